//! The reactor: one thread, one epoll, the shared rdma_cm event channel and one completion
//! channel per device, dispatching to the listener/agent/client state machines and to user
//! callbacks.
//!
//! This file holds [`Reactor`] (the public type) and `Core` (everything a callback may touch
//! through its context, and the order it is dropped in). The rest is in four folders, each
//! with a module doc saying what it owns and which invariants live there:
//!
//! - `api/`: the callback API: handlers, contexts, configuration, statistics, and the callback
//!   boundary (`api/guard.rs`: "Panics in callbacks").
//! - `conn/`: connection lifecycle: the entries, CM dispatch and setup, driving the state
//!   machines, teardown, hand-off between reactors, reconnection.
//! - `data/`: the data path: operations, the send queue, posting, the CQ protocol and room,
//!   shared receive queues, tails, exposure.
//! - `event_loop/`: the tick (`event_loop/tick.rs`: its steps, in order), timers, application fds, the
//!   cross-thread handle, embedding, devices, the executor.
//!
//! Commands called from callbacks run at once (`connect`, `listen`, `alloc`, a close's
//! `rdma_disconnect`); only posting (step 6 of the tick) and destruction (step 8) wait for the
//! end of the tick.

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
    pub(crate) use super::data::gate::Gate;
    pub use super::data::lanes::Done;
    pub(crate) use super::data::lanes::{Lanes, RecvOutcome, Slot};
    pub(crate) use super::data::op::OpEntry;
    pub(crate) use super::data::post::queue_shape;

    /// The work request of a queued receive (`post::recv_wr`).
    #[inline]
    pub(crate) fn recv_wr(k: crate::proto::token::OpKey, op: &OpEntry) -> crate::sys::qp::RecvWr {
        super::data::post::recv_wr(k, op)
    }
    pub(crate) use super::data::send_queue::{Plan, RecvQueue, SendQueue};

    /// The work request of a planned send (`post::send_wr`), on a transport with immediate
    /// data.
    pub(crate) fn send_wr(
        op: &OpEntry,
        w: &super::data::send_queue::Planned,
        max_inline: u32,
    ) -> crate::sys::qp::SendWr {
        super::data::post::send_wr(op, w, max_inline, None)
    }
}
pub use api::ctx::{Conn, Ctx, SubmitError};
pub use api::handler::{ConnectRequest, ConnectionHandler, Decision, ListenerHandler};
pub use api::stats::Stats;
pub use conn::handoff::Balance;
pub use data::op::{Completion, Op, RawBuf};
pub use event_loop::exec::{spawn, stats, JoinHandle};
pub(crate) use event_loop::exec::{with_ctx, with_ctx_of, ExecId, Orphans};
pub use event_loop::remote::{ReactorGone, Remote};
pub use event_loop::userfd::{FdEvent, FdHandler, Interest, Readiness};

use std::net::SocketAddr;
use std::panic::resume_unwind;
use std::rc::Rc;
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags};

use crate::error::{Error, Result};
use crate::proto::metrics::ConnMetrics;
use crate::proto::token::{ConnKey, CqKey, FdKey, GenSlab, Kind, ListenerKey, TimerKey, Token};
use crate::sys::cm::EventChannel;
use conn::entry::{ConnEntry, Endpoint, ListenerEntry, Placement, Role};
use conn::handoff::Handoff;
use conn::teardown::Closing;
use data::cq::{CqEntry, WorkLists};
use data::tail::TailRing;
use event_loop::device::Devices;
use event_loop::remote::Inbox;
use event_loop::tick::Spin;
use event_loop::timers::{Clock, TimerTarget, Timers, UserTimer};
use event_loop::userfd::UserFd;

/// Everything a callback may touch through its context. Field order is drop order:
/// connections (queue pairs, ids, then their operations' buffers in their lanes) before the CQs, before the
/// listeners, before the devices (pools, completion channels, PDs), before the CM channel.
pub(crate) struct Core {
    /// Tasks (`event_loop/exec.rs`): dropped first, while everything their handles name still exists.
    exec: event_loop::exec::Exec,
    /// What closed and waits for the end of the tick to be destroyed (`conn/teardown.rs`).
    closing: Closing,
    /// Connect requests handed to and from other reactors (`conn/handoff.rs`).
    handoff: Handoff,
    /// Connect requests waiting for room among the pending accepts (`conn/waiting.rs`); their
    /// ids go before the event channel.
    waiting: conn::waiting::WaitingRequests,
    /// `rdma_connect` calls on helper threads, and connects waiting for one (`conn/connect.rs`).
    calls: conn::connect::ConnectCalls,
    /// A connection whose call still runs joins its helper when dropped, before its queue pair.
    conns: GenSlab<ConnKey, ConnEntry>,
    /// The queue-pair epoch of each connection slot index (issue 47): bumped each time the
    /// connection at that index gets a queue pair (a new connection, a reconnection), so a
    /// ring `wr_id` of an earlier queue pair at the same index, whoever holds it now, never
    /// names an operation of the present one (`data/cq/mod.rs`, `Core::complete`).
    epochs: Vec<u16>,
    cqs: GenSlab<CqKey, CqEntry>,
    listeners: GenSlab<ListenerKey, ListenerEntry>,
    user_timers: GenSlab<TimerKey, UserTimer>,
    devices: Devices,
    /// Application fds in the epoll set (`event_loop/userfd.rs`).
    user_fds: GenSlab<FdKey, UserFd>,
    /// The cross-thread handle's eventfd and message handler (`event_loop/remote.rs`); marks the handle's
    /// reactor gone when dropped.
    inbox: Inbox,
    epoll: Epoll,
    cm: Rc<EventChannel>,
    cfg: Config,
    timers: Timers<TimerTarget>,
    /// What the tick has to poll, post and ack (`data/cq/mod.rs`).
    work: WorkLists,
    /// The raw chains a shared receive queue's post hands the device (`data/srq/mod.rs`),
    /// reused.
    chains: crate::sys::qp::Chains,
    /// `epoll_wait`'s readiness list, reused: not filled with empty entries every tick
    /// (`event_loop/tick.rs`).
    events: [nix::sys::epoll::EpollEvent; event_loop::tick::EVENTS],
    /// Spinning (`Config::spin`): the tick's state (`event_loop/tick.rs`).
    spin: Spin,
    /// The time as the tick last read it (`event_loop/timers.rs`).
    clock: Clock,
    stop: bool,
    /// Set by shutdown: no new listener or connection.
    shutting_down: bool,
    /// The first panic of a user callback in this tick, resumed at its end.
    panic: Option<Box<dyn std::any::Any + Send>>,
    /// The connections whose handler is running, innermost last, and the handlers of those
    /// destroyed meanwhile (`api/guard.rs`, `Core::call_conn`): a callback of one of them is
    /// not called inside its own.
    handlers_running: api::guard::Running,
    /// Agents in the accepting state (accepted, not yet established), for
    /// `Config::max_pending_accepts`.
    accepting: usize,
    /// An `SrqRefill` timer is pending: receives of a shared receive queue wait for pool
    /// buffers, which may come back with no event to wake the reactor (`data/srq/mod.rs`).
    srq_refill: bool,
    /// The wait of the next `SrqRefill` timer (`data/srq/mod.rs`, `schedule_srq_retry`).
    srq_retry_wait: std::time::Duration,
    /// The `SrqRefill` timer fired: the next posting looks at the connections whose receives
    /// are withheld for memory.
    srq_release_due: bool,
    /// The shared receive queue's receive a message being delivered consumed, on its way to
    /// the device's re-post queue after the handler returns, unless the handler withholds it
    /// (`Conn::withhold_receive`): the connection, its device, the re-post.
    srq_delivering: Option<(ConnKey, usize, data::srq::Repost)>,
    /// Bytes reserved by the connections accepted from each peer address
    /// (`PoolConfig::per_address_bytes`; `conn/setup.rs`, `Core::reserve`): an entry only
    /// while one of them lives.
    addr_reserved: std::collections::HashMap<std::net::IpAddr, usize>,
    /// The penalty box (`Config::violation_backoff`, `proto/penalty.rs`): addresses whose
    /// accepted connections broke the protocol, refused by `Core::decide` for a while.
    penalties: crate::proto::penalty::PenaltyBox,
    /// Faults a test injected (`fault-injection` feature, `api/faults.rs`).
    #[cfg(feature = "fault-injection")]
    faults: api::faults::Faults,
    stats: Stats,
}

/// The event loop. Single-threaded: it is neither `Send` nor `Sync`; other threads reach it
/// through a [`Remote`] ([`Reactor::remote`]). Another event loop can wait on its fd
/// ([`AsFd`](#impl-AsFd-for-Reactor)) and drive it with [`run_once`](Reactor::run_once).
///
/// Dropping it shuts it down ([`Reactor::shutdown`] with [`Timeouts::shutdown`]): every live
/// connection and listener hears `on_closed` with [`CloseReason::Shutdown`](crate::CloseReason::Shutdown), every submitted
/// operation completes, then every kernel object is destroyed in order (after any iWARP
/// `rdma_connect` still running on its helper thread has returned: see `shutdown`).
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
                closing: Closing::default(),
                handoff: Handoff::default(),
                waiting: Default::default(),
                calls: Default::default(),
                conns: GenSlab::new(),
                epochs: Vec::new(),
                cqs: GenSlab::new(),
                listeners: GenSlab::new(),
                user_timers: GenSlab::new(),
                devices: Devices::default(),
                user_fds: GenSlab::new(),
                inbox,
                epoll,
                cm,
                cfg,
                timers: Timers::new(),
                work: WorkLists::default(),
                chains: crate::sys::qp::Chains::default(),
                events: [nix::sys::epoll::EpollEvent::empty(); event_loop::tick::EVENTS],
                spin: Spin::default(),
                clock: Clock::new(),
                stop: false,
                shutting_down: false,
                accepting: 0,
                srq_refill: false,
                srq_retry_wait: std::time::Duration::ZERO,
                srq_release_due: false,
                srq_delivering: None,
                addr_reserved: std::collections::HashMap::new(),
                penalties: Default::default(),
                panic: None,
                handlers_running: api::guard::Running::default(),
                #[cfg(feature = "fault-injection")]
                faults: api::faults::Faults::default(),
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
    /// server; the `echo` and `blast` servers' `--metrics [ADDR:]PORT --metrics-conns` show one
    /// way, on a socket registered with [`Ctx::register_fd`]).
    ///
    /// Families are named `rdma_reactor_<field>` after [`Stats`]' fields (counters with
    /// `_total`; the gauges `connections`, `timer_entries`, `registered_bytes`,
    /// `buffers_in_use`, `srq_receives` and `cq_peak_reserved` without) and
    /// `rdma_reactor_conn_<counter>_total` after [`ConnMetrics`]' (credit wait time in
    /// `rdma_reactor_conn_credit_wait_seconds_total`), each connection's samples labelled `conn`
    /// (its [`Token::as_u64`]) and `peer` (its peer's address). `labels` are added to every
    /// sample (for example `[("reactor", "0")]` when several reactors share one endpoint).
    ///
    /// The text grows with the connections (13 samples each) and names every peer: for an
    /// endpoint others can reach, or a reactor of many connections,
    /// [`prometheus_totals`](Self::prometheus_totals) is the part that does neither.
    pub fn prometheus(&self, labels: &[(&str, &str)]) -> String {
        self.core.prometheus(labels)
    }

    /// The reactor's [`Stats`] alone in the Prometheus text exposition format (0.0.4): the
    /// families of [`prometheus`](Self::prometheus) named after [`Stats`]' fields, one sample
    /// each, labelled `labels`.
    ///
    /// It leaves out every connection's [`ConnMetrics`] series. Those are 13 families with a
    /// sample per live connection, each labelled with the connection's token and its peer's
    /// address: at 10 000 connections a scrape of [`prometheus`](Self::prometheus) builds
    /// about 14 MB on the reactor's thread, and it tells whoever can read the endpoint every
    /// client's address. This text is the same size however many connections there are and
    /// names no peer, which is what an endpoint open to more than its operator should serve
    /// (the `echo` and `blast` servers' `--metrics` serve it unless given `--metrics-conns`).
    pub fn prometheus_totals(&self, labels: &[(&str, &str)]) -> String {
        self.core.prometheus_totals(labels)
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
        self.resume_panic();
        r
    }

    /// Resumes the first panic a callback (or a handler's `Drop`) raised since the last call:
    /// after a tick, a shutdown, or `block_on`'s post-and-arm step.
    pub(in crate::reactor) fn resume_panic(&mut self) {
        self.core.keep_drop_panic();
        if let Some(panic) = self.core.panic.take() {
            resume_unwind(panic);
        }
    }

    /// Closes everything, keeping the callback contract: every listener hears
    /// [`on_closed`](ListenerHandler::on_closed) with [`CloseReason::Shutdown`](crate::CloseReason::Shutdown); every live
    /// connection is disconnected, and the loop runs for up to `grace` so connections close
    /// cleanly; those still open then are closed at once, except that an iWARP `rdma_connect`
    /// still running on its helper thread is waited for first (it blocks in the kernel until
    /// TCP connects or gives up: about 2 minutes against a host that drops SYNs; nothing ends it
    /// early safely). Every submitted operation completes
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
        self.resume_panic();
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
