//! Shared helpers for the integration tests that run against a real RDMA device (the
//! Soft-RoCE and Soft-iWARP VMs of `cargo xtask test`, or a host with a device and `RDMA_ADDR`
//! set).
#![allow(dead_code)]

use std::cell::RefCell;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_reactor::{
    Buf, CloseReason, Completion, Conn, ConnectRequest, ConnectionHandler, Ctx, Decision, ListenerHandler, Op, OpCode,
    OpError, Reactor, Token,
};

/// The reason RDMA tests are ignored on a host without a device.
pub const NEEDS_RDMA: &str = "needs an RDMA device: cargo xtask test";

/// The address of the RDMA netdev (`RDMA_ADDR`), which `cargo xtask test` exports.
pub fn rdma_ip() -> IpAddr {
    let v = std::env::var("RDMA_ADDR").expect("RDMA_ADDR is not set: run through `cargo xtask test`");
    v.parse().unwrap_or_else(|e| panic!("RDMA_ADDR={v:?}: {e}"))
}

/// The soft RDMA device's kind the tests run on: `$RDMA_DEVICE`, `"rxe"` (Soft-RoCE, RoCE)
/// or `"siw"` (Soft-iWARP), which `cargo xtask` exports; `"rxe"` when it is not set.
pub fn transport() -> &'static str {
    match std::env::var("RDMA_DEVICE").as_deref() {
        Ok("siw") => "siw",
        _ => "rxe",
    }
}

/// For a test that does not apply to iWARP: on siw, prints `xtask-not-applicable: TEST:
/// REASON` (one line, to stdout past libtest's capture, so `cargo xtask test` sees it, counts
/// the test `n/a` and lists the reason) and returns true: the caller returns at once. False on
/// any other device.
///
/// ```ignore
/// if util::not_on_iwarp("write_with_immediate", "iWARP has no immediate data") {
///     return;
/// }
/// ```
pub fn not_on_iwarp(test: &str, reason: &str) -> bool {
    if transport() != "siw" {
        return false;
    }
    not_applicable(test, reason);
    true
}

/// Reports a test that cannot run here by name: one `xtask-not-applicable: TEST: REASON`
/// line, which `cargo xtask test` counts `n/a` and lists.
pub fn not_applicable(test: &str, reason: &str) {
    use std::io::Write;
    // `std::io::stdout()`, not `println!`: libtest captures only the print macros, and drops a
    // passing test's capture.
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "xtask-not-applicable: {test}: {reason}");
    let _ = out.flush();
}

/// The netdev under the device the tests run on (`$RDMA_NETDEV`: d0 under rxe0, s0 under
/// siw0), `d0` when it is not set.
pub fn netdev() -> String {
    std::env::var("RDMA_NETDEV").unwrap_or_else(|_| "d0".into())
}

static NEXT_PORT: AtomicU16 = AtomicU16::new(0);

/// A port no other test of this process uses.
pub fn port() -> u16 {
    let base = 20000 + (std::process::id() % 2000) as u16 * 10;
    base + NEXT_PORT.fetch_add(1, Ordering::Relaxed)
}

/// A fresh `RDMA_ADDR:port`.
pub fn addr() -> SocketAddr {
    SocketAddr::new(rdma_ip(), port())
}

/// The path of one of the project's binaries (`BIN`, exported by `cargo xtask`).
pub fn bin(name: &str) -> PathBuf {
    let dir = std::env::var("BIN").expect("BIN is not set: run through `cargo xtask test`");
    PathBuf::from(dir).join(name)
}

/// A child process killed when dropped, so a failing test leaves nothing behind.
pub struct Proc(pub Child, pub &'static str);

impl Proc {
    /// Spawns `program args`, with its output going to the test's output.
    pub fn spawn(name: &'static str, program: impl AsRef<std::ffi::OsStr>, args: &[&str]) -> Proc {
        let child = Command::new(program.as_ref())
            .args(args)
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({:?}): {e}", program.as_ref()));
        Proc(child, name)
    }

    /// The pid.
    pub fn pid(&self) -> u32 {
        self.0.id()
    }

    /// Waits for exit, at most `limit`; panics on timeout.
    pub fn wait(mut self, limit: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(st) = self.0.try_wait().expect("try_wait") {
                return st;
            }
            if Instant::now() > deadline {
                let _ = self.0.kill();
                panic!("{} did not exit within {limit:?}", self.1);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Proc {
    /// Spawns `program args` with its stdout and stderr going to the file `log` (created or
    /// truncated), so the test can wait for a line (`wait_for_log`) or read it afterwards.
    pub fn spawn_logged(
        name: &'static str,
        program: impl AsRef<std::ffi::OsStr>,
        args: &[&str],
        log: &std::path::Path,
    ) -> Proc {
        let out = std::fs::File::create(log).unwrap_or_else(|e| panic!("cannot create {log:?}: {e}"));
        let err = out.try_clone().expect("clone the log file");
        let child = Command::new(program.as_ref())
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({:?}): {e}", program.as_ref()));
        Proc(child, name)
    }

    /// Stops the process with SIGSTOP and returns once it is stopped (`waitpid` with
    /// `WUNTRACED`), so it runs no more code of its own; its kernel still handles what
    /// arrives for it (rdma_cm messages included).
    pub fn stop(&mut self) {
        use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
        let pid = nix::unistd::Pid::from_raw(self.pid() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).expect("kill -STOP");
        match waitpid(pid, Some(WaitPidFlag::WUNTRACED)).expect("waitpid WUNTRACED") {
            WaitStatus::Stopped(..) => {}
            other => panic!("{} did not stop: {other:?}", self.1),
        }
    }
}

/// SIGKILLs the process and reaps it: when this returns its files are closed, so the kernel
/// has destroyed its rdma_cm ids (sending a REJ or DREQ for each, as their state asks) and
/// its verbs objects.
pub fn kill9(p: &mut Proc) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(p.0.id() as i32), nix::sys::signal::Signal::SIGKILL)
        .expect("kill -9");
    let _ = p.0.wait();
}

/// A fresh log file path for `Proc::spawn_logged` (in the temporary directory, named after the
/// test process and `what`).
pub fn log_path(what: &str) -> PathBuf {
    static N: AtomicU16 = AtomicU16::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("rdma-reactor-{}-{what}-{n}.log", std::process::id()))
}

/// What a logged process wrote so far.
pub fn read_log(log: &std::path::Path) -> String {
    std::fs::read_to_string(log).unwrap_or_default()
}

/// The fds of process `pid` open on `/dev/infiniband/rdma_cm`: its rdma_cm event channels.
pub fn cm_channel_fds(pid: u32) -> Vec<i32> {
    let dir = format!("/proc/{pid}/fd");
    let mut fds: Vec<i32> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{dir}: {e}"))
        .filter_map(|e| {
            let e = e.ok()?;
            let target = std::fs::read_link(e.path()).ok()?;
            (target.as_os_str() == "/dev/infiniband/rdma_cm").then(|| e.file_name().to_str()?.parse().ok())?
        })
        .collect();
    fds.sort_unstable();
    fds
}

/// ib_cm's count of the connection-manager messages of kind `msg` (`req`, `rep`, `rej`,
/// `rtu`, `dreq`, ...) that the RDMA device's port 1 sent (`dir` = `cm_tx_msgs`) or received
/// (`cm_rx_msgs`), from sysfs. On Soft-RoCE with both ends on one device, a message one
/// process sends is counted in both.
pub fn cm_msgs(dir: &str, msg: &str) -> u64 {
    let dev = std::env::var("RDMA_DEV").unwrap_or_else(|_| "rxe0".to_string());
    let path = format!("/sys/class/infiniband/{dev}/ports/1/{dir}/{msg}");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    text.trim().parse().unwrap_or_else(|e| panic!("{path}: {text:?}: {e}"))
}

/// Whether an rdma_cm event is waiting, unread, on the event channel `fd` of process `pid`
/// (which may be this process): polls a duplicate of the channel's file taken with
/// `pidfd_getfd` (this needs ptrace rights over `pid`: a child, or root), which reads nothing.
/// The duplicate is closed before this returns: holding it would keep the channel, and the
/// ids on it, alive after the process died.
pub fn cm_event_pending(pid: u32, fd: i32) -> bool {
    use std::os::fd::{AsFd, FromRawFd, OwnedFd};
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1; no memory is passed.
    let pidfd = unsafe { nix::libc::syscall(nix::libc::SYS_pidfd_open, pid as nix::libc::c_int, 0) };
    assert!(pidfd >= 0, "pidfd_open({pid}): {}", std::io::Error::last_os_error());
    // SAFETY: pidfd_open returned a new fd that nothing else owns.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as i32) };
    use std::os::fd::AsRawFd;
    // SAFETY: pidfd_getfd takes fds and flags and returns a new fd or -1; no memory is passed.
    let dup = unsafe { nix::libc::syscall(nix::libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    assert!(dup >= 0, "pidfd_getfd({pid}, {fd}): {}", std::io::Error::last_os_error());
    // SAFETY: pidfd_getfd returned a new fd that nothing else owns.
    let dup = unsafe { OwnedFd::from_raw_fd(dup as i32) };
    let mut fds = [nix::poll::PollFd::new(dup.as_fd(), nix::poll::PollFlags::POLLIN)];
    let n = nix::poll::poll(&mut fds, nix::poll::PollTimeout::ZERO).expect("poll the rdma_cm channel");
    n > 0 && fds[0].revents().is_some_and(|r| r.contains(nix::poll::PollFlags::POLLIN))
}

/// Waits until an rdma_cm event channel of process `pid` has an unread event (see
/// `cm_event_pending`); panics after `limit`, naming `what`. A reactor has one channel for its
/// ids and, per device it uses, the never-read channel of the id that holds the device's
/// context (`DeviceHold`), which gets no event but a device removal.
pub fn wait_cm_event_pending(pid: u32, limit: Duration, what: &str) {
    let fds = cm_channel_fds(pid);
    assert!(!fds.is_empty(), "{what}: process {pid} has no rdma_cm channel");
    let deadline = Instant::now() + limit;
    while !fds.iter().any(|fd| cm_event_pending(pid, *fd)) {
        assert!(Instant::now() < deadline, "{what}: no rdma_cm event pending after {limit:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Waits until something listens for RDMA connections at `addr`: the server printed nothing
/// we can parse, so this polls with `rdma res show cm_id` for a listening id on the port.
pub fn wait_listening(addr: SocketAddr, limit: Duration) {
    let deadline = Instant::now() + limit;
    let needle = format!(":{}", addr.port());
    loop {
        let out = Command::new("rdma").args(["res", "show", "cm_id"]).output().expect("run rdma res show cm_id");
        let text = String::from_utf8_lossy(&out.stdout);
        if text.lines().any(|l| l.contains("LISTEN") && l.contains(&needle)) {
            return;
        }
        assert!(Instant::now() < deadline, "nothing listens on {addr} after {limit:?}:\n{text}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Kernel RDMA resource counts of one process, from `rdma -j res show`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResCounts {
    pub qp: usize,
    pub cq: usize,
    pub mr: usize,
    pub pd: usize,
    pub cm_id: usize,
}

/// Counts `"pid":PID` in the JSON of `rdma -j res show KIND` (`qp`, `cq`, `mr`, `pd`,
/// `cm_id`): one kind's dump, which with thousands of connections in the VM is much cheaper
/// than [`res_counts`]' five.
pub fn count_for_pid(kind: &str, pid: u32) -> usize {
    let out = Command::new("rdma").args(["-j", "res", "show", kind]).output().expect("run rdma -j res show");
    assert!(out.status.success(), "rdma -j res show {kind}: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let needle = "\"pid\":";
    let mut n = 0;
    let mut rest = &text[..];
    while let Some(i) = rest.find(needle) {
        rest = &rest[i + needle.len()..];
        let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
        if digits.parse::<u32>().ok() == Some(pid) {
            n += 1;
        }
    }
    n
}

/// The resource counts of `pid`.
pub fn res_counts(pid: u32) -> ResCounts {
    ResCounts {
        qp: count_for_pid("qp", pid),
        cq: count_for_pid("cq", pid),
        mr: count_for_pid("mr", pid),
        pd: count_for_pid("pd", pid),
        cm_id: count_for_pid("cm_id", pid),
    }
}

/// The resource counts of each of `pids`, from one `rdma -j res show` per kind (the pids
/// with none are left out).
pub fn res_counts_of(pids: &[u32]) -> Vec<(u32, ResCounts)> {
    let mut all: std::collections::BTreeMap<u32, ResCounts> = Default::default();
    for (i, kind) in ["qp", "cq", "mr", "pd", "cm_id"].into_iter().enumerate() {
        let out = Command::new("rdma").args(["-j", "res", "show", kind]).output().expect("run rdma -j res show");
        assert!(out.status.success(), "rdma -j res show {kind}: {}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8_lossy(&out.stdout);
        for part in text.split("\"pid\":").skip(1) {
            let digits: String = part.chars().take_while(|c| c.is_ascii_digit()).collect();
            let Ok(pid) = digits.parse::<u32>() else { continue };
            if !pids.contains(&pid) {
                continue;
            }
            let c = all.entry(pid).or_insert(ResCounts { qp: 0, cq: 0, mr: 0, pd: 0, cm_id: 0 });
            *[&mut c.qp, &mut c.cq, &mut c.mr, &mut c.pd, &mut c.cm_id][i] += 1;
        }
    }
    all.into_iter().collect()
}

/// Threads of `pid`, from /proc.
pub fn threads(pid: u32) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read /proc/PID/status");
    status.lines().find_map(|l| l.strip_prefix("Threads:")).and_then(|v| v.trim().parse().ok()).expect("Threads: line")
}

/// The id `rdma res show` attributes this test's kernel objects to: the creating thread
/// (libtest runs each test on a thread of its own).
pub fn owner_id() -> u32 {
    nix::unistd::gettid().as_raw() as u32
}

/// Ticks every reactor in turn until `done()`; panics after `limit`, naming `what` (a test
/// never hangs).
pub fn pump(reactors: &mut [&mut Reactor], limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not done after {limit:?}: {reactors:?}");
        for r in reactors.iter_mut() {
            r.run_once(Some(Duration::from_millis(5))).expect("run_once");
        }
    }
}

/// Runs the reactor until idle or `limit`; panics on timeout (a test never hangs).
pub fn run_until_idle(reactor: &mut Reactor, limit: Duration) {
    let deadline = Instant::now() + limit;
    while !reactor.is_idle() {
        assert!(Instant::now() < deadline, "reactor not idle after {limit:?}: {reactor:?} {:?}", reactor.stats());
        reactor.run_once(Some(Duration::from_millis(200))).expect("run_once");
    }
}

/// Runs the reactor until `done()` or `limit`.
pub fn run_until(reactor: &mut Reactor, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "condition not met after {limit:?}: {reactor:?} {:?}", reactor.stats());
        reactor.run_once(Some(Duration::from_millis(200))).expect("run_once");
    }
}

/// A deterministic byte pattern of message `seq` on connection `conn`.
pub fn pattern(len: usize, conn: u64, seq: u64) -> Vec<u8> {
    let mut x = (conn + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (seq + 1).wrapping_mul(0xD1B5_4A32_D192_ED03);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

// ----- an echo server and a ping-pong client, in-process ------------------------------------

/// Posts `n` receives of `size` bytes from the pool (a handler's `on_ready`).
pub fn post_recvs(conn: &mut Conn<'_>, n: u64, size: usize) {
    for _ in 0..n {
        let buf = conn.alloc(size).expect("receive buffer");
        conn.submit(Op::recv(buf)).expect("post receive");
    }
}

/// Accepts everything; agents echo every message.
pub struct EchoListener {
    pub depth: u32,
    pub agents_closed: Rc<RefCell<Vec<CloseReason>>>,
}

impl ListenerHandler for EchoListener {
    fn on_connect_request(&mut self, _ctx: &mut Ctx<'_>, req: &ConnectRequest) -> Decision {
        let _ = req;
        // Receives of the size the reactor announces (`Conn::msg_size`), set in `on_ready`.
        Decision::Accept(Box::new(EchoAgent { depth: self.depth, size: 0, closed: self.agents_closed.clone() }))
    }
}

pub struct EchoAgent {
    depth: u32,
    size: usize,
    closed: Rc<RefCell<Vec<CloseReason>>>,
}

impl ConnectionHandler for EchoAgent {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        self.size = conn.msg_size().max(1);
        post_recvs(conn, u64::from(self.depth), self.size);
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        if let (OpCode::Recv, Ok(_)) = (c.opcode, c.result) {
            // Both are refused once the connection is closing (the peer left right after its
            // last message); the buffers then just go back to the pool.
            if conn.submit(Op::send(c.buf.expect("buffer"))).is_ok() {
                let buf = conn.alloc(self.size).expect("agent receive buffer");
                let _ = conn.submit(Op::recv(buf));
            }
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        self.closed.borrow_mut().push(reason);
    }
}

/// What one ping-pong client saw.
#[derive(Debug, Default)]
pub struct PingResult {
    pub echoed: u64,
    pub verified_bytes: u64,
    /// Operations that completed `Cancelled` (the receive submitted after closing).
    pub cancelled: u64,
    pub closed: Option<CloseReason>,
    pub error: Option<String>,
    /// Each round trip, send submitted to echo verified ([`PingClient::timed`] only).
    pub rtts: Vec<Duration>,
}

impl PingResult {
    /// The first failure, or the connection closing: `None` while the ping-pong goes on.
    pub fn failure(&self) -> Option<String> {
        self.error.clone().or_else(|| self.closed.as_ref().map(|r| format!("the connection closed: {r}")))
    }
}

/// Ping-pongs `count` verified messages of `size` bytes, then closes.
pub struct PingClient {
    pub id: u64,
    pub size: usize,
    pub count: u64,
    pub seq: u64,
    pub send_buf: Option<Buf>,
    pub waiting_echo: bool,
    /// Receives it keeps posted (1, or at least 3 to offer flow control, which a server on a
    /// shared receive queue requires).
    pub recvs: u64,
    /// Round trips are recorded in [`PingResult::rtts`] ([`PingClient::timed`]).
    pub timed: bool,
    pub sent_at: Instant,
    pub result: Rc<RefCell<PingResult>>,
}

impl PingClient {
    pub fn new(id: u64, size: usize, count: u64) -> (PingClient, Rc<RefCell<PingResult>>) {
        let result = Rc::new(RefCell::new(PingResult::default()));
        let c = PingClient {
            id,
            size,
            count,
            seq: 0,
            send_buf: None,
            waiting_echo: false,
            recvs: 1,
            timed: false,
            sent_at: Instant::now(),
            result: result.clone(),
        };
        (c, result)
    }

    /// The same, keeping 3 receives posted: enough to offer flow control (a server on a
    /// shared receive queue refuses a client that does not).
    pub fn flow_controlled(id: u64, size: usize, count: u64) -> (PingClient, Rc<RefCell<PingResult>>) {
        let (mut c, result) = PingClient::new(id, size, count);
        c.recvs = 3;
        (c, result)
    }

    /// Ping-pongs for ever, recording each round trip, with 4 receives posted: enough to offer
    /// flow control, so an echo never finds none posted (an RNR wait of milliseconds on RoCE).
    pub fn timed(id: u64, size: usize) -> (PingClient, Rc<RefCell<PingResult>>) {
        let (mut c, result) = PingClient::new(id, size, u64::MAX);
        c.recvs = 4;
        c.timed = true;
        (c, result)
    }

    fn fail(&mut self, conn: &mut Conn<'_>, what: String) {
        self.result.borrow_mut().error.get_or_insert(what);
        conn.close();
    }

    fn send_next(&mut self, conn: &mut Conn<'_>) {
        if self.waiting_echo || self.seq >= self.count {
            return;
        }
        let Some(mut buf) = self.send_buf.take() else { return };
        buf.fill_from(&pattern(self.size, self.id, self.seq)).expect("fill");
        self.waiting_echo = true;
        if self.timed {
            self.sent_at = Instant::now();
        }
        if let Err(e) = conn.submit(Op::send(buf).user_data(self.seq)) {
            self.fail(conn, format!("send: {}", e.error));
        }
    }
}

impl ConnectionHandler for PingClient {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        for _ in 0..self.recvs {
            let recv = conn.alloc(self.size).expect("client receive buffer");
            conn.submit(Op::recv(recv)).expect("client post receive");
        }
        self.send_buf = Some(conn.alloc(self.size).expect("client send buffer"));
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        if self.count == 0 {
            conn.close();
        }
        self.send_next(conn);
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        match (c.opcode, c.result) {
            (OpCode::Send, Ok(_)) => {
                self.send_buf = c.buf;
                self.send_next(conn);
            }
            (OpCode::Recv, Ok(n)) => {
                let rtt = self.timed.then(|| self.sent_at.elapsed());
                let buf = c.buf.expect("buffer");
                if n as usize != self.size {
                    return self.fail(conn, format!("message {}: {n} bytes echoed, {} sent", self.seq, self.size));
                }
                if buf.as_slice() != pattern(self.size, self.id, self.seq).as_slice() {
                    return self.fail(conn, format!("message {}: echoed bytes differ", self.seq));
                }
                {
                    let mut r = self.result.borrow_mut();
                    r.echoed += 1;
                    r.verified_bytes += n as u64;
                    r.rtts.extend(rtt);
                }
                self.seq += 1;
                self.waiting_echo = false;
                if self.seq == self.count {
                    conn.close();
                    // A submission on a closing connection is accepted and comes back
                    // cancelled, with its buffer, before on_closed.
                    conn.submit(Op::recv(buf)).expect("submit after close is accepted");
                    return;
                }
                if let Err(e) = conn.submit(Op::recv(buf)) {
                    // Refused only on a connection already closed under us (a device removal
                    // delivers the completions drained from its CQ just before on_closed).
                    return self.fail(conn, format!("post receive: {}", e.error));
                }
                self.send_next(conn);
            }
            (OpCode::Recv, Err(OpError::Cancelled)) if self.seq == self.count => {
                assert!(c.buf.is_some(), "the buffer comes back");
                self.result.borrow_mut().cancelled += 1;
            }
            // iWARP: the end of the stream (a refused connect, a peer gone) flushes the posted
            // receives before the connection manager says why; `on_closed` tells.
            (OpCode::Recv, Err(OpError::Wc(rdma_reactor::WcStatus::WrFlushErr))) if transport() == "siw" => {}
            (op, Err(e)) if self.seq < self.count => self.fail(conn, format!("{op:?} failed: {e}")),
            _ => {}
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        self.result.borrow_mut().closed = Some(reason);
    }
}

/// Ends the process with a message if it is not dropped within `limit`: `block_on` sleeps
/// until an event, so a future (or a stream) that never resolves would otherwise hang the test.
pub struct Watchdog(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Watchdog {
    pub fn new(what: &'static str, limit: Duration) -> Watchdog {
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let d = done.clone();
        std::thread::spawn(move || {
            let end = Instant::now() + limit;
            while Instant::now() < end {
                if d.load(Ordering::Relaxed) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            eprintln!("{what}: not done after {limit:?}");
            std::process::exit(101);
        });
        Watchdog(done)
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// The median of `v` (sorted in place); zero when empty.
pub fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// Bytes of memory regions the kernel lists for `pid` (`rdma -j res show mr`, field `mrlen`).
pub fn mr_bytes(pid: u32) -> u64 {
    let out = Command::new("rdma").args(["-j", "res", "show", "mr"]).output().expect("run rdma -j res show mr");
    assert!(out.status.success(), "rdma -j res show mr: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let field = |obj: &str, name: &str| -> Option<u64> {
        let i = obj.find(name)? + name.len();
        obj[i..].chars().take_while(|c| c.is_ascii_digit()).collect::<String>().parse().ok()
    };
    text.split('}')
        .filter(|o| field(o, "\"pid\":") == Some(u64::from(pid)))
        .filter_map(|o| field(o, "\"mrlen\":"))
        .sum()
}

/// rxe's per-port counters (`rdma statistic show link DEV/1`), by name. siw has none (the
/// command fails with EINVAL): empty there, and [`assert_no_rnr`] says why that is enough.
pub fn link_counters() -> std::collections::HashMap<String, u64> {
    if transport() == "siw" {
        return std::collections::HashMap::new();
    }
    let dev = std::env::var("RDMA_DEV").unwrap_or_else(|_| "rxe0".to_string());
    let out = Command::new("rdma")
        .args(["statistic", "show", "link", &format!("{dev}/1")])
        .output()
        .expect("run rdma statistic show link");
    assert!(out.status.success(), "rdma statistic: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let words: Vec<&str> = text.split_whitespace().collect();
    words.windows(2).filter_map(|w| w[1].parse::<u64>().ok().map(|v| (w[0].to_string(), v))).collect()
}

/// rxe's receiver-not-ready counters, which `assert_no_rnr` checks.
pub const RNR_COUNTERS: [&str; 3] = ["rcvd_rnr_err", "send_rnr_err", "retry_rnr_exceeded_err"];

/// Asserts rxe counted no RNR NAK between two `link_counters` readings (and that it has the
/// counters at all); `what` names the case in the message.
pub fn assert_no_rnr(
    before: &std::collections::HashMap<String, u64>,
    after: &std::collections::HashMap<String, u64>,
    what: &str,
) {
    if transport() == "siw" {
        // iWARP has no RNR NAK: a message that finds no posted receive ends the connection
        // (a DDP error, then TERMINATE), which the caller's outcome checks already catch.
        println!("{what}: iWARP has no RNR NAK to count; no connection ended, so no message found its receive missing");
        return;
    }
    for counter in RNR_COUNTERS {
        assert!(after.contains_key(counter), "rxe has no counter {counter}: {after:?}");
        assert_eq!(after.get(counter), before.get(counter), "{what}: {counter} moved: an RNR NAK happened");
    }
}

/// A finished program's stdout, then its stderr.
fn text(out: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// Runs a program to completion with a time limit; returns (success, stdout + stderr).
pub fn run_output(program: impl AsRef<std::ffi::OsStr>, args: &[&str], limit: Duration) -> (bool, String) {
    let child = Command::new(program.as_ref())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {:?}: {e}", program.as_ref()));
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(Ok(out)) => (out.status.success(), text(&out)),
        Ok(Err(e)) => panic!("waiting for {:?}: {e}", program.as_ref()),
        Err(_) => {
            let _ = Command::new("kill").arg(pid.to_string()).status();
            // What it printed before it was stopped says where it stood.
            let text = match rx.recv_timeout(Duration::from_secs(10)) {
                Ok(Ok(out)) => text(&out),
                _ => "(no output: it did not exit within 10 s of SIGTERM)".to_string(),
            };
            panic!("{:?} {args:?} did not finish within {limit:?}; it printed:\n{text}", program.as_ref());
        }
    }
}

// ----- tenants of issue 45: a streamer, an idle client -----------------------------------------

/// A message's sequence number (its first 8 bytes), the rest the pattern of stream `id`.
pub fn numbered(len: usize, id: u64, seq: u64) -> Vec<u8> {
    let mut m = pattern(len, id, seq);
    m[..8].copy_from_slice(&seq.to_be_bytes());
    m
}

/// Sends numbered messages as fast as its peer's credits let it (the runtime queues what the
/// credits do not allow yet), `window` submitted at a time, until `stop`; then closes once
/// every one sent has completed. Counts what completed.
pub struct Streamer {
    pub size: usize,
    pub window: u32,
    pub seq: u64,
    pub outstanding: u32,
    pub stop: Arc<AtomicBool>,
    pub sent: Arc<AtomicU64>,
    pub closed: Rc<RefCell<Option<CloseReason>>>,
}

impl Streamer {
    fn more(&mut self, conn: &mut Conn<'_>) {
        if self.stop.load(Ordering::Relaxed) {
            if self.outstanding == 0 {
                conn.close();
            }
            return;
        }
        while self.outstanding < self.window {
            let Ok(mut buf) = conn.alloc(self.size) else { return };
            buf.fill_from(&numbered(self.size, 9, self.seq)).expect("fits");
            if conn.submit(Op::send(buf)).is_err() {
                return;
            }
            self.seq += 1;
            self.outstanding += 1;
        }
    }
}

impl ConnectionHandler for Streamer {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        // Enough to offer flow control (an SRQ server requires it); the echoes never come.
        post_recvs(conn, 3, self.size);
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        // At most what the server takes (a larger send is refused at submit).
        self.size = conn.peer_info().map_or(self.size, |i| i.msg_size as usize).clamp(16, self.size.max(16));
        self.more(conn);
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        if c.opcode == OpCode::Send {
            self.outstanding -= 1;
            if c.result.is_ok() {
                self.sent.fetch_add(1, Ordering::Relaxed);
            }
            self.more(conn);
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        *self.closed.borrow_mut() = Some(reason);
    }
}

/// What an idle client saw.
#[derive(Default)]
pub struct IdleLog {
    pub established: bool,
    pub closed: Option<CloseReason>,
}

/// A client that connects, posts its receives (enough to offer flow control) and sends nothing.
pub struct Idle(pub Rc<RefCell<IdleLog>>);

impl ConnectionHandler for Idle {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        post_recvs(conn, 3, 64);
    }

    fn on_established(&mut self, _conn: &mut Conn<'_>) {
        self.0.borrow_mut().established = true;
    }

    fn on_completion(&mut self, _conn: &mut Conn<'_>, _c: Completion) {}

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        self.0.borrow_mut().closed = Some(reason);
    }
}
