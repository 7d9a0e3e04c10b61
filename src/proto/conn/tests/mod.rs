//! Host tests for the pure connection state machines (client, agent, listener and the shared
//! established → disconnecting → draining → closed phase). Nothing here touches RDMA: every test
//! feeds [`Input`]s and checks the [`Action`]s and the resulting [`State`].
//!
//! Layout:
//! * `check` and friends: a tiny data-driven harness (inputs in, final state and the last
//!   input's actions out), behind many small tests.
//! * `spec` (in `spec.rs`, shared with the `state_machines` fuzz target): the documented
//!   outcome of any input in any state, written independently of the machines.
//!   `every_input_in_every_reachable_state_matches_spec` explores every state the machines can
//!   reach (breadth-first over the whole input alphabet) and compares each transition with it.
//! * `Tracker` (in `spec.rs`): life-long invariants (one `Closed`, one `Established`, deadlines
//!   never leaked, stale timeouts ignored, armed timeouts honoured), checked both exhaustively
//!   and over thousands of pseudo-random sequences.

use std::collections::VecDeque;
use std::fmt;

use super::spec::{closed, expected, proto, Tracker, ALL_STEPS, KNOWN_KINDS};
use super::{Action as A, Actions, Agent, Client, CloseReason, CmEventKind as K, Input, Listener, ListenerAction};
use super::{AsyncEventKind, State, Step};
use crate::proto::op::WcStatus;
use crate::proto::wire::{RejectCode, RejectReason};

/// A non-zero event status, to see that it is carried through unchanged.
const ST: i32 = -110;

// ------------------------------------------------------------------------------------------
// Harness
// ------------------------------------------------------------------------------------------

/// What agent and client have in common, so one test body can drive both.
trait Machine: Clone + fmt::Debug + PartialEq {
    const NAME: &'static str;
    fn start() -> (Self, Actions);
    fn feed(&mut self, input: Input) -> Actions;
    fn st(&self) -> &State;
    /// Inputs that take a fresh machine to `Established`.
    fn to_established() -> Vec<Input>;
    /// Named paths to each state before establishment (the empty path is the start state).
    fn early_paths() -> Vec<(&'static str, Vec<Input>)>;
}

impl Machine for Client {
    const NAME: &'static str = "client";
    fn start() -> (Self, Actions) {
        Client::resolving()
    }
    fn feed(&mut self, input: Input) -> Actions {
        self.on_input(input)
    }
    fn st(&self) -> &State {
        self.state()
    }
    fn to_established() -> Vec<Input> {
        vec![cm(K::AddrResolved), cm(K::RouteResolved), cm(K::Established)]
    }
    fn early_paths() -> Vec<(&'static str, Vec<Input>)> {
        vec![
            ("resolving address", vec![]),
            ("resolving route", vec![cm(K::AddrResolved)]),
            ("connecting", vec![cm(K::AddrResolved), cm(K::RouteResolved)]),
        ]
    }
}

impl Machine for Agent {
    const NAME: &'static str = "agent";
    fn start() -> (Self, Actions) {
        Agent::accepting()
    }
    fn feed(&mut self, input: Input) -> Actions {
        self.on_input(input)
    }
    fn st(&self) -> &State {
        self.state()
    }
    fn to_established() -> Vec<Input> {
        vec![cm(K::Established)]
    }
    fn early_paths() -> Vec<(&'static str, Vec<Input>)> {
        vec![("accepting", vec![])]
    }
}

fn cm(kind: K) -> Input {
    Input::Cm(kind, 0)
}

fn fresh<M: Machine>() -> M {
    M::start().0
}

/// Feeds `inputs` to `m`; returns the machine and the actions of the last input.
fn feed_all<M: Machine>(mut m: M, inputs: impl AsRef<[Input]>) -> (M, Vec<A>) {
    let mut last = Vec::new();
    for input in inputs.as_ref() {
        last = m.feed(input.clone()).into_vec();
    }
    (m, last)
}

/// Feeds `inputs` to `m`, asserts the final state and the actions the *last* input produced,
/// and returns the machine for the next step.
#[track_caller]
fn check<M: Machine>(m: M, inputs: impl AsRef<[Input]>, state: State, actions: &[A]) -> M {
    let inputs = inputs.as_ref();
    let (m, last) = feed_all(m, inputs);
    assert_eq!(m.st(), &state, "{}: state after {inputs:?}", M::NAME);
    assert_eq!(last, actions, "{}: actions of the last of {inputs:?}", M::NAME);
    m
}

/// A fresh machine taken to `Established`.
fn established<M: Machine>() -> M {
    check(fresh::<M>(), M::to_established(), State::Established, &[A::ClearDeadline, A::Established])
}

/// Named paths to every kind of state a machine can be in.
fn paths<M: Machine>() -> Vec<(&'static str, Vec<Input>)> {
    let est = M::to_established();
    let after = |tail: &[Input]| est.iter().chain(tail).cloned().collect::<Vec<_>>();
    let mut v = M::early_paths();
    v.extend([
        ("established", after(&[])),
        ("disconnecting (local)", after(&[Input::Close])),
        ("saying goodbye", after(&[Input::Finish(CloseReason::Local)])),
        ("disconnecting (farewell answered)", after(&[Input::Finish(CloseReason::Local), Input::Finished])),
        ("disconnecting (protocol)", after(&[cm(K::Established)])),
        ("draining (peer)", after(&[cm(K::Disconnected)])),
        ("draining (local)", after(&[Input::Close, cm(K::Disconnected)])),
        ("draining (disconnect timed out)", after(&[Input::Close, Input::Timeout(Step::Disconnect)])),
        ("closed early", vec![Input::Close]),
        ("closed after drain", after(&[Input::Close, cm(K::Disconnected), Input::Drained])),
        ("closed by device removal", after(&[cm(K::DeviceRemoval)])),
    ]);
    v
}

fn refused() -> RejectReason {
    RejectReason::new(RejectCode::Refused, "go away")
}

/// Generates `mod $name { fn client(); fn agent(); }` running the generic body for both.
macro_rules! both {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[test]
            fn client() {
                super::$name::<super::Client>();
            }
            #[test]
            fn agent() {
                super::$name::<super::Agent>();
            }
        }
    )*};
}

// ------------------------------------------------------------------------------------------
// The input alphabet
// ------------------------------------------------------------------------------------------

/// Every CM event kind (plus two unknown values).
fn all_kinds() -> Vec<K> {
    let mut v = KNOWN_KINDS.to_vec();
    v.extend([K::Unknown(999), K::Unknown(u32::MAX)]);
    v
}

/// Exhaustive on purpose: a new variant fails to compile here until `all_kinds` lists it.
fn kind_ordinal(k: K) -> usize {
    match k {
        K::AddrResolved => 0,
        K::AddrError => 1,
        K::RouteResolved => 2,
        K::RouteError => 3,
        K::ConnectRequest => 4,
        K::ConnectResponse => 5,
        K::ConnectError => 6,
        K::Unreachable => 7,
        K::Rejected => 8,
        K::Established => 9,
        K::Disconnected => 10,
        K::DeviceRemoval => 11,
        K::MulticastJoin => 12,
        K::MulticastError => 13,
        K::AddrChange => 14,
        K::TimewaitExit => 15,
        K::Unknown(_) => 16,
    }
}

fn all_steps() -> [Step; 7] {
    ALL_STEPS
}

/// Exhaustive on purpose, as `kind_ordinal`.
fn step_ordinal(s: Step) -> usize {
    match s {
        Step::ResolveAddr => 0,
        Step::ResolveRoute => 1,
        Step::Connect => 2,
        Step::Accept => 3,
        Step::Disconnect => 4,
        Step::Drain => 5,
        Step::Finish => 6,
    }
}

/// Every input the machines can be given: each CM event with status 0 and with `ST`, both
/// kinds of REJECTED, every timeout, and every user/reactor input.
fn alphabet() -> Vec<Input> {
    let mut v = Vec::new();
    for k in all_kinds() {
        v.push(Input::Cm(k, 0));
        v.push(Input::Cm(k, ST));
    }
    v.push(Input::Cm(K::Rejected, 28));
    v.push(Input::Cm(K::Rejected, 8));
    v.push(Input::Rejected { status: 28, reason: Some(refused()) });
    v.push(Input::Rejected { status: 8, reason: None });
    v.extend(all_steps().map(Input::Timeout));
    v.push(Input::Close);
    v.push(Input::Shutdown);
    v.push(Input::Finish(CloseReason::Local));
    v.push(Input::Finish(CloseReason::Shutdown));
    v.push(Input::Finished);
    v.push(Input::Drained);
    v.push(Input::WorkError(WcStatus::RetryExcErr));
    v.push(Input::WorkError(WcStatus::Unknown(77)));
    v.push(Input::SetupFailed("create qp: ENOMEM".into()));
    v.push(Input::Fault(CloseReason::AsyncEvent(AsyncEventKind::QpFatal)));
    v.push(Input::Abort(CloseReason::AsyncEvent(AsyncEventKind::CqErr)));
    v.push(Input::Abort(CloseReason::CqFailed { call: "ibv_poll_cq", errno: 5 }));
    v
}

/// Exhaustive on purpose: a new `Input` variant fails to compile here until `alphabet` has it.
fn input_ordinal(i: &Input) -> usize {
    match i {
        Input::Cm(..) => 0,
        Input::Rejected { .. } => 1,
        Input::Timeout(_) => 2,
        Input::Close => 3,
        Input::WorkError(_) => 4,
        Input::Drained => 5,
        Input::SetupFailed(_) => 6,
        Input::Shutdown => 7,
        Input::Fault(_) => 8,
        Input::Abort(_) => 9,
        Input::Finish(_) => 10,
        Input::Finished => 11,
    }
}

#[test]
fn alphabet_covers_every_variant() {
    let mut kinds = [false; 17];
    all_kinds().into_iter().for_each(|k| kinds[kind_ordinal(k)] = true);
    assert!(kinds.iter().all(|&b| b), "all_kinds misses a CmEventKind");
    let mut steps = [false; 7];
    all_steps().into_iter().for_each(|s| steps[step_ordinal(s)] = true);
    assert!(steps.iter().all(|&b| b), "all_steps misses a Step");
    let mut inputs = [false; 12];
    alphabet().iter().for_each(|i| inputs[input_ordinal(i)] = true);
    assert!(inputs.iter().all(|&b| b), "alphabet misses an Input variant");
}

// ------------------------------------------------------------------------------------------
// The specification (`spec.rs`): what any input does in any state
// ------------------------------------------------------------------------------------------

/// Asserts that feeding `input` to `m` does what `spec` says; returns the actions.
#[track_caller]
fn assert_spec<M: Machine>(m: &mut M, input: &Input, ctx: &dyn fmt::Display) -> Vec<A> {
    let before = m.st().clone();
    let got = m.feed(input.clone()).into_vec();
    let (state, actions) = expected(&before, input);
    assert_eq!(
        (m.st(), &got),
        (&state, &actions),
        "{}: {input:?} while {before:?} ({ctx}) -> (state, actions)",
        M::NAME
    );
    got
}

// ------------------------------------------------------------------------------------------
// Life-long invariants (`Tracker`, in `spec.rs`)
// ------------------------------------------------------------------------------------------

/// Feeds `input`, checks the tracker's invariants; panics with the whole history on failure.
fn tracked<M: Machine>(m: &mut M, t: &mut Tracker, input: &Input, history: &[Input]) {
    let before = m.st().clone();
    let actions = m.feed(input.clone());
    if let Err(e) = t.step(&before, input, &actions, m.st()) {
        panic!("{}: {e}\n  history: {history:?}\n  input: {input:?} while {before:?}", M::NAME);
    }
}

mod closing;
mod establishment;
mod exhaustive;
mod listener;
mod protocol_errors;
mod timeouts;
