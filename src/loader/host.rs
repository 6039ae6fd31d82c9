//! [`Loader`]: host batches made by the worker threads, put back in order, and handed to the
//! caller; the budget's permits, the epoch made ahead, the file checks at each epoch's start,
//! and the bounded shutdown.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use super::budget::{self, BatchBudget};
use super::tune::{ConsumerClock, Tuner};

use super::worker::{Assembly, Done, Shared, Task};
use super::{
    Batch, BatchStream, Delivered, LoaderBuilder, LoaderState, LoaderStats, Next, Position,
    deadline, next_blocking,
};
use crate::error::{Error, Result};
use crate::layout::BatchLayout;
use crate::sampler::{Order, OrderSpec};
use crate::source::Dataset;

/// Yields the batches of one epoch, in order; see the [module docs](super).
///
/// An iterator of `Result<Batch>` and a [`BatchStream`]: [`set_epoch`](BatchStream::set_epoch)
/// at the top of each epoch
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
/// use gpufeed::{BatchStream, Loader};
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
    pub(super) shared: Arc<Shared>,
    /// Where the caller stands.
    pub(super) position: Position,
    /// The order of the epoch being delivered (of `position`'s epoch and start).
    pub(super) order: Order,
    pub(super) tasks: Option<Sender<Task>>,
    pub(super) done: Receiver<Done>,
    pub(super) threads: Vec<JoinHandle<()>>,
    pub(super) prefetch: usize,
    /// Parts each batch is made in (1: whole).
    pub(super) parts: usize,
    pub(super) budget: Arc<BatchBudget>,
    /// The next batch of `order` to put in flight.
    pub(super) next_dispatch: u64,
    /// Check that the dataset's files are unchanged before the next batch (set at each
    /// epoch's start; see [`Dataset::check_unchanged`]).
    pub(super) check_files: bool,
    /// Set when [`Iterator::next`] gave an error that leaves the position where it was (the
    /// files changed, the caller holds the whole budget, the threads are gone): until it is
    /// lifted the iterator ends, so that a `for` loop or `collect` stops instead of receiving
    /// the same error forever.
    pub(super) halt: Option<Halt>,
    /// Batches ahead of those dispatched that the dataset wants announced (0: none).
    pub(super) read_ahead: usize,
    /// The next batch of this epoch to announce.
    pub(super) announced: u64,
    /// Indices of the batch being announced.
    pub(super) scratch: Vec<u64>,
    /// Finished batches, by (epoch, number), waiting for their turn.
    pub(super) ready: BTreeMap<(u64, u64), Result<Batch>>,
    /// The next epoch's order, once its batches are being made ahead of time.
    pub(super) ahead: Option<Order>,
    /// Batches of `ahead` dispatched.
    pub(super) ahead_dispatch: u64,
    pub(super) speculate: bool,
    pub(super) built: Instant,
    pub(super) first_batch: Option<Duration>,
    pub(super) delivered: Delivered,
    /// The trace the loader records on, and its process number there.
    pub(super) trace: Option<(crate::trace::Trace, u32)>,
    /// The choice of the settings given as [`Auto`](super::Auto), if any.
    pub(super) tuner: Option<Tuner>,
    /// The CPUs the workers may use.
    pub(super) cpus: super::CpuBudget,
}

impl std::fmt::Debug for Loader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loader")
            .field("order", self.position.spec())
            .field("epoch", &self.position.epoch())
            .field("next_batch", &self.position.next_batch())
            .finish()
    }
}

impl Loader {
    /// The image pipeline of its transform, if it is one (the GPU path asks where it decodes).
    #[cfg(feature = "cuda")]
    pub(crate) fn image_pipeline(&self) -> Option<&crate::transform::image::ImageTransform> {
        self.shared.transform.image_pipeline()
    }
}

impl Loader {
    /// A builder over `dataset`, with PyTorch's defaults (batch 1, sequential, no drop_last).
    pub fn builder(dataset: impl Dataset + 'static) -> LoaderBuilder {
        LoaderBuilder::from_arc(Arc::new(dataset))
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

    /// The layout of every batch.
    pub fn layout(&self) -> &BatchLayout {
        &self.shared.layout
    }

    /// Starts `epoch` from its first batch in every case (the copy thread's `set_epoch`: the
    /// consumer has already decided that the position is not kept).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn restart_epoch(&mut self, epoch: u64) {
        self.position.end_resume();
        self.set_epoch(epoch);
    }

    /// The track of the loader's consumer on its trace, if it has one: the copy thread, which
    /// consumes a device loader's host batches, records its own spans there.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn consumer_track(&self) -> Option<&crate::trace::Track> {
        self.delivered.timeline.as_ref().map(|t| &t.track)
    }

    /// The loader's trace and its process number on it, if it has one.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn trace(&self) -> Option<&(crate::trace::Trace, u32)> {
        self.trace.as_ref()
    }

    /// The caller's position (the copy thread reads it to tell its own caller where it is).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn position(&self) -> &Position {
        &self.position
    }

    /// Moves to the first batch of `epoch`, keeping the batches made ahead if they are
    /// `epoch`'s and this epoch was delivered to its end, else discarding what is in flight.
    fn start_epoch(&mut self, epoch: u64) {
        let finished = self.position.next_batch() >= self.order.batches();
        self.position.restart(epoch);
        self.check_files = true;
        self.delivered.epoch_starts(epoch);
        match self.ahead.take() {
            Some(ahead) if finished && ahead.epoch() == epoch => {
                self.order = ahead;
                self.next_dispatch = std::mem::take(&mut self.ahead_dispatch);
                self.announced = 0;
            }
            _ => {
                self.abandon();
                self.order = self.position.spec().epoch(epoch);
                self.next_dispatch = 0;
            }
        }
    }

    /// Figures so far: time per stage, time waited, queue depths, pool.
    pub fn stats(&self) -> LoaderStats {
        LoaderStats {
            batches: self.delivered.batches,
            samples: self.delivered.samples,
            skipped: self.delivered.skipped,
            bytes: self.delivered.bytes,
            elapsed: self.delivered.elapsed(),
            waited: self.delivered.waited,
            first_batch: self.first_batch,
            workers: self
                .tuner
                .as_ref()
                .map_or(self.threads.len(), Tuner::active),
            in_flight: self.in_flight() as usize,
            ready: self.ready.len(),
            stages: self.shared.times.snapshot(),
            pool: self.shared.pool.stats(),
            tuning: self.tuner.as_ref().map(Tuner::report),
            cpus: self.cpus.clone(),
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
        self.next_dispatch - self.position.next_batch() + self.ahead_dispatch
    }

    pub(super) fn send(&self, task: Task) -> Result<()> {
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
    pub(super) fn dispatch(&mut self) -> Result<()> {
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
                .get_or_insert_with(|| self.position.spec().epoch(next_epoch))
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
        if self.read_ahead == 0 || self.position.next_batch() == 0 {
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
        let key = (self.order.epoch(), self.position.next_batch());
        loop {
            self.dispatch()?;
            if let Some(result) = self.ready.remove(&key) {
                return Ok(Some(result));
            }
            if self.next_dispatch <= self.position.next_batch() {
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
            let done_rx = &self.done;
            let received = self.delivered.wait(|| match deadline {
                None => done_rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
                Some(deadline) => done_rx.recv_deadline(deadline),
            });
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

impl Loader {
    /// Moves the choice of the settings given as [`Auto`](super::Auto) on, and once it is
    /// made, uses them for the batches dispatched from now on.
    fn tune(&mut self) {
        let Some(tuner) = &mut self.tuner else {
            return;
        };
        let clock = ConsumerClock {
            samples: self.delivered.samples,
            elapsed: self.delivered.elapsed(),
            waited: self.delivered.waited,
        };
        if let Some((_, prefetch, parts)) =
            tuner.step(Instant::now(), self.shared.times.work(), clock)
        {
            self.prefetch = prefetch;
            self.parts = parts;
        }
    }
}

/// Why [`Iterator::next`] ends early (see `Loader::halt`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Halt {
    FilesChanged,
    Budget,
    Shutdown,
}

impl Loader {
    fn next_until(&mut self, deadline: Option<Instant>) -> Next<Batch> {
        self.delivered.called();
        if self.position.next_batch() >= self.order.batches() {
            return Next::EndOfEpoch;
        }
        if self.check_files {
            // An epoch's first batch: are the files still the ones opened? Until they are,
            // every call says they are not (nothing of the epoch is delivered).
            if let Err(e) = self.shared.dataset.check_unchanged() {
                self.halt = Some(Halt::FilesChanged);
                return Next::Ready(Err(e));
            }
            self.check_files = false;
        }
        self.delivered
            .asked(self.order.epoch(), self.position.next_batch());
        let result = match self.receive(deadline) {
            Ok(Some(result)) => result,
            Ok(None) => return Next::Pending,
            Err(e) => {
                self.halt = Some(match e {
                    Error::Shutdown => Halt::Shutdown,
                    _ => Halt::Budget,
                });
                return Next::Ready(Err(e));
            }
        };
        self.halt = None;
        self.position.advance();
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
            self.delivered.batch(batch, batch.data_bytes());
        }
        self.tune();
        Next::Ready(result)
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

    /// The next batch of the epoch, or its error; `None` at the epoch's end (call
    /// [`set_epoch`](BatchStream::set_epoch) or [`next_epoch`](BatchStream::next_epoch) to go
    /// on).
    ///
    /// An error that leaves the position where it was ([`Error::FileChanged`] at an epoch's
    /// start, the `pool_budget` error when the caller holds every batch the budget allows,
    /// [`Error::Shutdown`]) is given once, and the iterator then ends (`None`) until the cause
    /// is gone: a batch is dropped (the budget), or [`set_epoch`](BatchStream::set_epoch) or
    /// [`load_state`](BatchStream::load_state) is called. [`state`](BatchStream::state) still
    /// names the batches not delivered. [`next_timeout`](BatchStream::next_timeout) reports
    /// such an error on every call instead.
    fn next(&mut self) -> Option<Result<Batch>> {
        match self.halt {
            None => {}
            Some(Halt::Budget) if self.budget.held() < self.budget.total() => self.halt = None,
            Some(_) => return None,
        }
        next_blocking(|| self.next_until(None))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self
            .order
            .batches()
            .saturating_sub(self.position.next_batch()) as usize;
        (left, Some(left))
    }
}

impl BatchStream for Loader {
    type Batch = Batch;

    fn epoch(&self) -> u64 {
        self.position.epoch()
    }

    fn batches_per_epoch(&self) -> u64 {
        self.position.spec().batches()
    }

    fn order_spec(&self) -> &OrderSpec {
        self.position.spec()
    }

    fn state(&self) -> LoaderState {
        self.position.state()
    }

    /// Batches in flight are discarded.
    fn load_state(&mut self, state: LoaderState) -> Result<()> {
        let (order, next) = self.position.resolve(&state)?;
        self.abandon();
        self.check_files = true;
        self.halt = None;
        self.position.resume_at(&order, next);
        self.delivered.epoch_starts(order.epoch());
        self.order = order;
        self.next_dispatch = next;
        Ok(())
    }

    /// Batches in flight are discarded, except the next epoch's first batches: once an epoch
    /// has been delivered to its end, the loader already makes the first batches of the next
    /// one (epoch + 1), so that the pipeline does not drain between epochs; asking for that
    /// epoch keeps them.
    fn set_epoch(&mut self, epoch: u64) {
        self.halt = None;
        if !self.position.keeps(epoch) {
            self.start_epoch(epoch);
        }
    }

    /// Batches already made wait in order.
    fn next_timeout(&mut self, timeout: Duration) -> Next<Batch> {
        self.next_until(deadline(timeout))
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
        // a buffer; draining the result channel (below) ends those blocked on send; closing
        // the gate ends those waiting for their turn.
        self.tasks = None;
        self.shared.pool.close();
        if let Some(gate) = &self.shared.gate {
            gate.close();
        }
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
