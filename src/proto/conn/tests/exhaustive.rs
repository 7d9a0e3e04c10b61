//! Inputs in every state, the exhaustive walk against the spec, and random sequences.

use super::*;

// ------------------------------------------------------------------------------------------
// Inputs in every state
// ------------------------------------------------------------------------------------------

/// DEVICE_REMOVAL closes from every open state, exactly once; nothing after.
fn device_removal_in_every_state<M: Machine>() {
    for (name, path) in paths::<M>() {
        let (m, _) = feed_all(fresh::<M>(), &path);
        let was_closed = m.st().is_closed();
        let (m, last) = feed_all(m, &[Input::Cm(K::DeviceRemoval, ST)]);
        let want = if was_closed { vec![] } else { closed(CloseReason::DeviceRemoval).to_vec() };
        assert_eq!((m.st(), last), (&State::Closed, want), "{name}");
        assert!(feed_all(m, &[cm(K::DeviceRemoval)]).1.is_empty(), "{name}: second removal");
    }
}

/// TIMEWAIT_EXIT and ADDR_CHANGE never do anything.
fn timewait_exit_and_addr_change_ignored_everywhere<M: Machine>() {
    for (name, path) in paths::<M>() {
        let (m, _) = feed_all(fresh::<M>(), &path);
        let ignored =
            [cm(K::TimewaitExit), cm(K::AddrChange), Input::Cm(K::TimewaitExit, ST), Input::Cm(K::AddrChange, ST)];
        for input in ignored {
            let (m2, last) = feed_all(m.clone(), [input.clone()]);
            assert_eq!((m2.st(), last), (m.st(), vec![]), "{name}: {input:?}");
        }
    }
}

/// Once closed, however it got there, every input is ignored.
fn closed_ignores_everything<M: Machine>() {
    let mut n = 0;
    for (name, path) in paths::<M>() {
        let (m, _) = feed_all(fresh::<M>(), &path);
        if !m.st().is_closed() {
            continue;
        }
        n += 1;
        for input in alphabet() {
            let (m2, last) = feed_all(m.clone(), [input.clone()]);
            assert_eq!((m2.st(), last), (&State::Closed, vec![]), "{name}: {input:?}");
        }
    }
    assert_eq!(n, 3);
}

/// Every CM event kind (both statuses) in every named state, against the spec.
fn every_cm_event_in_every_named_state<M: Machine>() {
    for (name, path) in paths::<M>() {
        let (m, _) = feed_all(fresh::<M>(), &path);
        for k in all_kinds() {
            for s in [0, ST, 28] {
                assert_spec(&mut m.clone(), &Input::Cm(k, s), &name);
            }
        }
    }
}

both!(
    device_removal_in_every_state,
    timewait_exit_and_addr_change_ignored_everywhere,
    closed_ignores_everything,
    every_cm_event_in_every_named_state,
);

// ------------------------------------------------------------------------------------------
// Exhaustive exploration and random sequences
// ------------------------------------------------------------------------------------------

/// Breadth-first over every (machine, history) pair reachable with the whole alphabet: each
/// transition must match `spec` and keep the tracker's invariants. Returns the number of
/// distinct pairs seen and the state kinds reached.
fn explore<M: Machine>() -> (usize, Vec<&'static str>) {
    let (m, first) = M::start();
    let t = Tracker::new(&first);
    let mut seen = vec![(m.clone(), t.clone())];
    let mut queue = VecDeque::from([(m, t, Vec::<Input>::new())]);
    let mut kinds = Vec::new();
    let alphabet = alphabet();
    while let Some((m, t, path)) = queue.pop_front() {
        let kind = m.st().name();
        if !kinds.contains(&kind) {
            kinds.push(kind);
        }
        for input in &alphabet {
            let (mut m2, mut t2) = (m.clone(), t.clone());
            let before = m2.st().clone();
            let actions = assert_spec(&mut m2, input, &format_args!("after {path:?}"));
            if let Err(e) = t2.step(&before, input, &actions, m2.st()) {
                panic!("{}: {e}\n  history: {path:?}\n  input: {input:?}", M::NAME);
            }
            if !seen.contains(&(m2.clone(), t2.clone())) {
                seen.push((m2.clone(), t2.clone()));
                let mut p = path.clone();
                p.push(input.clone());
                queue.push_back((m2, t2, p));
            }
        }
    }
    (seen.len(), kinds)
}

#[test]
fn every_input_in_every_reachable_state_matches_spec_client() {
    let (n, mut kinds) = explore::<Client>();
    kinds.sort_unstable();
    let mut want = [
        "resolving address",
        "resolving route",
        "connecting",
        "established",
        "saying goodbye",
        "disconnecting",
        "draining",
        "closed",
    ];
    want.sort_unstable();
    assert_eq!(kinds, want);
    assert!(n > 50, "only {n} states explored");
}

#[test]
fn every_input_in_every_reachable_state_matches_spec_agent() {
    let (n, mut kinds) = explore::<Agent>();
    kinds.sort_unstable();
    let mut want = ["accepting", "established", "saying goodbye", "disconnecting", "draining", "closed"];
    want.sort_unstable();
    assert_eq!(kinds, want);
    assert!(n > 50, "only {n} states explored");
}

/// xorshift64*: deterministic, dependency-free.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// What rdma_cm, the user or the reactor would plausibly send next in `state`, so that random
/// walks get past establishment and through the closing states instead of dying early.
fn plausible(state: &State) -> Vec<Input> {
    match state {
        State::ResolvingAddr => vec![cm(K::AddrResolved)],
        State::ResolvingRoute => vec![cm(K::RouteResolved), Input::Timeout(Step::ResolveAddr)],
        State::Connecting | State::Accepting => vec![cm(K::Established)],
        State::Established => vec![
            cm(K::Disconnected),
            Input::Close,
            Input::Shutdown,
            Input::Finish(CloseReason::Local),
            Input::WorkError(WcStatus::RemOpErr),
            Input::Timeout(Step::Connect),
            Input::Timeout(Step::Accept),
        ],
        State::Finishing(_) => vec![
            Input::Finished,
            Input::Timeout(Step::Finish),
            cm(K::Disconnected),
            Input::Close,
            Input::Timeout(Step::Disconnect),
        ],
        State::Disconnecting(_) => vec![
            cm(K::Disconnected),
            Input::Timeout(Step::Disconnect),
            Input::WorkError(WcStatus::WrFlushErr),
            Input::Close,
        ],
        State::Draining(_) => vec![Input::Drained, Input::Timeout(Step::Drain), cm(K::TimewaitExit)],
        State::Closed => vec![Input::Close, Input::Drained],
    }
}

fn random_sequences<M: Machine>(seed: u64) {
    let all = alphabet();
    let mut rng = Rng(seed);
    let (mut established, mut draining, mut drained) = (0, 0, 0);
    for _ in 0..4000 {
        let (mut m, first) = M::start();
        let mut t = Tracker::new(&first);
        let mut history = Vec::new();
        let (mut saw_established, mut saw_draining) = (false, false);
        for _ in 0..1 + rng.below(40) {
            // Three times in four something plausible, otherwise anything at all.
            let input = if rng.below(4) == 0 {
                all[rng.below(all.len())].clone()
            } else {
                let p = plausible(m.st());
                p[rng.below(p.len())].clone()
            };
            let before = m.st().clone();
            tracked(&mut m, &mut t, &input, &history);
            history.push(input.clone());
            saw_established |= m.st().is_established();
            saw_draining |= m.st().is_draining();
            drained += usize::from(before.is_draining() && m.st().is_closed() && input == Input::Drained);
        }
        established += usize::from(saw_established);
        draining += usize::from(saw_draining);
        // Whatever happened, the lifecycle counters stay within bounds.
        assert!(t.disconnects <= 1 && t.resolve_routes <= 1 && t.connects <= 1);
        assert_eq!(t.closed, m.st().is_closed());
    }
    // Not vacuous: many walks got into the interesting states.
    assert!(established > 1000, "{established} walks reached Established");
    assert!(draining > 500, "{draining} walks reached Draining");
    assert!(drained > 200, "{drained} walks closed after a drain");
}

#[test]
fn random_sequences_keep_invariants_client() {
    random_sequences::<Client>(0x9e37_79b9_7f4a_7c15);
}

#[test]
fn random_sequences_keep_invariants_agent() {
    random_sequences::<Agent>(0xdead_beef_cafe_f00d);
}

#[test]
fn tracker_catches_a_leaked_deadline() {
    // The harness itself: a Closed batch without ClearDeadline after a SetDeadline must fail.
    let mut t = Tracker::new(&[A::SetDeadline(Step::Connect)]);
    let err = t.step(&State::Connecting, &Input::Close, &[A::Closed(CloseReason::Local)], &State::Closed);
    assert!(err.unwrap_err().contains("still armed"));
    let mut t = Tracker::new(&[A::SetDeadline(Step::Accept)]);
    let err = t.step(&State::Accepting, &Input::Timeout(Step::Accept), &[], &State::Accepting);
    assert!(err.unwrap_err().contains("nothing happened"));
}
