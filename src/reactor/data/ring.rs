//! A queue pair's operation ring (issue 47): where an operation lives from its submission to
//! its completion, in posting order, at a position its work request's `wr_id` names.
//!
//! Each of a connection's two work queues (send and receive) has one [`Ring`]. Positions are
//! `u32` sequence numbers that only grow (wrapping); position `seq` lives in slot
//! `seq & mask`. Three counters cut the ring into regions:
//!
//! ```text
//!   head            posted                tail
//!    |  on the device  |  submitted, queued  |   free   ...   overflow (beyond the ring)
//! ```
//!
//! - `[head, posted)`: posted, in posting order; a completion of one of them is valid.
//! - `[posted, tail)`: submitted and not yet posted, in submission order, each already in the
//!   slot it will be posted from: posting writes its work request from the slot in place and
//!   advances `posted`; nothing is moved.
//! - Beyond `tail`, when the ring is full: the overflow queue, in order (the cold path of a
//!   backlog deeper than the queue pair; [`Ring::refill`] moves it in as slots free).
//!
//! **Invariants.** `head <= posted <= tail` and `tail - head <= capacity <= limit <= 2^16`
//! (differences wrapping). Every slot in `[posted, tail)` holds an operation; a slot in
//! `[head, posted)` holds one unless it completed out of order, and `head` never rests on such
//! a slot (it is `posted`, or the oldest operation outstanding: every method that empties the
//! slot at `head` moves `head` on over those). Every operation in the overflow queue comes after every one in the
//! ring. An operation is in exactly one place: a slot, the overflow queue, or given back by a
//! method (taken, popped, removed, drained, carried).
//!
//! **Completions.** A work request's `wr_id` carries its position modulo 2^23
//! (`proto::token::WrId`). [`Ring::window`] accepts it only if it lies in `[head, posted)` and
//! its slot holds an operation: a completion already taken, one of a request never posted, or
//! any hostile value fails the check (it is counted stale by the caller and reaches no
//! operation). Since a ring never holds more than 2^16 positions, the window is far smaller
//! than the 2^23 the id can name, so it never aliases itself across the wrap. A signaled send
//! completes the unsignaled requests before it ([`Ring::pop_until`]: `head` advances over
//! them, in order); a receive completes its own slot ([`Ring::take`]).
//!
//! **Out of order.** What does not complete in posting order is an insertion or a removal in
//! the queued region, paid only by the case that needs it (a shift of the queued slots, which
//! are few): [`Ring::insert_queued`] puts an operation ahead of queued ones (a receive posted
//! again after a credit-only message consumed it; a credit-only message, a nudge or a farewell
//! that must go ahead of data waiting for credits), [`Ring::remove_queued`] takes out the
//! requests a device refused part way through a chain. Receives a refused message gave back
//! leave the ring for the connection's side list (`data/lanes.rs`).
//!
//! Pure: no FFI. Unit tests below script every case.
//!
//! **Why `unsafe` here, outside `src/sys/`.** `src/sys/` owns what the C libraries hand out;
//! the three unsafe blocks here touch nothing of theirs: two index the slot array without a
//! bounds check (`slot`, `slot_mut`: the mask keeps the index in range, asserted in debug
//! builds) and one writes a slot known to hold `None` without dropping it (`fill`). They are the
//! ring's own invariants, so they live with the ring, each with its SAFETY argument.

use std::collections::VecDeque;

use crate::proto::token::WrId;

/// The most positions a ring holds (its `limit` is at most this).
pub(crate) const MAX_RING: u32 = 1 << 16;

/// One work queue's operations ([module docs](self)).
#[derive(Debug)]
pub(crate) struct Ring<T> {
    /// `capacity` slots, a power of two; position `seq` in slot `seq & mask`.
    slots: Box<[Option<T>]>,
    mask: u32,
    /// The capacity it may grow to (a power of two, at most [`MAX_RING`]).
    limit: u32,
    head: u32,
    posted: u32,
    tail: u32,
    /// Submitted beyond a full ring at its limit, in order.
    overflow: VecDeque<T>,
    /// The `wr_id` of position 0 (`WrId::base`: kind, connection index, epoch, direction).
    base: u64,
}

/// `n` rounded up to a power of two within `1..=MAX_RING`.
fn ring_size(n: u32) -> u32 {
    n.clamp(1, MAX_RING).next_power_of_two()
}

impl<T> Ring<T> {
    /// An empty ring of `cap` slots that may grow to `limit` (each rounded up to a power of two,
    /// at most [`MAX_RING`]), whose positions' `wr_id`s are `base` ORed with the position.
    pub(crate) fn new(cap: u32, limit: u32, base: u64) -> Ring<T> {
        let limit = ring_size(limit);
        let cap = ring_size(cap).min(limit);
        Ring {
            slots: (0..cap).map(|_| None).collect(),
            mask: cap - 1,
            limit,
            head: 0,
            posted: 0,
            tail: 0,
            overflow: VecDeque::new(),
            base,
        }
    }

    /// Lets it grow to hold `limit` (rounded up to a power of two; never below what it has):
    /// the queue pair's depth, known once the queue pair exists.
    pub(crate) fn set_limit(&mut self, limit: u32) {
        self.limit = ring_size(limit).max(self.capacity());
    }

    /// Slots it has now.
    #[inline(always)]
    pub(crate) fn capacity(&self) -> u32 {
        self.mask + 1
    }

    /// The position of the oldest operation not completed.
    #[inline(always)]
    pub(crate) fn head(&self) -> u32 {
        self.head
    }

    /// The position the next post starts at (the first queued operation's).
    #[inline(always)]
    pub(crate) fn next_post(&self) -> u32 {
        self.posted
    }

    /// Posted and not completed (out-of-order completions before `head` included).
    #[inline(always)]
    pub(crate) fn outstanding(&self) -> u32 {
        self.posted.wrapping_sub(self.head)
    }

    /// Queued in the ring, not yet posted.
    #[inline(always)]
    pub(crate) fn queued(&self) -> u32 {
        self.tail.wrapping_sub(self.posted)
    }

    /// Queued beyond the ring.
    #[inline(always)]
    pub(crate) fn overflowed(&self) -> usize {
        self.overflow.len()
    }

    /// True when nothing is held: nothing outstanding, queued or overflowed.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.head == self.tail && self.overflow.is_empty()
    }

    /// The `wr_id` of position `seq`.
    #[inline(always)]
    pub(crate) fn wr_id(&self, seq: u32) -> u64 {
        WrId::at(self.base, seq)
    }

    /// The `wr_id` base (`WrId::base`).
    pub(crate) fn base(&self) -> u64 {
        self.base
    }

    #[inline(always)]
    fn slot(&self, seq: u32) -> &Option<T> {
        let i = (seq & self.mask) as usize;
        debug_assert!(i < self.slots.len());
        #[allow(unsafe_code)]
        // SAFETY: `slots` has `mask + 1` elements (`new` and `grow` set both together), so
        // `seq & mask` indexes one of them.
        unsafe {
            self.slots.get_unchecked(i)
        }
    }

    #[inline(always)]
    fn slot_mut(&mut self, seq: u32) -> &mut Option<T> {
        let i = (seq & self.mask) as usize;
        debug_assert!(i < self.slots.len());
        #[allow(unsafe_code)]
        // SAFETY: as in `slot`.
        unsafe {
            self.slots.get_unchecked_mut(i)
        }
    }

    /// Writes `op` into the free slot of position `seq` (outside `[head, tail)`).
    #[inline(always)]
    fn fill(&mut self, seq: u32, op: T) {
        let slot = self.slot_mut(seq);
        debug_assert!(slot.is_none(), "a free slot holds an operation");
        #[allow(unsafe_code)]
        // SAFETY: `slot` is a valid, aligned `Option<T>` (a reference), and a slot outside
        // `[head, tail)` holds `None` (the module's invariant), which owns nothing: overwriting it
        // without dropping it leaks nothing. (A plain assignment would test and drop it.)
        unsafe {
            std::ptr::write(slot, Some(op))
        };
    }

    /// The full position a completion's `seq` (its `wr_id`'s 23 bits) names, if it is one of
    /// the posted operations still outstanding; `None` otherwise (stale, a duplicate, never
    /// posted, or hostile). Never panics.
    #[inline(always)]
    pub(crate) fn window(&self, seq: u32) -> Option<u32> {
        let off = seq.wrapping_sub(self.head) & WrId::SEQ_MASK;
        if off >= self.outstanding() {
            return None;
        }
        let at = self.head.wrapping_add(off);
        self.slot(at).is_some().then_some(at)
    }

    /// Queues `op` behind everything submitted before it: in the next free slot (growing the
    /// ring up to its limit), or in the overflow queue.
    #[inline(always)]
    pub(crate) fn push(&mut self, op: T) {
        self.push_with(
            #[inline(always)]
            || op,
        );
    }

    /// [`Ring::push`] of the operation `make` returns, made once its place is known: in the
    /// common case its fields are written straight into the slot (a value made first is moved
    /// in as a whole).
    #[inline(always)]
    pub(crate) fn push_with(&mut self, make: impl FnOnce() -> T) {
        if self.overflow.is_empty() && self.make_room() {
            self.fill(self.tail, make());
            self.tail = self.tail.wrapping_add(1);
        } else {
            self.overflow.push_back(make());
        }
    }

    /// True when a slot is free without growing the ring.
    #[inline(always)]
    pub(crate) fn has_room(&self) -> bool {
        self.tail.wrapping_sub(self.head) <= self.mask
    }

    /// True when a slot is free (after growing the ring if it was full and may grow).
    #[inline(always)]
    fn make_room(&mut self) -> bool {
        if self.tail.wrapping_sub(self.head) <= self.mask {
            return true;
        }
        self.grow()
    }

    /// Doubles the ring, up to its limit; false at the limit.
    #[cold]
    fn grow(&mut self) -> bool {
        let cap = self.capacity();
        if cap >= self.limit {
            return false;
        }
        let new_cap = 2 * cap;
        let mut slots: Box<[Option<T>]> = (0..new_cap).map(|_| None).collect();
        let mut seq = self.head;
        while seq != self.tail {
            slots[(seq & (new_cap - 1)) as usize] = self.slots[(seq & self.mask) as usize].take();
            seq = seq.wrapping_add(1);
        }
        self.slots = slots;
        self.mask = new_cap - 1;
        true
    }

    /// Grows the ring (up to its limit) so that `extra` more operations fit without growing it
    /// again: a planner that writes work requests at ring positions reserves what it may insert
    /// before it writes the first, since growing moves positions to other slots (an array of work
    /// requests indexed by the old mask would then name two positions with one request).
    #[inline]
    pub(crate) fn reserve(&mut self, extra: u32) {
        while self.tail.wrapping_sub(self.head).saturating_add(extra) > self.capacity() && self.grow() {}
    }

    /// Moves what waits in the overflow queue into the ring, in order, while slots are free;
    /// returns how many moved.
    pub(crate) fn refill(&mut self) -> usize {
        let mut n = 0;
        while !self.overflow.is_empty() && self.make_room() {
            let op = self.overflow.pop_front().expect("non-empty");
            self.fill(self.tail, op);
            self.tail = self.tail.wrapping_add(1);
            n += 1;
        }
        n
    }

    /// The `k`-th queued operation (0: the next to post).
    #[inline(always)]
    pub(crate) fn queued_at(&self, k: u32) -> Option<&T> {
        if k >= self.queued() {
            return None;
        }
        self.slot(self.posted.wrapping_add(k)).as_ref()
    }

    /// The next operation to post: the first queued in the ring, or, with none there, the first
    /// of the overflow queue (which moves in at the next [`Ring::refill`]).
    #[inline(always)]
    pub(crate) fn next_queued(&self) -> Option<&T> {
        self.queued_at(0).or_else(|| self.overflow.front())
    }

    /// The `k`-th queued operation, mutably.
    #[inline(always)]
    pub(crate) fn queued_mut(&mut self, k: u32) -> Option<&mut T> {
        if k >= self.queued() {
            return None;
        }
        let at = self.posted.wrapping_add(k);
        self.slot_mut(at).as_mut()
    }

    /// The last queued operation (the overflow queue's last, or the ring's), mutably: the one
    /// submitted last of those not posted.
    pub(crate) fn last_queued_mut(&mut self) -> Option<&mut T> {
        if !self.overflow.is_empty() {
            return self.overflow.back_mut();
        }
        let k = self.queued().checked_sub(1)?;
        self.queued_mut(k)
    }

    /// The operation at position `seq`, if the ring holds one there.
    #[inline(always)]
    pub(crate) fn get(&self, seq: u32) -> Option<&T> {
        if seq.wrapping_sub(self.head) >= self.tail.wrapping_sub(self.head) {
            return None;
        }
        self.slot(seq).as_ref()
    }

    /// The outstanding operation at position `at`, in place (to take apart before
    /// [`Ring::take`] or [`Ring::pop_until`] empties its slot).
    #[inline(always)]
    pub(crate) fn outstanding_mut(&mut self, at: u32) -> Option<&mut T> {
        if at.wrapping_sub(self.head) >= self.outstanding() {
            return None;
        }
        self.slot_mut(at).as_mut()
    }

    /// The device took the first `n` queued operations (they are posted from now on).
    #[inline(always)]
    pub(crate) fn mark_posted(&mut self, n: u32) {
        debug_assert!(n <= self.queued(), "posting {n} of {} queued", self.queued());
        self.posted = self.posted.wrapping_add(n.min(self.queued()));
    }

    /// Takes the posted operation at position `at` (from [`Ring::window`]); `head` moves past
    /// it and any completed after it out of order. A position not outstanding takes nothing
    /// (`None`): what is queued stays queued, and `head` never passes `posted`.
    #[inline(always)]
    pub(crate) fn take(&mut self, at: u32) -> Option<T> {
        if at.wrapping_sub(self.head) >= self.outstanding() {
            return None;
        }
        let op = self.slot_mut(at).take();
        if at == self.head {
            self.head = at.wrapping_add(1);
            self.skip_completed();
        }
        op
    }

    /// [`Ring::take`] of the position the caller has just found outstanding with
    /// [`Ring::outstanding_mut`] (and taken apart in place; nothing moved the ring since): that
    /// check is not made again. What is left of the operation is returned, for the caller to
    /// drop, or to forget when it owns nothing.
    #[inline(always)]
    pub(crate) fn vacate(&mut self, at: u32) -> Option<T> {
        debug_assert!(at.wrapping_sub(self.head) < self.outstanding(), "vacating a position not outstanding");
        let op = self.slot_mut(at).take();
        if at == self.head {
            self.head = at.wrapping_add(1);
            self.skip_completed();
        }
        op
    }

    /// Moves `head` over the slots completed out of order.
    #[inline(always)]
    fn skip_completed(&mut self) {
        while self.head != self.posted && self.slot(self.head).is_none() {
            self.head = self.head.wrapping_add(1);
        }
    }

    /// Takes the oldest outstanding operation if it lies before position `end` (a signaled
    /// completion's position plus one): each call pops one of the operations that completion
    /// completes, in posting order, and `None` when they are done. Positions in between that
    /// completed earlier out of order are skipped, and `head` stops at the next outstanding one
    /// (so [`Ring::oldest`] names what the next call pops).
    #[inline(always)]
    pub(crate) fn pop_until(&mut self, end: u32) -> Option<(u32, T)> {
        // `end` in (head, posted]: anything else pops nothing.
        while end.wrapping_sub(self.head).wrapping_sub(1) < self.outstanding() {
            let at = self.head;
            self.head = self.head.wrapping_add(1);
            if let Some(op) = self.slot_mut(at).take() {
                self.skip_completed();
                return Some((at, op));
            }
        }
        self.skip_completed();
        None
    }

    /// The oldest outstanding operation, if it lies before position `end`: what
    /// [`Ring::pop_until`] pops next (`head` never rests on a slot completed out of order).
    #[inline(always)]
    pub(crate) fn oldest(&self, end: u32) -> Option<&T> {
        if end.wrapping_sub(self.head).wrapping_sub(1) >= self.outstanding() {
            return None;
        }
        self.slot(self.head).as_ref()
    }

    /// Puts `op` at queued position `k` (0: ahead of every queued operation; at most
    /// [`Ring::queued`]: behind them), moving the queued ones after it back by one. A full ring
    /// grows, or at its limit sends its last queued operation to the front of the overflow
    /// queue. The cold path of the out-of-order cases ([module docs](self)).
    pub(crate) fn insert_queued(&mut self, k: u32, op: T) {
        let k = k.min(self.queued());
        if !self.make_room() {
            // Full at the limit: the last queued operation goes first in the overflow queue (if
            // none is queued, the ring is all outstanding and `op` waits there too).
            if self.queued() == k {
                self.overflow.push_front(op);
                return;
            }
            self.tail = self.tail.wrapping_sub(1);
            let last = self.slot_mut(self.tail).take().expect("a queued slot holds an operation");
            self.overflow.push_front(last);
        }
        let at = self.posted.wrapping_add(k);
        let mut seq = self.tail;
        while seq != at {
            let before = seq.wrapping_sub(1);
            let moved = self.slot_mut(before).take();
            *self.slot_mut(seq) = moved;
            seq = before;
        }
        self.fill(at, op);
        self.tail = self.tail.wrapping_add(1);
    }

    /// Takes `n` queued operations from queued position `k` out of the ring, in order, moving
    /// the ones after them forward (a chain the device refused part way: the requests it did
    /// not take). Fewer when fewer are queued there.
    pub(crate) fn remove_queued(&mut self, k: u32, n: u32) -> Vec<T> {
        let k = k.min(self.queued());
        let n = n.min(self.queued() - k);
        if n == 0 {
            return Vec::new();
        }
        let from = self.posted.wrapping_add(k);
        let mut out = Vec::with_capacity(n as usize);
        for i in 0..n {
            out.extend(self.slot_mut(from.wrapping_add(i)).take());
        }
        let mut seq = from;
        while seq.wrapping_add(n) != self.tail {
            let moved = self.slot_mut(seq.wrapping_add(n)).take();
            *self.slot_mut(seq) = moved;
            seq = seq.wrapping_add(1);
        }
        self.tail = self.tail.wrapping_sub(n);
        out
    }

    /// Everything it holds, in order (outstanding, queued, overflowed), leaving it empty: the
    /// queue pair is gone (teardown).
    pub(crate) fn drain(&mut self) -> Vec<T> {
        let mut out = self.take_outstanding();
        while self.posted != self.tail {
            out.extend(self.slot_mut(self.posted).take());
            self.posted = self.posted.wrapping_add(1);
        }
        self.head = self.tail;
        out.extend(self.overflow.drain(..));
        out
    }

    /// For a new queue pair (a reconnection): returns the outstanding operations (the old queue
    /// pair's), keeps the queued and overflowed ones in their order and places, and names the
    /// new queue pair's positions with `base` (its epoch). Positions go on from where they
    /// were: the new epoch, not the sequence, tells the queue pairs apart.
    pub(crate) fn carry(&mut self, base: u64) -> Vec<T> {
        let out = self.take_outstanding();
        self.base = base;
        out
    }

    /// Takes every outstanding operation, in order; `head` moves to `posted`.
    fn take_outstanding(&mut self) -> Vec<T> {
        let mut out = Vec::with_capacity(self.outstanding() as usize);
        while self.head != self.posted {
            out.extend(self.slot_mut(self.head).take());
            self.head = self.head.wrapping_add(1);
        }
        out
    }

    /// A ring whose positions start at `seq` (tests: the wrap of the counters and of the 23
    /// bits a `wr_id` carries).
    #[cfg(test)]
    pub(crate) fn starting_at(cap: u32, limit: u32, base: u64, seq: u32) -> Ring<T> {
        let mut r = Ring::new(cap, limit, base);
        (r.head, r.posted, r.tail) = (seq, seq, seq);
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::token::{Dir, WrId};

    fn base() -> u64 {
        WrId::base(5, 3, Dir::Send).unwrap()
    }

    /// The `wr_id` of position `seq` decoded back to the 23 bits a completion gives.
    fn seq_of(r: &Ring<u32>, seq: u32) -> u32 {
        WrId::decode(r.wr_id(seq)).unwrap().seq
    }

    #[test]
    fn submissions_queue_in_place_and_posting_moves_nothing() {
        let mut r: Ring<u32> = Ring::new(4, 4, base());
        for v in 10..13 {
            r.push(v);
        }
        assert_eq!((r.outstanding(), r.queued(), r.overflowed()), (0, 3, 0));
        assert_eq!(r.queued_at(0), Some(&10));
        r.mark_posted(2);
        assert_eq!((r.outstanding(), r.queued()), (2, 1));
        assert_eq!(r.queued_at(0), Some(&12), "the next to post");
        assert_eq!(r.get(0), Some(&10), "posted ones stay where they were written");
    }

    #[test]
    fn a_completion_is_valid_only_inside_the_posted_window() {
        let mut r: Ring<u32> = Ring::new(8, 8, base());
        for v in 0..5 {
            r.push(v);
        }
        r.mark_posted(3);
        let b = r.base();
        let s = |seq| WrId::decode(WrId::at(b, seq)).unwrap().seq;
        assert_eq!(r.window(s(0)), Some(0));
        assert_eq!(r.window(s(2)), Some(2));
        assert_eq!(r.window(s(3)), None, "queued, never posted");
        assert_eq!(r.window(s(7)), None, "never submitted");
        assert_eq!(r.window(WrId::SEQ_MASK), None, "before head, wrapped");
        assert_eq!(r.take(0), Some(0));
        assert_eq!(r.window(s(0)), None, "a duplicate of a completion already taken");
        assert_eq!(r.take(0), None);
        // Hostile sequences: every 23-bit value is checked, none panics, none but the
        // outstanding two is accepted.
        let accepted = (0..=WrId::SEQ_MASK).step_by(997).chain([1, 2]).filter(|&v| r.window(v).is_some()).count();
        assert_eq!(accepted, 2);
    }

    #[test]
    fn a_signaled_completion_retires_the_unsignaled_ones_before_it_in_order() {
        let mut r: Ring<u32> = Ring::new(8, 8, base());
        for v in 0..6 {
            r.push(v);
        }
        r.mark_posted(6);
        // The completion of position 3 (signaled) completes 0..=3.
        let end = r.window(seq_of(&r, 3)).unwrap() + 1;
        let mut done = Vec::new();
        while let Some((at, v)) = r.pop_until(end) {
            done.push((at, v));
        }
        assert_eq!(done, vec![(0, 0), (1, 1), (2, 2), (3, 3)]);
        assert_eq!((r.head(), r.outstanding()), (4, 2));
        assert_eq!(r.pop_until(end), None, "an end at or before head pops nothing");
        assert_eq!(r.pop_until(100), None, "an end past what was posted pops nothing");
    }

    #[test]
    fn receives_completing_out_of_order_are_each_taken_once_and_head_follows() {
        let mut r: Ring<u32> = Ring::new(4, 4, base());
        for v in 0..4 {
            r.push(v);
        }
        r.mark_posted(4);
        assert_eq!(r.take(2), Some(2));
        assert_eq!(r.head(), 0, "0 and 1 are still outstanding");
        assert_eq!(r.window(seq_of(&r, 2)), None, "taken");
        assert_eq!(r.take(0), Some(0));
        assert_eq!(r.head(), 1);
        assert_eq!(r.take(1), Some(1));
        assert_eq!(r.head(), 3, "past the hole left by 2");
        // A send completion over a hole pops only what is there.
        r.push(4);
        r.push(5);
        r.mark_posted(2);
        assert_eq!(r.take(4), Some(4));
        let mut got = Vec::new();
        while let Some((_, v)) = r.pop_until(6) {
            got.push(v);
        }
        assert_eq!(got, vec![3, 5]);
        assert!(r.is_empty());
    }

    #[test]
    fn counters_and_wr_id_sequences_wrap_without_a_seam() {
        for start in [u32::MAX - 2, WrId::SEQ_MASK - 2, (WrId::SEQ_MASK + 1) * 7 - 1] {
            let mut r: Ring<u32> = Ring::starting_at(4, 4, base(), start);
            for round in 0..20u32 {
                r.push(round);
                r.push(round + 100);
                r.mark_posted(2);
                let first = r.window(seq_of(&r, r.head())).expect("the oldest is valid");
                assert_eq!(r.take(first), Some(round));
                let second = r.window(seq_of(&r, r.head())).expect("and the next");
                let end = second.wrapping_add(1);
                assert_eq!(r.pop_until(end).map(|(_, v)| v), Some(round + 100));
                assert!(r.is_empty(), "start {start:#x}, round {round}");
                assert_eq!(r.window(seq_of(&r, first)), None, "stale after the wrap");
            }
        }
    }

    /// The completion path's steps (a slot made in place, found by its `wr_id`, taken apart in
    /// place and vacated; a send completion's oldest found and popped) across the seams of the
    /// counters and of the 23-bit sequence.
    #[test]
    fn taking_apart_in_place_wraps_without_a_seam() {
        for start in [u32::MAX - 2, WrId::SEQ_MASK - 2, (WrId::SEQ_MASK + 1) * 7 - 1] {
            let mut r: Ring<u32> = Ring::starting_at(4, 4, base(), start);
            for round in 0..20u32 {
                r.push_with(|| round);
                r.push_with(|| round + 100);
                r.push_with(|| round + 200);
                r.mark_posted(3);
                // The second completes out of order; then a signaled completion of the third
                // retires the first and the third.
                let second = r.window(seq_of(&r, r.head().wrapping_add(1))).expect("outstanding");
                *r.outstanding_mut(second).expect("in place") += 1;
                assert_eq!(r.vacate(second), Some(round + 101));
                assert_eq!(r.window(seq_of(&r, second)), None, "stale once taken");
                let end = r.window(seq_of(&r, r.head().wrapping_add(2))).expect("outstanding").wrapping_add(1);
                assert_eq!(r.oldest(end), Some(&round));
                let head = r.head();
                assert_eq!(r.vacate(head), Some(round), "start {start:#x}, round {round}");
                assert_eq!(r.oldest(end), Some(&(round + 200)), "over the hole");
                let head = r.head();
                assert_eq!(r.vacate(head), Some(round + 200));
                assert_eq!(r.oldest(end), None);
                assert!(r.is_empty(), "start {start:#x}, round {round}");
            }
        }
    }

    #[test]
    fn a_full_ring_grows_to_its_limit_then_overflows_in_order() {
        let mut r: Ring<u32> = Ring::new(2, 4, base());
        for v in 0..7 {
            r.push(v);
        }
        assert_eq!((r.capacity(), r.queued(), r.overflowed()), (4, 4, 3));
        r.mark_posted(4);
        // Once slots free, the overflow moves in behind the ring, in order.
        assert_eq!(r.take(0), Some(0));
        assert_eq!(r.take(1), Some(1));
        assert_eq!(r.refill(), 2);
        assert_eq!((r.queued(), r.overflowed()), (2, 1));
        assert_eq!((r.queued_at(0), r.queued_at(1)), (Some(&4), Some(&5)));
        // A push while the overflow is non-empty goes behind it, whatever the ring's room.
        assert_eq!(r.take(2), Some(2));
        r.push(7);
        assert_eq!(r.overflowed(), 2);
        assert_eq!(r.refill(), 1);
        assert_eq!(r.drain(), vec![3, 4, 5, 6, 7]);
        assert!(r.is_empty());
    }

    #[test]
    fn growing_keeps_every_position_where_its_wr_id_finds_it() {
        let mut r: Ring<u32> = Ring::starting_at(2, 16, base(), 7);
        r.push(70);
        r.mark_posted(1);
        r.push(80);
        r.push(90);
        assert_eq!(r.capacity(), 4);
        r.mark_posted(2);
        for (seq, v) in [(7, 70), (8, 80), (9, 90)] {
            assert_eq!(r.window(seq_of(&r, seq)), Some(seq));
            assert_eq!(r.get(seq), Some(&v));
        }
    }

    #[test]
    fn an_insertion_goes_ahead_of_the_queued_and_a_full_ring_spills_its_last() {
        let mut r: Ring<u32> = Ring::new(4, 4, base());
        r.push(1);
        r.mark_posted(1);
        r.push(2);
        r.push(3);
        r.insert_queued(0, 10);
        assert_eq!((r.queued_at(0), r.queued_at(1), r.queued_at(2)), (Some(&10), Some(&2), Some(&3)));
        // Full at its limit: 3 spills to the overflow's front, ahead of later submissions.
        r.push(4);
        assert_eq!(r.overflowed(), 1);
        r.insert_queued(1, 11);
        assert_eq!(r.drain(), vec![1, 10, 11, 2, 3, 4]);
        // Behind everything queued when k is past them.
        let mut r: Ring<u32> = Ring::new(4, 4, base());
        r.push(1);
        r.insert_queued(9, 2);
        assert_eq!(r.drain(), vec![1, 2]);
        // A ring all outstanding at its limit: the insertion waits first in line.
        let mut r: Ring<u32> = Ring::new(2, 2, base());
        r.push(1);
        r.push(2);
        r.mark_posted(2);
        r.push(3);
        r.insert_queued(0, 9);
        assert_eq!(r.drain(), vec![1, 2, 9, 3]);
    }

    #[test]
    fn a_refused_run_leaves_the_ring_and_the_rest_closes_up() {
        let mut r: Ring<u32> = Ring::new(8, 8, base());
        for v in 0..6 {
            r.push(v);
        }
        // A chain of 4 planned, 2 taken: the other 2 come out, 4 and 5 stay queued.
        r.mark_posted(2);
        assert_eq!(r.remove_queued(0, 2), vec![2, 3]);
        assert_eq!((r.outstanding(), r.queued()), (2, 2));
        assert_eq!((r.queued_at(0), r.queued_at(1)), (Some(&4), Some(&5)));
        assert_eq!(r.remove_queued(1, 9), vec![5], "no more than are queued");
        assert_eq!(r.drain(), vec![0, 1, 4]);
    }

    #[test]
    fn a_reconnection_hands_back_the_posted_and_keeps_the_queued_under_a_new_epoch() {
        let mut r: Ring<u32> = Ring::new(8, 8, base());
        for v in 0..5 {
            r.push(v);
        }
        r.mark_posted(3);
        let old = r.wr_id(1);
        let new_base = WrId::base(5, 4, Dir::Send).unwrap();
        assert_eq!(r.carry(new_base), vec![0, 1, 2]);
        assert_eq!((r.outstanding(), r.queued()), (0, 2));
        assert_ne!(WrId::decode(old).unwrap().epoch, WrId::decode(r.wr_id(3)).unwrap().epoch);
        r.mark_posted(2);
        assert_eq!(r.window(WrId::decode(r.wr_id(3)).unwrap().seq), Some(3));
        assert_eq!(r.drain(), vec![3, 4]);
    }

    #[test]
    fn an_operation_made_in_place_goes_to_its_slot_or_the_overflow_queue() {
        let mut r: Ring<u32> = Ring::new(2, 2, base());
        assert!(r.has_room());
        let mut made = 0;
        for v in 0..3 {
            r.push_with(|| {
                made += 1;
                v
            });
        }
        assert_eq!(made, 3, "made once each");
        assert!(!r.has_room(), "full at its limit");
        assert_eq!((r.queued(), r.overflowed()), (2, 1));
        assert_eq!(r.drain(), vec![0, 1, 2]);
        let mut r: Ring<u32> = Ring::new(1, 4, base());
        r.push_with(|| 1);
        assert!(!r.has_room(), "full, though it may grow");
        r.push_with(|| 2);
        assert_eq!((r.capacity(), r.queued(), r.overflowed()), (2, 2, 0), "it grew instead");
    }

    #[test]
    fn an_outstanding_operation_is_taken_apart_in_place_and_its_slot_vacated() {
        let mut r: Ring<u32> = Ring::new(4, 4, base());
        for v in 10..14 {
            r.push(v);
        }
        r.mark_posted(3);
        assert_eq!(r.outstanding_mut(3), None, "queued, not outstanding");
        assert_eq!(r.outstanding_mut(7), None, "never posted");
        // Out of order: position 1 first; `head` stays on 0.
        *r.outstanding_mut(1).unwrap() += 100;
        assert_eq!(r.vacate(1), Some(111));
        assert_eq!((r.head(), r.outstanding()), (0, 3));
        assert_eq!(r.outstanding_mut(1), None, "taken");
        assert_eq!(r.take(3), None, "queued: stays");
        assert_eq!(r.take(1), None, "taken already");
        assert_eq!(r.oldest(3), Some(&10), "the oldest before position 3");
        assert_eq!(r.oldest(0), None, "an end at head names nothing");
        // The oldest: `head` moves past it and over the hole at 1.
        assert_eq!(r.vacate(0), Some(10));
        assert_eq!((r.head(), r.outstanding()), (2, 1));
        assert_eq!(r.oldest(3), Some(&12));
        assert_eq!(r.pop_until(3), Some((2, 12)));
        assert_eq!(r.head(), 3, "posted: nothing outstanding");
        assert_eq!(r.oldest(4), None);
    }

    #[test]
    fn sizes_are_powers_of_two_within_bounds() {
        let r: Ring<u32> = Ring::new(3, 100, base());
        assert_eq!(r.capacity(), 4);
        let r: Ring<u32> = Ring::new(0, 0, base());
        assert_eq!(r.capacity(), 1);
        let r: Ring<u32> = Ring::new(1 << 20, 1 << 20, base());
        assert_eq!(r.capacity(), MAX_RING);
    }
}
