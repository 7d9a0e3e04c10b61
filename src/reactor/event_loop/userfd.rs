//! Application file descriptors in the reactor's epoll set: a socket, a pipe, a timerfd, with
//! a callback on the reactor's thread ([`Ctx::register_fd`]).
//!
//! Rules:
//! - Level-triggered, like the rest of the set: the callback is called in every tick in which
//!   the fd is ready, until it is drained (read to `EAGAIN`), its interest is changed
//!   ([`Ctx::set_fd_interest`]) or it is deregistered.
//! - The reactor registers **its own duplicate** of the fd (`F_DUPFD_CLOEXEC`), held until
//!   deregistration: the registration never names a closed or reused fd number, so
//!   [`Ctx::deregister_fd`] always removes it from the epoll set, also after the application
//!   closed its own fd. (The file stays open until then: an application closing a pipe's write
//!   end should deregister it first if the reader is to see the end of file.)
//! - Each registration has its own [`Token`] (kind `UserFd`, with a generation): an event
//!   of a registration removed earlier in the same tick is dropped, never delivered to
//!   another.
//! - A registered fd keeps the reactor busy: [`Reactor::run`](crate::Reactor::run) does not
//!   return for idleness while one is registered. [`Reactor::shutdown`](crate::Reactor::shutdown)
//!   deregisters them all (dropping their handlers without a call).

use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use nix::sys::epoll::{EpollEvent, EpollFlags};

use crate::error::{Error, Result};
use crate::proto::token::{FdKey, Key, Token};
use crate::reactor::{os, Core, Ctx};

bitflags::bitflags! {
    /// What readiness of a registered fd to report ([`Ctx::register_fd`]).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct Interest: u8 {
        /// Data to read, a connection to accept, an expired timerfd (`EPOLLIN`).
        const READABLE = 1;
        /// Room to write (`EPOLLOUT`).
        const WRITABLE = 2;
    }
}

bitflags::bitflags! {
    /// The readiness a registered fd's callback hears. `ERROR` and `HANGUP` are reported
    /// whatever the interest (as epoll does), and stay reported until the fd is deregistered.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct Readiness: u8 {
        /// `EPOLLIN` or `EPOLLPRI`.
        const READABLE = 1;
        /// `EPOLLOUT`.
        const WRITABLE = 2;
        /// `EPOLLERR`.
        const ERROR = 4;
        /// `EPOLLHUP` or `EPOLLRDHUP`.
        const HANGUP = 8;
    }
}

impl Interest {
    fn epoll_flags(self) -> EpollFlags {
        let mut f = EpollFlags::empty();
        if self.contains(Interest::READABLE) {
            f |= EpollFlags::EPOLLIN;
        }
        if self.contains(Interest::WRITABLE) {
            f |= EpollFlags::EPOLLOUT;
        }
        f
    }
}

impl Readiness {
    fn from_epoll(f: EpollFlags) -> Readiness {
        let mut r = Readiness::empty();
        if f.intersects(EpollFlags::EPOLLIN | EpollFlags::EPOLLPRI) {
            r |= Readiness::READABLE;
        }
        if f.contains(EpollFlags::EPOLLOUT) {
            r |= Readiness::WRITABLE;
        }
        if f.contains(EpollFlags::EPOLLERR) {
            r |= Readiness::ERROR;
        }
        if f.intersects(EpollFlags::EPOLLHUP | EpollFlags::EPOLLRDHUP) {
            r |= Readiness::HANGUP;
        }
        r
    }
}

/// One readiness report of a registered fd.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FdEvent {
    /// The registration's token ([`Ctx::deregister_fd`] takes it).
    pub token: Token,
    /// What the fd is ready for.
    pub readiness: Readiness,
    /// The value given at registration.
    pub user_data: u64,
}

/// The callback of a registered fd, called on the reactor's thread. Implemented by every
/// `FnMut(&mut Ctx<'_>, FdEvent)`.
pub trait FdHandler {
    /// The fd is ready. The context has no owner: [`Ctx::set_timer`] is refused in it (use a
    /// timerfd, or a connection's timer).
    fn on_fd(&mut self, ctx: &mut Ctx<'_>, event: FdEvent);
}

impl<F: FnMut(&mut Ctx<'_>, FdEvent)> FdHandler for F {
    fn on_fd(&mut self, ctx: &mut Ctx<'_>, event: FdEvent) {
        self(ctx, event);
    }
}

/// A registration.
pub(in crate::reactor) struct UserFd {
    /// The reactor's duplicate, the fd in the epoll set.
    fd: OwnedFd,
    user_data: u64,
    /// Taken out for the call.
    handler: Option<Box<dyn FdHandler>>,
}

impl Core {
    pub(in crate::reactor) fn register_fd(
        &mut self,
        fd: std::os::fd::BorrowedFd<'_>,
        interest: Interest,
        user_data: u64,
        handler: Box<dyn FdHandler>,
    ) -> Result<Token> {
        let dup = fd.try_clone_to_owned().map_err(|e| Error::Os { call: "fcntl(F_DUPFD_CLOEXEC)", source: e })?;
        let key = self.user_fds.insert(UserFd { fd: dup, user_data, handler: Some(handler) });
        let entry = self.user_fds.get(key).expect("just inserted");
        let ev = EpollEvent::new(interest.epoll_flags(), key.token().as_u64());
        if let Err(e) = self.epoll.add(entry.fd.as_fd(), ev) {
            self.user_fds.remove(key);
            return Err(os("epoll_ctl")(e));
        }
        Ok(key.token())
    }

    pub(in crate::reactor) fn set_fd_interest(&mut self, token: Token, interest: Interest) -> Result<()> {
        let key = self.user_fds.key_of(token).ok_or(Error::StaleToken(token.as_u64()))?;
        let entry = self.user_fds.get(key).expect("live key");
        let mut ev = EpollEvent::new(interest.epoll_flags(), token.as_u64());
        self.epoll.modify(entry.fd.as_fd(), &mut ev).map_err(os("epoll_ctl"))
    }

    pub(in crate::reactor) fn deregister_fd(&mut self, token: Token) -> bool {
        let Some(key) = self.user_fds.key_of(token) else { return false };
        let entry = self.user_fds.remove(key).expect("live key");
        // Cannot fail: the duplicate is open and in the set. Closing it would remove it too.
        let _ = self.epoll.delete(entry.fd.as_fd());
        true
    }

    /// Deregisters every fd (shutdown).
    pub(in crate::reactor) fn deregister_all_fds(&mut self) {
        for key in self.user_fds.keys() {
            self.deregister_fd(key.token());
        }
    }

    /// A registered fd is ready: call its handler. Returns 1 if it was called.
    pub(in crate::reactor) fn dispatch_fd(&mut self, token: Token, flags: EpollFlags) -> usize {
        let Some(key) = FdKey::of(token) else { return 0 };
        // None: deregistered earlier in this tick.
        let Some(entry) = self.user_fds.get_mut(key) else { return 0 };
        let Some(mut h) = entry.handler.take() else { return 0 };
        let event = FdEvent { token, readiness: Readiness::from_epoll(flags), user_data: entry.user_data };
        // A panic is kept for the end of the tick (see "Panics in callbacks" in mod.rs).
        self.deliver(|core| h.on_fd(&mut Ctx::new(core, None), event));
        if let Some(entry) = self.user_fds.get_mut(key) {
            entry.handler = Some(h);
        }
        1
    }
}

impl Ctx<'_> {
    /// Watches `fd` for `interest` in the reactor's epoll set: `handler` is called on the
    /// reactor's thread, level-triggered, with `user_data` and the readiness, in every tick in
    /// which the fd is ready. Returns the registration's token, for
    /// [`deregister_fd`](Self::deregister_fd) and [`set_fd_interest`](Self::set_fd_interest).
    ///
    /// The reactor registers a duplicate of `fd` (its own, until deregistration): closing
    /// `fd` first does not break the loop, and the file stays open until deregistration. A
    /// registered fd counts as work for [`Reactor::run`](crate::Reactor::run), which does not
    /// return for idleness while one is registered.
    ///
    /// A closure needs its parameter types spelled out (they are inferred from `FnMut` bounds
    /// only, and this one is [`FdHandler`]):
    ///
    /// ```no_run
    /// use rdma_reactor::{Ctx, FdEvent, Interest, Reactor};
    ///
    /// let mut reactor = Reactor::new()?;
    /// let (rx, tx) = std::os::unix::net::UnixDatagram::pair().expect("socketpair");
    /// rx.set_nonblocking(true).expect("O_NONBLOCK");
    /// // The callback owns `rx`; the reactor registers its own duplicate of the fd it is given.
    /// let fd = rx.try_clone().expect("dup");
    /// let token = reactor.ctx().register_fd(&fd, Interest::READABLE, 42, move |ctx: &mut Ctx<'_>, ev: FdEvent| {
    ///     let mut buf = [0u8; 64];
    ///     while let Ok(n) = rx.recv(&mut buf) {
    ///         println!("{} bytes for {}", n, ev.user_data);
    ///     }
    ///     ctx.deregister_fd(ev.token); // Once is enough: run() then returns (idle).
    /// })?;
    /// drop(fd);
    /// tx.send(b"hello").expect("send");
    /// reactor.run()?;
    /// # let _ = token;
    /// # Ok::<(), rdma_reactor::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Os`] naming `fcntl(F_DUPFD_CLOEXEC)` (out of fds) or `epoll_ctl` (for instance
    /// `EPERM`: a regular file cannot be polled).
    pub fn register_fd(
        &mut self,
        fd: impl AsFd,
        interest: Interest,
        user_data: u64,
        handler: impl FdHandler + 'static,
    ) -> Result<Token> {
        self.core.register_fd(fd.as_fd(), interest, user_data, Box::new(handler))
    }

    /// Changes what a registered fd is watched for (for instance, `WRITABLE` only while there
    /// is something to write).
    ///
    /// # Errors
    ///
    /// [`Error::StaleToken`] for a token that names no registration; [`Error::Os`] if
    /// `epoll_ctl` fails.
    pub fn set_fd_interest(&mut self, token: Token, interest: Interest) -> Result<()> {
        self.core.set_fd_interest(token, interest)
    }

    /// Removes a registration (also from inside its own callback): its handler is dropped and
    /// is not called again, not even for an event already read in this tick. Returns false
    /// for a token that names none (stale, or already deregistered).
    pub fn deregister_fd(&mut self, token: Token) -> bool {
        self.core.deregister_fd(token)
    }

    /// Registered fds.
    pub fn registered_fds(&self) -> usize {
        self.core.user_fds.len()
    }
}

impl std::fmt::Debug for UserFd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UserFd").field("fd", &self.fd.as_raw_fd()).field("user_data", &self.user_data).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interest_and_readiness_map_to_epoll() {
        assert_eq!(Interest::READABLE.epoll_flags(), EpollFlags::EPOLLIN);
        assert_eq!((Interest::READABLE | Interest::WRITABLE).epoll_flags(), EpollFlags::EPOLLIN | EpollFlags::EPOLLOUT);
        assert_eq!(Interest::empty().epoll_flags(), EpollFlags::empty());
        assert_eq!(Readiness::from_epoll(EpollFlags::EPOLLIN), Readiness::READABLE);
        assert_eq!(
            Readiness::from_epoll(EpollFlags::EPOLLPRI | EpollFlags::EPOLLOUT),
            Readiness::READABLE | Readiness::WRITABLE
        );
        assert_eq!(
            Readiness::from_epoll(EpollFlags::EPOLLERR | EpollFlags::EPOLLHUP),
            Readiness::ERROR | Readiness::HANGUP
        );
        assert_eq!(Readiness::from_epoll(EpollFlags::EPOLLRDHUP), Readiness::HANGUP);
    }
}
