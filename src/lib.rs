//! gpufeed feeds training loops.
//!
//! ```text
//!  files on disk ──mmap──▶ source ──(order)──▶ worker threads ──collate──▶ batch buffer ──bounded──▶ consumer
//!  (packed records,        zero-copy           share ONE dataset;          (pooled; pinned   channel    (CPU batch)
//!   .npy, shards)          sample views        transforms per sample        with `cuda`)                   │
//!                                                                              └─async H2D on a copy stream─▶ device batch
//! ```
//!
//! Where each stage lives:
//!
//! | stage | module |
//! |---|---|
//! | the packed record file (layout, writer, reader) | [`format`](mod@format) |
//! | what a batch is made of: fields, their places in a buffer, element types, sample slots | [`layout`] |
//! | where samples come from (packed files, `.npy`, shards) | [`source`] |
//! | encoded images: JPEG and PNG probed and decoded, within limits | [`codec`] |
//! | the order of samples: shuffle, shards, batches, resume | [`sampler`] |
//! | per-sample work that writes into the batch (copy, decode, augment) | [`transform`] |
//! | batch buffers: a caching pool with a byte budget | [`memory`] |
//! | a timeline of the loader's work (Chrome trace-event JSON, for Perfetto) | [`trace`] |
//! | worker threads, channels, [`Batch`], stats | [`loader`] |
//! | pinned buffers, device pool, async copies, device batches (feature `cuda`) | `cuda` |
//! | the user's tokenizer (a Hugging Face `tokenizer.json`): documents to token ids | [`tokenizer`] |
//! | token streams for language models: packed or concatenated rows, blends, elastic resume | [`tokens`] |
//! | batches as candle tensors (features `candle`, `candle-cuda`) | `candle` |
//!
//! Every fallible call returns [`Result`], whose [`Error`] names the file, record or sample at
//! fault. Nothing panics on bad input.
//!
//! # What is stable
//!
//! gpufeed is at 0.x: a minor release (0.1 to 0.2) may break the items below, a patch release
//! does not. Public means promised:
//!
//! - the types re-exported at the crate root, the modules listed above and their public items,
//!   with the behaviour their docs state;
//! - [`Error`]'s messages are for people and may be reworded; match on [`Error::kind`]
//!   ([`ErrorKind`]) or on the variants' fields, never on the text. [`Error`] and [`ErrorKind`]
//!   are `#[non_exhaustive]`: new variants come in minor releases;
//! - the packed record format ([`format`](mod@format), `docs/FORMAT.md`): a reader reads every
//!   file of its major format version.
//!
//! Not promised: items marked `#[doc(hidden)]`, the measuring helpers (`bench` functions and
//! reports, `loader::gather_baseline`: they move out of the library), the figures of
//! [`LoaderStats`] and [`PoolStats`] beyond their documented meaning, and the `gpufeed` command's
//! output.

#[cfg(feature = "candle")]
pub mod candle;
pub mod codec;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
mod file;
pub mod format;
pub mod layout;
pub mod loader;
pub mod memory;
pub mod sampler;
pub mod source;
pub mod temporary;
pub mod tokenizer;
pub mod tokens;
pub mod trace;
pub mod transform;

#[cfg(doctest)]
mod readme;

pub use error::{Error, ErrorKind, RemoteErrorKind, Result};
pub use format::{Codec, DType, Field, RecordFile, RecordWriter, Schema};
pub use layout::{BatchLayout, Element, OutputField, Slots};
pub use loader::{
    Auto, Batch, BatchInfo, BatchStream, Loader, LoaderBuilder, LoaderState, LoaderStats, Next,
    Setting,
};
pub use memory::{HostBuffer, HostPool, PoolStats};
pub use source::{Concat, Dataset, NpyArray, Sample};
pub use transform::{CopyFields, FnTransform, SampleContext, SampleTransform};
