//! Embedding the reactor in another event loop (tokio, mio, a `poll(2)` loop): its epoll fd
//! ([`AsFd`], [`AsRawFd`]) and how long the outer loop may sleep ([`Reactor::next_timeout`]).
//!
//! An epoll fd is itself pollable: it is readable while any fd in its set is ready (the rdma_cm
//! channel, a completion channel, a device's event fd, the [`Remote`](crate::reactor::Remote) eventfd,
//! a registered fd). What is not an fd, the outer loop learns from `next_timeout`: posts or
//! destruction left for a tick, CQs over budget or spinning (zero), and the next deadline.
//! The outer loop:
//!
//! ```text
//! loop {
//!     wait until reactor.as_fd() is readable, or its other fds are, at most next_timeout()
//!     reactor.run_once(Some(Duration::ZERO))   // never blocks
//!     handle its other fds
//! }
//! ```

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::time::{Duration, Instant};

use crate::reactor::{Core, Reactor};

/// The reactor's epoll fd, for an outer event loop to wait on (readable, level-triggered, in
/// `poll(2)`, `epoll`, mio's `SourceFd` or tokio's `AsyncFd`). It is readable while the
/// reactor has events to handle; call [`Reactor::run_once`] with `Some(Duration::ZERO)` then,
/// and also when [`Reactor::next_timeout`] has run out, without readiness. Do not read it,
/// change its set or close it.
impl AsFd for Reactor {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.core.epoll.0.as_fd()
    }
}

/// See [`AsFd`](#impl-AsFd-for-Reactor).
impl AsRawFd for Reactor {
    fn as_raw_fd(&self) -> RawFd {
        self.core.epoll.0.as_raw_fd()
    }
}

impl Core {
    fn next_timeout(&self) -> Option<Duration> {
        let now = Instant::now;
        let spinning = self.spin.on
            || self.spin.worked
            || (!self.cfg.spin.is_zero() && self.spin.until.is_some_and(|until| now() < until));
        let busy = spinning
            || !self.work.spinning.is_empty()
            || !self.work.hot.is_empty()
            || !self.work.dirty.is_empty()
            || !self.closing.conns.is_empty()
            || !self.closing.listeners.is_empty()
            || !self.closing.rejected.is_empty()
            || self.exec.has_work()
            // As the tick's own test: a connect request that can be decided now (review of
            // 2026-12-07, N11; one that cannot has its expiry among the timers).
            || self.waiting_can_go()
            // Pool memory came back while a shared receive queue's receives wait for it.
            || self.srq_memory_back();
        if busy {
            return Some(Duration::ZERO);
        }
        // The same clock as the tick's (`Core::timer_clock`): a deadline the outer loop thinks
        // due is one the tick finds due.
        self.timer_timeout()
    }
}

impl Reactor {
    /// How long an outer loop may wait for [this reactor's fd](#impl-AsFd-for-Reactor) before
    /// it must call [`run_once`](Reactor::run_once) anyway: zero when work is pending that no
    /// fd announces (posts or destruction left for a tick, a CQ over its budget, spinning),
    /// the time to the next deadline or timer otherwise, `None` when only an fd can bring work.
    /// It can be early (a cancelled timer), never late.
    pub fn next_timeout(&self) -> Option<Duration> {
        self.core.next_timeout()
    }
}
