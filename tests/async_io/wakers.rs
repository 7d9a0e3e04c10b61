//! A task's waker called from another thread.

use super::*;

/// A value another thread sets, and the waker it wakes then.
#[derive(Default)]
struct Slot {
    value: Option<u64>,
    waker: Option<std::task::Waker>,
}

/// Resolves with the value another thread puts in the slot.
struct FromThread(Arc<std::sync::Mutex<Slot>>);

impl Future for FromThread {
    type Output = u64;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<u64> {
        let mut s = self.0.lock().unwrap();
        match s.value {
            Some(v) => Poll::Ready(v),
            None => {
                s.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

/// A task's waker called from another thread while the reactor sleeps in `epoll_wait`: the
/// wake goes through the reactor's inbox and eventfd, and the task runs on the reactor's
/// thread; `block_on`'s own future likewise.
#[test]
#[ignore = "needs an RDMA device: cargo xtask test"]
fn a_waker_called_from_another_thread_wakes_the_task_on_the_reactor() {
    let _w = Watchdog::new("cross-thread wake", LIMIT);
    let mut r = Reactor::new().expect("reactor");
    let me = std::thread::current().id();
    let (task_slot, main_slot) =
        (Arc::new(std::sync::Mutex::new(Slot::default())), Arc::new(std::sync::Mutex::new(Slot::default())));
    let ts = task_slot.clone();
    let task = r.spawn(async move {
        let v = FromThread(ts).await;
        (v, std::thread::current().id())
    });
    let setter = {
        let (t, m) = (task_slot.clone(), main_slot.clone());
        std::thread::spawn(move || {
            for (slot, v) in [(t, 7), (m, 11)] {
                std::thread::sleep(Duration::from_millis(200));
                let w = {
                    let mut s = slot.lock().unwrap();
                    s.value = Some(v);
                    s.waker.take()
                };
                w.expect("the future is waiting").wake();
            }
        })
    };
    let started = Instant::now();
    let (from_task, from_main) = r
        .block_on(async move {
            let t = task.await.expect("no panic");
            let m = FromThread(main_slot).await;
            (t, m)
        })
        .expect("block_on");
    setter.join().expect("setter");
    println!(
        "woken from another thread: task {:?}, block_on's future {from_main}, after {:?}",
        from_task,
        started.elapsed()
    );
    assert_eq!(from_task, (7, me), "the task ran on the reactor's thread with the value");
    assert_eq!(from_main, 11);
    assert_eq!(r.tasks(), 0);
}
