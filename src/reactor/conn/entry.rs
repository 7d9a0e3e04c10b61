//! A connection's and a listener's entries in the reactor's tables: what the reactor keeps for
//! each (its state machine, handler, kernel objects, queues, timers, counters), and the
//! questions asked of them everywhere (may it post? is it drained?).
//!
//! Field order is drop order: a connection's memory windows, then its queue pair and id, then
//! its tail ring (`ConnEntry`).

use crate::error::{Error, Result};
use crate::proto::conn::{Actions, Agent, Client, CloseReason, Input, Listener, State, Step};
use crate::proto::metrics::ConnMeter;
use crate::proto::token::{CqKey, TimerKey};
use crate::proto::wire::ConnectInfo;
use crate::reactor::api::guard::Guarded;
use crate::reactor::conn::{handoff, reconnect};
use crate::reactor::data::gate::Gate;
use crate::reactor::data::lanes::Lanes;
use crate::reactor::data::srq;
use crate::reactor::data::tail::TailRing;
use crate::reactor::event_loop::device::Devices;
use crate::reactor::{ConnectionHandler, ListenerHandler};
use crate::sys::cm::CmId;
use crate::sys::connect::Connecting;
use crate::sys::pool::{Account, Buf, Windows};
use crate::sys::qp::Qp;

/// A connection's role: its state machine.
pub(in crate::reactor) enum Role {
    Agent(Agent),
    Client(Client),
}

impl Role {
    pub(in crate::reactor) fn state(&self) -> &State {
        match self {
            Role::Agent(a) => a.state(),
            Role::Client(c) => c.state(),
        }
    }

    pub(in crate::reactor) fn on_input(&mut self, input: Input) -> Actions {
        match self {
            Role::Agent(a) => a.on_input(input),
            Role::Client(c) => c.on_input(input),
        }
    }
}

/// A connection's rdma_cm id, owned by its queue pair once that exists.
pub(in crate::reactor) enum Endpoint {
    None,
    Id(CmId),
    Qp(Qp),
    /// The queue pair while an iWARP `rdma_connect` runs on a helper thread (`connect.rs`):
    /// neither it nor its id can be used, and the connection is not destroyed, until the call
    /// returned.
    Connecting(Connecting),
}

impl Endpoint {
    /// The id, unless a helper thread is connecting it.
    pub(in crate::reactor) fn id(&self) -> Option<&CmId> {
        match self {
            Endpoint::None | Endpoint::Connecting(_) => None,
            Endpoint::Id(id) => Some(id),
            Endpoint::Qp(qp) => Some(qp.id()),
        }
    }

    /// The queue pair, unless a helper thread is connecting it.
    pub(in crate::reactor) fn qp(&self) -> Option<&Qp> {
        match self {
            Endpoint::Qp(qp) => Some(qp),
            _ => None,
        }
    }

    /// The queue pair's address as asynchronous events name it, also while connecting.
    pub(in crate::reactor) fn qp_identity(&self) -> Option<usize> {
        match self {
            Endpoint::Qp(qp) => Some(qp.identity()),
            Endpoint::Connecting(c) => Some(c.identity()),
            _ => None,
        }
    }

    /// True while a helper thread makes the `rdma_connect` call (`connect.rs`).
    pub(in crate::reactor) fn is_connecting(&self) -> bool {
        matches!(self, Endpoint::Connecting(_))
    }

    /// True when a helper thread's `rdma_connect` call has returned and the helper is not
    /// joined yet.
    pub(in crate::reactor) fn has_returned(&self) -> bool {
        matches!(self, Endpoint::Connecting(c) if c.has_returned())
    }
}

/// What a connection was told and told the peer at setup.
pub(in crate::reactor) struct Infos {
    pub(in crate::reactor) local: ConnectInfo,
    pub(in crate::reactor) peer: Option<ConnectInfo>,
    /// Bytes a client sends instead of `local` (interoperability and fault tests).
    pub(in crate::reactor) raw_private_data: Option<Vec<u8>>,
    /// `local` went out: receives posted from now on grant credits.
    pub(in crate::reactor) sent: bool,
}

/// Where a connection's queue pair lives, once it exists.
#[derive(Clone, Copy)]
pub(in crate::reactor) struct Placement {
    /// Index into `Core::devices`.
    pub(in crate::reactor) device: usize,
    pub(in crate::reactor) cq: CqKey,
    /// Largest inline send the queue pair takes.
    pub(in crate::reactor) max_inline: u32,
    /// Its messages end in a tail instead of carrying immediate data (iWARP,
    /// `proto::transport`): the connection has a [`TailRing`].
    pub(in crate::reactor) tail: bool,
    /// CQ room committed to its receives when it was placed (0 on a shared receive queue),
    /// given back exactly at destruction, whatever the device granted.
    pub(in crate::reactor) recv_room: u32,
}

/// A connection's reservation ([`ConnEntry::account`]).
#[derive(Clone, Copy, Debug)]
pub(in crate::reactor) struct Reserved {
    /// The device whose pool holds it.
    pub(in crate::reactor) device: usize,
    pub(in crate::reactor) account: Account,
    /// An accepted connection's peer address and the bytes counted for it there
    /// (`PoolConfig::per_address_bytes`).
    pub(in crate::reactor) addr: Option<(std::net::IpAddr, usize)>,
}

pub(in crate::reactor) struct ConnEntry {
    /// Memory windows exposed on this connection (`Conn::expose`): deallocated at destruction
    /// before the queue pair.
    pub(in crate::reactor) windows: Windows,
    /// Dropped right after at destruction (queue pair, then id).
    pub(in crate::reactor) ep: Endpoint,
    /// The tails its sends end with, on a transport without immediate data: after `ep`, so
    /// the queue pair that reads them is destroyed first.
    pub(in crate::reactor) tails: Option<TailRing>,
    pub(in crate::reactor) role: Role,
    pub(in crate::reactor) handler: Option<Guarded<dyn ConnectionHandler>>,
    pub(in crate::reactor) placed: Option<Placement>,
    /// Its operations on the queue pair's rings (issue 47, `data/lanes.rs`): its sends and
    /// receives, from submission to completion, and its send queue's state (credits, the close
    /// handshake, an iWARP agent's hold, a client's hello and nudges). Its
    /// queue pair's epoch (`Core::epochs`) is the lanes' (`Lanes::epoch`, set by `setup_qp`):
    /// a ring `wr_id` names this connection only with it.
    pub(in crate::reactor) lanes: Lanes<Buf>,
    /// What `Core::submit` checks an operation against (`data/gate.rs`), as the connection's
    /// state is: recomputed by [`ConnEntry::refresh_gate`] wherever what it reads changes (the
    /// queue pair's setup, the peer's connect information, this side's), `Gate::CLOSED` until
    /// then. A debug build checks it against a fresh one at every submission.
    pub(in crate::reactor) gate: Gate,
    /// Listed in `Core::dirty`: has something to post at the end of the tick.
    pub(in crate::reactor) dirty: bool,
    /// Listed in its CQ's `waiting`: short of CQ room.
    pub(in crate::reactor) waiting_room: bool,
    pub(in crate::reactor) deadline: Option<(u64, Step)>,
    /// The credit-stall timer's key while the next send waits for credits
    /// (`Config::credit_timeout`, `data/post.rs`).
    pub(in crate::reactor) stall: Option<u64>,
    /// User timers set by this connection's callbacks (some may have fired or been cancelled).
    pub(in crate::reactor) timers: Vec<TimerKey>,
    pub(in crate::reactor) infos: Infos,
    pub(in crate::reactor) close_reason: Option<CloseReason>,
    /// On its device's shared receive queue (`Config::srq`): its share of the queue, which
    /// follows its activity (`data/srq/mod.rs`, `SrqBudget`), instead of a receive depth.
    pub(in crate::reactor) srq_share: Option<srq::ConnShare>,
    /// On a shared receive queue: receives its peer's messages consumed that are not posted
    /// again, their credits withheld: by its handler (`Conn::withhold_receive`, released by
    /// `Conn::release_receives`), and by the runtime while it holds too much of the pool
    /// (posted again as its buffers come back). Posted again, for no connection, when it
    /// leaves the queue (`data/srq/mod.rs`).
    pub(in crate::reactor) srq_withheld: srq::Withheld,
    /// Whose bytes this connection's buffers hold (`sys/pool/mod.rs`): unique in the process.
    pub(in crate::reactor) mem_owner: u64,
    /// Its account in its device's pool (`sys/pool/ledger.rs`: its reservation, and what it
    /// borrows beyond): opened when its queue pair is made, closed when it is destroyed (kept
    /// across a reconnection on the same device).
    pub(in crate::reactor) account: Option<Reserved>,
    /// iWARP only: the stream ended (DISCONNECTED) and the queue pair was moved to the error
    /// state. Soft-iWARP flushes the receives posted at that moment, never one posted later:
    /// the drain waits for sends only, and a receive still posted at destruction is reported
    /// flushed (`Core::cancel_ops`): no message can land in it any more.
    pub(in crate::reactor) stream_closed: bool,
    /// Its counters (`Conn::metrics`): each completion handed to its handler, its credit waits.
    pub(in crate::reactor) meter: ConnMeter,
    /// The keepalive timer's key while probes are scheduled (`Config::keepalive`).
    pub(in crate::reactor) keepalive: Option<u64>,
    /// An iWARP client's nudge timer while it has not heard from its server since its first
    /// message: its key, the index in `proto::transport::NUDGES` of the wait it ends, and
    /// what it had heard at ESTABLISHED (`ConnMeter::heard`).
    pub(in crate::reactor) nudge: Option<(u64, usize, u64)>,
    /// The parting timer's key: the peer said goodbye (the close handshake) and we answered;
    /// should its disconnect not arrive within `Timeouts::finish`, we disconnect (`data/cq/mod.rs`,
    /// `Core::on_farewell`).
    pub(in crate::reactor) parting: Option<u64>,
    /// Fault injection (`Reactor::inject_silent_parting`): this connection skips its
    /// `rdma_disconnect` after its farewell was answered.
    #[cfg(feature = "fault-injection")]
    pub(in crate::reactor) mute: bool,
    /// A client with a reconnect policy (`ConnectOptions::reconnect`, `reconnect.rs`).
    pub(in crate::reactor) redial: Option<Box<reconnect::Redial>>,
}

impl ConnEntry {
    pub(in crate::reactor) fn new(
        role: Role,
        handler: Box<dyn ConnectionHandler>,
        signal_every: u32,
        local: ConnectInfo,
    ) -> ConnEntry {
        ConnEntry {
            windows: Windows::default(),
            ep: Endpoint::None,
            tails: None,
            role,
            handler: Some(Guarded::new(handler)),
            placed: None,
            // Named after its slot and epoch when it gets a queue pair (`Lanes::set_id`).
            lanes: Lanes::new(0, 0, signal_every).expect("slot 0 is in range"),
            gate: Gate::CLOSED,
            dirty: false,
            waiting_room: false,
            deadline: None,
            stall: None,
            timers: Vec::new(),
            infos: Infos { local, peer: None, raw_private_data: None, sent: false },
            close_reason: None,
            srq_share: None,
            srq_withheld: srq::Withheld::default(),
            mem_owner: crate::sys::pool::next_owner(),
            account: None,
            stream_closed: false,
            meter: ConnMeter::default(),
            keepalive: None,
            nudge: None,
            parting: None,
            #[cfg(feature = "fault-injection")]
            mute: false,
            redial: None,
        }
    }

    /// While a client waits to reconnect or makes a new attempt (no queue pair yet): the
    /// device of its last queue pair, where operations submitted meanwhile are checked
    /// (`reconnect.rs`); `None` when it is not waiting or never had one.
    ///
    /// That device may be gone: a removal closes the client's queue pair, and the waiting
    /// client, which has none, does not keep the lost device from being released at the end
    /// of the same tick (`Core::release_lost_devices`). Then (and while it is lost) this is
    /// `Error::NoDevice`, never an index into `Devices`, whose slot is empty (its `Index`
    /// panics); the next attempt finds a device of its own.
    pub(in crate::reactor) fn waiting_device(&self, devices: &Devices) -> Option<Result<usize>> {
        let d = self.redial.as_ref().filter(|_| self.placed.is_none() && !self.role.state().is_closed())?.device?;
        Some(match devices.get(d) {
            Some(device) if !device.lost => Ok(d),
            _ => Err(Error::NoDevice(
                "the connection is reconnecting and the device of its last queue pair was removed: it has no device \
                 until a new attempt finds one"
                    .into(),
            )),
        })
    }

    /// True when operations may be posted: the queue pair exists and the connection is being
    /// set up, is established, or says goodbye (its farewell and receives still go; its send
    /// queue holds back the rest, `Lanes::say_farewell`).
    pub(in crate::reactor) fn can_post(&self) -> bool {
        self.ep.qp().is_some()
            && matches!(
                self.role.state(),
                State::Accepting | State::Connecting | State::Established | State::Finishing(_)
            )
    }

    /// True when operations are accepted: from the queue pair's creation until the connection
    /// is closed. On a closing connection they are never posted and complete with
    /// `OpError::Cancelled` (a receive re-posted as the peer disconnects is a normal race, not
    /// an error).
    pub(in crate::reactor) fn can_submit(&self) -> bool {
        self.placed.is_some() && !self.role.state().is_closed()
    }

    /// The CQs its completions land on: its own (or shared) CQ, and the device whose SRQ's CQ
    /// takes its receives when it is on a shared receive queue (`Core::reap_conn_cqs`).
    pub(in crate::reactor) fn cqs(&self) -> (Option<CqKey>, Option<usize>) {
        (self.placed.map(|p| p.cq), self.srq_share.and(self.placed).map(|p| p.device))
    }

    /// Recomputes the submission gate from the connection's state (`post::gate_of`): called
    /// where what it reads changes (its placement and shared receive queue share, the peer's
    /// connect information and this side's message size).
    pub(in crate::reactor) fn refresh_gate(&mut self, cfg: &crate::reactor::Config) {
        self.gate = crate::reactor::data::post::gate_of(self, cfg);
    }

    /// True when the connection is draining and nothing is outstanding.
    pub(in crate::reactor) fn drained(&self) -> bool {
        self.role.state().is_draining()
            && self.lanes.awaited() == 0
            && (self.lanes.outstanding().1 == 0 || self.stream_closed)
    }
}

pub(in crate::reactor) struct ListenerEntry {
    pub(in crate::reactor) id: Option<CmId>,
    pub(in crate::reactor) sm: Listener,
    pub(in crate::reactor) handler: Option<Guarded<dyn ListenerHandler>>,
    pub(in crate::reactor) close_reason: Option<CloseReason>,
    /// The reactors its connect requests are spread over (`handoff.rs`).
    pub(in crate::reactor) spread: Option<handoff::Spread>,
}

impl ListenerEntry {
    /// A listener with no id yet, its machine at the start, spreading nothing.
    pub(in crate::reactor) fn new(handler: Box<dyn ListenerHandler>) -> ListenerEntry {
        ListenerEntry {
            id: None,
            sm: Listener::new(),
            handler: Some(Guarded::new(handler)),
            close_reason: None,
            spread: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{ConnEntry, Role};
    use crate::error::Error;
    use crate::proto::conn::Client;
    use crate::proto::reconnect::Reconnect;
    use crate::reactor::conn::reconnect::Redial;
    use crate::reactor::event_loop::device::Devices;
    use crate::reactor::{Completion, Conn, ConnectionHandler};

    struct Quiet;

    impl ConnectionHandler for Quiet {
        fn on_completion(&mut self, _: &mut Conn<'_>, _: Completion) {}
    }

    /// The review's L2 (2026-11-26): a client waiting to reconnect after its device was
    /// removed names a device the reactor has released (its slot is empty, and indexing
    /// `Devices` with it panics). What the submit, alloc and region paths are given for it is
    /// `Error::NoDevice`, never that index.
    #[test]
    fn a_waiting_client_whose_device_was_released_has_no_device() {
        let mut c = ConnEntry::new(Role::Client(Client::resolving().0), Box::new(Quiet), 16, Default::default());
        let devices = Devices::default();
        assert!(c.waiting_device(&devices).is_none(), "no reconnect policy: not waiting");
        let dst = "192.0.2.1:7471".parse().expect("an address");
        c.redial = Some(Box::new(Redial::new(dst, None, Reconnect::default(), 1)));
        assert!(c.waiting_device(&devices).is_none(), "no queue pair yet: no device");
        // Its last queue pair was on device 0, which was lost and released since.
        c.redial.as_mut().expect("set").device = Some(0);
        assert!(devices.get(0).is_none(), "device 0 is released");
        match c.waiting_device(&devices) {
            Some(Err(Error::NoDevice(why))) => assert!(why.contains("was removed"), "{why}"),
            Some(Ok(d)) => panic!("device {d} is released and must not be indexed"),
            other => panic!("{other:?}"),
        }
    }
}
