//! The server: the listener, its agents (receives, write rings, numbered messages) and `server()`.

use super::bookkeeping::{
    numbered_terms, Announcer, Coverage, Hello, Resumable, RingBudget, RingLease, Seen, Unclaimed, RESUMABLE_MAX,
};
use super::*;

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
        for i in 0..self.depth {
            match conn.alloc(recv_size) {
                Ok(b) => {
                    if let Err(e) = conn.submit(Op::recv(b)) {
                        return self.fail(conn, format!("post receive: {}", e.error));
                    }
                }
                // Beyond this connection's reservation with nothing left to borrow (the pool's
                // memory guarantee, `PoolConfig`): fewer receives, so less credit for the
                // client, as long as flow control's minimum (3) is there.
                Err(rdma_reactor::Error::OverBudget { .. } | rdma_reactor::Error::PoolExhausted { .. }) if i >= 3 => {
                    break;
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

pub(crate) fn server(args: Args) {
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
