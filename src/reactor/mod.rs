//! The reactor: one thread, one epoll, the shared rdma_cm event channel and one completion
//! channel per device, dispatching to the listener/agent/client state machines and to user
//! callbacks.
//!
//! # One tick ([`Reactor::run_once`])
//!
//! 0. Spinning (`Config::spin`, for that long after the last tick that did work): poll the
//!    CQs left unarmed directly; once the spin time is over, arm them and poll once more.
//! 1. `epoll_wait` (level-triggered), with a timeout of zero when work is pending (a CQ left
//!    over budget, posts queued by a callback, objects to destroy, spinning), else until the
//!    next deadline. While spinning it runs only every few ticks. A signal that interrupts it
//!    (`EINTR`) makes a tick with no readiness (`Stats::interrupted_waits`).
//! 2. CM channel readable: read every event until `EAGAIN`; each goes to its object's state
//!    machine (by the token in `id->context`) and is acked before the next is read
//!    (`setup.rs`).
//! 3. Completion channel readable: read its events (at most as many as the device has armed
//!    CQs, since each raises one), count each on its CQ (acks are batched), mark the CQ hot
//!    (`cq.rs`).
//!    In the same pass, in epoll's order: a device's event fd (`device.rs`), the [`Remote`]
//!    eventfd (queued messages to the message handler, a stop request, connect requests
//!    handed over by another reactor (`handoff.rs`), asynchronous events another reactor
//!    read; `remote.rs`), an
//!    application fd registered with [`Ctx::register_fd`] (its callback; `userfd.rs`).
//! 4. Poll hot CQs in batches under a per-CQ budget. A CQ found empty stays unarmed for now;
//!    a CQ that used its budget stays hot for the next tick.
//! 5. Fire expired deadlines and timers (`timers.rs`).
//!    5b. Close what lost its last async handle and poll the woken tasks (`exec.rs`): what
//!    they submit is posted in step 6.
//! 6. Post the operations submitted during the tick: first each device's shared receive queue
//!    refill (`srq.rs`, one chain per device), then one chain per queue pair and direction
//!    (`post.rs`, planned by `send_queue.rs`). Then poll the CQs emptied in step 4 once more
//!    (a send whose ACK came back during its post completes now, not after a wakeup), arm
//!    them with `ibv_req_notify_cq` and poll again, so a completion that raced the arm is not
//!    stranded (unless spinning, which leaves them unarmed).
//! 7. Ack CQ events whose count reached the batch threshold.
//! 8. Destroy what closed during the tick (`teardown.rs`), and only now: every CM event of the
//!    tick has been acked.
//!
//! # Panics in callbacks
//!
//! A panic in a user callback is caught at the callback's boundary (`Core::with_conn`,
//! `Core::with_listener`, `Core::deliver`), the handler stays with its object, and the tick
//! runs to its end (the rest of the polled batch, timers, posts, acks, destruction), so the
//! reactor stays consistent and nothing is lost; then the first panic of the tick resumes out
//! of `run_once` (the reactor does not swallow it). Dropping the reactor discards a panic
//! caught during its shutdown.
//!
//! Commands called from callbacks run at once (`connect`, `listen`, `alloc`, a close's
//! `rdma_disconnect`); only posting (step 6) and destruction (step 8) wait for the end of the
//! tick.
//!
//! Files by concern: `config.rs` (configuration), `setup.rs` (CM dispatch, accept, connect,
//! queue pairs, devices), `drive.rs` (feeding the state machines, carrying out their actions),
//! `send_queue.rs` and `cq_room.rs` (pure planning of posts and CQ room), `srq.rs` (shared
//! receive queues and the credit rule), `post.rs`
//! (submission, the FFI post), `cq.rs` (the CQ protocol, completions), `timers.rs`,
//! `teardown.rs` (close, destroy, cancel, shutdown), `ctx.rs` and `handler.rs` (the callback
//! API), `op.rs` (operations and completions), `stats.rs`, `remote.rs` (the cross-thread
//! handle), `handoff.rs` (spreading a listener's connections over reactors), `userfd.rs` (application fds), `embed.rs` (the epoll fd and `next_timeout` for an
//! outer loop).

/// An operator's log line through the `log` facade (target `rdma_reactor`) with the feature
/// `log`; without it nothing is compiled and the arguments are not evaluated.
macro_rules! event {
    ($level:ident, $($arg:tt)+) => {
        #[cfg(feature = "log")]
        {
            log::$level!(target: "rdma_reactor", $($arg)+);
        }
    };
}

mod api;
mod conn;
mod data;
mod event_loop;

pub use api::config::{Config, ConnectOptions, SrqConfig, Timeouts};

/// The pure parts `crate::bench_internals` drives.
#[cfg(feature = "bench-internals")]
pub(crate) mod bench {
    pub(crate) use super::data::cq_room::CqRoom;
    pub(crate) use super::data::send_queue::{RecvQueue, SendQueue};
}
pub use api::ctx::{Conn, Ctx, SubmitError};
pub use api::handler::{ConnectRequest, ConnectionHandler, Decision, ListenerHandler};
pub use api::stats::Stats;
pub use conn::handoff::Balance;
pub use data::op::{Completion, Op, RawBuf};
pub use event_loop::exec::{spawn, stats, JoinHandle};
pub(crate) use event_loop::exec::{with_ctx, Orphans};
pub use event_loop::remote::{ReactorGone, Remote};
pub use event_loop::userfd::{FdEvent, FdHandler, Interest, Readiness};

use std::net::SocketAddr;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::rc::Rc;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};

use crate::error::{Error, Result};
use crate::proto::conn::{Actions, Agent, Client, CloseReason, Input, Listener, State, Step};
use crate::proto::metrics::{ConnMeter, ConnMetrics};
use crate::proto::token::{ConnKey, CqKey, FdKey, GenSlab, Key, Kind, ListenerKey, OpKey, TimerKey, Token};
use crate::proto::transport::Caps;
use crate::proto::wire::ConnectInfo;
use crate::sys::cm::{CmId, EventChannel};
use crate::sys::cq::CompChannel;
use crate::sys::device::DeviceRef;
use crate::sys::pd::Pd;
use crate::sys::pool::{Pool, Windows};
use crate::sys::qp::Qp;
use data::cq::CqEntry;
use data::op::OpEntry;
use data::send_queue::{RecvQueue, SendQueue};
use data::tail::TailRing;
use event_loop::device::Devices;
use event_loop::remote::Inbox;
use event_loop::timers::{TimerTarget, Timers, UserTimer};
use event_loop::userfd::UserFd;

/// A connection's role: its state machine.
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

    fn on_input(&mut self, input: Input) -> Actions {
        match self {
            Role::Agent(a) => a.on_input(input),
            Role::Client(c) => c.on_input(input),
        }
    }
}

/// A connection's rdma_cm id, owned by its queue pair once that exists.
enum Endpoint {
    None,
    Id(CmId),
    Qp(Qp),
}

impl Endpoint {
    fn id(&self) -> Option<&CmId> {
        match self {
            Endpoint::None => None,
            Endpoint::Id(id) => Some(id),
            Endpoint::Qp(qp) => Some(qp.id()),
        }
    }

    fn qp(&self) -> Option<&Qp> {
        match self {
            Endpoint::Qp(qp) => Some(qp),
            _ => None,
        }
    }
}

/// What a connection was told and told the peer at setup.
struct Infos {
    local: ConnectInfo,
    peer: Option<ConnectInfo>,
    /// Bytes a client sends instead of `local` (interoperability and fault tests).
    raw_private_data: Option<Vec<u8>>,
    /// `local` went out: receives posted from now on grant credits.
    sent: bool,
}

/// Where a connection's queue pair lives, once it exists.
#[derive(Clone, Copy)]
struct Placement {
    /// Index into `Core::devices`.
    device: usize,
    cq: CqKey,
    /// Largest inline send the queue pair takes.
    max_inline: u32,
    /// Its messages end in a tail instead of carrying immediate data (iWARP,
    /// `proto::transport`): the connection has a [`TailRing`].
    tail: bool,
    /// CQ room committed to its receives when it was placed (0 on a shared receive queue),
    /// given back exactly at destruction, whatever the device granted.
    recv_room: u32,
}

struct ConnEntry {
    /// Memory windows exposed on this connection (`Conn::expose`): deallocated at destruction
    /// before the queue pair.
    windows: Windows,
    /// Dropped right after at destruction (queue pair, then id).
    ep: Endpoint,
    /// The tails its sends end with, on a transport without immediate data: after `ep`, so
    /// the queue pair that reads them is destroyed first.
    tails: Option<TailRing>,
    role: Role,
    handler: Option<Guarded<dyn ConnectionHandler>>,
    placed: Option<Placement>,
    sq: SendQueue,
    rq: RecvQueue,
    /// Listed in `Core::dirty`: has something to post at the end of the tick.
    dirty: bool,
    /// Listed in its CQ's `waiting`: short of CQ room.
    waiting_room: bool,
    deadline: Option<(u64, Step)>,
    /// The credit-stall timer's key while the next send waits for credits
    /// (`Config::credit_timeout`, `post.rs`).
    stall: Option<u64>,
    /// User timers set by this connection's callbacks (some may have fired or been cancelled).
    timers: Vec<TimerKey>,
    infos: Infos,
    close_reason: Option<CloseReason>,
    /// On its device's shared receive queue (`Config::srq`): its share of the queue, which
    /// follows its activity (`srq.rs`, `SrqBudget`), instead of a receive depth.
    srq_share: Option<data::srq::ConnShare>,
    /// Whose bytes this connection's buffers hold (`sys/pool.rs`): unique in the process.
    mem_owner: u64,
    /// iWARP only: the stream ended (DISCONNECTED) and the queue pair was moved to the error
    /// state. Soft-iWARP flushes the receives posted at that moment, never one posted later:
    /// the drain waits for sends only, and a receive still posted at destruction is reported
    /// flushed (`Core::cancel_ops`): no message can land in it any more.
    stream_closed: bool,
    /// Its counters (`Conn::metrics`): each completion handed to its handler, its credit waits.
    meter: ConnMeter,
    /// The keepalive timer's key while probes are scheduled (`Config::keepalive`).
    keepalive: Option<u64>,
    /// The parting timer's key: the peer said goodbye (the close handshake) and we answered;
    /// should its disconnect not arrive within `Timeouts::finish`, we disconnect (`cq.rs`,
    /// `Core::on_farewell`).
    parting: Option<u64>,
    /// Fault injection (`Reactor::inject_silent_parting`): this connection skips its
    /// `rdma_disconnect` after its farewell was answered.
    #[cfg(feature = "fault-injection")]
    mute: bool,
    /// A client with a reconnect policy (`ConnectOptions::reconnect`, `reconnect.rs`).
    redial: Option<Box<conn::reconnect::Redial>>,
}

impl ConnEntry {
    fn new(role: Role, handler: Box<dyn ConnectionHandler>, signal_every: u32, local: ConnectInfo) -> ConnEntry {
        ConnEntry {
            windows: Windows::default(),
            ep: Endpoint::None,
            tails: None,
            role,
            handler: Some(Guarded::new(handler)),
            placed: None,
            sq: SendQueue::new(signal_every),
            rq: RecvQueue::default(),
            dirty: false,
            waiting_room: false,
            deadline: None,
            stall: None,
            timers: Vec::new(),
            infos: Infos { local, peer: None, raw_private_data: None, sent: false },
            close_reason: None,
            srq_share: None,
            mem_owner: crate::sys::pool::next_owner(),
            stream_closed: false,
            meter: ConnMeter::default(),
            keepalive: None,
            parting: None,
            #[cfg(feature = "fault-injection")]
            mute: false,
            redial: None,
        }
    }

    /// While a client waits to reconnect or makes a new attempt (no queue pair yet): the
    /// device of its last queue pair, where operations submitted meanwhile are checked
    /// (`reconnect.rs`).
    fn waiting_device(&self) -> Option<usize> {
        self.redial.as_ref().filter(|_| self.placed.is_none() && !self.role.state().is_closed()).and_then(|r| r.device)
    }

    /// True when operations may be posted: the queue pair exists and the connection is being
    /// set up, is established, or says goodbye (its farewell and receives still go; its send
    /// queue holds back the rest, `SendQueue::say_farewell`).
    fn can_post(&self) -> bool {
        self.ep.qp().is_some()
            && matches!(
                self.role.state(),
                State::Accepting | State::Connecting | State::Established | State::Finishing(_)
            )
    }

    /// True when operations are accepted: from the queue pair's creation until the connection
    /// is closed. On a closing connection they are never posted and complete with
    /// `OpError::Cancelled` (a receive re-posted as the peer disconnects is a normal race, not
    /// an error).
    fn can_submit(&self) -> bool {
        self.placed.is_some() && !self.role.state().is_closed()
    }

    /// The CQs its completions land on: its own (or shared) CQ, and the device whose SRQ's CQ
    /// takes its receives when it is on a shared receive queue (`Core::reap_conn_cqs`).
    fn cqs(&self) -> (Option<CqKey>, Option<usize>) {
        (self.placed.map(|p| p.cq), self.srq_share.and(self.placed).map(|p| p.device))
    }

    /// True when the connection is draining and nothing is outstanding.
    fn drained(&self) -> bool {
        self.role.state().is_draining() && self.sq.awaited() == 0 && (self.rq.outstanding() == 0 || self.stream_closed)
    }
}

struct ListenerEntry {
    id: Option<CmId>,
    sm: Listener,
    handler: Option<Guarded<dyn ListenerHandler>>,
    close_reason: Option<CloseReason>,
    /// The reactors its connect requests are spread over (`handoff.rs`).
    spread: Option<conn::handoff::Spread>,
}

impl ListenerEntry {
    /// A listener with no id yet, its machine at the start, spreading nothing.
    fn new(handler: Box<dyn ListenerHandler>) -> ListenerEntry {
        ListenerEntry {
            id: None,
            sm: Listener::new(),
            handler: Some(Guarded::new(handler)),
            close_reason: None,
            spread: None,
        }
    }
}

struct Device {
    dev: DeviceRef,
    /// The device in libibverbs' list (`DeviceRef::identity`), to tell when it has left it.
    identity: usize,
    /// CQs of this device armed for an event: at most this many events can be pending on its
    /// channel.
    armed: u32,
    /// The device's shared CQ, in `Config::shared_cq` mode.
    shared_cq: Option<CqKey>,
    /// Removed or failed: out of the epoll set, released once nothing uses it (`device.rs`).
    lost: bool,
    /// PORT_ERR seen and no PORT_ACTIVE since: keepalive probes wait (`device.rs`).
    port_down: bool,
    /// Its transport and memory windows, asked once (`proto::transport`).
    caps: Caps,
    /// On Soft-iWARP, the CQ that keeps every later queue's mmap key clear of the one its
    /// user library refuses (`Caps::key_plug`); never armed or polled.
    _key_plug: Option<Rc<crate::sys::cq::Cq>>,
    /// On a device with tails, the connections' tail rings (`tail.rs`): one size class of
    /// ring-sized chunks, so thousands of connections share one registered cluster.
    tails: Option<Pool>,
    // Field order is drop order: the SRQ (then the buffers posted to it), the pool's regions,
    // the channel, the PD.
    /// The shared receive queue, in `Config::srq` mode (`srq.rs`).
    srq: Option<data::srq::DevSrq>,
    pool: Pool,
    chan: Rc<CompChannel>,
    pd: Rc<Pd>,
}

/// Everything a callback may touch through its context. Field order is drop order:
/// connections (queue pairs, ids) before the operations' buffers, before the CQs, before the
/// listeners, before the devices (pools, completion channels, PDs), before the CM channel.
pub(crate) struct Core {
    /// Tasks (`exec.rs`): dropped first, while everything their handles name still exists.
    exec: event_loop::exec::Exec,
    /// Ids of rejected connect requests, destroyed at the end of the tick.
    graveyard: Vec<CmId>,
    /// Connect requests chosen for other reactors, migrated once their event is acked
    /// (`handoff.rs`).
    outgoing: Vec<conn::handoff::Outgoing>,
    conns: GenSlab<ConnKey, ConnEntry>,
    ops: GenSlab<OpKey, OpEntry>,
    cqs: GenSlab<CqKey, CqEntry>,
    listeners: GenSlab<ListenerKey, ListenerEntry>,
    user_timers: GenSlab<TimerKey, UserTimer>,
    devices: Devices,
    /// Lost devices whose resources are not released yet.
    lost_devices: Vec<usize>,
    /// Released devices librdmacm has not closed yet: (identity, tries).
    forgetting: Vec<(usize, u32)>,
    /// Failed shared CQs, destroyed once no connection uses them.
    retired_cqs: Vec<CqKey>,
    /// Application fds in the epoll set (`userfd.rs`).
    user_fds: GenSlab<FdKey, UserFd>,
    /// The cross-thread handle's eventfd and message handler (`remote.rs`); marks the handle's
    /// reactor gone when dropped.
    inbox: Inbox,
    epoll: Epoll,
    cm: Rc<EventChannel>,
    cfg: Config,
    timers: Timers<TimerTarget>,
    closing: Vec<ConnKey>,
    closing_listeners: Vec<ListenerKey>,
    /// CQs to poll this tick.
    hot: data::cq::WorkList<CqKey>,
    dirty: data::cq::WorkList<ConnKey>,
    /// CQs whose un-acked events reached the ack batch (`Config::cq_ack_batch`).
    evented: data::cq::WorkList<CqKey>,
    /// CQs emptied and left unarmed: until the end of the tick (armed after its posts), or
    /// while spinning (`Config::spin`).
    spinning: data::cq::WorkList<CqKey>,
    /// The reactor spins (does not arm emptied CQs, does not sleep) until then.
    spin_until: Option<Instant>,
    /// Spinning in this tick.
    spin_on: bool,
    /// `poll_cq` arms a CQ it finds empty at once (else it leaves it in `spinning`).
    arm_now: bool,
    /// Spinning ticks since the last full one (`epoll_wait`, clock, timers).
    spin_skipped: u32,
    /// A spinning tick since the last full one did work: the spin time restarts.
    spun_work: bool,
    /// The clock as read after the last `epoll_wait` that needed it (for timers or spinning);
    /// never ahead of the true time.
    clock: Instant,
    /// The coarse clock the timers use while no deadline is near (`timers.rs`).
    coarse: event_loop::timers::CoarseClock,
    stop: bool,
    /// Set by shutdown: no new listener or connection.
    shutting_down: bool,
    /// The listener that decides connect requests handed over by other reactors
    /// (`Reactor::accept_handoffs`).
    handoff_listener: Option<ListenerKey>,
    /// The first panic of a user callback in this tick, resumed at its end.
    panic: Option<Box<dyn std::any::Any + Send>>,
    /// Agents in the accepting state (accepted, not yet established), for
    /// `Config::max_pending_accepts`.
    accepting: usize,
    /// An `SrqRefill` timer is pending: receives of a shared receive queue wait for pool
    /// buffers, which may come back with no event to wake the reactor (`srq.rs`).
    srq_refill: bool,
    /// A fault injected by a test (`fault-injection` feature): the next CQ is created with at
    /// most this many entries while its room is accounted for what was asked.
    #[cfg(feature = "fault-injection")]
    short_cq: Option<u32>,
    /// A fault injected by a test (`fault-injection` feature): the next queue pair is taken
    /// as granted at most this many receive work requests (a device granting fewer than asked).
    #[cfg(feature = "fault-injection")]
    short_rq: Option<u32>,
    /// A fault injected by a test (`fault-injection` feature): in the next send chain longer
    /// than this, the request at this index is one the device refuses.
    #[cfg(feature = "fault-injection")]
    refuse_send: Option<usize>,
    /// A fault injected by a test (`fault-injection` feature): the next connection whose
    /// farewell is answered never calls `rdma_disconnect`.
    #[cfg(feature = "fault-injection")]
    silent_parting: bool,
    stats: Stats,
}

/// The event loop. Single-threaded: it is neither `Send` nor `Sync`; other threads reach it
/// through a [`Remote`] ([`Reactor::remote`]). Another event loop can wait on its fd
/// ([`AsFd`](#impl-AsFd-for-Reactor)) and drive it with [`run_once`](Reactor::run_once).
///
/// Dropping it shuts it down ([`Reactor::shutdown`] with [`Timeouts::shutdown`]): every live
/// connection and listener hears `on_closed` with [`CloseReason::Shutdown`], every submitted
/// operation completes, then every kernel object is destroyed in order.
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

/// While spinning, one tick in this many plus one is a full one: `epoll_wait` (without
/// blocking), the clock and the timers; the others only poll and post.
const SPIN_WAIT_EVERY: u32 = 63;

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
        cfg.validate()?;
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).map_err(os("epoll_create1"))?;
        let cm = EventChannel::new().map_err(|e| match e.raw_os_error() {
            // librdmacm's answers when there is no RDMA stack or no device at all.
            Some(nix::libc::ENODEV | nix::libc::ENOENT | nix::libc::EPERM | nix::libc::ENOSYS) => {
                Error::NoDevice(format!(
                    "rdma_create_event_channel: {e}: no RDMA device, or the kernel's RDMA stack is not \
                 loaded (/dev/infiniband/rdma_cm; `rdma link` lists devices; for Soft-RoCE: \
                 modprobe rdma_rxe, then rdma link add rxe0 type rxe netdev IFACE)"
                ))
            }
            _ => Error::verb("rdma_create_event_channel", "", e),
        })?;
        let token = Token::new(Kind::CmChannel, 0, 1);
        epoll.add(&*cm, EpollEvent::new(EpollFlags::EPOLLIN, token.as_u64())).map_err(os("epoll_ctl"))?;
        let inbox = Inbox::new(&epoll, Some(cm.channel_ref()))?;
        Ok(Reactor {
            core: Core {
                exec: event_loop::exec::Exec::new(inbox.remote()),
                graveyard: Vec::new(),
                outgoing: Vec::new(),
                conns: GenSlab::new(),
                ops: GenSlab::new(),
                cqs: GenSlab::new(),
                listeners: GenSlab::new(),
                user_timers: GenSlab::new(),
                devices: Devices::default(),
                lost_devices: Vec::new(),
                forgetting: Vec::new(),
                retired_cqs: Vec::new(),
                user_fds: GenSlab::new(),
                inbox,
                epoll,
                cm,
                cfg,
                timers: Timers::new(),
                closing: Vec::new(),
                closing_listeners: Vec::new(),
                hot: data::cq::WorkList::default(),
                dirty: data::cq::WorkList::default(),
                evented: data::cq::WorkList::default(),
                spinning: data::cq::WorkList::default(),
                spin_until: None,
                spin_on: false,
                arm_now: false,
                spin_skipped: 0,
                spun_work: false,
                clock: Instant::now(),
                coarse: event_loop::timers::CoarseClock::new(),
                stop: false,
                shutting_down: false,
                handoff_listener: None,
                accepting: 0,
                srq_refill: false,
                panic: None,
                #[cfg(feature = "fault-injection")]
                short_cq: None,
                #[cfg(feature = "fault-injection")]
                short_rq: None,
                #[cfg(feature = "fault-injection")]
                refuse_send: None,
                #[cfg(feature = "fault-injection")]
                silent_parting: false,
                stats: Stats::default(),
            },
        })
    }

    /// A context for calling the command API from outside any callback.
    pub fn ctx(&mut self) -> Ctx<'_> {
        Ctx::new(&mut self.core, None)
    }

    /// Binds and listens on `addr`. See [`Ctx::listen`].
    ///
    /// # Errors
    ///
    /// As [`Ctx::listen`].
    pub fn listen(&mut self, addr: SocketAddr, handler: impl ListenerHandler + 'static) -> Result<Token> {
        self.ctx().listen(addr, handler)
    }

    /// Starts a client connection to `dst`. See [`Ctx::connect`].
    ///
    /// # Errors
    ///
    /// As [`Ctx::connect`].
    pub fn connect(
        &mut self,
        dst: SocketAddr,
        opts: ConnectOptions,
        handler: impl ConnectionHandler + 'static,
    ) -> Result<Token> {
        self.ctx().connect(dst, opts, handler)
    }

    /// Hidden and unstable, behind the `fault-injection` feature, for the fault suite only:
    /// the next CQ this reactor creates gets at most `entries` entries from the device while
    /// its room is accounted for the entries it asked for, so real traffic can overrun it
    /// and the device raise a real `IBV_EVENT_CQ_ERR` (FAULTS.md, case 23).
    #[cfg(feature = "fault-injection")]
    #[doc(hidden)]
    pub fn inject_short_cq(&mut self, entries: u32) {
        self.core.short_cq = Some(entries);
    }

    /// Hidden and unstable, behind the `fault-injection` feature, for the fault suite only:
    /// the next queue pair this reactor creates is taken as granted at most `max_recv_wr`
    /// receive work requests, as a device that grants fewer than asked would (rxe grants what
    /// is asked), while its CQ room was committed for what was asked (the hostile review's
    /// finding 9).
    #[cfg(feature = "fault-injection")]
    #[doc(hidden)]
    pub fn inject_short_rq(&mut self, max_recv_wr: u32) {
        self.core.short_rq = Some(max_recv_wr);
    }

    /// Hidden and unstable, behind the `fault-injection` feature, for the fault suite only: in
    /// the next send chain this reactor posts with more than `index` requests, the request at
    /// `index` is marked inline although it is larger than the queue pair's inline limit, so
    /// the device refuses it in `ibv_post_send` (`EINVAL` on rxe) after taking the ones before
    /// it (FAULTS.md, case 18). The message must be larger than the inline limit.
    #[cfg(feature = "fault-injection")]
    #[doc(hidden)]
    pub fn inject_refused_send(&mut self, index: usize) {
        self.core.refuse_send = Some(index);
    }

    /// Hidden and unstable, behind the `fault-injection` feature, for the fault suite only: the
    /// next connection of this reactor whose farewell its peer answers (the close handshake)
    /// skips its `rdma_disconnect` and waits in `Disconnecting`, as a peer whose kernel dropped
    /// its stream without a word looks from the other end (FAULTS.md, iWARP, "a peer that said
    /// goodbye and never disconnected").
    #[cfg(feature = "fault-injection")]
    #[doc(hidden)]
    pub fn inject_silent_parting(&mut self) {
        self.core.silent_parting = true;
    }

    /// Statistics since creation.
    pub fn stats(&self) -> Stats {
        self.core.stats()
    }

    /// Connection `token`'s counters, while it lives ([`Conn::metrics`]).
    pub fn conn_metrics(&self, token: Token) -> Option<ConnMetrics> {
        self.core.conn_metrics(token)
    }

    /// The reactor's [`Stats`] and every live connection's [`ConnMetrics`] in the Prometheus
    /// text exposition format (0.0.4), for an application to serve (the library runs no HTTP
    /// server; the `echo` and `blast` servers' `--metrics ADDR:PORT` show one way, on a socket
    /// registered with [`Ctx::register_fd`]).
    ///
    /// Families are named `rdma_reactor_<field>` after [`Stats`]' fields (counters with
    /// `_total`; the gauges `connections`, `timer_entries`, `registered_bytes`,
    /// `buffers_in_use`, `srq_receives` and `cq_peak_reserved` without) and
    /// `rdma_reactor_conn_<counter>_total` after [`ConnMetrics`]' (credit wait time in
    /// `rdma_reactor_conn_credit_wait_seconds_total`), each connection's samples labelled `conn`
    /// (its [`Token::as_u64`]) and `peer` (its peer's address). `labels` are added to every
    /// sample (for example `[("reactor", "0")]` when several reactors share one endpoint).
    pub fn prometheus(&self, labels: &[(&str, &str)]) -> String {
        self.core.prometheus(labels)
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

    /// True when nothing is left to wait for: no listener, connection, timer or registered
    /// fd ([`Ctx::register_fd`]). A [`Remote`] does not count.
    pub fn is_idle(&self) -> bool {
        self.core.is_idle()
    }

    /// Runs ticks until [`Ctx::stop`] or [`Remote::stop`] is called or the reactor is idle.
    ///
    /// # Errors
    ///
    /// As [`Reactor::run_once`].
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
    ///
    /// # Panics
    ///
    /// Resumes the first panic a callback raised during the tick, once the tick has finished
    /// (see "Panics in callbacks" in `ARCHITECTURE.md`): the reactor stays usable.
    pub fn run_once(&mut self, timeout: Option<Duration>) -> Result<usize> {
        let r = self.core.tick(timeout);
        self.core.keep_drop_panic();
        if let Some(panic) = self.core.panic.take() {
            resume_unwind(panic);
        }
        r
    }

    /// Closes everything, keeping the callback contract: every listener hears
    /// [`on_closed`](ListenerHandler::on_closed) with [`CloseReason::Shutdown`]; every live
    /// connection is disconnected, and the loop runs for up to `grace` so connections close
    /// cleanly; those still open then are closed at once. Every submitted operation completes
    /// (flushed by the device, or [`OpError::Cancelled`](crate::OpError::Cancelled) if it was
    /// never posted, with its buffer), and each connection hears
    /// [`on_closed`](ConnectionHandler::on_closed) once (with `Shutdown` unless it was already
    /// closing for another reason). Callbacks cannot start new listeners or connections
    /// meanwhile.
    ///
    /// Registered fds are deregistered (their handlers dropped without a call). Afterwards the
    /// reactor is idle and can be used again.
    ///
    /// # Panics
    ///
    /// Resumes the first panic a callback raised meanwhile, once everything is closed.
    pub fn shutdown(&mut self, grace: Duration) {
        self.core.shutdown(grace);
        self.core.deregister_all_fds();
        self.core.keep_drop_panic();
        if let Some(panic) = self.core.panic.take() {
            resume_unwind(panic);
        }
    }
}

impl Drop for Reactor {
    fn drop(&mut self) {
        // Shut down (every connection and listener closed and told, every operation
        // completed); the devices, CQs and the CM channel are then destroyed by Core's field
        // order (see Core).
        let grace = self.core.cfg.timeouts.shutdown;
        self.core.shutdown(grace);
        // A callback's panic during the shutdown of a dropped reactor has nowhere to go
        // (resuming it here could abort the process): it is discarded.
        self.core.keep_drop_panic();
        self.core.panic = None;
    }
}

impl Core {
    fn stats(&self) -> Stats {
        let registered = self
            .devices
            .iter()
            .map(|d| (d.pool.registered_bytes() + d.tails.as_ref().map_or(0, Pool::registered_bytes)) as u64)
            .sum();
        let srq_receives = self.devices.iter().filter_map(|d| d.srq.as_ref()).map(|s| s.posted() as u64).sum();
        let srq_free = self.devices.iter().filter_map(|d| d.srq.as_ref()).map(|s| u64::from(s.budget.free())).sum();
        let buffers_in_use = self.devices.iter().map(|d| d.pool.in_use() as u64).sum();
        Stats {
            registered_bytes: registered,
            buffers_in_use,
            connections: self.conns.len() as u64,
            srq_receives,
            srq_free,
            timer_entries: self.timers.len() as u64,
            ..self.stats
        }
    }

    fn is_idle(&self) -> bool {
        self.listeners.len() == 0 && self.conns.len() == 0 && self.user_timers.len() == 0 && self.user_fds.len() == 0
    }

    fn tick(&mut self, timeout: Option<Duration>) -> Result<usize> {
        let _inside = event_loop::exec::Inside::enter();
        if self.spin_on && self.spin_skipped < SPIN_WAIT_EVERY {
            return Ok(self.spin_tick());
        }
        self.spin_skipped = 0;
        let spin_cfg = !self.cfg.spin.is_zero();
        let timed = self.timers.next_deadline().is_some();
        let clocked = spin_cfg || timed;
        let (now, precise) = self.tick_clock(spin_cfg, timed);
        if std::mem::take(&mut self.spun_work) {
            self.spin_until = now.checked_add(self.cfg.spin);
        }
        let spin = spin_cfg && self.spin_until.is_some_and(|until| now < until);
        let mut work = 0;
        if !self.spinning.is_empty() {
            // Spinning: poll the unarmed CQs. Spin time over: arm them (and poll once more)
            // before sleeping.
            work += self.poll_spinning(spin);
        }
        self.spin_on = spin;
        let busy = spin
            || work > 0
            || !self.hot.is_empty()
            || !self.dirty.is_empty()
            || !self.closing.is_empty()
            || !self.closing_listeners.is_empty()
            || self.exec.has_work();
        let mut wait = if busy { Some(Duration::ZERO) } else { timeout };
        if let Some(t) = self.timer_wait(now, precise) {
            wait = Some(wait.map_or(t, |w| w.min(t)));
        }
        let epoll_timeout = match wait {
            None => EpollTimeout::NONE,
            Some(d) => {
                // Round up so a deadline 0.3 ms (or 0.3 µs) away does not spin.
                let ms = d.as_nanos().div_ceil(1_000_000).min(i32::MAX as u128) as u32;
                EpollTimeout::try_from(ms).unwrap_or(EpollTimeout::MAX)
            }
        };
        let mut events = [EpollEvent::empty(); 32];
        let n = match self.epoll.wait(&mut events, epoll_timeout) {
            Ok(n) => n,
            // A signal (epoll_wait is never restarted, SA_RESTART or not): no readiness; the
            // tick goes on as after a timeout.
            Err(Errno::EINTR) => {
                self.stats.interrupted_waits += 1;
                0
            }
            Err(e) => return Err(os("epoll_wait")(e)),
        };
        self.stats.wakeups += 1;
        if clocked && wait != Some(Duration::ZERO) {
            // The wait may have blocked: the time again, as before it.
            self.tick_clock(spin_cfg, timed);
        }
        for ev in &events[..n] {
            match Token::from_u64(ev.data()) {
                Some(t) if t.kind() == Kind::CmChannel => work += self.drain_cm()?,
                Some(t) if t.kind() == Kind::CompChannel => {
                    if ev.events().intersects(EpollFlags::EPOLLERR | EpollFlags::EPOLLHUP) {
                        // A disassociated device: its channel reports an error on every wait.
                        self.device_lost(t.index() as usize, CloseReason::DeviceRemoval);
                        work += 1;
                    } else {
                        work += self.drain_comp(t.index() as usize);
                    }
                }
                Some(t) if t.kind() == Kind::Device => work += self.drain_async(t.index() as usize),
                Some(t) if t.kind() == Kind::UserFd => work += self.dispatch_fd(t, ev.events()),
                Some(t) if t.kind() == Kind::Remote => work += self.drain_remote(),
                _ => {}
            }
        }
        work += self.poll_hot();
        work += self.fire_timers(self.clock);
        work += self.run_tasks();
        self.flush_posts();
        if !spin && !self.spinning.is_empty() {
            // Arm what the tick emptied only after its posts: a send that completes at once
            // (its ACK came back while it was posted) is reaped now, not after another wakeup.
            work += self.poll_spinning(false);
            self.flush_posts();
        }
        self.flush_acks();
        work += self.reap();
        self.compact_timers();
        self.inbox.publish_load(self.conns.len());
        if n > 0 && work == 0 {
            self.stats.spurious_wakeups += 1;
        }
        if work > 0 && spin_cfg {
            self.spin_until = self.clock.checked_add(self.cfg.spin);
        }
        Ok(work)
    }

    /// The time for a full tick, and whether it is the precise clock. The precise clock can be
    /// a system call (an emulated HPET in the test VM): it is read only when the spin time
    /// needs it, or a deadline is within the coarse clock's margin (`Core::timer_clock`);
    /// otherwise the timers make do with the coarse clock (vDSO), and without timers or
    /// spinning the clock is not read at all.
    fn tick_clock(&mut self, spinning: bool, timed: bool) -> (Instant, bool) {
        if spinning {
            (self.read_clock(), true)
        } else if timed {
            self.timer_clock()
        } else {
            (self.clock, true)
        }
    }

    /// A tick while spinning between two full ones: poll the unarmed and hot CQs, post, ack and
    /// destroy; no `epoll_wait`, no clock, no timers (the next full tick, at most
    /// `SPIN_WAIT_EVERY` ticks away, does those).
    ///
    /// Lean: when only completions are pending it polls, dispatches and posts, as perftest's
    /// loop does; each other step returns at once when its list is empty.
    fn spin_tick(&mut self) -> usize {
        self.spin_skipped += 1;
        let mut work = self.poll_spinning(true);
        work += self.poll_hot();
        if self.exec.has_work() {
            work += self.run_tasks();
        }
        self.flush_posts();
        self.flush_acks();
        work += self.reap();
        self.spun_work |= work > 0;
        work
    }

    // ----- handler calls --------------------------------------------------------------------

    /// Calls a connection's handler with a context. The handler is taken out of its entry for
    /// the call, so the context can reach every other object mutably.
    ///
    /// A panic in the handler is resumed after the handler is back in its entry, so the
    /// connection keeps its handler (see "Panics in callbacks" in the module docs).
    fn with_conn(&mut self, t: ConnKey, f: impl FnOnce(&mut dyn ConnectionHandler, &mut Conn<'_>)) {
        let Some(mut h) = self.conns.get_mut(t).and_then(|c| c.handler.take()) else { return };
        let r = catch_unwind(AssertUnwindSafe(|| {
            let mut conn = Conn::new(self, t);
            f(&mut *h, &mut conn);
        }));
        if let Some(c) = self.conns.get_mut(t) {
            c.handler = Some(h);
        }
        self.caught(r);
    }

    fn with_listener(&mut self, t: ListenerKey, f: impl FnOnce(&mut dyn ListenerHandler, &mut Ctx<'_>)) {
        let Some(mut h) = self.listeners.get_mut(t).and_then(|l| l.handler.take()) else { return };
        let r = catch_unwind(AssertUnwindSafe(|| {
            let mut ctx = Ctx::new(self, Some(t.token()));
            f(&mut *h, &mut ctx);
        }));
        if let Some(l) = self.listeners.get_mut(t) {
            l.handler = Some(h);
        }
        self.caught(r);
    }

    /// Calls a callback outside any entry (a destroyed object's handler, a user function),
    /// catching its panic for the end of the tick.
    fn deliver(&mut self, f: impl FnOnce(&mut Core)) {
        let r = catch_unwind(AssertUnwindSafe(|| f(self)));
        self.caught(r);
    }

    /// Keeps the first panic of the tick; it resumes at the end of `run_once`.
    fn caught(&mut self, r: std::thread::Result<()>) {
        if let Err(panic) = r {
            self.panic.get_or_insert(panic);
        }
    }

    /// Adds a panic a handler's `Drop` raised during the tick (caught by [`Guarded`]) to the
    /// tick's panics.
    fn keep_drop_panic(&mut self) {
        // The flag first: a plain thread-local load on every tick, the slot only after a drop
        // panicked.
        if !DROP_PANICKED.try_with(|f| f.replace(false)).unwrap_or(false) {
            return;
        }
        // try_with: a reactor dropped by a thread-local's destructor may run after this
        // thread-local was destroyed; `with` would panic there, and a panic in a thread-local's
        // destructor aborts the process.
        if let Some(panic) = DROP_PANIC.try_with(|p| p.borrow_mut().take()).ok().flatten() {
            self.panic.get_or_insert(panic);
        }
    }
}

thread_local! {
    /// The first panic a user handler's `Drop` raised on this thread ([`Guarded`]), until the
    /// reactor ticking here takes it at the end of its tick.
    static DROP_PANIC: std::cell::RefCell<Option<Box<dyn std::any::Any + Send>>> = const { std::cell::RefCell::new(None) };
    /// `DROP_PANIC` holds a panic: set with it, cleared by the tick that takes it.
    static DROP_PANICKED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A user handler, boxed, whose `Drop` runs under a panic guard: a panic in it is caught and
/// resumed at the end of the tick like a callback's, so it cannot unwind out of the reactor's
/// bookkeeping (a reap that stopped half way would leave the rest of the closing connections
/// without `on_closed` or destruction until shutdown: the hostile review's finding 8). Every
/// connection and listener handler is held in one, wherever it is dropped.
pub(crate) struct Guarded<T: ?Sized>(Option<Box<T>>);

impl<T: ?Sized> Guarded<T> {
    fn new(handler: Box<T>) -> Guarded<T> {
        Guarded(Some(handler))
    }
}

impl<T: ?Sized> std::ops::Deref for Guarded<T> {
    type Target = T;

    fn deref(&self) -> &T {
        self.0.as_deref().expect("present until dropped")
    }
}

impl<T: ?Sized> std::ops::DerefMut for Guarded<T> {
    fn deref_mut(&mut self) -> &mut T {
        self.0.as_deref_mut().expect("present until dropped")
    }
}

impl<T: ?Sized> Drop for Guarded<T> {
    fn drop(&mut self) {
        if let Some(handler) = self.0.take() {
            if let Err(panic) = catch_unwind(AssertUnwindSafe(move || drop(handler))) {
                // Past the thread-local's destruction (a reactor in a thread-local being
                // dropped), the panic has nowhere to go and is discarded.
                let _ = DROP_PANIC.try_with(|p| {
                    p.borrow_mut().get_or_insert(panic);
                });
                let _ = DROP_PANICKED.try_with(|f| f.set(true));
            }
        }
    }
}
