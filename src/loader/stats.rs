//! What the loader measures: time per stage, time the consumer waited, queue depths, pool.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::BatchInfo;
use super::sizing::CpuBudget;
use super::tune::{Tuning, Work};
use crate::memory::{PoolStats, human_bytes, human_rate};
use crate::trace::{Args, Track};

/// What a loader delivered to its caller, and how long the caller waited for it: the figures
/// every loader's stats start from.
#[derive(Clone, Debug, Default)]
pub(crate) struct Delivered {
    /// When the caller first asked for a batch.
    started: Option<Instant>,
    /// Time the caller spent waiting for batches.
    pub waited: Duration,
    /// Batches, samples and bytes delivered (batches that are errors not counted).
    pub batches: u64,
    pub samples: u64,
    pub bytes: u64,
    /// Samples of the batches delivered that the transform skipped.
    pub skipped: u64,
    /// The consumer's track of the loader's trace, if it has one.
    pub timeline: Option<ConsumerTimeline>,
}

/// The consumer's track: its waits, and the time it holds each batch until it asks again.
#[derive(Clone)]
pub(crate) struct ConsumerTimeline {
    pub track: Track,
    /// The batch asked for.
    asking: Args,
    /// The batch delivered last, since when, until the next call.
    holding: Option<(Instant, Args)>,
}

impl std::fmt::Debug for ConsumerTimeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsumerTimeline").finish_non_exhaustive()
    }
}

impl ConsumerTimeline {
    /// The consumer's spans, on `track`.
    pub(crate) fn new(track: Track) -> ConsumerTimeline {
        ConsumerTimeline {
            track,
            asking: Args::EMPTY,
            holding: None,
        }
    }
}

impl Delivered {
    /// Nothing delivered yet; the consumer's spans on `timeline`, if any.
    pub(crate) fn recorded_on(timeline: Option<ConsumerTimeline>) -> Delivered {
        Delivered {
            timeline,
            ..Delivered::default()
        }
    }

    /// The caller called `next` again: the time since the last batch was delivered was its
    /// own (`holding`, on the timeline).
    pub(crate) fn called(&mut self) {
        if let Some(t) = &mut self.timeline
            && let Some((since, args)) = t.holding.take()
        {
            t.track.span("holding", since, Instant::now(), args);
        }
    }

    /// The caller asks for batch `batch` of epoch `epoch` (the clock of `elapsed` starts at
    /// the first).
    pub(crate) fn asked(&mut self, epoch: u64, batch: u64) {
        self.started.get_or_insert_with(Instant::now);
        if let Some(t) = &mut self.timeline {
            t.asking = Args::batch(epoch, batch);
        }
    }

    /// Runs `wait` (a wait for the next batch) and counts its time as waited.
    pub(crate) fn wait<T>(&mut self, wait: impl FnOnce() -> T) -> T {
        let t0 = Instant::now();
        let out = wait();
        let t1 = Instant::now();
        self.waited += t1 - t0;
        if let Some(t) = &self.timeline {
            t.track.span("waiting", t0, t1, t.asking);
        }
        out
    }

    /// The batch `info` describes, holding `bytes` bytes of data, was delivered.
    pub(crate) fn batch(&mut self, info: &BatchInfo, bytes: usize) {
        self.batches += 1;
        self.samples += info.len() as u64;
        self.skipped += info.skipped() as u64;
        self.bytes += bytes as u64;
        if let Some(t) = &mut self.timeline {
            t.holding = Some((Instant::now(), t.asking));
        }
    }

    /// Marks the start of epoch `epoch` on the timeline.
    pub(crate) fn epoch_starts(&self, epoch: u64) {
        if let Some(t) = &self.timeline {
            t.track.mark("epoch", Instant::now(), Args::epoch(epoch));
        }
    }

    /// Time since the caller first asked for a batch.
    pub(crate) fn elapsed(&self) -> Duration {
        self.started.map_or(Duration::ZERO, |s| s.elapsed())
    }
}

/// Time spent in each stage, summed over all workers.
#[derive(Debug, Default)]
pub struct StageTimes {
    fetch_ns: AtomicU64,
    transform_ns: AtomicU64,
    collate_ns: AtomicU64,
    batches: AtomicU64,
    /// Batches or parts written, and their samples.
    fills: AtomicU64,
    samples: AtomicU64,
}

impl StageTimes {
    /// A batch or part of `samples` samples was written, in `fetch_ns` and `transform_ns`.
    pub(crate) fn add_fetch_transform(&self, samples: usize, fetch_ns: u64, transform_ns: u64) {
        self.fetch_ns.fetch_add(fetch_ns, Ordering::Relaxed);
        self.transform_ns.fetch_add(transform_ns, Ordering::Relaxed);
        self.samples.fetch_add(samples as u64, Ordering::Relaxed);
        self.fills.fetch_add(1, Ordering::Relaxed);
    }

    /// The work counted so far (for the choice of workers: `tune.rs`).
    pub(crate) fn work(&self) -> Work {
        Work {
            fills: self.fills.load(Ordering::Relaxed),
            samples: self.samples.load(Ordering::Relaxed),
            busy_ns: self.fetch_ns.load(Ordering::Relaxed)
                + self.transform_ns.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn add_collate(&self, d: Duration) {
        self.collate_ns
            .fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    pub(crate) fn add_batch(&self) {
        self.batches.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> StageSnapshot {
        StageSnapshot {
            fetch: Duration::from_nanos(self.fetch_ns.load(Ordering::Relaxed)),
            transform: Duration::from_nanos(self.transform_ns.load(Ordering::Relaxed)),
            collate: Duration::from_nanos(self.collate_ns.load(Ordering::Relaxed)),
            batches_made: self.batches.load(Ordering::Relaxed),
        }
    }
}

/// Worker time per stage, summed over workers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StageSnapshot {
    /// `Dataset::get`: finding the sample in the mapping.
    pub fetch: Duration,
    /// The per-sample transform, which writes into the batch slot (decode, augment, copy).
    pub transform: Duration,
    /// Getting a batch buffer from the pool (waiting on the budget included) and the per-batch hook.
    pub collate: Duration,
    /// Batches the workers finished (discarded ones included).
    pub batches_made: u64,
}

/// A loader's figures; `Display` prints a table.
#[derive(Clone, Debug, Serialize)]
pub struct LoaderStats {
    /// Batches delivered.
    pub batches: u64,
    /// Samples delivered.
    pub samples: u64,
    /// Samples of the batches delivered that the transform skipped (the image pipeline's bad
    /// images, with `OnBadImage::Skip`): what [`BatchInfo::skipped`] of each says, summed.
    /// Batches made ahead and not delivered yet are not counted.
    pub skipped: u64,
    /// Bytes of batch fields delivered.
    pub bytes: u64,
    /// Time since the first call to `next`.
    pub elapsed: Duration,
    /// Time the consumer waited inside `next` for a batch.
    pub waited: Duration,
    /// Time from `build()` to the first batch delivered.
    pub first_batch: Option<Duration>,
    /// Worker threads.
    pub workers: usize,
    /// Batches dispatched and not delivered yet.
    pub in_flight: usize,
    /// Batches finished out of order, waiting for an earlier one.
    pub ready: usize,
    /// Worker time per stage.
    pub stages: StageSnapshot,
    /// The batch-buffer pool.
    pub pool: PoolStats,
    /// What the loader chose of the settings given as [`Auto`](super::Auto), and why; `None`
    /// when every setting was given or left to its default.
    pub tuning: Option<Tuning>,
    /// The CPUs the loader's workers may use.
    pub cpus: CpuBudget,
}

impl LoaderStats {
    /// The fraction of the consumer's time spent waiting for data (0 to 1).
    pub fn wait_fraction(&self) -> f64 {
        let e = self.elapsed.as_secs_f64();
        if e > 0.0 {
            (self.waited.as_secs_f64() / e).min(1.0)
        } else {
            0.0
        }
    }

    /// Samples delivered per second.
    pub fn samples_per_sec(&self) -> f64 {
        rate(self.samples, self.elapsed)
    }

    /// Bytes delivered per second.
    pub fn bytes_per_sec(&self) -> f64 {
        rate(self.bytes, self.elapsed)
    }
}

fn rate(n: u64, d: Duration) -> f64 {
    let s = d.as_secs_f64();
    if s > 0.0 { n as f64 / s } else { 0.0 }
}

impl fmt::Display for LoaderStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let worker_time = (self.elapsed.as_secs_f64() * self.workers as f64).max(1e-9);
        let share = |d: Duration| 100.0 * d.as_secs_f64() / worker_time;
        writeln!(f, "{:<22} {:>14} {:>14}", "stage", "time", "% of workers")?;
        for (name, d) in [
            ("fetch", self.stages.fetch),
            ("transform", self.stages.transform),
            ("collate", self.stages.collate),
        ] {
            writeln!(
                f,
                "{name:<22} {:>13.3}s {:>13.1}%",
                d.as_secs_f64(),
                share(d)
            )?;
        }
        writeln!(
            f,
            "{:<22} {:>13.3}s {:>13.1}%  (of the consumer's time)",
            "consumer waited",
            self.waited.as_secs_f64(),
            100.0 * self.wait_fraction()
        )?;
        writeln!(
            f,
            "{:<22} {} batches, {} samples, {} in {:.3}s: {:.0} samples/s, {}",
            "delivered",
            self.batches,
            self.samples,
            human_bytes(self.bytes),
            self.elapsed.as_secs_f64(),
            self.samples_per_sec(),
            human_rate(self.bytes_per_sec())
        )?;
        if self.skipped > 0 {
            writeln!(
                f,
                "{:<22} {} of the samples delivered (bad images)",
                "skipped", self.skipped
            )?;
        }
        if let Some(fb) = self.first_batch {
            writeln!(
                f,
                "{:<22} {:.2} ms after build",
                "first batch",
                fb.as_secs_f64() * 1e3
            )?;
        }
        writeln!(
            f,
            "{:<22} {} in flight, {} ready out of order",
            "queues", self.in_flight, self.ready
        )?;
        if let Some(t) = &self.tuning {
            writeln!(f, "{:<22} {}", "settings", t.reason)?;
        }
        write!(f, "{:<22} {}", "pool", self.pool)
    }
}
