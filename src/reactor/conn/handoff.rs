//! Many reactors, one per thread: a listener on one reactor spreads its connect requests over
//! several reactors, each on its own thread with its own epoll, CM channel, devices and CQs.
//!
//! # The hand-off
//!
//! The listening reactor (the *source*) reads a CONNECT_REQUEST on its channel and chooses a
//! reactor for it ([`Balance`]: round robin, or the fewest live connections). If it chose
//! itself, the request takes the ordinary path. Otherwise it takes the new id, copies out what
//! the target needs (the private data and the requested RDMA READ resources), and the event is
//! acked; then, before the next CM event is read (`Core::drain_cm`), `Core::send_handoffs`:
//!
//! 1. locks the target's inbox (`event_loop/remote.rs`), which holds the target's channel address
//!    (`sys::cm::ChannelRef`) while the target exists;
//! 2. sets the id's context to a fresh `Handoff` token, and `rdma_migrate_id`s it to that
//!    channel (the id's CONNECT_REQUEST is acked and no other event of it was read, so this
//!    never blocks; events the kernel queued for it meanwhile move to the target's channel);
//! 3. queues a `Parcel` (the `sys::cm::MigratedId`, the copied request) in the inbox, unlocks,
//!    and wakes the target through its eventfd.
//!
//! The target adopts parcels when its eventfd is readable (`Core::drain_remote`), or at once
//! when it reads a CM event whose context is a `Handoff` token (an event of an id migrated to
//! it that raced the wakeup): the source migrates and queues under the same lock, so by the
//! time the target can take that lock the parcel is there, and no event is ever held. Adopting
//! gives the id its owner on the target's thread and runs the ordinary accept path
//! (`Core::decide`) with the handler set by [`Reactor::accept_handoffs`]: the target's own
//! limits (`max_connections`, `max_pending_accepts`), its own device resources, PD, CQs and
//! pool, its own connection handler. librdmacm sends every command on an id through its
//! *current* channel's fd and the kernel checks the id belongs to that file, so the target is
//! the only one that ever touches the id after the migration.
//!
//! # Failure
//!
//! A target that is gone (its inbox closed, its channel cleared under the lock before it is
//! destroyed) or a failed migration: the source rejects the request itself
//! ([`RejectCode::NoResources`]) and its listener hears
//! [`ListenerHandler::on_refused`]. A target without a hand-off handler rejects it
//! ([`RejectCode::Refused`]). Parcels still queued when the target is dropped are destroyed
//! with the inbox (the kernel rejects them). Each case is counted in [`Stats`].
//!
//! # Hot path
//!
//! A reactor's hot path stays free of locks and atomics: the inbox lock is taken by the target
//! only when its eventfd is readable (or for the rare event above), and its load is published
//! with one relaxed store at the end of a tick in which its number of connections changed.
//!
//! [`Stats`]: crate::Stats

use std::net::SocketAddr;

use crate::error::{Error, Result};
use crate::proto::token::{Key, Kind, ListenerKey, Token};
use crate::proto::wire::{RejectCode, RejectReason};
use crate::reactor::{Core, Ctx, ListenerEntry, ListenerHandler, Reactor, Remote};
use crate::sys::cm::{CmEvent, CmId, MigratedId};

/// How a spreading listener chooses the reactor for a connect request
/// ([`Ctx::listen_spread`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Balance {
    /// Each reactor in turn.
    RoundRobin,
    /// The reactor with the fewest live connections (as each published it at the end of its
    /// last tick, plus the requests queued for it); ties go round robin.
    Fewest,
}

/// A listener's reactors and where the next choice starts.
#[derive(Debug)]
pub(in crate::reactor) struct Spread {
    peers: Vec<Remote>,
    balance: Balance,
    next: usize,
}

/// Which of `loads.len()` reactors gets the next request (`None` for a reactor that is gone,
/// never chosen); advances `next`. `None` when every one is gone. Pure.
pub(in crate::reactor) fn choose(balance: Balance, loads: &[Option<usize>], next: &mut usize) -> Option<usize> {
    let n = loads.len();
    if n == 0 {
        return None;
    }
    let start = *next % n;
    let mut live = (0..n).map(|k| (start + k) % n).filter(|&i| loads[i].is_some());
    let chosen = match balance {
        Balance::RoundRobin => live.next(),
        // The first of the least loaded, looking from `start` on.
        Balance::Fewest => live.min_by_key(|&i| loads[i]),
    }?;
    *next = (chosen + 1) % n;
    Some(chosen)
}

/// A connect request in transit: the migrated id and what the target needs of its event.
#[derive(Debug)]
pub(in crate::reactor) struct Parcel {
    id: MigratedId,
    private_data: Vec<u8>,
    /// The requested (initiator depth, responder resources).
    resources: (u8, u8),
}

/// A request chosen for another reactor, waiting for its event to be acked.
pub(in crate::reactor) struct Outgoing {
    peer: Remote,
    child: CmId,
    listener: ListenerKey,
    private_data: Vec<u8>,
    resources: (u8, u8),
}

/// What a reactor keeps of the hand-off between reactors.
#[derive(Default)]
pub(in crate::reactor) struct Handoff {
    /// Connect requests chosen for other reactors, migrated once their event is acked.
    pub(in crate::reactor) outgoing: Vec<Outgoing>,
    /// The listener that decides connect requests handed over by other reactors
    /// (`Reactor::accept_handoffs`).
    pub(in crate::reactor) listener: Option<ListenerKey>,
}

impl Core {
    /// The reactor a connect request on listener `lt` goes to, if the listener spreads and
    /// the choice is another reactor.
    fn spread_target(&mut self, lt: ListenerKey) -> Option<Remote> {
        let spread = self.listeners.get(lt)?.spread.as_ref()?;
        // A reactor that is gone is never chosen (its inbox is closed; the load it published
        // last would stay frozen, and under `Fewest` an idle one that exited would win every
        // choice). Looking costs a lock per reactor, on the connect-request path only.
        let loads: Vec<Option<usize>> = spread
            .peers
            .iter()
            .map(|p| {
                if p.is_of(&self.inbox) {
                    return Some(self.conns.len());
                }
                let q = p.lock_queue();
                (!q.closed).then(|| p.load() + q.parcels.len())
            })
            .collect();
        let spread = self.listeners.get_mut(lt)?.spread.as_mut()?;
        // With every reactor named gone, the first is "chosen": the hand-off then fails the
        // usual way (rejected, and the listener told that the reactor is gone).
        let i = choose(spread.balance, &loads, &mut spread.next).unwrap_or(0);
        let peer = &spread.peers[i];
        (!peer.is_of(&self.inbox)).then(|| peer.clone())
    }

    /// A CONNECT_REQUEST on listener `lt`: if it goes to another reactor, takes its id and
    /// queues it for `send_handoffs` (after the event is acked) and returns true.
    pub(in crate::reactor) fn hand_off_if_spread(&mut self, lt: ListenerKey, ev: &mut CmEvent) -> bool {
        let Some(peer) = self.spread_target(lt) else { return false };
        let Some(child) = ev.take_child(&self.cm, 0) else { return true };
        let (private_data, resources) = (ev.private_data(), ev.conn_resources());
        self.handoff.outgoing.push(Outgoing { peer, child, listener: lt, private_data, resources });
        true
    }

    /// Migrates the ids queued by `hand_off_if_spread` to their reactors. Called after their
    /// CONNECT_REQUEST events were acked, before the next CM event is read.
    pub(in crate::reactor) fn send_handoffs(&mut self) {
        for o in std::mem::take(&mut self.handoff.outgoing) {
            let sent = {
                let mut guard = o.peer.lock_queue();
                let q = &mut *guard;
                match &q.chan {
                    None => Err((o.child, "the chosen reactor is gone".to_string())),
                    Some(chan) => {
                        q.handoff_seq = q.handoff_seq.wrapping_add(1);
                        o.child.set_context(Token::new(Kind::Handoff, q.handoff_seq, 1).as_u64());
                        match o.child.migrate(chan) {
                            Ok(id) => {
                                let parcel = Parcel { id, private_data: o.private_data, resources: o.resources };
                                q.parcels.push_back(parcel);
                                Ok(())
                            }
                            Err((child, e)) => {
                                child.set_context(0);
                                Err((child, format!("rdma_migrate_id: {e}")))
                            }
                        }
                    }
                }
            };
            match sent {
                Ok(()) => {
                    o.peer.wake();
                    self.stats.handed_off += 1;
                    event!(debug, "a connect request handed to another reactor");
                }
                Err((child, why)) => {
                    self.stats.handoffs_failed += 1;
                    let peer = child.peer_addr();
                    let reason = RejectReason::new(RejectCode::NoResources, format!("hand-off failed: {why}"));
                    self.reject_child(child, &reason);
                    self.with_listener(o.listener, |h, ctx| h.on_refused(ctx, peer, &reason));
                }
            }
        }
    }

    /// Adopts the connect requests other reactors handed to this one. Returns how many.
    pub(in crate::reactor) fn take_handoffs(&mut self) -> usize {
        let parcels: Vec<Parcel> = {
            let mut q = self.inbox.lock_queue();
            if q.parcels.is_empty() {
                return 0;
            }
            q.parcels.drain(..).collect()
        };
        let n = parcels.len();
        for p in parcels {
            self.adopt(p);
        }
        n
    }

    fn adopt(&mut self, p: Parcel) {
        self.stats.handoffs_received += 1;
        event!(debug, "a connect request handed over by another reactor");
        let Some(child) = p.id.into_id(&self.cm) else {
            // Not on this reactor's channel (cannot happen: the source migrates to the
            // channel its inbox names); the id was destroyed, which rejects the request.
            self.stats.handoffs_failed += 1;
            return;
        };
        child.set_context(0);
        match self.handoff.listener.filter(|lt| self.listeners.get(*lt).is_some_and(|l| !l.sm.is_closed())) {
            Some(lt) => self.decide(lt, child, &p.private_data, p.resources),
            None => {
                self.stats.handoffs_failed += 1;
                let reason = RejectReason::new(RejectCode::Refused, "the reactor takes no hand-offs");
                self.reject_child(child, &reason);
            }
        }
    }

    fn accept_handoffs(&mut self, handler: Box<dyn ListenerHandler>) -> Result<Token> {
        self.refuse_when_shutting_down()?;
        if self.handoff.listener.is_some_and(|lt| self.listeners.get(lt).is_some()) {
            return Err(Error::Config("this reactor already accepts hand-offs (close that listener first)".into()));
        }
        let t = self.listeners.insert(ListenerEntry::new(handler));
        self.handoff.listener = Some(t);
        Ok(t.token())
    }

    fn listen_spread(
        &mut self,
        addr: SocketAddr,
        handler: Box<dyn ListenerHandler>,
        peers: Vec<Remote>,
        balance: Balance,
    ) -> Result<Token> {
        if peers.is_empty() {
            return Err(Error::Config("listen_spread needs at least one reactor".into()));
        }
        let token = self.listen(addr, handler)?;
        let lt = self.listeners.key_of(token).expect("just inserted");
        self.listeners.get_mut(lt).expect("just inserted").spread = Some(Spread { peers, balance, next: 0 });
        Ok(token)
    }
}

impl Ctx<'_> {
    /// Listens on `addr` and spreads the connect requests over `peers`, chosen by `balance`:
    /// one for this reactor (its own [`Reactor::remote`] among `peers`) is served here by
    /// `handler`; one for another reactor is handed to it (its id moved to that reactor's
    /// channel with `rdma_migrate_id`) and decided and served there, on its thread, by the
    /// handler it set with [`Reactor::accept_handoffs`]. The module docs of
    /// `reactor/conn/handoff.rs` describe the hand-off; ARCHITECTURE.md the thread model.
    ///
    /// `handler` hears [`on_refused`](ListenerHandler::on_refused) for a request that could
    /// not be handed off (the chosen reactor is gone, or `rdma_migrate_id` failed).
    ///
    /// # Errors
    ///
    /// As [`Ctx::listen`]; [`Error::Config`] if `peers` is empty.
    pub fn listen_spread(
        &mut self,
        addr: SocketAddr,
        handler: impl ListenerHandler + 'static,
        peers: Vec<Remote>,
        balance: Balance,
    ) -> Result<Token> {
        self.core.listen_spread(addr, Box::new(handler), peers, balance)
    }
}

impl Reactor {
    /// Listens on `addr` and spreads its connect requests over reactors. See
    /// [`Ctx::listen_spread`].
    ///
    /// ```no_run
    /// use rdma_reactor::{Balance, ConnectRequest, Ctx, Decision, ListenerHandler, Reactor};
    /// # struct Server;
    /// # impl ListenerHandler for Server {
    /// #     fn on_connect_request(&mut self, _: &mut Ctx<'_>, _: &ConnectRequest) -> Decision {
    /// #         unimplemented!()
    /// #     }
    /// # }
    /// // A second reactor on its own thread takes hand-offs; its handle comes back here.
    /// let (tx, rx) = std::sync::mpsc::channel();
    /// let worker = std::thread::spawn(move || {
    ///     let mut reactor = Reactor::new()?;
    ///     reactor.accept_handoffs(Server)?;
    ///     tx.send(reactor.remote()).expect("main waits");
    ///     reactor.run() // until its Remote::stop
    /// });
    /// let mut reactor = Reactor::new()?;
    /// let peers = vec![reactor.remote(), rx.recv().expect("worker started")];
    /// reactor.listen_spread("198.18.0.1:7471".parse().unwrap(), Server, peers.clone(), Balance::RoundRobin)?;
    /// reactor.run()?;
    /// peers[1].stop().ok();
    /// worker.join().expect("worker")?;
    /// # Ok::<(), rdma_reactor::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`Ctx::listen_spread`].
    pub fn listen_spread(
        &mut self,
        addr: SocketAddr,
        handler: impl ListenerHandler + 'static,
        peers: Vec<Remote>,
        balance: Balance,
    ) -> Result<Token> {
        self.ctx().listen_spread(addr, handler, peers, balance)
    }

    /// Serves connect requests other reactors hand to this one ([`Ctx::listen_spread`]):
    /// `handler` decides each, on this thread, as if it had arrived on a listener of this
    /// reactor (the [`ConnectRequest::listener`](crate::ConnectRequest::listener) is the token
    /// returned here), under this reactor's limits and with its own resources.
    ///
    /// The hand-off listener counts as a listener ([`Reactor::run`] does not return while it
    /// is open); [`Ctx::close`] with its token ends it, after which hand-offs are rejected.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] if one is already open; [`Error::NotConnected`] while shutting down.
    pub fn accept_handoffs(&mut self, handler: impl ListenerHandler + 'static) -> Result<Token> {
        self.core.accept_handoffs(Box::new(handler))
    }
}

#[cfg(test)]
mod tests {
    use super::{choose, Balance};

    #[test]
    fn round_robin_takes_each_in_turn() {
        let mut next = 0;
        let picks: Vec<Option<usize>> =
            (0..7).map(|_| choose(Balance::RoundRobin, &[Some(5), Some(0), Some(9)], &mut next)).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2, 0].map(Some));
    }

    #[test]
    fn fewest_takes_the_least_loaded_and_breaks_ties_in_turn() {
        let mut next = 0;
        assert_eq!(choose(Balance::Fewest, &[Some(3), Some(1), Some(2)], &mut next), Some(1));
        assert_eq!(next, 2);
        // Ties: from `next` on, so equal loads are taken in turn.
        let mut loads = [Some(0usize); 3];
        let mut picks = Vec::new();
        for _ in 0..6 {
            let i = choose(Balance::Fewest, &loads, &mut next).expect("all live");
            loads[i] = loads[i].map(|l| l + 1);
            picks.push(i);
        }
        assert_eq!(picks, [2, 0, 1, 2, 0, 1]);
        assert_eq!(loads, [Some(2); 3]);
    }

    #[test]
    fn one_reactor_is_always_chosen() {
        let mut next = 5;
        for b in [Balance::RoundRobin, Balance::Fewest] {
            assert_eq!(choose(b, &[Some(7)], &mut next), Some(0));
            assert_eq!(next, 0);
        }
    }

    /// Hostile review (issue 22), finding 3: a reactor that is gone kept being chosen: under
    /// `Fewest` an idle one that exited (its last published load 0, frozen) won every choice,
    /// under round robin one request in N. A gone reactor is never chosen while one lives.
    #[test]
    fn a_reactor_that_is_gone_is_never_chosen() {
        for b in [Balance::RoundRobin, Balance::Fewest] {
            let mut next = 0;
            let loads = [Some(5), None, Some(9)];
            let picks: Vec<usize> = (0..10).map(|_| choose(b, &loads, &mut next).expect("two live")).collect();
            assert!(!picks.contains(&1), "{b:?}: {picks:?}");
            assert!(picks.contains(&0), "{b:?}: {picks:?}");
        }
        let mut next = 0;
        assert_eq!(choose(Balance::Fewest, &[None, None], &mut next), None, "none live: none chosen");
    }
}
