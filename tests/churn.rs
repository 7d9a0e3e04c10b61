//! Catalogue case 38, bounded, twice. In one process: 2 000 connect → transfer → close
//! cycles, 16 at a time, with random early closes (a client that closes as soon as it is
//! established, before any message) mixed with verified ping-pongs of 1 to 5 messages. With
//! process kills: at least 2 000 connections from `echo client` processes, some of them
//! SIGKILLed mid-handshake, mid-transfer or idle. Afterwards the process's kernel objects and
//! open fds are back to what they were before (and the client processes' are gone), and every
//! cycle ended with the outcome it should have.

mod util;

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use rdma_reactor::{
    CloseReason, Completion, Config, Conn, ConnectOptions, ConnectRequest, ConnectionHandler, Ctx, Decision,
    ListenerHandler, Op, OpCode, Reactor, RejectReason, Step, Timeouts, Token,
};
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
        // An accept whose REP nobody answers ends at this deadline (see the close reasons).
        let cfg = Config {
            timeouts: Timeouts { accept: Duration::from_secs(5), ..Timeouts::default() },
            ..Config::default()
        };
        let mut srv = Reactor::with_config(cfg).expect("server reactor");
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

// ----- case 38 with process kills ------------------------------------------------------------

/// Connections each `echo client` process opens.
const PER_CLIENT: u64 = 25;
/// Verified round trips on each of them.
const ROUND_TRIPS: u64 = 4;
/// Accepted connections the test runs at least (the server's `Stats::accepted`).
const MIN_ACCEPTED: u64 = 2_000;
/// Client processes running at once.
const PROCS_AT_ONCE: usize = 4;
/// The message size of client process `tag` is `TAG_BASE + tag`: the size is in the connect
/// information its connections send, which is how the server tells whose connection an agent
/// is (no two processes share a size).
const TAG_BASE: u32 = 64;
/// The message size of the final in-process ping-pong (no client process's).
const PROBE_SIZE: usize = 32;

/// What happens to one client process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Fate {
    /// Runs to its end: every round trip verified, exit 0.
    Survives,
    /// SIGKILLed from the listener's `on_connect_request` for its `n`th connect request (so
    /// that request, and any later ones, is mid-handshake; earlier ones may be established).
    KilledInHandshake,
    /// SIGKILLed from an agent's `on_completion` when the server received its `n`th message
    /// (that connection has a message in flight waiting for its echo).
    KilledMidTransfer,
    /// SIGKILLed once every echo the server sent it was acknowledged (its connections are
    /// established and idle: it holds them open with `--hold-ms`).
    KilledIdle,
}

/// One client process, as the server sees it.
struct Client {
    fate: Fate,
    /// The request (handshake) or message (transfer) count at which it is killed.
    kill_at: u64,
    proc: Option<Proc>,
    pid: u32,
    log: std::path::PathBuf,
    killed: bool,
    /// When it was sent SIGKILL, and how long after that it was reaped.
    killed_at: Option<Instant>,
    reaped_after: Option<Duration>,
    exit: Option<std::process::ExitStatus>,
    requests: u64,
    /// Agents created for it (accept decisions).
    agents: u64,
    /// Its accepts the reactor refused after the decision (`on_refused`).
    refused: Vec<String>,
    established: u64,
    received: u64,
    echoes_acked: u64,
}

impl Client {
    /// Sends SIGKILL and returns: the process is reaped by [`Client::done`]. Waiting for it
    /// here would stall the server's reactor (this runs inside its callbacks) for as long as
    /// the kernel takes to tear the process's connections down, which on siw is seconds: every
    /// other client's connect request waiting for an accept meanwhile timed out.
    fn kill(&mut self) {
        if let Some(p) = &self.proc {
            if !self.killed {
                let pid = nix::unistd::Pid::from_raw(p.0.id() as i32);
                nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).expect("kill -9");
                self.killed = true;
                self.killed_at = Some(Instant::now());
            }
        }
    }

    /// On siw a kill waits until the server has seen all of the process's connect requests:
    /// Soft-iWARP (Linux 6.1) drops its listening socket when a TCP connection to it closes
    /// before siw has accepted it (FAULTS.md, "iWARP";
    /// `faults::admission::a_tcp_probe_of_the_listening_port`), which a process killed with
    /// connections still in their TCP handshake does. Once the server saw its last request, siw
    /// had accepted all of its streams.
    fn may_die(&self) -> bool {
        transport() != "siw" || self.requests == PER_CLIENT
    }

    fn done(&mut self) -> bool {
        if let Some(p) = &mut self.proc {
            if let Some(st) = p.0.try_wait().expect("try_wait") {
                self.exit = Some(st);
                self.proc = None;
                self.reaped_after = self.killed_at.map(|t| t.elapsed());
            }
        }
        self.proc.is_none()
    }
}

#[derive(Default)]
struct Book {
    clients: Vec<Client>,
    /// Every agent's close: (client tag, token, reason, whether it was established).
    closes: Vec<(usize, Token, CloseReason, bool)>,
    /// The last connect request decided: (peer, tag), to which `on_refused` belongs (the
    /// reactor refuses right after the decision, in the same call).
    last_request: Option<(Option<std::net::SocketAddr>, usize)>,
    /// Agents of the in-process ping-pong at the end (message size below `TAG_BASE`).
    probes: u64,
}

/// The tag of the final ping-pong's agent.
const PROBE: usize = usize::MAX;

type Shared = Rc<RefCell<Book>>;

struct ChurnListener(Shared);

impl ListenerHandler for ChurnListener {
    fn on_connect_request(&mut self, _ctx: &mut Ctx<'_>, req: &ConnectRequest) -> Decision {
        let size = req.info.as_ref().map_or(0, |i| i.msg_size);
        let tag = size.checked_sub(TAG_BASE).map(|t| t as usize);
        let mut b = self.0.borrow_mut();
        let tag = match tag {
            Some(t) => {
                let Some(c) = b.clients.get_mut(t) else { panic!("a connect request from no client: {req:?}") };
                c.requests += 1;
                if c.fate == Fate::KilledInHandshake && c.requests == c.kill_at {
                    c.kill();
                }
                c.agents += 1;
                t
            }
            None => {
                b.probes += 1;
                PROBE
            }
        };
        b.last_request = Some((req.peer, tag));
        Decision::Accept(Box::new(ChurnAgent { tag, size: size as usize, established: false, book: self.0.clone() }))
    }

    fn on_refused(&mut self, _ctx: &mut Ctx<'_>, peer: Option<std::net::SocketAddr>, reason: &RejectReason) {
        let mut b = self.0.borrow_mut();
        let Some((p, tag)) = b.last_request.take().filter(|(p, _)| *p == peer) else {
            panic!("a refusal of no request just decided: {peer:?}: {reason}")
        };
        let Some(c) = b.clients.get_mut(tag) else { panic!("the final ping-pong refused: {p:?}: {reason}") };
        c.refused.push(reason.to_string());
    }
}

/// Echoes every message of one client connection, counting for its process.
struct ChurnAgent {
    tag: usize,
    size: usize,
    established: bool,
    book: Shared,
}

impl ChurnAgent {
    /// Sends the received message back and posts a new receive; both are refused once the
    /// connection is closing (the buffers then go back to the pool).
    fn echo(&mut self, conn: &mut Conn<'_>, c: Completion) {
        if conn.submit(Op::send(c.buf.expect("buffer"))).is_ok() {
            let buf = conn.alloc(self.size).expect("agent receive buffer");
            let _ = conn.submit(Op::recv(buf));
        }
    }
}

impl ConnectionHandler for ChurnAgent {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        post_recvs(conn, 2, self.size);
    }

    fn on_established(&mut self, _conn: &mut Conn<'_>) {
        self.established = true;
        if let Some(client) = self.book.borrow_mut().clients.get_mut(self.tag) {
            client.established += 1;
        }
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        match (c.opcode, c.result) {
            (OpCode::Recv, Ok(_)) => {
                if let Some(client) = self.book.borrow_mut().clients.get_mut(self.tag) {
                    client.received += 1;
                    if client.fate == Fate::KilledMidTransfer && client.received >= client.kill_at && client.may_die() {
                        client.kill();
                    }
                }
                self.echo(conn, c);
            }
            (OpCode::Send, Ok(_)) => {
                if let Some(client) = self.book.borrow_mut().clients.get_mut(self.tag) {
                    client.echoes_acked += 1;
                }
            }
            _ => {}
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, token: Token, reason: CloseReason) {
        self.book.borrow_mut().closes.push((self.tag, token, reason, self.established));
    }
}

/// A close reason without its details, for the summary's histogram.
fn reason_kind(r: &CloseReason) -> String {
    match r {
        CloseReason::Rejected { status, .. } => format!("Rejected({status})"),
        CloseReason::Setup(s) => format!("Setup({})", s.split(':').next().unwrap_or(s)),
        other => format!("{other:?}"),
    }
}

/// Catalogue case 38 with process kills: `echo client` processes, each opening 25
/// connections with 4 verified round trips on each, against an in-test server reactor, until
/// it has accepted at least 2 000 connections; a seeded PRNG picks for each process whether
/// it survives or is SIGKILLed mid-handshake, mid-transfer or while idle (and at which
/// request or message). Every surviving process exits 0 with every byte verified; every agent
/// closes exactly once, with `Peer` for a survivor's connection and, for a killed process's,
/// only what its kernel's teardown of that connection's state explains; the server still
/// serves a verified ping-pong; the test's kernel objects and open fds are back to the
/// baseline, and no client process, killed or not, has a kernel object left.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn two_thousand_connections_with_random_client_kills_leave_nothing_behind() {
    if not_on_iwarp(
        "two_thousand_connections_with_random_client_kills_leave_nothing_behind",
        "Soft-iWARP's (Linux 6.1) connection management does not survive process kills reliably: its \
         listening socket closes when a killed client's stream closes before siw accepted it \
         (faults::admission::a_tcp_probe_of_the_listening_port), and, rarer, an accepted stream stalls before the \
         server's ESTABLISHED; with kills deferred until a process's last request (Client::may_die) \
         it passed 13 of 15 runs in the VM, not enough to gate CI; a kernel defect, not the runtime's",
    ) {
        return;
    }
    {
        let mut warm = Reactor::new().expect("reactor");
        warm.listen(addr(), EchoListener { depth: 1, agents_closed: Rc::default() }).expect("listen");
    }
    let fds_before = open_fds();
    let rss_before = rss_kib();
    let started = Instant::now();
    let seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut rng = seed;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let book: Shared = Rc::default();
    let pids: Vec<u32>;
    let summary: String;
    {
        let mut srv = Reactor::new().expect("server reactor");
        let a = addr();
        let l = srv.listen(a, ChurnListener(book.clone())).expect("listen");
        let deadline = Instant::now() + Duration::from_secs(240);
        loop {
            {
                let mut b = book.borrow_mut();
                // Idle victims: every echo acknowledged, so all its connections are quiet.
                for c in b.clients.iter_mut() {
                    if c.fate == Fate::KilledIdle && c.echoes_acked == PER_CLIENT * ROUND_TRIPS {
                        c.kill();
                    }
                }
                let mut live = 0;
                for c in b.clients.iter_mut() {
                    if !c.done() {
                        live += 1;
                    }
                }
                let enough = srv.stats().accepted >= MIN_ACCEPTED;
                if enough && live == 0 {
                    break;
                }
                if Instant::now() >= deadline {
                    report_late(&srv, a, &b);
                }
                assert!(Instant::now() < deadline, "{} processes, {live} live: {:?}", b.clients.len(), srv.stats());
                while !enough && live < PROCS_AT_ONCE {
                    let tag = b.clients.len();
                    let r = next();
                    let (fate, kill_at) = match r % 8 {
                        // On siw at the last request (`Client::may_die`).
                        0 | 1 if transport() == "siw" => (Fate::KilledInHandshake, PER_CLIENT),
                        0 | 1 => (Fate::KilledInHandshake, 1 + (r >> 8) % PER_CLIENT),
                        2 | 3 => (Fate::KilledMidTransfer, 1 + (r >> 8) % (PER_CLIENT * ROUND_TRIPS - 1)),
                        4 => (Fate::KilledIdle, 0),
                        _ => (Fate::Survives, 0),
                    };
                    let hold = if fate == Fate::KilledIdle { "600000" } else { "0" };
                    let size = (TAG_BASE as usize + tag).to_string();
                    let (clients, count, at) = (PER_CLIENT.to_string(), ROUND_TRIPS.to_string(), a.to_string());
                    let args = [
                        "client",
                        "--connect",
                        &at,
                        "--size",
                        &size,
                        "--count",
                        &count,
                        "--clients",
                        &clients,
                        "--verify",
                        "--hold-ms",
                        hold,
                    ];
                    let log = log_path("churn-client");
                    let p = Proc::spawn_logged("echo client", bin("echo"), &args, &log);
                    let pid = p.pid();
                    b.clients.push(Client {
                        fate,
                        kill_at,
                        proc: Some(p),
                        pid,
                        log,
                        killed: false,
                        killed_at: None,
                        reaped_after: None,
                        exit: None,
                        requests: 0,
                        agents: 0,
                        refused: Vec::new(),
                        established: 0,
                        received: 0,
                        echoes_acked: 0,
                    });
                    live += 1;
                }
            }
            srv.run_once(Some(Duration::from_millis(5))).expect("server run_once");
        }
        let agents = || book.borrow().clients.iter().map(|c| c.agents).sum::<u64>() + book.borrow().probes;
        let deadline = Instant::now() + Duration::from_secs(60);
        let ended = || {
            let b = book.borrow();
            (b.closes.len() + b.clients.iter().map(|c| c.refused.len()).sum::<usize>()) as u64
        };
        while ended() < agents() {
            if Instant::now() > deadline {
                let b = book.borrow();
                for (tag, c) in b.clients.iter().enumerate() {
                    let closes: Vec<_> = b.closes.iter().filter(|(t, ..)| *t == tag).map(|(_, _, r, _)| r).collect();
                    if (closes.len() + c.refused.len()) as u64 != c.agents {
                        eprintln!(
                            "client {tag} {:?} at {} killed {}: requests {} agents {} established {} closes {closes:?}",
                            c.fate, c.kill_at, c.killed, c.requests, c.agents, c.established
                        );
                    }
                }
                panic!("{} agents, {} closed: {:?}", agents(), b.closes.len(), srv.stats());
            }
            srv.run_once(Some(Duration::from_millis(5))).expect("server run_once");
        }
        // Then a verified ping-pong from a new client reactor: the server still serves.
        let mut cli = Reactor::new().expect("client reactor");
        let (c, ping) = PingClient::new(1, PROBE_SIZE, 10);
        let opts = ConnectOptions { msg_size: PROBE_SIZE as u32, ..ConnectOptions::default() };
        cli.connect(a, opts, c).expect("connect");
        pump(&mut [&mut srv, &mut cli], Duration::from_secs(60), "the last ping-pong", || {
            ping.borrow().closed.is_some()
        });
        let p = ping.borrow();
        assert_eq!(
            (p.echoed, p.verified_bytes, p.error.as_deref(), p.closed.clone()),
            (10, 10 * PROBE_SIZE as u64, None, Some(CloseReason::Local)),
            "the ping-pong after the churn: {p:?}"
        );
        drop(p);
        srv.ctx().close(l);
        let deadline = Instant::now() + Duration::from_secs(60);
        while !(srv.is_idle() && cli.is_idle()) {
            assert!(Instant::now() < deadline, "not idle: {srv:?} {cli:?}");
            srv.run_once(Some(Duration::from_millis(5))).expect("server run_once");
            cli.run_once(Some(Duration::from_millis(5))).expect("client run_once");
        }
        let b = book.borrow();
        let accepted = srv.stats().accepted;
        pids = b.clients.iter().map(|c| c.pid).collect();

        // Every agent closed exactly once.
        let mut tokens: Vec<Token> = b.closes.iter().map(|(_, t, ..)| *t).collect();
        tokens.sort();
        tokens.dedup();
        assert_eq!(tokens.len(), b.closes.len(), "an agent closed twice");
        let probe: Vec<_> = b.closes.iter().filter(|(t, ..)| *t == PROBE).map(|(_, _, r, _)| r.clone()).collect();
        assert_eq!((b.probes, probe), (1, vec![CloseReason::Peer]), "the final ping-pong's agent");
        // The histogram: fate → reason → count; and the checks.
        let mut hist: std::collections::BTreeMap<(Fate, String), u64> = Default::default();
        let mut kills: std::collections::BTreeMap<Fate, u64> = Default::default();
        let iwarp = transport() == "siw";
        for (tag, c) in b.clients.iter().enumerate() {
            let closes: Vec<(&CloseReason, bool)> =
                b.closes.iter().filter(|(t, ..)| *t == tag).map(|(_, _, r, e)| (r, *e)).collect();
            let what =
                format!("client {tag} ({:?} at {}): closes {closes:?}, refused {:?}", c.fate, c.kill_at, c.refused);
            assert_eq!((closes.len() + c.refused.len()) as u64, c.agents, "{what}: one end per agent");
            for (r, established) in &closes {
                let kind = if *established { reason_kind(r) } else { format!("{} before ESTABLISHED", reason_kind(r)) };
                *hist.entry((c.fate, kind)).or_default() += 1;
                let allowed = match (c.fate, established) {
                    // A survivor closes every connection itself, after its round trips.
                    (Fate::Survives, true) => **r == CloseReason::Peer,
                    // An established connection of a killed process: its kernel's DREQ. On
                    // iWARP its kernel resets the TCP stream instead, and an echo the agent had
                    // posted into it fails first (siw: `LocQpOpErr`).
                    (_, true) => **r == CloseReason::Peer || (iwarp && matches!(r, CloseReason::WorkError(_))),
                    (Fate::Survives, false) => false,
                    // Not established here when the process died (see FAULTS.md, case 4): its
                    // REJ "timeout" after our REP (its id waited for a REP) or "consumer
                    // defined" (the REP had arrived), or, handled between the queue pair and
                    // `rdma_accept`, a failed accept; or no REJ at all (ib_cm handled it before
                    // the REQ, on another CPU's work queue), then our REP goes unanswered until
                    // the accept deadline; or it had sent its RTU and its DREQ was handled
                    // here before the RTU (the same work queues): DISCONNECTED before
                    // ESTABLISHED, which the agent reports as `Peer`.
                    (_, false) => {
                        **r == CloseReason::Peer
                            || matches!(r, CloseReason::Rejected { status: 4 | 28, reason: None })
                            || matches!(r, CloseReason::Setup(s) if s.starts_with("rdma_accept: "))
                            || **r == CloseReason::Timeout(Step::Accept)
                    }
                };
                assert!(allowed, "{what}: {r:?} (established: {established})");
            }
            // A request whose dead client's REJ was handled before the reactor read it: its
            // id is idle and cannot take a queue pair, so the accept is refused.
            for r in &c.refused {
                *hist.entry((c.fate, "refused".to_string())).or_default() += 1;
                assert!(c.fate != Fate::Survives && r.contains("rdma_create_qp"), "{what}");
            }
            let out = read_log(&c.log);
            match c.fate {
                Fate::Survives => {
                    assert!(!c.killed);
                    assert!(c.exit.is_some_and(|s| s.success()), "survivor {tag} exited {:?}:\n{out}", c.exit);
                    let line = format!(
                        "{} round trips of {} bytes over {PER_CLIENT} connection(s)",
                        PER_CLIENT * ROUND_TRIPS,
                        TAG_BASE as usize + tag
                    );
                    assert!(out.contains(&line) && out.contains("every byte verified"), "survivor {tag}:\n{out}");
                    assert_eq!((c.agents, c.established), (PER_CLIENT, PER_CLIENT), "{what}");
                }
                fate => {
                    assert!(c.killed, "{what}: not killed: exit {:?}:\n{out}", c.exit);
                    *kills.entry(fate).or_default() += 1;
                }
            }
            if c.fate == Fate::KilledIdle {
                assert_eq!((c.agents, c.established), (PER_CLIENT, PER_CLIENT), "{what}");
            }
            let _ = std::fs::remove_file(&c.log);
        }
        let reaped = b.clients.iter().filter_map(|c| c.reaped_after).max().unwrap_or_default();
        summary = format!(
            "{accepted} connect → transfer → close cycles (connections accepted) from {} client processes; \
             kills by phase {kills:?}; agents' ends by fate {hist:?}; a killed process reaped at most {reaped:?} \
             after its SIGKILL",
            b.clients.len(),
        );
        assert!(accepted >= MIN_ACCEPTED, "{accepted} connections accepted");
        for fate in [Fate::KilledInHandshake, Fate::KilledMidTransfer, Fate::KilledIdle] {
            assert!(kills.get(&fate).is_some_and(|n| *n > 0), "no process {fate:?}: {kills:?}");
        }
    }
    let (fds_after, rss_after) = (open_fds(), rss_kib());
    println!(
        "case 38 with kills: {summary}; in {:?}; fds {fds_before} -> {fds_after}; RSS {rss_before} -> {rss_after} KiB",
        started.elapsed()
    );
    assert_eq!(fds_after, fds_before, "open fds back to the baseline");
    let zero = ResCounts { qp: 0, cq: 0, mr: 0, pd: 0, cm_id: 0 };
    assert_eq!(res_counts(owner_id()), zero, "every kernel object of the test destroyed");
    let left = res_counts_of(&pids);
    assert!(left.iter().all(|(_, c)| *c == zero), "client processes' kernel objects: {left:?}");
}

/// Why the kills test is late, on its standard error: the listener as the kernel sees it (a TCP
/// socket listening, on iWARP; rdma_cm's id), each live client's kernel stacks and ids, and the
/// clients that failed or still wait, with their agents' ends and their own output.
fn report_late(srv: &Reactor, a: std::net::SocketAddr, b: &Book) {
    let sh = |c: &str| {
        let o = std::process::Command::new("sh").args(["-c", c]).output().expect("sh");
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    eprintln!("server: {srv:?}, listening on {a}");
    eprintln!("TCP listeners:\n{}", sh("grep ' 0A ' /proc/net/tcp"));
    eprintln!("rdma_cm listeners:\n{}", sh("rdma res show cm_id | grep -i listen"));
    for c in b.clients.iter().filter(|c| c.proc.is_some() && !c.killed) {
        let pid = c.pid;
        let what = sh(&format!(
            "for t in /proc/{pid}/task/*; do echo $t; cat $t/stack; done; rdma res show cm_id | grep 'pid {pid} '"
        ));
        eprintln!("live client {pid} ({:?}):\n{what}", c.fate);
    }
    for (i, c) in b.clients.iter().enumerate().filter(|(_, c)| c.agents == 0).take(3) {
        eprintln!("client {i} with no connect request: {:?}, exit {:?}\n{}", c.fate, c.exit, read_log(&c.log));
    }
    for (i, c) in b.clients.iter().enumerate().filter(|(_, c)| c.agents > 0) {
        let bad = (c.fate == Fate::Survives && c.exit.is_some_and(|e| !e.success())) || (!c.killed && c.exit.is_none());
        if bad {
            let closes: Vec<_> = b.closes.iter().filter(|(t, ..)| *t == i).map(|(.., r, _)| r).collect();
            eprintln!(
                "client {i} {:?}: exit {:?}, {} agents, {} established; closes {closes:?}\n{}",
                c.fate,
                c.exit,
                c.agents,
                c.established,
                read_log(&c.log)
            );
        }
    }
}
