//! Token streams for language-model training: rows of `seq_len` tokens from
//! [`TokenSource`](crate::source::tokens::TokenSource)s, concatenated or packed, blended by
//! weight, shared by ranks, resumable exactly under any world size.
//!
//! ```text
//!  sources (.bin/.idx, train.bin, .npy, a dataset's field)      one number per window of documents
//!      │                                                         (index.rs: tokens, or rows packed)
//!      ▼
//!  global stream: position g of epoch e ──Blend──▶ source i, its k-th sample of the epoch
//!  (stream.rs)                                    ──▶ row r of the source's own epoch
//!      │                                              (windows permuted, rows permuted)
//!      ▼
//!  rank r of w: its share of each global batch (Shares), padded to ceil(B / w) rows
//!      │
//!      ▼
//!  Loader over the rank's rows ── RowWriter (a SampleTransform) writes input_ids, labels,
//!  (workers, parts, pool,          position_ids, document_ids; the batch hook lays out
//!   pinned buffers, resume)        cu_seqlens and the batch's TokenCounts
//!      │
//!      ▼
//!  TokenLoader: BatchStream of host batches (input_ids, labels, position_ids of the dtypes
//!  the builder names), or of device batches (build_device: narrow integers over PCIe,
//!  widened on the GPU by the copy stage's Widen kernels)
//! ```
//!
//! What each module owns:
//!
//! | module | owns |
//! |---|---|
//! | [`pack`] | packing a window of documents into rows: best-fit decreasing (and first-fit, for comparison) |
//! | `blend` | [`Blend`]: exact per-epoch counts of each source and their interleave |
//! | `index` | a source's windows, an epoch's order of them, the pieces of row `r` |
//! | `stream` | the global stream (position -> source and row), the ranks' shares of a global batch |
//! | `rows` | writing rows into batch slots; `cu_seqlens` and counts per batch |
//! | `text` | a text source's rows: windows tokenized as the stream reaches them, a shared bounded cache, [`TextStats`] |
//! | `loader` | [`TokenLoader`], [`TokenLoaderBuilder`] (host and, with `cuda`, device batches), states, [`TokenStats`] |
//!
//! # Rows
//!
//! *Concatenated* ([`SampleMode::Concatenated`], Megatron's `GPTDataset`): an epoch's documents
//! end to end, in a shuffled order, cut into windows of `seq_len + 1` tokens that overlap by
//! one, so that `labels` are `input_ids` shifted by one; every token of the epoch is an input
//! of exactly one row (the last row is padded). *Packed* ([`SampleMode::Packed`]): whole
//! documents placed into rows by best-fit decreasing over windows of documents (longer ones
//! split into full rows), `position_ids` restarting at each document and `cu_seqlens` marking
//! them, so that no token attends across documents; the padding is counted
//! ([`TokenStats::padding_fraction`]).
//!
//! The shuffle is two-level for documents (windows of `window` consecutive documents in a
//! permuted order, the documents of each window permuted) and global for rows (Megatron's
//! sample shuffle): rows of a batch come from unrelated parts of the data. Packing is done
//! window by window in file order and is the same every epoch (only the rows' order changes),
//! so that an epoch's rows can be counted once, when the loader is built.
//!
//! # Epochs of each source
//!
//! A source's epochs are its own: each is a new order of its documents (and rows) in which every
//! token is an input once (concatenated) or every document placed once (packed). The loader's
//! epoch takes each source's share of [`samples_per_epoch`](TokenLoaderBuilder::samples_per_epoch)
//! from where that source stopped: a source whose share is more than its rows goes on into its
//! next epoch (a new shuffle) within the loader's epoch, and one whose share is less continues
//! its epoch in the loader's next. With one source and the default `samples_per_epoch` the two
//! kinds of epoch are the same.
//!
//! # Text sources
//!
//! A text field of any source with the user's tokenizer ([`TextTokens`](crate::source::tokens::TextTokens),
//! added with [`weighted_text`](TokenLoaderBuilder::weighted_text)) is a source like the
//! others, in both row modes, in blends with pre-tokenized sources, with the same fields,
//! labels, masks, `cu_seqlens`, ranks and states. It is tokenized in the loader's worker
//! threads, each with its own [`Encoder`](crate::tokenizer::Encoder), one document per call
//! (never the `tokenizers` crate's `encode_batch` or its thread pool); each document's ids are
//! the tokenizer's, the EOS appended (an empty document is the template and the EOS alone).
//! Its token counts are learned as it is read (the `text` module's docs have the mechanism):
//!
//! - **First batch within seconds, whatever the corpus size.** Building the loader tokenizes
//!   one window of documents (the estimate below); the first batch needs only the windows
//!   its rows are in (concatenated: the block of `window` rows they are shuffled in). No pass
//!   over the corpus comes first.
//! - **Memory bounded, independent of the corpus size.** The tokenized windows are kept in a
//!   cache shared by the workers, bounded in bytes ([`text_cache`](TokenLoaderBuilder::text_cache),
//!   256 MiB by default: counted in [`pool_budget`](TokenLoaderBuilder::pool_budget) when one
//!   is given, with each tokenizer's model and an encoder per worker); at most one window per
//!   worker is tokenized ahead of the rows asked for. What grows with the corpus is the
//!   windows' running sums of the current and the previous pass: a few tens of bytes per
//!   window of `window` documents, nothing per document (as pre-tokenized sources keep 8
//!   bytes per window).
//! - **Resume exact, without tokenizing the past.** The order of a pass is canonical: windows
//!   permuted by (seed, pass), documents within a window by (seed, pass, window), packing
//!   window by window; nothing depends on ranks or workers. A state names, for each text
//!   source, its pass and the window its next row's block starts in, with the tokens (or rows)
//!   of the pass before it ([`TextPlace`](crate::loader::TextPlace)); a loader of any world size
//!   and number of workers resumed from it tokenizes from that window on, and its stream is the
//!   uninterrupted one.
//! - **What a weight means.** An epoch's length must be known when it starts (the blend's exact
//!   counts need it): it is [`samples_per_epoch`](TokenLoaderBuilder::samples_per_epoch) if
//!   given, else the pre-tokenized sources' rows plus, for each text source, an estimate of a
//!   pass: the rows of its first window in file order (tokenized at build), times its documents
//!   over the window's, the same whatever the ranks and workers. A source's share is then exact
//!   in rows per loader epoch (its weight's share of `N`, Tijdeman's interleave, as for
//!   pre-tokenized sources); a text source's passes follow each other across loader epochs
//!   without a row lost or repeated, so what is not exact is that a loader epoch is one pass
//!   of it. [`TokenLoader::text_stats`] reports the passes completed and the estimate.
//! - **Order without shuffle.** Concatenated rows are the corpus's documents' ids end to end in
//!   file order, the EOS after each.
//!
//! What it costs against pre-tokenized sources: rows are shuffled within blocks, not over the
//! pass (packed: a window's rows; concatenated: `window` consecutive rows), so a batch's rows
//! come from a few windows at a time where Megatron shuffles every sample of the epoch; every
//! rank tokenizes the whole stream (the running sums need every window's size, and ranks do
//! not talk), so the tokenizer's rate per rank must match the whole job's consumption; a pass
//! is not a loader epoch; going back to an epoch before the one the loader started or resumed
//! at (`set_epoch` backwards) tokenizes again from the last pass start known before it.
//!
//! # Fields
//!
//! Each row has `input_ids` (`pad_id` past its tokens), `labels` (below), `position_ids` (from
//! 0 at each document's piece), `document_ids` (the piece of its row each token belongs to,
//! from 0, -1 for padding: a document mask is `document_ids[i] == document_ids[j]`), and the
//! batch has `cu_seqlens`,
//! its sequences' offsets (each piece, and each row's padding as one more) as
//! flash-attention's varlen kernels take them, in a field of `rows * (seq_len + 1)` entries of
//! which the first [`TokenCounts::sequences`](crate::loader::TokenCounts::sequences)` + 1` count
//! (the rest repeat the last). [`BatchInfo::tokens`](crate::BatchInfo::tokens) has the counts,
//! on the host, for device batches too.
//!
//! Labels are shifted before padding: a row is read as a window of up to `seq_len + 1` tokens,
//! `labels[t]` is the window's token `t + 1`, and every place without a next token in the
//! window (the padding, and the last input of a row cut short by the end of its source's epoch)
//! gets the ignore index ([`ignore_index`](TokenLoaderBuilder::ignore_index), -100 by default:
//! what PyTorch's `cross_entropy` ignores), never `pad_id`. With
//! [`mask_document_ends`](TokenLoaderBuilder::mask_document_ends) (default on for packed rows,
//! off for concatenated ones) the label of each document's last token is the ignore index too:
//! nothing is learnt from predicting the next document's first token.
//!
//! # Batches
//!
//! The [`BatchInfo`](crate::BatchInfo) of a token batch speaks of global batches and rows:
//!
//! - [`number()`](crate::BatchInfo::number) is the global batch's number in the epoch, the
//!   same on every rank; after a resume, under any world size, it goes on from the state's
//!   `next_batch` (the first batch resumed is number `next_batch`, as it would have been
//!   without the stop), unlike a data loader's elastic resume, whose numbers start again
//!   from 0;
//! - [`indices()`](crate::BatchInfo::indices) are the rows' positions in the epoch's global
//!   stream (0 to `samples_per_epoch - 1`; what decides each row's source and row), and
//!   `u64::MAX` for a padding row;
//! - [`padding()`](crate::BatchInfo::padding) counts the padding rows, always the last ones:
//!   the rows of a rank beyond its share of a global batch (every rank's batch has
//!   `ceil(global_batch / world)` rows, and an epoch's last global batch can be short).
//!   Their `document_ids` are -1 and every label is the ignore index. Padding *tokens* within
//!   rows are counted in [`TokenCounts::padding`](crate::loader::TokenCounts::padding).
//!
//! # Resume
//!
//! The stream is a pure function of (seed, epoch, global position) and the settings. A state
//! ([`TokenLoader::state`](crate::BatchStream::state)) names the epoch and the global batches
//! delivered in it, with the global order's settings and the stream's ([`TokenState`](crate::loader::TokenState):
//! sources, their sizes and fingerprints, the blend's counts, and each source's place); a
//! loader of any rank and world size resumes from it at the next global batch. Mixture and
//! packing need nothing else: both are functions of the position.
//!
//! A resume checks that the state is this stream's: the same order settings, `seq_len`,
//! mode, window, sources with the same sizes and, from each source's
//! [`fingerprint`](crate::source::tokens::TokenSource::fingerprint) (its files' sizes and 256
//! KiB sampled from them), the same data; a state that differs is refused, the message saying
//! which setting or source differs and how. Each source's place is its own epoch
//! ([`TokenSourceState::epoch`](crate::loader::TokenSourceState::epoch)) and the row of that
//! epoch its next sample is ([`row`](crate::loader::TokenSourceState::row): rows counted in
//! the epoch's shuffled order, so the source has given `row` rows of that epoch).
//!
//! # Against Megatron's `GPTDataset`
//!
//! Concatenated rows are `GPTDataset`'s samples (windows of `seq_len + 1` tokens overlapping by
//! one, labels the inputs shifted by one, `position_ids` restarting at each document as with
//! `reset_position_ids`); the stream differs from megatron-core's in four ways:
//!
//! 1. **Epochs are separate.** `GPTDataset` builds one document index of `num_epochs` copies of
//!    the documents shuffled together (a document can come twice before another comes once; only
//!    a last epoch used less than 80% is shuffled apart), and its sample index runs across the
//!    copies. Here each source epoch is its own order: every token once before any comes again.
//! 2. **The shuffle.** `GPTDataset` permutes documents uniformly and its shuffle index permutes
//!    every sample of every epoch (numpy's `RandomState`). Here documents are shuffled in two
//!    levels (windows of [`window`](TokenLoaderBuilder::window) consecutive documents in a
//!    permuted order, documents permuted within each window) and rows uniformly within each
//!    source epoch, by keyed permutations computed per position: no index is stored, and the
//!    same seed gives another order than Megatron's.
//! 3. **The end of an epoch.** `GPTDataset` drops the last partial sample (training split);
//!    here the last row of each source epoch is padded (`pad_id`, labels ignored), so that
//!    every token is an input, and no row spans two epochs: an epoch has
//!    `ceil(tokens / seq_len)` rows where `GPTDataset` has `floor((tokens - 1) / seq_len)`
//!    per epoch.
//! 4. **Blends.** Megatron's `BlendedDataset` asks each dataset for 0.5% more samples than its
//!    share and takes, at each position, the dataset furthest behind its weight; here each
//!    source gives exactly its share of every epoch (largest remainders) in Tijdeman's
//!    interleave, within 2 samples of its share over any window ([`Blend`]).
//!
//! Padding is also marked otherwise: `GPTDataset` puts the tokenizer's pad id (or -1) in its
//! tokens and labels and 0 in its `loss_mask`; here labels hold the ignore index and there is
//! no loss mask.
//!
//! ```
//! # fn main() -> gpufeed::Result<()> {
//! use std::sync::Arc;
//! use gpufeed::BatchStream;
//! use gpufeed::source::tokens::FlatTokens;
//! use gpufeed::tokens::{SampleMode, TokenLoader};
//!
//! # let dir = tempfile::tempdir().map_err(gpufeed::Error::user)?;
//! # let path = dir.path().join("train.bin");
//! # let tokens: Vec<u8> = (0..10_000u16).flat_map(|t| (t % 50_000).to_le_bytes()).collect();
//! # std::fs::write(&path, tokens).map_err(gpufeed::Error::user)?;
//! // nanoGPT's train.bin: uint16 tokens.
//! let train = Arc::new(FlatTokens::open(&path, gpufeed::DType::U16)?);
//! let mut loader = TokenLoader::builder(128, 8) // rows of 128 tokens, global batches of 8
//!     .source(train)
//!     .mode(SampleMode::Concatenated)
//!     .shuffle(1)
//!     .shard(0, 2) // rank 0 of 2: 4 rows of each global batch
//!     .build()?;
//! let batch = loader.next().unwrap()?;
//! assert_eq!(batch.shape("input_ids")?, [4, 128]);
//! let (inputs, labels) = (batch.field::<i64>("input_ids")?, batch.field::<i64>("labels")?);
//! assert_eq!(inputs[1..128], labels[..127]); // shifted by one
//! let state = loader.state(); // resumes under any world size
//! # let _ = state;
//! # Ok(())
//! # }
//! ```

pub mod blend;
mod index;
mod loader;
pub mod pack;
pub mod rows;
mod stream;
mod text;

pub use blend::Blend;
pub use index::SampleMode;
pub use loader::{TokenLoader, TokenLoaderBuilder, TokenStats};
pub use rows::{CU_SEQLENS, DOCUMENT_IDS, INPUT_IDS, LABELS, Labels, POSITION_IDS, RowDtypes};
pub use text::TextStats;
