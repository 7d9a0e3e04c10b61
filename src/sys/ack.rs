//! Batched acknowledgement of completion-channel events: pure counting, no FFI.
//!
//! `ibv_ack_cq_events` takes a mutex per call, so acking each event as it is read costs a lock
//! per wakeup. The reactor counts events per CQ and acks them in one call when the count
//! reaches a threshold, and always before the CQ is destroyed (which waits for every event to
//! be acked).

/// Un-acked events of one CQ and the threshold at which to ack them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct AckCounter {
    pending: u32,
    threshold: u32,
}

impl AckCounter {
    /// A counter that asks for an ack every `threshold` events (0 or 1: every event).
    pub fn new(threshold: u32) -> Self {
        AckCounter { pending: 0, threshold: threshold.max(1) }
    }

    /// Counts one event.
    pub fn note(&mut self) {
        self.pending = self.pending.saturating_add(1);
    }

    /// Events counted and not yet acked.
    pub fn pending(&self) -> u32 {
        self.pending
    }

    /// True when the threshold is reached: [`take_due`](Self::take_due) would ack.
    pub fn is_due(&self) -> bool {
        self.pending >= self.threshold
    }

    /// If the threshold is reached, takes the count to ack now.
    pub fn take_due(&mut self) -> Option<u32> {
        if self.pending >= self.threshold {
            Some(self.take_all())
        } else {
            None
        }
    }

    /// Takes the whole count (before destroying the CQ), possibly 0.
    pub fn take_all(&mut self) -> u32 {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acks_in_batches_of_threshold() {
        let mut c = AckCounter::new(4);
        let mut acked = Vec::new();
        for _ in 0..10 {
            c.note();
            if let Some(n) = c.take_due() {
                acked.push(n);
            }
        }
        assert_eq!(acked, vec![4, 4]);
        assert_eq!(c.pending(), 2);
        assert_eq!(c.take_all(), 2, "the remainder is acked before destroy");
        assert_eq!(c.take_all(), 0);
        assert_eq!(c.take_due(), None);
    }

    #[test]
    fn threshold_zero_or_one_acks_every_event() {
        for t in [0, 1] {
            let mut c = AckCounter::new(t);
            c.note();
            assert_eq!(c.take_due(), Some(1));
            assert_eq!(c.take_due(), None);
        }
    }

    #[test]
    fn every_event_is_acked_exactly_once() {
        for threshold in 1..20u32 {
            let mut c = AckCounter::new(threshold);
            let mut total = 0u32;
            for i in 0..1000u32 {
                c.note();
                // Check at irregular "end of tick" points.
                if i % 7 == 0 {
                    total += c.take_due().unwrap_or(0);
                }
            }
            total += c.take_all();
            assert_eq!(total, 1000, "threshold {threshold}");
        }
    }
}
