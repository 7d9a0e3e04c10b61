//! Faults and limits on a real RDMA device (`../FAULTS.md` lists every case and its test):
//! what the user's callbacks see when a limit is reached or the device refuses a resource,
//! that the other connections keep working, and that the kernel objects return to baseline.
//!
//! Server and clients are two reactors on the test's thread, ticked in turn.

mod util;

#[path = "faults/admission.rs"]
mod admission;
#[path = "faults/completions.rs"]
mod completions;
#[path = "faults/panics.rs"]
mod panics;
#[path = "faults/reachability.rs"]
mod reachability;
#[path = "faults/timers.rs"]
mod timers;

use std::cell::RefCell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use rdma_reactor::{
    CloseReason, Config, ConnectOptions, ConnectRequest, Ctx, Decision, Error, ListenerHandler, Reactor, RejectCode,
    RejectReason,
};
use util::*;

const SIZE: usize = 64;
const LIMIT: Duration = Duration::from_secs(30);

/// Ticks every reactor in turn until `done()`; panics after `limit` (never hangs).
fn pump(reactors: &mut [&mut Reactor], limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "condition not met after {limit:?}: {reactors:?}");
        for r in reactors.iter_mut() {
            r.run_once(Some(Duration::from_millis(1))).expect("run_once");
        }
    }
}

/// What the listener heard.
#[derive(Default)]
struct Heard {
    accepted: usize,
    refused: Vec<RejectReason>,
    agents_closed: Rc<RefCell<Vec<CloseReason>>>,
}

/// Accepts every request with an echo agent and records refusals.
struct Recording(Rc<RefCell<Heard>>);

impl ListenerHandler for Recording {
    fn on_connect_request(&mut self, ctx: &mut Ctx<'_>, req: &ConnectRequest) -> Decision {
        let closed = self.0.borrow().agents_closed.clone();
        self.0.borrow_mut().accepted += 1;
        EchoListener { depth: 4, agents_closed: closed }.on_connect_request(ctx, req)
    }

    fn on_refused(&mut self, _ctx: &mut Ctx<'_>, _peer: Option<SocketAddr>, reason: &RejectReason) {
        self.0.borrow_mut().refused.push(reason.clone());
    }
}

fn server(cfg: Config) -> (Reactor, SocketAddr, Rc<RefCell<Heard>>) {
    let mut r = Reactor::with_config(cfg).expect("server reactor");
    let a = addr();
    let heard = Rc::new(RefCell::new(Heard::default()));
    r.listen(a, Recording(heard.clone())).expect("listen");
    (r, a, heard)
}

type Ping = Rc<RefCell<PingResult>>;

/// Starts a ping-pong client of `count` verified messages.
fn ping(client: &mut Reactor, a: SocketAddr, id: u64, count: u64) -> Ping {
    let (c, result) = PingClient::new(id, SIZE, count);
    let opts = ConnectOptions { msg_size: SIZE as u32, ..ConnectOptions::default() };
    client.connect(a, opts, c).expect("connect");
    result
}

fn closed(p: &Ping) -> bool {
    p.borrow().closed.is_some()
}

/// The reject reason a refused client heard.
fn rejected_with(p: &Ping) -> RejectReason {
    match p.borrow().closed.clone() {
        Some(CloseReason::Rejected { reason: Some(r), .. }) => r,
        other => panic!("expected a rejection with a reason, got {other:?}"),
    }
}

fn assert_served(p: &Ping, count: u64) {
    let r = p.borrow();
    assert_eq!(r.error, None);
    assert_eq!(r.echoed, count, "every message echoed and verified");
    assert_eq!(r.closed, Some(CloseReason::Local));
}

fn assert_baseline() {
    let zero = ResCounts { qp: 0, cq: 0, mr: 0, pd: 0, cm_id: 0 };
    assert_eq!(res_counts(owner_id()), zero, "every kernel object of this test destroyed");
}

/// Whether a TCP socket listens on `a` (`/proc/net/tcp`: an iWARP listener's is siw's kernel
/// socket).
fn tcp_listening(a: SocketAddr) -> bool {
    let port = format!(":{:04X} ", a.port());
    let table = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
    table.lines().any(|l| l.contains(&port) && l.split_whitespace().nth(3) == Some("0A"))
}

/// What the burst client of the stalled-peer test saw.
#[derive(Default)]
struct BurstSeen {
    established: bool,
    echoed: u64,
    sends_ok: u64,
    sends_failed: u64,
    closed: Option<CloseReason>,
    error: Option<String>,
}

/// Sends whatever the test submits; re-posts a receive for every echo and checks its bytes
/// (the echo server keeps order, so the n-th echo is message n).
struct Burst(Rc<RefCell<BurstSeen>>);

const BURST_CONN: u64 = 14;

impl rdma_reactor::ConnectionHandler for Burst {
    fn on_ready(&mut self, conn: &mut rdma_reactor::Conn<'_>) {
        post_recvs(conn, 16, SIZE);
    }

    fn on_established(&mut self, _conn: &mut rdma_reactor::Conn<'_>) {
        self.0.borrow_mut().established = true;
    }

    fn on_completion(&mut self, conn: &mut rdma_reactor::Conn<'_>, c: rdma_reactor::Completion) {
        let mut s = self.0.borrow_mut();
        match (c.opcode, c.result) {
            (rdma_reactor::OpCode::Recv, Ok(n)) => {
                let buf = c.buf.expect("buffer");
                if n as usize != SIZE || buf.as_slice() != pattern(SIZE, BURST_CONN, s.echoed).as_slice() {
                    let msg = format!("echo {} differs", s.echoed);
                    s.error.get_or_insert(msg);
                }
                s.echoed += 1;
                drop(buf);
                if let Ok(b) = conn.alloc(SIZE) {
                    let _ = conn.submit(rdma_reactor::Op::recv(b));
                }
            }
            (rdma_reactor::OpCode::Recv, Err(_)) => {}
            (_, Ok(_)) => s.sends_ok += 1,
            (_, Err(_)) => s.sends_failed += 1,
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _t: rdma_reactor::Token, reason: CloseReason) {
        self.0.borrow_mut().closed = Some(reason);
    }
}

/// Submits messages `from..to` of the burst connection `t`.
fn burst(cli: &mut Reactor, t: rdma_reactor::Token, from: u64, to: u64) {
    for seq in from..to {
        let mut buf = cli.ctx().alloc(t, SIZE).expect("send buffer");
        buf.fill_from(&pattern(SIZE, BURST_CONN, seq)).expect("fits");
        cli.ctx().submit(t, rdma_reactor::Op::send(buf)).expect("submit");
    }
}
