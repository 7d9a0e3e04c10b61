//! The tick: one turn of the loop, and the spinning tick between two full ones.
//!
//! # One tick ([`Reactor::run_once`](crate::Reactor::run_once))
//!
//! 0. Spinning (`Config::spin`, for that long after the last tick that did work): poll the
//!    CQs left unarmed directly; once the spin time is over, arm them and poll once more.
//! 1. `epoll_wait` (level-triggered), with a timeout of zero when work is pending (a CQ left
//!    over budget, posts queued by a callback, objects to destroy, spinning), else until the
//!    next deadline; the clock is read again after it when it timed out, or when the precise
//!    clock was read before it (spinning, a deadline near): a wait ended by readiness with no
//!    deadline near leaves the timers to the next tick. While spinning it runs only every few ticks. A signal that interrupts it
//!    (`EINTR`) makes a tick with no readiness (`Stats::interrupted_waits`).
//! 2. CM channel readable: read every event until `EAGAIN`; each goes to its object's state
//!    machine (by the token in `id->context`) and is acked before the next is read
//!    (`conn/setup.rs`).
//! 3. Completion channel readable: read its events (at most as many as the device has armed
//!    CQs, since each raises one), count each on its CQ (acks are batched), mark the CQ hot
//!    (`data/cq/mod.rs`).
//!    In the same pass, in epoll's order: a device's event fd (`event_loop/device.rs`), the [`Remote`](crate::Remote)
//!    eventfd (queued messages to the message handler, a stop request, connect requests
//!    handed over by another reactor (`conn/handoff.rs`), asynchronous events another reactor
//!    read; `event_loop/remote.rs`), an
//!    application fd registered with [`Ctx::register_fd`](crate::Ctx::register_fd) (its callback; `event_loop/userfd.rs`).
//! 4. Poll hot CQs in batches under a per-CQ budget. A CQ found empty stays unarmed for now;
//!    a CQ that used its budget stays hot for the next tick.
//! 5. Fire expired deadlines and timers (`event_loop/timers.rs`).
//!    5b. Close what lost its last async handle and poll the woken tasks (`event_loop/exec.rs`): what
//!    they submit is posted in step 6.
//! 6. Post the operations submitted during the tick: first each device's shared receive queue
//!    refill (`data/srq/`, one chain per device), then one chain per queue pair and direction
//!    (`data/post.rs`, planned by the connections' lanes, `data/lanes.rs`). Then arm the CQs
//!    emptied in step 4 with `ibv_req_notify_cq` and poll them once more (on rxe and siw; on
//!    another device poll, arm and poll again: `Core::arm_and_poll`): a send whose ACK came
//!    back during its post completes now, not after a wakeup, and a completion that raced the
//!    arm is not stranded (unless spinning, which leaves them unarmed; or when `block_on`'s
//!    future was woken: `block_on` polls it, posts what it submitted and then arms, as here; a
//!    CQ left unarmed is armed at the start of the next tick, before its wait).
//! 7. Ack CQ events whose count reached the batch threshold.
//! 8. Destroy what closed during the tick (`conn/teardown.rs`), and only now: every CM event of the
//!    tick has been acked.

use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::epoll::{EpollFlags, EpollTimeout};

use crate::error::Result;
use crate::proto::conn::CloseReason;
use crate::proto::token::{Kind, Token};
use crate::reactor::event_loop::exec;
use crate::reactor::{os, Core};

/// While spinning, one tick in this many plus one is a full one: `epoll_wait` (without
/// blocking), the clock and the timers; the others only poll and post.
const SPIN_WAIT_EVERY: u32 = 63;

/// Readiness reported per `epoll_wait` at most (`Core::events`); more is reported again by
/// the next wait (level-triggered).
pub(in crate::reactor) const EVENTS: usize = 32;

/// `epoll_wait`'s timeout for a wait of `d`, in whole milliseconds rounded up (so a deadline
/// 0.3 ms, or 0.3 µs, away does not spin), at most `i32::MAX`. In `u64`s: the `u128` division
/// of `Duration::as_nanos` cost about 40 instructions a tick (issue 33).
fn wait_ms(d: Duration) -> u32 {
    let ms = d.as_secs().saturating_mul(1000).saturating_add(u64::from(d.subsec_nanos().div_ceil(1_000_000)));
    ms.min(i32::MAX as u64) as u32
}

/// Where the reactor is in its spinning (`Config::spin`): the tick's own state.
#[derive(Default)]
pub(in crate::reactor) struct Spin {
    /// The reactor spins (does not arm emptied CQs, does not sleep) until then.
    pub(in crate::reactor) until: Option<Instant>,
    /// Spinning in this tick.
    pub(in crate::reactor) on: bool,
    /// Spinning ticks since the last full one (`epoll_wait`, clock, timers).
    skipped: u32,
    /// A spinning tick since the last full one did work: the spin time restarts.
    pub(in crate::reactor) worked: bool,
}

impl Core {
    pub(in crate::reactor) fn is_idle(&self) -> bool {
        self.listeners.len() == 0 && self.conns.len() == 0 && self.user_timers.len() == 0 && self.user_fds.len() == 0
    }

    pub(in crate::reactor) fn tick(&mut self, timeout: Option<Duration>) -> Result<usize> {
        let _inside = exec::Inside::enter(self.exec.id());
        // Taken now, so no later tick inherits it (`Exec::take_defer_arm`).
        let block_on = self.exec.take_defer_arm();
        if self.spin.on && self.spin.skipped < SPIN_WAIT_EVERY {
            return Ok(self.spin_tick());
        }
        self.spin.skipped = 0;
        let spin_cfg = !self.cfg.spin.is_zero();
        let timed = self.timers.next_deadline().is_some();
        let clocked = spin_cfg || timed;
        // `precise`: the precise clock was read (spinning, or a deadline within the coarse
        // clock's margin).
        let (timers_wait, precise) = self.tick_clock(spin_cfg);
        // Precise when spinning; otherwise only the timers read it (`Core::timer_clock`).
        let now = self.clock.now;
        if std::mem::take(&mut self.spin.worked) {
            self.spin.until = now.checked_add(self.cfg.spin);
        }
        let spin = spin_cfg && self.spin.until.is_some_and(|until| now < until);
        let mut work = 0;
        if !self.work.spinning.is_empty() {
            // Spinning: poll the unarmed CQs. Spin time over: arm them (and poll once more)
            // before sleeping.
            work += self.poll_spinning(spin);
        }
        self.spin.on = spin;
        let busy = spin
            || work > 0
            || !self.work.hot.is_empty()
            || !self.work.dirty.is_empty()
            || !self.closing.conns.is_empty()
            || !self.closing.listeners.is_empty()
            || self.exec.has_work()
            || self.waiting_can_go()
            || self.srq_memory_back();
        let mut wait = if busy { Some(Duration::ZERO) } else { timeout };
        if let Some(t) = timers_wait {
            wait = Some(wait.map_or(t, |w| w.min(t)));
        }
        let epoll_timeout = match wait {
            None => EpollTimeout::NONE,
            Some(d) => EpollTimeout::try_from(wait_ms(d)).unwrap_or(EpollTimeout::MAX),
        };
        let n = match self.epoll.wait(&mut self.events, epoll_timeout) {
            Ok(n) => n,
            // A signal (epoll_wait is never restarted, SA_RESTART or not): no readiness; the
            // tick goes on as after a timeout.
            Err(Errno::EINTR) => {
                self.stats.interrupted_waits += 1;
                0
            }
            Err(e) => return Err(os("epoll_wait")(e)),
        };
        self.stats.wakeups += 1;
        if clocked && wait != Some(Duration::ZERO) && (n == 0 || precise) {
            // The wait may have blocked until a deadline: the time again, as before it. Not
            // when the wait ended with readiness (`n > 0`) and the timers' wait came from the
            // coarse clock (the deadline more than the margin away, `CoarseClock::far_wait`):
            // read again, the coarse clock would show the deadline still that far unless the
            // wait outlasted its timeout (a preempted thread), and a deadline due then fires in
            // the next tick, which reads the clock first and does not block. So a tick woken by
            // completions with no deadline near reads the clock once, not twice (issue 47, the
            // tick). `Core::clock.now` is only the timers' (`fire_timers`) and spinning's;
            // whatever schedules reads the clock itself (`read_clock`).
            self.tick_clock(spin_cfg);
        }
        for i in 0..n {
            let ev = self.events[i];
            match Token::from_u64(ev.data()) {
                Some(t) if t.kind() == Kind::CmChannel => work += self.drain_cm()?,
                Some(t) if t.kind() == Kind::CompChannel => {
                    if ev.events().intersects(EpollFlags::EPOLLERR | EpollFlags::EPOLLHUP) {
                        // A disassociated device: its channel reports an error on every wait.
                        self.device_lost(t.index() as usize, CloseReason::DeviceRemoval);
                        work += 1;
                    } else {
                        work += self.drain_comp(t.index() as usize);
                    }
                }
                Some(t) if t.kind() == Kind::Device => work += self.drain_async(t.index() as usize),
                Some(t) if t.kind() == Kind::UserFd => work += self.dispatch_fd(t, ev.events()),
                Some(t) if t.kind() == Kind::Remote => work += self.drain_remote(),
                _ => {}
            }
        }
        work += self.poll_hot();
        work += self.fire_timers(self.clock.now);
        work += self.run_tasks();
        work += self.admit_waiting();
        self.flush_posts();
        // `block_on`'s future, woken in this tick, is polled right after it: it arms them
        // after its own posts (`Reactor::block_on`), as a task's posts come before the arm.
        if !spin && (!block_on || !self.exec.main_is_woken()) {
            work += self.arm_after_posts();
        }
        self.flush_acks();
        work += self.reap();
        self.compact_timers();
        // Waiting connect requests count: a reactor with a queue is not idle (`Balance::Fewest`).
        self.inbox.publish_load(self.conns.len() + self.waiting.len());
        if n > 0 && work == 0 {
            self.stats.spurious_wakeups += 1;
        }
        if work > 0 && spin_cfg {
            self.spin.until = self.clock.now.checked_add(self.cfg.spin);
        } else if spin && work == 0 {
            self.stats.idle_spins += 1;
        }
        Ok(work)
    }

    /// Step 6's end: arms what the tick emptied only after its posts, and polls it after the
    /// arm (on rxe and siw; elsewhere before and after it: `Core::arm_and_poll`), so a send
    /// that completed at once (its ACK came back while it was posted) is reaped now, not after
    /// another wakeup; then posts what that poll's callbacks submitted. A CQ left unarmed (a
    /// tick that did not arm) is armed by the next tick before it waits.
    pub(in crate::reactor) fn arm_after_posts(&mut self) -> usize {
        if self.work.spinning.is_empty() {
            return 0;
        }
        let work = self.poll_spinning(false);
        self.flush_posts();
        work
    }

    /// Reads the clock for a full tick, and returns how long the timers let its wait last
    /// (`None`: no timer). The precise clock, which can be a system call (an emulated HPET in
    /// the test VM), is read when the spin time needs it, or a deadline is within the coarse
    /// clock's margin (`Core::timer_clock`); otherwise the timers make do with the coarse
    /// clock (vDSO), and without timers or spinning the clock is not read at all.
    ///
    /// Also whether it read the precise clock.
    fn tick_clock(&mut self, spinning: bool) -> (Option<Duration>, bool) {
        if spinning {
            let now = self.read_clock();
            (self.timers.next_timeout(now), true)
        } else {
            self.timer_clock()
        }
    }

    /// A tick while spinning between two full ones: poll the unarmed and hot CQs, post, ack and
    /// destroy; no `epoll_wait`, no clock, no timers (the next full tick, at most
    /// `SPIN_WAIT_EVERY` ticks away, does those).
    ///
    /// Lean: when only completions are pending it polls, dispatches and posts, as perftest's
    /// loop does; each other step returns at once when its list is empty.
    fn spin_tick(&mut self) -> usize {
        self.spin.skipped += 1;
        let mut work = self.poll_spinning(true);
        work += self.poll_hot();
        if self.exec.has_work() {
            work += self.run_tasks();
        }
        self.flush_posts();
        self.flush_acks();
        work += self.reap();
        self.spin.worked |= work > 0;
        self.stats.idle_spins += u64::from(work == 0);
        work
    }
}

#[cfg(test)]
mod tests {
    use super::wait_ms;
    use std::time::Duration;

    #[test]
    fn waits_round_up_to_whole_milliseconds_and_saturate() {
        assert_eq!(wait_ms(Duration::ZERO), 0);
        assert_eq!(wait_ms(Duration::from_nanos(300)), 1);
        assert_eq!(wait_ms(Duration::from_micros(300)), 1);
        assert_eq!(wait_ms(Duration::from_millis(1)), 1);
        assert_eq!(wait_ms(Duration::from_nanos(1_000_001)), 2);
        assert_eq!(wait_ms(Duration::new(2, 999_000_001)), 3000);
        assert_eq!(wait_ms(Duration::new(5, 0)), 5000);
        assert_eq!(wait_ms(Duration::from_secs(u64::MAX)), i32::MAX as u32);
        assert_eq!(wait_ms(Duration::MAX), i32::MAX as u32);
        for ns in [1u64, 999_999, 1_000_000, 1_500_000, 123_456_789_012] {
            let d = Duration::from_nanos(ns);
            assert_eq!(u128::from(wait_ms(d)), d.as_nanos().div_ceil(1_000_000), "{ns} ns");
        }
    }
}
