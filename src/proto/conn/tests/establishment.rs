//! Client and agent: the happy paths and each failure before establishment.

use super::*;

// ------------------------------------------------------------------------------------------
// Client: happy path and each pre-establishment step
// ------------------------------------------------------------------------------------------

#[test]
fn client_starts_resolving_with_a_deadline() {
    let (c, first) = Client::resolving();
    assert_eq!(c.state(), &State::ResolvingAddr);
    assert_eq!(first.as_slice(), [A::SetDeadline(Step::ResolveAddr)]);
    assert!(!c.state().is_established() && !c.state().is_draining() && !c.state().is_closed());
}

#[test]
fn client_happy_path_step_by_step() {
    let c = fresh::<Client>();
    let c = check(
        c,
        &[cm(K::AddrResolved)],
        State::ResolvingRoute,
        &[A::ClearDeadline, A::ResolveRoute, A::SetDeadline(Step::ResolveRoute)],
    );
    let c = check(
        c,
        &[cm(K::RouteResolved)],
        State::Connecting,
        &[A::ClearDeadline, A::Connect, A::SetDeadline(Step::Connect)],
    );
    let c = check(c, &[cm(K::Established)], State::Established, &[A::ClearDeadline, A::Established]);
    assert!(c.state().is_established());
    let c = check(
        c,
        &[Input::Close],
        State::Disconnecting(CloseReason::Local),
        &[A::Disconnect, A::SetDeadline(Step::Disconnect)],
    );
    let c = check(
        c,
        &[cm(K::Disconnected)],
        State::Draining(CloseReason::Local),
        &[A::ClearDeadline, A::SetDeadline(Step::Drain)],
    );
    assert!(c.state().is_draining());
    let c = check(c, &[Input::Drained], State::Closed, &closed(CloseReason::Local));
    assert!(c.state().is_closed());
}

#[test]
fn client_happy_path_ends_with_a_clean_close() {
    let c = established::<Client>();
    let (_, last) = feed_all(c, &[Input::Close, cm(K::Disconnected), Input::Drained]);
    match last.as_slice() {
        [A::ClearDeadline, A::Closed(r)] => assert!(r.is_clean()),
        other => panic!("{other:?}"),
    }
}

#[test]
fn client_peer_disconnect() {
    let c = check(
        established::<Client>(),
        &[cm(K::Disconnected)],
        State::Draining(CloseReason::Peer),
        &[A::Disconnect, A::SetDeadline(Step::Drain)],
    );
    check(c, &[Input::Drained], State::Closed, &closed(CloseReason::Peer));
}

#[test]
fn client_addr_error_carries_status() {
    check(fresh::<Client>(), &[Input::Cm(K::AddrError, ST)], State::Closed, &closed(CloseReason::AddrError(ST)));
}

#[test]
fn client_route_error_carries_status() {
    let inputs = [cm(K::AddrResolved), Input::Cm(K::RouteError, ST)];
    check(fresh::<Client>(), &inputs, State::Closed, &closed(CloseReason::RouteError(ST)));
}

#[test]
fn client_connect_error_carries_status() {
    let inputs = [cm(K::AddrResolved), cm(K::RouteResolved), Input::Cm(K::ConnectError, ST)];
    check(fresh::<Client>(), &inputs, State::Closed, &closed(CloseReason::ConnectError(ST)));
}

#[test]
fn client_unreachable_carries_status() {
    let inputs = [cm(K::AddrResolved), cm(K::RouteResolved), Input::Cm(K::Unreachable, ST)];
    check(fresh::<Client>(), &inputs, State::Closed, &closed(CloseReason::Unreachable(ST)));
}

#[test]
fn client_cm_rejected_consumer_reject() {
    let inputs = [cm(K::AddrResolved), cm(K::RouteResolved), Input::Cm(K::Rejected, 28)];
    let want = CloseReason::Rejected { status: 28, reason: None };
    check(fresh::<Client>(), &inputs, State::Closed, &closed(want));
}

#[test]
fn client_cm_rejected_nothing_listening() {
    let inputs = [cm(K::AddrResolved), cm(K::RouteResolved), Input::Cm(K::Rejected, 8)];
    let want = CloseReason::Rejected { status: 8, reason: None };
    assert_eq!(want.to_string(), "rejected: nothing listens on that port (status 8)");
    check(fresh::<Client>(), &inputs, State::Closed, &closed(want));
}

#[test]
fn client_rejected_with_decoded_reason() {
    let inputs = [cm(K::AddrResolved), cm(K::RouteResolved), Input::Rejected { status: 28, reason: Some(refused()) }];
    let want = CloseReason::Rejected { status: 28, reason: Some(refused()) };
    assert_eq!(want.to_string(), "rejected by the server (status 28): refused by the application: go away");
    assert!(!want.is_clean());
    check(fresh::<Client>(), &inputs, State::Closed, &closed(want));
}

#[test]
fn client_rejected_without_decoded_reason() {
    let inputs = [cm(K::AddrResolved), cm(K::RouteResolved), Input::Rejected { status: 28, reason: None }];
    let want = CloseReason::Rejected { status: 28, reason: None };
    check(fresh::<Client>(), &inputs, State::Closed, &closed(want));
}

// ------------------------------------------------------------------------------------------
// Agent: happy paths and failures while accepting
// ------------------------------------------------------------------------------------------

#[test]
fn agent_starts_accepting_with_a_deadline() {
    let (a, first) = Agent::accepting();
    assert_eq!(a.state(), &State::Accepting);
    assert_eq!(first.as_slice(), [A::SetDeadline(Step::Accept)]);
}

#[test]
fn agent_happy_path_peer_disconnects() {
    let a = check(fresh::<Agent>(), &[cm(K::Established)], State::Established, &[A::ClearDeadline, A::Established]);
    let a = check(
        a,
        &[cm(K::Disconnected)],
        State::Draining(CloseReason::Peer),
        &[A::Disconnect, A::SetDeadline(Step::Drain)],
    );
    check(a, &[Input::Drained], State::Closed, &closed(CloseReason::Peer));
}

#[test]
fn agent_happy_path_local_close() {
    let a = check(
        established::<Agent>(),
        &[Input::Close],
        State::Disconnecting(CloseReason::Local),
        &[A::Disconnect, A::SetDeadline(Step::Disconnect)],
    );
    let a = check(
        a,
        &[cm(K::Disconnected)],
        State::Draining(CloseReason::Local),
        &[A::ClearDeadline, A::SetDeadline(Step::Drain)],
    );
    check(a, &[Input::Drained], State::Closed, &closed(CloseReason::Local));
}

#[test]
fn agent_disconnected_while_accepting_is_a_peer_close() {
    check(fresh::<Agent>(), &[cm(K::Disconnected)], State::Closed, &closed(CloseReason::Peer));
}

#[test]
fn agent_connect_error_carries_status() {
    check(fresh::<Agent>(), &[Input::Cm(K::ConnectError, ST)], State::Closed, &closed(CloseReason::ConnectError(ST)));
}

#[test]
fn agent_unreachable_carries_status() {
    check(fresh::<Agent>(), &[Input::Cm(K::Unreachable, ST)], State::Closed, &closed(CloseReason::Unreachable(ST)));
}

#[test]
fn agent_cm_rejected_carries_status() {
    let want = CloseReason::Rejected { status: 28, reason: None };
    check(fresh::<Agent>(), &[Input::Cm(K::Rejected, 28)], State::Closed, &closed(want));
}

#[test]
fn agent_rejected_with_decoded_reason() {
    let input = Input::Rejected { status: 28, reason: Some(refused()) };
    let want = CloseReason::Rejected { status: 28, reason: Some(refused()) };
    check(fresh::<Agent>(), &[input], State::Closed, &closed(want));
}
