//! Issue 46 on a real device: a dropped stream delivers what it accepted (the lingering
//! close), and what each call returns once something ended, row by row of the table in
//! `Stream`'s docs (the peer closed, the peer vanished, this side shut down, this side's
//! reactor gone, the connection closed through another handle, the peer stopped granting
//! credit, the peer broke the protocol or the connection), each on rxe and on siw where the
//! transport can show it.

use std::cell::{Cell, RefCell};
use std::io::ErrorKind;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

use rdma_reactor::io::{self, Connection, Listener, Message, Stream};
use rdma_reactor::{
    CloseReason, Completion, Config, Conn, ConnectOptions, ConnectionHandler, Ctx, Error, Op, Reactor, RemoteAccess,
    RemoteSlice, Token,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::util::*;
use super::{drive, read_stream, Bytes};

const LIMIT: Duration = Duration::from_secs(120);

fn opts() -> ConnectOptions {
    ConnectOptions { msg_size: 64 * 1024, ..ConnectOptions::default() }
}

/// Runs `f` on a reactor of its own under the tokio driver, on a thread of its own: a peer
/// whose reactor ticks whatever the test's does (as another process's would).
fn on_thread<T: Send + 'static, F: std::future::Future<Output = T> + 'static>(
    cfg: Config,
    f: impl FnOnce() -> F + Send + 'static,
) -> std::thread::JoinHandle<T> {
    std::thread::spawn(move || drive(cfg, |_| f()))
}

/// Waits for `t` without blocking the reactor that polls this.
async fn join<T>(t: std::thread::JoinHandle<T>) -> T {
    while !t.is_finished() {
        io::sleep(Duration::from_millis(20)).await.expect("sleep");
    }
    t.join().expect("the peer's thread did not panic")
}

/// The kinds of a write, a flush and a shutdown, in that order, and then a read's.
async fn calls(s: &mut Stream) -> [Result<(), ErrorKind>; 4] {
    let w = s.write(b"more").await.map(drop).map_err(|e| e.kind());
    let f = s.flush().await.map_err(|e| e.kind());
    let sh = s.shutdown().await.map_err(|e| e.kind());
    let mut b = [0u8; 16];
    let r = s.read(&mut b).await.map(|n| assert_eq!(n, 0, "nothing more to read")).map_err(|e| e.kind());
    [w, f, sh, r]
}

/// Issue 46: `write_all` of 1 MiB, and of 40 B, then the stream dropped with no flush and no
/// shutdown (the writer on a reactor and thread of its own): every byte arrives, then the end
/// (the marker: `Ok(0)`), where before neither arrived and the reader read a clean end.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_stream_dropped_after_write_all_delivers_every_byte_then_its_end() {
    let _w = Watchdog::new("dropped stream", LIMIT);
    for len in [1usize << 20, 40] {
        let (got, marked, in_flight, why) = drive(Config::default(), |a| async move {
            let listener = Listener::bind(a).expect("listen");
            let writer = on_thread(Config::default(), move || async move {
                let mut s = Stream::new(Connection::connect(a, opts()).await.expect("connect"));
                let conn = s.connection().clone();
                let mut buf = vec![0u8; len];
                Bytes::new().fill(21, 0, &mut buf);
                s.write_all(&buf).await.expect("write_all");
                let in_flight = s.in_flight();
                drop(s);
                // The linger closes the connection once everything went.
                let why = io::timeout(Duration::from_secs(30), conn.closed()).await.expect("closed by the linger");
                (in_flight, why)
            });
            let mut s = Stream::new(listener.accept().await.expect("accept"));
            let got = read_stream(&mut s, &Bytes::new(), 21).await.expect("read to the end");
            let (in_flight, why) = join(writer).await;
            (got, s.peer_shut_down(), in_flight, why)
        });
        println!("dropped after write_all of {len} B: {got} B read, then the marker: {marked}; {in_flight} messages were in flight at the drop; the writer's connection ended {why:?}");
        assert!(in_flight > 0, "dropped with messages in flight (the case)");
        assert_eq!(got, len as u64, "every byte arrived");
        assert!(marked, "then the end of the stream, its marker");
        assert!(why.is_clean(), "{why:?}");
    }
}

/// The first row of the table: the peer closed (its end, then its disconnect). The reader
/// reads `Ok(0)`; then, once the disconnect is in, a shutdown is `Ok` (hyper's close; it was
/// `BrokenPipe`), a write `BrokenPipe`, a flush `Ok`, a read `Ok(0)` again.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn after_the_peers_close_shutdown_and_flush_are_ok_and_a_write_is_a_broken_pipe() {
    let _w = Watchdog::new("peer closed", LIMIT);
    let (got, marked, why, first_shutdown, rest) = drive(Config::default(), |a| async move {
        let listener = Listener::bind(a).expect("listen");
        let client = io::spawn(async move {
            let mut s = Stream::new(Connection::connect(a, opts()).await.expect("connect"));
            let mut buf = vec![0u8; 100_000];
            Bytes::new().fill(22, 0, &mut buf);
            s.write_all(&buf).await.expect("write_all");
            // Dropped: its end goes, then its disconnect.
        })
        .expect("spawn");
        let mut s = Stream::new(listener.accept().await.expect("accept"));
        let got = read_stream(&mut s, &Bytes::new(), 22).await.expect("read to the end");
        client.await.expect("client");
        let why = io::timeout(Duration::from_secs(30), s.connection().closed()).await.expect("the peer's disconnect");
        let first_shutdown = s.shutdown().await.map_err(|e| e.kind());
        let rest = calls(&mut s).await;
        (got, s.peer_shut_down(), why, first_shutdown, rest)
    });
    println!("peer closed: {got} B, marker {marked}, {why:?}; shutdown {first_shutdown:?}; write, flush, shutdown, read: {rest:?}");
    assert_eq!((got, marked), (100_000, true));
    assert_eq!(why, CloseReason::Peer);
    assert_eq!(first_shutdown, Ok(()), "shutdown after the peer's close is Ok, as TCP's");
    assert_eq!(rest, [Err(ErrorKind::BrokenPipe), Ok(()), Ok(()), Ok(())]);
}

/// The row of the peer that vanished: its connection ended without its end marker (here a
/// linger of zero, TCP's abortive close). The reader reads the bytes that arrived, then
/// `ConnectionReset`; a write is `BrokenPipe`, a flush and a shutdown `Ok`.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_peer_that_vanished_reads_as_a_reset_after_its_bytes() {
    let _w = Watchdog::new("peer vanished", LIMIT);
    let (got, end, marked, rest) = drive(Config::default(), |a| async move {
        let listener = Listener::bind(a).expect("listen");
        let read = Rc::new(Cell::new(false));
        let r = read.clone();
        let client = io::spawn(async move {
            let mut s = Stream::new(Connection::connect(a, opts()).await.expect("connect"));
            s.set_linger(Duration::ZERO);
            let mut buf = vec![0u8; 50_000];
            Bytes::new().fill(23, 0, &mut buf);
            s.write_all(&buf).await.expect("write_all");
            // Dropped once the bytes were read: closed at once, no marker.
            while !r.get() {
                io::sleep(Duration::from_millis(10)).await.expect("sleep");
            }
        })
        .expect("spawn");
        let mut s = Stream::new(listener.accept().await.expect("accept"));
        let mut buf = vec![0u8; 50_000];
        s.read_exact(&mut buf).await.expect("the bytes");
        Bytes::new().check(23, 0, &buf);
        read.set(true);
        client.await.expect("client");
        let end = s.read(&mut buf).await.map_err(|e| e.kind());
        let rest = calls(&mut s).await;
        (50_000, end, s.peer_shut_down(), rest)
    });
    println!("peer vanished: {got} B, then {end:?} (marker {marked}); write, flush, shutdown, read: {rest:?}");
    assert_eq!(end, Err(ErrorKind::ConnectionReset), "a close without the end reads as a reset");
    assert!(!marked);
    assert_eq!(rest, [Err(ErrorKind::BrokenPipe), Ok(()), Ok(()), Err(ErrorKind::ConnectionReset)]);
}

/// The row of the peer that vanished, with bytes a write accepted still waiting to go (the peer
/// stopped reading, then closed with a linger of zero): `flush` and `shutdown` are
/// `BrokenPipe`, not `Ok` (the hostile review of issue 46: they said `Ok` with the bytes lost).
/// The sends that fail here are those that waited for the peer's credits, never posted; a
/// posted send the peer's device acknowledged counts as gone.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_peer_that_vanished_with_bytes_still_to_go_fails_the_flush_and_the_shutdown() {
    let _w = Watchdog::new("peer vanished, bytes lost", LIMIT);
    let (stalled, flush, shutdown) = drive(Config::default(), |a| async move {
        let listener = Listener::bind(a).expect("listen");
        let stop = Rc::new(Cell::new(false));
        let st = stop.clone();
        let server = io::spawn(async move {
            // Never reads: the writer's credits, then its sends, stop.
            let mut s = Stream::new(listener.accept().await.expect("accept"));
            while !st.get() {
                io::sleep(Duration::from_millis(10)).await.expect("sleep");
            }
            s.set_linger(Duration::ZERO);
            drop(s);
        })
        .expect("spawn");
        let mut s = Stream::new(Connection::connect(a, opts()).await.expect("connect"));
        let mut buf = vec![0u8; 32 << 20];
        Bytes::new().fill(24, 0, &mut buf);
        // Stalls once the reader holds what it may and the window is in flight.
        let stalled = io::timeout(Duration::from_secs(3), s.write_all(&buf)).await.is_err();
        stop.set(true);
        server.await.expect("server");
        let why = io::timeout(Duration::from_secs(30), s.connection().closed()).await.expect("the peer's disconnect");
        assert_eq!(why, CloseReason::Peer);
        let flush = s.flush().await.map_err(|e| e.kind());
        let shutdown = s.shutdown().await.map_err(|e| e.kind());
        (stalled, flush, shutdown)
    });
    println!("peer vanished with bytes to go: stalled {stalled}; flush {flush:?}, shutdown {shutdown:?}");
    assert!(stalled, "32 MiB into a reader that never reads stalls the writer");
    assert_eq!(flush, Err(ErrorKind::BrokenPipe), "bytes a write accepted were lost");
    assert_eq!(shutdown, Err(ErrorKind::BrokenPipe));
}

/// The row of this side's shutdown: writes fail with `BrokenPipe`, a flush and a second
/// shutdown are `Ok`, reads go on (the peer writes back and ends).
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn after_this_sides_shutdown_writes_are_a_broken_pipe_and_reads_go_on() {
    let _w = Watchdog::new("own shutdown", LIMIT);
    let (w, f, sh, got) = drive(Config::default(), |a| async move {
        let listener = Listener::bind(a).expect("listen");
        let server = io::spawn(async move {
            let mut s = Stream::new(listener.accept().await.expect("accept"));
            let mut all = Vec::new();
            s.read_to_end(&mut all).await.expect("the client's bytes");
            s.write_all(&all).await.expect("back");
            s.shutdown().await.expect("shutdown");
        })
        .expect("spawn");
        let mut s = Stream::new(Connection::connect(a, opts()).await.expect("connect"));
        s.write_all(b"hello").await.expect("write");
        s.shutdown().await.expect("shutdown");
        let w = s.write(b"late").await.map(drop).map_err(|e| e.kind());
        let f = s.flush().await.map_err(|e| e.kind());
        let sh = s.shutdown().await.map_err(|e| e.kind());
        let mut back = Vec::new();
        s.read_to_end(&mut back).await.expect("the echo");
        server.await.expect("server");
        (w, f, sh, back)
    });
    assert_eq!((w, f, sh), (Err(ErrorKind::BrokenPipe), Ok(()), Ok(())));
    assert_eq!(got, b"hello");
}

/// The row of this side's reactor gone: a stream whose reactor was shut down answers every
/// call with `ConnectionAborted` (it used to read a clean end); its peer reads a reset (no
/// marker came). (What a stream accepted goes while its reactor runs: here the shutdown comes
/// once the peer has the byte.)
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_stream_whose_reactor_shut_down_is_aborted() {
    let _w = Watchdog::new("reactor gone", LIMIT);
    let a = addr();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let (got_tx, got_rx) = std::sync::mpsc::channel::<()>();
    let server = std::thread::spawn(move || {
        drive(Config::default(), move |_| async move {
            let listener = Listener::bind(a).expect("listen");
            let _ = tx.send(());
            let mut s = Stream::new(listener.accept().await.expect("accept"));
            let mut buf = [0u8; 64];
            let n = s.read(&mut buf).await.expect("the byte");
            let _ = got_tx.send(());
            let end = s.read(&mut buf).await.map_err(|e| e.kind());
            (n, end)
        })
    });
    rx.recv_timeout(Duration::from_secs(30)).expect("the server listens");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio");
    let mut reactor = Reactor::new().expect("reactor");
    let mut s = rt
        .block_on(async {
            io::tokio::drive(&mut reactor, async {
                let mut s = Stream::new(Connection::connect(a, opts()).await.expect("connect"));
                s.write_all(b"x").await.expect("write");
                s.flush().await.expect("flush");
                while got_rx.try_recv().is_err() {
                    io::sleep(Duration::from_millis(10)).await.expect("sleep");
                }
                s
            })
            .expect("driver")
            .await
        })
        .expect("the reactor's loop");
    reactor.shutdown(Duration::from_secs(10));
    let kinds = rt.block_on(async {
        let mut b = [0u8; 8];
        let r = s.read(&mut b).await.map(drop).map_err(|e| e.kind());
        let w = s.write(b"y").await.map(drop).map_err(|e| e.kind());
        let f = s.flush().await.map_err(|e| e.kind());
        let sh = s.shutdown().await.map_err(|e| e.kind());
        [r, w, f, sh]
    });
    let source = rt.block_on(async { s.write(b"z").await.expect_err("aborted") });
    drop(s);
    drop(reactor);
    let (n, end) = server.join().expect("server");
    println!("reactor gone: read, write, flush, shutdown: {kinds:?} ({source}); the peer: {n} B, then {end:?}");
    assert_eq!(kinds, [Err(ErrorKind::ConnectionAborted); 4]);
    let inner = source.get_ref().and_then(|e| e.downcast_ref::<Error>());
    assert!(matches!(inner, Some(Error::Closed(CloseReason::Shutdown))), "{inner:?}");
    assert_eq!((n, end), (1, Err(ErrorKind::ConnectionReset)));
}

/// The row of a connection closed by this side through another handle
/// (`Connection::close`): `NotConnected` from every call.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_stream_whose_connection_was_closed_through_another_handle_is_not_connected() {
    let _w = Watchdog::new("closed locally", LIMIT);
    let kinds = drive(Config::default(), |a| async move {
        let listener = Listener::bind(a).expect("listen");
        let server = io::spawn(async move {
            let mut s = Stream::new(listener.accept().await.expect("accept"));
            let mut all = Vec::new();
            let _ = s.read_to_end(&mut all).await;
        })
        .expect("spawn");
        let mut s = Stream::new(Connection::connect(a, opts()).await.expect("connect"));
        s.write_all(b"hello").await.expect("write");
        let why = io::timeout(Duration::from_secs(30), s.connection().clone().close()).await.expect("closed");
        assert_eq!(why, CloseReason::Local);
        let mut b = [0u8; 8];
        let r = s.read(&mut b).await.map(drop).map_err(|e| e.kind());
        let w = s.write(b"y").await.map(drop).map_err(|e| e.kind());
        let f = s.flush().await.map_err(|e| e.kind());
        let sh = s.shutdown().await.map_err(|e| e.kind());
        server.await.expect("server");
        [r, w, f, sh]
    });
    assert_eq!(kinds, [Err(ErrorKind::NotConnected); 4]);
}

/// The row of a peer that stopped answering: here it stopped reading, so it grants no credit,
/// and `Config::credit_timeout` closes the writer's connection (`Stalled`): the write that
/// waits, a flush and a shutdown are `TimedOut`. The reader, which never read, then reads
/// every byte that had arrived and a reset (the writer's close came without its end).
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_writer_whose_peer_grants_no_credit_times_out() {
    let _w = Watchdog::new("credit stall", LIMIT);
    let a = addr();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let reader = std::thread::spawn(move || {
        drive(Config { recv_depth: 4, ..Config::default() }, move |_| async move {
            let listener = Listener::bind(a).expect("listen");
            let _ = tx.send(());
            let mut s = Stream::new(listener.accept().await.expect("accept"));
            // Reads only once the writer has given up.
            while go_rx.try_recv().is_err() {
                io::sleep(Duration::from_millis(20)).await.expect("sleep");
            }
            let mut got = 0u64;
            let mut buf = vec![0u8; 64 * 1024];
            let end = loop {
                match s.read(&mut buf).await {
                    Ok(0) => break Ok(()),
                    Ok(n) => {
                        Bytes::new().check(24, got, &buf[..n]);
                        got += n as u64;
                    }
                    Err(e) => break Err(e.kind()),
                }
            };
            (got, end)
        })
    });
    rx.recv_timeout(Duration::from_secs(30)).expect("the reader listens");
    let cfg = Config { credit_timeout: Some(Duration::from_secs(1)), ..Config::default() };
    let (sent, w, f, sh, why) = drive(cfg, |_| async move {
        let mut s = Stream::new(Connection::connect(a, opts()).await.expect("connect"));
        let mut buf = vec![0u8; 64 * 1024];
        let mut sent = 0u64;
        let w = loop {
            Bytes::new().fill(24, sent, &mut buf);
            match io::timeout(Duration::from_secs(30), s.write(&buf)).await.expect("the write did not hang") {
                Ok(n) => sent += n as u64,
                Err(e) => break e,
            }
        };
        let f = s.flush().await.map_err(|e| e.kind());
        let sh = s.shutdown().await.map_err(|e| e.kind());
        let why = s.connection().close_reason();
        (sent, w.kind(), f, sh, why)
    });
    go_tx.send(()).expect("the reader waits");
    let (got, end) = reader.join().expect("reader");
    println!("credit stall: {sent} B taken, then write {w:?}, flush {f:?}, shutdown {sh:?} ({why:?}); the reader: {got} B, then {end:?}");
    assert!(matches!(why, Some(CloseReason::Stalled(_))), "{why:?}");
    assert_eq!((w, f, sh), (ErrorKind::TimedOut, Err(ErrorKind::TimedOut), Err(ErrorKind::TimedOut)));
    assert!(got > 0 && got <= sent, "what arrived is a prefix of what was taken: {got} of {sent}");
    assert_eq!(end, Err(ErrorKind::ConnectionReset));
}

/// What the callback-API peer of [`the_peers_rdma_writes_are_told_from_its_messages`] does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Poke {
    /// A SEND of `hello`, then a WRITE with immediate data of 16 bytes into the exposed slice.
    WriteImm,
    /// An RDMA WRITE with a remote key it was never given.
    BadWrite,
}

/// A client of the callback API that pokes the stream's side as `Poke` says once the slice
/// to write into is known (`target`).
struct Poker {
    how: Poke,
    target: Rc<RefCell<Option<RemoteSlice>>>,
    done: Rc<Cell<bool>>,
    closed: Rc<RefCell<Option<CloseReason>>>,
}

impl Poker {
    fn poke(&mut self, conn: &mut Conn<'_>) {
        let Some(target) = *self.target.borrow() else {
            let _ = conn.ctx().set_timer(Duration::from_millis(10), 0);
            return;
        };
        let mut buf = conn.alloc(16).expect("alloc");
        buf.fill_from(&[9u8; 16]).expect("fill");
        let op = match self.how {
            Poke::WriteImm => {
                let mut hello = conn.alloc(5).expect("alloc");
                hello.fill_from(b"hello").expect("fill");
                conn.submit(Op::send(hello)).expect("send");
                Op::write_imm(buf, target)
            }
            Poke::BadWrite => Op::write(buf, RemoteSlice { rkey: target.rkey ^ 0x5a5a_0000, ..target }),
        };
        conn.submit(op).expect("submit");
        self.done.set(true);
    }
}

impl ConnectionHandler for Poker {
    fn on_established(&mut self, conn: &mut Conn<'_>) {
        self.poke(conn);
    }

    fn on_timer(&mut self, conn: &mut Conn<'_>, _user_data: u64) {
        self.poke(conn);
    }

    fn on_completion(&mut self, _conn: &mut Conn<'_>, _c: Completion) {}

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        *self.closed.borrow_mut() = Some(reason);
    }
}

/// Review N8, and the table's rows of a peer that broke the protocol or the connection. A
/// peer's RDMA WRITE with immediate data reaches an async reader as what it is
/// (`Message::RemoteWrite`, the bytes in the exposed memory), and a stream reads the bytes
/// before it, then fails with `InvalidData` (it read an empty message, its end, before). An
/// RDMA WRITE with a key the stream's side never gave breaks the connection: the stream reads
/// `ConnectionReset`. RoCE only: iWARP has no immediate data (its peer is refused at submit).
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn the_peers_rdma_writes_are_told_from_its_messages() {
    if not_on_iwarp(
        "the_peers_rdma_writes_are_told_from_its_messages",
        "iWARP has no RDMA WRITE with immediate data (refused at submit: memory::write_imm_and_exposures_follow_the_transport)",
    ) {
        return;
    }
    let _w = Watchdog::new("remote writes", LIMIT);
    // Three connections: a message reader, a stream poked with a WRITE with immediate, a
    // stream poked with a bad key.
    for case in 0..3 {
        let mut srv = Reactor::new().expect("server");
        let mut cli = Reactor::new().expect("client");
        let a: SocketAddr = addr();
        let target = Rc::new(RefCell::new(None));
        let outcome: Rc<RefCell<Option<String>>> = Rc::new(RefCell::new(None));
        let (t, o) = (target.clone(), outcome.clone());
        let _task = srv.spawn(async move {
            let listener = Listener::bind(a).expect("listen");
            let conn = listener.accept().await.expect("accept");
            let mem = conn.alloc(64).expect("alloc");
            let exposed = conn.expose(mem, RemoteAccess::WRITE).expect("expose");
            *t.borrow_mut() = Some(RemoteSlice { len: 16, ..exposed.remote() });
            let got = if case == 0 {
                let first = conn.recv_message().await.expect("the SEND");
                let second = conn.recv_message().await.expect("the WRITE with immediate data");
                let mut written = [0u8; 16];
                exposed.read_at(0, &mut written).expect("read the exposed bytes");
                format!(
                    "{} {:?} {} {:?}",
                    first.is_remote_write(),
                    first.into_buf().as_slice(),
                    matches!(second, Message::RemoteWrite { len: 16, .. }),
                    written == [9u8; 16]
                )
            } else {
                let mut s = Stream::new(conn);
                let mut buf = [0u8; 16];
                let first = s.read(&mut buf).await.map(|n| buf[..n].to_vec()).map_err(|e| e.kind());
                let then = s.read(&mut buf).await.map_err(|e| e.kind());
                let source = s.read(&mut buf).await.err().map(|e| e.to_string());
                format!("{first:?} {then:?} {}", source.unwrap_or_default())
            };
            drop(exposed);
            *o.borrow_mut() = Some(got);
        });
        let how = if case == 2 { Poke::BadWrite } else { Poke::WriteImm };
        let done = Rc::new(Cell::new(false));
        let closed = Rc::new(RefCell::new(None));
        let poker = Poker { how, target: target.clone(), done: done.clone(), closed: closed.clone() };
        // The task binds its listener in the server's first ticks.
        for _ in 0..3 {
            srv.run_once(Some(Duration::from_millis(20))).expect("run_once");
        }
        cli.connect(a, ConnectOptions::default(), poker).expect("connect");
        pump(&mut [&mut srv, &mut cli], LIMIT, "the poke's outcome", || outcome.borrow().is_some());
        let got = outcome.borrow_mut().take().expect("an outcome");
        println!("case {case} ({how:?}): {got}");
        match case {
            0 => assert_eq!(got, "false [104, 101, 108, 108, 111] true true", "a SEND, then the WRITE as what it is"),
            1 => {
                assert!(got.starts_with("Ok([104, 101, 108, 108, 111]) Err(InvalidData)"), "{got}");
                assert!(got.contains("RDMA WRITE with immediate data"), "{got}");
            }
            _ => assert!(got.starts_with("Err(ConnectionReset)"), "the broken connection reads as a reset: {got}"),
        }
        drop(cli);
        drop(srv);
    }
}
