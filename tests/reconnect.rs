//! Reconnecting clients (`ConnectOptions::reconnect`, issue 21): a client that loses its
//! server keeps its token, handler and unposted operations, and connects again; one whose
//! attempts run out closes with everything it held completed and every kernel resource gone.
//! The two-VM cases (link down and up, server killed and restarted across machines) are in
//! `xtask/src/vm2_cases.sh`.

mod util;

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use rdma_reactor::{
    CloseReason, Completion, Conn, ConnectOptions, ConnectionHandler, Ctx, Error, Op, OpCode, OpError, Reactor,
    Reconnect, RemoteSlice, Token,
};
use util::*;

const SIZE: usize = 256;
const LIMIT: Duration = Duration::from_secs(30);

/// What the client saw.
#[derive(Default)]
struct Seen {
    established: Vec<Token>,
    reconnecting: Vec<(CloseReason, u32)>,
    reconnected: Vec<Token>,
    /// Sequence numbers echoed back with every byte as sent.
    echoed: Vec<u64>,
    /// Completions in error or cancelled: (user_data, error).
    errors: Vec<(u64, OpError)>,
    /// What a one-sided submission while reconnecting was told.
    one_sided: Vec<String>,
    closed: Option<CloseReason>,
}

/// Sends message 0 when established and one numbered `1000 + attempt` from each
/// `on_reconnecting` (it waits for the new connection); checks every echo.
struct Redialer {
    seen: Rc<RefCell<Seen>>,
}

fn message(conn: &mut Conn<'_>, seq: u64) -> Op {
    let mut b = conn.alloc(SIZE).expect("buffer");
    b.fill_from(&pattern(SIZE, 7, seq)).expect("fits");
    b.as_mut_slice()[..8].copy_from_slice(&seq.to_le_bytes());
    Op::send(b).user_data(seq)
}

impl ConnectionHandler for Redialer {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        post_recvs(conn, 4, SIZE);
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        self.seen.borrow_mut().established.push(conn.token());
        let op = message(conn, 0);
        conn.submit(op).expect("send 0");
    }

    fn on_reconnecting(&mut self, conn: &mut Conn<'_>, reason: &CloseReason, attempt: u32, _delay: Duration) {
        let op = message(conn, 1000 + u64::from(attempt));
        let mut seen = self.seen.borrow_mut();
        seen.reconnecting.push((reason.clone(), attempt));
        conn.submit(op).expect("a SEND submitted while reconnecting waits for the new connection");
        let buf = conn.alloc(SIZE).expect("buffer");
        let stale = RemoteSlice { addr: 0x1000, len: SIZE as u32, rkey: 1 };
        match conn.submit(Op::write(buf, stale)) {
            Err(e) => seen.one_sided.push(e.error.to_string()),
            Ok(()) => seen.one_sided.push("accepted".into()),
        }
    }

    fn on_reconnected(&mut self, conn: &mut Conn<'_>) {
        self.seen.borrow_mut().reconnected.push(conn.token());
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        match (c.opcode, c.result) {
            (OpCode::Recv, Ok(n)) => {
                let buf = c.buf.expect("pool receive");
                let data = &buf.as_slice()[..n as usize];
                let seq = u64::from_le_bytes(data[..8].try_into().expect("8 bytes"));
                let mut want = pattern(SIZE, 7, seq);
                want[..8].copy_from_slice(&seq.to_le_bytes());
                assert_eq!(data, &want[..], "echo of message {seq}");
                self.seen.borrow_mut().echoed.push(seq);
                let _ = conn.submit(Op::recv(buf));
            }
            (_, Ok(_)) => {}
            (_, Err(e)) => self.seen.borrow_mut().errors.push((c.user_data, e)),
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        self.seen.borrow_mut().closed = Some(reason);
    }
}

fn policy() -> Reconnect {
    Reconnect {
        attempts: 50,
        backoff: Duration::from_millis(50),
        max_backoff: Duration::from_millis(400),
        jitter_percent: 25,
        deadline: Some(Duration::from_secs(30)),
    }
}

fn echo_server(at: std::net::SocketAddr) -> Reactor {
    let mut srv = Reactor::new().expect("server reactor");
    srv.listen(at, EchoListener { depth: 8, agents_closed: Default::default() }).expect("listen");
    srv
}

/// The server goes away (its reactor dropped: its connection disconnected, its listener gone)
/// and comes back on the same port: the client reconnects under the same token, what it
/// submitted meanwhile is posted on the new connection and echoed, a one-sided operation is
/// refused while it waits, and after its close nothing of it is left in the kernel.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_client_reconnects_under_its_token_and_sends_what_waited() {
    let base = res_counts(std::process::id());
    let seen = Rc::new(RefCell::new(Seen::default()));
    let mut cli = Reactor::new().expect("client reactor");
    let opts = ConnectOptions { msg_size: SIZE as u32, reconnect: Some(policy()), ..ConnectOptions::default() };
    let at = addr();
    let token = cli.connect(at, opts, Redialer { seen: seen.clone() }).expect("connect");
    {
        let mut srv = echo_server(at);
        pump(&mut [&mut srv, &mut cli], LIMIT, "the first echo", || seen.borrow().echoed.contains(&0));
    }
    // The server is gone: the client notices (its peer disconnected) and keeps trying.
    run_until(&mut cli, LIMIT, || seen.borrow().reconnecting.len() >= 2);
    let mut srv = echo_server(at);
    pump(&mut [&mut srv, &mut cli], LIMIT, "the reconnection and the waiting messages' echoes", || {
        let s = seen.borrow();
        !s.reconnected.is_empty() && s.reconnecting.iter().all(|(_, a)| s.echoed.contains(&(1000 + u64::from(*a))))
    });
    {
        let s = seen.borrow();
        println!(
            "reconnecting: {:?}\nreconnected: {:?}\nechoed: {:?}\nerrors: {:?}",
            s.reconnecting, s.reconnected, s.echoed, s.errors
        );
        assert_eq!(s.established, [token], "on_established once");
        assert_eq!(s.reconnected, [token], "the same token after the reconnection");
        assert_eq!(s.reconnecting[0].0, CloseReason::Peer, "the server's reactor disconnected it");
        assert_eq!(
            s.reconnecting.iter().map(|(_, a)| *a).collect::<Vec<_>>(),
            (1..=s.reconnecting.len() as u32).collect::<Vec<_>>()
        );
        assert!(s.reconnecting[1..].iter().all(|(r, _)| matches!(r, CloseReason::Rejected { .. })), "nothing listened");
        assert!(
            s.one_sided.iter().all(|e| e.contains("reconnecting") && e.contains("remote keys")),
            "{:?}",
            s.one_sided
        );
        // Every message submitted while it waited was echoed once, in order, after message 0.
        let waited: Vec<u64> = s.reconnecting.iter().map(|(_, a)| 1000 + u64::from(*a)).collect();
        assert_eq!(s.echoed, [&[0][..], &waited[..]].concat());
        // What was on the device at each failure completed in error: the receives of each
        // queue pair (4 each); the one-sided writes were refused, never queued.
        assert!(s.errors.iter().all(|(_, e)| !matches!(e, OpError::Cancelled)), "{:?}", s.errors);
    }
    let stats = cli.stats();
    assert_eq!(stats.reconnected, 1);
    assert_eq!(stats.reconnects as usize, seen.borrow().reconnecting.len());
    let m = cli.conn_metrics(token).expect("the connection lives");
    assert_eq!(m.recvs as usize, seen.borrow().echoed.len(), "counters kept across the reconnection");
    cli.ctx().close(token);
    pump(&mut [&mut srv, &mut cli], LIMIT, "the close", || seen.borrow().closed.is_some());
    assert_eq!(seen.borrow().closed, Some(CloseReason::Local));
    drop(cli);
    drop(srv);
    assert_eq!(res_counts(std::process::id()), base, "kernel resources back to the baseline");
}

/// Echoes like `EchoAgent`, and the first connection's agent closes its connection gracefully
/// once its first echo has gone (`Conn::close`: on iWARP the close handshake, our farewell).
struct ClosingAgent {
    first: bool,
}

impl ConnectionHandler for ClosingAgent {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        post_recvs(conn, 8, SIZE);
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        match (c.opcode, c.result) {
            (OpCode::Recv, Ok(_)) => echo(conn, c.buf.expect("buffer")),
            (OpCode::Send, Ok(_)) if self.first => {
                self.first = false;
                conn.close();
            }
            _ => {}
        }
    }
}

/// Sends `buf` back and posts a receive in its place (both refused once the connection is
/// closing: the buffers then go back to the pool).
fn echo(conn: &mut Conn<'_>, buf: rdma_reactor::Buf) {
    if conn.submit(Op::send(buf)).is_ok() {
        let buf = conn.alloc(SIZE).expect("agent receive buffer");
        let _ = conn.submit(Op::recv(buf));
    }
}

struct ClosingListener {
    accepted: u32,
}

impl rdma_reactor::ListenerHandler for ClosingListener {
    fn on_connect_request(
        &mut self,
        _ctx: &mut Ctx<'_>,
        _req: &rdma_reactor::ConnectRequest,
    ) -> rdma_reactor::Decision {
        self.accepted += 1;
        rdma_reactor::Decision::Accept(Box::new(ClosingAgent { first: self.accepted == 1 }))
    }
}

/// Review finding M4 (issue 32): the server closes the client's first connection gracefully;
/// on iWARP the client answers its farewell and arms the parting timer (`Timeouts::finish`,
/// 2 s), the server disconnects, the client reconnects. The old timer must not end the new
/// connection: before the fix it fired on it about 2 s later ("the peer said goodbye and has
/// not disconnected", `Stats::silent_partings` 1, a second `on_reconnecting`). On RoCE there is
/// no close handshake and no parting timer: the test passes there without testing M4.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_graceful_server_close_leaves_no_timer_on_the_reconnected_connection() {
    let seen = Rc::new(RefCell::new(Seen::default()));
    let mut cli = Reactor::new().expect("client reactor");
    let opts = ConnectOptions { msg_size: SIZE as u32, reconnect: Some(policy()), ..ConnectOptions::default() };
    let at = addr();
    let mut srv = Reactor::new().expect("server reactor");
    srv.listen(at, ClosingListener { accepted: 0 }).expect("listen");
    let token = cli.connect(at, opts, Redialer { seen: seen.clone() }).expect("connect");
    pump(&mut [&mut srv, &mut cli], LIMIT, "the reconnection after the server's close", || {
        let s = seen.borrow();
        !s.reconnected.is_empty() && s.echoed.contains(&1001)
    });
    // Longer than `Timeouts::finish` (2 s) after the answer to the server's farewell.
    let until = std::time::Instant::now() + Duration::from_secs(4);
    pump(&mut [&mut srv, &mut cli], LIMIT, "4 s on the new connection", || std::time::Instant::now() >= until);
    let stats = cli.stats();
    let s = seen.borrow();
    println!(
        "reconnecting: {:?}\nreconnected: {:?}\nechoed: {:?}\nfarewells heard {}, silent partings {}",
        s.reconnecting, s.reconnected, s.echoed, stats.farewells_heard, stats.silent_partings
    );
    assert_eq!(s.reconnecting.len(), 1, "one reconnection, for the server's close: {:?}", s.reconnecting);
    assert_eq!(s.reconnecting[0].0, CloseReason::Peer);
    assert_eq!(stats.silent_partings, 0, "the old connection's parting timer ended the new one");
    if transport() == "siw" {
        // Else the test would pass without the timer it is about.
        assert!(stats.farewells_heard >= 1, "the server's close went through the close handshake");
    }
    assert!(s.closed.is_none(), "{:?}", s.closed);
    assert_eq!(s.reconnected, [token]);
    drop(s);
    cli.ctx().close(token);
    pump(&mut [&mut srv, &mut cli], LIMIT, "the close", || seen.borrow().closed.is_some());
}

/// Nothing listens: the client tries `attempts` times, then closes with the last reason; the
/// SEND it submitted while waiting completes `Cancelled` before `on_closed`.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_client_gives_up_after_its_attempts_and_leaves_nothing() {
    let base = res_counts(std::process::id());
    let seen = Rc::new(RefCell::new(Seen::default()));
    let mut cli = Reactor::new().expect("client reactor");
    let policy = Reconnect { attempts: 3, backoff: Duration::from_millis(20), ..Reconnect::default() };
    let opts = ConnectOptions { msg_size: SIZE as u32, reconnect: Some(policy), ..ConnectOptions::default() };
    cli.connect(addr(), opts, Redialer { seen: seen.clone() }).expect("connect");
    run_until(&mut cli, LIMIT, || seen.borrow().closed.is_some());
    let s = seen.borrow();
    println!("reconnecting: {:?}\nclosed: {:?}\nerrors: {:?}", s.reconnecting, s.closed, s.errors);
    assert_eq!(s.reconnecting.iter().map(|(_, a)| *a).collect::<Vec<_>>(), [1, 2, 3]);
    assert!(matches!(s.closed, Some(CloseReason::Rejected { .. })), "{:?}", s.closed);
    assert!(s.established.is_empty() && s.reconnected.is_empty());
    // Each waiting SEND completed once, cancelled: never posted.
    let mut cancelled: Vec<u64> =
        s.errors.iter().filter(|(_, e)| matches!(e, OpError::Cancelled)).map(|(u, _)| *u).collect();
    cancelled.sort_unstable();
    assert_eq!(cancelled, [1001, 1002, 1003]);
    let stats = cli.stats();
    assert_eq!((stats.reconnects, stats.reconnected, stats.closed), (3, 0, 1));
    drop(s);
    drop(cli);
    assert_eq!(res_counts(std::process::id()), base, "kernel resources back to the baseline");
}

/// A policy it cannot work with is refused at connect, saying why.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_bad_policy_is_refused_at_connect() {
    let mut cli = Reactor::new().expect("client reactor");
    let policy = Reconnect { jitter_percent: 150, ..Reconnect::default() };
    let opts = ConnectOptions { reconnect: Some(policy), ..ConnectOptions::default() };
    let seen = Rc::new(RefCell::new(Seen::default()));
    match cli.connect(addr(), opts, Redialer { seen }) {
        Err(Error::Config(why)) => assert!(why.contains("jitter_percent 150"), "{why}"),
        other => panic!("{other:?}"),
    }
}

/// The blast example's `--reconnect` across a server killed (SIGKILL) and started again on the
/// same port: the new server has none of the messages, tells the client to resume at 0, and
/// gets every one, every byte verified; the client finishes when it says so.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn blast_finishes_its_count_across_a_killed_and_restarted_server() {
    let at = addr();
    let a = at.to_string();
    let server = |log: &std::path::Path| {
        let p = Proc::spawn_logged(
            "blast server",
            bin("blast"),
            &["server", "--bind", &a, "--verify", "--spin-us", "0"],
            log,
        );
        wait_listening(at, LIMIT);
        p
    };
    let log1 = log_path("server1");
    let mut s1 = server(&log1);
    let clog = log_path("client");
    let args = [
        "client",
        "--connect",
        &a,
        "--size",
        "16K",
        "--count",
        "8000",
        "--window",
        "16",
        "--verify",
        "--reconnect",
        "30",
        "--spin-us",
        "0",
    ];
    let client = Proc::spawn_logged("blast client", bin("blast"), &args, &clog);
    // Kill the server once data flows (its per-second rate line).
    let deadline = std::time::Instant::now() + LIMIT;
    while !read_log(&log1).contains("MB/s") {
        assert!(std::time::Instant::now() < deadline, "no data reached the first server:\n{}", read_log(&log1));
        std::thread::sleep(Duration::from_millis(20));
    }
    kill9(&mut s1);
    std::thread::sleep(Duration::from_millis(700));
    let log2 = log_path("server2");
    let mut s2 = server(&log2);
    let status = client.wait(Duration::from_secs(120));
    let out = read_log(&clog);
    println!("client:\n{out}");
    kill9(&mut s2);
    let srv = read_log(&log2);
    println!("second server:\n{srv}");
    assert!(status.success(), "the client failed: {status:?}");
    assert!(out.contains(": reconnected\n"), "the client did not reconnect");
    assert!(!out.contains("FAILED") && !srv.contains("FAILED"));
    assert!(srv.contains("all messages 0..7999 arrived over") && srv.contains("every byte verified"), "{srv}");
}
