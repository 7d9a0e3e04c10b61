//! Streams messages one way as fast as flow control allows, many connections from one thread.
//!
//! ```text
//! blast server --bind ADDR:PORT [--verify] [--depth N] [--exit-after N] [--quiet] [--spin-us N]
//!              [--srq [--srq-receives N] [--srq-credit N] [--srq-max-credit N] [--srq-reserve N] [--srq-size BYTES]]
//!              [--threads N] [--balance round-robin|fewest] [--shared-cq N] [--metrics ADDR:PORT]
//! blast client --connect ADDR:PORT --size BYTES --count N [--clients K] [--op send|write]
//!              [--verify] [--window N] [--spin-us N] [--shared-cq N] [--reconnect N]
//! ```
//!
//! With `--op send` every message is a SEND into one of the server's posted receives. With
//! `--op write` the server exposes a ring of `depth` slots (application memory, a `Region` of
//! at most 64 MiB, with REMOTE_WRITE only, to that connection alone: `Conn::expose_region`)
//! and sends its descriptor; each message is an RDMA WRITE with immediate into slot
//! `seq % depth`, whose immediate consumes one receive so the server learns the slot is full. Either way the sender
//! never has more messages in flight than the server has receives posted: receive credits
//! (the credit rule in `ConnectionHandler`'s docs), so there are no RNR retries and nothing is lost.
//!
//! Measured as perftest measures: the client takes its message buffers when each connection
//! is established, starts sending once every connection is, and reports the rate from the
//! first message submitted to the last completed (its CPU time per message covers the whole
//! run). Its defaults are perftest's too: 128 messages in flight per connection, up to 512
//! receives posted per connection, polling while messages flow (`--spin-us 1000`), and one CQ
//! for all of a client's connections.

mod common;

use std::cell::RefCell;
use std::collections::HashMap;
use std::process::exit;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::group::{self, Group};
use common::{check_pattern, fill_pattern, Args};
use rdma_reactor::{
    Buf, CloseReason, Completion, Config, Conn, ConnectOptions, ConnectRequest, ConnectionHandler, Ctx, Decision,
    ListenerHandler, Op, OpCode, OpError, Reactor, Reconnect, Region, RegionWindow, RejectCode, RejectReason,
    RemoteAccess, RemoteSlice, Token, Transport, WcStatus,
};

const USAGE: &str = "\
usage: blast server --bind ADDR:PORT [--verify] [--depth N] [--exit-after N] [--quiet]
                    [--spin-us N] [--srq [--srq-receives N] [--srq-credit N] [--srq-max-credit N] [--srq-reserve N] [--srq-size BYTES]]
                    [--threads N] [--balance round-robin|fewest] [--shared-cq N] [--metrics ADDR:PORT]
       blast client --connect ADDR:PORT --size BYTES --count N [--clients K]
                    [--op send|write] [--verify] [--window N] [--spin-us N] [--shared-cq N]
                    [--reconnect N]

server: receives from any number of clients at once, from one thread.
  --bind ADDR:PORT   address of an RDMA device to listen on
  --verify           check every byte of every message
  --depth N          receives posted per connection: the credit window (minimum 3; default:
                     by message size, about 8 MiB of buffers, 16 to 512: 512 up to 16 KiB)
  --exit-after N     exit after N connections have closed (default: run until killed)
  --threads N        reactors, one per thread (default 1); the first listens and spreads the
                     connections over all; at exit each prints what it served
  --balance B        how: round-robin (default) or fewest (live connections)
  --metrics ADDR:PORT serve GET /metrics (Prometheus text: the reactor's counters and each
                     connection's) on a TCP port, from the reactor's thread; reactor i of
                     --threads on PORT + i
  --quiet            no per-connection lines
  --spin-us N        (both) poll for N microseconds after work before sleeping (default 1000,
                     as perftest's bandwidth tests poll; 0: event mode)
  --shared-cq N      (both) all connections on one CQ of N entries instead of one CQ each
                     (default: the server one each; a client of several connections one CQ
                     with room for all of them, while that is at most 32767 entries)
  --keepalive-ms N   (both) probe an idle connection every N ms (default: off)
  --ack-timeout-ms N (both) RC ACK timeout (default: the kernel's)
  --retry-count N    (both) transport retries, 0 to 7 (default 6)
  --credit-timeout-ms N (both) close a connection whose sends waited this long for the
                     peer's credits (a stopped peer; default: wait for ever)
  --srq              receives from one shared receive queue the runtime keeps filled; the
                     credit window starts at --srq-credit instead of --depth
  --srq-receives N   receives on the shared queue (default 31232; (N - reserve) / credit
                     connections)
  --srq-credit N     receive depth each connection starts with and keeps (default 3, at least 3)
  --srq-max-credit N most a busy connection is granted from the free receives (default 32)
  --srq-reserve N    receives granted to no connection, taken by a peer that breaks its
                     credit before it is closed (default a thirty-second of --srq-receives)
  --srq-size BYTES   buffer of each shared receive: the largest message (default 1K)
client: streams N messages of BYTES on each of K connections.
  --connect ADDR:PORT
  --size BYTES       message size (suffixes K, M); with --op write the server's ring (depth
                     slots of it) is at most 64 MiB, its depth cut to fit
  --count N          messages per connection
  --clients K        connections from one reactor (default 1)
  --op send|write    SEND, or RDMA WRITE with immediate into the server's ring (default send)
  --verify           fill every message with a checkable pattern
  --window N         messages submitted ahead per connection (default 128)
  --reconnect N      after a failure, connect again (at most N failed attempts in a row,
                     backoff from 100 ms, give up after 60 s; --op send only). Messages carry
                     their number; on each connection the server says where to resume (the
                     first message it lacks) and, once it has them all, that the client is
                     done: the count finishes over as many connections as it takes, nothing
                     lost (a SEND's completion does not say the server's application got it)";

/// Connect-information user bytes: magic, flags (`FLAG_WRITE`, `FLAG_NUMBERED`), client id.
const USER_MAGIC: &[u8; 4] = b"BLST";
/// `--op write`.
const FLAG_WRITE: u8 = 1;
/// `--reconnect`: messages carry their number (`common::fill_numbered`) and may come over
/// several connections, some twice. The server tells the client where to resume ([`RESUME`]).
const FLAG_NUMBERED: u8 = 2;
/// With `FLAG_NUMBERED`, the server's messages: `RESUME` and the number of the first message
/// it has not received (little endian), when a connection is established and when it has
/// them all. The client (re)sends from there, and finishes when told it has them all: a
/// SEND's completion says the local device is done with it (on iWARP: handed to TCP), not that
/// the server's application got it, so only the server can say which messages a failure lost.
const RESUME: &[u8; 4] = b"RSUM";

fn main() {
    common::observe::init_logging("blast");
    let mut argv = std::env::args().skip(1);
    match argv.next().as_deref() {
        Some("server") => server(Args::parse(argv, &["verify", "quiet", "srq"], USAGE)),
        Some("client") => client(Args::parse(argv, &["verify"], USAGE)),
        Some("--help") | Some("-h") => println!("{USAGE}"),
        _ => common::fail(USAGE, "the first argument is `server` or `client`"),
    }
}

fn rate(bytes: u64, msgs: u64, secs: f64) -> String {
    let secs = secs.max(1e-9);
    format!("{:.1} MB/s, {:.0} messages/s", bytes as f64 / secs / 1e6, msgs as f64 / secs)
}

/// User and system CPU seconds of this process. System time includes the kernel's work on
/// our behalf; with Soft-RoCE that is the whole transport (packet building, ICRC).
fn cpu_seconds() -> (f64, f64) {
    use nix::sys::resource::{getrusage, UsageWho};
    match getrusage(UsageWho::RUSAGE_SELF) {
        Ok(u) => {
            let t = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 + tv.tv_usec() as f64 / 1e6;
            (t(u.user_time()), t(u.system_time()))
        }
        Err(_) => (0.0, 0.0),
    }
}

// ----- server -------------------------------------------------------------------------------

struct Totals {
    msgs: u64,
    bytes: u64,
    /// Bytes since the last per-second line.
    window_bytes: u64,
    window_msgs: u64,
    closed: u64,
    failed: u64,
    active: u64,
    /// This reactor's index in the group.
    reactor: usize,
    group: Arc<Group>,
    /// Numbered messages seen, per reconnecting client (`FLAG_NUMBERED`), over all its
    /// connections to this reactor.
    numbered: HashMap<u64, Coverage>,
}

/// Which numbered messages of one reconnecting client arrived.
#[derive(Default)]
struct Coverage {
    seen: Vec<bool>,
    /// The first message not received: every one before it was.
    floor: u64,
    duplicates: u64,
    connections: u64,
}

impl Coverage {
    fn record(&mut self, seq: u64) {
        let i = seq as usize;
        if self.seen.len() <= i {
            self.seen.resize(i + 1, false);
        }
        if std::mem::replace(&mut self.seen[i], true) {
            self.duplicates += 1;
        }
        while self.seen.get(self.floor as usize).copied().unwrap_or(false) {
            self.floor += 1;
        }
    }
}

/// A [`RESUME`] message for `next`.
fn resume_message(conn: &mut Conn<'_>, next: u64) -> Result<Op, String> {
    let mut b = conn.alloc(12).map_err(|e| format!("resume buffer: {}", common::report(&e)))?;
    let mut bytes = RESUME.to_vec();
    bytes.extend_from_slice(&next.to_le_bytes());
    b.fill_from(&bytes).expect("12 bytes fit");
    Ok(Op::send(b))
}

/// The message number a [`RESUME`] message carries.
fn resume_of(data: &[u8]) -> Option<u64> {
    (data.len() == 12 && &data[..4] == RESUME).then(|| u64::from_le_bytes(data[4..].try_into().expect("8 bytes")))
}

struct BlastListener {
    /// The receive depth (`--depth`; on a shared receive queue the most credit a connection can
    /// be granted, `--srq-max-credit`, so that `--op write`'s ring has a slot for every message
    /// its credit lets the client have in flight); with `auto`, the most [`auto_depth`] gives.
    depth: u32,
    /// No `--depth`: each connection's depth follows its message size ([`auto_depth`]).
    auto: bool,
    /// On a shared receive queue: the runtime posts the receives.
    srq: bool,
    verify: bool,
    quiet: bool,
    totals: Rc<RefCell<Totals>>,
    ticking: bool,
    last_tick: Instant,
}

impl ListenerHandler for BlastListener {
    fn on_connect_request(&mut self, ctx: &mut Ctx<'_>, req: &ConnectRequest) -> Decision {
        let Some(info) = req.info.as_ref() else {
            return Decision::Reject(RejectReason::new(RejectCode::Unsupported, "blast needs a blast client"));
        };
        let user = &info.user;
        if user.len() < 13 || &user[..4] != USER_MAGIC {
            return Decision::Reject(RejectReason::new(RejectCode::Unsupported, "not a blast client"));
        }
        let write = user[4] & FLAG_WRITE != 0;
        let numbered = user[4] & FLAG_NUMBERED != 0;
        let client_id = u64::from_be_bytes(user[5..13].try_into().expect("8 bytes"));
        let size = info.msg_size as usize;
        let base = if self.auto { auto_depth(size) } else { self.depth };
        let depth = if write { base.min((RING_MAX / size.max(1)) as u32) } else { base };
        if depth < 3 || (self.srq && depth < self.depth) {
            let text = format!("message size {size} leaves only {depth} ring slots");
            return Decision::Reject(RejectReason::new(RejectCode::Unsupported, text));
        }
        if !self.ticking {
            self.ticking = true;
            self.last_tick = Instant::now();
            let _ = ctx.set_timer(Duration::from_secs(1), 0);
        }
        self.totals.borrow_mut().active += 1;
        Decision::Accept(Box::new(BlastAgent {
            depth,
            srq: self.srq,
            expected: u64::from(info.msg_count),
            size,
            write,
            numbered,
            client_id,
            verify: self.verify,
            quiet: self.quiet,
            ring: None,
            seq: 0,
            bytes: 0,
            started: None,
            error: None,
            totals: self.totals.clone(),
        }))
    }

    fn on_refused(&mut self, _ctx: &mut Ctx<'_>, peer: Option<std::net::SocketAddr>, reason: &RejectReason) {
        eprintln!("blast server: refused {}: {reason}", peer.map_or("?".into(), |p| p.to_string()));
    }

    fn on_timer(&mut self, ctx: &mut Ctx<'_>, _user_data: u64) {
        let mut t = self.totals.borrow_mut();
        let secs = self.last_tick.elapsed().as_secs_f64();
        self.last_tick = Instant::now();
        if t.window_msgs > 0 {
            println!("blast server: {} ({} connections open now)", rate(t.window_bytes, t.window_msgs, secs), t.active);
        }
        t.window_bytes = 0;
        t.window_msgs = 0;
        if t.active > 0 {
            let _ = ctx.set_timer(Duration::from_secs(1), 0);
        } else {
            self.ticking = false;
        }
    }
}

struct BlastAgent {
    depth: u32,
    srq: bool,
    /// Messages the client said it would send (0: not stated).
    expected: u64,
    size: usize,
    write: bool,
    /// Its client reconnects: messages are numbered (`FLAG_NUMBERED`).
    numbered: bool,
    client_id: u64,
    verify: bool,
    quiet: bool,
    /// With `--op write`: the ring, application memory of `depth` slots, and its window.
    ring: Option<(Region, RegionWindow)>,
    seq: u64,
    bytes: u64,
    started: Option<Instant>,
    error: Option<String>,
    totals: Rc<RefCell<Totals>>,
}

impl BlastAgent {
    fn fail(&mut self, conn: &mut Conn<'_>, what: String) {
        self.error.get_or_insert(what);
        conn.close();
    }

    /// Tells a numbered client to (re)send from message `next` (`RESUME`).
    fn announce(&mut self, conn: &mut Conn<'_>, next: u64) {
        match resume_message(conn, next) {
            Ok(op) => {
                if let Err(e) = conn.submit(op) {
                    self.fail(conn, format!("send the resume point: {}", e.error));
                }
            }
            Err(e) => self.fail(conn, e),
        }
    }
}

impl ConnectionHandler for BlastAgent {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        if self.srq {
            return;
        }
        // With --op write the data lands in the ring; receives only carry the immediates.
        let recv_size = if self.write { 64 } else { self.size };
        for _ in 0..self.depth {
            match conn.alloc(recv_size) {
                Ok(b) => {
                    if let Err(e) = conn.submit(Op::recv(b)) {
                        return self.fail(conn, format!("post receive: {}", e.error));
                    }
                }
                Err(e) => return self.fail(conn, format!("receive buffer: {}", common::report(&e))),
            }
        }
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        self.started = Some(Instant::now());
        if self.numbered {
            // Where the client resumes: the first message this reactor has not received
            // from it (0 for a new client, or after this server was restarted).
            let next = self.totals.borrow().numbered.get(&self.client_id).map_or(0, |c| c.floor);
            self.announce(conn, next);
        }
        if !self.write {
            return;
        }
        // Application memory (a `Region`), as large as the slots need, not a pool chunk (at
        // most 1 MiB: 16 slots of 64 KiB, where ib_write_bw keeps 128 writes in flight). Bound
        // to this connection: the window's rkey is of no use on any other.
        let len = self.depth as usize * self.size;
        let ring = Region::zeroed(len).and_then(|region| {
            let window = conn.expose_region(&region.slice(..)?, RemoteAccess::WRITE)?;
            Ok((region, window))
        });
        let ring = match ring {
            Ok(r) => r,
            Err(e) => return self.fail(conn, format!("ring of {len} bytes: {}", common::report(&e))),
        };
        let descriptor = ring.1.remote();
        self.ring = Some(ring);
        let mut msg = match conn.alloc(RemoteSlice::ENCODED_LEN) {
            Ok(b) => b,
            Err(e) => return self.fail(conn, format!("descriptor buffer: {}", common::report(&e))),
        };
        msg.fill_from(&descriptor.encode()).expect("16 bytes fit");
        if let Err(e) = conn.submit(Op::send(msg)) {
            self.fail(conn, format!("send the ring descriptor: {}", e.error));
        }
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        match (c.opcode, c.result) {
            (OpCode::Recv, Ok(n)) => {
                let buf = c.buf.expect("pool receive");
                // On iWARP (no immediate data) a slot's WRITE is announced by an empty SEND
                // after it: RC delivers it after the written bytes are placed.
                let notice = self.write && !c.remote_write && n == 0;
                let n = if notice { self.size as u32 } else { n };
                if n as usize != self.size {
                    return self.fail(conn, format!("message {}: {n} bytes, expected {}", self.seq, self.size));
                }
                if self.numbered {
                    // Numbered: checked by its own number, which may repeat or skip ahead
                    // (a reconnecting client resends what it could not confirm).
                    let seq = match common::check_numbered(buf.as_slice(), self.client_id) {
                        Ok(seq) if self.expected == 0 || seq < self.expected => seq,
                        Ok(seq) => return self.fail(conn, format!("message number {seq} of {}", self.expected)),
                        Err(at) if self.verify || at < 8 => {
                            return self.fail(conn, format!("message {}: byte {at} differs", self.seq))
                        }
                        Err(_) => u64::from_le_bytes(buf.as_slice()[..8].try_into().expect("8 bytes")),
                    };
                    let complete = {
                        let mut t = self.totals.borrow_mut();
                        let cov = t.numbered.entry(self.client_id).or_default();
                        let before = cov.floor;
                        cov.record(seq);
                        (before < self.expected && cov.floor >= self.expected).then_some(cov.floor)
                    };
                    if let Some(all) = complete {
                        // Every message is here: the client may finish.
                        self.announce(conn, all);
                    }
                } else if self.verify {
                    let bad = if c.remote_write || notice {
                        let slot = (self.seq % u64::from(self.depth)) as usize * self.size;
                        let mut data = vec![0u8; self.size];
                        let (ring, _) = self.ring.as_ref().expect("write mode has a ring");
                        ring.read_at(slot, &mut data).expect("slot in the ring");
                        check_pattern(&data, self.client_id, self.seq)
                    } else {
                        check_pattern(buf.as_slice(), self.client_id, self.seq)
                    };
                    if let Some(at) = bad {
                        return self.fail(conn, format!("message {}: byte {at} differs", self.seq));
                    }
                }
                self.seq += 1;
                self.bytes += u64::from(n);
                {
                    let mut t = self.totals.borrow_mut();
                    t.msgs += 1;
                    t.bytes += u64::from(n);
                    t.window_msgs += 1;
                    t.window_bytes += u64::from(n);
                }
                if self.srq {
                    return;
                }
                if let Err(e) = conn.submit(Op::recv(buf)) {
                    self.fail(conn, format!("post receive: {}", e.error));
                }
            }
            (_, Err(OpError::Wc(WcStatus::WrFlushErr) | OpError::Cancelled)) => {}
            (op, Err(e)) => self.fail(conn, format!("{op:?} failed: {}", common::report(&e))),
            (_, Ok(_)) => {}
        }
    }

    fn on_closed(&mut self, ctx: &mut Ctx<'_>, token: Token, reason: CloseReason) {
        let secs = self.started.map_or(0.0, |s| s.elapsed().as_secs_f64());
        let mut t = self.totals.borrow_mut();
        t.closed += 1;
        t.active = t.active.saturating_sub(1);
        let mut all = String::new();
        if self.numbered {
            // Judged over all of the client's connections, when it closes one cleanly (at the
            // end of its count): every message from the first this reactor saw has arrived.
            // Connections that failed are the reason it reconnects, not a failure of the run.
            // Whether they all came is the client's to judge (it finishes only when told so):
            // a connection that ended first, cleanly or not, is why it reconnects.
            let cov = t.numbered.entry(self.client_id).or_default();
            cov.connections += 1;
            if self.error.is_none() && self.expected > 0 && cov.floor >= self.expected {
                let verified = if self.verify { ", every byte verified" } else { "" };
                all = format!(
                    "; client {}: all messages 0..{} arrived over {} connection(s), {} twice{verified}",
                    self.client_id,
                    self.expected - 1,
                    cov.connections,
                    cov.duplicates
                );
            }
        } else if self.error.is_none() && self.expected > 0 && self.seq != self.expected {
            self.error = Some(format!("received {} of the {} messages announced", self.seq, self.expected));
        }
        let failed = self.error.is_some() || (!reason.is_clean() && !self.numbered);
        if failed {
            t.failed += 1;
        }
        if !self.quiet || failed {
            let verified = if self.verify { ", every byte verified" } else { "" };
            let err = self.error.as_ref().map_or(String::new(), |e| format!(", FAILED: {e}"));
            println!(
                "blast server: {token:?} client {}: {} messages, {} bytes, {}{verified} ({reason}){err}{all}",
                self.client_id,
                self.seq,
                self.bytes,
                rate(self.bytes, self.seq, secs)
            );
        }
        if let Some(closed) = t.group.closed(ctx, t.reactor, self.seq, self.bytes, failed) {
            let g = &t.group;
            println!(
                "blast server: total {} messages, {} bytes, {closed} connections, {} failed",
                g.messages(),
                g.bytes(),
                g.failed()
            );
        }
    }
}

/// blast's default `--spin-us`: a throughput tool polls while messages flow, as perftest's
/// bandwidth tests do (they busy-poll for the whole run); one millisecond after the last work
/// it sleeps, so an idle blast costs nothing. The library's own default stays event mode
/// (`Config::spin` zero).
const BLAST_SPIN_US: u64 = 1000;

/// The largest `--op write` ring (`depth` slots of the message size): the depth is cut to fit.
const RING_MAX: usize = 64 << 20;

/// The most receives a connection gets without `--depth`: perftest's `ib_send_bw` posts 512.
const AUTO_DEPTH_MAX: u32 = 512;

/// A connection's receive depth (its sender's credit window) without `--depth`: as many
/// receives as about 8 MiB of buffers hold (a buffer is at least a 4 KiB pool chunk), from 16
/// to [`AUTO_DEPTH_MAX`]: 512 for messages up to 16 KiB, 128 for 64 KiB, 16 for 512 KiB and
/// more. A deep window keeps the sender going while credits travel back; a cap on the bytes
/// keeps large messages from pinning hundreds of megabytes per connection.
fn auto_depth(msg_size: usize) -> u32 {
    let per = msg_size.max(4096);
    ((8 << 20) / per).clamp(16, AUTO_DEPTH_MAX as usize) as u32
}

/// `--shared-cq N`: every connection of the reactor on one CQ of N entries (`Config::shared_cq`).
fn shared_cq(args: &Args) -> Option<u32> {
    Some(args.get("shared-cq", 0u32)).filter(|n| *n > 0)
}

fn server(args: Args) {
    let own = ["bind", "depth", "exit-after", "spin-us", "threads", "balance", "shared-cq", "metrics"];
    args.finish(&[&own[..], &Args::LIVENESS[..], &Args::SRQ[..]].concat());
    let bind = args.addr("bind");
    // Not given: each connection's depth follows its message size (`auto_depth`).
    let auto = !args.given("depth");
    let depth: u32 = args.get("depth", AUTO_DEPTH_MAX);
    if depth < 3 {
        common::fail(USAGE, "--depth must be at least 3 (flow control needs a reserve)");
    }
    let threads: usize = args.get("threads", 1);
    if threads == 0 {
        common::fail(USAGE, "--threads must be at least 1");
    }
    let balance = group::balance(&args.get("balance", "round-robin".to_string()))
        .unwrap_or_else(|| common::fail(USAGE, "--balance is round-robin or fewest"));
    let group = Group::new(threads, args.get("exit-after", 0), args.metrics());
    let srq = args.srq();
    // On a shared receive queue each connection's credit window starts at the SRQ's credit
    // and may grow to its maximum (credit that follows activity): a write ring needs a slot for
    // each.
    let depth = srq.map_or(depth, |s| s.credit);
    let slots = srq.map_or(depth, |s| s.max_credit.max(s.credit));
    let cfg = args.with_srq(args.liveness(Config {
        recv_depth: depth,
        send_depth: 16,
        spin: args.spin_or(BLAST_SPIN_US),
        shared_cq: shared_cq(&args),
        // `--op write`'s ring on a device without memory windows (iWARP): a registration
        // of its own, whose key any connection of this server on the device could use
        // (Config::exposure_registration; ignored where windows exist).
        exposure_registration: true,
        ..Config::default()
    }));
    let (verify, quiet, on_srq) = (args.switch("verify"), args.switch("quiet"), srq.is_some());
    let g = group.clone();
    group::serve("blast", &group, bind, cfg, balance, "", move |reactor| BlastListener {
        depth: slots,
        auto: auto && !on_srq,
        srq: on_srq,
        verify,
        quiet,
        totals: Rc::new(RefCell::new(Totals {
            msgs: 0,
            bytes: 0,
            window_bytes: 0,
            window_msgs: 0,
            closed: 0,
            failed: 0,
            active: 0,
            reactor,
            group: g.clone(),
            numbered: HashMap::new(),
        })),
        ticking: false,
        last_tick: Instant::now(),
    });
    if group.failed() > 0 {
        exit(1);
    }
}

// ----- client -------------------------------------------------------------------------------

#[derive(Default)]
struct ClientTotals {
    msgs: u64,
    bytes: u64,
    done: u64,
    failures: Vec<String>,
    /// The counter when the first message was submitted and when the last one completed: the
    /// rate is taken over the transfer alone, as perftest takes its own (connection setup and
    /// teardown are not in it).
    first_tick: Option<u64>,
    last_tick: u64,
    /// Connections established, or closed before they were: the messages start once every
    /// connection has settled, as perftest's start once all its queue pairs are connected.
    settled: u64,
    clients: u64,
    /// A connection ran on iWARP (`--op write` posts WRITE + SEND there).
    iwarp: bool,
    /// `--reconnect`: connections made again, and messages sent again.
    reconnected: u64,
    resent: u64,
}

/// `on_timer` user data: see whether every connection has settled, and start.
const START: u64 = 1;

struct BlastClient {
    id: u64,
    size: usize,
    count: u64,
    write: bool,
    /// The connection's device is iWARP: `--op write` posts a WRITE and an empty SEND.
    iwarp: bool,
    verify: bool,
    /// `--reconnect`: messages are numbered, sent from where the server says to resume
    /// (`RESUME`, after each connection is made), and the client finishes when the server
    /// says it has them all (`confirmed`). `submitted` is then the next message to send.
    numbered: bool,
    /// Numbered: messages submitted and not completed (in flight on the device, or waiting
    /// for a new connection).
    in_flight: u64,
    /// Numbered: this connection's `RESUME` has arrived: messages may go.
    resumed: bool,
    /// Numbered: the server has every message.
    confirmed: bool,
    window: u64,
    submitted: u64,
    completed: u64,
    ring: Option<RemoteSlice>,
    depth: u64,
    error: Option<String>,
    totals: Rc<RefCell<ClientTotals>>,
    established: bool,
    /// Every connection has settled: messages may go.
    started: bool,
    /// Message buffers, taken once when established (so the pool grows before the clock
    /// starts, as perftest registers its buffers first) and reused.
    free: Vec<Buf>,
}

impl BlastClient {
    /// Starts sending once every connection of the run has settled; until then looks again
    /// every millisecond.
    fn start_when_all_settled(&mut self, conn: &mut Conn<'_>) {
        let all = {
            let t = self.totals.borrow();
            t.settled >= t.clients
        };
        if all {
            self.started = true;
            self.pump(conn);
        } else if let Err(e) = conn.ctx().set_timer(Duration::from_millis(1), START) {
            self.fail(conn, format!("timer: {}", common::report(&e)));
        }
    }

    fn fail(&mut self, conn: &mut Conn<'_>, what: String) {
        self.error.get_or_insert(what);
        conn.close();
    }

    fn pump(&mut self, conn: &mut Conn<'_>) {
        if !self.started || (self.write && self.ring.is_none()) || (self.numbered && !self.resumed) {
            return; // Waiting for the server's ring descriptor, or where to resume.
        }
        let room = |c: &Self| if c.numbered { c.in_flight < c.window } else { c.submitted - c.completed < c.window };
        while self.submitted < self.count && room(self) {
            let seq = self.submitted;
            let mut buf = match self.free.pop().map_or_else(|| conn.alloc(self.size), Ok) {
                Ok(b) => b,
                Err(e) => return self.fail(conn, format!("buffer: {}", common::report(&e))),
            };
            if self.numbered {
                common::fill_numbered(buf.as_mut_slice(), self.id, seq);
            } else if self.verify {
                fill_pattern(buf.as_mut_slice(), self.id, seq);
            }
            let op = match self.ring {
                Some(ring) => {
                    let slot = (seq % self.depth) as u32 * self.size as u32;
                    let dst = ring.slice(slot, self.size as u32).expect("slot inside the ring");
                    if self.iwarp {
                        // No immediate data on iWARP: the WRITE, then an empty SEND that tells
                        // the server (RC keeps their order; the message counts at the SEND).
                        if let Err(e) = conn.submit(Op::write(buf, dst).user_data(seq)) {
                            return self.fail(conn, format!("submit message {seq}: {}", e.error));
                        }
                        match conn.alloc(0) {
                            Ok(b) => Op::send(b),
                            Err(e) => return self.fail(conn, format!("notice buffer: {}", common::report(&e))),
                        }
                    } else {
                        Op::write_imm(buf, dst)
                    }
                }
                None => Op::send(buf),
            };
            if let Err(e) = conn.submit(op.user_data(seq)) {
                return self.fail(conn, format!("submit message {seq}: {}", e.error));
            }
            if seq == 0 {
                self.totals.borrow_mut().first_tick.get_or_insert_with(common::Clock::ticks);
            }
            self.submitted += 1;
            self.in_flight += u64::from(self.numbered);
        }
    }
}

impl ConnectionHandler for BlastClient {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        // Receives for the server's credit-only messages (and, with --op write, its ring
        // descriptor): flow control needs at least 3.
        for _ in 0..4 {
            match conn.alloc(64) {
                Ok(b) => {
                    let _ = conn.submit(Op::recv(b));
                }
                Err(e) => return self.fail(conn, format!("receive buffer: {}", common::report(&e))),
            }
        }
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        self.iwarp = conn.transport() == Some(Transport::Iwarp);
        self.totals.borrow_mut().iwarp |= self.iwarp;
        if let Some(info) = conn.peer_info() {
            self.depth = u64::from(info.recv_depth);
        }
        if !conn.peer_info().is_some_and(|i| i.flow_control) {
            return self.fail(conn, "the server does not use flow control".into());
        }
        self.established = true;
        self.totals.borrow_mut().settled += 1;
        if self.count == 0 {
            return conn.close();
        }
        for _ in 0..self.window.min(self.count) {
            match conn.alloc(self.size) {
                Ok(b) => self.free.push(b),
                Err(e) => return self.fail(conn, format!("buffer: {}", common::report(&e))),
            }
        }
        self.start_when_all_settled(conn);
    }

    fn on_reconnecting(&mut self, _conn: &mut Conn<'_>, reason: &CloseReason, attempt: u32, delay: Duration) {
        // Nothing new goes until the next connection's server says where to resume.
        self.resumed = false;
        println!(
            "blast client: connection {}: {reason} with {} of {} messages sent; reconnecting in {} ms (attempt {attempt})",
            self.id,
            self.submitted,
            self.count,
            delay.as_millis()
        );
    }

    fn on_reconnected(&mut self, conn: &mut Conn<'_>) {
        self.totals.borrow_mut().reconnected += 1;
        if !conn.peer_info().is_some_and(|i| i.flow_control) {
            return self.fail(conn, "the server does not use flow control".into());
        }
        // The messages that waited for it go now; the server's RESUME says where the rest start.
        println!("blast client: connection {}: reconnected", self.id);
    }

    fn on_timer(&mut self, conn: &mut Conn<'_>, user_data: u64) {
        if user_data == START && !self.started {
            self.start_when_all_settled(conn);
        }
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        match (c.opcode, c.result) {
            (OpCode::Recv, Ok(n)) => {
                let buf = c.buf.expect("pool receive");
                if self.write && self.ring.is_none() {
                    match RemoteSlice::decode(&buf.as_slice()[..n as usize]) {
                        Some(r) if u64::from(r.len) >= self.depth * self.size as u64 => {
                            // A slot for each message in flight: the server sizes its ring for the
                            // most credit it may grant (more than its advertised depth on a
                            // shared receive queue, whose credit follows activity).
                            self.depth = u64::from(r.len) / self.size.max(1) as u64;
                            self.ring = Some(r);
                        }
                        _ => return self.fail(conn, "bad ring descriptor from the server".into()),
                    }
                }
                if self.numbered {
                    let Some(next) = resume_of(&buf.as_slice()[..n as usize]) else {
                        return self.fail(conn, "a message from the server that is not RESUME".into());
                    };
                    if next >= self.count {
                        self.confirmed = true;
                        return conn.close();
                    }
                    if next < self.submitted {
                        self.totals.borrow_mut().resent += self.submitted - next;
                        println!("blast client: connection {}: resuming at message {next}", self.id);
                    }
                    self.submitted = next;
                    self.resumed = true;
                }
                let _ = conn.submit(Op::recv(buf));
                self.pump(conn);
            }
            (OpCode::Write, Ok(_)) if self.iwarp => {
                // The WRITE of a WRITE + SEND pair: its buffer is free; the SEND counts.
                if let Some(buf) = c.buf {
                    self.free.push(buf);
                }
            }
            (OpCode::Send | OpCode::WriteImm, Ok(n)) => {
                self.completed += 1;
                // A WRITE + SEND pair's SEND is empty: the message is the WRITE's bytes.
                let n = if self.iwarp && self.write { self.size as u32 } else { n };
                {
                    let mut t = self.totals.borrow_mut();
                    t.msgs += 1;
                    t.bytes += u64::from(n);
                    t.last_tick = common::Clock::ticks();
                }
                // A message's buffer is used again; a WRITE + SEND pair's empty SEND is not a
                // message's (its length is 0: reused, it would WRITE nothing into the slot).
                if let Some(buf) = c.buf.filter(|b| b.len() == self.size) {
                    self.free.push(buf);
                }
                self.in_flight = self.in_flight.saturating_sub(u64::from(self.numbered));
                if self.completed == self.count && !self.numbered {
                    return conn.close();
                }
                self.pump(conn);
            }
            // Its receives (for credits) end with the connection; the new one gets its own.
            (OpCode::Recv, Err(_)) if self.numbered => {}
            (OpCode::Send, Err(_)) if self.numbered => {
                // In flight at a failure, or cancelled: the server's RESUME on the next
                // connection says whether it arrived.
                self.in_flight -= 1;
                if let Some(buf) = c.buf.filter(|b| b.len() == self.size) {
                    self.free.push(buf);
                }
            }
            (_, Err(OpError::Wc(WcStatus::WrFlushErr) | OpError::Cancelled)) => {}
            (op, Err(e)) => self.fail(conn, format!("{op:?} failed: {}", common::report(&e))),
            (_, Ok(_)) => {}
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        let mut t = self.totals.borrow_mut();
        if !self.established {
            t.settled += 1;
        }
        if let Some(e) = self.error.take() {
            t.failures.push(format!("connection {}: {e} ({reason})", self.id));
        } else if self.numbered && !self.confirmed {
            let what = format!(
                "connection {}: closed with {} of {} messages sent and the server's confirmation of all not \
                 received: {reason}",
                self.id, self.submitted, self.count
            );
            t.failures.push(what);
        } else if !self.numbered && self.completed < self.count {
            let what =
                format!("connection {}: closed after {} of {} messages: {reason}", self.id, self.completed, self.count);
            t.failures.push(what);
        } else {
            t.done += 1;
        }
    }
}

fn client(args: Args) {
    args.finish(
        &[
            &["connect", "size", "count", "clients", "op", "window", "spin-us", "shared-cq", "reconnect"][..],
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
    let window: u64 = args.get("window", 128);
    let write = match args.get("op", "send".to_string()).as_str() {
        "send" => false,
        "write" => true,
        other => common::fail(USAGE, &format!("--op {other:?}: send or write")),
    };
    if clients == 0 || window == 0 {
        common::fail(USAGE, "--clients and --window must be at least 1");
    }
    let verify = args.switch("verify");
    let reconnect: u32 = args.get("reconnect", 0);
    let numbered = reconnect > 0;
    if numbered && (write || size < 8) {
        common::fail(USAGE, "--reconnect takes --op send and messages of at least 8 bytes (they carry their number)");
    }
    let send_depth = 64.max(window as u32).min(1024);
    let recv_depth = 4;
    // Several connections share one CQ by default, as perftest's QPs do (`-q N`): a spinning
    // reactor then polls one CQ, not one per connection. It has room for every connection's
    // queues, so only while that fits a CQ of rxe's (32 767 entries at most).
    let entries = clients.saturating_mul(u64::from(send_depth + recv_depth));
    let shared = (clients > 1 && entries <= 32_767).then_some(entries as u32);
    let cfg = args.liveness(Config {
        send_depth,
        recv_depth,
        spin: args.spin_or(BLAST_SPIN_US),
        shared_cq: shared_cq(&args).or(shared),
        ..Config::default()
    });
    let mut reactor = Reactor::with_config(cfg)
        .unwrap_or_else(|e| common::die("blast", &format!("cannot start: {}", common::report(&e))));
    let totals = Rc::new(RefCell::new(ClientTotals { clients, ..ClientTotals::default() }));
    // Ids unique across client processes, so a server can tell its connections apart.
    let base = u64::from(std::process::id()) << 20;
    for i in 0..clients {
        let id = base + i;
        let mut user = USER_MAGIC.to_vec();
        user.push(if write { FLAG_WRITE } else { 0 } | if numbered { FLAG_NUMBERED } else { 0 });
        user.extend_from_slice(&id.to_be_bytes());
        let handler = BlastClient {
            id,
            size,
            count,
            write,
            iwarp: false,
            verify,
            numbered,
            in_flight: 0,
            resumed: false,
            confirmed: false,
            window,
            submitted: 0,
            completed: 0,
            ring: None,
            depth: 1,
            error: None,
            totals: totals.clone(),
            established: false,
            started: false,
            free: Vec::new(),
        };
        let opts = ConnectOptions {
            msg_size: size as u32,
            msg_count: count as u32,
            user_data: user,
            reconnect: numbered.then(|| Reconnect { attempts: reconnect, ..Reconnect::default() }),
            ..Default::default()
        };
        if let Err(e) = reactor.connect(dst, opts, handler) {
            common::die("blast", &format!("cannot connect to {dst}: {}", common::report(&e)));
        }
    }
    let start = Instant::now();
    let cpu0 = cpu_seconds();
    let mut clock = common::Clock::new();
    let mut last = (clock.elapsed_ns(), 0u64, 0u64);
    common::run_client("blast", &mut reactor, Duration::from_millis(250), &clock, |_, now| {
        if now.saturating_sub(last.0) >= 1_000_000_000 {
            let t = totals.borrow();
            let secs = now.saturating_sub(last.0) as f64 / 1e9;
            println!("blast client: {}", rate(t.bytes - last.2, t.msgs - last.1, secs));
            last = (now, t.msgs, t.bytes);
        }
    });
    let whole = start.elapsed().as_secs_f64();
    let cpu1 = cpu_seconds();
    let (user, system) = (cpu1.0 - cpu0.0, cpu1.1 - cpu0.1);
    clock.calibrate();
    let t = totals.borrow();
    // From the first message submitted to the last completed; the whole run when no message
    // completed.
    let secs = t
        .first_tick
        .filter(|_| t.msgs > 0)
        .map_or(whole, |first| clock.ns(t.last_tick.wrapping_sub(first)) as f64 / 1e9)
        .max(1e-9);
    let op = match (write, t.iwarp) {
        (true, false) => "RDMA WRITE with immediate",
        (true, true) => "RDMA WRITE + SEND (iWARP: no immediate data)",
        _ => "SEND",
    };
    println!(
        "blast client: {} messages of {size} bytes ({} bytes) by {op} over {clients} connection(s) in {secs:.3} s: {}",
        t.msgs,
        t.bytes,
        rate(t.bytes, t.msgs, secs)
    );
    println!("blast client: {whole:.3} s with connection setup and teardown (the rate above is from the first message to the last completion)");
    if t.msgs > 0 {
        let per = |s: f64| s * 1e6 / t.msgs as f64;
        println!(
            "blast client: CPU time {:.2} us per message (user {:.2} us, system {:.2} us)",
            per(user + system),
            per(user),
            per(system)
        );
    }
    if numbered {
        println!(
            "blast client: {} reconnections, {} messages sent again (the server's RESUME)",
            t.reconnected, t.resent
        );
    }
    let stats = reactor.stats();
    println!(
        "blast client: {} posts for {} work requests, {} completion events, {} acks",
        stats.post_send_calls + stats.post_recv_calls,
        stats.wrs_posted,
        stats.cq_events,
        stats.cq_ack_calls
    );
    if !t.failures.is_empty() {
        for f in &t.failures {
            eprintln!("blast client: FAILED {f}");
        }
        exit(1);
    }
    // Numbered messages may be sent more than once (resumed); the server confirmed them all.
    if t.done != clients || (t.msgs != clients * count && !numbered) {
        eprintln!("blast client: FAILED {} of {clients} connections completed, {} messages", t.done, t.msgs);
        exit(1);
    }
}
