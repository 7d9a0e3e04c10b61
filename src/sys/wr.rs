//! Work requests built in place (issue 47): a connection's send and receive work requests in
//! arrays as long as its operation rings (`reactor/data/ring.rs`), linked once into a circle,
//! so a post writes only what changes per request and hands the device a run of the circle cut
//! at its end.
//!
//! Request `i` of an array belongs to ring position `i` (mod the array's length, a power of
//! two): its scatter entries are its own (`2 i` and `2 i + 1` for a send, the payload's and a
//! tail's; `i` for a receive), pointed at once, when the array is made, and its `next` names
//! request `i + 1` (the last names the first). A post of `n` requests from position `first`
//! writes their fields, sets the `next` of the run's last request to NULL for the call (the
//! device reads a chain until a NULL), and links it again afterwards ([`SendWrs::with_chain`]).
//! No request is built elsewhere and copied: the reactor's plan writes each field once, here.
//!
//! What a provider reads of a request depends on its opcode (rdma-core's providers switch on
//! it: rxe `convert_send_wr`, siw `siw_post_send`, mlx5 `_mlx5_post_send`), so a field no
//! opcode of ours reads is never written, and the fields each opcode reads are written for
//! every request: `wr_id`, `opcode`, `send_flags`, `num_sge`, `sg_list` and the entries it
//! names, the immediate data (zero when the request has none), the whole `wr` union (the remote
//! address and key of an RDMA request, zeros otherwise), and a bind's `bind_mw` (zeroed again
//! when the slot next holds another opcode). `qp_type` (XRC and UD only) stays zero.
//!
//! The arrays are reached only through the raw pointers they were allocated as, the links
//! included, so the pointers the device follows keep the provenance they were made with; no
//! reference to a whole array is ever formed.
#![allow(unsafe_code)]
// Issue 47 phase 2, step 2: the reactor posts its receives from `RecvWrs`; `SendWrs` is step 3's
// and used only by the host benchmark (`bench_internals::Path`) and the unit tests until then.
// Dead-code warnings are therefore allowed in every build but a test build with
// `bench-internals` (`cargo test --all-features`), the only one that compiles every user: there
// the compiler reports dead code here, and the items unused even there carry their own allow.
#![cfg_attr(not(all(test, feature = "bench-internals")), allow(dead_code))]

use std::ptr::{self, NonNull};

use rdma_sys as ffi;

use super::qp::SendOp;
use crate::proto::transport::TAIL_LEN;

/// The C structs these arrays hold: integers and pointers (unions thereof), for which zero is a
/// valid value of every field.
///
/// # Safety
///
/// An implementor is valid when all its bytes are zero.
unsafe trait Zeroable {}

// SAFETY: integers, pointers and unions of them (rdma-sys' bindings of `struct ibv_send_wr`).
unsafe impl Zeroable for ffi::ibv_send_wr {}
// SAFETY: integers and pointers (`struct ibv_recv_wr`).
unsafe impl Zeroable for ffi::ibv_recv_wr {}
// SAFETY: integers (`struct ibv_sge`).
unsafe impl Zeroable for ffi::ibv_sge {}

/// An array of `len` (at least one) zeroed `T`s on the heap, as its raw pointer.
fn alloc_zeroed<T: Zeroable>(len: usize) -> NonNull<T> {
    debug_assert!(len > 0);
    // SAFETY: zero is a valid `T` (`Zeroable`).
    let v: Vec<T> = (0..len).map(|_| unsafe { std::mem::zeroed() }).collect();
    let raw = Box::into_raw(v.into_boxed_slice()) as *mut T;
    // SAFETY: `Box::into_raw` never returns NULL.
    unsafe { NonNull::new_unchecked(raw) }
}

/// Frees what [`alloc_zeroed`] made.
///
/// # Safety
///
/// `p` and `len` are an allocation of [`alloc_zeroed`], freed once, with nothing reading it
/// afterwards.
unsafe fn free<T>(p: NonNull<T>, len: usize) {
    // SAFETY: the caller's contract: a boxed slice of exactly `len`, made by `alloc_zeroed`.
    drop(unsafe { Box::from_raw(ptr::slice_from_raw_parts_mut(p.as_ptr(), len)) });
}

/// The position in a chain of `n` requests starting at array index `first` (of an array of
/// `cap`, a power of two, at `base`) of the request `bad` names: the requests before it were
/// taken. When `bad` names none of the chain's requests (NULL, outside the array, not a
/// request's address, or a request of the array outside the chain), every request is taken to
/// be posted (`qp::failed_index`'s reasoning: reading it as "none posted" would hand back
/// memory the device may still use; the caller closes the queue pair, which settles them).
fn failed_position<T>(bad: *const T, base: *const T, cap: u32, first: u32, n: u32) -> u32 {
    let (bad, base) = (bad as usize, base as usize);
    let size = std::mem::size_of::<T>().max(1);
    let Some(off) = bad.checked_sub(base).filter(|off| off % size == 0) else { return n };
    let i = off / size;
    if i >= cap as usize {
        return n;
    }
    let pos = (i as u32).wrapping_sub(first) & cap.wrapping_sub(1);
    if pos < n {
        pos
    } else {
        n
    }
}

/// One connection's send work requests, linked in a circle ([module docs](self)).
pub(crate) struct SendWrs {
    wrs: NonNull<ffi::ibv_send_wr>,
    /// Two per request: its payload's and its tail's.
    sges: NonNull<ffi::ibv_sge>,
    /// Requests, a power of two (0: none).
    cap: u32,
}

impl std::fmt::Debug for SendWrs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendWrs").field("cap", &self.cap).finish()
    }
}

impl SendWrs {
    /// `cap` requests (a power of two; 0 makes one), linked and pointed at their entries. An
    /// array always has a request, so every index masked by `cap - 1` names one.
    pub(crate) fn new(cap: u32) -> SendWrs {
        let cap = cap.max(1);
        assert!(cap.is_power_of_two(), "a send array of {cap}");
        let wrs = alloc_zeroed::<ffi::ibv_send_wr>(cap as usize);
        let sges = alloc_zeroed::<ffi::ibv_sge>(2 * cap as usize);
        for i in 0..cap as usize {
            // SAFETY: i < cap and 2 i + 1 < 2 cap: inside the two allocations, which this value
            // owns; the pointers stored are derived from their bases.
            unsafe {
                let w = wrs.as_ptr().add(i);
                (*w).next = wrs.as_ptr().add((i + 1) & (cap as usize - 1));
                (*w).sg_list = sges.as_ptr().add(2 * i);
                (*sges.as_ptr().add(2 * i + 1)).length = TAIL_LEN;
            }
        }
        SendWrs { wrs, sges, cap }
    }

    /// The requests it holds.
    pub(crate) fn capacity(&self) -> u32 {
        self.cap
    }

    /// Writes request `i` (mod the capacity): operation `op` on the local memory `(addr, len,
    /// lkey)`, with a second scatter entry `tail` (4 bytes at `(addr, lkey)`) on a transport
    /// without immediate data, asking for a completion when `signaled`, inline when `inline`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn write(
        &mut self,
        i: u32,
        wr_id: u64,
        op: SendOp,
        sge: (u64, u32, u32),
        tail: Option<(u64, u32)>,
        signaled: bool,
        inline: bool,
    ) {
        let w = self.common(i, wr_id, sge, tail, signaled, inline);
        let (opcode, imm) = match op {
            SendOp::Send => (ffi::ibv_wr_opcode::IBV_WR_SEND, 0),
            SendOp::SendImm(imm) => (ffi::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM, imm),
            SendOp::Write(remote_addr, rkey) => {
                w.wr.rdma = ffi::rdma_t { remote_addr, rkey };
                (ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE, 0)
            }
            SendOp::WriteImm(remote_addr, rkey, imm) => {
                w.wr.rdma = ffi::rdma_t { remote_addr, rkey };
                (ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM, imm)
            }
            SendOp::Read(remote_addr, rkey) => {
                w.wr.rdma = ffi::rdma_t { remote_addr, rkey };
                (ffi::ibv_wr_opcode::IBV_WR_RDMA_READ, 0)
            }
            SendOp::Bind(b) => {
                w.num_sge = 0;
                w.bind_mw_tso_union.bind_mw = ffi::bind_mw_t {
                    mw: b.mw,
                    rkey: b.rkey,
                    bind_info: ffi::ibv_mw_bind_info {
                        mr: b.mr,
                        addr: b.addr,
                        length: b.len,
                        mw_access_flags: b.access.bits(),
                    },
                };
                (ffi::ibv_wr_opcode::IBV_WR_BIND_MW, 0)
            }
        };
        set_opcode(w, opcode, imm);
    }

    /// [`SendWrs::write`] of a SEND (with immediate data when `imm` is given): the common
    /// request, without matching an operation.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn write_send(
        &mut self,
        i: u32,
        wr_id: u64,
        imm: Option<u32>,
        sge: (u64, u32, u32),
        tail: Option<(u64, u32)>,
        signaled: bool,
        inline: bool,
    ) {
        let w = self.common(i, wr_id, sge, tail, signaled, inline);
        match imm {
            Some(imm) => set_opcode(w, ffi::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM, imm),
            None => set_opcode(w, ffi::ibv_wr_opcode::IBV_WR_SEND, 0),
        }
    }

    /// [`SendWrs::write_send`] without a tail: a SEND (with immediate data when `imm` is given)
    /// of `(addr, len, lkey)`, its one scatter entry (none when `len` is 0).
    #[inline(always)]
    pub(crate) fn write_message(
        &mut self,
        i: u32,
        wr_id: u64,
        imm: Option<u32>,
        sge: (u64, u32, u32),
        signaled: bool,
        inline: bool,
    ) {
        let w = self.common(i, wr_id, sge, None, signaled, inline);
        match imm {
            Some(imm) => set_opcode(w, ffi::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM, imm),
            None => set_opcode(w, ffi::ibv_wr_opcode::IBV_WR_SEND, 0),
        }
    }

    /// The fields every request writes ([module docs](self)), leaving the opcode and immediate
    /// data to [`set_opcode`]: request `i` (mod the capacity), for the caller to finish.
    #[inline(always)]
    fn common(
        &mut self,
        i: u32,
        wr_id: u64,
        sge: (u64, u32, u32),
        tail: Option<(u64, u32)>,
        signaled: bool,
        inline: bool,
    ) -> &mut ffi::ibv_send_wr {
        let i = (i & (self.cap - 1)) as usize;
        // SAFETY: i < cap (cap is a power of two, at least 1: `new`): request i and entries 2 i,
        // 2 i + 1 are inside the allocations this value owns, and `&mut self` makes this the
        // only access to them while the reference lives.
        unsafe {
            let w = &mut *self.wrs.as_ptr().add(i);
            let pair = self.sges.as_ptr().add(2 * i);
            let (addr, len, lkey) = sge;
            *pair = ffi::ibv_sge { addr, length: len, lkey };
            let payload = len > 0;
            let mut num = i32::from(payload);
            if let Some((taddr, tkey)) = tail {
                let t = &mut *pair.add(1);
                t.addr = taddr;
                t.lkey = tkey;
                num += 1;
            }
            w.num_sge = num;
            // The payload's entry, or the tail's alone for an empty payload.
            w.sg_list = if payload || tail.is_none() { pair } else { pair.add(1) };
            w.wr_id = wr_id;
            if w.opcode == ffi::ibv_wr_opcode::IBV_WR_BIND_MW {
                // The slot held a bind: nothing of it is left (a bind writes it again).
                w.bind_mw_tso_union.bind_mw = ffi::bind_mw_t {
                    mw: ptr::null_mut(),
                    rkey: 0,
                    bind_info: ffi::ibv_mw_bind_info { mr: ptr::null_mut(), addr: 0, length: 0, mw_access_flags: 0 },
                };
            }
            w.wr.atomic = ffi::atomic_t { remote_addr: 0, compare_add: 0, swap: 0, rkey: 0 };
            let mut flags = 0;
            if signaled {
                flags |= ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
            }
            if inline {
                flags |= ffi::ibv_send_flags::IBV_SEND_INLINE.0;
            }
            w.send_flags = flags;
            w
        }
    }

    /// Makes request `i` ask for a completion (the last of a chain).
    #[inline(always)]
    pub(crate) fn set_signaled(&mut self, i: u32) {
        let i = (i & (self.cap - 1)) as usize;
        // SAFETY: i < cap (a power of two, at least 1), inside the allocation; `&mut self`: the
        // only access.
        unsafe { (*self.wrs.as_ptr().add(i)).send_flags |= ffi::ibv_send_flags::IBV_SEND_SIGNALED.0 };
    }

    /// Makes request `i` ask to be sent inline (`Reactor::inject_refused_send`: a request
    /// longer than the queue pair's inline limit is refused at post time).
    #[cfg(feature = "fault-injection")]
    pub(crate) fn force_inline(&mut self, i: u32) {
        let i = (i & (self.cap - 1)) as usize;
        // SAFETY: i < cap (a power of two, at least 1), inside the allocation; `&mut self`: the
        // only access.
        unsafe { (*self.wrs.as_ptr().add(i)).send_flags |= ffi::ibv_send_flags::IBV_SEND_INLINE.0 };
    }

    /// True when request `i` asks for a completion.
    pub(crate) fn signaled(&self, i: u32) -> bool {
        let i = (i & (self.cap - 1)) as usize;
        // SAFETY: i < cap (a power of two, at least 1), inside the allocation.
        unsafe { (*self.wrs.as_ptr().add(i)).send_flags & ffi::ibv_send_flags::IBV_SEND_SIGNALED.0 != 0 }
    }

    /// Calls `f` with the head of the chain of the `n` requests (at least one, at most the
    /// capacity) from position `first`: their run of the circle with its last request's `next`
    /// set to NULL, linked again once `f` returns. The chain is valid only during `f`; what its
    /// requests name is the caller's to keep valid for a post.
    #[inline(always)]
    pub(crate) fn with_chain<R>(&mut self, first: u32, n: u32, f: impl FnOnce(*mut ffi::ibv_send_wr) -> R) -> R {
        assert!(n >= 1 && n <= self.cap, "a chain of {n} of {} requests", self.cap);
        let mask = self.cap - 1;
        let (first, last) = ((first & mask) as usize, (first.wrapping_add(n - 1) & mask) as usize);
        // SAFETY: first and last < cap, inside the allocation; `&mut self`: nothing else reads
        // or writes the array while the chain is cut, and the link is restored before returning
        // (also should `f` unwind: the guard).
        unsafe {
            let base = self.wrs.as_ptr();
            let after = base.add((last + 1) & mask as usize);
            (*base.add(last)).next = ptr::null_mut();
            let relink = Relink(base.add(last), after);
            let r = f(base.add(first));
            drop(relink);
            r
        }
    }

    /// The position in the chain of `n` requests from `first` of the request `bad` a failed
    /// post named ([`failed_position`]).
    pub(crate) fn failed_position(&self, bad: *const ffi::ibv_send_wr, first: u32, n: u32) -> u32 {
        failed_position(bad, self.wrs.as_ptr(), self.cap, first & (self.cap - 1), n)
    }

    /// What request `i` says, in plain values (tests outside `sys`).
    #[cfg(test)]
    pub(crate) fn view(&self, i: u32) -> SendView {
        let w = self.get(i);
        let op = match w.opcode {
            ffi::ibv_wr_opcode::IBV_WR_SEND => "send",
            ffi::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM => "send_imm",
            ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE => "write",
            ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM => "write_imm",
            ffi::ibv_wr_opcode::IBV_WR_RDMA_READ => "read",
            ffi::ibv_wr_opcode::IBV_WR_BIND_MW => "bind",
            _ => "?",
        };
        // SAFETY: plain data; the entry named is the request's own, in the array.
        let (imm, len) = unsafe {
            (
                u32::from_be(w.imm_data_invalidated_rkey_union.imm_data),
                if w.num_sge > 0 { (*w.sg_list).length } else { 0 },
            )
        };
        SendView {
            wr_id: w.wr_id,
            op,
            imm,
            len,
            signaled: w.send_flags & ffi::ibv_send_flags::IBV_SEND_SIGNALED.0 != 0,
            inline: w.send_flags & ffi::ibv_send_flags::IBV_SEND_INLINE.0 != 0,
        }
    }

    /// Request `i` as written (tests and assertions).
    #[cfg(test)]
    fn get(&self, i: u32) -> &ffi::ibv_send_wr {
        // SAFETY: tests call it with i < cap; a shared view while no write happens (`&self`).
        unsafe { &*self.wrs.as_ptr().add((i & (self.cap - 1)) as usize) }
    }
}

/// Sets a request's opcode and immediate data (zero when it has none), last.
#[inline(always)]
fn set_opcode(w: &mut ffi::ibv_send_wr, opcode: ffi::ibv_wr_opcode::Type, imm: u32) {
    w.opcode = opcode;
    w.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
}

/// A send request in plain values ([`SendWrs::view`], tests).
#[cfg(test)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SendView {
    pub(crate) wr_id: u64,
    pub(crate) op: &'static str,
    /// The immediate data, host order (0 when none).
    pub(crate) imm: u32,
    /// The first scatter entry's length (0 without one).
    pub(crate) len: u32,
    pub(crate) signaled: bool,
    pub(crate) inline: bool,
}

/// Restores a cut chain's link when dropped: `(request, what its next was)`.
struct Relink<T: HasNext>(*mut T, *mut T);

impl<T: HasNext> Drop for Relink<T> {
    fn drop(&mut self) {
        // SAFETY: made by `with_chain` from pointers into the array it holds `&mut` for, and
        // dropped inside that call.
        unsafe { (*self.0).set_next(self.1) };
    }
}

/// A request with a `next` link.
trait HasNext {
    fn set_next(&mut self, next: *mut Self);
}

impl HasNext for ffi::ibv_send_wr {
    fn set_next(&mut self, next: *mut Self) {
        self.next = next;
    }
}

impl HasNext for ffi::ibv_recv_wr {
    fn set_next(&mut self, next: *mut Self) {
        self.next = next;
    }
}

impl Drop for SendWrs {
    fn drop(&mut self) {
        // SAFETY: both made by `alloc_zeroed` with these lengths in `new`, freed once, here.
        unsafe {
            free(self.wrs, self.cap as usize);
            free(self.sges, 2 * self.cap as usize);
        }
    }
}

/// One connection's receive work requests, linked in a circle, one scatter entry each
/// ([module docs](self)).
pub(crate) struct RecvWrs {
    wrs: NonNull<ffi::ibv_recv_wr>,
    sges: NonNull<ffi::ibv_sge>,
    cap: u32,
}

impl std::fmt::Debug for RecvWrs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvWrs").field("cap", &self.cap).finish()
    }
}

impl RecvWrs {
    /// `cap` requests (a power of two; 0 makes one), linked and pointed at their entries.
    pub(crate) fn new(cap: u32) -> RecvWrs {
        let cap = cap.max(1);
        assert!(cap.is_power_of_two(), "a receive array of {cap}");
        let wrs = alloc_zeroed::<ffi::ibv_recv_wr>(cap as usize);
        let sges = alloc_zeroed::<ffi::ibv_sge>(cap as usize);
        for i in 0..cap as usize {
            // SAFETY: i < cap: inside both allocations, owned here; pointers from their bases.
            unsafe {
                let w = wrs.as_ptr().add(i);
                (*w).next = wrs.as_ptr().add((i + 1) & (cap as usize - 1));
                (*w).sg_list = sges.as_ptr().add(i);
                (*w).num_sge = 1;
            }
        }
        RecvWrs { wrs, sges, cap }
    }

    /// The requests it holds.
    pub(crate) fn capacity(&self) -> u32 {
        self.cap
    }

    /// Writes request `i` (mod the capacity): a receive into `(addr, len, lkey)`.
    #[inline(always)]
    pub(crate) fn write(&mut self, i: u32, wr_id: u64, addr: u64, len: u32, lkey: u32) {
        let i = (i & (self.cap - 1)) as usize;
        // SAFETY: i < cap (a power of two, at least 1): inside the allocations; `&mut self`: the
        // only access.
        unsafe {
            (*self.wrs.as_ptr().add(i)).wr_id = wr_id;
            *self.sges.as_ptr().add(i) = ffi::ibv_sge { addr, length: len, lkey };
        }
    }

    /// As [`SendWrs::with_chain`], for receives.
    #[inline(always)]
    pub(crate) fn with_chain<R>(&mut self, first: u32, n: u32, f: impl FnOnce(*mut ffi::ibv_recv_wr) -> R) -> R {
        assert!(n >= 1 && n <= self.cap, "a chain of {n} of {} requests", self.cap);
        let mask = self.cap - 1;
        let (first, last) = ((first & mask) as usize, (first.wrapping_add(n - 1) & mask) as usize);
        // SAFETY: as in `SendWrs::with_chain`.
        unsafe {
            let base = self.wrs.as_ptr();
            let after = base.add((last + 1) & mask as usize);
            (*base.add(last)).next = ptr::null_mut();
            let relink = Relink(base.add(last), after);
            let r = f(base.add(first));
            drop(relink);
            r
        }
    }

    /// As [`SendWrs::failed_position`].
    pub(crate) fn failed_position(&self, bad: *const ffi::ibv_recv_wr, first: u32, n: u32) -> u32 {
        failed_position(bad, self.wrs.as_ptr(), self.cap, first & (self.cap - 1), n)
    }

    #[cfg(test)]
    #[allow(dead_code)] // A test helper of the receive array, unused by its tests so far.
    fn get(&self, i: u32) -> &ffi::ibv_recv_wr {
        // SAFETY: tests call it with i < cap; a shared view while no write happens.
        unsafe { &*self.wrs.as_ptr().add((i & (self.cap - 1)) as usize) }
    }
}

impl Drop for RecvWrs {
    fn drop(&mut self) {
        // SAFETY: both made by `alloc_zeroed` with these lengths in `new`, freed once, here.
        unsafe {
            free(self.wrs, self.cap as usize);
            free(self.sges, self.cap as usize);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::qp::SendOp;

    /// Walks the chain from `head` (at most `limit` requests), returning each one's `wr_id`.
    fn walk_send(head: *mut ffi::ibv_send_wr, limit: usize) -> Vec<u64> {
        let mut ids = Vec::new();
        let mut p = head;
        while !p.is_null() && ids.len() <= limit {
            // SAFETY: the chain's requests live in the array `with_chain` lends for the call.
            unsafe {
                ids.push((*p).wr_id);
                p = (*p).next;
            }
        }
        ids
    }

    #[test]
    fn a_chain_is_a_run_of_the_circle_cut_at_its_end_and_linked_again() {
        let mut w = SendWrs::new(4);
        for i in 0..4 {
            w.write(i, 100 + u64::from(i), SendOp::Send, (0x1000, 64, 7), None, false, false);
        }
        // A run that wraps: positions 3, 0, 1.
        let ids = w.with_chain(3, 3, |head| walk_send(head, 8));
        assert_eq!(ids, vec![103, 100, 101]);
        // Linked again: a run of the whole circle from 2.
        let ids = w.with_chain(6, 4, |head| walk_send(head, 8));
        assert_eq!(ids, vec![102, 103, 100, 101]);
        assert_eq!(w.get(1).next as *const _, w.get(2) as *const _, "the circle is whole again");
    }

    #[test]
    fn each_opcode_writes_what_it_is_read_for_and_a_bind_leaves_nothing_behind() {
        let mut w = SendWrs::new(2);
        w.write(0, 1, SendOp::SendImm(0x8000_0003), (0x2000, 16, 9), None, true, true);
        let r = w.get(0);
        assert_eq!(r.opcode, ffi::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM);
        // SAFETY: union fields of plain integers.
        unsafe {
            assert_eq!(u32::from_be(r.imm_data_invalidated_rkey_union.imm_data), 0x8000_0003);
            assert_eq!((*r.sg_list).addr, 0x2000);
        }
        assert_eq!(r.num_sge, 1);
        assert_eq!(r.send_flags, ffi::ibv_send_flags::IBV_SEND_SIGNALED.0 | ffi::ibv_send_flags::IBV_SEND_INLINE.0);
        // A credit-only message on RoCE: no entry at all.
        w.write(1, 2, SendOp::SendImm(0x8000_0000), (0, 0, 0), None, false, false);
        assert_eq!(w.get(1).num_sge, 0);
        assert!(!w.signaled(1));
        w.set_signaled(1);
        assert!(w.signaled(1));
        // On iWARP: the tail alone for an empty payload, after the payload otherwise.
        w.write(1, 3, SendOp::Send, (0, 0, 0), Some((0x9000, 5)), false, false);
        // SAFETY: the entry the request points at, in the array.
        unsafe {
            assert_eq!(((*w.get(1).sg_list).addr, (*w.get(1).sg_list).length), (0x9000, TAIL_LEN));
        }
        assert_eq!(w.get(1).num_sge, 1);
        w.write(1, 3, SendOp::Write(0xAB, 0xCD), (0x3000, 8, 1), Some((0x9004, 5)), false, false);
        assert_eq!(w.get(1).num_sge, 2);
        // SAFETY: as above.
        unsafe {
            assert_eq!((*w.get(1).sg_list).addr, 0x3000);
            assert_eq!(((*w.get(1).sg_list.add(1)).addr, (*w.get(1).sg_list.add(1)).length), (0x9004, TAIL_LEN));
            assert_eq!((w.get(1).wr.rdma.remote_addr, w.get(1).wr.rdma.rkey), (0xAB, 0xCD));
            assert_eq!(w.get(1).imm_data_invalidated_rkey_union.imm_data, 0, "no immediate data: zero");
        }
        // A bind, then a send in the same slot: the bind's fields are cleared.
        let b = crate::sys::qp::Bind {
            mw: ptr::null_mut(),
            rkey: 77,
            mr: ptr::null_mut(),
            addr: 1,
            len: 2,
            access: crate::sys::mr::Access::empty(),
        };
        w.write(0, 4, SendOp::Bind(b), (0, 0, 0), None, true, false);
        assert_eq!((w.get(0).opcode, w.get(0).num_sge), (ffi::ibv_wr_opcode::IBV_WR_BIND_MW, 0));
        w.write(0, 5, SendOp::Send, (0x10, 4, 1), None, false, false);
        // SAFETY: union of plain data.
        unsafe { assert_eq!(w.get(0).bind_mw_tso_union.bind_mw.rkey, 0) };
    }

    #[test]
    fn receives_chain_like_sends() {
        let mut r = RecvWrs::new(8);
        for i in 5..10u32 {
            r.write(i, u64::from(i), 0x100 * u64::from(i), 64, 3);
        }
        let ids = r.with_chain(5, 5, |head| {
            let mut ids = Vec::new();
            let mut p = head;
            // SAFETY: the chain lent for the call.
            unsafe {
                while !p.is_null() && ids.len() < 16 {
                    ids.push(((*p).wr_id, (*(*p).sg_list).addr));
                    p = (*p).next;
                }
            }
            ids
        });
        assert_eq!(ids, (5..10u64).map(|i| (i, 0x100 * i)).collect::<Vec<_>>());
    }

    /// A failed post's `bad` is placed in the chain, wrapping; anything it cannot name means
    /// every request was taken.
    #[test]
    fn a_refused_request_is_found_in_a_wrapping_chain_and_unknown_means_all() {
        let w = SendWrs::new(8);
        let base = w.wrs.as_ptr();
        // SAFETY: offsets within (or one past) the array.
        let at = |i: usize| unsafe { base.add(i) } as *const ffi::ibv_send_wr;
        assert_eq!(w.failed_position(at(6), 6, 4), 0, "the first refused: none posted");
        assert_eq!(w.failed_position(at(1), 6, 4), 3, "positions 6, 7, 0 taken");
        assert_eq!(w.failed_position(at(3), 6, 4), 4, "a request outside the chain: all");
        assert_eq!(w.failed_position(ptr::null(), 6, 4), 4, "NULL: all");
        assert_eq!(w.failed_position(at(8), 6, 4), 4, "past the array: all");
        assert_eq!(w.failed_position(base.wrapping_sub(1), 6, 4), 4, "before it: all");
        let odd = (base as usize + 3) as *const ffi::ibv_send_wr;
        assert_eq!(w.failed_position(odd, 6, 4), 4, "not a request: all");
        assert_eq!(w.failed_position(at(2), 14, 8), 4, "first taken modulo the capacity");
    }

    /// An array asked for no request has one, so any index is in it.
    #[test]
    fn an_array_always_has_a_request() {
        let mut s = SendWrs::new(0);
        let mut r = RecvWrs::new(0);
        assert_eq!((s.capacity(), r.capacity()), (1, 1));
        assert!(!s.signaled(3));
        s.write(u32::MAX, 1, SendOp::Send, (0, 0, 0), None, true, false);
        assert!(s.signaled(0));
        r.write(7, 2, 0x10, 4, 1);
        assert_eq!(r.with_chain(9, 1, read_wr_id), 2);
    }

    fn read_wr_id(head: *mut ffi::ibv_recv_wr) -> u64 {
        // SAFETY: the chain lent for the call.
        unsafe { (*head).wr_id }
    }
}
