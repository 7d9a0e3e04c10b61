//! The examples over IPv6 on the VM's current device (`cargo xtask test` runs this once on
//! Soft-RoCE and once on Soft-iWARP): an `echo` round trip to the device's global (ULA) address
//! `$RDMA_ADDR6`, and to its link-local one `$RDMA_LL6`, scoped by the interface's name
//! (`[fe80::2:1%s0]:PORT`), which `Args::addr` of the examples maps to its index.

mod util;

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use util::*;

/// The variable `name`, which `cargo xtask` exports, or `None` (after saying so) where it is not
/// set: a host with its own RDMA device may have no IPv6 address on it.
fn var(name: &str) -> Option<String> {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => Some(v),
        _ => {
            eprintln!("ipv6: {name} is not set (cargo xtask exports it in the VM): nothing to test here");
            None
        }
    }
}

/// Parses an IPv6 address from the variable `name`.
fn ip6(name: &str, v: &str) -> Ipv6Addr {
    v.parse().unwrap_or_else(|e| panic!("{name}={v:?}: {e}"))
}

/// `echo server --bind ADDR --exit-after 1`, then `echo client --connect ADDR --size 4096
/// --count 50 --verify`; both must succeed, the client having verified every byte. `listen` is
/// the same address as a `SocketAddr`, for waiting until the server listens.
fn echo_round_trip(addr: &str, listen: SocketAddr) {
    let server = Proc::spawn("echo server", bin("echo"), &["server", "--bind", addr, "--exit-after", "1"]);
    wait_listening(listen, Duration::from_secs(30));
    let args = ["client", "--connect", addr, "--size", "4096", "--count", "50", "--verify"];
    let (ok, out) = run_output(bin("echo"), &args, Duration::from_secs(120));
    println!("{out}");
    assert!(ok, "echo client --connect {addr} failed ({}):\n{out}", transport());
    assert!(out.contains("50 round trips of 4096 bytes"), "{out}");
    assert!(out.contains("every byte verified"), "{out}");
    let st = server.wait(Duration::from_secs(30));
    assert!(st.success(), "echo server --bind {addr} exited with {st}");
}

/// An echo round trip to the device's global IPv6 address, `[$RDMA_ADDR6]:PORT`.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn echo_over_global_ipv6() {
    let Some(v) = var("RDMA_ADDR6") else {
        not_applicable("echo_over_global_ipv6", "RDMA_ADDR6 not set");
        return;
    };
    let listen = SocketAddr::new(IpAddr::V6(ip6("RDMA_ADDR6", &v)), port());
    let addr = listen.to_string();
    assert!(addr.starts_with('['), "{addr}");
    echo_round_trip(&addr, listen);
}

/// An echo round trip to the device's link-local IPv6 address, scoped by the name of its
/// interface: `[$RDMA_LL6%$RDMA_NETDEV]:PORT`.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn echo_over_link_local_ipv6_scoped_by_interface_name() {
    let (Some(ll), Some(netdev)) = (var("RDMA_LL6"), var("RDMA_NETDEV")) else {
        not_applicable("echo_over_link_local_ipv6_scoped_by_interface_name", "RDMA_LL6 or RDMA_NETDEV not set");
        return;
    };
    let ip = ip6("RDMA_LL6", &ll);
    assert!(ip.segments()[0] & 0xffc0 == 0xfe80, "RDMA_LL6={ll} is not link-local");
    // A netdev taken down and up by an earlier test keeps the address (keep_addr_on_down) but
    // the RoCE GID table does not get a manual link-local address back: add it again, which
    // puts it there (and is harmless where it still is).
    let cidr = format!("{ll}/64");
    let _ = std::process::Command::new("ip").args(["-6", "addr", "del", &cidr, "dev", &netdev]).status();
    let added = std::process::Command::new("ip").args(["-6", "addr", "add", &cidr, "dev", &netdev, "nodad"]).status();
    assert!(added.is_ok_and(|s| s.success()), "ip -6 addr add {cidr} dev {netdev}");
    std::thread::sleep(std::time::Duration::from_millis(200));
    let port = port();
    let addr = format!("[{ll}%{netdev}]:{port}");
    echo_round_trip(&addr, SocketAddr::new(IpAddr::V6(ip), port));
}
