//! The reactor nested in another event loop: a plain `poll(2)` loop that owns a timerfd and
//! stdin, and waits on the reactor's epoll fd beside them.
//!
//! ```text
//! embed --bind ADDR:PORT [--clients K] [--count N] [--size BYTES] [--exit-after N]
//!       [--timeout SECS]
//! ```
//!
//! The nested reactor runs an echo server on ADDR:PORT and K ping-pong clients of its own
//! against it, each sending N messages of BYTES and checking every echoed byte. Other
//! processes may connect too (`echo client`). The outer loop:
//!
//! - waits in `poll(2)` on the reactor's fd (`AsFd`), its timerfd and stdin, at most as long as
//!   `Reactor::next_timeout` allows;
//! - calls `run_once(Some(Duration::ZERO))` (which never blocks) when the reactor's fd is
//!   readable or its timeout ran out;
//! - prints a progress line every second (its timerfd ticks every 100 ms) and gives up after
//!   `--timeout` seconds;
//! - reads commands on stdin: `stats`, `quit` (end of file: stdin is no longer watched).
//!
//! It exits 0 once its K clients are done, all verified, and `--exit-after` server-side
//! connections (default K) have closed.

mod common;

use std::cell::RefCell;
use std::os::fd::AsFd;
use std::process::exit;
use std::rc::Rc;
use std::time::{Duration, Instant};

use common::{check_pattern, fill_pattern, Args};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::time::TimeSpec;
use nix::sys::timerfd::{ClockId, Expiration, TimerFd, TimerFlags, TimerSetTimeFlags};
use rdma_reactor::{
    Buf, CloseReason, Completion, Conn, ConnectOptions, ConnectRequest, ConnectionHandler, Ctx, Decision,
    ListenerHandler, Op, OpCode, Reactor, Token,
};

const USAGE: &str = "\
usage: embed --bind ADDR:PORT [--clients K] [--count N] [--size BYTES] [--exit-after N]
             [--timeout SECS]

The reactor nested in a poll(2) loop that also watches a timerfd and stdin.
  --bind ADDR:PORT   address of an RDMA device: the nested echo server listens here
  --clients K        ping-pong clients in the same reactor (default 4)
  --count N          messages per client (default 1000)
  --size BYTES       message size (default 4096; suffixes K, M)
  --exit-after N     exit once N server-side connections have closed (default K)
  --timeout SECS     give up after SECS (default 120)
stdin: `stats` prints the reactor's statistics, `quit` exits.";

/// What the server side and the clients saw.
#[derive(Default)]
struct Totals {
    agents_closed: u64,
    echoed: u64,
    clients_done: u64,
    verified_bytes: u64,
    failures: Vec<String>,
}

type Shared = Rc<RefCell<Totals>>;

struct Server {
    size: usize,
    totals: Shared,
}

impl ListenerHandler for Server {
    fn on_connect_request(&mut self, _ctx: &mut Ctx<'_>, req: &ConnectRequest) -> Decision {
        let _ = req;
        // Receives of what the reactor announces: the client's size within `Config::msg_size`.
        Decision::Accept(Box::new(Agent { size: self.size, totals: self.totals.clone() }))
    }
}

/// Echoes every message.
struct Agent {
    size: usize,
    totals: Shared,
}

impl ConnectionHandler for Agent {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        self.size = conn.msg_size().max(1);
        for _ in 0..conn.recv_capacity().min(16) {
            let buf = conn.alloc(self.size).expect("receive buffer");
            conn.submit(Op::recv(buf)).expect("post receive");
        }
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        if let (OpCode::Recv, Ok(_)) = (c.opcode, c.result) {
            // Refused only once the connection is closing (the peer left after its last one).
            if conn.submit(Op::send(c.buf.expect("receive buffer"))).is_ok() {
                self.totals.borrow_mut().echoed += 1;
                if let Ok(buf) = conn.alloc(self.size) {
                    let _ = conn.submit(Op::recv(buf));
                }
            }
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, _reason: CloseReason) {
        self.totals.borrow_mut().agents_closed += 1;
    }
}

/// Sends `count` patterned messages, one at a time, and checks each echo.
struct Client {
    id: u64,
    size: usize,
    count: u64,
    seq: u64,
    send_buf: Option<Buf>,
    /// Message `seq` is out and its echo not back yet.
    waiting_echo: bool,
    totals: Shared,
}

impl Client {
    fn fail(&mut self, conn: &mut Conn<'_>, what: String) {
        self.totals.borrow_mut().failures.push(format!("client {}: {what}", self.id));
        conn.close();
    }

    /// Sends the next message once both the last echo and the last send's buffer are back
    /// (a receive can complete before the send that caused it is reaped).
    fn send(&mut self, conn: &mut Conn<'_>) {
        if self.waiting_echo || self.seq == self.count {
            return;
        }
        let Some(mut buf) = self.send_buf.take() else { return };
        self.waiting_echo = true;
        let _ = buf.set_len(self.size);
        fill_pattern(buf.as_mut_slice(), self.id, self.seq);
        if let Err(e) = conn.submit(Op::send(buf)) {
            self.fail(conn, format!("send: {}", e.error));
        }
    }
}

impl ConnectionHandler for Client {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        let recv = conn.alloc(self.size).expect("receive buffer");
        conn.submit(Op::recv(recv)).expect("post receive");
        self.send_buf = Some(conn.alloc(self.size).expect("send buffer"));
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        self.send(conn);
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        match (c.opcode, c.result) {
            (OpCode::Send, Ok(_)) => {
                self.send_buf = c.buf;
                self.send(conn);
            }
            (OpCode::Recv, Ok(n)) => {
                let buf = c.buf.expect("receive buffer");
                if n as usize != self.size {
                    return self.fail(conn, format!("message {}: {n} bytes back, {} sent", self.seq, self.size));
                }
                if let Some(i) = check_pattern(buf.as_slice(), self.id, self.seq) {
                    return self.fail(conn, format!("message {}: byte {i} differs", self.seq));
                }
                self.totals.borrow_mut().verified_bytes += n as u64;
                self.seq += 1;
                self.waiting_echo = false;
                if self.seq == self.count {
                    return conn.close();
                }
                if let Err(e) = conn.submit(Op::recv(buf)) {
                    return self.fail(conn, format!("receive: {}", e.error));
                }
                self.send(conn);
            }
            (op, Err(e)) if self.seq < self.count => self.fail(conn, format!("{op:?}: {e}")),
            _ => {}
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        let mut t = self.totals.borrow_mut();
        if self.seq < self.count && t.failures.iter().all(|f| !f.starts_with(&format!("client {}:", self.id))) {
            t.failures
                .push(format!("client {}: closed after {} of {} messages: {reason}", self.id, self.seq, self.count));
        }
        t.clients_done += 1;
    }
}

/// A `poll(2)` timeout from the reactor's: rounded up to a millisecond, so a deadline 0.3 ms
/// away does not spin.
fn poll_timeout(t: Option<Duration>) -> PollTimeout {
    match t {
        None => PollTimeout::NONE,
        Some(d) => PollTimeout::try_from(d.as_micros().div_ceil(1000)).unwrap_or(PollTimeout::MAX),
    }
}

fn main() {
    common::observe::init_logging("embed");
    let args = Args::parse(std::env::args().skip(1), &[], USAGE);
    args.finish(&["bind", "clients", "count", "size", "exit-after", "timeout"]);
    let bind = args.addr("bind");
    let clients: u64 = args.get("clients", 4);
    let count: u64 = args.get("count", 1000);
    let size = args.size("size", 4096);
    let exit_after: u64 = args.get("exit-after", clients);
    let limit = Duration::from_secs(args.get("timeout", 120));
    if count == 0 || size == 0 {
        common::fail(USAGE, "--count and --size must be at least 1");
    }
    let die = |what: &str, e: &dyn std::error::Error| -> ! {
        common::die("embed", &format!("{what}: {}", common::report(e)))
    };

    let totals = Shared::default();
    let cfg = rdma_reactor::Config { msg_size: size.min(1 << 20) as u32, ..rdma_reactor::Config::default() };
    let mut reactor = Reactor::with_config(cfg).unwrap_or_else(|e| die("cannot start", &e));
    reactor.listen(bind, Server { size, totals: totals.clone() }).unwrap_or_else(|e| die("listen", &e));
    for id in 0..clients {
        let c = Client { id, size, count, seq: 0, send_buf: None, waiting_echo: false, totals: totals.clone() };
        let opts = ConnectOptions { msg_size: size as u32, ..ConnectOptions::default() };
        reactor.connect(bind, opts, c).unwrap_or_else(|e| die("connect", &e));
    }
    println!("embed: listening on {bind}; {clients} clients x {count} x {size} B, nested in a poll(2) loop");

    // The outer loop's own fds: a 100 ms periodic timerfd and stdin.
    let timer = TimerFd::new(ClockId::CLOCK_MONOTONIC, TimerFlags::TFD_NONBLOCK | TimerFlags::TFD_CLOEXEC)
        .unwrap_or_else(|e| die("timerfd_create", &e));
    let period = TimeSpec::from_duration(Duration::from_millis(100));
    timer.set(Expiration::Interval(period), TimerSetTimeFlags::empty()).unwrap_or_else(|e| die("timerfd_settime", &e));
    let stdin = std::io::stdin();
    let mut watch_stdin = true;
    let mut line = Vec::new();

    let start = Instant::now();
    let (mut waits, mut ticks, mut ticks_unready, mut timer_fires) = (0u64, 0u64, 0u64, 0u64);
    let mut quit = false;
    loop {
        {
            let t = totals.borrow();
            if !t.failures.is_empty() || (t.clients_done == clients && t.agents_closed >= exit_after) {
                break;
            }
        }
        if quit {
            break;
        }
        // How long the reactor lets us sleep: zero with work pending, else its next deadline.
        let reactor_timeout = reactor.next_timeout();
        let reactor_due = reactor_timeout.map(|d| Instant::now() + d);
        // The timerfd ticks every 100 ms: the wait is never longer than that anyway.
        let (reactor_ready, timer_ready, stdin_ready) = {
            let mut fds =
                vec![PollFd::new(reactor.as_fd(), PollFlags::POLLIN), PollFd::new(timer.as_fd(), PollFlags::POLLIN)];
            if watch_stdin {
                fds.push(PollFd::new(stdin.as_fd(), PollFlags::POLLIN));
            }
            waits += 1;
            match poll(&mut fds, poll_timeout(reactor_timeout)) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => die("poll", &e),
            }
            let ready = |i: usize| fds.get(i).and_then(|f| f.revents()).is_some_and(|r| !r.is_empty());
            (ready(0), ready(1), ready(2))
        };
        if reactor_ready || reactor_due.is_some_and(|d| Instant::now() >= d) {
            // Never blocks: the waiting was ours.
            reactor.run_once(Some(Duration::ZERO)).unwrap_or_else(|e| die("reactor", &e));
            ticks += 1;
            ticks_unready += u64::from(!reactor_ready);
        }
        if timer_ready {
            let mut expirations = [0u8; 8];
            if nix::unistd::read(&timer, &mut expirations).is_ok() {
                timer_fires += u64::from_ne_bytes(expirations);
            }
            if timer_fires % 10 == 0 {
                let t = totals.borrow();
                println!(
                    "embed: {:.1} s: {} connections, {} echoed, {} bytes verified",
                    start.elapsed().as_secs_f64(),
                    reactor.connections(),
                    t.echoed,
                    t.verified_bytes
                );
            }
            if start.elapsed() > limit {
                common::die("embed", &format!("not done after {limit:?}"));
            }
        }
        if stdin_ready {
            let mut buf = [0u8; 256];
            match nix::unistd::read(&stdin, &mut buf) {
                Ok(0) | Err(_) => watch_stdin = false, // End of file (/dev/null): stop watching.
                Ok(n) => line.extend_from_slice(&buf[..n]),
            }
            while let Some(i) = line.iter().position(|b| *b == b'\n') {
                let cmd: Vec<u8> = line.drain(..=i).collect();
                match String::from_utf8_lossy(&cmd).trim() {
                    "stats" => println!("embed: {:?}", reactor.stats()),
                    "quit" => quit = true,
                    "" => {}
                    other => eprintln!("embed: unknown command {other:?} (stats, quit)"),
                }
            }
        }
    }
    let t = totals.borrow();
    for f in &t.failures {
        eprintln!("embed: {f}");
    }
    let ok = t.failures.is_empty() && !quit;
    let s = reactor.stats();
    println!(
        "embed: {} clients done, {} bytes verified, {} messages echoed, {} server connections closed",
        t.clients_done, t.verified_bytes, t.echoed, t.agents_closed
    );
    println!(
        "embed: outer loop: {waits} waits, {ticks} reactor ticks ({ticks_unready} on its timeout alone), \
         {timer_fires} timerfd expirations; reactor wakeups {}",
        s.wakeups
    );
    drop(t);
    reactor.shutdown(Duration::from_secs(5));
    if !ok {
        exit(1);
    }
    let want = clients * count * size as u64;
    let verified = totals.borrow().verified_bytes;
    if verified != want {
        common::die("embed", &format!("{verified} bytes verified, {want} expected"));
    }
    println!("embed: ok");
}
