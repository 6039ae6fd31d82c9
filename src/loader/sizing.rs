//! The defaults that depend on the machine and the batch: workers, parts, batches in flight,
//! ragged fields' budgets, the rank from the environment, and the machine's memory that
//! budgets are checked against.

use serde::Serialize;

use crate::error::{Error, Result};

/// Bytes of batches the default prefetch aims to keep in flight when batches are small.
const PREFETCH_BYTES: u64 = 64 << 20;

/// The default number of batches in flight for batches of `batch_bytes` made in `parts` parts
/// (see [`default_parts`]), when an epoch has `batches` batches (for this rank).
///
/// Whole batches: one per worker plus two ready, so that every worker is busy; more for small
/// batches (up to 4 per worker, about 64 MiB), so that per-batch costs downstream (a channel, a
/// device copy) overlap. Batches in parts: enough for twice as many parts as workers, plus two
/// ready. Large batches get no more than they need: every buffer of the budget is pinned memory
/// that a first epoch must allocate. Never more than the
/// epoch's `batches` (at least one): a small data set has no more to make ahead.
pub fn default_prefetch(workers: usize, batch_bytes: u64, parts: usize, batches: u64) -> usize {
    let per_epoch = usize::try_from(batches).unwrap_or(usize::MAX).max(1);
    if parts > 1 {
        return (2 * workers.div_ceil(parts) + 2).min(per_epoch);
    }
    let by_bytes = usize::try_from(PREFETCH_BYTES.div_ceil(batch_bytes.max(1))).unwrap_or(1);
    by_bytes.min(4 * workers).max(workers + 2).min(per_epoch)
}

/// The default number of worker threads: one per CPU (the available parallelism), at most 16;
/// when the batches go to a GPU (`feeds_device`), two CPUs fewer (at least one), for the copy
/// thread and the training loop: with every CPU busy writing batches, the copy thread waits
/// for a CPU between copies, and small rows reach the GPU measurably slower
/// (`benches/RESULTS.md`).
pub fn default_workers(feeds_device: bool) -> usize {
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
    let cpus = if feeds_device {
        cpus.saturating_sub(2).max(1)
    } else {
        cpus
    };
    cpus.min(16)
}

/// Batches at least this large are made in parts by default.
const PARTS_FROM_BYTES: u64 = 4 << 20;

/// The default number of parts a batch is made in: one per worker for batches of 4 MiB or
/// more, else one (a small batch is made by one worker in about the time it takes to hand it
/// around).
pub fn default_parts(workers: usize, batch_bytes: u64) -> usize {
    if batch_bytes >= PARTS_FROM_BYTES {
        workers.max(1)
    } else {
        1
    }
}

/// Byte budgets of ragged fields are multiples of this, and at least this.
const RAGGED_BUDGET_ROUND: u64 = 64 << 10;

/// The default byte budget of a ragged field's values in a batch of `batch_size` samples whose
/// sizes (in bytes) have this `mean` and standard deviation `std_dev` (over the samples
/// measured), the largest being `max`: twice the mean batch, or the mean batch plus eight
/// standard deviations of a batch's total, whichever is more, plus the largest sample seen,
/// rounded up to 64 KiB (at least 64 KiB).
///
/// A batch is copied to a device as far as its values go, so room not used costs pinned
/// memory, not copies; a batch that does not fit is an error (never a truncated batch), so
/// the default leaves room for batches far above the mean: sizes that spread widely (text,
/// whose lengths vary tenfold) get several times the mean batch, tight ones (JPEGs of one
/// camera) about twice.
pub fn default_ragged_budget(batch_size: usize, mean: f64, std_dev: f64, max: u64) -> u64 {
    let n = batch_size.max(1) as f64;
    let batch = n * mean.max(0.0);
    let spread = n.sqrt() * std_dev.max(0.0);
    let bytes = (2.0 * batch).max(batch + 8.0 * spread) + max as f64;
    let bytes = if bytes.is_finite() && bytes < u64::MAX as f64 {
        bytes.ceil() as u64
    } else {
        u64::MAX
    };
    bytes
        .max(1)
        .checked_next_multiple_of(RAGGED_BUDGET_ROUND)
        .unwrap_or(u64::MAX)
}

/// The most worker threads a loader starts: more is a mistake, not a configuration.
pub const MAX_WORKERS: usize = 1024;

/// This machine's physical memory in bytes, where the platform says (Linux: `/proc/meminfo`).
pub(super) fn physical_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Reads the rank and world size from torchrun's `RANK`/`WORLD_SIZE`, else Slurm's
/// `SLURM_PROCID`/`SLURM_NTASKS`; rank 0 of 1 if neither pair is set. Only one variable of a
/// pair, or one that is not a whole number, is an error naming the variable.
pub fn rank_from_env() -> Result<(u64, u64)> {
    let read = |name: &'static str| -> Result<Option<u64>> {
        match std::env::var(name) {
            Ok(v) => v.trim().parse().map(Some).map_err(|_| {
                Error::config(
                    name,
                    format!("environment variable {name}={v:?} is not a whole number"),
                )
            }),
            Err(_) => Ok(None),
        }
    };
    for (rank, world) in [("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")] {
        match (read(rank)?, read(world)?) {
            (Some(r), Some(w)) => return Ok((r, w)),
            (None, None) => {}
            _ => {
                return Err(Error::config(
                    "shard",
                    format!(
                        "only one of {rank} and {world} is set; set both, or give the rank and world size explicitly"
                    ),
                ));
            }
        }
    }
    Ok((0, 1))
}

/// The CPUs a loader's workers may use: those this thread may run on (its affinity), within
/// the CPU quota of its cgroup, less those the GPU path keeps for the copy thread and the
/// training loop (see [`default_workers`]).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CpuBudget {
    /// CPUs in this thread's affinity mask (`sched_getaffinity`, from `/proc`), or the
    /// available parallelism where that cannot be read.
    pub affinity: usize,
    /// The cgroup's CPU quota in CPUs (`cpu.max`, or `cpu.cfs_quota_us` / `cpu.cfs_period_us`),
    /// if it has one.
    pub quota: Option<f64>,
    /// CPUs kept for the copy thread and the consumer (2 on the GPU path, else 0).
    pub reserved: usize,
    /// What is left for workers (at least 1, at most [`MAX_AUTO_WORKERS`]).
    pub budget: usize,
}

/// The most workers [`Setting::Auto`](super::Setting::Auto) starts.
pub const MAX_AUTO_WORKERS: usize = 64;

impl CpuBudget {
    /// This machine's budget, for a loader whose batches go to a GPU (`feeds_device`) or not.
    pub fn of_this_thread(feeds_device: bool) -> CpuBudget {
        let affinity = affinity_cpus()
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        let quota = cgroup_quota();
        CpuBudget::from_parts(affinity, quota, feeds_device)
    }

    /// The budget of `affinity` CPUs within a quota of `quota` CPUs (whole CPUs of it, at
    /// least one), less 2 on the GPU path.
    pub fn from_parts(affinity: usize, quota: Option<f64>, feeds_device: bool) -> CpuBudget {
        let usable = match quota {
            Some(q) if q.is_finite() && q > 0.0 => affinity.min((q.floor() as usize).max(1)),
            _ => affinity,
        };
        let reserved = if feeds_device { 2 } else { 0 };
        CpuBudget {
            affinity,
            quota,
            reserved,
            budget: usable.saturating_sub(reserved).clamp(1, MAX_AUTO_WORKERS),
        }
    }
}

impl std::fmt::Display for CpuBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "affinity {}", self.affinity)?;
        match self.quota {
            Some(q) => write!(f, ", cgroup quota {q:.2}")?,
            None => write!(f, ", no cgroup quota")?,
        }
        if self.reserved > 0 {
            write!(
                f,
                ", {} kept for the copy thread and the consumer",
                self.reserved
            )?;
        }
        Ok(())
    }
}

/// CPUs this thread may run on: the `Cpus_allowed_list` of `/proc/thread-self/status`.
fn affinity_cpus() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/thread-self/status")
        .or_else(|_| std::fs::read_to_string("/proc/self/status"))
        .ok()?;
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?;
    cpu_list_len(list.trim())
}

/// The number of CPUs in a list such as `0-3,8,10-11`.
fn cpu_list_len(list: &str) -> Option<usize> {
    let mut n = 0usize;
    for range in list.split(',').filter(|r| !r.is_empty()) {
        let (a, b) = match range.split_once('-') {
            Some((a, b)) => (
                a.trim().parse::<usize>().ok()?,
                b.trim().parse::<usize>().ok()?,
            ),
            None => {
                let a = range.trim().parse::<usize>().ok()?;
                (a, a)
            }
        };
        n += b.checked_sub(a)? + 1;
    }
    (n > 0).then_some(n)
}

/// The CPU quota of this process's cgroup, in CPUs: cgroup v2's `cpu.max` (the lowest of its
/// cgroup and their parents'), else cgroup v1's `cpu.cfs_quota_us / cpu.cfs_period_us`. `None`
/// without a quota.
fn cgroup_quota() -> Option<f64> {
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let v2 = cgroups.lines().find_map(|l| l.strip_prefix("0::"));
    let mut lowest: Option<f64> = None;
    if let Some(path) = v2 {
        let mut dir = std::path::PathBuf::from("/sys/fs/cgroup");
        dir.push(path.trim().trim_start_matches('/'));
        for d in dir
            .ancestors()
            .take_while(|d| d.starts_with("/sys/fs/cgroup"))
        {
            if let Some(q) = std::fs::read_to_string(d.join("cpu.max"))
                .ok()
                .and_then(|t| cpu_max(&t))
            {
                lowest = Some(lowest.map_or(q, |l| l.min(q)));
            }
        }
    }
    if lowest.is_none() {
        let read = |f: &str| -> Option<f64> {
            std::fs::read_to_string(format!("/sys/fs/cgroup/cpu/{f}"))
                .ok()?
                .trim()
                .parse()
                .ok()
        };
        if let (Some(quota), Some(period)) = (read("cpu.cfs_quota_us"), read("cpu.cfs_period_us"))
            && quota > 0.0
            && period > 0.0
        {
            lowest = Some(quota / period);
        }
    }
    lowest
}

/// The quota of a cgroup v2 `cpu.max` (`"max 100000"`: none; `"150000 100000"`: 1.5 CPUs).
fn cpu_max(text: &str) -> Option<f64> {
    let mut words = text.split_whitespace();
    let quota: f64 = words.next()?.parse().ok()?;
    let period: f64 = words.next().unwrap_or("100000").parse().ok()?;
    (quota > 0.0 && period > 0.0).then(|| quota / period)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ragged_budgets_leave_room_above_the_mean_batch() {
        // Tight sizes: twice the mean batch, plus the largest sample, in 64 KiB.
        let b = default_ragged_budget(128, 110_000.0, 10_000.0, 150_000);
        assert_eq!(
            b,
            (2 * 128 * 110_000 + 150_000u64).next_multiple_of(64 << 10)
        );
        // Wide sizes: the mean batch plus eight standard deviations of a batch's total.
        let b = default_ragged_budget(16, 1_000.0, 3_000.0, 40_000);
        assert_eq!(
            b,
            (16_000 + 8 * 4 * 3_000 + 40_000u64).next_multiple_of(64 << 10)
        );
        // Empty samples still get room; absurd sizes do not overflow.
        assert_eq!(default_ragged_budget(8, 0.0, 0.0, 0), 64 << 10);
        assert_eq!(default_ragged_budget(8, f64::MAX, 0.0, u64::MAX), u64::MAX);
    }

    #[test]
    fn cpu_lists_and_quotas_are_read_as_the_kernel_writes_them() {
        assert_eq!(cpu_list_len("0-1"), Some(2));
        assert_eq!(cpu_list_len("0-3,8,10-11"), Some(7));
        assert_eq!(cpu_list_len("5"), Some(1));
        assert_eq!(cpu_list_len(""), None);
        assert_eq!(cpu_list_len("3-1"), None);
        assert_eq!(cpu_max("max 100000\n"), None);
        assert_eq!(cpu_max("150000 100000\n"), Some(1.5));
        assert_eq!(cpu_max("garbage"), None);
    }

    #[test]
    fn the_budget_is_the_affinity_within_the_quota_less_the_gpu_path_reserve() {
        assert_eq!(CpuBudget::from_parts(16, None, false).budget, 16);
        assert_eq!(CpuBudget::from_parts(16, None, true).budget, 14);
        assert_eq!(CpuBudget::from_parts(16, Some(4.5), false).budget, 4);
        assert_eq!(CpuBudget::from_parts(2, Some(8.0), true).budget, 1);
        assert_eq!(CpuBudget::from_parts(2, Some(0.5), false).budget, 1);
        assert_eq!(CpuBudget::from_parts(512, None, false).budget, 64);
    }
}
