//! Teardown: closing, destroying what closed at the end of the tick, cancelling what never
//! completed, and shutting the whole reactor down.
//!
//! A connection is destroyed in rdma-core's order (`destroy_conn`), once no helper thread makes
//! its `rdma_connect` any more (`connect.rs`):
//! 1. its memory windows (`Conn::expose`), the queue pair and the id (`rdma_destroy_qp`,
//!    `rdma_destroy_id`; the tick's CM events are all acked);
//! 2. its CQ is drained, so every completion it produced reaches its handler (a shared CQ
//!    delivers other connections' completions too);
//! 3. operations that never completed are cancelled (their buffers are safe to hand back: the
//!    queue pair is gone) and their CQ room given back;
//! 4. its own CQ, if it has one, is destroyed (counted events acked first);
//! 5. its timers are cancelled, then the handler hears the cancelled completions and
//!    `on_closed`.

use std::time::{Duration, Instant};

use crate::proto::conn::{CloseReason, Input, ListenerAction, State};
use crate::proto::token::{ConnKey, CqKey, Key, ListenerKey, Token};
use crate::reactor::Completion;
use crate::reactor::{Conn, Core, Ctx, Endpoint};
use crate::sys::cm::CmId;

/// What closed during the tick and is destroyed at its end (step 8), once every CM event of the
/// tick has been acked.
#[derive(Default)]
pub(in crate::reactor) struct Closing {
    /// Connections closed (drained or not), reaped at the end of the tick.
    pub(in crate::reactor) conns: Vec<ConnKey>,
    /// Listeners closed, destroyed at the end of the tick.
    pub(in crate::reactor) listeners: Vec<ListenerKey>,
    /// Ids of rejected connect requests, destroyed at the end of the tick.
    pub(in crate::reactor) rejected: Vec<CmId>,
}

impl Core {
    /// Closes a connection (through its state machine) or a listener; a stale token is ignored.
    pub(crate) fn close(&mut self, t: Token) {
        if let Some(k) = self.conns.key_of(t) {
            if let Some(r) = self.conns.get_mut(k).and_then(|c| c.redial.as_mut()) {
                // Also when it is already closing for a failure: no further attempt.
                r.stopped = true;
            }
            let input = self.close_input(k, CloseReason::Local);
            self.feed(k, input);
        } else if let Some(k) = self.listeners.key_of(t) {
            self.close_listener(k, CloseReason::Local);
        }
    }

    /// How a connection is told to close for `reason` (`Local` or `Shutdown`): with the close
    /// handshake when it negotiated one (`Lanes::farewell`), else at once.
    fn close_input(&self, k: ConnKey, reason: CloseReason) -> Input {
        match self.conns.get(k) {
            Some(c) if c.lanes.farewell() => Input::Finish(reason),
            _ if reason == CloseReason::Shutdown => Input::Shutdown,
            _ => Input::Close,
        }
    }

    pub(in crate::reactor) fn close_listener(&mut self, t: ListenerKey, reason: CloseReason) {
        let Some(l) = self.listeners.get_mut(t) else { return };
        if let ListenerAction::Closed(reason) = l.sm.close_for(reason) {
            l.close_reason = Some(reason);
            self.closing.listeners.push(t);
        }
    }

    /// Destroys what closed during the tick. Returns the number of objects destroyed.
    pub(in crate::reactor) fn reap(&mut self) -> usize {
        let idle = self.closing.conns.is_empty()
            && self.closing.listeners.is_empty()
            && self.closing.rejected.is_empty()
            && self.devices.lost.is_empty();
        if idle {
            // Nothing closed, rejected or lost: every tick, spinning ones included, ends here.
            return 0;
        }
        let mut n = 0;
        loop {
            let conns = std::mem::take(&mut self.closing.conns);
            let listeners = std::mem::take(&mut self.closing.listeners);
            if conns.is_empty() && listeners.is_empty() {
                break;
            }
            for t in conns {
                n += 1;
                self.destroy_conn(t);
            }
            for t in listeners {
                n += 1;
                self.destroy_listener(t);
            }
        }
        self.closing.rejected.clear();
        if n > 0 {
            for d in self.devices.iter() {
                d.pool.trim();
                // A ring cluster registered for a moment's excess (a connection refused after
                // its ring was taken, closing ones not yet destroyed) goes once empty.
                if let Some(tails) = d.tails.as_ref() {
                    tails.trim();
                }
            }
            self.reap_retired_cqs();
        }
        if !self.devices.lost.is_empty() {
            self.release_lost_devices();
        }
        n
    }

    /// Destroys one closed connection, in the order the module docs give.
    fn destroy_conn(&mut self, t: ConnKey) {
        self.calls.forget(t);
        let Some(c) = self.conns.get_mut(t) else { return };
        if c.ep.is_connecting() {
            // A helper thread still makes its `rdma_connect` with the id: destroyed when the
            // call has returned (`Core::finish_call` queues it again, `connect.rs`).
            return;
        }
        let (cq, on_srq) = c.cqs();
        let recv_room = c.placed.map_or(0, |p| p.recv_room);
        let qp_num = c.ep.qp().map(|q| q.qp_num());
        let share = c.srq_share.map_or(0, |s| s.receives);
        c.windows.release();
        drop(std::mem::replace(&mut c.ep, Endpoint::None));
        self.reap_conn_cqs(cq, on_srq);
        if let Some(s) = on_srq.and_then(|d| self.devices.get_mut(d)).and_then(|x| x.srq.as_mut()) {
            // Its queue pair is gone and its CQs drained: no completion names it any more.
            if let Some(n) = qp_num {
                s.qps.remove(n);
            }
            s.budget.leave(share);
        }
        if let Some(d) = on_srq {
            // The receives it withheld are counted in the share just left: posted again.
            self.srq_leave_withheld(d, t);
        }
        // A client with a reconnect policy may try again instead (`reconnect.rs`); asked after
        // the reap above, whose completions may have made its handler close it.
        let shutting_down = self.shutting_down;
        let again = self.conns.get_mut(t).and_then(|c| {
            let reason = c.close_reason.clone().unwrap_or(CloseReason::Local);
            c.redial.as_mut().filter(|_| !shutting_down).and_then(|r| r.failed(&reason))
        });
        // A wait the clock cannot count to would schedule no attempt and leave the client
        // waiting for ever, without `on_closed`: it gives up instead and closes with the
        // reason. (`Reconnect::check` bounds the policy's waits, so this is a backstop.)
        let again = again.filter(|&(_, delay)| self.read_clock().checked_add(delay).is_some());
        let completions = self.cancel_ops(t, cq, again.is_some());
        if let Some((attempt, delay)) = again {
            self.wait_to_redial(t, attempt, delay, completions);
            return;
        }
        // Its reservation goes; what its buffers still hold (an application may keep one)
        // counts as borrowed until dropped.
        self.release_account(t);
        let Some(mut c) = self.conns.remove(t) else { return };
        if matches!(c.role.state(), State::Accepting) {
            // Destroyed without leaving the state (a forced close at the end of a shutdown).
            self.accepting = self.accepting.saturating_sub(1);
        }
        self.stats.closed += 1;
        event!(info, "{:?}: closed: {}{}", t.token(), c.close_reason.as_ref().unwrap_or(&CloseReason::Local), {
            let m = c.meter.snapshot(std::time::Instant::now());
            format!(
                " ({} messages and {} bytes sent, {} and {} received, {} errors)",
                m.sends, m.send_bytes, m.recvs, m.recv_bytes, m.errors
            )
        });
        for k in c.timers.drain(..) {
            self.user_timers.remove(k);
        }
        let reason = c.close_reason.take().unwrap_or(CloseReason::Local);
        let mut handler = c.handler.take();
        if self.handlers_running.is_running(t) {
            // Destroyed while a callback of its own runs (the reap runs at the end of the
            // tick, outside every callback, so this is a safeguard, and no panic here: the
            // handler's frames are below this one): its handler is in use, so it hears nothing
            // more and is dropped once no call runs (`Running::park`).
            event!(error, "{:?}: destroyed inside its own callback: its handler hears nothing more", t.token());
            if let Some(h) = handler.take() {
                self.handlers_running.park(h);
            }
        }
        self.release_conn_cq(t, cq, recv_room);
        drop(c);
        if let Some(mut h) = handler {
            // Each call catches its own panic (resumed at the end of the tick), so every
            // completion and `on_closed` are delivered.
            for completion in completions {
                self.deliver(|core| h.on_completion(&mut Conn::new(core, t), completion));
            }
            self.deliver(|core| h.on_closed(&mut Ctx::new(core, None), t.token(), reason));
        }
    }

    /// Step 4: a closed connection `t` gives up its CQ `cq`: the room committed for its
    /// receives (`recv_room`) and its place in the CQ's waiting list; its own CQ is destroyed.
    pub(in crate::reactor) fn release_conn_cq(&mut self, t: ConnKey, cq: Option<CqKey>, recv_room: u32) {
        let Some(cq) = cq else { return };
        let Some(e) = self.cqs.get_mut(cq) else { return };
        e.waiting.retain(|w| *w != t);
        // Exactly the room committed for its receives when it was placed (none on the SRQ,
        // `data/srq/mod.rs`), not the receive capacity the device granted, which may be less.
        e.room.leave(recv_room);
        if e.shared {
            // Its receive entries, and the sends cancelled before, are free again: a
            // connection waiting for room must not wait for a poll that may never come.
            self.wake_waiting(cq);
        } else {
            // Drop acks the counted events (counted in `remove_cq`), then ibv_destroy_cq.
            self.remove_cq(cq);
        }
    }

    fn destroy_listener(&mut self, t: ListenerKey) {
        let Some(mut l) = self.listeners.remove(t) else { return };
        self.user_timers.retain(|timer| timer.owner != t.token());
        let reason = l.close_reason.take().unwrap_or(CloseReason::Local);
        drop(l.id.take());
        if let Some(mut h) = l.handler.take() {
            self.deliver(|core| h.on_closed(&mut Ctx::new(core, None), reason));
        }
    }

    /// Polls a connection's CQ (`cq`) and, on a shared receive queue (of device `on_srq`), the
    /// SRQ's CQ until they are empty: every completion they hold reaches its handler.
    pub(in crate::reactor) fn reap_conn_cqs(&mut self, cq: Option<CqKey>, on_srq: Option<usize>) {
        if let Some(cq) = cq {
            self.poll_cq(cq, usize::MAX);
        }
        if let Some(rcq) = on_srq.and_then(|d| self.devices.get(d)).and_then(|x| x.srq.as_ref()).map(|s| s.cq) {
            // Its receive completions are on the SRQ's CQ: they reach its handler too.
            self.poll_cq(rcq, usize::MAX);
        }
    }

    /// Completions for a connection's operations that will never complete on the device: its
    /// queue pair is destroyed and its CQ drained. Gives back their CQ reservations. Costs the
    /// connection's own operations, not every live one: its queues hold them all. With
    /// `carry` (a reconnection, `reconnect.rs`) the ones never posted that a new queue pair
    /// can take (SENDs and receives) stay queued. Each completes once, with
    /// `lanes::teardown_error`: posted, `Unconfirmed` (a receive on an iWARP queue pair whose
    /// stream ended: flushed); never posted, `Cancelled`. The lanes' sends first, then their
    /// receives (each lane: the posted ones, then, receives, the side list, then the queued
    /// ones); the runtime's own complete to no one.
    pub(in crate::reactor) fn cancel_ops(&mut self, t: ConnKey, cq: Option<CqKey>, carry: bool) -> Vec<Completion> {
        let Some(c) = self.conns.get_mut(t) else { return Vec::new() };
        let room = cq.and_then(|cq| self.cqs.get_mut(cq)).map(|e| &mut e.room);
        let stream_closed = c.stream_closed;
        let cleared = if carry {
            // The sends and receives queued stay (sends: not the runtime's own, and naming no
            // remote key of the old peer), the side list first among the receives. The lanes
            // keep their name (the connection's epoch, `Lanes::epoch`) until the next queue
            // pair's `setup_qp` renames them: one epoch a queue pair. Meanwhile a late
            // completion of the old queue pair names the live epoch but no position in the
            // posted windows, which the carry emptied (nothing can be posted without a queue
            // pair): counted stale.
            let epoch = c.lanes.epoch();
            c.lanes.carry(room, epoch, |s| !s.is_control() && !s.is_one_sided())
        } else {
            c.lanes.clear(room)
        };
        cleared.into_cancelled(stream_closed).into_iter().map(Completion::from).collect()
    }

    /// Our disconnect of `t` got no DISCONNECTED before its deadline or a shutdown's grace ran
    /// out: counted and said. Its id goes next, and with it the kernel's retransmissions of the
    /// DREQ (`Timeouts::disconnect`).
    #[cfg_attr(not(feature = "log"), allow(unused_variables))] // `t` names it in the log only.
    pub(in crate::reactor) fn disconnect_unanswered(&mut self, t: ConnKey) {
        self.stats.disconnects_unanswered += 1;
        event!(
            info,
            "{:?}: our disconnect unanswered (its deadline or a shutdown's grace ran out): the peer may not have heard it",
            t.token()
        );
    }

    /// See [`Reactor::shutdown`](crate::reactor::Reactor::shutdown).
    pub(in crate::reactor) fn shutdown(&mut self, grace: Duration) {
        self.shutting_down = true;
        self.refuse_waiting("the server is shutting down");
        for t in self.listeners.keys() {
            self.close_listener(t, CloseReason::Shutdown);
        }
        for t in self.conns.keys() {
            let input = self.close_input(t, CloseReason::Shutdown);
            self.feed(t, input);
        }
        // Let connections close cleanly: DISCONNECTED, flushes, drain.
        let deadline = Instant::now().checked_add(grace);
        while self.conns.len() > 0 || !self.closing.listeners.is_empty() {
            let left = deadline.map_or(grace, |d| d.saturating_duration_since(Instant::now()));
            if left.is_zero() || self.tick(Some(left)).is_err() {
                break;
            }
        }
        // Close the rest at once, once every `rdma_connect` on a helper thread has returned
        // (`connect.rs`: nothing safe ends one early).
        self.finish_all_calls();
        for t in self.conns.keys() {
            if let Some(c) = self.conns.get_mut(t) {
                c.close_reason.get_or_insert(CloseReason::Shutdown);
                if matches!(c.role.state(), State::Disconnecting(_)) {
                    self.disconnect_unanswered(t);
                }
            }
            self.destroy_conn(t);
        }
        self.reap();
        self.user_timers.retain(|_| false);
        self.shutting_down = false;
    }
}
