//! The penalty box on the reactor (`Config::violation_backoff`; the policy, pure, is
//! `proto/penalty.rs`): where the data path finds the peer of an accepted connection breaking
//! the protocol (a message beyond its credit or with broken framing, on its own receive queue
//! or a shared one: `data/cq/mod.rs`, `data/srq/mod.rs`), the peer's address is struck at once,
//! before the connection closes; a connect request from an address with time left is refused
//! first thing in `Core::decide` (`setup.rs`), with `RejectCode::Backoff`.
//!
//! Only those findings count: they are the peer's own bytes. `CloseReason::Protocol` also
//! names a connection-manager event in an order the state machine does not allow, and
//! `CloseReason::PeerViolation` is inferred from a flush, which a local fatal error can cause
//! too: neither is evidence enough to refuse an address.
//!
//! Each reactor has its own box: with listeners spread over reactors (`Balance`), a peer is
//! refused by the reactors whose connections it broke.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::proto::conn::State;
use crate::proto::token::ConnKey;
use crate::reactor::conn::entry::Role;
use crate::reactor::Core;

/// True when a connection in `state`, accepted by a listener (`agent`), is struck for a
/// violation found now: one not closing yet, so that the messages a peer's connection still
/// delivers while it closes (after a first overdraw the credit stays spent) strike once, not
/// once each.
fn strikes(agent: bool, state: &State) -> bool {
    agent && matches!(state, State::Accepting | State::Established | State::Finishing(_))
}

impl Core {
    /// How much longer connect requests from `peer` are refused (`None`: not at all, or the
    /// box is off).
    pub(in crate::reactor) fn penalized(&self, peer: Option<SocketAddr>) -> Option<Duration> {
        self.cfg.violation_backoff?;
        if self.penalties.len() == 0 {
            return None;
        }
        self.penalties.refusal(peer?.ip(), Instant::now())
    }

    /// The peer of connection `t` broke the data path's protocol: if `t` is an accepted
    /// connection and the box is on, its address is struck (called before the connection is
    /// fed the fault, while its id is live).
    pub(in crate::reactor) fn violated(&mut self, t: ConnKey) {
        let Some(base) = self.cfg.violation_backoff else { return };
        let Some(c) = self.conns.get(t) else { return };
        if !strikes(matches!(c.role, Role::Agent(_)), c.role.state()) {
            return;
        }
        let Some(peer) = c.ep.id().and_then(|id| id.peer_addr()) else { return };
        let wait = self.penalties.strike(peer.ip(), Instant::now(), base);
        self.stats.violation_strikes += 1;
        event!(
            info,
            "{}: a connection broke the protocol: its connect requests are refused (wait {wait:?})",
            peer.ip()
        );
        // Read only by `event!`, which the `log` feature compiles in.
        let _ = wait;
    }
}

#[cfg(test)]
mod tests {
    use super::strikes;
    use crate::proto::conn::{CloseReason, State};

    #[test]
    fn an_accepted_connection_is_struck_once_before_it_closes_and_a_client_never() {
        let bye = || CloseReason::Protocol("the peer sent beyond its credit".into());
        for s in [State::Accepting, State::Established, State::Finishing(CloseReason::Local)] {
            assert!(strikes(true, &s), "{s:?}");
            assert!(!strikes(false, &s), "a client's server is never struck: {s:?}");
        }
        // The first violation closed it: what it still delivers strikes no more.
        for s in [State::Disconnecting(bye()), State::Draining(bye()), State::Closed] {
            assert!(!strikes(true, &s), "{s:?}");
        }
    }
}
