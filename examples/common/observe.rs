//! What an operator watches: the runtime's log lines on stderr (`RUST_LOG`, with the crate's
//! feature `log`) and a Prometheus endpoint (`--metrics [ADDR:]PORT`) served from the reactor's
//! own thread, on a TCP socket registered with it as a user fd.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::rc::Rc;
use std::time::{Duration, Instant};

use nix::sys::time::TimeSpec;
use nix::sys::timerfd::{ClockId, Expiration, TimerFd, TimerFlags, TimerSetTimeFlags};
use rdma_reactor::{Ctx, FdEvent, Interest, Readiness, Token};

/// A logger for the `log` facade writing `[secs LEVEL target] message` to stderr, at the level
/// `RUST_LOG` names (`error`, `warn`, `info`, `debug`, `trace`; `target=level` pairs
/// separated by commas are taken too, the most verbose level winning). Unset: no logger.
/// Without the crate's feature `log` the runtime logs nothing, which it says once.
pub fn init_logging(program: &'static str) {
    let Ok(spec) = std::env::var("RUST_LOG") else { return };
    let level = spec
        .split(',')
        .filter_map(|part| part.rsplit('=').next())
        .filter_map(|l| l.trim().parse::<log::LevelFilter>().ok())
        .max()
        .unwrap_or(log::LevelFilter::Error);
    // Installed once for the life of the process (`log` keeps a `&'static` logger).
    let logger: &'static StderrLogger = Box::leak(Box::new(StderrLogger { program, start: Instant::now() }));
    if log::set_logger(logger).is_ok() {
        log::set_max_level(level);
    }
    if !cfg!(feature = "log") {
        eprintln!("{program}: RUST_LOG is set, but rdma-reactor was built without its feature `log`: it logs nothing");
    }
}

struct StderrLogger {
    program: &'static str,
    start: Instant,
}

impl log::Log for StderrLogger {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record<'_>) {
        if self.enabled(record.metadata()) {
            let secs = self.start.elapsed().as_secs_f64();
            eprintln!("[{secs:9.3} {:<5} {} {}] {}", record.level(), self.program, record.target(), record.args());
        }
    }

    fn flush(&self) {}
}

/// Largest request taken (headers included).
const MAX_REQUEST: usize = 8 * 1024;

/// HTTP connections an endpoint holds at most at once, by default (`--metrics-max-conns`).
pub const MAX_CONNS: usize = 64;

/// An HTTP connection not done this long after it was accepted is closed then (a timerfd of
/// the endpoint's, armed for the oldest held) or at the next accept, whichever comes first.
pub const IDLE: Duration = Duration::from_secs(10);

/// How long the endpoint stops accepting when it cannot even refuse a connection (out of file
/// descriptors with its spare gone, or out of kernel memory).
const BACKOFF: Duration = Duration::from_secs(1);

/// Accepts (taken or refused) per call of the listener's callback: a flood of connections does
/// not keep the reactor's thread from its RDMA work (the socket is level-triggered, so the
/// rest are taken in the next tick).
const ACCEPT_BUDGET: usize = 64;

/// How an endpoint serves (`Args::metrics`).
#[derive(Clone, Copy, Debug)]
pub struct Metrics {
    /// Reactor 0's address; reactor `i` of `--threads N` serves on its port + `i`.
    pub addr: SocketAddr,
    /// HTTP connections held at once (`--metrics-max-conns`, default [`MAX_CONNS`]).
    pub max_conns: usize,
    /// An HTTP connection older than this is closed ([`IDLE`]).
    pub idle: Duration,
    /// `--metrics-conns`: every connection's series too, each labelled with its peer's
    /// address (`Ctx::prometheus`); without it only the reactor's totals
    /// (`Ctx::prometheus_totals`), whose size does not grow with the connections.
    pub conns: bool,
}

/// Parses `--metrics`: `ADDR:PORT` as any address (`common::parse_addr`), or a bare `PORT`,
/// which is `127.0.0.1:PORT`: served to this host only unless an address says otherwise.
pub fn parse_metrics_addr(v: &str) -> Result<SocketAddr, String> {
    let v = v.trim();
    if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
        let port: u16 = v.parse().map_err(|e| format!("port {v:?}: {e}"))?;
        return Ok(SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), port));
    }
    super::parse_addr(v)
}

/// The HTTP connections an endpoint holds, in the order they were accepted: the key `K` of each
/// one's registration (its `Token`) and when it was accepted. An entry leaves when its
/// connection finishes (its handler's drop), or when [`Live::reap`] picks it as expired.
#[derive(Debug)]
pub struct Live<K> {
    conns: BTreeMap<u64, (K, Instant)>,
    next: u64,
}

impl<K> Default for Live<K> {
    fn default() -> Live<K> {
        Live { conns: BTreeMap::new(), next: 0 }
    }
}

impl<K: Copy> Live<K> {
    /// Connections held.
    pub fn len(&self) -> usize {
        self.conns.len()
    }

    /// True when none is held.
    pub fn is_empty(&self) -> bool {
        self.conns.is_empty()
    }

    /// When the oldest connection held was accepted: the next to expire.
    pub fn oldest(&self) -> Option<Instant> {
        self.conns.first_key_value().map(|(_, v)| v.1)
    }

    /// A number for the next connection, which [`Live::insert`] files it under.
    pub fn next_id(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    /// Connection `id`, registered as `key`, accepted at `at`.
    pub fn insert(&mut self, id: u64, key: K, at: Instant) {
        self.conns.insert(id, (key, at));
    }

    /// Connection `id` finished (nothing if it was reaped already, or never filed).
    pub fn remove(&mut self, id: u64) {
        self.conns.remove(&id);
    }

    /// Takes out the connections accepted `idle` or more before `now`, the oldest first, and
    /// returns their keys, for the caller to close. Ids grow with the accepts, so these are
    /// the first entries: the cost is the number reaped.
    pub fn reap(&mut self, now: Instant, idle: Duration) -> Vec<K> {
        let mut out = Vec::new();
        while let Some(entry) = self.conns.first_entry() {
            if now.saturating_duration_since(entry.get().1) < idle {
                break;
            }
            out.push(entry.remove().0);
        }
        out
    }

    /// At a new accept: the expired connections to close ([`Live::reap`]), and whether the
    /// newcomer may stay (true) or is closed at once (false: `max` are held and none expired).
    pub fn admit(&mut self, now: Instant, idle: Duration, max: usize) -> (Vec<K>, bool) {
        let reaped = self.reap(now, idle);
        let room = self.conns.len() < max;
        (reaped, room)
    }
}

/// One kind of event told on stderr at most once per `every`: the first at once, the ones
/// that follow within `every` counted into the next line instead.
#[derive(Debug)]
pub struct Quiet {
    every: Duration,
    last: Option<Instant>,
    held: u64,
}

impl Quiet {
    pub fn new(every: Duration) -> Quiet {
        Quiet { every, last: None, held: 0 }
    }

    /// The event happened at `now`: `Some(n)` to print a line now, `n` more having happened
    /// since the last line; `None` to print nothing (counted).
    pub fn event(&mut self, now: Instant) -> Option<u64> {
        if self.last.is_some_and(|t| now.saturating_duration_since(t) < self.every) {
            self.held += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.held))
    }
}

/// ` (and N more since the last such line)` for a line of [`Quiet`], or nothing.
fn more(n: u64) -> String {
    if n == 0 {
        String::new()
    } else {
        format!(" (and {n} more since the last such line)")
    }
}

/// What an `accept` error means for a listening socket.
#[derive(Debug, PartialEq, Eq)]
pub enum AcceptError {
    /// `EMFILE`, `ENFILE`: out of file descriptors; the connection is still queued.
    Fds,
    /// An error of the one connection accept dequeued (Linux passes a pending network error
    /// on as accept's: `ECONNABORTED`, `EPROTO`, `EPERM` from a firewall and the network
    /// errors accept(2) lists): that one is gone, the next may be taken.
    ThatOne,
    /// `ENOBUFS`, `ENOMEM`: the kernel is short of memory; the connection is still queued.
    Memory,
    /// Anything else (`EBADF`, `EINVAL`, `ENOTSOCK`...): the listening socket is unusable.
    Fatal,
}

/// What `accept`'s error `e` means (`AcceptError`).
pub fn classify(e: &std::io::Error) -> AcceptError {
    use nix::libc;
    match e.raw_os_error() {
        Some(libc::EMFILE | libc::ENFILE) => AcceptError::Fds,
        Some(
            libc::ECONNABORTED
            | libc::EPROTO
            | libc::EPERM
            | libc::ENETDOWN
            | libc::ENOPROTOOPT
            | libc::EHOSTDOWN
            | libc::ENONET
            | libc::EHOSTUNREACH
            | libc::EOPNOTSUPP
            | libc::ENETUNREACH
            | libc::ETIMEDOUT
            | libc::ECONNRESET,
        ) => AcceptError::ThatOne,
        Some(libc::ENOBUFS | libc::ENOMEM) => AcceptError::Memory,
        _ => AcceptError::Fatal,
    }
}

/// What [`Endpoint::refuse_for_fds`] did.
enum Refusal {
    /// Refused a connection (or one vanished, or the spare is back): accept the next.
    One,
    /// Nothing is queued any more.
    Drained,
    /// No room for an accept: pause.
    Stuck,
}

/// The spare file descriptor an endpoint holds for the moment it runs out: `/dev/null`, opened
/// read-only.
fn open_spare() -> Option<File> {
    File::open("/dev/null").ok()
}

/// Out of descriptors (`EMFILE`): closes `spare`, accepts from `listener` with its room, closes
/// the connection at once (the peer sees it closed before any answer) and opens the spare
/// again (`None` if another thread took the descriptor meanwhile).
fn refuse_with_spare(listener: &TcpListener, spare: &mut Option<File>) -> std::io::Result<()> {
    drop(spare.take());
    let refused = listener.accept().map(drop);
    *spare = open_spare();
    refused
}

/// One endpoint: its listening socket and what its listener's and back-off timer's callbacks
/// share (the HTTP connections share only `live`).
struct Endpoint {
    addr: SocketAddr,
    index: usize,
    opts: Metrics,
    listener: TcpListener,
    /// Closed to make room for the accept that refuses a connection when the process is out
    /// of file descriptors (`EMFILE`), then opened again: without it, a queued connection
    /// that cannot be accepted keeps the level-triggered listening socket readable, and the
    /// callback would run in every tick for nothing (100% of a core).
    spare: RefCell<Option<File>>,
    live: Rc<RefCell<Live<Token>>>,
    /// Armed for [`BACKOFF`] while accepting is paused (the listener's interest empty).
    backoff: TimerFd,
    /// Armed for when the oldest HTTP connection held expires (`opts.idle` after its
    /// accept), while any is held: expired ones are closed then, not only at the next accept
    /// (the review of 2026-12-07, N10: a client that rotated its connections just within the
    /// idle time kept every scrape out).
    reaper: TimerFd,
    reaper_token: Cell<Option<Token>>,
    /// The reaper's deadline while it is armed.
    reaper_at: Cell<Option<Instant>>,
    listener_token: Cell<Option<Token>>,
    timer_token: Cell<Option<Token>>,
    paused: Cell<bool>,
    /// Lines about refused connections and accept errors, one a second at most.
    out_of_fds: RefCell<Quiet>,
    full: RefCell<Quiet>,
    errors: RefCell<Quiet>,
}

/// Serves `GET /metrics` on `opts.addr` with its port + `index` from this reactor, every sample
/// labelled `reactor="INDEX"`: the reactor's totals (`Ctx::prometheus_totals`), or with
/// `opts.conns` every connection's series too (`Ctx::prometheus`, with the peers' addresses).
/// A non-blocking listening socket registered with the reactor, and a registration per HTTP
/// connection, which reads the request, writes the answer as the socket takes it (`WRITABLE`
/// only while there is something to write) and closes. Nothing blocks the reactor's thread.
///
/// Bounded: at most `opts.max_conns` HTTP connections at once (at the cap, those older than
/// `opts.idle` are closed first; if none is, the newcomer is closed at once), and those older
/// than `opts.idle` are closed when they reach it (a timerfd armed for the oldest one held). Out
/// of file descriptors, a queued connection is accepted with the room of a spare descriptor
/// and closed; when even that is impossible, or the kernel is out of memory, accepting pauses
/// for a second (a timerfd made at the start). One line a second at most tells of either.
pub fn serve_metrics(ctx: &mut Ctx<'_>, opts: Metrics, index: usize) -> std::io::Result<SocketAddr> {
    let addr = SocketAddr::new(opts.addr.ip(), opts.addr.port().wrapping_add(index as u16));
    let listener = TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    let backoff = TimerFd::new(ClockId::CLOCK_MONOTONIC, TimerFlags::TFD_NONBLOCK | TimerFlags::TFD_CLOEXEC)
        .map_err(std::io::Error::from)?;
    let reaper = TimerFd::new(ClockId::CLOCK_MONOTONIC, TimerFlags::TFD_NONBLOCK | TimerFlags::TFD_CLOEXEC)
        .map_err(std::io::Error::from)?;
    let every = Duration::from_secs(1);
    let ep = Rc::new(Endpoint {
        addr,
        index,
        opts,
        listener,
        spare: RefCell::new(open_spare()),
        live: Rc::new(RefCell::new(Live::default())),
        backoff,
        reaper,
        reaper_token: Cell::new(None),
        reaper_at: Cell::new(None),
        listener_token: Cell::new(None),
        timer_token: Cell::new(None),
        paused: Cell::new(false),
        out_of_fds: RefCell::new(Quiet::new(every)),
        full: RefCell::new(Quiet::new(every)),
        errors: RefCell::new(Quiet::new(every)),
    });
    let to_io = |e: rdma_reactor::Error| std::io::Error::other(e.to_string());
    let e = ep.clone();
    let timer = ctx
        .register_fd(&ep.backoff, Interest::READABLE, 0, move |ctx: &mut Ctx<'_>, _ev: FdEvent| e.resume(ctx))
        .map_err(to_io)?;
    ep.timer_token.set(Some(timer));
    let e = ep.clone();
    let reaper = ctx.register_fd(&ep.reaper, Interest::READABLE, 0, move |ctx: &mut Ctx<'_>, _ev: FdEvent| e.reap(ctx));
    let reaper = match reaper {
        Ok(token) => token,
        Err(err) => {
            ctx.deregister_fd(timer);
            return Err(to_io(err));
        }
    };
    ep.reaper_token.set(Some(reaper));
    let e = ep.clone();
    let registered =
        ctx.register_fd(&ep.listener, Interest::READABLE, 0, move |ctx: &mut Ctx<'_>, _ev: FdEvent| e.on_accept(ctx));
    match registered {
        Ok(token) => ep.listener_token.set(Some(token)),
        Err(err) => {
            ctx.deregister_fd(timer);
            ctx.deregister_fd(reaper);
            return Err(to_io(err));
        }
    }
    Ok(addr)
}

impl Endpoint {
    /// The listening socket is readable: accept what is queued, within [`ACCEPT_BUDGET`].
    fn on_accept(&self, ctx: &mut Ctx<'_>) {
        if self.paused.get() {
            return;
        }
        let mut budget = ACCEPT_BUDGET;
        while budget > 0 {
            budget -= 1;
            match self.listener.accept() {
                Ok((stream, _)) => self.take(ctx, stream),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => match classify(&e) {
                    AcceptError::Fds => match self.refuse_for_fds(&e) {
                        Refusal::One => {}
                        Refusal::Drained => return,
                        Refusal::Stuck => {
                            self.pause(ctx, &format!("accept: {e}, and no descriptor to spare"));
                            return;
                        }
                    },
                    AcceptError::ThatOne => {
                        if let Some(n) = self.errors.borrow_mut().event(Instant::now()) {
                            eprintln!(
                                "metrics on {}: a connection failed before it was accepted: {e}{}",
                                self.addr,
                                more(n)
                            );
                        }
                    }
                    AcceptError::Memory => {
                        self.pause(ctx, &format!("accept: {e}"));
                        return;
                    }
                    AcceptError::Fatal => {
                        // The listening socket itself is broken: it would be readable (or in
                        // error) for ever, so the endpoint stops; the reactor's RDMA service
                        // goes on.
                        eprintln!("metrics on {}: accept: {e}: this endpoint stops", self.addr);
                        self.stop(ctx);
                        return;
                    }
                },
            }
        }
    }

    /// Out of descriptors: closes the spare, accepts the queued connection with its room, closes
    /// that at once and opens the spare again.
    fn refuse_for_fds(&self, e: &std::io::Error) -> Refusal {
        let mut spare = self.spare.borrow_mut();
        if spare.is_none() {
            // An earlier reopening lost the descriptor to another thread. Descriptors may have
            // been freed since: then the next accept may well succeed.
            *spare = open_spare();
            return if spare.is_some() { Refusal::One } else { Refusal::Stuck };
        }
        let refused = refuse_with_spare(&self.listener, &mut spare);
        match refused {
            Ok(()) => {
                if let Some(n) = self.out_of_fds.borrow_mut().event(Instant::now()) {
                    eprintln!("metrics on {}: accept: {e}: refused a connection{}", self.addr, more(n));
                }
                Refusal::One
            }
            // Linux takes the descriptor before it looks at the queue: out of descriptors,
            // accept fails with EMFILE on an empty queue too. With the spare's room it tells.
            Err(r) if r.kind() == ErrorKind::WouldBlock => Refusal::Drained,
            Err(r) if r.kind() == ErrorKind::Interrupted || classify(&r) == AcceptError::ThatOne => Refusal::One,
            // Another thread took the freed descriptor first, or worse.
            Err(_) => Refusal::Stuck,
        }
    }

    /// Stops watching the listening socket for [`BACKOFF`]: what is queued cannot be taken now,
    /// and a level-triggered socket would call again in every tick.
    fn pause(&self, ctx: &mut Ctx<'_>, why: &str) {
        let (Some(listener), Some(_)) = (self.listener_token.get(), self.timer_token.get()) else { return };
        let armed = self.backoff.set(Expiration::OneShot(TimeSpec::from_duration(BACKOFF)), TimerSetTimeFlags::empty());
        if armed.is_err() || ctx.set_fd_interest(listener, Interest::empty()).is_err() {
            eprintln!("metrics on {}: cannot pause accepting ({why}): this endpoint stops", self.addr);
            self.stop(ctx);
            return;
        }
        self.paused.set(true);
        if let Some(n) = self.errors.borrow_mut().event(Instant::now()) {
            eprintln!("metrics on {}: {why}: not accepting for {BACKOFF:?}{}", self.addr, more(n));
        }
    }

    /// The back-off timer expired: accept again.
    fn resume(&self, ctx: &mut Ctx<'_>) {
        let mut expirations = [0u8; 8];
        let _ = nix::unistd::read(&self.backoff, &mut expirations);
        if !self.paused.replace(false) {
            return;
        }
        if self.spare.borrow().is_none() {
            *self.spare.borrow_mut() = open_spare();
        }
        if let Some(listener) = self.listener_token.get() {
            if let Err(e) = ctx.set_fd_interest(listener, Interest::READABLE) {
                eprintln!("metrics on {}: cannot accept again: {e}: this endpoint stops", self.addr);
                self.stop(ctx);
            }
        }
    }

    /// Deregisters the listening socket and the timers: their callbacks, which hold the
    /// endpoint, are dropped, and the listening socket is closed with it (connections queued
    /// on it are refused, not left waiting). HTTP connections in progress finish (the reaper
    /// goes too: one that never does ends with its client).
    fn stop(&self, ctx: &mut Ctx<'_>) {
        let tokens = [self.listener_token.take(), self.timer_token.take(), self.reaper_token.take()];
        for token in tokens.into_iter().flatten() {
            ctx.deregister_fd(token);
        }
    }

    /// The reaper fired: closes the HTTP connections held `opts.idle` or longer, and arms it
    /// again for the next one to expire.
    fn reap(&self, ctx: &mut Ctx<'_>) {
        let mut expirations = [0u8; 8];
        let _ = nix::unistd::read(&self.reaper, &mut expirations);
        self.reaper_at.set(None);
        let now = Instant::now();
        // The borrow ends before the registrations are dropped: their `Http`s borrow `live`.
        let reaped = self.live.borrow_mut().reap(now, self.opts.idle);
        for token in reaped {
            ctx.deregister_fd(token);
        }
        self.arm_reaper();
    }

    /// Arms the reaper for when the oldest connection held expires, unless it is armed
    /// already (for that or an earlier time) or none is held.
    fn arm_reaper(&self) {
        let Some(oldest) = self.live.borrow().oldest() else { return };
        if self.reaper_at.get().is_some() {
            return;
        }
        let at = oldest + self.opts.idle;
        let wait = at.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        if self.reaper.set(Expiration::OneShot(TimeSpec::from_duration(wait)), TimerSetTimeFlags::empty()).is_ok() {
            self.reaper_at.set(Some(at));
        }
    }

    /// A connection was accepted: closes the expired ones, then keeps it if there is room.
    fn take(&self, ctx: &mut Ctx<'_>, stream: TcpStream) {
        let now = Instant::now();
        // The borrow ends before the registrations are dropped: their `Http`s borrow `live`.
        let (reaped, room) = self.live.borrow_mut().admit(now, self.opts.idle, self.opts.max_conns);
        for token in reaped {
            ctx.deregister_fd(token);
        }
        if !room {
            if let Some(n) = self.full.borrow_mut().event(now) {
                eprintln!(
                    "metrics on {}: {} HTTP connections open, none for {:?} yet: refused one{}",
                    self.addr,
                    self.opts.max_conns,
                    self.opts.idle,
                    more(n)
                );
            }
            return;
        }
        if stream.set_nonblocking(true).is_err() {
            return;
        }
        let id = self.live.borrow_mut().next_id();
        let http = Http {
            stream,
            request: Vec::new(),
            answer: Vec::new(),
            sent: 0,
            index: self.index,
            conns: self.opts.conns,
            live: self.live.clone(),
            id,
        };
        // The reactor registers a duplicate of the socket, closed when it is deregistered.
        let fd = http.stream.try_clone();
        let registered = fd.map_err(|e| e.to_string()).and_then(|fd| {
            let mut http = http;
            ctx.register_fd(&fd, Interest::READABLE, 0, move |ctx: &mut Ctx<'_>, ev: FdEvent| http.on_ready(ctx, ev))
                .map_err(|e| e.to_string())
        });
        match registered {
            Ok(token) => {
                self.live.borrow_mut().insert(id, token, now);
                self.arm_reaper();
            }
            Err(e) => {
                if let Some(n) = self.errors.borrow_mut().event(now) {
                    eprintln!("metrics on {}: cannot take a connection: {e}{}", self.addr, more(n));
                }
            }
        }
    }
}

/// One HTTP connection of the metrics endpoint.
struct Http {
    stream: TcpStream,
    request: Vec<u8>,
    answer: Vec<u8>,
    sent: usize,
    index: usize,
    /// Every connection's series too (`--metrics-conns`).
    conns: bool,
    /// The endpoint's connections, which this one leaves when it is dropped.
    live: Rc<RefCell<Live<Token>>>,
    id: u64,
}

impl Drop for Http {
    fn drop(&mut self) {
        // Dropped with its registration: finished, reaped (already out), or at shutdown. No
        // one holds the borrow then (the endpoint lets go of it before deregistering);
        // `try_` all the same, as a drop must not panic.
        if let Ok(mut live) = self.live.try_borrow_mut() {
            live.remove(self.id);
        }
    }
}

impl Http {
    fn on_ready(&mut self, ctx: &mut Ctx<'_>, ev: FdEvent) {
        if ev.readiness.intersects(Readiness::ERROR) {
            ctx.deregister_fd(ev.token);
            return;
        }
        if self.answer.is_empty() {
            if !self.read_request(ctx, ev) {
                return;
            }
            let _ = ctx.set_fd_interest(ev.token, Interest::WRITABLE);
        }
        while self.sent < self.answer.len() {
            match self.stream.write(&self.answer[self.sent..]) {
                Ok(n) => self.sent += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        // Answered (or the peer went away): the registration's drop closes the socket.
        ctx.deregister_fd(ev.token);
    }

    /// Reads what the socket has; true once the request is complete and answered in
    /// `self.answer`.
    fn read_request(&mut self, ctx: &mut Ctx<'_>, ev: FdEvent) -> bool {
        let mut chunk = [0u8; 2048];
        // The client may close its side right after its request (`nc`, HTTP/1.0 clients): what
        // came before the end is still a request to answer.
        let mut ended = false;
        loop {
            match self.stream.read(&mut chunk) {
                Ok(0) => {
                    ended = true;
                    break;
                }
                Ok(n) => self.request.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => {
                    ctx.deregister_fd(ev.token);
                    return false;
                }
            }
            if self.request.len() > MAX_REQUEST {
                break;
            }
        }
        let complete = self.request.windows(4).any(|w| w == b"\r\n\r\n");
        if !complete && ended {
            ctx.deregister_fd(ev.token);
            return false;
        }
        if !complete && self.request.len() <= MAX_REQUEST {
            return false;
        }
        let line = self.request.split(|&b| b == b'\r').next().unwrap_or_default();
        let (status, ctype, body) = if !complete {
            ("431 Request Header Fields Too Large", "text/plain", "request too large\n".to_string())
        } else if line.starts_with(b"GET /metrics ") || line == b"GET /metrics" {
            let index = self.index.to_string();
            let labels = [("reactor", index.as_str())];
            let text = if self.conns { ctx.prometheus(&labels) } else { ctx.prometheus_totals(&labels) };
            ("200 OK", "text/plain; version=0.0.4; charset=utf-8", text)
        } else if line.starts_with(b"GET ") {
            ("404 Not Found", "text/plain", "only /metrics is here\n".to_string())
        } else {
            ("405 Method Not Allowed", "text/plain", "only GET /metrics\n".to_string())
        };
        self.answer = format!(
            "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .into_bytes();
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bare_port_is_loopback_and_an_address_is_taken_as_given() {
        assert_eq!(parse_metrics_addr("9100"), Ok("127.0.0.1:9100".parse().unwrap()));
        assert_eq!(parse_metrics_addr(" 9100 "), Ok("127.0.0.1:9100".parse().unwrap()));
        assert_eq!(parse_metrics_addr("0.0.0.0:9100"), Ok("0.0.0.0:9100".parse().unwrap()));
        assert_eq!(parse_metrics_addr("[::1]:9100"), Ok("[::1]:9100".parse().unwrap()));
        assert!(parse_metrics_addr("70000").is_err(), "a port is 16 bits");
        assert!(parse_metrics_addr("").is_err());
        assert!(parse_metrics_addr("10.0.0.1").is_err(), "an address needs its port");
    }

    #[test]
    fn live_connections_leave_when_done_or_reaped_oldest_first() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let idle = Duration::from_secs(10);
        let mut live = Live::default();
        for (key, ms) in [(10u32, 0), (11, 1_000), (12, 2_000), (13, 9_000)] {
            let id = live.next_id();
            live.insert(id, key, at(ms));
        }
        // One finished normally: it leaves at once (its handler's drop).
        live.remove(2);
        assert_eq!(live.len(), 3);
        // Nothing is 10 s old yet.
        assert_eq!(live.reap(at(9_999), idle), Vec::<u32>::new());
        // At 12 s: those accepted at 0 and 2 s (11 finished), not the one at 9 s.
        assert_eq!(live.reap(at(12_000), idle), vec![10, 12]);
        assert_eq!(live.len(), 1);
        // Removing a reaped (or unknown) one is nothing.
        live.remove(1);
        live.remove(99);
        assert_eq!(live.len(), 1);
        assert_eq!(live.reap(at(19_000), idle), vec![13]);
        assert!(live.is_empty());
    }

    #[test]
    fn at_the_cap_idle_connections_make_room_and_otherwise_the_newcomer_is_refused() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let (idle, max) = (Duration::from_secs(10), 3);
        let mut live = Live::default();
        let accept = |live: &mut Live<u64>, ms: u64| {
            let (reaped, room) = live.admit(at(ms), idle, max);
            if room {
                let id = live.next_id();
                live.insert(id, id, at(ms));
            }
            (reaped, room)
        };
        assert_eq!(accept(&mut live, 0), (vec![], true));
        assert_eq!(accept(&mut live, 5_000), (vec![], true));
        assert_eq!(accept(&mut live, 6_000), (vec![], true));
        // Full, none idle 10 s: refused, nothing closed.
        assert_eq!(accept(&mut live, 9_000), (vec![], false));
        assert_eq!(live.len(), 3);
        // The first is now idle: closed, and the newcomer takes its place.
        assert_eq!(accept(&mut live, 10_000), (vec![1], true));
        assert_eq!(live.len(), 3);
        // Below the cap, expired ones are closed all the same (reaped at every accept).
        live.remove(4);
        assert_eq!(accept(&mut live, 16_500), (vec![2, 3], true));
        assert_eq!(live.len(), 1);
    }

    #[test]
    fn a_repeated_event_is_told_once_a_second_with_the_count_held_back() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut q = Quiet::new(Duration::from_secs(1));
        assert_eq!(q.event(at(0)), Some(0));
        // A flood within the second: nothing printed.
        for ms in 1..1_000 {
            assert_eq!(q.event(at(ms)), None);
        }
        assert_eq!(q.event(at(1_000)), Some(999));
        assert_eq!(q.event(at(5_000)), Some(0));
        assert_eq!(more(0), "");
        assert!(more(3).contains("3 more"));
    }

    #[test]
    fn accept_errors_that_leave_the_connection_queued_are_not_skipped() {
        use nix::libc;
        let e = |n| std::io::Error::from_raw_os_error(n);
        assert_eq!(classify(&e(libc::EMFILE)), AcceptError::Fds);
        assert_eq!(classify(&e(libc::ENFILE)), AcceptError::Fds);
        assert_eq!(classify(&e(libc::ECONNABORTED)), AcceptError::ThatOne);
        assert_eq!(classify(&e(libc::EPROTO)), AcceptError::ThatOne);
        assert_eq!(classify(&e(libc::ENOBUFS)), AcceptError::Memory);
        assert_eq!(classify(&e(libc::ENOMEM)), AcceptError::Memory);
        assert_eq!(classify(&e(libc::EBADF)), AcceptError::Fatal);
        assert_eq!(classify(&e(libc::EINVAL)), AcceptError::Fatal);
    }

    /// The spare descriptor's technique, for real: with the process out of descriptors,
    /// `accept` fails with `EMFILE` and leaves the connection queued; closing the spare makes
    /// room to take it and close it, and the spare is there again afterwards. Run in a child
    /// process of its own (this test binary, this test alone): it lowers the descriptor limit
    /// and uses every descriptor, which would break tests running beside it.
    #[test]
    fn out_of_descriptors_a_queued_connection_is_refused_with_the_spare() {
        const CHILD: &str = "RDMA_REACTOR_EMFILE_CHILD";
        let name = "common::observe::tests::out_of_descriptors_a_queued_connection_is_refused_with_the_spare";
        if std::env::var_os(CHILD).is_none() {
            let out = std::process::Command::new(std::env::current_exe().expect("this test binary"))
                .args([name, "--exact", "--nocapture", "--test-threads", "1"])
                .env(CHILD, "1")
                .output()
                .expect("run the child");
            let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            assert!(out.status.success(), "the child failed:\n{text}");
            assert!(text.contains("1 passed"), "the child ran no test:\n{text}");
            return;
        }
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        use nix::sys::resource::{getrlimit, setrlimit, Resource};
        use std::os::fd::AsFd;
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.set_nonblocking(true).expect("O_NONBLOCK");
        let mut client = TcpStream::connect(listener.local_addr().expect("address")).expect("connect");
        let mut spare = open_spare();
        assert!(spare.is_some());
        // A limit a little above what is open now, then every descriptor up to it.
        let open = std::fs::read_dir("/proc/self/fd").expect("/proc/self/fd").count() as u64;
        let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
        setrlimit(Resource::RLIMIT_NOFILE, open + 16, hard).expect("setrlimit");
        let mut hog = Vec::new();
        let emfile = loop {
            match File::open("/dev/null") {
                Ok(f) => hog.push(f),
                Err(e) => break e,
            }
            assert!(hog.len() < 1_000, "the limit did not hold");
        };
        assert_eq!(classify(&emfile), AcceptError::Fds, "{emfile}");
        let readable = |l: &TcpListener| {
            let mut fds = [PollFd::new(l.as_fd(), PollFlags::POLLIN)];
            poll(&mut fds, PollTimeout::ZERO).expect("poll") == 1
        };
        let e = listener.accept().expect_err("no descriptor for the connection");
        assert_eq!(classify(&e), AcceptError::Fds, "{e}");
        // Still queued: the level-triggered listening socket would call back in every tick.
        assert!(readable(&listener), "the connection is still queued");
        refuse_with_spare(&listener, &mut spare).expect("refused with the spare's room");
        assert!(spare.is_some(), "the spare is back");
        assert!(!readable(&listener), "nothing queued any more");
        // Linux takes the descriptor before it looks at the queue: EMFILE on an empty queue
        // too; with the spare's room, the queue's state (`Refusal::Drained`).
        let e = listener.accept().expect_err("no descriptor");
        assert_eq!(classify(&e), AcceptError::Fds, "{e}");
        let e = refuse_with_spare(&listener, &mut spare).expect_err("nothing queued");
        assert_eq!(e.kind(), ErrorKind::WouldBlock, "{e}");
        assert!(spare.is_some(), "the spare is back");
        drop(hog);
        // The client sees its connection closed without an answer.
        client.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        let mut buf = [0u8; 16];
        match client.read(&mut buf) {
            Ok(0) => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
            other => panic!("the refused client read {other:?}"),
        }
    }
}
