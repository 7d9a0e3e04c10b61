//! Deadlines and user timers on the reactor's loop: a min-heap feeding epoll's timeout.
//!
//! Cancelling is lazy: an entry carries a key, and the owner keeps the key it expects; an entry
//! whose key no longer matches is dropped when it surfaces.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

/// A timer heap over targets of type `T`.
#[derive(Debug)]
pub struct Timers<T: Ord> {
    heap: BinaryHeap<Reverse<(Instant, u64, T)>>,
    seq: u64,
}

impl<T: Ord + Copy> Default for Timers<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Ord + Copy> Timers<T> {
    /// An empty heap.
    pub fn new() -> Self {
        Timers { heap: BinaryHeap::new(), seq: 0 }
    }

    /// Schedules `target` at `at`; returns the entry's unique key.
    pub fn schedule(&mut self, at: Instant, target: T) -> u64 {
        self.seq += 1;
        self.heap.push(Reverse((at, self.seq, target)));
        self.seq
    }

    /// The earliest deadline, if any.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.heap.peek().map(|Reverse((at, _, _))| *at)
    }

    /// Time until the earliest deadline (zero if past), if any.
    pub fn next_timeout(&self, now: Instant) -> Option<Duration> {
        self.next_deadline().map(|at| at.saturating_duration_since(now))
    }

    /// Pops every entry due at `now`, earliest first, as `(key, target)`.
    pub fn expired(&mut self, now: Instant) -> Vec<(u64, T)> {
        let mut out = Vec::new();
        while let Some(Reverse((at, _, _))) = self.heap.peek() {
            if *at > now {
                break;
            }
            let Reverse((_, key, target)) = self.heap.pop().expect("peeked");
            out.push((key, target));
        }
        out
    }

    /// Entries in the heap, cancelled ones included.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.heap.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expire_in_deadline_order() {
        let t0 = Instant::now();
        let mut t = Timers::new();
        let c = t.schedule(t0 + Duration::from_millis(30), 'c');
        let a = t.schedule(t0 + Duration::from_millis(10), 'a');
        let b = t.schedule(t0 + Duration::from_millis(20), 'b');
        assert_eq!(t.next_timeout(t0), Some(Duration::from_millis(10)));
        assert_eq!(t.expired(t0 + Duration::from_millis(5)), vec![]);
        assert_eq!(t.expired(t0 + Duration::from_millis(25)), vec![(a, 'a'), (b, 'b')]);
        assert_eq!(t.len(), 1);
        assert_eq!(t.expired(t0 + Duration::from_secs(1)), vec![(c, 'c')]);
        assert_eq!(t.len(), 0);
        assert_eq!(t.next_timeout(t0), None);
    }

    #[test]
    fn past_deadline_gives_zero_timeout_and_keys_are_unique() {
        let t0 = Instant::now();
        let mut t = Timers::new();
        let k1 = t.schedule(t0, 1);
        let k2 = t.schedule(t0, 1);
        assert_ne!(k1, k2);
        assert_eq!(t.next_timeout(t0 + Duration::from_secs(1)), Some(Duration::ZERO));
        assert_eq!(t.expired(t0).len(), 2);
    }
}
