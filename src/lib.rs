//! rdma-reactor: a single-threaded, callback-driven RDMA event loop.
#![deny(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, rust_2018_idioms)]
#![warn(clippy::undocumented_unsafe_blocks, clippy::missing_safety_doc, unsafe_op_in_unsafe_fn)]

pub mod conn;
pub mod error;
pub mod flow;
pub mod handler;
pub mod op;
pub mod reactor;
pub mod sys;
pub mod token;
pub mod wire;

pub use conn::CloseReason;
pub use error::{Error, Result};
pub use handler::{ConnectRequest, ConnectionHandler, Decision, ListenerHandler};
pub use op::{Completion, Op, OpCode, OpError, RawBuf, RemoteAccess, RemoteSlice, WcStatus};
pub use reactor::{Config, Conn, ConnectOptions, Ctx, Reactor, Stats, SubmitError, Timeouts};
pub use sys::device::{devices, DeviceInfo, LinkLayer, PortInfo, PortState};
pub use sys::pool::{Buf, Exposed, PoolConfig};
pub use token::Token;
pub use wire::{ConnectInfo, RejectCode, RejectReason};
