//! The callback API: one trait for listeners, one for connections (agents and clients).
//!
//! Callbacks receive a context ([`Ctx`] or [`Conn`]) over the reactor, never the reactor
//! itself: closing a connection, posting or connecting from inside a callback is safe; posts
//! go out and closed objects are destroyed at the end of the tick.

use std::net::SocketAddr;
use std::time::Duration;

use crate::proto::conn::CloseReason;
use crate::proto::token::Token;
use crate::proto::wire::{ConnectInfo, RejectReason};
use crate::reactor::{Completion, Conn, Ctx};

/// A connect request, as shown to [`ListenerHandler::on_connect_request`].
#[derive(Clone, Debug)]
pub struct ConnectRequest {
    /// The listener it arrived on.
    pub listener: Token,
    /// The client's address.
    pub peer: Option<SocketAddr>,
    /// The client's connect information; `None` for a peer that sent none (a plain librdmacm
    /// program), which is served with the reactor's defaults.
    pub info: Option<ConnectInfo>,
}

/// The answer to a connect request.
#[allow(missing_debug_implementations)]
pub enum Decision {
    /// Accept; the handler serves the new connection (the agent). If the reactor then has no
    /// resources for it (no room on the shared CQ, no queue pair), the request is rejected with
    /// [`RejectCode::NoResources`](crate::RejectCode::NoResources), the listener hears
    /// [`ListenerHandler::on_refused`], and the handler is dropped without a callback.
    Accept(Box<dyn ConnectionHandler>),
    /// Reject with a reason the client can read.
    Reject(RejectReason),
}

/// Callbacks of a listener.
pub trait ListenerHandler {
    /// A client asks to connect. Called only for well-formed requests; malformed ones are
    /// rejected by the reactor and reported through [`on_refused`](Self::on_refused).
    fn on_connect_request(&mut self, ctx: &mut Ctx<'_>, req: &ConnectRequest) -> Decision;

    /// The reactor rejected a request on its own: malformed connect information, a message
    /// size above the pool's, a limit of [`Config`](crate::Config) reached
    /// (`max_connections`, `recv_budget`; a request that waited `Timeouts::accept` for room
    /// among `max_pending_accepts`), or no resources for an accepted one.
    fn on_refused(&mut self, ctx: &mut Ctx<'_>, peer: Option<SocketAddr>, reason: &RejectReason) {
        let _ = (ctx, peer, reason);
    }

    /// Something unexpected happened on the listening id; it keeps listening.
    fn on_error(&mut self, ctx: &mut Ctx<'_>, what: &str) {
        let _ = (ctx, what);
    }

    /// A timer set with [`Ctx::set_timer`] from this listener's callbacks fired.
    fn on_timer(&mut self, ctx: &mut Ctx<'_>, user_data: u64) {
        let _ = (ctx, user_data);
    }

    /// The listener is gone (closed, or its device removed). Its agents live on.
    fn on_closed(&mut self, ctx: &mut Ctx<'_>, reason: CloseReason) {
        let _ = (ctx, reason);
    }
}

/// Callbacks of one connection: an agent (server side) or a client.
///
/// The order is: [`on_ready`](Self::on_ready) once the queue pair exists, then
/// [`on_established`](Self::on_established), then completions, then exactly one
/// [`on_closed`](Self::on_closed). A connection that fails before it is established gets
/// `on_closed` with the reason (rejected, unreachable, timeout, ...). Every submitted
/// operation completes exactly once, before `on_closed`, also when the reactor is shut down or
/// dropped. A client with a reconnect policy may instead, after a failure, get
/// [`on_reconnecting`](Self::on_reconnecting), then `on_ready` and
/// [`on_reconnected`](Self::on_reconnected) for the new connection, as many times as the
/// policy allows, and `on_closed` once at the end.
///
/// **Receive credits.** With flow control (the default, [`Config::flow_control`](crate::Config::flow_control);
/// it applies when both sides offer it and each keeps at least 3 receives posted), the peer
/// may send only into receives this side has posted: the receives posted in `on_ready` are its
/// first credit, and each receive posted again after a message consumed one is granted back
/// (riding on the next message, or in a zero-length credit message the runtime sends). A data
/// message needs two credits and leaves one in reserve, so a peer holding `k` credits can send
/// `k - 1` messages. **A handler that stops posting receives stalls its peer**: its sends wait
/// (for ever, or until [`Config::credit_timeout`](crate::Config::credit_timeout) closes the
/// connection with `Stalled`). Keeping fewer receives posted than at first is fine: it slows the
/// peer (back-pressure), it never deadlocks. Posting more than at first is fine too: each
/// receive posted after `on_ready` is granted as it is posted. So a server that posts the
/// flow-control minimum (3) in `on_ready` and the rest of its depth in `on_established` pins,
/// for a connection not yet up (idle, half open), only what its reservation in the pool covers
/// (its first three receives and one send: [`PoolConfig`](crate::PoolConfig)'s memory
/// guarantee), and borrows the rest once the connection is up; the async face and the `echo`
/// example do so. An allocation the pool cannot give the connection now fails with
/// [`Error::OverBudget`](crate::Error::OverBudget): post that receive later (a timer), which
/// shrinks the peer's credit meanwhile. On a shared receive queue
/// ([`Config::srq`](crate::Config::srq)) the runtime posts the receives and grants the credit.
///
/// **Receive sizes.** Each side announces a message size in its connect information, and that
/// is the size of the receives it must post: [`Conn::msg_size`] (a client's
/// [`ConnectOptions::msg_size`](crate::ConnectOptions::msg_size), or
/// [`Config::msg_size`](crate::Config::msg_size) when that is 0; an accepted connection's, the
/// smaller of its client's `msg_size` and `Config::msg_size`, so a client's claim never raises
/// what a server pins). The peer's sends above it are refused at its submit
/// ([`Error::TooLarge`](crate::Error::TooLarge), naming both sizes), and so are this side's
/// sends above either side's size. A receive posted smaller than the announced size fails the
/// connection when a message that fills it comes.
pub trait ConnectionHandler {
    /// The queue pair exists and the connection is about to be accepted or connected: post the
    /// first receives here (of [`Conn::msg_size`] bytes), so the peer's first message finds one.
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        let _ = conn;
    }

    /// The connection is established; data may flow.
    fn on_established(&mut self, conn: &mut Conn<'_>) {
        let _ = conn;
    }

    /// An operation completed (successfully, in error, flushed by a close, or cancelled).
    fn on_completion(&mut self, conn: &mut Conn<'_>, completion: Completion);

    /// A timer set with [`Ctx::set_timer`] (through [`Conn::ctx`]) fired.
    fn on_timer(&mut self, conn: &mut Conn<'_>, user_data: u64) {
        let _ = (conn, user_data);
    }

    /// A client with a reconnect policy ([`ConnectOptions::reconnect`](crate::ConnectOptions::reconnect))
    /// lost its connection, or an attempt to make it again failed, for `reason`: attempt
    /// `attempt` of the series starts after `delay`. Called instead of `on_closed` while the
    /// policy allows another attempt (see [`Reconnect`](crate::Reconnect) for which failures
    /// and how many).
    ///
    /// What a reconnection keeps, and what it does not:
    /// - **The token and the handler stay**, and so do this connection's user timers and
    ///   counters ([`Conn::metrics`]).
    /// - **Operations not yet posted** (waiting for credits, send slots or CQ room) **wait** and
    ///   are posted on the new connection, in their order: SENDs and receives. Operations
    ///   submitted while it reconnects wait with them.
    /// - **Operations on the device at the failure complete with their error** right after
    ///   this call (flushed, or [`OpError::Unconfirmed`](crate::OpError::Unconfirmed)): the
    ///   runtime cannot know whether the peer processed a SEND; retrying it is the handler's
    ///   decision (submitting it again here queues it for the new connection).
    /// - **A SEND that completed successfully is not known to have been processed either**:
    ///   on RoCE its completion says the peer's device acknowledged it (the peer's process may
    ///   still die before reading it), on iWARP only that the local device handed it to TCP
    ///   (a link outage lost such messages in the two-VM test). An application that must not
    ///   lose messages acknowledges them end to end (as `blast client --reconnect` does).
    /// - **One-sided operations** (WRITE, READ and WRITE with immediate data) not yet posted
    ///   complete with [`OpError::Cancelled`](crate::OpError::Cancelled), and new ones are refused
    ///   until the new connection is established: they name the old peer's remote keys,
    ///   which are invalid on a new connection. So are this side's exposures
    ///   ([`Conn::expose`], [`Conn::expose_region`]): their windows are released with the old
    ///   queue pair; expose again and send the new keys after [`on_reconnected`](Self::on_reconnected).
    /// - The new queue pair gets [`on_ready`](Self::on_ready) again (post its first receives
    ///   there), then `on_reconnected`.
    fn on_reconnecting(&mut self, conn: &mut Conn<'_>, reason: &CloseReason, attempt: u32, delay: Duration) {
        let _ = (conn, reason, attempt, delay);
    }

    /// A client's connection was made again after [`on_reconnecting`](Self::on_reconnecting):
    /// data may flow, and the operations that waited are posted. Called instead of
    /// `on_established`; the default calls [`on_established`](Self::on_established).
    fn on_reconnected(&mut self, conn: &mut Conn<'_>) {
        self.on_established(conn);
    }

    /// The connection is over and its resources are destroyed.
    fn on_closed(&mut self, ctx: &mut Ctx<'_>, token: Token, reason: CloseReason) {
        let _ = (ctx, token, reason);
    }
}
