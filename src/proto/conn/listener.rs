//! The listener: waits for connect requests and never moves data.

use super::CmEventKind;

/// What the reactor must do for a listener.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ListenerAction {
    /// Hand the connect request to the user (accept or reject).
    Incoming,
    /// Report a problem to the user; the listener keeps listening.
    Report(String),
    /// The listener is over (device removed or closed): destroy its id at the end of the tick.
    Closed(super::CloseReason),
    /// Nothing to do.
    None,
}

/// Listener state machine: listening until closed or its device goes away.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listener {
    closed: bool,
}

impl Default for Listener {
    fn default() -> Self {
        Self::new()
    }
}

impl Listener {
    /// A listener that is bound and listening.
    pub fn new() -> Self {
        Listener { closed: false }
    }

    /// True once closed.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// An rdma_cm event on the listening id.
    pub fn on_cm(&mut self, event: CmEventKind, status: i32) -> ListenerAction {
        if self.closed {
            // A connect request queued before the close: the reactor rejects it.
            return ListenerAction::None;
        }
        match event {
            CmEventKind::ConnectRequest => ListenerAction::Incoming,
            CmEventKind::DeviceRemoval => {
                self.closed = true;
                ListenerAction::Closed(super::CloseReason::DeviceRemoval)
            }
            CmEventKind::AddrChange | CmEventKind::TimewaitExit => ListenerAction::None,
            other => ListenerAction::Report(format!("unexpected {other:?} (status {status}) on a listener")),
        }
    }

    /// The user closed the listener.
    #[cfg(test)]
    pub fn close(&mut self) -> ListenerAction {
        self.close_for(super::CloseReason::Local)
    }

    /// The reactor closes the listener, for `reason` (a shutdown).
    pub fn close_for(&mut self, reason: super::CloseReason) -> ListenerAction {
        if self.closed {
            return ListenerAction::None;
        }
        self.closed = true;
        ListenerAction::Closed(reason)
    }
}
