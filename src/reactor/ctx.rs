//! Contexts handed to callbacks: command buffers over the reactor's objects.

use std::net::SocketAddr;
use std::time::Duration;

use super::{ConnectOptions, Core, Stats};
use crate::conn::State;
use crate::error::{Error, Result};
use crate::handler::{ConnectionHandler, ListenerHandler};
use crate::op::Op;
use crate::sys::pool::Buf;
use crate::token::Token;
use crate::wire::ConnectInfo;

/// The reactor's command API, as seen from a callback (or from [`Reactor::ctx`]).
///
/// Nothing called through it destroys anything at once: closed objects are destroyed at the
/// end of the tick, after the tick's events are acked.
///
/// [`Reactor::ctx`]: crate::Reactor::ctx
pub struct Ctx<'a> {
    pub(super) core: &'a mut Core,
    /// The listener or connection whose callback this is (owner of timers it sets).
    owner: Option<Token>,
}

impl std::fmt::Debug for Ctx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ctx").field("owner", &self.owner).finish()
    }
}

impl<'a> Ctx<'a> {
    pub(super) fn new(core: &'a mut Core, owner: Option<Token>) -> Self {
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

    /// Submits an operation on any connection. See [`Conn::submit`].
    pub fn submit_to(&mut self, token: Token, op: Op) -> std::result::Result<(), SubmitError> {
        if op.is_raw() {
            return Err(SubmitError::new(Error::Config("raw operations go through submit_raw".into()), op));
        }
        self.core.submit(token, op)
    }

    /// A buffer of `len` bytes from the pool of the device `token`'s connection is on.
    pub fn alloc_for(&mut self, token: Token, len: usize) -> Result<Buf> {
        self.core.alloc(token, len)
    }

    /// Calls the current listener's or connection's `on_timer` with `user_data` after
    /// `delay`. Returns the timer's token, for [`cancel_timer`](Self::cancel_timer).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] outside a callback (a timer needs an owner).
    pub fn set_timer(&mut self, delay: Duration, user_data: u64) -> Result<Token> {
        let owner = self.owner.ok_or_else(|| Error::Config("set_timer needs a callback's context".into()))?;
        Ok(self.core.set_timer(owner, delay, user_data))
    }

    /// Cancels a timer; a fired or stale one is ignored.
    pub fn cancel_timer(&mut self, timer: Token) {
        self.core.user_timers.remove(timer);
    }

    /// Reactor statistics.
    pub fn stats(&self) -> Stats {
        self.core.stats
    }

    /// Live connections.
    pub fn connections(&self) -> usize {
        self.core.conns.len()
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
    pub(super) fn new(error: Error, op: Op) -> SubmitError {
        SubmitError { error: Box::new(error), op: Box::new(op) }
    }
}

impl std::fmt::Display for SubmitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "submit failed: {}", self.error)
    }
}

impl std::error::Error for SubmitError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// The context of one connection's callback: the connection's own commands, plus the whole
/// [`Ctx`] through `Deref`.
pub struct Conn<'a> {
    ctx: Ctx<'a>,
    token: Token,
}

impl std::fmt::Debug for Conn<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn").field("token", &self.token).finish()
    }
}

impl<'a> std::ops::Deref for Conn<'a> {
    type Target = Ctx<'a>;
    fn deref(&self) -> &Ctx<'a> {
        &self.ctx
    }
}

impl std::ops::DerefMut for Conn<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.ctx
    }
}

impl<'a> Conn<'a> {
    pub(super) fn new(core: &'a mut Core, token: Token) -> Self {
        Conn { ctx: Ctx::new(core, Some(token)), token }
    }

    /// This connection's token.
    pub fn token(&self) -> Token {
        self.token
    }

    /// A buffer of `len` bytes (capacity: the smallest pool class that holds them) from this
    /// connection's device pool. Its contents are whatever the chunk held last.
    ///
    /// # Errors
    ///
    /// [`Error::TooLarge`] beyond the largest class; [`Error::PoolExhausted`] when the pool is at
    /// its maximum; [`Error::NotConnected`] before the connection has a device (before
    /// [`on_ready`](ConnectionHandler::on_ready)).
    pub fn alloc(&mut self, len: usize) -> Result<Buf> {
        self.ctx.core.alloc(self.token, len)
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
    /// or a send is larger than the peer accepts. The operation comes back in the error.
    pub fn submit(&mut self, op: Op) -> std::result::Result<(), SubmitError> {
        let t = self.token;
        self.ctx.submit_to(t, op)
    }

    /// Submits an operation on caller-registered memory ([`Op::raw_send`], [`Op::raw_recv`]).
    ///
    /// # Safety
    ///
    /// The memory `op` names must be registered on this connection's protection domain with
    /// the `lkey` given, and must stay allocated, registered and untouched by the caller until
    /// the operation's completion reaches `on_completion` (for a receive, the device writes it
    /// until then).
    #[allow(unsafe_code)] // Only declares the contract; the body is safe code.
    pub unsafe fn submit_raw(&mut self, op: Op) -> std::result::Result<(), SubmitError> {
        let t = self.token;
        self.ctx.core.submit(t, op)
    }

    /// Starts closing this connection (disconnect, drain outstanding operations, destroy).
    pub fn close(&mut self) {
        let t = self.token;
        self.ctx.core.close(t);
    }

    /// The connection's state, or `None` once it is destroyed.
    pub fn state(&self) -> Option<State> {
        self.ctx.core.conns.get(self.token).map(|c| c.role.state().clone())
    }

    /// What the peer sent when connecting or accepting; `None` for a peer that sent none.
    pub fn peer_info(&self) -> Option<&ConnectInfo> {
        self.ctx.core.conns.get(self.token).and_then(|c| c.peer_info.as_ref())
    }

    /// What this side sent.
    pub fn local_info(&self) -> Option<&ConnectInfo> {
        self.ctx.core.conns.get(self.token).map(|c| &c.local_info)
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.ctx.core.conns.get(self.token).and_then(|c| c.id.as_ref()).and_then(|id| id.peer_addr())
    }

    /// The local address.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.ctx.core.conns.get(self.token).and_then(|c| c.id.as_ref()).and_then(|id| id.local_addr())
    }

    /// Send and receive work requests posted and not yet completed.
    pub fn outstanding(&self) -> (u32, u32) {
        self.ctx.core.conns.get(self.token).map_or((0, 0), |c| (c.out_send, c.out_recv))
    }

    /// Receive work requests this connection's queue pair holds at most.
    pub fn recv_capacity(&self) -> u32 {
        self.ctx.core.conns.get(self.token).map_or(0, |c| c.caps.max_recv_wr)
    }

    /// Send work requests this connection's queue pair holds at most.
    pub fn send_capacity(&self) -> u32 {
        self.ctx.core.conns.get(self.token).map_or(0, |c| c.caps.max_send_wr)
    }
}
