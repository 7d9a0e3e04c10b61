//! Unit tests of the CQ protocol: a model CQ with completions injected anywhere in the
//! arm/poll sequence, the decision table after a poll, and the work lists.

//! The arm/poll race (catalogue case 25) on a model CQ with the notification semantics of
//! `ibv_req_notify_cq(3)`: arming asks for one event at the *next* completion; completions
//! already queued raise none. The driver below walks the same decisions as
//! `Core::poll_cq` and `Core::tick` (poll hot CQs, post, then, for the ones emptied, either
//! arm and poll again, as on rxe and siw, or poll, arm and poll again, as elsewhere:
//! `Core::arm_and_poll`), and a completion is injected at every point where the device could
//! add one: before each poll and between the last empty poll and the arm. Every test runs
//! both orders.

use std::collections::VecDeque;

use super::{after_poll, AfterPoll};

/// The device's side of one CQ.
#[derive(Default)]
struct ModelCq {
    queue: VecDeque<u64>,
    /// Every `ibv_poll_cq` from now on fails (`EIO`).
    broken: bool,
    /// Armed for one event.
    armed: bool,
    /// An event is readable on the channel.
    event: bool,
}

impl ModelCq {
    fn push(&mut self, v: u64) {
        self.queue.push_back(v);
        if std::mem::take(&mut self.armed) {
            self.event = true;
        }
    }
}

/// The reactor's side of it, and what it saw.
#[derive(Default)]
struct Reactor {
    /// The CQ was failed: its connections were closed, their operations completed with
    /// errors (nothing waits on it any more).
    failed: bool,
    armed: bool,
    hot: bool,
    unarmed: bool,
    reaped: Vec<u64>,
    spurious_events: u64,
    catches: u64,
}

/// Where a completion can be injected.
struct Injector {
    /// Hook calls so far.
    at: usize,
    /// Inject at these hook calls.
    when: Vec<usize>,
    next: u64,
    /// From this hook call on, polls fail.
    break_at: Option<usize>,
}

impl Injector {
    fn new(when: Vec<usize>) -> Injector {
        Injector { at: 0, when, next: 0, break_at: None }
    }

    fn hook(&mut self, cq: &mut ModelCq) {
        if self.when.contains(&self.at) {
            cq.push(self.next);
            self.next += 1;
        }
        if self.break_at == Some(self.at) {
            cq.broken = true;
        }
        self.at += 1;
    }
}

/// How the model reactor reads a failed poll: as the reactor does, or as it did before
/// the fault issue's defect 2 was fixed (`unwrap_or(0)`: "empty").
#[derive(Clone, Copy, PartialEq)]
enum OnPollError {
    FailTheCq,
    ReadAsEmpty,
}

const BATCH: usize = 2;

/// `Core::poll_cq` (or, `armed_now`, the poll of `Core::arm_and_poll` after its arm), on the
/// model; `repoll: false` is the broken protocol that arms and stops, and `on_error` chooses
/// how a failed poll is read.
#[allow(clippy::too_many_arguments)]
fn poll_cq_reading(
    cq: &mut ModelCq,
    r: &mut Reactor,
    inj: &mut Injector,
    budget: usize,
    arm_now: bool,
    repoll: bool,
    on_error: OnPollError,
    armed_now: bool,
) {
    let mut left = budget;
    let mut just_armed = armed_now;
    loop {
        inj.hook(cq);
        let want = left.min(BATCH);
        let mut polled = if cq.broken { Err(5) } else { Ok(want.min(cq.queue.len())) };
        if on_error == OnPollError::ReadAsEmpty {
            polled = Ok(polled.unwrap_or(0));
        }
        let got = *polled.as_ref().unwrap_or(&0);
        r.reaped.extend(cq.queue.drain(..got));
        if std::mem::take(&mut just_armed) {
            r.catches += got as u64;
        }
        left -= got;
        match after_poll(polled, want, left, r.armed, arm_now) {
            AfterPoll::Fail(_) => {
                r.failed = true;
                break;
            }
            AfterPoll::PollAgain => {}
            AfterPoll::Done => break,
            AfterPoll::LeaveUnarmed => {
                r.unarmed = true;
                break;
            }
            AfterPoll::ArmThenPoll => {
                // The race: the device adds a completion after the empty poll.
                inj.hook(cq);
                cq.armed = true;
                r.armed = true;
                just_armed = true;
                if !repoll {
                    break;
                }
            }
            AfterPoll::StayHot => {
                r.hot = true;
                break;
            }
        }
    }
}

/// Runs ticks until the reactor would sleep with nothing to wake it; returns whether a
/// completion was left stranded in the CQ then. `arm_first`: step 6 arms the emptied CQ and
/// polls it (rxe, siw); otherwise it polls, arms and polls again.
fn run(inj: &mut Injector, first: u64, budget: usize, repoll: bool, arm_first: bool) -> (Reactor, ModelCq) {
    run_reading(inj, first, budget, repoll, OnPollError::FailTheCq, arm_first)
}

/// [`run`], with a choice of how a failed poll is read.
fn run_reading(
    inj: &mut Injector,
    first: u64,
    budget: usize,
    repoll: bool,
    on_error: OnPollError,
    arm_first: bool,
) -> (Reactor, ModelCq) {
    let mut cq = ModelCq { armed: true, ..ModelCq::default() };
    let mut r = Reactor { armed: true, ..Reactor::default() };
    for v in 0..first {
        cq.push(v);
    }
    inj.next = first;
    for _ in 0..1000 {
        // Step 3: read the event, count it, disarm, mark hot.
        let evented = std::mem::take(&mut cq.event);
        if evented {
            r.armed = false;
            r.hot = true;
        }
        // Step 4: poll hot CQs; an emptied one stays unarmed until after the posts.
        if std::mem::take(&mut r.hot) {
            let before = r.reaped.len();
            poll_cq_reading(&mut cq, &mut r, inj, budget, false, repoll, on_error, false);
            if evented && r.reaped.len() == before {
                r.spurious_events += 1;
            }
        }
        // Step 6: after the posts, arm and poll again (`Core::arm_and_poll`).
        if r.failed {
            // Failed: never polled or armed again; its connections are closed.
            return (r, cq);
        }
        if std::mem::take(&mut r.unarmed) {
            if arm_first {
                // The race: the device adds a completion after step 4's empty poll, before
                // the arm (it raises no event).
                inj.hook(&mut cq);
                cq.armed = true;
                r.armed = true;
                if repoll {
                    poll_cq_reading(&mut cq, &mut r, inj, budget, true, repoll, on_error, true);
                }
            } else {
                poll_cq_reading(&mut cq, &mut r, inj, budget, true, repoll, on_error, false);
            }
        }
        if r.failed {
            return (r, cq);
        }
        assert!(!r.unarmed, "an emptied CQ is armed before the reactor sleeps");
        if !r.hot && !cq.event {
            // The reactor sleeps: only an event can wake it.
            return (r, cq);
        }
    }
    panic!("the model did not settle");
}

#[test]
fn a_completion_injected_anywhere_is_never_stranded() {
    for arm_first in [true, false] {
        for budget in [1, 2, 3, 64] {
            for first in 1..4 {
                for a in 0..24 {
                    for b in a..24 {
                        let mut inj = Injector::new(vec![a, b]);
                        let (r, cq) = run(&mut inj, first, budget, true, arm_first);
                        let injected = inj.next;
                        assert!(
                            cq.queue.is_empty(),
                            "arm first {arm_first}, budget {budget}, {first} first, injected at {a} and {b}: {:?} stranded",
                            cq.queue
                        );
                        assert_eq!(r.reaped, (0..injected).collect::<Vec<_>>(), "each reaped once, in order");
                        assert!(r.armed && cq.armed, "asleep armed");
                    }
                }
            }
        }
    }
}

#[test]
fn the_repoll_after_the_arm_is_what_catches_the_race() {
    // The completion injected between the empty poll and the arm: the first tick's hook
    // calls are step 4's poll (0, one completion, fewer than the batch: empty after it), then
    // at step 6 the arm (1) and the poll (2) when arming first, or the poll (1), the arm (2)
    // and the poll (3) otherwise.
    for arm_first in [true, false] {
        let mut caught = 0;
        let mut stranded = 0;
        for at in 0..12 {
            let mut with = Injector::new(vec![at]);
            let (r, cq) = run(&mut with, 1, 64, true, arm_first);
            assert!(cq.queue.is_empty());
            caught += r.catches;
            let mut without = Injector::new(vec![at]);
            let (_, cq) = run(&mut without, 1, 64, false, arm_first);
            stranded += cq.queue.len();
        }
        assert!(caught > 0, "arm first {arm_first}: the poll after the arm found the raced completion");
        assert!(stranded > 0, "arm first {arm_first}: arming without polling again strands it: the test can fail");
    }
}

#[test]
fn an_event_with_an_empty_cq_is_harmless() {
    // Injected after the arm and before the poll that follows it: the poll reaps it and
    // the event it raised later finds the CQ empty.
    for arm_first in [true, false] {
        let mut spurious = 0;
        for at in 0..12 {
            let mut inj = Injector::new(vec![at]);
            let (r, cq) = run(&mut inj, 1, 64, true, arm_first);
            assert!(cq.queue.is_empty() && r.armed && cq.armed);
            assert_eq!(r.reaped.len() as u64, inj.next);
            spurious += r.spurious_events;
        }
        assert!(spurious > 0, "arm first {arm_first}: some injection point gives an event with an empty CQ");
    }
}

/// Fault issue, defect 2: a failed `ibv_poll_cq` was read as "empty" (`unwrap_or(0)`):
/// the CQ was then armed or left as done with completions still in it, and its
/// connections waited forever with operations outstanding. Now it fails the CQ (its
/// connections close with `CqFailed`). On rxe a poll cannot fail (it reads a user-space
/// ring), so this is shown on the model: polls break at every point of a run with
/// completions queued and arriving.
#[test]
fn a_failed_poll_fails_the_cq_and_never_reads_as_empty() {
    for arm_first in [true, false] {
        a_failed_poll_fails_the_cq_in_one_order(arm_first);
    }
}

fn a_failed_poll_fails_the_cq_in_one_order(arm_first: bool) {
    let mut stranded_before = 0;
    for break_at in 0..16 {
        for first in 1..4 {
            let mut inj = Injector { break_at: Some(break_at), ..Injector::new(vec![1, 5, 9]) };
            let (r, cq) = run(&mut inj, first, 64, true, arm_first);
            // Whatever was not reaped is in a failed CQ whose connections were told.
            assert!(
                cq.queue.is_empty() || r.failed,
                "arm first {arm_first}, polls broken at {break_at}, {first} first: {:?} left behind, CQ not failed",
                cq.queue
            );
            assert!(r.failed || !cq.broken, "arm first {arm_first}: a broken CQ that was polled is failed");
            let mut old = Injector { break_at: Some(break_at), ..Injector::new(vec![1, 5, 9]) };
            let (r, cq) = run_reading(&mut old, first, 64, true, OnPollError::ReadAsEmpty, arm_first);
            if !r.failed && !cq.queue.is_empty() {
                stranded_before += 1;
            }
        }
    }
    assert!(stranded_before > 0, "arm first {arm_first}: read as empty, completions are stranded: the test can fail");
}

#[test]
fn a_work_list_walked_every_tick_stops_allocating() {
    let mut list = super::WorkList::<u32>::default();
    list.push(1);
    let mut seen = Vec::new();
    for tick in 0..100 {
        let walked = list.take();
        assert!(list.is_empty());
        for x in &walked {
            // Listed again for the next tick, as a spinning CQ is.
            list.push(*x);
        }
        list.give_back(walked);
        if tick >= 2 {
            seen.push((list.as_ptr(), list.capacity()));
        }
    }
    assert_eq!(list.as_slice(), &[1]);
    // Two buffers, alternating: two addresses in all, never a new one.
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 2, "{seen:?}");
}

#[test]
fn the_decision_table() {
    use AfterPoll::*;
    assert_eq!(after_poll(Err(5), 32, 64, true, false), Fail(5));
    // Empty (got < want): armed is done; unarmed is left for after the posts, or armed
    // and polled again when the reactor may sleep.
    assert_eq!(after_poll(Ok(0), 32, 64, true, false), Done);
    assert_eq!(after_poll(Ok(3), 32, 61, false, false), LeaveUnarmed);
    assert_eq!(after_poll(Ok(3), 32, 61, false, true), ArmThenPoll);
    // Full batch: poll again while budget is left, else stay hot (never armed then).
    assert_eq!(after_poll(Ok(32), 32, 32, false, true), PollAgain);
    assert_eq!(after_poll(Ok(32), 32, 0, false, true), StayHot);
    assert_eq!(after_poll(Ok(32), 32, 0, true, false), StayHot);
}

/// The reactor's receive completions on the rings (issue 47 phase 2, review M1), through
/// [`ring_recv_completed`], the decode and rules `Core::complete_ring` runs (the lanes' one
/// implementation of the receive rules, with the send queue as the send side, as in the
/// reactor). A connection here is what `complete_ring` reads of a `ConnEntry`.
mod ring {
    use super::super::{next_epoch, ring_recv_completed, ring_send_completed};
    use crate::proto::flow::{negotiate, Farewell, Flow, Imm};
    use crate::proto::op::{OpCode, OpError};
    use crate::proto::token::{ConnKey, Dir, GenSlab, Key, WrId};
    use crate::proto::wire::ConnectInfo;
    use crate::reactor::data::lanes::tests::wc;
    use crate::reactor::data::lanes::{Lanes, RecvOutcome, Slot};
    use crate::reactor::data::op::RawBuf;
    use crate::sys::cq::WorkCompletion;
    use crate::sys::pool::index::IndexBuf;

    /// What `Core::complete_ring` reads of a connection: its lanes (which hold the credit
    /// state) and whether its messages end in a tail.
    struct TestConn {
        lanes: Lanes<IndexBuf>,
    }

    fn conn(flow: Option<Flow>) -> TestConn {
        // As `ConnEntry::new`: named after slot 0, epoch 0, until its queue pair.
        let mut lanes = Lanes::new(0, 0, 4).expect("slot 0");
        lanes.set_flow(flow);
        TestConn { lanes }
    }

    fn flow(depth: u32) -> Option<Flow> {
        let peer = ConnectInfo { flow_control: true, recv_depth: depth as u16, ..ConnectInfo::default() };
        negotiate(true, depth, Some(&peer))
    }

    /// `setup_qp`'s part: the lanes renamed after the slot and the next epoch there.
    fn new_qp(conns: &mut GenSlab<ConnKey, TestConn>, epochs: &mut Vec<u16>, t: ConnKey) -> u16 {
        let index = t.token().index();
        let c = conns.get_mut(t).expect("live");
        c.lanes.can_rename(index).expect("nothing outstanding, the index in range");
        let epoch = next_epoch(epochs, index);
        assert!(c.lanes.set_id(index, epoch));
        c.lanes.set_capacity(8, 8);
        epoch
    }

    fn submit(conns: &mut GenSlab<ConnKey, TestConn>, t: ConnKey, user_data: u64) {
        let raw = RawBuf { addr: 0x1000, len: 64, lkey: 7 };
        conns.get_mut(t).expect("live").lanes.submit_recv(Slot::raw(OpCode::Recv, raw, user_data));
    }

    /// `Posting::post_recvs`, all taken: the grants to the lanes' credit state.
    fn post(conns: &mut GenSlab<ConnKey, TestConn>, t: ConnKey) -> Vec<u64> {
        let TestConn { lanes } = conns.get_mut(t).expect("live");
        let (first, n) = lanes.plan_recvs(false);
        let refused = lanes.recvs_posted(n, n, true);
        assert!(refused.is_none());
        let mut ids = Vec::new();
        lanes.run_ids(first, n, |id| ids.push(id));
        ids
    }

    /// `Core::complete_ring` up to the handler: `None` and `Stale` are counted stale there.
    fn complete(conns: &mut GenSlab<ConnKey, TestConn>, wc: &WorkCompletion) -> Option<(ConnKey, RecvOutcome)> {
        ring_recv_completed(conns, wc, |c| (&mut c.lanes, false)).map(|(t, _, out)| (t, out))
    }

    /// `complete`, delivered: the user_data and result the handler gets.
    fn deliver(conns: &mut GenSlab<ConnKey, TestConn>, wc: &WorkCompletion) -> (u64, Result<u32, OpError>) {
        match complete(conns, wc) {
            Some((t, RecvOutcome::Deliver { delivery, .. })) => {
                let done = conns.get_mut(t).expect("live").lanes.take_recv(delivery);
                (done.user_data, done.result)
            }
            other => panic!("not delivered: {other:?}"),
        }
    }

    fn stale(out: Option<(ConnKey, RecvOutcome)>) -> bool {
        matches!(out, None | Some((_, RecvOutcome::Stale)))
    }

    fn id(index: u32, epoch: u16, dir: Dir, seq: u32) -> u64 {
        WrId::at(WrId::base(index, epoch, dir).expect("in range"), seq)
    }

    fn seq_of(wr_id: u64) -> u32 {
        WrId::decode(wr_id).expect("a ring id").seq
    }

    /// An id of an earlier queue pair (a reconnection's, or a closed connection's at a slot
    /// taken by another), a send-direction id, a free slot, a position outside the posted
    /// window, a duplicate and forged values: each counted stale, reaching no receive (the
    /// receives stay outstanding and complete afterwards, once). Decoding never panics.
    #[test]
    fn a_receive_completion_reaches_its_receive_only_with_its_epoch_direction_and_position() {
        let mut epochs = Vec::new();
        let mut conns: GenSlab<ConnKey, TestConn> = GenSlab::new();
        let a = conns.insert(conn(None));
        let b = conns.insert(conn(None));
        let (ia, ib) = (a.token().index(), b.token().index());
        let ea = new_qp(&mut conns, &mut epochs, a);
        let eb = new_qp(&mut conns, &mut epochs, b);
        assert_eq!((ea, eb), (1, 1), "each slot counts its own epochs");
        for u in 1..=2 {
            submit(&mut conns, a, u);
        }
        let ids = post(&mut conns, a);
        assert_eq!(ids.len(), 2);
        // Before a's queue pair, a new connection's lanes name slot 0, epoch 0: nothing posted.
        let first = seq_of(ids[0]);
        // The send ring's id with the same index, epoch and sequence: `Core::complete_send`'s,
        // never a receive's.
        assert!(complete(&mut conns, &wc(id(ia, ea, Dir::Send, first), 8, None)).is_none());
        // Positions outside the posted window: the next to post, the one before, far off.
        for seq in [first + 2, first.wrapping_sub(1) & WrId::SEQ_MASK, first + 1000] {
            let out = complete(&mut conns, &wc(id(ia, ea, Dir::Recv, seq), 8, None));
            assert!(matches!(out, Some((t, RecvOutcome::Stale)) if t == a), "seq {seq}: {out:?}");
        }
        // Another epoch at the same slot, the same position.
        assert!(complete(&mut conns, &wc(id(ia, ea + 1, Dir::Recv, first), 8, None)).is_none());
        assert!(complete(&mut conns, &wc(id(ia, ea.wrapping_sub(1), Dir::Recv, first), 8, None)).is_none());
        // b's slot at a's position: b has nothing posted there.
        assert!(stale(complete(&mut conns, &wc(id(ib, eb, Dir::Recv, first), 8, None))));
        // A slot no connection holds; values that are no ring id.
        assert!(complete(&mut conns, &wc(id(WrId::MAX_INDEX, 1, Dir::Recv, 0), 8, None)).is_none());
        for raw in [0, u64::MAX, 0xA000_0000_0000_0000, 0xAFFF_FFFF_FFFF_FFFF, 0x0B00_0001_0000_0001] {
            let _ = complete(&mut conns, &wc(raw, 8, None));
        }
        assert_eq!(conns.get(a).unwrap().lanes.outstanding(), (0, 2), "no stale completion took a receive");
        // The real ones: delivered once, in any order; a duplicate is stale.
        assert_eq!(deliver(&mut conns, &wc(ids[0], 8, None)), (1, Ok(8)));
        assert!(matches!(complete(&mut conns, &wc(ids[0], 8, None)), Some((_, RecvOutcome::Stale))));
        // A reconnection: the teardown carries the lanes under the same epoch (one epoch a
        // queue pair) and empties the posted window, so a late completion of the old queue
        // pair during the redial wait is stale by the window, and by the epoch once the new
        // queue pair exists.
        let c = conns.get_mut(a).unwrap();
        let cleared = c.lanes.carry(None, c.lanes.epoch(), |_| true);
        assert_eq!((cleared.posted_recvs, c.lanes.epoch()), (1, ea), "the carry keeps the epoch");
        drop(cleared.into_cancelled(false));
        assert!(matches!(complete(&mut conns, &wc(ids[1], 8, None)), Some((_, RecvOutcome::Stale))));
        let ea2 = new_qp(&mut conns, &mut epochs, a);
        assert_eq!(ea2, ea + 1, "one epoch a reconnection");
        submit(&mut conns, a, 3);
        let again = post(&mut conns, a);
        assert!(complete(&mut conns, &wc(ids[1], 8, None)).is_none(), "the old queue pair's, after the new one");
        assert!(complete(&mut conns, &wc(id(ia, ea, Dir::Recv, seq_of(again[0])), 8, None)).is_none());
        assert_eq!(deliver(&mut conns, &wc(again[0], 4, None)), (3, Ok(4)));
        // b closes and another connection takes its slot: b's ids name nothing of it.
        submit(&mut conns, b, 9);
        let bid = post(&mut conns, b);
        conns.remove(b);
        assert!(complete(&mut conns, &wc(bid[0], 8, None)).is_none(), "a free slot");
        let c = conns.insert(conn(None));
        assert_eq!(c.token().index(), ib, "the slot is reused");
        assert!(stale(complete(&mut conns, &wc(bid[0], 8, None))), "before its queue pair");
        assert_eq!(new_qp(&mut conns, &mut epochs, c), eb + 1);
        submit(&mut conns, c, 10);
        let cid = post(&mut conns, c);
        assert_eq!(seq_of(cid[0]), seq_of(bid[0]), "the closed one's position: only the epoch tells them apart");
        assert!(complete(&mut conns, &wc(bid[0], 8, None)).is_none(), "the closed one's epoch");
        assert_eq!(deliver(&mut conns, &wc(cid[0], 1, None)), (10, Ok(1)));
        // Epochs wrap without panicking.
        let mut wrap = vec![u16::MAX];
        assert_eq!(next_epoch(&mut wrap, 0), 0);
    }

    /// A credit-only message's receive (review M1): queued again at the front of the queued
    /// receives, unseen by the handler, posted under a new position (its consumed `wr_id`
    /// stale from then on), and granted as a re-post (`on_repost(true)`) only once posted,
    /// with the send queue's credit state (the reactor's in step 2).
    #[test]
    fn a_credit_only_messages_receive_goes_again_first_under_a_new_id_granted_once_posted() {
        let mut epochs = Vec::new();
        let mut conns: GenSlab<ConnKey, TestConn> = GenSlab::new();
        let a = conns.insert(conn(flow(4)));
        new_qp(&mut conns, &mut epochs, a);
        submit(&mut conns, a, 1);
        let ids = post(&mut conns, a);
        submit(&mut conns, a, 2);
        let owed = |conns: &mut GenSlab<ConnKey, TestConn>| conns.get_mut(a).unwrap().lanes.flow_mut().unwrap().owed();
        let out = complete(&mut conns, &wc(ids[0], 0, Some(Imm::control(2))));
        assert!(matches!(out, Some((_, RecvOutcome::Control { farewell: Farewell::None }))), "{out:?}");
        let before = owed(&mut conns);
        let c = conns.get_mut(a).unwrap();
        assert_eq!(c.lanes.outstanding(), (0, 0));
        assert!(c.lanes.has_pending_recvs());
        assert!(matches!(complete(&mut conns, &wc(ids[0], 0, None)), Some((_, RecvOutcome::Stale))), "consumed");
        assert_eq!(owed(&mut conns), before, "nothing granted before it is posted");
        let again = post(&mut conns, a);
        assert_eq!(again.len(), 2);
        assert_eq!(owed(&mut conns), before + 2, "the re-post and the handler's receive, once each");
        assert_ne!(again[0], ids[0], "a new position");
        assert_eq!(seq_of(again[0]), seq_of(ids[0]) + 1);
        assert_eq!(deliver(&mut conns, &wc(again[0], 8, Some(Imm::data(0)))), (1, Ok(8)), "the re-post first");
        assert_eq!(deliver(&mut conns, &wc(again[1], 8, Some(Imm::data(0)))), (2, Ok(8)));
    }

    /// A connection under flow control with receives 1-3 posted (their `wr_id`s returned) and
    /// 4 queued, whose peer has spent every credit: its next message is beyond the credit.
    fn overdrawn_after_three_posted(
        conns: &mut GenSlab<ConnKey, TestConn>,
        epochs: &mut Vec<u16>,
    ) -> (ConnKey, Vec<u64>) {
        let t = conns.insert(conn(flow(4)));
        new_qp(conns, epochs, t);
        for u in 1..=3 {
            submit(conns, t, u);
        }
        let ids = post(conns, t);
        submit(conns, t, 4);
        let f = conns.get_mut(t).unwrap().lanes.flow_mut().unwrap();
        while !f.exhausted() {
            f.on_receive(Imm::data(0));
        }
        (t, ids)
    }

    /// A message beyond the credit (review M1): the receive goes to the side list (counted
    /// nowhere, reaching no handler), the connection's teardown cancels it after the posted
    /// ones, and a reconnection posts it first on the new queue pair.
    #[test]
    fn an_overdrawn_receive_waits_in_the_side_list_for_teardown_or_the_next_queue_pair() {
        let mut epochs = Vec::new();
        let mut conns: GenSlab<ConnKey, TestConn> = GenSlab::new();
        let (a, ids) = overdrawn_after_three_posted(&mut conns, &mut epochs);
        let out = complete(&mut conns, &wc(ids[0], 8, Some(Imm::data(0))));
        assert!(matches!(out, Some((_, RecvOutcome::Overdrawn))), "{out:?}");
        assert!(stale(complete(&mut conns, &wc(ids[0], 8, None))), "in the side list: no position of the window");
        // Teardown: posted Unconfirmed, then the side list and the queued Cancelled.
        let mut torn = conn(flow(4));
        std::mem::swap(&mut torn.lanes, &mut conns.get_mut(a).unwrap().lanes);
        let done: Vec<_> =
            torn.lanes.clear(None).into_cancelled(false).into_iter().map(|d| (d.user_data, d.result)).collect();
        let want = vec![
            (2, Err(OpError::Unconfirmed)),
            (3, Err(OpError::Unconfirmed)),
            (1, Err(OpError::Cancelled)),
            (4, Err(OpError::Cancelled)),
        ];
        assert_eq!(done, want);
        // The same again, carried to a new queue pair instead: the side list goes first.
        let (b, ids) = overdrawn_after_three_posted(&mut conns, &mut epochs);
        assert!(matches!(complete(&mut conns, &wc(ids[0], 8, None)), Some((_, RecvOutcome::Overdrawn))));
        let c = conns.get_mut(b).unwrap();
        let epoch = c.lanes.epoch();
        let done: Vec<_> = c
            .lanes
            .carry(None, epoch, |_| true)
            .into_cancelled(false)
            .into_iter()
            .map(|d| (d.user_data, d.result))
            .collect();
        assert_eq!(done, vec![(2, Err(OpError::Unconfirmed)), (3, Err(OpError::Unconfirmed))]);
        c.lanes.set_flow(flow(4));
        new_qp(&mut conns, &mut epochs, b);
        let again = post(&mut conns, b);
        assert_eq!(again.len(), 2);
        assert_eq!(deliver(&mut conns, &wc(again[0], 8, Some(Imm::data(0)))), (1, Ok(8)), "the side list first");
        assert_eq!(deliver(&mut conns, &wc(again[1], 8, Some(Imm::data(0)))), (4, Ok(8)));
    }

    /// `Core::complete_send` up to the handlers: the end of the positions the completion
    /// completes, `None` when it is counted stale.
    fn complete_send(conns: &mut GenSlab<ConnKey, TestConn>, wc: &WorkCompletion) -> Option<(ConnKey, u32)> {
        ring_send_completed(conns, wc, |c| &mut c.lanes).map(|(t, _, end)| (t, end))
    }

    /// A send completion's `wr_id` reaches its connection's send ring only with its epoch, its
    /// direction and a position in the posted window holding an operation: an earlier queue
    /// pair's, a receive-direction id, another slot's, a free slot's, a position not posted and
    /// a duplicate are each counted stale and complete nothing. The real one completes the
    /// unsignaled sends before it, in order, each with success, and itself with its status.
    #[test]
    fn a_send_completion_reaches_its_sends_only_with_its_epoch_direction_and_position() {
        use crate::proto::op::WcStatus;
        use crate::reactor::data::cq_room::CqRoom;
        let mut epochs = Vec::new();
        let mut conns: GenSlab<ConnKey, TestConn> = GenSlab::new();
        let a = conns.insert(conn(None));
        let b = conns.insert(conn(None));
        let (ia, ib) = (a.token().index(), b.token().index());
        let ea = new_qp(&mut conns, &mut epochs, a);
        let eb = new_qp(&mut conns, &mut epochs, b);
        let mut room = CqRoom::new(64, 0);
        let l = &mut conns.get_mut(a).unwrap().lanes;
        for u in 1..=3u64 {
            l.submit_send(Slot::raw(OpCode::Send, RawBuf { addr: 0x2000, len: 10 * u as u32, lkey: 7 }, u));
        }
        let run = l.plan_sends_imm(&mut room, 0);
        assert_eq!(run.n, 3);
        assert!(l.sends_posted(run, run.n, &mut room).is_none());
        assert_eq!(room.reserved(), 3);
        // The chain's last asks for the completion.
        let last = run.first + 2;
        let signaled = id(ia, ea, Dir::Send, last);
        let mut bad = wc(signaled, 0, None);
        bad.status = WcStatus::RemAccessErr;
        for stale in [
            id(ia, ea + 1, Dir::Send, last),
            id(ia, ea.wrapping_sub(1), Dir::Send, last),
            id(ia, ea, Dir::Recv, last),
            id(ib, eb, Dir::Send, last),
            id(WrId::MAX_INDEX, 1, Dir::Send, last),
            id(ia, ea, Dir::Send, run.first + 3),
            id(ia, ea, Dir::Send, run.first.wrapping_sub(1) & WrId::SEQ_MASK),
            0,
            u64::MAX,
        ] {
            assert!(complete_send(&mut conns, &wc(stale, 0, None)).is_none(), "{stale:#x}");
        }
        assert_eq!(conns.get(a).unwrap().lanes.free_slots(), 5, "no stale completion completed a send");
        let (t, end) = complete_send(&mut conns, &bad).expect("the signaled send");
        assert_eq!((t, end), (a, last + 1));
        let l = &mut conns.get_mut(a).unwrap().lanes;
        let mut seen = Vec::new();
        while let Some(op) = l.next_sent(end, &mut room, bad.status) {
            let done = op.take(&mut room, bad.status);
            seen.push((done.user_data, done.result));
        }
        let err = Err(OpError::Wc(WcStatus::RemAccessErr));
        assert_eq!(seen, vec![(1, Ok(10)), (2, Ok(20)), (3, err)], "in order; the signaled one with its status");
        assert_eq!(room.reserved(), 0, "each gave its CQ entry back once");
        assert!(complete_send(&mut conns, &bad).is_none(), "a duplicate");
        // A closed connection's slot: its ids name nothing of the next one there.
        conns.remove(a);
        assert!(complete_send(&mut conns, &wc(signaled, 0, None)).is_none(), "a free slot");
        let c = conns.insert(conn(None));
        assert_eq!(c.token().index(), ia);
        assert!(complete_send(&mut conns, &wc(signaled, 0, None)).is_none(), "before its queue pair");
        let ec = new_qp(&mut conns, &mut epochs, c);
        // c's sends at the same positions as a's: a's id still names a's epoch only.
        let l = &mut conns.get_mut(c).unwrap().lanes;
        for u in 4..=6u64 {
            l.submit_send(Slot::raw(OpCode::Send, RawBuf { addr: 0x2000, len: 8, lkey: 7 }, u));
        }
        let run_c = l.plan_sends_imm(&mut room, 0);
        assert!(l.sends_posted(run_c, run_c.n, &mut room).is_none());
        assert_eq!((run_c.first, run_c.n), (run.first, 3), "the same positions");
        assert!(complete_send(&mut conns, &wc(signaled, 0, None)).is_none(), "another queue pair's epoch");
        let own = id(ia, ec, Dir::Send, run_c.first + 2);
        assert_eq!(complete_send(&mut conns, &wc(own, 0, None)), Some((c, run_c.first + 3)));
    }
}
