//! The async face: connections, listeners and operations as futures, on the reactor's own
//! thread ([`Reactor::block_on`](crate::Reactor::block_on), [`Reactor::spawn`](crate::Reactor::spawn), or the tokio driver with the `tokio`
//! feature). A thin layer over the callback API, with the same tick: what the tasks polled in
//! a tick submit is posted at its end, one chain per queue pair.
//!
//! The same echo server as the crate's example, with a task per connection (the README's
//! "The same with async/await" has the rules):
//!
//! ```no_run
//! use rdma_reactor::io::{self, Listener};
//! use rdma_reactor::Reactor;
//!
//! fn main() -> rdma_reactor::Result<()> {
//!     let mut reactor = Reactor::new()?;
//!     let addr = "198.18.0.1:7471".parse().unwrap();
//!     reactor.block_on(async move {
//!         let listener = Listener::bind(addr)?;
//!         while let Ok(conn) = listener.accept().await {
//!             // Established, its receives posted. One task per connection: the next message,
//!             // in the buffer it arrived in, sent back as it is; the send gives the buffer back
//!             // with its result.
//!             let _task = io::spawn(async move {
//!                 while let Ok(msg) = conn.recv().await {
//!                     let (sent, _buf) = conn.send(msg).await;
//!                     if sent.is_err() {
//!                         break;
//!                     }
//!                 }
//!             })?;
//!         }
//!         Ok(())
//!     })?
//! }
//! ```
//!
//! # Time
//!
//! [`sleep`] and [`timeout`] run on the reactor's own timers, so a program without another
//! runtime can bound a `recv`. Under the tokio driver (`io::tokio::drive`) tokio's timers work
//! too, inside the crate's tasks as well as outside them: the tasks are polled within the
//! driver's poll, on tokio's thread, and a tokio timer's wake reaches the reactor like any
//! other wake.
//!
//! # The layer
//!
//! The async face is a layer of its own above the reactor (`ARCHITECTURE.md`, "Layers"): it
//! names the callback API ([`ConnectionHandler`](crate::ConnectionHandler),
//! [`Ctx`](crate::Ctx), [`Conn`](crate::Conn)) and reaches the reactor polling it only through
//! `reactor::with_ctx` (for what belongs to no reactor yet: a connect, a bind, a spawn) and
//! `reactor::with_ctx_of` (for a handle: only its own reactor, whose id it keeps, since
//! another reactor on the thread has objects of the same tokens); the reactor never names it
//! (`.ci/layers`). The executor that polls its futures is the reactor's own
//! (`reactor/event_loop/exec.rs`: a step of the tick).
//!
//! - `connection.rs`: [`Connection`], its handler and its futures ([`Connect`], [`OpFuture`],
//!   [`Recv`], [`Close`]).
//! - `line.rs`: the order `Connection::recv` keeps (pure, unit-tested).
//! - `message.rs`: [`Message`], what consumed a receive with its kind (a SEND, or the peer's
//!   RDMA WRITE with immediate data), and [`RecvMessage`], `Connection::recv_message`'s future.
//! - `listener.rs`: [`Listener`] and [`Accept`].
//! - `stream.rs` (feature `tokio`): `Stream`, a connection as a byte stream (tokio's
//!   `AsyncRead` and `AsyncWrite`), over `Connection`'s send and recv; its owned halves
//!   (`Stream::into_split`) in `stream/split.rs`, its lingering close in `stream/linger.rs`.
//! - `time.rs`: [`sleep`], [`sleep_until`] and [`timeout`], on the reactor's own timers.
//! - `tokio.rs` (feature `tokio`): the tokio driver.

mod connection;
mod line;
mod listener;
mod message;
#[cfg(feature = "tokio")]
mod stream;
mod time;
#[cfg(feature = "tokio")]
pub mod tokio;

pub use crate::reactor::{spawn, stats, JoinHandle};
pub use connection::{Close, Connect, Connection, OpFuture, Recv};
pub use listener::{Accept, Listener};
pub use message::{Message, RecvMessage};
#[cfg(feature = "tokio")]
pub use stream::{kind_of_close, OwnedReadHalf, OwnedWriteHalf, ReuniteError, Stream};
pub use time::{sleep, sleep_until, timeout, Sleep, Timeout};
