//! Echo end to end on a real RDMA device: the reactor's listener, agents and clients, the
//! examples, and interoperability with librdmacm's own example programs.

mod util;

use std::cell::RefCell;
use std::process::Command;
use std::rc::Rc;
use std::time::Duration;

use rdma_reactor::{CloseReason, Config, ConnectOptions, Reactor, RejectCode};
use util::*;

/// Listener, agents and clients in ONE reactor in one process, no threads: every size class
/// ping-pongs concurrently, every byte verified, counts exact.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn pingpong_every_size_in_one_reactor() {
    // Messages of up to 1 MiB: the server announces (and posts) the smaller of its clients'
    // sizes and `Config::msg_size`, 64 KiB by default.
    let cfg = Config { msg_size: 1 << 20, ..Config::default() };
    let mut reactor = Reactor::with_config(cfg).expect("reactor");
    let server = addr();
    let agents_closed = Rc::new(RefCell::new(Vec::new()));
    reactor.listen(server, EchoListener { depth: 8, agents_closed: agents_closed.clone() }).expect("listen");
    let plan: [(usize, u64); 5] = [(1, 10_000), (64, 10_000), (4096, 10_000), (64 * 1024, 1_000), (1024 * 1024, 100)];
    let mut results = Vec::new();
    for (i, &(size, count)) in plan.iter().enumerate() {
        let (client, result) = PingClient::new(i as u64, size, count);
        let opts = ConnectOptions { msg_size: size as u32, msg_count: count as u32, ..Default::default() };
        reactor.connect(server, opts, client).expect("connect");
        results.push((size, count, result));
    }
    run_until(&mut reactor, Duration::from_secs(900), || results.iter().all(|(_, _, r)| r.borrow().closed.is_some()));
    for (size, count, r) in &results {
        let r = r.borrow();
        assert_eq!(r.error, None, "size {size}");
        assert_eq!(r.echoed, *count, "size {size}: every message echoed");
        assert_eq!(r.verified_bytes, *count * *size as u64, "size {size}: every byte verified");
        assert_eq!(r.cancelled, 1, "size {size}: the receive submitted after close came back cancelled");
        assert_eq!(r.closed, Some(CloseReason::Local), "size {size}");
    }
    run_until(&mut reactor, Duration::from_secs(30), || agents_closed.borrow().len() == plan.len());
    assert!(agents_closed.borrow().iter().all(|r| *r == CloseReason::Peer), "{:?}", agents_closed.borrow());
    let stats = reactor.stats();
    let total: u64 = plan.iter().map(|(_, c)| c).sum();
    // Each message: a send and a receive on the client, and on the agent.
    assert!(stats.completions >= 4 * total, "{stats:?}");
    assert_eq!(stats.stale_completions, 0, "{stats:?}");
    assert_eq!(stats.established, 2 * plan.len() as u64);
    assert!(stats.cq_ack_calls < stats.cq_events, "acks are batched: {stats:?}");
    println!("{stats:?}");
}

/// One `echo server` process serves 64 concurrent clients from one thread, all verified; after
/// they disconnect, its kernel resource counts are back to what they were before.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn server_process_serves_64_clients_and_returns_to_baseline() {
    let server = addr();
    let s = server.to_string();
    let proc = Proc::spawn("echo server", bin("echo"), &["server", "--bind", &s, "--quiet"]);
    wait_listening(server, Duration::from_secs(30));
    let baseline = res_counts(proc.pid());
    assert_eq!(baseline.qp, 0, "{baseline:?}");
    assert!(baseline.cm_id >= 1, "the listener's id is counted: {baseline:?}");

    let mut reactor =
        Reactor::with_config(Config { send_depth: 4, recv_depth: 4, ..Config::default() }).expect("reactor");
    let mut results = Vec::new();
    for i in 0..64 {
        let (client, result) = PingClient::new(i, 256, 50);
        let opts = ConnectOptions { msg_size: 256, ..Default::default() };
        reactor.connect(server, opts, client).expect("connect");
        results.push(result);
    }
    // While they are all connected, the server holds one QP per client.
    let mut peak = baseline;
    run_until(&mut reactor, Duration::from_secs(600), || {
        let all_up = results.iter().all(|r| r.borrow().echoed > 0);
        if all_up && peak.qp == 0 {
            peak = res_counts(proc.pid());
        }
        results.iter().all(|r| r.borrow().closed.is_some())
    });
    for (i, r) in results.iter().enumerate() {
        let r = r.borrow();
        assert_eq!(r.error, None, "client {i}");
        assert_eq!(r.echoed, 50, "client {i}");
        assert_eq!(r.verified_bytes, 50 * 256, "client {i}");
    }
    assert_eq!(threads(proc.pid()), 1, "the server is one thread");
    println!("baseline {baseline:?}, with clients {peak:?}");
    // The server destroys each connection when its DISCONNECTED arrives; give it a moment.
    let mut now = res_counts(proc.pid());
    for _ in 0..100 {
        if now == baseline {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
        now = res_counts(proc.pid());
    }
    assert_eq!(now, baseline, "resources of the server after all clients left");
}

/// librdmacm's `rdma_client` (no private data, 16-byte send) is served by `echo server`.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn plain_rdma_client_is_served_with_defaults() {
    let server = addr();
    let s = server.to_string();
    let _proc = Proc::spawn("echo server", bin("echo"), &["server", "--bind", &s]);
    wait_listening(server, Duration::from_secs(30));
    let out = Command::new("rdma_client")
        .args(["-s", &server.ip().to_string(), "-p", &server.port().to_string()])
        .output()
        .expect("run rdma_client");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "rdma_client failed: {text}");
    assert!(text.contains("rdma_client: end 0"), "{text}");
}

/// `echo client` (size 16, count 1) against librdmacm's `rdma_server`.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn echo_client_against_plain_rdma_server() {
    let server = addr();
    let port = server.port().to_string();
    let srv = Proc::spawn("rdma_server", "rdma_server", &["-s", &server.ip().to_string(), "-p", &port]);
    wait_listening(server, Duration::from_secs(30));
    let s = server.to_string();
    let out = Command::new(bin("echo"))
        .args(["client", "--connect", &s, "--size", "16", "--count", "1"])
        .output()
        .expect("run echo client");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "echo client failed: {text}");
    assert!(text.contains("1 round trips of 16 bytes"), "{text}");
    let st = srv.wait(Duration::from_secs(30));
    assert!(st.success(), "rdma_server exited with {st}");
}

/// A malformed connect header is rejected before anything is built, and the client hears why.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn malformed_connect_header_is_rejected_with_a_reason() {
    let mut reactor = Reactor::new().expect("reactor");
    let server = addr();
    let agents_closed = Rc::new(RefCell::new(Vec::new()));
    reactor.listen(server, EchoListener { depth: 1, agents_closed: agents_closed.clone() }).expect("listen");
    // A valid header with one corruption.
    let corrupt = |f: fn(&mut Vec<u8>)| {
        let info = rdma_reactor::ConnectInfo { msg_size: 64, msg_count: 1, recv_depth: 1, ..Default::default() };
        let mut h = info.encode(56).expect("encode");
        f(&mut h);
        h
    };
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (b"XXXXgarbage that is not a header".to_vec(), "bad magic"),
        (corrupt(|h| h[4] = 9), "unsupported version 9"),
        (corrupt(|h| h[8..12].fill(0)), "bad message size 0"),
    ];
    let mut results = Vec::new();
    for (i, (raw, _)) in cases.iter().enumerate() {
        let (client, result) = PingClient::new(i as u64, 64, 1);
        let opts = ConnectOptions { raw_private_data: Some(raw.clone()), ..Default::default() };
        reactor.connect(server, opts, client).expect("connect");
        results.push(result);
    }
    run_until(&mut reactor, Duration::from_secs(60), || results.iter().all(|r| r.borrow().closed.is_some()));
    for ((_, want), r) in cases.iter().zip(&results) {
        let r = r.borrow();
        match &r.closed {
            Some(CloseReason::Rejected { status, reason: Some(reason) }) => {
                assert_eq!(*status, 28, "a consumer reject");
                assert_eq!(reason.code, RejectCode::BadConnectInfo);
                assert!(reason.text.contains(want), "{:?} should mention {want:?}", reason.text);
                let shown = r.closed.as_ref().unwrap().to_string();
                assert!(shown.contains(want), "the client reports the reason: {shown}");
            }
            other => panic!("expected a reject with a reason, got {other:?}"),
        }
        assert_eq!(r.echoed, 0);
    }
    assert!(agents_closed.borrow().is_empty(), "no agent was built");
    assert_eq!(reactor.stats().rejected, cases.len() as u64);
    assert_eq!(reactor.stats().accepted, 0);
}

/// The `echo` example's client reports the reason of a reject and exits non-zero.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn echo_client_reports_refused_connection() {
    // Nothing listens on this port: the kernel rejects with status 8.
    let s = addr().to_string();
    let out = Command::new(bin("echo"))
        .args(["client", "--connect", &s, "--size", "64", "--count", "1"])
        .output()
        .expect("run echo client");
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(text.contains("FAILED") && text.contains("rejected"), "{text}");
}
