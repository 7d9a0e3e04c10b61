//! rdma-reactor: a single-threaded, callback-driven RDMA event loop.
#![deny(unsafe_code)]

pub mod sys;
