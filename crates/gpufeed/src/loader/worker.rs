//! The worker threads: fetch each sample, transform it into its slot, hand the batch back.
//!
//! A worker owns nothing that grows with the dataset: it shares the dataset, the transform and
//! the pool through one `Arc<Shared>`, and keeps one reusable index vector.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};

use super::BatchHook;
use super::batch::{Batch, BatchInfo, BatchLayout};
use super::budget::BatchPermit;
use super::stats::StageTimes;
use crate::error::{Error, Result};
use crate::memory::HostPool;
use crate::sampler::Order;
use crate::source::Dataset;
use crate::transform::{SampleContext, SampleTransform, Slots};

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
}

/// Make batch `number` of `order`, in a buffer that `permit` reserves.
pub(crate) struct Task {
    pub generation: u64,
    pub order: Order,
    pub number: u64,
    pub permit: BatchPermit,
}

/// A finished task: `None` when it was skipped (its generation is over) or abandoned midway.
pub(crate) struct Done {
    pub generation: u64,
    pub epoch: u64,
    pub number: u64,
    pub result: Option<Result<Batch>>,
}

/// A worker's loop: runs until the task channel closes or the loader stops listening.
pub(crate) fn run(shared: &Shared, tasks: &Receiver<Task>, done: &Sender<Done>) {
    let mut indices = Vec::new();
    while let Ok(task) = tasks.recv() {
        let (generation, epoch, number) = (task.generation, task.order.epoch(), task.number);
        // The permit goes into the batch, or is given back here (skipped or failed tasks).
        let result = if shared.generation.load(Ordering::Acquire) == generation {
            make_batch(shared, task, &mut indices)
        } else {
            None
        };
        let message = Done {
            generation,
            epoch,
            number,
            result,
        };
        if done.send(message).is_err() {
            return;
        }
    }
}

/// Makes one batch; `None` if the task's generation ended while it was being made.
fn make_batch(shared: &Shared, task: Task, indices: &mut Vec<u64>) -> Option<Result<Batch>> {
    task.order.batch(task.number, indices);
    let t0 = Instant::now();
    let abandoned = || shared.generation.load(Ordering::Acquire) != task.generation;
    let buffer = match shared
        .pool
        .acquire_unless(shared.layout.total_bytes(), abandoned)
    {
        Ok(Some(b)) => b,
        Ok(None) | Err(Error::Shutdown) => return None,
        Err(e) => return Some(Err(e)),
    };
    let mut batch = Batch {
        buffer,
        layout: Arc::clone(&shared.layout),
        info: BatchInfo {
            indices: Vec::new(),
            padding: task.order.batch_padding(task.number),
            skipped: 0,
            epoch: task.order.epoch(),
            number: task.number,
        },
        permit: None,
    };
    let acquired = Instant::now();
    shared.times.add_collate(acquired - t0);
    let ctx = |position, index| SampleContext {
        index,
        position,
        batch: task.number,
        epoch: task.order.epoch(),
        seed: task.order.spec().shuffle.unwrap_or(0),
    };
    let (mut fetch_ns, mut transform_ns) = (0u64, 0u64);
    let mut skipped = 0usize;
    let (fields, slots) = (shared.layout.fields(), shared.layout.slots());
    let mut touched = vec![false; slots.len()];
    let buf = batch.buffer.as_mut_slice();
    for (position, &index) in indices.iter().enumerate() {
        if position % 16 == 15 && shared.generation.load(Ordering::Relaxed) != task.generation {
            return None;
        }
        let mut slot = Slots::new(buf, fields, slots, position, &mut touched);
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
        match outcome {
            Ok(Ok((f, t))) => {
                fetch_ns += f;
                transform_ns += t;
                skipped += usize::from(slot.is_skipped());
            }
            Ok(Err(e)) => return Some(Err(sample_error(index, task.number, e))),
            Err(panic) => {
                let what = panic_message(&panic);
                return Some(Err(sample_error(
                    index,
                    task.number,
                    Error::user(format!("the dataset or transform panicked: {what}")),
                )));
            }
        }
    }
    shared.times.add_fetch_transform(fetch_ns, transform_ns);
    batch.info.indices = std::mem::take(indices);
    batch.info.skipped = skipped;
    let t1 = Instant::now();
    if let Some(hook) = &shared.batch_hook {
        match catch_unwind(AssertUnwindSafe(|| hook(&mut batch))) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Some(Err(batch_error(task.number, e))),
            Err(panic) => {
                let what = panic_message(&panic);
                return Some(Err(batch_error(
                    task.number,
                    Error::user(format!("the batch hook panicked: {what}")),
                )));
            }
        }
    }
    shared.times.add_collate(t1.elapsed());
    shared.times.add_batch();
    batch.permit = Some(task.permit);
    Some(Ok(batch))
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
