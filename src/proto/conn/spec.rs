//! The independent specification of the agent and client machines, and the life-long
//! invariants of one connection: the oracle of the host tests (`tests/`: scripted, exhaustive
//! and random walks) and of the `state_machines` fuzz target (`crate::proto::fuzz`).
//!
//! Written from the documented behaviour, not from the machines' code: [`spec`] says what any
//! input does in any state; [`Tracker`] checks what must hold across a whole life (one
//! `Closed`, one `Established`, deadlines never leaked, stale timeouts ignored, armed timeouts
//! honoured).

use super::{Action as A, CloseReason, CmEventKind as K, Input, State, Step};

/// Every CM event kind this crate names (`Unknown` aside). The tests check it is complete.
pub(crate) const KNOWN_KINDS: [K; 16] = [
    K::AddrResolved,
    K::AddrError,
    K::RouteResolved,
    K::RouteError,
    K::ConnectRequest,
    K::ConnectResponse,
    K::ConnectError,
    K::Unreachable,
    K::Rejected,
    K::Established,
    K::Disconnected,
    K::DeviceRemoval,
    K::MulticastJoin,
    K::MulticastError,
    K::AddrChange,
    K::TimewaitExit,
];

/// Every step with a deadline. The tests check it is complete.
pub(crate) const ALL_STEPS: [Step; 7] =
    [Step::ResolveAddr, Step::ResolveRoute, Step::Connect, Step::Accept, Step::Disconnect, Step::Drain, Step::Finish];

/// The Protocol reason the machines build for `input` arriving in `state`.
pub(crate) fn proto(state: &State, input: &Input) -> CloseReason {
    CloseReason::Protocol(format!("unexpected {input:?} while {}", state.name()))
}

/// Early close: what every pre-establishment failure looks like.
pub(crate) fn closed(reason: CloseReason) -> [A; 2] {
    [A::ClearDeadline, A::Closed(reason)]
}

/// The deadline that must be armed while in `state`.
pub(crate) fn armed_in(state: &State) -> Option<Step> {
    match state {
        State::ResolvingAddr => Some(Step::ResolveAddr),
        State::ResolvingRoute => Some(Step::ResolveRoute),
        State::Connecting => Some(Step::Connect),
        State::Accepting => Some(Step::Accept),
        State::Established | State::Closed => None,
        State::Disconnecting(_) => Some(Step::Disconnect),
        State::Draining(_) => Some(Step::Drain),
        State::Finishing(_) => Some(Step::Finish),
    }
}

/// What an input must do, as [`spec`] says.
#[derive(Debug)]
pub(crate) enum Want {
    /// No actions, state unchanged.
    Ignore,
    /// `CloseReason::Protocol`: closed at once before establishment (and while closing),
    /// disconnect first when established.
    Protocol,
    /// This state and these actions.
    Go(State, Vec<A>),
}

/// The documented outcome of `input` in `state` (independent of the machines' code).
pub(crate) fn spec(state: &State, input: &Input) -> Want {
    use State as S;
    use Want::{Go, Ignore, Protocol};
    let close = |r: CloseReason| Go(S::Closed, closed(r).to_vec());
    let disconnect = |r: CloseReason| Go(S::Disconnecting(r), vec![A::Disconnect, A::SetDeadline(Step::Disconnect)]);
    let early = matches!(state, S::ResolvingAddr | S::ResolvingRoute | S::Connecting | S::Accepting);
    let closing = matches!(state, S::Disconnecting(_) | S::Draining(_));
    match (state, input) {
        (S::Closed, _) => Ignore,

        (_, Input::Cm(K::AddrChange | K::TimewaitExit, _)) => Ignore,
        (_, Input::Cm(K::DeviceRemoval, _)) => close(CloseReason::DeviceRemoval),
        // Nothing of the connection can be trusted: closed at once, whatever its state.
        (_, Input::Abort(r)) => close(r.clone()),
        // The close handshake: say goodbye, disconnect once the peer answers or the deadline
        // passes; the peer disconnecting first ends it too.
        (S::Established, Input::Finish(r)) => {
            Go(S::Finishing(r.clone()), vec![A::SendFarewell, A::SetDeadline(Step::Finish)])
        }
        (_, Input::Finish(r)) if early => close(r.clone()),
        (S::Finishing(r), Input::Finished) => disconnect(r.clone()),
        (_, Input::Finished | Input::Finish(_)) => Ignore,
        (S::Finishing(r), Input::Cm(K::Disconnected, _)) => {
            Go(S::Draining(r.clone()), vec![A::Disconnect, A::SetDeadline(Step::Drain)])
        }
        (S::Finishing(_), Input::Cm(K::Unreachable, s)) => disconnect(CloseReason::Unreachable(*s)),
        (S::ResolvingAddr, Input::Cm(K::AddrResolved, _)) => {
            Go(S::ResolvingRoute, vec![A::ClearDeadline, A::ResolveRoute, A::SetDeadline(Step::ResolveRoute)])
        }
        (S::ResolvingAddr, Input::Cm(K::AddrError, s)) => close(CloseReason::AddrError(*s)),
        (S::ResolvingRoute, Input::Cm(K::RouteResolved, _)) => {
            Go(S::Connecting, vec![A::ClearDeadline, A::Connect, A::SetDeadline(Step::Connect)])
        }
        (S::ResolvingRoute, Input::Cm(K::RouteError, s)) => close(CloseReason::RouteError(*s)),
        (S::Connecting | S::Accepting, Input::Cm(K::Established, _)) => {
            Go(S::Established, vec![A::ClearDeadline, A::Established])
        }
        (S::Connecting | S::Accepting, Input::Cm(K::Rejected, s)) => {
            close(CloseReason::Rejected { status: *s, reason: None })
        }
        (S::Connecting | S::Accepting, Input::Rejected { status, reason }) => {
            close(CloseReason::Rejected { status: *status, reason: reason.clone() })
        }
        (S::Connecting | S::Accepting, Input::Cm(K::ConnectError, s)) => close(CloseReason::ConnectError(*s)),
        (S::Connecting | S::Accepting, Input::Cm(K::Unreachable, s)) => close(CloseReason::Unreachable(*s)),
        // The client went away between our accept and its RTU.
        (S::Accepting, Input::Cm(K::Disconnected, _)) => close(CloseReason::Peer),
        (S::Established, Input::Cm(K::Disconnected, _)) => {
            Go(S::Draining(CloseReason::Peer), vec![A::Disconnect, A::SetDeadline(Step::Drain)])
        }
        (S::Disconnecting(r), Input::Cm(K::Disconnected, _)) => {
            Go(S::Draining(r.clone()), vec![A::ClearDeadline, A::SetDeadline(Step::Drain)])
        }
        (S::Draining(_), Input::Cm(K::Disconnected, _)) => Ignore,
        // The peer stopped answering (RC retries or a CM timeout): a reason the user can read.
        (S::Established, Input::Cm(K::Unreachable, s)) => disconnect(CloseReason::Unreachable(*s)),
        (S::Disconnecting(_) | S::Draining(_), Input::Cm(K::Unreachable, _)) => Ignore,
        (_, Input::Cm(..) | Input::Rejected { .. }) => Protocol,

        // Only the armed deadline counts; any other one is stale.
        (_, Input::Timeout(t)) if armed_in(state) != Some(*t) => Ignore,
        (S::Disconnecting(r), Input::Timeout(_)) => Go(S::Draining(r.clone()), vec![A::SetDeadline(Step::Drain)]),
        (S::Finishing(r), Input::Timeout(_)) => disconnect(r.clone()),
        (S::Draining(r), Input::Timeout(_) | Input::Drained) => close(r.clone()),
        (_, Input::Timeout(t)) => close(CloseReason::Timeout(*t)),

        (_, Input::Close) if early => close(CloseReason::Local),
        (_, Input::Shutdown) if early => close(CloseReason::Shutdown),
        (_, Input::WorkError(w)) if early => close(CloseReason::WorkError(*w)),
        (_, Input::Fault(r)) if early => close(r.clone()),
        (S::Established | S::Finishing(_), Input::Fault(r)) => disconnect(r.clone()),
        (_, Input::Fault(_)) if closing => Ignore,
        (_, Input::SetupFailed(what)) if early => close(CloseReason::Setup(what.clone())),
        (S::Established, Input::Close) => disconnect(CloseReason::Local),
        (S::Established, Input::Shutdown) => disconnect(CloseReason::Shutdown),
        (S::Established | S::Finishing(_), Input::WorkError(w)) => disconnect(CloseReason::WorkError(*w)),
        // Saying goodbye already: a second close changes nothing.
        (S::Finishing(_), Input::Close | Input::Shutdown | Input::SetupFailed(_)) => Ignore,
        // The machine asks for no verb while established, so this "cannot happen".
        (S::Established, Input::SetupFailed(_)) => Protocol,
        (_, Input::Close | Input::Shutdown | Input::WorkError(_) | Input::SetupFailed(_)) if closing => Ignore,

        (_, Input::Drained) => Ignore,
        (_, input) => unreachable!("spec has no rule for {input:?} while {state:?}"),
    }
}

/// What has happened so far on one connection, for invariants that span inputs.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Tracker {
    /// The deadline armed now, as the actions so far set and cleared it.
    pub(crate) armed: Option<Step>,
    /// A `Closed` action was emitted.
    pub(crate) closed: bool,
    /// An `Established` action was emitted.
    pub(crate) established: bool,
    /// `Disconnect` actions so far.
    pub(crate) disconnects: u8,
    /// `ResolveRoute` actions so far.
    pub(crate) resolve_routes: u8,
    /// `Connect` actions so far.
    pub(crate) connects: u8,
}

impl Tracker {
    /// A connection whose machine started with the actions `first`.
    pub(crate) fn new(first: &[A]) -> Tracker {
        let mut t = Tracker::default();
        for a in first {
            match a {
                A::SetDeadline(s) => t.armed = Some(*s),
                other => panic!("unexpected first action {other:?}"),
            }
        }
        t
    }

    /// Checks one transition; `Err` names the broken invariant.
    pub(crate) fn step(&mut self, before: &State, input: &Input, actions: &[A], after: &State) -> Result<(), String> {
        if self.closed && !actions.is_empty() {
            return Err(format!("actions {actions:?} after Closed"));
        }
        if self.closed && !after.is_closed() {
            return Err(format!("left Closed for {after:?}"));
        }
        if actions.is_empty() != (before == after) {
            return Err(format!("state {before:?} -> {after:?} with actions {actions:?}"));
        }
        if let Input::Timeout(t) = input {
            if self.armed != Some(*t) && !actions.is_empty() {
                return Err(format!("stale {input:?} (armed {:?}) acted: {actions:?}", self.armed));
            }
            if self.armed == Some(*t) && actions.is_empty() {
                return Err(format!("the armed deadline {t:?} expired and nothing happened"));
            }
        }
        let closes = actions.iter().filter(|a| matches!(a, A::Closed(_))).count();
        if closes > 1 {
            return Err(format!("{closes} Closed in one batch: {actions:?}"));
        }
        if closes == 1 && !matches!(actions.last(), Some(A::Closed(_))) {
            return Err(format!("Closed is not the last action: {actions:?}"));
        }
        if (closes == 1) != (after.is_closed() && !before.is_closed()) {
            return Err(format!("Closed emitted: {}, but {before:?} -> {after:?}", closes == 1));
        }
        for a in actions {
            match a {
                A::SetDeadline(s) => self.armed = Some(*s),
                A::ClearDeadline => self.armed = None,
                A::Closed(_) => {
                    if self.armed.is_some() {
                        return Err(format!("Closed with deadline {:?} still armed: {actions:?}", self.armed));
                    }
                    self.closed = true;
                }
                A::Established => {
                    if self.established {
                        return Err("Established twice".into());
                    }
                    if !after.is_established() {
                        return Err(format!("Established action but state {after:?}"));
                    }
                    self.established = true;
                }
                A::Disconnect => {
                    self.disconnects += 1;
                    if self.disconnects > 1 {
                        return Err("Disconnect twice".into());
                    }
                    if !before.is_connected() {
                        return Err(format!("Disconnect while {before:?}"));
                    }
                }
                A::SendFarewell => {
                    if !matches!((before, after), (State::Established, State::Finishing(_))) {
                        return Err(format!("SendFarewell from {before:?} to {after:?}"));
                    }
                }
                A::ResolveRoute => self.resolve_routes += 1,
                A::Connect => self.connects += 1,
            }
        }
        if self.resolve_routes > 1 || self.connects > 1 {
            return Err("ResolveRoute or Connect twice".into());
        }
        if self.armed != armed_in(after) {
            return Err(format!("deadline {:?} armed while {after:?} (should be {:?})", self.armed, armed_in(after)));
        }
        if after.is_established() && !self.established {
            return Err("established without the Established action".into());
        }
        if let (State::Draining(r) | State::Disconnecting(r), Some(A::Closed(got))) = (before, actions.last()) {
            // A CM event (device removal) or an abort (a failed CQ or device) ends the
            // connection at once for its own reason.
            let forced = matches!(input, Input::Cm(..) | Input::Rejected { .. } | Input::Abort(_));
            if got != r && !forced {
                return Err(format!("closed with {got:?}, not the original {r:?}"));
            }
        }
        Ok(())
    }
}

/// What `spec` says feeding `input` in `before` must produce: the next state and the actions.
pub(crate) fn expected(before: &State, input: &Input) -> (State, Vec<A>) {
    match spec(before, input) {
        Want::Ignore => (before.clone(), vec![]),
        Want::Go(s, a) => (s, a),
        Want::Protocol if before.is_connected() => {
            (State::Disconnecting(proto(before, input)), vec![A::Disconnect, A::SetDeadline(Step::Disconnect)])
        }
        Want::Protocol => (State::Closed, closed(proto(before, input)).to_vec()),
    }
}
