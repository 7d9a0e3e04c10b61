//! Criterion latency benchmarks.
//!
//! Host (no RDMA): token packing, connect-information decoding, ack batching.
//! RDMA (when `RDMA_ADDR` names an RDMA netdev address, as in `cargo xtask vm`): one reactor
//! with a listener, an echo agent and a client; one iteration is one 64-byte round trip, so
//! criterion's estimate is the round-trip latency through the whole reactor. Without
//! `RDMA_ADDR` the RDMA group prints that it is skipped.

use std::cell::RefCell;
use std::hint::black_box;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use rdma_reactor::{
    Completion, Conn, ConnectInfo, ConnectOptions, ConnectRequest, ConnectionHandler, Ctx, Decision, ListenerHandler,
    Op, OpCode, Reactor, Token,
};

fn host(c: &mut Criterion) {
    let info =
        ConnectInfo { msg_size: 4096, msg_count: 1000, recv_depth: 16, flow_control: false, user: b"bench".to_vec() };
    let mut bytes = info.encode(56).unwrap();
    bytes.resize(56, 0);
    c.bench_function("wire/decode_connect_info_56B", |b| b.iter(|| ConnectInfo::decode(black_box(&bytes))));
    c.bench_function("token/from_u64", |b| {
        let raw = (4u64 << 56) | (7 << 32) | 12345;
        b.iter(|| Token::from_u64(black_box(raw)).map(Token::as_u64))
    });
}

struct Echo;

impl ListenerHandler for Echo {
    fn on_connect_request(&mut self, _ctx: &mut Ctx<'_>, _req: &ConnectRequest) -> Decision {
        Decision::Accept(Box::new(EchoAgent))
    }
}

struct EchoAgent;

impl ConnectionHandler for EchoAgent {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        for _ in 0..16 {
            let b = conn.alloc(64).expect("buffer");
            conn.submit(Op::recv(b)).expect("recv");
        }
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        if let (OpCode::Recv, Ok(_)) = (c.opcode, c.result) {
            conn.submit(Op::send(c.buf.expect("buf"))).expect("echo");
            let b = conn.alloc(64).expect("buffer");
            conn.submit(Op::recv(b)).expect("recv");
        }
    }
}

#[derive(Default)]
struct Shared {
    remaining: u64,
    established: bool,
}

struct Pinger(Rc<RefCell<Shared>>);

impl ConnectionHandler for Pinger {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        for _ in 0..4 {
            let b = conn.alloc(64).expect("buffer");
            conn.submit(Op::recv(b)).expect("recv");
        }
    }

    fn on_established(&mut self, _conn: &mut Conn<'_>) {
        self.0.borrow_mut().established = true;
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        if let (OpCode::Recv, Ok(_)) = (c.opcode, c.result) {
            let buf = c.buf.expect("buf");
            let mut s = self.0.borrow_mut();
            s.remaining = s.remaining.saturating_sub(1);
            let again = s.remaining > 0;
            drop(s);
            let send = if again { Some(conn.alloc(64).expect("buffer")) } else { None };
            conn.submit(Op::recv(buf)).expect("recv");
            if let Some(b) = send {
                conn.submit(Op::send(b)).expect("send");
            }
        }
    }
}

fn rdma(c: &mut Criterion) {
    let Ok(ip) = std::env::var("RDMA_ADDR") else {
        println!("rdma/pingpong_64B: skipped (RDMA_ADDR is not set; run it in the VM with `cargo xtask vm`)");
        return;
    };
    let addr: SocketAddr = format!("{ip}:7600").parse().expect("RDMA_ADDR is an IP address");
    let mut reactor = Reactor::new().expect("reactor");
    reactor.listen(addr, Echo).expect("listen");
    let shared = Rc::new(RefCell::new(Shared::default()));
    let opts = ConnectOptions { msg_size: 64, ..Default::default() };
    let client = reactor.connect(addr, opts, Pinger(shared.clone())).expect("connect");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !shared.borrow().established {
        assert!(Instant::now() < deadline, "not established");
        reactor.run_once(Some(Duration::from_millis(100))).expect("tick");
    }
    let mut group = c.benchmark_group("rdma");
    group.sample_size(10).measurement_time(Duration::from_secs(10)).warm_up_time(Duration::from_secs(2));
    group.bench_function("pingpong_64B", |b| {
        b.iter_custom(|iters| {
            shared.borrow_mut().remaining = iters;
            let buf = reactor.ctx().alloc(client, 64).expect("buffer");
            let start = Instant::now();
            reactor.ctx().submit(client, Op::send(buf)).expect("send");
            while shared.borrow().remaining > 0 {
                reactor.run_once(Some(Duration::from_millis(100))).expect("tick");
            }
            start.elapsed()
        })
    });
    group.finish();
    println!("rdma/pingpong_64B: reactor stats {:?}", reactor.stats());
}

criterion_group!(benches, host, rdma);
criterion_main!(benches);
