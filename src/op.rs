//! The io_uring-style data path: submissions ([`Op`]) and their [`Completion`]s.
//!
//! An operation is submitted with a caller-chosen `u64` user_data and completes later, exactly
//! once, with that user_data, a result and (for pool buffers) the buffer back. Operations
//! submitted during a tick are posted to the device as one chain per queue pair at the end of
//! the tick (one doorbell), not one verb call each.

use std::fmt;

use crate::sys::pool::Buf;

/// A work completion status (`enum ibv_wc_status`), with an `Unknown` arm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WcStatus {
    /// `IBV_WC_SUCCESS`.
    Success,
    /// `IBV_WC_LOC_LEN_ERR`: a receive buffer was too small, or a send too long.
    LocLenErr,
    /// `IBV_WC_LOC_QP_OP_ERR`.
    LocQpOpErr,
    /// `IBV_WC_LOC_EEC_OP_ERR`.
    LocEecOpErr,
    /// `IBV_WC_LOC_PROT_ERR`: a local key or address outside its memory region.
    LocProtErr,
    /// `IBV_WC_WR_FLUSH_ERR`: the queue pair moved to error before this request ran.
    WrFlushErr,
    /// `IBV_WC_MW_BIND_ERR`.
    MwBindErr,
    /// `IBV_WC_BAD_RESP_ERR`.
    BadRespErr,
    /// `IBV_WC_LOC_ACCESS_ERR`.
    LocAccessErr,
    /// `IBV_WC_REM_INV_REQ_ERR`: the peer found the request invalid (e.g. too long).
    RemInvReqErr,
    /// `IBV_WC_REM_ACCESS_ERR`: the peer's key or bounds check failed.
    RemAccessErr,
    /// `IBV_WC_REM_OP_ERR`.
    RemOpErr,
    /// `IBV_WC_RETRY_EXC_ERR`: the peer did not acknowledge.
    RetryExcErr,
    /// `IBV_WC_RNR_RETRY_EXC_ERR`: the peer had no receive posted, too many times.
    RnrRetryExcErr,
    /// `IBV_WC_LOC_RDD_VIOL_ERR`.
    LocRddViolErr,
    /// `IBV_WC_REM_INV_RD_REQ_ERR`.
    RemInvRdReqErr,
    /// `IBV_WC_REM_ABORT_ERR`.
    RemAbortErr,
    /// `IBV_WC_INV_EECN_ERR`.
    InvEecnErr,
    /// `IBV_WC_INV_EEC_STATE_ERR`.
    InvEecStateErr,
    /// `IBV_WC_FATAL_ERR`.
    FatalErr,
    /// `IBV_WC_RESP_TIMEOUT_ERR`.
    RespTimeoutErr,
    /// `IBV_WC_GENERAL_ERR`.
    GeneralErr,
    /// A status this crate does not know.
    Unknown(u32),
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WcStatus::Unknown(v) => write!(f, "unknown work completion status {v}"),
            other => write!(f, "{other:?}"),
        }
    }
}

/// The kind of a data-path operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OpCode {
    /// A two-sided send.
    Send,
    /// A posted receive.
    Recv,
    /// An RDMA WRITE into the peer's exposed memory.
    Write,
    /// An RDMA WRITE with immediate: also consumes one of the peer's receives, which completes
    /// with [`Completion::remote_write`] set.
    WriteImm,
    /// An RDMA READ from the peer's exposed memory.
    Read,
}

impl OpCode {
    /// True for operations on the send queue (everything but receives).
    pub fn on_send_queue(self) -> bool {
        self != OpCode::Recv
    }

    /// True when the operation consumes one of the peer's receives.
    pub fn consumes_peer_receive(self) -> bool {
        matches!(self, OpCode::Send | OpCode::WriteImm)
    }
}

bitflags::bitflags! {
    /// What a peer may do to memory exposed with [`Conn::expose`](crate::Conn::expose).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct RemoteAccess: u8 {
        /// The peer may RDMA READ it.
        const READ = 1;
        /// The peer may RDMA WRITE it.
        const WRITE = 2;
    }
}

/// A window of a peer's exposed memory: where an RDMA WRITE or READ goes.
///
/// It travels between peers as 16 bytes ([`RemoteSlice::encode`]), in a message or in the
/// connect information's user bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteSlice {
    /// Address in the peer's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
    /// The peer's remote key.
    pub rkey: u32,
}

impl RemoteSlice {
    /// Length of the encoding.
    pub const ENCODED_LEN: usize = 16;

    /// `len` bytes at `offset` into this window, if they fit.
    pub fn slice(&self, offset: u32, len: u32) -> Option<RemoteSlice> {
        let end = offset.checked_add(len)?;
        (end <= self.len).then(|| RemoteSlice { addr: self.addr + u64::from(offset), len, rkey: self.rkey })
    }

    /// Network byte order: address, length, key.
    pub fn encode(&self) -> [u8; 16] {
        let mut out = [0u8; 16];
        out[..8].copy_from_slice(&self.addr.to_be_bytes());
        out[8..12].copy_from_slice(&self.len.to_be_bytes());
        out[12..].copy_from_slice(&self.rkey.to_be_bytes());
        out
    }

    /// Decodes the first 16 bytes; `None` if fewer.
    pub fn decode(b: &[u8]) -> Option<RemoteSlice> {
        let b: &[u8; 16] = b.get(..16)?.try_into().ok()?;
        Some(RemoteSlice {
            addr: u64::from_be_bytes(b[..8].try_into().ok()?),
            len: u32::from_be_bytes(b[8..12].try_into().ok()?),
            rkey: u32::from_be_bytes(b[12..].try_into().ok()?),
        })
    }
}

/// Why an operation did not succeed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum OpError {
    /// The device completed it with an error status (a flush when the connection closed).
    Wc(WcStatus),
    /// It never reached the device: the connection closed first.
    Cancelled,
    /// `ibv_post_send` or `ibv_post_recv` refused it with this errno.
    Post(i32),
}

impl fmt::Display for OpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OpError::Wc(s) => write!(f, "{s}"),
            OpError::Cancelled => f.write_str("cancelled: the connection closed before it was posted"),
            OpError::Post(errno) => write!(f, "post failed: {}", std::io::Error::from_raw_os_error(*errno)),
        }
    }
}

impl std::error::Error for OpError {}

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
            Body::Send(_) | Body::RawSend(_) => OpCode::Send,
            Body::Recv(_) | Body::RawRecv(_) => OpCode::Recv,
            Body::Write(..) => OpCode::Write,
            Body::WriteImm(..) => OpCode::WriteImm,
            Body::Read(..) => OpCode::Read,
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
}

impl Completion {
    /// True when the operation succeeded.
    pub fn is_ok(&self) -> bool {
        self.result.is_ok()
    }
}
