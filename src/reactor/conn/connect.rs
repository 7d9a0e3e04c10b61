//! A client's `rdma_connect`, and why on iWARP it runs on a helper thread.
//!
//! On InfiniBand and RoCE `rdma_connect` sends a REQ and returns; the answer is a CM event.
//! On iWARP the call itself makes the TCP connection (Soft-iWARP's `siw_connect` blocks in the
//! kernel's `kernel_connect` until the handshake ends), so on the reactor's thread a connect to
//! a host that drops SYNs would freeze every other connection of the reactor until TCP gives up
//! (about 2 minutes at Linux's defaults). There the call runs on a helper thread that exists
//! for that call alone (`sys::connect::Connecting`), which holds the connection's queue pair
//! meanwhile ([`Endpoint::Connecting`]):
//!
//! - nothing is posted on it and no command is issued on its id (an `rdma_disconnect` would
//!   wait in the kernel for the call to end): operations submitted meanwhile wait in the
//!   connection's queues, a close only moves its state machine;
//! - it is not destroyed: a connection closed meanwhile (its connect deadline, a close) is
//!   destroyed, and its handler hears the rest and `on_closed`, when the call has returned
//!   (`destroy_conn` skips it until then; [`Core::connect_returned`] queues it again);
//! - the helper tells the reactor through its `Remote` inbox when the call returned; the reactor
//!   joins it there, on its own thread, and feeds the result to the state machine as the inline
//!   call's would be (a refused TCP connection is `Rejected { status: -111 }`);
//! - at most [`MAX_CALLS`] helpers run at once; further connects wait their turn in order, with
//!   their connect deadline running (64 calls to hosts that drop SYNs hold every helper for
//!   about 2 minutes, so a connect queued behind them to a healthy host can time out before
//!   its call; closing a connection does not end its call);
//! - the kernel queues the call's own CM events (ESTABLISHED, REJECTED, ...) only once the
//!   call has returned (it holds the id's handler mutex for the call): such an event read
//!   before the helper's wakeup is handled after joining it, which waits at most for the
//!   helper's last instructions in the library, whichever of the two epoll reported first. An
//!   event queued before the call (an address change) is handled while it runs, without the
//!   queue pair, unless the helper has said its call returned; the reactor never waits for
//!   the kernel's call (but at shutdown);
//! - a shutdown (and so dropping the reactor) waits for the calls still running: the kernel
//!   offers no way to end one early that is safe (a signal corrupts a Soft-iWARP listener that
//!   queued the stream, FAULTS.md "a signal while connecting").
//!
//! [`Endpoint::Connecting`]: crate::reactor::Endpoint::Connecting

use std::collections::VecDeque;
use std::time::Instant;

use crate::proto::conn::{Input, State};
use crate::proto::flow::MIN_DEPTH;
use crate::proto::token::{ConnKey, Key, Token};
use crate::proto::transport::Transport;
use crate::proto::wire::MAX_CONNECT_PRIVATE_DATA;
use crate::reactor::conn::setup::RD_ATOM;
use crate::reactor::{Core, Endpoint};
use crate::sys::connect::Connecting;

/// Helper threads connecting at once, per reactor; more connects wait for one to return.
pub(in crate::reactor) const MAX_CALLS: usize = 64;

/// The reactor's connect calls on helper threads.
#[derive(Default)]
pub(in crate::reactor) struct ConnectCalls {
    /// Calls running on helpers now.
    pub(in crate::reactor) running: usize,
    /// Connections waiting for a helper, in order: their connect information and the call's
    /// deadline.
    waiting: VecDeque<(ConnKey, Vec<u8>, Option<Instant>)>,
}

impl ConnectCalls {
    /// Forgets connection `t`'s place in the line (it is being destroyed or reconnects).
    pub(in crate::reactor) fn forget(&mut self, t: ConnKey) {
        self.waiting.retain(|w| w.0 != t);
    }
}

impl Core {
    /// The client's `Action::Connect`: queue pair, first receives, `rdma_connect`.
    pub(in crate::reactor) fn client_connect(&mut self, t: ConnKey) -> Option<Input> {
        if let Err(e) = self.setup_qp(t) {
            return Some(Input::SetupFailed(e.chain()));
        }
        let depth = match self.ready(t) {
            Ok(Some(depth)) => depth,
            Ok(None) => return None,
            Err(e) => return Some(Input::SetupFailed(e.chain())),
        };
        let flow_offer = self.cfg.flow_control;
        let placed = self.conns.get(t)?.placed;
        let iwarp = placed.is_some_and(|p| self.devices[p.device].caps.transport == Transport::Iwarp);
        let handshake = self.offers_close_handshake(t);
        let c = self.conns.get_mut(t)?;
        // Tails land in the receive buffers' slack (`Pool::new`): message sizes stay whole.
        c.infos.local.tail = placed.is_some_and(|p| p.tail);
        c.infos.local.recv_depth = depth.min(u32::from(u16::MAX)) as u16;
        c.infos.local.flow_control = flow_offer && depth >= MIN_DEPTH;
        c.infos.local.farewell = c.infos.local.flow_control && handshake;
        c.infos.sent = true;
        let bytes = match (&c.infos.raw_private_data, c.infos.local.encode(MAX_CONNECT_PRIVATE_DATA)) {
            (Some(raw), _) => raw.clone(),
            (None, Ok(b)) => b,
            (None, Err(e)) => return Some(Input::SetupFailed(format!("connect information: {e}"))),
        };
        // An interrupted call is made again, as `SA_RESTART` would, for at most the connect
        // step's deadline (none if it cannot be represented, as for the step's own timer in
        // `act`; `Config::validate` bounds it).
        let deadline = Instant::now().checked_add(self.cfg.timeouts.connect);
        if iwarp {
            if self.calls.running >= MAX_CALLS {
                self.calls.waiting.push_back((t, bytes, deadline));
                self.stats.connects_queued += 1;
                return None;
            }
            return self.start_call(t, &bytes, deadline);
        }
        let param = self.conn_param(&bytes, RD_ATOM, RD_ATOM);
        let id = self.conns.get(t)?.ep.id()?;
        let (result, interrupted) = crate::sys::restart_interrupted(deadline, || id.connect(&param));
        self.stats.interrupted_connects += u64::from(interrupted);
        result.err().map(connect_failed)
    }

    /// Starts connection `t`'s `rdma_connect` on a helper thread.
    fn start_call(&mut self, t: ConnKey, bytes: &[u8], deadline: Option<Instant>) -> Option<Input> {
        let param = self.conn_param(bytes, RD_ATOM, RD_ATOM);
        let remote = self.inbox.remote();
        let token = t.token().as_u64();
        let c = self.conns.get_mut(t)?;
        let ep = std::mem::replace(&mut c.ep, Endpoint::None);
        let Endpoint::Qp(qp) = ep else {
            // Not reached: a client connects once its queue pair exists (`client_connect`,
            // `start_waiting` checks).
            c.ep = ep;
            return Some(Input::SetupFailed("rdma_connect: the connection has no queue pair".into()));
        };
        match Connecting::start(qp, &param, deadline, move || remote.connect_returned(token)) {
            Ok(call) => {
                c.ep = Endpoint::Connecting(call);
                self.calls.running += 1;
                self.stats.connect_threads += 1;
                None
            }
            Err((qp, e)) => {
                c.ep = Endpoint::Qp(qp);
                Some(Input::SetupFailed(format!("rdma_connect: no thread to make the call on: {e}")))
            }
        }
    }

    /// Connection `token`'s helper said its call returned (`Remote` inbox): takes the queue
    /// pair back and feeds the result; destroys a connection closed meanwhile; starts the next
    /// waiting call.
    pub(in crate::reactor) fn connect_returned(&mut self, token: u64) {
        let Some(t) = Token::from_u64(token).and_then(|tok| self.conns.key_of(tok)) else { return };
        // Only a call that has returned: a reconnecting client keeps its token, so a wakeup
        // read late could name a newer call that still runs (its own wakeup comes later).
        if self.conns.get(t).is_some_and(|c| c.ep.has_returned()) {
            self.finish_call(t);
        }
        self.start_waiting();
    }

    /// A CM event of connection `t` came while its helper was not joined yet: joins it (its
    /// call has returned), then starts a waiting call; the helper's own wakeup finds it done.
    pub(in crate::reactor) fn connect_returned_before_event(&mut self, t: ConnKey) {
        self.finish_call(t);
        self.start_waiting();
    }

    /// Joins connection `t`'s helper (waiting for it if it still runs) and carries on.
    pub(in crate::reactor) fn finish_call(&mut self, t: ConnKey) {
        let Some(c) = self.conns.get_mut(t) else { return };
        let ep = std::mem::replace(&mut c.ep, Endpoint::None);
        let Endpoint::Connecting(call) = ep else {
            // A stale wakeup: the call was finished already (by a shutdown's `finish_all_calls`, or
            // for a CM event of the id that came first).
            c.ep = ep;
            return;
        };
        let (qp, result, interrupted) = call.finish();
        c.ep = Endpoint::Qp(qp);
        self.calls.running -= 1;
        self.stats.interrupted_connects += u64::from(interrupted);
        if c.close_reason.is_some() {
            // Closed while the call ran: its destruction waited for it (`destroy_conn`).
            self.closing.conns.push(t);
            return;
        }
        match result {
            // What was submitted meanwhile can go to the queue pair now.
            Ok(()) => self.mark_dirty(t),
            Err(e) => self.feed(t, connect_failed(e)),
        }
    }

    /// Starts waiting calls while helpers are free; a connection that closed or moved on
    /// meanwhile has left the line (`ConnectCalls::forget`) or is skipped.
    fn start_waiting(&mut self) {
        while self.calls.running < MAX_CALLS {
            let Some((t, bytes, deadline)) = self.calls.waiting.pop_front() else { return };
            let ready = self.conns.get(t).is_some_and(|c| {
                c.close_reason.is_none() && c.ep.qp().is_some() && matches!(c.role.state(), State::Connecting)
            });
            if ready {
                if let Some(input) = self.start_call(t, &bytes, deadline) {
                    self.feed(t, input);
                }
            }
        }
    }

    /// A shutdown's last step: waits for every helper still connecting (`teardown.rs`).
    pub(in crate::reactor) fn finish_all_calls(&mut self) {
        self.calls.waiting.clear();
        let running: Vec<ConnKey> = self.conns.iter().filter(|(_, c)| c.ep.is_connecting()).map(|(k, _)| k).collect();
        for t in running {
            self.finish_call(t);
        }
    }
}

/// The input a failed `rdma_connect` gives the state machine.
fn connect_failed(e: std::io::Error) -> Input {
    // On iWARP `rdma_connect` makes the TCP connection itself: a port where nothing listens
    // refuses it right there, where InfiniBand's CM answers with a REJ later.
    if e.raw_os_error() == Some(nix::libc::ECONNREFUSED) {
        return Input::Rejected { status: -nix::libc::ECONNREFUSED, reason: None };
    }
    Input::SetupFailed(format!("rdma_connect: {e}"))
}
