//! Many tasks on one connection and across connections, RPC tasks, and the timers tasks use.

use super::*;

/// Connections × sender tasks each: every task sends its messages concurrently with the
/// others on the same connection; one receiver task per connection takes every echo and
/// checks it against the pattern its header names. Every message arrives once, every byte as
/// sent.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn many_tasks_on_one_connection_and_across_connections_every_byte_verified() {
    const CONNS: u64 = 4;
    const SENDERS: u64 = 8;
    const MESSAGES: u64 = 40;
    const SIZE: usize = 1024;
    let _w = Watchdog::new("many tasks", LIMIT);
    {
        let mut r = Reactor::new().expect("reactor");
        let a = addr();
        let listener = r.block_on(async { Listener::bind(a) }).expect("block_on").expect("listen");
        let ends = echo_server(&mut r, listener);
        let before = r.stats();
        let verified = r
            .block_on(async move {
                let mut conns = Vec::new();
                for c in 0..CONNS {
                    let opts = ConnectOptions { msg_size: SIZE as u32, ..ConnectOptions::default() };
                    conns.push((c, Connection::connect(a, opts).await.expect("connect")));
                }
                let mut joins = Vec::new();
                for (c, conn) in &conns {
                    for s in 0..SENDERS {
                        let (conn, task) = (conn.clone(), c * 100 + s);
                        joins.push(
                            io::spawn(async move {
                                let mut buf = conn.alloc(SIZE).expect("buffer");
                                for seq in 0..MESSAGES {
                                    buf.fill_from(&tagged(SIZE, task, seq)).expect("fits");
                                    let (sent, back) = conn.send(buf).await;
                                    sent.expect("send");
                                    buf = back.expect("the buffer comes back");
                                }
                                0
                            })
                            .expect("spawn"),
                        );
                    }
                    let conn = conn.clone();
                    let c = *c;
                    joins.push(
                        io::spawn(async move {
                            let mut seen = std::collections::BTreeSet::new();
                            for _ in 0..SENDERS * MESSAGES {
                                let m = conn.recv().await.expect("echo");
                                let b = m.as_slice();
                                let task = u64::from_be_bytes(b[..8].try_into().unwrap());
                                let seq = u64::from_be_bytes(b[8..16].try_into().unwrap());
                                assert_eq!(task / 100, c, "an echo of another connection's message");
                                assert_eq!(b, &tagged(SIZE, task, seq)[..], "task {task} message {seq}");
                                assert!(seen.insert((task, seq)), "task {task} message {seq} twice");
                            }
                            let reason = conn.close().await;
                            assert_eq!(reason, CloseReason::Local);
                            seen.len() as u64
                        })
                        .expect("spawn"),
                    );
                }
                let mut verified = 0;
                for j in joins {
                    verified += j.await.expect("no task panicked");
                }
                verified
            })
            .expect("block_on");
        run_until(&mut r, LIMIT, || ends.borrow().len() == CONNS as usize);
        let st = r.stats();
        println!(
            "{CONNS} connections x {SENDERS} sender tasks x {MESSAGES} messages of {SIZE} B: {verified} echoes \
             verified; server ends {:?}; post_send calls {} for {} requests; tasks left {}",
            ends.borrow(),
            st.post_send_calls - before.post_send_calls,
            st.wrs_posted - before.wrs_posted,
            r.tasks()
        );
        assert_eq!(verified, CONNS * SENDERS * MESSAGES, "every message echoed once, every byte as sent");
        assert!(ends.borrow().iter().all(|e| e == "peer disconnected"), "{:?}", ends.borrow());
        assert!(
            st.post_send_calls - before.post_send_calls < st.wrs_posted - before.wrs_posted,
            "sends of tasks polled in one tick are posted as one chain"
        );
        assert_eq!(r.tasks(), 1, "only the accept loop is left");
    }
    assert_eq!(res_counts(owner_id()), ResCounts { qp: 0, cq: 0, mr: 0, pd: 0, cm_id: 0 });
}

/// RPC clients sharing one connection, as a new user would write them: `tasks` tasks, each with
/// its own clone of one `Connection`, each sending a request and then awaiting its reply,
/// `pairs` times; the server echoes, so every reply must be the task's own request.
/// `Connection::recv` hands messages to the callers in the order they asked: a task woken for
/// a reply owns it, whatever other task is polled first (it did not: replies were taken by
/// the first `Recv` polled, and tasks received each other's).
fn rpc_tasks_on_one_connection(tasks: u64, pairs: u64) {
    const SIZE: usize = 64;
    let _w = Watchdog::new("rpc tasks", Duration::from_secs(600));
    {
        let mut r = Reactor::new().expect("reactor");
        let a = addr();
        let listener = r.block_on(async { Listener::bind(a) }).expect("block_on").expect("listen");
        let ends = echo_server(&mut r, listener);
        let started = Instant::now();
        let matched = r
            .block_on(async move {
                let opts = ConnectOptions { msg_size: SIZE as u32, ..ConnectOptions::default() };
                let conn = Connection::connect(a, opts).await.expect("connect");
                let mut joins = Vec::new();
                for task in 0..tasks {
                    let conn = conn.clone();
                    joins.push(
                        io::spawn(async move {
                            let mut buf = conn.alloc(SIZE).expect("buffer");
                            for seq in 0..pairs {
                                let request = tagged(SIZE, task, seq);
                                buf.fill_from(&request).expect("fits");
                                let (sent, _) = conn.send(buf).await;
                                sent.expect("request sent");
                                let reply = conn.recv().await.expect("reply");
                                let b = reply.as_slice();
                                let (t, q) = (
                                    u64::from_be_bytes(b[..8].try_into().unwrap()),
                                    u64::from_be_bytes(b[8..16].try_into().unwrap()),
                                );
                                assert!(
                                    b == &request[..],
                                    "task {task}, request {seq}: the reply is task {t}'s request {q}"
                                );
                                buf = reply;
                            }
                            pairs
                        })
                        .expect("spawn"),
                    );
                }
                let mut matched = 0;
                for j in joins {
                    matched += j.await.expect("every reply matched to its request");
                }
                assert_eq!(conn.close().await, CloseReason::Local);
                matched
            })
            .expect("block_on");
        run_until(&mut r, LIMIT, || ends.borrow().len() == 1);
        println!(
            "{tasks} tasks x {pairs} request/response pairs on one connection: {matched} replies matched to \
             their requests in {:?}",
            started.elapsed()
        );
        assert_eq!(matched, tasks * pairs);
    }
    assert_eq!(res_counts(owner_id()), ResCounts { qp: 0, cq: 0, mr: 0, pd: 0, cm_id: 0 });
}

#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn two_rpc_tasks_on_one_connection_each_get_their_own_replies() {
    rpc_tasks_on_one_connection(2, 10_000);
}

#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn eight_rpc_tasks_on_one_connection_each_get_their_own_replies() {
    rpc_tasks_on_one_connection(8, 10_000);
}

/// The async face's timers: `io::timeout` bounds a `recv` on a quiet connection (it ends with
/// `Error::Elapsed` no sooner than its limit, and the `Recv` it drops leaves the line, so the
/// next message goes to the next caller), `io::sleep` sleeps at least its time, and a sleep
/// polled and dropped before its time is cancelled without harm.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_timeout_bounds_a_recv_and_no_message_is_lost() {
    const SIZE: usize = 64;
    let _w = Watchdog::new("timeout", LIMIT);
    {
        let mut r = Reactor::new().expect("reactor");
        let a = addr();
        let listener = r.block_on(async { Listener::bind(a) }).expect("block_on").expect("listen");
        let ends = echo_server(&mut r, listener);
        let report = r
            .block_on(async move {
                let opts = ConnectOptions { msg_size: SIZE as u32, ..ConnectOptions::default() };
                let conn = Connection::connect(a, opts).await.expect("connect");
                let t0 = Instant::now();
                let quiet = io::timeout(Duration::from_millis(200), conn.recv()).await;
                let waited = t0.elapsed();
                assert!(matches!(quiet, Err(Error::Elapsed(d)) if d == Duration::from_millis(200)), "{quiet:?}");
                assert!(waited >= Duration::from_millis(200), "timed out after {waited:?}");
                let t1 = Instant::now();
                io::sleep(Duration::from_millis(50)).await.expect("sleep");
                let slept = t1.elapsed();
                assert!(slept >= Duration::from_millis(50), "slept {slept:?}");
                // A sleep given up before its time (polled once, on the timers, then dropped).
                assert!(!PollOnce(Some(Box::pin(io::sleep(Duration::from_secs(3600))))).await);
                let mut buf = conn.alloc(SIZE).expect("buffer");
                buf.fill_from(&tagged(SIZE, 7, 1)).expect("fits");
                let (sent, _) = conn.send(buf).await;
                sent.expect("send");
                let echo = io::timeout(Duration::from_secs(10), conn.recv()).await.expect("in time").expect("echo");
                assert_eq!(echo.as_slice(), &tagged(SIZE, 7, 1)[..], "the echo reaches the next caller");
                assert_eq!(conn.close().await, CloseReason::Local);
                format!("recv timed out after {waited:?}; slept {slept:?} for 50 ms")
            })
            .expect("block_on");
        run_until(&mut r, LIMIT, || ends.borrow().len() == 1);
        println!("{report}");
    }
    assert_eq!(res_counts(owner_id()), ResCounts { qp: 0, cq: 0, mr: 0, pd: 0, cm_id: 0 });
}

/// Under the tokio driver, tokio's timers work inside a task of the reactor (as the io docs
/// say), beside the reactor's own `io::sleep`.
#[cfg(feature = "tokio")]
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn tokio_timers_work_inside_the_reactors_tasks_under_the_driver() {
    let _w = Watchdog::new("tokio timers", LIMIT);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
    let mut r = Reactor::new().expect("reactor");
    let task = r.spawn(async {
        let t0 = Instant::now();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let tokio_slept = t0.elapsed();
        let t1 = Instant::now();
        io::sleep(Duration::from_millis(50)).await.expect("io::sleep");
        (tokio_slept, t1.elapsed())
    });
    let (tokio_slept, io_slept) = rt
        .block_on(async { io::tokio::drive(&mut r, task).expect("driver").await })
        .expect("the reactor's loop")
        .expect("the task did not panic");
    println!("inside a reactor task under the tokio driver: tokio slept {tokio_slept:?}, io::sleep {io_slept:?}");
    assert!(tokio_slept >= Duration::from_millis(50) && io_slept >= Duration::from_millis(50));
}
