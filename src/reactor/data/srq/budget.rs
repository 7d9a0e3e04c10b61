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
/// a peer that ran low (it had used all but a quarter of its grants when one of its receives
/// came back), having sent a share's worth of messages since the connection was admitted or
/// last grew, is granted one more from `free`, up to `max_credit`, while more than `keep`
/// receives are free (room kept for connections yet to come); a connection whose peer sent
/// a whole share's worth of messages without once running low gives one back, down to the
/// base, and so does every grown one while fewer than `keep` are free. A share never falls
/// below the base, so a peer is never left without the credit flow control needs to go on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SrqBudget {
    pub(super) receives: u32,
    pub(super) credit: u32,
    pub(super) max_credit: u32,
    pub(super) reserve: u32,
    pub(super) keep: u32,
    pub(super) conns: u32,
    pub(super) free: u32,
}

/// One connection's share of its SRQ ([`SrqBudget`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ConnShare {
    /// Receives of the SRQ it holds: granted to its peer, owed to it, or consumed and waiting
    /// to be posted again.
    pub(crate) receives: u32,
    /// Its receives posted again since its peer last ran low.
    pub(super) quiet: u32,
    /// Its receives posted again since it was admitted or last grew.
    pub(super) since_growth: u32,
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
