//! Hidden and unstable, behind the `bench-internals` feature: the reactor's pure per-operation
//! bookkeeping, for the host benchmark `benches/dispatch.rs`. Not part of the API.

use crate::proto::flow::negotiate;
use crate::proto::token::{GenSlab, Key, OpKey, Token};
use crate::proto::wire::ConnectInfo;
use crate::reactor::bench::{CqRoom, Plan, RecvQueue, SendQueue};

/// One connection's queues and CQ room, with the reused lists the reactor keeps beside them
/// (`Scratch`): what [`Dispatch`] and [`Path`] both drive.
#[derive(Debug)]
struct Queues {
    sq: SendQueue,
    rq: RecvQueue,
    room: CqRoom,
    plan: Plan,
    keys: Vec<OpKey>,
    done: Vec<OpKey>,
}

impl Queues {
    /// Receive-credit flow control on, both depths `depth`.
    fn new(depth: u32) -> Queues {
        let mut sq = SendQueue::new(16);
        sq.set_capacity(depth);
        let peer = ConnectInfo { flow_control: true, recv_depth: depth as u16, ..ConnectInfo::default() };
        sq.set_flow(negotiate(true, depth, Some(&peer)));
        let mut rq = RecvQueue::default();
        rq.set_capacity(depth);
        let mut room = CqRoom::new(4 * depth, depth);
        room.admit(depth);
        Queues { sq, rq, room, plan: Plan::default(), keys: Vec::new(), done: Vec::new() }
    }
}

/// One connection's queues, its CQ room and an operation table, driven without a device.
#[derive(Debug)]
pub struct Dispatch {
    ops: GenSlab<OpKey, u64>,
    q: Queues,
}

impl Dispatch {
    /// A connection with receive-credit flow control on, both depths `depth`.
    pub fn new(depth: u32) -> Dispatch {
        Dispatch { ops: GenSlab::new(), q: Queues::new(depth) }
    }

    /// The bookkeeping of one ping-pong on one side: a receive is submitted and posted, its
    /// completion found by `wr_id`, accounted and removed; a send likewise, with its credit, CQ
    /// room and signaling. Returns a value that depends on all of it.
    pub fn round(&mut self, user_data: u64) -> u64 {
        let r = self.ops.insert(user_data);
        self.q.rq.push(r);
        self.q.keys.clear();
        self.q.rq.plan(&mut self.q.keys);
        self.q.rq.posted(&self.q.keys, self.q.keys.len());
        let found = self.find(r.token().as_u64());
        let recv_ok = self.q.rq.complete(found);
        let mut sum = self.ops.remove(found).unwrap_or(0);
        if let Some(flow) = self.q.sq.flow_mut() {
            flow.on_repost(false);
            flow.on_receive(crate::proto::flow::Imm::data(1));
        }
        let s = self.ops.insert(user_data ^ 1);
        self.q.sq.push(s, true, 64);
        let ops = &mut self.ops;
        self.q.sq.plan_into(&mut self.q.room, || ops.insert(0), &mut self.q.plan);
        self.q.sq.posted(&self.q.plan, self.q.plan.wrs.len(), &mut self.q.room).for_each(drop);
        for w in self.q.plan.wrs.iter().filter(|w| w.signaled) {
            let found = self.find(w.op.token().as_u64());
            self.q.done.clear();
            self.q.sq.complete(found, &mut self.q.room, &mut self.q.done);
            for done in &self.q.done {
                sum = sum.wrapping_add(self.ops.remove(*done).unwrap_or(0));
            }
        }
        sum.wrapping_add(u64::from(recv_ok))
    }

    fn find(&self, wr_id: u64) -> OpKey {
        Token::from_u64(wr_id).and_then(|t| self.ops.key_of(t)).expect("a live operation")
    }
}

/// One connection's per-message path without the device: the echo server's side of a round
/// trip from the receive's work completion to the next receive's and the reply's work
/// requests built into their chains, and the reply's own completion. It calls the reactor's
/// own pieces on the same types (the token and operation table, `RecvQueue::complete`,
/// `SendQueue::complete`, `Flow::on_receive`, `OpEntry::into_completion`, `OpEntry::new`,
/// the queues' plans with credits, CQ room and signaling, `post::send_wr`,
/// `sys::qp::Chains`), in the reactor's order, joined by glue of its own. Left out, so not
/// measured here: the FFI (`ibv_poll_cq` and its conversion of `ibv_wc`, `ibv_post_*`); the
/// connection and CQ tables' look-ups; `Core::submit`'s checks (state and placement, the
/// pool's ownership, the size limits, the send backlog); `finish_op`'s overdraw, release,
/// credit-only and farewell branches and the connection's meters; the handler's `Conn` and
/// what runs after it (`after_completion`, the drained check); `flush_conn`'s state checks
/// and credit watch. The reactor flushes once a tick, after all the tick's completions; here
/// a flush follows each completion that submitted something (one completion a tick, as in a
/// ping-pong). The handler is a plain closure; the memory is caller memory
/// ([`crate::RawBuf`]) that nothing reads: no device is told of it.
pub struct Path {
    conn: crate::proto::token::ConnKey,
    ops: GenSlab<OpKey, crate::reactor::bench::OpEntry>,
    q: Queues,
    signaled: Vec<OpKey>,
    send_wrs: Vec<crate::sys::qp::SendWr>,
    recv_wrs: Vec<crate::sys::qp::RecvWr>,
    chains: crate::sys::qp::Chains,
    /// The receive posted now, whose completion the next message is.
    posted: Option<OpKey>,
    /// Something was submitted since the last flush.
    dirty: bool,
    /// Stands in for the registered memory the operations name (never touched).
    memory: Box<[u8; 64]>,
}

impl std::fmt::Debug for Path {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Path").field("ops", &self.ops.len()).finish()
    }
}

impl Path {
    /// A connection with receive-credit flow control on, both depths `depth`, one receive
    /// posted.
    pub fn new(depth: u32) -> Path {
        let mut conns: GenSlab<crate::proto::token::ConnKey, ()> = GenSlab::new();
        let mut p = Path {
            conn: conns.insert(()),
            ops: GenSlab::new(),
            q: Queues::new(depth),
            signaled: Vec::new(),
            send_wrs: Vec::new(),
            recv_wrs: Vec::new(),
            chains: crate::sys::qp::Chains::default(),
            posted: None,
            dirty: false,
            memory: Box::new([0; 64]),
        };
        let raw = p.raw();
        p.submit(crate::Op::raw_recv(raw));
        p.flush();
        p
    }

    fn raw(&self) -> crate::RawBuf {
        crate::RawBuf { addr: self.memory.as_ptr() as u64, len: 64, lkey: 1 }
    }

    /// One message: its receive completes with 64 bytes and a credit, the handler sees it
    /// and submits what `handler` returns (a reply and a receive, for an echo), the
    /// submissions are planned and built into work requests, and the reply's completion is
    /// delivered to the handler too. Returns a value that depends on all of it.
    pub fn message(
        &mut self,
        handler: &mut dyn FnMut(crate::Completion, crate::RawBuf) -> [Option<crate::Op>; 2],
    ) -> u64 {
        use crate::proto::flow::Imm;
        use crate::sys::cq::WorkCompletion;
        let Some(posted) = self.posted.take() else { return 0 };
        let wc = WorkCompletion {
            wr_id: posted.token().as_u64(),
            status: crate::WcStatus::Success,
            byte_len: 64,
            imm: Some(Imm::data(1).encode()),
            remote_write: false,
            qp_num: 1,
        };
        let mut sum = self.complete(wc, handler);
        // The signaled sends the flush built (as the device would complete them), listed
        // first: completing one plans again.
        let mut signaled = std::mem::take(&mut self.signaled);
        signaled.clear();
        signaled.extend(self.q.plan.wrs.iter().filter(|w| w.signaled).map(|w| w.op));
        for op in &signaled {
            let wc = WorkCompletion { wr_id: op.token().as_u64(), byte_len: 0, imm: None, ..wc };
            sum = sum.wrapping_add(self.complete(wc, handler));
        }
        self.signaled = signaled;
        sum
    }

    /// `Core::complete` and `finish_op` for one work completion (the parts [`Path`] names),
    /// then the flush of what the handler submitted.
    fn complete(
        &mut self,
        wc: crate::sys::cq::WorkCompletion,
        handler: &mut dyn FnMut(crate::Completion, crate::RawBuf) -> [Option<crate::Op>; 2],
    ) -> u64 {
        use crate::proto::flow::Imm;
        let Some(ot) = Token::from_u64(wc.wr_id).and_then(OpKey::of) else { return 0 };
        let Some(opcode) = self.ops.get(ot).map(|e| e.opcode) else { return 0 };
        self.q.done.clear();
        if opcode.on_send_queue() {
            self.q.sq.complete(ot, &mut self.q.room, &mut self.q.done);
        } else if self.q.rq.complete(ot) {
            self.q.done.push(ot);
        }
        let mut sum = 0u64;
        for i in 0..self.q.done.len() {
            let Some(op) = self.ops.remove(self.q.done[i]) else { continue };
            if op.control {
                continue;
            }
            if op.opcode == crate::OpCode::Recv {
                if let Some(flow) = self.q.sq.flow_mut() {
                    flow.on_receive(wc.imm.map_or(Imm::data(0), Imm::decode));
                }
            }
            let result = if op.opcode == crate::OpCode::Recv { Ok(wc.byte_len) } else { Ok(op.sge().1) };
            let completion = op.into_completion(result, wc.remote_write);
            sum = sum.wrapping_add(completion.user_data);
            let raw = self.raw();
            for op in handler(completion, raw).into_iter().flatten() {
                self.submit(op);
            }
        }
        // As the reactor flushes only a connection something was submitted on (its dirty
        // list).
        if std::mem::take(&mut self.dirty) {
            self.flush();
        }
        sum
    }

    /// `Core::submit`'s bookkeeping: the entry built into the table, queued.
    fn submit(&mut self, op: crate::Op) {
        let (opcode, pool_len) = crate::reactor::bench::queue_shape(&op);
        self.dirty = true;
        let key = self.ops.insert(crate::reactor::bench::OpEntry::new(self.conn, op, 0, None));
        if opcode == crate::OpCode::Recv {
            self.q.rq.push(key);
        } else {
            self.q.sq.push(key, opcode.consumes_peer_receive(), u32::try_from(pool_len).unwrap_or(u32::MAX));
        }
    }

    /// `Core::flush_conn`: receives planned, built and chained, then sends likewise.
    fn flush(&mut self) {
        self.q.keys.clear();
        self.q.rq.plan(&mut self.q.keys);
        if !self.q.keys.is_empty() {
            self.recv_wrs.clear();
            let ops = &self.ops;
            self.recv_wrs
                .extend(self.q.keys.iter().filter_map(|k| Some(crate::reactor::bench::recv_wr(*k, ops.get(*k)?))));
            std::hint::black_box(self.chains.recv_chain(&self.recv_wrs));
            self.q.rq.posted(&self.q.keys, self.q.keys.len());
            for k in &self.q.keys {
                if let Some(op) = self.ops.get_mut(*k) {
                    op.posted = true;
                }
                if let Some(flow) = self.q.sq.flow_mut() {
                    flow.on_repost(false);
                }
            }
            self.posted = self.q.keys.last().copied();
        }
        let (ops, conn) = (&mut self.ops, self.conn);
        self.q.sq.plan_into(
            &mut self.q.room,
            || ops.insert(crate::reactor::bench::OpEntry::control(conn)),
            &mut self.q.plan,
        );
        if !self.q.plan.wrs.is_empty() {
            self.send_wrs.clear();
            // Marked posted as each request is built, as `Posting::post_sends` does.
            let ops = &mut self.ops;
            self.send_wrs.extend(self.q.plan.wrs.iter().filter_map(|w| {
                let op = ops.get_mut(w.op)?;
                op.posted = true;
                Some(crate::reactor::bench::send_wr(op, w, 64))
            }));
            std::hint::black_box(self.chains.send_chain(&self.send_wrs));
            self.q.sq.posted(&self.q.plan, self.q.plan.wrs.len(), &mut self.q.room).for_each(drop);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Path;
    use crate::{Completion, Op, OpCode, RawBuf};

    /// The path is the echo's: every message's receive completes, the handler answers it and
    /// posts the receive again, the answer completes; nothing piles up in the tables.
    #[test]
    fn the_path_echoes_every_message_and_keeps_nothing() {
        let mut p = Path::new(16);
        let (mut recvs, mut sends) = (0u64, 0u64);
        let mut handler = |c: Completion, raw: RawBuf| match c.opcode {
            OpCode::Recv => {
                assert_eq!(c.result, Ok(64));
                recvs += 1;
                [Some(Op::raw_send(raw).user_data(7)), Some(Op::raw_recv(raw).user_data(3))]
            }
            _ => {
                assert_eq!((c.user_data, c.result), (7, Ok(64)));
                sends += 1;
                [None, None]
            }
        };
        let live = p.ops.len();
        // The first receive is `Path::new`'s (user_data 0), the others the handler's.
        assert_eq!(p.message(&mut handler), 7);
        for _ in 1..1000 {
            assert_eq!(p.message(&mut handler), 3 + 7);
        }
        assert_eq!((recvs, sends), (1000, 1000));
        assert_eq!(p.ops.len(), live, "one receive posted, nothing else held");
    }
}
