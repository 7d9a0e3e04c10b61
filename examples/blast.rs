//! Streams messages one way as fast as flow control allows, many connections from one thread.
//!
//! ```text
//! blast server --bind ADDR:PORT [--verify] [--depth N] [--exit-after N] [--quiet] [--spin-us N]
//!              [--srq [--srq-receives N] [--srq-credit N] [--srq-max-credit N] [--srq-reserve N] [--srq-size BYTES]]
//!              [--threads N] [--balance round-robin|fewest] [--shared-cq N]
//!              [--metrics [ADDR:]PORT [--metrics-conns] [--metrics-max-conns N]]
//!              [--ring-bytes BYTES]
//! blast client --connect ADDR:PORT --size BYTES --count N [--clients K] [--op send|write]
//!              [--verify] [--window N] [--spin-us N] [--shared-cq N] [--reconnect N]
//! ```
//!
//! With `--op send` every message is a SEND into one of the server's posted receives. With
//! `--op write` the server exposes a ring of `depth` slots (application memory, a `Region` of
//! at most 64 MiB, with REMOTE_WRITE only, to that connection alone: `Conn::expose_region`)
//! and sends its descriptor; each message is an RDMA WRITE with immediate into slot
//! `seq % depth`, whose immediate consumes one receive so the server learns the slot is full. Either way the sender
//! never has more messages in flight than the server has receives posted: receive credits
//! (the credit rule in `ConnectionHandler`'s docs), so there are no RNR retries and nothing is lost.
//! The rings are registered (pinned) memory outside the pool: all of a server's rings together
//! pin at most `--ring-bytes` (default 1 GiB,
//! [`RING_BYTES_DEFAULT`](server::RING_BYTES_DEFAULT)), and a connection whose ring would go
//! beyond is refused (`RejectCode::NoResources`, which a reconnecting client tries again).
//!
//! Measured as perftest measures: the client takes its message buffers when each connection
//! is established, starts sending once every connection is, and reports the rate from the
//! first message submitted to the last completed (its CPU time per message covers the whole
//! run). Its defaults are perftest's too: 128 messages in flight per connection, up to 512
//! receives posted per connection, polling while messages flow (`--spin-us 1000`), and one CQ
//! for all of a client's connections.
//!
//! # Reconnecting clients (`--reconnect`): numbered messages and `RESUME`
//!
//! A SEND's completion does not say the server's application got the message (on iWARP it
//! means handed to TCP), so only the server can say which messages a failure lost. With
//! `--reconnect` each message carries its number (`common::fill_numbered`), and the server
//! keeps, per client, which numbers arrived over all of that client's connections to the
//! reactor ([`Coverage`](bookkeeping::Coverage)). When a connection is established, and when the last message
//! arrives, it sends [`RESUME`] and the first number it lacks; the client (re)sends from
//! there and finishes only once told it has them all.
//!
//! That state outlives connections, so it is bound to the client that earned it: each client
//! connection draws a random 64-bit id and a random 128-bit key (`/dev/urandom`) and sends
//! both in its connect information. The id names the client in the server's lines; the key is
//! never printed. The server keeps a client's coverage under its id together with the key its
//! first connection gave, and refuses (`RejectCode::Refused`) a connection that names the id
//! with another key or another message count, before it is told anything of it (the key is
//! checked first, in time that does not depend on the bytes): another client can
//! neither read where someone else resumes nor mark someone else's messages as arrived (which
//! would make its victim stop early and lose them). Random ids also keep the clients of two
//! hosts apart. Nothing on the wire is encrypted: a peer that sees a client's connect
//! information can still claim its id.
//!
//! What a client's numbers may cost the server is bounded:
//!
//! - a numbered client states its message count (1 to 2^32 - 1) and sends messages of at least
//!   8 bytes by SEND; a number at or past its count closes that connection with a `FAILED`
//!   line naming it;
//! - a coverage is every message below the first missing one plus, one bit each, the next
//!   [`AHEAD_MAX`](bookkeeping::AHEAD_MAX) (at most 8 KiB, whatever the count); a message further ahead is not
//!   recorded, and the server sends `RESUME` with the first missing number again, from where
//!   the client sends them again (an honest client gets that far ahead only with a `--window`
//!   about that large, or when about that many messages that had completed at it were lost:
//!   on iWARP a completion means handed to TCP);
//! - at most one `RESUME` per connection is in flight, the latest value waiting behind it;
//! - a reactor keeps the coverage of at most [`RESUMABLE_MAX`](bookkeeping::RESUMABLE_MAX)
//!   clients: when a new one comes and the table is full, the entry of a client with no connection, unused the longest,
//!   goes (should that client come back, it is told to resume at 0 and sends everything
//!   again: nothing is lost); with every entry in use the new client is refused
//!   (`RejectCode::NoResources`).
//!
//! The client, for its part, refuses a server's numbers that cannot be true: a `RESUME` past
//! the messages it has sent, a message longer than its receive buffer, a ring descriptor with
//! fewer slots than the server's credit. It closes that connection and exits with an error.

#[path = "blast/bookkeeping.rs"]
mod bookkeeping;
#[path = "blast/client.rs"]
mod client;
mod common;
#[path = "blast/server.rs"]
mod server;

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::process::exit;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use client::client;
use common::group::{self, Group};
use common::{check_pattern, fill_pattern, Args};
use rdma_reactor::{
    Buf, CloseReason, Completion, Config, Conn, ConnectOptions, ConnectRequest, ConnectionHandler, Ctx, Decision,
    ListenerHandler, Op, OpCode, OpError, Reactor, Reconnect, Region, RegionWindow, RejectCode, RejectReason,
    RemoteAccess, RemoteSlice, Token, Transport, WcStatus,
};
use server::server;

const USAGE: &str = "\
usage: blast server --bind ADDR:PORT [--verify] [--depth N] [--max-size BYTES] [--exit-after N] [--quiet]
                    [--spin-us N] [--srq [--srq-receives N] [--srq-credit N] [--srq-max-credit N] [--srq-reserve N] [--srq-size BYTES]]
                    [--threads N] [--balance round-robin|fewest] [--shared-cq N]
                    [--metrics [ADDR:]PORT [--metrics-conns] [--metrics-max-conns N]]
                    [--ring-bytes BYTES]
       blast client --connect ADDR:PORT --size BYTES --count N [--clients K]
                    [--op send|write] [--verify] [--window N] [--spin-us N] [--shared-cq N]
                    [--reconnect N]

server: receives from any number of clients at once, from one thread.
  --bind ADDR:PORT   address of an RDMA device to listen on
  --verify           check every byte of every message
  --depth N          receives posted per connection: the credit window (minimum 3; default:
                     by message size, about 8 MiB of buffers, 16 to 512: 512 up to 16 KiB)
  --max-size BYTES   the largest message size a client may use (suffixes K, M; default 1M,
                     at most 1M; Config::msg_size): a client whose --size is larger is refused,
                     so receives are never sized by a client's claim alone
  --exit-after N     exit after N connections have closed (default: run until killed)
  --threads N        reactors, one per thread (default 1); the first listens and spreads the
                     connections over all; at exit each prints what it served
  --balance B        how: round-robin (default) or fewest (live connections)
  --metrics [ADDR:]PORT serve GET /metrics (Prometheus text: the reactor's counters) on a TCP
                     port, from the reactor's thread; reactor i of --threads on PORT + i.
                     A bare PORT is 127.0.0.1:PORT (this host only): any other address
                     exposes the counters to whoever can reach it on the network
  --metrics-conns    each connection's counters too, labelled with its peer's address:
                     13 samples a connection per scrape, built on the reactor's thread,
                     and every client's address told to whoever scrapes (default: off)
  --metrics-max-conns N HTTP connections held at once (default 64); one not done 10 s after
                     it was accepted is closed at the next accept; at the cap a newcomer is
                     closed at once
  --ring-bytes BYTES the most the --op write rings of all connections pin together (suffixes
                     K, M, G; default 1G): a connection whose ring would go beyond is refused
  --quiet            no per-connection lines
  --spin-us N        (both) poll for N microseconds after work before sleeping (default 1000,
                     as perftest's bandwidth tests poll; 0: event mode)
  --shared-cq N      (both) all connections on one CQ of N entries instead of one CQ each
                     (default: the server one each; a client of several connections one CQ
                     with room for all of them, while that is at most 32767 entries)
  --keepalive-ms N   (both) probe an idle connection every N ms (default: off)
  --ack-timeout-ms N (both) RC ACK timeout (default: the kernel's)
  --retry-count N    (both) transport retries, 0 to 7 (default 6)
  --credit-timeout-ms N (both) close a connection whose sends waited this long for the
                     peer's credits (a stopped peer; default 60000, the library's; 0:
                     wait for ever)
  --violation-backoff-ms N (server) refuse connect requests from an address for N ms,
                     twice as long per repeat, after one of its connections broke the
                     protocol (a message beyond its credit; default: off)
  --srq              receives from one shared receive queue the runtime keeps filled; the
                     credit window starts at --srq-credit instead of --depth
  --srq-receives N   receives on the shared queue (default 31232; (N - reserve) / credit
                     connections)
  --srq-credit N     receive depth each connection starts with and keeps (default 3, at least 3)
  --srq-max-credit N most a busy connection is granted from the free receives (default 32)
  --srq-reserve N    receives granted to no connection, taken by a peer that breaks its
                     credit before it is closed (default a thirty-second of --srq-receives)
  --srq-size BYTES   buffer of each shared receive: the largest message (default 1K)
client: streams N messages of BYTES on each of K connections.
  --connect ADDR:PORT
  --size BYTES       message size (suffixes K, M); with --op write the server's ring (depth
                     slots of it) is at most 64 MiB, its depth cut to fit
  --count N          messages per connection
  --clients K        connections from one reactor (default 1)
  --op send|write    SEND, or RDMA WRITE with immediate into the server's ring (default send)
  --verify           fill every message with a checkable pattern
  --window N         messages submitted ahead per connection (default 128)
  --reconnect N      after a failure, connect again (at most N failed attempts in a row,
                     backoff from 100 ms, give up after 60 s; --op send only, --count at most
                     4294967295). Messages carry their number; on each connection the server
                     says where to resume (the first message it lacks) and, once it has them
                     all, that the client is done: the count finishes over as many connections
                     as it takes, nothing lost (a SEND's completion does not say the server's
                     application got it). What the server keeps of a client is bound to a
                     random id and a secret key the client draws";

/// Connect-information user bytes: magic, flags (`FLAG_WRITE`, `FLAG_NUMBERED`), client id
/// (8 bytes, big endian), and with `FLAG_NUMBERED` the client's key ([`KEY_LEN`] bytes): 29
/// bytes of the 36 the connect information leaves.
const USER_MAGIC: &[u8; 4] = b"BLST";
/// Bytes of a reconnecting client's key: what binds its state at the server to it.
const KEY_LEN: usize = 16;
/// `--op write`.
const FLAG_WRITE: u8 = 1;
/// `--reconnect`: messages carry their number (`common::fill_numbered`) and may come over
/// several connections, some twice. The server tells the client where to resume ([`RESUME`]).
const FLAG_NUMBERED: u8 = 2;
/// With `FLAG_NUMBERED`, the server's messages: `RESUME` and the number of the first message
/// it has not received (little endian), when a connection is established and when it has
/// them all. The client (re)sends from there, and finishes when told it has them all: a
/// SEND's completion says the local device is done with it (on iWARP: handed to TCP), not that
/// the server's application got it, so only the server can say which messages a failure lost.
/// Also sent again, mid-connection, when a message arrives too far ahead ([`Seen::Beyond`]).
const RESUME: &[u8; 4] = b"RSUM";
/// The `user_data` of the server's `RESUME` sends: their completions free the next one.
const RESUME_SENT: u64 = 1;

fn main() {
    common::observe::init_logging("blast");
    let mut argv = std::env::args().skip(1);
    match argv.next().as_deref() {
        Some("server") => server(Args::parse(argv, &["verify", "quiet", "srq", "metrics-conns"], USAGE)),
        Some("client") => client(Args::parse(argv, &["verify"], USAGE)),
        Some("--help") | Some("-h") => println!("{USAGE}"),
        _ => common::fail(USAGE, "the first argument is `server` or `client`"),
    }
}

fn rate(bytes: u64, msgs: u64, secs: f64) -> String {
    let secs = secs.max(1e-9);
    format!("{:.1} MB/s, {:.0} messages/s", bytes as f64 / secs / 1e6, msgs as f64 / secs)
}

/// User and system CPU seconds of this process. System time includes the kernel's work on
/// our behalf; with Soft-RoCE that is the whole transport (packet building, ICRC).
fn cpu_seconds() -> (f64, f64) {
    use nix::sys::resource::{getrusage, UsageWho};
    match getrusage(UsageWho::RUSAGE_SELF) {
        Ok(u) => {
            let t = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 + tv.tv_usec() as f64 / 1e6;
            (t(u.user_time()), t(u.system_time()))
        }
        Err(_) => (0.0, 0.0),
    }
}

/// A [`RESUME`] message for `next`.
fn resume_message(conn: &mut Conn<'_>, next: u64) -> Result<Op, String> {
    let mut b = conn.alloc(12).map_err(|e| format!("resume buffer: {}", common::report(&e)))?;
    let mut bytes = RESUME.to_vec();
    bytes.extend_from_slice(&next.to_le_bytes());
    b.fill_from(&bytes).expect("12 bytes fit");
    Ok(Op::send(b).user_data(RESUME_SENT))
}

/// The message number a [`RESUME`] message carries.
fn resume_of(data: &[u8]) -> Option<u64> {
    (data.len() == 12 && &data[..4] == RESUME).then(|| u64::from_le_bytes(data[4..].try_into().expect("8 bytes")))
}

/// blast's default `--spin-us`: a throughput tool polls while messages flow, as perftest's
/// bandwidth tests do (they busy-poll for the whole run); one millisecond after the last work
/// it sleeps, so an idle blast costs nothing. The library's own default stays event mode
/// (`Config::spin` zero).
const BLAST_SPIN_US: u64 = 1000;

/// `--shared-cq N`: every connection of the reactor on one CQ of N entries (`Config::shared_cq`).
fn shared_cq(args: &Args) -> Option<u32> {
    Some(args.get("shared-cq", 0u32)).filter(|n| *n > 0)
}
