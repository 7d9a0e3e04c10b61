//! `ConnectInfo::decode` (against a second decoder written from the format table), its round
//! trips, `negotiate`, `RejectReason` and `RemoteSlice` on arbitrary bytes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| rdma_reactor::fuzz_internals::connect_info(data));
