//! A connection's two lanes (issue 47): its operations from submission to completion on the
//! queue pair's operation rings (`ring.rs`), with their work requests built in place
//! (`sys/wr.rs`) while credits, immediate data and signaling are decided in the same loop.
//!
//! This is what `OpEntry` in the global operation slab, `SendQueue`/`RecvQueue` and their key
//! queues, `Planned`, `SendWr` and `Chains` did, on one structure per connection. The reactor's
//! receives are on it since issue 47 phase 2, step 2, and its sends since step 3
//! (`ConnEntry::lanes`, DATAPATH.md); the old structures are kept only as the differential
//! test's oracle and the host benchmark's baseline.
//!
//! - **Submission** makes the operation's [`Slot`] in place at its ring's tail
//!   ([`Lanes::submit_send_with`], [`Lanes::submit_recv_with`]; its owner marks set, and its
//!   scatter entry decided in the same look at the buffer's chunk), after `Core::submit`'s
//!   checks (the connection's gate, `gate.rs`) let it through.
//! - **Posting** ([`Lanes::plan_recvs`], [`Lanes::plan_sends`]) walks the queued slots from the
//!   ring's `posted` counter and writes each one's work request into the connection's
//!   pre-linked array at the same position, from the slot alone; the caller posts that run
//!   (`Qp::post_recv_run`, `Qp::post_send_run`) and reports what the device took
//!   ([`Lanes::recvs_posted`], [`Lanes::sends_posted`]). The common state (no hello, nudge,
//!   hold or close handshake, nothing beyond the ring, immediate data) plans on a straight path
//!   of its own, and a single queued send straighter still (`plan_plain`, `plan_single`).
//! - **Completion** decodes the position from the `wr_id`, checks it against the posted window
//!   and takes the operation apart in its slot, its parts moved straight into the completion
//!   the handler gets ([`Lanes::recv_completed`] then [`Lanes::take_recv`];
//!   [`Lanes::send_completed`] then [`Lanes::next_sent`] and [`SentOp::take`] for each
//!   operation a signaled completion completes). `Lanes::pop_sent` does the same in one step
//!   for the tests, and [`Slot::into_done`] for a refused request or teardown.
//!
//! **The rules kept, as `send_queue/`'s module docs state them.** A send-queue operation is
//! posted only with a free send slot, CQ room for its completion ([`CqRoom`]) and, when it
//! consumes a peer receive under flow control, a credit (`proto/flow.rs`, unchanged: the
//! reserve, no echo, the farewell that leaves an answer possible). The send queue is FIFO; an
//! operation waiting for credit holds back the ones behind it. Credit-only messages, an iWARP
//! client's hello and nudge and the close handshake's farewells are slots of the runtime's own
//! (`CONTROL`), made during planning and put ahead of the data that waits (the ring's
//! insertion, a shift of the queued slots: the cold path). One request in `signal_every` asks
//! for a completion, and so does the last of each chain; a signaled completion completes the
//! unsignaled requests before it, in order, each giving back its CQ entry. Receives are posted
//! before sends (a grant never goes ahead of the receive it stands for), and a receive re-posted
//! after a credit-only message consumed it goes ahead of the queued ones. A chain the device
//! refused part way hands back the requests it did not take (failed with the errno), and the
//! unsignaled requests it took after its last signaled one are no longer awaited
//! ([`Lanes::awaited`]).
//!
//! **The out-of-order receive cases** ([`ring`](super::ring)'s module docs): a re-post after a
//! credit-only message is an insertion at the front of the queued receives; a receive whose
//! message was refused (beyond the peer's credit, or a broken frame) leaves the ring for the
//! side list `returned`, in order, never posted on this queue pair again (the connection
//! closes), cancelled at teardown or posted first on a reconnection's queue pair; saying
//! goodbye, only the queued re-posts (a prefix of the queued receives) are posted.
//!
//! **No token names two objects.** A work request's `wr_id` is its ring's base (the
//! connection's index and queue-pair epoch, the direction) and its position; a completion is
//! accepted only if the position is in its ring's posted window and its slot holds an
//! operation. A stale completion (an old queue pair's, a duplicate, a hostile value) reaches no
//! operation: [`Lanes::recv_completed`] says [`RecvOutcome::Stale`] and
//! [`Lanes::send_completed`] `None`, for the caller to count.
//!
//! Generic over the pool buffer ([`LaneBuf`]): the pool's `Buf` of today and the index-based
//! `IndexBuf` (`sys/pool/index.rs`), so the reactor can move onto the lanes before or after it
//! moves onto the new buffer.
//!
//! No FFI: the work-request arrays are `sys`'s, posted by `sys::qp`. Its one `unsafe` block
//! reads a received tail out of caller memory (`Slot::received_tail`): that memory is the
//! application's under `Conn::submit_raw`'s contract, which only the slot holding the receive
//! can vouch for, so the read stays here with its SAFETY argument. Unit tests below, and a
//! differential test that drives `SendQueue` (`send_queue/`, compiled for it) and the lanes with
//! the same random scripts and compares every chain they post.

use std::rc::Rc;

use crate::proto::flow::{Farewell, Flow, Imm};
use crate::proto::op::{OpCode, OpError, WcStatus};
use crate::proto::token::{Dir, WrId};
use crate::proto::transport::{unframe, Tail, TAIL_LEN};
use crate::proto::wire::RemoteSlice;
use crate::reactor::data::cq_room::CqRoom;
use crate::reactor::data::op::RawBuf;
use crate::reactor::data::ring::Ring;
use crate::reactor::data::tail::TailRing;
use crate::sys::cq::WorkCompletion;
use crate::sys::mr::Mr;
use crate::sys::pool::index::IndexBuf;
use crate::sys::pool::{Buf, Window};
use crate::sys::qp::SendOp;
use crate::sys::region::RegionSlice;
use crate::sys::wr::{RecvWrs, SendWrs};

/// What the lanes need of a pool buffer: the pool's `Buf` and the index-based `IndexBuf`.
pub(crate) trait LaneBuf {
    /// Address, length (`len()`) and key of a send of its data.
    fn send_sge(&self) -> (u64, u32, u32);
    /// Address, length (the capacity and the slack after it) and key of a receive into it.
    fn recv_sge(&self) -> (u64, u32, u32);
    /// Bytes of data.
    fn len(&self) -> usize;
    /// Bytes the chunk holds.
    fn capacity(&self) -> usize;
    /// Makes the first `len()` bytes this owner's before the device shows them.
    fn show(&self);
    /// The device may write `n` bytes (a posted READ).
    fn lend_to_device(&mut self, n: usize);
    /// The device may write the whole chunk (a posted receive).
    #[allow(dead_code)] // Unused since the reactor makes receive slots with `Slot::recv_on`.
    fn lend_all_to_device(&mut self);
    /// The device wrote `n` bytes for this owner: they are the data.
    fn received(&mut self, n: usize);
    /// The first `n` bytes hold this owner's data (a READ's).
    fn written(&mut self, n: usize);
    /// Sets the length (up to the capacity; longer is cut at it).
    fn set_len_at_most(&mut self, n: usize);
    /// The 4 bytes before offset `n` of a receive (a tail).
    fn tail_before(&self, n: usize) -> Option<[u8; 4]>;
    /// Submitted on connection `owner` to be sent whole (`set_owner(owner, len())`, `show()`);
    /// returns [`LaneBuf::send_sge`] (one look at the chunk for both).
    fn mark_send(&self, owner: u64) -> (u64, u32, u32);
    /// Submitted on connection `owner` to receive into (`set_owner(owner, 0)`, the whole
    /// chunk lent to the device); returns [`LaneBuf::recv_sge`].
    fn mark_recv(&mut self, owner: u64) -> (u64, u32, u32);
}

impl LaneBuf for Buf {
    #[inline(always)]
    fn send_sge(&self) -> (u64, u32, u32) {
        (self.addr(), self.len() as u32, self.lkey())
    }
    #[inline(always)]
    fn recv_sge(&self) -> (u64, u32, u32) {
        (self.addr(), self.post_capacity() as u32, self.lkey())
    }
    #[inline(always)]
    fn len(&self) -> usize {
        Buf::len(self)
    }
    fn capacity(&self) -> usize {
        Buf::capacity(self)
    }
    #[inline(always)]
    fn show(&self) {
        Buf::show(self);
    }
    #[inline(always)]
    fn lend_to_device(&mut self, n: usize) {
        Buf::lend_to_device(self, n);
    }
    #[inline(always)]
    fn lend_all_to_device(&mut self) {
        Buf::lend_to_device(self, Buf::capacity(self));
    }
    #[inline(always)]
    fn received(&mut self, n: usize) {
        Buf::received(self, n);
    }
    fn written(&mut self, n: usize) {
        Buf::written(self, n);
    }
    fn set_len_at_most(&mut self, n: usize) {
        let _ = self.set_len(n.min(Buf::capacity(self)));
    }
    fn tail_before(&self, n: usize) -> Option<[u8; 4]> {
        Buf::tail_before(self, n)
    }
    #[inline(always)]
    fn mark_send(&self, owner: u64) -> (u64, u32, u32) {
        self.set_owner(owner, Buf::len(self));
        Buf::show(self);
        LaneBuf::send_sge(self)
    }
    #[inline(always)]
    fn mark_recv(&mut self, owner: u64) -> (u64, u32, u32) {
        self.set_owner(owner, 0);
        Buf::lend_to_device(self, Buf::capacity(self));
        LaneBuf::recv_sge(self)
    }
}

impl LaneBuf for IndexBuf {
    #[inline(always)]
    fn send_sge(&self) -> (u64, u32, u32) {
        IndexBuf::send_sge(self)
    }
    #[inline(always)]
    fn recv_sge(&self) -> (u64, u32, u32) {
        IndexBuf::recv_sge(self)
    }
    #[inline(always)]
    fn len(&self) -> usize {
        IndexBuf::len(self)
    }
    fn capacity(&self) -> usize {
        IndexBuf::capacity(self)
    }
    #[inline(always)]
    fn show(&self) {
        IndexBuf::show(self);
    }
    #[inline(always)]
    fn lend_to_device(&mut self, n: usize) {
        IndexBuf::lend_to_device(self, n);
    }
    #[inline(always)]
    fn lend_all_to_device(&mut self) {
        IndexBuf::lend_all_to_device(self);
    }
    #[inline(always)]
    fn received(&mut self, n: usize) {
        IndexBuf::received(self, n);
    }
    fn written(&mut self, n: usize) {
        IndexBuf::written(self, n);
    }
    fn set_len_at_most(&mut self, n: usize) {
        let _ = self.set_len(n.min(IndexBuf::capacity(self)));
    }
    fn tail_before(&self, n: usize) -> Option<[u8; 4]> {
        IndexBuf::tail_before(self, n)
    }
    #[inline(always)]
    fn mark_send(&self, owner: u64) -> (u64, u32, u32) {
        IndexBuf::mark_send(self, owner)
    }
    #[inline(always)]
    fn mark_recv(&mut self, owner: u64) -> (u64, u32, u32) {
        IndexBuf::mark_recv(self, owner)
    }
}

/// What few operations hold besides their memory: kept out of line, so a slot moves and is
/// taken apart field by field, without matching a variant (one allocation per iWARP READ,
/// which registers its sink anyway, or window bind, as `OpEntry`'s `Rare`).
enum Rare {
    /// On iWARP, a READ's sink registered with remote write over exactly its bytes, held until
    /// the READ completes or is cancelled; its local key replaces the memory's.
    Sink(#[allow(dead_code)] Mr),
    /// A window bind: holds the window until the bind completes or is cancelled.
    Bind(Rc<Window>),
}

impl std::fmt::Debug for Rare {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Rare::Sink(_) => "Sink",
            Rare::Bind(_) => "Bind",
        })
    }
}

/// An operation while its ring holds it: from submission to completion. 96 bytes with an
/// `IndexBuf` ([module docs](self)).
///
/// Its work request's scatter entry (`addr`, `len`, `lkey`) is decided when the slot is made,
/// in the look at the buffer's chunk its owner marks take anyway, so posting reads the slot
/// alone, never the pool (nothing changes it meanwhile: the slot owns the memory). What it
/// holds is a field of its own each (a pool buffer, a region slice, the rare rest), none a
/// variant of another: a completion moves them into the handler's argument as they are.
/// Caller memory (`Conn::submit_raw`) holds nothing: its address and length are the
/// scatter entry's.
#[derive(Debug)]
pub(crate) struct Slot<B> {
    /// A READ's sink or a window bind (declared first: a sink is deregistered before the
    /// memory under it can go back to the pool or the application).
    rare: Option<Box<Rare>>,
    /// The user_data given at submission (0 for the runtime's own).
    pub(crate) user_data: u64,
    /// The local address its work request names.
    addr: u64,
    /// The bytes its work request names (a receive: the chunk and its slack).
    len: u32,
    /// The local key of that memory.
    lkey: u32,
    /// A pool buffer.
    buf: Option<B>,
    /// A region slice.
    region: Option<RegionSlice>,
    /// A one-sided operation's remote slice (zeros for the others).
    remote: RemoteSlice,
    /// The pool bytes it holds while it waits to be posted (`Config::send_backlog_bytes`).
    pool_len: u32,
    opcode: OpCode,
    flags: u8,
}

/// The runtime's own: no handler hears of it.
const CONTROL: u8 = 1;
/// A receive posted again after a credit-only message consumed it.
const AFTER_CONTROL: u8 = 2;
/// It consumes one of the peer's receives (a send or a WRITE with immediate data).
const CONSUMES: u8 = 4;

/// What a completed operation hands the handler: the public `Completion`'s fields, with the
/// lanes' buffer type (built once, from the slot, as the handler's argument).
#[derive(Debug)]
pub struct Done<B> {
    /// The user_data given at submission.
    pub user_data: u64,
    /// The operation's kind (the submission's, never the device's).
    pub opcode: OpCode,
    /// Bytes transferred (a receive: the message length), or why it failed.
    pub result: Result<u32, OpError>,
    /// The pool buffer of the submission, given back.
    pub buf: Option<B>,
    /// A receive consumed by an RDMA WRITE with immediate data.
    pub remote_write: bool,
    /// The region slice of the submission, given back.
    pub region: Option<RegionSlice>,
}

const NO_REMOTE: RemoteSlice = RemoteSlice { addr: 0, len: 0, rkey: 0 };

impl<B: LaneBuf> Slot<B> {
    /// A slot naming `(addr, len, lkey)`: the fields every constructor sets (none rare).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn of(
        user_data: u64,
        (addr, len, lkey): (u64, u32, u32),
        buf: Option<B>,
        remote: RemoteSlice,
        pool_len: u32,
        opcode: OpCode,
        flags: u8,
    ) -> Slot<B> {
        Slot { rare: None, user_data, addr, len, lkey, buf, region: None, remote, pool_len, opcode, flags }
    }

    /// A send of a pool buffer's `len()` bytes submitted on connection `owner` (its owner marks
    /// set as `Core::submit` and `OpEntry::new` set them: the buffer is `owner`'s with the
    /// bytes it sends, and they are shown).
    #[inline(always)]
    pub(crate) fn send_on(buf: B, owner: u64, user_data: u64) -> Slot<B> {
        let sge = buf.mark_send(owner);
        Slot::of(user_data, sge, Some(buf), NO_REMOTE, sge.1, OpCode::Send, CONSUMES)
    }

    /// A receive into a pool buffer's whole capacity submitted on connection `owner` (its
    /// marks as `Core::submit` and `OpEntry::new` set them).
    #[inline(always)]
    pub(crate) fn recv_on(mut buf: B, owner: u64, user_data: u64) -> Slot<B> {
        let sge = buf.mark_recv(owner);
        Slot::of(user_data, sge, Some(buf), NO_REMOTE, 0, OpCode::Recv, 0)
    }

    /// A receive into a pool buffer's whole capacity.
    #[inline(always)]
    #[allow(dead_code)] // Unused since the reactor makes receive slots with `Slot::recv_on`.
    pub(crate) fn recv(mut buf: B, user_data: u64) -> Slot<B> {
        buf.lend_all_to_device();
        let sge = buf.recv_sge();
        Slot::of(user_data, sge, Some(buf), NO_REMOTE, 0, OpCode::Recv, 0)
    }

    /// An RDMA WRITE (with immediate data when `imm`) of a pool buffer's `len()` bytes.
    pub(crate) fn write(buf: B, remote: RemoteSlice, imm: bool, user_data: u64) -> Slot<B> {
        buf.show();
        let sge = buf.send_sge();
        let (opcode, flags) = if imm { (OpCode::WriteImm, CONSUMES) } else { (OpCode::Write, 0) };
        Slot::of(user_data, sge, Some(buf), remote, sge.1, opcode, flags)
    }

    /// An RDMA READ of `remote.len` bytes into a pool buffer (submission checked they fit).
    pub(crate) fn read(mut buf: B, remote: RemoteSlice, user_data: u64) -> Slot<B> {
        buf.set_len_at_most(remote.len as usize);
        buf.lend_to_device(remote.len as usize);
        let sge = buf.send_sge();
        Slot::of(user_data, sge, Some(buf), remote, remote.len, OpCode::Read, 0)
    }

    /// An operation on caller-registered memory (`Conn::submit_raw`: a send or a receive).
    pub(crate) fn raw(opcode: OpCode, raw: RawBuf, user_data: u64) -> Slot<B> {
        let flags = if opcode.consumes_peer_receive() { CONSUMES } else { 0 };
        Slot::of(user_data, (raw.addr, raw.len, raw.lkey), None, NO_REMOTE, 0, opcode, flags)
    }

    /// An operation on a region slice whose key on the connection's device is `lkey`.
    pub(crate) fn region(
        opcode: OpCode,
        slice: RegionSlice,
        lkey: u32,
        remote: Option<RemoteSlice>,
        user_data: u64,
    ) -> Slot<B> {
        let flags = if opcode.consumes_peer_receive() { CONSUMES } else { 0 };
        let remote = remote.unwrap_or(NO_REMOTE);
        // A READ names the bytes it reads; the others the slice.
        let len = if opcode == OpCode::Read { remote.len } else { slice.len() as u32 };
        let s = Slot::of(user_data, (slice.addr(), len, lkey), None, remote, 0, opcode, flags);
        Slot { region: Some(slice), ..s }
    }

    /// A credit-only message (its immediate data is decided when it is planned).
    pub(crate) fn control() -> Slot<B> {
        Slot::of(0, (0, 0, 0), None, NO_REMOTE, 0, OpCode::Send, CONTROL)
    }

    /// A probe: a zero-length RDMA WRITE (a keepalive, an iWARP nudge), needing no credit.
    pub(crate) fn probe() -> Slot<B> {
        Slot { opcode: OpCode::Write, ..Slot::control() }
    }

    /// A window bind: holds the window until it completes.
    pub(crate) fn bind(window: Rc<Window>) -> Slot<B> {
        Slot { rare: Some(Box::new(Rare::Bind(window))), ..Slot::probe() }
    }

    /// On iWARP, a READ whose sink `sink` registers its memory with remote write: its request
    /// names the sink's key.
    pub(crate) fn with_sink(mut self, sink: Mr) -> Slot<B> {
        self.lkey = sink.lkey();
        self.rare = Some(Box::new(Rare::Sink(sink)));
        self
    }

    /// The bytes its work request names (a send's result: a send's completion carries no
    /// length).
    #[inline(always)]
    pub(crate) fn posted_len(&self) -> u32 {
        self.len
    }

    /// A one-sided operation: it names a remote key of the peer (a reconnection cannot carry it
    /// to a new queue pair).
    pub(crate) fn is_one_sided(&self) -> bool {
        matches!(self.opcode, OpCode::Write | OpCode::WriteImm | OpCode::Read) && !self.is_control()
    }

    /// The runtime's own (no handler hears of it).
    #[inline(always)]
    pub(crate) fn is_control(&self) -> bool {
        self.flags & CONTROL != 0
    }

    /// Local address, length and key of its work request.
    #[inline(always)]
    fn sge(&self) -> (u64, u32, u32) {
        (self.addr, self.len, self.lkey)
    }

    /// The window a bind holds.
    #[inline(always)]
    fn bound_window(&self) -> Option<&Rc<Window>> {
        match self.rare.as_deref() {
            Some(Rare::Bind(w)) => Some(w),
            _ => None,
        }
    }

    /// The most payload a receive's memory holds (a tail-framed message longer is refused).
    fn recv_capacity(&self) -> u32 {
        match (&self.buf, &self.region) {
            (Some(b), _) => u32::try_from(b.capacity()).unwrap_or(u32::MAX),
            (None, Some(s)) => u32::try_from(s.len()).unwrap_or(u32::MAX),
            // Caller memory: the slot names it whole.
            (None, None) => self.len,
        }
    }

    /// The last 4 of the `n` bytes a receive got (its tail, iWARP); `None` when fewer than 4
    /// arrived or they lie outside the memory (as `OpEntry::received_tail` did before the
    /// receives moved onto the receive lane).
    fn received_tail(&self, n: u32) -> Option<[u8; 4]> {
        let at = n.checked_sub(TAIL_LEN)? as usize;
        let mut tail = [0u8; 4];
        match (&self.buf, &self.region) {
            (Some(b), _) => return b.tail_before(n as usize),
            (None, Some(s)) => {
                if n as usize > s.len() {
                    return None;
                }
                s.region().read_at(s.range().start + at, &mut tail).ok()?;
            }
            (None, None) => {
                if self.opcode != OpCode::Recv || self.is_control() || n > self.len {
                    return None;
                }
                #[allow(unsafe_code)]
                // SAFETY: a receive (checked above) holding neither a pool buffer nor a region
                // slice is caller memory (`Slot::raw`), named whole by `addr..addr + len`; `Conn::submit_raw`'s
                // contract keeps it valid until the completion is handed over, which has not
                // happened yet (the slot still holds the operation); the device finished writing
                // it (its completion was reaped); at + 4 <= n <= len.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (self.addr as usize + at) as *const u8,
                        tail.as_mut_ptr(),
                        tail.len(),
                    );
                }
            }
        }
        Some(tail)
    }

    /// The completion's parts: `result`, with the memory handed back (a successful receive's
    /// length set to the bytes received, a READ's bytes the owner's), as
    /// `OpEntry::into_completion`. A READ's sink is deregistered, and a bind's window let go,
    /// before.
    #[inline(always)]
    pub(crate) fn into_done(mut self, result: Result<u32, OpError>, remote_write: bool) -> Done<B> {
        let done = self.take_done(result, remote_write);
        // Nothing is left of it to drop.
        std::mem::forget(self);
        done
    }

    /// [`Slot::into_done`] in place: everything the slot owns moves into the completion (or,
    /// its rare part, is dropped), so what is left of it owns nothing and may be forgotten.
    #[inline(always)]
    fn take_done(&mut self, result: Result<u32, OpError>, remote_write: bool) -> Done<B> {
        self.take_done_as(self.opcode, result, remote_write)
    }

    /// [`Slot::take_done`] of a slot whose opcode the caller knows is `opcode` (a receive
    /// ring's are all receives: the branches for the others go).
    #[inline(always)]
    fn take_done_as(&mut self, opcode: OpCode, result: Result<u32, OpError>, remote_write: bool) -> Done<B> {
        debug_assert_eq!(opcode, self.opcode);
        if self.rare.is_some() {
            drop_rare(self.rare.take());
        }
        let mut buf = self.buf.take();
        if let (Some(b), Ok(n)) = (buf.as_mut(), &result) {
            match opcode {
                // Exactly the bytes received (none for an RDMA WRITE with immediate data).
                OpCode::Recv => b.received(if remote_write { 0 } else { *n as usize }),
                // The device wrote these bytes for this owner.
                OpCode::Read => {
                    let n = b.len();
                    b.written(n);
                }
                _ => {}
            }
        }
        Done { user_data: self.user_data, opcode, result, buf, remote_write, region: self.region.take() }
    }
}

/// Forgets what is left of a slot [`Slot::take_done`] took apart: it owns nothing (its buffer,
/// region and rare part are gone), so forgetting it leaks nothing and spares its drop's tests.
#[inline(always)]
fn forget_husk<B>(husk: Option<Slot<B>>) {
    debug_assert!(
        husk.as_ref().is_some_and(|s| s.rare.is_none() && s.buf.is_none() && s.region.is_none()),
        "a slot taken apart owns nothing"
    );
    std::mem::forget(husk);
}

/// Drops a slot's rare part (a sink deregistered, a window let go): cold.
#[inline(never)]
#[cold]
fn drop_rare(rare: Option<Box<Rare>>) {
    drop(rare);
}

/// The send queue's state beside its ring: what `SendQueue` keeps besides its key queues.
#[derive(Debug)]
struct SendCtl {
    /// Send work requests the queue pair holds.
    capacity: u32,
    signal_every: u32,
    /// Unsignaled requests posted since the last signaled one.
    unsignaled: u32,
    /// Outstanding requests a refused post left without a signaled request after them.
    unreported: u32,
    /// Pool bytes of the queued operations (ring and overflow).
    queued_bytes: usize,
    flow: Option<Flow>,
    /// Credit-only messages whose completion came back successful since the caller last took
    /// the count ([`Lanes::take_credit_messages_sent`]: the connection's meter).
    credit_messages_sent: u32,
    /// Of the outstanding requests, those a send completion being delivered completed and
    /// that have not left their slots yet ([`Lanes::send_completed`]): completed for
    /// [`Lanes::outstanding`] and [`Lanes::free_slots`], so a handler called for one of them
    /// sees the others completed too, as the device reported them.
    completing: u32,
    /// [`HOLD`], [`HELLO`], [`NUDGE`], [`LEAVING_DUE`], [`LEAVING_SENT`], [`ANSWER`],
    /// [`FAREWELL`], [`YIELDS`]: one byte, so the common plan tests one mask ([`SPECIAL`]).
    flags: u8,
}

/// Nothing may go yet: an iWARP agent waits for its client's first message.
const HOLD: u8 = 1;
/// A credit-only message goes first: an iWARP client speaks first.
const HELLO: u8 = 2;
/// A zero-length RDMA WRITE goes next, ahead of the queued operations (an iWARP nudge).
const NUDGE: u8 = 4;
/// Our farewell is asked for and waits for a credit.
const LEAVING_DUE: u8 = 8;
/// Our farewell went.
const LEAVING_SENT: u8 = 16;
/// The peer's farewell arrived and our answer has not gone yet.
const ANSWER: u8 = 32;
/// Both sides take part in the close handshake.
const FAREWELL: u8 = 64;
/// Our farewell takes the last credit only with a grant.
const YIELDS: u8 = 128;
/// Saying goodbye: no data goes any more.
const QUIET: u8 = LEAVING_DUE | LEAVING_SENT;
/// A plan does more than post the queued operations and a credit-only message.
const SPECIAL: u8 = HOLD | HELLO | NUDGE | LEAVING_DUE | ANSWER;

impl SendCtl {
    fn new(signal_every: u32) -> SendCtl {
        SendCtl {
            capacity: 0,
            signal_every: signal_every.max(1),
            unsignaled: 0,
            unreported: 0,
            queued_bytes: 0,
            flow: None,
            credit_messages_sent: 0,
            completing: 0,
            flags: 0,
        }
    }

    #[inline(always)]
    fn has(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }

    #[inline(always)]
    fn set(&mut self, flag: u8, on: bool) {
        if on {
            self.flags |= flag;
        } else {
            self.flags &= !flag;
        }
    }

    /// The signaling of the next request of a chain: one in `signal_every` asks for a
    /// completion (the chain's last is made to by [`SendWrs::set_signaled`]).
    #[inline(always)]
    fn next_signaled(&mut self) -> bool {
        self.unsignaled += 1;
        let signaled = self.unsignaled >= self.signal_every;
        if signaled {
            self.unsignaled = 0;
        }
        signaled
    }
}

/// What [`Lanes::plan_sends`] planned: the run to post.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SendRun {
    /// The ring position (and array index, mod its length) of its first request.
    pub(crate) first: u32,
    /// Requests in it.
    pub(crate) n: u32,
    /// Something could not go for lack of CQ room: the connection waits for room.
    pub(crate) short_of_room: bool,
}

/// What a receive completion was ([`Lanes::recv_completed`]).
#[derive(Debug)]
pub(crate) enum RecvOutcome {
    /// Not an outstanding receive of this lane: the caller counts it stale.
    Stale,
    /// For the handler: the receive completed (an error: a work error to feed too), its
    /// completion for [`Lanes::take_recv`] to build. `wake` when the connection may have
    /// something to post now that it could not before: credits owed are due, held sends are
    /// released, credits arrived while sends wait, or a receive slot freed while receives wait.
    /// This is `after_completion` (`wants_post() || has_pending_recvs()`) reduced to what a
    /// receive completion changes: what it leaves out was blocked before it, by what it does
    /// not give back (send slots, CQ room), so a flush would post nothing more for it. It is
    /// not a subset of it: a connection saying goodbye whose pending sends wait is woken by a
    /// grant here (`SendSide::sends_waiting` has no goodbye condition), where `wants_post`
    /// ignores those sends; its flush posts nothing, it only runs `credit_watch` a tick early.
    Deliver { delivery: Delivery, wake: bool },
    /// A credit-only message consumed it: it is queued again ahead of the others (the
    /// connection has something to post), and the message said `farewell`.
    Control { farewell: Farewell },
    /// The peer broke the framing (why): the receive waits in the side list, the connection
    /// closes (`Protocol`).
    BadFrame(String),
    /// The peer sent beyond the credit we granted: the receive waits in the side list, the
    /// connection closes (`Protocol`, `Stats::credit_overdrawn`).
    Overdrawn,
}

/// A receive [`Lanes::recv_completed`] found for the handler, still in its slot (its credits
/// and kind already accounted), for [`Lanes::take_recv`] to take out as the handler's
/// completion, so the caller builds the completion where the handler gets it (inside the
/// guarded call), once. It names the receive by its ring position, which no other operation
/// takes while it is outstanding: taken once (neither `Copy` nor `Clone`), it takes that
/// receive or, if the lanes let it go meanwhile (the caller's contract broken), nothing.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "the receive stays in its slot until taken"]
pub(crate) struct Delivery {
    /// Its ring position (in the posted window).
    at: u32,
    /// The bytes received, or why it failed.
    pub(crate) result: Result<u32, OpError>,
    /// An RDMA WRITE with immediate data consumed it.
    remote_write: bool,
}

/// An operation [`Lanes::next_sent`] found for its handler, still in its slot: it holds the
/// lanes until [`SentOp::take`] pops it as the handler's completion, so nothing can touch them
/// in between (the borrow says so, not a contract).
#[must_use = "the operation stays in its slot until taken"]
pub(crate) struct SentOp<'l, B> {
    lanes: &'l mut Lanes<B>,
    /// The end (exclusive) of what the send completion completes: the signaled request's
    /// position plus one.
    end: u32,
}

impl<B> std::fmt::Debug for SentOp<'_, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SentOp").field("at", &self.lanes.send.head()).field("end", &self.end).finish()
    }
}

impl<B: LaneBuf> SentOp<'_, B> {
    /// Its ring position: the oldest outstanding (`head` never rests on a hole).
    #[inline(always)]
    pub(crate) fn at(&self) -> u32 {
        self.lanes.send.head()
    }

    /// True when more operations of the same send completion follow it (it is not the
    /// signaled request).
    #[inline(always)]
    pub(crate) fn more(&self) -> bool {
        self.at().wrapping_add(1) != self.end
    }

    /// [`Lanes::wants_post`] (unchanged by the take: a send completion gives back send slots
    /// and CQ room, which it does not read): the host benchmark's question at the last
    /// operation (the reactor's `after_completion` asks it before the last handler).
    #[cfg(feature = "bench-internals")]
    #[inline(always)]
    pub(crate) fn wants_post(&self) -> bool {
        self.lanes.wants_post()
    }

    /// Pops it, giving back its CQ entry, as its handler's completion: with the work
    /// completion's `status` when it is the signaled request (at `end - 1`), success when a
    /// later one completed it. Its parts move into the completion where they lie; nothing else
    /// of it is kept. Returned as itself, as [`Lanes::take_recv`]'s.
    #[inline(always)]
    pub(crate) fn take(self, room: &mut CqRoom, status: WcStatus) -> Done<B> {
        let more = self.more();
        let SentOp { lanes, .. } = self;
        let at = lanes.send.head();
        let slot = lanes.send.outstanding_mut(at).expect("next_sent found the oldest outstanding");
        let result = match status {
            _ if more => Ok(slot.posted_len()),
            WcStatus::Success => Ok(slot.posted_len()),
            s => Err(OpError::Wc(s)),
        };
        let done = slot.take_done(result, false);
        // What is left of it owns nothing (`Slot::take_done`); `head` moves past it.
        forget_husk(lanes.send.vacate(at));
        room.release_send(1);
        lanes.ctl.completing = lanes.ctl.completing.saturating_sub(1);
        lanes.ctl.unreported = lanes.ctl.unreported.min(lanes.send.outstanding());
        done
    }
}

/// One connection's send and receive lanes ([module docs](self)).
#[derive(Debug)]
pub(crate) struct Lanes<B> {
    send: Ring<Slot<B>>,
    recv: Ring<Slot<B>>,
    swrs: SendWrs,
    rwrs: RecvWrs,
    ctl: SendCtl,
    /// Receive work requests the queue pair holds.
    recv_capacity: u32,
    /// Receives a refused message gave back, in order (the side list).
    returned: Vec<Slot<B>>,
    /// Of the receives the last [`Lanes::plan_recvs`] planned, re-posts after credit-only
    /// messages (their grants are owed as such).
    recv_after_control: u32,
}

/// The most requests of the runtime's own one plan inserts: a hello, a nudge, two farewells and
/// a credit-only message.
const MAX_INSERTS: u32 = 5;

/// The slots a ring starts with; it grows (by doubling) up to the queue pair's depth, so a
/// connection's memory follows what it keeps in flight, not its configured depth.
const FIRST_SLOTS: u32 = 4;

impl<B: LaneBuf> Lanes<B> {
    /// The lanes of connection slot `index` (at most `WrId::MAX_INDEX`), whose queue pair is
    /// its `epoch`-th, signaling one send request in `signal_every`. Capacities come with the
    /// queue pair ([`Lanes::set_capacity`]).
    pub(crate) fn new(index: u32, epoch: u16, signal_every: u32) -> Option<Lanes<B>> {
        let sbase = WrId::base(index, epoch, Dir::Send)?;
        let rbase = WrId::base(index, epoch, Dir::Recv)?;
        Some(Lanes {
            send: Ring::new(FIRST_SLOTS, FIRST_SLOTS, sbase),
            recv: Ring::new(FIRST_SLOTS, FIRST_SLOTS, rbase),
            swrs: SendWrs::new(0),
            rwrs: RecvWrs::new(0),
            ctl: SendCtl::new(signal_every),
            recv_capacity: 0,
            returned: Vec::new(),
            recv_after_control: 0,
        })
    }

    /// The queue pair holds `send` send and `recv` receive work requests: each ring may grow
    /// to hold that many (a ring of the next power of two; its queued operations beyond the
    /// queue pair wait in it or in its overflow queue).
    pub(crate) fn set_capacity(&mut self, send: u32, recv: u32) {
        self.ctl.capacity = send;
        self.recv_capacity = recv;
        self.send.set_limit(send);
        self.recv.set_limit(recv);
    }

    /// Names the lanes' work requests after connection slot `index` and queue-pair epoch
    /// `epoch`: the connection got a queue pair. The positions go on; what is queued stays.
    /// Refused, nothing changed, when `index` is beyond `WrId::MAX_INDEX` or when anything is
    /// outstanding (a posted request names the old queue pair, and its slot holds memory the
    /// device may still write: renaming would drop it, review L3): the caller checks both
    /// first ([`Lanes::can_rename`]), so a refusal here is a broken invariant, and even then
    /// no slot is dropped.
    pub(crate) fn set_id(&mut self, index: u32, epoch: u16) -> bool {
        if self.can_rename(index).is_err() {
            return false;
        }
        let (Some(sbase), Some(rbase)) = (WrId::base(index, epoch, Dir::Send), WrId::base(index, epoch, Dir::Recv))
        else {
            return false;
        };
        // Nothing outstanding (checked above): the carries hand back nothing.
        let (sends, recvs) = (self.send.carry(sbase), self.recv.carry(rbase));
        debug_assert!(sends.is_empty() && recvs.is_empty());
        true
    }

    /// Why [`Lanes::set_id`] would refuse to rename the lanes after slot `index`: the index is
    /// beyond what a `wr_id` carries, or requests are outstanding (sends, receives).
    pub(crate) fn can_rename(&self, index: u32) -> Result<(), Rename> {
        if index > WrId::MAX_INDEX {
            return Err(Rename::IndexBeyond);
        }
        match (self.send.outstanding(), self.recv.outstanding()) {
            (0, 0) => Ok(()),
            (sends, recvs) => Err(Rename::Outstanding { sends, recvs }),
        }
    }

    /// The queue-pair epoch its work requests name (the connection's: `Core::complete`
    /// accepts a ring `wr_id` only with it).
    #[inline(always)]
    pub(crate) fn epoch(&self) -> u16 {
        WrId::epoch_of(self.recv.base())
    }

    /// The send work requests the queue pair holds.
    pub(crate) fn send_capacity(&self) -> u32 {
        self.ctl.capacity
    }

    /// The receive work requests the queue pair holds.
    pub(crate) fn recv_capacity(&self) -> u32 {
        self.recv_capacity
    }

    /// Turns flow control on with this credit state.
    pub(crate) fn set_flow(&mut self, flow: Option<Flow>) {
        self.ctl.flow = flow;
    }

    /// The credit state, when flow control is on.
    pub(crate) fn flow_mut(&mut self) -> Option<&mut Flow> {
        self.ctl.flow.as_mut()
    }

    /// Turns the close handshake on (both sides agreed, under flow control).
    pub(crate) fn set_farewell(&mut self, on: bool) {
        let on = on && self.ctl.flow.is_some();
        self.ctl.set(FAREWELL, on);
    }

    /// True when the connection closes with the close handshake.
    pub(crate) fn farewell(&self) -> bool {
        self.ctl.has(FAREWELL)
    }

    /// Asks for our farewell (as `SendQueue::say_farewell`).
    pub(crate) fn say_farewell(&mut self) {
        if self.ctl.has(FAREWELL) && !self.ctl.has(QUIET) {
            self.ctl.set(LEAVING_DUE, true);
        }
    }

    /// Our farewell yields the last credit (the connecting side's rule, `proto::flow`).
    pub(crate) fn yield_last_credit(&mut self) {
        self.ctl.set(YIELDS, true);
    }

    /// The peer's farewell arrived: answer it (once).
    pub(crate) fn answer_farewell(&mut self) {
        if self.ctl.has(FAREWELL) {
            self.ctl.set(ANSWER, true);
        }
    }

    /// Holds every send back until [`Lanes::release`] (an iWARP agent before its client spoke).
    pub(crate) fn set_hold(&mut self, hold: bool) {
        self.ctl.set(HOLD, hold);
    }

    /// The peer has spoken: what was held back may go. True when something was held.
    #[inline(always)]
    pub(crate) fn release(&mut self) -> bool {
        let held = self.ctl.has(HOLD);
        if held {
            self.ctl.set(HOLD, false);
        }
        held
    }

    /// The next plan starts with a credit-only message (an iWARP client speaks first).
    pub(crate) fn set_hello(&mut self, hello: bool) {
        self.ctl.set(HELLO, hello);
    }

    /// A zero-length RDMA WRITE goes at the next plan, ahead of the queued operations and
    /// needing no credit (an iWARP client's nudge). False when one is due already.
    pub(crate) fn nudge(&mut self) -> bool {
        let due = self.ctl.has(NUDGE);
        self.ctl.set(NUDGE, true);
        !due
    }

    /// Queues a send-queue operation behind the others.
    #[inline(always)]
    pub(crate) fn submit_send(&mut self, slot: Slot<B>) {
        self.submit_send_with(
            #[inline(always)]
            || slot,
        );
    }

    /// [`Lanes::submit_send`] of the operation `make` returns, made in its slot
    /// ([`Ring::push_with`]).
    #[inline(always)]
    pub(crate) fn submit_send_with(&mut self, make: impl FnOnce() -> Slot<B>) {
        let ctl = &mut self.ctl;
        self.send.push_with(
            #[inline(always)]
            || {
                let slot = make();
                ctl.queued_bytes += slot.pool_len as usize;
                slot
            },
        );
    }

    /// Queues a receive behind the others.
    #[inline(always)]
    pub(crate) fn submit_recv(&mut self, slot: Slot<B>) {
        self.recv.push(slot);
    }

    /// [`Lanes::submit_recv`] of the receive `make` returns, made in its slot.
    #[inline(always)]
    pub(crate) fn submit_recv_with(&mut self, make: impl FnOnce() -> Slot<B>) {
        self.recv.push_with(make);
    }

    /// Grows the last queued send-queue operation, if it is a SEND of a pool buffer carrying
    /// `user_data` and not the runtime's own (`data/append.rs`, the byte stream's coalesced
    /// writes): `grow` appends to its buffer and returns the bytes it took, given the backlog
    /// (`Lanes::backlog`) and the free slots (`Lanes::free_slots`) as they were. Its request's
    /// length and its backlog bytes follow. Returns the bytes taken (0: nothing changed).
    pub(crate) fn append_last_send(
        &mut self,
        user_data: u64,
        grow: impl FnOnce(&mut B, (u32, usize), u32) -> usize,
    ) -> usize {
        let (backlog, free) = (self.backlog(), self.free_slots());
        let Some(slot) = self.send.last_queued_mut() else { return 0 };
        if slot.user_data != user_data || slot.opcode != OpCode::Send || slot.is_control() {
            return 0;
        }
        let Some(buf) = slot.buf.as_mut() else { return 0 };
        let took = grow(buf, backlog, free);
        // Its request names the bytes it has now (the device has not seen it: it is queued).
        let (_, len, _) = buf.send_sge();
        let added = len.saturating_sub(slot.len);
        slot.len = len;
        slot.pool_len = slot.pool_len.saturating_add(added);
        self.ctl.queued_bytes += added as usize;
        took
    }

    /// Send-queue operations queued and not yet posted, and their pool bytes.
    #[inline(always)]
    pub(crate) fn backlog(&self) -> (u32, usize) {
        (self.send.queued() + self.send.overflowed() as u32, self.ctl.queued_bytes)
    }

    /// Send work requests the queue pair can take now.
    #[inline(always)]
    pub(crate) fn free_slots(&self) -> u32 {
        self.ctl.capacity.saturating_sub(self.sends_open())
    }

    /// Posted send requests not yet completed, and receives. A send completion being
    /// delivered completed its requests, also those whose handler has not been called yet.
    pub(crate) fn outstanding(&self) -> (u32, u32) {
        (self.sends_open(), self.recv.outstanding())
    }

    /// Posted send requests no completion reported yet.
    #[inline(always)]
    fn sends_open(&self) -> u32 {
        self.send.outstanding() - self.ctl.completing.min(self.send.outstanding())
    }

    /// Posted send requests whose completion is awaited (what draining waits for).
    pub(crate) fn awaited(&self) -> u32 {
        self.send.outstanding() - self.ctl.unreported.min(self.send.outstanding())
    }

    /// True when receives wait to be posted.
    pub(crate) fn has_pending_recvs(&self) -> bool {
        recvs_waiting(&self.recv)
    }

    /// True when a plan could post something now or later (as `SendQueue::wants_post`).
    #[inline(always)]
    pub(crate) fn wants_post(&self) -> bool {
        let c = &self.ctl;
        let pending = self.send.queued() > 0 || self.send.overflowed() > 0;
        !c.has(HOLD)
            && ((!c.has(QUIET) && pending)
                || c.has(HELLO | NUDGE | LEAVING_DUE | ANSWER)
                || c.flow.as_ref().is_some_and(Flow::wants_control))
    }

    /// True when the next operation waits for the peer's credits.
    #[inline]
    pub(crate) fn credit_blocked(&self) -> bool {
        let c = &self.ctl;
        !c.has(QUIET)
            && self.send.next_queued().is_some_and(|s| s.flags & CONSUMES != 0)
            && c.flow.as_ref().is_some_and(|f| !f.can_send_data())
    }

    /// Writes the queued receives the queue pair can take now into the receive array and
    /// returns the run to post: `(first, n)` (`n` 0: nothing). Saying goodbye (`finishing`),
    /// only the re-posts of receives credit-only messages consumed go (a prefix of the queued
    /// receives: they are queued at the front). Report with [`Lanes::recvs_posted`].
    #[inline]
    pub(crate) fn plan_recvs(&mut self, finishing: bool) -> (u32, u32) {
        if self.recv.overflowed() > 0 {
            self.recv.refill();
        }
        let room = self.recv_capacity.saturating_sub(self.recv.outstanding());
        let mut n = self.recv.queued().min(room);
        if finishing {
            n = (0..n).take_while(|&k| self.recv.queued_at(k).is_some_and(|s| s.flags & AFTER_CONTROL != 0)).count()
                as u32;
        }
        if n == 0 {
            return (self.recv.next_post(), 0);
        }
        if self.rwrs.capacity() != self.recv.capacity() {
            self.rwrs = RecvWrs::new(self.recv.capacity());
        }
        let first = self.recv.next_post();
        let mut after = 0;
        for k in 0..n {
            let seq = first.wrapping_add(k);
            let slot = self.recv.queued_at(k).expect("k < queued");
            after += u32::from(slot.flags & AFTER_CONTROL != 0);
            let (addr, len, lkey) = slot.sge();
            self.rwrs.write(seq, self.recv.wr_id(seq), addr, len, lkey);
        }
        self.recv_after_control = after;
        (first, n)
    }

    /// The receive array, for the post of the run [`Lanes::plan_recvs`] returned
    /// (`Qp::post_recv_run`).
    pub(crate) fn recv_wrs(&mut self) -> &mut RecvWrs {
        &mut self.rwrs
    }

    /// The device took `taken` of the `n` receives planned; `grants` when receives posted now
    /// grant credits (the connect information was sent). Returns the ones it refused, in
    /// order, for the caller to fail (`None`: all taken). Without `grants` the credit state is
    /// left as it is (review L1: it was dropped, turning flow control off).
    #[inline]
    pub(crate) fn recvs_posted(&mut self, taken: u32, n: u32, grants: bool) -> Option<Vec<Slot<B>>> {
        let Lanes { recv, ctl, recv_after_control, .. } = self;
        let mut flow = ctl.flow.as_mut().filter(|_| grants);
        recvs_taken(recv, *recv_after_control, taken, n, |after| {
            if let Some(f) = flow.as_mut() {
                f.on_repost(after);
            }
        })
    }

    /// Plans the send chain to post now and writes its work requests into the send array:
    /// every rule of `SendQueue::plan_into` ([module docs](self)), in its order (the hello, the
    /// nudge, the queued operations while slots, room and credits allow, the close handshake's
    /// messages, a credit-only message when one is owed), with each request's immediate data
    /// and signaling decided as it is written. CQ room is reserved and credits spent for every
    /// request of the run; `tails` (iWARP) carries the credits in each send's tail instead of
    /// immediate data. Report with [`Lanes::sends_posted`].
    ///
    /// The common plan (no special state: no hold, hello, nudge or close handshake; nothing
    /// beyond the ring; immediate data; a free slot for the credit-only message it may add) is
    /// its own straight path ([`Lanes::plan_plain`]); the others take the general one. Both
    /// plan each request with the same step ([`plan_one`]).
    #[inline]
    pub(in crate::reactor) fn plan_sends(
        &mut self,
        room: &mut CqRoom,
        max_inline: u32,
        tails: Option<&mut TailRing>,
    ) -> SendRun {
        let plain = self.ctl.flags & (SPECIAL | QUIET) == 0
            && tails.is_none()
            && self.send.overflowed() == 0
            && self.send.has_room()
            && self.swrs.capacity() == self.send.capacity();
        if plain {
            return self.plan_plain(room, max_inline);
        }
        self.plan_general(room, max_inline, tails)
    }

    /// [`Lanes::plan_sends`] in the common state: the queued operations while slots, room and
    /// credits allow, then a credit-only message when one is owed, each written as it is
    /// planned. The ring has a free slot (an insertion moves nothing to the overflow queue and
    /// grows nothing) and the send array its size.
    #[inline(always)]
    fn plan_plain(&mut self, room: &mut CqRoom, max_inline: u32) -> SendRun {
        let first = self.send.next_post();
        let mut run = SendRun { first, n: 0, short_of_room: false };
        let Lanes { send, swrs, ctl, .. } = self;
        let slots = ctl.capacity.saturating_sub(send.outstanding());
        let queued = slots.min(send.queued());
        if queued == 1 {
            return plan_single(send, swrs, ctl, room, run, slots, max_inline);
        }
        let mut k = 0u32;
        while k < queued && plan_one(send, swrs, ctl, room, &mut run, k, max_inline, None) {
            k += 1;
        }
        if k < slots && ctl.flow.as_ref().is_some_and(Flow::wants_control) {
            k = plan_credit(send, swrs, ctl, room, &mut run, k, max_inline, None);
        }
        if k > 0 {
            // The last of the chain asks for a completion.
            swrs.set_signaled(first.wrapping_add(k - 1));
            ctl.unsignaled = 0;
        }
        run.n = k;
        run
    }

    /// [`Lanes::plan_sends`] in any state ([`Lanes::plan_plain`]'s steps, with the special
    /// states' messages and rules around them).
    #[inline(never)]
    fn plan_general(&mut self, room: &mut CqRoom, max_inline: u32, mut tails: Option<&mut TailRing>) -> SendRun {
        if self.send.overflowed() > 0 {
            self.send.refill();
        }
        if self.ctl.flags != 0 || self.ctl.flow.is_some() {
            // Room, before any request is written, for what planning may insert (a hello, a
            // nudge, two farewells, a credit-only message): the ring must not grow under the
            // requests written (`Ring::reserve`); at its limit, an insertion moves its last
            // queued operation to the overflow queue instead, and nothing moves.
            self.send.reserve(MAX_INSERTS);
        }
        if self.swrs.capacity() != self.send.capacity() {
            self.swrs = SendWrs::new(self.send.capacity());
        }
        let first = self.send.next_post();
        let mut run = SendRun { first, n: 0, short_of_room: false };
        let Lanes { send, swrs, ctl, .. } = self;
        if ctl.has(HOLD) {
            return run;
        }
        let slots = ctl.capacity.saturating_sub(send.outstanding());
        // The run's requests so far: queued positions 0..k.
        let mut k = 0u32;
        if ctl.has(SPECIAL) {
            k = plan_first(send, swrs, ctl, room, &mut run, slots, max_inline, tails.as_deref_mut());
        }
        if !ctl.has(HELLO | QUIET) {
            while k < slots && plan_one(send, swrs, ctl, room, &mut run, k, max_inline, tails.as_deref_mut()) {
                k += 1;
            }
        }
        if ctl.has(ANSWER | LEAVING_DUE) {
            k = plan_farewells(send, swrs, ctl, room, &mut run, slots, k, max_inline, tails.as_deref_mut());
        }
        // A credit-only message when one is owed (after our farewell too).
        if !ctl.has(HELLO) && k < slots && ctl.flow.as_ref().is_some_and(Flow::wants_control) {
            k = plan_credit(send, swrs, ctl, room, &mut run, k, max_inline, tails);
        }
        if k > 0 {
            // The last of the chain asks for a completion.
            swrs.set_signaled(first.wrapping_add(k - 1));
            ctl.unsignaled = 0;
        }
        debug_assert_eq!(swrs.capacity(), send.capacity(), "the ring grew under the requests written");
        run.n = k;
        run
    }

    /// [`Lanes::plan_sends`] on a transport with immediate data (no tails): for callers
    /// outside the reactor (the host benchmark).
    #[cfg(any(test, feature = "bench-internals"))]
    #[inline(always)]
    pub(crate) fn plan_sends_imm(&mut self, room: &mut CqRoom, max_inline: u32) -> SendRun {
        self.plan_sends(room, max_inline, None)
    }

    /// The send array, for the post of the run [`Lanes::plan_sends`] returned
    /// (`Qp::post_send_run`).
    pub(crate) fn send_wrs(&mut self) -> &mut SendWrs {
        &mut self.swrs
    }

    /// The device took the first `taken` requests of `run`. The rest never reached it: their
    /// CQ room is given back and they are returned (in order) to be failed (`None`: all taken);
    /// the runtime's own among them are the caller's to drop. The unsignaled requests taken
    /// after the last signaled one are no longer awaited (as `SendQueue::posted`).
    #[inline]
    pub(crate) fn sends_posted(&mut self, run: SendRun, taken: u32, room: &mut CqRoom) -> Option<Vec<Slot<B>>> {
        let taken = taken.min(run.n);
        self.send.mark_posted(taken);
        if taken == run.n {
            return None;
        }
        Some(self.refused_sends(run, taken, room))
    }

    /// [`Lanes::sends_posted`] of a chain the device refused part way.
    #[cold]
    fn refused_sends(&mut self, run: SendRun, taken: u32, room: &mut CqRoom) -> Vec<Slot<B>> {
        let signaled_at = (0..taken).rev().find(|&k| self.swrs.signaled(run.first.wrapping_add(k)));
        self.ctl.unreported = match signaled_at {
            Some(k) => taken - 1 - k,
            None => taken,
        };
        self.ctl.unsignaled = 0;
        room.release_send(run.n - taken);
        self.send.remove_queued(0, run.n - taken)
    }

    /// A send-queue completion whose `wr_id` carried position `seq`: the end (exclusive) of
    /// the positions it completes, from the oldest outstanding on, for [`Lanes::next_sent`];
    /// `None` when it names no outstanding request (stale: counted by the caller).
    /// The requests it completes count as completed from now on ([`Lanes::outstanding`],
    /// [`Lanes::free_slots`]), though each leaves its slot only when it is popped or taken.
    #[inline(always)]
    pub(crate) fn send_completed(&mut self, seq: u32) -> Option<u32> {
        let end = self.send.window(seq)?.wrapping_add(1);
        self.ctl.completing = end.wrapping_sub(self.send.head());
        Some(end)
    }

    /// The next operation a send completion completes (in posting order), before `end`, with its
    /// position and whether more follow; its CQ entry is given back. `None` when they are done.
    #[cfg(test)]
    #[inline(always)]
    pub(crate) fn pop_sent(&mut self, end: u32, room: &mut CqRoom) -> Option<(u32, Slot<B>, bool)> {
        let (at, slot) = self.send.pop_until(end)?;
        let more = self.popped_sent(end, room);
        Some((at, slot, more))
    }

    /// What each operation a send completion completes gives back (its CQ entry, the requests
    /// no longer awaited) once popped; true when more before `end` follow.
    #[inline(always)]
    fn popped_sent(&mut self, end: u32, room: &mut CqRoom) -> bool {
        room.release_send(1);
        self.ctl.completing = self.ctl.completing.saturating_sub(1);
        self.ctl.unreported = self.ctl.unreported.min(self.send.outstanding());
        // More of them to pop: `end` still lies past the oldest outstanding.
        end.wrapping_sub(self.send.head()).wrapping_sub(1) < self.send.outstanding()
    }

    /// The completion path's `Lanes::pop_sent`, in two steps: the next operation a send
    /// completion completes, before `end`, found for its handler ([`SentOp`]: its position,
    /// whether more follow); [`SentOp::take`] then pops it as the handler's completion (so the
    /// caller builds the completion where the handler gets it, once). The runtime's own
    /// operations on the way are popped and dropped here (no handler hears of them), each
    /// giving back its CQ entry; a credit-only message's successful completion (`status` for
    /// the signaled request, success for the others) is counted for the meter
    /// ([`Lanes::take_credit_messages_sent`]). `None` when all are done: when the last ones
    /// were the runtime's own, the caller's `after_completion` is still due
    /// ([`Lanes::wants_post`]).
    #[inline(always)]
    pub(crate) fn next_sent(&mut self, end: u32, room: &mut CqRoom, status: WcStatus) -> Option<SentOp<'_, B>> {
        loop {
            let control = self.send.oldest(end)?.is_control();
            if !control {
                return Some(SentOp { lanes: self, end });
            }
            if !self.drop_sent_control(end, room, status) {
                return None;
            }
        }
    }

    /// [`Lanes::next_sent`]'s runtime's own operation (a credit-only message, a probe, a
    /// bind): popped, counted when a credit-only message went, and dropped; true when more
    /// before `end` follow.
    #[cold]
    #[inline(never)]
    fn drop_sent_control(&mut self, end: u32, room: &mut CqRoom, status: WcStatus) -> bool {
        match self.send.pop_until(end) {
            Some((at, slot)) => {
                let succeeded = at.wrapping_add(1) != end || status == WcStatus::Success;
                if succeeded && slot.opcode == OpCode::Send && slot.bound_window().is_none() {
                    self.ctl.credit_messages_sent = self.ctl.credit_messages_sent.saturating_add(1);
                }
                drop(slot);
                self.popped_sent(end, room)
            }
            None => false,
        }
    }

    /// The credit-only messages whose completion came back successful since the last call
    /// (the connection's meter: `Meter::credit_message(true)` each), counted by
    /// [`Lanes::next_sent`].
    pub(crate) fn take_credit_messages_sent(&mut self) -> u32 {
        std::mem::take(&mut self.ctl.credit_messages_sent)
    }

    /// The `wr_id`s of the requests of `run` that ask for a completion, each to `out`: what
    /// a device reports of the run (the host benchmark and tests stand in for the device).
    #[cfg(feature = "bench-internals")]
    #[inline]
    pub(crate) fn run_signaled(&self, run: SendRun, mut out: impl FnMut(u64)) {
        for k in 0..run.n {
            let seq = run.first.wrapping_add(k);
            if self.swrs.signaled(seq) {
                out(self.send.wr_id(seq));
            }
        }
    }

    /// The `wr_id`s of the `n` receives from position `first` (a run [`Lanes::plan_recvs`]
    /// returned), each to `out`: what a device completes of them, in order (the host
    /// benchmark stands in for the device).
    #[cfg(any(test, feature = "bench-internals"))]
    #[inline]
    pub(crate) fn run_ids(&self, first: u32, n: u32, mut out: impl FnMut(u64)) {
        for k in 0..n {
            out(self.recv.wr_id(first.wrapping_add(k)));
        }
    }

    /// The `wr_id` of the oldest outstanding receive: the next a device completes (the host
    /// benchmark and tests stand in for the device).
    #[cfg(feature = "bench-internals")]
    pub(crate) fn oldest_recv(&self) -> Option<u64> {
        (self.recv.outstanding() > 0).then(|| self.recv.wr_id(self.recv.head()))
    }

    /// A receive completion whose `wr_id` carried position `seq`, of a queue pair whose
    /// messages end in a tail when `tail` (iWARP): what it was ([`RecvOutcome`]), with the
    /// credits and kind read and the receive rules applied (`recv_rules`: a message beyond the
    /// credit or with a broken frame is refused; a credit-only message's receive is queued
    /// again), with the lanes' own send side (its credit state, hold and queued sends).
    #[inline(always)]
    pub(crate) fn recv_completed(&mut self, seq: u32, wc: &WorkCompletion, tail: bool) -> RecvOutcome {
        let Lanes { send, recv, ctl, returned, .. } = self;
        recv_rules(recv, returned, seq, wc, tail, &mut OwnSide { ctl, send })
    }

    /// The receive of `delivery` taken out of its slot as its handler's completion: its parts
    /// moved into it where they lie (a successful receive's buffer holds exactly the bytes
    /// received), nothing else kept. The completion is returned as itself (no `Option`), so
    /// the caller's local is the handler's argument, never copied into it.
    ///
    /// # Panics
    ///
    /// If the receive is no longer in its slot: only if the lanes let it go between
    /// [`Lanes::recv_completed`] and this call (cleared, carried), the caller's contract (a
    /// completion's `wr_id`, stale or hostile, never gets here: `recv_completed` checked it).
    #[inline(always)]
    pub(crate) fn take_recv(&mut self, delivery: Delivery) -> Done<B> {
        let Delivery { at, result, remote_write } = delivery;
        let slot = self.recv.outstanding_mut(at).expect("a delivered receive stays in its slot until taken");
        let done = slot.take_done_as(OpCode::Recv, result, remote_write);
        // What is left of it owns nothing (`Slot::take_done`).
        forget_husk(self.recv.vacate(at));
        done
    }

    /// Empties both lanes for teardown (the queue pair is gone): gives back the CQ room of the
    /// posted sends and returns every operation, each lane's posted ones first (receives: then
    /// the side list, then the queued), with how many were posted (`cancel_ops` completes those
    /// `Unconfirmed`, or flushed on an iWARP stream that ended, and the others `Cancelled`).
    pub(crate) fn clear(&mut self, room: Option<&mut CqRoom>) -> Cleared<B> {
        if let Some(room) = room {
            room.release_send(self.send.outstanding());
        }
        self.ctl.unreported = 0;
        self.ctl.completing = 0;
        self.ctl.queued_bytes = 0;
        self.ctl.set(NUDGE, false);
        let base = self.send.base();
        let mut sends = self.send.carry(base);
        let posted_sends = sends.len();
        sends.extend(self.send.drain());
        let base = self.recv.base();
        let mut recvs = self.recv.carry(base);
        let posted_recvs = recvs.len();
        recvs.append(&mut self.returned);
        recvs.extend(self.recv.drain());
        Cleared { sends, posted_sends, recvs, posted_recvs }
    }

    /// For a reconnection (the old queue pair is gone; the lanes are named with `epoch` from
    /// now on, on the same connection slot: the reactor passes their own, `Lanes::epoch`, and
    /// renames them for the next queue pair with [`Lanes::set_id`]): gives back the CQ room of the posted sends and returns them, keeps the
    /// queued send-queue operations for which `keep` is true (in order; the reactor keeps those
    /// that name no remote key of the old peer: [`Slot::is_one_sided`]) and returns the others
    /// after the posted ones, and forgets everything of the old queue pair (slots, signaling,
    /// credits, hold, hello, nudge; the runtime's own queued messages are returned); returns
    /// the posted receives and keeps the queued ones, the side list first (the order of
    /// `RecvQueue`, the receives' planner before issue 47 phase 2),
    /// each an ordinary receive of the next queue pair (a re-post's flag after a credit-only
    /// message is cleared: its grant was the old credit state's). Everything returned was
    /// posted but what follows `posted_sends` ([`Cleared`]).
    pub(crate) fn carry(
        &mut self,
        room: Option<&mut CqRoom>,
        epoch: u16,
        mut keep: impl FnMut(&Slot<B>) -> bool,
    ) -> Cleared<B> {
        if let Some(room) = room {
            room.release_send(self.send.outstanding());
        }
        // The same slot index, another epoch: the index is in range (`Lanes::new` checked it).
        let index = WrId::decode(self.send.base()).map_or(0, |id| id.index);
        let with_epoch = |base: u64| (base & !(u64::from(u16::MAX) << 24)) | (u64::from(epoch) << 24);
        debug_assert_eq!(WrId::base(index, epoch, Dir::Send), Some(with_epoch(self.send.base())));
        let (sbase, rbase) = (with_epoch(self.send.base()), with_epoch(self.recv.base()));
        let mut sends = self.send.carry(sbase);
        let posted_sends = sends.len();
        let queued = self.send.drain();
        let mut bytes = 0usize;
        for slot in queued {
            // The runtime's own name the old queue pair (its credit state, its peer): gone.
            if !slot.is_control() && keep(&slot) {
                bytes += slot.pool_len as usize;
                self.send.push(slot);
            } else {
                sends.push(slot);
            }
        }
        self.ctl = SendCtl {
            queued_bytes: bytes,
            credit_messages_sent: self.ctl.credit_messages_sent,
            ..SendCtl::new(self.ctl.signal_every)
        };
        let recvs = self.recv.carry(rbase);
        let posted_recvs = recvs.len();
        // The side list first, then the queued, each an ordinary receive of the new queue
        // pair: a re-post's grant after a credit-only message was owed on the old one's credit
        // state (review L5: left flagged, a carried re-post behind the side list broke the
        // rule that the flagged ones are a prefix, which saying goodbye posts).
        let queued = self.recv.drain();
        for mut slot in self.returned.drain(..).chain(queued) {
            slot.flags &= !AFTER_CONTROL;
            self.recv.push(slot);
        }
        self.recv_capacity = 0;
        Cleared { sends, posted_sends, recvs, posted_recvs }
    }
}

/// What [`Lanes::clear`] and [`Lanes::carry`] hand back: each lane's operations, the posted
/// ones first.
#[derive(Debug)]
pub(crate) struct Cleared<B> {
    pub(crate) sends: Vec<Slot<B>>,
    /// The first this many of `sends` were posted.
    pub(crate) posted_sends: usize,
    pub(crate) recvs: Vec<Slot<B>>,
    /// The first this many of `recvs` were posted.
    pub(crate) posted_recvs: usize,
}

/// What a receive completion reads and changes of its connection's send side: the credit
/// state, the hold of an iWARP agent's sends, whether sends wait ([`recv_rules`]' view of the
/// lanes' own, [`OwnSide`]).
pub(crate) trait SendSide {
    /// The credit state, when flow control is on.
    fn flow(&mut self) -> Option<&mut Flow>;
    /// The peer has spoken: sends held back may go. True when something was held.
    fn release(&mut self) -> bool;
    /// True when send-queue operations wait to be posted.
    fn sends_waiting(&self) -> bool;
}

/// The lanes' own send side.
struct OwnSide<'a, B> {
    ctl: &'a mut SendCtl,
    send: &'a Ring<Slot<B>>,
}

impl<B> SendSide for OwnSide<'_, B> {
    #[inline(always)]
    fn flow(&mut self) -> Option<&mut Flow> {
        self.ctl.flow.as_mut()
    }

    #[inline(always)]
    fn release(&mut self) -> bool {
        let held = self.ctl.has(HOLD);
        if held {
            self.ctl.set(HOLD, false);
        }
        held
    }

    #[inline(always)]
    fn sends_waiting(&self) -> bool {
        self.send.queued() > 0 || self.send.overflowed() > 0
    }
}

/// The receive rules ([`Lanes::recv_completed`]): a receive completion whose `wr_id` carried position `seq`
/// on the receive ring `recv` (side list `returned`), of a queue pair whose messages end in a
/// tail when `tail`, with the connection's send side `side`. In order: the posted window (a
/// position outside it, or whose slot is empty, is [`RecvOutcome::Stale`]); a failed
/// completion is delivered as it is; the credits and kind are read (the immediate data, or the
/// tail: a broken frame sends the receive to the side list, [`RecvOutcome::BadFrame`]); a
/// message beyond the credit sends it there too ([`RecvOutcome::Overdrawn`]); a hold is
/// released; the credits are taken in; a credit-only message's receive is queued again at the
/// front ([`RecvOutcome::Control`]); anything else is delivered, with `wake` when the
/// connection may have something to post it could not post before.
#[inline(always)]
fn recv_rules<B: LaneBuf, S: SendSide>(
    recv: &mut Ring<Slot<B>>,
    returned: &mut Vec<Slot<B>>,
    seq: u32,
    wc: &WorkCompletion,
    tail: bool,
    side: &mut S,
) -> RecvOutcome {
    let Some(at) = recv.window(seq) else { return RecvOutcome::Stale };
    if wc.status != WcStatus::Success {
        let delivery = Delivery { at, result: Err(OpError::Wc(wc.status)), remote_write: wc.remote_write };
        return RecvOutcome::Deliver { delivery, wake: recvs_waiting(recv) };
    }
    let mut byte_len = wc.byte_len;
    let imm = if tail {
        match recv.get(at).map(|s| unframe(wc.byte_len, s.received_tail(wc.byte_len), s.recv_capacity())) {
            Some(Ok(u)) => {
                byte_len = u.len;
                Some(u.imm)
            }
            Some(Err(why)) => {
                to_side_list(recv, returned, at);
                return RecvOutcome::BadFrame(why);
            }
            // In the window, so its slot is live: not reached.
            None => return RecvOutcome::Stale,
        }
    } else {
        wc.imm.map(Imm::decode)
    };
    if side.flow().is_some_and(|f| f.exhausted()) {
        to_side_list(recv, returned, at);
        return RecvOutcome::Overdrawn;
    }
    // An iWARP agent's sends wait for its client's first message: this one.
    let released = side.release();
    let (mut control, mut wake, mut farewell, mut grant) = (false, released, Farewell::None, 0);
    if let Some(flow) = side.flow() {
        // Every message consumed a receive we granted; one without immediate data (a peer
        // breaking the protocol) grants nothing.
        let imm = imm.unwrap_or(Imm::data(0));
        flow.on_receive(imm);
        // Credits owed are due.
        wake |= flow.wants_control();
        control = imm.control;
        farewell = imm.farewell;
        grant = imm.grant;
    } else if tail {
        // Without flow control a tail's only credit-only message is the client's first
        // (`set_hello`).
        control = imm.is_some_and(|i| i.control);
    }
    if control {
        repost(recv, at);
        return RecvOutcome::Control { farewell };
    }
    // The credits granted let waiting sends go.
    wake |= grant > 0 && side.sends_waiting();
    let delivery = Delivery { at, result: Ok(byte_len), remote_write: wc.remote_write };
    RecvOutcome::Deliver { delivery, wake: wake || recvs_waiting(recv) }
}

/// True when receives of `recv` wait to be posted.
#[inline(always)]
fn recvs_waiting<B>(recv: &Ring<Slot<B>>) -> bool {
    recv.queued() > 0 || recv.overflowed() > 0
}

/// The receive at `at`, whose message was refused, leaves the ring for the side list
/// `returned`: never posted on this queue pair again (the connection closes), cancelled at
/// teardown or posted first on a reconnection's queue pair.
#[cold]
#[inline(never)]
fn to_side_list<B>(recv: &mut Ring<Slot<B>>, returned: &mut Vec<Slot<B>>, at: u32) {
    if let Some(slot) = recv.take(at) {
        returned.push(slot);
    }
}

/// The receive at `at`, which a credit-only message consumed, is queued again ahead of the
/// others: at the front of the queued receives, under the position it is posted from next (its
/// consumed `wr_id` names an empty slot from now on).
#[cold]
#[inline(never)]
fn repost<B>(recv: &mut Ring<Slot<B>>, at: u32) {
    if let Some(mut again) = recv.take(at) {
        again.flags |= AFTER_CONTROL;
        recv.insert_queued(0, again);
    }
}

/// [`Lanes::recvs_posted`] on the receive ring `recv`, of which the last plan queued
/// `after_control` re-posts: the first `taken` of the `n` planned were posted (each granted to
/// `grant` in order), the rest are removed and returned.
#[inline(always)]
fn recvs_taken<B>(
    recv: &mut Ring<Slot<B>>,
    after_control: u32,
    taken: u32,
    n: u32,
    mut grant: impl FnMut(bool),
) -> Option<Vec<Slot<B>>> {
    if after_control == 0 {
        for _ in 0..taken {
            grant(false);
        }
    } else {
        for k in 0..taken {
            grant(recv.queued_at(k).is_some_and(|s| s.flags & AFTER_CONTROL != 0));
        }
    }
    recv.mark_posted(taken);
    if taken < n {
        return Some(recv.remove_queued(0, n - taken));
    }
    None
}

impl<B: LaneBuf> Cleared<B> {
    /// The completions of what [`Lanes::clear`] or [`Lanes::carry`] handed back, at teardown
    /// (the queue pair destroyed, its CQ reaped): the sends first, then the receives, each
    /// lane in its order (receives: the posted ones, then the side list, then the queued
    /// ones), each with [`teardown_error`]; the runtime's own are dropped (no handler hears of
    /// them). Every operation handed back completes once (`Core::cancel_ops`).
    pub(crate) fn into_cancelled(self, stream_closed: bool) -> Vec<Done<B>> {
        let Cleared { sends, posted_sends, recvs, posted_recvs } = self;
        let mut out = Vec::with_capacity(sends.len() + recvs.len());
        for (i, slot) in sends.into_iter().enumerate() {
            if slot.is_control() {
                drop(slot);
                continue;
            }
            out.push(slot.into_done(Err(teardown_error(i < posted_sends, false, stream_closed)), false));
        }
        for (i, slot) in recvs.into_iter().enumerate() {
            out.push(slot.into_done(Err(teardown_error(i < posted_recvs, true, stream_closed)), false));
        }
        out
    }
}

/// How an operation that never completed on the device completes at teardown, its queue pair
/// destroyed and its CQ reaped: posted, `Unconfirmed` (it may or may not have run), or, a
/// receive posted on an iWARP queue pair whose stream ended (`stream_closed`), flushed
/// (`Wc(WrFlushErr)`, `ConnEntry::stream_closed`); never posted, `Cancelled`
/// (`Cleared::into_cancelled`, for `Core::cancel_ops`).
pub(crate) fn teardown_error(posted: bool, recv: bool, stream_closed: bool) -> OpError {
    match (posted, recv) {
        (true, true) if stream_closed => OpError::Wc(WcStatus::WrFlushErr),
        (true, _) => OpError::Unconfirmed,
        (false, _) => OpError::Cancelled,
    }
}

/// Why [`Lanes::can_rename`] refuses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Rename {
    /// The slot index is beyond `WrId::MAX_INDEX`.
    IndexBeyond,
    /// Requests of the present queue pair are outstanding.
    Outstanding { sends: u32, recvs: u32 },
}

/// Plans the queued operation at queued position `k` of `run` (the `k`-th request): when it may
/// go (a credit when it consumes a peer receive under flow control, a CQ entry), its credit is
/// spent, its pool bytes leave the backlog, its signaling is decided and its request written;
/// false when it may not (for lack of room: `run.short_of_room`), or none is queued there.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn plan_one<B: LaneBuf>(
    send: &mut Ring<Slot<B>>,
    swrs: &mut SendWrs,
    ctl: &mut SendCtl,
    room: &mut CqRoom,
    run: &mut SendRun,
    k: u32,
    max_inline: u32,
    tails: Option<&mut TailRing>,
) -> bool {
    let Some(slot) = send.queued_at(k) else { return false };
    let (consumes, pool_len) = (slot.flags & CONSUMES != 0, slot.pool_len);
    let flow = ctl.flow.as_mut().filter(|_| consumes);
    if flow.as_ref().is_some_and(|f| !f.can_send_data()) {
        return false;
    }
    if !room.reserve_one() {
        run.short_of_room = true;
        return false;
    }
    let imm = flow.map(|f| f.send_data().encode());
    ctl.queued_bytes -= pool_len as usize;
    let signaled = ctl.next_signaled();
    let seq = run.first.wrapping_add(k);
    write_send(swrs, seq, send.wr_id(seq), slot, imm, signaled, max_inline, tails);
    true
}

/// [`Lanes::plan_plain`] of a single queued operation (a ping-pong's every plan), straight: the
/// same steps as [`plan_one`] and the credit-only message after it, with one decision moved
/// ahead of the request's write. Whether a credit-only message follows depends only on the
/// flow after this request's credit is spent, so it is known before the request is written:
/// when none follows, the request is the chain's last and is written asking for a completion
/// (what `set_signaled` after the run would make of it, the signaling count starting over).
#[inline(always)]
fn plan_single<B: LaneBuf>(
    send: &mut Ring<Slot<B>>,
    swrs: &mut SendWrs,
    ctl: &mut SendCtl,
    room: &mut CqRoom,
    mut run: SendRun,
    slots: u32,
    max_inline: u32,
) -> SendRun {
    let first = run.first;
    let Some(slot) = send.queued_at(0) else { return run };
    let (consumes, pool_len) = (slot.flags & CONSUMES != 0, slot.pool_len);
    let mut flow = ctl.flow.as_mut();
    let blocked = consumes && flow.as_ref().is_some_and(|f| !f.can_send_data());
    let mut k = 0;
    if !blocked {
        if room.reserve_one() {
            let imm = flow.as_mut().filter(|_| consumes).map(|f| f.send_data().encode());
            ctl.queued_bytes -= pool_len as usize;
            let control_next = 1 < slots && flow.as_ref().is_some_and(|f| f.wants_control());
            let signaled = if control_next {
                ctl.next_signaled()
            } else {
                // The chain's last.
                ctl.unsignaled = 0;
                true
            };
            write_send(swrs, first, send.wr_id(first), slot, imm, signaled, max_inline, None);
            if !control_next {
                run.n = 1;
                return run;
            }
            k = 1;
        } else {
            run.short_of_room = true;
        }
    }
    if k < slots && ctl.flow.as_ref().is_some_and(Flow::wants_control) {
        k = plan_credit(send, swrs, ctl, room, &mut run, k, max_inline, None);
    }
    if k > 0 {
        // The last of the chain asks for a completion.
        swrs.set_signaled(first.wrapping_add(k - 1));
        ctl.unsignaled = 0;
    }
    run.n = k;
    run
}

/// A credit-only message at queued position `k` of `run`, a CQ entry permitting (else
/// `run.short_of_room`): the flow wants one. Returns the requests planned.
#[cold]
#[inline(never)]
#[allow(clippy::too_many_arguments)]
fn plan_credit<B: LaneBuf>(
    send: &mut Ring<Slot<B>>,
    swrs: &mut SendWrs,
    ctl: &mut SendCtl,
    room: &mut CqRoom,
    run: &mut SendRun,
    k: u32,
    max_inline: u32,
    tails: Option<&mut TailRing>,
) -> u32 {
    let Some(flow) = ctl.flow.as_mut() else { return k };
    if !room.reserve_one() {
        run.short_of_room = true;
        return k;
    }
    let imm = flow.send_control().encode();
    put_control(send, swrs, ctl, run.first, k, Slot::control(), Some(imm), max_inline, tails);
    k + 1
}

/// Puts the runtime's own `slot` (a credit-only message or a probe) at queued position `k` of
/// the run from `first` and writes its request with `imm`.
#[inline]
#[allow(clippy::too_many_arguments)]
fn put_control<B: LaneBuf>(
    send: &mut Ring<Slot<B>>,
    swrs: &mut SendWrs,
    ctl: &mut SendCtl,
    first: u32,
    k: u32,
    slot: Slot<B>,
    imm: Option<u32>,
    max_inline: u32,
    tails: Option<&mut TailRing>,
) {
    send.insert_queued(k, slot);
    let seq = first.wrapping_add(k);
    let signaled = ctl.next_signaled();
    // In the ring, not spilled to the overflow queue: the planner inserts only at k < slots (the
    // queue pair's free send slots), so outstanding + k is below the queue pair's depth, which
    // the ring's limit is at least; a full ring at its limit therefore has queued operations
    // after k, and its last one is what spills.
    let slot = send.queued_at(k).expect("an insertion below the free slots stays in the ring");
    write_send(swrs, seq, send.wr_id(seq), slot, imm, signaled, max_inline, tails);
}

/// The start of a plan in a special state ([`SPECIAL`]): the hello (a credit-only message
/// first), then a due nudge. Returns the requests planned.
#[cold]
#[allow(clippy::too_many_arguments)]
fn plan_first<B: LaneBuf>(
    send: &mut Ring<Slot<B>>,
    swrs: &mut SendWrs,
    ctl: &mut SendCtl,
    room: &mut CqRoom,
    run: &mut SendRun,
    slots: u32,
    max_inline: u32,
    mut tails: Option<&mut TailRing>,
) -> u32 {
    let mut k = 0;
    if ctl.has(HELLO) && slots > 0 {
        // The first message, before any data: credit-only (a grant of what is owed).
        if room.reserve_one() {
            ctl.set(HELLO, false);
            let imm = match ctl.flow.as_mut() {
                Some(f) => f.send_control(),
                None => Imm::control(0),
            };
            put_control(
                send,
                swrs,
                ctl,
                run.first,
                k,
                Slot::control(),
                Some(imm.encode()),
                max_inline,
                tails.as_deref_mut(),
            );
            k += 1;
        } else {
            run.short_of_room = true;
        }
    }
    if !ctl.has(HELLO) && k < slots && ctl.has(NUDGE) {
        if room.reserve_one() {
            ctl.set(NUDGE, false);
            put_control(send, swrs, ctl, run.first, k, Slot::probe(), None, max_inline, tails);
            k += 1;
        } else {
            run.short_of_room = true;
        }
    }
    k
}

/// The close handshake's messages of a plan (credit-only, each with the grants owed): the
/// answer to the peer's farewell, then ours (on the yielding side only when it leaves an answer
/// possible, `proto::flow`). Returns the requests planned.
#[cold]
#[allow(clippy::too_many_arguments)]
fn plan_farewells<B: LaneBuf>(
    send: &mut Ring<Slot<B>>,
    swrs: &mut SendWrs,
    ctl: &mut SendCtl,
    room: &mut CqRoom,
    run: &mut SendRun,
    slots: u32,
    mut k: u32,
    max_inline: u32,
    mut tails: Option<&mut TailRing>,
) -> u32 {
    for (farewell, due) in [(Farewell::Heard, ANSWER), (Farewell::Leaving, LEAVING_DUE)] {
        if ctl.has(HELLO) || !ctl.has(due) || k >= slots {
            continue;
        }
        let yields = ctl.has(YIELDS);
        let Some(flow) = ctl.flow.as_mut().filter(|f| f.can_send_control()) else { continue };
        if farewell == Farewell::Leaving && yields && !flow.can_say_farewell() {
            // Our last credit, granting nothing: kept until a grant comes (or for the answer
            // to the peer's farewell), `proto::flow`'s module docs.
            continue;
        }
        if !room.reserve_one() {
            run.short_of_room = true;
            continue;
        }
        let imm = Imm { farewell, ..flow.send_control() }.encode();
        put_control(send, swrs, ctl, run.first, k, Slot::control(), Some(imm), max_inline, tails.as_deref_mut());
        k += 1;
        ctl.set(due, false);
        if farewell == Farewell::Leaving {
            ctl.set(LEAVING_SENT, true);
        }
    }
    k
}

/// Writes the send work request of `slot` at position `seq` of `swrs`: its operation with
/// `imm` (the credits under flow control; on a transport without immediate data, in a tail
/// from `tails` instead), asking for a completion when `signaled`, inline when its bytes fit
/// `max_inline` (as `post::send_wr`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn write_send<B: LaneBuf>(
    swrs: &mut SendWrs,
    seq: u32,
    wr_id: u64,
    slot: &Slot<B>,
    imm: Option<u32>,
    signaled: bool,
    max_inline: u32,
    tails: Option<&mut TailRing>,
) {
    if slot.opcode == OpCode::Send && tails.is_none() {
        // A message on a transport with immediate data (the common request; binds and probes
        // are WRITEs): its credits, if any, in the immediate data.
        let inline = slot.len > 0 && slot.len <= max_inline;
        swrs.write_message(seq, wr_id, imm, slot.sge(), signaled, inline);
        return;
    }
    write_send_other(swrs, seq, wr_id, slot, imm, signaled, max_inline, tails);
}

/// [`write_send`] of the other requests: binds, one-sided operations, and messages whose
/// credits ride in a tail.
#[inline(never)]
#[allow(clippy::too_many_arguments)]
fn write_send_other<B: LaneBuf>(
    swrs: &mut SendWrs,
    seq: u32,
    wr_id: u64,
    slot: &Slot<B>,
    imm: Option<u32>,
    signaled: bool,
    max_inline: u32,
    tails: Option<&mut TailRing>,
) {
    let (addr, len, lkey) = slot.sge();
    if let Some(window) = slot.bound_window() {
        // A connection releases its windows only when destroyed, after which nothing posts: a
        // queued bind's memory window exists.
        let bind = window.bind().expect("a queued bind's memory window exists");
        swrs.write(seq, wr_id, SendOp::Bind(bind), (0, 0, 0), None, signaled, false);
        return;
    }
    if slot.opcode == OpCode::Send {
        let tail = tails.map(|ring| {
            let control = slot.is_control();
            ring.put(Tail(Imm::decode(imm.unwrap_or(Imm { grant: 0, control, farewell: Farewell::None }.encode()))))
        });
        // On a transport without immediate data the credits ride in the tail.
        let imm = imm.filter(|_| tail.is_none());
        let total = len + if tail.is_some() { TAIL_LEN } else { 0 };
        let inline = total > 0 && total <= max_inline;
        swrs.write_send(seq, wr_id, imm, (addr, len, lkey), tail, signaled, inline);
        return;
    }
    let r = &slot.remote;
    let op = match slot.opcode {
        OpCode::Write => SendOp::Write(r.addr, r.rkey),
        OpCode::WriteImm => SendOp::WriteImm(r.addr, r.rkey, imm.unwrap_or(0)),
        OpCode::Read => SendOp::Read(r.addr, r.rkey),
        // Never queued on the send lane (submission puts receives on the other, sends above).
        OpCode::Send | OpCode::Recv => SendOp::Send,
    };
    let inline = len > 0 && len <= max_inline && slot.opcode != OpCode::Read;
    swrs.write(seq, wr_id, op, (addr, len, lkey), None, signaled, inline);
}

#[cfg(test)]
pub(in crate::reactor) mod tests;
