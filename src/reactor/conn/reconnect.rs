//! Reconnecting clients (`ConnectOptions::reconnect`): the reactor's side. The policy and its
//! arithmetic are pure (`proto/reconnect.rs`).
//!
//! **One connection, several queue pairs.** A client with a policy keeps its `ConnEntry`, its
//! token and handler across failures; what belongs to one queue pair does not survive it:
//!
//! 1. A failure closes the connection as any other (disconnect, drain, `Core::destroy_conn`'s
//!    steps 1-3: windows, queue pair and id destroyed, CQs reaped, operations that never
//!    completed returned). There `destroy_conn` asks the policy (`Redial::failed`); when it
//!    allows another attempt, the connection is *carried* instead of removed:
//! 2. Operations not yet posted that can go on a new queue pair stay queued, in order
//!    (`Lanes::carry`: the receives a refused message gave back first, each an ordinary
//!    receive of the next queue pair): SENDs and receives. One-sided ones name the old peer's remote keys, which a new
//!    connection invalidates: they complete with `Cancelled`, as do the runtime's own
//!    (credit-only messages, window binds). Posted ones complete with their error
//!    (`Unconfirmed`, or flushed). The receive lane keeps its name (the old queue pair's
//!    epoch) while the client waits: a late completion of the old queue pair finds the posted
//!    window empty and is counted stale; the next queue pair's `setup_qp` renames the lanes
//!    with the next epoch (one epoch a queue pair).
//! 3. Its CQ is given up as at destruction (step 4), its SRQ place left, its deadline,
//!    credit-stall and keepalive timers forgotten (their keys no longer match), its machine
//!    reset to a client that has not started; its user timers and counters stay.
//! 4. The handler hears `on_reconnecting` (reason, attempt, delay), then the completions of 2.
//! 5. After the delay (`TimerTarget::Redial`) a new id resolves the same address; from there
//!    it is an ordinary client: `on_ready` for the new queue pair, then `on_reconnected`
//!    (instead of `on_established`), and the carried operations are posted.
//!
//! While it waits, two-sided operations may be submitted (checked against the old
//! connection's device and peer) and wait with the carried ones; one-sided ones are refused.
//! A local close while it waits, or during a failure's teardown, ends it for good
//! (`Redial::stopped`), and so does a reactor shutdown. Should a new attempt land on another
//! device, the carried operations (whose buffers are the old device's pool's) are cancelled.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::error::Error;
use crate::proto::conn::{Client, CloseReason, Input};
use crate::proto::reconnect::{Backoff, Reconnect};
use crate::proto::token::{ConnKey, Key};
use crate::reactor::event_loop::timers::TimerTarget;
use crate::reactor::Completion;
use crate::reactor::{Conn, Core, Endpoint, Role};
use crate::sys::cm::CmId;

/// A client's reconnect state (`ConnEntry::redial`).
pub(in crate::reactor) struct Redial {
    pub(in crate::reactor) dst: SocketAddr,
    pub(in crate::reactor) src: Option<SocketAddr>,
    backoff: Backoff,
    epoch: Instant,
    /// The next attempt's timer while it waits for it.
    pub(in crate::reactor) timer: Option<u64>,
    /// Established once: the next ESTABLISHED is a reconnection.
    pub(in crate::reactor) established: bool,
    /// The device of the last queue pair: whose pool the carried operations' buffers are
    /// from, and where submissions while waiting are checked.
    pub(in crate::reactor) device: Option<usize>,
    /// Closed locally: no further attempt.
    pub(in crate::reactor) stopped: bool,
}

impl Redial {
    pub(in crate::reactor) fn new(dst: SocketAddr, src: Option<SocketAddr>, policy: Reconnect, seed: u64) -> Redial {
        Redial {
            dst,
            src,
            backoff: Backoff::new(policy, seed),
            epoch: Instant::now(),
            timer: None,
            established: false,
            device: None,
            stopped: false,
        }
    }

    /// The connection ended for `reason`: the next attempt and its delay, or `None`.
    pub(in crate::reactor) fn failed(&mut self, reason: &CloseReason) -> Option<(u32, Duration)> {
        if self.stopped {
            return None;
        }
        self.backoff.failed(reason, self.epoch.elapsed())
    }
}

impl Core {
    /// `destroy_conn`'s fork: connection `t` (its queue pair and id destroyed, CQs reaped, the
    /// operations of `done` returned by `cancel_ops`) tries again: its CQ is given up, the
    /// rest of the old queue pair's state forgotten, the next attempt scheduled, and the
    /// handler told. Module docs, steps 3-4.
    pub(in crate::reactor) fn wait_to_redial(
        &mut self,
        t: ConnKey,
        attempt: u32,
        delay: Duration,
        done: Vec<Completion>,
    ) {
        let Some(c) = self.conns.get_mut(t) else { return };
        let (cq, _) = c.cqs();
        let recv_room = c.placed.map_or(0, |p| p.recv_room);
        let device = c.placed.map(|p| p.device);
        let reason = c.close_reason.take().unwrap_or(CloseReason::Local);
        c.placed = None;
        c.srq_share = None;
        // Until the next queue pair the slow path checks submissions (`Core::submit`).
        c.gate = crate::reactor::data::gate::Gate::CLOSED;
        c.tails = None;
        c.deadline = None;
        c.stall = None;
        c.keepalive = None;
        c.nudge = None;
        // The parting timer of a peer whose farewell the old queue pair answered: left keyed
        // here, it fired on the new connection `Timeouts::finish` later and ended it as a
        // silent parting (review finding M4, issue 32; tests/reconnect.rs).
        c.parting = None;
        #[cfg(feature = "fault-injection")]
        {
            c.mute = false;
        }
        c.stream_closed = false;
        c.waiting_room = false;
        c.infos.sent = false;
        // A wait for the old peer's credits ends with it.
        c.meter.credit_state(false, Instant::now());
        c.role = Role::Client(Client::resolving().0);
        // `destroy_conn` forks here only for a delay the clock can count to (else the client
        // would wait for ever); should one not fit all the same, no timer is set.
        let at = self.read_clock().checked_add(delay);
        let key = at.map(|at| self.timers.schedule(at, TimerTarget::Redial(t)));
        let c = self.conns.get_mut(t).expect("checked");
        let Some(r) = c.redial.as_mut() else { return };
        r.timer = key;
        if device.is_some() {
            r.device = device;
        }
        self.release_conn_cq(t, cq, recv_room);
        self.stats.reconnects += 1;
        event!(
            warn,
            "{:?}: {reason}; reconnecting to {} in {delay:?} (attempt {attempt})",
            t.token(),
            self.conns.get(t).and_then(|c| c.redial.as_ref()).map_or_else(String::new, |r| r.dst.to_string())
        );
        self.with_conn(t, |h, conn| h.on_reconnecting(conn, &reason, attempt, delay));
        for completion in done {
            self.deliver_completion(t, completion);
        }
    }

    /// The reconnect timer `key` of connection `t` fired: a new id resolves the address (module
    /// docs, step 5). Returns 1 when it started an attempt.
    pub(in crate::reactor) fn redial(&mut self, t: ConnKey, key: u64) -> usize {
        let Some(c) = self.conns.get_mut(t) else { return 0 };
        let Some(r) = c.redial.as_mut().filter(|r| r.timer == Some(key)) else { return 0 };
        r.timer = None;
        let (dst, src) = (r.dst, r.src);
        let (client, first) = Client::resolving();
        c.role = Role::Client(client);
        c.infos.peer = None;
        let what = format!("client to {dst} (reconnecting)");
        let ms = crate::reactor::conn::setup::millis(self.cfg.timeouts.resolve_addr);
        let id = CmId::new(&self.cm, t.token().as_u64())
            .map_err(|e| Error::verb("rdma_create_id", what.clone(), e))
            .and_then(|id| {
                id.resolve_addr(src.as_ref(), &dst, ms).map_err(|e| Error::verb("rdma_resolve_addr", what, e))?;
                Ok(id)
            });
        match id {
            Ok(id) => {
                self.conns.get_mut(t).expect("checked").ep = Endpoint::Id(id);
                self.apply(t, first);
            }
            // Fails this attempt: the teardown asks the policy again.
            Err(e) => self.feed(t, Input::SetupFailed(e.chain())),
        }
        1
    }

    /// A reconnection's queue pair is on device `device`: if the carried operations' buffers
    /// are another device's, they cannot go on it and are cancelled.
    pub(in crate::reactor) fn carried_to(&mut self, t: ConnKey, device: usize) {
        let Some(r) = self.conns.get_mut(t).and_then(|c| c.redial.as_mut()) else { return };
        let old = r.device.replace(device);
        if old.is_none() || old == Some(device) {
            return;
        }
        // Nothing of it is posted (no queue pair yet): each completes `Cancelled`.
        for completion in self.cancel_ops(t, None, false) {
            self.deliver_completion(t, completion);
        }
    }

    /// ESTABLISHED: the handler's `on_established`, or `on_reconnected` when it is a
    /// reconnection (then the policy's series of failures starts again).
    pub(in crate::reactor) fn established_callback(&mut self, t: ConnKey) {
        let again = match self.conns.get_mut(t).and_then(|c| c.redial.as_mut()) {
            Some(r) => {
                r.backoff.connected();
                std::mem::replace(&mut r.established, true)
            }
            None => false,
        };
        if again {
            self.stats.reconnected += 1;
            self.with_conn(t, |h, conn: &mut Conn<'_>| h.on_reconnected(conn));
        } else {
            self.with_conn(t, |h, conn| h.on_established(conn));
        }
    }
}
