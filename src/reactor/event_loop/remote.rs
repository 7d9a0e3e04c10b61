//! The cross-thread handle: [`Remote`] stops a reactor or sends it `u64` messages from any
//! thread; they reach the message handler on the reactor's thread.
//!
//! # Thread model
//!
//! The reactor is single-threaded and `!Send`; this handle is the one piece shared between
//! threads. It is an `Arc` of a non-blocking, close-on-exec eventfd (in the reactor's epoll set
//! under a `Remote` token) and a `Mutex`-guarded inbox (the queued messages, a stop request,
//! and whether the reactor still exists). A sender locks the inbox, queues, unlocks, then
//! writes the eventfd; the reactor takes the lock only when the eventfd is readable: it reads
//! (resets) the eventfd *first*, then takes the whole queue. A message queued after that read
//! is followed by a write after it, so the eventfd is readable again and the message is taken
//! by a later tick: none is stranded. A reactor that nobody sends to never takes the lock, and
//! its hot path (CQ polling, posting) never touches the handle.
//!
//! When the reactor is dropped the inbox is marked closed (by `Inbox`'s `Drop`, a field of
//! `Core`): from then on [`Remote::send`] and [`Remote::stop`] return [`ReactorGone`]. The
//! eventfd itself lives as long as the last handle.
//!
//! The inbox also carries what reactors of one process pass each other, taken in the same
//! step as the messages:
//! - connect requests handed over by a spreading listener (`conn/handoff.rs`): the inbox holds the
//!   reactor's CM channel address while the reactor exists, cleared under the lock (in
//!   `Inbox`'s `Drop`, before `Core` destroys the channel), and a sender migrates an id to
//!   that channel and queues it under the same lock;
//! - asynchronous device events (`Core::share_async`): librdmacm opens each device context
//!   once per process, so every reactor on a device has the same event fd in its epoll set;
//!   the one that reads an event acts on it and queues a copy in every other reactor's inbox
//!   (found in `REACTORS`, a process-wide list of weak references), and each acts on it if it
//!   names its device and, for a queue pair or CQ, an object it has.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use nix::errno::Errno;
use nix::sys::epoll::{Epoll, EpollEvent, EpollFlags};
use nix::sys::eventfd::{EfdFlags, EventFd};

use crate::error::Result;
use crate::proto::conn::AsyncEventKind;
use crate::proto::token::{Kind, Token};
use crate::reactor::conn::handoff::Parcel;
use crate::reactor::{os, Core, Ctx, Reactor};
use crate::sys::cm::ChannelRef;
use crate::sys::device::AsyncElement;

/// Every reactor of the process, for sharing asynchronous device events (`Core::share_async`):
/// librdmacm opens each device context once per process, so every reactor on a device has the
/// same event fd in its epoll set, and the one that reads an event passes a copy to the
/// others. Locked only when a reactor is created and when an asynchronous event is read.
static REACTORS: Mutex<Vec<Weak<Shared>>> = Mutex::new(Vec::new());

/// An asynchronous event another reactor of the process read (and acked), as copied out of
/// it: the device context's address, the kind, what it names (by address).
#[derive(Clone, Copy, Debug)]
pub(in crate::reactor) struct SharedAsync {
    context: usize,
    kind: AsyncEventKind,
    element: AsyncElement,
}

/// What both sides share.
#[derive(Debug)]
struct Shared {
    efd: EventFd,
    inbox: Mutex<Queue>,
    /// The reactor's live connections, published by it at the end of a tick in which the
    /// number changed (`Balance::Fewest` reads it).
    load: AtomicUsize,
}

#[derive(Debug, Default)]
pub(in crate::reactor) struct Queue {
    messages: VecDeque<u64>,
    stop: bool,
    /// The reactor is gone.
    pub(in crate::reactor) closed: bool,
    /// The reactor's CM channel, for migrating ids to it (`conn/handoff.rs`); `None` once closed.
    pub(in crate::reactor) chan: Option<ChannelRef>,
    /// Connect requests handed to this reactor, not yet taken (`conn/handoff.rs`).
    pub(in crate::reactor) parcels: VecDeque<Parcel>,
    /// The last hand-off sequence number issued (the index of the next `Handoff` token).
    pub(in crate::reactor) handoff_seq: u32,
    /// Asynchronous device events other reactors read (`Core::share_async`).
    shared_async: Vec<SharedAsync>,
    /// Tasks of this reactor's executor woken on other threads (`event_loop/exec.rs`).
    tasks: Vec<u64>,
    /// Connections whose `rdma_connect` returned on its helper thread (`conn/connect.rs`).
    connects: Vec<u64>,
}

impl Shared {
    /// The queue; a panic in another thread while it held the lock leaves it consistent (every
    /// critical section is a push, a take or a flag), so poisoning is ignored.
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.inbox.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wake(&self) {
        // A non-blocking eventfd write fails only with EAGAIN, when the counter is at its
        // maximum: it is readable already, which is all a wakeup needs.
        let _ = self.efd.write(1);
    }
}

/// A handle to a [`Reactor`] usable from any thread: stops it, or wakes it with a `u64`
/// message that the handler set with [`Reactor::set_message_handler`] receives on the
/// reactor's thread.
///
/// It also names its reactor to another one: [`Ctx::listen_spread`] takes the `Remote`s of the
/// reactors a listener's connections are spread over.
///
/// Cheap to clone (an `Arc`). Messages from one thread arrive in the order sent; messages
/// sent before [`stop`](Remote::stop) are delivered before [`Reactor::run`] returns. Holding
/// a `Remote` does not keep the reactor busy: [`Reactor::run`] still returns when it is idle.
///
/// ```no_run
/// let mut reactor = rdma_reactor::Reactor::new()?;
/// reactor.set_message_handler(|_ctx, msg| println!("message {msg}"));
/// let remote = reactor.remote();
/// std::thread::spawn(move || {
///     remote.send(7).expect("the reactor is alive");
///     remote.stop().expect("the reactor is alive");
/// });
/// # reactor.listen("198.18.0.1:7471".parse().unwrap(), Server)?;
/// reactor.run()?; // Returns after the message is handled and the stop request is seen.
/// # struct Server;
/// # impl rdma_reactor::ListenerHandler for Server {
/// #     fn on_connect_request(&mut self, _: &mut rdma_reactor::Ctx<'_>, _: &rdma_reactor::ConnectRequest)
/// #         -> rdma_reactor::Decision { unimplemented!() }
/// # }
/// # Ok::<(), rdma_reactor::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct Remote {
    shared: Arc<Shared>,
}

/// The reactor a [`Remote`] belongs to has been dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReactorGone;

impl std::fmt::Display for ReactorGone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the reactor is gone")
    }
}

impl std::error::Error for ReactorGone {}

impl Remote {
    /// Queues `message` for the reactor's message handler and wakes the reactor.
    ///
    /// # Errors
    ///
    /// [`ReactorGone`] if the reactor has been dropped (the message is not queued).
    pub fn send(&self, message: u64) -> std::result::Result<(), ReactorGone> {
        self.queue(|q| q.messages.push_back(message))
    }

    /// Asks the reactor to stop: [`Reactor::run`] returns after the tick that sees the request
    /// (as [`Ctx::stop`] does), having delivered the messages sent before. A reactor driven by
    /// [`Reactor::run_once`] just wakes.
    ///
    /// # Errors
    ///
    /// [`ReactorGone`] if the reactor has been dropped.
    pub fn stop(&self) -> std::result::Result<(), ReactorGone> {
        self.queue(|q| q.stop = true)
    }

    /// Wakes task `task` of the reactor's executor from another thread (`event_loop/exec.rs`).
    pub(in crate::reactor) fn wake_task(&self, task: u64) -> std::result::Result<(), ReactorGone> {
        self.queue(|q| q.tasks.push(task))
    }

    /// Changes the reactor's queue with `f` under its lock, then wakes the reactor; refused
    /// once the reactor is gone.
    fn queue(&self, f: impl FnOnce(&mut Queue)) -> std::result::Result<(), ReactorGone> {
        {
            let mut q = self.shared.lock();
            if q.closed {
                return Err(ReactorGone);
            }
            f(&mut q);
        }
        self.shared.wake();
        Ok(())
    }

    /// Tells the reactor that connection `token`'s `rdma_connect` returned on its helper
    /// thread (`conn/connect.rs`); nothing if the reactor is gone.
    pub(in crate::reactor) fn connect_returned(&self, token: u64) {
        let _ = self.queue(|q| q.connects.push(token));
    }

    /// Makes the reactor's `epoll_wait` return (a task was woken on its thread outside a tick).
    pub(in crate::reactor) fn nudge(&self) {
        self.shared.wake();
    }

    /// True while the reactor exists.
    pub fn is_alive(&self) -> bool {
        !self.shared.lock().closed
    }

    /// The inbox, locked (`conn/handoff.rs`).
    pub(in crate::reactor) fn lock_queue(&self) -> MutexGuard<'_, Queue> {
        self.shared.lock()
    }

    /// Wakes the reactor (after queueing something under the lock).
    pub(in crate::reactor) fn wake(&self) {
        self.shared.wake();
    }

    /// The reactor's live connections as it last published them.
    pub(in crate::reactor) fn load(&self) -> usize {
        self.shared.load.load(Ordering::Relaxed)
    }

    /// True if this is the handle of the reactor that owns `inbox`.
    pub(in crate::reactor) fn is_of(&self, inbox: &Inbox) -> bool {
        Arc::ptr_eq(&self.shared, &inbox.shared)
    }
}

/// The message handler's type.
type MessageHandler = Box<dyn FnMut(&mut Ctx<'_>, u64)>;

/// The reactor's side: the shared state, the handler, and a buffer the queue is swapped into.
pub(in crate::reactor) struct Inbox {
    shared: Arc<Shared>,
    handler: Option<MessageHandler>,
    taken: VecDeque<u64>,
    /// Shared asynchronous events taken with the messages.
    taken_async: Vec<SharedAsync>,
    /// Tasks woken on other threads, taken with the messages.
    pub(in crate::reactor) taken_tasks: Vec<u64>,
    /// Connections whose helper's `rdma_connect` returned, taken with the messages.
    pub(in crate::reactor) taken_connects: Vec<u64>,
    /// The load last published (`Shared::load`).
    published: usize,
}

impl Inbox {
    /// Creates the eventfd (non-blocking, close-on-exec) and registers it with `epoll`.
    ///
    /// `chan` is the reactor's CM channel, which outlives the inbox (`Core`'s field order).
    pub(in crate::reactor) fn new(epoll: &Epoll, chan: Option<ChannelRef>) -> Result<Inbox> {
        let efd =
            EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK).map_err(os("eventfd"))?;
        let token = Token::new(Kind::Remote, 0, 1);
        epoll.add(&efd, EpollEvent::new(EpollFlags::EPOLLIN, token.as_u64())).map_err(os("epoll_ctl"))?;
        let queue = Queue { chan, ..Queue::default() };
        let shared = Arc::new(Shared { efd, inbox: Mutex::new(queue), load: AtomicUsize::new(0) });
        {
            let mut all = REACTORS.lock().unwrap_or_else(PoisonError::into_inner);
            all.retain(|w| w.strong_count() > 0);
            all.push(Arc::downgrade(&shared));
        }
        Ok(Inbox {
            shared,
            handler: None,
            taken: VecDeque::new(),
            taken_async: Vec::new(),
            taken_tasks: Vec::new(),
            taken_connects: Vec::new(),
            published: 0,
        })
    }

    pub(in crate::reactor) fn remote(&self) -> Remote {
        Remote { shared: self.shared.clone() }
    }

    /// The inbox, locked (`conn/handoff.rs`).
    pub(in crate::reactor) fn lock_queue(&self) -> MutexGuard<'_, Queue> {
        self.shared.lock()
    }

    /// Publishes the reactor's live connections if they changed: one comparison per tick,
    /// one relaxed store when the number moved.
    pub(in crate::reactor) fn publish_load(&mut self, conns: usize) {
        if conns != self.published {
            self.published = conns;
            self.shared.load.store(conns, Ordering::Relaxed);
        }
    }

    /// Resets the eventfd, then takes the queued messages into `self.taken`; returns whether a
    /// stop was requested.
    fn take(&mut self) -> bool {
        match self.shared.efd.read() {
            Ok(_) | Err(Errno::EAGAIN) => {}
            // Cannot happen on an eventfd we own; the queue is taken anyway.
            Err(_) => {}
        }
        let mut q = self.shared.lock();
        std::mem::swap(&mut q.messages, &mut self.taken);
        std::mem::swap(&mut q.shared_async, &mut self.taken_async);
        std::mem::swap(&mut q.tasks, &mut self.taken_tasks);
        std::mem::swap(&mut q.connects, &mut self.taken_connects);
        std::mem::take(&mut q.stop)
    }
}

impl Drop for Inbox {
    fn drop(&mut self) {
        let mut q = self.shared.lock();
        q.closed = true;
        q.messages.clear();
        // Under the lock, before the channel is destroyed (it is a later field of `Core`): no
        // sender migrates to it from now on.
        q.chan = None;
        // Ids handed over but never taken: destroyed on their (still live) channel, which
        // rejects their requests.
        q.parcels.clear();
        q.shared_async.clear();
        q.tasks.clear();
        q.connects.clear();
    }
}

impl std::fmt::Debug for Inbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox").field("handler", &self.handler.is_some()).finish()
    }
}

impl Core {
    /// The remote eventfd is readable: deliver the queued messages to the handler (dropped if
    /// none is set), then honour a stop request. Returns how many messages and requests.
    pub(in crate::reactor) fn drain_remote(&mut self) -> usize {
        let stop = self.inbox.take();
        // Connect requests handed over by other reactors (`conn/handoff.rs`), after the eventfd
        // was read: one queued later comes with a later write.
        let adopted = self.take_handoffs();
        let shared = std::mem::take(&mut self.inbox.taken_async);
        let tasks = std::mem::take(&mut self.inbox.taken_tasks);
        let mut connects = std::mem::take(&mut self.inbox.taken_connects);
        let mut n = adopted + shared.len() + tasks.len() + connects.len();
        self.exec.woken_elsewhere(tasks);
        for token in connects.drain(..) {
            self.connect_returned(token);
        }
        // Keep the buffer's capacity for the next swap.
        self.inbox.taken_connects = connects;
        for ev in shared {
            self.on_shared_async(ev);
        }
        let mut messages = std::mem::take(&mut self.inbox.taken);
        n += messages.len() + usize::from(stop);
        if !messages.is_empty() {
            if let Some(mut h) = self.inbox.handler.take() {
                for m in messages.drain(..) {
                    // A panic is kept for the end of the tick ("Panics in callbacks", mod.rs).
                    self.deliver(|core| h(&mut Ctx::new(core, None), m));
                }
                // Unless the handler was replaced meanwhile (it cannot be from a callback).
                self.inbox.handler.get_or_insert(h);
            }
            messages.clear();
        }
        // Keep the buffer's capacity for the next swap.
        self.inbox.taken = messages;
        if stop {
            self.stop = true;
        }
        n
    }
}

impl Core {
    /// Passes a copy of an asynchronous event this reactor read on device `context` (its
    /// address) to every other reactor of the process; each acts on it only if it names its
    /// device and, for a queue pair or CQ, an object it has (matched by address, as the
    /// reader does).
    pub(in crate::reactor) fn share_async(&mut self, context: usize, kind: AsyncEventKind, element: AsyncElement) {
        let others: Vec<Arc<Shared>> = {
            let all = REACTORS.lock().unwrap_or_else(PoisonError::into_inner);
            all.iter().filter_map(Weak::upgrade).filter(|s| !Arc::ptr_eq(s, &self.inbox.shared)).collect()
        };
        for s in others {
            {
                let mut q = s.lock();
                if q.closed {
                    continue;
                }
                q.shared_async.push(SharedAsync { context, kind, element });
            }
            s.wake();
        }
    }

    /// An asynchronous event another reactor read: acted on as if read here, if this reactor
    /// uses that device.
    fn on_shared_async(&mut self, ev: SharedAsync) {
        let found = (0..self.devices.slots())
            .find(|&d| self.devices.get(d).is_some_and(|x| !x.lost && x.dev.as_ptr() as usize == ev.context));
        if let Some(d) = found {
            self.stats.shared_async_events += 1;
            self.on_async(d, ev.kind, ev.element);
        }
    }
}

impl Reactor {
    /// A handle for other threads: [`Remote::stop`] makes [`Reactor::run`] return,
    /// [`Remote::send`] delivers a `u64` to the handler set with
    /// [`set_message_handler`](Reactor::set_message_handler), on this thread.
    pub fn remote(&self) -> Remote {
        self.core.inbox.remote()
    }

    /// Sets the callback that receives [`Remote::send`]'s messages, on the reactor's thread,
    /// in the tick that sees them (replacing any earlier one). Messages that arrive while no
    /// handler is set are dropped. The context has no owner: [`Ctx::set_timer`] is refused in
    /// it.
    pub fn set_message_handler(&mut self, handler: impl FnMut(&mut Ctx<'_>, u64) + 'static) {
        self.core.inbox.handler = Some(Box::new(handler));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::epoll::EpollCreateFlags;

    fn inbox() -> (Epoll, Inbox) {
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).expect("epoll");
        let inbox = Inbox::new(&epoll, None).expect("inbox");
        (epoll, inbox)
    }

    fn readable(epoll: &Epoll) -> bool {
        let mut ev = [EpollEvent::empty(); 4];
        epoll.wait(&mut ev, 0u16).expect("epoll_wait") > 0
    }

    #[test]
    fn remote_is_send_sync_clone() {
        fn check<T: Send + Sync + Clone + 'static>() {}
        check::<Remote>();
    }

    #[test]
    fn messages_from_threads_arrive_in_order_and_the_eventfd_resets() {
        let (epoll, mut inbox) = inbox();
        assert!(!readable(&epoll));
        let remote = inbox.remote();
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let r = remote.clone();
                std::thread::spawn(move || (0..1000).for_each(|i| r.send(t << 32 | i).expect("alive")))
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().expect("sender"));
        assert!(readable(&epoll), "the eventfd wakes the epoll set");
        assert!(!inbox.take(), "no stop requested");
        assert!(!readable(&epoll), "reading reset the eventfd");
        assert_eq!(inbox.taken.len(), 4000);
        for t in 0..4u64 {
            let mine: Vec<u64> = inbox.taken.iter().filter(|m| *m >> 32 == t).map(|m| m & 0xffff_ffff).collect();
            assert_eq!(mine, (0..1000).collect::<Vec<_>>(), "thread {t}'s messages in order");
        }
        remote.stop().expect("alive");
        assert!(readable(&epoll));
        inbox.taken.clear();
        assert!(inbox.take(), "stop requested");
        assert!(!inbox.take(), "a stop request is taken once");
    }

    #[test]
    fn a_handle_outliving_its_reactor_gets_an_error() {
        let (_epoll, inbox) = inbox();
        let remote = inbox.remote();
        assert!(remote.is_alive());
        drop(inbox);
        assert!(!remote.is_alive());
        assert_eq!(remote.send(1), Err(ReactorGone));
        assert_eq!(remote.stop(), Err(ReactorGone));
    }
}
