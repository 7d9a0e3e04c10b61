//! A dropped stream's lingering close (issue 46): the bytes it accepted still go, then the
//! connection closes.
//!
//! TCP's `close` returns at once and the kernel delivers what the socket holds, then ends
//! the connection. A stream's messages in flight are its reactor's, which delivers them too,
//! but closing the connection at once would flush them (on InfiniBand and RoCE the queue pair
//! goes to the error state): `write_all(response); return;` lost the response. So a dropped
//! stream hands its messages in flight to a task of its reactor, which sends the end-of-stream
//! marker after them, waits until all of them completed (the peer's device acknowledged them;
//! on iWARP the local TCP stack took them, and the close handshake then keeps the disconnect
//! until the peer has them), and closes the connection.
//!
//! Bounded: the task holds what the stream held (at most its window of messages, and the
//! marker) for at most the linger time (`Stream::set_linger`), then closes whatever is left.
//! It never holds the reactor: it is a task like any other, and a shutdown of the reactor
//! closes its connection with the others, which completes its messages (flushed) and ends it.

use std::collections::VecDeque;
use std::time::Duration;

use crate::error::Error;
use crate::io::connection::{Connection, OpFuture};
use crate::sys::pool::Buf;

/// The first wait for memory for the marker, doubled while memory stays short, to its most.
const MEMORY_FIRST: Duration = Duration::from_millis(5);
const MEMORY_MAX: Duration = Duration::from_millis(100);

/// Waits for `sends` (and, when `marker` is given, the end-of-stream marker sent after them,
/// in the spare buffer it holds if any) for at most `limit`, then closes `conn`.
pub(super) async fn linger(
    conn: Connection,
    mut sends: VecDeque<OpFuture>,
    marker: Option<Option<Buf>>,
    limit: Duration,
) {
    let delivered = async {
        if let Some(spare) = marker {
            let mut buf = spare.and_then(|mut b| b.set_len(0).ok().map(|()| b));
            let mut wait = MEMORY_FIRST;
            while buf.is_none() {
                match conn.alloc(0) {
                    Ok(b) => buf = Some(b),
                    // No memory for it now (the connection at its budget, the pool at its
                    // maximum): the oldest send's buffer, once it completed, or memory a
                    // moment later. Within the linger time: the hostile review of issue 46
                    // found the marker skipped, the peer then read a reset, not the end.
                    Err(Error::OverBudget { .. } | Error::PoolExhausted { .. }) => match sends.pop_front() {
                        Some(send) => {
                            let (res, b) = send.await;
                            if res.is_err() {
                                return;
                            }
                            buf = b.and_then(|mut b| b.set_len(0).ok().map(|()| b));
                        }
                        None => {
                            if crate::io::time::sleep(wait).await.is_err() {
                                // Out of its reactor's reach: its timers with it.
                                return;
                            }
                            wait = (wait * 2).min(MEMORY_MAX);
                        }
                    },
                    // The connection ended: nothing more will go.
                    Err(_) => return,
                }
            }
            if let Some(b) = buf {
                sends.push_back(conn.send(b));
            }
        }
        // RC completes in order: the last completion is the last message's.
        while let Some(send) = sends.pop_front() {
            if send.await.0.is_err() {
                // The connection failed or was closed meanwhile: nothing more will go.
                break;
            }
        }
    };
    let _ = crate::io::timeout(limit, delivered).await;
    conn.start_close();
}
