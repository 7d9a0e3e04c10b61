//! [`Stream`]: an established [`Connection`] as a byte stream, tokio's [`AsyncRead`] and
//! [`AsyncWrite`] (feature `tokio`).
//!
//! The stream adds no framing: its bytes are the connection's ordinary messages. A write
//! copies its bytes into the stream's last message when that one is still waiting to be posted
//! (`Conn::append_send`: submitted in this tick, or waiting for credits or a send slot), up to
//! the message size, else into a new message, which it submits at once; at most `window`
//! messages are in flight, and a write beyond them waits for the oldest to complete. A read
//! copies out of the message at hand and drops its buffer once emptied. The end of the write
//! side is an empty message. A dropped stream sends that end after what it accepted and
//! closes the connection once everything went, or after its linger time (`stream/linger.rs`).
//! The decisions that need no device (which end comes when, what each call returns once the
//! connection ended, how many bytes a write takes) are pure functions and [`Ends`],
//! unit-tested below.

mod linger;
mod split;

use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use ::tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

pub use split::{OwnedReadHalf, OwnedWriteHalf, ReuniteError};

use super::connection::{Close, Connection, OpFuture};
use super::message::{Message, RecvMessage};
use crate::error::Error;
use crate::proto::conn::CloseReason;
use crate::proto::op::{OpError, WcStatus};
use crate::sys::pool::Buf;

/// How long a dropped stream keeps its connection open, at most, to deliver what it accepted
/// ([`Stream::set_linger`]).
const DEFAULT_LINGER: Duration = Duration::from_secs(10);

/// The longest linger [`Stream::set_linger`] takes: what a peer that stops granting credit can
/// make a dropped stream hold is bounded in time whatever the setting.
const MAX_LINGER: Duration = Duration::from_secs(600);

/// An established [`Connection`] as a byte stream: tokio's [`AsyncRead`] and [`AsyncWrite`]
/// (feature `tokio`), for code written against them (`tokio::io::copy`, codecs, hyper through
/// `hyper_util::rt::TokioIo`). It behaves as a `TcpStream` does wherever the two can be
/// compared (the table below).
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
/// # Closing, flushing, dropping and errors, beside TCP
///
/// What each call returns once something has ended (a read returns the bytes that arrived
/// before it first). "Its end" is the peer's end-of-stream marker: the empty message a stream
/// sends when its writing is shut down, or when it is dropped.
///
/// | situation | `read` | `write` | `flush` | `shutdown` | `TcpStream` |
/// |---|---|---|---|---|---|
/// | the peer shut down its writing (its end came), the connection open | `Ok(0)` | goes on | `Ok` | `Ok` | the same (a FIN) |
/// | the peer closed: its end came, then its disconnect (a `shutdown` and a drop, or a drop alone) | `Ok(0)` | `BrokenPipe` | `Ok` | `Ok` | the same: `0`, `EPIPE`, `shutdown` is `Ok` |
/// | the peer vanished: it disconnected without its end (its process killed, a [`set_linger`](Stream::set_linger) of zero, a message-API peer that closed) | `ConnectionReset` | `BrokenPipe` | `Ok`, but `BrokenPipe` if bytes a write accepted did not all reach the peer's device (on iWARP its TCP stack) | as `flush` | a reset: `ECONNRESET` on a read, `ENOTCONN` from a `shutdown` |
/// | the peer stopped answering: its device did not acknowledge (`RetryExcErr`), no credit came for [`Config::credit_timeout`](crate::Config::credit_timeout), a connection-manager deadline | `TimedOut` | `TimedOut` | `TimedOut` | `TimedOut` | `ETIMEDOUT` |
/// | the connection broke: a work request failed, the peer's request was refused by this side's device | `ConnectionReset` | `ConnectionReset` | `ConnectionReset` | `ConnectionReset` | `ECONNRESET` |
/// | the peer broke the protocol (sent beyond its credit, a broken frame) | `InvalidData` | `InvalidData` | `InvalidData` | `InvalidData` | - |
/// | the peer wrote into the stream with an RDMA WRITE with immediate data (not a stream's message) | `InvalidData` | goes on | `Ok` | `Ok` | - |
/// | this side shut down its writing (`shutdown`) | goes on | `BrokenPipe` | `Ok` | `Ok` | the same |
/// | this side's reactor shut down or was dropped ([`Reactor::shutdown`](crate::Reactor::shutdown)) | `ConnectionAborted` | `ConnectionAborted` | `ConnectionAborted` | `ConnectionAborted` | `ECONNABORTED` |
/// | a local failure: the RDMA device removed or failed, the connection's completion queue failed | `ConnectionAborted` | `ConnectionAborted` | `ConnectionAborted` | `ConnectionAborted` | `ECONNABORTED` |
/// | this side closed the connection through another handle ([`Connection::close`]) | `NotConnected` | `NotConnected` | `NotConnected` | `NotConnected` | `ENOTCONN` |
/// | the pool has no memory for this connection now ([`PoolConfig`](crate::PoolConfig)'s memory guarantee: its budget, or the pool's maximum) | - | pending until a send gives its buffer back (or a short timer, none in flight) | - | pending, likewise | a full send buffer: the write waits |
/// | polled where its reactor does not poll (below) | `Other` | `Other` | `Other` | `Other` | - |
///
/// The error's source ([`io::Error::get_ref`]) is the crate's [`Error`]: `Error::Closed` with
/// the connection's [`CloseReason`] (`Peer`, `Shutdown`, `WorkError(..)`...) wherever the
/// connection ended, so a program can tell more than the kind; [`kind_of_close`] is the
/// mapping. Every error of the write side (but the pool's, and a reactor out of reach) is kept:
/// later writes fail with it.
///
/// # Writing
///
/// - A write takes at most one message's worth of its bytes (the connection's message size:
///   the smaller of the two sides' stated sizes, the client's
///   [`ConnectOptions::msg_size`](crate::ConnectOptions::msg_size) or else
///   [`Config::msg_size`](crate::Config::msg_size), 64 KiB by default; a server states at most
///   that) and is ready once they are in a message submitted to the connection, which sends
///   it without further calls: it never returns `Ok(n)` for bytes it will not send.
/// - **Writes coalesce.** While the stream's last message has not been posted to the device
///   (it was submitted in this tick of the reactor, or waits for the peer's credits or a send
///   slot), a write appends to it, up to the message size; otherwise it starts a message,
///   which goes at the end of the tick. So `tokio::io::copy`'s 8 KiB writes travel as messages
///   of the connection's size, while a lone small write goes at once, as it would alone (no
///   delay, no timer: nothing waits for more bytes).
/// - At most [`window`](Stream::window) messages are in flight (the queue pair's send slots,
///   within the receives the peer announced); a write that needs a new message beyond them is
///   pending until the oldest completes. While a writer streams, the buffer of a completed
///   send is kept for the next message (no pool round trip per message); once none is in
///   flight only a buffer of the pool's smallest class is kept, and a write with nothing in
///   flight takes the smallest chunk that holds its bytes: an idle stream holds no
///   message-size buffer (completed sends are taken by reads too, not only by writes).
/// - **A reader that stops reading** stops granting credits, and the writer's writes become
///   pending once the window is full: at most `2 × recv_depth` messages wait at the reader
///   (its posted receives, [`Config::recv_depth`](crate::Config::recv_depth), refilled while
///   no more than `recv_depth` are unread) and `window` at the writer, each of up to the
///   message size. At the defaults (64 KiB messages, `recv_depth` 64, `send_depth` 64, so a
///   window of 64) that is `(2 × 64 + 64) × 64 KiB` = 12 MiB a direction; smaller
///   `msg_size`, `recv_depth` or `send_depth` make it smaller. On a shared receive queue
///   ([`Config::srq`](crate::Config::srq)) the reader's side is about twice its
///   connection's share of the queue (its unread messages beyond its share withhold their
///   receives, and the peer's credit dries up), each of up to `SrqConfig::buf_size`.
/// - `poll_flush` has nothing to push (every accepted byte is already in a submitted message)
///   and does not wait for the device: it is `Ok` unless the write side failed, as a
///   `TcpStream`'s flush is once the kernel holds the bytes. So code that flushes after each
///   response (hyper) does not wait a round trip, and a peer that reads everything and closes
///   meanwhile does not turn a flush into an error.
/// - `poll_shutdown` ends the write side: it sends the end marker after the data and is ready
///   once every message, the marker included, has completed (on InfiniBand and RoCE the
///   peer's device acknowledged them; on iWARP the local TCP stack took them). It is the call
///   to await for "everything went". After the peer's close it is `Ok`, as TCP's is.
///
/// # Reading
///
/// A read copies out of the message at hand and, while the caller's buffer has room, out of
/// the messages that have already arrived; a message's buffer goes back to the pool once read
/// to its end, and its receive is posted again. The stream reads its end (`Ok` with no bytes)
/// at the peer's end-of-stream marker; a connection that ends without it is the peer vanishing
/// (the table). [`peer_shut_down`](Stream::peer_shut_down) says whether the marker came.
///
/// # The end, and a dropped stream
///
/// When both sides have shut down (this side's marker completed and the peer's arrived), the
/// stream closes the connection (with the close handshake where the transport needs it).
///
/// **A dropped stream delivers what it accepted** (a lingering close, as TCP's default close
/// does): it sends its end marker after the messages still in flight and closes the connection
/// once all of them completed, or when its linger time ([`set_linger`](Stream::set_linger), 10
/// s by default) has passed, whichever comes first. The linger is a task of the stream's
/// reactor (dropped where that reactor is not at hand, at its next tick): the dropping task
/// does not wait, the reactor goes on, and what the linger holds is bounded, the window's
/// messages and the marker for at most the linger time. On iWARP, where a send completes once
/// TCP took it, the close handshake then keeps the disconnect until the peer has the marker.
/// A reactor that stops running ends the linger: its shutdown closes the connection as any
/// other (the peer reads `ConnectionReset` if its end had not gone). A linger of zero closes at
/// once, without the marker (TCP's `SO_LINGER` of zero: the peer sees the close as a reset).
///
/// # Where it may be polled
///
/// Where the rest of the async face may: in a task of the reactor
/// ([`Reactor::spawn`](crate::Reactor::spawn), [`io::spawn`](crate::io::spawn)), in
/// [`Reactor::block_on`](crate::Reactor::block_on)'s future, in the future given to
/// [`io::tokio::drive`](crate::io::tokio::drive), and in the tasks started inside it, the
/// reactor's and tokio's (`tokio::task::spawn_local`, which the driver runs: hyper's habit of a
/// task per connection works there). Polled anywhere else (a task of another runtime or
/// another `LocalSet`, another thread) every call fails with an [`Other`](io::ErrorKind::Other)
/// error whose source is [`Error::NoReactor`].
///
/// [`into_split`](Stream::into_split) gives owned halves, for a reader and a writer in two
/// tasks (as `TcpStream`'s; the write half's drop shuts the writing down).
///
/// # The message API on the other side
///
/// The stream's bytes are the connection's ordinary messages: a peer using
/// [`Connection::recv`] (or a callback handler) sees its bytes in messages of at most its own
/// message size, cut wherever the stream cut them (no framing to parse), and an empty message
/// at the shutdown; a peer's messages are read by the stream as consecutive bytes, and an
/// empty message ends the stream. So a stream interoperates with the `echo` and `aecho`
/// examples' servers: they echo its messages as they came, the empty marker included, and the
/// stream reads its bytes back, then its own marker as the end (`tests/stream.rs`). A message
/// protocol that gives an empty message another meaning cannot share a connection with a
/// stream. A peer's RDMA WRITE with immediate data carries no stream bytes: the stream's
/// reads fail with `InvalidData` from there on.
///
/// The stream owns the connection's receives: do not call [`Connection::recv`] on a clone
/// while a stream reads (each would take some of the other's messages).
pub struct Stream {
    conn: Connection,
    /// Set at the first write: the largest message, and the most sends in flight.
    limits: Option<(usize, usize)>,
    /// The messages in flight, oldest first (the end-of-stream marker among them, last).
    sends: VecDeque<OpFuture>,
    /// The buffer of the last send that completed, for the next message (no pool round trip
    /// per message while a writer streams); with the sends in flight, never more than `window`
    /// buffers. Once none is in flight, only a small one is kept (`small`).
    spare: Option<Buf>,
    /// The first failure of the write side: every later write fails with it.
    write_err: Option<Failure>,
    /// A send failed, or a submission was refused, before the connection's end was known: its
    /// end, whose reason becomes the write side's failure.
    why: Option<Close>,
    /// The message waited for, in the connection's line.
    recv: Option<RecvMessage>,
    /// The message being read, and how far.
    cur: Option<(Buf, usize)>,
    /// The failure of the read side, reported after the bytes read before it.
    read_err: Option<Failure>,
    ends: Ends,
    /// The bytes of the last data message submitted, as far as this stream knows (its appends
    /// count): a full one is not offered more.
    last_len: usize,
    /// How long a dropped stream lingers at most.
    linger: Duration,
    /// A new message's buffer could not be had for want of pool memory (this connection at
    /// its reservation with nothing left to borrow: `PoolConfig`'s memory guarantee) while
    /// none of its sends was in flight to wake it: the wait before it asks again (5 ms,
    /// doubling to 100 ms), and its timer. Back-pressure, as TCP's writer waits for buffer
    /// space, never an error.
    memory_wait: Option<(Duration, super::time::Sleep)>,
    /// The pool's smallest chunk: the largest spare buffer an idle stream keeps.
    small_spare: usize,
    /// The slot of this side's end-of-stream marker, once submitted.
    marker_slot: Option<usize>,
    /// A send of data bytes (not the marker) failed: bytes a write accepted did not all go.
    /// `flush` and `shutdown` after the peer's close are `Ok` only without it (or once the
    /// peer's own marker was read): the hostile review of issue 46.
    data_lost: bool,
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
    /// The peer's end arrived (its marker), or the read side ended otherwise.
    pub(crate) read_done: bool,
    /// The peer's end was its marker.
    pub(crate) marked: bool,
    /// The stream started the connection's close (or its lingering close).
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
    /// The marker completed (after every send before it), or the write side ended otherwise.
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

/// One of the stream's calls, as the table in [`Stream`]'s docs names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Call {
    Read,
    Write,
    Flush,
    Shutdown,
}

/// What `call` returns once the connection ended with `reason` (a read, after the bytes that
/// arrived first, and only when the peer's end marker did not come): `None` for `Ok`. Pure:
/// the table in [`Stream`]'s docs.
pub(crate) fn outcome(reason: &CloseReason, call: Call) -> Option<io::ErrorKind> {
    match (reason, call) {
        // The peer closed (or vanished): TCP's flush and shutdown are `Ok` then.
        (CloseReason::Peer, Call::Flush | Call::Shutdown) => None,
        (r, Call::Read) => Some(kind_of_close(r, false)),
        (r, _) => Some(kind_of_close(r, true)),
    }
}

/// The [`io::ErrorKind`] of a connection that ended with `reason`, for a `writer` (a write, a
/// flush or a shutdown) or a reader (`false`). A reader that got the peer's end-of-stream
/// marker reads the end of the stream instead; one that did not reads a disconnect by the
/// peer as `ConnectionReset`, as TCP reads a reset. The table in [`Stream`]'s docs.
pub fn kind_of_close(reason: &CloseReason, writer: bool) -> io::ErrorKind {
    use io::ErrorKind as K;
    match reason {
        CloseReason::Peer if writer => K::BrokenPipe,
        CloseReason::Peer => K::ConnectionReset,
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

/// The kind of one of the crate's errors that is not the connection's end (a call refused
/// while the connection lives): the pool's, a size, the reactor's reach.
fn kind_of(e: &Error) -> io::ErrorKind {
    use io::ErrorKind as K;
    match e {
        Error::PoolExhausted { .. } | Error::OverBudget { .. } | Error::Memlock { .. } => K::OutOfMemory,
        Error::TooLarge { .. } | Error::Config(_) | Error::Limit { .. } => K::InvalidInput,
        Error::Operation(OpError::Wc(WcStatus::RetryExcErr | WcStatus::RnrRetryExcErr)) => K::TimedOut,
        Error::Operation(_) => K::ConnectionReset,
        Error::NotConnected(_) | Error::StaleToken(_) => K::NotConnected,
        Error::Elapsed(_) => K::TimedOut,
        Error::Unsupported(_) => K::Unsupported,
        _ => K::Other,
    }
}

/// A failure of one side of the stream: its kind and the crate's error, and whether it came
/// of the peer's close (`CloseReason::Peer`: `flush` and `shutdown` are `Ok` then).
#[derive(Debug)]
struct Failure {
    kind: io::ErrorKind,
    err: Error,
    peer: bool,
}

impl Failure {
    /// The failure of `call` (a read or a write) on a connection that ended with `reason`;
    /// `peer` when `flush` and `shutdown` are `Ok` then.
    fn closed(reason: CloseReason, call: Call) -> Failure {
        let kind = outcome(&reason, call).unwrap_or(io::ErrorKind::Other);
        let peer = outcome(&reason, Call::Shutdown).is_none();
        Failure { kind, err: Error::Closed(reason), peer }
    }

    fn io(&self) -> io::Error {
        io::Error::new(self.kind, copy(&self.err))
    }
}

/// A copy of a kept error, for each `io::Error` made of it (the crate's `Error` is not
/// `Clone`: it can hold an `io::Error`): the same variant and words where it can, else its
/// text.
fn copy(e: &Error) -> Error {
    match e {
        Error::Closed(r) => Error::Closed(r.clone()),
        Error::Operation(o) => Error::Operation(*o),
        Error::NoReactor => Error::NoReactor,
        Error::PoolExhausted { max_bytes } => Error::PoolExhausted { max_bytes: *max_bytes },
        Error::OverBudget { held, reserved, limit } => Error::OverBudget { held: *held, reserved: *reserved, limit },
        Error::NotConnected(s) => Error::NotConnected(s.clone()),
        Error::Unsupported(s) => Error::Unsupported(s.clone()),
        other => Error::NotConnected(other.to_string()),
    }
}

/// Polled outside the connection's reactor (none polls here, or another one does): the error
/// every call then fails with.
fn no_reactor(conn: &Connection) -> Option<io::Error> {
    conn.unreachable().map(io::Error::other)
}

/// After the peer's close, whether `flush` and `shutdown` are `Ok` (TCP's after an orderly
/// close): only when the write side failed for the peer's close (`peer`) and no send of data
/// bytes failed (`data_lost`: bytes a write accepted did not reach the peer's device, on
/// iWARP its local TCP stack). Bytes acknowledged by the peer's device and never read by its
/// application count as gone, as TCP's acknowledged bytes do.
pub(crate) fn closed_cleanly(peer: bool, data_lost: bool) -> bool {
    peer && !data_lost
}

/// The write side's error after the stream's own shutdown.
fn shut_down() -> io::Error {
    let e =
        Error::NotConnected("this stream's writing was shut down (poll_shutdown): nothing more can be written".into());
    io::Error::new(io::ErrorKind::BrokenPipe, e)
}

impl Stream {
    /// The byte stream over `conn`, an established connection (from
    /// [`Connection::connect`] or [`Listener::accept`](crate::io::Listener::accept)). The
    /// stream takes over its receives; dropping the stream closes the connection (once what
    /// it accepted went: the lingering close).
    pub fn new(conn: Connection) -> Stream {
        Stream {
            conn,
            limits: None,
            sends: VecDeque::new(),
            spare: None,
            write_err: None,
            why: None,
            recv: None,
            cur: None,
            read_err: None,
            ends: Ends::default(),
            last_len: 0,
            linger: DEFAULT_LINGER,
            memory_wait: None,
            marker_slot: None,
            data_lost: false,
            small_spare: 0,
        }
    }

    /// The connection under the stream (its token, addresses, close reason).
    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    /// Messages submitted and not yet completed (at most [`window`](Stream::window), and
    /// the end marker).
    pub fn in_flight(&self) -> usize {
        self.sends.len()
    }

    /// The most messages the stream keeps in flight, once known (at the first write); `None`
    /// before.
    pub fn window(&self) -> Option<usize> {
        self.limits.map(|(_, w)| w)
    }

    /// The largest message the stream sends, once known (at the first write).
    pub fn max_message(&self) -> Option<usize> {
        self.limits.map(|(m, _)| m)
    }

    /// True once the peer's end-of-stream marker arrived: its writing shut down, cleanly. A
    /// stream whose reads failed with `ConnectionReset` instead saw its peer vanish.
    pub fn peer_shut_down(&self) -> bool {
        self.ends.marked
    }

    /// Sets how long a dropped stream keeps its connection open, at most, to deliver what it
    /// accepted (10 s by default, 10 minutes at most: a longer time is taken as that): the
    /// lingering close (the type's docs). Zero closes at once when the stream is dropped,
    /// without the end marker, losing what is still in flight (TCP's `SO_LINGER` of zero); the
    /// peer reads that as a reset (`ConnectionReset`).
    pub fn set_linger(&mut self, linger: Duration) {
        self.linger = linger.min(MAX_LINGER);
    }

    /// How long a dropped stream lingers at most ([`set_linger`](Stream::set_linger)).
    pub fn linger(&self) -> Duration {
        self.linger
    }

    /// Splits the stream into a reader and a writer that two tasks can own, as
    /// `TcpStream::into_split` does: the halves share the stream (on the reactor's thread, no
    /// lock), [`OwnedReadHalf::reunite`] puts it back together, and dropping the write half
    /// shuts the writing down (the end marker goes, once its reactor is at hand). The stream
    /// ends, as a dropped stream does, when both halves are dropped.
    pub fn into_split(self) -> (OwnedReadHalf, OwnedWriteHalf) {
        split::split(self)
    }

    /// Closes the connection once both sides have shut down.
    fn maybe_close(&mut self) {
        if self.ends.close_due() {
            self.conn.start_close();
        }
    }

    /// What an error of a write-side call means: the connection's end when it has ended (kept
    /// as the write side's failure); `None` while it is ending and its reason is not known
    /// yet (waited for in `why`, whose poll registers `cx`); else the error itself, kept or
    /// not (a full pool, or a reactor out of reach, is this call's alone).
    fn settle(&mut self, e: Error, cx: &mut Context<'_>) -> Option<io::Error> {
        if let Some(r) = self.conn.close_reason() {
            let f = Failure::closed(r, Call::Write);
            let err = f.io();
            self.write_err.get_or_insert(f);
            return Some(err);
        }
        match e {
            // The queue pair failed, or the connection is closing: its reason says why.
            Error::Operation(_) | Error::NotConnected(_) | Error::StaleToken(_) | Error::Closed(_) => {
                if self.why.is_none() {
                    self.why = Some(self.conn.closed());
                }
                self.poll_why(cx);
                self.write_err.as_ref().map(Failure::io)
            }
            e => Some(io::Error::new(kind_of(&e), e)),
        }
    }

    /// Learns the connection's end once a failure said it comes.
    fn poll_why(&mut self, cx: &mut Context<'_>) {
        if let Some(why) = &mut self.why {
            if let Poll::Ready(r) = Pin::new(why).poll(cx) {
                self.why = None;
                self.write_err.get_or_insert(Failure::closed(r, Call::Write));
            }
        }
    }

    /// Takes the completed sends, oldest first, up to the first still in flight (whose waker
    /// is then `cx`'s). The first failure is kept.
    fn reap(&mut self, cx: &mut Context<'_>) {
        self.reap_sends(cx, false);
    }

    /// `reap`, or with `done_only` the completed sends alone: a reader takes them (and their
    /// buffers back to the pool) without polling one in flight, whose waker is its writer's
    /// (another task may wait on it, in `shutdown`), and so without registering its own.
    fn reap_sends(&mut self, cx: &mut Context<'_>, done_only: bool) {
        while let Some(front) = self.sends.front_mut() {
            if done_only && !front.is_done() {
                break;
            }
            let slot = front.slot();
            let Poll::Ready((res, buf)) = Pin::new(front).poll(cx) else { break };
            self.sends.pop_front();
            if res.is_err() && (slot.is_none() || slot != self.marker_slot) {
                self.data_lost = true;
            }
            match res {
                // Kept for the next message while more are in flight (a writer streaming), or
                // when it is of the smallest class; any other goes back to the pool here, so an
                // idle stream holds no message-size chunk.
                Ok(_) if self.spare.is_none() && (!self.sends.is_empty() || self.is_small(buf.as_ref())) => {
                    self.spare = buf
                }
                Ok(_) => {}
                Err(_) if self.write_err.is_some() || self.why.is_some() => {}
                Err(e) => {
                    let _ = self.settle(e, cx);
                }
            }
        }
        if self.sends.is_empty() && !self.is_small(self.spare.as_ref()) {
            // Idle: no message-size buffer is kept.
            self.spare = None;
        }
        self.poll_why(cx);
        let settled = self.write_err.is_none() && self.why.is_none();
        if self.ends.write == WriteEnd::Marked && self.sends.is_empty() && settled {
            self.ends.write = WriteEnd::Shut;
            self.maybe_close();
        }
    }

    /// Ready to take bytes: the failure or the reach of the write side checked, the sends that
    /// completed taken, the limits known. Pending while a failure's reason is awaited.
    fn write_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.reap(cx);
        if let Some(f) = &self.write_err {
            return Poll::Ready(Err(f.io()));
        }
        if self.why.is_some() {
            // Woken by the connection's end.
            return Poll::Pending;
        }
        if let Some(e) = no_reactor(&self.conn) {
            // Out of its reactor's reach: unless the connection has ended (its reactor shut
            // down, say), whose end is then the answer. (A connection that ended otherwise
            // says so when a submission is refused.)
            return Poll::Ready(Err(self.settle(Error::NoReactor, cx).unwrap_or(e)));
        }
        if self.limits.is_none() {
            match self.conn.stream_limits() {
                Ok(l) => {
                    self.limits = Some(l);
                    self.small_spare = self.conn.smallest_chunk();
                }
                Err(e) => {
                    return match self.settle(e, cx) {
                        Some(err) => Poll::Ready(Err(err)),
                        None => Poll::Pending,
                    }
                }
            }
        }
        Poll::Ready(Ok(()))
    }

    /// Submits `buf` as the next message; pending when the connection turned out to be
    /// ending (the bytes are not taken).
    fn push_send(&mut self, buf: Buf, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut send = self.conn.send(buf);
        // A refused submission fails this call (none of its bytes went). No waker yet: the
        // oldest send is polled (and so wakes this task) before any call waits.
        match send.refused(cx.waker()) {
            None => {
                self.sends.push_back(send);
                Poll::Ready(Ok(()))
            }
            Some((Ok(_), _)) => Poll::Ready(Ok(())),
            Some((Err(e), buf)) => {
                if self.spare.is_none() {
                    self.spare = buf;
                }
                match self.settle(e, cx) {
                    Some(err) => Poll::Ready(Err(err)),
                    None => Poll::Pending,
                }
            }
        }
    }

    /// An empty buffer of at least `cap` bytes for a new message: the spare one, or the pool's
    /// (after the receives the connection owes: they come first).
    fn message_buf(&mut self, cap: usize, cx: &mut Context<'_>) -> Poll<io::Result<Buf>> {
        if self.spare.as_ref().map_or(true, |b| b.capacity() < cap) {
            self.conn.receives_first();
        }
        let mut buf = match self.spare.take() {
            // The last completed send's buffer: it held this connection's bytes only, and
            // the new message's bytes are written over it from its start.
            Some(b) if b.capacity() >= cap => b,
            _ => match self.conn.alloc(cap) {
                Ok(b) => b,
                Err(Error::OverBudget { .. } | Error::PoolExhausted { .. }) => return self.wait_for_memory(cx),
                Err(e) => {
                    return match self.settle(e, cx) {
                        Some(err) => Poll::Ready(Err(err)),
                        None => Poll::Pending,
                    }
                }
            },
        };
        self.memory_wait = None;
        let _ = buf.set_len(0);
        Poll::Ready(Ok(buf))
    }

    /// No pool memory for a new message now: pending until a send of this stream completes
    /// (which gives its buffer back, and wakes this task: `reap` polled the oldest with `cx`),
    /// or, with none in flight, until a short timer, doubling while memory stays short.
    fn wait_for_memory<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        if !self.sends.is_empty() {
            return Poll::Pending;
        }
        let (wait, sleep) = self.memory_wait.get_or_insert_with(|| (MEMORY_FIRST, super::time::sleep(MEMORY_FIRST)));
        if Pin::new(sleep).poll(cx).is_pending() {
            return Poll::Pending;
        }
        // The wait is over: the caller asks again at its next poll (woken now), and should
        // the memory still be short, waits twice as long.
        let next = (*wait * 2).min(MEMORY_MAX);
        self.memory_wait = Some((next, super::time::sleep(next)));
        cx.waker().wake_by_ref();
        Poll::Pending
    }

    fn write_vectored(&mut self, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        if self.ends.write != WriteEnd::Open {
            return Poll::Ready(Err(shut_down()));
        }
        let total = bufs.iter().fold(0usize, |n, b| n.saturating_add(b.len()));
        if total == 0 {
            return Poll::Ready(Ok(0));
        }
        ready!(self.write_ready(cx))?;
        let (max, window) = self.limits.unwrap_or((1, 1));
        // The last message has room and may still wait to be posted: the bytes join it if it
        // does (`Conn::append_send`). Not asked of a full one (a writer of whole messages).
        if self.last_len < max {
            if let Some(slot) = self.sends.back().and_then(OpFuture::slot) {
                let n = self.conn.append(slot, bufs, max - self.last_len);
                if n > 0 {
                    self.last_len += n;
                    return Poll::Ready(Ok(n));
                }
            }
        }
        if self.sends.len() >= window {
            // The oldest send's completion wakes this task.
            return Poll::Pending;
        }
        let len = take(bufs.iter().map(|b| b.len()), max);
        // Of the message size while sends are in flight, so the next writes can join it (a
        // writer streaming); else of the smallest chunk that holds these bytes (a small
        // request or answer does not hold a message-size chunk: the hostile review of issue
        // 46). Writes in the same poll still join it, up to that chunk.
        let cap = if self.sends.is_empty() { len } else { max };
        let mut buf = ready!(self.message_buf(cap, cx))?;
        let mut left = len;
        for b in bufs {
            if left == 0 {
                break;
            }
            left -= buf.append(&b[..b.len().min(left)]);
        }
        ready!(self.push_send(buf, cx))?;
        self.last_len = len;
        Poll::Ready(Ok(len))
    }

    /// A buffer of the pool's smallest class at most (`None` too): what an idle stream keeps.
    fn is_small(&self, b: Option<&Buf>) -> bool {
        b.map_or(true, |b| b.capacity() <= self.small_spare)
    }

    /// The write side failed for the peer's close and no data send failed (only the marker,
    /// if any): `flush` and `shutdown` are `Ok` then ([`closed_cleanly`]).
    fn closed_cleanly(&self) -> bool {
        closed_cleanly(self.write_err.as_ref().is_some_and(|f| f.peer), self.data_lost)
    }

    fn flush(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Some(e) = no_reactor(&self.conn) {
            if self.write_err.is_none() {
                return Poll::Ready(Err(e));
            }
        }
        if self.ends.closing && self.ends.write == WriteEnd::Shut {
            // This stream closed its connection itself, both ends read and written (every
            // send completed): nothing is left to flush, as TCP's after its orderly close.
            return Poll::Ready(Ok(()));
        }
        self.reap(cx);
        if let Some(f) = &self.write_err {
            return Poll::Ready(if self.closed_cleanly() { Ok(()) } else { Err(f.io()) });
        }
        if self.why.is_some() {
            return Poll::Pending;
        }
        if let Some(r) = self.conn.close_reason() {
            return Poll::Ready(match outcome(&r, Call::Flush) {
                None => Ok(()),
                Some(kind) => Err(io::Error::new(kind, Error::Closed(r))),
            });
        }
        if let Some(e) = no_reactor(&self.conn) {
            return Poll::Ready(Err(e));
        }
        Poll::Ready(Ok(()))
    }

    fn shutdown(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.ends.write == WriteEnd::Open {
            match self.start_shutdown(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => {
                    return Poll::Ready(if self.closed_cleanly() {
                        // After the peer's close: TCP's shutdown is `Ok` then.
                        self.ends.write = WriteEnd::Shut;
                        Ok(())
                    } else {
                        Err(e)
                    });
                }
                Poll::Pending => return Poll::Pending,
            }
        }
        self.reap(cx);
        if let Some(f) = &self.write_err {
            return Poll::Ready(if self.closed_cleanly() { Ok(()) } else { Err(f.io()) });
        }
        if self.why.is_some() || !self.sends.is_empty() {
            return Poll::Pending;
        }
        Poll::Ready(Ok(()))
    }

    /// Submits the end-of-stream marker, an empty message after the data.
    fn start_shutdown(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.write_ready(cx))?;
        let window = self.limits.map_or(1, |(_, w)| w);
        if self.sends.len() >= window {
            return Poll::Pending;
        }
        let buf = ready!(self.message_buf(0, cx))?;
        ready!(self.push_send(buf, cx))?;
        self.marker_slot = self.sends.back().and_then(OpFuture::slot);
        self.ends.write = WriteEnd::Marked;
        Poll::Ready(Ok(()))
    }

    fn read(&mut self, cx: &mut Context<'_>, out: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if let Some(e) = no_reactor(&self.conn) {
            // Out of its reactor's reach: the messages that arrived before the connection
            // ended are still read, then its end (its reactor shut down, say).
            if !self.conn.is_closed() {
                return Poll::Ready(Err(e));
            }
        }
        if !self.sends.is_empty() {
            // The sends that completed since the last write, their buffers back to the pool
            // (a keep-alive connection whose writer waits in a read holds none of them).
            self.reap_sends(cx, true);
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
            if let Some(f) = &self.read_err {
                if progressed {
                    return Poll::Ready(Ok(()));
                }
                return Poll::Ready(Err(f.io()));
            }
            let conn = &self.conn;
            let recv = self.recv.get_or_insert_with(|| conn.recv_message());
            match Pin::new(recv).poll(cx) {
                Poll::Pending if progressed => return Poll::Ready(Ok(())),
                Poll::Pending => return Poll::Pending,
                Poll::Ready(got) => {
                    self.recv = None;
                    match got {
                        Ok(Message::Send(buf)) if buf.is_empty() => {
                            // The peer's end-of-stream marker.
                            self.ends.read_done = true;
                            self.ends.marked = true;
                            // Our marker may have completed with no writer to see it (an owned
                            // write half dropped): `reap_sends` closes then. The completed sends
                            // only: a poll of one in flight would put this reader's waker in
                            // place of the writer's, which another task may be waiting on
                            // (`shutdown`), and that writer would never wake (the hostile
                            // review of issue 46).
                            self.reap_sends(cx, true);
                            self.maybe_close();
                        }
                        Ok(Message::Send(buf)) => self.cur = Some((buf, 0)),
                        Ok(Message::RemoteWrite { len, .. }) => {
                            let what = format!(
                                "the peer wrote {len} bytes with an RDMA WRITE with immediate data, which a byte \
                                 stream does not carry (its bytes are the peer's SENDs): the peer does not speak \
                                 the stream"
                            );
                            let err = Error::Unsupported(what);
                            self.read_err = Some(Failure { kind: io::ErrorKind::InvalidData, err, peer: false });
                        }
                        Err(Error::Closed(r)) => self.read_err = Some(Failure::closed(r, Call::Read)),
                        Err(e) => self.read_err = Some(Failure { kind: kind_of(&e), err: e, peer: false }),
                    }
                }
            }
        }
    }
}

/// The first and the longest wait of a write for pool memory with none of its sends in
/// flight (`Stream::wait_for_memory`).
const MEMORY_FIRST: Duration = Duration::from_millis(5);
const MEMORY_MAX: Duration = Duration::from_millis(100);

/// How many bytes one write takes of `lens` (a vectored write's slices): at most `max`, the
/// message size.
pub(crate) fn take(lens: impl IntoIterator<Item = usize>, max: usize) -> usize {
    lens.into_iter().fold(0usize, |n, l| n.saturating_add(l)).min(max)
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
        if self.ends.closing {
            return;
        }
        self.ends.closing = true;
        let sends = std::mem::take(&mut self.sends);
        // The end marker goes unless the writing was shut down already or failed.
        let marker = self.ends.write == WriteEnd::Open && self.write_err.is_none() && self.why.is_none();
        let abort = self.linger.is_zero() || self.conn.is_closed() || self.write_err.is_some();
        if abort || (sends.is_empty() && !marker) {
            // Nothing to deliver, or no delivery asked: closed at once (what is in flight is
            // flushed on InfiniBand and RoCE).
            self.conn.start_close();
            return;
        }
        let marker = marker.then(|| self.spare.take());
        let task = linger::linger(self.conn.clone(), sends, marker, self.linger);
        self.conn.spawn_at_home(Box::pin(task));
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
    fn flush_and_shutdown_after_the_peers_close_are_ok_only_when_no_data_was_lost() {
        // The peer closed (its end, or it vanished), every data send went: `Ok`, as TCP's.
        assert!(closed_cleanly(true, false));
        // A data send failed: bytes a write accepted did not reach the peer's device, the
        // write side's own error (`BrokenPipe`) whether or not the peer's end was read (a
        // half-closed peer killed mid-response lost them too).
        assert!(!closed_cleanly(true, true));
        // A failure that is not the peer's close keeps its own kind.
        assert!(!closed_cleanly(false, false));
        assert!(!closed_cleanly(false, true));
    }

    #[test]
    fn a_write_takes_at_most_one_message() {
        assert_eq!(take([], 4096), 0);
        assert_eq!(take([10, 20], 4096), 30);
        assert_eq!(take([4000, 200], 4096), 4096);
        assert_eq!(take([usize::MAX, 1], 65536), 65536);
    }

    /// The table of `Stream`'s docs (issue 46), row by row: one kind per situation, TCP's
    /// where TCP has one.
    #[test]
    fn each_situation_ends_each_call_as_the_table_says() {
        use io::ErrorKind as K;
        use Call::*;
        let rows: [(CloseReason, [Option<K>; 4]); 9] = [
            // The peer closed (after its end: a reader read `Ok(0)` already) or vanished.
            (CloseReason::Peer, [Some(K::ConnectionReset), Some(K::BrokenPipe), None, None]),
            (CloseReason::WorkError(WcStatus::RetryExcErr), [Some(K::TimedOut); 4]),
            (CloseReason::Stalled(Duration::from_secs(1)), [Some(K::TimedOut); 4]),
            (CloseReason::WorkError(WcStatus::RemAccessErr), [Some(K::ConnectionReset); 4]),
            (CloseReason::PeerViolation, [Some(K::ConnectionReset); 4]),
            (CloseReason::Protocol("beyond its credit".into()), [Some(K::InvalidData); 4]),
            (CloseReason::Shutdown, [Some(K::ConnectionAborted); 4]),
            (CloseReason::DeviceRemoval, [Some(K::ConnectionAborted); 4]),
            (CloseReason::Local, [Some(K::NotConnected); 4]),
        ];
        for (reason, kinds) in rows {
            for (call, kind) in [Read, Write, Flush, Shutdown].into_iter().zip(kinds) {
                assert_eq!(outcome(&reason, call), kind, "{reason:?} {call:?}");
            }
        }
        assert_eq!(kind_of_close(&CloseReason::Peer, true), K::BrokenPipe);
        assert_eq!(kind_of_close(&CloseReason::Peer, false), K::ConnectionReset, "a vanished peer reads as a reset");
        assert_eq!(kind_of_close(&CloseReason::Timeout(crate::proto::conn::Step::Drain), false), K::TimedOut);
    }

    #[test]
    fn errors_that_are_not_the_connections_end_keep_their_own_kind() {
        use io::ErrorKind as K;
        assert_eq!(kind_of(&Error::PoolExhausted { max_bytes: 1 }), K::OutOfMemory);
        assert_eq!(kind_of(&Error::OverBudget { held: 1, reserved: 1, limit: "x" }), K::OutOfMemory);
        assert_eq!(kind_of(&Error::NoReactor), K::Other);
        assert_eq!(kind_of(&Error::Operation(OpError::Wc(WcStatus::RetryExcErr))), K::TimedOut);
        assert_eq!(kind_of(&Error::Unsupported("x".into())), K::Unsupported);
    }

    #[test]
    fn a_kept_error_keeps_its_variant_its_words_and_whether_the_peer_closed() {
        let e = Error::Closed(CloseReason::Peer);
        assert_eq!(copy(&e).to_string(), e.to_string());
        let f = Failure::closed(CloseReason::Peer, Call::Write);
        assert!(f.peer, "the peer's close: flush and shutdown are Ok");
        let io = f.io();
        assert_eq!(io.kind(), io::ErrorKind::BrokenPipe);
        let inner = io.get_ref().and_then(|s| s.downcast_ref::<Error>()).expect("the crate's error is the source");
        assert!(matches!(inner, Error::Closed(CloseReason::Peer)));
        assert!(!Failure::closed(CloseReason::Shutdown, Call::Write).peer);
        assert!(!io.to_string().contains("Token"), "no token in a stream's error: {io}");
    }
}
