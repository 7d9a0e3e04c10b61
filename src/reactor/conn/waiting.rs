//! Connect requests that wait for room among the pending accepts (issue 32 item 8).
//!
//! `Config::max_pending_accepts` bounds the agents accepted and not yet established: each holds
//! a queue pair, its receives and a CQ's room while the connection manager finishes. A connect
//! storm beyond it used to be refused (`NoResources`), which is not what a TCP backlog does: a
//! request beyond the bound now **waits**, its connect request event acked and its new id kept
//! (context 0: an event of the id meanwhile, the client giving up, is a stale one, acked and
//! dropped), and is decided (`Core::decide`, from the start: the listener's handler is asked
//! only then) as soon as a pending accept settles. It is refused only when the server is
//! really full (`Config::max_connections` counts live connections and waiting requests
//! together), when its listener closed, or when it waited longer than `Timeouts::accept`
//! (its client's connection manager has given up by then: rdma_cm's active side retries its
//! request for about as long, and Soft-iWARP's MPA exchange times out after 10 s). In arrival
//! order; each tick admits what fits.
//!
//! Nothing is registered for a waiting request: it holds its id and its private data (at most
//! 196 bytes). The ids are destroyed before the event channel (`Core`'s field order), and a
//! shutdown refuses them first.

use std::collections::VecDeque;
use std::time::Instant;

use crate::proto::token::ListenerKey;
use crate::proto::wire::{RejectCode, RejectReason};
use crate::reactor::Core;
use crate::sys::cm::CmId;

/// A connect request waiting for room among the pending accepts.
pub(in crate::reactor) struct Waiting {
    listener: ListenerKey,
    child: CmId,
    private_data: Vec<u8>,
    resources: (u8, u8),
    since: Instant,
}

/// The waiting requests, oldest first.
#[derive(Default)]
pub(in crate::reactor) struct WaitingRequests {
    queue: VecDeque<Waiting>,
    /// [`Core::admit_waiting`] is deciding one of them: it does not queue again.
    admitting: bool,
}

impl WaitingRequests {
    /// Requests waiting.
    pub(in crate::reactor) fn len(&self) -> usize {
        self.queue.len()
    }

    /// True when a new request must queue behind waiting ones (arrival order), outside
    /// [`Core::admit_waiting`].
    pub(in crate::reactor) fn queued_first(&self) -> bool {
        !self.admitting && !self.queue.is_empty()
    }
}

impl Core {
    /// Makes connect request `child` wait for room among the pending accepts.
    pub(in crate::reactor) fn park_request(
        &mut self,
        listener: ListenerKey,
        child: CmId,
        private_data: &[u8],
        resources: (u8, u8),
    ) {
        child.set_context(0);
        let since = self.read_clock();
        self.waiting.queue.push_back(Waiting {
            listener,
            child,
            private_data: private_data.to_vec(),
            resources,
            since,
        });
        self.stats.accepts_waited += 1;
    }

    /// True when a waiting request can be decided now (the tick must not sleep).
    pub(in crate::reactor) fn waiting_can_go(&self) -> bool {
        !self.waiting.queue.is_empty() && self.accepting < self.cfg.max_pending_accepts
    }

    /// Decides the waiting requests that fit among the pending accepts now, oldest first,
    /// after refusing those whose listener closed or whose wait outlasted
    /// `Timeouts::accept`. Returns how many it decided or refused.
    pub(in crate::reactor) fn admit_waiting(&mut self) -> usize {
        if self.waiting.queue.is_empty() {
            return 0;
        }
        let now = self.read_clock();
        let patience = self.cfg.timeouts.accept;
        let mut n = 0;
        let mut kept = VecDeque::with_capacity(self.waiting.queue.len());
        for w in std::mem::take(&mut self.waiting.queue) {
            let gone = self.listeners.get(w.listener).map_or(true, |l| l.sm.is_closed());
            let expired = now.saturating_duration_since(w.since) > patience;
            if gone || expired {
                let why = if gone {
                    "listener closed while the request waited for room among the pending accepts".to_string()
                } else {
                    format!(
                        "waited {patience:?} (Timeouts::accept) for room among the pending accepts \
                         (max_pending_accepts = {})",
                        self.cfg.max_pending_accepts
                    )
                };
                let reason = RejectReason::new(if gone { RejectCode::Refused } else { RejectCode::NoResources }, why);
                let peer = w.child.peer_addr();
                self.reject_child(w.child, &reason);
                if !gone {
                    self.with_listener(w.listener, |h, ctx| h.on_refused(ctx, peer, &reason));
                }
                n += 1;
            } else {
                kept.push_back(w);
            }
        }
        self.waiting.queue = kept;
        self.waiting.admitting = true;
        while self.accepting < self.cfg.max_pending_accepts && !self.shutting_down {
            let Some(w) = self.waiting.queue.pop_front() else { break };
            self.decide(w.listener, w.child, &w.private_data, w.resources);
            n += 1;
        }
        self.waiting.admitting = false;
        n
    }

    /// Refuses every waiting request (a shutdown).
    pub(in crate::reactor) fn refuse_waiting(&mut self, why: &str) {
        for w in std::mem::take(&mut self.waiting.queue) {
            self.reject_child(w.child, &RejectReason::new(RejectCode::Refused, why));
        }
    }
}
