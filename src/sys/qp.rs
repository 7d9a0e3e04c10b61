//! Queue pairs: creation on a CM id, and posting work requests.
#![allow(unsafe_code)]

use std::io;
use std::ptr;
use std::rc::Rc;

use rdma_sys as ffi;

use super::cm::CmId;
use super::cq::Cq;
use super::mr::Access;
use super::pd::Pd;
use super::srq::Srq;
use super::wr::{RecvWrs, SendWrs};
use super::{cvt, cvt_nz};
use crate::proto::transport::TAIL_LEN;

/// Capacities of a queue pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpCaps {
    /// Send work requests that may be outstanding.
    pub max_send_wr: u32,
    /// Receive work requests that may be outstanding.
    pub max_recv_wr: u32,
    /// Largest inline send.
    pub max_inline_data: u32,
    /// Scatter entries per send work request (2 for a payload and its tail on iWARP).
    pub max_send_sge: u32,
}

/// The operation of a send-queue work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendOp {
    /// `IBV_WR_SEND`.
    Send,
    /// `IBV_WR_SEND_WITH_IMM`.
    #[cfg_attr(not(feature = "bench-internals"), allow(dead_code))]
    // The host benchmark's `SlabPath` (the data path before issue 47).
    SendImm(u32),
    /// `IBV_WR_RDMA_WRITE` to `(remote_addr, rkey)`.
    Write(u64, u32),
    /// `IBV_WR_RDMA_WRITE_WITH_IMM`.
    WriteImm(u64, u32, u32),
    /// `IBV_WR_RDMA_READ` from `(remote_addr, rkey)`.
    Read(u64, u32),
    /// `IBV_WR_BIND_MW`: binds a type-2 window to this queue pair (no local memory).
    Bind(Bind),
}

/// A type-2 memory window binding: the window, the region it lies in, the range and rights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bind {
    /// The window (`ibv_alloc_mw`, type 2), on this queue pair's PD.
    pub mw: *mut ffi::ibv_mw,
    /// The rkey the window gets: its rkey with a new key byte ([`next_rkey`](super::mw::next_rkey)).
    pub rkey: u32,
    /// The memory region the range lies in, registered with `IBV_ACCESS_MW_BIND`.
    pub mr: *mut ffi::ibv_mr,
    /// Start address of the range.
    pub addr: u64,
    /// Length of the range.
    pub len: u64,
    /// The rights peers get (remote read and/or write).
    pub access: Access,
}

/// One send work request to post (the operation slab's, before issue 47's in-place arrays).
#[cfg_attr(not(feature = "bench-internals"), allow(dead_code))] // The host benchmark's `SlabPath` (the data path before issue 47).
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
    /// A second scatter entry after the payload, `(addr, lkey)` of 4 bytes: the message's tail
    /// on a transport without immediate data.
    pub tail: Option<(u64, u32)>,
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

/// The buffers a post builds its chain of raw work requests and scatter entries in, kept by
/// the caller across posts: once they have grown to the largest chain, a post allocates and
/// moves nothing. What they hold between posts is stale and never read: a post clears the
/// scatter entries and the receive chain, and writes every field of the send requests it uses
/// (`Chains::send_chain`).
#[derive(Default)]
pub(crate) struct Chains {
    send: Vec<ffi::ibv_send_wr>,
    recv: Vec<ffi::ibv_recv_wr>,
    sge: Vec<ffi::ibv_sge>,
}

impl std::fmt::Debug for Chains {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chains").field("send", &self.send.capacity()).field("recv", &self.recv.capacity()).finish()
    }
}

/// An RC queue pair created on a CM id (`rdma_create_qp`). It owns the id.
///
/// Drop destroys the queue pair (`rdma_destroy_qp`), then, as fields in this order, the id
/// (`rdma_destroy_id`), the CQs, the shared receive queue (if it uses one) and the PD it was
/// created on: the order rdma-core requires.
#[derive(Debug)]
pub(crate) struct Qp {
    id: CmId,
    _send_cq: Rc<Cq>,
    _recv_cq: Rc<Cq>,
    _srq: Option<Rc<Srq>>,
    _pd: Rc<Pd>,
    caps: QpCaps,
}

impl Qp {
    /// Creates `id`'s queue pair on `pd`, `send_cq` and `recv_cq`, taking its receives from
    /// `srq` if given (then `want.max_recv_wr` is ignored: the queue pair has no receive queue
    /// of its own); on failure the id comes back with the error.
    pub(crate) fn create(
        id: CmId,
        pd: &Rc<Pd>,
        send_cq: &Rc<Cq>,
        recv_cq: &Rc<Cq>,
        srq: Option<&Rc<Srq>>,
        want: QpCaps,
    ) -> Result<Qp, (CmId, io::Error)> {
        let max_recv_wr = if srq.is_some() { 0 } else { want.max_recv_wr };
        let mut attr = ffi::ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: send_cq.as_ptr(),
            recv_cq: recv_cq.as_ptr(),
            srq: srq.map_or(ptr::null_mut(), |s| s.as_ptr()),
            cap: ffi::ibv_qp_cap {
                max_send_wr: want.max_send_wr,
                max_recv_wr,
                max_send_sge: want.max_send_sge.max(1),
                max_recv_sge: 1,
                max_inline_data: want.max_inline_data,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: the id is live and has no QP (a Qp owns its id, so this is the only create);
        // pd, the CQs and the SRQ are live and kept as fields, so they outlive the QP.
        if let Err(e) = cvt(unsafe { ffi::rdma_create_qp(id.id(), pd.as_ptr(), &mut attr) }) {
            return Err((id, e));
        }
        let caps = QpCaps {
            max_send_wr: attr.cap.max_send_wr,
            max_recv_wr: if srq.is_some() { 0 } else { attr.cap.max_recv_wr },
            max_inline_data: attr.cap.max_inline_data,
            max_send_sge: attr.cap.max_send_sge,
        };
        Ok(Qp { id, _send_cq: send_cq.clone(), _recv_cq: recv_cq.clone(), _srq: srq.cloned(), _pd: pd.clone(), caps })
    }

    /// The queue pair's address, as asynchronous events name it (compared, never followed).
    pub(crate) fn identity(&self) -> usize {
        // SAFETY: the id is live and has this queue pair.
        unsafe { (*self.id.id()).qp as usize }
    }

    /// The queue pair number, as work completions name it (`wc.qp_num`).
    pub(crate) fn qp_num(&self) -> u32 {
        // SAFETY: the id is live and has this queue pair.
        unsafe { (*(*self.id.id()).qp).qp_num }
    }

    /// The CM id the queue pair belongs to.
    pub(crate) fn id(&self) -> &CmId {
        &self.id
    }

    /// The capacities the device granted.
    pub(crate) fn caps(&self) -> QpCaps {
        self.caps
    }

    /// Moves the queue pair to the error state (`ibv_modify_qp`, `IBV_QPS_ERR`): every
    /// outstanding work request completes, flushed. `rdma_disconnect` does that on InfiniBand
    /// but only moves an iWARP queue pair to SQD (a graceful close of the stream), which leaves
    /// its posted receives outstanding.
    pub(crate) fn set_error(&self) -> io::Result<()> {
        // SAFETY: ibv_qp_attr is plain old data; zero is valid for every field.
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ffi::ibv_qp_state::IBV_QPS_ERR;
        // SAFETY: the QP is live while self lives; attr is valid for the call.
        cvt_nz(unsafe { ffi::ibv_modify_qp(self.raw(), &mut attr, ffi::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32) })
    }

    fn raw(&self) -> *mut ffi::ibv_qp {
        // SAFETY: the id is live and its QP was created in Qp::create.
        unsafe { (*self.id.id()).qp }
    }

    /// Posts `wrs` as one chain (one doorbell).
    ///
    /// # Safety
    ///
    /// Every request names memory (`addr`, `len`) inside a memory region of this queue pair's
    /// PD with key `lkey`, and that memory stays allocated, registered and unused by anything
    /// else until the request's completion is reaped (or, unsignaled, a later one's), or the
    /// queue pair is destroyed. A READ's memory is written by the device. A [`SendOp::Bind`]
    /// names a live window and a live region of this PD that holds the range, and that memory
    /// stays allocated while the window stays bound (until it is deallocated).
    #[allow(dead_code)] // The host benchmark's `SlabPath` (the data path before issue 47) builds its requests only.
    pub(crate) unsafe fn post_send(&self, wrs: &[SendWr], chains: &mut Chains) -> Result<(), PostError> {
        if wrs.is_empty() {
            return Ok(());
        }
        let base = chains.send_chain(wrs);
        let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
        // SAFETY: the QP is live while self lives; the chain and its SGEs are valid for the
        // call (`Chains::send_chain`); the memory they name is the caller's to keep valid (this
        // fn's contract).
        let ret = unsafe { ffi::ibv_post_send(self.raw(), base, &mut bad) };
        post_outcome(ret, bad, base, wrs.len())
    }
}

// Issue 47: the reactor posts its receives with `post_recv_run` (phase 2, step 2) and its sends
// with `post_send_run` from step 3; until then the latter serves only the host benchmark and
// the tests.
impl Qp {
    /// Posts the `n` send requests of `wrs` from position `first` (wrapping) as one chain, one
    /// doorbell: the run built in place (issue 47, `sys/wr.rs`).
    ///
    /// # Safety
    ///
    /// As [`Qp::post_send`], for every request of the run as `wrs` holds it.
    pub(crate) unsafe fn post_send_run(&self, wrs: &mut SendWrs, first: u32, n: u32) -> Result<(), PostError> {
        if n == 0 {
            return Ok(());
        }
        let (ret, bad) = wrs.with_chain(first, n, |head| {
            let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
            // SAFETY: the QP is live while self lives; the chain and its entries are valid for
            // the call (`SendWrs::with_chain`); the memory they name is the caller's to keep
            // valid (this fn's contract).
            let ret = unsafe { ffi::ibv_post_send(self.raw(), head, &mut bad) };
            (ret, bad)
        });
        run_outcome(ret, wrs.failed_position(bad, first, n), n)
    }

    /// Posts the `n` receive requests of `wrs` from position `first` (wrapping) as one chain.
    ///
    /// # Safety
    ///
    /// As [`Qp::post_send`], for every request of the run; the device writes the memory until
    /// the completion.
    pub(crate) unsafe fn post_recv_run(&self, wrs: &mut RecvWrs, first: u32, n: u32) -> Result<(), PostError> {
        if n == 0 {
            return Ok(());
        }
        let (ret, bad) = wrs.with_chain(first, n, |head| {
            let mut bad: *mut ffi::ibv_recv_wr = ptr::null_mut();
            // SAFETY: as in `post_send_run`.
            let ret = unsafe { ffi::ibv_post_recv(self.raw(), head, &mut bad) };
            (ret, bad)
        });
        run_outcome(ret, wrs.failed_position(bad, first, n), n)
    }
}

/// What a post of a run of `n` requests did, from its return value and the position of the
/// first refused request (`n` when it named none): as [`post_outcome`], whose reasons hold
/// (libsiw's refusal reported with 0 included).
fn run_outcome(ret: i32, at: u32, n: u32) -> Result<(), PostError> {
    let error = match cvt_nz(ret) {
        Err(e) => e,
        Ok(()) if at < n => io::Error::from_raw_os_error(nix::libc::EINVAL),
        Ok(()) => return Ok(()),
    };
    Err(PostError { posted: at as usize, error })
}

impl Chains {
    /// Builds `wrs` (at least one) into one linked chain of send requests in the reused
    /// buffers and returns its head, valid until these buffers are next used. Safe: it only
    /// writes memory it owns; what the requests name is the poster's to keep valid.
    #[inline]
    #[cfg_attr(not(feature = "bench-internals"), allow(dead_code))] // The host benchmark's `SlabPath` (the data path before issue 47).
    pub(crate) fn send_chain(&mut self, wrs: &[SendWr]) -> *mut ffi::ibv_send_wr {
        // Empty, the head would be the last chain's first request, still linked.
        debug_assert!(!wrs.is_empty(), "an empty send chain");
        // Built in place in the reused buffers: no work request is moved after it is written
        // (they were collected into `SmallVec`s, whose moves cost ~300 instructions a post:
        // issue 33). The chain buffer keeps its elements between posts (zeroed once, when it
        // grows) and every field of the ones used is written below, so no request is zeroed
        // whole per post (a `memset` of 128 bytes a request, as much as the rest of the post).
        let Chains { send: chain, sge: sges, .. } = self;
        sges.clear();
        // Two entries per request: the payload's, and its tail's (used when it has one).
        sges.reserve(2 * wrs.len());
        for w in wrs {
            let (taddr, tkey) = w.tail.unwrap_or((0, 0));
            sges.push(ffi::ibv_sge { addr: w.addr, length: w.len, lkey: w.lkey });
            sges.push(ffi::ibv_sge { addr: taddr, length: TAIL_LEN, lkey: tkey });
        }
        if chain.len() < wrs.len() {
            // SAFETY: ibv_send_wr is plain old data (integers, pointers, unions thereof); zero
            // is a valid value for every field.
            chain.resize_with(wrs.len(), || unsafe { std::mem::zeroed() });
        }
        let chain = &mut chain[..wrs.len()];
        // `sges` is not grown again before the post: the pointers into it stay valid.
        for ((w, raw), pair) in wrs.iter().zip(chain.iter_mut()).zip(sges.chunks_exact_mut(2)) {
            raw.wr_id = w.wr_id;
            raw.next = ptr::null_mut();
            let payload = w.len > 0;
            raw.num_sge = i32::from(payload) + i32::from(w.tail.is_some());
            // The payload's entry, or the tail's alone for an empty payload.
            raw.sg_list = if payload { &mut pair[0] } else { &mut pair[1] };
            // Every union is written whole (its largest member zeroed first), so nothing of
            // an earlier request in this slot is left for the provider to read.
            raw.wr.atomic = ffi::atomic_t { remote_addr: 0, compare_add: 0, swap: 0, rkey: 0 };
            raw.qp_type.xrc = ffi::xrc_t { remote_srqn: 0 };
            raw.imm_data_invalidated_rkey_union.imm_data = 0;
            raw.bind_mw_tso_union.bind_mw = ffi::bind_mw_t {
                mw: ptr::null_mut(),
                rkey: 0,
                bind_info: ffi::ibv_mw_bind_info { mr: ptr::null_mut(), addr: 0, length: 0, mw_access_flags: 0 },
            };
            let (opcode, imm, remote) = match w.op {
                SendOp::Send => (ffi::ibv_wr_opcode::IBV_WR_SEND, None, None),
                SendOp::SendImm(imm) => (ffi::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM, Some(imm), None),
                SendOp::Write(a, k) => (ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE, None, Some((a, k))),
                SendOp::WriteImm(a, k, imm) => {
                    (ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM, Some(imm), Some((a, k)))
                }
                SendOp::Read(a, k) => (ffi::ibv_wr_opcode::IBV_WR_RDMA_READ, None, Some((a, k))),
                SendOp::Bind(b) => {
                    raw.num_sge = 0;
                    raw.bind_mw_tso_union.bind_mw = ffi::bind_mw_t {
                        mw: b.mw,
                        rkey: b.rkey,
                        bind_info: ffi::ibv_mw_bind_info {
                            mr: b.mr,
                            addr: b.addr,
                            length: b.len,
                            mw_access_flags: b.access.bits(),
                        },
                    };
                    (ffi::ibv_wr_opcode::IBV_WR_BIND_MW, None, None)
                }
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
        }
        link(chain, |wr, next| wr.next = next);
        chain.as_mut_ptr()
    }

    /// Builds `wrs` (at least one) into one linked chain of receive requests (one SGE each)
    /// in the reused buffers and returns its head, valid until these buffers are next used.
    #[inline]
    pub(crate) fn recv_chain(&mut self, wrs: &[RecvWr]) -> *mut ffi::ibv_recv_wr {
        debug_assert!(!wrs.is_empty(), "an empty receive chain");
        let Chains { recv: chain, sge: sges, .. } = self;
        sges.clear();
        sges.extend(wrs.iter().map(|w| ffi::ibv_sge { addr: w.addr, length: w.len, lkey: w.lkey }));
        chain.clear();
        // `sges` is not grown again before the post: the pointers into it stay valid.
        chain.extend(wrs.iter().zip(sges.iter_mut()).map(|(w, sge)| ffi::ibv_recv_wr {
            wr_id: w.wr_id,
            next: ptr::null_mut(),
            sg_list: sge,
            num_sge: 1,
        }));
        link(chain, |wr, next| wr.next = next);
        chain.as_mut_ptr()
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: the QP was created by rdma_create_qp on this id and is destroyed once, here;
        // the id, CQs and PD are fields and drop after this.
        unsafe { ffi::rdma_destroy_qp(self.id.id()) };
    }
}

/// Builds `wrs` into one chain of receive requests (one SGE each) and hands it to `post`
/// (`ibv_post_recv` or `ibv_post_srq_recv`, which report the first refused request in `bad`);
/// returns how many were taken on failure.
pub(super) fn post_recv_chain(
    wrs: &[RecvWr],
    chains: &mut Chains,
    post: impl FnOnce(*mut ffi::ibv_recv_wr, &mut *mut ffi::ibv_recv_wr) -> i32,
) -> Result<(), PostError> {
    if wrs.is_empty() {
        return Ok(());
    }
    let base = chains.recv_chain(wrs);
    let mut bad: *mut ffi::ibv_recv_wr = ptr::null_mut();
    let ret = post(base, &mut bad);
    post_outcome(ret, bad, base, wrs.len())
}

/// Links a chain of work requests through their `next` pointers (the last one's stays NULL).
pub(super) fn link<T>(chain: &mut [T], set_next: impl Fn(&mut T, *mut T)) {
    let base = chain.as_mut_ptr();
    for i in 1..chain.len() {
        // SAFETY: i < len, so base + i - 1 and base + i name elements of the chain, which is
        // borrowed mutably for the whole loop and reached only through base.
        unsafe { set_next(&mut *base.add(i - 1), base.add(i)) };
    }
}

/// What a post call of a chain of `len` requests at `base` did, from its return value and
/// the first refused request it reported in `bad` (NULL before the call).
///
/// A refused request reported with a return value of 0 is a failure too: libsiw (rdma-core
/// `providers/siw/siw.c`, `siw_post_send`) overwrites the error of a request it refused with
/// the result of the doorbell it then rings for the requests before it, so it returns 0 having
/// posted only those. Its refusals are `EINVAL` (a request it cannot encode, such as inline
/// data beyond its limit), which is what such a failure is reported as. (A nonzero return
/// may also be a negated errno: libsiw returns `-EINVAL`; `cvt_nz` takes either sign.)
pub(super) fn post_outcome<T>(ret: i32, bad: *mut T, base: *mut T, len: usize) -> Result<(), PostError> {
    let error = match cvt_nz(ret) {
        Err(e) => e,
        Ok(()) if failed_index(bad, base, len) < len => io::Error::from_raw_os_error(nix::libc::EINVAL),
        Ok(()) => return Ok(()),
    };
    Err(PostError { posted: failed_index(bad, base, len), error })
}

/// Index of the failing request `bad` in a chain at `base` of `len`: the requests before it
/// were taken. When `bad` names none of them (NULL, or outside the chain: a provider that did
/// not say), every request is taken to be posted: reading it as "none posted" would hand back
/// buffers the device may still write. The caller then closes the queue pair, whose
/// destruction (or flush) settles them.
pub(super) fn failed_index<T>(bad: *mut T, base: *mut T, len: usize) -> usize {
    let (bad, base) = (bad as usize, base as usize);
    let size = std::mem::size_of::<T>().max(1);
    if bad < base || (bad - base) % size != 0 {
        return len;
    }
    let i = (bad - base) / size;
    i.min(len)
}

#[cfg(test)]
mod tests {
    use super::{failed_index, post_outcome};

    /// Hostile review (issue 22), finding 7: an unknown failing request was read as "nothing
    /// posted" (0), so the callers handed back receive buffers (or freed SRQ slots) the device
    /// might still write. Unknown now means "all posted".
    #[test]
    fn an_unknown_failing_request_means_all_were_posted() {
        let mut chain = [0u64; 5];
        let base = chain.as_mut_ptr();
        // SAFETY: offsets within (or one past) the array.
        let at = |i: usize| unsafe { base.add(i) };
        assert_eq!(failed_index(at(0), base, 5), 0, "the first refused: none posted");
        assert_eq!(failed_index(at(3), base, 5), 3);
        assert_eq!(failed_index(std::ptr::null_mut(), base, 5), 5, "NULL: unknown, all taken as posted");
        assert_eq!(failed_index(at(5), base, 5), 5, "past the chain: all");
        assert_eq!(failed_index(base.wrapping_sub(1), base, 5), 5, "before the chain: all");
        assert_eq!(failed_index(base.cast::<u8>().wrapping_add(3).cast::<u64>(), base, 5), 5, "not a request: all");
    }

    /// libsiw returns 0 from a post that refused a request part-way (the doorbell's result
    /// overwrites the refusal), with the refused request in `bad`: that is a failure at it, not
    /// a success, or the requests after it would wait for completions that never come.
    #[test]
    fn a_refused_request_reported_with_success_is_a_failure() {
        let mut chain = [0u64; 8];
        let base = chain.as_mut_ptr();
        // SAFETY: an offset within the array.
        let sixth = unsafe { base.add(5) };
        let e = post_outcome(0, sixth, base, 8).expect_err("refused at the sixth");
        assert_eq!((e.posted, e.error.raw_os_error()), (5, Some(nix::libc::EINVAL)));
        assert!(post_outcome(0, std::ptr::null_mut(), base, 8).is_ok(), "NULL: all posted");
        let e = post_outcome(-nix::libc::EINVAL, sixth, base, 8).expect_err("a negated errno");
        assert_eq!((e.posted, e.error.raw_os_error()), (5, Some(nix::libc::EINVAL)));
        let e = post_outcome(nix::libc::ENOMEM, std::ptr::null_mut(), base, 8).expect_err("unknown request");
        assert_eq!((e.posted, e.error.raw_os_error()), (8, Some(nix::libc::ENOMEM)));
    }
}
