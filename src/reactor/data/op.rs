//! The io_uring-style data path: submissions ([`Op`]) and their [`Completion`]s.
//!
//! An operation is submitted with a caller-chosen `u64` user_data and completes later, exactly
//! once, with that user_data, a result and (for pool buffers) the buffer back. Operations
//! submitted during a tick are posted to the device as one chain per queue pair at the end of
//! the tick (one doorbell), not one verb call each.

use crate::proto::op::{OpCode, OpError};
use crate::proto::wire::RemoteSlice;
use crate::sys::mr::{Access, Mr};
use crate::sys::pd::Pd;
use crate::sys::pool::Buf;
use crate::sys::region::RegionSlice;
use std::rc::Rc;
#[cfg(feature = "bench-internals")]
use {crate::proto::token::ConnKey, crate::sys::pool::Window, crate::sys::qp::Bind};

/// Memory registered by the caller, for [`Op::raw_send`] and [`Op::raw_recv`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawBuf {
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
    /// The local key of the memory region that covers `addr..addr+len`.
    pub lkey: u32,
}

#[derive(Debug)]
pub(crate) enum Body {
    Send(Buf),
    Recv(Buf),
    Write(Buf, RemoteSlice),
    WriteImm(Buf, RemoteSlice),
    Read(Buf, RemoteSlice),
    RawSend(RawBuf),
    RawRecv(RawBuf),
    SendRegion(RegionSlice),
    RecvRegion(RegionSlice),
    WriteRegion(RegionSlice, RemoteSlice),
    ReadRegion(RegionSlice, RemoteSlice),
}

impl Body {
    /// The application region slice of a region operation.
    pub(crate) fn region(&self) -> Option<&RegionSlice> {
        match self {
            Body::SendRegion(s) | Body::RecvRegion(s) | Body::WriteRegion(s, _) | Body::ReadRegion(s, _) => Some(s),
            _ => None,
        }
    }

    /// A WRITE, WRITE with immediate data or READ: it names a peer's remote key.
    pub(crate) fn one_sided(&self) -> bool {
        matches!(
            self,
            Body::Write(..) | Body::WriteImm(..) | Body::Read(..) | Body::WriteRegion(..) | Body::ReadRegion(..)
        )
    }
}

/// One submission: what to do, and the user_data its completion will carry.
///
/// Build with [`Op::send`] or [`Op::recv`] and submit with
/// [`Conn::submit`](crate::Conn::submit).
#[derive(Debug)]
#[must_use = "an Op does nothing until it is submitted"]
pub struct Op {
    pub(crate) body: Body,
    pub(crate) user_data: u64,
}

impl Op {
    /// Sends the first `buf.len()` bytes of a pool buffer. The buffer comes back in the
    /// completion.
    pub fn send(buf: Buf) -> Op {
        Op { body: Body::Send(buf), user_data: 0 }
    }

    /// Posts a pool buffer (its whole capacity) to receive one message. The buffer comes back in
    /// the completion with its length set to the bytes received.
    ///
    /// Under flow control each posted receive is one credit of the peer's, granted back when
    /// a receive is posted again: a handler that stops posting receives stalls its peer (the
    /// credit rule: [`ConnectionHandler`](crate::ConnectionHandler)'s docs).
    pub fn recv(buf: Buf) -> Op {
        Op { body: Body::Recv(buf), user_data: 0 }
    }

    /// Writes the first `buf.len()` bytes into the peer's memory at `remote` (which must be at
    /// least that long). The buffer comes back in the completion.
    pub fn write(buf: Buf, remote: RemoteSlice) -> Op {
        Op { body: Body::Write(buf, remote), user_data: 0 }
    }

    /// Like [`Op::write`], and also consumes one of the peer's receives, which completes with
    /// [`Completion::remote_write`] set: the peer learns the data is there.
    pub fn write_imm(buf: Buf, remote: RemoteSlice) -> Op {
        Op { body: Body::WriteImm(buf, remote), user_data: 0 }
    }

    /// Reads `remote.len` bytes of the peer's memory into `buf` (its length is set to them).
    pub fn read(buf: Buf, remote: RemoteSlice) -> Op {
        Op { body: Body::Read(buf, remote), user_data: 0 }
    }

    /// Sends the bytes of part of an application [`Region`](crate::Region), without copying.
    /// The slice comes back in [`Completion::region`]. The region is registered on the
    /// connection's device at the first operation there.
    pub fn send_region(slice: RegionSlice) -> Op {
        Op { body: Body::SendRegion(slice), user_data: 0 }
    }

    /// Receives one message into part of an application region (at most its length). The
    /// slice comes back in [`Completion::region`]; `result` is the bytes received, at its
    /// start.
    pub fn recv_region(slice: RegionSlice) -> Op {
        Op { body: Body::RecvRegion(slice), user_data: 0 }
    }

    /// Writes the bytes of part of an application region into the peer's memory at `remote`
    /// (at least as long).
    pub fn write_region(slice: RegionSlice, remote: RemoteSlice) -> Op {
        Op { body: Body::WriteRegion(slice, remote), user_data: 0 }
    }

    /// Reads `remote.len` bytes of the peer's memory into the start of part of an application
    /// region (at least as long).
    pub fn read_region(slice: RegionSlice, remote: RemoteSlice) -> Op {
        Op { body: Body::ReadRegion(slice, remote), user_data: 0 }
    }

    /// Sends caller-registered memory. Only [`Conn::submit_raw`](crate::Conn::submit_raw)
    /// accepts it.
    pub fn raw_send(buf: RawBuf) -> Op {
        Op { body: Body::RawSend(buf), user_data: 0 }
    }

    /// Receives into caller-registered memory. Only
    /// [`Conn::submit_raw`](crate::Conn::submit_raw) accepts it.
    pub fn raw_recv(buf: RawBuf) -> Op {
        Op { body: Body::RawRecv(buf), user_data: 0 }
    }

    /// Sets the user_data the completion carries.
    pub fn user_data(mut self, user_data: u64) -> Op {
        self.user_data = user_data;
        self
    }

    /// The operation's kind.
    pub fn opcode(&self) -> OpCode {
        match self.body {
            Body::Send(_) | Body::RawSend(_) | Body::SendRegion(_) => OpCode::Send,
            Body::Recv(_) | Body::RawRecv(_) | Body::RecvRegion(_) => OpCode::Recv,
            Body::Write(..) | Body::WriteRegion(..) => OpCode::Write,
            Body::WriteImm(..) => OpCode::WriteImm,
            Body::Read(..) | Body::ReadRegion(..) => OpCode::Read,
        }
    }

    /// The pool buffer of the operation, if it has one (an operation that was not taken).
    pub(crate) fn into_buf(self) -> Option<Buf> {
        match self.body {
            Body::Send(b) | Body::Recv(b) | Body::Write(b, _) | Body::WriteImm(b, _) | Body::Read(b, _) => Some(b),
            _ => None,
        }
    }

    pub(crate) fn is_raw(&self) -> bool {
        matches!(self.body, Body::RawSend(_) | Body::RawRecv(_))
    }
}

/// The result of one submitted operation.
#[derive(Debug)]
pub struct Completion {
    /// The user_data given at submission.
    pub user_data: u64,
    /// The operation's kind (taken from the submission, never from the device's completion,
    /// whose opcode is undefined on error).
    pub opcode: OpCode,
    /// Bytes transferred (for a receive, the message length), or why it failed.
    pub result: Result<u32, OpError>,
    /// The pool buffer of the submission, given back. For a successful receive its length is
    /// the message length; for a successful READ, the bytes read.
    pub buf: Option<Buf>,
    /// For a receive: it was consumed by the peer's RDMA WRITE with immediate, so the data
    /// (`result` bytes) is in the exposed memory the peer wrote, not in `buf`.
    pub remote_write: bool,
    /// The application region slice of the submission ([`Op::send_region`] and the like),
    /// given back.
    pub region: Option<RegionSlice>,
}

impl Completion {
    /// The user_data of a message that arrived through the device's shared receive queue
    /// (`Config::srq`): the runtime posted that receive, not the handler. Its opcode is
    /// [`OpCode::Recv`] and it carries the buffer, which is the handler's from then on.
    pub const SRQ_RECV: u64 = u64::MAX;

    /// True when the operation succeeded.
    pub fn is_ok(&self) -> bool {
        self.result.is_ok()
    }
}

impl From<crate::reactor::data::lanes::Done<Buf>> for Completion {
    /// A completion of the lanes (issue 47), field by field.
    #[inline(always)]
    fn from(d: crate::reactor::data::lanes::Done<Buf>) -> Completion {
        let crate::reactor::data::lanes::Done { user_data, opcode, result, buf, remote_write, region } = d;
        Completion { user_data, opcode, result, buf, remote_write, region }
    }
}

/// The memory a submitted operation names on this side.
#[cfg(feature = "bench-internals")]
pub(crate) enum Mem {
    /// None: a credit-only message, a keepalive probe, a window bind.
    None,
    /// A pool buffer.
    Pool(Buf),
    /// Caller-registered memory (`Conn::submit_raw`).
    Raw(RawBuf),
    /// A region slice, held until the operation completes (its memory and registration with
    /// it), and the memory the device reads or writes (address, length and the region's key on
    /// the connection's device).
    Region(RegionSlice, RawBuf),
}

/// What few operations carry: kept out of line so an [`OpEntry`] moves in a few stores
/// (issue 33: a 208-byte entry cost a `memmove` call each time it moved, about 14 a round
/// trip). One allocation per iWARP READ (which registers its sink anyway) or window bind.
#[cfg(feature = "bench-internals")]
#[allow(dead_code)] // The baseline keeps the whole of the old entry.
pub(crate) enum Rare {
    /// On iWARP, a READ's sink registered with remote write over exactly its bytes (the
    /// responder writes the data into it: RFC 5040's tagged sink), held until the READ
    /// completes or is cancelled; its local key replaces the pool's or the region's.
    Sink(Mr),
    /// A window bind (`Conn::expose`): holds the window until the bind completes or is
    /// cancelled, so the memory window outlives its posted bind.
    Bind(Rc<Window>),
}

/// A submitted operation while the reactor holds it: from submission to its completion.
#[cfg(feature = "bench-internals")]
#[allow(dead_code)] // The baseline keeps the whole of the old entry.
pub(crate) struct OpEntry {
    /// A READ's sink or a window bind (declared first: a sink is deregistered before the
    /// memory under it can go back to the pool or the application).
    rare: Option<Box<Rare>>,
    pub(crate) conn: ConnKey,
    pub(crate) user_data: u64,
    mem: Mem,
    pub(crate) remote: Option<RemoteSlice>,
    pub(crate) opcode: OpCode,
    /// A credit-only send, or a window bind, of the runtime's own: its completion reaches no
    /// handler.
    pub(crate) control: bool,
    /// On the device (holds a CQ reservation); false while queued.
    pub(crate) posted: bool,
}

#[cfg(feature = "bench-internals")]
#[allow(dead_code)] // The baseline keeps the whole of the old entry.
impl OpEntry {
    /// The entry of a submitted operation, not yet posted. `lkey` is the local key of a
    /// region operation's memory on the connection's device (0 for the others); `sink`, a
    /// READ's sink on iWARP ([`read_sink`]).
    // Always: built straight into its slab slot (issue 33: a call of its own moved the
    // operation in and the entry out, about 40 instructions an operation).
    #[inline(always)]
    pub(crate) fn new(conn: ConnKey, op: Op, lkey: u32, sink: Option<Mr>) -> OpEntry {
        let opcode = op.opcode();
        let Op { body, user_data } = op;
        let raw_of = |s: &RegionSlice, len: usize| RawBuf { addr: s.addr(), len: len as u32, lkey };
        let (mem, remote) = match body {
            Body::Send(b) => {
                // The device sends its `len()` bytes: none may be an earlier owner's.
                b.show();
                (Mem::Pool(b), None)
            }
            Body::Recv(mut b) => {
                b.lend_to_device(b.capacity());
                (Mem::Pool(b), None)
            }
            Body::Write(b, r) | Body::WriteImm(b, r) => {
                b.show();
                (Mem::Pool(b), Some(r))
            }
            Body::Read(mut b, r) => {
                // The device writes `r.len` bytes; submission checked they fit the capacity.
                let _ = b.set_len(r.len as usize);
                b.lend_to_device(r.len as usize);
                (Mem::Pool(b), Some(r))
            }
            Body::RawSend(r) | Body::RawRecv(r) => (Mem::Raw(r), None),
            Body::SendRegion(s) | Body::RecvRegion(s) => {
                let raw = raw_of(&s, s.len());
                (Mem::Region(s, raw), None)
            }
            Body::WriteRegion(s, r) => {
                let raw = raw_of(&s, s.len());
                (Mem::Region(s, raw), Some(r))
            }
            // The device writes `r.len` bytes; submission checked they fit the slice.
            Body::ReadRegion(s, r) => {
                let raw = raw_of(&s, r.len as usize);
                (Mem::Region(s, raw), Some(r))
            }
        };
        let rare = sink.map(|m| Box::new(Rare::Sink(m)));
        OpEntry { rare, conn, user_data, mem, remote, opcode, control: false, posted: false }
    }

    /// The entry of a credit-only message: a zero-length send.
    pub(crate) fn control(conn: ConnKey) -> OpEntry {
        OpEntry {
            rare: None,
            conn,
            user_data: 0,
            mem: Mem::None,
            remote: None,
            opcode: OpCode::Send,
            control: true,
            posted: false,
        }
    }

    /// A keepalive probe: a zero-length RDMA WRITE, which names no memory on either side
    /// (a zero-length request's key and address are not checked) and consumes nothing of the
    /// peer's; the peer's device acknowledges it.
    pub(crate) fn probe(conn: ConnKey) -> OpEntry {
        OpEntry { opcode: OpCode::Write, ..OpEntry::control(conn) }
    }

    /// The entry of a window bind: no local memory, no peer receive used, no handler told.
    pub(crate) fn bind(conn: ConnKey, window: Rc<Window>) -> OpEntry {
        OpEntry { rare: Some(Box::new(Rare::Bind(window))), ..OpEntry::control(conn) }
    }

    /// The pool buffer of an operation on one (`data/append.rs` appends to a pending SEND's).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn pool_buf_mut(&mut self) -> Option<&mut Buf> {
        match &mut self.mem {
            Mem::Pool(b) => Some(b),
            _ => None,
        }
    }

    /// True for a window bind.
    pub(crate) fn is_bind(&self) -> bool {
        matches!(self.rare.as_deref(), Some(Rare::Bind(_)))
    }

    /// The bind work request of a window bind entry, while its memory window exists.
    pub(crate) fn bind_wr(&self) -> Option<Bind> {
        match self.rare.as_deref() {
            Some(Rare::Bind(w)) => w.bind(),
            _ => None,
        }
    }

    /// Local address, length and key of the work request.
    pub(crate) fn sge(&self) -> (u64, u32, u32) {
        if let Some(Rare::Sink(mr)) = self.rare.as_deref() {
            let (addr, len, _) = self.sge_of_memory();
            return (addr, len, mr.lkey());
        }
        self.sge_of_memory()
    }

    fn sge_of_memory(&self) -> (u64, u32, u32) {
        match &self.mem {
            Mem::Pool(b) => {
                let len = if self.opcode == OpCode::Recv { b.post_capacity() } else { b.len() };
                (b.addr(), len as u32, b.lkey())
            }
            Mem::Raw(r) | Mem::Region(_, r) => (r.addr, r.len, r.lkey),
            Mem::None => (0, 0, 0),
        }
    }

    /// The completion the handler sees: `result`, with the buffer handed back (a successful
    /// receive's length set to the bytes received).
    #[inline(always)]
    pub(crate) fn into_completion(self, result: Result<u32, OpError>, remote_write: bool) -> Completion {
        // A READ sink's registration ends before the handler sees the memory.
        drop(self.rare);
        let (mut buf, region) = match self.mem {
            Mem::Pool(b) => (Some(b), None),
            Mem::Region(s, _) => (None, Some(s)),
            Mem::Raw(_) | Mem::None => (None, None),
        };
        match (buf.as_mut(), self.opcode, &result) {
            // Exactly the bytes received (none for an RDMA WRITE with immediate data).
            (Some(b), OpCode::Recv, Ok(n)) => b.received(if remote_write { 0 } else { *n as usize }),
            (Some(b), OpCode::Read, Ok(_)) => {
                // The device wrote these bytes for this owner.
                let n = b.len();
                b.written(n);
            }
            _ => {}
        }
        Completion { user_data: self.user_data, opcode: self.opcode, result, buf, remote_write, region }
    }
}

/// On iWARP, the registration a READ's sink needs (`Slot::with_sink`): remote write over
/// exactly the bytes the READ fills; `None` for other operations.
pub(crate) fn read_sink(op: &Op, pd: &Rc<Pd>) -> crate::error::Result<Option<Mr>> {
    let (addr, len) = match &op.body {
        Body::Read(b, r) => (b.addr(), r.len as usize),
        Body::ReadRegion(s, r) => (s.addr(), r.len as usize),
        _ => return Ok(None),
    };
    if len == 0 {
        return Ok(None);
    }
    #[allow(unsafe_code)]
    // SAFETY: the memory is the operation's (a pool chunk or a region slice), which its slot
    // on the send lane holds (`Slot::buf`, `Slot::region`) after its `rare` part, which holds
    // the sink (`Slot::with_sink`): the registration ends before that memory can be released
    // or reused, whether the slot is dropped (fields drop in declaration order) or taken apart
    // (`Slot::take_done` drops the rare part first).
    let mr =
        unsafe { Mr::register(pd, addr as *mut u8, len, Access::LOCAL_WRITE | Access::REMOTE_WRITE) }.map_err(|e| {
            crate::error::Error::verb("ibv_reg_mr", format!("an RDMA READ's sink of {len} bytes (iWARP)"), e)
        })?;
    Ok(Some(mr))
}
