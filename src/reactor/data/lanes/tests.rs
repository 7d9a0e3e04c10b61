//! Unit tests of the lanes: scripted sequences of the receive path's cases, and a differential
//! test that drives `SendQueue` (today's planner) and the lanes with the same random scripts and
//! compares every chain, completion and counter.

use super::*;
use crate::proto::flow::negotiate;
use crate::proto::token::{GenSlab, OpKey};
use crate::proto::wire::ConnectInfo;
use crate::reactor::data::send_queue::{Plan, SendQueue};
use crate::sys::cq::WorkCompletion;

type L = Lanes<IndexBuf>;

fn flow(peer_depth: u16, depth: u32) -> Option<Flow> {
    let peer = ConnectInfo { flow_control: true, recv_depth: peer_depth, ..ConnectInfo::default() };
    negotiate(true, depth, Some(&peer))
}

fn raw(len: u32) -> RawBuf {
    RawBuf { addr: 0x1000, len, lkey: 7 }
}

impl<B: LaneBuf> Slot<B> {
    /// A zero-length RDMA WRITE to `remote` (a one-sided operation naming the peer's key).
    fn region_free_write(remote: RemoteSlice, user_data: u64) -> Slot<B> {
        Slot { remote, user_data, ..Slot::raw(OpCode::Write, raw(0), 0) }
    }
}

fn lanes(send: u32, recv: u32, flow: Option<Flow>) -> L {
    let mut l = L::new(3, 1, 4).expect("an index in range");
    l.set_capacity(send, recv);
    l.set_flow(flow);
    l
}

/// A successful receive completion of `wr_id` with `byte_len` bytes and immediate data `imm`
/// (the completion-path tests of `data::cq` use it too).
pub(in crate::reactor) fn wc(wr_id: u64, byte_len: u32, imm: Option<Imm>) -> WorkCompletion {
    WorkCompletion {
        wr_id,
        status: WcStatus::Success,
        byte_len,
        imm: imm.map(Imm::encode),
        remote_write: false,
        qp_num: 1,
    }
}

fn seq_of(wr_id: u64) -> u32 {
    WrId::decode(wr_id).expect("a ring id").seq
}

/// Posts every receive queued now (all taken) and returns their `wr_id`s.
fn post_recvs(l: &mut L, finishing: bool) -> Vec<u64> {
    let (first, n) = l.plan_recvs(finishing);
    assert!(l.recvs_posted(n, n, true).is_none());
    (0..n).map(|k| l.recv.wr_id(first.wrapping_add(k))).collect()
}

/// A receive's completion as the handler gets it, with `wake`: taken out of its slot when
/// `out` delivers it (the outcome back otherwise).
fn delivered(l: &mut L, out: RecvOutcome) -> Result<(Done<IndexBuf>, bool), RecvOutcome> {
    match out {
        RecvOutcome::Deliver { delivery, wake } => Ok((l.take_recv(delivery), wake)),
        other => Err(other),
    }
}

#[test]
fn a_receive_completes_with_its_bytes_and_grants_and_a_stale_one_reaches_nothing() {
    let mut l = lanes(8, 4, flow(4, 4));
    l.submit_recv(Slot::raw(OpCode::Recv, raw(64), 10));
    l.submit_recv(Slot::raw(OpCode::Recv, raw(64), 11));
    let ids = post_recvs(&mut l, false);
    assert_eq!(ids.len(), 2);
    assert_eq!(l.flow_mut().map(|f| f.owed()), Some(2), "each posted receive is owed as a grant");
    let first = l.recv_completed(seq_of(ids[0]), &wc(ids[0], 40, Some(Imm::data(3))), false);
    match delivered(&mut l, first) {
        Ok((done, wake)) => {
            assert_eq!((done.user_data, done.opcode, done.result), (10, OpCode::Recv, Ok(40)));
            assert!(wake, "2 receives owed, half the depth: a grant is due");
        }
        Err(other) => panic!("{other:?}"),
    }
    assert_eq!(l.flow_mut().map(|f| f.credits()), Some(4 + 3), "the grant it carried");
    // The same completion again, and a position never posted: stale.
    assert!(matches!(l.recv_completed(seq_of(ids[0]), &wc(ids[0], 40, None), false), RecvOutcome::Stale));
    assert!(matches!(l.recv_completed(seq_of(ids[1]) + 1, &wc(0, 1, None), false), RecvOutcome::Stale));
    // An error completes it too, its error reported.
    let mut err = wc(ids[1], 0, None);
    err.status = WcStatus::WrFlushErr;
    let out = l.recv_completed(seq_of(ids[1]), &err, false);
    match delivered(&mut l, out) {
        Ok((done, _)) => assert_eq!(done.result, Err(OpError::Wc(WcStatus::WrFlushErr))),
        Err(other) => panic!("{other:?}"),
    }
    assert_eq!(l.outstanding(), (0, 0));
}

#[test]
fn a_credit_only_message_reposts_its_receive_ahead_of_the_queued_ones() {
    let mut l = lanes(8, 4, flow(4, 4));
    l.submit_recv(Slot::raw(OpCode::Recv, raw(64), 1));
    let ids = post_recvs(&mut l, false);
    l.submit_recv(Slot::raw(OpCode::Recv, raw(64), 2));
    let out = l.recv_completed(seq_of(ids[0]), &wc(ids[0], 0, Some(Imm::control(2))), false);
    assert!(matches!(out, RecvOutcome::Control { farewell: Farewell::None }));
    // The re-post goes first, and is owed as a credit-only message's grant.
    let owed_before = l.flow_mut().map(|f| f.owed()).unwrap();
    let again = post_recvs(&mut l, false);
    assert_eq!(again.len(), 2);
    assert_eq!(l.flow_mut().map(|f| f.owed()), Some(owed_before + 2));
    let first = l.recv_completed(seq_of(again[0]), &wc(again[0], 8, Some(Imm::data(0))), false);
    assert_eq!(
        delivered(&mut l, first).ok().map(|(d, _)| d.user_data),
        Some(1),
        "the re-posted receive completes first"
    );
}

#[test]
fn saying_goodbye_posts_only_the_reposts() {
    let mut l = lanes(8, 4, flow(4, 4));
    l.submit_recv(Slot::raw(OpCode::Recv, raw(64), 1));
    let ids = post_recvs(&mut l, false);
    // The handler's receive, then a credit-only message's re-post (queued ahead of it).
    l.submit_recv(Slot::raw(OpCode::Recv, raw(64), 2));
    assert!(matches!(
        l.recv_completed(seq_of(ids[0]), &wc(ids[0], 0, Some(Imm::control(0))), false),
        RecvOutcome::Control { .. }
    ));
    assert_eq!(post_recvs(&mut l, true).len(), 1, "the re-post alone");
    assert!(l.has_pending_recvs(), "the handler's receive stays queued (cancelled at teardown)");
    assert_eq!(post_recvs(&mut l, true).len(), 0);
}

#[test]
fn a_refused_message_leaves_its_receive_in_the_side_list_for_teardown_or_the_next_queue_pair() {
    // The peer holds no grant of ours: its message breaks the credit.
    let mut l = lanes(8, 4, flow(4, 4));
    for u in 1..=3 {
        l.submit_recv(Slot::raw(OpCode::Recv, raw(64), u));
    }
    let ids = post_recvs(&mut l, false);
    for _ in 0..4 {
        l.flow_mut().unwrap().on_receive(Imm::data(0));
    }
    assert!(l.flow_mut().unwrap().exhausted());
    assert!(matches!(
        l.recv_completed(seq_of(ids[0]), &wc(ids[0], 8, Some(Imm::data(0))), false),
        RecvOutcome::Overdrawn
    ));
    // A broken frame (iWARP: the tail is read from the memory) likewise.
    let mut l2 = lanes(8, 4, None);
    l2.submit_recv(Slot::raw(OpCode::Recv, raw(64), 9));
    let id2 = post_recvs(&mut l2, false);
    assert!(matches!(l2.recv_completed(seq_of(id2[0]), &wc(id2[0], 2, None), true), RecvOutcome::BadFrame(_)));
    let cleared = l2.clear(None);
    assert_eq!(cleared.recvs.iter().map(|s| s.user_data).collect::<Vec<_>>(), vec![9]);
    assert_eq!(cleared.posted_recvs, 0, "given back by a refused message: not posted any more");
    // Teardown: the posted ones, then the side list, then the queued.
    l.submit_recv(Slot::raw(OpCode::Recv, raw(64), 4));
    let cleared = l.clear(None);
    assert_eq!(cleared.recvs.iter().map(|s| s.user_data).collect::<Vec<_>>(), vec![2, 3, 1, 4]);
    assert_eq!(cleared.posted_recvs, 2, "2 and 3 were posted (Unconfirmed), 1 and 4 not (Cancelled)");
}

#[test]
fn a_reconnection_posts_the_side_list_first_under_a_new_epoch() {
    let mut l = lanes(8, 4, flow(4, 4));
    for u in 1..=2 {
        l.submit_recv(Slot::raw(OpCode::Recv, raw(64), u));
    }
    let ids = post_recvs(&mut l, false);
    for _ in 0..4 {
        l.flow_mut().unwrap().on_receive(Imm::data(0));
    }
    assert!(matches!(l.recv_completed(seq_of(ids[0]), &wc(ids[0], 8, None), false), RecvOutcome::Overdrawn));
    l.submit_recv(Slot::raw(OpCode::Recv, raw(64), 3));
    l.submit_send(Slot::raw(OpCode::Send, raw(8), 20));
    l.submit_send(Slot::control());
    let remote = RemoteSlice { addr: 0x10, len: 8, rkey: 9 };
    l.submit_send(Slot::<IndexBuf>::region_free_write(remote, 21));
    let carried = l.carry(None, 2, |s| !s.is_one_sided());
    assert_eq!(carried.recvs.iter().map(|s| s.user_data).collect::<Vec<_>>(), vec![2], "the old queue pair's");
    assert_eq!(carried.posted_recvs, 1);
    assert_eq!(carried.sends.len(), 2, "the runtime's own message and the WRITE naming the old peer's key");
    assert_eq!(carried.posted_sends, 0);
    l.set_capacity(8, 4);
    l.set_flow(flow(4, 4));
    let (first, n) = l.plan_recvs(false);
    let order: Vec<u64> = (0..n).map(|k| l.recv.queued_at(k).unwrap().user_data).collect();
    assert_eq!(order, vec![1, 3], "the side list first");
    assert_eq!(WrId::decode(l.recv.wr_id(first)).unwrap().epoch, 2);
    assert!(l.recvs_posted(n, n, true).is_none());
    let mut room = CqRoom::new(64, 16);
    let run = l.plan_sends_imm(&mut room, 0);
    assert_eq!(run.n, 1);
    assert_eq!(l.swrs.view(run.first).wr_id >> 24 & 0xFFFF, 2, "the send's id names the new epoch");
}

/// Review L5: a re-post after a credit-only message carried to a new queue pair is an
/// ordinary receive there (its grant was the old credit state's), so the flagged receives stay
/// a prefix of the queued ones and saying goodbye on the new queue pair posts none of the
/// carried ones.
#[test]
fn a_carried_repost_is_an_ordinary_receive_of_the_next_queue_pair() {
    let mut l = lanes(8, 4, flow(4, 4));
    for u in 1..=2 {
        l.submit_recv(Slot::raw(OpCode::Recv, raw(64), u));
    }
    let ids = post_recvs(&mut l, false);
    l.submit_recv(Slot::raw(OpCode::Recv, raw(64), 3));
    assert!(matches!(
        l.recv_completed(seq_of(ids[0]), &wc(ids[0], 0, Some(Imm::control(0))), false),
        RecvOutcome::Control { .. }
    ));
    for _ in 0..4 {
        l.flow_mut().unwrap().on_receive(Imm::data(0));
    }
    assert!(matches!(l.recv_completed(seq_of(ids[1]), &wc(ids[1], 8, None), false), RecvOutcome::Overdrawn));
    // Queued now: the re-post of 1 (flagged), then 3; 2 in the side list.
    let epoch = l.epoch();
    let carried = l.carry(None, epoch, |_| true);
    assert_eq!(carried.posted_recvs, 0);
    assert!(l.set_id(3, epoch + 1));
    l.set_capacity(8, 4);
    l.set_flow(flow(4, 4));
    assert_eq!(l.plan_recvs(true).1, 0, "saying goodbye, nothing carried is a re-post");
    let (_, n) = l.plan_recvs(false);
    let order: Vec<u64> = (0..n).map(|k| l.recv.queued_at(k).unwrap().user_data).collect();
    assert_eq!(order, vec![2, 1, 3], "the side list first, then the queued in order");
    let owed = l.flow_mut().map(|f| f.owed());
    assert!(l.recvs_posted(n, n, true).is_none());
    assert_eq!(l.flow_mut().map(|f| f.owed()), owed.map(|o| o + 3));
}

#[test]
fn a_partly_refused_receive_chain_gives_back_the_rest_in_order() {
    let mut l = lanes(8, 8, None);
    for u in 1..=4 {
        l.submit_recv(Slot::raw(OpCode::Recv, raw(64), u));
    }
    let (_, n) = l.plan_recvs(false);
    let refused = l.recvs_posted(1, n, false).expect("refused");
    assert_eq!(refused.iter().map(|s| s.user_data).collect::<Vec<_>>(), vec![2, 3, 4]);
    assert_eq!(l.outstanding(), (0, 1));
    assert!(!l.has_pending_recvs());
}

/// Review L1: receives posted while they grant nothing yet (before the connect information
/// went) leave the credit state in place; it was dropped, turning flow control off.
#[test]
fn receives_posted_before_the_grants_leave_the_credit_state_alone() {
    let mut l = lanes(8, 4, flow(4, 4));
    let owed = l.flow_mut().map(|f| f.owed());
    l.submit_recv(Slot::raw(OpCode::Recv, raw(64), 1));
    let (_, n) = l.plan_recvs(false);
    assert!(l.recvs_posted(n, n, false).is_none());
    assert!(l.flow_mut().is_some(), "flow control stays on");
    assert_eq!(l.flow_mut().map(|f| f.owed()), owed, "nothing granted");
    l.submit_recv(Slot::raw(OpCode::Recv, raw(64), 2));
    assert_eq!(post_recvs(&mut l, false).len(), 1);
    assert_eq!(l.flow_mut().map(|f| f.owed()), owed.map(|o| o + 1), "granted once the grants go");
}

/// Review L3: the lanes are never renamed with requests outstanding (their slots hold memory
/// the device may write): refused, nothing dropped, nothing renamed; and never beyond the
/// slot index a `wr_id` carries.
#[test]
fn renaming_with_requests_outstanding_is_refused_and_drops_nothing() {
    let mut l = lanes(8, 4, None);
    for u in 1..=2 {
        l.submit_recv(Slot::raw(OpCode::Recv, raw(64), u));
    }
    let ids = post_recvs(&mut l, false);
    let epoch = l.epoch();
    assert_eq!(l.can_rename(3), Err(Rename::Outstanding { sends: 0, recvs: 2 }));
    assert!(!l.set_id(3, epoch + 1));
    assert_eq!((l.epoch(), l.outstanding()), (epoch, (0, 2)), "nothing renamed, nothing dropped");
    let out = l.recv_completed(seq_of(ids[1]), &wc(ids[1], 8, None), false);
    assert_eq!(delivered(&mut l, out).ok().map(|(d, _)| d.user_data), Some(2), "still there");
    assert_eq!(l.can_rename(WrId::MAX_INDEX + 1), Err(Rename::IndexBeyond));
    drop(l.clear(None));
    assert_eq!(l.can_rename(3), Ok(()));
    assert!(l.set_id(3, epoch + 1));
    assert_eq!(l.epoch(), epoch + 1);
    let mut fresh = L::new(0, 0, 4).expect("slot 0");
    assert!(!fresh.set_id(WrId::MAX_INDEX + 1, 1), "beyond the 20 bits of a wr_id");
    assert_eq!(fresh.epoch(), 0);
    assert!(fresh.set_id(WrId::MAX_INDEX, 1));
    assert!(L::new(WrId::MAX_INDEX + 1, 0, 4).is_none());
}

/// Review L2 and M1: teardown completes every operation the lanes hand back once, the runtime's
/// own excepted: posted ones `Unconfirmed` (a posted receive on an iWARP queue pair whose
/// stream ended: flushed), the others `Cancelled`; sends first, receives in the order posted,
/// side list, queued; the CQ room of the posted sends given back.
#[test]
fn teardown_completes_each_operation_once_posted_unconfirmed_the_rest_cancelled() {
    assert_eq!(teardown_error(true, false, true), OpError::Unconfirmed, "a send is never flushed so");
    assert_eq!(teardown_error(true, true, true), OpError::Wc(WcStatus::WrFlushErr));
    assert_eq!(teardown_error(true, true, false), OpError::Unconfirmed);
    assert_eq!(teardown_error(false, true, true), OpError::Cancelled);
    for stream_closed in [false, true] {
        let mut l = lanes(8, 8, flow(4, 4));
        for u in 1..=3 {
            l.submit_recv(Slot::raw(OpCode::Recv, raw(64), u));
        }
        let ids = post_recvs(&mut l, false);
        for _ in 0..4 {
            l.flow_mut().unwrap().on_receive(Imm::data(0));
        }
        assert!(matches!(l.recv_completed(seq_of(ids[0]), &wc(ids[0], 8, None), false), RecvOutcome::Overdrawn));
        l.submit_recv(Slot::raw(OpCode::Recv, raw(64), 4));
        // A send posted, then one queued behind a credit-only message of the runtime's.
        l.set_flow(None);
        let mut room = CqRoom::new(64, 16);
        l.submit_send(Slot::raw(OpCode::Send, raw(8), 20));
        let run = l.plan_sends_imm(&mut room, 0);
        assert_eq!(run.n, 1);
        assert!(l.sends_posted(run, run.n, &mut room).is_none());
        l.submit_send(Slot::control());
        l.submit_send(Slot::raw(OpCode::Send, raw(8), 21));
        assert_eq!(room.reserved(), 1);
        let done: Vec<_> = l
            .clear(Some(&mut room))
            .into_cancelled(stream_closed)
            .into_iter()
            .map(|d| (d.user_data, d.opcode, d.result))
            .collect();
        assert_eq!(room.reserved(), 0, "the posted send's CQ entry is given back");
        let posted_recv = if stream_closed { OpError::Wc(WcStatus::WrFlushErr) } else { OpError::Unconfirmed };
        let want = vec![
            (20, OpCode::Send, Err(OpError::Unconfirmed)),
            (21, OpCode::Send, Err(OpError::Cancelled)),
            (2, OpCode::Recv, Err(posted_recv)),
            (3, OpCode::Recv, Err(posted_recv)),
            (1, OpCode::Recv, Err(OpError::Cancelled)),
            (4, OpCode::Recv, Err(OpError::Cancelled)),
        ];
        assert_eq!(done, want, "stream closed: {stream_closed}");
        assert_eq!(l.outstanding(), (0, 0));
        assert!(!l.has_pending_recvs());
    }
}

#[test]
fn a_send_is_written_in_place_with_its_credits_and_signaling() {
    let mut l = lanes(4, 4, flow(8, 8));
    l.flow_mut().unwrap().on_repost(false);
    l.submit_send(Slot::raw(OpCode::Send, raw(100), 5));
    l.submit_send(Slot::raw(OpCode::Send, raw(16), 6));
    let mut room = CqRoom::new(64, 16);
    let run = l.plan_sends_imm(&mut room, 64);
    assert_eq!(run.n, 2);
    let (a, b) = (l.swrs.view(run.first), l.swrs.view(run.first + 1));
    assert_eq!((a.op, a.imm, a.len, a.signaled, a.inline), ("send_imm", 1, 100, false, false), "the owed grant");
    assert_eq!((b.op, b.imm, b.len, b.signaled, b.inline), ("send_imm", 0, 16, true, true), "the chain's last");
    assert!(l.sends_posted(run, 2, &mut room).is_none());
    assert_eq!(room.reserved(), 2);
    // The signaled completion completes both, in order, giving back their room.
    let end = l.send_completed(seq_of(b.wr_id)).expect("outstanding");
    let mut done = Vec::new();
    while let Some((_, s, _)) = l.pop_sent(end, &mut room) {
        done.push(s.user_data);
    }
    assert_eq!((done, room.reserved()), (vec![5, 6], 0));
    assert!(l.send_completed(seq_of(b.wr_id)).is_none(), "stale now");
}

/// Lanes with one chain posted: a nudge (the runtime's own probe), sends 1 to 5 (2 a WRITE),
/// then whatever credit-only message the flow owes; signaled every 2 and the chain's last.
/// Returns the lanes, their CQ room and the posted `wr_id`s with "signaled".
fn posted_chain() -> (L, CqRoom, Vec<(u64, bool)>) {
    let mut l = L::new(2, 1, 2).unwrap();
    l.set_capacity(16, 4);
    l.set_flow(flow(8, 4));
    l.nudge();
    for u in 1..=5 {
        let op = if u == 2 { OpCode::Write } else { OpCode::Send };
        l.submit_send(Slot::raw(op, raw(8 * u as u32), u));
    }
    // Receives re-posted after data: a grant is owed, and rides on the first send.
    for _ in 0..3 {
        l.flow_mut().unwrap().on_repost(false);
    }
    let mut room = CqRoom::new(64, 16);
    let run = l.plan_sends_imm(&mut room, 0);
    let ids = (0..run.n).map(|k| l.swrs.view(run.first + k)).map(|v| (v.wr_id, v.signaled)).collect();
    assert!(l.sends_posted(run, run.n, &mut room).is_none());
    (l, room, ids)
}

/// The completion path's two steps (`next_sent`, `SentOp::take`) pop what `pop_sent` pops, in the
/// same order, the runtime's own skipped, each with its CQ entry given back; the work
/// completion's status goes to the signaled request only.
#[test]
fn the_completion_path_pops_a_send_completion_as_pop_sent_does() {
    for status in [WcStatus::Success, WcStatus::RetryExcErr] {
        let (mut a, mut room_a, ids) = posted_chain();
        let (mut b, mut room_b, _) = posted_chain();
        assert!(ids.len() >= 6, "the probe and the five: {ids:?}");
        // Each signaled completion in turn (in order, as RC reports them).
        for (wr_id, _) in ids.iter().filter(|(_, signaled)| *signaled) {
            let end = a.send_completed(seq_of(*wr_id)).expect("outstanding");
            assert_eq!(b.send_completed(seq_of(*wr_id)), Some(end));
            let mut popped = Vec::new();
            while let Some((at, slot, _)) = a.pop_sent(end, &mut room_a) {
                if !slot.is_control() {
                    let result = if at.wrapping_add(1) == end && status != WcStatus::Success {
                        Err(OpError::Wc(status))
                    } else {
                        Ok(slot.posted_len())
                    };
                    popped.push((slot.user_data, result));
                }
            }
            let mut taken = Vec::new();
            while let Some(op) = b.next_sent(end, &mut room_b, status) {
                let more = op.more();
                assert_eq!(more, op.at().wrapping_add(1) != end);
                let done = op.take(&mut room_b, status);
                assert_eq!(done.opcode == OpCode::Write, done.user_data == 2);
                taken.push((done.user_data, done.result));
                if !more {
                    break;
                }
            }
            assert_eq!(taken, popped, "the operations completed by {wr_id:#x}");
            assert_eq!(room_a, room_b);
            assert_eq!((a.outstanding(), a.awaited()), (b.outstanding(), b.awaited()));
        }
        assert_eq!(b.outstanding().0, 0, "everything completed");
    }
}

/// A send completion whose last operations are the runtime's own (here a credit-only message
/// alone) finds none for a handler: `next_sent` drops them, gives back their CQ entries, counts
/// the credit-only message for the meter when its completion succeeded, and says `None` (the
/// caller's `after_completion` is still due: a send waiting for the slot it held may go now).
#[test]
fn a_credit_only_message_completes_without_a_handler_and_is_counted() {
    for status in [WcStatus::Success, WcStatus::RetryExcErr] {
        let mut l = L::new(2, 1, 2).unwrap();
        l.set_capacity(1, 4);
        l.set_flow(flow(8, 4));
        for _ in 0..3 {
            l.flow_mut().unwrap().on_repost(false);
        }
        let mut room = CqRoom::new(64, 16);
        let run = l.plan_sends_imm(&mut room, 0);
        assert_eq!(run.n, 1, "a credit-only message alone");
        let (wr_id, signaled) = {
            let v = l.swrs.view(run.first);
            (v.wr_id, v.signaled)
        };
        assert!(signaled, "the chain's last");
        assert!(l.sends_posted(run, run.n, &mut room).is_none());
        // A send submitted meanwhile waits for the one send slot.
        l.submit_send(Slot::raw(OpCode::Send, raw(8), 9));
        assert_eq!(l.plan_sends_imm(&mut room, 0).n, 0, "no free send slot");
        let end = l.send_completed(seq_of(wr_id)).expect("outstanding");
        assert!(l.next_sent(end, &mut room, status).is_none(), "nothing for a handler");
        assert_eq!(l.outstanding().0, 0);
        assert_eq!(room.reserved(), 0, "its CQ entry back");
        assert_eq!(l.take_credit_messages_sent(), u32::from(status == WcStatus::Success));
        assert_eq!(l.take_credit_messages_sent(), 0, "taken");
        assert!(l.wants_post(), "the waiting send may go now");
        assert_eq!(l.plan_sends_imm(&mut room, 0).n, 1);
    }
}

/// A receive completion wakes its connection for what it unblocks, and only for that: credits
/// arriving while sends wait for them, credits owed, a receive slot freed while receives wait.
#[test]
fn a_receive_completion_wakes_the_connection_for_what_it_unblocks() {
    let wake = |out: RecvOutcome| match out {
        RecvOutcome::Deliver { wake, .. } => wake,
        other => panic!("{other:?}"),
    };
    // Nothing waits: no wake.
    let mut l = lanes(8, 4, flow(8, 4));
    l.submit_recv(Slot::raw(OpCode::Recv, raw(64), 1));
    let ids = post_recvs(&mut l, false);
    let out = l.recv_completed(seq_of(ids[0]), &wc(ids[0], 8, Some(Imm::data(1))), false);
    assert!(!wake(out));
    // A send waits for credits (one left, the reserve): a grant wakes it, none does not.
    let mut l = lanes(8, 4, Some(Flow::new(1, 8)));
    l.submit_send(Slot::raw(OpCode::Send, raw(8), 7));
    l.submit_recv(Slot::raw(OpCode::Recv, raw(64), 1));
    l.submit_recv(Slot::raw(OpCode::Recv, raw(64), 2));
    let ids = post_recvs(&mut l, false);
    assert!(l.credit_blocked());
    let out = l.recv_completed(seq_of(ids[0]), &wc(ids[0], 8, Some(Imm::data(0))), false);
    assert!(!wake(out), "no credit came: the send still waits");
    let out = l.recv_completed(seq_of(ids[1]), &wc(ids[1], 8, Some(Imm::data(2))), false);
    assert!(wake(out), "credits for the waiting send");
    // A receive waits for a receive slot (the queue pair holds one): a completion frees it.
    let mut l = lanes(8, 1, None);
    l.submit_recv(Slot::raw(OpCode::Recv, raw(64), 1));
    l.submit_recv(Slot::raw(OpCode::Recv, raw(64), 2));
    let ids = post_recvs(&mut l, false);
    assert_eq!((ids.len(), l.has_pending_recvs()), (1, true));
    let out = l.recv_completed(seq_of(ids[0]), &wc(ids[0], 8, None), false);
    assert!(wake(out), "the waiting receive may go");
}

#[test]
fn a_partly_refused_send_chain_awaits_nothing_that_cannot_come() {
    let mut l = L::new(0, 1, 2).unwrap();
    l.set_capacity(8, 0);
    for u in 1..=5 {
        l.submit_send(Slot::raw(OpCode::Write, raw(8), u));
    }
    let mut room = CqRoom::new(64, 16);
    let run = l.plan_sends_imm(&mut room, 0);
    assert_eq!(run.n, 5);
    // Signaled: the 2nd, the 4th and the last. The device takes 3: the 3rd is never reported.
    let refused = l.sends_posted(run, 3, &mut room).expect("refused");
    assert_eq!(refused.iter().map(|s| s.user_data).collect::<Vec<_>>(), vec![4, 5]);
    assert_eq!((l.outstanding().0, l.awaited()), (3, 2));
    assert_eq!(room.reserved(), 3);
    // Defect 8's case: a prefix with no signaled request awaits nothing.
    let mut u = L::new(0, 1, 4).unwrap();
    u.set_capacity(8, 0);
    for k in 1..=4 {
        u.submit_send(Slot::raw(OpCode::Write, raw(8), k));
    }
    let run = u.plan_sends_imm(&mut room, 0);
    assert_eq!(run.n, 4, "only the last signaled (one in four)");
    let refused = u.sends_posted(run, 2, &mut room).expect("refused");
    assert_eq!(refused.len(), 2);
    assert_eq!((u.outstanding().0, u.awaited()), (2, 0), "no completion can come for the two taken");
}

/// A send completion completes all its requests at once, as the device reported them: while
/// their handlers are called one by one, each handler sees the others completed too (their
/// send slots free for what it submits, `Config::send_backlog`'s rule, and `Conn::outstanding`),
/// as when the operation slab popped them all first (the review of issue 47 step 3, M1).
#[test]
fn a_send_completion_frees_every_slot_it_completes_before_the_first_handler() {
    let mut l = L::new(0, 1, 16).unwrap();
    l.set_capacity(4, 0);
    for u in 1..=4 {
        l.submit_send(Slot::raw(OpCode::Write, raw(8), u));
    }
    let mut room = CqRoom::new(64, 16);
    let run = l.plan_sends_imm(&mut room, 0);
    assert!(l.sends_posted(run, run.n, &mut room).is_none());
    assert_eq!((l.outstanding().0, l.free_slots()), (4, 0));
    let end = l.send_completed(run.first + 3).expect("the signaled one");
    assert_eq!((l.outstanding().0, l.free_slots()), (0, 4), "all four completed, none taken yet");
    let mut seen = 0;
    while let Some(op) = l.next_sent(end, &mut room, WcStatus::Success) {
        drop(op.take(&mut room, WcStatus::Success));
        seen += 1;
        assert_eq!((l.outstanding().0, l.free_slots()), (0, 4), "after {seen} taken");
    }
    assert_eq!((seen, room.reserved(), l.awaited()), (4, 0, 0));
    // A stale id records nothing.
    assert!(l.send_completed(run.first + 3).is_none());
    assert_eq!(l.free_slots(), 4);
}

/// One step of a differential script.
#[derive(Clone, Copy, Debug)]
enum Step {
    Push(bool),
    Plan(u8),
    Complete,
    Grant(u32, bool),
    Repost(bool),
    Hold,
    Release,
    Hello,
    Nudge,
    Farewell,
    Answer,
    Yield,
}

/// What a planned request is, the same for both planners.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Data(u64),
    Control,
    Probe,
}

/// `SendQueue` with keys for its operations, as the reactor drives it today.
struct Old {
    q: SendQueue,
    room: CqRoom,
    keys: GenSlab<OpKey, Kind>,
    plan: Plan,
    /// Posted, in order, with "signaled".
    posted: Vec<(OpKey, bool)>,
}

/// The lanes.
struct New {
    l: L,
    room: CqRoom,
    /// Posted `wr_id`s, in order, with "signaled".
    posted: Vec<(u64, bool)>,
}

fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

fn step(x: &mut u64) -> Step {
    let r = xorshift(x);
    match r % 100 {
        0..=29 => Step::Push(r & 0x100 != 0),
        30..=49 => Step::Plan((r >> 8) as u8),
        50..=69 => Step::Complete,
        70..=79 => Step::Grant(((r >> 8) % 4) as u32, r & 0x1000 != 0),
        80..=87 => Step::Repost(r & 0x100 != 0),
        88 => Step::Hold,
        89..=90 => Step::Release,
        91 => Step::Hello,
        92..=93 => Step::Nudge,
        94..=95 => Step::Farewell,
        96..=97 => Step::Answer,
        _ => Step::Yield,
    }
}

/// The plan of each, as `(kind, imm, signaled)` per request.
fn plan_old(o: &mut Old) -> Vec<(Kind, Option<u32>, bool)> {
    let keys = &mut o.keys;
    o.q.plan_into(&mut o.room, || keys.insert(Kind::Control), &mut o.plan);
    o.plan.wrs.iter().map(|w| (*o.keys.get(w.op).unwrap(), w.imm, w.signaled)).collect()
}

fn plan_new(n: &mut New) -> (SendRun, Vec<(Kind, Option<u32>, bool)>) {
    let run = n.l.plan_sends_imm(&mut n.room, 0);
    let v = (0..run.n)
        .map(|k| {
            let slot = n.l.send.queued_at(k).unwrap();
            let view = n.l.swrs.view(run.first + k);
            let kind = match (slot.is_control(), slot.opcode) {
                (true, OpCode::Write) => Kind::Probe,
                (true, _) => Kind::Control,
                (false, _) => Kind::Data(slot.user_data),
            };
            let imm = (view.op == "send_imm" || view.op == "write_imm").then_some(view.imm);
            (kind, imm, view.signaled)
        })
        .collect();
    (run, v)
}

/// Drives both planners through `steps` random steps from `seed`, comparing everything each
/// step shows: the chains planned (order, kind, immediate data, signaling), refused requests,
/// what each completion completes, the CQ room, the credit state, and the queues' counters.
fn differential(seed: u64, steps: usize, cap: u32, room: u32, signal_every: u32, with_flow: bool) {
    let mut x = seed | 1;
    let f = if with_flow { flow(4, 4) } else { None };
    let mut old = Old {
        q: SendQueue::new(signal_every),
        room: CqRoom::new(room, 0),
        keys: GenSlab::new(),
        plan: Plan::default(),
        posted: Vec::new(),
    };
    old.q.set_capacity(cap);
    old.q.set_flow(f.clone());
    old.q.set_farewell(true);
    let mut new = New { l: L::new(1, 1, signal_every).unwrap(), room: CqRoom::new(room, 0), posted: Vec::new() };
    new.l.set_capacity(cap, 0);
    new.l.set_flow(f);
    new.l.set_farewell(true);
    let mut next_id = 100u64;
    for i in 0..steps {
        let s = step(&mut x);
        let at = format!("seed {seed:#x}, step {i}: {s:?}");
        match s {
            Step::Push(consumes) => {
                next_id += 1;
                let k = old.keys.insert(Kind::Data(next_id));
                old.q.push(k, consumes, 8);
                let op = if consumes { OpCode::Send } else { OpCode::Write };
                new.l.submit_send(Slot::raw(op, raw(8), next_id));
            }
            Step::Plan(take) => {
                let before = format!("old unsignaled {:?}, new {:?}", old.q, new.l.ctl);
                let a = plan_old(&mut old);
                let (run, b) = plan_new(&mut new);
                assert_eq!(a, b, "{at}: the chains; before: {before}");
                assert_eq!(old.plan.short_of_room, run.short_of_room, "{at}: short of room");
                // The device takes all of it, or (now and then) only part.
                let n = a.len();
                let taken = if take % 8 == 0 && n > 0 { (take as usize / 8) % n } else { n };
                let refused_old: Vec<Kind> =
                    old.q.posted(&old.plan, taken, &mut old.room).map(|k| *old.keys.get(k).unwrap()).collect();
                let wr_ids: Vec<u64> = (0..run.n).map(|k| new.l.swrs.view(run.first + k).wr_id).collect();
                let refused_new: Vec<Kind> = new
                    .l
                    .sends_posted(run, taken as u32, &mut new.room)
                    .unwrap_or_default()
                    .iter()
                    .map(|s| if s.is_control() { Kind::Control } else { Kind::Data(s.user_data) })
                    .collect();
                // A refused probe reads as the runtime's own on both sides.
                let norm = |v: Vec<Kind>| -> Vec<Kind> {
                    v.into_iter().map(|k| if k == Kind::Probe { Kind::Control } else { k }).collect()
                };
                assert_eq!(norm(refused_old), norm(refused_new), "{at}: refused");
                for (j, w) in old.plan.wrs.iter().take(taken).enumerate() {
                    old.posted.push((w.op, w.signaled));
                    new.posted.push((wr_ids[j], b[j].2));
                }
            }
            Step::Complete => {
                // The device reports the oldest signaled request (RC: in order).
                let Some(j) = old.posted.iter().position(|p| p.1) else { continue };
                let (ko, _) = old.posted[j];
                let (wn, _) = new.posted[j];
                let mut done = Vec::new();
                old.q.complete(ko, &mut old.room, &mut done);
                let a: Vec<Kind> = done.iter().map(|k| *old.keys.get(*k).unwrap()).collect();
                let end = new.l.send_completed(seq_of(wn)).expect("outstanding on the lanes");
                let mut b = Vec::new();
                while let Some((_, s, _)) = new.l.pop_sent(end, &mut new.room) {
                    b.push(match (s.is_control(), s.opcode) {
                        (true, OpCode::Write) => Kind::Probe,
                        (true, _) => Kind::Control,
                        (false, _) => Kind::Data(s.user_data),
                    });
                }
                assert_eq!(a, b, "{at}: what the completion completes");
                old.posted.drain(..=j);
                new.posted.drain(..=j);
            }
            Step::Grant(g, control) => {
                let imm = if control { Imm::control(g) } else { Imm::data(g) };
                if let (Some(a), Some(b)) = (old.q.flow_mut(), new.l.flow_mut()) {
                    if !a.exhausted() {
                        a.on_receive(imm);
                        b.on_receive(imm);
                    }
                }
            }
            Step::Repost(control) => {
                if let (Some(a), Some(b)) = (old.q.flow_mut(), new.l.flow_mut()) {
                    a.on_repost(control);
                    b.on_repost(control);
                }
            }
            Step::Hold => {
                old.q.set_hold(true);
                new.l.set_hold(true);
            }
            Step::Release => assert_eq!(old.q.release(), new.l.release(), "{at}"),
            // A hello is set at connect time only, with the peer's depth of credit (both
            // planners spend one on it unchecked).
            Step::Hello if i < 8 && old.q.flow_mut().map_or(true, |f| f.credits() >= 1) => {
                old.q.set_hello(true);
                new.l.set_hello(true);
            }
            Step::Hello => {}
            Step::Nudge => {
                let probe = old.keys.insert(Kind::Probe);
                assert_eq!(old.q.nudge(probe), new.l.nudge(), "{at}: a nudge queued");
            }
            Step::Farewell => {
                old.q.say_farewell();
                new.l.say_farewell();
            }
            Step::Answer => {
                old.q.answer_farewell();
                new.l.answer_farewell();
            }
            Step::Yield => {
                old.q.yield_last_credit();
                new.l.yield_last_credit();
            }
        }
        assert_eq!(old.room, new.room, "{at}: the CQ room");
        assert_eq!(old.q.flow_mut().cloned(), new.l.flow_mut().cloned(), "{at}: the credits");
        assert_eq!(old.q.wants_post(), new.l.wants_post(), "{at}: wants_post");
        assert_eq!(
            old.q.credit_blocked(),
            new.l.credit_blocked(),
            "{at}: credit_blocked; old {:?}, new queued {} overflow {} head {:?}",
            old.q,
            new.l.send.queued(),
            new.l.send.overflowed(),
            new.l.send.queued_at(0).map(|s| (s.user_data, s.flags, s.opcode))
        );
        assert_eq!(old.q.backlog().0, new.l.backlog().0, "{at}: backlog");
        assert_eq!(old.q.free_slots(), new.l.free_slots(), "{at}: free slots");
        assert_eq!(old.q.outstanding(), new.l.outstanding().0, "{at}: outstanding");
        assert_eq!(old.q.awaited(), new.l.awaited(), "{at}: awaited");
    }
}

/// The lanes plan exactly as `SendQueue` does: the same chains (order, kind, credits, immediate
/// data, signaling), the same refusals, completions, CQ room and credit state, over random
/// scripts of submissions, plans (some refused part way), completions, grants, re-posts, holds,
/// hellos, nudges and the close handshake, at several depths, signaling rates and CQ sizes (a
/// small CQ runs out of room), with flow control and (one script in four) without.
#[test]
fn the_lanes_plan_every_chain_as_the_send_queue_does() {
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    for (cap, room, every) in [(4, 64, 2), (8, 5, 3), (16, 64, 16), (2, 3, 1), (64, 40, 4)] {
        for i in 0..40 {
            differential(xorshift(&mut seed), 400, cap, room, every, i % 4 != 0);
        }
    }
}

/// iWARP: the credits and kind come from the message's tail, read from the pool buffer
/// (`proto::transport::unframe`); a credit-only message's receive is posted again.
#[test]
fn on_a_transport_without_immediate_data_the_tail_carries_the_credits() {
    use crate::sys::pool::{index::IndexPool, PoolConfig};
    let cfg = PoolConfig { chunk_sizes: vec![64], cluster_bytes: 4096, max_bytes: 1 << 20, ..PoolConfig::default() };
    let pool = IndexPool::unregistered(&cfg, TAIL_LEN as usize).unwrap();
    let mut l = lanes(8, 4, flow(4, 4));
    for u in [1, 2] {
        l.submit_recv(Slot::recv_on(pool.alloc(64, 5).unwrap(), 5, u));
    }
    let ids = post_recvs(&mut l, false);
    // The device wrote 10 bytes of payload and a tail granting 2 into the first.
    let addr = l.recv.get(l.recv.head()).map(|s| s.sge().0).unwrap();
    let tail = crate::proto::transport::Tail(Imm::data(2)).encode();
    #[allow(unsafe_code)]
    // SAFETY: the chunk's memory (64 bytes and its slack), which the host pool owns; nothing
    // else writes it here.
    unsafe {
        std::ptr::copy_nonoverlapping(tail.as_ptr(), (addr + 10) as *mut u8, 4)
    };
    let out = l.recv_completed(seq_of(ids[0]), &wc(ids[0], 14, None), true);
    match delivered(&mut l, out) {
        Ok((done, _)) => {
            assert_eq!(done.result, Ok(10), "the payload, without its tail");
            assert_eq!(done.buf.map(|b| b.len()), Some(10));
        }
        Err(other) => panic!("{other:?}"),
    }
    assert_eq!(l.flow_mut().map(|f| f.credits()), Some(4 + 2));
    let addr = l.recv.get(l.recv.head()).map(|s| s.sge().0).unwrap();
    let tail = crate::proto::transport::Tail(Imm::control(1)).encode();
    #[allow(unsafe_code)]
    // SAFETY: as above.
    unsafe {
        std::ptr::copy_nonoverlapping(tail.as_ptr(), addr as *mut u8, 4)
    };
    assert!(matches!(
        l.recv_completed(seq_of(ids[1]), &wc(ids[1], 4, None), true),
        RecvOutcome::Control { farewell: Farewell::None }
    ));
    assert_eq!(post_recvs(&mut l, false).len(), 1, "posted again");
}

/// The byte stream's coalesced writes (`data/append.rs`): only the last queued send-queue
/// operation grows, and only a SEND of a pool buffer with the caller's user_data (not caller
/// memory, not the runtime's own, never a posted one), in the ring or beyond it in the overflow
/// queue; its request names the bytes it has when it is posted, and the backlog counts them.
#[test]
fn only_the_last_queued_send_of_its_user_data_grows_and_its_request_follows() {
    use crate::sys::pool::{index::IndexPool, PoolConfig};
    let cfg = PoolConfig { chunk_sizes: vec![64], cluster_bytes: 4096, max_bytes: 1 << 20, ..PoolConfig::default() };
    let pool = IndexPool::unregistered(&cfg, 0).unwrap();
    let send = |len: usize, user_data: u64| {
        let mut b = pool.alloc(64, 5).unwrap();
        b.set_len(len).unwrap();
        Slot::send_on(b, 5, user_data)
    };
    let grow = |n: usize| {
        move |b: &mut IndexBuf, _: (u32, usize), _: u32| {
            let len = b.len();
            b.set_len(len + n).unwrap();
            n
        }
    };
    // Four send slots: the ring holds four operations, the rest wait in the overflow queue.
    let mut l = lanes(4, 4, None);
    assert_eq!(l.append_last_send(7, grow(4)), 0, "nothing queued");
    l.submit_send(send(10, 7));
    assert_eq!(l.backlog(), (1, 10));
    assert_eq!(l.append_last_send(8, grow(4)), 0, "another user_data");
    let took = l.append_last_send(7, |b, backlog, free| {
        assert_eq!((backlog, free), ((1, 10), 4), "the backlog and free slots as they were");
        grow(4)(b, backlog, free)
    });
    assert_eq!((took, l.backlog()), (4, (1, 14)));
    // Caller memory behind it, the last in the overflow queue: the last is not a pool buffer.
    for _ in 0..4 {
        l.submit_send(Slot::raw(OpCode::Send, raw(8), 7));
    }
    assert_eq!(l.send.overflowed(), 1);
    assert_eq!(l.append_last_send(7, grow(4)), 0, "caller memory");
    // A pool send behind that, in the overflow queue too: it grows.
    l.submit_send(send(20, 7));
    assert_eq!(l.append_last_send(7, grow(5)), 5);
    assert_eq!(l.backlog(), (6, 14 + 25));
    // The first four are posted, the first with its 14 bytes; a posted send never grows.
    let mut room = CqRoom::new(64, 0);
    let run = l.plan_sends_imm(&mut room, 0);
    assert_eq!(run.n, 4);
    assert_eq!(l.swrs.view(run.first).len, 14, "the request names the bytes appended");
    assert!(l.sends_posted(run, 4, &mut room).is_none());
    assert_eq!(l.backlog(), (2, 25));
    // The runtime's own: a probe queued last is never grown.
    l.submit_send(Slot::probe());
    assert_eq!(l.append_last_send(0, grow(4)), 0, "the runtime's own");
    assert_eq!(l.backlog(), (3, 25));
    // Everything completes; the grown one was posted with 25 bytes.
    let mut lens = Vec::new();
    for _ in 0..3 {
        let end = l.send.next_post();
        while let Some((_, s, _)) = l.pop_sent(end, &mut room) {
            lens.push(s.posted_len());
        }
        let run = l.plan_sends_imm(&mut room, 0);
        assert!(l.sends_posted(run, run.n, &mut room).is_none());
    }
    assert_eq!(lens, vec![14, 8, 8, 8, 8, 25, 0]);
}

/// A request of a lanes' plan: its user_data (`None`: the runtime's own), its immediate data
/// decoded, its operation (`SendWrs::view`).
type Req = (Option<u64>, Option<Imm>, &'static str, bool);

/// Plans the lanes' sends (immediate data, nothing inline) and posts all of them.
fn plan_all(l: &mut L, room: &mut CqRoom) -> Vec<Req> {
    let run = l.plan_sends_imm(room, 0);
    let v = (0..run.n)
        .map(|k| {
            let slot = l.send.queued_at(k).unwrap();
            let view = l.swrs.view(run.first + k);
            let imm = (view.op == "send_imm" || view.op == "write_imm").then(|| Imm::decode(view.imm));
            ((!slot.is_control()).then_some(slot.user_data), imm, view.op, view.signaled)
        })
        .collect();
    assert!(l.sends_posted(run, run.n, room).is_none());
    v
}

/// Queues a 64-byte SEND of caller memory for each of `user_data`.
fn queue_sends(l: &mut L, user_data: &[u64]) {
    for u in user_data {
        l.submit_send(Slot::raw(OpCode::Send, raw(64), *u));
    }
}

fn data_of(plan: &[Req]) -> Vec<Option<u64>> {
    plan.iter().map(|r| r.0).collect()
}

/// The send queue's depth bounds a chain (FAULTS.md, "send queue full"): the queue pair's free
/// send slots, no more; teardown hands back every operation, the posted ones first, with their
/// CQ room (as `send_queue::tests::slots_bound_the_chain_and_clear_returns_everything`, on the
/// reactor's lanes).
#[test]
fn the_lanes_slots_bound_the_chain_and_clear_returns_everything() {
    let mut l = lanes(3, 0, None);
    let mut room = CqRoom::new(64, 16);
    queue_sends(&mut l, &[1, 2, 3, 4, 5]);
    assert_eq!(data_of(&plan_all(&mut l, &mut room)), vec![Some(1), Some(2), Some(3)], "three send slots");
    assert!(plan_all(&mut l, &mut room).is_empty(), "no slot left");
    assert_eq!(room.reserved(), 3);
    let cleared = l.clear(Some(&mut room));
    assert_eq!(cleared.posted_sends, 3);
    assert_eq!(cleared.sends.iter().map(|s| s.user_data).collect::<Vec<_>>(), vec![1, 2, 3, 4, 5]);
    assert_eq!(room.reserved(), 0);
    assert_eq!((l.backlog(), l.outstanding()), ((0, 0), (0, 0)));
}

/// `Config::send_backlog` and `send_backlog_bytes` read the lanes' backlog (FAULTS.md, "a peer
/// that takes our messages slowly"): what waits unposted and its pool bytes, not the posted
/// ones, and after a reconnection what it keeps (as
/// `send_queue::tests::the_backlog_counts_what_waits_unposted`).
#[test]
fn the_lanes_backlog_counts_what_waits_unposted() {
    use crate::sys::pool::{index::IndexPool, PoolConfig};
    let cfg = PoolConfig { chunk_sizes: vec![1024], cluster_bytes: 8192, max_bytes: 1 << 20, ..PoolConfig::default() };
    let pool = IndexPool::unregistered(&cfg, 0).unwrap();
    let mut l = lanes(2, 0, None);
    let mut room = CqRoom::new(64, 8);
    for i in 0..6u64 {
        let mut b = pool.alloc(1024, 5).unwrap();
        b.set_len(100 * (i as usize + 1)).unwrap();
        // The fourth is one-sided (a WRITE naming the peer's key): a reconnection drops it.
        l.submit_send(if i == 3 {
            Slot::write(b, RemoteSlice { addr: 0x10, len: 1024, rkey: 9 }, false, i)
        } else {
            Slot::send_on(b, 5, i)
        });
    }
    assert_eq!(l.backlog(), (6, 2100));
    assert_eq!(plan_all(&mut l, &mut room).len(), 2, "two send slots");
    assert_eq!(l.backlog(), (4, 1800), "the posted ones are not queued any more");
    let epoch = l.epoch();
    let gone = l.carry(Some(&mut room), epoch, |s| !s.is_one_sided());
    assert_eq!(gone.sends.iter().map(|s| s.user_data).collect::<Vec<_>>(), vec![0, 1, 3]);
    assert_eq!(l.backlog(), (3, 300 + 500 + 600), "what a reconnection keeps");
    drop(gone);
    drop(l.clear(None));
    assert_eq!(l.backlog(), (0, 0));
}

/// An iWARP client's nudge (FAULTS.md, a connection that hangs before its first message): a
/// zero-length RDMA WRITE that needs no credit goes ahead of data waiting for credits, one at a
/// time, never before the hello, and a nudge still queued is dropped at teardown and at a
/// reconnection (as `send_queue::tests::a_nudge_goes_ahead_of_credit_blocked_data_and_is_returned_at_teardown`).
#[test]
fn a_nudge_on_the_lanes_goes_ahead_of_credit_blocked_data_and_goes_at_teardown() {
    // Three credits, one kept in reserve: two messages go, the third waits for a grant.
    let mut l = lanes(16, 0, flow(3, 8));
    let mut room = CqRoom::new(64, 16);
    queue_sends(&mut l, &[1, 2, 3]);
    assert_eq!(data_of(&plan_all(&mut l, &mut room)), vec![Some(1), Some(2)]);
    assert!(l.credit_blocked());
    assert!(l.nudge());
    assert!(!l.nudge(), "one nudge queued at a time");
    assert!(l.wants_post());
    let plan = plan_all(&mut l, &mut room);
    assert_eq!(
        plan,
        vec![(None, None, "write", true)],
        "the nudge needs no credit, carries no immediate data, is signaled"
    );
    assert_eq!(l.swrs.view(l.send.next_post().wrapping_sub(1)).len, 0, "a zero-length WRITE");
    assert!(l.credit_blocked(), "the message still waits for its credit");
    // Never before the hello: the first message goes first.
    let mut h = lanes(16, 0, flow(8, 8));
    queue_sends(&mut h, &[4]);
    h.set_hello(true);
    assert!(h.nudge());
    let plan = plan_all(&mut h, &mut room);
    let kinds: Vec<_> = plan.iter().map(|r| (r.0, r.2)).collect();
    assert_eq!(kinds, vec![(None, "send_imm"), (None, "write"), (Some(4), "send_imm")]);
    // A nudge still due when the queue pair goes is not carried to the next one.
    let mut t = lanes(16, 0, None);
    queue_sends(&mut t, &[5]);
    t.set_hold(true);
    assert!(t.nudge());
    let epoch = t.epoch();
    let gone = t.carry(None, epoch, |_| true);
    assert!(gone.sends.is_empty(), "the data is kept");
    assert!(t.nudge(), "the old queue pair's nudge is forgotten");
    let mut c = lanes(16, 0, None);
    queue_sends(&mut c, &[6]);
    c.set_hold(true);
    assert!(c.nudge());
    let cleared = c.clear(None);
    assert_eq!(cleared.sends.len(), 1);
    assert!(c.nudge(), "teardown forgets the nudge");
}

/// Both sides close at once, each at its last credit with nothing owed (FAULTS.md, the close
/// handshake; the review of 2026-11-26, L6): the handshake still finishes without
/// `Timeouts::finish`. Each side is scripted as the runtime drives it on its lanes (as
/// `send_queue::tests::crossing_farewells_at_the_last_credit_are_still_answered`).
#[test]
fn crossing_farewells_on_the_lanes_at_the_last_credit_are_still_answered() {
    // Side 0 accepted the connection, side 1 made it (it yields its last credit).
    let mut q = [lanes(16, 0, flow(3, 3)), lanes(16, 0, flow(3, 3))];
    let mut room = [CqRoom::new(64, 16), CqRoom::new(64, 16)];
    for (i, q) in q.iter_mut().enumerate() {
        q.set_farewell(true);
        if i == 1 {
            q.yield_last_credit();
        }
        queue_sends(q, &[10 * i as u64, 10 * i as u64 + 1]);
        assert_eq!(plan_all(q, &mut room[i]).len(), 2, "two data messages; the last credit is kept");
    }
    // The data arrived, their receives are not posted again: nothing owed, one credit each.
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
            for (_, imm, _, _) in plan_all(&mut q[i], &mut room[i]) {
                let imm = imm.expect("flow control");
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
    assert!(heard[0], "no farewell answered: both sides wait Timeouts::finish; sent {said:?}");
    assert_eq!(said[0].first(), Some(&Farewell::Leaving));
}

/// The connecting side's farewell on the lanes (L6): on its last credit it goes only with a
/// grant; with two credits or more at once (as
/// `send_queue::tests::the_connecting_sides_farewell_takes_the_last_credit_only_with_a_grant`).
#[test]
fn the_connecting_sides_farewell_on_the_lanes_takes_the_last_credit_only_with_a_grant() {
    let mut room = CqRoom::new(64, 16);
    let mut q = lanes(16, 0, flow(3, 3));
    q.set_farewell(true);
    q.yield_last_credit();
    queue_sends(&mut q, &[1, 2]);
    assert_eq!(plan_all(&mut q, &mut room).len(), 2);
    q.say_farewell();
    assert!(plan_all(&mut q, &mut room).is_empty(), "one credit, nothing to grant: it waits");
    assert!(q.wants_post(), "the farewell is still due");
    q.flow_mut().unwrap().on_repost(false);
    let plan = plan_all(&mut q, &mut room);
    assert_eq!(plan.len(), 1);
    let imm = plan[0].1.expect("flow");
    assert_eq!((plan[0].0, imm.farewell, imm.grant), (None, Farewell::Leaving, 1), "the last credit, with a grant");
    let mut two = lanes(16, 0, flow(3, 3));
    two.set_farewell(true);
    two.yield_last_credit();
    two.say_farewell();
    let plan = plan_all(&mut two, &mut room);
    assert_eq!(plan[0].1.map(|i| i.farewell), Some(Farewell::Leaving), "a credit is left for an answer");
}
