//! rdma-reactor: a single-threaded, callback-driven RDMA event loop.
//!
//! One thread epolls the non-blocking rdma_cm event channel and the verbs completion channels,
//! and dispatches every event to the state machine it belongs to (a listener, the agent of an
//! accepted connection, or a client), which reacts through your callbacks
//! ([`ListenerHandler`], [`ConnectionHandler`]). The data path works like io_uring: operations
//! ([`Op`]) are submitted with a `u64` user_data and complete later ([`Completion`]) with that
//! user_data, a result and the pool buffer handed back.
//!
//! ```no_run
//! use rdma_reactor::{
//!     Completion, ConnectRequest, ConnectionHandler, Conn, Ctx, Decision, ListenerHandler, Op, OpCode,
//!     Reactor,
//! };
//!
//! /// Accepts every client; each connection gets an `Echo` agent.
//! struct Server;
//!
//! impl ListenerHandler for Server {
//!     fn on_connect_request(&mut self, _ctx: &mut Ctx<'_>, _req: &ConnectRequest) -> Decision {
//!         Decision::Accept(Box::new(Echo))
//!     }
//! }
//!
//! /// Sends every message back.
//! struct Echo;
//!
//! impl ConnectionHandler for Echo {
//!     fn on_ready(&mut self, conn: &mut Conn<'_>) {
//!         // Post receives before the connection is accepted, so the first message finds one.
//!         for _ in 0..16 {
//!             let buf = conn.alloc(4096).expect("pool buffer");
//!             conn.submit(Op::recv(buf)).expect("post receive");
//!         }
//!     }
//!
//!     fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
//!         if let (OpCode::Recv, Ok(_)) = (c.opcode, c.result) {
//!             // The buffer comes back with the message in it: send it back as it is,
//!             // and post a fresh receive. Both go out at the end of this tick, chained.
//!             let _ = conn.submit(Op::send(c.buf.expect("receive buffer")).user_data(1));
//!             if let Ok(buf) = conn.alloc(4096) {
//!                 let _ = conn.submit(Op::recv(buf));
//!             }
//!         }
//!     }
//! }
//!
//! fn main() -> rdma_reactor::Result<()> {
//!     let mut reactor = Reactor::new()?;
//!     reactor.listen("198.18.0.1:7471".parse().unwrap(), Server)?;
//!     reactor.run() // One thread serves every connection.
//! }
//! ```
//!
//! See `ARCHITECTURE.md` for the design: the layers, the tick, the CQ protocol and the teardown
//! order.
#![deny(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, rust_2018_idioms)]
#![warn(clippy::undocumented_unsafe_blocks, clippy::missing_safety_doc, unsafe_op_in_unsafe_fn)]

#[cfg(feature = "bench-internals")]
#[doc(hidden)]
pub mod bench_internals;
mod error;
#[cfg(feature = "fuzz-internals")]
#[doc(hidden)]
pub mod fuzz_internals;
pub mod io;
mod proto;
mod reactor;
mod sys;

pub use error::{Error, Result};
pub use proto::conn::{AsyncEventKind, CloseReason, State, Step};
pub use proto::metrics::ConnMetrics;
pub use proto::op::{OpCode, OpError, RemoteAccess, WcStatus};
pub use proto::reconnect::Reconnect;
pub use proto::token::Token;
pub use proto::transport::Transport;
pub use proto::wire::{ConnectInfo, RejectCode, RejectReason, RemoteSlice, WireError};
pub use reactor::{
    Balance, Completion, Config, Conn, ConnectOptions, ConnectRequest, ConnectionHandler, Ctx, Decision, FdEvent,
    FdHandler, Interest, ListenerHandler, Op, RawBuf, Reactor, ReactorGone, Readiness, Remote, SrqConfig, Stats,
    SubmitError, Timeouts,
};
pub use sys::device::{devices, DeviceInfo, LinkLayer, PortInfo, PortState};

pub use sys::pool::{Buf, Exposed, PoolConfig, RegionWindow};
pub use sys::region::{Region, RegionSlice};

/// The FFI layer is private: nothing outside this crate can reach an rdma-core object.
///
/// ```compile_fail
/// use rdma_reactor::sys::cm::EventChannel;
/// ```
#[cfg(doctest)]
pub struct SysIsPrivate;
