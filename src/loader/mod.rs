//! The loader: worker threads that share one dataset and collate batches into pooled buffers.
//!
//! [`Loader::builder`] takes a [`Dataset`] and PyTorch's vocabulary (`batch_size`, `shuffle`,
//! `workers`, `prefetch`, `drop_last`, `shard`); `build()` checks every setting, starts the
//! worker threads once, and the loader then yields the batches of one epoch, in order, as an
//! iterator of `Result<Batch>`. [`Loader::set_epoch`] starts another epoch on the same threads.
//!
//! How a batch is made (see `worker.rs`): the loader puts the batch's number on a task channel;
//! a free worker computes its sample indices from the [`Order`], takes a
//! buffer from the [`HostPool`] (waiting if the byte budget is used up: backpressure), and for
//! each sample calls [`Dataset::get`] (a view into the mapping) and the
//! [`SampleTransform`], which writes straight into the
//! sample's slot. The finished batch goes back on a bounded result channel; the loader puts
//! results back in order. At most `prefetch` batches are in flight.
//!
//! Faults: an error or a panic in a transform for sample *i* makes that batch an `Err` naming
//! sample *i* and the batch; the loader stays usable and the next call yields the next batch.
//! Dropping the loader stops and joins every worker thread, also when they wait on a full
//! channel or an exhausted pool.

mod baseline;
mod batch;
mod stats;
mod worker;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use serde::{Deserialize, Serialize};

pub use baseline::gather_baseline;
pub use batch::{Batch, BatchLayout, Element, FIELD_ALIGN};
use stats::StageTimes;
pub use stats::{LoaderStats, StageSnapshot, steady_rate};

use crate::error::{Error, Result};
use crate::memory::{Backing, HeapBacking, HostPool};
use crate::sampler::{Order, OrderSpec};
use crate::source::Dataset;
use crate::transform::{CopyFields, SampleTransform};
use worker::{Done, Shared, Task};

/// A hook run on each whole batch, in the worker, after its samples are written.
pub type BatchHook = Arc<dyn Fn(&mut Batch) -> Result<()> + Send + Sync>;

/// Settings of a [`Loader`]; see [`Loader::builder`].
pub struct LoaderBuilder {
    dataset: Arc<dyn Dataset>,
    transform: Arc<dyn SampleTransform>,
    batch_hook: Option<BatchHook>,
    batch_size: usize,
    shuffle: Option<u64>,
    workers: usize,
    prefetch: Option<usize>,
    drop_last: bool,
    shard: Option<(u64, u64)>,
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

    /// Sequential order (the default).
    pub fn sequential(mut self) -> Self {
        self.shuffle = None;
        self
    }

    /// Worker threads (default: the available parallelism, at most 16).
    pub fn workers(mut self, n: usize) -> Self {
        self.workers = n;
        self
    }

    /// Batches in flight, all workers together (default: twice the workers).
    pub fn prefetch(mut self, n: usize) -> Self {
        self.prefetch = Some(n);
        self
    }

    /// Drops the samples that do not fill a rank's share or a whole batch (default false: pad
    /// shards by wrapping around and deliver a short last batch). One flag covers both
    /// PyTorch's `DistributedSampler(drop_last)` and `DataLoader(drop_last)`.
    pub fn drop_last(mut self, yes: bool) -> Self {
        self.drop_last = yes;
        self
    }

    /// This process's rank and the world size. Without it, the loader reads `RANK` and
    /// `WORLD_SIZE` (torchrun), else `SLURM_PROCID` and `SLURM_NTASKS`, else rank 0 of 1.
    pub fn shard(mut self, rank: u64, world: u64) -> Self {
        self.shard = Some((rank, world));
        self
    }

    /// The first epoch (default 0).
    pub fn epoch(mut self, epoch: u64) -> Self {
        self.epoch = epoch;
        self
    }

    /// Resumes from a [`LoaderState`]: the loader yields exactly the batches of that epoch not
    /// yet delivered. The settings that decide the order must match those of the state.
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
    pub fn pool_budget(mut self, bytes: u64) -> Self {
        self.budget = Some(bytes);
        self
    }

    /// Backs the batch buffers with `backing` (pinned memory, with the `cuda` feature).
    pub fn backing(mut self, backing: impl Backing<Addr = std::ptr::NonNull<u8>>) -> Self {
        self.backing = Some(Box::new(move |budget| {
            HostPool::with_backing(backing, budget)
        }));
        self
    }

    /// Checks every setting and starts the worker threads.
    pub fn build(self) -> Result<Loader> {
        let (rank, world) = match self.shard {
            Some(s) => s,
            None => rank_from_env()?,
        };
        if self.workers == 0 {
            return Err(Error::config(
                "workers",
                "at least one worker thread is needed",
            ));
        }
        let prefetch = self.prefetch.unwrap_or(2 * self.workers);
        if prefetch == 0 {
            return Err(Error::config(
                "prefetch",
                "at least one batch must be in flight",
            ));
        }
        let spec = OrderSpec {
            len: self.dataset.len(),
            batch_size: self.batch_size as u64,
            shuffle: self.shuffle,
            rank,
            world,
            drop_last: self.drop_last,
        };
        spec.validate()?;
        let outputs = self.transform.output(self.dataset.schema())?;
        let layout = Arc::new(BatchLayout::new(outputs, self.batch_size)?);
        let batch_bytes = HostPool::block_size(layout.total_bytes()) as u64;
        let budget = match self.budget {
            Some(b) => b,
            None => (prefetch + 2) as u64 * batch_bytes,
        };
        if budget < batch_bytes {
            return Err(Error::config(
                "pool_budget",
                format!("{budget} bytes cannot hold one batch of {batch_bytes} bytes"),
            ));
        }
        let (epoch, next) = match &self.resume {
            Some(state) => {
                state.check(&spec)?;
                (state.epoch, state.next_batch)
            }
            None => (self.epoch, 0),
        };
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
            held: Arc::new(AtomicUsize::new(0)),
        });
        let (task_tx, task_rx) = crossbeam_channel::unbounded::<Task>();
        let (done_tx, done_rx) = crossbeam_channel::bounded::<Done>(2 * prefetch + self.workers);
        let mut threads = Vec::with_capacity(self.workers);
        for w in 0..self.workers {
            let (shared, tasks, done) = (Arc::clone(&shared), task_rx.clone(), done_tx.clone());
            let handle = std::thread::Builder::new()
                .name(format!("gpufeed-worker-{w}"))
                .spawn(move || worker::run(&shared, &tasks, &done))
                .map_err(|e| {
                    Error::config("workers", format!("cannot start worker thread {w}: {e}"))
                })?;
            threads.push(handle);
        }
        let order = spec.epoch(epoch);
        Ok(Loader {
            shared,
            spec,
            order,
            tasks: Some(task_tx),
            done: done_rx,
            threads,
            prefetch,
            budget_batches: (budget / batch_bytes) as usize,
            next_batch: next,
            next_dispatch: next,
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
        })
    }
}

/// Reads the rank and world size from torchrun's or Slurm's variables; rank 0 of 1 if unset.
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
                        "only one of {rank} and {world} is set; set both or call shard(rank, world)"
                    ),
                ));
            }
        }
    }
    Ok((0, 1))
}

/// Where a loader stands: enough to resume after a crash with exactly the batches not yet
/// delivered. Small and serializable (serde).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderState {
    /// The epoch.
    pub epoch: u64,
    /// The next batch to deliver in that epoch.
    pub next_batch: u64,
    /// The settings that decide the order; a resumed loader must have the same.
    pub order: OrderSpec,
}

impl LoaderState {
    fn check(&self, spec: &OrderSpec) -> Result<()> {
        if &self.order != spec {
            return Err(Error::mismatch(format!(
                "cannot resume: the state was saved with order settings {:?}, this loader has {:?}",
                self.order, spec
            )));
        }
        if self.next_batch > spec.batches() {
            return Err(Error::mismatch(format!(
                "cannot resume: the state's next batch {} is past the epoch's {} batches",
                self.next_batch,
                spec.batches()
            )));
        }
        Ok(())
    }
}

/// Yields the batches of one epoch, in order; see the [module docs](self).
pub struct Loader {
    shared: Arc<Shared>,
    spec: OrderSpec,
    order: Order,
    tasks: Option<Sender<Task>>,
    done: Receiver<Done>,
    threads: Vec<JoinHandle<()>>,
    prefetch: usize,
    budget_batches: usize,
    next_batch: u64,
    next_dispatch: u64,
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
        self.order.batches()
    }

    /// The settings that decide the order.
    pub fn order_spec(&self) -> &OrderSpec {
        &self.spec
    }

    /// The layout of every batch.
    pub fn layout(&self) -> &BatchLayout {
        &self.shared.layout
    }

    /// The batch-buffer pool.
    pub fn pool(&self) -> &HostPool {
        &self.shared.pool
    }

    /// Where the loader stands now: resuming from it yields the batches not yet delivered.
    pub fn state(&self) -> LoaderState {
        LoaderState {
            epoch: self.order.epoch(),
            next_batch: self.next_batch,
            order: self.spec.clone(),
        }
    }

    /// Starts epoch `epoch` from its first batch (PyTorch's `set_epoch`), abandoning what is
    /// left of the current one. Batches in flight are discarded.
    ///
    /// Once an epoch has been delivered to its end, the loader already makes the first batches
    /// of the next one (epoch + 1), so that the pipeline does not drain between epochs; asking
    /// for that epoch keeps them, asking for another discards them.
    pub fn set_epoch(&mut self, epoch: u64) {
        let finished = self.next_batch >= self.order.batches();
        match self.ahead.take() {
            Some(ahead) if finished && ahead.epoch() == epoch => {
                self.order = ahead;
                self.next_batch = 0;
                self.next_dispatch = std::mem::take(&mut self.ahead_dispatch);
            }
            _ => {
                self.abandon();
                self.order = self.spec.epoch(epoch);
                self.next_batch = 0;
                self.next_dispatch = 0;
            }
        }
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

    fn dispatch(&mut self) -> Result<()> {
        // Batches the user still holds keep their buffers: never put more in flight than the
        // budget has room for, or workers would wait for buffers that never come back.
        let held = self.shared.held.load(Ordering::Acquire);
        let room = self.budget_batches.saturating_sub(held);
        if room == 0 && self.in_flight() == 0 {
            return Err(Error::config(
                "pool_budget",
                format!(
                    "the caller holds {held} batches, all the pool's budget allows ({} batches); drop some or raise the budget",
                    self.budget_batches
                ),
            ));
        }
        let limit = self.prefetch.min(room);
        let generation = self.shared.generation.load(Ordering::Acquire);
        while self.next_dispatch < self.order.batches() && self.in_flight() < limit as u64 {
            self.send(Task {
                generation,
                order: self.order.clone(),
                number: self.next_dispatch,
            })?;
            self.next_dispatch += 1;
        }
        // This epoch is all in flight: start on the next one while there is room.
        if self.speculate
            && self.next_dispatch >= self.order.batches()
            && self.in_flight() < limit as u64
        {
            let Some(next_epoch) = self.order.epoch().checked_add(1) else {
                return Ok(());
            };
            let ahead = self
                .ahead
                .get_or_insert_with(|| self.spec.epoch(next_epoch))
                .clone();
            while self.ahead_dispatch < ahead.batches() && self.in_flight() < limit as u64 {
                self.send(Task {
                    generation,
                    order: ahead.clone(),
                    number: self.ahead_dispatch,
                })?;
                self.ahead_dispatch += 1;
            }
        }
        Ok(())
    }

    fn receive(&mut self) -> Result<Batch> {
        let generation = self.shared.generation.load(Ordering::Acquire);
        let key = (self.order.epoch(), self.next_batch);
        loop {
            if let Some(result) = self.ready.remove(&key) {
                return result;
            }
            let t0 = Instant::now();
            let done = self.done.recv().map_err(|_| Error::Shutdown)?;
            self.waited += t0.elapsed();
            if done.generation != generation {
                continue;
            }
            match done.result {
                Some(result) => {
                    self.ready.insert((done.epoch, done.number), result);
                }
                None => {
                    return Err(Error::user(format!(
                        "a worker dropped batch {} of the current epoch",
                        done.number
                    )));
                }
            }
        }
    }
}

impl LoaderBuilder {
    fn from_arc(dataset: Arc<dyn Dataset>) -> LoaderBuilder {
        let workers = std::thread::available_parallelism()
            .map_or(2, |n| n.get())
            .min(16);
        LoaderBuilder {
            dataset,
            transform: Arc::new(CopyFields::all()),
            batch_hook: None,
            batch_size: 1,
            shuffle: None,
            workers,
            prefetch: None,
            drop_last: false,
            shard: None,
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
    fn next(&mut self) -> Option<Result<Batch>> {
        if self.next_batch >= self.order.batches() {
            return None;
        }
        self.started.get_or_insert_with(Instant::now);
        if let Err(e) = self.dispatch() {
            return Some(Err(e));
        }
        let mut result = self.receive();
        self.next_batch += 1;
        if let Ok(batch) = &mut result {
            // Count it as held before dispatching more: in flight + held never exceeds what
            // the budget holds, so every batch in flight can get a buffer.
            batch.held = Some(batch::HeldToken::new(&self.shared.held));
        }
        if let Err(e) = self.dispatch() {
            return Some(Err(e));
        }
        if let Ok(batch) = &result {
            self.first_batch.get_or_insert_with(|| self.built.elapsed());
            self.delivered += 1;
            self.delivered_samples += batch.len() as u64;
            self.delivered_bytes += (batch.len() * self.shared.layout.sample_bytes()) as u64;
        }
        Some(result)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.order.batches().saturating_sub(self.next_batch) as usize;
        (left, Some(left))
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.abandon();
        // Closing the task channel ends idle workers; closing the pool wakes those waiting for
        // a buffer; dropping our receiver (below, by replacing it) ends those blocked on send.
        self.tasks = None;
        self.shared.pool.close();
        let (_, never) = crossbeam_channel::bounded(0);
        drop(std::mem::replace(&mut self.done, never));
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
