//! A connection's send and receive queues, pure: what may be posted now, given the queue pair's
//! slots, the CQ's room and the peer's credits. No FFI; the posting itself is `post.rs`.
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

use std::collections::VecDeque;

use crate::proto::flow::{Farewell, Flow, Imm};
use crate::proto::token::OpKey;
use crate::reactor::data::cq_room::CqRoom;

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
        // The close handshake's messages: credit-only, each with the grants owed.
        for farewell in [Farewell::Heard, Farewell::Leaving] {
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
        self.posted.extend(plan.wrs[..n].iter().map(|w| w.op));
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
        let Some(at) = self.posted.iter().position(|o| *o == op) else { return };
        done.extend(self.posted.drain(..=at));
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
        posted.chain(self.pending.drain(..).map(|(op, _, _)| op)).collect()
    }

    /// For a reconnection (`reactor/conn/reconnect.rs`; the queue pair is gone): gives back the CQ
    /// room of the posted requests and returns them, keeps the pending operations for which
    /// `keep` is true (in their order) and returns the others after the posted ones, and
    /// forgets everything of the old queue pair (slots, signaling, credits, iWARP's hold and
    /// hello), as a new queue would.
    pub(crate) fn carry(&mut self, room: Option<&mut CqRoom>, mut keep: impl FnMut(OpKey) -> bool) -> Vec<OpKey> {
        if let Some(room) = room {
            room.release_send(self.outstanding());
        }
        let mut gone: Vec<OpKey> = self.posted.drain(..).collect();
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
/// queue pair completes in posting order.
#[derive(Debug, Default)]
pub(crate) struct RecvQueue {
    pending: VecDeque<OpKey>,
    posted: VecDeque<OpKey>,
    capacity: u32,
    /// Receives at the front of `pending` given back after a message consumed them
    /// ([`RecvQueue::push_returned`]), in the order they were consumed.
    returned: usize,
}

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
        out.extend(self.pending.drain(..n as usize));
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
        self.posted.extend(&planned[..n]);
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
mod tests {
    use super::*;
    use crate::proto::flow::{negotiate, Imm};
    use crate::proto::token::GenSlab;
    use crate::proto::wire::ConnectInfo;

    fn keys(n: usize) -> Vec<OpKey> {
        let mut slab: GenSlab<OpKey, ()> = GenSlab::new();
        (0..n).map(|_| slab.insert(())).collect()
    }

    fn flow(peer_depth: u16, depth: u32) -> Option<Flow> {
        let peer = ConnectInfo { flow_control: true, recv_depth: peer_depth, ..ConnectInfo::default() };
        negotiate(true, depth, Some(&peer))
    }

    /// A queue of 16 slots with `ops` pushed.
    fn filled(signal_every: u32, ops: &[OpKey], consumes: bool) -> SendQueue {
        let mut q = SendQueue::new(signal_every);
        q.set_capacity(16);
        for op in ops {
            q.push(*op, consumes, 64);
        }
        q
    }

    /// The operations a send completion completes.
    fn completed(q: &mut SendQueue, op: OpKey, room: &mut CqRoom) -> Vec<OpKey> {
        let mut done = Vec::new();
        q.complete(op, room, &mut done);
        done
    }

    /// The receives a plan takes.
    fn rplan(r: &mut RecvQueue) -> Vec<OpKey> {
        let mut out = Vec::new();
        r.plan(&mut out);
        out
    }

    /// The receives a selective plan takes.
    fn rplan_only(r: &mut RecvQueue, want: impl FnMut(OpKey) -> bool) -> Vec<OpKey> {
        let mut out = Vec::new();
        r.plan_only(want, &mut out);
        out
    }

    fn ops(plan: &Plan) -> Vec<OpKey> {
        plan.wrs.iter().map(|w| w.op).collect()
    }

    #[test]
    fn a_held_queue_posts_nothing_until_released() {
        let k = keys(2);
        let mut q = filled(16, &k, true);
        q.set_flow(flow(8, 8));
        q.set_hold(true);
        let mut room = CqRoom::new(64, 16);
        assert!(!q.wants_post());
        assert!(q.plan(&mut room, || unreachable!()).wrs.is_empty(), "an iWARP agent before its client spoke");
        assert!(q.release());
        assert!(!q.release(), "released once");
        assert_eq!(ops(&q.plan(&mut room, || unreachable!())), k);
    }

    #[test]
    fn a_hello_goes_first_credit_only_and_spends_one_credit() {
        let k = keys(3);
        let hello = keys(1)[0];
        let mut q = filled(16, &k[..2], true);
        q.set_flow(flow(3, 8));
        q.set_hello(true);
        assert!(q.wants_post());
        let mut room = CqRoom::new(64, 16);
        let plan = q.plan(&mut room, || hello);
        // The hello took one of the 3 credits; one data message may go, one stays in reserve.
        assert_eq!(ops(&plan), vec![hello, k[0]]);
        assert_eq!(plan.wrs[0].imm.map(Imm::decode), Some(Imm::control(0)));
        assert_eq!(plan.wrs[1].imm.map(Imm::decode), Some(Imm::data(0)));
        // Without flow control the hello still goes first, marked credit-only.
        let mut plain = filled(16, &k[2..], true);
        plain.set_hello(true);
        let plan = plain.plan(&mut room, || hello);
        assert_eq!(ops(&plan), vec![hello, k[2]]);
        assert_eq!(plan.wrs[0].imm.map(Imm::decode), Some(Imm::control(0)));
        assert_eq!(plan.wrs[1].imm, None);
    }

    #[test]
    fn fifo_order_holds_behind_a_credit_blocked_op() {
        let k = keys(6);
        let mut q = SendQueue::new(16);
        q.set_capacity(16);
        // The peer granted 3 credits; one is spent: one data message may go, one credit stays in
        // reserve.
        q.set_flow(flow(3, 8));
        q.flow_mut().unwrap().send_data();
        let mut room = CqRoom::new(64, 16);
        // A write (no credit needed), two sends, then another write.
        q.push(k[0], false, 64);
        q.push(k[1], true, 64);
        q.push(k[2], true, 64);
        q.push(k[3], false, 64);
        let plan = q.plan(&mut room, || unreachable!("nothing is owed"));
        assert_eq!(ops(&plan), vec![k[0], k[1]], "the second send waits for credit, and the write behind it");
        assert!(!plan.short_of_room);
        assert!(plan.wrs[1].imm.is_some(), "a flow-controlled send carries its grant");
        assert_eq!(q.posted(&plan, 2, &mut room).count(), 0);
        assert!(q.credit_blocked(), "the second send waits for credit (the credit-stall timer runs)");
        // Nothing moves until credit arrives, and then in order.
        assert!(q.plan(&mut room, || unreachable!()).wrs.is_empty());
        q.flow_mut().unwrap().on_receive(Imm::data(2));
        let plan = q.plan(&mut room, || unreachable!());
        assert_eq!(ops(&plan), vec![k[2], k[3]]);
        assert!(!q.credit_blocked(), "nothing waits");
    }

    #[test]
    fn only_a_send_that_needs_credit_is_credit_blocked() {
        let k = keys(2);
        let mut q = SendQueue::new(16);
        q.set_capacity(16);
        q.set_flow(flow(3, 8));
        q.flow_mut().unwrap().send_data();
        q.flow_mut().unwrap().send_data();
        q.push(k[0], false, 64);
        assert!(!q.credit_blocked(), "a write needs no credit, even at the last one");
        let mut plain = SendQueue::new(16);
        plain.push(k[1], true, 64);
        assert!(!plain.credit_blocked(), "without flow control nothing waits for credit");
        q.pending.clear();
        q.push(k[1], true, 64);
        assert!(q.credit_blocked(), "a send at the reserved last credit waits");
    }

    #[test]
    fn the_last_of_each_chain_is_signaled_and_one_in_n() {
        let k = keys(10);
        let mut q = filled(4, &k, true);
        let mut room = CqRoom::new(64, 16);
        let plan = q.plan(&mut room, || unreachable!());
        let signaled: Vec<bool> = plan.wrs.iter().map(|w| w.signaled).collect();
        let mut want = vec![false; 10];
        for i in [3, 7, 9] {
            want[i] = true;
        }
        assert_eq!(signaled, want, "every 4th and the last");
        assert!(plan.wrs.iter().all(|w| w.imm.is_none()), "no flow control: no immediate");
    }

    #[test]
    fn a_signaled_completion_frees_its_unsignaled_predecessors() {
        let k = keys(5);
        let mut q = filled(16, &k, false);
        let mut room = CqRoom::new(32, 8);
        let plan = q.plan(&mut room, || unreachable!());
        assert_eq!(room.reserved(), 5, "one CQ entry per request, unsignaled ones too");
        q.posted(&plan, 5, &mut room).for_each(drop);
        assert_eq!(q.outstanding(), 5);
        let done = completed(&mut q, k[4], &mut room);
        assert_eq!(done.to_vec(), k, "in posting order, the signaled one last");
        assert_eq!(room.reserved(), 0, "their entries are free");
        assert_eq!(q.outstanding(), 0);
        assert!(completed(&mut q, k[4], &mut room).is_empty(), "a second completion for it is ignored");
    }

    #[test]
    fn a_chain_refused_part_way_awaits_no_completion_that_cannot_come() {
        // Five unsignaled requests, then the signaled last one; the device takes three and
        // refuses the fourth. The three went out unsignaled: if they ran, no completion will
        // ever name them, so draining must not wait for them (it waited for its full
        // timeout, then reported them as never posted).
        let k = keys(6);
        let mut q = filled(16, &k, false);
        let mut room = CqRoom::new(32, 8);
        let plan = q.plan(&mut room, || unreachable!());
        assert!(plan.wrs[..5].iter().all(|w| !w.signaled) && plan.wrs[5].signaled);
        let failed: Vec<OpKey> = q.posted(&plan, 3, &mut room).collect();
        assert_eq!(failed.to_vec(), k[3..].to_vec(), "refused, to be failed");
        assert_eq!(q.outstanding(), 3, "they still hold their slots and memory until the QP is gone");
        assert_eq!(q.awaited(), 0, "but no completion is awaited for them");
        // Had they not run yet, the queue pair's flush reports them after all.
        assert_eq!(completed(&mut q, k[1], &mut room).to_vec(), k[..2].to_vec());
        assert_eq!((q.outstanding(), q.awaited()), (1, 0));
        // A prefix that ends with a signaled request is awaited as usual.
        let k = keys(4);
        let mut q = filled(2, &k, false);
        let plan = q.plan(&mut room, || unreachable!());
        assert!(plan.wrs[1].signaled && !plan.wrs[2].signaled);
        q.posted(&plan, 3, &mut room).for_each(drop);
        assert_eq!((q.outstanding(), q.awaited()), (3, 2), "the third alone has no completion coming");
    }

    #[test]
    fn a_flush_completes_each_request_on_its_own() {
        let k = keys(3);
        let mut q = filled(16, &k, false);
        let mut room = CqRoom::new(32, 8);
        let plan = q.plan(&mut room, || unreachable!());
        q.posted(&plan, 3, &mut room).for_each(drop);
        for (i, op) in k.iter().enumerate() {
            assert_eq!(completed(&mut q, *op, &mut room).to_vec(), vec![*op]);
            assert_eq!(room.reserved(), 2 - i as u32);
        }
    }

    #[test]
    fn a_credit_only_message_goes_out_exactly_when_owed() {
        let k = keys(2);
        let mut q = SendQueue::new(16);
        q.set_capacity(16);
        // Depth 8 on our side: a credit-only message is due once 4 receives re-posted after data
        // messages are owed (half the depth).
        q.set_flow(flow(8, 8));
        let mut room = CqRoom::new(64, 16);
        for owed in 1..=4 {
            q.flow_mut().unwrap().on_repost(false);
            let plan = q.plan(&mut room, || k[0]);
            if owed < 4 {
                assert!(plan.wrs.is_empty(), "{owed} owed: not yet");
                assert!(!q.wants_post());
            } else {
                assert_eq!(ops(&plan), vec![k[0]], "4 owed: one credit-only message");
                let imm = Imm::decode(plan.wrs[0].imm.unwrap());
                assert_eq!(imm, Imm::control(4));
                assert!(plan.wrs[0].signaled, "the last of its chain");
            }
        }
        assert!(!q.wants_post(), "nothing owed after the grant");
        // Owed credits ride on a data message instead when there is one.
        for _ in 0..4 {
            q.flow_mut().unwrap().on_repost(false);
        }
        q.push(k[1], true, 64);
        let plan = q.plan(&mut room, || unreachable!("the data message carries the grant"));
        assert_eq!(ops(&plan), vec![k[1]]);
        assert_eq!(Imm::decode(plan.wrs[0].imm.unwrap()), Imm::data(4));
    }

    #[test]
    fn without_cq_room_nothing_goes_and_the_connection_waits() {
        let k = keys(3);
        let mut q = SendQueue::new(16);
        q.set_capacity(16);
        let mut room = CqRoom::new(4, 2);
        assert!(room.admit(2));
        for op in &k {
            q.push(*op, false, 64);
        }
        let plan = q.plan(&mut room, || unreachable!());
        assert_eq!(ops(&plan), vec![k[0], k[1]]);
        assert!(plan.short_of_room);
        // The device refuses the second: its room comes back and it is returned for failing.
        let failed: Vec<OpKey> = q.posted(&plan, 1, &mut room).collect();
        assert_eq!(failed.to_vec(), vec![k[1]]);
        assert_eq!(room.reserved(), 2 + 1);
    }

    #[test]
    fn slots_bound_the_chain_and_clear_returns_everything() {
        let k = keys(5);
        let mut q = SendQueue::new(16);
        q.set_capacity(3);
        let mut room = CqRoom::new(64, 16);
        for op in &k {
            q.push(*op, false, 64);
        }
        let plan = q.plan(&mut room, || unreachable!());
        assert_eq!(ops(&plan), k[..3].to_vec(), "three send slots");
        q.posted(&plan, 3, &mut room).for_each(drop);
        assert!(q.plan(&mut room, || unreachable!()).wrs.is_empty(), "no slot left");
        assert_eq!(q.clear(Some(&mut room)), k, "posted first, then pending");
        assert_eq!(room.reserved(), 0);
    }

    /// A reconnection: the posted requests come back (their room given back), the pending
    /// ones the caller keeps wait in order for a new queue pair, and nothing of the old one's
    /// credits, slots or signaling is left.
    #[test]
    fn a_reconnection_keeps_what_was_never_posted_and_forgets_the_queue_pair() {
        let k = keys(6);
        let mut q = SendQueue::new(4);
        q.set_capacity(2);
        q.set_flow(flow(4, 4));
        q.set_hold(false);
        let mut room = CqRoom::new(64, 16);
        for op in &k {
            q.push(*op, true, 64);
        }
        let plan = q.plan(&mut room, || unreachable!());
        q.posted(&plan, 2, &mut room).for_each(drop);
        assert_eq!(room.reserved(), 2);
        // k[3] is one the caller drops (a one-sided operation: its remote key is the old peer's).
        let gone = q.carry(Some(&mut room), |op| op != k[3]);
        assert_eq!(gone, vec![k[0], k[1], k[3]], "posted first, then the pending ones not kept");
        assert_eq!(room.reserved(), 0);
        assert_eq!((q.outstanding(), q.capacity(), q.flow_mut().is_some()), (0, 0, false));
        q.set_capacity(16);
        let plan = q.plan(&mut room, || unreachable!());
        assert_eq!(ops(&plan), vec![k[2], k[4], k[5]], "in their order, on the new queue pair");

        let mut r = RecvQueue::default();
        r.set_capacity(1);
        r.push(k[0]);
        r.push(k[1]);
        let first = rplan(&mut r);
        r.posted(&first, 1);
        assert_eq!(r.carry(), vec![k[0]], "the posted receive");
        assert_eq!((r.outstanding(), r.capacity()), (0, 0));
        r.set_capacity(4);
        assert_eq!(rplan(&mut r).to_vec(), vec![k[1]], "the pending one waits for the new queue pair");
    }

    #[test]
    fn receives_fill_the_queue_pair_and_no_more() {
        let k = keys(5);
        let mut r = RecvQueue::default();
        r.set_capacity(3);
        for op in &k {
            r.push(*op);
        }
        let first = rplan(&mut r);
        assert_eq!(first.to_vec(), k[..3].to_vec());
        // The device took two; the third was refused (the caller fails it).
        r.posted(&first, 2);
        assert_eq!(r.outstanding(), 2);
        let second = rplan(&mut r);
        assert_eq!(second.to_vec(), vec![k[3]], "one slot left");
        r.posted(&second, 1);
        assert!(r.complete(k[0]));
        assert!(!r.complete(k[0]), "completed once");
        let fresh = keys(6)[5];
        r.push_front(fresh);
        assert_eq!(rplan(&mut r).to_vec(), vec![fresh], "a re-posted receive goes first");
        assert_eq!(r.clear(), vec![k[1], k[3], k[4]], "posted first, then pending");
    }

    #[test]
    fn plan_only_takes_the_wanted_receives_and_keeps_the_rest_in_order() {
        let k = keys(5);
        let mut r = RecvQueue::default();
        r.set_capacity(2);
        for op in &k {
            r.push(*op);
        }
        assert_eq!(
            rplan_only(&mut r, |o| o == k[1] || o == k[3] || o == k[4]).to_vec(),
            vec![k[1], k[3]],
            "room for two"
        );
        r.posted(&[k[1], k[3]], 2);
        assert!(rplan_only(&mut r, |_| true).is_empty(), "no room");
        assert!(r.complete(k[1]));
        assert_eq!(rplan(&mut r).to_vec(), vec![k[0]], "the rest stayed, in order");
    }

    fn farewell_of(w: &Planned) -> Option<Farewell> {
        w.imm.map(Imm::decode).filter(|i| i.control).map(|i| i.farewell)
    }

    #[test]
    fn a_farewell_goes_after_what_was_posted_and_nothing_goes_after_it() {
        let k = keys(5);
        let mut q = filled(16, &k[..2], true);
        q.set_flow(flow(8, 8));
        q.set_farewell(true);
        let mut room = CqRoom::new(64, 16);
        assert_eq!(ops(&q.plan(&mut room, || unreachable!())), k[..2].to_vec());
        q.push(k[2], true, 64);
        q.say_farewell();
        assert!(!q.credit_blocked(), "nothing waits for credit once saying goodbye");
        let plan = q.plan(&mut room, || k[3]);
        assert_eq!(ops(&plan), vec![k[3]], "the farewell alone, not the data submitted after the close");
        assert_eq!(farewell_of(&plan.wrs[0]), Some(Farewell::Leaving));
        assert!(plan.wrs[0].signaled);
        assert!(!q.wants_post(), "after the farewell no data goes");
        q.say_farewell();
        assert!(q.plan(&mut room, || unreachable!()).wrs.is_empty(), "one farewell");
        // The peer spent its credits: our grant still goes, so that it can answer.
        for _ in 0..7 {
            q.flow_mut().unwrap().on_receive(Imm::control(0));
            q.flow_mut().unwrap().on_repost(true);
        }
        assert!(q.wants_post());
        let plan = q.plan(&mut room, || k[4]);
        assert_eq!(ops(&plan), vec![k[4]], "a credit-only message, not the pending data");
        assert_eq!(farewell_of(&plan.wrs[0]), Some(Farewell::None));
    }

    #[test]
    fn farewells_wait_for_a_credit_and_the_answer_goes_first() {
        let k = keys(5);
        let mut q = filled(16, &k[..2], true);
        q.set_flow(flow(3, 8));
        q.set_farewell(true);
        let mut room = CqRoom::new(64, 16);
        assert_eq!(ops(&q.plan(&mut room, || unreachable!())), k[..2].to_vec(), "the last credit is kept");
        q.answer_farewell();
        q.say_farewell();
        let plan = q.plan(&mut room, || k[2]);
        assert_eq!(ops(&plan), vec![k[2]], "one credit: the answer goes, the farewell waits");
        assert_eq!(farewell_of(&plan.wrs[0]), Some(Farewell::Heard));
        assert!(q.wants_post(), "the farewell still waits");
        assert!(q.plan(&mut room, || unreachable!()).wrs.is_empty(), "no credit");
        q.flow_mut().unwrap().on_receive(Imm::control(2));
        let plan = q.plan(&mut room, || k[3]);
        assert_eq!(ops(&plan), vec![k[3]]);
        assert_eq!(farewell_of(&plan.wrs[0]), Some(Farewell::Leaving));
        assert!(!q.wants_post());
    }

    #[test]
    fn without_the_handshake_a_close_changes_nothing_here() {
        let k = keys(2);
        let mut q = filled(16, &k, true);
        q.set_flow(flow(8, 8));
        q.set_farewell(false);
        q.say_farewell();
        q.answer_farewell();
        let mut room = CqRoom::new(64, 16);
        assert_eq!(ops(&q.plan(&mut room, || unreachable!())), k.to_vec());
        // And it needs flow control: without it there is no credit to say goodbye with.
        let mut plain = SendQueue::new(16);
        plain.set_farewell(true);
        assert!(!plain.farewell());
    }

    /// The backlog (`Config::send_backlog`, review M1) counts what is queued and not posted:
    /// a plan that posts takes it off, a reconnection keeps what stays queued, a teardown
    /// empties it.
    #[test]
    fn the_backlog_counts_what_waits_unposted() {
        let k = keys(6);
        let mut q = SendQueue::new(1);
        q.set_capacity(2);
        let mut room = CqRoom::new(64, 8);
        for (i, op) in k.iter().enumerate() {
            q.push(*op, false, 100 * (i as u32 + 1));
        }
        assert_eq!(q.backlog(), (6, 2100));
        let plan = q.plan(&mut room, || unreachable!());
        assert_eq!(ops(&plan), k[..2].to_vec(), "two send slots");
        q.posted(&plan, 2, &mut room).for_each(drop);
        assert_eq!(q.backlog(), (4, 1800), "the posted ones are not queued any more");
        let gone = q.carry(Some(&mut room), |op| op != k[3]);
        assert_eq!(gone, vec![k[0], k[1], k[3]]);
        assert_eq!(q.backlog(), (3, 300 + 500 + 600), "what a reconnection keeps");
        q.clear(None);
        assert_eq!(q.backlog(), (0, 0));
    }

    /// Receives given back after their messages were refused (review of the M1 change, finding
    /// 6) keep the order they were consumed in, before the ones never posted and after a
    /// credit-only message's re-post.
    #[test]
    fn returned_receives_keep_their_order() {
        let k = keys(6);
        let mut r = RecvQueue::default();
        r.set_capacity(2);
        r.push(k[0]);
        r.push(k[1]);
        let first = rplan(&mut r);
        r.posted(&first, 2);
        r.push(k[2]);
        r.push(k[3]);
        assert!(r.complete(k[0]) && r.complete(k[1]));
        r.push_returned(k[0]);
        r.push_returned(k[1]);
        r.push_front(k[4]);
        r.push_returned(k[5]);
        r.set_capacity(8);
        assert_eq!(rplan(&mut r), vec![k[4], k[0], k[1], k[5], k[2], k[3]]);
    }

    /// Both sides close at once, each at its last credit with nothing owed (the review of
    /// 2026-11-26, L6): the handshake must still finish without `Timeouts::finish`. Each side
    /// is scripted as the runtime drives it: every message it plans arrives at the other, whose
    /// credit-only messages' receives are posted again (`on_repost(true)`) and whose `Leaving`
    /// is answered. Before the fix both farewells took the last credits, neither side could
    /// send its `Heard`, and both waited the 2 s out.
    #[test]
    fn crossing_farewells_at_the_last_credit_are_still_answered() {
        let k = keys(64);
        let mut next = k.iter().copied();
        // Side 0 accepted the connection, side 1 made it (it yields its last credit).
        let mut q = [filled(1, &k[..2], true), filled(1, &k[2..4], true)];
        let mut room = [CqRoom::new(64, 16), CqRoom::new(64, 16)];
        for (i, q) in q.iter_mut().enumerate() {
            q.set_flow(flow(3, 3));
            q.set_farewell(true);
            if i == 1 {
                q.yield_last_credit();
            }
            let plan = q.plan(&mut room[i], || unreachable!());
            assert_eq!(plan.wrs.len(), 2, "two data messages; the last credit is kept");
            q.posted(&plan, 2, &mut room[i]).for_each(drop);
        }
        // The data arrived, their receives are not posted again (the applications stopped
        // reading): nothing is owed on either side, one credit each.
        for q in &mut q {
            for _ in 0..2 {
                q.flow_mut().unwrap().on_receive(Imm::data(0));
            }
            assert_eq!((q.flow_mut().unwrap().credits(), q.flow_mut().unwrap().owed()), (1, 0));
            q.say_farewell();
        }
        let mut heard = [false; 2];
        let mut said = [Vec::new(), Vec::new()];
        for _round in 0..4 {
            let mut wire: [Vec<Imm>; 2] = [Vec::new(), Vec::new()];
            for i in 0..2 {
                let plan = q[i].plan(&mut room[i], || next.next().expect("enough keys"));
                q[i].posted(&plan, plan.wrs.len(), &mut room[i]).for_each(drop);
                for w in &plan.wrs {
                    let imm = Imm::decode(w.imm.expect("flow control"));
                    said[i].push(imm.farewell);
                    wire[1 - i].push(imm);
                }
            }
            for (j, msgs) in wire.into_iter().enumerate() {
                for imm in msgs {
                    let f = q[j].flow_mut().unwrap();
                    f.on_receive(imm);
                    if imm.control {
                        f.on_repost(true);
                    }
                    match imm.farewell {
                        Farewell::Leaving => q[j].answer_farewell(),
                        Farewell::Heard => heard[j] = true,
                        Farewell::None => {}
                    }
                }
            }
            if heard.iter().any(|h| *h) {
                break;
            }
        }
        assert!(
            heard.iter().any(|h| *h),
            "no farewell answered: both sides wait Timeouts::finish; side 0 sent {:?}, side 1 sent {:?}",
            said[0],
            said[1]
        );
        // Side 0 said goodbye and was answered: it disconnects (and side 1 with it).
        assert_eq!(said[0].first(), Some(&Farewell::Leaving));
        assert!(heard[0], "{said:?}");
    }

    /// The connecting side's farewell (L6): on its last credit it goes only with a grant, which
    /// lets the peer answer whatever it spent its own credits on; with two credits or more it
    /// goes at once, as on the other side.
    #[test]
    fn the_connecting_sides_farewell_takes_the_last_credit_only_with_a_grant() {
        let k = keys(6);
        let mut room = CqRoom::new(64, 16);
        let mut q = filled(1, &k[..2], true);
        q.set_flow(flow(3, 3));
        q.set_farewell(true);
        q.yield_last_credit();
        let plan = q.plan(&mut room, || unreachable!());
        q.posted(&plan, 2, &mut room).for_each(drop);
        q.say_farewell();
        assert!(q.plan(&mut room, || unreachable!()).wrs.is_empty(), "one credit, nothing to grant: it waits");
        assert!(q.wants_post(), "the farewell is still due");
        q.flow_mut().unwrap().on_repost(false);
        let plan = q.plan(&mut room, || k[2]);
        assert_eq!(ops(&plan), vec![k[2]]);
        let imm = Imm::decode(plan.wrs[0].imm.expect("flow"));
        assert_eq!((imm.farewell, imm.grant), (Farewell::Leaving, 1), "the last credit, with a grant");
        let mut two = filled(1, &[], true);
        two.set_flow(flow(3, 3));
        two.set_farewell(true);
        two.yield_last_credit();
        two.say_farewell();
        let plan = two.plan(&mut room, || k[3]);
        assert_eq!(farewell_of(&plan.wrs[0]), Some(Farewell::Leaving), "a credit is left for an answer");
    }
}
