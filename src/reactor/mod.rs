//! The reactor: one thread, one epoll, the shared rdma_cm event channel and one completion
//! channel per device, dispatching to the listener/agent/client state machines and to user
//! callbacks.
//!
//! # One tick ([`Reactor::run_once`])
//!
//! 1. `epoll_wait`, with a timeout of zero when work is pending (a CQ left over budget, posts
//!    queued by a callback, objects to destroy), else until the next deadline.
//! 2. CM channel readable: read every event until `EAGAIN`; each goes to its object's state
//!    machine (by the token in `id->context`) and is acked before the next is read.
//! 3. Completion channel readable: read every event until `EAGAIN`, count it on its CQ (acks
//!    are batched), mark the CQ hot (disarmed).
//! 4. Poll hot CQs in batches under a per-CQ budget. A CQ found empty is re-armed with
//!    `ibv_req_notify_cq` and polled once more, so a completion that raced the arm is not
//!    stranded. A CQ that used its budget stays hot for the next tick.
//! 5. Fire expired deadlines and timers.
//! 6. Post every operation submitted during the tick: one chain per queue pair and direction.
//! 7. Ack CQ events whose count reached the batch threshold.
//! 8. Destroy what closed during the tick, in rdma-core's order (see ARCHITECTURE.md), and
//!    only now: every CM event of the tick has been acked.

pub(crate) mod ack;
mod cq;
mod ctx;
mod post;
mod stats;
mod timer;

pub use ctx::{Conn, Ctx, SubmitError};
pub use stats::Stats;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};

use crate::conn::{Action, Agent, Client, CloseReason, CmEventKind, Input, Listener, ListenerAction, State, Step};
use crate::error::{Error, Result};
use crate::flow::{Flow, MIN_DEPTH};
use crate::handler::{ConnectRequest, ConnectionHandler, Decision, ListenerHandler};
use crate::op::{Completion, OpCode, OpError, RawBuf, RemoteSlice};
use crate::sys::cm::{CmEvent, CmId, ConnParam, EventChannel};
use crate::sys::pool::{Buf, Pool, PoolConfig};
use crate::sys::verbs::{CompChannel, DeviceRef, Pd, QpCaps, WorkCompletion};
use crate::token::{GenSlab, Kind, Token};
use crate::wire::{ConnectInfo, RejectCode, RejectReason, MAX_ACCEPT_PRIVATE_DATA, MAX_CONNECT_PRIVATE_DATA};
use cq::CqEntry;
use timer::Timers;

/// Deadlines of the connection-manager steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// `rdma_resolve_addr` (also passed to the kernel).
    pub resolve_addr: Duration,
    /// `rdma_resolve_route` (also passed to the kernel).
    pub resolve_route: Duration,
    /// From `rdma_connect` to ESTABLISHED.
    pub connect: Duration,
    /// From `rdma_accept` to ESTABLISHED.
    pub accept: Duration,
    /// From our `rdma_disconnect` to DISCONNECTED.
    pub disconnect: Duration,
    /// From DISCONNECTED until every outstanding work request has completed.
    pub drain: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            resolve_addr: Duration::from_secs(5),
            resolve_route: Duration::from_secs(5),
            connect: Duration::from_secs(20),
            accept: Duration::from_secs(20),
            disconnect: Duration::from_secs(5),
            drain: Duration::from_secs(5),
        }
    }
}

impl Timeouts {
    fn of(&self, step: Step) -> Duration {
        match step {
            Step::ResolveAddr => self.resolve_addr,
            Step::ResolveRoute => self.resolve_route,
            Step::Connect => self.connect,
            Step::Accept => self.accept,
            Step::Disconnect => self.disconnect,
            Step::Drain => self.drain,
        }
    }
}

/// Reactor configuration. `Config::default()` suits most uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// The registered buffer pool of each device (chunk size = largest pool message).
    pub pool: PoolConfig,
    /// Send work requests each queue pair may have outstanding.
    pub send_depth: u32,
    /// Receive work requests each queue pair may have outstanding.
    pub recv_depth: u32,
    /// Largest send copied inline into the work request.
    pub max_inline: u32,
    /// Completion events counted per CQ before one `ibv_ack_cq_events` call.
    pub cq_ack_batch: u32,
    /// `Some(entries)`: every connection on a device shares one CQ of that many entries
    /// (room is accounted so it never overruns); `None`: one CQ per connection, sized for its
    /// queue pair.
    pub shared_cq: Option<u32>,
    /// One send in this many asks for a completion (and the last of each chain); the others
    /// are reported when the signaled one after them completes.
    pub signal_every: u32,
    /// Offer receive-credit flow control to peers (it applies when both sides offer it and
    /// both keep at least 3 receives posted).
    pub flow_control: bool,
    /// Completions reaped from one CQ per tick before the others get a turn.
    pub poll_budget: usize,
    /// Connection-manager deadlines.
    pub timeouts: Timeouts,
    /// Transport retries on each connection (0..=7).
    pub retry_count: u8,
    /// Receiver-not-ready retries (0..=6 finite; 7 retries forever).
    pub rnr_retry_count: u8,
    /// Listen backlog.
    pub backlog: i32,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            pool: PoolConfig::default(),
            send_depth: 64,
            recv_depth: 64,
            max_inline: 64,
            cq_ack_batch: 64,
            shared_cq: None,
            signal_every: 16,
            flow_control: true,
            poll_budget: 256,
            timeouts: Timeouts::default(),
            retry_count: 7,
            rnr_retry_count: 6,
            backlog: 1024,
        }
    }
}

/// Options of one client connection.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConnectOptions {
    /// Local address to bind (none: the kernel picks by route).
    pub src: Option<SocketAddr>,
    /// Largest message this client sends or receives (0: the pool's chunk size).
    pub msg_size: u32,
    /// Messages this client intends to send (0: not stated).
    pub msg_count: u32,
    /// Opaque bytes for the server (at most 36).
    pub user_data: Vec<u8>,
    /// Sends these bytes as the connect private data instead of the connect information (at
    /// most 56). For interoperability and fault tests: a server of this crate validates them.
    pub raw_private_data: Option<Vec<u8>>,
}

/// RDMA READ/atomic depth requested and granted on every connection.
const RD_ATOM: u8 = 4;

enum Role {
    Agent(Agent),
    Client(Client),
}

impl Role {
    fn state(&self) -> &State {
        match self {
            Role::Agent(a) => a.state(),
            Role::Client(c) => c.state(),
        }
    }

    fn on_input(&mut self, input: Input) -> crate::conn::Actions {
        match self {
            Role::Agent(a) => a.on_input(input),
            Role::Client(c) => c.on_input(input),
        }
    }
}

struct ConnEntry {
    /// Dropped first at destruction (queue pair, then id).
    id: Option<CmId>,
    role: Role,
    handler: Option<Box<dyn ConnectionHandler>>,
    device: Option<usize>,
    /// The CQ (in `Core::cqs`) of the queue pair, once created.
    cq: Option<Token>,
    dirty: bool,
    waiting_room: bool,
    caps: QpCaps,
    pending_send: VecDeque<Token>,
    pending_recv: VecDeque<Token>,
    /// Send-queue operations posted and not completed, in posting order.
    sq: VecDeque<Token>,
    unsignaled: u32,
    out_send: u32,
    out_recv: u32,
    /// Credit state, when both sides use flow control.
    flow: Option<Flow>,
    /// The connect information went out: receives posted from now on grant credits.
    info_sent: bool,
    deadline: Option<(u64, Step)>,
    peer_info: Option<ConnectInfo>,
    local_info: ConnectInfo,
    raw_private_data: Option<Vec<u8>>,
    close_reason: Option<CloseReason>,
}

impl ConnEntry {
    fn new(role: Role, handler: Box<dyn ConnectionHandler>) -> ConnEntry {
        ConnEntry {
            id: None,
            role,
            handler: Some(handler),
            device: None,
            cq: None,
            dirty: false,
            waiting_room: false,
            caps: QpCaps { max_send_wr: 0, max_recv_wr: 0, max_inline_data: 0 },
            pending_send: VecDeque::new(),
            pending_recv: VecDeque::new(),
            sq: VecDeque::new(),
            unsignaled: 0,
            out_send: 0,
            out_recv: 0,
            flow: None,
            info_sent: false,
            deadline: None,
            peer_info: None,
            local_info: ConnectInfo::default(),
            raw_private_data: None,
            close_reason: None,
        }
    }

    /// True when operations may be posted: the queue pair exists and the connection is being
    /// set up or is established.
    fn can_post(&self) -> bool {
        self.cq.is_some()
            && self.id.is_some()
            && matches!(self.role.state(), State::Accepting | State::Connecting | State::Established)
    }

    /// True when operations are accepted: from the queue pair's creation until the connection
    /// is closed. On a closing connection they are never posted and complete with
    /// `OpError::Cancelled` (a receive re-posted as the peer disconnects is a normal race, not
    /// an error).
    fn can_submit(&self) -> bool {
        self.cq.is_some() && !self.role.state().is_closed()
    }
}

struct ListenerEntry {
    id: Option<CmId>,
    sm: Listener,
    handler: Option<Box<dyn ListenerHandler>>,
    close_reason: Option<CloseReason>,
}

struct OpEntry {
    conn: Token,
    user_data: u64,
    opcode: OpCode,
    buf: Option<Buf>,
    raw: Option<RawBuf>,
    remote: Option<RemoteSlice>,
    /// A credit-only send of the runtime's own: its completion reaches no handler.
    control: bool,
    /// A receive posted again after a credit-only message consumed it.
    after_control: bool,
    /// On the device (holds a CQ reservation); false while queued.
    posted: bool,
}

impl OpEntry {
    /// Local address, length and key of the work request.
    fn sge(&self) -> (u64, u32, u32) {
        match (&self.buf, &self.raw) {
            (Some(b), _) => {
                let len = if self.opcode == OpCode::Recv { b.capacity() } else { b.len() };
                (b.addr(), len as u32, b.lkey())
            }
            (None, Some(r)) => (r.addr, r.len, r.lkey),
            (None, None) => (0, 0, 0),
        }
    }
}

struct UserTimer {
    owner: Token,
    user_data: u64,
}

struct Device {
    dev: DeviceRef,
    /// The device's shared CQ, in `Config::shared_cq` mode.
    shared_cq: Option<Token>,
    // Field order is drop order: the pool's regions before the channel and the PD.
    pool: Pool,
    chan: Rc<CompChannel>,
    pd: Rc<Pd>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum TimerTarget {
    Deadline(Token),
    User(Token),
}

/// Everything a callback may touch through its context. Field order is drop order:
/// connections (queue pairs, ids) before the operations' buffers, before the CQs, before the
/// listeners, before the devices (pools, completion channels, PDs), before the CM channel.
pub(crate) struct Core {
    graveyard: Vec<CmId>,
    conns: GenSlab<ConnEntry>,
    ops: GenSlab<OpEntry>,
    cqs: GenSlab<CqEntry>,
    listeners: GenSlab<ListenerEntry>,
    user_timers: GenSlab<UserTimer>,
    devices: Vec<Device>,
    epoll: Epoll,
    cm: Rc<EventChannel>,
    cfg: Config,
    timers: Timers<TimerTarget>,
    closing: Vec<Token>,
    closing_listeners: Vec<Token>,
    /// CQs to poll this tick.
    hot: Vec<Token>,
    dirty: Vec<Token>,
    /// CQs with un-acked events.
    evented: Vec<Token>,
    stop: bool,
    stats: Stats,
}

/// The event loop. Single-threaded: it is neither `Send` nor `Sync`.
///
/// ```compile_fail
/// fn assert_send<T: Send>() {}
/// assert_send::<rdma_reactor::Reactor>();
/// ```
pub struct Reactor {
    core: Core,
}

impl std::fmt::Debug for Reactor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reactor")
            .field("listeners", &self.core.listeners.len())
            .field("connections", &self.core.conns.len())
            .field("devices", &self.core.devices.len())
            .finish()
    }
}

fn os(call: &'static str) -> impl FnOnce(Errno) -> Error {
    move |e| Error::Os { call, source: e.into() }
}

impl Reactor {
    /// A reactor with the default configuration: creates the epoll instance and the shared,
    /// non-blocking rdma_cm event channel.
    ///
    /// # Errors
    ///
    /// `epoll_create1` or `rdma_create_event_channel` failed (no RDMA stack: librdmacm cannot
    /// open `/dev/infiniband/rdma_cm`).
    pub fn new() -> Result<Reactor> {
        Reactor::with_config(Config::default())
    }

    /// A reactor with the given configuration. See [`Reactor::new`].
    ///
    /// # Errors
    ///
    /// As [`Reactor::new`], and [`Error::Config`] for a depth or budget of zero.
    pub fn with_config(cfg: Config) -> Result<Reactor> {
        if cfg.send_depth == 0 || cfg.recv_depth == 0 {
            return Err(Error::Config("send and receive depth must be at least 1".into()));
        }
        if cfg.poll_budget == 0 {
            return Err(Error::Config("poll budget must be at least 1".into()));
        }
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).map_err(os("epoll_create1"))?;
        let cm = EventChannel::new().map_err(|e| Error::verb("rdma_create_event_channel", "", e))?;
        let token = Token::new(Kind::CmChannel, 0, 1);
        epoll.add(&*cm, EpollEvent::new(EpollFlags::EPOLLIN, token.as_u64())).map_err(os("epoll_ctl"))?;
        Ok(Reactor {
            core: Core {
                graveyard: Vec::new(),
                conns: GenSlab::new(Kind::Conn),
                ops: GenSlab::new(Kind::Op),
                cqs: GenSlab::new(Kind::Cq),
                listeners: GenSlab::new(Kind::Listener),
                user_timers: GenSlab::new(Kind::Timer),
                devices: Vec::new(),
                epoll,
                cm,
                cfg,
                timers: Timers::new(),
                closing: Vec::new(),
                closing_listeners: Vec::new(),
                hot: Vec::new(),
                dirty: Vec::new(),
                evented: Vec::new(),
                stop: false,
                stats: Stats::default(),
            },
        })
    }

    /// A context for calling the command API from outside any callback.
    pub fn ctx(&mut self) -> Ctx<'_> {
        Ctx::new(&mut self.core, None)
    }

    /// Binds and listens on `addr`. See [`Ctx::listen`].
    pub fn listen(&mut self, addr: SocketAddr, handler: impl ListenerHandler + 'static) -> Result<Token> {
        self.ctx().listen(addr, handler)
    }

    /// Starts a client connection to `dst`. See [`Ctx::connect`].
    pub fn connect(
        &mut self,
        dst: SocketAddr,
        opts: ConnectOptions,
        handler: impl ConnectionHandler + 'static,
    ) -> Result<Token> {
        self.ctx().connect(dst, opts, handler)
    }

    /// Statistics since creation.
    pub fn stats(&self) -> Stats {
        self.core.stats
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.core.cfg
    }

    /// Live connections (agents and clients, in any state).
    pub fn connections(&self) -> usize {
        self.core.conns.len()
    }

    /// Live listeners.
    pub fn listeners(&self) -> usize {
        self.core.listeners.len()
    }

    /// True when nothing is left to wait for: no listener, connection or timer.
    pub fn is_idle(&self) -> bool {
        self.core.listeners.len() == 0 && self.core.conns.len() == 0 && self.core.user_timers.len() == 0
    }

    /// Runs ticks until [`Ctx::stop`] is called or the reactor is idle.
    pub fn run(&mut self) -> Result<()> {
        self.core.stop = false;
        while !self.core.stop && !self.is_idle() {
            self.run_once(None)?;
        }
        self.core.stop = false;
        Ok(())
    }

    /// Runs one tick, waiting at most `timeout` (none: until something happens or the next
    /// deadline). Returns the number of events, completions and timers handled.
    ///
    /// # Errors
    ///
    /// Only failures of the loop itself (epoll, the CM channel); a connection's failure closes
    /// that connection and is reported to its handler.
    pub fn run_once(&mut self, timeout: Option<Duration>) -> Result<usize> {
        self.core.tick(timeout)
    }
}

impl Drop for Reactor {
    fn drop(&mut self) {
        // Objects closed in the last tick are destroyed by reap; the rest are destroyed by
        // Core's field order (see Core). Every CM event was acked within its tick, and every
        // CQ acks its counted events before it is destroyed.
        self.core.reap();
    }
}

impl Core {
    fn tick(&mut self, timeout: Option<Duration>) -> Result<usize> {
        let now = Instant::now();
        let busy = !self.hot.is_empty()
            || !self.dirty.is_empty()
            || !self.closing.is_empty()
            || !self.closing_listeners.is_empty();
        let mut wait = if busy { Some(Duration::ZERO) } else { timeout };
        if let Some(t) = self.timers.next_timeout(now) {
            wait = Some(wait.map_or(t, |w| w.min(t)));
        }
        let epoll_timeout = match wait {
            None => EpollTimeout::NONE,
            Some(d) => {
                // Round up so a deadline 0.3 ms away does not spin.
                let ms = d.as_micros().div_ceil(1000).min(i32::MAX as u128) as u32;
                EpollTimeout::try_from(ms).unwrap_or(EpollTimeout::MAX)
            }
        };
        let mut events = [EpollEvent::empty(); 32];
        let n = match self.epoll.wait(&mut events, epoll_timeout) {
            Ok(n) => n,
            Err(Errno::EINTR) => 0,
            Err(e) => return Err(os("epoll_wait")(e)),
        };
        self.stats.wakeups += 1;
        let mut work = 0;
        for ev in &events[..n] {
            match Token::from_u64(ev.data()) {
                Some(t) if t.kind() == Kind::CmChannel => work += self.drain_cm()?,
                Some(t) if t.kind() == Kind::CompChannel => work += self.drain_comp(t.index() as usize),
                _ => {}
            }
        }
        work += self.poll_hot();
        work += self.fire_timers();
        self.flush_posts();
        self.flush_acks();
        work += self.reap();
        if n > 0 && work == 0 {
            self.stats.spurious_wakeups += 1;
        }
        Ok(work)
    }

    // ----- rdma_cm events -------------------------------------------------------------------

    fn drain_cm(&mut self) -> Result<usize> {
        let mut n = 0;
        loop {
            let ev = match self.cm.get_event() {
                Ok(Some(ev)) => ev,
                Ok(None) => break,
                Err(e) if e.raw_os_error() == Some(nix::libc::EINTR) => continue,
                Err(e) => return Err(Error::verb("rdma_get_cm_event", "shared event channel", e)),
            };
            n += 1;
            self.stats.cm_events += 1;
            self.on_cm_event(&ev);
            // The event is acked here, before the next is read; ids it names are destroyed
            // only at the end of the tick.
            drop(ev);
        }
        Ok(n)
    }

    fn on_cm_event(&mut self, ev: &CmEvent) {
        let kind = ev.kind();
        match Token::from_u64(ev.context()) {
            Some(t) if t.kind() == Kind::Listener && self.listeners.contains(t) => self.on_listener_event(t, ev),
            Some(t) if t.kind() == Kind::Conn && self.conns.contains(t) => self.on_conn_event(t, ev),
            _ => {
                self.stats.stale_cm_events += 1;
                if kind == CmEventKind::ConnectRequest {
                    self.refuse_child(ev, RejectReason::new(RejectCode::Refused, "listener closed"));
                }
            }
        }
    }

    /// Rejects the id a connect request created and queues it for destruction.
    fn refuse_child(&mut self, ev: &CmEvent, reason: RejectReason) {
        if let Some(child) = ev.take_child(&self.cm, 0) {
            self.reject_child(child, &reason);
        }
    }

    /// Rejects a connect request's new id with `reason`; the id is destroyed at the end of the
    /// tick, after its CONNECT_REQUEST is acked.
    fn reject_child(&mut self, child: CmId, reason: &RejectReason) {
        let _ = child.reject(&reason.encode());
        self.stats.rejected += 1;
        self.graveyard.push(child);
    }

    fn on_listener_event(&mut self, t: Token, ev: &CmEvent) {
        let Some(l) = self.listeners.get_mut(t) else { return };
        match l.sm.on_cm(ev.kind(), ev.status()) {
            ListenerAction::Incoming => self.incoming(t, ev),
            ListenerAction::Report(what) => self.with_listener(t, |h, ctx| h.on_error(ctx, &what)),
            ListenerAction::Closed(reason) => {
                l.close_reason = Some(reason);
                self.closing_listeners.push(t);
            }
            ListenerAction::None => {
                if ev.kind() == CmEventKind::ConnectRequest {
                    self.refuse_child(ev, RejectReason::new(RejectCode::Refused, "listener closed"));
                }
            }
        }
    }

    fn incoming(&mut self, lt: Token, ev: &CmEvent) {
        let Some(child) = ev.take_child(&self.cm, 0) else { return };
        let peer = child.peer_addr();
        let refuse = |core: &mut Core, child: CmId, reason: RejectReason| {
            core.reject_child(child, &reason);
            core.with_listener(lt, |h, ctx| h.on_refused(ctx, peer, &reason));
        };
        let info = match ConnectInfo::decode(&ev.private_data()) {
            Ok(info) => info,
            Err(e) => return refuse(self, child, RejectReason::new(RejectCode::BadConnectInfo, e.to_string())),
        };
        if let Some(i) = &info {
            let max = self.cfg.pool.max_chunk();
            if i.msg_size as usize > max {
                let text = format!("message size {} exceeds the server's maximum {max}", i.msg_size);
                return refuse(self, child, RejectReason::new(RejectCode::Unsupported, text));
            }
        }
        let req = ConnectRequest { listener: lt, peer, info };
        let mut decision = None;
        self.with_listener(lt, |h, ctx| decision = Some(h.on_connect_request(ctx, &req)));
        match decision {
            None => refuse(self, child, RejectReason::new(RejectCode::Refused, "listener closed")),
            Some(Decision::Reject(reason)) => self.reject_child(child, &reason),
            Some(Decision::Accept(handler)) => self.accept(child, req.info, handler, ev),
        }
    }

    fn accept(&mut self, child: CmId, info: Option<ConnectInfo>, handler: Box<dyn ConnectionHandler>, ev: &CmEvent) {
        let (agent, first) = Agent::accepting();
        let t = self.conns.insert(ConnEntry::new(Role::Agent(agent), handler));
        child.set_context(t.as_u64());
        let c = self.conns.get_mut(t).expect("just inserted");
        c.peer_info = info;
        c.id = Some(child);
        self.apply(t, first);
        if let Err(e) = self.setup_qp(t) {
            self.reject_accepted(t, RejectCode::NoResources, &e.to_string());
            return self.feed(t, Input::SetupFailed(e.to_string()));
        }
        self.with_conn(t, |h, conn| h.on_ready(conn));
        let Some(c) = self.conns.get(t) else { return };
        if !c.can_post() {
            // The handler closed it in on_ready.
            return self.reject_accepted(t, RejectCode::Refused, "closed by the application");
        }
        self.flush_conn(t);
        let flow_offer = self.cfg.flow_control;
        let c = self.conns.get_mut(t).expect("live");
        let depth = c.out_recv.min(u16::MAX as u32);
        let peer = c.peer_info.as_ref();
        let flow = flow_offer
            && depth >= MIN_DEPTH
            && peer.is_some_and(|p| p.flow_control && u32::from(p.recv_depth) >= MIN_DEPTH);
        if flow {
            let peer_depth = u32::from(peer.expect("checked").recv_depth);
            c.flow = Some(Flow::new(peer_depth, depth));
        }
        let local = ConnectInfo {
            msg_size: self.cfg.pool.max_chunk() as u32,
            msg_count: 0,
            recv_depth: depth as u16,
            flow_control: flow,
            user: Vec::new(),
        };
        let bytes = local.encode(MAX_ACCEPT_PRIVATE_DATA).unwrap_or_default();
        c.local_info = local;
        c.info_sent = true;
        let (initiator, responder) = ev.conn_resources();
        let param = ConnParam {
            private_data: &bytes,
            responder_resources: initiator.min(RD_ATOM),
            initiator_depth: responder.min(RD_ATOM),
            retry_count: self.cfg.retry_count,
            rnr_retry_count: self.cfg.rnr_retry_count,
        };
        let r = c.id.as_ref().expect("live id").accept(&param);
        match r {
            Ok(()) => self.stats.accepted += 1,
            Err(e) => self.feed(t, Input::SetupFailed(format!("rdma_accept: {e}"))),
        }
    }

    fn reject_accepted(&mut self, t: Token, code: RejectCode, text: &str) {
        if let Some(id) = self.conns.get(t).and_then(|c| c.id.as_ref()) {
            let _ = id.reject(&RejectReason::new(code, text).encode());
            self.stats.rejected += 1;
        }
    }

    fn on_conn_event(&mut self, t: Token, ev: &CmEvent) {
        let kind = ev.kind();
        let status = ev.status();
        let mut bad_accept = None;
        let input = match kind {
            CmEventKind::Rejected => Input::Rejected { status, reason: RejectReason::decode(&ev.private_data()) },
            CmEventKind::Established => {
                let c = self.conns.get_mut(t).expect("checked by caller");
                if matches!(c.role, Role::Client(_)) {
                    match ConnectInfo::decode(&ev.private_data()) {
                        Ok(info) => {
                            let depth = u32::from(c.local_info.recv_depth);
                            if let Some(p) = info.as_ref().filter(|p| p.flow_control && c.local_info.flow_control) {
                                c.flow = Some(Flow::new(u32::from(p.recv_depth), depth));
                            }
                            c.peer_info = info;
                        }
                        Err(e) => bad_accept = Some(format!("bad accept information from the server: {e}")),
                    }
                }
                Input::Cm(kind, status)
            }
            _ => Input::Cm(kind, status),
        };
        self.feed(t, input);
        if let Some(what) = bad_accept {
            self.feed(t, Input::SetupFailed(what));
        }
    }

    // ----- state machine plumbing -----------------------------------------------------------

    /// Feeds an input to a connection's state machine and carries out the actions, including
    /// inputs those actions produce (a verb that failed).
    fn feed(&mut self, t: Token, input: Input) {
        let mut queue = VecDeque::from([input]);
        while let Some(input) = queue.pop_front() {
            let Some(c) = self.conns.get_mut(t) else { return };
            let actions = c.role.on_input(input);
            for a in actions {
                if let Some(next) = self.act(t, a) {
                    queue.push_back(next);
                }
            }
            if queue.is_empty() && self.drained(t) {
                queue.push_back(Input::Drained);
            }
        }
    }

    /// True when the connection is draining and nothing is outstanding.
    fn drained(&self, t: Token) -> bool {
        self.conns.get(t).is_some_and(|c| c.role.state().is_draining() && c.out_send == 0 && c.out_recv == 0)
    }

    fn apply(&mut self, t: Token, actions: crate::conn::Actions) {
        for a in actions {
            if let Some(next) = self.act(t, a) {
                self.feed(t, next);
            }
        }
    }

    fn act(&mut self, t: Token, action: Action) -> Option<Input> {
        let timeouts = self.cfg.timeouts;
        match action {
            Action::ResolveRoute => {
                let ms = timeouts.resolve_route.as_millis().min(i32::MAX as u128) as i32;
                let c = self.conns.get(t)?;
                if let Err(e) = c.id.as_ref()?.resolve_route(ms) {
                    return Some(Input::SetupFailed(format!("rdma_resolve_route: {e}")));
                }
            }
            Action::Connect => return self.client_connect(t),
            Action::Established => {
                self.stats.established += 1;
                // Sends submitted before ESTABLISHED (a peer's first message can complete a
                // receive before the event arrives) go out now.
                self.mark_dirty(t);
                self.with_conn(t, |h, conn| h.on_established(conn));
            }
            Action::Disconnect => {
                if let Some(id) = self.conns.get(t).and_then(|c| c.id.as_ref()) {
                    // EINVAL (already disconnected) is success; any other failure still ends
                    // in DISCONNECTED or the disconnect deadline.
                    let _ = id.disconnect();
                }
            }
            Action::SetDeadline(step) => {
                let key = self.timers.schedule(Instant::now() + timeouts.of(step), TimerTarget::Deadline(t));
                self.conns.get_mut(t)?.deadline = Some((key, step));
            }
            Action::ClearDeadline => self.conns.get_mut(t)?.deadline = None,
            Action::Closed(reason) => {
                let c = self.conns.get_mut(t)?;
                if c.close_reason.is_none() {
                    c.close_reason = Some(reason);
                    self.closing.push(t);
                }
            }
        }
        None
    }

    fn client_connect(&mut self, t: Token) -> Option<Input> {
        if let Err(e) = self.setup_qp(t) {
            return Some(Input::SetupFailed(e.to_string()));
        }
        self.with_conn(t, |h, conn| h.on_ready(conn));
        if !self.conns.get(t)?.can_post() {
            return None; // Closed by the handler in on_ready.
        }
        self.flush_conn(t);
        let flow_offer = self.cfg.flow_control;
        let c = self.conns.get_mut(t)?;
        c.local_info.recv_depth = c.out_recv.min(u16::MAX as u32) as u16;
        c.local_info.flow_control = flow_offer && c.out_recv >= MIN_DEPTH;
        c.info_sent = true;
        let bytes = match (&c.raw_private_data, c.local_info.encode(MAX_CONNECT_PRIVATE_DATA)) {
            (Some(raw), _) => raw.clone(),
            (None, Ok(b)) => b,
            (None, Err(e)) => return Some(Input::SetupFailed(format!("connect information: {e}"))),
        };
        let param = ConnParam {
            private_data: &bytes,
            responder_resources: RD_ATOM,
            initiator_depth: RD_ATOM,
            retry_count: self.cfg.retry_count,
            rnr_retry_count: self.cfg.rnr_retry_count,
        };
        if let Err(e) = c.id.as_ref()?.connect(&param) {
            return Some(Input::SetupFailed(format!("rdma_connect: {e}")));
        }
        None
    }

    /// Creates the device resources if needed, the connection's CQ (its own, or the
    /// device's shared one) and queue pair.
    fn setup_qp(&mut self, t: Token) -> Result<()> {
        let dev = {
            let c = self.conns.get(t).ok_or(Error::StaleToken(t.as_u64()))?;
            let id = c.id.as_ref().ok_or_else(|| Error::NotConnected("no id".into()))?;
            id.device().ok_or_else(|| Error::NoDevice("the id is not bound to a device".into()))?
        };
        let d = self.device(dev)?;
        let ct = match self.devices[d].shared_cq {
            Some(ct) => ct,
            None => self.new_cq(d, dev, self.cfg.send_depth + self.cfg.recv_depth, false)?,
        };
        let want = QpCaps {
            max_send_wr: self.cfg.send_depth,
            max_recv_wr: self.cfg.recv_depth,
            max_inline_data: self.cfg.max_inline,
        };
        let pd = self.devices[d].pd.clone();
        let shared = self.devices[d].shared_cq.is_some();
        let e = self.cqs.get_mut(ct).expect("live");
        if !e.room.admit(self.cfg.recv_depth) {
            let (cap, used) = (e.room.capacity(), e.room.reserved());
            return Err(Error::Config(format!(
                "the shared CQ has no room for {} more receives ({used} of {cap} entries committed)",
                self.cfg.recv_depth
            )));
        }
        let cq = e.cq.clone();
        let c = self.conns.get_mut(t).expect("checked above");
        let id = c.id.as_mut().expect("checked above");
        match id.create_qp(&pd, &cq, &cq, want) {
            Ok(granted) => {
                // Post no more than was committed on the CQ, even if the device granted more.
                c.caps = QpCaps {
                    max_send_wr: granted.max_send_wr.min(want.max_send_wr),
                    max_recv_wr: granted.max_recv_wr.min(want.max_recv_wr),
                    max_inline_data: granted.max_inline_data,
                };
                c.cq = Some(ct);
                c.device = Some(d);
                Ok(())
            }
            Err(err) => {
                if shared {
                    self.cqs.get_mut(ct).expect("live").room.leave(self.cfg.recv_depth);
                } else {
                    self.cqs.remove(ct);
                }
                Err(Error::verb("rdma_create_qp", format!("connection {t:?}"), err))
            }
        }
    }

    /// The index of the device's resources, created on first use.
    fn device(&mut self, dev: DeviceRef) -> Result<usize> {
        if let Some(i) = self.devices.iter().position(|d| d.dev == dev) {
            return Ok(i);
        }
        let pd = Pd::new(dev).map_err(|e| Error::verb("ibv_alloc_pd", "", e))?;
        let chan = CompChannel::new(dev).map_err(|e| Error::verb("ibv_create_comp_channel", "", e))?;
        let pool = Pool::new(&pd, &self.cfg.pool)?;
        let index = self.devices.len();
        let token = Token::new(Kind::CompChannel, index as u32, 1);
        self.epoll.add(&*chan, EpollEvent::new(EpollFlags::EPOLLIN, token.as_u64())).map_err(os("epoll_ctl"))?;
        self.devices.push(Device { dev, shared_cq: None, pool, chan, pd });
        if let Some(entries) = self.cfg.shared_cq {
            let ct = self.new_cq(index, dev, entries, true)?;
            self.devices[index].shared_cq = Some(ct);
        }
        Ok(index)
    }

    // ----- timers ---------------------------------------------------------------------------

    fn fire_timers(&mut self) -> usize {
        let due = self.timers.expired(Instant::now());
        let mut n = 0;
        for (key, target) in due {
            match target {
                TimerTarget::Deadline(t) => {
                    let Some(c) = self.conns.get_mut(t) else { continue };
                    if let Some((k, step)) = c.deadline {
                        if k == key {
                            c.deadline = None;
                            n += 1;
                            self.feed(t, Input::Timeout(step));
                        }
                    }
                }
                TimerTarget::User(tt) => {
                    let Some(timer) = self.user_timers.remove(tt) else { continue };
                    n += 1;
                    match timer.owner.kind() {
                        Kind::Conn => self.with_conn(timer.owner, |h, conn| h.on_timer(conn, timer.user_data)),
                        Kind::Listener => self.with_listener(timer.owner, |h, ctx| h.on_timer(ctx, timer.user_data)),
                        _ => {}
                    }
                }
            }
        }
        n
    }

    pub(crate) fn set_timer(&mut self, owner: Token, delay: Duration, user_data: u64) -> Token {
        let tt = self.user_timers.insert(UserTimer { owner, user_data });
        self.timers.schedule(Instant::now() + delay, TimerTarget::User(tt));
        tt
    }

    // ----- destruction ----------------------------------------------------------------------

    /// Destroys what closed during the tick. Returns the number of objects destroyed.
    fn reap(&mut self) -> usize {
        let mut n = 0;
        loop {
            let conns = std::mem::take(&mut self.closing);
            let listeners = std::mem::take(&mut self.closing_listeners);
            if conns.is_empty() && listeners.is_empty() {
                break;
            }
            for t in conns {
                n += 1;
                self.destroy_conn(t);
            }
            for t in listeners {
                n += 1;
                self.destroy_listener(t);
            }
        }
        self.graveyard.clear();
        if n > 0 {
            for d in &self.devices {
                d.pool.trim();
            }
        }
        n
    }

    /// Destroys one closed connection, in rdma-core's order:
    /// 1. the queue pair and the id (`rdma_destroy_qp`, `rdma_destroy_id`; the tick's CM events
    ///    are all acked);
    /// 2. its CQ is drained, so every completion it produced reaches its handler (a shared CQ
    ///    delivers other connections' completions too);
    /// 3. operations that never completed are cancelled (their buffers are safe to hand back:
    ///    the queue pair is gone) and their CQ room given back;
    /// 4. its own CQ, if it has one, is destroyed (counted events acked first);
    /// 5. the handler hears `on_closed`; the connection's timers are cancelled.
    fn destroy_conn(&mut self, t: Token) {
        let Some(c) = self.conns.get_mut(t) else { return };
        let id = c.id.take();
        let ct = c.cq;
        drop(id);
        if let Some(ct) = ct {
            self.poll_cq(ct, usize::MAX);
        }
        let completions = self.cancel_ops(t, ct);
        let Some(mut c) = self.conns.remove(t) else { return };
        self.stats.closed += 1;
        self.user_timers.retain(|timer| timer.owner != t);
        let reason = c.close_reason.take().unwrap_or(CloseReason::Local);
        let mut handler = c.handler.take();
        if let Some(ct) = ct {
            if let Some(e) = self.cqs.get_mut(ct) {
                e.waiting.retain(|w| *w != t);
                e.room.leave(c.caps.max_recv_wr);
                if !e.shared {
                    let unacked = e.cq.unacked();
                    if unacked > 0 {
                        self.stats.cq_ack_calls += 1;
                        self.stats.cq_events_acked += u64::from(unacked);
                    }
                    // Drop acks the counted events, then ibv_destroy_cq.
                    self.cqs.remove(ct);
                }
            }
        }
        drop(c);
        if let Some(h) = handler.as_mut() {
            for completion in completions {
                let mut conn = Conn::new(self, t);
                h.on_completion(&mut conn, completion);
            }
            let mut ctx = Ctx::new(self, None);
            h.on_closed(&mut ctx, t, reason);
        }
    }

    fn destroy_listener(&mut self, t: Token) {
        let Some(mut l) = self.listeners.remove(t) else { return };
        self.user_timers.retain(|timer| timer.owner != t);
        let reason = l.close_reason.take().unwrap_or(CloseReason::Local);
        drop(l.id.take());
        if let Some(mut h) = l.handler.take() {
            let mut ctx = Ctx::new(self, None);
            h.on_closed(&mut ctx, reason);
        }
    }

    // ----- handler calls --------------------------------------------------------------------

    /// Calls a connection's handler with a context. The handler is taken out of its entry for
    /// the call, so the context can reach every other object mutably.
    fn with_conn(&mut self, t: Token, f: impl FnOnce(&mut dyn ConnectionHandler, &mut Conn<'_>)) {
        let Some(mut h) = self.conns.get_mut(t).and_then(|c| c.handler.take()) else { return };
        {
            let mut conn = Conn::new(self, t);
            f(&mut *h, &mut conn);
        }
        if let Some(c) = self.conns.get_mut(t) {
            c.handler = Some(h);
        }
    }

    fn with_listener(&mut self, t: Token, f: impl FnOnce(&mut dyn ListenerHandler, &mut Ctx<'_>)) {
        let Some(mut h) = self.listeners.get_mut(t).and_then(|l| l.handler.take()) else { return };
        {
            let mut ctx = Ctx::new(self, Some(t));
            f(&mut *h, &mut ctx);
        }
        if let Some(l) = self.listeners.get_mut(t) {
            l.handler = Some(h);
        }
    }

    // ----- commands (called through Ctx) ----------------------------------------------------

    pub(crate) fn listen(&mut self, addr: SocketAddr, handler: Box<dyn ListenerHandler>) -> Result<Token> {
        let t = self.listeners.insert(ListenerEntry {
            id: None,
            sm: Listener::new(),
            handler: Some(handler),
            close_reason: None,
        });
        let what = format!("listener on {addr}");
        let setup = (|| {
            let id = CmId::new(&self.cm, t.as_u64()).map_err(|e| Error::verb("rdma_create_id", what.clone(), e))?;
            id.bind(&addr).map_err(|e| Error::verb("rdma_bind_addr", what.clone(), e))?;
            // Bound to an address of one device: create its resources now, so the first
            // connection does not pay for them and a quiet server's resource count is stable.
            if let Some(dev) = id.device() {
                self.device(dev)?;
            }
            id.listen(self.cfg.backlog).map_err(|e| Error::verb("rdma_listen", what.clone(), e))?;
            Ok(id)
        })();
        match setup {
            Ok(id) => {
                self.listeners.get_mut(t).expect("inserted").id = Some(id);
                Ok(t)
            }
            Err(e) => {
                self.listeners.remove(t);
                Err(e)
            }
        }
    }

    pub(crate) fn connect(
        &mut self,
        dst: SocketAddr,
        opts: ConnectOptions,
        handler: Box<dyn ConnectionHandler>,
    ) -> Result<Token> {
        let (client, first) = Client::resolving();
        let msg_size = if opts.msg_size == 0 { self.cfg.pool.max_chunk() as u32 } else { opts.msg_size };
        if msg_size as usize > self.cfg.pool.max_chunk() {
            return Err(Error::TooLarge { len: msg_size as usize, max: self.cfg.pool.max_chunk() });
        }
        let local_info = ConnectInfo {
            msg_size,
            msg_count: opts.msg_count,
            recv_depth: 1,
            flow_control: false,
            user: opts.user_data,
        };
        local_info.encode(MAX_CONNECT_PRIVATE_DATA)?;
        if opts.raw_private_data.as_ref().is_some_and(|r| r.len() > MAX_CONNECT_PRIVATE_DATA) {
            return Err(Error::Config(format!("raw private data is limited to {MAX_CONNECT_PRIVATE_DATA} bytes")));
        }
        let t = self.conns.insert(ConnEntry::new(Role::Client(client), handler));
        let what = format!("client to {dst}");
        let ms = self.cfg.timeouts.resolve_addr.as_millis().min(i32::MAX as u128) as i32;
        let setup = (|| {
            let id = CmId::new(&self.cm, t.as_u64()).map_err(|e| Error::verb("rdma_create_id", what.clone(), e))?;
            id.resolve_addr(opts.src.as_ref(), &dst, ms)
                .map_err(|e| Error::verb("rdma_resolve_addr", what.clone(), e))?;
            Ok(id)
        })();
        match setup {
            Ok(id) => {
                let c = self.conns.get_mut(t).expect("inserted");
                c.id = Some(id);
                c.local_info = local_info;
                c.raw_private_data = opts.raw_private_data;
                self.apply(t, first);
                Ok(t)
            }
            Err(e) => {
                self.conns.remove(t);
                Err(e)
            }
        }
    }

    pub(crate) fn close(&mut self, t: Token) {
        match t.kind() {
            Kind::Conn => self.feed(t, Input::Close),
            Kind::Listener => {
                if let Some(l) = self.listeners.get_mut(t) {
                    if let ListenerAction::Closed(reason) = l.sm.close() {
                        l.close_reason = Some(reason);
                        self.closing_listeners.push(t);
                    }
                }
            }
            _ => {}
        }
    }

    pub(crate) fn alloc(&mut self, t: Token, len: usize) -> Result<Buf> {
        let c = self.conns.get(t).ok_or(Error::StaleToken(t.as_u64()))?;
        let d = c.device.ok_or_else(|| Error::NotConnected(format!("connection {t:?} has no device yet")))?;
        self.devices[d].pool.alloc(len)
    }
}

fn build_completion(op: OpEntry, wc: &WorkCompletion) -> Completion {
    let result = if wc.status == crate::op::WcStatus::Success {
        match op.opcode {
            OpCode::Recv => Ok(wc.byte_len),
            // A send's byte_len is undefined in the completion; report what was posted.
            _ => Ok(op.sge().1),
        }
    } else {
        Err(OpError::Wc(wc.status))
    };
    let mut buf = op.buf;
    if let (Some(b), OpCode::Recv, Ok(n)) = (buf.as_mut(), op.opcode, &result) {
        let _ = b.set_len(if wc.remote_write { 0 } else { *n as usize });
    }
    Completion { user_data: op.user_data, opcode: op.opcode, result, buf, remote_write: wc.remote_write }
}
