//! Application memory regions: memory the application owns, of any size, registered on the
//! devices it is used on, and exposed to peers through memory windows.
//!
//! A [`Region`] owns its memory (a `Vec<u8>`, a `Box<[u8]>`, an anonymous mapping, optionally
//! of huge pages, or a mapping the caller hands over) and its registrations: one memory region
//! (MR) per protection domain it is used on, over all of it, with local write and
//! `IBV_ACCESS_MW_BIND` and no remote rights of its own, made on first use; and, for each
//! part of it exposed on its own, an MR of exactly that part (below). The memory is freed only
//! after every registration, and a registration is released only when the last `Region` handle
//! is dropped; every operation and window that uses the region holds a handle, so the memory
//! cannot be freed or deregistered under the device.
//!
//! **Exposure.** A peer reaches a region only through a type-2 memory window bound to its own
//! connection's queue pair ([`RegionWindow`](crate::sys::pool::RegionWindow), made by `Conn::expose_region`). rxe (Linux 6.1,
//! `check_rkey`) checks an access through a window against the range of the window's MR, not
//! of the window, so a window over part of a large MR would give its peer the whole MR: an
//! exposure of the whole region uses the region's MR, and one of a part uses an MR of exactly
//! that part (shared by every exposure of the same part on the same PD).
//!
//! **Sharing and consistency.** The memory may be read and written by peers at any time (one
//! region serves many connections), so the region hands out no Rust references into it:
//! [`Region::read_at`] and [`Region::write_at`] copy. A peer's READ racing a local write (or
//! another peer's WRITE) can return a mix of old and new bytes; see the README's "One-sided
//! access" for the usual remedy (a version word per record, read before and after).
#![allow(unsafe_code)]

use std::any::Any;
use std::cell::RefCell;
use std::fmt;
use std::ops::{Bound, Range, RangeBounds};
use std::ptr::NonNull;
use std::rc::Rc;

use nix::libc;

use super::mr::{Access, Mr};
use super::pd::Pd;
use crate::error::{Error, Result};

/// Where a region's memory came from, and how it is freed.
enum Memory {
    /// A boxed slice (from a `Vec` or a `Box`), held as the raw pointer `Box::into_raw` gave
    /// (no live `Box` asserts unique access while peers and the device write the memory), and
    /// made a `Box` again only to be freed.
    Boxed(NonNull<[u8]>),
    /// An anonymous mapping of `map_len` bytes (`len` rounded up to the huge page size for
    /// `MAP_HUGETLB`, which `munmap` needs), unmapped on drop.
    Mapped { ptr: NonNull<u8>, len: usize, map_len: usize },
    /// Memory the caller handed over with an owner that frees it when dropped.
    Foreign { ptr: NonNull<u8>, len: usize, _owner: Box<dyn Any> },
}

impl Memory {
    fn boxed(b: Box<[u8]>) -> Memory {
        Memory::Boxed(NonNull::from(Box::leak(b)))
    }

    fn ptr(&mut self) -> *mut u8 {
        match self {
            Memory::Boxed(b) => b.as_ptr().cast(),
            Memory::Mapped { ptr, .. } | Memory::Foreign { ptr, .. } => ptr.as_ptr(),
        }
    }

    fn len(&self) -> usize {
        match self {
            Memory::Boxed(b) => b.len(),
            Memory::Mapped { len, .. } | Memory::Foreign { len, .. } => *len,
        }
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        match *self {
            Memory::Boxed(b) => {
                // SAFETY: b came from Box::leak in Memory::boxed and is freed only here, once;
                // nothing refers to it any more (the registrations were released first:
                // RegionInner's field order).
                drop(unsafe { Box::from_raw(b.as_ptr()) });
            }
            Memory::Mapped { ptr, map_len, .. } => {
                // SAFETY: mapped by Region::mapped with this length, unmapped once; nothing
                // refers to it any more (as above).
                let rc = unsafe { libc::munmap(ptr.as_ptr().cast(), map_len) };
                debug_assert_eq!(rc, 0, "munmap of a region's mapping: {}", std::io::Error::last_os_error());
            }
            Memory::Foreign { .. } => {}
        }
    }
}

/// The system's default huge page size (`Hugepagesize` in `/proc/meminfo`), the unit of a
/// `MAP_HUGETLB` mapping.
fn huge_page_size() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("Hugepagesize:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024).filter(|&n| n > 0)
}

/// One registration of (part of) a region on a protection domain.
struct Registration {
    /// The PD's address (identity only).
    pd: usize,
    range: Range<usize>,
    mr: Mr,
}

/// Field order is drop order: the registrations are released before the memory is freed.
struct RegionInner {
    regs: RefCell<Vec<Registration>>,
    /// Start address and length (fixed: the memory never moves).
    addr: usize,
    len: usize,
    _mem: Memory,
}

/// Memory the application owns, of any size, usable in operations and exposable to peers
/// without copying (module docs of `sys/region.rs` in ARCHITECTURE.md's terms: one MR per
/// device for the whole region, shared by every connection).
///
/// A `Region` is a cheap handle (`Clone` shares it, like an `Rc`); the memory and its
/// registrations live until the last handle, and every operation or window using it holds
/// one. It belongs to the reactor's thread (`!Send`).
///
/// Use it with [`Op::send_region`](crate::Op::send_region),
/// [`Op::recv_region`](crate::Op::recv_region), [`Op::write_region`](crate::Op::write_region),
/// [`Op::read_region`](crate::Op::read_region) (slices of it, no copy) and
/// [`Conn::expose_region`](crate::Conn::expose_region) (one window per connection over the
/// same memory). It is registered on a device at first use there (or with
/// [`Conn::register_region`](crate::Conn::register_region) ahead of time).
///
/// The memory can change under the caller at any time (peers READ and WRITE it; receives and
/// READs land in it), so the region hands out no references into it: [`read_at`](Region::read_at)
/// and [`write_at`](Region::write_at) copy.
#[derive(Clone)]
pub struct Region {
    inner: Rc<RegionInner>,
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region")
            .field("len", &self.inner.len)
            .field("registrations", &self.inner.regs.borrow().len())
            .finish()
    }
}

/// An empty `Vec` makes an empty region, which cannot be registered or sliced (every use of
/// it fails with [`Error::Config`]).
impl From<Vec<u8>> for Region {
    fn from(v: Vec<u8>) -> Region {
        Region::new(Memory::boxed(v.into_boxed_slice()))
    }
}

/// An empty `Box` makes an empty region, as an empty `Vec` does.
impl From<Box<[u8]>> for Region {
    fn from(b: Box<[u8]>) -> Region {
        Region::new(Memory::boxed(b))
    }
}

impl Region {
    fn new(mut mem: Memory) -> Region {
        let (addr, len) = (mem.ptr() as usize, mem.len());
        Region { inner: Rc::new(RegionInner { regs: RefCell::new(Vec::new()), addr, len, _mem: mem }) }
    }

    /// `len` zeroed bytes of anonymous memory (`mmap`), page-aligned.
    ///
    /// # Errors
    ///
    /// [`Error::Os`] when the mapping fails; [`Error::Config`] for a zero length.
    pub fn zeroed(len: usize) -> Result<Region> {
        Region::mapped(len, 0)
    }

    /// `len` zeroed bytes of anonymous memory on huge pages (`MAP_HUGETLB`, the system's
    /// default huge page size; `len` is rounded up to it by the kernel).
    ///
    /// # Errors
    ///
    /// [`Error::Os`] when no huge pages can be had (`vm.nr_hugepages` is 0, or too few are
    /// free): the error says so.
    pub fn huge_pages(len: usize) -> Result<Region> {
        Region::mapped(len, libc::MAP_HUGETLB)
    }

    fn mapped(len: usize, extra: libc::c_int) -> Result<Region> {
        if len == 0 {
            return Err(Error::Config("a region needs at least one byte".into()));
        }
        let map_len = if extra & libc::MAP_HUGETLB != 0 {
            let page = huge_page_size().ok_or_else(|| {
                Error::Config("no huge page size in /proc/meminfo (Hugepagesize): no huge pages here".into())
            })?;
            len.checked_next_multiple_of(page).ok_or_else(|| Error::TooLarge {
                len,
                max: usize::MAX - page,
                limit: "the address space",
            })?
        } else {
            len
        };
        // SAFETY: an anonymous private mapping of `len` bytes at an address the kernel picks;
        // no existing memory is touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | extra,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            let call = if extra & libc::MAP_HUGETLB != 0 {
                "mmap (MAP_HUGETLB: are huge pages reserved? vm.nr_hugepages)"
            } else {
                "mmap"
            };
            return Err(Error::Os { call, source: std::io::Error::last_os_error() });
        }
        let ptr = NonNull::new(p.cast::<u8>()).expect("mmap returned MAP_FAILED or an address");
        Ok(Region::new(Memory::Mapped { ptr, len, map_len }))
    }

    /// A region over memory the caller already has (an `mmap`ed file, shared memory, ...),
    /// freed by dropping `owner` once the region and everything using it are gone.
    ///
    /// # Safety
    ///
    /// `ptr..ptr+len` must be valid for reads and writes, must not move, and must stay
    /// allocated until `owner` is dropped; nothing else may free it. Others may read and write
    /// it concurrently only as a peer may (the region makes no references into it).
    pub unsafe fn from_raw_parts(ptr: NonNull<u8>, len: usize, owner: Box<dyn Any>) -> Region {
        Region::new(Memory::Foreign { ptr, len, _owner: owner })
    }

    /// Bytes in the region.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// True for a region of no bytes.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// The part `range` of the region, for an operation or an exposure.
    ///
    /// # Errors
    ///
    /// [`Error::TooLarge`] when the range reaches past the region's end; [`Error::Config`] for
    /// an empty or reversed range.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<RegionSlice> {
        let start = match range.start_bound() {
            Bound::Included(&s) => s,
            Bound::Excluded(&s) => s.saturating_add(1),
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(&e) => e.saturating_add(1),
            Bound::Excluded(&e) => e,
            Bound::Unbounded => self.len(),
        };
        if end > self.len() {
            return Err(Error::TooLarge { len: end, max: self.len(), limit: "the region's length" });
        }
        if start >= end {
            return Err(Error::Config(format!("an empty or reversed region slice {start}..{end}")));
        }
        if end - start > u32::MAX as usize {
            return Err(Error::TooLarge {
                len: end - start,
                max: u32::MAX as usize,
                limit: "one work request's length (32 bits)",
            });
        }
        Ok(RegionSlice { region: self.clone(), range: start..end })
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => {
                Err(Error::TooLarge { len: offset.saturating_add(len), max: self.len(), limit: "the region's length" })
            }
        }
    }

    /// Copies `dst.len()` bytes at `offset` out of the region.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len())?;
        // SAFETY: in bounds (checked); the memory lives while self does; a raw copy makes no
        // reference to memory the device or a peer may be writing.
        unsafe { std::ptr::copy_nonoverlapping((self.inner.addr + offset) as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies `src` into the region at `offset`. Allowed while peers read it: a READ racing
    /// this copy may see part of it (module docs).
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len())?;
        // SAFETY: as in read_at; `src` cannot alias the region (the region hands out no
        // references into itself).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), (self.inner.addr + offset) as *mut u8, src.len()) };
        Ok(())
    }

    /// Memory registrations this region holds now (over all devices; one per device for its
    /// whole, plus one per part exposed on its own).
    pub fn registrations(&self) -> usize {
        self.inner.regs.borrow().len()
    }

    pub(crate) fn addr(&self) -> u64 {
        self.inner.addr as u64
    }

    /// The MR over `range` on `pd`, registered now if it is not yet (local write and window
    /// binding, no remote rights). Returns its local key and raw MR.
    pub(crate) fn registration(&self, pd: &Rc<Pd>, range: Range<usize>) -> Result<(u32, *mut rdma_sys::ibv_mr)> {
        if range.is_empty() {
            return Err(Error::Config("an empty region cannot be registered (it needs at least one byte)".into()));
        }
        let id = Rc::as_ptr(pd) as usize;
        let mut regs = self.inner.regs.borrow_mut();
        if let Some(r) = regs.iter().find(|r| r.pd == id && r.range == range) {
            return Ok((r.mr.lkey(), r.mr.as_ptr()));
        }
        let len = range.len();
        // SAFETY: the range lies in the region's memory, which never moves and is freed only
        // after every registration (RegionInner's field order).
        let mr = unsafe {
            Mr::register(pd, (self.inner.addr + range.start) as *mut u8, len, Access::LOCAL_WRITE | Access::MW_BIND)
        }
        .map_err(|e| super::reg_error(len, format!("an application region of {len} bytes"), e))?;
        let out = (mr.lkey(), mr.as_ptr());
        regs.push(Registration { pd: id, range, mr });
        Ok(out)
    }

    /// The local key of the MR over the whole region on `pd` (registered on first use).
    pub(crate) fn lkey(&self, pd: &Rc<Pd>) -> Result<u32> {
        self.registration(pd, 0..self.len()).map(|(lkey, _)| lkey)
    }
}

/// A part of a [`Region`], the memory of one operation or exposure. Holds the region.
#[derive(Clone, Debug)]
pub struct RegionSlice {
    region: Region,
    range: Range<usize>,
}

impl RegionSlice {
    /// The region it is part of.
    pub fn region(&self) -> &Region {
        &self.region
    }

    /// Its bytes' offsets in the region.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// Its length in bytes (at least 1).
    pub fn len(&self) -> usize {
        self.range.len()
    }

    /// Always false: a slice holds at least one byte.
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    /// The address of its first byte.
    pub(crate) fn addr(&self) -> u64 {
        self.region.addr() + self.range.start as u64
    }
}
