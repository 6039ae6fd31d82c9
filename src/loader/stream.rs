//! The face every loader shows a training loop: epochs of batches, a position to save and
//! resume, and a wait for the next batch that can time out.
//!
//! [`Loader`](super::Loader) (host batches) and `cuda::DeviceLoader` (device batches) both
//! implement [`BatchStream`]; code that drives a loader without caring where its batches live
//! (the Python binding, the command's bench, a user's training loop) is written once, against
//! the trait. A new loader mode (another kind of batch, another producer) implements it too.

use std::time::{Duration, Instant};

use super::LoaderState;
use crate::error::Result;
use crate::sampler::OrderSpec;

/// What a bounded wait for the next batch found ([`BatchStream::next_timeout`]).
#[derive(Debug)]
pub enum Next<B> {
    /// The next batch of the epoch, or its error, as [`Iterator::next`] gives it.
    Ready(Result<B>),
    /// No batch came within the timeout. The position did not move: ask again.
    Pending,
    /// The epoch has been delivered to its end (where [`Iterator::next`] gives `None`).
    EndOfEpoch,
}

/// A loader: the batches of one epoch as an iterator of `Result<Batch>`, epochs chosen with
/// [`set_epoch`](Self::set_epoch), and a [`LoaderState`] that resumes exactly where it stands.
///
/// The rules are the same for every loader:
///
/// - **Epochs.** [`set_epoch`](Self::set_epoch) at the top of every epoch (PyTorch's
///   `set_epoch`), then take the epoch's batches; the iterator ends (`None`) at its end.
/// - **Resume.** [`state`](Self::state) counts the batches delivered to the caller;
///   [`load_state`](Self::load_state) (or the builder's `resume`) puts the loader back there,
///   and the first `set_epoch` of the state's own epoch keeps that position, so the same loop
///   serves fresh and resumed runs (torchdata's `StatefulDataLoader`).
/// - **Waiting.** [`next_timeout`](Self::next_timeout) waits at most so long; a timeout changes
///   nothing, no batch is lost or skipped.
///
/// ```
/// # use gpufeed::{DType, Dataset};
/// # use gpufeed::source::{npy_header, Zip};
/// # fn data() -> gpufeed::Result<(tempfile::TempDir, Zip<gpufeed::NpyArray>)> {
/// #     let dir = tempfile::tempdir().map_err(gpufeed::Error::user)?;
/// #     let x = dir.path().join("x.npy");
/// #     let mut b = npy_header(DType::U32, &[100])?;
/// #     b.extend((0..100u32).flat_map(|i| i.to_le_bytes()));
/// #     std::fs::write(&x, b).map_err(gpufeed::Error::user)?;
/// #     Ok((dir, Zip::npy([("x", &x)])?))
/// # }
/// # fn main() -> gpufeed::Result<()> {
/// # let (_dir, dataset) = data()?;
/// use gpufeed::{BatchStream, BatchInfo, Loader};
///
/// /// Any loader, host or device: the samples of its epochs, in order.
/// fn samples<L>(loader: &mut L, epochs: u64) -> gpufeed::Result<usize>
/// where
///     L: BatchStream,
///     L::Batch: std::ops::Deref<Target = BatchInfo>,
/// {
///     let mut n = 0;
///     for epoch in 0..epochs {
///         loader.set_epoch(epoch);
///         for batch in loader.by_ref() {
///             n += batch?.len();
///         }
///     }
///     Ok(n)
/// }
///
/// let mut loader = Loader::builder(dataset).batch_size(32).shuffle(7).build()?;
/// assert_eq!(samples(&mut loader, 2)?, 200);
/// # Ok(())
/// # }
/// ```
pub trait BatchStream: Iterator<Item = Result<Self::Batch>> {
    /// What the loader delivers: [`Batch`](super::Batch) on the host,
    /// `cuda::DeviceBatch` on a GPU.
    type Batch;

    /// The epoch being delivered.
    fn epoch(&self) -> u64;

    /// Batches in an epoch, for this rank.
    fn batches_per_epoch(&self) -> u64;

    /// The settings that decide the order: samples, batch size, shuffle, rank and world size.
    fn order_spec(&self) -> &OrderSpec;

    /// Where the caller stands: resuming from it yields the batches not yet delivered.
    /// Batches made or copied ahead are not counted.
    fn state(&self) -> LoaderState;

    /// Puts the loader where `state` says (torchdata's `load_state_dict`): the next batches are
    /// the rest of `state.epoch`, and work in flight is discarded. Fails, changing nothing, if
    /// the state was saved with other order settings or is past its epoch's end.
    fn load_state(&mut self, state: LoaderState) -> Result<()>;

    /// Starts epoch `epoch` from its first batch, abandoning what is left of the current one.
    ///
    /// Right after a resume, asking for the state's own epoch keeps the position instead (the
    /// rest of that epoch comes next); asking for the epoch the loader stands at the start of
    /// changes nothing either (its first batches, made since it was built or ahead of time, are
    /// kept).
    fn set_epoch(&mut self, epoch: u64);

    /// Starts the epoch after the current one.
    fn next_epoch(&mut self) {
        let next = self.epoch().saturating_add(1);
        self.set_epoch(next);
    }

    /// Like [`Iterator::next`], but waits at most `timeout`; a timeout changes nothing (no batch
    /// is lost or skipped, the position does not move), so the caller can do something else,
    /// such as look for an interrupt, and ask again.
    fn next_timeout(&mut self, timeout: Duration) -> Next<Self::Batch>;
}

/// The deadline of a wait of `timeout` from now; a timeout too large for an `Instant` is a wait
/// without a deadline.
pub(crate) fn deadline(timeout: Duration) -> Option<Instant> {
    Instant::now().checked_add(timeout)
}

/// [`Iterator::next`] from a loader's wait until a deadline, called without one: only a
/// deadline times out, so `Pending` is waited through.
pub(crate) fn next_blocking<B>(mut next_until: impl FnMut() -> Next<B>) -> Option<Result<B>> {
    loop {
        match next_until() {
            Next::Ready(result) => return Some(result),
            Next::EndOfEpoch => return None,
            Next::Pending => {}
        }
    }
}
