//! Spin-then-sleep polling (`Config::spin`, `--spin-us`) on a real RDMA device: echo works with
//! both sides spinning, and a server that goes idle stops using CPU once its spin time has
//! passed.

mod util;

use std::process::Command;
use std::time::{Duration, Instant};

use util::*;

/// User plus system CPU time of a process, in seconds (`/proc/PID/stat`).
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read /proc/PID/stat");
    // The command name is in parentheses and may hold spaces: fields count from after it.
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state is field 3 of the whole line, utime 14 and stime 15.
    let ticks: u64 = fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime");
    // /proc counts in USER_HZ, which the kernel ABI fixes at 100 on x86_64.
    ticks as f64 / 100.0
}

/// Share of one CPU the process used over `window`.
fn cpu_share(pid: u32, window: Duration) -> f64 {
    let (c0, t0) = (cpu_seconds(pid), Instant::now());
    std::thread::sleep(window);
    (cpu_seconds(pid) - c0) / t0.elapsed().as_secs_f64()
}

#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn spinning_echo_verifies_every_byte_then_idles_without_cpu() {
    let server = addr();
    let s = server.to_string();
    // 50 ms of spinning after the last work: long against a round trip, short against the
    // idle window measured below.
    let proc = Proc::spawn("echo server", bin("echo"), &["server", "--bind", &s, "--quiet", "--spin-us", "50000"]);
    wait_listening(server, Duration::from_secs(30));
    let idle_before = cpu_share(proc.pid(), Duration::from_secs(1));
    let out = Command::new(bin("echo"))
        .args(["client", "--connect", &s, "--size", "64", "--count", "500", "--verify", "--spin-us", "50000"])
        .output()
        .expect("run echo client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    print!("{stdout}");
    assert!(out.status.success(), "echo client failed: {}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("500 round trips of 64 bytes over 1 connection(s)"), "{stdout}");
    assert!(stdout.contains("every byte verified"), "{stdout}");
    // The client has gone; past the spin time the server sleeps in epoll_wait. A reactor that
    // kept spinning would use most of a CPU here.
    std::thread::sleep(Duration::from_millis(500));
    let idle_after = cpu_share(proc.pid(), Duration::from_secs(2));
    println!("echo server CPU share: idle before {idle_before:.3}, idle after spinning {idle_after:.3}");
    assert!(idle_after < 0.05, "the server still uses {:.0}% of a CPU after the spin time", idle_after * 100.0);
}
