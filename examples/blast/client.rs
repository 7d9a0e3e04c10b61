//! The client: its connections, the send pump, `RESUME` handling and `client()`.

use super::bookkeeping::{random_bytes, received, resume_point, ring_slots, Hello};
use super::*;

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
                // No pool memory for one more now (the connection's budget, `PoolConfig`):
                // the next completion gives a buffer back and pumps again.
                Err(rdma_reactor::Error::OverBudget { .. } | rdma_reactor::Error::PoolExhausted { .. })
                    if self.submitted > self.completed =>
                {
                    return
                }
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
                // The connection's share of the pool (`PoolConfig`'s memory guarantee) holds
                // fewer: a smaller window.
                Err(rdma_reactor::Error::OverBudget { .. } | rdma_reactor::Error::PoolExhausted { .. })
                    if !self.free.is_empty() =>
                {
                    break
                }
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

pub(crate) fn client(args: Args) {
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
    if stats.disconnects_unanswered > 0 {
        println!(
            "blast client: {} disconnect(s) unanswered within the disconnect timeout: the server may not have heard",
            stats.disconnects_unanswered
        );
    }
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
