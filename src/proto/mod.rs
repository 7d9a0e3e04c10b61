//! The pure core: everything that decides, nothing that does I/O.
//!
//! Tokens ([`token`]), the wire formats carried in private data and messages ([`wire`]),
//! receive-credit flow control ([`flow`]), what differs between transports ([`transport`]), the listener/agent/client state machines ([`conn`])
//! the data path's plain vocabulary ([`op`]: operation kinds, completion statuses) and the
//! per-connection counters with their Prometheus text ([`metrics`]) and a reconnecting client's
//! policy and backoff ([`reconnect`]), and the addresses a listener refuses for a while after
//! their connections broke the protocol ([`penalty`]).
//!
//! **Architecture invariant:** nothing here names `crate::sys`, `crate::reactor` or an FFI
//! type, performs I/O or can fail with an OS error; all of it is unit-tested on a host without
//! RDMA. `.ci/layers` checks the imports.

use std::time::Duration;

/// The longest duration setting the runtime takes (a [`Timeouts`](crate::Timeouts) step, the
/// spin time, the keepalive interval, the credit-stall bound, a reconnect policy's waits and
/// deadline): 365 days. Longer ones are refused with `Error::Config` naming the setting
/// (`Config::validate`, `Reconnect::check`), so that every deadline the reactor sets, the time
/// now plus such a setting, is an `Instant` it can represent: an unrepresentable one panics
/// (`Instant + Duration`) or, checked, would be no deadline at all.
pub(crate) const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// `MAX_DURATION` for an error message.
pub(crate) const MAX_DURATION_TEXT: &str = "365 days";

pub(crate) mod conn;
pub(crate) mod flow;
#[cfg(any(test, feature = "fuzz-internals"))]
pub(crate) mod fuzz;
pub(crate) mod metrics;
pub(crate) mod op;
pub(crate) mod penalty;
pub(crate) mod reconnect;
pub(crate) mod token;
pub(crate) mod transport;
pub(crate) mod wire;
