//! Protection domains.
#![allow(unsafe_code)]

use std::io;
use std::ptr::NonNull;
use std::rc::Rc;

use rdma_sys as ffi;

use super::cvt_ptr;
use super::device::DeviceRef;

/// A protection domain on a device context librdmacm owns.
#[derive(Debug)]
pub struct Pd {
    raw: NonNull<ffi::ibv_pd>,
}

impl Pd {
    /// `ibv_alloc_pd` on a device.
    pub fn new(dev: DeviceRef) -> io::Result<Rc<Pd>> {
        // SAFETY: dev is librdmacm's open context, live for the process.
        let raw = cvt_ptr(unsafe { ffi::ibv_alloc_pd(dev.as_ptr()) })?;
        Ok(Rc::new(Pd { raw }))
    }

    pub(crate) fn as_ptr(&self) -> *mut ffi::ibv_pd {
        self.raw.as_ptr()
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // Every QP and MR holds an Rc of this PD, so none is left.
        // SAFETY: owned, live, destroyed once.
        let _ = unsafe { ffi::ibv_dealloc_pd(self.raw.as_ptr()) };
    }
}
