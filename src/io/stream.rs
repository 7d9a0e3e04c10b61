//! [`Stream`]: an established [`Connection`] as a byte stream, tokio's [`AsyncRead`] and
//! [`AsyncWrite`] (feature `tokio`).
//!
//! The stream adds no framing: its bytes are the connection's ordinary messages. A write is
//! one message of at most the connection's message size, copied into a pool buffer and
//! submitted; at most `window` sends are in flight, and a write beyond them waits for the
//! oldest to complete. A read copies out of the message at hand and drops its buffer once
//! emptied. The end of the write side is an empty message. The decisions that need no device
//! (which end comes when, the error kinds, how many bytes a write takes) are pure functions
//! and [`Ends`], unit-tested below.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use ::tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::connection::{Close, Connection, OpFuture, Recv};
use crate::error::Error;
use crate::proto::conn::CloseReason;
use crate::proto::op::{OpError, WcStatus};
use crate::sys::pool::Buf;

/// An established [`Connection`] as a byte stream: tokio's [`AsyncRead`] and [`AsyncWrite`]
/// (feature `tokio`), for code written against them (`tokio::io::copy`, codecs, hyper through
/// `hyper_util::rt::TokioIo`).
///
/// ```no_run
/// use rdma_reactor::io::{Connection, Stream};
/// use rdma_reactor::ConnectOptions;
/// use tokio::io::{AsyncReadExt, AsyncWriteExt};
///
/// async fn hello(addr: std::net::SocketAddr) -> std::io::Result<Vec<u8>> {
///     let conn = Connection::connect(addr, ConnectOptions::default()).await.map_err(std::io::Error::other)?;
///     let mut stream = Stream::new(conn);
///     stream.write_all(b"hello").await?;
///     stream.shutdown().await?; // the peer reads to its end
///     let mut reply = Vec::new();
///     stream.read_to_end(&mut reply).await?; // until the peer shuts down its side
///     Ok(reply)
/// }
/// ```
///
/// # Writing
///
/// - A write takes at most one message's worth of its bytes (the connection's message size:
///   the smaller of the two sides' stated sizes, the client's
///   [`ConnectOptions::msg_size`](crate::ConnectOptions::msg_size) or else
///   [`Config::msg_size`](crate::Config::msg_size), 64 KiB by default; a server states at most
///   that), copies them into a pool buffer and submits the
///   send; it is ready then, and returns how many it took. Vectored writes gather their slices
///   into one message.
/// - At most [`window`](Stream::window) sends are in flight (the queue pair's send slots,
///   within the receives the peer announced). A write beyond them is pending until the oldest
///   completes: a reader that stops reading stops granting credits, the sends stop completing,
///   and the writer waits, with at most `window` buffers of its own in use. Nothing is
///   buffered beyond that. The buffer of the last completed send is kept for the next write
///   (no pool round trip per message), so a stream holds one pool buffer of at most its
///   message size between writes, idle too, until it is dropped.
/// - `poll_flush` is ready when every submitted send has completed: the peer's device has the
///   bytes (on iWARP, the local TCP stack).
/// - `poll_shutdown` closes the write side: it sends an empty message after the data (the
///   end-of-stream marker) and is ready once everything, the marker included, has completed.
///   The peer reads the end of the stream and may still write back. Writing after it fails
///   with [`BrokenPipe`](io::ErrorKind::BrokenPipe).
///
/// # Reading
///
/// A read copies out of the message at hand and, while the caller's buffer has room, out of
/// the messages that have already arrived; a message's buffer goes back to the pool once read
/// to its end, and its receive is posted again. The stream reads its end (`Ok` with no
/// bytes) at the peer's end-of-stream marker, and also when the peer closes the connection
/// without one (a disconnect with no error: a dropped stream, an echo-style peer);
/// [`peer_shut_down`](Stream::peer_shut_down) tells the two apart.
///
/// # The end
///
/// When both sides have shut down (this side's marker completed and the peer's arrived), the
/// stream closes the connection (the close handshake where the transport needs it). Dropping
/// the stream closes it too: call `shutdown` (or at least `flush`) first, since a send still
/// in flight at the close may be lost (flushed) on InfiniBand and RoCE.
///
/// # Errors
///
/// Every error is an [`io::Error`] whose source is the crate's [`Error`], its kind mapped
/// from how the connection ended ([`kind_of_close`]): the peer's disconnect is
/// [`BrokenPipe`](io::ErrorKind::BrokenPipe) for a writer (and the end of the stream for a
/// reader), a retry or credit timeout [`TimedOut`](io::ErrorKind::TimedOut), a device's
/// failure or a peer's violation [`ConnectionReset`](io::ErrorKind::ConnectionReset) or
/// [`ConnectionAborted`](io::ErrorKind::ConnectionAborted), a reactor shut down
/// `ConnectionAborted`, a closed or not yet connected one
/// [`NotConnected`](io::ErrorKind::NotConnected); a pool at its maximum is
/// [`OutOfMemory`](io::ErrorKind::OutOfMemory).
///
/// # Where it may be polled
///
/// Where the rest of the async face may: in a task of the reactor
/// ([`Reactor::spawn`](crate::Reactor::spawn), [`io::spawn`](crate::io::spawn)), in
/// [`Reactor::block_on`](crate::Reactor::block_on)'s future, or in the future given to
/// [`io::tokio::drive`](crate::io::tokio::drive) (and the reactor's tasks under it, which may
/// use tokio's sockets and timers too: `tokio::io::copy` between a `TcpStream` and a `Stream`
/// works there). Polled anywhere else (a task spawned on tokio, another thread) every call
/// fails with an [`Other`](io::ErrorKind::Other) error whose source is [`Error::NoReactor`].
///
/// # The message API on the other side
///
/// The stream's bytes are the connection's ordinary messages: a peer using
/// [`Connection::recv`] (or a callback handler) sees its bytes in messages of at most its own
/// message size, cut where the writes were cut (no framing to parse), and an empty message at
/// the shutdown; a peer's messages are read by the stream as consecutive bytes, and an empty
/// message ends the stream. So a stream interoperates with the `echo` and `aecho` examples'
/// servers: they echo its messages as they came, the empty marker included, and the stream
/// reads its bytes back, then its own marker as the end (`tests/stream.rs`). A message
/// protocol that gives an empty message another meaning cannot share a connection with a
/// stream.
///
/// The stream owns the connection's receives: do not call [`Connection::recv`] on a clone
/// while a stream reads (each would take some of the other's messages).
pub struct Stream {
    conn: Connection,
    /// Set at the first write: the largest message, and the most sends in flight.
    limits: Option<(usize, usize)>,
    /// The sends in flight, oldest first (the end-of-stream marker among them).
    sends: std::collections::VecDeque<OpFuture>,
    /// The buffer of the last send that completed, for the next write (no pool round trip per
    /// message); with the sends in flight, never more than `window` buffers.
    spare: Option<Buf>,
    /// The first error of the write side (a failed send): every later write and flush fails
    /// with it.
    write_err: Option<(io::ErrorKind, Error)>,
    /// A send failed (a flush, a cancel) before the connection's end was known: its end, whose
    /// reason becomes the write side's error.
    why: Option<Close>,
    /// The receive waited for, in the connection's line.
    recv: Option<Recv>,
    /// The message being read, and how far.
    cur: Option<(Buf, usize)>,
    /// An error of the read side, reported after the bytes read before it.
    read_err: Option<(io::ErrorKind, Error)>,
    ends: Ends,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream")
            .field("conn", &self.conn)
            .field("limits", &self.limits)
            .field("in_flight", &self.sends.len())
            .field("ends", &self.ends)
            .finish()
    }
}

/// Which ends of a stream have come, pure: when the connection is closed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ends {
    /// This side's write end.
    pub(crate) write: WriteEnd,
    /// The peer's end arrived (its marker, or its disconnect).
    pub(crate) read_done: bool,
    /// The peer's end was its marker.
    pub(crate) marked: bool,
    /// The stream started the connection's close.
    pub(crate) closing: bool,
}

/// This side's write end.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WriteEnd {
    /// Writes go.
    #[default]
    Open,
    /// The end-of-stream marker is submitted, not yet completed.
    Marked,
    /// The marker completed (after every send before it).
    Shut,
}

impl Ends {
    /// Both sides have shut down and the stream has not closed the connection yet: close it
    /// now (and note it).
    pub(crate) fn close_due(&mut self) -> bool {
        let due = !self.closing && self.write == WriteEnd::Shut && self.read_done;
        self.closing |= due;
        due
    }
}

/// How many bytes one write takes of `lens` (a vectored write's slices): at most `max`, the
/// message size.
pub(crate) fn take(lens: impl IntoIterator<Item = usize>, max: usize) -> usize {
    lens.into_iter().fold(0usize, |n, l| n.saturating_add(l)).min(max)
}

/// The [`io::ErrorKind`] of a connection that ended with `reason`, for a `writer` (a reader
/// gets the end of the stream for a clean close instead).
pub fn kind_of_close(reason: &CloseReason, writer: bool) -> io::ErrorKind {
    use io::ErrorKind as K;
    match reason {
        CloseReason::Peer if writer => K::BrokenPipe,
        CloseReason::Peer => K::UnexpectedEof,
        CloseReason::Local => K::NotConnected,
        CloseReason::Shutdown | CloseReason::DeviceRemoval => K::ConnectionAborted,
        CloseReason::AsyncEvent(_) | CloseReason::CqFailed { .. } => K::ConnectionAborted,
        CloseReason::Timeout(_) | CloseReason::Stalled(_) => K::TimedOut,
        CloseReason::WorkError(WcStatus::RetryExcErr | WcStatus::RnrRetryExcErr) => K::TimedOut,
        CloseReason::WorkError(_) | CloseReason::PeerViolation => K::ConnectionReset,
        CloseReason::Protocol(_) => K::InvalidData,
        CloseReason::Rejected { .. } | CloseReason::ConnectError(_) => K::ConnectionRefused,
        CloseReason::AddrError(_) | CloseReason::RouteError(_) | CloseReason::Unreachable(_) => K::NotConnected,
        CloseReason::Setup(_) => K::Other,
    }
}

/// The kind of one of the crate's errors as the stream reports it (`writer`: on the write
/// side); a failed operation takes the connection's close reason when it has one.
fn kind_of(e: &Error, close: Option<&CloseReason>, writer: bool) -> io::ErrorKind {
    use io::ErrorKind as K;
    match (e, close) {
        (Error::Closed(r), _) | (Error::Operation(_), Some(r)) => kind_of_close(r, writer),
        (Error::Operation(OpError::Wc(WcStatus::RetryExcErr | WcStatus::RnrRetryExcErr)), None) => K::TimedOut,
        (Error::Operation(OpError::Cancelled), None) => K::NotConnected,
        (Error::Operation(_), None) => K::ConnectionReset,
        (Error::NotConnected(_) | Error::StaleToken(_), _) => K::NotConnected,
        (Error::PoolExhausted { .. } | Error::Memlock { .. }, _) => K::OutOfMemory,
        (Error::TooLarge { .. } | Error::Config(_), _) => K::InvalidInput,
        (Error::Elapsed(_), _) => K::TimedOut,
        (Error::Unsupported(_), _) => K::Unsupported,
        _ => K::Other,
    }
}

fn io_err((kind, e): &(io::ErrorKind, Error)) -> io::Error {
    io::Error::new(*kind, copy(e))
}

/// A copy of a sticky error, for each `io::Error` made of it (the crate's `Error` is not
/// `Clone`: it can hold an `io::Error`): the same variant and words where it can, else its
/// text.
fn copy(e: &Error) -> Error {
    match e {
        Error::Closed(r) => Error::Closed(r.clone()),
        Error::Operation(o) => Error::Operation(*o),
        Error::NoReactor => Error::NoReactor,
        Error::PoolExhausted { max_bytes } => Error::PoolExhausted { max_bytes: *max_bytes },
        Error::NotConnected(s) => Error::NotConnected(s.clone()),
        other => Error::NotConnected(other.to_string()),
    }
}

/// Polled outside the connection's reactor (none polls here, or another one does): the error
/// every call then fails with.
fn no_reactor(conn: &Connection) -> Option<io::Error> {
    conn.unreachable().map(io::Error::other)
}

impl Stream {
    /// The byte stream over `conn`, an established connection (from
    /// [`Connection::connect`] or [`Listener::accept`](crate::io::Listener::accept)). The
    /// stream takes over its receives; dropping the stream closes the connection.
    pub fn new(conn: Connection) -> Stream {
        Stream {
            conn,
            limits: None,
            sends: std::collections::VecDeque::new(),
            spare: None,
            write_err: None,
            why: None,
            recv: None,
            cur: None,
            read_err: None,
            ends: Ends::default(),
        }
    }

    /// The connection under the stream (its token, addresses, close reason).
    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    /// Sends submitted and not yet completed (at most [`window`](Stream::window)).
    pub fn in_flight(&self) -> usize {
        self.sends.len()
    }

    /// The most sends the stream keeps in flight, once known (at the first write); `None`
    /// before.
    pub fn window(&self) -> Option<usize> {
        self.limits.map(|(_, w)| w)
    }

    /// The largest message a write sends, once known (at the first write).
    pub fn max_message(&self) -> Option<usize> {
        self.limits.map(|(m, _)| m)
    }

    /// True once the peer's end-of-stream marker arrived: its writer shut down. A stream that
    /// reads its end without it was ended by the peer's disconnect.
    pub fn peer_shut_down(&self) -> bool {
        self.ends.marked
    }

    /// The error of a failed operation or call, with its kind; sticky on the write side.
    fn fail(&self, e: Error, writer: bool) -> (io::ErrorKind, Error) {
        let close = self.conn.close_reason();
        let kind = kind_of(&e, close.as_ref(), writer);
        // A failed send of a closed connection says why it closed.
        let e = match (e, close) {
            (Error::Operation(_), Some(r)) => Error::Closed(r),
            (e, _) => e,
        };
        (kind, e)
    }

    /// Closes the connection once both sides have shut down.
    fn maybe_close(&mut self) {
        if self.ends.close_due() {
            self.conn.start_close();
        }
    }

    /// Takes the completed sends, oldest first, up to the first still in flight (whose waker
    /// is then `cx`'s). The first failure is kept.
    fn reap(&mut self, cx: &mut Context<'_>) {
        while let Some(front) = self.sends.front_mut() {
            match Pin::new(front).poll(cx) {
                Poll::Pending => return,
                Poll::Ready((res, buf)) => {
                    self.sends.pop_front();
                    match res {
                        Ok(_) => {
                            // Kept for the next write; any other goes back to the pool here.
                            if self.spare.is_none() {
                                self.spare = buf;
                            }
                        }
                        Err(_) if self.write_err.is_some() || self.why.is_some() => {}
                        Err(Error::Operation(_)) if self.conn.close_reason().is_none() => {
                            // The queue pair is in error and the connection closing: its
                            // reason (the peer's disconnect, a retry timeout...) says more.
                            self.why = Some(self.conn.closed());
                        }
                        Err(e) => self.write_err = Some(self.fail(e, true)),
                    }
                }
            }
        }
        if let Some(why) = &mut self.why {
            if let Poll::Ready(r) = Pin::new(why).poll(cx) {
                self.why = None;
                self.write_err = Some((kind_of_close(&r, true), Error::Closed(r)));
            }
        }
        let settled = self.write_err.is_none() && self.why.is_none();
        if self.ends.write == WriteEnd::Marked && self.sends.is_empty() && settled {
            self.ends.write = WriteEnd::Shut;
            self.maybe_close();
        }
    }

    /// Submits one message of `len` bytes gathered from `bufs`.
    fn submit(&mut self, bufs: &[io::IoSlice<'_>], len: usize, cx: &mut Context<'_>) -> io::Result<()> {
        let mut buf = match self.spare.take() {
            // The last completed send's buffer: it held this connection's bytes only, and
            // every byte of the new message is written below.
            Some(mut b) if b.capacity() >= len => {
                b.set_len(len).map_err(|e| io_err(&self.fail(e, true)))?;
                b
            }
            _ => self.conn.alloc(len).map_err(|e| io_err(&self.fail(e, true)))?,
        };
        if let Some(one) = bufs.iter().find(|b| !b.is_empty()) {
            if one.len() >= len {
                // The usual case: one slice, copied once.
                buf.fill_from(&one[..len]).map_err(|e| io_err(&self.fail(e, true)))?;
            } else {
                let out = buf.as_mut_slice();
                let mut at = 0;
                for b in bufs {
                    let n = b.len().min(len - at);
                    out[at..at + n].copy_from_slice(&b[..n]);
                    at += n;
                    if at == len {
                        break;
                    }
                }
            }
        }
        let mut send = self.conn.send(buf);
        // A refused submission fails this write (none of its bytes went). No waker yet: the
        // oldest send is polled (and so wakes this task) before any write or flush waits.
        match send.refused(cx.waker()) {
            None => {
                self.sends.push_back(send);
                Ok(())
            }
            Some((Ok(_), _)) => Ok(()),
            Some((Err(e), _)) => {
                let f = self.fail(e, true);
                let err = io_err(&f);
                self.write_err = Some(f);
                Err(err)
            }
        }
    }

    fn write_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Some(e) = no_reactor(&self.conn) {
            return Poll::Ready(Err(e));
        }
        if self.limits.is_none() {
            match self.conn.stream_limits() {
                Ok(l) => self.limits = Some(l),
                Err(e) => return Poll::Ready(Err(io_err(&self.fail(e, true)))),
            }
        }
        self.reap(cx);
        if let Some(e) = &self.write_err {
            return Poll::Ready(Err(io_err(e)));
        }
        if self.why.is_some() {
            // Woken by the connection's end.
            return Poll::Pending;
        }
        let window = self.limits.map_or(1, |(_, w)| w);
        if self.sends.len() >= window {
            // The oldest send's completion wakes this task.
            return Poll::Pending;
        }
        Poll::Ready(Ok(()))
    }

    fn write_vectored(&mut self, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        if self.ends.write != WriteEnd::Open {
            let e = Error::NotConnected("the stream's write side was shut down".into());
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::BrokenPipe, e)));
        }
        if bufs.iter().all(|b| b.is_empty()) {
            return Poll::Ready(Ok(0));
        }
        match self.write_ready(cx) {
            Poll::Ready(Ok(())) => {}
            other => return other.map(|r| r.map(|()| 0)),
        }
        let max = self.limits.map_or(1, |(m, _)| m);
        let len = take(bufs.iter().map(|b| b.len()), max);
        Poll::Ready(self.submit(bufs, len, cx).map(|()| len))
    }

    fn shutdown(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.ends.write == WriteEnd::Open {
            match self.write_ready(cx) {
                Poll::Ready(Ok(())) => {}
                other => return other,
            }
            // The end-of-stream marker: an empty message after the data.
            self.submit(&[], 0, cx)?;
            self.ends.write = WriteEnd::Marked;
        }
        self.flush(cx)
    }

    fn flush(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Some(e) = no_reactor(&self.conn) {
            return Poll::Ready(Err(e));
        }
        self.reap(cx);
        if let Some(e) = &self.write_err {
            return Poll::Ready(Err(io_err(e)));
        }
        if self.sends.is_empty() && self.why.is_none() {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    }

    fn read(&mut self, cx: &mut Context<'_>, out: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if let Some(e) = no_reactor(&self.conn) {
            return Poll::Ready(Err(e));
        }
        let start = out.filled().len();
        loop {
            if out.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            if let Some((buf, at)) = &mut self.cur {
                let bytes = &buf.as_slice()[*at..];
                let n = bytes.len().min(out.remaining());
                out.put_slice(&bytes[..n]);
                *at += n;
                if *at == buf.len() {
                    // Read to its end: the buffer goes back to the pool.
                    self.cur = None;
                }
                continue;
            }
            let progressed = out.filled().len() > start;
            if progressed && self.recv.is_none() && self.conn.unread() == 0 {
                // Nothing more has arrived: the bytes read are the answer (the next read
                // waits in line).
                return Poll::Ready(Ok(()));
            }
            if self.ends.read_done {
                return Poll::Ready(Ok(()));
            }
            if let Some(e) = &self.read_err {
                if progressed {
                    return Poll::Ready(Ok(()));
                }
                return Poll::Ready(Err(io_err(e)));
            }
            let conn = &self.conn;
            let recv = self.recv.get_or_insert_with(|| conn.recv());
            match Pin::new(recv).poll(cx) {
                Poll::Pending if progressed => return Poll::Ready(Ok(())),
                Poll::Pending => return Poll::Pending,
                Poll::Ready(got) => {
                    self.recv = None;
                    match got {
                        Ok(buf) if buf.is_empty() => {
                            // The peer's end-of-stream marker.
                            self.ends.read_done = true;
                            self.ends.marked = true;
                            self.maybe_close();
                        }
                        Ok(buf) => self.cur = Some((buf, 0)),
                        Err(Error::Closed(r)) if r.is_clean() => {
                            // The peer's disconnect (or this side's close): the end.
                            self.ends.read_done = true;
                        }
                        Err(e) => self.read_err = Some(self.fail(e, false)),
                    }
                }
            }
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        self.get_mut().read(cx, buf)
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.get_mut().write_vectored(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().shutdown(cx)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if !self.ends.closing {
            self.ends.closing = true;
            self.conn.start_close();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_connection_closes_once_both_sides_have_shut_down_and_only_once() {
        for (write, read_done, due) in [
            (WriteEnd::Open, false, false),
            (WriteEnd::Open, true, false),
            (WriteEnd::Marked, true, false),
            (WriteEnd::Shut, false, false),
            (WriteEnd::Shut, true, true),
        ] {
            let mut e = Ends { write, read_done, ..Ends::default() };
            assert_eq!(e.close_due(), due, "{write:?}, peer done {read_done}");
            assert!(!e.close_due(), "never twice");
        }
    }

    #[test]
    fn a_write_takes_at_most_one_message() {
        assert_eq!(take([], 4096), 0);
        assert_eq!(take([10, 20], 4096), 30);
        assert_eq!(take([4000, 200], 4096), 4096);
        assert_eq!(take([usize::MAX, 1], 65536), 65536);
    }

    #[test]
    fn close_reasons_map_to_io_error_kinds() {
        use io::ErrorKind as K;
        assert_eq!(kind_of_close(&CloseReason::Peer, true), K::BrokenPipe);
        assert_eq!(kind_of_close(&CloseReason::Local, true), K::NotConnected);
        assert_eq!(kind_of_close(&CloseReason::WorkError(WcStatus::RetryExcErr), true), K::TimedOut);
        assert_eq!(kind_of_close(&CloseReason::WorkError(WcStatus::WrFlushErr), false), K::ConnectionReset);
        assert_eq!(kind_of_close(&CloseReason::Stalled(std::time::Duration::from_secs(1)), true), K::TimedOut);
        assert_eq!(kind_of_close(&CloseReason::Shutdown, false), K::ConnectionAborted);
        assert_eq!(kind_of_close(&CloseReason::Protocol("x".into()), false), K::InvalidData);
        // A failed send of a closed connection takes the close's kind; without one, its own.
        let flushed = Error::Operation(OpError::Wc(WcStatus::WrFlushErr));
        assert_eq!(kind_of(&flushed, Some(&CloseReason::Peer), true), K::BrokenPipe);
        assert_eq!(kind_of(&flushed, None, true), K::ConnectionReset);
        assert_eq!(kind_of(&Error::PoolExhausted { max_bytes: 1 }, None, true), K::OutOfMemory);
        assert_eq!(kind_of(&Error::NoReactor, None, false), K::Other);
    }

    #[test]
    fn a_sticky_error_keeps_its_variant_and_words() {
        let e = Error::Closed(CloseReason::Peer);
        assert_eq!(copy(&e).to_string(), e.to_string());
        let io = io_err(&(io::ErrorKind::BrokenPipe, Error::Closed(CloseReason::Peer)));
        assert_eq!(io.kind(), io::ErrorKind::BrokenPipe);
        let inner = io.get_ref().and_then(|s| s.downcast_ref::<Error>()).expect("the crate's error is the source");
        assert!(matches!(inner, Error::Closed(CloseReason::Peer)));
    }
}
