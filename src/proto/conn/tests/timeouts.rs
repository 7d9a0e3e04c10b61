//! Timeouts: each step's deadline, stale ones ignored, and the close handshake.

use super::*;

// ------------------------------------------------------------------------------------------
// Timeouts
// ------------------------------------------------------------------------------------------

#[test]
fn client_timeout_of_each_early_step_closes() {
    let steps = [Step::ResolveAddr, Step::ResolveRoute, Step::Connect];
    for ((name, path), step) in Client::early_paths().into_iter().zip(steps) {
        let (c, _) = feed_all(fresh::<Client>(), &path);
        let (c, last) = feed_all(c, &[Input::Timeout(step)]);
        assert_eq!((c.state(), last), (&State::Closed, closed(CloseReason::Timeout(step)).to_vec()), "{name}");
    }
}

#[test]
fn client_stale_timeouts_of_earlier_steps_are_ignored() {
    let c =
        check(fresh::<Client>(), &[cm(K::AddrResolved), Input::Timeout(Step::ResolveAddr)], State::ResolvingRoute, &[]);
    let c = check(c, &[cm(K::RouteResolved), Input::Timeout(Step::ResolveAddr)], State::Connecting, &[]);
    let c = check(c, &[Input::Timeout(Step::ResolveRoute)], State::Connecting, &[]);
    let c = check(c, &[cm(K::Established), Input::Timeout(Step::Connect)], State::Established, &[]);
    check(c, &[Input::Timeout(Step::ResolveRoute)], State::Established, &[]);
}

#[test]
fn client_timeouts_of_other_roles_steps_are_ignored() {
    for s in [Step::Accept, Step::Disconnect, Step::Drain] {
        check(fresh::<Client>(), &[Input::Timeout(s)], State::ResolvingAddr, &[]);
    }
}

#[test]
fn agent_accept_timeout_closes() {
    check(
        fresh::<Agent>(),
        &[Input::Timeout(Step::Accept)],
        State::Closed,
        &closed(CloseReason::Timeout(Step::Accept)),
    );
}

#[test]
fn agent_other_timeouts_while_accepting_are_ignored() {
    for s in [Step::ResolveAddr, Step::ResolveRoute, Step::Connect, Step::Disconnect, Step::Drain] {
        check(fresh::<Agent>(), &[Input::Timeout(s)], State::Accepting, &[]);
    }
}

#[test]
fn agent_stale_accept_timeout_after_established_is_ignored() {
    check(established::<Agent>(), &[Input::Timeout(Step::Accept)], State::Established, &[]);
}

#[test]
fn timeout_display() {
    assert_eq!(CloseReason::Timeout(Step::Connect).to_string(), "connect timed out");
    assert_eq!(CloseReason::Timeout(Step::ResolveAddr).to_string(), "address resolution timed out");
    assert_eq!(Step::Drain.to_string(), "drain");
}

/// A disconnect that never completes moves on to draining, keeping the reason.
fn disconnect_timeout_moves_to_draining<M: Machine>() {
    let m = check(
        established::<M>(),
        &[Input::Close, Input::Timeout(Step::Disconnect)],
        State::Draining(CloseReason::Local),
        &[A::SetDeadline(Step::Drain)],
    );
    // DISCONNECTED arriving late while draining is ignored.
    let m = check(m, &[cm(K::Disconnected)], State::Draining(CloseReason::Local), &[]);
    check(m, &[Input::Drained], State::Closed, &closed(CloseReason::Local));
}

/// A drain that never completes closes with the reason the close started with.
fn drain_timeout_closes_with_the_original_reason<M: Machine>() {
    let cases = [
        (vec![Input::Close], CloseReason::Local),
        (vec![Input::Shutdown], CloseReason::Shutdown),
        (vec![Input::WorkError(WcStatus::RemAccessErr)], CloseReason::WorkError(WcStatus::RemAccessErr)),
        (vec![cm(K::Established)], proto(&State::Established, &cm(K::Established))),
        (vec![], CloseReason::Peer),
    ];
    for (tail, reason) in cases {
        let path = [M::to_established(), tail, vec![cm(K::Disconnected)]].concat();
        let (m, _) = feed_all(fresh::<M>(), &path);
        assert_eq!(m.st(), &State::Draining(reason.clone()));
        check(m, &[Input::Timeout(Step::Drain)], State::Closed, &closed(reason));
    }
}

/// Stale deadlines while closing: a drain deadline while disconnecting and a disconnect
/// deadline while draining mean nothing.
fn stale_timeouts_while_closing_are_ignored<M: Machine>() {
    let m = established::<M>();
    let m = check(m, &[Input::Close, Input::Timeout(Step::Drain)], State::Disconnecting(CloseReason::Local), &[]);
    let m =
        check(m, &[cm(K::Disconnected), Input::Timeout(Step::Disconnect)], State::Draining(CloseReason::Local), &[]);
    for s in all_steps().into_iter().filter(|&s| s != Step::Drain) {
        check(m.clone(), &[Input::Timeout(s)], State::Draining(CloseReason::Local), &[]);
    }
}

/// The close handshake: our farewell, then the peer's answer (or the deadline) lets us
/// disconnect; the peer disconnecting first ends it; the reason is the one it started with.
fn the_close_handshake_disconnects_once_answered<M: Machine>() {
    for reason in [CloseReason::Local, CloseReason::Shutdown] {
        let finishing = State::Finishing(reason.clone());
        let m = check(
            established::<M>(),
            &[Input::Finish(reason.clone())],
            finishing.clone(),
            &[A::SendFarewell, A::SetDeadline(Step::Finish)],
        );
        // A second close, a stray deadline, a drain: nothing.
        for i in [Input::Close, Input::Shutdown, Input::Finish(CloseReason::Local), Input::Timeout(Step::Disconnect)] {
            check(m.clone(), [i], finishing.clone(), &[]);
        }
        let disconnecting = State::Disconnecting(reason.clone());
        let go = [A::Disconnect, A::SetDeadline(Step::Disconnect)];
        let answered = check(m.clone(), &[Input::Finished], disconnecting.clone(), &go);
        check(m.clone(), &[Input::Timeout(Step::Finish)], disconnecting, &go);
        let path = [cm(K::Disconnected), Input::Drained];
        check(answered, &path, State::Closed, &closed(reason.clone()));
        // The peer leaves first: draining, still for our reason.
        let m = check(
            m,
            &[cm(K::Disconnected)],
            State::Draining(reason.clone()),
            &[A::Disconnect, A::SetDeadline(Step::Drain)],
        );
        check(m, &[Input::Drained], State::Closed, &closed(reason));
    }
    // An answer nobody asked for, and a farewell before establishment (a plain close).
    check(established::<M>(), &[Input::Finished], State::Established, &[]);
    let m = check(fresh::<M>(), &[Input::Finish(CloseReason::Local)], State::Closed, &closed(CloseReason::Local));
    check(m, &[Input::Finished], State::Closed, &[]);
    // Failures while saying goodbye disconnect for their own reason.
    let m = check(
        established::<M>(),
        &[Input::Finish(CloseReason::Local)],
        State::Finishing(CloseReason::Local),
        &[A::SendFarewell, A::SetDeadline(Step::Finish)],
    );
    let w = CloseReason::WorkError(WcStatus::RetryExcErr);
    check(
        m.clone(),
        &[Input::WorkError(WcStatus::RetryExcErr)],
        State::Disconnecting(w),
        &[A::Disconnect, A::SetDeadline(Step::Disconnect)],
    );
    check(
        m,
        &[cm(K::Unreachable)],
        State::Disconnecting(CloseReason::Unreachable(0)),
        &[A::Disconnect, A::SetDeadline(Step::Disconnect)],
    );
}

both!(
    the_close_handshake_disconnects_once_answered,
    disconnect_timeout_moves_to_draining,
    drain_timeout_closes_with_the_original_reason,
    stale_timeouts_while_closing_are_ignored
);
