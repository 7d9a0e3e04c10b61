//! Unit tests of the send and receive queues' planning: windows, credits, the backlog's
//! bounds and the order receives are given back in.

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
fn a_nudge_goes_ahead_of_credit_blocked_data_and_is_returned_at_teardown() {
    let k = keys(7);
    let (nudge, second) = (k[4], k[5]);
    // Three credits, one kept in reserve: two messages go, the third waits for a grant.
    let mut q = filled(16, &[k[0], k[1], k[6]], true);
    q.set_flow(flow(3, 8));
    let mut room = CqRoom::new(64, 16);
    assert_eq!(ops(&q.plan(&mut room, || unreachable!())), vec![k[0], k[1]]);
    assert!(q.credit_blocked());
    assert!(q.nudge(nudge));
    assert!(!q.nudge(second), "one nudge queued at a time");
    assert!(q.wants_post());
    let plan = q.plan(&mut room, || unreachable!());
    assert_eq!(ops(&plan), vec![nudge], "the nudge needs no credit and passes the blocked message");
    assert_eq!(plan.wrs[0].imm, None, "a zero-length WRITE carries no immediate data");
    assert!(plan.wrs[0].signaled);
    assert!(q.credit_blocked(), "the message still waits for its credit");
    // Never before the hello: the first message goes first.
    let mut h = filled(16, &k[2..3], true);
    h.set_hello(true);
    assert!(h.nudge(nudge));
    assert_eq!(ops(&h.plan(&mut room, || k[3])), vec![k[3], nudge, k[2]]);
    // A nudge still queued is returned with the rest at teardown and at a reconnection.
    let mut t = filled(16, &k[..1], true);
    t.set_hold(true);
    assert!(t.nudge(nudge));
    assert_eq!(t.clear(None), vec![nudge, k[0]]);
    let mut r = filled(16, &k[..1], true);
    r.set_hold(true);
    assert!(r.nudge(nudge));
    assert_eq!(r.carry(None, |_| true), vec![nudge], "the pending data is kept, the old queue pair's nudge is not");
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
    assert_eq!(rplan_only(&mut r, |o| o == k[1] || o == k[3] || o == k[4]).to_vec(), vec![k[1], k[3]], "room for two");
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

/// The byte stream's coalescing (issue 46, `data/append.rs`): only the last operation still
/// pending may grow, and its bytes count in the backlog until it is posted; once posted there
/// is nothing left to grow.
#[test]
fn only_the_last_pending_operation_grows_and_the_backlog_counts_it() {
    let k = keys(3);
    let mut room = CqRoom::new(64, 16);
    let mut q = filled(1, &k[..2], true);
    assert_eq!(q.last_pending(), Some(k[1]));
    assert_eq!(q.backlog(), (2, 128));
    q.grow_last(1000);
    assert_eq!(q.backlog(), (2, 1128), "the grown bytes are counted");
    let plan = q.plan(&mut room, || unreachable!());
    assert_eq!(ops(&plan), vec![k[0], k[1]]);
    q.posted(&plan, 2, &mut room).for_each(drop);
    assert_eq!((q.last_pending(), q.backlog()), (None, (0, 0)), "posted: nothing pending, nothing counted");
    q.grow_last(7);
    assert_eq!(q.backlog(), (0, 0), "no pending operation: nothing grows");
    q.push(k[2], true, 64);
    assert_eq!(q.last_pending(), Some(k[2]));
}
