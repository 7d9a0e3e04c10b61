//! The callback boundary: how the reactor calls a handler, and what a panic in one does.
//!
//! # Panics in callbacks
//!
//! A panic in a user callback is caught at the callback's boundary (`Core::with_conn`,
//! `Core::with_listener`, `Core::deliver`), the handler stays with its object, and the tick
//! runs to its end (the rest of the polled batch, timers, posts, acks, destruction), so the
//! reactor stays consistent and nothing is lost; then the first panic of the tick resumes out
//! of `run_once` (the reactor does not swallow it). Dropping the reactor discards a panic
//! caught during its shutdown.
//!
//! Commands called from callbacks run at once (`connect`, `listen`, `alloc`, a close's
//! `rdma_disconnect`); only posting (step 6) and destruction (step 8) wait for the end of the
//! tick.

use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::proto::token::{ConnKey, Key, ListenerKey};
use crate::reactor::{Conn, ConnEntry, ConnectionHandler, Core, Ctx, ListenerHandler};

impl Core {
    /// Calls a connection's handler with a context. The handler is taken out of its entry for
    /// the call, so the context can reach every other object mutably.
    ///
    /// A panic in the handler is resumed after the handler is back in its entry, so the
    /// connection keeps its handler (see "Panics in callbacks" above).
    pub(in crate::reactor) fn with_conn(
        &mut self,
        t: ConnKey,
        f: impl FnOnce(&mut dyn ConnectionHandler, &mut Conn<'_>),
    ) {
        self.with_conn_between(t, |_| {}, f, |_, _| {});
    }

    /// [`Core::with_conn`], with `first` run on the connection's entry in the lookup that
    /// takes its handler (a completion's metering) and `last` in the lookup that puts it back,
    /// with the tick's list of connections to post (`list_dirty`): what a completion leaves
    /// to do is seen without a lookup of its own (issue 33). Neither runs for a connection
    /// that is gone. When its handler is out (a callback of its own is running), both run at
    /// once; otherwise `last` runs after the handler, if the connection is still there.
    #[inline]
    pub(in crate::reactor) fn with_conn_between(
        &mut self,
        t: ConnKey,
        first: impl FnOnce(&mut ConnEntry),
        f: impl FnOnce(&mut dyn ConnectionHandler, &mut Conn<'_>),
        last: impl FnOnce(&mut ConnEntry, &mut Vec<ConnKey>),
    ) {
        let Some(c) = self.conns.get_mut(t) else { return };
        first(c);
        let Some(mut h) = c.handler.take() else {
            return last(c, &mut self.work.dirty);
        };
        let r = catch_unwind(AssertUnwindSafe(|| {
            let mut conn = Conn::new(self, t);
            f(&mut *h, &mut conn);
        }));
        if let Some(c) = self.conns.get_mut(t) {
            c.handler = Some(h);
            last(c, &mut self.work.dirty);
        }
        self.caught(r);
    }

    pub(in crate::reactor) fn with_listener(
        &mut self,
        t: ListenerKey,
        f: impl FnOnce(&mut dyn ListenerHandler, &mut Ctx<'_>),
    ) {
        let Some(mut h) = self.listeners.get_mut(t).and_then(|l| l.handler.take()) else { return };
        let r = catch_unwind(AssertUnwindSafe(|| {
            let mut ctx = Ctx::new(self, Some(t.token()));
            f(&mut *h, &mut ctx);
        }));
        if let Some(l) = self.listeners.get_mut(t) {
            l.handler = Some(h);
        }
        self.caught(r);
    }

    /// Calls a callback outside any entry (a destroyed object's handler, a user function),
    /// catching its panic for the end of the tick.
    pub(in crate::reactor) fn deliver(&mut self, f: impl FnOnce(&mut Core)) {
        let r = catch_unwind(AssertUnwindSafe(|| f(self)));
        self.caught(r);
    }

    /// Keeps the first panic of the tick; it resumes at the end of `run_once`.
    pub(in crate::reactor) fn caught(&mut self, r: std::thread::Result<()>) {
        if let Err(panic) = r {
            self.panic.get_or_insert(panic);
        }
    }

    /// Adds a panic a handler's `Drop` raised during the tick (caught by [`Guarded`]) to the
    /// tick's panics.
    pub(in crate::reactor) fn keep_drop_panic(&mut self) {
        // The flag first: a plain thread-local load on every tick, the slot only after a drop
        // panicked.
        if !DROP_PANICKED.try_with(|f| f.replace(false)).unwrap_or(false) {
            return;
        }
        // try_with: a reactor dropped by a thread-local's destructor may run after this
        // thread-local was destroyed; `with` would panic there, and a panic in a thread-local's
        // destructor aborts the process.
        if let Some(panic) = DROP_PANIC.try_with(|p| p.borrow_mut().take()).ok().flatten() {
            self.panic.get_or_insert(panic);
        }
    }
}

thread_local! {
    /// The first panic a user handler's `Drop` raised on this thread ([`Guarded`]), until the
    /// reactor ticking here takes it at the end of its tick.
    static DROP_PANIC: std::cell::RefCell<Option<Box<dyn std::any::Any + Send>>> = const { std::cell::RefCell::new(None) };
    /// `DROP_PANIC` holds a panic: set with it, cleared by the tick that takes it.
    static DROP_PANICKED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A user handler, boxed, whose `Drop` runs under a panic guard: a panic in it is caught and
/// resumed at the end of the tick like a callback's, so it cannot unwind out of the reactor's
/// bookkeeping (a reap that stopped half way would leave the rest of the closing connections
/// without `on_closed` or destruction until shutdown: the hostile review's finding 8). Every
/// connection and listener handler is held in one, wherever it is dropped.
pub(crate) struct Guarded<T: ?Sized>(Option<Box<T>>);

impl<T: ?Sized> Guarded<T> {
    pub(in crate::reactor) fn new(handler: Box<T>) -> Guarded<T> {
        Guarded(Some(handler))
    }
}

impl<T: ?Sized> std::ops::Deref for Guarded<T> {
    type Target = T;

    fn deref(&self) -> &T {
        self.0.as_deref().expect("present until dropped")
    }
}

impl<T: ?Sized> std::ops::DerefMut for Guarded<T> {
    fn deref_mut(&mut self) -> &mut T {
        self.0.as_deref_mut().expect("present until dropped")
    }
}

impl<T: ?Sized> Drop for Guarded<T> {
    fn drop(&mut self) {
        if let Some(handler) = self.0.take() {
            if let Err(panic) = catch_unwind(AssertUnwindSafe(move || drop(handler))) {
                // Past the thread-local's destruction (a reactor in a thread-local being
                // dropped), the panic has nowhere to go and is discarded.
                let _ = DROP_PANIC.try_with(|p| {
                    p.borrow_mut().get_or_insert(panic);
                });
                let _ = DROP_PANICKED.try_with(|f| f.set(true));
            }
        }
    }
}
