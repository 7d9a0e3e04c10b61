//! `cargo xtask demo`: the project's main job in one command.
//!
//! THE PLACE TO EDIT the demo's command lines: [`ECHO`], [`BLAST`], [`EMBED`], [`KV`], [`ASYNC`],
//! [`HTTP`] and [`RPING`] below. Each is a sh fragment run with `$BIN` (the project's binaries) and `$RDMA_ADDR` set, in
//! the VM (on the device `cargo xtask demo --device rxe|siw` chose: `$RDMA_ADDR` is its address)
//! or on a host with an RDMA device. A fragment is used when its example source exists
//! (`examples/echo.rs`, `examples/blast.rs`, `examples/embed.rs`); with neither echo nor blast,
//! the rping pair runs instead.

use crate::project;

/// The echo example: a server, then a client that verifies what comes back.
pub const ECHO: &str = r#"
echo "== echo: server on $RDMA_ADDR:7471; client: 1000 x 4096 B, verified"
"$BIN"/echo server --bind "$RDMA_ADDR:7471" &
server=$!
sleep 1
"$BIN"/echo client --connect "$RDMA_ADDR:7471" --size 4096 --count 1000 --verify
rc=$?
kill $server 2>/dev/null
wait $server 2>/dev/null
[ $rc -eq 0 ] || { echo "== echo client failed: exit $rc"; exit $rc; }
"#;

/// The blast example: a server, then a client streaming 64 KiB messages at it.
pub const BLAST: &str = r#"
echo "== blast: server on $RDMA_ADDR:7472; client: 2000 x 65536 B, verified"
"$BIN"/blast server --bind "$RDMA_ADDR:7472" --verify &
server=$!
sleep 1
"$BIN"/blast client --connect "$RDMA_ADDR:7472" --size 65536 --count 2000 --verify
rc=$?
kill $server 2>/dev/null
wait $server 2>/dev/null
[ $rc -eq 0 ] || { echo "== blast client failed: exit $rc"; exit $rc; }
"#;

/// The embed example: the reactor nested in a `poll(2)` loop, serving its own verifying clients.
pub const EMBED: &str = r#"
echo "== embed: the reactor nested in a poll(2) loop on $RDMA_ADDR:7473; 4 clients x 1000 x 4096 B, verified"
"$BIN"/embed --bind "$RDMA_ADDR:7473" --clients 4 --count 1000 --size 4096
rc=$?
[ $rc -eq 0 ] || { echo "== embed failed: exit $rc"; exit $rc; }
"#;

/// The kv example: a table in one region, exposed to 8 clients, each reading it by one-sided
/// RDMA READ (every value verified) and writing it by SEND.
pub const KV: &str = r#"
echo "== kv: server on $RDMA_ADDR:7474 (1024 values of 256 B in one region); 8 clients x 2000 GETs by RDMA READ, verified"
"$BIN"/kv server --bind "$RDMA_ADDR:7474" --exit-after 8 --quiet &
server=$!
sleep 1
"$BIN"/kv client --connect "$RDMA_ADDR:7474" --clients 8 --count 2000 --verify
rc=$?
wait $server
src=$?
[ $rc -eq 0 ] || { echo "== kv client failed: exit $rc"; exit $rc; }
[ $src -eq 0 ] || { echo "== kv server failed: exit $src"; exit $src; }
"#;

/// The async examples: an `aecho` server (one task per connection) with an `aecho` client and
/// an `echo` client (the two interoperate), then the tokio program serving RDMA echo and a TCP
/// control port in one task, asked for its statistics and told to quit over TCP (busybox `nc`).
pub const ASYNC: &str = r#"
echo "== aecho: async server on $RDMA_ADDR:7475; an aecho client (4 tasks x 500 x 4096 B, verified), then an echo client"
"$BIN"/aecho server --bind "$RDMA_ADDR:7475" --exit-after 5 --quiet &
server=$!
sleep 1
"$BIN"/aecho client --connect "$RDMA_ADDR:7475" --clients 4 --size 4096 --count 500 --verify || { echo "== aecho client failed"; exit 1; }
"$BIN"/echo client --connect "$RDMA_ADDR:7475" --size 4096 --count 500 --verify || { echo "== echo client against aecho failed"; exit 1; }
wait $server || { echo "== aecho server failed"; exit 1; }
echo "== tokio_control: RDMA echo on $RDMA_ADDR:7476 and a TCP control port on 127.0.0.1:7477, one tokio task"
"$BIN"/tokio_control --bind "$RDMA_ADDR:7476" --control 127.0.0.1:7477 &
server=$!
sleep 1
"$BIN"/echo client --connect "$RDMA_ADDR:7476" --clients 2 --size 256 --count 300 --verify || { echo "== echo client against tokio_control failed"; exit 1; }
sleep 0.5
echo "-- control: stats"; printf 'stats
' | nc -w 2 127.0.0.1 7477
echo "-- control: quit"; printf 'quit
' | nc -w 2 127.0.0.1 7477
wait $server || { echo "== tokio_control failed"; exit 1; }
"#;

/// The HTTP example: hyper 1 over RDMA byte streams (`io::Stream`), a server and a client making
/// 2000 requests over 4 connections with bodies from 0 B to 1 MiB, every byte verified.
pub const HTTP: &str = r#"
echo "== http: hyper server on $RDMA_ADDR:7478; client: 4 connections x 500 requests, bodies 0 B to 1 MiB, verified"
"$BIN"/http server --bind "$RDMA_ADDR:7478" --exit-after 4 --quiet &
server=$!
sleep 1
"$BIN"/http client --connect "$RDMA_ADDR:7478" --clients 4 --requests 2000 --max-body 1M
rc=$?
wait $server
src=$?
[ $rc -eq 0 ] || { echo "== http client failed: exit $rc"; exit $rc; }
[ $src -eq 0 ] || { echo "== http server failed: exit $src"; exit $src; }
"#;

/// Until the examples exist: rdma-core's rping, server and client, 5 verified pings.
pub const RPING: &str = r#"
echo "== rping (the echo/blast examples do not exist yet): server and client on $RDMA_ADDR, 5 pings"
rping -s -a "$RDMA_ADDR" -C 5 &
server=$!
sleep 1
rping -c -a "$RDMA_ADDR" -C 5 -v
rc=$?
wait $server
src=$?
[ $rc -eq 0 ] || { echo "== rping client failed: exit $rc"; exit $rc; }
[ $src -eq 0 ] || { echo "== rping server failed: exit $src"; exit $src; }
"#;

/// The demo script for the examples this checkout has.
pub fn script() -> String {
    let mut s = String::from("# cargo xtask demo (xtask/src/demo.rs)\n");
    s.push_str("echo \"== device ${RDMA_DEV:-(this host's)}, address $RDMA_ADDR\"\n");
    let echo = project::has_example("echo");
    let blast = project::has_example("blast");
    if echo {
        s.push_str(ECHO);
    }
    if blast {
        s.push_str(BLAST);
    }
    if project::has_example("embed") {
        s.push_str(EMBED);
    }
    if project::has_example("kv") {
        s.push_str(KV);
    }
    if project::has_example("aecho") && project::has_example("tokio_control") {
        s.push_str(ASYNC);
    }
    if project::has_example("http") {
        s.push_str(HTTP);
    }
    if !echo && !blast {
        s.push_str(RPING);
    }
    s.push_str("echo \"== demo done\"\n");
    s
}
