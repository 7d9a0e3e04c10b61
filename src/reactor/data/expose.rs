//! Exposing pool memory to one connection's peer (`Conn::expose`).
//!
//! Each exposure is a type-2 memory window over exactly the buffer's bytes, bound to the
//! connection's queue pair by an `IBV_WR_BIND_MW` request queued on its send queue like any
//! operation. The send queue is FIFO, so the bind goes to the device before anything submitted
//! after `expose` (the message that tells the peer the descriptor, typically): by the time the
//! peer can know the rkey, the window is bound. The bind's operation entry holds the window
//! until the bind completes or is cancelled; the connection releases its windows when it is
//! destroyed (`ConnEntry::windows`), just before its queue pair: in rxe a bound window holds
//! its queue pair, whose destruction would otherwise wait for it.

use crate::error::{Error, Result};
use crate::proto::op::RemoteAccess;
use crate::proto::token::{ConnKey, Key};
use crate::reactor::data::lanes::Slot;
use crate::reactor::Core;
use crate::sys::pool::{Buf, Exposed, Exposure, RegionWindow};
use crate::sys::region::{Region, RegionSlice};
#[cfg(feature = "bench-internals")]
use {
    crate::reactor::data::op::OpEntry,
    crate::reactor::data::send_queue::Planned,
    crate::sys::qp::{SendOp, SendWr},
};

impl Core {
    /// See [`Conn::expose`](crate::reactor::Conn::expose).
    pub(crate) fn expose(&mut self, t: ConnKey, buf: Buf, access: RemoteAccess) -> Result<Exposed> {
        let (d, how) = self.exposable(t)?;
        if !self.devices[d].pool.owns(&buf) {
            return Err(Error::Config("the buffer belongs to another device's pool".into()));
        }
        // What it exposes is this connection's; the rest of the chunk is foreign to it.
        buf.set_owner(self.conns.get(t).expect("checked").mem_owner, buf.len());
        let (exposed, window) = Exposed::new(buf, access, how)?;
        self.queue_bind(t, &window);
        Ok(exposed)
    }

    /// See [`Conn::expose_region`](crate::reactor::Conn::expose_region).
    pub(crate) fn expose_region(
        &mut self,
        t: ConnKey,
        slice: &RegionSlice,
        access: RemoteAccess,
    ) -> Result<RegionWindow> {
        let (d, how) = self.exposable(t)?;
        let pd = self.devices[d].pd.clone();
        let (exposed, window) = RegionWindow::new(slice, &pd, access, how)?;
        self.queue_bind(t, &window);
        Ok(exposed)
    }

    /// See [`Conn::register_region`](crate::reactor::Conn::register_region).
    pub(crate) fn register_region(&mut self, t: ConnKey, region: &Region) -> Result<()> {
        let d = self.placed_device(t)?;
        region.lkey(&self.devices[d].pd).map(|_| ())
    }

    /// The device of a connection that can take an exposure now, and how it exposes: by a
    /// memory window, or on a device without them (iWARP) by a registration when
    /// `Config::exposure_registration` allows it. Refused otherwise, saying why.
    fn exposable(&self, t: ConnKey) -> Result<(usize, Exposure)> {
        let Some(c) = self.conns.get(t) else { return Err(Error::StaleToken(t.token().as_u64())) };
        let Some(placed) = c.placed.filter(|_| c.can_submit()) else {
            return Err(Error::NotConnected(format!("connection {:?} is {:?}", t.token(), c.role.state())));
        };
        let caps = self.devices[placed.device].caps;
        if caps.windows() {
            return Ok((placed.device, Exposure::Window));
        }
        if self.cfg.exposure_registration {
            return Ok((placed.device, Exposure::Registration));
        }
        Err(Error::Unsupported(format!(
            "exposing memory: the connection's device ({} transport) has no memory windows (max_mw 0), which \
             confine a remote key to one connection; set Config::exposure_registration to register each \
             exposure instead, whose key any connection of this reactor on the device could use while it lives",
            caps.transport.name()
        )))
    }

    /// Queues a window's bind on the connection's send queue (FIFO: before anything submitted
    /// after it) and lists the window with the connection, which releases it when destroyed.
    /// An exposure by registration has nothing to bind: it is only listed.
    fn queue_bind(&mut self, t: ConnKey, window: &std::rc::Rc<crate::sys::pool::Window>) {
        let c = self.conns.get_mut(t).expect("checked by the caller");
        c.windows.add(window);
        if window.bind().is_none() {
            return;
        }
        c.lanes.submit_send(Slot::bind(window.clone()));
        self.mark_dirty(t);
    }
}

/// The work request of a planned window bind of the operation slab (the host benchmark's
/// `SlabPath`, the data path before issue 47).
#[cfg(feature = "bench-internals")]
pub(in crate::reactor) fn bind_wr(op: &OpEntry, w: &Planned) -> SendWr {
    // A connection releases its windows only when it is destroyed, and a destroyed connection
    // posts nothing more: a bind is never planned without its memory window.
    let bind = op.bind_wr().expect("a queued bind's memory window exists");
    SendWr {
        wr_id: w.op.token().as_u64(),
        op: SendOp::Bind(bind),
        addr: 0,
        len: 0,
        lkey: 0,
        signaled: w.signaled,
        inline: false,
        tail: None,
    }
}
