//! One gibibyte through the `blast` example, verified, by SEND and by RDMA WRITE with
//! immediate (a separate test binary: it is the longest one under emulation).

mod util;

use std::time::Duration;

use util::*;

fn blast_one_gib(op: &str) {
    let server = addr();
    let s = server.to_string();
    let srv = Proc::spawn("blast server", bin("blast"), &["server", "--bind", &s, "--verify", "--exit-after", "1"]);
    wait_listening(server, Duration::from_secs(30));
    // 16384 messages of 64 KiB = 1 GiB.
    let (ok, out) = run_output(
        bin("blast"),
        &["client", "--connect", &s, "--size", "64K", "--count", "16384", "--op", op, "--verify"],
        Duration::from_secs(600),
    );
    println!("{out}");
    assert!(ok, "blast client --op {op} failed:\n{out}");
    assert!(out.contains("16384 messages of 65536 bytes (1073741824 bytes)"), "{out}");
    let st = srv.wait(Duration::from_secs(60));
    assert!(st.success(), "blast server exited with {st}: it verified every byte and counted 1 GiB");
}

#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn one_gib_verified_by_send() {
    blast_one_gib("send");
}

#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn one_gib_verified_by_write_with_immediate() {
    blast_one_gib("write");
}
