//! The async examples against the callback ones, and the tokio example.

use super::*;

/// `aecho client` against an `echo server`, and `echo client` against an `aecho server`, each
/// with 4 connections of 200 verified round trips.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn aecho_and_echo_interoperate_both_ways() {
    for (server, client) in [("echo", "aecho"), ("aecho", "echo")] {
        let a = addr();
        let at = a.to_string();
        let srv = Proc::spawn("server", bin(server), &["server", "--bind", &at, "--exit-after", "4", "--quiet"]);
        wait_listening(a, Duration::from_secs(30));
        let args = ["client", "--connect", &at, "--size", "512", "--count", "200", "--clients", "4", "--verify"];
        let (ok, out) = run_output(bin(client), &args, LIMIT);
        println!("{client} client against {server} server:\n{out}");
        assert!(ok, "{client} client failed:\n{out}");
        assert!(out.contains("800 round trips of 512 bytes over 4 connection(s)"), "{out}");
        assert!(out.contains("every byte verified"), "{out}");
        let st = srv.wait(Duration::from_secs(60));
        assert!(st.success(), "{server} server: {st}");
    }
}

/// The tokio example: RDMA echo (the async face, driven by `io::tokio::drive`) and a TCP
/// control port (tokio's `TcpListener`) in one task of one tokio program: `echo` clients are
/// served, `stats` over TCP shows them, `quit` ends the program.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn the_tokio_example_serves_rdma_and_its_control_port() {
    use std::io::{BufRead, BufReader, Write};
    let a = addr();
    let at = a.to_string();
    let control = format!("127.0.0.1:{}", port());
    let mut srv = Proc::spawn("tokio_control", bin("tokio_control"), &["--bind", &at, "--control", &control]);
    wait_listening(a, Duration::from_secs(30));
    let args = ["client", "--connect", &at, "--size", "256", "--count", "100", "--clients", "2", "--verify"];
    let (ok, out) = run_output(bin("echo"), &args, LIMIT);
    assert!(ok && out.contains("200 round trips of 256 bytes over 2 connection(s)"), "{out}");
    let ask = |cmd: &str| {
        let end = Instant::now() + Duration::from_secs(30);
        let mut s = loop {
            match std::net::TcpStream::connect(&control) {
                Ok(s) => break s,
                Err(e) => {
                    assert!(Instant::now() < end, "the control port {control}: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        };
        s.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
        s.write_all(format!("{cmd}\n").as_bytes()).expect("write");
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line).expect("the answer");
        line
    };
    // The server hears the clients' closes a moment after they exit.
    let end = Instant::now() + Duration::from_secs(30);
    let stats = loop {
        let s = ask("stats");
        if s.starts_with("served 2 ") || Instant::now() > end {
            break s;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    println!("control port: stats -> {}", stats.trim());
    assert!(stats.starts_with("served 2 live 0 echoed 200;"), "{stats}");
    // The review of 2026-12-07, X3: a client that holds a control connection open (sending
    // nothing) no longer holds the port: others are answered meanwhile, and a ninth one at
    // once is told the port is busy.
    let mut holders: Vec<std::net::TcpStream> =
        (0..8).map(|_| std::net::TcpStream::connect(&control).expect("a holder")).collect();
    std::thread::sleep(Duration::from_millis(500));
    let busy = ask("stats");
    assert!(busy.starts_with("error: busy"), "eight held open: the ninth is told so: {busy}");
    drop(holders.pop());
    let end = Instant::now() + Duration::from_secs(30);
    let answered = loop {
        let s = ask("stats");
        if s.starts_with("served ") || Instant::now() > end {
            break s;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(answered.starts_with("served "), "answered while seven others hold theirs: {answered}");
    drop(holders);
    // (The sessions just closed end once the server reads their close: until then it may say
    // it is busy.)
    let end = Instant::now() + Duration::from_secs(30);
    let bye = loop {
        let s = ask("quit");
        if !s.starts_with("error: busy") || Instant::now() > end {
            break s;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(bye.trim(), "bye");
    let st = srv.0.wait().expect("wait");
    assert!(st.success(), "tokio_control exited {st}");
}
