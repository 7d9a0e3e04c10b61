//! The test bed itself: an RDMA device is there, with an active port, through the library's
//! public API. (That the rdma_cm event channel opens non-blocking and close-on-exec is checked
//! inside the crate, `sys::cm`'s tests, which `cargo xtask test` also runs in the VM.)
//!
//! These need an RDMA device, so they are ignored by a plain `cargo test`; `cargo xtask test`
//! runs them in the Soft-RoCE VM (device `rxe0`), or on a host with a real device (set
//! `RDMA_DEV` to its name there).

use rdma_reactor::PortState;

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

/// "No RDMA device" is an error a user can act on. Runs everywhere: on a machine without the
/// RDMA stack (a plain `cargo test` here) `Reactor::new` fails with `Error::NoDevice` saying
/// what is missing and how to get a device; where `/dev/infiniband/rdma_cm` exists (the VM) it
/// succeeds.
#[test]
fn without_an_rdma_stack_the_error_says_what_is_missing() {
    let stack = std::path::Path::new("/dev/infiniband/rdma_cm").exists();
    match (stack, rdma_reactor::Reactor::new()) {
        (true, r) => assert!(r.is_ok(), "the RDMA stack is there: {:?}", r.err()),
        (false, Ok(_)) => panic!("a reactor without /dev/infiniband/rdma_cm"),
        (false, Err(e)) => {
            let text = e.to_string();
            assert!(matches!(e, rdma_reactor::Error::NoDevice(_)), "{e:?}");
            for needle in ["no RDMA device", "/dev/infiniband/rdma_cm", "rdma link", "modprobe rdma_rxe"] {
                assert!(text.contains(needle), "{needle:?} missing from: {text}");
            }
        }
    }
}
