//! The defaults that depend on the machine and the batch: workers, parts, batches in flight,
//! ragged fields' budgets, the rank from the environment, and the machine's memory that
//! budgets are checked against.

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
}
