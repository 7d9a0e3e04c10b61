//! The callback API: what user code sees of the reactor and how it is called.
//!
//! - `handler.rs`: the traits user code implements ([`ListenerHandler`](crate::ListenerHandler),
//!   [`ConnectionHandler`](crate::ConnectionHandler)), [`Decision`](crate::Decision) and
//!   [`ConnectRequest`](crate::ConnectRequest).
//! - `ctx.rs`: the contexts handed to them ([`Ctx`](crate::Ctx), [`Conn`](crate::Conn)):
//!   command buffers over the reactor's objects; nothing called through one destroys anything
//!   at once (closed objects are destroyed at the end of the tick, after its events are acked).
//! - `config.rs`: [`Config`](crate::Config), [`ConnectOptions`](crate::ConnectOptions),
//!   [`SrqConfig`](crate::SrqConfig), [`Timeouts`](crate::Timeouts), and their validation.
//! - `stats.rs`: [`Stats`](crate::Stats), per-connection counters and the Prometheus text.
//!
//! Invariant owned here: a handler is called only with a context whose `Core` borrow ends
//! with the call (no context outlives its callback).

pub(super) mod config;
pub(super) mod ctx;
#[cfg(feature = "fault-injection")]
pub(super) mod faults;
pub(super) mod guard;
pub(super) mod handler;
pub(super) mod stats;
