//! Deadlines and user timers on the reactor's loop: a min-heap feeding epoll's timeout.
//!
//! Cancelling is lazy: a connection keeps the key of the deadline it expects and a user timer
//! lives in `Core::user_timers`; a heap entry whose deadline key no longer matches, or whose
//! timer is gone, is dropped when it surfaces. A closed object's timers are removed before its
//! handler hears `on_closed`: a connection's are listed in its entry (`ConnEntry::timers`),
//! so closing it costs its own timers, never a walk over every live one.
//!
//! **The clock.** The tick reads the time only for the timers and the spin time. For the
//! timers it reads `CLOCK_MONOTONIC_COARSE` ([`CoarseClock`], vDSO) while the earliest deadline
//! is further away than twice that clock's resolution, and shortens the wait by as much; the
//! precise clock (a system call where its source is an emulated HPET) only when a deadline is
//! that near (`Core::timer_clock`). A reading is never ahead of the true time, so no timer
//! fires early; the wait oversleeps a deadline only if the coarse clock lags by more than two
//! of its ticks. A wait ended by readiness with the deadline far by the coarse clock does not
//! read the clock again after it (`Core::tick`): a deadline that came due meanwhile (the
//! thread preempted past its timeout) fires in the next tick, which reads it first.
//!
//! **Compaction.** Left alone, the stale entries would stay until their deadlines: a handler
//! that resets an hour's idle timer on every message would keep an entry per message for an
//! hour. At the end of each full tick, once the heap holds more than twice the entries that
//! can be live (`Core::live_timer_bound`: the user timers and sleeping tasks, four per connection, two more)
//! plus a slack, it is rebuilt without the stale ones ([`Core::compact_timers`]). Each
//! rebuild drops at least half the heap, so its cost is amortised over the schedules that
//! made it necessary.

use std::cell::Cell;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::proto::conn::{Input, Step};
use crate::proto::token::{ConnKey, Key, Kind, ListenerKey, TimerKey, Token};
use crate::reactor::Core;

/// What a heap entry fires.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(in crate::reactor) enum TimerTarget {
    /// A connection's connection-manager deadline.
    Deadline(ConnKey),
    /// A user timer.
    User(TimerKey),
    /// Retry letting librdmacm forget released devices (`device.rs`).
    ForgetDevices,
    /// A connection's keepalive probe is due.
    Keepalive(ConnKey),
    /// An iWARP client has not heard from its server since its first message: nudge it
    /// (`proto::transport::NUDGES`).
    Nudge(ConnKey),
    /// A connection's next send has waited for credits for `Config::credit_timeout`.
    Stall(ConnKey),
    /// Shared-receive-queue receives wait for pool buffers (`data/srq/mod.rs`): try again.
    SrqRefill,
    /// A reconnecting client's next attempt (`conn/reconnect.rs`).
    Redial(ConnKey),
    /// A peer that said goodbye and was answered has not disconnected within
    /// `Timeouts::finish` (`data/cq/mod.rs`, `Core::on_farewell`).
    Parting(ConnKey),
    /// A task's sleep is over (`io::sleep`, `event_loop/exec.rs`): wake it.
    Wake(TimerKey),
    /// A connect request that waits for room among the pending accepts has waited
    /// `Timeouts::accept` (`conn/waiting.rs`): the tick's `admit_waiting` refuses it. A timer,
    /// so a reactor with nothing else to do wakes for it, and an outer loop's
    /// `Reactor::next_timeout` names it (review of 2026-12-07, N11).
    WaitingExpiry,
}

/// A timer set by a callback: whose `on_timer` to call, with what.
pub(in crate::reactor) struct UserTimer {
    pub(in crate::reactor) owner: Token,
    pub(in crate::reactor) user_data: u64,
}

impl Core {
    /// Fires every deadline and timer expired at `now`; returns how many fired.
    pub(in crate::reactor) fn fire_timers(&mut self, now: Instant) -> usize {
        // Nothing due (the usual tick): no list built.
        if !self.timers.next_deadline().is_some_and(|at| at <= now) {
            return 0;
        }
        let due = self.timers.expired(now);
        let mut n = 0;
        for (key, target) in due {
            n += self.fire(key, target);
        }
        n
    }

    /// Fires one expired heap entry; returns 1 if it did something.
    fn fire(&mut self, key: u64, target: TimerTarget) -> usize {
        match target {
            TimerTarget::Deadline(t) => {
                let Some(c) = self.conns.get_mut(t) else { return 0 };
                match c.deadline {
                    Some((k, step)) if k == key => {
                        c.deadline = None;
                        match step {
                            Step::Finish => {
                                self.stats.farewells_unanswered += 1;
                                event!(
                                    info,
                                    "{:?}: the peer did not answer the farewell within {:?}: disconnecting anyway",
                                    t.token(),
                                    self.cfg.timeouts.finish
                                );
                            }
                            Step::Disconnect => self.disconnect_unanswered(t),
                            _ => {}
                        }
                        self.feed(t, Input::Timeout(step));
                        1
                    }
                    _ => 0,
                }
            }
            TimerTarget::ForgetDevices => {
                self.forget_devices();
                0
            }
            TimerTarget::Keepalive(t) => self.keepalive(t, key),
            TimerTarget::Nudge(t) => self.nudge(t, key),
            TimerTarget::Redial(t) => self.redial(t, key),
            TimerTarget::Stall(t) => self.credit_stall(t, key),
            TimerTarget::Parting(t) => self.parting(t, key),
            TimerTarget::SrqRefill => {
                // The tick's posting tries the refill again, and looks at the connections
                // withheld for memory (and re-arms this if either is still short).
                self.srq_refill = false;
                self.srq_release_due = true;
                0
            }
            // The tick's `admit_waiting`, after the timers, refuses what waited too long and
            // sets the timer again for the new front.
            TimerTarget::WaitingExpiry => {
                if self.waiting.expiry == Some(key) {
                    self.waiting.expiry = None;
                }
                0
            }
            TimerTarget::Wake(k) => match self.exec.sleepers.remove(k) {
                Some(w) => {
                    w.wake();
                    1
                }
                None => 0,
            },
            TimerTarget::User(tt) => {
                let Some(timer) = self.user_timers.remove(tt) else { return 0 };
                let (owner, user_data) = (timer.owner, timer.user_data);
                if let Some(c) = ConnKey::of(owner) {
                    self.with_conn(c, |h, conn| h.on_timer(conn, user_data));
                } else if let Some(l) = ListenerKey::of(owner) {
                    self.with_listener(l, |h, ctx| h.on_timer(ctx, user_data));
                }
                1
            }
        }
    }

    /// Schedules `owner`'s `on_timer(user_data)` after `delay`.
    pub(crate) fn set_timer(&mut self, owner: Token, delay: Duration, user_data: u64) -> Result<Token> {
        debug_assert!(matches!(owner.kind(), Kind::Conn | Kind::Listener));
        // A destroyed owner (its cancelled completions are delivered after it left `conns`)
        // would leave the timer listed nowhere: never cancelled, keeping the reactor busy.
        let live = ConnKey::of(owner).is_some_and(|c| self.conns.contains(c))
            || ListenerKey::of(owner).is_some_and(|l| self.listeners.contains(l));
        if !live {
            return Err(Error::StaleToken(owner.as_u64()));
        }
        let at = self
            .read_clock()
            .checked_add(delay)
            .ok_or_else(|| Error::Config(format!("a timer delay of {delay:?} is out of range")))?;
        let tt = self.user_timers.insert(UserTimer { owner, user_data });
        self.timers.schedule(at, TimerTarget::User(tt));
        if let Some(c) = ConnKey::of(owner).and_then(|c| self.conns.get_mut(c)) {
            // Indexed by connection, so its close costs its own timers, not every live one.
            // Fired and cancelled ones are pruned whenever the list doubles.
            if c.timers.len() == c.timers.capacity() && c.timers.len() >= 4 {
                let live = &self.user_timers;
                c.timers.retain(|k| live.get(*k).is_some());
            }
            c.timers.push(tt);
        }
        Ok(tt.token())
    }

    /// Reads the precise clock and keeps the reading in `Core::clock.now` (for `fire_timers`,
    /// the spin time, and deadlines scheduled from it).
    pub(in crate::reactor) fn read_clock(&mut self) -> Instant {
        self.clock.now = Instant::now();
        self.clock.now
    }

    /// Reads the clock as far as the timers need it, and returns how long they let the wait
    /// last (`None`: no timer). The coarse clock while the earliest deadline is further away
    /// than the coarse clock's margin (`CoarseClock::margin_ns`): then no deadline can be
    /// due, and `Core::clock.now`, never ahead of the true time, is left as it was (nothing
    /// compares a deadline with it but `fire_timers`, which then finds nothing due either
    /// way); the wait is shortened by the margin, since the reading may lag the true time (the
    /// tick after such an early wakeup reads the precise clock, the deadline being within the
    /// margin then). Otherwise the precise clock, kept in `Core::clock.now`. Also whether the
    /// precise clock was read.
    pub(in crate::reactor) fn timer_clock(&mut self) -> (Option<Duration>, bool) {
        let Some(at) = self.timers.next_deadline() else { return (None, false) };
        if let Some(wait) = self.clock.coarse.far_wait(at) {
            return (Some(wait), false);
        }
        let now = self.read_clock();
        (Some(at.saturating_duration_since(now)), true)
    }

    /// [`Core::timer_clock`] for an outer loop (`Reactor::next_timeout`), without touching
    /// `Core::clock.now` (only the coarse clock's cached limit, a function of the deadline
    /// alone): the same choice of clock, so the tick it leads to finds the deadline due
    /// (or, if the coarse clock lagged more than the margin, a little more time to wait).
    pub(in crate::reactor) fn timer_timeout(&self) -> Option<Duration> {
        let at = self.timers.next_deadline()?;
        Some(self.clock.coarse.far_wait(at).unwrap_or_else(|| at.saturating_duration_since(Instant::now())))
    }

    /// Cancels a user timer; a fired or stale one is ignored.
    pub(crate) fn cancel_timer(&mut self, timer: Token) {
        if let Some(t) = TimerKey::of(timer) {
            self.user_timers.remove(t);
        }
    }

    /// At most how many heap entries can be live: every user timer and sleeping task; per connection its
    /// connection-manager deadline, its keepalive, its credit-stall, its parting timer and its
    /// nudge (a redial replaces the deadline); the waiting connect requests' expiry; the retry
    /// of forgetting devices and the SRQ refill.
    fn live_timer_bound(&self) -> usize {
        self.user_timers.len() + self.exec.sleepers.len() + 5 * self.conns.len() + 3
    }

    /// Drops the heap's stale entries once more than half of it (beyond a slack) must be
    /// stale (module docs).
    pub(in crate::reactor) fn compact_timers(&mut self) {
        const SLACK: usize = 1024;
        if self.timers.len() <= 2 * self.live_timer_bound() + SLACK {
            return;
        }
        let (conns, user_timers, sleepers) = (&self.conns, &self.user_timers, &self.exec.sleepers);
        let waiting_expiry = self.waiting.expiry;
        self.timers.retain(|key, target| match target {
            TimerTarget::Deadline(t) => conns.get(t).is_some_and(|c| c.deadline.is_some_and(|(k, _)| k == key)),
            TimerTarget::Stall(t) => conns.get(t).is_some_and(|c| c.stall == Some(key)),
            TimerTarget::Parting(t) => conns.get(t).is_some_and(|c| c.parting == Some(key)),
            // Not keyed: one per live connection at a time (re-scheduled as it fires).
            TimerTarget::Keepalive(t) => conns.get(t).is_some_and(|c| c.keepalive == Some(key)),
            TimerTarget::Nudge(t) => conns.get(t).is_some_and(|c| c.nudge.is_some_and(|(k, _, _)| k == key)),
            TimerTarget::Redial(t) => {
                conns.get(t).is_some_and(|c| c.redial.as_ref().is_some_and(|r| r.timer == Some(key)))
            }
            TimerTarget::User(tt) => user_timers.contains(tt),
            TimerTarget::Wake(k) => sleepers.contains(k),
            TimerTarget::WaitingExpiry => waiting_expiry == Some(key),
            TimerTarget::ForgetDevices | TimerTarget::SrqRefill => true,
        });
        self.stats.timer_compactions += 1;
    }
}

/// The tick's clocks: the last precise reading, and `CLOCK_MONOTONIC_COARSE` ([`CoarseClock`]),
/// the kernel's timekeeping as of its last update (at a tick), read in the vDSO, where the
/// precise clock can be a
/// system call (in the test VM it reads an emulated HPET). Before the coarse clock, the reactor
/// read the precise clock twice per wakeup whenever a timer was set.
pub(in crate::reactor) struct Clock {
    /// The last precise reading (`Core::read_clock`): taken by every tick while spinning, and
    /// by a tick whose earliest deadline is within the coarse clock's margin; otherwise it can
    /// be old. Never ahead of the true time, so comparing a deadline with it never fires one
    /// early.
    pub(in crate::reactor) now: Instant,
    /// The coarse clock the timers use while no deadline is near.
    pub(in crate::reactor) coarse: CoarseClock,
}

impl Clock {
    pub(in crate::reactor) fn new() -> Clock {
        Clock { now: Instant::now(), coarse: CoarseClock::new() }
    }
}

/// The coarse clock (see [`Clock`]).
pub(in crate::reactor) struct CoarseClock {
    /// An `Instant` and the `CLOCK_MONOTONIC` nanoseconds read right after it: `Instant` is
    /// `CLOCK_MONOTONIC` on Linux, so the coarse time maps onto it (never ahead of the truth).
    anchor: Instant,
    anchor_ns: u64,
    /// The margin in nanoseconds: how far a coarse reading is trusted to lag the true time,
    /// twice the coarse clock's resolution (8 ms at HZ=250). The coarse clock is the kernel's
    /// timekeeping as of its last update; each tick's update advances it by whole tick
    /// intervals and leaves the remainder in the clock source, so even just after a tick it
    /// lags by that remainder, a phase below one resolution that stays put while ticks keep
    /// time (3.8 ms of 4, at every tick, on one host). A reading lags by up to the phase plus
    /// the time since the tick: below two resolutions (7.8 ms seen there, so 0.2 ms to spare).
    /// A tick that comes late adds to that: a wait then ends that much late, never early.
    /// Within this of a deadline the timers read the precise clock.
    margin_ns: u64,
    /// The last deadline [`CoarseClock::far_wait`] was asked about, and its limit: the coarse
    /// reading, in nanoseconds, below which that deadline is further away than the margin.
    /// The earliest deadline changes far less often than ticks come; the `Instant` arithmetic
    /// this saves (a coarse reading made an `Instant`, plus the margin, minus the deadline)
    /// cost about 150 instructions a tick (issue 33).
    limit: Cell<Option<(Instant, u64)>>,
}

fn monotonic_ns(id: nix::time::ClockId) -> Option<u64> {
    let t = nix::time::clock_gettime(id).ok()?;
    u64::try_from(t.tv_sec()).ok()?.checked_mul(1_000_000_000)?.checked_add(u64::try_from(t.tv_nsec()).ok()?)
}

/// `d` in nanoseconds, `u64::MAX` past 584 years.
fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl CoarseClock {
    pub(in crate::reactor) fn new() -> CoarseClock {
        // The anchor's two reads bracket one instant; a preemption between them would make
        // every coarse reading lag by its length, so the tightest of a few brackets is kept.
        let mut best: Option<(Duration, Instant, u64)> = None;
        for _ in 0..4 {
            let before = Instant::now();
            let ns = monotonic_ns(nix::time::ClockId::CLOCK_MONOTONIC).unwrap_or(0);
            let gap = before.elapsed();
            if best.as_ref().map_or(true, |b| gap < b.0) {
                best = Some((gap, before, ns));
            }
        }
        let (_, anchor, anchor_ns) = best.expect("four tries");
        let resolution = nix::time::clock_getres(nix::time::ClockId::CLOCK_MONOTONIC_COARSE)
            .ok()
            .map_or(Duration::from_millis(10), |r| Duration::from(r).max(Duration::from_micros(1)));
        CoarseClock { anchor, anchor_ns, margin_ns: nanos(resolution.saturating_mul(2)), limit: Cell::new(None) }
    }

    /// The coarse clock in milliseconds (`CLOCK_MONOTONIC_COARSE`, a vDSO read: no system
    /// call), for what ages by the clock without a deadline (the SRQ's grown shares); 0 if it
    /// cannot be read.
    pub(in crate::reactor) fn millis(&self) -> u64 {
        monotonic_ns(nix::time::ClockId::CLOCK_MONOTONIC_COARSE).map_or(0, |ns| ns / 1_000_000)
    }

    /// The margin (`CoarseClock::margin_ns`).
    #[cfg(test)]
    fn margin(&self) -> Duration {
        Duration::from_nanos(self.margin_ns)
    }

    /// `at` in `CLOCK_MONOTONIC` nanoseconds, less the margin (saturating at both ends).
    fn limit_ns(&self, at: Instant) -> u64 {
        if let Some((cached, limit)) = self.limit.get() {
            if cached == at {
                return limit;
            }
        }
        let at_ns = if at >= self.anchor {
            self.anchor_ns.saturating_add(nanos(at.duration_since(self.anchor)))
        } else {
            self.anchor_ns.saturating_sub(nanos(self.anchor.duration_since(at)))
        };
        let limit = at_ns.saturating_sub(self.margin_ns);
        self.limit.set(Some((at, limit)));
        limit
    }

    /// If a coarse reading shows `at` further away than the margin: how long until `at` less
    /// the margin (the reading may lag the true time by that much), as the wait the timers
    /// allow. `None` when `at` is that near, or the coarse clock cannot be read: read the
    /// precise clock.
    pub(in crate::reactor) fn far_wait(&self, at: Instant) -> Option<Duration> {
        self.far_wait_from(monotonic_ns(nix::time::ClockId::CLOCK_MONOTONIC_COARSE)?, at)
    }

    /// [`CoarseClock::far_wait`] for a given coarse reading (`CLOCK_MONOTONIC_COARSE`
    /// nanoseconds): the arithmetic alone, so that a test can check it exactly.
    #[inline]
    fn far_wait_from(&self, coarse_ns: u64, at: Instant) -> Option<Duration> {
        let limit = self.limit_ns(at);
        (coarse_ns < limit).then(|| Duration::from_nanos(limit - coarse_ns))
    }

    /// The coarse time as an `Instant`: at most the true time, and normally less than the
    /// margin (two resolutions) behind it (see `margin_ns`); a reading at or before the anchor
    /// reads as the anchor. Without a coarse clock (it cannot fail on Linux), the precise one.
    #[cfg(test)]
    fn now(&self) -> Instant {
        match monotonic_ns(nix::time::ClockId::CLOCK_MONOTONIC_COARSE) {
            Some(ns) => self.anchor + Duration::from_nanos(ns.saturating_sub(self.anchor_ns)),
            None => Instant::now(),
        }
    }
}

/// A timer heap over targets of type `T`.
#[derive(Debug)]
pub(in crate::reactor) struct Timers<T: Ord> {
    heap: BinaryHeap<Reverse<(Instant, u64, T)>>,
    seq: u64,
}

impl<T: Ord + Copy> Default for Timers<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Ord + Copy> Timers<T> {
    /// An empty heap.
    pub fn new() -> Self {
        Timers { heap: BinaryHeap::new(), seq: 0 }
    }

    /// Schedules `target` at `at`; returns the entry's unique key.
    pub fn schedule(&mut self, at: Instant, target: T) -> u64 {
        self.seq += 1;
        self.heap.push(Reverse((at, self.seq, target)));
        self.seq
    }

    /// The earliest deadline, if any.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.heap.peek().map(|Reverse((at, _, _))| *at)
    }

    /// Time until the earliest deadline (zero if past), if any.
    pub fn next_timeout(&self, now: Instant) -> Option<Duration> {
        self.next_deadline().map(|at| at.saturating_duration_since(now))
    }

    /// Pops every entry due at `now`, earliest first, as `(key, target)`.
    pub fn expired(&mut self, now: Instant) -> Vec<(u64, T)> {
        let mut out = Vec::new();
        while let Some(Reverse((at, _, _))) = self.heap.peek() {
            if *at > now {
                break;
            }
            let Reverse((_, key, target)) = self.heap.pop().expect("peeked");
            out.push((key, target));
        }
        out
    }

    /// Entries in the heap, cancelled ones included.
    pub fn len(&self) -> usize {
        self.heap.len()
    }

    /// Keeps only the entries for which `keep(key, target)` holds; O(entries).
    pub fn retain(&mut self, mut keep: impl FnMut(u64, T) -> bool) {
        let mut entries = std::mem::take(&mut self.heap).into_vec();
        entries.retain(|Reverse((_, key, target))| keep(*key, *target));
        self.heap = BinaryHeap::from(entries);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The coarse clock never runs ahead of the precise one (so nothing fires early), and the
    /// anchor's offset is small: read just after the clock moves on (a kernel tick), a coarse
    /// reading lags by the phase (`CoarseClock::margin_ns`), below a resolution, so a smallest
    /// lag at such moves within a resolution plus 1 ms catches an anchor that adds more than
    /// that less the phase. At other moments a reading lags by up to two resolutions (the
    /// margin), and more when a tick comes late. (This test once asserted a resolution plus
    /// 2 ms for every reading of a tight loop right after the anchor: it failed when a reading
    /// came more than that less the phase after a tick, 2.2 ms on one host, which a loop of
    /// about 100 us did only when preempted, under load.)
    #[test]
    fn the_coarse_clock_is_never_ahead_and_its_anchor_adds_no_offset() {
        let c = CoarseClock::new();
        let resolution = c.margin() / 2;
        assert!(resolution > Duration::ZERO && resolution <= Duration::from_millis(100), "{resolution:?}");
        const MOVES: u32 = 20;
        let give_up = Instant::now() + Duration::from_secs(5);
        let mut last = c.now();
        let (mut moves, mut least_lag) = (0, Duration::MAX);
        while moves < MOVES && Instant::now() < give_up {
            let before = Instant::now();
            let coarse = c.now();
            let after = Instant::now();
            assert!(coarse <= after, "coarse {coarse:?} ahead of {after:?}");
            if coarse != last {
                least_lag = least_lag.min(before.saturating_duration_since(coarse));
                moves += 1;
                last = coarse;
            }
        }
        assert!(moves > 0, "the coarse clock did not move in 5 s");
        let bound = resolution + Duration::from_millis(1);
        assert!(
            least_lag <= bound,
            "just after {moves} moves the coarse clock still lagged by {least_lag:?}: an offset"
        );
    }

    /// The coarse path's wait is the deadline less the margin less the coarse reading, exactly
    /// (checked with given readings: a test that reads the coarse clock itself depends on the
    /// kernel's tick, see above); a deadline within the margin (or past) asks for the precise
    /// clock; the cached limit follows a new deadline; the live reading lies between the
    /// results for readings taken before and after it.
    #[test]
    fn far_wait_is_the_deadline_less_the_margin_or_none_when_near() {
        let now = Instant::now();
        let ms = |n: u64| Duration::from_millis(n);
        let anchor_ns = 5_000_000_000_000;
        let c = CoarseClock { anchor: now, anchor_ns, margin_ns: 8_000_000, limit: Cell::new(None) };
        for ahead in [ms(1000), ms(250), ms(3_600_000)] {
            let at = now + ahead;
            let limit = anchor_ns + nanos(ahead) - 8_000_000;
            assert_eq!(c.far_wait_from(anchor_ns, at), Some(ahead - ms(8)), "{ahead:?} at the anchor");
            assert_eq!(c.far_wait_from(anchor_ns + 2_000_000, at), Some(ahead - ms(10)), "{ahead:?}, 2 ms on");
            assert_eq!(c.far_wait_from(limit - 1, at), Some(Duration::from_nanos(1)), "{ahead:?}, just far");
            assert_eq!(c.far_wait_from(limit, at), None, "{ahead:?}: within the margin");
            assert_eq!(c.far_wait_from(limit + 9_000_000, at), None, "{ahead:?}: past");
        }
        assert_eq!(c.far_wait_from(anchor_ns, now), None, "a deadline now is near");
        assert_eq!(c.far_wait_from(anchor_ns, now + ms(8)), None, "at the margin");
        assert_eq!(c.far_wait_from(anchor_ns, now + ms(9)), Some(ms(1)), "just beyond it");
        if let Some(earlier) = now.checked_sub(ms(1000)) {
            assert_eq!(c.far_wait_from(anchor_ns, earlier), None, "a deadline before the anchor");
        }
        assert_eq!(c.far_wait_from(anchor_ns, now + ms(10_000)), Some(ms(9_992)), "the cache follows a new deadline");
        assert_eq!(c.far_wait_from(anchor_ns, now), None, "and back");
        // Near the clock's zero the limit saturates: nothing is far.
        let early = CoarseClock { anchor: now, anchor_ns: 1_000, margin_ns: 8_000_000, limit: Cell::new(None) };
        assert_eq!(early.far_wait_from(0, now + ms(5)), None);

        // The live clock: far_wait's own reading lies between two taken around it (the coarse
        // clock is monotonic), so its wait lies between theirs.
        let live = CoarseClock::new();
        let at = Instant::now() + ms(60_000);
        let coarse = || monotonic_ns(nix::time::ClockId::CLOCK_MONOTONIC_COARSE).expect("coarse clock");
        let first = coarse();
        let wait = live.far_wait(at).expect("60 s ahead is far");
        let second = coarse();
        assert!(
            live.far_wait_from(second, at) <= Some(wait) && Some(wait) <= live.far_wait_from(first, at),
            "{wait:?}"
        );
    }

    #[test]
    fn expire_in_deadline_order() {
        let t0 = Instant::now();
        let mut t = Timers::new();
        let c = t.schedule(t0 + Duration::from_millis(30), 'c');
        let a = t.schedule(t0 + Duration::from_millis(10), 'a');
        let b = t.schedule(t0 + Duration::from_millis(20), 'b');
        assert_eq!(t.next_timeout(t0), Some(Duration::from_millis(10)));
        assert_eq!(t.expired(t0 + Duration::from_millis(5)), vec![]);
        assert_eq!(t.expired(t0 + Duration::from_millis(25)), vec![(a, 'a'), (b, 'b')]);
        assert_eq!(t.len(), 1);
        assert_eq!(t.expired(t0 + Duration::from_secs(1)), vec![(c, 'c')]);
        assert_eq!(t.len(), 0);
        assert_eq!(t.next_timeout(t0), None);
    }

    #[test]
    fn retain_keeps_the_order_of_what_is_left() {
        let t0 = Instant::now();
        let mut t = Timers::new();
        let keys: Vec<u64> = (0..10u64).map(|i| t.schedule(t0 + Duration::from_millis(10 * (10 - i)), i)).collect();
        t.retain(|_, v| v % 3 != 0);
        assert_eq!(t.len(), 6);
        let left: Vec<(u64, u64)> = t.expired(t0 + Duration::from_secs(1));
        let want: Vec<(u64, u64)> = (0..10u64).rev().filter(|v| v % 3 != 0).map(|v| (keys[v as usize], v)).collect();
        assert_eq!(left, want, "earliest first, cancelled ones gone");
    }

    #[test]
    fn past_deadline_gives_zero_timeout_and_keys_are_unique() {
        let t0 = Instant::now();
        let mut t = Timers::new();
        let k1 = t.schedule(t0, 1);
        let k2 = t.schedule(t0, 1);
        assert_ne!(k1, k2);
        assert_eq!(t.next_timeout(t0 + Duration::from_secs(1)), Some(Duration::ZERO));
        assert_eq!(t.expired(t0).len(), 2);
    }
}
