//! Byte-stream benchmarks over `io::Stream` (issue 31): a round trip against the `aecho`
//! server, and one-way throughput into this program's sink.
//!
//! ```text
//! stream_bench server --bind ADDR:PORT [--exit-after N] [--depth N] [--quiet]
//! stream_bench client --connect ADDR:PORT --size BYTES --count N [--echo | --copy | --copy-buf BYTES] [--depth N] [--verify]
//! ```
//!
//! `stream_bench server` is a sink: each connection's stream is read to its end (the client's
//! shutdown), every byte counted (and, with the client's `--verify`, checked), and the count
//! is written back (8 bytes, little-endian) before the server shuts its side down.
//! `stream_bench client` writes `--count` writes of `--size` bytes, shuts down, reads the count and
//! checks it: "stream_bench client: N bytes in W writes of S bytes: X MB/s". With `--echo` it talks
//! to an `aecho server` (a message server: each write is one message, echoed as it came)
//! instead: `--count` round trips of `--size` bytes, each a write and a read of as many, and
//! prints the round-trip distribution as the echo clients do (`cargo xtask bench --compare`
//! reads its `p50`). With `--copy` the same bytes go from an in-memory reader into the stream
//! through `tokio::io::copy` (whose writes are of its own 8 KiB buffer), with `--copy-buf
//! BYTES` through `tokio::io::copy_buf` from a `BufReader` of that capacity (writes of that
//! size): what a tokio program writes without thinking of message sizes, against what one
//! that does writes (issue 46: the stream coalesces the small writes into messages).

mod common;

use std::net::SocketAddr;
use std::process::exit;
use std::time::Instant;

use common::{check_pattern, fill_pattern, Args};
use rdma_reactor::io::{self, Connection, Listener, Stream};
use rdma_reactor::{Config, ConnectOptions, Reactor};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const USAGE: &str = "\
usage: stream_bench server --bind ADDR:PORT [--exit-after N] [--depth N] [--quiet]
       stream_bench client --connect ADDR:PORT --size BYTES --count N [--echo | --copy | --copy-buf BYTES] [--depth N] [--verify]

Byte streams over RDMA (rdma_reactor::io::Stream), for benchmarks.
server: a sink; reads each stream to its end and answers with the byte count.
  --bind ADDR:PORT     address of an RDMA device to listen on
  --exit-after N       exit after N connections (default: run until killed)
  --quiet              no per-connection lines
  --depth N            receives (and sends) kept posted per connection (default: Config's, 64)
client:
  --connect ADDR:PORT  the server (`stream_bench server`; with --echo an `aecho server`)
  --size BYTES         bytes per write, 1 to 1M (suffixes K, M)
  --count N            writes (with --echo: round trips)
  --echo               round trips against a message echo server: write, then read as many
  --copy               the BYTES x N bytes through tokio::io::copy (writes of 8 KiB) from memory
  --copy-buf BYTES     ... through tokio::io::copy_buf from a BufReader of BYTES (writes of BYTES)
  --verify             fill and check a pattern in every byte
  --depth N            sends (and receives) in flight per connection (default: Config's, 64)";

/// The message size the client asks for: one write of up to 64 KiB is one message.
const MSG: usize = 64 * 1024;

fn main() {
    common::observe::init_logging("stream_bench");
    let mut argv = std::env::args().skip(1);
    match argv.next().as_deref() {
        Some("server") => server(Args::parse(argv, &["quiet"], USAGE)),
        Some("client") => client(Args::parse(argv, &["echo", "copy", "verify"], USAGE)),
        Some("--help") | Some("-h") => println!("{USAGE}"),
        _ => common::fail(USAGE, "the first argument is `server` or `client`"),
    }
}

/// The configuration at `--depth N` (sends and receives kept posted; `Config`'s when not given).
fn depths(args: &Args) -> Config {
    let d = Config::default();
    let depth = args.get("depth", d.recv_depth).max(3);
    Config { send_depth: depth, recv_depth: depth, ..d }
}

fn reactor(cfg: Config) -> Reactor {
    Reactor::with_config(cfg)
        .unwrap_or_else(|e| common::die("stream_bench", &format!("cannot start: {}", common::report(&e))))
}

// ----- server -------------------------------------------------------------------------------

/// Reads `conn`'s stream to its end; answers with the byte count. Checks the pattern when the
/// first byte says so (1: verified, 0: not).
async fn sink(conn: Connection) -> Result<u64, String> {
    let mut s = Stream::new(conn);
    let mut flag = [0u8; 1];
    s.read_exact(&mut flag).await.map_err(|e| format!("the first byte: {e}"))?;
    let verify = flag[0] == 1;
    let mut buf = vec![0u8; MSG];
    let mut total = 0u64;
    // The client's writes are `size`-byte units of the pattern, seq = offset / size; the
    // size comes next (8 bytes) when verifying.
    let mut size = [0u8; 8];
    if verify {
        s.read_exact(&mut size).await.map_err(|e| format!("the size: {e}"))?;
    }
    let size = u64::from_le_bytes(size).max(1) as usize;
    let mut unit = vec![0u8; if verify { size } else { 0 }];
    loop {
        if verify {
            match s.read_exact(&mut unit).await {
                Ok(_) => {
                    let seq = total / size as u64;
                    if let Some(at) = check_pattern(&unit, 0, seq) {
                        return Err(format!("write {seq}: byte {at} differs"));
                    }
                    total += size as u64;
                }
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
                Err(e) => return Err(format!("after {total} bytes: {e}")),
            }
        } else {
            let n = s.read(&mut buf).await.map_err(|e| format!("after {total} bytes: {e}"))?;
            if n == 0 {
                break;
            }
            total += n as u64;
        }
    }
    s.write_all(&total.to_le_bytes()).await.map_err(|e| format!("the answer: {e}"))?;
    s.shutdown().await.map_err(|e| format!("the shutdown: {e}"))?;
    Ok(total)
}

fn server(args: Args) {
    args.finish(&["bind", "exit-after", "quiet", "depth"]);
    let addr = args.addr("bind");
    let exit_after: u64 = args.get("exit-after", 0);
    let quiet = args.switch("quiet");
    let mut reactor = reactor(depths(&args));
    let result = reactor.block_on(async move {
        let listener = Listener::bind(addr)?;
        println!("stream_bench server: listening on {addr}");
        let mut tasks = Vec::new();
        let mut accepted = 0u64;
        while exit_after == 0 || accepted < exit_after {
            let conn = listener.accept().await?;
            accepted += 1;
            let peer = conn.peer_addr();
            tasks.push(io::spawn(async move {
                let r = sink(conn).await;
                match &r {
                    Ok(n) if !quiet => println!("stream_bench server: {peer:?}: {n} bytes"),
                    Err(e) => eprintln!("stream_bench server: {peer:?}: {e}"),
                    _ => {}
                }
                r.is_ok()
            })?);
        }
        let mut ok = true;
        for t in tasks {
            ok &= t.await.unwrap_or(false);
        }
        Ok::<_, rdma_reactor::Error>(ok)
    });
    match result {
        Ok(Ok(true)) => {}
        Ok(Ok(false)) => exit(1),
        Ok(Err(e)) | Err(e) => common::die("stream_bench server", &common::report(&e)),
    }
}

// ----- client -------------------------------------------------------------------------------

/// The bytes a copy reads: `count` units of `size` bytes of the pattern (unit `seq` is the
/// pattern's message `seq`, what the sink checks), or of a constant block without `verify`.
struct Source {
    size: usize,
    count: u64,
    verify: bool,
    /// The unit being read, its number, and how far.
    unit: Vec<u8>,
    seq: u64,
    at: usize,
}

impl Source {
    fn new(size: usize, count: u64, verify: bool) -> Source {
        let mut unit = vec![0u8; size];
        fill_pattern(&mut unit, 0, if verify { 0 } else { u64::MAX });
        Source { size, count, verify, unit, seq: 0, at: 0 }
    }
}

impl tokio::io::AsyncRead for Source {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
        out: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let s = &mut *self;
        while out.remaining() > 0 && s.seq < s.count {
            let n = (s.size - s.at).min(out.remaining());
            out.put_slice(&s.unit[s.at..s.at + n]);
            s.at += n;
            if s.at == s.size {
                s.at = 0;
                s.seq += 1;
                if s.verify {
                    fill_pattern(&mut s.unit, 0, s.seq);
                }
            }
        }
        std::task::Poll::Ready(Ok(()))
    }
}

/// How the client writes its bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Via {
    /// `write_all` of `--size` bytes at a time.
    Writes,
    /// `tokio::io::copy` (writes of its 8 KiB buffer).
    Copy,
    /// `tokio::io::copy_buf` from a `BufReader` of this capacity.
    CopyBuf(usize),
}

/// `count` writes of `size` bytes (or as many bytes through a copy), the shutdown, and the
/// sink's count; returns the bytes sent.
async fn bulk(dst: SocketAddr, size: usize, count: u64, verify: bool, via: Via) -> Result<u64, String> {
    let opts = ConnectOptions { msg_size: MSG as u32, ..ConnectOptions::default() };
    let conn = Connection::connect(dst, opts).await.map_err(|e| format!("connect: {}", common::report(&e)))?;
    let mut s = Stream::new(conn);
    let mut head = vec![u8::from(verify)];
    if verify {
        head.extend_from_slice(&(size as u64).to_le_bytes());
    }
    s.write_all(&head).await.map_err(|e| format!("the header: {e}"))?;
    match via {
        Via::Writes => {
            let mut buf = vec![0u8; size];
            fill_pattern(&mut buf, 0, u64::MAX);
            for seq in 0..count {
                if verify {
                    fill_pattern(&mut buf, 0, seq);
                }
                s.write_all(&buf).await.map_err(|e| format!("write {seq}: {e}"))?;
            }
        }
        Via::Copy => {
            let mut src = Source::new(size, count, verify);
            tokio::io::copy(&mut src, &mut s).await.map_err(|e| format!("copy: {e}"))?;
        }
        Via::CopyBuf(cap) => {
            let mut src = tokio::io::BufReader::with_capacity(cap, Source::new(size, count, verify));
            tokio::io::copy_buf(&mut src, &mut s).await.map_err(|e| format!("copy_buf: {e}"))?;
        }
    }
    s.shutdown().await.map_err(|e| format!("the shutdown: {e}"))?;
    let mut answer = [0u8; 8];
    s.read_exact(&mut answer).await.map_err(|e| format!("the sink's count: {e}"))?;
    let got = u64::from_le_bytes(answer);
    let sent = size as u64 * count;
    if got != sent {
        return Err(format!("the sink counted {got} bytes, {sent} were sent"));
    }
    Ok(sent)
}

/// `count` round trips of `size` bytes against a message echo server; their times (ticks).
async fn echo(dst: SocketAddr, size: usize, count: u64, verify: bool) -> Result<Vec<u64>, String> {
    let opts = ConnectOptions { msg_size: size as u32, msg_count: count as u32, ..ConnectOptions::default() };
    let conn = Connection::connect(dst, opts).await.map_err(|e| format!("connect: {}", common::report(&e)))?;
    let mut s = Stream::new(conn);
    let mut out = vec![0u8; size];
    fill_pattern(&mut out, 0, u64::MAX);
    let mut back = vec![0u8; size];
    let mut times = Vec::with_capacity(count as usize);
    for seq in 0..count {
        if verify {
            fill_pattern(&mut out, 0, seq);
        }
        let at = common::Clock::ticks();
        s.write_all(&out).await.map_err(|e| format!("round trip {seq}: {e}"))?;
        s.read_exact(&mut back).await.map_err(|e| format!("round trip {seq}: {e}"))?;
        times.push(common::Clock::ticks().wrapping_sub(at));
        if verify {
            if let Some(at) = check_pattern(&back, 0, seq) {
                return Err(format!("round trip {seq}: byte {at} differs"));
            }
        }
    }
    s.shutdown().await.map_err(|e| format!("the shutdown: {e}"))?;
    // The echo server sends the end marker back: the stream's end.
    let n = s.read(&mut back).await.map_err(|e| format!("the end: {e}"))?;
    if n != 0 {
        return Err(format!("{n} bytes after the last echo"));
    }
    Ok(times)
}

fn client(args: Args) {
    args.finish(&["connect", "size", "count", "echo", "copy", "copy-buf", "verify", "depth"]);
    let dst = args.addr("connect");
    let size = args.size("size", 0);
    if !(1..=1024 * 1024).contains(&size) {
        common::fail(USAGE, "--size must be 1 to 1M bytes");
    }
    let count: u64 = args.get("count", 0);
    let verify = args.switch("verify");
    let start = Instant::now();
    if args.switch("echo") {
        // As the aecho client it is compared with: 4 sends and receives deep.
        let mut reactor = reactor(Config { send_depth: 4, recv_depth: 4, ..Config::default() });
        let mut clock = common::Clock::new();
        let r = reactor.block_on(echo(dst, size, count, verify));
        let elapsed = start.elapsed();
        clock.calibrate();
        match r {
            Ok(Ok(times)) => {
                let mut lat: Vec<u64> = times.into_iter().map(|t| clock.ns(t)).collect();
                lat.sort_unstable();
                common::print_round_trips("stream_bench", &lat, size, 1, elapsed, verify);
            }
            Ok(Err(e)) => {
                eprintln!("stream_bench client: FAILED {e}");
                exit(1);
            }
            Err(e) => common::die("stream_bench client", &common::report(&e)),
        }
        return;
    }
    let via = match (args.switch("copy"), args.given("copy-buf")) {
        (false, false) => Via::Writes,
        (true, false) => Via::Copy,
        (false, true) => Via::CopyBuf(args.size("copy-buf", 0).max(1)),
        (true, true) => common::fail(USAGE, "--copy or --copy-buf, not both"),
    };
    let mut reactor = reactor(depths(&args));
    match reactor.block_on(bulk(dst, size, count, verify, via)) {
        Ok(Ok(bytes)) => {
            let secs = start.elapsed().as_secs_f64();
            let how = match via {
                Via::Writes => format!("in {count} writes of {size} bytes"),
                Via::Copy => "through tokio::io::copy (8 KiB writes)".to_string(),
                Via::CopyBuf(cap) => format!("through tokio::io::copy_buf ({cap}-byte writes)"),
            };
            println!(
                "stream_bench client: {bytes} bytes {how}{}: {:.1} MB/s",
                if verify { ", every byte verified" } else { "" },
                bytes as f64 / secs / 1e6
            );
        }
        Ok(Err(e)) => {
            eprintln!("stream_bench client: FAILED {e}");
            exit(1);
        }
        Err(e) => common::die("stream_bench client", &common::report(&e)),
    }
}
