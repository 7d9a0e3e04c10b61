//! Exposing pool memory to one connection's peer (`pool/mod.rs` says why the region is exactly
//! the window): [`Exposed`] (a pool buffer), [`RegionWindow`] (a slice of an application
//! [`Region`]), the shared [`Window`] state the reactor's bind operation holds, and the
//! connection's [`Windows`], released when the connection is destroyed.

#![allow(unsafe_code)]

use std::cell::RefCell;
use std::fmt;
use std::rc::Rc;

use super::Buf;
use crate::error::{Error, Result};
use crate::proto::op::RemoteAccess;
use crate::proto::wire::RemoteSlice;
use crate::sys::mr::{Access, Mr};
use crate::sys::mw::{next_rkey, Mw};
use crate::sys::pd::Pd;
use crate::sys::qp::Bind;
use crate::sys::region::{Region, RegionSlice};

/// A window's shared state: the memory window, and the chunk once its [`Exposed`] is gone
/// while the bind is still queued or in flight.
///
/// Held by the [`Exposed`], by the reactor's bind operation until its completion (or its
/// cancellation after the queue pair is destroyed), and weakly by the connection
/// ([`Windows`]), which releases the memory window when it is destroyed.
pub(crate) struct Window {
    // Drop order: the memory window is deallocated (peers lose access) and its region
    // deregistered before the parked chunk goes back to the pool.
    binding: RefCell<Option<Binding>>,
    parked: RefCell<Option<Buf>>,
    /// `None` for an exposure by registration ([`Exposure::Registration`]): nothing to bind.
    bind: Option<Bind>,
}

/// How memory is exposed to one connection's peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Exposure {
    /// A type-2 memory window bound to the connection's queue pair: its key works on that
    /// queue pair only.
    Window,
    /// A memory region of its own with the remote rights, for a device without memory
    /// windows (iWARP), opted into with `Config::exposure_registration`: its key works from
    /// any queue pair on the device's protection domain, so any connection of the reactor on
    /// that device could use it while it lives.
    Registration,
}

fn remote_rights(access: RemoteAccess) -> Access {
    let mut rights = Access::empty();
    if access.contains(RemoteAccess::READ) {
        rights |= Access::REMOTE_READ;
    }
    if access.contains(RemoteAccess::WRITE) {
        rights |= Access::REMOTE_WRITE;
    }
    rights
}

/// A memory window and the memory region under it. Field order is drop order: rdma-core
/// refuses to deregister a region with a window bound to it.
struct Binding {
    _mw: Option<Mw>,
    _mem: Under,
}

/// What a window's memory region belongs to (held for its `Drop` only).
#[allow(dead_code)]
enum Under {
    /// A region of its own, over exactly one pool chunk's exposed bytes.
    Chunk(Mr),
    /// An application region, which owns the MR (and keeps it, and the memory, while this
    /// handle lives).
    Region(Region),
    /// A region of its own with remote rights ([`Exposure::Registration`]), over a pool
    /// chunk's exposed bytes or (then the application region too, after it: deregistered
    /// first) a slice of an application region.
    Registered(Mr, Option<Region>),
}

impl Window {
    /// The bind work request, while the memory window exists.
    pub(crate) fn bind(&self) -> Option<Bind> {
        self.binding.borrow().as_ref().and(self.bind)
    }

    /// Deallocates the memory window and deregisters its region: peers lose access at once.
    /// Idempotent.
    fn release(&self) {
        drop(self.binding.borrow_mut().take());
    }

    fn is_released(&self) -> bool {
        self.binding.borrow().is_none()
    }
}

/// The windows exposed on one connection, released when it is destroyed, before its queue
/// pair, even while their [`Exposed`] handles live on.
///
/// Before the queue pair: a bound type-2 window holds a reference to its queue pair in rxe,
/// and destroying the queue pair first makes the kernel wait for it (and warn).
#[derive(Default)]
pub(crate) struct Windows(Vec<std::rc::Weak<Window>>);

impl Windows {
    /// Records a window; forgets those already gone.
    pub(crate) fn add(&mut self, w: &Rc<Window>) {
        self.0.retain(|w| w.strong_count() > 0);
        self.0.push(Rc::downgrade(w));
    }

    /// Deallocates every window (and its region): the peer loses access to all of them.
    pub(crate) fn release(&mut self) {
        for w in self.0.drain(..) {
            if let Some(w) = w.upgrade() {
                w.release();
            }
        }
    }
}

impl Drop for Windows {
    fn drop(&mut self) {
        self.release();
    }
}

/// Pool memory a peer may read or write (an RDMA READ or WRITE target), made by
/// [`Conn::expose`](crate::Conn::expose): a type-2 memory window over exactly the buffer's
/// `len()` bytes (and a memory region of just those bytes under it), with exactly the rights
/// asked for, bound to that connection's queue pair.
/// Its [`remote`](Exposed::remote) descriptor works on that connection only: from any other
/// queue pair, or past the window's end, a peer's request fails with a remote access error.
///
/// Exposed bytes hold only what the owner put there (bytes of the chunk's earlier use read as
/// zeros, `Buf`'s rule): it shows the peer nothing else.
///
/// Peers may write it at any time, so it hands out no references into it: [`read_at`] and
/// [`write_at`] copy. Dropping it deallocates the memory window before the chunk goes back to
/// the pool (should its bind still be in flight, when the bind completes). Destroying the
/// connection deallocates the window (and deregisters its region) too; the `Exposed` then only
/// holds the chunk.
///
/// [`read_at`]: Exposed::read_at
/// [`write_at`]: Exposed::write_at
pub struct Exposed {
    /// `Some` until dropped.
    buf: Option<Buf>,
    win: Rc<Window>,
    remote: RemoteSlice,
    access: RemoteAccess,
}

impl fmt::Debug for Exposed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Exposed")
            .field("remote", &self.remote)
            .field("access", &self.access)
            .field("released", &self.win.is_released())
            .finish()
    }
}

impl Exposed {
    /// A window over `buf`'s `len()` bytes with `access`, not yet bound: clears the bytes an
    /// earlier owner may have left, registers a region over exactly those bytes and allocates
    /// the memory window. The reactor posts the returned window's bind on the connection's
    /// send queue.
    pub(crate) fn new(buf: Buf, access: RemoteAccess, how: Exposure) -> Result<(Exposed, Rc<Window>)> {
        if access.is_empty() {
            return Err(Error::Config("exposing memory needs READ, WRITE or both".into()));
        }
        if buf.is_empty() {
            return Err(Error::Config("cannot expose an empty buffer".into()));
        }
        buf.show();
        let pd = buf.class.borrow().pd.clone();
        if how == Exposure::Registration {
            // SAFETY: as below; the region is released with the window.
            let mr = unsafe { Mr::register(&pd, buf.base(), buf.len(), Access::LOCAL_WRITE | remote_rights(access)) }
                .map_err(|e| {
                crate::sys::reg_error(buf.len(), format!("exposing {} bytes ({access:?})", buf.len()), e)
            })?;
            let remote = RemoteSlice { addr: buf.addr(), len: buf.len() as u32, rkey: mr.rkey() };
            let binding = Binding { _mw: None, _mem: Under::Registered(mr, None) };
            let win = Rc::new(Window { binding: RefCell::new(Some(binding)), parked: RefCell::new(None), bind: None });
            return Ok((Exposed { buf: Some(buf), win: win.clone(), remote, access }, win));
        }
        // SAFETY: the chunk stays allocated while the region lives: the region is released
        // (with the window, before it) by `Window::release` or the window's drop, and the chunk
        // is held until then by the `Exposed` or, once that is dropped, by the window itself.
        let mr = unsafe { Mr::register(&pd, buf.base(), buf.len(), Access::LOCAL_WRITE | Access::MW_BIND) }
            .map_err(|e| crate::sys::reg_error(buf.len(), format!("exposing {} bytes ({access:?})", buf.len()), e))?;
        let mw =
            Mw::alloc(&pd).map_err(|e| Error::verb("ibv_alloc_mw", "a type-2 memory window to expose memory", e))?;
        let rights = remote_rights(access);
        let rkey = next_rkey(mw.rkey());
        let bind =
            Bind { mw: mw.as_ptr(), rkey, mr: mr.as_ptr(), addr: buf.addr(), len: buf.len() as u64, access: rights };
        let remote = RemoteSlice { addr: buf.addr(), len: buf.len() as u32, rkey };
        let binding = Binding { _mw: Some(mw), _mem: Under::Chunk(mr) };
        let win =
            Rc::new(Window { binding: RefCell::new(Some(binding)), parked: RefCell::new(None), bind: Some(bind) });
        Ok((Exposed { buf: Some(buf), win: win.clone(), remote, access }, win))
    }

    fn buf(&self) -> &Buf {
        self.buf.as_ref().expect("present until dropped")
    }

    /// The descriptor the peer needs: address, length (the bytes exposed) and remote key. It
    /// works only on the connection the memory was exposed to.
    pub fn remote(&self) -> RemoteSlice {
        self.remote
    }

    /// The rights the peer has.
    pub fn access(&self) -> RemoteAccess {
        self.access
    }

    /// Bytes the window covers: the buffer's `len()` when it was exposed.
    pub fn len(&self) -> usize {
        self.remote.len as usize
    }

    /// Always false: an empty buffer cannot be exposed.
    pub fn is_empty(&self) -> bool {
        self.remote.len == 0
    }

    /// True once the peer's access is gone: the connection was destroyed.
    pub fn is_released(&self) -> bool {
        self.win.is_released()
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(Error::TooLarge {
                len: offset.saturating_add(len),
                max: self.len(),
                limit: "the exposed length (the buffer's len() when exposed)",
            }),
        }
    }

    /// Copies `dst.len()` bytes at `offset` out of the window.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len())?;
        // SAFETY: in bounds (checked); the chunk is alive while self holds it; a raw copy makes
        // no reference to memory a peer may be writing.
        unsafe { std::ptr::copy_nonoverlapping(self.buf().base().add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies `src` into the window at `offset`.
    pub fn write_at(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len())?;
        // SAFETY: as in read_at.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.buf().base().add(offset), src.len()) };
        Ok(())
    }

    /// Revokes the peer's access (deallocates the memory window) and gives the buffer back,
    /// with the window's bytes.
    ///
    /// # Errors
    ///
    /// The `Exposed` itself, unchanged, while the window's bind is still queued or in flight
    /// (the tick it was exposed in, or until its completion): the chunk cannot be reused before
    /// the bind is done. Try again from a later callback, or drop it (then the chunk returns to
    /// the pool once the bind is done).
    pub fn into_buf(mut self) -> std::result::Result<Buf, Exposed> {
        if Rc::strong_count(&self.win) > 1 {
            return Err(self);
        }
        self.win.release();
        Ok(self.buf.take().expect("present until dropped"))
    }
}

impl Drop for Exposed {
    fn drop(&mut self) {
        // The chunk waits in the window; when the last holder (this, or the bind operation)
        // lets go, the window's Drop deallocates the memory window, then frees the chunk.
        if let Some(buf) = self.buf.take() {
            *self.win.parked.borrow_mut() = Some(buf);
        }
    }
}

/// Part of an application [`Region`] a peer may read or write, made by
/// [`Conn::expose_region`](crate::Conn::expose_region): a type-2 memory window over exactly
/// that part, with exactly the rights asked for, bound to that connection's queue pair. Many
/// connections can each have one over the same memory; each descriptor
/// ([`remote`](RegionWindow::remote)) works on its own connection only: from any other queue
/// pair, or past the window's end, a peer's request fails with a remote access error.
///
/// Dropping it deallocates the memory window (should its bind still be in flight, when the
/// bind completes); so does the end of its connection. The region's memory stays the
/// application's throughout ([`Region::read_at`], [`Region::write_at`]).
pub struct RegionWindow {
    win: Rc<Window>,
    remote: RemoteSlice,
    access: RemoteAccess,
}

impl fmt::Debug for RegionWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegionWindow")
            .field("remote", &self.remote)
            .field("access", &self.access)
            .field("released", &self.win.is_released())
            .finish()
    }
}

impl RegionWindow {
    /// A window over `slice` with `access`, not yet bound, on `pd`: the MR under it is the
    /// region's over exactly the slice (made now if needed; module docs of `region.rs` on why
    /// exactly). The reactor posts the returned window's bind on the connection's send queue.
    pub(crate) fn new(
        slice: &RegionSlice,
        pd: &Rc<Pd>,
        access: RemoteAccess,
        how: Exposure,
    ) -> Result<(RegionWindow, Rc<Window>)> {
        if access.is_empty() {
            return Err(Error::Config("exposing memory needs READ, WRITE or both".into()));
        }
        if how == Exposure::Registration {
            let (addr, len) = (slice.addr(), slice.len());
            // SAFETY: the slice lies in the region's memory, which never moves and is freed
            // only after this registration: the binding holds the region after the MR.
            let mr = unsafe { Mr::register(pd, addr as *mut u8, len, Access::LOCAL_WRITE | remote_rights(access)) }
                .map_err(|e| {
                    crate::sys::reg_error(len, format!("exposing a region slice of {len} bytes ({access:?})"), e)
                })?;
            let remote = RemoteSlice { addr, len: len as u32, rkey: mr.rkey() };
            let binding = Binding { _mw: None, _mem: Under::Registered(mr, Some(slice.region().clone())) };
            let win = Rc::new(Window { binding: RefCell::new(Some(binding)), parked: RefCell::new(None), bind: None });
            return Ok((RegionWindow { win: win.clone(), remote, access }, win));
        }
        let (_, mr) = slice.region().registration(pd, slice.range())?;
        let mw =
            Mw::alloc(pd).map_err(|e| Error::verb("ibv_alloc_mw", "a type-2 memory window to expose a region", e))?;
        let rights = remote_rights(access);
        let rkey = next_rkey(mw.rkey());
        let (addr, len) = (slice.addr(), slice.len() as u64);
        let bind = Bind { mw: mw.as_ptr(), rkey, mr, addr, len, access: rights };
        let remote = RemoteSlice { addr, len: len as u32, rkey };
        let binding = Binding { _mw: Some(mw), _mem: Under::Region(slice.region().clone()) };
        let win =
            Rc::new(Window { binding: RefCell::new(Some(binding)), parked: RefCell::new(None), bind: Some(bind) });
        Ok((RegionWindow { win: win.clone(), remote, access }, win))
    }

    /// The descriptor the peer needs: address, length and remote key. It works only on the
    /// connection the window was exposed to.
    pub fn remote(&self) -> RemoteSlice {
        self.remote
    }

    /// The rights the peer has.
    pub fn access(&self) -> RemoteAccess {
        self.access
    }

    /// True once the peer's access is gone: the connection was destroyed.
    pub fn is_released(&self) -> bool {
        self.win.is_released()
    }
}
