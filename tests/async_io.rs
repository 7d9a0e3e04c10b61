//! The async face (`rdma_reactor::io`, issue 20) on a real device: many tasks on one
//! connection and across connections with every byte verified, a future dropped mid-flight,
//! a peer's close reaching every waiting task, a panicking task, `aecho` against `echo`
//! both ways, and the one size contract (the review's M2, issue 32 item 1: receives of the
//! smaller of the peer's claim and the local size, a send above the peer's refused at submit).

mod util;

#[path = "async_io/closing.rs"]
mod closing;
#[path = "async_io/interop.rs"]
mod interop;
#[path = "async_io/refusals.rs"]
mod refusals;
#[path = "async_io/sizes.rs"]
mod sizes;
#[path = "async_io/tasks.rs"]
mod tasks;
#[path = "async_io/wakers.rs"]
mod wakers;

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use rdma_reactor::io::{self, Connection, Listener};
use rdma_reactor::{CloseReason, Completion, Conn, ConnectOptions, ConnectionHandler, Ctx, Error, Reactor, Token};
use util::*;

const LIMIT: Duration = Duration::from_secs(120);

/// Serves `listener`: one task per connection, echoing every message until the peer closes.
/// Returns how each served connection ended, as the tasks record it.
fn echo_server(reactor: &mut Reactor, listener: Listener) -> Rc<RefCell<Vec<String>>> {
    let ends = Rc::new(RefCell::new(Vec::new()));
    let e = ends.clone();
    let _accept = reactor.spawn(async move {
        while let Ok(conn) = listener.accept().await {
            let e = e.clone();
            let _task = io::spawn(async move {
                let why = loop {
                    match conn.recv().await {
                        Ok(msg) => {
                            if let (Err(err), _) = conn.send(msg).await {
                                break format!("echo failed: {err}");
                            }
                        }
                        Err(Error::Closed(r)) => break r.to_string(),
                        Err(err) => break format!("recv failed: {err}"),
                    }
                };
                e.borrow_mut().push(why);
            })
            .expect("on the reactor");
        }
    });
    ends
}

/// Header of a tagged message: the sender task and the sequence number, then the pattern.
fn tagged(len: usize, task: u64, seq: u64) -> Vec<u8> {
    let mut m = pattern(len, task, seq);
    m[..8].copy_from_slice(&task.to_be_bytes());
    m[8..16].copy_from_slice(&seq.to_be_bytes());
    m
}

/// Polls a future once, then drops it (a task that gave up on an operation).
struct PollOnce<F>(Option<Pin<Box<F>>>);

impl<F: Future> Future for PollOnce<F> {
    type Output = bool;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<bool> {
        let mut f = self.0.take().expect("polled once");
        let ready = f.as_mut().poll(cx).is_ready();
        drop(f);
        Poll::Ready(ready)
    }
}
