//! Closes that race: both sides in the same tick, and closes from inside callbacks.

use super::*;

/// Case 33: both sides close in the same tick. Each hears `on_closed` exactly once, with a
/// clean reason.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn simultaneous_close_is_heard_once_on_each_side() {
    struct Closer(Rc<RefCell<Vec<CloseReason>>>);
    impl ConnectionHandler for Closer {
        fn on_established(&mut self, conn: &mut Conn<'_>) {
            conn.close();
        }
        fn on_completion(&mut self, _conn: &mut Conn<'_>, _c: Completion) {}
        fn on_closed(&mut self, _ctx: &mut Ctx<'_>, _token: Token, reason: CloseReason) {
            self.0.borrow_mut().push(reason);
        }
    }
    struct Both(Rc<RefCell<Vec<CloseReason>>>);
    impl rdma_reactor::ListenerHandler for Both {
        fn on_connect_request(
            &mut self,
            _ctx: &mut Ctx<'_>,
            _req: &rdma_reactor::ConnectRequest,
        ) -> rdma_reactor::Decision {
            rdma_reactor::Decision::Accept(Box::new(Closer(self.0.clone())))
        }
    }
    {
        let mut r = Reactor::new().expect("reactor");
        let a = addr();
        let closed = Rc::new(RefCell::new(Vec::new()));
        let l = r.listen(a, Both(closed.clone())).expect("listen");
        for _ in 0..8 {
            r.connect(a, ConnectOptions::default(), Closer(closed.clone())).expect("connect");
        }
        pump(&mut [&mut r], LIMIT, "every close heard", || closed.borrow().len() >= 16);
        r.ctx().close(l);
        run_until_idle(&mut r, LIMIT);
        let closed = closed.borrow();
        assert_eq!(closed.len(), 16, "one on_closed per side: {closed:?}");
        assert!(closed.iter().all(|c| matches!(c, CloseReason::Local | CloseReason::Peer)), "{closed:?}");
    }
    assert_baseline();
}

/// Cases 28 and 29: closing from inside callbacks. A connection closes itself from its own
/// completion, closes another connection whose completion may be later in the same batch,
/// the last one to close closes the listener from its `on_closed` and starts a new connect
/// from there, which is refused cleanly or served. Every `on_closed` once, no hang, nothing
/// left behind.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn closing_from_inside_callbacks_is_safe() {
    #[derive(Default)]
    struct Book {
        tokens: Vec<Token>,
        closed: Vec<(Token, CloseReason)>,
        listener: Option<Token>,
        reconnect: Option<Rc<RefCell<PingResult>>>,
    }
    type Shared = Rc<RefCell<Book>>;
    /// Sends one message; on its first completion closes itself and its neighbour.
    struct Closer {
        me: usize,
        book: Shared,
        addr: SocketAddr,
    }
    impl ConnectionHandler for Closer {
        fn on_ready(&mut self, conn: &mut Conn<'_>) {
            let buf = conn.alloc(SIZE).expect("buffer");
            conn.submit(Op::recv(buf)).expect("receive");
        }
        fn on_established(&mut self, conn: &mut Conn<'_>) {
            let mut buf = conn.alloc(SIZE).expect("buffer");
            buf.fill_from(&[7; SIZE]).expect("fill");
            conn.submit(Op::send(buf)).expect("send");
        }
        fn on_completion(&mut self, conn: &mut Conn<'_>, c: Completion) {
            if c.opcode == OpCode::Recv && c.result.is_ok() {
                conn.close();
                let other = self.book.borrow().tokens.get(self.me ^ 1).copied();
                if let Some(other) = other {
                    conn.ctx().close(other);
                }
            }
        }
        fn on_closed(&mut self, ctx: &mut Ctx<'_>, token: Token, reason: CloseReason) {
            let mut b = self.book.borrow_mut();
            b.closed.push((token, reason));
            if b.closed.len() == b.tokens.len() {
                if let Some(l) = b.listener.take() {
                    ctx.close(l);
                }
                // A new connect from inside on_closed: the listener is closing, so it is
                // refused (or, if the request raced ahead, served).
                let (c, result) = PingClient::new(99, SIZE, 1);
                let opts = ConnectOptions { msg_size: SIZE as u32, ..ConnectOptions::default() };
                ctx.connect(self.addr, opts, c).expect("connect from on_closed");
                b.reconnect = Some(result);
            }
        }
    }
    {
        let mut r = Reactor::new().expect("reactor");
        let s = listen(&mut r, 4);
        let book: Shared = Rc::default();
        book.borrow_mut().listener =
            Some(r.listen(addr(), EchoListener { depth: 1, agents_closed: Rc::default() }).expect("second listener"));
        for me in 0..8 {
            let opts = ConnectOptions { msg_size: SIZE as u32, ..ConnectOptions::default() };
            let t = r.connect(s.addr, opts, Closer { me, book: book.clone(), addr: s.addr }).expect("connect");
            book.borrow_mut().tokens.push(t);
        }
        pump(&mut [&mut r], LIMIT, "every closer closed and the reconnect ended", || {
            let b = book.borrow();
            b.closed.len() == 8 && b.reconnect.as_ref().is_some_and(|p| p.borrow().closed.is_some())
        });
        let b = book.borrow();
        let mut tokens: Vec<Token> = b.closed.iter().map(|(t, _)| *t).collect();
        tokens.sort();
        tokens.dedup();
        assert_eq!(tokens.len(), 8, "one on_closed per connection: {:?}", b.closed);
        assert!(b.closed.iter().all(|(_, r)| r.is_clean()), "{:?}", b.closed);
        let re = b.reconnect.as_ref().expect("reconnect").borrow();
        assert!(re.error.is_none() && re.closed == Some(CloseReason::Local), "the connect from on_closed: {re:?}");
        drop(re);
        drop(b);
        pump(&mut [&mut r], LIMIT, "agents closed", || s.agents_closed.borrow().len() == 9);
    }
    assert_baseline();
}
