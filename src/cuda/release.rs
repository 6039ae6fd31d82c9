//! The release thread: where a device pool is dropped when the thread that lets go of it must not
//! wait.
//!
//! A pool's drop waits for the work still using its blocks (the pool's rule: no block is freed
//! under running work), then gives every block back with `cuMemFree`, which may wait for the
//! device too. When the last handle of a pool goes in a DLPack deleter (any thread, with or
//! without the GIL, in the middle of a training step), or with a loader dropped between epochs,
//! that wait must not fall on the thread that let go. So the last [`DevicePool`](super::DevicePool)
//! handle is handed to one thread of the process, started on first use, which drops it there.
//! [`settle`] waits until everything handed over so far has been dropped (tests, and a process
//! that wants its memory back now).

use std::sync::{Condvar, Mutex, OnceLock};

use crossbeam_channel::Sender;

/// Something to drop on the release thread.
type Job = Box<dyn Send>;

/// Jobs handed over and jobs dropped, under one lock so that [`settle`] can wait on them.
#[derive(Default)]
struct Counts {
    handed: u64,
    dropped: u64,
}

struct Releaser {
    /// `None` when the thread could not be started: then jobs are dropped where they are let go.
    tx: Option<Sender<Job>>,
    counts: Mutex<Counts>,
    done: Condvar,
}

fn releaser() -> &'static Releaser {
    static RELEASER: OnceLock<Releaser> = OnceLock::new();
    RELEASER.get_or_init(|| {
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let spawned = std::thread::Builder::new()
            .name("gpufeed-release".into())
            .spawn(move || {
                for job in rx {
                    // A panic in a drop must not end the thread (later jobs would never be
                    // dropped, and `settle` would wait forever): it leaks what it was dropping.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(job)));
                    let r = releaser();
                    r.lock().dropped += 1;
                    r.done.notify_all();
                }
            });
        Releaser {
            tx: spawned.ok().map(|_| tx),
            counts: Mutex::new(Counts::default()),
            done: Condvar::new(),
        }
    })
}

impl Releaser {
    fn lock(&self) -> std::sync::MutexGuard<'_, Counts> {
        self.counts.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Drops `job` on the release thread (or here, waiting, if that thread could not be started).
/// Never waits when the thread runs.
pub(crate) fn drop_later(job: Job) {
    let r = releaser();
    let Some(tx) = &r.tx else {
        drop(job);
        return;
    };
    r.lock().handed += 1;
    if let Err(back) = tx.send(job) {
        // The thread is gone (it never ends while the process runs, so this is unreachable in
        // practice): drop it here, and count it as dropped.
        drop(back.into_inner());
        r.lock().dropped += 1;
        r.done.notify_all();
    }
}

/// Waits (blocking) until every device pool let go of so far has been dropped: its blocks'
/// pending work waited for and its memory given back to the driver. Pools are dropped on a
/// thread of gpufeed's when their last handle (a loader, a batch, a buffer) goes, so that no
/// deleter or loop waits for the device; call this where the memory must be back now (a leak
/// check, before measuring free memory).
pub fn settle() {
    let r = releaser();
    let mut counts = r.lock();
    let target = counts.handed;
    while counts.dropped < target {
        counts = r.done.wait(counts).unwrap_or_else(|p| p.into_inner());
    }
}
