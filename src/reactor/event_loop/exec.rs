//! The reactor's local executor: `!Send` tasks polled by its own tick ([`Reactor::spawn`]),
//! a future driven to completion on it ([`Reactor::block_on`]), and the access the async face
//! (`crate::io`) has to the reactor while one of them is polled.
//!
//! # How a task runs
//!
//! A task is a boxed future in a slot of [`Exec`]. Its waker ([`TaskWaker`]) names the
//! executor and the slot. Woken on the reactor's thread (the usual case: a completion, a
//! close, another task), the wake is one push onto a thread-local list; from another thread
//! it goes through the reactor's [`Remote`] inbox (a lock and an eventfd write). Step 5b of the
//! tick (`Core::run_tasks`, after the timers and before the posts) takes this executor's
//! entries and polls each woken task once, so what the tasks submit is posted in the same
//! tick, one chain per queue pair. A wake on the thread that does not come from inside this
//! reactor's own tick or poll ([`INSIDE`] names the executor running, innermost) also writes the
//! reactor's eventfd, since it may be asleep (another reactor's tick on the thread included); a
//! dropped executor takes its entries off the list, and later wakes of its tasks are dropped.
//!
//! # Reaching the reactor from a future
//!
//! A future cannot hold `&mut Core`: the reactor owns the future. While the executor polls a
//! task (or `block_on` its future), and only then, a thread-local holds a pointer to the
//! polling reactor's `Core` ([`CURRENT`]); [`with_core`] (and [`with_ctx`], the async face's
//! way in, `crate::io`) takes it out for the length of one
//! call and puts it back, so a call made through it that would reach it again (a callback that
//! polls nothing but could, in principle, call the async face) finds none and fails with
//! [`Error::NoReactor`] instead of aliasing. Polled anywhere else (another executor's task, a
//! thread without a reactor), the async face fails the same way. And a handle of the async face
//! is bound to the reactor that made it ([`ExecId`], [`with_ctx_of`]): polled by another
//! reactor on the same thread, which issues the same tokens, it fails the same way instead of
//! acting on that reactor's connection of its token.
//!
//! [`Remote`]: crate::reactor::Remote

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::ThreadId;
use std::time::Instant;

use slab::Slab;

use crate::error::{Error, Result};
use crate::proto::token::{GenSlab, TimerKey, Token};
use crate::reactor::event_loop::timers::TimerTarget;
use crate::reactor::{Core, Ctx, Reactor, Remote};

/// The task id of [`Reactor::block_on`]'s future.
const MAIN: u64 = u64::MAX;

/// How many times one tick polls the woken tasks again when polling them woke more: a task
/// that wakes itself for ever still lets the tick go on (it is polled again next tick).
const ROUNDS: usize = 8;

static NEXT_EXEC: AtomicU64 = AtomicU64::new(1);

// Every access is `try_with`: a reactor kept in a thread-local is dropped (and shut down,
// ticking) while this thread's locals are destroyed, and must not panic there.
thread_local! {
    /// The run queues of the executors that exist on this thread, one each ([`RunQueue`]): a
    /// wake of a task of an executor not listed (dropped since) is dropped.
    static QUEUES: RefCell<Vec<RunQueue>> = const { RefCell::new(Vec::new()) };
    /// The reactor whose task or `block_on` future this thread is polling, while it is; null
    /// otherwise, and while a call made through it runs ([`with_core`]).
    static CURRENT: Cell<*mut Core> = const { Cell::new(std::ptr::null_mut()) };
    /// This thread's id (read once: `thread::current()` clones a handle each time).
    static THREAD: ThreadId = std::thread::current().id();
    /// The executor whose reactor's tick or `block_on` poll runs on this thread, innermost
    /// (0: none): a wake of one of its tasks will be seen before that reactor sleeps, so it
    /// needs no eventfd write. A wake of another reactor's task (two reactors on one thread)
    /// does (review of 2026-11-26, L5: it was a count of any reactor's ticks, so such a wake
    /// skipped the write, and a reactor asleep under the tokio driver never polled the task).
    static INSIDE: Cell<u64> = const { Cell::new(0) };
    /// False when every run queue of the thread is surely empty: set by every push, cleared by
    /// a take that left the thread's queues empty. A tick asks twice whether its executor has
    /// work (`Exec::has_work`); with no task woken, this one load answers (a `Cell` of a type
    /// without `Drop` needs no lazy registration, unlike the queues' `RefCell<Vec>`: about 35
    /// instructions a question less, issue 33).
    static ANY_WOKEN: Cell<bool> = const { Cell::new(false) };
}

/// One executor's woken tasks on its thread, in the order they were woken: each task at most
/// once, since a task is queued only when its `queued` flag ([`TaskWaker::queued`]) was clear,
/// and the flag is cleared when the task is taken to be polled (review of 2026-12-07, N4: the
/// list was one for the thread, and each entry taken was looked for among those taken before,
/// which was quadratic in the tasks woken in a tick: about 10 ms of the reactor's thread a
/// tick at 5 000). `block_on`'s future has no flag: `main` says it was woken.
#[derive(Debug)]
struct RunQueue {
    exec: u64,
    tasks: Vec<u64>,
    main: bool,
}

/// Runs `f` with executor `exec`'s run queue on this thread; `None` when it has none (it was
/// dropped, or the thread's locals are being destroyed).
fn with_queue<R>(exec: u64, f: impl FnOnce(&mut RunQueue) -> R) -> Option<R> {
    QUEUES
        .try_with(|q| {
            let mut q = q.borrow_mut();
            // Usually one executor per thread: found at the first compare.
            q.iter_mut()
                .find(|r| {
                    #[cfg(test)]
                    tests::step(1);
                    r.exec == exec
                })
                .map(f)
        })
        .ok()
        .flatten()
}

/// Queues task `task` of executor `exec` (or its `block_on` future, [`MAIN`]) on this thread.
/// False when that executor is gone.
fn push_woken(exec: u64, task: u64) -> bool {
    let pushed = with_queue(exec, |r| {
        if task == MAIN {
            r.main = true;
        } else {
            r.tasks.push(task);
        }
    })
    .is_some();
    if pushed {
        let _ = ANY_WOKEN.try_with(|a| a.set(true));
    }
    pushed
}

/// Recomputes [`ANY_WOKEN`] after a take.
fn settle_any_woken() {
    let any = QUEUES.try_with(|q| q.borrow().iter().any(|r| r.main || !r.tasks.is_empty())).unwrap_or(false);
    let _ = ANY_WOKEN.try_with(|a| a.set(any));
}

/// Marks this thread inside a tick or poll of `exec`'s reactor for the guard's life (and puts
/// back the executor it was inside before: reactors nest, `block_on` in another's task).
pub(in crate::reactor) struct Inside(u64);

impl Inside {
    pub(in crate::reactor) fn enter(exec: ExecId) -> Inside {
        Inside(INSIDE.try_with(|i| i.replace(exec.0)).unwrap_or(0))
    }
}

impl Drop for Inside {
    fn drop(&mut self) {
        let _ = INSIDE.try_with(|i| i.set(self.0));
    }
}

/// Puts the previous [`CURRENT`] back, also when the poll or call panics.
struct Restore(*mut Core);

impl Drop for Restore {
    fn drop(&mut self) {
        let _ = CURRENT.try_with(|c| c.set(self.0));
    }
}

/// Runs `f` with the reactor whose task or `block_on` future is being polled on this thread.
///
/// # Errors
///
/// [`Error::NoReactor`] when no reactor is polling here (a future of the async face polled by
/// another executor, or from inside a call made through this function).
fn with_core<R>(f: impl FnOnce(&mut Core) -> R) -> Result<R> {
    let p = CURRENT.try_with(|c| c.replace(std::ptr::null_mut())).unwrap_or(std::ptr::null_mut());
    if p.is_null() {
        return Err(Error::NoReactor);
    }
    let _restore = Restore(p);
    // Why `unsafe` here, outside `src/sys/`: the pointer is the reactor's own (a `&mut Core`
    // lent to the futures it polls through a thread-local), nothing of the C libraries'.
    #[allow(unsafe_code)]
    // SAFETY: `p` was set by `poll_with_core` from a `&mut Core` that the polling function does
    // not use while the poll runs (the polled future is not stored in the `Core`: it was taken
    // out of its slot, or lives on `block_on`'s stack), and it is cleared again when the poll
    // ends. Taking it out of `CURRENT` (it is null until `_restore` puts it back) makes this
    // the only reference derived from it meanwhile: a nested `with_core` finds null. The
    // reference does not escape `f`.
    let core = unsafe { &mut *p };
    Ok(f(core))
}

/// Which reactor's executor something belongs to: process-unique, never reused. The async
/// face's handles keep the id of the reactor that made them, and reach the reactor only
/// through [`with_ctx_of`] with it (two reactors on one thread issue the same tokens).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ExecId(u64);

/// Runs `f` with the reactor polling on this thread if it is the one `home` names.
///
/// # Errors
///
/// [`Error::NoReactor`] when no reactor is polling here, or another one is.
fn with_core_of<R>(home: ExecId, f: impl FnOnce(&mut Core) -> R) -> Result<R> {
    with_core(|core| (core.exec.id == home.0).then(|| f(core)))?.ok_or(Error::NoReactor)
}

/// Runs `f` with a context of the reactor whose task or `block_on` future is being polled on
/// this thread, if it is `home` (the reactor an async handle belongs to): a handle polled by
/// another reactor fails instead of naming that reactor's object of the same token.
///
/// # Errors
///
/// As [`with_core_of`].
pub(crate) fn with_ctx_of<R>(home: ExecId, f: impl FnOnce(&mut Ctx<'_>) -> R) -> Result<R> {
    with_core_of(home, |core| f(&mut Ctx::new(core, None)))
}

/// Runs `f` with a context of the reactor whose task or `block_on` future is being polled on
/// this thread: the async face's only way in (`crate::io` names the callback API, never
/// `Core`), for what belongs to no reactor yet (a connect, a bind, a spawn); what does goes
/// through [`with_ctx_of`]. The context has no owner (a task is no callback: it sets no timers).
///
/// # Errors
///
/// As [`with_core`].
pub(crate) fn with_ctx<R>(f: impl FnOnce(&mut Ctx<'_>) -> R) -> Result<R> {
    with_core(|core| f(&mut Ctx::new(core, None)))
}

/// Polls `fut` with `core` reachable through [`with_core`].
pub(in crate::reactor) fn poll_with_core<T>(
    core: &mut Core,
    fut: Pin<&mut dyn Future<Output = T>>,
    waker: &Waker,
) -> Poll<T> {
    let _inside = Inside::enter(core.exec.id());
    let prev = CURRENT.try_with(|c| c.replace(core as *mut Core)).unwrap_or(std::ptr::null_mut());
    let _restore = Restore(prev);
    fut.poll(&mut Context::from_waker(waker))
}

/// What [`Core`] keeps for its tasks.
pub(in crate::reactor) struct Exec {
    /// This executor's id in wakers (process-unique).
    id: u64,
    tasks: Slab<Task>,
    /// Generation of the next task: with the slot index it makes the task id, so a stale wake
    /// of a slot reused since is ignored.
    generation: u32,
    /// Tokens of connections and listeners whose last async handle was dropped: closed at
    /// the next tick (a handle may be dropped anywhere, without the reactor at hand).
    pub(in crate::reactor) orphans: Orphans,
    /// For wakes from other threads (and a same-thread wake outside the reactor's tick).
    remote: Remote,
    /// `block_on`'s future was woken.
    main_woken: bool,
    /// Set by `block_on` for the tick it runs next ([`Exec::take_defer_arm`]).
    defer_arm: bool,
    /// The woken tasks a round of `run_tasks` polls (kept: no allocation per tick).
    woken: Vec<u64>,
    /// Wakers of sleeping futures (`io::sleep`), each with a heap entry
    /// (`TimerTarget::Wake`); a cancelled sleep leaves its entry stale.
    pub(in crate::reactor) sleepers: GenSlab<TimerKey, Waker>,
}

impl Drop for Exec {
    /// Forgets this executor on its thread: its run queue goes (no tick of a later reactor
    /// looks at it), and later wakes of its tasks are dropped (`TaskWaker`). Runs
    /// before the tasks drop (fields drop after this), so what they wake while dropping is
    /// dropped too.
    fn drop(&mut self) {
        let id = self.id;
        let _ = QUEUES.try_with(|q| q.borrow_mut().retain(|r| r.exec != id));
        settle_any_woken();
    }
}

/// Work queued by async handles for their reactor's next tick ([`Orphans::defer`]).
pub(crate) type Deferred = Box<dyn FnOnce(&mut crate::reactor::Ctx<'_>)>;

/// Tokens whose last async handle is gone, shared by the handles and the reactor: closed at
/// the reactor's next tick (and the work handles deferred to it).
#[derive(Clone)]
pub(crate) struct Orphans {
    list: Rc<RefCell<Vec<Token>>>,
    /// Work a handle owes its reactor, queued where that reactor was not at hand
    /// ([`Orphans::defer`]).
    deferred: Rc<RefCell<Vec<Deferred>>>,
    /// The executor whose reactor closes them.
    exec: u64,
    remote: Remote,
}

impl Orphans {
    fn new(exec: u64, remote: Remote) -> Orphans {
        Orphans { list: Rc::default(), deferred: Rc::default(), exec, remote }
    }

    /// Queues `f` for the reactor's next tick (it runs there with that reactor's `Ctx`), and
    /// wakes the reactor when outside its tick, as [`Orphans::push`] does: what an async
    /// handle owes its connection (a receive to post again) when it is polled where its
    /// reactor is not at hand (late review of issue 32's M5, F2).
    pub(crate) fn defer(&self, f: Deferred) {
        self.deferred.borrow_mut().push(f);
        if INSIDE.try_with(Cell::get).unwrap_or(0) != self.exec {
            self.remote.nudge();
        }
    }

    fn take_deferred(&self) -> Vec<Deferred> {
        std::mem::take(&mut *self.deferred.borrow_mut())
    }

    /// Queues `t` for closing. Outside its reactor's tick (a handle dropped by another
    /// runtime's task, or in another reactor's tick on this thread) it also wakes that
    /// reactor, should it sleep: under the tokio driver an idle reactor would otherwise keep
    /// the connection open until its next event (review finding F1, issue 32).
    pub(crate) fn push(&self, t: Token) {
        self.list.borrow_mut().push(t);
        if INSIDE.try_with(Cell::get).unwrap_or(0) != self.exec {
            self.remote.nudge();
        }
    }

    fn is_empty(&self) -> bool {
        self.list.borrow().is_empty() && self.deferred.borrow().is_empty()
    }

    fn take(&self) -> Vec<Token> {
        std::mem::take(&mut *self.list.borrow_mut())
    }
}

struct Task {
    generation: u32,
    /// `None` while it is being polled.
    fut: Option<Pin<Box<dyn Future<Output = ()>>>>,
    /// Shared with each poll (an `Rc` clone, issue 33: cloning the `Waker` itself went through
    /// its vtable and an atomic count, twice a poll).
    waker: Rc<Waker>,
    /// The waker's own state: its `queued` flag is cleared when the task is taken to be
    /// polled ([`RunQueue`]).
    shared: Arc<TaskWaker>,
}

impl Exec {
    pub(in crate::reactor) fn new(remote: Remote) -> Exec {
        let id = NEXT_EXEC.fetch_add(1, Ordering::Relaxed);
        let _ = QUEUES.try_with(|q| q.borrow_mut().push(RunQueue { exec: id, tasks: Vec::new(), main: false }));
        Exec {
            id,
            tasks: Slab::new(),
            generation: 0,
            orphans: Orphans::new(id, remote.clone()),
            remote,
            main_woken: false,
            defer_arm: false,
            woken: Vec::new(),
            sleepers: GenSlab::new(),
        }
    }

    /// This executor's id, which the async face's handles keep ([`with_ctx_of`]).
    pub(in crate::reactor) fn id(&self) -> ExecId {
        ExecId(self.id)
    }

    fn task_waker(&self, task: u64) -> Arc<TaskWaker> {
        Arc::new(TaskWaker {
            exec: self.id,
            task,
            owner: std::thread::current().id(),
            remote: self.remote.clone(),
            queued: AtomicBool::new(false),
        })
    }

    fn waker(&self, task: u64) -> Waker {
        Waker::from(self.task_waker(task))
    }

    /// True when a tick has tasks to poll or handles to close: the reactor must not sleep.
    /// Constant time in the tasks woken (a look at this executor's run queue).
    pub(in crate::reactor) fn has_work(&self) -> bool {
        !self.orphans.is_empty()
            || (ANY_WOKEN.get() && with_queue(self.id, |r| r.main || !r.tasks.is_empty()).unwrap_or(false))
    }

    /// Live tasks.
    pub(in crate::reactor) fn len(&self) -> usize {
        self.tasks.len()
    }

    /// Takes this executor's woken tasks off its run queue (each is there once), in the order
    /// they were woken: linear in the tasks taken.
    fn take_woken(&mut self, into: &mut Vec<u64>) {
        if !ANY_WOKEN.get() {
            return;
        }
        let main = with_queue(self.id, |r| {
            // Moved over, the queue keeping its allocation.
            #[cfg(test)]
            tests::step(r.tasks.len());
            into.append(&mut r.tasks);
            std::mem::take(&mut r.main)
        });
        self.main_woken |= main.unwrap_or(false);
        settle_any_woken();
    }

    /// Whether `block_on` runs this tick (and forgets it). `block_on` polls its future right
    /// after the tick if it was woken ([`Exec::main_is_woken`]): the tick may leave its arm
    /// to `block_on`. Taken at the start of the tick, so a tick that `block_on` did not start
    /// never skips its arm (a `main_woken` left set by a stale waker after `block_on` returned,
    /// or after a tick failed, does not count).
    pub(in crate::reactor) fn take_defer_arm(&mut self) -> bool {
        std::mem::take(&mut self.defer_arm)
    }

    /// `block_on`'s future was woken and not polled since.
    pub(in crate::reactor) fn main_is_woken(&self) -> bool {
        self.main_woken
    }

    /// Whether `block_on`'s future was woken (and forgets it), taking its wakes off the
    /// thread's list.
    fn take_main(&mut self) -> bool {
        if ANY_WOKEN.get() {
            let main = with_queue(self.id, |r| std::mem::take(&mut r.main)).unwrap_or(false);
            self.main_woken |= main;
            if main {
                settle_any_woken();
            }
        }
        std::mem::take(&mut self.main_woken)
    }

    /// Tasks other threads woke (taken from the inbox by the reactor): as if woken here, each
    /// queued unless its flag says it is already ([`TaskWaker::queued`]); a task gone since is
    /// not.
    pub(in crate::reactor) fn woken_elsewhere(&mut self, tasks: impl IntoIterator<Item = u64>) {
        for id in tasks {
            if id == MAIN {
                push_woken(self.id, id);
                continue;
            }
            let (index, generation) = ((id & 0xFFFF_FFFF) as usize, (id >> 32) as u32);
            let Some(task) = self.tasks.get(index).filter(|t| t.generation == generation) else { continue };
            if !task.shared.queued.load(Ordering::Relaxed) {
                task.shared.queued.store(true, Ordering::Relaxed);
                push_woken(self.id, id);
            }
        }
    }

    fn spawn(&mut self, fut: Pin<Box<dyn Future<Output = ()>>>) {
        self.generation = self.generation.wrapping_add(1);
        let generation = self.generation;
        let id = u64::from(generation) << 32 | self.tasks.vacant_key() as u64;
        let shared = self.task_waker(id);
        let waker = Rc::new(Waker::from(shared.clone()));
        // Queued for its first poll, as a wake would queue it.
        shared.queued.store(true, Ordering::Relaxed);
        self.tasks.insert(Task { generation, fut: Some(fut), waker, shared });
        push_woken(self.id, id);
    }
}

/// A task's waker: the executor and the task, the thread that owns them, and the way to wake
/// that reactor from elsewhere.
struct TaskWaker {
    exec: u64,
    task: u64,
    owner: ThreadId,
    remote: Remote,
    /// The task is on its executor's run queue and not yet taken to be polled: a wake then
    /// adds nothing ([`RunQueue`]). Read and written on the reactor's thread only (a wake
    /// from another thread goes through the inbox, and the reactor sets it when it takes
    /// that); cleared when the task is taken to be polled, before the poll, so a wake during
    /// the poll queues it again. Never set for `block_on`'s future ([`MAIN`]).
    /// (An atomic for `Sync` alone: every access is a relaxed load or store, plain moves, by
    /// one thread.)
    queued: AtomicBool,
}

impl Wake for TaskWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if THREAD.try_with(|t| *t == self.owner).unwrap_or(false) {
            if self.task != MAIN {
                if self.queued.load(Ordering::Relaxed) {
                    // Queued already: by a wake inside its reactor's tick (seen before it
                    // sleeps) or by one that nudged it.
                    return;
                }
                self.queued.store(true, Ordering::Relaxed);
            }
            let inside = INSIDE.try_with(Cell::get).unwrap_or(0);
            // Its reactor was dropped when it has no run queue: no task is left to wake.
            if push_woken(self.exec, self.task) && inside != self.exec {
                // Outside this reactor's tick (a timer of another runtime, a future the
                // application polls, another reactor's tick on this thread): make it look,
                // should it sleep. Inside it, the tick sees the wake before it sleeps.
                self.remote.nudge();
            }
        } else {
            // Through the inbox, every time: the flag is the reactor's thread's alone (a
            // flag set here could be read as set there while the task is being taken, and the
            // wake lost: the hostile review of issue 45). The reactor queues it, flag and all,
            // when it takes the inbox (`Exec::woken_elsewhere`). A dropped reactor has no
            // tasks left to wake.
            let _ = self.remote.wake_task(self.task);
        }
    }
}

impl Core {
    /// Step 5b of the tick: closes what lost its last async handle, then polls the woken tasks
    /// (again while polling them woke more, at most [`ROUNDS`] times). Returns the tasks polled.
    pub(in crate::reactor) fn run_tasks(&mut self) -> usize {
        // Nothing orphaned, deferred or woken (every tick of a reactor without tasks): what
        // follows would find nothing, through two `RefCell`s and the thread's woken list.
        if !self.exec.has_work() {
            return 0;
        }
        // Taken only when there are some (issue 33: two empty lists taken and walked cost
        // about 40 instructions a tick with a task woken).
        if !self.exec.orphans.is_empty() {
            let orphans = self.exec.orphans.take();
            for t in orphans {
                self.close(t);
            }
            for f in self.exec.orphans.take_deferred() {
                f(&mut crate::reactor::Ctx::new(self, None));
            }
        }
        let mut polled = 0;
        let mut woken = std::mem::take(&mut self.exec.woken);
        for _ in 0..ROUNDS {
            self.exec.take_woken(&mut woken);
            if woken.is_empty() {
                break;
            }
            for id in woken.drain(..) {
                polled += usize::from(self.poll_task(id));
            }
        }
        self.exec.woken = woken;
        polled
    }

    /// Wakes `waker` at `at` (a sleeping future of the async face): its key, for
    /// [`Core::set_sleeper`] and [`Core::cancel_sleep`].
    pub(in crate::reactor) fn sleep_until(&mut self, at: Instant, waker: Waker) -> TimerKey {
        let key = self.exec.sleepers.insert(waker);
        self.timers.schedule(at, TimerTarget::Wake(key));
        key
    }

    /// The waker a sleep wakes, replaced (the future was polled by another task); false once
    /// the sleep is over (it fired or was cancelled).
    pub(in crate::reactor) fn set_sleeper(&mut self, key: TimerKey, waker: &Waker) -> bool {
        match self.exec.sleepers.get_mut(key) {
            Some(w) => {
                if !w.will_wake(waker) {
                    *w = waker.clone();
                }
                true
            }
            None => false,
        }
    }

    /// Forgets a sleep (its future was dropped); a fired one is ignored.
    pub(in crate::reactor) fn cancel_sleep(&mut self, key: TimerKey) {
        self.exec.sleepers.remove(key);
    }

    /// Polls task `id` once if it still exists; true when it did. A finished task is
    /// dropped, with the reactor reachable (its handles may close connections).
    fn poll_task(&mut self, id: u64) -> bool {
        let (index, generation) = ((id & 0xFFFF_FFFF) as usize, (id >> 32) as u32);
        let Some(task) = self.exec.tasks.get_mut(index).filter(|t| t.generation == generation) else { return false };
        // Off its run queue: a wake from here on queues it again.
        task.shared.queued.store(false, Ordering::Relaxed);
        let Some(mut fut) = task.fut.take() else { return false };
        let waker = task.waker.clone();
        // A panic is the task's: `spawn`'s wrapper catches it for its JoinHandle, so this one
        // only guards the reactor against a future polled after it panicked.
        let r = catch_unwind(AssertUnwindSafe(|| poll_with_core(self, fut.as_mut(), &waker)));
        match r {
            Ok(Poll::Pending) => {
                if let Some(t) = self.exec.tasks.get_mut(index) {
                    t.fut = Some(fut);
                }
            }
            Ok(Poll::Ready(())) | Err(_) => {
                self.exec.tasks.remove(index);
                let _inside = Inside::enter(self.exec.id());
                let prev = CURRENT.try_with(|c| c.replace(self as *mut Core)).unwrap_or(std::ptr::null_mut());
                let _restore = Restore(prev);
                drop(fut);
            }
        }
        true
    }
}

/// The output of a spawned task, or its panic.
struct JoinState<T> {
    result: Option<std::thread::Result<T>>,
    waker: Option<Waker>,
}

/// A spawned task's result: a future that resolves to the task's output, or to the payload
/// of its panic (as [`std::thread::JoinHandle::join`] does). Dropping it detaches the task,
/// which runs on.
#[must_use = "dropping a JoinHandle detaches the task"]
pub struct JoinHandle<T> {
    state: Rc<RefCell<JoinState<T>>>,
}

impl<T> std::fmt::Debug for JoinHandle<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JoinHandle").field("finished", &self.state.borrow().result.is_some()).finish()
    }
}

impl<T> Future for JoinHandle<T> {
    type Output = std::thread::Result<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut s = self.state.borrow_mut();
        match s.result.take() {
            Some(r) => Poll::Ready(r),
            None => {
                s.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

/// A task's future with its panic caught: a panicking task ends, its handles are dropped (its
/// connections close), and the panic goes to its [`JoinHandle`], not out of the reactor.
struct CatchPanic<F: Future> {
    fut: Pin<Box<F>>,
    state: Rc<RefCell<JoinState<F::Output>>>,
}

impl<F: Future> Future for CatchPanic<F> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let r: std::result::Result<Poll<F::Output>, Box<dyn Any + Send>> =
            catch_unwind(AssertUnwindSafe(|| self.fut.as_mut().poll(cx)));
        let done = match r {
            Ok(Poll::Pending) => return Poll::Pending,
            Ok(Poll::Ready(v)) => Ok(v),
            Err(panic) => Err(panic),
        };
        let waker = {
            let mut s = self.state.borrow_mut();
            s.result = Some(done);
            s.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
        Poll::Ready(())
    }
}

pub(in crate::reactor) fn spawn_on<F>(exec: &mut Exec, fut: F) -> JoinHandle<F::Output>
where
    F: Future + 'static,
    F::Output: 'static,
{
    let state = Rc::new(RefCell::new(JoinState { result: None, waker: None }));
    exec.spawn(Box::pin(CatchPanic { fut: Box::pin(fut), state: state.clone() }));
    JoinHandle { state }
}

/// Spawns a task on the reactor whose task (or `block_on` future) is polling this one: the
/// async counterpart of [`Reactor::spawn`], for use inside async code.
///
/// # Errors
///
/// [`Error::NoReactor`] outside a reactor's task or `block_on`.
pub fn spawn<F>(fut: F) -> Result<JoinHandle<F::Output>>
where
    F: Future + 'static,
    F::Output: 'static,
{
    with_core(|core| spawn_on(&mut core.exec, fut))
}

/// The statistics of the reactor whose task (or `block_on` future) is polling this one.
///
/// # Errors
///
/// [`Error::NoReactor`] outside a reactor's task or `block_on`.
pub fn stats() -> Result<crate::reactor::Stats> {
    with_core(|core| core.stats())
}

impl Reactor {
    /// Spawns a task: a future run by this reactor's own tick, on its thread (it need not be
    /// `Send`). It is first polled in the next tick, and again each time it is woken; what it
    /// submits is posted in the tick that polled it, with the tick's other operations (one
    /// chain per queue pair). The async face (`rdma_reactor::io`) works inside it.
    ///
    /// A panic in the task ends the task (its handles are dropped, so connections only it held
    /// are closed) and reaches the [`JoinHandle`], not the reactor.
    pub fn spawn<F>(&mut self, fut: F) -> JoinHandle<F::Output>
    where
        F: Future + 'static,
        F::Output: 'static,
    {
        spawn_on(&mut self.core.exec, fut)
    }

    /// Runs `fut` to completion on this thread, running the reactor (its ticks, its spawned
    /// tasks) meanwhile; the async face (`rdma_reactor::io`) works inside it. Between polls
    /// the thread sleeps in the reactor's `epoll_wait` as [`Reactor::run_once`] does.
    ///
    /// # Errors
    ///
    /// As [`Reactor::run_once`] (the loop itself failed).
    ///
    /// # Panics
    ///
    /// A panic of `fut` propagates; one of a callback is resumed as [`Reactor::run_once`]
    /// resumes it.
    pub fn block_on<F: Future>(&mut self, fut: F) -> Result<F::Output> {
        let mut fut = std::pin::pin!(fut);
        let waker = self.core.exec.waker(MAIN);
        self.core.exec.main_woken = true;
        loop {
            if self.core.exec.take_main() {
                let f: Pin<&mut dyn Future<Output = F::Output>> = fut.as_mut();
                let polled = poll_with_core(&mut self.core, f, &waker);
                self.after_main_poll();
                if let Poll::Ready(v) = polled {
                    return Ok(v);
                }
                if self.core.exec.take_main() {
                    // It woke itself (a yield): poll it again, after a tick that does not wait.
                    self.core.exec.main_woken = true;
                    self.core.exec.defer_arm = true;
                    self.run_once(Some(std::time::Duration::ZERO))?;
                    continue;
                }
            }
            // Sleeps only when nothing is ready: woken tasks and what the future submitted
            // make the tick's wait zero. A tick that wakes the future leaves its arm to
            // `after_main_poll`.
            self.core.exec.defer_arm = true;
            self.run_once(None)?;
        }
    }

    /// After a poll of `block_on`'s future: what it submitted goes out now, then the CQs the
    /// waking tick emptied are armed and polled once more (polled before the arm too on a
    /// device other than rxe and siw; that tick left them to this:
    /// `Core::tick`, step 6), as for a task polled inside the tick. Before, its posts waited
    /// for a tick that did not wait, and a send completing during its post was a wakeup of its
    /// own (issue 31: the byte stream's round trip took about 2.8 ticks under `block_on`,
    /// aecho's tasks 1). A callback's panic in that poll is resumed here, as `run_once`
    /// resumes a tick's.
    fn after_main_poll(&mut self) {
        {
            let _inside = Inside::enter(self.core.exec.id());
            self.core.flush_posts();
            if !self.core.spin.on {
                self.core.arm_after_posts();
            }
        }
        self.resume_panic();
    }

    /// Polls `fut` once with this reactor reachable through [`with_ctx`], as its tasks are
    /// polled (the tokio driver's poll of its future, `crate::io::tokio`).
    #[cfg(feature = "tokio")]
    pub(crate) fn poll_inside<T>(&mut self, fut: Pin<&mut dyn Future<Output = T>>, waker: &Waker) -> Poll<T> {
        poll_with_core(&mut self.core, fut, waker)
    }

    /// Live tasks spawned on this reactor.
    pub fn tasks(&self) -> usize {
        self.core.exec.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reactor::event_loop::remote::Inbox;
    use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent};

    /// An executor with its reactor's inbox (the eventfd a wake writes) in an epoll set of its
    /// own, as `Core` has them: no device needed.
    fn exec() -> (Epoll, Inbox, Exec) {
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).expect("epoll");
        let inbox = Inbox::new(&epoll, None).expect("inbox");
        let exec = Exec::new(inbox.remote());
        (epoll, inbox, exec)
    }

    /// True when the reactor's eventfd was written (its epoll set is readable).
    fn nudged(epoll: &Epoll) -> bool {
        let mut ev = [EpollEvent::empty(); 4];
        epoll.wait(&mut ev, 0u16).expect("epoll_wait") > 0
    }

    thread_local! {
        /// Steps of the run queues' code on this thread (an executor compared, an entry
        /// moved): how a test times a tick without a clock.
        static STEPS: Cell<usize> = const { Cell::new(0) };
    }

    pub(super) fn step(n: usize) {
        STEPS.with(|s| s.set(s.get() + n));
    }

    /// Review of 2026-12-07, N4: 5 000 tasks woken in one tick, each several times (a stream
    /// with many sends in flight wakes its task once per completion), are each queued once and
    /// taken in the order first woken, in steps linear in the tasks (the old list took about
    /// 1.25e7 compares); asking whether there is work costs a step whatever the count.
    #[test]
    fn five_thousand_woken_tasks_are_taken_in_linear_steps_each_once() {
        const N: u64 = 5_000;
        let (_epoll, _inbox, mut a) = exec();
        let (_epoll_b, _inbox_b, b) = exec();
        let _inside = Inside::enter(a.id());
        for _ in 0..N {
            a.spawn(Box::pin(std::future::pending()));
        }
        let wakers: Vec<Rc<Waker>> = a.tasks.iter().map(|(_, t)| t.waker.clone()).collect();
        STEPS.with(|s| s.set(0));
        for _ in 0..3 {
            for w in &wakers {
                w.wake_by_ref();
            }
        }
        assert!(a.has_work() && !b.has_work());
        let mut into = Vec::new();
        a.take_woken(&mut into);
        let steps = STEPS.with(Cell::get);
        assert_eq!(into.len() as u64, N, "each task once, however often woken");
        let ids: Vec<u64> = a.tasks.iter().map(|(i, t)| u64::from(t.generation) << 32 | i as u64).collect();
        assert_eq!(into, ids, "in the order they were first woken (spawned)");
        // Each wake finds its flag set (no step); the take moves N entries after one compare.
        assert!(steps <= 2 * N as usize + 8, "{steps} steps for {N} tasks");
        assert!(!a.has_work(), "taken");
        STEPS.with(|s| s.set(0));
        assert!(!a.has_work());
        assert_eq!(STEPS.with(Cell::get), 0, "nothing woken on the thread: one load answers");
        // Taken to be polled, a task's flag is clear and its next wake queues it again.
        a.tasks.iter().for_each(|(_, t)| t.shared.queued.store(false, Ordering::Relaxed));
        wakers[7].wake_by_ref();
        wakers[7].wake_by_ref();
        let mut again = Vec::new();
        a.take_woken(&mut again);
        assert_eq!(again, vec![ids[7]]);
    }

    /// This thread's woken entries of executor `id`.
    fn woken_of(id: ExecId) -> usize {
        with_queue(id.0, |r| r.tasks.len()).unwrap_or(0)
    }

    /// Review of 2026-11-26, L5: a task of reactor A woken from inside reactor B's tick on the
    /// same thread must write A's eventfd (A may be asleep, under the tokio driver), and a wake
    /// from inside A's own tick need not.
    #[test]
    fn a_wake_from_inside_another_reactors_tick_nudges_its_own() {
        let (epoll_a, _inbox_a, mut a) = exec();
        let (epoll_b, _inbox_b, b) = exec();
        let shared = a.task_waker(7);
        let task = Waker::from(shared.clone());
        {
            let _inside = Inside::enter(a.id());
            task.wake_by_ref();
        }
        assert!(!nudged(&epoll_a), "woken inside its own reactor's tick: seen before it sleeps");
        assert!(a.has_work());
        // A's tick takes it to poll it (its flag cleared): the next wake queues it again.
        a.take_woken(&mut Vec::new());
        shared.queued.store(false, Ordering::Relaxed);
        {
            let _inside_b = Inside::enter(b.id());
            task.wake_by_ref();
            assert_eq!(INSIDE.with(Cell::get), b.id().0);
        }
        assert!(nudged(&epoll_a), "woken inside reactor B's tick: A must be woken");
        assert!(!nudged(&epoll_b), "B has nothing to do");
        assert!(!b.has_work());
        assert_eq!(INSIDE.with(Cell::get), 0, "left every tick");
        // Nested: A's poll inside B's, then back in B's.
        {
            let _b = Inside::enter(b.id());
            {
                let _a = Inside::enter(a.id());
                assert_eq!(INSIDE.with(Cell::get), a.id().0);
            }
            assert_eq!(INSIDE.with(Cell::get), b.id().0, "the outer reactor again");
        }
    }

    /// Late review of issue 32's M5 (F1): a handle dropped outside its reactor's tick (a
    /// task of another runtime, another reactor's tick) queues its close and must write its
    /// reactor's eventfd, which may be asleep (the tokio driver) and would keep the
    /// connection open until its next event; one dropped inside its own tick need not.
    #[test]
    fn an_orphan_queued_outside_its_reactors_tick_nudges_it() {
        let (epoll_a, _inbox_a, a) = exec();
        let (epoll_b, _inbox_b, b) = exec();
        let orphans = a.orphans.clone();
        let t = |i| Token::new(crate::proto::token::Kind::Conn, i, 1);
        {
            let _inside = Inside::enter(a.id());
            orphans.push(t(1));
        }
        assert!(!nudged(&epoll_a), "queued inside its own reactor's tick: closed before it sleeps");
        assert!(a.has_work());
        assert_eq!(a.orphans.take(), vec![t(1)]);
        orphans.push(t(2));
        assert!(nudged(&epoll_a), "queued outside any tick: its reactor must look");
        {
            let _inside_b = Inside::enter(b.id());
            orphans.push(t(3));
        }
        assert!(nudged(&epoll_a), "queued inside reactor B's tick: A must look");
        assert!(!nudged(&epoll_b), "B has nothing to close");
        assert!(!b.has_work());
        assert_eq!(a.orphans.take().len(), 2);
    }

    /// Late review of issue 32's M5 (F2): work a handle owes its reactor (a receive to post
    /// again after a message was handed out), queued where that reactor was not at hand, is
    /// kept for its next tick and wakes it, as an orphan's close does.
    #[test]
    fn work_deferred_outside_its_reactors_tick_waits_for_it_and_nudges_it() {
        let (epoll_a, _inbox_a, a) = exec();
        let orphans = a.orphans.clone();
        assert!(!a.has_work());
        {
            let _inside = Inside::enter(a.id());
            orphans.defer(Box::new(|_ctx| ()));
        }
        assert!(!nudged(&epoll_a), "queued inside its own tick: run before it sleeps");
        assert!(a.has_work(), "the tick must not sleep before running it");
        orphans.defer(Box::new(|_ctx| ()));
        assert!(nudged(&epoll_a), "queued outside any tick: its reactor must look");
        assert_eq!(a.orphans.take_deferred().len(), 2);
        assert!(!a.has_work());
    }

    /// Review of 2026-11-26, L5: the wakes of an executor that no longer exists are not kept
    /// on this thread's list (every tick of every reactor here scanned them, for ever).
    #[test]
    fn a_dropped_executors_wakes_are_purged_and_later_ones_dropped() {
        let (_epoll_a, _inbox_a, a) = exec();
        let (_epoll_b, _inbox_b, b) = exec();
        let (ida, idb) = (a.id(), b.id());
        let (task_a, task_b) = (a.waker(1), b.waker(2));
        task_a.wake_by_ref();
        task_b.wake_by_ref();
        assert_eq!((woken_of(ida), woken_of(idb)), (1, 1));
        drop(a);
        assert_eq!(woken_of(ida), 0, "the dropped executor's entries went with it");
        assert_eq!(woken_of(idb), 1, "the other's stay");
        task_a.wake_by_ref();
        task_a.wake_by_ref();
        assert_eq!(woken_of(ida), 0, "a wake after the drop adds nothing");
        assert!(b.has_work());
    }
}
