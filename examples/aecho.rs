//! The echo protocol written with async/await (`rdma_reactor::io`), interoperable with `echo`
//! both ways: an `aecho client` against an `echo server`, an `echo client` against an
//! `aecho server`.
//!
//! ```text
//! aecho server --bind ADDR:PORT [--exit-after N] [--quiet] [--spin-us N]
//! aecho client --connect ADDR:PORT --size BYTES --count N [--verify] [--clients K] [--spin-us N]
//! ```
//!
//! The server runs one task per connection (`recv`, then `send` of the same buffer); the
//! client one task per connection (send message `seq`, await its echo, verify it), all on one
//! reactor thread. Output lines are `echo`'s, with `aecho` in place of `echo`.

mod common;

use std::cell::RefCell;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::process::exit;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use common::{check_pattern, fill_pattern, Args};
use rdma_reactor::io::{self, Connection, Listener};
use rdma_reactor::{Config, ConnectOptions, Error, Reactor};

const USAGE: &str = "\
usage: aecho server --bind ADDR:PORT [--max-size BYTES] [--exit-after N] [--quiet] [--spin-us N]
                    [--srq [--srq-receives N] [--srq-credit N] [--srq-max-credit N] [--srq-reserve N] [--srq-size BYTES]]
                    [--sleep-first-ms N]
       aecho client --connect ADDR:PORT --size BYTES --count N [--verify] [--clients K] [--spin-us N]

The echo protocol with async/await: one task per connection, on one reactor thread.
server: echoes every message on every connection.
  --bind ADDR:PORT     address of an RDMA device to listen on
  --max-size BYTES     the largest message a connection may send (suffixes K, M; default 64K,
                       the library's Config::msg_size; at most 1M): each connection receives
                       messages of its client's --size within this, 64 receives of it
  --exit-after N       exit after N connections have closed (default: run until killed)
  --quiet              no per-connection lines
  --spin-us N          (both) poll for N microseconds after work before sleeping (default 0)
  --srq                receives from one shared receive queue the runtime keeps filled (the
                       --srq-* flags as echo's); a connection's task that reads slowly holds
                       at most its share of messages unread: its peer's credit shrinks
  --sleep-first-ms N   test hook: the first connection's task sleeps N ms before it reads
                       (a task that does not read, while its peer sends)
client: ping-pongs messages and reports round-trip latency.
  --connect ADDR:PORT  the server (an aecho or echo server)
  --size BYTES         message size, 1 to 1M (suffixes K, M)
  --count N            messages per connection
  --verify             check every echoed byte
  --clients K          connections (tasks) from one reactor (default 1)";

fn main() {
    common::observe::init_logging("aecho");
    let mut argv = std::env::args().skip(1);
    match argv.next().as_deref() {
        Some("server") => server(Args::parse(argv, &["quiet", "srq"], USAGE)),
        Some("client") => client(Args::parse(argv, &["verify"], USAGE)),
        Some("--help") | Some("-h") => println!("{USAGE}"),
        _ => common::fail(USAGE, "the first argument is `server` or `client`"),
    }
}

fn reactor(cfg: Config) -> Reactor {
    Reactor::with_config(cfg).unwrap_or_else(|e| common::die("aecho", &format!("cannot start: {}", common::report(&e))))
}

// ----- server -------------------------------------------------------------------------------

/// What the server's tasks count, and the task waiting for `--exit-after` closes.
#[derive(Default)]
struct Served {
    closed: u64,
    messages: u64,
    waiter: Option<Waker>,
}

/// Resolves once `n` connections have closed.
struct Closed {
    served: Rc<RefCell<Served>>,
    n: u64,
}

impl Future for Closed {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let mut s = self.served.borrow_mut();
        if s.closed >= self.n {
            return Poll::Ready(());
        }
        s.waiter = Some(cx.waker().clone());
        Poll::Pending
    }
}

/// Echoes every message of `conn` until it ends; returns the messages echoed and how it ended.
/// With `sleep`, the task first sleeps that long (`--sleep-first-ms`).
async fn serve(conn: Connection, sleep: Option<std::time::Duration>) -> (u64, String) {
    if let Some(d) = sleep {
        let _ = io::sleep(d).await;
    }
    let mut echoed = 0;
    loop {
        let msg = match conn.recv().await {
            Ok(m) => m,
            Err(Error::Closed(reason)) => return (echoed, reason.to_string()),
            Err(e) => return (echoed, format!("receive failed: {}", common::report(&e))),
        };
        // The echo is submitted as its future is made. Not awaiting it lets the next message
        // be taken at once, as the callback server does: its completion returns the buffer
        // to the pool, and a failure closes the connection, which the next recv reports.
        drop(conn.send(msg));
        echoed += 1;
    }
}

/// Accepts for ever, one task per connection.
async fn accept_loop(
    listener: Listener,
    served: Rc<RefCell<Served>>,
    quiet: bool,
    mut sleep_first: Option<std::time::Duration>,
) -> Result<(), Error> {
    loop {
        let conn = listener.accept().await?;
        let sleep = sleep_first.take();
        if let Some(d) = sleep {
            println!("aecho server: {:?} sleeps {} ms before it reads (test hook)", conn.token(), d.as_millis());
        }
        if !quiet {
            let peer = conn.peer_addr().map_or("?".into(), |p| p.to_string());
            println!("aecho server: {:?} established with {peer}", conn.token());
        }
        let served = served.clone();
        // Detached: the task reports its end through `served`.
        let _task = io::spawn(async move {
            let token = conn.token();
            let (echoed, why) = serve(conn, sleep).await;
            if !quiet {
                println!("aecho server: {token:?} closed after {echoed} messages: {why}");
            }
            let mut s = served.borrow_mut();
            s.closed += 1;
            s.messages += echoed;
            if let Some(w) = s.waiter.take() {
                w.wake();
            }
        })?;
    }
}

fn server(args: Args) {
    args.finish(
        &[&["bind", "max-size", "exit-after", "quiet", "srq", "spin-us", "sleep-first-ms"][..], &Args::SRQ[..]]
            .concat(),
    );
    let sleep_first =
        Some(args.get::<u64>("sleep-first-ms", 0)).filter(|ms| *ms > 0).map(std::time::Duration::from_millis);
    let addr = args.addr("bind");
    let exit_after: u64 = args.get("exit-after", 0);
    let quiet = args.switch("quiet");
    // Each connection's receives: its client's --size within --max-size (`io::Listener`).
    let max_size = args.size("max-size", Config::default().msg_size as usize);
    if !(1..=1024 * 1024).contains(&max_size) {
        common::fail(USAGE, "--max-size must be 1 to 1M bytes");
    }
    let cfg = args.with_srq(Config { msg_size: max_size as u32, spin: args.spin(), ..Config::default() });
    let mut reactor = reactor(cfg);
    let served = Rc::new(RefCell::new(Served::default()));
    let listener = reactor
        .block_on(async { Listener::bind(addr) })
        .and_then(|r| r)
        .unwrap_or_else(|e| common::die("aecho server", &format!("cannot listen on {addr}: {}", common::report(&e))));
    println!("aecho server: listening on {addr} (pid {})", std::process::id());
    let accept = reactor.spawn(accept_loop(listener, served.clone(), quiet, sleep_first));
    let outcome = if exit_after == 0 {
        reactor.block_on(accept).map(|r| match r {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(format!("listener failed: {}", common::report(&e))),
            Err(_) => Err("the accept task panicked".to_string()),
        })
    } else {
        reactor.block_on(Closed { served: served.clone(), n: exit_after }).map(Ok)
    };
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(msg)) => common::die("aecho server", &msg),
        Err(e) => common::die("aecho server", &format!("reactor failed: {}", common::report(&e))),
    }
    let s = served.borrow();
    println!("aecho server: {} connections closed, {} messages echoed; exiting", s.closed, s.messages);
}

// ----- client -------------------------------------------------------------------------------

/// One connection's ping-pong; returns its round-trip times (counter ticks).
async fn ping(dst: SocketAddr, index: u64, size: usize, count: u64, verify: bool) -> Result<Vec<u64>, String> {
    let opts = ConnectOptions { msg_size: size as u32, msg_count: count as u32, ..Default::default() };
    let conn = Connection::connect(dst, opts).await.map_err(|e| format!("connect: {}", common::report(&e)))?;
    if let Some(max) = conn.peer_info().map(|i| i.msg_size as usize) {
        if size > max {
            return Err(format!("the server takes messages up to {max} bytes, not {size}"));
        }
    }
    let mut times = Vec::with_capacity(count as usize);
    let mut buf = conn.alloc(size).map_err(|e| format!("buffer: {}", common::report(&e)))?;
    fill_pattern(buf.as_mut_slice(), index, u64::MAX);
    for seq in 0..count {
        if verify {
            fill_pattern(buf.as_mut_slice(), index, seq);
        }
        let sent_at = common::Clock::ticks();
        // Submitted now; awaited after the echo, as the callback client takes its send buffer
        // back whenever the send completes.
        let sending = conn.send(buf);
        let echo = conn.recv().await.map_err(|e| format!("message {seq}: no echo: {}", common::report(&e)))?;
        times.push(common::Clock::ticks().wrapping_sub(sent_at));
        let (sent, back) = sending.await;
        sent.map_err(|e| format!("send {seq}: {}", common::report(&e)))?;
        if echo.len() != size {
            return Err(format!("message {seq}: echo of {} bytes, sent {size}", echo.len()));
        }
        if verify {
            if let Some(at) = check_pattern(echo.as_slice(), index, seq) {
                return Err(format!("message {seq}: echoed byte {at} differs"));
            }
        }
        buf = back.ok_or_else(|| format!("send {seq}: the buffer did not come back"))?;
    }
    let reason = conn.close().await;
    if !reason.is_clean() {
        return Err(format!("closed: {reason}"));
    }
    Ok(times)
}

fn client(args: Args) {
    args.finish(&["connect", "size", "count", "clients", "spin-us", "verify"]);
    let dst = args.addr("connect");
    let size = args.size("size", 0);
    if !(1..=1024 * 1024).contains(&size) {
        common::fail(USAGE, "--size must be 1 to 1M bytes");
    }
    let count: u64 = args.get("count", 0);
    let clients: u64 = args.get("clients", 1);
    if clients == 0 {
        common::fail(USAGE, "--clients must be at least 1");
    }
    let verify = args.switch("verify");
    let mut reactor = reactor(Config { send_depth: 4, recv_depth: 4, spin: args.spin(), ..Config::default() });
    let start = Instant::now();
    let mut clock = common::Clock::new();
    let results = reactor.block_on(async move {
        let tasks: Vec<_> = (0..clients)
            .map(|index| io::spawn(ping(dst, index, size, count, verify)).expect("on the reactor"))
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await);
        }
        out
    });
    let elapsed = start.elapsed();
    clock.calibrate();
    let results =
        results.unwrap_or_else(|e| common::die("aecho client", &format!("reactor failed: {}", common::report(&e))));
    let mut lat = Vec::new();
    let mut failures = Vec::new();
    for (index, r) in results.into_iter().enumerate() {
        match r {
            Ok(Ok(times)) => lat.extend(times.into_iter().map(|t| clock.ns(t))),
            Ok(Err(e)) => failures.push(format!("connection {index}: {e}")),
            Err(_) => failures.push(format!("connection {index}: its task panicked")),
        }
    }
    lat.sort_unstable();
    common::print_round_trips("aecho", &lat, size, clients, elapsed, verify);
    if !failures.is_empty() {
        for f in &failures {
            eprintln!("aecho client: FAILED {f}");
        }
        exit(1);
    }
}
