//! rdma-reactor: a single-threaded, callback-driven RDMA event loop.
#![deny(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, rust_2018_idioms)]
#![warn(clippy::undocumented_unsafe_blocks, clippy::missing_safety_doc, unsafe_op_in_unsafe_fn)]

pub mod conn;
pub mod error;
pub mod op;
pub mod sys;
pub mod token;
pub mod wire;

pub use error::{Error, Result};
