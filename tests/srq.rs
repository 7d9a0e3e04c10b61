//! Shared receive queues (`Config::srq`) on a real RDMA device: verified echo over the SRQ,
//! receives refused on an SRQ connection, the credit rule's refusal, and flow control into an
//! SRQ server with no RNR NAK.

mod util;

#[path = "srq/credit.rs"]
mod credit;
#[path = "srq/echo.rs"]
mod echo;
#[path = "srq/refill.rs"]
mod refill;
#[path = "srq/review.rs"]
mod review;

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use rdma_reactor::{
    CloseReason, Completion, Config, Conn, ConnectOptions, ConnectRequest, ConnectionHandler, Ctx, Decision,
    ListenerHandler, Op, OpCode, Reactor, RejectCode, RejectReason, SrqConfig, Token,
};
use util::*;

/// What the SRQ agents saw.
#[derive(Debug, Default)]
struct AgentLog {
    /// `submit(Op::recv)` refusals, with their text.
    refused_recvs: Vec<String>,
    /// `recv_capacity()` in `on_ready`.
    capacities: Vec<u32>,
    /// Messages echoed (all with `Completion::SRQ_RECV` as user_data).
    echoed: u64,
    /// Receive completions with any other user_data.
    foreign: u64,
    closed: Vec<CloseReason>,
    refused_conns: Vec<RejectReason>,
}

struct SrqListener {
    log: Rc<RefCell<AgentLog>>,
}

impl ListenerHandler for SrqListener {
    fn on_connect_request(&mut self, _ctx: &mut Ctx<'_>, _req: &ConnectRequest) -> Decision {
        Decision::Accept(Box::new(SrqEcho { log: self.log.clone() }))
    }

    fn on_refused(&mut self, _ctx: &mut Ctx<'_>, _peer: Option<std::net::SocketAddr>, reason: &RejectReason) {
        self.log.borrow_mut().refused_conns.push(reason.clone());
    }
}

/// Echoes every message that arrives through the SRQ; tries once to post a receive of its own.
struct SrqEcho {
    log: Rc<RefCell<AgentLog>>,
}

impl ConnectionHandler for SrqEcho {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        let mut log = self.log.borrow_mut();
        log.capacities.push(conn.recv_capacity());
        let buf = conn.alloc(64).expect("a pool buffer");
        match conn.submit(Op::recv(buf)) {
            Ok(()) => panic!("a receive was accepted on an SRQ connection"),
            Err(e) => {
                assert!(e.op.opcode() == OpCode::Recv, "the operation comes back");
                log.refused_recvs.push(e.error.to_string());
            }
        }
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        if let (OpCode::Recv, Ok(_)) = (c.opcode, c.result) {
            if c.user_data != Completion::SRQ_RECV {
                self.log.borrow_mut().foreign += 1;
            }
            if conn.submit(Op::send(c.buf.expect("the SRQ receive carries its buffer"))).is_ok() {
                self.log.borrow_mut().echoed += 1;
            }
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        self.log.borrow_mut().closed.push(reason);
    }
}

fn srq_reactor(receives: u32, credit: u32) -> Reactor {
    srq_reactor_with(receives, credit, None)
}

fn srq_reactor_with(receives: u32, credit: u32, shared_cq: Option<u32>) -> Reactor {
    let srq = SrqConfig { receives, credit, max_credit: credit, buf_size: 4096, low_water: receives / 4, reserve: 0 };
    Reactor::with_config(Config { srq: Some(srq), shared_cq, ..Config::default() }).expect("SRQ reactor")
}

fn srv_closed(log: &Rc<RefCell<AgentLog>>) -> usize {
    log.borrow().closed.len()
}

/// A client that claims flow control in its connect information but ignores its credits: it
/// posts 64 receives and sends 64 messages at once.
struct Flood {
    closed: Rc<RefCell<Option<CloseReason>>>,
    /// Sends the server's device acknowledged, and whether `on_established` ran.
    sent: Rc<RefCell<(u64, bool)>>,
}

impl ConnectionHandler for Flood {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        post_recvs(conn, 64, 64);
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        self.sent.borrow_mut().1 = true;
        for i in 0..64u8 {
            let mut buf = conn.alloc(64).expect("buffer");
            buf.fill_from(&[i; 64]).expect("fill");
            if conn.submit(Op::send(buf)).is_err() {
                return;
            }
        }
    }

    fn on_completion(&mut self, _conn: &mut Conn<'_>, c: Completion) {
        if c.opcode == OpCode::Send && c.result.is_ok() {
            self.sent.borrow_mut().0 += 1;
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        *self.closed.borrow_mut() = Some(reason);
    }
}

/// Streams messages of `size` bytes: `burst` submitted at once when established, one more for
/// each send that completes, `total` in all; receives what the server sends back (posting
/// `recvs` receives and re-posting each).
struct Streamer {
    size: usize,
    burst: u64,
    total: u64,
    recvs: u64,
    submitted: u64,
    log: Rc<RefCell<StreamLog>>,
}

#[derive(Debug, Default)]
struct StreamLog {
    established: bool,
    sent: u64,
    error: Option<String>,
    closed: Option<CloseReason>,
}

impl Streamer {
    fn new(size: usize, burst: u64, total: u64, recvs: u64) -> (Streamer, Rc<RefCell<StreamLog>>) {
        let log = Rc::new(RefCell::new(StreamLog::default()));
        (Streamer { size, burst, total, recvs, submitted: 0, log: log.clone() }, log)
    }

    fn send_one(&mut self, conn: &mut Conn<'_>) {
        if self.submitted >= self.total {
            return;
        }
        let mut buf = conn.alloc(self.size).expect("buffer");
        buf.fill_from(&pattern(self.size, 9, self.submitted)).expect("fill");
        if conn.submit(Op::send(buf)).is_ok() {
            self.submitted += 1;
        }
    }
}

impl ConnectionHandler for Streamer {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        if self.recvs > 0 {
            post_recvs(conn, self.recvs, self.size);
        }
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        self.log.borrow_mut().established = true;
        for _ in 0..self.burst {
            self.send_one(conn);
        }
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        match (c.opcode, c.result) {
            (OpCode::Send, Ok(_)) => {
                self.log.borrow_mut().sent += 1;
                self.send_one(conn);
            }
            (OpCode::Recv, Ok(_)) => {
                let _ = conn.submit(Op::recv(c.buf.expect("buffer")));
            }
            (op, Err(e)) => {
                self.log.borrow_mut().error.get_or_insert(format!("{op:?}: {e}"));
            }
            _ => {}
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        self.log.borrow_mut().closed = Some(reason);
    }
}

/// A client reactor that gives up on the first receiver-not-ready NAK (`rnr_retry_count` 0):
/// any moment at which the server's SRQ is empty when its message arrives kills its
/// connection with `RnrRetryExcErr`.
fn no_rnr_tolerance() -> Reactor {
    Reactor::with_config(Config { rnr_retry_count: 0, ..Config::default() }).expect("client")
}

/// Connect information that claims flow control with 64 receives, from a client that keeps to
/// no credit. On iWARP it frames with tails too (or it is refused at connect time): it lies
/// about credits only.
fn lying_info() -> rdma_reactor::ConnectInfo {
    rdma_reactor::ConnectInfo {
        msg_size: 64,
        recv_depth: 64,
        flow_control: true,
        tail: transport() == "siw",
        ..Default::default()
    }
}
