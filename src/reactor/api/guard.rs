//! The callback boundary: how the reactor calls a handler, and what a panic in one does.
//!
//! # Panics in callbacks
//!
//! A panic in a user callback is caught at the callback's boundary (`Core::call_conn`, which
//! `Core::with_conn` and the completion paths use, `Core::with_listener`, `Core::deliver`), the
//! handler stays with its object, and the tick runs to its end (the rest of the polled batch,
//! timers, posts, acks, destruction), so the reactor stays consistent and nothing is lost; then
//! the first panic of the tick resumes out of `run_once` (the reactor does not swallow it).
//! Dropping the reactor discards a panic caught during its shutdown.
//!
//! # Where a handler lies while it runs
//!
//! A connection's handler stays in its entry for the call ([`Core::call_conn`]): the entry
//! owns it through a raw pointer ([`Guarded`]), the call reaches it through a copy of that
//! pointer ([`HandlerRef`]) while the handler's context borrows the whole core. Taking it out
//! and putting it back cost two look-ups a call (issue 47). **Why `unsafe` here, outside
//! `src/sys/`**: what it guards is the reactor's own rule (one call of a handler at a time, its
//! owner alive for the call: [`Running`]), nothing of the C libraries'.
//!
//! Commands called from callbacks run at once (`connect`, `listen`, `alloc`, a close's
//! `rdma_disconnect`); only posting (step 6) and destruction (step 8) wait for the end of the
//! tick.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;

use crate::proto::token::{ConnKey, Key, ListenerKey};
use crate::reactor::{Conn, ConnEntry, ConnectionHandler, Core, Ctx, ListenerHandler};

impl Core {
    /// Calls a connection's handler with a context, the handler left where it is (in its
    /// entry: see [`HandlerRef`]), so the context can reach every object mutably, other
    /// connections' entries included.
    ///
    /// A panic in the handler is kept and resumed at the end of the tick (see "Panics in
    /// callbacks" above).
    pub(in crate::reactor) fn with_conn(
        &mut self,
        t: ConnKey,
        f: impl FnOnce(&mut dyn ConnectionHandler, &mut Conn<'_>),
    ) {
        let Some(c) = self.conns.get_mut(t) else { return };
        let Some(h) = callable(c, t, &self.handlers_running) else { return };
        #[allow(unsafe_code)]
        // SAFETY: `h` is `callable`'s, on `t`'s entry, just now.
        unsafe {
            self.call_conn(t, h, f);
        }
    }

    /// [`Core::with_conn`], with `first` run on the connection's entry in the lookup that
    /// finds its handler (a completion's metering) and `last` after the handler, in a lookup of
    /// its own, with the tick's list of connections to post (`list_dirty`). Neither runs for a
    /// connection that is gone. When its handler cannot be called (a callback of its own is
    /// running), both run at once. The completion paths of `data/cq/mod.rs` do their work
    /// before the call and need no `last`: this is for the shared receive queue's.
    pub(in crate::reactor) fn with_conn_between(
        &mut self,
        t: ConnKey,
        first: impl FnOnce(&mut ConnEntry),
        f: impl FnOnce(&mut dyn ConnectionHandler, &mut Conn<'_>),
        last: impl FnOnce(&mut ConnEntry, &mut Vec<ConnKey>),
    ) {
        let Some(c) = self.conns.get_mut(t) else { return };
        first(c);
        let Some(h) = callable(c, t, &self.handlers_running) else {
            return last(c, &mut self.work.dirty);
        };
        #[allow(unsafe_code)]
        // SAFETY: `h` is `callable`'s, on `t`'s entry, just now.
        unsafe {
            self.call_conn(t, h, f);
        }
        if let Some(c) = self.conns.get_mut(t) {
            last(c, &mut self.work.dirty);
        }
    }

    /// Calls connection `t`'s handler `h` under a panic guard: the one place a connection
    /// handler is called from while its connection lives. The connection is on the stack of
    /// running calls ([`Running`]) for the call, so no callback of its own runs inside it.
    ///
    /// # Safety
    ///
    /// `h` is what [`callable`] returned for connection `t`'s entry, with no handler called
    /// and no connection destroyed since (the caller's look-up of the entry, then this call).
    #[inline]
    #[allow(unsafe_code)]
    pub(in crate::reactor) unsafe fn call_conn(
        &mut self,
        t: ConnKey,
        h: HandlerRef,
        f: impl FnOnce(&mut dyn ConnectionHandler, &mut Conn<'_>),
    ) {
        self.handlers_running.enter(t);
        let r = catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: `h` is the address of the handler owned by connection `t`'s entry
            // (`Guarded`, a raw owner: nothing moving the entry or the table asserts
            // uniqueness over it), fresh from `callable` (the contract above), so the entry
            // and its handler are alive now. It stays allocated for the call: an entry's
            // handler is never replaced, and the one teardown that could drop it while it runs
            // (`destroy_conn`) parks it instead while `t` is on the stack of running calls
            // (`Running::park`), freed only once the stack is empty. No other reference to it
            // exists during the call: a handler is reached only through `call_conn` (after
            // `callable` refused a connection on the stack, as `t` now is) or, once its entry
            // is gone, by the teardown that owns it; `Conn` reaches the core, never a handler.
            let h = unsafe { &mut *h.0.as_ptr() };
            f(h, &mut Conn::new(self, t));
        }));
        // After the guard: a panic in the handler is caught above, so the stack is always
        // popped.
        self.handlers_running.leave();
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

/// Connection `t`'s handler, if it can be called now: it has one (teardown takes it), and no
/// callback of its own is running (`running`). Read in the look-up that does the rest of the
/// caller's work on the entry `c`; called with [`Core::call_conn`].
#[inline]
pub(in crate::reactor) fn callable(c: &ConnEntry, t: ConnKey, running: &Running) -> Option<HandlerRef> {
    let h = c.handler.as_ref()?;
    if running.is_running(t) {
        return None;
    }
    Some(HandlerRef(h.0))
}

/// The address of a connection's handler, for one call ([`Core::call_conn`], which consumes
/// it): the handler stays in its entry (the plan's "handlers beside the connection table",
/// kept in the entry: no take-out and put-back look-ups around a call). Neither `Copy` nor
/// `Clone`: one address, one call.
pub(in crate::reactor) struct HandlerRef(NonNull<dyn ConnectionHandler>);

/// The connections whose handler is running, innermost last, and the handlers of those
/// destroyed meanwhile (`Core::handlers_running`).
#[derive(Default)]
pub(in crate::reactor) struct Running {
    running: Vec<ConnKey>,
    /// Handlers of connections destroyed while their call ran (`conn/teardown.rs`), dropped
    /// once no call runs. Empty outside such a call.
    parked: Vec<Guarded<dyn ConnectionHandler>>,
}

impl Running {
    /// Connection `t`'s handler is being called.
    #[inline]
    pub(in crate::reactor) fn enter(&mut self, t: ConnKey) {
        self.running.push(t);
    }

    /// The innermost call returned (or panicked). Once no call runs, the parked handlers are
    /// dropped (each under its own guard, `Guarded`'s `Drop`).
    #[inline]
    pub(in crate::reactor) fn leave(&mut self) {
        self.running.pop();
        if !self.parked.is_empty() && self.running.is_empty() {
            self.parked.clear();
        }
    }

    /// True while connection `t`'s handler runs.
    #[inline]
    pub(in crate::reactor) fn is_running(&self, t: ConnKey) -> bool {
        self.running.contains(&t)
    }

    /// Keeps `handler`, whose connection is being destroyed while its call runs, until no
    /// call runs.
    pub(in crate::reactor) fn park(&mut self, handler: Guarded<dyn ConnectionHandler>) {
        self.parked.push(handler);
    }
}

/// A user handler, boxed, whose `Drop` runs under a panic guard: a panic in it is caught and
/// resumed at the end of the tick like a callback's, so it cannot unwind out of the reactor's
/// bookkeeping (a reap that stopped half way would leave the rest of the closing connections
/// without `on_closed` or destruction until shutdown: the hostile review's finding 8). Every
/// connection and listener handler is held in one, wherever it is dropped.
///
/// It owns the handler through a raw pointer (from `Box::leak`, back to a `Box` only in
/// `Drop`), not a `Box`: a connection's handler is called where it lies while the core, its
/// entry included, is borrowed mutably by the handler's context ([`Core::call_conn`]), and the
/// reactor reads the handler's address from its entry during that call (`callable`, refusing a
/// nested call): through a `Box` that read is a reborrow of the handler under its own `&mut`
/// (Miri reports Undefined Behavior; a test below does it with this type, which Miri passes);
/// through the raw pointer it is a copy.
pub(crate) struct Guarded<T: ?Sized>(NonNull<T>);

impl<T: ?Sized> Guarded<T> {
    pub(in crate::reactor) fn new(handler: Box<T>) -> Guarded<T> {
        Guarded(NonNull::from(Box::leak(handler)))
    }
}

impl<T: ?Sized> std::ops::Deref for Guarded<T> {
    type Target = T;

    fn deref(&self) -> &T {
        // SAFETY: the pointer came from a live `Box` this value owns until `Drop`; a shared
        // borrow of `self` excludes the unique one `call_conn` makes only of a handler whose
        // owner it does not borrow (the entry stays in the table, untouched, for the call).
        #[allow(unsafe_code)]
        unsafe {
            self.0.as_ref()
        }
    }
}

impl<T: ?Sized> std::ops::DerefMut for Guarded<T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as `deref`; the reactor borrows a connection's handler through its owner
        // only once it owns it alone (a teardown that took it out of its entry, after
        // `destroy_conn` checked that no call of it runs), and a listener's always so.
        #[allow(unsafe_code)]
        unsafe {
            self.0.as_mut()
        }
    }
}

impl<T: ?Sized> Drop for Guarded<T> {
    fn drop(&mut self) {
        // SAFETY: the pointer came from `Box::leak` in `new` and is turned back into its box
        // once, here; no call of the handler runs (see `Core::call_conn` on parking).
        #[allow(unsafe_code)]
        let handler = unsafe { Box::from_raw(self.0.as_ptr()) };
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

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::rc::Rc;

    use super::{callable, Guarded, Running, DROP_PANIC, DROP_PANICKED};
    use crate::proto::conn::Client;
    use crate::proto::token::{ConnKey, GenSlab, Key};
    use crate::reactor::conn::entry::{ConnEntry, Role};
    use crate::reactor::{Completion, Conn, ConnectionHandler};

    /// Counts its drops in `drops`; panics in `Drop` when `panic_on_drop`.
    struct Counted {
        drops: Rc<Cell<u32>>,
        panic_on_drop: bool,
    }

    impl ConnectionHandler for Counted {
        fn on_completion(&mut self, _: &mut Conn<'_>, _: Completion) {}
    }

    impl Drop for Counted {
        fn drop(&mut self) {
            self.drops.set(self.drops.get() + 1);
            if self.panic_on_drop {
                panic!("a handler's drop panics");
            }
        }
    }

    fn running(keys: &[ConnKey]) -> Running {
        let mut r = Running::default();
        for &k in keys {
            r.enter(k);
        }
        r
    }

    fn entry(drops: &Rc<Cell<u32>>, panic_on_drop: bool) -> ConnEntry {
        let h = Counted { drops: drops.clone(), panic_on_drop };
        ConnEntry::new(Role::Client(Client::resolving().0), Box::new(h), 16, Default::default())
    }

    /// A handler is callable only while it is in its entry and no call of its own runs: the
    /// stack of running calls names connections by key, so another connection's call (or one of
    /// an earlier connection at the same slot) does not refuse it.
    #[test]
    fn a_handler_is_not_callable_inside_its_own_call() {
        let drops = Rc::new(Cell::new(0));
        let mut conns: GenSlab<ConnKey, ConnEntry> = GenSlab::new();
        let a = conns.insert(entry(&drops, false));
        let b = conns.insert(entry(&drops, false));
        assert!(callable(conns.get(a).unwrap(), a, &running(&[])).is_some());
        assert!(callable(conns.get(a).unwrap(), a, &running(&[b])).is_some(), "another connection's call runs");
        assert!(callable(conns.get(a).unwrap(), a, &running(&[b, a])).is_none(), "its own call runs");
        assert!(callable(conns.get(b).unwrap(), b, &running(&[b])).is_none());
        // Slot a again, another generation: a call of the old connection does not refuse it.
        conns.remove(a);
        let a2 = conns.insert(entry(&drops, false));
        assert_eq!(a2.token().index(), a.token().index());
        assert!(callable(conns.get(a2).unwrap(), a2, &running(&[a])).is_some());
        // Taken by teardown: nothing to call.
        let taken = conns.get_mut(b).unwrap().handler.take();
        assert!(callable(conns.get(b).unwrap(), b, &running(&[])).is_none());
        drop(taken);
        assert_eq!(drops.get(), 2, "a and b's handlers dropped once each");
        drop(conns);
        assert_eq!(drops.get(), 3);
    }

    /// `Guarded` owns its handler through a raw pointer: dropped exactly once, with its entry or
    /// wherever it was moved, and a panic in its `Drop` is kept for the tick (not unwound into
    /// the reactor's bookkeeping).
    #[test]
    fn a_guarded_handler_is_dropped_once_and_its_drop_panic_is_kept() {
        let drops = Rc::new(Cell::new(0));
        let g: Guarded<dyn ConnectionHandler> =
            Guarded::new(Box::new(Counted { drops: drops.clone(), panic_on_drop: false }));
        let moved = vec![g];
        assert_eq!(drops.get(), 0);
        drop(moved);
        assert_eq!(drops.get(), 1);

        let g: Guarded<dyn ConnectionHandler> =
            Guarded::new(Box::new(Counted { drops: drops.clone(), panic_on_drop: true }));
        drop(g);
        assert_eq!(drops.get(), 2);
        assert!(DROP_PANICKED.with(|f| f.replace(false)), "the panic is flagged for the tick");
        let panic = DROP_PANIC.with(|p| p.borrow_mut().take()).expect("kept");
        assert_eq!(panic.downcast_ref::<&str>(), Some(&"a handler's drop panics"));
    }

    /// The stack of running calls: a handler parked by a teardown inside a call (the safeguard
    /// in `destroy_conn`) outlives every call still running, and is dropped, once, when the
    /// outermost returns.
    #[test]
    fn a_parked_handler_is_dropped_when_the_outermost_call_returns() {
        let drops = Rc::new(Cell::new(0));
        let mut conns: GenSlab<ConnKey, ConnEntry> = GenSlab::new();
        let a = conns.insert(entry(&drops, false));
        let b = conns.insert(entry(&drops, false));
        let mut r = Running::default();
        r.enter(a);
        r.enter(b);
        assert!(r.is_running(a) && r.is_running(b));
        let h = conns.get_mut(b).unwrap().handler.take().expect("b's handler");
        r.park(h);
        r.leave();
        assert!(!r.is_running(b) && r.is_running(a));
        assert_eq!(drops.get(), 0, "a call still runs: the parked handler is kept");
        r.leave();
        assert!(!r.is_running(a));
        assert_eq!(drops.get(), 1, "no call runs: dropped");
        r.leave();
        assert_eq!(drops.get(), 1, "dropped once");
    }

    /// What `Core::call_conn` does, in a form Miri can check (`cargo +nightly miri test --lib
    /// api::guard`): a handler is called through the address its owner (`Guarded`) holds, while
    /// the table holding the owner is borrowed mutably by the call and grows (the owner moved
    /// by a reallocation, as a connection table growing under `Ctx::connect` moves its entries),
    /// and the handler reads and writes its own state after that.
    #[test]
    fn a_handler_called_through_its_address_survives_its_table_growing() {
        trait Bump {
            fn bump(&mut self, table: &mut Vec<Option<Guarded<dyn Bump>>>);
            fn count(&self) -> u32;
        }
        struct Grower(u32);
        impl Bump for Grower {
            fn bump(&mut self, table: &mut Vec<Option<Guarded<dyn Bump>>>) {
                self.0 += 1;
                for _ in 0..64 {
                    table.push(Some(Guarded::new(Box::new(Grower(0)))));
                }
                // Its address read from its owner during its call, as `callable` reads it to
                // refuse a nested call: a copy of the pointer. (With a `Box` for the owner, the
                // address read through it is a reborrow of the handler under its own `&mut`:
                // Miri reports Undefined Behavior.)
                let again = table[0].as_ref().expect("present").0;
                assert!(std::ptr::addr_eq(again.as_ptr(), self as *mut Grower));
                // Its own owner has moved; its memory has not.
                self.0 += 1;
            }
            fn count(&self) -> u32 {
                self.0
            }
        }
        let mut table: Vec<Option<Guarded<dyn Bump>>> = Vec::with_capacity(1);
        table.push(Some(Guarded::new(Box::new(Grower(0)))));
        for round in 1..=3 {
            let h = table[0].as_ref().expect("present").0;
            // SAFETY: as in `call_conn`: the owner stays in the table for the call, is never
            // replaced or dropped during it, and nothing else reaches the handler meanwhile.
            #[allow(unsafe_code)]
            let handler = unsafe { &mut *h.as_ptr() };
            handler.bump(&mut table);
            assert_eq!(table[0].as_ref().expect("present").count(), 2 * round);
        }
        assert_eq!(table.len(), 1 + 3 * 64);
    }
}
