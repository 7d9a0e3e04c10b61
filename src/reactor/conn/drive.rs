//! Driving the pure state machines: feeding a connection's machine its inputs and carrying out
//! the actions it returns.

use smallvec::SmallVec;

use crate::proto::conn::{Action, Actions, Input, State};
use crate::proto::token::ConnKey;
use crate::reactor::conn::setup::millis;
use crate::reactor::event_loop::timers::TimerTarget;
use crate::reactor::Core;

impl Core {
    /// Feeds an input to a connection's state machine and carries out the actions, including
    /// inputs those actions produce (a verb that failed) and `Drained` once a draining
    /// connection has nothing outstanding.
    pub(in crate::reactor) fn feed(&mut self, t: ConnKey, input: Input) {
        // Rarely more than one input: an action's failure, or Drained after the last one.
        let mut queue: SmallVec<[Input; 2]> = SmallVec::new();
        queue.push(input);
        while !queue.is_empty() {
            let input = queue.remove(0);
            let Some(c) = self.conns.get_mut(t) else { return };
            let was_accepting = matches!(c.role.state(), State::Accepting);
            let actions = c.role.on_input(input);
            if was_accepting && !matches!(c.role.state(), State::Accepting) {
                self.accepting = self.accepting.saturating_sub(1);
            }
            for a in actions {
                if let Some(next) = self.act(t, a) {
                    queue.push(next);
                }
            }
            if queue.is_empty() && self.conns.get(t).is_some_and(|c| c.drained()) {
                queue.push(Input::Drained);
            }
        }
    }

    /// Carries out actions a machine returned outside [`Core::feed`] (its first ones).
    pub(in crate::reactor) fn apply(&mut self, t: ConnKey, actions: Actions) {
        for a in actions {
            if let Some(next) = self.act(t, a) {
                self.feed(t, next);
            }
        }
    }

    fn act(&mut self, t: ConnKey, action: Action) -> Option<Input> {
        let timeouts = self.cfg.timeouts;
        match action {
            Action::ResolveRoute => {
                let c = self.conns.get(t)?;
                if let Err(e) = c.ep.id()?.resolve_route(millis(timeouts.resolve_route)) {
                    return Some(Input::SetupFailed(format!("rdma_resolve_route: {e}")));
                }
            }
            Action::Connect => return self.client_connect(t),
            Action::Established => {
                self.stats.established += 1;
                event!(
                    info,
                    "{:?}: established with {}",
                    crate::proto::token::Key::token(t),
                    self.conns
                        .get(t)
                        .and_then(|c| c.ep.id())
                        .and_then(|id| id.peer_addr())
                        .map_or_else(String::new, |a| a.to_string())
                );
                // Sends submitted before ESTABLISHED (a peer's first message can complete a
                // receive before the event arrives) go out now.
                self.mark_dirty(t);
                if let Some(interval) = self.cfg.keepalive {
                    self.schedule_keepalive(t, interval);
                }
                self.established_callback(t);
            }
            Action::Disconnect => {
                #[cfg(feature = "fault-injection")]
                if self.conns.get(t).is_some_and(|c| c.mute) {
                    return None;
                }
                if let Some(id) = self.conns.get(t).and_then(|c| c.ep.id()) {
                    // EINVAL (already disconnected) is success; any other failure still ends
                    // in DISCONNECTED or the disconnect deadline.
                    let _ = id.disconnect();
                }
            }
            Action::SetDeadline(step) => {
                let at = self.read_clock().checked_add(timeouts.of(step))?;
                let key = self.timers.schedule(at, TimerTarget::Deadline(t));
                self.conns.get_mut(t)?.deadline = Some((key, step));
            }
            Action::ClearDeadline => self.conns.get_mut(t)?.deadline = None,
            Action::SendFarewell => {
                event!(debug, "{:?}: closing: saying goodbye (close handshake)", crate::proto::token::Key::token(t));
                let c = self.conns.get_mut(t)?;
                c.lanes.say_farewell();
                self.mark_dirty(t);
            }
            Action::Closed(reason) => {
                let c = self.conns.get_mut(t)?;
                if c.close_reason.is_none() {
                    c.close_reason = Some(reason);
                    self.closing.conns.push(t);
                }
            }
        }
        None
    }
}
