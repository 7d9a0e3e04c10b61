//! [`Stream::into_split`]: a reader and a writer two tasks can own, as `TcpStream`'s owned
//! halves. The halves share the stream through an `Rc<RefCell<..>>` on the reactor's thread:
//! no lock, and each call borrows it only for its own length (no call of one half reaches the
//! other, so the borrow is never contended; were it, the call would fail, not panic).

use std::cell::RefCell;
use std::io;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};

use ::tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::{Stream, WriteEnd};

type Shared = Rc<RefCell<Stream>>;

pub(super) fn split(stream: Stream) -> (OwnedReadHalf, OwnedWriteHalf) {
    let shared = Rc::new(RefCell::new(stream));
    (OwnedReadHalf { shared: shared.clone() }, OwnedWriteHalf { shared: Some(shared) })
}

/// Runs `f` on the stream, borrowed for this call only.
fn with<T>(shared: &RefCell<Stream>, f: impl FnOnce(&mut Stream) -> Poll<io::Result<T>>) -> Poll<io::Result<T>> {
    match shared.try_borrow_mut() {
        Ok(mut s) => f(&mut s),
        Err(_) => Poll::Ready(Err(io::Error::other("the stream is in use by its other half (a call inside a call)"))),
    }
}

/// The reading half of a [`Stream`] ([`Stream::into_split`]): [`AsyncRead`].
pub struct OwnedReadHalf {
    shared: Shared,
}

/// The writing half of a [`Stream`] ([`Stream::into_split`]): [`AsyncWrite`]. Dropping it
/// shuts the stream's writing down, as `TcpStream`'s write half does: the end marker goes
/// after what was written, sent by a task of the stream's reactor that polls the shutdown for
/// at most the stream's linger time ([`Stream::set_linger`]) and holds the stream meanwhile.
pub struct OwnedWriteHalf {
    /// `None` only once given back to [`OwnedReadHalf::reunite`].
    shared: Option<Shared>,
}

impl std::fmt::Debug for OwnedReadHalf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedReadHalf").finish_non_exhaustive()
    }
}

impl std::fmt::Debug for OwnedWriteHalf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedWriteHalf").finish_non_exhaustive()
    }
}

/// The halves given to [`OwnedReadHalf::reunite`] were not of the same stream: both back.
#[derive(Debug)]
pub struct ReuniteError(pub OwnedReadHalf, pub OwnedWriteHalf);

impl std::fmt::Display for ReuniteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("tried to reunite halves that are not from the same stream")
    }
}

impl std::error::Error for ReuniteError {}

impl OwnedReadHalf {
    /// The stream again, from its two halves; `ReuniteError` (with both) when `write` is
    /// another stream's.
    ///
    /// # Errors
    ///
    /// [`ReuniteError`] when the halves are not of the same stream.
    pub fn reunite(self, mut write: OwnedWriteHalf) -> Result<Stream, ReuniteError> {
        let same = write.shared.as_ref().is_some_and(|w| Rc::ptr_eq(w, &self.shared));
        if !same {
            return Err(ReuniteError(self, write));
        }
        // The write half gives its share back without shutting anything down.
        drop(write.shared.take());
        match Rc::try_unwrap(self.shared) {
            Ok(cell) => Ok(cell.into_inner()),
            // Not reachable (the two halves are the only owners), but never a panic.
            Err(shared) => {
                Err(ReuniteError(OwnedReadHalf { shared: shared.clone() }, OwnedWriteHalf { shared: Some(shared) }))
            }
        }
    }

    /// True once the peer's end-of-stream marker arrived ([`Stream::peer_shut_down`]).
    pub fn peer_shut_down(&self) -> bool {
        self.shared.try_borrow().is_ok_and(|s| s.peer_shut_down())
    }
}

impl AsyncRead for OwnedReadHalf {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        with(&self.shared, |s| s.read(cx, buf))
    }
}

impl AsyncWrite for OwnedWriteHalf {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match &self.shared {
            Some(shared) => with(shared, |s| s.write_vectored(cx, bufs)),
            None => Poll::Ready(Err(io::Error::from(io::ErrorKind::NotConnected))),
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &self.shared {
            Some(shared) => with(shared, |s| s.flush(cx)),
            None => Poll::Ready(Ok(())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &self.shared {
            Some(shared) => with(shared, |s| s.shutdown(cx)),
            None => Poll::Ready(Ok(())),
        }
    }
}

impl Drop for OwnedWriteHalf {
    fn drop(&mut self) {
        let Some(shared) = self.shared.take() else { return };
        if Rc::strong_count(&shared) == 1 {
            // The last half: the stream's own drop (its lingering close) follows.
            return;
        }
        // The read half lives on: the writing ends now, as TCP's write half's drop ends it.
        // A task does it (the window may be full, and nothing else would poll the write side
        // again), bounded by the linger time; it holds the stream until then.
        let Ok(s) = shared.try_borrow() else { return };
        if s.ends.write != WriteEnd::Open || s.ends.closing {
            return;
        }
        let (conn, limit) = (s.conn.clone(), s.linger);
        drop(s);
        let task = async move {
            let shut = std::future::poll_fn(|cx| match shared.try_borrow_mut() {
                Ok(mut s) => s.shutdown(cx),
                Err(_) => Poll::Ready(Ok(())),
            });
            if crate::io::timeout(limit, shut).await.is_err() && Rc::strong_count(&shared) == 1 {
                // The linger time is spent and the read half is gone too: the stream's own
                // drop, next, closes at once rather than lingering a second time. (With the
                // read half alive, its drop later lingers as a stream's does: the marker may
                // still go then.)
                if let Ok(mut s) = shared.try_borrow_mut() {
                    s.linger = std::time::Duration::ZERO;
                }
            }
        };
        conn.spawn_at_home(Box::pin(task));
    }
}
