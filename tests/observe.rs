//! What an operator watches (issue 21): each connection's counters (`Conn::metrics`), the
//! Prometheus text (`Reactor::prometheus`) and the examples' `--metrics` endpoint while data
//! moves, and the runtime's log lines (`RUST_LOG`, feature `log`) over a session with a reject
//! and a killed client.

mod util;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rdma_reactor::{ConnectOptions, Reactor};
use util::*;

const LIMIT: Duration = Duration::from_secs(30);

/// The value of the sample of `family` whose labels contain `label`, in Prometheus text.
fn sample(text: &str, family: &str, label: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(&format!("{family}{{")) || l.starts_with(&format!("{family} ")))
        .filter(|l| l.contains(label))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

/// The sum of every sample of `family`.
fn total(text: &str, family: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{family}{{")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Each message and byte is counted once on each side: the client's counters from
/// `Conn`/`Reactor::conn_metrics`, the server's from its Prometheus text.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn each_message_and_byte_is_counted_on_both_sides() {
    const SIZE: usize = 100;
    let mut srv = Reactor::new().expect("server reactor");
    let a = addr();
    let closed = Default::default();
    let listener =
        srv.listen(a, EchoListener { depth: 4, agents_closed: std::rc::Rc::clone(&closed) }).expect("listen");
    let mut cli = Reactor::new().expect("client reactor");
    let (c, result) = PingClient::new(1, SIZE, 1000);
    let opts = ConnectOptions { msg_size: SIZE as u32, ..ConnectOptions::default() };
    let token = cli.connect(a, opts, c).expect("connect");
    pump(&mut [&mut srv, &mut cli], LIMIT, "40 echoes", || result.borrow().echoed >= 40);
    let echoed = result.borrow().echoed;
    let m = cli.conn_metrics(token).expect("the client connection lives");
    println!("client after {echoed} echoes: {m:?}");
    // The echo's receive completion was counted before the client's callback counted it.
    assert_eq!(m.recvs, echoed);
    assert_eq!(m.recv_bytes, echoed * SIZE as u64);
    // One message in flight: its send may not have completed yet.
    assert!(m.sends == echoed || m.sends == echoed + 1, "{m:?}");
    assert_eq!(m.send_bytes, m.sends * SIZE as u64);
    assert_eq!((m.writes, m.reads, m.errors), (0, 0, 0));
    let text = srv.prometheus(&[("reactor", "0")]);
    let peer = format!("peer=\"{}", a.ip());
    let recvs = sample(&text, "rdma_reactor_conn_recvs_total", &peer).expect("the agent's sample");
    assert!(recvs >= echoed as f64 && recvs <= echoed as f64 + 1.0, "{recvs} against {echoed}:\n{text}");
    assert_eq!(sample(&text, "rdma_reactor_connections", "reactor=\"0\""), Some(1.0), "{text}");
    assert!(text.contains("# TYPE rdma_reactor_conn_credit_wait_seconds_total counter\n"), "{text}");
    assert!(text.contains("# TYPE rdma_reactor_buffers_in_use gauge\n"), "{text}");
    assert_eq!(srv.conn_metrics(listener), None, "a listener has no connection counters");
    cli.ctx().close(token);
    pump(&mut [&mut srv, &mut cli], LIMIT, "both sides closed", || {
        result.borrow().closed.is_some() && closed.borrow().len() == 1
    });
    assert_eq!(cli.conn_metrics(token), None, "gone with its connection");
}

/// `GET path` on `addr`; the whole answer.
fn http_get(addr: SocketAddr, path: &str) -> String {
    http_get_with(addr, path, false)
}

/// `GET path` on `addr`, closing our side right after the request when `half_close` (as `nc`
/// and HTTP/1.0 clients do; the endpoint once dropped such a request unanswered when its end
/// arrived with it, as it does under load); the whole answer.
fn http_get_with(addr: SocketAddr, path: &str, half_close: bool) -> String {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10)).expect("connect to the metrics port");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    write!(s, "GET {path} HTTP/1.1\r\nHost: test\r\n\r\n").expect("request");
    if half_close {
        s.shutdown(std::net::Shutdown::Write).expect("close our side");
    }
    let mut out = String::new();
    s.read_to_string(&mut out).expect("answer");
    out
}

/// A blast run's per-connection counters move between two scrapes of the server's
/// `--metrics` endpoint, served from the reactor's thread while it receives (the second by a
/// client that closes its side after the request).
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn the_metrics_endpoint_shows_a_blast_run_s_counters_moving() {
    let server = addr();
    let metrics = SocketAddr::new(server.ip(), port());
    let (s, m) = (server.to_string(), metrics.to_string());
    let srv = Proc::spawn(
        "blast server",
        bin("blast"),
        &["server", "--bind", &s, "--metrics", &m, "--metrics-conns", "--exit-after", "1"],
    );
    wait_listening(server, LIMIT);
    let client = Proc::spawn(
        "blast client",
        bin("blast"),
        &["client", "--connect", &s, "--size", "4096", "--count", "50000", "--verify"],
    );
    // Two scrapes while the messages flow.
    let deadline = Instant::now() + LIMIT;
    let first = loop {
        let text = http_get(metrics, "/metrics");
        if total(&text, "rdma_reactor_conn_recvs_total") > 0.0 {
            break text;
        }
        assert!(Instant::now() < deadline, "no message counted after {LIMIT:?}:\n{text}");
        std::thread::sleep(Duration::from_millis(100));
    };
    std::thread::sleep(Duration::from_millis(500));
    let second = http_get_with(metrics, "/metrics", true);
    println!("{}", second.lines().filter(|l| l.contains("rdma_reactor_conn_")).collect::<Vec<_>>().join("\n"));
    assert!(second.starts_with("HTTP/1.1 200 OK\r\n"), "{second}");
    assert!(second.contains("Content-Type: text/plain; version=0.0.4"), "{second}");
    for family in ["rdma_reactor_conn_recvs_total", "rdma_reactor_conn_recv_bytes_total"] {
        let (a, b) = (total(&first, family), total(&second, family));
        assert!(b > a && a > 0.0, "{family} did not move: {a} then {b}");
    }
    assert!(total(&second, "rdma_reactor_conn_credit_messages_sent_total") > 0.0, "the server grants credits");
    assert!(http_get(metrics, "/other").starts_with("HTTP/1.1 404 "), "only /metrics is served");
    let st = client.wait(Duration::from_secs(240));
    assert!(st.success(), "blast client: exit {st}");
    assert!(srv.wait(LIMIT).success(), "blast server");
}

/// The review of 2026-12-07, N10: an HTTP connection to the metrics endpoint that sends
/// nothing was closed only at the next accept, so a client rotating its connections just
/// within the idle time (10 s) kept every scrape out. Now the endpoint closes it when its idle
/// time is up, with no other connection made: the client reads the end of the stream.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn an_idle_metrics_connection_is_closed_when_its_time_is_up() {
    let server = addr();
    let metrics = SocketAddr::new(server.ip(), port());
    let (s, m) = (server.to_string(), metrics.to_string());
    let mut srv = Proc::spawn("echo server", bin("echo"), &["server", "--bind", &s, "--metrics", &m, "--quiet"]);
    wait_listening(server, LIMIT);
    let mut idle = TcpStream::connect_timeout(&metrics, Duration::from_secs(5)).expect("connect");
    let start = Instant::now();
    idle.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    let mut b = [0u8; 16];
    let got = idle.read(&mut b);
    let waited = start.elapsed();
    println!("an idle metrics connection: {got:?} after {waited:?}");
    assert!(matches!(got, Ok(0)), "closed by the server, not by the read timeout: {got:?} after {waited:?}");
    assert!(
        waited >= Duration::from_secs(9) && waited < Duration::from_secs(20),
        "at its idle time (10 s): {waited:?}"
    );
    // The endpoint serves on.
    assert!(http_get(metrics, "/metrics").starts_with("HTTP/1.1 200 OK\r\n"));
    kill9(&mut srv);
}

/// With `RUST_LOG=info` an echo server built with the feature `log` says what an operator
/// needs: listening, a reject and why, each accept and establishment, each close and why (a
/// killed client's included).
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn rust_log_tells_an_operator_what_happened() {
    let server = addr();
    let s = server.to_string();
    let log = log_path("echo-server");
    let out = std::fs::File::create(&log).expect("log file");
    let child = Command::new(bin("echo"))
        .args(["server", "--bind", &s, "--srq"])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("clone"))
        .stderr(out)
        .spawn()
        .expect("echo server");
    let srv = Proc(child, "echo server");
    wait_listening(server, LIMIT);
    // Refused by the runtime: larger than the shared receive queue's buffers (1 KiB at the defaults).
    let (ok, text) = run_output(bin("echo"), &["client", "--connect", &s, "--size", "8192", "--count", "1"], LIMIT);
    assert!(!ok, "a client of 8 KiB messages is refused:\n{text}");
    let (ok, text) = run_output(bin("echo"), &["client", "--connect", &s, "--size", "64", "--count", "5"], LIMIT);
    assert!(ok, "{text}");
    // A client killed while its connection is established.
    let mut victim = Proc::spawn(
        "echo client",
        bin("echo"),
        &["client", "--connect", &s, "--size", "64", "--count", "100000000", "--stall-timeout", "600"],
    );
    let deadline = Instant::now() + LIMIT;
    // The runtime's lines only ("Token(..): established"; the example prints its own too).
    while read_log(&log).matches("): established with ").count() < 2 {
        assert!(Instant::now() < deadline, "the third client did not connect:\n{}", read_log(&log));
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    kill9(&mut victim);
    while read_log(&log).matches("): closed: ").count() < 2 {
        assert!(Instant::now() < deadline, "the killed client's connection did not close:\n{}", read_log(&log));
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(srv);
    let text = read_log(&log);
    println!("{text}");
    for line in [
        "INFO  echo rdma_reactor] ",
        ": listening on ",
        "rejected a connect request from ",
        "message size 8192 exceeds the server's maximum 1024",
        "accepted a connect request from ",
        "established with ",
        ": closed: ",
    ] {
        assert!(text.contains(line), "no {line:?} in the log:\n{text}");
    }
}
