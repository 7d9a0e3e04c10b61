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

use super::verbs::{Cq, DeviceRef, Pd, QpCaps};
use super::{cvt, cvt_ptr, nonblock, set_nonblocking};
use crate::conn::CmEventKind;

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
        Ok(r.and_then(|_| NonNull::new(ev)).map(|raw| CmEvent { raw }))
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
pub struct CmEvent {
    raw: NonNull<ffi::rdma_cm_event>,
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

    /// Takes ownership of the new id a CONNECT_REQUEST created.
    ///
    /// The returned id must be dropped only after this event (the reactor's graveyard does so).
    pub fn take_child(&self, chan: &Rc<EventChannel>, context: u64) -> Option<CmId> {
        if self.kind() != CmEventKind::ConnectRequest {
            return None;
        }
        let raw = NonNull::new(self.ev().id)?;
        let id = CmId { raw, qp: false, qp_parents: None, _chan: chan.clone() };
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
    fn raw(&self) -> ffi::rdma_conn_param {
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

/// An owned rdma_cm id on the shared channel, with its queue pair once created.
///
/// Drop destroys the QP (`rdma_destroy_qp`), then the id, then (as fields) the CQs and PD the
/// QP used, then releases the channel: the order rdma-core requires.
#[derive(Debug)]
pub struct CmId {
    raw: NonNull<ffi::rdma_cm_id>,
    qp: bool,
    /// The CQs (send, recv) and PD the QP was created on. Dropped after the QP and the id.
    qp_parents: Option<(Rc<Cq>, Rc<Cq>, Rc<Pd>)>,
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
        Ok(CmId { raw, qp: false, qp_parents: None, _chan: chan.clone() })
    }

    fn id(&self) -> *mut ffi::rdma_cm_id {
        self.raw.as_ptr()
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

    /// The verbs context the id is bound to, as an opaque key (0 when unbound).
    pub fn device_key(&self) -> usize {
        // SAFETY: self.raw is live.
        unsafe { (*self.id()).verbs as usize }
    }

    /// The device the id is bound to, once bound or resolved.
    pub fn device(&self) -> Option<DeviceRef> {
        // SAFETY: self.raw is live.
        DeviceRef::from_raw(unsafe { (*self.id()).verbs })
    }

    /// The port the id is bound to.
    pub fn port_num(&self) -> u8 {
        // SAFETY: self.raw is live.
        unsafe { (*self.id()).port_num }
    }

    /// Creates the id's RC queue pair on `pd`, `send_cq` and `recv_cq`. Returns the capacities
    /// the device granted.
    pub fn create_qp(&mut self, pd: &Rc<Pd>, send_cq: &Rc<Cq>, recv_cq: &Rc<Cq>, caps: QpCaps) -> io::Result<QpCaps> {
        if self.qp {
            return Err(io::Error::new(io::ErrorKind::AlreadyExists, "the id already has a queue pair"));
        }
        let mut attr = ffi::ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: send_cq.as_ptr(),
            recv_cq: recv_cq.as_ptr(),
            srq: ptr::null_mut(),
            cap: ffi::ibv_qp_cap {
                max_send_wr: caps.max_send_wr,
                max_recv_wr: caps.max_recv_wr,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: caps.max_inline_data,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: self.raw is live; pd and CQs are live and stored below so they outlive the QP.
        cvt(unsafe { ffi::rdma_create_qp(self.id(), pd.as_ptr(), &mut attr) })?;
        self.qp = true;
        self.qp_parents = Some((send_cq.clone(), recv_cq.clone(), pd.clone()));
        Ok(QpCaps {
            max_send_wr: attr.cap.max_send_wr,
            max_recv_wr: attr.cap.max_recv_wr,
            max_inline_data: attr.cap.max_inline_data,
        })
    }

    /// The raw QP, for posting. NULL before `create_qp`.
    pub(crate) fn qp(&self) -> *mut ffi::ibv_qp {
        if !self.qp {
            return ptr::null_mut();
        }
        // SAFETY: self.raw is live.
        unsafe { (*self.id()).qp }
    }

    /// The QP number, 0 before `create_qp`.
    pub fn qp_num(&self) -> u32 {
        let qp = self.qp();
        if qp.is_null() {
            0
        } else {
            // SAFETY: qp is live while self lives.
            unsafe { (*qp).qp_num }
        }
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

impl Drop for CmId {
    fn drop(&mut self) {
        if self.qp {
            // SAFETY: the QP was created by rdma_create_qp on this id and is destroyed once.
            unsafe { ffi::rdma_destroy_qp(self.id()) };
        }
        // SAFETY: self.raw is owned and live; every event naming it was acked (the reactor
        // drops ids only at the end of a tick, after the tick's events).
        let _ = unsafe { ffi::rdma_destroy_id(self.id()) };
        // qp_parents (CQs, PD) and the channel drop after this, as fields.
    }
}
