//! The tails a connection's sends end with on a transport without immediate data (iWARP;
//! the format is `proto::transport`'s [`Tail`]).
//!
//! A tail is the second scatter entry of a send's work request, so it must sit in registered
//! memory until the device has read it: a ring of 4-byte slots in one chunk of the connection's
//! own, from the device's ring pool ([`ring_pool`]: one size class of ring-sized chunks in
//! 2 MiB clusters, so 6 553 connections of the default send depth share one registration; with
//! a shared receive queue, in clusters that hold a ring for every connection the queue admits,
//! so registered memory does not grow with the connections). Slot `i` is written again only after `slots` later sends were posted;
//! the ring has more slots than the queue pair has send work requests, and an RC queue pair
//! completes its sends in order, so by then the send that used slot `i` has completed (or
//! the queue pair has failed, and reads nothing any more).

use std::rc::Rc;

use crate::error::Result;
use crate::proto::transport::{Tail, TAIL_LEN};
use crate::reactor::Config;
use crate::sys::pd::Pd;
use crate::sys::pool::PoolConfig;
use crate::sys::pool::{Buf, Pool};

/// Bytes of one connection's ring: more slots than `send_depth`, in whole cache lines.
fn ring_bytes(send_depth: u32) -> usize {
    ((send_depth as usize + 1) * TAIL_LEN as usize).div_ceil(64) * 64
}

/// The device's pool of tail rings for connections of `cfg` (`Device::tails`): clusters of
/// 2 MiB, or of a ring for each connection the device's shared receive queue admits when that
/// is more (its admission limit is per device, so one registration serves them all).
pub(in crate::reactor) fn ring_pool(pd: &Rc<Pd>, cfg: &Config) -> Result<Pool> {
    let chunk = ring_bytes(cfg.send_depth);
    let srq_conns = cfg.srq.map_or(0, |s| s.max_connections() as usize);
    let cluster_bytes = (2 << 20).max(chunk).max(chunk.saturating_mul(srq_conns));
    let rings =
        PoolConfig { chunk_sizes: vec![chunk], cluster_bytes, max_bytes: cfg.pool.max_bytes, ..PoolConfig::default() };
    Pool::new(pd, &rings, 0)
}

/// One connection's ring of tails.
#[derive(Debug)]
pub(in crate::reactor) struct TailRing {
    buf: Buf,
    slots: u32,
    next: u32,
}

impl TailRing {
    /// A ring with more slots than `send_wrs` (the queue pair's send work requests), from
    /// `pool`, for connection `owner`.
    pub(in crate::reactor) fn new(pool: &Pool, send_wrs: u32, owner: u64) -> Result<TailRing> {
        let want = ring_bytes(send_wrs);
        let mut buf = pool.alloc(want, owner)?;
        let cap = buf.capacity();
        buf.set_len(cap)?;
        // Zeroes what an earlier owner left, once.
        buf.as_mut_slice();
        let slots = (cap / TAIL_LEN as usize) as u32;
        debug_assert!(slots > send_wrs);
        Ok(TailRing { buf, slots, next: 0 })
    }

    /// Writes `tail` into the next slot; returns the slot's address and local key, for the
    /// send's second scatter entry.
    pub(in crate::reactor) fn put(&mut self, tail: Tail) -> (u64, u32) {
        let i = self.next as usize;
        self.next = (self.next + 1) % self.slots;
        let at = i * TAIL_LEN as usize;
        self.buf.as_mut_slice()[at..at + TAIL_LEN as usize].copy_from_slice(&tail.encode());
        (self.buf.addr() + at as u64, self.buf.lkey())
    }
}
