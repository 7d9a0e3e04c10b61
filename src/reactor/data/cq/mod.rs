//! Completion queues: the CQ protocol (drain events, batched acks, poll under a budget, arm
//! then poll again) and delivering completions.
//!
//! Room on each CQ is accounted by [`CqRoom`]: a CQ never holds more completions than it has
//! entries.

use std::collections::VecDeque;
use std::rc::Rc;

use crate::error::{Error, Result};
use crate::proto::conn::{CloseReason, Input, State};
use crate::proto::flow::Farewell;
use crate::proto::op::WcStatus;
use crate::proto::token::{ConnKey, CqKey, Dir, GenSlab, Key, Kind, Token, WrId};
use crate::reactor::api::guard::{callable, HandlerRef, Running};
use crate::reactor::data::cq_room::CqRoom;
use crate::reactor::data::lanes::{LaneBuf, Lanes, RecvOutcome};
use crate::reactor::data::post::list_dirty;
use crate::reactor::event_loop::device::Devices;
use crate::reactor::Core;
use crate::sys::cq::{Cq, WcBatch, WorkCompletion, POLL_BATCH};

/// A list of work the tick walks once while the walk may add to it (a CQ polled while
/// spinning is listed again for the next tick): two buffers, swapped by [`WorkList::take`] and
/// [`WorkList::give_back`], so once both have grown neither the walk nor what it adds
/// allocates. (Taking the list and leaving an empty `Vec` in its place allocated on every
/// spinning tick.)
#[derive(Debug)]
pub(in crate::reactor) struct WorkList<T> {
    cur: Vec<T>,
    spare: Vec<T>,
}

/// The tick's work: what it polls, posts and acks, each object listed once (its entry's flag).
#[derive(Default)]
pub(in crate::reactor) struct WorkLists {
    /// CQs to poll this tick.
    pub(in crate::reactor) hot: WorkList<CqKey>,
    /// Connections with something to post at the end of the tick (`data/post.rs`).
    pub(in crate::reactor) dirty: WorkList<ConnKey>,
    /// CQs whose un-acked events reached the ack batch (`Config::cq_ack_batch`).
    pub(in crate::reactor) evented: WorkList<CqKey>,
    /// CQs emptied and left unarmed: until the end of the tick (armed after its posts), or
    /// while spinning (`Config::spin`).
    pub(in crate::reactor) spinning: WorkList<CqKey>,
    /// `poll_cq` arms a CQ it finds empty at once (else it leaves it in `spinning`).
    pub(in crate::reactor) arm_now: bool,
}

impl<T> Default for WorkList<T> {
    fn default() -> Self {
        WorkList { cur: Vec::new(), spare: Vec::new() }
    }
}

impl<T> WorkList<T> {
    /// The listed work, for the walk; the list is empty then (it keeps the spare buffer's
    /// capacity for what the walk adds).
    pub(in crate::reactor) fn take(&mut self) -> Vec<T> {
        let spare = std::mem::take(&mut self.spare);
        std::mem::replace(&mut self.cur, spare)
    }

    /// The walked buffer back, emptied: the spare of the next walk.
    pub(in crate::reactor) fn give_back(&mut self, mut walked: Vec<T>) {
        walked.clear();
        if walked.capacity() >= self.spare.capacity() {
            self.spare = walked;
        }
    }
}

impl<T> std::ops::Deref for WorkList<T> {
    type Target = Vec<T>;

    fn deref(&self) -> &Vec<T> {
        &self.cur
    }
}

impl<T> std::ops::DerefMut for WorkList<T> {
    fn deref_mut(&mut self) -> &mut Vec<T> {
        &mut self.cur
    }
}

/// Completion events read per readiness at most.
const MAX_READS: u32 = 1024;

/// What [`Core::poll_cq`] does after one `ibv_poll_cq` call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::reactor) enum AfterPoll {
    /// The batch was full and budget is left: poll again.
    PollAgain,
    /// The CQ is empty and armed: done.
    Done,
    /// The CQ is empty and unarmed, and the tick's posts are not out yet (or the reactor
    /// spins): leave it unarmed, listed in `Core::spinning`.
    LeaveUnarmed,
    /// The CQ is empty and unarmed, and the reactor may sleep next: arm it, then poll once
    /// more, since a completion that arrived after the last poll and before the arm raises
    /// no event.
    ArmThenPoll,
    /// The budget is used up: keep the CQ hot for the next tick.
    StayHot,
    /// `ibv_poll_cq` failed (with this errno): the CQ's completions cannot be reaped, so it
    /// is failed and its connections closed. Read as "empty" instead, the connections would
    /// wait forever with operations outstanding (fault issue, defect 2).
    Fail(i32),
}

/// The CQ protocol's decision after a poll that asked for `want` completions and got
/// `polled` (a count, or the errno of a failed `ibv_poll_cq`), with `left` of the budget
/// remaining: a failed poll fails the CQ; an empty CQ (`got < want`) is never left unarmed
/// when the reactor may sleep (`arm_now`), and a CQ is never armed without being polled after
/// the arm. Pure, so the protocol is checked on the host against a model CQ (tests below).
pub(in crate::reactor) fn after_poll(
    polled: Result<usize, i32>,
    want: usize,
    left: usize,
    armed: bool,
    arm_now: bool,
) -> AfterPoll {
    let got = match polled {
        Ok(got) => got,
        Err(errno) => return AfterPoll::Fail(errno),
    };
    if got < want {
        if armed {
            AfterPoll::Done
        } else if arm_now {
            AfterPoll::ArmThenPoll
        } else {
            AfterPoll::LeaveUnarmed
        }
    } else if left == 0 {
        AfterPoll::StayHot
    } else {
        AfterPoll::PollAgain
    }
}

/// One CQ and its protocol state.
pub(in crate::reactor) struct CqEntry {
    pub(in crate::reactor) cq: Rc<Cq>,
    /// Index of its device in `Core::devices`.
    pub(in crate::reactor) device: usize,
    /// Armed for one event (counted in its device's `armed`).
    pub(in crate::reactor) armed: bool,
    pub(in crate::reactor) hot: bool,
    pub(in crate::reactor) evented: bool,
    /// Listed in `Core::spinning`: emptied and left unarmed while the reactor spins.
    pub(in crate::reactor) spinning: bool,
    pub(in crate::reactor) shared: bool,
    /// Overrun, or a poll or arm failed: never polled or armed again (`Core::fail_cq`).
    pub(in crate::reactor) failed: bool,
    pub(in crate::reactor) room: CqRoom,
    /// Connections that could not post for lack of room, in order.
    pub(in crate::reactor) waiting: VecDeque<ConnKey>,
}

impl CqEntry {
    /// Arms it for one event (`ibv_req_notify_cq`, counted in `arms`) and, once armed, counts it
    /// in its device's `armed` (what `Core::drain_comp` reads at most). On failure it is left
    /// as it was: the caller decides (fail the CQ, or poll first).
    #[inline(always)]
    fn arm(&mut self, devices: &mut Devices, arms: &mut u64) -> std::io::Result<()> {
        *arms += 1;
        self.cq.req_notify()?;
        if !self.armed {
            self.armed = true;
            devices[self.device].armed += 1;
        }
        Ok(())
    }

    /// Connections wait for room on it, and it has some: [`Core::wake_waiting`] marks them.
    #[inline(always)]
    fn wakes(&self) -> bool {
        !self.waiting.is_empty() && !self.room.is_full()
    }
}

impl Core {
    /// Creates a CQ of `entries` on device `d`, armed, and returns its key (also its context).
    pub(in crate::reactor) fn new_cq(&mut self, d: usize, entries: u32, shared: bool) -> Result<CqKey> {
        let (dev, chan) = (self.devices[d].dev, self.devices[d].chan.clone());
        let short = self.take_short_cq().map(|n| n.min(entries));
        let create = short.unwrap_or(entries);
        let cq = Cq::new(dev, &chan, create, 0, self.cfg.cq_ack_batch)
            .map_err(|e| Error::verb("ibv_create_cq", format!("{create} entries"), e))?;
        cq.req_notify().map_err(|e| Error::verb("ibv_req_notify_cq", "new CQ", e))?;
        self.stats.cq_arms += 1;
        // The device may grant more entries than asked; account only for what was asked (an
        // injected short CQ is accounted for what it should have had).
        let capacity = if short.is_some() { entries } else { entries.min(cq.entries()) };
        let send_floor = if shared { capacity / 4 } else { self.cfg.send_depth.min(capacity) };
        let entry = CqEntry {
            cq,
            device: d,
            armed: true,
            hot: false,
            evented: false,
            spinning: false,
            shared,
            failed: false,
            room: CqRoom::new(capacity, send_floor),
            waiting: VecDeque::new(),
        };
        let t = self.cqs.insert(entry);
        self.devices[d].armed += 1;
        // The context names the entry; events are read later on this thread, never before.
        self.cqs.get(t).expect("inserted").cq.set_context(t.token().as_u64());
        Ok(t)
    }

    /// The entries of a short CQ a test injected (`Reactor::inject_short_cq`), once.
    #[cfg(feature = "fault-injection")]
    fn take_short_cq(&mut self) -> Option<u32> {
        self.faults.short_cq.take()
    }

    /// Without the `fault-injection` feature there is nothing to inject.
    #[cfg(not(feature = "fault-injection"))]
    fn take_short_cq(&mut self) -> Option<u32> {
        None
    }

    /// The receive depth a test injected as the next queue pair's grant
    /// (`Reactor::inject_short_rq`), once.
    #[cfg(feature = "fault-injection")]
    pub(in crate::reactor) fn take_short_rq(&mut self) -> Option<u32> {
        self.faults.short_rq.take()
    }

    /// Without the `fault-injection` feature there is nothing to inject.
    #[cfg(not(feature = "fault-injection"))]
    pub(in crate::reactor) fn take_short_rq(&mut self) -> Option<u32> {
        None
    }

    /// Reads the events of device `d`'s completion channel, counts each on its CQ and marks
    /// the CQ hot.
    ///
    /// An armed CQ raises at most one event, so no more events can be pending than the device
    /// has armed CQs: the reactor reads that many at most and stops there without the read
    /// that would only find `EAGAIN` (one connection's ping-pong: one read per event). The
    /// channel is registered level-triggered, so should more be pending, the next
    /// `epoll_wait` reports it again.
    pub(in crate::reactor) fn drain_comp(&mut self, d: usize) -> usize {
        let Some((chan, armed)) = self.devices.get(d).filter(|d| !d.lost).map(|d| (d.chan.clone(), d.armed)) else {
            return 0;
        };
        let limit = armed.clamp(1, MAX_READS);
        let mut n = 0;
        while n < limit {
            self.stats.channel_reads += 1;
            let ev = match chan.get_event() {
                Ok(Some(ev)) => ev,
                Ok(None) => break,
                Err(e) if e.raw_os_error() == Some(nix::libc::EINTR) => continue,
                // EIO after the device was disassociated: nothing more will come on this
                // channel, and left in the epoll set it would wake every wait.
                Err(_) => {
                    self.device_lost(d, CloseReason::DeviceRemoval);
                    break;
                }
            };
            n += 1;
            self.stats.cq_events += 1;
            let Some(t) = Token::from_u64(ev.context).and_then(|t| self.cqs.key_of(t)) else {
                // Not ours (any more): dropping the event acks it.
                drop(ev);
                self.count_acks(1);
                continue;
            };
            let e = self.cqs.get_mut(t).expect("checked");
            if !e.cq.count(ev) {
                // Another CQ's event (the context was stale): acked when dropped, in count.
                self.count_acks(1);
                continue;
            }
            if e.armed {
                e.armed = false;
                self.devices[e.device].armed -= 1;
            }
            // Listed only once its count reached the batch: a CQ below it waits for more
            // events (or its destruction, which acks the rest), and costs the tick nothing.
            if !e.evented && e.cq.ack_is_due() {
                e.evented = true;
                self.work.evented.push(t);
            }
            if !e.hot {
                e.hot = true;
                self.work.hot.push(t);
            }
        }
        n as usize
    }

    /// Polls every hot CQ under its budget.
    pub(in crate::reactor) fn poll_hot(&mut self) -> usize {
        if self.work.hot.is_empty() {
            return 0;
        }
        let mut total = 0;
        let mut hot = self.work.hot.take();
        for t in hot.drain(..) {
            let Some(e) = self.cqs.get_mut(t) else { continue };
            e.hot = false;
            let found = self.poll_cq(t, self.cfg.poll_budget);
            if found == 0 {
                self.stats.spurious_cq_events += 1;
            }
            total += found;
        }
        self.work.hot.give_back(hot);
        total
    }

    /// Polls one CQ: batches of up to 32 until it is empty or `budget` completions were
    /// reaped. An empty CQ is re-armed and polled once more (the arm/poll race); a CQ that used
    /// its budget stays hot for the next tick. Each step is [`after_poll`]'s decision.
    #[inline]
    pub(in crate::reactor) fn poll_cq(&mut self, t: CqKey, budget: usize) -> usize {
        self.poll_cq_from(t, budget, false)
    }

    /// Arms CQ `t` (emptied by a poll earlier in the tick, and left unarmed), then polls it as
    /// [`Core::poll_cq`] does, on a device whose arm raises no event for completions already
    /// in the CQ (`Caps::arm_sees_only_new`: rxe and siw): what came since that poll (a send
    /// whose ACK came back while it was posted) and what raced the arm are reaped now, in one
    /// poll where polling first, then arming and polling again took two (issue 47, the tick:
    /// at most two polls a round trip in event mode; `Stats::cq_rearm_catches` counts what it
    /// finds, every completion of which would wait unseen without it). One that lands after
    /// the arm raises an event, in either order. On another device the CQ is polled, armed and
    /// polled again ([`Core::poll_cq`] with `arm_now`): an arm doorbell that finds completions
    /// past its consumer index may raise an event at once. A failed arm leaves the CQ
    /// unarmed: the poll then reaps what it holds first and arms it again at the end, which
    /// fails the CQ (`after_poll`'s `ArmThenPoll`), so a failed CQ never strands completions a
    /// poll could have reaped. A CQ armed here that then uses its whole budget stays hot and
    /// armed: the next tick polls it, and its posts are not followed by another poll (a send
    /// completed during its post then costs a wakeup; only after a poll budget ran out).
    fn arm_and_poll(&mut self, t: CqKey, budget: usize) -> usize {
        #[cfg(feature = "fault-injection")]
        if self.faults.poll_before_arm {
            return self.poll_cq(t, budget);
        }
        let devices = &self.devices;
        let Some(e) = self
            .cqs
            .get_mut(t)
            .filter(|e| !e.failed && !e.armed && devices.get(e.device).is_some_and(|d| d.caps.arm_sees_only_new()))
        else {
            return self.poll_cq(t, budget);
        };
        let armed = e.arm(&mut self.devices, &mut self.stats.cq_arms).is_ok();
        self.poll_cq_from(t, budget, armed)
    }

    /// [`Core::poll_cq`], the first poll closing the arm/poll race when `armed_now` (the
    /// caller just armed the CQ: [`Core::arm_and_poll`]).
    #[inline(always)]
    fn poll_cq_from(&mut self, t: CqKey, budget: usize, armed_now: bool) -> usize {
        let Some(cq) = self.cqs.get(t).filter(|e| !e.failed).map(|e| e.cq.clone()) else { return 0 };
        // Uninitialised until a poll fills it: an empty poll costs no stores.
        let mut wcs = WcBatch::new();
        let mut left = budget;
        let mut found = 0;
        // The last call armed the CQ: this poll is the one that closes the race.
        let mut just_armed = armed_now;
        // Whether connections wait for room on it, read from the entry in hand where the poll
        // ends with it (issue 33: no look-up again); `None` where it ends without it.
        let wakes = loop {
            let want = left.min(POLL_BATCH);
            self.stats.cq_polls += 1;
            let polled = cq.poll(&mut wcs, want).map_err(|e| e.raw_os_error().unwrap_or(nix::libc::EIO));
            // No work completion to hand out after a failed poll; the decision below fails the CQ.
            let n = *polled.as_ref().unwrap_or(&0);
            if std::mem::take(&mut just_armed) {
                self.stats.cq_rearm_catches += n as u64;
            }
            for wc in wcs.as_slice() {
                self.complete(t, *wc);
            }
            found += n;
            left -= n;
            let Some(e) = self.cqs.get_mut(t).filter(|e| !e.failed) else { break None };
            match after_poll(polled, want, left, e.armed, self.work.arm_now) {
                AfterPoll::Fail(errno) => {
                    // Its completions cannot be reaped: waiting for them would hang its
                    // connections with operations outstanding.
                    self.fail_cq(t, CloseReason::CqFailed { call: "ibv_poll_cq", errno });
                    break None;
                }
                AfterPoll::PollAgain => {}
                AfterPoll::Done => break Some(e.wakes()),
                AfterPoll::LeaveUnarmed => {
                    // It is armed after the tick's posts (or, spinning, polled again next
                    // tick).
                    if !e.spinning {
                        e.spinning = true;
                        self.work.spinning.push(t);
                    }
                    break Some(e.wakes());
                }
                AfterPoll::ArmThenPoll => {
                    // Armed for one event with the entry in hand (issue 33: looked up again
                    // before). A failed arm fails the CQ: unarmed, it would raise no event (its
                    // connections would wait forever), and retrying would spin the tick.
                    if let Err(err) = e.arm(&mut self.devices, &mut self.stats.cq_arms) {
                        let errno = err.raw_os_error().unwrap_or(nix::libc::EIO);
                        self.fail_cq(t, CloseReason::CqFailed { call: "ibv_req_notify_cq", errno });
                        break None;
                    }
                    just_armed = true;
                }
                AfterPoll::StayHot => {
                    self.stats.budget_exhausted += 1;
                    if !e.hot {
                        e.hot = true;
                        self.work.hot.push(t);
                    }
                    break Some(e.wakes());
                }
            }
        };
        match wakes {
            Some(true) => self.wake_waiting_now(t),
            Some(false) => {}
            None => self.wake_waiting(t),
        }
        found
    }

    /// Destroys a CQ entry (its `Drop` acks its counted events, then `ibv_destroy_cq`).
    pub(in crate::reactor) fn remove_cq(&mut self, t: CqKey) {
        if let Some(e) = self.cqs.remove(t) {
            let unacked = e.cq.unacked();
            if unacked > 0 {
                self.count_acks(unacked);
            }
            if let Some(d) = self.devices.get_mut(e.device).filter(|_| e.armed) {
                d.armed -= 1;
            }
        }
    }

    /// Polls the CQs left unarmed (emptied during the tick, or spinning). With
    /// `keep_spinning` false each is armed, so the reactor can sleep: on rxe and siw armed,
    /// then polled; elsewhere polled, armed and polled again ([`Core::arm_and_poll`]). (Issue
    /// 33 armed first everywhere, then reverted to the three polls: on a provider whose arm
    /// raises an event at once for a CQ that still holds completions, a send completed during
    /// its post would cost a wakeup, and a failed arm would fail the CQ with completions
    /// unreaped. Issue 47 arms first only where the arm raises no such event, and a failed arm
    /// polls before it fails the CQ; the third poll was about 130 instructions a round trip.)
    pub(in crate::reactor) fn poll_spinning(&mut self, keep_spinning: bool) -> usize {
        self.work.arm_now = !keep_spinning;
        let mut n = 0;
        let mut spinning = self.work.spinning.take();
        for t in spinning.drain(..) {
            let Some(e) = self.cqs.get_mut(t) else { continue };
            e.spinning = false;
            n += if keep_spinning {
                self.poll_cq(t, self.cfg.poll_budget)
            } else {
                self.arm_and_poll(t, self.cfg.poll_budget)
            };
        }
        self.work.spinning.give_back(spinning);
        self.work.arm_now = false;
        if keep_spinning {
            self.stats.spin_polls += 1;
        }
        n
    }

    /// Marks the connections waiting for room on CQ `t` for posting again. The check is
    /// inlined into every poll (twice a round trip): as a call it cost about 34 instructions
    /// to find nobody waiting (issue 33).
    #[inline]
    pub(in crate::reactor) fn wake_waiting(&mut self, t: CqKey) {
        if self.cqs.get(t).is_some_and(CqEntry::wakes) {
            self.wake_waiting_now(t);
        }
    }

    /// [`Core::wake_waiting`] once someone waits and there is room.
    #[inline(never)]
    fn wake_waiting_now(&mut self, t: CqKey) {
        let Some(e) = self.cqs.get_mut(t) else { return };
        let waiting = std::mem::take(&mut e.waiting);
        for c in waiting {
            if let Some(conn) = self.conns.get_mut(c) {
                conn.waiting_room = false;
            }
            self.mark_dirty(c);
        }
    }

    /// One work completion reaped from CQ `ct`: a ring's (`proto::token::WrId`: a send or a
    /// receive of a connection's lanes), a shared receive queue's (`SrqRecv` token), or
    /// anything else (an earlier value, a forged one), counted stale.
    fn complete(&mut self, ct: CqKey, wc: WorkCompletion) {
        self.stats.completions += 1;
        if let Some(id) = WrId::decode(wc.wr_id) {
            if id.dir == Dir::Send {
                return self.complete_send(ct, wc);
            }
            return self.complete_ring(wc);
        }
        match Token::from_u64(wc.wr_id).filter(|t| t.kind() == Kind::SrqRecv) {
            Some(token) => self.srq_complete(ct, wc, token),
            None => self.stats.stale_completions += 1,
        }
    }

    /// A send-queue completion of the send ring: valid only if it names a live connection slot
    /// whose queue pair is of the id's epoch and a position in the send ring's posted window
    /// whose slot holds an operation ([`ring_send_completed`]; anything else is counted stale
    /// and reaches no operation). It completes, in posting order, the unsignaled requests before it and
    /// itself (`Lanes::next_sent`, `SentOp::take`): each operation's CQ entry is given back,
    /// the runtime's own are dropped unseen (a credit-only message's success counted for the
    /// meter), the others reach the handler, the signaled one with the work completion's
    /// status, those before it with success. The entry that checked the epoch takes the first
    /// operation, meters it and finds the handler (`meter_and_find`, then [`Core::call_conn`]); each handler after
    /// it is followed by two look-ups (the connection and its CQ) for the next. Every request
    /// it completes counts as completed from the check on (`Lanes::send_completed`), so each
    /// handler sees the others completed too.
    fn complete_send(&mut self, ct: CqKey, wc: WorkCompletion) {
        let status = wc.status;
        let Some((t, mut c, end)) = ring_send_completed(&mut self.conns, &wc, |c| &mut c.lanes) else {
            self.stats.stale_completions += 1;
            return;
        };
        loop {
            // The CQ this completion came from is the connection's send CQ, which lives as
            // long as the connection (both go in the tick's reap, the connection first).
            let Some(e) = self.cqs.get_mut(ct) else {
                debug_assert!(false, "a connection's CQ lives as long as it");
                return;
            };
            let Some((done, more)) = next_sent_done(c, t, &mut e.room, end, status, &mut self.work.dirty) else {
                break;
            };
            // The last operation's handler is the completion's last word: whether a draining
            // connection is drained is asked after it (`after_work`), as after a receive's.
            let check = !more && (status != WcStatus::Success || c.role.state().is_draining());
            if let Some(h) = meter_and_find(c, t, &done, &self.handlers_running) {
                #[allow(unsafe_code)]
                // SAFETY: `h` is `callable`'s on `t`'s entry, in this look-up.
                unsafe {
                    self.call_conn(t, h, |h, conn| h.on_completion(conn, done.into()));
                }
            }
            if !more {
                if check {
                    self.after_work(t, status);
                }
                return;
            }
            // Its handler ran: the connection is looked up again. Nothing a handler does
            // destroys it or empties its lanes (teardown runs in the tick's reap, after every
            // completion of the poll), so the rest of this completion's operations still lie
            // in the posted window, each taken once.
            let Some(again) = self.conns.get_mut(t) else { return };
            c = again;
        }
        self.after_work(t, status);
    }

    /// What a work completion of status `status` leaves connection `t` to hear: a work error,
    /// or, draining, that nothing is outstanding any more.
    #[inline]
    fn after_work(&mut self, t: ConnKey, status: WcStatus) {
        if status != WcStatus::Success {
            if let Some(input) = self.work_error(t, status) {
                self.feed(t, input);
            }
        } else if self.conns.get(t).is_some_and(|c| c.drained()) {
            self.feed(t, Input::Drained);
        }
    }

    /// A work completion whose `wr_id` is a ring's (`proto::token::WrId`): valid only if it
    /// names a live connection slot whose queue pair is of the id's epoch, the receive ring
    /// (the send ring's are [`Core::complete_send`]'s), and a
    /// position in that ring's posted window whose slot holds a receive; anything else (an
    /// earlier queue pair's, a duplicate, a forged value) is counted stale and reaches no
    /// operation. The entry that checked the epoch serves the receive's rules
    /// ([`ring_recv_completed`]: `Lanes::recv_completed`, the lanes' one implementation),
    /// the take of the completion, its metering, what it leaves to post (`after_completion`)
    /// and the handler's address: the handler is called where it lies ([`Core::call_conn`]),
    /// and a successful receive of a connection that is not draining needs no look-up after
    /// it (one look-up a completion). A failed one, or a draining connection's, is looked up
    /// again after the handler for what it leaves to hear ([`Core::after_work`]).
    fn complete_ring(&mut self, wc: WorkCompletion) {
        let found = ring_recv_completed(&mut self.conns, &wc, |c| {
            let tail = c.placed.is_some_and(|p| p.tail);
            (&mut c.lanes, tail)
        });
        let Some((t, c, outcome)) = found else {
            self.stats.stale_completions += 1;
            return;
        };
        match outcome {
            RecvOutcome::Stale => {
                self.stats.stale_completions += 1;
                return;
            }
            RecvOutcome::Deliver { delivery, wake } => {
                if wake {
                    // Credits owed are due, held sends may go, granted credits let waiting
                    // sends go, or receives wait to be posted.
                    list_dirty(c, t, &mut self.work.dirty);
                }
                // Taken out of its slot, metered, and what it leaves to post listed, in the
                // look-up that checked it; the handler is called where it lies.
                let done = c.lanes.take_recv(delivery);
                after_completion(c, t, &mut self.work.dirty);
                let check = wc.status != WcStatus::Success || c.role.state().is_draining();
                if let Some(h) = meter_and_find(c, t, &done, &self.handlers_running) {
                    #[allow(unsafe_code)]
                    // SAFETY: `h` is `callable`'s on `t`'s entry, in this look-up.
                    unsafe {
                        self.call_conn(t, h, |h, conn| h.on_completion(conn, done.into()));
                    }
                }
                if check {
                    self.after_work(t, wc.status);
                }
                return;
            }
            RecvOutcome::Control { farewell } => {
                // A credit-only message used this receive: it is queued again, unseen, first.
                c.meter.credit_message(false);
                list_dirty(c, t, &mut self.work.dirty);
                self.on_farewell(t, farewell);
            }
            RecvOutcome::BadFrame(why) => {
                // The peer broke the framing: the receive waits in the side list (the closing
                // connection cancels it) and the connection closes.
                self.violated(t);
                self.feed(t, Input::Fault(CloseReason::Protocol(why)));
            }
            RecvOutcome::Overdrawn => {
                // The peer sent beyond the credit we granted it (review M1: a credit that is
                // only advice lets one peer make a handler that answers every message queue
                // without bound). The message is dropped, the receive waits in the side list
                // (the closing connection cancels it) and the connection closes, as on a
                // shared receive queue. Counted and fed once: the messages after it in the
                // same poll find the connection closing already.
                let live = matches!(
                    c.role.state(),
                    State::Accepting | State::Connecting | State::Established | State::Finishing(_)
                );
                if live {
                    self.stats.credit_overdrawn += 1;
                    self.violated(t);
                    let why = "the peer sent beyond its credit (flow control)".to_string();
                    self.feed(t, Input::Fault(CloseReason::Protocol(why)));
                }
            }
        }
        self.after_work(t, wc.status);
    }

    /// What a failed work request tells connection `t`, if anything. A flush is the first
    /// error of an established connection no one was closing only when the device moved its
    /// queue pair to the error state for a request of the peer's (a READ, WRITE or atomic
    /// outside what was exposed to it: rxe raises no asynchronous event for it, Linux 6.1
    /// `rxe_resp.c`, and such a request completes no work request of this side): named as
    /// that. On iWARP such a flush (or one before establishment) tells nothing yet: the peer's disconnect (its end of the TCP
    /// stream closing) flushes the queue pair before the connection manager reports it, a
    /// local error's flushed receives can come before that error's own completion, and a
    /// peer's violation ends the stream (a TERMINATE, then the close): the connection waits
    /// for what follows, DISCONNECTED (`Peer`) or the failed request (`WorkError`)
    /// (`proto::transport`).
    pub(in crate::reactor) fn work_error(&mut self, t: ConnKey, status: WcStatus) -> Option<Input> {
        // Saying goodbye counts as established: the queue pair is still connected.
        let established = self.conns.get(t).is_some_and(|c| c.role.state().is_connected());
        let iwarp = self.conns.get(t).and_then(|c| c.placed).is_some_and(|p| self.devices[p.device].caps.tail());
        let setting_up =
            self.conns.get(t).is_some_and(|c| matches!(c.role.state(), State::Connecting | State::Accepting));
        if status == WcStatus::WrFlushErr && (established || setting_up) && iwarp {
            // (Before establishment too: a refused connect flushes the receives before the
            // reject is reported, which then says why.)
            return None;
        }
        if status == WcStatus::WrFlushErr && established {
            self.stats.peer_violations += 1;
            return Some(Input::Fault(CloseReason::PeerViolation));
        }
        Some(Input::WorkError(status))
    }

    /// A credit-only message of connection `t`'s peer said `farewell` (the close handshake,
    /// `proto::flow::Farewell`): its goodbye is answered, its answer to ours lets us
    /// disconnect. Ignored on a connection that did not negotiate the handshake.
    pub(in crate::reactor) fn on_farewell(&mut self, t: ConnKey, farewell: Farewell) {
        let Some(c) = self.conns.get_mut(t).filter(|c| c.lanes.farewell()) else { return };
        match farewell {
            Farewell::None => {}
            Farewell::Leaving => {
                if c.role.state().is_connected() {
                    // Every message it sent before its goodbye has reached us: say so.
                    c.lanes.answer_farewell();
                    self.stats.farewells_heard += 1;
                    if c.parting.is_none() {
                        // It disconnects once it has the answer. Should its disconnect never
                        // arrive (its kernel dropped the stream without a word: FAULTS.md),
                        // this timer ends the connection instead of leaving it for ever.
                        if let Some(at) = self.read_clock().checked_add(self.cfg.timeouts.finish) {
                            let key =
                                self.timers.schedule(at, crate::reactor::event_loop::timers::TimerTarget::Parting(t));
                            self.conns.get_mut(t).expect("checked").parting = Some(key);
                        }
                    }
                    self.mark_dirty(t);
                }
            }
            Farewell::Heard => {
                // Counted only while waiting for it: an answer after `Timeouts::finish` was
                // counted unanswered, and the connection is disconnecting already.
                if matches!(c.role.state(), State::Finishing(_)) {
                    self.stats.farewells_answered += 1;
                    #[cfg(feature = "fault-injection")]
                    {
                        c.mute = std::mem::take(&mut self.faults.silent_parting);
                    }
                    self.feed(t, Input::Finished);
                }
            }
        }
    }

    /// Connection `t`'s parting timer `key` fired: its peer said goodbye, was answered
    /// `Timeouts::finish` ago and has not disconnected. If the connection is still
    /// established, it disconnects now and closes as the peer's close
    /// (`Stats::silent_partings`); a connection closing already is left to its own deadlines.
    pub(in crate::reactor) fn parting(&mut self, t: ConnKey, key: u64) -> usize {
        let Some(c) = self.conns.get_mut(t).filter(|c| c.parting == Some(key)) else { return 0 };
        c.parting = None;
        if !c.role.state().is_established() {
            return 0;
        }
        self.stats.silent_partings += 1;
        event!(
            warn,
            "{:?}: the peer said goodbye and has not disconnected within {:?}: disconnecting",
            t.token(),
            self.cfg.timeouts.finish
        );
        self.feed(t, Input::Fault(CloseReason::Peer));
        1
    }

    /// Hands `completion` to connection `t`'s handler, counted first (`Conn::metrics`): a
    /// completion built outside the rings' completion paths (a refused post's, a reconnection's
    /// cancelled operations; those of `complete_ring` and `complete_send` are metered by
    /// `meter_and_find` and handed over by [`Core::call_conn`]).
    #[inline]
    pub(in crate::reactor) fn deliver_completion(&mut self, t: ConnKey, completion: crate::reactor::Completion) {
        self.deliver_then(t, completion, |_, _| {});
    }

    /// [`Core::deliver_completion`], then [`Core::after_completion`] in the lookup that puts
    /// the handler back.
    pub(in crate::reactor) fn deliver_completion_then(&mut self, t: ConnKey, completion: crate::reactor::Completion) {
        self.deliver_then(t, completion, |c, dirty| after_completion(c, t, dirty));
    }

    /// [`Core::deliver_completion`], and `last` as [`Core::with_conn_between`] runs it.
    #[inline]
    fn deliver_then(
        &mut self,
        t: ConnKey,
        completion: crate::reactor::Completion,
        last: impl FnOnce(&mut crate::reactor::ConnEntry, &mut Vec<ConnKey>),
    ) {
        let (opcode, result) = (completion.opcode, completion.result);
        let meter = |c: &mut crate::reactor::ConnEntry| c.meter.completed(opcode, &result);
        self.with_conn_between(t, meter, |h, conn| h.on_completion(conn, completion), last);
    }

    /// After a completion: post what waited for queue room or credit, or grant credits.
    pub(in crate::reactor) fn after_completion(&mut self, t: ConnKey) {
        if let Some(c) = self.conns.get_mut(t) {
            after_completion(c, t, &mut self.work.dirty);
        }
    }

    /// Counts one `ibv_ack_cq_events` call of `n` events.
    fn count_acks(&mut self, n: u32) {
        self.stats.cq_ack_calls += 1;
        self.stats.cq_events_acked += u64::from(n);
    }

    /// Acks the events of every CQ whose count reached the batch threshold (only those are
    /// listed, so the cost is theirs, not every CQ's with a few events counted); a destroyed
    /// CQ acked its own count.
    pub(in crate::reactor) fn flush_acks(&mut self) {
        if self.work.evented.is_empty() {
            return;
        }
        let mut evented = self.work.evented.take();
        for t in evented.drain(..) {
            let Some(e) = self.cqs.get_mut(t) else { continue };
            e.evented = false;
            let n = e.cq.ack_due();
            if n > 0 {
                self.count_acks(n);
            }
        }
        self.work.evented.give_back(evented);
    }
}

/// The next queue-pair epoch of connection slot `index` in `epochs` (grown to hold it): each
/// queue pair made for a connection at that slot takes the next, wrapping (`Core::epochs`).
pub(in crate::reactor) fn next_epoch(epochs: &mut Vec<u16>, index: u32) -> u16 {
    let i = index as usize;
    if epochs.len() <= i {
        epochs.resize(i + 1, 0);
    }
    epochs[i] = epochs[i].wrapping_add(1);
    epochs[i]
}

/// [`Core::complete_ring`]'s decode and rules, pure over the connection table (so the host
/// tests drive the code the reactor runs): the connection a receive completion's ring `wr_id`
/// names (`split` gives an entry's lanes and whether its messages end in a tail), with what
/// the receive was (`Lanes::recv_completed`). `None` (the caller counts it stale, and nothing
/// is changed) for a value that is no ring id, a free slot, another queue pair's epoch (the
/// lanes' own: `Lanes::epoch`, the one copy of the connection's epoch) or the send ring's
/// direction; [`RecvOutcome::Stale`] for a position outside the posted window or naming an
/// empty slot (a duplicate, a credit-only message's consumed id).
#[inline(always)]
pub(in crate::reactor) fn ring_recv_completed<'c, T, B>(
    conns: &'c mut GenSlab<ConnKey, T>,
    wc: &WorkCompletion,
    split: impl FnOnce(&mut T) -> (&mut Lanes<B>, bool),
) -> Option<(ConnKey, &'c mut T, RecvOutcome)>
where
    B: LaneBuf,
{
    let id = WrId::decode(wc.wr_id).filter(|id| id.dir == Dir::Recv)?;
    let (t, c) = conns.get_index_mut(id.index)?;
    let (lanes, tail) = split(&mut *c);
    if lanes.epoch() != id.epoch {
        return None;
    }
    let outcome = lanes.recv_completed(id.seq, wc, tail);
    Some((t, c, outcome))
}

/// [`Core::complete_send`]'s decode and checks, pure over the connection table (so the host
/// tests drive the code the reactor runs): the connection a send completion's ring `wr_id`
/// names (`lanes` gives an entry's lanes) and the end (exclusive) of the positions it
/// completes, from the oldest outstanding on (`Lanes::send_completed`, which counts them
/// completed from now on). `None` (the caller
/// counts it stale, and nothing is changed) for a value that is no ring id, the receive ring's
/// direction, a free slot, another queue pair's epoch, or a position outside the send ring's
/// posted window or naming an empty slot (a duplicate).
#[inline(always)]
pub(in crate::reactor) fn ring_send_completed<'c, T, B>(
    conns: &'c mut GenSlab<ConnKey, T>,
    wc: &WorkCompletion,
    lanes: impl FnOnce(&mut T) -> &mut Lanes<B>,
) -> Option<(ConnKey, &'c mut T, u32)>
where
    B: LaneBuf,
{
    let id = WrId::decode(wc.wr_id).filter(|id| id.dir == Dir::Send)?;
    let (t, c) = conns.get_index_mut(id.index)?;
    let l = lanes(&mut *c);
    if l.epoch() != id.epoch {
        return None;
    }
    let end = l.send_completed(id.seq)?;
    Some((t, c, end))
}

/// The next operation of connection `t`'s (entry `c`) send completion ending before `end`
/// (`Lanes::next_sent`), taken as its handler's completion with whether more follow; its CQ
/// entry and those of the runtime's own before it go back to `room`, and the credit-only
/// messages among those are counted. With the last operation (none follows), or `None` when
/// no operation for a handler is left, the connection is listed in `dirty` if it has
/// something to post (`after_completion`): before the last handler is called, since what the
/// handler submits lists the connection itself (`Core::submit`).
#[inline(always)]
fn next_sent_done(
    c: &mut crate::reactor::ConnEntry,
    t: ConnKey,
    room: &mut CqRoom,
    end: u32,
    status: WcStatus,
    dirty: &mut Vec<ConnKey>,
) -> Option<(crate::reactor::data::lanes::Done<crate::sys::pool::Buf>, bool)> {
    let next = match c.lanes.next_sent(end, room, status) {
        Some(op) => {
            let more = op.more();
            Some((op.take(room, status), more))
        }
        None => None,
    };
    let sent = c.lanes.take_credit_messages_sent();
    if sent > 0 {
        c.meter.credit_messages_sent(sent);
    }
    if !matches!(next, Some((_, true))) {
        after_completion(c, t, dirty);
    }
    next
}

/// Counts completion `done` for connection `t`'s meter (`Conn::metrics`: every completion of
/// a live connection that reaches its handler is counted first) and finds its handler
/// ([`callable`]), in the caller's look-up of its entry `c`. `None`: its handler cannot be
/// called now (a callback of its own runs), and the completion is dropped, as one for a
/// connection being destroyed.
#[inline(always)]
fn meter_and_find(
    c: &mut crate::reactor::ConnEntry,
    t: ConnKey,
    done: &crate::reactor::data::lanes::Done<crate::sys::pool::Buf>,
    running: &Running,
) -> Option<HandlerRef> {
    c.meter.completed(done.opcode, &done.result);
    callable(c, t, running)
}

/// [`Core::after_completion`] on connection `t`'s entry `c`.
#[inline]
fn after_completion(c: &mut crate::reactor::ConnEntry, t: ConnKey, dirty: &mut Vec<ConnKey>) {
    if c.lanes.wants_post() || c.lanes.has_pending_recvs() {
        list_dirty(c, t, dirty);
    }
}

#[cfg(test)]
mod tests;
