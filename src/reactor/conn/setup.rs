//! Connection setup: rdma_cm event dispatch, listening, accepting, connecting, queue pairs and
//! per-device resources.

use std::net::{IpAddr, SocketAddr};

use crate::error::{Error, Result};
use crate::proto::conn::{Agent, Client, CloseReason, CmEventKind, Input, ListenerAction};
use crate::proto::flow::{negotiate, MIN_DEPTH};
use crate::proto::token::{ConnKey, Key, Kind, ListenerKey, Token, WrId};
use crate::proto::transport::{normalize_reject_status, Caps, Transport};
use crate::proto::wire::{ConnectInfo, RejectCode, RejectReason, MAX_ACCEPT_PRIVATE_DATA, MAX_CONNECT_PRIVATE_DATA};
use crate::reactor::api::config::{over_recv_budget, recv_size};
use crate::reactor::conn::entry::Reserved;
use crate::reactor::data::lanes::Rename;
use crate::reactor::{
    ConnEntry, ConnectOptions, ConnectRequest, ConnectionHandler, Core, Decision, Endpoint, ListenerEntry,
    ListenerHandler, Placement, Role, TailRing,
};
use crate::sys::cm::{CmEvent, CmId, ConnParam};
use crate::sys::pool::Account;
use crate::sys::qp::{Qp, QpCaps};

/// RDMA READ/atomic depth requested and granted on every connection.
pub(super) const RD_ATOM: u8 = 4;

/// [`Lanes::can_rename`](crate::reactor::data::lanes::Lanes::can_rename)'s answer as
/// `setup_qp`'s error: a slot index beyond what a work request id carries (a reactor with more
/// live connections than `WrId::MAX_INDEX + 1`, which `Config::validate` keeps out of reach: it
/// refuses a `max_connections` above `WrId::MAX_INDEX`, the one connection a connect request's
/// handler may open beyond the limit included),
/// or a connection given a queue pair while its last one's requests are outstanding (no path
/// does: `destroy_conn` and `carried_to` empty the lanes first; refused rather than renaming,
/// which would free memory the device may still write, review L3).
pub(super) fn rename_check(check: std::result::Result<(), Rename>) -> Result<()> {
    match check {
        Ok(()) => Ok(()),
        Err(Rename::IndexBeyond) => Err(Error::Limit {
            what: "live connections of one reactor (the slot index a work request id carries)",
            limit: WrId::MAX_INDEX as usize + 1,
        }),
        Err(Rename::Outstanding { sends, recvs }) => Err(Error::NotConnected(format!(
            "a new queue pair for a connection whose last one still has {sends} sends and {recvs} receives \
             outstanding"
        ))),
    }
}

impl Core {
    // ----- commands (called through Ctx) ----------------------------------------------------

    pub(crate) fn listen(&mut self, addr: SocketAddr, handler: Box<dyn ListenerHandler>) -> Result<Token> {
        self.refuse_when_shutting_down()?;
        let t = self.listeners.insert(ListenerEntry::new(handler));
        let what = format!("listener on {addr}");
        let setup = (|| {
            let id =
                CmId::new(&self.cm, t.token().as_u64()).map_err(|e| Error::verb("rdma_create_id", what.clone(), e))?;
            id.bind(&addr).map_err(|e| Error::verb("rdma_bind_addr", what.clone(), e))?;
            // Bound to an address of one device: create its resources now, so the first
            // connection does not pay for them and a quiet server's resource count is stable.
            if let Some(dev) = id.device() {
                self.device(dev, id.local_addr())?;
            }
            id.listen(self.cfg.backlog).map_err(|e| Error::verb("rdma_listen", what.clone(), e))?;
            Ok(id)
        })();
        match setup {
            Ok(id) => {
                event!(info, "{:?}: listening on {addr}", t.token());
                self.listeners.get_mut(t).expect("inserted").id = Some(id);
                Ok(t.token())
            }
            Err(e) => {
                self.listeners.remove(t);
                Err(e)
            }
        }
    }

    pub(crate) fn connect(
        &mut self,
        dst: SocketAddr,
        opts: ConnectOptions,
        handler: Box<dyn ConnectionHandler>,
    ) -> Result<Token> {
        self.refuse_when_shutting_down()?;
        if self.conns.len() + self.waiting.len() >= self.cfg.max_connections {
            return Err(Error::Limit { what: "max_connections", limit: self.cfg.max_connections });
        }
        let (client, first) = Client::resolving();
        let max = self.max_msg();
        // The size this client announces is the size of its receives (`Config::msg_size`).
        let msg_size = if opts.msg_size == 0 { recv_size(&self.cfg, None, max) } else { opts.msg_size };
        if msg_size as usize > max {
            return Err(Error::TooLarge {
                len: msg_size as usize,
                max,
                limit: "the pool's largest chunk, PoolConfig::chunk_sizes (Config::pool)",
            });
        }
        if let Some(why) = over_recv_budget(&self.cfg, msg_size) {
            event!(info, "a connect to {dst} refused: {why}");
            let _ = why;
            return Err(Error::Limit { what: "Config::recv_budget", limit: self.cfg.recv_budget });
        }
        let local = ConnectInfo {
            msg_size,
            msg_count: opts.msg_count,
            recv_depth: 1,
            flow_control: false,
            tail: false,
            farewell: false,
            user: opts.user_data,
        };
        local.encode(MAX_CONNECT_PRIVATE_DATA)?;
        if opts.raw_private_data.as_ref().is_some_and(|r| r.len() > MAX_CONNECT_PRIVATE_DATA) {
            return Err(Error::Config(format!("raw private data is limited to {MAX_CONNECT_PRIVATE_DATA} bytes")));
        }
        if let Some(Err(why)) = opts.reconnect.as_ref().map(|r| r.check()) {
            return Err(Error::Config(why));
        }
        let mut entry = ConnEntry::new(Role::Client(client), handler, self.cfg.signal_every, local);
        if let Some(policy) = opts.reconnect {
            let seed = entry.mem_owner ^ u64::from(std::process::id()).rotate_left(32);
            entry.redial = Some(Box::new(crate::reactor::conn::reconnect::Redial::new(dst, opts.src, policy, seed)));
        }
        let t = self.conns.insert(entry);
        let what = format!("client to {dst}");
        let ms = millis(self.cfg.timeouts.resolve_addr);
        let setup = (|| {
            let id =
                CmId::new(&self.cm, t.token().as_u64()).map_err(|e| Error::verb("rdma_create_id", what.clone(), e))?;
            id.resolve_addr(opts.src.as_ref(), &dst, ms)
                .map_err(|e| Error::verb("rdma_resolve_addr", what.clone(), e))?;
            Ok(id)
        })();
        match setup {
            Ok(id) => {
                let c = self.conns.get_mut(t).expect("inserted");
                c.ep = Endpoint::Id(id);
                c.infos.raw_private_data = opts.raw_private_data;
                self.apply(t, first);
                Ok(t.token())
            }
            Err(e) => {
                self.conns.remove(t);
                Err(e)
            }
        }
    }

    /// True when connection `t` offers the close handshake: `Config::close_handshake`, on a
    /// device where a completed SEND is no receipt (`Caps::close_handshake`).
    pub(super) fn offers_close_handshake(&self, t: ConnKey) -> bool {
        let placed = self.conns.get(t).and_then(|c| c.placed);
        self.cfg.close_handshake && placed.is_some_and(|p| self.devices[p.device].caps.close_handshake())
    }

    /// The largest message a connection takes: the pool's largest chunk, or on a shared
    /// receive queue its buffer size.
    pub(in crate::reactor) fn max_msg(&self) -> usize {
        let max = self.cfg.pool.max_chunk();
        self.cfg.srq.map_or(max, |s| max.min(s.buf_size as usize))
    }

    /// Why a new connection cannot be taken, if it cannot: the live ones and the connect
    /// requests waiting for room (`waiting.rs`) together at `Config::max_connections`.
    fn over_limit(&self) -> Option<String> {
        let cfg = &self.cfg;
        if self.conns.len() + self.waiting.len() >= cfg.max_connections {
            return Some(format!(
                "connection limit reached (max_connections = {}: {} connections, {} requests waiting)",
                cfg.max_connections,
                self.conns.len(),
                self.waiting.len()
            ));
        }
        None
    }

    pub(in crate::reactor) fn refuse_when_shutting_down(&self) -> Result<()> {
        if self.shutting_down {
            return Err(Error::NotConnected("the reactor is shutting down".into()));
        }
        Ok(())
    }

    // ----- rdma_cm events -------------------------------------------------------------------

    pub(in crate::reactor) fn drain_cm(&mut self) -> Result<usize> {
        let mut n = 0;
        loop {
            self.stats.channel_reads += 1;
            let mut ev = match self.cm.get_event() {
                Ok(Some(ev)) => ev,
                Ok(None) => break,
                Err(e) if e.raw_os_error() == Some(nix::libc::EINTR) => continue,
                Err(e) => return Err(Error::verb("rdma_get_cm_event", "shared event channel", e)),
            };
            n += 1;
            self.stats.cm_events += 1;
            self.on_cm_event(&mut ev);
            // The event is acked here, before the next is read; ids it names are destroyed
            // only at the end of the tick.
            drop(ev);
            if !self.handoff.outgoing.is_empty() {
                // A connect request chosen for another reactor: its event is acked, no other
                // event of its id was read, so it migrates now without blocking.
                self.send_handoffs();
            }
        }
        Ok(n)
    }

    fn on_cm_event(&mut self, ev: &mut CmEvent) {
        let mut token = Token::from_u64(ev.context());
        if token.is_some_and(|t| t.kind() == Kind::Handoff) {
            // An event of an id migrated here whose parcel is not adopted yet: the sender
            // queued it under the inbox lock it migrated under, so it is there now.
            self.take_handoffs();
            token = Token::from_u64(ev.context());
        }
        if let Some(t) = token.and_then(|t| self.listeners.key_of(t)) {
            return self.on_listener_event(t, ev);
        }
        if let Some(t) = token.and_then(|t| self.conns.key_of(t)) {
            return self.on_conn_event(t, ev);
        }
        self.stats.stale_cm_events += 1;
        self.refuse_child(ev, "listener closed");
    }

    /// Rejects the id a connect request created, if `ev` is one, and queues it for
    /// destruction.
    fn refuse_child(&mut self, ev: &mut CmEvent, why: &str) {
        if let Some(child) = ev.take_child(&self.cm, 0) {
            self.reject_child(child, &RejectReason::new(RejectCode::Refused, why));
        }
    }

    /// Rejects connect request `child` of listener `lt` with `reason` and tells the listener's
    /// handler (`on_refused`): the reactor's own refusals (`decide`, `waiting.rs`).
    pub(in crate::reactor) fn refuse_request(&mut self, lt: ListenerKey, child: CmId, reason: RejectReason) {
        let peer = child.peer_addr();
        self.reject_child(child, &reason);
        self.with_listener(lt, |h, ctx| h.on_refused(ctx, peer, &reason));
    }

    /// Rejects a connect request's new id with `reason`; the id is destroyed at the end of the
    /// tick, after its CONNECT_REQUEST is acked.
    pub(in crate::reactor) fn reject_child(&mut self, child: CmId, reason: &RejectReason) {
        event!(
            info,
            "rejected a connect request from {}: {reason}",
            child.peer_addr().map_or_else(|| "an unknown address".to_string(), |a| a.to_string())
        );
        let _ = child.reject(&reason.encode());
        self.stats.rejected += 1;
        self.closing.rejected.push(child);
    }

    fn on_listener_event(&mut self, t: ListenerKey, ev: &mut CmEvent) {
        if ev.kind() == CmEventKind::DeviceRemoval {
            let dev = self.listeners.get(t).and_then(|l| l.id.as_ref()).and_then(|id| id.device());
            if let Some(d) = dev.and_then(|dev| self.devices.index_of(dev)) {
                self.device_lost(d, CloseReason::DeviceRemoval);
            }
        }
        let Some(l) = self.listeners.get_mut(t) else { return };
        match l.sm.on_cm(ev.kind(), ev.status()) {
            ListenerAction::Incoming => self.incoming(t, ev),
            ListenerAction::Report(what) => self.with_listener(t, |h, ctx| h.on_error(ctx, &what)),
            ListenerAction::Closed(reason) => {
                l.close_reason = Some(reason);
                self.closing.listeners.push(t);
            }
            ListenerAction::None => self.refuse_child(ev, "listener closed"),
        }
    }

    fn incoming(&mut self, lt: ListenerKey, ev: &mut CmEvent) {
        if self.hand_off_if_spread(lt, ev) {
            return;
        }
        let Some(child) = ev.take_child(&self.cm, 0) else { return };
        self.decide(lt, child, &ev.private_data(), ev.conn_resources());
    }

    /// A connect request's new id, arrived on listener `lt` or handed over by another reactor
    /// (`handoff.rs`): checks it, asks the listener's handler, accepts or rejects.
    /// `resources` are the requested (initiator depth, responder resources).
    pub(in crate::reactor) fn decide(
        &mut self,
        lt: ListenerKey,
        child: CmId,
        private_data: &[u8],
        resources: (u8, u8),
    ) {
        let peer = child.peer_addr();
        let refuse = |core: &mut Core, child: CmId, reason: RejectReason| core.refuse_request(lt, child, reason);
        // The penalty box first: a peer that broke the protocol costs a reject, nothing more.
        if let Some(left) = self.penalized(peer) {
            self.stats.violation_refusals += 1;
            let text = format!(
                "a connection from this address broke the protocol: refused for {} ms more (Config::violation_backoff)",
                left.as_millis().max(1)
            );
            return refuse(self, child, RejectReason::new(RejectCode::Backoff, text));
        }
        let info = match ConnectInfo::decode(private_data) {
            Ok(info) => info,
            Err(e) => return refuse(self, child, RejectReason::new(RejectCode::BadConnectInfo, e.to_string())),
        };
        let caps = child.device().map_or(Caps::infiniband(), |d| self.caps_of(d));
        if let Some(i) = info.as_ref().filter(|i| i.tail != caps.tail()) {
            // Tails frame every message on a transport without immediate data; a peer that
            // disagrees would misread each one (`proto::transport`).
            let text = if caps.tail() {
                "this server's device has no immediate data (iWARP): its messages end in a tail, and the \
                 connect information does not announce one (wire version 2)"
                    .to_string()
            } else {
                format!("the connect information announces message tails, which {} does not use", caps.transport.name())
            };
            let _ = i;
            return refuse(self, child, RejectReason::new(RejectCode::BadConnectInfo, text));
        }
        if let Some(i) = &info {
            let max = self.max_msg();
            if i.msg_size as usize > max {
                let text = format!("message size {} exceeds the server's maximum {max}", i.msg_size);
                return refuse(self, child, RejectReason::new(RejectCode::Unsupported, text));
            }
        }
        // Its receives are of the smaller of its claim and ours (`Config::msg_size`), and as
        // many as `Config::recv_depth`: refused before anything is registered for it if they
        // would pin more than `Config::recv_budget` (the review of 2026-11-26, M2).
        let size = recv_size(&self.cfg, info.as_ref().map(|i| i.msg_size), self.max_msg());
        if let Some(why) = over_recv_budget(&self.cfg, size) {
            return refuse(self, child, RejectReason::new(RejectCode::NoResources, why));
        }
        // The pool as a whole: a request whose first receives the device's pool can no longer
        // hold (free chunks, and clusters `PoolConfig::max_bytes` still allows) is refused
        // now, not accepted to fail its first `alloc` (issue 32 item 1).
        if let Some(why) = self.pool_cannot_hold(&child, size) {
            return refuse(self, child, RejectReason::new(RejectCode::NoResources, why));
        }
        // Its reservation (issue 45): the pool's reservations, and its address's, have room.
        if let Some(why) = self.reservation_refusal(&child, peer, size) {
            self.stats.reservations_refused += 1;
            return refuse(self, child, RejectReason::new(RejectCode::NoResources, why));
        }
        if self.cfg.srq.is_some()
            && !info.as_ref().is_some_and(|i| i.flow_control && u32::from(i.recv_depth) >= MIN_DEPTH)
        {
            // Without flow control nothing keeps this peer from consuming every receive of the
            // shared queue, starving every other connection on it (`data/srq/mod.rs`).
            let text = format!(
                "this server receives through a shared receive queue, which needs flow control: the connect \
                 information does not offer it (with a receive depth of at least {MIN_DEPTH})"
            );
            return refuse(self, child, RejectReason::new(RejectCode::Unsupported, text));
        }
        if self.cfg.max_pending_accepts == 0 {
            let text = "this server accepts nothing (max_pending_accepts = 0)";
            return refuse(self, child, RejectReason::new(RejectCode::NoResources, text));
        }
        if let Some(text) = self.over_limit() {
            return refuse(self, child, RejectReason::new(RejectCode::NoResources, text));
        }
        if self.accepting >= self.cfg.max_pending_accepts || self.waiting.queued_first() {
            // Beyond the pending accepts (or behind requests that wait already): waits for
            // room, decided from the start then (`waiting.rs`).
            return self.park_request(lt, child, private_data, resources);
        }
        let req = ConnectRequest { listener: lt.token(), peer, info };
        let mut decision = None;
        self.with_listener(lt, |h, ctx| decision = Some(h.on_connect_request(ctx, &req)));
        match decision {
            None => refuse(self, child, RejectReason::new(RejectCode::Refused, "listener closed")),
            Some(Decision::Reject(reason)) => self.reject_child(child, &reason),
            Some(Decision::Accept(handler)) => self.accept(lt, child, req.info, handler, resources),
        }
    }

    fn accept(
        &mut self,
        lt: ListenerKey,
        child: CmId,
        info: Option<ConnectInfo>,
        handler: Box<dyn ConnectionHandler>,
        resources: (u8, u8),
    ) {
        let peer = child.peer_addr();
        let (agent, first) = Agent::accepting();
        // What this side announces is the size of the receives it posts (`Conn::msg_size`, set
        // before `on_ready` posts them): the smaller of the client's claim and ours.
        let msg_size = recv_size(&self.cfg, info.as_ref().map(|i| i.msg_size), self.max_msg());
        let own = ConnectInfo { msg_size, ..ConnectInfo::default() };
        let entry = ConnEntry::new(Role::Agent(agent), handler, self.cfg.signal_every, own);
        let t = self.conns.insert(entry);
        self.accepting += 1;
        child.set_context(t.token().as_u64());
        let c = self.conns.get_mut(t).expect("just inserted");
        c.infos.peer = info;
        c.ep = Endpoint::Id(child);
        self.apply(t, first);
        if let Err(e) = self.setup_qp(t) {
            // No resources for it (the shared CQ's room, a queue pair, the device's PD or
            // pool): the handler was told nothing yet, so this is the listener's refusal, as
            // `ListenerHandler::on_refused` documents. The handler is dropped unused.
            let reason = RejectReason::new(RejectCode::NoResources, e.chain());
            if let Some(c) = self.conns.remove(t) {
                self.accepting = self.accepting.saturating_sub(1);
                if let Endpoint::Id(id) = c.ep {
                    self.reject_child(id, &reason);
                }
            }
            return self.with_listener(lt, |h, ctx| h.on_refused(ctx, peer, &reason));
        }
        let depth = match self.ready(t) {
            Ok(Some(depth)) => depth,
            Ok(None) => return self.reject_accepted(t, RejectCode::Refused, "closed before it was accepted"),
            Err(e) => {
                self.reject_accepted(t, RejectCode::NoResources, &e.chain());
                return self.feed(t, Input::SetupFailed(e.chain()));
            }
        };
        let flow_offer = self.cfg.flow_control;
        let c = self.conns.get_mut(t).expect("live");
        let tail = c.placed.is_some_and(|p| p.tail);
        // The close handshake, when both sides take part.
        let handshake = self.offers_close_handshake(t);
        let c = self.conns.get_mut(t).expect("live");
        // A tail lands in the slack after a full chunk (`Pool::new`): the whole size is payload.
        let msg_size = c.infos.local.msg_size;
        let flow = negotiate(flow_offer, depth, c.infos.peer.as_ref());
        let farewell = handshake && flow.is_some() && c.infos.peer.as_ref().is_some_and(|p| p.farewell);
        let local = ConnectInfo {
            msg_size,
            msg_count: 0,
            recv_depth: depth as u16,
            flow_control: flow.is_some(),
            tail,
            farewell,
            user: Vec::new(),
        };
        // The agent's sends wait for the client's first message (`proto::transport`); with
        // no receives it cannot see one, and waits for nothing.
        let first = c.placed.is_some_and(|p| self.devices[p.device].caps.client_sends_first());
        let c = self.conns.get_mut(t).expect("live");
        c.lanes.set_hold(first && tail && depth > 0);
        c.lanes.set_flow(flow);
        c.lanes.set_farewell(farewell);
        let bytes = local.encode(MAX_ACCEPT_PRIVATE_DATA).unwrap_or_default();
        c.infos.local = local;
        c.infos.sent = true;
        // This side's message size is set: the gate's limit follows.
        c.refresh_gate(&self.cfg);
        let (initiator, responder) = resources;
        let param = self.conn_param(&bytes, initiator.min(RD_ATOM), responder.min(RD_ATOM));
        let c = self.conns.get(t).expect("live");
        match c.ep.id().expect("live id").accept(&param) {
            Ok(()) => {
                self.stats.accepted += 1;
                event!(
                    info,
                    "{:?}: accepted a connect request from {}",
                    t.token(),
                    c.ep.id().and_then(|id| id.peer_addr()).map_or_else(String::new, |a| a.to_string())
                );
            }
            Err(e) => self.feed(t, Input::SetupFailed(format!("rdma_accept: {e}"))),
        }
    }

    fn reject_accepted(&mut self, t: ConnKey, code: RejectCode, text: &str) {
        if let Some(id) = self.conns.get(t).and_then(|c| c.ep.id()) {
            event!(
                info,
                "{:?}: rejected the connect request from {}: {code}: {text}",
                t.token(),
                id.peer_addr().map_or_else(String::new, |a| a.to_string())
            );
            let _ = id.reject(&RejectReason::new(code, text).encode());
            self.stats.rejected += 1;
        }
    }

    fn on_conn_event(&mut self, t: ConnKey, ev: &CmEvent) {
        let own = matches!(
            ev.kind(),
            CmEventKind::Established
                | CmEventKind::Rejected
                | CmEventKind::ConnectError
                | CmEventKind::Unreachable
                | CmEventKind::Disconnected
                | CmEventKind::ConnectResponse
        );
        if self.conns.get(t).is_some_and(|c| c.ep.is_connecting() && (own || c.ep.has_returned())) {
            // An event of an id whose `rdma_connect` runs on a helper (`connect.rs`), read
            // before the helper's wakeup: join it first, so the event finds the queue pair. The
            // call's own events the kernel queues only once the call has returned (it holds
            // the id's handler mutex), so for them the join waits at most for the helper's last
            // instructions in the library. Any other (an address change queued before the
            // call) waits for nothing: it is handled while the call runs, without the queue
            // pair, unless the helper already said its call returned.
            self.connect_returned_before_event(t);
        }
        let kind = ev.kind();
        if kind == CmEventKind::Disconnected {
            // On iWARP the stream has closed (the graceful close `rdma_disconnect` starts ends
            // here, after what was sent went out), but the queue pair was only drained of its
            // sends (SQD): move it to the error state so its posted receives flush and the
            // connection can drain (`Qp::set_error`).
            let iwarp = self
                .conns
                .get(t)
                .and_then(|c| c.placed)
                .is_some_and(|p| self.devices[p.device].caps.transport == Transport::Iwarp);
            if let Some(c) = self.conns.get_mut(t).filter(|_| iwarp) {
                if let Some(qp) = c.ep.qp() {
                    let _ = qp.set_error();
                }
                // The flush is synchronous: every completion of what was posted is in the CQ
                // now. Reap them all (the handler hears them while the connection is still
                // established); what stays posted after that never completes
                // (`ConnEntry::stream_closed`).
                let (cq, on_srq) = c.cqs();
                self.reap_conn_cqs(cq, on_srq);
                if let Some(c) = self.conns.get_mut(t) {
                    c.stream_closed = true;
                }
            }
        }
        if kind == CmEventKind::DeviceRemoval {
            let dev = self.conns.get(t).and_then(|c| c.ep.id()).and_then(|id| id.device());
            if let Some(d) = dev.and_then(|dev| self.devices.index_of(dev)) {
                self.device_lost(d, CloseReason::DeviceRemoval);
            }
        }
        let status = ev.status();
        let input = match kind {
            CmEventKind::Rejected => {
                let reason = RejectReason::decode(&ev.private_data());
                // iWARP reports a consumer's reject as a refused connection (`proto::transport`).
                let transport = self.conns.get(t).and_then(|c| c.placed).map(|p| self.devices[p.device].caps.transport);
                let status = transport.map_or(status, |tr| normalize_reject_status(tr, status, reason.is_some()));
                Input::Rejected { status, reason }
            }
            CmEventKind::Established => {
                let c = self.conns.get_mut(t).expect("checked by caller");
                if matches!(c.role, Role::Client(_)) {
                    let decoded = ConnectInfo::decode(&ev.private_data());
                    if matches!(decoded, Ok(None)) && c.infos.local.tail {
                        // A plain librdmacm server (no accept information): raw messages, as
                        // on RoCE without flow control; the tails are not used.
                        c.infos.local.tail = false;
                        if let Some(p) = c.placed.as_mut() {
                            p.tail = false;
                        }
                        c.tails = None;
                    }
                    match decoded {
                        Ok(info) if c.infos.local.tail && !info.as_ref().is_some_and(|i| i.tail) => {
                            let _ = info;
                            let why = "the server does not end its messages in tails, which this device (iWARP, no \
                                       immediate data) needs: an older rdma-reactor, or another program";
                            return self.feed(t, Input::SetupFailed(why.into()));
                        }
                        Ok(info) => {
                            let local = &c.infos.local;
                            let flow = negotiate(local.flow_control, u32::from(local.recv_depth), info.as_ref());
                            let unguarded = flow.is_none() && c.srq_share.is_some();
                            let farewell =
                                flow.is_some() && local.farewell && info.as_ref().is_some_and(|i| i.farewell);
                            c.lanes.set_flow(flow);
                            c.lanes.set_farewell(farewell);
                            // The connecting side's farewell yields the last credit, so that
                            // two crossing farewells can be answered (`proto::flow`).
                            c.lanes.yield_last_credit();
                            // The initiator speaks first on iWARP: a credit-only message.
                            let rule = c.placed.is_some_and(|p| self.devices[p.device].caps.client_sends_first());
                            let first = rule && c.infos.local.tail && info.as_ref().is_some_and(|i| i.recv_depth > 0);
                            c.lanes.set_hello(first);
                            c.infos.peer = info;
                            // The peer's size and, against a plain librdmacm server, the framing
                            // changed: the gate follows.
                            c.refresh_gate(&self.cfg);
                            if rule {
                                // Soft-iWARP may leave the first messages (or READ requests,
                                // or WRITEs) unread at the server: nudge until it is heard
                                // from (`proto::transport::NUDGES`).
                                let heard = c.meter.heard();
                                self.schedule_nudge(t, 0, heard);
                            }
                            if unguarded {
                                // Our receives are the shared queue's: a server sending without
                                // credits could consume every one of them (`data/srq/mod.rs`).
                                let why = "the server did not agree to flow control, which a connection on a shared \
                                           receive queue needs";
                                return self.feed(t, Input::SetupFailed(why.into()));
                            }
                        }
                        // Refused before `on_established`: the handler hears one `on_closed`
                        // naming what was wrong, never a connection it cannot use.
                        Err(e) => {
                            return self
                                .feed(t, Input::SetupFailed(format!("bad accept information from the server: {e}")))
                        }
                    }
                }
                Input::Cm(kind, status)
            }
            _ => Input::Cm(kind, status),
        };
        self.feed(t, input);
    }

    /// What accept and connect share once the queue pair exists: lets the handler post its first
    /// receives ([`ConnectionHandler::on_ready`]) and posts them. Returns the receive depth
    /// now posted (the first credit offered to the peer), or `None` when the handler closed
    /// the connection.
    pub(super) fn ready(&mut self, t: ConnKey) -> Result<Option<u32>> {
        self.with_conn(t, |h, conn| h.on_ready(conn));
        if !self.conns.get(t).is_some_and(ConnEntry::can_post) {
            return Ok(None);
        }
        self.flush_conn(t);
        // A failed post of the first receives closes the connection: then neither
        // `rdma_accept` nor `rdma_connect` runs.
        if !self.conns.get(t).is_some_and(ConnEntry::can_post) {
            return Ok(None);
        }
        // On the shared receive queue the first credit is the connection's credit there.
        Ok(self
            .conns
            .get(t)
            .map(|c| c.srq_share.map_or(c.lanes.outstanding().1, |s| s.receives).min(u32::from(u16::MAX))))
    }

    /// Why the pool of `child`'s device cannot hold the first receives of `size` bytes a
    /// connection needs, if it cannot: the flow-control minimum (`MIN_DEPTH`, or
    /// `Config::recv_depth` if smaller). How many a handler posts is its own choice, made in
    /// `on_ready` after this (`blast` posts fewer than its `recv_depth` for large messages), so
    /// a request is refused when the pool is full, not when it could hold fewer than the
    /// most a handler might post. Never with `srq` (the shared queue's receives); a device not
    /// opened yet has its whole pool free.
    fn pool_cannot_hold(&self, child: &CmId, size: u32) -> Option<String> {
        if self.cfg.srq.is_some() {
            return None;
        }
        let d = child.device().and_then(|dev| self.devices.index_of(dev))?;
        let pool = &self.devices.get(d)?.pool;
        let depth = MIN_DEPTH.min(self.cfg.recv_depth) as usize;
        (!pool.room_for(size as usize, depth)).then(|| {
            format!(
                "the receive pool is full: {depth} receives of {size} bytes do not fit beside the {} bytes \
                 registered (Config::pool.max_bytes {})",
                pool.registered_bytes(),
                self.cfg.pool.max_bytes
            )
        })
    }

    pub(super) fn conn_param<'a>(&self, private_data: &'a [u8], responder: u8, initiator: u8) -> ConnParam<'a> {
        ConnParam {
            private_data,
            responder_resources: responder,
            initiator_depth: initiator,
            retry_count: self.cfg.retry_count,
            rnr_retry_count: self.cfg.rnr_retry_count,
        }
    }

    /// Creates the device resources if needed, the connection's CQ (its own, or the device's
    /// shared one) and queue pair.
    pub(super) fn setup_qp(&mut self, t: ConnKey) -> Result<()> {
        let dev = {
            let c = self.conns.get(t).ok_or(Error::StaleToken(t.token().as_u64()))?;
            // The lanes are renamed after the new queue pair below (`Lanes::set_id`): checked
            // here, before anything is made, so the rename cannot be refused.
            rename_check(c.lanes.can_rename(t.token().index()))?;
            let id = c.ep.id().ok_or_else(|| Error::NotConnected("no id".into()))?;
            if let Some(exponent) = self.cfg.ack_timeout.map(ack_timeout_exponent) {
                // Before rdma_connect/rdma_accept, which move the queue pair to RTS with it.
                id.set_ack_timeout(exponent)
                    .map_err(|e| Error::verb("rdma_set_option", "RDMA_OPTION_ID_ACK_TIMEOUT", e))?;
            }
            let dev = id.device().ok_or_else(|| Error::NoDevice("the id is not bound to a device".into()))?;
            (dev, id.local_addr())
        };
        let d = self.device(dev.0, dev.1)?;
        // A reconnection on another device cannot post what waited for it (`reconnect.rs`).
        self.carried_to(t, d);
        let c = self.conns.get(t).ok_or(Error::StaleToken(t.token().as_u64()))?;
        // Tails on a transport without immediate data, for a peer that speaks this crate's
        // framing: a client that sends its connect information, an agent whose client sent
        // one (a plain librdmacm peer gets raw messages, as on RoCE without flow control).
        let tail = self.devices[d].caps.tail()
            && match c.role {
                // Raw private data frames with tails only when it announces them itself.
                Role::Client(_) => c
                    .infos
                    .raw_private_data
                    .as_deref()
                    .map_or(true, |raw| ConnectInfo::decode(raw).ok().flatten().is_some_and(|i| i.tail)),
                _ => c.infos.peer.is_some(),
            };
        let tails = match self.devices[d].tails.as_ref().filter(|_| tail) {
            Some(rings) => Some(TailRing::new(rings, self.cfg.send_depth, c.mem_owner)?),
            None => None,
        };
        // On the shared receive queue (`data/srq/mod.rs`): the credit rule admits it or not; its
        // receive completions go to the SRQ's CQ, so it commits no receive room on its own.
        let srq = match self.cfg.srq {
            None => None,
            Some(_) => {
                let s = self.devices[d].srq.as_mut().expect("created with the device in SRQ mode");
                if s.failed {
                    return Err(Error::NoDevice("the device's shared receive queue failed".into()));
                }
                if !s.budget.admit() {
                    self.stats.srq_refused += 1;
                    return Err(Error::Limit {
                        what: "connections on the shared receive queue ((SrqConfig::receives - SrqConfig::reserve) / SrqConfig::credit)",
                        limit: s.budget.max_conns() as usize,
                    });
                }
                let Some(rcq) = self.cqs.get(s.cq).filter(|e| !e.failed).map(|e| e.cq.clone()) else {
                    s.budget.leave(s.budget.credit());
                    return Err(Error::NoDevice("the shared receive queue's CQ failed".into()));
                };
                Some((s.srq.clone(), rcq))
            }
        };
        let recv_room = if srq.is_some() { 0 } else { self.cfg.recv_depth };
        let leave_srq = |core: &mut Core| {
            if srq.is_some() {
                if let Some(s) = core.devices[d].srq.as_mut() {
                    s.budget.leave(s.budget.credit());
                }
            }
        };
        // Its reservation in the device's pool (`sys/pool/ledger.rs`): made here, where its
        // device is known, for both roles; kept across a reconnection on the same device.
        if let Err(e) = self.reserve(t, d, srq.is_some()) {
            leave_srq(self);
            return Err(e);
        }
        let leave_srq = |core: &mut Core| {
            leave_srq(core);
            core.release_account(t);
        };
        let shared = self.cfg.shared_cq;
        let ct = match shared {
            Some(entries) => self.shared_cq(d, entries),
            None => self.new_cq(d, self.cfg.send_depth.saturating_add(recv_room), false),
        };
        let ct = match ct {
            Ok(ct) => ct,
            Err(e) => {
                leave_srq(self);
                return Err(e);
            }
        };
        let want = QpCaps {
            max_send_wr: self.cfg.send_depth,
            max_recv_wr: self.cfg.recv_depth,
            max_inline_data: self.cfg.max_inline,
            // The payload and its tail.
            max_send_sge: if tail { 2 } else { 1 },
        };
        let pd = self.devices[d].pd.clone();
        let e = self.cqs.get_mut(ct).expect("live");
        if !e.room.admit(recv_room) {
            let (cap, used) = (e.room.capacity(), e.room.reserved());
            leave_srq(self);
            return Err(Error::Config(format!(
                "the shared CQ has no room for {recv_room} more receives ({used} of {cap} entries committed)"
            )));
        }
        let cq = e.cq.clone();
        let c = self.conns.get_mut(t).expect("checked above");
        let Endpoint::Id(id) = std::mem::replace(&mut c.ep, Endpoint::None) else {
            unreachable!("checked above: the connection has an id and no queue pair")
        };
        let recv_cq = srq.as_ref().map_or(&cq, |(_, rcq)| rcq);
        let short_rq = self.take_short_rq();
        let c = self.conns.get_mut(t).expect("checked above");
        match Qp::create(id, &pd, &cq, recv_cq, srq.as_ref().map(|(s, _)| s), want) {
            Ok(qp) => {
                // Post no more than was committed on the CQ, even if the device granted more.
                let mut granted = qp.caps();
                if let Some(n) = short_rq {
                    granted.max_recv_wr = granted.max_recv_wr.min(n);
                }
                c.lanes
                    .set_capacity(granted.max_send_wr.min(want.max_send_wr), granted.max_recv_wr.min(want.max_recv_wr));
                if srq.is_some() {
                    // A share of its own, also when it reconnects: a receive queued for its
                    // earlier queue pair is not credited to this one (`data/srq/mod.rs`).
                    let s = self.devices[d].srq.as_mut().expect("checked above");
                    c.srq_share = Some(s.budget.new_share());
                    s.qps.insert(qp.qp_num(), t);
                }
                c.ep = Endpoint::Qp(qp);
                // A new queue pair: a new epoch at this connection's slot, so nothing an earlier
                // queue pair there reports names its operations. The lanes carry it (the one
                // copy of the connection's epoch, `Lanes::epoch`). The rename cannot be
                // refused: `rename_check` passed at the start (the index in range, nothing
                // outstanding), and nothing was posted since (the connection had no queue
                // pair); refused all the same, it would drop nothing (`Lanes::set_id`).
                let epoch = crate::reactor::data::cq::next_epoch(&mut self.epochs, t.token().index());
                let named = c.lanes.set_id(t.token().index(), epoch);
                debug_assert!(named, "checked by rename_check");
                c.tails = tails;
                c.placed = Some(Placement { device: d, cq: ct, max_inline: granted.max_inline_data, recv_room, tail });
                c.refresh_gate(&self.cfg);
                Ok(())
            }
            Err((id, err)) => {
                c.ep = Endpoint::Id(id);
                if shared.is_some() {
                    self.cqs.get_mut(ct).expect("live").room.leave(recv_room);
                } else {
                    self.remove_cq(ct);
                }
                leave_srq(self);
                Err(Error::verb("rdma_create_qp", format!("connection {:?}", t.token()), err))
            }
        }
    }

    pub(crate) fn alloc(&mut self, t: ConnKey, len: usize) -> Result<crate::Buf> {
        // Looked up once (issue 33: `placed_device` and a second look-up for the owner).
        let c = self.conns.get(t).ok_or_else(|| Error::StaleToken(t.token().as_u64()))?;
        let d = conn_device(c, &self.devices, t)?;
        // Charged to its account on that device (none while a reconnecting client waits on
        // another: uncharged, as the runtime's own).
        let account = c.account.filter(|r| r.device == d).map_or(Account::NONE, |r| r.account);
        self.devices[d].pool.alloc_for(len, c.mem_owner, account)
    }

    /// The bytes a connection of message size `size` reserves (`reservation`), before it
    /// exists.
    fn reservation_of(&self, size: usize, srq: bool) -> usize {
        let pool = self.cfg.device_pool();
        let size = size.clamp(1, pool.max_chunk().max(1));
        let chunk = pool.chunk_for(size).unwrap_or(size);
        let recvs = if srq { 0 } else { MIN_DEPTH.min(self.cfg.recv_depth) as usize };
        chunk.saturating_mul(recvs + 1)
    }

    /// Why a connect request from `peer` on `child`'s device, of message size `size`, cannot
    /// have its reservation now (the pool's reservations, or its address's, are full), if it
    /// cannot: refused before the listener is asked, with nothing registered.
    fn reservation_refusal(&self, child: &CmId, peer: Option<SocketAddr>, size: u32) -> Option<String> {
        let bytes = self.reservation_of(size as usize, self.cfg.srq.is_some());
        let d = child.device().and_then(|dev| self.devices.index_of(dev));
        self.reservation_room(d, peer.map(|p| quota_key(p.ip())), bytes).err().map(|r| r.text(bytes))
    }

    /// Whether a reservation of `bytes` fits device `d`'s pool (when it exists) for a
    /// connection from `addr` (an accepted one's peer; `None` for a client): its address within
    /// `PoolConfig::per_address_bytes`, and, beyond the address's floor (a sixteenth of that),
    /// not into the last quarter of the reservations, which is kept for addresses below
    /// theirs (the hostile review of issue 45: four addresses could take every reservation, and
    /// refuse every later client); then the pool's reservations.
    fn reservation_room(&self, d: Option<usize>, addr: Option<IpAddr>, bytes: usize) -> Result<(), Refused> {
        let pool = d.and_then(|d| self.devices.get(d)).map(|x| &x.pool);
        let budget = pool.map_or_else(|| self.cfg.device_pool().budget(), |p| p.ledger().budget());
        let reserved = pool.map_or(0, |p| p.ledger().reserved());
        if let Some(ip) = addr {
            let most = self.cfg.device_pool().per_address();
            let held = self.addr_reserved.get(&ip).copied().unwrap_or(0).saturating_add(bytes);
            if held > most {
                return Err(Refused::Address { ip, held: held - bytes, most });
            }
            let kept = budget.reservable / 4;
            if held > most / 16 && reserved.saturating_add(bytes) > budget.reservable - kept {
                return Err(Refused::Kept { ip, reserved, kept });
            }
        }
        if reserved.saturating_add(bytes) > budget.reservable {
            return Err(Refused::Pool { reserved, reservable: budget.reservable });
        }
        Ok(())
    }

    /// The chunk bytes connection `t` reserves on device `d`'s pool: its first receives
    /// (`min(MIN_DEPTH, Config::recv_depth)` of its receive size; none on a shared receive
    /// queue, whose receives are the device's) and one send of its message size. Its size is
    /// what this side announced (`ConnectInfo::msg_size`: an agent's is the smaller of its
    /// client's claim and `Config::msg_size`), within the pool's largest chunk.
    pub(in crate::reactor) fn reservation(&self, t: ConnKey, srq: bool) -> usize {
        self.conns.get(t).map_or(0, |c| self.reservation_of(c.infos.local.msg_size as usize, srq))
    }

    /// Opens connection `t`'s account with its reservation on device `d`'s pool, unless it has
    /// one there already (a reconnection on the same device); one on another device is closed
    /// first.
    fn reserve(&mut self, t: ConnKey, d: usize, srq: bool) -> Result<()> {
        let Some(c) = self.conns.get(t) else { return Err(Error::StaleToken(t.token().as_u64())) };
        match c.account {
            Some(r) if r.device == d => return Ok(()),
            Some(_) => self.release_account(t),
            None => {}
        }
        let bytes = self.reservation(t, srq);
        let c = self.conns.get(t).expect("checked");
        // An accepted connection's reservation counts for its peer's address too.
        let addr = match c.role {
            Role::Agent(_) => c.ep.id().and_then(|id| id.peer_addr()).map(|p| quota_key(p.ip())),
            _ => None,
        };
        let refused = |core: &mut Core, r: Refused| {
            core.stats.reservations_refused += 1;
            Err(r.into_error())
        };
        if let Err(r) = self.reservation_room(Some(d), addr, bytes) {
            return refused(self, r);
        }
        let pool = &self.devices[d].pool;
        let Some(account) = pool.open_account(bytes) else {
            let ledger = pool.ledger();
            let r = Refused::Pool { reserved: ledger.reserved(), reservable: ledger.budget().reservable };
            drop(ledger);
            return refused(self, r);
        };
        if let Some(ip) = addr {
            *self.addr_reserved.entry(ip).or_insert(0) += bytes;
        }
        if let Some(c) = self.conns.get_mut(t) {
            c.account = Some(Reserved { device: d, account, addr: addr.map(|ip| (ip, bytes)) });
        }
        Ok(())
    }

    /// Closes connection `t`'s account (`reserve`): its reservation is released (its
    /// address's count too), what its buffers still hold counts as borrowed until they are
    /// dropped.
    pub(in crate::reactor) fn release_account(&mut self, t: ConnKey) {
        let Some(r) = self.conns.get_mut(t).and_then(|c| c.account.take()) else { return };
        if let Some(dev) = self.devices.get(r.device) {
            dev.pool.close_account(r.account);
        }
        if let Some((ip, bytes)) = r.addr {
            if let std::collections::hash_map::Entry::Occupied(mut e) = self.addr_reserved.entry(ip) {
                *e.get_mut() = e.get().saturating_sub(bytes);
                if *e.get() == 0 {
                    e.remove();
                }
            }
        }
    }

    /// The device of a connection that has one (from `on_ready` on): a live index into
    /// `devices` (`Error::NoDevice` for a reconnecting client whose last device was removed).
    pub(in crate::reactor) fn placed_device(&self, t: ConnKey) -> Result<usize> {
        let c = self.conns.get(t).ok_or_else(|| Error::StaleToken(t.token().as_u64()))?;
        conn_device(c, &self.devices, t)
    }
}

/// [`Core::placed_device`] of connection `t`'s entry `c`, already looked up.
fn conn_device(c: &ConnEntry, devices: &crate::reactor::event_loop::device::Devices, t: ConnKey) -> Result<usize> {
    match c.placed {
        Some(p) => Ok(p.device),
        // Reconnecting: the last connection's (`reconnect.rs`), if it is still there.
        None => c
            .waiting_device(devices)
            .unwrap_or_else(|| Err(Error::NotConnected(format!("connection {:?} has no device yet", t.token())))),
    }
}

/// The RC ACK timeout exponent `t` (4.096 µs × 2^t) for at least `d`, within the 5-bit field
/// (1..=31; 0 would turn retransmission off, so it is never used).
pub(in crate::reactor) fn ack_timeout_exponent(d: std::time::Duration) -> u8 {
    let units = d.as_nanos().div_ceil(4096).max(2);
    let t = 128 - (units - 1).leading_zeros();
    t.clamp(1, 31) as u8
}

/// A duration in whole milliseconds for rdma_cm, saturating.
pub(in crate::reactor) fn millis(d: std::time::Duration) -> i32 {
    d.as_millis().min(i32::MAX as u128) as i32
}

/// Why a reservation was refused (`Core::reservation_room`).
#[derive(Clone, Copy, Debug)]
enum Refused {
    /// The address is at `PoolConfig::per_address_bytes`.
    Address { ip: IpAddr, held: usize, most: usize },
    /// The address is beyond its floor, and only the part kept for addresses below theirs is
    /// left.
    Kept { ip: IpAddr, reserved: usize, kept: usize },
    /// The pool's reservations are full (`PoolConfig::reserved_bytes`).
    Pool { reserved: usize, reservable: usize },
}

impl Refused {
    /// The reject's text (within its 141 bytes, an IPv6 address included).
    fn text(self, bytes: usize) -> String {
        let k = |n: usize| n.div_ceil(1024);
        match self {
            Refused::Address { ip, held, most } => format!(
                "{ip}: {} of its {} KiB reserved, one more needs {} (per_address_bytes)",
                k(held),
                k(most),
                k(bytes)
            ),
            Refused::Kept { ip, reserved, kept } => format!(
                "{ip} past its floor, {} KiB reserved: the last {} KiB are kept for new addresses",
                k(reserved),
                k(kept)
            ),
            Refused::Pool { reserved, reservable } => format!(
                "no room for a reservation of {} KiB: {} of {} KiB taken (reserved_bytes)",
                k(bytes),
                k(reserved),
                k(reservable)
            ),
        }
    }

    fn into_error(self) -> Error {
        match self {
            Refused::Address { most, .. } => {
                Error::Limit { what: "one address's reservations, PoolConfig::per_address_bytes", limit: most }
            }
            Refused::Kept { kept, .. } => {
                Error::Limit { what: "reservations kept for addresses below their floor (PoolConfig)", limit: kept }
            }
            Refused::Pool { reservable, .. } => {
                Error::Limit { what: "the pool's reservations, PoolConfig::reserved_bytes", limit: reservable }
            }
        }
    }
}

/// What the reservations of accepted connections are counted by: an IPv4 address (an
/// IPv4-mapped one as such), or an IPv6 address's /64 (a host usually has a /64 of its own, and
/// could make itself a new address for every connection).
fn quota_key(ip: IpAddr) -> IpAddr {
    match crate::proto::penalty::key(ip) {
        IpAddr::V6(v6) => {
            let s = v6.segments();
            IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
        }
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::ack_timeout_exponent;

    /// Issue 47 (review L3, L5): `setup_qp` refuses, before it makes anything, a slot index
    /// beyond what a work request id carries and a connection whose lanes still hold requests
    /// of a queue pair (renaming them would free memory the device may write).
    #[test]
    fn a_queue_pair_is_refused_beyond_the_slot_index_limit_or_with_requests_outstanding() {
        use super::rename_check;
        use crate::error::Error;
        use crate::proto::token::WrId;
        use crate::reactor::data::lanes::{Lanes, Rename, Slot};
        use crate::reactor::data::op::RawBuf;
        use crate::sys::pool::Buf;

        let mut lanes: Lanes<Buf> = Lanes::new(0, 0, 4).expect("slot 0");
        assert!(rename_check(lanes.can_rename(WrId::MAX_INDEX)).is_ok());
        match rename_check(lanes.can_rename(WrId::MAX_INDEX + 1)) {
            Err(Error::Limit { limit, .. }) => assert_eq!(limit, 1 << 20),
            other => panic!("{other:?}"),
        }
        lanes.set_capacity(4, 4);
        lanes.submit_recv(Slot::raw(crate::proto::op::OpCode::Recv, RawBuf { addr: 0x1000, len: 8, lkey: 1 }, 1));
        let (_, n) = lanes.plan_recvs(false);
        assert!(lanes.recvs_posted(n, n, false).is_none());
        assert_eq!(lanes.can_rename(7), Err(Rename::Outstanding { sends: 0, recvs: 1 }));
        let e = rename_check(lanes.can_rename(7)).expect_err("refused");
        assert!(matches!(e, Error::NotConnected(ref why) if why.contains("1 receives outstanding")), "{e}");
        // Refused by the lanes themselves too: nothing dropped.
        assert!(!lanes.set_id(7, 1));
        assert_eq!(lanes.outstanding(), (0, 1));
        let cleared = lanes.clear(None);
        assert_eq!(cleared.posted_recvs, 1);
        drop(cleared.into_cancelled(false));
    }

    #[test]
    fn refusal_texts_fit_a_reject_and_ipv6_counts_by_its_64() {
        use super::{quota_key, Refused};
        use std::net::IpAddr;
        let v6: IpAddr = "fd18:ffff:ffff:ffff:ffff:ffff:ffff:ffff".parse().expect("an address");
        // A petabyte of anything: every count at most 13 digits in KiB.
        let big = 1usize << 50;
        for r in [
            Refused::Address { ip: v6, held: big, most: big },
            Refused::Kept { ip: v6, reserved: big, kept: big },
            Refused::Pool { reserved: big, reservable: big },
        ] {
            let text = r.text(big);
            assert!(text.len() <= 141, "{} bytes: {text}", text.len());
        }
        let a: IpAddr = "fd18::1:2:3:4".parse().expect("an address");
        let b: IpAddr = "fd18::5:6:7:8".parse().expect("an address");
        assert_eq!(quota_key(a), quota_key(b), "one /64");
        let mapped: IpAddr = "::ffff:198.18.0.1".parse().expect("an address");
        assert_eq!(quota_key(mapped), "198.18.0.1".parse::<IpAddr>().expect("an address"));
    }

    #[test]
    fn the_ack_timeout_exponent_is_the_smallest_that_covers_the_duration() {
        let covers = |t: u8, d: Duration| Duration::from_nanos(4096u64 << t) >= d;
        for d in [1, 8, 9, 1_000, 20_000, 1_073_742, 2_000_000, 10_000_000].map(Duration::from_micros) {
            let t = ack_timeout_exponent(d);
            assert!(covers(t, d), "{d:?}: 4.096 us << {t} is shorter");
            assert!(t == 1 || !covers(t - 1, d), "{d:?}: {t} is not the smallest");
        }
        // Never 0 (no retransmission at all), never above the 5-bit field.
        assert_eq!(ack_timeout_exponent(Duration::ZERO), 1);
        assert_eq!(ack_timeout_exponent(Duration::from_secs(1 << 20)), 31);
    }
}
