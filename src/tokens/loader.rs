//! [`TokenLoader`]: the token stream as a loader, and [`TokenLoaderBuilder`], its settings.
//!
//! A token loader is a [`Loader`] over this rank's rows,
//! with the rules of a global stream around it: the inner loader orders the rank's rows
//! sequentially, one global batch per batch, and its transform ([`RowWriter`]) makes each row
//! from the global stream; its batch hook lays out each batch's `cu_seqlens`. Workers, batches
//! made in parts, the pool and its budget, pinned buffers, the copy stream, the epoch made
//! ahead, the file checks at each epoch and the shutdown are the loader's own. What this adds
//! is the translation of positions: the inner loader counts batches of this rank, which are
//! the global batches one for one, so a state is (epoch, global batch) with the global order's
//! settings, and resumes under any world size.

use std::sync::Arc;
use std::time::Duration;

use super::blend::{Blend, check_weights};
use super::index::{SampleMode, SourceIndex};
use super::rows::{Labels, RowDtypes, RowSlots, RowWriter};
use super::stream::{Shares, Stream, StreamSource, source_seed};
use super::text::{DEFAULT_CACHE_BYTES, TextIndex, TextStats};
use crate::error::{Error, Result};
use crate::file::fingerprint_hex;
use crate::format::DType;
use crate::loader::{
    BatchInfo, BatchStream, Loader, LoaderBuilder, LoaderState, Next, OrderWords, Setting,
    TokenSourceState, TokenState, default_workers, order_differences, rank_from_env,
};
use crate::sampler::{OrderSpec, Remainder};
use crate::source::tokens::{TextTokens, TokenSource};
use crate::trace::Trace;

/// A source as given to the builder: token ids, or text and a tokenizer.
#[derive(Clone)]
enum Given {
    Tokens(Arc<dyn TokenSource>),
    Text(Arc<TextTokens>),
}

impl Given {
    fn name(&self) -> String {
        match self {
            Given::Tokens(s) => s.name(),
            Given::Text(t) => t.name(),
        }
    }

    /// The dtype its ids fit: a token file's, or the narrowest of u16 and u32 that holds the
    /// tokenizer's vocabulary.
    #[cfg(feature = "cuda")]
    fn dtype(&self) -> DType {
        match self {
            Given::Tokens(s) => s.dtype(),
            Given::Text(t) if t.tokenizer().vocab_size() <= 1 << 16 => DType::U16,
            Given::Text(_) => DType::U32,
        }
    }
}

/// Settings of a [`TokenLoader`]; see [`TokenLoader::builder`].
pub struct TokenLoaderBuilder {
    sources: Vec<(Given, f64)>,
    text_cache: u64,
    seq_len: usize,
    global_batch: usize,
    mode: SampleMode,
    seed: Option<u64>,
    window: u64,
    samples_per_epoch: Option<u64>,
    shard: Option<(u64, u64)>,
    shard_env: bool,
    drop_last: bool,
    ignore_index: i64,
    mask_document_ends: Option<bool>,
    pad_id: u32,
    dtypes: RowDtypes,
    workers: Option<Setting>,
    prefetch: Option<Setting>,
    batch_parts: Option<Setting>,
    pool_budget: Option<u64>,
    epoch: u64,
    resume: Option<LoaderState>,
    across_epochs: bool,
    trace: Option<Trace>,
}

/// What a token loader knows beyond its inner loader: the stream, the shares, the global
/// order's settings; what translates its states.
#[derive(Clone)]
struct Settings {
    stream: Arc<Stream>,
    shares: Shares,
    spec: OrderSpec,
    /// The inner loader's order settings (to translate states).
    inner_spec: OrderSpec,
    window: u64,
    mode: SampleMode,
    seq_len: u64,
    dtypes: RowDtypes,
}

/// A token loader's settings and the inner loader's builder, before it is built.
struct Built {
    settings: Settings,
    inner: LoaderBuilder,
}

impl TokenLoaderBuilder {
    /// Adds a source with weight 1 (see [`weighted`](Self::weighted)).
    pub fn source(self, source: Arc<dyn TokenSource>) -> Self {
        self.weighted(source, 1.0)
    }

    /// Adds a source of this weight in the blend: each epoch takes its share of the epoch's
    /// samples exactly (see [`Blend`]). Weights need not sum to 1.
    pub fn weighted(mut self, source: Arc<dyn TokenSource>, weight: f64) -> Self {
        self.sources.push((Given::Tokens(source), weight));
        self
    }

    /// Adds a text source with weight 1 (see [`weighted_text`](Self::weighted_text)).
    pub fn text(self, source: Arc<TextTokens>) -> Self {
        self.weighted_text(source, 1.0)
    }

    /// Adds a text source ([`TextTokens`]: a text field and a tokenizer) of this weight,
    /// tokenized in the workers as the stream reaches it (see the [module docs](super), "Text
    /// sources"): its token counts are not known ahead, so an epoch's length is
    /// [`samples_per_epoch`](Self::samples_per_epoch) if given, else estimated from its first
    /// window, and its share of each epoch is exact in rows, not in passes over it.
    pub fn weighted_text(mut self, source: Arc<TextTokens>, weight: f64) -> Self {
        self.sources.push((Given::Text(source), weight));
        self
    }

    /// The byte limit of each text source's cache of tokenized windows (default 256 MiB),
    /// counted in the [`pool_budget`](Self::pool_budget) when one is given.
    pub fn text_cache(mut self, bytes: u64) -> Self {
        self.text_cache = bytes;
        self
    }

    /// How rows are made (default [`SampleMode::Concatenated`]).
    pub fn mode(mut self, mode: SampleMode) -> Self {
        self.mode = mode;
        self
    }

    /// Shuffles with this seed: windows, documents within windows and rows, anew each epoch
    /// (default: sequential, in file order).
    pub fn shuffle(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Documents per window (default 1,024): concatenated rows shuffle documents within
    /// windows and windows within the epoch; packed rows pack each window alone (more
    /// documents pack tighter). The memory kept is 8 bytes per window.
    pub fn window(mut self, documents: u64) -> Self {
        self.window = documents;
        self
    }

    /// Samples (rows) in an epoch (default: one epoch of every source, their rows summed).
    /// Each source gives its weight's share of them, exactly; a source whose share is more
    /// than its rows goes round its own epochs (each a new shuffle), one with fewer reads part
    /// of one.
    pub fn samples_per_epoch(mut self, n: u64) -> Self {
        self.samples_per_epoch = Some(n);
        self
    }

    /// This rank's share of every global batch (default rank 0 of 1: the whole batch).
    pub fn shard(mut self, rank: u64, world: u64) -> Self {
        self.shard = Some((rank, world));
        self.shard_env = false;
        self
    }

    /// Reads the rank and world size at `build()` from torchrun's or Slurm's variables
    /// ([`rank_from_env`]).
    pub fn shard_from_env(mut self) -> Self {
        self.shard_env = true;
        self
    }

    /// Drops an epoch's last global batch if it is short (default false: it is shared as any
    /// other, and ranks' missing rows are padding rows).
    pub fn drop_last(mut self, yes: bool) -> Self {
        self.drop_last = yes;
        self
    }

    /// The label where there is nothing to predict (default -100, PyTorch's).
    pub fn ignore_index(mut self, index: i64) -> Self {
        self.ignore_index = index;
        self
    }

    /// Ignores the label of each document's last token (default: on for packed rows, off for
    /// concatenated rows, as Megatron's `GPTDataset`).
    pub fn mask_document_ends(mut self, yes: bool) -> Self {
        self.mask_document_ends = Some(yes);
        self
    }

    /// The token that pads rows (default 0); its labels are ignored.
    pub fn pad_id(mut self, id: u32) -> Self {
        self.pad_id = id;
        self
    }

    /// The dtype of `input_ids` (default i64; u16, u32, i32 also).
    pub fn input_dtype(mut self, dtype: DType) -> Self {
        self.dtypes.input_ids = dtype;
        self
    }

    /// The dtype of `labels` (default i64; i32 also).
    pub fn label_dtype(mut self, dtype: DType) -> Self {
        self.dtypes.labels = dtype;
        self
    }

    /// The dtype of `position_ids` (default i64; i32 also).
    pub fn position_dtype(mut self, dtype: DType) -> Self {
        self.dtypes.position_ids = dtype;
        self
    }

    /// Worker threads (default: the loader's, [`default_workers`](crate::loader::default_workers)),
    /// or [`Auto`](crate::loader::Auto): chosen from a measurement on the first batches, as
    /// [`LoaderBuilder::workers`] chooses them.
    pub fn workers(mut self, n: impl Into<Setting>) -> Self {
        self.workers = Some(n.into());
        self
    }

    /// Batches in flight (default: the loader's), or [`Auto`](crate::loader::Auto): from the
    /// workers, within the memory budget.
    pub fn prefetch(mut self, n: impl Into<Setting>) -> Self {
        self.prefetch = Some(n.into());
        self
    }

    /// Parts each batch is made in (default: the loader's: by every worker for batches of
    /// 4 MiB or more), or [`Auto`](crate::loader::Auto): from the workers.
    pub fn batch_parts(mut self, n: impl Into<Setting>) -> Self {
        self.batch_parts = Some(n.into());
        self
    }

    /// The byte budget of the batch buffers (default: the loader's).
    pub fn pool_budget(mut self, bytes: u64) -> Self {
        self.pool_budget = Some(bytes);
        self
    }

    /// The first epoch (default 0).
    pub fn epoch(mut self, epoch: u64) -> Self {
        self.epoch = epoch;
        self
    }

    /// Resumes from a token loader's state, under any world size: the next batch is the
    /// state's next global batch.
    pub fn resume(mut self, state: LoaderState) -> Self {
        self.resume = Some(state);
        self
    }

    /// Makes the next epoch's first batches while an epoch ends (default true).
    pub fn prefetch_across_epochs(mut self, yes: bool) -> Self {
        self.across_epochs = yes;
        self
    }

    /// Records the loader's timeline into `trace` (see [`LoaderBuilder::trace`]).
    pub fn trace(mut self, trace: &Trace) -> Self {
        self.trace = Some(trace.clone());
        self
    }

    /// Checks the settings, reads every source's index once, and starts the workers.
    pub fn build(self) -> Result<TokenLoader> {
        let built = self.prepare(None)?;
        let loader = built.inner.build()?;
        Ok(TokenLoader::wrap(loader, built.settings))
    }

    /// As [`build`](Self::build), with the batches on `device` (feature `cuda`): the workers
    /// write narrow integers into pinned buffers (`input_ids` as u16 when every source stores
    /// 16-bit tokens, else as u32 for i64 ids; `labels` as i32 for 16-bit tokens;
    /// `position_ids` as u16 for rows of at most 65,536 tokens), the copy thread copies each
    /// batch and widens them on the device ([`Widen`](crate::cuda::Widen)) to the dtypes this
    /// builder names; `document_ids` and `cu_seqlens` are i32 on both sides. `opts` are the
    /// device loader's (depth, poison, mask, indices).
    #[cfg(feature = "cuda")]
    pub fn build_device(
        self,
        device: &crate::cuda::Device,
        opts: crate::cuda::DeviceLoaderOptions,
    ) -> Result<TokenLoader<crate::cuda::DeviceLoader>> {
        let sources: Vec<DType> = self.sources.iter().map(|(s, _)| s.dtype()).collect();
        let labels = self.labels();
        let (wire, widen) = self
            .dtypes
            .wire(&sources, self.seq_len as u64, &labels, self.pad_id);
        let built = self.prepare(Some(wire))?;
        let opts = widen.into_iter().fold(opts, |o, (field, dtype)| {
            o.widen(crate::cuda::Widen::new(field, dtype))
        });
        let loader = crate::cuda::DeviceLoader::from_builder(built.inner, device, opts)?;
        Ok(TokenLoader::wrap(loader, built.settings))
    }

    /// What labels hold where there is nothing to predict, as set.
    fn labels(&self) -> Labels {
        Labels {
            ignore_index: self.ignore_index,
            mask_document_ends: self
                .mask_document_ends
                .unwrap_or(self.mode == SampleMode::Packed),
        }
    }

    /// The checks and the inner loader's settings; `host_dtypes`: the row dtypes the host
    /// writes, when they are not the user's (for a loader that widens them after the copy).
    fn prepare(self, host_dtypes: Option<RowDtypes>) -> Result<Built> {
        if self.sources.is_empty() {
            return Err(Error::config("sources", "no source of tokens was given"));
        }
        if self.seq_len == 0 {
            return Err(Error::config("seq_len", "a row holds at least one token"));
        }
        if self.global_batch == 0 {
            return Err(Error::config("global_batch", "must be at least 1"));
        }
        if self.window == 0 {
            return Err(Error::config(
                "window",
                "a window holds at least one document",
            ));
        }
        let (rank, world) = match (self.shard_env, self.shard) {
            (true, _) => rank_from_env()?,
            (false, Some(s)) => s,
            (false, None) => (0, 1),
        };
        if world == 0 {
            return Err(Error::config("world", "the world size must be at least 1"));
        }
        if rank >= world {
            return Err(Error::config(
                "rank",
                format!("rank {rank} is not below the world size {world}"),
            ));
        }
        let labels = self.labels();
        self.dtypes.check(&labels, self.seq_len as u64)?;
        self.dtypes.check_pad(self.pad_id)?;
        let rows = (self.global_batch as u64).div_ceil(world);
        // cu_seqlens are i32 offsets into a batch's tokens, as flash-attention takes them.
        if rows.saturating_mul(self.seq_len as u64 + 1) > i32::MAX as u64 {
            return Err(Error::config(
                "seq_len",
                format!(
                    "{rows} rows of {} tokens are more than i32 cu_seqlens can count",
                    self.seq_len
                ),
            ));
        }
        // The weights first (a pass over every index is not cheap), one source as many.
        let weights: Vec<f64> = self.sources.iter().map(|(_, w)| *w).collect();
        let name = |i: usize| self.sources[i].0.name();
        check_weights(&weights, &name)?;
        let seq_len = self.seq_len as u64;
        // Windows a text source tokenizes at once: one per worker.
        let workers = match self.workers {
            Some(Setting::Fixed(n)) => n.max(1),
            _ => default_workers(false),
        };
        let indexes = self
            .sources
            .iter()
            .enumerate()
            .map(|(i, (s, _))| match s {
                Given::Tokens(s) => Ok(StreamSource::Tokens(SourceIndex::build(
                    Arc::clone(s),
                    self.mode,
                    seq_len,
                    self.window,
                )?)),
                Given::Text(t) => Ok(StreamSource::Text(Box::new(TextIndex::build(
                    Arc::clone(t),
                    self.mode,
                    seq_len,
                    self.window,
                    source_seed(self.seed, i),
                    workers,
                    self.text_cache,
                )?))),
            })
            .collect::<Result<Vec<_>>>()?;
        // The tokenizers' memory (the model, an encoder per worker) and the caches of
        // tokenized windows come out of the budget the user gave.
        let text_bytes: u64 = self
            .sources
            .iter()
            .filter_map(|(s, _)| match s {
                Given::Text(t) => {
                    let m = t.tokenizer().memory();
                    Some(m.model as u64 + (m.per_encoder as u64) * workers as u64 + self.text_cache)
                }
                Given::Tokens(_) => None,
            })
            .sum();
        let pool_budget = match self.pool_budget {
            Some(b) if text_bytes > 0 && b <= text_bytes => {
                return Err(Error::config(
                    "pool_budget",
                    format!(
                        "{b} bytes do not hold the text sources' tokenizers and caches of                          tokenized windows ({text_bytes} bytes with {workers} workers) and any                          batch: raise it, or lower text_cache"
                    ),
                ));
            }
            Some(b) => Some(b - text_bytes),
            None => None,
        };
        let samples = self
            .samples_per_epoch
            .unwrap_or_else(|| indexes.iter().map(StreamSource::rows).sum());
        if samples == 0 {
            return Err(Error::config(
                "samples_per_epoch",
                "an epoch holds at least one sample",
            ));
        }
        let blend = Blend::named(&weights, samples, &name)?;
        let stream = Arc::new(Stream::new(indexes, blend, self.seed));
        let shares = Shares {
            samples,
            global_batch: self.global_batch as u64,
            rank,
            world,
            drop_last: self.drop_last,
        };
        let batches = shares.batches();
        if batches == 0 {
            return Err(Error::config(
                "drop_last",
                format!(
                    "an epoch of {samples} samples holds no whole global batch of {}",
                    self.global_batch
                ),
            ));
        }
        let spec = OrderSpec {
            len: samples,
            batch_size: self.global_batch as u64,
            shuffle: self.seed,
            rank,
            world,
            remainder: if self.drop_last {
                Remainder::Drop
            } else {
                Remainder::Mask
            },
            blocks: None,
        };
        let inner_spec = OrderSpec {
            len: batches * rows,
            batch_size: rows,
            shuffle: None,
            rank: 0,
            world: 1,
            remainder: Remainder::Wrap,
            blocks: None,
        };
        let writer = Arc::new(RowWriter {
            stream: Arc::clone(&stream),
            shares,
            seq_len: self.seq_len,
            dtypes: host_dtypes.unwrap_or(self.dtypes),
            labels,
            pad_id: self.pad_id,
        });
        let hook = Arc::clone(&writer);
        let dataset = RowSlots::new(Arc::clone(&stream), batches * rows)?;
        let mut inner = Loader::builder(dataset)
            .batch_size(rows as usize)
            .transform(writer)
            .batch_hook(move |batch| hook.finish(batch))
            .epoch(self.epoch)
            .prefetch_across_epochs(self.across_epochs);
        if let Some(w) = self.workers {
            inner = inner.workers(w);
        }
        if let Some(p) = self.prefetch {
            inner = inner.prefetch(p);
        }
        if let Some(p) = self.batch_parts {
            inner = inner.batch_parts(p);
        }
        if let Some(b) = pool_budget {
            inner = inner.pool_budget(b);
        }
        if let Some(t) = &self.trace {
            inner = inner.trace(t);
        }
        let settings = Settings {
            stream,
            shares,
            spec,
            inner_spec,
            window: self.window,
            mode: self.mode,
            seq_len,
            dtypes: self.dtypes,
        };
        if let Some(state) = self.resume {
            inner = inner.resume(settings.translate(&state)?);
        }
        Ok(Built { settings, inner })
    }
}

impl Settings {
    /// The token part of a state of this stream at global batch `next_batch` of `epoch`;
    /// with `places`, each text source's place too (which may tokenize up to it).
    fn token_state(&self, epoch: u64, next_batch: u64, places: bool) -> TokenState {
        let g = next_batch
            .saturating_mul(self.shares.global_batch)
            .min(self.shares.samples);
        let taken = self.stream.blend.taken_before(g);
        let sources = self
            .stream
            .sources
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let (source_epoch, row, text) = match s {
                    StreamSource::Tokens(_) => {
                        let place = self.stream.place_of(i, epoch, taken[i]).ok();
                        (
                            place.map_or(0, |p| p.source_epoch),
                            place.map_or(0, |p| p.row),
                            None,
                        )
                    }
                    StreamSource::Text(t) if places => self
                        .stream
                        .stream_row(i, epoch, taken[i])
                        .and_then(|q| t.place(q))
                        .map_or((0, 0, None), |(pass, row, place)| (pass, row, Some(place))),
                    StreamSource::Text(_) => (0, 0, None),
                };
                TokenSourceState {
                    name: s.name(),
                    fingerprint: Some(fingerprint_hex(s.fingerprint())),
                    documents: s.documents(),
                    tokens: s.tokens(),
                    rows: s.rows(),
                    per_epoch: self.stream.blend.counts()[i],
                    taken: taken[i],
                    epoch: source_epoch,
                    row,
                    text,
                }
            })
            .collect();
        TokenState {
            seq_len: self.seq_len,
            mode: self.mode.name().to_owned(),
            window: self.window,
            sources,
        }
    }

    /// Tells each text source that its rows before global batch `next_batch` of `epoch` are
    /// delivered: its stream keeps what the rows from there on need, nothing before.
    fn release_before(&self, epoch: u64, next_batch: u64) {
        if !self
            .stream
            .sources
            .iter()
            .any(|s| matches!(s, StreamSource::Text(_)))
        {
            return;
        }
        let g = next_batch
            .saturating_mul(self.shares.global_batch)
            .min(self.shares.samples);
        let taken = self.stream.blend.taken_before(g);
        for (i, s) in self.stream.sources.iter().enumerate() {
            if let StreamSource::Text(t) = s
                && let Ok(q) = self.stream.stream_row(i, epoch, taken[i])
            {
                t.release_before(q);
            }
        }
    }

    /// Puts each text source's stream at the state's place (a state checked to be this
    /// stream's), so that it tokenizes from there on.
    fn resume_text(&self, state: &LoaderState, saved: &TokenState) -> Result<()> {
        let g = state
            .next_batch
            .saturating_mul(self.shares.global_batch)
            .min(self.shares.samples);
        let taken = self.stream.blend.taken_before(g);
        for (i, s) in self.stream.sources.iter().enumerate() {
            let StreamSource::Text(t) = s else { continue };
            let Some(place) = saved.sources[i].text else {
                return Err(Error::mismatch(format!(
                    "cannot resume: the state has no place for source {i} ({}), a text source: \
                     it was saved by a loader that could not tell where that source stood",
                    s.name()
                )));
            };
            let q = self.stream.stream_row(i, state.epoch, taken[i])?;
            t.resume_at(q, saved.sources[i].epoch, &place)?;
        }
        Ok(())
    }

    /// The inner loader's state for a token loader's `state`, checked against these settings
    /// (any rank and world size): the same order, stream settings and sources, each with the
    /// same sizes and (where the state has one) fingerprint.
    fn translate(&self, state: &LoaderState) -> Result<LoaderState> {
        if !state.order.same_sequence(&self.spec) {
            return Err(Error::mismatch(format!(
                "cannot resume: the state was saved with other order settings: {}",
                order_differences(&state.order, &self.spec, &TOKEN_WORDS)
            )));
        }
        let Some(tokens) = &state.tokens else {
            return Err(Error::mismatch(
                "cannot resume: the state is not a token loader's (it has no token stream settings)",
            ));
        };
        let ours = self.token_state(state.epoch, state.next_batch, false);
        let differences = stream_differences(tokens, &ours);
        if !differences.is_empty() {
            return Err(Error::mismatch(format!(
                "cannot resume: the state was saved with another token stream: {}",
                differences.join("; ")
            )));
        }
        let batches = self.shares.batches();
        if state.next_batch > batches {
            return Err(Error::mismatch(format!(
                "cannot resume: the state's next batch {} is past the epoch's {batches} global batches",
                state.next_batch
            )));
        }
        self.resume_text(state, tokens)?;
        Ok(LoaderState {
            epoch: state.epoch,
            next_batch: state.next_batch,
            start: 0,
            order: self.inner_spec.clone(),
            tokens: None,
            fingerprint: None,
        })
    }
}

/// A token loader's words for its order settings.
const TOKEN_WORDS: OrderWords = OrderWords {
    samples: "samples per epoch",
    batch: "global batch size",
    remainder: |r| match r {
        Remainder::Drop => "drop_last",
        Remainder::Mask | Remainder::Wrap => "no drop_last",
    },
};

/// What differs between the token stream a state was saved with and this loader's, in words,
/// with both values; empty when nothing does. A source's sizes or fingerprint that differ
/// name the source; a fingerprint is compared only where the state has one (states saved
/// before fingerprints were recorded are checked by their sizes).
fn stream_differences(saved: &TokenState, ours: &TokenState) -> Vec<String> {
    let mut out = Vec::new();
    if saved.seq_len != ours.seq_len {
        out.push(format!(
            "seq_len {} (this loader: {})",
            saved.seq_len, ours.seq_len
        ));
    }
    if saved.mode != ours.mode {
        out.push(format!(
            "{} rows (this loader: {} rows)",
            saved.mode, ours.mode
        ));
    }
    if saved.window != ours.window {
        out.push(format!(
            "windows of {} documents (this loader: {})",
            saved.window, ours.window
        ));
    }
    if saved.sources.len() != ours.sources.len() {
        out.push(format!(
            "{} sources (this loader: {})",
            saved.sources.len(),
            ours.sources.len()
        ));
        return out;
    }
    for (i, (a, b)) in saved.sources.iter().zip(&ours.sources).enumerate() {
        let named = if a.name.is_empty() || a.name == b.name {
            format!("source {i} ({})", b.name)
        } else {
            format!("source {i} ({}; {} in the state)", b.name, a.name)
        };
        let sizes = |s: &TokenSourceState| {
            format!(
                "{} documents, {} tokens, {} rows an epoch",
                s.documents, s.tokens, s.rows
            )
        };
        if (a.documents, a.tokens, a.rows) != (b.documents, b.tokens, b.rows) {
            out.push(format!(
                "{named}: {} (this loader: {}): other data",
                sizes(a),
                sizes(b)
            ));
        } else if let (Some(x), Some(y)) = (&a.fingerprint, &b.fingerprint)
            && x != y
        {
            out.push(format!(
                "{named}: other data of the same size ({}): its fingerprint (sizes and bytes \
                 sampled from its files) was {x}, it is {y} here: rewritten, re-tokenized or \
                 another file",
                sizes(b)
            ));
        } else if a.per_epoch != b.per_epoch {
            out.push(format!(
                "{named}: {} samples an epoch (this loader: {}): the weights differ",
                a.per_epoch, b.per_epoch
            ));
        }
    }
    if !out.is_empty() {
        out.push(
            "resume with the sources and settings the state was saved with, or start anew without the state"
                .into(),
        );
    }
    out
}

/// What a token loader delivered: rows, tokens, padding, and each source's rows.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct TokenStats {
    /// Batches delivered.
    pub batches: u64,
    /// Rows delivered (padding rows included).
    pub rows: u64,
    /// Tokens of documents delivered.
    pub tokens: u64,
    /// Padding tokens delivered.
    pub padding: u64,
    /// Rows of each source, in the order the sources were given.
    pub rows_per_source: Vec<u64>,
}

impl TokenStats {
    /// The share of the delivered tokens that is padding (0 to 1).
    pub fn padding_fraction(&self) -> f64 {
        let all = self.tokens + self.padding;
        if all == 0 {
            0.0
        } else {
            self.padding as f64 / all as f64
        }
    }

    /// Each source's share of the rows that came from a source (0 to 1 each).
    pub fn shares(&self) -> Vec<f64> {
        let all: u64 = self.rows_per_source.iter().sum();
        self.rows_per_source
            .iter()
            .map(|&r| if all == 0 { 0.0 } else { r as f64 / all as f64 })
            .collect()
    }

    fn add(&mut self, info: &BatchInfo) {
        let Some(t) = info.tokens() else { return };
        self.batches += 1;
        self.rows += info.len() as u64;
        self.tokens += t.tokens;
        self.padding += t.padding;
        if self.rows_per_source.len() < t.rows_per_source.len() {
            self.rows_per_source.resize(t.rows_per_source.len(), 0);
        }
        for (a, b) in self.rows_per_source.iter_mut().zip(&t.rows_per_source) {
            *a += b;
        }
    }
}

/// Language-model batches of a global token stream: concatenated or packed rows of
/// `seq_len` tokens from one source or a weighted blend, each rank's share of every global
/// batch, resumable exactly under any world size. See the [module docs](super).
///
/// `L` is the loader underneath: [`Loader`] (host batches; [`TokenLoaderBuilder::build`]) or,
/// with feature `cuda`, a `cuda::DeviceLoader` (device batches, their
/// integer fields widened on the GPU; `TokenLoaderBuilder::build_device`).
pub struct TokenLoader<L = Loader> {
    inner: L,
    settings: Settings,
    delivered: TokenStats,
}

impl<L> std::fmt::Debug for TokenLoader<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenLoader")
            .field("order", &self.settings.spec)
            .field("seq_len", &self.settings.seq_len)
            .field("mode", &self.settings.mode)
            .finish()
    }
}

impl TokenLoader {
    /// A builder of rows of `seq_len` tokens in global batches of `global_batch` rows; add
    /// sources with [`source`](TokenLoaderBuilder::source) or
    /// [`weighted`](TokenLoaderBuilder::weighted).
    pub fn builder(seq_len: usize, global_batch: usize) -> TokenLoaderBuilder {
        TokenLoaderBuilder {
            sources: Vec::new(),
            seq_len,
            global_batch,
            mode: SampleMode::Concatenated,
            seed: None,
            window: 1024,
            samples_per_epoch: None,
            shard: None,
            shard_env: false,
            text_cache: DEFAULT_CACHE_BYTES,
            drop_last: false,
            ignore_index: -100,
            mask_document_ends: None,
            pad_id: 0,
            dtypes: RowDtypes {
                input_ids: DType::I64,
                labels: DType::I64,
                position_ids: DType::I64,
            },
            workers: None,
            prefetch: None,
            batch_parts: None,
            pool_budget: None,
            epoch: 0,
            resume: None,
            across_epochs: true,
            trace: None,
        }
    }
}

impl<L> TokenLoader<L> {
    fn wrap(inner: L, settings: Settings) -> TokenLoader<L> {
        TokenLoader {
            inner,
            settings,
            delivered: TokenStats::default(),
        }
    }

    /// Counts a batch handed to the caller; the rows before the next one are released.
    fn delivered(&mut self, batch: &BatchInfo) {
        self.delivered.add(batch);
        self.settings.release_before(batch.epoch, batch.number + 1);
    }

    /// The loader underneath (its figures: [`Loader::stats`]).
    pub fn loader(&self) -> &L {
        &self.inner
    }

    /// What was delivered so far: rows, tokens, padding, rows per source.
    pub fn token_stats(&self) -> &TokenStats {
        &self.delivered
    }

    /// Tokens per row.
    pub fn seq_len(&self) -> u64 {
        self.settings.seq_len
    }

    /// Rows of every batch of this rank (`ceil(global_batch / world)`).
    pub fn rows_per_batch(&self) -> u64 {
        self.settings.shares.rows()
    }

    /// How rows are made.
    pub fn mode(&self) -> SampleMode {
        self.settings.mode
    }

    /// The dtypes of the integer fields as delivered.
    pub fn dtypes(&self) -> RowDtypes {
        self.settings.dtypes
    }

    /// Each source's samples in an epoch (the blend's exact counts).
    pub fn samples_per_source(&self) -> &[u64] {
        self.settings.stream.blend.counts()
    }

    /// Each source's rows in one of its own epochs, and its tokens (a text source's: the
    /// build's estimate of one pass).
    pub fn source_sizes(&self) -> Vec<(u64, u64)> {
        self.settings
            .stream
            .sources
            .iter()
            .map(|s| (s.rows(), s.tokens()))
            .collect()
    }

    /// Each source's tokenization so far (`None` for a pre-tokenized source): passes
    /// completed, windows, documents and tokens tokenized, the estimate of a pass.
    pub fn text_stats(&self) -> Vec<Option<TextStats>> {
        self.settings
            .stream
            .sources
            .iter()
            .map(|s| match s {
                StreamSource::Text(t) => Some(t.stats()),
                StreamSource::Tokens(_) => None,
            })
            .collect()
    }
}

impl<L: BatchStream> TokenLoader<L> {
    /// The state with `next_batch` global batches of the current epoch delivered: the stream's
    /// places as they stood there. For a batch taken from the loader but not used (a
    /// binding's hand-over that failed), `state_at(state().next_batch - 1)` resumes with it.
    pub fn state_at(&self, next_batch: u64) -> LoaderState {
        let epoch = self.inner.state().epoch;
        LoaderState {
            epoch,
            next_batch,
            start: 0,
            order: self.settings.spec.clone(),
            tokens: Some(self.settings.token_state(epoch, next_batch, true)),
            fingerprint: None,
        }
    }
}

impl<L> Iterator for TokenLoader<L>
where
    L: BatchStream,
    L::Batch: std::ops::Deref<Target = BatchInfo>,
{
    type Item = Result<L::Batch>;

    fn next(&mut self) -> Option<Result<L::Batch>> {
        let next = self.inner.next();
        if let Some(Ok(batch)) = &next {
            self.delivered(batch);
        }
        next
    }
}

impl<L> BatchStream for TokenLoader<L>
where
    L: BatchStream,
    L::Batch: std::ops::Deref<Target = BatchInfo>,
{
    type Batch = L::Batch;

    fn epoch(&self) -> u64 {
        self.inner.epoch()
    }

    /// Global batches in an epoch (each rank gets a share of every one).
    fn batches_per_epoch(&self) -> u64 {
        self.inner.batches_per_epoch()
    }

    /// The global order: samples of an epoch, the global batch, the seed, this rank and world.
    fn order_spec(&self) -> &OrderSpec {
        &self.settings.spec
    }

    /// The epoch and the global batches delivered in it, with the stream's settings and
    /// places ([`TokenState`]).
    fn state(&self) -> LoaderState {
        self.state_at(self.inner.state().next_batch)
    }

    /// Puts the loader at the state's next global batch, whatever world size saved it.
    fn load_state(&mut self, state: LoaderState) -> Result<()> {
        let inner = self.settings.translate(&state)?;
        self.inner.load_state(inner)
    }

    fn set_epoch(&mut self, epoch: u64) {
        self.inner.set_epoch(epoch)
    }

    fn next_timeout(&mut self, timeout: Duration) -> Next<L::Batch> {
        let next = self.inner.next_timeout(timeout);
        if let Next::Ready(Ok(batch)) = &next {
            self.delivered(batch);
        }
        next
    }
}
