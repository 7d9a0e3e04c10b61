//! Hidden and unstable, behind the `bench-internals` feature: the reactor's pure per-operation
//! bookkeeping, for the host benchmark `benches/dispatch.rs`. Not part of the API.

use crate::proto::flow::negotiate;
use crate::proto::token::{GenSlab, Key, OpKey, Token};
use crate::proto::wire::ConnectInfo;
use crate::reactor::bench::{CqRoom, Plan, RecvQueue, SendQueue};

/// One connection's queues, its CQ room and an operation table, driven without a device.
#[derive(Debug)]
pub struct Dispatch {
    ops: GenSlab<OpKey, u64>,
    sq: SendQueue,
    rq: RecvQueue,
    room: CqRoom,
    /// The reused lists, as the reactor keeps them (`Scratch`).
    plan: Plan,
    keys: Vec<OpKey>,
    done: Vec<OpKey>,
}

impl Dispatch {
    /// A connection with receive-credit flow control on, both depths `depth`.
    pub fn new(depth: u32) -> Dispatch {
        let mut sq = SendQueue::new(16);
        sq.set_capacity(depth);
        let peer = ConnectInfo { flow_control: true, recv_depth: depth as u16, ..ConnectInfo::default() };
        sq.set_flow(negotiate(true, depth, Some(&peer)));
        let mut rq = RecvQueue::default();
        rq.set_capacity(depth);
        let mut room = CqRoom::new(4 * depth, depth);
        room.admit(depth);
        Dispatch { ops: GenSlab::new(), sq, rq, room, plan: Plan::default(), keys: Vec::new(), done: Vec::new() }
    }

    /// The bookkeeping of one ping-pong on one side: a receive is submitted and posted, its
    /// completion found by `wr_id`, accounted and removed; a send likewise, with its credit, CQ
    /// room and signaling. Returns a value that depends on all of it.
    pub fn round(&mut self, user_data: u64) -> u64 {
        let r = self.ops.insert(user_data);
        self.rq.push(r);
        self.keys.clear();
        self.rq.plan(&mut self.keys);
        self.rq.posted(&self.keys, self.keys.len());
        let found = self.find(r.token().as_u64());
        let recv_ok = self.rq.complete(found);
        let mut sum = self.ops.remove(found).unwrap_or(0);
        if let Some(flow) = self.sq.flow_mut() {
            flow.on_repost(false);
            flow.on_receive(crate::proto::flow::Imm::data(1));
        }
        let s = self.ops.insert(user_data ^ 1);
        self.sq.push(s, true, 64);
        let ops = &mut self.ops;
        self.sq.plan_into(&mut self.room, || ops.insert(0), &mut self.plan);
        self.sq.posted(&self.plan, self.plan.wrs.len(), &mut self.room).for_each(drop);
        for w in self.plan.wrs.iter().filter(|w| w.signaled) {
            let found = self.find(w.op.token().as_u64());
            self.done.clear();
            self.sq.complete(found, &mut self.room, &mut self.done);
            for done in &self.done {
                sum = sum.wrapping_add(self.ops.remove(*done).unwrap_or(0));
            }
        }
        sum.wrapping_add(u64::from(recv_ok))
    }

    fn find(&self, wr_id: u64) -> OpKey {
        Token::from_u64(wr_id).and_then(|t| self.ops.key_of(t)).expect("a live operation")
    }
}
