//! Two linked VMs: a busy connection when the peer's link goes down, goes down and comes back,
//! or the peer VM dies (catalogue cases 13 and 20).
//!
//! Run by `cargo xtask vm2 --cases` (and so by the two-VM stage of `cargo xtask test`): each
//! test runs in both VMs at the same time, `$VM_NAME` (A or B) picks its half, and the halves
//! meet through the VMs' `peer-signal` / `peer-wait` helpers (bounded waits). Without
//! `$PEER_ADDR` (one VM, a host) a test returns at once; `cargo xtask test`'s single-VM stage
//! leaves this binary out.
//!
//! The streaming side uses `retry_count` 6 (`$TWO_VM_RETRY` overrides): rxe takes 7, the
//! library's default, as "retry for ever" (rxe_comp.c: `if (qp->comp.retry_cnt != 7)
//! qp->comp.retry_cnt--;`), so with 7 a connection to a dead peer never fails on Soft-RoCE.
//! Flow control is off (`$TWO_VM_FLOW=1` turns it on), see [`reactor`]. Each half prints
//! `RESULT ...` lines, which the cases script quotes.

mod util;

use std::cell::RefCell;
use std::net::{IpAddr, SocketAddr};
use std::process::{Command, Stdio};
use std::rc::Rc;
use std::time::{Duration, Instant};

use rdma_reactor::{
    CloseReason, Completion, Config, Conn, ConnectOptions, ConnectRequest, ConnectionHandler, Ctx, Decision,
    ListenerHandler, Op, OpCode, OpError, Reactor, Token, WcStatus,
};

const NEEDS_TWO_VMS: &str = "needs two linked VMs: cargo xtask vm2 --cases";
/// Message size of the streams.
const SIZE: usize = 64 * 1024;
/// How long a link stays down: well beyond the retries' end (7 tries of the 268 ms ACK
/// timeout below, plus the keepalive: if the link came back sooner, the connection would
/// recover).
const DOWN: Duration = Duration::from_secs(12);
/// The keepalive and ACK timeout of both sides (`Config::keepalive`, `Config::ack_timeout`):
/// a connection that only receives notices a dead peer through its keepalive probes.
const KEEPALIVE: Duration = Duration::from_millis(500);
const ACK_TIMEOUT: Duration = Duration::from_millis(250);
/// The bound on noticing that the peer is gone.
const NOTICE: Duration = Duration::from_secs(60);
/// Receives a sink keeps posted.
const RECV_DEPTH: u32 = 16;
/// Sends a stream keeps in flight: half the sink's receives, so it never finds the receiver
/// without one (flow control is off: see [`reactor`]; on iWARP a completion is no receipt,
/// see [`link_down_up_iwarp`]).
const WINDOW: u64 = 8;

/// This VM's place on the link.
struct Vm {
    name: String,
    me: IpAddr,
    peer: IpAddr,
    netdev: String,
}

/// The link's ends from the environment, or `None` (after saying so) outside a linked VM.
fn vm() -> Option<Vm> {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let (Some(name), Some(me), Some(peer), Some(netdev)) =
        (var("VM_NAME"), var("RDMA_ADDR"), var("PEER_ADDR"), var("RDMA_NETDEV"))
    else {
        println!("skipped: {NEEDS_TWO_VMS}");
        return None;
    };
    Some(Vm { name, me: me.parse().expect("RDMA_ADDR"), peer: peer.parse().expect("PEER_ADDR"), netdev })
}

fn retry_count() -> u8 {
    std::env::var("TWO_VM_RETRY").ok().and_then(|v| v.parse().ok()).unwrap_or(6)
}

/// What one side's connections did.
#[derive(Default)]
struct Watch {
    /// Messages received by the sink, all connections.
    received: u64,
    /// Sends completed by the streams, all connections.
    sent: u64,
    /// Messages received whose bytes were not the stream's (each message `i` of a connection
    /// is filled with the byte `i as u8`).
    corrupt: u64,
    /// Closed connections: which side, messages it moved, why it ended, when.
    closed: Vec<Closed>,
    /// Credit-only messages the streams that finished their count had received (flow control
    /// at work).
    credit_messages: u64,
    /// When a stream's first operation failed with the device's error (not a flush): the
    /// handler knows of the failure then; `on_closed` follows once the disconnect is answered
    /// or its deadline (`Timeouts::disconnect`) has passed.
    first_failure: Option<Instant>,
}

struct Closed {
    role: &'static str,
    messages: u64,
    why: String,
    clean: bool,
    at: Instant,
}

type Shared = Rc<RefCell<Watch>>;

/// Accepts every connection and receives into 16 posted buffers.
struct Sink(Shared);

impl ListenerHandler for Sink {
    fn on_connect_request(&mut self, _ctx: &mut Ctx<'_>, _req: &ConnectRequest) -> Decision {
        Decision::Accept(Box::new(SinkConn { shared: self.0.clone(), messages: 0 }))
    }
}

struct SinkConn {
    shared: Shared,
    messages: u64,
}

impl ConnectionHandler for SinkConn {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        for _ in 0..RECV_DEPTH {
            let buf = conn.alloc(SIZE).expect("receive buffer");
            conn.submit(Op::recv(buf)).expect("post receive");
        }
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        if let (OpCode::Recv, Ok(len)) = (c.opcode, &c.result) {
            let expected = self.messages as u8;
            let intact =
                *len as usize == SIZE && c.buf.as_ref().is_some_and(|b| b.as_slice().iter().all(|&x| x == expected));
            self.messages += 1;
            let mut w = self.shared.borrow_mut();
            w.received += 1;
            w.corrupt += u64::from(!intact);
            drop(w);
            if let Some(buf) = c.buf {
                let _ = conn.submit(Op::recv(buf));
            }
        }
    }

    fn on_established(&mut self, _conn: &mut Conn<'_>) {
        log("receiving connection established");
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        let clean = reason.is_clean();
        log(&format!("receiving connection closed after {} messages: {reason}", self.messages));
        let c =
            Closed { role: "receiving", messages: self.messages, why: reason.to_string(), clean, at: Instant::now() };
        self.shared.borrow_mut().closed.push(c);
    }
}

/// Streams `limit` messages ([`WINDOW`] in flight), then closes.
struct Stream {
    shared: Shared,
    limit: u64,
    submitted: u64,
    completed: u64,
    error: Option<String>,
    /// Receives it keeps posted: 0, or at least 3 to take part in flow control (the peer's
    /// credit-only messages consume them; the runtime posts those again).
    recvs: u32,
}

impl Stream {
    fn new(shared: &Shared, limit: u64) -> Self {
        Stream { shared: shared.clone(), limit, submitted: 0, completed: 0, error: None, recvs: 0 }
    }

    /// A stream under flow control: it keeps 4 receives posted, as flow control needs (each
    /// side at least 3), in a reactor that offers it.
    fn flow_controlled(shared: &Shared, limit: u64) -> Self {
        Stream { recvs: 4, ..Stream::new(shared, limit) }
    }

    fn pump(&mut self, conn: &mut Conn<'_>) {
        while self.submitted < self.limit && self.submitted - self.completed < WINDOW {
            let Ok(mut buf) = conn.alloc(SIZE) else { return };
            buf.as_mut_slice().fill(self.submitted as u8);
            if conn.submit(Op::send(buf).user_data(self.submitted)).is_err() {
                return;
            }
            self.submitted += 1;
        }
    }
}

impl ConnectionHandler for Stream {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        for _ in 0..self.recvs {
            let buf = conn.alloc(64).expect("receive buffer");
            conn.submit(Op::recv(buf)).expect("post receive");
        }
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        log("sending connection established");
        self.pump(conn);
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        match (c.opcode, c.result) {
            (OpCode::Send, Ok(_)) => {
                self.completed += 1;
                self.shared.borrow_mut().sent += 1;
                if self.completed == self.limit {
                    self.shared.borrow_mut().credit_messages += conn.metrics().credit_messages_received;
                    return conn.close();
                }
                self.pump(conn);
            }
            (_, Err(OpError::Wc(WcStatus::WrFlushErr) | OpError::Cancelled)) => {}
            (op, Err(e)) => {
                self.error.get_or_insert(format!("{op:?} failed: {e}"));
                if matches!(e, OpError::Wc(_)) {
                    // The device's word (the runtime's own, `Unconfirmed`, comes at teardown).
                    self.shared.borrow_mut().first_failure.get_or_insert_with(Instant::now);
                }
            }
            (_, Ok(_)) => {}
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        let clean = reason.is_clean() && self.error.is_none();
        let why = match self.error.take() {
            Some(e) => format!("{reason} ({e})"),
            None => reason.to_string(),
        };
        log(&format!("sending connection closed after {} messages: {why}", self.completed));
        let c = Closed { role: "sending", messages: self.completed, why, clean, at: Instant::now() };
        self.shared.borrow_mut().closed.push(c);
    }
}

/// A line on the test's output with the time since boot (comparable between the halves only
/// roughly: each VM has its own clock).
fn log(what: &str) {
    let up = std::fs::read_to_string("/proc/uptime").unwrap_or_default();
    println!("[{}] {what}", up.split_whitespace().next().unwrap_or("?"));
}

/// A reactor for both roles, with a keepalive and a short ACK timeout, and flow control off
/// (`$TWO_VM_FLOW=1` turns it on): without a keepalive, a sender that waits for credits has
/// nothing in flight, so nothing to retry, and a receiver sends nothing at all; neither would
/// learn that the peer is gone.
fn reactor(retry: u8) -> Reactor {
    reactor_with(retry, std::env::var("TWO_VM_FLOW").is_ok_and(|v| v == "1"))
}

/// [`reactor`] with flow control as given.
fn reactor_with(retry: u8, flow_control: bool) -> Reactor {
    let cfg = Config {
        send_depth: 64,
        recv_depth: RECV_DEPTH,
        retry_count: retry,
        flow_control,
        keepalive: Some(KEEPALIVE),
        ack_timeout: Some(ACK_TIMEOUT),
        ..Config::default()
    };
    Reactor::with_config(cfg).expect("reactor")
}

/// Runs the reactor until `done` or `limit`; true when `done`.
fn run_until(r: &mut Reactor, limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if done() {
            return true;
        }
        r.run_once(Some(Duration::from_millis(50))).expect("run_once");
    }
    done()
}

fn signal(name: &str) {
    let st = Command::new("peer-signal").arg(name).status().expect("peer-signal");
    assert!(st.success(), "peer-signal {name}: {st}");
}

/// Waits for the peer's signal while the reactor keeps serving; true when it came.
fn wait_serving(r: &mut Reactor, name: &str, limit: Duration) -> bool {
    let mut child = Command::new("peer-wait")
        .args([name, &limit.as_secs().to_string()])
        .stdout(Stdio::null())
        .spawn()
        .expect("peer-wait");
    loop {
        if let Some(st) = child.try_wait().expect("peer-wait") {
            return st.success();
        }
        r.run_once(Some(Duration::from_millis(50))).expect("run_once");
    }
}

/// Waits for the peer's signal (nothing to serve meanwhile); panics when it does not come.
fn wait(name: &str, limit: Duration) {
    let st = Command::new("peer-wait")
        .args([name, &limit.as_secs().to_string()])
        .stdout(Stdio::null())
        .status()
        .expect("peer-wait");
    assert!(st.success(), "the peer did not signal {name} within {limit:?}");
}

fn link(vm: &Vm, state: &str) {
    let st = Command::new("ip").args(["link", "set", "dev", &vm.netdev, state]).status().expect("ip");
    assert!(st.success(), "ip link set dev {} {state}: {st}", vm.netdev);
    log(&format!("{}: link {} {state}", vm.name, vm.netdev));
}

/// Serves until the device's port is ACTIVE again (at most 30 s).
fn serve_until_active(r: &mut Reactor) -> bool {
    let dev = format!("{}/1", std::env::var("RDMA_DEV").unwrap_or_else(|_| "rxe0".into()));
    let end = Instant::now() + Duration::from_secs(30);
    while Instant::now() < end {
        let out = Command::new("rdma").args(["link", "show", &dev]).output().expect("rdma");
        if String::from_utf8_lossy(&out.stdout).contains("state ACTIVE") {
            return true;
        }
        run_until(r, Duration::from_millis(200), || false);
    }
    false
}

fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

fn closed_text(w: &Watch, role: &str, since: Instant) -> Vec<String> {
    w.closed
        .iter()
        .filter(|c| c.role == role)
        .map(|c| {
            let when = c.at.checked_duration_since(since).map_or("before".into(), secs);
            format!("{} messages, closed at {when}: {}", c.messages, c.why)
        })
        .collect()
}

/// Case 13a: A streams to B; B's link goes down. A's busy connection must be torn down with a
/// work error within [`NOTICE`] (on iWARP: by B's close, which arrives when B's link is back).
/// What B's receiving side sees is reported.
#[test]
#[ignore = "needs two linked VMs: cargo xtask vm2 --cases"]
fn peer_link_down_sender_gives_up() {
    let Some(vm) = vm() else { return };
    let port = 7481;
    let w = Shared::default();
    let mut r = reactor(retry_count());
    if vm.name == "B" {
        r.listen(SocketAddr::new(vm.me, port), Sink(w.clone())).expect("listen");
        signal("pld.listening");
        assert!(wait_serving(&mut r, "pld.down", Duration::from_secs(60)), "A's stream did not start");
        link(&vm, "down");
        let t0 = Instant::now();
        run_until(&mut r, DOWN, || false);
        link(&vm, "up");
        let active = serve_until_active(&mut r);
        signal("pld.up");
        run_until(&mut r, Duration::from_secs(10), || !w.borrow().closed.is_empty());
        let seen = closed_text(&w.borrow(), "receiving", t0);
        println!(
            "RESULT B's receiving side (link down {}, {} {} after up): {}",
            secs(DOWN),
            std::env::var("RDMA_DEV").unwrap_or_default(),
            if active { "ACTIVE" } else { "NOT active" },
            if seen.is_empty() {
                format!("never noticed; still open {} after its link went down", secs(t0.elapsed()))
            } else {
                seen.join("; ")
            }
        );
        return;
    }
    wait("pld.listening", Duration::from_secs(60));
    r.connect(SocketAddr::new(vm.peer, port), ConnectOptions::default(), Stream::new(&w, u64::MAX)).expect("connect");
    assert!(run_until(&mut r, Duration::from_secs(30), || w.borrow().sent >= 32), "the stream did not start");
    let t0 = Instant::now();
    signal("pld.down");
    let noticed = run_until(&mut r, NOTICE, || !w.borrow().closed.is_empty());
    let took = t0.elapsed();
    let text = closed_text(&w.borrow(), "sending", t0).join("; ");
    wait("pld.up", DOWN + Duration::from_secs(60));
    assert!(noticed, "A's busy connection was not torn down within {NOTICE:?} (retry_count {})", retry_count());
    let c = &w.borrow().closed[0];
    // On iWARP B's siw errors B's queue pairs when its link goes down and closes their
    // streams; A hears that close (a peer's disconnect) once the link is back, the retransmitted
    // FIN: an orderly end, within NOTICE all the same.
    if util::transport() != "siw" {
        assert!(!c.clean, "A's busy connection ended cleanly? {}", c.why);
    }
    println!(
        "RESULT A's sending side (retry_count {}): torn down {} after B was told to take its link down: {text}",
        retry_count(),
        secs(took)
    );
}

/// Case 20: B streams to A; A's link goes down for [`DOWN`], then up. B's busy connection must
/// fail (a work error), and a new connection after the link is back must carry its messages.
#[test]
#[ignore = "needs two linked VMs: cargo xtask vm2 --cases"]
fn link_down_up_busy_fails_new_works() {
    let Some(vm) = vm() else { return };
    if util::transport() == "siw" {
        return link_down_up_iwarp(&vm);
    }
    let port = 7482;
    let w = Shared::default();
    let mut r = reactor(retry_count());
    if vm.name == "A" {
        r.listen(SocketAddr::new(vm.me, port), Sink(w.clone())).expect("listen");
        signal("ldu.listening");
        assert!(wait_serving(&mut r, "ldu.down", Duration::from_secs(60)), "B's stream did not start");
        link(&vm, "down");
        let t0 = Instant::now();
        run_until(&mut r, DOWN, || false);
        link(&vm, "up");
        assert!(serve_until_active(&mut r), "rxe0 did not come back ACTIVE within 30 s of the link coming up");
        signal("ldu.up");
        let done = wait_serving(&mut r, "ldu.done", Duration::from_secs(120));
        run_until(&mut r, Duration::from_secs(5), || w.borrow().closed.len() >= 2);
        let seen = closed_text(&w.borrow(), "receiving", t0);
        println!(
            "RESULT A's receiving side: {}",
            if seen.is_empty() { "no connection closed".into() } else { seen.join("; ") }
        );
        assert!(done, "B did not finish");
        let w = w.borrow();
        assert!(
            w.closed.iter().any(|c| c.clean && c.messages == 64),
            "A's server did not receive the new connection's 64 messages"
        );
        return;
    }
    wait("ldu.listening", Duration::from_secs(60));
    r.connect(SocketAddr::new(vm.peer, port), ConnectOptions::default(), Stream::new(&w, u64::MAX)).expect("connect");
    assert!(run_until(&mut r, Duration::from_secs(30), || w.borrow().sent >= 32), "the stream did not start");
    let t0 = Instant::now();
    signal("ldu.down");
    // Closed after its first failed send and the disconnect's wait (across the dead link, until
    // the link is back or `Timeouts::disconnect`).
    let failed = run_until(&mut r, DOWN + Duration::from_secs(30), || !w.borrow().closed.is_empty());
    let first_failure = w.borrow().first_failure;
    let first = closed_text(&w.borrow(), "sending", t0).join("; ");
    wait("ldu.up", DOWN + Duration::from_secs(60));
    let before = w.borrow().closed.len();
    r.connect(SocketAddr::new(vm.peer, port), ConnectOptions::default(), Stream::new(&w, 64)).expect("connect again");
    let second_done = run_until(&mut r, Duration::from_secs(60), || w.borrow().closed.len() > before);
    signal("ldu.done");
    assert!(failed, "B's busy connection survived A's {DOWN:?} outage (retry_count {})", retry_count());
    let took = first_failure
        .unwrap_or_else(|| panic!("B's busy connection closed with no send failed by the device: {first}"))
        .saturating_duration_since(t0);
    assert!(
        took < DOWN,
        "B's busy connection's first send failed only {} after the link went down, when it was back",
        secs(took)
    );
    assert!(!w.borrow().closed[0].clean, "B's busy connection ended cleanly? {first}");
    println!(
        "RESULT B's busy connection's first send failed {} after A was told to take its link down: {first}",
        secs(took)
    );
    assert!(second_done, "the new connection did not finish within 60 s");
    let w = w.borrow();
    let second = &w.closed[before];
    assert!(second.clean && second.messages == 64, "the new connection: {} messages, {}", second.messages, second.why);
    println!("RESULT a new connection after the link came up: 64 messages of {SIZE} bytes, {}", second.why);
}

/// Case 20 on iWARP, where what is asserted differs. Soft-iWARP moves every queue pair of its
/// device to the error state when the device's netdev goes down (`siw_netdev_down`, Linux 6.1
/// `siw_main.c`), and closes their TCP streams; the peer, across the dead link, hears of it
/// only when the link is back (the stream's end arrives then: TCP retransmits through the
/// outage, and neither the RC retry count nor the ACK timeout applies to siw). What must hold:
/// A's connection closes during its outage, B's busy one ends (after the link is back, or
/// during the outage when siw ends it first: see the end of the function), and a new
/// connection afterwards carries its 64 messages, every byte as sent.
///
/// The new connection runs with flow control (B makes it from a second reactor that offers
/// it, and its stream keeps 4 receives posted, as flow control needs of each side; A offers
/// it to both). Without it the stream is paced by [`WINDOW`] completions, and
/// Soft-iWARP completes a SEND once TCP has taken it, not once it was received: the stream can
/// run any distance ahead of the receives the sink has posted again, and a SEND that finds
/// none ends the connection (no RNR retry on iWARP: the receiving device terminates the stream,
/// and the sink sees a close like a peer's, short of the 64; FAULTS.md, "a send ... without
/// credit"). That was this test's failure in a run of stop 27: 60 of 64 received, every send
/// completed. On RoCE the same overrun is an RNR NAK, retried.
///
/// And the new connection closes right after its 64th SEND completed. Before the close
/// handshake that lost the last message in 1 run of 4 (63 of 64, stop 28): on iWARP a
/// completed SEND may still be in the sender's TCP send buffer when the close begins (FAULTS.md,
/// iWARP, "a close right after the last SEND completed"; the case `close-after-send` measures
/// it). Stop 28 made this connection wait for A's word before closing; now the runtime waits
/// for A's answer to its farewell (`Config::close_handshake`, on by default), and the test
/// checks that it did. The busy connection is made as before, without flow control. (A first attempt only made both reactors offer flow control;
/// with no receives posted by the streams it never applied, three runs passed all the same,
/// and in the next CI run B's busy connection met A's reset within a second of the outage,
/// `LocQpOpErr`, which this test had never seen: not understood, left as it was.)
fn link_down_up_iwarp(vm: &Vm) {
    let port = 7482;
    let w = Shared::default();
    if vm.name == "A" {
        let mut r = reactor_with(retry_count(), true);
        r.listen(SocketAddr::new(vm.me, port), Sink(w.clone())).expect("listen");
        signal("ldu.listening");
        assert!(wait_serving(&mut r, "ldu.down", Duration::from_secs(60)), "B's stream did not start");
        link(vm, "down");
        let t0 = Instant::now();
        run_until(&mut r, DOWN, || false);
        let during = closed_text(&w.borrow(), "receiving", t0);
        link(vm, "up");
        assert!(serve_until_active(&mut r), "siw0 did not come back ACTIVE within 30 s of the link coming up");
        signal("ldu.up");
        let done = wait_serving(&mut r, "ldu.done", Duration::from_secs(120));
        run_until(&mut r, Duration::from_secs(5), || w.borrow().closed.len() >= 2);
        let w = w.borrow();
        println!(
            "RESULT A's receiving side: during its {} outage: {}; after: {}; {} messages with bytes not as sent",
            secs(DOWN),
            if during.is_empty() { "no connection closed".into() } else { during.join("; ") },
            closed_text(&w, "receiving", t0).into_iter().skip(during.len()).collect::<Vec<_>>().join("; "),
            w.corrupt
        );
        assert!(done, "B did not finish");
        assert_eq!(during.len(), 1, "A's connection was closed during A's outage (siw errors its queue pairs)");
        assert!(
            w.closed.iter().any(|c| c.clean && c.messages == 64),
            "A's server did not receive the new connection's 64 messages"
        );
        assert_eq!(w.corrupt, 0, "every byte as sent");
        return;
    }
    wait("ldu.listening", Duration::from_secs(60));
    // B's busy connection without flow control, its new one with it (see above).
    let mut r = reactor(retry_count());
    r.connect(SocketAddr::new(vm.peer, port), ConnectOptions::default(), Stream::new(&w, u64::MAX)).expect("connect");
    assert!(run_until(&mut r, Duration::from_secs(30), || w.borrow().sent >= 32), "the stream did not start");
    let t0 = Instant::now();
    signal("ldu.down");
    let came_back = wait_serving(&mut r, "ldu.up", DOWN + Duration::from_secs(60));
    let closed_before_up = w.borrow().closed.len();
    let t_up = Instant::now();
    let ended = run_until(&mut r, NOTICE, || !w.borrow().closed.is_empty());
    let first = closed_text(&w.borrow(), "sending", t0).join("; ");
    let after_up = t_up.elapsed();
    assert!(came_back, "A's link did not come back");
    let before = w.borrow().closed.len();
    let mut r = reactor_with(retry_count(), true);
    // Its 64 SENDs completed, it closes at once: the close handshake (see the doc comment).
    let again = Stream::flow_controlled(&w, 64);
    r.connect(SocketAddr::new(vm.peer, port), ConnectOptions::default(), again).expect("connect again");
    let second_done = run_until(&mut r, Duration::from_secs(90), || w.borrow().closed.len() > before);
    signal("ldu.done");
    let farewells = (r.stats().farewells_answered, r.stats().farewells_unanswered);
    // When B's dead connection ends is Soft-iWARP's and TCP's business, not the runtime's: after
    // the link is back (A's stack resets B's retransmission), or already during the outage: on
    // stop 31's machine 4 runs of 6 ended it within 0.4-0.6 s (`Peer` or `LocQpOpErr`) and one
    // at 5.5 s, the baseline c364230 alike, and dropping everything A sends (netem) before its
    // link went down did not prevent it: not understood. What must hold is that it ends, and
    // that a new connection works once the link is back.
    assert!(ended, "B's busy connection did not end within {NOTICE:?} of A's link coming back");
    if closed_before_up == 0 {
        println!("RESULT B's busy connection ended {} after A's link came back: {first}", secs(after_up));
    } else {
        println!("RESULT B's busy connection ended while A's link was down: {first}");
    }
    assert!(second_done, "the new connection did not finish within 60 s");
    let w = w.borrow();
    let second = &w.closed[before];
    assert!(second.clean && second.messages == 64, "the new connection: {} messages, {}", second.messages, second.why);
    assert!(w.credit_messages > 0, "the new connection ran under flow control (A granted credits)");
    assert_eq!(farewells, (1, 0), "the new connection closed by the close handshake, A answered its farewell");
    println!(
        "RESULT a new connection after the link came up: 64 messages of {SIZE} bytes under flow control ({} credit messages from A), {}, its farewell answered",
        w.credit_messages, second.why
    );
}

/// Streams per round of [`close_right_after_the_last_send`], and rounds per phase.
const CLOSE_CONNS: usize = 8;
const CLOSE_ROUNDS: usize = 4;

/// B's reactor for [`close_right_after_the_last_send`]: flow control on, the close handshake
/// as given.
fn close_reactor(close_handshake: bool) -> Reactor {
    let cfg = Config { send_depth: 64, recv_depth: RECV_DEPTH, close_handshake, ..Config::default() };
    Reactor::with_config(cfg).expect("reactor")
}

/// FAULTS.md, iWARP, "a close right after the last SEND completed": B streams 64 messages of
/// 64 KiB on each of [`CLOSE_CONNS`] connections to A, [`CLOSE_ROUNDS`] rounds, and closes each
/// connection in its last SEND's completion; A's sink verifies every byte and counts. First
/// with B's close handshake off (`Config::close_handshake`): on iWARP a completed SEND may
/// still be in B's TCP send buffer, and what is lost is printed, not asserted (a race); on RoCE
/// nothing may be lost. Then with it on: nothing may be lost, and on iWARP every farewell was
/// answered.
#[test]
#[ignore = "needs two linked VMs: cargo xtask vm2 --cases"]
fn close_right_after_the_last_send() {
    let Some(vm) = vm() else { return };
    let port = 7484;
    let iwarp = util::transport() == "siw";
    let per_phase = CLOSE_CONNS * CLOSE_ROUNDS;
    let w = Shared::default();
    if vm.name == "A" {
        let mut r = reactor_with(retry_count(), true);
        r.listen(SocketAddr::new(vm.me, port), Sink(w.clone())).expect("listen");
        signal("cl.listening");
        let mut lost = Vec::new();
        for phase in ["off", "on"] {
            let before = w.borrow().closed.len();
            let all = run_until(&mut r, Duration::from_secs(120), || w.borrow().closed.len() >= before + per_phase);
            let w = w.borrow();
            let got: Vec<u64> = w.closed[before..].iter().map(|c| c.messages).collect();
            let n: u64 = got.iter().sum();
            println!(
                "RESULT A, B's close handshake {phase}: {n} of {} messages received ({} connections with fewer than 64)",
                64 * per_phase,
                got.iter().filter(|&&m| m < 64).count()
            );
            assert!(all, "handshake {phase}: only {} of {per_phase} connections closed", got.len());
            lost.push(64 * per_phase as u64 - n);
            signal(&format!("cl.{phase}"));
        }
        assert_eq!(w.borrow().corrupt, 0, "every byte as sent");
        if !iwarp {
            assert_eq!(lost[0], 0, "on RoCE a completed SEND is one the peer acknowledged");
        }
        assert_eq!(lost[1], 0, "nothing lost with the close handshake");
        return;
    }
    wait("cl.listening", Duration::from_secs(60));
    for (phase, on) in [("off", false), ("on", true)] {
        let mut r = close_reactor(on);
        for round in 0..CLOSE_ROUNDS {
            let before = w.borrow().closed.len();
            for _ in 0..CLOSE_CONNS {
                let s = Stream::flow_controlled(&w, 64);
                r.connect(SocketAddr::new(vm.peer, port), ConnectOptions::default(), s).expect("connect");
            }
            let done = run_until(&mut r, Duration::from_secs(60), || w.borrow().closed.len() >= before + CLOSE_CONNS);
            assert!(done, "handshake {phase}, round {round}: the streams did not all close");
            let w = w.borrow();
            for c in &w.closed[before..] {
                assert!(c.clean && c.messages == 64, "handshake {phase}: {} sends completed, {}", c.messages, c.why);
            }
        }
        let s = r.stats();
        println!(
            "RESULT B, close handshake {phase}: {per_phase} streams of 64 closed at their last completion; farewells \
             answered {}, unanswered {}",
            s.farewells_answered, s.farewells_unanswered
        );
        let want = if on && iwarp { per_phase as u64 } else { 0 };
        assert_eq!((s.farewells_answered, s.farewells_unanswered), (want, 0), "handshake {phase}");
        drop(r);
        wait(&format!("cl.{phase}"), Duration::from_secs(120));
    }
}

/// Case 13b: A and B stream to each other; B's VM powers off at once. A's sending connection
/// must be torn down within [`NOTICE`], and so must its receiving side, which sends nothing
/// but its keepalive probes (on iWARP, with `tcp_retries2` lowered: TCP decides there).
#[test]
#[ignore = "needs two linked VMs: cargo xtask vm2 --cases"]
fn peer_killed_sender_notices() {
    let Some(vm) = vm() else { return };
    if util::transport() == "siw" {
        // On iWARP a vanished peer is noticed when TCP gives up on the stream: the RC retry
        // count and ACK timeout do not apply, and a keepalive WRITE is only more data for TCP
        // to retransmit. At Linux's default `tcp_retries2` (15) that is about 15 minutes;
        // an operator who wants it sooner lowers it, as here (5: about 13-16 s at the VM's RTO, with a keepalive interval).
        let st = Command::new("sysctl").args(["-w", "net.ipv4.tcp_retries2=5"]).status().expect("sysctl");
        assert!(st.success(), "sysctl -w net.ipv4.tcp_retries2=5: {st}");
    }
    let port = 7483;
    let w = Shared::default();
    let mut r = reactor(retry_count());
    r.listen(SocketAddr::new(vm.me, port), Sink(w.clone())).expect("listen");
    signal("pk.listening");
    wait("pk.listening", Duration::from_secs(60));
    r.connect(SocketAddr::new(vm.peer, port), ConnectOptions::default(), Stream::new(&w, u64::MAX)).expect("connect");
    let both = |w: &Shared| w.borrow().sent >= 32 && w.borrow().received >= 32;
    assert!(run_until(&mut r, Duration::from_secs(30), || both(&w)), "the streams did not start");
    if vm.name == "B" {
        signal("pk.streaming");
        if wait_serving(&mut r, "pk.die", Duration::from_secs(60)) {
            println!("B: powering off now");
            let _ = Command::new("vm-poweroff").status();
            std::thread::sleep(Duration::from_secs(30));
        }
        panic!("A did not say when to power off");
    }
    assert!(wait_serving(&mut r, "pk.streaming", Duration::from_secs(60)), "B's stream did not start");
    let t0 = Instant::now();
    signal("pk.die");
    let sent_before = w.borrow().sent;
    let noticed = run_until(&mut r, NOTICE, || w.borrow().closed.iter().filter(|c| c.role == "sending").count() > 0);
    let took = t0.elapsed();
    // Give the receiving side as long again (bounded by NOTICE in all). On iWARP it learns
    // later than the sending side: it only sends keepalive probes, which TCP retransmits until
    // it gives up (about 15 s at tcp_retries2 5), while the sending side can learn at once (one
    // CI run: B's powering off closed it in 2.6 s): there it gets what is left of NOTICE.
    let rest = if util::transport() == "siw" {
        NOTICE.saturating_sub(took)
    } else {
        NOTICE.saturating_sub(took).min(took + Duration::from_secs(5))
    };
    run_until(&mut r, rest, || w.borrow().closed.iter().any(|c| c.role == "receiving"));
    let w = w.borrow();
    let recv = closed_text(&w, "receiving", t0);
    println!(
        "RESULT A's receiving side (keepalive {KEEPALIVE:?}): {}",
        if recv.is_empty() { format!("did not notice within {}", secs(t0.elapsed())) } else { recv.join("; ") }
    );
    assert!(!recv.is_empty(), "A's receiving side did not notice within {}", secs(t0.elapsed()));
    assert!(noticed, "A's sending connection was not torn down within {NOTICE:?} (retry_count {})", retry_count());
    let c = w.closed.iter().find(|c| c.role == "sending").expect("closed");
    // siw reports TCP giving up as the stream's close, which rdma_cm passes on as a
    // DISCONNECTED like a peer's orderly one: on iWARP the end cannot be told apart.
    if util::transport() != "siw" {
        assert!(!c.clean, "A's sending connection ended cleanly? {}", c.why);
    }
    println!(
        "RESULT A's sending side (retry_count {}): torn down {} after B was told to power off ({} sends completed since): {}",
        retry_count(),
        secs(took),
        c.messages.saturating_sub(sent_before),
        closed_text(&w, "sending", t0).join("; ")
    );
}
