//! Hidden and unstable, behind the `fuzz-internals` feature: the pure core's fuzz harnesses,
//! for the coverage-guided targets of the `fuzz/` crate (`cargo xtask fuzz`). Not part of the
//! API.
//!
//! Each function drives one part of the pure core with arbitrary bytes and panics when an
//! oracle disagrees; the harnesses and their oracles are in `src/proto/fuzz.rs`.

/// The connect information, the reject reason and `RemoteSlice`, decoded from and encoded to
/// `data`.
pub fn connect_info(data: &[u8]) {
    crate::proto::fuzz::connect_info(data);
}

/// A sequence of arbitrary inputs fed to a client, an agent and a listener, checked against the
/// independent specification of the machines.
pub fn state_machines(data: &[u8]) {
    crate::proto::fuzz::state_machines(data);
}

/// Two peers under receive-credit flow control, scheduled by `data`.
pub fn flow(data: &[u8]) {
    crate::proto::fuzz::flow(data);
}
