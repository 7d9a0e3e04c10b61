//! Time on the reactor: [`sleep`], [`sleep_until`] and [`timeout`], so a program without
//! another runtime can bound a [`recv`](super::Connection::recv) or pace a loop.
//!
//! A sleep is a deadline on the reactor's own timer heap (the one its connections' deadlines
//! use): the reactor's `epoll_wait` wakes for it, and the sleeping task is woken in the tick
//! that fires it. Under the tokio driver (`io::tokio::drive`) tokio's own timers work as well,
//! inside the crate's tasks and outside them; these work wherever the async face does.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::proto::token::TimerKey;
use crate::reactor::{with_ctx, with_ctx_of, ExecId};

/// A future that resolves once `duration` has passed (measured from this call).
///
/// # Errors
///
/// The future resolves to [`Error::NoReactor`] when it is polled where no reactor polls it
/// (and the time is not over yet).
///
/// ```no_run
/// use std::time::Duration;
/// use rdma_reactor::{io, Reactor};
///
/// let mut reactor = Reactor::new()?;
/// reactor.block_on(async { io::sleep(Duration::from_millis(10)).await })??;
/// # Ok::<(), rdma_reactor::Error>(())
/// ```
pub fn sleep(duration: Duration) -> Sleep {
    sleep_until(Instant::now().checked_add(duration).unwrap_or_else(far_future))
}

/// A future that resolves at `deadline` (at once if it has passed). See [`sleep`].
pub fn sleep_until(deadline: Instant) -> Sleep {
    Sleep { deadline, key: None }
}

/// Bounds `fut` by `limit`: its output if it is ready first, else [`Error::Elapsed`], and `fut`
/// is dropped then. For the async face's futures that gives up the operation's result, never
/// the operation: a send is still sent, and a `recv` leaves the line, so a message that comes
/// later goes to the next caller. (After a request/response timed out, its late reply would be
/// taken as the next request's: close the connection, or match replies to requests by an id
/// of your protocol.)
///
/// ```no_run
/// use std::time::Duration;
/// use rdma_reactor::io::{self, Connection};
///
/// async fn ask(conn: &Connection) -> rdma_reactor::Result<usize> {
///     let reply = io::timeout(Duration::from_secs(1), conn.recv()).await??;
///     Ok(reply.len())
/// }
/// ```
pub fn timeout<F: Future>(limit: Duration, fut: F) -> Timeout<F> {
    Timeout { fut: Some(Box::pin(fut)), sleep: sleep(limit), limit }
}

/// Some 30 years on: a deadline too far to represent is as good as never.
fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(86_400 * 365 * 30)
}

/// [`sleep`]'s and [`sleep_until`]'s future.
#[derive(Debug)]
pub struct Sleep {
    deadline: Instant,
    /// Its entry on the timers of the reactor that first polled it (or last: polled by another
    /// reactor on this thread, the entry is made anew there, and the key is only ever used
    /// with the reactor it belongs to: `with_ctx_of`).
    key: Option<(ExecId, TimerKey)>,
}

impl Sleep {
    /// When it resolves.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }
}

impl Future for Sleep {
    type Output = Result<()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if Instant::now() >= self.deadline {
            if let Some((home, key)) = self.key.take() {
                let _ = with_ctx_of(home, |ctx| ctx.cancel_wake(key));
            }
            return Poll::Ready(Ok(()));
        }
        let (deadline, key) = (self.deadline, self.key);
        let key = with_ctx(|ctx| {
            let here = ctx.exec_id();
            match key {
                Some((home, k)) if home == here && ctx.set_wake(k, cx.waker()) => (here, k),
                // Not polled yet, it fired early (the reactor's clock may run behind this one
                // by less than its resolution), or polled by another reactor than before (the
                // old entry wakes once, for nothing, at the deadline): on the timers here.
                _ => (here, ctx.wake_at(deadline, cx.waker().clone())),
            }
        });
        match key {
            Ok(k) => {
                self.key = Some(k);
                Poll::Pending
            }
            Err(e) => Poll::Ready(Err(e)),
        }
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        if let Some((home, key)) = self.key.take() {
            // Outside its reactor the entry stays until its deadline, when its waker is woken
            // once, for nothing, and dropped.
            let _ = with_ctx_of(home, |ctx| ctx.cancel_wake(key));
        }
    }
}

/// [`timeout`]'s future.
pub struct Timeout<F: Future> {
    /// `None` once it resolved: a timed-out future is dropped at once.
    fut: Option<Pin<Box<F>>>,
    sleep: Sleep,
    limit: Duration,
}

impl<F: Future> std::fmt::Debug for Timeout<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Timeout").field("limit", &self.limit).field("deadline", &self.sleep.deadline).finish()
    }
}

impl<F: Future> Future for Timeout<F> {
    type Output = Result<F::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(fut) = self.fut.as_mut() else {
            return Poll::Ready(Err(Error::Config("io::Timeout polled after it resolved".into())));
        };
        if let Poll::Ready(v) = fut.as_mut().poll(cx) {
            self.fut = None;
            return Poll::Ready(Ok(v));
        }
        let r = match Pin::new(&mut self.sleep).poll(cx) {
            Poll::Ready(Ok(())) => Err(Error::Elapsed(self.limit)),
            Poll::Ready(Err(e)) => Err(e),
            Poll::Pending => return Poll::Pending,
        };
        // Given up: dropped now, not when the `Timeout` is (a `Recv` leaves the line).
        self.fut = None;
        Poll::Ready(r)
    }
}
