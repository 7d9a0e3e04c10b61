//! Arbitrary input sequences into the client, the agent and the listener, checked against the
//! independent specification of the machines and their life-long invariants.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| rdma_reactor::fuzz_internals::state_machines(data));
