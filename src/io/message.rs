//! What consumed one of a connection's receives, with its kind (review 2026-12-07, N8): a
//! peer's SEND (its bytes, an empty SEND included) or its RDMA WRITE with immediate data
//! (bytes placed in memory this side exposed; nothing in the receive's buffer). Before, both
//! reached an async reader as a buffer, and a WRITE with immediate data read as an empty
//! message, which a byte stream takes for the end of the stream.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::connection::Recv;
use crate::error::Result;
use crate::sys::pool::Buf;

/// One message of a connection, as [`Connection::recv_message`](super::Connection::recv_message)
/// hands it out.
#[derive(Debug)]
pub enum Message {
    /// A SEND of the peer's: its bytes, in the buffer they arrived in (an empty SEND is an
    /// empty buffer).
    Send(Buf),
    /// The peer's RDMA WRITE with immediate data ([`Op::write_imm`](crate::Op::write_imm)):
    /// `len` bytes were written into memory this side exposed to it, and the receive it
    /// consumed carries none of them (its buffer, empty, is `buf`).
    RemoteWrite {
        /// The bytes the peer wrote.
        len: u32,
        /// The receive's buffer, empty.
        buf: Buf,
    },
}

impl Message {
    /// The message of a receive's completion: `remote_write` as
    /// [`Completion::remote_write`](crate::Completion::remote_write) says, `n` its result.
    #[inline]
    pub(super) fn of(buf: Buf, remote_write: bool, n: u32) -> Message {
        if remote_write {
            Message::RemoteWrite { len: n, buf }
        } else {
            Message::Send(buf)
        }
    }

    /// The buffer (for a WRITE with immediate data, the receive's, empty).
    #[inline]
    pub fn into_buf(self) -> Buf {
        match self {
            Message::Send(b) | Message::RemoteWrite { buf: b, .. } => b,
        }
    }

    /// True for a peer's RDMA WRITE with immediate data.
    pub fn is_remote_write(&self) -> bool {
        matches!(self, Message::RemoteWrite { .. })
    }
}

/// [`Connection::recv_message`](super::Connection::recv_message)'s future: a place in the same
/// line as [`Recv`]'s, from the call on.
#[derive(Debug)]
pub struct RecvMessage {
    recv: Recv,
}

impl RecvMessage {
    pub(super) fn new(recv: Recv) -> RecvMessage {
        RecvMessage { recv }
    }
}

impl Future for RecvMessage {
    type Output = Result<Message>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.recv.poll_message(cx)
    }
}
