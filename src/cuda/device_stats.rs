//! [`DeviceStats`]: what the consumer of a [`DeviceLoader`](super::DeviceLoader) received and waited
//! for, the copy stage's time and bytes, and the device pool.

use std::time::Duration;

use serde::Serialize;

use crate::loader::{LoaderStats, Verdict};
use crate::memory::{PoolStats, human_bytes, human_rate};

/// Figures of a [`DeviceLoader`](super::DeviceLoader).
#[derive(Clone, Debug, Serialize)]
pub struct DeviceStats {
    /// Device batches delivered to the consumer.
    pub batches: u64,
    /// Samples delivered.
    pub samples: u64,
    /// Samples of the device batches delivered that the transform skipped (bad images), as
    /// [`LoaderStats::skipped`] counts them for host batches.
    pub skipped: u64,
    /// Bytes of batch fields delivered (as collated on the host).
    pub bytes: u64,
    /// Time since the consumer's first call to `next`.
    pub elapsed: Duration,
    /// Time the consumer waited inside `next`.
    pub waited: Duration,
    /// Bytes copied host to device: the batch buffers' bytes in use; under the GPU decode,
    /// what the decode stage sends (metadata and labels, the workers' pixels, the JPEGs nvJPEG
    /// reads, descriptors), whose device time is the decode's (`decode_report`), not counted
    /// in `h2d_busy`.
    pub h2d_bytes: u64,
    /// Copies enqueued.
    pub h2d_copies: u64,
    /// Bytes of the copies whose device time is known (their events completed and were read).
    pub h2d_timed_bytes: u64,
    /// Device time of those copies: the union of the intervals between the events around each
    /// copy on the copy stream (time shared by queued copies counted once).
    pub h2d_busy: Duration,
    /// Copy-thread time spent enqueueing copies (taking a device buffer, recording events,
    /// the copy and conversion calls): with the host loader's `waited` (for host batches) and
    /// `copy_thread_blocked` (on a full queue to the consumer), where the copy thread's time went.
    pub copy_thread_enqueue: Duration,
    /// Copy-thread time blocked handing device batches to the consumer (the queue of `depth`
    /// batches was full: the consumer is the slower side).
    pub copy_thread_blocked: Duration,
    /// The device pool.
    pub device_pool: PoolStats,
    /// Device buffers of this loader leaked because their release could not be fenced (a
    /// driver error; see [`DevicePool::leaked`](super::DevicePool::leaked)). Zero unless the driver failed.
    pub device_leaked: u64,
    /// The host loader's figures, as seen by the copy thread (its `waited` is the copy thread's).
    pub loader: Option<LoaderStats>,
    /// The images are decoded on the GPU (the image pipeline's GPU decode; its figures are
    /// the loader's `decode_report`).
    pub gpu_decode: bool,
}

impl DeviceStats {
    /// Host-to-device bytes per second of copy-engine time (timed bytes over busy time).
    pub fn h2d_bytes_per_sec(&self) -> f64 {
        let s = self.h2d_busy.as_secs_f64();
        if s > 0.0 {
            self.h2d_timed_bytes as f64 / s
        } else {
            0.0
        }
    }

    /// Bytes delivered per second, end to end.
    pub fn bytes_per_sec(&self) -> f64 {
        let s = self.elapsed.as_secs_f64();
        if s > 0.0 { self.bytes as f64 / s } else { 0.0 }
    }

    /// The fraction of the consumer's time spent waiting for a batch (0 to 1).
    pub fn wait_fraction(&self) -> f64 {
        let e = self.elapsed.as_secs_f64();
        if e > 0.0 {
            (self.waited.as_secs_f64() / e).min(1.0)
        } else {
            0.0
        }
    }

    /// Whether the consumer waited, which stage bound the rate (the copy engine included), and
    /// what would help, in one line ([`Verdict::of_device`]); `None` until the host loader's
    /// figures are known.
    pub fn verdict(&self) -> Option<Verdict> {
        let host = self.loader.as_ref()?;
        let elapsed = self.elapsed.as_secs_f64().max(1e-9);
        let copy_busy = (self.h2d_busy.as_secs_f64() / elapsed).min(1.0);
        Some(Verdict::of_device(
            host,
            self.wait_fraction(),
            copy_busy,
            &host.cpus,
            self.gpu_decode,
        ))
    }
}

impl std::fmt::Display for DeviceStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{:<22} {} batches, {} in {:.3}s: {} end to end",
            "delivered to device",
            self.batches,
            human_bytes(self.bytes),
            self.elapsed.as_secs_f64(),
            human_rate(self.bytes_per_sec())
        )?;
        writeln!(
            f,
            "{:<22} {} copies, {}; copy engine busy {:.3}s: {}",
            "H2D",
            self.h2d_copies,
            human_bytes(self.h2d_bytes),
            self.h2d_busy.as_secs_f64(),
            human_rate(self.h2d_bytes_per_sec())
        )?;
        writeln!(
            f,
            "{:<22} enqueueing {:.3}s, blocked on the consumer {:.3}s",
            "copy thread",
            self.copy_thread_enqueue.as_secs_f64(),
            self.copy_thread_blocked.as_secs_f64()
        )?;
        writeln!(
            f,
            "{:<22} {:.3}s ({:.2}% of the consumer's time)",
            "consumer waited",
            self.waited.as_secs_f64(),
            100.0 * self.wait_fraction()
        )?;
        write!(f, "{:<22} {}", "device pool", self.device_pool)?;
        if self.device_leaked > 0 {
            write!(
                f,
                "\n{:<22} {} buffers (driver errors)",
                "device leaked", self.device_leaked
            )?;
        }
        if let Some(l) = &self.loader {
            write!(f, "\n{l}")?;
        }
        Ok(())
    }
}
