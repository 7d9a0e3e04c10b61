//! The `kv` example end to end on a real device (issue 17, item 4): a table in one application
//! region, exposed to every client through a window of its own; GETs by one-sided READ with
//! the version check, every value verified; PUTs by SEND; a malformed message closes only the
//! connection that sent it.

mod util;

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use rdma_reactor::{CloseReason, Completion, Conn, ConnectOptions, ConnectionHandler, Ctx, Op, Reactor, Token};
use util::*;

/// `kv server` and `kv client --clients 8 --verify`: every GET verified, the server served all
/// 8 connections from one region registration.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn eight_clients_read_one_table_every_value_verified() {
    let server = addr();
    let s = server.to_string();
    let srv = Proc::spawn("kv server", bin("kv"), &["server", "--bind", &s, "--exit-after", "8", "--quiet"]);
    wait_listening(server, Duration::from_secs(30));
    let (ok, out) = run_output(
        bin("kv"),
        &["client", "--connect", &s, "--clients", "8", "--count", "500", "--verify"],
        Duration::from_secs(240),
    );
    println!("{out}");
    assert!(ok, "kv client failed:\n{out}");
    assert!(out.contains("4000 of 4000 GETs verified, every byte"), "{out}");
    let st = srv.wait(Duration::from_secs(60));
    assert!(st.success(), "kv server: exit {st}");
}

/// Not a message of the kv protocol.
const GARBAGE: &[u8] = b"this is not a PUT of the kv protocol";

/// Sends one malformed message once established, and records its close.
struct Garbage(Rc<RefCell<Option<CloseReason>>>);

impl ConnectionHandler for Garbage {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        post_recvs(conn, 3, 64);
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        let mut buf = conn.alloc(GARBAGE.len()).expect("buffer");
        buf.fill_from(GARBAGE).expect("fill");
        conn.submit(Op::send(buf)).expect("send");
    }

    fn on_completion(&mut self, _conn: &mut Conn<'_>, _c: Completion) {}

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        *self.0.borrow_mut() = Some(reason);
    }
}

/// A client that sends a malformed message is closed by the server, which says why; a kv
/// client connected meanwhile finishes with every value verified.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_malformed_message_closes_only_its_connection() {
    let server = addr();
    let s = server.to_string();
    let log = log_path("kv-server");
    let srv =
        Proc::spawn_logged("kv server", bin("kv"), &["server", "--bind", &s, "--exit-after", "2", "--quiet"], &log);
    wait_listening(server, Duration::from_secs(30));
    let good_log = log_path("kv-client");
    let good = Proc::spawn_logged(
        "kv client",
        bin("kv"),
        &["client", "--connect", &s, "--count", "3000", "--verify"],
        &good_log,
    );
    let mut r = Reactor::new().expect("reactor");
    let closed = Rc::new(RefCell::new(None));
    r.connect(server, ConnectOptions { msg_size: 64, ..Default::default() }, Garbage(closed.clone())).expect("connect");
    pump(&mut [&mut r], Duration::from_secs(60), "the bad client closed", || closed.borrow().is_some());
    let st = good.wait(Duration::from_secs(240));
    let client_out = read_log(&good_log);
    assert!(st.success(), "the good client failed: {st}\n{client_out}");
    assert!(client_out.contains("3000 of 3000 GETs verified"), "{client_out}");
    let sst = srv.wait(Duration::from_secs(60));
    let server_out = read_log(&log);
    println!("bad client closed with {:?}; server:\n{server_out}", closed.borrow());
    let said = format!("closing a connection: a malformed message of {} bytes", GARBAGE.len());
    assert!(server_out.contains(&said), "{server_out}");
    assert!(server_out.contains("1 malformed"), "{server_out}");
    assert!(!sst.success(), "the server reports the malformed connection in its exit status");
}
