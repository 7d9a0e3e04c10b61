//! The async face, `rdma_reactor::io`: connections, listeners and operations as futures, run
//! on the reactor's own thread by [`Reactor::block_on`](crate::Reactor::block_on), a task
//! ([`Reactor::spawn`](crate::Reactor::spawn)) or the tokio driver.
//!
//! It is a thin layer over the callback API: each connection has an ordinary
//! [`ConnectionHandler`] of this module's ([`AsyncConn`]) whose callbacks store what happened in
//! the connection's shared state and wake the task that waits for it; the futures reach the
//! reactor through `reactor::with_ctx` (a [`Ctx`]) while they are polled. Nothing here locks: the state is
//! `Rc<RefCell<..>>` on the reactor's thread.
//!
//! How a completion reaches a waker: an operation future submits its [`Op`] with the index of
//! a slot of the connection's state as user_data and keeps the slot; the completion comes to
//! `AsyncConn::on_completion` in the tick that polled it, which puts it in the slot and wakes
//! the slot's waker (for a task of this reactor, a push onto a thread-local list the same tick
//! takes). A slot whose future was dropped is marked abandoned: its completion is still reaped
//! (the device owns the buffer until then) and then dropped, which returns the buffer to the
//! pool. The work itself is not cancelled: a posted request cannot be taken back from the
//! device, and a send may already be at the peer.
//!
//! Receives are the runtime's: with flow control the receive depth is announced at connect
//! time, before the application can ask for a message, so the connection keeps its receives
//! posted itself and queues what arrives; [`Connection::recv`] hands out the next message in
//! the buffer it arrived in (no copy). Each receive is of the size this side announced
//! (`Conn::msg_size`: a client's `ConnectOptions::msg_size`, else `Config::msg_size`; an
//! accepted connection's, the smaller of its client's and `Config::msg_size`), and
//! `Config::recv_depth` of them are kept posted: the peer's claim never raises either.

use std::cell::RefCell;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use slab::Slab;

use super::line::RecvLine;
use super::listener::ListenState;
use super::message::{Message, RecvMessage};
use crate::error::{Error, Result};
use crate::proto::conn::CloseReason;
use crate::proto::op::{OpCode, OpError, RemoteAccess};
use crate::proto::token::{ConnKey, Key, Token};
use crate::proto::transport::Transport;
use crate::proto::wire::{ConnectInfo, RemoteSlice};
use crate::reactor::{
    with_ctx, with_ctx_of, Completion, Conn, ConnectOptions, ConnectionHandler, Ctx, ExecId, Op, Orphans,
};
use crate::sys::pool::{Buf, Exposed};

/// The user_data of the receives the connection posts itself.
const RECV: u64 = u64::MAX - 1;

/// The user_data of the timer that tries a failed receive refill again.
const REFILL: u64 = u64::MAX - 2;

/// The first wait before a failed refill is tried again, and the longest (the wait doubles
/// while it keeps failing): a connection whose receives ran short for want of pool memory
/// gets them back soon after memory comes back, and thousands of such connections cost the
/// reactor a few timers a second each, not a busy loop.
const REFILL_FIRST: std::time::Duration = std::time::Duration::from_millis(5);
const REFILL_MAX: std::time::Duration = std::time::Duration::from_secs(1);

/// The message size a byte stream assumes for a peer that states none (a plain librdmacm
/// peer).
#[cfg(feature = "tokio")]
pub(super) const DEFAULT_MSG: usize = 4096;

/// Where a connection is in its life.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    Connecting,
    Established,
    Closed(CloseReason),
}

/// One operation's completion, as its future waits for it.
enum Slot {
    Waiting(Option<Waker>),
    /// The completion's result and buffer: what its future hands out (the rest of a
    /// `Completion` is not kept, so less is moved twice per operation).
    Done(std::result::Result<u32, OpError>, Option<Buf>),
    /// Its future was dropped: the completion is dropped when it comes.
    Abandoned,
}

/// What the handler and the handles of one connection share.
pub(super) struct ConnState {
    token: Option<Token>,
    phase: Phase,
    /// A connect future, or the tasks waiting for the close.
    waiters: Vec<Waker>,
    /// Messages received and not yet taken, and the callers of `recv` in line for them
    /// (`line.rs`: a woken caller's message is its own), each with its kind
    /// (`message.rs`: a peer's RDMA WRITE with immediate data is not an empty SEND).
    recvs: RecvLine<Message>,
    /// Receives posted now, and the most kept posted.
    posted: u32,
    depth: u32,
    /// The receives kept posted now: the flow-control minimum at first, one more for each
    /// message that arrives, up to `depth` (issue 45: receives beyond the minimum are the
    /// pool's shared remainder, borrowed as the traffic shows they are wanted; a connection
    /// that stays idle borrows none). `depth` from the start where the peer may send without
    /// credits (no flow control) and on a client.
    target: u32,
    /// The size each receive is posted with: the size this side announced (`Conn::msg_size`).
    recv_size: usize,
    /// On a shared receive queue (`Config::srq`) the runtime posts the receives.
    srq: bool,
    /// On a shared receive queue: receives its messages consumed that this side withheld
    /// (`Conn::withhold_receive`) while more messages waited unread than its share.
    withheld: u32,
    /// The last wait of a failed refill's retry (`replenish`): doubled at the next failure,
    /// forgotten once every receive is posted.
    refill: Option<std::time::Duration>,
    /// The refill's retry timer is set.
    refill_pending: bool,
    slots: Slab<Slot>,
    /// The connect future or the handles are gone before the connection was up: close it
    /// once it is.
    abandoned: bool,
    orphans: Orphans,
    /// The reactor the connection lives on: every call reaches it only there (`with_ctx_of`),
    /// since another reactor on this thread has a connection of the same token.
    home: ExecId,
}

type Shared = Rc<RefCell<ConnState>>;

impl ConnState {
    pub(super) fn new(orphans: Orphans, home: ExecId) -> Shared {
        Rc::new(RefCell::new(ConnState {
            token: None,
            phase: Phase::Connecting,
            waiters: Vec::new(),
            recvs: RecvLine::default(),
            posted: 0,
            depth: 0,
            target: 0,
            recv_size: 0,
            srq: false,
            withheld: 0,
            refill: None,
            refill_pending: false,
            slots: Slab::new(),
            abandoned: false,
            orphans,
            home,
        }))
    }

    fn wake_all(&mut self) {
        for w in self.waiters.drain(..) {
            w.wake();
        }
        self.recvs.wake_all();
        for (_, s) in self.slots.iter_mut() {
            if let Slot::Waiting(Some(w)) = s {
                w.wake_by_ref();
            }
        }
    }

    /// The connection's token while it can take operations; else why not, in the same words
    /// for every call (`alloc`, `send`, `expose`...): closed (with its reason) or not up yet.
    fn usable(&self) -> Result<Token> {
        match (&self.phase, self.token) {
            (Phase::Closed(r), _) => Err(Error::Closed(r.clone())),
            (_, Some(t)) => Ok(t),
            (_, None) => Err(Error::NotConnected("the connection has no queue pair yet".into())),
        }
    }

    /// Posts receives until `depth` are posted or `limit` more were. One that cannot be had
    /// for want of pool memory (the connection is beyond its reservation and may borrow no
    /// more: `PoolConfig`'s memory guarantee) is tried again on a timer, its wait doubling
    /// from [`REFILL_FIRST`] to [`REFILL_MAX`] while it keeps failing (review of 2026-12-07,
    /// N2: a refill that failed was never tried again, and a connection left with one receive
    /// posted and nothing unread hung for good).
    fn replenish(&mut self, conn: &mut Conn<'_>, limit: u32) {
        let mut n = 0;
        while !self.srq && self.posted < self.target && n < limit {
            let buf = match conn.alloc(self.recv_size) {
                Ok(buf) => buf,
                Err(Error::OverBudget { .. } | Error::PoolExhausted { .. }) => {
                    self.retry_refill(conn);
                    return;
                }
                Err(_) => break,
            };
            if conn.submit(Op::recv(buf).user_data(RECV)).is_err() {
                break;
            }
            self.posted += 1;
            n += 1;
        }
        if self.posted >= self.target {
            self.refill = None;
        }
    }

    /// Sets the refill's retry timer, unless one is set.
    fn retry_refill(&mut self, conn: &mut Conn<'_>) {
        if self.refill_pending {
            return;
        }
        let wait = self.refill.map_or(REFILL_FIRST, |w| (w * 2).min(REFILL_MAX));
        if conn.ctx().set_timer(wait, REFILL).is_ok() {
            self.refill = Some(wait);
            self.refill_pending = true;
        }
    }

    /// The receives a refill is owed now: fewer than `target` posted, and room under the
    /// peer's credit (fewer than `depth` messages wait unread).
    fn owed(&self) -> bool {
        !self.srq && self.posted < self.target && self.recvs.unread() < self.depth as usize
    }
}

/// The callback side of an async connection.
pub(crate) struct AsyncConn {
    pub(super) st: Shared,
    /// An accepted connection: where it goes once established.
    pub(super) accept: Option<Rc<RefCell<ListenState>>>,
}

impl ConnectionHandler for AsyncConn {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        let mut st = self.st.borrow_mut();
        st.token = Some(conn.token());
        // What this side announced, for a client its `ConnectOptions::msg_size` (or
        // `Config::msg_size`), for an accepted connection the smaller of its client's claim and
        // `Config::msg_size`: a peer's claim never raises it.
        st.recv_size = conn.msg_size().max(1);
        let capacity = conn.recv_capacity();
        st.srq = capacity == 0;
        st.depth = conn.ctx().config().recv_depth.min(capacity);
        // An accepted connection whose peer keeps to credits posts only the flow-control
        // minimum, what its reservation in the pool covers (issue 45, and the review of
        // 2026-11-26, M2: every connection, idle or half open, pinned its whole depth of
        // receives before `rdma_accept`); the rest grows with its traffic once it is up,
        // borrowed from the pool's shared remainder and granted to the peer as it is posted. A
        // peer without flow control may send at once, before this side's establishment is
        // handled, and a client cannot know yet whether its server agrees to it: both post
        // their whole depth now (a receive missing then is an RNR on RoCE, the end of the
        // connection on iWARP).
        let min = crate::proto::flow::MIN_DEPTH;
        let credits = conn.ctx().config().flow_control
            && conn.peer_info().is_some_and(|i| i.flow_control && u32::from(i.recv_depth) >= min);
        st.target = if self.accept.is_some() && credits { st.depth.min(min) } else { st.depth };
        let first = st.target;
        st.replenish(conn, first);
        if !st.srq && st.posted < first.min(min) {
            // Not even the minimum (the pool had no room at all): flow control could not be
            // offered, so the connection is not made.
            drop(st);
            conn.close();
        }
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        let abandoned = {
            let mut st = self.st.borrow_mut();
            st.phase = Phase::Established;
            st.wake_all();
            st.abandoned
        };
        if abandoned {
            return conn.close();
        }
        if let Some(q) = &self.accept {
            let mut q = q.borrow_mut();
            if q.closed {
                drop(q);
                return conn.close();
            }
            q.ready.push_back(Connection::from_state(self.st.clone()));
            if let Some(w) = q.waiters.pop_front() {
                w.wake();
            }
        }
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        let mut st = self.st.borrow_mut();
        if c.opcode == OpCode::Recv && (c.user_data == RECV || c.user_data == Completion::SRQ_RECV) {
            if c.user_data == RECV {
                st.posted -= 1;
            }
            if let (Ok(n), Some(buf)) = (c.result, c.buf) {
                st.recvs.arrive(Message::of(buf, c.remote_write, n));
                if c.user_data == Completion::SRQ_RECV {
                    // On a shared receive queue the runtime posts a fresh receive for each
                    // message and grants it back at once: beyond its share of unread messages,
                    // this connection keeps that receive back, and its peer's credit shrinks,
                    // until the application reads (review of 2026-12-07, N1: the unread
                    // messages had no bound but the pool, and a full pool starved every
                    // connection on the queue).
                    let share = conn.recv_share().unwrap_or(0) as usize;
                    if st.recvs.unread() > share && conn.withhold_receive() {
                        st.withheld += 1;
                    }
                } else if st.recvs.unread() <= st.depth as usize {
                    // Traffic: one receive more is wanted, up to `depth`.
                    st.target = (st.target + 1).min(st.depth);
                    // Up to `depth` messages may wait unread while the peer keeps its full
                    // credit; beyond that its credit shrinks until the application catches up.
                    // (Two: the one consumed, and one more while the target grows.)
                    st.replenish(conn, 2);
                }
            }
            return;
        }
        let key = c.user_data as usize;
        match st.slots.get_mut(key) {
            Some(slot @ Slot::Waiting(_)) => {
                // Replaced in place (issue 33: no second look-up of the slot).
                if let Slot::Waiting(Some(w)) = std::mem::replace(slot, Slot::Done(c.result, c.buf)) {
                    w.wake();
                }
            }
            Some(Slot::Abandoned) => {
                st.slots.remove(key);
            }
            Some(Slot::Done(..)) | None => {}
        }
    }

    fn on_timer(&mut self, conn: &mut Conn<'_>, user_data: u64) {
        if user_data != REFILL {
            return;
        }
        let mut st = self.st.borrow_mut();
        st.refill_pending = false;
        if matches!(st.phase, Phase::Closed(_)) || !st.owed() {
            st.refill = None;
            return;
        }
        // Tried again (and the timer set again, its wait doubled, if it still fails).
        let depth = st.depth;
        st.replenish(conn, depth);
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        let mut st = self.st.borrow_mut();
        st.phase = Phase::Closed(reason);
        st.wake_all();
    }
}

/// Closes the connection when the last handle is dropped.
struct Handle {
    st: Shared,
}

impl Drop for Handle {
    fn drop(&mut self) {
        let mut st = self.st.borrow_mut();
        st.abandoned = true;
        if let (Some(t), Phase::Established | Phase::Connecting) = (st.token, &st.phase) {
            st.orphans.push(t);
        }
    }
}

/// A connection of the async face: cheap to clone (every clone is the same connection), used
/// by any number of tasks at once. Dropping the last clone closes it.
///
/// Operations take owned buffers and give them back with their result, as tokio-uring does:
/// no borrowed memory can be freed under the device. A future dropped before its completion
/// does not cancel the operation (a posted request cannot be taken back, and a send may
/// already be at the peer): the completion is still reaped, then its buffer goes back to the
/// pool.
#[derive(Clone)]
pub struct Connection {
    handle: Rc<Handle>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.handle.st.borrow();
        f.debug_struct("Connection").field("token", &st.token).field("phase", &st.phase).finish()
    }
}

impl Connection {
    pub(super) fn from_state(st: Shared) -> Connection {
        Connection { handle: Rc::new(Handle { st }) }
    }

    fn st(&self) -> &Shared {
        &self.handle.st
    }

    /// Connects to `addr` (address and route resolution, connect). Resolves once the
    /// connection is established, with this side's receives posted.
    ///
    /// Dropping the future before it resolves closes the connection attempt.
    ///
    /// # Errors
    ///
    /// [`Error::Closed`] with the reason when the connection fails (rejected, unreachable, a
    /// timeout), what [`Ctx::connect`] fails with at once, [`Error::NoReactor`] outside a
    /// reactor, and [`Error::Unsupported`] when `opts.reconnect` is set (reconnecting clients
    /// are the callback API's for now: [`ConnectionHandler::on_reconnecting`]).
    pub fn connect(addr: SocketAddr, opts: ConnectOptions) -> Connect {
        Connect { start: Some((addr, opts)), st: None }
    }

    /// The connection's token (as the callback API names it).
    pub fn token(&self) -> Option<Token> {
        self.st().borrow().token
    }

    /// Messages that arrived and no `recv` took yet.
    #[cfg(feature = "tokio")]
    pub(super) fn unread(&self) -> usize {
        self.st().borrow().recvs.unread()
    }

    /// How the connection ended, once it has.
    pub fn close_reason(&self) -> Option<CloseReason> {
        match &self.st().borrow().phase {
            Phase::Closed(r) => Some(r.clone()),
            _ => None,
        }
    }

    /// Runs `f` with the connection's callback context.
    ///
    /// # Errors
    ///
    /// [`Error::NoReactor`] unless its own reactor polls this code (another reactor on this
    /// thread has a connection of the same token: it is never looked up there).
    fn with_conn<R>(&self, f: impl FnOnce(&mut Conn<'_>) -> Result<R>) -> Result<R> {
        let (token, home) = {
            let st = self.st().borrow();
            (st.usable()?, st.home)
        };
        let key = ConnKey::of(token).ok_or_else(|| Error::StaleToken(token.as_u64()))?;
        with_ctx_of(home, |ctx| match ctx.conn(key) {
            Some(mut conn) => f(&mut conn),
            // Gone from the reactor: it closed (its handler heard why).
            None => Err(self.st().borrow().usable().err().unwrap_or(Error::StaleToken(token.as_u64()))),
        })?
    }

    /// Whether this code can reach the connection's reactor: `None` when its own reactor polls
    /// here, else why not ([`Error::NoReactor`]).
    #[cfg(feature = "tokio")]
    pub(super) fn unreachable(&self) -> Option<Error> {
        let home = self.st().borrow().home;
        with_ctx_of(home, |_| ()).err()
    }

    /// A buffer of `len` bytes from the connection's device pool ([`Conn::alloc`]).
    ///
    /// # Errors
    ///
    /// As [`Conn::alloc`]; [`Error::NoReactor`] outside the connection's reactor (none polls
    /// here, or another one does).
    pub fn alloc(&self, len: usize) -> Result<Buf> {
        self.with_conn(|c| c.alloc(len))
    }

    /// A buffer holding `bytes`.
    ///
    /// # Errors
    ///
    /// As [`Connection::alloc`].
    pub fn alloc_from(&self, bytes: &[u8]) -> Result<Buf> {
        let mut b = self.alloc(bytes.len())?;
        b.fill_from(bytes)?;
        Ok(b)
    }

    /// Sends `buf.len()` bytes; resolves when the device completed the send, with the
    /// buffer.
    pub fn send(&self, buf: Buf) -> OpFuture {
        OpFuture::new(self.st().clone(), Op::send(buf))
    }

    /// Writes `local.len()` bytes into the peer's memory at `remote`; resolves with the
    /// buffer.
    pub fn write(&self, local: Buf, remote: RemoteSlice) -> OpFuture {
        OpFuture::new(self.st().clone(), Op::write(local, remote))
    }

    /// Reads `remote.len` bytes of the peer's memory into `local`; resolves with the buffer
    /// (its length set to the bytes read).
    pub fn read(&self, local: Buf, remote: RemoteSlice) -> OpFuture {
        OpFuture::new(self.st().clone(), Op::read(local, remote))
    }

    /// The next message, in the buffer it arrived in (its length is the message's). Messages
    /// are handed out in arrival order, one per call, to the callers in the order they asked:
    /// the order of these calls (the caller is in line from this call, not from the first
    /// poll), and a woken caller's message is its own. A `Recv` dropped while it holds a
    /// message passes it to the next caller in line; none is lost.
    ///
    /// For requests and replies on one connection shared by several tasks, take the place in
    /// line before the request goes out: `let reply = conn.recv(); conn.send(req).await;
    /// reply.await` pairs each task's reply with its request whatever order the tasks are
    /// polled in (a peer that answers in order assumed). Tasks spawned on the reactor that
    /// `send(req).await` and then `recv()` are woken by their sends' completions in the order
    /// the sends were posted and get their own replies too; `block_on`'s future and the tokio
    /// driver's are polled at another point of the tick, so mixed with tasks they may not.
    ///
    /// # Errors
    ///
    /// [`Error::Closed`] once the connection has ended and every message was handed out.
    pub fn recv(&self) -> Recv {
        let st = self.st().clone();
        let place = Some(st.borrow_mut().recvs.join());
        Recv { st, place }
    }

    /// The next message with its kind ([`Message`]): as [`recv`](Connection::recv), in the
    /// same line, but a peer's RDMA WRITE with immediate data
    /// ([`Op::write_imm`](crate::Op::write_imm)) is told from a SEND: it resolves to
    /// [`Message::RemoteWrite`] with the bytes written, where `recv` hands out its receive's
    /// empty buffer, as it would an empty SEND.
    ///
    /// # Errors
    ///
    /// As [`recv`](Connection::recv).
    pub fn recv_message(&self) -> RecvMessage {
        RecvMessage::new(self.recv())
    }

    /// Exposes `buf` to the peer with `access` ([`Conn::expose`]).
    ///
    /// # Errors
    ///
    /// As [`Conn::expose`]; [`Error::NoReactor`] outside the connection's reactor.
    pub fn expose(&self, buf: Buf, access: RemoteAccess) -> Result<Exposed> {
        self.with_conn(|c| c.expose(buf, access))
    }

    /// What the peer sent when connecting or accepting.
    pub fn peer_info(&self) -> Option<ConnectInfo> {
        self.with_conn(|c| Ok(c.peer_info().cloned())).ok().flatten()
    }

    /// The transport of the connection's device.
    pub fn transport(&self) -> Option<Transport> {
        self.with_conn(|c| Ok(c.transport())).ok().flatten()
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.with_conn(|c| Ok(c.peer_addr())).ok().flatten()
    }

    /// Closes the connection (disconnect, drain, destroy); resolves with how it ended.
    /// Operations still waiting complete first (flushed or cancelled). Closing a closed
    /// connection resolves at once.
    pub fn close(&self) -> Close {
        Close { st: self.st().clone(), asked: false }
    }

    /// Resolves with how the connection ended, once it has, without closing it (the peer's
    /// close, a failure, another task's [`close`](Connection::close)).
    pub fn closed(&self) -> Close {
        Close { st: self.st().clone(), asked: true }
    }

    /// What a byte stream over this connection may send (`stream.rs`): the largest message
    /// (the smaller of the sizes both sides stated, [`DEFAULT_MSG`] for a peer that states
    /// none, within this side's largest pool buffer) and how many sends it keeps in flight (the queue pair's send
    /// slots, within what the send backlog takes).
    #[cfg(feature = "tokio")]
    pub(super) fn stream_limits(&self) -> Result<(usize, usize)> {
        self.with_conn(|c| {
            let peer = c.peer_info().cloned();
            let msg = peer.as_ref().map(|i| i.msg_size as usize).filter(|m| *m > 0).unwrap_or(DEFAULT_MSG);
            // Both sides' stated sizes: an accepted async connection posts receives of its
            // client's size while it states the pool's largest (`Listener`), so a client's
            // messages must keep to its own size too.
            let own = c.local_info().map(|i| i.msg_size as usize).filter(|m| *m > 0).unwrap_or(msg);
            let chunk = msg.min(own).min(c.ctx().max_msg()).max(1);
            // Not the receive depth the peer announced: that is only its first credit (the
            // flow-control minimum, issue 45), and it grants the receives it posts once
            // established; sends beyond its credit wait in the send queue for its grants.
            let slots = c.send_capacity() as usize;
            // Never more queued than the send backlog takes (`Config::send_backlog_bytes`): a
            // write is then never refused for it, whatever the send depth.
            let backlog = (c.ctx().config().send_backlog_bytes / chunk).max(1);
            Ok((chunk, slots.min(backlog).max(1)))
        })
    }

    /// The pool's smallest chunk size (its first class): what an idle byte stream may keep
    /// as its spare buffer.
    #[cfg(feature = "tokio")]
    pub(super) fn smallest_chunk(&self) -> usize {
        self.with_conn(|c| Ok(c.ctx().config().pool.chunk_sizes.first().copied().unwrap_or(4096))).unwrap_or(4096)
    }

    /// Appends as many of `bytes` as fit, and at most `limit`, to the SEND of operation slot
    /// `slot` if it is still the connection's last submitted operation and not posted yet
    /// ([`Conn::append_send`]); returns how many bytes it took (0 also where its reactor is not
    /// at hand). A byte stream's coalesced writes (`stream.rs`), within its message size.
    #[cfg(feature = "tokio")]
    pub(super) fn append(&self, slot: usize, bytes: &[std::io::IoSlice<'_>], limit: usize) -> usize {
        self.with_conn(|c| Ok(c.append_send(slot as u64, bytes, limit))).unwrap_or(0)
    }

    /// Posts the receives the connection owes now, if it owes any, before a writer takes pool
    /// memory for a new message: receives come first (without them the peer's credits, then
    /// this side's sends, stop: a writer that took every chunk of its connection's budget
    /// would wait for ever on sends that wait for the peer, whose answers find no receive).
    #[cfg(feature = "tokio")]
    pub(super) fn receives_first(&self) {
        let (owed, token, home) = {
            let st = self.st().borrow();
            (st.owed(), st.token.and_then(ConnKey::of), st.home)
        };
        let Some(key) = token.filter(|_| owed) else { return };
        let st = self.st().clone();
        let _ = with_ctx_of(home, |ctx| {
            if let Some(mut conn) = ctx.conn(key) {
                let mut st = st.borrow_mut();
                let target = st.target;
                st.replenish(&mut conn, target);
            }
        });
    }

    /// True once the connection has ended (cheaper than [`close_reason`](Connection::close_reason)).
    #[cfg(feature = "tokio")]
    pub(super) fn is_closed(&self) -> bool {
        matches!(self.st().borrow().phase, Phase::Closed(_))
    }

    /// Runs `fut` as a task of the connection's own reactor: spawned at once where that
    /// reactor polls, else queued for its next tick (and dropped with it, if it is gone). A
    /// byte stream's lingering close (`stream.rs`), which may start where a stream is dropped.
    #[cfg(feature = "tokio")]
    pub(super) fn spawn_at_home(&self, fut: Pin<Box<dyn Future<Output = ()>>>) {
        let (home, orphans) = {
            let st = self.st().borrow();
            (st.home, st.orphans.clone())
        };
        let mut fut = Some(fut);
        let _ = with_ctx_of(home, |ctx| fut.take().map(|f| ctx.spawn(f)));
        if let Some(f) = fut {
            orphans.defer(Box::new(move |ctx| ctx.spawn(f)));
        }
    }

    /// Starts closing the connection without waiting for the end (a byte stream's end, or its
    /// drop): at once inside a reactor, else at the reactor's next tick.
    #[cfg(feature = "tokio")]
    pub(super) fn start_close(&self) {
        let (token, orphans, home) = {
            let st = self.st().borrow();
            let live = matches!(st.phase, Phase::Established | Phase::Connecting);
            (st.token.filter(|_| live), st.orphans.clone(), st.home)
        };
        if let Some(t) = token {
            // (No borrow of the state is held: closing may call the handler.)
            if with_ctx_of(home, |ctx| ctx.close(t)).is_err() {
                orphans.push(t);
            }
        }
    }
}

/// [`Connection::connect`]'s future.
pub struct Connect {
    start: Option<(SocketAddr, ConnectOptions)>,
    st: Option<Shared>,
}

impl std::fmt::Debug for Connect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connect").field("started", &self.st.is_some()).finish()
    }
}

impl Future for Connect {
    type Output = Result<Connection>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if let Some((addr, opts)) = self.start.take() {
            if opts.reconnect.is_some() {
                // The async face's state (its receives, waiting futures, the end of the
                // connection) follows one queue pair; it does not know reconnections yet.
                let what = "ConnectOptions::reconnect on the async face (io::Connection): this API does not \
                            offer it yet; reconnecting clients are supported through the callback API \
                            (ConnectionHandler::on_reconnecting)";
                return Poll::Ready(Err(Error::Unsupported(what.into())));
            }
            let st = with_ctx(|ctx| {
                let st = ConnState::new(ctx.orphans(), ctx.exec_id());
                let handler = AsyncConn { st: st.clone(), accept: None };
                ctx.connect(addr, opts, handler).map(|t| {
                    st.borrow_mut().token = Some(t);
                    st
                })
            });
            match st {
                Ok(Ok(st)) => self.st = Some(st),
                Ok(Err(e)) | Err(e) => return Poll::Ready(Err(e)),
            }
        }
        let Some(st) = &self.st else {
            return Poll::Ready(Err(Error::Config("Connect polled after it resolved".into())));
        };
        let mut s = st.borrow_mut();
        match &s.phase {
            Phase::Established => {
                drop(s);
                let st = self.st.take().expect("checked");
                Poll::Ready(Ok(Connection::from_state(st)))
            }
            Phase::Closed(r) => {
                let r = r.clone();
                drop(s);
                self.st = None;
                Poll::Ready(Err(Error::Closed(r)))
            }
            Phase::Connecting => {
                s.waiters.retain(|w| !w.will_wake(cx.waker()));
                s.waiters.push(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

impl Drop for Connect {
    fn drop(&mut self) {
        if let Some(st) = self.st.take() {
            // Not handed out yet: the handle closes it.
            drop(Handle { st });
        }
    }
}

/// An operation's future ([`Connection::send`], [`Connection::write`],
/// [`Connection::read`]): resolves with the result (the bytes moved) and the buffer.
///
/// The operation is submitted when the future is made, inside a reactor (as io_uring submits
/// at the call), or else at its first poll: `let sent = conn.send(buf);` goes out with the
/// tick's posts while the task awaits something else (its echo, say), and `sent.await` then
/// gives the buffer back.
pub struct OpFuture {
    st: Shared,
    /// Not submitted yet (made where no reactor polls).
    op: Option<Op>,
    /// Submitted: the slot its completion lands in.
    slot: Option<usize>,
    /// The submission failed: the result, handed out at the first poll.
    failed: Option<(Result<u32>, Option<Buf>)>,
}

impl std::fmt::Debug for OpFuture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpFuture").field("slot", &self.slot).finish()
    }
}

impl OpFuture {
    fn new(st: Shared, op: Op) -> OpFuture {
        let mut f = OpFuture { st, op: Some(op), slot: None, failed: None };
        f.submit(None);
        f
    }

    /// Submits the operation if a reactor is at hand (or `waker` is given: the first poll,
    /// which must submit or fail). Leaves it for the first poll otherwise.
    fn submit(&mut self, waker: Option<&Waker>) {
        let Some(op) = self.op.take() else { return };
        let (usable, home) = {
            let st = self.st.borrow();
            (st.usable(), st.home)
        };
        let token = match usable {
            Ok(t) => t,
            Err(e) => {
                self.failed = Some((Err(e), op.into_buf()));
                return;
            }
        };
        let slot = self.st.borrow_mut().slots.insert(Slot::Waiting(waker.cloned()));
        let mut op = Some(op.user_data(slot as u64));
        let submitted = with_ctx_of(home, |ctx| ctx.submit(token, op.take().expect("once")));
        match submitted {
            Ok(Ok(())) => self.slot = Some(slot),
            Ok(Err(refused)) => {
                self.st.borrow_mut().slots.remove(slot);
                self.failed = Some((Err(*refused.error), refused.op.into_buf()));
            }
            Err(e) => {
                self.st.borrow_mut().slots.remove(slot);
                let op = op.take().expect("not submitted");
                if waker.is_some() {
                    self.failed = Some((Err(e), op.into_buf()));
                } else {
                    // Not its reactor here (none, or another): submitted at the first poll.
                    self.op = Some(op);
                }
            }
        }
    }
}

#[cfg(feature = "tokio")]
impl OpFuture {
    /// The slot its completion lands in, while it is submitted and has not resolved: its
    /// operation's user_data ([`Connection::append`]).
    pub(super) fn slot(&self) -> Option<usize> {
        self.slot
    }

    /// True when its completion (or its refusal) is in: a poll now resolves, and registers no
    /// waker. A look that replaces no waker of another task's (a byte stream's reader looking
    /// at its writer's sends).
    pub(super) fn is_done(&self) -> bool {
        if self.failed.is_some() {
            return true;
        }
        let Some(slot) = self.slot else { return self.op.is_none() };
        matches!(self.st.borrow().slots.get(slot), Some(Slot::Done(..)) | Some(Slot::Abandoned) | None)
    }

    /// Whether the submission went: `None` when it did (the completion comes later), the
    /// failed submission's result otherwise. Submits first when it was made where no reactor
    /// was at hand. Registers no waker: the first `poll` does.
    pub(super) fn refused(&mut self, waker: &Waker) -> Option<(Result<u32>, Option<Buf>)> {
        if self.op.is_some() {
            self.submit(Some(waker));
        }
        self.failed.take()
    }
}

impl Future for OpFuture {
    type Output = (Result<u32>, Option<Buf>);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if self.op.is_some() {
            self.submit(Some(cx.waker()));
        }
        if let Some(out) = self.failed.take() {
            return Poll::Ready(out);
        }
        let Some(slot) = self.slot else {
            return Poll::Ready((Err(Error::Config("polled after it resolved".into())), None));
        };
        let mut st = self.st.borrow_mut();
        match st.slots.get_mut(slot) {
            Some(Slot::Done(..)) => {
                let Slot::Done(result, buf) = st.slots.remove(slot) else { unreachable!("matched") };
                drop(st);
                self.slot = None;
                Poll::Ready((result.map_err(Error::Operation), buf))
            }
            Some(Slot::Waiting(w)) => {
                if !w.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    *w = Some(cx.waker().clone());
                }
                Poll::Pending
            }
            Some(Slot::Abandoned) | None => {
                Poll::Ready((Err(Error::Config("the operation's slot is gone".into())), None))
            }
        }
    }
}

impl Drop for OpFuture {
    fn drop(&mut self) {
        if let Some(slot) = self.slot {
            let mut st = self.st.borrow_mut();
            match st.slots.get(slot) {
                Some(Slot::Done(..)) => {
                    st.slots.remove(slot);
                }
                Some(Slot::Waiting(_)) => st.slots[slot] = Slot::Abandoned,
                _ => {}
            }
        }
    }
}

/// [`Connection::recv`]'s future.
pub struct Recv {
    st: Shared,
    /// Its place in the connection's line (`line.rs`), until it takes its message or ends.
    place: Option<usize>,
}

impl std::fmt::Debug for Recv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recv").field("in_line", &self.place.is_some()).finish()
    }
}

impl Future for Recv {
    type Output = Result<Buf>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.poll_message(cx).map(|r| r.map(Message::into_buf))
    }
}

impl Recv {
    /// The next message and its kind ([`Connection::recv_message`]); inlined into `Recv`'s
    /// poll, whose body it is (a call of its own cost a round trip of the async face about 150
    /// instructions, issue 46's measurement).
    #[inline]
    pub(super) fn poll_message(&mut self, cx: &mut Context<'_>) -> Poll<Result<Message>> {
        let this = self;
        let mut st = this.st.borrow_mut();
        // Polled again after it resolved: a new call, at the end of the line.
        let place = *this.place.get_or_insert_with(|| st.recvs.join());
        if let Some(msg) = st.recvs.take(place, cx.waker()) {
            this.place = None;
            // A receive to post again (its own queue), or one withheld to release (a shared
            // queue): room again under the peer's credit.
            let refill = st.owed() || st.withheld > 0;
            let key = st.token.and_then(ConnKey::of).filter(|_| refill);
            // The state's handle and the orphan list are cloned only for a refill (issue 33:
            // cloned and dropped on every message, about 40 instructions).
            let refill_with = key.map(|key| (key, st.home, st.orphans.clone()));
            drop(st);
            if let Some((key, home, orphans)) = refill_with {
                let st_rc = this.st.clone();
                // Room again under the peer's credit: post a receive for the one handed out,
                // on its own reactor. Polled where that reactor is not at hand (a task of
                // another runtime, another reactor's tick), the post is owed to its next tick:
                // skipped, the receives of a connection read only there never came back, and
                // at none posted its peer could send nothing more (late review of M5, F2).
                let refill = move |ctx: &mut Ctx<'_>| {
                    if let Some(mut conn) = ctx.conn(key) {
                        let mut st = st_rc.borrow_mut();
                        if st.srq {
                            // Back within its share of unread messages: one withheld receive
                            // goes back to the queue, and its credit to the peer.
                            let share = conn.recv_share().unwrap_or(0) as usize;
                            if st.withheld > 0 && st.recvs.unread() <= share {
                                st.withheld -= conn.release_receives(1).min(st.withheld);
                            }
                        } else if !st.refill_pending {
                            // (A refill that failed waits for its timer.)
                            st.replenish(&mut conn, 1);
                        }
                    }
                };
                let mut refill = Some(refill);
                let _ = with_ctx_of(home, |ctx| refill.take().map(|f| f(ctx)));
                if let Some(f) = refill {
                    orphans.defer(Box::new(f));
                }
            }
            return Poll::Ready(Ok(msg));
        }
        if let Phase::Closed(r) = &st.phase {
            // It holds no message, so none is unclaimed: every one that arrived before the
            // close is held by a caller ahead of it.
            let r = r.clone();
            st.recvs.leave(place);
            this.place = None;
            return Poll::Ready(Err(Error::Closed(r)));
        }
        Poll::Pending
    }
}

impl Drop for Recv {
    fn drop(&mut self) {
        if let Some(place) = self.place.take() {
            // A message it was given goes to the next caller in line.
            self.st.borrow_mut().recvs.leave(place);
        }
    }
}

/// [`Connection::close`]'s and [`Connection::closed`]'s future.
pub struct Close {
    st: Shared,
    asked: bool,
}

impl std::fmt::Debug for Close {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Close").field("asked", &self.asked).finish()
    }
}

impl Future for Close {
    type Output = CloseReason;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<CloseReason> {
        if let Phase::Closed(r) = &self.st.borrow().phase {
            return Poll::Ready(r.clone());
        }
        if !self.asked {
            self.asked = true;
            let (token, home) = {
                let st = self.st.borrow();
                (st.token, st.home)
            };
            if let Some(t) = token {
                if with_ctx_of(home, |ctx| ctx.close(t)).is_err() {
                    // Not its reactor here (none, or another one, which has a connection of
                    // the same token): its own reactor closes it at its next tick.
                    self.st.borrow().orphans.push(t);
                }
            }
        }
        let mut st = self.st.borrow_mut();
        st.waiters.retain(|w| !w.will_wake(cx.waker()));
        st.waiters.push(cx.waker().clone());
        Poll::Pending
    }
}
