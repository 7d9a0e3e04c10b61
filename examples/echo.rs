//! Ping-pong over RDMA send/receive, many connections from one thread.
//!
//! ```text
//! echo server --bind ADDR:PORT [--depth N] [--exit-after N] [--quiet] [--spin-us N]
//!             [--srq [--srq-receives N] [--srq-credit N] [--srq-max-credit N] [--srq-reserve N] [--srq-size BYTES]] [--marks N,N,..]
//!             [--threads N] [--balance round-robin|fewest] [--accept-delay-ms N]
//!             [--metrics [ADDR:]PORT [--metrics-conns] [--metrics-max-conns N]]
//! echo client --connect ADDR:PORT --size BYTES --count N [--verify] [--clients K]
//!             [--stall-timeout SECS] [--spin-us N] [--hold-ms N] [--hold-until PATH]
//! ```
//!
//! The server echoes every message it receives on every connection, from one reactor thread,
//! or from N with `--threads N` (the first listens and hands connections to the others); it
//! also serves plain librdmacm clients that send no connect information (`rdma_client`). The client opens K
//! connections from one reactor, ping-pongs N messages of BYTES on each (one in flight per
//! connection), checks every echoed byte with `--verify`, and prints the round-trip latency
//! distribution and the message rate. It exits non-zero with a message on any failure.

mod common;

use std::cell::RefCell;
use std::process::exit;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::group::{self, Group};
use common::{check_pattern, fill_pattern, Args};
use rdma_reactor::{
    Buf, CloseReason, Completion, Config, Conn, ConnectOptions, ConnectRequest, ConnectionHandler, Ctx, Decision,
    ListenerHandler, Op, OpCode, OpError, Reactor, RejectReason, Token, WcStatus,
};

const USAGE: &str = "\
usage: echo server --bind ADDR:PORT [--depth N] [--max-size BYTES] [--exit-after N] [--quiet] [--spin-us N]
                   [--srq [--srq-receives N] [--srq-credit N] [--srq-max-credit N] [--srq-reserve N] [--srq-size BYTES]] [--marks N,N,..]
                   [--threads N] [--balance round-robin|fewest] [--accept-delay-ms N]
                   [--metrics [ADDR:]PORT [--metrics-conns] [--metrics-max-conns N]]
       echo client --connect ADDR:PORT --size BYTES --count N [--verify] [--clients K]
                   [--stall-timeout SECS] [--spin-us N] [--hold-ms N] [--hold-until PATH]

server: echoes every message on every connection, from one thread.
  --bind ADDR:PORT     address of an RDMA device to listen on
  --depth N            receives kept posted per connection (default 16)
  --max-size BYTES     the largest message a connection may send (suffixes K, M; default 1M,
                       at most 1M): each connection's receives are of its client's --size,
                       within this (Config::msg_size), so a client cannot make the server pin
                       more than --depth x BYTES
  --exit-after N       exit after N connections have closed (default: run until killed)
  --quiet              no per-connection lines
  --threads N          reactors, one per thread (default 1); the first listens and spreads the
                       connections over all; at exit each prints what it served
  --balance B          how: round-robin (default) or fewest (live connections)
  --metrics [ADDR:]PORT serve GET /metrics (Prometheus text: the reactor's counters) on a TCP
                       port, from the reactor's thread; reactor i of --threads on PORT + i.
                       A bare PORT is 127.0.0.1:PORT (this host only): any other address
                       exposes the counters to whoever can reach it on the network
  --metrics-conns      each connection's counters too, labelled with its peer's address:
                       13 samples a connection per scrape, built on the reactor's thread,
                       and every client's address told to whoever scrapes (default: off)
  --metrics-max-conns N HTTP connections held at once (default 64); one not done 10 s after
                       it was accepted is closed at the next accept; at the cap a newcomer
                       is closed at once
  --spin-us N          (both) poll for N microseconds after work before sleeping (default 0:
                       event mode); then also prints `idle spinning ticks N` (the client at
                       the end, the server when its --exit-after-th connection closes)
  --keepalive-ms N     (both) probe an idle connection every N ms (zero-length RDMA WRITE), so
                       a peer host that vanished is noticed (default: off)
  --ack-timeout-ms N   (both) RC ACK timeout (default: the kernel's, about 1-2 s on RoCE)
  --retry-count N      (both) transport retries, 0 to 7 (default 6; rxe retries 7 forever)
  --credit-timeout-ms N (both) close a connection whose sends waited this long for the
                       peer's credits (a stopped peer; default 60000, the library's; 0: wait
                       for ever)
  --violation-backoff-ms N (server) refuse connect requests from an address for N ms, twice
                       as long per repeat, after one of its connections broke the protocol
                       (a message beyond its credit; default: off)
  --srq                receives from one shared receive queue the runtime keeps filled, not
                       --depth per connection: registered memory does not grow with connections
  --srq-receives N     receives on the shared queue (default 31232); at most
                       (N - reserve) / credit connections are accepted
  --srq-credit N       receive depth each connection starts with and keeps (default 3, the
                       least flow control works with)
  --srq-max-credit N   most a busy connection is granted from the free receives (default 32)
  --srq-reserve N      receives granted to no connection: what a peer that breaks its credit
                       takes before it is closed (default N / 32 of --srq-receives)
  --srq-size BYTES     buffer of each shared receive: the largest message (default 1K)
  --marks N,N,..       print a `mark` line (live connections, registered bytes) when the live
                       connections reach each N (per reactor)
  --accept-delay-ms N  test hook: on each connect request print `echo server: connect request
                       from PEER` (also with --quiet), then sleep N ms before accepting; the
                       sleep blocks the reactor's thread, so every other connection waits too
                       (the fault tests kill the server during it)
client: ping-pongs messages and reports round-trip latency.
  --connect ADDR:PORT  the server
  --size BYTES         message size, 1 to 1M (suffixes K, M)
  --count N            messages per connection
  --verify             check every echoed byte
  --clients K          connections from one reactor (default 1)
  --stall-timeout SECS fail a connection that gets no echo for this long (default 20)
  --hold-ms N          keep each connection open and idle N ms after its round trips
  --hold-until PATH    keep every connection open after its round trips until PATH exists";

fn main() {
    common::observe::init_logging("echo");
    let mut argv = std::env::args().skip(1);
    match argv.next().as_deref() {
        Some("server") => server(Args::parse(argv, &["quiet", "srq", "metrics-conns"], USAGE)),
        Some("client") => client(Args::parse(argv, &["verify"], USAGE)),
        Some("--help") | Some("-h") => println!("{USAGE}"),
        _ => common::fail(USAGE, "the first argument is `server` or `client`"),
    }
}

// ----- server -------------------------------------------------------------------------------

struct ServerStats {
    quiet: bool,
    /// Established and not yet closed.
    live: u64,
    marks: Vec<u64>,
    /// This reactor's index in the group.
    reactor: usize,
    group: Arc<Group>,
    /// `--spin-us` was given (not 0): the idle spinning ticks are printed when the
    /// `--exit-after`-th connection closes.
    spinning: bool,
}

struct EchoListener {
    depth: u32,
    /// `--accept-delay-ms` (a test hook): announce each request, then sleep this long.
    accept_delay: Duration,
    /// On a shared receive queue: the runtime posts the receives.
    srq: bool,
    stats: Rc<RefCell<ServerStats>>,
}

impl ListenerHandler for EchoListener {
    fn on_connect_request(&mut self, _ctx: &mut Ctx<'_>, req: &ConnectRequest) -> Decision {
        if !self.accept_delay.is_zero() {
            // The test hook: the request has reached this process and is not accepted yet.
            let peer = req.peer.map_or("?".into(), |p| p.to_string());
            println!("echo server: connect request from {peer}; accepting in {:?} (test hook)", self.accept_delay);
            std::thread::sleep(self.accept_delay);
        }
        Decision::Accept(Box::new(EchoAgent {
            depth: self.depth,
            srq: self.srq,
            // Set in `on_ready`: the size the reactor announced for it.
            size: 0,
            echoed: 0,
            established: false,
            target: 0,
            owed: 0,
            retry: None,
            retry_set: false,
            stats: self.stats.clone(),
        }))
    }

    fn on_refused(&mut self, _ctx: &mut Ctx<'_>, peer: Option<std::net::SocketAddr>, reason: &RejectReason) {
        eprintln!("echo server: refused {}: {reason}", peer.map_or("?".into(), |p| p.to_string()));
    }
}

struct EchoAgent {
    depth: u32,
    srq: bool,
    established: bool,
    size: usize,
    echoed: u64,
    /// Receives to keep posted: the flow-control minimum, growing by one a message to
    /// `depth` (see `on_ready`).
    target: u32,
    /// Receives not posted for want of pool memory (the connection is at its reservation and
    /// may borrow no more), posted by a timer as memory comes back: its peer's credit is
    /// smaller meanwhile, so it sends less.
    owed: u32,
    /// The retry timer's last wait (doubled each time it finds no memory, forgotten once
    /// nothing is owed), and whether it is set.
    retry: Option<Duration>,
    retry_set: bool,
    stats: Rc<RefCell<ServerStats>>,
}

/// The first and the longest wait before receives owed for want of memory are tried again.
const RETRY_FIRST: Duration = Duration::from_millis(5);
const RETRY_MAX: Duration = Duration::from_secs(1);

impl EchoAgent {
    /// Posts `n` receives; those the pool cannot give this connection now are owed, and
    /// tried again on a timer. False when the connection was closed (a failure other than
    /// memory).
    fn post_recvs(&mut self, conn: &mut Conn<'_>, n: u32) -> bool {
        for i in 0..n {
            match conn.alloc(self.size) {
                Ok(buf) => {
                    if conn.submit(Op::recv(buf)).is_err() {
                        return false;
                    }
                }
                // Beyond its reservation with nothing left to borrow (the pool's memory
                // guarantee, `PoolConfig`): fewer receives, so fewer credits for its peer,
                // until memory comes back. Never another connection's memory.
                Err(rdma_reactor::Error::OverBudget { .. } | rdma_reactor::Error::PoolExhausted { .. }) => {
                    self.owed += n - i;
                    if !self.retry_set {
                        // One timer at a time, its wait doubling while memory stays short.
                        let wait = self.retry.map_or(RETRY_FIRST, |w| (w * 2).min(RETRY_MAX));
                        self.retry_set = conn.ctx().set_timer(wait, 0).is_ok();
                        self.retry = Some(wait);
                    }
                    return true;
                }
                Err(e) => {
                    eprintln!("echo server: {:?}: no receive buffer: {e}", conn.token());
                    conn.close();
                    return false;
                }
            }
        }
        true
    }
}

impl ConnectionHandler for EchoAgent {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        // What this side announced: the client's --size within --max-size (Config::msg_size),
        // never the client's claim alone.
        self.size = conn.msg_size().max(1);
        if self.srq {
            return;
        }
        self.depth = self.depth.min(conn.recv_capacity());
        // A peer that keeps to credits gets only what this connection's reservation covers
        // (the flow-control minimum): a half-open or idle connection pins no more, and the
        // rest grows with its traffic (`on_completion`). One that may send without credits
        // (no flow control) finds every receive posted before it can.
        // (This server offers flow control: `Config::flow_control`'s default.)
        let credits = conn.peer_info().is_some_and(|i| i.flow_control && i.recv_depth >= 3);
        self.target = if credits { self.depth.min(3) } else { self.depth };
        let first = self.target;
        if self.post_recvs(conn, first) && self.owed > 0 && first - self.owed < first.min(3) {
            // Not even the minimum: the pool has no room for it now.
            eprintln!("echo server: {:?}: no room in the pool for its first receives", conn.token());
            conn.close();
        }
    }

    fn on_timer(&mut self, conn: &mut Conn<'_>, _user_data: u64) {
        self.retry_set = false;
        let owed = std::mem::take(&mut self.owed);
        // Still short: `post_recvs` sets the timer again, for twice as long.
        if self.post_recvs(conn, owed) && self.owed == 0 {
            self.retry = None;
        }
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        self.established = true;
        {
            let mut s = self.stats.borrow_mut();
            s.live += 1;
            if s.marks.contains(&s.live) {
                common::print_mark("echo", &s.marks, s.live, &conn.ctx().stats());
            }
        }
        if !self.stats.borrow().quiet {
            let peer = conn.peer_addr().map_or("?".into(), |p| p.to_string());
            let info = conn.peer_info().map_or("no connect information".to_string(), |i| {
                format!("message size {}, count {}, receive depth {}", i.msg_size, i.msg_count, i.recv_depth)
            });
            println!("echo server: {:?} established with {peer} ({info})", conn.token());
        }
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        // Send completions need nothing; errors are flushes when the connection closes, and the
        // reactor closes it on real errors.
        if let (OpCode::Recv, Ok(_)) = (c.opcode, c.result) {
            let buf = c.buf.expect("pool receive");
            if let Err(e) = conn.submit(Op::send(buf)) {
                eprintln!("echo server: {:?}: cannot echo: {}", conn.token(), e.error);
                conn.close();
                return;
            }
            self.echoed += 1;
            if !self.srq {
                // The receive consumed, and one more while traffic grows the depth kept
                // posted (borrowed from the pool's shared remainder; owed to the retry timer
                // when it cannot be had).
                let grow = u32::from(self.target < self.depth);
                self.target += grow;
                self.post_recvs(conn, 1 + grow);
            }
        }
    }

    fn on_closed(&mut self, ctx: &mut Ctx<'_>, token: Token, reason: CloseReason) {
        let mut s = self.stats.borrow_mut();
        if self.established {
            s.live -= 1;
        }
        if !s.quiet || !reason.is_clean() {
            println!("echo server: {token:?} closed after {} messages: {reason}", self.echoed);
        }
        let bytes = self.echoed * self.size as u64;
        if let Some(closed) = s.group.closed(ctx, s.reactor, self.echoed, bytes, !reason.is_clean()) {
            println!("echo server: {closed} connections closed, {} messages echoed; exiting", s.group.messages());
            if s.spinning {
                print_idle_spins("echo server", &ctx.stats());
            }
        }
    }
}

fn server(args: Args) {
    let own = ["bind", "depth", "max-size", "exit-after", "spin-us", "marks", "threads", "balance", "accept-delay-ms"];
    args.finish(&[&own[..], &Args::LIVENESS[..], &Args::SRQ[..], &Args::METRICS[..]].concat());
    let bind = args.addr("bind");
    let depth: u32 = args.get("depth", 16);
    if depth == 0 {
        common::fail(USAGE, "--depth must be at least 1");
    }
    let threads: usize = args.get("threads", 1);
    if threads == 0 {
        common::fail(USAGE, "--threads must be at least 1");
    }
    let balance = group::balance(&args.get("balance", "round-robin".to_string()))
        .unwrap_or_else(|| common::fail(USAGE, "--balance is round-robin or fewest"));
    let (quiet, marks) = (args.switch("quiet"), args.marks());
    let accept_delay = Duration::from_millis(args.get("accept-delay-ms", 0));
    let group = Group::new(threads, args.get("exit-after", 0), args.metrics());
    let max_size = args.size("max-size", 1024 * 1024);
    if !(1..=1024 * 1024).contains(&max_size) {
        common::fail(USAGE, "--max-size must be 1 to 1M bytes");
    }
    let srq = args.srq();
    // The operator's --depth and --max-size are the budget a connection's receives may pin
    // (Config::recv_budget's default, 64 MiB, is the largest message at depth 64).
    let chunk = rdma_reactor::PoolConfig::default().chunk_sizes.iter().copied().find(|c| *c >= max_size);
    let recv_budget = (depth.max(16) as usize).saturating_mul(chunk.unwrap_or(max_size)).max(64 << 20);
    let cfg = Config {
        recv_depth: depth.max(16),
        msg_size: max_size as u32,
        recv_budget,
        spin: args.spin(),
        ..Config::default()
    };
    let cfg = args.with_srq(args.liveness(cfg));
    let srq_note = srq.as_ref().map_or(String::new(), |s| {
        format!(", shared receive queue of {} receives of {} bytes, credit {}", s.receives, s.buf_size, s.credit)
    });
    let (g, on_srq, spinning) = (group.clone(), srq.is_some(), !args.spin().is_zero());
    group::serve("echo", &group, bind, cfg, balance, &srq_note, move |reactor| EchoListener {
        depth,
        accept_delay,
        srq: on_srq,
        stats: Rc::new(RefCell::new(ServerStats {
            quiet,
            live: 0,
            marks: marks.clone(),
            reactor,
            group: g.clone(),
            spinning,
        })),
    });
}

/// With `--spin-us`: the ticks that spun and found nothing, which `cargo xtask bench
/// --instructions` subtracts from the spin-mode count (they are time, not work). Printed
/// whenever spinning was asked for, 0 too, so a missing line is a run that never got that far
/// (the client prints it before it reports failures; the server when the `--exit-after`-th
/// connection closes, the figure of the reactor that saw it: with `--threads`, only that
/// one's; the instrument runs one).
fn print_idle_spins(program: &str, stats: &rdma_reactor::Stats) {
    println!("{program}: idle spinning ticks {}", stats.idle_spins);
}

// ----- client -------------------------------------------------------------------------------

#[derive(Default)]
struct Results {
    latencies: Vec<u64>,
    failures: Vec<String>,
    completed: u64,
}

struct EchoClient {
    index: u64,
    size: usize,
    count: u64,
    verify: bool,
    seq: u64,
    /// Counter ticks (`common::Clock`) when the pending message was submitted.
    sent_at: Option<u64>,
    send_buf: Option<Buf>,
    echo_pending: bool,
    failed: Option<String>,
    stall: Duration,
    seen_at_last_check: u64,
    /// Keep the connection open, idle, this long after its last round trip.
    hold: Duration,
    /// `--hold-until`: after its round trips the connection waits here to be closed.
    held: Option<Rc<RefCell<Vec<Token>>>>,
    results: Rc<RefCell<Results>>,
}

/// The user_data of the timer that ends a held connection (the stall timer's is 0).
const HOLD_TIMER: u64 = 1;

impl EchoClient {
    /// The round trips are done: close now, or after `--hold-ms`.
    fn finish(&mut self, conn: &mut Conn<'_>) {
        if let Some(held) = &self.held {
            held.borrow_mut().push(conn.token());
            return;
        }
        if self.hold.is_zero() || conn.ctx().set_timer(self.hold, HOLD_TIMER).is_err() {
            conn.close();
        }
    }

    fn fail(&mut self, conn: &mut Conn<'_>, msg: String) {
        if self.failed.is_none() {
            self.failed = Some(msg);
        }
        conn.close();
    }

    /// Sends message `seq` when its buffer is back and the previous echo arrived.
    fn maybe_send(&mut self, conn: &mut Conn<'_>) {
        if self.echo_pending || self.seq >= self.count {
            return;
        }
        let Some(mut buf) = self.send_buf.take() else { return };
        if self.verify {
            fill_pattern(buf.as_mut_slice(), self.index, self.seq);
        }
        self.sent_at = Some(common::Clock::ticks());
        self.echo_pending = true;
        if let Err(e) = conn.submit(Op::send(buf).user_data(self.seq)) {
            let msg = format!("send {}: {}", self.seq, e.error);
            self.fail(conn, msg);
        }
    }
}

impl ConnectionHandler for EchoClient {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        match conn.alloc(self.size) {
            Ok(mut send) => {
                // Without --verify the payload is a fixed pattern written once.
                fill_pattern(send.as_mut_slice(), self.index, u64::MAX);
                self.send_buf = Some(send);
            }
            Err(e) => return self.fail(conn, format!("buffers: {}", common::report(&e))),
        }
        // One echo is in flight at a time, but three receives posted let the client offer flow
        // control, which a server on a shared receive queue requires (`--srq`).
        for _ in 0..3 {
            let posted = conn
                .alloc(self.size)
                .map_err(|e| common::report(&e))
                .and_then(|recv| conn.submit(Op::recv(recv)).map_err(|e| format!("post receive: {}", e.error)));
            if let Err(msg) = posted {
                return self.fail(conn, msg);
            }
        }
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        if let Some(max) = conn.peer_info().map(|i| i.msg_size as usize) {
            if self.size > max {
                return self.fail(conn, format!("the server takes messages up to {max} bytes, not {}", self.size));
            }
        }
        let _ = conn.ctx().set_timer(self.stall, 0);
        if self.count == 0 {
            return self.finish(conn);
        }
        self.maybe_send(conn);
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        match (c.opcode, c.result) {
            (OpCode::Send, Ok(_)) => {
                self.send_buf = c.buf;
                self.maybe_send(conn);
            }
            (OpCode::Recv, Ok(n)) => {
                let rtt = self.sent_at.take().map_or(0, |t| common::Clock::ticks().wrapping_sub(t));
                let buf = c.buf.expect("pool receive");
                if n as usize != self.size {
                    return self.fail(conn, format!("message {}: echo of {n} bytes, sent {}", self.seq, self.size));
                }
                if self.verify {
                    if let Some(at) = check_pattern(buf.as_slice(), self.index, self.seq) {
                        return self.fail(conn, format!("message {}: echoed byte {at} differs", self.seq));
                    }
                }
                self.results.borrow_mut().latencies.push(rtt);
                self.seq += 1;
                self.echo_pending = false;
                if self.seq >= self.count {
                    return self.finish(conn);
                }
                if let Err(e) = conn.submit(Op::recv(buf)) {
                    let msg = format!("post receive: {}", e.error);
                    return self.fail(conn, msg);
                }
                self.maybe_send(conn);
            }
            // A flush or a cancel is the consequence of a close, whose reason on_closed reports.
            (_, Err(OpError::Wc(WcStatus::WrFlushErr) | OpError::Cancelled)) => {}
            (op, Err(e)) => {
                if self.seq < self.count {
                    self.fail(conn, format!("{op:?} of message {} failed: {e}", self.seq));
                }
            }
            (_, Ok(_)) => {}
        }
    }

    fn on_timer(&mut self, conn: &mut Conn<'_>, user_data: u64) {
        if user_data == HOLD_TIMER {
            return conn.close();
        }
        if self.seq >= self.count {
            return;
        }
        if self.seq == self.seen_at_last_check {
            let msg = format!("no echo for {:?} after {} messages", self.stall, self.seq);
            return self.fail(conn, msg);
        }
        self.seen_at_last_check = self.seq;
        let _ = conn.ctx().set_timer(self.stall, 0);
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        if std::env::var_os("ECHO_STATS").is_some() {
            eprintln!("echo client: connection {} closed: {reason}", self.index);
        }
        let mut r = self.results.borrow_mut();
        if let Some(f) = self.failed.take() {
            let why = if reason.is_clean() { String::new() } else { format!(" ({reason})") };
            r.failures.push(format!("connection {}: {f}{why}", self.index));
        } else if self.seq < self.count {
            r.failures.push(format!(
                "connection {}: closed after {} of {} messages: {reason}",
                self.index, self.seq, self.count
            ));
        } else {
            r.completed += 1;
        }
    }
}

fn client(args: Args) {
    args.finish(
        &[
            &["connect", "size", "count", "clients", "stall-timeout", "spin-us", "hold-ms", "hold-until"][..],
            &Args::LIVENESS[..],
        ]
        .concat(),
    );
    let dst = args.addr("connect");
    let size = args.size("size", 0);
    if !(1..=1024 * 1024).contains(&size) {
        common::fail(USAGE, "--size must be 1 to 1M bytes");
    }
    let count: u64 = args.get("count", 0);
    let clients: u64 = args.get("clients", 1);
    if clients == 0 {
        common::fail(USAGE, "--clients must be at least 1");
    }
    let verify = args.switch("verify");
    let stall = Duration::from_secs(args.get("stall-timeout", 20));
    let cfg = args.liveness(Config { send_depth: 4, recv_depth: 4, spin: args.spin(), ..Config::default() });
    let mut reactor = Reactor::with_config(cfg)
        .unwrap_or_else(|e| common::die("echo", &format!("cannot start: {}", common::report(&e))));
    // Room for every round trip up front: growing the list would copy it in the timed loop.
    let latencies = Vec::with_capacity(usize::try_from(count.saturating_mul(clients)).unwrap_or(0).min(1 << 24));
    let results = Rc::new(RefCell::new(Results { latencies, ..Results::default() }));
    let hold_until: Option<std::path::PathBuf> = args
        .get::<String>("hold-until", String::new())
        .parse()
        .ok()
        .filter(|p: &std::path::PathBuf| !p.as_os_str().is_empty());
    let held = hold_until.as_ref().map(|_| Rc::new(RefCell::new(Vec::new())));
    for index in 0..clients {
        let handler = EchoClient {
            index,
            size,
            count,
            verify,
            seq: 0,
            sent_at: None,
            send_buf: None,
            echo_pending: false,
            failed: None,
            stall,
            seen_at_last_check: 0,
            hold: Duration::from_millis(args.get("hold-ms", 0)),
            held: held.clone(),
            results: results.clone(),
        };
        let opts = ConnectOptions { msg_size: size as u32, msg_count: count as u32, ..Default::default() };
        if let Err(e) = reactor.connect(dst, opts, handler) {
            common::die("echo", &format!("cannot connect to {dst}: {}", common::report(&e)));
        }
    }
    let start = Instant::now();
    let mut clock = common::Clock::new();
    let mut last_report = 0;
    common::run_client("echo", &mut reactor, Duration::from_millis(500), &clock, |reactor, now| {
        if now.saturating_sub(last_report) >= 2_000_000_000 {
            last_report = now;
            if let (Some(path), Some(held)) = (&hold_until, &held) {
                if path.exists() {
                    // Released: close what has finished, and each later one as it finishes.
                    let tokens = std::mem::take(&mut *held.borrow_mut());
                    for t in tokens {
                        reactor.ctx().close(t);
                    }
                }
            }
            let done = results.borrow().latencies.len();
            eprintln!("echo client: {done} of {} round trips after {:.1} s", count * clients, now as f64 / 1e9);
        }
    });
    let elapsed = start.elapsed();
    clock.calibrate();
    let stats = reactor.stats();
    if std::env::var_os("ECHO_STATS").is_some() {
        eprintln!("echo client: {stats:?}");
    }
    let r = results.borrow();
    let mut lat: Vec<u64> = r.latencies.iter().map(|&ticks| clock.ns(ticks)).collect();
    lat.sort_unstable();
    let msgs = lat.len() as u64;
    if msgs > 0 {
        let per = |n: u64| n as f64 / msgs as f64;
        println!(
            "calls per round trip (client): epoll_wait {:.2}, channel reads {:.2}, CQ arms {:.2}, \
             post_send {:.2}, post_recv {:.2}, CQ events {:.2}",
            per(stats.wakeups),
            per(stats.channel_reads),
            per(stats.cq_arms),
            per(stats.post_send_calls),
            per(stats.post_recv_calls),
            per(stats.cq_events)
        );
    }
    if !args.spin().is_zero() {
        print_idle_spins("echo client", &stats);
    }
    common::print_round_trips("echo", &lat, size, clients, elapsed, verify);
    if !r.failures.is_empty() {
        for f in &r.failures {
            eprintln!("echo client: FAILED {f}");
        }
        exit(1);
    }
    if r.completed != clients {
        eprintln!("echo client: FAILED only {} of {clients} connections completed", r.completed);
        exit(1);
    }
}
