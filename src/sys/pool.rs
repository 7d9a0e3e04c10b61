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
#![allow(unsafe_code)]

use std::alloc::{self, Layout};
use std::cell::{Cell, RefCell};
use std::fmt;
use std::ptr::NonNull;
use std::rc::Rc;

use super::mr::{Access, Mr};
use super::pd::Pd;
use crate::error::{Error, Result};
use crate::proto::op::RemoteAccess;
use crate::proto::wire::RemoteSlice;

/// Pool sizing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Chunk sizes of the size classes, ascending. A buffer comes from the smallest class that
    /// fits the length asked for; the largest is the largest pool message.
    pub chunk_sizes: Vec<usize>,
    /// Bytes registered per cluster (a cluster holds at least one chunk).
    pub cluster_bytes: usize,
    /// Most bytes the pool may register in total, over all classes.
    pub max_bytes: usize,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            chunk_sizes: vec![4096, 64 * 1024, 1024 * 1024],
            cluster_bytes: 4 * 1024 * 1024,
            max_bytes: 1024 * 1024 * 1024,
        }
    }
}

impl PoolConfig {
    /// The largest chunk: the largest message a pool buffer holds.
    pub fn max_chunk(&self) -> usize {
        self.chunk_sizes.iter().copied().max().unwrap_or(0)
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
}

/// One size class: clusters of equal chunks, with per-cluster free lists.
struct Class {
    chunk_size: usize,
    per_cluster: usize,
    pd: Rc<Pd>,
    clusters: Vec<Option<Rc<Cluster>>>,
    free: Vec<Vec<u32>>,
    in_use: usize,
    /// Bytes registered by every class of the pool, shared.
    registered: Rc<Cell<usize>>,
    max_bytes: usize,
}

/// A pool of registered chunks, in size classes, on one protection domain.
#[derive(Clone)]
pub struct Pool {
    classes: Vec<Rc<RefCell<Class>>>,
    registered: Rc<Cell<usize>>,
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
    /// A pool on `pd`; registers one cluster of the smallest class now.
    pub fn new(pd: &Rc<Pd>, cfg: &PoolConfig) -> Result<Pool> {
        let mut sizes = cfg.chunk_sizes.clone();
        sizes.sort_unstable();
        sizes.dedup();
        if sizes.is_empty() || sizes[0] == 0 || sizes[sizes.len() - 1] > u32::MAX as usize {
            return Err(Error::Config(format!("pool chunk sizes {:?}", cfg.chunk_sizes)));
        }
        let registered = Rc::new(Cell::new(0));
        let classes = sizes
            .iter()
            .map(|&chunk_size| {
                Rc::new(RefCell::new(Class {
                    chunk_size,
                    per_cluster: (cfg.cluster_bytes / chunk_size).max(1),
                    pd: pd.clone(),
                    clusters: Vec::new(),
                    free: Vec::new(),
                    in_use: 0,
                    registered: registered.clone(),
                    max_bytes: cfg.max_bytes,
                }))
            })
            .collect();
        let pool = Pool { classes, registered };
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

    /// Takes a free chunk of the smallest class that holds `len` bytes, registering a new
    /// cluster when that class has none free and the maximum allows. The buffer's length is
    /// `len`.
    pub fn alloc(&self, len: usize) -> Result<Buf> {
        let class = self
            .classes
            .iter()
            .find(|c| c.borrow().chunk_size >= len)
            .ok_or(Error::TooLarge { len, max: self.max_chunk() })?;
        let mut inner = class.borrow_mut();
        let slot = match inner.free.iter().position(|f| !f.is_empty()) {
            Some(i) => i,
            None => inner.grow()?,
        };
        let chunk = inner.free[slot].pop().expect("grow leaves free chunks");
        inner.in_use += 1;
        let cluster = inner.clusters[slot].clone().expect("a cluster with free chunks is present");
        let cap = inner.chunk_size;
        drop(inner);
        Ok(Buf {
            class: class.clone(),
            cluster,
            slot: slot as u32,
            chunk,
            len,
            cap,
            pool: Rc::as_ptr(&self.registered) as usize,
        })
    }

    /// Releases clusters whose chunks are all free, except the first cluster of the smallest
    /// class, so a quiet pool returns to one registered region.
    pub fn trim(&self) {
        for (i, class) in self.classes.iter().enumerate() {
            let mut c = class.borrow_mut();
            let per = c.per_cluster;
            let bytes = per * c.chunk_size;
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
        buf.pool == Rc::as_ptr(&self.registered) as usize
    }
}

impl Class {
    /// Registers one more cluster; returns its slot.
    fn grow(&mut self) -> Result<usize> {
        let cluster_bytes = self.chunk_size * self.per_cluster;
        if self.registered.get() + cluster_bytes > self.max_bytes.max(cluster_bytes) {
            return Err(Error::PoolExhausted { max_bytes: self.max_bytes });
        }
        let mem = Mem::new(cluster_bytes).ok_or(Error::PoolExhausted { max_bytes: self.max_bytes })?;
        // SAFETY: mem is kept in the same Cluster as the region and is dropped after it (field
        // order), so the memory outlives the registration and never moves.
        let mr = unsafe { Mr::register(&self.pd, mem.ptr.as_ptr(), cluster_bytes, Access::LOCAL_WRITE) }
            .map_err(|e| super::reg_error(cluster_bytes, format!("pool cluster of {cluster_bytes} bytes"), e))?;
        self.registered.set(self.registered.get() + cluster_bytes);
        let cluster = Rc::new(Cluster { mr, mem });
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

/// One chunk of registered memory, owned. Returns to its pool when dropped.
pub struct Buf {
    class: Rc<RefCell<Class>>,
    /// Identity of the pool (the address of its shared byte counter).
    pool: usize,
    cluster: Rc<Cluster>,
    slot: u32,
    chunk: u32,
    len: usize,
    cap: usize,
}

impl fmt::Debug for Buf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buf").field("slot", &self.slot).field("chunk", &self.chunk).field("len", &self.len).finish()
    }
}

impl Buf {
    fn base(&self) -> *mut u8 {
        // SAFETY: chunk < chunks_per_cluster, so the offset stays inside the allocation.
        unsafe { self.cluster.mem.ptr.as_ptr().add(self.chunk as usize * self.cap) }
    }

    /// Bytes of data (what a send sends; what a receive received).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when `len()` is 0.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes the chunk holds.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Sets the data length, up to the capacity (new bytes keep the chunk's old contents).
    pub fn set_len(&mut self, len: usize) -> Result<()> {
        if len > self.cap {
            return Err(Error::TooLarge { len, max: self.cap });
        }
        self.len = len;
        Ok(())
    }

    /// Replaces the contents with `data`.
    pub fn fill_from(&mut self, data: &[u8]) -> Result<()> {
        self.set_len(data.len())?;
        self.as_mut_slice().copy_from_slice(data);
        Ok(())
    }

    /// The data.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: this Buf owns the chunk exclusively (it is off the free list) and it is not
        // posted (a posted Buf is held by the reactor, not reachable here); the memory lives
        // while self.cluster does; len <= cap.
        unsafe { std::slice::from_raw_parts(self.base(), self.len) }
    }

    /// The data, mutable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice, and &mut self makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.base(), self.len) }
    }

    pub(crate) fn addr(&self) -> u64 {
        self.base() as u64
    }

    pub(crate) fn lkey(&self) -> u32 {
        self.cluster.mr.lkey()
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        let mut inner = self.class.borrow_mut();
        inner.in_use -= 1;
        let slot = self.slot as usize;
        // A trimmed cluster has no live Buf, so the slot still names this cluster.
        if inner.clusters[slot].as_ref().is_some_and(|c| Rc::ptr_eq(c, &self.cluster)) {
            inner.free[slot].push(self.chunk);
        }
    }
}

impl Buf {
    /// Exposes this chunk to peers with exactly `access`: registers a memory region over the
    /// chunk alone, with local write and the remote rights asked for, nothing wider.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for an empty `access`; [`Error::Verb`] when `ibv_reg_mr` fails.
    pub fn expose(self, access: RemoteAccess) -> Result<Exposed> {
        if access.is_empty() {
            return Err(Error::Config("exposing memory needs READ, WRITE or both".into()));
        }
        let mut flags = Access::LOCAL_WRITE;
        if access.contains(RemoteAccess::READ) {
            flags |= Access::REMOTE_READ;
        }
        if access.contains(RemoteAccess::WRITE) {
            flags |= Access::REMOTE_WRITE;
        }
        let pd = self.class.borrow().pd.clone();
        // SAFETY: the chunk stays allocated while `Exposed` holds this Buf, and `Exposed`
        // declares the region before the Buf, so the region is deregistered first.
        let mr = unsafe { Mr::register(&pd, self.base(), self.cap, flags) }
            .map_err(|e| super::reg_error(self.cap, format!("exposing {} bytes ({access:?})", self.cap), e))?;
        Ok(Exposed { mr, buf: self, access })
    }
}

/// A pool chunk peers may read or write (an RDMA READ or WRITE target), through its own
/// memory region with exactly the rights it was exposed with.
///
/// Peers may write it at any time, so it hands out no references into it: [`read_at`] and
/// [`write_at`] copy. Dropping it (or [`into_buf`]) deregisters the region first, so the key
/// stops working before the chunk is reused.
///
/// [`read_at`]: Exposed::read_at
/// [`write_at`]: Exposed::write_at
/// [`into_buf`]: Exposed::into_buf
pub struct Exposed {
    // Field order is drop order: the region goes before the chunk.
    mr: Mr,
    buf: Buf,
    access: RemoteAccess,
}

impl fmt::Debug for Exposed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Exposed").field("remote", &self.remote()).field("access", &self.access).finish()
    }
}

impl Exposed {
    /// The descriptor a peer needs: address, length (the chunk's capacity) and remote key.
    pub fn remote(&self) -> RemoteSlice {
        RemoteSlice { addr: self.buf.addr(), len: self.buf.cap as u32, rkey: self.mr.rkey() }
    }

    /// The rights peers have.
    pub fn access(&self) -> RemoteAccess {
        self.access
    }

    /// Bytes the region covers.
    pub fn capacity(&self) -> usize {
        self.buf.cap
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.buf.cap => Ok(()),
            _ => Err(Error::TooLarge { len: offset.saturating_add(len), max: self.buf.cap }),
        }
    }

    /// Copies `dst.len()` bytes at `offset` out of the region.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len())?;
        // SAFETY: in bounds (checked); the chunk is alive while self holds it; a raw copy makes
        // no reference to memory a peer may be writing.
        unsafe { std::ptr::copy_nonoverlapping(self.buf.base().add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies `src` into the region at `offset`.
    pub fn write_at(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len())?;
        // SAFETY: as in read_at.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.buf.base().add(offset), src.len()) };
        Ok(())
    }

    /// Revokes the peers' access (deregisters the region) and gives the chunk back.
    pub fn into_buf(self) -> Buf {
        let Exposed { mr, buf, .. } = self;
        drop(mr);
        buf
    }
}
