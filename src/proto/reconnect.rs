//! Reconnecting clients: the policy ([`Reconnect`]) and its arithmetic ([`Backoff`]), pure.
//!
//! A client connected with `ConnectOptions::reconnect` that loses its connection (or fails to
//! make it) is not closed: the reactor tears the old queue pair and id down as for a close,
//! keeps the token, the handler and the operations not yet posted, waits, and connects again
//! to the same address. This file decides whether it tries again and how long it waits:
//!
//! - **Which failures.** Every end this side did not ask for ([`retries`]): not a local close
//!   or a shutdown, and not a server's deliberate answer that a new attempt would only repeat
//!   (a reject with the runtime's reason other than "no resources" or the penalty box's
//!   "backoff": the application refused, or the connect information is wrong or
//!   unsupported).
//! - **How often.** At most [`Reconnect::attempts`] attempts in a row that fail; an attempt
//!   that reaches ESTABLISHED starts the count again ([`Backoff::connected`]).
//! - **How long.** The first wait is [`Reconnect::backoff`], each later one twice the one
//!   before, at most [`Reconnect::max_backoff`]; up to [`Reconnect::jitter_percent`] of each is
//!   taken off at random, so clients that lost one server do not all come back at the same
//!   instant. No attempt starts later than [`Reconnect::deadline`] after the failure that
//!   began the series.

use std::time::Duration;

use super::conn::CloseReason;
use super::wire::RejectCode;
use super::{MAX_DURATION, MAX_DURATION_TEXT};

/// A client connection's reconnect policy (`ConnectOptions::reconnect`).
///
/// What a reconnection keeps and what it does not (the token, the handler and the operations
/// not yet posted stay; operations on the device at the failure complete with their error;
/// exposures and remote keys of the old connection are invalid) is documented on
/// [`ConnectionHandler::on_reconnecting`](crate::ConnectionHandler::on_reconnecting).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reconnect {
    /// Most attempts in a row that may fail; after that the connection is closed with the
    /// last attempt's reason. An attempt that connects starts the count again. Default 10.
    pub attempts: u32,
    /// The wait before the first attempt after a failure; each further one waits twice as long
    /// as the one before. Default 100 ms; at most 365 days, as are `max_backoff` and
    /// `deadline` (a connect with a longer one fails with `Error::Config`).
    pub backoff: Duration,
    /// The longest wait. Default 5 s.
    pub max_backoff: Duration,
    /// Up to this share of each wait, in percent (0..=100), is taken off at random. Default 25.
    pub jitter_percent: u8,
    /// No attempt starts later than this after the failure that began the series (`None`:
    /// only `attempts` bounds it). Default 60 s.
    pub deadline: Option<Duration>,
}

impl Default for Reconnect {
    fn default() -> Self {
        Reconnect {
            attempts: 10,
            backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            jitter_percent: 25,
            deadline: Some(Duration::from_secs(60)),
        }
    }
}

impl Reconnect {
    /// Checks the values a policy cannot work with; returns what is wrong.
    pub(crate) fn check(&self) -> Result<(), String> {
        if self.jitter_percent > 100 {
            return Err(format!("reconnect: jitter_percent {} is above 100", self.jitter_percent));
        }
        let waits =
            [("backoff", Some(self.backoff)), ("max_backoff", Some(self.max_backoff)), ("deadline", self.deadline)];
        for (name, d) in waits {
            if let Some(d) = d.filter(|d| *d > MAX_DURATION) {
                return Err(format!("reconnect: {name} {d:?} is above the maximum of {MAX_DURATION_TEXT}"));
            }
        }
        if self.max_backoff < self.backoff {
            return Err(format!(
                "reconnect: max_backoff {:?} is below the first backoff {:?}",
                self.max_backoff, self.backoff
            ));
        }
        Ok(())
    }
}

/// True when a connection that ended for `reason` may be made again.
pub fn retries(reason: &CloseReason) -> bool {
    match reason {
        CloseReason::Local | CloseReason::Shutdown => false,
        // Refused for now: no resources, or the penalty box's wait (which the policy's backoff
        // waits out, or retries into a reject as cheap as this one).
        CloseReason::Rejected { reason: Some(r), .. } => {
            matches!(r.code, RejectCode::NoResources | RejectCode::Backoff)
        }
        _ => true,
    }
}

/// One connection's reconnect state: the policy, the series of failed attempts under way, and
/// a small random generator for the jitter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Backoff {
    policy: Reconnect,
    /// Attempts made since the last connection (or the first) failed.
    failed: u32,
    /// When the series began, in the caller's clock (any monotonic `Duration`).
    since: Option<Duration>,
    rng: u64,
}

impl Backoff {
    /// A fresh state; `seed` varies the jitter between connections (any value).
    pub fn new(policy: Reconnect, seed: u64) -> Backoff {
        // splitmix64's finaliser spreads close seeds apart; never zero: xorshift stays there.
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Backoff { policy, failed: 0, since: None, rng: (z ^ (z >> 31)) | 1 }
    }

    /// The connection failed for `reason` at `now`: `Some((attempt, wait))` to try again
    /// after `wait` (attempt 1 is the first after the series began), `None` to give up.
    pub fn failed(&mut self, reason: &CloseReason, now: Duration) -> Option<(u32, Duration)> {
        if !retries(reason) || self.failed >= self.policy.attempts {
            return None;
        }
        let since = *self.since.get_or_insert(now);
        let base = self.base(self.failed);
        let wait = base - self.jitter(base);
        if let Some(limit) = self.policy.deadline {
            // The attempt would start `now - since + wait` after the series began: past the
            // deadline, or so far past it that the sum does not fit a `Duration`.
            if now.saturating_sub(since).checked_add(wait).map_or(true, |start| start > limit) {
                return None;
            }
        }
        self.failed += 1;
        Some((self.failed, wait))
    }

    /// An attempt reached ESTABLISHED: the next failure starts a new series.
    pub fn connected(&mut self) {
        self.failed = 0;
        self.since = None;
    }

    /// The wait before attempt `n + 1` of a series, before jitter.
    fn base(&self, n: u32) -> Duration {
        let factor = 1u32.checked_shl(n.min(31)).unwrap_or(u32::MAX);
        self.policy.backoff.saturating_mul(factor).min(self.policy.max_backoff)
    }

    /// The random part taken off `base`: uniform in `[0, base × jitter_percent / 100]`.
    fn jitter(&mut self, base: Duration) -> Duration {
        let pct = u128::from(self.policy.jitter_percent.min(100));
        let span = base.as_nanos() * pct / 100;
        if span == 0 {
            return Duration::ZERO;
        }
        // xorshift64
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let off = u128::from(self.rng) % (span + 1);
        Duration::from_nanos(off.min(u128::from(u64::MAX)) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::op::WcStatus;
    use crate::proto::wire::RejectReason;

    const MS: Duration = Duration::from_millis(1);

    fn lost() -> CloseReason {
        CloseReason::WorkError(WcStatus::RetryExcErr)
    }

    fn no_jitter() -> Reconnect {
        Reconnect { jitter_percent: 0, ..Reconnect::default() }
    }

    #[test]
    fn waits_double_up_to_the_cap() {
        let mut b = Backoff::new(Reconnect { deadline: None, attempts: 12, ..no_jitter() }, 7);
        let waits: Vec<u64> = (0..8).map(|_| b.failed(&lost(), Duration::ZERO).unwrap().1.as_millis() as u64).collect();
        assert_eq!(waits, [100, 200, 400, 800, 1600, 3200, 5000, 5000]);
    }

    #[test]
    fn attempts_bound_a_series_and_a_connection_starts_a_new_one() {
        let mut b = Backoff::new(Reconnect { attempts: 3, deadline: None, ..no_jitter() }, 1);
        for n in 1..=3 {
            assert_eq!(b.failed(&lost(), Duration::ZERO).map(|(a, _)| a), Some(n));
        }
        assert_eq!(b.failed(&lost(), Duration::ZERO), None, "a fourth attempt");
        b.connected();
        assert_eq!(b.failed(&lost(), Duration::ZERO), Some((1, 100 * MS)), "a new series, from the first wait");
    }

    #[test]
    fn no_attempt_starts_after_the_deadline() {
        let policy = Reconnect { attempts: 100, deadline: Some(Duration::from_secs(1)), ..no_jitter() };
        let mut b = Backoff::new(policy, 1);
        let mut now = Duration::from_secs(50);
        let mut starts = Vec::new();
        while let Some((_, wait)) = b.failed(&lost(), now) {
            // Each attempt fails at once.
            now += wait;
            starts.push(now - Duration::from_secs(50));
        }
        assert_eq!(starts, [100 * MS, 300 * MS, 700 * MS], "the next would start at 1.5 s");
    }

    #[test]
    fn jitter_takes_off_at_most_its_share_and_varies() {
        let policy = Reconnect { jitter_percent: 50, attempts: u32::MAX, deadline: None, ..Reconnect::default() };
        let mut seen = std::collections::BTreeSet::new();
        for seed in 0..200 {
            let mut b = Backoff::new(policy, seed);
            let (_, wait) = b.failed(&lost(), Duration::ZERO).unwrap();
            assert!(wait >= 50 * MS && wait <= 100 * MS, "{wait:?}");
            seen.insert(wait);
        }
        assert!(seen.len() > 100, "only {} different waits", seen.len());
        let mut full = Backoff::new(Reconnect { jitter_percent: 100, ..policy }, 3);
        for _ in 0..50 {
            assert!(full.failed(&lost(), Duration::ZERO).unwrap().1 <= Duration::from_secs(5));
        }
    }

    #[test]
    fn only_failures_this_side_did_not_ask_for_retry() {
        let app = |code| CloseReason::Rejected { status: 28, reason: Some(RejectReason::new(code, "x")) };
        for r in [CloseReason::Local, CloseReason::Shutdown, app(RejectCode::Refused), app(RejectCode::Unsupported)] {
            assert!(!retries(&r), "{r:?}");
            assert_eq!(Backoff::new(Reconnect::default(), 1).failed(&r, Duration::ZERO), None);
        }
        for r in [
            CloseReason::Peer,
            lost(),
            app(RejectCode::NoResources),
            app(RejectCode::Backoff),
            CloseReason::Rejected { status: 8, reason: None },
            CloseReason::Rejected { status: -111, reason: None },
            CloseReason::Timeout(crate::proto::conn::Step::ResolveAddr),
            CloseReason::Unreachable(-110),
        ] {
            assert!(retries(&r), "{r:?}");
        }
    }

    #[test]
    fn policies_it_cannot_work_with_say_why() {
        let bad = Reconnect { jitter_percent: 101, ..Reconnect::default() };
        assert!(bad.check().unwrap_err().contains("jitter_percent 101"));
        let bad = Reconnect { max_backoff: MS, ..Reconnect::default() };
        assert!(bad.check().unwrap_err().contains("below the first backoff"));
        assert!(Reconnect::default().check().is_ok());
        let year = Duration::from_secs(365 * 86_400);
        assert!(Reconnect { backoff: year, max_backoff: year, deadline: Some(year), ..Reconnect::default() }
            .check()
            .is_ok());
        let bad = Reconnect { max_backoff: Duration::MAX, ..Reconnect::default() };
        assert!(bad
            .check()
            .unwrap_err()
            .contains("max_backoff 18446744073709551615.999999999s is above the maximum of 365 days"));
        let bad = Reconnect { backoff: year + MS, max_backoff: Duration::MAX, ..Reconnect::default() };
        assert!(bad.check().unwrap_err().contains("reconnect: backoff"));
        let bad = Reconnect { deadline: Some(Duration::MAX), ..Reconnect::default() };
        assert!(bad.check().unwrap_err().contains("reconnect: deadline"));
    }

    /// The review's L4 (2026-11-26): the start of the next attempt, `now - since + wait`, was
    /// added unchecked and overflowed (a panic inside `destroy_conn`) for waits near
    /// `Duration::MAX`. A `Backoff` is made without `Reconnect::check`, so its arithmetic
    /// holds for any policy: a start that does not fit is past any deadline.
    #[test]
    fn huge_waits_never_overflow() {
        let huge = Reconnect {
            attempts: 100,
            backoff: Duration::MAX,
            max_backoff: Duration::MAX,
            jitter_percent: 0,
            deadline: Some(Duration::MAX),
        };
        let mut b = Backoff::new(huge, 1);
        assert_eq!(b.failed(&lost(), Duration::ZERO), Some((1, Duration::MAX)), "starts exactly at the deadline");
        assert_eq!(b.failed(&lost(), MS), None, "1 ms later plus Duration::MAX does not fit: past the deadline");
        // With jitter, and without a deadline (nothing is added then).
        let mut b = Backoff::new(Reconnect { jitter_percent: 100, deadline: None, ..huge }, 7);
        for now in [Duration::ZERO, MS, Duration::MAX] {
            assert!(b.failed(&lost(), now).is_some());
        }
        let mut b = Backoff::new(Reconnect { jitter_percent: 25, deadline: Some(Duration::from_secs(60)), ..huge }, 7);
        assert_eq!(b.failed(&lost(), Duration::from_secs(1)), None);
        assert_eq!(b.failed(&lost(), Duration::from_secs(2)), None);
    }
}
