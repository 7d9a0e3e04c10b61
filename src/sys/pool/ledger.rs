//! Who holds a pool's memory: a reservation per connection and a shared remainder, pure (no
//! FFI) and unit-tested (issue 45, "Isolation II").
//!
//! Per-connection bounds (a send backlog, receives sized by the server) do not add up to
//! isolation: one peer is not one connection, and a few connections whose peers make them
//! hold memory (replies queued behind a peer that grants one credit, receives posted for
//! connections that never send) could take the whole pool, after which every other
//! connection's next allocation failed (review of 2026-12-07, N3). The ledger splits the
//! pool's bytes:
//!
//! - **Reservations.** A connection is admitted with a reservation: the chunk bytes its
//!   minimum needs (its first receives and one send of its largest size, `Core`'s
//!   `reservation`). The reservations together are at most [`Budget::reservable`]; one that
//!   does not fit is refused at admission, with a reason its client sees. What a connection
//!   holds within its reservation it can always have: no other connection can take it.
//! - **The shared remainder.** Beyond its reservation a connection borrows, while the bytes
//!   borrowed by all connections stay within [`Budget::shared`] and its own within
//!   [`Budget::per_account`]. Under pressure, borrowing is what fails first: a connection at
//!   its reservation keeps being served, however much the others hold.
//!
//! So whatever the peers do, a connection can hold at most its reservation plus
//! `per_account`, all connections together at most `reservable + shared`, and every admitted
//! connection its reservation. Bytes are chunk bytes (a buffer's capacity), charged when a
//! buffer is allocated, credited when it is dropped, to the account it was allocated for (a
//! buffer submitted on another connection stays charged to the one that allocated it); a
//! shared receive queue's buffers are charged to the device's own account and move to a
//! connection's when a message for it lands in one ([`Ledger::transfer`]).
//!
//! An account outlives its connection while buffers charged to it live (an application may
//! keep a buffer): its reservation is released when the connection closes, and whatever it
//! still holds counts as borrowed from then on, so it never frees bytes it does not have.

/// How a pool's bytes are split (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    /// The most bytes reserved at once, over all accounts.
    pub reservable: usize,
    /// The most bytes borrowed at once beyond the accounts' reservations, over all accounts.
    pub shared: usize,
    /// The most bytes one account borrows beyond its reservation.
    pub per_account: usize,
}

/// An account of the ledger: a connection's (or a shared receive queue's). [`Account::NONE`]
/// charges nothing: the memory of the runtime's own that no peer controls.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Account(u32);

impl Account {
    /// Charged to no account.
    pub const NONE: Account = Account(0);

    /// Its index, for a buffer to keep (`u32`: a `Buf` moves in a few stores).
    pub(crate) fn raw(self) -> u32 {
        self.0
    }

    pub(crate) fn from_raw(raw: u32) -> Account {
        Account(raw)
    }
}

/// Why a charge was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The account would borrow more than [`Budget::per_account`].
    Account {
        /// Bytes it holds now.
        held: usize,
        /// Its reservation.
        reserved: usize,
    },
    /// The shared remainder is lent out ([`Budget::shared`]).
    Shared {
        /// Bytes borrowed now, over all accounts.
        borrowed: usize,
    },
}

#[derive(Clone, Copy, Debug, Default)]
struct Entry {
    reserved: usize,
    used: usize,
    /// Its connection lives: its reservation stands.
    open: bool,
    /// Its reservation is outside [`Budget::reservable`] ([`Ledger::open_outside`]).
    outside: bool,
}

impl Entry {
    fn over(&self) -> usize {
        self.used.saturating_sub(self.reserved)
    }
}

/// The accounts of one pool (see the module docs).
#[derive(Debug)]
pub struct Ledger {
    budget: Budget,
    /// Σ reservations of open accounts.
    reserved: usize,
    /// Σ over every account of what it holds beyond its reservation (all of it, once closed).
    borrowed: usize,
    /// Slot 0 is [`Account::NONE`]'s and never used.
    entries: Vec<Entry>,
    free: Vec<u32>,
    /// Credits so far (wrapping): a change says memory came back to some account, with or
    /// without an event to tell the reactor (a buffer dropped outside it).
    returned: u64,
}

impl Ledger {
    /// An empty ledger with `budget`.
    pub fn new(budget: Budget) -> Ledger {
        Ledger { budget, reserved: 0, borrowed: 0, entries: vec![Entry::default()], free: Vec::new(), returned: 0 }
    }

    /// The split.
    pub fn budget(&self) -> Budget {
        self.budget
    }

    /// Bytes reserved now, over the open accounts.
    pub fn reserved(&self) -> usize {
        self.reserved
    }

    /// Bytes borrowed now, over all accounts.
    pub fn borrowed(&self) -> usize {
        self.borrowed
    }

    /// How many credits were made so far (wrapping): compared with an earlier reading, whether
    /// any memory came back since.
    pub fn returned(&self) -> u64 {
        self.returned
    }

    /// True when a reservation of `bytes` would fit now.
    pub fn can_reserve(&self, bytes: usize) -> bool {
        self.reserved.checked_add(bytes).is_some_and(|r| r <= self.budget.reservable)
    }

    /// Opens an account with a reservation of `bytes`; `None` when the reservations would
    /// exceed [`Budget::reservable`].
    pub fn open(&mut self, bytes: usize) -> Option<Account> {
        if !self.can_reserve(bytes) {
            return None;
        }
        self.reserved += bytes;
        Some(self.insert(Entry { reserved: bytes, used: 0, open: true, outside: false }))
    }

    /// Opens an account whose reservation of `bytes` is not taken from
    /// [`Budget::reservable`]: a device's own (a shared receive queue's receives, whose bytes
    /// the pool's configuration sets aside before it splits the rest).
    pub fn open_outside(&mut self, bytes: usize) -> Account {
        self.insert(Entry { reserved: bytes, used: 0, open: true, outside: true })
    }

    /// Puts `e` in a free place of the table (the last freed first), else at its end.
    fn insert(&mut self, e: Entry) -> Account {
        let i = match self.free.pop() {
            Some(i) => {
                self.entries[i as usize] = e;
                i
            }
            None => {
                self.entries.push(e);
                u32::try_from(self.entries.len() - 1).unwrap_or(u32::MAX)
            }
        };
        Account(i)
    }

    /// The account's connection is gone: its reservation is released, and what it still holds
    /// counts as borrowed until it is dropped. Closing [`Account::NONE`], an unknown or a
    /// closed account does nothing.
    pub fn close(&mut self, a: Account) {
        let Some(e) = self.live(a).filter(|e| e.open).copied() else { return };
        let over = e.over();
        if !e.outside {
            self.reserved -= e.reserved;
        }
        self.borrowed = self.borrowed - over + e.used;
        let e = &mut self.entries[a.0 as usize];
        e.open = false;
        e.reserved = 0;
        self.retire(a);
    }

    /// Charges `bytes` to `a` if it may hold them: within its reservation, or borrowed within
    /// both its own limit and the shared remainder. Nothing changes when it may not.
    pub fn charge(&mut self, a: Account, bytes: usize) -> Result<(), Refusal> {
        let Some(e) = self.live(a).copied() else { return Ok(()) };
        let used = e.used.saturating_add(bytes);
        let more = used.saturating_sub(e.reserved) - e.over();
        if more > 0 {
            if used.saturating_sub(e.reserved) > self.budget.per_account {
                return Err(Refusal::Account { held: e.used, reserved: e.reserved });
            }
            if self.borrowed.saturating_add(more) > self.budget.shared {
                return Err(Refusal::Shared { borrowed: self.borrowed });
            }
        }
        self.borrowed += more;
        self.entries[a.0 as usize].used = used;
        Ok(())
    }

    /// Credits `bytes` back to `a` (a buffer charged to it was dropped).
    pub fn credit(&mut self, a: Account, bytes: usize) {
        self.returned = self.returned.wrapping_add(1);
        let Some(e) = self.live(a).copied() else { return };
        let used = e.used.saturating_sub(bytes);
        let less = e.over() - used.saturating_sub(e.reserved);
        self.borrowed -= less;
        self.entries[a.0 as usize].used = used;
        self.retire(a);
    }

    /// Moves `bytes` from `from`'s charge to `to`'s, whether or not `to` may hold them: a
    /// buffer already in use changes hands (a shared receive queue's buffer now holds a
    /// message for connection `to`). Afterwards [`Ledger::can_borrow`] says whether `to` is
    /// still within its limits.
    pub fn transfer(&mut self, from: Account, to: Account, bytes: usize) {
        if from == to {
            return;
        }
        self.credit(from, bytes);
        let Some(e) = self.live(to).copied() else { return };
        let used = e.used.saturating_add(bytes);
        self.borrowed += used.saturating_sub(e.reserved) - e.over();
        self.entries[to.0 as usize].used = used;
    }

    /// True when `a` may hold `bytes` more now ([`Ledger::charge`] would take them).
    pub fn can_charge(&self, a: Account, bytes: usize) -> bool {
        let Some(e) = self.live(a) else { return true };
        let used = e.used.saturating_add(bytes);
        let more = used.saturating_sub(e.reserved) - e.over();
        more == 0
            || (used.saturating_sub(e.reserved) <= self.budget.per_account
                && self.borrowed.saturating_add(more) <= self.budget.shared)
    }

    /// Bytes `a` holds now, and its reservation.
    pub fn held(&self, a: Account) -> (usize, usize) {
        self.live(a).map_or((0, 0), |e| (e.used, e.reserved))
    }

    /// Accounts open or still holding bytes.
    #[cfg(test)]
    pub fn accounts(&self) -> usize {
        self.entries.len() - 1 - self.free.len()
    }

    fn live(&self, a: Account) -> Option<&Entry> {
        if a == Account::NONE {
            return None;
        }
        self.entries.get(a.0 as usize).filter(|e| e.open || e.used > 0)
    }

    /// Frees a closed account's slot once it holds nothing.
    fn retire(&mut self, a: Account) {
        let e = self.entries[a.0 as usize];
        if !e.open && e.used == 0 {
            self.entries[a.0 as usize] = Entry::default();
            self.free.push(a.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const K: usize = 1024;

    fn ledger() -> Ledger {
        Ledger::new(Budget { reservable: 100 * K, shared: 50 * K, per_account: 30 * K })
    }

    /// The ledger's own sums, recomputed.
    fn check(l: &Ledger) {
        let reserved: usize = l.entries.iter().filter(|e| e.open && !e.outside).map(|e| e.reserved).sum();
        let borrowed: usize = l.entries.iter().map(Entry::over).sum();
        assert_eq!((l.reserved, l.borrowed), (reserved, borrowed));
        assert!(l.reserved <= l.budget.reservable);
    }

    #[test]
    fn reservations_are_admitted_while_they_fit() {
        let mut l = ledger();
        let a = l.open(60 * K).expect("fits");
        assert!(l.open(41 * K).is_none(), "60 + 41 > 100");
        let b = l.open(40 * K).expect("60 + 40 = 100");
        assert!(!l.can_reserve(1));
        l.close(a);
        assert!(l.can_reserve(60 * K), "a closed account's reservation is free again");
        l.close(b);
        check(&l);
        assert_eq!(l.accounts(), 0);
    }

    #[test]
    fn within_its_reservation_an_account_is_served_whatever_the_others_borrowed() {
        let mut l = ledger();
        let (hog, good) = (l.open(10 * K).unwrap(), l.open(10 * K).unwrap());
        // The hog borrows to its own limit, a second one takes the rest of the shared part.
        for _ in 0..40 {
            let _ = l.charge(hog, K);
        }
        assert_eq!(l.held(hog), (40 * K, 10 * K), "its reservation and its own limit of borrowing");
        assert_eq!(l.charge(hog, K), Err(Refusal::Account { held: 40 * K, reserved: 10 * K }));
        let other = l.open(5 * K).unwrap();
        for _ in 0..25 {
            let _ = l.charge(other, K);
        }
        assert_eq!(l.borrowed(), 50 * K, "the shared remainder is lent out");
        assert_eq!(l.charge(good, 11 * K), Err(Refusal::Shared { borrowed: 50 * K }), "no borrowing left");
        assert_eq!(l.charge(good, 10 * K), Ok(()), "but its reservation is there");
        l.credit(good, 10 * K);
        // The hog gives back: others may borrow again.
        l.credit(hog, 5 * K);
        assert_eq!(l.charge(good, 12 * K), Ok(()));
        check(&l);
    }

    #[test]
    fn a_closed_account_keeps_its_bytes_as_borrowed_until_they_are_dropped() {
        let mut l = ledger();
        let a = l.open(10 * K).unwrap();
        l.charge(a, 8 * K).unwrap();
        l.close(a);
        assert_eq!((l.reserved(), l.borrowed()), (0, 8 * K), "its buffers are borrowed now");
        assert_eq!(l.accounts(), 1, "kept while it holds bytes");
        l.credit(a, 8 * K);
        assert_eq!((l.borrowed(), l.accounts()), (0, 0));
        // Its slot is reused; a late credit naming it finds nothing of its own.
        let b = l.open(10 * K).unwrap();
        assert_eq!(b, a);
        check(&l);
    }

    #[test]
    fn a_transfer_moves_a_charge_even_beyond_the_limits() {
        let mut l = ledger();
        let (srq, c) = (l.open_outside(200 * K), l.open(K).unwrap());
        assert_eq!(l.reserved(), K, "the device's own reservation is outside the connections'");
        let srq_slot = srq;
        l.close(srq_slot);
        let srq = l.open_outside(20 * K);
        l.charge(srq, 20 * K).unwrap();
        for _ in 0..40 {
            l.transfer(srq, c, K);
            // The device's account refills within its reservation.
            l.charge(srq, K).unwrap();
        }
        assert_eq!(l.held(c).0, 40 * K);
        assert!(!l.can_charge(c, 1), "beyond its limit: it may take nothing more");
        assert_eq!(l.held(srq), (20 * K, 20 * K), "the device's account stays at its reservation");
        check(&l);
        l.credit(c, 40 * K);
        assert_eq!(l.borrowed(), 0);
        check(&l);
    }

    #[test]
    fn none_charges_nothing_and_unknown_accounts_are_ignored() {
        let mut l = ledger();
        assert_eq!(l.charge(Account::NONE, usize::MAX), Ok(()));
        l.credit(Account::NONE, 5);
        l.credit(Account(99), 5);
        l.close(Account(99));
        assert_eq!(l.charge(Account(99), 5), Ok(()));
        assert_eq!((l.reserved(), l.borrowed(), l.accounts()), (0, 0, 0));
    }

    /// Random opens, charges, credits, transfers and closes: the sums hold, nothing is
    /// borrowed beyond the budget by a charge, and every account within its reservation is
    /// always served.
    #[test]
    fn random_use_keeps_the_sums_and_the_reservations() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for _ in 0..200 {
            let mut l = ledger();
            let mut open: Vec<(Account, Vec<usize>)> = Vec::new();
            let mut closed: Vec<(Account, Vec<usize>)> = Vec::new();
            for _ in 0..400 {
                match next(6) {
                    0 => {
                        if let Some(a) = l.open((next(20) as usize + 1) * K) {
                            open.push((a, Vec::new()));
                        }
                    }
                    1 | 2 if !open.is_empty() => {
                        let i = next(open.len() as u64) as usize;
                        let n = (next(8) as usize + 1) * K;
                        let (held, reserved) = l.held(open[i].0);
                        let before = l.borrowed();
                        match l.charge(open[i].0, n) {
                            Ok(()) => open[i].1.push(n),
                            Err(_) => assert!(held + n > reserved, "refused within its reservation"),
                        }
                        assert!(l.borrowed() <= l.budget().shared.max(before));
                    }
                    3 if !open.is_empty() => {
                        let i = next(open.len() as u64) as usize;
                        if let Some(n) = open[i].1.pop() {
                            l.credit(open[i].0, n);
                        }
                    }
                    4 if open.len() > 1 => {
                        let (i, j) = (next(open.len() as u64) as usize, next(open.len() as u64) as usize);
                        if i != j {
                            if let Some(n) = open[i].1.pop() {
                                l.transfer(open[i].0, open[j].0, n);
                                open[j].1.push(n);
                            }
                        }
                    }
                    5 if !open.is_empty() => {
                        let i = next(open.len() as u64) as usize;
                        let gone = open.swap_remove(i);
                        l.close(gone.0);
                        closed.push(gone);
                    }
                    _ => {}
                }
                check(&l);
                for (a, bufs) in &open {
                    assert_eq!(l.held(*a).0, bufs.iter().sum::<usize>());
                }
            }
            for (a, bufs) in open.into_iter().chain(closed) {
                l.close(a);
                for n in bufs {
                    l.credit(a, n);
                }
            }
            assert_eq!((l.reserved(), l.borrowed(), l.accounts()), (0, 0, 0), "everything given back");
        }
    }
}
