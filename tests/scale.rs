//! Scale with a shared receive queue: one `echo server --srq` process holds 5 000 connections
//! from eleven client processes at once, with the same registered memory as at 100.

mod util;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use util::*;

/// Connections per client process: the first holds 100 alone while the server's memory is
/// read at 100, then the others bring the total to 5 000 in steps of 500.
const PER_CLIENT: [usize; 11] = [100, 400, 500, 500, 500, 500, 500, 500, 500, 500, 500];
const TOTAL: usize = 5_000;

/// A parsed `echo server: mark N live N registered_bytes B srq_receives R` line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Mark {
    mark: u64,
    live: u64,
    registered: u64,
    srq_receives: u64,
}

fn parse_mark(line: &str) -> Option<Mark> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let value = |name: &str| words.windows(2).find(|w| w[0] == name).and_then(|w| w[1].parse().ok());
    Some(Mark {
        mark: value("mark")?,
        live: value("live")?,
        registered: value("registered_bytes")?,
        srq_receives: value("srq_receives")?,
    })
}

/// `MemAvailable` of the machine, from /proc/meminfo.
fn mem_available_kib() -> u64 {
    let text = std::fs::read_to_string("/proc/meminfo").expect("read /proc/meminfo");
    text.lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("a MemAvailable line")
}

/// Waits for the server's mark line for `n` live connections.
fn wait_mark(lines: &mpsc::Receiver<String>, n: u64, limit: Duration) -> Mark {
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => {
                if let Some(m) = parse_mark(&line).filter(|m| m.mark == n) {
                    return m;
                }
                if line.contains("refused") || line.contains("closed after") {
                    println!("server: {line}");
                }
            }
            Err(_) => panic!("the server did not reach {n} live connections within {limit:?}"),
        }
    }
}

/// Running totals of `steps`: the live connections after each client process.
fn cumulative(steps: &[usize]) -> Vec<usize> {
    steps
        .iter()
        .scan(0, |sum, n| {
            *sum += n;
            Some(*sum)
        })
        .collect()
}

/// `echo server --bind SERVER --quiet --srq SRQ_FLAGS... --marks MARKS` with its output lines
/// on a channel; returns once it listens.
fn start_srq_server(server: SocketAddr, srq_flags: &[&str], marks: &[usize]) -> (Proc, mpsc::Receiver<String>) {
    let s = server.to_string();
    let marks = marks.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(",");
    let mut args = vec!["server", "--bind", &s, "--quiet", "--srq"];
    args.extend_from_slice(srq_flags);
    args.extend_from_slice(&["--marks", &marks]);
    let child = Command::new(bin("echo"))
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start echo server");
    let mut srv = Proc(child, "echo server");
    let stdout = srv.0.stdout.take().expect("piped stdout");
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    wait_listening(server, Duration::from_secs(30));
    (srv, lines)
}

/// An `echo client` process of `n` connections, each with one verified round trip of 64
/// bytes, holding them open until `release` exists.
struct HeldClient {
    pid: u32,
    n: usize,
    out: mpsc::Receiver<std::io::Result<std::process::Output>>,
}

impl HeldClient {
    fn start(server: SocketAddr, n: usize, release: &std::path::Path) -> HeldClient {
        let child = Command::new(bin("echo"))
            .args([
                "client",
                "--connect",
                &server.to_string(),
                "--size",
                "64",
                "--count",
                "1",
                "--verify",
                "--clients",
                &n.to_string(),
                "--stall-timeout",
                "120",
                "--hold-until",
                &release.to_string_lossy(),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start echo client");
        let pid = child.id();
        let (tx, out) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(child.wait_with_output());
        });
        HeldClient { pid, n, out }
    }

    /// After the release: it exits successfully with its `n` round trips, every byte
    /// verified (killed and failed after 120 s); returns `n`.
    fn finish(self) -> usize {
        let (pid, n) = (self.pid, self.n);
        let out = match self.out.recv_timeout(Duration::from_secs(120)) {
            Ok(Ok(out)) => out,
            Ok(Err(e)) => panic!("echo client {pid}: {e}"),
            Err(_) => {
                let _ = Command::new("kill").arg(pid.to_string()).status();
                panic!("echo client {pid} did not finish after its release");
            }
        };
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "echo client {pid} failed:\n{text}");
        let want = format!("{n} round trips of 64 bytes over {n} connection(s)");
        assert!(text.contains(&want) && text.contains("every byte verified"), "{text}");
        n
    }
}

/// Releases every held client, checks each finished, and removes the release file; returns
/// the round trips in all.
fn release_all(clients: Vec<HeldClient>, release: &std::path::Path) -> usize {
    std::fs::write(release, b"go").expect("create the release file");
    let round_trips = clients.into_iter().map(HeldClient::finish).sum();
    let _ = std::fs::remove_file(release);
    round_trips
}

/// The server's `rdma res` counts once back at `baseline` (it destroys each connection as its
/// DISCONNECTED arrives), or as they are after 120 s.
fn settled_res_counts(pid: u32, baseline: &ResCounts) -> ResCounts {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut now = res_counts(pid);
    while now != *baseline && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(500));
        now = res_counts(pid);
    }
    now
}

/// 5 000 connections from 11 `echo client` processes (100, then 400, then 500 each; one
/// verified round trip each, then held open) into one `echo server --srq`: the server sees
/// all 5 000 live at once; its registered memory (`Stats::registered_bytes`, and its MR count
/// in `rdma res show`) is the same with 100 connections (the first client alone) and with
/// 5 000; after every client closed, its `rdma res show`
/// counts are back to the baseline; rxe counted no RNR NAK.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn five_thousand_connections_on_one_srq() {
    let started = Instant::now();
    let before = link_counters();
    let server = addr();
    let totals = cumulative(&PER_CLIENT);
    assert_eq!(totals.last(), Some(&TOTAL));
    // 5 000 connections × a credit of 3, plus a reserve of 500: 15 500 receives of 1 KiB, in
    // four 4 MiB clusters of 1 KiB chunks (16 384). The 884 chunks left over hold the echoes in
    // flight: one client process's 500 connections can each have one, while the SRQ is
    // refilled from the pool. (With 16 000 receives, 384 were left, and a burst of echoes
    // registered a fifth cluster in one CI run: more memory for a moment's traffic, not per
    // connection.)
    let srq_flags = ["--srq-receives", "15500", "--srq-reserve", "500", "--srq-credit", "3", "--srq-size", "1024"];
    let (srv, lines) = start_srq_server(server, &srq_flags, &totals);
    let baseline = res_counts(srv.pid());
    let mem_before = mem_available_kib();
    println!("baseline {baseline:?}, MemAvailable {mem_before} KiB");
    assert_eq!(baseline.qp, 0, "{baseline:?}");

    let release = std::env::temp_dir().join(format!("scale-release-{}", srv.pid()));
    let _ = std::fs::remove_file(&release);
    let mut clients = Vec::new();
    let mut at_100 = None;
    let mut mr_100 = None;
    let mut last = None;
    for (i, (&per_client, &total)) in PER_CLIENT.iter().zip(&totals).enumerate() {
        clients.push(HeldClient::start(server, per_client, &release));
        let m = wait_mark(&lines, total as u64, Duration::from_secs(120));
        println!("{} live after {:.1} s: {m:?}", m.live, started.elapsed().as_secs_f64());
        if i == 0 {
            // The first client alone: exactly 100 live while this is read.
            assert_eq!(m.live, 100, "{m:?}");
            mr_100 = Some(res_counts(srv.pid()).mr);
            at_100 = Some(m);
        }
        last = Some(m);
    }
    let at_100 = at_100.expect("mark 100");
    let at_full = last.expect("the last mark");
    let full = res_counts(srv.pid());
    let mem_full = mem_available_kib();
    println!("at 100: {at_100:?}, MRs {mr_100:?}; at {TOTAL}: {at_full:?}, {full:?}");
    println!(
        "MemAvailable with {TOTAL} connections open: {mem_full} KiB ({} MiB less than before the clients)",
        mem_before.saturating_sub(mem_full) / 1024
    );
    // All 5 000 are open together: the clients hold every connection until released.
    assert_eq!(at_full.live, TOTAL as u64, "{at_full:?}");
    assert_eq!(full.qp, TOTAL, "the server holds {TOTAL} queue pairs at once: {full:?}");
    assert_eq!(at_full.registered, at_100.registered, "registered bytes at 100 and at {TOTAL} connections");
    assert_eq!(Some(full.mr), mr_100, "memory regions at 100 and at {TOTAL} connections");
    assert_eq!(at_full.srq_receives, at_100.srq_receives, "the SRQ's receives are the same");

    assert_eq!(release_all(clients, &release), TOTAL);
    let now = settled_res_counts(srv.pid(), &baseline);
    assert_eq!(now, baseline, "the server's resources after all {TOTAL} connections closed");
    let after = link_counters();
    assert_no_rnr(&before, &after, "five thousand connections");
    println!("five thousand connections: {:.1} s in all; rxe counters {after:?}", started.elapsed().as_secs_f64());
}

/// Issue 21: `echo server --srq` at its defaults (3 840 receives of 4 KiB, credit 3 growing to
/// 32 while busy, reserve 240) holds 1 200 connections from eleven client processes (100, then
/// ten of 110; one verified round trip each, all at once, then held open), with the same
/// registered memory and memory regions at 100 and at 1 200; the 1 201st is refused by the
/// credit rule, and its client says so; after all closed the server's `rdma res` counts are
/// back to the baseline; rxe counted no RNR NAK.
///
/// Registered memory follows the traffic in flight, not the connections: each message handed
/// to a handler is replaced on the queue at once, from the 256 chunks the defaults leave free
/// in the receives' clusters. (With 4 096 receives, which took every chunk, the first burst of
/// 118 round trips at once registered a fifth 4 MiB cluster; 100 had not: the defaults were
/// changed for it.) (The issue asked for 10 000 at the defaults: with buffered receives that
/// cannot be had at a memory that does not grow with the connections; `SrqConfig`'s docs say
/// why.)
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn echo_server_srq_at_its_defaults_holds_1200_connections() {
    const STEPS: [usize; 11] = [100, 110, 110, 110, 110, 110, 110, 110, 110, 110, 110];
    const MAX: usize = 1_200;
    let started = Instant::now();
    let before = link_counters();
    let server = addr();
    let s = server.to_string();
    let totals = cumulative(&STEPS);
    let (srv, lines) = start_srq_server(server, &[], &totals);
    let baseline = res_counts(srv.pid());
    let release = std::env::temp_dir().join(format!("defaults-release-{}", srv.pid()));
    let _ = std::fs::remove_file(&release);
    let mut clients = Vec::new();
    let mut marks = Vec::new();
    for (&n, &total) in STEPS.iter().zip(&totals) {
        clients.push(HeldClient::start(server, n, &release));
        let m = wait_mark(&lines, total as u64, Duration::from_secs(120));
        println!("{} live after {:.1} s: {m:?}, {:?}", m.live, started.elapsed().as_secs_f64(), res_counts(srv.pid()));
        marks.push((m, res_counts(srv.pid()).mr));
    }
    assert_eq!(totals.last(), Some(&MAX));
    let (at_100, mr_100) = marks[0];
    let (at_max, mr_max) = marks[marks.len() - 1];
    assert_eq!(at_100.live, 100, "{at_100:?}");
    assert_eq!(at_max.live, MAX as u64, "all {MAX} open at once: {at_max:?}");
    assert_eq!(res_counts(srv.pid()).qp, MAX, "the server holds {MAX} queue pairs");
    assert_eq!(at_max.registered, at_100.registered, "registered bytes at 100 and at {MAX} connections");
    assert_eq!(mr_max, mr_100, "memory regions at 100 and at {MAX} connections");
    assert_eq!(at_max.srq_receives, at_100.srq_receives, "the SRQ's receives are the same");

    // One more: the credit rule refuses it, and the client is told why.
    let (ok, text) = run_output(
        bin("echo"),
        &["client", "--connect", &s, "--size", "64", "--count", "1", "--stall-timeout", "60"],
        Duration::from_secs(90),
    );
    println!("the connection beyond {MAX}: {}", text.trim());
    assert!(!ok, "a connection beyond {MAX} was served: {text}");
    assert!(text.contains("limit reached") && text.contains("1200"), "the refusal names the limit: {text}");

    assert_eq!(release_all(clients, &release), MAX);
    let now = settled_res_counts(srv.pid(), &baseline);
    assert_eq!(now, baseline, "the server's resources after all {MAX} connections closed");
    assert_no_rnr(&before, &link_counters(), "1 200 connections at the defaults");
    println!("1 200 connections at the defaults: {:.1} s in all", started.elapsed().as_secs_f64());
}
