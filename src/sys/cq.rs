//! Completion channels and completion queues: events, batched acks, polling.
#![allow(unsafe_code)]

use std::cell::Cell;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, RawFd};
use std::ptr::{self, NonNull};
use std::rc::Rc;

use rdma_sys as ffi;

use super::ack::AckCounter;
use super::device::{DeviceHold, DeviceRef};
use super::{cvt, cvt_nz, cvt_ptr, nonblock, set_nonblocking};
use crate::proto::op::WcStatus;

/// A completion channel, its fd non-blocking from creation.
#[derive(Debug)]
pub struct CompChannel {
    raw: NonNull<ffi::ibv_comp_channel>,
    /// A reference on the context, released after the channel (and so after every CQ, each of
    /// which holds the channel).
    _hold: Rc<DeviceHold>,
}

impl CompChannel {
    /// `ibv_create_comp_channel` on a device, holding `hold` (a reference on its context).
    pub fn new(dev: DeviceRef, hold: &Rc<DeviceHold>) -> io::Result<Rc<CompChannel>> {
        // SAFETY: dev's context is open: `hold` keeps librdmacm from closing it.
        let raw = cvt_ptr(unsafe { ffi::ibv_create_comp_channel(dev.as_ptr()) })?;
        let chan = CompChannel { raw, _hold: hold.clone() };
        set_nonblocking(chan.fd())?;
        Ok(Rc::new(chan))
    }

    /// The fd to register with epoll.
    pub fn fd(&self) -> RawFd {
        // SAFETY: self.raw is live until Drop.
        unsafe { self.raw.as_ref() }.fd
    }

    /// The next completion event, or `None` when none is pending. Count it on the CQ its
    /// context names with [`Cq::count`]; dropped uncounted, it is acked at once.
    pub fn get_event(&self) -> io::Result<Option<CqEvent>> {
        let mut cq: *mut ffi::ibv_cq = ptr::null_mut();
        let mut ctx: *mut std::os::raw::c_void = ptr::null_mut();
        // SAFETY: self.raw is live; cq and ctx are valid out-pointers.
        let r = nonblock(cvt(unsafe { ffi::ibv_get_cq_event(self.raw.as_ptr(), &mut cq, &mut ctx) }))?;
        Ok(r.and_then(|_| NonNull::new(cq)).map(|cq| CqEvent { context: ctx as u64, cq }))
    }
}

impl AsFd for CompChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the fd belongs to self.raw, which is open while self lives.
        unsafe { BorrowedFd::borrow_raw(self.fd()) }
    }
}

/// One event read from a completion channel, to be acked exactly once: counted on its own CQ
/// by [`Cq::count`] (acked in a batch later), or acked when dropped.
#[derive(Debug)]
#[must_use = "an event dropped uncounted is acked at once"]
pub(crate) struct CqEvent {
    /// The context of the CQ that fired (our token).
    pub context: u64,
    cq: NonNull<ffi::ibv_cq>,
}

impl Drop for CqEvent {
    fn drop(&mut self) {
        // SAFETY: self.cq came from ibv_get_cq_event and cannot be destroyed before its events
        // are acked; this event is acked once, here (Cq::count forgets the events it counts).
        unsafe { ffi::ibv_ack_cq_events(self.cq.as_ptr(), 1) };
    }
}

impl Drop for CompChannel {
    fn drop(&mut self) {
        // Every CQ on this channel holds an Rc of it, so none is left.
        // SAFETY: owned, live, destroyed once.
        let _ = unsafe { ffi::ibv_destroy_comp_channel(self.raw.as_ptr()) };
    }
}

/// One polled work completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The work request id we posted with.
    pub wr_id: u64,
    /// The status.
    pub status: WcStatus,
    /// Bytes received (receives) or transferred; valid only on success.
    pub byte_len: u32,
    /// Immediate data, host order, when the completion carries it.
    pub imm: Option<u32>,
    /// A receive consumed by an RDMA WRITE with immediate.
    pub remote_write: bool,
    /// The local queue pair the work request belonged to (how a receive from a shared receive
    /// queue is matched to its connection).
    pub qp_num: u32,
}

fn wc_status(v: ffi::ibv_wc_status::Type) -> WcStatus {
    use ffi::ibv_wc_status as S;
    match v {
        S::IBV_WC_SUCCESS => WcStatus::Success,
        S::IBV_WC_LOC_LEN_ERR => WcStatus::LocLenErr,
        S::IBV_WC_LOC_QP_OP_ERR => WcStatus::LocQpOpErr,
        S::IBV_WC_LOC_EEC_OP_ERR => WcStatus::LocEecOpErr,
        S::IBV_WC_LOC_PROT_ERR => WcStatus::LocProtErr,
        S::IBV_WC_WR_FLUSH_ERR => WcStatus::WrFlushErr,
        S::IBV_WC_MW_BIND_ERR => WcStatus::MwBindErr,
        S::IBV_WC_BAD_RESP_ERR => WcStatus::BadRespErr,
        S::IBV_WC_LOC_ACCESS_ERR => WcStatus::LocAccessErr,
        S::IBV_WC_REM_INV_REQ_ERR => WcStatus::RemInvReqErr,
        S::IBV_WC_REM_ACCESS_ERR => WcStatus::RemAccessErr,
        S::IBV_WC_REM_OP_ERR => WcStatus::RemOpErr,
        S::IBV_WC_RETRY_EXC_ERR => WcStatus::RetryExcErr,
        S::IBV_WC_RNR_RETRY_EXC_ERR => WcStatus::RnrRetryExcErr,
        S::IBV_WC_LOC_RDD_VIOL_ERR => WcStatus::LocRddViolErr,
        S::IBV_WC_REM_INV_RD_REQ_ERR => WcStatus::RemInvRdReqErr,
        S::IBV_WC_REM_ABORT_ERR => WcStatus::RemAbortErr,
        S::IBV_WC_INV_EECN_ERR => WcStatus::InvEecnErr,
        S::IBV_WC_INV_EEC_STATE_ERR => WcStatus::InvEecStateErr,
        S::IBV_WC_FATAL_ERR => WcStatus::FatalErr,
        S::IBV_WC_RESP_TIMEOUT_ERR => WcStatus::RespTimeoutErr,
        S::IBV_WC_GENERAL_ERR => WcStatus::GeneralErr,
        other => WcStatus::Unknown(other),
    }
}

/// Completions polled in one `ibv_poll_cq` call at most.
pub const POLL_BATCH: usize = 32;

/// A completion queue bound to a completion channel, with its un-acked event count.
///
/// **Invariant:** `ibv_ack_cq_events` is called for every event counted here before the CQ is
/// destroyed (Drop flushes the count), because `ibv_destroy_cq` waits for all of them.
#[derive(Debug)]
pub(crate) struct Cq {
    raw: NonNull<ffi::ibv_cq>,
    acks: Cell<AckCounter>,
    entries: u32,
    _chan: Rc<CompChannel>,
}

impl Default for WorkCompletion {
    fn default() -> Self {
        WorkCompletion { wr_id: 0, status: WcStatus::Success, byte_len: 0, imm: None, remote_write: false, qp_num: 0 }
    }
}

impl Cq {
    /// `ibv_create_cq` with at least `entries` entries on `chan`'s context, with `context`
    /// (our token) as the CQ context.
    pub fn new(
        dev: DeviceRef,
        chan: &Rc<CompChannel>,
        entries: u32,
        context: u64,
        ack_batch: u32,
    ) -> io::Result<Rc<Cq>> {
        let ctx = dev.as_ptr();
        let n = i32::try_from(entries).map_err(|_| io::Error::from_raw_os_error(nix::libc::EINVAL))?;
        // SAFETY: ctx and chan are live; context is an opaque integer.
        let raw = cvt_ptr(unsafe { ffi::ibv_create_cq(ctx, n, context as usize as *mut _, chan.raw.as_ptr(), 0) })?;
        // SAFETY: raw is live; cqe is the granted size.
        let granted = unsafe { raw.as_ref() }.cqe.max(0) as u32;
        Ok(Rc::new(Cq { raw, acks: Cell::new(AckCounter::new(ack_batch)), entries: granted, _chan: chan.clone() }))
    }

    /// The CQ's address, as asynchronous events name it (compared, never followed).
    pub(crate) fn identity(&self) -> usize {
        self.raw.as_ptr() as usize
    }

    pub(crate) fn as_ptr(&self) -> *mut ffi::ibv_cq {
        self.raw.as_ptr()
    }

    /// Sets the context `ibv_get_cq_event` returns for this CQ (our token).
    pub(crate) fn set_context(&self, context: u64) {
        // SAFETY: self.raw is live; cq_context is an opaque field the library only copies out.
        unsafe { (*self.raw.as_ptr()).cq_context = context as usize as *mut _ };
    }

    /// Entries the device granted.
    pub fn entries(&self) -> u32 {
        self.entries
    }

    /// Counts an event for a batched ack, if it is this CQ's; another CQ's event is acked at
    /// once (dropped). Returns whether it was this CQ's.
    pub fn count(&self, ev: CqEvent) -> bool {
        if ev.cq != self.raw {
            return false;
        }
        std::mem::forget(ev);
        let mut a = self.acks.get();
        a.note();
        self.acks.set(a);
        true
    }

    /// True when the counted events reached the ack batch: [`Cq::ack_due`] acks them.
    pub fn ack_is_due(&self) -> bool {
        self.acks.get().is_due()
    }

    /// Events counted and not yet acked.
    pub fn unacked(&self) -> u32 {
        self.acks.get().pending()
    }

    /// Acks the counted events if the batch threshold is reached; returns how many.
    pub fn ack_due(&self) -> u32 {
        let mut a = self.acks.get();
        let n = a.take_due().unwrap_or(0);
        self.acks.set(a);
        self.ack(n)
    }

    /// Acks every counted event in one `ibv_ack_cq_events` call; returns how many.
    pub fn ack_events(&self) -> u32 {
        let mut a = self.acks.get();
        let n = a.take_all();
        self.acks.set(a);
        self.ack(n)
    }

    fn ack(&self, n: u32) -> u32 {
        if n > 0 {
            // SAFETY: self.raw is live; n events were returned by ibv_get_cq_event for it.
            unsafe { ffi::ibv_ack_cq_events(self.raw.as_ptr(), n) };
        }
        n
    }

    /// Arms the CQ for one notification (`ibv_req_notify_cq`, all completions).
    pub fn req_notify(&self) -> io::Result<()> {
        // SAFETY: self.raw is live.
        cvt_nz(unsafe { ffi::ibv_req_notify_cq(self.raw.as_ptr(), 0) })
    }

    /// Polls up to `want` (at most [`POLL_BATCH`]) completions into `batch`, replacing what
    /// it held; returns how many.
    pub fn poll(&self, batch: &mut WcBatch, want: usize) -> io::Result<usize> {
        let n = want.min(POLL_BATCH);
        batch.len = 0;
        let mut wcs: [MaybeUninit<ffi::ibv_wc>; POLL_BATCH] = [const { MaybeUninit::uninit() }; POLL_BATCH];
        // SAFETY: self.raw is live; wcs has room for n entries.
        let got = unsafe { ffi::ibv_poll_cq(self.raw.as_ptr(), n as i32, wcs.as_mut_ptr().cast()) };
        if got < 0 {
            return Err(io::Error::other(format!("ibv_poll_cq returned {got}")));
        }
        let got = (got as usize).min(n);
        for (dst, src) in batch.wcs.iter_mut().zip(&wcs[..got]) {
            // SAFETY: ibv_poll_cq initialised the first `got` entries.
            let wc = unsafe { src.assume_init_ref() };
            let status = wc_status(wc.status);
            let with_imm = wc.wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
            dst.write(WorkCompletion {
                wr_id: wc.wr_id,
                status,
                byte_len: wc.byte_len,
                // SAFETY: imm_data is the active member when IBV_WC_WITH_IMM is set.
                imm: with_imm.then(|| u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data })),
                remote_write: status == WcStatus::Success && wc.opcode == ffi::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM,
                qp_num: wc.qp_num,
            });
        }
        batch.len = got;
        Ok(got)
    }
}

/// Room for one `ibv_poll_cq` call's completions, left uninitialised until a poll fills it: a
/// poll that finds the CQ empty (most polls of a spinning reactor) writes nothing.
pub(crate) struct WcBatch {
    wcs: [MaybeUninit<WorkCompletion>; POLL_BATCH],
    /// The first `len` entries are initialised.
    len: usize,
}

impl WcBatch {
    /// An empty batch.
    pub(crate) fn new() -> WcBatch {
        WcBatch { wcs: [const { MaybeUninit::uninit() }; POLL_BATCH], len: 0 }
    }

    /// The completions of the last poll.
    pub(crate) fn as_slice(&self) -> &[WorkCompletion] {
        // SAFETY: `Cq::poll` initialised the first `len` entries (`WorkCompletion` is `Copy`:
        // nothing to drop) and `len` is never more than `POLL_BATCH`.
        unsafe { std::slice::from_raw_parts(self.wcs.as_ptr().cast::<WorkCompletion>(), self.len) }
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // Ack first: ibv_destroy_cq blocks until every event is acked.
        self.ack_events();
        // SAFETY: owned and live; every QP using it held an Rc and is gone.
        let _ = unsafe { ffi::ibv_destroy_cq(self.raw.as_ptr()) };
    }
}
