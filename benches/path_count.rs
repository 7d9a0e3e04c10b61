//! The host per-message path's instruction count: `cargo xtask path-count`.
//!
//! `path_count old|new|new-raw N` runs `bench_internals`' echo server side of a round trip N times
//! (`old`: [`SlabPath`](rdma_reactor::bench_internals::SlabPath), the reactor's pieces of today;
//! `new`: [`Path`](rdma_reactor::bench_internals::Path), the ring design of issue 47) and prints
//! what the messages returned, so nothing is optimised away; `new-raw` is the ring design with
//! `old`'s handler (caller memory: no pool, no owner marks), the structures alone. Under `valgrind --tool=cachegrind` at two message counts, the difference over the
//! extra messages is the instructions a message, exactly and on any host (`xtask/src/path_count.rs`).
//! Run by `cargo bench` (which passes `--bench`), it runs both briefly.

use std::hint::black_box;

use rdma_reactor::bench_internals::{Echo, Path, RawEcho, SlabPath};
use rdma_reactor::{Completion, Op, OpCode, RawBuf};

/// The echo server's handler of today's path: a message back for every message, and the
/// receive again (as `benches/dispatch.rs`).
fn echo(c: Completion, raw: RawBuf) -> [Option<Op>; 2] {
    match c.opcode {
        OpCode::Recv => [
            Some(Op::raw_send(RawBuf { len: c.result.unwrap_or(0), ..raw }).user_data(c.user_data + 1)),
            Some(Op::raw_recv(raw).user_data(c.user_data)),
        ],
        _ => [None, None],
    }
}

fn old(n: u64) -> u64 {
    let mut p = SlabPath::new(16);
    let mut handler = echo;
    let mut sum = 0u64;
    for _ in 0..n {
        sum = sum.wrapping_add(black_box(p.message(&mut handler)));
    }
    sum
}

/// The ring design's path with the echo server's handler (`bench_internals::Echo`, as
/// `examples/echo.rs`: the received buffer sent back, a fresh buffer received into).
fn new(n: u64) -> u64 {
    let mut p = Path::new(16, Box::new(Echo));
    let mut sum = 0u64;
    for _ in 0..n {
        sum = sum.wrapping_add(black_box(p.message()));
    }
    sum
}

/// The ring design's path with [`SlabPath`]'s work per message (caller memory, no pool, no owner
/// marks): the structures alone, against `old`.
fn new_raw(n: u64) -> u64 {
    let raw = rdma_reactor::RawBuf { addr: 0x1000, len: 64, lkey: 1 };
    let mut p = Path::new_raw(16, Box::new(RawEcho(raw)));
    let mut sum = 0u64;
    for _ in 0..n {
        sum = sum.wrapping_add(black_box(p.message()));
    }
    sum
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--bench") {
        black_box((old(1000), new_raw(1000), new(1000)));
        println!("path_count: old, new-raw and new ran 1 000 messages each (cargo xtask path-count counts them)");
        return;
    }
    let (which, n) = match args.as_slice() {
        [which, n] => (which.as_str(), n.parse::<u64>().unwrap_or_else(|_| usage())),
        _ => usage(),
    };
    let sum = match which {
        "old" => old(n),
        "new" => new(n),
        "new-raw" => new_raw(n),
        _ => usage(),
    };
    println!("{sum}");
}

fn usage() -> ! {
    eprintln!("usage: path_count old|new-raw|new MESSAGES");
    std::process::exit(2);
}
