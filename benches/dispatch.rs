//! The reactor's dispatch cost per operation with no RDMA, on the host:
//! `cargo bench --features bench-internals --bench dispatch`.
//!
//! One iteration is the pure bookkeeping of one ping-pong on one side (a receive and a send:
//! table insert and lookup by `wr_id`, queue planning with credits, CQ room and selective
//! signaling, completion accounting). What it leaves out is the FFI itself (`ibv_post_*`,
//! `ibv_poll_cq`) and the user's callback.
//!
//! `dispatch/per_message_path` is the whole per-message path the instruction profile names
//! (issue 33), on the echo server's side: a receive's work completion found by `wr_id`, its
//! credit taken, the completion built and handed to the handler, which submits the reply and
//! the receive again; both planned, built into work requests and chained as for a post; the
//! reply's completion delivered. The FFI, the connection and CQ tables and the checks around
//! them are left out (`bench_internals::SlabPath` lists them): a regression of the queues, the
//! operation table, the work requests or the completions shows here.
//!
//! `dispatch/ring_path` is the same message on the ring design of issue 47
//! (`bench_internals::Path`: operation rings, the submission gate, work requests built in
//! place, the index-based pool with its owner marks, the guarded handler call);
//! `cargo xtask path-count` counts both in instructions.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use rdma_reactor::bench_internals::{Dispatch, Echo, Path, SlabPath};
use rdma_reactor::{Completion, Op, OpCode, RawBuf};

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

/// The echo server's handler: a message back for every message, and the receive again.
fn echo(c: Completion, raw: RawBuf) -> [Option<Op>; 2] {
    match c.opcode {
        OpCode::Recv => [
            Some(Op::raw_send(RawBuf { len: c.result.unwrap_or(0), ..raw }).user_data(c.user_data + 1)),
            Some(Op::raw_recv(raw).user_data(c.user_data)),
        ],
        _ => [None, None],
    }
}

fn path(c: &mut Criterion) {
    let mut p = SlabPath::new(16);
    let mut handler = echo;
    c.bench_function("dispatch/per_message_path", |b| b.iter(|| black_box(p.message(&mut handler))));
    let mut r = Path::new(16, Box::new(Echo));
    c.bench_function("dispatch/ring_path", |b| b.iter(|| black_box(r.message())));
}

criterion_group!(benches, dispatch, path);
criterion_main!(benches);
