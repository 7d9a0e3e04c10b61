//! Verified echo through the SRQ, the credit rule's refusal, and `blast` with flow control into it.

use super::*;

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
