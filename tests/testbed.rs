//! The test bed itself: an RDMA device is there, and the rdma_cm event channel opens
//! non-blocking and close-on-exec, through the library's own API.
//!
//! These need an RDMA device, so they are ignored by a plain `cargo test`; `cargo xtask test`
//! runs them in the Soft-RoCE VM (device `rxe0`), or on a host with a real device (set
//! `RDMA_DEV` to its name there).

use std::os::fd::{AsFd, AsRawFd};

use nix::fcntl::{fcntl, FcntlArg, FdFlag, OFlag};
use rdma_reactor::sys::cm::EventChannel;
use rdma_reactor::{PortState, Reactor};

/// The device the test bed provides: `$RDMA_DEV`, else the VM's `rxe0`.
fn expected_device() -> String {
    std::env::var("RDMA_DEV").unwrap_or_else(|_| "rxe0".to_string())
}

#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn lists_the_rdma_device_with_an_active_port() {
    let devices = rdma_reactor::devices().expect("list RDMA devices");
    let want = expected_device();
    let dev = devices.iter().find(|d| d.name == want);
    let dev = dev.unwrap_or_else(|| panic!("RDMA device {want} not found; devices: {devices:?}"));
    assert!(dev.max_qp > 0 && dev.max_cqe > 0, "{dev:?}");
    assert!(dev.ports.iter().any(|p| p.state == PortState::Active), "no active port: {dev:?}");
}

#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn the_rdma_cm_event_channel_is_nonblocking_and_cloexec() {
    let chan = EventChannel::new().expect("rdma_create_event_channel");
    let fd = chan.as_fd();
    assert!(fd.as_raw_fd() >= 0, "the event channel has no fd ({fd:?})");
    let fl = OFlag::from_bits_retain(fcntl(fd, FcntlArg::F_GETFL).expect("F_GETFL"));
    assert!(fl.contains(OFlag::O_NONBLOCK), "O_NONBLOCK is not set: {fl:?}");
    let fdfl = FdFlag::from_bits_retain(fcntl(fd, FcntlArg::F_GETFD).expect("F_GETFD"));
    assert!(fdfl.contains(FdFlag::FD_CLOEXEC), "FD_CLOEXEC is not set: {fdfl:?}");
    // No event is pending on a fresh channel: EAGAIN is "no event", not an error.
    assert!(chan.get_event().expect("get_event").is_none());
    // A reactor opens its own channel the same way.
    drop(Reactor::new().expect("reactor"));
}
