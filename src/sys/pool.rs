//! The registered buffer pool: large registered clusters carved into fixed-size chunks.
//!
//! After Ceph's RDMA stack (seed 000): a `Cluster` is one allocation registered as one memory
//! region and cut into `chunks_per_cluster` chunks of `chunk_size` bytes; free chunks sit on a
//! free list. The pool grows by whole clusters up to `max_bytes`, and [`Pool::trim`] gives back
//! clusters that are entirely free (except the first), so a quiet server returns to its
//! baseline of memory regions.
//!
//! A [`Buf`] owns one chunk. It is the safe way to hand memory to the device: while a work
//! request uses it, the reactor holds the `Buf`, so user code cannot touch the bytes; it comes
//! back in the completion. A `Buf` keeps its cluster (memory and registration) alive, so a
//! chunk is never deregistered under a posted request.
#![allow(unsafe_code)]

use std::alloc::{self, Layout};
use std::cell::RefCell;
use std::fmt;
use std::ptr::NonNull;
use std::rc::Rc;

use super::verbs::{Access, Mr, Pd};
use crate::error::{Error, Result};

/// Pool sizing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Bytes per chunk: the largest message a pool buffer holds.
    pub chunk_size: usize,
    /// Chunks per registered cluster.
    pub chunks_per_cluster: usize,
    /// Most bytes the pool may register in total.
    pub max_bytes: usize,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig { chunk_size: 64 * 1024, chunks_per_cluster: 64, max_bytes: 512 * 1024 * 1024 }
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

struct Inner {
    cfg: PoolConfig,
    pd: Rc<Pd>,
    clusters: Vec<Option<Rc<Cluster>>>,
    /// Free chunk indexes, per cluster.
    free: Vec<Vec<u32>>,
    in_use: usize,
}

/// A pool of registered chunks on one protection domain.
#[derive(Clone)]
pub struct Pool {
    inner: Rc<RefCell<Inner>>,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = self.inner.borrow();
        f.debug_struct("Pool")
            .field("chunk_size", &i.cfg.chunk_size)
            .field("clusters", &i.clusters.iter().filter(|c| c.is_some()).count())
            .field("in_use", &i.in_use)
            .finish()
    }
}

impl Pool {
    /// A pool on `pd`; registers its first cluster now.
    pub fn new(pd: &Rc<Pd>, cfg: PoolConfig) -> Result<Pool> {
        if cfg.chunk_size == 0 || cfg.chunks_per_cluster == 0 || cfg.chunk_size > u32::MAX as usize {
            return Err(Error::Config(format!(
                "pool chunk size {} and count {}",
                cfg.chunk_size, cfg.chunks_per_cluster
            )));
        }
        let pool = Pool {
            inner: Rc::new(RefCell::new(Inner {
                cfg,
                pd: pd.clone(),
                clusters: Vec::new(),
                free: Vec::new(),
                in_use: 0,
            })),
        };
        pool.inner.borrow_mut().grow()?;
        Ok(pool)
    }

    /// Bytes per chunk.
    pub fn chunk_size(&self) -> usize {
        self.inner.borrow().cfg.chunk_size
    }

    /// Chunks handed out and not yet returned.
    pub fn in_use(&self) -> usize {
        self.inner.borrow().in_use
    }

    /// Registered clusters.
    pub fn clusters(&self) -> usize {
        self.inner.borrow().clusters.iter().filter(|c| c.is_some()).count()
    }

    /// Takes a free chunk, registering a new cluster when all are in use and the maximum
    /// allows.
    pub fn alloc(&self) -> Result<Buf> {
        let mut inner = self.inner.borrow_mut();
        let slot = match inner.free.iter().position(|f| !f.is_empty()) {
            Some(i) => i,
            None => inner.grow()?,
        };
        let chunk = inner.free[slot].pop().expect("grow leaves free chunks");
        inner.in_use += 1;
        let cluster = inner.clusters[slot].clone().expect("a cluster with free chunks is present");
        let size = inner.cfg.chunk_size;
        drop(inner);
        Ok(Buf { pool: self.inner.clone(), cluster, slot: slot as u32, chunk, len: 0, cap: size })
    }

    /// Releases clusters (other than the first) whose chunks are all free.
    pub fn trim(&self) {
        let mut inner = self.inner.borrow_mut();
        let per = inner.cfg.chunks_per_cluster;
        for slot in 1..inner.clusters.len() {
            if inner.clusters[slot].is_some() && inner.free[slot].len() == per {
                inner.clusters[slot] = None;
                inner.free[slot].clear();
            }
        }
    }
}

impl Inner {
    /// Registers one more cluster; returns its slot.
    fn grow(&mut self) -> Result<usize> {
        let cluster_bytes = self.cfg.chunk_size * self.cfg.chunks_per_cluster;
        let live = self.clusters.iter().filter(|c| c.is_some()).count();
        if (live + 1) * cluster_bytes > self.cfg.max_bytes.max(cluster_bytes) {
            return Err(Error::PoolExhausted { max_bytes: self.cfg.max_bytes });
        }
        let mem = Mem::new(cluster_bytes).ok_or(Error::PoolExhausted { max_bytes: self.cfg.max_bytes })?;
        // SAFETY: mem is kept in the same Cluster as the region and is dropped after it (field
        // order), so the memory outlives the registration and never moves.
        let mr = unsafe { Mr::register(&self.pd, mem.ptr.as_ptr(), cluster_bytes, Access::LOCAL_WRITE) }
            .map_err(|e| Error::verb("ibv_reg_mr", format!("pool cluster of {cluster_bytes} bytes"), e))?;
        let cluster = Rc::new(Cluster { mr, mem });
        let chunks: Vec<u32> = (0..self.cfg.chunks_per_cluster as u32).rev().collect();
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
    pool: Rc<RefCell<Inner>>,
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

    /// True when the buffer came from `pool`.
    pub fn is_from(&self, pool: &Pool) -> bool {
        Rc::ptr_eq(&self.pool, &pool.inner)
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        let mut inner = self.pool.borrow_mut();
        inner.in_use -= 1;
        let slot = self.slot as usize;
        // A trimmed cluster has no live Buf, so the slot still names this cluster.
        if inner.clusters[slot].as_ref().is_some_and(|c| Rc::ptr_eq(c, &self.cluster)) {
            inner.free[slot].push(self.chunk);
        }
    }
}
