//! `rdma_connect` on a thread of its own, for a transport whose call blocks.
//!
//! On iWARP, `rdma_connect` makes the TCP connection inside the call: Soft-iWARP's
//! `siw_connect` calls the kernel's blocking `kernel_connect`, which returns when the TCP
//! handshake ends, or when TCP gives up (about 2 minutes against a host that drops SYNs, at
//! Linux's default `tcp_syn_retries`). Made on the reactor's thread, that call would freeze
//! every other connection of the reactor for as long. [`Connecting`] makes it on a helper
//! thread that exists for that one call.
//!
//! **Ownership.** [`Connecting`] holds the queue pair (and so the id) while the helper runs and
//! gives no access to either: nothing else can post on the queue pair, issue a command on the
//! id (`rdma_disconnect` would wait for the kernel's `ctx->mutex`, which `ucma_connect` holds
//! for the whole call) or destroy them. [`Connecting::finish`] joins the helper before it
//! hands the queue pair back, and `Drop` joins it before the queue pair drops: the id outlives
//! every use of it on the helper, structurally.
//!
//! **Signals.** The helper is started with every signal blocked (the spawning thread blocks
//! them around `spawn`, so the helper is born with that mask) and never unblocks them: a
//! signal cannot interrupt the kernel's connect, which would close a TCP stream a Soft-iWARP
//! listener may have queued but not accepted yet and break that listener (FAULTS.md, "a signal
//! while connecting"). A process-directed signal goes to another thread. Should `EINTR` come
//! back all the same, the call is made again, as `SA_RESTART` would, until its deadline.
#![allow(unsafe_code)]

use std::io;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use nix::sys::signal::{pthread_sigmask, SigSet, SigmaskHow};
use rdma_sys as ffi;

use super::cm::ConnParam;
use super::cvt;
use super::qp::Qp;

/// The helper's stack: `rdma_connect` needs little (the work is in the kernel).
const STACK: usize = 128 * 1024;

/// What the helper returns: the call's result, and how many times a signal interrupted it.
type Outcome = (io::Result<()>, u32);

/// An `rdma_connect` in flight on a helper thread, holding the queue pair it connects.
#[derive(Debug)]
pub(crate) struct Connecting {
    /// Joined before `qp` drops (`Drop`), and by `finish`.
    call: Option<JoinHandle<Outcome>>,
    /// Taken by `finish`; while it is here nothing can use it.
    qp: Option<Qp>,
    identity: usize,
    /// Set by the helper as soon as the call has returned (before `done`).
    returned: Arc<AtomicBool>,
}

/// The id's address, moved to the helper.
struct IdPtr(NonNull<ffi::rdma_cm_id>);

// SAFETY: the pointer goes to exactly one helper thread, which makes one call with it
// (`rdma_connect`, possibly repeated after EINTR). Its owner, `Connecting::qp`, is not
// reachable while the helper runs and is dropped or handed back only after the helper was
// joined, so the id outlives that use, and the reactor issues no command on the id meanwhile.
// Once the kernel's call has returned, the reactor's thread may read and ack an event of the
// id (`rdma_get_cm_event` reads and locks the id's private part) while the helper finishes the
// library's `rdma_connect`, which after its `write` only reads fields nothing else writes
// (`connect_len`, `sync`); the fields it writes it wrote before the kernel call, before any
// event of the id could exist.
unsafe impl Send for IdPtr {}

impl Connecting {
    /// Starts `rdma_connect` on `qp`'s id with `param` on a new helper thread, retried after
    /// `EINTR` until `deadline` (for ever if `None`). `done` runs on the helper once the call
    /// has returned: it should wake the owner, which then calls [`Connecting::finish`]. If the
    /// thread cannot be started, the queue pair comes back with the error.
    pub(crate) fn start(
        qp: Qp,
        param: &ConnParam<'_>,
        deadline: Option<Instant>,
        done: impl FnOnce() + Send + 'static,
    ) -> Result<Connecting, (Qp, io::Error)> {
        let id = IdPtr(qp.id().non_null());
        let identity = qp.identity();
        let private_data = param.private_data.to_vec();
        let returned = Arc::new(AtomicBool::new(false));
        let returned_in_helper = returned.clone();
        let (responder, initiator, retry, rnr) =
            (param.responder_resources, param.initiator_depth, param.retry_count, param.rnr_retry_count);
        let body = move || {
            let id = id;
            let param = ConnParam {
                private_data: &private_data,
                responder_resources: responder,
                initiator_depth: initiator,
                retry_count: retry,
                rnr_retry_count: rnr,
            };
            let (result, interrupted) = super::restart_interrupted(deadline, || {
                let mut raw = param.raw();
                // SAFETY: the id is live until this thread is joined (`IdPtr`); `raw` and the
                // private data it points to live across the call.
                cvt(unsafe { ffi::rdma_connect(id.0.as_ptr(), &mut raw) }).map(drop)
            });
            returned_in_helper.store(true, Ordering::Release);
            done();
            (result, interrupted)
        };
        let spawned = {
            // The helper inherits this thread's mask: every signal blocked from its first
            // instruction on. Restored here at once.
            let _blocked = BlockSignals::new();
            std::thread::Builder::new().name("rdma-connect".into()).stack_size(STACK).spawn(body)
        };
        match spawned {
            Ok(call) => Ok(Connecting { call: Some(call), qp: Some(qp), identity, returned }),
            Err(e) => Err((qp, e)),
        }
    }

    /// True once the call has returned: [`Connecting::finish`] then waits at most for the
    /// helper's last instructions, never for the kernel.
    pub(crate) fn has_returned(&self) -> bool {
        self.returned.load(Ordering::Acquire)
    }

    /// The queue pair's address, as asynchronous events name it ([`Qp::identity`]).
    pub(crate) fn identity(&self) -> usize {
        self.identity
    }

    /// Waits for the call to return (at once once `done` ran) and hands back the queue pair,
    /// the call's result, and how many times a signal interrupted it.
    pub(crate) fn finish(mut self) -> (Qp, io::Result<()>, u32) {
        let (result, interrupted) = match self.call.take().map(JoinHandle::join) {
            Some(Ok(outcome)) => outcome,
            // The helper runs no code that panics; should it, the call's outcome is unknown.
            Some(Err(_)) | None => (Err(io::Error::other("the rdma_connect helper thread failed")), 0),
        };
        (self.qp.take().expect("taken only here"), result, interrupted)
    }
}

impl Drop for Connecting {
    fn drop(&mut self) {
        // The id must outlive the helper's call: wait for it (the kernel's connect returns
        // when TCP connects or gives up), then the queue pair and its id drop.
        if let Some(call) = self.call.take() {
            let _ = call.join();
        }
    }
}

/// While it lives, the calling thread's signals are blocked (`pthread_sigmask`); dropping it
/// restores the mask it found. SIGKILL and SIGSTOP cannot be blocked, and are not.
struct BlockSignals(Option<SigSet>);

impl BlockSignals {
    fn new() -> BlockSignals {
        let mut old = SigSet::empty();
        match pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&SigSet::all()), Some(&mut old)) {
            Ok(()) => BlockSignals(Some(old)),
            // Nothing blocked: the helper retries an interrupted call.
            Err(_) => BlockSignals(None),
        }
    }
}

impl Drop for BlockSignals {
    fn drop(&mut self) {
        if let Some(old) = self.0.take() {
            let _ = pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&old), None);
        }
    }
}
