//! Per-connection counters and the Prometheus text exposition: pure bookkeeping, no I/O.
//!
//! The reactor keeps a [`ConnMeter`] in every connection and records each completion it hands
//! to a handler, and each wait of a send for the peer's credits; [`Exposition`] writes counters
//! in the Prometheus text format (version 0.0.4), which `Reactor::prometheus` builds from the
//! reactor's `Stats` and every live connection's [`ConnMetrics`]. No HTTP server lives in the
//! library: an application serves the text however it likes (the `echo` and `blast` servers'
//! `--metrics` answer `GET /metrics` on a TCP socket registered with the reactor).

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use super::op::{OpCode, OpError};

/// Counters of one connection since it was created, as its handler saw its operations
/// ([`Conn::metrics`](crate::Conn::metrics), [`Ctx::conn_metrics`](crate::Ctx::conn_metrics)).
///
/// Only operations whose completion reached the handler count: those cancelled when the
/// connection was destroyed do not. The runtime's own credit-only messages are counted apart.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnMetrics {
    /// SENDs completed successfully (messages out).
    pub sends: u64,
    /// Payload bytes of those SENDs.
    pub send_bytes: u64,
    /// Messages received (receive completions with a message; an RDMA WRITE with immediate
    /// data's notice included, with 0 bytes).
    pub recvs: u64,
    /// Payload bytes of those messages.
    pub recv_bytes: u64,
    /// RDMA WRITEs (with or without immediate data) completed successfully.
    pub writes: u64,
    /// Bytes those WRITEs moved to the peer.
    pub write_bytes: u64,
    /// RDMA READs completed successfully.
    pub reads: u64,
    /// Bytes those READs moved from the peer.
    pub read_bytes: u64,
    /// Credit-only messages this side sent (flow control's own, never seen by the handler).
    pub credit_messages_sent: u64,
    /// Credit-only messages received from the peer.
    pub credit_messages_received: u64,
    /// Times its next send had to wait for the peer's credits.
    pub credit_waits: u64,
    /// Time its sends spent waiting for credits, over all those waits (a wait still going on
    /// counts up to now).
    pub credit_wait: Duration,
    /// Operations that completed with an error (a failed work request, a refused post).
    pub errors: u64,
}

/// A connection's [`ConnMetrics`] while they are being counted.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ConnMeter {
    m: ConnMetrics,
    /// When the current credit wait began.
    waiting_since: Option<Instant>,
}

impl ConnMeter {
    /// A completion handed to the handler: `result` as the handler sees it (bytes moved).
    pub(crate) fn completed(&mut self, opcode: OpCode, result: &Result<u32, OpError>) {
        let Ok(n) = *result else {
            self.m.errors += 1;
            return;
        };
        let n = u64::from(n);
        let m = &mut self.m;
        match opcode {
            OpCode::Send => {
                m.sends += 1;
                m.send_bytes += n;
            }
            OpCode::Recv => {
                m.recvs += 1;
                m.recv_bytes += n;
            }
            OpCode::Write | OpCode::WriteImm => {
                m.writes += 1;
                m.write_bytes += n;
            }
            OpCode::Read => {
                m.reads += 1;
                m.read_bytes += n;
            }
        }
    }

    /// What came from the peer so far: messages and credit-only ones (a nudge compares it
    /// with its value at ESTABLISHED: a reconnected client's first queue pair's do not count).
    pub(crate) fn heard(&self) -> u64 {
        self.m.recvs + self.m.credit_messages_received
    }

    /// A credit-only message went out (`sent`) or came in.
    pub(crate) fn credit_message(&mut self, sent: bool) {
        if sent {
            self.m.credit_messages_sent += 1;
        } else {
            self.m.credit_messages_received += 1;
        }
    }

    /// `n` credit-only messages of ours went (their completions came back successful).
    #[inline]
    pub(crate) fn credit_messages_sent(&mut self, n: u32) {
        self.m.credit_messages_sent += u64::from(n);
    }

    /// After each plan of its sends: `blocked` when the next send waits for credits; `now` is
    /// the reactor's clock. A wait begins at the first blocked report and ends at the first
    /// report that is not.
    pub(crate) fn credit_state(&mut self, blocked: bool, now: Instant) {
        match (blocked, self.waiting_since) {
            (true, None) => {
                self.m.credit_waits += 1;
                self.waiting_since = Some(now);
            }
            (false, Some(since)) => {
                self.m.credit_wait += now.saturating_duration_since(since);
                self.waiting_since = None;
            }
            _ => {}
        }
    }

    /// True while a credit wait is going on (the caller reads the clock only then).
    pub(crate) fn waiting(&self) -> bool {
        self.waiting_since.is_some()
    }

    /// The counters at `now` (a credit wait still going on counts up to now).
    pub(crate) fn snapshot(&self, now: Instant) -> ConnMetrics {
        let mut m = self.m;
        if let Some(since) = self.waiting_since {
            m.credit_wait += now.saturating_duration_since(since);
        }
        m
    }
}

/// Whether a family counts up or goes up and down.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Counter,
    Gauge,
}

/// Prometheus text exposition (format 0.0.4), written family by family.
#[derive(Default)]
pub(crate) struct Exposition {
    out: String,
}

impl Exposition {
    /// Starts a family `name` (without the crate's prefix; a counter's name gains `_total`).
    /// Its samples follow with [`Family::sample`].
    pub(crate) fn family(&mut self, name: &str, kind: Kind, help: &str) -> Family<'_> {
        let full = match kind {
            Kind::Counter => format!("rdma_reactor_{name}_total"),
            Kind::Gauge => format!("rdma_reactor_{name}"),
        };
        let _ = writeln!(self.out, "# HELP {full} {}", escape_help(help));
        let _ = writeln!(self.out, "# TYPE {full} {}", if kind == Kind::Counter { "counter" } else { "gauge" });
        Family { out: &mut self.out, name: full }
    }

    /// The text.
    pub(crate) fn finish(self) -> String {
        self.out
    }
}

/// One family's samples.
pub(crate) struct Family<'a> {
    out: &'a mut String,
    name: String,
}

impl Family<'_> {
    /// One sample, with labels `(name, value)` (values escaped here).
    pub(crate) fn sample(&mut self, labels: &[(&str, &str)], value: impl std::fmt::Display) -> &mut Self {
        self.out.push_str(&self.name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{k}=\"{}\"", escape_label(v));
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {value}");
        self
    }
}

/// A HELP text: backslash and newline escaped.
fn escape_help(s: &str) -> String {
    s.replace('\\', "\\\\").replace('\n', "\\n")
}

/// A label value: backslash, double quote and newline escaped.
fn escape_label(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// The per-connection families of [`ConnMetrics`]: (name, kind, help, value).
pub(crate) fn conn_families(m: &ConnMetrics) -> [(&'static str, Kind, &'static str, f64); 13] {
    [
        ("conn_sends", Kind::Counter, "SENDs completed successfully.", m.sends as f64),
        ("conn_send_bytes", Kind::Counter, "Payload bytes of the completed SENDs.", m.send_bytes as f64),
        ("conn_recvs", Kind::Counter, "Messages received.", m.recvs as f64),
        ("conn_recv_bytes", Kind::Counter, "Payload bytes received.", m.recv_bytes as f64),
        ("conn_writes", Kind::Counter, "RDMA WRITEs completed successfully.", m.writes as f64),
        ("conn_write_bytes", Kind::Counter, "Bytes the completed RDMA WRITEs moved.", m.write_bytes as f64),
        ("conn_reads", Kind::Counter, "RDMA READs completed successfully.", m.reads as f64),
        ("conn_read_bytes", Kind::Counter, "Bytes the completed RDMA READs moved.", m.read_bytes as f64),
        ("conn_credit_messages_sent", Kind::Counter, "Credit-only messages sent.", m.credit_messages_sent as f64),
        (
            "conn_credit_messages_received",
            Kind::Counter,
            "Credit-only messages received.",
            m.credit_messages_received as f64,
        ),
        ("conn_credit_waits", Kind::Counter, "Times a send waited for the peer's credits.", m.credit_waits as f64),
        (
            "conn_credit_wait_seconds",
            Kind::Counter,
            "Time sends spent waiting for the peer's credits.",
            m.credit_wait.as_secs_f64(),
        ),
        ("conn_errors", Kind::Counter, "Operations that completed with an error.", m.errors as f64),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::op::WcStatus;

    #[test]
    fn completions_count_by_kind_and_errors_apart() {
        let mut c = ConnMeter::default();
        c.completed(OpCode::Send, &Ok(64));
        c.completed(OpCode::Send, &Ok(36));
        c.completed(OpCode::Recv, &Ok(10));
        c.completed(OpCode::WriteImm, &Ok(4096));
        c.completed(OpCode::Write, &Ok(4));
        c.completed(OpCode::Read, &Ok(100));
        c.completed(OpCode::Send, &Err(OpError::Wc(WcStatus::RetryExcErr)));
        c.completed(OpCode::Recv, &Err(OpError::Cancelled));
        c.credit_message(true);
        c.credit_message(false);
        c.credit_message(false);
        let m = c.snapshot(Instant::now());
        assert_eq!((m.sends, m.send_bytes), (2, 100));
        assert_eq!((m.recvs, m.recv_bytes), (1, 10));
        assert_eq!((m.writes, m.write_bytes), (2, 4100));
        assert_eq!((m.reads, m.read_bytes), (1, 100));
        assert_eq!(m.errors, 2);
        assert_eq!((m.credit_messages_sent, m.credit_messages_received), (1, 2));
    }

    #[test]
    fn a_credit_wait_is_counted_once_and_timed_until_it_ends() {
        let t0 = Instant::now();
        let at = |ns: u64| t0 + Duration::from_nanos(ns);
        let mut c = ConnMeter::default();
        c.credit_state(false, at(100));
        assert!(!c.waiting());
        c.credit_state(true, at(1_000));
        c.credit_state(true, at(5_000));
        assert!(c.waiting());
        // Still waiting: counted up to now.
        assert_eq!(c.snapshot(at(3_000)).credit_wait, Duration::from_nanos(2_000));
        c.credit_state(false, at(11_000));
        c.credit_state(false, at(20_000));
        c.credit_state(true, at(30_000));
        c.credit_state(false, at(30_500));
        let m = c.snapshot(at(99_999));
        assert_eq!(m.credit_waits, 2);
        assert_eq!(m.credit_wait, Duration::from_nanos(10_500));
        // An earlier `now` than the wait's start costs nothing, never a panic.
        c.credit_state(true, at(50));
        c.credit_state(false, at(10));
        assert_eq!(c.snapshot(at(0)).credit_wait, Duration::from_nanos(10_500));
    }

    #[test]
    fn the_exposition_is_prometheus_text() {
        let mut e = Exposition::default();
        e.family("wakeups", Kind::Counter, "epoll_wait returns.").sample(&[], 7);
        e.family("connections", Kind::Gauge, "Live connections.\nnow").sample(&[("reactor", "0")], 2);
        e.family("conn_sends", Kind::Counter, "SENDs.")
            .sample(&[("conn", "17"), ("peer", "198.18.0.1:7471")], 3)
            .sample(&[("conn", "18"), ("peer", "a\"b\\c\nd")], 0.5);
        assert_eq!(
            e.finish(),
            "# HELP rdma_reactor_wakeups_total epoll_wait returns.\n\
             # TYPE rdma_reactor_wakeups_total counter\n\
             rdma_reactor_wakeups_total 7\n\
             # HELP rdma_reactor_connections Live connections.\\nnow\n\
             # TYPE rdma_reactor_connections gauge\n\
             rdma_reactor_connections{reactor=\"0\"} 2\n\
             # HELP rdma_reactor_conn_sends_total SENDs.\n\
             # TYPE rdma_reactor_conn_sends_total counter\n\
             rdma_reactor_conn_sends_total{conn=\"17\",peer=\"198.18.0.1:7471\"} 3\n\
             rdma_reactor_conn_sends_total{conn=\"18\",peer=\"a\\\"b\\\\c\\nd\"} 0.5\n"
        );
    }

    #[test]
    fn every_connection_counter_has_a_family() {
        let m = ConnMetrics { sends: 1, errors: 9, credit_wait: Duration::from_millis(1500), ..Default::default() };
        let f = conn_families(&m);
        let names: std::collections::HashSet<_> = f.iter().map(|x| x.0).collect();
        assert_eq!(names.len(), f.len(), "names are unique");
        assert!(f.iter().all(|x| x.0.starts_with("conn_")));
        // Debug lists the struct's fields: one family per field.
        let fields = format!("{m:?}").matches(": ").count();
        assert_eq!(fields, f.len());
        assert!(f.contains(&(
            "conn_credit_wait_seconds",
            Kind::Counter,
            "Time sends spent waiting for the peer's credits.",
            1.5
        )));
    }
}
