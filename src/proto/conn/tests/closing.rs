//! Work errors, close, shutdown, setup failures and `Drained`.

use super::*;

// ------------------------------------------------------------------------------------------
// Work errors, close, shutdown, setup failures, drained
// ------------------------------------------------------------------------------------------

/// A work error while established disconnects and closes with that status after the drain.
fn work_error_while_established<M: Machine>() {
    let w = WcStatus::RetryExcErr;
    let m = check(
        established::<M>(),
        &[Input::WorkError(w)],
        State::Disconnecting(CloseReason::WorkError(w)),
        &[A::Disconnect, A::SetDeadline(Step::Disconnect)],
    );
    // The flushes and errors that follow change nothing.
    let m = check(m, &[Input::WorkError(WcStatus::FatalErr)], State::Disconnecting(CloseReason::WorkError(w)), &[]);
    let m = check(
        m,
        &[cm(K::Disconnected)],
        State::Draining(CloseReason::WorkError(w)),
        &[A::ClearDeadline, A::SetDeadline(Step::Drain)],
    );
    let m = check(m, &[Input::WorkError(WcStatus::GeneralErr)], State::Draining(CloseReason::WorkError(w)), &[]);
    let m = check(m, &[Input::Drained], State::Closed, &closed(CloseReason::WorkError(w)));
    assert!(feed_all(m, &[Input::WorkError(w)]).1.is_empty());
}

/// A work error does not override a close already under way.
fn work_error_while_closing_is_ignored<M: Machine>() {
    let w = Input::WorkError(WcStatus::LocProtErr);
    let m = check(established::<M>(), &[Input::Close, w.clone()], State::Disconnecting(CloseReason::Local), &[]);
    check(m, &[cm(K::Disconnected), w.clone(), Input::Drained], State::Closed, &closed(CloseReason::Local));
    let m = check(established::<M>(), &[cm(K::Disconnected), w], State::Draining(CloseReason::Peer), &[]);
    check(m, &[Input::Drained], State::Closed, &closed(CloseReason::Peer));
}

/// Close while established, then again at every later stage: only the first one acts.
fn close_is_idempotent<M: Machine>() {
    let m = check(
        established::<M>(),
        &[Input::Close],
        State::Disconnecting(CloseReason::Local),
        &[A::Disconnect, A::SetDeadline(Step::Disconnect)],
    );
    let m = check(m, &[Input::Close], State::Disconnecting(CloseReason::Local), &[]);
    let m = check(m, &[cm(K::Disconnected), Input::Close], State::Draining(CloseReason::Local), &[]);
    let m = check(m, &[Input::Drained], State::Closed, &closed(CloseReason::Local));
    check(m, &[Input::Close], State::Closed, &[]);
}

/// Close before establishment closes at once; a second close does nothing.
fn close_before_established<M: Machine>() {
    for (name, path) in M::early_paths() {
        let (m, _) = feed_all(fresh::<M>(), &path);
        let (m, last) = feed_all(m, &[Input::Close]);
        assert_eq!((m.st(), last), (&State::Closed, closed(CloseReason::Local).to_vec()), "{name}");
        assert!(feed_all(m, &[Input::Close]).1.is_empty(), "{name}");
    }
}

/// Shutdown: disconnects when established, closes at once before, ignored while closing.
fn shutdown<M: Machine>() {
    let m = check(
        established::<M>(),
        &[Input::Shutdown],
        State::Disconnecting(CloseReason::Shutdown),
        &[A::Disconnect, A::SetDeadline(Step::Disconnect)],
    );
    let m = check(m, &[Input::Close, Input::Shutdown], State::Disconnecting(CloseReason::Shutdown), &[]);
    let m = check(m, &[cm(K::Disconnected), Input::Drained], State::Closed, &closed(CloseReason::Shutdown));
    assert!(CloseReason::Shutdown.is_clean());
    assert!(feed_all(m, &[Input::Shutdown]).1.is_empty());
    for (name, path) in M::early_paths() {
        let (m, last) = feed_all(fresh::<M>(), [path, vec![Input::Shutdown]].concat());
        assert_eq!((m.st(), last), (&State::Closed, closed(CloseReason::Shutdown).to_vec()), "{name}");
    }
    // Close first, shutdown later: the reason stays Local.
    let (m, _) = feed_all(established::<M>(), &[Input::Close, Input::Shutdown]);
    assert_eq!(m.st(), &State::Disconnecting(CloseReason::Local));
}

/// A failed verb before establishment closes with `Setup`.
fn setup_failed_before_established<M: Machine>() {
    for (name, path) in M::early_paths() {
        let (m, _) = feed_all(fresh::<M>(), &path);
        let (m, last) = feed_all(m, &[Input::SetupFailed("ibv_create_qp: ENOMEM".into())]);
        let want = closed(CloseReason::Setup("ibv_create_qp: ENOMEM".into()));
        assert_eq!((m.st(), last), (&State::Closed, want.to_vec()), "{name}");
    }
    assert_eq!(CloseReason::Setup("x".into()).to_string(), "setup failed: x");
}

/// A failed `rdma_disconnect` (the only verb asked for while closing) changes nothing: the
/// deadline still runs.
fn setup_failed_while_closing_is_ignored<M: Machine>() {
    let f = Input::SetupFailed("rdma_disconnect: EIO".into());
    let m = check(established::<M>(), &[Input::Close, f.clone()], State::Disconnecting(CloseReason::Local), &[]);
    check(m, &[cm(K::Disconnected), f.clone()], State::Draining(CloseReason::Local), &[]);
    check(established::<M>(), &[cm(K::Disconnected), f], State::Draining(CloseReason::Peer), &[]);
}

/// The machines ask for no verb while established, so a SetupFailed then is a protocol error.
fn setup_failed_while_established_is_protocol<M: Machine>() {
    let f = Input::SetupFailed("late".into());
    check(
        established::<M>(),
        [f.clone()],
        State::Disconnecting(proto(&State::Established, &f)),
        &[A::Disconnect, A::SetDeadline(Step::Disconnect)],
    );
}

/// A work error before establishment (e.g. a first receive failing) closes at once.
fn work_error_before_established<M: Machine>() {
    for (name, path) in M::early_paths() {
        let (m, last) = feed_all(fresh::<M>(), [path, vec![Input::WorkError(WcStatus::LocLenErr)]].concat());
        let want = closed(CloseReason::WorkError(WcStatus::LocLenErr));
        assert_eq!((m.st(), last), (&State::Closed, want.to_vec()), "{name}");
    }
}

/// `Drained` only means something while draining.
fn drained_outside_draining_is_ignored<M: Machine>() {
    for (name, path) in paths::<M>() {
        let (m, _) = feed_all(fresh::<M>(), &path);
        if m.st().is_draining() {
            continue;
        }
        let before = m.st().clone();
        let (m, last) = feed_all(m, &[Input::Drained]);
        assert_eq!((m.st(), last), (&before, vec![]), "{name}");
    }
}

both!(
    work_error_while_established,
    work_error_while_closing_is_ignored,
    close_is_idempotent,
    close_before_established,
    shutdown,
    setup_failed_before_established,
    setup_failed_while_closing_is_ignored,
    setup_failed_while_established_is_protocol,
    work_error_before_established,
    drained_outside_draining_is_ignored,
);
