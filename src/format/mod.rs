//! The packed record file: its layout, its writer and its reader.
//!
//! A packed file is one memory mapping that every worker thread shares: records are read in
//! place, never copied into a cache (or, with [`ReadMode::Pread`], read at their offsets, for
//! file systems where a mapping is unsafe). `docs/FORMAT.md` specifies it byte by byte:
//!
//! ```text
//! header (64 B) | records, each aligned | schema | offset table (n+1 x u64) | checksums (n x u64) | footer (64 B)
//! ```
//!
//! - [`schema`](Schema): named fields, fixed-size tensors and variable-size bytes;
//! - [`RecordWriter`]: writes a file atomically (temporary name, then rename); [`RecordSink`]
//!   is what it and the shard writer have in common;
//! - [`pack_raw_records`]: packs raw files of fixed-size records into a [`RecordSink`];
//! - [`RecordFile`]: maps, validates in O(1), hands out zero-copy samples; [`ReadOptions`] says
//!   how it reads (mapping or `pread`, checksums checked or not).
//!
//! This module never trusts the bytes it reads: every malformed file is a typed
//! [`Error`](crate::Error) that names the file and the fault.

mod layout;
mod raw;
mod reader;
mod schema;
mod writer;

pub(crate) use layout::record_checksum;
pub use layout::{FOOTER_MAGIC, MAGIC, VERSION_MAJOR, VERSION_MINOR};
pub use raw::pack_raw_records;
pub use reader::{ReadMode, ReadOptions, RecordFile};
pub use schema::{Codec, DType, Field, FieldKind, Schema};
// The temporaries' functions are the crate's `temporary` module's, named here too because the
// record writer is where users first meet them.
pub use crate::temporary::{
    TEMPORARY_MARKER, remove_stale_temporaries, remove_unfinished_temporaries,
};
pub(crate) use writer::default_record_align;
pub use writer::{PackSummary, RecordSink, RecordWriter, foreign_file};
