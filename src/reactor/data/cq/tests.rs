//! Unit tests of the CQ protocol: a model CQ with completions injected anywhere in the
//! arm/poll sequence, the decision table after a poll, and the work lists.

//! The arm/poll race (catalogue case 25) on a model CQ with the notification semantics of
//! `ibv_req_notify_cq(3)`: arming asks for one event at the *next* completion; completions
//! already queued raise none. The driver below walks the same decisions as
//! `Core::poll_cq` and `Core::tick` (poll hot CQs, post, then poll, arm and poll again the
//! ones emptied), and a completion is injected at every point where the device could add
//! one: before each poll and between the last empty poll and the arm.

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

/// `Core::poll_cq`, on the model; `repoll: false` is the broken protocol that arms and
/// stops, and `on_error` chooses how a failed poll is read.
fn poll_cq_reading(
    cq: &mut ModelCq,
    r: &mut Reactor,
    inj: &mut Injector,
    budget: usize,
    arm_now: bool,
    repoll: bool,
    on_error: OnPollError,
) {
    let mut left = budget;
    let mut just_armed = false;
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
/// completion was left stranded in the CQ then.
fn run(inj: &mut Injector, first: u64, budget: usize, repoll: bool) -> (Reactor, ModelCq) {
    run_reading(inj, first, budget, repoll, OnPollError::FailTheCq)
}

/// [`run`], with a choice of how a failed poll is read.
fn run_reading(
    inj: &mut Injector,
    first: u64,
    budget: usize,
    repoll: bool,
    on_error: OnPollError,
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
            poll_cq_reading(&mut cq, &mut r, inj, budget, false, repoll, on_error);
            if evented && r.reaped.len() == before {
                r.spurious_events += 1;
            }
        }
        // Step 6: after the posts, poll, arm and poll again.
        if r.failed {
            // Failed: never polled or armed again; its connections are closed.
            return (r, cq);
        }
        if std::mem::take(&mut r.unarmed) {
            poll_cq_reading(&mut cq, &mut r, inj, budget, true, repoll, on_error);
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
    for budget in [1, 2, 3, 64] {
        for first in 1..4 {
            for a in 0..24 {
                for b in a..24 {
                    let mut inj = Injector::new(vec![a, b]);
                    let (r, cq) = run(&mut inj, first, budget, true);
                    let injected = inj.next;
                    assert!(
                        cq.queue.is_empty(),
                        "budget {budget}, {first} first, injected at {a} and {b}: {:?} stranded",
                        cq.queue
                    );
                    assert_eq!(r.reaped, (0..injected).collect::<Vec<_>>(), "each reaped once, in order");
                    assert!(r.armed && cq.armed, "asleep armed");
                }
            }
        }
    }
}

#[test]
fn the_repoll_after_the_arm_is_what_catches_the_race() {
    // The completion injected between the empty poll and the arm: first tick's hook
    // calls are poll (0), poll (1, empty), then at step 6 poll (2, empty), arm (3).
    let mut caught = 0;
    let mut stranded = 0;
    for at in 0..12 {
        let mut with = Injector::new(vec![at]);
        let (r, cq) = run(&mut with, 1, 64, true);
        assert!(cq.queue.is_empty());
        caught += r.catches;
        let mut without = Injector::new(vec![at]);
        let (_, cq) = run(&mut without, 1, 64, false);
        stranded += cq.queue.len();
    }
    assert!(caught > 0, "the poll after the arm found the raced completion");
    assert!(stranded > 0, "arming without polling again strands it: the test can fail");
}

#[test]
fn an_event_with_an_empty_cq_is_harmless() {
    // Injected after the arm and before the poll that follows it: the poll reaps it and
    // the event it raised later finds the CQ empty.
    let mut spurious = 0;
    for at in 0..12 {
        let mut inj = Injector::new(vec![at]);
        let (r, cq) = run(&mut inj, 1, 64, true);
        assert!(cq.queue.is_empty() && r.armed && cq.armed);
        assert_eq!(r.reaped.len() as u64, inj.next);
        spurious += r.spurious_events;
    }
    assert!(spurious > 0, "some injection point gives an event with an empty CQ");
}

/// Fault issue, defect 2: a failed `ibv_poll_cq` was read as "empty" (`unwrap_or(0)`):
/// the CQ was then armed or left as done with completions still in it, and its
/// connections waited forever with operations outstanding. Now it fails the CQ (its
/// connections close with `CqFailed`). On rxe a poll cannot fail (it reads a user-space
/// ring), so this is shown on the model: polls break at every point of a run with
/// completions queued and arriving.
#[test]
fn a_failed_poll_fails_the_cq_and_never_reads_as_empty() {
    let mut stranded_before = 0;
    for break_at in 0..16 {
        for first in 1..4 {
            let mut inj = Injector { break_at: Some(break_at), ..Injector::new(vec![1, 5, 9]) };
            let (r, cq) = run(&mut inj, first, 64, true);
            // Whatever was not reaped is in a failed CQ whose connections were told.
            assert!(
                cq.queue.is_empty() || r.failed,
                "polls broken at {break_at}, {first} first: {:?} left behind, CQ not failed",
                cq.queue
            );
            assert!(r.failed || !cq.broken, "a broken CQ that was polled is failed");
            let mut old = Injector { break_at: Some(break_at), ..Injector::new(vec![1, 5, 9]) };
            let (r, cq) = run_reading(&mut old, first, 64, true, OnPollError::ReadAsEmpty);
            if !r.failed && !cq.queue.is_empty() {
                stranded_before += 1;
            }
        }
    }
    assert!(stranded_before > 0, "read as empty, completions are stranded: the test can fail");
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

/// Issue 47: a ring `wr_id` names a connection only at its slot with its queue pair's epoch.
/// An earlier queue pair's id (a reconnection's, or a closed connection's at a slot taken by
/// another), a free slot and a forged value are refused (counted stale by `Core::complete`),
/// and decoding and looking up never panic on any value.
#[test]
fn a_ring_wr_id_names_a_connection_only_with_its_epoch() {
    use super::{next_epoch, ring_conn};
    use crate::proto::token::{ConnKey, Dir, GenSlab, Key, WrId};

    let mut epochs = Vec::new();
    let mut conns: GenSlab<ConnKey, u16> = GenSlab::new();
    let a = conns.insert(0);
    let b = conns.insert(0);
    let (ia, ib) = (a.token().index(), b.token().index());
    // Each queue pair a slot gets takes the next epoch; slots count apart.
    *conns.get_mut(a).unwrap() = next_epoch(&mut epochs, ia);
    *conns.get_mut(b).unwrap() = next_epoch(&mut epochs, ib);
    assert_eq!((*conns.get(a).unwrap(), *conns.get(b).unwrap()), (1, 1));
    let id = |index, epoch, dir, seq| WrId::decode(WrId::at(WrId::base(index, epoch, dir).unwrap(), seq)).unwrap();
    let found = ring_conn(&mut conns, id(ia, 1, Dir::Recv, 7), |e| *e).map(|(t, _, id)| (t, id.seq, id.dir));
    assert_eq!(found, Some((a, 7, Dir::Recv)));
    // A reconnection: a new queue pair at the same slot. The old one's ids are stale.
    let old = id(ia, 1, Dir::Send, 3);
    *conns.get_mut(a).unwrap() = next_epoch(&mut epochs, ia);
    assert!(ring_conn(&mut conns, old, |e| *e).is_none(), "an earlier queue pair's completion");
    assert!(ring_conn(&mut conns, id(ia, 2, Dir::Send, 3), |e| *e).is_some());
    // The connection closes and another takes its slot: its ids do not name the newcomer.
    conns.remove(a);
    assert!(ring_conn(&mut conns, id(ia, 2, Dir::Send, 3), |e| *e).is_none(), "a free slot");
    let c = conns.insert(0);
    assert_eq!(c.token().index(), ia, "the slot is reused");
    *conns.get_mut(c).unwrap() = next_epoch(&mut epochs, ia);
    assert!(ring_conn(&mut conns, id(ia, 2, Dir::Send, 3), |e| *e).is_none(), "the closed one's epoch");
    assert!(ring_conn(&mut conns, id(ia, 3, Dir::Send, 3), |e| *e).is_some());
    // Beyond the table, and values that are no ring id at all.
    assert!(ring_conn(&mut conns, id(WrId::MAX_INDEX, 3, Dir::Recv, 0), |e| *e).is_none());
    for raw in [0, u64::MAX, 0xA000_0000_0000_0000, 0xAFFF_FFFF_FFFF_FFFF, 0x0B00_0001_0000_0001] {
        if let Some(id) = WrId::decode(raw) {
            let _ = ring_conn(&mut conns, id, |e| *e);
        }
    }
    // Epochs wrap without panicking.
    let mut wrap = vec![u16::MAX];
    assert_eq!(next_epoch(&mut wrap, 0), 0);
}
