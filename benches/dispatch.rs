//! The reactor's dispatch cost per operation with no RDMA, on the host:
//! `cargo bench --features bench-internals --bench dispatch`.
//!
//! One iteration is the pure bookkeeping of one ping-pong on one side (a receive and a send:
//! table insert and lookup by `wr_id`, queue planning with credits, CQ room and selective
//! signaling, completion accounting). What it leaves out is the FFI itself (`ibv_post_*`,
//! `ibv_poll_cq`) and the user's callback.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use rdma_reactor::bench_internals::Dispatch;

fn dispatch(c: &mut Criterion) {
    let mut d = Dispatch::new(16);
    let mut i = 0u64;
    c.bench_function("dispatch/recv_and_send_bookkeeping", |b| {
        b.iter(|| {
            i += 1;
            black_box(d.round(black_box(i)))
        })
    });
}

criterion_group!(benches, dispatch);
criterion_main!(benches);
