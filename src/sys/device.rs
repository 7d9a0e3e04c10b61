//! The RDMA device list with device and port attributes.
#![allow(unsafe_code)]

use std::io;
use std::mem::MaybeUninit;
use std::ptr::NonNull;

use rdma_sys as ffi;

use super::{c_str, cvt_nz, cvt_ptr};

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
    /// Ethernet (RoCE, iWARP, Soft-RoCE).
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
        ports,
    })
}

/// A device context owned by librdmacm (it stays open for the life of the process once an id
/// is bound to it). Copyable, never closed by this crate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DeviceRef(NonNull<ffi::ibv_context>);

impl DeviceRef {
    pub(crate) fn from_raw(ctx: *mut ffi::ibv_context) -> Option<DeviceRef> {
        NonNull::new(ctx).map(DeviceRef)
    }

    pub(crate) fn as_ptr(&self) -> *mut ffi::ibv_context {
        self.0.as_ptr()
    }
}
