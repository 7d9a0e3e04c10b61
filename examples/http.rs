//! HTTP/1.1 over RDMA: hyper 1 on `io::Stream` (issue 31 item 2), under the tokio driver.
//!
//! ```text
//! http server --bind ADDR:PORT [--exit-after N] [--quiet]
//! http client --connect ADDR:PORT [--clients K] [--requests N] [--max-body BYTES]
//! ```
//!
//! The server is hyper's `http1::Builder::serve_connection` over
//! `hyper_util::rt::TokioIo<Stream>`, one task of the reactor per connection; it answers
//! `POST /echo` with the request's body and `GET /bytes/LEN/SEED` with LEN bytes of a pattern.
//! The client opens K connections (hyper's `http1::handshake`, one task each) and makes N
//! requests over them, alternating the two kinds, with bodies from 0 B to `--max-body` (1 MiB
//! by default), and checks every byte of every response. Everything runs on one reactor thread
//! inside one tokio current-thread runtime (`io::tokio::drive`): hyper's timers are tokio's,
//! which work in the reactor's tasks there.

mod common;

use std::cell::RefCell;
use std::convert::Infallible;
use std::process::exit;
use std::rc::Rc;
use std::time::{Duration, Instant};

use common::{fill_pattern, Args};
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use rdma_reactor::io::{self, Connection, Listener, Stream};
use rdma_reactor::{Config, ConnectOptions, Reactor};

const USAGE: &str = "\
usage: http server --bind ADDR:PORT [--exit-after N] [--quiet]
       http client --connect ADDR:PORT [--clients K] [--requests N] [--max-body BYTES]

HTTP/1.1 (hyper 1) over RDMA byte streams (rdma_reactor::io::Stream), on one reactor thread.
server: POST /echo answers with the request's body; GET /bytes/LEN/SEED with LEN pattern bytes.
  --bind ADDR:PORT     address of an RDMA device to listen on
  --exit-after N       exit after N connections have ended (default: run until killed)
  --quiet              no per-connection lines
client: N requests over K connections, every response byte verified; exits 1 on any mismatch.
  --connect ADDR:PORT  the server
  --clients K          connections (default 4)
  --requests N         requests in all (default 2000), spread over the connections
  --max-body BYTES     largest body, 0 to 16M (suffixes K, M; default 1M)";

/// The stream's message size: 64 KiB messages carry a 1 MiB body in 16.
const MSG: u32 = 64 * 1024;

fn main() {
    common::observe::init_logging("http");
    let mut argv = std::env::args().skip(1);
    match argv.next().as_deref() {
        Some("server") => server(Args::parse(argv, &["quiet"], USAGE)),
        Some("client") => client(Args::parse(argv, &[], USAGE)),
        Some("--help") | Some("-h") => println!("{USAGE}"),
        _ => common::fail(USAGE, "the first argument is `server` or `client`"),
    }
}

/// Runs `program` on a new reactor inside a tokio current-thread runtime.
fn run<T>(program: impl std::future::Future<Output = T>) -> T {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| common::die("http", &format!("cannot start tokio: {e}")));
    let mut reactor = Reactor::with_config(Config::default())
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
    let len: usize = len.parse().ok().filter(|l| *l <= 16 << 20)?;
    Some((len, seed.parse().ok()?))
}

async fn handle(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let reply = |status: StatusCode, body: Bytes| {
        let mut r = Response::new(Full::new(body));
        *r.status_mut() = status;
        Ok(r)
    };
    match (req.method(), req.uri().path()) {
        (&Method::POST, "/echo") => match req.into_body().collect().await {
            Ok(b) => reply(StatusCode::OK, b.to_bytes()),
            Err(e) => reply(StatusCode::BAD_REQUEST, Bytes::from(format!("reading the body: {e}\n"))),
        },
        (&Method::GET, path) => match bytes_path(path) {
            Some((len, seed)) => reply(StatusCode::OK, Bytes::from(body(len, seed))),
            None => reply(StatusCode::NOT_FOUND, Bytes::from_static(b"GET /bytes/LEN/SEED or POST /echo\n")),
        },
        _ => reply(StatusCode::METHOD_NOT_ALLOWED, Bytes::from_static(b"GET /bytes/LEN/SEED or POST /echo\n")),
    }
}

fn server(args: Args) {
    args.finish(&["bind", "exit-after"]);
    let addr = args.addr("bind");
    let exit_after: u64 = args.get("exit-after", 0);
    let quiet = args.switch("quiet");
    let ended = Rc::new(RefCell::new(0u64));
    let result = run(async move {
        let listener = Listener::bind(addr)?;
        println!("http server: listening on {addr}");
        while exit_after == 0 || *ended.borrow() < exit_after {
            // Accept until enough connections have ended (checked between accepts and by a
            // periodic look, so the last one's end is seen without another accept).
            let next = io::timeout(Duration::from_millis(200), listener.accept()).await;
            let conn = match next {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => return Err(e),
                Err(_) => continue,
            };
            let peer = conn.peer_addr();
            let ended = ended.clone();
            let _task = io::spawn(async move {
                let io = TokioIo::new(Stream::new(conn));
                let served = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .serve_connection(io, hyper::service::service_fn(handle))
                    .await;
                if !quiet {
                    match served {
                        Ok(()) => println!("http server: {peer:?} done"),
                        Err(e) => println!("http server: {peer:?} ended: {e}"),
                    }
                }
                *ended.borrow_mut() += 1;
            })?;
        }
        Ok(())
    });
    if let Err(e) = result {
        common::die("http server", &common::report(&e));
    }
}

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

async fn one_connection(addr: std::net::SocketAddr, first: u64, count: u64, total: u64, max: usize) -> Outcome {
    let opts = ConnectOptions { msg_size: MSG, ..ConnectOptions::default() };
    let conn = Connection::connect(addr, opts).await.map_err(|e| format!("connect: {e}"))?;
    let (mut send, driver) = hyper::client::conn::http1::Builder::new()
        .handshake(TokioIo::new(Stream::new(conn)))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    let driver = io::spawn(driver).map_err(|e| format!("spawn: {e}"))?;
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
    // Closing the sender ends the connection's driver, which shuts the stream down.
    drop(send);
    match driver.await {
        Ok(Ok(())) => Ok((requests, bytes)),
        Ok(Err(e)) => Err(format!("the connection ended with {e}")),
        Err(_) => Err("the connection's task panicked".into()),
    }
}

fn client(args: Args) {
    args.finish(&["connect", "clients", "requests", "max-body"]);
    let addr = args.addr("connect");
    let clients: u64 = args.get("clients", 4).max(1);
    let total: u64 = args.get("requests", 2000);
    let max = args.size("max-body", 1 << 20);
    if max > 16 << 20 {
        common::fail(USAGE, "--max-body is at most 16M");
    }
    let t0 = Instant::now();
    let outcomes = run(async move {
        let mut tasks = Vec::new();
        let mut first = 0;
        for k in 0..clients {
            let count = total / clients + u64::from(k < total % clients);
            tasks.push(io::spawn(one_connection(addr, first, count, total, max))?);
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
         (bodies 0 to {max} B), in {secs:.1} s"
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
