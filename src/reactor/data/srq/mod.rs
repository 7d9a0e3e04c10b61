//! Shared receive queues (`Config::srq`): one per device per reactor, with receives the
//! runtime posts from the device's pool and re-posts as they are consumed.
//!
//! **Receives.** When the device's resources are created, its SRQ is created on its PD and
//! `SrqConfig::receives` pool buffers of `SrqConfig::buf_size` are posted, each under a token
//! of kind `SrqRecv` naming a slot of the device's slot table (which holds the `Buf` while it
//! is posted). A receive completion is matched to its connection by `wc.qp_num` (a map kept
//! from queue-pair creation to destruction); an unknown number is a stale completion
//! (`Stats::srq_stale`) and its buffer is posted again. A message is delivered to the
//! connection's handler as an `OpCode::Recv` completion with user_data
//! [`Completion::SRQ_RECV`](crate::Completion::SRQ_RECV), carrying the buffer; a fresh buffer
//! takes its place. A credit-only message's buffer is posted again unseen. Every re-post is
//! queued and goes to the device at the start of the tick's posting (`Core::flush_posts`), in
//! one `ibv_post_srq_recv` chain per device, *before* any connection posts its sends, so a
//! credit granted in this tick is never ahead of the receive it stands for. The SRQ's limit
//! event (`SrqConfig::low_water`) is armed as a backstop: it is counted
//! (`Stats::srq_limit_events`), and armed again only by the posting that brings the SRQ back
//! to its mark (armed while below it, it would fire at every receive consumed).
//!
//! **The credit rule.** Each receive of the SRQ is in exactly one place: the reserve, a
//! connection's share, or free ([`SrqBudget`]). A connection is admitted with a share of
//! `SrqConfig::credit`, which it advertises as its receive depth in its connect information,
//! while the free receives cover it; one beyond that is refused (a listener's `on_refused`
//! with `NoResources`, a client's connect fails). With flow control (`proto/flow.rs`) each SRQ
//! receive a message of its peer consumed goes back to that connection once it has been
//! posted again (`post_srq`), so the grants a connection has outstanding never exceed its
//! share. So a peer that respects its credit can never find the SRQ empty: no
//! receiver-not-ready NAK. A connection that reconnects (`conn/reconnect.rs`) leaves with its
//! old queue pair, its whole share going back to the free receives (those consumed and
//! queued for posting again included), and is admitted afresh with the new one, under the
//! same `ConnKey` but a new share (`ConnShare::id`). A receive queued for the old queue pair
//! (it waited for a pool buffer across the reconnection) names the old share (`Owner`), so
//! when it is posted it stays free: it is never credited to the new share, whose grants would
//! otherwise exceed it by one (review L3). No receive can be posted by the application on a
//! connection of an SRQ reactor, waiting to reconnect or not (`Core::submit` refuses it): its
//! queue pair has no receive queue of its own.
//!
//! **Credit follows activity** (`SrqBudget::on_repost`, at that re-post): a connection whose
//! peer ran low (all but a quarter of its share consumed and not yet granted back, seen when
//! the receive of a data message comes back) and sent a share's worth of data messages since
//! it was admitted or last grew (so a handshake grows nothing) gets the receive back with one
//! more from the free ones (`Flow::grant_more`: owed like any re-posted receive, it rides the
//! next grant), up to `SrqConfig::max_credit`, while more than an eighth of the queue is free,
//! while the shares together hold less than the growth pool beyond their bases (a
//! thirty-second of the queue, or one connection's growth to `max_credit` if that is more:
//! 976 receives at the defaults), and only when no receive waits unposted, so that every free
//! receive is on the queue. A credit-only message (`Repost`'s owner flag) never grows a share
//! and never counts as running low: it costs its peer nothing its application sees, else a
//! peer bursting only such messages would grow to `max_credit` in about 500 of them. A
//! connection whose peer sent a whole share's worth of messages (credit-only ones included)
//! without once running low keeps the receive instead of granting it back (its share one
//! smaller), down to its base, as does every grown one while fewer than an eighth are free.
//! The share never falls below the base (at least `MIN_DEPTH`), so flow control's guarantee
//! of progress holds as with a fixed depth.
//!
//! **Idle grown shares.** Grants cannot be taken back: a peer that grew its share and stopped
//! sending holds it. Two things bound what that costs. The growth pool caps what all such
//! peers together can hold, so admission never falls below `(receives - reserve - pool) /
//! credit` (9 760 of the 10 085 at the defaults), whatever the peers did. And a grown share
//! *lapses* when its peer sent no data while the queue took `receives` data messages of others
//! (`SrqBudget::traffic`, counted at each re-post of a data message's receive): from its
//! peer's next message on, each of its receives that comes back is kept (the share one
//! smaller), however low its peer runs, until it is back at its base, and it grows again only
//! after a share's worth of data messages. A peer that never sends again keeps what it holds
//! until it closes, and that part of the pool is not there for others to grow into (silent
//! peers holding all of it leave every other connection at its base: slower, never refused).
//! And grown shares age by the clock while others want the growth (review of 2026-12-07, N9:
//! peers bursting now and then, each burst running low, renewed their growth for good): while
//! a busy connection was refused growth for want of the pool within the last second, a share
//! grown more than a second ago lapses as above (`SrqBudget::set_now`, set from the coarse
//! clock at each posting), so the pool goes round the connections that want it.
//! The pool is no place of its own: a bound on the receives inside the shares beyond their
//! bases, taken from and given back to the free ones. `Stats::srq_grown`, `srq_shrunk`,
//! `srq_free`. The rule is unit-tested with a model of the SRQ (connections streaming,
//! ping-ponging, pausing, sending only credit-only messages, idle, joining and leaving; at
//! every step no message finds the queue below its reserve, every receive is in one place and
//! the growth pool is kept), and with the review's attack at the defaults.
//!
//! **Peers that do not.** Flow control is required (`conn/setup.rs`: a request that does not offer
//! it is refused with `Unsupported`, a client whose server does not agree is closed before
//! `on_established`): without it nothing bounds what one peer consumes, and the queue is every
//! connection's. A peer that negotiated and then sends beyond its credit is closed
//! (`Protocol`, `Stats::srq_overdrawn`) at its first such message `srq_complete` sees; the
//! device took a receive for each message it landed before that, and those come out of the
//! `reserve`, which no connection is granted. An overdraw larger than the reserve, landing
//! while the reactor does not poll, can still empty the queue for a moment (the device
//! consumes a receive for any queue pair's message before software can look; no single SRQ
//! can do better): the other peers then see RNR NAKs, which their retries cover.
//!
//! **CQ room.** Every queue pair on the SRQ takes its receive completions on one CQ of the
//! device's, the SRQ's own (`DevSrq::cq`), of `receives` entries, all committed to receives:
//! a receive is posted again only after its completion was reaped, so at most `receives`
//! completions can wait in it, however many connections there are and however a peer
//! behaves. (With receive completions on each connection's own CQ, sized for its credit, a
//! peer sending beyond its credit while the reactor was busy overran that CQ: rxe dropped the
//! completions, and the receives they consumed were lost to the SRQ for good; on a shared CQ
//! the overrun failed every connection on it.) A connection's own CQ, or the shared one
//! (`Config::shared_cq`), holds only its sends: it commits no receive entries there. rxe caps
//! a CQ at 32 767 entries (`max_cqe`), which bounds `receives` on it.
//!
//! **Memory.** The SRQ's receives are `receives × buf_size` bytes of the pool, registered when
//! the device's resources are created, whatever the number of connections. Buffers handed to
//! handlers are replaced by fresh ones; what handlers keep (an echo in flight) comes back to
//! the pool when they drop it. When handlers hold every buffer the pool may register, the
//! consumed receives wait, unposted, and (under flow control) their credits with them; since a
//! buffer can come back with no event to wake the reactor (dropped outside it, or in
//! `on_closed` after the tick's posting), a short timer (`TimerTarget::SrqRefill`, 5 ms,
//! doubling to 1 s while it finds nothing) tries the refill again for as long as receives wait,
//! and memory that came back to the pool since the posting that found it short (the ledger's
//! count of credits, `Core::srq_memory_back`) makes the next tick, and `next_timeout`, come at
//! once.
//!
//! **Teardown.** Every queue pair on the SRQ holds an `Rc` of it (`Qp`'s fields), so the SRQ
//! is destroyed only after the last of them, when its device's resources are dropped (before
//! the pool's regions and the PD, `Device`'s field order); the posted buffers are released
//! after the SRQ (`DevSrq`'s field order). SRQ_ERR closes every connection on the SRQ (as an
//! `Abort`, like CQ_ERR) and the SRQ is not posted to again; new connections are refused.

use std::rc::Rc;
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use crate::error::{Error, Result};
use crate::proto::conn::{AsyncEventKind, CloseReason, Input};
use crate::proto::flow::{Farewell, Imm};
use crate::proto::op::{OpCode, WcStatus};
use crate::proto::token::{ConnKey, CqKey, GenSlab, Key, SrqKey, Token};
use crate::proto::transport::unframe;
use crate::reactor::data::cq_room::CqRoom;
use crate::reactor::data::op::Completion;
use crate::reactor::event_loop::timers::TimerTarget;
use crate::reactor::Core;
use crate::sys::cq::WorkCompletion;
use crate::sys::pool::{Account, Buf, NO_OWNER};
use crate::sys::qp::RecvWr;
use crate::sys::srq::Srq;

pub(crate) use budget::{ConnShare, Share, SrqBudget};

/// How soon receives left unposted for want of pool buffers (or withheld for a connection's
/// memory) are tried again, at first; the wait doubles while a try finds nothing, to at most
/// `SRQ_RETRY_MAX`.
const SRQ_REFILL_RETRY: Duration = Duration::from_millis(5);
const SRQ_RETRY_MAX: Duration = Duration::from_secs(1);

/// A connection's receives of the SRQ that its peer's messages consumed and that are not
/// posted again, their credits withheld (`ConnEntry::srq_withheld`; the module docs'
/// "Withheld receives").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(in crate::reactor) struct Withheld {
    /// By its handler (`Conn::withhold_receive`), until it releases them
    /// (`Conn::release_receives`).
    pub(in crate::reactor) by_handler: u32,
    /// By the runtime, while the connection holds more of the pool than it may
    /// (`PoolConfig::per_connection_bytes`, or the shared remainder lent out): posted again as
    /// its buffers come back (`Core::post_srqs`).
    pub(in crate::reactor) for_memory: u32,
}

impl Withheld {
    pub(in crate::reactor) fn total(&self) -> u32 {
        self.by_handler + self.for_memory
    }
}

/// A receive to post (again): its buffer (none: allocate a fresh one), and the connection
/// whose credit it returns once posted.
pub(in crate::reactor) struct Repost {
    buf: Option<Buf>,
    owner: Option<Owner>,
}

/// Whose credit a receive queued for posting again returns: the connection, the share it
/// held when its peer's message consumed the receive ([`ConnShare::id`]: a connection that
/// reconnects gets a new share under the same key, and a receive queued for the old one is
/// not the new one's, `SrqBudget::repost_for`), and whether a credit-only message consumed it.
#[derive(Clone, Copy, Debug)]
pub(in crate::reactor) struct Owner {
    conn: ConnKey,
    share: u64,
    control: bool,
}

/// Queue pair numbers of the queue pairs on an SRQ, each with its connection: how a receive
/// completion, which names only its queue pair, finds its connection. A sorted list searched
/// by bisection: no hashing on the path of a completion; adding and removing (at connection
/// setup and teardown) shift the list.
#[derive(Debug, Default)]
pub(in crate::reactor) struct QpMap(Vec<(u32, ConnKey)>);

impl QpMap {
    /// Adds (or replaces) `qp_num`'s connection.
    pub(in crate::reactor) fn insert(&mut self, qp_num: u32, t: ConnKey) {
        match self.0.binary_search_by_key(&qp_num, |e| e.0) {
            Ok(i) => self.0[i].1 = t,
            Err(i) => self.0.insert(i, (qp_num, t)),
        }
    }

    /// Forgets `qp_num`.
    pub(in crate::reactor) fn remove(&mut self, qp_num: u32) {
        if let Ok(i) = self.0.binary_search_by_key(&qp_num, |e| e.0) {
            self.0.remove(i);
        }
    }

    /// The connection of `qp_num`.
    pub(in crate::reactor) fn get(&self, qp_num: u32) -> Option<ConnKey> {
        self.0.binary_search_by_key(&qp_num, |e| e.0).ok().map(|i| self.0[i].1)
    }

    /// Every connection listed.
    pub(in crate::reactor) fn values(&self) -> impl Iterator<Item = ConnKey> + '_ {
        self.0.iter().map(|e| e.1)
    }
}

/// One device's shared receive queue and its bookkeeping. Field order is drop order: the SRQ
/// (once no queue pair holds it) before the buffers posted to it.
pub(in crate::reactor) struct DevSrq {
    pub(in crate::reactor) srq: Rc<Srq>,
    /// The receive CQ of every queue pair on the SRQ: `receives` entries, all committed to
    /// them, so no receive completion can overrun it, however a peer behaves.
    pub(in crate::reactor) cq: CqKey,
    /// The buffers of the posted receives, by the slot their `wr_id` names.
    slots: GenSlab<SrqKey, Buf>,
    /// Receives to post at the next posting, in order.
    repost: Vec<Repost>,
    pub(in crate::reactor) budget: SrqBudget,
    /// Queue pair number to connection, for every queue pair on this SRQ.
    pub(in crate::reactor) qps: QpMap,
    buf_size: usize,
    low_water: u32,
    /// The limit event is armed. It is disarmed by its event and armed again only once a
    /// posting brought the SRQ back to `low_water`: armed while the SRQ is below the mark, it
    /// would fire again at every receive consumed (an event, and a copy to every other
    /// reactor, per message).
    limit_armed: bool,
    /// SRQ_ERR or a failed post: nothing is posted any more, no connection admitted.
    pub(in crate::reactor) failed: bool,
    /// The device's own account in its pool (`sys/pool/ledger.rs`): the receives' buffers are
    /// charged to it, within its reservation of `receives` of them, until a message for a
    /// connection lands in one, whose account it is charged to from then on.
    account: Account,
    /// Connections with receives withheld for memory (`Withheld::for_memory`), looked at
    /// by each posting.
    mem_withheld: Vec<ConnKey>,
    /// The pool's [`Ledger::returned`](crate::sys::pool::Ledger::returned) when the last
    /// posting found the pool short (`None` when it was not): memory back since then is a
    /// reason for a tick now (`Core::srq_memory_back`), whether or not an event announced it.
    short_at: Option<u64>,
}

impl Drop for DevSrq {
    fn drop(&mut self) {
        if Rc::strong_count(&self.srq) > 1 {
            // A queue pair still holds the SRQ (never expected: see `post_srq`'s SAFETY): its
            // posted buffers must outlive it, so they are leaked, not returned to the pool.
            debug_assert!(false, "a queue pair outlived its device's SRQ bookkeeping");
            std::mem::forget(std::mem::take(&mut self.slots));
        }
        // Then the fields, in order: the SRQ (destroyed, as the last holder), the buffers.
    }
}

impl DevSrq {
    /// Receives posted now.
    pub(in crate::reactor) fn posted(&self) -> usize {
        self.slots.len()
    }
}

impl Core {
    /// Creates device `d`'s SRQ (`Config::srq`) and queues its receives for the first posting,
    /// which happens at once.
    pub(in crate::reactor) fn create_srq(&mut self, d: usize) -> Result<()> {
        let Some(cfg) = self.cfg.srq else { return Ok(()) };
        let pd = self.devices[d].pd.clone();
        let srq = Srq::new(&pd, cfg.receives)
            .map_err(|e| Error::verb("ibv_create_srq", format!("{} receives", cfg.receives), e))?;
        // The receive CQ: one entry per receive. A receive is posted again only after its
        // completion was reaped, so at most `receives` completions are ever waiting in it.
        let cq = self.new_cq(d, cfg.receives, true)?;
        let e = self.cqs.get_mut(cq).expect("just created");
        if e.room.capacity() < cfg.receives {
            self.remove_cq(cq);
            return Err(Error::Config(format!(
                "the device gave the shared receive queue's CQ fewer entries than its {} receives",
                cfg.receives
            )));
        }
        e.room = CqRoom::new(cfg.receives, 0);
        e.room.admit(cfg.receives);
        let repost = (0..cfg.receives).map(|_| Repost { buf: None, owner: None }).collect();
        let account = self.devices[d].pool.open_device_account(self.cfg.srq_bytes());
        self.devices[d].srq = Some(DevSrq {
            srq,
            cq,
            slots: GenSlab::new(),
            repost,
            budget: SrqBudget::new(cfg.receives, cfg.credit, cfg.max_credit, cfg.reserve),
            qps: QpMap::default(),
            buf_size: cfg.buf_size as usize,
            low_water: cfg.low_water,
            limit_armed: false,
            failed: false,
            account,
            mem_withheld: Vec::new(),
            short_at: None,
        });
        self.post_srq(d);
        let dev = self.devices[d].srq.as_mut().expect("just set");
        if cfg.low_water > 0 && !dev.limit_armed {
            // Armed by the first posting; done here only to report why it could not be.
            dev.srq
                .arm_limit(cfg.low_water)
                .map_err(|e| Error::verb("ibv_modify_srq", format!("limit {}", cfg.low_water), e))?;
            dev.limit_armed = true;
        }
        if dev.posted() < cfg.receives as usize {
            let posted = dev.posted();
            let cq = dev.cq;
            self.devices[d].srq = None;
            self.remove_cq(cq);
            return Err(Error::Config(format!(
                "the shared receive queue took {posted} of its {} receives (pool too small? Config::pool)",
                cfg.receives
            )));
        }
        Ok(())
    }

    /// Posts every device's queued SRQ receives (start of the tick's posting), with those
    /// withheld for connections whose memory is back within their limits.
    pub(in crate::reactor) fn post_srqs(&mut self) {
        if self.cfg.srq.is_none() {
            return;
        }
        // Connections withheld for memory are looked at when the retry timer says (not every
        // tick: they can be many).
        let release = std::mem::take(&mut self.srq_release_due);
        for d in 0..self.devices.slots() {
            if release && self.devices.get(d).and_then(|x| x.srq.as_ref()).is_some_and(|s| !s.mem_withheld.is_empty()) {
                self.release_mem_withheld(d);
            }
            if self.devices.get(d).and_then(|x| x.srq.as_ref()).is_some_and(|s| !s.repost.is_empty()) {
                self.post_srq(d);
            }
        }
    }

    /// Device `d`'s connections whose receives were withheld for memory: each gets back as
    /// many as its account may hold again (one chunk each), the others keep waiting, and a
    /// short timer looks again while any wait (their buffers can come back with no event).
    fn release_mem_withheld(&mut self, d: usize) {
        let Some(dev) = self.devices.get_mut(d) else { return };
        let pool = dev.pool.clone();
        let Some(s) = dev.srq.as_mut() else { return };
        let chunk = pool.chunk_size(s.buf_size).unwrap_or(s.buf_size);
        let mut waiting = std::mem::take(&mut s.mem_withheld);
        let mut released = false;
        waiting.retain(|&t| {
            let Some(c) = self.conns.get_mut(t) else { return false };
            let (Some(share), Some(account)) = (c.srq_share, c.account.map(|r| r.account)) else {
                c.srq_withheld.for_memory = 0;
                return false;
            };
            // As many as its account may hold chunks for: each receive posted again lets one
            // more message land in its share.
            let mut room = 0;
            while room < c.srq_withheld.for_memory
                && pool.ledger().can_charge(account, chunk.saturating_mul(room as usize + 1))
            {
                room += 1;
            }
            for _ in 0..room {
                s.repost.push(Repost { buf: None, owner: Some(Owner { conn: t, share: share.id(), control: false }) });
            }
            released |= room > 0;
            c.srq_withheld.for_memory -= room;
            c.srq_withheld.for_memory > 0
        });
        s.mem_withheld = waiting;
        if !s.mem_withheld.is_empty() {
            // Looked at again by the next retry: soon after progress, else later and later.
            self.srq_retry_wait = if released {
                SRQ_REFILL_RETRY
            } else {
                (self.srq_retry_wait * 2).clamp(SRQ_REFILL_RETRY, SRQ_RETRY_MAX)
            };
            self.schedule_srq_retry();
        }
    }

    /// The SRQ's retry timer, unless one is pending: `SRQ_REFILL_RETRY` after a posting that
    /// made progress, twice the last wait (at most `SRQ_RETRY_MAX`) after one that found
    /// nothing to post (review of issue 45: a connection holding its memory for good kept the
    /// reactor waking every 5 ms).
    fn schedule_srq_retry(&mut self) {
        if !self.srq_refill {
            self.srq_refill = true;
            let wait = self.srq_retry_wait.max(SRQ_REFILL_RETRY);
            if let Some(at) = Instant::now().checked_add(wait) {
                self.timers.schedule(at, TimerTarget::SrqRefill);
            }
        }
    }

    /// `Conn::withhold_receive`: the receive the message being delivered to `t` consumed is
    /// not posted again (nor its credit returned) until `Core::release_receives`. False when no
    /// such message is being delivered to `t`.
    pub(in crate::reactor) fn withhold_receive(&mut self, t: ConnKey) -> bool {
        if !self.srq_delivering.as_ref().is_some_and(|(c, _, _)| *c == t) {
            return false;
        }
        self.srq_delivering = None;
        let Some(c) = self.conns.get_mut(t) else { return false };
        c.srq_withheld.by_handler += 1;
        self.stats.srq_withheld += 1;
        true
    }

    /// `Conn::release_receives`: up to `n` of the receives `t`'s handler withheld are queued
    /// to be posted again, each returning its credit once posted; how many.
    pub(in crate::reactor) fn release_receives(&mut self, t: ConnKey, n: u32) -> u32 {
        let Some(c) = self.conns.get_mut(t) else { return 0 };
        let k = n.min(c.srq_withheld.by_handler);
        let (Some(share), Some(p)) = (c.srq_share, c.placed) else { return 0 };
        if k == 0 {
            return 0;
        }
        c.srq_withheld.by_handler -= k;
        let Some(s) = self.devices.get_mut(p.device).and_then(|x| x.srq.as_mut()) else { return 0 };
        for _ in 0..k {
            s.repost.push(Repost { buf: None, owner: Some(Owner { conn: t, share: share.id(), control: false }) });
        }
        k
    }

    /// Connection `t` leaves device `d`'s SRQ (destroyed, or reconnecting): the receives it
    /// withheld are posted again for no connection (its share, which counts them, goes back to
    /// the free receives, which must all be on the queue).
    pub(in crate::reactor) fn srq_leave_withheld(&mut self, d: usize, t: ConnKey) {
        let Some(c) = self.conns.get_mut(t) else { return };
        let n = std::mem::take(&mut c.srq_withheld).total();
        let Some(s) = self.devices.get_mut(d).and_then(|x| x.srq.as_mut()) else { return };
        s.mem_withheld.retain(|&k| k != t);
        for _ in 0..n {
            s.repost.push(Repost { buf: None, owner: None });
        }
    }

    /// True when a shared receive queue's receives wait for pool memory and some came back
    /// since the posting that found it short: a tick should try again now, not at the retry
    /// timer (a buffer dropped outside the reactor announces itself to no fd). Cheap unless a
    /// retry is pending.
    pub(in crate::reactor) fn srq_memory_back(&self) -> bool {
        if !self.srq_refill {
            return false;
        }
        (0..self.devices.slots()).any(|d| {
            self.devices.get(d).is_some_and(|dev| {
                dev.srq.as_ref().and_then(|s| s.short_at).is_some_and(|at| at != dev.pool.ledger().returned())
            })
        })
    }

    /// Posts device `d`'s queued receives in one chain; each returns a credit to its
    /// connection once posted.
    fn post_srq(&mut self, d: usize) {
        let Some(dev) = self.devices.get_mut(d) else { return };
        let pool = dev.pool.clone();
        let Some(s) = dev.srq.as_mut().filter(|s| !s.failed) else { return };
        let mut queued = std::mem::take(&mut s.repost).into_iter();
        let mut wrs: Vec<RecvWr> = Vec::with_capacity(queued.len());
        let mut owners: SmallVec<[Option<Owner>; 16]> = SmallVec::new();
        let mut keys: Vec<SrqKey> = Vec::with_capacity(queued.len());
        let mut short = false;
        for r in queued.by_ref() {
            let buf = match r.buf {
                Some(b) => b,
                None => match pool.alloc_for(s.buf_size, NO_OWNER, s.account) {
                    Ok(b) => b,
                    Err(_) => {
                        // The pool is at its maximum: this and the rest wait for buffers to
                        // come back. One may come back with no event at all (a handler drops it
                        // in `on_closed`, after this tick's posting, or outside the reactor),
                        // so a short timer tries again.
                        s.repost.push(r);
                        short = true;
                        break;
                    }
                },
            };
            let mut buf = buf;
            buf.lend_to_device(buf.capacity());
            let (addr, len, lkey) = (buf.addr(), buf.post_capacity() as u32, buf.lkey());
            let k = s.slots.insert(buf);
            wrs.push(RecvWr { wr_id: k.token().as_u64(), addr, len, lkey });
            owners.push(r.owner);
            keys.push(k);
        }
        s.repost.extend(queued);
        s.short_at = short.then(|| pool.ledger().returned());
        // The retry's wait: short again after progress, doubled after a try that found nothing.
        self.srq_retry_wait =
            if wrs.is_empty() { (self.srq_retry_wait * 2).min(SRQ_RETRY_MAX) } else { SRQ_REFILL_RETRY };
        if short && !self.srq_refill {
            // `schedule_srq_retry`, with the device borrowed.
            self.srq_refill = true;
            if let Some(at) = Instant::now().checked_add(self.srq_retry_wait.max(SRQ_REFILL_RETRY)) {
                self.timers.schedule(at, TimerTarget::SrqRefill);
            }
        }
        if wrs.is_empty() {
            return;
        }
        // Why `unsafe` here, outside `src/sys/`: the post is `src/sys/`'s (`Srq::post_recv`); who
        // holds the buffers the device writes until their completion is this module's slot
        // table, so the argument that they live long enough can only be made here.
        #[allow(unsafe_code)]
        // SAFETY: every request names a pool `Buf` of this device's PD, held in the SRQ's slot
        // table until its completion is reaped or the SRQ is destroyed; a `Buf` keeps its region
        // registered. The slot table is dropped only with the `DevSrq`, and then the SRQ goes
        // first: the queue pairs that also hold it are all destroyed by then (a device's
        // resources are released only once no connection is on it, and `Core` drops its
        // connections before its devices), so `DevSrq`'s `Rc` is the last and its field order
        // destroys the SRQ before the buffers; should a queue pair still hold it, `DevSrq`'s
        // `Drop` leaks the buffers rather than free memory the device may still write.
        let r = unsafe { s.srq.post_recv(&wrs, &mut self.chains) };
        self.stats.srq_post_calls += 1;
        let n = r.as_ref().map_or_else(|e| e.posted, |()| wrs.len());
        self.stats.srq_posted += n as u64;
        self.stats.wrs_posted += n as u64;
        if n < wrs.len() {
            // Refused by the device: the SRQ is not usable any more.
            for k in &keys[n..] {
                s.slots.remove(*k);
            }
            s.failed = true;
        }
        // Each receive goes back to the connection whose peer consumed it, with one more if
        // it is busy, or to the free receives (`SrqBudget::on_repost`). Growth only while no
        // receive waits unposted (then every free receive is on the queue), and never for a
        // receive a credit-only message consumed.
        let all_posted = s.repost.is_empty();
        if !owners.is_empty() {
            // Grown shares age by the clock while others want growth (review N9).
            s.budget.set_now(self.clock.coarse.millis());
        }
        let mut dirty: SmallVec<[ConnKey; 16]> = SmallVec::new();
        for Owner { conn: t, share: of, control } in owners[..n].iter().flatten().copied() {
            let Some(c) = self.conns.get_mut(t) else { continue };
            let (Some(share), Some(flow)) = (c.srq_share.as_mut(), c.lanes.flow_mut()) else { continue };
            // `None`: queued for the connection's earlier queue pair, whose share `leave` freed
            // with this receive in it; it is free now, no credit of the new one (review L3).
            // What its peer holds or is about to, and what its connection withholds: receives
            // kept back from a connection that does not read are not its peer running low
            // (review of issue 45: they grew the share of a connection that did not read).
            let held = flow.unused() + flow.owed() + c.srq_withheld.total();
            let Some(verdict) = s.budget.repost_for(share, of, control, held, all_posted) else {
                continue;
            };
            match verdict {
                Share::Return => flow.on_repost(control),
                Share::Grow => {
                    flow.on_repost(control);
                    flow.grant_more();
                    flow.resize(share.receives);
                    self.stats.srq_grown += 1;
                }
                Share::Shrink => {
                    flow.resize(share.receives);
                    self.stats.srq_shrunk += 1;
                }
            }
            if flow.wants_control() {
                dirty.push(t);
            }
        }
        for t in dirty {
            self.mark_dirty(t);
        }
        if let Err(e) = r {
            let errno = e.error.raw_os_error().unwrap_or(0);
            self.fail_srq(d, CloseReason::Setup(format!("ibv_post_srq_recv failed: errno {errno}")));
            return;
        }
        let s = self.devices[d].srq.as_mut().expect("checked above");
        if s.low_water > 0 && !s.limit_armed && s.posted() >= s.low_water as usize {
            // Back at the mark: the next dip below it may raise one event. A failed arm is
            // tried again at the next posting.
            s.limit_armed = s.srq.arm_limit(s.low_water).is_ok();
        }
    }

    /// Device `d`'s SRQ cannot be used: every connection on it closes at once.
    pub(in crate::reactor) fn fail_srq(&mut self, d: usize, reason: CloseReason) {
        let Some(s) = self.devices.get_mut(d).and_then(|x| x.srq.as_mut()) else { return };
        s.failed = true;
        let on: Vec<ConnKey> = s.qps.values().collect();
        for t in on {
            self.feed(t, Input::Abort(reason.clone()));
        }
    }

    /// An asynchronous event naming an SRQ (`event_loop/device.rs`).
    /// True when it named this reactor's SRQ.
    pub(in crate::reactor) fn on_srq_event(&mut self, d: usize, kind: AsyncEventKind, srq: usize) -> bool {
        let ours = self.devices.get(d).and_then(|x| x.srq.as_ref()).is_some_and(|s| s.srq.identity() == srq);
        if !ours {
            self.stats.stale_async_events += 1;
            return false;
        }
        match kind {
            AsyncEventKind::SrqLimitReached => {
                self.stats.srq_limit_events += 1;
                // Disarmed by the device; armed again by the posting that brings the SRQ
                // back to its mark (`post_srq`), not now, while it is still below it.
                self.devices[d].srq.as_mut().expect("checked").limit_armed = false;
            }
            _ => self.fail_srq(d, CloseReason::AsyncEvent(kind)),
        }
        true
    }

    /// A completion of a receive posted to the SRQ of CQ `ct`'s device.
    pub(in crate::reactor) fn srq_complete(&mut self, ct: CqKey, wc: WorkCompletion, token: Token) {
        self.stats.srq_consumed += 1;
        let Some(d) = self.cqs.get(ct).map(|e| e.device) else { return };
        let Some(s) = self.devices.get_mut(d).and_then(|x| x.srq.as_mut()) else {
            self.stats.stale_completions += 1;
            return;
        };
        let Some(buf) = SrqKey::of(token).and_then(|k| s.slots.remove(k)) else {
            self.stats.stale_completions += 1;
            return;
        };
        let owner = s.qps.get(wc.qp_num).filter(|t| self.conns.contains(*t));
        let Some(t) = owner else {
            self.stats.srq_stale += 1;
            s.repost.push(Repost { buf: Some(buf), owner: None });
            return;
        };
        if wc.status != WcStatus::Success {
            s.repost.push(Repost { buf: Some(buf), owner: None });
            if let Some(input) = self.work_error(t, wc.status) {
                self.feed(t, input);
            }
            return;
        }
        let c = self.conns.get_mut(t).expect("checked");
        let c_owner = c.mem_owner;
        let account = c.account.filter(|r| r.device == d).map(|r| r.account);
        // The share its peer consumed the receive from: the credit goes back to that one only.
        let share = c.srq_share.map_or(0, |s| s.id());
        if c.lanes.flow_mut().is_some_and(|f| f.exhausted()) {
            // The peer sent beyond its credit: on a shared queue that takes receives other
            // connections were promised. The message is dropped and the connection closed.
            s.repost.push(Repost { buf: Some(buf), owner: None });
            self.stats.srq_overdrawn += 1;
            self.violated(t);
            let why = "the peer sent beyond its credit on the shared receive queue".to_string();
            return self.feed(t, Input::Fault(CloseReason::Protocol(why)));
        }
        let mut buf = buf;
        let mut byte_len = wc.byte_len;
        // The credits and kind: in the immediate data, or in the message's tail on a
        // transport without it (`proto::transport`).
        let imm = if c.placed.is_some_and(|p| p.tail) {
            let capacity = u32::try_from(buf.capacity()).unwrap_or(u32::MAX);
            match unframe(wc.byte_len, buf.tail_before(wc.byte_len as usize), capacity) {
                Ok(u) => {
                    byte_len = u.len;
                    u.imm
                }
                Err(why) => {
                    let s = self.devices[d].srq.as_mut().expect("checked");
                    s.repost.push(Repost { buf: Some(buf), owner: None });
                    self.violated(t);
                    return self.feed(t, Input::Fault(CloseReason::Protocol(why)));
                }
            }
        } else {
            // A message without immediate data (a peer breaking the protocol) grants nothing.
            wc.imm.map_or(Imm::data(0), Imm::decode)
        };
        // An iWARP agent's sends wait for its client's first message: this one.
        let released = c.lanes.release();
        let mut control = false;
        let mut farewell = Farewell::None;
        if let Some(flow) = c.lanes.flow_mut() {
            flow.on_receive(imm);
            control = imm.control;
            farewell = imm.farewell;
        }
        if control {
            c.meter.credit_message(false);
        }
        if released {
            self.mark_dirty(t);
        }
        let s = self.devices[d].srq.as_mut().expect("checked");
        if control {
            // A credit-only message: its buffer goes back unseen, and returns its credit.
            s.repost.push(Repost { buf: Some(buf), owner: Some(Owner { conn: t, share, control: true }) });
            // Its grant may let queued sends go.
            self.after_completion(t);
            return self.on_farewell(t, farewell);
        }
        let repost = Repost { buf: None, owner: Some(Owner { conn: t, share, control: false }) };
        // Exactly the bytes received (none for an RDMA WRITE with immediate data).
        buf.received(if wc.remote_write { 0 } else { byte_len as usize });
        // The message is this connection's; the rest of the chunk is foreign to it.
        let n = buf.len();
        buf.set_owner(c_owner, n);
        // And so is the chunk's charge: the device's account takes a fresh one for the re-post.
        if let Some(a) = account {
            buf.charge_to(a);
        }
        let completion = Completion {
            user_data: Completion::SRQ_RECV,
            opcode: OpCode::Recv,
            result: Ok(byte_len),
            buf: Some(buf),
            remote_write: wc.remote_write,
            region: None,
        };
        // The handler may keep the receive from being posted again (`Conn::withhold_receive`).
        // (Deliveries do not nest: a handler cannot poll. Should one, the outer re-post goes.)
        if let Some((pt, pd, prev)) = self.srq_delivering.replace((t, d, repost)) {
            debug_assert!(false, "nested SRQ deliveries");
            if let Some(s) = self.devices.get_mut(pd).and_then(|x| x.srq.as_mut()) {
                let _ = pt;
                s.repost.push(prev);
            }
        }
        self.deliver_completion_then(t, completion);
        if let Some((_, d, repost)) = self.srq_delivering.take() {
            self.srq_repost_or_withhold(t, d, repost, account);
        }
        if self.conns.get(t).is_some_and(|c| c.drained()) {
            self.feed(t, Input::Drained);
        }
    }

    /// The receive of a message delivered to `t` goes back to the queue, its credit with it,
    /// unless `t` holds more of the pool than it may: then it waits, withheld, until `t`'s
    /// buffers come back (`release_mem_withheld`). So a peer cannot make its connection hold
    /// more than its account allows by having the runtime post fresh receives for it while its
    /// handler keeps the messages.
    fn srq_repost_or_withhold(&mut self, t: ConnKey, d: usize, repost: Repost, account: Option<Account>) {
        let Some(dev) = self.devices.get_mut(d) else { return };
        let Some(s) = dev.srq.as_mut() else { return };
        let over = account.is_some_and(|a| !dev.pool.can_charge(a, s.buf_size));
        match self.conns.get_mut(t).filter(|_| over) {
            Some(c) => {
                if c.srq_withheld.for_memory == 0 {
                    s.mem_withheld.push(t);
                }
                c.srq_withheld.for_memory += 1;
                self.stats.srq_withheld += 1;
                self.schedule_srq_retry();
            }
            None => s.repost.push(repost),
        }
    }
}

mod budget;
#[cfg(test)]
mod tests;
