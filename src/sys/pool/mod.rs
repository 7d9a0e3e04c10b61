//! The registered buffer pool: large registered clusters carved into fixed-size chunks.
//!
//! After Ceph's RDMA stack (seed 000): a `Cluster` is one allocation registered as one memory
//! region and cut into equal chunks; free chunks sit on a free list. The pool has a few size
//! classes (4 KiB, 64 KiB and 1 MiB chunks by default) so a 16-byte ping does not pin a
//! megabyte. Each class grows by whole clusters while the pool's total stays under
//! `max_bytes`, and [`Pool::trim`] gives back clusters that are entirely free (except the very
//! first), so a quiet server returns to its baseline of memory regions.
//!
//! A [`Buf`] owns one chunk. It is the safe way to hand memory to the device: while a work
//! request uses it, the reactor holds the `Buf`, so user code cannot touch the bytes; it comes
//! back in the completion. A `Buf` keeps its cluster (memory and registration) alive, so a
//! chunk is never deregistered under a posted request.
//!
//! **No safe call shows a connection another connection's bytes.** Chunks are recycled
//! without being cleared up front (no memset on the send and receive path), so a chunk may
//! still hold an earlier owner's bytes. An owner is a connection (its token): the one that
//! allocated the buffer, or the one it was last submitted on; the runtime's own buffers (the
//! shared receive queue's) have none until a message lands in them for a connection. Each
//! chunk carries, in its cluster, how far its owners may have dirtied it and whose bytes those
//! are (one owner, or mixed). Bytes a connection left are not foreign to it: a chunk that
//! comes back to the connection whose bytes it holds needs no zeroing (a sender that reuses
//! its own chunks pays nothing). Foreign bytes are zeroed lazily, only where they would be
//! seen, with three watermarks per buffer ([`Marks`], pure and unit-tested): `fresh`, the
//! prefix holding only this owner's bytes or zeros (written through [`Buf::fill_from`], by the
//! device for this owner's receive or READ, or zeroed); `stale`, the prefix that may hold
//! another owner's bytes (beyond it, the chunk holds this owner's bytes or zeros); and `dirty`,
//! how far the chunk may be non-zero when this owner lets go. Whatever shows the first `len`
//! bytes (the views [`Buf::as_slice`] and [`Buf::as_mut_slice`], a send or RDMA WRITE taking
//! them, an exposure) first zeroes `fresh..min(len, stale)`; a buffer submitted on another
//! connection than its owner takes everything but the bytes it sends or exposes as foreign to
//! the new one (bytes the last owner wrote or received included). A chunk never dirtied
//! costs nothing, and the common paths (fill then send; receive then read) find nothing to
//! zero. [`Buf::set_len_unchecked`] is the `unsafe` escape hatch for callers who
//! fill a buffer's spare capacity themselves ([`Buf::spare_capacity_mut`]).
//!
//! Clusters are registered with local write only: no remote rights, no windows. Peers reach
//! memory only through an [`Exposed`] window: a memory region over exactly the bytes exposed
//! (local write and `IBV_ACCESS_MW_BIND`, no remote rights of its own), and a type-2 memory
//! window over all of it, bound to one connection's queue pair (`mw.rs`). The region is
//! exactly the window because rxe checks a remote access through a window against the range
//! of the window's region, not of the window (Linux 6.1 `check_rkey`): a window over a whole
//! cluster would let its peer read every chunk of it.
#![allow(unsafe_code)]

use std::alloc::{self, Layout};
use std::cell::{Cell, RefCell};
use std::fmt;
use std::ptr::NonNull;
use std::rc::Rc;

mod expose;
pub(crate) mod index;
mod ledger;

pub use expose::{Exposed, RegionWindow};
pub(crate) use expose::{Exposure, Window, Windows};
pub use ledger::{Account, Budget, Ledger, Refusal};

use super::mr::{Access, Mr};
use super::pd::Pd;
use crate::error::{Error, Result};

/// Pool sizing. The default: size classes of 4 KiB, 64 KiB and 1 MiB chunks (the largest pool
/// message is 1 MiB; larger data goes in an application [`Region`](crate::Region)), clusters of 4 MiB
/// registered at a time, at most 1 GiB registered in all.
///
/// # Who may hold what: the memory guarantee
///
/// A device's pool is shared by every connection of the reactor on the device, and what a
/// peer can make its connection hold (receives, replies queued behind its credit, messages
/// its task does not read) is bounded per connection **and in total** (issue 45):
///
/// - **Every admitted connection has its reservation**: the chunk bytes of its first
///   receives (`min(3, Config::recv_depth)` of its receive size; none on a shared receive
///   queue) and of one send of its message size. No other connection's use can make an
///   allocation within it fail. Reservations together are at most
///   [`reserved_bytes`](PoolConfig::reserved_bytes) (half of `max_bytes` by default); those of
///   the connections accepted from one peer address (an IPv4 address, an IPv6 address's
///   /64) at most [`per_address_bytes`](PoolConfig::per_address_bytes) (a quarter of that);
///   and the last quarter of `reserved_bytes` is kept for addresses below their floor (a
///   sixteenth of `per_address_bytes`, 8 MiB at the defaults), so that a few addresses
///   cannot take every reservation: a new address is admitted while that part has room. A
///   connect request whose reservation does not fit is refused
///   ([`RejectCode::NoResources`](crate::RejectCode::NoResources), the reason naming the
///   setting), and a client whose reservation does not fit closes before it connects
///   ([`CloseReason::Setup`](crate::CloseReason::Setup) with the text of an [`Error::Limit`]).
/// - **Beyond its reservation a connection borrows** from the shared remainder
///   ([`shared_bytes`](PoolConfig::shared_bytes), a quarter of `max_bytes` by default), at
///   most [`per_connection_bytes`](PoolConfig::per_connection_bytes) of it (a quarter of the
///   shared remainder by default). An allocation that would borrow more fails with
///   [`Error::OverBudget`], and what waits for memory waits: the async face and `echo` post
///   receives beyond the flow-control minimum only as traffic shows they are wanted (an
///   idle connection borrows none) and post one that cannot be had later (its credit with
///   it), `io::Stream`'s writes wait for their sends' buffers, and a shared receive queue's
///   credit for a connection over its limit is withheld until it lets go of buffers.
/// - So a peer can make one connection hold at most its reservation plus
///   `per_connection_bytes` (64 MiB at the defaults, beside at most 4 MiB reserved; on a
///   shared receive queue up to its share of messages more, which land before the runtime
///   can withhold); all connections of one address together at most `per_address_bytes` in
///   reservations (128 MiB; at 64 KiB messages 512 connections, the rest refused) plus the
///   shared remainder (256 MiB); and all connections together at most `reserved_bytes +
///   shared_bytes` in buffers (768 MiB), while every other address's connections keep their
///   reservations. What is borrowed is lent first come, first served, and a receive posted
///   is not taken back: connections that were busy and then went idle keep what they
///   borrowed until their peers send again (they cannot take a reservation). The counts are
///   per reactor and device.
/// - The rest of `max_bytes` (a quarter) is room for the clusters' fragmentation: the pool
///   registers whole clusters, per size class, and a cluster with one buffer in use stays
///   registered. The guarantee is on the chunks handed out; should mixed sizes fragment the
///   classes beyond that quarter, an allocation can still find `max_bytes` reached
///   ([`Error::PoolExhausted`]). With explicit values the split holds when `reserved_bytes +
///   shared_bytes` (and the SRQ's receives) fit in `max_bytes` with room to spare; nothing
///   checks that.
///
/// A shared receive queue's own receives (`SrqConfig::receives × buf_size`) are the device's
/// reservation, set aside before the split.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Chunk sizes of the size classes, ascending. A buffer comes from the smallest class that
    /// fits the length asked for; the largest is the largest pool message.
    pub chunk_sizes: Vec<usize>,
    /// Bytes registered per cluster (a cluster holds at least one chunk).
    pub cluster_bytes: usize,
    /// Most bytes the pool may register in total, over all classes.
    pub max_bytes: usize,
    /// Most bytes reserved for connections at once (see the type's docs). `None` (the
    /// default): half of `max_bytes`.
    pub reserved_bytes: Option<usize>,
    /// Most bytes all connections together borrow beyond their reservations (see the type's
    /// docs). `None` (the default): a quarter of `max_bytes`.
    pub shared_bytes: Option<usize>,
    /// Most bytes one connection borrows beyond its reservation. `None` (the default): a
    /// quarter of the shared remainder.
    pub per_connection_bytes: Option<usize>,
    /// Most bytes the reservations of the connections accepted from one peer address hold
    /// together (see the type's docs). `None` (the default): a quarter of `reserved_bytes`.
    pub per_address_bytes: Option<usize>,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            chunk_sizes: vec![4096, 64 * 1024, 1024 * 1024],
            cluster_bytes: 4 * 1024 * 1024,
            max_bytes: 1024 * 1024 * 1024,
            reserved_bytes: None,
            shared_bytes: None,
            per_connection_bytes: None,
            per_address_bytes: None,
        }
    }
}

impl PoolConfig {
    /// The largest chunk: the largest message a pool buffer holds.
    pub fn max_chunk(&self) -> usize {
        self.chunk_sizes.iter().copied().max().unwrap_or(0)
    }

    /// The chunk a buffer of `len` bytes takes: the smallest class that holds it (`None`
    /// beyond the largest).
    pub fn chunk_for(&self, len: usize) -> Option<usize> {
        self.chunk_sizes.iter().copied().filter(|&c| c >= len).min()
    }

    /// How the pool's bytes are split between reservations and the shared remainder, the
    /// defaults resolved (see the type's docs).
    pub fn budget(&self) -> Budget {
        self.budget_beside(0)
    }

    /// The most the reservations of one peer address's accepted connections hold together
    /// (`per_address_bytes`, resolved).
    pub fn per_address(&self) -> usize {
        self.per_address_bytes.unwrap_or(self.budget().reservable / 4)
    }

    /// [`PoolConfig::budget`] with `device` bytes set aside first for the device's own use (a
    /// shared receive queue's receives): the defaults split what is left.
    pub(crate) fn budget_beside(&self, device: usize) -> Budget {
        let rest = self.max_bytes.saturating_sub(device);
        let shared = self.shared_bytes.unwrap_or(rest / 4);
        Budget {
            reservable: self.reserved_bytes.unwrap_or(rest / 2),
            shared,
            per_account: self.per_connection_bytes.unwrap_or(shared / 4),
        }
    }
}

/// Page-aligned, zeroed memory, freed on drop.
struct Mem {
    ptr: NonNull<u8>,
    layout: Layout,
}

impl Mem {
    fn new(len: usize) -> Option<Mem> {
        let layout = Layout::from_size_align(len.max(1), 4096).ok()?;
        // SAFETY: layout has non-zero size.
        let ptr = NonNull::new(unsafe { alloc::alloc_zeroed(layout) })?;
        Some(Mem { ptr, layout })
    }
}

impl Drop for Mem {
    fn drop(&mut self) {
        // SAFETY: allocated in Mem::new with this layout, freed once.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// One registered allocation. Field order is drop order: the region is deregistered before
/// its memory is freed.
struct Cluster {
    mr: Mr,
    mem: Mem,
    /// Its class's chunk size: a [`Buf`]'s capacity (kept here, not in each `Buf`, so a `Buf`
    /// moves in a few stores: issue 33).
    cap: usize,
    /// Its class's stride: the chunk and its slack.
    stride: usize,
    /// Identity of its pool (the address of the pool's shared byte counter): [`Pool::owns`].
    pool: usize,
    /// Per chunk: how many bytes from its start may be non-zero (its owners' dirty extents);
    /// the rest is zero, as allocated.
    dirty: Vec<Cell<u32>>,
    /// Per chunk: whose bytes those are ([`NO_OWNER`]: nobody's in particular, foreign to
    /// every connection).
    owner: Vec<Cell<u64>>,
}

/// The owner of the runtime's own buffers, and of chunks whose bytes mix several owners':
/// no connection's, so foreign to every connection.
pub(crate) const NO_OWNER: u64 = 0;

/// A new owner id for a connection: never [`NO_OWNER`], never one an earlier connection of the
/// process had (a token's generation wraps, and a slot freed last is reused first, so a token
/// would let a connection take another's leftover bytes as its own).
pub(crate) fn next_owner() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// One size class: clusters of equal chunks, with per-cluster free lists.
struct Class {
    chunk_size: usize,
    /// Bytes from one chunk's start to the next: the chunk and its slack (`Pool::new`).
    stride: usize,
    per_cluster: usize,
    pd: Rc<Pd>,
    clusters: Vec<Option<Rc<Cluster>>>,
    free: Vec<Vec<u32>>,
    in_use: usize,
    /// Bytes registered by every class of the pool, shared.
    registered: Rc<Cell<usize>>,
    max_bytes: usize,
    /// Who holds the pool's bytes (`ledger.rs`), shared by the classes: a buffer is charged
    /// to its account when allocated and credited when dropped.
    ledger: Rc<RefCell<Ledger>>,
}

/// A pool of registered chunks, in size classes, on one protection domain.
#[derive(Clone)]
pub struct Pool {
    classes: Vec<Rc<RefCell<Class>>>,
    registered: Rc<Cell<usize>>,
    ledger: Rc<RefCell<Ledger>>,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("classes", &self.classes.len())
            .field("registered", &self.registered.get())
            .finish()
    }
}

impl Pool {
    /// A pool on `pd`; registers one cluster of the smallest class now. Every chunk is
    /// followed by at least `slack` bytes only the device writes (a message's tail after a
    /// full chunk of payload on iWARP, `proto::transport`), never shown, sent or exposed;
    /// rounded up to 64 so chunks stay cache-line aligned.
    pub fn new(pd: &Rc<Pd>, cfg: &PoolConfig, slack: usize) -> Result<Pool> {
        let slack = slack.div_ceil(64) * 64;
        let mut sizes = cfg.chunk_sizes.clone();
        sizes.sort_unstable();
        sizes.dedup();
        // With its slack a chunk's stride is still a `u32`: a receive is posted over the whole
        // stride (`Buf::post_capacity`), and its length is a `u32` in the work request.
        if sizes.is_empty() || sizes[0] == 0 || sizes[sizes.len() - 1] > u32::MAX as usize - slack {
            return Err(Error::Config(format!("pool chunk sizes {:?}", cfg.chunk_sizes)));
        }
        let registered = Rc::new(Cell::new(0));
        let ledger = Rc::new(RefCell::new(Ledger::new(cfg.budget())));
        let classes = sizes
            .iter()
            .map(|&chunk_size| {
                Rc::new(RefCell::new(Class {
                    chunk_size,
                    stride: chunk_size + slack,
                    per_cluster: (cfg.cluster_bytes / chunk_size).max(1),
                    pd: pd.clone(),
                    clusters: Vec::new(),
                    free: Vec::new(),
                    in_use: 0,
                    registered: registered.clone(),
                    max_bytes: cfg.max_bytes,
                    ledger: ledger.clone(),
                }))
            })
            .collect();
        let pool = Pool { classes, registered, ledger };
        pool.classes[0].borrow_mut().grow()?;
        Ok(pool)
    }

    /// The largest chunk size.
    pub fn max_chunk(&self) -> usize {
        self.classes.last().map_or(0, |c| c.borrow().chunk_size)
    }

    /// Bytes registered.
    pub fn registered_bytes(&self) -> usize {
        self.registered.get()
    }

    /// Chunks handed out and not yet back (buffers the application or the device holds).
    pub fn in_use(&self) -> usize {
        self.classes.iter().map(|c| c.borrow().in_use).sum()
    }

    /// True if `n` buffers of `len` bytes can be had now: free chunks of the class that holds
    /// `len`, and the clusters the maximum still lets it register (`PoolConfig::max_bytes`).
    pub fn room_for(&self, len: usize, n: usize) -> bool {
        let Some(class) = self.classes.iter().find(|c| c.borrow().chunk_size >= len) else { return false };
        let c = class.borrow();
        let free: usize = c.free.iter().map(Vec::len).sum();
        clusters_fit(free, n, c.per_cluster, c.stride * c.per_cluster, self.registered.get(), c.max_bytes)
    }

    /// Takes a free chunk of the smallest class that holds `len` bytes, registering a new
    /// cluster when that class has none free and the maximum allows, for `owner` (a
    /// connection's owner id, [`next_owner`], or [`NO_OWNER`]). The buffer's length is `len`; bytes of another
    /// owner's in it read as zeros.
    pub fn alloc(&self, len: usize, owner: u64) -> Result<Buf> {
        self.alloc_for(len, owner, Account::NONE)
    }

    /// [`Pool::alloc`], charged to `account` ([`Ledger`]): refused with
    /// [`Error::OverBudget`] when the account may not hold one more chunk of the class.
    pub fn alloc_for(&self, len: usize, owner: u64, account: Account) -> Result<Buf> {
        // The error is built only when it is returned (issue 33: built and dropped on every
        // allocation, with the largest class borrowed for it, it cost about 45 instructions).
        let class = self.classes.iter().find(|c| c.borrow().chunk_size >= len).ok_or_else(|| Error::TooLarge {
            len,
            max: self.max_chunk(),
            limit: "the pool's largest chunk, PoolConfig::chunk_sizes (Config::pool)",
        })?;
        let mut inner = class.borrow_mut();
        if account != Account::NONE {
            let cap = inner.chunk_size;
            let charged = inner.ledger.borrow_mut().charge(account, cap);
            if let Err(r) = charged {
                return Err(over_budget(r, &inner.ledger.borrow(), account));
            }
        }
        let slot = match inner.free.iter().position(|f| !f.is_empty()) {
            Some(i) => i,
            None => match inner.grow() {
                Ok(i) => i,
                Err(e) => {
                    let cap = inner.chunk_size;
                    inner.ledger.borrow_mut().credit(account, cap);
                    return Err(e);
                }
            },
        };
        let chunk = inner.free[slot].pop().expect("grow leaves free chunks");
        inner.in_use += 1;
        let cluster = inner.clusters[slot].clone().expect("a cluster with free chunks is present");
        drop(inner);
        let (dirty, left_by) = (cluster.dirty[chunk as usize].get(), cluster.owner[chunk as usize].get());
        let marks = Marks::new(dirty, owner != NO_OWNER && left_by == owner);
        Ok(Buf {
            class: class.clone(),
            cluster,
            slot: slot as u32,
            chunk,
            len: mark(len),
            marks: Cell::new(marks),
            owner: Cell::new(owner),
            account: account.raw(),
        })
    }

    /// Opens an account with a reservation of `bytes` ([`Ledger::open`]); `None` when the
    /// reservations would exceed the pool's [`Budget::reservable`].
    pub fn open_account(&self, bytes: usize) -> Option<Account> {
        self.ledger.borrow_mut().open(bytes)
    }

    /// Opens the device's own account, whose reservation of `bytes` was set aside before the
    /// split ([`Ledger::open_outside`]: a shared receive queue's receives).
    pub fn open_device_account(&self, bytes: usize) -> Account {
        self.ledger.borrow_mut().open_outside(bytes)
    }

    /// Closes an account ([`Ledger::close`]): its reservation is released.
    pub fn close_account(&self, account: Account) {
        self.ledger.borrow_mut().close(account);
    }

    /// The chunk size of the class that holds `len` bytes (`None` beyond the largest).
    pub fn chunk_size(&self, len: usize) -> Option<usize> {
        self.classes.iter().map(|c| c.borrow().chunk_size).find(|&c| c >= len)
    }

    /// True when `account` may hold `len` bytes more (a chunk of the class that holds them).
    pub fn can_charge(&self, account: Account, len: usize) -> bool {
        let Some(cap) = self.classes.iter().map(|c| c.borrow().chunk_size).find(|&c| c >= len) else {
            return false;
        };
        self.ledger.borrow().can_charge(account, cap)
    }

    /// The ledger: reservations and what is borrowed.
    pub fn ledger(&self) -> std::cell::Ref<'_, Ledger> {
        self.ledger.borrow()
    }

    /// Releases clusters whose chunks are all free, except the first cluster of the smallest
    /// class, so a quiet pool returns to one registered region.
    pub fn trim(&self) {
        for (i, class) in self.classes.iter().enumerate() {
            let mut c = class.borrow_mut();
            let per = c.per_cluster;
            let bytes = per * c.stride;
            let first = if i == 0 { 1 } else { 0 };
            for slot in first..c.clusters.len() {
                if c.clusters[slot].is_some() && c.free[slot].len() == per {
                    c.clusters[slot] = None;
                    c.free[slot].clear();
                    c.registered.set(c.registered.get() - bytes);
                }
            }
        }
    }

    /// True when `buf` came from this pool.
    pub fn owns(&self, buf: &Buf) -> bool {
        buf.cluster.pool == Rc::as_ptr(&self.registered) as usize
    }
}

/// [`Error::OverBudget`] for refusal `r` of `account`.
fn over_budget(r: Refusal, ledger: &Ledger, account: Account) -> Error {
    let (held, reserved) = ledger.held(account);
    let limit = match r {
        Refusal::Account { .. } => "its own limit, PoolConfig::per_connection_bytes",
        Refusal::Shared { .. } => "every connection's borrowing together, PoolConfig::shared_bytes",
    };
    Error::OverBudget { held, reserved, limit }
}

impl Class {
    /// Registers one more cluster; returns its slot.
    fn grow(&mut self) -> Result<usize> {
        let cluster_bytes = self.stride * self.per_cluster;
        if self.registered.get() + cluster_bytes > self.max_bytes.max(cluster_bytes) {
            return Err(Error::PoolExhausted { max_bytes: self.max_bytes });
        }
        let mem = Mem::new(cluster_bytes).ok_or(Error::PoolExhausted { max_bytes: self.max_bytes })?;
        // SAFETY: mem is kept in the same Cluster as the region and is dropped after it (field
        // order), so the memory outlives the registration and never moves.
        let mr = unsafe { Mr::register(&self.pd, mem.ptr.as_ptr(), cluster_bytes, Access::LOCAL_WRITE) }
            .map_err(|e| super::reg_error(cluster_bytes, format!("pool cluster of {cluster_bytes} bytes"), e))?;
        self.registered.set(self.registered.get() + cluster_bytes);
        let dirty = (0..self.per_cluster).map(|_| Cell::new(0)).collect();
        let owner = (0..self.per_cluster).map(|_| Cell::new(NO_OWNER)).collect();
        let pool = Rc::as_ptr(&self.registered) as usize;
        let cluster = Rc::new(Cluster { mr, mem, cap: self.chunk_size, stride: self.stride, pool, dirty, owner });
        let chunks: Vec<u32> = (0..self.per_cluster as u32).rev().collect();
        let slot = match self.clusters.iter().position(|c| c.is_none()) {
            Some(s) => s,
            None => {
                self.clusters.push(None);
                self.free.push(Vec::new());
                self.clusters.len() - 1
            }
        };
        self.clusters[slot] = Some(cluster);
        self.free[slot] = chunks;
        Ok(slot)
    }
}

/// Whether `n` chunks can be had from a class with `free` chunks free, `per_cluster` chunks in
/// each new cluster of `cluster_bytes`, the pool having `registered` bytes of at most `max`
/// (a cluster larger than `max` may still be the first, as `Class::grow` allows). Pure.
fn clusters_fit(
    free: usize,
    n: usize,
    per_cluster: usize,
    cluster_bytes: usize,
    registered: usize,
    max: usize,
) -> bool {
    let Some(short) = n.checked_sub(free).filter(|s| *s > 0) else { return true };
    let clusters = short.div_ceil(per_cluster.max(1));
    clusters
        .checked_mul(cluster_bytes)
        .and_then(|b| b.checked_add(registered))
        .is_some_and(|total| total <= max.max(cluster_bytes))
}

/// One chunk of registered memory, owned. Returns to its pool when dropped.
///
/// Its bytes are its owner's: those it wrote, those the device wrote for it (a receive, a
/// READ), and zeros. A chunk's earlier owner's bytes never show, through any safe call (the
/// module docs say how, at no cost on the common paths).
pub struct Buf {
    class: Rc<RefCell<Class>>,
    /// Its chunk's cluster, which also holds the capacity, stride and pool identity every
    /// chunk of its class shares.
    cluster: Rc<Cluster>,
    slot: u32,
    chunk: u32,
    len: u32,
    /// Which bytes are this owner's (a `Cell`: the shared view zeroes lazily too).
    marks: Cell<Marks>,
    /// The connection whose buffer this is (module docs), or [`NO_OWNER`].
    owner: Cell<u64>,
    /// The account its chunk is charged to ([`Ledger`]; 0: none).
    account: u32,
}

/// Which bytes of a chunk are its current owner's (pure; see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Marks {
    /// Bytes from the chunk's start that hold only this owner's data or zeros.
    fresh: u32,
    /// Bytes from the chunk's start that may hold another owner's data; beyond, this
    /// owner's bytes or zeros.
    stale: u32,
    /// Bytes from the chunk's start that may be non-zero when this owner lets go.
    dirty: u32,
}

/// A byte count inside a chunk as a mark, or a `Buf`'s length. Every count given is at most
/// the chunk's capacity, which `Pool::new` keeps at most `u32::MAX` (with its slack), so the
/// conversion is exact. (Were one larger, it would saturate to `u32::MAX`: `fresh`, only ever
/// raised to a count, could not pass the count; a `dirty` or `stale` mark would be short of
/// it, but every range zeroed is cut at the length first, itself at most `u32::MAX`.) Marks
/// are `u32`s so a [`Buf`] moves in a few stores (issue 33).
fn mark(n: usize) -> u32 {
    debug_assert!(u32::try_from(n).is_ok(), "a count of {n} bytes in a chunk");
    u32::try_from(n).unwrap_or(u32::MAX)
}

impl Marks {
    /// A chunk whose first `dirty` bytes may be non-zero: another owner's bytes, or (`own`)
    /// those of the owner taking it.
    #[inline]
    fn new(dirty: u32, own: bool) -> Marks {
        Marks { fresh: 0, stale: if own { 0 } else { dirty }, dirty }
    }

    /// The buffer passes to another owner, which is given its first `keep` bytes (what it
    /// sends or exposes; 0 for a receive or READ, which the device overwrites): everything
    /// else may be the last owner's, fresh for it or not.
    #[inline]
    fn change_owner(&mut self, keep: usize) {
        self.stale = self.stale.max(self.dirty);
        self.fresh = self.fresh.min(mark(keep));
    }

    /// Whose the chunk's bytes are once this owner lets go: its own, unless bytes of another
    /// owner may remain (some were never shown, so never zeroed).
    #[inline]
    fn leaves_only_own_bytes(&self) -> bool {
        self.fresh >= self.stale
    }

    /// The first `n` bytes were written by the owner (or zeroed, or by the device for it).
    #[inline]
    fn written(&mut self, n: usize) {
        let n = mark(n);
        self.fresh = self.fresh.max(n);
        self.dirty = self.dirty.max(n);
    }

    /// The device may write up to `n` bytes for this owner (a posted receive or READ).
    #[inline]
    fn device_may_write(&mut self, n: usize) {
        self.dirty = self.dirty.max(mark(n));
    }

    /// The first `len` bytes are about to be shown (to the owner, the device or a peer): the
    /// range to zero first, where an earlier owner's bytes may be. Afterwards they are all
    /// this owner's.
    #[inline]
    fn show(&mut self, len: usize) -> std::ops::Range<usize> {
        let start = (self.fresh as usize).min(len);
        let clear = start..(self.stale as usize).min(len).max(start);
        self.written(len);
        clear
    }
}

impl fmt::Debug for Buf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buf").field("slot", &self.slot).field("chunk", &self.chunk).field("len", &self.len()).finish()
    }
}

impl Buf {
    fn base(&self) -> *mut u8 {
        // SAFETY: chunk < chunks_per_cluster, so the offset stays inside the allocation.
        unsafe { self.cluster.mem.ptr.as_ptr().add(self.chunk as usize * self.cluster.stride) }
    }

    /// Bytes of data (what a send sends; what a receive received).
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// True when `len()` is 0.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes the chunk holds.
    pub fn capacity(&self) -> usize {
        self.cluster.cap
    }

    /// Sets the data length, up to the capacity. Bytes this owner did not write (or receive)
    /// read as zeros.
    pub fn set_len(&mut self, len: usize) -> Result<()> {
        if len > self.cluster.cap {
            return Err(Error::TooLarge {
                len,
                max: self.cluster.cap,
                limit: "the buffer's capacity (allocate a larger one)",
            });
        }
        self.len = mark(len);
        Ok(())
    }

    /// Sets the data length without zeroing what an earlier owner may have left in the chunk:
    /// the first `len` bytes are taken as this owner's.
    ///
    /// # Safety
    ///
    /// Like [`Vec::set_len`]: the caller must have written every byte of the first `len` that
    /// it did not write or receive before (for example through
    /// [`spare_capacity_mut`](Buf::spare_capacity_mut)). Otherwise the buffer shows, and a send
    /// of it carries, bytes of the chunk's earlier use: another connection's data.
    pub unsafe fn set_len_unchecked(&mut self, len: usize) -> Result<()> {
        self.set_len(len)?;
        self.update(|m| m.written(len));
        Ok(())
    }

    /// The bytes past `len()`, to write in place without the cost of zeroing them first (then
    /// [`set_len_unchecked`](Buf::set_len_unchecked)). Their contents are unspecified: they may
    /// be an earlier owner's, so they are handed out write-only.
    pub fn spare_capacity_mut(&mut self) -> &mut [std::mem::MaybeUninit<u8>] {
        self.update(|m| m.device_may_write(self.cluster.cap));
        // SAFETY: as in as_mut_slice; len <= cap, and MaybeUninit<u8> has u8's layout, so the
        // bytes can only be written through it.
        unsafe { std::slice::from_raw_parts_mut(self.base().add(self.len()).cast(), self.cluster.cap - self.len()) }
    }

    /// Replaces the contents with `data`.
    pub fn fill_from(&mut self, data: &[u8]) -> Result<()> {
        self.set_len(data.len())?;
        // SAFETY: as in as_mut_slice; data.len() == self.len <= cap, and `data` cannot alias
        // the chunk (the only references to it come from &self or &mut self).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.base(), data.len()) };
        self.written(data.len());
        Ok(())
    }

    /// Appends as many bytes of `data` as fit in the capacity after the data; returns how
    /// many. The data before them are this owner's (or zeros) from then on, as after
    /// [`as_slice`](Buf::as_slice).
    pub fn append(&mut self, data: &[u8]) -> usize {
        let at = self.len();
        let n = data.len().min(self.cluster.cap - at);
        // The first `at` bytes become this owner's before the mark below counts them written.
        self.show();
        // SAFETY: as in as_mut_slice; at + n <= cap, and `data` cannot alias the chunk (the
        // only references to it come from &self or &mut self).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.base().add(at), n) };
        self.len = mark(at + n);
        self.written(at + n);
        n
    }

    /// Sets the data (`len()` bytes) to zeros.
    pub fn zero(&mut self) {
        // SAFETY: as in as_mut_slice; len <= cap.
        unsafe { std::ptr::write_bytes(self.base(), 0, self.len()) };
        self.written(self.len());
    }

    /// The data. Bytes this owner did not write or receive read as zeros.
    pub fn as_slice(&self) -> &[u8] {
        self.show();
        // SAFETY: this Buf owns the chunk exclusively (it is off the free list) and it is not
        // posted (a posted Buf is held by the reactor, not reachable here); the memory lives
        // while self.cluster does; len <= cap.
        unsafe { std::slice::from_raw_parts(self.base(), self.len()) }
    }

    /// The data, mutable. Bytes this owner did not write or receive read as zeros.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.show();
        // SAFETY: as in as_slice, and &mut self makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.base(), self.len()) }
    }

    pub(crate) fn addr(&self) -> u64 {
        self.base() as u64
    }

    /// Bytes a receive posted on it may take: the capacity and the slack after it (a
    /// message's tail on iWARP).
    pub(crate) fn post_capacity(&self) -> usize {
        self.cluster.stride
    }

    /// The 4 bytes before offset `n` of a receive that got `n` bytes: a message's tail, which
    /// may lie in the slack past the capacity. `None` when `n` is under 4 or past the slack.
    pub(crate) fn tail_before(&self, n: usize) -> Option<[u8; 4]> {
        let at = n.checked_sub(4).filter(|_| n <= self.cluster.stride)?;
        let mut tail = [0u8; 4];
        // SAFETY: at + 4 <= stride: inside this chunk's stride, which this Buf owns; the device
        // wrote these bytes for the receive whose completion was reaped, and nothing else
        // writes them while the caller holds the Buf.
        unsafe { std::ptr::copy_nonoverlapping(self.base().add(at), tail.as_mut_ptr(), 4) };
        Some(tail)
    }

    pub(crate) fn lkey(&self) -> u32 {
        self.cluster.mr.lkey()
    }

    fn update(&self, f: impl FnOnce(&mut Marks)) {
        let mut m = self.marks.get();
        f(&mut m);
        self.marks.set(m);
    }

    /// The first `n` bytes now hold this owner's data (written by it, or by the device for
    /// its receive or READ).
    pub(crate) fn written(&mut self, n: usize) {
        self.update(|m| m.written(n.min(self.cluster.cap)));
    }

    /// The device wrote `n` bytes for this owner (a receive's completion): they are the data.
    pub(crate) fn received(&mut self, n: usize) {
        self.len = mark(n.min(self.cluster.cap));
        self.written(self.len());
    }

    /// The buffer is used by connection `owner` from now on (submitted on it, or a message
    /// for it landed in it), which is given its first `keep` bytes (what it sends, exposes or
    /// received; 0 for a receive or READ still to be posted): every other byte may be foreign
    /// to it, including bytes the previous owner wrote or received past `keep`.
    pub(crate) fn set_owner(&self, owner: u64, keep: usize) {
        if self.owner.get() != owner {
            self.update(|m| m.change_owner(keep.min(self.len())));
            self.owner.set(owner);
        }
    }

    /// Moves the chunk's charge to `to` ([`Ledger::transfer`]): a shared receive queue's
    /// buffer now holds a message for `to`'s connection.
    pub(crate) fn charge_to(&mut self, to: Account) {
        if self.account != to.raw() {
            let inner = self.class.borrow();
            inner.ledger.borrow_mut().transfer(Account::from_raw(self.account), to, inner.chunk_size);
            self.account = to.raw();
        }
    }

    /// The device may write up to `n` bytes of the chunk (a receive or READ is posted on it).
    pub(crate) fn lend_to_device(&mut self, n: usize) {
        self.update(|m| m.device_may_write(n.min(self.cluster.cap)));
    }

    /// Makes the first `len()` bytes this owner's before anything shows them (a view, a send
    /// or RDMA WRITE of them, an exposure): zeroes those an earlier owner may have left.
    pub(crate) fn show(&self) {
        let mut m = self.marks.get();
        let clear = m.show(self.len());
        self.marks.set(m);
        if !clear.is_empty() {
            // SAFETY: clear.end <= len <= cap, inside the chunk this Buf owns exclusively; the
            // bytes in `clear` were not yet shown to anyone (they are past `fresh`), so no
            // reference into them exists, and a device access to them needs this Buf, which is
            // not posted while its owner can call this.
            unsafe { std::ptr::write_bytes(self.base().add(clear.start), 0, clear.len()) };
        }
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        // What this owner may have left, and whose it is, for the next owner.
        let m = self.marks.get();
        let dirty = &self.cluster.dirty[self.chunk as usize];
        dirty.set(dirty.get().max(m.dirty));
        let owner = if m.leaves_only_own_bytes() { self.owner.get() } else { NO_OWNER };
        self.cluster.owner[self.chunk as usize].set(owner);
        let mut inner = self.class.borrow_mut();
        inner.in_use -= 1;
        if self.account != 0 {
            let cap = inner.chunk_size;
            inner.ledger.borrow_mut().credit(Account::from_raw(self.account), cap);
        }
        let slot = self.slot as usize;
        // A trimmed cluster has no live Buf, so the slot still names this cluster.
        if inner.clusters[slot].as_ref().is_some_and(|c| Rc::ptr_eq(c, &self.cluster)) {
            inner.free[slot].push(self.chunk);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{clusters_fit, Marks};

    #[test]
    fn room_counts_free_chunks_then_the_clusters_the_maximum_allows() {
        // 4 chunks a cluster of 1 MiB, 8 MiB at most, 6 MiB registered: 2 clusters more.
        let fit = |free, n| clusters_fit(free, n, 4, 1 << 20, 6 << 20, 8 << 20);
        assert!(fit(0, 0) && fit(3, 3), "free chunks suffice");
        assert!(fit(0, 8) && fit(2, 10), "two more clusters hold 8 chunks");
        assert!(!fit(0, 9) && !fit(2, 11), "a third cluster is over the maximum");
        // A first cluster larger than the maximum is allowed (as `Class::grow` does), no more.
        assert!(clusters_fit(0, 1, 1, 4 << 20, 0, 1 << 20));
        assert!(!clusters_fit(0, 2, 1, 4 << 20, 0, 1 << 20));
        // No overflow on absurd counts.
        assert!(!clusters_fit(0, usize::MAX, 1, usize::MAX, 1, usize::MAX));
    }

    #[test]
    fn a_chunk_never_dirtied_needs_no_zeroing() {
        let mut m = Marks::new(0, false);
        assert!(m.show(8192).is_empty());
    }

    #[test]
    fn another_owners_bytes_are_zeroed_where_they_would_show_and_only_once() {
        let mut m = Marks::new(4096, false);
        assert_eq!(m.show(16), 0..16, "a fresh 16-byte buffer viewed");
        assert_eq!(m.show(8192), 16..4096, "grown to the capacity: the rest of the old bytes");
        assert!(m.show(8192).is_empty(), "shown once: nothing left to clear");
        assert!(m.leaves_only_own_bytes());
    }

    #[test]
    fn an_owners_own_bytes_are_not_foreign_to_it() {
        let mut m = Marks::new(4096, true);
        assert!(m.show(4096).is_empty(), "a connection reusing its own chunk zeroes nothing");
        let mut n = Marks::new(4096, true);
        n.change_owner(0);
        assert_eq!(n.show(4096), 0..4096, "submitted on another connection: its old bytes are foreign there");
    }

    #[test]
    fn written_or_received_bytes_are_the_owners_and_cost_nothing() {
        let mut m = Marks::new(4096, false);
        m.written(2); // a 2-byte receive, or fill_from
        assert!(m.show(2).is_empty(), "the common path zeroes nothing");
        assert!(!m.leaves_only_own_bytes(), "bytes 2..4096 were never shown, so never zeroed");
        assert_eq!(m.show(4096), 2..4096, "set_len(4096) after a 2-byte receive: the rest is zeroed");
        let mut f = Marks::new(4096, false);
        f.written(100);
        f.change_owner(100);
        assert!(f.show(100).is_empty(), "the bytes it sends go with the buffer to its new owner");
    }

    #[test]
    fn bytes_past_what_is_passed_on_are_foreign_to_the_new_owner() {
        // Hostile read of issue 17's fix: a 4 096-byte message received on X, cut to 16
        // bytes and sent on Y. X's other 4 080 bytes were fresh for X, never for Y.
        let mut m = Marks::new(0, false);
        m.device_may_write(4096);
        m.written(4096);
        m.change_owner(16);
        assert!(m.show(16).is_empty(), "the 16 bytes sent are Y's");
        assert!(!m.leaves_only_own_bytes(), "X's bytes are still in the chunk: it is nobody's when Y drops it");
        assert_eq!(m.show(4096), 16..4096, "grown back on Y: X's bytes are zeroed");
        // A receive reposted on another connection: nothing of X's is kept.
        let mut r = Marks::new(0, false);
        r.written(4096);
        r.change_owner(0);
        r.written(100); // Y's receive of 100 bytes
        assert_eq!(r.show(4096), 100..4096, "X's bytes past Y's message are zeroed");
    }

    /// `Buf::append`'s marks (issue 46): the data before the appended bytes are shown (an
    /// earlier owner's bytes there zeroed) before the appended ones count as written, so
    /// bytes past the data that were never written stay foreign.
    #[test]
    fn appended_bytes_are_the_owners_and_what_lay_before_them_was_shown_first() {
        let mut m = Marks::new(4096, false);
        m.written(100); // filled with 100 bytes
        m.change_owner(100); // submitted on a connection
        assert!(m.show(100).is_empty(), "append's show: the data are already the owner's");
        m.written(1100); // 1 000 bytes appended after them
        assert!(m.show(1100).is_empty(), "the appended bytes are the owner's");
        assert_eq!(m.show(4096), 1100..4096, "what lies past them is still zeroed before it shows");
        // Data whose length was set without writing (`set_len`): shown (zeroed) first.
        let mut n = Marks::new(4096, false);
        assert_eq!(n.show(50), 0..50, "the first 50 bytes, never written, are zeroed before the append");
        n.written(80);
        assert!(n.show(80).is_empty());
    }

    #[test]
    fn what_an_owner_leaves_is_the_next_owners_dirty_extent() {
        let mut m = Marks::new(100, false);
        m.device_may_write(4096); // a receive posted over the whole chunk
        assert_eq!(m.dirty, 4096, "the device may have written all of it");
        let mut n = Marks::new(16, false);
        n.written(300);
        assert_eq!(n.dirty, 300);
        assert_eq!(Marks::new(5, true).dirty, 5, "never less than what it found");
    }
}
