//! Shared receive queues (`Config::srq`) on a real RDMA device: verified echo over the SRQ,
//! receives refused on an SRQ connection, the credit rule's refusal, and flow control into an
//! SRQ server with no RNR NAK.

mod util;

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use rdma_reactor::{
    CloseReason, Completion, Config, Conn, ConnectOptions, ConnectRequest, ConnectionHandler, Ctx, Decision,
    ListenerHandler, Op, OpCode, Reactor, RejectCode, RejectReason, SrqConfig, Token,
};
use util::*;

/// What the SRQ agents saw.
#[derive(Debug, Default)]
struct AgentLog {
    /// `submit(Op::recv)` refusals, with their text.
    refused_recvs: Vec<String>,
    /// `recv_capacity()` in `on_ready`.
    capacities: Vec<u32>,
    /// Messages echoed (all with `Completion::SRQ_RECV` as user_data).
    echoed: u64,
    /// Receive completions with any other user_data.
    foreign: u64,
    closed: Vec<CloseReason>,
    refused_conns: Vec<RejectReason>,
}

struct SrqListener {
    log: Rc<RefCell<AgentLog>>,
}

impl ListenerHandler for SrqListener {
    fn on_connect_request(&mut self, _ctx: &mut Ctx<'_>, _req: &ConnectRequest) -> Decision {
        Decision::Accept(Box::new(SrqEcho { log: self.log.clone() }))
    }

    fn on_refused(&mut self, _ctx: &mut Ctx<'_>, _peer: Option<std::net::SocketAddr>, reason: &RejectReason) {
        self.log.borrow_mut().refused_conns.push(reason.clone());
    }
}

/// Echoes every message that arrives through the SRQ; tries once to post a receive of its own.
struct SrqEcho {
    log: Rc<RefCell<AgentLog>>,
}

impl ConnectionHandler for SrqEcho {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        let mut log = self.log.borrow_mut();
        log.capacities.push(conn.recv_capacity());
        let buf = conn.alloc(64).expect("a pool buffer");
        match conn.submit(Op::recv(buf)) {
            Ok(()) => panic!("a receive was accepted on an SRQ connection"),
            Err(e) => {
                assert!(e.op.opcode() == OpCode::Recv, "the operation comes back");
                log.refused_recvs.push(e.error.to_string());
            }
        }
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        if let (OpCode::Recv, Ok(_)) = (c.opcode, c.result) {
            if c.user_data != Completion::SRQ_RECV {
                self.log.borrow_mut().foreign += 1;
            }
            if conn.submit(Op::send(c.buf.expect("the SRQ receive carries its buffer"))).is_ok() {
                self.log.borrow_mut().echoed += 1;
            }
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        self.log.borrow_mut().closed.push(reason);
    }
}

fn srq_reactor(receives: u32, credit: u32) -> Reactor {
    srq_reactor_with(receives, credit, None)
}

fn srq_reactor_with(receives: u32, credit: u32, shared_cq: Option<u32>) -> Reactor {
    let srq = SrqConfig { receives, credit, max_credit: credit, buf_size: 4096, low_water: receives / 4, reserve: 0 };
    Reactor::with_config(Config { srq: Some(srq), shared_cq, ..Config::default() }).expect("SRQ reactor")
}

/// Eight clients ping-pong 200 verified messages each through a server whose receives all come
/// from one SRQ of 64; the handlers cannot post receives of their own and see a receive
/// capacity of 0; every completion carries `Completion::SRQ_RECV`; the SRQ stays full.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn echo_through_the_srq_every_byte_verified() {
    echo_through_the_srq(None);
}

/// The same with every connection on one shared CQ of 256 entries: receive completions of
/// eight queue pairs on one CQ reach their own connections (matched by `wc.qp_num`).
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn echo_through_the_srq_on_a_shared_cq() {
    echo_through_the_srq(Some(256));
}

fn echo_through_the_srq(shared_cq: Option<u32>) {
    let before = link_counters();
    let server = addr();
    let mut srv = srq_reactor_with(64, 8, shared_cq);
    let log = Rc::new(RefCell::new(AgentLog::default()));
    srv.listen(server, SrqListener { log: log.clone() }).expect("listen");
    let mut cli = Reactor::with_config(Config { send_depth: 4, recv_depth: 4, ..Config::default() }).expect("client");
    let mut results = Vec::new();
    for i in 0..8 {
        let (client, result) = PingClient::flow_controlled(i, 512, 200);
        let opts = ConnectOptions { msg_size: 512, ..Default::default() };
        cli.connect(server, opts, client).expect("connect");
        results.push(result);
    }
    pump(&mut [&mut srv, &mut cli], Duration::from_secs(300), "8 clients through the SRQ", || {
        results.iter().all(|r| r.borrow().closed.is_some())
    });
    for (i, r) in results.iter().enumerate() {
        let r = r.borrow();
        assert_eq!(r.error, None, "client {i}");
        assert_eq!(r.echoed, 200, "client {i}");
        assert_eq!(r.verified_bytes, 200 * 512, "client {i}");
    }
    pump(&mut [&mut srv, &mut cli], Duration::from_secs(30), "the agents close", || log.borrow().closed.len() == 8);
    let log = log.borrow();
    assert_eq!(log.capacities, vec![0; 8], "an SRQ connection has no receive queue of its own");
    assert_eq!(log.refused_recvs.len(), 8);
    assert!(log.refused_recvs.iter().all(|t| t.contains("shared receive queue")), "{:?}", log.refused_recvs);
    assert_eq!(log.echoed, 8 * 200);
    assert_eq!(log.foreign, 0, "every SRQ message carries Completion::SRQ_RECV");
    let st = srv.stats();
    println!("server {st:?}");
    // iWARP: each client's first message is the runtime's credit-only one (the initiator
    // speaks first), and its close says goodbye in another (the close handshake); each takes an
    // SRQ receive too.
    let hellos = if transport() == "siw" { 8 + 8 } else { 0 };
    assert_eq!(st.srq_consumed, 8 * 200 + hellos, "{st:?}");
    assert_eq!(st.srq_posted, 64 + 8 * 200 + hellos, "the initial fill, then one re-post per message: {st:?}");
    assert_eq!(st.srq_receives, 64, "the SRQ is full again: {st:?}");
    assert_eq!(st.srq_stale, 0, "{st:?}");
    assert!(st.srq_post_calls < st.srq_posted, "re-posts are chained: {st:?}");
    assert_no_rnr(&before, &link_counters(), "echo through the SRQ");
}

/// A client that connects and stays open until told to close.
struct Idle {
    closed: Rc<RefCell<Option<CloseReason>>>,
    up: Rc<RefCell<u32>>,
}

impl ConnectionHandler for Idle {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        // Three: enough to offer flow control, which the SRQ server requires.
        post_recvs(conn, 3, 64);
    }

    fn on_established(&mut self, _conn: &mut Conn<'_>) {
        *self.up.borrow_mut() += 1;
    }

    fn on_completion(&mut self, _conn: &mut Conn<'_>, _c: Completion) {}

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        *self.closed.borrow_mut() = Some(reason);
    }
}

/// An SRQ of 8 receives with a credit of 4 holds two connections: the third is refused with
/// `NoResources` and a text naming the shared receive queue, at the listener and at the
/// client; after one leaves, a new one is admitted.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn the_credit_rule_refuses_the_third_connection() {
    let server = addr();
    let mut srv = srq_reactor(8, 4);
    let log = Rc::new(RefCell::new(AgentLog::default()));
    srv.listen(server, SrqListener { log: log.clone() }).expect("listen");
    let mut cli = Reactor::new().expect("client");
    let up = Rc::new(RefCell::new(0));
    let mut conns = Vec::new();
    for _ in 0..2 {
        let closed = Rc::new(RefCell::new(None));
        let t = cli.connect(
            server,
            ConnectOptions { msg_size: 64, ..Default::default() },
            Idle { closed: closed.clone(), up: up.clone() },
        );
        conns.push((t.expect("connect"), closed));
    }
    pump(&mut [&mut srv, &mut cli], Duration::from_secs(60), "two connections up", || {
        assert!(conns.iter().all(|(_, c)| c.borrow().is_none()), "a connection closed: {:?}", conns[0].1.borrow());
        *up.borrow() == 2
    });
    let third = Rc::new(RefCell::new(None));
    cli.connect(
        server,
        ConnectOptions { msg_size: 64, ..Default::default() },
        Idle { closed: third.clone(), up: up.clone() },
    )
    .expect("connect");
    pump(&mut [&mut srv, &mut cli], Duration::from_secs(60), "the third refused", || third.borrow().is_some());
    let refusal = third.borrow().clone();
    match refusal {
        Some(CloseReason::Rejected { reason: Some(r), .. }) => {
            assert_eq!(r.code, RejectCode::NoResources, "{r}");
            assert!(r.text.contains("shared receive queue"), "{r}");
        }
        other => panic!("expected a reject with a reason, got {other:?}"),
    }
    {
        let l = log.borrow();
        assert_eq!(l.refused_conns.len(), 1, "{:?}", l.refused_conns);
        assert_eq!(l.refused_conns[0].code, RejectCode::NoResources);
        assert!(l.refused_conns[0].text.contains("shared receive queue"), "{}", l.refused_conns[0]);
        println!("refused: {}", l.refused_conns[0]);
    }
    assert_eq!(srv.stats().srq_refused, 1);
    // One leaves: there is room for a new one.
    cli.ctx().close(conns[0].0);
    let closed0 = conns[0].1.clone();
    pump(&mut [&mut srv, &mut cli], Duration::from_secs(60), "the first closes", || {
        closed0.borrow().is_some() && srv_closed(&log) == 1
    });
    let fourth = Rc::new(RefCell::new(None));
    cli.connect(
        server,
        ConnectOptions { msg_size: 64, ..Default::default() },
        Idle { closed: fourth.clone(), up: up.clone() },
    )
    .expect("connect");
    pump(&mut [&mut srv, &mut cli], Duration::from_secs(60), "the fourth up", || *up.borrow() == 3);
    assert_eq!(srv.stats().srq_refused, 1);
    assert!(fourth.borrow().is_none());
}

fn srv_closed(log: &Rc<RefCell<AgentLog>>) -> usize {
    log.borrow().closed.len()
}

/// `blast` with flow control into an SRQ server: 4 clients stream 20 000 verified messages
/// each (SEND, then RDMA WRITE with immediate) at a window far above the credit of 4: no
/// RNR NAK, nothing lost. On 17 receives the credits cannot grow; on 256 they grow to 32 (credit
/// that follows activity), and the WRITEs land in a ring with a slot for each (the server sizes
/// it by `--srq-max-credit`, the client takes the slot count from the ring's length: with slots
/// for the base credit only, a grown credit overwrote slots not yet read).
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn blast_into_an_srq_server_flow_control_no_rnr() {
    for (op, receives) in [("send", "17"), ("write", "17"), ("write", "256")] {
        let before = link_counters();
        let server = addr();
        let s = server.to_string();
        let srv = Proc::spawn(
            "blast server",
            bin("blast"),
            &[
                "server",
                "--bind",
                &s,
                "--verify",
                "--quiet",
                "--exit-after",
                "4",
                "--srq",
                "--srq-receives",
                receives,
                "--srq-credit",
                "4",
            ],
        );
        wait_listening(server, Duration::from_secs(30));
        let (ok, out) = run_output(
            bin("blast"),
            &[
                "client",
                "--connect",
                &s,
                "--clients",
                "4",
                "--size",
                "256",
                "--count",
                "20000",
                "--verify",
                "--window",
                "64",
                "--op",
                op,
            ],
            Duration::from_secs(240),
        );
        println!("{out}");
        assert!(ok, "blast client ({op}) failed:\n{out}");
        assert!(out.contains("80000 messages of 256 bytes"), "{out}");
        let st = srv.wait(Duration::from_secs(60));
        assert!(st.success(), "the SRQ server verified every message ({op}): exit {st}");
        assert_no_rnr(&before, &link_counters(), op);
    }
}

/// A client that claims flow control in its connect information but ignores its credits: it
/// posts 64 receives and sends 64 messages at once.
struct Flood {
    closed: Rc<RefCell<Option<CloseReason>>>,
    /// Sends the server's device acknowledged, and whether `on_established` ran.
    sent: Rc<RefCell<(u64, bool)>>,
}

impl ConnectionHandler for Flood {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        post_recvs(conn, 64, 64);
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        self.sent.borrow_mut().1 = true;
        for i in 0..64u8 {
            let mut buf = conn.alloc(64).expect("buffer");
            buf.fill_from(&[i; 64]).expect("fill");
            if conn.submit(Op::send(buf)).is_err() {
                return;
            }
        }
    }

    fn on_completion(&mut self, _conn: &mut Conn<'_>, c: Completion) {
        if c.opcode == OpCode::Send && c.result.is_ok() {
            self.sent.borrow_mut().0 += 1;
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        *self.closed.borrow_mut() = Some(reason);
    }
}

/// A peer that breaks its credit on the shared receive queue (it offered flow control, then
/// sends 64 messages into a credit of 4) is closed with a protocol error naming it; the SRQ
/// is refilled and serves the next connection.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_peer_beyond_its_credit_is_closed() {
    let server = addr();
    let mut srv = srq_reactor(64, 4);
    let log = Rc::new(RefCell::new(AgentLog::default()));
    srv.listen(server, SrqListener { log: log.clone() }).expect("listen");
    let mut cli = Reactor::with_config(Config { flow_control: false, ..Config::default() }).expect("client");
    let lie = lying_info();
    let opts = ConnectOptions { raw_private_data: Some(lie.encode(56).expect("encode")), ..Default::default() };
    let closed = Rc::new(RefCell::new(None));
    cli.connect(server, opts, Flood { closed: closed.clone(), sent: Rc::default() }).expect("connect");
    pump(&mut [&mut srv, &mut cli], Duration::from_secs(120), "the flooding peer closed", || {
        closed.borrow().is_some() && !log.borrow().closed.is_empty()
    });
    let why = log.borrow().closed[0].clone();
    match &why {
        CloseReason::Protocol(text) => assert!(text.contains("beyond its credit"), "{text}"),
        other => panic!("expected a protocol close, got {other}"),
    }
    let st = srv.stats();
    assert!(st.srq_overdrawn >= 1, "{st:?}");
    // The SRQ is whole again and serves a well-behaved client (from a reactor that offers
    // flow control: the SRQ server refuses one that does not).
    let mut good = Reactor::new().expect("client");
    let (client, result) = PingClient::flow_controlled(0, 64, 20);
    good.connect(server, ConnectOptions { msg_size: 64, ..Default::default() }, client).expect("connect");
    pump(&mut [&mut srv, &mut good], Duration::from_secs(120), "a good client after", || {
        result.borrow().closed.is_some()
    });
    assert_eq!(result.borrow().error, None);
    assert_eq!(result.borrow().echoed, 20);
    assert_eq!(srv.stats().srq_receives, 64, "{:?}", srv.stats());
}

/// A peer that sends 64 messages into a credit of 4 while the server's reactor is busy (not
/// polling): all 64 land on the SRQ (its device acknowledges them), and their receive
/// completions wait in the SRQ's own CQ of 64 entries. Before that CQ existed they went to the
/// connection's CQ, sized for its sends and its credit (8 + 4 here), which overran: the
/// device raised CQ_ERR, dropped the completions and, with them, the receives they consumed.
/// Now no CQ overruns, only the peer is closed (for breaking its credit), a well-behaved
/// connection on the same server (and, on a shared CQ, the same CQ) keeps being served, and
/// the SRQ is whole again.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_flood_while_the_server_is_busy_overruns_no_cq() {
    flood_while_busy(None);
}

/// The same with every connection on one shared CQ: an overrun there would fail them all.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_flood_while_the_server_is_busy_overruns_no_shared_cq() {
    flood_while_busy(Some(32));
}

fn flood_while_busy(shared_cq: Option<u32>) {
    let server = addr();
    let srq = SrqConfig { receives: 64, credit: 4, max_credit: 4, buf_size: 4096, low_water: 16, reserve: 0 };
    let cfg = Config { srq: Some(srq), send_depth: 8, shared_cq, ..Config::default() };
    let mut srv = Reactor::with_config(cfg).expect("SRQ reactor");
    let log = Rc::new(RefCell::new(AgentLog::default()));
    srv.listen(server, SrqListener { log: log.clone() }).expect("listen");

    // A well-behaved client, ping-ponging until told to stop.
    let mut good = Reactor::new().expect("client");
    let (client, result) = PingClient::flow_controlled(1, 64, u64::MAX);
    let t = good.connect(server, ConnectOptions { msg_size: 64, ..Default::default() }, client).expect("connect");
    pump(&mut [&mut srv, &mut good], Duration::from_secs(60), "the good client", || result.borrow().echoed >= 10);

    // The flooder: established with the server ticking, then the server stops ticking.
    let mut cli = Reactor::with_config(Config { flow_control: false, ..Config::default() }).expect("client");
    let lie = lying_info();
    let opts = ConnectOptions { raw_private_data: Some(lie.encode(56).expect("encode")), ..Default::default() };
    let (closed, sent) = (Rc::new(RefCell::new(None)), Rc::new(RefCell::new((0, false))));
    cli.connect(server, opts, Flood { closed: closed.clone(), sent: sent.clone() }).expect("connect");
    pump(&mut [&mut srv, &mut cli], Duration::from_secs(60), "the flooder established", || sent.borrow().1);
    pump(&mut [&mut cli], Duration::from_secs(60), "the flood acknowledged by the server's device", || {
        sent.borrow().0 == 64 || closed.borrow().is_some()
    });
    assert_eq!(sent.borrow().0, 64, "every message landed on the SRQ while the server was busy");

    // The server ticks again.
    let echoed = result.borrow().echoed;
    pump(
        &mut [&mut srv, &mut cli, &mut good],
        Duration::from_secs(60),
        "the flooder closed, the good one served",
        || closed.borrow().is_some() && !log.borrow().closed.is_empty() && result.borrow().echoed >= echoed + 20,
    );
    let st = srv.stats();
    println!("flood while busy (shared CQ {shared_cq:?}): server closed it with {}; {st:?}", log.borrow().closed[0]);
    match &log.borrow().closed[0] {
        CloseReason::Protocol(text) => assert!(text.contains("beyond its credit"), "{text}"),
        other => panic!("expected a protocol close for the flooder, got {other}"),
    }
    assert_eq!(result.borrow().error, None, "the good client saw every echo, verified");
    assert_eq!(result.borrow().closed, None, "the good client is still connected");
    good.ctx().close(t);
    pump(&mut [&mut srv, &mut good], Duration::from_secs(60), "the good client closed", || {
        result.borrow().closed.is_some() && log.borrow().closed.len() == 2
    });
    assert_eq!(result.borrow().closed, Some(CloseReason::Local));
    assert_eq!(srv.stats().srq_receives, 64, "the SRQ is whole again");
}

/// Keeps every message that arrives through the SRQ (the buffer is the handler's from then on)
/// and checks its bytes.
struct Hoarder {
    held: Rc<RefCell<Vec<rdma_reactor::Buf>>>,
    received: Rc<RefCell<u64>>,
    errors: Rc<RefCell<Vec<String>>>,
}

impl ConnectionHandler for Hoarder {
    fn on_completion(&mut self, _conn: &mut Conn<'_>, c: Completion) {
        if let (OpCode::Recv, Ok(n)) = (c.opcode, c.result) {
            let buf = c.buf.expect("the SRQ receive carries its buffer");
            let seq = *self.received.borrow();
            if n as usize != HOARD_SIZE || buf.as_slice() != pattern(HOARD_SIZE, 77, seq).as_slice() {
                self.errors.borrow_mut().push(format!("message {seq} differs"));
            }
            *self.received.borrow_mut() += 1;
            self.held.borrow_mut().push(buf);
        }
    }
}

/// Accepts with a [`Hoarder`].
struct HoardListener(Rc<RefCell<Vec<rdma_reactor::Buf>>>, Rc<RefCell<u64>>, Rc<RefCell<Vec<String>>>);

impl ListenerHandler for HoardListener {
    fn on_connect_request(&mut self, _ctx: &mut Ctx<'_>, _req: &ConnectRequest) -> Decision {
        Decision::Accept(Box::new(Hoarder { held: self.0.clone(), received: self.1.clone(), errors: self.2.clone() }))
    }
}

const HOARD_SIZE: usize = 4096;

/// Sends `n` messages once established (the reactor holds back what its credits do not allow).
struct Sender {
    n: u64,
    sent: Rc<RefCell<u64>>,
}

impl ConnectionHandler for Sender {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        // Three: enough to offer flow control, which the SRQ server requires.
        post_recvs(conn, 3, 64);
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        for seq in 0..self.n {
            let mut buf = conn.alloc(HOARD_SIZE).expect("send buffer");
            buf.fill_from(&pattern(HOARD_SIZE, 77, seq)).expect("fits");
            conn.submit(Op::send(buf)).expect("send");
        }
    }

    fn on_completion(&mut self, _conn: &mut Conn<'_>, c: Completion) {
        if c.opcode == OpCode::Send && c.result.is_ok() {
            *self.sent.borrow_mut() += 1;
        }
    }
}

/// Review finding: the SRQ's receives are re-posted with fresh pool buffers; when handlers
/// hold every buffer the pool may register, the re-posts wait. Buffers that come back with no
/// event to wake the reactor (dropped outside it, or in `on_closed` after the tick's posting)
/// used to leave the receives unposted until some unrelated event: under flow control the
/// peer, short of credits, sends nothing, so nothing came (`next_timeout()` told an outer loop
/// it could wait for the fd). Now a short refill timer retries: `next_timeout()` is at most
/// 5 ms while receives wait, the SRQ refills and every message arrives, verified.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn buffers_released_outside_the_reactor_refill_the_srq() {
    const N: u64 = 60;
    {
        let srq =
            SrqConfig { receives: 8, credit: 4, max_credit: 4, buf_size: HOARD_SIZE as u32, low_water: 0, reserve: 0 };
        // 32 chunks of 4 KiB in all: 8 posted, so the handler can hold 24 before the pool is dry.
        let pool =
            // (On iWARP each chunk has 64 bytes of slack for a tail: two clusters are a bit more.)
            rdma_reactor::PoolConfig {
                chunk_sizes: vec![HOARD_SIZE],
                cluster_bytes: 64 * 1024,
                max_bytes: if transport() == "siw" { 2 * 16 * (HOARD_SIZE + 64) } else { 128 * 1024 },
            };
        let mut srv = Reactor::with_config(Config { srq: Some(srq), pool, ..Config::default() }).expect("server");
        let a = addr();
        let (held, received, errors) = (Rc::default(), Rc::new(RefCell::new(0u64)), Rc::default());
        srv.listen(a, HoardListener(Rc::clone(&held), received.clone(), Rc::clone(&errors))).expect("listen");
        let mut cli = Reactor::new().expect("client");
        let sent = Rc::new(RefCell::new(0u64));
        let opts = ConnectOptions { msg_size: HOARD_SIZE as u32, ..ConnectOptions::default() };
        cli.connect(a, opts, Sender { n: N, sent: sent.clone() }).expect("connect");
        // Until the pool is dry and the receives it could not re-post are waiting.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while *received.borrow() < 24 || srv.stats().srq_receives >= 8 {
            assert!(std::time::Instant::now() < deadline, "the pool did not run dry: {}", received.borrow());
            srv.run_once(Some(Duration::from_millis(1))).expect("tick");
            cli.run_once(Some(Duration::from_millis(1))).expect("tick");
        }
        for _ in 0..50 {
            srv.run_once(Some(Duration::from_millis(1))).expect("tick");
            cli.run_once(Some(Duration::from_millis(1))).expect("tick");
        }
        let (got, posted) = (*received.borrow(), srv.stats().srq_receives);
        assert!(got < N, "the sender is held back by its credits: {got} of {N} arrived");
        // Released outside the reactor: no event announces it.
        held.borrow_mut().clear();
        let next = srv.next_timeout();
        println!(
            "SRQ starved: {got} of {N} messages held by the handler, {posted} of 8 receives posted; after the \
             handler let go of them, next_timeout() = {next:?}"
        );
        assert!(
            next.is_some_and(|t| t <= Duration::from_millis(5)),
            "receives wait for buffers: the reactor must try again soon, not wait for an event: {next:?}"
        );
        // Driven the way an outer loop would: wait as told, then tick.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while *received.borrow() < N {
            assert!(std::time::Instant::now() < deadline, "the SRQ was not refilled: {} of {N}", received.borrow());
            let wait = srv.next_timeout().unwrap_or(Duration::from_secs(1));
            srv.run_once(Some(wait)).expect("tick");
            cli.run_once(Some(Duration::ZERO)).expect("tick");
            held.borrow_mut().clear();
        }
        assert_eq!(*errors.borrow(), Vec::<String>::new(), "every byte verified");
        assert_eq!(srv.stats().srq_receives, 8, "the SRQ is full again");
        drop(cli);
        srv.shutdown(Duration::from_secs(1));
    }
}

// Hostile review (issue 22), findings 2, 4 and 5.

/// Streams messages of `size` bytes: `burst` submitted at once when established, one more for
/// each send that completes, `total` in all; receives what the server sends back (posting
/// `recvs` receives and re-posting each).
struct Streamer {
    size: usize,
    burst: u64,
    total: u64,
    recvs: u64,
    submitted: u64,
    log: Rc<RefCell<StreamLog>>,
}

#[derive(Debug, Default)]
struct StreamLog {
    established: bool,
    sent: u64,
    error: Option<String>,
    closed: Option<CloseReason>,
}

impl Streamer {
    fn new(size: usize, burst: u64, total: u64, recvs: u64) -> (Streamer, Rc<RefCell<StreamLog>>) {
        let log = Rc::new(RefCell::new(StreamLog::default()));
        (Streamer { size, burst, total, recvs, submitted: 0, log: log.clone() }, log)
    }

    fn send_one(&mut self, conn: &mut Conn<'_>) {
        if self.submitted >= self.total {
            return;
        }
        let mut buf = conn.alloc(self.size).expect("buffer");
        buf.fill_from(&pattern(self.size, 9, self.submitted)).expect("fill");
        if conn.submit(Op::send(buf)).is_ok() {
            self.submitted += 1;
        }
    }
}

impl ConnectionHandler for Streamer {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        if self.recvs > 0 {
            post_recvs(conn, self.recvs, self.size);
        }
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        self.log.borrow_mut().established = true;
        for _ in 0..self.burst {
            self.send_one(conn);
        }
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        match (c.opcode, c.result) {
            (OpCode::Send, Ok(_)) => {
                self.log.borrow_mut().sent += 1;
                self.send_one(conn);
            }
            (OpCode::Recv, Ok(_)) => {
                let _ = conn.submit(Op::recv(c.buf.expect("buffer")));
            }
            (op, Err(e)) => {
                self.log.borrow_mut().error.get_or_insert(format!("{op:?}: {e}"));
            }
            _ => {}
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        self.log.borrow_mut().closed = Some(reason);
    }
}

/// A client reactor that gives up on the first receiver-not-ready NAK (`rnr_retry_count` 0):
/// any moment at which the server's SRQ is empty when its message arrives kills its
/// connection with `RnrRetryExcErr`.
fn no_rnr_tolerance() -> Reactor {
    Reactor::with_config(Config { rnr_retry_count: 0, ..Config::default() }).expect("client")
}

/// Finding 2: a peer that leaves flow control off (an ordinary `echo`-style client of a
/// reactor with `flow_control: false`) keeps 64 sends outstanding into an SRQ server while a
/// well-behaved client that tolerates no RNR NAK ping-pongs. Before the fix the flooder was
/// accepted, never checked, and emptied the SRQ: the good client died with `RnrRetryExcErr`.
/// Now the flooder is refused (`Unsupported`, naming flow control) and the good client is
/// served, every echo verified.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_peer_without_flow_control_is_refused_and_cannot_starve_the_srq() {
    let before = link_counters();
    let server = addr();
    let srq = SrqConfig { receives: 64, credit: 8, max_credit: 8, buf_size: 4096, low_water: 16, reserve: 0 };
    let mut srv = Reactor::with_config(Config { srq: Some(srq), ..Config::default() }).expect("SRQ reactor");
    let log = Rc::new(RefCell::new(AgentLog::default()));
    srv.listen(server, SrqListener { log: log.clone() }).expect("listen");

    let mut good = no_rnr_tolerance();
    let (client, result) = PingClient::flow_controlled(1, 64, 400);
    good.connect(server, ConnectOptions { msg_size: 64, ..Default::default() }, client).expect("connect");
    pump(&mut [&mut srv, &mut good], Duration::from_secs(60), "the good client", || {
        result.borrow().echoed >= 10 || result.borrow().closed.is_some()
    });

    let mut bad = Reactor::with_config(Config { flow_control: false, ..Config::default() }).expect("client");
    let (flooder, flood) = Streamer::new(64, 64, 4000, 64);
    bad.connect(server, ConnectOptions { msg_size: 64, ..Default::default() }, flooder).expect("connect");
    pump(&mut [&mut srv, &mut good, &mut bad], Duration::from_secs(240), "the flood and the ping-pong", || {
        let f = flood.borrow();
        (f.closed.is_some() || f.sent >= 4000) && result.borrow().closed.is_some()
    });
    let (f, r) = (flood.borrow(), result.borrow());
    println!(
        "finding 2 (no flow control): flooder sent {} and closed with {:?}; good client echoed {} ({:?}, error {:?}); \
         listener refused {:?}; server {:?}",
        f.sent,
        f.closed,
        r.echoed,
        r.closed,
        r.error,
        log.borrow().refused_conns,
        srv.stats()
    );
    assert_eq!((r.echoed, r.error.as_deref()), (400, None), "the good client was served, every echo verified");
    assert_eq!(f.sent, 0, "the flooder never got to send");
    match &f.closed {
        Some(CloseReason::Rejected { reason: Some(why), .. }) => {
            assert_eq!(why.code, RejectCode::Unsupported, "{why:?}");
            assert!(why.text.contains("needs flow control"), "{why:?}");
        }
        other => panic!("the flooder was not refused: {other:?}"),
    }
    assert_eq!(log.borrow().refused_conns.len(), 1, "the listener heard the refusal");
    assert_no_rnr(&before, &link_counters(), "no flow control");
}

/// The server of the overdraw tests: an SRQ echo server with 16 receives for connections (4
/// of credit 4) and a reserve of 64.
fn overdraw_server() -> (Reactor, std::net::SocketAddr, Rc<RefCell<AgentLog>>) {
    let server = addr();
    let srq = SrqConfig { receives: 16 + 64, credit: 4, max_credit: 4, buf_size: 4096, low_water: 0, reserve: 64 };
    let mut srv = Reactor::with_config(Config { srq: Some(srq), ..Config::default() }).expect("SRQ reactor");
    let log = Rc::new(RefCell::new(AgentLog::default()));
    srv.listen(server, SrqListener { log: log.clone() }).expect("listen");
    (srv, server, log)
}

/// Two connections that hold their credit on the SRQ and send nothing.
fn idle_clients(server: std::net::SocketAddr) -> (Reactor, Vec<Rc<RefCell<StreamLog>>>) {
    let mut idle = Reactor::new().expect("client");
    let logs = (0..2)
        .map(|_| {
            let (s, l) = Streamer::new(64, 0, 0, 8);
            idle.connect(server, ConnectOptions { msg_size: 64, ..Default::default() }, s).expect("connect");
            l
        })
        .collect();
    (idle, logs)
}

/// What a `Flood` reports: how it closed, and (sends acknowledged, established).
type FloodLog = (Rc<RefCell<Option<CloseReason>>>, Rc<RefCell<(u64, bool)>>);

/// A peer that claims flow control with a receive depth of 64 and ignores credits: it sends 64
/// messages as soon as it is established.
fn connect_flooder(server: std::net::SocketAddr) -> (Reactor, FloodLog) {
    let mut bad = Reactor::with_config(Config { flow_control: false, ..Config::default() }).expect("client");
    let lie = lying_info();
    let opts = ConnectOptions { raw_private_data: Some(lie.encode(56).expect("encode")), ..Default::default() };
    let (closed, sent) = (Rc::new(RefCell::new(None)), Rc::new(RefCell::new((0, false))));
    bad.connect(server, opts, Flood { closed: closed.clone(), sent: sent.clone() }).expect("connect");
    (bad, (closed, sent))
}

/// Finding 2, its other half: a peer that does negotiate flow control, then sends 64 messages
/// at once into a credit of 4, while every other receive of the SRQ is promised (two idle
/// connections and a well-behaved client that tolerates no RNR NAK hold the rest of the
/// credits). Its overdraw lands before the reactor can look. The SRQ keeps a reserve of 64
/// receives granted to no one: the overdraw takes those, the peer is closed for breaking its
/// credit, and the good client is served. (With the server ticking all along, as here, the
/// code before the fix served the good client too, even with all 16 receives promised: every
/// tick re-posts what the flood took. The next test makes the flood land while the server
/// does not tick, which is where the reserve matters.)
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn an_overdraw_takes_the_reserve_not_receives_promised_to_others() {
    let (mut srv, server, log) = overdraw_server();
    let mut good = no_rnr_tolerance();
    let (client, result) = PingClient::flow_controlled(1, 64, 300);
    good.connect(server, ConnectOptions { msg_size: 64, ..Default::default() }, client).expect("connect");
    let (mut idle, idle_logs) = idle_clients(server);
    pump(&mut [&mut srv, &mut good, &mut idle], Duration::from_secs(60), "the good and idle clients", || {
        result.borrow().echoed >= 10 && idle_logs.iter().all(|l| l.borrow().established)
    });

    let (mut bad, (closed, _)) = connect_flooder(server);
    pump(&mut [&mut srv, &mut good, &mut idle, &mut bad], Duration::from_secs(240), "the overdraw", || {
        closed.borrow().is_some() && result.borrow().closed.is_some()
    });
    let r = result.borrow();
    println!(
        "finding 2 (overdraw): the flooder closed with {:?}; server closed {:?}; good client echoed {} ({:?}, error {:?}); \
         server {:?}",
        closed.borrow(),
        log.borrow().closed,
        r.echoed,
        r.closed,
        r.error,
        srv.stats()
    );
    assert_eq!((r.echoed, r.error.as_deref()), (300, None), "the good client was served, every echo verified");
    assert!(log
        .borrow()
        .closed
        .iter()
        .any(|c| matches!(c, CloseReason::Protocol(t) if t.contains("beyond its credit"))));
    assert!(srv.stats().srq_overdrawn >= 1);
    assert!(idle_logs.iter().all(|l| l.borrow().closed.is_none()), "the idle clients are still connected");
}

/// Finding 2's overdraw where it hurts: the flood lands while the server's reactor is not
/// ticking (a handler busy, the thread descheduled), so nothing is re-posted before an honest
/// client's next message arrives. 16 receives are promised (4 connections, a credit of 4
/// each), the reserve holds 64 more; a peer that lied about flow control sends 64 messages at
/// once, then, the server still not ticking, a client that tolerates no RNR NAK sends one
/// message within its credit: its receive must still be there. Without the reserve (the code
/// before the fix, with all 16 receives promised) the flood took them and the good client's
/// message was refused (`RnrRetryExcErr`).
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn an_overdraw_while_the_server_is_busy_leaves_promised_receives_in_place() {
    let (mut srv, server, log) = overdraw_server();
    let mut good = no_rnr_tolerance();
    let (g, glog) = Streamer::new(64, 0, 0, 8);
    let gt = good.connect(server, ConnectOptions { msg_size: 64, ..Default::default() }, g).expect("connect");
    let (mut idle, idle_logs) = idle_clients(server);
    pump(&mut [&mut srv, &mut good, &mut idle], Duration::from_secs(60), "the good and idle clients", || {
        glog.borrow().established && idle_logs.iter().all(|l| l.borrow().established)
    });

    let (mut bad, (closed, sent)) = connect_flooder(server);
    pump(&mut [&mut srv, &mut bad], Duration::from_secs(60), "the flooder established", || sent.borrow().1);
    // From here the server does not tick: the device takes a receive for each message of the
    // flood it can (the rest are NAKed and retried), and nothing is re-posted.
    let until = std::time::Instant::now() + Duration::from_millis(500);
    pump(&mut [&mut bad], Duration::from_secs(10), "the flood landed", || std::time::Instant::now() >= until);
    let landed = sent.borrow().0;
    {
        let mut ctx = good.ctx();
        let mut buf = ctx.alloc(gt, 64).expect("buffer");
        buf.fill_from(&[7; 64]).expect("fill");
        ctx.submit(gt, Op::send(buf)).expect("send");
    }
    pump(&mut [&mut good, &mut bad], Duration::from_secs(30), "the good client's message settled", || {
        let g = glog.borrow();
        g.sent >= 1 || g.error.is_some() || g.closed.is_some()
    });
    let outcome = format!("{:?}", glog.borrow());
    println!(
        "finding 2 (overdraw while the server does not tick): {landed} of the flood's 64 messages acknowledged by the \
         server's device; then the good client's one message: {outcome}"
    );
    assert_eq!(glog.borrow().error, None, "the good client's message found no receive (RNR)");
    assert_eq!(glog.borrow().sent, 1, "the good client's message was taken by a receive promised to it");
    pump(&mut [&mut srv, &mut good, &mut idle, &mut bad], Duration::from_secs(60), "the flooder closed", || {
        closed.borrow().is_some() && !log.borrow().closed.is_empty()
    });
    println!("then the server ticked: it closed {:?}; the flooder heard {:?}", log.borrow().closed, closed.borrow());
    assert!(log
        .borrow()
        .closed
        .iter()
        .any(|c| matches!(c, CloseReason::Protocol(t) if t.contains("beyond its credit"))));
    assert!(glog.borrow().closed.is_none(), "the good client is still connected");
    assert!(idle_logs.iter().all(|l| l.borrow().closed.is_none()), "the idle clients are still connected");
}

/// Keeps every buffer it receives, so the SRQ cannot be refilled from a pool that holds no
/// more than its receives.
struct Keeper(Rc<RefCell<Vec<rdma_reactor::Buf>>>);

impl ConnectionHandler for Keeper {
    fn on_completion(&mut self, _conn: &mut Conn<'_>, c: Completion) {
        if let Some(b) = c.buf {
            self.0.borrow_mut().push(b);
        }
    }
}

struct KeeperListener(Rc<RefCell<Vec<rdma_reactor::Buf>>>);

impl ListenerHandler for KeeperListener {
    fn on_connect_request(&mut self, _ctx: &mut Ctx<'_>, _req: &ConnectRequest) -> Decision {
        Decision::Accept(Box::new(Keeper(self.0.clone())))
    }
}

/// Finding 5: the SRQ's limit event was re-armed as soon as it was read, while the SRQ was
/// still below its mark, so every receive consumed below it raised another event, each copied
/// to every other reactor on the device. Here a handler keeps every buffer and the pool holds
/// only the SRQ's 64, so the SRQ drains below its mark of 32 and stays there while a client
/// with a credit of 60 sends its 59 messages one at a time (each after the last was
/// acknowledged, the reactors ticking in between): one dip, so one event; and the other
/// reactor on the device is passed none (the event named this reactor's own SRQ). Before the
/// fix: one event per message below the mark, each passed on.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn one_dip_below_the_srq_mark_raises_one_event_shared_with_no_one() {
    let server = addr();
    let srq = SrqConfig { receives: 64, credit: 60, max_credit: 60, buf_size: 4096, low_water: 32, reserve: 0 };
    let pool = rdma_reactor::PoolConfig { chunk_sizes: vec![4096], cluster_bytes: 64 * 4096, max_bytes: 64 * 4096 };
    let mut srv = Reactor::with_config(Config { srq: Some(srq), pool, ..Config::default() }).expect("SRQ reactor");
    let kept = Rc::new(RefCell::new(Vec::new()));
    srv.listen(server, KeeperListener(kept.clone())).expect("listen");
    // Another reactor with resources on the same device (a listener bound to it).
    let mut other = Reactor::new().expect("other reactor");
    other.listen(addr(), EchoListener { depth: 8, agents_closed: Rc::default() }).expect("listen");

    let mut cli = Reactor::new().expect("client");
    // One message in flight at a time, 200 in all: 59 fit the credit (one is kept in reserve).
    let (s, log) = Streamer::new(64, 1, 200, 8);
    cli.connect(server, ConnectOptions { msg_size: 64, ..Default::default() }, s).expect("connect");
    pump(&mut [&mut srv, &mut other, &mut cli], Duration::from_secs(120), "59 messages kept", || {
        kept.borrow().len() >= 59
    });
    for _ in 0..40 {
        for r in [&mut srv, &mut other, &mut cli] {
            r.run_once(Some(Duration::from_millis(5))).expect("run_once");
        }
    }
    let (s, o) = (srv.stats(), other.stats());
    println!(
        "finding 5: {} messages kept; SRQ limit events {}, receives posted {}; the other reactor was passed {} events",
        kept.borrow().len(),
        s.srq_limit_events,
        s.srq_receives,
        o.shared_async_events
    );
    assert_eq!(kept.borrow().len(), 59, "the client's credit of 60, one kept in reserve");
    assert_eq!(s.srq_limit_events, 1, "one dip below the mark, one event: {s:?}");
    assert_eq!(o.shared_async_events, 0, "the event named the server's own SRQ: {o:?}");
    // The buffers come back (dropped as they arrive from now on): the SRQ is refilled, the
    // limit armed again, and the rest flows.
    let mut received = 0;
    pump(&mut [&mut srv, &mut other, &mut cli], Duration::from_secs(120), "every message", || {
        received += kept.borrow().len();
        kept.borrow_mut().clear();
        log.borrow().sent == 200 && received == 200
    });
    assert_eq!(log.borrow().error, None);
    println!("finding 5: then {} limit events over all {received} messages", srv.stats().srq_limit_events);
}

/// Counts the messages that arrive and drops their buffers; records its close.
struct Sink(Rc<RefCell<(u64, Vec<CloseReason>)>>);

impl ConnectionHandler for Sink {
    fn on_completion(&mut self, _conn: &mut Conn<'_>, c: Completion) {
        if let (OpCode::Recv, Ok(_)) = (c.opcode, c.result) {
            self.0.borrow_mut().0 += 1;
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        self.0.borrow_mut().1.push(reason);
    }
}

struct SinkListener(Rc<RefCell<(u64, Vec<CloseReason>)>>);

impl ListenerHandler for SinkListener {
    fn on_connect_request(&mut self, _ctx: &mut Ctx<'_>, _req: &ConnectRequest) -> Decision {
        Decision::Accept(Box::new(Sink(self.0.clone())))
    }
}

/// Finding 4 (suspected): a queue pair on the SRQ destroyed while a multi-packet message was
/// landing in one of the SRQ's receives could leave that receive neither completed nor
/// posted, so the runtime's count of posted receives would drift above the device's and
/// credits would promise receives that are not there. Here 12 `blast client` processes
/// streaming 64 KiB messages (16 packets each at rxe's 4 KiB MTU) into an SRQ of 16 receives
/// are killed mid-transfer, one after another; then a client that tolerates no RNR NAK
/// spends its whole credit of 16 (15 messages, one held in reserve) again and again. One
/// receive lost would make the SRQ short of its credit: an RNR NAK, and that client's death.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn clients_killed_mid_message_lose_no_srq_receive() {
    const SIZE: usize = 64 * 1024;
    let before = link_counters();
    let server = addr();
    let s = server.to_string();
    let srq = SrqConfig { receives: 16, credit: 16, max_credit: 16, buf_size: SIZE as u32, low_water: 0, reserve: 0 };
    let mut srv = Reactor::with_config(Config { srq: Some(srq), ..Config::default() }).expect("SRQ reactor");
    let seen = Rc::new(RefCell::new((0u64, Vec::new())));
    srv.listen(server, SinkListener(seen.clone())).expect("listen");
    for round in 0..12u64 {
        let mut p = Proc::spawn(
            "blast client",
            bin("blast"),
            &["client", "--connect", &s, "--size", "64K", "--count", "100000", "--window", "16"],
        );
        let (got, closed) = (seen.borrow().0, seen.borrow().1.len());
        // Killed after a few messages, at a point in the stream that varies with the round.
        pump(&mut [&mut srv], Duration::from_secs(60), "messages from the blast client", || {
            seen.borrow().0 >= got + 3 + round % 5
        });
        kill9(&mut p);
        pump(&mut [&mut srv], Duration::from_secs(60), "the killed client's agent closed", || {
            seen.borrow().1.len() > closed
        });
    }
    let st = srv.stats();
    println!(
        "finding 4: 12 clients killed mid-transfer after {} messages; SRQ receives posted (the runtime's count) {}, \
         stale SRQ completions {}; agents closed with {:?}",
        seen.borrow().0,
        st.srq_receives,
        st.srq_stale,
        seen.borrow().1
    );
    assert_eq!(st.srq_receives, 16, "the runtime counts every receive posted: {st:?}");

    let mut good = no_rnr_tolerance();
    let (client, log) = Streamer::new(SIZE, 64, 240, 3);
    good.connect(server, ConnectOptions { msg_size: SIZE as u32, ..Default::default() }, client).expect("connect");
    let got = seen.borrow().0;
    pump(&mut [&mut srv, &mut good], Duration::from_secs(240), "240 messages at the whole credit", || {
        log.borrow().sent == 240 || log.borrow().closed.is_some()
    });
    pump(&mut [&mut srv, &mut good], Duration::from_secs(60), "all received", || {
        seen.borrow().0 == got + 240 || log.borrow().closed.is_some()
    });
    let l = log.borrow();
    println!("finding 4: then a client with no RNR tolerance sent {} at its full credit: {:?}", l.sent, l);
    assert_eq!((l.sent, l.error.as_deref(), &l.closed), (240, None, &None), "no receive was missing");
    assert_eq!(seen.borrow().0, got + 240);
    assert_no_rnr(&before, &link_counters(), "after the kills");
}

/// Connect information that claims flow control with 64 receives, from a client that keeps to
/// no credit. On iWARP it frames with tails too (or it is refused at connect time): it lies
/// about credits only.
fn lying_info() -> rdma_reactor::ConnectInfo {
    rdma_reactor::ConnectInfo {
        msg_size: 64,
        recv_depth: 64,
        flow_control: true,
        tail: transport() == "siw",
        ..Default::default()
    }
}

/// Streams `stream` messages (up to 64 in flight; the runtime holds what its credit does not
/// cover), then ping-pongs `pings`, every echo verified; then closes.
struct Phases {
    id: u64,
    size: usize,
    stream: u64,
    pings: u64,
    submitted: u64,
    echoed: u64,
    log: Rc<RefCell<StreamLog>>,
}

impl Phases {
    fn total(&self) -> u64 {
        self.stream + self.pings
    }

    /// Sends what the phase allows: in the stream, up to 64 beyond the echoes; in the
    /// ping-pong, one at a time.
    fn send(&mut self, conn: &mut Conn<'_>) {
        let window = if self.submitted < self.stream { 64 } else { 1 };
        while self.submitted < self.total() && self.submitted - self.echoed < window {
            let mut buf = conn.alloc(self.size).expect("buffer");
            buf.fill_from(&pattern(self.size, self.id, self.submitted)).expect("fill");
            if conn.submit(Op::send(buf)).is_err() {
                return;
            }
            self.submitted += 1;
            if self.submitted == self.stream {
                // The stream's last: the ping-pong starts once every echo is back.
                return;
            }
        }
    }
}

impl ConnectionHandler for Phases {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        post_recvs(conn, 64, self.size);
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        self.log.borrow_mut().established = true;
        self.send(conn);
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        match (c.opcode, c.result) {
            (OpCode::Send, Ok(_)) => self.log.borrow_mut().sent += 1,
            (OpCode::Recv, Ok(n)) => {
                let buf = c.buf.expect("buffer");
                if n as usize != self.size || buf.as_slice() != pattern(self.size, self.id, self.echoed).as_slice() {
                    self.log.borrow_mut().error.get_or_insert(format!("echo {} differs", self.echoed));
                    return conn.close();
                }
                self.echoed += 1;
                let _ = conn.submit(Op::recv(buf));
                if self.echoed == self.total() {
                    return conn.close();
                }
                self.send(conn);
            }
            (op, Err(e)) if self.echoed < self.total() => {
                self.log.borrow_mut().error.get_or_insert(format!("{op:?}: {e}"));
            }
            _ => {}
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        self.log.borrow_mut().closed = Some(reason);
    }
}

/// Issue 21, credit that follows activity: on an SRQ of 256 receives (credit 3, growing to 32,
/// reserve 16) with eight idle connections, a client that tolerates no RNR NAK streams 1 500
/// messages of 1 KiB (64 in flight), then ping-pongs 800, every echo verified. While it streams
/// its share grows (`Stats::srq_grown`, fewer free receives: `Stats::srq_free`); in the
/// ping-pong it gives the growth back (`srq_shrunk`), so before it closes every connection is
/// at its base again; after all closed every receive is free. No RNR NAK counted by rxe.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_busy_connection_grows_its_share_of_the_srq_and_gives_it_back() {
    let before = link_counters();
    let server = addr();
    let (receives, credit, reserve) = (256, 3, 16);
    let srq = SrqConfig { receives, credit, max_credit: 32, buf_size: 4096, low_water: 0, reserve };
    let mut srv = Reactor::with_config(Config { srq: Some(srq), ..Config::default() }).expect("SRQ reactor");
    let log = Rc::new(RefCell::new(AgentLog::default()));
    srv.listen(server, SrqListener { log: log.clone() }).expect("listen");
    let opts = || ConnectOptions { msg_size: 1024, ..Default::default() };
    let mut idle = Reactor::new().expect("client");
    let idle_logs: Vec<_> = (0..8)
        .map(|_| {
            let (s, l) = Streamer::new(64, 0, 0, 8);
            idle.connect(server, opts(), s).expect("connect");
            l
        })
        .collect();
    let mut busy = no_rnr_tolerance();
    let phases_log = Rc::new(RefCell::new(StreamLog::default()));
    let phases =
        Phases { id: 5, size: 1024, stream: 1500, pings: 800, submitted: 0, echoed: 0, log: phases_log.clone() };
    busy.connect(server, opts(), phases).expect("connect");
    let all_base = receives - reserve - 9 * credit;
    pump(&mut [&mut srv, &mut idle, &mut busy], Duration::from_secs(60), "the connections", || {
        phases_log.borrow().sent >= 750 && idle_logs.iter().all(|l| l.borrow().established)
    });
    let mid = srv.stats();
    println!("half way through the stream: grown {}, shrunk {}, free {}", mid.srq_grown, mid.srq_shrunk, mid.srq_free);
    assert!(mid.srq_grown > 0, "the stream's share grew: {mid:?}");
    assert!(mid.srq_free < u64::from(all_base), "it holds more than its base now: {mid:?}");
    pump(&mut [&mut srv, &mut idle, &mut busy], Duration::from_secs(120), "the stream and the ping-pong", || {
        phases_log.borrow().closed.is_some()
    });
    let end = srv.stats();
    let p = phases_log.borrow();
    println!(
        "after the ping-pong: grown {}, shrunk {}, free {} (all at the base: {all_base}); client {:?}",
        end.srq_grown, end.srq_shrunk, end.srq_free, *p
    );
    assert_eq!(p.error, None);
    assert_eq!(p.sent, 2300, "every message sent and echoed (verified)");
    assert!(end.srq_shrunk > 0, "the ping-pong gave the growth back: {end:?}");
    assert_eq!(end.srq_grown, end.srq_shrunk, "as much given back as grown: every share at its base");
    assert_eq!(end.srq_overdrawn, 0);
    drop(p);
    for l in &idle_logs {
        assert_eq!(l.borrow().closed, None, "the idle connections are still open");
    }
    drop(idle);
    pump(&mut [&mut srv], Duration::from_secs(30), "the server's closes", || srv_closed(&log) == 9);
    assert_eq!(srv.stats().srq_free, u64::from(receives - reserve), "after all closed every receive is free");
    assert_no_rnr(&before, &link_counters(), "credit that follows activity");
}
