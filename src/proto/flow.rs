//! Receive-credit flow control: pure arithmetic, no FFI.
//!
//! A sender never posts a message the peer has no receive for. Each side grants the other one
//! credit per receive it has posted; the first grant is the receive depth in the connect
//! information, later grants ride in the 32-bit immediate data of every message
//! ([`Imm`]). A side with nothing to send still returns credits with a zero-length
//! credit-only message.
//!
//! Every message consumes one peer receive, credit-only ones included, and the re-posted
//! receive is granted back. Two rules keep this from deadlocking or looping:
//!
//! - **Reserve.** A data message needs two credits and leaves at least one, so a side can always
//!   send a credit-only message. (If both sides spent their last credit on data, each would be
//!   waiting for the other's grant.)
//! - **No echo.** A credit-only message is sent when the receives owed to the peer include one
//!   re-posted after a data message and reach `threshold`, or when the peer may be blocked:
//!   the credits we granted and it has not yet used (its credits plus its messages in flight)
//!   are at most one. Credits owed only for the peer's own credit-only messages would otherwise
//!   be returned one for one, forever.
//!
//! Why the second rule is the right one: a receiver need not re-post every receive it
//! consumes. An application may keep any `K` receives posted, with `MIN_DEPTH <= K <= depth`
//! (it applies back-pressure by posting fewer). The peer can send data while it holds two
//! credits, so it is blocked exactly when the unused grants are at most one, whatever `K` is;
//! tracking those grants (`granted`) sees that directly. (An earlier rule waited for
//! `depth - 1` owed receives, which only a receiver re-posting everything reaches: one keeping
//! 4 of 8 posted stalled its peer after 7 messages, for ever.)
//!
//! On a shared receive queue (`Config::srq`, `reactor/data/srq/mod.rs`) the same rules hold per
//! connection: its depth is the credit the SRQ grants it, and a receive of the SRQ its peer's
//! message consumed counts as re-posted for that connection (`on_repost`) once the runtime has
//! posted it again to the SRQ. The SRQ admits connections only while their credits sum to at
//! most the receives it keeps posted, so every grant stands for a posted receive.
//!
//! Closing on iWARP (where a completed SEND is no receipt), a side that negotiated it says
//! goodbye with a credit-only message ([`Farewell`]) and waits for the peer's answer before it
//! disconnects. Both are ordinary credit-only messages for the arithmetic here; after its
//! farewell a side sends no data, but still returns credits, so a peer at its last credit can
//! answer.
//!
//! - **A farewell leaves an answer possible.** Farewells are credit-only messages that may
//!   grant nothing, so the reserve alone does not keep both sides able to speak: two farewells
//!   crossing, each on its sender's last credit and each granting nothing, leave neither side a
//!   credit to answer the other's, and both would wait out `Timeouts::finish` (the review of
//!   2026-11-26, L6). So one side, the one that made the connection, says goodbye on its last
//!   credit only when the farewell grants at least one receive ([`Flow::can_say_farewell`]);
//!   else it waits for a grant (or answers the peer's farewell first, with that credit). The
//!   other side says goodbye on its last credit as before. Two crossing farewells then always
//!   leave one side a credit, or a grant from the other, to answer with. The price: a
//!   connecting side that closes at its last credit with nothing owed, while its peer neither
//!   grants nor closes, waits for the peer's next grant, at most `Timeouts::finish`. Nothing
//!   changes on the wire.
//!
//! Why credit-only traffic dies out: right after a credit-only message we have granted every
//! receive we have posted, at least `MIN_DEPTH = 3`. The peer's credit-only messages consume
//! one each, so we send the next one only after the peer sent at least two since our last; and
//! the same holds for the peer. Two sides that each wait for two of the other's cannot keep
//! answering each other.

use super::wire::ConnectInfo;

/// Smallest receive depth that can use flow control (see the module docs).
pub const MIN_DEPTH: u32 = 3;

/// Largest grant one immediate carries.
pub const MAX_GRANT: u32 = 0xFFFF;

/// The immediate data of a flow-controlled message: bit 31 marks a credit-only message, the
/// low 16 bits carry a grant, and bits 30 and 29 of a credit-only message say goodbye
/// ([`Farewell`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Imm {
    /// Credits granted to the receiver of this message.
    pub grant: u32,
    /// A zero-length credit-only message (not delivered to the application).
    pub control: bool,
    /// What a credit-only message says about closing ([`Farewell::None`] on every other).
    pub farewell: Farewell,
}

/// The close handshake a credit-only message can carry (iWARP, where a completed SEND is no
/// receipt: `proto::transport`, `Caps::close_handshake`). A side that closes sends `Leaving`
/// after its last message and disconnects only once the peer's `Heard` arrives (or its
/// `Timeouts::finish` passes); the peer sends `Heard` once it has received the `Leaving`, so
/// every message before it. Bits 30 and 29 of the immediate were reserved and ignored before:
/// an older peer reads either as a plain credit-only message, and the closing side's deadline
/// covers the `Heard` it never sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Farewell {
    /// No word about closing.
    #[default]
    None,
    /// The sender sends nothing more and will disconnect once it hears back.
    Leaving,
    /// The sender received the peer's `Leaving`, and so every message before it.
    Heard,
}

impl Imm {
    const CONTROL: u32 = 1 << 31;
    const LEAVING: u32 = 1 << 30;
    const HEARD: u32 = 1 << 29;

    /// A data message's immediate granting `grant`.
    pub fn data(grant: u32) -> Imm {
        Imm { grant, control: false, farewell: Farewell::None }
    }

    /// A credit-only message's immediate granting `grant`.
    pub fn control(grant: u32) -> Imm {
        Imm { grant, control: true, farewell: Farewell::None }
    }

    /// Packs into the 32-bit immediate (host order; the verbs layer converts). A farewell goes
    /// only on a credit-only message.
    pub fn encode(self) -> u32 {
        let farewell = match self.farewell {
            _ if !self.control => 0,
            Farewell::None => 0,
            Farewell::Leaving => Self::LEAVING,
            Farewell::Heard => Self::HEARD,
        };
        self.grant.min(MAX_GRANT) | if self.control { Self::CONTROL } else { 0 } | farewell
    }

    /// Unpacks; bits 16..=28 are reserved and ignored, and so are bits 29 and 30 on a data
    /// message or both set at once.
    pub fn decode(v: u32) -> Imm {
        let control = v & Self::CONTROL != 0;
        let farewell = match (control, v & Self::LEAVING != 0, v & Self::HEARD != 0) {
            (true, true, false) => Farewell::Leaving,
            (true, false, true) => Farewell::Heard,
            _ => Farewell::None,
        };
        Imm { grant: v & MAX_GRANT, control, farewell }
    }
}

/// One connection's credit state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Flow {
    credits: u32,
    /// Receives granted to the peer and not yet consumed by a message of its (its credits plus
    /// its messages in flight, as far as we know).
    granted: u32,
    owed_data: u32,
    owed_ctrl: u32,
    threshold: u32,
}

impl Flow {
    /// A flow whose peer granted `peer_depth` receives at connect time and to which we
    /// granted `depth` (at least [`MIN_DEPTH`]; the caller checks).
    pub fn new(peer_depth: u32, depth: u32) -> Flow {
        Flow { credits: peer_depth, granted: depth, owed_data: 0, owed_ctrl: 0, threshold: (depth / 2).max(1) }
    }

    /// Peer receives we may still consume.
    #[cfg(any(test, feature = "fuzz-internals"))]
    pub fn credits(&self) -> u32 {
        self.credits
    }

    /// Receives re-posted and not yet granted to the peer.
    pub fn owed(&self) -> u32 {
        self.owed_data + self.owed_ctrl
    }

    /// True when a data message may go out now (it would leave the reserved credit).
    pub fn can_send_data(&self) -> bool {
        self.credits >= 2
    }

    /// Spends a credit on a data message; returns its immediate, carrying every owed credit.
    pub fn send_data(&mut self) -> Imm {
        debug_assert!(self.can_send_data());
        self.credits -= 1;
        Imm::data(self.take_owed())
    }

    /// True when a credit-only message may go out now (the reserved credit is there).
    pub fn can_send_control(&self) -> bool {
        self.credits >= 1
    }

    /// True when our farewell may go now from the side that yields (see the module docs): it
    /// leaves us a credit to answer the peer's farewell with, or it grants the peer one to
    /// answer ours.
    pub fn can_say_farewell(&self) -> bool {
        self.credits >= 2 || (self.credits >= 1 && self.owed() >= 1)
    }

    /// True when a credit-only message should go out now.
    pub fn wants_control(&self) -> bool {
        let owed = self.owed();
        // Nothing owed first: what a data message that just granted everything leaves.
        owed > 0 && self.credits >= 1 && ((self.owed_data > 0 && owed >= self.threshold) || self.granted <= 1)
    }

    /// Spends a credit on a credit-only message; returns its immediate.
    pub fn send_control(&mut self) -> Imm {
        debug_assert!(self.credits >= 1);
        self.credits -= 1;
        Imm::control(self.take_owed())
    }

    #[inline]
    fn take_owed(&mut self) -> u32 {
        let owed = self.owed();
        if owed <= MAX_GRANT {
            // All of it fits one immediate (the common case; the same as below, in fewer steps).
            self.owed_data = 0;
            self.owed_ctrl = 0;
            self.granted = self.granted.saturating_add(owed);
            return owed;
        }
        self.take_owed_capped()
    }

    /// [`Flow::take_owed`] of more than one immediate carries.
    #[cold]
    fn take_owed_capped(&mut self) -> u32 {
        let owed = self.owed().min(MAX_GRANT);
        // Grant the data-caused ones first; what does not fit stays owed.
        let from_data = self.owed_data.min(owed);
        self.owed_data -= from_data;
        self.owed_ctrl -= owed - from_data;
        self.granted = self.granted.saturating_add(owed);
        owed
    }

    /// True when the peer holds no grant of ours: a message arriving now breaks its credit.
    pub fn exhausted(&self) -> bool {
        self.granted == 0
    }

    /// A message arrived carrying `imm` (it consumed one of the receives we granted).
    pub fn on_receive(&mut self, imm: Imm) {
        self.granted = self.granted.saturating_sub(1);
        self.credits = self.credits.saturating_add(imm.grant);
    }

    /// Receives granted to the peer that no message of its has consumed yet, as far as we know
    /// (its credits plus its messages in flight): how much room the peer has left.
    pub fn unused(&self) -> u32 {
        self.granted
    }

    /// One more posted receive for the peer, not one its message consumed: a connection on a
    /// shared receive queue granted more of the queue while it is busy (`reactor/data/srq/mod.rs`).
    /// Owed like a receive re-posted after data, so it goes out with the next grant.
    pub fn grant_more(&mut self) {
        self.owed_data += 1;
    }

    /// The receives this side now keeps for the peer changed to `depth` (a connection on a
    /// shared receive queue whose share grew or shrank): grants are batched for half of it.
    pub fn resize(&mut self, depth: u32) {
        self.threshold = (depth / 2).max(1);
    }

    /// The receives posted for the peer now number `posted` (a receive queue of its own):
    /// grants are batched for half of the most posted so far. A connection announces only the
    /// receives it posted before connecting (its first credit) and posts the rest once
    /// established (issue 45: beyond a small minimum, a connection's receives are the pool's
    /// shared remainder, borrowed only once it is up), so the batch grows with them; without
    /// it, every receive posted after a data message would go back in a credit-only message
    /// of its own.
    pub fn note_depth(&mut self, posted: u32) {
        self.threshold = self.threshold.max(posted / 2);
    }

    /// A receive was posted again after a message consumed it; `control` when that message
    /// was credit-only.
    pub fn on_repost(&mut self, control: bool) {
        if control {
            self.owed_ctrl += 1;
        } else {
            self.owed_data += 1;
        }
    }
}

/// Decides whether a connection uses flow control, the same way on both sides: it does when
/// this side offers it and keeps `depth` receives posted, the peer's connect information offers
/// it too, and both depths are at least [`MIN_DEPTH`]. Returns the connection's credit state.
pub fn negotiate(offer: bool, depth: u32, peer: Option<&ConnectInfo>) -> Option<Flow> {
    let peer = peer.filter(|p| p.flow_control)?;
    let peer_depth = u32::from(peer.recv_depth);
    (offer && depth >= MIN_DEPTH && peer_depth >= MIN_DEPTH).then(|| Flow::new(peer_depth, depth))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The grant a message carries, as `take_owed` took it before its one-step case (issue 47):
    /// the data-caused receives first, at most `MAX_GRANT`, the rest left owed.
    fn take_owed_reference(f: &mut Flow) -> u32 {
        let owed = f.owed().min(MAX_GRANT);
        let from_data = f.owed_data.min(owed);
        f.owed_data -= from_data;
        f.owed_ctrl -= owed - from_data;
        f.granted = f.granted.saturating_add(owed);
        owed
    }

    /// `take_owed` gives and leaves exactly what the capped computation does, in the one-step
    /// case (everything owed fits one immediate) and beyond it.
    #[test]
    fn taking_what_is_owed_in_one_step_grants_as_the_capped_computation() {
        for (data, ctrl) in [
            (0, 0),
            (1, 0),
            (0, 1),
            (5, 3),
            (MAX_GRANT, 0),
            (MAX_GRANT - 1, 1),
            (MAX_GRANT, 1),
            (7, MAX_GRANT),
            (70_000, 3),
        ] {
            let start = Flow { credits: 10, granted: 4, owed_data: data, owed_ctrl: ctrl, threshold: 8 };
            let (mut a, mut b) = (start.clone(), start.clone());
            assert_eq!(a.take_owed(), take_owed_reference(&mut b), "owed {data} + {ctrl}");
            assert_eq!(a, b, "owed {data} + {ctrl}: the state after");
        }
    }

    #[test]
    fn negotiation_needs_both_offers_and_both_depths() {
        let peer = |flow_control, recv_depth| ConnectInfo { flow_control, recv_depth, ..ConnectInfo::default() };
        let on = negotiate(true, 8, Some(&peer(true, 16))).expect("both offer, both deep enough");
        assert_eq!((on.credits(), on.owed()), (16, 0), "the peer's depth is our first credit");
        assert_eq!(negotiate(false, 8, Some(&peer(true, 16))), None, "we do not offer");
        assert_eq!(negotiate(true, 8, Some(&peer(false, 16))), None, "the peer does not offer");
        assert_eq!(negotiate(true, 8, None), None, "a peer without connect information");
        assert_eq!(negotiate(true, MIN_DEPTH - 1, Some(&peer(true, 16))), None, "our depth too small");
        assert_eq!(negotiate(true, 8, Some(&peer(true, MIN_DEPTH as u16 - 1))), None, "the peer's too small");
        assert!(negotiate(true, MIN_DEPTH, Some(&peer(true, MIN_DEPTH as u16))).is_some(), "the minimum works");
    }
    use std::collections::VecDeque;

    #[test]
    fn imm_round_trip() {
        for imm in [Imm::data(0), Imm::control(7), Imm::data(MAX_GRANT)] {
            assert_eq!(Imm::decode(imm.encode()), imm);
        }
        assert_eq!(Imm::decode(0x7FFF_0003), Imm::data(3), "reserved bits ignored");
        assert_eq!(Imm::data(1 << 20).encode(), MAX_GRANT, "grants saturate");
    }

    #[test]
    fn a_farewell_rides_only_on_a_credit_only_message() {
        for farewell in [Farewell::None, Farewell::Leaving, Farewell::Heard] {
            let imm = Imm { farewell, ..Imm::control(5) };
            assert_eq!(Imm::decode(imm.encode()), imm, "{farewell:?}");
            let data = Imm { farewell, ..Imm::data(5) };
            assert_eq!(Imm::decode(data.encode()), Imm::data(5), "a data message says no farewell");
        }
        assert_eq!(Imm::decode(0xC000_0001), Imm { farewell: Farewell::Leaving, ..Imm::control(1) });
        assert_eq!(Imm::decode(0xA000_0001), Imm { farewell: Farewell::Heard, ..Imm::control(1) });
        assert_eq!(Imm::decode(0xE000_0001), Imm::control(1), "both bits at once mean nothing");
        assert_eq!(Imm::decode(0x6000_0001), Imm::data(1), "a data message's bits 29 and 30 are ignored");
        // What an older peer (bits 16..=30 ignored) makes of a farewell: a credit-only message.
        let old = |v: u32| (v & MAX_GRANT, v & (1 << 31) != 0);
        assert_eq!(old(Imm { farewell: Farewell::Leaving, ..Imm::control(2) }.encode()), (2, true));
    }

    #[test]
    fn data_keeps_one_credit_in_reserve() {
        let mut f = Flow::new(3, 3);
        assert!(f.can_send_data());
        f.send_data();
        assert!(f.can_send_data());
        f.send_data();
        assert!(!f.can_send_data(), "the last credit is for credit-only messages");
        assert_eq!(f.credits(), 1);
    }

    #[test]
    fn grants_ride_on_data() {
        let mut f = Flow::new(4, 4);
        f.on_repost(false);
        f.on_repost(true);
        let imm = f.send_data();
        assert_eq!(imm, Imm::data(2));
        assert_eq!(f.owed(), 0);
    }

    /// A message of the peer arrives and its receive is posted again.
    fn consume_and_repost(f: &mut Flow, control: bool) {
        f.on_receive(Imm { grant: 0, control, farewell: Farewell::None });
        f.on_repost(control);
    }

    #[test]
    fn control_only_for_data_or_a_blocked_peer() {
        let mut f = Flow::new(4, 4);
        consume_and_repost(&mut f, true);
        assert!(!f.wants_control(), "one credit for the peer's own control message is not returned alone");
        consume_and_repost(&mut f, true);
        assert!(!f.wants_control());
        consume_and_repost(&mut f, true);
        assert!(f.wants_control(), "one grant left unused: the peer may be blocked");
        let mut g = Flow::new(4, 4);
        consume_and_repost(&mut g, false);
        assert!(!g.wants_control(), "below the threshold");
        consume_and_repost(&mut g, false);
        assert!(g.wants_control());
        assert_eq!(g.send_control(), Imm::control(2));
        assert!(!g.wants_control());
    }

    /// Defect 4 of the fault issue: a receiver keeping 4 of its 8 receives posted. The sender
    /// spends 7 credits (one is its reserve); the receiver re-posts 3 of the 7 consumed
    /// receives, which is below the data threshold (4) and far from `depth - 1`. The old rule
    /// sent no grant, and the sender waited for ever at one credit.
    #[test]
    fn a_receiver_keeping_few_receives_posted_still_grants() {
        let mut f = Flow::new(8, 8);
        for _ in 0..7 {
            f.on_receive(Imm::data(0));
        }
        for _ in 0..3 {
            f.on_repost(false);
        }
        assert!(f.wants_control(), "the peer holds one credit and cannot send data: grant what is posted");
        assert_eq!(f.send_control(), Imm::control(3));
        assert!(!f.wants_control());
    }

    /// Two sides exchanging messages over a simulated in-order link. Each side posts `depth`
    /// receives at connect time and then keeps `keep` of them posted: a consumed receive is
    /// posted again (at a random later step) only while fewer than `keep` are posted; a receive
    /// a credit-only message consumed is always posted again (the runtime does that, unseen).
    /// The invariants: no message ever arrives with no receive posted (the zero-RNR guarantee),
    /// no deadlock while data is queued, and credit-only traffic dies out once data stops.
    fn simulate(depth: [u32; 2], keep: [u32; 2], send: [u32; 2], seed: u64) {
        struct Side {
            flow: Flow,
            posted: u32,
            keep: u32,
            /// Consumed by data, not posted again yet.
            to_repost: u32,
            to_send: u32,
            delivered: u32,
        }
        let side = |i: usize| Side {
            flow: Flow::new(depth[1 - i], depth[i]),
            posted: depth[i],
            keep: keep[i],
            to_repost: 0,
            to_send: send[i],
            delivered: 0,
        };
        let mut sides = [side(0), side(1)];
        let (send_a, send_b) = (send[0], send[1]);
        // Messages in flight towards side i, and messages received but not yet processed.
        let mut wire: [VecDeque<Imm>; 2] = [VecDeque::new(), VecDeque::new()];
        let mut unprocessed: [VecDeque<Imm>; 2] = [VecDeque::new(), VecDeque::new()];
        let mut rng = seed | 1;
        let mut controls = 0u32;
        let mut idle_rounds = 0;
        for _step in 0..200_000 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let i = (rng % 2) as usize;
            let j = 1 - i;
            let mut progressed = false;
            match (rng >> 8) % 4 {
                // Side i sends data or a control message.
                0 => {
                    if sides[i].to_send > 0 && sides[i].flow.can_send_data() {
                        let imm = sides[i].flow.send_data();
                        sides[i].to_send -= 1;
                        wire[j].push_back(imm);
                        progressed = true;
                    } else if sides[i].flow.wants_control() {
                        let imm = sides[i].flow.send_control();
                        wire[j].push_back(imm);
                        controls += 1;
                        progressed = true;
                    }
                }
                // A message lands at side j: it must find a posted receive.
                1 => {
                    if let Some(imm) = wire[j].pop_front() {
                        assert!(sides[j].posted > 0, "RNR: a message reached side {j} with no receive posted");
                        sides[j].posted -= 1;
                        unprocessed[j].push_back(imm);
                        progressed = true;
                    }
                }
                // Side i processes one received message; a credit-only one's receive is
                // posted again at once.
                2 => {
                    if let Some(imm) = unprocessed[i].pop_front() {
                        sides[i].flow.on_receive(imm);
                        if imm.control {
                            sides[i].posted += 1;
                            sides[i].flow.on_repost(true);
                        } else {
                            sides[i].delivered += 1;
                            sides[i].to_repost += 1;
                        }
                        progressed = true;
                    }
                }
                // Side i posts a consumed receive again, if it keeps fewer than `keep` posted.
                _ => {
                    let s = &mut sides[i];
                    if s.to_repost > 0 && s.posted < s.keep {
                        s.to_repost -= 1;
                        s.posted += 1;
                        s.flow.on_repost(false);
                        progressed = true;
                    }
                }
            }
            idle_rounds = if progressed { 0 } else { idle_rounds + 1 };
            if idle_rounds > 2000 {
                break;
            }
        }
        assert_eq!(sides[1].delivered, send_a, "every message from A delivered (depths {depth:?}, kept {keep:?})");
        assert_eq!(sides[0].delivered, send_b, "every message from B delivered (depths {depth:?}, kept {keep:?})");
        assert!(wire.iter().all(|w| w.is_empty()) && unprocessed.iter().all(|u| u.is_empty()), "quiescent");
        let data = send_a + send_b;
        assert!(controls <= data + 4, "credit-only traffic is bounded: {controls} for {data} data messages");
    }

    #[test]
    fn no_rnr_no_deadlock_no_credit_ping_pong() {
        let mut seed = 0x1234_5678_9abc_def1u64;
        for depth_a in MIN_DEPTH..8 {
            for depth_b in MIN_DEPTH..8 {
                for (sa, sb) in [(500, 0), (0, 500), (300, 300), (1, 1), (0, 0)] {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                    simulate([depth_a, depth_b], [depth_a, depth_b], [sa, sb], seed);
                }
            }
        }
    }

    /// Receivers that keep any `K` of their `depth` receives posted (`MIN_DEPTH <= K <= depth`),
    /// including the two cases the fault issue names: depth 8 keeping 4, depth 64 keeping 32.
    #[test]
    fn receivers_keeping_any_k_posted_never_stall() {
        let mut seed = 0x0dd_ba11_5eed_0001u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            seed
        };
        for depth in [3, 4, 5, 8, 16] {
            for keep in MIN_DEPTH..=depth {
                for (sa, sb) in [(300, 0), (0, 300), (200, 200)] {
                    simulate([depth, depth], [keep, keep], [sa, sb], next());
                    simulate([depth, 8], [keep, 8], [sa, sb], next());
                }
            }
        }
        for keep in [3, 4, 16, 31, 32, 33, 63, 64] {
            simulate([64, 64], [keep, keep], [2000, 0], next());
            simulate([64, 64], [keep, 64], [1000, 1000], next());
        }
    }
}
