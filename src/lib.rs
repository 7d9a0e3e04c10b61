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

/// The async face: connections, listeners and operations as futures, on the reactor's own
/// thread ([`Reactor::block_on`], [`Reactor::spawn`], or the tokio driver with the `tokio`
/// feature). A thin layer over the callback API, with the same tick: what the tasks polled in
/// a tick submit is posted at its end, one chain per queue pair.
///
/// The same echo server as the crate's example, with a task per connection (the README's
/// "The same with async/await" has the rules):
///
/// ```no_run
/// use rdma_reactor::io::{self, Listener};
/// use rdma_reactor::Reactor;
///
/// fn main() -> rdma_reactor::Result<()> {
///     let mut reactor = Reactor::new()?;
///     let addr = "198.18.0.1:7471".parse().unwrap();
///     reactor.block_on(async move {
///         let listener = Listener::bind(addr)?;
///         while let Ok(conn) = listener.accept().await {
///             // Established, its receives posted. One task per connection: the next message,
///             // in the buffer it arrived in, sent back as it is; the send gives the buffer back
///             // with its result.
///             let _task = io::spawn(async move {
///                 while let Ok(msg) = conn.recv().await {
///                     let (sent, _buf) = conn.send(msg).await;
///                     if sent.is_err() {
///                         break;
///                     }
///                 }
///             })?;
///         }
///         Ok(())
///     })?
/// }
/// ```
pub mod io {
    pub use crate::reactor::aio::{Accept, Close, Connect, Connection, Listener, OpFuture, Recv};
    pub use crate::reactor::exec::{spawn, stats, JoinHandle};

    /// The tokio driver (feature `tokio`): [`drive`](tokio::drive) runs a reactor inside a
    /// tokio task, so RDMA futures and tokio's own are awaited in the same task.
    #[cfg(feature = "tokio")]
    pub mod tokio {
        pub use crate::reactor::tokio_drive::{drive, Drive};
    }
}
pub use sys::pool::{Buf, Exposed, PoolConfig, RegionWindow};
pub use sys::region::{Region, RegionSlice};

/// The FFI layer is private: nothing outside this crate can reach an rdma-core object.
///
/// ```compile_fail
/// use rdma_reactor::sys::cm::EventChannel;
/// ```
#[cfg(doctest)]
pub struct SysIsPrivate;
