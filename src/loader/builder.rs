//! [`LoaderBuilder`]: PyTorch's settings in Rust form, checked in three steps at `build()`:
//! the order (rank, world, batch, shuffle, remainder), the sizes (the batch layout, parts,
//! prefetch, the pool's budget, against the machine's memory), then the threads.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use super::budget::BatchBudget;
use super::host::Loader;
use super::probe::{PROBE_SAMPLES, measure};
use super::sizing::{
    CpuBudget, MAX_AUTO_WORKERS, default_parts, default_prefetch, default_ragged_budget,
    default_workers, physical_memory,
};
use super::stats::{ConsumerTimeline, StageTimes};
use super::tune::{Derive, Gate, Setting, Tuner, candidates};
use super::worker::{self, Done, Shared, Task};
use super::{Batch, BatchHook, Delivered, LoaderState, MAX_WORKERS, Position, rank_from_env};
use crate::error::{Error, Result};
use crate::layout::BatchLayout;
use crate::memory::{Backing, HeapBacking, HostPool, human_bytes};
use crate::sampler::{BlockShuffle, OrderSpec, Remainder};
use crate::source::Dataset;
use crate::trace::Trace;
use crate::transform::{CopyFields, SampleTransform};

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
/// use gpufeed::{BatchStream, CopyFields, Loader};
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
    workers: Option<Setting>,
    /// The backing's blocks are copied to a device (see [`Backing::feeds_device`]).
    feeds_device: bool,
    prefetch: Option<Setting>,
    parts: Option<Setting>,
    /// CPUs for workers chosen by the loader (`None`: [`CpuBudget::of_this_thread`]).
    cpus: Option<usize>,
    drop_last: bool,
    evaluation: bool,
    blocks: Option<(u64, u64)>,
    shard: ShardChoice,
    epoch: u64,
    resume: Option<LoaderState>,
    budget: Option<u64>,
    ragged_budgets: BTreeMap<String, u64>,
    ragged_budget_each: Option<u64>,
    across_epochs: bool,
    backing: Option<Box<dyn FnOnce(u64) -> HostPool + Send>>,
    trace: Option<Trace>,
}

impl LoaderBuilder {
    /// The image pipeline of the transform set, if it is one (a loader that feeds a GPU
    /// decides where it decodes before it builds).
    #[cfg(feature = "cuda")]
    pub(crate) fn image_pipeline(&self) -> Option<&crate::transform::image::ImageTransform> {
        self.transform.image_pipeline()
    }

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
    /// has shards ([`Dataset::shard_sizes`]). A data set that must be read in windows
    /// (Parquet: [`Dataset::windowed_shuffle`]) is shuffled so by [`shuffle`](Self::shuffle)
    /// alone, with its own window and block unless these are set.
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
    ///
    /// [`Auto`](super::Auto) (`.workers(Auto)`): the loader chooses, from a short measurement
    /// on the first batches (at most [`TUNE_LIMIT`](super::TUNE_LIMIT)), the fewest workers
    /// within 3% of the fastest count it measured and of what the consumer takes, within the
    /// CPUs this thread may use (its affinity and its cgroup's quota, less two on the GPU
    /// path: [`CpuBudget`]; or [`cpu_budget`](Self::cpu_budget)). What it chose and why is
    /// [`LoaderStats::tuning`](super::LoaderStats::tuning).
    pub fn workers(mut self, n: impl Into<Setting>) -> Self {
        self.workers = Some(n.into());
        self
    }

    /// The CPUs the loader may give workers when it chooses them ([`Auto`](super::Auto));
    /// default: [`CpuBudget::of_this_thread`].
    pub fn cpu_budget(mut self, cpus: usize) -> Self {
        self.cpus = Some(cpus);
        self
    }

    /// Batches in flight, all workers together (default: one per worker plus two, more for
    /// small batches: about 64 MiB, at most four per worker; for batches made in parts (see
    /// [`batch_parts`](Self::batch_parts)), enough parts to keep every worker busy twice over,
    /// plus two batches; never more than an epoch has: [`default_prefetch`]).
    ///
    /// [`Auto`](super::Auto): the same rule for the workers chosen, within the memory budget
    /// ([`pool_budget`](Self::pool_budget), or by default what the default prefetch needs for
    /// the most workers the CPU budget holds, at most a quarter of this machine's memory).
    pub fn prefetch(mut self, n: impl Into<Setting>) -> Self {
        self.prefetch = Some(n.into());
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
    /// size. [`Auto`](super::Auto): the default rule for the workers chosen.
    pub fn batch_parts(mut self, n: impl Into<Setting>) -> Self {
        self.parts = Some(n.into());
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
    /// padding ([`BatchInfo::padding`](crate::BatchInfo::padding), [`BatchInfo::mask`](crate::BatchInfo::mask)) instead of counting samples twice as
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
    /// those of the state (`build()` checks). A first [`Loader::set_epoch`](crate::BatchStream::set_epoch) of the state's
    /// epoch keeps this position (see the [module docs](super)).
    pub fn resume(mut self, state: LoaderState) -> Self {
        self.resume = Some(state);
        self
    }

    /// Makes the first batches of epoch + 1 while the end of an epoch is consumed (default
    /// true), so that [`Loader::set_epoch`](crate::BatchStream::set_epoch)`(epoch + 1)` finds them ready.
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

    /// The byte budget of ragged field `field`'s values in one batch (see [the layout's
    /// docs](crate::layout#ragged-fields)): every batch buffer has this much room for them.
    /// A batch whose values need more is an error of kind `Config` naming the field, the batch
    /// and `ragged_budget` (the batch is never cut short); room a batch does not use costs
    /// memory, not copies.
    ///
    /// Default: from the sizes of the first samples of the loader's order, run through the
    /// transform when the loader is built ([`default_ragged_budget`]: twice the mean batch or
    /// more, for sizes that spread widely). Setting it skips that measure. `build()` refuses a
    /// name that is not a ragged field of the transform's output.
    pub fn ragged_budget(mut self, field: impl Into<String>, bytes: u64) -> Self {
        self.ragged_budgets.insert(field.into(), bytes);
        self
    }

    /// The byte budget of every ragged field that [`ragged_budget`](Self::ragged_budget) does
    /// not name (for front ends that take one number: `gpufeed bench --ragged-budget`, Python's
    /// `ragged_budget=N`). `build()` refuses it when the batches have no ragged field.
    pub fn ragged_budget_each(mut self, bytes: u64) -> Self {
        self.ragged_budget_each = Some(bytes);
        self
    }

    /// Records the loader's work on `trace`: a track per worker thread, the consumer's, the
    /// copy thread's and the copy stream's on the GPU path, pool allocations and epochs (see
    /// the [trace](crate::trace) module); write it with [`Trace::write`]. Several loaders may
    /// share one trace: each is a process of its own on the timeline.
    pub fn trace(mut self, trace: &Trace) -> Self {
        self.trace = Some(trace.clone());
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
        let (spec, workers) = self.check_order()?;
        // What identifies the data, recorded in states: a resume on other data is refused.
        let fingerprint = self
            .dataset
            .fingerprint()?
            .map(crate::file::fingerprint_hex);
        if let Some(state) = &self.resume {
            state.check_data(fingerprint.as_deref(), spec.len)?;
        }
        let sizes = self.size(&spec, workers)?;
        self.spawn(spec, fingerprint, workers, sizes)
    }

    /// True when the loader chooses any of its workers, prefetch or parts.
    fn tunes(&self) -> bool {
        [self.workers, self.prefetch, self.parts].contains(&Some(Setting::Auto))
    }

    /// The CPUs for workers the loader chooses.
    fn cpus(&self) -> CpuBudget {
        let mut cpus = CpuBudget::of_this_thread(self.feeds_device);
        if let Some(n) = self.cpus {
            cpus.budget = n.clamp(1, MAX_AUTO_WORKERS);
        }
        cpus
    }

    /// The order's settings, and the number of workers: every setting that does not depend on
    /// the batch's size, checked.
    fn check_order(&self) -> Result<(OrderSpec, usize)> {
        let (rank, world) = match self.shard {
            ShardChoice::Whole => (0, 1),
            ShardChoice::Explicit(r, w) => (r, w),
            ShardChoice::FromEnv => rank_from_env()?,
        };
        if self.cpus == Some(0) {
            return Err(Error::config(
                "cpu_budget",
                "at least one CPU is needed for the workers",
            ));
        }
        let workers = match self.workers {
            Some(Setting::Fixed(n)) => n,
            Some(Setting::Auto) => self.cpus().budget,
            None => default_workers(self.feeds_device),
        };
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
        if self.parts == Some(Setting::Fixed(0)) {
            return Err(Error::config(
                "batch_parts",
                "a batch is made in at least one part",
            ));
        }
        if self.prefetch == Some(Setting::Fixed(0)) {
            return Err(Error::config(
                "prefetch",
                "at least one batch must be in flight",
            ));
        }
        let remainder = Remainder::of(self.drop_last, self.evaluation)?;
        // A data set read in windows (Parquet) is never shuffled globally: a global shuffle
        // would decode a chunk of rows per sample.
        let windowed = self.shuffle.and(self.dataset.windowed_shuffle());
        let blocks = match self.blocks.or(windowed) {
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
        Ok((spec, workers))
    }

    /// What a batch takes and how many are in flight, checked against this machine's memory.
    fn size(&self, spec: &OrderSpec, workers: usize) -> Result<Sizes> {
        // A batch holds no more than this rank gets in an epoch: buffers (and the pool) are
        // sized for the samples there are, not for a batch size beyond the data set.
        let capacity = usize::try_from(spec.batch_capacity()).unwrap_or(self.batch_size);
        let outputs = self.transform.output(self.dataset.schema())?;
        let budgets = self.ragged_budgets(&outputs, spec, capacity)?;
        let layout = Arc::new(BatchLayout::with_budgets(outputs, capacity, |f| {
            budgets.get(&f.name).copied()
        })?);
        let batch_bytes = HostPool::block_size(layout.total_bytes()) as u64;
        let parts = fixed(self.parts)
            .unwrap_or_else(|| default_parts(workers, batch_bytes))
            .clamp(1, capacity.max(1));
        let prefetch = fixed(self.prefetch)
            .unwrap_or_else(|| default_prefetch(workers, batch_bytes, parts, spec.batches()));
        let memory = physical_memory();
        if let Some(memory) = memory
            && batch_bytes > memory / 2
        {
            return Err(Error::config(
                "batch_size",
                format!(
                    "one batch of {capacity} samples takes {}, more than half this machine's memory ({})",
                    human_bytes(batch_bytes),
                    human_bytes(memory)
                ),
            ));
        }
        // A cache of decoded rows the data set keeps (Parquet's chunks) is memory too.
        let held = self.dataset.held_bytes();
        let budget = match self.budget {
            Some(b) => b,
            None => {
                let default = (prefetch as u64)
                    .checked_add(2)
                    .and_then(|n| n.checked_mul(batch_bytes))
                    .unwrap_or(u64::MAX);
                // A loader that chooses its settings keeps to a quarter of the machine's
                // memory (at least one batch and two held), what the data set holds
                // included, unless given a budget.
                match memory {
                    Some(m) if self.tunes() => {
                        default.min((m / 4).saturating_sub(held).max(3 * batch_bytes))
                    }
                    _ => default,
                }
            }
        };
        if budget < batch_bytes {
            return Err(Error::config(
                "pool_budget",
                format!("{budget} bytes cannot hold one batch of {batch_bytes} bytes"),
            ));
        }
        if let Some(memory) = memory
            && budget.saturating_add(held) > memory
        {
            // Name what the user set: the budget, or the prefetch it was computed from.
            let (setting, why) = match self.budget {
                Some(_) => (
                    "pool_budget",
                    format!("a budget of {}", human_bytes(budget)),
                ),
                None => (
                    "prefetch",
                    format!(
                        "{prefetch} batches in flight (+2 held) of {} each",
                        human_bytes(batch_bytes)
                    ),
                ),
            };
            let beside = if held > 0 {
                format!(
                    ", beside the {} the data set keeps of decoded rows",
                    human_bytes(held)
                )
            } else {
                String::new()
            };
            return Err(Error::config(
                setting,
                format!(
                    "{why} is more than this machine's memory ({}){beside}",
                    human_bytes(memory)
                ),
            ));
        }
        let budget_batches = usize::try_from(budget / batch_bytes).unwrap_or(usize::MAX);
        let derive = Derive {
            batch_bytes,
            capacity,
            batches: spec.batches(),
            budget_batches,
            prefetch: fixed(self.prefetch),
            parts: fixed(self.parts),
        };
        // Under a budget smaller than the default's, the batches in flight the rule gives.
        let prefetch = match self.prefetch {
            Some(Setting::Auto) => derive.prefetch(workers),
            _ => prefetch,
        };
        Ok(Sizes {
            layout,
            parts,
            prefetch,
            budget,
            budget_batches,
            derive,
        })
    }

    /// The byte budget of each ragged field of `outputs` in batches of `capacity` samples: as
    /// set, else measured (see [`ragged_budget`](Self::ragged_budget)).
    fn ragged_budgets(
        &self,
        outputs: &[crate::layout::OutputField],
        spec: &OrderSpec,
        capacity: usize,
    ) -> Result<BTreeMap<String, u64>> {
        let ragged: Vec<&str> = outputs
            .iter()
            .filter(|f| f.ragged)
            .map(|f| f.name.as_str())
            .collect();
        if let Some(name) = self
            .ragged_budgets
            .keys()
            .find(|n| !ragged.contains(&n.as_str()))
        {
            return Err(Error::config(
                "ragged_budget",
                format!(
                    "no ragged field `{name}` in the batches (their ragged fields: {ragged:?})"
                ),
            ));
        }
        if self.ragged_budget_each.is_some() && ragged.is_empty() {
            return Err(Error::config(
                "ragged_budget",
                "the batches have no ragged field to give a budget",
            ));
        }
        let mut budgets = self.ragged_budgets.clone();
        if let Some(each) = self.ragged_budget_each {
            for name in &ragged {
                budgets.entry((*name).to_owned()).or_insert(each);
            }
        }
        if ragged.iter().all(|n| budgets.contains_key(*n)) {
            return Ok(budgets);
        }
        let (order, first) = match &self.resume {
            Some(state) => state.position(spec)?,
            None => (spec.epoch(self.epoch), 0),
        };
        let sizes = measure(
            self.dataset.as_ref(),
            self.transform.as_ref(),
            outputs,
            (&order, first),
            PROBE_SAMPLES,
        )?;
        for (f, s) in outputs.iter().zip(sizes) {
            if let Some(s) = s
                && !budgets.contains_key(&f.name)
            {
                let bytes = default_ragged_budget(capacity, s.mean, s.std_dev, s.max);
                budgets.insert(f.name.clone(), bytes);
            }
        }
        Ok(budgets)
    }

    /// Starts the worker threads on the first batches.
    fn spawn(
        self,
        spec: OrderSpec,
        fingerprint: Option<String>,
        workers: usize,
        sizes: Sizes,
    ) -> Result<Loader> {
        let Sizes {
            layout,
            parts,
            prefetch,
            budget,
            budget_batches,
            derive,
        } = sizes;
        // A loader that chooses its workers starts them all and lets the ones measured take
        // tasks (`tune.rs`); one that chooses only its prefetch or parts derives them now.
        let cpus = self.cpus();
        let tuner = self.tunes().then(|| {
            let auto_workers = self.workers == Some(Setting::Auto);
            let counts = if auto_workers {
                candidates(workers, default_workers(self.feeds_device))
            } else {
                vec![workers]
            };
            let gate = Arc::new(Gate::new(counts[0]));
            Tuner::new(
                Instant::now(),
                gate,
                derive,
                counts,
                cpus.clone(),
                budget,
                !auto_workers,
            )
        });
        let gate = tuner
            .as_ref()
            .filter(|_| self.workers == Some(Setting::Auto))
            .map(Tuner::gate);
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
            gate,
        });
        let trace = self.trace.map(|t| {
            let group = t.group("gpufeed loader");
            (t, group)
        });
        let (task_tx, task_rx) = crossbeam_channel::unbounded::<Task>();
        // Results in flight never exceed the permits; stale ones (skipped tasks) only make a
        // worker wait until the consumer drains them.
        let results = prefetch.min(budget_batches).saturating_add(workers);
        let (done_tx, done_rx) = crossbeam_channel::bounded::<Done>(results);
        let mut threads = Vec::with_capacity(workers);
        for w in 0..workers {
            let (shared, tasks, done) = (Arc::clone(&shared), task_rx.clone(), done_tx.clone());
            let track = trace
                .as_ref()
                .map(|(t, group)| t.track(*group, format!("worker {w}"), 10 + w as i32));
            let handle = std::thread::Builder::new()
                .name(format!("gpufeed-worker-{w}"))
                .spawn(move || worker::run(&shared, &tasks, &done, w, track))
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
            position: Position::new(spec, fingerprint, &order, next, resumed),
            order,
            tasks: Some(task_tx),
            done: done_rx,
            threads,
            prefetch,
            parts,
            budget: BatchBudget::new(budget_batches),
            next_dispatch: next,
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
            delivered: Delivered::recorded_on(
                trace
                    .as_ref()
                    .map(|(t, group)| ConsumerTimeline::new(t.track(*group, "consumer", 0))),
            ),
            trace,
            tuner,
            cpus,
        };
        if let Some((_, prefetch, parts)) = loader.tuner.as_ref().and_then(Tuner::chosen) {
            loader.prefetch = prefetch;
            loader.parts = parts;
        }
        loader.delivered.epoch_starts(loader.order.epoch());
        // Batches made in parts would each wait for their buffer (their parts take every
        // worker); one worker makes the budget's buffers ahead, in turn, while the others make
        // batches in the first ones.
        if parts > 1 {
            let generation = loader.shared.generation.load(Ordering::Acquire);
            // No more than an epoch has batches (a data set of one batch needs one buffer
            // ahead); the rest of the budget is made when it is used.
            let per_epoch = usize::try_from(loader.position.spec().batches()).unwrap_or(usize::MAX);
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

impl LoaderBuilder {
    pub(super) fn from_arc(dataset: Arc<dyn Dataset>) -> LoaderBuilder {
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
            cpus: None,
            drop_last: false,
            evaluation: false,
            blocks: None,
            shard: ShardChoice::Whole,
            epoch: 0,
            resume: None,
            budget: None,
            ragged_budgets: BTreeMap::new(),
            ragged_budget_each: None,
            across_epochs: true,
            backing: None,
            trace: None,
        }
    }
}

/// What `build()` sized: the layout of a batch, and how many batches are made at once.
struct Sizes {
    layout: Arc<BatchLayout>,
    parts: usize,
    prefetch: usize,
    budget: u64,
    budget_batches: usize,
    /// What the settings the loader may choose are derived from.
    derive: Derive,
}

/// The number a setting fixes, if it does.
fn fixed(setting: Option<Setting>) -> Option<usize> {
    match setting {
        Some(Setting::Fixed(n)) => Some(n),
        _ => None,
    }
}
