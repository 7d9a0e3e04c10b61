//! Completion queues: the CQ protocol (drain events, batched acks, poll under a budget, arm
//! then poll again) and CQ room accounting.
//!
//! **Invariant:** a CQ never holds more completions than it has entries.
//!
//! - **Receives are admitted.** A connection commits its receive depth on its CQ when its queue
//!   pair is created; a connection that does not fit (a shared CQ keeps a quarter of its
//!   entries for sends) is refused. Its posted receives, at most that depth, then always have
//!   room.
//! - **Sends are metered.** Every send-queue work request reserves one of the remaining
//!   entries before it is posted (an unsignaled one too: if the queue pair fails, its flush
//!   completion lands as well). It gives the entry back when its completion is reaped, or,
//!   unsignaled, when the signaled completion after it is reaped.
//! - **Waiting is ordered.** A connection whose CQ is out of send room waits in the CQ's
//!   `waiting` list and is posted again as room frees, in order.

use std::collections::VecDeque;
use std::rc::Rc;

use smallvec::SmallVec;

use super::{build_completion, Core};
use crate::conn::Input;
use crate::error::{Error, Result};
use crate::flow::Imm;
use crate::op::{Completion, OpCode, OpError, WcStatus};
use crate::sys::verbs::{Cq, DeviceRef, WorkCompletion, POLL_BATCH};
use crate::token::Token;

/// The room of one CQ: pure counting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CqRoom {
    capacity: u32,
    /// Entries never committed to receives.
    send_floor: u32,
    recv_committed: u32,
    send_reserved: u32,
}

impl CqRoom {
    /// A CQ of `capacity` entries of which receives may never commit the last `send_floor`.
    pub(crate) fn new(capacity: u32, send_floor: u32) -> CqRoom {
        CqRoom { capacity, send_floor: send_floor.min(capacity), recv_committed: 0, send_reserved: 0 }
    }

    /// Commits `depth` entries to a new connection's receives, if they fit.
    pub(crate) fn admit(&mut self, depth: u32) -> bool {
        let fits = self.recv_committed + depth + self.send_floor.max(self.send_reserved) <= self.capacity;
        if fits {
            self.recv_committed += depth;
        }
        fits
    }

    /// Gives back a departed connection's receive entries.
    pub(crate) fn leave(&mut self, depth: u32) {
        self.recv_committed = self.recv_committed.saturating_sub(depth);
    }

    /// Reserves up to `n` entries for send-queue work; returns how many.
    pub(crate) fn reserve_send(&mut self, n: u32) -> u32 {
        let room = self.capacity - self.recv_committed - self.send_reserved;
        let k = n.min(room);
        self.send_reserved += k;
        k
    }

    /// Gives back `n` send-queue entries.
    pub(crate) fn release_send(&mut self, n: u32) {
        self.send_reserved = self.send_reserved.saturating_sub(n);
    }

    /// Entries that completions may occupy now: committed receives and reserved sends.
    pub(crate) fn reserved(&self) -> u32 {
        self.recv_committed + self.send_reserved
    }

    /// The CQ's entries.
    pub(crate) fn capacity(&self) -> u32 {
        self.capacity
    }

    /// True when no send may be posted.
    pub(crate) fn is_full(&self) -> bool {
        self.reserved() == self.capacity
    }
}

/// One CQ and its protocol state.
pub(super) struct CqEntry {
    pub(super) cq: Rc<Cq>,
    pub(super) armed: bool,
    pub(super) hot: bool,
    pub(super) evented: bool,
    pub(super) shared: bool,
    pub(super) room: CqRoom,
    /// Connections that could not post for lack of room, in order.
    pub(super) waiting: VecDeque<Token>,
}

impl Core {
    /// Creates a CQ of `entries` on device `d`, armed, and returns its token (also its
    /// context).
    pub(super) fn new_cq(&mut self, d: usize, dev: DeviceRef, entries: u32, shared: bool) -> Result<Token> {
        let chan = self.devices[d].chan.clone();
        let cq = Cq::new(dev, &chan, entries, 0, self.cfg.cq_ack_batch)
            .map_err(|e| Error::verb("ibv_create_cq", format!("{entries} entries"), e))?;
        cq.req_notify().map_err(|e| Error::verb("ibv_req_notify_cq", "new CQ", e))?;
        self.stats.cq_arms += 1;
        // The device may grant more entries than asked; account only for what was asked.
        let capacity = entries.min(cq.entries());
        let send_floor = if shared { capacity / 4 } else { self.cfg.send_depth.min(capacity) };
        let entry = CqEntry {
            cq,
            armed: true,
            hot: false,
            evented: false,
            shared,
            room: CqRoom::new(capacity, send_floor),
            waiting: VecDeque::new(),
        };
        let t = self.cqs.insert(entry);
        // The context names the entry; events are read later on this thread, never before.
        self.cqs.get(t).expect("inserted").cq.set_context(t.as_u64());
        Ok(t)
    }

    pub(super) fn drain_comp(&mut self, d: usize) -> usize {
        let Some(chan) = self.devices.get(d).map(|d| d.chan.clone()) else { return 0 };
        let mut n = 0;
        loop {
            let ev = match chan.get_event() {
                Ok(Some(ev)) => ev,
                Ok(None) => break,
                Err(e) if e.raw_os_error() == Some(nix::libc::EINTR) => continue,
                // EIO after device removal: nothing more will come on this channel.
                Err(_) => break,
            };
            n += 1;
            self.stats.cq_events += 1;
            let Some(t) = Token::from_u64(ev.context).filter(|t| self.cqs.contains(*t)) else {
                chan.ack_orphan(ev);
                continue;
            };
            let e = self.cqs.get_mut(t).expect("checked");
            e.cq.note_event();
            e.armed = false;
            if !e.evented {
                e.evented = true;
                self.evented.push(t);
            }
            if !e.hot {
                e.hot = true;
                self.hot.push(t);
            }
        }
        n
    }

    /// Polls every hot CQ under its budget.
    pub(super) fn poll_hot(&mut self) -> usize {
        let mut total = 0;
        for t in std::mem::take(&mut self.hot) {
            let Some(e) = self.cqs.get_mut(t) else { continue };
            e.hot = false;
            let found = self.poll_cq(t, self.cfg.poll_budget);
            if found == 0 {
                self.stats.spurious_cq_events += 1;
            }
            total += found;
        }
        total
    }

    /// Polls one CQ: batches of up to 32 until it is empty or `budget` completions were
    /// reaped. An empty CQ is re-armed and polled once more (the arm/poll race); a CQ that used
    /// its budget stays hot for the next tick.
    pub(super) fn poll_cq(&mut self, t: Token, budget: usize) -> usize {
        let Some(cq) = self.cqs.get(t).map(|e| e.cq.clone()) else { return 0 };
        let mut wcs = [WorkCompletion::default(); POLL_BATCH];
        let mut left = budget;
        let mut found = 0;
        loop {
            let want = left.min(POLL_BATCH);
            let n = cq.poll(&mut wcs[..want]).unwrap_or(0);
            self.stats.cq_polls += 1;
            for wc in &wcs[..n] {
                self.complete(t, *wc);
            }
            found += n;
            left -= n;
            let Some(e) = self.cqs.get_mut(t) else { break };
            if n < want {
                if !e.armed {
                    if e.cq.req_notify().is_ok() {
                        e.armed = true;
                    }
                    self.stats.cq_arms += 1;
                    continue;
                }
                break;
            }
            if left == 0 {
                self.stats.budget_exhausted += 1;
                if !e.hot {
                    e.hot = true;
                    self.hot.push(t);
                }
                break;
            }
        }
        self.wake_waiting(t);
        found
    }

    /// Marks the connections waiting for room on CQ `t` for posting again.
    fn wake_waiting(&mut self, t: Token) {
        let Some(e) = self.cqs.get_mut(t) else { return };
        if e.waiting.is_empty() || e.room.is_full() {
            return;
        }
        let waiting = std::mem::take(&mut e.waiting);
        for c in waiting {
            if let Some(conn) = self.conns.get_mut(c) {
                conn.waiting_room = false;
            }
            self.mark_dirty(c);
        }
    }

    /// One work completion reaped from CQ `ct`.
    fn complete(&mut self, ct: Token, wc: WorkCompletion) {
        self.stats.completions += 1;
        let op = Token::from_u64(wc.wr_id).and_then(|o| self.ops.get(o).map(|e| (o, e.conn, e.opcode)));
        let Some((ot, t, opcode)) = op else {
            self.stats.stale_completions += 1;
            return;
        };
        // Usually one operation, or a few unsignaled ones before it: no allocation per completion.
        let mut done: SmallVec<[(Token, WorkCompletion); 8]> = SmallVec::new();
        if opcode.on_send_queue() {
            // Unsignaled work requests posted before this one completed with it, in order.
            let Some(c) = self.conns.get_mut(t) else { return };
            while let Some(front) = c.sq.pop_front() {
                c.out_send = c.out_send.saturating_sub(1);
                if front == ot {
                    break;
                }
                done.push((front, WorkCompletion { wr_id: front.as_u64(), ..WorkCompletion::default() }));
            }
            if let Some(e) = self.cqs.get_mut(ct) {
                e.room.release_send(1 + done.len() as u32);
            }
        } else if let Some(c) = self.conns.get_mut(t) {
            c.out_recv = c.out_recv.saturating_sub(1);
        }
        done.push((ot, wc));
        for (ot, wc) in done {
            self.finish_op(t, ot, wc);
        }
        if wc.status != WcStatus::Success {
            self.feed(t, Input::WorkError(wc.status));
        } else if self.drained(t) {
            self.feed(t, Input::Drained);
        }
    }

    /// Delivers one finished operation (or handles it, for the runtime's own).
    fn finish_op(&mut self, t: Token, ot: Token, wc: WorkCompletion) {
        let Some(op) = self.ops.remove(ot) else { return };
        if op.control {
            // A credit-only send: nothing to deliver.
            return self.after_completion(t);
        }
        if op.opcode == OpCode::Recv && wc.status == WcStatus::Success {
            if let Some(flow) = self.conns.get_mut(t).and_then(|c| c.flow.as_mut()) {
                let imm = wc.imm.map(Imm::decode);
                if let Some(imm) = imm {
                    flow.on_receive(imm);
                }
                if imm.is_some_and(|i| i.control) {
                    // A credit-only message used this receive: post it again, unseen.
                    let mut again = op;
                    again.after_control = true;
                    let nt = self.ops.insert(again);
                    if let Some(c) = self.conns.get_mut(t) {
                        c.pending_recv.push_front(nt);
                    }
                    self.mark_dirty(t);
                    return;
                }
            }
        }
        let completion = build_completion(op, &wc);
        self.with_conn(t, |h, conn| h.on_completion(conn, completion));
        self.after_completion(t);
    }

    /// After a completion: post what waited for queue room or credit, or grant credits.
    fn after_completion(&mut self, t: Token) {
        let Some(c) = self.conns.get(t) else { return };
        let wants = !c.pending_send.is_empty()
            || !c.pending_recv.is_empty()
            || c.flow.as_ref().is_some_and(|f| f.wants_control());
        if wants {
            self.mark_dirty(t);
        }
    }

    /// Acks the events of every CQ whose count reached the batch threshold. A CQ below it
    /// stays listed; a destroyed CQ acked its own count.
    pub(super) fn flush_acks(&mut self) {
        let mut keep = Vec::new();
        for t in std::mem::take(&mut self.evented) {
            let Some(e) = self.cqs.get_mut(t) else { continue };
            let n = e.cq.ack_due();
            if n > 0 {
                self.stats.cq_ack_calls += 1;
                self.stats.cq_events_acked += u64::from(n);
            }
            if e.cq.unacked() > 0 {
                keep.push(t);
            } else {
                e.evented = false;
            }
        }
        self.evented = keep;
    }

    /// Completions for operations that will never complete on the device: their queue pair
    /// is destroyed and its CQ drained. Gives back their CQ reservations.
    pub(super) fn cancel_ops(&mut self, t: Token, ct: Option<Token>) -> Vec<Completion> {
        let mine: Vec<Token> =
            self.ops.tokens().into_iter().filter(|o| self.ops.get(*o).is_some_and(|e| e.conn == t)).collect();
        let mut out = Vec::new();
        for o in mine {
            let Some(op) = self.ops.remove(o) else { continue };
            if op.posted && op.opcode != OpCode::Recv {
                if let Some(e) = ct.and_then(|ct| self.cqs.get_mut(ct)) {
                    e.room.release_send(1);
                }
            }
            if op.control {
                continue;
            }
            out.push(Completion {
                user_data: op.user_data,
                opcode: op.opcode,
                result: Err(OpError::Cancelled),
                buf: op.buf,
                remote_write: false,
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::CqRoom;

    #[test]
    fn admission_keeps_the_send_floor() {
        let mut r = CqRoom::new(16, 4);
        assert!(r.admit(8));
        assert!(r.admit(4));
        assert!(!r.admit(1), "the last 4 entries are for sends");
        assert_eq!(r.reserve_send(10), 4);
        assert!(r.is_full());
        r.leave(8);
        assert!(r.admit(3));
        assert_eq!(r.reserved(), 4 + 3 + 4);
        assert_eq!(r.capacity(), 16);
    }

    #[test]
    fn sends_never_exceed_what_receives_leave() {
        let mut r = CqRoom::new(100, 25);
        assert!(r.admit(75));
        assert_eq!(r.reserve_send(1000), 25);
        assert_eq!(r.reserve_send(1), 0);
        r.release_send(5);
        assert_eq!(r.reserve_send(1000), 5);
    }

    #[test]
    fn many_connections_sharing_one_cq_never_overrun_it() {
        // 200 connections of 3 receives each, each wanting 8 sends in flight, on a 1024-entry
        // CQ: a random interleaving of posts and completions never reserves more than 1024,
        // and every send gets to go eventually.
        let mut r = CqRoom::new(1024, 256);
        for _ in 0..200 {
            assert!(r.admit(3));
        }
        let mut want = vec![8u32; 200];
        let mut posted = vec![0u32; 200];
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut waited = 0;
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let i = (x % 200) as usize;
            if (x >> 20) % 2 == 0 {
                let k = r.reserve_send(want[i]);
                if k < want[i] {
                    waited += 1;
                }
                want[i] -= k;
                posted[i] += k;
            } else if posted[i] > 0 {
                posted[i] -= 1;
                r.release_send(1);
            }
            assert!(r.reserved() <= 1024);
        }
        assert!(waited > 0, "the test must exceed the room to mean anything");
        assert!(want.iter().all(|w| *w == 0), "every send got to go");
    }
}
