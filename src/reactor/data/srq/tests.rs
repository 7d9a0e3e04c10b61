//! Unit tests of the SRQ's pure parts: the queue-pair map and the credit rule, with a model of
//! the SRQ (streams, ping-pongs, idle joiners and leavers).

use std::collections::VecDeque;

use super::{ConnShare, QpMap, Share, SrqBudget};
use crate::proto::flow::{Flow, Imm, MIN_DEPTH};
use crate::proto::token::{ConnKey, GenSlab};

/// What consumed a receive, as `SrqBudget::on_repost` takes it: a data message, or a
/// credit-only one.
const DATA: bool = false;
const CREDIT_ONLY: bool = true;

#[test]
fn the_qp_map_finds_each_connection_by_its_queue_pair() {
    let mut slab: GenSlab<ConnKey, ()> = GenSlab::new();
    let keys: Vec<ConnKey> = (0..50).map(|_| slab.insert(())).collect();
    let mut m = QpMap::default();
    // Out of order, as the kernel hands out numbers.
    for (i, k) in keys.iter().enumerate() {
        m.insert(((i * 37) % 50) as u32 + 17, *k);
    }
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(m.get(((i * 37) % 50) as u32 + 17), Some(*k));
    }
    assert_eq!(m.get(16), None);
    assert_eq!(m.get(67), None);
    m.remove(17);
    assert_eq!(m.get(17), None);
    m.remove(17);
    assert_eq!(m.values().count(), 49);
    m.insert(18, keys[0]);
    assert_eq!(m.get(18), Some(keys[0]), "a number reused names its new connection");
}

#[test]
fn the_credit_rule_admits_exactly_what_the_receives_cover() {
    let mut b = SrqBudget::new(8, 3, 3, 0);
    assert_eq!(b.max_conns(), 2);
    assert!(b.admit());
    assert!(b.admit());
    assert!(!b.admit(), "a third connection would need 9 receives of 8");
    assert_eq!(b.conns(), 2);
    b.leave(3);
    assert!(b.admit(), "room again after one left");
    b.leave(3);
    b.leave(3);
    b.leave(3);
    assert_eq!(b.conns(), 0, "leaving never underflows");
    assert_eq!(b.free(), 8, "nor frees more than there is");
}

#[test]
fn the_credit_rule_does_not_overflow() {
    let mut b = SrqBudget::new(u32::MAX, u32::MAX, u32::MAX, 0);
    assert!(b.admit());
    assert!(!b.admit());
    let mut z = SrqBudget::new(10, 0, 0, 0);
    assert_eq!(z.max_conns(), 10, "a zero credit counts as one (Config::validate refuses it)");
    assert!(z.admit());
}

/// `SrqConfig::max_connections` (what the tail-ring pool is sized for, read from the
/// budget's own rule) is what the budget admits: 10 085 at the defaults, and the next is
/// refused.
#[test]
fn the_config_says_what_the_budget_admits() {
    for cfg in [
        crate::SrqConfig::default(),
        crate::SrqConfig { receives: 80, credit: 4, reserve: 64, ..Default::default() },
        crate::SrqConfig { receives: 60, credit: 4, reserve: 64, ..Default::default() },
    ] {
        let mut b = SrqBudget::new(cfg.receives, cfg.credit, cfg.max_credit, cfg.reserve);
        assert_eq!(b.max_conns(), cfg.max_connections(), "{cfg:?}");
        for _ in 0..cfg.max_connections() {
            assert!(b.admit());
        }
        assert!(!b.admit(), "{cfg:?}");
    }
    assert_eq!(crate::SrqConfig::default().max_connections(), 10_085);
}

/// Finding 2 of the hostile review: the reserve is never granted to a connection, not even
/// to a busy one growing.
#[test]
fn the_reserve_is_granted_to_no_connection() {
    let mut b = SrqBudget::new(80, 4, 4, 64);
    assert_eq!(b.max_conns(), 4);
    for _ in 0..4 {
        assert!(b.admit());
    }
    assert!(!b.admit(), "a fifth connection would take the reserve");
    assert_eq!(SrqBudget::new(60, 4, 4, 64).max_conns(), 0, "a reserve above the receives admits nothing");
    assert!(!SrqBudget::new(60, 4, 4, 64).admit());
    let mut g = SrqBudget::new(80, 4, 1000, 64);
    assert!(g.admit());
    let mut share = ConnShare::new(4);
    for _ in 0..10_000 {
        g.on_repost(&mut share, DATA, 0, true);
    }
    assert_eq!(share.receives + g.free() + 64, 80, "grown into the free receives only");
    assert!(g.free() <= 80 / 8 + 1, "and no further than the room kept for newcomers");
}

/// Review L3 (a): a receive consumed on a connection's queue pair and queued for posting again
/// while the pool was short is posted after the connection reconnected (same `ConnKey`, a new
/// queue pair and share). `leave` already freed it with the old share, so crediting it to the
/// new one would let the new peer hold a grant beyond its share, taken from what another
/// connection was promised: with both at their shares the queue would be one receive short
/// (an RNR NAK for someone). It is credited to nobody; a receive of the new share still is.
#[test]
fn a_receive_queued_before_a_reconnection_is_not_credited_to_the_new_queue_pair() {
    const PEER_DEPTH: u32 = 64;
    let (receives, credit) = (16, 8);
    let mut b = SrqBudget::new(receives, credit, credit, 0);
    // Two connections fill the queue: `a` (the one that reconnects) and `other`.
    assert!(b.admit());
    let old = b.new_share();
    assert!(b.admit());
    let other = b.new_share();
    assert_ne!(old.id(), other.id(), "every admission is a share of its own");
    let mut old_flow = Flow::new(PEER_DEPTH, credit);
    // `a`'s peer consumes a receive; no pool buffer to post it again with: it waits, queued
    // for the old share.
    old_flow.on_receive(Imm::data(0));
    let queued_for = old.id();
    // The queue pair fails and the client reconnects: its whole share is freed, the receive
    // waiting to be posted included, and it is admitted again with a new share and flow.
    b.leave(old.receives);
    assert!(b.admit(), "the freed share covers the new one");
    let mut new = b.new_share();
    let mut flow = Flow::new(PEER_DEPTH, credit);
    assert_eq!(b.free() + new.receives + other.receives, receives, "every receive in one place");
    // The pool refills: the queued receive is posted now.
    if let Some(verdict) = b.repost_for(&mut new, queued_for, DATA, flow.unused() + flow.owed(), true) {
        assert_eq!(verdict, Share::Return);
        flow.on_repost(DATA);
    }
    // What `a`'s new peer can hold: its grants and what is owed to it (the next grant).
    let held = flow.unused() + flow.owed();
    assert!(
        held <= new.receives,
        "the new queue pair's peer may hold {held} grants, beyond its share of {}: with the other \
         connection's {} that is {} of the queue's {receives} receives",
        new.receives,
        other.receives,
        held + other.receives
    );
    assert_eq!(b.free() + new.receives + other.receives, receives, "the receive stayed free");
    // A receive of the new share comes back to it as always.
    flow.on_receive(Imm::data(0));
    let id = new.id();
    let verdict = b.repost_for(&mut new, id, DATA, flow.unused() + flow.owed(), true);
    assert_eq!(verdict, Some(Share::Return));
    flow.on_repost(DATA);
    assert_eq!(flow.unused() + flow.owed(), new.receives);
}

/// 5 000 connections of credit 3 on 15 360 receives: every one admitted, the 5 121st not.
#[test]
fn five_thousand_connections_fit_their_receives() {
    let mut b = SrqBudget::new(15_360, 3, 32, 0);
    for _ in 0..5_120 {
        assert!(b.admit());
    }
    assert!(!b.admit());
}

/// The defaults (`SrqConfig::default`): 10 085 connections at their base credit, in
/// receives that fit Soft-RoCE's CQ and leave 1 536 chunks of their eight clusters free.
#[test]
fn the_defaults_admit_10085_connections() {
    let d = crate::SrqConfig::default();
    let mut b = SrqBudget::new(d.receives, d.credit, d.max_credit, d.reserve);
    assert_eq!(b.max_conns(), 10_085);
    for _ in 0..10_085 {
        assert!(b.admit());
    }
    assert!(!b.admit());
    assert!(d.receives <= 32_767, "rxe's max_cqe");
    let chunks = 8 * (4 << 20) / d.buf_size;
    assert_eq!(chunks - d.receives, 1_536);
}

#[test]
fn a_peer_that_runs_low_grows_its_share_and_one_that_does_not_gives_it_back() {
    let mut b = SrqBudget::new(1024, 3, 32, 0);
    assert!(b.admit());
    let mut share = ConnShare::new(3);
    assert_eq!(b.on_repost(&mut share, DATA, 1, true), Share::Return, "low, but its first message: a hello");
    assert_eq!(b.on_repost(&mut share, DATA, 2, true), Share::Return, "two of three unused: not low");
    assert_eq!(b.on_repost(&mut share, DATA, 1, false), Share::Return, "low, but a receive waits unposted");
    for want in 4..=32 {
        // A share's worth of messages, running low, for each receive more (the first: the
        // three above were a share's worth already).
        for _ in 0..if want == 4 { 0 } else { want - 2 } {
            assert_eq!(b.on_repost(&mut share, DATA, 1, true), Share::Return);
        }
        assert_eq!(b.on_repost(&mut share, DATA, 1, true), Share::Grow);
        assert_eq!(share.receives, want);
    }
    assert_eq!(b.on_repost(&mut share, DATA, 1, true), Share::Return, "at max_credit");
    assert_eq!(b.free(), 1024 - 32);
    // A stream that runs low once per share's worth of messages keeps its share.
    for _ in 0..100 {
        for _ in 0..31 {
            assert_eq!(b.on_repost(&mut share, DATA, 20, true), Share::Return);
        }
        assert_eq!(b.on_repost(&mut share, DATA, 8, true), Share::Return, "low (a quarter left)");
    }
    // Its peer now never runs low (a ping-pong): one back per share's worth of messages.
    let mut messages = 0;
    while share.receives > 3 {
        let before = share.receives;
        let got = b.on_repost(&mut share, DATA, before - 1, true);
        messages += 1;
        assert!(got == Share::Return || (got == Share::Shrink && share.receives == before - 1));
    }
    assert_eq!(messages, (4..=32).sum::<u32>(), "a share's worth of messages per receive given back");
    for _ in 0..100 {
        assert_eq!(b.on_repost(&mut share, DATA, 2, true), Share::Return, "never below the base");
    }
    assert_eq!(b.free(), 1024 - 3);
}

#[test]
fn growth_stops_and_shares_shrink_when_newcomers_need_the_room() {
    // 1 024 receives keep 128 free for newcomers.
    let mut b = SrqBudget::new(1024, 3, 64, 0);
    assert!(b.admit());
    let mut busy = ConnShare::new(3);
    for _ in 0..10_000 {
        b.on_repost(&mut busy, DATA, 0, true);
    }
    assert_eq!(busy.receives, 64);
    let mut n = 1;
    while b.free() >= 3 + 128 {
        assert!(b.admit());
        n += 1;
    }
    assert_eq!(b.on_repost(&mut busy, DATA, 0, true), Share::Return, "at the room kept: no growth");
    while b.admit() {
        n += 1;
    }
    assert!(b.free() < 3, "admitted down to the last receive");
    assert_eq!(b.on_repost(&mut busy, DATA, 0, true), Share::Shrink, "few free: even a busy one gives back");
    for _ in 0..60 {
        b.on_repost(&mut busy, DATA, 0, true);
    }
    assert_eq!(busy.receives, 3);
    while b.admit() {
        n += 1;
    }
    assert_eq!(n, 1024 / 3, "every connection the receives cover, once the busy one is back at its base");
}

/// The review's attack (review 2026-11-26, finding M3; issue 32 item 3) at the defaults:
/// peers join one after another while more than an eighth of the queue is free, each spends
/// its credit on zero-length credit-only messages, burst after burst (each receive posted
/// again finds it out of credit: `held` 0), and goes idle; then legitimate connections come.
/// Before the fix every attacker grew to `max_credit` and kept it: 824 attackers, 407 739
/// credit-only messages, 1 301 legitimate connections after them, 2 125 in all instead of
/// 10 085. A credit-only message grows no share now, so every connection the formula promises
/// is admitted.
#[test]
fn credit_only_messages_farm_no_share_admission_stays_at_10085() {
    let d = crate::SrqConfig::default();
    let mut b = SrqBudget::new(d.receives, d.credit, d.max_credit, d.reserve);
    let (mut attackers, mut msgs) = (Vec::new(), 0u64);
    while b.free() > d.receives / 8 + d.credit {
        assert!(b.admit());
        let mut share = ConnShare::new(d.credit);
        // 493 messages took a share from 3 to 32 before the fix.
        for _ in 0..600 {
            msgs += 1;
            assert_eq!(b.on_repost(&mut share, CREDIT_ONLY, 0, true), Share::Return);
        }
        attackers.push(share);
    }
    let mut legit = 0u32;
    while b.admit() {
        legit += 1;
    }
    eprintln!(
        "credit-only attackers {} (shares {:?}), {msgs} credit-only messages in all, legitimate connections admitted afterwards {legit}, {} in all, free {}",
        attackers.len(),
        attackers.iter().map(|s| s.receives).max(),
        attackers.len() as u32 + legit,
        b.free()
    );
    assert!(attackers.iter().all(|s| s.receives == d.credit), "no attacker's share grew");
    assert_eq!(b.grown, 0);
    assert_eq!(attackers.len() as u32 + legit, d.max_connections(), "admission after the attack: 10 085");
    assert!(attackers.len() as u32 + legit >= 9_500);
}

/// The same attack with data messages, which do grow a share (the application sees each,
/// and may close a peer that sends nothing useful): the attackers grow as far as they can and
/// go idle. Their grants cannot be taken back, but growth comes out of a bounded pool
/// (`grow_cap`: 976 receives at the defaults), so the idle grown shares keep at most that from
/// newcomers: at least `(receives - reserve - grow_cap) / credit` = 9 760 connections are
/// admitted (2 125 before the fix). When the idle peers send again after the queue took
/// `receives` data messages of others, their grown shares come back, one receive per
/// message, and the rest of the 10 085 are admitted.
#[test]
fn idle_grown_shares_cannot_keep_the_free_room_from_newcomers() {
    let d = crate::SrqConfig::default();
    let mut b = SrqBudget::new(d.receives, d.credit, d.max_credit, d.reserve);
    assert_eq!(b.grow_cap(), 976);
    let (mut attackers, mut msgs) = (Vec::new(), 0u64);
    while b.free() > d.receives / 8 + d.credit {
        assert!(b.admit());
        let mut share = ConnShare::new(d.credit);
        for _ in 0..600 {
            msgs += 1;
            b.on_repost(&mut share, DATA, 0, true);
            if share.receives == d.max_credit {
                break;
            }
        }
        attackers.push(share);
    }
    let grown: u32 = attackers.iter().map(|s| s.receives - d.credit).sum();
    assert_eq!(grown, b.grow_cap(), "growth stopped at the cap");
    assert_eq!(b.grown, grown);
    let mut legit = Vec::new();
    while b.admit() {
        legit.push(ConnShare::new(d.credit));
    }
    let admitted = attackers.len() + legit.len();
    eprintln!(
        "data attackers {} ({} grown, {grown} receives beyond their bases), {msgs} data messages in all, legitimate connections admitted afterwards {}, {admitted} in all, free {}",
        attackers.len(),
        attackers.iter().filter(|s| s.receives > d.credit).count(),
        legit.len(),
        b.free()
    );
    let floor = (d.receives - d.reserve - b.grow_cap()) / d.credit;
    assert_eq!(floor, 9_760);
    assert!(admitted as u32 >= floor, "admission after the attack: {admitted}");
    assert!(admitted >= 9_500);
    // The legitimate connections are busy (at their base, ping-pong: never low) while the
    // attackers stay silent, until the queue took `receives` data messages.
    for k in 0..=d.receives as usize {
        let n = legit.len();
        let got = b.on_repost(&mut legit[k % n], DATA, d.credit - 1, true);
        assert_eq!(got, Share::Return);
    }
    // Then each attacker sends again: each of its messages gives back a receive, even while it
    // runs low, down to its base.
    for a in attackers.iter_mut().filter(|s| s.receives > d.credit) {
        let before = a.receives;
        for _ in d.credit..before {
            assert_eq!(b.on_repost(a, DATA, 0, true), Share::Shrink);
        }
        assert_eq!(a.receives, d.credit);
    }
    assert_eq!(b.grown, 0);
    let mut more = 0;
    while b.admit() {
        more += 1;
    }
    assert_eq!(admitted as u32 + more, d.max_connections(), "every grown share back: 10 085");
}

/// A grown share whose peer pauses keeps it while the queue is quiet (fewer than `receives`
/// data messages of others meanwhile), and gives it back at its peer's next messages once the
/// queue took that many: one receive per message, however low its peer runs, and then it
/// grows again only after a share's worth of data messages. Credit-only messages neither grow
/// a share nor keep one: they count as messages sent without running low.
#[test]
fn an_idle_grown_share_is_given_back_when_its_peer_sends_again() {
    let mut b = SrqBudget::new(1024, 3, 32, 0);
    assert!(b.admit() && b.admit());
    let (mut a, mut other) = (ConnShare::new(3), ConnShare::new(3));
    while a.receives < 32 {
        b.on_repost(&mut a, DATA, 1, true);
    }
    assert_eq!((b.grown, b.free()), (29, 1024 - 6 - 29));
    // A pause while the queue took 1 000 data messages of others: kept.
    for _ in 0..1_000 {
        assert_eq!(b.on_repost(&mut other, DATA, 2, true), Share::Return);
    }
    assert_eq!(b.on_repost(&mut a, DATA, 1, true), Share::Return, "a quiet queue: the grown share is kept");
    // A pause while the queue took 1 024: given back.
    for _ in 0..1_024 {
        b.on_repost(&mut other, DATA, 2, true);
    }
    for want in (3..32).rev() {
        assert_eq!(b.on_repost(&mut a, DATA, 1, true), Share::Shrink, "lapsed: kept, not granted back");
        assert_eq!(a.receives, want);
    }
    assert_eq!((b.grown, b.free()), (0, 1024 - 6));
    assert_eq!(b.on_repost(&mut a, DATA, 1, true), Share::Return, "at the base");
    assert_eq!(b.on_repost(&mut a, DATA, 1, true), Share::Return);
    assert_eq!(b.on_repost(&mut a, DATA, 1, true), Share::Grow, "a share's worth later it grows again");
    // Lapsing by credit-only messages alone: a grown share whose peer only returns credits.
    while a.receives < 8 {
        b.on_repost(&mut a, DATA, 1, true);
    }
    for _ in 0..1_025 {
        b.on_repost(&mut other, DATA, 2, true);
    }
    assert_eq!(b.on_repost(&mut a, CREDIT_ONLY, 0, true), Share::Shrink);
    assert_eq!(a.receives, 7);
}

/// A credit-only message's receive never grows a share, and never counts as running low: a
/// grown share fed only credit-only messages gives one receive back per share's worth of them,
/// as one whose peer never runs low.
#[test]
fn credit_only_messages_neither_grow_a_share_nor_keep_it() {
    let mut b = SrqBudget::new(1024, 3, 32, 0);
    assert!(b.admit());
    let mut share = ConnShare::new(3);
    for _ in 0..10_000 {
        assert_eq!(b.on_repost(&mut share, CREDIT_ONLY, 0, true), Share::Return);
    }
    assert_eq!((share.receives, b.grown), (3, 0));
    // Credit-only messages do not count toward growth either: after them, a share's worth
    // of data messages is still needed.
    assert_eq!(b.on_repost(&mut share, DATA, 1, true), Share::Return);
    assert_eq!(b.on_repost(&mut share, DATA, 1, true), Share::Return);
    assert_eq!(b.on_repost(&mut share, DATA, 1, true), Share::Grow);
    while share.receives < 16 {
        b.on_repost(&mut share, DATA, 1, true);
    }
    let mut messages = 0;
    while share.receives > 3 {
        b.on_repost(&mut share, CREDIT_ONLY, 0, true);
        messages += 1;
    }
    assert_eq!(messages, (4..=16).sum::<u32>(), "a share's worth of credit-only messages per receive given back");
    assert_eq!(b.grown, 0);
}

/// A model of the shared receive queue on the host, as `Flow`'s is: connections of six
/// kinds (streaming, ping-pong, streaming then ping-pong, streaming with a pause, a peer
/// sending only credit-only messages, idle) on one SRQ, the server's side of each with its
/// `Flow` and share, the client's with its own receives; messages land (consuming a receive
/// of the SRQ), are reaped, and their receives posted again (granted back, grown or shrunk
/// by `SrqBudget::on_repost`) in random order; idle connections join and leave. At every
/// step: no message lands on an SRQ without a receive beyond the reserve (no RNR, the
/// reserve untouched), no peer sends beyond its credit, every receive is in exactly one place
/// (`reserve + free + shares = receives`), each share is its peer's unused grants plus what
/// is owed plus what waits to be posted, and within `credit..=max_credit`, the shares hold
/// at most `grow_cap` beyond their bases (and the budget knows how much), the credit-only
/// peer's share never grew, and a grown share whose peer paused while the queue took
/// `receives` data messages is given back at its next messages. At the end: every message
/// delivered, the streams grew, and the connections that turned to ping-pong are back at the
/// base. Returns how many grown shares lapsed (of any kind of connection).
fn simulate_srq(receives: u32, credit: u32, max_credit: u32, reserve: u32, seed: u64) -> u32 {
    #[derive(Clone, Copy, PartialEq, Eq, Debug)]
    enum Kind {
        Stream,
        PingPong,
        StreamThenPingPong,
        StreamPauseStream,
        CreditOnly,
        Idle,
    }
    struct C {
        kind: Kind,
        server: Flow,
        client: Flow,
        share: ConnShare,
        peak: u32,
        /// Messages the client still sends in its streaming phase, then in ping-pong.
        stream: u32,
        pings: u32,
        awaiting: bool,
        replies: u32,
        wire: VecDeque<Imm>,
        unreaped: VecDeque<Imm>,
        queued: u32,
        delivered: u32,
        expected: u32,
        gone: bool,
        /// Credit-only messages the client still sends, whenever it holds a credit.
        farm: u32,
        /// Messages the client sends after its pause (`StreamPauseStream`).
        after_pause: u32,
        /// Its first stream is done and its share grown: it waits for the queue's traffic.
        paused: bool,
        /// Messages it streamed beyond its first 400 to see its share grown.
        extra: u32,
        /// It resumed after the queue took `receives` data messages, its share grown: the
        /// next of its receives to come back must shrink it.
        expect_lapse: bool,
    }
    const CLIENT_DEPTH: u32 = 64;
    let new_conn = |kind: Kind, stream: u32, pings: u32| C {
        kind,
        server: Flow::new(CLIENT_DEPTH, credit),
        client: Flow::new(credit, CLIENT_DEPTH),
        share: ConnShare::new(credit),
        peak: credit,
        stream,
        pings,
        awaiting: false,
        replies: 0,
        wire: VecDeque::new(),
        unreaped: VecDeque::new(),
        queued: 0,
        delivered: 0,
        expected: stream + pings,
        gone: false,
        farm: 0,
        after_pause: 0,
        paused: false,
        extra: 0,
        expect_lapse: false,
    };
    let mut b = SrqBudget::new(receives, credit, max_credit, reserve);
    let mut conns: Vec<C> = Vec::new();
    for (kind, stream, pings) in [
        (Kind::Stream, 1500, 0),
        (Kind::Stream, 1000, 0),
        (Kind::PingPong, 0, 300),
        (Kind::StreamThenPingPong, 1000, 700),
        (Kind::StreamThenPingPong, 500, 800),
        (Kind::StreamPauseStream, 400, 0),
        (Kind::CreditOnly, 0, 0),
        (Kind::Idle, 0, 0),
    ] {
        assert!(b.admit(), "the first connections fit");
        let mut c = new_conn(kind, stream, pings);
        if kind == Kind::StreamPauseStream {
            c.after_pause = 400;
            c.expected += 400;
        }
        if kind == Kind::CreditOnly {
            c.farm = 1000;
        }
        conns.push(c);
    }
    let mut posted = receives;
    // Receives reaped and waiting to be posted again, in order: (connection, control).
    let mut repost: VecDeque<(usize, bool)> = VecDeque::new();
    let mut rng = seed | 1;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let (mut grown, mut shrunk, mut lapses, mut idle_rounds) = (0u32, 0u32, 0u32, 0u32);
    for _step in 0..2_000_000 {
        let r = next();
        let i = (r >> 16) as usize % conns.len();
        let mut progressed = false;
        match r % 6 {
            // The client sends data (a stream, or a ping when no reply is awaited), or a
            // credit-only message (one that farms sends one whenever it may). One that paused
            // goes on once the queue took `receives` data messages since its last one's
            // receive was posted again (or no one else has data left to send).
            0 => {
                let c = &mut conns[i];
                if c.stream == 0 && c.after_pause > 0 && !c.paused {
                    // It pauses with its share grown: until then (or 3 000 more) it streams on.
                    if c.share.receives > credit || c.extra >= 3_000 || max_credit <= credit {
                        c.paused = true;
                    } else {
                        c.stream += 1;
                        c.expected += 1;
                        c.extra += 1;
                    }
                }
                let c = &conns[i];
                if c.paused && c.wire.is_empty() && c.unreaped.is_empty() && c.queued == 0 {
                    let lapsing = b.traffic - c.share.last_data >= u64::from(receives);
                    let others =
                        conns.iter().enumerate().any(|(k, o)| k != i && !o.gone && (o.stream > 0 || o.pings > 0));
                    if lapsing || !others {
                        let c = &mut conns[i];
                        c.stream = c.after_pause;
                        c.after_pause = 0;
                        c.paused = false;
                        c.expect_lapse = lapsing && c.share.receives > credit;
                    }
                }
                let c = &mut conns[i];
                if !c.gone && c.farm > 0 && c.client.can_send_control() {
                    let imm = c.client.send_control();
                    c.farm -= 1;
                    c.wire.push_back(imm);
                    progressed = true;
                } else if !c.gone && c.kind == Kind::StreamPauseStream && c.stream > 0 && c.client.can_send_data() {
                    // A greedy stream: every credit it may spend at once, so it runs low.
                    while c.stream > 0 && c.client.can_send_data() {
                        let imm = c.client.send_data();
                        c.stream -= 1;
                        c.wire.push_back(imm);
                    }
                    progressed = true;
                } else if !c.gone {
                    let ping = c.stream == 0 && c.pings > 0 && !c.awaiting;
                    if (c.stream > 0 || ping) && c.client.can_send_data() {
                        let imm = c.client.send_data();
                        if c.stream > 0 {
                            c.stream -= 1;
                        } else {
                            c.pings -= 1;
                            c.awaiting = true;
                        }
                        c.wire.push_back(imm);
                        progressed = true;
                    } else if c.client.wants_control() {
                        let imm = c.client.send_control();
                        c.wire.push_back(imm);
                        progressed = true;
                    }
                }
            }
            // A message lands: the device takes a receive of the SRQ.
            1 => {
                if let Some(imm) = conns[i].wire.pop_front() {
                    assert!(posted > reserve, "RNR or the reserve taken: a message landed with {posted} posted");
                    posted -= 1;
                    conns[i].unreaped.push_back(imm);
                    progressed = true;
                }
            }
            // The server reaps one.
            2 => {
                let c = &mut conns[i];
                if let Some(imm) = c.unreaped.pop_front() {
                    assert!(!c.server.exhausted(), "a peer keeping to its credit overdrew it");
                    c.server.on_receive(imm);
                    c.queued += 1;
                    repost.push_back((i, imm.control));
                    if !imm.control {
                        c.delivered += 1;
                        if c.awaiting {
                            c.replies += 1;
                        }
                    }
                    progressed = true;
                }
            }
            // The tick's posting: every waiting receive, or (a pool short of buffers) some.
            3 => {
                if !repost.is_empty() {
                    let n = if next() % 4 == 0 { 1 + next() as usize % repost.len() } else { repost.len() };
                    let batch: Vec<(usize, bool)> = repost.drain(..n).collect();
                    let all_posted = repost.is_empty();
                    for (j, control) in batch {
                        posted += 1;
                        let c = &mut conns[j];
                        c.queued -= 1;
                        let held = c.server.unused() + c.server.owed();
                        let before = c.share.receives;
                        // Its peer sent no data while the queue took `receives` data messages.
                        let silent = b.traffic + u64::from(!control) - c.share.last_data > u64::from(receives);
                        let lapsing = before > credit && !c.share.lapsed && silent;
                        let got = b.on_repost(&mut c.share, control, held, all_posted);
                        if lapsing || c.share.lapsed {
                            assert_eq!(got, Share::Shrink, "a grown share whose peer was silent is given back");
                        }
                        if c.expect_lapse {
                            assert!(
                                got == Share::Shrink || before == credit,
                                "a grown share idle for a queue's worth of traffic is given back: {got:?} at {before}"
                            );
                            c.expect_lapse = false;
                        }
                        lapses += u32::from(lapsing);
                        match got {
                            Share::Return => c.server.on_repost(control),
                            Share::Grow => {
                                c.server.on_repost(control);
                                c.server.grant_more();
                                c.server.resize(c.share.receives);
                                grown += 1;
                            }
                            Share::Shrink => {
                                c.server.resize(c.share.receives);
                                shrunk += 1;
                            }
                        }
                        c.peak = c.peak.max(c.share.receives);
                    }
                    progressed = true;
                }
            }
            // The server answers a ping (its grants ride on it), or sends a credit-only
            // message; the client's own receives are always posted again at once.
            4 => {
                let c = &mut conns[i];
                if c.replies > 0 && c.server.can_send_data() {
                    let imm = c.server.send_data();
                    c.replies -= 1;
                    c.awaiting = false;
                    c.client.on_receive(imm);
                    c.client.on_repost(false);
                    progressed = true;
                } else if c.server.wants_control() {
                    let imm = c.server.send_control();
                    c.client.on_receive(imm);
                    c.client.on_repost(true);
                    progressed = true;
                }
            }
            // Now and then an idle connection joins, or a quiet idle one leaves.
            _ => {
                if next() % 64 == 0 {
                    let idle = conns.iter().filter(|c| c.kind == Kind::Idle && !c.gone).count();
                    if next() % 2 == 0 && idle < 24 {
                        if b.admit() {
                            // In the place of one that left (nothing of it is queued), so the
                            // list stays short.
                            match conns.iter().position(|c| c.gone) {
                                Some(k) => conns[k] = new_conn(Kind::Idle, 0, 0),
                                None => conns.push(new_conn(Kind::Idle, 0, 0)),
                            }
                        }
                    } else if let Some(c) = conns.iter_mut().find(|c| {
                        c.kind == Kind::Idle && !c.gone && c.wire.is_empty() && c.unreaped.is_empty() && c.queued == 0
                    }) {
                        c.gone = true;
                        b.leave(c.share.receives);
                    }
                }
            }
        }
        let held: u32 = conns.iter().filter(|c| !c.gone).map(|c| c.share.receives).sum();
        assert_eq!(reserve + b.free() + held, receives, "every receive in exactly one place");
        let beyond: u32 = conns.iter().filter(|c| !c.gone).map(|c| c.share.receives - credit).sum();
        assert_eq!(b.grown, beyond, "the budget knows what the shares hold beyond their bases");
        assert!(beyond <= b.grow_cap(), "grown {beyond} beyond the cap {}", b.grow_cap());
        for c in conns.iter().filter(|c| !c.gone) {
            let share = c.share.receives;
            assert_eq!(share, c.server.unused() + c.server.owed() + c.queued, "{:?}'s share", c.kind);
            assert!((credit..=max_credit.max(credit)).contains(&share), "{:?}'s share {share}", c.kind);
            if c.kind == Kind::CreditOnly {
                assert_eq!(share, credit, "credit-only messages grew a share");
            }
        }
        idle_rounds = if progressed { 0 } else { idle_rounds + 1 };
        if idle_rounds > 20_000 {
            break;
        }
    }
    for c in &conns {
        assert_eq!(
            c.delivered,
            c.expected,
            "{:?}: every message delivered (SRQ {receives}/{credit}/{max_credit}/{reserve}: share {}, server's peer unused {} owed {}, client's credits {} unused {} owed {}, free {}; wire {} unreaped {} queued {} stream {} pings {} awaiting {} replies {}; idle rounds {idle_rounds})",
            c.kind,
            c.share.receives,
            c.server.unused(),
            c.server.owed(),
            c.client.credits(),
            c.client.unused(),
            c.client.owed(),
            b.free(),
            c.wire.len(),
            c.unreaped.len(),
            c.queued,
            c.stream,
            c.pings,
            c.awaiting,
            c.replies
        );
        assert!(c.wire.is_empty() && c.unreaped.is_empty() && c.queued == 0, "quiescent");
        assert_eq!(c.farm, 0, "the credit-only peer sent all it meant to");
    }
    assert!(repost.is_empty());
    if max_credit > credit {
        assert!(grown > 0 && shrunk > 0, "grew {grown}, shrank {shrunk}");
        for c in conns.iter().filter(|c| matches!(c.kind, Kind::Stream | Kind::StreamPauseStream)) {
            assert!(c.peak > credit, "a stream of {} grew (peak {})", c.expected, c.peak);
        }
        for c in conns.iter().filter(|c| matches!(c.kind, Kind::StreamThenPingPong | Kind::PingPong)) {
            assert_eq!(c.share.receives, credit, "{:?} is back at the base after its ping-pong (peak {}, SRQ {receives}/{credit}/{max_credit}/{reserve}, quiet {})", c.kind, c.peak, c.share.quiet);
        }
    }
    lapses
}

#[test]
fn srq_credit_follows_activity_no_rnr_no_loss() {
    let mut seed = 0x5eed_0f5a_5000_0001u64;
    let mut next = || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        seed
    };
    // Roomy, tight (growth stops near the kept room), with a reserve, static shares, and
    // the defaults.
    let mut lapses = Vec::new();
    for (receives, credit, max_credit, reserve) in
        [(1024, 3, 32, 0), (256, 3, 32, 16), (64, 3, 16, 8), (48, MIN_DEPTH, 8, 4), (96, 4, 4, 0), (4096, 3, 32, 256)]
    {
        for _ in 0..3 {
            lapses.push(simulate_srq(receives, credit, max_credit, reserve, next()));
        }
    }
    eprintln!("shares that lapsed, per run: {lapses:?}");
    assert!(lapses.iter().sum::<u32>() > 0, "some grown share lapsed and was given back");
}

/// Review of 2026-12-07, N9: peers that burst now and then, each burst running low, kept the
/// grown shares that fill the growth pool for good, and every other connection stayed at its
/// base. Now, while another busy connection is refused growth, a share grown more than
/// `SHARE_TTL_MS` ago lapses at its peer's next messages, and the newcomer grows.
#[test]
fn bursty_peers_cannot_hold_the_growth_pool_while_others_want_it() {
    use super::budget::SHARE_TTL_MS;
    let d = crate::SrqConfig::default();
    let mut b = SrqBudget::new(d.receives, d.credit, d.max_credit, d.reserve);
    b.set_now(1);
    // Attackers grow to max_credit until the growth pool is full (34 at the defaults).
    let mut attackers = Vec::new();
    while b.grown < b.grow_cap() {
        assert!(b.admit());
        let mut share = b.new_share();
        while share.receives < d.max_credit && b.grown < b.grow_cap() {
            b.on_repost(&mut share, DATA, 0, true);
        }
        attackers.push(share);
    }
    assert_eq!(attackers.len(), 34);
    assert!(b.admit());
    let mut busy = b.new_share();
    // The busy newcomer runs low at every message: refused growth, the pool being full.
    let burst = |b: &mut SrqBudget, attackers: &mut Vec<ConnShare>| {
        for a in attackers.iter_mut() {
            for _ in 0..4 {
                b.on_repost(a, DATA, 0, true);
            }
        }
    };
    for t in [2, 400, 900] {
        b.set_now(t);
        for _ in 0..10 {
            assert_eq!(b.on_repost(&mut busy, DATA, 0, true), Share::Return, "the pool is full");
        }
        // The attackers burst now and then, running low: within the time they keep it.
        burst(&mut b, &mut attackers);
        assert_eq!(b.grown, b.grow_cap(), "at {t} ms the grown shares are kept");
    }
    // Past the time: the attackers' next bursts give their growth back, one receive a message.
    b.set_now(2 + SHARE_TTL_MS + 1);
    assert_eq!(b.on_repost(&mut busy, DATA, 0, true), Share::Return, "still refused: marks the contention");
    for a in attackers.iter_mut() {
        // One receive kept per message, however low the peer runs, down to the base.
        while a.receives > d.credit {
            assert_eq!(b.on_repost(a, DATA, 0, true), Share::Shrink);
        }
    }
    assert_eq!(b.grown, 0);
    let mut grew = 0;
    for _ in 0..2_000 {
        if b.on_repost(&mut busy, DATA, 0, true) == Share::Grow {
            grew += 1;
        }
    }
    assert_eq!(busy.receives, d.max_credit, "the busy newcomer grew ({grew} times)");
    // With nobody refused since, a grown share is kept however old.
    b.set_now(2 + 10 * SHARE_TTL_MS);
    for _ in 0..100 {
        assert_ne!(b.on_repost(&mut busy, DATA, 0, true), Share::Shrink);
    }
}
