//! A connection's send queue, pure: what may be posted now, given the queue pair's slots, the
//! CQ's room and the peer's credits. No FFI. **The reactor no longer uses it**: its sends and
//! receives are on the connection's lanes since issue 47 phase 2 (`data/lanes.rs`, whose
//! `SendCtl` planning is this file's rules ported). It is compiled for the lanes' differential
//! test, which checks every plan against it (its oracle), and for the host benchmark's slab
//! path (`bench_internals::SlabPath`, the baseline the ring path is counted against); with
//! `RecvQueue`, the receive queue's planner, for the same two.
//!
//! A send-queue operation leaves [`SendQueue`]'s pending queue only when:
//! - the send queue has a slot;
//! - its CQ has room for its completion ([`CqRoom`]);
//! - for an operation that consumes a peer receive under flow control, the peer granted a
//!   credit ([`Flow`]).
//!
//! The queue is strictly FIFO: an operation waiting for credit holds back the ones behind it,
//! so operations reach the peer in submission order. When credits are owed and no data message
//! carries them, the plan adds a credit-only message ([`Flow::wants_control`]).
//!
//! **The close handshake** (iWARP under flow control, `proto::flow::Farewell`): once the
//! connection asks to say goodbye ([`SendQueue::say_farewell`]), no data goes any more; the
//! farewell goes as soon as a credit allows (on the connecting side, a credit that leaves an
//! answer possible: [`SendQueue::yield_last_credit`]), after everything posted before it. Credit-only
//! messages still go when due: a peer that spent its last credit needs our grant to answer. The answer to the peer's farewell ([`SendQueue::answer_farewell`])
//! goes after the data planned with it.
//!
//! Signaling is selective: one work request in `signal_every` asks for a completion, and so
//! does the last of each chain. A signaled completion means the unsignaled requests before it
//! are complete too (RC completes in order); [`SendQueue::complete`] hands them back in order
//! and frees their CQ entries with its own.

// The oracle and the baseline keep the whole of the old planner, some of which neither calls.
#![allow(dead_code)]

use std::collections::VecDeque;

use crate::proto::flow::{Farewell, Flow, Imm};
use crate::proto::token::OpKey;
use crate::reactor::data::cq_room::CqRoom;

/// Moves the first `n` keys of `from` (all of them if fewer) to the end of `out`, in order.
/// One `pop_front` each: the usual `n` is 1, where `extend(drain(..n))` went through the
/// generic extend (about 70 instructions a call, issue 33).
#[inline]
fn move_front(from: &mut VecDeque<OpKey>, n: usize, out: &mut Vec<OpKey>) {
    debug_assert!(n <= from.len(), "moving {n} of {} keys", from.len());
    out.reserve(n.min(from.len()));
    for _ in 0..n {
        match from.pop_front() {
            Some(k) => out.push(k),
            None => break,
        }
    }
}

/// Appends `keys` to `to`, in order: one `push_back` each. The usual chain is one or two
/// requests, where the generic extend of a `VecDeque` cost more than the pushes (issue 33).
#[inline]
fn push_keys(to: &mut VecDeque<OpKey>, keys: impl ExactSizeIterator<Item = OpKey>) {
    to.reserve(keys.len());
    for k in keys {
        to.push_back(k);
    }
}

/// One send work request the plan says to post now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Planned {
    /// The operation (for a credit-only message, the one the plan's caller made for it).
    pub(crate) op: OpKey,
    /// Immediate data (host order) under flow control: the credits it grants.
    pub(crate) imm: Option<u32>,
    /// Asks for a completion.
    pub(crate) signaled: bool,
}

/// What may be posted on one connection's send queue now.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    /// The chain to post, in order.
    pub(crate) wrs: Vec<Planned>,
    /// Something could not go for lack of CQ room: the connection waits for room.
    pub(crate) short_of_room: bool,
}

/// The send side of one connection: pending operations, posted ones, signaling and credits.
#[derive(Debug)]
pub(crate) struct SendQueue {
    /// Submitted, not yet posted, in submission order, with "consumes a peer receive" and its
    /// bytes.
    pending: VecDeque<(OpKey, bool, u32)>,
    /// The bytes of `pending` (`Config::send_backlog_bytes`).
    pending_bytes: usize,
    /// Posted and not yet completed, in posting order.
    posted: VecDeque<OpKey>,
    /// Unsignaled requests posted since the last signaled one.
    unsignaled: u32,
    /// The last requests of `posted` that may never be reported: unsignaled, and the signaled
    /// request after them was refused by the device (see [`SendQueue::posted`]).
    unreported: u32,
    /// Send work requests the queue pair holds.
    capacity: u32,
    signal_every: u32,
    /// Credit state, when both sides use flow control.
    flow: Option<Flow>,
    /// Nothing may go yet: an iWARP agent waits for its client's first message
    /// (`proto::transport`).
    hold: bool,
    /// A credit-only message goes first: an iWARP client speaks first.
    hello: bool,
    /// A zero-length RDMA WRITE that goes next, ahead of the pending operations and needing no
    /// credit: an iWARP client's nudge ([`SendQueue::nudge`]).
    nudge: Option<OpKey>,
    /// Both sides take part in the close handshake (negotiated at connect time).
    farewell: bool,
    /// Our farewell: not asked for, waiting for a credit, or sent.
    leaving: Leaving,
    /// The peer's farewell arrived and our answer has not gone yet.
    answer_due: bool,
    /// Our farewell takes the last credit only with a grant ([`SendQueue::yield_last_credit`]).
    yields: bool,
}

/// Where our farewell stands ([`SendQueue::say_farewell`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Leaving {
    No,
    Due,
    Sent,
}

impl SendQueue {
    /// An empty queue; `capacity` is set when the queue pair exists.
    pub(crate) fn new(signal_every: u32) -> SendQueue {
        SendQueue {
            pending: VecDeque::new(),
            pending_bytes: 0,
            posted: VecDeque::new(),
            unsignaled: 0,
            unreported: 0,
            capacity: 0,
            signal_every: signal_every.max(1),
            flow: None,
            hold: false,
            hello: false,
            nudge: None,
            farewell: false,
            leaving: Leaving::No,
            answer_due: false,
            yields: false,
        }
    }

    /// Turns the close handshake on (both sides agreed, under flow control).
    pub(crate) fn set_farewell(&mut self, on: bool) {
        self.farewell = on && self.flow.is_some();
    }

    /// True when the connection closes with the close handshake.
    pub(crate) fn farewell(&self) -> bool {
        self.farewell
    }

    /// Asks for our farewell: it goes after everything posted so far, as soon as a credit
    /// allows, and no data goes after it (operations still pending stay unposted); credit-only
    /// messages still do.
    pub(crate) fn say_farewell(&mut self) {
        if self.farewell && self.leaving == Leaving::No {
            self.leaving = Leaving::Due;
        }
    }

    /// Makes our farewell yield the last credit (the connecting side's rule, `proto::flow`'s
    /// module docs): it goes on the last credit only when it grants the peer a receive, so two
    /// farewells crossing never leave both sides without a credit to answer with.
    pub(crate) fn yield_last_credit(&mut self) {
        self.yields = true;
    }

    /// The peer's farewell arrived: answer it (once).
    pub(crate) fn answer_farewell(&mut self) {
        self.answer_due |= self.farewell;
    }

    /// Sets the send work requests the queue pair holds.
    pub(crate) fn set_capacity(&mut self, capacity: u32) {
        self.capacity = capacity;
    }

    /// The send work requests the queue pair holds.
    pub(crate) fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Turns flow control on with this credit state.
    pub(crate) fn set_flow(&mut self, flow: Option<Flow>) {
        self.flow = flow;
    }

    /// Holds every send back until [`SendQueue::release`] (an agent on iWARP before its
    /// client's first message).
    pub(crate) fn set_hold(&mut self, hold: bool) {
        self.hold = hold;
    }

    /// The peer has spoken: what was held back may go. True when something was held.
    pub(crate) fn release(&mut self) -> bool {
        std::mem::replace(&mut self.hold, false)
    }

    /// Makes the next plan start with a credit-only message (a client on iWARP speaks first).
    pub(crate) fn set_hello(&mut self, hello: bool) {
        self.hello = hello;
    }

    /// Queues `probe`, a zero-length RDMA WRITE, to go at the next plan ahead of the pending
    /// operations: it consumes no peer receive, so no credit holds it back. An iWARP client
    /// sends it when its server has not been heard from after its first message
    /// (`proto::transport`, Soft-iWARP's lost wakeup). False (and `probe` not taken) when one
    /// is queued already.
    pub(crate) fn nudge(&mut self, probe: OpKey) -> bool {
        if self.nudge.is_some() {
            return false;
        }
        self.nudge = Some(probe);
        true
    }

    /// The credit state, when flow control is on.
    pub(crate) fn flow_mut(&mut self) -> Option<&mut Flow> {
        self.flow.as_mut()
    }

    /// Queues an operation of `len` bytes; `consumes` when it uses one of the peer's receives
    /// (a send or a write with immediate).
    pub(crate) fn push(&mut self, op: OpKey, consumes: bool, len: u32) {
        self.pending.push_back((op, consumes, len));
        self.pending_bytes += len as usize;
    }

    /// The last operation queued and not yet posted: the one a byte stream's next write may
    /// still append to (`data/append.rs`).
    pub(crate) fn last_pending(&self) -> Option<OpKey> {
        self.pending.back().map(|&(op, _, _)| op)
    }

    /// The last pending operation grew by `n` bytes (`data/append.rs`): its bytes and the
    /// queue's, which `Config::send_backlog_bytes` bounds, count them.
    pub(crate) fn grow_last(&mut self, n: u32) {
        if let Some(last) = self.pending.back_mut() {
            last.2 = last.2.saturating_add(n);
            self.pending_bytes += n as usize;
        }
    }

    /// Operations queued and not yet posted, and their pool bytes (`Config::send_backlog`).
    pub(crate) fn backlog(&self) -> (u32, usize) {
        (self.pending.len() as u32, self.pending_bytes)
    }

    /// Send work requests the queue pair can take now: queued operations up to this many go
    /// at the next post unless they wait for credits.
    pub(crate) fn free_slots(&self) -> u32 {
        self.capacity.saturating_sub(self.outstanding())
    }

    /// Posted requests not yet completed.
    pub(crate) fn outstanding(&self) -> u32 {
        self.posted.len() as u32
    }

    /// Posted requests whose completion is awaited (what draining waits for): all but the
    /// unsignaled ones a refused post left with no signaled request after them.
    pub(crate) fn awaited(&self) -> u32 {
        self.outstanding() - self.unreported
    }

    /// True when a plan could post something now or later: operations are pending or credits
    /// are owed.
    pub(crate) fn wants_post(&self) -> bool {
        let quiet = self.leaving != Leaving::No;
        !self.hold
            && ((!quiet && !self.pending.is_empty())
                || self.hello
                || self.nudge.is_some()
                || self.leaving == Leaving::Due
                || self.answer_due
                || self.flow.as_ref().is_some_and(Flow::wants_control))
    }

    /// True when the next operation waits for the peer's credits (flow control on, it
    /// consumes a peer receive, and a data message may not go now).
    pub(crate) fn credit_blocked(&self) -> bool {
        let head_consumes = self.pending.front().is_some_and(|&(_, consumes, _)| consumes);
        // Saying goodbye, nothing pending goes any more: nothing waits for credit.
        let quiet = self.leaving != Leaving::No;
        !quiet && head_consumes && self.flow.as_ref().is_some_and(|f| !f.can_send_data())
    }

    /// Plans the chain to post now. Reserves CQ room and spends credits for every request in it;
    /// `new_control` makes the operation of a credit-only message when one is due. The caller
    /// posts the chain and reports with [`SendQueue::posted`]. `plan` is the caller's, reused
    /// from one plan to the next (cleared here), so planning allocates nothing once it grew.
    pub(crate) fn plan_into(&mut self, room: &mut CqRoom, mut new_control: impl FnMut() -> OpKey, plan: &mut Plan) {
        plan.wrs.clear();
        plan.short_of_room = false;
        if self.hold {
            return;
        }
        let slots = self.capacity.saturating_sub(self.outstanding()) as usize;
        if self.hello && slots > 0 {
            // The first message, before any data: credit-only (a grant of what is owed).
            if room.reserve_send(1) == 1 {
                self.hello = false;
                let imm = match self.flow.as_mut() {
                    Some(f) => f.send_control(),
                    None => Imm::control(0),
                };
                plan.wrs.push(Planned { op: new_control(), imm: Some(imm.encode()), signaled: false });
            } else {
                plan.short_of_room = true;
            }
        }
        if !self.hello && plan.wrs.len() < slots {
            if let Some(op) = self.nudge {
                if room.reserve_send(1) == 1 {
                    self.nudge = None;
                    plan.wrs.push(Planned { op, imm: None, signaled: false });
                } else {
                    plan.short_of_room = true;
                }
            }
        }
        let quiet = self.leaving != Leaving::No;
        while !self.hello && !quiet && plan.wrs.len() < slots {
            let Some(&(op, consumes, len)) = self.pending.front() else { break };
            let flow = self.flow.as_mut().filter(|_| consumes);
            if flow.as_ref().is_some_and(|f| !f.can_send_data()) {
                break;
            }
            if room.reserve_send(1) == 0 {
                plan.short_of_room = true;
                break;
            }
            let imm = flow.map(|f| f.send_data().encode());
            self.pending.pop_front();
            self.pending_bytes -= len as usize;
            plan.wrs.push(Planned { op, imm, signaled: false });
        }
        // The close handshake's messages: credit-only, each with the grants owed (the loop
        // only when one is due: every plan passes here).
        let handshake = self.answer_due || self.leaving == Leaving::Due;
        for farewell in [Farewell::Heard, Farewell::Leaving].into_iter().filter(|_| handshake) {
            let due = match farewell {
                Farewell::Heard => self.answer_due,
                _ => self.leaving == Leaving::Due,
            };
            if self.hello || !due || plan.wrs.len() >= slots {
                continue;
            }
            let Some(flow) = self.flow.as_mut().filter(|f| f.can_send_control()) else { continue };
            if farewell == Farewell::Leaving && self.yields && !flow.can_say_farewell() {
                // Our last credit, granting nothing: kept until a grant comes (or for the
                // answer to the peer's farewell), `proto::flow`'s module docs.
                continue;
            }
            if room.reserve_send(1) == 0 {
                plan.short_of_room = true;
                continue;
            }
            let imm = Imm { farewell, ..flow.send_control() };
            plan.wrs.push(Planned { op: new_control(), imm: Some(imm.encode()), signaled: false });
            match farewell {
                Farewell::Heard => self.answer_due = false,
                _ => self.leaving = Leaving::Sent,
            }
        }
        // Credit-only messages go on after our farewell: the peer may need the grant to answer.
        if !self.hello && plan.wrs.len() < slots {
            if let Some(flow) = self.flow.as_mut().filter(|f| f.wants_control()) {
                if room.reserve_send(1) == 1 {
                    let imm = Some(flow.send_control().encode());
                    plan.wrs.push(Planned { op: new_control(), imm, signaled: false });
                } else {
                    plan.short_of_room = true;
                }
            }
        }
        let last = plan.wrs.len().saturating_sub(1);
        for (i, w) in plan.wrs.iter_mut().enumerate() {
            self.unsignaled += 1;
            if self.unsignaled >= self.signal_every || i == last {
                w.signaled = true;
                self.unsignaled = 0;
            }
        }
    }

    /// [`SendQueue::plan_into`] a new [`Plan`].
    #[cfg(test)]
    pub(crate) fn plan(&mut self, room: &mut CqRoom, new_control: impl FnMut() -> OpKey) -> Plan {
        let mut plan = Plan::default();
        self.plan_into(room, new_control, &mut plan);
        plan
    }

    /// The device took the first `n` requests of `plan`. The rest never reached it: their CQ
    /// room is given back and their operations returned (in order) to be failed.
    ///
    /// When the device refused part of the chain, the unsignaled requests it took after the
    /// last signaled one will be reported only if they had not run when the queue pair is
    /// flushed: they stay outstanding (their memory is held until the queue pair is
    /// destroyed) but are no longer awaited ([`SendQueue::awaited`]). Returns the refused
    /// operations, in order.
    pub(crate) fn posted<'p>(
        &mut self,
        plan: &'p Plan,
        n: usize,
        room: &mut CqRoom,
    ) -> impl Iterator<Item = OpKey> + 'p {
        push_keys(&mut self.posted, plan.wrs[..n].iter().map(|w| w.op));
        if n < plan.wrs.len() {
            let taken = &plan.wrs[..n];
            self.unreported = taken.iter().rev().take_while(|w| !w.signaled).count() as u32;
            self.unsignaled = 0;
        }
        let rest = &plan.wrs[n..];
        room.release_send(rest.len() as u32);
        rest.iter().map(|w| w.op)
    }

    /// A send-queue completion for `op`. Appends the operations it completes to `done`, in
    /// order: the unsignaled ones posted before it, then `op` itself; their CQ entries are
    /// given back. Appends nothing when `op` is not outstanding (a completion already
    /// accounted for).
    pub(crate) fn complete(&mut self, op: OpKey, room: &mut CqRoom, done: &mut Vec<OpKey>) {
        // Usually the oldest posted request (a chain of one, signaled): a pop, without the
        // search over the deque's two halves (issue 33: about 40 instructions).
        let at = if self.posted.front() == Some(&op) {
            0
        } else {
            let Some(at) = self.posted.iter().position(|o| *o == op) else { return };
            at
        };
        move_front(&mut self.posted, at + 1, done);
        self.unreported = self.unreported.min(self.posted.len() as u32);
        room.release_send(at as u32 + 1);
    }

    /// Empties the queue for teardown (the queue pair is gone): gives back the CQ room of the
    /// posted requests and returns every operation, posted first.
    pub(crate) fn clear(&mut self, room: Option<&mut CqRoom>) -> Vec<OpKey> {
        if let Some(room) = room {
            room.release_send(self.outstanding());
        }
        self.unreported = 0;
        self.pending_bytes = 0;
        let posted = self.posted.drain(..);
        let nudge = self.nudge.take();
        posted.chain(nudge).chain(self.pending.drain(..).map(|(op, _, _)| op)).collect()
    }

    /// For a reconnection (`reactor/conn/reconnect.rs`; the queue pair is gone): gives back the CQ
    /// room of the posted requests and returns them, keeps the pending operations for which
    /// `keep` is true (in their order) and returns the others after the posted ones, and
    /// forgets everything of the old queue pair (slots, signaling, credits, iWARP's hold,
    /// hello and nudge; a queued nudge is returned with the posted ones), as a new queue would.
    pub(crate) fn carry(&mut self, room: Option<&mut CqRoom>, mut keep: impl FnMut(OpKey) -> bool) -> Vec<OpKey> {
        if let Some(room) = room {
            room.release_send(self.outstanding());
        }
        let mut gone: Vec<OpKey> = self.posted.drain(..).collect();
        gone.extend(self.nudge.take());
        self.pending.retain(|&(op, _, _)| {
            keep(op) || {
                gone.push(op);
                false
            }
        });
        let pending_bytes = self.pending.iter().map(|&(_, _, len)| len as usize).sum();
        *self = SendQueue {
            pending: std::mem::take(&mut self.pending),
            pending_bytes,
            ..SendQueue::new(self.signal_every)
        };
        gone
    }
}

/// The receive side of one connection: pending receives and the posted ones, which an RC
/// queue pair completes in posting order. The reactor's receives are on its receive lane
/// (`data/lanes.rs`, issue 47); the host benchmark's slab path and the tests keep this.
#[cfg(any(test, feature = "bench-internals"))]
#[derive(Debug, Default)]
pub(crate) struct RecvQueue {
    pending: VecDeque<OpKey>,
    posted: VecDeque<OpKey>,
    capacity: u32,
    /// Receives at the front of `pending` given back after a message consumed them
    /// ([`RecvQueue::push_returned`]), in the order they were consumed.
    returned: usize,
}

#[cfg(any(test, feature = "bench-internals"))]
// Kept whole for the slab path's model of the reactor's receive queue as it was.
#[allow(dead_code)]
impl RecvQueue {
    /// Sets the receive work requests the queue pair holds.
    pub(crate) fn set_capacity(&mut self, capacity: u32) {
        self.capacity = capacity;
    }

    /// The receive work requests the queue pair holds.
    pub(crate) fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Queues a receive at the back.
    pub(crate) fn push(&mut self, op: OpKey) {
        self.pending.push_back(op);
    }

    /// Queues a receive at the front (one a credit-only message used, posted again first).
    pub(crate) fn push_front(&mut self, op: OpKey) {
        self.pending.push_front(op);
        if self.returned > 0 {
            self.returned += 1;
        }
    }

    /// Gives back a receive whose message was refused (a peer beyond its credit, a broken
    /// frame) before the ones never posted, after those given back before it: several refused
    /// in one poll keep their order (a reconnecting client posts them again as they were).
    pub(crate) fn push_returned(&mut self, op: OpKey) {
        let at = self.returned.min(self.pending.len());
        self.pending.insert(at, op);
        self.returned = at + 1;
    }

    /// Posted receives not yet completed.
    pub(crate) fn outstanding(&self) -> u32 {
        self.posted.len() as u32
    }

    /// True when receives wait to be posted.
    pub(crate) fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Takes the receives that fit in the queue pair now. Their CQ room was committed when the
    /// queue pair was created. Report with [`RecvQueue::posted`]. They are appended to `out`.
    pub(crate) fn plan(&mut self, out: &mut Vec<OpKey>) {
        let n = (self.pending.len() as u32).min(self.capacity.saturating_sub(self.outstanding()));
        move_front(&mut self.pending, n as usize, out);
        self.returned = self.returned.saturating_sub(n as usize);
    }

    /// Like [`RecvQueue::plan`], but takes only the receives `want` accepts; the others stay
    /// pending, in order (a connection saying goodbye posts the runtime's re-posts only).
    pub(crate) fn plan_only(&mut self, mut want: impl FnMut(OpKey) -> bool, out: &mut Vec<OpKey>) {
        self.returned = 0;
        let room = self.capacity.saturating_sub(self.outstanding()) as usize;
        let (mut i, mut taken) = (0, 0);
        while i < self.pending.len() && taken < room {
            if want(self.pending[i]) {
                out.extend(self.pending.remove(i));
                taken += 1;
            } else {
                i += 1;
            }
        }
    }

    /// The device took the first `n` of the planned receives `planned`.
    pub(crate) fn posted(&mut self, planned: &[OpKey], n: usize) {
        push_keys(&mut self.posted, planned[..n].iter().copied());
    }

    /// A receive completed: `op`, normally the oldest posted one. False when `op` is not
    /// outstanding (a completion already accounted for).
    pub(crate) fn complete(&mut self, op: OpKey) -> bool {
        if self.posted.front() == Some(&op) {
            self.posted.pop_front();
            return true;
        }
        // Not in order (not expected on RC): still account for it exactly once.
        match self.posted.iter().position(|o| *o == op) {
            Some(at) => {
                self.posted.remove(at);
                true
            }
            None => false,
        }
    }

    /// For a reconnection: returns the posted receives and keeps the pending ones for the new
    /// queue pair.
    pub(crate) fn carry(&mut self) -> Vec<OpKey> {
        self.capacity = 0;
        self.returned = 0;
        self.posted.drain(..).collect()
    }

    /// Empties the queue for teardown; returns every receive, posted first.
    pub(crate) fn clear(&mut self) -> Vec<OpKey> {
        self.returned = 0;
        let posted = self.posted.drain(..);
        posted.chain(self.pending.drain(..)).collect()
    }
}

#[cfg(test)]
mod tests;
