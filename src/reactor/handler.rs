//! The callback API: one trait for listeners, one for connections (agents and clients).
//!
//! Callbacks receive a context ([`Ctx`] or [`Conn`]) over the reactor, never the reactor
//! itself: closing a connection, posting or connecting from inside a callback is safe; posts
//! go out and closed objects are destroyed at the end of the tick.

use std::net::SocketAddr;

use super::{Completion, Conn, Ctx};
use crate::proto::conn::CloseReason;
use crate::proto::token::Token;
use crate::proto::wire::{ConnectInfo, RejectReason};

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
    /// (`max_connections`, `max_pending_accepts`), or no resources for an accepted one.
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
/// dropped.
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
/// peer (back-pressure), it never deadlocks. On a shared receive queue
/// ([`Config::srq`](crate::Config::srq)) the runtime posts the receives and grants the credit.
pub trait ConnectionHandler {
    /// The queue pair exists and the connection is about to be accepted or connected: post the
    /// first receives here, so the peer's first message finds one.
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

    /// The connection is over and its resources are destroyed.
    fn on_closed(&mut self, ctx: &mut Ctx<'_>, token: Token, reason: CloseReason) {
        let _ = (ctx, token, reason);
    }
}
