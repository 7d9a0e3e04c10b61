//! Wire formats carried in rdma_cm private data, all integers in network byte order.
//!
//! # Connect information (client → server in `rdma_connect`, server → client in `rdma_accept`)
//!
//! ```text
//! offset size field
//!  0      4   magic          0x5244_5258 ("RDRX")
//!  4      1   version        1, or 2 exactly when flag bit 1 is set
//!  5      1   header length  bytes from offset 0 to the user bytes (>= 20; longer headers are
//!                            extensions a version-1 reader skips)
//!  6      1   user length    bytes of opaque user data after the header
//!  7      1   flags          bit 0: the sender uses receive-credit flow control
//!                            (`crate::flow`); bit 1 (version 2 only): every message the
//!                            sender sends ends in a 4-byte tail instead of carrying immediate
//!                            data (iWARP, `crate::proto::transport`); bit 2: the sender
//!                            takes part in the close handshake (`crate::proto::flow::Farewell`,
//!                            sent with flow control on iWARP); other bits reserved, 0
//!  8      4   message size   largest message the sender will send or can receive
//! 12      4   message count  messages the sender intends to send (0: not stated)
//! 16      2   receive depth  receives the sender keeps posted (its initial credit to the peer)
//! 18      2   reserved       0
//! 20      ..  user bytes
//! ```
//!
//! The kernel hands incoming private data over zero-padded to the transport's maximum (56 bytes
//! on a connect request, 196 on an accept), so the decoder takes its lengths from the header,
//! never from the buffer size. A buffer that is empty or all zero is a peer that sent no private
//! data at all (a plain librdmacm program): [`ConnectInfo::decode`] returns `Ok(None)` and the
//! runtime serves it with defaults.
//!
//! # Reject reason (server → client in `rdma_reject`)
//!
//! ```text
//!  0      4   magic          0x5244_524A ("RDRJ")
//!  4      1   version        1
//!  5      1   code           RejectCode
//!  6      1   text length
//!  7      ..  UTF-8 text
//! ```

use std::fmt;

/// Magic number opening a connect-information header.
pub const CONNECT_MAGIC: u32 = 0x5244_5258;
/// Magic number opening a reject reason.
pub const REJECT_MAGIC: u32 = 0x5244_524A;
/// The wire version of connect information without [`FLAG_TAIL`] (and of reject reasons).
pub const VERSION: u8 = 1;
/// The wire version of connect information with [`FLAG_TAIL`]: a version-1 reader (an older
/// rdma-reactor) refuses it as an unsupported version rather than misreading tailed messages.
pub const VERSION_TAIL: u8 = 2;
/// Length of the version-1 connect header.
pub const CONNECT_HEADER_LEN: usize = 20;
/// Private data a connect request can carry on IB and RoCE (RDMA_PS_TCP).
pub const MAX_CONNECT_PRIVATE_DATA: usize = 56;
/// Private data an accept can carry on IB and RoCE (RDMA_PS_TCP).
pub const MAX_ACCEPT_PRIVATE_DATA: usize = 196;
/// Private data a reject can carry on IB and RoCE.
pub const MAX_REJECT_PRIVATE_DATA: usize = 148;
/// Connect-information flag: the sender uses receive-credit flow control.
pub const FLAG_FLOW_CONTROL: u8 = 1;
/// Connect-information flag (version 2): the sender frames every message with a 4-byte tail.
pub const FLAG_TAIL: u8 = 2;
/// Connect-information flag: the sender takes part in the close handshake
/// ([`Farewell`](crate::proto::flow::Farewell)); sent with flow control on iWARP only, so a
/// connection on InfiniBand or RoCE reads exactly as before it existed.
pub const FLAG_FAREWELL: u8 = 4;
/// Length of the reject header before its text.
const REJECT_HEADER_LEN: usize = 7;

/// A malformed header from a peer.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum WireError {
    /// Fewer bytes than the header needs.
    Truncated {
        /// Bytes needed.
        need: usize,
        /// Bytes present.
        have: usize,
    },
    /// The first four bytes are not our magic number.
    BadMagic(u32),
    /// A version this crate does not speak.
    UnsupportedVersion(u8),
    /// A header length below the version's minimum.
    BadHeaderLength(u8),
    /// Reserved bits are set.
    ReservedNotZero,
    /// A field has a value the protocol forbids.
    BadField {
        /// The field's name.
        field: &'static str,
        /// Its value.
        value: u32,
    },
    /// Encoding: the user bytes do not fit in the transport's private data.
    UserDataTooLong {
        /// Bytes given.
        len: usize,
        /// Bytes that fit.
        max: usize,
    },
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::Truncated { need, have } => {
                write!(f, "truncated header: need {need} bytes, have {have}")
            }
            WireError::BadMagic(m) => write!(f, "bad magic {m:#010x}"),
            WireError::UnsupportedVersion(v) => write!(f, "unsupported version {v}"),
            WireError::BadHeaderLength(l) => write!(f, "bad header length {l}"),
            WireError::ReservedNotZero => write!(f, "reserved bits set"),
            WireError::BadField { field, value } => write!(f, "bad {field} {value}"),
            WireError::UserDataTooLong { len, max } => {
                write!(f, "user data of {len} bytes does not fit (maximum {max})")
            }
        }
    }
}

impl std::error::Error for WireError {}

/// What each side tells the other when a connection is set up.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct ConnectInfo {
    /// Largest message the sender will send or can receive, in bytes.
    pub msg_size: u32,
    /// Messages the sender intends to send; 0 when not stated.
    pub msg_count: u32,
    /// Receives the sender has posted: its initial credit to the peer (0 for a side that
    /// receives nothing, e.g. one that only issues RDMA WRITEs and READs).
    pub recv_depth: u16,
    /// The sender uses receive-credit flow control (both sides must, for it to apply).
    pub flow_control: bool,
    /// The sender frames every message with a 4-byte tail (a transport without immediate
    /// data: iWARP); both sides must agree, or the connection is refused. Sent as version 2.
    pub tail: bool,
    /// The sender takes part in the close handshake (connect flag bit 2); both sides must, and
    /// use flow control, for it to apply.
    pub farewell: bool,
    /// Opaque application bytes.
    pub user: Vec<u8>,
}

fn be_u32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn be_u16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

impl ConnectInfo {
    /// Encodes into at most `max` bytes (the transport's private-data limit).
    ///
    /// Fails as [`decode`](Self::decode) would on the result: a message size of 0 is a
    /// `BadField`; user bytes that do not fit are `UserDataTooLong`.
    pub fn encode(&self, max: usize) -> Result<Vec<u8>, WireError> {
        if self.msg_size == 0 {
            return Err(WireError::BadField { field: "message size", value: 0 });
        }
        let room = max.saturating_sub(CONNECT_HEADER_LEN).min(u8::MAX as usize);
        if self.user.len() > room {
            return Err(WireError::UserDataTooLong { len: self.user.len(), max: room });
        }
        let mut out = Vec::with_capacity(CONNECT_HEADER_LEN + self.user.len());
        out.extend_from_slice(&CONNECT_MAGIC.to_be_bytes());
        out.push(if self.tail { VERSION_TAIL } else { VERSION });
        out.push(CONNECT_HEADER_LEN as u8);
        out.push(self.user.len() as u8);
        let flag = |on: bool, bit: u8| if on { bit } else { 0 };
        out.push(
            flag(self.flow_control, FLAG_FLOW_CONTROL)
                | flag(self.tail, FLAG_TAIL)
                | flag(self.farewell, FLAG_FAREWELL),
        );
        out.extend_from_slice(&self.msg_size.to_be_bytes());
        out.extend_from_slice(&self.msg_count.to_be_bytes());
        out.extend_from_slice(&self.recv_depth.to_be_bytes());
        out.extend_from_slice(&0u16.to_be_bytes());
        out.extend_from_slice(&self.user);
        Ok(out)
    }

    /// Decodes private data received from a peer.
    ///
    /// Returns `Ok(None)` for empty or all-zero data (a peer that sent none).
    pub fn decode(data: &[u8]) -> Result<Option<ConnectInfo>, WireError> {
        if data.iter().all(|&b| b == 0) {
            return Ok(None);
        }
        if data.len() < 4 {
            return Err(WireError::Truncated { need: CONNECT_HEADER_LEN, have: data.len() });
        }
        let magic = be_u32(data, 0);
        if magic != CONNECT_MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        if data.len() < CONNECT_HEADER_LEN {
            return Err(WireError::Truncated { need: CONNECT_HEADER_LEN, have: data.len() });
        }
        let version = data[4];
        if version != VERSION && version != VERSION_TAIL {
            return Err(WireError::UnsupportedVersion(version));
        }
        let header_len = data[5];
        if (header_len as usize) < CONNECT_HEADER_LEN {
            return Err(WireError::BadHeaderLength(header_len));
        }
        let user_len = data[6] as usize;
        let need = header_len as usize + user_len;
        if data.len() < need {
            return Err(WireError::Truncated { need, have: data.len() });
        }
        let known = FLAG_FLOW_CONTROL | FLAG_FAREWELL | if version == VERSION_TAIL { FLAG_TAIL } else { 0 };
        if data[7] & !known != 0 || be_u16(data, 18) != 0 {
            return Err(WireError::ReservedNotZero);
        }
        if version == VERSION_TAIL && data[7] & FLAG_TAIL == 0 {
            // Version 2 is the tail framing: one encoding per meaning.
            return Err(WireError::BadField { field: "version 2 without the tail flag", value: 2 });
        }
        let info = ConnectInfo {
            msg_size: be_u32(data, 8),
            msg_count: be_u32(data, 12),
            recv_depth: be_u16(data, 16),
            flow_control: data[7] & FLAG_FLOW_CONTROL != 0,
            tail: data[7] & FLAG_TAIL != 0,
            farewell: data[7] & FLAG_FAREWELL != 0,
            user: data[header_len as usize..need].to_vec(),
        };
        if info.msg_size == 0 {
            return Err(WireError::BadField { field: "message size", value: 0 });
        }
        Ok(Some(info))
    }
}

/// Why a server refused a connection, as sent in the reject's private data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RejectCode {
    /// The client's connect information was malformed.
    BadConnectInfo,
    /// The application refused the connection.
    Refused,
    /// The server could not allocate what the connection needs.
    NoResources,
    /// The client asked for more than the server allows.
    Unsupported,
    /// A connection from the client's address broke the protocol recently: the server
    /// refuses that address for a while (`Config::violation_backoff`, the penalty box; the
    /// reason's text says how much longer).
    Backoff,
    /// A code this version does not know.
    Unknown(u8),
}

impl RejectCode {
    fn to_u8(self) -> u8 {
        match self {
            RejectCode::BadConnectInfo => 1,
            RejectCode::Refused => 2,
            RejectCode::NoResources => 3,
            RejectCode::Unsupported => 4,
            RejectCode::Backoff => 5,
            RejectCode::Unknown(v) => v,
        }
    }

    fn from_u8(v: u8) -> RejectCode {
        match v {
            1 => RejectCode::BadConnectInfo,
            2 => RejectCode::Refused,
            3 => RejectCode::NoResources,
            4 => RejectCode::Unsupported,
            5 => RejectCode::Backoff,
            v => RejectCode::Unknown(v),
        }
    }
}

impl fmt::Display for RejectCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RejectCode::BadConnectInfo => f.write_str("bad connect information"),
            RejectCode::Refused => f.write_str("refused by the application"),
            RejectCode::NoResources => f.write_str("no resources"),
            RejectCode::Unsupported => f.write_str("unsupported request"),
            RejectCode::Backoff => f.write_str("refused for a while after a protocol violation from this address"),
            RejectCode::Unknown(v) => write!(f, "code {v}"),
        }
    }
}

/// A reject reason: a code and a human-readable text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RejectReason {
    /// The machine-readable reason.
    pub code: RejectCode,
    /// Text for humans (truncated to what fits).
    pub text: String,
}

impl RejectReason {
    /// Builds a reason.
    pub fn new(code: RejectCode, text: impl Into<String>) -> Self {
        RejectReason { code, text: text.into() }
    }

    /// Encodes, truncating the text at a character boundary to fit in a reject.
    pub fn encode(&self) -> Vec<u8> {
        let room = (MAX_REJECT_PRIVATE_DATA - REJECT_HEADER_LEN).min(u8::MAX as usize);
        let mut end = self.text.len().min(room);
        while !self.text.is_char_boundary(end) {
            end -= 1;
        }
        let text = &self.text.as_bytes()[..end];
        let mut out = Vec::with_capacity(REJECT_HEADER_LEN + text.len());
        out.extend_from_slice(&REJECT_MAGIC.to_be_bytes());
        out.push(VERSION);
        out.push(self.code.to_u8());
        out.push(text.len() as u8);
        out.extend_from_slice(text);
        out
    }

    /// Decodes a reject's private data; `None` when it is not one of ours.
    pub fn decode(data: &[u8]) -> Option<RejectReason> {
        if data.len() < REJECT_HEADER_LEN || be_u32(data, 0) != REJECT_MAGIC || data[4] != VERSION {
            return None;
        }
        let len = data[6] as usize;
        let text = data.get(REJECT_HEADER_LEN..REJECT_HEADER_LEN + len)?;
        Some(RejectReason { code: RejectCode::from_u8(data[5]), text: String::from_utf8_lossy(text).into_owned() })
    }
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.text.is_empty() {
            write!(f, "{}", self.code)
        } else {
            write!(f, "{}: {}", self.code, self.text)
        }
    }
}

/// A window of a peer's exposed memory: where an RDMA WRITE or READ goes.
///
/// It travels between peers as 16 bytes ([`RemoteSlice::encode`]), in a message or in the
/// connect information's user bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteSlice {
    /// Address in the peer's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
    /// The peer's remote key.
    pub rkey: u32,
}

impl RemoteSlice {
    /// Length of the encoding.
    pub const ENCODED_LEN: usize = 16;

    /// `len` bytes at `offset` into this window, if they fit.
    pub fn slice(&self, offset: u32, len: u32) -> Option<RemoteSlice> {
        let end = offset.checked_add(len)?;
        // A peer chose `addr`: near the top of the address space the sum must not wrap.
        let addr = self.addr.checked_add(u64::from(offset))?;
        (end <= self.len).then_some(RemoteSlice { addr, len, rkey: self.rkey })
    }

    /// Network byte order: address, length, key.
    pub fn encode(&self) -> [u8; 16] {
        let mut out = [0u8; 16];
        out[..8].copy_from_slice(&self.addr.to_be_bytes());
        out[8..12].copy_from_slice(&self.len.to_be_bytes());
        out[12..].copy_from_slice(&self.rkey.to_be_bytes());
        out
    }

    /// Decodes the first 16 bytes; `None` if fewer.
    pub fn decode(b: &[u8]) -> Option<RemoteSlice> {
        let b: &[u8; 16] = b.get(..16)?.try_into().ok()?;
        Some(RemoteSlice {
            addr: u64::from_be_bytes(b[..8].try_into().ok()?),
            len: u32::from_be_bytes(b[8..12].try_into().ok()?),
            rkey: u32::from_be_bytes(b[12..].try_into().ok()?),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fault issue, defect 9: a peer-supplied address near the top of the address space made
    /// `addr + offset` overflow (a panic in a debug build).
    #[test]
    fn a_slice_past_the_top_of_the_address_space_is_none() {
        let w = RemoteSlice { addr: u64::MAX - 10, len: 100, rkey: 7 };
        assert_eq!(w.slice(50, 10), None);
        assert_eq!(w.slice(10, 10), Some(RemoteSlice { addr: u64::MAX, len: 10, rkey: 7 }));
        assert_eq!(w.slice(0, 101), None, "past the window's end");
    }

    fn sample() -> ConnectInfo {
        ConnectInfo {
            msg_size: 4096,
            msg_count: 10_000,
            recv_depth: 16,
            flow_control: true,
            tail: false,
            farewell: false,
            user: b"hello".to_vec(),
        }
    }

    #[test]
    fn round_trip_exact() {
        let bytes = sample().encode(MAX_CONNECT_PRIVATE_DATA).unwrap();
        assert_eq!(bytes.len(), CONNECT_HEADER_LEN + 5);
        assert_eq!(ConnectInfo::decode(&bytes).unwrap(), Some(sample()));
    }

    #[test]
    fn network_byte_order() {
        let bytes = sample().encode(MAX_CONNECT_PRIVATE_DATA).unwrap();
        assert_eq!(&bytes[0..4], b"RDRX");
        assert_eq!(bytes[4], 1);
        assert_eq!(bytes[5], 20);
        assert_eq!(bytes[6], 5);
        assert_eq!(bytes[7], FLAG_FLOW_CONTROL);
        assert_eq!(&bytes[8..12], &[0, 0, 0x10, 0]);
        assert_eq!(&bytes[12..16], &[0, 0, 0x27, 0x10]);
        assert_eq!(&bytes[16..18], &[0, 16]);
    }

    #[test]
    fn zero_padded_as_the_kernel_delivers_it() {
        let mut bytes = sample().encode(MAX_CONNECT_PRIVATE_DATA).unwrap();
        bytes.resize(MAX_CONNECT_PRIVATE_DATA, 0);
        assert_eq!(ConnectInfo::decode(&bytes).unwrap(), Some(sample()));
        let mut bytes = sample().encode(MAX_ACCEPT_PRIVATE_DATA).unwrap();
        bytes.resize(MAX_ACCEPT_PRIVATE_DATA, 0);
        assert_eq!(ConnectInfo::decode(&bytes).unwrap(), Some(sample()));
    }

    #[test]
    fn absent_private_data_means_defaults() {
        assert_eq!(ConnectInfo::decode(&[]).unwrap(), None);
        assert_eq!(ConnectInfo::decode(&[0; MAX_CONNECT_PRIVATE_DATA]).unwrap(), None);
    }

    #[test]
    fn zero_receive_depth_is_valid() {
        let info = ConnectInfo { recv_depth: 0, ..sample() };
        assert_eq!(ConnectInfo::decode(&info.encode(MAX_CONNECT_PRIVATE_DATA).unwrap()).unwrap(), Some(info));
    }

    #[test]
    fn longer_header_is_skipped_by_a_version_1_reader() {
        let mut bytes = sample().encode(MAX_CONNECT_PRIVATE_DATA).unwrap();
        // Grow the header by 4 extension bytes placed before the user bytes.
        bytes[5] = 24;
        bytes.splice(20..20, [9, 9, 9, 9]);
        assert_eq!(ConnectInfo::decode(&bytes).unwrap(), Some(sample()));
    }

    #[test]
    fn the_farewell_flag_round_trips_in_both_versions() {
        for tail in [false, true] {
            let info = ConnectInfo { tail, farewell: true, ..sample() };
            let bytes = info.encode(MAX_CONNECT_PRIVATE_DATA).unwrap();
            assert_eq!(bytes[7] & FLAG_FAREWELL, FLAG_FAREWELL);
            assert_eq!(ConnectInfo::decode(&bytes).unwrap(), Some(info));
        }
        // Bit 3 and up stay reserved.
        let mut bytes = sample().encode(MAX_CONNECT_PRIVATE_DATA).unwrap();
        bytes[7] |= 8;
        assert_eq!(ConnectInfo::decode(&bytes), Err(WireError::ReservedNotZero));
    }

    #[test]
    fn the_tail_flag_is_version_2_and_round_trips() {
        let info = ConnectInfo { tail: true, ..sample() };
        let bytes = info.encode(MAX_CONNECT_PRIVATE_DATA).unwrap();
        assert_eq!(bytes[4], VERSION_TAIL);
        assert_eq!(bytes[7], FLAG_FLOW_CONTROL | FLAG_TAIL);
        assert_eq!(ConnectInfo::decode(&bytes).unwrap(), Some(info.clone()));
        // Without the tail, version 1 as before: older peers on RoCE read it unchanged.
        assert_eq!(sample().encode(MAX_CONNECT_PRIVATE_DATA).unwrap()[4], VERSION);
        // The tail flag in a version-1 header is a reserved bit.
        let mut v1 = sample().encode(MAX_CONNECT_PRIVATE_DATA).unwrap();
        v1[7] |= FLAG_TAIL;
        assert_eq!(ConnectInfo::decode(&v1), Err(WireError::ReservedNotZero));
        // Version 2 is the tail framing: without its flag it is refused (one encoding per
        // meaning; the fuzz target found the version-2 header without it re-encoding as 1).
        let mut v2 = info.encode(MAX_CONNECT_PRIVATE_DATA).unwrap();
        v2[7] &= !FLAG_TAIL;
        assert!(matches!(ConnectInfo::decode(&v2), Err(WireError::BadField { value: 2, .. })));
    }

    #[test]
    fn malformed_headers_are_rejected_with_a_reason() {
        let good = sample().encode(MAX_CONNECT_PRIVATE_DATA).unwrap();
        let cases: Vec<(Vec<u8>, WireError)> = vec![
            (vec![1, 2], WireError::Truncated { need: 20, have: 2 }),
            (b"XXXX and more bytes here".to_vec(), WireError::BadMagic(0x5858_5858)),
            (good[..12].to_vec(), WireError::Truncated { need: 20, have: 12 }),
            (
                {
                    let mut b = good.clone();
                    b[4] = 3;
                    b
                },
                WireError::UnsupportedVersion(3),
            ),
            (
                {
                    let mut b = good.clone();
                    b[5] = 8;
                    b
                },
                WireError::BadHeaderLength(8),
            ),
            (
                {
                    let mut b = good.clone();
                    b[6] = 200;
                    b
                },
                WireError::Truncated { need: 220, have: 25 },
            ),
            (
                {
                    let mut b = good.clone();
                    b[7] = 2;
                    b
                },
                WireError::ReservedNotZero,
            ),
            (
                {
                    let mut b = good.clone();
                    b[19] = 1;
                    b
                },
                WireError::ReservedNotZero,
            ),
            (
                {
                    let mut b = good.clone();
                    b[8..12].fill(0);
                    b
                },
                WireError::BadField { field: "message size", value: 0 },
            ),
        ];
        for (bytes, want) in cases {
            assert_eq!(ConnectInfo::decode(&bytes), Err(want.clone()), "input {bytes:?}");
            assert!(!want.to_string().is_empty());
        }
    }

    /// Found by the `connect_info` fuzz target: a message size of 0 encoded to a header that
    /// `decode` (and so the peer) rejects with `BadField`; encoding now refuses it the same way.
    #[test]
    fn what_encode_accepts_decode_accepts() {
        let zero = ConnectInfo { msg_size: 0, ..sample() };
        assert_eq!(zero.encode(MAX_CONNECT_PRIVATE_DATA), Err(WireError::BadField { field: "message size", value: 0 }));
        assert!(ConnectInfo::default().encode(MAX_ACCEPT_PRIVATE_DATA).is_err(), "the default states no message size");
        let one = ConnectInfo { msg_size: 1, ..ConnectInfo::default() };
        assert_eq!(ConnectInfo::decode(&one.encode(MAX_CONNECT_PRIVATE_DATA).unwrap()), Ok(Some(one)));
    }

    #[test]
    fn user_data_limit_is_enforced_on_encode() {
        let mut info = sample();
        info.user = vec![7; MAX_CONNECT_PRIVATE_DATA - CONNECT_HEADER_LEN];
        assert!(info.encode(MAX_CONNECT_PRIVATE_DATA).is_ok());
        info.user.push(7);
        assert_eq!(info.encode(MAX_CONNECT_PRIVATE_DATA), Err(WireError::UserDataTooLong { len: 37, max: 36 }));
    }

    #[test]
    fn decode_never_panics_on_any_short_input() {
        // Every prefix and every single-byte corruption of a valid header.
        let good = sample().encode(MAX_CONNECT_PRIVATE_DATA).unwrap();
        for n in 0..=good.len() {
            let _ = ConnectInfo::decode(&good[..n]);
        }
        for i in 0..good.len() {
            for v in [0u8, 1, 0x7f, 0xff] {
                let mut b = good.clone();
                b[i] = v;
                let _ = ConnectInfo::decode(&b);
                let _ = RejectReason::decode(&b);
            }
        }
    }

    #[test]
    fn reject_reason_round_trip_and_truncation() {
        let r = RejectReason::new(RejectCode::BadConnectInfo, "bad magic 0x58585858");
        let bytes = r.encode();
        let mut padded = bytes.clone();
        padded.resize(MAX_REJECT_PRIVATE_DATA, 0);
        assert_eq!(RejectReason::decode(&padded), Some(r));

        let long = RejectReason::new(RejectCode::Refused, "é".repeat(200));
        let bytes = long.encode();
        assert!(bytes.len() <= MAX_REJECT_PRIVATE_DATA);
        let back = RejectReason::decode(&bytes).unwrap();
        assert_eq!(back.code, RejectCode::Refused);
        assert!(back.text.chars().all(|c| c == 'é'));

        assert_eq!(RejectReason::decode(&[0; 148]), None);
        assert_eq!(RejectReason::decode(b"RDRJ"), None);
        let unknown = RejectReason { code: RejectCode::Unknown(77), text: String::new() };
        assert_eq!(RejectReason::decode(&unknown.encode()), Some(unknown));
    }
}
