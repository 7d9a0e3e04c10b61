//! A connection's submission gate (issue 47): what `Core::submit` checks of every operation,
//! decided once per state, so a submission is a few compares.
//!
//! Most of what a submission is checked against changes only when the connection's state or
//! flow does: whether it may queue at all (it has a queue pair and is connected: `can_submit`),
//! whether its receives are the runtime's (a shared receive queue), whether its queue pair
//! carries immediate data (one framed with tails, iWARP's, does not: `Op::write_imm` is
//! refused), the largest message (the
//! smaller of both sides' announced sizes, the one size contract) and the backlog bounds
//! (`Config::send_backlog`, `send_backlog_bytes`). [`Gate::new`] computes them when that state
//! changes (`ConnEntry::refresh_gate`: the queue pair's setup, the peer's connect information,
//! this side's; a reconnection closes it), and the hot path reads them (`Core::submit`, since
//! issue 47 phase 2 step 4). Whether the connection may queue at all is asked of it live
//! (`ConnEntry::can_submit`, two compares), so a state change needs no recomputation.
//!
//! What stays per operation: the buffer's pool (one pointer compare) and its owner marks, the
//! operation's own bounds (a WRITE's remote slice, a READ's target), the backlog against the
//! ring's live counters ([`Gate::backlog`]), and the cold cases (a region's first registration
//! on the device, an iWARP READ's sink). A connection that cannot submit takes `Core::submit`'s
//! slow path, which says exactly why (reconnecting, not connected, a device gone: the messages
//! are built only when refusing); so do the refusals here ([`Refusal::into_error`]).
//! `Gate::CLOSED` is what a connection holds before its queue pair and while it waits to
//! reconnect: read by the fast path it would refuse everything (only a missed recomputation
//! could make it, which debug builds assert against).
//!
//! Pure: no FFI, no connection table. Unit-tested below.

use crate::error::Error;
use crate::proto::token::Token;

/// Why the gate refused a submission ([`Refusal::into_error`] makes the error the caller gets).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Not open: the slow path decides (reconnecting, not connected).
    Closed,
    /// A receive on a connection whose receives the runtime posts (a shared receive queue).
    OwnReceive,
    /// An RDMA WRITE with immediate data on a device without immediate data.
    NoImmediate,
    /// A message longer than the connection takes: `max`, the peer's receive size (`peer`) or
    /// this side's announced size.
    TooLarge { len: usize, max: usize, peer: bool },
    /// `Config::send_backlog` operations wait beyond the free send slots already.
    Backlog { limit: u32 },
    /// The waiting operations' pool bytes would pass `Config::send_backlog_bytes`.
    BacklogBytes { limit: usize },
}

impl Refusal {
    /// The error `Conn::submit` returns for it, on connection `token` (the messages of
    /// `Core::submit`).
    pub(crate) fn into_error(self, token: Token) -> Error {
        match self {
            Refusal::Closed => Error::NotConnected(format!("connection {token:?} takes no operations now")),
            Refusal::OwnReceive => Error::Config(format!(
                "connection {token:?} takes its receives from the shared receive queue (Config::srq): the runtime \
                 posts them"
            )),
            Refusal::NoImmediate => Error::Unsupported(
                "an RDMA WRITE with immediate data (Op::write_imm): this connection's device has no immediate data \
                 (iWARP); post an Op::write, then an Op::send to notify the peer (RC keeps their order)"
                    .into(),
            ),
            Refusal::TooLarge { len, max, peer } => Error::TooLarge {
                len,
                max,
                limit: if peer {
                    "the peer's receive size, the msg_size of its connect information"
                } else {
                    "this side's announced message size (ConnectOptions::msg_size, or Config::msg_size)"
                },
            },
            Refusal::Backlog { limit } => Error::Limit { what: "Config::send_backlog", limit: limit as usize },
            Refusal::BacklogBytes { limit } => Error::Limit { what: "Config::send_backlog_bytes", limit },
        }
    }
}

/// One connection's submission gate ([module docs](self)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Gate {
    /// The connection may queue operations (a queue pair, connected).
    open: bool,
    /// Its receives are the runtime's.
    srq: bool,
    /// Its device has no immediate data.
    no_imm: bool,
    /// The largest message: `u32::MAX` when neither side announced a size.
    max_msg: u32,
    /// `max_msg` is the peer's receive size (not ours).
    max_is_peer: bool,
    backlog_ops: u32,
    backlog_bytes: usize,
}

impl Gate {
    /// A gate that lets nothing through (before the queue pair, after the close).
    pub(crate) const CLOSED: Gate = Gate {
        open: false,
        srq: false,
        no_imm: false,
        max_msg: 0,
        max_is_peer: false,
        backlog_ops: 0,
        backlog_bytes: 0,
    };

    /// The gate of a connection in this state: `open` when it may queue operations, `srq` when
    /// its receives are the runtime's (it holds a share of a shared receive queue, or the
    /// reactor has one), `no_imm` on a device without immediate data; `peer_msg` the peer's
    /// announced message size (its connect information; `None` or 0: none), `own_msg` this
    /// side's (0: none); the backlog bounds of `Config`.
    pub(crate) fn new(
        open: bool,
        srq: bool,
        no_imm: bool,
        peer_msg: Option<u32>,
        own_msg: u32,
        backlog_ops: u32,
        backlog_bytes: usize,
    ) -> Gate {
        let peer = peer_msg.filter(|m| *m > 0);
        let own = Some(own_msg).filter(|m| *m > 0);
        // The smaller of both; the peer's on a tie (what the submission path says).
        let (max_msg, max_is_peer) = match (peer, own) {
            (Some(p), Some(o)) if o < p => (o, false),
            (Some(p), _) => (p, true),
            (None, Some(o)) => (o, false),
            (None, None) => (u32::MAX, false),
        };
        Gate { open, srq, no_imm, max_msg, max_is_peer, backlog_ops, backlog_bytes }
    }

    /// True when the connection may queue operations (the host benchmark's question; the
    /// reactor asks `ConnEntry::can_submit`).
    #[cfg(any(test, feature = "bench-internals"))]
    #[inline(always)]
    pub(crate) fn is_open(&self) -> bool {
        self.open
    }

    /// A receive of the application's.
    #[inline(always)]
    pub(crate) fn recv(&self) -> Result<(), Refusal> {
        if !self.open {
            return Err(Refusal::Closed);
        }
        if self.srq {
            return Err(Refusal::OwnReceive);
        }
        Ok(())
    }

    /// A message (a send) of `len` bytes.
    #[inline(always)]
    pub(crate) fn message(&self, len: usize) -> Result<(), Refusal> {
        if !self.open {
            return Err(Refusal::Closed);
        }
        if len > self.max_msg as usize {
            return Err(Refusal::TooLarge { len, max: self.max_msg as usize, peer: self.max_is_peer });
        }
        Ok(())
    }

    /// A one-sided operation (its bound is its own: the remote slice, the local target);
    /// `imm` for an RDMA WRITE with immediate data.
    #[inline(always)]
    pub(crate) fn one_sided(&self, imm: bool) -> Result<(), Refusal> {
        if !self.open {
            return Err(Refusal::Closed);
        }
        if imm && self.no_imm {
            return Err(Refusal::NoImmediate);
        }
        Ok(())
    }

    /// The backlog bound for one more send-queue operation holding `pool_len` pool bytes, with
    /// `queued` operations (`queued_bytes` pool bytes) submitted and not posted and `free`
    /// send slots on the queue pair: what the next post can take is never refused; beyond it,
    /// at most `backlog_ops` wait, and, once one waits, at most `backlog_bytes` of pool bytes.
    #[inline(always)]
    pub(crate) fn backlog(&self, queued: u32, free: u32, queued_bytes: usize, pool_len: usize) -> Result<(), Refusal> {
        if queued < free {
            return Ok(());
        }
        if queued - free >= self.backlog_ops {
            return Err(Refusal::Backlog { limit: self.backlog_ops });
        }
        if queued_bytes > 0 && queued_bytes.saturating_add(pool_len) > self.backlog_bytes {
            return Err(Refusal::BacklogBytes { limit: self.backlog_bytes });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(peer: Option<u32>, own: u32) -> Gate {
        Gate::new(true, false, false, peer, own, 4, 1000)
    }

    #[test]
    fn a_closed_gate_refuses_everything_to_the_slow_path() {
        let g = Gate::CLOSED;
        assert_eq!(g.recv(), Err(Refusal::Closed));
        assert_eq!(g.message(0), Err(Refusal::Closed));
        assert_eq!(g.one_sided(false), Err(Refusal::Closed));
        assert!(!g.is_open());
    }

    #[test]
    fn the_size_limit_is_the_smaller_announced_size_and_names_whose() {
        assert_eq!(open(Some(100), 200).message(101), Err(Refusal::TooLarge { len: 101, max: 100, peer: true }));
        assert_eq!(open(Some(300), 200).message(201), Err(Refusal::TooLarge { len: 201, max: 200, peer: false }));
        assert_eq!(open(Some(200), 200).message(201), Err(Refusal::TooLarge { len: 201, max: 200, peer: true }));
        assert_eq!(open(None, 64).message(65), Err(Refusal::TooLarge { len: 65, max: 64, peer: false }));
        assert_eq!(open(Some(0), 0).message(usize::MAX >> 33), Ok(()), "no size announced: no limit here");
        assert_eq!(open(Some(100), 0).message(100), Ok(()));
        let token = Token::new(crate::proto::token::Kind::Conn, 1, 1);
        let e = Refusal::TooLarge { len: 101, max: 100, peer: true }.into_error(token);
        assert!(matches!(e, Error::TooLarge { len: 101, max: 100, limit } if limit.contains("peer's receive size")));
    }

    #[test]
    fn receives_are_refused_where_the_runtime_posts_them() {
        assert_eq!(Gate::new(true, true, false, None, 0, 1, 1).recv(), Err(Refusal::OwnReceive));
        assert_eq!(open(None, 0).recv(), Ok(()));
    }

    #[test]
    fn write_imm_is_refused_without_immediate_data() {
        let iwarp = Gate::new(true, false, true, None, 0, 1, 1);
        assert_eq!(iwarp.one_sided(true), Err(Refusal::NoImmediate));
        assert_eq!(iwarp.one_sided(false), Ok(()));
        assert_eq!(open(None, 0).one_sided(true), Ok(()));
    }

    /// `Config::send_backlog` and `send_backlog_bytes` as `Core::submit` applies them: what the
    /// next post can take passes; beyond, the count, then the bytes once one waits.
    #[test]
    fn the_backlog_bounds_what_waits_beyond_the_free_slots() {
        let g = open(None, 0);
        assert_eq!(g.backlog(3, 4, 10_000, 10_000), Ok(()), "the next post takes it: never refused");
        assert_eq!(g.backlog(4, 4, 0, 999), Ok(()), "the first to wait, bytes not yet counted");
        assert_eq!(g.backlog(7, 4, 10, 10), Ok(()), "3 wait beyond the slots, under 4");
        assert_eq!(g.backlog(8, 4, 10, 10), Err(Refusal::Backlog { limit: 4 }));
        assert_eq!(g.backlog(5, 4, 990, 10), Ok(()));
        assert_eq!(g.backlog(5, 4, 991, 10), Err(Refusal::BacklogBytes { limit: 1000 }));
        assert_eq!(g.backlog(5, 4, usize::MAX, usize::MAX), Err(Refusal::BacklogBytes { limit: 1000 }), "no overflow");
    }
}
