//! Fuzz harnesses of the pure core. Each takes arbitrary bytes, drives one part of the core with
//! them and panics when an oracle disagrees; none of them can fail any other way.
//!
//! - [`connect_info`]: [`ConnectInfo::decode`] against a second decoder written from the format
//!   table in `wire.rs`, lengths honoured, zero padding ignored, decode → encode → decode equal;
//!   an arbitrary `ConnectInfo` encodes to what decodes to it; [`negotiate`] on what decoded;
//!   [`RejectReason`] both ways; [`RemoteSlice`] decoding and `slice` against 128-bit arithmetic.
//! - [`state_machines`]: one sequence of arbitrary inputs (every CM event kind, unknown ones,
//!   any status, rejects with any reason, every deadline, close, shutdown, drained, work errors,
//!   setup failures) fed to a client, an agent and a listener. Every transition must be what the
//!   independent table `conn::spec` says, keep the life-long invariants of `spec::Tracker`, and
//!   be legal for the role; at the end, closing must reach `Closed` with exactly one `Closed`
//!   action in the connection's whole life.
//! - [`flow`]: two peers exchanging messages under receive-credit flow control, each keeping any
//!   `K` of its `depth` receives posted, scheduled by the fuzzer, then by a fair scheduler to the
//!   end: never a message without a posted receive, credits always conserved, every message
//!   delivered (no deadlock), credit-only traffic bounded.
//!
//! They run coverage-guided in the `fuzz/` crate (through the hidden `fuzz_internals` module,
//! feature `fuzz-internals`), and on seeded pseudo-random bytes in this module's unit tests.

use super::conn::spec::{self, Tracker};
use super::conn::{Action, Agent, Client, CloseReason, CmEventKind as K, Input, Listener, ListenerAction, State, Step};
use super::flow::{negotiate, Flow, Imm, MAX_GRANT, MIN_DEPTH};
use super::op::WcStatus;
use super::wire::{
    ConnectInfo, RejectCode, RejectReason, RemoteSlice, WireError, CONNECT_HEADER_LEN, MAX_ACCEPT_PRIVATE_DATA,
    MAX_CONNECT_PRIVATE_DATA, MAX_REJECT_PRIVATE_DATA,
};

/// The fuzzer's bytes read as values; past the end every read is zero.
struct Bytes<'a>(&'a [u8]);

impl<'a> Bytes<'a> {
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }

    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    fn take(&mut self, n: usize) -> &'a [u8] {
        let (head, rest) = self.0.split_at(n.min(self.0.len()));
        self.0 = rest;
        head
    }
}

// ------------------------------------------------------------------------------------------
// Wire formats
// ------------------------------------------------------------------------------------------

/// The connect information, the reject reason and `RemoteSlice`, each on `data`.
pub(crate) fn connect_info(data: &[u8]) {
    decode_connect_info(data);
    encode_connect_info(data);
    reject_reason(data);
    remote_slice(data);
}

/// The connect-information header decoded from the table in `wire.rs`'s docs, independently of
/// `ConnectInfo::decode`: the same checks in the same order, the offsets as the table has them.
fn reference_decode(d: &[u8]) -> Result<Option<ConnectInfo>, WireError> {
    use WireError as E;
    let be = |at: usize, n: usize| d[at..at + n].iter().fold(0u32, |v, &b| v << 8 | u32::from(b));
    if d.iter().all(|&b| b == 0) {
        return Ok(None);
    }
    if d.len() < 4 {
        return Err(E::Truncated { need: 20, have: d.len() });
    }
    if be(0, 4) != 0x5244_5258 {
        return Err(E::BadMagic(be(0, 4)));
    }
    if d.len() < 20 {
        return Err(E::Truncated { need: 20, have: d.len() });
    }
    let (version, header, user, flags) = (d[4], usize::from(d[5]), usize::from(d[6]), d[7]);
    if version != 1 && version != 2 {
        return Err(E::UnsupportedVersion(version));
    }
    if header < 20 {
        return Err(E::BadHeaderLength(d[5]));
    }
    if d.len() < header + user {
        return Err(E::Truncated { need: header + user, have: d.len() });
    }
    // Version 1 knows flag bit 0; version 2 bits 0 and 1.
    // Flow control and the close handshake in either version, the tail only in version 2.
    let known = 1 | 4 | if version == 2 { 2 } else { 0 };
    if flags & !known != 0 || be(18, 2) != 0 {
        return Err(E::ReservedNotZero);
    }
    if version == 2 && flags & 2 == 0 {
        return Err(E::BadField { field: "version 2 without the tail flag", value: 2 });
    }
    if be(8, 4) == 0 {
        return Err(E::BadField { field: "message size", value: 0 });
    }
    Ok(Some(ConnectInfo {
        msg_size: be(8, 4),
        msg_count: be(12, 4),
        recv_depth: be(16, 2) as u16,
        flow_control: flags & 1 == 1,
        tail: flags & 2 == 2,
        farewell: flags & 4 == 4,
        user: d[header..header + user].to_vec(),
    }))
}

fn decode_connect_info(data: &[u8]) {
    let got = ConnectInfo::decode(data);
    assert_eq!(got, reference_decode(data), "decode disagrees with the format table on {data:?}");
    if let Err(e) = &got {
        assert!(!e.to_string().is_empty());
        if let WireError::Truncated { need, have } = e {
            assert!(*have == data.len() && need > have, "{e:?} for {} bytes", data.len());
        }
    }
    // The kernel pads private data with zeros: padding changes nothing that decoded.
    if got.is_ok() {
        let mut padded = data.to_vec();
        padded.resize(data.len() + MAX_ACCEPT_PRIVATE_DATA, 0);
        assert_eq!(ConnectInfo::decode(&padded), got, "zero padding changed the result for {data:?}");
    }
    let Ok(Some(info)) = got else { return };
    // Lengths honoured: the user bytes are exactly the declared ones; bytes past them do not
    // count, and one byte fewer is a truncated header.
    let (start, end) = (usize::from(data[5]), usize::from(data[5]) + usize::from(data[6]));
    assert_eq!(info.user, &data[start..end]);
    assert_eq!(ConnectInfo::decode(&data[..end]).as_ref(), Ok(&Some(info.clone())));
    assert_eq!(ConnectInfo::decode(&data[..end - 1]), Err(WireError::Truncated { need: end, have: end - 1 }));
    // What decodes re-encodes to an equal value; a version-1 header re-encodes byte for byte.
    let bytes = info.encode(CONNECT_HEADER_LEN + usize::from(u8::MAX)).expect("255 user bytes always fit");
    assert_eq!(ConnectInfo::decode(&bytes).as_ref(), Ok(&Some(info.clone())), "re-encoded as {bytes:?}");
    if start == CONNECT_HEADER_LEN {
        assert_eq!(bytes, &data[..end], "a version-1 header re-encodes to its own bytes");
    }
    // Flow control is negotiated from it the documented way.
    for offer in [false, true] {
        for depth in [0, MIN_DEPTH - 1, MIN_DEPTH, u32::from(info.recv_depth), u32::MAX] {
            let flow = negotiate(offer, depth, Some(&info));
            let on = offer && info.flow_control && depth >= MIN_DEPTH && u32::from(info.recv_depth) >= MIN_DEPTH;
            assert_eq!(flow.is_some(), on, "negotiate({offer}, {depth}, {info:?})");
            if let Some(f) = flow {
                assert_eq!((f.credits(), f.owed()), (u32::from(info.recv_depth), 0), "the first credit is the depth");
            }
        }
    }
}

/// An arbitrary `ConnectInfo` built from the bytes: it encodes within the transport's limits,
/// and what it encodes to decodes to it; what it refuses to encode, a peer would refuse.
fn encode_connect_info(data: &[u8]) {
    let mut b = Bytes(data);
    let info = ConnectInfo {
        msg_size: b.u32(),
        msg_count: b.u32(),
        recv_depth: b.u32() as u16,
        flow_control: b.u8() & 1 == 1,
        tail: b.u8() & 1 == 1,
        farewell: b.u8() & 1 == 1,
        user: {
            let n = usize::from(b.u8());
            b.take(n).to_vec()
        },
    };
    for max in [MAX_CONNECT_PRIVATE_DATA, MAX_ACCEPT_PRIVATE_DATA, 0, CONNECT_HEADER_LEN + 300] {
        let room = max.saturating_sub(CONNECT_HEADER_LEN).min(usize::from(u8::MAX));
        match info.encode(max) {
            Ok(bytes) => {
                assert!(info.user.len() <= room && bytes.len() <= CONNECT_HEADER_LEN + room, "{bytes:?} for {max}");
                assert_eq!(bytes.len(), CONNECT_HEADER_LEN + info.user.len());
                assert_eq!(ConnectInfo::decode(&bytes), Ok(Some(info.clone())), "{info:?} encoded as {bytes:?}");
            }
            Err(WireError::BadField { field: "message size", value: 0 }) => assert_eq!(info.msg_size, 0),
            Err(WireError::UserDataTooLong { len, max: m }) => {
                assert_eq!((len, m), (info.user.len(), room));
                assert!(len > room && info.msg_size != 0);
            }
            Err(e) => panic!("encoding {info:?} into {max} bytes: {e}"),
        }
    }
}

/// The wire value of a reject code, from the table in `wire.rs`'s docs.
fn reject_code_value(c: RejectCode) -> u8 {
    match c {
        RejectCode::BadConnectInfo => 1,
        RejectCode::Refused => 2,
        RejectCode::NoResources => 3,
        RejectCode::Unsupported => 4,
        RejectCode::Backoff => 5,
        RejectCode::Unknown(v) => v,
    }
}

/// The longest prefix of `s` of at most `max` bytes that ends at a character boundary.
fn prefix_within(s: &str, max: usize) -> &str {
    let end = s.char_indices().map(|(i, c)| i + c.len_utf8()).take_while(|&e| e <= max).last().unwrap_or(0);
    &s[..end]
}

fn reject_reason(data: &[u8]) {
    const HEADER: usize = 7;
    let room = MAX_REJECT_PRIVATE_DATA - HEADER;
    let got = RejectReason::decode(data);
    let ours = data.len() >= HEADER && data[..4] == *b"RDRJ" && data[4] == 1;
    let text = data.get(HEADER..HEADER + usize::from(*data.get(6).unwrap_or(&0)));
    match (&got, ours, text) {
        (Some(r), true, Some(text)) => {
            assert_eq!(reject_code_value(r.code), data[5]);
            assert_eq!(r.text, String::from_utf8_lossy(text));
        }
        (None, false, _) | (None, true, None) => {}
        _ => panic!("RejectReason::decode({data:?}) = {got:?}"),
    }
    // What decoded, and an arbitrary reason built from the bytes, survive a round trip: the
    // text cut at a character boundary to fit in a reject.
    let mut b = Bytes(data);
    let code = match b.u8() % 7 {
        0 => RejectCode::BadConnectInfo,
        1 => RejectCode::Refused,
        2 => RejectCode::NoResources,
        3 => RejectCode::Unsupported,
        4 => RejectCode::Backoff,
        _ => RejectCode::Unknown(b.u8()),
    };
    let n = usize::from(b.u8());
    let built = RejectReason::new(code, String::from_utf8_lossy(b.take(n)));
    for r in got.into_iter().chain([built]) {
        assert!(!r.to_string().is_empty());
        let bytes = r.encode();
        assert!(bytes.len() <= MAX_REJECT_PRIVATE_DATA, "{} bytes", bytes.len());
        let back = RejectReason::decode(&bytes).expect("an encoded reason decodes");
        assert_eq!(reject_code_value(back.code), reject_code_value(r.code));
        assert_eq!(back.text, prefix_within(&r.text, room), "the text of {r:?}");
    }
}

fn remote_slice(data: &[u8]) {
    let got = RemoteSlice::decode(data);
    assert_eq!(got.is_some(), data.len() >= RemoteSlice::ENCODED_LEN);
    let Some(w) = got else { return };
    assert_eq!(w.encode(), data[..16], "the 16 bytes re-encode to themselves");
    assert_eq!(
        (w.addr, w.len, w.rkey),
        (
            u64::from_be_bytes(data[..8].try_into().expect("8 bytes")),
            u32::from_be_bytes(data[8..12].try_into().expect("4 bytes")),
            u32::from_be_bytes(data[12..16].try_into().expect("4 bytes")),
        )
    );
    let check = |offset: u32, len: u32| {
        let fits = u64::from(offset) + u64::from(len) <= u64::from(w.len)
            && u128::from(w.addr) + u128::from(offset) <= u128::from(u64::MAX);
        match w.slice(offset, len) {
            Some(s) => {
                assert!(fits, "{w:?}.slice({offset}, {len}) = {s:?}");
                assert_eq!(s, RemoteSlice { addr: w.addr + u64::from(offset), len, rkey: w.rkey });
            }
            None => assert!(!fits, "{w:?}.slice({offset}, {len}) = None"),
        }
    };
    check(0, w.len);
    check(w.len, 0);
    check(w.len, 1);
    check(u32::MAX, 1);
    let mut b = Bytes(&data[16..]);
    while !b.is_empty() {
        let (offset, len) = (b.u32(), b.u32());
        check(offset, len);
        // Also within the window, where slicing succeeds unless the address wraps.
        let offset = offset % w.len.saturating_add(1).max(1);
        check(offset, len % (w.len - offset).saturating_add(1));
    }
}

// ------------------------------------------------------------------------------------------
// State machines
// ------------------------------------------------------------------------------------------

/// Inputs fed at most, so a run stays short whatever the fuzzer's input length.
const MAX_INPUTS: usize = 2000;

const WC_STATUSES: [WcStatus; 22] = [
    WcStatus::Success,
    WcStatus::LocLenErr,
    WcStatus::LocQpOpErr,
    WcStatus::LocEecOpErr,
    WcStatus::LocProtErr,
    WcStatus::WrFlushErr,
    WcStatus::MwBindErr,
    WcStatus::BadRespErr,
    WcStatus::LocAccessErr,
    WcStatus::RemInvReqErr,
    WcStatus::RemAccessErr,
    WcStatus::RemOpErr,
    WcStatus::RetryExcErr,
    WcStatus::RnrRetryExcErr,
    WcStatus::LocRddViolErr,
    WcStatus::RemInvRdReqErr,
    WcStatus::RemAbortErr,
    WcStatus::InvEecnErr,
    WcStatus::InvEecStateErr,
    WcStatus::FatalErr,
    WcStatus::RespTimeoutErr,
    WcStatus::GeneralErr,
];

/// An event status: zero, the ones rdma_cm uses, the extremes, or any.
fn status(b: &mut Bytes<'_>) -> i32 {
    match b.u8() % 4 {
        0 => 0,
        1 => [28, 8, -110, -111, -1, i32::MIN, i32::MAX][usize::from(b.u8()) % 7],
        _ => b.u32() as i32,
    }
}

fn text(b: &mut Bytes<'_>) -> String {
    let n = usize::from(b.u8() % 64);
    String::from_utf8_lossy(b.take(n)).into_owned()
}

/// One input of any kind, with any payload.
fn input(b: &mut Bytes<'_>) -> Input {
    match b.u8() % 14 {
        0..=3 => {
            let k = b.u8();
            let kind = spec::KNOWN_KINDS.get(usize::from(k)).copied().unwrap_or_else(|| match k % 4 {
                0 => K::Unknown(b.u32()),
                _ => spec::KNOWN_KINDS[usize::from(k) % spec::KNOWN_KINDS.len()],
            });
            Input::Cm(kind, status(b))
        }
        4 => {
            let status = status(b);
            let reason = match b.u8() % 3 {
                0 => None,
                1 => {
                    let n = usize::from(b.u8() % 32);
                    RejectReason::decode(b.take(n))
                }
                _ => Some(RejectReason::new(RejectCode::Unknown(b.u8()), text(b))),
            };
            Input::Rejected { status, reason }
        }
        5 => Input::Timeout(spec::ALL_STEPS[usize::from(b.u8()) % spec::ALL_STEPS.len()]),
        6 => Input::Close,
        7 => Input::Shutdown,
        8 => Input::Drained,
        9 => {
            let s = b.u8();
            Input::WorkError(WC_STATUSES.get(usize::from(s)).copied().unwrap_or_else(|| WcStatus::Unknown(b.u32())))
        }
        10 => Input::SetupFailed(text(b)),
        11 => Input::Fault(crate::proto::conn::CloseReason::AsyncEvent(crate::proto::conn::AsyncEventKind::QpFatal)),
        12 => Input::Abort(crate::proto::conn::CloseReason::CqFailed { call: "ibv_poll_cq", errno: i32::from(b.u8()) }),
        // The next step of a connection going well, so that sequences get far often.
        _ => match b.u8() % 7 {
            0 => Input::Cm(K::AddrResolved, 0),
            1 => Input::Cm(K::RouteResolved, 0),
            2 => Input::Cm(K::Established, 0),
            3 => Input::Cm(K::Disconnected, 0),
            4 => Input::Finish(crate::proto::conn::CloseReason::Local),
            5 => Input::Finished,
            _ => Input::Drained,
        },
    }
}

/// A client or an agent, its tracker and its `Closed` actions so far.
struct Life {
    machine: Machine,
    tracker: Tracker,
    closes: usize,
}

enum Machine {
    Client(Client),
    Agent(Agent),
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Role {
    Client,
    Agent,
}

impl Life {
    fn new(role: Role) -> Life {
        let (machine, first) = match role {
            Role::Client => {
                let (m, first) = Client::resolving();
                (Machine::Client(m), first)
            }
            Role::Agent => {
                let (m, first) = Agent::accepting();
                (Machine::Agent(m), first)
            }
        };
        Life { machine, tracker: Tracker::new(&first), closes: 0 }
    }

    fn role(&self) -> Role {
        match self.machine {
            Machine::Client(_) => Role::Client,
            Machine::Agent(_) => Role::Agent,
        }
    }

    fn state(&self) -> &State {
        match &self.machine {
            Machine::Client(m) => m.state(),
            Machine::Agent(m) => m.state(),
        }
    }

    /// Feeds `input` and checks the transition; panics with the history on a violation.
    fn feed(&mut self, input: &Input, history: &[Input]) {
        let before = self.state().clone();
        let actions = match &mut self.machine {
            Machine::Client(m) => m.on_input(input.clone()),
            Machine::Agent(m) => m.on_input(input.clone()),
        }
        .into_vec();
        let after = self.state().clone();
        let (want_state, want_actions) = spec::expected(&before, input);
        let problem = if (&after, &actions) != (&want_state, &want_actions) {
            Some(format!("the spec wants {want_state:?} with {want_actions:?}"))
        } else {
            self.tracker
                .step(&before, input, &actions, &after)
                .err()
                .or_else(|| legal(self.role(), &before, &actions).err())
        };
        if let Some(p) = problem {
            panic!(
                "{:?}: {p}\n  history: {history:?}\n  input: {input:?} while {before:?}\n  got: {after:?} with {actions:?}",
                self.role()
            );
        }
        self.closes += actions.iter().filter(|a| matches!(a, Action::Closed(_))).count();
    }

    /// Closes the connection the way the reactor does (`how`: Close or Shutdown, then each
    /// armed deadline expiring): it must reach `Closed`, with one `Closed` action in its life.
    fn finish(&mut self, how: Input, history: &mut Vec<Input>) {
        self.feed(&how, history);
        history.push(how);
        for _ in 0..3 {
            if self.state().is_closed() {
                break;
            }
            let step = self.tracker.armed.unwrap_or_else(|| panic!("{:?}: open with no deadline armed", self.role()));
            let input = Input::Timeout(step);
            self.feed(&input, history);
            history.push(input);
        }
        assert!(self.state().is_closed(), "{:?}: still {:?} after {history:?}", self.role(), self.state());
        assert_eq!(self.closes, 1, "{:?}: Closed actions in one life, after {history:?}", self.role());
    }
}

/// The actions a role may emit from a state, whatever the input: the machines' contracts with
/// the reactor, independent of the spec's table.
fn legal(role: Role, before: &State, actions: &[Action]) -> Result<(), String> {
    let client = role == Role::Client;
    let own_step = |s: &Step| match s {
        Step::ResolveAddr | Step::ResolveRoute | Step::Connect => client,
        Step::Accept => !client,
        Step::Disconnect | Step::Drain | Step::Finish => true,
    };
    for a in actions {
        let ok = match a {
            Action::ResolveRoute => client && *before == State::ResolvingAddr,
            Action::Connect => client && *before == State::ResolvingRoute,
            Action::Established => *before == if client { State::Connecting } else { State::Accepting },
            Action::Disconnect => before.is_connected(),
            Action::SendFarewell => before.is_established(),
            Action::SetDeadline(s) => own_step(s),
            Action::ClearDeadline => !before.is_closed(),
            Action::Closed(reason) => match reason {
                CloseReason::AddrError(_) | CloseReason::RouteError(_) => client,
                CloseReason::Timeout(s) => own_step(s) && !matches!(s, Step::Disconnect | Step::Drain | Step::Finish),
                CloseReason::Rejected { .. } | CloseReason::ConnectError(_) => {
                    matches!(before, State::Connecting | State::Accepting)
                }
                _ => true,
            },
        };
        if !ok {
            return Err(format!("{a:?} is illegal for the {role:?} while {before:?}"));
        }
    }
    Ok(())
}

/// A listener and what the oracle knows of it.
struct ListenerLife {
    listener: Listener,
    closed: bool,
}

impl ListenerLife {
    fn feed(&mut self, input: &Input) {
        let (got, want) = match input {
            Input::Cm(kind, status) => {
                let got = self.listener.on_cm(*kind, *status);
                let want = match kind {
                    _ if self.closed => ListenerAction::None,
                    K::ConnectRequest => ListenerAction::Incoming,
                    K::DeviceRemoval => ListenerAction::Closed(CloseReason::DeviceRemoval),
                    K::AddrChange | K::TimewaitExit => ListenerAction::None,
                    other => match &got {
                        ListenerAction::Report(text) => {
                            assert!(
                                text.contains(&format!("{other:?}")) && text.contains(&status.to_string()),
                                "{text}"
                            );
                            got.clone()
                        }
                        _ => ListenerAction::Report(format!("{other:?} (status {status})")),
                    },
                };
                (got, want)
            }
            Input::Close | Input::Shutdown => {
                let reason = if *input == Input::Close { CloseReason::Local } else { CloseReason::Shutdown };
                let got = self.listener.close_for(reason.clone());
                (got, if self.closed { ListenerAction::None } else { ListenerAction::Closed(reason) })
            }
            _ => return,
        };
        assert_eq!(got, want, "listener: {input:?} (closed: {})", self.closed);
        self.closed |= matches!(got, ListenerAction::Closed(_));
    }
}

/// One sequence of arbitrary inputs to a client, an agent and a listener.
pub(crate) fn state_machines(data: &[u8]) {
    let mut b = Bytes(data);
    let shutdown = b.u8() & 1 == 1;
    let mut lives = [Life::new(Role::Client), Life::new(Role::Agent)];
    let mut listener = ListenerLife { listener: Listener::new(), closed: false };
    let mut history = Vec::new();
    while !b.is_empty() && history.len() < MAX_INPUTS {
        let input = input(&mut b);
        for life in &mut lives {
            life.feed(&input, &history);
        }
        listener.feed(&input);
        history.push(input);
    }
    for life in &mut lives {
        life.finish(if shutdown { Input::Shutdown } else { Input::Close }, &mut history.clone());
    }
}

// ------------------------------------------------------------------------------------------
// Flow control
// ------------------------------------------------------------------------------------------

/// One peer of the flow simulation.
struct Side {
    flow: Flow,
    /// Receives posted now.
    posted: u32,
    /// Receives the application keeps posted (`MIN_DEPTH <= keep <= depth`).
    keep: u32,
    /// Receives consumed by data and not posted again yet.
    to_repost: u32,
    /// Data messages still to send.
    to_send: u32,
    delivered: u32,
    controls: u32,
}

/// Two peers over an in-order link: `wire[i]` holds the messages on their way to side `i`,
/// `landed[i]` those that reached a receive of side `i` and wait for it to process them.
struct Sim {
    sides: [Side; 2],
    wire: [Vec<Imm>; 2],
    landed: [Vec<Imm>; 2],
}

impl Sim {
    /// Side `i` makes one move (`0` send, `1` a message lands, `2` process one, `3` re-post
    /// a receive); returns whether anything happened.
    fn step(&mut self, i: usize, how: u8) -> bool {
        let j = 1 - i;
        let done = match how % 4 {
            0 => {
                let s = &mut self.sides[i];
                if s.to_send > 0 && s.flow.can_send_data() {
                    let imm = s.flow.send_data();
                    assert!(s.flow.credits() >= 1, "data spent the reserved credit");
                    s.to_send -= 1;
                    self.wire[j].push(imm);
                    true
                } else if s.flow.wants_control() {
                    let imm = s.flow.send_control();
                    assert!(imm.grant > 0, "a credit-only message that grants nothing");
                    s.controls += 1;
                    self.wire[j].push(imm);
                    true
                } else {
                    false
                }
            }
            1 => {
                if self.wire[i].is_empty() {
                    false
                } else {
                    let imm = self.wire[i].remove(0);
                    assert!(self.sides[i].posted > 0, "RNR: a message reached side {i} with no receive posted");
                    self.sides[i].posted -= 1;
                    self.landed[i].push(imm);
                    true
                }
            }
            2 => {
                if self.landed[i].is_empty() {
                    false
                } else {
                    let imm = self.landed[i].remove(0);
                    let s = &mut self.sides[i];
                    s.flow.on_receive(imm);
                    if imm.control {
                        // The runtime posts a credit-only message's receive again at once.
                        s.posted += 1;
                        s.flow.on_repost(true);
                    } else {
                        s.delivered += 1;
                        s.to_repost += 1;
                    }
                    true
                }
            }
            _ => {
                let s = &mut self.sides[i];
                if s.to_repost > 0 && s.posted < s.keep {
                    s.to_repost -= 1;
                    s.posted += 1;
                    s.flow.on_repost(false);
                    true
                } else {
                    false
                }
            }
        };
        self.check_conservation();
        done
    }

    /// Every receive side `j` has posted is, in side `i`'s view, a credit, a message on its
    /// way, a grant on its way back, or owed: credits never exceed the receives posted.
    fn check_conservation(&self) {
        for i in 0..2 {
            let j = 1 - i;
            let grants_back: u32 = self.wire[i].iter().chain(&self.landed[i]).map(|m| m.grant).sum();
            let accounted =
                self.sides[i].flow.credits() + self.wire[j].len() as u32 + grants_back + self.sides[j].flow.owed();
            assert_eq!(accounted, self.sides[j].posted, "receives of side {j}: credits of {i} + in flight + owed");
        }
    }
}

/// Two peers with depths, kept receives and message counts from the bytes, scheduled by the
/// bytes and then fairly until nothing moves.
pub(crate) fn flow(data: &[u8]) {
    let mut b = Bytes(data);
    let v = b.u32();
    let imm = Imm::decode(v);
    // A credit-only message keeps one farewell bit (30 or 29, not both); the rest is reserved.
    let farewell = v & (1 << 30 | 1 << 29);
    let kept = if v & 1 << 31 != 0 && farewell != 1 << 30 | 1 << 29 { farewell } else { 0 };
    assert_eq!(imm.encode(), v & (MAX_GRANT | 1 << 31) | kept, "reserved bits are dropped, the rest kept");
    assert_eq!(Imm::decode(imm.encode()), imm);
    let depth = [MIN_DEPTH + u32::from(b.u8() % 62), MIN_DEPTH + u32::from(b.u8() % 62)];
    let keep = [0, 1].map(|i| MIN_DEPTH + u32::from(b.u8()) % (depth[i] - MIN_DEPTH + 1));
    let send = [u32::from(b.u8()), u32::from(b.u8())];
    let side = |i: usize| Side {
        flow: Flow::new(depth[1 - i], depth[i]),
        posted: depth[i],
        keep: keep[i],
        to_repost: 0,
        to_send: send[i],
        delivered: 0,
        controls: 0,
    };
    let mut sim = Sim { sides: [side(0), side(1)], wire: [Vec::new(), Vec::new()], landed: [Vec::new(), Vec::new()] };
    sim.check_conservation();
    while !b.is_empty() {
        let x = b.u8();
        sim.step(usize::from(x & 1), x >> 1);
    }
    // A fair scheduler to the end: every move of every side in turn until none moves.
    let limit = 64 * (send[0] + send[1] + depth[0] + depth[1]);
    let mut rounds = 0;
    while (0..8u8).fold(false, |moved, k| sim.step(usize::from(k & 1), k >> 1) | moved) {
        rounds += 1;
        assert!(rounds < limit, "no quiescence after {rounds} fair rounds: credit-only messages never stop");
    }
    let ctx = format!("depths {depth:?}, kept {keep:?}, sent {send:?}");
    assert_eq!(sim.sides[1].delivered, send[0], "deadlock: side 0's messages not all delivered ({ctx})");
    assert_eq!(sim.sides[0].delivered, send[1], "deadlock: side 1's messages not all delivered ({ctx})");
    let controls = sim.sides[0].controls + sim.sides[1].controls;
    assert!(controls <= send[0] + send[1] + 4, "{controls} credit-only messages for {send:?} data ({ctx})");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// xorshift64*: seeded, dependency-free.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        fn bytes(&mut self, max: usize) -> Vec<u8> {
            let n = (self.next() % (max as u64 + 1)) as usize;
            (0..n).map(|_| self.next() as u8).collect()
        }
    }

    /// The harnesses on seeded pseudo-random bytes, as a host test (the coverage-guided runs
    /// are `cargo xtask fuzz`).
    #[test]
    fn connect_info_on_random_and_mutated_headers() {
        let mut rng = Rng(0x5eed_0001);
        let good = ConnectInfo {
            msg_size: 4096,
            msg_count: 3,
            recv_depth: 16,
            flow_control: true,
            tail: false,
            farewell: false,
            user: vec![7; 9],
        }
        .encode(MAX_CONNECT_PRIVATE_DATA)
        .expect("fits");
        for _ in 0..3000 {
            connect_info(&rng.bytes(80));
            let mut b = good.clone();
            for _ in 0..1 + rng.next() % 3 {
                let at = (rng.next() % b.len() as u64) as usize;
                b[at] = rng.next() as u8;
            }
            b.truncate(b.len() - (rng.next() % 4) as usize);
            connect_info(&b);
        }
    }

    #[test]
    fn state_machines_on_random_sequences() {
        let mut rng = Rng(0x5eed_0002);
        for _ in 0..1500 {
            state_machines(&rng.bytes(200));
        }
    }

    #[test]
    fn flow_on_random_schedules() {
        let mut rng = Rng(0x5eed_0003);
        for _ in 0..300 {
            flow(&rng.bytes(400));
        }
    }

    #[test]
    fn harnesses_take_empty_input() {
        connect_info(&[]);
        state_machines(&[]);
        flow(&[]);
    }
}
