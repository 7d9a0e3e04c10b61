//! Connection lifecycle: from a connect request or a `connect` call to the last destroy.
//!
//! - `setup.rs`: the rdma_cm event dispatch (each event to its object's state machine, acked
//!   before the next is read), listening, accepting and refusing, connecting, and making a
//!   connection's queue pair on its device (its CQ, receives, tail ring).
//! - `connect.rs`: a client's `rdma_connect`, made on a helper thread on iWARP, where the call
//!   blocks for the TCP handshake (why and what it takes: its module docs).
//! - `drive.rs`: feeding a connection's state machine (`proto::conn`) and carrying out the
//!   actions it returns.
//! - `teardown.rs`: close, drain, destroy, cancelling what never reached the device, and the
//!   reactor's shutdown.
//! - `handoff.rs`: spreading a listener's connect requests over reactors ([`Balance`]).
//! - `reconnect.rs`: a client that reconnects ([`Reconnect`]): its token, handler and queued
//!   work carried from one queue pair to the next.
//! - `waiting.rs`: connect requests beyond `Config::max_pending_accepts`, which wait for room
//!   instead of being refused.
//! - `penalty.rs`: the penalty box (`Config::violation_backoff`): an address whose accepted
//!   connection broke the protocol is refused for a while.
//!
//! Invariants owned here: a CM event is acked before its object is destroyed (destruction waits
//! for the end of the tick, `reap`); a connection's kernel objects are freed in field order
//! (windows, queue pair, id, tail ring: `ConnEntry`); every operation submitted on a connection
//! completes exactly once, flushed by the device or cancelled before it reached it.
//!
//! [`Balance`]: crate::Balance
//! [`Reconnect`]: crate::Reconnect

pub(super) mod connect;
pub(super) mod drive;
pub(super) mod entry;
pub(super) mod handoff;
pub(super) mod penalty;
pub(super) mod reconnect;
pub(super) mod setup;
pub(super) mod teardown;
pub(super) mod waiting;
