//! The loop: what wakes the reactor and what runs in its tick besides connections' events.
//!
//! - `timers.rs`: deadlines, user timers and the coarse clock (`Timers`, `TimerTarget`).
//! - `userfd.rs`: application fds in the reactor's epoll set ([`FdHandler`](crate::FdHandler)).
//! - `remote.rs`: the cross-thread handle ([`Remote`](crate::Remote)): an eventfd and an inbox.
//! - `embed.rs`: the epoll fd and `next_timeout`, for an outer event loop.
//! - `device.rs`: devices and their resources (PD, pool, completion channel, SRQ), their
//!   asynchronous events, and a lost device's release.
//! - `exec.rs`: the reactor's executor (step 5b of the tick): tasks, `block_on`, and the only
//!   way the async face (`crate::io`) reaches the reactor (`with_ctx`).
//!
//! Invariants owned here: the reactor sleeps in `epoll_wait` only when nothing is pending (no
//! hot CQ, queued post, woken task or closing object); a device's resources are released only
//! once nothing uses them; nothing reaches `Core` from a future except through `with_core`,
//! which a nested call finds empty.

pub(super) mod device;
pub(super) mod embed;
pub(super) mod exec;
pub(super) mod remote;
pub(super) mod tick;
pub(super) mod timers;
pub(super) mod userfd;
