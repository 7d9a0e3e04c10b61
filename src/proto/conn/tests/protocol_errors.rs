//! Protocol errors: events that cannot happen in the state they arrive in.

use super::*;

// ------------------------------------------------------------------------------------------
// Protocol errors
// ------------------------------------------------------------------------------------------

#[test]
fn protocol_message_names_the_event_and_the_state() {
    let (_, last) = feed_all(fresh::<Client>(), &[cm(K::RouteResolved)]);
    assert_eq!(last, closed(CloseReason::Protocol("unexpected Cm(RouteResolved, 0) while resolving address".into())));
    let (a, _) = feed_all(established::<Agent>(), &[Input::Cm(K::Unknown(999), 5)]);
    assert_eq!(
        a.state(),
        &State::Disconnecting(CloseReason::Protocol("unexpected Cm(Unknown(999), 5) while established".into()))
    );
}

#[test]
fn client_route_resolved_while_resolving_addr() {
    let i = cm(K::RouteResolved);
    check(fresh::<Client>(), [i.clone()], State::Closed, &closed(proto(&State::ResolvingAddr, &i)));
}

#[test]
fn client_addr_resolved_twice() {
    let i = cm(K::AddrResolved);
    check(fresh::<Client>(), &[i.clone(), i.clone()], State::Closed, &closed(proto(&State::ResolvingRoute, &i)));
}

#[test]
fn client_connect_request_in_every_early_state() {
    let i = cm(K::ConnectRequest);
    for (name, path) in Client::early_paths() {
        let (c, _) = feed_all(fresh::<Client>(), &path);
        let before = c.state().clone();
        let (c, last) = feed_all(c, [i.clone()]);
        assert_eq!((c.state(), last), (&State::Closed, closed(proto(&before, &i)).to_vec()), "{name}");
    }
}

#[test]
fn client_connect_response_while_connecting() {
    let i = cm(K::ConnectResponse);
    let path = [cm(K::AddrResolved), cm(K::RouteResolved), i.clone()];
    check(fresh::<Client>(), &path, State::Closed, &closed(proto(&State::Connecting, &i)));
}

#[test]
fn client_disconnected_while_connecting() {
    // Unlike the agent (whose peer may leave before its RTU), a client has no DISCONNECTED
    // before ESTABLISHED.
    let i = cm(K::Disconnected);
    let path = [cm(K::AddrResolved), cm(K::RouteResolved), i.clone()];
    check(fresh::<Client>(), &path, State::Closed, &closed(proto(&State::Connecting, &i)));
}

#[test]
fn client_rejected_before_connecting() {
    let i = Input::Rejected { status: 28, reason: Some(refused()) };
    check(fresh::<Client>(), [i.clone()], State::Closed, &closed(proto(&State::ResolvingAddr, &i)));
    let i = Input::Cm(K::Rejected, 28);
    let path = [cm(K::AddrResolved), i.clone()];
    check(fresh::<Client>(), &path, State::Closed, &closed(proto(&State::ResolvingRoute, &i)));
}

#[test]
fn client_unknown_event_before_establishment() {
    let i = Input::Cm(K::Unknown(999), 0);
    check(fresh::<Client>(), [i.clone()], State::Closed, &closed(proto(&State::ResolvingAddr, &i)));
}

#[test]
fn agent_connect_request_while_accepting() {
    let i = cm(K::ConnectRequest);
    check(fresh::<Agent>(), [i.clone()], State::Closed, &closed(proto(&State::Accepting, &i)));
}

#[test]
fn agent_client_only_events_while_accepting() {
    for k in [K::AddrResolved, K::AddrError, K::RouteResolved, K::RouteError, K::ConnectResponse, K::Unknown(999)] {
        let i = Input::Cm(k, ST);
        check(fresh::<Agent>(), [i.clone()], State::Closed, &closed(proto(&State::Accepting, &i)));
    }
}

/// An impossible event while established disconnects first and closes after the drain.
fn protocol_error_while_established_drains_first<M: Machine>() {
    for k in [K::Established, K::AddrResolved, K::ConnectRequest, K::ConnectResponse, K::Rejected, K::Unknown(999)] {
        let i = cm(k);
        let reason = proto(&State::Established, &i);
        let m = check(
            established::<M>(),
            &[i],
            State::Disconnecting(reason.clone()),
            &[A::Disconnect, A::SetDeadline(Step::Disconnect)],
        );
        let m = check(
            m,
            &[cm(K::Disconnected)],
            State::Draining(reason.clone()),
            &[A::ClearDeadline, A::SetDeadline(Step::Drain)],
        );
        let m = check(m, &[Input::Drained], State::Closed, &closed(reason));
        assert!(!feed_all(m, &[Input::Close]).1.iter().any(|a| matches!(a, A::Closed(_))));
    }
}

/// A second ESTABLISHED is a protocol error; the handler hears Established only once.
fn established_twice<M: Machine>() {
    let mut path = M::to_established();
    path.push(cm(K::Established));
    let (m, last) = feed_all(fresh::<M>(), &path);
    assert_eq!(last, [A::Disconnect, A::SetDeadline(Step::Disconnect)]);
    assert_eq!(m.st(), &State::Disconnecting(proto(&State::Established, &cm(K::Established))));
}

/// A REJECTED (decoded) after establishment is a protocol error too.
fn rejected_after_established<M: Machine>() {
    let i = Input::Rejected { status: 28, reason: None };
    check(
        established::<M>(),
        [i.clone()],
        State::Disconnecting(proto(&State::Established, &i)),
        &[A::Disconnect, A::SetDeadline(Step::Disconnect)],
    );
}

/// While closing, an impossible event closes at once with the Protocol reason: no drain, and
/// the reason the close started with (here Local or Peer) is replaced. This pins today's
/// behaviour (`Phase::unexpected` only disconnects from `Established`); unlike a protocol
/// error while established, the reactor gets `Closed` with work requests possibly outstanding.
fn protocol_error_while_closing_closes_at_once<M: Machine>() {
    let est = M::to_established();
    for tail in [vec![Input::Close], vec![Input::Close, cm(K::Disconnected)], vec![cm(K::Disconnected)]] {
        let (m, _) = feed_all(fresh::<M>(), [est.clone(), tail].concat());
        let before = m.st().clone();
        let i = cm(K::Established);
        check(m, [i.clone()], State::Closed, &closed(proto(&before, &i)));
    }
}

both!(
    protocol_error_while_established_drains_first,
    established_twice,
    rejected_after_established,
    protocol_error_while_closing_closes_at_once,
);

/// Fault issue, defect 9: UNREACHABLE on an established connection was "Protocol".
fn unreachable_while_established_is_unreachable<M: Machine>() {
    let m = established::<M>();
    let m = check(
        m,
        [Input::Cm(K::Unreachable, ST)],
        State::Disconnecting(CloseReason::Unreachable(ST)),
        &[A::Disconnect, A::SetDeadline(Step::Disconnect)],
    );
    let (m, acts) = feed_all(m, [Input::Cm(K::Unreachable, ST)]);
    assert!(acts.is_empty(), "a second one while disconnecting is ignored");
    let inputs = [cm(K::Disconnected), Input::Drained];
    check(m, inputs, State::Closed, &closed(CloseReason::Unreachable(ST)));
}
both!(unreachable_while_established_is_unreachable);

#[test]
fn client_addr_resolved_after_established() {
    let i = cm(K::AddrResolved);
    check(
        established::<Client>(),
        [i.clone()],
        State::Disconnecting(proto(&State::Established, &i)),
        &[A::Disconnect, A::SetDeadline(Step::Disconnect)],
    );
}
