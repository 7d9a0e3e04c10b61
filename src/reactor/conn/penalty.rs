//! The penalty box on the reactor (`Config::violation_backoff`; the policy, pure, is
//! `proto/penalty.rs`): an accepted connection closed because its peer broke the protocol
//! counts against the peer's address when it is destroyed (`teardown.rs`), and a connect
//! request from an address with time left is refused first thing in `Core::decide`
//! (`setup.rs`), with `RejectCode::Backoff`.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::proto::conn::CloseReason;
use crate::reactor::conn::entry::Role;
use crate::reactor::{Config, ConnEntry, Core};

/// True for the reasons that are the peer's breach of the protocol, not a failure: a message
/// beyond its credit or otherwise against the wire protocol (`Protocol`), a request on memory
/// it was not given (`PeerViolation`).
fn is_violation(reason: &CloseReason) -> bool {
    matches!(reason, CloseReason::Protocol(_) | CloseReason::PeerViolation)
}

/// The address to count a violation against when connection `c` is destroyed: an accepted
/// one (a client's server is not penalized) that closed for a violation, with the box on
/// (`cfg`). Read before its id goes.
pub(in crate::reactor) fn violator(cfg: &Config, c: &ConnEntry) -> Option<SocketAddr> {
    cfg.violation_backoff?;
    if !matches!(c.role, Role::Agent(_)) || !c.close_reason.as_ref().is_some_and(is_violation) {
        return None;
    }
    c.ep.id()?.peer_addr()
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

    /// Counts a violation against `peer`'s address.
    pub(in crate::reactor) fn strike(&mut self, peer: SocketAddr) {
        let Some(base) = self.cfg.violation_backoff else { return };
        let wait = self.penalties.strike(peer.ip(), Instant::now(), base);
        self.stats.violation_strikes += 1;
        event!(info, "{}: a connection broke the protocol: its connect requests are refused for {wait:?}", peer.ip());
    }
}

#[cfg(test)]
mod tests {
    use super::is_violation;
    use crate::proto::conn::CloseReason;
    use crate::WcStatus;

    #[test]
    fn only_a_peers_breach_of_the_protocol_counts() {
        assert!(is_violation(&CloseReason::Protocol("a message beyond its credit".into())));
        assert!(is_violation(&CloseReason::PeerViolation));
        for r in [
            CloseReason::Local,
            CloseReason::Peer,
            CloseReason::WorkError(WcStatus::RetryExcErr),
            CloseReason::Shutdown,
            CloseReason::Setup("x".into()),
        ] {
            assert!(!is_violation(&r), "{r:?}");
        }
    }
}
