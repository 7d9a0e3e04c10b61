//! What a peer's numbers may do: the pure bookkeeping of numbered messages and rings, unit-tested.

use super::*;

// ----- what a peer's numbers may do: pure bookkeeping, unit-tested ----------------------------

/// How far past the first missing message a reconnecting client's messages are recorded: one
/// bit each, so a coverage holds at most 8 KiB whatever numbers its client sends.
const AHEAD_MAX: u64 = 1 << 16;

/// The reconnecting clients whose coverage one reactor keeps (each at most about 8 KiB).
pub(crate) const RESUMABLE_MAX: usize = 1024;

/// A client's connect information ([`USER_MAGIC`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    pub(crate) write: bool,
    pub(crate) id: u64,
    /// `FLAG_NUMBERED`: the client's key.
    pub(crate) key: Option<[u8; KEY_LEN]>,
}

impl Hello {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut user = USER_MAGIC.to_vec();
        user.push(if self.write { FLAG_WRITE } else { 0 } | if self.key.is_some() { FLAG_NUMBERED } else { 0 });
        user.extend_from_slice(&self.id.to_be_bytes());
        user.extend_from_slice(self.key.as_ref().map_or(&[][..], |k| &k[..]));
        user
    }

    pub(crate) fn parse(user: &[u8]) -> Result<Hello, String> {
        if user.len() < 13 || &user[..4] != USER_MAGIC {
            return Err("not a blast client".into());
        }
        let id = u64::from_be_bytes(user[5..13].try_into().expect("8 bytes"));
        let key = if user[4] & FLAG_NUMBERED != 0 {
            let Some(key) = user.get(13..13 + KEY_LEN) else {
                return Err(format!("client {id}: numbered messages and no key (a blast client of before the key)"));
            };
            Some(key.try_into().expect("KEY_LEN bytes"))
        } else {
            None
        };
        Ok(Hello { write: user[4] & FLAG_WRITE != 0, id, key })
    }
}

/// What a numbered client must state to be served: a count (the server records numbers up to
/// it, and refuses any past it) and messages that hold their number, by SEND.
pub(crate) fn numbered_terms(size: usize, count: u32, write: bool) -> Result<(), String> {
    if count == 0 {
        return Err("numbered messages and no count: the server needs to know where they end".into());
    }
    if size < 8 {
        return Err(format!("numbered messages of {size} bytes: a number takes 8"));
    }
    if write {
        return Err("numbered messages by RDMA WRITE: --reconnect takes --op send".into());
    }
    Ok(())
}

/// Which numbered messages of one reconnecting client arrived: every one below `floor`, and
/// of the [`AHEAD_MAX`] after it those marked in `ahead`. Its memory does not depend on the
/// client's numbers.
pub(crate) struct Coverage {
    /// The key the client's first connection gave: later ones must give it too.
    key: [u8; KEY_LEN],
    /// The client's message count: every number is below it.
    pub(crate) expected: u64,
    /// The first message not received: every one before it was.
    pub(crate) floor: u64,
    /// Bit `i` of word `w`: message `base + 64 w + i` arrived. One word while messages come
    /// in order.
    ahead: VecDeque<u64>,
    /// `floor` rounded down to a multiple of 64: the number of `ahead`'s first bit.
    base: u64,
    pub(crate) duplicates: u64,
    pub(crate) connections: u64,
    /// When a connection last claimed it, by [`Resumable`]'s clock.
    used: u64,
}

/// What [`Coverage::record`] made of a message number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Seen {
    /// Its first arrival: recorded.
    New,
    /// It had arrived before (the client sent it again).
    Again,
    /// [`AHEAD_MAX`] or more past the first missing one: not recorded. The client must send it
    /// again (the server tells it to resume at the floor).
    Beyond,
}

impl Coverage {
    fn new(key: [u8; KEY_LEN], expected: u64) -> Coverage {
        Coverage { key, expected, floor: 0, ahead: VecDeque::new(), base: 0, duplicates: 0, connections: 0, used: 0 }
    }

    /// Records message `seq`; `Err` for a number the client cannot have sent (at or past its
    /// count), which closes its connection.
    pub(crate) fn record(&mut self, seq: u64) -> Result<Seen, String> {
        if seq >= self.expected {
            return Err(format!("message number {seq} of {}", self.expected));
        }
        if seq < self.floor {
            self.duplicates += 1;
            return Ok(Seen::Again);
        }
        if seq - self.floor >= AHEAD_MAX {
            return Ok(Seen::Beyond);
        }
        // Below floor + AHEAD_MAX, so the word is below (63 + AHEAD_MAX) / 64.
        let at = seq - self.base;
        let (word, bit) = ((at / 64) as usize, 1u64 << (at % 64));
        if self.ahead.len() <= word {
            self.ahead.resize(word + 1, 0);
        }
        if self.ahead[word] & bit != 0 {
            self.duplicates += 1;
            return Ok(Seen::Again);
        }
        self.ahead[word] |= bit;
        // Up over every message now received in a row; words wholly below the floor go.
        while let Some(&w) = self.ahead.front() {
            let off = self.floor - self.base;
            self.floor += u64::from((!(w >> off)).trailing_zeros());
            if self.floor - self.base < 64 {
                break;
            }
            self.ahead.pop_front();
            self.base += 64;
        }
        Ok(Seen::New)
    }
}

/// Why [`Resumable::claim`] gave no coverage.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Unclaimed {
    /// The id is another client's (another key, or another count): refused for good.
    NotYours(String),
    /// The table is full of clients with a connection: refused for now.
    Full(String),
}

/// The coverage of each reconnecting client, by id, bound to the key its first connection
/// gave; at most `max` of them.
pub(crate) struct Resumable {
    max: usize,
    /// Counts claims: the idle entry claimed longest ago goes first.
    clock: u64,
    clients: HashMap<u64, Rc<RefCell<Coverage>>>,
}

impl Resumable {
    pub(crate) fn new(max: usize) -> Resumable {
        Resumable { max, clock: 0, clients: HashMap::new() }
    }

    /// The coverage of client `id` for a connection that gives `key` and `expected`: the one
    /// kept if the key and count are those it was made with, else a new one. While the
    /// connection holds it (the agent), no other claim evicts it.
    pub(crate) fn claim(
        &mut self,
        id: u64,
        key: &[u8; KEY_LEN],
        expected: u64,
    ) -> Result<Rc<RefCell<Coverage>>, Unclaimed> {
        self.clock += 1;
        if let Some(c) = self.clients.get(&id) {
            let mut cov = c.borrow_mut();
            if !same_key(&cov.key, key) {
                return Err(Unclaimed::NotYours(format!("client {id}: not the key its first connection gave")));
            }
            if cov.expected != expected {
                let text =
                    format!("client {id}: {expected} messages, where its first connection said {}", cov.expected);
                return Err(Unclaimed::NotYours(text));
            }
            cov.used = self.clock;
            drop(cov);
            return Ok(c.clone());
        }
        if self.clients.len() >= self.max {
            // Only this table holds an idle one's coverage.
            let idle =
                self.clients.iter().filter(|(_, c)| Rc::strong_count(c) == 1).min_by_key(|(_, c)| c.borrow().used);
            let Some(old) = idle.map(|(old, _)| *old) else {
                return Err(Unclaimed::Full(format!(
                    "{} reconnecting clients connected: no room for another",
                    self.max
                )));
            };
            self.clients.remove(&old);
        }
        let mut cov = Coverage::new(*key, expected);
        cov.used = self.clock;
        let c = Rc::new(RefCell::new(cov));
        self.clients.insert(id, c.clone());
        Ok(c)
    }
}

/// Keys compared in time that does not depend on where they differ: a client probing ids
/// learns nothing from how fast it is refused.
fn same_key(a: &[u8; KEY_LEN], b: &[u8; KEY_LEN]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The `RESUME` messages of one connection: one in flight at a time, so a client whose
/// messages keep asking for one cannot pile them up in the send queue; the latest value waits
/// behind it, and a value already announced is not sent again.
#[derive(Debug, Default)]
pub(crate) struct Announcer {
    /// The last value sent or waiting.
    last: Option<u64>,
    busy: bool,
    waiting: bool,
}

impl Announcer {
    /// `next` is where the client should resume: the value to send now, if any.
    pub(crate) fn want(&mut self, next: u64) -> Option<u64> {
        if self.last == Some(next) {
            return None;
        }
        self.last = Some(next);
        if self.busy {
            self.waiting = true;
            return None;
        }
        self.busy = true;
        Some(next)
    }

    /// The one in flight completed: the value to send now, if one waited.
    pub(crate) fn sent(&mut self) -> Option<u64> {
        self.busy = std::mem::take(&mut self.waiting);
        if self.busy {
            self.last
        } else {
            None
        }
    }
}

/// The bytes of `--op write` rings pinned by every connection of a server, and `--ring-bytes`.
pub(crate) struct RingBudget {
    max: u64,
    used: AtomicU64,
}

/// A ring's share of the [`RingBudget`], given back when dropped.
pub(crate) struct RingLease {
    budget: Arc<RingBudget>,
    bytes: u64,
}

impl RingBudget {
    pub(crate) fn new(max: u64) -> RingBudget {
        RingBudget { max, used: AtomicU64::new(0) }
    }

    /// `bytes` more, if they fit under the cap.
    pub(crate) fn lease(self: &Arc<Self>, bytes: u64) -> Result<RingLease, String> {
        let fits = |used: u64| used.checked_add(bytes).filter(|total| *total <= self.max);
        match self.used.fetch_update(Ordering::AcqRel, Ordering::Acquire, fits) {
            Ok(_) => Ok(RingLease { budget: self.clone(), bytes }),
            Err(used) => Err(format!(
                "a write ring of {bytes} bytes: the rings pin {used} of at most {} bytes (--ring-bytes)",
                self.max
            )),
        }
    }
}

impl Drop for RingLease {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// The bytes of a receive that completed with `n`: the device may report more than the buffer
/// holds (on iWARP a message may run into the receive's slack), which is a message too long.
pub(crate) fn received(data: &[u8], n: u32) -> Result<&[u8], String> {
    data.get(..n as usize)
        .ok_or_else(|| format!("a message of {n} bytes from the server, into a buffer of {}", data.len()))
}

/// The slots of `size` bytes in a server's ring of `len` bytes, which must hold one for each
/// message the server's credit (`depth`, at least 1) lets the client have in flight.
pub(crate) fn ring_slots(len: u32, depth: u64, size: usize) -> Result<u64, String> {
    let slots = u64::from(len) / size.max(1) as u64;
    if slots == 0 || slots < depth {
        return Err(format!(
            "a ring of {len} bytes holds {slots} messages of {size} bytes, fewer than its credit {depth}"
        ));
    }
    Ok(slots)
}

/// A server's `RESUME` at `next`, to a client that has sent `high` of its `count` messages:
/// `None` when the server has them all, else where to resume. A server cannot have a message
/// the client has not sent.
pub(crate) fn resume_point(next: u64, high: u64, count: u64) -> Result<Option<u64>, String> {
    if next > high {
        return Err(format!("the server says resume at message {next}, and {high} have been sent"));
    }
    Ok((next < count).then_some(next))
}

/// `N` random bytes from the kernel (`/dev/urandom`); exits if there are none.
pub(crate) fn random_bytes<const N: usize>() -> [u8; N] {
    use std::io::Read;
    let mut b = [0u8; N];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .unwrap_or_else(|e| common::die("blast", &format!("no random bytes for the client's id and key: {e}")));
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic stream of numbers (xorshift): the tests' schedules.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
    }

    const KEY: [u8; KEY_LEN] = [7; KEY_LEN];

    /// The review's H1: one message numbered u64::MAX (or 2^40) made `record` index past its
    /// vector (a panic out of `run`) or allocate a terabyte (an abort). Every number at or past
    /// the count is refused, and the count is at most u32::MAX.
    #[test]
    fn a_number_at_or_past_the_count_is_refused_not_a_panic() {
        let mut cov = Coverage::new(KEY, u64::from(u32::MAX));
        for seq in [u64::MAX, u64::MAX - 1, 1 << 40, 1 << 32, u64::from(u32::MAX)] {
            assert!(cov.record(seq).is_err(), "{seq}");
        }
        let mut small = Coverage::new(KEY, 10);
        assert_eq!(small.record(10), Err("message number 10 of 10".to_string()));
        assert_eq!(small.record(9), Ok(Seen::New));
        assert!(cov.ahead.is_empty() && small.ahead.len() == 1, "nothing was allocated for the refused numbers");
    }

    /// A number far inside a huge count but far ahead of the floor costs nothing: not recorded,
    /// the client is sent back to the floor.
    #[test]
    fn a_number_far_ahead_is_not_recorded_and_memory_stays_bounded() {
        let mut cov = Coverage::new(KEY, u64::from(u32::MAX));
        assert_eq!(cov.record(u64::from(u32::MAX) - 1), Ok(Seen::Beyond));
        assert_eq!(cov.record(AHEAD_MAX), Ok(Seen::Beyond));
        assert!(cov.ahead.is_empty());
        assert_eq!(cov.record(AHEAD_MAX - 1), Ok(Seen::New), "the last one inside the window");
        assert!(cov.ahead.len() as u64 <= AHEAD_MAX / 64 + 1, "{} words", cov.ahead.len());
        assert_eq!(cov.floor, 0);
        assert_eq!(cov.record(AHEAD_MAX), Ok(Seen::Beyond), "still too far from the floor");
        for seq in 0..AHEAD_MAX - 1 {
            assert_eq!(cov.record(seq), Ok(Seen::New));
        }
        assert_eq!(cov.floor, AHEAD_MAX, "the floor went up over the one recorded ahead");
        assert!(cov.ahead.len() <= 1);
        assert_eq!(cov.record(AHEAD_MAX), Ok(Seen::New), "inside the window now");
        assert_eq!((cov.floor, cov.duplicates), (AHEAD_MAX + 1, 0));
    }

    /// In order, as a client sends: the floor follows, one word of bits at most.
    #[test]
    fn messages_in_order_raise_the_floor_in_one_word() {
        let mut cov = Coverage::new(KEY, 1000);
        for seq in 0..1000 {
            assert_eq!(cov.record(seq), Ok(Seen::New));
            assert_eq!(cov.floor, seq + 1);
            assert!(cov.ahead.len() <= 1);
        }
        assert_eq!(cov.record(0), Ok(Seen::Again));
        assert_eq!(cov.record(999), Ok(Seen::Again));
        assert_eq!(cov.duplicates, 2);
    }

    /// Resends and messages ahead in a random order, against a set of what arrived: the floor
    /// is the first number missing from it, duplicates are counted, numbers beyond the window
    /// are left out, and the bits never exceed the window.
    #[test]
    fn coverage_agrees_with_a_set_of_what_arrived() {
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        for round in 0..20u64 {
            let expected = 1 + rng.below(300_000);
            let mut cov = Coverage::new(KEY, expected);
            let mut set = std::collections::BTreeSet::new();
            let (mut floor, mut duplicates) = (0, 0);
            for _ in 0..3_000 {
                // Mostly near the floor (a client's window, a resend), sometimes anywhere.
                let seq = match rng.below(4) {
                    0 => rng.below(expected),
                    _ => (cov.floor + rng.below(300)).saturating_sub(100).min(expected - 1),
                };
                let want = if seq >= cov.floor + AHEAD_MAX {
                    Seen::Beyond
                } else if set.insert(seq) {
                    Seen::New
                } else {
                    duplicates += 1;
                    Seen::Again
                };
                assert_eq!(cov.record(seq), Ok(want), "round {round}, message {seq}");
                while set.contains(&floor) {
                    floor += 1;
                }
                assert_eq!(cov.floor, floor, "round {round}");
                assert_eq!(cov.duplicates, duplicates);
                assert!(cov.ahead.len() as u64 <= AHEAD_MAX / 64 + 1);
                assert_eq!(cov.base, cov.floor / 64 * 64);
            }
        }
    }

    /// The protocol, both ends modelled on one connection (RC keeps each direction in order):
    /// a client that reconnects with messages carried over from far past the server's floor
    /// (many that had completed at it were lost, as on iWARP) finishes its count, told so once,
    /// and never more than one RESUME is in flight.
    #[test]
    fn a_client_sent_back_from_far_ahead_finishes_its_count() {
        let (count, window, floor, carried) = (4 * AHEAD_MAX, 128, 1_000, 3 * AHEAD_MAX);
        let mut cov = Coverage::new(KEY, count);
        for seq in 0..floor {
            cov.record(seq).expect("the first connection's");
        }
        // The second connection: the carried-over messages are on the wire before the
        // client has heard where to resume.
        let mut to_server: VecDeque<u64> = (carried..carried + window).collect();
        let (mut submitted, mut high, mut resumed, mut done) = (carried + window, carried + window, false, false);
        let mut to_client = VecDeque::new();
        let mut announcer = Announcer::default();
        to_client.extend(announcer.want(cov.floor));
        let mut steps = 0;
        while !done {
            steps += 1;
            assert!(steps < 10 * count, "no progress: floor {}, submitted {submitted}", cov.floor);
            if resumed && submitted < count && (to_server.len() as u64) < window {
                to_server.push_back(submitted);
                submitted += 1;
                high = high.max(submitted);
            }
            if let Some(seq) = to_server.pop_front() {
                let before = cov.floor;
                let seen = cov.record(seq).expect("an honest number");
                if seen == Seen::Beyond || (before < count && cov.floor >= count) {
                    to_client.extend(announcer.want(cov.floor));
                }
            }
            assert!(to_client.len() <= 1, "one RESUME in flight");
            if steps % 3 == 0 {
                if let Some(next) = to_client.pop_front() {
                    match resume_point(next, high, count).expect("true") {
                        None => done = true,
                        Some(next) => (submitted, resumed) = (next, true),
                    }
                    to_client.extend(announcer.sent());
                }
            }
        }
        assert_eq!(cov.floor, count);
        assert!(cov.ahead.len() <= 1);
    }

    #[test]
    fn a_numbered_client_states_its_count_and_sends_numbers() {
        assert!(numbered_terms(8, 0, false).unwrap_err().contains("no count"), "msg_count 0: every number accepted");
        assert!(numbered_terms(7, 10, false).is_err());
        assert!(numbered_terms(64, 10, true).is_err());
        assert_eq!(numbered_terms(8, u32::MAX, false), Ok(()));
    }

    #[test]
    fn connect_information_round_trips_and_a_numbered_one_needs_a_key() {
        for hello in [
            Hello { write: false, id: 1, key: None },
            Hello { write: true, id: u64::MAX, key: None },
            Hello { write: false, id: 42, key: Some(KEY) },
        ] {
            let user = hello.encode();
            assert!(user.len() <= 36, "fits the connect information's user bytes");
            assert_eq!(Hello::parse(&user), Ok(hello));
        }
        let mut old = Hello { write: false, id: 42, key: Some(KEY) }.encode();
        old.truncate(13);
        assert!(Hello::parse(&old).unwrap_err().contains("no key"));
        assert!(Hello::parse(b"BLST\0\0\0").is_err());
        assert!(Hello::parse(b"XLST\0\0\0\0\0\0\0\0\0").is_err());
    }

    /// The review's X2: a connection that names another client's id cannot read where it
    /// resumes or mark its messages as arrived.
    #[test]
    fn an_id_with_another_key_or_count_is_refused_and_touches_nothing() {
        let mut table = Resumable::new(4);
        let victim = table.claim(9, &KEY, 100).expect("first claim");
        for seq in 0..40 {
            victim.borrow_mut().record(seq).expect("in the count");
        }
        drop(victim);
        let mut other = KEY;
        other[KEY_LEN - 1] ^= 1;
        assert!(matches!(table.claim(9, &other, 100), Err(Unclaimed::NotYours(_))));
        assert!(matches!(table.claim(9, &KEY, 200), Err(Unclaimed::NotYours(_))));
        let again = table.claim(9, &KEY, 100).expect("the client itself");
        assert_eq!(again.borrow().floor, 40, "kept for its own key, untouched by the refused claims");
        assert!(same_key(&KEY, &KEY) && !same_key(&KEY, &other));
    }

    /// At most `max` entries: an idle one (no connection holds it), claimed longest ago, makes
    /// room; with every one held the new client is refused, for now.
    #[test]
    fn the_table_is_bounded_and_evicts_only_idle_clients() {
        let mut table = Resumable::new(3);
        let held: Vec<_> = (0..3).map(|id| table.claim(id, &KEY, 10).expect("room")).collect();
        assert!(matches!(table.claim(3, &KEY, 10), Err(Unclaimed::Full(_))));
        drop(held);
        // 1 is claimed again (now the most recent); 0 is the idle one unused longest.
        let one = table.claim(1, &KEY, 10).expect("kept");
        let three = table.claim(3, &KEY, 10).expect("room made");
        assert_eq!(table.clients.len(), 3);
        assert!(!table.clients.contains_key(&0) && table.clients.contains_key(&2));
        let four = table.claim(4, &KEY, 10).expect("2 was idle");
        assert!(!table.clients.contains_key(&2));
        assert!(matches!(table.claim(5, &KEY, 10), Err(Unclaimed::Full(_))), "1, 3, 4 are held");
        drop((one, three, four));
        for id in 100..200 {
            table.claim(id, &KEY, 10).expect("idle ones go");
            assert!(table.clients.len() <= 3);
        }
    }

    /// Numbers that keep asking for a RESUME while one is in flight leave one waiting, the
    /// latest; a value already announced is not sent again.
    #[test]
    fn one_resume_in_flight_and_the_latest_waiting() {
        let mut a = Announcer::default();
        assert_eq!(a.want(0), Some(0));
        assert_eq!(a.want(0), None);
        for next in 1..10_000 {
            assert_eq!(a.want(next), None, "one in flight");
        }
        assert_eq!(a.sent(), Some(9_999), "the latest waited");
        assert_eq!(a.want(9_999), None, "already on its way");
        assert_eq!(a.sent(), None);
        assert_eq!(a.want(10_000), Some(10_000), "nothing in flight: sent at once");
    }

    /// The review's X4: rings outside the pool had no cap.
    #[test]
    fn rings_are_counted_against_the_cap_and_given_back() {
        let budget = Arc::new(RingBudget::new(64 << 20));
        let a = budget.lease(40 << 20).expect("fits");
        assert!(budget.lease(30 << 20).err().expect("beyond the cap").contains("--ring-bytes"));
        let b = budget.lease(24 << 20).expect("exactly the cap");
        assert!(budget.lease(1).is_err());
        assert!(budget.lease(u64::MAX).is_err(), "no overflow");
        drop(a);
        let c = budget.lease(40 << 20).expect("given back");
        drop((b, c));
        assert_eq!(budget.used.load(Ordering::Relaxed), 0);
    }

    /// The review's L1/X5: `&buf.as_slice()[..n]` with a completion longer than the buffer
    /// panicked the client.
    #[test]
    fn a_message_longer_than_its_buffer_is_an_error() {
        let data = [1u8; 64];
        assert_eq!(received(&data, 16), Ok(&data[..16]));
        assert_eq!(received(&data, 64).map(<[u8]>::len), Ok(64));
        assert!(received(&data, 65).is_err());
        assert!(received(&data, u32::MAX).is_err());
    }

    /// The review's X5: a server stating receive depth 0 and a ring shorter than a message made
    /// the client's slot `seq % 0`.
    #[test]
    fn a_ring_without_a_slot_per_credit_is_refused() {
        assert!(ring_slots(100, 0, 256).is_err(), "no slot at all");
        assert!(ring_slots(4 * 256, 5, 256).is_err(), "fewer slots than credits");
        assert_eq!(ring_slots(4 * 256 + 10, 4, 256), Ok(4));
        assert_eq!(ring_slots(u32::MAX, 16, 1 << 20), Ok(4095));
    }

    /// The review's X2, at the client: a RESUME at or past its count made it report success
    /// without having sent them.
    #[test]
    fn a_resume_past_what_was_sent_is_refused() {
        assert!(resume_point(u64::MAX, 0, 100).is_err());
        assert!(resume_point(100, 50, 100).is_err(), "done, says the server, after 50 of 100");
        assert!(resume_point(51, 50, 100).is_err());
        assert_eq!(resume_point(50, 50, 100), Ok(Some(50)));
        assert_eq!(resume_point(0, 50, 100), Ok(Some(0)), "a restarted server has none");
        assert_eq!(resume_point(100, 100, 100), Ok(None), "all of them");
    }

    #[test]
    fn ids_and_keys_are_random() {
        let (a, b): ([u8; 8], [u8; 8]) = (random_bytes(), random_bytes());
        assert_ne!(a, b);
        assert_ne!(u64::from_le_bytes(a), u64::from(std::process::id()) << 20);
    }
}
