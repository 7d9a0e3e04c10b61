//! Paths and peers: an address without RDMA, unfinishable resolution, keepalive, a stopped peer.

use super::*;

/// An address with no RDMA device behind it: a client connecting through a netdev that has no
/// RDMA device (a dummy `d2` without rxe) hears `AddrError` whose text says so; nothing is
/// left behind.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn connect_through_a_netdev_without_rdma_says_so() {
    let run = |args: &[&str]| std::process::Command::new("ip").args(args).status().is_ok_and(|s| s.success());
    assert!(run(&["link", "add", "d2", "type", "dummy"]), "ip link add d2");
    struct Del;
    impl Drop for Del {
        fn drop(&mut self) {
            let _ = std::process::Command::new("ip").args(["link", "delete", "d2"]).status();
        }
    }
    let _del = Del;
    assert!(run(&["addr", "add", "198.18.2.1/24", "dev", "d2"]) && run(&["link", "set", "d2", "up"]));
    {
        let mut r = Reactor::new().expect("reactor");
        let p = ping(&mut r, "198.18.2.2:7000".parse().unwrap(), 1, 1);
        pump(&mut [&mut r], LIMIT, || closed(&p));
        let reason = p.borrow().closed.clone().expect("closed");
        println!("connect via a netdev without RDMA: {reason}");
        assert_eq!(reason, CloseReason::AddrError(-19), "connect via a netdev without RDMA");
        assert!(reason.to_string().contains("no RDMA device behind that address"), "{reason}");
    }
    assert_baseline();
}

/// Keepalive and ACK timeout (dead-peer detection, `Config::keepalive`,
/// `Config::ack_timeout`): an idle connection with a 50 ms keepalive posts a probe every
/// interval, each acknowledged by the peer's device without the peer's application seeing
/// anything; the connection stays up and closes cleanly. (A peer that vanished is the
/// two-VM case 13.)
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn keepalive_probes_an_idle_connection_without_disturbing_it() {
    {
        let cfg = Config {
            keepalive: Some(Duration::from_millis(50)),
            ack_timeout: Some(Duration::from_millis(20)),
            retry_count: 3,
            ..Config::default()
        };
        let (mut srv, a, heard) = server(Config::default());
        let mut cli = Reactor::with_config(cfg).expect("client reactor");
        // An idle client: one receive posted, nothing sent.
        struct Idle(Rc<RefCell<Option<CloseReason>>>);
        impl rdma_reactor::ConnectionHandler for Idle {
            fn on_ready(&mut self, conn: &mut rdma_reactor::Conn<'_>) {
                let buf = conn.alloc(SIZE).expect("buffer");
                conn.submit(rdma_reactor::Op::recv(buf)).expect("receive");
            }
            fn on_completion(&mut self, _conn: &mut rdma_reactor::Conn<'_>, _c: rdma_reactor::Completion) {}
            fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _t: rdma_reactor::Token, reason: CloseReason) {
                *self.0.borrow_mut() = Some(reason);
            }
        }
        let closed = Rc::new(RefCell::new(None));
        let opts = ConnectOptions { msg_size: SIZE as u32, ..ConnectOptions::default() };
        let t = cli.connect(a, opts, Idle(closed.clone())).expect("connect");
        let deadline = Instant::now() + LIMIT;
        while cli.stats().established == 0 {
            assert!(Instant::now() < deadline, "not established: {cli:?}");
            srv.run_once(Some(Duration::from_millis(1))).expect("run_once");
            cli.run_once(Some(Duration::from_millis(1))).expect("run_once");
        }
        let before = cli.stats();
        let until = Instant::now() + Duration::from_secs(1);
        pump(&mut [&mut srv, &mut cli], LIMIT, || Instant::now() >= until);
        let after = cli.stats();
        let probes = after.keepalives - before.keepalives;
        println!("keepalive: {probes} probes in 1 s at 50 ms, {} completions", after.completions - before.completions);
        assert!(probes >= 5, "{probes} probes in 1 s at a 50 ms interval");
        assert!(after.completions > before.completions, "the probes completed (signaled)");
        assert_eq!(*closed.borrow(), None, "the idle connection stays up");
        assert!(heard.borrow().agents_closed.borrow().is_empty(), "the server saw nothing but a connection");
        cli.ctx().close(t);
        pump(&mut [&mut srv, &mut cli], LIMIT, || closed.borrow().is_some());
        assert_eq!(*closed.borrow(), Some(CloseReason::Local));
        srv.shutdown(Duration::from_secs(1));
    }
    assert_baseline();
}

/// Catalogue case 14: a peer process stopped (SIGSTOP) under load. Its kernel keeps
/// acknowledging, so neither RC retries nor keepalive probes notice; under flow control the
/// sends stop at the peer's credits, and `Config::credit_timeout` bounds the wait. Resumed
/// within the bound, the connection recovers and every message is echoed and verified;
/// stopped past it, the connection closes with `Stalled`, every submitted send completes
/// exactly once before `on_closed`, and a connection to another server keeps working.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_stopped_peer_recovers_within_the_credit_timeout_and_is_closed_past_it() {
    const BOUND: Duration = Duration::from_secs(3);
    const N: u64 = 32;
    {
        let a = addr();
        let s = a.to_string();
        let peer = Proc::spawn("echo server", bin("echo"), &["server", "--bind", &s, "--depth", "8", "--quiet"]);
        wait_listening(a, LIMIT);
        let signal = |sig: nix::sys::signal::Signal| {
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(peer.pid() as i32), sig).expect("signal the peer")
        };
        let (mut other, other_addr, _) = server(Config::default());
        let mut cli =
            Reactor::with_config(Config { credit_timeout: Some(BOUND), ..Config::default() }).expect("client");
        let seen = Rc::new(RefCell::new(BurstSeen::default()));
        let opts = ConnectOptions { msg_size: SIZE as u32, ..ConnectOptions::default() };
        let t = cli.connect(a, opts, Burst(seen.clone())).expect("connect");
        pump(&mut [&mut cli], LIMIT, || seen.borrow().established || seen.borrow().closed.is_some());
        assert_eq!(seen.borrow().closed, None, "connected to the echo server");

        // Stopped for a third of the bound: the sends stop at the peer's 8 credits, then all go.
        signal(nix::sys::signal::Signal::SIGSTOP);
        burst(&mut cli, t, 0, N);
        let until = Instant::now() + BOUND / 3;
        pump(&mut [&mut cli], LIMIT, || Instant::now() >= until);
        assert_eq!(seen.borrow().echoed, 0, "a stopped peer echoes nothing");
        assert!(seen.borrow().sends_ok < 8, "at most the peer's credits went out: {}", seen.borrow().sends_ok);
        signal(nix::sys::signal::Signal::SIGCONT);
        pump(&mut [&mut cli], LIMIT, || seen.borrow().echoed == N || seen.borrow().closed.is_some());
        assert_eq!(seen.borrow().closed, None, "resumed within the bound, the connection recovers");
        assert_eq!((seen.borrow().echoed, seen.borrow().sends_ok), (N, N), "every message echoed");
        assert_eq!(cli.stats().credit_stalls, 0);

        // Stopped past the bound: closed with the reason, every send accounted for.
        signal(nix::sys::signal::Signal::SIGSTOP);
        let stopped = Instant::now();
        burst(&mut cli, t, N, 2 * N);
        pump(&mut [&mut cli], LIMIT, || seen.borrow().closed.is_some());
        let waited = stopped.elapsed();
        {
            let s = seen.borrow();
            assert_eq!(s.closed, Some(CloseReason::Stalled(BOUND)), "closed because the credits stopped");
            assert!(waited >= BOUND, "not before the bound: closed after {waited:?}");
            assert_eq!(s.sends_ok + s.sends_failed, 2 * N, "every send completed exactly once before on_closed");
            assert_eq!(s.echoed, N, "nothing more was echoed");
            assert_eq!(s.error, None);
            println!(
                "case 14: closed {waited:?} after the stop (the bound, then the disconnect waits for the DREP a \
                 stopped peer never sends); {} of the second burst sent, {} failed: {}",
                s.sends_ok - N,
                s.sends_failed,
                s.closed.as_ref().expect("closed")
            );
        }
        assert_eq!(cli.stats().credit_stalls, 1);
        if transport() == "rxe" {
            // The stopped peer's kernel took our DREQ but answers it only once its process
            // disconnects: our disconnect waited `Timeouts::disconnect` out, counted.
            assert_eq!(cli.stats().disconnects_unanswered, 1, "the unanswered disconnect counted");
        }

        // Another connection of the same reactor is unaffected.
        let p = ping(&mut cli, other_addr, 15, 20);
        pump(&mut [&mut other, &mut cli], LIMIT, || closed(&p));
        assert_served(&p, 20);
        signal(nix::sys::signal::Signal::SIGCONT);
        drop(peer);
        drop(cli);
        other.shutdown(Duration::from_secs(1));
    }
    assert_baseline();
}

/// Catalogue case 2, the rest: resolution that cannot finish. An unused address in the rxe
/// netdev's subnet, and an address deleted (`ip addr del`) after the client's address
/// resolution started and before its route resolution. Each ends in a typed close reason
/// within the deadlines, the id is destroyed, and the reactor keeps serving (a ping to a live
/// server afterwards).
///
/// The VM's rxe0 sits on a dummy netdev, which is NOARP: the kernel resolves any neighbour on
/// it at once, so an unused address resolves, its route too, and the connect request goes
/// nowhere; the connect deadline ends it (`Timeout(Connect)`, before the CM's own retries
/// give up). On a netdev with ARP the same connect ends at address resolution.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn resolution_that_cannot_finish_is_a_typed_close() {
    let netdev = std::env::var("RDMA_NETDEV").expect("RDMA_NETDEV is set by cargo xtask");
    let ip = |args: &[&str]| {
        let ok = std::process::Command::new("ip").args(args).status().is_ok_and(|s| s.success());
        assert!(ok, "ip {args:?}");
    };
    {
        let timeouts = rdma_reactor::Timeouts {
            resolve_addr: Duration::from_secs(2),
            connect: Duration::from_secs(3),
            ..rdma_reactor::Timeouts::default()
        };
        let mut r = Reactor::with_config(Config { timeouts, ..Config::default() }).expect("reactor");

        // An unused address: nothing answers.
        let started = Instant::now();
        let p = ping(&mut r, "198.18.0.77:7000".parse().unwrap(), 1, 1);
        pump(&mut [&mut r], LIMIT, || closed(&p));
        let reason = p.borrow().closed.clone().expect("closed");
        println!("case 2, an unused address: {reason} after {:?}", started.elapsed());
        assert_eq!(reason, CloseReason::Timeout(rdma_reactor::Step::Connect), "an unused address on a NOARP netdev");

        // The destination's address deleted between the two resolution steps: address
        // resolution has started (`connect` called rdma_resolve_addr), route resolution runs
        // only when the reactor next ticks, after the delete.
        ip(&["addr", "add", "198.18.0.50/24", "dev", &netdev]);
        // The control: with the address in place, nothing listens there, and the request is
        // rejected at once.
        let p = ping(&mut r, "198.18.0.50:7000".parse().unwrap(), 4, 1);
        pump(&mut [&mut r], LIMIT, || closed(&p));
        let control = p.borrow().closed.clone().expect("closed");
        // iWARP: TCP refuses the connection at `rdma_connect` (-111), where IB's CM says 8.
        assert!(
            matches!(control, CloseReason::Rejected { status: 8 | -111, reason: None }),
            "with the address: {control:?}"
        );
        let started = Instant::now();
        let p = ping(&mut r, "198.18.0.50:7000".parse().unwrap(), 2, 1);
        ip(&["addr", "del", "198.18.0.50/24", "dev", &netdev]);
        pump(&mut [&mut r], LIMIT, || closed(&p));
        let reason = p.borrow().closed.clone().expect("closed");
        println!("case 2, address deleted between the steps: {reason} after {:?}", started.elapsed());
        // Its GID left rxe0's table with the address: the request goes nowhere. On iWARP the
        // TCP connect in `rdma_connect` cannot bind the deleted address: it fails at once.
        let iwarp_at_once = transport() == "siw"
            && matches!(&reason, CloseReason::Setup(s) if s.contains("Cannot assign requested address"));
        assert!(
            reason == CloseReason::Timeout(rdma_reactor::Step::Connect) || iwarp_at_once,
            "address deleted between the steps: {reason:?}"
        );

        // The reactor still serves.
        let (mut srv, a, _) = server(Config::default());
        let p = ping(&mut r, a, 3, 5);
        pump(&mut [&mut srv, &mut r], LIMIT, || closed(&p));
        assert_served(&p, 5);
        srv.shutdown(Duration::from_secs(1));
    }
    assert_baseline();
}
