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
//! | the packed record file (layout, writer, reader) | [`format`] |
//! | where samples come from (packed files, `.npy`, shards) | [`source`] |
//!
//! Every fallible call returns [`Result`], whose [`Error`] names the file, record or sample at
//! fault. Nothing panics on bad input.

#![warn(missing_docs)]

pub mod error;
pub mod format;
pub mod source;

pub use error::{Error, Result};
pub use format::{Codec, DType, Field, RecordFile, RecordWriter, Schema};
pub use source::{Concat, Dataset, NpyArray, Sample};
