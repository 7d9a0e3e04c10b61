//! Panics in callbacks and in handlers' `Drop`, and a reactor dropped with its thread's locals.

use super::*;

/// A panic in a callback (defect 9): it propagates out of `run_once`, and nothing is lost:
/// the handler stays with its connection, the rest of the polled batch is delivered by the
/// next tick, every message is still echoed and verified, and the connection closes once.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_panicking_callback_loses_nothing() {
    struct PanicOnce {
        inner: PingClient,
        completions: u32,
    }
    impl rdma_reactor::ConnectionHandler for PanicOnce {
        fn on_ready(&mut self, conn: &mut rdma_reactor::Conn<'_>) {
            self.inner.on_ready(conn)
        }
        fn on_established(&mut self, conn: &mut rdma_reactor::Conn<'_>) {
            self.inner.on_established(conn)
        }
        fn on_completion(&mut self, conn: &mut rdma_reactor::Conn<'_>, c: rdma_reactor::Completion) {
            self.completions += 1;
            // Handle the completion first, then panic: the panic must not lose the handler
            // or the completions polled with this one.
            self.inner.on_completion(conn, c);
            if self.completions == 7 {
                panic!("a user callback panics (on purpose)");
            }
        }
        fn on_closed(&mut self, ctx: &mut Ctx<'_>, t: rdma_reactor::Token, reason: CloseReason) {
            self.inner.on_closed(ctx, t, reason)
        }
    }
    {
        let (mut srv, a, _heard) = server(Config::default());
        let mut cli = Reactor::new().expect("client reactor");
        let (inner, result) = PingClient::new(1, SIZE, 50);
        let opts = ConnectOptions { msg_size: SIZE as u32, ..ConnectOptions::default() };
        cli.connect(a, opts, PanicOnce { inner, completions: 0 }).expect("connect");
        let mut panics = 0;
        let deadline = Instant::now() + LIMIT;
        while result.borrow().closed.is_none() {
            assert!(Instant::now() < deadline, "{:?}", result.borrow());
            srv.run_once(Some(Duration::from_millis(1))).expect("server run_once");
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                cli.run_once(Some(Duration::from_millis(1)))
            })) {
                Ok(r) => {
                    r.expect("client run_once");
                }
                Err(_) => panics += 1,
            }
        }
        let r = result.borrow();
        assert_eq!(panics, 1, "the panic reached the caller of run_once once");
        assert_eq!((r.echoed, r.verified_bytes, r.error.as_deref()), (50, 50 * SIZE as u64, None), "{r:?}");
        assert_eq!(r.closed, Some(CloseReason::Local));
    }
    assert_baseline();
}

/// Hostile review (issue 22), finding 8: a handler whose `Drop` panics. Handlers were dropped
/// outside the panic guard, so the first such panic unwound out of the reactor's bookkeeping
/// and the connections after it in the same pass (the tick's reap, or the shutdown's "close the
/// rest at once") never heard `on_closed` and were not destroyed. Here 4 client handlers panic
/// in `Drop`; a shutdown with no grace destroys them all in one pass: every one hears
/// `on_closed` (`Shutdown`), no kernel object is left, the panic reaches the caller once, and
/// the reactor serves a new connection afterwards.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_handler_panicking_in_drop_loses_no_other_connection() {
    struct PanicInDrop(PingClient);
    impl rdma_reactor::ConnectionHandler for PanicInDrop {
        fn on_ready(&mut self, conn: &mut rdma_reactor::Conn<'_>) {
            self.0.on_ready(conn)
        }
        fn on_established(&mut self, conn: &mut rdma_reactor::Conn<'_>) {
            self.0.on_established(conn)
        }
        fn on_completion(&mut self, conn: &mut rdma_reactor::Conn<'_>, c: rdma_reactor::Completion) {
            self.0.on_completion(conn, c)
        }
        fn on_closed(&mut self, ctx: &mut Ctx<'_>, t: rdma_reactor::Token, reason: CloseReason) {
            self.0.on_closed(ctx, t, reason)
        }
    }
    impl Drop for PanicInDrop {
        fn drop(&mut self) {
            panic!("a handler's Drop panics (on purpose)");
        }
    }
    {
        let (mut srv, a, _heard) = server(Config::default());
        let mut cli = Reactor::new().expect("client reactor");
        let mut results = Vec::new();
        for id in 0..4 {
            let (inner, result) = PingClient::new(id, SIZE, u64::MAX);
            let opts = ConnectOptions { msg_size: SIZE as u32, ..ConnectOptions::default() };
            cli.connect(a, opts, PanicInDrop(inner)).expect("connect");
            results.push(result);
        }
        pump(&mut [&mut srv, &mut cli], LIMIT, || results.iter().all(|r| r.borrow().echoed >= 3));
        let shut = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cli.shutdown(Duration::ZERO)));
        let heard: Vec<_> = results.iter().map(|r| r.borrow().closed.clone()).collect();
        let how = if shut.is_err() { "resumed a panic" } else { "returned" };
        println!("finding 8: shutdown {how}; the 4 connections heard {heard:?}; client {cli:?}");
        assert!(shut.is_err(), "the handlers' panic reached the caller");
        assert!(heard.iter().all(|c| *c == Some(CloseReason::Shutdown)), "every connection heard on_closed: {heard:?}");
        assert!(cli.is_idle(), "every connection destroyed: {cli:?}");
        // The reactor keeps serving.
        let again = ping(&mut cli, a, 9, 5);
        pump(&mut [&mut srv, &mut cli], LIMIT, || closed(&again));
        assert_eq!((again.borrow().echoed, again.borrow().error.as_deref()), (5, None));
    }
    assert_baseline();
}

/// A reactor kept in a `thread_local!` (a common way to give each thread its own) is dropped
/// by the thread-local destructors at thread exit. The reactor's store for panics raised by
/// handlers' `Drop` is a thread-local too, first used by the reactor's first tick, so it was
/// destroyed first; the reactor's drop then used it (`LocalKey::with` panics there), and a
/// panic in a thread-local destructor aborts the process. Here a thread serves a connection
/// from a thread-local reactor and exits: the test binary survives it, the connection heard
/// `on_closed`, and nothing is left behind.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_reactor_in_a_thread_local_is_dropped_at_thread_exit_without_aborting() {
    thread_local! {
        static REACTOR: RefCell<Option<Reactor>> = const { RefCell::new(None) };
    }
    let (mut srv, a, heard) = server(Config::default());
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<(u64, Option<String>)>();
    let worker = std::thread::spawn(move || {
        // The thread-local is first used (its destructor registered) before the reactor ticks.
        REACTOR.with(|r| *r.borrow_mut() = Some(Reactor::new().expect("client reactor")));
        let p = REACTOR.with(|r| ping(r.borrow_mut().as_mut().expect("set"), a, 1, 5));
        let deadline = Instant::now() + LIMIT;
        while p.borrow().echoed < 5 && p.borrow().error.is_none() && Instant::now() < deadline {
            REACTOR.with(|r| {
                r.borrow_mut().as_mut().expect("set").run_once(Some(Duration::from_millis(1))).expect("tick")
            });
        }
        done_tx.send((p.borrow().echoed, p.borrow().error.clone())).expect("report");
        // Exit only once the server has ticked past the echoes; the reactor is then dropped by
        // the thread-local destructors, with its connection still open.
        let _ = rx.recv();
    });
    let mut report = None;
    pump(&mut [&mut srv], LIMIT, || {
        report = report.take().or_else(|| done_rx.try_recv().ok());
        report.is_some()
    });
    assert_eq!(report, Some((5, None)), "the thread-local reactor's client was served");
    tx.send(()).expect("release the worker");
    // The server keeps ticking while the worker's reactor shuts its connection down.
    pump(&mut [&mut srv], LIMIT, || worker.is_finished());
    let joined = worker.join();
    assert!(joined.is_ok(), "the worker thread panicked: {joined:?}");
    pump(&mut [&mut srv], LIMIT, || !heard.borrow().agents_closed.borrow().is_empty());
    println!(
        "a thread-local reactor dropped at thread exit: the process lives, the server's agent closed with {:?}",
        heard.borrow().agents_closed.borrow()
    );
    drop(srv);
    assert_baseline();
}
