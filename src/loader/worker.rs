//! The worker threads: fetch each sample, transform it into its slot, hand the batch back.
//!
//! A worker owns nothing that grows with the dataset: it shares the dataset, the transform and
//! the pool through one `Arc<Shared>`, and keeps one reusable index vector.
//!
//! A batch is made by one worker ([`Task::Whole`]) or, when batches are large, in parts by
//! several at once ([`Task::Part`]): each part writes its own samples of the one buffer, and the
//! part that finishes last hands the batch on. Parts keep the batches in flight, and so the
//! pinned buffers a first epoch must make, few (for 16 workers, 6 buffers instead of 20), and
//! the first batch is made by every worker instead of one.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};

use super::BatchHook;
use super::batch::{Batch, BatchInfo};
use super::budget::BatchPermit;
use super::stats::StageTimes;
use super::tune::Gate;
use crate::error::{Error, Result};
use crate::layout::{BatchBytes, BatchLayout, RaggedPart, Slots, seal};
use crate::memory::{DeferredFence, HostBuffer, HostPool};
use crate::sampler::Order;
use crate::source::Dataset;
use crate::trace::{Args, Track};
use crate::transform::{SampleContext, SampleTransform};

/// What every worker shares.
pub(crate) struct Shared {
    pub dataset: Arc<dyn Dataset>,
    pub transform: Arc<dyn SampleTransform>,
    pub batch_hook: Option<BatchHook>,
    pub layout: Arc<BatchLayout>,
    pub pool: HostPool,
    /// Bumped when an epoch is abandoned; tasks of older generations are skipped.
    pub generation: AtomicU64,
    pub times: StageTimes,
    /// Which workers may take tasks, when the loader chooses how many (`tune.rs`).
    pub gate: Option<Arc<Gate>>,
}

/// One job for a worker.
// One task per batch moves through the channel: a `Box` for the large variant would be an
// allocation per batch to save a copy of ~200 bytes.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Task {
    /// Make batch `number` of `order` alone, in a buffer that `permit` reserves.
    Whole {
        generation: u64,
        order: Order,
        number: u64,
        permit: BatchPermit,
    },
    /// Make part `part` of the batch that `assembly` collects (its samples
    /// `len * part / parts .. len * (part + 1) / parts`).
    Part {
        assembly: Arc<Assembly>,
        part: usize,
    },
    /// Make `buffers` buffers of the pool ahead of need, one after the other, each given back
    /// to the pool as soon as it is made: the first batches of a loader whose batches are made
    /// in parts then find their buffers made while other batches are being made, instead of
    /// every worker waiting while each batch's first part makes one. In turn, not at once:
    /// pinned blocks are made one at a time anyway (`cuda::PinnedBacking`), and the first is
    /// ready soonest.
    Warm { generation: u64, buffers: usize },
}

/// A finished batch: `None` when it was skipped (its generation is over) or abandoned midway.
pub(crate) struct Done {
    pub generation: u64,
    pub epoch: u64,
    pub number: u64,
    pub result: Option<Result<Batch>>,
}

/// A batch made in parts by several workers at once: it holds the batch's permit, then its
/// buffer (taken by the first part to start), and what the parts found; the part that finishes
/// last hands the batch on. Parts write disjoint samples of the one buffer.
pub(crate) struct Assembly {
    generation: u64,
    order: Order,
    number: u64,
    parts: usize,
    /// Parts not finished yet.
    left: AtomicUsize,
    state: Mutex<AssemblyState>,
}

#[derive(Default)]
struct AssemblyState {
    permit: Option<BatchPermit>,
    /// The buffer, once the first part has it.
    buffer: Option<HostBuffer>,
    /// Where its bytes are: parts write through this, not through `buffer`.
    bytes: Option<(NonNull<u8>, usize)>,
    /// No buffer can be had: the generation ended or the pool closed.
    abandoned: bool,
    /// The failure at the lowest sample position so far, with that position.
    failure: Option<(usize, Error)>,
    skipped: usize,
    /// Per part, in part order, where it wrote its ragged fields' values, once it has.
    ragged: Vec<Option<Vec<RaggedPart>>>,
}

// SAFETY: `bytes` points into `buffer` (a `HostBuffer`, which is `Send`), held in the same
// state; the pointer is only read under the lock and used by parts as the contract of
// `Slots::for_position` says.
unsafe impl Send for AssemblyState {}

impl Assembly {
    /// Batch `number` of `order`, to be made in `parts` parts; holds `permit` until it is made.
    pub(crate) fn new(
        generation: u64,
        order: Order,
        number: u64,
        parts: usize,
        permit: BatchPermit,
    ) -> Arc<Assembly> {
        Arc::new(Assembly {
            generation,
            order,
            number,
            parts: parts.max(1),
            left: AtomicUsize::new(parts.max(1)),
            state: Mutex::new(AssemblyState {
                permit: Some(permit),
                ..AssemblyState::default()
            }),
        })
    }

    /// The number of parts.
    pub(crate) fn parts(&self) -> usize {
        self.parts
    }

    fn lock(&self) -> MutexGuard<'_, AssemblyState> {
        // A part panicking while holding the lock leaves only counters half-written; the
        // batch's result still comes from the last part.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Worker `index`'s loop: runs until the task channel closes, the loader stops listening or
/// the gate stops it. With a `track`, each task's spans are recorded on it (and the pool's
/// allocations made here).
pub(crate) fn run(
    shared: &Shared,
    tasks: &Receiver<Task>,
    done: &Sender<Done>,
    index: usize,
    track: Option<Track>,
) {
    let _entered = track.as_ref().map(Track::enter);
    let track = track.as_ref();
    let mut indices = Vec::new();
    loop {
        if let Some(gate) = &shared.gate
            && !gate.wait_turn(index)
        {
            return;
        }
        let Ok(task) = tasks.recv() else {
            return;
        };
        let t0 = Instant::now();
        let message = match task {
            Task::Whole {
                generation,
                order,
                number,
                permit,
            } => {
                // The permit goes into the batch, or is given back here (skipped or failed).
                let result = if shared.generation.load(Ordering::Acquire) == generation {
                    let made = make_batch(
                        shared,
                        generation,
                        &order,
                        number,
                        permit,
                        &mut indices,
                        track,
                    );
                    if let Some(track) = track {
                        let args = Args::batch(order.epoch(), number);
                        track.span("batch", t0, Instant::now(), args);
                    }
                    made
                } else {
                    None
                };
                Some(Done {
                    generation,
                    epoch: order.epoch(),
                    number,
                    result,
                })
            }
            Task::Part { assembly, part } => {
                let done = make_part(shared, &assembly, part, &mut indices, track);
                if let Some(track) = track {
                    let args = Args::batch(assembly.order.epoch(), assembly.number)
                        .part(part, assembly.parts);
                    track.span("part", t0, Instant::now(), args);
                }
                done
            }
            Task::Warm {
                generation,
                buffers,
            } => {
                warm(shared, generation, buffers);
                if let Some(track) = track {
                    track.span("warm", t0, Instant::now(), Args::EMPTY);
                }
                None
            }
        };
        if let Some(message) = message
            && done.send(message).is_err()
        {
            return;
        }
    }
}

/// Makes up to `buffers` new buffers of the pool, one after the other, each free for the next
/// batch as soon as it is made (`HostPool::allocate_ahead`). A failure is the batches' to
/// report, when they allocate theirs.
fn warm(shared: &Shared, generation: u64, buffers: usize) {
    let t0 = Instant::now();
    let abandoned = || shared.generation.load(Ordering::Acquire) != generation;
    let _ = shared
        .pool
        .allocate_ahead(shared.layout.total_bytes(), buffers, abandoned);
    shared.times.add_collate(t0.elapsed());
}

/// Makes one batch alone; `None` if the task's generation ended while it was being made.
fn make_batch(
    shared: &Shared,
    generation: u64,
    order: &Order,
    number: u64,
    permit: BatchPermit,
    indices: &mut Vec<u64>,
    track: Option<&Track>,
) -> Option<Result<Batch>> {
    order.batch(number, indices);
    let t0 = Instant::now();
    let abandoned = || shared.generation.load(Ordering::Acquire) != generation;
    let mut buffer = match shared
        .pool
        .acquire_unless(shared.layout.total_bytes(), abandoned)
    {
        Ok(Some(b)) => b,
        Ok(None) | Err(Error::Shutdown) => return None,
        Err(e) => return Some(Err(e)),
    };
    let args = Args::batch(order.epoch(), number);
    shared.times.add_collate(t0.elapsed());
    if let Some(track) = track {
        track.span("buffer", t0, Instant::now(), args);
    }
    let bytes = BatchBytes::new(buffer.as_mut_slice());
    let spans = track.map(|t| (t, args));
    let (skipped, ragged) = match fill(
        shared,
        generation,
        order,
        number,
        indices,
        0..indices.len(),
        bytes,
        spans,
    ) {
        Filled::Made { skipped, ragged } => (skipped, ragged),
        Filled::Failed(_, e) => return Some(Err(e)),
        Filled::Abandoned => return None,
    };
    if let Err(e) = seal_ragged(shared, &mut buffer, indices.len(), &[ragged]) {
        return Some(Err(batch_error(number, e)));
    }
    let info = BatchInfo {
        indices: std::mem::take(indices),
        padding: order.batch_padding(number),
        skipped,
        epoch: order.epoch(),
        number,
        tokens: None,
    };
    Some(finish(shared, buffer, info, permit, spans))
}

/// Makes part `part` of `assembly`'s batch; the last part to finish returns the batch's
/// [`Done`], the others `None`.
fn make_part(
    shared: &Shared,
    assembly: &Assembly,
    part: usize,
    indices: &mut Vec<u64>,
    track: Option<&Track>,
) -> Option<Done> {
    let (generation, order, number) = (assembly.generation, &assembly.order, assembly.number);
    let spans = track.map(|t| (t, Args::batch(order.epoch(), number)));
    let abandoned = || shared.generation.load(Ordering::Acquire) != generation;
    order.batch(number, indices);
    let n = indices.len();
    let positions = n * part / assembly.parts..n * (part + 1) / assembly.parts;
    let bytes = if abandoned() {
        None
    } else {
        let mut state = assembly.lock();
        if state.buffer.is_none() && !state.abandoned && state.failure.is_none() {
            // The first part to start gets the buffer; the batch's other parts wait here for
            // it (they could not start without it).
            let t0 = Instant::now();
            match shared
                .pool
                .acquire_unless(shared.layout.total_bytes(), abandoned)
            {
                Ok(Some(mut buffer)) => {
                    let slice = buffer.as_mut_slice();
                    state.bytes = Some((NonNull::from(&mut *slice).cast::<u8>(), slice.len()));
                    state.buffer = Some(buffer);
                }
                Ok(None) | Err(Error::Shutdown) => state.abandoned = true,
                Err(e) => state.failure = Some((0, e)),
            }
            shared.times.add_collate(t0.elapsed());
            if let Some((track, args)) = spans {
                track.span("buffer", t0, Instant::now(), args);
            }
        }
        match &state.failure {
            // A sample before this part's failed: the batch's error is that one whatever this
            // part finds, so skip the work. A failure after this part's samples does not skip
            // it: one of its samples may fail first, and the batch names the first failing
            // sample, as a batch made whole does.
            Some((at, _)) if *at < positions.start || *at == 0 => None,
            _ => state.bytes,
        }
    };
    if let Some((ptr, len)) = bytes {
        // SAFETY: `ptr..ptr + len` is the assembly's buffer, which stays in the assembly (alive,
        // not moved from, not read) until every part has counted itself done below, after this
        // part's last write; parts write disjoint positions (`positions` splits `0..n`), and
        // `fill` makes one `Slots` per position.
        let bytes = unsafe { BatchBytes::from_raw(ptr, len) };
        let spans = spans.map(|(t, args)| (t, args.part(part, assembly.parts)));
        let outcome = fill(
            shared, generation, order, number, indices, positions, bytes, spans,
        );
        let mut state = assembly.lock();
        match outcome {
            Filled::Made { skipped, ragged } => {
                state.skipped += skipped;
                if state.ragged.len() < assembly.parts {
                    state.ragged.resize_with(assembly.parts, || None);
                }
                state.ragged[part] = Some(ragged);
            }
            Filled::Failed(position, e) => {
                if state.failure.as_ref().is_none_or(|(p, _)| position < *p) {
                    state.failure = Some((position, e));
                }
            }
            Filled::Abandoned => state.abandoned = true,
        }
    }
    // Release: this part's writes happen before the last part reads the state and the buffer;
    // Acquire: the last part sees every part's writes.
    if assembly.left.fetch_sub(1, Ordering::AcqRel) != 1 {
        return None;
    }
    let mut state = assembly.lock();
    // The buffer and the permit leave the assembly here, whatever happens: a failed or
    // abandoned batch gives both back before its `Done` is sent, as a whole batch does.
    let (buffer, permit) = (state.buffer.take(), state.permit.take());
    state.bytes = None;
    let ragged: Option<Vec<Vec<RaggedPart>>> = std::mem::take(&mut state.ragged)
        .into_iter()
        .collect::<Option<Vec<_>>>()
        .or_else(|| (!shared.layout.has_ragged()).then(Vec::new));
    let result = if let Some((_, e)) = state.failure.take() {
        Some(Err(e))
    } else {
        match (buffer, permit) {
            (Some(mut buffer), Some(permit)) if !state.abandoned && !abandoned() => {
                // Every part wrote its ragged values (none failed or was abandoned): put them
                // together, in part order.
                let sealed = match &ragged {
                    Some(parts) => seal_ragged(shared, &mut buffer, n, parts),
                    None => Err(Error::user("a part of the batch left no ragged values")),
                };
                if let Err(e) = sealed {
                    return Some(Done {
                        generation,
                        epoch: order.epoch(),
                        number,
                        result: Some(Err(batch_error(number, e))),
                    });
                }
                // `indices` holds the batch's indices (computed above; `fill` reads them).
                let info = BatchInfo {
                    indices: std::mem::take(indices),
                    padding: order.batch_padding(number),
                    skipped: state.skipped,
                    epoch: order.epoch(),
                    number,
                    tokens: None,
                };
                Some(finish(shared, buffer, info, permit, spans))
            }
            _ => None,
        }
    };
    Some(Done {
        generation,
        epoch: order.epoch(),
        number,
        result,
    })
}

/// Seals a made batch's ragged fields (see [`seal`]), if it has any: its parts' values
/// together, its lengths turned into offsets.
fn seal_ragged(
    shared: &Shared,
    buffer: &mut HostBuffer,
    len: usize,
    parts: &[Vec<RaggedPart>],
) -> Result<()> {
    if !shared.layout.has_ragged() {
        return Ok(());
    }
    let t0 = Instant::now();
    let sealed = seal(buffer.as_mut_slice(), &shared.layout, len, parts);
    shared.times.add_collate(t0.elapsed());
    sealed
}

/// What [`fill`] did with its samples.
enum Filled {
    /// Every sample written; this many were marked skipped; where the ragged values went.
    Made {
        skipped: usize,
        ragged: Vec<RaggedPart>,
    },
    /// The sample at this position failed.
    Failed(usize, Error),
    /// The generation ended midway.
    Abandoned,
}

/// Fetches and transforms the samples at `positions` of batch `number` (whose dataset indices
/// are `indices`) into their slots of `bytes`; with `spans`, records their summed fetch and
/// transform times as two spans (see the [trace](crate::trace) module).
#[allow(clippy::too_many_arguments)]
fn fill(
    shared: &Shared,
    generation: u64,
    order: &Order,
    number: u64,
    indices: &[u64],
    positions: std::ops::Range<usize>,
    bytes: BatchBytes<'_>,
    spans: Option<(&Track, Args)>,
) -> Filled {
    let (started, samples) = (Instant::now(), positions.len());
    let ctx = |position, index| SampleContext {
        index,
        position,
        batch: number,
        epoch: order.epoch(),
        seed: order.spec().shuffle.unwrap_or(0),
    };
    let (mut fetch_ns, mut transform_ns) = (0u64, 0u64);
    let mut skipped = 0usize;
    let (fields, slots) = (shared.layout.fields(), shared.layout.slots());
    // Streaming copies into the slots fence once, when this returns (before the batch is
    // handed on), not once per sample.
    let _fence = DeferredFence::start();
    let mut touched = vec![false; slots.len()];
    let mut ragged = RaggedPart::for_positions(&shared.layout, positions.clone(), indices.len());
    for position in positions {
        let index = indices[position];
        if position % 16 == 15 && shared.generation.load(Ordering::Relaxed) != generation {
            return Filled::Abandoned;
        }
        // SAFETY: this thread alone writes `position` of this batch (the caller's split), and
        // this `Slots` is dropped before the next position's is made.
        // The ragged regions are this part's (`for_positions` splits them as the positions).
        let mut slot = unsafe {
            Slots::for_position(bytes, fields, slots, position, &mut touched, &mut ragged)
        };
        // Debug builds mark every slot first, so that bytes the transform leaves unwritten
        // are found (`Slots::check_written`), not delivered as an earlier batch's.
        let marker = cfg!(debug_assertions);
        if marker {
            slot.fill_marker();
        }
        // User code runs here twice (a Dataset's `get`, the transform): a panic in either
        // becomes this batch's error instead of ending the worker thread.
        let outcome = catch_unwind(AssertUnwindSafe(|| -> Result<(u64, u64)> {
            let a = Instant::now();
            let sample = shared.dataset.get(index)?;
            let b = Instant::now();
            shared
                .transform
                .apply(sample, &ctx(position, index), &mut slot)?;
            slot.check_written(marker)?;
            Ok(((b - a).as_nanos() as u64, b.elapsed().as_nanos() as u64))
        }));
        let skipped_here = slot.is_skipped();
        // Beyond a ragged field's budget, the batch fails, whatever the transform made of the
        // refusal: the batch's error, not the sample's.
        if let Some(e) = over_budget(&shared.layout, &ragged) {
            return Filled::Failed(position, batch_error(number, e));
        }
        match outcome {
            Ok(Ok((f, t))) => {
                fetch_ns += f;
                transform_ns += t;
                skipped += usize::from(skipped_here);
            }
            Ok(Err(e)) => return Filled::Failed(position, sample_error(index, number, e)),
            Err(panic) => {
                let what = panic_message(&panic);
                let e = Error::user(format!("the dataset or transform panicked: {what}"));
                return Filled::Failed(position, sample_error(index, number, e));
            }
        }
    }
    shared
        .times
        .add_fetch_transform(samples, fetch_ns, transform_ns);
    if let Some((track, args)) = spans {
        let (start, args) = (track.ns(started), args.samples(samples));
        track.span_ns("fetch", start, fetch_ns, args);
        track.span_ns("transform", start + fetch_ns, transform_ns, args);
    }
    Filled::Made { skipped, ragged }
}

/// The error of the first ragged field whose values outgrew its budget in `parts`, if any.
fn over_budget(layout: &BatchLayout, parts: &[RaggedPart]) -> Option<Error> {
    let p = parts.iter().find(|p| p.over_budget().is_some())?;
    let name = &layout.fields()[p.field].name;
    let capacity = layout.ragged_capacity(p.field).unwrap_or(0);
    Some(crate::layout::over_budget(
        name,
        p.over_budget().unwrap_or(0),
        capacity,
        true,
    ))
}

/// Runs the batch hook on a made batch and gives it its permit (a `collate` span on `spans`).
fn finish(
    shared: &Shared,
    buffer: HostBuffer,
    info: BatchInfo,
    permit: BatchPermit,
    spans: Option<(&Track, Args)>,
) -> Result<Batch> {
    let number = info.number;
    let mut batch = Batch {
        buffer,
        layout: Arc::clone(&shared.layout),
        info,
        permit: None,
    };
    let t1 = Instant::now();
    if let Some(hook) = &shared.batch_hook {
        match catch_unwind(AssertUnwindSafe(|| hook(&mut batch))) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(batch_error(number, e)),
            Err(panic) => {
                let what = panic_message(&panic);
                return Err(batch_error(
                    number,
                    Error::user(format!("the batch hook panicked: {what}")),
                ));
            }
        }
    }
    shared.times.add_collate(t1.elapsed());
    shared.times.add_batch();
    if let Some((track, args)) = spans {
        track.span("collate", t1, Instant::now(), args);
    }
    batch.permit = Some(permit);
    Ok(batch)
}

fn sample_error(index: u64, batch: u64, source: Error) -> Error {
    Error::Sample {
        index,
        batch,
        source: Box::new(source),
    }
}

fn batch_error(batch: u64, source: Error) -> Error {
    Error::Batch {
        batch,
        source: Box::new(source),
    }
}

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "(a non-text panic payload)".to_owned()
    }
}

#[cfg(test)]
mod tests {
    //! Parts of one buffer written by several threads at once: under Miri (CI runs
    //! `loader::`), its data-race detector checks that parts' writes never overlap and that
    //! the last part sees every other part's writes.
    use crate::format::{DType, Field, Schema};
    use crate::source::{Dataset, Sample};
    use crate::{BatchStream, Error, Loader, Result};

    struct Numbers(Vec<u8>, Schema);

    impl Dataset for Numbers {
        fn len(&self) -> u64 {
            (self.0.len() / 8) as u64
        }
        fn schema(&self) -> &Schema {
            &self.1
        }
        fn get(&self, index: u64) -> Result<Sample<'_>> {
            let i = usize::try_from(index).map_err(|_| Error::user("index"))?;
            let bytes = self.0.get(i * 8..i * 8 + 8).ok_or(Error::OutOfRange {
                index,
                len: self.len(),
            })?;
            Sample::borrowed(bytes, &self.1)
        }
    }

    #[test]
    fn parts_of_a_batch_written_by_several_workers_hold_every_sample() -> Result<()> {
        let n = 60u64;
        let data = (0..n).flat_map(|i| (i * 7 + 2).to_le_bytes()).collect();
        let schema = Schema::new(vec![Field::tensor("x", DType::U64, &[])])?;
        let mut loader = Loader::builder(Numbers(data, schema))
            .batch_size(16)
            .workers(3)
            .batch_parts(4)
            .shuffle(9)
            .shard(0, 1)
            .build()?;
        for epoch in 0..2 {
            loader.set_epoch(epoch);
            let mut seen = vec![0u32; n as usize];
            for batch in loader.by_ref() {
                let batch = batch?;
                for (&i, &x) in batch.indices().iter().zip(batch.field::<u64>("x")?) {
                    assert_eq!(x, i * 7 + 2, "sample {i}");
                    seen[i as usize] += 1;
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "epoch {epoch}: {seen:?}");
        }
        Ok(())
    }

    /// The parts of one batch run out of order, the last part first: its failure (sample 28)
    /// must not hide the failure of an earlier sample (23) in a part that starts after it.
    #[test]
    fn a_part_that_starts_after_a_later_failure_still_reports_its_own_earlier_one() -> Result<()> {
        use std::sync::Arc;
        use std::sync::atomic::AtomicU64;

        use super::{Assembly, Shared, make_part};
        use crate::layout::BatchLayout;
        use crate::layout::{OutputField, Slots};
        use crate::loader::budget::BatchBudget;
        use crate::loader::stats::StageTimes;
        use crate::memory::HostPool;
        use crate::sampler::{OrderSpec, Remainder};
        use crate::transform::{FnTransform, SampleContext};

        let data = (0..50u64).flat_map(|i| (i * 3 + 1).to_le_bytes()).collect();
        let schema = Schema::new(vec![Field::tensor("x", DType::U64, &[])])?;
        let fields = vec![OutputField::new("x", DType::U64, &[])];
        let transform = FnTransform::new(
            fields.clone(),
            |s: Sample<'_>, ctx: &SampleContext, slots: &mut Slots<'_>| {
                if ctx.index == 23 || ctx.index == 28 {
                    return Err(Error::user(format!("bad {}", ctx.index)));
                }
                slots
                    .field(0)?
                    .copy_from_slice(s.field(0).ok_or_else(|| Error::user("no field"))?);
                Ok(())
            },
        );
        let shared = Shared {
            dataset: Arc::new(Numbers(data, schema)),
            transform: Arc::new(transform),
            batch_hook: None,
            layout: Arc::new(BatchLayout::new(fields, 10)?),
            pool: HostPool::heap(1 << 20),
            generation: AtomicU64::new(0),
            times: StageTimes::default(),
            gate: None,
        };
        let spec = OrderSpec {
            len: 50,
            batch_size: 10,
            shuffle: None,
            rank: 0,
            world: 1,
            remainder: Remainder::Wrap,
            blocks: None,
        };
        let budget = BatchBudget::new(1);
        let permit = budget
            .try_acquire()
            .ok_or_else(|| Error::user("no permit"))?;
        // Batch 2 (samples 20..30) in 4 parts: positions 0..2, 2..5, 5..7, 7..10.
        let assembly = Assembly::new(0, spec.epoch(0), 2, 4, permit);
        let mut indices = Vec::new();
        for part in [3, 0, 2] {
            assert!(make_part(&shared, &assembly, part, &mut indices, None).is_none());
        }
        let done = make_part(&shared, &assembly, 1, &mut indices, None)
            .ok_or_else(|| Error::user("the last part hands the batch on"))?;
        match done.result {
            Some(Err(Error::Sample {
                index: 23,
                batch: 2,
                ..
            })) => {}
            other => panic!("expected sample 23's error, got {other:?}"),
        }
        drop(assembly);
        assert!(budget.try_acquire().is_some(), "the permit came back");
        Ok(())
    }
}
