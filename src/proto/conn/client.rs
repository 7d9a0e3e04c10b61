//! The client: resolve address, resolve route, connect, transfer, disconnect.

use super::{acts, Action, Actions, CloseReason, CmEventKind, Input, Phase, State, Step};

/// Client state machine. It starts after the reactor has called `rdma_resolve_addr`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Client {
    state: State,
}

impl Client {
    /// A client whose address resolution is under way, and its first actions.
    pub fn resolving() -> (Client, Actions) {
        (Client { state: State::ResolvingAddr }, acts([Action::SetDeadline(Step::ResolveAddr)]))
    }

    /// The current state.
    pub fn state(&self) -> &State {
        &self.state
    }

    /// Feeds one input; returns what the reactor must do.
    pub fn on_input(&mut self, input: Input) -> Actions {
        use CmEventKind as K;
        let step = match self.state {
            State::ResolvingAddr => Step::ResolveAddr,
            State::ResolvingRoute => Step::ResolveRoute,
            State::Connecting => Step::Connect,
            _ => return Phase::after_established(&mut self.state, input),
        };
        if let Some(out) = Phase::before_established(&mut self.state, &input) {
            return out;
        }
        match (&self.state, input) {
            (State::ResolvingAddr, Input::Cm(K::AddrResolved, _)) => {
                self.state = State::ResolvingRoute;
                acts([Action::ClearDeadline, Action::ResolveRoute, Action::SetDeadline(Step::ResolveRoute)])
            }
            (State::ResolvingAddr, Input::Cm(K::AddrError, s)) => {
                Phase::close_early(&mut self.state, CloseReason::AddrError(s))
            }
            (State::ResolvingRoute, Input::Cm(K::RouteResolved, _)) => {
                self.state = State::Connecting;
                acts([Action::ClearDeadline, Action::Connect, Action::SetDeadline(Step::Connect)])
            }
            (State::ResolvingRoute, Input::Cm(K::RouteError, s)) => {
                Phase::close_early(&mut self.state, CloseReason::RouteError(s))
            }
            (State::Connecting, Input::Cm(K::Established, _)) => {
                self.state = State::Established;
                acts([Action::ClearDeadline, Action::Established])
            }
            (State::Connecting, Input::Rejected { status, reason }) => {
                Phase::close_early(&mut self.state, CloseReason::Rejected { status, reason })
            }
            (State::Connecting, Input::Cm(K::Rejected, s)) => {
                Phase::close_early(&mut self.state, CloseReason::Rejected { status: s, reason: None })
            }
            (State::Connecting, Input::Cm(K::ConnectError, s)) => {
                Phase::close_early(&mut self.state, CloseReason::ConnectError(s))
            }
            (State::Connecting, Input::Cm(K::Unreachable, s)) => {
                Phase::close_early(&mut self.state, CloseReason::Unreachable(s))
            }
            (_, Input::Timeout(t)) if t == step => Phase::close_early(&mut self.state, CloseReason::Timeout(t)),
            // A deadline of an earlier step that fired in the same tick as its event.
            (_, Input::Timeout(_)) => Actions::new(),
            (_, other) => Phase::unexpected(&mut self.state, &other),
        }
    }
}
