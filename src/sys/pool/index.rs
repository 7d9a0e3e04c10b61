//! The index-based pool (issue 47, item 7): what [`Pool`](super::Pool) and [`Buf`](super::Buf)
//! become, built beside them so the reactor can adopt it in phase 2 (and the pool's
//! per-connection accounting, changed meanwhile, merges into one of the two).
//!
//! The same pool, on other bookkeeping:
//!
//! - **A buffer is an index.** An [`IndexBuf`] is its pool's address, its chunk's id and its
//!   length: 16 bytes, no `Rc`. Everything a chunk keeps (address, local key, capacity,
//!   stride, the ownership [`Marks`] and the owner) sits in the pool's array of chunks, at the
//!   chunk's id; the marks of a chunk that is out are its holder's (the pool's `Buf` kept them
//!   in the buffer, and merged its dirty extent and owner back when dropped: here they never
//!   leave the array).
//! - **O(1) free stacks.** Each size class keeps one stack of free chunk ids: an allocation
//!   pops, a drop pushes. (The pool's classes keep a free list per cluster, scanned for one
//!   with a free chunk, behind a `RefCell` borrowed at every allocation and drop.)
//! - **One count keeps the pool alive.** The pool's state lives on the heap, reached by a
//!   pointer from each handle ([`IndexPool`], cheap to clone) and each buffer; it is freed when
//!   the last of them goes, so a buffer the application keeps after its reactor is dropped
//!   still owns registered, mapped memory (as the pool's `Buf` does with its `Rc`s). The
//!   count of buffers out is the one the pool needs anyway (`in_use`); nothing else is counted
//!   per buffer.
//!
//! The rule the pool's module docs state is kept, with the same [`Marks`] (the same code): no
//! safe call shows a connection another connection's bytes; foreign bytes are zeroed lazily,
//! where they would be seen; the common paths zero nothing.
//!
//! **Per-connection accounting** (the lead's change to the pool, issue 46) sits in the same
//! arrays: an account id per chunk, written at allocation, and a table of accounts in the
//! pool's state (bytes charged, limit): [`IndexPool::alloc`] would refuse past the account's
//! limit and charge the chunk's capacity, and the drop would credit it back to the account the
//! chunk names (two loads and a store each way; a reservation is a counter of the account).
//! Nothing of it is built here.
//!
//! **The state's borrow discipline.** The state is one [`UnsafeCell`], reached only through
//! [`Shared::state`], which hands out `&mut State`. Every function here takes it at most once,
//! uses it, and lets it go before returning; none calls another that takes it while holding
//! it, and none runs user code or anything that could reach this pool again while holding it
//! (registering or deregistering memory calls into rdma-core only). The types are `!Send` and
//! `!Sync` (raw pointers), so only the thread that made the pool reaches it. So no two
//! `&mut State` are ever live at once. A view of a buffer's bytes borrows the cluster's
//! memory, a separate allocation the state only points at, never the state.
#![allow(unsafe_code)]
// Phase 1 of issue 47: built beside the reactor's data path, which adopts it in phase 2
// (DATAPATH.md); until then only the host benchmark (`bench_internals::Path`) and the unit tests
// use it, so parts of it are dead code in a build without them.
#![allow(dead_code)]

use std::alloc::{self, Layout};
use std::cell::{Cell, UnsafeCell};
use std::fmt;
use std::ptr::NonNull;
use std::rc::Rc;

use super::{mark, Marks, PoolConfig, NO_OWNER};
use crate::error::{Error, Result};
use crate::sys::mr::{Access, Mr};
use crate::sys::pd::Pd;

/// Page-aligned, zeroed memory, freed on drop (as the pool's).
struct Mem {
    ptr: NonNull<u8>,
    layout: Layout,
}

impl Mem {
    fn new(len: usize) -> Option<Mem> {
        let layout = Layout::from_size_align(len.max(1), 4096).ok()?;
        // SAFETY: layout has a non-zero size.
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

/// One registered allocation. Field order is drop order: deregistered, then freed.
struct Cluster {
    /// `None` in a pool made with [`IndexPool::unregistered`] (no device).
    _mr: Option<Mr>,
    _mem: Mem,
    /// Its first chunk's id; its chunks are the next `per_cluster` ids.
    first: u32,
}

/// What the pool keeps of one chunk, at its id.
#[derive(Clone, Copy)]
struct Chunk {
    /// Its first byte.
    addr: u64,
    /// The connection whose buffer it is while out; once back, whose bytes it holds
    /// ([`NO_OWNER`]: nobody's in particular).
    owner: u64,
    /// Its holder's marks while out; once back, `dirty` is how far it may be non-zero.
    marks: Marks,
    lkey: u32,
    /// Its class's chunk size and stride (the chunk and its slack).
    cap: u32,
    stride: u32,
    class: u32,
}

/// One size class.
struct Class {
    chunk_size: u32,
    stride: u32,
    per_cluster: u32,
    /// Free chunk ids: popped by an allocation, pushed by a drop.
    free: Vec<u32>,
    /// The clusters of this class, by index into [`State::clusters`].
    clusters: Vec<usize>,
    /// Id ranges (their first id) of released clusters, for the next cluster of the class.
    spare: Vec<u32>,
}

struct State {
    classes: Vec<Class>,
    /// Every chunk, by id.
    chunks: Vec<Chunk>,
    clusters: Vec<Option<Cluster>>,
    registered: usize,
    max_bytes: usize,
    /// `None`: memory is not registered (a pool for the host, [`IndexPool::unregistered`]).
    pd: Option<Rc<Pd>>,
}

/// The pool's state and the counts that keep it alive ([module docs](self)).
struct Shared {
    /// [`IndexPool`] handles.
    handles: Cell<usize>,
    /// [`IndexBuf`]s.
    live: Cell<usize>,
    state: UnsafeCell<State>,
}

impl Shared {
    /// The state, mutably.
    ///
    /// # Safety
    ///
    /// `shared` is live (a handle or a buffer holds it), and no other `&mut State` of it is live
    /// while the one returned is (the module docs' discipline).
    #[allow(clippy::mut_from_ref)]
    #[inline(always)]
    unsafe fn state<'a>(shared: NonNull<Shared>) -> &'a mut State {
        // SAFETY: the caller's contract.
        unsafe { &mut *(*shared.as_ptr()).state.get() }
    }

    /// Frees `shared` when nothing holds it any more.
    ///
    /// # Safety
    ///
    /// `shared` is live, and the handle or buffer that just let go of it does not use it again.
    unsafe fn release_if_unused(shared: NonNull<Shared>) {
        // SAFETY: live, the caller's contract.
        let s = unsafe { shared.as_ref() };
        if s.handles.get() == 0 && s.live.get() == 0 {
            // SAFETY: allocated by `Box::new` in `IndexPool::make`; no handle and no buffer is
            // left to reach it, so this is the last use, once.
            drop(unsafe { Box::from_raw(shared.as_ptr()) });
        }
    }
}

/// A pool of registered chunks in size classes, bookkept by index (the module docs).
pub struct IndexPool {
    shared: NonNull<Shared>,
}

impl fmt::Debug for IndexPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IndexPool").field("registered", &self.registered_bytes()).finish()
    }
}

impl Clone for IndexPool {
    fn clone(&self) -> IndexPool {
        // SAFETY: this handle holds the state live.
        let s = unsafe { self.shared.as_ref() };
        s.handles.set(s.handles.get() + 1);
        IndexPool { shared: self.shared }
    }
}

impl Drop for IndexPool {
    fn drop(&mut self) {
        // SAFETY: this handle held the state live; it is not used after this.
        unsafe {
            let s = self.shared.as_ref();
            s.handles.set(s.handles.get() - 1);
            Shared::release_if_unused(self.shared);
        }
    }
}

impl IndexPool {
    /// A pool on `pd`, as [`Pool::new`](super::Pool::new): every chunk followed by at least
    /// `slack` bytes (rounded up to 64) only the device writes; one cluster of the smallest
    /// class registered now.
    pub(crate) fn new(pd: &Rc<Pd>, cfg: &PoolConfig, slack: usize) -> Result<IndexPool> {
        IndexPool::make(Some(pd.clone()), cfg, slack)
    }

    /// The same pool with its memory not registered (local keys 0): for the host, where there
    /// is no device (`bench_internals::Path`, tests). Nothing posts from it.
    #[cfg(any(test, feature = "bench-internals"))]
    pub(crate) fn unregistered(cfg: &PoolConfig, slack: usize) -> Result<IndexPool> {
        IndexPool::make(None, cfg, slack)
    }

    fn make(pd: Option<Rc<Pd>>, cfg: &PoolConfig, slack: usize) -> Result<IndexPool> {
        let slack = slack.div_ceil(64) * 64;
        let mut sizes = cfg.chunk_sizes.clone();
        sizes.sort_unstable();
        sizes.dedup();
        // With its slack a chunk's stride is a `u32` (a receive is posted over it).
        if sizes.is_empty() || sizes[0] == 0 || sizes[sizes.len() - 1] > u32::MAX as usize - slack {
            return Err(Error::Config(format!("pool chunk sizes {:?}", cfg.chunk_sizes)));
        }
        let classes = sizes
            .iter()
            .map(|&size| Class {
                chunk_size: size as u32,
                stride: (size + slack) as u32,
                per_cluster: (cfg.cluster_bytes / size).clamp(1, u32::MAX as usize) as u32,
                free: Vec::new(),
                clusters: Vec::new(),
                spare: Vec::new(),
            })
            .collect();
        let state =
            State { classes, chunks: Vec::new(), clusters: Vec::new(), registered: 0, max_bytes: cfg.max_bytes, pd };
        let shared = Box::new(Shared { handles: Cell::new(1), live: Cell::new(0), state: UnsafeCell::new(state) });
        let pool = IndexPool { shared: NonNull::from(Box::leak(shared)) };
        // SAFETY: the handle just made holds the state live; no other borrow exists yet.
        unsafe { Shared::state(pool.shared) }.grow(0)?;
        Ok(pool)
    }

    /// The largest chunk size.
    pub fn max_chunk(&self) -> usize {
        // SAFETY: held live by this handle; the borrow ends here.
        unsafe { Shared::state(self.shared) }.classes.last().map_or(0, |c| c.chunk_size as usize)
    }

    /// Bytes registered.
    pub fn registered_bytes(&self) -> usize {
        // SAFETY: as in `max_chunk`.
        unsafe { Shared::state(self.shared) }.registered
    }

    /// Chunks handed out and not yet back.
    pub fn in_use(&self) -> usize {
        // SAFETY: held live by this handle.
        unsafe { self.shared.as_ref() }.live.get()
    }

    /// True if `n` buffers of `len` bytes can be had now (as [`Pool::room_for`](super::Pool::room_for)).
    pub fn room_for(&self, len: usize, n: usize) -> bool {
        // SAFETY: as in `max_chunk`.
        let st = unsafe { Shared::state(self.shared) };
        let Some(c) = st.classes.iter().find(|c| c.chunk_size as usize >= len) else { return false };
        let bytes = c.stride as usize * c.per_cluster as usize;
        super::clusters_fit(c.free.len(), n, c.per_cluster as usize, bytes, st.registered, st.max_bytes)
    }

    /// Takes a free chunk of the smallest class that holds `len` bytes for `owner` (a
    /// connection's owner id, or [`NO_OWNER`]), registering a new cluster when the class has
    /// none free and the maximum allows. The buffer's length is `len`; bytes of another owner's
    /// in it read as zeros.
    #[inline(always)]
    pub fn alloc(&self, len: usize, owner: u64) -> Result<IndexBuf> {
        // SAFETY: held live by this handle; the borrow ends before returning.
        let st = unsafe { Shared::state(self.shared) };
        // The smallest class first, on its own: what most allocations take.
        let class = match st.classes.first() {
            Some(c) if c.chunk_size as usize >= len => 0,
            _ => match st.classes.iter().position(|c| c.chunk_size as usize >= len) {
                Some(class) => class,
                None => return Err(st.too_large(len)),
            },
        };
        let id = match st.classes[class].free.pop() {
            Some(id) => id,
            None => {
                st.grow(class)?;
                st.classes[class].free.pop().expect("a new cluster has free chunks")
            }
        };
        debug_assert!((id as usize) < st.chunks.len());
        // SAFETY: ids on a class's stack index `chunks` (`grow` pushes only those), which never
        // shrinks.
        let chunk = unsafe { st.chunks.get_unchecked_mut(id as usize) };
        let own = owner != NO_OWNER && chunk.owner == owner;
        chunk.marks = Marks::new(chunk.marks.dirty, own);
        chunk.owner = owner;
        // SAFETY: held live by this handle.
        let s = unsafe { self.shared.as_ref() };
        s.live.set(s.live.get() + 1);
        Ok(IndexBuf { pool: self.shared, chunk: id, len: mark(len) })
    }

    /// Releases clusters whose chunks are all free, except the first cluster of the smallest
    /// class, so a quiet pool returns to one registered region.
    pub fn trim(&self) {
        // SAFETY: held live by this handle; the borrow ends here. Dropping a cluster
        // deregisters and frees memory: it reaches no pool.
        let st = unsafe { Shared::state(self.shared) };
        for ci in 0..st.classes.len() {
            let per = st.classes[ci].per_cluster;
            let bytes = st.classes[ci].stride as usize * per as usize;
            let keep_first = usize::from(ci == 0);
            let mut released = Vec::new();
            for &k in st.classes[ci].clusters.iter().skip(keep_first) {
                let Some(first) = st.clusters[k].as_ref().map(|c| c.first) else { continue };
                let free = st.classes[ci].free.iter().filter(|&&id| id.wrapping_sub(first) < per).count();
                if free == per as usize {
                    released.push((k, first));
                }
            }
            for (k, first) in released {
                st.classes[ci].free.retain(|&id| id.wrapping_sub(first) >= per);
                st.classes[ci].clusters.retain(|&c| c != k);
                st.classes[ci].spare.push(first);
                st.clusters[k] = None;
                st.registered -= bytes;
            }
        }
    }

    /// True when `buf` came from this pool.
    #[inline(always)]
    pub fn owns(&self, buf: &IndexBuf) -> bool {
        buf.pool == self.shared
    }
}

impl State {
    /// The error of an allocation of `len` bytes, above the largest chunk.
    #[cold]
    fn too_large(&self, len: usize) -> Error {
        let max = self.classes.last().map_or(0, |c| c.chunk_size as usize);
        Error::TooLarge { len, max, limit: "the pool's largest chunk, PoolConfig::chunk_sizes (Config::pool)" }
    }

    /// Registers one more cluster of class `ci` and pushes its chunks on the class's stack.
    fn grow(&mut self, ci: usize) -> Result<()> {
        let (chunk_size, stride, per) = {
            let c = &self.classes[ci];
            (c.chunk_size, c.stride, c.per_cluster)
        };
        let bytes = stride as usize * per as usize;
        if self.registered + bytes > self.max_bytes.max(bytes) {
            return Err(Error::PoolExhausted { max_bytes: self.max_bytes });
        }
        let mem = Mem::new(bytes).ok_or(Error::PoolExhausted { max_bytes: self.max_bytes })?;
        let mr = match &self.pd {
            // SAFETY: `mem` is kept in the same `Cluster` as the region and dropped after it
            // (field order), so the memory outlives the registration and never moves.
            Some(pd) => Some(
                unsafe { Mr::register(pd, mem.ptr.as_ptr(), bytes, Access::LOCAL_WRITE) }
                    .map_err(|e| super::super::reg_error(bytes, format!("pool cluster of {bytes} bytes"), e))?,
            ),
            None => None,
        };
        let lkey = mr.as_ref().map_or(0, Mr::lkey);
        let first = match self.classes[ci].spare.pop() {
            Some(first) => first,
            None => {
                let first = u32::try_from(self.chunks.len())
                    .ok()
                    .filter(|f| f.checked_add(per).is_some())
                    .ok_or(Error::PoolExhausted { max_bytes: self.max_bytes })?;
                let blank = Chunk {
                    addr: 0,
                    owner: NO_OWNER,
                    marks: Marks::default(),
                    lkey: 0,
                    cap: chunk_size,
                    stride,
                    class: ci as u32,
                };
                self.chunks.resize(self.chunks.len() + per as usize, blank);
                first
            }
        };
        let base = mem.ptr.as_ptr() as u64;
        for i in 0..per {
            // New memory is zeroed: nobody's bytes, nothing dirty.
            self.chunks[(first + i) as usize] = Chunk {
                addr: base + u64::from(i) * u64::from(stride),
                owner: NO_OWNER,
                marks: Marks::default(),
                lkey,
                cap: chunk_size,
                stride,
                class: ci as u32,
            };
        }
        let k = match self.clusters.iter().position(Option::is_none) {
            Some(k) => k,
            None => {
                self.clusters.push(None);
                self.clusters.len() - 1
            }
        };
        self.clusters[k] = Some(Cluster { _mr: mr, _mem: mem, first });
        self.registered += bytes;
        let class = &mut self.classes[ci];
        class.clusters.push(k);
        // Popped lowest id first.
        class.free.extend((first..first + per).rev());
        Ok(())
    }
}

/// One chunk of registered memory, owned: an index into its pool (the module docs). Returns
/// to its pool when dropped.
///
/// Its bytes are its owner's: those it wrote, those the device wrote for it, and zeros; a
/// chunk's earlier owner's bytes never show through a safe call.
pub struct IndexBuf {
    pool: NonNull<Shared>,
    chunk: u32,
    len: u32,
}

impl fmt::Debug for IndexBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IndexBuf").field("chunk", &self.chunk).field("len", &self.len).finish()
    }
}

impl IndexBuf {
    /// Its chunk in the pool's array, and what it needs of it, through `f` (the state's one
    /// borrow, released when `f` returns).
    #[inline(always)]
    fn with<R>(&self, f: impl FnOnce(&mut Chunk) -> R) -> R {
        // SAFETY: the borrow `chunk` returns ends when `f` returns, and `f` (this module's code)
        // takes no other (the module's discipline).
        f(unsafe { self.chunk() })
    }

    /// Its chunk in the pool's array.
    ///
    /// # Safety
    ///
    /// The reference is the state's one borrow (the module docs' discipline): the caller lets
    /// it go before anything else reaches the state.
    #[allow(clippy::mut_from_ref)]
    #[inline(always)]
    unsafe fn chunk(&self) -> &mut Chunk {
        // SAFETY: this buffer holds the state live (`live`); the caller keeps the borrow
        // discipline. `chunk` indexes `chunks`: an id is handed out only for an element of it
        // (`alloc`, from a class's stack, which `grow` fills with ids below the array's length),
        // and the array never shrinks.
        unsafe {
            let st = Shared::state(self.pool);
            debug_assert!((self.chunk as usize) < st.chunks.len());
            st.chunks.get_unchecked_mut(self.chunk as usize)
        }
    }

    fn base(&self) -> *mut u8 {
        self.with(|c| c.addr) as *mut u8
    }

    /// Bytes of data (what a send sends; what a receive received).
    #[inline(always)]
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// True when `len()` is 0.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes the chunk holds.
    pub fn capacity(&self) -> usize {
        self.with(|c| c.cap) as usize
    }

    /// Sets the data length, up to the capacity. Bytes this owner did not write (or receive)
    /// read as zeros.
    pub fn set_len(&mut self, len: usize) -> Result<()> {
        let cap = self.capacity();
        if len > cap {
            return Err(Error::TooLarge { len, max: cap, limit: "the buffer's capacity (allocate a larger one)" });
        }
        self.len = mark(len);
        Ok(())
    }

    /// Sets the data length without zeroing what an earlier owner may have left.
    ///
    /// # Safety
    ///
    /// As [`Buf::set_len_unchecked`](super::Buf::set_len_unchecked): the caller wrote every byte
    /// of the first `len` it did not write or receive before.
    pub unsafe fn set_len_unchecked(&mut self, len: usize) -> Result<()> {
        self.set_len(len)?;
        self.with(|c| c.marks.written(len));
        Ok(())
    }

    /// The bytes past `len()`, write-only (their contents may be an earlier owner's).
    pub fn spare_capacity_mut(&mut self) -> &mut [std::mem::MaybeUninit<u8>] {
        let (addr, cap) = self.with(|c| {
            c.marks.device_may_write(c.cap as usize);
            (c.addr, c.cap as usize)
        });
        // SAFETY: this buffer owns the chunk exclusively (off the free stack, not posted while
        // reachable here), its memory lives while the buffer does (the pool and the cluster
        // stay while it is out), len <= cap, and `MaybeUninit<u8>` has `u8`'s layout.
        unsafe { std::slice::from_raw_parts_mut((addr as *mut u8).add(self.len()).cast(), cap - self.len()) }
    }

    /// Replaces the contents with `data`.
    pub fn fill_from(&mut self, data: &[u8]) -> Result<()> {
        self.set_len(data.len())?;
        // SAFETY: as in `as_mut_slice`; data.len() == len <= cap; `data` cannot alias the chunk
        // (the only references to it come from this buffer).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.base(), data.len()) };
        self.written(data.len());
        Ok(())
    }

    /// Sets the data (`len()` bytes) to zeros.
    pub fn zero(&mut self) {
        // SAFETY: as in `as_mut_slice`; len <= cap.
        unsafe { std::ptr::write_bytes(self.base(), 0, self.len()) };
        self.written(self.len());
    }

    /// The data. Bytes this owner did not write or receive read as zeros.
    pub fn as_slice(&self) -> &[u8] {
        let base = self.show_at();
        // SAFETY: this buffer owns the chunk exclusively and it is not posted (a posted buffer
        // is held by the reactor, not reachable here); the memory lives while the buffer does;
        // len <= cap.
        unsafe { std::slice::from_raw_parts(base, self.len()) }
    }

    /// The data, mutable. Bytes this owner did not write or receive read as zeros.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let base = self.show_at();
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(base, self.len()) }
    }

    /// The chunk's address.
    #[inline(always)]
    pub(crate) fn addr(&self) -> u64 {
        self.with(|c| c.addr)
    }

    /// The local key of the chunk's registration (0 in an unregistered pool).
    #[inline(always)]
    pub(crate) fn lkey(&self) -> u32 {
        self.with(|c| c.lkey)
    }

    /// Address, length and key of a send of its data, in one look at its chunk.
    #[inline(always)]
    pub(crate) fn send_sge(&self) -> (u64, u32, u32) {
        let len = self.len;
        self.with(|c| (c.addr, len, c.lkey))
    }

    /// Address, length and key of a receive into it: the capacity and the slack after it.
    #[inline(always)]
    pub(crate) fn recv_sge(&self) -> (u64, u32, u32) {
        self.with(|c| (c.addr, c.stride, c.lkey))
    }

    /// Bytes a receive posted on it may take: the capacity and the slack after it.
    pub(crate) fn post_capacity(&self) -> usize {
        self.with(|c| c.stride) as usize
    }

    /// The 4 bytes before offset `n` of a receive that got `n` bytes (a message's tail, which
    /// may lie in the slack). `None` when `n` is under 4 or past the slack.
    pub(crate) fn tail_before(&self, n: usize) -> Option<[u8; 4]> {
        let (addr, stride) = self.with(|c| (c.addr, c.stride as usize));
        let at = n.checked_sub(4).filter(|_| n <= stride)?;
        let mut tail = [0u8; 4];
        // SAFETY: at + 4 <= stride: inside this chunk's stride, which this buffer owns; the
        // device wrote these bytes for the receive whose completion was reaped.
        unsafe { std::ptr::copy_nonoverlapping((addr as *const u8).add(at), tail.as_mut_ptr(), 4) };
        Some(tail)
    }

    /// The first `n` bytes now hold this owner's data.
    #[inline(always)]
    pub(crate) fn written(&mut self, n: usize) {
        self.with(|c| c.marks.written(n.min(c.cap as usize)));
    }

    /// The device wrote `n` bytes for this owner (a receive's completion): they are the data.
    #[inline(always)]
    pub(crate) fn received(&mut self, n: usize) {
        let len = self.with(|c| {
            let n = n.min(c.cap as usize);
            c.marks.written(n);
            n
        });
        self.len = mark(len);
    }

    /// The buffer is used by connection `owner` from now on, which is given its first `keep`
    /// bytes (as [`Buf::set_owner`](super::Buf::set_owner)).
    #[inline(always)]
    pub(crate) fn set_owner(&self, owner: u64, keep: usize) {
        let len = self.len();
        self.with(|c| {
            if c.owner != owner {
                c.marks.change_owner(keep.min(len));
                c.owner = owner;
            }
        });
    }

    /// Submitted on connection `owner` to be sent whole: [`IndexBuf::set_owner`] with its
    /// `len()` bytes, then [`IndexBuf::show`], in one look at its chunk; returns
    /// [`IndexBuf::send_sge`] from the same look.
    #[inline(always)]
    pub(crate) fn mark_send(&self, owner: u64) -> (u64, u32, u32) {
        let len = self.len();
        // SAFETY: the one borrow of the state, let go at the end of this block.
        let (addr, lkey, clear) = unsafe {
            let c = self.chunk();
            if c.owner != owner {
                c.marks.change_owner(len);
                c.owner = owner;
            }
            (c.addr, c.lkey, c.marks.show(len))
        };
        if !clear.is_empty() {
            // SAFETY: as in `show_at`.
            unsafe { std::ptr::write_bytes((addr as *mut u8).add(clear.start), 0, clear.len()) };
        }
        (addr, self.len, lkey)
    }

    /// Submitted on connection `owner` to receive into: [`IndexBuf::set_owner`] with none of
    /// its bytes (the device overwrites them), then the whole chunk lent to the device, in one
    /// look at its chunk; returns [`IndexBuf::recv_sge`] from the same look.
    #[inline(always)]
    pub(crate) fn mark_recv(&mut self, owner: u64) -> (u64, u32, u32) {
        // SAFETY: the one borrow of the state, let go when this function returns (nothing
        // below reaches the state another way).
        let c = unsafe { self.chunk() };
        if c.owner != owner {
            c.marks.change_owner(0);
            c.owner = owner;
        }
        c.marks.device_may_write(c.cap as usize);
        (c.addr, c.stride, c.lkey)
    }

    /// The device may write up to `n` bytes of the chunk (a receive or READ is posted on it).
    #[inline(always)]
    pub(crate) fn lend_to_device(&mut self, n: usize) {
        self.with(|c| c.marks.device_may_write(n.min(c.cap as usize)));
    }

    /// The device may write the whole chunk (a receive is posted on it).
    #[inline(always)]
    pub(crate) fn lend_all_to_device(&mut self) {
        self.with(|c| c.marks.device_may_write(c.cap as usize));
    }

    /// Makes the first `len()` bytes this owner's before anything shows them: zeroes those an
    /// earlier owner may have left.
    #[inline(always)]
    pub(crate) fn show(&self) {
        self.show_at();
    }

    /// [`IndexBuf::show`], returning the chunk's address.
    #[inline(always)]
    fn show_at(&self) -> *mut u8 {
        let len = self.len();
        let (addr, clear) = self.with(|c| (c.addr, c.marks.show(len)));
        let base = addr as *mut u8;
        if !clear.is_empty() {
            // SAFETY: clear.end <= len <= cap, inside the chunk this buffer owns exclusively; the
            // bytes were not yet shown (past `fresh`), so no reference into them exists, and the
            // device reaches them only through a post, which needs this buffer.
            unsafe { std::ptr::write_bytes(base.add(clear.start), 0, clear.len()) };
        }
        base
    }
}

impl Drop for IndexBuf {
    #[inline(always)]
    fn drop(&mut self) {
        // SAFETY: this buffer holds the state live; the borrow ends before the release below,
        // which is this buffer's last use of it.
        unsafe {
            let st = Shared::state(self.pool);
            debug_assert!((self.chunk as usize) < st.chunks.len());
            let chunk = st.chunks.get_unchecked_mut(self.chunk as usize);
            // Whose bytes it holds, for the next owner (its dirty extent is already in `marks`).
            if !chunk.marks.leaves_only_own_bytes() {
                chunk.owner = NO_OWNER;
            }
            let class = &mut st.classes[chunk.class as usize];
            class.free.push(self.chunk);
            let s = self.pool.as_ref();
            let live = s.live.get() - 1;
            s.live.set(live);
            if live == 0 {
                Shared::release_if_unused(self.pool);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(sizes: &[usize], cluster: usize, max: usize) -> IndexPool {
        let cfg =
            PoolConfig { chunk_sizes: sizes.to_vec(), cluster_bytes: cluster, max_bytes: max, ..PoolConfig::default() };
        IndexPool::unregistered(&cfg, 0).expect("a host pool")
    }

    #[test]
    fn a_buffer_is_16_bytes_and_no_rc() {
        assert_eq!(std::mem::size_of::<IndexBuf>(), 16);
        assert_eq!(std::mem::size_of::<Option<IndexBuf>>(), 16, "the pool pointer is its niche");
    }

    #[test]
    fn allocation_pops_and_a_drop_pushes_the_class_stack() {
        let p = pool(&[64, 4096], 4096, 1 << 20);
        let a = p.alloc(10, 1).unwrap();
        let b = p.alloc(64, 1).unwrap();
        let c = p.alloc(65, 1).unwrap();
        assert_eq!((a.capacity(), b.capacity(), c.capacity()), (64, 64, 4096));
        assert_eq!(p.in_use(), 3);
        let (ida, idb) = (a.chunk, b.chunk);
        drop(b);
        drop(a);
        // Last freed, first reused.
        assert_eq!(p.alloc(1, 1).unwrap().chunk, ida);
        assert_eq!(p.in_use(), 1, "the temporary went back at once");
        let again = p.alloc(1, 1).unwrap();
        assert_eq!(again.chunk, ida, "and again");
        let other = p.alloc(1, 1).unwrap();
        assert_eq!(other.chunk, idb);
        assert!(p.owns(&other));
        assert!(!pool(&[64], 4096, 1 << 20).owns(&other), "another pool's buffer");
        assert!(matches!(p.alloc(4097, 1), Err(Error::TooLarge { max: 4096, .. })));
    }

    #[test]
    fn a_class_grows_by_clusters_to_the_maximum_and_trims_back() {
        // 4 chunks a cluster, 3 clusters at most.
        let p = pool(&[1024], 4096, 3 * 4096);
        let bufs: Vec<IndexBuf> = (0..12).map(|_| p.alloc(1, 1).unwrap()).collect();
        assert_eq!(p.registered_bytes(), 3 * 4096);
        assert!(matches!(p.alloc(1, 1), Err(Error::PoolExhausted { .. })));
        assert!(!p.room_for(1, 1));
        drop(bufs);
        assert!(p.room_for(1, 12));
        p.trim();
        assert_eq!(p.registered_bytes(), 4096, "the first cluster stays");
        // The released id ranges are reused, with fresh (zeroed) chunks.
        let bufs: Vec<IndexBuf> = (0..12).map(|_| p.alloc(1, 1).unwrap()).collect();
        let mut ids: Vec<u32> = bufs.iter().map(|b| b.chunk).collect();
        ids.sort_unstable();
        assert_eq!(ids, (0..12).collect::<Vec<_>>());
    }

    #[test]
    fn another_owners_bytes_never_show_and_an_owners_own_do_without_zeroing() {
        let p = pool(&[64], 4096, 1 << 20);
        let mut a = p.alloc(64, 1).unwrap();
        a.fill_from(&[7; 64]).unwrap();
        let id = a.chunk;
        drop(a);
        // Owner 2 gets the chunk: owner 1's bytes read as zeros.
        let mut b = p.alloc(64, 2).unwrap();
        assert_eq!(b.chunk, id);
        assert_eq!(b.as_slice(), &[0; 64][..]);
        b.as_mut_slice()[..4].copy_from_slice(&[1, 2, 3, 4]);
        drop(b);
        // Owner 2 again: its own bytes are there (not foreign to it).
        let c = p.alloc(64, 2).unwrap();
        assert_eq!(&c.as_slice()[..4], &[1, 2, 3, 4]);
        // Passed to connection 3 with only its first 2 bytes: the rest is foreign there.
        let mut c = c;
        c.set_len(2).unwrap();
        c.set_owner(3, 2);
        c.set_len(64).unwrap();
        assert_eq!(&c.as_slice()[..4], &[1, 2, 0, 0]);
    }

    #[test]
    fn a_receive_shows_exactly_what_arrived() {
        let p = pool(&[64], 4096, 1 << 20);
        let mut a = p.alloc(64, 1).unwrap();
        a.fill_from(&[9; 64]).unwrap();
        drop(a);
        let mut r = p.alloc(64, 2).unwrap();
        r.lend_to_device(r.capacity());
        // The device wrote 3 bytes for owner 2 (here by hand, as the device would).
        // SAFETY: the chunk is this buffer's; 3 <= cap.
        unsafe { std::ptr::copy_nonoverlapping([5u8, 6, 7].as_ptr(), r.addr() as *mut u8, 3) };
        r.received(3);
        assert_eq!(r.as_slice(), &[5, 6, 7]);
        r.set_len(8).unwrap();
        assert_eq!(r.as_slice(), &[5, 6, 7, 0, 0, 0, 0, 0], "owner 1's bytes past the message are zeroed");
        assert_eq!(r.tail_before(3), None);
        assert_eq!(r.tail_before(8), Some([0, 0, 0, 0]));
        assert_eq!(r.tail_before(65), None, "past the stride");
    }

    /// A buffer outlives every handle of its pool: the state (and the memory) goes with the
    /// last of them, whichever it is.
    #[test]
    fn the_last_of_the_handles_and_buffers_frees_the_pool() {
        let p = pool(&[64], 4096, 1 << 20);
        let q = p.clone();
        let mut b = p.alloc(8, 1).unwrap();
        drop(p);
        drop(q);
        b.fill_from(b"survives").unwrap();
        assert_eq!(b.as_slice(), b"survives");
        drop(b);
        // And the other way round.
        let p = pool(&[64], 4096, 1 << 20);
        let b = p.alloc(8, 1).unwrap();
        drop(b);
        assert_eq!(p.in_use(), 0);
    }

    #[test]
    fn bad_sizes_are_refused() {
        let cfg = PoolConfig { chunk_sizes: vec![], cluster_bytes: 4096, max_bytes: 1 << 20, ..PoolConfig::default() };
        assert!(IndexPool::unregistered(&cfg, 0).is_err());
        let cfg =
            PoolConfig { chunk_sizes: vec![0, 64], cluster_bytes: 4096, max_bytes: 1 << 20, ..PoolConfig::default() };
        assert!(IndexPool::unregistered(&cfg, 0).is_err());
    }
}
