//! The data path: operations from `submit` to their completion.
//!
//! - `op.rs`: [`Op`](crate::Op), [`Completion`](crate::Completion) and the reactor's record of
//!   an operation in flight (`OpEntry`, under an `OpKey` token carried as the work request id).
//! - `send_queue/` (pure; unit tests in `send_queue/tests.rs`): what a connection's send queue
//!   posts at the end of a tick, in which order and under which credits (`SendQueue`), and the
//!   farewell of the close handshake. `RecvQueue`, the receives' planner before issue 47 phase
//!   2, is kept for the host benchmark's `SlabPath` and the tests only.
//! - `post.rs`: checking a submission, building the work requests and the FFI post, one chain
//!   per queue pair and direction; keepalive probes and the credit-stall timer.
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
//!   (planning, work requests built in place, completions from the slot). Since phase 2, step 2
//!   the reactor's receives live on the receive lane (`ConnEntry::lanes`: submitted, posted,
//!   completed through `Lanes::recv_completed_with`, the lanes' one set of receive rules,
//!   cancelled or carried at teardown); its sends are still `SendQueue`'s and the operation
//!   slab's until step 3, and the gate is unused until step 4 (DATAPATH.md). The host
//!   benchmark (`bench_internals::Path`) runs all of it.
//!
//! Invariants owned here: a CQ's completions never exceed its entries (`CqRoom`); a completion
//! that raced an arm is never stranded (poll after arming); a credit is never granted ahead of
//! the receive it stands for (the SRQ refill and the receives are posted before the sends);
//! the device holds a buffer only through what returns it in the completion: a send-queue
//! operation's `OpEntry`, a receive's slot on its connection's receive lane (never dropped
//! while posted: handed out taken, cleared or carried, and never renamed while outstanding,
//! `Lanes::set_id`), or a shared receive queue's slot table.

pub(super) mod append;
pub(super) mod cq;
pub(super) mod cq_room;
pub(super) mod expose;
pub(crate) mod gate;
pub(crate) mod lanes;
pub(super) mod op;
pub(super) mod post;
pub(crate) mod ring;
pub(super) mod send_queue;
pub(super) mod srq;
pub(super) mod tail;
