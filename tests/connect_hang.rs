//! A connect that hangs does not stop the reactor: on iWARP `rdma_connect` makes the TCP
//! connection inside the call, which blocks until the handshake ends; against a host that
//! drops SYNs that is until TCP gives up (about 2 minutes). The runtime makes that call on a
//! helper thread (`src/reactor/conn/connect.rs`), so the reactor's other connections keep
//! their pace meanwhile, a connection closed during the call is destroyed once it returned,
//! and dropping the reactor waits for it.
//!
//! The SYNs are dropped by a plain TCP listener whose accept queue is full (backlog 0, one
//! connection queued and never accepted): Linux drops a SYN to such a listener
//! (`LISTENOVERFLOWS`) and answers a retransmitted one with a reset once the listener is
//! closed, which ends the call with `ECONNREFUSED`.

mod util;

use std::cell::RefCell;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::rc::Rc;
use std::time::{Duration, Instant};

use nix::sys::socket::{bind, listen, socket, AddressFamily, Backlog, SockFlag, SockType, SockaddrStorage};
use rdma_reactor::{
    Buf, CloseReason, Completion, Conn, ConnectOptions, ConnectionHandler, Ctx, Op, OpCode, Reactor, Token,
};

use util::*;

/// Round trips measured alone, and at least as many while a connect hangs.
const ROUND_TRIPS: usize = 300;

/// Ping-pongs one 64-byte verified message at a time, for ever, recording each round trip.
struct Pinger {
    seq: u64,
    send: Option<Buf>,
    waiting: bool,
    sent_at: Instant,
    rtts: Rc<RefCell<Vec<Duration>>>,
    failed: Rc<RefCell<Option<String>>>,
}

const SIZE: usize = 64;

impl Pinger {
    fn send_next(&mut self, conn: &mut Conn<'_>) {
        if self.waiting {
            return;
        }
        let Some(mut buf) = self.send.take() else { return };
        buf.fill_from(&pattern(SIZE, 7, self.seq)).expect("fill");
        self.waiting = true;
        self.sent_at = Instant::now();
        if let Err(e) = conn.submit(Op::send(buf)) {
            *self.failed.borrow_mut() = Some(format!("send {}: {}", self.seq, e.error));
        }
    }
}

impl ConnectionHandler for Pinger {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        let recv = conn.alloc(SIZE).expect("receive buffer");
        conn.submit(Op::recv(recv)).expect("post receive");
        self.send = Some(conn.alloc(SIZE).expect("send buffer"));
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        self.send_next(conn);
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        match (c.opcode, c.result) {
            (OpCode::Send, Ok(_)) => {
                self.send = c.buf;
                self.send_next(conn);
            }
            (OpCode::Recv, Ok(n)) => {
                let rtt = self.sent_at.elapsed();
                let buf = c.buf.expect("buffer");
                if n as usize != SIZE || buf.as_slice() != pattern(SIZE, 7, self.seq).as_slice() {
                    *self.failed.borrow_mut() = Some(format!("message {}: the echo differs ({n} bytes)", self.seq));
                    return conn.close();
                }
                self.rtts.borrow_mut().push(rtt);
                self.seq += 1;
                self.waiting = false;
                conn.submit(Op::recv(buf)).expect("post receive");
                self.send_next(conn);
            }
            (op, Err(e)) => {
                self.failed.borrow_mut().get_or_insert(format!("{op:?} failed: {e}"));
            }
            _ => {}
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        self.failed.borrow_mut().get_or_insert(format!("the ping-pong connection closed: {reason}"));
    }
}

/// A client whose connect hangs: records what it hears.
#[derive(Default)]
struct Hanging {
    heard: Rc<RefCell<Vec<String>>>,
    closed: Rc<RefCell<Option<CloseReason>>>,
}

impl ConnectionHandler for Hanging {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        // One receive posted before the call: it must come back, never posted on a queue pair
        // already destroyed.
        let recv = conn.alloc(SIZE).expect("receive buffer");
        conn.submit(Op::recv(recv)).expect("post receive");
    }

    fn on_established(&mut self, _conn: &mut Conn<'_>) {
        self.heard.borrow_mut().push("established".into());
    }

    fn on_completion(&mut self, _conn: &mut Conn<'_>, c: Completion) {
        assert!(c.buf.is_some(), "the receive's buffer comes back");
        self.heard.borrow_mut().push(format!("{:?}: {:?}", c.opcode, c.result));
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        *self.closed.borrow_mut() = Some(reason);
    }
}

/// A TCP listener at `addr` whose accept queue is full: SYNs to it are dropped. Returns it and
/// the connection that fills the queue.
fn syn_dropper(addr: SocketAddr) -> (TcpListener, TcpStream) {
    let family = if addr.is_ipv4() { AddressFamily::Inet } else { AddressFamily::Inet6 };
    let fd = socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None).expect("socket");
    bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &SockaddrStorage::from(addr)).expect("bind");
    // Backlog 0: the queue is full with one connection that is never accepted.
    listen(&fd, Backlog::new(0).expect("backlog 0")).expect("listen");
    let listener = TcpListener::from(fd);
    let filler = TcpStream::connect(addr).expect("the connection that fills the accept queue");
    // The proof that the next SYN is dropped: a connect that gets no answer.
    let probe = TcpStream::connect_timeout(&addr, Duration::from_millis(500));
    assert!(
        probe.as_ref().is_err_and(|e| e.kind() == std::io::ErrorKind::TimedOut),
        "a SYN to a full accept queue is dropped (the probe timed out): {probe:?}"
    );
    (listener, filler)
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Ticks until `done`, failing after `limit` or when the ping-pong failed.
fn pump_until(
    reactor: &mut Reactor,
    failed: &Rc<RefCell<Option<String>>>,
    limit: Duration,
    what: &str,
    mut done: impl FnMut(&Reactor) -> bool,
) {
    let deadline = Instant::now() + limit;
    while !done(reactor) {
        assert!(failed.borrow().is_none(), "{what}: {}", failed.borrow().as_deref().unwrap_or(""));
        assert!(Instant::now() < deadline, "{what}: not done after {limit:?}: {:?}", reactor.stats());
        reactor.run_once(Some(Duration::from_millis(5))).expect("run_once");
    }
}

#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_connect_hanging_on_dropped_syns_leaves_the_other_connections_at_their_pace() {
    if transport() != "siw" {
        return not_applicable(
            "a_connect_hanging_on_dropped_syns_leaves_the_other_connections_at_their_pace",
            "on RoCE rdma_connect sends a REQ and returns: nothing blocks (the CM's answer is an event)",
        );
    }
    let me = std::process::id();
    let threads_before = threads(me);
    let mut reactor = Reactor::new().expect("reactor");
    let server = addr();
    reactor.listen(server, EchoListener { depth: 4, agents_closed: Default::default() }).expect("listen");
    let rtts = Rc::new(RefCell::new(Vec::new()));
    let failed = Rc::new(RefCell::new(None));
    let pinger = Pinger {
        seq: 0,
        send: None,
        waiting: false,
        sent_at: Instant::now(),
        rtts: rtts.clone(),
        failed: failed.clone(),
    };
    reactor.connect(server, ConnectOptions::default(), pinger).expect("connect the ping-pong client");

    // Alone (after a warm-up of the same length).
    pump_until(&mut reactor, &failed, Duration::from_secs(60), "warm-up", |_| rtts.borrow().len() >= ROUND_TRIPS);
    rtts.borrow_mut().clear();
    pump_until(&mut reactor, &failed, Duration::from_secs(60), "alone", |_| rtts.borrow().len() >= ROUND_TRIPS);
    let alone = median(&mut rtts.borrow_mut());
    rtts.borrow_mut().clear();

    // A connect whose SYNs are dropped.
    let dropping = addr();
    let (listener, filler) = syn_dropper(dropping);
    let hung = Hanging::default();
    let (hung_heard, hung_closed) = (hung.heard.clone(), hung.closed.clone());
    let started = Instant::now();
    reactor.connect(dropping, ConnectOptions::default(), hung).expect("connect to the SYN dropper");
    pump_until(&mut reactor, &failed, Duration::from_secs(30), "the hanging call starts", |r| {
        r.stats().connect_calls_running == 1
    });
    let call_started = started.elapsed();
    // A second one, closed by us while its call runs.
    let closed_early = Hanging::default();
    let (early_heard, early_closed) = (closed_early.heard.clone(), closed_early.closed.clone());
    let early = reactor.connect(dropping, ConnectOptions::default(), closed_early).expect("second connect");
    pump_until(&mut reactor, &failed, Duration::from_secs(30), "the second call starts", |r| {
        r.stats().connect_calls_running == 2
    });
    reactor.ctx().close(early);

    // The ping-pong goes on meanwhile: at least ROUND_TRIPS, and for at least 2 s.
    let measuring = Instant::now();
    pump_until(&mut reactor, &failed, Duration::from_secs(60), "while connects hang", |_| {
        rtts.borrow().len() >= ROUND_TRIPS && measuring.elapsed() >= Duration::from_secs(2)
    });
    let st = reactor.stats();
    assert_eq!(st.connect_calls_running, 2, "both calls still run after the measurement: {st:?}");
    assert!(hung_closed.borrow().is_none(), "the hanging client is still connecting: {:?}", hung_closed.borrow());
    assert!(
        early_closed.borrow().is_none(),
        "a connection closed during its call is destroyed (and told) only when the call returned: {:?}",
        early_closed.borrow()
    );
    let during = median(&mut rtts.borrow_mut());
    let n_during = rtts.borrow().len();
    println!(
        "median round trip alone {alone:?}, while 2 connects hang {during:?} ({n_during} round trips in {:?}; \
         the call started {call_started:?} after connect)",
        measuring.elapsed()
    );
    assert!(
        during <= alone * 2,
        "the ping-pong's median round trip while connects hang ({during:?}) is within 2x of alone ({alone:?})"
    );

    // The listener goes: the next retransmitted SYN is answered with a reset.
    drop(filler);
    drop(listener);
    pump_until(&mut reactor, &failed, Duration::from_secs(60), "the calls return", |_| {
        hung_closed.borrow().is_some() && early_closed.borrow().is_some()
    });
    assert_eq!(
        *hung_closed.borrow(),
        Some(CloseReason::Rejected { status: -111, reason: None }),
        "the hanging connect ends refused once the listener is gone ({:?} after it started)",
        started.elapsed()
    );
    assert_eq!(*early_closed.borrow(), Some(CloseReason::Local), "the connection closed during its call");
    for (who, heard) in [("hanging", &hung_heard), ("closed early", &early_heard)] {
        let heard = heard.borrow();
        assert!(!heard.iter().any(|h| h == "established"), "{who}: never established: {heard:?}");
        assert_eq!(heard.len(), 1, "{who}: its receive came back, once: {heard:?}");
    }
    let st = reactor.stats();
    assert_eq!((st.connect_threads, st.connect_calls_running), (3, 0), "three calls on helpers, none left: {st:?}");

    // Dropping the reactor while a call runs waits for it: the listener is gone, so the
    // call ends at its first retransmitted SYN (about 1 s after the first).
    let (listener, filler) = syn_dropper(dropping);
    let last = Hanging::default();
    let last_closed = last.closed.clone();
    reactor.connect(dropping, ConnectOptions::default(), last).expect("third connect");
    pump_until(&mut reactor, &failed, Duration::from_secs(30), "the third call starts", |r| {
        r.stats().connect_calls_running == 1
    });
    // Long enough for its first SYN to be dropped: the call then waits for a retransmission.
    let settle = Instant::now();
    pump_until(&mut reactor, &failed, Duration::from_secs(30), "the third call's SYN goes", |_| {
        settle.elapsed() >= Duration::from_millis(300)
    });
    assert_eq!(reactor.stats().connect_calls_running, 1, "the third call still runs");
    drop(filler);
    drop(listener);
    let dropping_at = Instant::now();
    drop(reactor);
    println!("the reactor's drop waited {:?} for the call", dropping_at.elapsed());
    assert!(last_closed.borrow().is_some(), "the last client heard on_closed: {:?}", last_closed.borrow());
    // Every helper thread is gone.
    let deadline = Instant::now() + Duration::from_secs(10);
    while threads(me) > threads_before && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(threads(me), threads_before, "no helper thread is left");
}
