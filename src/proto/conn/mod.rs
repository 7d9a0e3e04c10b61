//! Pure connection state machines: listener, agent (server side) and client.
//!
//! **Architecture invariant:** nothing in this module performs I/O or names an FFI type. Each
//! machine takes an [`Input`] (an rdma_cm event, an expired deadline, a user request, a work
//! request failure) and returns [`Action`]s for the reactor to carry out. An input that is
//! impossible in the current state becomes a [`CloseReason::Protocol`] error on that
//! connection; nothing here panics.
//!
//! Agent and client differ only until the connection is established; from then on both run the
//! same shared phase (established → (saying goodbye →) disconnecting → draining → closed),
//! coded once in [`Phase`]. Saying goodbye (`Finishing`) is the close handshake of a
//! connection that negotiated it (iWARP, `crate::proto::flow::Farewell`): the reactor feeds
//! `Finish` instead of `Close`, and the disconnect waits for the peer's `Finished`.

mod agent;
mod client;
mod listener;

pub use agent::Agent;
pub use client::Client;
pub use listener::{Listener, ListenerAction};

use std::fmt;
use std::time::Duration;

use smallvec::SmallVec;

use crate::proto::op::WcStatus;
use crate::proto::wire::RejectReason;

/// An rdma_cm event type, as a closed Rust enum with an `Unknown` arm for values this crate
/// does not know (never a transmute of the C value).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CmEventKind {
    /// `RDMA_CM_EVENT_ADDR_RESOLVED`.
    AddrResolved,
    /// `RDMA_CM_EVENT_ADDR_ERROR`.
    AddrError,
    /// `RDMA_CM_EVENT_ROUTE_RESOLVED`.
    RouteResolved,
    /// `RDMA_CM_EVENT_ROUTE_ERROR`.
    RouteError,
    /// `RDMA_CM_EVENT_CONNECT_REQUEST`.
    ConnectRequest,
    /// `RDMA_CM_EVENT_CONNECT_RESPONSE`.
    ConnectResponse,
    /// `RDMA_CM_EVENT_CONNECT_ERROR`.
    ConnectError,
    /// `RDMA_CM_EVENT_UNREACHABLE`.
    Unreachable,
    /// `RDMA_CM_EVENT_REJECTED`.
    Rejected,
    /// `RDMA_CM_EVENT_ESTABLISHED`.
    Established,
    /// `RDMA_CM_EVENT_DISCONNECTED`.
    Disconnected,
    /// `RDMA_CM_EVENT_DEVICE_REMOVAL`.
    DeviceRemoval,
    /// `RDMA_CM_EVENT_MULTICAST_JOIN`.
    MulticastJoin,
    /// `RDMA_CM_EVENT_MULTICAST_ERROR`.
    MulticastError,
    /// `RDMA_CM_EVENT_ADDR_CHANGE`.
    AddrChange,
    /// `RDMA_CM_EVENT_TIMEWAIT_EXIT`.
    TimewaitExit,
    /// A value this crate does not know.
    Unknown(u32),
}

/// An asynchronous event of a device (`enum ibv_event_type`), as a closed Rust enum with an
/// `Unknown` arm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AsyncEventKind {
    /// `IBV_EVENT_CQ_ERR`: a completion queue overran; it cannot be used any more.
    CqErr,
    /// `IBV_EVENT_QP_FATAL`: a queue pair hit an error it cannot report in a completion.
    QpFatal,
    /// `IBV_EVENT_QP_REQ_ERR`: the queue pair's peer sent an invalid request.
    QpReqErr,
    /// `IBV_EVENT_QP_ACCESS_ERR`: a local access violation on the queue pair.
    QpAccessErr,
    /// `IBV_EVENT_COMM_EST`: a message arrived before the connection was established.
    CommEst,
    /// `IBV_EVENT_SQ_DRAINED`.
    SqDrained,
    /// `IBV_EVENT_PATH_MIG`.
    PathMig,
    /// `IBV_EVENT_PATH_MIG_ERR`.
    PathMigErr,
    /// `IBV_EVENT_DEVICE_FATAL`: the device failed; nothing on it works any more.
    DeviceFatal,
    /// `IBV_EVENT_PORT_ACTIVE`: a port came (back) up.
    PortActive,
    /// `IBV_EVENT_PORT_ERR`: a port went down (its link is gone).
    PortErr,
    /// `IBV_EVENT_LID_CHANGE`.
    LidChange,
    /// `IBV_EVENT_PKEY_CHANGE`.
    PkeyChange,
    /// `IBV_EVENT_SM_CHANGE`.
    SmChange,
    /// `IBV_EVENT_SRQ_ERR`.
    SrqErr,
    /// `IBV_EVENT_SRQ_LIMIT_REACHED`.
    SrqLimitReached,
    /// `IBV_EVENT_QP_LAST_WQE_REACHED`.
    QpLastWqeReached,
    /// `IBV_EVENT_CLIENT_REREGISTER`.
    ClientReregister,
    /// `IBV_EVENT_GID_CHANGE`.
    GidChange,
    /// `IBV_EVENT_WQ_FATAL`.
    WqFatal,
    /// A value this crate does not know.
    Unknown(u32),
}

impl fmt::Display for AsyncEventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AsyncEventKind::CqErr => "completion queue overrun (CQ_ERR)",
            AsyncEventKind::QpFatal => "queue pair fatal error (QP_FATAL)",
            AsyncEventKind::QpReqErr => "invalid request from the peer (QP_REQ_ERR)",
            AsyncEventKind::QpAccessErr => "local access violation (QP_ACCESS_ERR)",
            AsyncEventKind::DeviceFatal => "device fatal error (DEVICE_FATAL)",
            AsyncEventKind::PortErr => "port down (PORT_ERR)",
            AsyncEventKind::PortActive => "port active (PORT_ACTIVE)",
            AsyncEventKind::Unknown(v) => return write!(f, "unknown asynchronous event {v}"),
            other => return write!(f, "{other:?}"),
        })
    }
}

/// A connection-manager step that has a deadline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    /// Client: `rdma_resolve_addr` until ADDR_RESOLVED.
    ResolveAddr,
    /// Client: `rdma_resolve_route` until ROUTE_RESOLVED.
    ResolveRoute,
    /// Client: `rdma_connect` until ESTABLISHED.
    Connect,
    /// Agent: `rdma_accept` until ESTABLISHED.
    Accept,
    /// Either side: our `rdma_disconnect` until DISCONNECTED.
    Disconnect,
    /// Either side: after DISCONNECTED, until every outstanding work request has completed.
    Drain,
    /// From our farewell to the peer's answer (the close handshake, `Input::Finish`).
    Finish,
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Step::ResolveAddr => "address resolution",
            Step::ResolveRoute => "route resolution",
            Step::Connect => "connect",
            Step::Accept => "accept",
            Step::Disconnect => "disconnect",
            Step::Drain => "drain",
            Step::Finish => "close handshake",
        })
    }
}

/// Why a connection ended.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CloseReason {
    /// This side closed it.
    Local,
    /// The peer disconnected.
    Peer,
    /// The server rejected the connection (`status` is the rdma_cm status: 28 for a consumer
    /// reject, 8 when nothing listens on the port; on iWARP -111 when nothing listens, and a
    /// reject with the runtime's reason reads 28 too, `proto::transport`).
    Rejected {
        /// The event status.
        status: i32,
        /// The reason the server sent, when it is an rdma-reactor server.
        reason: Option<RejectReason>,
    },
    /// Address resolution failed (ADDR_ERROR, with its status).
    AddrError(i32),
    /// Route resolution failed (ROUTE_ERROR, with its status).
    RouteError(i32),
    /// The connection could not be established (CONNECT_ERROR, with its status).
    ConnectError(i32),
    /// The peer did not answer (UNREACHABLE, with its status).
    Unreachable(i32),
    /// A connection-manager step did not finish before its deadline.
    Timeout(Step),
    /// The RDMA device went away.
    DeviceRemoval,
    /// A work request failed; the queue pair is in the error state.
    WorkError(WcStatus),
    /// The device reported an asynchronous event that ends the connection (a fatal error of
    /// its queue pair or completion queue, its port going down, the device failing).
    AsyncEvent(AsyncEventKind),
    /// A verb on the connection's completion queue failed (`call` with `errno`): its
    /// completions can no longer be reaped, so it was closed at once.
    CqFailed {
        /// The verb: `ibv_poll_cq` or `ibv_req_notify_cq`.
        call: &'static str,
        /// The error it returned.
        errno: i32,
    },
    /// An event arrived in an order the protocol does not allow.
    Protocol(String),
    /// Setting the connection up failed locally (queue pair, memory, a verb).
    Setup(String),
    /// The reactor was shut down with the connection open.
    Shutdown,
    /// The device moved the queue pair to the error state because of a request of the
    /// peer's: an RDMA READ, WRITE or atomic reaching memory this side did not expose to it
    /// (another connection's key, past a window's end, a window since revoked), or another
    /// request this side's device refused. Devices that raise `IBV_EVENT_QP_ACCESS_ERR` or
    /// `QP_REQ_ERR` for it are reported as [`CloseReason::AsyncEvent`]; rxe raises neither
    /// (Linux 6.1), and the runtime infers it from what it leaves: the first error an
    /// established connection sees, which no one was closing, is the flush of its own work.
    PeerViolation,
    /// Sends waited this long for the peer's receive credits and none came
    /// (`Config::credit_timeout`): the peer stopped consuming messages (a stopped or hung
    /// process whose kernel still acknowledges, or one that stopped posting receives).
    Stalled(Duration),
}

impl CloseReason {
    /// True when the connection ended without any error (a local or peer disconnect).
    pub fn is_clean(&self) -> bool {
        matches!(self, CloseReason::Local | CloseReason::Peer | CloseReason::Shutdown)
    }
}

impl fmt::Display for CloseReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CloseReason::Local => f.write_str("closed locally"),
            CloseReason::Peer => f.write_str("peer disconnected"),
            CloseReason::Rejected { status, reason: Some(r) } => {
                write!(f, "rejected by the server (status {status}): {r}")
            }
            CloseReason::Rejected { status: 8, reason: None } => {
                f.write_str("rejected: nothing listens on that port (status 8)")
            }
            CloseReason::Rejected { status: -111, reason: None } => {
                f.write_str("rejected: connection refused, nothing listens on that port (status -111, iWARP)")
            }
            CloseReason::Rejected { status, reason: None } => write!(f, "rejected (status {status})"),
            CloseReason::AddrError(s) => write!(f, "address resolution failed (status {s}{})", errno_hint(*s)),
            CloseReason::RouteError(s) => write!(f, "route resolution failed (status {s}{})", errno_hint(*s)),
            CloseReason::ConnectError(s) => write!(f, "connect failed (status {s})"),
            CloseReason::Unreachable(s) => write!(f, "peer unreachable (status {s}{})", errno_hint(*s)),
            CloseReason::Timeout(step) => write!(f, "{step} timed out"),
            CloseReason::DeviceRemoval => f.write_str("RDMA device removed"),
            CloseReason::WorkError(WcStatus::RetryExcErr) => {
                f.write_str("work request failed: the peer did not acknowledge (RetryExcErr)")
            }
            CloseReason::WorkError(s) => write!(f, "work request failed: {s}"),
            CloseReason::AsyncEvent(k) => write!(f, "the device reported {k}"),
            CloseReason::CqFailed { call, errno } => write!(f, "{call} failed (errno {errno})"),
            CloseReason::Protocol(what) => write!(f, "protocol error: {what}"),
            CloseReason::Setup(what) => write!(f, "setup failed: {what}"),
            CloseReason::Shutdown => f.write_str("reactor shut down"),
            CloseReason::PeerViolation => f.write_str(
                "the peer's request was refused by this side's device (a remote access violation: memory not \
                 exposed to it, or past a window's end), which ended the queue pair",
            ),
            CloseReason::Stalled(waited) => write!(
                f,
                "the peer granted no receive credit for {waited:?} while sends waited: it stopped consuming messages"
            ),
        }
    }
}

/// What a negative rdma_cm event status means, for the statuses a user can act on.
fn errno_hint(status: i32) -> &'static str {
    match status {
        -19 => ": no RDMA device behind that address or on the route to it",
        -110 => ": timed out",
        -101 => ": network unreachable",
        -113 => ": no route to the host",
        -111 => ": connection refused",
        _ => "",
    }
}

/// What a connection state machine is told.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Input {
    /// An rdma_cm event for this connection's id, with the event's status.
    Cm(CmEventKind, i32),
    /// A REJECTED event, with the reason decoded from its private data.
    Rejected {
        /// The event status.
        status: i32,
        /// The decoded reason, if the peer sent one of ours.
        reason: Option<RejectReason>,
    },
    /// The deadline set for a step expired.
    Timeout(Step),
    /// The user asked to close.
    Close,
    /// A work request completed in error (other than a flush).
    WorkError(WcStatus),
    /// Every outstanding work request has completed (sent by the reactor while draining).
    Drained,
    /// A verb the machine asked for failed synchronously.
    SetupFailed(String),
    /// The reactor is shutting down.
    Shutdown,
    /// A failure that ends the connection but lets it close cleanly (like `WorkError`): a
    /// queue pair's asynchronous error event. Established: disconnect first; before that:
    /// closed at once; already closing: ignored.
    Fault(CloseReason),
    /// A failure after which nothing of the connection can be trusted (its completion queue
    /// or device failed): closed at once in any state, without waiting for its completions.
    Abort(CloseReason),
    /// Close (`CloseReason::Local`) or shut down (`CloseReason::Shutdown`) with the close
    /// handshake: say goodbye and disconnect once the peer answers ([`Input::Finished`]) or
    /// [`Step::Finish`] times out. The reactor sends it instead of `Close` or `Shutdown` on a
    /// connection that negotiated the handshake (`crate::proto::flow::Farewell`). Before
    /// establishment it is a plain close; while closing, ignored.
    Finish(CloseReason),
    /// The peer answered our farewell: it has received everything we sent before it.
    Finished,
}

/// What the reactor must do for a connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Client: call `rdma_resolve_route`.
    ResolveRoute,
    /// Client: create the queue pair, let the handler post its first receives, `rdma_connect`.
    Connect,
    /// Tell the handler the connection is established.
    Established,
    /// Call `rdma_disconnect` (moves the queue pair to error; EINVAL is tolerated).
    Disconnect,
    /// Arm the deadline for a step (replacing any armed one).
    SetDeadline(Step),
    /// Disarm the deadline.
    ClearDeadline,
    /// The connection is over: tell the handler, destroy its resources at the end of the tick.
    Closed(CloseReason),
    /// Send the farewell after everything posted so far (a credit-only message saying
    /// `Farewell::Leaving`), and post no further message.
    SendFarewell,
}

/// The actions one input produces.
pub type Actions = SmallVec<[Action; 4]>;

/// Where a connection is in its life.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    /// Client: waiting for ADDR_RESOLVED.
    ResolvingAddr,
    /// Client: waiting for ROUTE_RESOLVED.
    ResolvingRoute,
    /// Client: `rdma_connect` called, waiting for ESTABLISHED.
    Connecting,
    /// Agent: `rdma_accept` called, waiting for ESTABLISHED.
    Accepting,
    /// Data may flow.
    Established,
    /// Our `rdma_disconnect` was called, waiting for DISCONNECTED.
    Disconnecting(CloseReason),
    /// Disconnected; waiting for outstanding work requests to complete or flush.
    Draining(CloseReason),
    /// Our farewell is sent (or waits for a credit); waiting for the peer's answer before
    /// `rdma_disconnect` (the close handshake, [`Config::close_handshake`](crate::Config::close_handshake)).
    Finishing(CloseReason),
    /// Over. Every further input is ignored.
    Closed,
}

impl State {
    /// True once the connection is established and until it starts closing.
    pub fn is_established(&self) -> bool {
        matches!(self, State::Established)
    }

    /// True from establishment until our `rdma_disconnect` or the peer's (established, or
    /// saying goodbye): the states a disconnect leaves.
    pub(crate) fn is_connected(&self) -> bool {
        matches!(self, State::Established | State::Finishing(_))
    }

    /// True while waiting for outstanding work requests after a disconnect.
    pub fn is_draining(&self) -> bool {
        matches!(self, State::Draining(_))
    }

    /// True once closed.
    pub fn is_closed(&self) -> bool {
        matches!(self, State::Closed)
    }

    fn name(&self) -> &'static str {
        match self {
            State::ResolvingAddr => "resolving address",
            State::ResolvingRoute => "resolving route",
            State::Connecting => "connecting",
            State::Accepting => "accepting",
            State::Established => "established",
            State::Disconnecting(_) => "disconnecting",
            State::Draining(_) => "draining",
            State::Finishing(_) => "saying goodbye",
            State::Closed => "closed",
        }
    }
}

fn acts<const N: usize>(list: [Action; N]) -> Actions {
    list.into_iter().collect()
}

/// The part of the life that agent and client share: from establishment to closed.
pub(crate) struct Phase;

impl Phase {
    /// Ends a connection that never got established.
    fn close_early(state: &mut State, reason: CloseReason) -> Actions {
        *state = State::Closed;
        acts([Action::ClearDeadline, Action::Closed(reason)])
    }

    /// Inputs common to every state before establishment. Returns `None` when the input is
    /// role-specific and the caller must handle it.
    fn before_established(state: &mut State, input: &Input) -> Option<Actions> {
        let out = match input {
            Input::Close => Phase::close_early(state, CloseReason::Local),
            Input::Shutdown => Phase::close_early(state, CloseReason::Shutdown),
            Input::Finish(reason) => Phase::close_early(state, reason.clone()),
            Input::SetupFailed(what) => Phase::close_early(state, CloseReason::Setup(what.clone())),
            Input::WorkError(s) => Phase::close_early(state, CloseReason::WorkError(*s)),
            Input::Cm(CmEventKind::DeviceRemoval, _) => Phase::close_early(state, CloseReason::DeviceRemoval),
            Input::Fault(reason) | Input::Abort(reason) => Phase::close_early(state, reason.clone()),
            // Neither needs an answer before establishment.
            Input::Cm(CmEventKind::AddrChange | CmEventKind::TimewaitExit, _) => Actions::new(),
            Input::Drained | Input::Finished => Actions::new(),
            _ => return None,
        };
        Some(out)
    }

    fn unexpected(state: &mut State, input: &Input) -> Actions {
        let what = format!("unexpected {input:?} while {}", state.name());
        if state.is_connected() {
            *state = State::Disconnecting(CloseReason::Protocol(what));
            acts([Action::Disconnect, Action::SetDeadline(Step::Disconnect)])
        } else {
            Phase::close_early(state, CloseReason::Protocol(what))
        }
    }

    /// Inputs in the established, disconnecting, draining and closed states.
    fn after_established(state: &mut State, input: Input) -> Actions {
        use CmEventKind as K;
        match (&*state, input) {
            (State::Closed, _) => Actions::new(),

            (State::Established, Input::Finish(reason)) => {
                *state = State::Finishing(reason);
                acts([Action::SendFarewell, Action::SetDeadline(Step::Finish)])
            }
            (State::Finishing(reason), Input::Finished | Input::Timeout(Step::Finish)) => {
                // The peer has everything we sent (or did not answer in time): disconnect.
                *state = State::Disconnecting(reason.clone());
                acts([Action::Disconnect, Action::SetDeadline(Step::Disconnect)])
            }
            (State::Finishing(reason), Input::Cm(K::Disconnected, _)) => {
                // The peer disconnected first: nothing more can arrive from us anyway.
                *state = State::Draining(reason.clone());
                acts([Action::Disconnect, Action::SetDeadline(Step::Drain)])
            }
            (State::Finishing(_), Input::Cm(K::Unreachable, s)) => {
                *state = State::Disconnecting(CloseReason::Unreachable(s));
                acts([Action::Disconnect, Action::SetDeadline(Step::Disconnect)])
            }
            (State::Finishing(_), Input::WorkError(s)) => {
                *state = State::Disconnecting(CloseReason::WorkError(s));
                acts([Action::Disconnect, Action::SetDeadline(Step::Disconnect)])
            }
            (State::Finishing(_), Input::Fault(reason)) => {
                *state = State::Disconnecting(reason);
                acts([Action::Disconnect, Action::SetDeadline(Step::Disconnect)])
            }
            (
                State::Finishing(_),
                Input::Close
                | Input::Shutdown
                | Input::Finish(_)
                | Input::Drained
                | Input::Timeout(_)
                | Input::SetupFailed(_)
                | Input::Cm(K::AddrChange | K::TimewaitExit, _),
            ) => Actions::new(),
            (_, Input::Finished) => Actions::new(),
            (State::Disconnecting(_) | State::Draining(_), Input::Finish(_)) => Actions::new(),

            (State::Established, Input::Close) => {
                *state = State::Disconnecting(CloseReason::Local);
                acts([Action::Disconnect, Action::SetDeadline(Step::Disconnect)])
            }
            (State::Established, Input::Shutdown) => {
                *state = State::Disconnecting(CloseReason::Shutdown);
                acts([Action::Disconnect, Action::SetDeadline(Step::Disconnect)])
            }
            (State::Established, Input::WorkError(s)) => {
                *state = State::Disconnecting(CloseReason::WorkError(s));
                acts([Action::Disconnect, Action::SetDeadline(Step::Disconnect)])
            }
            (State::Established, Input::Fault(reason)) => {
                *state = State::Disconnecting(reason);
                acts([Action::Disconnect, Action::SetDeadline(Step::Disconnect)])
            }
            (State::Disconnecting(_) | State::Draining(_), Input::Fault(_)) => Actions::new(),
            (_, Input::Abort(reason)) => {
                *state = State::Closed;
                acts([Action::ClearDeadline, Action::Closed(reason)])
            }
            (State::Established, Input::Cm(K::Disconnected, _)) => {
                // The peer's DREQ: disconnect too, so our queue pair moves to error and every
                // posted work request flushes.
                *state = State::Draining(CloseReason::Peer);
                acts([Action::Disconnect, Action::SetDeadline(Step::Drain)])
            }
            (State::Established, Input::Cm(K::Unreachable, s)) => {
                // The peer stopped answering: disconnect (flushing what is posted) and say so.
                *state = State::Disconnecting(CloseReason::Unreachable(s));
                acts([Action::Disconnect, Action::SetDeadline(Step::Disconnect)])
            }
            (State::Disconnecting(_) | State::Draining(_), Input::Cm(K::Unreachable, _)) => Actions::new(),
            (State::Established, Input::Cm(K::AddrChange | K::TimewaitExit, _)) => Actions::new(),
            (State::Established, Input::Drained | Input::Timeout(_)) => Actions::new(),

            (State::Disconnecting(reason), Input::Cm(K::Disconnected, _)) => {
                *state = State::Draining(reason.clone());
                acts([Action::ClearDeadline, Action::SetDeadline(Step::Drain)])
            }
            (State::Disconnecting(reason), Input::Timeout(Step::Disconnect)) => {
                *state = State::Draining(reason.clone());
                acts([Action::SetDeadline(Step::Drain)])
            }
            (State::Disconnecting(_), Input::Close | Input::Shutdown | Input::WorkError(_) | Input::Drained) => {
                Actions::new()
            }
            (State::Disconnecting(_), Input::Cm(K::AddrChange | K::TimewaitExit, _) | Input::Timeout(_)) => {
                Actions::new()
            }

            (State::Draining(reason), Input::Drained | Input::Timeout(Step::Drain)) => {
                let reason = reason.clone();
                *state = State::Closed;
                acts([Action::ClearDeadline, Action::Closed(reason)])
            }
            (State::Draining(_), Input::Close | Input::Shutdown | Input::WorkError(_) | Input::Timeout(_)) => {
                Actions::new()
            }
            (State::Draining(_), Input::Cm(K::Disconnected | K::AddrChange | K::TimewaitExit, _)) => Actions::new(),

            (
                State::Established | State::Finishing(_) | State::Disconnecting(_) | State::Draining(_),
                Input::Cm(K::DeviceRemoval, _),
            ) => {
                *state = State::Closed;
                acts([Action::ClearDeadline, Action::Closed(CloseReason::DeviceRemoval)])
            }
            (State::Disconnecting(_) | State::Draining(_), Input::SetupFailed(_)) => Actions::new(),

            (_, input) => Phase::unexpected(state, &input),
        }
    }
}

#[cfg(any(test, feature = "fuzz-internals"))]
pub(crate) mod spec;
#[cfg(test)]
mod tests;
