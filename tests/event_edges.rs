//! The event edges of the loop on a real RDMA device (`../FAULTS.md` cases 25 and 35):
//!
//! - **The arm/poll race** (case 25): a long one-byte ping-pong under a per-message hang
//!   detector; the poll right after `ibv_req_notify_cq` is seen catching completions
//!   (`Stats::cq_rearm_catches`), and events that find their CQ already emptied are harmless
//!   (`Stats::spurious_cq_events`).
//! - **Signals and spurious readiness** (case 35): echo traffic while another thread
//!   bombards the reactor's thread with a signal whose handler is installed without
//!   `SA_RESTART`, and a third sends it `Remote` messages: every `epoll_wait` the signal
//!   interrupts (`Stats::interrupted_waits`), every wakeup with nothing to do
//!   (`Stats::spurious_wakeups`) and every read that found `EAGAIN` is "no event", never an
//!   error.
//!
//! Both end with every completion event acked exactly once (`cq_events_acked == cq_events`) and
//! the kernel objects back to the baseline.

mod util;

use std::cell::{Cell, RefCell};
use std::net::SocketAddr;
use std::process::Command;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_reactor::{
    Buf, CloseReason, Completion, Config, Conn, ConnectOptions, ConnectRequest, ConnectionHandler, Ctx, Decision,
    ListenerHandler, Op, OpCode, Reactor, RejectReason, Stats, Token,
};
use util::*;

/// The hang detector of case 25: a round trip still unanswered this long after its send, while
/// the test thread kept ticking the reactor, is a stall. Not a performance threshold: a round
/// trip takes well under a millisecond in the VM.
const WATCHDOG: Duration = Duration::from_secs(1);
/// Ticks the reactor must have run since the send before the watchdog may fire, so a test
/// process that was merely descheduled (a busy host) is not taken for a stall.
const WATCHDOG_TICKS: u64 = 5;

/// The byte of message `seq` of client `id`.
fn byte(id: u64, seq: u64) -> u8 {
    (seq.wrapping_mul(131) ^ id.wrapping_mul(29) ^ 0x5a) as u8
}

/// What one racing client saw.
#[derive(Debug, Default)]
struct RaceResult {
    echoed: u64,
    verified_bytes: u64,
    /// The message awaiting its echo, when it was sent, and the test's tick count then.
    outstanding: Option<(u64, Instant, u64)>,
    error: Option<String>,
    closed: Option<CloseReason>,
    /// The connection's token, once ready.
    token: Option<Token>,
    /// The connection's local address, once established.
    local: Option<SocketAddr>,
    /// Sends completed.
    sends_completed: u64,
}

/// Ping-pongs `count` one-byte messages, each verified, then closes.
struct RacePing {
    id: u64,
    count: u64,
    seq: u64,
    send_buf: Option<Buf>,
    /// The test loop's tick count.
    ticks: Rc<Cell<u64>>,
    result: Rc<RefCell<RaceResult>>,
}

impl RacePing {
    fn fail(&mut self, conn: &mut Conn<'_>, what: String) {
        self.result.borrow_mut().error.get_or_insert(what);
        conn.close();
    }

    fn send_next(&mut self, conn: &mut Conn<'_>) {
        let Some(mut buf) = self.send_buf.take() else {
            return self.fail(conn, format!("message {}: no send buffer", self.seq));
        };
        buf.fill_from(&[byte(self.id, self.seq)]).expect("fill");
        self.result.borrow_mut().outstanding = Some((self.seq, Instant::now(), self.ticks.get()));
        if let Err(e) = conn.submit(Op::send(buf).user_data(self.seq)) {
            self.fail(conn, format!("message {}: send: {}", self.seq, e.error));
        }
    }
}

impl ConnectionHandler for RacePing {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        self.result.borrow_mut().token = Some(conn.token());
        let recv = conn.alloc(1).expect("client receive buffer");
        conn.submit(Op::recv(recv)).expect("client post receive");
        self.send_buf = Some(conn.alloc(1).expect("client send buffer"));
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        self.result.borrow_mut().local = conn.local_addr();
        self.send_next(conn);
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        match (c.opcode, c.result) {
            // The send's completion may come after the echo: the buffer waits for it.
            (OpCode::Send, Ok(_)) => {
                self.result.borrow_mut().sends_completed += 1;
                self.send_buf = c.buf;
                if self.result.borrow().outstanding.is_none() && self.seq < self.count {
                    self.send_next(conn);
                }
            }
            (OpCode::Recv, Ok(n)) => {
                let buf = c.buf.expect("buffer");
                if n != 1 || buf.as_slice() != [byte(self.id, self.seq)] {
                    let got = buf.as_slice().to_vec();
                    return self.fail(conn, format!("message {}: echoed {got:?} ({n} bytes)", self.seq));
                }
                {
                    let mut r = self.result.borrow_mut();
                    r.echoed += 1;
                    r.verified_bytes += 1;
                    r.outstanding = None;
                }
                self.seq += 1;
                if self.seq == self.count {
                    conn.close();
                    return;
                }
                if let Err(e) = conn.submit(Op::recv(buf)) {
                    return self.fail(conn, format!("message {}: post receive: {}", self.seq, e.error));
                }
                if self.send_buf.is_some() {
                    self.send_next(conn);
                }
            }
            (op, Err(e)) if self.seq < self.count => {
                self.fail(conn, format!("message {}: {op:?} failed: {e}", self.seq))
            }
            _ => {}
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        self.result.borrow_mut().closed = Some(reason);
    }
}

/// Accepts everything with an echo agent; records refusals (there must be none) and how each
/// agent closed.
#[derive(Default)]
struct Served {
    refused: Vec<RejectReason>,
    agents_closed: Rc<RefCell<Vec<CloseReason>>>,
}

struct Listener(Rc<RefCell<Served>>);

impl ListenerHandler for Listener {
    fn on_connect_request(&mut self, ctx: &mut Ctx<'_>, req: &ConnectRequest) -> Decision {
        let closed = self.0.borrow().agents_closed.clone();
        EchoListener { depth: 4, agents_closed: closed }.on_connect_request(ctx, req)
    }

    fn on_refused(&mut self, _ctx: &mut Ctx<'_>, _peer: Option<SocketAddr>, reason: &RejectReason) {
        self.0.borrow_mut().refused.push(reason.clone());
    }
}

/// What a race run measured.
#[derive(Debug)]
struct RaceRun {
    stats: Stats,
    round_trips: u64,
    connections: u64,
    secs: f64,
}

/// Round trips of each short-lived connection of a race's churn.
const CHURN_COUNT: u64 = 16;

/// `clients` connections each ping-pong `count` one-byte messages with an `echo server`
/// process, under the watchdog, while (with `churn`) short-lived connections of
/// `CHURN_COUNT` round trips come and go one after another; every byte verified, every
/// connection closed cleanly, every event acked, nothing left in the kernel.
fn race(clients: u64, count: u64, churn: bool, cfg: Config, poll_before_arm: bool) -> RaceRun {
    let server = addr();
    let s = server.to_string();
    let (cfg_shared, ack_batch) = (cfg.shared_cq.is_some(), cfg.cq_ack_batch);
    let mut r = Reactor::with_config(cfg).expect("reactor");
    if poll_before_arm {
        #[cfg(not(feature = "fault-injection"))]
        panic!("built without the `fault-injection` feature: run it with `cargo xtask test`");
        #[cfg(feature = "fault-injection")]
        r.inject_poll_before_arm();
    }
    // Its metrics endpoint shows the server's side of a stalled connection (`diagnose_stall`).
    let metrics = SocketAddr::new([127, 0, 0, 1].into(), server.port() + 1);
    let m = metrics.to_string();
    let _server = Proc::spawn(
        "echo server",
        bin("echo"),
        &["server", "--bind", &s, "--quiet", "--metrics", &m, "--metrics-conns"],
    );
    wait_listening(server, Duration::from_secs(30));
    let ticks = Rc::new(Cell::new(0u64));
    let start_one = |r: &mut Reactor, id: u64, count: u64| {
        let result = Rc::new(RefCell::new(RaceResult::default()));
        let ping = RacePing { id, count, seq: 0, send_buf: None, ticks: ticks.clone(), result: result.clone() };
        let opts = ConnectOptions { msg_size: 1, ..ConnectOptions::default() };
        r.connect(server, opts, ping).expect("connect");
        result
    };
    let mut results: Vec<Rc<RefCell<RaceResult>>> = (0..clients).map(|id| start_one(&mut r, id, count)).collect();
    let mut churned = 0;
    let start = Instant::now();
    // Far beyond any run; the watchdog is what catches a stall.
    let limit = Duration::from_secs(600);
    while results.iter().any(|x| x.borrow().closed.is_none()) {
        r.run_once(Some(Duration::from_millis(100))).expect("run_once");
        ticks.set(ticks.get() + 1);
        let main_running = results[..clients as usize].iter().any(|x| x.borrow().closed.is_none());
        let churner_done = churned == 0 || results.last().is_some_and(|x| x.borrow().closed.is_some());
        if churn && main_running && churner_done {
            // The last short-lived connection has gone (or none started yet): the next one.
            results.push(start_one(&mut r, clients + churned, CHURN_COUNT));
            churned += 1;
        }
        for (id, x) in results.iter().enumerate() {
            let Some((seq, at, t0)) = x.borrow().outstanding else { continue };
            let waited = at.elapsed();
            if waited >= WATCHDOG && ticks.get() - t0 >= WATCHDOG_TICKS {
                let lag = ticks.get() - t0;
                let why = diagnose_stall(&mut r, &ticks, x, server, metrics);
                panic!(
                    "client {id}, message {seq}: no echo {waited:?} after its send ({lag} ticks later): a stall\n{why}\n{:?}",
                    r.stats()
                );
            }
        }
        assert!(start.elapsed() < limit, "not done after {limit:?}: {:?}", r.stats());
    }
    let secs = start.elapsed().as_secs_f64();
    for (id, x) in results.iter().enumerate() {
        let x = x.borrow();
        let count = if id < clients as usize { count } else { CHURN_COUNT };
        assert_eq!(x.error, None, "client {id}: {x:?}");
        assert_eq!(x.echoed, count, "client {id}: every message echoed: {x:?}");
        assert_eq!(x.verified_bytes, count, "client {id}: every byte verified");
        assert_eq!(x.closed, Some(CloseReason::Local), "client {id}");
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while r.connections() > 0 {
        assert!(Instant::now() < deadline, "connections left: {r:?}");
        r.run_once(Some(Duration::from_millis(50))).expect("run_once");
    }
    let st = r.stats();
    if cfg_shared {
        // The shared CQ lives as long as the reactor: its last events (fewer than a batch)
        // are acked when it is destroyed.
        assert!(st.cq_events - st.cq_events_acked < u64::from(ack_batch), "every completion event acked once: {st:?}");
    } else {
        assert_eq!(st.cq_events_acked, st.cq_events, "every completion event acked once: {st:?}");
    }
    assert_eq!(st.stale_completions, 0, "{st:?}");
    drop(r);
    assert_eq!(res_counts(owner_id()), ResCounts { qp: 0, cq: 0, mr: 0, pd: 0, cm_id: 0 }, "kernel objects left");
    RaceRun { stats: st, round_trips: clients * count + churned * CHURN_COUNT, connections: clients + churned, secs }
}

/// What a stalled round trip's connection shows, for the failure message: the client's
/// counters, the kernel's TCP sockets of the connection (Soft-iWARP runs over TCP: bytes
/// queued in a socket and never read are the kernel's), the server's counters for it, then
/// whether the echo comes at all within ten more seconds of ticking (a late echo is a delay,
/// none a stall).
fn diagnose_stall(
    r: &mut Reactor,
    ticks: &Cell<u64>,
    x: &RefCell<RaceResult>,
    server: SocketAddr,
    metrics: SocketAddr,
) -> String {
    let (token, local, seq, sent_at, sends) = {
        let x = x.borrow();
        let (seq, at, _) = x.outstanding.expect("outstanding");
        (x.token, x.local, seq, at, x.sends_completed)
    };
    let mut out =
        format!("client: {local:?}, sends completed {sends}, metrics {:?}\n", token.and_then(|t| r.conn_metrics(t)));
    out += &tcp_sockets(local.map(|a| a.port()), server.port());
    out += &server_lines(metrics, local);
    let qps = Command::new("rdma").args(["res", "show", "qp"]).output();
    out += &format!(
        "rdma res show qp:\n{}",
        qps.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default()
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while x.borrow().outstanding.is_some_and(|o| o.0 == seq) && Instant::now() < deadline {
        r.run_once(Some(Duration::from_millis(50))).expect("run_once");
        ticks.set(ticks.get() + 1);
    }
    if x.borrow().outstanding.is_some_and(|o| o.0 == seq) {
        out += &format!("no echo {:?} after the send either: a stall, not a delay\n", sent_at.elapsed());
        let unread = server_unread(local.map(|a| a.port()), server.port());
        if unread > 0 {
            out += &format!(
                "{unread} bytes wait unread in the server's TCP socket: Soft-iWARP's lost wakeup at accept \
                 (NUDGES in src/proto/transport.rs), which {} nudges of this reactor did not end\n",
                r.stats().iwarp_nudges
            );
        }
    } else {
        out += &format!("the echo came {:?} after the send: a delay, not a stall\n", sent_at.elapsed());
    }
    out += &tcp_sockets(local.map(|a| a.port()), server.port());
    out
}

/// The lines of `/proc/net/tcp` of the sockets between `port` and `server_port` (both ends),
/// with their send and receive queues.
fn tcp_sockets(port: Option<u16>, server_port: u16) -> String {
    let Some(port) = port else { return "no local address\n".into() };
    let text = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    let (a, b) = (format!(":{port:04X} "), format!(":{server_port:04X} "));
    let lines: Vec<&str> = text.lines().filter(|l| l.contains(&a) && l.contains(&b)).collect();
    format!("tcp sockets (local rem st tx_queue:rx_queue):\n{}\n", lines.join("\n"))
}

/// The bytes waiting in the receive queue of the server's socket of the connection from
/// `port` (`/proc/net/tcp`; 0 when there is none).
fn server_unread(port: Option<u16>, server_port: u16) -> u64 {
    let Some(port) = port else { return 0 };
    let text = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    let (local, remote) = (format!(":{server_port:04X}"), format!(":{port:04X}"));
    text.lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|f| f.len() > 4 && f[1].ends_with(&local) && f[2].ends_with(&remote))
        .filter_map(|f| f[4].split(':').nth(1).and_then(|rx| u64::from_str_radix(rx, 16).ok()))
        .sum()
}

/// The echo server's metrics lines of the connection from `local`, fetched from its endpoint.
fn server_lines(metrics: SocketAddr, local: Option<SocketAddr>) -> String {
    use std::io::{Read, Write};
    let Some(local) = local else { return String::new() };
    let mut text = String::new();
    let fetched = std::net::TcpStream::connect_timeout(&metrics, Duration::from_secs(2)).and_then(|mut s| {
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n")?;
        s.read_to_string(&mut text)
    });
    if let Err(e) = fetched {
        return format!("server metrics: {e}\n");
    }
    let needle = format!("\"{local}\"");
    let lines: Vec<&str> = text.lines().filter(|l| l.contains(&needle) && !l.starts_with('#')).collect();
    format!("server metrics of {local}:\n{}\n", lines.join("\n"))
}

fn report(what: &str, run: &RaceRun) {
    let st = &run.stats;
    println!(
        "{what}: {} round trips over {} connections in {:.1} s ({:.0}/s); cq_rearm_catches {}, spurious_cq_events {}, cq_events {}, \
         cq_arms {}, cq_polls {}, wakeups {}, spurious_wakeups {}, iwarp_nudges {}",
        run.round_trips,
        run.connections,
        run.secs,
        run.round_trips as f64 / run.secs,
        st.cq_rearm_catches,
        st.spurious_cq_events,
        st.cq_events,
        st.cq_arms,
        st.cq_polls,
        st.wakeups,
        st.spurious_wakeups,
        st.iwarp_nudges
    );
}

/// Catalogue case 25: 100 000 one-byte round trips (8 connections × 12 500) through one reactor
/// against an `echo server` process, every connection on one shared CQ, while short-lived
/// connections of 16 round trips come and go on the same CQ, all under a per-message hang
/// detector. The poll right after `ibv_req_notify_cq` finds completions
/// (`cq_rearm_catches`), events find their CQ already emptied (`spurious_cq_events`), and
/// nothing stalls.
///
/// On rxe and siw the reactor arms a CQ right after the tick's posts and polls it once
/// (`Caps::arm_sees_only_new`): every completion since the tick's earlier poll is then such a
/// catch, the sends rxe completes inside `ibv_post_send` included, and each would wait unseen
/// without that poll. The next test runs the other order (poll, arm, poll), the one devices
/// other than rxe and siw take, where a catch is a completion that raced the arm.
///
/// The load is the one that makes the race visible in the VM (numbers from runs of this file,
/// in the poll, arm, poll order): with both ends on the test's reactor, rxe completes each post
/// inside the `ibv_post_send` call, so no completion ever arrives between a poll and an arm (0
/// catches in 6 000 round trips); against another process each completion arrives from the
/// other vCPU at any time (1 connection: 37 catches in 3 000 round trips; 8 connections on one
/// CQ: 650 to 9 000 catches per 100 000, fewer on a loaded host). An event that finds its CQ
/// empty is rarer: a completion must land in the microseconds between the arm and the poll
/// after it (4 to 8 per 100 000 round trips). The short-lived connections make it common:
/// destroying one drains the shared CQ, which is armed, and reaps completions of the others
/// whose event is already on its way (150 to 250 per run). 5 000 to 8 000 round trips/s on an
/// idle host, so 100 000 take 13 to 20 s (1 200 to 2 000/s and up to 90 s on a loaded one); the
/// catalogue's 10^6 would take 2 to 15 minutes of the emulated VM per run.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn arm_poll_race_100k_one_byte_round_trips_never_stall() {
    let cfg = Config { shared_cq: Some(4096), ..Config::default() };
    let run = race(8, 12_500, true, cfg, false);
    report("8 connections on one shared CQ against an echo server process", &run);
    let st = run.stats;
    assert!(st.cq_rearm_catches > 0, "the poll after the arm caught completions: {st:?}");
    assert!(st.spurious_cq_events > 0, "events found their CQ already emptied, harmlessly: {st:?}");
}

/// The test above in the order a device other than rxe and siw takes
/// (`Reactor::inject_poll_before_arm`, feature `fault-injection`): after the tick's posts an
/// emptied CQ is polled, armed and polled again, and a catch is a completion that arrived
/// between the last empty poll and the arm. 40 000 round trips (8 × 5 000), with the churn.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn arm_poll_race_polling_before_the_arm_never_stalls() {
    let cfg = Config { shared_cq: Some(4096), ..Config::default() };
    let run = race(8, 5_000, true, cfg, true);
    report("poll, arm, poll: 8 connections on one shared CQ against an echo server process", &run);
    let st = run.stats;
    assert!(st.cq_rearm_catches > 0, "the poll after the arm caught completions that raced it: {st:?}");
    assert!(st.spurious_cq_events > 0, "events found their CQ already emptied, harmlessly: {st:?}");
}

// ----- case 35: signals and spurious readiness -------------------------------------------------

/// SIGUSR1 deliveries seen by the handler.
static SIGNALS: AtomicU64 = AtomicU64::new(0);

extern "C" fn on_signal(_: nix::libc::c_int) {
    // Async-signal-safe: one atomic add.
    SIGNALS.fetch_add(1, Ordering::Relaxed);
}

/// Installs `on_signal` for SIGUSR1 without `SA_RESTART` for its lifetime.
struct SignalHandler(nix::sys::signal::SigAction);

impl SignalHandler {
    fn install() -> SignalHandler {
        use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
        let action = SigAction::new(SigHandler::Handler(on_signal), SaFlags::empty(), SigSet::empty());
        // SAFETY: the handler only adds to an atomic (async-signal-safe); no other code of this
        // test binary handles SIGUSR1.
        let old = unsafe { sigaction(Signal::SIGUSR1, &action) }.expect("sigaction SIGUSR1");
        SignalHandler(old)
    }
}

impl Drop for SignalHandler {
    fn drop(&mut self) {
        // SAFETY: puts back the disposition found at install.
        let _ = unsafe { nix::sys::signal::sigaction(nix::sys::signal::Signal::SIGUSR1, &self.0) };
    }
}

/// Catalogue case 35: while echo traffic runs through one reactor on the test's thread (its
/// listener serving an `echo client` process, its clients ping-ponging with an `echo server`
/// process, so it sleeps in `epoll_wait` between messages), one thread sends that thread
/// SIGUSR1 every ~300 µs (handler without `SA_RESTART`: the sleeping `epoll_wait` fails with
/// `EINTR`) and another sends it `Remote` messages in pairs (the second message is often taken
/// with the first, before its own eventfd write lands, which then wakes the reactor with
/// nothing to do). Every message is
/// verified, every `Remote` message arrives once and in order, no callback hears an error, the
/// interrupted waits and the wakeups, CQ events and reads that found nothing are counted, and
/// every completion event is acked once.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn signals_and_spurious_wakeups_cost_nothing() {
    const CLIENTS: u64 = 2;
    const COUNT: u64 = 1500;
    const MESSAGES: u64 = 24_000;
    let listen_at = addr();
    let echo_at = addr();
    let mut r = Reactor::new().expect("reactor");
    let served = Rc::new(RefCell::new(Served::default()));
    r.listen(listen_at, Listener(served.clone())).expect("listen");
    let e = echo_at.to_string();
    let _server = Proc::spawn("echo server", bin("echo"), &["server", "--bind", &e, "--quiet"]);
    wait_listening(echo_at, Duration::from_secs(30));
    let l = listen_at.to_string();
    let count = COUNT.to_string();
    let clients = CLIENTS.to_string();
    let args = ["client", "--connect", &l, "--size", "64", "--count", &count, "--clients", &clients, "--verify"];
    let mut echo_client = std::process::Command::new(bin("echo"))
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start echo client");
    let pings: Vec<_> = (0..CLIENTS)
        .map(|id| {
            let (c, result) = PingClient::new(id, 64, COUNT);
            let opts = ConnectOptions { msg_size: 64, ..ConnectOptions::default() };
            r.connect(echo_at, opts, c).expect("connect");
            result
        })
        .collect();
    // Remote messages: each once, in order.
    let received = Rc::new(Cell::new(0u64));
    let out_of_order = Rc::new(Cell::new(None::<(u64, u64)>));
    {
        let (received, out_of_order) = (received.clone(), out_of_order.clone());
        r.set_message_handler(move |_ctx, m| {
            if m != received.get() && out_of_order.get().is_none() {
                out_of_order.set(Some((received.get(), m)));
            }
            received.set(received.get() + 1);
        });
    }

    let _handler = SignalHandler::install();
    let signals_before = SIGNALS.load(Ordering::Relaxed);
    let stop = Arc::new(AtomicBool::new(false));
    let me = nix::sys::pthread::pthread_self();
    let bomber = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut sent = 0u64;
            while !stop.load(Ordering::Relaxed) {
                nix::sys::pthread::pthread_kill(me, nix::sys::signal::Signal::SIGUSR1).expect("pthread_kill");
                sent += 1;
                std::thread::sleep(Duration::from_micros(300));
            }
            sent
        })
    };
    // Pairs: the first write wakes the reactor, which may take both messages before the
    // second write lands; that write then wakes it to an empty inbox (a spurious wakeup).
    let flooder = {
        let remote = r.remote();
        std::thread::spawn(move || {
            for m in (0..MESSAGES).step_by(2) {
                remote.send(m).expect("the reactor is alive");
                remote.send(m + 1).expect("the reactor is alive");
                std::thread::sleep(Duration::from_micros(300));
            }
        })
    };

    let start = Instant::now();
    let limit = Duration::from_secs(240);
    let mut client_status = None;
    while pings.iter().any(|p| p.borrow().closed.is_none())
        || received.get() < MESSAGES
        || client_status.is_none()
        || r.connections() > 0
    {
        assert!(start.elapsed() < limit, "not done after {limit:?}: {:?}", r.stats());
        r.run_once(Some(Duration::from_millis(100))).expect("run_once never fails on EINTR");
        if client_status.is_none() {
            client_status = echo_client.try_wait().expect("try_wait");
        }
    }
    stop.store(true, Ordering::Relaxed);
    let sent = bomber.join().expect("bomber");
    flooder.join().expect("flooder");
    let secs = start.elapsed().as_secs_f64();
    let signals = SIGNALS.load(Ordering::Relaxed) - signals_before;
    let out = echo_client.wait_with_output().expect("echo client output");
    let stdout = String::from_utf8_lossy(&out.stdout);
    print!("{stdout}");
    let st = r.stats();
    println!(
        "{secs:.1} s: {sent} signals sent ({:.0}/s), {signals} handled; interrupted_waits {}, interrupted_connects {}; {} remote messages; \
         wakeups {}, spurious_wakeups {}; channel_reads {} = cm_events {} + cq_events {} + {} that found EAGAIN; \
         spurious_cq_events {}, cq_rearm_catches {}; cq_events_acked {}",
        sent as f64 / secs,
        st.interrupted_waits,
        st.interrupted_connects,
        received.get(),
        st.wakeups,
        st.spurious_wakeups,
        st.channel_reads,
        st.cm_events,
        st.cq_events,
        st.channel_reads - st.cm_events - st.cq_events,
        st.spurious_cq_events,
        st.cq_rearm_catches,
        st.cq_events_acked,
    );

    assert!(out.status.success(), "echo client failed: {}", String::from_utf8_lossy(&out.stderr));
    let line = format!("{} round trips of 64 bytes over {CLIENTS} connection(s)", COUNT * CLIENTS);
    assert!(stdout.contains(&line) && stdout.contains("every byte verified"), "{stdout}");
    for (id, p) in pings.iter().enumerate() {
        let p = p.borrow();
        assert_eq!(p.error, None, "client {id}: no error reached its callbacks");
        assert_eq!(p.echoed, COUNT, "client {id}: every message echoed and verified (closed: {:?})", p.closed);
        assert_eq!(p.verified_bytes, COUNT * 64, "client {id}");
        assert_eq!(p.closed, Some(CloseReason::Local), "client {id}");
    }
    {
        let sv = served.borrow();
        assert!(sv.refused.is_empty(), "refused: {:?}", sv.refused);
        let agents = sv.agents_closed.borrow();
        assert_eq!(agents.len() as u64, CLIENTS, "one agent per client, each closed once");
        assert!(agents.iter().all(|c| *c == CloseReason::Peer), "agents closed with {agents:?}");
    }
    assert_eq!(received.get(), MESSAGES, "every Remote message delivered once");
    assert_eq!(out_of_order.get(), None, "Remote messages in order");
    assert!(signals > 0 && st.interrupted_waits > 0, "the signals interrupted epoll_wait: {st:?}");
    assert!(st.interrupted_waits <= signals, "an EINTR counted without a signal: {st:?}");
    // Only iWARP connects inside rdma_connect, and there the runtime defers the thread's signals
    // for the call (an interrupted connect corrupts Soft-iWARP's listener: FAULTS.md).
    assert_eq!(st.interrupted_connects, 0, "no signal interrupted a connect: {st:?}");
    assert!(st.spurious_wakeups > 0, "a wakeup found nothing to do: {st:?}");
    assert!(st.channel_reads > st.cm_events + st.cq_events, "some reads found EAGAIN (no event): {st:?}");
    assert_eq!(st.cq_events_acked, st.cq_events, "every completion event acked once, none without a get: {st:?}");
    assert_eq!(st.stale_completions, 0, "{st:?}");
    drop(r);
    assert_eq!(res_counts(owner_id()), ResCounts { qp: 0, cq: 0, mr: 0, pd: 0, cm_id: 0 }, "kernel objects left");
}
