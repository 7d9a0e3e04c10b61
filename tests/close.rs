//! A close right after the last SEND completed loses nothing (FAULTS.md, iWARP, "a close
//! right after the last send").
//!
//! On iWARP a SEND completes once TCP has taken it, not once the peer has it; a sender that
//! closes at its last completion could lose that message (its stream ended before the bytes
//! left: seen as 63 of 64 in the two-VM link-down-up case). Under flow control the runtime
//! closes such a connection with the close handshake (`Config::close_handshake`,
//! `proto::flow::Farewell`): the farewell goes after the last message and the disconnect
//! waits for the peer's answer. On RoCE a SEND completes only once the peer acknowledged it,
//! and the handshake is not used.
//!
//! The test streams 64 messages of 64 KiB on each of 8 connections, 3 rounds, and closes each
//! connection in the completion of its last SEND; the receiving side verifies every byte and
//! counts. First with the handshake off on the sending side (iWARP: what it loses is printed,
//! not asserted, since the loss is a race), then with it on (nothing may be lost, and on iWARP
//! every farewell was answered). Within one VM the race did not show (0 lost with the handshake
//! off in 3 runs on siw): the two-VM case `close-after-send` (`tests/two_vm.rs`), over a link,
//! loses messages without the handshake in every run so far; this test keeps the handshake's
//! working in the single-VM suite on both devices.

mod util;

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use rdma_reactor::{
    CloseReason, Completion, Config, Conn, ConnectOptions, ConnectRequest, ConnectionHandler, Ctx, Decision,
    ListenerHandler, Op, OpCode, OpError, Reactor, Token, WcStatus,
};
use util::*;

const SIZE: usize = 64 * 1024;
const COUNT: u64 = 64;
const CONNS: usize = 8;
const ROUNDS: usize = 3;
/// Sends a stream keeps submitted and not yet completed (flow control paces them further).
const WINDOW: u64 = 8;
const RECV_DEPTH: u32 = 16;
const LIMIT: Duration = Duration::from_secs(120);

#[derive(Default)]
struct Tally {
    /// Per receiving connection: messages received, messages with bytes not as sent.
    received: Vec<(u64, u64)>,
    /// Per receiving connection: why it closed.
    receiver_reasons: Vec<CloseReason>,
    receivers_closed: usize,
    /// Per sending connection: sends completed, close reason, an error seen.
    sent: Vec<(u64, CloseReason, Option<String>)>,
}

type Shared = Rc<RefCell<Tally>>;

struct Sink(Shared);

impl ListenerHandler for Sink {
    fn on_connect_request(&mut self, _ctx: &mut Ctx<'_>, _req: &ConnectRequest) -> Decision {
        Decision::Accept(Box::new(SinkConn { shared: self.0.clone(), messages: 0, corrupt: 0 }))
    }
}

struct SinkConn {
    shared: Shared,
    messages: u64,
    corrupt: u64,
}

impl ConnectionHandler for SinkConn {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        post_recvs(conn, RECV_DEPTH.into(), SIZE);
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        if let (OpCode::Recv, Ok(len)) = (c.opcode, &c.result) {
            let want = self.messages as u8;
            let intact =
                *len as usize == SIZE && c.buf.as_ref().is_some_and(|b| b.as_slice().iter().all(|&x| x == want));
            self.messages += 1;
            self.corrupt += u64::from(!intact);
            if let Some(buf) = c.buf {
                let _ = conn.submit(Op::recv(buf));
            }
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        let mut t = self.shared.borrow_mut();
        t.received.push((self.messages, self.corrupt));
        t.receiver_reasons.push(reason);
        t.receivers_closed += 1;
    }
}

/// Streams [`COUNT`] messages, message `i` filled with the byte `i as u8`, and closes in the
/// completion of the last one. Keeps 4 small receives posted for the peer's credit messages.
struct Stream {
    shared: Shared,
    submitted: u64,
    completed: u64,
    error: Option<String>,
}

impl Stream {
    fn pump(&mut self, conn: &mut Conn<'_>) {
        while self.submitted < COUNT && self.submitted - self.completed < WINDOW {
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
        post_recvs(conn, 4, 64);
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        self.pump(conn);
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        match (c.opcode, c.result) {
            (OpCode::Send, Ok(_)) => {
                self.completed += 1;
                if self.completed == COUNT {
                    // At once: the case under test.
                    return conn.close();
                }
                self.pump(conn);
            }
            (_, Err(OpError::Wc(WcStatus::WrFlushErr) | OpError::Cancelled)) => {}
            (op, Err(e)) => {
                self.error.get_or_insert(format!("{op:?} failed: {e}"));
            }
            (_, Ok(_)) => {}
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        self.shared.borrow_mut().sent.push((self.completed, reason, self.error.take()));
    }
}

fn reactor(close_handshake: bool) -> Reactor {
    reactor_with(close_handshake, rdma_reactor::Timeouts::default())
}

fn reactor_with(close_handshake: bool, timeouts: rdma_reactor::Timeouts) -> Reactor {
    let cfg = Config { recv_depth: RECV_DEPTH, send_depth: 64, close_handshake, timeouts, ..Config::default() };
    Reactor::with_config(cfg).expect("reactor")
}

/// Runs [`ROUNDS`] rounds of [`CONNS`] streams from a sending reactor with the handshake on or
/// off to a receiving one with it on. Returns the messages lost (sent and completed, never
/// received), with the sending reactor's farewell counters.
fn rounds(close_handshake: bool) -> (u64, u64, u64) {
    let mut server = reactor(true);
    let mut client = reactor(close_handshake);
    let shared: Shared = Rc::default();
    let addr = addr();
    server.listen(addr, Sink(shared.clone())).expect("listen");
    let mut lost = 0;
    for round in 0..ROUNDS {
        *shared.borrow_mut() = Tally::default();
        for _ in 0..CONNS {
            let s = Stream { shared: shared.clone(), submitted: 0, completed: 0, error: None };
            client.connect(addr, ConnectOptions::default(), s).expect("connect");
        }
        let what = format!("round {round}: {CONNS} streams of {COUNT} messages, closed and received");
        pump(&mut [&mut server, &mut client], LIMIT, &what, || {
            let t = shared.borrow();
            t.sent.len() == CONNS && t.receivers_closed == CONNS
        });
        let t = shared.borrow();
        for (completed, reason, error) in &t.sent {
            assert_eq!(*completed, COUNT, "every send completed ({reason})");
            assert_eq!(*reason, CloseReason::Local, "the sender closed it, cleanly");
            assert_eq!(error.as_deref(), None);
        }
        let received: u64 = t.received.iter().map(|r| r.0).sum();
        let corrupt: u64 = t.received.iter().map(|r| r.1).sum();
        assert_eq!(corrupt, 0, "every message received holds the bytes sent");
        assert!(t.received.iter().all(|r| r.0 <= COUNT));
        lost += COUNT * CONNS as u64 - received;
        println!(
            "handshake {}: round {round}: {received} of {} messages received, per connection {:?}",
            if close_handshake { "on" } else { "off" },
            COUNT * CONNS as u64,
            t.received.iter().map(|r| r.0).collect::<Vec<_>>()
        );
    }
    let s = client.stats();
    let heard = server.stats();
    assert_eq!(heard.farewells_heard, s.farewells_answered, "the receiving side answered each farewell it heard");
    assert_eq!(heard.silent_partings, 0, "every peer that said goodbye disconnected by itself");
    (lost, s.farewells_answered, s.farewells_unanswered)
}

#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_close_right_after_the_last_send_loses_nothing() {
    let iwarp = transport() == "siw";
    let (lost_without, answered, _) = rounds(false);
    assert_eq!(answered, 0, "no handshake when the sender does not offer it");
    println!("without the close handshake: {lost_without} messages lost in {ROUNDS} rounds of {CONNS} connections");
    if !iwarp {
        assert_eq!(lost_without, 0, "on RoCE a completed SEND is one the peer acknowledged");
    }
    let (lost, answered, unanswered) = rounds(true);
    println!("with the close handshake: {lost} messages lost; farewells answered {answered}, unanswered {unanswered}");
    assert_eq!(lost, 0, "nothing lost with the handshake");
    let want = if iwarp { (ROUNDS * CONNS) as u64 } else { 0 };
    assert_eq!((answered, unanswered), (want, 0), "every close by the handshake (iWARP only), every farewell answered");
}

/// A peer that says goodbye and then never disconnects is closed by the side that answered it,
/// `Timeouts::finish` after its answer, as the peer's close (`CloseReason::Peer`,
/// `Stats::silent_partings`), instead of being held for ever. Seen in CI with 10 000
/// connections in one VM (`scale`): the kernel aborted client streams past its orphan limit
/// without the server's side hearing it, and the server held 155 and 466 dead connections
/// (FAULTS.md, iWARP). Here the client is made that peer by fault injection
/// (`Reactor::inject_silent_parting`: it skips its `rdma_disconnect` once its farewell is
/// answered) with a disconnect deadline of ten minutes, so only the server can end the
/// connection within the test's limit. iWARP only: RoCE connections have no close handshake.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_peer_that_said_goodbye_and_never_disconnected_is_closed_after_the_finish_deadline() {
    #[cfg(not(feature = "fault-injection"))]
    panic!("built without the `fault-injection` feature: run it with `cargo xtask test`");
    #[cfg(feature = "fault-injection")]
    {
        if transport() != "siw" {
            return not_applicable(
                "a_peer_that_said_goodbye_and_never_disconnected_is_closed_after_the_finish_deadline",
                "the close handshake is iWARP's: a RoCE SEND completes once the peer has it, and no farewell is said",
            );
        }
        let finish = Duration::from_millis(500);
        let mut server = reactor_with(true, rdma_reactor::Timeouts { finish, ..Default::default() });
        let patient = rdma_reactor::Timeouts { disconnect: Duration::from_secs(600), ..Default::default() };
        let mut client = reactor_with(true, patient);
        client.inject_silent_parting();
        let shared: Shared = Rc::default();
        let addr = addr();
        server.listen(addr, Sink(shared.clone())).expect("listen");
        let s = Stream { shared: shared.clone(), submitted: 0, completed: 0, error: None };
        client.connect(addr, ConnectOptions::default(), s).expect("connect");
        let started = std::time::Instant::now();
        pump(&mut [&mut server, &mut client], LIMIT, "a stream whose client never disconnects", || {
            let t = shared.borrow();
            t.sent.len() == 1 && t.receivers_closed == 1
        });
        let took = started.elapsed();
        let (cs, ss) = (client.stats(), server.stats());
        let t = shared.borrow();
        println!(
            "closed after {took:?}: receiver {:?} with {:?}, sender {:?}; client farewells answered {}, \
             server farewells heard {}, silent partings {}",
            t.received[0],
            t.receiver_reasons[0],
            t.sent[0].1,
            cs.farewells_answered,
            ss.farewells_heard,
            ss.silent_partings
        );
        assert_eq!(t.received[0], (COUNT, 0), "every message received intact");
        assert_eq!(t.sent[0].0, COUNT, "every send completed");
        assert_eq!((cs.farewells_answered, ss.farewells_heard), (1, 1), "the farewell said, heard and answered");
        assert_eq!(ss.silent_partings, 1, "the server ended the connection its peer left hanging");
        assert_eq!(t.receiver_reasons[0], CloseReason::Peer, "closed as the peer's close");
        assert_eq!(t.sent[0].1, CloseReason::Local, "the client's close is its own");
        assert!(took >= finish, "not before the finish deadline after the answer");
    }
}
