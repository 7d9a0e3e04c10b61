//! What differs between RDMA transports, as data: the one place that knows.
//!
//! Two transports run this crate's connections: InfiniBand's, which RoCE carries over
//! Ethernet (rxe, and every RoCE NIC), and iWARP, RDMA over TCP (siw, Chelsio, Intel E810 in
//! iWARP mode). The runtime asks each device which it is once, when it first uses the device
//! ([`Transport`], from `ibv_device::transport_type`), and keeps the answer as [`Caps`]; every
//! difference below is decided here from `Caps`, not by `if iwarp` where it matters.
//!
//! What iWARP lacks, and what the runtime does instead:
//! - **No immediate data** (siw refuses SEND and WRITE with immediate). Credits, which ride in
//!   the immediate on RoCE, ride in a 4-byte **tail** after every message's payload
//!   ([`Tail`]): the sender adds it as a second scatter entry from a small registered ring of
//!   its own, the receiver reads it from the last 4 bytes received and delivers the rest. A
//!   credit-only message is a tail alone. Both sides announce the tail in their connect
//!   information (wire version 2, [`FLAG_TAIL`](super::wire::FLAG_TAIL)), so a peer that does
//!   not frame this way is refused at connect time, never misread. An RDMA WRITE with
//!   immediate data is refused on such a device (`Op::write_imm`): a WRITE followed by a SEND
//!   is the application's to post, in that order (RC keeps it).
//! - **No memory windows** (`max_mw` 0): exposures are refused unless the application opts
//!   in to a registration per exposure (`Config::exposure_registration`), whose key any queue
//!   pair on the device's protection domain could use.
//! - **The initiator sends first** (MPA, RFC 5044 section 7.1.2): a client's first message is
//!   a credit-only one the runtime sends on its own ([`Caps::client_sends_first`]), and an
//!   agent posts nothing before its first receive completes.
//! - **A refused connect reports `-ECONNREFUSED`**, not the IB CM's reject status 28; the
//!   reason in the private data reads the same ([`normalize_reject_status`]).

use super::flow::Imm;

/// The transport of a device (`enum ibv_transport_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Transport {
    /// InfiniBand's transport: InfiniBand, and RoCE (Soft-RoCE `rxe`, RoCE NICs).
    InfiniBand,
    /// iWARP: RDMA over TCP (Soft-iWARP `siw`, Chelsio, Intel E810 in iWARP mode).
    Iwarp,
    /// A value this crate does not know (treated as InfiniBand's).
    Unknown(i32),
}

impl Transport {
    /// From `ibv_device::transport_type` (`IBV_TRANSPORT_IB` 0, `IBV_TRANSPORT_IWARP` 1).
    pub fn from_raw(v: i32) -> Transport {
        match v {
            0 => Transport::InfiniBand,
            1 => Transport::Iwarp,
            other => Transport::Unknown(other),
        }
    }

    /// A short name: `ib`, `iwarp`, `unknown`.
    pub fn name(self) -> &'static str {
        match self {
            Transport::InfiniBand => "ib",
            Transport::Iwarp => "iwarp",
            Transport::Unknown(_) => "unknown",
        }
    }
}

/// What the runtime adapts to on one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    /// The device's transport.
    pub transport: Transport,
    /// Memory windows the device can allocate (`ibv_device_attr::max_mw`).
    pub max_mw: u32,
    /// `ibv_device_attr::vendor_id` (Soft-iWARP's is [`SIW_VENDOR_ID`]).
    pub vendor_id: u32,
}

/// Soft-iWARP's vendor id (`"bmt"`, Linux `drivers/infiniband/sw/siw/siw.h`).
pub const SIW_VENDOR_ID: u32 = 0x62_6d74;

/// Soft-RoCE's vendor id (Linux `drivers/infiniband/sw/rxe/rxe_param.h`, `RXE_VENDOR_ID`).
pub const RXE_VENDOR_ID: u32 = 0xff_ffff;

/// Entries of the CQ that plugs Soft-iWARP's bad mmap key ([`Caps::key_plug`]): 1 MiB of
/// completion queue, 257 pages of mmap offsets.
pub const KEY_PLUG_CQ_ENTRIES: u32 = 32 * 1024;

impl Caps {
    /// True when a completed SEND is no receipt, so a close right after the last one can lose
    /// it: iWARP, where a SEND completes once TCP has taken it, and where the closing side's
    /// stream can end before its last bytes reach the peer (a reset, when data the closing side
    /// never read was waiting). There, under flow control, a closing side says goodbye and
    /// disconnects only once the peer answers ([`Farewell`](super::flow::Farewell)). On
    /// InfiniBand and RoCE a SEND completes when the peer acknowledged it: nothing to wait for.
    pub fn close_handshake(&self) -> bool {
        self.transport == Transport::Iwarp
    }

    /// Caps of a device with immediate data and memory windows (what the tests assume).
    pub fn infiniband() -> Caps {
        Caps { transport: Transport::InfiniBand, max_mw: u32::MAX, vendor_id: 0 }
    }

    /// The device is Soft-iWARP, whose user library refuses any queue whose mmap key is
    /// 0x90000 (`SIW_INVAL_UOBJ_KEY` is `SIW_UOBJ_MAX_KEY + 1`, a page index from before the
    /// kernel's keys became byte offsets; rdma-core's `libsiw` compares the key with it and
    /// fails the create with no error of the kernel's, so `errno` is stale). The kernel hands
    /// out keys first-fit from the lowest free page, so once a process's queues reach page
    /// 144 every queue that lands there is refused, and a refused one frees the page again:
    /// every later create fails (seen at 6 to 67 connections in one process). The runtime
    /// creates one large CQ of [`KEY_PLUG_CQ_ENTRIES`] first on such a device: it spans page
    /// 144 from below, and every later queue's key lies above it.
    pub fn key_plug(&self) -> bool {
        self.vendor_id == SIW_VENDOR_ID
    }

    /// Arming the device's CQ raises no event for completions already in it, only for the
    /// next one: Soft-RoCE (Linux 6.1 `rxe_req_notify_cq` sets the CQ's notify flags, and
    /// `rxe_cq_post` raises the event as it adds a completion) and Soft-iWARP (libsiw's
    /// `siw_notify_cq` stores the flags in the CQ's shared control word, which the kernel
    /// reads as it adds a completion, `siw_cq_notify_now`). Such a CQ is armed and then
    /// polled once after the tick's posts; elsewhere it is polled, armed and polled again,
    /// since an arm doorbell that finds completions past the consumer index it is given (as
    /// those of mlx4 and mlx5 are understood to) raises an event at once, a wakeup for a
    /// completion the next poll reaps anyway (`reactor/data/cq/mod.rs`, `Core::arm_and_poll`).
    ///
    /// Told by the vendor id, which is not proof: rxe before Linux 5.x reported 0 (it then
    /// takes the three polls), and IBTA lets any generic controller report 0xffffff. Either
    /// mistake costs only a wakeup, never a completion: the poll after the arm reaps whatever
    /// the CQ holds.
    pub fn arm_sees_only_new(&self) -> bool {
        (self.vendor_id == RXE_VENDOR_ID && self.transport == Transport::InfiniBand)
            || (self.vendor_id == SIW_VENDOR_ID && self.transport == Transport::Iwarp)
    }

    /// Messages carry their credits in a [`Tail`] instead of immediate data.
    pub fn tail(&self) -> bool {
        self.transport == Transport::Iwarp
    }

    /// The device can expose memory through type-2 memory windows.
    pub fn windows(&self) -> bool {
        self.max_mw > 0
    }

    /// The client must send the first message after the connection is established.
    pub fn client_sends_first(&self) -> bool {
        self.transport == Transport::Iwarp
    }

    /// Bytes every message carries besides its payload.
    pub fn overhead(&self) -> u32 {
        if self.tail() {
            TAIL_LEN
        } else {
            0
        }
    }
}

/// Length of a [`Tail`] on the wire.
pub const TAIL_LEN: u32 = 4;

/// When an iWARP client that has not heard from its server since its first message nudges it
/// with a zero-length RDMA WRITE: the waits between nudges, from ESTABLISHED on (5 ms, then
/// 25, 125, 625 and 3 125 ms after it); none once anything arrived from the server.
///
/// **Why: Soft-iWARP loses the client's first messages now and then** (Linux 6.1 to at least
/// 6.18, `drivers/infiniband/sw/siw/siw_cm.c`, `siw_accept`): the server's kernel sends its
/// MPA reply (`siw_send_mpareqrep`) *before* it hands the socket's receive callback to the
/// queue pair (`siw_qp_socket_assoc`), and the connection manager's callback it still has,
/// in state `SIW_EPSTATE_RDMA_MODE` already, ignores what arrives. A client that is quick
/// to send (its ESTABLISHED comes with the reply) lands its first messages in that window:
/// they stay in the server's TCP receive queue, unread, until more bytes arrive, and a client
/// awaiting an answer sends none, so the connection hangs for ever. A busy host (a
/// preempted server thread) widens the window from nanoseconds to milliseconds;
/// `tests/event_edges.rs` caught it with 60 bytes (the credit-only first message and a
/// one-byte message, framed) queued in the server's socket for 11 s, the server having
/// seen nothing. Any later segment makes the kernel read the whole queue, in order; a
/// zero-length RDMA WRITE is such a segment that needs no receive at the server and reaches
/// no handler there, and, after the window, it delivers what waited. Nothing on the
/// server's side can: no verb it may call reads the socket.
pub(crate) const NUDGES: [std::time::Duration; 5] = [
    std::time::Duration::from_millis(5),
    std::time::Duration::from_millis(20),
    std::time::Duration::from_millis(100),
    std::time::Duration::from_millis(500),
    std::time::Duration::from_millis(2500),
];

/// The 4 bytes after a message's payload on a transport without immediate data: the same 32
/// bits the immediate carries on RoCE ([`Imm`]: bit 31 credit-only, bits 0..=15 the grant,
/// bits 30 and 29 a credit-only message's farewell, the rest reserved and zero), in network
/// byte order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tail(pub Imm);

impl Tail {
    /// The bytes on the wire.
    pub fn encode(self) -> [u8; 4] {
        self.0.encode().to_be_bytes()
    }

    /// From the bytes on the wire.
    pub fn decode(b: [u8; 4]) -> Tail {
        Tail(Imm::decode(u32::from_be_bytes(b)))
    }
}

/// A received message on a transport with tails, taken apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unframed {
    /// The payload's length (what the application is given).
    pub len: u32,
    /// The credits and kind the tail carried.
    pub imm: Imm,
}

/// Takes apart a message of `byte_len` bytes whose last 4 are `tail` (read by the caller from
/// the receive buffer when `byte_len >= 4`), received into memory that holds `capacity` bytes
/// of payload (a pool buffer's capacity, a region slice's or a raw receive's length). A
/// message shorter than a tail, a credit-only message with a payload, reserved bits set, or a
/// payload longer than `capacity` is the peer breaking the protocol: the error names what was
/// wrong.
///
/// The last one is possible because a pool buffer's receive is posted with the chunk's slack
/// after its capacity, where the tail lands (`Buf::post_capacity`): a peer that sends up to
/// that slack's length past the capacity, followed by a valid tail, has its message taken by
/// the device. Its payload runs into the slack, which the application never sees; it is
/// refused here rather than delivered cut short, with a length the buffer does not hold.
pub fn unframe(byte_len: u32, tail: Option<[u8; 4]>, capacity: u32) -> Result<Unframed, String> {
    let Some(tail) = tail.filter(|_| byte_len >= TAIL_LEN) else {
        return Err(format!("a message of {byte_len} bytes has no {TAIL_LEN}-byte tail (iWARP framing)"));
    };
    let raw = u32::from_be_bytes(tail);
    let imm = Tail::decode(tail).0;
    // What `Imm` does not read back is reserved: bits 16..=28, and bits 29 and 30 unless a
    // credit-only message says one farewell with them.
    if imm.encode() != raw {
        return Err(format!("a message's tail has reserved bits set ({raw:#010x})"));
    }
    let len = byte_len - TAIL_LEN;
    if imm.control && len != 0 {
        return Err(format!("a credit-only message carries {len} bytes of payload"));
    }
    if len > capacity {
        return Err(format!(
            "a message of {len} bytes of payload ran past its {capacity}-byte receive buffer into the slack \
             its tail lands in"
        ));
    }
    Ok(Unframed { len, imm })
}

/// The reject status a client reports, the same on both transports: iWARP reports a
/// consumer's reject (an MPA reject) as `-ECONNRESET` (-104, Soft-iWARP) or `-ECONNREFUSED`
/// (-111); with the runtime's reject reason in the private data it was a consumer's reject,
/// which InfiniBand's CM reports as 28. Other statuses pass (a port where nothing listens is
/// refused by TCP at `rdma_connect`: -111, no reason).
pub fn normalize_reject_status(transport: Transport, status: i32, has_reason: bool) -> i32 {
    const ECONNREFUSED: i32 = 111;
    const ECONNRESET: i32 = 104;
    const IB_CM_REJ_CONSUMER_DEFINED: i32 = 28;
    if transport == Transport::Iwarp && (status == -ECONNREFUSED || status == -ECONNRESET) && has_reason {
        IB_CM_REJ_CONSUMER_DEFINED
    } else {
        status
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::flow::Farewell;

    #[test]
    fn transport_from_raw() {
        assert_eq!(Transport::from_raw(0), Transport::InfiniBand);
        assert_eq!(Transport::from_raw(1), Transport::Iwarp);
        assert_eq!(Transport::from_raw(4), Transport::Unknown(4));
        assert_eq!(Transport::from_raw(-1).name(), "unknown");
    }

    #[test]
    fn caps_decide_each_difference() {
        let ib = Caps::infiniband();
        assert!(ib.windows() && !ib.tail() && !ib.client_sends_first());
        assert_eq!(ib.overhead(), 0);
        let siw = Caps { transport: Transport::Iwarp, max_mw: 0, vendor_id: SIW_VENDOR_ID };
        assert!(siw.key_plug() && !ib.key_plug());
        assert!(!siw.windows() && siw.tail() && siw.client_sends_first());
        assert_eq!(siw.overhead(), 4);
        // Armed before the tick's last poll only where the arm raises no event for what the
        // CQ holds already: the kernel's software providers, not a hardware one (mlx5's vendor
        // id is Mellanox's 0x02c9).
        let rxe = Caps { transport: Transport::InfiniBand, max_mw: 8, vendor_id: RXE_VENDOR_ID };
        let mlx5 = Caps { transport: Transport::InfiniBand, max_mw: 8, vendor_id: 0x02c9 };
        assert!(rxe.arm_sees_only_new() && siw.arm_sees_only_new());
        assert!(!mlx5.arm_sees_only_new() && !ib.arm_sees_only_new());
        // Each vendor id counts only with its provider's transport.
        let iwarp_ffffff = Caps { transport: Transport::Iwarp, max_mw: 0, vendor_id: RXE_VENDOR_ID };
        let ib_bmt = Caps { transport: Transport::InfiniBand, max_mw: 8, vendor_id: SIW_VENDOR_ID };
        assert!(!iwarp_ffffff.arm_sees_only_new() && !ib_bmt.arm_sees_only_new());
    }

    #[test]
    fn a_tail_is_the_immediate_in_network_order() {
        let t = Tail(Imm::control(0x1234));
        assert_eq!(t.encode(), [0x80, 0x00, 0x12, 0x34]);
        assert_eq!(Tail::decode(t.encode()), t);
        let data = Tail(Imm::data(7));
        assert_eq!(Tail::decode(data.encode()), data);
    }

    #[test]
    fn unframe_splits_payload_and_tail() {
        let t = Tail(Imm::data(3)).encode();
        assert_eq!(unframe(104, Some(t), 4096), Ok(Unframed { len: 100, imm: Imm::data(3) }));
        assert_eq!(unframe(4, Some(t), 4096).unwrap().len, 0);
        let c = Tail(Imm::control(9)).encode();
        assert_eq!(unframe(4, Some(c), 4096), Ok(Unframed { len: 0, imm: Imm::control(9) }));
        // A payload that fills its buffer exactly, the tail in the slack after it.
        assert_eq!(unframe(1024 + 4, Some(t), 1024).unwrap().len, 1024);
    }

    #[test]
    fn unframe_refuses_what_breaks_the_framing() {
        let t = Tail(Imm::data(1)).encode();
        assert!(unframe(3, Some(t), 4096).unwrap_err().contains("no 4-byte tail"));
        assert!(unframe(0, None, 4096).is_err());
        assert!(unframe(8, Some([0x40, 0, 0, 1]), 4096).unwrap_err().contains("reserved"));
        let c = Tail(Imm::control(0)).encode();
        assert!(unframe(5, Some(c), 4096).unwrap_err().contains("credit-only"));
        // Bit 30 or 29 only on a credit-only message, and never both.
        assert!(unframe(8, Some([0x20, 0, 0, 1]), 4096).unwrap_err().contains("reserved"));
        assert!(unframe(4, Some([0xE0, 0, 0, 1]), 4096).unwrap_err().contains("reserved"));
        assert!(unframe(4, Some([0x90, 0, 0, 1]), 4096).unwrap_err().contains("reserved"));
    }

    /// The review's L1 (2026-11-26): a 1 KiB buffer's receive is posted with its 64 bytes of
    /// slack, so the device takes a message of up to 1 084 bytes of payload and a tail. Such a
    /// payload is refused, never reported as 1 084 bytes of a buffer that holds 1 024.
    #[test]
    fn unframe_refuses_a_payload_past_the_buffer() {
        let tail = Tail(Imm::data(0)).encode();
        let why = unframe(1024 + 64, Some(tail), 1024).unwrap_err();
        assert!(why.contains("1084 bytes of payload ran past its 1024-byte receive buffer"), "{why}");
        assert!(unframe(1024 + 5, Some(tail), 1024).is_err(), "one byte past the capacity");
        assert!(unframe(1024 + 4, Some(tail), 1024).is_ok(), "exactly the capacity");
    }

    #[test]
    fn a_farewell_travels_in_a_tail() {
        for farewell in [Farewell::Leaving, Farewell::Heard] {
            let imm = Imm { farewell, ..Imm::control(2) };
            assert_eq!(unframe(4, Some(Tail(imm).encode()), 4096), Ok(Unframed { len: 0, imm }));
        }
    }

    #[test]
    fn iwarp_refusals_read_as_consumer_rejects_only_with_a_reason() {
        assert_eq!(normalize_reject_status(Transport::Iwarp, -111, true), 28);
        assert_eq!(normalize_reject_status(Transport::Iwarp, -104, true), 28);
        assert_eq!(normalize_reject_status(Transport::Iwarp, -104, false), -104);
        assert_eq!(normalize_reject_status(Transport::Iwarp, -111, false), -111);
        assert_eq!(normalize_reject_status(Transport::InfiniBand, 28, true), 28);
        assert_eq!(normalize_reject_status(Transport::InfiniBand, -111, true), -111);
        assert_eq!(normalize_reject_status(Transport::Iwarp, 8, true), 8);
    }
}
