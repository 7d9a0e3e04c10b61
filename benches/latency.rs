//! Criterion benchmarks. `cargo xtask bench` runs them in the VM.
//!
//! Host (no RDMA): token packing, connect-information decoding. (The reactor's bookkeeping per
//! operation is `benches/dispatch.rs`.)
//!
//! RDMA (when `RDMA_ADDR` names an RDMA netdev address, as in the VM), each in one reactor that
//! holds a listener, the agents and the clients:
//! - `rdma/echo_{event,spin}/{64,4096,65536}`: one iteration is one round trip of that size,
//!   event mode or spinning (`Config::spin`);
//! - `rdma/blast/{64,65536}`: one iteration is one message streamed with flow control
//!   (criterion reports the throughput);
//! - `rdma/connection_setup`: one iteration is one connection resolved, connected,
//!   established, closed and destroyed on both sides;
//! - `rdma/close_among/{16,512}`: one iteration is one connection closed and destroyed on both
//!   sides while 16 or 512 idle ones stay open, each with 16 receives posted on both sides and
//!   64 one-hour user timers (the connection is made outside the timed part). Closing costs
//!   the connection's own operations and timers, so the two should take the same time (fault
//!   issue, defect 6: a close used to walk every live operation and timer).
//!
//! Without `RDMA_ADDR` the RDMA groups print that they are skipped.

use std::cell::RefCell;
use std::hint::black_box;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rdma_reactor::{
    CloseReason, Completion, Config, Conn, ConnectInfo, ConnectOptions, ConnectRequest, ConnectionHandler, Ctx,
    Decision, ListenerHandler, Op, OpCode, OpError, Reactor, Token, WcStatus,
};

fn host(c: &mut Criterion) {
    let info = ConnectInfo {
        msg_size: 4096,
        msg_count: 1000,
        recv_depth: 16,
        flow_control: false,
        tail: false,
        farewell: false,
        user: b"bench".to_vec(),
    };
    let mut bytes = info.encode(56).unwrap();
    bytes.resize(56, 0);
    c.bench_function("wire/decode_connect_info_56B", |b| b.iter(|| ConnectInfo::decode(black_box(&bytes))));
    c.bench_function("token/from_u64", |b| {
        let raw = (4u64 << 56) | (7 << 32) | 12345;
        b.iter(|| Token::from_u64(black_box(raw)).map(Token::as_u64))
    });
}

/// Accepts every client with an agent that echoes (or, for a blast client, only re-posts).
struct Server;

impl ListenerHandler for Server {
    fn on_connect_request(&mut self, _ctx: &mut Ctx<'_>, req: &ConnectRequest) -> Decision {
        let size = req.info.as_ref().map_or(64, |i| i.msg_size as usize);
        let echo = !req.info.as_ref().is_some_and(|i| i.user == b"blast");
        Decision::Accept(Box::new(Agent { size, echo }))
    }
}

/// Echoes every message (`echo`), or only takes it and posts the receive again.
struct Agent {
    size: usize,
    echo: bool,
}

impl ConnectionHandler for Agent {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        for _ in 0..16 {
            let b = conn.alloc(self.size).expect("buffer");
            conn.submit(Op::recv(b)).expect("recv");
        }
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        if let (OpCode::Recv, Ok(_)) = (c.opcode, c.result) {
            let buf = c.buf.expect("buf");
            if self.echo {
                let _ = conn.submit(Op::send(buf));
                if let Ok(b) = conn.alloc(self.size) {
                    let _ = conn.submit(Op::recv(b));
                }
            } else {
                let _ = conn.submit(Op::recv(buf));
            }
        }
    }
}

#[derive(Default)]
struct Shared {
    /// Messages still to send (blast) or round trips still to make (echo).
    remaining: u64,
    /// Messages in flight (blast).
    in_flight: u64,
    established: bool,
    closed: Option<CloseReason>,
}

/// The client side: ping-pongs (`window` 0) or streams with `window` messages in flight.
struct Client {
    size: usize,
    window: u64,
    shared: Rc<RefCell<Shared>>,
}

impl Client {
    fn send(&self, conn: &mut Conn<'_>, buf: Option<rdma_reactor::Buf>) {
        let mut b = buf.unwrap_or_else(|| conn.alloc(self.size).expect("buffer"));
        b.set_len(self.size).expect("size");
        conn.submit(Op::send(b)).expect("send");
    }
}

impl ConnectionHandler for Client {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        for _ in 0..16 {
            let b = conn.alloc(self.size).expect("buffer");
            conn.submit(Op::recv(b)).expect("recv");
        }
    }

    fn on_established(&mut self, _conn: &mut Conn<'_>) {
        self.shared.borrow_mut().established = true;
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        match (c.opcode, c.result) {
            (OpCode::Recv, Ok(_)) if self.window == 0 => {
                let buf = c.buf.expect("buf");
                let mut s = self.shared.borrow_mut();
                s.remaining = s.remaining.saturating_sub(1);
                let again = s.remaining > 0;
                drop(s);
                conn.submit(Op::recv(buf)).expect("recv");
                if again {
                    self.send(conn, None);
                }
            }
            (OpCode::Send, Ok(_)) if self.window > 0 => {
                let mut s = self.shared.borrow_mut();
                s.in_flight -= 1;
                if s.remaining > 0 {
                    s.remaining -= 1;
                    s.in_flight += 1;
                    drop(s);
                    self.send(conn, c.buf);
                }
            }
            (_, Ok(_)) => {}
            // Flushed or cancelled: the reactor is shutting the connection down.
            (_, Err(OpError::Wc(WcStatus::WrFlushErr) | OpError::Cancelled)) => {}
            (op, Err(e)) => panic!("{op:?} failed: {e}"),
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        self.shared.borrow_mut().closed = Some(reason);
    }
}

fn run_until(reactor: &mut Reactor, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not done after 60 s");
        reactor.run_once(Some(Duration::from_millis(100))).expect("tick");
    }
}

/// A reactor listening on `port`, and one client connection to it.
fn pair(port: u16, spin: Duration, size: usize, window: u64) -> (Reactor, Token, Rc<RefCell<Shared>>) {
    let ip = std::env::var("RDMA_ADDR").expect("RDMA_ADDR");
    let addr: SocketAddr = format!("{ip}:{port}").parse().expect("RDMA_ADDR is an IP address");
    let mut reactor = Reactor::with_config(Config { spin, ..Config::default() }).expect("reactor");
    reactor.listen(addr, Server).expect("listen");
    let shared = Rc::new(RefCell::new(Shared::default()));
    let user = if window > 0 { b"blast".to_vec() } else { Vec::new() };
    let opts = ConnectOptions { msg_size: size as u32, user_data: user, ..Default::default() };
    let client = Client { size, window, shared: shared.clone() };
    let token = reactor.connect(addr, opts, client).expect("connect");
    run_until(&mut reactor, "establish", || shared.borrow().established);
    (reactor, token, shared)
}

fn echo(c: &mut Criterion, port: &mut u16) {
    for (mode, spin) in [("event", Duration::ZERO), ("spin", Duration::from_millis(1))] {
        let mut group = c.benchmark_group(format!("rdma/echo_{mode}"));
        group.sample_size(10).measurement_time(Duration::from_secs(5)).warm_up_time(Duration::from_secs(1));
        for size in [64usize, 4096, 65536] {
            *port += 1;
            let (mut reactor, client, shared) = pair(*port, spin, size, 0);
            group.bench_with_input(BenchmarkId::from_parameter(size), &size, |b, &size| {
                b.iter_custom(|iters| {
                    shared.borrow_mut().remaining = iters;
                    let mut buf = reactor.ctx().alloc(client, size).expect("buffer");
                    buf.set_len(size).expect("size");
                    let start = Instant::now();
                    reactor.ctx().submit(client, Op::send(buf)).expect("send");
                    while shared.borrow().remaining > 0 {
                        reactor.run_once(Some(Duration::from_millis(100))).expect("tick");
                    }
                    start.elapsed()
                })
            });
            println!("rdma/echo_{mode}/{size}: reactor stats {:?}", reactor.stats());
        }
        group.finish();
    }
}

fn blast(c: &mut Criterion, port: &mut u16) {
    let mut group = c.benchmark_group("rdma/blast");
    group.sample_size(10).measurement_time(Duration::from_secs(5)).warm_up_time(Duration::from_secs(1));
    for size in [64usize, 65536] {
        *port += 1;
        let window = 32;
        let (mut reactor, client, shared) = pair(*port, Duration::ZERO, size, window);
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_with_input(BenchmarkId::from_parameter(size), &size, |b, &size| {
            b.iter_custom(|iters| {
                let first = iters.min(window);
                {
                    let mut s = shared.borrow_mut();
                    s.remaining = iters - first;
                    s.in_flight = first;
                }
                let start = Instant::now();
                for _ in 0..first {
                    let mut buf = reactor.ctx().alloc(client, size).expect("buffer");
                    buf.set_len(size).expect("size");
                    reactor.ctx().submit(client, Op::send(buf)).expect("send");
                }
                while shared.borrow().in_flight > 0 {
                    reactor.run_once(Some(Duration::from_millis(100))).expect("tick");
                }
                start.elapsed()
            })
        });
    }
    group.finish();
}

fn setup(c: &mut Criterion, port: &mut u16) {
    *port += 1;
    let ip = std::env::var("RDMA_ADDR").expect("RDMA_ADDR");
    let addr: SocketAddr = format!("{ip}:{port}").parse().expect("RDMA_ADDR is an IP address");
    let mut reactor = Reactor::new().expect("reactor");
    reactor.listen(addr, Server).expect("listen");
    let mut group = c.benchmark_group("rdma");
    group.sample_size(10).measurement_time(Duration::from_secs(5)).warm_up_time(Duration::from_secs(1));
    group.bench_function("connection_setup", |b| {
        b.iter(|| {
            let shared = Rc::new(RefCell::new(Shared::default()));
            let opts = ConnectOptions { msg_size: 64, ..Default::default() };
            let client = Client { size: 64, window: 0, shared: shared.clone() };
            let token = reactor.connect(addr, opts, client).expect("connect");
            run_until(&mut reactor, "establish", || shared.borrow().established);
            reactor.ctx().close(token);
            // Both sides closed and destroyed: only the listener is left.
            let deadline = Instant::now() + Duration::from_secs(60);
            while shared.borrow().closed.is_none() || reactor.connections() > 0 {
                assert!(Instant::now() < deadline, "close: not done after 60 s");
                reactor.run_once(Some(Duration::from_millis(100))).expect("tick");
            }
        })
    });
    group.finish();
}

/// A client that sets `timers` one-hour timers once established, and otherwise idles.
struct Idle {
    timers: u64,
    shared: Rc<RefCell<Shared>>,
}

impl ConnectionHandler for Idle {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        for _ in 0..16 {
            let b = conn.alloc(64).expect("buffer");
            conn.submit(Op::recv(b)).expect("recv");
        }
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        for i in 0..self.timers {
            conn.ctx().set_timer(Duration::from_secs(3600), i).expect("timer");
        }
        self.shared.borrow_mut().established = true;
    }

    fn on_completion(&mut self, _conn: &mut Conn<'_>, _c: Completion) {}

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        self.shared.borrow_mut().closed = Some(reason);
    }
}

/// Connects an [`Idle`] client with `timers` timers and waits until it is established.
fn idle(reactor: &mut Reactor, addr: SocketAddr, timers: u64) -> (Token, Rc<RefCell<Shared>>) {
    let shared = Rc::new(RefCell::new(Shared::default()));
    let opts = ConnectOptions { msg_size: 64, ..Default::default() };
    let token = reactor.connect(addr, opts, Idle { timers, shared: shared.clone() }).expect("connect");
    run_until(reactor, "establish", || shared.borrow().established);
    (token, shared)
}

fn close_among(c: &mut Criterion, port: &mut u16) {
    let ip = std::env::var("RDMA_ADDR").expect("RDMA_ADDR");
    let mut group = c.benchmark_group("rdma/close_among");
    group.sample_size(10).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    for others in [16usize, 512] {
        *port += 1;
        let addr: SocketAddr = format!("{ip}:{port}").parse().expect("RDMA_ADDR is an IP address");
        let mut reactor = Reactor::new().expect("reactor");
        reactor.listen(addr, Server).expect("listen");
        let open: Vec<_> = (0..others).map(|_| idle(&mut reactor, addr, 64)).collect();
        group.bench_with_input(BenchmarkId::from_parameter(others), &others, |b, _| {
            b.iter_custom(|iters| {
                let mut spent = Duration::ZERO;
                for _ in 0..iters {
                    let (token, shared) = idle(&mut reactor, addr, 64);
                    let start = Instant::now();
                    reactor.ctx().close(token);
                    let deadline = start + Duration::from_secs(60);
                    while shared.borrow().closed.is_none() || reactor.connections() > 2 * others {
                        assert!(Instant::now() < deadline, "close: not done after 60 s");
                        reactor.run_once(Some(Duration::from_millis(100))).expect("tick");
                    }
                    spent += start.elapsed();
                }
                spent
            })
        });
        assert!(open.iter().all(|(_, s)| s.borrow().closed.is_none()), "the idle connections stayed open");
        println!("rdma/close_among/{others}: reactor stats {:?}", reactor.stats());
    }
    group.finish();
}

fn rdma(c: &mut Criterion) {
    if std::env::var("RDMA_ADDR").is_err() {
        println!("rdma: skipped (RDMA_ADDR is not set; run it in the VM with `cargo xtask bench`)");
        return;
    }
    let mut port = 7600;
    echo(c, &mut port);
    blast(c, &mut port);
    setup(c, &mut port);
    close_among(c, &mut port);
}

criterion_group!(benches, host, rdma);
criterion_main!(benches);
