//! Unit tests of the SRQ's pure parts: the queue-pair map and the credit rule, with a model of
//! the SRQ (streams, ping-pongs, idle joiners and leavers).

use std::collections::VecDeque;

use super::{ConnShare, QpMap, Share, SrqBudget};
use crate::proto::flow::{Flow, Imm, MIN_DEPTH};
use crate::proto::token::{ConnKey, GenSlab};

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
        g.on_repost(&mut share, 0, true);
    }
    assert_eq!(share.receives + g.free() + 64, 80, "grown into the free receives only");
    assert!(g.free() <= 80 / 8 + 1, "and no further than the room kept for newcomers");
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
    assert_eq!(b.on_repost(&mut share, 1, true), Share::Return, "low, but its first message: a hello");
    assert_eq!(b.on_repost(&mut share, 2, true), Share::Return, "two of three unused: not low");
    assert_eq!(b.on_repost(&mut share, 1, false), Share::Return, "low, but a receive waits unposted");
    for want in 4..=32 {
        // A share's worth of messages, running low, for each receive more (the first: the
        // three above were a share's worth already).
        for _ in 0..if want == 4 { 0 } else { want - 2 } {
            assert_eq!(b.on_repost(&mut share, 1, true), Share::Return);
        }
        assert_eq!(b.on_repost(&mut share, 1, true), Share::Grow);
        assert_eq!(share.receives, want);
    }
    assert_eq!(b.on_repost(&mut share, 1, true), Share::Return, "at max_credit");
    assert_eq!(b.free(), 1024 - 32);
    // A stream that runs low once per share's worth of messages keeps its share.
    for _ in 0..100 {
        for _ in 0..31 {
            assert_eq!(b.on_repost(&mut share, 20, true), Share::Return);
        }
        assert_eq!(b.on_repost(&mut share, 8, true), Share::Return, "low (a quarter left)");
    }
    // Its peer now never runs low (a ping-pong): one back per share's worth of messages.
    let mut messages = 0;
    while share.receives > 3 {
        let before = share.receives;
        let got = b.on_repost(&mut share, before - 1, true);
        messages += 1;
        assert!(got == Share::Return || (got == Share::Shrink && share.receives == before - 1));
    }
    assert_eq!(messages, (4..=32).sum::<u32>(), "a share's worth of messages per receive given back");
    for _ in 0..100 {
        assert_eq!(b.on_repost(&mut share, 2, true), Share::Return, "never below the base");
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
        b.on_repost(&mut busy, 0, true);
    }
    assert_eq!(busy.receives, 64);
    let mut n = 1;
    while b.free() >= 3 + 128 {
        assert!(b.admit());
        n += 1;
    }
    assert_eq!(b.on_repost(&mut busy, 0, true), Share::Return, "at the room kept: no growth");
    while b.admit() {
        n += 1;
    }
    assert!(b.free() < 3, "admitted down to the last receive");
    assert_eq!(b.on_repost(&mut busy, 0, true), Share::Shrink, "few free: even a busy one gives back");
    for _ in 0..60 {
        b.on_repost(&mut busy, 0, true);
    }
    assert_eq!(busy.receives, 3);
    while b.admit() {
        n += 1;
    }
    assert_eq!(n, 1024 / 3, "every connection the receives cover, once the busy one is back at its base");
}

/// A model of the shared receive queue on the host, as `Flow`'s is: connections of four
/// kinds (streaming, ping-pong, streaming then ping-pong, idle) on one SRQ, the server's
/// side of each with its `Flow` and share, the client's with its own receives; messages
/// land (consuming a receive of the SRQ), are reaped, and their receives posted again
/// (granted back, grown or shrunk by `SrqBudget::on_repost`) in random order; idle
/// connections join and leave. At every step: no message lands on an SRQ without a
/// receive beyond the reserve (no RNR, the reserve untouched), no peer sends beyond its
/// credit, every receive is in exactly one place (`reserve + free + shares = receives`),
/// each share is its peer's unused grants plus what is owed plus what waits to be posted,
/// and within `credit..=max_credit`. At the end: every message delivered, the streams grew,
/// and the connections that turned to ping-pong are back at the base.
fn simulate_srq(receives: u32, credit: u32, max_credit: u32, reserve: u32, seed: u64) {
    #[derive(Clone, Copy, PartialEq, Eq, Debug)]
    enum Kind {
        Stream,
        PingPong,
        StreamThenPingPong,
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
    };
    let mut b = SrqBudget::new(receives, credit, max_credit, reserve);
    let mut conns: Vec<C> = Vec::new();
    for (kind, stream, pings) in [
        (Kind::Stream, 1500, 0),
        (Kind::Stream, 1000, 0),
        (Kind::PingPong, 0, 300),
        (Kind::StreamThenPingPong, 1000, 700),
        (Kind::StreamThenPingPong, 500, 800),
        (Kind::Idle, 0, 0),
    ] {
        assert!(b.admit(), "the first connections fit");
        conns.push(new_conn(kind, stream, pings));
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
    let (mut grown, mut shrunk, mut idle_rounds) = (0u32, 0u32, 0u32);
    for _step in 0..2_000_000 {
        let r = next();
        let i = (r >> 16) as usize % conns.len();
        let mut progressed = false;
        match r % 6 {
            // The client sends data (a stream, or a ping when no reply is awaited), or a
            // credit-only message.
            0 => {
                let c = &mut conns[i];
                if !c.gone {
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
                        match b.on_repost(&mut c.share, held, all_posted) {
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
        for c in conns.iter().filter(|c| !c.gone) {
            let share = c.share.receives;
            assert_eq!(share, c.server.unused() + c.server.owed() + c.queued, "{:?}'s share", c.kind);
            assert!((credit..=max_credit.max(credit)).contains(&share), "{:?}'s share {share}", c.kind);
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
    }
    assert!(repost.is_empty());
    if max_credit > credit {
        assert!(grown > 0 && shrunk > 0, "grew {grown}, shrank {shrunk}");
        for c in conns.iter().filter(|c| c.kind == Kind::Stream) {
            assert!(c.peak > credit, "a stream of {} grew (peak {})", c.expected, c.peak);
        }
        for c in conns.iter().filter(|c| matches!(c.kind, Kind::StreamThenPingPong | Kind::PingPong)) {
            assert_eq!(c.share.receives, credit, "{:?} is back at the base after its ping-pong (peak {}, SRQ {receives}/{credit}/{max_credit}/{reserve}, quiet {})", c.kind, c.peak, c.share.quiet);
        }
    }
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
    for (receives, credit, max_credit, reserve) in
        [(1024, 3, 32, 0), (256, 3, 32, 16), (64, 3, 16, 8), (48, MIN_DEPTH, 8, 4), (96, 4, 4, 0), (4096, 3, 32, 256)]
    {
        for _ in 0..3 {
            simulate_srq(receives, credit, max_credit, reserve, next());
        }
    }
}
