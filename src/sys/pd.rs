//! Protection domains.
#![allow(unsafe_code)]

use std::io;
use std::ptr::NonNull;
use std::rc::Rc;

use rdma_sys as ffi;

use super::cvt_ptr;
use super::device::{DeviceHold, DeviceRef};

/// A protection domain on a device context librdmacm owns. It holds a reference on the
/// context ([`DeviceHold`], its last field), so the context outlives it and everything on it
/// (memory regions and windows, queue pairs, the SRQ, the pool's buffers): a user's buffer can
/// outlive its device's removal.
#[derive(Debug)]
pub struct Pd {
    raw: NonNull<ffi::ibv_pd>,
    _hold: Rc<DeviceHold>,
}

impl Pd {
    /// `ibv_alloc_pd` on a device, holding `hold` (a reference on its context).
    pub fn new(dev: DeviceRef, hold: &Rc<DeviceHold>) -> io::Result<Rc<Pd>> {
        // SAFETY: dev's context is open: `hold` keeps librdmacm from closing it.
        let raw = cvt_ptr(unsafe { ffi::ibv_alloc_pd(dev.as_ptr()) })?;
        Ok(Rc::new(Pd { raw, _hold: hold.clone() }))
    }

    pub(crate) fn as_ptr(&self) -> *mut ffi::ibv_pd {
        self.raw.as_ptr()
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // Every QP and MR holds an Rc of this PD, so none is left; the context's reference
        // (a field) is released after this.
        // SAFETY: owned, live, destroyed once.
        let _ = unsafe { ffi::ibv_dealloc_pd(self.raw.as_ptr()) };
    }
}
