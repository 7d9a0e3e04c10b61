//! Contexts handed to callbacks: command buffers over the reactor's objects.

use std::net::SocketAddr;
use std::task::Waker;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::proto::conn::State;
use crate::proto::metrics::ConnMetrics;
use crate::proto::op::RemoteAccess;
use crate::proto::token::{ConnKey, Key, TimerKey, Token};
use crate::proto::wire::ConnectInfo;
use crate::reactor::event_loop::exec::{ExecId, Orphans};
use crate::reactor::{Config, ConnectOptions, ConnectionHandler, Core, ListenerHandler, Op, Stats};
use crate::sys::pool::{Buf, Exposed, RegionWindow};
use crate::sys::region::{Region, RegionSlice};

/// The reactor's command API, as seen from a callback (or from [`Reactor::ctx`]).
///
/// Nothing called through it destroys anything at once: closed objects are destroyed at the
/// end of the tick, after the tick's events are acked.
///
/// [`Reactor::ctx`]: crate::Reactor::ctx
pub struct Ctx<'a> {
    pub(in crate::reactor) core: &'a mut Core,
    /// The listener or connection whose callback this is (owner of timers it sets).
    owner: Option<Token>,
}

impl std::fmt::Debug for Ctx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ctx").field("owner", &self.owner).finish()
    }
}

impl<'a> Ctx<'a> {
    pub(in crate::reactor) fn new(core: &'a mut Core, owner: Option<Token>) -> Self {
        Ctx { core, owner }
    }

    /// Makes [`Reactor::run`](crate::Reactor::run) return after this tick.
    pub fn stop(&mut self) {
        self.core.stop = true;
    }

    /// Binds to `addr` and listens; connect requests go to `handler`.
    ///
    /// # Errors
    ///
    /// [`Error::Verb`] naming `rdma_create_id`, `rdma_bind_addr` (no RDMA device has that
    /// address, or it is in use) or `rdma_listen`.
    pub fn listen(&mut self, addr: SocketAddr, handler: impl ListenerHandler + 'static) -> Result<Token> {
        self.core.listen(addr, Box::new(handler))
    }

    /// Starts a client connection to `dst`: address resolution, route resolution, connect.
    /// `handler` hears how it goes, including failure (`on_closed` with the reason).
    ///
    /// # Errors
    ///
    /// Only what fails at once (`rdma_create_id`, `rdma_resolve_addr`, options out of range).
    pub fn connect(
        &mut self,
        dst: SocketAddr,
        opts: ConnectOptions,
        handler: impl ConnectionHandler + 'static,
    ) -> Result<Token> {
        self.core.connect(dst, opts, Box::new(handler))
    }

    /// Closes a connection (disconnect, drain, destroy) or a listener. Idempotent; a stale
    /// token is ignored.
    pub fn close(&mut self, token: Token) {
        self.core.close(token);
    }

    /// Submits an operation on the connection `token` names. See [`Conn::submit`].
    ///
    /// # Errors
    ///
    /// As [`Conn::submit`], and [`Error::StaleToken`] for a token that names no live connection.
    pub fn submit(&mut self, token: Token, op: Op) -> std::result::Result<(), SubmitError> {
        if op.is_raw() {
            return Err(raw_refused(op));
        }
        match ConnKey::of(token) {
            Some(t) => self.core.submit(t, op),
            None => Err(SubmitError::new(Error::StaleToken(token.as_u64()), op)),
        }
    }

    /// [`Ctx::submit`] of a connection key: raw operations refused (they need
    /// [`Conn::submit_raw`]'s contract).
    #[inline]
    fn submit_safe(&mut self, t: ConnKey, op: Op) -> std::result::Result<(), SubmitError> {
        if op.is_raw() {
            return Err(raw_refused(op));
        }
        self.core.submit(t, op)
    }

    /// A buffer of `len` bytes from the pool of the device the connection `token` names is on.
    /// See [`Conn::alloc`].
    ///
    /// # Errors
    ///
    /// As [`Conn::alloc`], and [`Error::StaleToken`] for a token that names no connection.
    pub fn alloc(&mut self, token: Token, len: usize) -> Result<Buf> {
        let t = ConnKey::of(token).ok_or_else(|| Error::StaleToken(token.as_u64()))?;
        self.core.alloc(t, len)
    }

    /// Calls the current listener's or connection's `on_timer` with `user_data` after
    /// `delay`. Returns the timer's token, for [`cancel_timer`](Self::cancel_timer).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] outside a callback (a timer needs an owner), or for a delay too large to
    /// represent; [`Error::StaleToken`] when the owner is gone (a completion delivered while its
    /// connection is destroyed: nothing would cancel the timer, and no `on_timer` could be
    /// called).
    pub fn set_timer(&mut self, delay: Duration, user_data: u64) -> Result<Token> {
        let owner = self.owner.ok_or_else(|| Error::Config("set_timer needs a callback's context".into()))?;
        self.core.set_timer(owner, delay, user_data)
    }

    /// Cancels a timer; a fired or stale one is ignored.
    pub fn cancel_timer(&mut self, timer: Token) {
        self.core.cancel_timer(timer);
    }

    /// Spawns `fut` as a task of this reactor, as [`Reactor::spawn`](crate::Reactor::spawn)
    /// does: the async face's way to start work where its reactor is at hand only as a context
    /// (a byte stream's lingering close queued for the next tick, `crate::io`). Detached.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn spawn(&mut self, fut: impl std::future::Future<Output = ()> + 'static) {
        drop(crate::reactor::event_loop::exec::spawn_on(&mut self.core.exec, fut));
    }

    /// The live connection `key` names, as its callbacks see it (the async face, `crate::io`).
    pub(crate) fn conn(&mut self, key: ConnKey) -> Option<Conn<'_>> {
        self.core.conns.get(key)?;
        Some(Conn::new(self.core, key))
    }

    /// The reactor's configuration.
    pub(crate) fn config(&self) -> &Config {
        &self.core.cfg
    }

    /// The largest message a connection takes (`Core::max_msg`): the pool's largest chunk, or on
    /// a shared receive queue its buffer size.
    #[cfg(feature = "tokio")]
    pub(crate) fn max_msg(&self) -> usize {
        self.core.max_msg()
    }

    /// Wakes `waker` at `at` (`io::sleep`): the sleep's key.
    pub(crate) fn wake_at(&mut self, at: Instant, waker: Waker) -> TimerKey {
        self.core.sleep_until(at, waker)
    }

    /// Replaces the waker of a sleep; false once it is over.
    pub(crate) fn set_wake(&mut self, key: TimerKey, waker: &Waker) -> bool {
        self.core.set_sleeper(key, waker)
    }

    /// Forgets a sleep.
    pub(crate) fn cancel_wake(&mut self, key: TimerKey) {
        self.core.cancel_sleep(key);
    }

    /// Where the async face's handles leave the tokens they stop holding (`event_loop/exec.rs`).
    pub(crate) fn orphans(&self) -> Orphans {
        self.core.exec.orphans.clone()
    }

    /// The id of this reactor's executor: what the async face's handles are bound to
    /// (`event_loop/exec.rs`, `with_ctx_of`).
    pub(crate) fn exec_id(&self) -> ExecId {
        self.core.exec.id()
    }

    /// Reactor statistics.
    pub fn stats(&self) -> Stats {
        self.core.stats()
    }

    /// Live connections.
    pub fn connections(&self) -> usize {
        self.core.conns.len()
    }

    /// Connection `token`'s counters, while it lives (`None` for another kind of token, or
    /// once the connection is gone).
    pub fn conn_metrics(&self, token: Token) -> Option<ConnMetrics> {
        self.core.conn_metrics(token)
    }

    /// The reactor's [`Stats`] and every live connection's [`ConnMetrics`] in the Prometheus
    /// text format ([`Reactor::prometheus`](crate::Reactor::prometheus)).
    pub fn prometheus(&self, labels: &[(&str, &str)]) -> String {
        self.core.prometheus(labels)
    }

    /// The reactor's [`Stats`] alone in the Prometheus text format, without any connection's
    /// [`ConnMetrics`] series and so without their peers' addresses: a scrape of a size that
    /// does not grow with the connections
    /// ([`Reactor::prometheus_totals`](crate::Reactor::prometheus_totals)).
    pub fn prometheus_totals(&self, labels: &[(&str, &str)]) -> String {
        self.core.prometheus_totals(labels)
    }
}

/// An operation the reactor would not take, with the operation given back.
#[derive(Debug)]
pub struct SubmitError {
    /// Why.
    pub error: Box<Error>,
    /// The operation, with its buffer.
    pub op: Box<Op>,
}

impl SubmitError {
    pub(in crate::reactor) fn new(error: Error, op: Op) -> SubmitError {
        SubmitError { error: Box::new(error), op: Box::new(op) }
    }
}

/// Transparent: displays as the [`Error`] it carries, whose cause is its source.
impl std::fmt::Display for SubmitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for SubmitError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&*self.error)
    }
}

/// The error alone, so one `?` chain can mix [`Conn::alloc`] and [`Conn::submit`]; the
/// operation (and its buffer) is dropped, which returns the buffer to the pool.
///
/// ```
/// fn send(conn: &mut rdma_reactor::Conn<'_>, bytes: &[u8]) -> rdma_reactor::Result<()> {
///     let mut buf = conn.alloc(bytes.len())?;
///     buf.fill_from(bytes)?;
///     conn.submit(rdma_reactor::Op::send(buf))?;
///     Ok(())
/// }
/// ```
impl From<SubmitError> for Error {
    fn from(e: SubmitError) -> Error {
        *e.error
    }
}

/// The context of one connection's callback: the connection's own commands, and the reactor's
/// through [`Conn::ctx`].
pub struct Conn<'a> {
    ctx: Ctx<'a>,
    key: ConnKey,
}

impl std::fmt::Debug for Conn<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn").field("token", &self.key.token()).finish()
    }
}

impl<'a> Conn<'a> {
    pub(in crate::reactor) fn new(core: &'a mut Core, key: ConnKey) -> Self {
        Conn { ctx: Ctx::new(core, Some(key.token())), key }
    }

    /// This connection's token.
    pub fn token(&self) -> Token {
        self.key.token()
    }

    /// The reactor's command API: listen, connect, close or submit on other objects, timers
    /// (owned by this connection), statistics, stop.
    pub fn ctx(&mut self) -> &mut Ctx<'a> {
        &mut self.ctx
    }

    /// A buffer of `len` bytes (capacity: the smallest pool class that holds them) from this
    /// connection's device pool. Its bytes read as zeros until written, except bytes this
    /// connection itself left in the chunk (its own earlier messages, sent or received, which
    /// are not zeroed for it): a chunk's earlier owner's bytes (another connection's data)
    /// never show through a view, a send or an exposure. They are zeroed lazily, only where they would show, so filling the buffer
    /// ([`Buf::fill_from`]) and sending it, or receiving into it and reading what arrived,
    /// costs nothing extra ([`Buf`]).
    ///
    /// # Errors
    ///
    /// [`Error::TooLarge`] beyond the largest class (`PoolConfig::chunk_sizes`, set through
    /// [`Config::pool`](crate::Config::pool)); [`Error::OverBudget`] when the connection holds
    /// its reservation and may borrow no more now ([`PoolConfig`](crate::PoolConfig)'s memory
    /// guarantee: transient, it passes as buffers come back); [`Error::PoolExhausted`] when
    /// the pool is at its maximum; [`Error::NotConnected`] before the connection has a device
    /// (before [`on_ready`](ConnectionHandler::on_ready)).
    pub fn alloc(&mut self, len: usize) -> Result<Buf> {
        self.ctx.core.alloc(self.key, len)
    }

    /// Submits an operation on this connection. It is posted at the end of the tick, chained
    /// with the tick's other operations on this queue pair, and completes exactly once through
    /// [`on_completion`](ConnectionHandler::on_completion).
    ///
    /// Operations are accepted from [`on_ready`](ConnectionHandler::on_ready) until the
    /// connection is closed. Once it is closing they are not posted any more and complete with
    /// [`OpError::Cancelled`](crate::OpError::Cancelled), their buffer handed back.
    ///
    /// # Errors
    ///
    /// The connection has no queue pair yet or is gone, the buffer belongs to another device,
    /// a send is larger than the peer accepts, or a receive on a connection of a shared
    /// receive queue ([`Config::srq`](crate::Config::srq): the runtime posts those, and
    /// messages arrive with [`Completion::SRQ_RECV`](crate::Completion::SRQ_RECV)). The
    /// operation comes back in the error.
    pub fn submit(&mut self, op: Op) -> std::result::Result<(), SubmitError> {
        self.ctx.submit_safe(self.key, op)
    }

    /// Appends as many of `bytes` as fit to this connection's last submitted operation if it
    /// is a SEND of a pool buffer with `user_data`, not posted yet (submitted in this tick, or
    /// waiting for credits or a send slot): up to its buffer's capacity, the message size and
    /// `limit`. Returns how many bytes it took (0: none, nothing changed). The byte stream's coalesced
    /// writes (`crate::io::Stream`; `data/append.rs`).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn append_send(&mut self, user_data: u64, bytes: &[std::io::IoSlice<'_>], limit: usize) -> usize {
        self.ctx.core.append_send(self.key, user_data, bytes, limit)
    }

    /// Submits an operation on caller-registered memory ([`Op::raw_send`], [`Op::raw_recv`]).
    ///
    /// # Safety
    ///
    /// The memory `op` names must be registered on this connection's protection domain with
    /// the `lkey` given, and must stay allocated, registered and untouched by the caller until
    /// the operation's completion reaches `on_completion` (for a receive, the device writes it
    /// until then).
    ///
    /// # Errors
    ///
    /// As [`Conn::submit`].
    // Why `unsafe` here, outside `src/sys/`: the contract is the caller's memory, which only the
    // caller can vouch for; the post that relies on it is `src/sys/`'s (`Qp::post_send_run`).
    #[allow(unsafe_code)] // Only declares the contract; the body is safe code.
    pub unsafe fn submit_raw(&mut self, op: Op) -> std::result::Result<(), SubmitError> {
        self.ctx.core.submit(self.key, op)
    }

    /// Exposes `buf`'s `len()` bytes to this connection's peer with exactly `access`, for its
    /// RDMA READs and WRITEs: a type-2 memory window bound to this connection's queue pair.
    /// Send the peer [`Exposed::remote`].
    ///
    /// - The descriptor works on this connection only. A peer using it on another connection
    ///   (even of this process), or reaching past the window's end, gets a remote access error
    ///   (and that connection closes).
    /// - The peer sees only this owner's bytes: bytes the chunk held from an earlier use read
    ///   as zeros ([`Buf`]'s rule). Bytes written (in any way), received, READ or zeroed are kept.
    /// - The bind is queued on this connection's send queue like an operation, so it reaches
    ///   the device before anything submitted after this call (such as the descriptor's send).
    ///   If it fails, the connection closes with a work error.
    /// - Dropping the [`Exposed`] (or [`Exposed::into_buf`]) revokes access before the chunk
    ///   can be reused; so does the end of the connection.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for an empty `access` or buffer, or a buffer of another device;
    /// [`Error::NotConnected`] before [`on_ready`](ConnectionHandler::on_ready) or once closed;
    /// [`Error::Verb`] when `ibv_alloc_mw` fails (a device without type-2 memory windows). The
    /// buffer goes back to the pool.
    pub fn expose(&mut self, buf: Buf, access: RemoteAccess) -> Result<Exposed> {
        self.ctx.core.expose(self.key, buf, access)
    }

    /// Lets this connection's peer READ and/or WRITE part of an application [`Region`]: a
    /// type-2 memory window over exactly `slice`, bound to this connection's queue pair, over
    /// the region's one registration on this device (made now if it is the first use here).
    /// Many connections can each be given a window over the same memory: N peers, one copy.
    ///
    /// - The descriptor ([`RegionWindow::remote`]) works on this connection only: a peer using
    ///   it on another connection, or reaching past the window's end, gets a remote access
    ///   error (and that connection closes).
    /// - The bind is queued like an operation, before anything submitted after this call
    ///   (such as the descriptor's send).
    /// - Dropping the [`RegionWindow`] revokes access; so does the end of the connection.
    /// - The application keeps reading and writing the region ([`Region::read_at`],
    ///   [`Region::write_at`]) while peers access it; a peer's READ racing a local write can
    ///   see part of it (the README's "One-sided access" shows the usual remedy).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for an empty `access`; [`Error::NotConnected`] before
    /// [`on_ready`](ConnectionHandler::on_ready) or once closed; [`Error::Verb`] or
    /// [`Error::Memlock`] when registering the region fails; [`Error::Verb`] when
    /// `ibv_alloc_mw` fails (a device without type-2 memory windows).
    pub fn expose_region(&mut self, slice: &RegionSlice, access: RemoteAccess) -> Result<RegionWindow> {
        self.ctx.core.expose_region(self.key, slice, access)
    }

    /// Registers `region` on this connection's device now, rather than at its first operation
    /// or exposure there (registering pins the memory, which takes time for a large region).
    ///
    /// # Errors
    ///
    /// [`Error::NotConnected`] before [`on_ready`](ConnectionHandler::on_ready);
    /// [`Error::Memlock`] or [`Error::Verb`] when `ibv_reg_mr` fails.
    pub fn register_region(&mut self, region: &Region) -> Result<()> {
        self.ctx.core.register_region(self.key, region)
    }

    /// Starts closing this connection (disconnect, drain outstanding operations, destroy).
    /// Operations submitted and not yet posted are cancelled. On iWARP with the close
    /// handshake ([`Config::close_handshake`](crate::Config::close_handshake)) the disconnect
    /// waits until the peer confirmed it has every message posted before the close.
    pub fn close(&mut self) {
        self.ctx.core.close(self.key.token());
    }

    /// The connection's state, or `None` once it is destroyed.
    pub fn state(&self) -> Option<State> {
        self.ctx.core.conns.get(self.key).map(|c| c.role.state().clone())
    }

    /// What the peer sent when connecting or accepting; `None` for a peer that sent none.
    pub fn peer_info(&self) -> Option<&ConnectInfo> {
        self.ctx.core.conns.get(self.key).and_then(|c| c.infos.peer.as_ref())
    }

    /// What this side sent.
    pub fn local_info(&self) -> Option<&ConnectInfo> {
        self.ctx.core.conns.get(self.key).map(|c| &c.infos.local)
    }

    /// The message size this side announces, which is the size of the receives it must post
    /// (known from [`on_ready`](crate::ConnectionHandler::on_ready) on): a client's
    /// [`ConnectOptions::msg_size`](crate::ConnectOptions::msg_size) (or
    /// [`Config::msg_size`](crate::Config::msg_size) when that is 0); an accepted connection's,
    /// the smaller of its client's `msg_size` and `Config::msg_size`. The peer may send
    /// messages of this size, so a receive posted smaller fails the connection when one comes
    /// (a local length error on InfiniBand and RoCE); and this side's sends are refused above it
    /// ([`Error::TooLarge`]). 0 once the connection is destroyed.
    pub fn msg_size(&self) -> usize {
        self.ctx.core.conns.get(self.key).map_or(0, |c| c.infos.local.msg_size as usize)
    }

    /// The transport of the connection's device (from `on_ready` on; `None` before it has
    /// one): InfiniBand's (IB, RoCE) or iWARP. On iWARP [`Op::write_imm`](crate::Op::write_imm)
    /// is refused and exposures need [`Config::exposure_registration`](crate::Config); the
    /// README's "Transports" section has the whole list.
    pub fn transport(&self) -> Option<crate::Transport> {
        let c = self.ctx.core.conns.get(self.key)?;
        c.placed.map(|p| self.ctx.core.devices[p.device].caps.transport)
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.ctx.core.conns.get(self.key).and_then(|c| c.ep.id()).and_then(|id| id.peer_addr())
    }

    /// The local address.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.ctx.core.conns.get(self.key).and_then(|c| c.ep.id()).and_then(|id| id.local_addr())
    }

    /// Send and receive work requests posted and not yet completed.
    pub fn outstanding(&self) -> (u32, u32) {
        self.ctx.core.conns.get(self.key).map_or((0, 0), |c| c.lanes.outstanding())
    }

    /// Send-queue operations submitted and not yet posted (waiting for the peer's credits, or
    /// for send-queue or CQ room), and their bytes: what [`Config::send_backlog`] and
    /// [`Config::send_backlog_bytes`] bound. A handler that answers every message can hold
    /// its answers (or stop reading) while this is high, instead of meeting the limit.
    ///
    /// [`Config::send_backlog`]: crate::Config::send_backlog
    /// [`Config::send_backlog_bytes`]: crate::Config::send_backlog_bytes
    pub fn backlog(&self) -> (u32, usize) {
        self.ctx.core.conns.get(self.key).map_or((0, 0), |c| c.lanes.backlog())
    }

    /// Receive work requests this connection's queue pair holds at most: 0 on a shared
    /// receive queue ([`Config::srq`](crate::Config::srq)), where the runtime posts them.
    pub fn recv_capacity(&self) -> u32 {
        self.ctx.core.conns.get(self.key).map_or(0, |c| c.lanes.recv_capacity())
    }

    /// On a shared receive queue ([`Config::srq`](crate::Config::srq)): the receives of the
    /// queue this connection holds now, its share ([`SrqConfig`](crate::SrqConfig): its
    /// peer's credits never exceed it); `None` on a receive queue of its own.
    pub fn recv_share(&self) -> Option<u32> {
        self.ctx.core.conns.get(self.key).and_then(|c| c.srq_share).map(|s| s.receives)
    }

    /// On a shared receive queue, from [`ConnectionHandler::on_completion`] for a message
    /// ([`Completion::SRQ_RECV`](crate::Completion::SRQ_RECV)): the receive it consumed is not
    /// posted again, and its credit not returned to the peer, until
    /// [`release_receives`](Conn::release_receives). Back-pressure for a handler that keeps
    /// messages it has not processed (the async face does, beyond its share of unread
    /// messages): its peer's credit shrinks by one for each receive withheld, so a peer cannot
    /// make the runtime post fresh receives for it while its messages pile up. False (and
    /// nothing withheld) anywhere else. The receives still withheld when the connection
    /// leaves the queue are posted again for others.
    pub fn withhold_receive(&mut self) -> bool {
        self.ctx.core.withhold_receive(self.key)
    }

    /// Posts again up to `n` of the receives [`withhold_receive`](Conn::withhold_receive)
    /// kept (at the tick's posting), each returning its credit to the peer; returns how many.
    pub fn release_receives(&mut self, n: u32) -> u32 {
        self.ctx.core.release_receives(self.key, n)
    }

    /// Receives withheld by [`withhold_receive`](Conn::withhold_receive) and not released.
    pub fn withheld_receives(&self) -> u32 {
        self.ctx.core.conns.get(self.key).map_or(0, |c| c.srq_withheld.by_handler)
    }

    /// Send work requests this connection's queue pair holds at most.
    pub fn send_capacity(&self) -> u32 {
        self.ctx.core.conns.get(self.key).map_or(0, |c| c.lanes.send_capacity())
    }

    /// This connection's counters so far: messages and bytes each way, operations by kind,
    /// credit waits and their time, errors ([`ConnMetrics`]).
    pub fn metrics(&self) -> ConnMetrics {
        self.ctx.core.conns.get(self.key).map(|c| c.meter.snapshot(std::time::Instant::now())).unwrap_or_default()
    }
}

/// The refusal of a raw operation on a safe submit path (`Ctx::submit`, `Conn::submit`).
fn raw_refused(op: Op) -> SubmitError {
    SubmitError::new(Error::Config("raw operations go through Conn::submit_raw".into()), op)
}
