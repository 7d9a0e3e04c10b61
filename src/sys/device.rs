//! The RDMA device list with device and port attributes.
#![allow(unsafe_code)]

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, RawFd};
use std::ptr::NonNull;

use rdma_sys as ffi;

use super::{c_str, cvt, cvt_nz, cvt_ptr, nonblock, set_nonblocking};
use crate::proto::conn::AsyncEventKind;
use crate::proto::transport::{Caps, Transport};

/// A port's state (`enum ibv_port_state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PortState {
    /// `IBV_PORT_NOP`.
    Nop,
    /// `IBV_PORT_DOWN`.
    Down,
    /// `IBV_PORT_INIT`.
    Init,
    /// `IBV_PORT_ARMED`.
    Armed,
    /// `IBV_PORT_ACTIVE`.
    Active,
    /// `IBV_PORT_ACTIVE_DEFER`.
    ActiveDefer,
    /// A value this crate does not know.
    Unknown(u32),
}

/// A port's link layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LinkLayer {
    /// InfiniBand.
    InfiniBand,
    /// Ethernet (RoCE, iWARP, Soft-RoCE, Soft-iWARP; [`DeviceInfo::transport`] tells which).
    Ethernet,
    /// A value this crate does not know.
    Unknown(u8),
}

/// One port of a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortInfo {
    /// Port number (from 1).
    pub port: u8,
    /// State.
    pub state: PortState,
    /// Active MTU in bytes.
    pub active_mtu: u32,
    /// Largest MTU in bytes.
    pub max_mtu: u32,
    /// Link layer.
    pub link_layer: LinkLayer,
    /// GID table length.
    pub gid_table_len: i32,
    /// Largest message.
    pub max_msg_size: u32,
    /// Local identifier (InfiniBand only).
    pub lid: u16,
}

/// One RDMA device with its main attributes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Kernel name, e.g. `rxe0`.
    pub name: String,
    /// Node GUID, host order.
    pub node_guid: u64,
    /// Firmware version string.
    pub fw_ver: String,
    /// Vendor id.
    pub vendor_id: u32,
    /// Vendor part id.
    pub vendor_part_id: u32,
    /// Largest memory region.
    pub max_mr_size: u64,
    /// Queue pairs.
    pub max_qp: i32,
    /// Work requests per queue.
    pub max_qp_wr: i32,
    /// Scatter/gather entries per work request.
    pub max_sge: i32,
    /// Completion queues.
    pub max_cq: i32,
    /// Entries per completion queue.
    pub max_cqe: i32,
    /// Memory regions.
    pub max_mr: i32,
    /// Protection domains.
    pub max_pd: i32,
    /// Outstanding RDMA READs per QP as responder.
    pub max_qp_rd_atom: i32,
    /// Shared receive queues.
    pub max_srq: i32,
    /// Memory windows it can allocate (0 on Soft-iWARP: exposures need another way).
    pub max_mw: i32,
    /// Its transport: InfiniBand's (IB and RoCE) or iWARP.
    pub transport: Transport,
    /// Ports.
    pub ports: Vec<PortInfo>,
}

fn mtu_bytes(m: ffi::ibv_mtu::Type) -> u32 {
    match m {
        1..=5 => 128 << m,
        _ => 0,
    }
}

fn port_state(s: ffi::ibv_port_state::Type) -> PortState {
    use ffi::ibv_port_state as S;
    match s {
        S::IBV_PORT_NOP => PortState::Nop,
        S::IBV_PORT_DOWN => PortState::Down,
        S::IBV_PORT_INIT => PortState::Init,
        S::IBV_PORT_ARMED => PortState::Armed,
        S::IBV_PORT_ACTIVE => PortState::Active,
        S::IBV_PORT_ACTIVE_DEFER => PortState::ActiveDefer,
        other => PortState::Unknown(other),
    }
}

/// Opened context, closed on drop.
struct Ctx(NonNull<ffi::ibv_context>);

impl Drop for Ctx {
    fn drop(&mut self) {
        // SAFETY: opened by ibv_open_device below, closed once; nothing was created on it.
        let _ = unsafe { ffi::ibv_close_device(self.0.as_ptr()) };
    }
}

/// Device list, freed on drop.
struct List(*mut *mut ffi::ibv_device, usize);

impl Drop for List {
    fn drop(&mut self) {
        // SAFETY: returned by ibv_get_device_list, freed once.
        unsafe { ffi::ibv_free_device_list(self.0) };
    }
}

/// Lists the RDMA devices with their device and port attributes.
pub fn devices() -> io::Result<Vec<DeviceInfo>> {
    let mut n = 0;
    // SAFETY: n is a valid out-pointer.
    let raw = cvt_ptr(unsafe { ffi::ibv_get_device_list(&mut n) })?;
    let list = List(raw.as_ptr(), n.max(0) as usize);
    let mut out = Vec::with_capacity(list.1);
    for i in 0..list.1 {
        // SAFETY: the list holds n device pointers.
        let dev = unsafe { *list.0.add(i) };
        out.push(query(dev)?);
    }
    Ok(out)
}

fn query(dev: *mut ffi::ibv_device) -> io::Result<DeviceInfo> {
    // SAFETY: dev comes from a live device list.
    let name = unsafe { c_str(ffi::ibv_get_device_name(dev)) };
    // SAFETY: as above.
    let guid = u64::from_be(unsafe { ffi::ibv_get_device_guid(dev) });
    // SAFETY: as above.
    let ctx = Ctx(cvt_ptr(unsafe { ffi::ibv_open_device(dev) })
        .map_err(|e| io::Error::new(e.kind(), format!("ibv_open_device({name}): {e}")))?);
    let mut attr = MaybeUninit::<ffi::ibv_device_attr>::zeroed();
    // SAFETY: ctx is open; attr is a valid out-pointer.
    cvt_nz(unsafe { ffi::ibv_query_device(ctx.0.as_ptr(), attr.as_mut_ptr()) })
        .map_err(|e| io::Error::new(e.kind(), format!("ibv_query_device({name}): {e}")))?;
    // SAFETY: initialised by ibv_query_device.
    let attr = unsafe { attr.assume_init() };
    let fw_ver = {
        let bytes: Vec<u8> = attr.fw_ver.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    };
    let mut ports = Vec::new();
    for port in 1..=attr.phys_port_cnt {
        let mut pa = MaybeUninit::<ffi::ibv_port_attr>::zeroed();
        // SAFETY: ctx is open; pa is a valid out-pointer.
        cvt_nz(unsafe { ffi::___ibv_query_port(ctx.0.as_ptr(), port, pa.as_mut_ptr()) })
            .map_err(|e| io::Error::new(e.kind(), format!("ibv_query_port({name}, {port}): {e}")))?;
        // SAFETY: initialised by ibv_query_port.
        let pa = unsafe { pa.assume_init() };
        ports.push(PortInfo {
            port,
            state: port_state(pa.state),
            active_mtu: mtu_bytes(pa.active_mtu),
            max_mtu: mtu_bytes(pa.max_mtu),
            link_layer: match pa.link_layer as u32 {
                1 => LinkLayer::InfiniBand,
                2 => LinkLayer::Ethernet,
                0 => LinkLayer::InfiniBand,
                other => LinkLayer::Unknown(other as u8),
            },
            gid_table_len: pa.gid_tbl_len,
            max_msg_size: pa.max_msg_sz,
            lid: pa.lid,
        });
    }
    Ok(DeviceInfo {
        name,
        node_guid: guid,
        fw_ver,
        vendor_id: attr.vendor_id,
        vendor_part_id: attr.vendor_part_id,
        max_mr_size: attr.max_mr_size,
        max_qp: attr.max_qp,
        max_qp_wr: attr.max_qp_wr,
        max_sge: attr.max_sge,
        max_cq: attr.max_cq,
        max_cqe: attr.max_cqe,
        max_mr: attr.max_mr,
        max_pd: attr.max_pd,
        max_qp_rd_atom: attr.max_qp_rd_atom,
        max_srq: attr.max_srq,
        max_mw: attr.max_mw,
        // SAFETY: dev comes from a live device list.
        transport: Transport::from_raw(unsafe { (*dev).transport_type }),
        ports,
    })
}

/// A device context owned by librdmacm. Copyable, never closed by this crate: librdmacm
/// closes it once the device was removed (its list synchronised without it) and nothing holds
/// a reference on it any more: neither an id bound to it nor a [`DeviceHold`]. Everything this
/// crate creates on a context holds a `DeviceHold` (through the [`Pd`](super::pd::Pd) or the
/// [`CompChannel`](super::cq::CompChannel) it is on), so a `DeviceRef` is used only while its
/// device's resources exist.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DeviceRef(NonNull<ffi::ibv_context>);

impl DeviceRef {
    pub(crate) fn from_raw(ctx: *mut ffi::ibv_context) -> Option<DeviceRef> {
        NonNull::new(ctx).map(DeviceRef)
    }

    pub(crate) fn as_ptr(&self) -> *mut ffi::ibv_context {
        self.0.as_ptr()
    }

    /// What the runtime adapts to on this device: its transport and memory windows
    /// (`ibv_query_device` on the live context).
    pub(crate) fn caps(&self) -> io::Result<Caps> {
        let mut attr = MaybeUninit::<ffi::ibv_device_attr>::zeroed();
        // SAFETY: the context is live (see DeviceRef); attr is a valid out-pointer.
        cvt_nz(unsafe { ffi::ibv_query_device(self.0.as_ptr(), attr.as_mut_ptr()) })?;
        // SAFETY: initialised by ibv_query_device.
        let attr = unsafe { attr.assume_init() };
        // SAFETY: the context is live, and its device with it.
        let transport = Transport::from_raw(unsafe { (*(*self.0.as_ptr()).device).transport_type });
        Ok(Caps { transport, max_mw: attr.max_mw.max(0) as u32, vendor_id: attr.vendor_id })
    }

    /// The device's name (`ibv_get_device_name`), for messages.
    #[cfg_attr(not(feature = "log"), allow(dead_code))]
    pub(crate) fn name(&self) -> String {
        // SAFETY: the context is live, and its device with it; the name is a NUL-terminated
        // string the device owns, copied here.
        unsafe { c_str(ffi::ibv_get_device_name((*self.0.as_ptr()).device)) }
    }

    /// The device's identity in libibverbs' device list (its `ibv_device` address), kept as a
    /// number to compare with later lists, never dereferenced.
    pub(crate) fn identity(&self) -> usize {
        // SAFETY: the context is live (see DeviceRef).
        unsafe { (*self.0.as_ptr()).device as usize }
    }
}

/// A librdmacm reference on one device context: while it lives, librdmacm does not close the
/// context, even once the device is removed and every other id on it is destroyed. librdmacm
/// counts references of ids (and of the lists `rdma_get_devices` hands out), not of PDs,
/// regions or CQs: without this, a removed device's context could be closed under a buffer, a
/// CQ or a PD still to be destroyed, and their destruction would use freed memory (the hostile
/// review's finding 1). The [`Pd`](super::pd::Pd) and the [`CompChannel`](super::cq::CompChannel)
/// of a device each hold one (shared), as their last field, so the context outlives every
/// object on it.
///
/// It is an rdma_cm id of its own, bound to an address of the device (port 0: an ephemeral
/// port, never listened or connected on), on a channel of its own that is never read (the
/// kernel's DEVICE_REMOVAL for it is dropped with it). Destroying it is librdmacm's ordinary
/// release of a device reference: at the last one, librdmacm frees its own PD on the device
/// and, for a removed device, closes the context. (A reference taken with `rdma_get_devices`
/// would not free that PD.)
pub(crate) struct DeviceHold {
    _id: super::cm::CmId,
}

impl std::fmt::Debug for DeviceHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceHold").finish()
    }
}

impl DeviceHold {
    /// A reference on `dev`'s context, through an id bound to `addr`'s IP (an address of the
    /// device: the local address of an id on it).
    ///
    /// # Errors
    ///
    /// What `rdma_create_event_channel`, `rdma_create_id` or `rdma_bind_addr` report; `ENODEV`
    /// when the address binds to another device.
    pub(crate) fn new(dev: DeviceRef, addr: std::net::SocketAddr) -> io::Result<std::rc::Rc<DeviceHold>> {
        let chan = super::cm::EventChannel::new()?;
        let id = super::cm::CmId::new(&chan, 0)?;
        let mut any_port = addr;
        any_port.set_port(0);
        id.bind(&any_port)?;
        if id.device() != Some(dev) {
            return Err(io::Error::from_raw_os_error(nix::libc::ENODEV));
        }
        Ok(std::rc::Rc::new(DeviceHold { _id: id }))
    }
}

/// True while the device named by `identity` ([`DeviceRef::identity`]) is in libibverbs'
/// device list; a removed device drops out of it once the kernel unregistered its verbs
/// node.
pub(crate) fn device_listed(identity: usize) -> bool {
    let mut n = 0;
    // SAFETY: n is a valid out-pointer.
    let Ok(raw) = cvt_ptr(unsafe { ffi::ibv_get_device_list(&mut n) }) else { return true };
    let list = List(raw.as_ptr(), n.max(0) as usize);
    // SAFETY: the list holds n device pointers.
    (0..list.1).any(|i| unsafe { *list.0.add(i) } as usize == identity)
}

/// What an asynchronous event is about: the CQ, queue pair or SRQ it names (by address, as
/// `Cq::identity` and `Qp::identity` give them: the device's event fd is shared by every
/// reactor of the process, so a context value alone could name another reactor's object),
/// a port, or the whole device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AsyncElement {
    /// A completion queue.
    Cq(usize),
    /// A queue pair.
    Qp(usize),
    /// A shared receive queue.
    Srq(usize),
    /// A port, by number.
    Port(u8),
    /// The device (or something this crate does not create, such as a work queue).
    Device,
}

/// One asynchronous event, acked (`ibv_ack_async_event`) when dropped. A CQ or queue pair it
/// names cannot be destroyed before then (libibverbs waits), so its address names a live
/// object until the event is dropped.
pub(crate) struct AsyncEvent {
    /// Kept uninitialised as far as Rust knows: rdma-sys declares `event_type` a Rust enum,
    /// and a value the kernel adds later would make a typed `ibv_async_event` invalid (undefined
    /// behaviour). It is only read through [`decode`] and handed back to the C library.
    raw: MaybeUninit<ffi::ibv_async_event>,
    /// The event type.
    pub kind: AsyncEventKind,
    /// What it is about.
    pub element: AsyncElement,
}

impl std::fmt::Debug for AsyncEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncEvent").field("kind", &self.kind).field("element", &self.element).finish()
    }
}

impl Drop for AsyncEvent {
    fn drop(&mut self) {
        // SAFETY: raw was filled by ibv_get_async_event and is acked once, here.
        unsafe { ffi::ibv_ack_async_event(self.raw.as_mut_ptr()) };
    }
}

fn async_kind(v: u32) -> AsyncEventKind {
    use AsyncEventKind as K;
    match v {
        0 => K::CqErr,
        1 => K::QpFatal,
        2 => K::QpReqErr,
        3 => K::QpAccessErr,
        4 => K::CommEst,
        5 => K::SqDrained,
        6 => K::PathMig,
        7 => K::PathMigErr,
        8 => K::DeviceFatal,
        9 => K::PortActive,
        10 => K::PortErr,
        11 => K::LidChange,
        12 => K::PkeyChange,
        13 => K::SmChange,
        14 => K::SrqErr,
        15 => K::SrqLimitReached,
        16 => K::QpLastWqeReached,
        17 => K::ClientReregister,
        18 => K::GidChange,
        19 => K::WqFatal,
        other => K::Unknown(other),
    }
}

impl DeviceRef {
    fn async_raw_fd(&self) -> RawFd {
        // SAFETY: the context is live (see DeviceRef).
        unsafe { (*self.0.as_ptr()).async_fd }
    }

    /// The device's asynchronous-event fd, to register with epoll (owned by the context,
    /// which librdmacm owns).
    pub(crate) fn async_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the fd belongs to the context, which is open while this DeviceRef is used.
        unsafe { BorrowedFd::borrow_raw(self.async_raw_fd()) }
    }

    /// Makes the asynchronous-event fd non-blocking, so [`DeviceRef::get_async_event`] never
    /// waits. librdmacm never reads this fd itself.
    pub(crate) fn set_async_nonblocking(&self) -> io::Result<()> {
        set_nonblocking(self.async_raw_fd())
    }

    /// The next asynchronous event, or `None` when none is pending.
    pub(crate) fn get_async_event(&self) -> io::Result<Option<AsyncEvent>> {
        let mut raw = MaybeUninit::<ffi::ibv_async_event>::zeroed();
        // SAFETY: the context is live; raw is a valid out-pointer.
        let got = nonblock(cvt(unsafe { ffi::ibv_get_async_event(self.0.as_ptr(), raw.as_mut_ptr()) }))?;
        if got.is_none() {
            return Ok(None);
        }
        // SAFETY: filled by ibv_get_async_event.
        let (kind, element) = unsafe { decode(&raw) };
        Ok(Some(AsyncEvent { raw, kind, element }))
    }
}

/// What an asynchronous event is: its type read as the integer it is (never as rdma-sys' Rust
/// enum, which a value newer than the bindings would make invalid), and the union member that
/// type selects.
///
/// # Safety
///
/// `raw` holds an event filled by `ibv_get_async_event` (its type field, and the union member
/// its type selects, are initialised).
unsafe fn decode(raw: &MaybeUninit<ffi::ibv_async_event>) -> (AsyncEventKind, AsyncElement) {
    let p = raw.as_ptr();
    // SAFETY: the field is initialised (the caller's contract) and 4 bytes (repr(u32)); read
    // as a u32 through a raw pointer, no enum value is made.
    let kind = async_kind(unsafe { std::ptr::addr_of!((*p).event_type).cast::<u32>().read() });
    use AsyncEventKind as K;
    // SAFETY: the union member read is the one the event type selects (verbs.h), initialised
    // (the caller's contract); raw pointers only, no typed copy of the event.
    let element = unsafe {
        match kind {
            K::CqErr => AsyncElement::Cq(std::ptr::addr_of!((*p).element.cq).read() as usize),
            K::QpFatal
            | K::QpReqErr
            | K::QpAccessErr
            | K::CommEst
            | K::SqDrained
            | K::PathMig
            | K::PathMigErr
            | K::QpLastWqeReached => AsyncElement::Qp(std::ptr::addr_of!((*p).element.qp).read() as usize),
            K::SrqErr | K::SrqLimitReached => AsyncElement::Srq(std::ptr::addr_of!((*p).element.srq).read() as usize),
            K::PortActive
            | K::PortErr
            | K::LidChange
            | K::PkeyChange
            | K::SmChange
            | K::ClientReregister
            | K::GidChange => AsyncElement::Port(std::ptr::addr_of!((*p).element.port_num).read().clamp(0, 255) as u8),
            _ => AsyncElement::Device,
        }
    };
    (kind, element)
}

/// Lets librdmacm forget devices that were removed: its device list is synchronised with
/// the kernel's, and a removed device that nothing holds any more has its context closed
/// (which the kernel waits for before it finishes the removal, on drivers without
/// disassociation). librdmacm skips the synchronisation while no device at all is left.
pub(crate) fn forget_removed_devices() {
    let mut n = 0;
    // SAFETY: n is a valid out-pointer; the list is freed at once. Taking and freeing it
    // changes no reference count in the end.
    let list = unsafe { ffi::rdma_get_devices(&mut n) };
    if !list.is_null() {
        // SAFETY: returned by rdma_get_devices, freed once.
        unsafe { ffi::rdma_free_devices(list) };
    }
}

#[cfg(test)]
mod tests {
    use std::mem::MaybeUninit;

    use rdma_sys as ffi;

    use super::{decode, AsyncElement};
    use crate::proto::conn::AsyncEventKind;

    fn event(kind: u32, port: i32) -> MaybeUninit<ffi::ibv_async_event> {
        let mut raw = MaybeUninit::<ffi::ibv_async_event>::zeroed();
        let p = raw.as_mut_ptr();
        // SAFETY: writes into the zeroed event through raw pointers, as the kernel would; no
        // typed value of the event (or of its enum field) is made.
        unsafe {
            std::ptr::addr_of_mut!((*p).event_type).cast::<u32>().write(kind);
            std::ptr::addr_of_mut!((*p).element.port_num).cast::<i32>().write(port);
        }
        raw
    }

    /// Hostile review (issue 22), finding 6: the event was read into a typed
    /// `ibv_async_event`, whose `event_type` rdma-sys declares a Rust enum: a type the kernel
    /// adds later (here 99) made an invalid enum value, undefined behaviour (not observable at
    /// run time without Miri). Now it is decoded from the raw bytes, never as the enum.
    #[test]
    fn an_event_type_newer_than_the_bindings_is_unknown_and_never_an_enum() {
        // SAFETY: both events are initialised (zeroed, then written above).
        let (kind, element) = unsafe { decode(&event(99, 0)) };
        assert_eq!((kind, element), (AsyncEventKind::Unknown(99), AsyncElement::Device));
        // SAFETY: as above.
        let (kind, element) = unsafe { decode(&event(10, 1)) };
        assert_eq!((kind, element), (AsyncEventKind::PortErr, AsyncElement::Port(1)));
    }
}
