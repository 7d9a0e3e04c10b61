//! Dying, broken and hostile peers (FAULTS.md, cases 4, 9, 11, 12, 15, 16, 26, 28, 29, 33, 37):
//! each costs one connection and nothing else. Every test checks that the server keeps serving
//! (a well-behaved client running alongside, or one after the fault, with its messages echoed
//! and verified), checks the exact close reasons the callbacks see, and checks that the kernel
//! objects of this test's thread are back to zero at the end. The peers are `echo` processes
//! killed with SIGKILL (at chosen points of the handshake too), or in-process clients that
//! break the protocol on purpose.

mod util;

#[path = "hostile/backlog.rs"]
mod backlog;
#[path = "hostile/closing.rs"]
mod closing;
#[path = "hostile/killed.rs"]
mod killed;
#[path = "hostile/misbehaving.rs"]
mod misbehaving;

use std::cell::RefCell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use rdma_reactor::{
    CloseReason, Completion, Config, Conn, ConnectInfo, ConnectOptions, ConnectionHandler, Ctx, Op, OpCode, OpError,
    Reactor, Token, WcStatus,
};
use util::*;

const SIZE: usize = 64;
const LIMIT: Duration = Duration::from_secs(60);

struct Server {
    addr: SocketAddr,
    agents_closed: Rc<RefCell<Vec<CloseReason>>>,
}

fn listen(r: &mut Reactor, depth: u32) -> Server {
    let addr = addr();
    let agents_closed = Rc::new(RefCell::new(Vec::new()));
    r.listen(addr, EchoListener { depth, agents_closed: agents_closed.clone() }).expect("listen");
    Server { addr, agents_closed }
}

type Ping = Rc<RefCell<PingResult>>;

fn ping(r: &mut Reactor, a: SocketAddr, id: u64, count: u64) -> Ping {
    let (c, result) = PingClient::new(id, SIZE, count);
    let opts = ConnectOptions { msg_size: SIZE as u32, ..ConnectOptions::default() };
    r.connect(a, opts, c).expect("connect");
    result
}

/// The well-behaved client is still served: `more` further verified echoes after now.
fn still_served(reactors: &mut [&mut Reactor], good: &Ping, more: u64) {
    let want = good.borrow().echoed + more;
    pump(reactors, LIMIT, "the good client keeps being served", || {
        good.borrow().echoed >= want || good.borrow().closed.is_some()
    });
    let g = good.borrow();
    assert!(g.echoed >= want && g.error.is_none() && g.closed.is_none(), "the good client: {g:?}");
}

fn assert_baseline() {
    let zero = ResCounts { qp: 0, cq: 0, mr: 0, pd: 0, cm_id: 0 };
    assert_eq!(res_counts(owner_id()), zero, "every kernel object of this test destroyed");
}

/// An `echo client` process: `size`-byte messages, `count` of them, then idle for `hold_ms`.
fn echo_client(a: SocketAddr, size: usize, count: u64, hold_ms: u64) -> Proc {
    let (a, size, count, hold) = (a.to_string(), size.to_string(), count.to_string(), hold_ms.to_string());
    let args = ["client", "--connect", &a, "--size", &size, "--count", &count, "--verify", "--hold-ms", &hold];
    Proc::spawn("echo client", bin("echo"), &args)
}
