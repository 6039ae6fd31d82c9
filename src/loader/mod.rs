//! The loader: worker threads that share one dataset and collate batches into pooled buffers.
//!
//! [`Loader::builder`] takes a [`Dataset`](crate::source::Dataset) and PyTorch's vocabulary (`batch_size`, `shuffle`,
//! `workers`, `prefetch`, `drop_last`, `shard`); `build()` checks every setting, starts the
//! worker threads once, and the loader then yields the batches of one epoch, in order, as an
//! iterator of `Result<Batch>`. [`Loader::set_epoch`] starts another epoch on the same threads.
//! [`Loader::next_timeout`] waits for the next batch at most so long, for callers that must
//! look up now and then (a Python binding checking for Ctrl-C).
//!
//! How a batch is made (see `worker.rs`): the loader puts the batch's number on a task channel;
//! a free worker computes its sample indices from the [`Order`](crate::sampler::Order), takes a
//! buffer from the [`HostPool`](crate::memory::HostPool) (waiting if the byte budget is used up: backpressure), and for
//! each sample calls [`Dataset::get`](crate::source::Dataset::get) (a view into the mapping) and the
//! [`SampleTransform`](crate::transform::SampleTransform), which writes straight into the
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
mod builder;
mod host;
mod probe;
mod sizing;
mod state;
mod stats;
mod stream;
mod tune;
mod verdict;
mod worker;

use std::sync::Arc;

pub use batch::{Batch, BatchInfo, TokenCounts};
pub use builder::LoaderBuilder;
pub use host::{Loader, SHUTDOWN_WAIT, detached_workers};
pub use sizing::{
    CpuBudget, MAX_AUTO_WORKERS, MAX_WORKERS, default_parts, default_prefetch,
    default_ragged_budget, default_workers, rank_from_env,
};
pub use state::{LoaderState, TextPlace, TokenSourceState, TokenState};
pub(crate) use state::{OrderWords, Position, order_differences};
#[cfg_attr(not(feature = "cuda"), allow(unused_imports))]
pub(crate) use stats::ConsumerTimeline;
pub(crate) use stats::Delivered;
pub use stats::{LoaderStats, StageSnapshot};
pub use stream::{BatchStream, Next};
pub(crate) use stream::{deadline, next_blocking};
pub use tune::{Auto, Choice, Setting, TUNE_LIMIT, Trial, Tuning};
pub use verdict::{BUFFER_WAIT, BUSY, Bound, Verdict, WAITED_LITTLE};

use crate::error::Result;

/// A hook run on each whole batch, in the worker, after its samples are written.
pub type BatchHook = Arc<dyn Fn(&mut Batch) -> Result<()> + Send + Sync>;
