//! Counters the user can read.

use std::time::Instant;

use crate::proto::metrics::{conn_families, ConnMetrics, Exposition, Kind};
use crate::proto::token::{Key, Token};
use crate::reactor::Core;
use crate::sys::pool::Pool;

/// Reactor statistics since creation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// `epoll_wait` returns.
    pub wakeups: u64,
    /// `epoll_wait` returns interrupted by a signal (`EINTR`): the tick goes on with no
    /// readiness, as after a timeout. (The channel reads are non-blocking: the kernel answers
    /// them at once, with an event or `EAGAIN`, so a signal cannot interrupt them.)
    pub interrupted_waits: u64,
    /// `rdma_connect` calls a signal interrupted (`EINTR`), each made again within the
    /// connect deadline. Only iWARP makes its TCP connection inside the call, and there the
    /// call runs on a helper thread born with every signal blocked, so this stays 0 unless
    /// blocking them failed.
    pub interrupted_connects: u64,
    /// `rdma_connect` calls made on a helper thread: on iWARP the call makes the TCP
    /// connection and blocks until it is made or TCP gives up, so it never runs on the
    /// reactor's thread.
    pub connect_threads: u64,
    /// iWARP connects that waited for a helper thread (at most 64 run at once per reactor).
    pub connects_queued: u64,
    /// iWARP `rdma_connect` calls running on helper threads now.
    pub connect_calls_running: u64,
    /// Reads of the rdma_cm and completion channels (`rdma_get_cm_event`, `ibv_get_cq_event`),
    /// the ones that found nothing (`EAGAIN`) included.
    pub channel_reads: u64,
    /// Wakeups that reported a ready fd but found nothing to do (every read found `EAGAIN`,
    /// or the `Remote` eventfd had been written for messages an earlier tick already took).
    /// An interrupted wait is counted in `interrupted_waits` instead.
    pub spurious_wakeups: u64,
    /// rdma_cm events read (and acked).
    pub cm_events: u64,
    /// CM events for an object that no longer exists (dropped).
    pub stale_cm_events: u64,
    /// Completion-channel events read (each acked once: `cq_events_acked` catches up with it
    /// whenever no CQ holds un-acked events).
    pub cq_events: u64,
    /// Completion events after which the CQ held nothing new (the arm/poll race's extra event).
    pub spurious_cq_events: u64,
    /// `ibv_ack_cq_events` calls.
    pub cq_ack_calls: u64,
    /// Completion events acked: in batches, when their CQ is destroyed, and at once for an
    /// event naming a CQ that is gone.
    pub cq_events_acked: u64,
    /// `ibv_req_notify_cq` calls.
    pub cq_arms: u64,
    /// Completions found by the poll right after a CQ was armed (the arm/poll race). One that
    /// arrived between the last empty poll and `ibv_req_notify_cq` raises no event: without
    /// that poll it would wait, unseen, until some later completion woke the CQ. On rxe and
    /// siw, whose CQs are armed before the tick's last poll (`Caps::arm_sees_only_new`), that
    /// is every completion since the tick's earlier poll (a send completed during its post too)
    /// in the first batch of that poll (up to 32). (One that arrived after the arm is found
    /// here too, and its event then finds the CQ empty: `spurious_cq_events`.)
    pub cq_rearm_catches: u64,
    /// Ticks that polled CQs left unarmed by spinning (`Config::spin`).
    pub spin_polls: u64,
    /// Ticks while spinning (`Config::spin`) that found no work: the polls that waited, which
    /// count as time, not work (`cargo xtask bench --instructions` subtracts them from the
    /// spin-mode row's count).
    pub idle_spins: u64,
    /// `ibv_poll_cq` calls.
    pub cq_polls: u64,
    /// Work completions reaped.
    pub completions: u64,
    /// Completions whose work request id named no live operation (dropped).
    pub stale_completions: u64,
    /// Ticks in which a CQ hit the poll budget and was left for the next tick.
    pub budget_exhausted: u64,
    /// Times a connection had sends ready but its CQ had no room left for them.
    pub cq_room_waits: u64,
    /// Most CQ entries ever committed or reserved on one CQ at once (never above its size).
    pub cq_peak_reserved: u64,
    /// `ibv_post_send` calls.
    pub post_send_calls: u64,
    /// `ibv_post_recv` calls.
    pub post_recv_calls: u64,
    /// Work requests posted.
    pub wrs_posted: u64,
    /// Connect requests accepted.
    pub accepted: u64,
    /// Connect requests rejected.
    pub rejected: u64,
    /// Connections established.
    pub established: u64,
    /// Connections closed.
    pub closed: u64,
    /// Closes by the close handshake (iWARP under flow control: a SEND's completion is no
    /// receipt there) whose farewell the peer answered: it had everything this side sent.
    pub farewells_answered: u64,
    /// Closes by the close handshake whose farewell was not answered within
    /// `Timeouts::finish` (a peer gone, or one that stopped reading): disconnected anyway.
    pub farewells_unanswered: u64,
    /// Peers' farewells this reactor answered (the close handshake, the other side of
    /// [`farewells_answered`](Stats::farewells_answered)).
    pub farewells_heard: u64,
    /// Peers that said goodbye, were answered and had not disconnected `Timeouts::finish`
    /// later: this reactor disconnected them (closed as `CloseReason::Peer`). Their kernel may
    /// have dropped the stream without a word (FAULTS.md, iWARP).
    pub silent_partings: u64,
    /// Disconnects of this side (`rdma_disconnect`) that no DISCONNECTED followed within
    /// `Timeouts::disconnect`, or before a shutdown's grace ran out: the connection was
    /// drained and destroyed anyway. Its DREQ and the retransmissions were lost, the peer is
    /// gone or cut off, or the `rdma_disconnect` call itself failed (the peer may then never
    /// have heard of it); or the peer's kernel got it but its process never disconnected
    /// (stopped, or not ticking its reactor).
    pub disconnects_unanswered: u64,
    /// Reconnect attempts scheduled by clients with a reconnect policy
    /// (`ConnectOptions::reconnect`): one per failure that did not close the connection.
    pub reconnects: u64,
    /// Connections made again by a reconnect attempt (`on_reconnected`).
    pub reconnected: u64,
    /// Asynchronous device events read (and acked).
    pub async_events: u64,
    /// Asynchronous events naming a queue pair or CQ this reactor does not have.
    pub stale_async_events: u64,
    /// Asynchronous events another reactor of the process read and passed on, for a device
    /// this reactor uses.
    pub shared_async_events: u64,
    /// Devices lost (removed, failed, or their fds dead).
    pub devices_lost: u64,
    /// Lost devices whose resources were released.
    pub devices_released: u64,
    /// Keepalive probes posted (`Config::keepalive`).
    pub keepalives: u64,
    /// Zero-length RDMA WRITEs an iWARP client queued because its server had not been heard
    /// from since ESTABLISHED (one still queued when its connection ends is not sent):
    /// Soft-iWARP can leave a client's first messages unread at the server until more bytes
    /// arrive (`NUDGES` in `proto/transport.rs` has why).
    pub iwarp_nudges: u64,
    /// Connect requests that arrived beyond `Config::max_pending_accepts` (or behind ones
    /// that had) and waited for room instead of being refused (`conn/waiting.rs`).
    pub accepts_waited: u64,
    /// Connections closed because their sends waited too long for credits
    /// (`Config::credit_timeout`).
    pub credit_stalls: u64,
    /// Connect requests this reactor's spreading listeners handed to another reactor
    /// (`Ctx::listen_spread`).
    pub handed_off: u64,
    /// Connect requests other reactors handed to this one.
    pub handoffs_received: u64,
    /// Hand-offs that failed: the chosen reactor was gone or `rdma_migrate_id` failed (the
    /// source rejected the request), or the receiving reactor takes no hand-offs (it rejected
    /// it).
    pub handoffs_failed: u64,
    /// Live connections (agents and clients, in any state; a gauge, not a counter).
    pub connections: u64,
    /// Entries in the reactor's timer heap now, cancelled and superseded ones included (a
    /// gauge): cancelling is lazy, and the heap is compacted once more than half of it can be
    /// stale, so this stays within about twice the live timers.
    pub timer_entries: u64,
    /// Rebuilds of the timer heap that dropped its stale entries.
    pub timer_compactions: u64,
    /// Bytes of memory the buffer pools have registered now, over all devices (a gauge, not a
    /// counter). With a shared receive queue (`Config::srq`) it does not grow with the number
    /// of connections.
    pub registered_bytes: u64,
    /// Pool buffers handed out and not yet back, over every device: what the application
    /// holds, what is posted (receives, sends in flight) and what completions carry. Back to
    /// its earlier value once everything handed out since was dropped.
    pub buffers_in_use: u64,
    /// Receives posted to shared receive queues (`Config::srq`).
    pub srq_posted: u64,
    /// `ibv_post_srq_recv` calls.
    pub srq_post_calls: u64,
    /// Receive completions of shared receive queues (messages and credit-only messages).
    pub srq_consumed: u64,
    /// Shared-receive-queue completions of a queue pair this reactor no longer has (their
    /// buffers were posted again).
    pub srq_stale: u64,
    /// SRQ limit events (`IBV_EVENT_SRQ_LIMIT_REACHED`): the SRQ fell below
    /// `SrqConfig::low_water` before the runtime refilled it.
    pub srq_limit_events: u64,
    /// Connections refused by the credit rule of a shared receive queue.
    pub srq_refused: u64,
    /// Messages that arrived on a shared receive queue beyond their connection's credit (the
    /// connection was closed with `CloseReason::Protocol`).
    pub srq_overdrawn: u64,
    /// Receives posted to shared receive queues now (a gauge).
    pub srq_receives: u64,
    /// Receives of shared receive queues granted to busy connections beyond their base credit
    /// (`SrqConfig::max_credit`): each one grew a connection's share by one.
    pub srq_grown: u64,
    /// Receives of shared receive queues given back by connections whose peers left them
    /// unused (or, when few are free, by any grown connection): each one shrank a share by one.
    pub srq_shrunk: u64,
    /// Receives of shared receive queues in no connection's share and not in the reserve now
    /// (a gauge): what admits new connections and what busy ones grow into.
    pub srq_free: u64,
    /// Connections the device ended for a request of the peer's
    /// ([`CloseReason::PeerViolation`](crate::CloseReason::PeerViolation)): a remote access
    /// violation, most often.
    pub peer_violations: u64,
    /// Submissions refused because the connection's queued sends reached
    /// [`Config::send_backlog`](crate::Config::send_backlog) or
    /// [`Config::send_backlog_bytes`](crate::Config::send_backlog_bytes).
    pub backlog_refusals: u64,
    /// Connections closed because the peer sent a message beyond the credit we granted it, on
    /// their own receive queue (on a shared one: [`Stats::srq_overdrawn`]).
    pub credit_overdrawn: u64,
    /// Violations counted in the penalty box ([`Config::violation_backoff`](crate::Config::violation_backoff)):
    /// messages beyond their credit, or with broken framing, from the peers of accepted
    /// connections (each closes its connection).
    pub violation_strikes: u64,
    /// Connect requests refused because their address is in the penalty box
    /// ([`RejectCode::Backoff`](crate::RejectCode::Backoff)).
    pub violation_refusals: u64,
    /// Connections refused because the pool's bytes reserved for connections could not hold
    /// one more reservation ([`PoolConfig`](crate::PoolConfig)'s memory guarantee).
    pub reservations_refused: u64,
    /// Pool bytes reserved for connections now, over all devices (a gauge).
    pub reserved_bytes: u64,
    /// Pool bytes connections hold beyond their reservations now, over all devices (a gauge).
    pub borrowed_bytes: u64,
    /// Receives of a shared receive queue not posted again (their credits withheld) because
    /// their connection held too much: its own memory beyond its limit, or, for the async
    /// face, more unread messages than its share.
    pub srq_withheld: u64,
}

/// The reactor-wide families of [`Stats`], each `(field, kind, help)`, then its value.
macro_rules! families {
    ($s:expr; counters: $($c:ident),* ; gauges: $($g:ident),* $(,)?) => {
        vec![
            $((stringify!($c), Kind::Counter, concat!("Stats::", stringify!($c), " (rdma-reactor's docs)."), $s.$c),)*
            $((stringify!($g), Kind::Gauge, concat!("Stats::", stringify!($g), " (rdma-reactor's docs)."), $s.$g),)*
        ]
    };
}

impl Stats {
    /// Every field as a Prometheus family: `(name, kind, help, value)`.
    pub(crate) fn families(&self) -> Vec<(&'static str, Kind, &'static str, u64)> {
        families!(self;
            counters: wakeups, interrupted_waits, interrupted_connects, connect_threads, connects_queued, channel_reads, spurious_wakeups,
                cm_events, stale_cm_events, cq_events, spurious_cq_events, cq_ack_calls, cq_events_acked,
                cq_arms, cq_rearm_catches, spin_polls, idle_spins, cq_polls, completions, stale_completions,
                budget_exhausted, cq_room_waits, post_send_calls, post_recv_calls, wrs_posted, accepted,
                rejected, established, closed, farewells_answered, farewells_unanswered, farewells_heard, silent_partings, disconnects_unanswered, reconnects, reconnected, async_events, stale_async_events, shared_async_events,
                devices_lost, devices_released, keepalives, iwarp_nudges, accepts_waited, credit_stalls, handed_off, handoffs_received,
                handoffs_failed, timer_compactions, srq_posted, srq_post_calls, srq_consumed, srq_stale,
                srq_limit_events, srq_refused, srq_overdrawn, srq_grown, srq_shrunk, peer_violations,
                backlog_refusals, credit_overdrawn, violation_strikes, violation_refusals, reservations_refused,
                srq_withheld;
            gauges: cq_peak_reserved, connections, connect_calls_running, timer_entries, registered_bytes, buffers_in_use, srq_receives,
                srq_free, reserved_bytes, borrowed_bytes,
        )
    }

    /// Every field as a family of one sample labelled `labels`, written to `e`: the totals
    /// part of both `Reactor::prometheus` and `Reactor::prometheus_totals`.
    pub(crate) fn expose(&self, e: &mut Exposition, labels: &[(&str, &str)]) {
        for (name, kind, help, value) in self.families() {
            e.family(name, kind, help).sample(labels, value);
        }
    }
}

impl Core {
    /// Connection `token`'s counters, while it lives.
    pub(in crate::reactor) fn conn_metrics(&self, token: Token) -> Option<ConnMetrics> {
        let t = self.conns.key_of(token)?;
        self.conns.get(t).map(|c| c.meter.snapshot(Instant::now()))
    }

    /// The reactor's [`Stats`] alone in the Prometheus text format
    /// (`Reactor::prometheus_totals`): one sample per field, whatever the connections.
    pub(in crate::reactor) fn prometheus_totals(&self, labels: &[(&str, &str)]) -> String {
        let mut e = Exposition::default();
        self.stats().expose(&mut e, labels);
        e.finish()
    }

    /// The reactor's [`Stats`] and every live connection's [`ConnMetrics`] in the Prometheus
    /// text format (`Reactor::prometheus`).
    pub(in crate::reactor) fn prometheus(&self, labels: &[(&str, &str)]) -> String {
        let mut e = Exposition::default();
        self.stats().expose(&mut e, labels);
        // Each connection's labels and values, then one family after another over them all.
        let now = Instant::now();
        let conns: Vec<(String, String, _)> = self
            .conns
            .iter()
            .map(|(k, c)| {
                let peer = c.ep.id().and_then(|id| id.peer_addr()).map_or_else(String::new, |a| a.to_string());
                (k.token().as_u64().to_string(), peer, conn_families(&c.meter.snapshot(now)))
            })
            .collect();
        if !conns.is_empty() {
            for (i, (name, kind, help, _)) in conn_families(&ConnMetrics::default()).into_iter().enumerate() {
                let mut f = e.family(name, kind, help);
                for (token, peer, values) in &conns {
                    let mut l: Vec<(&str, &str)> = labels.to_vec();
                    l.push(("conn", token));
                    l.push(("peer", peer));
                    f.sample(&l, Number(values[i].3));
                }
            }
        }
        e.finish()
    }
}

/// A sample's value: integers without a fraction, the rest as Rust prints an `f64`.
struct Number(f64);

impl std::fmt::Display for Number {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.fract() == 0.0 && self.0.abs() < 9.0e15 {
            write!(f, "{}", self.0 as i64)
        } else {
            write!(f, "{}", self.0)
        }
    }
}

impl Core {
    pub(in crate::reactor) fn stats(&self) -> Stats {
        let registered = self
            .devices
            .iter()
            .map(|d| (d.pool.registered_bytes() + d.tails.as_ref().map_or(0, Pool::registered_bytes)) as u64)
            .sum();
        let srq_receives = self.devices.iter().filter_map(|d| d.srq.as_ref()).map(|s| s.posted() as u64).sum();
        let srq_free = self.devices.iter().filter_map(|d| d.srq.as_ref()).map(|s| u64::from(s.budget.free())).sum();
        let buffers_in_use = self.devices.iter().map(|d| d.pool.in_use() as u64).sum();
        let reserved_bytes = self.devices.iter().map(|d| d.pool.ledger().reserved() as u64).sum();
        let borrowed_bytes = self.devices.iter().map(|d| d.pool.ledger().borrowed() as u64).sum();
        Stats {
            reserved_bytes,
            borrowed_bytes,
            registered_bytes: registered,
            buffers_in_use,
            connections: self.conns.len() as u64,
            srq_receives,
            srq_free,
            timer_entries: self.timers.len() as u64,
            connect_calls_running: self.calls.running as u64,
            ..self.stats
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_field_is_a_family_once() {
        let s = Stats { wakeups: 3, buffers_in_use: 7, ..Stats::default() };
        let f = s.families();
        let names: std::collections::HashSet<_> = f.iter().map(|x| x.0).collect();
        assert_eq!(names.len(), f.len(), "no field twice");
        // Debug lists every field of the struct: a field added later without a family fails here.
        let debug = format!("{s:?}");
        assert_eq!(debug.matches(": ").count(), f.len(), "{debug}");
        for (name, ..) in &f {
            assert!(debug.contains(&format!(" {name}: ")), "{name} is not a field");
        }
        assert!(f.contains(&("wakeups", Kind::Counter, "Stats::wakeups (rdma-reactor's docs).", 3)));
        assert!(f.contains(&("buffers_in_use", Kind::Gauge, "Stats::buffers_in_use (rdma-reactor's docs).", 7)));
    }

    #[test]
    fn the_totals_are_one_sample_per_field_with_no_connection_label() {
        let s = Stats { wakeups: 3, connections: 10_000, ..Stats::default() };
        let mut e = Exposition::default();
        s.expose(&mut e, &[("reactor", "1")]);
        let text = e.finish();
        let samples: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(samples.len(), s.families().len(), "{text}");
        assert!(samples.iter().all(|l| l.contains("{reactor=\"1\"} ")), "{text}");
        assert!(samples.contains(&"rdma_reactor_wakeups_total{reactor=\"1\"} 3"), "{text}");
        assert!(samples.contains(&"rdma_reactor_connections{reactor=\"1\"} 10000"), "{text}");
        assert!(!text.contains("conn=") && !text.contains("peer="), "{text}");
    }
}
