//! Memory regions.
#![allow(unsafe_code)]

use std::io;
use std::ptr::NonNull;
use std::rc::Rc;

use rdma_sys as ffi;

use super::cvt_ptr;
use super::pd::Pd;

/// A registered memory region over memory its owner keeps alive longer than the region.
#[derive(Debug)]
pub struct Mr {
    raw: NonNull<ffi::ibv_mr>,
    _pd: Rc<Pd>,
}

bitflags::bitflags! {
    /// Access a memory region grants (`enum ibv_access_flags`).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Access: u32 {
        /// The device may write it (needed for receives).
        const LOCAL_WRITE = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        /// Peers may RDMA WRITE it.
        const REMOTE_WRITE = ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        /// Peers may RDMA READ it.
        const REMOTE_READ = ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        /// Memory windows may be bound over it (a window's rights are its own; this flag
        /// gives the region's own rkey none).
        const MW_BIND = ffi::ibv_access_flags::IBV_ACCESS_MW_BIND.0;
    }
}

impl Mr {
    /// Registers `len` bytes at `addr`.
    ///
    /// # Safety
    ///
    /// `addr..addr+len` is memory the caller keeps allocated, and does not move or free, until
    /// this `Mr` is dropped.
    pub unsafe fn register(pd: &Rc<Pd>, addr: *mut u8, len: usize, access: Access) -> io::Result<Mr> {
        // SAFETY: pd is live; the memory contract is the caller's.
        let raw = cvt_ptr(unsafe { ffi::ibv_reg_mr(pd.as_ptr(), addr.cast(), len, access.bits() as i32) })?;
        Ok(Mr { raw, _pd: pd.clone() })
    }

    /// The local key.
    pub fn lkey(&self) -> u32 {
        // SAFETY: self.raw is live.
        unsafe { self.raw.as_ref() }.lkey
    }

    /// The remote key (meaningful for a region registered with remote rights).
    pub fn rkey(&self) -> u32 {
        // SAFETY: self.raw is live.
        unsafe { self.raw.as_ref() }.rkey
    }

    pub(crate) fn as_ptr(&self) -> *mut ffi::ibv_mr {
        self.raw.as_ptr()
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: owned and live; no posted work request references it (the reactor holds the
        // buffers of outstanding requests, and those hold their memory region).
        let _ = unsafe { ffi::ibv_dereg_mr(self.raw.as_ptr()) };
    }
}
