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
//! together), when [`max_waiting`] wait already, when its listener closed, or when it waited
//! longer than `Timeouts::accept`. Its client may give up sooner (Soft-iWARP's MPA exchange
//! times out after 10 s): the kernel drops the events of an id not yet accepted, so the
//! reactor cannot tell, and such a request, decided later, fails its `rdma_accept` (the
//! listener's handler was asked, its connection handler hears a setup failure). In arrival
//! order; each tick looks at the front only and admits what fits.
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

/// The most connect requests that wait at once: four times `Config::max_pending_accepts`
/// (4 096 at the defaults), and never fewer than 1 024 (a server that keeps few accepts
/// pending still takes a storm), so a flood cannot make the reactor hold an unbounded number
/// of kernel ids, while a storm of a few thousand at once is served in full.
pub(in crate::reactor) fn max_waiting(max_pending_accepts: usize) -> usize {
    max_pending_accepts.saturating_mul(4).max(1024)
}

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
    /// The heap key of the one expiry timer, set for the front request's patience while any
    /// waits (`TimerTarget::WaitingExpiry`; one timer, not one per request, so that requests
    /// decided long before their expiry leave no entries behind: the hostile review of issue
    /// 45).
    pub(in crate::reactor) expiry: Option<u64>,
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
    /// Makes connect request `child` wait for room among the pending accepts, or refuses it
    /// when [`max_waiting`] wait already (each holds a kernel id, on iWARP a TCP socket too).
    pub(in crate::reactor) fn park_request(
        &mut self,
        listener: ListenerKey,
        child: CmId,
        private_data: &[u8],
        resources: (u8, u8),
    ) {
        let most = max_waiting(self.cfg.max_pending_accepts);
        if self.waiting.queue.len() >= most {
            let why = format!(
                "too many connect requests wait for room among the pending accepts ({most}: 4 x max_pending_accepts, \
                 at least 1024)"
            );
            return self.refuse_request(listener, child, RejectReason::new(RejectCode::NoResources, why));
        }
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
        self.arm_waiting_expiry();
    }

    /// Sets the expiry timer for the front request, unless it is set: just past its patience,
    /// when `admit_waiting` refuses it (a timer, so a reactor with nothing else to do wakes,
    /// and `Reactor::next_timeout` names it: review N11).
    fn arm_waiting_expiry(&mut self) {
        if self.waiting.expiry.is_some() {
            return;
        }
        let Some(front) = self.waiting.queue.front() else { return };
        let patience = self.cfg.timeouts.accept + std::time::Duration::from_millis(1);
        if let Some(at) = front.since.checked_add(patience) {
            let key = self.timers.schedule(at, crate::reactor::event_loop::timers::TimerTarget::WaitingExpiry);
            self.waiting.expiry = Some(key);
        }
    }

    /// True when a waiting request can be decided now (the tick must not sleep).
    pub(in crate::reactor) fn waiting_can_go(&self) -> bool {
        !self.waiting.queue.is_empty() && self.accepting < self.cfg.max_pending_accepts
    }

    /// Refuses the requests at the front that waited longer than `Timeouts::accept` (in
    /// arrival order, the oldest are at the front: the rest is not looked at), then decides
    /// those that fit among the pending accepts now, oldest first, refusing each whose
    /// listener closed meanwhile (checked as each is taken: a callback of this pass may close
    /// one). Returns how many it decided or refused.
    pub(in crate::reactor) fn admit_waiting(&mut self) -> usize {
        if self.waiting.queue.is_empty() {
            return 0;
        }
        let now = self.read_clock();
        let patience = self.cfg.timeouts.accept;
        let mut n = 0;
        while self.waiting.queue.front().is_some_and(|w| now.saturating_duration_since(w.since) > patience) {
            let w = self.waiting.queue.pop_front().expect("a front");
            let why = format!(
                "waited {patience:?} (Timeouts::accept) for room among the pending accepts (max_pending_accepts = {})",
                self.cfg.max_pending_accepts
            );
            self.refuse_request(w.listener, w.child, RejectReason::new(RejectCode::NoResources, why));
            n += 1;
        }
        self.waiting.admitting = true;
        while self.accepting < self.cfg.max_pending_accepts && !self.shutting_down {
            let Some(w) = self.waiting.queue.pop_front() else { break };
            n += 1;
            if self.listeners.get(w.listener).map_or(true, |l| l.sm.is_closed()) {
                let why = "listener closed while the request waited for room among the pending accepts";
                self.reject_child(w.child, &RejectReason::new(RejectCode::Refused, why));
                continue;
            }
            self.decide(w.listener, w.child, &w.private_data, w.resources);
        }
        self.waiting.admitting = false;
        // The front may have changed: its expiry.
        self.arm_waiting_expiry();
        n
    }

    /// Refuses every waiting request (a shutdown).
    pub(in crate::reactor) fn refuse_waiting(&mut self, why: &str) {
        for w in std::mem::take(&mut self.waiting.queue) {
            self.reject_child(w.child, &RejectReason::new(RejectCode::Refused, why));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::max_waiting;

    #[test]
    fn the_waiting_bound_is_four_pending_accepts_and_never_below_1024() {
        assert_eq!(max_waiting(1024), 4096, "the defaults");
        assert_eq!(max_waiting(2), 1024, "a server with few pending accepts still takes a storm");
        assert_eq!(max_waiting(usize::MAX), usize::MAX);
    }
}
