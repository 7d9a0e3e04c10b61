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

// ------------------------------------------------------------------------------------------
// Client: happy path and each pre-establishment step
// ------------------------------------------------------------------------------------------

#[test]
fn client_starts_resolving_with_a_deadline() {
    let (c, first) = Client::resolving();
    assert_eq!(c.state(), &State::ResolvingAddr);
    assert_eq!(first.as_slice(), [A::SetDeadline(Step::ResolveAddr)]);
    assert!(!c.state().is_established() && !c.state().is_draining() && !c.state().is_closed());
}

#[test]
fn client_happy_path_step_by_step() {
    let c = fresh::<Client>();
    let c = check(
        c,
        &[cm(K::AddrResolved)],
        State::ResolvingRoute,
        &[A::ClearDeadline, A::ResolveRoute, A::SetDeadline(Step::ResolveRoute)],
    );
    let c = check(
        c,
        &[cm(K::RouteResolved)],
        State::Connecting,
        &[A::ClearDeadline, A::Connect, A::SetDeadline(Step::Connect)],
    );
    let c = check(c, &[cm(K::Established)], State::Established, &[A::ClearDeadline, A::Established]);
    assert!(c.state().is_established());
    let c = check(
        c,
        &[Input::Close],
        State::Disconnecting(CloseReason::Local),
        &[A::Disconnect, A::SetDeadline(Step::Disconnect)],
    );
    let c = check(
        c,
        &[cm(K::Disconnected)],
        State::Draining(CloseReason::Local),
        &[A::ClearDeadline, A::SetDeadline(Step::Drain)],
    );
    assert!(c.state().is_draining());
    let c = check(c, &[Input::Drained], State::Closed, &closed(CloseReason::Local));
    assert!(c.state().is_closed());
}

#[test]
fn client_happy_path_ends_with_a_clean_close() {
    let c = established::<Client>();
    let (_, last) = feed_all(c, &[Input::Close, cm(K::Disconnected), Input::Drained]);
    match last.as_slice() {
        [A::ClearDeadline, A::Closed(r)] => assert!(r.is_clean()),
        other => panic!("{other:?}"),
    }
}

#[test]
fn client_peer_disconnect() {
    let c = check(
        established::<Client>(),
        &[cm(K::Disconnected)],
        State::Draining(CloseReason::Peer),
        &[A::Disconnect, A::SetDeadline(Step::Drain)],
    );
    check(c, &[Input::Drained], State::Closed, &closed(CloseReason::Peer));
}

#[test]
fn client_addr_error_carries_status() {
    check(fresh::<Client>(), &[Input::Cm(K::AddrError, ST)], State::Closed, &closed(CloseReason::AddrError(ST)));
}

#[test]
fn client_route_error_carries_status() {
    let inputs = [cm(K::AddrResolved), Input::Cm(K::RouteError, ST)];
    check(fresh::<Client>(), &inputs, State::Closed, &closed(CloseReason::RouteError(ST)));
}

#[test]
fn client_connect_error_carries_status() {
    let inputs = [cm(K::AddrResolved), cm(K::RouteResolved), Input::Cm(K::ConnectError, ST)];
    check(fresh::<Client>(), &inputs, State::Closed, &closed(CloseReason::ConnectError(ST)));
}

#[test]
fn client_unreachable_carries_status() {
    let inputs = [cm(K::AddrResolved), cm(K::RouteResolved), Input::Cm(K::Unreachable, ST)];
    check(fresh::<Client>(), &inputs, State::Closed, &closed(CloseReason::Unreachable(ST)));
}

#[test]
fn client_cm_rejected_consumer_reject() {
    let inputs = [cm(K::AddrResolved), cm(K::RouteResolved), Input::Cm(K::Rejected, 28)];
    let want = CloseReason::Rejected { status: 28, reason: None };
    check(fresh::<Client>(), &inputs, State::Closed, &closed(want));
}

#[test]
fn client_cm_rejected_nothing_listening() {
    let inputs = [cm(K::AddrResolved), cm(K::RouteResolved), Input::Cm(K::Rejected, 8)];
    let want = CloseReason::Rejected { status: 8, reason: None };
    assert_eq!(want.to_string(), "rejected: nothing listens on that port (status 8)");
    check(fresh::<Client>(), &inputs, State::Closed, &closed(want));
}

#[test]
fn client_rejected_with_decoded_reason() {
    let inputs = [cm(K::AddrResolved), cm(K::RouteResolved), Input::Rejected { status: 28, reason: Some(refused()) }];
    let want = CloseReason::Rejected { status: 28, reason: Some(refused()) };
    assert_eq!(want.to_string(), "rejected by the server (status 28): refused by the application: go away");
    assert!(!want.is_clean());
    check(fresh::<Client>(), &inputs, State::Closed, &closed(want));
}

#[test]
fn client_rejected_without_decoded_reason() {
    let inputs = [cm(K::AddrResolved), cm(K::RouteResolved), Input::Rejected { status: 28, reason: None }];
    let want = CloseReason::Rejected { status: 28, reason: None };
    check(fresh::<Client>(), &inputs, State::Closed, &closed(want));
}

// ------------------------------------------------------------------------------------------
// Agent: happy paths and failures while accepting
// ------------------------------------------------------------------------------------------

#[test]
fn agent_starts_accepting_with_a_deadline() {
    let (a, first) = Agent::accepting();
    assert_eq!(a.state(), &State::Accepting);
    assert_eq!(first.as_slice(), [A::SetDeadline(Step::Accept)]);
}

#[test]
fn agent_happy_path_peer_disconnects() {
    let a = check(fresh::<Agent>(), &[cm(K::Established)], State::Established, &[A::ClearDeadline, A::Established]);
    let a = check(
        a,
        &[cm(K::Disconnected)],
        State::Draining(CloseReason::Peer),
        &[A::Disconnect, A::SetDeadline(Step::Drain)],
    );
    check(a, &[Input::Drained], State::Closed, &closed(CloseReason::Peer));
}

#[test]
fn agent_happy_path_local_close() {
    let a = check(
        established::<Agent>(),
        &[Input::Close],
        State::Disconnecting(CloseReason::Local),
        &[A::Disconnect, A::SetDeadline(Step::Disconnect)],
    );
    let a = check(
        a,
        &[cm(K::Disconnected)],
        State::Draining(CloseReason::Local),
        &[A::ClearDeadline, A::SetDeadline(Step::Drain)],
    );
    check(a, &[Input::Drained], State::Closed, &closed(CloseReason::Local));
}

#[test]
fn agent_disconnected_while_accepting_is_a_peer_close() {
    check(fresh::<Agent>(), &[cm(K::Disconnected)], State::Closed, &closed(CloseReason::Peer));
}

#[test]
fn agent_connect_error_carries_status() {
    check(fresh::<Agent>(), &[Input::Cm(K::ConnectError, ST)], State::Closed, &closed(CloseReason::ConnectError(ST)));
}

#[test]
fn agent_unreachable_carries_status() {
    check(fresh::<Agent>(), &[Input::Cm(K::Unreachable, ST)], State::Closed, &closed(CloseReason::Unreachable(ST)));
}

#[test]
fn agent_cm_rejected_carries_status() {
    let want = CloseReason::Rejected { status: 28, reason: None };
    check(fresh::<Agent>(), &[Input::Cm(K::Rejected, 28)], State::Closed, &closed(want));
}

#[test]
fn agent_rejected_with_decoded_reason() {
    let input = Input::Rejected { status: 28, reason: Some(refused()) };
    let want = CloseReason::Rejected { status: 28, reason: Some(refused()) };
    check(fresh::<Agent>(), &[input], State::Closed, &closed(want));
}

// ------------------------------------------------------------------------------------------
// Protocol errors
// ------------------------------------------------------------------------------------------

#[test]
fn protocol_message_names_the_event_and_the_state() {
    let (_, last) = feed_all(fresh::<Client>(), &[cm(K::RouteResolved)]);
    assert_eq!(last, closed(CloseReason::Protocol("unexpected Cm(RouteResolved, 0) while resolving address".into())));
    let (a, _) = feed_all(established::<Agent>(), &[Input::Cm(K::Unknown(999), 5)]);
    assert_eq!(
        a.state(),
        &State::Disconnecting(CloseReason::Protocol("unexpected Cm(Unknown(999), 5) while established".into()))
    );
}

#[test]
fn client_route_resolved_while_resolving_addr() {
    let i = cm(K::RouteResolved);
    check(fresh::<Client>(), [i.clone()], State::Closed, &closed(proto(&State::ResolvingAddr, &i)));
}

#[test]
fn client_addr_resolved_twice() {
    let i = cm(K::AddrResolved);
    check(fresh::<Client>(), &[i.clone(), i.clone()], State::Closed, &closed(proto(&State::ResolvingRoute, &i)));
}

#[test]
fn client_connect_request_in_every_early_state() {
    let i = cm(K::ConnectRequest);
    for (name, path) in Client::early_paths() {
        let (c, _) = feed_all(fresh::<Client>(), &path);
        let before = c.state().clone();
        let (c, last) = feed_all(c, [i.clone()]);
        assert_eq!((c.state(), last), (&State::Closed, closed(proto(&before, &i)).to_vec()), "{name}");
    }
}

#[test]
fn client_connect_response_while_connecting() {
    let i = cm(K::ConnectResponse);
    let path = [cm(K::AddrResolved), cm(K::RouteResolved), i.clone()];
    check(fresh::<Client>(), &path, State::Closed, &closed(proto(&State::Connecting, &i)));
}

#[test]
fn client_disconnected_while_connecting() {
    // Unlike the agent (whose peer may leave before its RTU), a client has no DISCONNECTED
    // before ESTABLISHED.
    let i = cm(K::Disconnected);
    let path = [cm(K::AddrResolved), cm(K::RouteResolved), i.clone()];
    check(fresh::<Client>(), &path, State::Closed, &closed(proto(&State::Connecting, &i)));
}

#[test]
fn client_rejected_before_connecting() {
    let i = Input::Rejected { status: 28, reason: Some(refused()) };
    check(fresh::<Client>(), [i.clone()], State::Closed, &closed(proto(&State::ResolvingAddr, &i)));
    let i = Input::Cm(K::Rejected, 28);
    let path = [cm(K::AddrResolved), i.clone()];
    check(fresh::<Client>(), &path, State::Closed, &closed(proto(&State::ResolvingRoute, &i)));
}

#[test]
fn client_unknown_event_before_establishment() {
    let i = Input::Cm(K::Unknown(999), 0);
    check(fresh::<Client>(), [i.clone()], State::Closed, &closed(proto(&State::ResolvingAddr, &i)));
}

#[test]
fn agent_connect_request_while_accepting() {
    let i = cm(K::ConnectRequest);
    check(fresh::<Agent>(), [i.clone()], State::Closed, &closed(proto(&State::Accepting, &i)));
}

#[test]
fn agent_client_only_events_while_accepting() {
    for k in [K::AddrResolved, K::AddrError, K::RouteResolved, K::RouteError, K::ConnectResponse, K::Unknown(999)] {
        let i = Input::Cm(k, ST);
        check(fresh::<Agent>(), [i.clone()], State::Closed, &closed(proto(&State::Accepting, &i)));
    }
}

/// An impossible event while established disconnects first and closes after the drain.
fn protocol_error_while_established_drains_first<M: Machine>() {
    for k in [K::Established, K::AddrResolved, K::ConnectRequest, K::ConnectResponse, K::Rejected, K::Unknown(999)] {
        let i = cm(k);
        let reason = proto(&State::Established, &i);
        let m = check(
            established::<M>(),
            &[i],
            State::Disconnecting(reason.clone()),
            &[A::Disconnect, A::SetDeadline(Step::Disconnect)],
        );
        let m = check(
            m,
            &[cm(K::Disconnected)],
            State::Draining(reason.clone()),
            &[A::ClearDeadline, A::SetDeadline(Step::Drain)],
        );
        let m = check(m, &[Input::Drained], State::Closed, &closed(reason));
        assert!(!feed_all(m, &[Input::Close]).1.iter().any(|a| matches!(a, A::Closed(_))));
    }
}

/// A second ESTABLISHED is a protocol error; the handler hears Established only once.
fn established_twice<M: Machine>() {
    let mut path = M::to_established();
    path.push(cm(K::Established));
    let (m, last) = feed_all(fresh::<M>(), &path);
    assert_eq!(last, [A::Disconnect, A::SetDeadline(Step::Disconnect)]);
    assert_eq!(m.st(), &State::Disconnecting(proto(&State::Established, &cm(K::Established))));
}

/// A REJECTED (decoded) after establishment is a protocol error too.
fn rejected_after_established<M: Machine>() {
    let i = Input::Rejected { status: 28, reason: None };
    check(
        established::<M>(),
        [i.clone()],
        State::Disconnecting(proto(&State::Established, &i)),
        &[A::Disconnect, A::SetDeadline(Step::Disconnect)],
    );
}

/// While closing, an impossible event closes at once with the Protocol reason: no drain, and
/// the reason the close started with (here Local or Peer) is replaced. This pins today's
/// behaviour (`Phase::unexpected` only disconnects from `Established`); unlike a protocol
/// error while established, the reactor gets `Closed` with work requests possibly outstanding.
fn protocol_error_while_closing_closes_at_once<M: Machine>() {
    let est = M::to_established();
    for tail in [vec![Input::Close], vec![Input::Close, cm(K::Disconnected)], vec![cm(K::Disconnected)]] {
        let (m, _) = feed_all(fresh::<M>(), [est.clone(), tail].concat());
        let before = m.st().clone();
        let i = cm(K::Established);
        check(m, [i.clone()], State::Closed, &closed(proto(&before, &i)));
    }
}

both!(
    protocol_error_while_established_drains_first,
    established_twice,
    rejected_after_established,
    protocol_error_while_closing_closes_at_once,
);

/// Fault issue, defect 9: UNREACHABLE on an established connection was "Protocol".
fn unreachable_while_established_is_unreachable<M: Machine>() {
    let m = established::<M>();
    let m = check(
        m,
        [Input::Cm(K::Unreachable, ST)],
        State::Disconnecting(CloseReason::Unreachable(ST)),
        &[A::Disconnect, A::SetDeadline(Step::Disconnect)],
    );
    let (m, acts) = feed_all(m, [Input::Cm(K::Unreachable, ST)]);
    assert!(acts.is_empty(), "a second one while disconnecting is ignored");
    let inputs = [cm(K::Disconnected), Input::Drained];
    check(m, inputs, State::Closed, &closed(CloseReason::Unreachable(ST)));
}
both!(unreachable_while_established_is_unreachable);

#[test]
fn client_addr_resolved_after_established() {
    let i = cm(K::AddrResolved);
    check(
        established::<Client>(),
        [i.clone()],
        State::Disconnecting(proto(&State::Established, &i)),
        &[A::Disconnect, A::SetDeadline(Step::Disconnect)],
    );
}

// ------------------------------------------------------------------------------------------
// Timeouts
// ------------------------------------------------------------------------------------------

#[test]
fn client_timeout_of_each_early_step_closes() {
    let steps = [Step::ResolveAddr, Step::ResolveRoute, Step::Connect];
    for ((name, path), step) in Client::early_paths().into_iter().zip(steps) {
        let (c, _) = feed_all(fresh::<Client>(), &path);
        let (c, last) = feed_all(c, &[Input::Timeout(step)]);
        assert_eq!((c.state(), last), (&State::Closed, closed(CloseReason::Timeout(step)).to_vec()), "{name}");
    }
}

#[test]
fn client_stale_timeouts_of_earlier_steps_are_ignored() {
    let c =
        check(fresh::<Client>(), &[cm(K::AddrResolved), Input::Timeout(Step::ResolveAddr)], State::ResolvingRoute, &[]);
    let c = check(c, &[cm(K::RouteResolved), Input::Timeout(Step::ResolveAddr)], State::Connecting, &[]);
    let c = check(c, &[Input::Timeout(Step::ResolveRoute)], State::Connecting, &[]);
    let c = check(c, &[cm(K::Established), Input::Timeout(Step::Connect)], State::Established, &[]);
    check(c, &[Input::Timeout(Step::ResolveRoute)], State::Established, &[]);
}

#[test]
fn client_timeouts_of_other_roles_steps_are_ignored() {
    for s in [Step::Accept, Step::Disconnect, Step::Drain] {
        check(fresh::<Client>(), &[Input::Timeout(s)], State::ResolvingAddr, &[]);
    }
}

#[test]
fn agent_accept_timeout_closes() {
    check(
        fresh::<Agent>(),
        &[Input::Timeout(Step::Accept)],
        State::Closed,
        &closed(CloseReason::Timeout(Step::Accept)),
    );
}

#[test]
fn agent_other_timeouts_while_accepting_are_ignored() {
    for s in [Step::ResolveAddr, Step::ResolveRoute, Step::Connect, Step::Disconnect, Step::Drain] {
        check(fresh::<Agent>(), &[Input::Timeout(s)], State::Accepting, &[]);
    }
}

#[test]
fn agent_stale_accept_timeout_after_established_is_ignored() {
    check(established::<Agent>(), &[Input::Timeout(Step::Accept)], State::Established, &[]);
}

#[test]
fn timeout_display() {
    assert_eq!(CloseReason::Timeout(Step::Connect).to_string(), "connect timed out");
    assert_eq!(CloseReason::Timeout(Step::ResolveAddr).to_string(), "address resolution timed out");
    assert_eq!(Step::Drain.to_string(), "drain");
}

/// A disconnect that never completes moves on to draining, keeping the reason.
fn disconnect_timeout_moves_to_draining<M: Machine>() {
    let m = check(
        established::<M>(),
        &[Input::Close, Input::Timeout(Step::Disconnect)],
        State::Draining(CloseReason::Local),
        &[A::SetDeadline(Step::Drain)],
    );
    // DISCONNECTED arriving late while draining is ignored.
    let m = check(m, &[cm(K::Disconnected)], State::Draining(CloseReason::Local), &[]);
    check(m, &[Input::Drained], State::Closed, &closed(CloseReason::Local));
}

/// A drain that never completes closes with the reason the close started with.
fn drain_timeout_closes_with_the_original_reason<M: Machine>() {
    let cases = [
        (vec![Input::Close], CloseReason::Local),
        (vec![Input::Shutdown], CloseReason::Shutdown),
        (vec![Input::WorkError(WcStatus::RemAccessErr)], CloseReason::WorkError(WcStatus::RemAccessErr)),
        (vec![cm(K::Established)], proto(&State::Established, &cm(K::Established))),
        (vec![], CloseReason::Peer),
    ];
    for (tail, reason) in cases {
        let path = [M::to_established(), tail, vec![cm(K::Disconnected)]].concat();
        let (m, _) = feed_all(fresh::<M>(), &path);
        assert_eq!(m.st(), &State::Draining(reason.clone()));
        check(m, &[Input::Timeout(Step::Drain)], State::Closed, &closed(reason));
    }
}

/// Stale deadlines while closing: a drain deadline while disconnecting and a disconnect
/// deadline while draining mean nothing.
fn stale_timeouts_while_closing_are_ignored<M: Machine>() {
    let m = established::<M>();
    let m = check(m, &[Input::Close, Input::Timeout(Step::Drain)], State::Disconnecting(CloseReason::Local), &[]);
    let m =
        check(m, &[cm(K::Disconnected), Input::Timeout(Step::Disconnect)], State::Draining(CloseReason::Local), &[]);
    for s in all_steps().into_iter().filter(|&s| s != Step::Drain) {
        check(m.clone(), &[Input::Timeout(s)], State::Draining(CloseReason::Local), &[]);
    }
}

/// The close handshake: our farewell, then the peer's answer (or the deadline) lets us
/// disconnect; the peer disconnecting first ends it; the reason is the one it started with.
fn the_close_handshake_disconnects_once_answered<M: Machine>() {
    for reason in [CloseReason::Local, CloseReason::Shutdown] {
        let finishing = State::Finishing(reason.clone());
        let m = check(
            established::<M>(),
            &[Input::Finish(reason.clone())],
            finishing.clone(),
            &[A::SendFarewell, A::SetDeadline(Step::Finish)],
        );
        // A second close, a stray deadline, a drain: nothing.
        for i in [Input::Close, Input::Shutdown, Input::Finish(CloseReason::Local), Input::Timeout(Step::Disconnect)] {
            check(m.clone(), [i], finishing.clone(), &[]);
        }
        let disconnecting = State::Disconnecting(reason.clone());
        let go = [A::Disconnect, A::SetDeadline(Step::Disconnect)];
        let answered = check(m.clone(), &[Input::Finished], disconnecting.clone(), &go);
        check(m.clone(), &[Input::Timeout(Step::Finish)], disconnecting, &go);
        let path = [cm(K::Disconnected), Input::Drained];
        check(answered, &path, State::Closed, &closed(reason.clone()));
        // The peer leaves first: draining, still for our reason.
        let m = check(
            m,
            &[cm(K::Disconnected)],
            State::Draining(reason.clone()),
            &[A::Disconnect, A::SetDeadline(Step::Drain)],
        );
        check(m, &[Input::Drained], State::Closed, &closed(reason));
    }
    // An answer nobody asked for, and a farewell before establishment (a plain close).
    check(established::<M>(), &[Input::Finished], State::Established, &[]);
    let m = check(fresh::<M>(), &[Input::Finish(CloseReason::Local)], State::Closed, &closed(CloseReason::Local));
    check(m, &[Input::Finished], State::Closed, &[]);
    // Failures while saying goodbye disconnect for their own reason.
    let m = check(
        established::<M>(),
        &[Input::Finish(CloseReason::Local)],
        State::Finishing(CloseReason::Local),
        &[A::SendFarewell, A::SetDeadline(Step::Finish)],
    );
    let w = CloseReason::WorkError(WcStatus::RetryExcErr);
    check(
        m.clone(),
        &[Input::WorkError(WcStatus::RetryExcErr)],
        State::Disconnecting(w),
        &[A::Disconnect, A::SetDeadline(Step::Disconnect)],
    );
    check(
        m,
        &[cm(K::Unreachable)],
        State::Disconnecting(CloseReason::Unreachable(0)),
        &[A::Disconnect, A::SetDeadline(Step::Disconnect)],
    );
}

both!(
    the_close_handshake_disconnects_once_answered,
    disconnect_timeout_moves_to_draining,
    drain_timeout_closes_with_the_original_reason,
    stale_timeouts_while_closing_are_ignored
);

// ------------------------------------------------------------------------------------------
// Work errors, close, shutdown, setup failures, drained
// ------------------------------------------------------------------------------------------

/// A work error while established disconnects and closes with that status after the drain.
fn work_error_while_established<M: Machine>() {
    let w = WcStatus::RetryExcErr;
    let m = check(
        established::<M>(),
        &[Input::WorkError(w)],
        State::Disconnecting(CloseReason::WorkError(w)),
        &[A::Disconnect, A::SetDeadline(Step::Disconnect)],
    );
    // The flushes and errors that follow change nothing.
    let m = check(m, &[Input::WorkError(WcStatus::FatalErr)], State::Disconnecting(CloseReason::WorkError(w)), &[]);
    let m = check(
        m,
        &[cm(K::Disconnected)],
        State::Draining(CloseReason::WorkError(w)),
        &[A::ClearDeadline, A::SetDeadline(Step::Drain)],
    );
    let m = check(m, &[Input::WorkError(WcStatus::GeneralErr)], State::Draining(CloseReason::WorkError(w)), &[]);
    let m = check(m, &[Input::Drained], State::Closed, &closed(CloseReason::WorkError(w)));
    assert!(feed_all(m, &[Input::WorkError(w)]).1.is_empty());
}

/// A work error does not override a close already under way.
fn work_error_while_closing_is_ignored<M: Machine>() {
    let w = Input::WorkError(WcStatus::LocProtErr);
    let m = check(established::<M>(), &[Input::Close, w.clone()], State::Disconnecting(CloseReason::Local), &[]);
    check(m, &[cm(K::Disconnected), w.clone(), Input::Drained], State::Closed, &closed(CloseReason::Local));
    let m = check(established::<M>(), &[cm(K::Disconnected), w], State::Draining(CloseReason::Peer), &[]);
    check(m, &[Input::Drained], State::Closed, &closed(CloseReason::Peer));
}

/// Close while established, then again at every later stage: only the first one acts.
fn close_is_idempotent<M: Machine>() {
    let m = check(
        established::<M>(),
        &[Input::Close],
        State::Disconnecting(CloseReason::Local),
        &[A::Disconnect, A::SetDeadline(Step::Disconnect)],
    );
    let m = check(m, &[Input::Close], State::Disconnecting(CloseReason::Local), &[]);
    let m = check(m, &[cm(K::Disconnected), Input::Close], State::Draining(CloseReason::Local), &[]);
    let m = check(m, &[Input::Drained], State::Closed, &closed(CloseReason::Local));
    check(m, &[Input::Close], State::Closed, &[]);
}

/// Close before establishment closes at once; a second close does nothing.
fn close_before_established<M: Machine>() {
    for (name, path) in M::early_paths() {
        let (m, _) = feed_all(fresh::<M>(), &path);
        let (m, last) = feed_all(m, &[Input::Close]);
        assert_eq!((m.st(), last), (&State::Closed, closed(CloseReason::Local).to_vec()), "{name}");
        assert!(feed_all(m, &[Input::Close]).1.is_empty(), "{name}");
    }
}

/// Shutdown: disconnects when established, closes at once before, ignored while closing.
fn shutdown<M: Machine>() {
    let m = check(
        established::<M>(),
        &[Input::Shutdown],
        State::Disconnecting(CloseReason::Shutdown),
        &[A::Disconnect, A::SetDeadline(Step::Disconnect)],
    );
    let m = check(m, &[Input::Close, Input::Shutdown], State::Disconnecting(CloseReason::Shutdown), &[]);
    let m = check(m, &[cm(K::Disconnected), Input::Drained], State::Closed, &closed(CloseReason::Shutdown));
    assert!(CloseReason::Shutdown.is_clean());
    assert!(feed_all(m, &[Input::Shutdown]).1.is_empty());
    for (name, path) in M::early_paths() {
        let (m, last) = feed_all(fresh::<M>(), [path, vec![Input::Shutdown]].concat());
        assert_eq!((m.st(), last), (&State::Closed, closed(CloseReason::Shutdown).to_vec()), "{name}");
    }
    // Close first, shutdown later: the reason stays Local.
    let (m, _) = feed_all(established::<M>(), &[Input::Close, Input::Shutdown]);
    assert_eq!(m.st(), &State::Disconnecting(CloseReason::Local));
}

/// A failed verb before establishment closes with `Setup`.
fn setup_failed_before_established<M: Machine>() {
    for (name, path) in M::early_paths() {
        let (m, _) = feed_all(fresh::<M>(), &path);
        let (m, last) = feed_all(m, &[Input::SetupFailed("ibv_create_qp: ENOMEM".into())]);
        let want = closed(CloseReason::Setup("ibv_create_qp: ENOMEM".into()));
        assert_eq!((m.st(), last), (&State::Closed, want.to_vec()), "{name}");
    }
    assert_eq!(CloseReason::Setup("x".into()).to_string(), "setup failed: x");
}

/// A failed `rdma_disconnect` (the only verb asked for while closing) changes nothing: the
/// deadline still runs.
fn setup_failed_while_closing_is_ignored<M: Machine>() {
    let f = Input::SetupFailed("rdma_disconnect: EIO".into());
    let m = check(established::<M>(), &[Input::Close, f.clone()], State::Disconnecting(CloseReason::Local), &[]);
    check(m, &[cm(K::Disconnected), f.clone()], State::Draining(CloseReason::Local), &[]);
    check(established::<M>(), &[cm(K::Disconnected), f], State::Draining(CloseReason::Peer), &[]);
}

/// The machines ask for no verb while established, so a SetupFailed then is a protocol error.
fn setup_failed_while_established_is_protocol<M: Machine>() {
    let f = Input::SetupFailed("late".into());
    check(
        established::<M>(),
        [f.clone()],
        State::Disconnecting(proto(&State::Established, &f)),
        &[A::Disconnect, A::SetDeadline(Step::Disconnect)],
    );
}

/// A work error before establishment (e.g. a first receive failing) closes at once.
fn work_error_before_established<M: Machine>() {
    for (name, path) in M::early_paths() {
        let (m, last) = feed_all(fresh::<M>(), [path, vec![Input::WorkError(WcStatus::LocLenErr)]].concat());
        let want = closed(CloseReason::WorkError(WcStatus::LocLenErr));
        assert_eq!((m.st(), last), (&State::Closed, want.to_vec()), "{name}");
    }
}

/// `Drained` only means something while draining.
fn drained_outside_draining_is_ignored<M: Machine>() {
    for (name, path) in paths::<M>() {
        let (m, _) = feed_all(fresh::<M>(), &path);
        if m.st().is_draining() {
            continue;
        }
        let before = m.st().clone();
        let (m, last) = feed_all(m, &[Input::Drained]);
        assert_eq!((m.st(), last), (&before, vec![]), "{name}");
    }
}

both!(
    work_error_while_established,
    work_error_while_closing_is_ignored,
    close_is_idempotent,
    close_before_established,
    shutdown,
    setup_failed_before_established,
    setup_failed_while_closing_is_ignored,
    setup_failed_while_established_is_protocol,
    work_error_before_established,
    drained_outside_draining_is_ignored,
);

// ------------------------------------------------------------------------------------------
// Inputs in every state
// ------------------------------------------------------------------------------------------

/// DEVICE_REMOVAL closes from every open state, exactly once; nothing after.
fn device_removal_in_every_state<M: Machine>() {
    for (name, path) in paths::<M>() {
        let (m, _) = feed_all(fresh::<M>(), &path);
        let was_closed = m.st().is_closed();
        let (m, last) = feed_all(m, &[Input::Cm(K::DeviceRemoval, ST)]);
        let want = if was_closed { vec![] } else { closed(CloseReason::DeviceRemoval).to_vec() };
        assert_eq!((m.st(), last), (&State::Closed, want), "{name}");
        assert!(feed_all(m, &[cm(K::DeviceRemoval)]).1.is_empty(), "{name}: second removal");
    }
}

/// TIMEWAIT_EXIT and ADDR_CHANGE never do anything.
fn timewait_exit_and_addr_change_ignored_everywhere<M: Machine>() {
    for (name, path) in paths::<M>() {
        let (m, _) = feed_all(fresh::<M>(), &path);
        let ignored =
            [cm(K::TimewaitExit), cm(K::AddrChange), Input::Cm(K::TimewaitExit, ST), Input::Cm(K::AddrChange, ST)];
        for input in ignored {
            let (m2, last) = feed_all(m.clone(), [input.clone()]);
            assert_eq!((m2.st(), last), (m.st(), vec![]), "{name}: {input:?}");
        }
    }
}

/// Once closed, however it got there, every input is ignored.
fn closed_ignores_everything<M: Machine>() {
    let mut n = 0;
    for (name, path) in paths::<M>() {
        let (m, _) = feed_all(fresh::<M>(), &path);
        if !m.st().is_closed() {
            continue;
        }
        n += 1;
        for input in alphabet() {
            let (m2, last) = feed_all(m.clone(), [input.clone()]);
            assert_eq!((m2.st(), last), (&State::Closed, vec![]), "{name}: {input:?}");
        }
    }
    assert_eq!(n, 3);
}

/// Every CM event kind (both statuses) in every named state, against the spec.
fn every_cm_event_in_every_named_state<M: Machine>() {
    for (name, path) in paths::<M>() {
        let (m, _) = feed_all(fresh::<M>(), &path);
        for k in all_kinds() {
            for s in [0, ST, 28] {
                assert_spec(&mut m.clone(), &Input::Cm(k, s), &name);
            }
        }
    }
}

both!(
    device_removal_in_every_state,
    timewait_exit_and_addr_change_ignored_everywhere,
    closed_ignores_everything,
    every_cm_event_in_every_named_state,
);

// ------------------------------------------------------------------------------------------
// Exhaustive exploration and random sequences
// ------------------------------------------------------------------------------------------

/// Breadth-first over every (machine, history) pair reachable with the whole alphabet: each
/// transition must match `spec` and keep the tracker's invariants. Returns the number of
/// distinct pairs seen and the state kinds reached.
fn explore<M: Machine>() -> (usize, Vec<&'static str>) {
    let (m, first) = M::start();
    let t = Tracker::new(&first);
    let mut seen = vec![(m.clone(), t.clone())];
    let mut queue = VecDeque::from([(m, t, Vec::<Input>::new())]);
    let mut kinds = Vec::new();
    let alphabet = alphabet();
    while let Some((m, t, path)) = queue.pop_front() {
        let kind = m.st().name();
        if !kinds.contains(&kind) {
            kinds.push(kind);
        }
        for input in &alphabet {
            let (mut m2, mut t2) = (m.clone(), t.clone());
            let before = m2.st().clone();
            let actions = assert_spec(&mut m2, input, &format_args!("after {path:?}"));
            if let Err(e) = t2.step(&before, input, &actions, m2.st()) {
                panic!("{}: {e}\n  history: {path:?}\n  input: {input:?}", M::NAME);
            }
            if !seen.contains(&(m2.clone(), t2.clone())) {
                seen.push((m2.clone(), t2.clone()));
                let mut p = path.clone();
                p.push(input.clone());
                queue.push_back((m2, t2, p));
            }
        }
    }
    (seen.len(), kinds)
}

#[test]
fn every_input_in_every_reachable_state_matches_spec_client() {
    let (n, mut kinds) = explore::<Client>();
    kinds.sort_unstable();
    let mut want = [
        "resolving address",
        "resolving route",
        "connecting",
        "established",
        "saying goodbye",
        "disconnecting",
        "draining",
        "closed",
    ];
    want.sort_unstable();
    assert_eq!(kinds, want);
    assert!(n > 50, "only {n} states explored");
}

#[test]
fn every_input_in_every_reachable_state_matches_spec_agent() {
    let (n, mut kinds) = explore::<Agent>();
    kinds.sort_unstable();
    let mut want = ["accepting", "established", "saying goodbye", "disconnecting", "draining", "closed"];
    want.sort_unstable();
    assert_eq!(kinds, want);
    assert!(n > 50, "only {n} states explored");
}

/// xorshift64*: deterministic, dependency-free.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// What rdma_cm, the user or the reactor would plausibly send next in `state`, so that random
/// walks get past establishment and through the closing states instead of dying early.
fn plausible(state: &State) -> Vec<Input> {
    match state {
        State::ResolvingAddr => vec![cm(K::AddrResolved)],
        State::ResolvingRoute => vec![cm(K::RouteResolved), Input::Timeout(Step::ResolveAddr)],
        State::Connecting | State::Accepting => vec![cm(K::Established)],
        State::Established => vec![
            cm(K::Disconnected),
            Input::Close,
            Input::Shutdown,
            Input::Finish(CloseReason::Local),
            Input::WorkError(WcStatus::RemOpErr),
            Input::Timeout(Step::Connect),
            Input::Timeout(Step::Accept),
        ],
        State::Finishing(_) => vec![
            Input::Finished,
            Input::Timeout(Step::Finish),
            cm(K::Disconnected),
            Input::Close,
            Input::Timeout(Step::Disconnect),
        ],
        State::Disconnecting(_) => vec![
            cm(K::Disconnected),
            Input::Timeout(Step::Disconnect),
            Input::WorkError(WcStatus::WrFlushErr),
            Input::Close,
        ],
        State::Draining(_) => vec![Input::Drained, Input::Timeout(Step::Drain), cm(K::TimewaitExit)],
        State::Closed => vec![Input::Close, Input::Drained],
    }
}

fn random_sequences<M: Machine>(seed: u64) {
    let all = alphabet();
    let mut rng = Rng(seed);
    let (mut established, mut draining, mut drained) = (0, 0, 0);
    for _ in 0..4000 {
        let (mut m, first) = M::start();
        let mut t = Tracker::new(&first);
        let mut history = Vec::new();
        let (mut saw_established, mut saw_draining) = (false, false);
        for _ in 0..1 + rng.below(40) {
            // Three times in four something plausible, otherwise anything at all.
            let input = if rng.below(4) == 0 {
                all[rng.below(all.len())].clone()
            } else {
                let p = plausible(m.st());
                p[rng.below(p.len())].clone()
            };
            let before = m.st().clone();
            tracked(&mut m, &mut t, &input, &history);
            history.push(input.clone());
            saw_established |= m.st().is_established();
            saw_draining |= m.st().is_draining();
            drained += usize::from(before.is_draining() && m.st().is_closed() && input == Input::Drained);
        }
        established += usize::from(saw_established);
        draining += usize::from(saw_draining);
        // Whatever happened, the lifecycle counters stay within bounds.
        assert!(t.disconnects <= 1 && t.resolve_routes <= 1 && t.connects <= 1);
        assert_eq!(t.closed, m.st().is_closed());
    }
    // Not vacuous: many walks got into the interesting states.
    assert!(established > 1000, "{established} walks reached Established");
    assert!(draining > 500, "{draining} walks reached Draining");
    assert!(drained > 200, "{drained} walks closed after a drain");
}

#[test]
fn random_sequences_keep_invariants_client() {
    random_sequences::<Client>(0x9e37_79b9_7f4a_7c15);
}

#[test]
fn random_sequences_keep_invariants_agent() {
    random_sequences::<Agent>(0xdead_beef_cafe_f00d);
}

#[test]
fn tracker_catches_a_leaked_deadline() {
    // The harness itself: a Closed batch without ClearDeadline after a SetDeadline must fail.
    let mut t = Tracker::new(&[A::SetDeadline(Step::Connect)]);
    let err = t.step(&State::Connecting, &Input::Close, &[A::Closed(CloseReason::Local)], &State::Closed);
    assert!(err.unwrap_err().contains("still armed"));
    let mut t = Tracker::new(&[A::SetDeadline(Step::Accept)]);
    let err = t.step(&State::Accepting, &Input::Timeout(Step::Accept), &[], &State::Accepting);
    assert!(err.unwrap_err().contains("nothing happened"));
}

// ------------------------------------------------------------------------------------------
// Listener
// ------------------------------------------------------------------------------------------

#[test]
fn listener_connect_requests_are_incoming_and_it_keeps_listening() {
    let mut l = Listener::new();
    for _ in 0..3 {
        assert_eq!(l.on_cm(K::ConnectRequest, 0), ListenerAction::Incoming);
    }
    assert!(!l.is_closed());
    assert_eq!(Listener::default(), Listener::new());
}

#[test]
fn listener_device_removal_closes_once() {
    let mut l = Listener::new();
    assert_eq!(l.on_cm(K::DeviceRemoval, 0), ListenerAction::Closed(CloseReason::DeviceRemoval));
    assert!(l.is_closed());
    assert_eq!(l.on_cm(K::DeviceRemoval, 0), ListenerAction::None);
    assert_eq!(l.close(), ListenerAction::None);
}

#[test]
fn listener_close_once() {
    let mut l = Listener::new();
    assert_eq!(l.close(), ListenerAction::Closed(CloseReason::Local));
    assert!(l.is_closed());
    assert_eq!(l.close(), ListenerAction::None);
}

#[test]
fn listener_shutdown_closes_once_with_its_reason() {
    let mut l = Listener::new();
    assert_eq!(l.close_for(CloseReason::Shutdown), ListenerAction::Closed(CloseReason::Shutdown));
    assert_eq!(l.close(), ListenerAction::None);
    assert_eq!(l.close_for(CloseReason::Shutdown), ListenerAction::None);
}

#[test]
fn listener_after_close_every_event_is_none() {
    let mut l = Listener::new();
    l.close();
    for k in all_kinds() {
        assert_eq!(l.on_cm(k, ST), ListenerAction::None, "{k:?}");
    }
    assert_eq!(l.close(), ListenerAction::None);
}

#[test]
fn listener_ignores_addr_change_and_timewait_exit() {
    let mut l = Listener::new();
    assert_eq!(l.on_cm(K::AddrChange, 0), ListenerAction::None);
    assert_eq!(l.on_cm(K::TimewaitExit, ST), ListenerAction::None);
    assert!(!l.is_closed());
}

#[test]
fn listener_reports_unexpected_events_and_keeps_listening() {
    let mut l = Listener::new();
    let expected = [K::ConnectRequest, K::DeviceRemoval, K::AddrChange, K::TimewaitExit];
    for k in all_kinds().into_iter().filter(|k| !expected.contains(k)) {
        match l.on_cm(k, ST) {
            ListenerAction::Report(msg) => {
                assert!(msg.contains(&format!("{k:?}")), "{msg}");
                assert!(msg.contains(&ST.to_string()), "{msg}");
            }
            other => panic!("{k:?}: {other:?}"),
        }
        assert!(!l.is_closed());
        assert_eq!(l.on_cm(K::ConnectRequest, 0), ListenerAction::Incoming, "after {k:?}");
    }
    assert_eq!(
        l.on_cm(K::Established, 3),
        ListenerAction::Report("unexpected Established (status 3) on a listener".into())
    );
}

#[test]
fn listener_every_event_sequence_closes_at_most_once() {
    // All sequences of three steps over every event plus close(): at most one Closed, and
    // nothing but None after it.
    let mut steps: Vec<Option<K>> = all_kinds().into_iter().map(Some).collect();
    steps.push(None);
    for a in &steps {
        for b in &steps {
            for c in &steps {
                let mut l = Listener::new();
                let mut closes = 0;
                for s in [a, b, c] {
                    let was_closed = l.is_closed();
                    let out = match s {
                        Some(k) => l.on_cm(*k, 0),
                        None => l.close(),
                    };
                    if was_closed {
                        assert_eq!(out, ListenerAction::None, "{a:?} {b:?} {c:?}");
                    }
                    if matches!(out, ListenerAction::Closed(_)) {
                        closes += 1;
                        assert!(l.is_closed());
                    }
                }
                assert!(closes <= 1, "{a:?} {b:?} {c:?}");
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// CloseReason
// ------------------------------------------------------------------------------------------

#[test]
fn close_reason_cleanliness_and_display() {
    let cases = [
        (CloseReason::Local, true, "closed locally"),
        (CloseReason::Peer, true, "peer disconnected"),
        (CloseReason::Shutdown, true, "reactor shut down"),
        (CloseReason::Rejected { status: 28, reason: None }, false, "rejected (status 28)"),
        (CloseReason::AddrError(ST), false, "address resolution failed (status -110: timed out)"),
        (
            CloseReason::AddrError(-19),
            false,
            "address resolution failed (status -19: no RDMA device behind that address or on the route to it)",
        ),
        (CloseReason::RouteError(ST), false, "route resolution failed (status -110: timed out)"),
        (CloseReason::ConnectError(ST), false, "connect failed (status -110)"),
        (CloseReason::Unreachable(ST), false, "peer unreachable (status -110: timed out)"),
        (CloseReason::DeviceRemoval, false, "RDMA device removed"),
        (
            CloseReason::WorkError(WcStatus::RetryExcErr),
            false,
            "work request failed: the peer did not acknowledge (RetryExcErr)",
        ),
        (CloseReason::WorkError(WcStatus::RemAccessErr), false, "work request failed: RemAccessErr"),
        (CloseReason::AsyncEvent(AsyncEventKind::PortErr), false, "the device reported port down (PORT_ERR)"),
        (
            CloseReason::AsyncEvent(AsyncEventKind::Unknown(99)),
            false,
            "the device reported unknown asynchronous event 99",
        ),
        (CloseReason::CqFailed { call: "ibv_poll_cq", errno: 5 }, false, "ibv_poll_cq failed (errno 5)"),
        (CloseReason::Protocol("x".into()), false, "protocol error: x"),
    ];
    for (reason, clean, text) in cases {
        assert_eq!(reason.is_clean(), clean, "{reason:?}");
        assert_eq!(reason.to_string(), text);
    }
}
