//! Catalogue case 38, bounded: 2 000 connect → transfer → close cycles, 16 at a time, with
//! random early closes (a client that closes as soon as it is established, before any
//! message) mixed with verified ping-pongs of 1 to 5 messages. Afterwards the process's
//! kernel objects and open fds are back to what they were before, and every cycle ended with
//! the outcome it should have.

mod util;

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use rdma_reactor::{CloseReason, Completion, Conn, ConnectOptions, ConnectionHandler, Ctx, Reactor, Token};
use util::*;

const CYCLES: usize = 2_000;
const IN_FLIGHT: usize = 16;
const SIZE: usize = 64;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").expect("/proc/self/fd").count()
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Closes its connection as soon as it is established.
struct Quitter(Rc<RefCell<Option<CloseReason>>>);

impl ConnectionHandler for Quitter {
    fn on_established(&mut self, conn: &mut Conn<'_>) {
        conn.close();
    }

    fn on_completion(&mut self, _conn: &mut Conn<'_>, _c: Completion) {}

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        *self.0.borrow_mut() = Some(reason);
    }
}

enum Cycle {
    Ping(Rc<RefCell<PingResult>>, u64),
    Quit(Rc<RefCell<Option<CloseReason>>>),
}

impl Cycle {
    fn done(&self) -> bool {
        match self {
            Cycle::Ping(p, _) => p.borrow().closed.is_some(),
            Cycle::Quit(q) => q.borrow().is_some(),
        }
    }
}

#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn two_thousand_cycles_with_random_early_closes_leave_nothing_behind() {
    // librdmacm keeps the device context it opens (two fds) for the life of the process:
    // open it before taking the baseline.
    {
        let mut warm = Reactor::new().expect("reactor");
        warm.listen(addr(), EchoListener { depth: 1, agents_closed: Rc::default() }).expect("listen");
    }
    let fds_before = open_fds();
    let rss_before = rss_kib();
    let started = Instant::now();
    let (mut pings, mut quits) = (0, 0);
    {
        let mut srv = Reactor::new().expect("server reactor");
        let mut cli = Reactor::new().expect("client reactor");
        let a = addr();
        let agents_closed = Rc::new(RefCell::new(Vec::new()));
        srv.listen(a, EchoListener { depth: 4, agents_closed: agents_closed.clone() }).expect("listen");
        let mut rng = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut live: Vec<Cycle> = Vec::new();
        let mut started_cycles = 0;
        let deadline = Instant::now() + Duration::from_secs(240);
        while started_cycles < CYCLES || !live.is_empty() {
            assert!(Instant::now() < deadline, "{started_cycles} cycles started, {} live: {cli:?}", live.len());
            while started_cycles < CYCLES && live.len() < IN_FLIGHT {
                let r = next();
                let opts = ConnectOptions { msg_size: SIZE as u32, ..ConnectOptions::default() };
                if r % 8 == 0 {
                    let q = Rc::new(RefCell::new(None));
                    cli.connect(a, opts, Quitter(q.clone())).expect("connect");
                    live.push(Cycle::Quit(q));
                    quits += 1;
                } else {
                    let count = 1 + (r >> 8) % 5;
                    let (c, result) = PingClient::new(started_cycles as u64, SIZE, count);
                    cli.connect(a, opts, c).expect("connect");
                    live.push(Cycle::Ping(result, count));
                    pings += 1;
                }
                started_cycles += 1;
            }
            srv.run_once(Some(Duration::from_millis(1))).expect("server run_once");
            cli.run_once(Some(Duration::from_millis(1))).expect("client run_once");
            let mut i = 0;
            while i < live.len() {
                if !live[i].done() {
                    i += 1;
                    continue;
                }
                match live.swap_remove(i) {
                    Cycle::Ping(p, count) => {
                        let p = p.borrow();
                        assert_eq!(
                            (p.echoed, p.verified_bytes, p.error.as_deref(), p.closed.clone()),
                            (count, count * SIZE as u64, None, Some(CloseReason::Local)),
                            "a ping-pong cycle: {p:?}"
                        );
                    }
                    Cycle::Quit(q) => assert_eq!(*q.borrow(), Some(CloseReason::Local), "an early close"),
                }
            }
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while agents_closed.borrow().len() < CYCLES {
            assert!(Instant::now() < deadline, "{} agents closed of {CYCLES}", agents_closed.borrow().len());
            srv.run_once(Some(Duration::from_millis(5))).expect("server run_once");
            cli.run_once(Some(Duration::from_millis(5))).expect("client run_once");
        }
        let closed = agents_closed.borrow();
        assert!(closed.iter().all(|c| matches!(c, CloseReason::Peer | CloseReason::Local)), "agents: {closed:?}");
        assert_eq!(srv.connections() + cli.connections(), 0);
    }
    let (fds_after, rss_after) = (open_fds(), rss_kib());
    println!(
        "{CYCLES} cycles ({pings} ping-pongs, {quits} early closes) in {:?}; fds {fds_before} -> {fds_after}; RSS {rss_before} -> {rss_after} KiB",
        started.elapsed()
    );
    assert_eq!(fds_after, fds_before, "open fds back to the baseline");
    let zero = ResCounts { qp: 0, cq: 0, mr: 0, pd: 0, cm_id: 0 };
    assert_eq!(res_counts(owner_id()), zero, "every kernel object destroyed");
}
