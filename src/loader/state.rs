//! Where a loader stands, and the one set of rules that moves it: [`LoaderState`] (what a
//! checkpoint saves) and `Position` (what every loader keeps of its caller's place: the epoch,
//! the batches delivered in it, and whether it was just resumed).

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::sampler::{BlockShuffle, Order, OrderSpec, Remainder};

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
/// [`resume`](super::LoaderBuilder::resume), and run the same loop from the state's epoch. Its
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
/// use gpufeed::{BatchStream, Dataset, Loader, LoaderState};
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
    /// A token loader's stream: its settings and where each source stands (`None` for other
    /// loaders; see [`TokenState`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<TokenState>,
    /// The data set's [fingerprint](crate::Dataset::fingerprint), 16 hex digits: a resume
    /// refuses a state taken on other data of the same length. `None` for a data set without
    /// one (and in states saved before fingerprints were recorded: those resume on any data
    /// of their length, as they did).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<String>,
}

/// What a [`TokenLoader`](crate::tokens::TokenLoader)'s state holds beyond the global batch it
/// stands at (`next_batch` counts global batches, the same on every rank): the settings that
/// decide its stream, which a resume checks, and the blend's and each source's place at that
/// batch.
///
/// The stream is a pure function of (seed, epoch, global position) and these settings, so the
/// places are what the position implies: a resume recomputes them from `next_batch` (they are
/// here to be read, and so that a checkpoint says how far each source is).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenState {
    /// Tokens per row.
    pub seq_len: u64,
    /// How rows are made: `concatenated` or `packed`.
    pub mode: String,
    /// Documents per window (of a shuffle, or of packing).
    pub window: u64,
    /// Each source, in the order given.
    pub sources: Vec<TokenSourceState>,
}

/// One source of a [`TokenState`]: what it is (checked on resume) and where it stands.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenSourceState {
    /// Its name, for messages: the path, or the field read (not checked: data may move).
    #[serde(default)]
    pub name: String,
    /// Its [fingerprint](crate::source::tokens::TokenSource::fingerprint), 16 hex digits:
    /// a resume refuses a state whose source had another. `None` in states saved before
    /// fingerprints were recorded: those are checked by their sizes only, as they were.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<String>,
    /// Its documents.
    pub documents: u64,
    /// Its tokens.
    pub tokens: u64,
    /// Rows (samples) in one of its own epochs.
    pub rows: u64,
    /// Its samples in each epoch of the loader: the blend's exact count.
    pub per_epoch: u64,
    /// Its samples in the loader's epoch before the state's position.
    pub taken: u64,
    /// The source's own epoch that its next sample belongs to.
    pub epoch: u64,
    /// That sample's row in that source epoch, a row being `seq_len` tokens (`seq_len + 1`
    /// with the last input's label) of the epoch's concatenated documents, or one row the
    /// packer filled: rows are counted from 0 in the epoch's shuffled order, so row `r` is the
    /// `r`-th row this source gives in that epoch.
    pub row: u64,
    /// For a text source (tokenized as it is read; its `tokens` and `rows` are the build's
    /// estimate of one pass, `epoch` is its pass): where in the pass its stream stands, what a
    /// resume starts from without tokenizing the pass up to there. `None` for pre-tokenized
    /// sources.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<TextPlace>,
}

/// Where a text source's stream stands in a state: the window its next row's tokens start
/// in (for concatenated rows, the start of the block of rows shuffled together), so that a
/// resume tokenizes from that window on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TextPlace {
    /// The row of the source's stream (all its passes end to end) that the pass starts at.
    pub first_row: u64,
    /// The window's place in the pass's order of windows.
    pub window: u64,
    /// Tokens (concatenated rows) or rows (packed rows) of the pass before that window.
    pub before: u64,
}

impl LoaderState {
    /// Refuses a state taken on data of another `fingerprint` and the same length `len` (a
    /// state or a data set without one is not checked; another length is the order's
    /// mismatch, which [`position`](Self::position) describes).
    pub(crate) fn check_data(&self, fingerprint: Option<&str>, len: u64) -> Result<()> {
        match (self.fingerprint.as_deref(), fingerprint) {
            (Some(saved), Some(ours)) if saved != ours && self.order.len == len => {
                Err(Error::mismatch(format!(
                    "cannot resume: the state was taken on other data: the data set's fingerprint \
                 (its files' sizes and sampled bytes) was {saved} when it was saved, it is {ours} \
                 here, with the same {} samples; resume on the data the state was taken on, or \
                 start anew without the state",
                    self.order.len
                )))
            }
            _ => Ok(()),
        }
    }

    /// The order and next batch that resume this state under `spec`.
    pub(crate) fn position(&self, spec: &OrderSpec) -> Result<(Order, u64)> {
        if !self.order.same_sequence(spec) {
            return Err(Error::mismatch(format!(
                "cannot resume: the state was saved with other order settings: {}",
                order_differences(&self.order, spec, &RECORD_WORDS)
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

/// How a loader's users name the settings of an [`OrderSpec`], for messages.
pub(crate) struct OrderWords {
    /// What `len` counts.
    pub samples: &'static str,
    /// What `batch_size` is.
    pub batch: &'static str,
    /// What each remainder policy is, as the user chose it.
    pub remainder: fn(Remainder) -> &'static str,
}

/// A data loader's words: samples of the data set, its `drop_last` and `evaluation`.
pub(crate) const RECORD_WORDS: OrderWords = OrderWords {
    samples: "samples in the data set",
    batch: "batch size",
    remainder: |r| match r {
        Remainder::Wrap => "neither drop_last nor evaluation",
        Remainder::Drop => "drop_last",
        Remainder::Mask => "evaluation",
    },
};

/// What differs between the order settings a state was saved with and a loader's, in words,
/// with both values: `batch size 64 (this loader: 32); shuffle seed 3 (this loader: 5)`.
pub(crate) fn order_differences(saved: &OrderSpec, ours: &OrderSpec, words: &OrderWords) -> String {
    let seed = |s: Option<u64>| {
        s.map_or("no shuffle (file order)".to_owned(), |s| {
            format!("shuffle seed {s}")
        })
    };
    let blocks = |b: &Option<BlockShuffle>| match b {
        None => "no two-level shuffle".to_owned(),
        Some(b) => format!(
            "a two-level shuffle (windows of {} shards, blocks of {} samples, shards {:016x})",
            b.window, b.block, b.shards_digest
        ),
    };
    let mut out = Vec::new();
    let mut differs = |saved: String, ours: String| {
        if saved != ours {
            out.push(format!("{saved} (this loader: {ours})"));
        }
    };
    differs(
        format!("{} {}", saved.len, words.samples),
        format!("{} {}", ours.len, words.samples),
    );
    differs(
        format!("{} {}", words.batch, saved.batch_size),
        format!("{} {}", words.batch, ours.batch_size),
    );
    differs(seed(saved.shuffle), seed(ours.shuffle));
    differs(
        (words.remainder)(saved.remainder).to_owned(),
        (words.remainder)(ours.remainder).to_owned(),
    );
    if saved.blocks != ours.blocks {
        differs(blocks(&saved.blocks), blocks(&ours.blocks));
    }
    if out.is_empty() {
        "none that decides the order".to_owned()
    } else {
        out.join("; ")
    }
}

/// The caller's place in its loader's epochs, and the rules that move it, shared by every
/// loader (see [`BatchStream`](super::BatchStream)): a state is taken from it, a resume and
/// `set_epoch` decide from it whether the position is kept, and each batch delivered moves it
/// on.
#[derive(Clone, Debug)]
pub(crate) struct Position {
    spec: OrderSpec,
    /// The data set's fingerprint, hex (see [`LoaderState::fingerprint`]).
    fingerprint: Option<String>,
    epoch: u64,
    /// Positions of the epoch consumed before this run's first batch of it (an elastic restart).
    start: u64,
    /// Batches of `epoch` delivered to the caller.
    next_batch: u64,
    /// Set by a resume, until the next batch or `set_epoch`: a `set_epoch` of the same epoch
    /// then keeps the position.
    resumed: bool,
}

impl Position {
    /// At the start of `order` (a new loader), or `next_batch` into it and marked resumed.
    pub(crate) fn new(
        spec: OrderSpec,
        fingerprint: Option<String>,
        order: &Order,
        next_batch: u64,
        resumed: bool,
    ) -> Position {
        Position {
            spec,
            fingerprint,
            epoch: order.epoch(),
            start: order.start(),
            next_batch,
            resumed,
        }
    }

    /// The settings that decide the order.
    pub(crate) fn spec(&self) -> &OrderSpec {
        &self.spec
    }

    /// The epoch being delivered.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Batches of the epoch delivered.
    pub(crate) fn next_batch(&self) -> u64 {
        self.next_batch
    }

    /// What resuming from here yields: the batches not yet delivered.
    pub(crate) fn state(&self) -> LoaderState {
        LoaderState {
            epoch: self.epoch,
            next_batch: self.next_batch,
            start: self.start,
            order: self.spec.clone(),
            tokens: None,
            fingerprint: self.fingerprint.clone(),
        }
    }

    /// The order and next batch that resume `state` under this loader's settings; moves
    /// nothing (a state that does not fit is an error and leaves the position as it was).
    pub(crate) fn resolve(&self, state: &LoaderState) -> Result<(Order, u64)> {
        state.check_data(self.fingerprint.as_deref(), self.spec.len)?;
        state.position(&self.spec)
    }

    /// Moves to a resolved state (see [`resolve`](Self::resolve)), marked resumed.
    pub(crate) fn resume_at(&mut self, order: &Order, next_batch: u64) {
        self.epoch = order.epoch();
        self.start = order.start();
        self.next_batch = next_batch;
        self.resumed = true;
    }

    /// Whether `set_epoch(epoch)` keeps the position: right after a resume into `epoch`, or at
    /// the start of `epoch` (nothing of it delivered). Ends the resume either way.
    pub(crate) fn keeps(&mut self, epoch: u64) -> bool {
        let resumed = std::mem::take(&mut self.resumed);
        let at_start = self.next_batch == 0 && self.start == 0;
        epoch == self.epoch && (resumed || at_start)
    }

    /// Ends the resume without moving (a consumer that has already decided not to keep it).
    pub(crate) fn end_resume(&mut self) {
        self.resumed = false;
    }

    /// Moves to the first batch of `epoch`.
    pub(crate) fn restart(&mut self, epoch: u64) {
        self.epoch = epoch;
        self.start = 0;
        self.next_batch = 0;
        self.resumed = false;
    }

    /// One more batch delivered to the caller.
    pub(crate) fn advance(&mut self) {
        self.next_batch += 1;
        self.resumed = false;
    }
}
