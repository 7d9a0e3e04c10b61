//! No buffer shows one owner's bytes to another (issue 17, item 1), on a real device.
//!
//! Pool chunks are recycled without being cleared up front. Earlier connections on the same
//! reactor (`Dirtier`s) leave 4 KiB chunks full of their patterned bytes; then, on new
//! connections of the same pool, the three ways a safe call used to hand those bytes out:
//! a 2-byte receive grown to 4 096 bytes with `set_len`, fresh `alloc(16)` buffers grown to
//! their capacity, and a 4 096-byte buffer of which 5 bytes were written in place and then
//! sent (the peer got another client's bytes: Heartbleed's shape). Each now shows zeros where
//! this owner wrote nothing.

mod util;

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use rdma_reactor::{CloseReason, Completion, Conn, ConnectOptions, ConnectionHandler, Ctx, Op, OpCode, Reactor, Token};
use util::*;

const SIZE: usize = 4096;
const LIMIT: Duration = Duration::from_secs(60);

/// What a probing client found.
#[derive(Debug, Default)]
struct Found {
    /// Buffers (or messages) checked.
    checked: u64,
    /// Those showing a byte this owner did not write or receive: (which, first offending
    /// offset, the byte there).
    leaks: Vec<(u64, usize, u8)>,
    closed: Option<CloseReason>,
    error: Option<String>,
}

impl Found {
    /// Records whether `bytes[from..]` are all zero.
    fn check(&mut self, which: u64, bytes: &[u8], from: usize) {
        self.checked += 1;
        if let Some(i) = bytes[from..].iter().position(|b| *b != 0) {
            self.leaks.push((which, from + i, bytes[from + i]));
        }
    }
}

/// Sends three 4 KiB patterned messages and takes their echoes into its three receives,
/// re-posting each, then closes: every chunk it used (three sent, three received into) holds
/// its bytes when it goes back to the pool.
struct Dirtier {
    id: u64,
    echoed: u64,
    done: Rc<RefCell<u64>>,
}

impl ConnectionHandler for Dirtier {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        post_recvs(conn, 3, SIZE);
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        for seq in 0..3 {
            let mut buf = conn.alloc(SIZE).expect("buffer");
            buf.fill_from(&pattern(SIZE, self.id, seq)).expect("fill");
            conn.submit(Op::send(buf)).expect("send");
        }
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        if let (OpCode::Recv, Ok(_)) = (c.opcode, c.result) {
            let buf = c.buf.expect("buffer");
            assert_eq!(buf.as_slice(), pattern(SIZE, self.id, self.echoed).as_slice(), "the echo");
            self.echoed += 1;
            // The same (now dirty) chunk again: flushed back to the pool at the close.
            let _ = conn.submit(Op::recv(buf));
            if self.echoed == 3 {
                conn.close();
            }
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, _reason: CloseReason) {
        *self.done.borrow_mut() += 1;
    }
}

/// Case 1: receives 8 messages of 2 bytes into 4 KiB buffers and grows each to 4 096 bytes.
struct ShortReceiver {
    left: u64,
    found: Rc<RefCell<Found>>,
}

/// Case 2: on a connection of its own, 256 fresh buffers of 16 bytes, all held at once so each
/// is its own chunk, grown to their capacity, then closes. (A connection's own earlier bytes
/// are not foreign to it, so the check needs a connection that left none.)
struct FreshProbe {
    found: Rc<RefCell<Found>>,
}

impl ConnectionHandler for FreshProbe {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        let mut held = Vec::new();
        for i in 0..256 {
            let mut buf = conn.alloc(16).expect("buffer");
            let cap = buf.capacity();
            buf.set_len(cap).expect("grow to the capacity");
            self.found.borrow_mut().check(i, buf.as_slice(), 0);
            held.push(buf);
        }
        drop(held);
        post_recvs(conn, 3, 64);
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        conn.close();
    }

    fn on_completion(&mut self, _conn: &mut Conn<'_>, _c: Completion) {}

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        self.found.borrow_mut().closed = Some(reason);
    }
}

impl ConnectionHandler for ShortReceiver {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        // First: the chunks the earlier connections just gave back (the free lists are LIFO).
        post_recvs(conn, 8, SIZE);
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        for i in 0..8u8 {
            let mut buf = conn.alloc(2).expect("buffer");
            buf.fill_from(&[i + 1, 0xEE]).expect("fill");
            conn.submit(Op::send(buf)).expect("send");
        }
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        match (c.opcode, c.result) {
            (OpCode::Recv, Ok(n)) => {
                // Re-posted first (under flow control the echoes need it), from the same pool.
                let fresh = conn.alloc(SIZE).expect("buffer");
                let _ = conn.submit(Op::recv(fresh));
                let mut buf = c.buf.expect("buffer");
                assert_eq!((n, buf.len()), (2, 2), "a receive's buffer holds exactly the bytes received");
                buf.set_len(SIZE).expect("grow");
                self.found.borrow_mut().check(self.left, buf.as_slice(), 2);
                self.left -= 1;
                if self.left == 0 {
                    conn.close();
                }
            }
            (op, Err(e)) if self.left > 0 => {
                self.found.borrow_mut().error.get_or_insert(format!("{op:?}: {e}"));
            }
            _ => {}
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        self.found.borrow_mut().closed = Some(reason);
    }
}

/// Case 3: allocates 4 096 bytes, writes 5 in place, sends all 4 096; the echo shows what the
/// peer received.
struct InPlaceSender {
    left: u64,
    found: Rc<RefCell<Found>>,
    sends: Vec<rdma_reactor::Buf>,
}

impl ConnectionHandler for InPlaceSender {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        // The send buffers first: the chunks the earlier connections just gave back (the free
        // lists are LIFO).
        for _ in 0..self.left {
            let mut buf = conn.alloc(SIZE).expect("buffer");
            buf.as_mut_slice()[..5].copy_from_slice(b"hello");
            self.sends.push(buf);
        }
        post_recvs(conn, 8, SIZE);
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        for buf in self.sends.drain(..) {
            conn.submit(Op::send(buf)).expect("send");
        }
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        match (c.opcode, c.result) {
            (OpCode::Recv, Ok(n)) => {
                let fresh = conn.alloc(SIZE).expect("buffer");
                let _ = conn.submit(Op::recv(fresh));
                let buf = c.buf.expect("buffer");
                assert_eq!(n as usize, SIZE);
                assert_eq!(&buf.as_slice()[..5], b"hello");
                self.found.borrow_mut().check(self.left, buf.as_slice(), 5);
                self.left -= 1;
                if self.left == 0 {
                    conn.close();
                }
            }
            (op, Err(e)) if self.left > 0 => {
                self.found.borrow_mut().error.get_or_insert(format!("{op:?}: {e}"));
            }
            _ => {}
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        self.found.borrow_mut().closed = Some(reason);
    }
}

/// Eight earlier connections leave 48 chunks of 4 KiB full of their bytes in the client's pool.
fn dirty_the_pool(srv: &mut Reactor, cli: &mut Reactor, server: std::net::SocketAddr) {
    let done = Rc::new(RefCell::new(0));
    for id in 0..8 {
        let opts = ConnectOptions { msg_size: SIZE as u32, ..Default::default() };
        cli.connect(server, opts, Dirtier { id, echoed: 0, done: done.clone() }).expect("connect");
    }
    pump(&mut [srv, cli], LIMIT, "the earlier connections", || *done.borrow() == 8);
}

fn echo_server() -> (Reactor, std::net::SocketAddr) {
    let mut srv = Reactor::new().expect("server");
    let server = addr();
    srv.listen(server, EchoListener { depth: 8, agents_closed: Rc::default() }).expect("listen");
    (srv, server)
}

/// Cases 1 and 2: a receive of 2 bytes grown to 4 096, and (on the next connection) 256 fresh
/// `alloc(16)` buffers grown to their capacity, after earlier connections used the same pool:
/// every byte past what this owner wrote or received is zero.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn grown_buffers_show_no_earlier_owners_bytes() {
    let (mut srv, server) = echo_server();
    let mut cli = Reactor::new().expect("client");
    dirty_the_pool(&mut srv, &mut cli, server);
    let (found, fresh) = (Rc::new(RefCell::new(Found::default())), Rc::new(RefCell::new(Found::default())));
    let h = ShortReceiver { left: 8, found: found.clone() };
    cli.connect(server, ConnectOptions { msg_size: SIZE as u32, ..Default::default() }, h).expect("connect");
    pump(&mut [&mut srv, &mut cli], LIMIT, "the short receives", || found.borrow().closed.is_some());
    let h = FreshProbe { found: fresh.clone() };
    cli.connect(server, ConnectOptions { msg_size: SIZE as u32, ..Default::default() }, h).expect("connect");
    pump(&mut [&mut srv, &mut cli], LIMIT, "the fresh buffers", || fresh.borrow().closed.is_some());
    let (f, r) = (fresh.borrow(), found.borrow());
    println!(
        "fresh alloc(16) grown to capacity: {} of {} showed earlier bytes {:?}; 2-byte receives grown to 4096: {} of {} \
         showed earlier bytes {:?}",
        f.leaks.len(),
        f.checked,
        &f.leaks[..f.leaks.len().min(4)],
        r.leaks.len(),
        r.checked,
        &r.leaks[..r.leaks.len().min(4)]
    );
    assert_eq!((f.checked, r.checked), (256, 8));
    assert_eq!(r.error, None);
    assert!(f.leaks.is_empty(), "fresh buffers grown to their capacity showed an earlier owner's bytes");
    assert!(r.leaks.is_empty(), "receives grown past their length showed an earlier owner's bytes");
}

/// Case 3: a 4 096-byte buffer, 5 bytes written in place, sent whole: the peer receives the 5
/// bytes and zeros, never an earlier connection's bytes.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_partly_written_send_carries_no_earlier_owners_bytes() {
    let (mut srv, server) = echo_server();
    let mut cli = Reactor::new().expect("client");
    dirty_the_pool(&mut srv, &mut cli, server);
    let found = Rc::new(RefCell::new(Found::default()));
    let h = InPlaceSender { left: 8, found: found.clone(), sends: Vec::new() };
    cli.connect(server, ConnectOptions { msg_size: SIZE as u32, ..Default::default() }, h).expect("connect");
    pump(&mut [&mut srv, &mut cli], LIMIT, "the partly written sends", || found.borrow().closed.is_some());
    let r = found.borrow();
    println!(
        "4096-byte sends with 5 bytes written in place: {} of {} carried earlier bytes {:?}",
        r.leaks.len(),
        r.checked,
        &r.leaks[..r.leaks.len().min(4)]
    );
    assert_eq!(r.checked, 8);
    assert_eq!(r.error, None);
    assert!(r.leaks.is_empty(), "a send carried an earlier owner's bytes to the peer");
}

/// What the forwarding pair shares: Y's token, and what Y found.
#[derive(Default)]
struct Forwarding {
    y: Option<Token>,
    y_up: bool,
    found: Found,
    /// Y checked both views.
    done: bool,
}

/// Connection X: sends one 4 KiB patterned message and, when its echo lands, cuts the buffer
/// to 16 bytes and sends those on connection Y (forwarding a header, say).
struct Forwarder {
    shared: Rc<RefCell<Forwarding>>,
}

impl ConnectionHandler for Forwarder {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        post_recvs(conn, 3, SIZE);
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        let mut buf = conn.alloc(SIZE).expect("buffer");
        buf.fill_from(&pattern(SIZE, 77, 0)).expect("fill");
        conn.submit(Op::send(buf)).expect("send");
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        if let (OpCode::Recv, Ok(n)) = (c.opcode, c.result) {
            let mut buf = c.buf.expect("buffer");
            assert_eq!((n as usize, buf.as_slice()), (SIZE, pattern(SIZE, 77, 0).as_slice()), "X's echo");
            buf.set_len(16).expect("cut");
            let y = self.shared.borrow().y.expect("Y's token");
            conn.ctx().submit(y, Op::send(buf)).expect("send on Y");
            conn.close();
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, _reason: CloseReason) {}
}

/// Connection Y: when the forwarded send completes, grows the buffer back to 4 KiB (case a),
/// drops it and allocates 4 KiB on Y, 5 bytes written in place (case b: the chunk it just
/// dropped comes back first, holding the 16 bytes Y sent, which are Y's own, and X's bytes
/// past them unless they were zeroed).
struct ForwardTarget {
    shared: Rc<RefCell<Forwarding>>,
}

impl ConnectionHandler for ForwardTarget {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        post_recvs(conn, 3, SIZE);
    }

    fn on_established(&mut self, _conn: &mut Conn<'_>) {
        self.shared.borrow_mut().y_up = true;
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        if let (OpCode::Send, Ok(_), Some(mut buf)) = (c.opcode, c.result, c.buf) {
            let mut s = self.shared.borrow_mut();
            buf.set_len(SIZE).expect("grow");
            s.found.check(0, buf.as_slice(), 16);
            drop(buf);
            let mut again = conn.alloc(SIZE).expect("buffer");
            again.as_mut_slice()[..5].copy_from_slice(b"hello");
            // Past the 16 bytes Y sent: those were Y's (a connection's own earlier bytes are
            // not foreign to it), the rest was X's.
            s.found.check(1, again.as_slice(), 16);
            s.done = true;
            drop(s);
            conn.close();
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        self.shared.borrow_mut().found.closed = Some(reason);
    }
}

/// A buffer passed from one connection to another carries only what is sent: connection X
/// receives a 4 KiB message, cuts the buffer to 16 bytes and sends them on connection Y. Y's
/// handler then sees none of X's other bytes, neither in the buffer grown back after the send
/// (a) nor in a fresh buffer Y allocates once it dropped it (b: the same chunk, which must not
/// count as Y's own). Found by a hostile read of this first fix, which let X's bytes
/// count as Y's in both.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_buffer_passed_to_another_connection_carries_only_what_it_sends() {
    let (mut srv, server) = echo_server();
    let mut cli = Reactor::new().expect("client");
    let shared = Rc::new(RefCell::new(Forwarding::default()));
    let opts = || ConnectOptions { msg_size: SIZE as u32, ..Default::default() };
    let y = cli.connect(server, opts(), ForwardTarget { shared: shared.clone() }).expect("connect Y");
    shared.borrow_mut().y = Some(y);
    pump(&mut [&mut srv, &mut cli], LIMIT, "Y established", || shared.borrow().y_up);
    cli.connect(server, opts(), Forwarder { shared: shared.clone() }).expect("connect X");
    pump(&mut [&mut srv, &mut cli], LIMIT, "the forwarded buffer checked", || shared.borrow().found.closed.is_some());
    let s = shared.borrow();
    println!(
        "X's 4096-byte message cut to 16 bytes and sent on Y: {} of {} views on Y showed X's bytes {:?}",
        s.found.leaks.len(),
        s.found.checked,
        &s.found.leaks
    );
    assert!(s.done);
    assert_eq!(s.found.checked, 2);
    assert!(s.found.leaks.is_empty(), "Y's handler saw bytes of X's message that were never sent on Y");
}

// One region, many peers (issue 17, items 2, 3 and 5).

const REGION: usize = 64 << 20;
const PEERS: usize = 8;
const SHARE: usize = REGION / PEERS;
const PIECE: usize = 1 << 20;

/// The region's bytes: block `i` of 1 MiB is `pattern(PIECE, 42, i)`.
fn region_bytes(block: usize) -> Vec<u8> {
    pattern(PIECE, 42, block as u64)
}

#[derive(Default)]
struct RegionServer {
    /// Close reasons of the agents, by connection index (in accept order).
    closed: Vec<(usize, CloseReason)>,
    windows: Vec<rdma_reactor::RegionWindow>,
    accepted: usize,
}

struct RegionListener {
    region: rdma_reactor::Region,
    shared: Rc<RefCell<RegionServer>>,
}

impl rdma_reactor::ListenerHandler for RegionListener {
    fn on_connect_request(
        &mut self,
        _ctx: &mut Ctx<'_>,
        _req: &rdma_reactor::ConnectRequest,
    ) -> rdma_reactor::Decision {
        let idx = {
            let mut s = self.shared.borrow_mut();
            s.accepted += 1;
            s.accepted - 1
        };
        rdma_reactor::Decision::Accept(Box::new(RegionAgent {
            idx,
            region: self.region.clone(),
            shared: self.shared.clone(),
        }))
    }
}

/// Exposes the whole region to its peer (READ and WRITE) and sends it the descriptor.
struct RegionAgent {
    idx: usize,
    region: rdma_reactor::Region,
    shared: Rc<RefCell<RegionServer>>,
}

impl ConnectionHandler for RegionAgent {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        post_recvs(conn, 3, 64);
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        let all = self.region.slice(..).expect("the whole region");
        let w = conn
            .expose_region(&all, rdma_reactor::RemoteAccess::READ | rdma_reactor::RemoteAccess::WRITE)
            .expect("expose");
        let mut msg = conn.alloc(16).expect("buffer");
        msg.fill_from(&w.remote().encode()).expect("16 bytes");
        conn.submit(Op::send(msg)).expect("send the descriptor");
        self.shared.borrow_mut().windows.push(w);
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        if let (OpCode::Recv, Ok(_)) = (c.opcode, c.result) {
            let _ = conn.submit(Op::recv(c.buf.expect("buffer")));
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        self.shared.borrow_mut().closed.push((self.idx, reason));
    }
}

#[derive(Debug, Default)]
struct Reader {
    desc: Option<rdma_reactor::RemoteSlice>,
    /// 1 MiB pieces of its share read and verified.
    verified: usize,
    failures: Vec<String>,
    /// The result of a WRITE through another connection's window (the intruder's).
    intrusion: Option<Result<u32, rdma_reactor::OpError>>,
    closed: Option<CloseReason>,
}

/// Reads its share of the region (8 pieces of 1 MiB) into its part of a local region, each
/// time it is told to, and checks every byte.
struct RegionReader {
    idx: usize,
    local: rdma_reactor::Region,
    state: Rc<RefCell<Reader>>,
}

impl RegionReader {
    fn read_share(&self, conn: &mut Conn<'_>) {
        let desc = self.state.borrow().desc.expect("descriptor");
        for k in 0..SHARE / PIECE {
            let off = self.idx * SHARE + k * PIECE;
            let local = self.local.slice(off..off + PIECE).expect("slice");
            let remote = desc.slice(off as u32, PIECE as u32).expect("inside the window");
            conn.submit(Op::read_region(local, remote).user_data((off / PIECE) as u64)).expect("read");
        }
    }
}

impl ConnectionHandler for RegionReader {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        post_recvs(conn, 3, 64);
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        match (c.opcode, c.result) {
            (OpCode::Recv, Ok(16)) => {
                let desc =
                    rdma_reactor::RemoteSlice::decode(c.buf.as_ref().expect("buffer").as_slice()).expect("descriptor");
                self.state.borrow_mut().desc = Some(desc);
                self.read_share(conn);
            }
            (OpCode::Read, Ok(n)) => {
                let block = c.user_data as usize;
                let slice = c.region.expect("the region slice comes back");
                let mut got = vec![0u8; PIECE];
                slice.region().read_at(slice.range().start, &mut got).expect("read_at");
                if n as usize != PIECE || got != region_bytes(block) {
                    self.state.borrow_mut().failures.push(format!("block {block}: {n} bytes, differ"));
                } else {
                    self.state.borrow_mut().verified += 1;
                }
            }
            (OpCode::Write, r) => self.state.borrow_mut().intrusion = Some(r),
            (op, Err(e)) => self.state.borrow_mut().failures.push(format!("{op:?}: {e}")),
            _ => {}
        }
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
        self.state.borrow_mut().closed = Some(reason);
    }
}

/// `rdma res show mr` lines of `len` bytes.
fn mrs_of_len(len: usize) -> usize {
    let out = std::process::Command::new("rdma").args(["res", "show", "mr"]).output().expect("rdma res show mr");
    String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.contains(&format!("mrlen {len} "))).count()
}

/// One region of 64 MiB, exposed to 8 connections (a window each over the whole region, one
/// registration): each peer READs its 8 MiB share, every byte verified; one of them WRITEs
/// through another's window and gets a remote access error, the region is unchanged, the
/// server names the violation as that connection's close reason, and the 7 others are served
/// again; `rdma res show mr` shows one MR of 64 MiB.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn one_region_serves_eight_peers_each_through_its_own_window() {
    if not_on_iwarp("one_region_serves_eight_peers_each_through_its_own_window", "checks that each peer's type-2 memory window works on its own connection only; siw has no memory windows (max_mw 0), and the registration fallback's keys are not confined to one connection (Config::exposure_registration)") {
        return;
    }
    let region = rdma_reactor::Region::zeroed(REGION).expect("a 64 MiB region");
    for b in 0..REGION / PIECE {
        region.write_at(b * PIECE, &region_bytes(b)).expect("fill");
    }
    let (mut srv, server) = (Reactor::new().expect("server"), addr());
    let shared = Rc::new(RefCell::new(RegionServer::default()));
    srv.listen(server, RegionListener { region: region.clone(), shared: shared.clone() }).expect("listen");
    let mut cli = Reactor::new().expect("clients");
    let local = rdma_reactor::Region::zeroed(REGION).expect("the clients' region");
    let mut readers = Vec::new();
    for idx in 0..PEERS {
        let state = Rc::new(RefCell::new(Reader::default()));
        let h = RegionReader { idx, local: local.clone(), state: state.clone() };
        // Connect one at a time, so the server's accept order is the client index.
        let t = cli.connect(server, ConnectOptions { msg_size: 64, ..Default::default() }, h).expect("connect");
        pump(&mut [&mut srv, &mut cli], LIMIT, "connected", || state.borrow().desc.is_some());
        readers.push((t, state));
    }
    let pieces = SHARE / PIECE;
    pump(&mut [&mut srv, &mut cli], Duration::from_secs(240), "every share read", || {
        readers.iter().all(|(_, s)| s.borrow().verified == pieces || !s.borrow().failures.is_empty())
    });
    for (i, (_, s)) in readers.iter().enumerate() {
        assert_eq!((s.borrow().verified, &s.borrow().failures), (pieces, &Vec::new()), "peer {i}");
    }
    let mrs = mrs_of_len(REGION);
    println!(
        "8 peers read their 8 MiB shares of one 64 MiB region, every byte verified; MRs of 64 MiB: {mrs} \
         (the server's region; the clients' region is another); server region registrations: {}",
        region.registrations()
    );
    assert_eq!(region.registrations(), 1, "one registration of the server's region for all 8 windows");
    assert_eq!(mrs, 2, "one MR for the server's region and one for the clients' region, not one per connection");

    // The intruder: peer 0 WRITEs through peer 1's window, on its own connection.
    let other = readers[1].1.borrow().desc.expect("peer 1's descriptor");
    let target = other.slice(SHARE as u32, 4096).expect("inside");
    let scribble = rdma_reactor::Region::from(vec![0xFFu8; 4096]);
    let t0 = readers[0].0;
    cli.ctx().submit(t0, Op::write_region(scribble.slice(..).expect("all"), target)).expect("submit");
    pump(&mut [&mut srv, &mut cli], LIMIT, "the intruder closed on both sides", || {
        readers[0].1.borrow().closed.is_some() && shared.borrow().closed.iter().any(|(i, _)| *i == 0)
    });
    let intruder = readers[0].1.borrow();
    let server_saw = shared.borrow().closed.iter().find(|(i, _)| *i == 0).map(|(_, r)| r.clone()).expect("closed");
    println!(
        "intruder: its WRITE {:?}, closed with {:?}; the server closed its connection with {server_saw:?} ({server_saw}); \
         server stats: peer_violations {}",
        intruder.intrusion,
        intruder.closed,
        srv.stats().peer_violations
    );
    assert_eq!(intruder.intrusion, Some(Err(rdma_reactor::OpError::Wc(rdma_reactor::WcStatus::RemAccessErr))));
    // Its connection closes with that error, or with `Peer` when the server's disconnect (it
    // closed the connection at once) is read before the failed WRITE's completion.
    assert!(
        matches!(
            intruder.closed,
            Some(CloseReason::WorkError(rdma_reactor::WcStatus::RemAccessErr) | CloseReason::Peer)
        ),
        "{:?}",
        intruder.closed
    );
    assert_eq!(server_saw, CloseReason::PeerViolation, "the server names the violation");
    assert_eq!(srv.stats().peer_violations, 1);
    drop(intruder);
    let mut back = vec![0u8; PIECE];
    for b in 0..REGION / PIECE {
        region.read_at(b * PIECE, &mut back).expect("read_at");
        assert!(back == region_bytes(b), "block {b} of the region changed");
    }

    // The others are still served.
    for (_, s) in &readers[1..] {
        s.borrow_mut().verified = 0;
    }
    let conns: Vec<_> = readers[1..].iter().map(|(t, _)| *t).collect();
    for (i, t) in conns.iter().enumerate() {
        let idx = i + 1;
        let desc = readers[idx].1.borrow().desc.expect("descriptor");
        for k in 0..pieces {
            let off = idx * SHARE + k * PIECE;
            let op = Op::read_region(
                local.slice(off..off + PIECE).expect("slice"),
                desc.slice(off as u32, PIECE as u32).expect("in"),
            );
            cli.ctx().submit(*t, op.user_data((off / PIECE) as u64)).expect("read again");
        }
    }
    pump(&mut [&mut srv, &mut cli], Duration::from_secs(240), "the shares read again", || {
        readers[1..].iter().all(|(_, s)| s.borrow().verified == pieces || !s.borrow().failures.is_empty())
    });
    for (i, (_, s)) in readers.iter().enumerate().skip(1) {
        assert_eq!(
            (s.borrow().verified, &s.borrow().failures, &s.borrow().closed),
            (pieces, &Vec::new(), &None),
            "peer {i}"
        );
    }
    for t in conns {
        cli.ctx().close(t);
    }
    pump(&mut [&mut srv, &mut cli], LIMIT, "all closed", || shared.borrow().closed.len() == PEERS);
    shared.borrow_mut().windows.clear();
}

/// Client side of the region operations test: SENDs from one part of its region, receives
/// the echo into another part, then WRITEs a third part into the server's region.
struct RegionOps {
    region: rdma_reactor::Region,
    state: Rc<RefCell<(Vec<String>, u32)>>,
    window: Option<rdma_reactor::RemoteSlice>,
}

const OPS_LEN: usize = 3000;

impl ConnectionHandler for RegionOps {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        // Receives complete in order: the descriptor takes the first (a pool buffer), the echo
        // the second, in the region (bytes 8192.. of it); a third, so flow control applies.
        post_recvs(conn, 1, 64);
        let into = self.region.slice(8192..8192 + 4096).expect("slice");
        conn.submit(Op::recv_region(into).user_data(7)).expect("recv into the region");
        post_recvs(conn, 1, 64);
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        let mut st = self.state.borrow_mut();
        match (c.opcode, c.user_data, c.result) {
            // The server's window descriptor (a pool receive).
            (OpCode::Recv, _, Ok(16)) if c.region.is_none() => {
                self.window = rdma_reactor::RemoteSlice::decode(c.buf.expect("buffer").as_slice());
                let from = self.region.slice(0..OPS_LEN).expect("slice");
                conn.submit(Op::send_region(from).user_data(1)).expect("send from the region");
            }
            (OpCode::Recv, 7, Ok(n)) => {
                let slice = c.region.expect("the slice comes back");
                let mut got = vec![0u8; n as usize];
                slice.region().read_at(slice.range().start, &mut got).expect("read_at");
                if got != pattern(OPS_LEN, 5, 0) {
                    st.0.push(format!("the echo received into the region differs ({n} bytes)"));
                }
                st.1 += 1;
                let w = self.window.expect("descriptor").slice(0, OPS_LEN as u32).expect("inside");
                let from = self.region.slice(4096..4096 + OPS_LEN).expect("slice");
                conn.submit(Op::write_region(from, w).user_data(2)).expect("write from the region");
            }
            (OpCode::Send, 1, Ok(_)) => st.1 += 1,
            (OpCode::Write, 2, Ok(_)) => st.1 += 1,
            (op, _, Err(e)) => st.0.push(format!("{op:?}: {e}")),
            _ => {}
        }
    }
}

/// Echoes pool messages and exposes its region (WRITE) to its peer.
struct RegionTarget {
    region: rdma_reactor::Region,
    window: Option<rdma_reactor::RegionWindow>,
}

impl ConnectionHandler for RegionTarget {
    fn on_ready(&mut self, conn: &mut Conn<'_>) {
        post_recvs(conn, 3, 4096);
    }

    fn on_established(&mut self, conn: &mut Conn<'_>) {
        let w = conn
            .expose_region(&self.region.slice(..).expect("all"), rdma_reactor::RemoteAccess::WRITE)
            .expect("expose");
        let mut msg = conn.alloc(16).expect("buffer");
        msg.fill_from(&w.remote().encode()).expect("16 bytes");
        conn.submit(Op::send(msg)).expect("send the descriptor");
        self.window = Some(w);
    }

    fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
        if let (OpCode::Recv, Ok(_)) = (c.opcode, c.result) {
            let _ = conn.submit(Op::send(c.buf.expect("buffer")));
        }
    }
}

struct RegionTargetListener(rdma_reactor::Region);

impl rdma_reactor::ListenerHandler for RegionTargetListener {
    fn on_connect_request(
        &mut self,
        _ctx: &mut Ctx<'_>,
        _req: &rdma_reactor::ConnectRequest,
    ) -> rdma_reactor::Decision {
        rdma_reactor::Decision::Accept(Box::new(RegionTarget { region: self.0.clone(), window: None }))
    }
}

/// SEND from, RECV into and WRITE from slices of an application region, with no copy: the
/// sent bytes come back (echoed) into another part of the region, and the written bytes land
/// in the server's region, every byte checked.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn send_recv_and_write_take_region_slices() {
    let theirs = rdma_reactor::Region::zeroed(64 * 1024).expect("server region");
    // On iWARP (no memory windows) the WRITE target is exposed by a registration of its own.
    let cfg = rdma_reactor::Config { exposure_registration: true, ..Default::default() };
    let (mut srv, server) = (Reactor::with_config(cfg).expect("server"), addr());
    srv.listen(server, RegionTargetListener(theirs.clone())).expect("listen");
    let ours = rdma_reactor::Region::from(vec![0u8; 16 * 1024]);
    ours.write_at(0, &pattern(OPS_LEN, 5, 0)).expect("fill");
    ours.write_at(4096, &pattern(OPS_LEN, 6, 0)).expect("fill");
    let mut cli = Reactor::new().expect("client");
    let state = Rc::new(RefCell::new((Vec::new(), 0)));
    let h = RegionOps { region: ours.clone(), state: state.clone(), window: None };
    cli.connect(server, ConnectOptions { msg_size: 4096, ..Default::default() }, h).expect("connect");
    pump(&mut [&mut srv, &mut cli], LIMIT, "send, receive and write", || {
        state.borrow().1 == 3 || !state.borrow().0.is_empty()
    });
    assert_eq!(state.borrow().0, Vec::<String>::new());
    let mut landed = vec![0u8; OPS_LEN];
    theirs.read_at(0, &mut landed).expect("read_at");
    assert!(landed == pattern(OPS_LEN, 6, 0), "the WRITE from the region landed in the server's region");
    println!(
        "region operations: SEND from, RECV into and WRITE from region slices, every byte checked; registrations: ours {}, theirs {}",
        ours.registrations(),
        theirs.registrations()
    );
    // On iWARP the server's region is exposed by an MR of the exposure's own, not the
    // region's: it has none.
    let theirs_regs = if transport() == "siw" { 0 } else { 1 };
    assert_eq!((ours.registrations(), theirs.registrations()), (1, theirs_regs));
}

/// What `TransportProbe` saw on its connection.
#[derive(Debug, Default)]
struct Probed {
    transport: Option<rdma_reactor::Transport>,
    write_imm: Option<Result<(), String>>,
    expose: Option<Result<u32, String>>,
    done: bool,
    closed: bool,
}

/// Tries, once established, what iWARP lacks: an RDMA WRITE with immediate data (only where
/// it is refused: elsewhere it would go to the peer) and an exposure.
struct TransportProbe(Rc<RefCell<Probed>>);

impl ConnectionHandler for TransportProbe {
    fn on_established(&mut self, conn: &mut Conn<'_>) {
        let mut p = self.0.borrow_mut();
        p.transport = conn.transport();
        if p.transport == Some(rdma_reactor::Transport::Iwarp) {
            let buf = conn.alloc(64).expect("alloc");
            let bogus = rdma_reactor::RemoteSlice { addr: 0, len: 64, rkey: 0 };
            p.write_imm = Some(match conn.submit(Op::write_imm(buf, bogus)) {
                Ok(()) => Ok(()),
                Err(e) => Err(e.error.to_string()),
            });
        }
        let mut buf = conn.alloc(64).expect("alloc");
        buf.fill_from(&[7; 64]).expect("fill");
        p.expose = Some(match conn.expose(buf, rdma_reactor::RemoteAccess::READ) {
            Ok(e) => Ok(e.remote().rkey),
            Err(e) => Err(e.to_string()),
        });
        p.done = true;
        conn.close();
    }

    fn on_completion(&mut self, _conn: &mut Conn<'_>, _c: Completion) {}

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, _reason: CloseReason) {
        self.0.borrow_mut().closed = true;
    }
}

fn probe_transport(cfg: rdma_reactor::Config) -> Probed {
    let (mut srv, server) = echo_server();
    let mut cli = Reactor::with_config(cfg).expect("client");
    let state = Rc::new(RefCell::new(Probed::default()));
    cli.connect(server, ConnectOptions::default(), TransportProbe(state.clone())).expect("connect");
    pump(&mut [&mut srv, &mut cli], LIMIT, "the probe", || state.borrow().done);
    // Both reactors tick until the close: the server's answers the client's disconnect (with
    // only the client's ticking, its disconnect waited `Timeouts::disconnect` out).
    pump(&mut [&mut srv, &mut cli], LIMIT, "the probe's close", || state.borrow().closed);
    run_until_idle(&mut cli, Duration::from_secs(5));
    Rc::try_unwrap(state).expect("the probe is done").into_inner()
}

/// The transport's differences (`proto/transport.rs`), on whichever device the VM points at:
/// on iWARP `Op::write_imm` is refused at submission and an exposure is refused unless
/// `Config::exposure_registration` allows a registration; on RoCE the window is made either way.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn write_imm_and_exposures_follow_the_transport() {
    let plain = probe_transport(rdma_reactor::Config::default());
    let allowed = probe_transport(rdma_reactor::Config { exposure_registration: true, ..Default::default() });
    println!("transport {:?}: default {plain:?}; with exposure_registration {allowed:?}", plain.transport);
    match plain.transport.expect("the connection has a device") {
        rdma_reactor::Transport::Iwarp => {
            let e = plain.write_imm.expect("tried").expect_err("write_imm is refused on iWARP");
            assert!(e.contains("immediate data") && e.contains("Op::write"), "{e}");
            let e = plain.expose.expect("tried").expect_err("no windows: refused by default");
            assert!(e.contains("exposure_registration") && e.contains("max_mw 0"), "{e}");
            let rkey = allowed.expose.expect("tried").expect("registration allowed");
            assert_ne!(rkey, 0);
        }
        _ => {
            assert_eq!(plain.write_imm, None);
            assert!(plain.expose.expect("tried").is_ok(), "a window on RoCE");
            assert!(allowed.expose.expect("tried").is_ok(), "a window on RoCE: the option is ignored");
        }
    }
}
