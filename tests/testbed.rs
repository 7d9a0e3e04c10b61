//! The test bed itself: an RDMA device and the rdma_cm event channel are there.
//!
//! These talk to `rdma_sys` directly; they will move onto the library's own API once it has one.
//! They need an RDMA device, so they are ignored by a plain `cargo test`; `cargo xtask test`
//! runs them in the Soft-RoCE VM (device `rxe0`), or on a host with a real device (set
//! `RDMA_DEV` to its name there).

use std::ffi::CStr;
use std::io;

/// The device the test bed provides: `$RDMA_DEV`, else the VM's `rxe0`.
fn expected_device() -> String {
    std::env::var("RDMA_DEV").unwrap_or_else(|_| "rxe0".to_string())
}

/// The names of the RDMA devices libibverbs sees.
fn device_names() -> io::Result<Vec<String>> {
    let mut num: libc::c_int = 0;
    // SAFETY: `num` is a valid out-pointer for the call's duration; the returned list is only
    // read below and freed exactly once.
    let list = unsafe { rdma_sys::ibv_get_device_list(&mut num) };
    if list.is_null() {
        return Err(io::Error::last_os_error());
    }
    let count = usize::try_from(num).unwrap_or(0);
    let mut names = Vec::with_capacity(count);
    for i in 0..count {
        // SAFETY: `list` holds `num` valid device pointers (then a NULL), alive until it is freed.
        let dev = unsafe { *list.add(i) };
        assert!(!dev.is_null(), "device {i} of {count} is NULL");
        // SAFETY: `dev` is a live device of the list; the name is a NUL-terminated string owned
        // by the device, copied out before the list is freed.
        let name = unsafe { CStr::from_ptr(rdma_sys::ibv_get_device_name(dev)) };
        names.push(name.to_string_lossy().into_owned());
    }
    // SAFETY: `list` came from ibv_get_device_list and is not used after this.
    unsafe { rdma_sys::ibv_free_device_list(list) };
    Ok(names)
}

#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn lists_the_rdma_device() {
    let names = device_names().expect("ibv_get_device_list failed");
    let want = expected_device();
    assert!(names.contains(&want), "RDMA device {want} not found; libibverbs lists {names:?}");
}

#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn opens_and_closes_the_rdma_cm_event_channel() {
    // SAFETY: no arguments; the result is checked for NULL before use.
    let channel = unsafe { rdma_sys::rdma_create_event_channel() };
    assert!(!channel.is_null(), "rdma_create_event_channel failed: {}", io::Error::last_os_error());
    // SAFETY: `channel` is non-NULL and points to the channel librdmacm just created.
    let fd = unsafe { (*channel).fd };
    assert!(fd >= 0, "the event channel has no fd ({fd})");
    // SAFETY: F_GETFD only queries the descriptor's flags.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    assert_ne!(flags, -1, "the event channel's fd {fd} is not open");
    // SAFETY: `channel` came from rdma_create_event_channel, has no ids, and is not used after.
    unsafe { rdma_sys::rdma_destroy_event_channel(channel) };
}
