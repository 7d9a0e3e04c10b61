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
//! receiver-not-ready NAK.
//!
//! **Credit follows activity** (`SrqBudget::on_repost`, at that re-post): a connection whose
//! peer ran low (all but a quarter of its share consumed and not yet granted back) and sent a
//! share's worth of messages since it was admitted or last grew (so a handshake grows nothing)
//! gets the receive back with one more from the free ones (`Flow::grant_more`: owed like any re-posted
//! receive, it rides the next grant), up to `SrqConfig::max_credit`, while more than an
//! eighth of the queue is free, and only when no receive waits unposted, so that every free
//! receive is on the queue. A connection whose peer sent a whole share's worth of messages
//! without once running low keeps the receive instead of granting it back (its share one
//! smaller), down to its base, as does every grown one while fewer than an eighth are free.
//! The share never falls below the base (at least `MIN_DEPTH`), so flow control's guarantee
//! of progress holds as with a fixed depth. Grants cannot be taken back: a peer that stops
//! sending keeps its share until it sends again. `Stats::srq_grown`, `srq_shrunk`,
//! `srq_free`. The rule is unit-tested with a model of the SRQ (connections streaming,
//! ping-ponging, idle, joining and leaving; at every step no message finds the queue below its
//! reserve and every receive is in one place).
//!
//! **Peers that do not.** Flow control is required (`setup.rs`: a request that does not offer
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
//! `on_closed` after the tick's posting), a short timer (`TimerTarget::SrqRefill`, 5 ms) tries
//! the refill again for as long as receives wait.
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
use crate::sys::pool::{Buf, NO_OWNER};
use crate::sys::qp::RecvWr;
use crate::sys::srq::Srq;

/// How soon receives left unposted for want of pool buffers are tried again.
const SRQ_REFILL_RETRY: Duration = Duration::from_millis(5);

/// The credit rule's arithmetic, pure: which connections an SRQ of `receives` receives admits,
/// and how much of it each is granted. Every receive is in exactly one place: the `reserve`
/// (granted to nobody: what a peer that breaks its credit consumes before it is closed), a
/// connection's share (granted to its peer, owed to it, or consumed by its peer and waiting to
/// be posted again), or `free`. So `reserve + free + Σ shares = receives` at every moment,
/// and a connection's grants never exceed its share.
///
/// A connection is admitted with a share of `credit` (the base, at least `MIN_DEPTH`) while
/// `free` covers it. Its share then follows what its peer needs ([`SrqBudget::on_repost`]):
/// a peer that ran low (it had used all but a quarter of its grants when one of its receives
/// came back), having sent a share's worth of messages since the connection was admitted or
/// last grew, is granted one more from `free`, up to `max_credit`, while more than `keep`
/// receives are free (room kept for connections yet to come); a connection whose peer sent
/// a whole share's worth of messages without once running low gives one back, down to the
/// base, and so does every grown one while fewer than `keep` are free. A share never falls
/// below the base, so a peer is never left without the credit flow control needs to go on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SrqBudget {
    receives: u32,
    credit: u32,
    max_credit: u32,
    reserve: u32,
    keep: u32,
    conns: u32,
    free: u32,
}

/// One connection's share of its SRQ ([`SrqBudget`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ConnShare {
    /// Receives of the SRQ it holds: granted to its peer, owed to it, or consumed and waiting
    /// to be posted again.
    pub(crate) receives: u32,
    /// Its receives posted again since its peer last ran low.
    quiet: u32,
    /// Its receives posted again since it was admitted or last grew.
    since_growth: u32,
}

impl ConnShare {
    /// A connection just admitted with `credit`.
    pub(crate) fn new(credit: u32) -> ConnShare {
        ConnShare { receives: credit, quiet: 0, since_growth: 0 }
    }
}

/// What one of a connection's receives, posted again, does to its share ([`SrqBudget::on_repost`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Share {
    /// Granted back to the connection: its share stays.
    Return,
    /// Granted back with one more from the free receives: its share grew by one.
    Grow,
    /// Not granted back: it is free now, and the connection's share one smaller.
    Shrink,
}

impl SrqBudget {
    /// An SRQ of `receives`, connections starting at `credit` and growing to `max_credit`,
    /// `reserve` granted to nobody.
    pub(crate) fn new(receives: u32, credit: u32, max_credit: u32, reserve: u32) -> SrqBudget {
        let credit = credit.max(1);
        SrqBudget {
            receives,
            credit,
            max_credit: max_credit.max(credit),
            reserve,
            keep: receives / KEEP_FREE_DIVISOR,
            conns: 0,
            free: receives.saturating_sub(reserve),
        }
    }

    /// Admits one more connection with a share of `credit`, if the free receives cover it.
    pub(crate) fn admit(&mut self) -> bool {
        let fits = self.free >= self.credit;
        if fits {
            self.free -= self.credit;
            self.conns += 1;
        }
        fits
    }

    /// A connection holding `share` receives left: they are free again.
    pub(crate) fn leave(&mut self, share: u32) {
        self.conns = self.conns.saturating_sub(1);
        self.free = self.free.saturating_add(share).min(self.receives.saturating_sub(self.reserve));
    }

    /// The most connections the SRQ admits (each at its base credit).
    pub(crate) fn max_conns(&self) -> u32 {
        self.receives.saturating_sub(self.reserve) / self.credit
    }

    /// The base credit: what a connection is admitted with and advertises.
    pub(crate) fn credit(&self) -> u32 {
        self.credit
    }

    /// Receives in no connection's share and not in the reserve.
    pub(crate) fn free(&self) -> u32 {
        self.free
    }

    /// One of a connection's receives, consumed by its peer, has been posted again: whether it
    /// goes back to the connection, with one more, or to the free receives. `share` is the
    /// connection's (updated here); `held` what its peer holds or is about to: its grants not
    /// yet consumed, messages in flight included, plus the receives owed to it, this one not
    /// counted ([`Flow::unused`](crate::proto::flow::Flow::unused) +
    /// [`Flow::owed`](crate::proto::flow::Flow::owed)); `all_posted`: no receive of the SRQ
    /// waits to be posted, so every free one is on the queue and may be granted.
    ///
    /// The peer ran low when `held` is at most a quarter of the share (at least 1): a peer that
    /// spent all it could (it keeps one credit back) is at 1 when the first receive of its
    /// burst comes back; a ping-pong peer is at `share - 1`. It grows only if it also sent a
    /// whole share's worth of messages since it was admitted or last grew: a connection's
    /// first few messages (a handshake, a credit-only message beside it) grow nothing, else
    /// thousands of connections that each said hello once would hold the free receives.
    pub(crate) fn on_repost(&mut self, share: &mut ConnShare, held: u32, all_posted: bool) -> Share {
        let s = share.receives;
        let ran_low = held <= (s / 4).max(1);
        share.since_growth = share.since_growth.saturating_add(1);
        if ran_low {
            share.quiet = 0;
        } else {
            share.quiet = share.quiet.saturating_add(1);
        }
        // A whole share's worth without running low, not less: a peer held back by its credit
        // runs low once per burst (the first of its receives to come back), and the rest of the
        // burst's receives come back with more and more owed to it.
        if s > self.credit && (share.quiet >= s || self.free < self.keep) {
            share.receives -= 1;
            share.quiet = 0;
            self.free += 1;
            return Share::Shrink;
        }
        if ran_low && share.since_growth >= s && all_posted && s < self.max_credit && self.free > self.keep {
            share.receives += 1;
            share.since_growth = 0;
            self.free -= 1;
            return Share::Grow;
        }
        Share::Return
    }

    /// Connections admitted now.
    #[cfg(test)]
    pub(crate) fn conns(&self) -> u32 {
        self.conns
    }
}

/// Shares grow only while more than `receives / KEEP_FREE_DIVISOR` receives are free: room kept
/// for connections yet to come (a grown share comes back only as its peer sends).
const KEEP_FREE_DIVISOR: u32 = 8;

/// A receive to post (again): its buffer (none: allocate a fresh one), and the connection
/// whose credit it returns once posted, with whether a credit-only message consumed it.
pub(in crate::reactor) struct Repost {
    buf: Option<Buf>,
    owner: Option<(ConnKey, bool)>,
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

    /// Posts every device's queued SRQ receives (start of the tick's posting).
    pub(in crate::reactor) fn post_srqs(&mut self) {
        if self.cfg.srq.is_none() {
            return;
        }
        for d in 0..self.devices.slots() {
            if self.devices.get(d).and_then(|x| x.srq.as_ref()).is_some_and(|s| !s.repost.is_empty()) {
                self.post_srq(d);
            }
        }
    }

    /// Posts device `d`'s queued receives in one chain; each returns a credit to its
    /// connection once posted.
    fn post_srq(&mut self, d: usize) {
        let Some(dev) = self.devices.get_mut(d) else { return };
        let pool = dev.pool.clone();
        let Some(s) = dev.srq.as_mut().filter(|s| !s.failed) else { return };
        let mut queued = std::mem::take(&mut s.repost).into_iter();
        let mut wrs: Vec<RecvWr> = Vec::with_capacity(queued.len());
        let mut owners: SmallVec<[Option<(ConnKey, bool)>; 16]> = SmallVec::new();
        let mut keys: Vec<SrqKey> = Vec::with_capacity(queued.len());
        for r in queued.by_ref() {
            let buf = match r.buf {
                Some(b) => b,
                None => match pool.alloc(s.buf_size, NO_OWNER) {
                    Ok(b) => b,
                    Err(_) => {
                        // The pool is at its maximum: this and the rest wait for buffers to
                        // come back. One may come back with no event at all (a handler drops it
                        // in `on_closed`, after this tick's posting, or outside the reactor),
                        // so a short timer tries again.
                        s.repost.push(r);
                        if !self.srq_refill {
                            self.srq_refill = true;
                            if let Some(at) = Instant::now().checked_add(SRQ_REFILL_RETRY) {
                                self.timers.schedule(at, TimerTarget::SrqRefill);
                            }
                        }
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
        if wrs.is_empty() {
            return;
        }
        #[allow(unsafe_code)]
        // SAFETY: every request names a pool `Buf` of this device's PD, held in the SRQ's slot
        // table until its completion is reaped or the SRQ is destroyed; a `Buf` keeps its region
        // registered. The slot table is dropped only with the `DevSrq`, and then the SRQ goes
        // first: the queue pairs that also hold it are all destroyed by then (a device's
        // resources are released only once no connection is on it, and `Core` drops its
        // connections before its devices), so `DevSrq`'s `Rc` is the last and its field order
        // destroys the SRQ before the buffers; should a queue pair still hold it, `DevSrq`'s
        // `Drop` leaks the buffers rather than free memory the device may still write.
        let r = unsafe { s.srq.post_recv(&wrs) };
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
        // receive waits unposted: then every free receive is on the queue.
        let all_posted = s.repost.is_empty();
        let mut dirty: SmallVec<[ConnKey; 16]> = SmallVec::new();
        for (t, control) in owners[..n].iter().flatten().copied() {
            let Some(c) = self.conns.get_mut(t) else { continue };
            let (Some(share), Some(flow)) = (c.srq_share.as_mut(), c.sq.flow_mut()) else { continue };
            match s.budget.on_repost(share, flow.unused() + flow.owed(), all_posted) {
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

    /// An asynchronous event naming an SRQ (`device.rs`).
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
        if c.sq.flow_mut().is_some_and(|f| f.exhausted()) {
            // The peer sent beyond its credit: on a shared queue that takes receives other
            // connections were promised. The message is dropped and the connection closed.
            s.repost.push(Repost { buf: Some(buf), owner: None });
            self.stats.srq_overdrawn += 1;
            let why = "the peer sent beyond its credit on the shared receive queue".to_string();
            return self.feed(t, Input::Fault(CloseReason::Protocol(why)));
        }
        let mut buf = buf;
        let mut byte_len = wc.byte_len;
        // The credits and kind: in the immediate data, or in the message's tail on a
        // transport without it (`proto::transport`).
        let imm = if c.placed.is_some_and(|p| p.tail) {
            match unframe(wc.byte_len, buf.tail_before(wc.byte_len as usize)) {
                Ok(u) => {
                    byte_len = u.len;
                    u.imm
                }
                Err(why) => {
                    let s = self.devices[d].srq.as_mut().expect("checked");
                    s.repost.push(Repost { buf: Some(buf), owner: None });
                    return self.feed(t, Input::Fault(CloseReason::Protocol(why)));
                }
            }
        } else {
            // A message without immediate data (a peer breaking the protocol) grants nothing.
            wc.imm.map_or(Imm::data(0), Imm::decode)
        };
        // An iWARP agent's sends wait for its client's first message: this one.
        let released = c.sq.release();
        let mut control = false;
        let mut farewell = Farewell::None;
        if let Some(flow) = c.sq.flow_mut() {
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
            s.repost.push(Repost { buf: Some(buf), owner: Some((t, true)) });
            // Its grant may let queued sends go.
            self.after_completion(t);
            return self.on_farewell(t, farewell);
        }
        s.repost.push(Repost { buf: None, owner: Some((t, false)) });
        // Exactly the bytes received (none for an RDMA WRITE with immediate data).
        buf.received(if wc.remote_write { 0 } else { byte_len as usize });
        // The message is this connection's; the rest of the chunk is foreign to it.
        let n = buf.len();
        buf.set_owner(c_owner, n);
        let completion = Completion {
            user_data: Completion::SRQ_RECV,
            opcode: OpCode::Recv,
            result: Ok(byte_len),
            buf: Some(buf),
            remote_write: wc.remote_write,
            region: None,
        };
        self.deliver_completion(t, completion);
        self.after_completion(t);
        if self.conns.get(t).is_some_and(|c| c.drained()) {
            self.feed(t, Input::Drained);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::{ConnShare, QpMap, Share, SrqBudget};
    use crate::proto::flow::{Flow, Imm, MIN_DEPTH};
    use crate::proto::token::{ConnKey, GenSlab};

    #[test]
    fn the_qp_map_finds_each_connection_by_its_queue_pair() {
        let mut slab: GenSlab<ConnKey, ()> = GenSlab::new();
        let keys: Vec<ConnKey> = (0..50).map(|_| slab.insert(())).collect();
        let mut m = QpMap::default();
        // Out of order, as the kernel hands out numbers.
        for (i, k) in keys.iter().enumerate() {
            m.insert(((i * 37) % 50) as u32 + 17, *k);
        }
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(m.get(((i * 37) % 50) as u32 + 17), Some(*k));
        }
        assert_eq!(m.get(16), None);
        assert_eq!(m.get(67), None);
        m.remove(17);
        assert_eq!(m.get(17), None);
        m.remove(17);
        assert_eq!(m.values().count(), 49);
        m.insert(18, keys[0]);
        assert_eq!(m.get(18), Some(keys[0]), "a number reused names its new connection");
    }

    #[test]
    fn the_credit_rule_admits_exactly_what_the_receives_cover() {
        let mut b = SrqBudget::new(8, 3, 3, 0);
        assert_eq!(b.max_conns(), 2);
        assert!(b.admit());
        assert!(b.admit());
        assert!(!b.admit(), "a third connection would need 9 receives of 8");
        assert_eq!(b.conns(), 2);
        b.leave(3);
        assert!(b.admit(), "room again after one left");
        b.leave(3);
        b.leave(3);
        b.leave(3);
        assert_eq!(b.conns(), 0, "leaving never underflows");
        assert_eq!(b.free(), 8, "nor frees more than there is");
    }

    #[test]
    fn the_credit_rule_does_not_overflow() {
        let mut b = SrqBudget::new(u32::MAX, u32::MAX, u32::MAX, 0);
        assert!(b.admit());
        assert!(!b.admit());
        let mut z = SrqBudget::new(10, 0, 0, 0);
        assert_eq!(z.max_conns(), 10, "a zero credit counts as one (Config::validate refuses it)");
        assert!(z.admit());
    }

    /// `SrqConfig::max_connections` (what the tail-ring pool is sized for, read from the
    /// budget's own rule) is what the budget admits: 10 085 at the defaults, and the next is
    /// refused.
    #[test]
    fn the_config_says_what_the_budget_admits() {
        for cfg in [
            crate::SrqConfig::default(),
            crate::SrqConfig { receives: 80, credit: 4, reserve: 64, ..Default::default() },
            crate::SrqConfig { receives: 60, credit: 4, reserve: 64, ..Default::default() },
        ] {
            let mut b = SrqBudget::new(cfg.receives, cfg.credit, cfg.max_credit, cfg.reserve);
            assert_eq!(b.max_conns(), cfg.max_connections(), "{cfg:?}");
            for _ in 0..cfg.max_connections() {
                assert!(b.admit());
            }
            assert!(!b.admit(), "{cfg:?}");
        }
        assert_eq!(crate::SrqConfig::default().max_connections(), 10_085);
    }

    /// Finding 2 of the hostile review: the reserve is never granted to a connection, not even
    /// to a busy one growing.
    #[test]
    fn the_reserve_is_granted_to_no_connection() {
        let mut b = SrqBudget::new(80, 4, 4, 64);
        assert_eq!(b.max_conns(), 4);
        for _ in 0..4 {
            assert!(b.admit());
        }
        assert!(!b.admit(), "a fifth connection would take the reserve");
        assert_eq!(SrqBudget::new(60, 4, 4, 64).max_conns(), 0, "a reserve above the receives admits nothing");
        assert!(!SrqBudget::new(60, 4, 4, 64).admit());
        let mut g = SrqBudget::new(80, 4, 1000, 64);
        assert!(g.admit());
        let mut share = ConnShare::new(4);
        for _ in 0..10_000 {
            g.on_repost(&mut share, 0, true);
        }
        assert_eq!(share.receives + g.free() + 64, 80, "grown into the free receives only");
        assert!(g.free() <= 80 / 8 + 1, "and no further than the room kept for newcomers");
    }

    /// 5 000 connections of credit 3 on 15 360 receives: every one admitted, the 5 121st not.
    #[test]
    fn five_thousand_connections_fit_their_receives() {
        let mut b = SrqBudget::new(15_360, 3, 32, 0);
        for _ in 0..5_120 {
            assert!(b.admit());
        }
        assert!(!b.admit());
    }

    /// The defaults (`SrqConfig::default`): 10 085 connections at their base credit, in
    /// receives that fit Soft-RoCE's CQ and leave 1 536 chunks of their eight clusters free.
    #[test]
    fn the_defaults_admit_10085_connections() {
        let d = crate::SrqConfig::default();
        let mut b = SrqBudget::new(d.receives, d.credit, d.max_credit, d.reserve);
        assert_eq!(b.max_conns(), 10_085);
        for _ in 0..10_085 {
            assert!(b.admit());
        }
        assert!(!b.admit());
        assert!(d.receives <= 32_767, "rxe's max_cqe");
        let chunks = 8 * (4 << 20) / d.buf_size;
        assert_eq!(chunks - d.receives, 1_536);
    }

    #[test]
    fn a_peer_that_runs_low_grows_its_share_and_one_that_does_not_gives_it_back() {
        let mut b = SrqBudget::new(1024, 3, 32, 0);
        assert!(b.admit());
        let mut share = ConnShare::new(3);
        assert_eq!(b.on_repost(&mut share, 1, true), Share::Return, "low, but its first message: a hello");
        assert_eq!(b.on_repost(&mut share, 2, true), Share::Return, "two of three unused: not low");
        assert_eq!(b.on_repost(&mut share, 1, false), Share::Return, "low, but a receive waits unposted");
        for want in 4..=32 {
            // A share's worth of messages, running low, for each receive more (the first: the
            // three above were a share's worth already).
            for _ in 0..if want == 4 { 0 } else { want - 2 } {
                assert_eq!(b.on_repost(&mut share, 1, true), Share::Return);
            }
            assert_eq!(b.on_repost(&mut share, 1, true), Share::Grow);
            assert_eq!(share.receives, want);
        }
        assert_eq!(b.on_repost(&mut share, 1, true), Share::Return, "at max_credit");
        assert_eq!(b.free(), 1024 - 32);
        // A stream that runs low once per share's worth of messages keeps its share.
        for _ in 0..100 {
            for _ in 0..31 {
                assert_eq!(b.on_repost(&mut share, 20, true), Share::Return);
            }
            assert_eq!(b.on_repost(&mut share, 8, true), Share::Return, "low (a quarter left)");
        }
        // Its peer now never runs low (a ping-pong): one back per share's worth of messages.
        let mut messages = 0;
        while share.receives > 3 {
            let before = share.receives;
            let got = b.on_repost(&mut share, before - 1, true);
            messages += 1;
            assert!(got == Share::Return || (got == Share::Shrink && share.receives == before - 1));
        }
        assert_eq!(messages, (4..=32).sum::<u32>(), "a share's worth of messages per receive given back");
        for _ in 0..100 {
            assert_eq!(b.on_repost(&mut share, 2, true), Share::Return, "never below the base");
        }
        assert_eq!(b.free(), 1024 - 3);
    }

    #[test]
    fn growth_stops_and_shares_shrink_when_newcomers_need_the_room() {
        // 1 024 receives keep 128 free for newcomers.
        let mut b = SrqBudget::new(1024, 3, 64, 0);
        assert!(b.admit());
        let mut busy = ConnShare::new(3);
        for _ in 0..10_000 {
            b.on_repost(&mut busy, 0, true);
        }
        assert_eq!(busy.receives, 64);
        let mut n = 1;
        while b.free() >= 3 + 128 {
            assert!(b.admit());
            n += 1;
        }
        assert_eq!(b.on_repost(&mut busy, 0, true), Share::Return, "at the room kept: no growth");
        while b.admit() {
            n += 1;
        }
        assert!(b.free() < 3, "admitted down to the last receive");
        assert_eq!(b.on_repost(&mut busy, 0, true), Share::Shrink, "few free: even a busy one gives back");
        for _ in 0..60 {
            b.on_repost(&mut busy, 0, true);
        }
        assert_eq!(busy.receives, 3);
        while b.admit() {
            n += 1;
        }
        assert_eq!(n, 1024 / 3, "every connection the receives cover, once the busy one is back at its base");
    }

    /// A model of the shared receive queue on the host, as `Flow`'s is: connections of four
    /// kinds (streaming, ping-pong, streaming then ping-pong, idle) on one SRQ, the server's
    /// side of each with its `Flow` and share, the client's with its own receives; messages
    /// land (consuming a receive of the SRQ), are reaped, and their receives posted again
    /// (granted back, grown or shrunk by `SrqBudget::on_repost`) in random order; idle
    /// connections join and leave. At every step: no message lands on an SRQ without a
    /// receive beyond the reserve (no RNR, the reserve untouched), no peer sends beyond its
    /// credit, every receive is in exactly one place (`reserve + free + shares = receives`),
    /// each share is its peer's unused grants plus what is owed plus what waits to be posted,
    /// and within `credit..=max_credit`. At the end: every message delivered, the streams grew,
    /// and the connections that turned to ping-pong are back at the base.
    fn simulate_srq(receives: u32, credit: u32, max_credit: u32, reserve: u32, seed: u64) {
        #[derive(Clone, Copy, PartialEq, Eq, Debug)]
        enum Kind {
            Stream,
            PingPong,
            StreamThenPingPong,
            Idle,
        }
        struct C {
            kind: Kind,
            server: Flow,
            client: Flow,
            share: ConnShare,
            peak: u32,
            /// Messages the client still sends in its streaming phase, then in ping-pong.
            stream: u32,
            pings: u32,
            awaiting: bool,
            replies: u32,
            wire: VecDeque<Imm>,
            unreaped: VecDeque<Imm>,
            queued: u32,
            delivered: u32,
            expected: u32,
            gone: bool,
        }
        const CLIENT_DEPTH: u32 = 64;
        let new_conn = |kind: Kind, stream: u32, pings: u32| C {
            kind,
            server: Flow::new(CLIENT_DEPTH, credit),
            client: Flow::new(credit, CLIENT_DEPTH),
            share: ConnShare::new(credit),
            peak: credit,
            stream,
            pings,
            awaiting: false,
            replies: 0,
            wire: VecDeque::new(),
            unreaped: VecDeque::new(),
            queued: 0,
            delivered: 0,
            expected: stream + pings,
            gone: false,
        };
        let mut b = SrqBudget::new(receives, credit, max_credit, reserve);
        let mut conns: Vec<C> = Vec::new();
        for (kind, stream, pings) in [
            (Kind::Stream, 1500, 0),
            (Kind::Stream, 1000, 0),
            (Kind::PingPong, 0, 300),
            (Kind::StreamThenPingPong, 1000, 700),
            (Kind::StreamThenPingPong, 500, 800),
            (Kind::Idle, 0, 0),
        ] {
            assert!(b.admit(), "the first connections fit");
            conns.push(new_conn(kind, stream, pings));
        }
        let mut posted = receives;
        // Receives reaped and waiting to be posted again, in order: (connection, control).
        let mut repost: VecDeque<(usize, bool)> = VecDeque::new();
        let mut rng = seed | 1;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let (mut grown, mut shrunk, mut idle_rounds) = (0u32, 0u32, 0u32);
        for _step in 0..2_000_000 {
            let r = next();
            let i = (r >> 16) as usize % conns.len();
            let mut progressed = false;
            match r % 6 {
                // The client sends data (a stream, or a ping when no reply is awaited), or a
                // credit-only message.
                0 => {
                    let c = &mut conns[i];
                    if !c.gone {
                        let ping = c.stream == 0 && c.pings > 0 && !c.awaiting;
                        if (c.stream > 0 || ping) && c.client.can_send_data() {
                            let imm = c.client.send_data();
                            if c.stream > 0 {
                                c.stream -= 1;
                            } else {
                                c.pings -= 1;
                                c.awaiting = true;
                            }
                            c.wire.push_back(imm);
                            progressed = true;
                        } else if c.client.wants_control() {
                            let imm = c.client.send_control();
                            c.wire.push_back(imm);
                            progressed = true;
                        }
                    }
                }
                // A message lands: the device takes a receive of the SRQ.
                1 => {
                    if let Some(imm) = conns[i].wire.pop_front() {
                        assert!(posted > reserve, "RNR or the reserve taken: a message landed with {posted} posted");
                        posted -= 1;
                        conns[i].unreaped.push_back(imm);
                        progressed = true;
                    }
                }
                // The server reaps one.
                2 => {
                    let c = &mut conns[i];
                    if let Some(imm) = c.unreaped.pop_front() {
                        assert!(!c.server.exhausted(), "a peer keeping to its credit overdrew it");
                        c.server.on_receive(imm);
                        c.queued += 1;
                        repost.push_back((i, imm.control));
                        if !imm.control {
                            c.delivered += 1;
                            if c.awaiting {
                                c.replies += 1;
                            }
                        }
                        progressed = true;
                    }
                }
                // The tick's posting: every waiting receive, or (a pool short of buffers) some.
                3 => {
                    if !repost.is_empty() {
                        let n = if next() % 4 == 0 { 1 + next() as usize % repost.len() } else { repost.len() };
                        let batch: Vec<(usize, bool)> = repost.drain(..n).collect();
                        let all_posted = repost.is_empty();
                        for (j, control) in batch {
                            posted += 1;
                            let c = &mut conns[j];
                            c.queued -= 1;
                            let held = c.server.unused() + c.server.owed();
                            match b.on_repost(&mut c.share, held, all_posted) {
                                Share::Return => c.server.on_repost(control),
                                Share::Grow => {
                                    c.server.on_repost(control);
                                    c.server.grant_more();
                                    c.server.resize(c.share.receives);
                                    grown += 1;
                                }
                                Share::Shrink => {
                                    c.server.resize(c.share.receives);
                                    shrunk += 1;
                                }
                            }
                            c.peak = c.peak.max(c.share.receives);
                        }
                        progressed = true;
                    }
                }
                // The server answers a ping (its grants ride on it), or sends a credit-only
                // message; the client's own receives are always posted again at once.
                4 => {
                    let c = &mut conns[i];
                    if c.replies > 0 && c.server.can_send_data() {
                        let imm = c.server.send_data();
                        c.replies -= 1;
                        c.awaiting = false;
                        c.client.on_receive(imm);
                        c.client.on_repost(false);
                        progressed = true;
                    } else if c.server.wants_control() {
                        let imm = c.server.send_control();
                        c.client.on_receive(imm);
                        c.client.on_repost(true);
                        progressed = true;
                    }
                }
                // Now and then an idle connection joins, or a quiet idle one leaves.
                _ => {
                    if next() % 64 == 0 {
                        let idle = conns.iter().filter(|c| c.kind == Kind::Idle && !c.gone).count();
                        if next() % 2 == 0 && idle < 24 {
                            if b.admit() {
                                // In the place of one that left (nothing of it is queued), so the
                                // list stays short.
                                match conns.iter().position(|c| c.gone) {
                                    Some(k) => conns[k] = new_conn(Kind::Idle, 0, 0),
                                    None => conns.push(new_conn(Kind::Idle, 0, 0)),
                                }
                            }
                        } else if let Some(c) = conns.iter_mut().find(|c| {
                            c.kind == Kind::Idle
                                && !c.gone
                                && c.wire.is_empty()
                                && c.unreaped.is_empty()
                                && c.queued == 0
                        }) {
                            c.gone = true;
                            b.leave(c.share.receives);
                        }
                    }
                }
            }
            let held: u32 = conns.iter().filter(|c| !c.gone).map(|c| c.share.receives).sum();
            assert_eq!(reserve + b.free() + held, receives, "every receive in exactly one place");
            for c in conns.iter().filter(|c| !c.gone) {
                let share = c.share.receives;
                assert_eq!(share, c.server.unused() + c.server.owed() + c.queued, "{:?}'s share", c.kind);
                assert!((credit..=max_credit.max(credit)).contains(&share), "{:?}'s share {share}", c.kind);
            }
            idle_rounds = if progressed { 0 } else { idle_rounds + 1 };
            if idle_rounds > 20_000 {
                break;
            }
        }
        for c in &conns {
            assert_eq!(
                c.delivered,
                c.expected,
                "{:?}: every message delivered (SRQ {receives}/{credit}/{max_credit}/{reserve}: share {}, server's peer unused {} owed {}, client's credits {} unused {} owed {}, free {}; wire {} unreaped {} queued {} stream {} pings {} awaiting {} replies {}; idle rounds {idle_rounds})",
                c.kind,
                c.share.receives,
                c.server.unused(),
                c.server.owed(),
                c.client.credits(),
                c.client.unused(),
                c.client.owed(),
                b.free(),
                c.wire.len(),
                c.unreaped.len(),
                c.queued,
                c.stream,
                c.pings,
                c.awaiting,
                c.replies
            );
            assert!(c.wire.is_empty() && c.unreaped.is_empty() && c.queued == 0, "quiescent");
        }
        assert!(repost.is_empty());
        if max_credit > credit {
            assert!(grown > 0 && shrunk > 0, "grew {grown}, shrank {shrunk}");
            for c in conns.iter().filter(|c| c.kind == Kind::Stream) {
                assert!(c.peak > credit, "a stream of {} grew (peak {})", c.expected, c.peak);
            }
            for c in conns.iter().filter(|c| matches!(c.kind, Kind::StreamThenPingPong | Kind::PingPong)) {
                assert_eq!(c.share.receives, credit, "{:?} is back at the base after its ping-pong (peak {}, SRQ {receives}/{credit}/{max_credit}/{reserve}, quiet {})", c.kind, c.peak, c.share.quiet);
            }
        }
    }

    #[test]
    fn srq_credit_follows_activity_no_rnr_no_loss() {
        let mut seed = 0x5eed_0f5a_5000_0001u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            seed
        };
        // Roomy, tight (growth stops near the kept room), with a reserve, static shares, and
        // the defaults.
        for (receives, credit, max_credit, reserve) in [
            (1024, 3, 32, 0),
            (256, 3, 32, 16),
            (64, 3, 16, 8),
            (48, MIN_DEPTH, 8, 4),
            (96, 4, 4, 0),
            (4096, 3, 32, 256),
        ] {
            for _ in 0..3 {
                simulate_srq(receives, credit, max_credit, reserve, next());
            }
        }
    }
}
