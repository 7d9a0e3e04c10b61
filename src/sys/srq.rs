//! Shared receive queues: one `ibv_srq` on a protection domain, posting receives to it and
//! arming its limit event.
//!
//! Soft-RoCE's limits, as `ibv_devinfo -v` reports them in the test VM (Debian's Linux 6.1
//! rxe): `max_srq` 917 503, `max_srq_wr` 1 048 576, `max_srq_sge` 27; for comparison
//! `max_qp` 1 048 560, `max_qp_wr` 1 048 576, `max_cq` 1 048 576, `max_cqe` 32 767. The
//! SRQ's receive completions all go to one CQ of as many entries (`reactor/data/srq/mod.rs`), so
//! `max_cqe` is what bounds an SRQ's receives on rxe.
#![allow(unsafe_code)]

use std::io;
use std::ptr::{self, NonNull};
use std::rc::Rc;

use rdma_sys as ffi;

use super::pd::Pd;
use super::qp::{PostError, RecvWr};
use super::{cvt_nz, cvt_ptr};

/// A shared receive queue (`ibv_create_srq`) on a protection domain, which it holds.
///
/// Drop destroys it (`ibv_destroy_srq`), then, as a field, drops its PD. Every queue pair
/// created on it holds an `Rc` of it, so it outlives them.
#[derive(Debug)]
pub(crate) struct Srq {
    raw: NonNull<ffi::ibv_srq>,
    _pd: Rc<Pd>,
}

impl Srq {
    /// Creates a shared receive queue of `max_wr` receives of one scatter entry each on `pd`.
    pub(crate) fn new(pd: &Rc<Pd>, max_wr: u32) -> io::Result<Rc<Srq>> {
        let mut attr = ffi::ibv_srq_init_attr {
            srq_context: ptr::null_mut(),
            attr: ffi::ibv_srq_attr { max_wr, max_sge: 1, srq_limit: 0 },
        };
        // SAFETY: pd is live (and kept as a field, so it outlives the SRQ); attr is valid for
        // the call, which writes the granted sizes back into it.
        let raw = cvt_ptr(unsafe { ffi::ibv_create_srq(pd.as_ptr(), &mut attr) })?;
        Ok(Rc::new(Srq { raw, _pd: pd.clone() }))
    }

    pub(crate) fn as_ptr(&self) -> *mut ffi::ibv_srq {
        self.raw.as_ptr()
    }

    /// The SRQ's address, as asynchronous events name it (compared, never followed).
    pub(crate) fn identity(&self) -> usize {
        self.raw.as_ptr() as usize
    }

    /// Arms the limit event (`ibv_modify_srq` with `IBV_SRQ_LIMIT`): the device raises
    /// `IBV_EVENT_SRQ_LIMIT_REACHED` once when fewer than `limit` receives are left posted, and
    /// must be armed again after it. Zero disarms it.
    pub(crate) fn arm_limit(&self, limit: u32) -> io::Result<()> {
        let mut attr = ffi::ibv_srq_attr { max_wr: 0, max_sge: 0, srq_limit: limit };
        // SAFETY: the SRQ is live; attr is valid for the call.
        cvt_nz(unsafe { ffi::ibv_modify_srq(self.as_ptr(), &mut attr, ffi::ibv_srq_attr_mask::IBV_SRQ_LIMIT.0 as i32) })
    }

    /// Posts `wrs` as one chain (one `ibv_post_srq_recv`).
    ///
    /// # Safety
    ///
    /// As [`Qp::post_recv_run`](super::qp::Qp::post_recv_run): every request names memory inside a
    /// memory region of this SRQ's PD with key `lkey`, which stays allocated, registered and
    /// untouched until the request's completion is reaped or the SRQ is destroyed.
    pub(crate) unsafe fn post_recv(&self, wrs: &[RecvWr], chains: &mut super::qp::Chains) -> Result<(), PostError> {
        // SAFETY: the SRQ is live while self lives; the chain is valid for the call; the
        // memory it names is the caller's to keep valid (this fn's contract).
        super::qp::post_recv_chain(wrs, chains, |base, bad| unsafe { ffi::ibv_post_srq_recv(self.as_ptr(), base, bad) })
    }
}

impl Drop for Srq {
    fn drop(&mut self) {
        // SAFETY: owned and live; every queue pair on it held an Rc and is gone; destroyed
        // once, here; the PD is a field and drops after.
        let _ = unsafe { ffi::ibv_destroy_srq(self.raw.as_ptr()) };
    }
}
