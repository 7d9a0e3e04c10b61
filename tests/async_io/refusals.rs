//! What the async face refuses: a reconnect policy, a handle polled by another reactor.

use super::*;

/// The async face refuses a reconnect policy (its state follows one queue pair), before it
/// needs a reactor or a device: runs on the host.
#[test]
fn a_reconnect_policy_is_refused_by_the_async_face() {
    use std::task::{Wake, Waker};
    struct Nothing;
    impl Wake for Nothing {
        fn wake(self: Arc<Self>) {}
    }
    let opts = ConnectOptions { reconnect: Some(rdma_reactor::Reconnect::default()), ..ConnectOptions::default() };
    let mut connect = std::pin::pin!(Connection::connect("127.0.0.1:1".parse().expect("address"), opts));
    let waker = Waker::from(Arc::new(Nothing));
    match connect.as_mut().poll(&mut Context::from_waker(&waker)) {
        Poll::Ready(Err(Error::Unsupported(why))) => assert!(why.contains("reconnect"), "{why}"),
        other => panic!("{:?}", other.map(|r| r.map(|_| ()))),
    }
}

/// Two reactors on one thread, each with one client connection (the first connection of each:
/// the same token), and reactor A's `Connection` used by a task of reactor B (review of
/// 2026-11-26, M5; issue 32). The handle belongs to A: B refuses it with `Error::NoReactor`
/// ("... belongs to another reactor ..."), hands the buffer back, and closes nothing of its
/// own; B's connection, and the server's end of it, see nothing of A's. Before the fix the
/// token was looked up in B's table: `alloc` took a buffer of B's pool and the send went out
/// on B's connection, so B's peer received A's bytes.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_handle_polled_by_another_reactor_on_its_thread_is_refused() {
    let _w = Watchdog::new("foreign handle", LIMIT);
    let a = addr();
    let mut s = Reactor::new().expect("server reactor");
    let mut ra = Reactor::new().expect("reactor A");
    let mut rb = Reactor::new().expect("reactor B");
    let listener = s.block_on(async { Listener::bind(a) }).expect("block_on").expect("listen");
    // What the server received, per connection in accept order.
    let got: Rc<RefCell<Vec<Vec<Vec<u8>>>>> = Rc::default();
    let g = got.clone();
    let _server = s.spawn(async move {
        while let Ok(conn) = listener.accept().await {
            let i = {
                let mut g = g.borrow_mut();
                g.push(Vec::new());
                g.len() - 1
            };
            let g = g.clone();
            let _recv = io::spawn(async move {
                while let Ok(m) = conn.recv().await {
                    g.borrow_mut()[i].push(m.as_slice().to_vec());
                }
            })
            .expect("on the reactor");
        }
    });
    let connect = |r: &mut Reactor| {
        let out: Rc<RefCell<Option<Connection>>> = Rc::default();
        let o = out.clone();
        let _connect = r.spawn(async move {
            *o.borrow_mut() = Some(Connection::connect(a, ConnectOptions::default()).await.expect("connect"));
        });
        out
    };
    let ca = connect(&mut ra);
    pump(&mut [&mut s, &mut ra], LIMIT, "A connects", || ca.borrow().is_some() && got.borrow().len() == 1);
    let cb = connect(&mut rb);
    pump(&mut [&mut s, &mut rb], LIMIT, "B connects", || cb.borrow().is_some() && got.borrow().len() == 2);
    let conn_a = ca.borrow_mut().take().expect("connected");
    let conn_b = cb.borrow_mut().take().expect("connected");
    assert_eq!(conn_a.token(), conn_b.token(), "the first connection of each reactor has the same token");
    let buf_a = ra.block_on(async { conn_a.alloc_from(b"made by A") }).expect("block_on").expect("A's buffer");

    // A's handle in a task of B: every call is refused.
    let said: Rc<RefCell<Option<Vec<String>>>> = Rc::default();
    let (sd, foreign) = (said.clone(), conn_a.clone());
    let _misuse = rb.spawn(async move {
        let mut out = Vec::new();
        match foreign.alloc_from(b"A's secret") {
            Ok(buf) => {
                // The bug: a buffer of B's pool, and a send on B's connection.
                let sent = io::timeout(Duration::from_secs(1), foreign.send(buf)).await;
                out.push(format!("alloc succeeded; send: {:?}", sent.map(|(r, _)| r)));
            }
            Err(e) => {
                out.push(format!("alloc: {e:?}: {e}"));
                let (sent, back) = foreign.send(buf_a).await;
                out.push(format!("send: {sent:?}, buffer back: {}", back.is_some()));
                let exposed = back.map(|b| foreign.expose(b, rdma_reactor::RemoteAccess::READ).map(|_| ()));
                out.push(format!("expose: {exposed:?}"));
                out.push(format!("peer_addr: {:?}", foreign.peer_addr()));
                out.push(format!("close polled once: {}", PollOnce(Some(Box::pin(foreign.close()))).await));
            }
        }
        *sd.borrow_mut() = Some(out);
    });
    pump(&mut [&mut s, &mut rb], LIMIT, "B's task", || said.borrow().is_some());
    // Time for anything sent to arrive.
    let settle = Instant::now() + Duration::from_millis(500);
    pump(&mut [&mut s, &mut rb], LIMIT, "settle", || Instant::now() >= settle);
    let said = said.borrow_mut().take().expect("done");
    println!("A's handle in B's task: {said:#?}; the server received {:?}", got.borrow());
    assert_eq!(got.borrow()[1], Vec::<Vec<u8>>::new(), "B's peer received nothing: {said:?}");
    assert_eq!(got.borrow()[0], Vec::<Vec<u8>>::new(), "A's peer received nothing: {said:?}");
    assert!(said[0].starts_with("alloc: NoReactor") && said[0].contains("another reactor"), "{said:?}");
    assert_eq!(said[1], "send: Err(NoReactor), buffer back: true");
    assert_eq!(said[2], "expose: Some(Err(NoReactor))");
    assert_eq!(said[3], "peer_addr: None");
    assert_eq!(said[4], "close polled once: false");
    assert_eq!(conn_b.close_reason(), None, "B's connection is untouched");

    // B's own connection works, and A's close (asked from B's task) is done by A itself.
    let (sent, _) =
        rb.block_on(async { conn_b.send(conn_b.alloc_from(b"B's own").expect("buffer")).await }).expect("block_on");
    sent.expect("B's send");
    pump(&mut [&mut s, &mut ra, &mut rb], LIMIT, "B's message and A's close", || {
        got.borrow()[1].len() == 1 && conn_a.close_reason().is_some()
    });
    assert_eq!(got.borrow()[1], vec![b"B's own".to_vec()]);
    assert_eq!(got.borrow()[0], Vec::<Vec<u8>>::new());
    assert_eq!(conn_a.close_reason(), Some(CloseReason::Local));
    assert_eq!(conn_b.close_reason(), None);
}
