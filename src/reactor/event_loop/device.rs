//! Devices: their resources (PD, registered pool, completion channel, shared CQ, shared
//! receive queue), their asynchronous events, and their loss.
//!
//! A device's resources are created when the first listener or connection binds to it. Its
//! completion channel and asynchronous-event fd are in the epoll set, both non-blocking.
//!
//! **Asynchronous events** are read until `EAGAIN`, acked at once (what they name is copied
//! out first), and each becomes the close of exactly the connections it affects:
//! - a queue pair's error (QP_FATAL, QP_REQ_ERR, QP_ACCESS_ERR, PATH_MIG_ERR): that
//!   connection, as a `Fault` (it disconnects and drains like a work error);
//! - CQ_ERR: every connection on that CQ, as an `Abort` (its completions are lost, so nothing
//!   is waited for), and the CQ is never polled again;
//! - PORT_ERR and PORT_ACTIVE: reported to the listeners on the device (`on_error`), nothing
//!   closed: a connection on the port fails through its own unacknowledged requests (RC
//!   retries, `Config::keepalive`) if the outage lasts, and survives a short one. (Closing
//!   them at once would send their DREQs through the downed port, which on rxe, Linux 6.1,
//!   leaves rdma_cm unable to connect on the device until it is recreated.) While the port
//!   is down, keepalive probes wait: a probe through a downed port fails at once and would
//!   tear its connection down in the outage, with the same effect.
//! - SRQ_ERR: every connection on the device's shared receive queue, as an `Abort`, and the SRQ
//!   is not used again; SRQ_LIMIT_REACHED is counted, and the limit armed again once a posting
//!   refilled the SRQ to its mark (`data/srq/mod.rs`);
//! - DEVICE_FATAL: every connection on the device, as an `Abort`, and the device is lost.
//!
//! The rest (PORT_ACTIVE, COMM_EST, ...) are counted and otherwise ignored.
//!
//! A device's event fd belongs to its context, which librdmacm opens once per process: with
//! several reactors in one process, the one that reads an event acts on it and, unless it
//! named a queue pair, CQ or SRQ of the reader's own (which no other reactor has), passes a copy
//! to the others through their inboxes (`Core::share_async`, `remote.rs`), which act on it as
//! if they had read it (`Stats::shared_async_events`); an event naming a queue pair or CQ a
//! reactor does not have is counted there (`Stats::stale_async_events`). Objects are matched
//! by address, never by a context value that another reactor could also have issued. A copy
//! arrives after the reader acked the event, so for a queue pair or CQ the address names the
//! object only as long as its owner has not destroyed it (and reused the address for a new
//! one) in between: a window of one tick of the owner, in which a stray fault of a new queue
//! pair at the same address is possible in theory. Port and device events have no such
//! window.
//!
//! **A lost device** (DEVICE_REMOVAL on any of its ids, DEVICE_FATAL, or an error reading one
//! of its fds, which a disassociated device reports as `EIO` on every read) leaves the epoll
//! set at once, so a dead fd cannot wake the loop; its connections and listeners close with
//! the reason the user sees. Once none is left (end of a tick), its resources are destroyed
//! in order: the shared CQ, then the shared receive queue and its buffers, the pool's regions,
//! the completion channel and the PD, in the same tick as its last rdma_cm ids.
//!
//! **The context outlives everything on it.** librdmacm (which owns the context) closes a
//! removed device's context when its list, synchronised with the kernel's, no longer has the
//! device and no reference is left: its ids' and those of the lists `rdma_get_devices` hands
//! out, not PDs, regions or CQs. So the device's PD and completion channel each hold a
//! `DeviceHold` (an rdma_cm id of its own bound to the device, `sys/device.rs`) as their last
//! field: the
//! context stays open until the last object on it is destroyed, whichever reactor
//! synchronises the list and whenever a user's `Buf` (which holds its region and PD) is
//! dropped. The reactor asks for the synchronisation until the device has left libibverbs'
//! list; the last hold's release then closes the context. The kernel's removal waits for that
//! close on drivers without disassociation (rxe up to at least Linux 6.1): a buffer of the
//! device's pool kept by the application holds the removal until it is dropped. librdmacm
//! skips the synchronisation while no device at all is left, so with a single device the
//! removal completes only when the process exits. A device that comes back is a new entry;
//! indexes are never reused.

use std::rc::Rc;
use std::time::Duration;

use nix::sys::epoll::{EpollEvent, EpollFlags};

use crate::error::{Error, Result};
use crate::proto::conn::{AsyncEventKind, CloseReason, Input};
use crate::proto::token::{ConnKey, CqKey, Kind, ListenerKey, Token};
use crate::proto::transport::{Caps, KEY_PLUG_CQ_ENTRIES};
use crate::reactor::data::{srq, tail};
use crate::reactor::event_loop::timers::TimerTarget;
use crate::reactor::{os, ConnEntry, Core, ListenerEntry};
use crate::sys::cq::CompChannel;
use crate::sys::cq::Cq;
use crate::sys::device::{self, AsyncElement, DeviceHold, DeviceRef};
use crate::sys::pd::Pd;
use crate::sys::pool::Pool;

/// How often a lost device's release is retried, and for how long.
const RELEASE_EVERY: Duration = Duration::from_millis(50);
const RELEASE_TRIES: u32 = 400;

/// The devices in use, and the lost ones on their way out.
#[derive(Default)]
pub(in crate::reactor) struct Devices {
    /// By index. An index is never reused: a released device leaves `None`.
    list: Vec<Option<Device>>,
    /// Lost devices whose resources are not released yet.
    pub(in crate::reactor) lost: Vec<usize>,
    /// Released devices librdmacm has not closed yet: (identity, tries).
    pub(in crate::reactor) forgetting: Vec<(usize, u32)>,
    /// Failed shared CQs, destroyed once no connection uses them.
    pub(in crate::reactor) retired_cqs: Vec<CqKey>,
}

impl Devices {
    pub(in crate::reactor) fn get(&self, d: usize) -> Option<&Device> {
        self.list.get(d).and_then(Option::as_ref)
    }

    pub(in crate::reactor) fn get_mut(&mut self, d: usize) -> Option<&mut Device> {
        self.list.get_mut(d).and_then(Option::as_mut)
    }

    /// The live devices.
    pub(in crate::reactor) fn iter(&self) -> impl Iterator<Item = &Device> {
        self.list.iter().flatten()
    }

    /// Device indexes issued so far (released ones included).
    pub(in crate::reactor) fn slots(&self) -> usize {
        self.list.len()
    }

    /// Live devices.
    pub(in crate::reactor) fn len(&self) -> usize {
        self.iter().count()
    }

    /// The index of `dev`'s entry, if it has one that is not lost.
    fn find(&self, dev: DeviceRef) -> Option<usize> {
        self.list.iter().position(|d| d.as_ref().is_some_and(|d| d.dev == dev && !d.lost))
    }

    /// The index of `dev`'s entry, lost or not.
    pub(in crate::reactor) fn index_of(&self, dev: DeviceRef) -> Option<usize> {
        self.list.iter().position(|d| d.as_ref().is_some_and(|d| d.dev == dev))
    }
}

impl std::ops::Index<usize> for Devices {
    type Output = Device;

    fn index(&self, d: usize) -> &Device {
        self.get(d).expect("a device outlives its connections and CQs")
    }
}

impl std::ops::IndexMut<usize> for Devices {
    fn index_mut(&mut self, d: usize) -> &mut Device {
        self.get_mut(d).expect("a device outlives its connections and CQs")
    }
}

impl Core {
    /// The index of the device's resources, created on first use; `addr` is an address of the
    /// device (the local address of the id that uses it), for its `DeviceHold`.
    pub(in crate::reactor) fn device(&mut self, dev: DeviceRef, addr: Option<std::net::SocketAddr>) -> Result<usize> {
        if let Some(i) = self.devices.find(dev) {
            return Ok(i);
        }
        if self.devices.index_of(dev).is_some() {
            return Err(Error::NoDevice("the RDMA device was removed".into()));
        }
        let addr = addr.ok_or_else(|| Error::NoDevice("the id on the device has no local address".into()))?;
        let caps = dev.caps().map_err(|e| Error::verb("ibv_query_device", "the device's transport and limits", e))?;
        let hold = DeviceHold::new(dev, addr)
            .map_err(|e| Error::verb("rdma_bind_addr", format!("a reference on the device's context ({addr})"), e))?;
        let pd = Pd::new(dev, &hold).map_err(|e| Error::verb("ibv_alloc_pd", "", e))?;
        let chan = CompChannel::new(dev, &hold).map_err(|e| Error::verb("ibv_create_comp_channel", "", e))?;
        dev.set_async_nonblocking().map_err(|e| Error::verb("fcntl", "the device's async event fd", e))?;
        // Before any queue of this process's on the device (`Caps::key_plug`).
        let key_plug = if caps.key_plug() {
            let cq = Cq::new(dev, &chan, KEY_PLUG_CQ_ENTRIES, 0, 1)
                .map_err(|e| Error::verb("ibv_create_cq", "Soft-iWARP's mmap-key plug (Caps::key_plug)", e))?;
            Some(cq)
        } else {
            None
        };
        let pool = Pool::new(&pd, &self.cfg.device_pool(), caps.overhead() as usize)?;
        let tails = if caps.tail() { Some(tail::ring_pool(&pd, &self.cfg)?) } else { None };
        let index = self.devices.list.len();
        let token = Token::new(Kind::CompChannel, index as u32, 1);
        self.epoll.add(&*chan, EpollEvent::new(EpollFlags::EPOLLIN, token.as_u64())).map_err(os("epoll_ctl"))?;
        let token = Token::new(Kind::Device, index as u32, 1);
        if let Err(e) = self.epoll.add(dev.async_fd(), EpollEvent::new(EpollFlags::EPOLLIN, token.as_u64())) {
            let _ = self.epoll.delete(&*chan);
            return Err(os("epoll_ctl")(e));
        }
        self.devices.list.push(Some(Device {
            dev,
            identity: dev.identity(),
            armed: 0,
            shared_cq: None,
            lost: false,
            port_down: false,
            caps,
            _key_plug: key_plug,
            tails,
            srq: None,
            pool,
            chan,
            pd,
        }));
        if let Err(e) = self.create_srq(index) {
            // As for the shared CQ below: not usable as configured.
            self.unregister(index);
            self.devices.list[index] = None;
            return Err(e);
        }
        if let Some(entries) = self.cfg.shared_cq {
            match self.new_cq(index, entries, true) {
                Ok(ct) => self.devices[index].shared_cq = Some(ct),
                Err(e) => {
                    // Without its shared CQ the device is not usable as configured: forget it,
                    // so the next connection tries again (and fails the same way) rather than
                    // getting a CQ of its own.
                    self.unregister(index);
                    self.devices.list[index] = None;
                    return Err(e);
                }
            }
        }
        Ok(index)
    }

    /// What device `dev` adapts to: as its resources recorded it, or asked now (InfiniBand's
    /// when the device cannot say).
    pub(in crate::reactor) fn caps_of(&self, dev: DeviceRef) -> Caps {
        match self.devices.find(dev) {
            Some(d) => self.devices[d].caps,
            None => dev.caps().unwrap_or(Caps::infiniband()),
        }
    }

    /// The connections on device `d`: placed there, or, before they have a queue pair, with
    /// an id bound to it.
    fn conns_on_device(&self, d: usize) -> Vec<ConnKey> {
        let Some(devref) = self.devices.get(d).map(|x| x.dev) else { return Vec::new() };
        let on = |c: &ConnEntry| match c.placed {
            Some(p) => p.device == d,
            None => c.ep.id().and_then(|id| id.device()) == Some(devref),
        };
        self.conns.iter().filter(|(_, c)| on(c)).map(|(k, _)| k).collect()
    }

    /// The listeners whose id is bound to device `d`.
    fn listeners_on_device(&self, d: usize) -> Vec<ListenerKey> {
        let Some(devref) = self.devices.get(d).map(|x| x.dev) else { return Vec::new() };
        let on = |l: &ListenerEntry| l.id.as_ref().and_then(|id| id.device()) == Some(devref);
        self.listeners.iter().filter(|(_, l)| on(l)).map(|(k, _)| k).collect()
    }

    /// Takes a device's fds out of the epoll set.
    fn unregister(&mut self, d: usize) {
        if let Some(dev) = self.devices.get(d) {
            let _ = self.epoll.delete(&*dev.chan);
            let _ = self.epoll.delete(dev.dev.async_fd());
        }
    }

    /// Reads device `d`'s asynchronous events until none is pending; each is acked, then
    /// turned into the close of what it affects (module docs).
    pub(in crate::reactor) fn drain_async(&mut self, d: usize) -> usize {
        let Some(dev) = self.devices.get(d).filter(|x| !x.lost).map(|x| x.dev) else { return 0 };
        let mut n = 0;
        loop {
            let ev = match dev.get_async_event() {
                Ok(Some(ev)) => ev,
                Ok(None) => break,
                Err(e) if e.raw_os_error() == Some(nix::libc::EINTR) => continue,
                Err(_) => {
                    // EIO: the device was disassociated; nothing more will come.
                    self.device_lost(d, CloseReason::DeviceRemoval);
                    break;
                }
            };
            let (kind, element) = (ev.kind, ev.element);
            // Acked before anything it names can be destroyed (that happens at the end of
            // the tick at the earliest).
            drop(ev);
            n += 1;
            self.stats.async_events += 1;
            event!(
                warn,
                "device {}: asynchronous event {kind} ({element:?})",
                self.devices.get(d).map_or_else(String::new, |x| x.dev.name())
            );
            let ours = self.on_async(d, kind, element);
            // The fd is the process's, not this reactor's: the others hear it too, if it is a
            // kind anyone acts on (not COMM_EST, nor the LAST_WQE_REACHED a queue pair on an
            // SRQ raises as it closes, on devices other than rxe: those would wake every
            // reactor for nothing) and it does not name an object of this reactor's (which no
            // other reactor has).
            if !ours && target(kind, element).is_some() {
                self.share_async(dev.as_ptr() as usize, kind, element);
            }
        }
        n
    }

    /// Acts on one asynchronous event of device `d`, on what [`target`] says it concerns;
    /// the other kinds are only counted. True when it named a queue pair, CQ or SRQ of this
    /// reactor's: then it concerns no other reactor.
    pub(in crate::reactor) fn on_async(&mut self, d: usize, kind: AsyncEventKind, element: AsyncElement) -> bool {
        use AsyncEventKind as K;
        let Some(target) = target(kind, element) else { return false };
        let reason = CloseReason::AsyncEvent(kind);
        match target {
            Target::Qp(qp) => {
                let found = self.conns.iter().find(|(_, c)| c.ep.qp_identity() == Some(qp));
                let found = found.map(|(t, _)| t);
                match found {
                    Some(t) => {
                        // The request that broke the queue pair usually completed in error
                        // first, and that status says more than the event does (a wrong key,
                        // not just "fatal"). Its completion may sit unread in the CQ when the
                        // epoll wait returned both fds: reap it first, so the close names it
                        // whatever order the fds are read in (siw raises the event at once).
                        let (cq, on_srq) = self.conns.get(t).map_or((None, None), |c| c.cqs());
                        self.reap_conn_cqs(cq, on_srq);
                        if self.conns.contains(t) {
                            self.feed(t, Input::Fault(reason));
                        }
                        return true;
                    }
                    None => self.stats.stale_async_events += 1,
                }
            }
            Target::Cq(cq) => {
                let found = self.cqs.iter().find(|(_, e)| e.cq.identity() == cq).map(|(ct, _)| ct);
                match found {
                    Some(ct) => {
                        self.fail_cq(ct, reason);
                        return true;
                    }
                    None => self.stats.stale_async_events += 1,
                }
            }
            Target::Port(port) => {
                // Reported, not acted on: the port's connections fail through their own
                // unacknowledged requests (RC retries, the keepalive) if the outage lasts,
                // and survive a short one. Closing them at once would send their DREQs
                // through the downed port, which leaves rdma_cm unable to connect on the
                // device afterwards on rxe (Linux 6.1; FAULTS.md, case 20).
                self.devices[d].port_down = kind == K::PortErr;
                let what = if kind == K::PortErr { "went down" } else { "is active again" };
                let text = format!("port {port} of the RDMA device {what} ({kind})");
                for t in self.listeners_on_device(d) {
                    self.with_listener(t, |h, ctx| h.on_error(ctx, &text));
                }
            }
            Target::Srq(srq) => return self.on_srq_event(d, kind, srq),
            Target::Device => self.device_lost(d, reason),
        }
        false
    }

    /// CQ `ct` cannot be used any more (overrun, or a poll or arm failed): every connection
    /// on it closes at once with `reason`, and it is never polled or armed again. A failed
    /// shared CQ is replaced for later connections and destroyed when its last one is gone.
    pub(in crate::reactor) fn fail_cq(&mut self, ct: CqKey, reason: CloseReason) {
        let Some(e) = self.cqs.get_mut(ct) else { return };
        if e.failed {
            return;
        }
        e.failed = true;
        let (d, shared) = (e.device, e.shared);
        if shared {
            if let Some(dev) = self.devices.get_mut(d) {
                if dev.shared_cq == Some(ct) {
                    dev.shared_cq = None;
                    self.devices.retired_cqs.push(ct);
                }
            }
        }
        let on_cq: Vec<ConnKey> =
            self.conns.iter().filter(|(_, c)| c.placed.is_some_and(|p| p.cq == ct)).map(|(k, _)| k).collect();
        for t in on_cq {
            self.feed(t, Input::Abort(reason.clone()));
        }
        if self.devices.get(d).and_then(|x| x.srq.as_ref()).is_some_and(|s| s.cq == ct) {
            // The SRQ's receive CQ: every connection on the SRQ receives through it.
            self.fail_srq(d, reason);
        }
    }

    /// Device `d` is gone or unusable: its fds leave the epoll set now, every connection and
    /// listener on it closes with `reason`, and its resources are released once nothing uses
    /// them (`release_lost_devices`).
    pub(in crate::reactor) fn device_lost(&mut self, d: usize, reason: CloseReason) {
        let Some(dev) = self.devices.get_mut(d) else { return };
        if dev.lost {
            return;
        }
        dev.lost = true;
        self.unregister(d);
        self.stats.devices_lost += 1;
        for t in self.conns_on_device(d) {
            self.feed(t, Input::Abort(reason.clone()));
        }
        for t in self.listeners_on_device(d) {
            self.close_listener(t, reason.clone());
        }
        self.devices.lost.push(d);
    }

    /// Destroys the resources of lost devices nothing uses any more (called at the end of a
    /// tick, after the closed connections and listeners were destroyed), then asks librdmacm
    /// to let go of their contexts (retried on a timer until the device has left the list).
    pub(in crate::reactor) fn release_lost_devices(&mut self) {
        let mut i = 0;
        while i < self.devices.lost.len() {
            let d = self.devices.lost[i];
            if self.devices.get(d).is_none() {
                self.devices.lost.swap_remove(i);
                continue;
            }
            let used = !self.conns_on_device(d).is_empty()
                || !self.listeners_on_device(d).is_empty()
                || self.cqs.iter().any(|(_, e)| e.device == d && !e.shared);
            if used {
                i += 1;
                continue;
            }
            self.devices.lost.swap_remove(i);
            let shared: Vec<CqKey> = self.cqs.iter().filter(|(_, e)| e.device == d).map(|(k, _)| k).collect();
            for ct in shared {
                self.devices.retired_cqs.retain(|r| *r != ct);
                self.remove_cq(ct);
            }
            let dev = self.devices.list[d].take().expect("checked above");
            let identity = dev.identity;
            // Pool regions, completion channel, PD, then librdmacm's reference (field order).
            drop(dev);
            self.stats.devices_released += 1;
            self.devices.forgetting.push((identity, 0));
            self.schedule_forget();
        }
    }

    fn schedule_forget(&mut self) {
        if let Some(at) = self.read_clock().checked_add(RELEASE_EVERY) {
            self.timers.schedule(at, TimerTarget::ForgetDevices);
        }
    }

    /// Asks librdmacm to synchronise its device list once a released device has left
    /// libibverbs' list, so it closes that device's context; retried for a while.
    pub(in crate::reactor) fn forget_devices(&mut self) {
        let mut sync = false;
        self.devices.forgetting.retain_mut(|(identity, tries)| {
            *tries += 1;
            if !device::device_listed(*identity) {
                sync = true;
                return false;
            }
            *tries < RELEASE_TRIES
        });
        if sync {
            device::forget_removed_devices();
        }
        if !self.devices.forgetting.is_empty() {
            self.schedule_forget();
        }
    }

    /// A shared CQ that failed and whose connections are all gone is destroyed.
    pub(in crate::reactor) fn reap_retired_cqs(&mut self) {
        if self.devices.retired_cqs.is_empty() {
            return;
        }
        let retired = std::mem::take(&mut self.devices.retired_cqs);
        for ct in retired {
            if self.conns.iter().any(|(_, c)| c.placed.is_some_and(|p| p.cq == ct)) {
                self.devices.retired_cqs.push(ct);
            } else {
                self.remove_cq(ct);
            }
        }
    }

    /// The shared CQ of device `d`, created again if the last one failed.
    pub(in crate::reactor) fn shared_cq(&mut self, d: usize, entries: u32) -> Result<CqKey> {
        if let Some(ct) = self.devices[d].shared_cq {
            return Ok(ct);
        }
        let ct = self.new_cq(d, entries, true)?;
        self.devices[d].shared_cq = Some(ct);
        Ok(ct)
    }
}

/// What a reactor acts on for an asynchronous event (`Core::on_async`); `None` for the kinds
/// it only counts (COMM_EST, LAST_WQE_REACHED, ...), which are not passed to other reactors
/// either.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Target {
    /// The connection of that queue pair (by address).
    Qp(usize),
    /// Every connection on that CQ (by address).
    Cq(usize),
    /// The listeners of the device, told of the port's state.
    Port(u8),
    /// That shared receive queue (by address).
    Srq(usize),
    /// Everything on the device.
    Device,
}

/// The one list of the asynchronous events a reactor acts on, and on what.
fn target(kind: AsyncEventKind, element: AsyncElement) -> Option<Target> {
    use AsyncEventKind as K;
    match (kind, element) {
        (K::QpFatal | K::QpReqErr | K::QpAccessErr | K::PathMigErr, AsyncElement::Qp(qp)) => Some(Target::Qp(qp)),
        (K::CqErr, AsyncElement::Cq(cq)) => Some(Target::Cq(cq)),
        (K::PortErr | K::PortActive, AsyncElement::Port(port)) => Some(Target::Port(port)),
        (K::SrqErr | K::SrqLimitReached, AsyncElement::Srq(srq)) => Some(Target::Srq(srq)),
        (K::DeviceFatal, _) => Some(Target::Device),
        _ => None,
    }
}

/// A device this reactor uses: its resources, and what the loop knows of it.
pub(in crate::reactor) struct Device {
    pub(in crate::reactor) dev: DeviceRef,
    /// The device in libibverbs' list (`DeviceRef::identity`), to tell when it has left it.
    pub(in crate::reactor) identity: usize,
    /// CQs of this device armed for an event: at most this many events can be pending on its
    /// channel.
    pub(in crate::reactor) armed: u32,
    /// The device's shared CQ, in `Config::shared_cq` mode.
    pub(in crate::reactor) shared_cq: Option<CqKey>,
    /// Removed or failed: out of the epoll set, released once nothing uses it (`device.rs`).
    pub(in crate::reactor) lost: bool,
    /// PORT_ERR seen and no PORT_ACTIVE since: keepalive probes wait (`device.rs`).
    pub(in crate::reactor) port_down: bool,
    /// Its transport and memory windows, asked once (`proto::transport`).
    pub(in crate::reactor) caps: Caps,
    /// On Soft-iWARP, the CQ that keeps every later queue's mmap key clear of the one its
    /// user library refuses (`Caps::key_plug`); never armed or polled.
    pub(in crate::reactor) _key_plug: Option<Rc<crate::sys::cq::Cq>>,
    /// On a device with tails, the connections' tail rings (`data/tail.rs`): one size class of
    /// ring-sized chunks, so thousands of connections share one registered cluster.
    pub(in crate::reactor) tails: Option<Pool>,
    // Field order is drop order: the SRQ (then the buffers posted to it), the pool's regions,
    // the channel, the PD.
    /// The shared receive queue, in `Config::srq` mode (`data/srq/mod.rs`).
    pub(in crate::reactor) srq: Option<srq::DevSrq>,
    pub(in crate::reactor) pool: Pool,
    pub(in crate::reactor) chan: Rc<CompChannel>,
    pub(in crate::reactor) pd: Rc<Pd>,
}
