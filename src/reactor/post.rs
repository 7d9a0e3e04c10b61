//! Submission and posting: operations queue per connection during a tick and go to the device
//! at the end of it, one chain per queue pair and direction (one doorbell each).
//!
//! A send-queue operation leaves its queue only when:
//! - the send queue has a slot;
//! - its CQ has room (see `cq.rs`);
//! - for an operation that consumes a peer receive under flow control, the peer granted a
//!   credit (`crate::flow`).
//!
//! The queue is strictly FIFO: an operation waiting for credit holds back the ones behind it,
//! so operations reach the peer in submission order.
//!
//! Signaling is selective. One work request in `Config::signal_every` asks for a completion,
//! and so does the last of each chain. When a signaled completion arrives, the unsignaled
//! requests before it are complete too (RC completes in order); they are reported then.

use super::{Core, OpEntry, SubmitError};
use crate::conn::{Input, State};
use crate::error::Error;
use crate::op::{Body, Completion, Op, OpCode, OpError, WcStatus};
use crate::sys::verbs::{RecvWr, SendOp, SendWr};
use crate::token::Token;

impl Core {
    pub(crate) fn submit(&mut self, t: Token, op: Op) -> std::result::Result<(), SubmitError> {
        let Some(c) = self.conns.get(t) else { return Err(SubmitError::new(Error::StaleToken(t.as_u64()), op)) };
        if !c.can_submit() {
            let what = format!("connection {t:?} is {:?}", c.role.state());
            return Err(SubmitError::new(Error::NotConnected(what), op));
        }
        let pool = &self.devices[c.device.expect("a connection with a CQ has a device")].pool;
        let buf = match &op.body {
            Body::Send(b) | Body::Recv(b) | Body::Write(b, _) | Body::WriteImm(b, _) | Body::Read(b, _) => Some(b),
            Body::RawSend(_) | Body::RawRecv(_) => None,
        };
        if buf.is_some_and(|b| !pool.owns(b)) {
            return Err(SubmitError::new(Error::Config("the buffer belongs to another device's pool".into()), op));
        }
        let len = match &op.body {
            Body::Send(b) | Body::Write(b, _) | Body::WriteImm(b, _) | Body::Recv(b) => b.len(),
            Body::Read(_, r) => r.len as usize,
            Body::RawSend(r) | Body::RawRecv(r) => r.len as usize,
        };
        let limit = match &op.body {
            Body::Send(_) | Body::RawSend(_) => c.peer_info.as_ref().map(|i| i.msg_size as usize),
            Body::Write(_, r) | Body::WriteImm(_, r) => Some(r.len as usize),
            Body::Read(b, _) => Some(b.capacity()),
            Body::Recv(_) | Body::RawRecv(_) => None,
        };
        if let Some(max) = limit.filter(|max| len > *max) {
            return Err(SubmitError::new(Error::TooLarge { len, max }, op));
        }
        let opcode = op.opcode();
        let Op { body, user_data } = op;
        let (buf, raw, remote) = match body {
            Body::Send(b) | Body::Recv(b) => (Some(b), None, None),
            Body::Write(b, r) | Body::WriteImm(b, r) => (Some(b), None, Some(r)),
            Body::Read(mut b, r) => {
                b.set_len(r.len as usize).expect("checked against the capacity");
                (Some(b), None, Some(r))
            }
            Body::RawSend(r) | Body::RawRecv(r) => (None, Some(r), None),
        };
        let entry = OpEntry {
            conn: t,
            user_data,
            opcode,
            buf,
            raw,
            remote,
            control: false,
            after_control: false,
            posted: false,
        };
        let ot = self.ops.insert(entry);
        let c = self.conns.get_mut(t).expect("checked");
        if opcode == OpCode::Recv {
            c.pending_recv.push_back(ot);
        } else {
            c.pending_send.push_back(ot);
        }
        self.mark_dirty(t);
        Ok(())
    }

    pub(super) fn mark_dirty(&mut self, t: Token) {
        if let Some(c) = self.conns.get_mut(t) {
            if !c.dirty {
                c.dirty = true;
                self.dirty.push(t);
            }
        }
    }

    pub(super) fn flush_posts(&mut self) {
        for t in std::mem::take(&mut self.dirty) {
            self.flush_conn(t);
        }
    }

    /// Posts a connection's queued operations, as many as may go now.
    pub(super) fn flush_conn(&mut self, t: Token) {
        let Some(c) = self.conns.get_mut(t) else { return };
        c.dirty = false;
        if !c.can_post() {
            return;
        }
        let Some(ct) = c.cq else { return };
        self.post_recvs(t);
        if self.conns.get(t).is_some_and(|c| matches!(c.role.state(), State::Established)) {
            self.post_sends(t, ct);
        }
    }

    fn wait_for_room(&mut self, t: Token, ct: Token) {
        self.stats.cq_room_waits += 1;
        let Some(c) = self.conns.get_mut(t) else { return };
        if !c.waiting_room {
            c.waiting_room = true;
            if let Some(e) = self.cqs.get_mut(ct) {
                e.waiting.push_back(t);
            }
        }
    }

    fn post_recvs(&mut self, t: Token) {
        let c = self.conns.get_mut(t).expect("live");
        // Receives were admitted on the CQ with the queue pair: up to max_recv_wr have room.
        let granted = (c.pending_recv.len() as u32).min(c.caps.max_recv_wr.saturating_sub(c.out_recv));
        if granted == 0 {
            return;
        }
        let take: Vec<Token> = c.pending_recv.drain(..granted as usize).collect();
        let wrs: Vec<RecvWr> = take
            .iter()
            .map(|ot| {
                let (addr, len, lkey) = self.ops.get(*ot).expect("queued op").sge();
                RecvWr { wr_id: ot.as_u64(), addr, len, lkey }
            })
            .collect();
        let r = c.id.as_ref().expect("can_post").post_recv(&wrs);
        self.stats.post_recv_calls += 1;
        let posted = match &r {
            Ok(()) => take.len(),
            Err(e) => e.posted,
        };
        self.stats.wrs_posted += posted as u64;
        let c = self.conns.get_mut(t).expect("live");
        c.out_recv += posted as u32;
        for ot in &take[..posted] {
            let op = self.ops.get_mut(*ot).expect("queued op");
            op.posted = true;
            // Receives posted after the connect information grant credits one by one.
            if c.info_sent {
                if let Some(flow) = c.flow.as_mut() {
                    flow.on_repost(op.after_control);
                }
            }
        }
        if let Err(e) = r {
            self.fail_unposted(t, &take[posted..], e.error.raw_os_error().unwrap_or(0));
        }
    }

    fn post_sends(&mut self, t: Token, ct: Token) {
        let signal_every = self.cfg.signal_every.max(1);
        let c = self.conns.get_mut(t).expect("live");
        let e = self.cqs.get_mut(ct).expect("a connection's CQ lives as long as it");
        let slots = c.caps.max_send_wr.saturating_sub(c.out_send);
        let mut take: Vec<Token> = Vec::new();
        let mut wrs: Vec<SendWr> = Vec::new();
        let mut short_of_room = false;
        while (wrs.len() as u32) < slots {
            let Some(&ot) = c.pending_send.front() else { break };
            let op = self.ops.get(ot).expect("queued op");
            let imm = match c.flow.as_mut() {
                Some(flow) if op.opcode.consumes_peer_receive() => {
                    if !flow.can_send_data() {
                        break;
                    }
                    if e.room.reserve_send(1) == 0 {
                        short_of_room = true;
                        break;
                    }
                    Some(flow.send_data().encode())
                }
                _ => {
                    if e.room.reserve_send(1) == 0 {
                        short_of_room = true;
                        break;
                    }
                    None
                }
            };
            c.pending_send.pop_front();
            let (addr, len, lkey) = op.sge();
            let remote = op.remote.map(|r| (r.addr, r.rkey)).unwrap_or((0, 0));
            let send_op = match (op.opcode, imm) {
                (OpCode::Send, None) => SendOp::Send,
                (OpCode::Send, Some(imm)) => SendOp::SendImm(imm),
                (OpCode::Write, _) => SendOp::Write(remote.0, remote.1),
                (OpCode::WriteImm, imm) => SendOp::WriteImm(remote.0, remote.1, imm.unwrap_or(0)),
                (OpCode::Read, _) => SendOp::Read(remote.0, remote.1),
                (OpCode::Recv, _) => unreachable!("receives are not on the send queue"),
            };
            let inline = len > 0 && len <= c.caps.max_inline_data && op.opcode != OpCode::Read;
            wrs.push(SendWr { wr_id: ot.as_u64(), op: send_op, addr, len, lkey, signaled: false, inline });
            take.push(ot);
        }
        // Credits owed and nothing carried them: a credit-only message.
        if (wrs.len() as u32) < slots {
            if let Some(flow) = c.flow.as_mut() {
                if flow.wants_control() {
                    if e.room.reserve_send(1) == 1 {
                        let imm = flow.send_control().encode();
                        let op = OpEntry {
                            conn: t,
                            user_data: 0,
                            opcode: OpCode::Send,
                            buf: None,
                            raw: None,
                            remote: None,
                            control: true,
                            after_control: false,
                            posted: false,
                        };
                        let ot = self.ops.insert(op);
                        wrs.push(SendWr {
                            wr_id: ot.as_u64(),
                            op: SendOp::SendImm(imm),
                            addr: 0,
                            len: 0,
                            lkey: 0,
                            signaled: false,
                            inline: false,
                        });
                        take.push(ot);
                    } else {
                        short_of_room = true;
                    }
                }
            }
        }
        let e = self.cqs.get_mut(ct).expect("live");
        self.stats.cq_peak_reserved = self.stats.cq_peak_reserved.max(u64::from(e.room.reserved()));
        if short_of_room {
            self.wait_for_room(t, ct);
        }
        if wrs.is_empty() {
            return;
        }
        let c = self.conns.get_mut(t).expect("live");
        let last = wrs.len() - 1;
        for (i, w) in wrs.iter_mut().enumerate() {
            c.unsignaled += 1;
            if c.unsignaled >= signal_every || i == last {
                w.signaled = true;
                c.unsignaled = 0;
            }
        }
        let r = c.id.as_ref().expect("can_post").post_send(&wrs);
        self.stats.post_send_calls += 1;
        let posted = match &r {
            Ok(()) => take.len(),
            Err(e) => e.posted,
        };
        self.stats.wrs_posted += posted as u64;
        c.out_send += posted as u32;
        for ot in &take[..posted] {
            c.sq.push_back(*ot);
            self.ops.get_mut(*ot).expect("queued op").posted = true;
        }
        if let Err(e) = r {
            if let Some(cq) = self.cqs.get_mut(ct) {
                cq.room.release_send((take.len() - posted) as u32);
            }
            self.fail_unposted(t, &take[posted..], e.error.raw_os_error().unwrap_or(0));
        }
    }

    /// Operations the device refused: each completes with the errno, and the connection,
    /// whose queue pair is now suspect, closes.
    fn fail_unposted(&mut self, t: Token, ops: &[Token], errno: i32) {
        for ot in ops {
            let Some(op) = self.ops.remove(*ot) else { continue };
            if op.control {
                continue;
            }
            let completion = Completion {
                user_data: op.user_data,
                opcode: op.opcode,
                result: Err(OpError::Post(errno)),
                buf: op.buf,
                remote_write: false,
            };
            self.with_conn(t, |h, conn| h.on_completion(conn, completion));
        }
        self.feed(t, Input::WorkError(WcStatus::LocQpOpErr));
    }
}
