//! The agent: the server side of one connection, from accept to closed.

use super::{acts, Action, Actions, CloseReason, CmEventKind, Input, Phase, State, Step};

/// Agent state machine. It is created when the user accepts a connect request, after the
/// reactor has called `rdma_accept`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Agent {
    state: State,
}

impl Agent {
    /// A freshly accepted agent and its first actions.
    pub fn accepting() -> (Agent, Actions) {
        (Agent { state: State::Accepting }, acts([Action::SetDeadline(Step::Accept)]))
    }

    /// The current state.
    pub fn state(&self) -> &State {
        &self.state
    }

    /// Feeds one input; returns what the reactor must do.
    pub fn on_input(&mut self, input: Input) -> Actions {
        use CmEventKind as K;
        if !matches!(self.state, State::Accepting) {
            return Phase::after_established(&mut self.state, input);
        }
        if let Some(out) = Phase::before_established(&mut self.state, &input) {
            return out;
        }
        match input {
            Input::Cm(K::Established, _) => {
                self.state = State::Established;
                acts([Action::ClearDeadline, Action::Established])
            }
            Input::Cm(K::ConnectError, s) => Phase::close_early(&mut self.state, CloseReason::ConnectError(s)),
            Input::Cm(K::Unreachable, s) => Phase::close_early(&mut self.state, CloseReason::Unreachable(s)),
            Input::Cm(K::Rejected, s) => {
                Phase::close_early(&mut self.state, CloseReason::Rejected { status: s, reason: None })
            }
            Input::Rejected { status, reason } => {
                Phase::close_early(&mut self.state, CloseReason::Rejected { status, reason })
            }
            // The client went away between our accept and its RTU.
            Input::Cm(K::Disconnected, _) => Phase::close_early(&mut self.state, CloseReason::Peer),
            Input::Timeout(Step::Accept) => Phase::close_early(&mut self.state, CloseReason::Timeout(Step::Accept)),
            Input::Timeout(_) => Actions::new(),
            other => Phase::unexpected(&mut self.state, &other),
        }
    }
}
