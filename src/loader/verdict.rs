//! The stall verdict: one line at the end of a run that says whether the consumer waited for
//! data, which stage bound the rate, and what setting would help.
//!
//! The rule, from a loader's figures ([`LoaderStats`]):
//!
//! 1. The consumer waited less than [`WAITED_LITTLE`] of its time: the loader kept up, the
//!    consumer is the bound (and with the workers mostly idle, fewer would do).
//! 2. Otherwise the workers' busy time decides: busy (fetching and transforming) at least
//!    [`BUSY`] of their time, the rate is theirs: fetch-bound or transform-bound, whichever
//!    took more of it. Getting batch buffers for at least [`BUFFER_WAIT`] of it: mostly
//!    allocating them (the pool's first use of its memory, which later epochs reuse),
//!    allocation-bound, a start-up cost; else, when workers had to wait for a buffer to come
//!    back ([`PoolStats::waits`](crate::memory::PoolStats::waits)) and the consumer did more
//!    than wait (one that only waits holds no batch), buffer-bound (the pool's budget, or the
//!    batches the consumer holds). Else the workers sat idle while the consumer waited,
//!    prefetch-bound (too few batches in flight, or per-batch costs outside the workers).
//! 3. On the GPU path, before 2: the copy engine busy at least [`BUSY`] of the time is
//!    copy-bound.
//!
//! The thresholds are wide on purpose: a verdict is for a stage that bounds the rate clearly
//! (the tests make the slow stage ten times slower than the others), not for a close call.

use std::fmt;

use serde::Serialize;

use super::sizing::CpuBudget;
use super::stats::LoaderStats;

/// Below this fraction of its time waiting, the consumer is the bound.
pub const WAITED_LITTLE: f64 = 0.05;

/// Workers (or the copy engine) busy this fraction of the time bound the rate.
pub const BUSY: f64 = 0.75;

/// Workers waiting for batch buffers this fraction of their time are bound by the budget.
pub const BUFFER_WAIT: f64 = 0.25;

/// The stage that bounds a run's rate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Bound {
    /// The consumer: the loader kept up.
    Consumer,
    /// `Dataset::get`: reading the samples.
    Fetch,
    /// The per-sample transform (decode, augment, copy into the batch).
    Transform,
    /// Workers waiting for batch buffers: the pool's budget.
    Buffers,
    /// Workers allocating batch buffers: the pool's first use of its memory.
    Allocation,
    /// Workers idle while the consumer waited: too few batches in flight.
    Prefetch,
    /// The host-to-device copies (GPU path).
    Copy,
}

impl Bound {
    /// Its name in the verdict (`transform-bound`).
    pub fn name(self) -> &'static str {
        match self {
            Bound::Consumer => "consumer-bound",
            Bound::Fetch => "fetch-bound",
            Bound::Transform => "transform-bound",
            Bound::Buffers => "buffer-bound",
            Bound::Allocation => "allocation-bound",
            Bound::Prefetch => "prefetch-bound",
            Bound::Copy => "copy-bound",
        }
    }
}

/// Where a run's time went, in one line ([`LoaderStats::verdict`]); `Display` writes it:
/// `waited 31% of the time; transform-bound: 8 of 8 workers busy; more CPUs, or less work per
/// sample (GPU decode, for images), would help`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Verdict {
    /// The fraction of the consumer's time spent waiting for a batch.
    pub waited: f64,
    /// The stage that bound the rate.
    pub bound: Bound,
    /// Workers busy fetching and transforming, on average over the run.
    pub busy_workers: f64,
    /// Workers.
    pub workers: usize,
    /// The fraction of the run the copy engine was busy (GPU path).
    pub copy_busy: Option<f64>,
    /// What would help.
    pub help: String,
}

impl Verdict {
    /// The verdict of a host loader's figures, its consumer having waited `waited` of its
    /// time, with `cpus` for workers.
    pub fn of(stats: &LoaderStats, waited: f64, cpus: &CpuBudget) -> Verdict {
        let worker_time = (stats.elapsed.as_secs_f64() * stats.workers as f64).max(1e-9);
        let (fetch, transform, collate) = (
            stats.stages.fetch.as_secs_f64(),
            stats.stages.transform.as_secs_f64(),
            stats.stages.collate.as_secs_f64(),
        );
        let busy = ((fetch + transform) / worker_time).min(1.0);
        let workers = stats.workers;
        let more_cpus = workers < cpus.budget;
        let (bound, help) = if waited < WAITED_LITTLE {
            let help = if busy < 0.5 && workers > 1 {
                "nothing in the loader would help (fewer workers would do)"
            } else {
                "nothing in the loader would help"
            };
            (Bound::Consumer, help.to_owned())
        } else if busy >= BUSY {
            if fetch >= transform {
                let help = if more_cpus {
                    "more workers, or faster storage, would help"
                } else {
                    "more workers than CPUs (a fetch that waits for storage leaves its CPU \
                     idle), or faster storage, would help"
                };
                (Bound::Fetch, help.to_owned())
            } else {
                let help = if more_cpus {
                    "more workers, or less work per sample (GPU decode, for images), would help"
                } else {
                    "more CPUs, or less work per sample (GPU decode, for images), would help"
                };
                (Bound::Transform, help.to_owned())
            }
        } else if collate / worker_time >= BUFFER_WAIT
            && stats.pool.allocation_time.as_secs_f64() >= collate / 2.0
        {
            (
                Bound::Allocation,
                format!(
                    "{} of the workers' time went to allocating batch buffers, which later \
                     epochs reuse: a start-up cost that a longer run spreads",
                    percent(stats.pool.allocation_time.as_secs_f64() / worker_time)
                ),
            )
        } else if collate / worker_time >= BUFFER_WAIT
            && stats.pool.waits > 0
            && waited < 1.0 - WAITED_LITTLE
        {
            (
                Bound::Buffers,
                "a larger pool_budget (or fewer batches held by the consumer) would help"
                    .to_owned(),
            )
        } else {
            (
                Bound::Prefetch,
                "more prefetch, or larger batches (fewer per-batch costs), would help".to_owned(),
            )
        };
        Verdict {
            waited,
            bound,
            busy_workers: busy * workers as f64,
            workers,
            copy_busy: None,
            help,
        }
    }

    /// The verdict of a GPU run: the consumer of device batches waited `waited` of its time,
    /// the copy engine was busy `copy_busy` of it, and `host` are the host loader's figures
    /// (its consumer, the copy thread). With `gpu_decode` the images are decoded on the GPU
    /// already: busy workers then gather the JPEGs and decode the CPU's share of them.
    pub fn of_device(
        host: &LoaderStats,
        waited: f64,
        copy_busy: f64,
        cpus: &CpuBudget,
        gpu_decode: bool,
    ) -> Verdict {
        let mut v = Verdict::of(host, waited, cpus);
        v.copy_busy = Some(copy_busy);
        if gpu_decode && v.bound == Bound::Transform {
            v.help = if host.workers < cpus.budget {
                "more workers, or a smaller CPU share of the decode (ImageTransformBuilder::\
                 cpu_share, --decode-split), would help"
            } else {
                "a smaller CPU share of the decode (ImageTransformBuilder::cpu_share, \
                 --decode-split), or more CPUs, would help"
            }
            .to_owned();
        }
        if v.bound != Bound::Consumer && copy_busy >= BUSY {
            v.bound = Bound::Copy;
            v.help = "fewer bytes per sample (u8 on the host, converted on the GPU), or \
                      nothing: the copy engine is the ceiling"
                .to_owned();
        }
        v
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "waited {} of the time; {}: ",
            percent(self.waited),
            self.bound.name()
        )?;
        match (self.bound, self.copy_busy) {
            (Bound::Copy, Some(c)) => write!(f, "the copy engine busy {} of the time", percent(c))?,
            _ => write!(
                f,
                "{} of {} busy",
                workers(self.busy_workers),
                if self.workers == 1 {
                    "1 worker".to_owned()
                } else {
                    format!("{} workers", self.workers)
                }
            )?,
        }
        write!(f, "; {}", self.help)
    }
}

/// `31%`, `2.5%`, `0.3%`.
fn percent(fraction: f64) -> String {
    let p = 100.0 * fraction;
    if p >= 10.0 || p == 0.0 {
        format!("{p:.0}%")
    } else {
        format!("{p:.1}%")
    }
}

/// A number of workers: whole when it is nearly, else to a tenth (`8`, `1.4`).
fn workers(n: f64) -> String {
    if (n - n.round()).abs() < 0.05 {
        format!("{:.0}", n.round())
    } else {
        format!("{n:.1}")
    }
}

impl LoaderStats {
    /// Whether the consumer waited, which stage bound the rate, and what would help, in one
    /// line (see [`Verdict`]).
    pub fn verdict(&self) -> Verdict {
        Verdict::of(self, self.wait_fraction(), &self.cpus)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{Bound, Verdict};
    use crate::loader::{CpuBudget, LoaderStats, StageSnapshot};
    use crate::memory::PoolStats;

    fn stats(workers: usize, fetch: f64, transform: f64, collate: f64) -> LoaderStats {
        LoaderStats {
            batches: 100,
            samples: 100,
            skipped: 0,
            bytes: 100,
            elapsed: Duration::from_secs(10),
            waited: Duration::ZERO,
            first_batch: None,
            workers,
            in_flight: 0,
            ready: 0,
            stages: StageSnapshot {
                fetch: Duration::from_secs_f64(fetch),
                transform: Duration::from_secs_f64(transform),
                collate: Duration::from_secs_f64(collate),
                batches_made: 100,
            },
            pool: PoolStats::default(),
            tuning: None,
            cpus: CpuBudget::from_parts(workers, None, false),
        }
    }

    #[test]
    fn each_bound_is_named_with_what_would_help() {
        let cpus = CpuBudget::from_parts(8, None, false);
        let v = Verdict::of(&stats(8, 10.0, 70.0, 0.0), 0.31, &cpus);
        assert_eq!(v.bound, Bound::Transform);
        assert_eq!(
            v.to_string(),
            "waited 31% of the time; transform-bound: 8 of 8 workers busy; more CPUs, or less \
             work per sample (GPU decode, for images), would help"
        );
        let v = Verdict::of(&stats(4, 30.0, 9.0, 0.0), 0.5, &cpus);
        assert_eq!(v.bound, Bound::Fetch);
        assert!(
            v.to_string()
                .contains("3.9 of 4 workers busy; more workers"),
            "{v}"
        );
        let v = Verdict::of(&stats(2, 1.0, 1.0, 0.0), 0.02, &cpus);
        assert_eq!(v.bound, Bound::Consumer);
        assert!(v.to_string().contains("fewer workers would do"), "{v}");
        // Workers that waited for buffers to come back: the budget.
        let mut held = stats(2, 2.0, 2.0, 8.0);
        held.pool.waits = 12;
        let v = Verdict::of(&held, 0.4, &cpus);
        assert_eq!(v.bound, Bound::Buffers);
        assert!(v.to_string().contains("a larger pool_budget"), "{v}");
        let v = Verdict::of(&stats(2, 2.0, 2.0, 1.0), 0.4, &cpus);
        assert_eq!(v.bound, Bound::Prefetch);
        let v = Verdict::of_device(&stats(2, 2.0, 2.0, 1.0), 0.4, 0.97, &cpus, false);
        assert_eq!(v.bound, Bound::Copy);
        assert!(
            v.to_string()
                .contains("the copy engine busy 97% of the time"),
            "{v}"
        );
        // Decoding on the GPU already: the workers' share of the decode is what to change.
        let v = Verdict::of_device(&stats(4, 1.0, 39.0, 0.0), 0.6, 0.0, &cpus, true);
        assert_eq!(v.bound, Bound::Transform);
        let text = v.to_string();
        assert!(
            text.contains("more workers, or a smaller CPU share of the decode"),
            "{v}"
        );
        assert!(!text.contains("(GPU decode"), "{v}");
        let v = Verdict::of_device(&stats(8, 1.0, 79.0, 0.0), 0.6, 0.0, &cpus, true);
        assert!(v.to_string().contains("or more CPUs, would help"), "{v}");
    }

    #[test]
    fn a_consumer_that_only_waits_is_not_told_to_raise_the_budget() {
        // A consumer that does nothing but wait holds no batch: the workers' time getting
        // buffers went to allocating them (a first epoch), not to waiting for the budget.
        let cpus = CpuBudget::from_parts(2, None, false);
        let mut first = stats(2, 2.0, 2.0, 8.0);
        first.pool.allocation_time = Duration::from_secs_f64(7.5);
        first.pool.allocations = 6;
        let v = Verdict::of(&first, 0.98, &cpus);
        assert_eq!(v.bound, Bound::Allocation, "{v}");
        let text = v.to_string();
        assert!(text.contains("allocation-bound"), "{v}");
        assert!(
            text.contains("38% of the workers' time went to allocating batch buffers"),
            "{v}"
        );
        assert!(!text.contains("pool_budget"), "{v}");
        // Time getting buffers with little allocation: no budget either, waits or not.
        let mut waits = stats(2, 2.0, 2.0, 8.0);
        for n in [0, 3] {
            waits.pool.waits = n;
            let v = Verdict::of(&waits, 0.98, &cpus);
            assert_eq!(v.bound, Bound::Prefetch, "{v}");
            assert!(!v.to_string().contains("pool_budget"), "{v}");
        }
    }
}
