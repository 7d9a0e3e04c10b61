//! Many reactors, one per thread (`--threads N`, `Reactor::listen_spread`): connections spread
//! over both reactors of a server process, every byte verified, the per-reactor counts, the
//! threads, and the kernel resource counts back to their baseline; and asynchronous device
//! events shared between the reactors of a process.

mod util;

use std::cell::RefCell;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdma_reactor::{
    Balance, CloseReason, Config, ConnectOptions, ConnectRequest, Ctx, Decision, ListenerHandler, Reactor, RejectCode,
    RejectReason,
};
use util::*;

/// A server process whose stdout is kept (and echoed to the test's output); killed if the test
/// fails first.
struct Server {
    child: Child,
    out: Arc<Mutex<String>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    fn spawn(program: &str, args: &[&str]) -> Server {
        let mut child = Command::new(bin(program))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {program}: {e}"));
        let stdout = child.stdout.take().expect("piped");
        let out = Arc::new(Mutex::new(String::new()));
        let o = out.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                println!("{line}");
                let mut o = o.lock().expect("output");
                o.push_str(&line);
                o.push('\n');
            }
        });
        Server { child, out, reader: Some(reader) }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the exit (at most `limit`); returns whether it succeeded and its output.
    fn wait(mut self, limit: Duration) -> (bool, String) {
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(st) = self.child.try_wait().expect("try_wait") {
                break st;
            }
            assert!(Instant::now() < deadline, "the server did not exit within {limit:?}");
            std::thread::sleep(Duration::from_millis(20));
        };
        self.reader.take().expect("reader").join().expect("reader thread");
        let out = self.out.lock().expect("output").clone();
        (status.success(), out)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The kernel resource counts of every thread of `pid` (`rdma res show` names the creating
/// thread), summed.
fn process_res_counts(pid: u32) -> ResCounts {
    let mut sum = ResCounts { qp: 0, cq: 0, mr: 0, pd: 0, cm_id: 0 };
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("read /proc/PID/task");
    for tid in tasks.map(|e| e.expect("task").file_name().to_string_lossy().parse::<u32>().expect("a tid")) {
        let c = res_counts(tid);
        sum = ResCounts {
            qp: sum.qp + c.qp,
            cq: sum.cq + c.cq,
            mr: sum.mr + c.mr,
            pd: sum.pd + c.pd,
            cm_id: sum.cm_id + c.cm_id,
        };
    }
    sum
}

/// Polls until the server's resource counts equal `baseline` (it destroys each connection
/// when its DISCONNECTED arrives); returns the last counts.
fn settle(pid: u32, baseline: ResCounts) -> ResCounts {
    let mut now = process_res_counts(pid);
    for _ in 0..150 {
        if now == baseline {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
        now = process_res_counts(pid);
    }
    now
}

/// `K connections, M messages, B bytes` of each `PROGRAM server: reactor I:` line.
fn per_reactor(out: &str, program: &str) -> Vec<(u64, u64, u64)> {
    let prefix = format!("{program} server: reactor ");
    out.lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .map(|rest| {
            let nums: Vec<u64> = rest
                .split(|c: char| !c.is_ascii_digit())
                .filter(|w| !w.is_empty())
                .map(|w| w.parse().expect("a number"))
                .collect();
            assert_eq!(nums.len(), 4, "reactor line: {rest}");
            (nums[1], nums[2], nums[3])
        })
        .collect()
}

/// `count` echo clients of `size` bytes from one reactor in this process, every byte verified.
fn echo_clients(server: SocketAddr, first: u64, n: u64, size: usize, count: u64) {
    let mut reactor =
        Reactor::with_config(Config { send_depth: 4, recv_depth: 4, ..Config::default() }).expect("reactor");
    let mut results = Vec::new();
    for i in first..first + n {
        let (client, result) = PingClient::new(i, size, count);
        let opts = ConnectOptions { msg_size: size as u32, ..Default::default() };
        reactor.connect(server, opts, client).expect("connect");
        results.push(result);
    }
    run_until(&mut reactor, Duration::from_secs(600), || results.iter().all(|r| r.borrow().closed.is_some()));
    for (i, r) in results.iter().enumerate() {
        let r = r.borrow();
        assert_eq!(r.error, None, "client {i}");
        assert_eq!(r.echoed, count, "client {i}");
        assert_eq!(r.verified_bytes, count * size as u64, "client {i}: every byte verified");
    }
}

/// `echo server --threads 2` serves 64 verified clients spread over both reactors (round
/// robin), runs two reactor threads, and returns to its resource baseline.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn echo_server_spreads_64_clients_over_two_reactors() {
    let server = addr();
    let s = server.to_string();
    // 2 warm-up clients (one per reactor: each creates its device resources, kept for the
    // next), then 64, then one to end it.
    let srv = Server::spawn("echo", &["server", "--bind", &s, "--quiet", "--threads", "2", "--exit-after", "67"]);
    wait_listening(server, Duration::from_secs(30));
    assert_eq!(threads(srv.pid()), 2, "two reactor threads (the main thread runs the first)");
    echo_clients(server, 0, 2, 256, 10);
    let baseline = settle(srv.pid(), process_res_counts(srv.pid()));
    assert_eq!(baseline.qp, 0, "{baseline:?}");
    assert!(baseline.pd >= 2, "each reactor has its own PD: {baseline:?}");
    echo_clients(server, 2, 64, 256, 50);
    let now = settle(srv.pid(), baseline);
    assert_eq!(now, baseline, "resources of the server after all clients left");
    echo_clients(server, 66, 1, 256, 10);
    let (ok, out) = srv.wait(Duration::from_secs(60));
    assert!(ok, "echo server failed:\n{out}");
    let reactors = per_reactor(&out, "echo");
    assert_eq!(reactors.len(), 2, "one line per reactor:\n{out}");
    assert!(reactors.iter().all(|r| r.0 > 0 && r.1 > 0), "both reactors served: {reactors:?}");
    assert_eq!(reactors.iter().map(|r| r.0).sum::<u64>(), 67, "{reactors:?}");
    assert_eq!(reactors.iter().map(|r| r.1).sum::<u64>(), 3 * 10 + 64 * 50, "{reactors:?}");
    // Round robin: an even split (the 67th connection makes one more on the first).
    assert_eq!((reactors[0].0, reactors[1].0), (34, 33), "{reactors:?}");
}

/// `blast server --threads 2 --verify` takes 8 clients over both reactors: every byte of every
/// message verified by the server (its exit status), both reactors served, resources back to
/// baseline; also with `--balance fewest`.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn blast_server_spreads_8_clients_over_two_reactors() {
    for balance in ["round-robin", "fewest"] {
        let server = addr();
        let s = server.to_string();
        let srv = Server::spawn(
            "blast",
            &[
                "server",
                "--bind",
                &s,
                "--verify",
                "--quiet",
                "--threads",
                "2",
                "--exit-after",
                "11",
                "--balance",
                balance,
            ],
        );
        wait_listening(server, Duration::from_secs(30));
        assert_eq!(threads(srv.pid()), 2);
        let blast = |clients: &str, count: &str| {
            let args =
                ["client", "--connect", &s, "--clients", clients, "--size", "4096", "--count", count, "--verify"];
            let (ok, out) = run_output(bin("blast"), &args, Duration::from_secs(300));
            println!("{out}");
            assert!(ok, "blast client failed:\n{out}");
            out
        };
        blast("2", "10");
        let baseline = settle(srv.pid(), process_res_counts(srv.pid()));
        assert_eq!(baseline.qp, 0, "{baseline:?}");
        let out = blast("8", "500");
        assert!(out.contains("4000 messages of 4096 bytes (16384000 bytes)"), "{out}");
        let now = settle(srv.pid(), baseline);
        assert_eq!(now, baseline, "{balance}: resources of the server after all clients left");
        blast("1", "10");
        let (ok, out) = srv.wait(Duration::from_secs(60));
        assert!(ok, "{balance}: the server verified every byte of all 11 connections:\n{out}");
        let reactors = per_reactor(&out, "blast");
        assert_eq!(reactors.len(), 2, "one line per reactor:\n{out}");
        assert!(reactors.iter().all(|r| r.0 > 0 && r.2 > 0), "{balance}: both reactors served: {reactors:?}");
        assert_eq!(reactors.iter().map(|r| r.0).sum::<u64>(), 11, "{reactors:?}");
        assert_eq!(reactors.iter().map(|r| r.1).sum::<u64>(), 3 * 10 + 8 * 500, "{reactors:?}");
        assert_eq!(reactors.iter().map(|r| r.2).sum::<u64>(), (3 * 10 + 8 * 500) * 4096, "{reactors:?}");
    }
}

/// A listener that records what it is told of the device.
struct PortWatch(Rc<RefCell<Vec<String>>>);

impl ListenerHandler for PortWatch {
    fn on_connect_request(&mut self, _ctx: &mut Ctx<'_>, _req: &ConnectRequest) -> Decision {
        Decision::Reject(RejectReason::new(RejectCode::Refused, "this test serves nobody"))
    }

    fn on_error(&mut self, _ctx: &mut Ctx<'_>, what: &str) {
        self.0.borrow_mut().push(what.to_string());
    }
}

/// The device's asynchronous-event fd is the process's: every reactor on the device has it in
/// its epoll set, one of them reads each event, and passes a copy to the others. A port going
/// down and up (`ip link set d0 down/up`) reaches the listeners of both reactors.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn port_events_reach_the_listeners_of_every_reactor() {
    struct Up;
    impl Drop for Up {
        fn drop(&mut self) {
            let _ = Command::new("ip").args(["link", "set", &netdev(), "up"]).status();
        }
    }
    let limit = Duration::from_secs(60);
    let (mut a, mut b) = (Reactor::new().expect("reactor"), Reactor::new().expect("reactor"));
    let (ea, eb) = (Rc::new(RefCell::new(Vec::new())), Rc::new(RefCell::new(Vec::new())));
    a.listen(addr(), PortWatch(ea.clone())).expect("listen a");
    b.listen(addr(), PortWatch(eb.clone())).expect("listen b");
    let up = Up;
    assert!(Command::new("ip").args(["link", "set", &netdev(), "down"]).status().is_ok_and(|s| s.success()));
    let heard = |e: &Rc<RefCell<Vec<String>>>, what: &str| e.borrow().iter().any(|x| x.contains(what));
    pump(&mut [&mut a, &mut b], limit, "PORT_ERR at both", || heard(&ea, "PORT_ERR") && heard(&eb, "PORT_ERR"));
    drop(up);
    pump(&mut [&mut a, &mut b], limit, "PORT_ACTIVE at both", || {
        heard(&ea, "PORT_ACTIVE") && heard(&eb, "PORT_ACTIVE")
    });
    let (sa, sb) = (a.stats(), b.stats());
    println!("reactor a heard {:?} ({sa:?})\nreactor b heard {:?} ({sb:?})", ea.borrow(), eb.borrow());
    // Each port event was read once, by one of them, and passed to the other (both heard
    // both, above). A link going down and up raises other kinds too, which no one acts on and
    // the reader keeps to itself (GID changes of the netdev's addresses, IPv6 ones included):
    // read, not passed.
    let (read, passed) = (sa.async_events + sb.async_events, sa.shared_async_events + sb.shared_async_events);
    assert!(passed >= 2 && passed <= read, "read {read}, passed on {passed}");
    assert!(sa.async_events + sb.async_events >= 2, "PORT_ERR and PORT_ACTIVE were read");
    // Wait until the port is active again, for the tests after this one.
    let deadline = Instant::now() + limit;
    loop {
        let dev = std::env::var("RDMA_DEV").unwrap_or_else(|_| "rxe0".into());
        let out = Command::new("rdma").args(["link", "show", &format!("{dev}/1")]).output().expect("rdma link show");
        if String::from_utf8_lossy(&out.stdout).contains("state ACTIVE") {
            break;
        }
        assert!(Instant::now() < deadline, "rxe0 not ACTIVE after {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A listener that records what the reactor refused on its own.
struct Refusals(Rc<RefCell<Vec<String>>>);

impl ListenerHandler for Refusals {
    fn on_connect_request(&mut self, _ctx: &mut Ctx<'_>, _req: &ConnectRequest) -> Decision {
        Decision::Reject(RejectReason::new(RejectCode::Refused, "kept here: not expected"))
    }

    fn on_refused(&mut self, _ctx: &mut Ctx<'_>, _peer: Option<SocketAddr>, reason: &RejectReason) {
        self.0.borrow_mut().push(reason.to_string());
    }
}

/// The hand-off in one process, every reactor ticked by this thread: requests spread over a
/// reactor that serves them (every byte verified, counted on both sides); a reactor without a
/// hand-off handler rejects what it is handed; once the chosen reactor is dropped, the
/// listening one rejects and tells its listener. Every kernel object is destroyed at the end.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn handoffs_are_served_or_rejected_and_counted() {
    let limit = Duration::from_secs(120);
    let mut source = Reactor::new().expect("source");
    let mut target = Reactor::new().expect("target");
    let mut client =
        Reactor::with_config(Config { send_depth: 4, recv_depth: 4, ..Config::default() }).expect("client");
    let agents_closed = Rc::new(RefCell::new(Vec::new()));
    target.accept_handoffs(EchoListener { depth: 8, agents_closed: agents_closed.clone() }).expect("hand-offs");
    let refused = Rc::new(RefCell::new(Vec::new()));
    let server = addr();
    let peers = vec![target.remote()];
    source.listen_spread(server, Refusals(refused.clone()), peers, Balance::Fewest).expect("listen_spread");

    // Served by the target.
    let results: Vec<_> = (0..4)
        .map(|i| {
            let (c, r) = PingClient::new(i, 512, 20);
            client.connect(server, ConnectOptions { msg_size: 512, ..Default::default() }, c).expect("connect");
            r
        })
        .collect();
    pump(&mut [&mut client, &mut source, &mut target], limit, "4 clients served by the target", || {
        results.iter().all(|r| r.borrow().closed.is_some()) && agents_closed.borrow().len() == 4
    });
    for r in &results {
        let r = r.borrow();
        assert_eq!((r.echoed, r.verified_bytes, r.error.as_deref()), (20, 20 * 512, None), "{r:?}");
    }
    assert_eq!((source.stats().handed_off, source.stats().accepted), (4, 0), "{:?}", source.stats());
    assert_eq!((target.stats().handoffs_received, target.stats().accepted), (4, 4), "{:?}", target.stats());

    // A target that takes no hand-offs rejects them.
    let mut bare = Reactor::new().expect("bare");
    let server2 = addr();
    let refused2 = Rc::new(RefCell::new(Vec::new()));
    source
        .listen_spread(server2, Refusals(refused2.clone()), vec![bare.remote()], Balance::RoundRobin)
        .expect("listen");
    let (c, r) = PingClient::new(10, 64, 1);
    client.connect(server2, ConnectOptions::default(), c).expect("connect");
    pump(&mut [&mut client, &mut source, &mut bare], limit, "rejected by the bare reactor", || {
        r.borrow().closed.is_some()
    });
    let closed = r.borrow().closed.clone();
    assert!(
        matches!(&closed, Some(CloseReason::Rejected { reason: Some(x), .. }) if x.code == RejectCode::Refused),
        "{closed:?}"
    );
    assert_eq!((bare.stats().handoffs_received, bare.stats().handoffs_failed), (1, 1), "{:?}", bare.stats());

    // The chosen reactor is gone: the source rejects, and its listener hears why.
    drop(bare);
    let (c, r) = PingClient::new(11, 64, 1);
    client.connect(server2, ConnectOptions::default(), c).expect("connect");
    pump(&mut [&mut client, &mut source], limit, "rejected by the source", || r.borrow().closed.is_some());
    let closed = r.borrow().closed.clone();
    assert!(
        matches!(&closed, Some(CloseReason::Rejected { reason: Some(x), .. }) if x.code == RejectCode::NoResources),
        "{closed:?}"
    );
    assert_eq!(source.stats().handoffs_failed, 1, "{:?}", source.stats());
    assert!(refused.borrow().is_empty(), "{:?}", refused.borrow());
    let told = refused2.borrow();
    assert!(told.len() == 1 && told[0].contains("the chosen reactor is gone"), "{told:?}");
    drop(told);
    drop((source, target, client));
    let zero = ResCounts { qp: 0, cq: 0, mr: 0, pd: 0, cm_id: 0 };
    assert_eq!(res_counts(owner_id()), zero, "every kernel object of this test destroyed");
}

/// Hostile review (issue 22), finding 3: a reactor that is gone kept being chosen by the
/// hand-off. Its inbox is closed, but its published load stays frozen: under `Fewest` an idle
/// reactor that exited (load 0) won every choice and every request was rejected; under round
/// robin one in three. Here a listener spreads over itself and two reactors, one of which is
/// dropped: 10 clients under `Fewest`, then 10 under round robin, are all served, none refused.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_reactor_that_is_gone_is_never_chosen() {
    let limit = Duration::from_secs(120);
    for balance in [Balance::Fewest, Balance::RoundRobin] {
        let mut source = Reactor::new().expect("source");
        let mut live = Reactor::new().expect("live target");
        let mut gone = Reactor::new().expect("target to drop");
        let mut client = Reactor::new().expect("client");
        let closed = Rc::new(RefCell::new(Vec::new()));
        for r in [&mut live, &mut gone] {
            r.accept_handoffs(EchoListener { depth: 8, agents_closed: closed.clone() }).expect("hand-offs");
        }
        let server = addr();
        let peers = vec![source.remote(), live.remote(), gone.remote()];
        source
            .listen_spread(server, EchoListener { depth: 8, agents_closed: closed.clone() }, peers, balance)
            .expect("listen_spread");
        drop(gone);
        let results: Vec<_> = (0..10)
            .map(|i| {
                let (c, r) = PingClient::new(i, 256, 5);
                client.connect(server, ConnectOptions { msg_size: 256, ..Default::default() }, c).expect("connect");
                r
            })
            .collect();
        pump(&mut [&mut client, &mut source, &mut live], limit, "10 clients", || {
            results.iter().all(|r| r.borrow().closed.is_some())
        });
        let outcomes: Vec<_> = results.iter().map(|r| (r.borrow().echoed, r.borrow().closed.clone())).collect();
        println!(
            "finding 3 ({balance:?}): source accepted {}, handed off {}, failed {}; live target received {}; clients {outcomes:?}",
            source.stats().accepted,
            source.stats().handed_off,
            source.stats().handoffs_failed,
            live.stats().handoffs_received
        );
        for (i, r) in results.iter().enumerate() {
            let r = r.borrow();
            assert_eq!((r.echoed, r.error.as_deref(), &r.closed), (5, None, &Some(CloseReason::Local)), "client {i}");
        }
        assert_eq!(source.stats().handoffs_failed, 0, "{balance:?}: nothing was handed to the reactor that is gone");
        assert_eq!(source.stats().accepted + live.stats().handoffs_received, 10);
        drop((source, live, client));
    }
    let zero = ResCounts { qp: 0, cq: 0, mr: 0, pd: 0, cm_id: 0 };
    assert_eq!(res_counts(owner_id()), zero, "every kernel object of this test destroyed");
}
