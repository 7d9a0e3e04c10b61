//! The async face's listener: [`Listener::bind`] listens on the reactor polling it, with a
//! handler of this module's ([`AsyncListener`]) that accepts every request and gives each
//! connection an async handler (`connection.rs`); [`Listener::accept`] yields them once they
//! are established. Each connection's receives are of the size the reactor announces for it:
//! the smaller of its client's `msg_size` and [`Config::msg_size`](crate::Config::msg_size)
//! (64 KiB at the defaults), [`Config::recv_depth`](crate::Config::recv_depth) of them; a
//! request whose receives would pin more than [`Config::recv_budget`](crate::Config::recv_budget)
//! is refused before anything is registered for it.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use super::connection::{AsyncConn, ConnState, Connection};
use crate::error::{Error, Result};
use crate::proto::conn::CloseReason;
use crate::proto::token::Token;
use crate::reactor::{with_ctx, ConnectRequest, Ctx, Decision, ExecId, ListenerHandler, Orphans};

/// What a listener's handler and its handle share.
pub(super) struct ListenState {
    /// Established connections not yet taken by `accept`.
    pub(super) ready: VecDeque<Connection>,
    pub(super) waiters: VecDeque<Waker>,
    pub(super) closed: bool,
    reason: Option<CloseReason>,
    orphans: Orphans,
    /// The reactor it listens on, which its connections live on too.
    home: ExecId,
}

/// The callback side of an async listener: accepts every request.
struct AsyncListener {
    st: Rc<RefCell<ListenState>>,
}

impl ListenerHandler for AsyncListener {
    fn on_connect_request(&mut self, _ctx: &mut Ctx<'_>, req: &ConnectRequest) -> Decision {
        // Its receives are of the size the reactor announces for it, the smaller of the
        // client's claim and `Config::msg_size` (`AsyncConn::on_ready`), never the claim alone.
        let _ = req;
        let (orphans, home) = {
            let st = self.st.borrow();
            (st.orphans.clone(), st.home)
        };
        let st = ConnState::new(orphans, home);
        Decision::Accept(Box::new(AsyncConn { st, accept: Some(self.st.clone()) }))
    }

    fn on_closed(&mut self, _ctx: &mut Ctx<'_>, reason: CloseReason) {
        let mut st = self.st.borrow_mut();
        st.closed = true;
        st.reason = Some(reason);
        for w in st.waiters.drain(..) {
            w.wake();
        }
    }
}

/// A listener of the async face: [`accept`](Listener::accept) yields its connections once
/// they are established. Dropping it stops listening (connections already accepted live on).
pub struct Listener {
    st: Rc<RefCell<ListenState>>,
    token: Token,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener").field("token", &self.token).finish()
    }
}

impl Listener {
    /// Binds to `addr` and listens, on the reactor polling this code.
    ///
    /// # Errors
    ///
    /// As [`Ctx::listen`]; [`Error::NoReactor`] outside a reactor.
    pub fn bind(addr: SocketAddr) -> Result<Listener> {
        with_ctx(|ctx| {
            let st = Rc::new(RefCell::new(ListenState {
                ready: VecDeque::new(),
                waiters: VecDeque::new(),
                closed: false,
                reason: None,
                orphans: ctx.orphans(),
                home: ctx.exec_id(),
            }));
            let token = ctx.listen(addr, AsyncListener { st: st.clone() })?;
            Ok(Listener { st, token })
        })?
    }

    /// The listener's token.
    pub fn token(&self) -> Token {
        self.token
    }

    /// The next established connection.
    ///
    /// # Errors
    ///
    /// [`Error::Closed`] once the listener is closed (its device lost, the reactor shut down).
    pub fn accept(&self) -> Accept<'_> {
        Accept { listener: self }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let mut st = self.st.borrow_mut();
        st.closed = true;
        st.ready.clear();
        st.orphans.push(self.token);
    }
}

/// [`Listener::accept`]'s future.
pub struct Accept<'a> {
    listener: &'a Listener,
}

impl std::fmt::Debug for Accept<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Accept").finish()
    }
}

impl Future for Accept<'_> {
    type Output = Result<Connection>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut st = self.listener.st.borrow_mut();
        if let Some(c) = st.ready.pop_front() {
            return Poll::Ready(Ok(c));
        }
        if st.closed {
            return Poll::Ready(Err(Error::Closed(st.reason.clone().unwrap_or(CloseReason::Local))));
        }
        st.waiters.retain(|w| !w.will_wake(cx.waker()));
        st.waiters.push_back(cx.waker().clone());
        Poll::Pending
    }
}
