//! Closes and cancellations: after a close, dropped futures, a peer's close, a panicking task.

use super::*;

/// After a connection closed, its calls say so in one voice: `alloc` and `send` fail with
/// `Error::Closed` and the reason (`alloc` named a stale token while `send` said the
/// connection had closed).
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn after_the_close_every_call_says_closed_with_the_reason() {
    let _w = Watchdog::new("closed", LIMIT);
    {
        let mut r = Reactor::new().expect("reactor");
        let a = addr();
        let listener = r.block_on(async { Listener::bind(a) }).expect("block_on").expect("listen");
        let ends = echo_server(&mut r, listener);
        let said = r
            .block_on(async move {
                let conn = Connection::connect(a, ConnectOptions::default()).await.expect("connect");
                let buf = conn.alloc(64).expect("buffer");
                assert_eq!(conn.close().await, CloseReason::Local);
                let alloc = conn.alloc(64).map(|_| ()).expect_err("alloc after the close");
                let (send, _) = conn.send(buf).await;
                let send = send.expect_err("send after the close");
                for e in [&alloc, &send] {
                    assert!(matches!(e, Error::Closed(CloseReason::Local)), "{e:?}");
                }
                format!("alloc: {alloc}; send: {send}")
            })
            .expect("block_on");
        run_until(&mut r, LIMIT, || ends.borrow().len() == 1);
        println!("{said}");
    }
    assert_eq!(res_counts(owner_id()), ResCounts { qp: 0, cq: 0, mr: 0, pd: 0, cm_id: 0 });
}

/// Sends whose futures are dropped right after they were submitted: the operations are not
/// cancelled (the peer gets every message), their completions are reaped, and their buffers
/// go back to the pool: the buffers in use return to the baseline, and nothing is left of the
/// connections.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_future_dropped_mid_flight_returns_its_buffer_and_leaks_nothing() {
    const DROPPED: u64 = 16;
    let _w = Watchdog::new("dropped futures", LIMIT);
    {
        let mut r = Reactor::new().expect("reactor");
        let a = addr();
        let listener = r.block_on(async { Listener::bind(a) }).expect("block_on").expect("listen");
        let received = Rc::new(RefCell::new(Vec::new()));
        let rx = received.clone();
        let _server = r.spawn(async move {
            let conn = listener.accept().await.expect("accept");
            while let Ok(m) = conn.recv().await {
                rx.borrow_mut().push(m.as_slice().to_vec());
            }
        });
        let conn = r
            .block_on(Connection::connect(a, ConnectOptions { msg_size: 256, ..ConnectOptions::default() }))
            .expect("block_on")
            .expect("connect");
        // The server's receives grow with its traffic, one a message, to its depth (64, issue
        // 45): grown first, so that what this test counts is the dropped futures' buffers.
        let c = conn.clone();
        r.block_on(async move {
            for i in 0..64 {
                let buf = c.alloc_from(&pattern(256, 8, i)).expect("buffer");
                c.send(buf).await.0.expect("a warm-up send");
            }
        })
        .expect("block_on");
        run_until(&mut r, LIMIT, || received.borrow().len() == 64);
        received.borrow_mut().clear();
        // Settled: the server task waits for a message, both sides' receives are posted.
        let end = Instant::now() + LIMIT;
        while r.stats().connections < 2
            || (0..20).any(|_| r.run_once(Some(Duration::from_millis(1))).expect("tick") > 0)
        {
            assert!(Instant::now() < end, "not settled: {:?}", r.stats());
            r.run_once(Some(Duration::from_millis(10))).expect("run_once");
        }
        let baseline = r.stats().buffers_in_use;
        let c = conn.clone();
        let resolved = r
            .block_on(async move {
                let mut resolved = 0;
                for i in 0..DROPPED {
                    let buf = c.alloc_from(&pattern(256, 7, i)).expect("buffer");
                    resolved += u64::from(PollOnce(Some(Box::pin(c.send(buf)))).await);
                }
                resolved
            })
            .expect("block_on");
        run_until(&mut r, LIMIT, || received.borrow().len() as u64 == DROPPED);
        for _ in 0..20 {
            r.run_once(Some(Duration::from_millis(1))).expect("run_once");
        }
        let after = r.stats().buffers_in_use;
        println!(
            "{DROPPED} sends dropped after their submission ({resolved} had resolved at once); the peer received {}; \
             buffers in use {baseline} before, {after} after",
            received.borrow().len()
        );
        assert_eq!(resolved, 0, "a send cannot complete in the poll that submits it");
        for (i, m) in received.borrow().iter().enumerate() {
            assert_eq!(m, &pattern(256, 7, i as u64), "message {i}: not cancelled, every byte as sent");
        }
        assert_eq!(after, baseline, "every dropped future's buffer went back to the pool");
        drop(conn);
        let end = Instant::now() + LIMIT;
        while r.stats().connections > 0 {
            assert!(Instant::now() < end, "the dropped connection did not close: {:?}", r.stats());
            r.run_once(Some(Duration::from_millis(10))).expect("run_once");
        }
    }
    assert_eq!(res_counts(owner_id()), ResCounts { qp: 0, cq: 0, mr: 0, pd: 0, cm_id: 0 });
}

/// Five tasks wait on one connection (four for a message, one for its close) when the peer
/// closes it: each wakes, with the close reason.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_peer_close_wakes_every_waiting_task_with_the_reason() {
    let _w = Watchdog::new("peer close", LIMIT);
    let mut r = Reactor::new().expect("reactor");
    let a = addr();
    let listener = r.block_on(async { Listener::bind(a) }).expect("block_on").expect("listen");
    let server = r.spawn(async move {
        let conn = listener.accept().await.expect("accept");
        // Closes once the client's five tasks wait (a message says so).
        let m = conn.recv().await.expect("the go-ahead");
        assert_eq!(m.as_slice(), b"waiting");
        conn.close().await
    });
    let heard = r
        .block_on(async move {
            let conn = Connection::connect(a, ConnectOptions::default()).await.expect("connect");
            let mut waits = Vec::new();
            for _ in 0..4 {
                let c = conn.clone();
                waits.push(io::spawn(async move { format!("{:?}", c.recv().await.map(|b| b.len())) }).expect("spawn"));
            }
            let c = conn.clone();
            waits.push(io::spawn(async move { format!("close {}", c.closed().await) }).expect("spawn"));
            // Let the five tasks reach their await, then tell the server.
            io::spawn(async {}).expect("spawn").await.expect("a yield");
            let go = conn.alloc_from(b"waiting").expect("buffer");
            conn.send(go).await.0.expect("send");
            let mut heard = Vec::new();
            for w in waits {
                heard.push(w.await.expect("no panic"));
            }
            heard
        })
        .expect("block_on");
    let server_end = r.block_on(server).expect("block_on").expect("no panic");
    println!("the server closed ({server_end}); the client's tasks heard {heard:?}");
    assert_eq!(server_end, CloseReason::Local);
    let closed = format!("{:?}", Err::<usize, _>(Error::Closed(CloseReason::Peer)));
    assert_eq!(heard[..4], vec![closed; 4][..], "each waiting receiver woke with the reason");
    assert_eq!(heard[4], "close peer disconnected", "the close waiter too");
}

/// A task panics holding a connection: the panic reaches its JoinHandle, not the reactor; the
/// connection closes (its only handle was the task's), the server hears `Peer`; the reactor
/// serves a new connection after.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_panicking_task_closes_its_connection_and_the_reactor_goes_on() {
    let _w = Watchdog::new("panicking task", LIMIT);
    {
        let mut r = Reactor::new().expect("reactor");
        let a = addr();
        let listener = r.block_on(async { Listener::bind(a) }).expect("block_on").expect("listen");
        let ends = echo_server(&mut r, listener);
        let doomed = r.spawn(async move {
            let conn = Connection::connect(a, ConnectOptions::default()).await.expect("connect");
            let m = conn.alloc_from(b"before the panic").expect("buffer");
            conn.send(m).await.0.expect("send");
            let echo = conn.recv().await.expect("echo");
            assert_eq!(echo.as_slice(), b"before the panic");
            panic!("a task's bug");
        });
        let joined = r.block_on(doomed).expect("block_on");
        let payload = joined.expect_err("the panic reaches the JoinHandle");
        let text = payload.downcast_ref::<&str>().copied().unwrap_or("?");
        run_until(&mut r, LIMIT, || ends.borrow().len() == 1);
        println!("the task panicked ({text:?}); the server's end of its connection: {:?}", ends.borrow());
        assert_eq!(text, "a task's bug");
        assert_eq!(ends.borrow()[0], "peer disconnected", "the panicking task's connection closed");
        let again = r
            .block_on(async move {
                let conn = Connection::connect(a, ConnectOptions::default()).await?;
                let (sent, _) = conn.send(conn.alloc_from(b"after")?).await;
                sent?;
                let echo = conn.recv().await?;
                conn.close().await;
                Ok::<_, Error>(echo.as_slice().to_vec())
            })
            .expect("block_on")
            .expect("a new connection is served");
        assert_eq!(again, b"after");
        run_until(&mut r, LIMIT, || ends.borrow().len() == 2);
    }
    assert_eq!(res_counts(owner_id()), ResCounts { qp: 0, cq: 0, mr: 0, pd: 0, cm_id: 0 });
}
