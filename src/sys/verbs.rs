//! verbs: protection domain, completion channel, completion queue, memory region, posting.
#![allow(unsafe_code)]

use std::cell::Cell;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, RawFd};
use std::ptr::{self, NonNull};
use std::rc::Rc;

use rdma_sys as ffi;
use smallvec::SmallVec;

use super::cm::CmId;
use super::{cvt, cvt_nz, cvt_ptr, nonblock, set_nonblocking};
use crate::op::WcStatus;
use crate::reactor::ack::AckCounter;

/// A device context owned by librdmacm (it stays open for the life of the process once an id
/// is bound to it). Copyable, never closed by this crate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceRef(NonNull<ffi::ibv_context>);

impl DeviceRef {
    pub(crate) fn from_raw(ctx: *mut ffi::ibv_context) -> Option<DeviceRef> {
        NonNull::new(ctx).map(DeviceRef)
    }

    /// An opaque key identifying the device context.
    pub fn key(&self) -> usize {
        self.0.as_ptr() as usize
    }

    fn as_ptr(&self) -> *mut ffi::ibv_context {
        self.0.as_ptr()
    }
}

/// Capacities of a queue pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpCaps {
    /// Send work requests that may be outstanding.
    pub max_send_wr: u32,
    /// Receive work requests that may be outstanding.
    pub max_recv_wr: u32,
    /// Largest inline send.
    pub max_inline_data: u32,
}

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

/// A completion channel, its fd non-blocking from creation.
#[derive(Debug)]
pub struct CompChannel {
    raw: NonNull<ffi::ibv_comp_channel>,
}

impl CompChannel {
    /// `ibv_create_comp_channel` on a device.
    pub fn new(dev: DeviceRef) -> io::Result<Rc<CompChannel>> {
        // SAFETY: dev is librdmacm's open context, live for the process.
        let raw = cvt_ptr(unsafe { ffi::ibv_create_comp_channel(dev.as_ptr()) })?;
        let chan = CompChannel { raw };
        set_nonblocking(chan.fd())?;
        Ok(Rc::new(chan))
    }

    /// The fd to register with epoll.
    pub fn fd(&self) -> RawFd {
        // SAFETY: self.raw is live until Drop.
        unsafe { self.raw.as_ref() }.fd
    }

    /// The next completion event, or `None` when none is pending. The caller must count it
    /// on the CQ its context names ([`Cq::note_event`]) or, if no CQ of ours has that
    /// context, ack it at once with [`CompChannel::ack_orphan`].
    pub fn get_event(&self) -> io::Result<Option<CqEvent>> {
        let mut cq: *mut ffi::ibv_cq = ptr::null_mut();
        let mut ctx: *mut std::os::raw::c_void = ptr::null_mut();
        // SAFETY: self.raw is live; cq and ctx are valid out-pointers.
        let r = nonblock(cvt(unsafe { ffi::ibv_get_cq_event(self.raw.as_ptr(), &mut cq, &mut ctx) }))?;
        Ok(r.map(|_| CqEvent { context: ctx as u64, cq }))
    }

    /// Acks an event whose CQ context names nothing we know, so that CQ's destroy can finish.
    pub fn ack_orphan(&self, ev: CqEvent) {
        if !ev.cq.is_null() {
            // SAFETY: ev.cq came from ibv_get_cq_event and is live until its events are acked.
            unsafe { ffi::ibv_ack_cq_events(ev.cq, 1) };
        }
    }
}

impl AsFd for CompChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the fd belongs to self.raw, which is open while self lives.
        unsafe { BorrowedFd::borrow_raw(self.fd()) }
    }
}

/// One event read from a completion channel.
#[derive(Debug)]
pub struct CqEvent {
    /// The context of the CQ that fired (our token).
    pub context: u64,
    cq: *mut ffi::ibv_cq,
}

impl CompChannel {}

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
pub struct Cq {
    raw: NonNull<ffi::ibv_cq>,
    acks: Cell<AckCounter>,
    entries: u32,
    _chan: Rc<CompChannel>,
}

impl Default for WorkCompletion {
    fn default() -> Self {
        WorkCompletion { wr_id: 0, status: WcStatus::Success, byte_len: 0, imm: None, remote_write: false }
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

    pub(crate) fn as_ptr(&self) -> *mut ffi::ibv_cq {
        self.raw.as_ptr()
    }

    /// Sets the context `ibv_get_cq_event` returns for this CQ (our token).
    pub fn set_context(&self, context: u64) {
        // SAFETY: self.raw is live; cq_context is an opaque field the library only copies out.
        unsafe { (*self.raw.as_ptr()).cq_context = context as usize as *mut _ };
    }

    /// Entries the device granted.
    pub fn entries(&self) -> u32 {
        self.entries
    }

    /// Counts one event from the completion channel for this CQ.
    pub fn note_event(&self) {
        let mut a = self.acks.get();
        a.note();
        self.acks.set(a);
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

    /// Polls up to `out.len()` (at most [`POLL_BATCH`]) completions.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> io::Result<usize> {
        let n = out.len().min(POLL_BATCH);
        let mut wcs: [MaybeUninit<ffi::ibv_wc>; POLL_BATCH] = [const { MaybeUninit::uninit() }; POLL_BATCH];
        // SAFETY: self.raw is live; wcs has room for n entries.
        let got = unsafe { ffi::ibv_poll_cq(self.raw.as_ptr(), n as i32, wcs.as_mut_ptr().cast()) };
        if got < 0 {
            return Err(io::Error::other(format!("ibv_poll_cq returned {got}")));
        }
        let got = got as usize;
        for (dst, src) in out.iter_mut().zip(&wcs[..got]) {
            // SAFETY: ibv_poll_cq initialised the first `got` entries.
            let wc = unsafe { src.assume_init_ref() };
            let status = wc_status(wc.status);
            let with_imm = wc.wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
            *dst = WorkCompletion {
                wr_id: wc.wr_id,
                status,
                byte_len: wc.byte_len,
                // SAFETY: imm_data is the active member when IBV_WC_WITH_IMM is set.
                imm: with_imm.then(|| u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data })),
                remote_write: status == WcStatus::Success && wc.opcode == ffi::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM,
            };
        }
        Ok(got)
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

    /// The remote key.
    pub fn rkey(&self) -> u32 {
        // SAFETY: self.raw is live.
        unsafe { self.raw.as_ref() }.rkey
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: owned and live; no posted work request references it (the reactor holds the
        // buffers of outstanding requests, and those hold their memory region).
        let _ = unsafe { ffi::ibv_dereg_mr(self.raw.as_ptr()) };
    }
}

/// The operation of a send-queue work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendOp {
    /// `IBV_WR_SEND`.
    Send,
    /// `IBV_WR_SEND_WITH_IMM`.
    SendImm(u32),
    /// `IBV_WR_RDMA_WRITE` to `(remote_addr, rkey)`.
    Write(u64, u32),
    /// `IBV_WR_RDMA_WRITE_WITH_IMM`.
    WriteImm(u64, u32, u32),
    /// `IBV_WR_RDMA_READ` from `(remote_addr, rkey)`.
    Read(u64, u32),
}

/// One send work request to post.
#[derive(Clone, Copy, Debug)]
pub struct SendWr {
    /// Our work request id.
    pub wr_id: u64,
    /// The operation.
    pub op: SendOp,
    /// Local address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
    /// Local key.
    pub lkey: u32,
    /// Ask for a completion.
    pub signaled: bool,
    /// Copy the payload into the work request.
    pub inline: bool,
}

/// One receive work request to post.
#[derive(Clone, Copy, Debug)]
pub struct RecvWr {
    /// Our work request id.
    pub wr_id: u64,
    /// Local address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
    /// Local key.
    pub lkey: u32,
}

/// A post that failed part-way: the first `posted` requests went to the device.
#[derive(Debug)]
pub struct PostError {
    /// Requests posted before the failing one.
    pub posted: usize,
    /// The error.
    pub error: io::Error,
}

impl CmId {
    /// Posts `wrs` as one chain (one doorbell).
    pub fn post_send(&self, wrs: &[SendWr]) -> Result<(), PostError> {
        let qp = self.qp();
        if qp.is_null() {
            return Err(PostError { posted: 0, error: io::Error::new(io::ErrorKind::NotConnected, "no queue pair") });
        }
        if wrs.is_empty() {
            return Ok(());
        }
        let mut sges: SmallVec<[ffi::ibv_sge; 16]> =
            wrs.iter().map(|w| ffi::ibv_sge { addr: w.addr, length: w.len, lkey: w.lkey }).collect();
        // SAFETY: ibv_send_wr is plain old data (integers, pointers, unions thereof); zero is a
        // valid value for every field.
        let mut chain: SmallVec<[ffi::ibv_send_wr; 16]> = wrs.iter().map(|_| unsafe { std::mem::zeroed() }).collect();
        let base = chain.as_mut_ptr();
        for (i, (w, raw)) in wrs.iter().zip(chain.iter_mut()).enumerate() {
            raw.wr_id = w.wr_id;
            raw.sg_list = &mut sges[i];
            raw.num_sge = if w.len == 0 { 0 } else { 1 };
            let (opcode, imm, remote) = match w.op {
                SendOp::Send => (ffi::ibv_wr_opcode::IBV_WR_SEND, None, None),
                SendOp::SendImm(imm) => (ffi::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM, Some(imm), None),
                SendOp::Write(a, k) => (ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE, None, Some((a, k))),
                SendOp::WriteImm(a, k, imm) => {
                    (ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM, Some(imm), Some((a, k)))
                }
                SendOp::Read(a, k) => (ffi::ibv_wr_opcode::IBV_WR_RDMA_READ, None, Some((a, k))),
            };
            raw.opcode = opcode;
            if let Some(imm) = imm {
                raw.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
            }
            if let Some((remote_addr, rkey)) = remote {
                raw.wr.rdma = ffi::rdma_t { remote_addr, rkey };
            }
            let mut flags = 0;
            if w.signaled {
                flags |= ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
            }
            if w.inline {
                flags |= ffi::ibv_send_flags::IBV_SEND_INLINE.0;
            }
            raw.send_flags = flags;
            // SAFETY: i + 1 <= len, so this is at most one past the end; it is stored only
            // when it names a real element.
            raw.next = if i + 1 < wrs.len() { unsafe { base.add(i + 1) } } else { ptr::null_mut() };
        }
        let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
        // SAFETY: qp is live while self lives; the chain and its SGEs are valid for the call,
        // and the memory they name is kept registered by the caller until completion.
        let r = cvt_nz(unsafe { ffi::ibv_post_send(qp, chain.as_mut_ptr(), &mut bad) });
        r.map_err(|error| PostError {
            posted: failed_index::<ffi::ibv_send_wr>(bad as usize, base as usize, wrs.len()),
            error,
        })
    }

    /// Posts `wrs` as one chain (one doorbell).
    pub fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), PostError> {
        let qp = self.qp();
        if qp.is_null() {
            return Err(PostError { posted: 0, error: io::Error::new(io::ErrorKind::NotConnected, "no queue pair") });
        }
        if wrs.is_empty() {
            return Ok(());
        }
        let mut sges: SmallVec<[ffi::ibv_sge; 16]> =
            wrs.iter().map(|w| ffi::ibv_sge { addr: w.addr, length: w.len, lkey: w.lkey }).collect();
        let mut chain: SmallVec<[ffi::ibv_recv_wr; 16]> = wrs
            .iter()
            .map(|w| ffi::ibv_recv_wr { wr_id: w.wr_id, next: ptr::null_mut(), sg_list: ptr::null_mut(), num_sge: 1 })
            .collect();
        let base = chain.as_mut_ptr();
        for (i, raw) in chain.iter_mut().enumerate() {
            raw.sg_list = &mut sges[i];
            // SAFETY: as in post_send.
            raw.next = if i + 1 < wrs.len() { unsafe { base.add(i + 1) } } else { ptr::null_mut() };
        }
        let mut bad: *mut ffi::ibv_recv_wr = ptr::null_mut();
        // SAFETY: as in post_send.
        let r = cvt_nz(unsafe { ffi::ibv_post_recv(qp, chain.as_mut_ptr(), &mut bad) });
        r.map_err(|error| PostError {
            posted: failed_index::<ffi::ibv_recv_wr>(bad as usize, base as usize, wrs.len()),
            error,
        })
    }
}

/// Index of the failing request named by `bad` in a chain at `base`; 0 when unknown (then
/// nothing is assumed posted).
fn failed_index<T>(bad: usize, base: usize, len: usize) -> usize {
    let size = std::mem::size_of::<T>().max(1);
    if bad < base {
        return 0;
    }
    let i = (bad - base) / size;
    if i < len {
        i
    } else {
        0
    }
}
