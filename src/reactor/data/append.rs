//! Appending bytes to a SEND that was submitted and is not posted yet: the byte stream's
//! coalesced writes (`crate::io::Stream`, issue 46).
//!
//! A submitted operation waits on its connection's send queue until the end of the tick (or
//! longer, for the peer's credits or a send slot); until it is posted the device has not seen
//! its buffer, so the buffer is still the reactor's to change. A stream that writes again
//! while its last message waits appends to that message, up to the message size, instead of
//! queueing a message of its own: `tokio::io::copy`'s 8 KiB writes go out as messages of the
//! connection's size, and a lone write is not delayed (it was submitted, and is posted at the
//! end of its tick as before).
//!
//! Only the connection's last pending operation may grow, only if it is a SEND of a pool
//! buffer that carries the caller's user_data (its own message), only while the connection is
//! established, and never beyond the buffer's capacity, the message size both sides agreed on,
//! or (for a message that waits beyond the free send slots) `Config::send_backlog_bytes`.

use std::io::IoSlice;

use crate::proto::token::ConnKey;
use crate::reactor::conn::entry::ConnEntry;
use crate::reactor::Core;

/// How many bytes a pending message of `len` bytes in a buffer of `capacity` may still take:
/// up to the capacity and the message size `limit` (when there is one), and no more than
/// `backlog_room`, the bytes `Config::send_backlog_bytes` still allows, when the message waits
/// beyond the free send slots. Pure.
pub(in crate::reactor) fn append_room(
    len: usize,
    capacity: usize,
    limit: Option<usize>,
    backlog_room: Option<usize>,
) -> usize {
    let max = limit.map_or(capacity, |l| l.min(capacity));
    max.saturating_sub(len).min(backlog_room.unwrap_or(usize::MAX))
}

/// The largest message the connection may send: the smaller of both sides' announced sizes
/// (as `Core::submit` checks a SEND), `None` when neither announced one.
fn msg_limit(c: &ConnEntry) -> Option<usize> {
    let peer = c.infos.peer.as_ref().map(|i| i.msg_size as usize).filter(|m| *m > 0);
    let own = Some(c.infos.local.msg_size as usize).filter(|m| *m > 0);
    match (peer, own) {
        (Some(p), Some(o)) => Some(p.min(o)),
        (p, o) => p.or(o),
    }
}

impl Core {
    /// Appends as many of `bytes` as fit to connection `t`'s last pending operation, if it is
    /// a SEND of a pool buffer with `user_data` that is not posted yet (module docs), at most
    /// `limit` of them (the caller's own message size). Returns how many bytes it took; 0 when
    /// it took none (nothing changed).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn append_send(&mut self, t: ConnKey, user_data: u64, bytes: &[IoSlice<'_>], limit: usize) -> usize {
        let backlog_limit = self.cfg.send_backlog_bytes;
        let Some(c) = self.conns.get_mut(t) else { return 0 };
        if c.placed.is_none() || !c.role.state().is_established() {
            return 0;
        }
        let msg = msg_limit(c);
        c.lanes.append_last_send(user_data, |buf, (ops, pending_bytes), free| {
            // The last of `ops` pending operations waits beyond the free slots when there are
            // fewer of those: then the backlog's byte bound applies to what it grows by.
            let waits = ops > free;
            let backlog_room = waits.then(|| backlog_limit.saturating_sub(pending_bytes));
            let mut room = append_room(buf.len(), buf.capacity(), msg, backlog_room).min(limit);
            let mut took = 0;
            for b in bytes {
                if room == 0 {
                    break;
                }
                let n = buf.append(&b[..b.len().min(room)]);
                room -= n;
                took += n;
            }
            took
        })
    }
}

#[cfg(test)]
mod tests {
    use super::append_room;

    #[test]
    fn a_pending_message_grows_to_the_capacity_the_message_size_and_the_backlog() {
        assert_eq!(append_room(8192, 65536, Some(65536), None), 57344, "to the message size");
        assert_eq!(append_room(100, 4096, Some(65536), None), 3996, "to the buffer's capacity");
        assert_eq!(append_room(100, 65536, Some(1000), None), 900, "to the smaller message size");
        assert_eq!(append_room(100, 65536, None, None), 65436, "no size announced: the capacity");
        assert_eq!(append_room(65536, 65536, Some(65536), None), 0, "full");
        assert_eq!(append_room(2000, 65536, Some(1000), None), 0, "never negative");
        assert_eq!(append_room(100, 65536, Some(65536), Some(50)), 50, "waiting beyond the slots: the backlog");
        assert_eq!(append_room(100, 65536, Some(65536), Some(0)), 0, "the backlog is full");
    }
}
