//! Peers killed with SIGKILL: idle, under load, the server itself, at points of the handshake.

use super::*;

/// Case 11: a peer process killed while its connection is idle. Its kernel sends a DREQ: the
/// agent closes with `Peer`, promptly; the good client is untouched.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn peer_killed_while_idle_closes_its_agent_with_peer() {
    {
        let mut r = Reactor::new().expect("reactor");
        let s = listen(&mut r, 4);
        let good = ping(&mut r, s.addr, 1, u64::MAX);
        let mut victim = echo_client(s.addr, SIZE, 5, 600_000);
        let deadline = Instant::now() + LIMIT;
        // Established counts both ends of the good client (2) and the victim's agent (1).
        while r.stats().established < 3 {
            assert!(Instant::now() < deadline, "the echo client never connected");
            r.run_once(Some(Duration::from_millis(5))).expect("run_once");
        }
        // Its 5 round trips take a moment; then it sits idle.
        let idle = Instant::now() + Duration::from_millis(500);
        pump(&mut [&mut r], LIMIT, "idle", || Instant::now() >= idle);
        let killed = Instant::now();
        kill9(&mut victim);
        pump(&mut [&mut r], LIMIT, "the agent closed", || !s.agents_closed.borrow().is_empty());
        println!("agent of the killed idle peer closed after {:?}", killed.elapsed());
        assert_eq!(*s.agents_closed.borrow(), vec![CloseReason::Peer]);
        still_served(&mut [&mut r], &good, 20);
    }
    assert_baseline();
}

/// Case 12: a peer process killed under load (4 KiB ping-pong at full rate). The agent
/// closes with `Peer`, or with the work error its last posted request got; never a protocol
/// error; the good client is untouched. (The server runs a keepalive: an agent waiting for
/// credits has nothing in flight, so if the dead peer's DREQ is lost only a probe notices.)
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn peer_killed_under_load_costs_one_connection() {
    {
        let cfg = Config { keepalive: Some(Duration::from_millis(500)), ..Config::default() };
        let mut r = Reactor::with_config(cfg).expect("reactor");
        let s = listen(&mut r, 8);
        let good = ping(&mut r, s.addr, 1, u64::MAX);
        let mut victim = echo_client(s.addr, 4096, 1_000_000, 0);
        let deadline = Instant::now() + LIMIT;
        // Established counts both ends of the good client (2) and the victim's agent (1).
        while r.stats().established < 3 || r.stats().completions < 2_000 {
            assert!(Instant::now() < deadline, "no traffic from the echo client: {:?}", r.stats());
            r.run_once(Some(Duration::from_millis(5))).expect("run_once");
        }
        kill9(&mut victim);
        pump(&mut [&mut r], LIMIT, "the agent closed", || !s.agents_closed.borrow().is_empty());
        let closed = s.agents_closed.borrow().clone();
        assert!(
            matches!(closed.as_slice(), [CloseReason::Peer] | [CloseReason::WorkError(_)]),
            "the agent of the killed peer: {closed:?}"
        );
        still_served(&mut [&mut r], &good, 20);
    }
    assert_baseline();
}

/// Case 37 (the other side of it): the server process is killed; our clients hear it as
/// `Peer` (its kernel's DREQ) or a work error, each once, and leave nothing behind.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn server_killed_its_clients_close_and_leave_nothing() {
    {
        let a = addr();
        let mut server = Proc::spawn("echo server", bin("echo"), &["server", "--bind", &a.to_string(), "--quiet"]);
        std::thread::sleep(Duration::from_millis(500));
        let mut r = Reactor::new().expect("reactor");
        let clients: Vec<Ping> = (0..4).map(|i| ping(&mut r, a, i, u64::MAX)).collect();
        pump(&mut [&mut r], LIMIT, "clients served", || clients.iter().all(|c| c.borrow().echoed >= 20));
        kill9(&mut server);
        pump(&mut [&mut r], LIMIT, "clients closed", || clients.iter().all(|c| c.borrow().closed.is_some()));
        for c in &clients {
            let c = c.borrow();
            assert!(
                matches!(c.closed, Some(CloseReason::Peer) | Some(CloseReason::WorkError(_))),
                "a client of the killed server: {c:?}"
            );
        }
        run_until_idle(&mut r, LIMIT);
    }
    assert_baseline();
}

/// Case 9: a client killed and replaced at once, ten times: every new one is served (the
/// server keeps no half-open state), and the server hears each killed one close.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn fast_reconnect_after_crash_is_served() {
    {
        let mut r = Reactor::new().expect("reactor");
        let s = listen(&mut r, 4);
        for round in 1..=10u64 {
            let mut victim = echo_client(s.addr, SIZE, 1_000_000, 0);
            let deadline = Instant::now() + LIMIT;
            while r.stats().established < 2 * round - 1 {
                assert!(Instant::now() < deadline, "round {round}: the victim never connected");
                r.run_once(Some(Duration::from_millis(5))).expect("run_once");
            }
            kill9(&mut victim);
            let mut next = echo_client(s.addr, SIZE, 5, 0);
            let mut status = None;
            pump(&mut [&mut r], LIMIT, "the next client finished", || {
                status = status.or_else(|| next.0.try_wait().expect("try_wait"));
                status.is_some()
            });
            assert!(status.is_some_and(|s| s.success()), "round {round}: the next client failed: {status:?}");
        }
        pump(&mut [&mut r], LIMIT, "every agent closed", || s.agents_closed.borrow().len() == 20);
        let closed = s.agents_closed.borrow();
        assert!(closed.iter().all(|c| matches!(c, CloseReason::Peer | CloseReason::WorkError(_))), "{closed:?}");
    }
    assert_baseline();
}

/// Case 4: the client process dies mid-handshake, after its CONNECT_REQUEST reached the
/// server and before the server accepted (the listener kills it from `on_connect_request`,
/// then accepts). The accepted agent fails to establish and closes once (rejected,
/// unreachable, a connect error or the accept deadline), nothing of it is retained, and the
/// listener keeps serving: a client after it is served.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn client_dying_mid_handshake_costs_nothing() {
    struct KillThenAccept {
        victim: Rc<RefCell<Option<Proc>>>,
        agents_closed: Rc<RefCell<Vec<CloseReason>>>,
        refused: Rc<RefCell<Vec<String>>>,
    }
    impl rdma_reactor::ListenerHandler for KillThenAccept {
        fn on_connect_request(
            &mut self,
            ctx: &mut Ctx<'_>,
            req: &rdma_reactor::ConnectRequest,
        ) -> rdma_reactor::Decision {
            if let Some(mut p) = self.victim.borrow_mut().take() {
                kill9(&mut p);
            }
            EchoListener { depth: 4, agents_closed: self.agents_closed.clone() }.on_connect_request(ctx, req)
        }
        fn on_refused(&mut self, _ctx: &mut Ctx<'_>, _peer: Option<SocketAddr>, reason: &rdma_reactor::RejectReason) {
            self.refused.borrow_mut().push(reason.to_string());
        }
    }
    {
        let cfg = Config {
            timeouts: rdma_reactor::Timeouts { accept: Duration::from_secs(5), ..Default::default() },
            ..Config::default()
        };
        let mut r = Reactor::with_config(cfg).expect("reactor");
        let a = addr();
        let agents_closed = Rc::new(RefCell::new(Vec::new()));
        let victim = Rc::new(RefCell::new(None));
        let refused = Rc::new(RefCell::new(Vec::new()));
        let l =
            KillThenAccept { victim: victim.clone(), agents_closed: agents_closed.clone(), refused: refused.clone() };
        r.listen(a, l).expect("listen");
        *victim.borrow_mut() = Some(echo_client(a, SIZE, 5, 0));
        // Either the accept already fails (the listener hears a refusal, the agent's handler
        // nothing), or the agent fails to establish and closes once.
        pump(&mut [&mut r], LIMIT, "the accepted agent of the dead client ended", || {
            !agents_closed.borrow().is_empty() || !refused.borrow().is_empty()
        });
        let closed = agents_closed.borrow().clone();
        println!("a client killed mid-handshake: agent closed {closed:?}, listener refused {:?}", refused.borrow());
        assert!(
            matches!(
                closed.as_slice(),
                [] | [CloseReason::Rejected { .. }
                    | CloseReason::Unreachable(_)
                    | CloseReason::ConnectError(_)
                    | CloseReason::Peer
                    | CloseReason::Setup(_)
                    | CloseReason::Timeout(rdma_reactor::Step::Accept)]
            ),
            "{closed:?}"
        );
        assert_eq!(closed.len() + refused.borrow().len(), 1, "exactly one outcome");
        let next = ping(&mut r, a, 2, 10);
        pump(&mut [&mut r], LIMIT, "the next client", || next.borrow().closed.is_some());
        let n = next.borrow();
        assert_eq!((n.echoed, n.error.as_deref(), n.closed.clone()), (10, None, Some(CloseReason::Local)), "{n:?}");
    }
    assert_baseline();
}

/// A connection handler that runs `before` (once) at the start of `on_ready`, then is `inner`.
/// On an accepted agent `on_ready` runs after the queue pair exists and before `rdma_accept`
/// (`reactor/conn/setup.rs`, `Core::accept`): the one point between the server's decision and its
/// REP.
struct BeforeAccept {
    before: Option<Box<dyn FnOnce()>>,
    inner: Box<dyn ConnectionHandler>,
}

impl ConnectionHandler for BeforeAccept {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        if let Some(f) = self.before.take() {
            f();
        }
        self.inner.on_ready(conn);
    }
    fn on_established(&mut self, conn: &mut Conn<'_>) {
        self.inner.on_established(conn);
    }
    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        self.inner.on_completion(conn, c);
    }
    fn on_timer(&mut self, conn: &mut Conn<'_>, user_data: u64) {
        self.inner.on_timer(conn, user_data);
    }
    fn on_closed(&mut self, ctx: &mut Ctx<'_>, token: Token, reason: CloseReason) {
        self.inner.on_closed(ctx, token, reason);
    }
}

/// Echoes like `EchoListener`; for the first connect request it runs `on_request` (in
/// `on_connect_request`) and gives its agent `before_accept` (run before `rdma_accept`).
/// Refusals are recorded.
struct Intercept {
    echo: EchoListener,
    on_request: Option<Box<dyn FnOnce()>>,
    before_accept: Option<Box<dyn FnOnce()>>,
    refused: Rc<RefCell<Vec<String>>>,
}

impl rdma_reactor::ListenerHandler for Intercept {
    fn on_connect_request(&mut self, ctx: &mut Ctx<'_>, req: &rdma_reactor::ConnectRequest) -> rdma_reactor::Decision {
        if let Some(f) = self.on_request.take() {
            f();
        }
        match self.echo.on_connect_request(ctx, req) {
            rdma_reactor::Decision::Accept(inner) => {
                let before = self.before_accept.take();
                rdma_reactor::Decision::Accept(Box::new(BeforeAccept { before, inner }))
            }
            reject => reject,
        }
    }
    fn on_refused(&mut self, _ctx: &mut Ctx<'_>, _peer: Option<SocketAddr>, reason: &rdma_reactor::RejectReason) {
        self.refused.borrow_mut().push(reason.to_string());
    }
}

/// After a fault on the server's first connection: the listener still serves (a verified
/// ping-pong from the same reactor), and the dead client's kernel objects are gone.
fn serves_after_and_the_dead_client_left_nothing(r: &mut Reactor, a: SocketAddr, dead: u32) {
    let next = ping(r, a, 2, 10);
    pump(&mut [r], LIMIT, "the next client", || next.borrow().closed.is_some());
    let n = next.borrow();
    assert_eq!(
        (n.echoed, n.verified_bytes, n.error.as_deref(), n.closed.clone()),
        (10, 10 * SIZE as u64, None, Some(CloseReason::Local)),
        "{n:?}"
    );
    let zero = ResCounts { qp: 0, cq: 0, mr: 0, pd: 0, cm_id: 0 };
    assert_eq!(res_counts(dead), zero, "the killed process's kernel objects (pid {dead})");
}

/// Case 4 (a): the server process is killed after its CONNECT_REQUEST reached it and before
/// it accepted. The server is an `echo server` with the test hook `--accept-delay-ms`: it
/// prints a line when the request arrives, then sleeps; it is killed once the line is there.
/// Its kernel destroys the new connection's id, which is still waiting for the accept (ib_cm
/// state REQ_RCVD), with a REJ "consumer defined" (ib_cm's `cm_destroy_id`); so our client
/// hears exactly `Rejected { status: 28 }`, with no reason of ours (the REJ carries none).
/// Nothing of it is retained, and a new server at the same address serves the same reactor.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn server_killed_before_accepting_rejects_its_client_with_28() {
    {
        let a = addr();
        let log = log_path("delayed-server");
        let args = ["server", "--bind", &a.to_string(), "--quiet", "--accept-delay-ms", "600000"];
        let mut server = Proc::spawn_logged("echo server (accept delayed)", bin("echo"), &args, &log);
        wait_listening(a, LIMIT);
        let mut r = Reactor::new().expect("reactor");
        let first = ping(&mut r, a, 1, 10);
        pump(&mut [&mut r], LIMIT, "the request reached the server", || {
            read_log(&log).contains("echo server: connect request from")
        });
        let pid = server.pid();
        kill9(&mut server);
        pump(&mut [&mut r], LIMIT, "the client closed", || first.borrow().closed.is_some());
        let f = first.borrow().closed.clone();
        println!("case 4 (a): the server killed before accepting: the client closed with {f:?}");
        // iWARP: the killed server's kernel resets the TCP connection, -ECONNRESET.
        let status = if transport() == "siw" { -104 } else { 28 };
        assert_eq!(f, Some(CloseReason::Rejected { status, reason: None }), "{:?}", first.borrow());
        assert_eq!(first.borrow().echoed, 0);
        let zero = ResCounts { qp: 0, cq: 0, mr: 0, pd: 0, cm_id: 0 };
        assert_eq!(res_counts(pid), zero, "the killed server's kernel objects");
        let _ = std::fs::remove_file(&log);
        // A new server at the same address serves the same reactor.
        let _server = Proc::spawn("echo server", bin("echo"), &["server", "--bind", &a.to_string(), "--quiet"]);
        wait_listening(a, LIMIT);
        let next = ping(&mut r, a, 2, 10);
        pump(&mut [&mut r], LIMIT, "the next client", || next.borrow().closed.is_some());
        let n = next.borrow();
        assert_eq!(
            (n.echoed, n.verified_bytes, n.error.as_deref(), n.closed.clone()),
            (10, 10 * SIZE as u64, None, Some(CloseReason::Local)),
            "{n:?}"
        );
        drop(n);
        run_until_idle(&mut r, LIMIT);
    }
    assert_baseline();
}

/// Case 4 (b): the client process is killed after its `rdma_connect`, while the server is
/// accepting: its agent's `on_ready` (queue pair created, `rdma_accept` not yet called) kills
/// it and waits until the dead client's REJ has reached the server (ib_cm's `cm_rx_msgs/rej`
/// count). The client's id was waiting for a REP (ib_cm state REQ_SENT), so its kernel sent
/// REJ "timeout" (4). What the agent sees depends only on whether the server's ib_cm had
/// handled that REJ (in its work queue) when `rdma_accept` ran: if it had, the new id is idle
/// and `rdma_accept` fails at once (the REJECTED event itself is dropped by the kernel, which
/// reports nothing for an id user space has not accepted yet), so the agent closes with
/// `Setup("rdma_accept: ...")`; if not, the REP goes out and the REJ then fails it:
/// `Rejected { status: 4 }`. Either way exactly once; the listener keeps serving and nothing
/// is left behind.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn client_killed_after_connect_fails_the_accept_once() {
    if not_on_iwarp("client_killed_after_connect_fails_the_accept_once", "drives InfiniBand CM message timing (REQ, REJ, RTU and ib_cm's cm_rx_msgs counters); iWARP connects over TCP with MPA, which has none of them") {
        return;
    }
    {
        let mut r = Reactor::new().expect("reactor");
        let a = addr();
        let agents_closed = Rc::new(RefCell::new(Vec::new()));
        let refused = Rc::new(RefCell::new(Vec::new()));
        let victim: Rc<RefCell<Option<Proc>>> = Rc::default();
        let v = victim.clone();
        let before_accept = move || {
            let mut p = v.borrow_mut().take().expect("the victim");
            let rej = cm_msgs("cm_rx_msgs", "rej");
            kill9(&mut p);
            let deadline = Instant::now() + LIMIT;
            while cm_msgs("cm_rx_msgs", "rej") == rej {
                assert!(Instant::now() < deadline, "the dead client's REJ never arrived");
                std::thread::sleep(Duration::from_millis(1));
            }
        };
        let l = Intercept {
            echo: EchoListener { depth: 4, agents_closed: agents_closed.clone() },
            on_request: None,
            before_accept: Some(Box::new(before_accept)),
            refused: refused.clone(),
        };
        r.listen(a, l).expect("listen");
        let p = echo_client(a, SIZE, 5, 0);
        let dead = p.pid();
        *victim.borrow_mut() = Some(p);
        pump(&mut [&mut r], LIMIT, "the agent of the killed client closed", || !agents_closed.borrow().is_empty());
        let closed = agents_closed.borrow().clone();
        println!(
            "case 4 (b): the client killed after rdma_connect: the agent closed with {closed:?}; refused {:?}",
            refused.borrow(),
        );
        assert!(
            matches!(
                closed.as_slice(),
                [CloseReason::Setup(s)] if s.starts_with("rdma_accept")
            ) || closed == [CloseReason::Rejected { status: 4, reason: None }],
            "{closed:?}"
        );
        assert!(refused.borrow().is_empty(), "{:?}", refused.borrow());
        serves_after_and_the_dead_client_left_nothing(&mut r, a, dead);
        pump(&mut [&mut r], LIMIT, "the next client's agent closed", || agents_closed.borrow().len() >= 2);
        assert_eq!(agents_closed.borrow()[1..], [CloseReason::Peer], "{:?}", agents_closed.borrow());
    }
    assert_baseline();
}

/// Case 4 (c): the client process is killed after the server accepted and before the
/// connection is established. The listener stops the client (SIGSTOP) when its request
/// arrives and accepts; once the REP has been handled by the client's kernel (its rdma_cm
/// channel has the CONNECT_RESPONSE event waiting, which the stopped process cannot read, so
/// it never sends the RTU) the client is killed. Its id was in ib_cm state REP_RCVD: its kernel
/// sends REJ "consumer defined", so the agent closes exactly once with `Rejected { status: 28 }`
/// and no reason. The listener keeps serving; nothing is left behind.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn client_killed_after_the_accept_rejects_its_agent_with_28() {
    if not_on_iwarp("client_killed_after_the_accept_rejects_its_agent_with_28", "drives InfiniBand CM message timing (REQ, REJ, RTU and ib_cm's cm_rx_msgs counters); iWARP connects over TCP with MPA, which has none of them") {
        return;
    }
    {
        let mut r = Reactor::new().expect("reactor");
        let a = addr();
        let agents_closed = Rc::new(RefCell::new(Vec::new()));
        let refused = Rc::new(RefCell::new(Vec::new()));
        let victim: Rc<RefCell<Option<Proc>>> = Rc::default();
        let v = victim.clone();
        let on_request = move || v.borrow_mut().as_mut().expect("the victim").stop();
        let l = Intercept {
            echo: EchoListener { depth: 4, agents_closed: agents_closed.clone() },
            on_request: Some(Box::new(on_request)),
            before_accept: None,
            refused: refused.clone(),
        };
        r.listen(a, l).expect("listen");
        let p = echo_client(a, SIZE, 5, 0);
        let dead = p.pid();
        *victim.borrow_mut() = Some(p);
        let deadline = Instant::now() + LIMIT;
        while r.stats().accepted == 0 {
            assert!(Instant::now() < deadline, "the server never accepted: {:?}", r.stats());
            r.run_once(Some(Duration::from_millis(5))).expect("run_once");
        }
        wait_cm_event_pending(dead, LIMIT, "the REP reached the stopped client");
        assert_eq!(r.stats().established, 0, "the stopped client cannot have sent its RTU");
        kill9(&mut victim.borrow_mut().take().expect("the victim"));
        pump(&mut [&mut r], LIMIT, "the agent of the killed client closed", || !agents_closed.borrow().is_empty());
        let closed = agents_closed.borrow().clone();
        println!("case 4 (c): the client killed after the accept: the agent closed with {closed:?}");
        assert_eq!(closed, vec![CloseReason::Rejected { status: 28, reason: None }]);
        assert!(refused.borrow().is_empty(), "{:?}", refused.borrow());
        serves_after_and_the_dead_client_left_nothing(&mut r, a, dead);
        pump(&mut [&mut r], LIMIT, "the next client's agent closed", || agents_closed.borrow().len() >= 2);
        assert_eq!(agents_closed.borrow()[1..], [CloseReason::Peer], "{:?}", agents_closed.borrow());
    }
    assert_baseline();
}
