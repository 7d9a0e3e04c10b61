//! A key-value table read by one-sided RDMA READ: the table lives in one application
//! [`Region`] on the server, exposed to every client through a memory window of its own
//! (`Conn::expose_region`): N clients, one copy of the table, one registration.
//!
//! ```text
//! kv server --bind ADDR:PORT [--values N] [--value-size B] [--exit-after K] [--quiet]
//! kv client --connect ADDR:PORT [--clients K] [--count N] [--puts-every M] [--verify] [--spin-us N]
//! ```
//!
//! **Record layout** (record `k` at offset `k × (24 + B)` of the region; integers little
//! endian): `head: u64`, `seed: u64`, `value: [u8; B]`, `tail: u64`. The value of a record is
//! the byte pattern of (key, seed) (`common::fill_pattern`), so a reader can check every byte.
//!
//! **GET** is one RDMA READ of the whole record. The server may be writing it meanwhile (a
//! PUT), so the read can be torn; the record carries a version twice, a seqlock: the writer
//! sets `tail` to an odd number, writes seed and value, then sets `head`, then `tail`, to the
//! next even number; the reader, whose READ lands in address order (head first, tail last),
//! accepts a record only when `head == tail` and both are even, and otherwise reads it again
//! (counted as a retry). Any byte of a new value the reader got was written after the odd
//! `tail`, which it then reads after that byte: it cannot accept a mix.
//!
//! **PUT** is a SEND of `[b"KVP1", key: u32, seed: u64, value]` (network byte order for the
//! integers); the server applies it with the seqlock and answers `b"KVOK"`. The server checks
//! every message it gets and closes a connection that sends a malformed one.
//!
//! **Hello**: once established, the server SENDs `[b"KV01", values: u32, value_size: u32,
//! 0u32, the window's 16-byte descriptor]`, so the client needs no flag to match the table.

mod common;

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

use common::{fill_pattern, Args};
use rdma_reactor::{
    CloseReason, Completion, Config, Conn, ConnectOptions, ConnectRequest, ConnectionHandler, Ctx, Decision,
    ListenerHandler, Op, OpCode, Reactor, Region, RegionWindow, RemoteAccess, RemoteSlice, Token,
};

const USAGE: &str = "\
usage: kv server --bind ADDR:PORT [--values N] [--value-size B] [--exit-after K] [--quiet]
       kv client --connect ADDR:PORT [--clients K] [--count N] [--puts-every M] [--verify] [--spin-us N]
server: keeps a table of N values of B bytes in one registered region, exposed to each client
        through its own memory window (READ only); applies PUTs.
  --bind ADDR:PORT     listen here
  --values N           records in the table (default 1024)
  --value-size B       bytes per value, 1 to 64K (default 256)
  --exit-after K       exit after K connections have closed (default: run until killed)
  --quiet              no per-second line
client: GETs by one-sided RDMA READ (with the version check), PUTs by SEND.
  --connect ADDR:PORT  the server
  --clients K          connections from one reactor (default 1)
  --count N            GETs per connection (default 10000)
  --puts-every M       one PUT after every M GETs (default 10; 0: none)
  --verify             check every byte of every value read
  --spin-us N          spin-then-sleep polling for N us after work (default 0: event mode)";

const HELLO: &[u8; 4] = b"KV01";
const PUT: &[u8; 4] = b"KVP1";
const ACK: &[u8; 4] = b"KVOK";
const HELLO_LEN: usize = 16 + RemoteSlice::ENCODED_LEN;

/// Bytes of one record with values of `b` bytes.
fn record_len(b: usize) -> usize {
    24 + b
}

/// The largest message either side sends.
fn msg_size(b: usize) -> usize {
    (16 + b).max(HELLO_LEN)
}

fn main() {
    common::observe::init_logging("kv");
    let mut argv = std::env::args().skip(1);
    match argv.next().as_deref() {
        Some("server") => server(Args::parse(argv, &["quiet"], USAGE)),
        Some("client") => client(Args::parse(argv, &["verify"], USAGE)),
        Some("--help") | Some("-h") => println!("{USAGE}"),
        _ => common::fail(USAGE, "the first argument is `server` or `client`"),
    }
}

// ----- server -------------------------------------------------------------------------------

/// The table: one region of records, written with the seqlock.
struct Table {
    region: Region,
    values: usize,
    value_size: usize,
}

impl Table {
    fn new(values: usize, value_size: usize) -> rdma_reactor::Result<Table> {
        let region = Region::zeroed(values * record_len(value_size))?;
        let t = Table { region, values, value_size };
        let mut value = vec![0u8; value_size];
        for k in 0..values {
            fill_pattern(&mut value, k as u64, 0);
            t.write(k, 0, &value);
        }
        Ok(t)
    }

    /// Writes record `k` with the seqlock (module docs).
    fn write(&self, k: usize, seed: u64, value: &[u8]) {
        let at = k * record_len(self.value_size);
        let tail_at = at + 16 + self.value_size;
        let mut head = [0u8; 8];
        self.region.read_at(at, &mut head).expect("inside the table");
        let next = (u64::from_le_bytes(head) | 1) + 1; // the next even number
        let w = |off: usize, bytes: &[u8]| self.region.write_at(off, bytes).expect("inside the table");
        w(tail_at, &(next - 1).to_le_bytes());
        fence(Ordering::SeqCst);
        w(at + 8, &seed.to_le_bytes());
        w(at + 16, value);
        fence(Ordering::SeqCst);
        w(at, &next.to_le_bytes());
        fence(Ordering::SeqCst);
        w(tail_at, &next.to_le_bytes());
    }
}

#[derive(Default)]
struct ServerCounts {
    puts: u64,
    live: u64,
    closed: u64,
    bad: u64,
}

struct KvListener {
    table: Rc<Table>,
    counts: Rc<RefCell<ServerCounts>>,
}

impl ListenerHandler for KvListener {
    fn on_connect_request(&mut self, _ctx: &mut Ctx<'_>, _req: &ConnectRequest) -> Decision {
        Decision::Accept(Box::new(KvAgent { table: self.table.clone(), counts: self.counts.clone(), window: None }))
    }

    fn on_refused(
        &mut self,
        _ctx: &mut Ctx<'_>,
        peer: Option<std::net::SocketAddr>,
        reason: &rdma_reactor::RejectReason,
    ) {
        eprintln!("kv server: refused {}: {reason}", peer.map_or("?".into(), |p| p.to_string()));
    }
}

struct KvAgent {
    table: Rc<Table>,
    counts: Rc<RefCell<ServerCounts>>,
    /// The client's window on the table (dropped, and revoked, with the connection).
    window: Option<RegionWindow>,
}

impl KvAgent {
    fn refuse(&mut self, conn: &mut Conn<'_>, what: &str) {
        eprintln!("kv server: closing a connection: {what}");
        self.counts.borrow_mut().bad += 1;
        conn.close();
    }

    /// Applies one PUT message; false when it is malformed.
    fn put(&mut self, msg: &[u8]) -> bool {
        let b = self.table.value_size;
        if msg.len() != 16 + b || &msg[..4] != PUT {
            return false;
        }
        let key = u32::from_be_bytes(msg[4..8].try_into().expect("4 bytes")) as usize;
        if key >= self.table.values {
            return false;
        }
        let seed = u64::from_be_bytes(msg[8..16].try_into().expect("8 bytes"));
        self.table.write(key, seed, &msg[16..]);
        self.counts.borrow_mut().puts += 1;
        true
    }
}

impl ConnectionHandler for KvAgent {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        let size = msg_size(self.table.value_size);
        for _ in 0..4 {
            match conn.alloc(size) {
                Ok(b) => {
                    if let Err(e) = conn.submit(Op::recv(b)) {
                        return self.refuse(conn, &format!("post receive: {}", e.error));
                    }
                }
                Err(e) => return self.refuse(conn, &format!("buffer: {}", common::report(&e))),
            }
        }
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        self.counts.borrow_mut().live += 1;
        let table = self.table.region.slice(..).expect("the table is not empty");
        let window = match conn.expose_region(&table, RemoteAccess::READ) {
            Ok(w) => w,
            Err(e) => return self.refuse(conn, &format!("expose the table: {}", common::report(&e))),
        };
        let mut hello = Vec::with_capacity(HELLO_LEN);
        hello.extend_from_slice(HELLO);
        hello.extend_from_slice(&(self.table.values as u32).to_be_bytes());
        hello.extend_from_slice(&(self.table.value_size as u32).to_be_bytes());
        hello.extend_from_slice(&0u32.to_be_bytes());
        hello.extend_from_slice(&window.remote().encode());
        self.window = Some(window);
        let sent = conn.alloc(HELLO_LEN).and_then(|mut b| {
            b.fill_from(&hello)?;
            conn.submit(Op::send(b)).map_err(rdma_reactor::Error::from)
        });
        if let Err(e) = sent {
            self.refuse(conn, &format!("send the hello: {}", common::report(&e)));
        }
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        // Only a PUT matters here: sends complete unseen, a closing connection's flushes too.
        if let (OpCode::Recv, Ok(_)) = (c.opcode, c.result) {
            let mut buf = c.buf.expect("a receive carries its buffer");
            if !self.put(buf.as_slice()) {
                return self.refuse(conn, &format!("a malformed message of {} bytes", buf.len()));
            }
            // A fresh buffer answers; this one is posted again as a receive.
            let ack = conn.alloc(ACK.len()).and_then(|mut a| {
                a.fill_from(ACK)?;
                conn.submit(Op::send(a)).map_err(rdma_reactor::Error::from)
            });
            let cap = buf.capacity();
            let _ = buf.set_len(cap);
            let again = conn.submit(Op::recv(buf)).map_err(rdma_reactor::Error::from);
            if let Err(e) = ack.and(again) {
                self.refuse(conn, &format!("answer a PUT: {}", common::report(&e)));
            }
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        let mut c = self.counts.borrow_mut();
        c.live = c.live.saturating_sub(1);
        c.closed += 1;
        if !reason.is_clean() {
            eprintln!("kv server: a connection closed: {reason}");
        }
    }
}

fn server(args: Args) {
    args.finish(&["bind", "values", "value-size", "exit-after"]);
    let bind = args.addr("bind");
    let values: usize = args.get("values", 1024);
    let value_size = args.size("value-size", 256);
    if values == 0 || !(1..=64 * 1024).contains(&value_size) {
        common::fail(USAGE, "--values must be at least 1 and --value-size 1 to 64K");
    }
    let exit_after: u64 = args.get("exit-after", 0);
    let quiet = args.switch("quiet");
    let table = Rc::new(
        Table::new(values, value_size)
            .unwrap_or_else(|e| common::die("kv", &format!("cannot make the table: {}", common::report(&e)))),
    );
    let mut reactor =
        // The table's window on a device without memory windows (iWARP): a registration of
        // its own (Config::exposure_registration; ignored where windows exist).
        // Receives of the largest message either side sends (`msg_size`), whatever a client claims.
        Reactor::with_config(Config {
            exposure_registration: true,
            msg_size: msg_size(value_size) as u32,
            ..Config::default()
        })
            .unwrap_or_else(|e| common::die("kv", &format!("cannot start: {}", common::report(&e))));
    let counts = Rc::new(RefCell::new(ServerCounts::default()));
    reactor
        .listen(bind, KvListener { table: table.clone(), counts: counts.clone() })
        .unwrap_or_else(|e| common::die("kv", &format!("cannot listen on {bind}: {}", common::report(&e))));
    println!(
        "kv server: listening on {bind}: {values} values of {value_size} B in one region of {} B (pid {})",
        table.region.len(),
        std::process::id()
    );
    let mut last = Instant::now();
    let mut last_puts = 0;
    while exit_after == 0 || counts.borrow().closed < exit_after {
        if let Err(e) = reactor.run_once(Some(Duration::from_millis(200))) {
            common::die("kv", &format!("the reactor failed: {}", common::report(&e)));
        }
        if !quiet && last.elapsed() >= Duration::from_secs(1) {
            let c = counts.borrow();
            println!("kv server: {} live, {} PUTs/s, {} PUTs in all", c.live, c.puts - last_puts, c.puts);
            last_puts = c.puts;
            last = Instant::now();
        }
    }
    let c = counts.borrow();
    println!(
        "kv server: done: {} connections served, {} PUTs applied, {} malformed; region registrations {}",
        c.closed,
        c.puts,
        c.bad,
        table.region.registrations()
    );
    if c.bad > 0 {
        std::process::exit(1);
    }
}

// ----- client -------------------------------------------------------------------------------

#[derive(Default)]
struct Totals {
    gets: u64,
    puts: u64,
    retries: u64,
    verified: u64,
    done: u64,
    failures: Vec<String>,
    /// GET latencies in clock ticks.
    latencies: Vec<u64>,
}

/// What a client connection waits for.
enum Waiting {
    Hello,
    Get { key: usize, started: u64 },
    Ack,
}

struct KvClient {
    index: u64,
    count: u64,
    puts_every: u64,
    verify: bool,
    /// This connection's part of the client's region: one record.
    local: Region,
    local_at: usize,
    table: Option<(RemoteSlice, usize, usize)>,
    waiting: Waiting,
    gets: u64,
    rng: u64,
    totals: Rc<RefCell<Totals>>,
    finished: bool,
}

impl KvClient {
    fn fail(&mut self, conn: &mut Conn<'_>, what: String) {
        self.totals.borrow_mut().failures.push(format!("client {}: {what}", self.index));
        self.finished = true;
        conn.close();
    }

    fn next_key(&mut self, values: usize) -> usize {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng % values as u64) as usize
    }

    /// The next GET or PUT, or the close once `count` GETs are done.
    fn next(&mut self, conn: &mut Conn<'_>) {
        let Some((_, values, b)) = self.table else { return };
        if self.gets >= self.count {
            self.finished = true;
            self.totals.borrow_mut().done += 1;
            return conn.close();
        }
        let key = self.next_key(values);
        if self.puts_every > 0
            && self.gets > 0
            && self.gets % self.puts_every == 0
            && !matches!(self.waiting, Waiting::Ack)
        {
            let seed = self.rng;
            let mut msg = Vec::with_capacity(16 + b);
            msg.extend_from_slice(PUT);
            msg.extend_from_slice(&(key as u32).to_be_bytes());
            msg.extend_from_slice(&seed.to_be_bytes());
            let mut value = vec![0u8; b];
            fill_pattern(&mut value, key as u64, seed);
            msg.extend_from_slice(&value);
            self.waiting = Waiting::Ack;
            let sent = conn.alloc(msg.len()).and_then(|mut buf| {
                buf.fill_from(&msg)?;
                conn.submit(Op::send(buf)).map_err(rdma_reactor::Error::from)
            });
            if let Err(e) = sent {
                self.fail(conn, format!("PUT: {}", common::report(&e)));
            }
            return;
        }
        self.get(conn, key, common::Clock::ticks());
    }

    fn get(&mut self, conn: &mut Conn<'_>, key: usize, started: u64) {
        let Some((remote, _, b)) = self.table else { return };
        let rec = record_len(b);
        let Some(src) = remote.slice((key * rec) as u32, rec as u32) else {
            return self.fail(conn, format!("record {key} is outside the server's window"));
        };
        self.waiting = Waiting::Get { key, started };
        let read = self
            .local
            .slice(self.local_at..self.local_at + rec)
            .and_then(|dst| conn.submit(Op::read_region(dst, src)).map_err(rdma_reactor::Error::from));
        if let Err(e) = read {
            self.fail(conn, format!("GET: {}", common::report(&e)));
        }
    }

    /// A GET's record arrived in the local region: checked, retried when torn.
    fn got(&mut self, conn: &mut Conn<'_>, key: usize, started: u64) {
        let Some((_, _, b)) = self.table else { return };
        let mut rec = vec![0u8; record_len(b)];
        self.local.read_at(self.local_at, &mut rec).expect("inside the local region");
        let word = |at: usize| u64::from_le_bytes(rec[at..at + 8].try_into().expect("8 bytes"));
        let (head, seed, tail) = (word(0), word(8), word(16 + b));
        if head != tail || head % 2 == 1 {
            self.totals.borrow_mut().retries += 1;
            return self.get(conn, key, started);
        }
        let mut t = self.totals.borrow_mut();
        t.gets += 1;
        t.latencies.push(common::Clock::ticks().wrapping_sub(started));
        if self.verify {
            if common::check_pattern(&rec[16..16 + b], key as u64, seed).is_some() {
                t.failures.push(format!("client {}: record {key} (seed {seed:#x}) differs", self.index));
            } else {
                t.verified += 1;
            }
        }
        drop(t);
        self.gets += 1;
        self.next(conn);
    }
}

impl ConnectionHandler for KvClient {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        for _ in 0..4 {
            let posted =
                conn.alloc(HELLO_LEN).and_then(|b| conn.submit(Op::recv(b)).map_err(rdma_reactor::Error::from));
            if let Err(e) = posted {
                return self.fail(conn, format!("post receive: {}", common::report(&e)));
            }
        }
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        if self.finished {
            return;
        }
        match (c.opcode, c.result) {
            (OpCode::Recv, Ok(_)) => {
                let mut buf = c.buf.expect("a receive carries its buffer");
                let msg = buf.as_slice().to_vec();
                let cap = buf.capacity();
                let _ = buf.set_len(cap);
                if let Err(e) = conn.submit(Op::recv(buf)) {
                    return self.fail(conn, format!("post receive: {}", e.error));
                }
                match self.waiting {
                    Waiting::Hello if msg.len() == HELLO_LEN && &msg[..4] == HELLO => {
                        let values = u32::from_be_bytes(msg[4..8].try_into().expect("4 bytes")) as usize;
                        let b = u32::from_be_bytes(msg[8..12].try_into().expect("4 bytes")) as usize;
                        let Some(remote) = RemoteSlice::decode(&msg[16..]) else {
                            return self.fail(conn, "a hello with a malformed descriptor".into());
                        };
                        if values == 0
                            || record_len(b) > self.local.len() / 64
                            || values * record_len(b) > remote.len as usize
                        {
                            return self.fail(conn, format!("a table of {values} x {b} B this client cannot read"));
                        }
                        self.local_at = self.index as usize * record_len(b);
                        self.table = Some((remote, values, b));
                        self.next(conn);
                    }
                    Waiting::Ack if msg == ACK => {
                        self.totals.borrow_mut().puts += 1;
                        self.waiting = Waiting::Hello;
                        let key = self.next_key(self.table.map_or(1, |t| t.1));
                        self.get(conn, key, common::Clock::ticks());
                    }
                    _ => self.fail(conn, format!("an unexpected message of {} bytes", msg.len())),
                }
            }
            (OpCode::Read, Ok(_)) => {
                if let Waiting::Get { key, started } = self.waiting {
                    self.got(conn, key, started);
                }
            }
            (OpCode::Send, Ok(_)) => {}
            (op, Err(e)) => self.fail(conn, format!("{op:?} failed: {e}")),
            _ => {}
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        if !self.finished {
            self.totals.borrow_mut().failures.push(format!("client {}: closed early: {reason}", self.index));
        }
    }
}

fn client(args: Args) {
    args.finish(&["connect", "clients", "count", "puts-every", "spin-us"]);
    let dst = args.addr("connect");
    let clients: u64 = args.get("clients", 1);
    if !(1..=64).contains(&clients) {
        common::fail(USAGE, "--clients must be 1 to 64");
    }
    let count: u64 = args.get("count", 10_000);
    let puts_every: u64 = args.get("puts-every", 10);
    let verify = args.switch("verify");
    let cfg = Config { send_depth: 8, recv_depth: 8, spin: args.spin(), ..Config::default() };
    let mut reactor = Reactor::with_config(cfg)
        .unwrap_or_else(|e| common::die("kv", &format!("cannot start: {}", common::report(&e))));
    // One local region for every connection's records: 64 slots of the largest record.
    let local = Region::zeroed(64 * record_len(64 * 1024))
        .unwrap_or_else(|e| common::die("kv", &format!("cannot make the local region: {}", common::report(&e))));
    let totals = Rc::new(RefCell::new(Totals::default()));
    let mut clock = common::Clock::new();
    let opts = ConnectOptions { msg_size: msg_size(64 * 1024) as u32, ..ConnectOptions::default() };
    for index in 0..clients {
        let h = KvClient {
            index,
            count,
            puts_every,
            verify,
            local: local.clone(),
            local_at: 0,
            table: None,
            waiting: Waiting::Hello,
            gets: 0,
            rng: 0x9E37_79B9_7F4A_7C15 ^ (index + 1).wrapping_mul(0xD1B5_4A32_D192_ED03),
            totals: totals.clone(),
            finished: false,
        };
        if let Err(e) = reactor.connect(dst, opts.clone(), h) {
            common::die("kv", &format!("cannot connect to {dst}: {}", common::report(&e)));
        }
    }
    let start = Instant::now();
    let (mut last, mut last_gets) = (Instant::now(), 0);
    loop {
        {
            let t = totals.borrow();
            if t.done + t.failures.len() as u64 >= clients || (!t.failures.is_empty() && reactor.is_idle()) {
                break;
            }
        }
        if let Err(e) = reactor.run_once(Some(Duration::from_millis(200))) {
            common::die("kv", &format!("the reactor failed: {}", common::report(&e)));
        }
        if last.elapsed() >= Duration::from_secs(1) {
            let t = totals.borrow();
            println!(
                "kv client: {} GETs/s, {} GETs, {} PUTs, {} retries",
                t.gets - last_gets,
                t.gets,
                t.puts,
                t.retries
            );
            last_gets = t.gets;
            last = Instant::now();
        }
        if start.elapsed() > Duration::from_secs(600) {
            common::die("kv", "not done after 600 s");
        }
    }
    reactor.shutdown(Duration::from_secs(2));
    clock.calibrate();
    let secs = start.elapsed().as_secs_f64();
    let mut t = totals.borrow_mut();
    t.latencies.sort_unstable();
    let p = |q: f64| common::us(clock.ns(common::percentile(&t.latencies, q)));
    println!(
        "kv client: {} GETs and {} PUTs over {clients} connections in {secs:.2} s ({:.0} GETs/s); {} torn reads retried",
        t.gets,
        t.puts,
        t.gets as f64 / secs,
        t.retries
    );
    println!("kv client: GET latency p50 {} p90 {} p99 {} p99.9 {}", p(50.0), p(90.0), p(99.0), p(99.9));
    if verify {
        println!("kv client: {} of {} GETs verified, every byte", t.verified, t.gets);
    }
    for f in &t.failures {
        eprintln!("kv client: FAILED {f}");
    }
    let expected = clients * count;
    if !t.failures.is_empty() || t.gets != expected || (verify && t.verified != expected) {
        eprintln!("kv client: FAILED: {} of {expected} GETs done", t.gets);
        std::process::exit(1);
    }
}
