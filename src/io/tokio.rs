//! The tokio driver (feature `tokio`): [`drive`] runs a reactor inside a tokio task, through
//! [`AsyncFd`] on its epoll fd and a tokio timer for [`Reactor::next_timeout`], so RDMA
//! futures and tokio's own (TCP, timers, channels) are awaited in the same task.
//!
//! The driver keeps a [`LocalSet`] of its own, entered while it runs: a task started inside it
//! with `tokio::task::spawn_local` (hyper's habit: a task per connection) is polled inside the
//! driver's poll, where the reactor is at hand, so the async face works there as in the
//! reactor's own tasks (issue 46; before, such a task compiled and failed with `NoReactor`).
//! The reactor stays reachable only while the driver polls, as before: nothing of it outlives
//! a poll.

use std::future::Future;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use ::tokio::io::unix::AsyncFd;
use ::tokio::task::LocalSet;
use ::tokio::time::{Instant, Sleep};

use crate::error::{Error, Result};
use crate::reactor::Reactor;

/// How many ticks one poll of the driver runs at most before it yields to tokio.
const TICKS_PER_POLL: usize = 16;

/// The reactor's epoll fd, as tokio registers it.
struct EpollFd(RawFd);

impl AsRawFd for EpollFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// [`drive`]'s future.
pub struct Drive<'r, F: Future> {
    reactor: &'r mut Reactor,
    fut: Pin<Box<F>>,
    /// The tasks `tokio::task::spawn_local` starts inside the driver, polled in its poll;
    /// `None` once `fut` completed (they were dropped then, inside the reactor's reach).
    local: Option<LocalSet>,
    fd: AsyncFd<EpollFd>,
    sleep: Pin<Box<Sleep>>,
}

impl<F: Future> std::fmt::Debug for Drive<'_, F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Drive").field("reactor", &self.reactor).finish()
    }
}

/// Runs `fut` to completion inside a tokio task, running `reactor` (its ticks and its
/// spawned tasks) meanwhile: the async face (`rdma_reactor::io`) works inside `fut` next to
/// tokio's own futures. Await it on a current-thread runtime or in a
/// [`LocalSet`] (the reactor is not `Send`).
///
/// Tasks started with `tokio::task::spawn_local` inside `fut` (or inside the reactor's tasks,
/// or inside such a task) run in a `LocalSet` of the driver's own, polled within the driver's
/// poll: the async face works in them too. They end with `fut`: when it completes they are
/// dropped (as a `LocalSet` drops its tasks), inside the reactor's reach, so a byte stream
/// they held closes as a dropped stream does.
///
/// The task sleeps in tokio: the reactor's epoll fd is registered with tokio's
/// ([`AsyncFd`]), and a tokio timer covers [`Reactor::next_timeout`]. Each wakeup runs the
/// reactor's ticks without blocking ([`Reactor::run_once`] with a zero timeout), at most 16
/// in a row before it yields to tokio's other tasks.
///
/// # Errors
///
/// Registering the fd with tokio failed (not inside a tokio runtime with IO enabled), or the
/// reactor's loop failed ([`Reactor::run_once`]'s errors).
pub fn drive<F: Future>(reactor: &mut Reactor, fut: F) -> Result<Drive<'_, F>> {
    // `with_interest` (deprecated in tokio 1.54 for `register_with_interest`, which is
    // `unsafe` and not in the older tokio this crate accepts): the fd is the reactor's epoll fd,
    // which outlives the `AsyncFd`, since `Drive` borrows the reactor and drops the `AsyncFd`
    // with itself; it is not closed or replaced meanwhile.
    #[allow(deprecated)]
    let fd = AsyncFd::with_interest(EpollFd(reactor.as_raw_fd()), tokio::io::Interest::READABLE)
        .map_err(|source| Error::Os { call: "tokio AsyncFd::new (the reactor's epoll fd)", source })?;
    Ok(Drive {
        reactor,
        fut: Box::pin(fut),
        local: Some(LocalSet::new()),
        fd,
        sleep: Box::pin(tokio::time::sleep(Duration::ZERO)),
    })
}

impl<F: Future> Future for Drive<'_, F> {
    type Output = Result<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let Some(local) = &this.local else {
            return Poll::Ready(Err(Error::Config("the tokio driver was polled after it completed".into())));
        };
        // `spawn_local` inside the driver's poll (its future, the reactor's tasks, the local
        // tasks themselves) starts a task of the driver's set.
        let _local = local.enter();
        for _ in 0..TICKS_PER_POLL {
            let (fut, local) = (&mut this.fut, &mut this.local);
            // The future, then the local tasks it woke or started, with the reactor at hand.
            let step = std::pin::pin!(std::future::poll_fn(|cx| {
                if let Poll::Ready(v) = fut.as_mut().poll(cx) {
                    return Poll::Ready(v);
                }
                if let Some(set) = local.as_mut() {
                    // Ready means no task is left; new ones may come: polled again next time.
                    let _ = Pin::new(set).poll(cx);
                }
                Poll::Pending
            }));
            let f: Pin<&mut dyn Future<Output = F::Output>> = step;
            if let Poll::Ready(v) = this.reactor.poll_inside(f, cx.waker()) {
                // The local tasks end with the future, dropped where the reactor is at hand.
                let mut set = this.local.take();
                let end = std::pin::pin!(std::future::poll_fn(|_| {
                    drop(set.take());
                    Poll::Ready(())
                }));
                let _ = this.reactor.poll_inside(end, cx.waker());
                return Poll::Ready(Ok(v));
            }
            if let Err(e) = this.reactor.run_once(Some(Duration::ZERO)) {
                return Poll::Ready(Err(e));
            }
            // Registered before the timeout is read: an event after it makes the fd readable.
            let fd_ready = match this.fd.poll_read_ready(cx) {
                Poll::Ready(Ok(mut guard)) => {
                    guard.clear_ready();
                    true
                }
                Poll::Ready(Err(source)) => {
                    return Poll::Ready(Err(Error::Os { call: "tokio AsyncFd::poll_read_ready", source }))
                }
                Poll::Pending => false,
            };
            match this.reactor.next_timeout() {
                Some(t) if t.is_zero() => continue,
                // (A deadline too far for the clock to hold is none: the fd brings the work.)
                Some(t) => {
                    if let Some(at) = Instant::now().checked_add(t) {
                        this.sleep.as_mut().reset(at);
                        if this.sleep.as_mut().poll(cx).is_ready() {
                            continue;
                        }
                    }
                }
                None => {}
            }
            if !fd_ready {
                return Poll::Pending;
            }
        }
        // Still busy after a burst: let tokio's other tasks run, then come back.
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}
