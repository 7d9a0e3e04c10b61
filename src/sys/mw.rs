//! Memory windows of type 2: remote access to a range of a memory region, granted to one
//! queue pair.
//!
//! A type-2 window is allocated unbound (`ibv_alloc_mw`) and bound by an `IBV_WR_BIND_MW` work
//! request on a queue pair's send queue ([`SendOp::Bind`](super::qp::SendOp::Bind)). Once
//! bound, its rkey works only in requests that arrive on that queue pair (InfiniBand C10-72,
//! o10-37.2.x; rxe checks `mw->qp == qp` on every remote access), only within the range bound
//! and only with the rights bound. `ibv_dealloc_mw` invalidates it at once.
//!
//! The memory region under a window is registered with `IBV_ACCESS_MW_BIND` and no remote
//! rights of its own, so its own rkey gives peers nothing. rxe checks a remote access through
//! a window against the range of the region under it, not of the window, so the pool registers
//! one region per window, of exactly the window's bytes (`pool/expose.rs`).
#![allow(unsafe_code)]

use std::io;
use std::ptr::NonNull;
use std::rc::Rc;

use rdma_sys as ffi;

use super::cvt_ptr;
use super::pd::Pd;

/// A type-2 memory window on a protection domain. Dropping it deallocates it
/// (`ibv_dealloc_mw`), which also invalidates a binding.
#[derive(Debug)]
pub struct Mw {
    raw: NonNull<ffi::ibv_mw>,
    _pd: Rc<Pd>,
}

impl Mw {
    /// `ibv_alloc_mw(pd, IBV_MW_TYPE_2)`.
    ///
    /// # Errors
    ///
    /// `EOPNOTSUPP` when the device's provider has no memory windows; what `ibv_alloc_mw`
    /// reports otherwise (e.g. `ENOMEM` at the device's `max_mw`).
    pub fn alloc(pd: &Rc<Pd>) -> io::Result<Mw> {
        // SAFETY: pd is live. rdma-sys' ibv_alloc_mw is the C inline function: it calls the
        // provider's alloc_mw through the context's ops table when the provider has one and
        // sets errno to EOPNOTSUPP otherwise.
        let raw = match unsafe { ffi::ibv_alloc_mw(pd.as_ptr(), ffi::ibv_mw_type::IBV_MW_TYPE_2) } {
            Some(p) => cvt_ptr(p)?,
            None => return Err(io::Error::from_raw_os_error(nix::libc::EOPNOTSUPP)),
        };
        Ok(Mw { raw, _pd: pd.clone() })
    }

    /// The rkey the window was allocated with (the rkey of a bind names the window by it).
    pub fn rkey(&self) -> u32 {
        // SAFETY: self.raw is live.
        unsafe { self.raw.as_ref() }.rkey
    }

    pub(crate) fn as_ptr(&self) -> *mut ffi::ibv_mw {
        self.raw.as_ptr()
    }
}

impl Drop for Mw {
    fn drop(&mut self) {
        // SAFETY: owned and live, deallocated once. rdma-sys' ibv_dealloc_mw is the C inline
        // function (the provider's dealloc_mw through the ops table; a provider that allocated
        // the window has one). A bind still queued on a send queue then fails (the window is
        // gone), it cannot bind anything; the reactor never drops a window whose bind it has
        // yet to post (the bind's operation holds the window).
        let _ = unsafe { ffi::ibv_dealloc_mw(self.raw.as_ptr()) };
    }
}

/// The rkey to bind a type-2 window with: its current rkey with the low 8 bits (the consumer's
/// key) advanced, as `ibv_inc_rkey` does. The index bits stay; a key byte different from the
/// last one makes an old descriptor of the same window stale.
pub fn next_rkey(rkey: u32) -> u32 {
    (rkey & !0xff) | (rkey.wrapping_add(1) & 0xff)
}

#[cfg(test)]
mod tests {
    use super::next_rkey;

    #[test]
    fn next_rkey_advances_only_the_key_byte() {
        assert_eq!(next_rkey(0x0000_1234), 0x0000_1235);
        assert_eq!(next_rkey(0x0012_34ff), 0x0012_3400, "the key byte wraps, the index stays");
        assert_eq!(next_rkey(0xffff_ffff), 0xffff_ff00);
        for k in [0u32, 7, 0xabcd_ef12, u32::MAX] {
            assert_eq!(next_rkey(k) >> 8, k >> 8);
            assert_ne!(next_rkey(k), k);
        }
    }
}
