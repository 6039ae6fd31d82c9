//! The loader: worker threads that share one dataset and collate batches into pooled buffers.
//!
//! [`Loader::builder`] takes a [`Dataset`] and PyTorch's vocabulary (`batch_size`, `shuffle`,
//! `workers`, `prefetch`, `drop_last`, `shard`); `build()` checks every setting, starts the
//! worker threads once, and the loader then yields the batches of one epoch, in order, as an
//! iterator of `Result<Batch>`. [`Loader::set_epoch`] starts another epoch on the same threads.
//! [`Loader::next_timeout`] waits for the next batch at most so long, for callers that must
//! look up now and then (a Python binding checking for Ctrl-C).
//!
//! How a batch is made (see `worker.rs`): the loader puts the batch's number on a task channel;
//! a free worker computes its sample indices from the [`Order`], takes a
//! buffer from the [`HostPool`] (waiting if the byte budget is used up: backpressure), and for
//! each sample calls [`Dataset::get`] (a view into the mapping) and the
//! [`SampleTransform`], which writes straight into the
//! sample's slot. The finished batch goes back on a bounded result channel; the loader puts
//! results back in order. At most `prefetch` batches are in flight. Large batches are made in
//! parts ([`LoaderBuilder::batch_parts`]): several workers write disjoint samples of one
//! buffer, and the last to finish hands the batch on.
//!
//! The budget: a loader makes at most as many batch buffers as its pool's byte budget holds
//! (see [`LoaderBuilder::pool_budget`]). Each batch dispatched takes a permit that travels with
//! it into the [`Batch`] and is given back when the batch drops, so batches in flight plus
//! batches the caller holds never exceed the budget, and a caller that holds all of them gets an
//! error naming the budget, before anything waits, without losing a batch.
//!
//! Position and resume: [`Loader::state`] is where the loader stands (the epoch and the number
//! of batches delivered in it); [`LoaderBuilder::resume`] or [`Loader::load_state`] puts a
//! loader back there, and the next batches are the rest of that epoch, as with torchdata's
//! `StatefulDataLoader`. A loop that calls [`Loader::set_epoch`] at the top of every epoch works
//! unchanged for fresh and resumed runs: the first `set_epoch` of the state's own epoch keeps
//! the position instead of starting the epoch over.
//!
//! Faults: an error or a panic in a transform for sample *i* makes that batch an `Err` naming
//! sample *i* and the batch; the loader stays usable and the next call yields the next batch.
//! Dropping the loader stops and joins every worker thread, also when they wait on a full
//! channel or an exhausted pool; a worker stuck in a call that does not return (a named pipe)
//! is left running after [`SHUTDOWN_WAIT`], detached and counted ([`detached_workers`]).

mod batch;
mod budget;
mod stats;
mod worker;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use serde::{Deserialize, Serialize};

pub use batch::{Batch, BatchInfo};
use stats::StageTimes;
pub use stats::{LoaderStats, StageSnapshot, steady_rate};

use crate::error::{Error, Result};
use crate::layout::BatchLayout;
use crate::memory::{Backing, HeapBacking, HostPool};
use crate::sampler::{BlockShuffle, Order, OrderSpec, Remainder};
use crate::source::Dataset;
use crate::transform::{CopyFields, SampleTransform};
use budget::BatchBudget;
use worker::{Assembly, Done, Shared, Task};

/// A hook run on each whole batch, in the worker, after its samples are written.
pub type BatchHook = Arc<dyn Fn(&mut Batch) -> Result<()> + Send + Sync>;

/// Where a loader's rank and world size come from.
#[derive(Clone, Copy, Debug)]
enum ShardChoice {
    /// Rank 0 of 1: the whole data set.
    Whole,
    /// Set by [`LoaderBuilder::shard`].
    Explicit(u64, u64),
    /// Read at `build()` by [`rank_from_env`].
    FromEnv,
}

/// Settings of a [`Loader`]; see [`Loader::builder`].
///
/// Every setting has a default (one sample per batch, sequential order, the available
/// parallelism's workers, [`CopyFields::all`]); [`build`](LoaderBuilder::build) checks them
/// all against the dataset and the machine, and starts the worker threads.
///
/// ```
/// # use gpufeed::{DType, Dataset};
/// # use gpufeed::source::{npy_header, Zip};
/// # fn data() -> gpufeed::Result<(tempfile::TempDir, Zip<gpufeed::NpyArray>)> {
/// #     let dir = tempfile::tempdir().map_err(gpufeed::Error::user)?;
/// #     let (x, y) = (dir.path().join("x.npy"), dir.path().join("y.npy"));
/// #     let mut b = npy_header(DType::F32, &[100, 4])?;
/// #     b.extend((0..400).flat_map(|i| (i as f32).to_le_bytes()));
/// #     std::fs::write(&x, b).map_err(gpufeed::Error::user)?;
/// #     let mut b = npy_header(DType::U32, &[100])?;
/// #     b.extend((0..100u32).flat_map(|i| (i % 10).to_le_bytes()));
/// #     std::fs::write(&y, b).map_err(gpufeed::Error::user)?;
/// #     let zip = Zip::npy([("x", &x), ("label", &y)])?;
/// #     Ok((dir, zip))
/// # }
/// # fn main() -> gpufeed::Result<()> {
/// # let (_dir, dataset) = data()?;
/// use gpufeed::{CopyFields, Loader};
///
/// // `dataset`: 100 samples of `x` (4 f32) and `label` (u32).
/// let loader = Loader::builder(dataset)
///     .batch_size(32)
///     .shuffle(42) // a seeded shuffle, different every epoch
///     .workers(2)
///     .drop_last(true)
///     .shard(0, 1) // rank 0 of 1 (`shard_from_env()` reads torchrun's or Slurm's)
///     .transform(CopyFields::named(["x"]))
///     .build()?;
/// assert_eq!(loader.batches_per_epoch(), 3);
/// # Ok(())
/// # }
/// ```
pub struct LoaderBuilder {
    dataset: Arc<dyn Dataset>,
    transform: Arc<dyn SampleTransform>,
    batch_hook: Option<BatchHook>,
    batch_size: usize,
    shuffle: Option<u64>,
    /// `None`: [`default_workers`] at build.
    workers: Option<usize>,
    /// The backing's blocks are copied to a device (see [`Backing::feeds_device`]).
    feeds_device: bool,
    prefetch: Option<usize>,
    parts: Option<usize>,
    drop_last: bool,
    evaluation: bool,
    blocks: Option<(u64, u64)>,
    shard: ShardChoice,
    epoch: u64,
    resume: Option<LoaderState>,
    budget: Option<u64>,
    across_epochs: bool,
    backing: Option<Box<dyn FnOnce(u64) -> HostPool + Send>>,
}

impl LoaderBuilder {
    /// Samples per batch (PyTorch's `batch_size`; default 1).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// Shuffles with this seed: a new order every epoch, the same for the same (seed, epoch).
    pub fn shuffle(mut self, seed: u64) -> Self {
        self.shuffle = Some(seed);
        self
    }

    /// Shuffles a sharded data set in two levels instead of globally: the order of shards,
    /// then blocks of `block` consecutive samples within windows of `window` consecutive
    /// shards (see [`BlockShuffle`]). For data streamed by shard: only a window's shards are
    /// needed at a time, read in runs. Needs [`shuffle`](Self::shuffle) and a data set that
    /// has shards ([`Dataset::shard_sizes`]).
    pub fn shuffle_blocks(mut self, window: u64, block: u64) -> Self {
        self.blocks = Some((window, block));
        self
    }

    /// Sequential order (the default).
    pub fn sequential(mut self) -> Self {
        self.shuffle = None;
        self
    }

    /// Worker threads (default: [`default_workers`]: one per CPU, at most 16, and two CPUs fewer
    /// when the batches go to a GPU).
    pub fn workers(mut self, n: usize) -> Self {
        self.workers = Some(n);
        self
    }

    /// Batches in flight, all workers together (default: one per worker plus two, more for
    /// small batches: about 64 MiB, at most four per worker; for batches made in parts (see
    /// [`batch_parts`](Self::batch_parts)), enough parts to keep every worker busy twice over,
    /// plus two batches; never more than an epoch has: [`default_prefetch`]).
    pub fn prefetch(mut self, n: usize) -> Self {
        self.prefetch = Some(n);
        self
    }

    /// Makes each batch in `n` parts, written by up to `n` workers at once (each its own
    /// samples; `1`: each batch by one worker). Default: batches of 4 MiB or more are made in
    /// as many parts as there are workers (at most one per sample), smaller ones whole.
    ///
    /// Parts trade nothing in throughput and cut what a large batch costs before it arrives:
    /// the first batch is made by every worker, not one, and fewer batches need to be in flight
    /// to keep the workers busy, so the pool (pinned memory, on the GPU path, that a first
    /// epoch must allocate) is smaller. A value larger than the batch size counts as the batch
    /// size.
    pub fn batch_parts(mut self, n: usize) -> Self {
        self.parts = Some(n);
        self
    }

    /// Drops the samples that do not fill a rank's share or a whole batch (default false: pad
    /// shards by wrapping around and deliver a short last batch). One flag covers both
    /// PyTorch's `DistributedSampler(drop_last)` and `DataLoader(drop_last)`.
    pub fn drop_last(mut self, yes: bool) -> Self {
        self.drop_last = yes;
        self
    }

    /// Evaluation mode (default false): every sample exactly once across ranks, and every rank
    /// still gets the same number of batches. A rank's share is padded with slots marked as
    /// padding ([`BatchInfo::padding`], [`BatchInfo::mask`]) instead of counting samples twice as
    /// PyTorch's `DistributedSampler` does. Cannot be combined with `drop_last`.
    pub fn evaluation(mut self, yes: bool) -> Self {
        self.evaluation = yes;
        self
    }

    /// Reads this rank's share only: samples `rank`, `rank + world`, ... of each epoch's order
    /// (PyTorch's `DistributedSampler`). Without it (or [`shard_from_env`](Self::shard_from_env))
    /// the loader reads the whole data set, also under torchrun: sharding is never implicit, so
    /// an evaluation loader does not silently see 1/world of the data.
    pub fn shard(mut self, rank: u64, world: u64) -> Self {
        self.shard = ShardChoice::Explicit(rank, world);
        self
    }

    /// Reads the rank and world size at `build()` from torchrun's `RANK` and `WORLD_SIZE`, else
    /// Slurm's `SLURM_PROCID` and `SLURM_NTASKS`, else rank 0 of 1 (see [`rank_from_env`]).
    pub fn shard_from_env(mut self) -> Self {
        self.shard = ShardChoice::FromEnv;
        self
    }

    /// The first epoch (default 0).
    pub fn epoch(mut self, epoch: u64) -> Self {
        self.epoch = epoch;
        self
    }

    /// Resumes from a [`LoaderState`]: the loader yields exactly the batches of that epoch not
    /// yet delivered, then goes on as usual. The settings that decide the order must match
    /// those of the state (`build()` checks). A first [`Loader::set_epoch`] of the state's
    /// epoch keeps this position (see the [module docs](self)).
    pub fn resume(mut self, state: LoaderState) -> Self {
        self.resume = Some(state);
        self
    }

    /// Makes the first batches of epoch + 1 while the end of an epoch is consumed (default
    /// true), so that [`Loader::set_epoch`]`(epoch + 1)` finds them ready.
    pub fn prefetch_across_epochs(mut self, yes: bool) -> Self {
        self.across_epochs = yes;
        self
    }

    /// The per-sample transform (default [`CopyFields::all`]).
    pub fn transform(mut self, t: impl SampleTransform) -> Self {
        self.transform = Arc::new(t);
        self
    }

    /// A hook run on each whole batch in the worker (normalisation, packing, ...).
    pub fn batch_hook(
        mut self,
        hook: impl Fn(&mut Batch) -> Result<()> + Send + Sync + 'static,
    ) -> Self {
        self.batch_hook = Some(Arc::new(hook));
        self
    }

    /// The byte budget of the batch-buffer pool (default: `prefetch + 2` batches: those in
    /// flight, and two held by the caller). Batches in flight plus batches the caller holds
    /// never exceed what the budget holds; the loader limits what it puts in flight instead.
    /// A caller that holds every batch the budget allows and asks for another gets an
    /// [`Error::InvalidConfig`] naming `pool_budget` (no batch is lost: drop one and ask
    /// again). `build()` refuses a budget larger than the machine's memory.
    pub fn pool_budget(mut self, bytes: u64) -> Self {
        self.budget = Some(bytes);
        self
    }

    /// Backs the batch buffers with `backing` (pinned memory, with the `cuda` feature).
    pub fn backing(mut self, backing: impl Backing<Addr = std::ptr::NonNull<u8>>) -> Self {
        self.feeds_device = backing.feeds_device();
        self.backing = Some(Box::new(move |budget| {
            HostPool::with_backing(backing, budget)
        }));
        self
    }

    /// Checks every setting, against the machine too (memory, threads), and starts the worker
    /// threads. Every fault is an [`Error::InvalidConfig`] naming the setting.
    pub fn build(self) -> Result<Loader> {
        let (rank, world) = match self.shard {
            ShardChoice::Whole => (0, 1),
            ShardChoice::Explicit(r, w) => (r, w),
            ShardChoice::FromEnv => rank_from_env()?,
        };
        let workers = self
            .workers
            .unwrap_or_else(|| default_workers(self.feeds_device));
        if workers == 0 {
            return Err(Error::config(
                "workers",
                "at least one worker thread is needed",
            ));
        }
        if workers > MAX_WORKERS {
            return Err(Error::config(
                "workers",
                format!(
                    "{} worker threads is more than the {MAX_WORKERS} a loader starts (this machine has {} CPUs)",
                    workers,
                    std::thread::available_parallelism().map_or(1, |n| n.get())
                ),
            ));
        }
        if self.parts == Some(0) {
            return Err(Error::config(
                "batch_parts",
                "a batch is made in at least one part",
            ));
        }
        if self.prefetch == Some(0) {
            return Err(Error::config(
                "prefetch",
                "at least one batch must be in flight",
            ));
        }
        let remainder = Remainder::of(self.drop_last, self.evaluation)?;
        let blocks = match self.blocks {
            None => None,
            Some(_) if self.shuffle.is_none() => {
                return Err(Error::config(
                    "shuffle_window",
                    "a two-level shuffle needs a seed: set shuffle too",
                ));
            }
            Some((window, block)) => {
                let Some(sizes) = self.dataset.shard_sizes() else {
                    return Err(Error::config(
                        "shuffle_window",
                        "this data set has no shards to shuffle in windows",
                    ));
                };
                Some(BlockShuffle::new(sizes, window, block)?)
            }
        };
        let spec = OrderSpec {
            len: self.dataset.len(),
            batch_size: self.batch_size as u64,
            shuffle: self.shuffle,
            rank,
            world,
            remainder,
            blocks,
        };
        spec.validate()?;
        // A batch holds no more than this rank gets in an epoch: buffers (and the pool) are
        // sized for the samples there are, not for a batch size beyond the data set.
        let capacity = usize::try_from(spec.batch_capacity()).unwrap_or(self.batch_size);
        let outputs = self.transform.output(self.dataset.schema())?;
        let layout = Arc::new(BatchLayout::new(outputs, capacity)?);
        let batch_bytes = HostPool::block_size(layout.total_bytes()) as u64;
        let parts = self
            .parts
            .unwrap_or_else(|| default_parts(workers, batch_bytes))
            .clamp(1, capacity.max(1));
        let prefetch = self
            .prefetch
            .unwrap_or_else(|| default_prefetch(workers, batch_bytes, parts, spec.batches()));
        let memory = physical_memory();
        if let Some(memory) = memory
            && batch_bytes > memory / 2
        {
            return Err(Error::config(
                "batch_size",
                format!(
                    "one batch of {capacity} samples takes {}, more than half this machine's memory ({})",
                    crate::memory::human_bytes(batch_bytes),
                    crate::memory::human_bytes(memory)
                ),
            ));
        }
        let budget = match self.budget {
            Some(b) => b,
            None => (prefetch as u64)
                .checked_add(2)
                .and_then(|n| n.checked_mul(batch_bytes))
                .unwrap_or(u64::MAX),
        };
        if budget < batch_bytes {
            return Err(Error::config(
                "pool_budget",
                format!("{budget} bytes cannot hold one batch of {batch_bytes} bytes"),
            ));
        }
        if let Some(memory) = memory
            && budget > memory
        {
            // Name what the user set: the budget, or the prefetch it was computed from.
            let (setting, why) = match self.budget {
                Some(_) => (
                    "pool_budget",
                    format!("a budget of {}", crate::memory::human_bytes(budget)),
                ),
                None => (
                    "prefetch",
                    format!(
                        "{prefetch} batches in flight (+2 held) of {} each",
                        crate::memory::human_bytes(batch_bytes)
                    ),
                ),
            };
            return Err(Error::config(
                setting,
                format!(
                    "{why} is more than this machine's memory ({})",
                    crate::memory::human_bytes(memory)
                ),
            ));
        }
        let budget_batches = usize::try_from(budget / batch_bytes).unwrap_or(usize::MAX);
        let (order, next, resumed) = match &self.resume {
            Some(state) => {
                let (order, next) = state.position(&spec)?;
                (order, next, true)
            }
            None => (spec.epoch(self.epoch), 0, false),
        };
        let read_ahead = self.dataset.read_ahead_batches();
        let pool = match self.backing {
            Some(make) => make(budget),
            None => HostPool::with_backing(HeapBacking, budget),
        };
        let shared = Arc::new(Shared {
            dataset: self.dataset,
            transform: self.transform,
            batch_hook: self.batch_hook,
            layout: Arc::clone(&layout),
            pool: pool.clone(),
            generation: AtomicU64::new(0),
            times: StageTimes::default(),
        });
        let (task_tx, task_rx) = crossbeam_channel::unbounded::<Task>();
        // Results in flight never exceed the permits; stale ones (skipped tasks) only make a
        // worker wait until the consumer drains them.
        let results = prefetch.min(budget_batches).saturating_add(workers);
        let (done_tx, done_rx) = crossbeam_channel::bounded::<Done>(results);
        let mut threads = Vec::with_capacity(workers);
        for w in 0..workers {
            let (shared, tasks, done) = (Arc::clone(&shared), task_rx.clone(), done_tx.clone());
            let handle = std::thread::Builder::new()
                .name(format!("gpufeed-worker-{w}"))
                .spawn(move || worker::run(&shared, &tasks, &done))
                .map_err(|e| Error::spawn("workers", format!("worker thread {w}"), e));
            match handle {
                Ok(h) => threads.push(h),
                Err(e) => {
                    // Stop the threads already started before reporting.
                    drop(task_tx);
                    for t in threads {
                        let _ = t.join();
                    }
                    return Err(e);
                }
            }
        }
        let mut loader = Loader {
            shared,
            spec,
            order,
            tasks: Some(task_tx),
            done: done_rx,
            threads,
            prefetch,
            parts,
            budget: BatchBudget::new(budget_batches),
            next_batch: next,
            next_dispatch: next,
            resumed,
            // Just opened: the first epoch needs no check.
            check_files: false,
            halt: None,
            read_ahead,
            announced: 0,
            scratch: Vec::new(),
            ready: BTreeMap::new(),
            ahead: None,
            ahead_dispatch: 0,
            speculate: self.across_epochs,
            built: Instant::now(),
            first_batch: None,
            started: None,
            waited: Duration::ZERO,
            delivered: 0,
            delivered_samples: 0,
            delivered_bytes: 0,
        };
        // Batches made in parts would each wait for their buffer (their parts take every
        // worker); one worker makes the budget's buffers ahead, in turn, while the others make
        // batches in the first ones.
        if parts > 1 {
            let generation = loader.shared.generation.load(Ordering::Acquire);
            // No more than an epoch has batches (a data set of one batch needs one buffer
            // ahead); the rest of the budget is made when it is used.
            let per_epoch = usize::try_from(loader.spec.batches()).unwrap_or(usize::MAX);
            loader.send(Task::Warm {
                generation,
                buffers: budget_batches.min(per_epoch.max(1)),
            })?;
        }
        // The workers start on the first batches now, while the caller sets up the rest of
        // its job: the first `next` finds them made or under way.
        loader.dispatch()?;
        Ok(loader)
    }
}

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

/// The most worker threads a loader starts: more is a mistake, not a configuration.
pub const MAX_WORKERS: usize = 1024;

/// This machine's physical memory in bytes, where the platform says (Linux: `/proc/meminfo`).
fn physical_memory() -> Option<u64> {
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

/// Where a loader stands: enough to resume after a crash with exactly the batches not yet
/// delivered. Small and serializable (serde).
///
/// `next_batch` counts the batches delivered in `epoch`, including those the caller still
/// holds: take the state after the step that used the last batch (as with torchdata's
/// `StatefulDataLoader`). At the end of an epoch, `next_batch` is the epoch's batch count.
///
/// A state resumes under another world size too (an elastic restart): the ranks of the new
/// run share the positions of the epoch that the old run had not reached, provided every
/// old rank had delivered the same number of batches (as data-parallel training does), and
/// batch numbers start again from 0 for the rest of that epoch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
///
/// A training loop that resumes: save the state with each checkpoint, build the loader with
/// [`resume`](LoaderBuilder::resume), and run the same loop from the state's epoch. Its
/// first `set_epoch` keeps the position, so the rest of that epoch comes next:
///
/// ```
/// # use gpufeed::{DType, Dataset};
/// # use gpufeed::source::{npy_header, Zip};
/// # fn data() -> gpufeed::Result<(tempfile::TempDir, Zip<gpufeed::NpyArray>)> {
/// #     let dir = tempfile::tempdir().map_err(gpufeed::Error::user)?;
/// #     let (x, y) = (dir.path().join("x.npy"), dir.path().join("y.npy"));
/// #     let mut b = npy_header(DType::F32, &[100, 4])?;
/// #     b.extend((0..400).flat_map(|i| (i as f32).to_le_bytes()));
/// #     std::fs::write(&x, b).map_err(gpufeed::Error::user)?;
/// #     let mut b = npy_header(DType::U32, &[100])?;
/// #     b.extend((0..100u32).flat_map(|i| (i % 10).to_le_bytes()));
/// #     std::fs::write(&y, b).map_err(gpufeed::Error::user)?;
/// #     let zip = Zip::npy([("x", &x), ("label", &y)])?;
/// #     Ok((dir, zip))
/// # }
/// # fn main() -> gpufeed::Result<()> {
/// # let (_dir, dataset) = data()?;
/// use std::sync::Arc;
/// use gpufeed::{Dataset, Loader, LoaderState};
///
/// let dataset: Arc<dyn Dataset> = Arc::new(dataset); // shared by both runs below
/// let loader = |resume: Option<LoaderState>| {
///     let builder = Loader::builder_shared(Arc::clone(&dataset)).batch_size(10).shuffle(3);
///     match resume {
///         Some(state) => builder.resume(state),
///         None => builder,
///     }
///     .build()
/// };
///
/// // A run that stops after 13 batches, the checkpoint written after the 13th step.
/// let (mut first, mut checkpoint, mut seen) = (loader(None)?, None, Vec::new());
/// 'run: for epoch in 0..3 {
///     first.set_epoch(epoch);
///     while let Some(batch) = first.next() {
///         seen.extend_from_slice(batch?.indices());
///         checkpoint = Some(serde_json::to_string(&first.state()).map_err(gpufeed::Error::user)?);
///         if seen.len() == 130 {
///             break 'run; // a crash
///         }
///     }
/// }
/// drop(first);
///
/// // The restart: the same loop, from the saved epoch.
/// let state: LoaderState = serde_json::from_str(&checkpoint.unwrap()).map_err(gpufeed::Error::user)?;
/// let (start, mut resumed) = (state.epoch, loader(Some(state))?);
/// for epoch in start..3 {
///     resumed.set_epoch(epoch);
///     for batch in resumed.by_ref() {
///         seen.extend_from_slice(batch?.indices());
///     }
/// }
/// // Every sample of every epoch exactly once: none repeated, none lost.
/// assert_eq!(seen.len(), 300);
/// for epoch in seen.chunks(100) {
///     let mut e = epoch.to_vec();
///     e.sort();
///     assert!(e.iter().copied().eq(0..100));
/// }
/// # Ok(())
/// # }
/// ```
pub struct LoaderState {
    /// The epoch.
    pub epoch: u64,
    /// The next batch to deliver in that epoch.
    pub next_batch: u64,
    /// Positions of the epoch consumed before this run's first batch of it (after an elastic
    /// restart; 0 otherwise).
    #[serde(default)]
    pub start: u64,
    /// The settings that decide the order; a resumed loader must have the same data, batch
    /// size, shuffle and remainder policy.
    pub order: OrderSpec,
}

impl LoaderState {
    /// The order and next batch that resume this state under `spec`.
    pub(crate) fn position(&self, spec: &OrderSpec) -> Result<(Order, u64)> {
        if !self.order.same_sequence(spec) {
            return Err(Error::mismatch(format!(
                "cannot resume: the state was saved with order settings {:?}, this loader has {:?}",
                self.order, spec
            )));
        }
        let saved = self.order.epoch_from(self.epoch, self.start);
        if self.next_batch > saved.batches() {
            return Err(Error::mismatch(format!(
                "cannot resume: the state's next batch {} is past the epoch's {} batches",
                self.next_batch,
                saved.batches()
            )));
        }
        if self.order.world == spec.world {
            return Ok((spec.epoch_from(self.epoch, self.start), self.next_batch));
        }
        // Another world size: every old rank took `next_batch` batches, that is the epoch's
        // positions `start .. start + next_batch * batch_size * world`.
        let consumed = self
            .next_batch
            .saturating_mul(self.order.batch_size)
            .saturating_mul(self.order.world);
        let start = self.start.saturating_add(consumed).min(spec.len);
        Ok((spec.epoch_from(self.epoch, start), 0))
    }
}

/// Yields the batches of one epoch, in order; see the [module docs](self).
///
/// An iterator of `Result<Batch>`: [`set_epoch`](Loader::set_epoch) at the top of each epoch
/// (a new shuffle), then take the epoch's batches. A failed batch is an `Err` naming the
/// sample at fault, and the loader goes on with the next one.
///
/// ```
/// # use gpufeed::{DType, Dataset};
/// # use gpufeed::source::{npy_header, Zip};
/// # fn data() -> gpufeed::Result<(tempfile::TempDir, Zip<gpufeed::NpyArray>)> {
/// #     let dir = tempfile::tempdir().map_err(gpufeed::Error::user)?;
/// #     let (x, y) = (dir.path().join("x.npy"), dir.path().join("y.npy"));
/// #     let mut b = npy_header(DType::F32, &[100, 4])?;
/// #     b.extend((0..400).flat_map(|i| (i as f32).to_le_bytes()));
/// #     std::fs::write(&x, b).map_err(gpufeed::Error::user)?;
/// #     let mut b = npy_header(DType::U32, &[100])?;
/// #     b.extend((0..100u32).flat_map(|i| (i % 10).to_le_bytes()));
/// #     std::fs::write(&y, b).map_err(gpufeed::Error::user)?;
/// #     let zip = Zip::npy([("x", &x), ("label", &y)])?;
/// #     Ok((dir, zip))
/// # }
/// # fn main() -> gpufeed::Result<()> {
/// # let (_dir, dataset) = data()?;
/// use gpufeed::Loader;
///
/// let mut loader = Loader::builder(dataset).batch_size(32).shuffle(7).workers(2).build()?;
/// for epoch in 0..2 {
///     loader.set_epoch(epoch);
///     let mut seen = 0;
///     for batch in loader.by_ref() {
///         let batch = batch?;
///         let x: &[f32] = batch.field("x")?; // [len, 4]
///         let labels: &[u32] = batch.field("label")?; // [len]
///         assert_eq!(x.len(), 4 * labels.len());
///         seen += batch.len();
///     }
///     assert_eq!(seen, 100); // the last batch is short: 4 samples
/// }
/// println!("{}", loader.stats()); // time per stage, time waited, pool figures
/// # Ok(())
/// # }
/// ```
pub struct Loader {
    shared: Arc<Shared>,
    spec: OrderSpec,
    order: Order,
    tasks: Option<Sender<Task>>,
    done: Receiver<Done>,
    threads: Vec<JoinHandle<()>>,
    prefetch: usize,
    /// Parts each batch is made in (1: whole).
    parts: usize,
    budget: Arc<BatchBudget>,
    next_batch: u64,
    next_dispatch: u64,
    /// Set by a resume or `load_state`, until the next batch or `set_epoch`: a `set_epoch` of
    /// the current epoch then keeps the position.
    resumed: bool,
    /// Check that the dataset's files are unchanged before the next batch (set at each
    /// epoch's start; see [`Dataset::check_unchanged`]).
    check_files: bool,
    /// Set when [`Iterator::next`] gave an error that leaves the position where it was (the
    /// files changed, the caller holds the whole budget, the threads are gone): until it is
    /// lifted the iterator ends, so that a `for` loop or `collect` stops instead of receiving
    /// the same error forever.
    halt: Option<Halt>,
    /// Batches ahead of those dispatched that the dataset wants announced (0: none).
    read_ahead: usize,
    /// The next batch of this epoch to announce.
    announced: u64,
    /// Indices of the batch being announced.
    scratch: Vec<u64>,
    /// Finished batches, by (epoch, number), waiting for their turn.
    ready: BTreeMap<(u64, u64), Result<Batch>>,
    /// The next epoch's order, once its batches are being made ahead of time.
    ahead: Option<Order>,
    /// Batches of `ahead` dispatched.
    ahead_dispatch: u64,
    speculate: bool,
    built: Instant,
    first_batch: Option<Duration>,
    started: Option<Instant>,
    waited: Duration,
    delivered: u64,
    delivered_samples: u64,
    delivered_bytes: u64,
}

impl std::fmt::Debug for Loader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loader")
            .field("order", &self.spec)
            .field("epoch", &self.order.epoch())
            .field("next_batch", &self.next_batch)
            .finish()
    }
}

impl Loader {
    /// A builder over `dataset`, with PyTorch's defaults (batch 1, sequential, no drop_last).
    pub fn builder(dataset: impl Dataset + 'static) -> LoaderBuilder {
        LoaderBuilder::from_arc(Arc::new(dataset))
    }

    /// The epoch being delivered.
    pub fn epoch(&self) -> u64 {
        self.order.epoch()
    }

    /// Batches in an epoch (for this rank).
    pub fn batches_per_epoch(&self) -> u64 {
        self.spec.batches()
    }

    /// Batches in flight at most (the `prefetch` setting, or its default).
    pub fn prefetch(&self) -> usize {
        self.prefetch
    }

    /// The parts each batch is made in (the `batch_parts` setting, or its default).
    pub fn batch_parts(&self) -> usize {
        self.parts
    }

    /// Batches the pool's budget holds: at most this many are in flight and in the caller's
    /// hands together (see [`LoaderBuilder::pool_budget`]).
    pub fn budget_batches(&self) -> usize {
        self.budget.total()
    }

    /// Batches delivered that the caller still holds. When it holds all
    /// [`budget_batches`](Self::budget_batches), the next batch is the `pool_budget` error.
    pub fn held_batches(&self) -> usize {
        self.budget.held()
    }

    /// The settings that decide the order.
    pub fn order_spec(&self) -> &OrderSpec {
        &self.spec
    }

    /// The layout of every batch.
    pub fn layout(&self) -> &BatchLayout {
        &self.shared.layout
    }

    /// Where the loader stands now: resuming from it yields the batches not yet delivered.
    pub fn state(&self) -> LoaderState {
        LoaderState {
            epoch: self.order.epoch(),
            next_batch: self.next_batch,
            start: self.order.start(),
            order: self.spec.clone(),
        }
    }

    /// Puts the loader where `state` says (torchdata's `load_state_dict`): the next batches are
    /// the rest of `state.epoch`. Batches in flight are discarded. Fails, changing nothing, if
    /// the state was saved with other order settings or is past its epoch's end.
    pub fn load_state(&mut self, state: LoaderState) -> Result<()> {
        let (order, next) = state.position(&self.spec)?;
        self.abandon();
        self.check_files = true;
        self.halt = None;
        self.order = order;
        self.next_batch = next;
        self.next_dispatch = next;
        self.resumed = true;
        Ok(())
    }

    /// Starts epoch `epoch` from its first batch (PyTorch's `set_epoch`), abandoning what is
    /// left of the current one. Batches in flight are discarded.
    ///
    /// Right after a resume ([`LoaderBuilder::resume`], [`Loader::load_state`]), asking for the
    /// state's own epoch keeps the position instead: the rest of that epoch comes next. So the
    /// README's loop, `set_epoch` at the top of every epoch, serves fresh and resumed runs.
    /// Asking for the epoch the loader stands at the start of changes nothing either (its
    /// first batches, made since `build()`, are kept).
    ///
    /// Once an epoch has been delivered to its end, the loader already makes the first batches
    /// of the next one (epoch + 1), so that the pipeline does not drain between epochs; asking
    /// for that epoch keeps them, asking for another discards them.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.halt = None;
        // Already there: right after a resume, or at the epoch's start (a loader just built,
        // or a `set_epoch` of the epoch made ahead): keep what is in flight.
        let resumed = std::mem::take(&mut self.resumed);
        let at_start = self.next_batch == 0 && self.order.start() == 0;
        if epoch == self.order.epoch() && (resumed || at_start) {
            return;
        }
        let finished = self.next_batch >= self.order.batches();
        match self.ahead.take() {
            Some(ahead) if finished && ahead.epoch() == epoch => {
                self.order = ahead;
                self.next_batch = 0;
                self.next_dispatch = std::mem::take(&mut self.ahead_dispatch);
                self.announced = 0;
                self.check_files = true;
            }
            _ => {
                self.abandon();
                self.check_files = true;
                self.order = self.spec.epoch(epoch);
                self.next_batch = 0;
                self.next_dispatch = 0;
            }
        }
    }

    /// Starts `epoch` from its first batch in every case (the copy thread's `set_epoch`: the
    /// consumer has already decided that the position is not kept).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn restart_epoch(&mut self, epoch: u64) {
        self.resumed = false;
        self.set_epoch(epoch);
    }

    /// Batches of the current epoch delivered.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn next_batch(&self) -> u64 {
        self.next_batch
    }

    /// True right after a resume, until the next batch or `set_epoch`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn is_resumed(&self) -> bool {
        self.resumed
    }

    /// Starts the epoch after the current one.
    pub fn next_epoch(&mut self) {
        self.set_epoch(self.order.epoch() + 1);
    }

    /// Figures so far: time per stage, time waited, queue depths, pool.
    pub fn stats(&self) -> LoaderStats {
        let elapsed = self.started.map_or(Duration::ZERO, |s| s.elapsed());
        LoaderStats {
            batches: self.delivered,
            samples: self.delivered_samples,
            bytes: self.delivered_bytes,
            elapsed,
            waited: self.waited,
            first_batch: self.first_batch,
            workers: self.threads.len(),
            in_flight: self.in_flight() as usize,
            ready: self.ready.len(),
            stages: self.shared.times.snapshot(),
            pool: self.shared.pool.stats(),
        }
    }

    fn abandon(&mut self) {
        self.announced = 0;
        // Workers skip tasks of older generations; results that arrive late are dropped.
        self.shared.generation.fetch_add(1, Ordering::AcqRel);
        self.shared.pool.wake_waiters();
        self.ready.clear();
        self.ahead = None;
        self.ahead_dispatch = 0;
    }

    /// Batches dispatched and not delivered, of this epoch and (ahead) of the next.
    fn in_flight(&self) -> u64 {
        self.next_dispatch - self.next_batch + self.ahead_dispatch
    }

    fn send(&self, task: Task) -> Result<()> {
        let Some(tx) = &self.tasks else {
            return Err(Error::Shutdown);
        };
        tx.send(task).map_err(|_| Error::Shutdown)
    }

    /// Puts batch `number` of `order` on the task channel: whole, or as its parts.
    fn send_batch(
        &self,
        generation: u64,
        order: &Order,
        number: u64,
        permit: budget::BatchPermit,
    ) -> Result<()> {
        if self.parts <= 1 {
            return self.send(Task::Whole {
                generation,
                order: order.clone(),
                number,
                permit,
            });
        }
        let assembly = Assembly::new(generation, order.clone(), number, self.parts, permit);
        for part in 0..assembly.parts() {
            self.send(Task::Part {
                assembly: Arc::clone(&assembly),
                part,
            })?;
        }
        Ok(())
    }

    /// Puts batches in flight, up to `prefetch` and while the budget has permits; never waits.
    fn dispatch(&mut self) -> Result<()> {
        self.announce();
        let generation = self.shared.generation.load(Ordering::Acquire);
        while self.next_dispatch < self.order.batches() && self.in_flight() < self.prefetch as u64 {
            let Some(permit) = self.budget.try_acquire() else {
                return Ok(());
            };
            self.send_batch(generation, &self.order, self.next_dispatch, permit)?;
            self.next_dispatch += 1;
        }
        // This epoch is all in flight: start on the next one while there is room.
        if self.speculate
            && self.next_dispatch >= self.order.batches()
            && self.in_flight() < self.prefetch as u64
        {
            let Some(next_epoch) = self.order.epoch().checked_add(1) else {
                return Ok(());
            };
            let ahead = self
                .ahead
                .get_or_insert_with(|| self.spec.epoch(next_epoch))
                .clone();
            while self.ahead_dispatch < ahead.batches() && self.in_flight() < self.prefetch as u64 {
                let Some(permit) = self.budget.try_acquire() else {
                    return Ok(());
                };
                self.send_batch(generation, &ahead, self.ahead_dispatch, permit)?;
                self.ahead_dispatch += 1;
            }
        }
        Ok(())
    }

    /// Tells the dataset which samples come next, up to its `read_ahead_batches` beyond the
    /// batches in flight (see [`Dataset::read_ahead`]), once the epoch's first batch has been
    /// delivered: until then the first batches' own reads come first, instead of queueing
    /// behind fetches for batches far ahead (from object storage, that was the first batch's
    /// whole wait). The batches in flight by then are not announced: workers read them already.
    fn announce(&mut self) {
        if self.read_ahead == 0 || self.next_batch == 0 {
            return;
        }
        let until = self
            .next_dispatch
            .saturating_add(self.read_ahead as u64)
            .min(self.order.batches());
        self.announced = self.announced.max(self.next_dispatch);
        while self.announced < until {
            self.order.batch(self.announced, &mut self.scratch);
            self.shared.dataset.read_ahead(&self.scratch);
            self.announced += 1;
        }
    }

    /// The next batch's result, or `None` if `deadline` passed first. The outer error is the
    /// loader's (the budget is all in the caller's hands, or the threads are gone): the
    /// position does not move, nor does it on a timeout. The inner result is the batch's own,
    /// delivered in its turn.
    fn receive(&mut self, deadline: Option<Instant>) -> Result<Option<Result<Batch>>> {
        let key = (self.order.epoch(), self.next_batch);
        loop {
            self.dispatch()?;
            if let Some(result) = self.ready.remove(&key) {
                return Ok(Some(result));
            }
            if self.next_dispatch <= self.next_batch {
                // Not in flight: no permit was free. If the caller holds them all, waiting
                // would never end; otherwise they are in batches in flight (abandoned ones,
                // or the next epoch's) and come back when those arrive.
                let held = self.budget.held();
                if held >= self.budget.total() {
                    return Err(Error::config(
                        "pool_budget",
                        format!(
                            "the caller holds {held} batches, all that the pool's budget allows ({} batches); drop one and ask again, or raise the budget",
                            self.budget.total()
                        ),
                    ));
                }
            }
            let t0 = Instant::now();
            let received = match deadline {
                None => self.done.recv().map_err(|_| RecvTimeoutError::Disconnected),
                Some(deadline) => self.done.recv_deadline(deadline),
            };
            self.waited += t0.elapsed();
            let done = match received {
                Ok(done) => done,
                Err(RecvTimeoutError::Timeout) => return Ok(None),
                Err(RecvTimeoutError::Disconnected) => return Err(Error::Shutdown),
            };
            if done.generation != self.shared.generation.load(Ordering::Acquire) {
                continue; // abandoned: dropping it gives its permit back
            }
            match done.result {
                Some(result) => {
                    self.ready.insert((done.epoch, done.number), result);
                }
                // A worker gives up on a current task only when the pool has closed.
                None => return Err(Error::Shutdown),
            }
        }
    }
}

/// Why [`Iterator::next`] ends early (see `Loader::halt`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Halt {
    FilesChanged,
    Budget,
    Shutdown,
}

/// What [`Loader::next_timeout`] found.
#[derive(Debug)]
pub enum NextBatch {
    /// The next batch of the epoch, or its error, as [`Iterator::next`] gives it.
    Ready(Result<Batch>),
    /// No batch came within the timeout. The position did not move: ask again.
    Pending,
    /// The epoch has been delivered to its end (where [`Iterator::next`] gives `None`).
    EndOfEpoch,
}

impl Loader {
    /// Like [`Iterator::next`], but waits at most `timeout` for the next batch; a timeout
    /// changes nothing (no batch is lost or skipped), so the caller can do something else,
    /// such as look for an interrupt, and ask again. Batches already made wait in order.
    pub fn next_timeout(&mut self, timeout: Duration) -> NextBatch {
        // A timeout too large for an `Instant` is a wait without a deadline.
        self.next_until(Instant::now().checked_add(timeout))
    }

    fn next_until(&mut self, deadline: Option<Instant>) -> NextBatch {
        if self.next_batch >= self.order.batches() {
            return NextBatch::EndOfEpoch;
        }
        if self.check_files {
            // An epoch's first batch: are the files still the ones opened? Until they are,
            // every call says they are not (nothing of the epoch is delivered).
            if let Err(e) = self.shared.dataset.check_unchanged() {
                self.halt = Some(Halt::FilesChanged);
                return NextBatch::Ready(Err(e));
            }
            self.check_files = false;
        }
        self.started.get_or_insert_with(Instant::now);
        let result = match self.receive(deadline) {
            Ok(Some(result)) => result,
            Ok(None) => return NextBatch::Pending,
            Err(e) => {
                self.halt = Some(match e {
                    Error::Shutdown => Halt::Shutdown,
                    _ => Halt::Budget,
                });
                return NextBatch::Ready(Err(e));
            }
        };
        self.resumed = false;
        self.halt = None;
        self.next_batch += 1;
        let result = result.map(|mut batch| {
            if let Some(permit) = &mut batch.permit {
                permit.mark_held();
            }
            batch
        });
        // Refill the pipeline now, so that workers make the next batches while the caller
        // uses this one. A failure here (the threads are gone) is reported by the next call:
        // this batch is delivered either way.
        let _ = self.dispatch();
        if let Ok(batch) = &result {
            self.first_batch.get_or_insert_with(|| self.built.elapsed());
            self.delivered += 1;
            self.delivered_samples += batch.len() as u64;
            self.delivered_bytes += (batch.len() * self.shared.layout.sample_bytes()) as u64;
        }
        NextBatch::Ready(result)
    }
}

impl LoaderBuilder {
    fn from_arc(dataset: Arc<dyn Dataset>) -> LoaderBuilder {
        LoaderBuilder {
            dataset,
            transform: Arc::new(CopyFields::all()),
            batch_hook: None,
            batch_size: 1,
            shuffle: None,
            workers: None,
            feeds_device: false,
            prefetch: None,
            parts: None,
            drop_last: false,
            evaluation: false,
            blocks: None,
            shard: ShardChoice::Whole,
            epoch: 0,
            resume: None,
            budget: None,
            across_epochs: true,
            backing: None,
        }
    }
}

impl Loader {
    /// A builder over a dataset that is already shared.
    pub fn builder_shared(dataset: Arc<dyn Dataset>) -> LoaderBuilder {
        LoaderBuilder::from_arc(dataset)
    }
}

impl Iterator for Loader {
    type Item = Result<Batch>;

    /// The next batch of the epoch, or `None` at its end (call [`Loader::set_epoch`] or
    /// [`Loader::next_epoch`] to go on).
    /// The next batch of the epoch, or its error; `None` at the epoch's end.
    ///
    /// An error that leaves the position where it was ([`Error::FileChanged`] at an epoch's
    /// start, the `pool_budget` error when the caller holds every batch the budget allows,
    /// [`Error::Shutdown`]) is given once, and the iterator then ends (`None`) until the cause
    /// is gone: a batch is dropped (the budget), or [`Loader::set_epoch`] or
    /// [`Loader::load_state`] is called. [`Loader::state`] still names the batches not
    /// delivered. [`Loader::next_timeout`] reports such an error on every call instead.
    fn next(&mut self) -> Option<Result<Batch>> {
        match self.halt {
            None => {}
            Some(Halt::Budget) if self.budget.held() < self.budget.total() => self.halt = None,
            Some(_) => return None,
        }
        loop {
            match self.next_until(None) {
                NextBatch::Ready(result) => return Some(result),
                NextBatch::EndOfEpoch => return None,
                // Only a deadline times out.
                NextBatch::Pending => {}
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.order.batches().saturating_sub(self.next_batch) as usize;
        (left, Some(left))
    }
}

/// How long dropping a [`Loader`] waits for its worker threads to stop.
///
/// A worker stops at its next task or result once the loader is dropped; one blocked in a
/// call that does not return (a read of a named pipe or of a hung network file system, a
/// [`Dataset::get`] that waits forever) cannot. After this long the loader leaves such
/// workers running, detached, and counts them in [`detached_workers`]: a detached worker
/// holds only shared ownership (`Arc`s of the dataset, the transform and the pool), so it
/// touches no memory that the drop freed, and it ends by itself, freeing them, once its call
/// returns (its result has nowhere to go).
pub const SHUTDOWN_WAIT: Duration = Duration::from_secs(2);

/// Worker threads left running by dropped loaders, in this process; see [`SHUTDOWN_WAIT`].
static DETACHED_WORKERS: AtomicU64 = AtomicU64::new(0);

/// How many worker threads dropped loaders have left running in this process, because they
/// did not stop within [`SHUTDOWN_WAIT`] (see there). Zero unless a worker was stuck in a call
/// that did not return.
pub fn detached_workers() -> u64 {
    DETACHED_WORKERS.load(Ordering::Acquire)
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.abandon();
        // Closing the task channel ends idle workers; closing the pool wakes those waiting for
        // a buffer; draining the result channel (below) ends those blocked on send.
        self.tasks = None;
        self.shared.pool.close();
        // Every worker holds a sender of the result channel: it disconnects once the last
        // worker has returned. Results that come meanwhile are dropped (their permits and
        // buffers go back).
        // Miri runs every thread on one host thread, some hundred times slower: a worker
        // that is merely busy could take longer than SHUTDOWN_WAIT to see the stop, and a
        // thread left running fails its leak check. There, wait for every one.
        let wait = if cfg!(miri) {
            Duration::from_secs(3600)
        } else {
            SHUTDOWN_WAIT
        };
        let deadline = Instant::now() + wait;
        let all_stopped = loop {
            match self.done.recv_deadline(deadline) {
                Ok(_) => {}
                Err(RecvTimeoutError::Disconnected) => break true,
                Err(RecvTimeoutError::Timeout) => break false,
            }
        };
        for t in self.threads.drain(..) {
            if all_stopped || t.is_finished() {
                let _ = t.join();
            } else {
                // Dropping the handle detaches the thread; what it uses it owns (see
                // `SHUTDOWN_WAIT`).
                DETACHED_WORKERS.fetch_add(1, Ordering::AcqRel);
            }
        }
    }
}
