//! Submission and posting. Operations queue per connection during a tick and go to the device
//! at the end of it, one chain per queue pair and direction (one doorbell each). What may go
//! is planned by the connection's lanes ([`Lanes::plan_sends`] and [`Lanes::plan_recvs`], which
//! write their work requests in place; issue 47 phase 2); this file checks submissions and
//! does the FFI step.
//!
//! **Why `unsafe` here, outside `src/sys/`.** The two posts (`Qp::post_recv_run`,
//! `Qp::post_send_run`) are `src/sys/`'s, and unsafe because the device reads or writes the
//! memory each request names until its completion: only the data path knows who holds that
//! memory (the slots on the connection's lanes), so the caller states it, in the SAFETY comment
//! at each call.
//!
//! [`Lanes::plan_sends`]: crate::reactor::data::lanes::Lanes::plan_sends
//! [`Lanes::plan_recvs`]: crate::reactor::data::lanes::Lanes::plan_recvs

use crate::error::Error;
use crate::proto::conn::{CloseReason, Input, State};
use crate::proto::op::{OpCode, OpError, WcStatus};
use crate::proto::token::{ConnKey, CqKey, GenSlab, Key};
use crate::reactor::conn::entry::ConnEntry;
use crate::reactor::data::cq::CqEntry;
use crate::reactor::data::gate::{Gate, Refusal};
use crate::reactor::data::lanes::Slot;
use crate::reactor::data::op::Body;
use crate::reactor::Op;
use crate::reactor::{Completion, Config, Core, Placement, Stats, SubmitError};
use crate::sys::pool::Buf;
use std::time::Duration;
#[cfg(feature = "bench-internals")]
use {
    crate::proto::flow::{Farewell, Imm},
    crate::proto::token::OpKey,
    crate::proto::transport::{Tail, TAIL_LEN},
    crate::reactor::data::op::OpEntry,
    crate::reactor::data::send_queue::Planned,
    crate::reactor::TailRing,
    crate::sys::qp::{SendOp, SendWr},
};

/// What posting a connection's operations borrows of the core beside the connection itself,
/// so that a flush looks the connection up once (issue 33): built by `posting!`.
struct Posting<'a> {
    cqs: &'a mut GenSlab<CqKey, CqEntry>,
    stats: &'a mut Stats,
    cfg: &'a Config,
    /// `Reactor::inject_refused_send`.
    #[cfg(feature = "fault-injection")]
    refuse_send: &'a mut Option<usize>,
    /// `Reactor::inject_refused_recv`.
    #[cfg(feature = "fault-injection")]
    refuse_recv: &'a mut Option<u32>,
}

/// The [`Posting`] of a core: its fields borrowed apart, beside a connection borrowed from
/// `conns`.
macro_rules! posting {
    ($core:expr) => {
        Posting {
            cqs: &mut $core.cqs,
            stats: &mut $core.stats,
            cfg: &$core.cfg,
            #[cfg(feature = "fault-injection")]
            refuse_send: &mut $core.faults.refuse_send,
            #[cfg(feature = "fault-injection")]
            refuse_recv: &mut $core.faults.refuse_recv,
        }
    };
}

/// What is left to do after [`Posting::post_sends`], with the whole core.
enum AfterSends {
    /// Nothing.
    Done,
    /// Start the connection's credit-stall timer (`Config::credit_timeout`), this long.
    Stall(Duration),
    /// The device refused these requests (with this errno): fail them, then wait for CQ room
    /// if the plan was short of it and watch the credits.
    Refused { failed: Vec<Slot<Buf>>, errno: i32, short_of_room: bool },
}

/// True when the application may not post receives on this connection: it takes its receives
/// from a shared receive queue (`on_srq`: it holds a share of one), or the reactor has one
/// (`srq_mode`: `Config::srq`), where every connection does. The second covers a client waiting
/// to reconnect (`conn/reconnect.rs`), which holds no share until its new queue pair: a receive
/// accepted then was carried to that queue pair, which has no receive queue of its own (its
/// receive lane's capacity 0), so it was never posted and completed only at close (review L3).
fn runtime_posts_receives(srq_mode: bool, on_srq: bool) -> bool {
    srq_mode || on_srq
}

/// An operation's opcode and the pool bytes it holds while it waits (what the backlog counts),
/// for `crate::bench_internals`.
#[cfg(feature = "bench-internals")]
pub(crate) fn queue_shape(op: &Op) -> (OpCode, usize) {
    let pool_len = match &op.body {
        Body::Send(b) | Body::Write(b, _) | Body::WriteImm(b, _) => b.len(),
        Body::Read(_, r) => r.len as usize,
        _ => 0,
    };
    (op.opcode(), pool_len)
}

/// The gate of connection `c` as its state is now (`data/gate.rs`): what `Core::submit` checks
/// an operation against. `ConnEntry::gate` keeps it, recomputed where what it reads changes
/// (`ConnEntry::refresh_gate`); a connection waiting to reconnect is checked against one made
/// at the submission (no immediate data is asked of its next device: its one-sided operations
/// are refused anyway).
pub(in crate::reactor) fn gate_of(c: &ConnEntry, cfg: &Config) -> Gate {
    Gate::new(
        true,
        runtime_posts_receives(cfg.srq.is_some(), c.srq_share.is_some()),
        c.placed.is_some_and(|p| p.tail),
        c.infos.peer.as_ref().map(|i| i.msg_size),
        c.infos.local.msg_size,
        cfg.send_backlog,
        cfg.send_backlog_bytes,
    )
}

/// An RDMA WRITE or READ whose length passes its own bound (`len` against `max`, named by
/// `limit`).
#[inline(always)]
fn within(len: usize, max: usize, limit: &'static str) -> Result<(), Error> {
    if len > max {
        return Err(Error::TooLarge { len, max, limit });
    }
    Ok(())
}

impl Core {
    /// Queues an operation on a connection after checking it; it is posted at the end of the
    /// tick. `raw` operations are accepted only here, for `Conn::submit_raw`.
    ///
    /// The checks are the connection's gate (`data/gate.rs`: receives refused on a shared
    /// receive queue, no immediate data on iWARP, the message size both sides announced, the
    /// send backlog), read from `ConnEntry::gate` on an established connection (one look-up,
    /// a few compares), then the operation's own bounds (a WRITE's remote slice, a READ's
    /// target) and the cold cases (a region's first registration on the device, an iWARP
    /// READ's sink). A connection without a queue pair takes the slow path, which says why, or
    /// (reconnecting) checks a two-sided operation against its last device and peer.
    pub(crate) fn submit(&mut self, t: ConnKey, op: Op) -> std::result::Result<(), SubmitError> {
        // Looked up once for all of it (issue 33).
        let Some(c) = self.conns.get_mut(t) else {
            return Err(SubmitError::new(Error::StaleToken(t.token().as_u64()), op));
        };
        let (device, gate) = match c.placed {
            Some(p) if c.can_submit() => {
                debug_assert_eq!(c.gate, gate_of(c, &self.cfg), "{:?}: a gate not refreshed", t.token());
                (p.device, c.gate)
            }
            _ => match c.waiting_device(&self.devices) {
                // Reconnecting (`conn/reconnect.rs`): a two-sided operation waits for the new
                // queue pair; it is checked against the last one's device and peer.
                Some(Ok(device)) if !op.body.one_sided() => (device, gate_of(c, &self.cfg)),
                // ... unless that device was removed (and released): nothing to check it
                // against, and its buffers could never go on the new queue pair.
                Some(Err(e)) if !op.body.one_sided() => return Err(SubmitError::new(e, op)),
                Some(_) => {
                    let what = format!(
                        "connection {:?} is reconnecting: a one-sided operation names the old peer's remote keys, \
                         which are invalid on the new connection (submit it after on_reconnected, with the new ones)",
                        t.token()
                    );
                    return Err(SubmitError::new(Error::NotConnected(what), op));
                }
                None => {
                    let what = format!("connection {:?} is {:?}", t.token(), c.role.state());
                    return Err(SubmitError::new(Error::NotConnected(what), op));
                }
            },
        };
        let pool = &self.devices[device].pool;
        // The checks, in one match on the body (issue 33: a match each was about 30
        // instructions a submission): the pool's ownership of a buffer, then the gate's,
        // then the operation's own bounds; each refusal gives the operation back.
        let (lanes, token) = (&c.lanes, t.token());
        let backlog = |pool_len: usize| {
            let (queued, bytes) = lanes.backlog();
            gate.backlog(queued, lanes.free_slots(), bytes, pool_len)
        };
        let owned = |b: &Buf| {
            if pool.owns(b) {
                Ok(())
            } else {
                Err(Error::Config("the buffer belongs to another device's pool".into()))
            }
        };
        let checked: Result<(), Error> = (|| {
            let refused = |r: Refusal| r.into_error(token);
            match &op.body {
                Body::Recv(b) => {
                    owned(b)?;
                    gate.recv().map_err(refused)
                }
                Body::RawRecv(_) | Body::RecvRegion(_) => gate.recv().map_err(refused),
                Body::Send(b) => {
                    owned(b)?;
                    gate.message(b.len()).map_err(refused)?;
                    backlog(b.len()).map_err(refused)
                }
                Body::RawSend(r) => {
                    gate.message(r.len as usize).map_err(refused)?;
                    backlog(0).map_err(refused)
                }
                Body::SendRegion(s) => {
                    gate.message(s.len()).map_err(refused)?;
                    backlog(0).map_err(refused)
                }
                Body::Write(b, r) | Body::WriteImm(b, r) => {
                    owned(b)?;
                    gate.one_sided(matches!(op.body, Body::WriteImm(..))).map_err(refused)?;
                    within(b.len(), r.len as usize, "the peer's exposed length")?;
                    backlog(b.len()).map_err(refused)
                }
                Body::Read(b, r) => {
                    owned(b)?;
                    gate.one_sided(false).map_err(refused)?;
                    within(r.len as usize, b.capacity(), "the local buffer's capacity")?;
                    backlog(r.len as usize).map_err(refused)
                }
                Body::WriteRegion(s, r) => {
                    gate.one_sided(false).map_err(refused)?;
                    within(s.len(), r.len as usize, "the peer's exposed length")?;
                    backlog(0).map_err(refused)
                }
                Body::ReadRegion(s, r) => {
                    gate.one_sided(false).map_err(refused)?;
                    within(r.len as usize, s.len(), "the local region slice's length")?;
                    backlog(0).map_err(refused)
                }
            }
        })();
        if let Err(e) = checked {
            if matches!(e, Error::Limit { .. }) {
                self.stats.backlog_refusals += 1;
            }
            return Err(SubmitError::new(e, op));
        }
        // A region is registered on this device at its first operation here (cold).
        let lkey = match op.body.region().map(|s| s.region().lkey(&self.devices[device].pd)) {
            None => 0,
            Some(Ok(lkey)) => lkey,
            Some(Err(e)) => return Err(SubmitError::new(e, op)),
        };
        // On iWARP a READ's sink takes a registration of its own with remote write
        // (`Slot::with_sink`).
        let sink = if self.devices[device].caps.tail() {
            match crate::reactor::data::op::read_sink(&op, &self.devices[device].pd) {
                Ok(m) => m,
                Err(e) => return Err(SubmitError::new(e, op)),
            }
        } else {
            None
        };
        // On the connection's lanes, made in its slot (issue 47): the owner marks (every byte
        // of the chunk the connection is not given is foreign to it, `sys/pool/mod.rs`) and
        // the scatter entry are set there, after every check.
        let (owner, Op { body, user_data }) = (c.mem_owner, op);
        let with_sink = |slot: Slot<Buf>| match sink {
            Some(mr) => slot.with_sink(mr),
            None => slot,
        };
        let lanes = &mut c.lanes;
        match body {
            Body::Send(buf) => lanes.submit_send_with(|| Slot::send_on(buf, owner, user_data)),
            Body::Recv(buf) => lanes.submit_recv_with(|| Slot::recv_on(buf, owner, user_data)),
            Body::RecvRegion(s) => lanes.submit_recv(Slot::region(OpCode::Recv, s, lkey, None, user_data)),
            Body::RawRecv(raw) => lanes.submit_recv(Slot::raw(OpCode::Recv, raw, user_data)),
            Body::Write(buf, r) => {
                buf.set_owner(owner, buf.len());
                lanes.submit_send(Slot::write(buf, r, false, user_data))
            }
            Body::WriteImm(buf, r) => {
                buf.set_owner(owner, buf.len());
                lanes.submit_send(Slot::write(buf, r, true, user_data))
            }
            Body::Read(buf, r) => {
                // The device overwrites what it reads into: none of it is given.
                buf.set_owner(owner, 0);
                lanes.submit_send(with_sink(Slot::read(buf, r, user_data)))
            }
            Body::RawSend(raw) => lanes.submit_send(Slot::raw(OpCode::Send, raw, user_data)),
            Body::SendRegion(s) => lanes.submit_send(Slot::region(OpCode::Send, s, lkey, None, user_data)),
            Body::WriteRegion(s, r) => lanes.submit_send(Slot::region(OpCode::Write, s, lkey, Some(r), user_data)),
            Body::ReadRegion(s, r) => {
                lanes.submit_send(with_sink(Slot::region(OpCode::Read, s, lkey, Some(r), user_data)))
            }
        }
        list_dirty(c, t, &mut self.work.dirty);
        Ok(())
    }

    /// Connection `t`'s keepalive probe is due (`Config::keepalive`): queues one and schedules
    /// the next. Returns 1 when one was queued.
    pub(in crate::reactor) fn keepalive(&mut self, t: ConnKey, key: u64) -> usize {
        let Some(interval) = self.cfg.keepalive else { return 0 };
        // The key: a reconnected client's probes are the new queue pair's, not the old one's.
        let live = |c: &&crate::reactor::ConnEntry| c.role.state().is_established() && c.keepalive == Some(key);
        let Some(c) = self.conns.get(t).filter(live) else { return 0 };
        if c.placed.and_then(|p| self.devices.get(p.device)).is_some_and(|d| d.port_down) {
            // Through a downed port a probe fails at once: wait for the port (device.rs).
            self.schedule_keepalive(t, interval);
            return 0;
        }
        if c.lanes.backlog().0 > 0 {
            // Something waits to be posted already (for credits, or room): it will show the
            // queue pair's health when it goes, and a probe queued behind it would not go
            // before it. One probe per interval would pile up for as long as it waits.
            self.schedule_keepalive(t, interval);
            return 0;
        }
        self.conns.get_mut(t).expect("checked").lanes.submit_send(Slot::probe());
        self.mark_dirty(t);
        self.stats.keepalives += 1;
        self.schedule_keepalive(t, interval);
        1
    }

    /// Connection `t`'s nudge timer `key` fired (an iWARP client, `proto::transport::NUDGES`):
    /// unless its server was heard from, or a nudge still waits to go, queues a zero-length
    /// RDMA WRITE ahead of everything and schedules the next nudge. Returns 1 when one was
    /// queued.
    pub(in crate::reactor) fn nudge(&mut self, t: ConnKey, key: u64) -> usize {
        let Some(c) = self.conns.get_mut(t) else { return 0 };
        let Some((_, i, before)) = c.nudge.filter(|&(k, _, _)| k == key) else { return 0 };
        c.nudge = None;
        if !c.role.state().is_established() || c.meter.heard() > before {
            return 0;
        }
        let queued = c.lanes.nudge();
        if queued {
            self.stats.iwarp_nudges += 1;
            self.mark_dirty(t);
        }
        self.schedule_nudge(t, i + 1, before);
        usize::from(queued)
    }

    /// Schedules connection `t`'s nudge `i` (`proto::transport::NUDGES`), if there is one;
    /// `before` is what it had heard from its peer at ESTABLISHED (`ConnMeter::heard`).
    pub(in crate::reactor) fn schedule_nudge(&mut self, t: ConnKey, i: usize, before: u64) {
        let Some(&wait) = crate::proto::transport::NUDGES.get(i) else { return };
        if let Some(at) = self.read_clock().checked_add(wait) {
            let key = self.timers.schedule(at, crate::reactor::event_loop::timers::TimerTarget::Nudge(t));
            if let Some(c) = self.conns.get_mut(t) {
                c.nudge = Some((key, i, before));
            }
        }
    }

    pub(in crate::reactor) fn schedule_keepalive(&mut self, t: ConnKey, interval: std::time::Duration) {
        if let Some(at) = self.read_clock().checked_add(interval) {
            let key = self.timers.schedule(at, crate::reactor::event_loop::timers::TimerTarget::Keepalive(t));
            if let Some(c) = self.conns.get_mut(t) {
                c.keepalive = Some(key);
            }
        }
    }

    pub(in crate::reactor) fn mark_dirty(&mut self, t: ConnKey) {
        if let Some(c) = self.conns.get_mut(t) {
            list_dirty(c, t, &mut self.work.dirty);
        }
    }

    pub(in crate::reactor) fn flush_posts(&mut self) {
        // The shared receive queues first: a credit granted below is never ahead of the
        // receive it stands for (`srq/mod.rs`).
        self.post_srqs();
        if self.work.dirty.is_empty() {
            return;
        }
        let mut dirty = self.work.dirty.take();
        for t in dirty.drain(..) {
            self.flush_conn(t);
        }
        self.work.dirty.give_back(dirty);
    }

    /// Posts a connection's queued operations, as many as may go now. On the usual path the
    /// connection is looked up once for all of it (issue 33: five times before); after a post
    /// the device refused, handlers run, and what follows looks everything up again.
    pub(in crate::reactor) fn flush_conn(&mut self, t: ConnKey) {
        let Some(c) = self.conns.get_mut(t) else { return };
        c.dirty = false;
        let Some(placed) = c.placed.filter(|_| c.can_post()) else { return };
        if let Some((failed, errno)) = posting!(self).post_recvs(c) {
            let failed = failed.into_iter().map(|s| s.into_done(Err(OpError::Post(errno)), false).into()).collect();
            self.fail_unposted_done(t, failed);
            // Its handlers ran: the connection, its queue pair and its placement are read
            // again, not taken from before them.
            let again = self.conns.get(t).filter(|c| c.can_post() && c.role.state().is_connected());
            if let Some(placed) = again.and_then(|c| c.placed) {
                self.post_sends(t, placed);
            }
            return;
        }
        // Saying goodbye, the farewell (and credit-only messages) still go (`Lanes::plan_sends`).
        if c.role.state().is_connected() {
            let next = posting!(self).post_sends(t, c, placed);
            self.after_sends(t, placed, next);
        }
    }

    /// Posts connection `t`'s sends, looking it up (after a refused receive post's handlers).
    fn post_sends(&mut self, t: ConnKey, placed: Placement) {
        let Some(c) = self.conns.get_mut(t) else { return };
        let next = posting!(self).post_sends(t, c, placed);
        self.after_sends(t, placed, next);
    }

    /// What follows a send post that needs the whole core: a credit-stall timer to start, or
    /// the requests the device refused to fail (which runs handlers).
    fn after_sends(&mut self, t: ConnKey, placed: Placement, next: AfterSends) {
        match next {
            AfterSends::Done => {}
            AfterSends::Stall(limit) => self.start_stall_timer(t, limit),
            AfterSends::Refused { failed, errno, short_of_room } => {
                self.fail_unposted(t, failed, errno);
                // The refused requests gave their CQ room back.
                self.wake_waiting(placed.cq);
                if short_of_room {
                    self.wait_for_room(t, placed);
                }
                self.watch_credits(t);
            }
        }
    }

    fn wait_for_room(&mut self, t: ConnKey, placed: Placement) {
        self.stats.cq_room_waits += 1;
        let Some(c) = self.conns.get_mut(t) else { return };
        list_waiting_room(c, t, self.cqs.get_mut(placed.cq).map(|e| &mut e.waiting));
    }

    /// [`credit_watch`] for connection `t`, looked up.
    fn watch_credits(&mut self, t: ConnKey) {
        let Some(c) = self.conns.get_mut(t) else { return };
        if let Some(limit) = credit_watch(c, &self.cfg) {
            self.start_stall_timer(t, limit);
        }
    }

    /// Starts connection `t`'s credit-stall timer, `limit` from now.
    fn start_stall_timer(&mut self, t: ConnKey, limit: Duration) {
        if let Some(at) = self.read_clock().checked_add(limit) {
            let key = self.timers.schedule(at, crate::reactor::event_loop::timers::TimerTarget::Stall(t));
            if let Some(c) = self.conns.get_mut(t) {
                c.stall = Some(key);
            }
        }
    }

    /// Connection `t`'s credit-stall timer `key` fired: if it is still the connection's and its
    /// next send still waits for credits, the connection closes with `CloseReason::Stalled`.
    /// Returns 1 when it did.
    pub(in crate::reactor) fn credit_stall(&mut self, t: ConnKey, key: u64) -> usize {
        let Some(limit) = self.cfg.credit_timeout else { return 0 };
        let Some(c) = self.conns.get_mut(t).filter(|c| c.stall == Some(key)) else { return 0 };
        c.stall = None;
        if !c.lanes.credit_blocked() || !c.role.state().is_established() {
            return 0;
        }
        self.stats.credit_stalls += 1;
        event!(warn, "{:?}: closing: its sends waited {limit:?} for the peer's credits", t.token());
        self.feed(t, Input::Fault(CloseReason::Stalled(limit)));
        1
    }

    /// Operations the device refused: each completes with the errno, and the connection,
    /// whose queue pair is now suspect, closes.
    fn fail_unposted(&mut self, t: ConnKey, refused: Vec<Slot<Buf>>, errno: i32) {
        let failed = refused
            .into_iter()
            // The runtime's own complete to no one.
            .filter(|s| !s.is_control())
            .map(|s| s.into_done(Err(OpError::Post(errno)), false).into())
            .collect();
        self.fail_unposted_done(t, failed);
    }

    /// [`Core::fail_unposted`] of completions made already: each is delivered, then the
    /// connection closes.
    fn fail_unposted_done(&mut self, t: ConnKey, failed: Vec<Completion>) {
        for completion in failed {
            self.deliver_completion(t, completion);
        }
        self.feed(t, Input::WorkError(WcStatus::LocQpOpErr));
    }
}

/// After a plan, asks for the connection's credit-stall timer (`Config::credit_timeout`) when
/// its next send waits for credits and none is running (returns its length, for
/// `Core::start_stall_timer`), and stops it (lazily: the key is forgotten) when nothing waits
/// for credits. A grant that lets a send go therefore restarts the bound: it measures time
/// without progress, not time spent short of credits in total. Also counts the connection's
/// credit waits (`Conn::metrics`), reading the clock only when one begins or ends.
fn credit_watch(c: &mut ConnEntry, cfg: &Config) -> Option<Duration> {
    let blocked = c.lanes.credit_blocked();
    if blocked != c.meter.waiting() {
        c.meter.credit_state(blocked, std::time::Instant::now());
    }
    let limit = cfg.credit_timeout?;
    match (blocked, c.stall) {
        (true, None) => Some(limit),
        (false, Some(_)) => {
            c.stall = None;
            None
        }
        _ => None,
    }
}

impl Posting<'_> {
    /// The position in a receive run of `n` requests a test made the device refuse
    /// (`Reactor::inject_refused_recv`), once.
    #[cfg(feature = "fault-injection")]
    fn take_refused_recv(&mut self, n: u32) -> Option<u32> {
        let at = self.refuse_recv.filter(|i| *i < n);
        if at.is_some() {
            *self.refuse_recv = None;
        }
        at
    }

    /// Without the `fault-injection` feature there is nothing to inject.
    #[cfg(not(feature = "fault-injection"))]
    #[inline(always)]
    fn take_refused_recv(&mut self, _n: u32) -> Option<u32> {
        None
    }

    /// Posts connection `c`'s queued receives from its receive lane, written in place
    /// (`Lanes::plan_recvs`). Returns the ones the device refused, with the errno, for the
    /// caller to fail.
    fn post_recvs(&mut self, c: &mut ConnEntry) -> Option<(Vec<Slot<Buf>>, i32)> {
        // Saying goodbye, what the handler submitted is never posted (a closing connection
        // cancels it), but a receive a credit-only message consumed goes back, so that its
        // grant can reach a peer that needs it to answer our farewell.
        let finishing = matches!(c.role.state(), State::Finishing(_));
        let (first, n) = c.lanes.plan_recvs(finishing);
        if n == 0 {
            return None;
        }
        let qp = c.ep.qp().expect("can_post");
        // `Reactor::inject_refused_recv`: the run posted up to the request it refuses.
        let refused_at = self.take_refused_recv(n);
        #[allow(unsafe_code)]
        // SAFETY: every request of the run names a pool `Buf`, a region slice or a `RawBuf`
        // held by its slot on the receive lane until its completion is reaped or it is
        // cancelled after the queue pair is destroyed (the lanes never drop a posted slot: they
        // hand it out taken, cleared or carried, and `Lanes::set_id` refuses to rename them
        // while any is outstanding); a pool buffer is registered on this device's PD and keeps
        // its region alive, and so does a region slice (its `lkey` is the region's registration
        // on this PD, which the region keeps while any handle lives); a `RawBuf` is covered by
        // `Conn::submit_raw`'s contract. A shorter run (an injected refusal) is a prefix of it.
        let r = unsafe { qp.post_recv_run(c.lanes.recv_wrs(), first, refused_at.unwrap_or(n)) };
        let r = match (r, refused_at) {
            (Ok(()), Some(at)) => Err(crate::sys::qp::PostError {
                posted: at as usize,
                error: std::io::Error::from_raw_os_error(nix::libc::EINVAL),
            }),
            (r, _) => r,
        };
        self.stats.post_recv_calls += 1;
        let taken = r.as_ref().map_or_else(|e| e.posted as u32, |()| n).min(n);
        self.stats.wrs_posted += u64::from(taken);
        // Receives posted after the connect information grant credits one by one.
        let grants = c.infos.sent;
        let refused = c.lanes.recvs_posted(taken, n, grants);
        let depth = c.lanes.outstanding().1;
        if let Some(f) = c.lanes.flow_mut().filter(|_| grants) {
            f.note_depth(depth);
        }
        match (r, refused) {
            (Err(e), refused) => Some((refused.unwrap_or_default(), e.error.raw_os_error().unwrap_or(0))),
            (Ok(()), _) => None,
        }
    }

    /// Plans and posts connection `t`'s (entry `c`, placed `placed`) sends, then waits for CQ
    /// room if the plan was short of it and watches its credits; what needs the whole core is
    /// returned. When the device refused part of the chain, the waiting and the watch are left
    /// to the caller too (`AfterSends::Refused`: they come after the refused requests fail).
    fn post_sends(&mut self, t: ConnKey, c: &mut ConnEntry, placed: Placement) -> AfterSends {
        let e = self.cqs.get_mut(placed.cq).expect("a connection's CQ lives as long as it");
        let run = c.lanes.plan_sends(&mut e.room, placed.max_inline, c.tails.as_mut());
        let short_of_room = run.short_of_room;
        self.stats.cq_peak_reserved = self.stats.cq_peak_reserved.max(u64::from(e.room.reserved()));
        if run.n > 0 {
            #[cfg(feature = "fault-injection")]
            if let Some(i) = self.refuse_send.filter(|i| *i < run.n as usize) {
                // `Reactor::inject_refused_send`: inline beyond the limit, refused at post time.
                *self.refuse_send = None;
                c.lanes.send_wrs().force_inline(run.first.wrapping_add(i as u32));
            }
            let qp = c.ep.qp().expect("can_post");
            #[allow(unsafe_code)]
            // SAFETY: every request of the run names memory its slot on the send lane holds
            // (a pool `Buf`, a region slice, a READ's sink) until its completion is taken or it
            // is cancelled after the queue pair is destroyed (the lanes never drop a posted slot:
            // they hand it out popped, cleared or carried, and `Lanes::set_id` refuses to rename
            // them while any is outstanding); a pool buffer is registered on this device's PD
            // and keeps its region alive, and so does a region slice; a `RawBuf` is covered by
            // `Conn::submit_raw`'s contract; a credit-only message or a probe names no memory of
            // its own (on iWARP a credit-only message names its tail, below); a window bind's
            // slot holds its window, whose chunk its `Exposed` or the window itself keeps until
            // the memory window is deallocated; a tail is in the connection's `TailRing`, which
            // outlives the queue pair (`ConnEntry::tails` is declared after `ep`).
            let r = unsafe { qp.post_send_run(c.lanes.send_wrs(), run.first, run.n) };
            self.stats.post_send_calls += 1;
            let taken = r.as_ref().map_or_else(|e| e.posted as u32, |()| run.n).min(run.n);
            self.stats.wrs_posted += u64::from(taken);
            let refused = c.lanes.sends_posted(run, taken, &mut e.room);
            if let Err(err) = r {
                let errno = err.error.raw_os_error().unwrap_or(0);
                return AfterSends::Refused { failed: refused.unwrap_or_default(), errno, short_of_room };
            }
        }
        if short_of_room {
            self.stats.cq_room_waits += 1;
            list_waiting_room(c, t, Some(&mut e.waiting));
        }
        credit_watch(c, self.cfg).map_or(AfterSends::Done, AfterSends::Stall)
    }
}

/// Lists connection `t` (its entry `c`) among those waiting for room on its CQ (`waiting`, its
/// entry's list), once.
fn list_waiting_room(c: &mut ConnEntry, t: ConnKey, waiting: Option<&mut std::collections::VecDeque<ConnKey>>) {
    if !c.waiting_room {
        c.waiting_room = true;
        if let Some(waiting) = waiting {
            waiting.push_back(t);
        }
    }
}

/// Lists connection `t` (its entry `c`) among those to post at the end of the tick, once.
#[inline]
pub(in crate::reactor) fn list_dirty(c: &mut crate::reactor::ConnEntry, t: ConnKey, dirty: &mut Vec<ConnKey>) {
    if !c.dirty {
        c.dirty = true;
        dirty.push(t);
    }
}

/// The work request of queued receive `k` (the host benchmark's slab path, `SlabPath`).
#[cfg(feature = "bench-internals")]
#[inline]
pub(in crate::reactor) fn recv_wr(k: OpKey, op: &OpEntry) -> crate::sys::qp::RecvWr {
    let (addr, len, lkey) = op.sge();
    crate::sys::qp::RecvWr { wr_id: k.token().as_u64(), addr, len, lkey }
}

/// The work request of a planned send-queue operation of the operation slab the data path used
/// before issue 47 (the host benchmark's `SlabPath` keeps it as its baseline); with `tails` (a
/// transport without immediate data) a send carries its credits in a tail instead.
#[cfg(feature = "bench-internals")]
pub(in crate::reactor) fn send_wr(op: &OpEntry, w: &Planned, max_inline: u32, tails: Option<&mut TailRing>) -> SendWr {
    if op.is_bind() {
        return crate::reactor::data::expose::bind_wr(op, w);
    }
    let (addr, len, lkey) = op.sge();
    let (raddr, rkey) = op.remote.map_or((0, 0), |r| (r.addr, r.rkey));
    let tail = match tails {
        Some(ring) if op.opcode == OpCode::Send => Some(ring.put(Tail(Imm::decode(
            w.imm.unwrap_or(Imm { grant: 0, control: op.control, farewell: Farewell::None }.encode()),
        )))),
        _ => None,
    };
    let send_op = match (op.opcode, w.imm) {
        (OpCode::Send, _) if tail.is_some() => SendOp::Send,
        (OpCode::Send, None) => SendOp::Send,
        (OpCode::Send, Some(imm)) => SendOp::SendImm(imm),
        (OpCode::Write, _) => SendOp::Write(raddr, rkey),
        (OpCode::WriteImm, imm) => SendOp::WriteImm(raddr, rkey, imm.unwrap_or(0)),
        (OpCode::Read, _) => SendOp::Read(raddr, rkey),
        (OpCode::Recv, _) => unreachable!("receives are not on the send queue"),
    };
    let total = len + if tail.is_some() { TAIL_LEN } else { 0 };
    let inline = total > 0 && total <= max_inline && op.opcode != OpCode::Read;
    SendWr { wr_id: w.op.token().as_u64(), op: send_op, addr, len, lkey, signaled: w.signaled, inline, tail }
}

#[cfg(test)]
mod tests {
    use super::runtime_posts_receives;
    use crate::reactor::data::gate::{Gate, Refusal};

    /// The gate a connection's receives meet (`gate_of`): `srq` from the reactor's mode or
    /// the connection's share.
    fn gate(srq_mode: bool, on_srq: bool) -> Gate {
        Gate::new(true, runtime_posts_receives(srq_mode, on_srq), false, None, 0, 1, 1)
    }

    /// Review L3 (b): a client of an SRQ reactor waiting to reconnect holds no share
    /// (`srq_share` is `None` until its new queue pair), and a receive it was given then could
    /// never be posted; the reactor's SRQ config refuses it, share or not.
    #[test]
    fn an_srq_reactor_refuses_own_receives_also_while_a_connection_waits_to_reconnect() {
        // Established on the SRQ: a share.
        assert_eq!(gate(true, true).recv(), Err(Refusal::OwnReceive));
        // Waiting to reconnect: no share, the reactor's SRQ all the same.
        assert_eq!(
            gate(true, false).recv(),
            Err(Refusal::OwnReceive),
            "a receive submitted while waiting to reconnect on an SRQ reactor must be refused"
        );
        // Sends go on; without an SRQ receives are the application's.
        assert_eq!(gate(true, false).message(64), Ok(()));
        assert_eq!(gate(true, true).message(64), Ok(()));
        assert_eq!(gate(false, false).recv(), Ok(()));
    }
}
