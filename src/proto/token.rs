//! Tokens: a `u64` that names a reactor object wherever the kernel hands a value back.
//!
//! Each object's own token goes where its events come back: a channel's into
//! `epoll_event.u64`, a listener's or connection's into `rdma_cm_id->context`, a CQ's into its
//! CQ context, an operation's into its work request's `wr_id` (a receive the runtime posted
//! to a shared receive queue: its slot's, of kind `SrqRecv`). A token packs a kind, a slab
//! index and a generation:
//!
//! ```text
//! 63      56 55                  32 31                               0
//! +---------+----------------------+---------------------------------+
//! |  kind   |  generation (24 bit) |          slab index             |
//! +---------+----------------------+---------------------------------+
//! ```
//!
//! Generation 0 is never issued, so the value 0 means "no token" (a null `context`). The
//! generation changes every time a slab slot is reused, so an event that names a freed slot is
//! recognised as stale and dropped instead of reaching the slot's new owner.

/// What kind of object a token names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub(crate) enum Kind {
    /// The shared rdma_cm event channel.
    CmChannel = 1,
    /// A device's completion channel.
    CompChannel = 2,
    /// A listener.
    Listener = 3,
    /// A connection (agent or client).
    Conn = 4,
    /// An outstanding work request.
    Op = 5,
    /// A user timer.
    Timer = 6,
    /// A completion queue.
    Cq = 7,
    /// A device's asynchronous-event fd.
    Device = 8,
    /// The eventfd of the reactor's cross-thread handle (`Remote`).
    Remote = 9,
    /// A file descriptor the application registered.
    UserFd = 10,
    /// A receive the runtime posted to a device's shared receive queue (its `wr_id`).
    SrqRecv = 11,
    /// A connect request's id in transit from the listening reactor to another one
    /// (`reactor/conn/handoff.rs`): its `context` until the receiving reactor adopts it.
    Handoff = 12,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::CmChannel,
            2 => Kind::CompChannel,
            3 => Kind::Listener,
            4 => Kind::Conn,
            5 => Kind::Op,
            6 => Kind::Timer,
            7 => Kind::Cq,
            8 => Kind::Device,
            9 => Kind::Remote,
            10 => Kind::UserFd,
            11 => Kind::SrqRecv,
            12 => Kind::Handoff,
            _ => return None,
        })
    }
}

/// Largest generation; generations wrap from here back to 1.
pub(crate) const MAX_GENERATION: u32 = (1 << 24) - 1;

/// The name of a listener, a connection or a timer, as callbacks and commands use it.
///
/// Inside it packs `{kind, generation, index}`; a token of a closed object stays stale forever
/// (its slot's generation moves on), so commands given one are ignored or refused, never
/// applied to another object.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Token(u64);

impl Token {
    /// Packs a token. `generation` must be in `1..=MAX_GENERATION`.
    pub(crate) fn new(kind: Kind, index: u32, generation: u32) -> Token {
        debug_assert!(generation != 0 && generation <= MAX_GENERATION);
        Token(((kind as u64) << 56) | (u64::from(generation & MAX_GENERATION) << 32) | u64::from(index))
    }

    /// Unpacks a raw value, or `None` if it is 0 or names no known kind.
    pub fn from_u64(raw: u64) -> Option<Token> {
        let t = Token(raw);
        if raw == 0 || t.generation() == 0 || Kind::from_u8((raw >> 56) as u8).is_none() {
            return None;
        }
        Some(t)
    }

    /// The raw value.
    pub fn as_u64(self) -> u64 {
        self.0
    }

    /// The object kind.
    pub(crate) fn kind(self) -> Kind {
        // from_u64 and new only produce known kinds.
        Kind::from_u8((self.0 >> 56) as u8).unwrap_or(Kind::Op)
    }

    /// The slab index.
    pub(crate) fn index(self) -> u32 {
        self.0 as u32
    }

    /// The generation.
    pub(crate) fn generation(self) -> u32 {
        ((self.0 >> 32) as u32) & MAX_GENERATION
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Token({:?}#{}g{})", self.kind(), self.index(), self.generation())
    }
}

/// The next generation after `g`, skipping 0.
pub(crate) fn next_generation(g: u32) -> u32 {
    if g >= MAX_GENERATION {
        1
    } else {
        g + 1
    }
}

/// Which of a queue pair's two rings a work request is on ([`WrId`]).
// Issue 47, phase 1: used by the reactor once it adopts the rings (phase 2).
#[allow(dead_code)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Dir {
    /// The send ring: sends, RDMA WRITEs and READs, credit-only messages, probes, binds.
    Send,
    /// The receive ring.
    Recv,
}

/// The `wr_id` of a work request posted from a connection's operation ring (issue 47,
/// `reactor/data/ring.rs`): which connection slot, which of its queue pairs, which ring and
/// which position of it.
///
/// ```text
/// 63  60 59             40 39            24 23 22                 0
/// +-----+-----------------+----------------+--+--------------------+
/// | 0xA | conn index (20) |   epoch (16)   |d |    sequence (23)   |
/// +-----+-----------------+----------------+--+--------------------+
/// ```
///
/// The top nibble tells it from a [`Token`] (whose top byte is a kind, at most 12, so its top
/// nibble is 0): a shared receive queue's `SrqRecv` token and a ring's id never collide. Every
/// value with that nibble decodes to some id, so decoding never fails on a hostile or stale
/// value and never panics; what makes an id *valid* is checked by its owners, never here: the
/// connection slot `index` exists and its queue pair's epoch is `epoch` (an epoch changes with
/// every queue pair a slot gets, a reconnection's included, so a completion of an old queue
/// pair never names the new one's operations), and `seq` lies in that ring's posted window
/// (`Ring::window`). The sequence is a ring position modulo 2^23; a ring holds at most 2^16
/// operations, so a window never wraps onto itself.
#[allow(dead_code)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct WrId {
    /// The connection's slab index.
    pub(crate) index: u32,
    /// The connection's queue-pair epoch.
    pub(crate) epoch: u16,
    /// The ring.
    pub(crate) dir: Dir,
    /// The ring position, modulo 2^23 ([`WrId::SEQ_MASK`]).
    pub(crate) seq: u32,
}

#[allow(dead_code)]
impl WrId {
    /// The top nibble of every ring `wr_id`.
    const TAG: u64 = 0xA;
    /// Largest connection index a `wr_id` carries.
    pub(crate) const MAX_INDEX: u32 = (1 << 20) - 1;
    /// The sequence bits.
    pub(crate) const SEQ_MASK: u32 = (1 << 23) - 1;

    /// The `wr_id` of sequence 0 of ring `dir` of connection slot `index` in queue-pair epoch
    /// `epoch`: ring position `seq`'s is this ORed with `seq & SEQ_MASK` ([`WrId::at`]). `None`
    /// for an index beyond [`WrId::MAX_INDEX`] (a reactor admits no more connections).
    pub(crate) fn base(index: u32, epoch: u16, dir: Dir) -> Option<u64> {
        (index <= Self::MAX_INDEX).then(|| {
            (Self::TAG << 60)
                | (u64::from(index) << 40)
                | (u64::from(epoch) << 24)
                | if dir == Dir::Recv { 1 << 23 } else { 0 }
        })
    }

    /// The `wr_id` of position `seq` of the ring whose [`WrId::base`] is `base`.
    #[inline(always)]
    pub(crate) fn at(base: u64, seq: u32) -> u64 {
        base | u64::from(seq & Self::SEQ_MASK)
    }

    /// True when `raw` is a ring's `wr_id` (whether or not it is still valid).
    #[inline(always)]
    pub(crate) fn is_ring(raw: u64) -> bool {
        raw >> 60 == Self::TAG
    }

    /// The queue-pair epoch a ring `wr_id` (or a ring's base) carries.
    #[inline(always)]
    pub(crate) const fn epoch_of(raw: u64) -> u16 {
        (raw >> 24) as u16
    }

    /// Unpacks a ring's `wr_id`; `None` for any other value (a token, 0). Total: never panics.
    #[inline(always)]
    pub(crate) fn decode(raw: u64) -> Option<WrId> {
        Self::is_ring(raw).then_some(WrId {
            index: ((raw >> 40) as u32) & Self::MAX_INDEX,
            epoch: (raw >> 24) as u16,
            dir: if raw & (1 << 23) != 0 { Dir::Recv } else { Dir::Send },
            seq: raw as u32 & Self::SEQ_MASK,
        })
    }
}

/// A key into one [`GenSlab`]: a token of one kind, typed by what it indexes, so a connection
/// key cannot be used as an operation key.
pub(crate) trait Key: Copy + Eq + std::fmt::Debug {
    /// The kind of token this key wraps.
    const KIND: Kind;
    /// Wraps a token already known to be of [`Key::KIND`].
    fn wrap(token: Token) -> Self;
    /// The token.
    fn token(self) -> Token;
    /// Wraps `token` if it is of this key's kind.
    fn of(token: Token) -> Option<Self> {
        (token.kind() == Self::KIND).then(|| Self::wrap(token))
    }
}

macro_rules! keys {
    ($($(#[$doc:meta])* $name:ident => $kind:ident;)*) => {$(
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub(crate) struct $name(Token);

        impl Key for $name {
            const KIND: Kind = Kind::$kind;
            fn wrap(token: Token) -> Self {
                debug_assert_eq!(token.kind(), Kind::$kind);
                $name(token)
            }
            fn token(self) -> Token {
                self.0
            }
        }
    )*};
}

keys! {
    /// A connection (agent or client).
    ConnKey => Conn;
    /// A listener.
    ListenerKey => Listener;
    /// A submitted operation of the operation slab (the host benchmark's `SlabPath`: the data
    /// path before issue 47, whose `wr_id` it was), and the token tests.
    #[cfg_attr(not(any(test, feature = "bench-internals")), allow(dead_code))]
    OpKey => Op;
    /// A completion queue (its CQ context).
    CqKey => Cq;
    /// A user timer.
    TimerKey => Timer;
    /// A file descriptor the application registered.
    FdKey => UserFd;
    /// A receive posted to a shared receive queue (its `wr_id`): a slot of the SRQ's table.
    SrqKey => SrqRecv;
}

/// A slab whose entries carry a generation, so keys of freed slots are detected.
///
/// Its own arena rather than `slab::Slab` with the generations beside it (issue 33): the
/// generation lives in the slot, and a value is built into its slot once, where the pair of
/// slab and generation table looked each index up twice and moved the value twice (every
/// operation is inserted, found and removed once per message). Free slots form a list,
/// last freed first reused, as in `slab`.
#[derive(Debug)]
pub(crate) struct GenSlab<K: Key, T> {
    slots: Vec<Slot<T>>,
    /// The first free slot (each free slot names the next), [`NO_SLOT`] when none is.
    free: u32,
    /// Live entries.
    len: usize,
    _key: std::marker::PhantomData<K>,
}

/// The end of a [`GenSlab`]'s free list.
const NO_SLOT: u32 = u32::MAX;

#[derive(Debug)]
struct Slot<T> {
    /// The generation last used at this index (kept while free, so reuse moves it on).
    generation: u32,
    entry: Entry<T>,
}

#[derive(Debug)]
enum Entry<T> {
    Full(T),
    /// Free; the next free slot, or [`NO_SLOT`].
    Free(u32),
}

impl<K: Key, T> Default for GenSlab<K, T> {
    fn default() -> Self {
        GenSlab { slots: Vec::new(), free: NO_SLOT, len: 0, _key: std::marker::PhantomData }
    }
}

impl<K: Key, T> GenSlab<K, T> {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Inserts a value built from its own key.
    #[inline]
    pub(crate) fn insert_with(&mut self, f: impl FnOnce(K) -> T) -> K {
        let index = self.free;
        if let Some(slot) = self.slots.get_mut(index as usize) {
            if let Entry::Free(next) = slot.entry {
                // The generation moves on before `f` runs: should it panic, the key it saw is
                // never live (the slot stays free, first on the list).
                slot.generation = next_generation(slot.generation);
                let key = K::wrap(Token::new(K::KIND, index, slot.generation));
                slot.entry = Entry::Full(f(key));
                self.free = next;
                self.len += 1;
                return key;
            }
            // A full slot on the free list would be a bug of this type: leave the list, never
            // overwrite a live entry.
            debug_assert!(false, "GenSlab: slot {index} is on the free list and full");
            self.free = NO_SLOT;
        }
        let index = self.slots.len() as u32;
        let key = K::wrap(Token::new(K::KIND, index, 1));
        self.slots.push(Slot { generation: 1, entry: Entry::Full(f(key)) });
        self.len += 1;
        key
    }

    #[inline]
    pub(crate) fn insert(&mut self, value: T) -> K {
        self.insert_with(|_| value)
    }

    // `get` and `get_mut` look the slot up once: every operation, completion and callback goes
    // through them a few times (issue 33).
    #[inline]
    pub(crate) fn get(&self, key: K) -> Option<&T> {
        let token = key.token();
        match self.slots.get(token.index() as usize) {
            Some(Slot { generation, entry: Entry::Full(v) }) if *generation == token.generation() => Some(v),
            _ => None,
        }
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, key: K) -> Option<&mut T> {
        let token = key.token();
        match self.slots.get_mut(token.index() as usize) {
            Some(Slot { generation, entry: Entry::Full(v) }) if *generation == token.generation() => Some(v),
            _ => None,
        }
    }

    #[inline]
    pub(crate) fn remove(&mut self, key: K) -> Option<T> {
        let token = key.token();
        let index = token.index();
        let slot = self.slots.get_mut(index as usize)?;
        if slot.generation != token.generation() || matches!(slot.entry, Entry::Free(_)) {
            return None;
        }
        let Entry::Full(v) = std::mem::replace(&mut slot.entry, Entry::Free(self.free)) else { return None };
        self.free = index;
        self.len -= 1;
        Some(v)
    }

    pub(crate) fn contains(&self, key: K) -> bool {
        self.get(key).is_some()
    }

    /// The live entry at slab index `index` and its key, whatever its generation: for an id
    /// that carries the index and an epoch of its own instead of the generation (a ring's
    /// `wr_id`, [`WrId`]), whose owner checks that epoch on the entry.
    #[inline]
    #[allow(dead_code)]
    pub(crate) fn get_index_mut(&mut self, index: u32) -> Option<(K, &mut T)> {
        match self.slots.get_mut(index as usize) {
            Some(Slot { generation, entry: Entry::Full(v) }) => {
                Some((K::wrap(Token::new(K::KIND, index, *generation)), v))
            }
            _ => None,
        }
    }

    /// The key of a live entry named by a raw token, if it is one.
    pub(crate) fn key_of(&self, token: Token) -> Option<K> {
        K::of(token).filter(|k| self.contains(*k))
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Removes every entry for which `keep` returns false.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) {
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if matches!(&slot.entry, Entry::Full(v) if !keep(v)) {
                let gone = std::mem::replace(&mut slot.entry, Entry::Free(self.free));
                self.free = i as u32;
                self.len -= 1;
                // Dropped with the slab consistent: a `Drop` that panics leaves no slot lost.
                drop(gone);
            }
        }
    }

    /// Every live entry with its key.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (K, &T)> {
        self.slots.iter().enumerate().filter_map(|(i, s)| match &s.entry {
            Entry::Full(v) => Some((K::wrap(Token::new(K::KIND, i as u32, s.generation)), v)),
            Entry::Free(_) => None,
        })
    }

    pub(crate) fn keys(&self) -> Vec<K> {
        self.iter().map(|(k, _)| k).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_unpack_round_trips() {
        for kind in [
            Kind::CmChannel,
            Kind::CompChannel,
            Kind::Listener,
            Kind::Conn,
            Kind::Op,
            Kind::Timer,
            Kind::Cq,
            Kind::Device,
            Kind::Remote,
            Kind::UserFd,
            Kind::SrqRecv,
            Kind::Handoff,
        ] {
            for (index, generation) in [(0, 1), (7, 2), (u32::MAX, MAX_GENERATION), (12345, 999)] {
                let t = Token::new(kind, index, generation);
                let back = Token::from_u64(t.as_u64()).expect("valid token");
                assert_eq!(back.kind(), kind);
                assert_eq!(back.index(), index);
                assert_eq!(back.generation(), generation);
                assert_eq!(back, t);
            }
        }
    }

    #[test]
    fn zero_and_garbage_are_not_tokens() {
        assert!(Token::from_u64(0).is_none());
        // Unknown kind.
        assert!(Token::from_u64(0xff00_0001_0000_0000).is_none());
        // Known kind but generation 0.
        assert!(Token::from_u64((Kind::Conn as u64) << 56 | 5).is_none());
    }

    #[test]
    fn generation_wraps_and_skips_zero() {
        assert_eq!(next_generation(0), 1);
        assert_eq!(next_generation(1), 2);
        assert_eq!(next_generation(MAX_GENERATION), 1);
    }

    #[test]
    fn stale_token_never_reaches_reused_slot() {
        let mut s: GenSlab<ConnKey, _> = GenSlab::new();
        let a = s.insert("a");
        assert_eq!(s.get(a), Some(&"a"));
        assert_eq!(s.remove(a), Some("a"));
        let b = s.insert("b");
        assert_eq!(a.token().index(), b.token().index(), "slot is reused");
        assert_ne!(a, b);
        assert_eq!(s.get(a), None, "old token is stale");
        assert_eq!(s.get(b), Some(&"b"));
        assert_eq!(s.remove(a), None);
        assert!(s.contains(b));
    }

    #[test]
    fn wrong_kind_is_rejected() {
        let mut s: GenSlab<ConnKey, _> = GenSlab::new();
        let a = s.insert(1);
        let forged = Token::new(Kind::Listener, a.token().index(), a.token().generation());
        assert_eq!(s.key_of(forged), None, "a listener token is no connection key");
        assert_eq!(s.key_of(a.token()), Some(a));
        assert_eq!(OpKey::of(a.token()), None);
    }

    #[test]
    fn retain_removes_and_stales_tokens() {
        let mut s: GenSlab<TimerKey, _> = GenSlab::new();
        let a = s.insert(1);
        let b = s.insert(2);
        s.retain(|v| *v != 1);
        assert_eq!(s.get(a), None);
        assert_eq!(s.get(b), Some(&2));
        let c = s.insert(3);
        assert_eq!(c.token().index(), a.token().index());
        assert_eq!(s.get(a), None, "the reused slot has a new generation");
    }

    #[test]
    fn insert_with_sees_own_token() {
        let mut s: GenSlab<TimerKey, _> = GenSlab::new();
        let t = s.insert_with(|t| t);
        assert_eq!(s.get(t), Some(&t));
        assert_eq!(s.keys(), vec![t]);
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn freed_slots_are_reused_last_freed_first_and_stale_keys_miss() {
        let mut s: GenSlab<OpKey, u32> = GenSlab::new();
        let k: Vec<OpKey> = (0..4).map(|i| s.insert(i)).collect();
        assert_eq!(k.iter().map(|k| k.token().index()).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
        assert_eq!(s.remove(k[1]), Some(1));
        assert_eq!(s.remove(k[1]), None, "removed twice");
        assert_eq!(s.remove(k[3]), Some(3));
        assert_eq!(s.len(), 2);
        assert_eq!(s.get(k[3]), None);
        let a = s.insert(30);
        let b = s.insert(10);
        let c = s.insert(40);
        assert_eq!((a.token().index(), b.token().index(), c.token().index()), (3, 1, 4));
        assert_eq!((a.token().generation(), c.token().generation()), (2, 1));
        assert_eq!(s.get(k[3]), None, "a stale key misses");
        assert_eq!(s.get_mut(k[1]), None, "a stale key misses");
        assert_eq!(s.remove(k[3]), None, "a stale key misses");
        assert_eq!((s.get(a), s.get(b), s.get(c)), (Some(&30), Some(&10), Some(&40)));
        s.retain(|v| *v != 10 && *v != 0);
        assert_eq!(s.len(), 3);
        assert_eq!(s.iter().map(|(_, v)| *v).collect::<Vec<_>>(), vec![2, 30, 40]);
        // retain freed 0 then 1: 1 is reused first.
        assert_eq!(s.insert(7).token().index(), 1);
        assert_eq!(s.insert(8).token().index(), 0);
        assert_eq!(s.len(), 5);
    }

    /// Issue 47: a ring's `wr_id` round-trips, is never read as a token (nor a token as one),
    /// and every value with its tag decodes without a panic.
    #[test]
    fn a_ring_wr_id_round_trips_and_never_passes_for_a_token() {
        for (index, epoch, dir, seq) in
            [(0, 0, Dir::Send, 0), (1, 1, Dir::Recv, 1), (WrId::MAX_INDEX, u16::MAX, Dir::Recv, WrId::SEQ_MASK)]
        {
            let raw = WrId::at(WrId::base(index, epoch, dir).expect("an index in range"), seq);
            assert_eq!(WrId::decode(raw), Some(WrId { index, epoch, dir, seq }));
            assert!(Token::from_u64(raw).is_none(), "a ring wr_id {raw:#x} is no token");
        }
        assert_eq!(WrId::base(WrId::MAX_INDEX + 1, 0, Dir::Send), None, "beyond 20 bits: refused, not truncated");
        // The sequence is taken modulo 2^23: a counter past it wraps into the same bits.
        let base = WrId::base(3, 9, Dir::Send).unwrap();
        assert_eq!(WrId::at(base, WrId::SEQ_MASK + 5), WrId::at(base, 4));
        // Tokens (top byte a kind) are never ring ids, and neither is 0.
        let token = Token::new(Kind::SrqRecv, WrId::MAX_INDEX, MAX_GENERATION).as_u64();
        assert_eq!(WrId::decode(token), None);
        assert_eq!(WrId::decode(0), None);
        // Hostile values with the tag decode to something, whatever the other bits.
        for raw in [0xA000_0000_0000_0000u64, u64::MAX >> 4 | 0xA << 60, 0xAFFF_FFFF_FFFF_FFFF] {
            let id = WrId::decode(raw).expect("tagged");
            assert!(id.index <= WrId::MAX_INDEX && id.seq <= WrId::SEQ_MASK);
        }
        assert_eq!(WrId::decode(u64::MAX), None, "top nibble 0xF is not the tag");
    }

    #[test]
    fn an_entry_is_found_by_its_index_whatever_its_generation() {
        let mut s: GenSlab<ConnKey, u32> = GenSlab::new();
        let a = s.insert(1);
        assert_eq!(s.get_index_mut(a.token().index()).map(|(k, v)| (k, *v)), Some((a, 1)));
        s.remove(a);
        assert!(s.get_index_mut(a.token().index()).is_none(), "a free slot");
        let b = s.insert(2);
        assert_eq!(s.get_index_mut(a.token().index()).map(|(k, _)| k), Some(b), "the slot's current key");
        assert!(s.get_index_mut(u32::MAX).is_none());
    }

    #[test]
    fn a_slots_generation_wraps_past_the_largest_and_skips_zero() {
        let mut s: GenSlab<OpKey, u32> = GenSlab::new();
        let k = s.insert(0);
        assert_eq!(s.remove(k), Some(0));
        s.slots[0].generation = MAX_GENERATION - 1;
        let a = s.insert(1);
        assert_eq!(a.token().generation(), MAX_GENERATION);
        assert_eq!(s.remove(a), Some(1));
        let b = s.insert(2);
        assert_eq!(b.token().generation(), 1, "wraps to 1, never 0");
        assert_eq!(s.get(a), None);
        assert_eq!(s.get(b), Some(&2));
    }
}
