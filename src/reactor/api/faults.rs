//! Fault injection (feature `fault-injection`, for tests): the `Reactor::inject_*` calls and the
//! faults they arm, each taken once by the code it breaks.

use crate::reactor::Reactor;

/// The faults armed and not yet taken.
#[derive(Default)]
pub(in crate::reactor) struct Faults {
    /// A fault injected by a test (`fault-injection` feature): the next CQ is created with at
    /// most this many entries while its room is accounted for what was asked.
    pub(in crate::reactor) short_cq: Option<u32>,
    /// A fault injected by a test (`fault-injection` feature): the next queue pair is taken
    /// as granted at most this many receive work requests (a device granting fewer than asked).
    pub(in crate::reactor) short_rq: Option<u32>,
    /// A fault injected by a test (`fault-injection` feature): in the next send chain longer
    /// than this, the request at this index is one the device refuses.
    pub(in crate::reactor) refuse_send: Option<usize>,
    /// A fault injected by a test (`fault-injection` feature): in the next receive run longer
    /// than this, the request at this index and the ones after it are refused.
    pub(in crate::reactor) refuse_recv: Option<u32>,
    /// A fault injected by a test (`fault-injection` feature): the next connection whose
    /// farewell is answered never calls `rdma_disconnect`.
    pub(in crate::reactor) silent_parting: bool,
    /// A test's choice (`fault-injection` feature): every CQ is polled before it is armed
    /// after the tick's posts, as on a device whose arm may raise an event for completions
    /// already queued (`Caps::arm_sees_only_new` false), so the VM's rxe and siw run that
    /// order too.
    pub(in crate::reactor) poll_before_arm: bool,
}

impl Reactor {
    /// Hidden and unstable, behind the `fault-injection` feature, for the fault suite only:
    /// the next CQ this reactor creates gets at most `entries` entries from the device while
    /// its room is accounted for the entries it asked for, so real traffic can overrun it
    /// and the device raise a real `IBV_EVENT_CQ_ERR` (FAULTS.md, case 23).
    #[doc(hidden)]
    pub fn inject_short_cq(&mut self, entries: u32) {
        self.core.faults.short_cq = Some(entries);
    }

    /// Hidden and unstable, behind the `fault-injection` feature, for the fault suite only:
    /// the next queue pair this reactor creates is taken as granted at most `max_recv_wr`
    /// receive work requests, as a device that grants fewer than asked would (rxe grants what
    /// is asked), while its CQ room was committed for what was asked (the hostile review's
    /// finding 9).
    #[doc(hidden)]
    pub fn inject_short_rq(&mut self, max_recv_wr: u32) {
        self.core.faults.short_rq = Some(max_recv_wr);
    }

    /// Hidden and unstable, behind the `fault-injection` feature, for the fault suite only: in
    /// the next send chain this reactor posts with more than `index` requests, the request at
    /// `index` is marked inline although it is larger than the queue pair's inline limit, so
    /// the device refuses it in `ibv_post_send` (`EINVAL` on rxe) after taking the ones before
    /// it (FAULTS.md, case 18). The message must be larger than the inline limit.
    #[doc(hidden)]
    pub fn inject_refused_send(&mut self, index: usize) {
        self.core.faults.refuse_send = Some(index);
    }

    /// Hidden and unstable, behind the `fault-injection` feature, for the fault suite only: in
    /// the next receive run this reactor posts with more than `index` requests, the request at
    /// `index` is refused, as a device that takes the ones before it and refuses it in
    /// `ibv_post_recv` would. The reactor cannot build a receive rxe refuses (a scatter entry
    /// beyond the queue pair's limit would have the provider read memory that is not a request),
    /// so the refusal is the reactor's own: it posts the first `index` requests of the run and
    /// takes the post as refused there with `EINVAL`; what follows is the reactor's handling of
    /// a real refusal (the receive counterpart of [`Reactor::inject_refused_send`], FAULTS.md,
    /// case 18).
    #[doc(hidden)]
    pub fn inject_refused_recv(&mut self, index: u32) {
        self.core.faults.refuse_recv = Some(index);
    }

    /// Hidden and unstable, behind the `fault-injection` feature, for the fault suite only: the
    /// next connection of this reactor whose farewell its peer answers (the close handshake)
    /// skips its `rdma_disconnect` and waits in `Disconnecting`, as a peer whose kernel dropped
    /// its stream without a word looks from the other end (FAULTS.md, iWARP, "a peer that said
    /// goodbye and never disconnected").
    #[doc(hidden)]
    pub fn inject_silent_parting(&mut self) {
        self.core.faults.silent_parting = true;
    }

    /// Hidden and unstable, behind the `fault-injection` feature, for the fault suite only:
    /// from now on this reactor polls every CQ it arms after the tick's posts before the arm
    /// too (poll, arm, poll), as on a device other than rxe and siw, so the VM tests that
    /// order of the arm/poll race (FAULTS.md, case 25).
    #[doc(hidden)]
    pub fn inject_poll_before_arm(&mut self) {
        self.core.faults.poll_before_arm = true;
    }
}
