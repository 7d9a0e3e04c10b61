//! The order [`Connection::recv`](super::Connection::recv) keeps, pure: messages are handed out
//! in arrival order, one per call, to the callers in the order they asked.
//!
//! Each caller has a place in line from the moment it asks (`join`, when its `Recv` is made)
//! until it takes its message (`take`) or gives up (`leave`, its `Recv` dropped). A message is
//! given to the first caller in line that has none, and woken there; only when nobody waits is
//! it kept unclaimed, for the next caller to ask. So a woken caller's message is its own: no
//! other task polled before it can take it (the bug this replaces: the waker was taken out of
//! the queue while the message stayed in a shared inbox, so any `Recv` polled first took it,
//! and concurrent request/response tasks received each other's replies).
//!
//! Invariants (checked by the unit tests after every step):
//! - the places holding a message are a prefix of the line;
//! - a message is unclaimed only while every place in line holds one;
//! - messages leave in arrival order along the line: a caller that gives up holding a message
//!   passes it on to the one behind it (each later holder passes its own on, the last to the
//!   first waiting caller, or back to the head of the unclaimed ones), so none is lost and
//!   none overtakes another.

use std::collections::VecDeque;
use std::task::Waker;

use slab::Slab;

/// One caller's place: its message once it has one, and its waker while it waits.
struct Place<T> {
    msg: Option<T>,
    waker: Option<Waker>,
}

/// The callers waiting for a message of one connection, and the messages no caller holds yet.
pub(super) struct RecvLine<T> {
    /// Messages no caller is in line for, oldest first.
    unclaimed: VecDeque<T>,
    /// The callers' places, in the order they asked.
    line: VecDeque<usize>,
    places: Slab<Place<T>>,
    /// How many places at the head of `line` hold a message.
    served: usize,
}

impl<T> Default for RecvLine<T> {
    fn default() -> Self {
        RecvLine { unclaimed: VecDeque::new(), line: VecDeque::new(), places: Slab::new(), served: 0 }
    }
}

impl<T> RecvLine<T> {
    /// A new caller, at the end of the line; it gets the oldest unclaimed message at once if
    /// there is one. Returns its place.
    pub(super) fn join(&mut self) -> usize {
        let msg = self.unclaimed.pop_front();
        let held = msg.is_some();
        let key = self.places.insert(Place { msg, waker: None });
        self.line.push_back(key);
        if held {
            // Unclaimed messages exist only while every place holds one: this is the next.
            self.served += 1;
        }
        key
    }

    /// A message arrived: to the first caller in line without one (woken), else unclaimed.
    pub(super) fn arrive(&mut self, msg: T) {
        match self.line.get(self.served) {
            Some(&key) => {
                self.served += 1;
                let place = &mut self.places[key];
                place.msg = Some(msg);
                if let Some(w) = place.waker.take() {
                    w.wake();
                }
            }
            None => self.unclaimed.push_back(msg),
        }
    }

    /// The caller at `key` takes its message and leaves the line; without one yet, it stays
    /// and `waker` is woken when one is given to it. `None` also for a place not in line.
    pub(super) fn take(&mut self, key: usize, waker: &Waker) -> Option<T> {
        let place = self.places.get_mut(key)?;
        if place.msg.is_none() {
            if !place.waker.as_ref().is_some_and(|w| w.will_wake(waker)) {
                place.waker = Some(waker.clone());
            }
            return None;
        }
        let msg = self.places.remove(key).msg;
        // Usually the head of the line takes its message: `pop_front` then (issue 33:
        // `VecDeque::remove` of the front cost about 40 instructions a message).
        match self.position(key) {
            0 => drop(self.line.pop_front()),
            pos => drop(self.line.remove(pos)),
        }
        self.served -= 1;
        msg
    }

    /// The caller at `key` gives up its place. A message it held goes to the one behind it,
    /// each later holder's to the next, and the last to the first caller waiting (woken) or
    /// back to the head of the unclaimed messages: arrival order holds along the line.
    pub(super) fn leave(&mut self, key: usize) {
        if !self.places.contains(key) {
            return;
        }
        let pos = self.position(key);
        self.line.remove(pos);
        let Some(mut carry) = self.places.remove(key).msg else { return };
        self.served -= 1;
        for i in pos..self.served {
            let k = self.line[i];
            carry = self.places[k].msg.replace(carry).expect("the served places hold a message");
        }
        match self.line.get(self.served) {
            Some(&k) => {
                self.served += 1;
                let place = &mut self.places[k];
                place.msg = Some(carry);
                if let Some(w) = place.waker.take() {
                    w.wake();
                }
            }
            None => self.unclaimed.push_front(carry),
        }
    }

    /// Messages received and not yet taken (held in line or unclaimed).
    pub(super) fn unread(&self) -> usize {
        self.unclaimed.len() + self.served
    }

    /// Wakes every caller waiting for a message (the connection ended).
    pub(super) fn wake_all(&mut self) {
        for (_, place) in self.places.iter_mut() {
            if let Some(w) = place.waker.take() {
                w.wake();
            }
        }
    }

    fn position(&self, key: usize) -> usize {
        self.line.iter().position(|&k| k == key).expect("a place in the slab is in line")
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::{Wake, Waker};

    use super::RecvLine;

    /// Counts its wakes.
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn waker() -> (Waker, Arc<Count>) {
        let c = Arc::new(Count(AtomicUsize::new(0)));
        (Waker::from(c.clone()), c)
    }

    fn check<T>(l: &RecvLine<T>) {
        let held = l.line.iter().take_while(|&&k| l.places[k].msg.is_some()).count();
        assert_eq!(held, l.served, "the places holding a message are a prefix of the line");
        assert!(l.line.iter().skip(l.served).all(|&k| l.places[k].msg.is_none()));
        assert!(l.unclaimed.is_empty() || l.served == l.line.len(), "unclaimed only while all hold one");
        assert_eq!(l.places.len(), l.line.len());
    }

    #[test]
    fn a_woken_callers_message_is_its_own_whoever_polls_first() {
        let mut l = RecvLine::default();
        let (wa, ca) = waker();
        let a = l.join();
        assert_eq!(l.take(a, &wa), None);
        l.arrive(1);
        assert_eq!(ca.0.load(Ordering::Relaxed), 1, "the first in line is woken");
        // Another caller asks before the woken one is polled: it waits for the next message.
        let (wc, _) = waker();
        let c = l.join();
        assert_eq!(l.take(c, &wc), None);
        assert_eq!(l.take(a, &wa), Some(1));
        l.arrive(2);
        assert_eq!(l.take(c, &wc), Some(2));
        check(&l);
    }

    #[test]
    fn callers_get_messages_in_the_order_they_asked() {
        let mut l = RecvLine::default();
        let keys: Vec<usize> = (0..5).map(|_| l.join()).collect();
        for m in 0..5 {
            l.arrive(m);
            check(&l);
        }
        // Taken in any order, each caller has the message of its place in line.
        for (i, &k) in keys.iter().enumerate().rev() {
            assert_eq!(l.take(k, &waker().0), Some(i));
            check(&l);
        }
        assert_eq!(l.unread(), 0);
    }

    #[test]
    fn a_caller_that_gives_up_passes_its_message_on_in_order() {
        let mut l = RecvLine::default();
        let (a, b, c) = (l.join(), l.join(), l.join());
        let (wc, cc) = waker();
        assert_eq!(l.take(c, &wc), None);
        l.arrive(10);
        l.arrive(20);
        assert_eq!(l.unread(), 2);
        // `a` held 10, `b` 20; `a` gives up: `b` gets 10, `c` (waiting) gets 20 and is woken.
        l.leave(a);
        check(&l);
        assert_eq!(cc.0.load(Ordering::Relaxed), 1);
        assert_eq!(l.take(b, &waker().0), Some(10));
        assert_eq!(l.take(c, &wc), Some(20));
        // Nobody behind: a message given up goes back to the head of the unclaimed ones.
        let d = l.join();
        l.arrive(30);
        l.arrive(40);
        l.leave(d);
        check(&l);
        let e = l.join();
        assert_eq!(l.take(e, &waker().0), Some(30));
        let f = l.join();
        assert_eq!(l.take(f, &waker().0), Some(40));
        // A waiting caller that gives up leaves nothing behind.
        let g = l.join();
        l.leave(g);
        l.leave(g);
        check(&l);
        assert_eq!((l.unread(), l.line.len()), (0, 0));
    }

    /// Random joins, arrivals, takes and departures: every message is taken once or is still
    /// unclaimed, the invariants hold after every step, and where no caller gives up, callers
    /// in the order they asked got messages in arrival order. (A caller that gives up a
    /// message after one behind it took a newer one cannot keep that order: its message goes
    /// to the next caller to ask.)
    #[test]
    fn a_random_schedule_keeps_the_order_and_loses_nothing() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for run in 0..400 {
            let leaves = run % 2 == 1;
            let mut l = RecvLine::default();
            let (mut sent, mut joined) = (0u64, 0u64);
            // (join order, message) of each message taken; callers in line: (place, join order).
            let mut taken = Vec::new();
            let mut callers: Vec<(usize, u64)> = Vec::new();
            for _ in 0..200 {
                match next(4) {
                    0 => {
                        callers.push((l.join(), joined));
                        joined += 1;
                    }
                    1 => {
                        l.arrive(sent);
                        sent += 1;
                    }
                    2 if !callers.is_empty() => {
                        let i = next(callers.len() as u64) as usize;
                        if let Some(m) = l.take(callers[i].0, &waker().0) {
                            taken.push((callers[i].1, m));
                            callers.remove(i);
                        }
                    }
                    3 if leaves && !callers.is_empty() => {
                        let i = next(callers.len() as u64) as usize;
                        l.leave(callers.remove(i).0);
                    }
                    _ => {}
                }
                check(&l);
            }
            // Whoever is still in line takes what is there; the rest is unclaimed.
            for (k, order) in callers.drain(..) {
                if let Some(m) = l.take(k, &waker().0) {
                    taken.push((order, m));
                }
            }
            assert_eq!(taken.len() as u64 + l.unclaimed.len() as u64, sent, "every message taken once or unclaimed");
            let mut msgs: Vec<u64> = taken.iter().map(|t| t.1).chain(l.unclaimed.iter().copied()).collect();
            msgs.sort_unstable();
            msgs.dedup();
            assert_eq!(msgs.len() as u64, sent, "no message twice");
            if !leaves {
                taken.sort_unstable();
                assert!(
                    taken.windows(2).all(|w| w[0].1 < w[1].1),
                    "callers in the order they asked got messages in arrival order: {taken:?}"
                );
                let newest = taken.last().map(|t| t.1);
                assert!(l.unclaimed.iter().all(|m| Some(*m) > newest), "the unclaimed are the newest");
            }
        }
    }
}
