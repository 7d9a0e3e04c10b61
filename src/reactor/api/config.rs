//! Configuration: the reactor's ([`Config`], [`Timeouts`]) and one client connection's
//! ([`ConnectOptions`]).

use std::net::SocketAddr;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::proto::conn::Step;
use crate::proto::flow::MIN_DEPTH;
use crate::proto::reconnect::Reconnect;
use crate::proto::{MAX_DURATION, MAX_DURATION_TEXT};
use crate::sys::pool::PoolConfig;

/// Deadlines of the connection-manager steps, and of shutdown. Each is at most 365 days
/// ([`Reactor::with_config`](crate::Reactor::with_config) refuses a longer one with
/// [`Error::Config`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// `rdma_resolve_addr` (also passed to the kernel). Default 5 s.
    pub resolve_addr: Duration,
    /// `rdma_resolve_route` (also passed to the kernel). Default 5 s.
    pub resolve_route: Duration,
    /// From `rdma_connect` (its queue pair made; on iWARP, the call handed to a helper thread or
    /// queued for one, `Stats::connects_queued`) to ESTABLISHED. Default 20 s. When it passes
    /// while an iWARP call still runs, the connection closes with `Timeout(Connect)` once the
    /// call has returned (the kernel's TCP connect cannot be cut short safely).
    pub connect: Duration,
    /// From `rdma_accept` to ESTABLISHED. Default 20 s.
    pub accept: Duration,
    /// From our `rdma_disconnect` to DISCONNECTED. Default 15 s: on RoCE and InfiniBand the
    /// kernel's CM retransmits a DREQ that got no answer, but only while the id lives: with
    /// rdma_cm's RoCE settings on Linux 6.1 every 6.1 s from the connecting side (twice the
    /// path's packet lifetime, 1 s, plus the CM response timeout, 4 s; 6.2-6.4 s measured by
    /// the two-VM case `dreq-lost`) and every 4.1 s from the accepting side (the response
    /// timeout). The default outlasts two retransmissions. A shorter wait (it was 5 s) gives
    /// up before the first, destroys the id, and a single lost DREQ leaves the peer holding the
    /// connection, never told (with no [`Config::keepalive`], for as long as it sends
    /// nothing). The price: a connection whose peer is gone or cut off, or whose peer's
    /// process does not disconnect (stopped, or not ticking its reactor: its kernel answers
    /// our DREQ only then), waits this long before `on_closed` (and a reconnecting client
    /// before its next attempt). A disconnect that times out is counted
    /// (`Stats::disconnects_unanswered`).
    pub disconnect: Duration,
    /// From DISCONNECTED until every outstanding work request has completed. Default 5 s.
    pub drain: Duration,
    /// How long a closing connection that uses the close handshake (iWARP under flow control,
    /// both sides this crate: [`State::Finishing`](crate::State::Finishing)) waits for the
    /// peer to answer its farewell before it disconnects anyway. Default 2 s.
    pub finish: Duration,
    /// How long dropping the [`Reactor`](crate::Reactor) lets connections close cleanly before
    /// it closes the rest at once (see [`Reactor::shutdown`](crate::Reactor::shutdown)), after
    /// waiting for any iWARP `rdma_connect` still running on a helper thread. Default 2 s,
    /// shorter than one DREQ retransmission ([`disconnect`](Timeouts::disconnect)): a
    /// connection whose disconnect was lost is destroyed then and its peer never told
    /// (counted in `Stats::disconnects_unanswered`). An application that must have its peers
    /// told closes its connections and waits for `on_closed`, or passes a longer grace to
    /// `Reactor::shutdown`.
    pub shutdown: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            resolve_addr: Duration::from_secs(5),
            resolve_route: Duration::from_secs(5),
            connect: Duration::from_secs(20),
            accept: Duration::from_secs(20),
            disconnect: Duration::from_secs(15),
            drain: Duration::from_secs(5),
            finish: Duration::from_secs(2),
            shutdown: Duration::from_secs(2),
        }
    }
}

impl Timeouts {
    pub(crate) fn of(&self, step: Step) -> Duration {
        match step {
            Step::ResolveAddr => self.resolve_addr,
            Step::ResolveRoute => self.resolve_route,
            Step::Connect => self.connect,
            Step::Accept => self.accept,
            Step::Disconnect => self.disconnect,
            Step::Drain => self.drain,
            Step::Finish => self.finish,
        }
    }
}

/// A shared receive queue per device ([`Config::srq`]): the runtime keeps `receives` buffers
/// of `buf_size` bytes posted on it for every connection of the reactor on that device, so the
/// registered receive memory does not grow with the number of connections. The device's pool
/// gets a size class of exactly `buf_size` when that is below its smallest (a receive then pins
/// `buf_size` bytes, not a larger chunk).
///
/// **The defaults** serve many mostly idle connections with small messages (requests,
/// replies, control; bulk data goes by RDMA WRITE or READ, or on connections of a reactor
/// without an SRQ): 31 232 receives of 1 KiB, a credit of 3 growing to 32 while busy, a
/// reserve of 976: 10 085 connections per device, in 32 MiB registered when the queue is
/// created (eight 4 MiB clusters of 1 KiB chunks; the 1 536 chunks the receives leave hold
/// messages handed to handlers, each replaced on the queue at once, so a burst of that many
/// in flight registers nothing more). Messages are then at most 1 KiB on every connection of
/// the reactor; a larger `buf_size` admits `(receives - reserve) / credit` connections all
/// the same, at `receives × buf_size` of memory.
///
/// **The credit rule.** Every receive is granted to at most one connection: each connection
/// has a share of the queue, and its peer's grants never exceed it, so a peer that keeps to its
/// credit never finds the queue empty (no receiver-not-ready NAK). A connection starts with a
/// share of `credit`, which it tells its peer as its receive depth; each receive its peer's
/// message consumed is granted back once posted again. **Credit follows activity:** while a
/// connection is busy (its peer has used most of its grants, and sent at least a share's
/// worth of data messages since it last grew: a handshake grows nothing; credit-only messages
/// never count) each receive posted again for it comes back with one more from the receives
/// no connection holds, up to `max_credit`, as long as more than an eighth of the queue stays
/// free for connections yet to come and the shares together hold at most a thirty-second of
/// the queue beyond their bases (or one connection's growth to `max_credit`, if more); a
/// connection whose peer leaves half its grants unused gives one back each time its peer
/// sends, down to `credit` (as does every grown one while fewer than an eighth are free, and
/// one whose peer sent no data while the queue took `receives` data messages of others). A
/// connection is admitted while the free receives cover its `credit`: at most `(receives -
/// reserve) / credit` per device, all of them at their base. One beyond is refused with
/// [`RejectCode::NoResources`](crate::RejectCode::NoResources) (a listener's `on_refused`),
/// or its connect fails (a client) with [`Error::Limit`] naming these settings. A peer that
/// went idle after being busy keeps its grown share until it sends again: grants cannot be
/// taken back, only not renewed. The cap on growth bounds what such peers hold together, so
/// at least `(receives - reserve - cap) / credit` connections are admitted however the peers
/// behave, `cap` being `max(receives / 32, max_credit - credit)` (9 760 at the defaults). The
/// receives and their memory are fixed when the queue is created, whatever the number of
/// connections. **A peer may so hold up to `max_credit`
/// grants, more than the depth the connect information advertised:** a protocol that gives
/// its peer one slot of application memory per credit (RDMA WRITE with immediate data into a
/// ring, as `blast --op write` does) sizes the ring for `max_credit`.
///
/// **Flow control is required** on the SRQ: without it nothing stops one peer from consuming
/// every receive of the queue, which starves every other connection on it. A connect request
/// whose connect information does not offer flow control (or sends none) is refused with
/// [`RejectCode::Unsupported`](crate::RejectCode::Unsupported); a client whose server does not
/// agree to it is closed before `on_established` ([`CloseReason::Setup`](crate::CloseReason::Setup));
/// and [`Config::flow_control`] must be on.
///
/// **A peer that breaks its credit** is closed ([`CloseReason::Protocol`](crate::CloseReason::Protocol),
/// [`Stats::srq_overdrawn`](crate::Stats::srq_overdrawn)) as soon as its first message beyond
/// the credit is polled. The messages it sent before that consumed receives all the same (the
/// device takes a receive from the SRQ for any queue pair on it before software can look):
/// `reserve` receives are kept posted beyond everything granted so that such an overdraw,
/// up to `reserve` messages, takes none of the receives promised to other connections. A
/// larger burst landing before the reactor polls (a reactor busy elsewhere) can still empty
/// the queue: the other peers then see receiver-not-ready NAKs, which they survive with
/// retries left ([`Config::rnr_retry_count`]).
///
/// On a connection of the SRQ the handler posts no receives ([`Conn::submit`](crate::Conn::submit)
/// refuses them, [`Conn::recv_capacity`](crate::Conn::recv_capacity) is 0): messages arrive as
/// [`OpCode::Recv`](crate::OpCode::Recv) completions with user_data
/// [`Completion::SRQ_RECV`](crate::Completion::SRQ_RECV), each carrying its buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SrqConfig {
    /// Receives kept posted on the SRQ (also its size, and the size of the CQ all its receive
    /// completions go to, so at most the device's `max_cqe`: 32 767 on Soft-RoCE; see
    /// `ibv_devinfo -v`).
    pub receives: u32,
    /// Bytes of each receive buffer: the largest message a connection on the SRQ takes (it is
    /// the message size its connect information states). At most the pool's largest chunk.
    pub buf_size: u32,
    /// The receive depth each connection advertises and the credit its peer starts with: its
    /// share of the queue when admitted, and the least it keeps (at least 3, the flow-control
    /// minimum).
    pub credit: u32,
    /// The most a busy connection's share grows to (see the type's docs); `credit` or less:
    /// shares never grow.
    pub max_credit: u32,
    /// Low-water mark: the SRQ raises its limit event when fewer receives than this are left
    /// posted (a backstop: the runtime refills it every tick); the limit is armed again only
    /// once a refill brought the SRQ back to the mark, so one dip raises one event. Zero: not
    /// armed.
    pub low_water: u32,
    /// Receives kept posted beyond the credits granted to every connection, which a peer that
    /// breaks its credit consumes before it is closed, instead of receives promised to others
    /// (see the type's docs). At most `receives - credit`.
    pub reserve: u32,
}

impl Default for SrqConfig {
    /// 31 232 receives of 1 KiB, a credit of 3 growing to 32 while busy, a low-water mark of
    /// 7 808 (a quarter) and a reserve of 976 (a thirty-second): 10 085 connections per device,
    /// in 32 MiB registered (see the type's docs). The receives are within Soft-RoCE's CQ limit
    /// (32 767), which the SRQ's receive CQ is sized by.
    fn default() -> Self {
        SrqConfig { receives: 31_232, buf_size: 1024, credit: 3, max_credit: 32, low_water: 7_808, reserve: 976 }
    }
}

/// Reactor configuration. `Config::default()` suits most uses; each field says its default.
/// Every duration in it is at most 365 days: [`Reactor::with_config`](crate::Reactor::with_config)
/// refuses a longer one with [`Error::Config`] naming the field.
///
/// **What peers can make the reactor hold.** Per connection, the fields below bound its
/// receives (`recv_depth`, `msg_size`, `recv_budget`), its queued sends (`send_backlog`,
/// `send_backlog_bytes`), its peer's credit (`flow_control`, enforced) and how long its sends
/// wait for credits (`credit_timeout`). In total, its device's pool gives each admitted
/// connection a reservation no other can take and lends the rest within limits per
/// connection, per peer address and for all: [`PoolConfig`]'s docs, "Who may hold what",
/// state the guarantee and its defaults (one connection: its reservation and at most 64 MiB
/// more; one address: 128 MiB of reservations and the 256 MiB shared remainder; all
/// connections: 768 MiB of the 1 GiB pool).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// The registered buffer pool of each device (chunk size = largest pool message).
    /// Default: [`PoolConfig::default`] (chunks of 4 KiB, 64 KiB and 1 MiB; at most 1 GiB).
    pub pool: PoolConfig,
    /// Send work requests each queue pair may have outstanding. Default 64.
    pub send_depth: u32,
    /// Receive work requests each queue pair may have outstanding (the most a handler can
    /// post, and so the most credit its peer can get). Default 64.
    pub recv_depth: u32,
    /// The message size of this reactor's connections: the size a client announces (and the
    /// async face posts its receives of) when its [`ConnectOptions::msg_size`] is 0, and the
    /// most an accepted connection announces: a server announces the smaller of this and the
    /// client's `msg_size` (this for a client that states none), and that is the size of each
    /// receive it must post ([`Conn::msg_size`](crate::Conn::msg_size); the async face does).
    /// A peer's claim can lower a connection's receive size, never raise it. Taken within the
    /// pool's largest chunk (and an SRQ's buffers). **Its cost:** each connection's receives pin `recv_depth` pool
    /// chunks of this size: 64 × 64 KiB = 4 MiB at the defaults (a 1 MiB size would pin
    /// 64 MiB per connection, and 16 connections the whole default pool). Sends are bounded by
    /// the smaller of both sides' announced sizes ([`Error::TooLarge`] at submit). Default
    /// 64 KiB (`io::Stream` writes messages of this size).
    pub msg_size: u32,
    /// The most pool bytes one connection's receives may pin: `recv_depth` × the pool chunk
    /// that holds a receive of its message size (see `msg_size`). A connect request whose
    /// receives would need more is refused with
    /// [`RejectCode::NoResources`](crate::RejectCode::NoResources) (the listener's
    /// `on_refused`) before anything is registered for it, and [`Ctx::connect`](crate::Ctx::connect)
    /// fails with [`Error::Limit`] (`what`: `"Config::recv_budget"`). Not used with `srq`
    /// (the shared queue's receives are fixed when it is made). Default 64 MiB: the pool's
    /// largest message (1 MiB) at the default depth (64). A bound per connection: what all
    /// connections hold together is the pool's guarantee ([`PoolConfig`]: a connection
    /// beyond its reservation borrows, within `PoolConfig::per_connection_bytes`).
    pub recv_budget: usize,
    /// Largest send copied inline into the work request. Default 64 bytes.
    pub max_inline: u32,
    /// Completion events counted per CQ before one `ibv_ack_cq_events` call. Default 64.
    pub cq_ack_batch: u32,
    /// `Some(entries)`: every connection on a device shares one CQ of that many entries
    /// (room is accounted so it never overruns); `None`: one CQ per connection, sized for its
    /// queue pair (the default).
    pub shared_cq: Option<u32>,
    /// One send in this many asks for a completion (and the last of each chain); the others
    /// are reported when the signaled one after them completes. Default 16.
    pub signal_every: u32,
    /// Offer receive-credit flow control to peers (it applies when both sides offer it and
    /// both keep at least 3 receives posted; the rule is in
    /// [`ConnectionHandler`](crate::ConnectionHandler)'s docs). Default on; required with `srq`.
    pub flow_control: bool,
    /// Offer the close handshake to peers (it applies on iWARP when both sides offer it and
    /// use flow control). On iWARP a SEND completes once TCP has taken it, and a connection
    /// closed right after its last SEND completed can lose that message (the stream's end
    /// can overtake it). With the handshake a closing side sends a farewell after its last
    /// message and disconnects only once the peer answers that it has it, or after
    /// [`Timeouts::finish`]; the connection is [`State::Finishing`](crate::State::Finishing)
    /// meanwhile. Off: a close disconnects at once, and an application that needs its last
    /// messages delivered must hear back from the peer before it closes. No effect on
    /// InfiniBand or RoCE, where a SEND completes only once the peer acknowledged it. Default on.
    pub close_handshake: bool,
    /// On a device without memory windows (iWARP: Soft-iWARP has `max_mw` 0), expose memory
    /// ([`Conn::expose`](crate::Conn::expose), [`Conn::expose_region`](crate::Conn::expose_region))
    /// by registering a memory region with the remote rights for each exposure. Weaker
    /// isolation than a window, hence off by default (then such an exposure is refused with
    /// [`Error::Unsupported`]): a window's key works only on the
    /// connection it was bound to, a registration's from any queue pair on the device's
    /// protection domain, so a peer of another connection of this reactor on the device that
    /// learned or guessed the key could use it while the exposure lives. Released as a window
    /// is: when the exposure is dropped or its connection is destroyed. Devices with windows
    /// ignore it.
    pub exposure_registration: bool,
    /// Completions reaped from one CQ per tick before the others get a turn. Default 256.
    pub poll_budget: usize,
    /// Spin-then-sleep polling. Zero (the default) is pure event mode: a CQ found empty is
    /// re-armed and the reactor sleeps in `epoll_wait`. Otherwise, for this long after the last
    /// tick that did work, the reactor does not sleep: it polls its emptied CQs directly (left
    /// unarmed, so they raise no events) and checks its channels without blocking; when the
    /// time runs out it arms them, polls once more and sleeps. An idle reactor uses no CPU once
    /// the spin time has passed.
    pub spin: Duration,
    /// Connection-manager deadlines. Default: [`Timeouts::default`] (each field says).
    pub timeouts: Timeouts,
    /// Transport retries on each connection (0..=7): how many times a request the peer does
    /// not acknowledge is sent again before it fails with `RetryExcErr`. The default is 6:
    /// Soft-RoCE (rxe) takes 7 to mean "retry forever", so a dead peer would never be noticed.
    pub retry_count: u8,
    /// The RC ACK timeout: how long a request waits for the peer's acknowledgement before it
    /// is sent again (`RDMA_OPTION_ID_ACK_TIMEOUT`, rounded up to 4.096 µs × 2^t, t in
    /// 1..=31). `None` (the default) keeps the kernel's (on RoCE about 1-2 s: the packet lifetime).
    /// A peer that stops answering fails a request after about
    /// `ack_timeout × (retry_count + 1)`.
    pub ack_timeout: Option<Duration>,
    /// Keepalive: while established, every this often a connection posts a zero-length RDMA
    /// WRITE (no data, no receive or credit of the peer consumed; the peer's device
    /// acknowledges it), so a peer host that vanished without a disconnect is noticed even on
    /// an idle connection: the probe fails with `RetryExcErr` after about
    /// `ack_timeout × (retry_count + 1)` and the connection closes with
    /// [`CloseReason::WorkError`](crate::CloseReason::WorkError). `None` (the default): no
    /// probes.
    pub keepalive: Option<Duration>,
    /// Credit stall bound: a flow-controlled connection whose next send has waited this long
    /// for the peer's receive credits, with no credit arriving that let it go, is closed with
    /// [`CloseReason::Stalled`](crate::CloseReason::Stalled) (it disconnects and drains like
    /// a work error). This notices a peer that stopped consuming messages while its kernel
    /// still acknowledges them (a stopped or hung process), which neither RC retries nor
    /// keepalive probes can, and a peer that grants just enough to keep us answering and
    /// never enough to answer with data (review of 2026-12-07, N3: one credit per burst made
    /// a server queue its replies for good). Counted in
    /// [`Stats::credit_stalls`](crate::Stats::credit_stalls). Default 60 s; `None`: sends wait
    /// for credits for ever (as a TCP sender waits on a zero window: a reader that stops
    /// reading for longer than this closes a byte stream's writer).
    pub credit_timeout: Option<Duration>,
    /// The penalty box: once the peer of a connection a listener accepted sends a message
    /// beyond the credit it was granted, or one whose framing is broken (the connection closes
    /// with [`CloseReason::Protocol`](crate::CloseReason::Protocol)), every listener of this
    /// reactor refuses connect requests from that peer's IP address (an IPv6 one whole: a host
    /// handing itself new addresses evades it, rather than a subnet paying for one peer)
    /// for this long ([`RejectCode::Backoff`](crate::RejectCode::Backoff), counted in
    /// [`Stats::violation_refusals`](crate::Stats::violation_refusals)), twice as long after
    /// each violation after a wait ended while it is remembered (at most 64 times this; a
    /// violation during a wait does not lengthen it), forgetting it after it has behaved for 8
    /// times its last wait. A peer that reconnects after every such close (a reconnect storm)
    /// then costs a reject each time, not an accept, a queue pair, registered receives and a
    /// teardown. At most 4 096 addresses are remembered, by each reactor (listeners spread over
    /// reactors: each refuses what broke its own connections). Every client behind one
    /// address (a NAT, one host's processes) shares its wait: `None` (the default) keeps the
    /// box off. A client of an older version of this crate reads the reject's code as unknown
    /// and does not reconnect after it.
    pub violation_backoff: Option<Duration>,
    /// Send-queue operations (sends, writes, reads) a connection may hold submitted and
    /// waiting beyond its queue pair's free send slots (for the peer's credits, or for send
    /// or CQ room). What the next post can take is never refused; a submission that would
    /// wait beyond this many fails with [`Error::Limit`] (`what`:
    /// `"Config::send_backlog"`), the operation given back in the
    /// [`SubmitError`](crate::SubmitError): back-pressure the handler can act on (submit it
    /// again after a completion; [`Conn::backlog`](crate::Conn::backlog) says how much waits).
    /// It bounds what a peer that takes our messages slowly, or grants no credit, can make a
    /// request/response handler hold (the review of 2026-11-26, M1). Default 1024.
    pub send_backlog: u32,
    /// Pool bytes (the buffers of sends, writes and reads; an application region's or raw
    /// memory is not the pool's) a connection may hold queued when an operation would wait
    /// beyond its free send slots: such a submission fails the same way (`what`:
    /// `"Config::send_backlog_bytes"`) if it would take them past this, unless no pool bytes
    /// are queued (one operation may always wait). Default 192 MiB (`io::Stream` keeps its writes
    /// in flight within it). A bound per connection, on what waits; the memory its buffers
    /// take is also bounded by its account in the pool ([`PoolConfig`]: its reservation and
    /// at most `per_connection_bytes` more), and all connections' together by the pool's
    /// guarantee.
    pub send_backlog_bytes: usize,
    /// Receiver-not-ready retries (0..=6 finite; 7 retries forever). Default 6.
    pub rnr_retry_count: u8,
    /// Listen backlog (`rdma_listen`'s): how many connect requests the kernel holds for the
    /// listener before the reactor reads them; one beyond it is refused by the kernel (iWARP:
    /// a TCP reset, the client sees `Rejected { status: -104 }`). **The kernel caps it** at
    /// the sysctl `net.rdma_ucm.max_backlog` (1024 by default; on iWARP also at
    /// `net.core.somaxconn`): 2 000 connects at once against one Soft-iWARP listener lost
    /// about 170 that way at the cap of 1024, none with the sysctl at 4096. A server that
    /// must take larger storms raises the sysctl. Default 4096.
    pub backlog: i32,
    /// Most live connections (agents and clients, in any state). A connect request beyond it
    /// is rejected with [`RejectCode::NoResources`](crate::RejectCode::NoResources) and
    /// reported to the listener's `on_refused`; [`Ctx::connect`](crate::Ctx::connect) beyond
    /// it fails with [`Error::Limit`]. At most 1 048 575 (2^20 - 1): a work request id carries
    /// 20 bits of a connection's slot, and for a moment a reactor may hold one connection
    /// more than this limit (a listener's `on_connect_request` may
    /// [`Ctx::connect`](crate::Ctx::connect) into the last place before its accepted agent is
    /// added); [`Reactor::with_config`](crate::Reactor::with_config) refuses more. Default
    /// 65 536.
    pub max_connections: usize,
    /// Most accepted connections not yet established (waiting for the client's RTU): a flood
    /// of half-open connections cannot take every queue pair. A connect request beyond it
    /// waits (holding nothing but its id) and is decided as soon as a pending accept settles,
    /// in arrival order, as a TCP backlog would; it is refused (`NoResources`) only when the
    /// live connections and the waiting requests together reach `max_connections`, when four
    /// times this many (at least 1 024) wait already, after waiting [`Timeouts::accept`], or when its listener
    /// closes (`Stats::accepts_waited`). At 0 every request is refused. Default 1024.
    pub max_pending_accepts: usize,
    /// `Some`: every connection takes its receives from one shared receive queue per device,
    /// which the runtime keeps filled ([`SrqConfig`]); `recv_depth` is then unused. `None`
    /// (the default): each queue pair has its own receive queue, filled by its handler.
    pub srq: Option<SrqConfig>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            pool: PoolConfig::default(),
            send_depth: 64,
            recv_depth: 64,
            msg_size: 64 * 1024,
            recv_budget: 64 << 20,
            max_inline: 64,
            cq_ack_batch: 64,
            shared_cq: None,
            signal_every: 16,
            flow_control: true,
            close_handshake: true,
            exposure_registration: false,
            poll_budget: 256,
            spin: Duration::ZERO,
            timeouts: Timeouts::default(),
            retry_count: 6,
            ack_timeout: None,
            keepalive: None,
            credit_timeout: Some(Duration::from_secs(60)),
            violation_backoff: None,
            send_backlog: 1024,
            send_backlog_bytes: 192 << 20,
            rnr_retry_count: 6,
            backlog: 4096,
            max_connections: 65_536,
            max_pending_accepts: 1024,
            srq: None,
        }
    }
}

impl Config {
    /// The pool each device gets: `pool`, with a size class of exactly the SRQ's buffer size
    /// when that is below its smallest (see [`SrqConfig`]).
    pub(crate) fn device_pool(&self) -> PoolConfig {
        let mut pool = self.pool.clone();
        if let Some(srq) = self.srq {
            let size = srq.buf_size as usize;
            if size > 0 && pool.chunk_sizes.iter().all(|&c| c > size) {
                pool.chunk_sizes.insert(0, size);
            }
            // The SRQ's receives are the device's own reservation: set aside before the rest
            // is split between connections' reservations and the shared remainder.
            let chunk = pool.chunk_for(size).unwrap_or(size);
            let budget = pool.budget_beside(chunk.saturating_mul(srq.receives as usize));
            pool.reserved_bytes = Some(budget.reservable);
            pool.shared_bytes = Some(budget.shared);
            pool.per_connection_bytes = Some(budget.per_account);
        }
        pool
    }

    /// The chunk bytes of a device's shared receive queue's receives (`srq`): its own
    /// reservation in the device's pool.
    pub(crate) fn srq_bytes(&self) -> usize {
        let Some(srq) = self.srq else { return 0 };
        let pool = self.device_pool();
        pool.chunk_for(srq.buf_size as usize).unwrap_or(srq.buf_size as usize).saturating_mul(srq.receives as usize)
    }

    /// Checks the values a reactor cannot work with.
    pub(crate) fn validate(&self) -> Result<()> {
        if self.send_depth == 0 || self.recv_depth == 0 {
            return Err(Error::Config("send and receive depth must be at least 1".into()));
        }
        if self.msg_size == 0 || self.recv_budget == 0 {
            return Err(Error::Config("msg_size and recv_budget must be at least 1".into()));
        }
        if self.send_backlog == 0 || self.send_backlog_bytes == 0 {
            return Err(Error::Config("send_backlog and send_backlog_bytes must be at least 1".into()));
        }
        if self.poll_budget == 0 {
            return Err(Error::Config("poll budget must be at least 1".into()));
        }
        // A work request id carries 20 bits of a connection's slot (issue 47): slots 0 to
        // `MAX_INDEX`. A reactor holds at most `max_connections` live connections plus one for
        // a moment: the limit is checked before a listener's `on_connect_request`, whose
        // `Ctx::connect` may take the last place before the accepted agent is inserted (a
        // second `connect` is refused). The connection table reuses freed slots first, so its
        // highest slot index is at most `max_connections`, which must be at most `MAX_INDEX`.
        let most = crate::proto::token::WrId::MAX_INDEX as usize;
        if self.max_connections > most {
            return Err(Error::Config(format!(
                "max_connections {} is above {most}: a work request id carries 20 bits of a connection's slot \
                 ({} slots), and a connect request's handler may open one connection beyond max_connections",
                self.max_connections,
                most + 1
            )));
        }
        if self.retry_count > 7 {
            return Err(Error::Config(format!("retry_count {} is above 7", self.retry_count)));
        }
        if self.keepalive.is_some_and(|k| k.is_zero()) {
            return Err(Error::Config("a keepalive interval must not be zero".into()));
        }
        if self.credit_timeout.is_some_and(|k| k.is_zero()) {
            return Err(Error::Config("a credit timeout must not be zero".into()));
        }
        if self.violation_backoff.is_some_and(|k| k.is_zero()) {
            return Err(Error::Config("a violation backoff must not be zero (None turns it off)".into()));
        }
        // The reactor adds each of these to the time now for a deadline: one it cannot
        // represent would panic or be no deadline at all.
        let t = &self.timeouts;
        let durations = [
            ("timeouts.resolve_addr", Some(t.resolve_addr)),
            ("timeouts.resolve_route", Some(t.resolve_route)),
            ("timeouts.connect", Some(t.connect)),
            ("timeouts.accept", Some(t.accept)),
            ("timeouts.disconnect", Some(t.disconnect)),
            ("timeouts.drain", Some(t.drain)),
            ("timeouts.finish", Some(t.finish)),
            ("timeouts.shutdown", Some(t.shutdown)),
            ("spin", Some(self.spin)),
            ("keepalive", self.keepalive),
            ("credit_timeout", self.credit_timeout),
            ("violation_backoff", self.violation_backoff),
        ];
        for (name, d) in durations {
            if let Some(d) = d.filter(|d| *d > MAX_DURATION) {
                return Err(Error::Config(format!("{name} {d:?} is above the maximum of {MAX_DURATION_TEXT}")));
            }
        }
        if let Some(srq) = &self.srq {
            if !self.flow_control {
                return Err(Error::Config(
                    "srq: a shared receive queue needs flow_control (without it one peer can consume every \
                     receive of the queue)"
                        .into(),
                ));
            }
            srq.validate(self.pool.max_chunk())?;
        }
        Ok(())
    }
}

/// The receive size of a connection whose peer states `claim` as its message size (`None`:
/// a peer that states none, or a client's own unset option): the smaller of the claim,
/// `Config::msg_size` and `max_msg` (the pool's largest chunk, within the SRQ's buffers), at
/// least 1. A peer's claim lowers it, never raises it.
pub(crate) fn recv_size(cfg: &Config, claim: Option<u32>, max_msg: usize) -> u32 {
    let own = (cfg.msg_size as usize).min(max_msg);
    let size = claim.filter(|c| *c > 0).map_or(own, |c| own.min(c as usize));
    u32::try_from(size).unwrap_or(u32::MAX).max(1)
}

/// Pool bytes `depth` receives of `size` bytes pin: each takes a chunk of the smallest class
/// that holds it (a size above every class counts as the largest, which the caller refuses
/// anyway).
pub(crate) fn recv_bytes(pool: &PoolConfig, depth: u32, size: usize) -> usize {
    let chunk = pool.chunk_sizes.iter().copied().filter(|c| *c >= size).min().unwrap_or(size.max(pool.max_chunk()));
    chunk.saturating_mul(depth as usize)
}

/// Why a connection receiving messages of `size` is over `Config::recv_budget`, if it is
/// (never with `srq`: the shared queue's receives are the runtime's, fixed at its creation).
pub(crate) fn over_recv_budget(cfg: &Config, size: u32) -> Option<String> {
    if cfg.srq.is_some() {
        return None;
    }
    let bytes = recv_bytes(&cfg.pool, cfg.recv_depth, size as usize);
    (bytes > cfg.recv_budget).then(|| {
        format!(
            "over Config::recv_budget ({} bytes): {} receives of {size} bytes pin {bytes} bytes of pool chunks",
            cfg.recv_budget, cfg.recv_depth
        )
    })
}

impl SrqConfig {
    /// The most connections one device's shared receive queue admits, each at its base
    /// credit: `(receives - reserve) / credit` (10 085 at the defaults). The next is refused
    /// ([`RejectCode::NoResources`](crate::RejectCode::NoResources), "limit reached").
    pub fn max_connections(&self) -> u32 {
        crate::reactor::data::srq::SrqBudget::new(self.receives, self.credit, self.max_credit, self.reserve).max_conns()
    }

    /// Checks the values a shared receive queue cannot work with.
    fn validate(&self, max_chunk: usize) -> Result<()> {
        let bad = |what: String| Err(Error::Config(format!("srq: {what}")));
        if self.credit < MIN_DEPTH {
            return bad(format!("credit {} is below the flow-control minimum {MIN_DEPTH}", self.credit));
        }
        if self.credit > u32::from(u16::MAX) {
            return bad(format!("credit {} does not fit the connect information (at most 65535)", self.credit));
        }
        if self.max_credit > u32::from(u16::MAX) {
            return bad(format!("max credit {} is above 65535", self.max_credit));
        }
        if u64::from(self.receives) < u64::from(self.credit) + u64::from(self.reserve) {
            return bad(format!(
                "{} receives do not cover one connection's credit {} and the reserve {}",
                self.receives, self.credit, self.reserve
            ));
        }
        if self.low_water >= self.receives {
            return bad(format!("low water {} is not below the {} receives", self.low_water, self.receives));
        }
        if self.buf_size == 0 || self.buf_size as usize > max_chunk {
            return bad(format!(
                "buffer size {} is not within 1..={max_chunk} (the pool's largest chunk)",
                self.buf_size
            ));
        }
        Ok(())
    }
}

/// Options of one client connection.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConnectOptions {
    /// Local address to bind (none: the kernel picks by route).
    pub src: Option<SocketAddr>,
    /// Largest message this client sends or receives, announced to the server as the size of
    /// its receives (the async face posts them of this size; a handler of the callback API
    /// posts receives of at least [`Conn::msg_size`](crate::Conn::msg_size)). 0 (the
    /// default): [`Config::msg_size`] (64 KiB at the defaults). Each receive pins a pool chunk
    /// that holds it, [`Config::recv_depth`] of them (64 × 64 KiB = 4 MiB at the defaults;
    /// 1 MiB messages pin 64 MiB). The server announces at most this (the smaller of it and
    /// its own `Config::msg_size`), and a send larger than the smaller of the two sizes fails
    /// at submit with [`Error::TooLarge`] naming both.
    pub msg_size: u32,
    /// Messages this client intends to send (0: not stated).
    pub msg_count: u32,
    /// Opaque bytes for the server (at most 36).
    pub user_data: Vec<u8>,
    /// Sends these bytes as the connect private data instead of the connect information (at
    /// most 56). For interoperability and fault tests: a server of this crate validates them.
    pub raw_private_data: Option<Vec<u8>>,
    /// Reconnect to the same address after a failure, with this policy, instead of closing
    /// (`None`, the default: a failure closes the connection). See
    /// [`ConnectionHandler::on_reconnecting`](crate::ConnectionHandler::on_reconnecting) for what
    /// a reconnection keeps.
    pub reconnect: Option<Reconnect>,
}

#[cfg(test)]
mod tests {
    use super::{Config, SrqConfig};

    fn with(srq: SrqConfig) -> Config {
        Config { srq: Some(srq), ..Config::default() }
    }

    /// Issue 47: a reactor uses at most 2^20 connection slots (a work request id carries 20
    /// bits of a connection's slot), and at most `max_connections + 1` of them (a connect
    /// request's handler may open one connection beyond the limit before its agent is
    /// inserted); a configuration that could need more is refused when it is checked, not
    /// connection by connection at setup.
    #[test]
    fn max_connections_beyond_the_slot_index_limit_is_refused() {
        assert!(Config { max_connections: (1 << 20) - 1, ..Config::default() }.validate().is_ok());
        let e = Config { max_connections: 1 << 20, ..Config::default() }.validate().expect_err("refused");
        assert!(e.to_string().contains("max_connections 1048576 is above 1048575"), "{e}");
        assert!(e.to_string().contains("1048576 slots"), "{e}");
        assert!(Config { max_connections: usize::MAX, ..Config::default() }.validate().is_err());
    }

    #[test]
    fn the_default_srq_is_valid() {
        assert!(with(SrqConfig::default()).validate().is_ok());
    }

    #[test]
    fn srq_values_it_cannot_work_with_are_refused_with_a_reason() {
        let d = SrqConfig::default();
        let cases = [
            (SrqConfig { credit: 2, ..d }, "below the flow-control minimum"),
            (SrqConfig { credit: 70_000, receives: 1 << 20, ..d }, "does not fit the connect information"),
            (
                SrqConfig { receives: 4, credit: 8, low_water: 0, reserve: 0, ..d },
                "do not cover one connection's credit",
            ),
            (SrqConfig { receives: 64, credit: 8, low_water: 0, reserve: 60, ..d }, "and the reserve 60"),
            (SrqConfig { low_water: d.receives, ..d }, "is not below"),
            (SrqConfig { buf_size: 0, ..d }, "buffer size 0"),
            (SrqConfig { buf_size: 2 << 20, ..d }, "the pool's largest chunk"),
        ];
        for (srq, why) in cases {
            let e = with(srq).validate().expect_err(why).to_string();
            assert!(e.contains(why), "{srq:?}: {e}");
        }
    }

    /// The review's L4 (2026-11-26): a huge `Timeouts::connect` panicked in the client's
    /// connect (`Instant::now() + connect`); every duration the reactor adds to the clock is
    /// refused above the maximum, naming the field.
    #[test]
    fn durations_above_the_maximum_are_refused_naming_the_field() {
        use std::time::Duration;
        let year = Duration::from_secs(365 * 86_400);
        let at_most = Config {
            timeouts: super::Timeouts {
                resolve_addr: year,
                resolve_route: year,
                connect: year,
                accept: year,
                disconnect: year,
                drain: year,
                finish: year,
                shutdown: year,
            },
            spin: year,
            keepalive: Some(year),
            credit_timeout: Some(year),
            ..Config::default()
        };
        assert!(at_most.validate().is_ok());
        let over = year + Duration::from_nanos(1);
        let mut cases: Vec<(Config, &str)> = Vec::new();
        let timeouts = |f: fn(&mut super::Timeouts) -> &mut Duration| {
            let mut cfg = Config::default();
            *f(&mut cfg.timeouts) = Duration::MAX;
            cfg
        };
        cases.push((timeouts(|t| &mut t.resolve_addr), "timeouts.resolve_addr"));
        cases.push((timeouts(|t| &mut t.resolve_route), "timeouts.resolve_route"));
        cases.push((timeouts(|t| &mut t.connect), "timeouts.connect"));
        cases.push((timeouts(|t| &mut t.accept), "timeouts.accept"));
        cases.push((timeouts(|t| &mut t.disconnect), "timeouts.disconnect"));
        cases.push((timeouts(|t| &mut t.drain), "timeouts.drain"));
        cases.push((timeouts(|t| &mut t.finish), "timeouts.finish"));
        cases.push((timeouts(|t| &mut t.shutdown), "timeouts.shutdown"));
        cases.push((Config { spin: over, ..Config::default() }, "spin"));
        cases.push((Config { keepalive: Some(over), ..Config::default() }, "keepalive"));
        cases.push((Config { credit_timeout: Some(Duration::MAX), ..Config::default() }, "credit_timeout"));
        cases.push((Config { violation_backoff: Some(Duration::MAX), ..Config::default() }, "violation_backoff"));
        for (cfg, field) in cases {
            let e = cfg.validate().expect_err(field).to_string();
            assert!(e.starts_with(&format!("bad configuration: {field} ")), "{field}: {e}");
            assert!(e.contains("is above the maximum of 365 days"), "{field}: {e}");
        }
    }

    /// The review's M2 (2026-11-26): a connection's receives are of the smaller of the peer's
    /// claim and the local `Config::msg_size`, never the claim alone, and the default costs
    /// 4 MiB per connection, not 64 MiB.
    #[test]
    fn a_peers_claim_lowers_the_receive_size_and_never_raises_it() {
        use super::recv_size;
        let cfg = Config::default();
        let max = cfg.pool.max_chunk();
        assert_eq!(recv_size(&cfg, Some(1 << 20), max), 64 * 1024, "a 1 MiB claim against the default");
        assert_eq!(recv_size(&cfg, Some(64), max), 64, "a smaller claim lowers it");
        assert_eq!(recv_size(&cfg, None, max), 64 * 1024, "no claim: the local size");
        assert_eq!(recv_size(&cfg, Some(0), max), 64 * 1024, "a zero claim is no claim");
        assert_eq!(recv_size(&cfg, Some(u32::MAX), 4096), 4096, "within the pool's (or SRQ's) largest");
        let big = Config { msg_size: 1 << 20, ..Config::default() };
        assert_eq!(recv_size(&big, Some(1 << 20), max), 1 << 20, "a raised local size admits the claim");
    }

    #[test]
    fn the_receive_budget_counts_pool_chunks_and_refuses_beyond_it() {
        use super::{over_recv_budget, recv_bytes};
        let cfg = Config::default();
        assert_eq!(
            recv_bytes(&cfg.pool, cfg.recv_depth, cfg.msg_size as usize),
            4 << 20,
            "64 x 64 KiB at the defaults"
        );
        assert_eq!(recv_bytes(&cfg.pool, 64, 64 * 1024 + 1), 64 << 20, "a byte over a class takes the next chunk");
        assert_eq!(recv_bytes(&cfg.pool, 64, 1), 64 * 4096);
        assert_eq!(cfg.recv_budget, 64 << 20, "the largest message at the default depth");
        assert_eq!(recv_bytes(&cfg.pool, cfg.recv_depth, cfg.pool.max_chunk()), cfg.recv_budget);
        assert_eq!(
            cfg.recv_budget + cfg.send_backlog_bytes,
            cfg.pool.max_bytes / 4,
            "receives and queued sends together: a quarter of the default pool's 1 GiB"
        );
        assert!(over_recv_budget(&cfg, cfg.msg_size).is_none());
        // The pool's largest message at full depth is within the budget; 512 of them are not.
        let deep = Config { recv_depth: 512, msg_size: 1 << 20, ..Config::default() };
        let why = over_recv_budget(&deep, 1 << 20).expect("512 MiB of receives");
        let want = "over Config::recv_budget (67108864 bytes): 512 receives of 1048576 bytes pin 536870912 bytes";
        assert!(why.starts_with(want), "{why}");
        assert!(over_recv_budget(&deep, 4096).is_none(), "a small claim fits");
        let srq = Config { srq: Some(SrqConfig::default()), ..deep };
        assert!(over_recv_budget(&srq, 1 << 20).is_none(), "the SRQ's receives are not per connection");
    }

    #[test]
    fn a_zero_message_size_or_budget_is_refused() {
        for cfg in [Config { msg_size: 0, ..Config::default() }, Config { recv_budget: 0, ..Config::default() }] {
            let e = cfg.validate().expect_err("zero").to_string();
            assert!(e.contains("msg_size and recv_budget must be at least 1"), "{e}");
        }
    }

    /// Finding 2 of the hostile review: without flow control one peer can empty the SRQ.
    #[test]
    fn an_srq_without_flow_control_is_refused() {
        let cfg = Config { flow_control: false, ..with(SrqConfig::default()) };
        let e = cfg.validate().expect_err("srq without flow control").to_string();
        assert!(e.contains("needs flow_control"), "{e}");
    }
}
