//! The reactor among other threads and loops: the cross-thread `Remote`, application fds in
//! its epoll set, and the reactor nested in an outer `poll(2)` loop (`examples/embed.rs`).
//!
//! A reactor needs the rdma_cm event channel, so these run in the VM (`cargo xtask test`);
//! the pipes, eventfds and timerfds they use need no RDMA.

mod util;

use std::cell::{Cell, RefCell};
use std::os::fd::{AsFd, OwnedFd};
use std::rc::Rc;
use std::time::{Duration, Instant};

use nix::fcntl::OFlag;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::time::TimeSpec;
use nix::sys::timerfd::{ClockId, Expiration, TimerFd, TimerFlags, TimerSetTimeFlags};
use rdma_reactor::{ConnectOptions, FdEvent, Interest, Reactor, ReactorGone, Readiness};
use util::*;

const LIMIT: Duration = Duration::from_secs(30);

fn pipe() -> (OwnedFd, OwnedFd) {
    nix::unistd::pipe2(OFlag::O_NONBLOCK | OFlag::O_CLOEXEC).expect("pipe2")
}

/// Reads everything the pipe holds.
fn drain(fd: &OwnedFd) -> usize {
    let mut buf = [0u8; 64];
    let mut n = 0;
    while let Ok(k @ 1..) = nix::unistd::read(fd, &mut buf) {
        n += k;
    }
    n
}

/// A thread holding a `Remote` sends messages to a reactor blocked in `run()` (it listens, so
/// it is not idle), then stops it: `run()` returns with every message delivered, in order, to
/// the handler on the reactor's thread. Once the reactor is dropped, the handle says so.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn remote_delivers_messages_and_stops_a_running_reactor_from_another_thread() {
    let mut reactor = Reactor::new().expect("reactor");
    reactor.listen(addr(), EchoListener { depth: 1, agents_closed: Default::default() }).expect("listen");
    assert_eq!(reactor.next_timeout(), None, "a listening reactor waits for its fds alone");
    let got = Rc::new(RefCell::new(Vec::new()));
    let on_thread = std::thread::current().id();
    let g = got.clone();
    reactor.set_message_handler(move |ctx, msg| {
        assert_eq!(std::thread::current().id(), on_thread, "delivered on the reactor's thread");
        assert_eq!(ctx.connections(), 0);
        g.borrow_mut().push(msg);
    });
    let remote = reactor.remote();
    let sender = {
        let remote = remote.clone();
        std::thread::spawn(move || {
            // Let the reactor block in epoll_wait first.
            std::thread::sleep(Duration::from_millis(300));
            for m in 0..1000u64 {
                remote.send(m).expect("the reactor is alive");
            }
            remote.stop().expect("the reactor is alive");
        })
    };
    let t0 = Instant::now();
    reactor.run().expect("run");
    let took = t0.elapsed();
    sender.join().expect("sender thread");
    assert!(took >= Duration::from_millis(250), "run() returned before the stop: {took:?}");
    assert!(took < LIMIT, "{took:?}");
    assert_eq!(*got.borrow(), (0..1000).collect::<Vec<_>>(), "every message, in order, before run() returned");
    assert_eq!(reactor.listeners(), 1, "stopping closes nothing");
    println!("run() stopped after {took:?}; {:?}", reactor.stats());

    // Again, from two threads at once; the stop comes last.
    got.borrow_mut().clear();
    let senders: Vec<_> = (0..2u64)
        .map(|t| {
            let remote = remote.clone();
            std::thread::spawn(move || (0..500).for_each(|i| remote.send(t << 32 | i).expect("alive")))
        })
        .collect();
    senders.into_iter().for_each(|s| s.join().expect("sender"));
    remote.stop().expect("alive");
    reactor.run().expect("run");
    assert_eq!(got.borrow().len(), 1000);

    assert!(remote.is_alive());
    drop(reactor);
    assert!(!remote.is_alive());
    assert_eq!(remote.send(1), Err(ReactorGone), "an error, not a panic");
    assert_eq!(remote.stop(), Err(ReactorGone));
}

/// A registered pipe's callback gets its user_data and readiness on the reactor's thread; the
/// pipe keeps the reactor from being idle; once deregistered, no more callbacks.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_registered_pipe_gets_its_callback_and_none_after_deregistering() {
    let mut reactor = Reactor::new().expect("reactor");
    assert!(reactor.is_idle());
    let (r, w) = pipe();
    let r = Rc::new(r);
    let events: Rc<RefCell<Vec<(FdEvent, usize)>>> = Default::default();
    let (ev, rr) = (events.clone(), r.clone());
    let token = reactor
        .ctx()
        .register_fd(&*r, Interest::READABLE, 0xfeed, move |_ctx: &mut rdma_reactor::Ctx<'_>, e: FdEvent| {
            let n = drain(&rr);
            ev.borrow_mut().push((e, n));
        })
        .expect("register the pipe");
    assert!(!reactor.is_idle(), "a registered fd is work");
    assert_eq!(reactor.ctx().registered_fds(), 1);

    reactor.run_once(Some(Duration::from_millis(50))).expect("run_once");
    assert!(events.borrow().is_empty(), "nothing written yet");
    nix::unistd::write(&w, b"hello").expect("write");
    run_until(&mut reactor, LIMIT, || !events.borrow().is_empty());
    {
        let e = events.borrow();
        assert_eq!(e.len(), 1, "drained in its callback: called once");
        assert_eq!(e[0].0.user_data, 0xfeed);
        assert_eq!(e[0].0.token, token);
        assert_eq!(e[0].0.readiness, Readiness::READABLE);
        assert_eq!(e[0].1, 5, "the callback read what was written");
    }

    assert!(reactor.ctx().deregister_fd(token));
    assert!(!reactor.ctx().deregister_fd(token), "a second deregistration finds nothing");
    assert!(reactor.is_idle());
    nix::unistd::write(&w, b"more").expect("write");
    for _ in 0..5 {
        reactor.run_once(Some(Duration::from_millis(20))).expect("run_once");
    }
    assert_eq!(events.borrow().len(), 1, "no callback after deregistering");
    assert_eq!(drain(&r), 4, "the data is still in the pipe, unread");

    // Writable interest, then none: level-triggered, so it fires every tick until changed.
    let writes = Rc::new(Cell::new(0u32));
    let wc = writes.clone();
    let wt = reactor
        .ctx()
        .register_fd(&w, Interest::WRITABLE, 2, move |ctx: &mut rdma_reactor::Ctx<'_>, e: FdEvent| {
            assert_eq!((e.user_data, e.readiness), (2, Readiness::WRITABLE));
            wc.set(wc.get() + 1);
            if wc.get() == 3 {
                ctx.set_fd_interest(e.token, Interest::empty()).expect("modify");
            }
        })
        .expect("register the write end");
    for _ in 0..6 {
        reactor.run_once(Some(Duration::from_millis(10))).expect("run_once");
    }
    assert_eq!(writes.get(), 3, "level-triggered until its interest was cleared");
    reactor.shutdown(Duration::from_secs(1));
    assert!(reactor.is_idle(), "shutdown deregisters fds");
    assert!(!reactor.ctx().deregister_fd(wt));
}

/// A timerfd's callback counts its expirations and deregisters itself after five: `run()`
/// returns, the reactor being idle. Then an fd closed by the application before it is
/// deregistered: the loop keeps working (the reactor holds its own duplicate).
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_timerfd_deregisters_itself_and_a_closed_fd_does_not_break_the_loop() {
    let mut reactor = Reactor::new().expect("reactor");
    let timer = Rc::new(
        TimerFd::new(ClockId::CLOCK_MONOTONIC, TimerFlags::TFD_NONBLOCK | TimerFlags::TFD_CLOEXEC).expect("timerfd"),
    );
    timer
        .set(Expiration::Interval(TimeSpec::from_duration(Duration::from_millis(10))), TimerSetTimeFlags::empty())
        .expect("timerfd_settime");
    let fired = Rc::new(Cell::new(0u64));
    let (f, t) = (fired.clone(), timer.clone());
    reactor
        .ctx()
        .register_fd(timer.as_fd(), Interest::READABLE, 7, move |ctx: &mut rdma_reactor::Ctx<'_>, e: FdEvent| {
            assert_eq!(e.user_data, 7);
            let mut n = [0u8; 8];
            if nix::unistd::read(t.as_fd(), &mut n).is_ok() {
                f.set(f.get() + u64::from_ne_bytes(n));
            }
            if f.get() >= 5 {
                assert!(ctx.deregister_fd(e.token), "deregistered from its own callback");
            }
        })
        .expect("register the timerfd");
    let t0 = Instant::now();
    reactor.run().expect("run returns once the timerfd is gone");
    assert!(fired.get() >= 5, "{}", fired.get());
    assert!(t0.elapsed() >= Duration::from_millis(40), "{:?}", t0.elapsed());

    // The application closes both ends of a registered pipe: the reactor's duplicate of the
    // read end sees the hangup; the callback deregisters; the loop goes on.
    let (r, w) = pipe();
    let heard: Rc<RefCell<Vec<Readiness>>> = Default::default();
    let h = heard.clone();
    let token = reactor
        .ctx()
        .register_fd(&r, Interest::READABLE, 9, move |ctx: &mut rdma_reactor::Ctx<'_>, e: FdEvent| {
            h.borrow_mut().push(e.readiness);
            ctx.deregister_fd(e.token);
        })
        .expect("register");
    drop(r);
    drop(w);
    run_until(&mut reactor, LIMIT, || !heard.borrow().is_empty());
    assert!(heard.borrow()[0].contains(Readiness::HANGUP), "{:?}", heard.borrow());
    assert!(!reactor.ctx().deregister_fd(token));
    for _ in 0..3 {
        assert_eq!(reactor.run_once(Some(Duration::from_millis(10))).expect("run_once"), 0);
    }
    assert_eq!(heard.borrow().len(), 1);

    // Closed without any callback, then deregistered from outside: no error, no stuck fd.
    let (r, w) = pipe();
    let token = reactor
        .ctx()
        .register_fd(&r, Interest::READABLE, 10, |_: &mut rdma_reactor::Ctx<'_>, _: FdEvent| panic!("not ready"))
        .expect("register");
    drop(r);
    assert!(reactor.ctx().deregister_fd(token));
    nix::unistd::write(&w, b"x").expect_err("no reader is left: EPIPE");
    assert_eq!(reactor.run_once(Some(Duration::from_millis(10))).expect("run_once"), 0);
    assert!(reactor.is_idle());
}

/// The reactor nested in a `poll(2)` loop in this test: it waits on the reactor's fd at most
/// `next_timeout()`, and ticks it with `run_once(Some(ZERO))`. An echo listener and verifying
/// ping-pong clients in the nested reactor complete.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn nested_in_a_poll_loop_an_echo_completes() {
    let mut reactor = Reactor::new().expect("reactor");
    let server = addr();
    reactor.listen(server, EchoListener { depth: 8, agents_closed: Default::default() }).expect("listen");
    let mut results = Vec::new();
    for i in 0..3 {
        let (c, result) = PingClient::new(i, 1024, 300);
        reactor.connect(server, ConnectOptions { msg_size: 1024, ..Default::default() }, c).expect("connect");
        results.push(result);
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    let (mut waits, mut ready_ticks) = (0u64, 0u64);
    while !results.iter().all(|r| r.borrow().closed.is_some()) {
        assert!(Instant::now() < deadline, "not done: {reactor:?} {:?}", reactor.stats());
        let timeout = reactor.next_timeout().map_or(PollTimeout::from(200u16), |d| {
            PollTimeout::try_from(d.as_micros().div_ceil(1000).min(200)).expect("at most 200 ms")
        });
        let readable = {
            let mut fds = [PollFd::new(reactor.as_fd(), PollFlags::POLLIN)];
            waits += 1;
            poll(&mut fds, timeout).expect("poll") > 0
        };
        ready_ticks += u64::from(readable);
        reactor.run_once(Some(Duration::ZERO)).expect("run_once");
    }
    for r in &results {
        let r = r.borrow();
        assert_eq!(r.error, None);
        assert_eq!(r.verified_bytes, 300 * 1024);
    }
    assert!(ready_ticks > 0);
    println!("{waits} waits, {ready_ticks} with the reactor's fd readable; {:?}", reactor.stats());
}

/// `examples/embed.rs`: the reactor nested in a `poll(2)` loop with a timerfd and stdin
/// serves its own verifying clients and an `echo client` process, then exits 0.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn the_embed_example_serves_its_clients_and_another_process() {
    let server = addr();
    let s = server.to_string();
    let embed =
        Proc::spawn("embed", bin("embed"), &["--bind", &s, "--clients", "2", "--count", "300", "--exit-after", "4"]);
    wait_listening(server, LIMIT);
    let (ok, out) = run_output(
        bin("echo"),
        &["client", "--connect", &s, "--size", "2048", "--count", "300", "--clients", "2", "--verify"],
        Duration::from_secs(120),
    );
    println!("{out}");
    assert!(ok, "echo client failed");
    let status = embed.wait(Duration::from_secs(120));
    assert!(status.success(), "embed: {status}");
}
