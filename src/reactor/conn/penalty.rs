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

use crate::proto::token::ConnKey;
use crate::reactor::conn::entry::Role;
use crate::reactor::Core;

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
        if !matches!(c.role, Role::Agent(_)) {
            return;
        }
        let Some(peer) = c.ep.id().and_then(|id| id.peer_addr()) else { return };
        let wait = self.penalties.strike(peer.ip(), Instant::now(), base);
        self.stats.violation_strikes += 1;
        event!(info, "{}: a connection broke the protocol: its connect requests are refused for {wait:?}", peer.ip());
        // Read only by `event!`, which the `log` feature compiles in.
        let _ = wait;
    }
}
