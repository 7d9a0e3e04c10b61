//! Two peers under receive-credit flow control with arbitrary depths, kept receives and
//! schedules: no message without a receive, credits conserved, no deadlock.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| rdma_reactor::fuzz_internals::flow(data));
