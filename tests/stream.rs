//! `io::Stream` (issue 31 items 1 and 3) on a real device, under the tokio driver: a TCP
//! socket piped through an RDMA stream and back with `tokio::io::copy`, every byte verified;
//! half-close and the end of the stream; the peer closing mid-read and mid-write (typed
//! errors, no hang); a reader that stops reading (the writer waits with a bounded number of
//! sends in flight); many streams on one reactor; the HTTP example (hyper over streams); a
//! peer process killed mid-write and mid-read. Issue 46's cases, in `tests/stream/`: the close
//! and its outcomes row by row of `Stream`'s table (`close.rs`), hyper's normal closes and the
//! example's limits (`http.rs`), tokio's habits (`spawn_local`, owned halves) and coalesced
//! writes (`habits.rs`).
//!
//! Sizes can be set by hand: `STREAM_BYTES` (the proxy test's bytes each way, default 1 GiB,
//! the size: 110-200 s under TCG, so `cargo xtask test` gives this binary three
//! watchdogs), `STREAM_COUNT` (the many-streams test's streams, default 1000), `HTTP_REQUESTS`
//! (the HTTP example's requests, default 400) and `HTTP_ROUNDS` (the rounds of 8 connections x
//! 10 requests of `stream/http.rs`, default 20).
#![cfg(feature = "tokio")]

mod util;

#[path = "stream/close.rs"]
mod close;
#[path = "stream/habits.rs"]
mod habits;
#[path = "stream/http.rs"]
mod http;

use std::cell::Cell;
use std::future::Future;
use std::io::ErrorKind;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use rdma_reactor::io::{self, Connection, Listener, Stream};
use rdma_reactor::{CloseReason, Config, ConnectOptions, Error, Reactor};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use util::*;

/// The bytes of a stream: byte `i` of stream `seed` is `block[(i + seed) % block.len()]`, a
/// block of a prime length, so a lost, repeated or reordered message shows.
struct Bytes {
    block: Vec<u8>,
}

impl Bytes {
    fn new() -> Bytes {
        Bytes { block: pattern(65_521, 7, 7) }
    }

    /// Fills `out` with the bytes from offset `at` of stream `seed`.
    fn fill(&self, seed: u64, at: u64, out: &mut [u8]) {
        let n = self.block.len() as u64;
        let mut pos = ((at + seed) % n) as usize;
        let mut done = 0;
        while done < out.len() {
            let k = (self.block.len() - pos).min(out.len() - done);
            out[done..done + k].copy_from_slice(&self.block[pos..pos + k]);
            done += k;
            pos = 0;
        }
    }

    /// Checks `got` against the bytes from offset `at` of stream `seed`.
    fn check(&self, seed: u64, at: u64, got: &[u8]) {
        let n = self.block.len() as u64;
        let mut pos = ((at + seed) % n) as usize;
        let mut done = 0;
        while done < got.len() {
            let k = (self.block.len() - pos).min(got.len() - done);
            if got[done..done + k] != self.block[pos..pos + k] {
                let bad = (0..k).find(|i| got[done + i] != self.block[pos + i]).unwrap_or(0);
                panic!("stream {seed}: byte {} differs", at + (done + bad) as u64);
            }
            done += k;
            pos = 0;
        }
    }
}

/// Runs `f` (given the listening address) under the tokio driver on a new reactor.
fn drive<F, T>(cfg: Config, f: impl FnOnce(SocketAddr) -> F) -> T
where
    F: Future<Output = T>,
{
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
    let mut r = Reactor::with_config(cfg).expect("reactor");
    let fut = f(addr());
    rt.block_on(async { io::tokio::drive(&mut r, fut).expect("driver").await }).expect("the reactor's loop")
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Writes `len` bytes of stream `seed` to `w` in writes of `piece`, then shuts it down.
async fn write_stream<W: tokio::io::AsyncWrite + Unpin>(w: &mut W, bytes: &Bytes, seed: u64, len: u64, piece: usize) {
    let mut buf = vec![0u8; piece];
    let mut at = 0u64;
    while at < len {
        let n = piece.min((len - at) as usize);
        bytes.fill(seed, at, &mut buf[..n]);
        w.write_all(&buf[..n]).await.expect("write");
        at += n as u64;
    }
    w.shutdown().await.expect("shutdown");
}

/// Reads `r` to its end, checking every byte against stream `seed`; returns how many.
async fn read_stream<R: tokio::io::AsyncRead + Unpin>(r: &mut R, bytes: &Bytes, seed: u64) -> std::io::Result<u64> {
    let mut buf = vec![0u8; 256 * 1024];
    let mut at = 0u64;
    loop {
        let n = r.read(&mut buf).await?;
        if n == 0 {
            return Ok(at);
        }
        bytes.check(seed, at, &buf[..n]);
        at += n as u64;
    }
}

/// An RDMA echo server: every accepted connection's stream copied back into itself with
/// `tokio::io::copy`, then shut down. Returns the bytes echoed per connection as the tasks
/// end.
fn serve_echo(listener: Listener) -> Rc<std::cell::RefCell<Vec<u64>>> {
    let echoed = Rc::new(std::cell::RefCell::new(Vec::new()));
    let e = echoed.clone();
    let _accept = io::spawn(async move {
        while let Ok(conn) = listener.accept().await {
            let e = e.clone();
            let _task = io::spawn(async move {
                let (mut rd, mut wr) = tokio::io::split(Stream::new(conn));
                let n = tokio::io::copy(&mut rd, &mut wr).await.expect("echo: copy");
                wr.shutdown().await.expect("echo: shutdown");
                e.borrow_mut().push(n);
            })
            .expect("spawn");
        }
    })
    .expect("spawn");
    echoed
}

/// The proxy a user would write first: TCP client -> [TCP accept, `copy_bidirectional` with
/// an RDMA stream] -> RDMA echo server (`copy` of the stream into itself). The client writes
/// `STREAM_BYTES` and reads every byte back, verified; each half-close travels the chain (the
/// client's shutdown ends the echo's copy, whose shutdown ends the proxy's).
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn tcp_piped_through_an_rdma_stream_and_back_every_byte_verified() {
    let total = env("STREAM_BYTES", 1 << 30);
    let _w = Watchdog::new("proxy", Duration::from_secs(600));
    let t0 = Instant::now();
    let (sent, got, echoed, proxied) = drive(Config::default(), |a| async move {
        let echoed = serve_echo(Listener::bind(a).expect("listen"));
        let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("tcp listen");
        let taddr = tcp.local_addr().expect("tcp addr");
        let proxy = io::spawn(async move {
            let (mut sock, _) = tcp.accept().await.expect("tcp accept");
            let opts = ConnectOptions { msg_size: 64 * 1024, ..ConnectOptions::default() };
            let mut rdma = Stream::new(Connection::connect(a, opts).await.expect("connect"));
            let moved = tokio::io::copy_bidirectional(&mut sock, &mut rdma).await.expect("proxy: copy");
            (moved, rdma.in_flight(), rdma.window(), rdma.connection().transport())
        })
        .expect("spawn");
        let sock = tokio::net::TcpStream::connect(taddr).await.expect("tcp connect");
        let (mut rd, mut wr) = sock.into_split();
        let bytes = Bytes::new();
        let writer = async {
            write_stream(&mut wr, &bytes, 1, total, 256 * 1024).await;
            total
        };
        let reader = async { read_stream(&mut rd, &bytes, 1).await.expect("client read") };
        let (sent, got) = tokio::join!(writer, reader);
        let proxied = proxy.await.expect("the proxy did not panic");
        let echoed = echoed.borrow().clone();
        (sent, got, echoed, proxied)
    });
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "proxy: {got} of {sent} bytes back in {secs:.1} s ({:.1} MiB/s each way); echoed {echoed:?}; \
         proxy moved {:?}, in flight at the end {}, window {:?}, transport {:?}",
        got as f64 / secs / (1 << 20) as f64,
        proxied.0,
        proxied.1,
        proxied.2,
        proxied.3
    );
    assert_eq!(got, sent, "every byte back");
    assert_eq!(echoed, vec![total], "the echo copied every byte once");
    assert_eq!(proxied.0, (total, total), "the proxy moved every byte each way");
    assert_eq!(proxied.1, 0, "nothing in flight after the shutdown");
}

/// Issue 45 (its hostile review): a writer whose connection is at its pool budget waits, as a
/// TCP writer waits for buffer space, instead of failing. With 1 MiB messages, 8 receives a
/// connection and 16 MiB a connection may borrow, a stream's window of 64 sends does not fit:
/// its writes wait for its sends to give their buffers back, and 64 MiB go through to an echo
/// and back, every byte verified (a write failed with `OverBudget` before).
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_writer_at_its_pool_budget_waits_instead_of_failing() {
    const TOTAL: u64 = 64 << 20;
    let _w = Watchdog::new("budget", Duration::from_secs(400));
    let pool = rdma_reactor::PoolConfig { per_connection_bytes: Some(16 << 20), ..rdma_reactor::PoolConfig::default() };
    let cfg = Config { pool, msg_size: 1 << 20, recv_depth: 8, ..Config::default() };
    let (sent, got, echoed, window) = drive(cfg, |a| async move {
        let echoed = serve_echo(Listener::bind(a).expect("listen"));
        let opts = ConnectOptions { msg_size: 1 << 20, ..ConnectOptions::default() };
        let stream = Stream::new(Connection::connect(a, opts).await.expect("connect"));
        let (mut rd, mut wr) = tokio::io::split(stream);
        let bytes = Bytes::new();
        let writer = async {
            write_stream(&mut wr, &bytes, 5, TOTAL, 1 << 20).await;
            TOTAL
        };
        let reader = async { read_stream(&mut rd, &bytes, 5).await.expect("read") };
        let (sent, got) = tokio::join!(writer, reader);
        let window = rd.unsplit(wr).window();
        let echoed = echoed.borrow().clone();
        (sent, got, echoed, window)
    });
    println!("at its budget: {got} of {sent} bytes back through an echo; echoed {echoed:?}; window {window:?}");
    assert_eq!(got, sent, "every byte back, no write failed");
}

/// Half-close: the client writes and shuts down; the server reads to the end (the marker),
/// then writes back on its still open side and shuts down; the client reads that to the end.
/// Both saw the peer's marker, and the connection is closed cleanly afterwards.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn half_close_then_the_other_side_writes_back_and_both_end() {
    let _w = Watchdog::new("half-close", Duration::from_secs(120));
    let (server, client) = drive(Config::default(), |a| async move {
        let listener = Listener::bind(a).expect("listen");
        let server = io::spawn(async move {
            let bytes = Bytes::new();
            let mut s = Stream::new(listener.accept().await.expect("accept"));
            let got = read_stream(&mut s, &bytes, 2).await.expect("server read");
            // The client's side is shut: ours still writes.
            write_stream(&mut s, &bytes, 3, 300_000, 10_000).await;
            let marked = s.peer_shut_down();
            let why = io::timeout(Duration::from_secs(10), s.connection().closed()).await.expect("closed");
            (got, marked, why)
        })
        .expect("spawn");
        let bytes = Bytes::new();
        let opts = ConnectOptions { msg_size: 4096, ..ConnectOptions::default() };
        let mut s = Stream::new(Connection::connect(a, opts).await.expect("connect"));
        write_stream(&mut s, &bytes, 2, 100_000, 7_000).await;
        assert!(s.write(b"late").await.is_err_and(|e| e.kind() == ErrorKind::BrokenPipe), "no write after shutdown");
        let got = read_stream(&mut s, &bytes, 3).await.expect("client read");
        let marked = s.peer_shut_down();
        let why = io::timeout(Duration::from_secs(10), s.connection().closed()).await.expect("closed");
        (server.await.expect("server"), (got, marked, why))
    });
    println!("half-close: server {server:?}, client {client:?}");
    assert_eq!((server.0, server.1), (100_000, true));
    assert_eq!((client.0, client.1), (300_000, true));
    assert!(server.2.is_clean() && client.2.is_clean(), "clean closes: {server:?} {client:?}");
}

/// The peer closes mid-read and mid-write: a reader waiting for bytes reads the end (the
/// dropped stream's lingering close sends its marker, issue 46) after what was written; a
/// writer whose peer closed fails with a typed error (`BrokenPipe`, the crate's
/// `Error::Closed` as its source). Neither hangs.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn the_peer_closing_mid_read_and_mid_write_ends_with_typed_outcomes() {
    let _w = Watchdog::new("peer close", Duration::from_secs(120));
    let (read_end, write_err) = drive(Config::default(), |a| async move {
        let listener = Listener::bind(a).expect("listen");
        let bytes = Rc::new(Bytes::new());
        let opts = ConnectOptions { msg_size: 16 * 1024, ..ConnectOptions::default() };

        // Mid-read: the server reads; the client writes 200 000 bytes, flushes and drops
        // its stream (a close without a shutdown: its end marker goes, then the disconnect)
        // while the server waits for more.
        let b = bytes.clone();
        let reader = io::spawn(async move {
            let mut s = Stream::new(listener.accept().await.expect("accept"));
            let got = read_stream(&mut s, &b, 4).await;
            (got.map_err(|e| e.kind()), s.peer_shut_down(), listener)
        })
        .expect("spawn");
        let mut c = Stream::new(Connection::connect(a, opts.clone()).await.expect("connect"));
        let mut buf = vec![0u8; 200_000];
        bytes.fill(4, 0, &mut buf);
        c.write_all(&buf).await.expect("write");
        c.flush().await.expect("flush");
        io::sleep(Duration::from_millis(100)).await.expect("sleep");
        drop(c);
        let (got, marked, listener) = reader.await.expect("reader");

        // Mid-write: the server reads 64 KiB and drops its stream; the client writes on.
        let b = bytes.clone();
        let closer = io::spawn(async move {
            let mut s = Stream::new(listener.accept().await.expect("accept"));
            let mut buf = vec![0u8; 64 * 1024];
            s.read_exact(&mut buf).await.expect("read");
            b.check(5, 0, &buf);
        })
        .expect("spawn");
        let mut c = Stream::new(Connection::connect(a, opts).await.expect("connect"));
        let mut buf = vec![0u8; 16 * 1024];
        let mut at = 0u64;
        let err = loop {
            bytes.fill(5, at, &mut buf);
            match io::timeout(Duration::from_secs(20), c.write_all(&buf)).await {
                Ok(Ok(())) => at += buf.len() as u64,
                Ok(Err(e)) => break e,
                Err(e) => panic!("the writer hung after its peer closed: {e}"),
            }
        };
        closer.await.expect("closer");
        let source = err.get_ref().and_then(|s| s.downcast_ref::<Error>()).map(|e| match e {
            Error::Closed(r) => Some(r.clone()),
            _ => None,
        });
        ((got, marked), (err.kind(), source, at))
    });
    println!("mid-read: {read_end:?}; mid-write: {write_err:?}");
    assert_eq!(read_end, (Ok(200_000), true), "the bytes, then the end: the dropped stream's marker");
    assert_eq!(write_err.0, ErrorKind::BrokenPipe, "the peer's close, typed: {write_err:?}");
    assert_eq!(write_err.1, Some(Some(CloseReason::Peer)), "the crate's Error::Closed as the source");
}

/// A reader that stops reading: the writer's writes go pending once `window` sends are in
/// flight and stay pending (no unbounded buffering); when the reader reads again every byte
/// arrives.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_reader_that_stops_reading_blocks_the_writer_with_bounded_sends_in_flight() {
    const TOTAL: u64 = 32 << 20;
    const MSG: usize = 64 * 1024;
    let _w = Watchdog::new("slow reader", Duration::from_secs(300));
    let cfg = Config { recv_depth: 16, send_depth: 32, ..Config::default() };
    let (blocked_at, in_flight, window, still, got) = drive(cfg, |a| async move {
        let listener = Listener::bind(a).expect("listen");
        let go = Rc::new(Cell::new(false));
        let g = go.clone();
        let reader = io::spawn(async move {
            let mut s = Stream::new(listener.accept().await.expect("accept"));
            while !g.get() {
                io::sleep(Duration::from_millis(20)).await.expect("sleep");
            }
            read_stream(&mut s, &Bytes::new(), 6).await.expect("read")
        })
        .expect("spawn");
        let bytes = Bytes::new();
        let opts = ConnectOptions { msg_size: MSG as u32, ..ConnectOptions::default() };
        let mut s = Stream::new(Connection::connect(a, opts).await.expect("connect"));
        let mut buf = vec![0u8; MSG];
        let mut at = 0u64;
        // Write until a write stays pending for half a second.
        loop {
            bytes.fill(6, at, &mut buf);
            match io::timeout(Duration::from_millis(500), s.write(&buf)).await {
                Ok(n) => at += n.expect("write") as u64,
                Err(_) => break,
            }
            assert!(at < TOTAL, "the writer never blocked: {at} bytes taken");
        }
        let (blocked_at, in_flight, window) = (at, s.in_flight(), s.window());
        // Still blocked a second later.
        let still = io::timeout(Duration::from_secs(1), s.write(&buf)).await.is_err();
        go.set(true);
        while at < TOTAL {
            let n = (TOTAL - at).min(MSG as u64) as usize;
            bytes.fill(6, at, &mut buf[..n]);
            s.write_all(&buf[..n]).await.expect("write");
            at += n as u64;
        }
        s.shutdown().await.expect("shutdown");
        (blocked_at, in_flight, window, still, reader.await.expect("reader"))
    });
    println!(
        "slow reader: the writer blocked after {blocked_at} bytes with {in_flight} sends in flight (window \
         {window:?}); still blocked a second later: {still}; then {got} bytes read"
    );
    let window = window.expect("known after the first write");
    assert!(window <= 32, "the window is within the send queue: {window}");
    assert_eq!(in_flight, window, "blocked with the window full");
    // What the writer got through: its window, and the reader's receives (posted and unread:
    // at most twice its depth).
    let bound = ((window + 2 * 16 + 2) * MSG) as u64;
    assert!(blocked_at <= bound, "bounded: {blocked_at} bytes taken before blocking, bound {bound}");
    assert!(still, "the writer stays blocked while the reader does not read");
    assert_eq!(got, TOTAL, "every byte arrived once the reader read again");
}

/// Many streams on one reactor, each a client writing its own bytes to the echo server,
/// shutting down and reading every byte back.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn many_streams_on_one_reactor_every_byte_verified() {
    let count = env("STREAM_COUNT", 1000);
    const EACH: u64 = 20_000;
    let _w = Watchdog::new("many streams", Duration::from_secs(600));
    let cfg = Config { recv_depth: 4, send_depth: 8, ..Config::default() };
    let t0 = Instant::now();
    let (done, echoed) = drive(cfg, |a| async move {
        let echoed = serve_echo(Listener::bind(a).expect("listen"));
        let bytes = Rc::new(Bytes::new());
        let mut joins = Vec::new();
        for i in 0..count {
            let b = bytes.clone();
            joins.push(
                io::spawn(async move {
                    let opts = ConnectOptions { msg_size: 4096, ..ConnectOptions::default() };
                    let conn = Connection::connect(a, opts).await.expect("connect");
                    let (mut rd, mut wr) = tokio::io::split(Stream::new(conn));
                    let seed = 100 + i;
                    let (_, got) =
                        tokio::join!(write_stream(&mut wr, &b, seed, EACH, 3000), read_stream(&mut rd, &b, seed));
                    got.expect("read")
                })
                .expect("spawn"),
            );
        }
        let mut done = 0;
        for j in joins {
            assert_eq!(j.await.expect("client"), EACH);
            done += 1;
        }
        // The echo tasks end as their connections' markers arrive.
        let t = Instant::now();
        while echoed.borrow().len() < count as usize && t.elapsed() < Duration::from_secs(30) {
            io::sleep(Duration::from_millis(20)).await.expect("sleep");
        }
        let echoed = echoed.borrow().clone();
        (done, echoed)
    });
    println!("many streams: {done} of {count} streams verified in {:.1} s", t0.elapsed().as_secs_f64());
    assert_eq!(done, count);
    assert_eq!(echoed.len() as u64, count);
    assert!(echoed.iter().all(|n| *n == EACH));
}

/// The HTTP example (hyper 1 over streams, issue 31 item 2): its client makes
/// `HTTP_REQUESTS` requests (default 400) over 4 connections with bodies from 0 B to 1 MiB and
/// checks every byte; the server exits after the 4 connections ended.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn the_http_example_serves_hyper_over_streams_every_byte_verified() {
    let requests = env("HTTP_REQUESTS", 400).to_string();
    let a = addr();
    let at = a.to_string();
    let srv = Proc::spawn("http server", bin("http"), &["server", "--bind", &at, "--exit-after", "4", "--quiet"]);
    wait_listening(a, Duration::from_secs(30));
    let args = ["client", "--connect", &at, "--clients", "4", "--requests", &requests, "--max-body", "1M"];
    let (ok, out) = run_output(bin("http"), &args, Duration::from_secs(600));
    println!("http client:\n{out}");
    assert!(ok, "the http client failed:\n{out}");
    assert!(out.contains(&format!("{requests} of {requests} requests over 4 connections verified")), "{out}");
    let st = srv.wait(Duration::from_secs(60));
    assert!(st.success(), "http server: {st}");
}

/// A peer process killed (SIGKILL) mid-write and mid-read: the http example's server is
/// killed while this stream writes a request body it will never finish, then while this
/// stream reads a 16 MiB response. The writer fails with a typed error, the reader, short of
/// the response, with `ConnectionReset` (the peer vanished: its connection ended without its
/// end marker, `Stream`'s table); neither hangs.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_peer_process_killed_mid_write_and_mid_read_ends_the_stream_without_a_hang() {
    let _w = Watchdog::new("killed peer", Duration::from_secs(300));
    let (write_end, read_end) = drive(Config::default(), |a| async move {
        let at = a.to_string();
        let opts = ConnectOptions { msg_size: 64 * 1024, ..ConnectOptions::default() };

        // Mid-write: a POST whose body never ends (below the server's limit: it reads on).
        let mut srv = Proc::spawn(
            "http server",
            bin("http"),
            &["server", "--bind", &at, "--quiet", "--max-body", "2000000000000"],
        );
        wait_listening(a, Duration::from_secs(30));
        let mut s = Stream::new(Connection::connect(a, opts.clone()).await.expect("connect"));
        s.write_all(b"POST /echo HTTP/1.1\r\nhost: rdma\r\ncontent-length: 1000000000000\r\n\r\n").await.expect("head");
        let chunk = vec![7u8; 64 * 1024];
        let mut sent = 0u64;
        let err = loop {
            if sent == 4 << 20 {
                kill9(&mut srv);
            }
            match io::timeout(Duration::from_secs(30), s.write_all(&chunk)).await {
                Ok(Ok(())) => sent += chunk.len() as u64,
                Ok(Err(e)) => break e,
                Err(e) => panic!("the writer hung after its peer was killed ({sent} bytes sent): {e}"),
            }
            assert!(sent < 1 << 30, "the writer never failed");
        };
        let write_end = (err.kind(), sent);
        drop(s);

        // Mid-read: a 16 MiB response, the server killed after the first 4 MiB.
        let mut srv = Proc::spawn("http server", bin("http"), &["server", "--bind", &at, "--quiet"]);
        wait_listening(a, Duration::from_secs(30));
        let mut s = Stream::new(Connection::connect(a, opts).await.expect("connect"));
        s.write_all(b"GET /bytes/16777216/1 HTTP/1.1\r\nhost: rdma\r\n\r\n").await.expect("request");
        let mut buf = vec![0u8; 64 * 1024];
        let mut got = 0u64;
        let read_end = loop {
            if got >= 4 << 20 && srv.0.try_wait().ok().flatten().is_none() {
                kill9(&mut srv);
            }
            match io::timeout(Duration::from_secs(30), s.read(&mut buf)).await {
                Ok(Ok(0)) => break Ok(s.peer_shut_down()),
                Ok(Ok(n)) => got += n as u64,
                Ok(Err(e)) => break Err(e.kind()),
                Err(e) => panic!("the reader hung after its peer was killed ({got} bytes read): {e}"),
            }
        };
        (write_end, (read_end, got))
    });
    println!("killed peer: mid-write {write_end:?}; mid-read {read_end:?}");
    assert!(
        matches!(write_end.0, ErrorKind::BrokenPipe | ErrorKind::ConnectionReset | ErrorKind::TimedOut),
        "a typed error for the writer: {write_end:?}"
    );
    assert!(write_end.1 >= 4 << 20);
    assert_eq!(read_end.0, Err(ErrorKind::ConnectionReset), "no marker from a killed peer: it vanished");
    assert!(read_end.1 >= 4 << 20 && read_end.1 < 16 << 20, "the response was cut short: {read_end:?}");
}

/// Interop with the message API (issue 31 item 4): a stream against the `echo` (callbacks)
/// and `aecho` (async messages) servers, which know nothing of streams. Each echoes every
/// message as it came, the empty end-of-stream marker included, so the stream reads every byte
/// back and then its own marker as the end.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_stream_against_the_message_echo_servers_reads_its_bytes_and_its_end_back() {
    let _w = Watchdog::new("interop", Duration::from_secs(120));
    for server in ["echo", "aecho"] {
        let (got, marked) = drive(Config::default(), |a| async move {
            let at = a.to_string();
            let srv = Proc::spawn("server", bin(server), &["server", "--bind", &at, "--exit-after", "1", "--quiet"]);
            wait_listening(a, Duration::from_secs(30));
            let opts = ConnectOptions { msg_size: 16 * 1024, ..ConnectOptions::default() };
            let s = Stream::new(Connection::connect(a, opts).await.expect("connect"));
            let (mut rd, mut wr) = tokio::io::split(s);
            let bytes = Bytes::new();
            let (_, got) =
                tokio::join!(write_stream(&mut wr, &bytes, 9, 1 << 20, 10_000), read_stream(&mut rd, &bytes, 9));
            let s = rd.unsplit(wr);
            let marked = s.peer_shut_down();
            // Both ends are in: the stream closes the connection (on iWARP with the close
            // handshake, which needs this reactor's ticks: wait without blocking them).
            let why = io::timeout(Duration::from_secs(30), s.connection().closed()).await.expect("closed");
            assert!(why.is_clean(), "{why:?}");
            drop(s);
            let mut srv = srv;
            let t = Instant::now();
            let st = loop {
                if let Some(st) = srv.0.try_wait().expect("try_wait") {
                    break st;
                }
                assert!(t.elapsed() < Duration::from_secs(30), "the {server} server did not exit");
                io::sleep(Duration::from_millis(50)).await.expect("sleep");
            };
            assert!(st.success(), "{server} server: {st}");
            (got.expect("read"), marked)
        });
        println!("a stream against the {server} server: {got} bytes back, its marker back as the end: {marked}");
        assert_eq!((got, marked), (1 << 20, true));
    }
}
