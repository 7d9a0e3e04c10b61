//! The vocabulary of the data path, pure: operation kinds, work completion statuses, errors
//! and remote access rights. The operations themselves ([`Op`](crate::Op)) carry buffers and
//! live in the reactor.

use std::fmt;

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

impl WcStatus {
    /// What a status most likely means, for the ones a program meets when the two ends disagree
    /// about message sizes (FAULTS.md, case 15): shown by `Display` after the status's name.
    /// `None` for the rest, whose doc comments say what they are.
    pub fn hint(self) -> Option<&'static str> {
        Some(match self {
            WcStatus::LocLenErr => {
                "a message longer than the receive buffer it landed in, or a request longer than the \
                 queue pair allows"
            }
            WcStatus::RemOpErr | WcStatus::RemInvReqErr => {
                "the peer's device refused the request: most likely a SEND larger than the receive buffer \
                 the peer had posted (its announced message size), or an RDMA access it did not expose"
            }
            _ => return None,
        })
    }
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WcStatus::Unknown(v) => write!(f, "unknown work completion status {v}"),
            other => match other.hint() {
                Some(hint) => write!(f, "{other:?} ({hint})"),
                None => write!(f, "{other:?}"),
            },
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
    /// with [`Completion::remote_write`](crate::Completion::remote_write) set.
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
    /// It was posted, but its connection ended without the device reporting its outcome
    /// (its completion queue or device failed, the drain timed out, or a later request of
    /// the same chain was refused): it may or may not have run.
    Unconfirmed,
}

impl fmt::Display for OpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OpError::Wc(s) => write!(f, "{s}"),
            OpError::Cancelled => f.write_str("cancelled: the connection closed before it was posted"),
            OpError::Post(errno) => write!(f, "post failed: {}", std::io::Error::from_raw_os_error(*errno)),
            OpError::Unconfirmed => f.write_str("unconfirmed: posted, but the connection ended before it completed"),
        }
    }
}

impl std::error::Error for OpError {}

#[cfg(test)]
mod tests {
    use super::{OpError, WcStatus};

    #[test]
    fn a_status_a_size_mismatch_causes_says_what_it_most_likely_means() {
        let send = OpError::Wc(WcStatus::RemOpErr).to_string();
        assert!(send.starts_with("RemOpErr (") && send.contains("larger than the receive buffer"), "{send}");
        let recv = WcStatus::LocLenErr.to_string();
        assert!(recv.contains("longer than the receive buffer"), "{recv}");
        assert_eq!(WcStatus::LocQpOpErr.to_string(), "LocQpOpErr");
        assert_eq!(WcStatus::Unknown(99).to_string(), "unknown work completion status 99");
    }
}
