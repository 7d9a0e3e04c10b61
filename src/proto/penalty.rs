//! The penalty box (`Config::violation_backoff`): once the peer of a connection a listener
//! accepted breaks the data path's protocol (a message beyond the credit it was granted, a
//! message whose framing is broken: the connection closes with `CloseReason::Protocol`), the
//! listeners refuse connect requests from that peer's address for a while, so a peer that
//! reconnects after each such close (a reconnect storm) costs a reject each time, not an
//! accept, a queue pair, registered receives and a teardown.
//!
//! The wait doubles with each further violation after the last wait ended, while the address
//! is remembered (at most [`MAX_DOUBLINGS`] times); violations during a wait (connections made
//! before it, breaking the protocol together) do not lengthen it. The address is forgotten once
//! it has behaved for [`FORGET_AFTER`] times its last wait after that wait ended. At most [`CAPACITY`] addresses
//! are remembered: a new one takes the place of the one whose wait ends first (expired ones
//! first), so what a flood of addresses makes the reactor hold is bounded, and it can at worst
//! shorten another address's wait.
//!
//! Keyed by IP address, not port: a reconnecting peer gets a new port each time; an
//! IPv4-mapped IPv6 address as the IPv4 address. An IPv6 address is kept whole: a /64 is
//! often a whole subnet (link-local `fe80::/64` is every peer on the link), so keying by it
//! would refuse every peer there for one violator; the cost is that a host handing itself new
//! addresses evades the box. Every client behind one address (a NAT, one host's processes)
//! shares its wait, which is why the box is off by default.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// Addresses remembered at most.
pub(crate) const CAPACITY: usize = 4096;
/// A wait doubles at most this many times: 64 times the configured one.
pub(crate) const MAX_DOUBLINGS: u32 = 6;
/// An address that has behaved this many times its last wait, after that wait ended, is
/// forgotten (its next violation starts again from the configured wait).
pub(crate) const FORGET_AFTER: u32 = 8;

/// One remembered address.
#[derive(Clone, Copy, Debug)]
struct Strikes {
    /// Connect requests are refused until then.
    until: Instant,
    /// The last wait: the configured one, doubled per violation since the first.
    wait: Duration,
}

impl Strikes {
    /// True once the address can be forgotten at `now`.
    fn forgotten(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.until) > self.wait.saturating_mul(FORGET_AFTER)
    }
}

/// The key an address is remembered by (module docs): the address, an IPv4-mapped one as its
/// IPv4 address. Also what the pool's per-address reservations are counted by.
pub(crate) fn key(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(addr, IpAddr::V4),
        IpAddr::V4(_) => addr,
    }
}

/// The addresses whose connections broke the protocol recently.
#[derive(Debug, Default)]
pub(crate) struct PenaltyBox {
    strikes: HashMap<IpAddr, Strikes>,
}

impl PenaltyBox {
    /// Counts a violation of a connection from `addr` at `now`: its connect requests are
    /// refused for `base`, or twice its last wait if it is still remembered (at most
    /// [`MAX_DOUBLINGS`] doublings); during a wait, the wait stays as it is. Returns the wait.
    pub(crate) fn strike(&mut self, addr: IpAddr, now: Instant, base: Duration) -> Duration {
        let addr = key(addr);
        let max = base.saturating_mul(1 << MAX_DOUBLINGS);
        let wait = match self.strikes.get(&addr).filter(|s| !s.forgotten(now)) {
            Some(s) if now < s.until => return s.wait,
            Some(s) => s.wait.saturating_mul(2).min(max),
            None => base,
        };
        // `Config::validate` bounds `base`, so this is representable; were it not, the
        // address would be refused until the far future, which is what a wait that long says.
        let until = now.checked_add(wait).unwrap_or_else(|| now + Duration::from_secs(365 * 86_400));
        if !self.strikes.contains_key(&addr) && self.strikes.len() >= CAPACITY {
            self.make_room(now);
        }
        self.strikes.insert(addr, Strikes { until, wait });
        wait
    }

    /// How much longer connect requests from `addr` are refused at `now`: `None` when they
    /// are not.
    pub(crate) fn refusal(&self, addr: IpAddr, now: Instant) -> Option<Duration> {
        let s = self.strikes.get(&key(addr))?;
        (now < s.until).then(|| s.until - now)
    }

    /// Addresses remembered.
    pub(crate) fn len(&self) -> usize {
        self.strikes.len()
    }

    /// Full: forgets the addresses that can be, and if none can, the one whose wait ends
    /// first.
    fn make_room(&mut self, now: Instant) {
        self.strikes.retain(|_, s| !s.forgotten(now));
        if self.strikes.len() >= CAPACITY {
            if let Some(first) = self.strikes.iter().min_by_key(|(_, s)| s.until).map(|(a, _)| *a) {
                self.strikes.remove(&first);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    const MS: Duration = Duration::from_millis(1);

    fn v4(n: u32) -> IpAddr {
        IpAddr::V4(Ipv4Addr::from(n))
    }

    #[test]
    fn a_violation_refuses_its_address_for_the_wait_and_no_other() {
        let t0 = Instant::now();
        let mut b = PenaltyBox::default();
        assert_eq!(b.strike(v4(1), t0, 100 * MS), 100 * MS);
        assert_eq!(b.refusal(v4(1), t0), Some(100 * MS));
        assert_eq!(b.refusal(v4(1), t0 + 40 * MS), Some(60 * MS));
        assert_eq!(b.refusal(v4(1), t0 + 100 * MS), None, "over when the wait is");
        assert_eq!(b.refusal(v4(2), t0), None, "another address");
        let six = IpAddr::V6(Ipv6Addr::LOCALHOST);
        assert_eq!(b.refusal(six, t0), None);
        b.strike(six, t0, 100 * MS);
        assert!(b.refusal(six, t0).is_some());
    }

    #[test]
    fn the_wait_doubles_per_violation_up_to_64_times_and_is_forgotten_after_good_behaviour() {
        let t0 = Instant::now();
        let mut b = PenaltyBox::default();
        let mut now = t0;
        let mut waits = Vec::new();
        for _ in 0..9 {
            let w = b.strike(v4(1), now, 10 * MS);
            waits.push(w.as_millis());
            // It reconnects as soon as it may, and breaks the protocol again at once.
            now += w;
        }
        assert_eq!(waits, [10, 20, 40, 80, 160, 320, 640, 640, 640]);
        // Behaved for 8 times its last wait after it ended: not yet forgotten...
        assert_eq!(b.strike(v4(1), now + 8 * 640 * MS, 10 * MS), 640 * MS);
        let now = now + 8 * 640 * MS + 640 * MS;
        // ... and now it is: back to the configured wait.
        assert_eq!(b.strike(v4(1), now + 8 * 640 * MS + MS, 10 * MS), 10 * MS);
    }

    #[test]
    fn a_flood_of_addresses_is_bounded_and_shortens_no_wait_it_need_not() {
        let t0 = Instant::now();
        let mut b = PenaltyBox::default();
        // An address with a long wait, then a full box of short ones.
        b.strike(v4(0), t0, Duration::from_secs(60));
        for i in 1..CAPACITY as u32 {
            b.strike(v4(i), t0, MS);
        }
        assert_eq!(b.len(), CAPACITY);
        // Full, and nothing forgettable yet: the newcomer takes the place of a wait that
        // ends first, never the long one.
        b.strike(v4(1 << 20), t0, MS);
        assert_eq!(b.len(), CAPACITY);
        assert!(b.refusal(v4(0), t0).is_some(), "the long wait stays");
        assert!(b.refusal(v4(1 << 20), t0).is_some());
        // Later, the short ones can be forgotten: one newcomer clears them all.
        let later = t0 + Duration::from_secs(1);
        b.strike(v4(1 << 21), later, MS);
        assert_eq!(b.len(), 2, "the long wait and the newcomer");
        assert!(b.refusal(v4(0), later).is_some());
    }

    #[test]
    fn the_longest_wait_is_representable() {
        // The longest base `Config::validate` takes, doubled to the cap: 64 years.
        let t0 = Instant::now();
        let mut b = PenaltyBox::default();
        let year = Duration::from_secs(365 * 86_400);
        let mut now = t0;
        let mut wait = Duration::ZERO;
        for _ in 0..=MAX_DOUBLINGS {
            wait = b.strike(v4(1), now, year);
            now += wait;
        }
        assert_eq!(wait, year * 64);
        assert!(b.refusal(v4(1), now - Duration::from_secs(1)).is_some());
        assert_eq!(b.refusal(v4(1), now), None);
    }

    #[test]
    fn violations_during_a_wait_do_not_lengthen_it() {
        let t0 = Instant::now();
        let mut b = PenaltyBox::default();
        assert_eq!(b.strike(v4(1), t0, 100 * MS), 100 * MS);
        // Seven connections made before the first violation break the protocol together.
        for i in 1..8 {
            assert_eq!(b.strike(v4(1), t0 + i * MS, 100 * MS), 100 * MS);
        }
        assert_eq!(b.refusal(v4(1), t0 + 99 * MS), Some(MS));
        assert_eq!(b.refusal(v4(1), t0 + 100 * MS), None);
        // Again after the wait: doubled, once.
        assert_eq!(b.strike(v4(1), t0 + 100 * MS, 100 * MS), 200 * MS);
    }

    #[test]
    fn an_ipv6_address_is_itself_and_a_mapped_address_its_ipv4_one() {
        let t0 = Instant::now();
        let mut b = PenaltyBox::default();
        let a: IpAddr = "fe80::1".parse().unwrap();
        b.strike(a, t0, 100 * MS);
        assert!(b.refusal(a, t0).is_some());
        // Another peer on the same link (and /64) is not refused for it.
        assert_eq!(b.refusal("fe80::2".parse().unwrap(), t0), None);
        let mapped: IpAddr = "::ffff:192.0.2.7".parse().unwrap();
        b.strike(mapped, t0, 100 * MS);
        assert!(b.refusal("192.0.2.7".parse().unwrap(), t0).is_some());
        assert_eq!(b.refusal("192.0.2.8".parse().unwrap(), t0), None);
    }
}
