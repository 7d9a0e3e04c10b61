//! The listener's machine, and `CloseReason`.

use super::*;

// ------------------------------------------------------------------------------------------
// Listener
// ------------------------------------------------------------------------------------------

#[test]
fn listener_connect_requests_are_incoming_and_it_keeps_listening() {
    let mut l = Listener::new();
    for _ in 0..3 {
        assert_eq!(l.on_cm(K::ConnectRequest, 0), ListenerAction::Incoming);
    }
    assert!(!l.is_closed());
    assert_eq!(Listener::default(), Listener::new());
}

#[test]
fn listener_device_removal_closes_once() {
    let mut l = Listener::new();
    assert_eq!(l.on_cm(K::DeviceRemoval, 0), ListenerAction::Closed(CloseReason::DeviceRemoval));
    assert!(l.is_closed());
    assert_eq!(l.on_cm(K::DeviceRemoval, 0), ListenerAction::None);
    assert_eq!(l.close(), ListenerAction::None);
}

#[test]
fn listener_close_once() {
    let mut l = Listener::new();
    assert_eq!(l.close(), ListenerAction::Closed(CloseReason::Local));
    assert!(l.is_closed());
    assert_eq!(l.close(), ListenerAction::None);
}

#[test]
fn listener_shutdown_closes_once_with_its_reason() {
    let mut l = Listener::new();
    assert_eq!(l.close_for(CloseReason::Shutdown), ListenerAction::Closed(CloseReason::Shutdown));
    assert_eq!(l.close(), ListenerAction::None);
    assert_eq!(l.close_for(CloseReason::Shutdown), ListenerAction::None);
}

#[test]
fn listener_after_close_every_event_is_none() {
    let mut l = Listener::new();
    l.close();
    for k in all_kinds() {
        assert_eq!(l.on_cm(k, ST), ListenerAction::None, "{k:?}");
    }
    assert_eq!(l.close(), ListenerAction::None);
}

#[test]
fn listener_ignores_addr_change_and_timewait_exit() {
    let mut l = Listener::new();
    assert_eq!(l.on_cm(K::AddrChange, 0), ListenerAction::None);
    assert_eq!(l.on_cm(K::TimewaitExit, ST), ListenerAction::None);
    assert!(!l.is_closed());
}

#[test]
fn listener_reports_unexpected_events_and_keeps_listening() {
    let mut l = Listener::new();
    let expected = [K::ConnectRequest, K::DeviceRemoval, K::AddrChange, K::TimewaitExit];
    for k in all_kinds().into_iter().filter(|k| !expected.contains(k)) {
        match l.on_cm(k, ST) {
            ListenerAction::Report(msg) => {
                assert!(msg.contains(&format!("{k:?}")), "{msg}");
                assert!(msg.contains(&ST.to_string()), "{msg}");
            }
            other => panic!("{k:?}: {other:?}"),
        }
        assert!(!l.is_closed());
        assert_eq!(l.on_cm(K::ConnectRequest, 0), ListenerAction::Incoming, "after {k:?}");
    }
    assert_eq!(
        l.on_cm(K::Established, 3),
        ListenerAction::Report("unexpected Established (status 3) on a listener".into())
    );
}

#[test]
fn listener_every_event_sequence_closes_at_most_once() {
    // All sequences of three steps over every event plus close(): at most one Closed, and
    // nothing but None after it.
    let mut steps: Vec<Option<K>> = all_kinds().into_iter().map(Some).collect();
    steps.push(None);
    for a in &steps {
        for b in &steps {
            for c in &steps {
                let mut l = Listener::new();
                let mut closes = 0;
                for s in [a, b, c] {
                    let was_closed = l.is_closed();
                    let out = match s {
                        Some(k) => l.on_cm(*k, 0),
                        None => l.close(),
                    };
                    if was_closed {
                        assert_eq!(out, ListenerAction::None, "{a:?} {b:?} {c:?}");
                    }
                    if matches!(out, ListenerAction::Closed(_)) {
                        closes += 1;
                        assert!(l.is_closed());
                    }
                }
                assert!(closes <= 1, "{a:?} {b:?} {c:?}");
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// CloseReason
// ------------------------------------------------------------------------------------------

#[test]
fn close_reason_cleanliness_and_display() {
    let cases = [
        (CloseReason::Local, true, "closed locally"),
        (CloseReason::Peer, true, "peer disconnected"),
        (CloseReason::Shutdown, true, "reactor shut down"),
        (CloseReason::Rejected { status: 28, reason: None }, false, "rejected (status 28)"),
        (CloseReason::AddrError(ST), false, "address resolution failed (status -110: timed out)"),
        (
            CloseReason::AddrError(-19),
            false,
            "address resolution failed (status -19: no RDMA device behind that address or on the route to it)",
        ),
        (CloseReason::RouteError(ST), false, "route resolution failed (status -110: timed out)"),
        (CloseReason::ConnectError(ST), false, "connect failed (status -110)"),
        (CloseReason::Unreachable(ST), false, "peer unreachable (status -110: timed out)"),
        (CloseReason::DeviceRemoval, false, "RDMA device removed"),
        (
            CloseReason::WorkError(WcStatus::RetryExcErr),
            false,
            "work request failed: the peer did not acknowledge (RetryExcErr)",
        ),
        (CloseReason::WorkError(WcStatus::RemAccessErr), false, "work request failed: RemAccessErr"),
        (CloseReason::AsyncEvent(AsyncEventKind::PortErr), false, "the device reported port down (PORT_ERR)"),
        (
            CloseReason::AsyncEvent(AsyncEventKind::Unknown(99)),
            false,
            "the device reported unknown asynchronous event 99",
        ),
        (CloseReason::CqFailed { call: "ibv_poll_cq", errno: 5 }, false, "ibv_poll_cq failed (errno 5)"),
        (CloseReason::Protocol("x".into()), false, "protocol error: x"),
    ];
    for (reason, clean, text) in cases {
        assert_eq!(reason.is_clean(), clean, "{reason:?}");
        assert_eq!(reason.to_string(), text);
    }
}
