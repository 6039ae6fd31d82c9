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
//! # Fields
//!
//! Each row has `input_ids` (`pad_id` past its tokens), `labels` (the next token; the ignore
//! index for padding and, with [`mask_document_ends`](TokenLoaderBuilder::mask_document_ends),
//! at each document's last token), `position_ids` (from 0 at each document's piece),
//! `document_ids` (the piece of its row each token belongs to, from 0, -1 for padding: a
//! document mask is `document_ids[i] == document_ids[j]`), and the batch has `cu_seqlens`,
//! its sequences' offsets (each piece, and each row's padding as one more) as
//! flash-attention's varlen kernels take them, in a field of `rows * (seq_len + 1)` entries of
//! which the first [`TokenCounts::sequences`](crate::loader::TokenCounts::sequences)` + 1` count
//! (the rest repeat the last). [`BatchInfo::tokens`](crate::BatchInfo::tokens) has the counts,
//! on the host, for device batches too.
//!
//! # Resume
//!
//! The stream is a pure function of (seed, epoch, global position) and the settings. A state
//! ([`TokenLoader::state`](crate::BatchStream::state)) names the epoch and the global batches
//! delivered in it, with the global order's settings and the stream's ([`TokenState`](crate::loader::TokenState):
//! sources, their sizes, the blend's counts, and each source's place); a loader of any rank
//! and world size resumes from it at the next global batch. Mixture and packing need nothing
//! else: both are functions of the position.
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

pub use blend::Blend;
pub use index::SampleMode;
pub use loader::{TokenLoader, TokenLoaderBuilder, TokenStats};
pub use rows::{CU_SEQLENS, DOCUMENT_IDS, INPUT_IDS, LABELS, Labels, POSITION_IDS, RowDtypes};
