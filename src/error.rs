//! The crate's one error type.

use std::fmt;
use std::io;

use crate::proto::conn::CloseReason;
use crate::proto::wire::WireError;

/// Result with the crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in rdma-reactor, with the context needed to act on it.
///
/// Verb failures carry the name of the verb and the OS error it returned; semantic failures
/// (pool exhausted, wrong state, malformed peer data) have variants of their own.
///
/// `Display` prints this error's own message; the cause (the OS error, the wire error) is its
/// [`source`](std::error::Error::source), so a report that walks the chain (as `anyhow`'s
/// `{:#}` does) prints each cause once:
///
/// ```
/// use std::error::Error as _;
/// let e = rdma_reactor::Error::Os { call: "epoll_wait", source: std::io::Error::from_raw_os_error(9) };
/// assert_eq!(e.to_string(), "epoll_wait failed");
/// assert!(e.source().unwrap().to_string().starts_with("Bad file descriptor"));
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// A verbs or rdma_cm call failed.
    Verb {
        /// The C function that failed, e.g. `"rdma_resolve_addr"`.
        verb: &'static str,
        /// What the runtime was doing, e.g. `"client 3 to 198.18.0.1:7471"`.
        context: String,
        /// The OS error the call reported.
        source: io::Error,
    },
    /// An epoll, timerfd or fcntl call failed.
    Os {
        /// The system call that failed.
        call: &'static str,
        /// The OS error.
        source: io::Error,
    },
    /// No RDMA device is present, or the named one does not exist.
    NoDevice(String),
    /// The registered buffer pool has no free chunk and may not grow further.
    PoolExhausted {
        /// Bytes the pool holds at its configured maximum.
        max_bytes: usize,
    },
    /// A connection may take no more of its device's pool now: it holds its reservation and
    /// may borrow no more beyond it, its own limit reached or the pool's shared remainder
    /// lent out (`PoolConfig`'s docs: what is reserved and what is shared). Transient: it
    /// passes as buffers come back.
    OverBudget {
        /// Pool bytes the connection holds now.
        held: usize,
        /// Its reservation.
        reserved: usize,
        /// What stops it: its own borrowing limit or the shared remainder, named by setting.
        limit: &'static str,
    },
    /// A buffer is larger than the chunk size, or a message larger than the peer accepts.
    TooLarge {
        /// The size asked for.
        len: usize,
        /// The largest size allowed.
        max: usize,
        /// What sets that maximum (a setting, or the peer), e.g.
        /// `"PoolConfig::chunk_sizes (Config::pool)"`.
        limit: &'static str,
    },
    /// The connection this call names is closed, closing or not established yet.
    NotConnected(String),
    /// A token names no live object (it was closed, or belongs to another reactor).
    StaleToken(u64),
    /// The peer's connect information was malformed.
    Wire(WireError),
    /// A connection ended; the reason says how.
    Closed(CloseReason),
    /// An address string could not be parsed or resolved.
    BadAddress(String),
    /// A configuration value is out of range.
    Config(String),
    /// This cannot be done: the connection's device lacks it (for example immediate data or
    /// memory windows on iWARP), or this API does not offer it (yet); the text says which, and
    /// what to do instead.
    Unsupported(String),
    /// Registering memory failed for lack of locked memory: the process may pin at most
    /// `limit` bytes (`RLIMIT_MEMLOCK`), and `asked` more were needed.
    Memlock {
        /// Bytes the registration asked to pin.
        asked: usize,
        /// The soft `RLIMIT_MEMLOCK` in bytes (`None`: unlimited or unknown).
        limit: Option<u64>,
        /// What was being registered.
        context: String,
        /// The OS error `ibv_reg_mr` reported (`ENOMEM`).
        source: io::Error,
    },
    /// A future of the async face (`rdma_reactor::io`) was polled where no reactor polls it:
    /// outside [`Reactor::block_on`](crate::Reactor::block_on), a task
    /// [`spawn`](crate::Reactor::spawn)ed on a reactor, or the tokio driver; or a handle (a
    /// connection, its futures, a sleep) was used where another reactor than its own polls
    /// (two reactors on one thread): it belongs to the reactor that made it, and another one is
    /// never asked in its place.
    NoReactor,
    /// A submitted operation completed with an error (the device's, a flush, a cancel).
    Operation(crate::proto::op::OpError),
    /// A time limit of the async face ([`io::timeout`](crate::io::timeout)) passed before the
    /// future it bounds was ready.
    Elapsed(std::time::Duration),
    /// A limit of [`Config`](crate::Config) was reached.
    Limit {
        /// Which one, e.g. `"max_connections"`.
        what: &'static str,
        /// Its value.
        limit: usize,
    },
}

impl Error {
    /// Builds [`Error::Verb`] from the current `errno`.
    pub(crate) fn verb(verb: &'static str, context: impl Into<String>, source: io::Error) -> Self {
        Error::Verb { verb, context: context.into(), source }
    }

    /// This error and its causes on one line (`a: b: c`), for text that travels on without the
    /// error value (a close reason, a reject reason).
    pub(crate) fn chain(&self) -> String {
        let mut out = self.to_string();
        let mut cause = std::error::Error::source(self);
        while let Some(c) = cause {
            out.push_str(": ");
            out.push_str(&c.to_string());
            cause = c.source();
        }
        out
    }

    /// The OS error behind this error, if there is one.
    pub fn os_error(&self) -> Option<&io::Error> {
        match self {
            Error::Verb { source, .. } | Error::Os { source, .. } => Some(source),
            _ => None,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Verb { verb, context, .. } => {
                if context.is_empty() {
                    write!(f, "{verb} failed")
                } else {
                    write!(f, "{verb} failed ({context})")
                }
            }
            Error::Os { call, .. } => write!(f, "{call} failed"),
            Error::NoDevice(what) => write!(f, "no RDMA device: {what}"),
            Error::PoolExhausted { max_bytes } => {
                write!(f, "registered buffer pool exhausted (maximum {max_bytes} bytes)")
            }
            Error::OverBudget { held, reserved, limit } => write!(
                f,
                "this connection holds {held} bytes of the pool ({reserved} reserved for it) and may borrow no \
                 more now: {limit}"
            ),
            Error::TooLarge { len, max, limit } => {
                write!(f, "{len} bytes is larger than the maximum {max} (set by {limit})")
            }
            Error::NotConnected(what) => write!(f, "not connected: {what}"),
            Error::StaleToken(t) => write!(f, "token {t:#x} names no live object"),
            Error::Wire(_) => f.write_str("bad connect information"),
            Error::Closed(reason) => write!(f, "connection closed: {reason}"),
            Error::BadAddress(a) => write!(f, "bad address: {a}"),
            Error::Config(what) => write!(f, "bad configuration: {what}"),
            Error::Unsupported(what) => write!(f, "not supported: {what}"),
            Error::Limit { what, limit } => write!(f, "limit reached: {what} = {limit} (raise it in Config)"),
            Error::Elapsed(limit) => write!(f, "timed out: not ready within {limit:?}"),
            Error::NoReactor => f.write_str(
                "no reactor polls this future, or the reactor polling it is not the one its handle (a \
                 connection, a listener) belongs to, which has another reactor's object of the same token: \
                 await it in Reactor::block_on, a task of Reactor::spawn, or the tokio driver \
                 (rdma_reactor::io::tokio), of the reactor that made the handle",
            ),
            Error::Operation(_) => f.write_str("operation failed"),
            Error::Memlock { asked, limit, context, .. } => {
                let limit = limit.map_or("unlimited".to_string(), |l| format!("{l} bytes"));
                write!(
                    f,
                    "ibv_reg_mr could not pin {asked} bytes ({context}): the locked-memory limit \
                     RLIMIT_MEMLOCK is {limit}; raise it (`ulimit -l`, systemd's LimitMEMLOCK=, \
                     /etc/security/limits.conf) or configure a smaller pool (PoolConfig::cluster_bytes, \
                     PoolConfig::max_bytes)"
                )
            }
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Verb { source, .. } | Error::Os { source, .. } | Error::Memlock { source, .. } => Some(source),
            Error::Wire(e) => Some(e),
            Error::Operation(e) => Some(e),
            _ => None,
        }
    }
}

impl From<WireError> for Error {
    fn from(e: WireError) -> Self {
        Error::Wire(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_leaves_the_cause_to_source_and_chain_has_each_once() {
        let e = Error::verb("rdma_bind_addr", "listener on 10.0.0.1:1", io::Error::from_raw_os_error(19));
        assert_eq!(e.to_string(), "rdma_bind_addr failed (listener on 10.0.0.1:1)");
        let chain = e.chain();
        assert!(chain.starts_with("rdma_bind_addr failed (listener on 10.0.0.1:1): No such device"), "{chain}");
        assert_eq!(chain.matches("No such device").count(), 1);
        let w = Error::Wire(WireError::BadMagic(7));
        assert_eq!(w.to_string(), "bad connect information");
        assert!(w.chain().starts_with("bad connect information: "), "{}", w.chain());
    }

    #[test]
    fn memlock_names_the_limit_the_bytes_and_how_to_raise_it() {
        let e = Error::Memlock {
            asked: 4 << 20,
            limit: Some(65536),
            context: "pool cluster".into(),
            source: io::Error::from_raw_os_error(12),
        };
        let text = e.to_string();
        for needle in ["RLIMIT_MEMLOCK", "4194304 bytes", "65536 bytes", "ulimit -l", "LimitMEMLOCK", "smaller pool"] {
            assert!(text.contains(needle), "{needle:?} missing from {text}");
        }
    }
}
