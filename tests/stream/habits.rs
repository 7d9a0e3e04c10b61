//! Issue 46 on a real device: what tokio code does without thinking of RDMA. A task of
//! `tokio::task::spawn_local` inside the driver uses streams; owned halves in two tasks;
//! small writes coalesce into messages of the connection's size, and a lone write still goes
//! at once.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

use rdma_reactor::io::{self, Connection, Listener, Stream};
use rdma_reactor::{Config, ConnectOptions, Error};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::util::*;
use super::{drive, read_stream, write_stream, Bytes};

const LIMIT: Duration = Duration::from_secs(120);

/// Hyper's habit, a task per connection started with `tokio::task::spawn_local`, inside the
/// driver: the server's task and the client's two tasks (its owned halves, issue 46) use
/// streams there (they failed with `NoReactor` before). The server echoes through its own
/// owned halves with `tokio::io::copy`; the client's write half writes 1 MiB and is dropped,
/// which ends its writing; the client's read half reads every byte back, then the end. A
/// second stream's halves are put back together and used as one.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn tasks_of_spawn_local_inside_the_driver_use_streams_and_their_owned_halves() {
    const LEN: u64 = 1 << 20;
    let _w = Watchdog::new("spawn_local", LIMIT);
    let (echoed, got, marked, reunited) = drive(Config::default(), |a| async move {
        let listener = Listener::bind(a).expect("listen");
        let server = tokio::task::spawn_local(async move {
            let mut echoed = Vec::new();
            for _ in 0..2 {
                let (mut rd, mut wr) = Stream::new(listener.accept().await.expect("accept")).into_split();
                echoed.push(tokio::io::copy(&mut rd, &mut wr).await.expect("echo"));
                wr.shutdown().await.expect("shutdown");
            }
            echoed
        });
        let opts = ConnectOptions { msg_size: 16 * 1024, ..ConnectOptions::default() };
        let s = Stream::new(Connection::connect(a, opts.clone()).await.expect("connect"));
        let (mut rd, mut wr) = s.into_split();
        let writer = tokio::task::spawn_local(async move {
            let bytes = Bytes::new();
            let mut buf = vec![0u8; 10_000];
            let mut at = 0u64;
            while at < LEN {
                let n = (LEN - at).min(buf.len() as u64) as usize;
                bytes.fill(31, at, &mut buf[..n]);
                wr.write_all(&buf[..n]).await.expect("write");
                at += n as u64;
            }
            // Dropped: the end marker goes after the bytes.
        });
        let reader = tokio::task::spawn_local(async move {
            let got = read_stream(&mut rd, &Bytes::new(), 31).await.expect("read");
            (got, rd.peer_shut_down())
        });
        writer.await.expect("the writer task");
        let (got, marked) = reader.await.expect("the reader task");
        // Split and put back together: one stream again.
        let s = Stream::new(Connection::connect(a, opts).await.expect("connect"));
        let (rd, wr) = s.into_split();
        let mut s = rd.reunite(wr).expect("the halves of one stream");
        s.write_all(b"whole again").await.expect("write");
        s.shutdown().await.expect("shutdown");
        let mut back = Vec::new();
        s.read_to_end(&mut back).await.expect("read");
        let echoed = server.await.expect("the server task");
        (echoed, got, marked, back)
    });
    println!(
        "spawn_local: echoed {echoed:?}; the client's read half got {got} B and the end ({marked}); reunited: {:?}",
        String::from_utf8_lossy(&reunited)
    );
    assert_eq!(echoed, vec![LEN, 11]);
    assert_eq!((got, marked), (LEN, true));
    assert_eq!(reunited, b"whole again");
}

/// Outside the driver's reach a stream still says so: polled by a task of a `LocalSet` of
/// the test's own after the driver returned, a read fails with `NoReactor` (never a panic,
/// never another reactor's connection).
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_stream_polled_outside_its_driver_says_no_reactor() {
    let _w = Watchdog::new("no reactor", LIMIT);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio");
    let mut reactor = rdma_reactor::Reactor::new().expect("reactor");
    let a = addr();
    let outside = tokio::task::LocalSet::new();
    let got = rt.block_on(outside.run_until(async {
        let driven = io::tokio::drive(&mut reactor, async move {
            let listener = Listener::bind(a).expect("listen");
            let client =
                io::spawn(async move { Connection::connect(a, ConnectOptions::default()).await }).expect("spawn");
            let conn = listener.accept().await.expect("accept");
            let peer = client.await.expect("client").expect("connect");
            (Stream::new(conn), peer)
        });
        let (mut s, peer) = driven.expect("driver").await.expect("the loop");
        // A task of the outer `LocalSet`: no reactor polls it.
        let outer = tokio::task::spawn_local(async move {
            let mut b = [0u8; 4];
            let r = s.read(&mut b).await.map(drop);
            (r, s)
        });
        let (r, s) = outer.await.expect("the outer task");
        drop((s, peer));
        r
    }));
    let e = got.expect_err("no reactor polls the outer task");
    println!("polled outside the driver: {e}");
    assert!(matches!(e.get_ref().and_then(|s| s.downcast_ref::<Error>()), Some(Error::NoReactor)), "{e:?}");
}

/// Writes coalesce (issue 46): `tokio::io::copy` writes 8 KiB at a time, and a message-API
/// reader sees messages of up to the connection's 64 KiB, not of 8 KiB (every byte in order);
/// a lone 40-byte write afterwards, never flushed, still arrives at once as its own message.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn small_writes_coalesce_and_a_lone_write_goes_at_once() {
    const LEN: usize = 1 << 20;
    let _w = Watchdog::new("coalescing", LIMIT);
    let (sizes, lone) = drive(Config::default(), |a| async move {
        let listener = Listener::bind(a).expect("listen");
        let sizes = Rc::new(RefCell::new(Vec::new()));
        let all_in = Rc::new(Cell::new(false));
        let (sz, done) = (sizes.clone(), all_in.clone());
        let server = io::spawn(async move {
            let conn = listener.accept().await.expect("accept");
            let bytes = Bytes::new();
            let mut at = 0u64;
            loop {
                let msg = conn.recv().await.expect("a message");
                if msg.is_empty() {
                    return at;
                }
                if at < LEN as u64 {
                    bytes.check(32, at, msg.as_slice());
                }
                at += msg.len() as u64;
                sz.borrow_mut().push(msg.len());
                done.set(at >= LEN as u64);
            }
        })
        .expect("spawn");
        let opts = ConnectOptions { msg_size: 64 * 1024, ..ConnectOptions::default() };
        let mut s = Stream::new(Connection::connect(a, opts).await.expect("connect"));
        let mut data = vec![0u8; LEN];
        Bytes::new().fill(32, 0, &mut data);
        tokio::io::copy(&mut data.as_slice(), &mut s).await.expect("copy");
        while !all_in.get() {
            io::sleep(Duration::from_millis(5)).await.expect("sleep");
        }
        // A lone small write, no flush: it must not wait for more bytes.
        s.write_all(&[7u8; 40]).await.expect("write");
        let lone = io::timeout(Duration::from_secs(10), async {
            while sizes.borrow().len() < 2 || *sizes.borrow().last().expect("one") != 40 {
                io::sleep(Duration::from_millis(1)).await.expect("sleep");
            }
        })
        .await
        .is_ok();
        write_stream(&mut s, &Bytes::new(), 0, 0, 1).await;
        let total = server.await.expect("server");
        assert_eq!(total, LEN as u64 + 40);
        let sizes = sizes.borrow().clone();
        (sizes, lone)
    });
    let copied = &sizes[..sizes.len() - 1];
    let avg = LEN / copied.len();
    println!(
        "coalescing: 1 MiB of 8 KiB writes arrived in {} messages (average {avg} B, largest {:?}); the lone 40 B write arrived on its own: {lone}",
        copied.len(),
        copied.iter().max()
    );
    assert!(copied.iter().all(|n| *n <= 64 * 1024), "at most the message size");
    assert!(avg >= 32 * 1024, "8 KiB writes coalesced into messages of 32 KiB or more on average: {copied:?}");
    assert!(lone, "the lone write went at once, unflushed");
}
