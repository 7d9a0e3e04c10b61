//! rdma_cm: the event channel, communication ids and their events.
#![allow(unsafe_code)]

use std::io;
use std::mem;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsFd, BorrowedFd, RawFd};
use std::ptr::{self, NonNull};
use std::rc::Rc;

use nix::libc;
use rdma_sys as ffi;

use super::device::DeviceRef;
use super::{cvt, cvt_ptr, nonblock, set_nonblocking};
use crate::proto::conn::CmEventKind;

/// The shared rdma_cm event channel, its fd non-blocking from creation.
#[derive(Debug)]
pub struct EventChannel {
    raw: NonNull<ffi::rdma_event_channel>,
}

impl EventChannel {
    /// Creates the channel and sets its fd `O_NONBLOCK`.
    pub fn new() -> io::Result<Rc<EventChannel>> {
        // SAFETY: no preconditions; the result is checked for NULL.
        let raw = cvt_ptr(unsafe { ffi::rdma_create_event_channel() })?;
        let chan = EventChannel { raw };
        set_nonblocking(chan.fd())?;
        Ok(Rc::new(chan))
    }

    /// The fd to register with epoll.
    pub fn fd(&self) -> RawFd {
        // SAFETY: self.raw is live until Drop.
        unsafe { self.raw.as_ref() }.fd
    }

    /// The next event, or `None` when none is pending (EAGAIN).
    pub fn get_event(&self) -> io::Result<Option<CmEvent>> {
        let mut ev: *mut ffi::rdma_cm_event = ptr::null_mut();
        // SAFETY: self.raw is live; ev is a valid out-pointer.
        let r = nonblock(cvt(unsafe { ffi::rdma_get_cm_event(self.raw.as_ptr(), &mut ev) }))?;
        Ok(r.and_then(|_| NonNull::new(ev)).map(|raw| CmEvent { raw, child_taken: false }))
    }
}

impl AsFd for EventChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the fd belongs to self.raw, which is open while self lives.
        unsafe { BorrowedFd::borrow_raw(self.fd()) }
    }
}

impl Drop for EventChannel {
    fn drop(&mut self) {
        // Every CmId holds an Rc of this channel, so all ids are destroyed by now; their events
        // were acked before they were destroyed.
        // SAFETY: self.raw is live and owned; this is its only destroy.
        unsafe { ffi::rdma_destroy_event_channel(self.raw.as_ptr()) };
    }
}

/// One rdma_cm event, acked when dropped.
///
/// **Invariant:** a `CmEvent` never outlives the tick that read it, and the id it names is
/// destroyed only after it is dropped (`rdma_destroy_id` blocks until its events are acked).
#[derive(Debug)]
pub(crate) struct CmEvent {
    raw: NonNull<ffi::rdma_cm_event>,
    /// The new id of a CONNECT_REQUEST has been given an owner.
    child_taken: bool,
}

impl CmEvent {
    fn ev(&self) -> &ffi::rdma_cm_event {
        // SAFETY: self.raw is live until acked in Drop.
        unsafe { self.raw.as_ref() }
    }

    /// The event type.
    pub fn kind(&self) -> CmEventKind {
        use ffi::rdma_cm_event_type as T;
        match self.ev().event {
            T::RDMA_CM_EVENT_ADDR_RESOLVED => CmEventKind::AddrResolved,
            T::RDMA_CM_EVENT_ADDR_ERROR => CmEventKind::AddrError,
            T::RDMA_CM_EVENT_ROUTE_RESOLVED => CmEventKind::RouteResolved,
            T::RDMA_CM_EVENT_ROUTE_ERROR => CmEventKind::RouteError,
            T::RDMA_CM_EVENT_CONNECT_REQUEST => CmEventKind::ConnectRequest,
            T::RDMA_CM_EVENT_CONNECT_RESPONSE => CmEventKind::ConnectResponse,
            T::RDMA_CM_EVENT_CONNECT_ERROR => CmEventKind::ConnectError,
            T::RDMA_CM_EVENT_UNREACHABLE => CmEventKind::Unreachable,
            T::RDMA_CM_EVENT_REJECTED => CmEventKind::Rejected,
            T::RDMA_CM_EVENT_ESTABLISHED => CmEventKind::Established,
            T::RDMA_CM_EVENT_DISCONNECTED => CmEventKind::Disconnected,
            T::RDMA_CM_EVENT_DEVICE_REMOVAL => CmEventKind::DeviceRemoval,
            T::RDMA_CM_EVENT_MULTICAST_JOIN => CmEventKind::MulticastJoin,
            T::RDMA_CM_EVENT_MULTICAST_ERROR => CmEventKind::MulticastError,
            T::RDMA_CM_EVENT_ADDR_CHANGE => CmEventKind::AddrChange,
            T::RDMA_CM_EVENT_TIMEWAIT_EXIT => CmEventKind::TimewaitExit,
            other => CmEventKind::Unknown(other),
        }
    }

    /// The event status (0, a negative errno, or a CM reject reason).
    pub fn status(&self) -> i32 {
        self.ev().status
    }

    /// The context (our token) of the id the event is for; for a connect request, of the
    /// listening id.
    pub fn context(&self) -> u64 {
        let ev = self.ev();
        let id =
            if self.kind() == CmEventKind::ConnectRequest && !ev.listen_id.is_null() { ev.listen_id } else { ev.id };
        if id.is_null() {
            return 0;
        }
        // SAFETY: the id named by a live event is live until the event is acked.
        unsafe { (*id).context as u64 }
    }

    /// The private data, copied (zero-padded by the kernel to the transport maximum).
    pub fn private_data(&self) -> Vec<u8> {
        match self.kind() {
            CmEventKind::ConnectRequest
            | CmEventKind::ConnectResponse
            | CmEventKind::Established
            | CmEventKind::Rejected
            | CmEventKind::Disconnected => {}
            _ => return Vec::new(),
        }
        // SAFETY: for these event types param.conn is the active union member.
        let conn = unsafe { self.ev().param.conn };
        if conn.private_data.is_null() || conn.private_data_len == 0 {
            return Vec::new();
        }
        // SAFETY: rdma-core guarantees private_data_len readable bytes while the event lives.
        unsafe { std::slice::from_raw_parts(conn.private_data as *const u8, conn.private_data_len as usize) }.to_vec()
    }

    /// The connect request's initiator depth and responder resources.
    pub fn conn_resources(&self) -> (u8, u8) {
        // SAFETY: param.conn is the active member for connect requests; for other events the
        // values are only read, never trusted.
        let conn = unsafe { self.ev().param.conn };
        (conn.initiator_depth, conn.responder_resources)
    }

    /// Takes ownership of the new id a CONNECT_REQUEST created; `None` for any other event,
    /// and on every call after the first, so the id never has two owners.
    ///
    /// The returned id must be dropped only after this event is acked (the reactor destroys
    /// ids at the end of the tick).
    pub(crate) fn take_child(&mut self, chan: &Rc<EventChannel>, context: u64) -> Option<CmId> {
        if self.kind() != CmEventKind::ConnectRequest || self.child_taken {
            return None;
        }
        let raw = NonNull::new(self.ev().id)?;
        self.child_taken = true;
        let id = CmId { raw, _chan: chan.clone() };
        id.set_context(context);
        Some(id)
    }
}

impl Drop for CmEvent {
    fn drop(&mut self) {
        // SAFETY: self.raw came from rdma_get_cm_event and is acked exactly once, here.
        let _ = unsafe { ffi::rdma_ack_cm_event(self.raw.as_ptr()) };
    }
}

/// Connection parameters for `rdma_connect` and `rdma_accept`.
#[derive(Clone, Debug, Default)]
pub struct ConnParam<'a> {
    /// Private data (at most 56 bytes on connect, 196 on accept).
    pub private_data: &'a [u8],
    /// RDMA READs the peer may have outstanding against us.
    pub responder_resources: u8,
    /// RDMA READs we may have outstanding against the peer.
    pub initiator_depth: u8,
    /// Transport retries (0..=7).
    pub retry_count: u8,
    /// Receiver-not-ready retries (0..=7; 7 is infinite).
    pub rnr_retry_count: u8,
}

impl ConnParam<'_> {
    pub(super) fn raw(&self) -> ffi::rdma_conn_param {
        ffi::rdma_conn_param {
            private_data: if self.private_data.is_empty() { ptr::null() } else { self.private_data.as_ptr().cast() },
            private_data_len: self.private_data.len().min(u8::MAX as usize) as u8,
            responder_resources: self.responder_resources,
            initiator_depth: self.initiator_depth,
            flow_control: 1,
            retry_count: self.retry_count.min(7),
            rnr_retry_count: self.rnr_retry_count.min(7),
            srq: 0,
            qp_num: 0,
        }
    }
}

/// An owned rdma_cm id on the shared channel.
///
/// Drop destroys the id, then releases the channel. An id with a queue pair is owned by a
/// [`Qp`](super::qp::Qp), which destroys the queue pair first.
#[derive(Debug)]
pub(crate) struct CmId {
    raw: NonNull<ffi::rdma_cm_id>,
    _chan: Rc<EventChannel>,
}

fn sockaddr(addr: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain old data; all-zero is a valid value.
    let mut ss: libc::sockaddr_storage = unsafe { mem::zeroed() };
    match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from_ne_bytes(a.ip().octets()) },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and suitably aligned for sockaddr_in.
            unsafe { ptr::write(&mut ss as *mut _ as *mut libc::sockaddr_in, sin) };
            (ss, mem::size_of::<libc::sockaddr_in>() as libc::socklen_t)
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr { s6_addr: a.ip().octets() },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and suitably aligned for sockaddr_in6.
            unsafe { ptr::write(&mut ss as *mut _ as *mut libc::sockaddr_in6, sin6) };
            (ss, mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t)
        }
    }
}

/// Reads a socket address written by rdma-core.
///
/// # Safety
///
/// `sa` points to a readable sockaddr of the family it names.
unsafe fn from_sockaddr(sa: *const libc::sockaddr) -> Option<SocketAddr> {
    // SAFETY: per the contract, sa is readable.
    match i32::from(unsafe { (*sa).sa_family }) {
        libc::AF_INET => {
            // SAFETY: the family says this is a sockaddr_in.
            let sin = unsafe { &*(sa as *const libc::sockaddr_in) };
            let ip = Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            Some(SocketAddr::V4(SocketAddrV4::new(ip, u16::from_be(sin.sin_port))))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says this is a sockaddr_in6.
            let sin6 = unsafe { &*(sa as *const libc::sockaddr_in6) };
            let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            Some(SocketAddr::V6(SocketAddrV6::new(
                ip,
                u16::from_be(sin6.sin6_port),
                sin6.sin6_flowinfo,
                sin6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

impl CmId {
    /// Creates a reliable-connected (RDMA_PS_TCP) id on `chan` with `context` as its context.
    pub fn new(chan: &Rc<EventChannel>, context: u64) -> io::Result<CmId> {
        let mut raw: *mut ffi::rdma_cm_id = ptr::null_mut();
        // SAFETY: chan is live; raw is a valid out-pointer; context is an opaque integer.
        cvt(unsafe {
            ffi::rdma_create_id(
                chan.raw.as_ptr(),
                &mut raw,
                context as usize as *mut _,
                ffi::rdma_port_space::RDMA_PS_TCP,
            )
        })?;
        let raw = cvt_ptr(raw)?;
        Ok(CmId { raw, _chan: chan.clone() })
    }

    pub(super) fn id(&self) -> *mut ffi::rdma_cm_id {
        self.raw.as_ptr()
    }

    /// The id's address, never NULL (`connect.rs` moves it to its helper thread).
    pub(super) fn non_null(&self) -> NonNull<ffi::rdma_cm_id> {
        self.raw
    }

    /// Replaces the id's context (our token).
    pub fn set_context(&self, context: u64) {
        // SAFETY: self.raw is live; the context field is ours to write and is only read by
        // this crate (rdma-core copies it, never dereferences it).
        unsafe { (*self.id()).context = context as usize as *mut _ };
    }

    /// `rdma_bind_addr`.
    pub fn bind(&self, addr: &SocketAddr) -> io::Result<()> {
        let (mut ss, _) = sockaddr(addr);
        // SAFETY: self.raw is live; ss is a valid sockaddr for the call's duration.
        cvt(unsafe { ffi::rdma_bind_addr(self.id(), &mut ss as *mut _ as *mut _) }).map(drop)
    }

    /// `rdma_listen`.
    pub fn listen(&self, backlog: i32) -> io::Result<()> {
        // SAFETY: self.raw is live and bound.
        cvt(unsafe { ffi::rdma_listen(self.id(), backlog) }).map(drop)
    }

    /// `rdma_resolve_addr`.
    pub fn resolve_addr(&self, src: Option<&SocketAddr>, dst: &SocketAddr, timeout_ms: i32) -> io::Result<()> {
        let (mut d, _) = sockaddr(dst);
        let mut s = src.map(sockaddr);
        let sp = s.as_mut().map_or(ptr::null_mut(), |(ss, _)| ss as *mut _ as *mut _);
        // SAFETY: self.raw is live; the sockaddrs are valid for the call's duration.
        cvt(unsafe { ffi::rdma_resolve_addr(self.id(), sp, &mut d as *mut _ as *mut _, timeout_ms) }).map(drop)
    }

    /// `rdma_resolve_route`.
    pub fn resolve_route(&self, timeout_ms: i32) -> io::Result<()> {
        // SAFETY: self.raw is live.
        cvt(unsafe { ffi::rdma_resolve_route(self.id(), timeout_ms) }).map(drop)
    }

    /// The device the id is bound to, once bound or resolved.
    pub fn device(&self) -> Option<DeviceRef> {
        // SAFETY: self.raw is live.
        DeviceRef::from_raw(unsafe { (*self.id()).verbs })
    }

    /// Sets the RC ACK timeout of the id's queue pair (`RDMA_OPTION_ID_ACK_TIMEOUT`): the
    /// exponent `t` of 4.096 µs × 2^t. Takes effect when the queue pair is connected, so set
    /// it before `rdma_connect` or `rdma_accept`.
    pub fn set_ack_timeout(&self, exponent: u8) -> io::Result<()> {
        // From rdma_cma.h: RDMA_OPTION_ID = 0, RDMA_OPTION_ID_ACK_TIMEOUT = 3 (uint8_t).
        const RDMA_OPTION_ID: i32 = 0;
        const RDMA_OPTION_ID_ACK_TIMEOUT: i32 = 3;
        let mut v = exponent;
        // SAFETY: self.id is live; v is a valid u8 for the call's duration.
        cvt(unsafe {
            ffi::rdma_set_option(self.id(), RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, (&mut v as *mut u8).cast(), 1)
        })
        .map(drop)
    }

    /// `rdma_connect`.
    pub fn connect(&self, param: &ConnParam<'_>) -> io::Result<()> {
        let mut p = param.raw();
        // SAFETY: self.raw is live; p and its private data are valid for the call.
        cvt(unsafe { ffi::rdma_connect(self.id(), &mut p) }).map(drop)
    }

    /// `rdma_accept`. Call it before the connect request's event is acked.
    pub fn accept(&self, param: &ConnParam<'_>) -> io::Result<()> {
        let mut p = param.raw();
        // SAFETY: self.raw is live; p and its private data are valid for the call.
        cvt(unsafe { ffi::rdma_accept(self.id(), &mut p) }).map(drop)
    }

    /// `rdma_reject` with private data.
    pub fn reject(&self, private_data: &[u8]) -> io::Result<()> {
        let len = private_data.len().min(u8::MAX as usize) as u8;
        let p = if private_data.is_empty() { ptr::null() } else { private_data.as_ptr().cast() };
        // SAFETY: self.raw is live; the private data is valid for the call.
        cvt(unsafe { ffi::rdma_reject(self.id(), p, len) }).map(drop)
    }

    /// `rdma_disconnect`. EINVAL (already disconnected, or the QP already in error) is success.
    pub fn disconnect(&self) -> io::Result<()> {
        // SAFETY: self.raw is live.
        match cvt(unsafe { ffi::rdma_disconnect(self.id()) }) {
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(()),
            r => r.map(drop),
        }
    }

    /// The local address.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        // SAFETY: self.raw is live; rdma-core keeps the route's addresses inside the id.
        unsafe { from_sockaddr(&(*self.id()).route.addr.src_addr_union.src_addr) }
    }

    /// The peer address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        // SAFETY: as for local_addr.
        unsafe { from_sockaddr(&(*self.id()).route.addr.dst_addr_union.dst_addr) }
    }
}

/// The address of a reactor's event channel, for migrating ids to it from another thread.
///
/// It is only a pointer: it carries no ownership. The reactor keeps it inside its
/// `Mutex`-guarded inbox and clears it under that lock before its channel is destroyed, so a
/// sender that finds it there, and migrates while still holding the lock, migrates to a live
/// channel.
#[derive(Debug)]
pub(crate) struct ChannelRef {
    raw: NonNull<ffi::rdma_event_channel>,
}

// SAFETY: a ChannelRef is an address with no methods that dereference it except
// `CmId::migrate`, whose caller (the reactor's inbox) guarantees the channel is live by
// holding the lock under which its owner clears the ChannelRef before destroying the channel.
// librdmacm's channel functions are thread-safe (a write on its fd).
unsafe impl Send for ChannelRef {}

impl EventChannel {
    /// The channel's address, for `CmId::migrate` from another thread (see `ChannelRef`).
    pub(crate) fn channel_ref(&self) -> ChannelRef {
        ChannelRef { raw: self.raw }
    }
}

/// An id in transit between two reactors: migrated to the receiving reactor's channel, not
/// yet owned by it. Its only use is `into_id` on the receiving thread; dropped unused, it
/// destroys the id (the kernel then rejects the connect request).
#[derive(Debug)]
pub(crate) struct MigratedId {
    raw: NonNull<ffi::rdma_cm_id>,
}

// SAFETY: librdmacm ids may be used from any thread as long as one thread uses each at a
// time. A MigratedId is the id's only handle (the sending reactor gave up its `CmId` in
// `CmId::migrate`), it offers no method but `into_id` and Drop, and it holds no Rc: it moves
// the id from one thread to another, never shares it.
unsafe impl Send for MigratedId {}

impl MigratedId {
    /// Gives the id its owner on the receiving reactor: `chan` must be the channel it was
    /// migrated to (checked: `None` and the id destroyed otherwise).
    pub(crate) fn into_id(self, chan: &Rc<EventChannel>) -> Option<CmId> {
        let raw = self.raw;
        // SAFETY: raw is live (owned by self); librdmacm set id->channel in rdma_migrate_id.
        let on = unsafe { (*raw.as_ptr()).channel } == chan.raw.as_ptr();
        if !on {
            return None; // Drop destroys it.
        }
        mem::forget(self);
        Some(CmId { raw, _chan: chan.clone() })
    }
}

impl Drop for MigratedId {
    fn drop(&mut self) {
        // SAFETY: self.raw is owned and live; its events on the new channel are either unread
        // (freed by the kernel) or were acked by the reactor that read them.
        let _ = unsafe { ffi::rdma_destroy_id(self.raw.as_ptr()) };
    }
}

impl CmId {
    /// `rdma_migrate_id` to `target`, giving up this thread's ownership: the id's events
    /// come on `target` from now on (the kernel moves the unread ones), and every command on
    /// it must go through that channel, so only the receiving reactor may use it.
    ///
    /// Call it only after every event of the id read on the current channel was acked (else
    /// it blocks until they are), and only while `target` is live (see `ChannelRef`). On
    /// failure the id is given back, still on its channel.
    pub(crate) fn migrate(self, target: &ChannelRef) -> Result<MigratedId, (CmId, io::Error)> {
        // SAFETY: self.raw is live; target is a live channel (the caller's contract, held by
        // the inbox lock).
        match cvt(unsafe { ffi::rdma_migrate_id(self.id(), target.raw.as_ptr()) }) {
            Ok(_) => {
                let me = mem::ManuallyDrop::new(self);
                let raw = me.raw;
                // SAFETY: `me` is never used or dropped again; its Rc of the old channel is
                // released here, on the thread that owns that channel.
                drop(unsafe { ptr::read(&me._chan) });
                Ok(MigratedId { raw })
            }
            Err(e) => Err((self, e)),
        }
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        // SAFETY: self.raw is owned and live; every event naming it was acked (the reactor
        // drops ids only at the end of a tick, after the tick's events).
        let _ = unsafe { ffi::rdma_destroy_id(self.id()) };
        // The channel drops after this, as a field.
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsFd, AsRawFd};

    use nix::fcntl::{fcntl, FcntlArg, FdFlag, OFlag};

    use super::EventChannel;

    #[test]
    #[ignore = "needs an RDMA device: cargo xtask test"]
    fn the_event_channel_is_nonblocking_and_cloexec() {
        let chan = EventChannel::new().expect("rdma_create_event_channel");
        let fd = chan.as_fd();
        assert!(fd.as_raw_fd() >= 0, "the event channel has no fd ({fd:?})");
        let fl = OFlag::from_bits_retain(fcntl(fd, FcntlArg::F_GETFL).expect("F_GETFL"));
        assert!(fl.contains(OFlag::O_NONBLOCK), "O_NONBLOCK is not set: {fl:?}");
        let fdfl = FdFlag::from_bits_retain(fcntl(fd, FcntlArg::F_GETFD).expect("F_GETFD"));
        assert!(fdfl.contains(FdFlag::FD_CLOEXEC), "FD_CLOEXEC is not set: {fdfl:?}");
        // No event is pending on a fresh channel: EAGAIN is "no event", not an error.
        assert!(chan.get_event().expect("get_event").is_none());
        // A reactor opens its own channel the same way.
        drop(crate::Reactor::new().expect("reactor"));
    }
}
