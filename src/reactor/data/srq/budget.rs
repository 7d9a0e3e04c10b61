//! The SRQ credit rule's arithmetic, pure (no FFI, no `Core`): which connections a shared
//! receive queue admits and how each connection's share follows its peer's activity. The
//! module doc of `srq/mod.rs` says why; this file is the rule, unit-tested in `tests.rs` with a
//! model of the SRQ.

/// The credit rule's arithmetic, pure: which connections an SRQ of `receives` receives admits,
/// and how much of it each is granted. Every receive is in exactly one place: the `reserve`
/// (granted to nobody: what a peer that breaks its credit consumes before it is closed), a
/// connection's share (granted to its peer, owed to it, or consumed by its peer and waiting to
/// be posted again), or `free`. So `reserve + free + Σ shares = receives` at every moment,
/// and a connection's grants never exceed its share.
///
/// A connection is admitted with a share of `credit` (the base, at least `MIN_DEPTH`) while
/// `free` covers it. Its share then follows what its peer needs ([`SrqBudget::on_repost`]):
/// a peer that ran low on a data message (it had used all but a quarter of its grants when
/// the receive came back), having sent a share's worth of data messages since the connection
/// was admitted or last grew, is granted one more from `free`, up to `max_credit`, while more
/// than `keep` receives are free (room kept for connections yet to come) and the shares
/// together hold fewer than `grow_cap` beyond their bases; a connection whose peer sent a
/// whole share's worth of messages without once running low gives one back, down to the
/// base, and so does every grown one while fewer than `keep` are free, and every one whose
/// peer sent no data while the queue took `receives` data messages of others (it lapsed:
/// every receive of its that comes back is kept until it is at its base). Credit-only
/// messages never grow a share. A share never falls below the base, so a peer is never left
/// without the credit flow control needs to go on.
///
/// Grants cannot be taken back, so a peer that grew its share and went silent holds it until
/// it sends again; `grow_cap` bounds what all such peers together can hold: connections are
/// always admitted up to `(receives - reserve - grow_cap) / credit`, whatever the peers did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SrqBudget {
    pub(super) receives: u32,
    pub(super) credit: u32,
    pub(super) max_credit: u32,
    pub(super) reserve: u32,
    pub(super) keep: u32,
    /// The most receives the shares together hold beyond their bases.
    pub(super) grow_cap: u32,
    /// Receives the shares together hold beyond their bases now (`Σ (share - credit)`).
    pub(super) grown: u32,
    pub(super) conns: u32,
    pub(super) free: u32,
    /// Data messages whose receives were posted again, over every connection: the queue's
    /// traffic, by which a peer's silence is measured.
    pub(super) traffic: u64,
    /// The time, in milliseconds of the caller's clock ([`SrqBudget::set_now`]; 0 if it never
    /// says), by which grown shares age.
    pub(super) now: u64,
    /// When a share that would have grown last could not because the growth pool was full
    /// (`grown == grow_cap`): others want the growth that grown shares hold.
    pub(super) contended_at: Option<u64>,
}

/// The next [`ConnShare::id`], unique in the process: a connection that reconnects can move to
/// another device, whose SRQ must not know its earlier share's id as one of its own (review
/// of the L3 fix: per-SRQ counters repeat across devices).
static NEXT_SHARE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// One connection's share of its SRQ ([`SrqBudget`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ConnShare {
    /// Receives of the SRQ it holds: granted to its peer, owed to it, or consumed and waiting
    /// to be posted again.
    pub(crate) receives: u32,
    /// Its receives posted again since its peer last ran low.
    pub(super) quiet: u32,
    /// Its receives a data message consumed posted again since it was admitted, last grew or
    /// lapsed.
    pub(super) since_growth: u32,
    /// [`SrqBudget::traffic`] when a data message of its peer last had its receive posted
    /// again (0 before the first: a share at its base cannot lapse, and a share grows only
    /// after data messages).
    pub(super) last_data: u64,
    /// Its peer left the grown share unused while the queue took `receives` data messages of
    /// others: each of its receives that comes back is kept until the share is at its base.
    pub(super) lapsed: bool,
    /// [`SrqBudget::now`] when it last grew.
    pub(super) grew_at: u64,
    /// Which admission to its SRQ this share is ([`SrqBudget::new_share`]; 0 for one made by
    /// [`ConnShare::new`]): a connection that reconnects keeps its key but gets a new share
    /// with its new queue pair, and a receive queued for posting again on behalf of the old
    /// one names the old admission, so it is never credited to the new one
    /// ([`SrqBudget::repost_for`]).
    pub(super) id: u64,
}

impl ConnShare {
    /// A connection just admitted with `credit`.
    pub(crate) fn new(credit: u32) -> ConnShare {
        ConnShare { receives: credit, quiet: 0, since_growth: 0, last_data: 0, lapsed: false, grew_at: 0, id: 0 }
    }

    /// Which admission to its SRQ this share is: what a re-post queued for it names.
    pub(crate) fn id(&self) -> u64 {
        self.id
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
            grow_cap: (receives / GROW_CAP_DIVISOR).max(max_credit.max(credit) - credit),
            grown: 0,
            conns: 0,
            free: receives.saturating_sub(reserve),
            traffic: 0,
            now: 0,
            contended_at: None,
        }
    }

    /// The time now, in milliseconds of a monotonic clock: grown shares age by it (see
    /// [`SrqBudget::on_repost`]). Called by the runtime before a posting's re-posts.
    pub(crate) fn set_now(&mut self, now_ms: u64) {
        self.now = self.now.max(now_ms);
    }

    /// The share of a connection just admitted ([`SrqBudget::admit`]): its base, under an `id`
    /// no earlier share of any SRQ of the process had.
    pub(crate) fn new_share(&mut self) -> ConnShare {
        let id = NEXT_SHARE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        ConnShare { id, ..ConnShare::new(self.credit) }
    }

    /// [`SrqBudget::on_repost`] for a receive queued on behalf of share `of` (its
    /// [`ConnShare::id`] then), now posted again for the connection whose share is `share`:
    /// `None`, and nothing changes, when `of` is an earlier share of that connection (it
    /// reconnected while the receive waited to be posted, review L3). That share's receives
    /// all went back to `free` when it left ([`SrqBudget::leave`]), this one included, so
    /// the receive is free now, on the queue: crediting it to the new share would let its peer
    /// hold one grant beyond its share, taken from what the others were promised.
    pub(crate) fn repost_for(
        &mut self,
        share: &mut ConnShare,
        of: u64,
        control: bool,
        held: u32,
        all_posted: bool,
    ) -> Option<Share> {
        (share.id == of).then(|| self.on_repost(share, control, held, all_posted))
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
        self.grown = self.grown.saturating_sub(share.saturating_sub(self.credit));
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
    /// connection's (updated here); `control`: a credit-only message consumed it; `held` what
    /// its peer holds or is about to: its grants not yet consumed, messages in flight included,
    /// plus the receives owed to it, this one not counted
    /// ([`Flow::unused`](crate::proto::flow::Flow::unused) +
    /// [`Flow::owed`](crate::proto::flow::Flow::owed)); `all_posted`: no receive of the SRQ
    /// waits to be posted, so every free one is on the queue and may be granted.
    ///
    /// The peer ran low when a data message's receive comes back with `held` at most a quarter
    /// of the share (at least 1): a peer that spent all it could (it keeps one credit back) is
    /// at 1 when the first receive of its burst comes back; a ping-pong peer is at `share - 1`.
    /// It grows only if it also sent a whole share's worth of data messages since it was
    /// admitted or last grew: a connection's first few messages (a handshake) grow nothing,
    /// else thousands of connections that each said hello once would hold the free receives.
    /// A credit-only message's receive never grows a share, nor counts as running low: such
    /// messages cost a peer nothing its application sees, and a peer sending only them would
    /// otherwise farm a share of `max_credit` and keep it ([`SrqBudget`]). It counts as a
    /// message sent without running low.
    ///
    /// A grown share lapses when its peer sent no data while the queue took `receives` data
    /// messages (its own last one's receive posted again since): its grants sat unused while
    /// others were served. From then on each of its receives that comes back is kept, the share
    /// one smaller each time, down to the base, and it grows again only after a share's worth
    /// of data messages, as if just admitted. A peer that never sends again keeps what it
    /// holds (grants cannot be taken back); `grow_cap` bounds that.
    pub(crate) fn on_repost(&mut self, share: &mut ConnShare, control: bool, held: u32, all_posted: bool) -> Share {
        let s = share.receives;
        if !control {
            self.traffic += 1;
        }
        if s > self.credit && self.traffic.saturating_sub(share.last_data) > u64::from(self.receives) {
            share.lapsed = true;
        }
        // Grown shares age while others want the growth they hold (review of 2026-12-07, N9:
        // peers that burst now and then, each burst running low, kept their growth for good
        // and left every other connection at its base): one grown more than `SHARE_TTL_MS`
        // ago, while a share was refused growth for want of the pool within the same time,
        // lapses, and grows again only as a newcomer does. So the pool is shared out over time
        // among the busy; with no one refused, nothing changes.
        if s > self.credit
            && self.contended_at.is_some_and(|c| self.now.saturating_sub(c) <= SHARE_TTL_MS)
            && self.now.saturating_sub(share.grew_at) > SHARE_TTL_MS
        {
            share.lapsed = true;
        }
        if !control {
            share.last_data = self.traffic;
            share.since_growth = share.since_growth.saturating_add(1);
        }
        let ran_low = !control && held <= (s / 4).max(1);
        if ran_low {
            share.quiet = 0;
        } else {
            share.quiet = share.quiet.saturating_add(1);
        }
        // A whole share's worth without running low, not less: a peer held back by its credit
        // runs low once per burst (the first of its receives to come back), and the rest of the
        // burst's receives come back with more and more owed to it.
        if s > self.credit && (share.lapsed || share.quiet >= s || self.free < self.keep) {
            share.receives -= 1;
            share.quiet = 0;
            if share.lapsed {
                // Back to the base as if just admitted: growth needs a share's worth again.
                share.since_growth = 0;
                share.lapsed = share.receives > self.credit;
            }
            self.grown = self.grown.saturating_sub(1);
            self.free += 1;
            return Share::Shrink;
        }
        if ran_low && share.since_growth >= s && all_posted && s < self.max_credit && self.free > self.keep {
            if self.grown < self.grow_cap {
                share.receives += 1;
                share.since_growth = 0;
                share.grew_at = self.now;
                self.grown += 1;
                self.free -= 1;
                return Share::Grow;
            }
            self.contended_at = Some(self.now);
        }
        Share::Return
    }

    /// The most receives the shares together hold beyond their bases: a thirty-second of the
    /// queue, or one connection's growth to `max_credit` if that is more.
    #[cfg(test)]
    pub(crate) fn grow_cap(&self) -> u32 {
        self.grow_cap
    }

    /// Connections admitted now.
    #[cfg(test)]
    pub(crate) fn conns(&self) -> u32 {
        self.conns
    }
}

/// How long a grown share keeps its growth while others are refused growth
/// ([`SrqBudget::on_repost`]): one second, so the growth pool goes round the busy connections
/// within seconds, and one that stays busy grows back in about 500 messages.
pub(super) const SHARE_TTL_MS: u64 = 1_000;

/// Shares grow only while more than `receives / KEEP_FREE_DIVISOR` receives are free: room kept
/// for connections yet to come (a grown share comes back only as its peer sends).
const KEEP_FREE_DIVISOR: u32 = 8;

/// The shares together hold at most `receives / GROW_CAP_DIVISOR` receives beyond their bases
/// (or one connection's full growth, if more): what peers that grew and went silent can keep
/// from newcomers, for grants cannot be taken back. At the defaults 976 receives, so at least
/// 9 760 of the 10 085 connections are admitted whatever the peers did.
const GROW_CAP_DIVISOR: u32 = 32;
