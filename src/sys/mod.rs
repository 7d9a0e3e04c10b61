//! The FFI boundary: the only module that names `rdma_sys`. Private to the crate.
//!
//! One file per rdma-core object family: `cm.rs` (event channel, CM ids and events), `connect.rs`
//! (`rdma_connect` on a helper thread, for iWARP, whose call blocks), `device.rs`
//! (device list, device contexts), `pd.rs`, `mr.rs`, `mw.rs` (type-2 memory windows), `cq.rs` (completion channels and CQs, with
//! `ack.rs`'s batched ack counter), `qp.rs` (queue pairs on CM ids, posting), `wr.rs` (work requests built in place, issue 47), `srq.rs`
//! (shared receive queues) and `pool/` (the registered buffer pool). Layering: this module imports the pure core (`crate::proto`,
//! `crate::error`) and never the reactor layer above it.
//!
//! **Architecture invariant:** every raw pointer from rdma-core has exactly one owner here that
//! frees it in `Drop`, and parents are fields of their children (a queue pair's owner holds its
//! CQs and PD, a CQ holds its completion channel), so the destroy order rdma-core requires is
//! structural. Nothing outside `sys` names an `ibv_*` or `rdma_*` symbol.
//!
//! rdma-core uses three error conventions; each has one helper here: [`cvt`] (returns -1 and
//! sets errno), [`cvt_nz`] (returns the errno itself) and [`cvt_ptr`] (returns NULL and sets
//! errno). `EAGAIN` from a non-blocking fd becomes `Ok(None)` and never leaves this module as
//! an error.
#![allow(unsafe_code)]

pub(crate) mod ack;
pub(crate) mod cm;
pub(crate) mod connect;
pub(crate) mod cq;
pub(crate) mod device;
pub(crate) mod mr;
pub(crate) mod mw;
pub(crate) mod pd;
pub(crate) mod pool;
pub(crate) mod qp;
pub(crate) mod region;
pub(crate) mod srq;
pub(crate) mod wr;

use std::io;
use std::os::fd::{BorrowedFd, RawFd};
use std::ptr::NonNull;

use nix::fcntl::{fcntl, FcntlArg, OFlag};

/// `-1` and errno.
pub(crate) fn cvt(ret: i32) -> io::Result<i32> {
    if ret == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// The errno is the return value (0 on success).
pub(crate) fn cvt_nz(ret: i32) -> io::Result<()> {
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(ret.abs()))
    }
}

/// NULL and errno.
pub(crate) fn cvt_ptr<T>(p: *mut T) -> io::Result<NonNull<T>> {
    NonNull::new(p).ok_or_else(|| {
        let e = io::Error::last_os_error();
        // Some providers return NULL without setting errno.
        if e.raw_os_error() == Some(0) {
            io::Error::other("the call returned NULL without an errno")
        } else {
            e
        }
    })
}

/// Makes `call` again while it fails with `EINTR` and `deadline` (`None`: no limit) has not
/// passed, as `SA_RESTART` would for a call the kernel never restarts (`rdma_connect`'s write
/// to the CM): its last result, and how many times it was interrupted.
pub(crate) fn restart_interrupted<T>(
    deadline: Option<std::time::Instant>,
    mut call: impl FnMut() -> io::Result<T>,
) -> (io::Result<T>, u32) {
    let mut interrupted = 0u32;
    loop {
        match call() {
            Err(e)
                if e.raw_os_error() == Some(nix::libc::EINTR)
                    && deadline.map_or(true, |d| std::time::Instant::now() < d) =>
            {
                interrupted = interrupted.saturating_add(1);
            }
            r => return (r, interrupted),
        }
    }
}

/// Maps a would-block error to `Ok(None)`.
pub(crate) fn nonblock<T>(r: io::Result<T>) -> io::Result<Option<T>> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
        Err(e) => Err(e),
    }
}

/// Sets `O_NONBLOCK` on an fd we do not own (it belongs to an rdma-core object).
pub(crate) fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: the caller passes an fd owned by a live rdma-core object that outlives this call.
    let fd = unsafe { BorrowedFd::borrow_raw(fd) };
    let flags = fcntl(fd, FcntlArg::F_GETFL).map_err(io::Error::from)?;
    let flags = OFlag::from_bits_retain(flags) | OFlag::O_NONBLOCK;
    fcntl(fd, FcntlArg::F_SETFL(flags)).map_err(io::Error::from)?;
    Ok(())
}

/// Converts a C string owned by rdma-core into an owned `String`.
///
/// # Safety
///
/// `p` is NULL or points to a NUL-terminated string valid for the duration of the call.
pub(crate) unsafe fn c_str(p: *const std::os::raw::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: non-null and NUL-terminated per this function's contract.
    unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The error of a failed `ibv_reg_mr` of `bytes` bytes: `ENOMEM` with a locked-memory limit
/// below what the registration needs is [`Error::Memlock`](crate::Error::Memlock), naming the
/// limit; anything else is a plain verb error.
pub(crate) fn reg_error(bytes: usize, context: String, e: io::Error) -> crate::Error {
    use nix::sys::resource::{getrlimit, Resource, RLIM_INFINITY};
    if e.raw_os_error() == Some(nix::libc::ENOMEM) {
        let limit = getrlimit(Resource::RLIMIT_MEMLOCK).ok().map(|(soft, _)| soft).filter(|l| *l != RLIM_INFINITY);
        if limit.is_some() {
            return crate::Error::Memlock { asked: bytes, limit, context, source: e };
        }
    }
    crate::Error::verb("ibv_reg_mr", context, e)
}

#[cfg(test)]
mod tests {
    use std::io;

    use super::{cvt, nonblock};

    /// The channel reads' errno handling (catalogue case 35): `EAGAIN` is "no event", and
    /// anything else (`EINTR`, `EIO`) reaches the reactor as an error for it to decide on (it
    /// retries `EINTR` and loses the device on `EIO`).
    #[test]
    fn eagain_is_no_event_and_other_errors_pass_through() {
        let err = |errno| io::Result::<u8>::Err(io::Error::from_raw_os_error(errno));
        assert_eq!(nonblock(Ok(7)).unwrap(), Some(7));
        assert_eq!(nonblock(err(nix::libc::EAGAIN)).unwrap(), None);
        assert_eq!(nonblock(err(nix::libc::EWOULDBLOCK)).unwrap(), None);
        for errno in [nix::libc::EINTR, nix::libc::EIO, nix::libc::EINVAL] {
            assert_eq!(nonblock(err(errno)).unwrap_err().raw_os_error(), Some(errno));
        }
        // The -1/errno convention: a failed non-blocking read with EAGAIN is no event.
        nix::errno::Errno::EAGAIN.set();
        assert_eq!(nonblock(cvt(-1)).unwrap(), None);
        nix::errno::Errno::EINTR.set();
        assert_eq!(nonblock(cvt(-1)).unwrap_err().raw_os_error(), Some(nix::libc::EINTR));
    }
}
