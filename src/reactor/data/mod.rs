//! The data path: operations from `submit` to their completion.
//!
//! - `op.rs`: [`Op`](crate::Op), [`Completion`](crate::Completion); the operation slab's
//!   record of an operation (`OpEntry`) is compiled for the host benchmark's baseline only.
//! - `send_queue/` (pure; unit tests in `send_queue/tests.rs`): the planners before issue 47's
//!   lanes (`SendQueue`, `RecvQueue`), kept as the lanes' differential test's oracle and the
//!   host benchmark's `SlabPath` only (compiled for tests and `bench-internals`).
//! - `post.rs`: checking a submission, the FFI post of the runs the lanes planned, one chain
//!   per queue pair and direction; keepalive probes, nudges and the credit-stall timer.
//! - `cq/mod.rs`: the CQ protocol (drain the channel, poll under a budget, arm then poll again,
//!   acks in batches) and delivering completions to handlers.
//! - `cq_room.rs` (pure): room on each CQ, so a CQ never holds more completions than it has
//!   entries.
//! - `srq/mod.rs`: the shared receive queues and the SRQ credit rule (`SrqBudget`, pure).
//! - `tail.rs`: the tail rings that carry immediate data where the transport has none (iWARP).
//! - `expose.rs`: memory windows bound to a connection (`Conn::expose`).
//! - `append.rs`: bytes appended to a SEND submitted and not yet posted (the byte stream's
//!   coalesced writes, `Conn::append_send`).
//! - `ring.rs`, `gate.rs`, `lanes.rs` (issue 47): per-queue-pair operation rings addressed by
//!   `wr_id`, a connection's submission gate, and its send and receive lanes on the rings
//!   (planning, work requests built in place, completions from the slot). Since phase 2, steps
//!   2 and 3, every operation of the reactor's but a shared receive queue's receives lives on
//!   its connection's lanes (`ConnEntry::lanes`: submitted, planned and posted, completed
//!   through `Lanes::recv_completed` or `Lanes::next_sent`, cancelled or carried at teardown);
//!   since step 4 `Core::submit` checks against the connection's gate (DATAPATH.md). The host benchmark
//!   (`bench_internals::Path`) runs all of it.
//!
//! Invariants owned here: a CQ's completions never exceed its entries (`CqRoom`); a completion
//! that raced an arm is never stranded (poll after arming); a credit is never granted ahead of
//! the receive it stands for (the SRQ refill and the receives are posted before the sends);
//! the device holds a buffer only through what returns it in the completion: an operation's
//! slot on its connection's lanes (never dropped while posted: handed out taken, popped,
//! cleared or carried, and never renamed while outstanding, `Lanes::set_id`), or a shared
//! receive queue's slot table.

pub(super) mod append;
pub(super) mod cq;
pub(super) mod cq_room;
pub(super) mod expose;
pub(crate) mod gate;
pub(crate) mod lanes;
pub(super) mod op;
pub(super) mod post;
pub(crate) mod ring;
// The send queue's planner before issue 47's lanes: the lanes' differential test keeps it as its
// oracle, and the host benchmark's `SlabPath` as its baseline.
#[cfg(any(test, feature = "bench-internals"))]
pub(super) mod send_queue;
pub(super) mod srq;
pub(super) mod tail;
