//! The FFI boundary: the only module that names `rdma_sys`.
#![allow(unsafe_code)]

pub use rdma_sys as ffi;
