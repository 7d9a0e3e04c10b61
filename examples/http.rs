//! HTTP/1.1 over RDMA: hyper 1 on `io::Stream` (issue 31 item 2; a deployable server, issue
//! 46), under the tokio driver.
//!
//! ```text
//! http server --bind ADDR:PORT [--max-body BYTES] [--header-timeout SECS] [--body-timeout SECS]
//!             [--connection-timeout SECS] [--max-connections N] [--exit-after N] [--tcp] [--quiet]
//! http client --connect ADDR:PORT [--clients K] [--requests N] [--max-body BYTES] [--tcp]
//! ```
//!
//! The server is hyper's `http1::Builder::serve_connection` over
//! `hyper_util::rt::TokioIo<Stream>`, one task per connection, started with
//! `tokio::task::spawn_local` as a hyper server would (the tokio driver runs such tasks where
//! the reactor is at hand); it answers `POST /echo` with the request's body and
//! `GET /bytes/LEN/SEED` with LEN bytes of a pattern. What a peer can make it hold is bounded:
//! a request body above `--max-body` (16 MiB by default) is refused with 413 (at once when its
//! `content-length` says so, else once that much arrived: `http_body_util::Limited`), a body
//! that has not all arrived within `--body-timeout` seconds (30 by default) is answered with
//! 408, a response body is at most 16 MiB, a connection that has not sent a whole request head
//! within `--header-timeout` seconds (10 by default) is closed by hyper, and every connection
//! is closed after `--connection-timeout` seconds (600 by default: a client that never reads
//! its response holds it no longer). In total: at most `--max-connections` (64 by default) are
//! open at once (`Config::max_connections`: a connect request beyond them is refused with
//! `NoResources`; over TCP the next is accepted when one ends), so the heap holds at most
//! max-connections x (max-body + 16 MiB), 2 GiB at the defaults, and the pool what its
//! `PoolConfig` allows. (64 clients that never read their 16 MiB answers hold every connection
//! for `--connection-timeout`: the flags bound memory and time, not who gets served.) It prints one line per
//! connection that ended with an error (and, without `--quiet`, per connection that ended
//! cleanly), and at exit how many ended cleanly.
//!
//! The client opens K connections (hyper's `http1::handshake`, one task each) and makes N
//! requests over them, alternating the two kinds, with bodies from 0 B to `--max-body` (1 MiB
//! by default), and checks every byte of every response. It ends each connection as hyper's
//! own client does: it drops the request sender, and the connection's task shuts the stream
//! down and drops it. Everything runs on one reactor thread inside one tokio current-thread
//! runtime (`io::tokio::drive`): hyper's timers are tokio's, which work in the driver's tasks.
//!
//! `--tcp` runs the same over TCP (`tokio::net`), the control of `tests/stream.rs`'s HTTP case:
//! the same code, the same requests, another byte stream.

mod common;

use std::cell::RefCell;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::exit;
use std::rc::Rc;
use std::time::{Duration, Instant};

use common::{fill_pattern, Args};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use rdma_reactor::io::{self, Connection, Listener, Stream};
use rdma_reactor::{Config, ConnectOptions, Reactor};

const USAGE: &str = "\
usage: http server --bind ADDR:PORT [--max-body BYTES] [--header-timeout SECS] [--body-timeout SECS]
                   [--connection-timeout SECS] [--max-connections N] [--exit-after N] [--tcp] [--quiet]
       http client --connect ADDR:PORT [--clients K] [--requests N] [--max-body BYTES] [--tcp]

HTTP/1.1 (hyper 1) over RDMA byte streams (rdma_reactor::io::Stream), on one reactor thread.
server: POST /echo answers with the request's body; GET /bytes/LEN/SEED with LEN pattern bytes.
  --bind ADDR:PORT       address of an RDMA device to listen on
  --max-body BYTES       largest request body; a larger one is refused with 413 (default 16M)
  --header-timeout SECS  a connection must send a request head within this (default 10)
  --body-timeout SECS    a request body must arrive within this, else 408 (default 30)
  --connection-timeout SECS  a connection is closed after this, whatever it does (default 600)
  --max-connections N    connections open at once; more are refused (default 64)
  --exit-after N         exit after N connections have ended (default: run until killed)
  --tcp                  serve over TCP instead (the control)
  --quiet                no line for a connection that ended cleanly
client: N requests over K connections, every response byte verified; exits 1 on any mismatch.
  --connect ADDR:PORT    the server
  --clients K            connections (default 4)
  --requests N           requests in all (default 2000), spread over the connections
  --max-body BYTES       largest body, 0 to 16M (suffixes K, M; default 1M)
  --tcp                  over TCP instead (the control)";

/// The stream's message size: 64 KiB messages carry a 1 MiB body in 16.
const MSG: u32 = 64 * 1024;

/// The largest body `GET /bytes` answers with.
const MAX_RESPONSE: usize = 16 << 20;

fn main() {
    common::observe::init_logging("http");
    let mut argv = std::env::args().skip(1);
    match argv.next().as_deref() {
        Some("server") => server(Args::parse(argv, &["quiet", "tcp"], USAGE)),
        Some("client") => client(Args::parse(argv, &["tcp"], USAGE)),
        Some("--help") | Some("-h") => println!("{USAGE}"),
        _ => common::fail(USAGE, "the first argument is `server` or `client`"),
    }
}

/// Runs `program` on a new reactor inside a tokio current-thread runtime.
fn run<T>(program: impl std::future::Future<Output = T>) -> T {
    run_with(Config::default(), program)
}

/// [`run`] on a reactor with `cfg`.
fn run_with<T>(cfg: Config, program: impl std::future::Future<Output = T>) -> T {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| common::die("http", &format!("cannot start tokio: {e}")));
    let mut reactor = Reactor::with_config(cfg)
        .unwrap_or_else(|e| common::die("http", &format!("cannot start: {}", common::report(&e))));
    let outcome = rt.block_on(async {
        match io::tokio::drive(&mut reactor, program) {
            Ok(driven) => driven.await,
            Err(e) => Err(e),
        }
    });
    outcome.unwrap_or_else(|e| common::die("http", &format!("the reactor failed: {}", common::report(&e))))
}

/// The bytes of `GET /bytes/LEN/SEED` (and of the client's request bodies): connection 0,
/// message SEED of the examples' pattern.
fn body(len: usize, seed: u64) -> Vec<u8> {
    let mut b = vec![0u8; len];
    fill_pattern(&mut b, 0, seed);
    b
}

// ----- server -------------------------------------------------------------------------------

/// `GET /bytes/LEN/SEED`'s length and seed, if the path is one (LEN at most 16 MiB).
fn bytes_path(path: &str) -> Option<(usize, u64)> {
    let rest = path.strip_prefix("/bytes/")?;
    let (len, seed) = rest.split_once('/')?;
    let len: usize = len.parse().ok().filter(|l| *l <= MAX_RESPONSE)?;
    Some((len, seed.parse().ok()?))
}

/// A request's `content-length`, when it states one (and it parses).
fn content_length(req: &Request<Incoming>) -> Option<u64> {
    req.headers().get(hyper::header::CONTENT_LENGTH)?.to_str().ok()?.trim().parse().ok()
}

/// The response to one request; request bodies are read up to `max_body` bytes, for at most
/// `body_timeout`.
async fn handle(
    req: Request<Incoming>,
    max_body: usize,
    body_timeout: Duration,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let reply = |status: StatusCode, body: Bytes| {
        let mut r = Response::new(Full::new(body));
        *r.status_mut() = status;
        Ok(r)
    };
    let too_large = || {
        let msg = format!("the request body is larger than this server takes ({max_body} bytes)\n");
        reply(StatusCode::PAYLOAD_TOO_LARGE, Bytes::from(msg))
    };
    match (req.method(), req.uri().path()) {
        (&Method::POST, "/echo") => {
            if content_length(&req).is_some_and(|n| n > max_body as u64) {
                // Refused before a byte of it is read (hyper closes the connection after the
                // answer: the rest of the body is not read).
                return too_large();
            }
            // A body without a length (chunked) is cut at the limit as it comes.
            match tokio::time::timeout(body_timeout, Limited::new(req.into_body(), max_body).collect()).await {
                Ok(Ok(b)) => reply(StatusCode::OK, b.to_bytes()),
                Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => too_large(),
                Ok(Err(e)) => reply(StatusCode::BAD_REQUEST, Bytes::from(format!("reading the body: {e}\n"))),
                Err(_) => {
                    let msg = format!("the request body did not arrive within {} s\n", body_timeout.as_secs());
                    reply(StatusCode::REQUEST_TIMEOUT, Bytes::from(msg))
                }
            }
        }
        (&Method::GET, path) => match bytes_path(path) {
            Some((len, seed)) => reply(StatusCode::OK, Bytes::from(body(len, seed))),
            None => reply(StatusCode::NOT_FOUND, Bytes::from_static(b"GET /bytes/LEN/SEED or POST /echo\n")),
        },
        _ => reply(StatusCode::METHOD_NOT_ALLOWED, Bytes::from_static(b"GET /bytes/LEN/SEED or POST /echo\n")),
    }
}

/// What the server's connections did: ended cleanly, and ended with an error.
#[derive(Default)]
struct Ended {
    clean: u64,
    failed: u64,
}

/// The server's limits.
#[derive(Clone, Copy)]
struct Limits {
    max_body: usize,
    header_timeout: Duration,
    body_timeout: Duration,
    connection_timeout: Duration,
}

/// Serves one connection with hyper; counts and reports how it ended.
async fn serve<S>(io: S, peer: String, limits: Limits, quiet: bool, ended: Rc<RefCell<Ended>>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + 'static,
{
    let Limits { max_body, header_timeout, body_timeout, connection_timeout } = limits;
    // Counts this connection's end even if the task is dropped or panics (its slot among
    // `--max-connections` comes back).
    let mut guard = EndGuard { ended: ended.clone(), peer: peer.clone(), counted: false };
    let serving = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .serve_connection(TokioIo::new(io), hyper::service::service_fn(move |req| handle(req, max_body, body_timeout)));
    // Bounded in time whatever the peer does (hyper has no timeout for a response its peer
    // does not read): dropped at the limit, which drops the stream (a lingering close).
    let served = tokio::time::timeout(connection_timeout, serving).await;
    guard.counted = true;
    let mut ended = ended.borrow_mut();
    match served {
        Err(_) => {
            ended.failed += 1;
            println!("http server: {peer} closed after its {} s (--connection-timeout)", connection_timeout.as_secs());
        }
        Ok(Ok(())) => {
            ended.clean += 1;
            if !quiet {
                println!("http server: {peer} done");
            }
        }
        Ok(Err(e)) => {
            ended.failed += 1;
            // The error and what caused it (hyper's own words, then the stream's).
            let mut why = e.to_string();
            let mut cause = std::error::Error::source(&e);
            while let Some(c) = cause {
                why.push_str(": ");
                why.push_str(&c.to_string());
                cause = c.source();
            }
            println!("http server: {peer} ended with an error: {why}");
        }
    }
}

/// Counts a connection's end as failed when its task ended without counting it.
struct EndGuard {
    ended: Rc<RefCell<Ended>>,
    peer: String,
    counted: bool,
}

impl Drop for EndGuard {
    fn drop(&mut self) {
        if !self.counted {
            if let Ok(mut e) = self.ended.try_borrow_mut() {
                e.failed += 1;
            }
            println!("http server: {} ended without an outcome (its task was dropped)", self.peer);
        }
    }
}

fn server(args: Args) {
    args.finish(&[
        "bind",
        "max-body",
        "header-timeout",
        "body-timeout",
        "connection-timeout",
        "max-connections",
        "exit-after",
        "quiet",
        "tcp",
    ]);
    let addr = args.addr("bind");
    let secs = |name: &str, default: u64| Duration::from_secs(args.get(name, default).max(1));
    let limits = Limits {
        max_body: args.size("max-body", 16 << 20),
        header_timeout: secs("header-timeout", 10),
        body_timeout: secs("body-timeout", 30),
        connection_timeout: secs("connection-timeout", 600),
    };
    let max_connections: u64 = args.get("max-connections", 64u64).max(1);
    let exit_after: u64 = args.get("exit-after", 0);
    let quiet = args.switch("quiet");
    let tcp = args.switch("tcp");
    let ended = Rc::new(RefCell::new(Ended::default()));
    let counts = ended.clone();
    // The reactor admits at most `--max-connections` at once: a connect request beyond them is
    // refused (`NoResources`), none waits established and unserved.
    let cfg = Config { max_connections: max_connections as usize, ..Config::default() };
    let result = run_with(cfg, async move {
        let listener = if tcp {
            let bound = tokio::net::TcpListener::bind(addr).await;
            Accepting::Tcp(bound.map_err(|source| rdma_reactor::Error::Os { call: "bind (TCP)", source })?)
        } else {
            Accepting::Rdma(Listener::bind(addr)?)
        };
        println!("http server: listening on {addr}{}", if tcp { " (TCP)" } else { "" });
        let done = |e: &Ended| exit_after > 0 && e.clean + e.failed >= exit_after;
        let mut accepted = 0u64;
        while !done(&ended.borrow()) {
            let open = {
                let e = ended.borrow();
                accepted - (e.clean + e.failed)
            };
            if open >= max_connections {
                // At the limit (over TCP; over RDMA the reactor refuses beyond it, and a
                // connection closing still counts there): the next is accepted when one ends.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
            // Accept until enough connections have ended (checked between accepts and by a
            // periodic look, so the last one's end is seen without another accept).
            let limit = Duration::from_millis(200);
            let (io, peer): (Box<dyn Io>, String) = match &listener {
                Accepting::Rdma(l) => match io::timeout(limit, l.accept()).await {
                    Ok(Ok(conn)) => {
                        let peer = format!("{:?}", conn.peer_addr());
                        (Box::new(Stream::new(conn)), peer)
                    }
                    Ok(Err(e)) => return Err(e),
                    Err(_) => continue,
                },
                Accepting::Tcp(l) => match tokio::time::timeout(limit, l.accept()).await {
                    Ok(Ok((sock, peer))) => (Box::new(sock), format!("{peer}")),
                    Ok(Err(e)) => return Err(rdma_reactor::Error::Os { call: "accept (TCP)", source: e }),
                    Err(_) => continue,
                },
            };
            // A task per connection, as a hyper server makes it: `spawn_local` (the driver
            // runs it where the reactor is at hand).
            accepted += 1;
            drop(tokio::task::spawn_local(serve(io, peer, limits, quiet, ended.clone())));
        }
        Ok(())
    });
    if let Err(e) = result {
        common::die("http server", &common::report(&e));
    }
    let e = counts.borrow();
    println!("http server: {} connections ended, {} cleanly, {} with an error", e.clean + e.failed, e.clean, e.failed);
}

/// Where the server's connections come from.
enum Accepting {
    Rdma(Listener),
    Tcp(tokio::net::TcpListener),
}

/// A byte stream hyper can serve: an RDMA stream or a TCP socket.
trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin {}

impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin> Io for T {}

// ----- client -------------------------------------------------------------------------------

/// The body size of request `i` of `n`: 0, 1, and sizes spread up to `max` (every tenth
/// request `max` itself), so the small and the large both go over every connection.
fn size_of(i: u64, n: u64, max: usize) -> usize {
    match i % 10 {
        0 => (i / 10 % 2) as usize * max.min(1),
        9 => max,
        _ => ((i.wrapping_mul(0x9E37_79B9) % (n.max(1) * 997)) as usize * 7919) % (max + 1),
    }
}

/// What one connection's requests did: requests and body bytes verified, or the first
/// mismatch.
type Outcome = Result<(u64, u64), String>;

/// Connects over RDMA, or TCP with `tcp`.
async fn connect(addr: SocketAddr, tcp: bool) -> Result<Box<dyn Io>, String> {
    if tcp {
        let sock = tokio::net::TcpStream::connect(addr).await.map_err(|e| format!("connect (TCP): {e}"))?;
        return Ok(Box::new(sock));
    }
    let opts = ConnectOptions { msg_size: MSG, ..ConnectOptions::default() };
    let conn = Connection::connect(addr, opts).await.map_err(|e| format!("connect: {e}"))?;
    Ok(Box::new(Stream::new(conn)))
}

async fn one_connection(addr: SocketAddr, tcp: bool, first: u64, count: u64, total: u64, max: usize) -> Outcome {
    let io = connect(addr, tcp).await?;
    let (mut send, driver) = hyper::client::conn::http1::Builder::new()
        .handshake(TokioIo::new(io))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    let driver = tokio::task::spawn_local(driver);
    let (mut requests, mut bytes) = (0u64, 0u64);
    for i in first..first + count {
        let len = size_of(i, total, max);
        let (req, want) = if i % 2 == 0 {
            let b = body(len, i);
            let req = Request::post("/echo").header("host", "rdma").body(Full::new(Bytes::from(b.clone())));
            (req, b)
        } else {
            let req = Request::get(format!("/bytes/{len}/{i}")).header("host", "rdma").body(Full::new(Bytes::new()));
            (req, body(len, i))
        };
        let req = req.map_err(|e| format!("request {i}: {e}"))?;
        send.ready().await.map_err(|e| format!("request {i}: the connection: {e}"))?;
        let resp = send.send_request(req).await.map_err(|e| format!("request {i}: {e}"))?;
        if resp.status() != StatusCode::OK {
            return Err(format!("request {i}: status {}", resp.status()));
        }
        let got = resp.into_body().collect().await.map_err(|e| format!("request {i}: body: {e}"))?.to_bytes();
        if got.len() != want.len() {
            return Err(format!("request {i}: {} bytes, expected {}", got.len(), want.len()));
        }
        if let Some(at) = got.iter().zip(&want).position(|(a, b)| a != b) {
            return Err(format!("request {i}: byte {at} of {} differs", want.len()));
        }
        requests += 1;
        bytes += (len * if i % 2 == 0 { 2 } else { 1 }) as u64;
    }
    // As hyper's client ends a connection: the sender dropped, the connection's task shuts
    // the stream down and drops it.
    drop(send);
    match driver.await {
        Ok(Ok(())) => Ok((requests, bytes)),
        Ok(Err(e)) => Err(format!("the connection ended with {e}")),
        Err(e) => Err(format!("the connection's task: {e}")),
    }
}

fn client(args: Args) {
    args.finish(&["connect", "clients", "requests", "max-body", "tcp"]);
    let addr = args.addr("connect");
    let clients: u64 = args.get("clients", 4).max(1);
    let total: u64 = args.get("requests", 2000);
    let max = args.size("max-body", 1 << 20);
    let tcp = args.switch("tcp");
    if max > MAX_RESPONSE {
        common::fail(USAGE, "--max-body is at most 16M");
    }
    let t0 = Instant::now();
    let outcomes = run(async move {
        let mut tasks = Vec::new();
        let mut first = 0;
        for k in 0..clients {
            let count = total / clients + u64::from(k < total % clients);
            tasks.push(io::spawn(one_connection(addr, tcp, first, count, total, max))?);
            first += count;
        }
        let mut outcomes = Vec::new();
        for t in tasks {
            outcomes.push(t.await.unwrap_or_else(|_| Err("a connection's task panicked".into())));
        }
        Ok::<_, rdma_reactor::Error>(outcomes)
    });
    let outcomes = outcomes.unwrap_or_else(|e| common::die("http client", &common::report(&e)));
    let secs = t0.elapsed().as_secs_f64();
    let (mut requests, mut bytes, mut failed) = (0, 0, 0);
    for (k, o) in outcomes.iter().enumerate() {
        match o {
            Ok((r, b)) => {
                requests += r;
                bytes += b;
            }
            Err(e) => {
                failed += 1;
                eprintln!("http client: connection {k}: {e}");
            }
        }
    }
    println!(
        "http client: {requests} of {total} requests over {clients} connections verified, {bytes} body bytes \
         (bodies 0 to {max} B){}, in {secs:.1} s",
        if tcp { " over TCP" } else { "" }
    );
    if failed > 0 || requests != total {
        exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_cover_empty_one_byte_and_the_maximum() {
        let sizes: Vec<usize> = (0..100).map(|i| size_of(i, 100, 1 << 20)).collect();
        assert!(sizes.contains(&0) && sizes.contains(&1) && sizes.contains(&(1 << 20)));
        assert!(sizes.iter().all(|s| *s <= 1 << 20));
        assert!(sizes.iter().filter(|s| **s > 0 && **s < 1 << 20).count() > 50);
    }

    #[test]
    fn only_well_formed_paths_are_served() {
        assert_eq!(bytes_path("/bytes/10/3"), Some((10, 3)));
        assert_eq!(bytes_path("/bytes/99999999999/3"), None);
        assert_eq!(bytes_path("/bytes/x/3"), None);
        assert_eq!(bytes_path("/echo"), None);
    }
}
