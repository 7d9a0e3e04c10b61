//! Shutdown keeps the callback contract, on a real RDMA device: dropping the reactor, or
//! `Reactor::shutdown`, completes every submitted operation exactly once (with its buffer),
//! tells every connection and listener `on_closed(Shutdown)` exactly once, and leaves the
//! process's kernel RDMA objects at their baseline.

mod util;

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

use rdma_reactor::{
    CloseReason, Completion, Conn, ConnectOptions, ConnectRequest, ConnectionHandler, Ctx, Decision, ListenerHandler,
    Op, OpCode, OpError, Reactor, Token, WcStatus,
};
use util::*;

const SIZE: usize = 64;
const CLIENTS: usize = 4;

/// The id `rdma res show` attributes this test's kernel objects to: the creating task, and
/// libtest runs each test on a thread of its own.
/// How an operation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Outcome {
    Ok,
    Flushed,
    Cancelled,
    Other,
}

#[derive(Default)]
struct Ledger {
    next: u64,
    /// user_data -> how many completions it got, and how.
    ops: HashMap<u64, Vec<(Outcome, bool)>>,
    /// Closes heard, by connection.
    closes: HashMap<Token, Vec<CloseReason>>,
    listener_closes: Vec<CloseReason>,
    /// Whether `listen` and `connect`, tried from the listener's `on_closed` (during the
    /// shutdown), were refused.
    refused_while_closing: Vec<(bool, bool)>,
    /// Clients whose first message came back.
    echoed: usize,
}

impl Ledger {
    fn submit(ledger: &Rc<RefCell<Ledger>>, conn: &mut Conn<'_>, op: impl FnOnce(rdma_reactor::Buf) -> Op) {
        let buf = conn.alloc(SIZE).expect("pool buffer");
        let ud = ledger.borrow_mut().new_op();
        conn.submit(op(buf).user_data(ud)).expect("submit");
    }

    fn new_op(&mut self) -> u64 {
        self.next += 1;
        self.ops.insert(self.next, Vec::new());
        self.next
    }

    fn complete(&mut self, c: &Completion) {
        let outcome = match c.result {
            Ok(_) => Outcome::Ok,
            Err(OpError::Wc(WcStatus::WrFlushErr)) => Outcome::Flushed,
            Err(OpError::Cancelled) => Outcome::Cancelled,
            Err(_) => Outcome::Other,
        };
        self.ops.entry(c.user_data).or_default().push((outcome, c.buf.is_some()));
    }
}

struct Server(Rc<RefCell<Ledger>>);

impl ListenerHandler for Server {
    fn on_connect_request(&mut self, _ctx: &mut Ctx<'_>, _req: &ConnectRequest) -> Decision {
        Decision::Accept(Box::new(Side { ledger: self.0.clone(), client: false }))
    }

    fn on_closed(&mut self, ctx: &mut Ctx<'_>, reason: CloseReason) {
        // Shutting down: neither a new listener nor a new connection is taken.
        let listen = ctx.listen(addr(), Server(Rc::new(RefCell::new(Ledger::default())))).is_err();
        let side = Side { ledger: Rc::new(RefCell::new(Ledger::default())), client: true };
        let connect = ctx.connect(addr(), ConnectOptions::default(), side).is_err();
        let mut ledger = self.0.borrow_mut();
        ledger.listener_closes.push(reason);
        ledger.refused_while_closing.push((listen, connect));
    }
}

/// An agent echoes each message; a client sends one on establishment and counts its echo.
struct Side {
    ledger: Rc<RefCell<Ledger>>,
    client: bool,
}

impl ConnectionHandler for Side {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        for _ in 0..4 {
            Ledger::submit(&self.ledger, conn, Op::recv);
        }
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        if self.client {
            Ledger::submit(&self.ledger, conn, |mut b| {
                b.fill_from(&pattern(SIZE, 1, 0)).expect("fill");
                Op::send(b)
            });
        }
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        self.ledger.borrow_mut().complete(&c);
        if let (OpCode::Recv, Ok(_)) = (c.opcode, c.result) {
            let data = c.buf.as_ref().expect("buffer").as_slice().to_vec();
            assert_eq!(data, pattern(SIZE, 1, 0), "the message arrived intact");
            if self.client {
                self.ledger.borrow_mut().echoed += 1;
            } else {
                // Echo it; a closing connection takes the send and cancels it.
                Ledger::submit(&self.ledger, conn, |mut b| {
                    b.fill_from(&data).expect("fill");
                    Op::send(b)
                });
            }
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, token: Token, reason: CloseReason) {
        self.ledger.borrow_mut().closes.entry(token).or_default().push(reason);
    }
}

/// Sets up a listener and `CLIENTS` echoing connections, then queues more operations from
/// outside any callback (not posted before the shutdown starts). Returns the reactor, the
/// ledger and the queued operations' user_data.
fn busy_reactor() -> (Reactor, Rc<RefCell<Ledger>>, Vec<u64>) {
    let ledger = Rc::new(RefCell::new(Ledger::default()));
    let mut reactor = Reactor::new().expect("reactor");
    let server = addr();
    reactor.listen(server, Server(ledger.clone())).expect("listen");
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let opts = ConnectOptions { msg_size: SIZE as u32, ..Default::default() };
        clients.push(reactor.connect(server, opts, Side { ledger: ledger.clone(), client: true }).expect("connect"));
    }
    run_until(&mut reactor, Duration::from_secs(60), || ledger.borrow().echoed == CLIENTS);
    let mut queued = Vec::new();
    for &t in &clients[..3] {
        for send in [false, false, true] {
            let buf = reactor.ctx().alloc(t, SIZE).expect("pool buffer");
            let ud = ledger.borrow_mut().new_op();
            let op = if send { Op::send(buf) } else { Op::recv(buf) };
            reactor.ctx().submit(t, op.user_data(ud)).expect("submit from outside");
            queued.push(ud);
        }
    }
    (reactor, ledger, queued)
}

/// The contract, checked on the ledger after the shutdown.
fn check(ledger: &Ledger, queued: &[u64], what: &str) {
    let mut by_outcome: HashMap<Outcome, usize> = HashMap::new();
    for (ud, done) in &ledger.ops {
        assert_eq!(done.len(), 1, "{what}: operation {ud} completed {} times: {done:?}", done.len());
        let (outcome, buf) = done[0];
        assert_ne!(outcome, Outcome::Other, "{what}: operation {ud}: {done:?}");
        assert!(buf, "{what}: operation {ud} came back without its buffer");
        *by_outcome.entry(outcome).or_default() += 1;
    }
    for ud in queued {
        assert_eq!(ledger.ops[ud][0].0, Outcome::Cancelled, "{what}: queued operation {ud} was never posted");
    }
    assert_eq!(ledger.closes.len(), 2 * CLIENTS, "{what}: every client and agent closed: {:?}", ledger.closes);
    for (t, reasons) in &ledger.closes {
        assert_eq!(reasons, &vec![CloseReason::Shutdown], "{what}: {t:?} heard on_closed once, for the shutdown");
    }
    assert_eq!(ledger.listener_closes, vec![CloseReason::Shutdown], "{what}: the listener closed once");
    assert_eq!(ledger.refused_while_closing, vec![(true, true)], "{what}: listen and connect refused while closing");
    println!(
        "{what}: {} operations completed once each ({:?}), {} connections and 1 listener closed with Shutdown",
        ledger.ops.len(),
        by_outcome,
        ledger.closes.len()
    );
}

#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn dropping_the_reactor_completes_everything_and_closes_everyone() {
    let pid = owner_id();
    let baseline = res_counts(pid);
    let (reactor, ledger, queued) = busy_reactor();
    let busy = res_counts(pid);
    assert!(busy.qp >= 2 * CLIENTS && busy.cm_id > 2 * CLIENTS, "the connections exist: {busy:?}");
    drop(reactor);
    check(&ledger.borrow(), &queued, "drop");
    assert_eq!(res_counts(pid), baseline, "kernel objects back to the baseline after the drop");
}

#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn shutdown_completes_everything_and_the_reactor_is_idle() {
    let pid = owner_id();
    let baseline = res_counts(pid);
    let (mut reactor, ledger, queued) = busy_reactor();
    reactor.shutdown(Duration::from_secs(2));
    assert_eq!((reactor.connections(), reactor.listeners()), (0, 0), "nothing left open");
    assert!(reactor.is_idle());
    check(&ledger.borrow(), &queued, "shutdown");
    // The reactor is usable again; dropping it closes the new listener too.
    let again = Rc::new(RefCell::new(Ledger::default()));
    let mut second = addr();
    second.set_port(second.port().wrapping_add(1).max(1024));
    reactor.listen(second, Server(again.clone())).expect("listen after shutdown");
    drop(reactor);
    assert_eq!(again.borrow().listener_closes, vec![CloseReason::Shutdown]);
    assert_eq!(again.borrow().refused_while_closing, vec![(true, true)]);
    assert_eq!(res_counts(pid), baseline, "kernel objects back to the baseline");
}
