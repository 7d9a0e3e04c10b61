//! Streams messages one way as fast as flow control allows, many connections from one thread.
//!
//! ```text
//! blast server --bind ADDR:PORT [--verify] [--depth N] [--exit-after N] [--quiet] [--spin-us N]
//!              [--srq [--srq-receives N] [--srq-credit N] [--srq-max-credit N] [--srq-reserve N] [--srq-size BYTES]]
//!              [--threads N] [--balance round-robin|fewest] [--shared-cq N]
//!              [--metrics [ADDR:]PORT [--metrics-conns] [--metrics-max-conns N]]
//!              [--ring-bytes BYTES]
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
//! The rings are registered (pinned) memory outside the pool: all of a server's rings together
//! pin at most `--ring-bytes` (default 1 GiB, [`RING_BYTES_DEFAULT`]), and a connection whose
//! ring would go beyond is refused (`RejectCode::NoResources`, which a reconnecting client
//! tries again).
//!
//! Measured as perftest measures: the client takes its message buffers when each connection
//! is established, starts sending once every connection is, and reports the rate from the
//! first message submitted to the last completed (its CPU time per message covers the whole
//! run). Its defaults are perftest's too: 128 messages in flight per connection, up to 512
//! receives posted per connection, polling while messages flow (`--spin-us 1000`), and one CQ
//! for all of a client's connections.
//!
//! # Reconnecting clients (`--reconnect`): numbered messages and `RESUME`
//!
//! A SEND's completion does not say the server's application got the message (on iWARP it
//! means handed to TCP), so only the server can say which messages a failure lost. With
//! `--reconnect` each message carries its number (`common::fill_numbered`), and the server
//! keeps, per client, which numbers arrived over all of that client's connections to the
//! reactor ([`Coverage`]). When a connection is established, and when the last message
//! arrives, it sends [`RESUME`] and the first number it lacks; the client (re)sends from
//! there and finishes only once told it has them all.
//!
//! That state outlives connections, so it is bound to the client that earned it: each client
//! connection draws a random 64-bit id and a random 128-bit key (`/dev/urandom`) and sends
//! both in its connect information. The id names the client in the server's lines; the key is
//! never printed. The server keeps a client's coverage under its id together with the key its
//! first connection gave, and refuses (`RejectCode::Refused`) a connection that names the id
//! with another key or another message count, before it is told anything of it (the key is
//! checked first, in time that does not depend on the bytes): another client can
//! neither read where someone else resumes nor mark someone else's messages as arrived (which
//! would make its victim stop early and lose them). Random ids also keep the clients of two
//! hosts apart. Nothing on the wire is encrypted: a peer that sees a client's connect
//! information can still claim its id.
//!
//! What a client's numbers may cost the server is bounded:
//!
//! - a numbered client states its message count (1 to 2^32 - 1) and sends messages of at least
//!   8 bytes by SEND; a number at or past its count closes that connection with a `FAILED`
//!   line naming it;
//! - a coverage is every message below the first missing one plus, one bit each, the next
//!   [`AHEAD_MAX`] (at most 8 KiB, whatever the count); a message further ahead is not
//!   recorded, and the server sends `RESUME` with the first missing number again, from where
//!   the client sends them again (an honest client gets that far ahead only with a `--window`
//!   about that large, or when about that many messages that had completed at it were lost:
//!   on iWARP a completion means handed to TCP);
//! - at most one `RESUME` per connection is in flight, the latest value waiting behind it;
//! - a reactor keeps the coverage of at most [`RESUMABLE_MAX`] clients: when a new one comes
//!   and the table is full, the entry of a client with no connection, unused the longest,
//!   goes (should that client come back, it is told to resume at 0 and sends everything
//!   again: nothing is lost); with every entry in use the new client is refused
//!   (`RejectCode::NoResources`).
//!
//! The client, for its part, refuses a server's numbers that cannot be true: a `RESUME` past
//! the messages it has sent, a message longer than its receive buffer, a ring descriptor with
//! fewer slots than the server's credit. It closes that connection and exits with an error.

mod common;

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::process::exit;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
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
usage: blast server --bind ADDR:PORT [--verify] [--depth N] [--max-size BYTES] [--exit-after N] [--quiet]
                    [--spin-us N] [--srq [--srq-receives N] [--srq-credit N] [--srq-max-credit N] [--srq-reserve N] [--srq-size BYTES]]
                    [--threads N] [--balance round-robin|fewest] [--shared-cq N]
                    [--metrics [ADDR:]PORT [--metrics-conns] [--metrics-max-conns N]]
                    [--ring-bytes BYTES]
       blast client --connect ADDR:PORT --size BYTES --count N [--clients K]
                    [--op send|write] [--verify] [--window N] [--spin-us N] [--shared-cq N]
                    [--reconnect N]

server: receives from any number of clients at once, from one thread.
  --bind ADDR:PORT   address of an RDMA device to listen on
  --verify           check every byte of every message
  --depth N          receives posted per connection: the credit window (minimum 3; default:
                     by message size, about 8 MiB of buffers, 16 to 512: 512 up to 16 KiB)
  --max-size BYTES   the largest message size a client may use (suffixes K, M; default 1M,
                     at most 1M; Config::msg_size): a client whose --size is larger is refused,
                     so receives are never sized by a client's claim alone
  --exit-after N     exit after N connections have closed (default: run until killed)
  --threads N        reactors, one per thread (default 1); the first listens and spreads the
                     connections over all; at exit each prints what it served
  --balance B        how: round-robin (default) or fewest (live connections)
  --metrics [ADDR:]PORT serve GET /metrics (Prometheus text: the reactor's counters) on a TCP
                     port, from the reactor's thread; reactor i of --threads on PORT + i.
                     A bare PORT is 127.0.0.1:PORT (this host only): any other address
                     exposes the counters to whoever can reach it on the network
  --metrics-conns    each connection's counters too, labelled with its peer's address:
                     13 samples a connection per scrape, built on the reactor's thread,
                     and every client's address told to whoever scrapes (default: off)
  --metrics-max-conns N HTTP connections held at once (default 64); one not done 10 s after
                     it was accepted is closed at the next accept; at the cap a newcomer is
                     closed at once
  --ring-bytes BYTES the most the --op write rings of all connections pin together (suffixes
                     K, M, G; default 1G): a connection whose ring would go beyond is refused
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
                     backoff from 100 ms, give up after 60 s; --op send only, --count at most
                     4294967295). Messages carry their number; on each connection the server
                     says where to resume (the first message it lacks) and, once it has them
                     all, that the client is done: the count finishes over as many connections
                     as it takes, nothing lost (a SEND's completion does not say the server's
                     application got it). What the server keeps of a client is bound to a
                     random id and a secret key the client draws";

/// Connect-information user bytes: magic, flags (`FLAG_WRITE`, `FLAG_NUMBERED`), client id
/// (8 bytes, big endian), and with `FLAG_NUMBERED` the client's key ([`KEY_LEN`] bytes): 29
/// bytes of the 36 the connect information leaves.
const USER_MAGIC: &[u8; 4] = b"BLST";
/// Bytes of a reconnecting client's key: what binds its state at the server to it.
const KEY_LEN: usize = 16;
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
/// Also sent again, mid-connection, when a message arrives too far ahead ([`Seen::Beyond`]).
const RESUME: &[u8; 4] = b"RSUM";
/// The `user_data` of the server's `RESUME` sends: their completions free the next one.
const RESUME_SENT: u64 = 1;

fn main() {
    common::observe::init_logging("blast");
    let mut argv = std::env::args().skip(1);
    match argv.next().as_deref() {
        Some("server") => server(Args::parse(argv, &["verify", "quiet", "srq", "metrics-conns"], USAGE)),
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
    numbered: Resumable,
}

/// A [`RESUME`] message for `next`.
fn resume_message(conn: &mut Conn<'_>, next: u64) -> Result<Op, String> {
    let mut b = conn.alloc(12).map_err(|e| format!("resume buffer: {}", common::report(&e)))?;
    let mut bytes = RESUME.to_vec();
    bytes.extend_from_slice(&next.to_le_bytes());
    b.fill_from(&bytes).expect("12 bytes fit");
    Ok(Op::send(b).user_data(RESUME_SENT))
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
    /// `--max-size`: the largest message size a client may claim (`Config::msg_size`).
    max_size: usize,
    /// On a shared receive queue: the runtime posts the receives.
    srq: bool,
    verify: bool,
    quiet: bool,
    /// `--ring-bytes`: what the `--op write` rings of every reactor of the server pin together.
    rings: Arc<RingBudget>,
    totals: Rc<RefCell<Totals>>,
    ticking: bool,
    last_tick: Instant,
}

/// Refuses a connect request with `code` and `text`, and says so (the listener's `on_refused`
/// hears only the reactor's own refusals).
fn refuse(req: &ConnectRequest, code: RejectCode, text: String) -> Decision {
    eprintln!("blast server: refused {}: {text}", req.peer.map_or("?".into(), |p| p.to_string()));
    Decision::Reject(RejectReason::new(code, text))
}

impl ListenerHandler for BlastListener {
    fn on_connect_request(&mut self, ctx: &mut Ctx<'_>, req: &ConnectRequest) -> Decision {
        let Some(info) = req.info.as_ref() else {
            return refuse(req, RejectCode::Unsupported, "blast needs a blast client".into());
        };
        let hello = match Hello::parse(&info.user) {
            Ok(h) => h,
            Err(e) => return refuse(req, RejectCode::Unsupported, e),
        };
        let size = info.msg_size as usize;
        if size == 0 {
            return refuse(req, RejectCode::Unsupported, "message size 0".into());
        }
        if size > self.max_size {
            // blast's messages are all of the claimed size: receives of the smaller one the
            // reactor would announce could not hold them.
            let text = format!("message size {size} exceeds this server's --max-size {}", self.max_size);
            return refuse(req, RejectCode::Unsupported, text);
        }
        let base = if self.auto { auto_depth(size) } else { self.depth };
        let depth = if hello.write { base.min((RING_MAX / size) as u32) } else { base };
        if depth < 3 || (self.srq && depth < self.depth) {
            let text = format!("message size {size} leaves only {depth} ring slots");
            return refuse(req, RejectCode::Unsupported, text);
        }
        let lease = if hello.write {
            match self.rings.lease(u64::from(depth) * size as u64) {
                Ok(l) => Some(l),
                Err(e) => return refuse(req, RejectCode::NoResources, e),
            }
        } else {
            None
        };
        let cov = match hello.key {
            Some(key) => {
                if let Err(e) = numbered_terms(size, info.msg_count, hello.write) {
                    return refuse(req, RejectCode::Unsupported, format!("client {}: {e}", hello.id));
                }
                match self.totals.borrow_mut().numbered.claim(hello.id, &key, u64::from(info.msg_count)) {
                    Ok(c) => Some(c),
                    Err(Unclaimed::Full(e)) => return refuse(req, RejectCode::NoResources, e),
                    Err(Unclaimed::NotYours(e)) => return refuse(req, RejectCode::Refused, e),
                }
            }
            None => None,
        };
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
            write: hello.write,
            cov,
            resume: Announcer::default(),
            client_id: hello.id,
            verify: self.verify,
            quiet: self.quiet,
            ring: None,
            _lease: lease,
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
    /// Its client reconnects (`FLAG_NUMBERED`): which numbered messages arrived over all of
    /// the client's connections to this reactor. Held here, the table never lets it go while
    /// the connection lives.
    cov: Option<Rc<RefCell<Coverage>>>,
    /// Numbered: the `RESUME` messages of this connection, one in flight at a time.
    resume: Announcer,
    client_id: u64,
    verify: bool,
    quiet: bool,
    /// With `--op write`: the ring, application memory of `depth` slots, and its window.
    ring: Option<(Region, RegionWindow)>,
    /// With `--op write`: the ring's share of `--ring-bytes`, given back when the agent is
    /// dropped, after the ring (also when the reactor drops an accepted agent without a
    /// callback: no queue pair for it).
    _lease: Option<RingLease>,
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

    /// Tells a numbered client to (re)send from message `next` (`RESUME`): now, or once the
    /// one in flight has completed.
    fn announce(&mut self, conn: &mut Conn<'_>, next: u64) {
        if let Some(next) = self.resume.want(next) {
            self.send_resume(conn, next);
        }
    }

    fn send_resume(&mut self, conn: &mut Conn<'_>, next: u64) {
        match resume_message(conn, next) {
            Ok(op) => {
                if let Err(e) = conn.submit(op) {
                    self.fail(conn, format!("send the resume point: {}", e.error));
                }
            }
            Err(e) => self.fail(conn, e),
        }
    }

    /// A numbered message arrived: records it; says where to resume when it completes the
    /// count or came too far ahead. `Err` closes the connection.
    fn numbered(&mut self, conn: &mut Conn<'_>, cov: &RefCell<Coverage>, data: &[u8]) -> Result<(), String> {
        // Checked by its own number, which may repeat or skip ahead (a reconnecting client
        // resends what it could not confirm).
        let seq = match common::check_numbered(data, self.client_id) {
            Ok(seq) => seq,
            Err(at) if self.verify || at < 8 => return Err(format!("message {}: byte {at} differs", self.seq)),
            Err(_) => u64::from_le_bytes(data[..8].try_into().expect("8 bytes")),
        };
        let (seen, floor, complete) = {
            let mut cov = cov.borrow_mut();
            let before = cov.floor;
            let seen = cov.record(seq)?;
            (seen, cov.floor, before < cov.expected && cov.floor >= cov.expected)
        };
        if complete || seen == Seen::Beyond {
            // Every message is here: the client may finish. Or one came too far ahead to be
            // kept: the client sends again from the first missing one.
            self.announce(conn, floor);
        }
        Ok(())
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
        if let Some(next) = self.cov.as_ref().map(|c| c.borrow().floor) {
            // Where the client resumes: the first message this reactor has not received
            // from it (0 for a new client, or after this server was restarted).
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
                if let Some(cov) = self.cov.clone() {
                    if let Err(e) = self.numbered(conn, &cov, buf.as_slice()) {
                        return self.fail(conn, e);
                    }
                } else if self.verify {
                    let bad = if c.remote_write || notice {
                        // A WRITE with immediate on a SEND connection (a zero-length one
                        // needs no key), or one before the ring was made: no ring to read.
                        let Some((ring, _)) = self.ring.as_ref() else {
                            return self.fail(conn, format!("message {}: a WRITE, and no ring to write", self.seq));
                        };
                        let slot = (self.seq % u64::from(self.depth)) as usize * self.size;
                        let mut data = vec![0u8; self.size];
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
            (OpCode::Send, result) if c.user_data == RESUME_SENT => {
                // The RESUME in flight is done: the latest one that waited behind it goes.
                let waiting = self.resume.sent();
                match result {
                    Ok(_) => {
                        if let Some(next) = waiting {
                            self.send_resume(conn, next);
                        }
                    }
                    Err(OpError::Wc(WcStatus::WrFlushErr) | OpError::Cancelled) => {}
                    Err(e) => self.fail(conn, format!("Send failed: {}", common::report(&e))),
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
        if let Some(cov) = &self.cov {
            // Judged over all of the client's connections, when it closes one cleanly (at the
            // end of its count): every message from the first this reactor saw has arrived.
            // Connections that failed are the reason it reconnects, not a failure of the run.
            // Whether they all came is the client's to judge (it finishes only when told so):
            // a connection that ended first, cleanly or not, is why it reconnects.
            let mut cov = cov.borrow_mut();
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
        let numbered = self.cov.is_some();
        let failed = self.error.is_some() || (!reason.is_clean() && !numbered);
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

/// `--ring-bytes` by default: what the `--op write` rings of all of a server's connections pin
/// together (16 of the largest rings, 128 of the 8 MiB ones of 64 KiB messages).
const RING_BYTES_DEFAULT: u64 = 1 << 30;

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

/// The default pool's chunk that holds a message of `size` bytes (what a receive pins).
fn chunk_of(size: usize) -> usize {
    let pool = rdma_reactor::PoolConfig::default();
    pool.chunk_sizes.iter().copied().find(|c| *c >= size).unwrap_or(size)
}

/// `--shared-cq N`: every connection of the reactor on one CQ of N entries (`Config::shared_cq`).
fn shared_cq(args: &Args) -> Option<u32> {
    Some(args.get("shared-cq", 0u32)).filter(|n| *n > 0)
}

fn server(args: Args) {
    let own = ["bind", "depth", "max-size", "exit-after", "spin-us", "threads", "balance", "shared-cq", "ring-bytes"];
    args.finish(&[&own[..], &Args::LIVENESS[..], &Args::SRQ[..], &Args::METRICS[..]].concat());
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
    let rings = Arc::new(RingBudget::new(args.size("ring-bytes", RING_BYTES_DEFAULT as usize) as u64));
    let max_size = args.size("max-size", 1024 * 1024);
    if !(1..=1024 * 1024).contains(&max_size) {
        common::fail(USAGE, "--max-size must be 1 to 1M bytes");
    }
    let srq = args.srq();
    // On a shared receive queue each connection's credit window starts at the SRQ's credit
    // and may grow to its maximum (credit that follows activity): a write ring needs a slot for
    // each.
    let depth = srq.map_or(depth, |s| s.credit);
    let slots = srq.map_or(depth, |s| s.max_credit.max(s.credit));
    let cfg = args.with_srq(args.liveness(Config {
        recv_depth: depth,
        msg_size: max_size as u32,
        // The reactor's budget counts the queue pair's whole receive depth (512 without
        // --depth); blast posts fewer of large messages (`auto_depth`: about 8 MiB of buffers,
        // 16 receives of 512 KiB and more), so it allows what --depth and --max-size allow.
        recv_budget: (depth as usize).saturating_mul(chunk_of(max_size)),
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
        max_size,
        srq: on_srq,
        verify,
        quiet,
        rings: rings.clone(),
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
            numbered: Resumable::new(RESUMABLE_MAX),
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
    /// Numbered: messages sent, over all connections (the highest number submitted, plus one):
    /// a `RESUME` past it is not the truth.
    high: u64,
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
                    // `depth` slots of `size` fit the ring's u32 length (`ring_slots`).
                    let slot = (seq % self.depth) as u32 * self.size as u32;
                    let Some(dst) = ring.slice(slot, self.size as u32) else {
                        return self.fail(conn, format!("message {seq}: slot {slot} outside the server's ring"));
                    };
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
            self.high = self.high.max(self.submitted);
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
                let data = match received(buf.as_slice(), n) {
                    Ok(d) => d,
                    Err(e) => return self.fail(conn, e),
                };
                if self.write && self.ring.is_none() {
                    // A slot for each message in flight: the server sizes its ring for the most
                    // credit it may grant (more than its advertised depth on a shared receive
                    // queue, whose credit follows activity).
                    let ring = RemoteSlice::decode(data)
                        .ok_or_else(|| format!("a ring descriptor of {} bytes from the server", data.len()))
                        .and_then(|r| Ok((r, ring_slots(r.len, self.depth, self.size)?)));
                    match ring {
                        Ok((r, slots)) => {
                            self.depth = slots;
                            self.ring = Some(r);
                        }
                        Err(e) => return self.fail(conn, format!("bad ring descriptor from the server: {e}")),
                    }
                }
                if self.numbered {
                    let Some(next) = resume_of(data) else {
                        return self.fail(conn, "a message from the server that is not RESUME".into());
                    };
                    match resume_point(next, self.high, self.count) {
                        Err(e) => return self.fail(conn, e),
                        Ok(None) => {
                            self.confirmed = true;
                            return conn.close();
                        }
                        Ok(Some(next)) => {
                            if next < self.submitted {
                                self.totals.borrow_mut().resent += self.submitted - next;
                                println!("blast client: connection {}: resuming at message {next}", self.id);
                            }
                            self.submitted = next;
                            self.resumed = true;
                        }
                    }
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
    // The connect information states the count in 32 bits: a larger one is not stated (0).
    let stated = u32::try_from(count).unwrap_or(0);
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
    if numbered && (count == 0 || stated == 0) {
        common::fail(USAGE, "--reconnect takes a --count of 1 to 4294967295 (the server counts the messages it has)");
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
    for _ in 0..clients {
        // Random, so that no one guesses them and clients of two hosts do not share one; with
        // --reconnect a secret key too, which binds the server's state of this client to it
        // (the module docs).
        let id = u64::from_le_bytes(random_bytes());
        let hello = Hello { write, id, key: numbered.then(random_bytes) };
        let user = hello.encode();
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
            high: 0,
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
            msg_count: stated,
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

// ----- what a peer's numbers may do: pure bookkeeping, unit-tested ----------------------------

/// How far past the first missing message a reconnecting client's messages are recorded: one
/// bit each, so a coverage holds at most 8 KiB whatever numbers its client sends.
const AHEAD_MAX: u64 = 1 << 16;

/// The reconnecting clients whose coverage one reactor keeps (each at most about 8 KiB).
const RESUMABLE_MAX: usize = 1024;

/// A client's connect information ([`USER_MAGIC`]).
#[derive(Debug, PartialEq, Eq)]
struct Hello {
    write: bool,
    id: u64,
    /// `FLAG_NUMBERED`: the client's key.
    key: Option<[u8; KEY_LEN]>,
}

impl Hello {
    fn encode(&self) -> Vec<u8> {
        let mut user = USER_MAGIC.to_vec();
        user.push(if self.write { FLAG_WRITE } else { 0 } | if self.key.is_some() { FLAG_NUMBERED } else { 0 });
        user.extend_from_slice(&self.id.to_be_bytes());
        user.extend_from_slice(self.key.as_ref().map_or(&[][..], |k| &k[..]));
        user
    }

    fn parse(user: &[u8]) -> Result<Hello, String> {
        if user.len() < 13 || &user[..4] != USER_MAGIC {
            return Err("not a blast client".into());
        }
        let id = u64::from_be_bytes(user[5..13].try_into().expect("8 bytes"));
        let key = if user[4] & FLAG_NUMBERED != 0 {
            let Some(key) = user.get(13..13 + KEY_LEN) else {
                return Err(format!("client {id}: numbered messages and no key (a blast client of before the key)"));
            };
            Some(key.try_into().expect("KEY_LEN bytes"))
        } else {
            None
        };
        Ok(Hello { write: user[4] & FLAG_WRITE != 0, id, key })
    }
}

/// What a numbered client must state to be served: a count (the server records numbers up to
/// it, and refuses any past it) and messages that hold their number, by SEND.
fn numbered_terms(size: usize, count: u32, write: bool) -> Result<(), String> {
    if count == 0 {
        return Err("numbered messages and no count: the server needs to know where they end".into());
    }
    if size < 8 {
        return Err(format!("numbered messages of {size} bytes: a number takes 8"));
    }
    if write {
        return Err("numbered messages by RDMA WRITE: --reconnect takes --op send".into());
    }
    Ok(())
}

/// Which numbered messages of one reconnecting client arrived: every one below `floor`, and
/// of the [`AHEAD_MAX`] after it those marked in `ahead`. Its memory does not depend on the
/// client's numbers.
struct Coverage {
    /// The key the client's first connection gave: later ones must give it too.
    key: [u8; KEY_LEN],
    /// The client's message count: every number is below it.
    expected: u64,
    /// The first message not received: every one before it was.
    floor: u64,
    /// Bit `i` of word `w`: message `base + 64 w + i` arrived. One word while messages come
    /// in order.
    ahead: VecDeque<u64>,
    /// `floor` rounded down to a multiple of 64: the number of `ahead`'s first bit.
    base: u64,
    duplicates: u64,
    connections: u64,
    /// When a connection last claimed it, by [`Resumable`]'s clock.
    used: u64,
}

/// What [`Coverage::record`] made of a message number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Seen {
    /// Its first arrival: recorded.
    New,
    /// It had arrived before (the client sent it again).
    Again,
    /// [`AHEAD_MAX`] or more past the first missing one: not recorded. The client must send it
    /// again (the server tells it to resume at the floor).
    Beyond,
}

impl Coverage {
    fn new(key: [u8; KEY_LEN], expected: u64) -> Coverage {
        Coverage { key, expected, floor: 0, ahead: VecDeque::new(), base: 0, duplicates: 0, connections: 0, used: 0 }
    }

    /// Records message `seq`; `Err` for a number the client cannot have sent (at or past its
    /// count), which closes its connection.
    fn record(&mut self, seq: u64) -> Result<Seen, String> {
        if seq >= self.expected {
            return Err(format!("message number {seq} of {}", self.expected));
        }
        if seq < self.floor {
            self.duplicates += 1;
            return Ok(Seen::Again);
        }
        if seq - self.floor >= AHEAD_MAX {
            return Ok(Seen::Beyond);
        }
        // Below floor + AHEAD_MAX, so the word is below (63 + AHEAD_MAX) / 64.
        let at = seq - self.base;
        let (word, bit) = ((at / 64) as usize, 1u64 << (at % 64));
        if self.ahead.len() <= word {
            self.ahead.resize(word + 1, 0);
        }
        if self.ahead[word] & bit != 0 {
            self.duplicates += 1;
            return Ok(Seen::Again);
        }
        self.ahead[word] |= bit;
        // Up over every message now received in a row; words wholly below the floor go.
        while let Some(&w) = self.ahead.front() {
            let off = self.floor - self.base;
            self.floor += u64::from((!(w >> off)).trailing_zeros());
            if self.floor - self.base < 64 {
                break;
            }
            self.ahead.pop_front();
            self.base += 64;
        }
        Ok(Seen::New)
    }
}

/// Why [`Resumable::claim`] gave no coverage.
#[derive(Debug, PartialEq, Eq)]
enum Unclaimed {
    /// The id is another client's (another key, or another count): refused for good.
    NotYours(String),
    /// The table is full of clients with a connection: refused for now.
    Full(String),
}

/// The coverage of each reconnecting client, by id, bound to the key its first connection
/// gave; at most `max` of them.
struct Resumable {
    max: usize,
    /// Counts claims: the idle entry claimed longest ago goes first.
    clock: u64,
    clients: HashMap<u64, Rc<RefCell<Coverage>>>,
}

impl Resumable {
    fn new(max: usize) -> Resumable {
        Resumable { max, clock: 0, clients: HashMap::new() }
    }

    /// The coverage of client `id` for a connection that gives `key` and `expected`: the one
    /// kept if the key and count are those it was made with, else a new one. While the
    /// connection holds it (the agent), no other claim evicts it.
    fn claim(&mut self, id: u64, key: &[u8; KEY_LEN], expected: u64) -> Result<Rc<RefCell<Coverage>>, Unclaimed> {
        self.clock += 1;
        if let Some(c) = self.clients.get(&id) {
            let mut cov = c.borrow_mut();
            if !same_key(&cov.key, key) {
                return Err(Unclaimed::NotYours(format!("client {id}: not the key its first connection gave")));
            }
            if cov.expected != expected {
                let text =
                    format!("client {id}: {expected} messages, where its first connection said {}", cov.expected);
                return Err(Unclaimed::NotYours(text));
            }
            cov.used = self.clock;
            drop(cov);
            return Ok(c.clone());
        }
        if self.clients.len() >= self.max {
            // Only this table holds an idle one's coverage.
            let idle =
                self.clients.iter().filter(|(_, c)| Rc::strong_count(c) == 1).min_by_key(|(_, c)| c.borrow().used);
            let Some(old) = idle.map(|(old, _)| *old) else {
                return Err(Unclaimed::Full(format!(
                    "{} reconnecting clients connected: no room for another",
                    self.max
                )));
            };
            self.clients.remove(&old);
        }
        let mut cov = Coverage::new(*key, expected);
        cov.used = self.clock;
        let c = Rc::new(RefCell::new(cov));
        self.clients.insert(id, c.clone());
        Ok(c)
    }
}

/// Keys compared in time that does not depend on where they differ: a client probing ids
/// learns nothing from how fast it is refused.
fn same_key(a: &[u8; KEY_LEN], b: &[u8; KEY_LEN]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The `RESUME` messages of one connection: one in flight at a time, so a client whose
/// messages keep asking for one cannot pile them up in the send queue; the latest value waits
/// behind it, and a value already announced is not sent again.
#[derive(Debug, Default)]
struct Announcer {
    /// The last value sent or waiting.
    last: Option<u64>,
    busy: bool,
    waiting: bool,
}

impl Announcer {
    /// `next` is where the client should resume: the value to send now, if any.
    fn want(&mut self, next: u64) -> Option<u64> {
        if self.last == Some(next) {
            return None;
        }
        self.last = Some(next);
        if self.busy {
            self.waiting = true;
            return None;
        }
        self.busy = true;
        Some(next)
    }

    /// The one in flight completed: the value to send now, if one waited.
    fn sent(&mut self) -> Option<u64> {
        self.busy = std::mem::take(&mut self.waiting);
        if self.busy {
            self.last
        } else {
            None
        }
    }
}

/// The bytes of `--op write` rings pinned by every connection of a server, and `--ring-bytes`.
struct RingBudget {
    max: u64,
    used: AtomicU64,
}

/// A ring's share of the [`RingBudget`], given back when dropped.
struct RingLease {
    budget: Arc<RingBudget>,
    bytes: u64,
}

impl RingBudget {
    fn new(max: u64) -> RingBudget {
        RingBudget { max, used: AtomicU64::new(0) }
    }

    /// `bytes` more, if they fit under the cap.
    fn lease(self: &Arc<Self>, bytes: u64) -> Result<RingLease, String> {
        let fits = |used: u64| used.checked_add(bytes).filter(|total| *total <= self.max);
        match self.used.fetch_update(Ordering::AcqRel, Ordering::Acquire, fits) {
            Ok(_) => Ok(RingLease { budget: self.clone(), bytes }),
            Err(used) => Err(format!(
                "a write ring of {bytes} bytes: the rings pin {used} of at most {} bytes (--ring-bytes)",
                self.max
            )),
        }
    }
}

impl Drop for RingLease {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// The bytes of a receive that completed with `n`: the device may report more than the buffer
/// holds (on iWARP a message may run into the receive's slack), which is a message too long.
fn received(data: &[u8], n: u32) -> Result<&[u8], String> {
    data.get(..n as usize)
        .ok_or_else(|| format!("a message of {n} bytes from the server, into a buffer of {}", data.len()))
}

/// The slots of `size` bytes in a server's ring of `len` bytes, which must hold one for each
/// message the server's credit (`depth`, at least 1) lets the client have in flight.
fn ring_slots(len: u32, depth: u64, size: usize) -> Result<u64, String> {
    let slots = u64::from(len) / size.max(1) as u64;
    if slots == 0 || slots < depth {
        return Err(format!(
            "a ring of {len} bytes holds {slots} messages of {size} bytes, fewer than its credit {depth}"
        ));
    }
    Ok(slots)
}

/// A server's `RESUME` at `next`, to a client that has sent `high` of its `count` messages:
/// `None` when the server has them all, else where to resume. A server cannot have a message
/// the client has not sent.
fn resume_point(next: u64, high: u64, count: u64) -> Result<Option<u64>, String> {
    if next > high {
        return Err(format!("the server says resume at message {next}, and {high} have been sent"));
    }
    Ok((next < count).then_some(next))
}

/// `N` random bytes from the kernel (`/dev/urandom`); exits if there are none.
fn random_bytes<const N: usize>() -> [u8; N] {
    use std::io::Read;
    let mut b = [0u8; N];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .unwrap_or_else(|e| common::die("blast", &format!("no random bytes for the client's id and key: {e}")));
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic stream of numbers (xorshift): the tests' schedules.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
    }

    const KEY: [u8; KEY_LEN] = [7; KEY_LEN];

    /// The review's H1: one message numbered u64::MAX (or 2^40) made `record` index past its
    /// vector (a panic out of `run`) or allocate a terabyte (an abort). Every number at or past
    /// the count is refused, and the count is at most u32::MAX.
    #[test]
    fn a_number_at_or_past_the_count_is_refused_not_a_panic() {
        let mut cov = Coverage::new(KEY, u64::from(u32::MAX));
        for seq in [u64::MAX, u64::MAX - 1, 1 << 40, 1 << 32, u64::from(u32::MAX)] {
            assert!(cov.record(seq).is_err(), "{seq}");
        }
        let mut small = Coverage::new(KEY, 10);
        assert_eq!(small.record(10), Err("message number 10 of 10".to_string()));
        assert_eq!(small.record(9), Ok(Seen::New));
        assert!(cov.ahead.is_empty() && small.ahead.len() == 1, "nothing was allocated for the refused numbers");
    }

    /// A number far inside a huge count but far ahead of the floor costs nothing: not recorded,
    /// the client is sent back to the floor.
    #[test]
    fn a_number_far_ahead_is_not_recorded_and_memory_stays_bounded() {
        let mut cov = Coverage::new(KEY, u64::from(u32::MAX));
        assert_eq!(cov.record(u64::from(u32::MAX) - 1), Ok(Seen::Beyond));
        assert_eq!(cov.record(AHEAD_MAX), Ok(Seen::Beyond));
        assert!(cov.ahead.is_empty());
        assert_eq!(cov.record(AHEAD_MAX - 1), Ok(Seen::New), "the last one inside the window");
        assert!(cov.ahead.len() as u64 <= AHEAD_MAX / 64 + 1, "{} words", cov.ahead.len());
        assert_eq!(cov.floor, 0);
        assert_eq!(cov.record(AHEAD_MAX), Ok(Seen::Beyond), "still too far from the floor");
        for seq in 0..AHEAD_MAX - 1 {
            assert_eq!(cov.record(seq), Ok(Seen::New));
        }
        assert_eq!(cov.floor, AHEAD_MAX, "the floor went up over the one recorded ahead");
        assert!(cov.ahead.len() <= 1);
        assert_eq!(cov.record(AHEAD_MAX), Ok(Seen::New), "inside the window now");
        assert_eq!((cov.floor, cov.duplicates), (AHEAD_MAX + 1, 0));
    }

    /// In order, as a client sends: the floor follows, one word of bits at most.
    #[test]
    fn messages_in_order_raise_the_floor_in_one_word() {
        let mut cov = Coverage::new(KEY, 1000);
        for seq in 0..1000 {
            assert_eq!(cov.record(seq), Ok(Seen::New));
            assert_eq!(cov.floor, seq + 1);
            assert!(cov.ahead.len() <= 1);
        }
        assert_eq!(cov.record(0), Ok(Seen::Again));
        assert_eq!(cov.record(999), Ok(Seen::Again));
        assert_eq!(cov.duplicates, 2);
    }

    /// Resends and messages ahead in a random order, against a set of what arrived: the floor
    /// is the first number missing from it, duplicates are counted, numbers beyond the window
    /// are left out, and the bits never exceed the window.
    #[test]
    fn coverage_agrees_with_a_set_of_what_arrived() {
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        for round in 0..20u64 {
            let expected = 1 + rng.below(300_000);
            let mut cov = Coverage::new(KEY, expected);
            let mut set = std::collections::BTreeSet::new();
            let (mut floor, mut duplicates) = (0, 0);
            for _ in 0..3_000 {
                // Mostly near the floor (a client's window, a resend), sometimes anywhere.
                let seq = match rng.below(4) {
                    0 => rng.below(expected),
                    _ => (cov.floor + rng.below(300)).saturating_sub(100).min(expected - 1),
                };
                let want = if seq >= cov.floor + AHEAD_MAX {
                    Seen::Beyond
                } else if set.insert(seq) {
                    Seen::New
                } else {
                    duplicates += 1;
                    Seen::Again
                };
                assert_eq!(cov.record(seq), Ok(want), "round {round}, message {seq}");
                while set.contains(&floor) {
                    floor += 1;
                }
                assert_eq!(cov.floor, floor, "round {round}");
                assert_eq!(cov.duplicates, duplicates);
                assert!(cov.ahead.len() as u64 <= AHEAD_MAX / 64 + 1);
                assert_eq!(cov.base, cov.floor / 64 * 64);
            }
        }
    }

    /// The protocol, both ends modelled on one connection (RC keeps each direction in order):
    /// a client that reconnects with messages carried over from far past the server's floor
    /// (many that had completed at it were lost, as on iWARP) finishes its count, told so once,
    /// and never more than one RESUME is in flight.
    #[test]
    fn a_client_sent_back_from_far_ahead_finishes_its_count() {
        let (count, window, floor, carried) = (4 * AHEAD_MAX, 128, 1_000, 3 * AHEAD_MAX);
        let mut cov = Coverage::new(KEY, count);
        for seq in 0..floor {
            cov.record(seq).expect("the first connection's");
        }
        // The second connection: the carried-over messages are on the wire before the
        // client has heard where to resume.
        let mut to_server: VecDeque<u64> = (carried..carried + window).collect();
        let (mut submitted, mut high, mut resumed, mut done) = (carried + window, carried + window, false, false);
        let mut to_client = VecDeque::new();
        let mut announcer = Announcer::default();
        to_client.extend(announcer.want(cov.floor));
        let mut steps = 0;
        while !done {
            steps += 1;
            assert!(steps < 10 * count, "no progress: floor {}, submitted {submitted}", cov.floor);
            if resumed && submitted < count && (to_server.len() as u64) < window {
                to_server.push_back(submitted);
                submitted += 1;
                high = high.max(submitted);
            }
            if let Some(seq) = to_server.pop_front() {
                let before = cov.floor;
                let seen = cov.record(seq).expect("an honest number");
                if seen == Seen::Beyond || (before < count && cov.floor >= count) {
                    to_client.extend(announcer.want(cov.floor));
                }
            }
            assert!(to_client.len() <= 1, "one RESUME in flight");
            if steps % 3 == 0 {
                if let Some(next) = to_client.pop_front() {
                    match resume_point(next, high, count).expect("true") {
                        None => done = true,
                        Some(next) => (submitted, resumed) = (next, true),
                    }
                    to_client.extend(announcer.sent());
                }
            }
        }
        assert_eq!(cov.floor, count);
        assert!(cov.ahead.len() <= 1);
    }

    #[test]
    fn a_numbered_client_states_its_count_and_sends_numbers() {
        assert!(numbered_terms(8, 0, false).unwrap_err().contains("no count"), "msg_count 0: every number accepted");
        assert!(numbered_terms(7, 10, false).is_err());
        assert!(numbered_terms(64, 10, true).is_err());
        assert_eq!(numbered_terms(8, u32::MAX, false), Ok(()));
    }

    #[test]
    fn connect_information_round_trips_and_a_numbered_one_needs_a_key() {
        for hello in [
            Hello { write: false, id: 1, key: None },
            Hello { write: true, id: u64::MAX, key: None },
            Hello { write: false, id: 42, key: Some(KEY) },
        ] {
            let user = hello.encode();
            assert!(user.len() <= 36, "fits the connect information's user bytes");
            assert_eq!(Hello::parse(&user), Ok(hello));
        }
        let mut old = Hello { write: false, id: 42, key: Some(KEY) }.encode();
        old.truncate(13);
        assert!(Hello::parse(&old).unwrap_err().contains("no key"));
        assert!(Hello::parse(b"BLST\0\0\0").is_err());
        assert!(Hello::parse(b"XLST\0\0\0\0\0\0\0\0\0").is_err());
    }

    /// The review's X2: a connection that names another client's id cannot read where it
    /// resumes or mark its messages as arrived.
    #[test]
    fn an_id_with_another_key_or_count_is_refused_and_touches_nothing() {
        let mut table = Resumable::new(4);
        let victim = table.claim(9, &KEY, 100).expect("first claim");
        for seq in 0..40 {
            victim.borrow_mut().record(seq).expect("in the count");
        }
        drop(victim);
        let mut other = KEY;
        other[KEY_LEN - 1] ^= 1;
        assert!(matches!(table.claim(9, &other, 100), Err(Unclaimed::NotYours(_))));
        assert!(matches!(table.claim(9, &KEY, 200), Err(Unclaimed::NotYours(_))));
        let again = table.claim(9, &KEY, 100).expect("the client itself");
        assert_eq!(again.borrow().floor, 40, "kept for its own key, untouched by the refused claims");
        assert!(same_key(&KEY, &KEY) && !same_key(&KEY, &other));
    }

    /// At most `max` entries: an idle one (no connection holds it), claimed longest ago, makes
    /// room; with every one held the new client is refused, for now.
    #[test]
    fn the_table_is_bounded_and_evicts_only_idle_clients() {
        let mut table = Resumable::new(3);
        let held: Vec<_> = (0..3).map(|id| table.claim(id, &KEY, 10).expect("room")).collect();
        assert!(matches!(table.claim(3, &KEY, 10), Err(Unclaimed::Full(_))));
        drop(held);
        // 1 is claimed again (now the most recent); 0 is the idle one unused longest.
        let one = table.claim(1, &KEY, 10).expect("kept");
        let three = table.claim(3, &KEY, 10).expect("room made");
        assert_eq!(table.clients.len(), 3);
        assert!(!table.clients.contains_key(&0) && table.clients.contains_key(&2));
        let four = table.claim(4, &KEY, 10).expect("2 was idle");
        assert!(!table.clients.contains_key(&2));
        assert!(matches!(table.claim(5, &KEY, 10), Err(Unclaimed::Full(_))), "1, 3, 4 are held");
        drop((one, three, four));
        for id in 100..200 {
            table.claim(id, &KEY, 10).expect("idle ones go");
            assert!(table.clients.len() <= 3);
        }
    }

    /// Numbers that keep asking for a RESUME while one is in flight leave one waiting, the
    /// latest; a value already announced is not sent again.
    #[test]
    fn one_resume_in_flight_and_the_latest_waiting() {
        let mut a = Announcer::default();
        assert_eq!(a.want(0), Some(0));
        assert_eq!(a.want(0), None);
        for next in 1..10_000 {
            assert_eq!(a.want(next), None, "one in flight");
        }
        assert_eq!(a.sent(), Some(9_999), "the latest waited");
        assert_eq!(a.want(9_999), None, "already on its way");
        assert_eq!(a.sent(), None);
        assert_eq!(a.want(10_000), Some(10_000), "nothing in flight: sent at once");
    }

    /// The review's X4: rings outside the pool had no cap.
    #[test]
    fn rings_are_counted_against_the_cap_and_given_back() {
        let budget = Arc::new(RingBudget::new(64 << 20));
        let a = budget.lease(40 << 20).expect("fits");
        assert!(budget.lease(30 << 20).err().expect("beyond the cap").contains("--ring-bytes"));
        let b = budget.lease(24 << 20).expect("exactly the cap");
        assert!(budget.lease(1).is_err());
        assert!(budget.lease(u64::MAX).is_err(), "no overflow");
        drop(a);
        let c = budget.lease(40 << 20).expect("given back");
        drop((b, c));
        assert_eq!(budget.used.load(Ordering::Relaxed), 0);
    }

    /// The review's L1/X5: `&buf.as_slice()[..n]` with a completion longer than the buffer
    /// panicked the client.
    #[test]
    fn a_message_longer_than_its_buffer_is_an_error() {
        let data = [1u8; 64];
        assert_eq!(received(&data, 16), Ok(&data[..16]));
        assert_eq!(received(&data, 64).map(<[u8]>::len), Ok(64));
        assert!(received(&data, 65).is_err());
        assert!(received(&data, u32::MAX).is_err());
    }

    /// The review's X5: a server stating receive depth 0 and a ring shorter than a message made
    /// the client's slot `seq % 0`.
    #[test]
    fn a_ring_without_a_slot_per_credit_is_refused() {
        assert!(ring_slots(100, 0, 256).is_err(), "no slot at all");
        assert!(ring_slots(4 * 256, 5, 256).is_err(), "fewer slots than credits");
        assert_eq!(ring_slots(4 * 256 + 10, 4, 256), Ok(4));
        assert_eq!(ring_slots(u32::MAX, 16, 1 << 20), Ok(4095));
    }

    /// The review's X2, at the client: a RESUME at or past its count made it report success
    /// without having sent them.
    #[test]
    fn a_resume_past_what_was_sent_is_refused() {
        assert!(resume_point(u64::MAX, 0, 100).is_err());
        assert!(resume_point(100, 50, 100).is_err(), "done, says the server, after 50 of 100");
        assert!(resume_point(51, 50, 100).is_err());
        assert_eq!(resume_point(50, 50, 100), Ok(Some(50)));
        assert_eq!(resume_point(0, 50, 100), Ok(Some(0)), "a restarted server has none");
        assert_eq!(resume_point(100, 100, 100), Ok(None), "all of them");
    }

    #[test]
    fn ids_and_keys_are_random() {
        let (a, b): ([u8; 8], [u8; 8]) = (random_bytes(), random_bytes());
        assert_ne!(a, b);
        assert_ne!(u64::from_le_bytes(a), u64::from(std::process::id()) << 20);
    }
}
