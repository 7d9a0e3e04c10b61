//! CQ room accounting, pure counting: a CQ never holds more completions than it has entries.
//!
//! - **Receives are admitted.** A connection commits its receive depth on its CQ when its queue
//!   pair is created; a connection that does not fit (a shared CQ keeps a quarter of its
//!   entries for sends) is refused. Its posted receives, at most that depth, then always have
//!   room.
//! - **Sends are metered.** Every send-queue work request reserves one of the remaining
//!   entries before it is posted (an unsignaled one too: if the queue pair fails, its flush
//!   completion lands as well). It gives the entry back when its completion is reaped, or,
//!   unsignaled, when the signaled completion after it is reaped.
//! - **Waiting is ordered.** A connection whose CQ is out of send room waits in the CQ's
//!   `waiting` list and is posted again as room frees, in order.

/// The room of one CQ: pure counting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CqRoom {
    capacity: u32,
    /// Entries never committed to receives.
    send_floor: u32,
    recv_committed: u32,
    send_reserved: u32,
}

impl CqRoom {
    /// A CQ of `capacity` entries of which receives may never commit the last `send_floor`.
    pub(crate) fn new(capacity: u32, send_floor: u32) -> CqRoom {
        CqRoom { capacity, send_floor: send_floor.min(capacity), recv_committed: 0, send_reserved: 0 }
    }

    /// Commits `depth` entries to a new connection's receives, if they fit.
    pub(crate) fn admit(&mut self, depth: u32) -> bool {
        let need =
            u64::from(self.recv_committed) + u64::from(depth) + u64::from(self.send_floor.max(self.send_reserved));
        let fits = need <= u64::from(self.capacity);
        if fits {
            self.recv_committed += depth;
        }
        fits
    }

    /// Gives back a departed connection's receive entries.
    pub(crate) fn leave(&mut self, depth: u32) {
        self.recv_committed = self.recv_committed.saturating_sub(depth);
    }

    /// Reserves up to `n` entries for send-queue work; returns how many.
    #[cfg_attr(not(any(test, feature = "bench-internals")), allow(dead_code))] // `SendQueue`'s (the oracle and baseline).
    pub(crate) fn reserve_send(&mut self, n: u32) -> u32 {
        let room = self.capacity - self.recv_committed - self.send_reserved;
        let k = n.min(room);
        self.send_reserved += k;
        k
    }

    /// Reserves one entry for a send-queue work request: [`CqRoom::reserve_send`] of one, true
    /// when it got it.
    #[inline]
    pub(crate) fn reserve_one(&mut self) -> bool {
        let free = self.recv_committed + self.send_reserved < self.capacity;
        self.send_reserved += u32::from(free);
        free
    }

    /// Gives back `n` send-queue entries.
    pub(crate) fn release_send(&mut self, n: u32) {
        self.send_reserved = self.send_reserved.saturating_sub(n);
    }

    /// Entries that completions may occupy now: committed receives and reserved sends.
    pub(crate) fn reserved(&self) -> u32 {
        self.recv_committed + self.send_reserved
    }

    /// The CQ's entries.
    pub(crate) fn capacity(&self) -> u32 {
        self.capacity
    }

    /// True when no send may be posted.
    pub(crate) fn is_full(&self) -> bool {
        self.reserved() == self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::CqRoom;

    /// `reserve_one` is `reserve_send(1)`: the same answer and the same room left, full or not.
    #[test]
    fn reserving_one_entry_is_reserving_a_send_of_one() {
        for (cap, floor, recv, sends) in [(16, 4, 8, 0), (16, 4, 8, 3), (16, 4, 8, 8), (4, 4, 0, 4), (1, 1, 0, 0)] {
            let (mut a, mut b) = (CqRoom::new(cap, floor), CqRoom::new(cap, floor));
            assert_eq!(a.admit(recv), b.admit(recv));
            assert_eq!(a.reserve_send(sends), b.reserve_send(sends));
            for _ in 0..3 {
                assert_eq!(a.reserve_one(), b.reserve_send(1) == 1);
                assert_eq!(a, b);
            }
        }
    }

    /// Fault issue, defect 9: a huge depth overflowed the sum (a panic in a debug build).
    #[test]
    fn admission_of_a_huge_depth_is_refused_not_a_panic() {
        let mut r = CqRoom::new(u32::MAX, 16);
        assert!(r.admit(u32::MAX - 100));
        assert!(!r.admit(u32::MAX), "does not fit, and does not overflow");
        assert!(!r.admit(200));
    }

    #[test]
    fn admission_keeps_the_send_floor() {
        let mut r = CqRoom::new(16, 4);
        assert!(r.admit(8));
        assert!(r.admit(4));
        assert!(!r.admit(1), "the last 4 entries are for sends");
        assert_eq!(r.reserve_send(10), 4);
        assert!(r.is_full());
        r.leave(8);
        assert!(r.admit(3));
        assert_eq!(r.reserved(), 4 + 3 + 4);
        assert_eq!(r.capacity(), 16);
    }

    #[test]
    fn sends_never_exceed_what_receives_leave() {
        let mut r = CqRoom::new(100, 25);
        assert!(r.admit(75));
        assert_eq!(r.reserve_send(1000), 25);
        assert_eq!(r.reserve_send(1), 0);
        r.release_send(5);
        assert_eq!(r.reserve_send(1000), 5);
    }

    #[test]
    fn many_connections_sharing_one_cq_never_overrun_it() {
        // 200 connections of 3 receives each, each wanting 8 sends in flight, on a 1024-entry
        // CQ: a random interleaving of posts and completions never reserves more than 1024,
        // and every send gets to go eventually.
        let mut r = CqRoom::new(1024, 256);
        for _ in 0..200 {
            assert!(r.admit(3));
        }
        let mut want = vec![8u32; 200];
        let mut posted = vec![0u32; 200];
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut waited = 0;
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let i = (x % 200) as usize;
            if (x >> 20) % 2 == 0 {
                let k = r.reserve_send(want[i]);
                if k < want[i] {
                    waited += 1;
                }
                want[i] -= k;
                posted[i] += k;
            } else if posted[i] > 0 {
                posted[i] -= 1;
                r.release_send(1);
            }
            assert!(r.reserved() <= 1024);
        }
        assert!(waited > 0, "the test must exceed the room to mean anything");
        assert!(want.iter().all(|w| *w == 0), "every send got to go");
    }
}
