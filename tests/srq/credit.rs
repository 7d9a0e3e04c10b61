//! Peers beyond their credit on the SRQ, and credit that follows activity (issue 21).

use super::*;

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
