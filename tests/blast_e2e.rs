//! Flow control, CQ room accounting and one-sided operations on a real RDMA device.

mod util;

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use rdma_reactor::{
    CloseReason, Completion, Config, Conn, ConnectOptions, ConnectRequest, ConnectionHandler, Ctx, Decision, Exposed,
    ListenerHandler, Op, OpCode, OpError, Reactor, RemoteAccess, RemoteSlice, Token, WcStatus,
};
use util::*;

/// 16 clients at once into one `blast` server process: all verified, totals exact.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn sixteen_clients_into_one_server_totals_exact() {
    let server = addr();
    let s = server.to_string();
    let srv = Proc::spawn(
        "blast server",
        bin("blast"),
        &["server", "--bind", &s, "--verify", "--exit-after", "16", "--quiet"],
    );
    wait_listening(server, Duration::from_secs(30));
    let (ok, out) = run_output(
        bin("blast"),
        &["client", "--connect", &s, "--clients", "16", "--size", "4096", "--count", "500", "--verify"],
        Duration::from_secs(300),
    );
    println!("{out}");
    assert!(ok, "blast client failed:\n{out}");
    assert!(out.contains("8000 messages of 4096 bytes (32768000 bytes)"), "{out}");
    let st = srv.wait(Duration::from_secs(60));
    assert!(st.success(), "the server verified every byte of all 16 connections: exit {st}");
}

/// 100 000 messages of 64 bytes with a receive depth of 4: flow control means no sender ever
/// finds the receiver without a posted receive, so rxe counts no RNR NAK, and nothing is lost.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn tiny_receive_depth_no_rnr_no_loss() {
    let before = link_counters();
    let server = addr();
    let s = server.to_string();
    let srv = Proc::spawn(
        "blast server",
        bin("blast"),
        &["server", "--bind", &s, "--verify", "--depth", "4", "--exit-after", "1", "--quiet"],
    );
    wait_listening(server, Duration::from_secs(30));
    let (ok, out) = run_output(
        bin("blast"),
        &["client", "--connect", &s, "--size", "64", "--count", "100000", "--verify", "--window", "256"],
        Duration::from_secs(600),
    );
    println!("{out}");
    assert!(ok, "blast client failed:\n{out}");
    assert!(out.contains("100000 messages of 64 bytes"), "{out}");
    let st = srv.wait(Duration::from_secs(60));
    assert!(st.success(), "the server received and verified all 100000 messages: exit {st}");
    let after = link_counters();
    for counter in ["rcvd_rnr_err", "send_rnr_err", "retry_rnr_exceeded_err"] {
        let (b, a) = (before.get(counter), after.get(counter));
        assert!(a.is_some(), "rxe has no counter {counter}: {after:?}");
        assert_eq!(a, b, "{counter} moved: RNR NAKs happened");
    }
    println!("rxe counters after: {after:?}");
}

// ----- 200 connections on one CQ ------------------------------------------------------------

struct Sink;

impl ListenerHandler for Sink {
    fn on_connect_request(&mut self, _ctx: &mut Ctx<'_>, _req: &ConnectRequest) -> Decision {
        Decision::Accept(Box::new(SinkAgent))
    }
}

/// Counts and re-posts every receive.
struct SinkAgent;

impl ConnectionHandler for SinkAgent {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        for _ in 0..8 {
            let b = conn.alloc(256).expect("buffer");
            conn.submit(Op::recv(b)).expect("recv");
        }
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        if let (OpCode::Recv, Ok(_)) = (c.opcode, c.result) {
            // Refused once the connection is closing; the buffer then just goes back.
            let _ = conn.submit(Op::recv(c.buf.expect("buffer")));
        }
    }
}

#[derive(Default)]
struct Counts {
    sent: u64,
    closed_clean: u64,
    failures: Vec<String>,
}

/// Submits `count` sends at once, closes when all completed.
struct Burst {
    count: u64,
    done: u64,
    counts: Rc<RefCell<Counts>>,
}

impl ConnectionHandler for Burst {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        for _ in 0..3 {
            let b = conn.alloc(64).expect("buffer");
            conn.submit(Op::recv(b)).expect("recv");
        }
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        for i in 0..self.count {
            let mut b = conn.alloc(256).expect("buffer");
            b.fill_from(&pattern(256, conn.token().as_u64(), i)).expect("fill");
            conn.submit(Op::send(b).user_data(i)).expect("submit");
        }
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        match (c.opcode, c.result) {
            (OpCode::Send, Ok(_)) => {
                self.done += 1;
                self.counts.borrow_mut().sent += 1;
                if self.done == self.count {
                    conn.close();
                }
            }
            (OpCode::Recv, Ok(_)) => {
                let _ = conn.submit(Op::recv(c.buf.expect("buffer")));
            }
            (_, Err(OpError::Wc(WcStatus::WrFlushErr) | OpError::Cancelled)) => {}
            (op, Err(e)) => self.counts.borrow_mut().failures.push(format!("{op:?}: {e}")),
            _ => {}
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        let mut c = self.counts.borrow_mut();
        if reason == CloseReason::Local && self.done == self.count {
            c.closed_clean += 1;
        } else {
            c.failures.push(format!("closed after {} of {}: {reason}", self.done, self.count));
        }
    }
}

/// 200 client connections share one 1024-entry CQ; each submits 16 sends at once, 3200 in
/// all, far more than the CQ could hold unchecked. The reactor holds sends back until the CQ
/// has room: no overrun, no lost completion, every send completes.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn two_hundred_connections_share_one_cq_without_overrun() {
    let server_addr = addr();
    let mut server =
        Reactor::with_config(Config { recv_depth: 8, send_depth: 8, ..Config::default() }).expect("server");
    server.listen(server_addr, Sink).expect("listen");
    let cfg = Config { shared_cq: Some(1024), recv_depth: 3, send_depth: 16, ..Config::default() };
    let mut clients = Reactor::with_config(cfg).expect("clients");
    let counts = Rc::new(RefCell::new(Counts::default()));
    for _ in 0..200 {
        let h = Burst { count: 16, done: 0, counts: counts.clone() };
        clients.connect(server_addr, ConnectOptions { msg_size: 256, ..Default::default() }, h).expect("connect");
    }
    let deadline = Instant::now() + Duration::from_secs(600);
    while counts.borrow().closed_clean + counts.borrow().failures.len() as u64 != 200 {
        assert!(Instant::now() < deadline, "not done: {:?}", clients.stats());
        clients.run_once(Some(Duration::from_millis(1))).expect("client tick");
        server.run_once(Some(Duration::from_millis(1))).expect("server tick");
    }
    let c = counts.borrow();
    assert!(c.failures.is_empty(), "{:?}", c.failures);
    assert_eq!(c.sent, 200 * 16, "every send completed exactly once");
    let stats = clients.stats();
    println!("clients {stats:?}");
    assert!(stats.cq_peak_reserved <= 1024, "never more work than the CQ holds: {stats:?}");
    assert!(stats.cq_room_waits > 0, "the test exceeded the CQ's room, so accounting was exercised: {stats:?}");
    assert_eq!(stats.stale_completions, 0);
}

// ----- RDMA READ ----------------------------------------------------------------------------

const CHUNK: usize = 8192;

/// Accepts agents that expose a chunk filled with a pattern (READ only) and send its
/// descriptor.
struct Exposer;

impl ListenerHandler for Exposer {
    fn on_connect_request(&mut self, _ctx: &mut Ctx<'_>, _req: &ConnectRequest) -> Decision {
        Decision::Accept(Box::new(ExposerAgent { exposed: None }))
    }
}

struct ExposerAgent {
    exposed: Option<Exposed>,
}

impl ConnectionHandler for ExposerAgent {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        for _ in 0..4 {
            let b = conn.alloc(64).expect("buffer");
            conn.submit(Op::recv(b)).expect("recv");
        }
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        let mut chunk = conn.alloc(CHUNK).expect("chunk");
        chunk.fill_from(&pattern(CHUNK, 77, 0)).expect("fill");
        let exposed = chunk.expose(RemoteAccess::READ).expect("expose");
        let desc = exposed.remote().slice(0, CHUNK as u32).expect("fits");
        self.exposed = Some(exposed);
        let mut msg = conn.alloc(16).expect("buffer");
        msg.fill_from(&desc.encode()).expect("16 bytes");
        conn.submit(Op::send(msg)).expect("send descriptor");
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        if let (OpCode::Recv, Ok(_)) = (c.opcode, c.result) {
            let _ = conn.submit(Op::recv(c.buf.expect("buffer")));
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tamper {
    /// READ with the descriptor as sent.
    None,
    /// READ with an rkey the peer never exposed.
    BadKey,
    /// WRITE into a region exposed for READ only.
    WriteToReadOnly,
}

#[derive(Debug, Default)]
struct ReadResult {
    read: Option<Result<Vec<u8>, OpError>>,
    closed: Option<CloseReason>,
}

struct Reader {
    tamper: Tamper,
    result: Rc<RefCell<ReadResult>>,
}

impl ConnectionHandler for Reader {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        for _ in 0..4 {
            let b = conn.alloc(64).expect("buffer");
            conn.submit(Op::recv(b)).expect("recv");
        }
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        match (c.opcode, c.result) {
            (OpCode::Recv, Ok(n)) => {
                let buf = c.buf.expect("buffer");
                let mut desc = RemoteSlice::decode(&buf.as_slice()[..n as usize]).expect("descriptor");
                let local = conn.alloc(CHUNK).expect("buffer");
                let op = match self.tamper {
                    Tamper::None => Op::read(local, desc),
                    Tamper::BadKey => {
                        desc.rkey ^= 0x00ab_cd00;
                        Op::read(local, desc)
                    }
                    Tamper::WriteToReadOnly => {
                        let mut local = local;
                        local.fill_from(&[0xee; CHUNK]).expect("fill");
                        Op::write(local, desc)
                    }
                };
                conn.submit(op).expect("submit");
            }
            (OpCode::Read | OpCode::Write, result) => {
                self.result.borrow_mut().read = Some(result.map(|_| c.buf.expect("buffer").as_slice().to_vec()));
            }
            _ => {}
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        self.result.borrow_mut().closed = Some(reason);
    }
}

/// RDMA READ of a peer's exposed chunk returns its exact bytes. A READ with an rkey the peer
/// never exposed, and a WRITE into memory exposed for READ only, fail with a remote access
/// error reported to the callback; the runtime closes those connections and keeps serving the
/// others (a ping-pong connection keeps going throughout).
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn read_returns_exact_bytes_and_bad_keys_fail_alone() {
    let mut reactor = Reactor::new().expect("reactor");
    let server = addr();
    reactor.listen(server, Exposer).expect("listen");
    let pp_server = addr();
    reactor
        .listen(pp_server, EchoListener { depth: 4, agents_closed: Rc::new(RefCell::new(Vec::new())) })
        .expect("listen");
    let (pinger, ping) = PingClient::new(9, 128, 2000);
    reactor.connect(pp_server, ConnectOptions { msg_size: 128, ..Default::default() }, pinger).expect("connect");
    let mut results = Vec::new();
    for tamper in [Tamper::None, Tamper::BadKey, Tamper::WriteToReadOnly] {
        let r = Rc::new(RefCell::new(ReadResult::default()));
        reactor.connect(server, ConnectOptions::default(), Reader { tamper, result: r.clone() }).expect("connect");
        results.push((tamper, r));
    }
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let reads_done = results.iter().all(|(t, r)| {
            let r = r.borrow();
            r.read.is_some() && (*t == Tamper::None || r.closed.is_some())
        });
        if reads_done && ping.borrow().closed.is_some() {
            break;
        }
        assert!(Instant::now() < deadline, "not done: {results:?} {:?}", ping.borrow());
        reactor.run_once(Some(Duration::from_millis(100))).expect("tick");
    }
    for (tamper, r) in &results {
        let r = r.borrow();
        match tamper {
            Tamper::None => assert_eq!(r.read, Some(Ok(pattern(CHUNK, 77, 0))), "the exact bytes"),
            Tamper::BadKey | Tamper::WriteToReadOnly => {
                assert_eq!(r.read, Some(Err(OpError::Wc(WcStatus::RemAccessErr))), "{tamper:?}");
                assert_eq!(r.closed, Some(CloseReason::WorkError(WcStatus::RemAccessErr)), "{tamper:?}");
            }
        }
    }
    let p = ping.borrow();
    assert_eq!(p.error, None);
    assert_eq!(p.echoed, 2000, "the other connection kept being served");
}
