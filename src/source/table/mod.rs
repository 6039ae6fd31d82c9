//! Data sets that are tables (rows of named columns), as the Hugging Face hub and `datasets`
//! ship them: Parquet files ([`parquet`]), Arrow IPC files (`datasets`' `save_to_disk`
//! directories and cache files: [`arrow`]) and JSON lines ([`jsonl`]: `.jsonl`, `.jsonl.gz`,
//! `.jsonl.zst`, and `.json` files of one object per line). The files a name stands for (one
//! file, a directory's, a glob pattern's) are found by one rule (`files.rs`).
//!
//! Each format opens to a [`Dataset`](crate::source::Dataset) whose samples are rows, and whose
//! fields are the table's columns mapped to gpufeed's fields by one set of rules
//! (`columns.rs`): numbers and fixed-size lists of numbers to tensors, strings and binaries to
//! bytes, variable-size lists of numbers to ragged fields, the `datasets` Image feature (a
//! struct of `bytes` and `path`) to an image field, other structs to one field per child
//! (`parent.child`). What they read is set by [`TableOptions`]; what a data set holds (schema,
//! rows, row groups or record batches, compression, sizes, the columns that cannot be read) is
//! its `describe()`, a [`TableSummary`] that `gpufeed inspect` prints.
//!
//! Which path is a table of which format is decided by the front door
//! ([`source::open`](crate::source::open())), by one row of its table each; each format module
//! offers its `open`.

pub mod arrow;
mod cache;
mod columns;
mod dense;
pub(crate) mod files;
pub mod jsonl;
pub mod parquet;

use std::collections::BTreeMap;
use std::path::PathBuf;

pub use cache::ChunkCacheStats;
pub use jsonl::{
    JsonLines, JsonLinesFieldSummary, JsonLinesFileSummary, JsonLinesOptions, JsonLinesSummary,
    is_json_lines,
};

use crate::file::ReadMode;
use crate::format::Schema;
use crate::source::{Description, Format};

/// A value put in place of a null, for a column named in [`TableOptions::fill`].
#[derive(Clone, Debug, PartialEq)]
pub enum Fill {
    /// An integer, for integer, float and bool fields (0 or 1).
    Int(i64),
    /// A number, for float fields.
    Float(f64),
    /// Bytes, for bytes fields (strings, binaries, images; ragged fields take the elements'
    /// little-endian bytes).
    Bytes(Vec<u8>),
}

/// How a table (Parquet, Arrow, JSON lines) is read.
#[derive(Clone, Debug, Default)]
pub struct TableOptions {
    /// The fields to read, by name (a column's name, or `parent.child` for a struct's child);
    /// `None`: every column that maps to a field. Columns not read are never decoded.
    pub columns: Option<Vec<String>>,
    /// Values for nulls, by field name. A null in a field without one is an error naming
    /// the file, the row and the column.
    pub fill: BTreeMap<String, Fill>,
    /// How files are reached: mapped (the default) or read at offsets.
    pub read_mode: ReadMode,
    /// Parquet: rows per chunk, the unit that is decoded and cached (row groups larger than
    /// this are split). `None`: chosen per row group from its size in the footer, so that a
    /// decoded chunk is about [`DEFAULT_CHUNK_BYTES`].
    pub chunk_rows: Option<u64>,
    /// Parquet: chunks whose rows are shuffled together (the window of the two-level
    /// shuffle the loader uses when asked to shuffle). `None`: [`DEFAULT_WINDOW`].
    pub window: Option<u64>,
    /// Parquet: the bytes of decoded chunks kept for all workers together. `None`: two
    /// windows of chunks of [`DEFAULT_CHUNK_BYTES`].
    pub cache_bytes: Option<u64>,
    /// Arrow: the split of a `DatasetDict` directory to read (`train`, `test`, ...), when the
    /// path names the dictionary's directory and not a split's.
    pub split: Option<String>,
    /// JSON lines: fields' types declared by name, over what the first lines suggest
    /// ([`JsonLinesOptions::decode`]).
    pub decode: BTreeMap<String, crate::source::shards::FieldDecode>,
    /// JSON lines: where each file's index of lines may be kept between opens
    /// ([`JsonLinesOptions::index_dir`]); `None`: built at every open.
    pub index_dir: Option<std::path::PathBuf>,
}

/// The decoded size a Parquet chunk aims at when [`TableOptions::chunk_rows`] is not set.
pub const DEFAULT_CHUNK_BYTES: u64 = 4 << 20;

/// Chunks per shuffle window when [`TableOptions::window`] is not set.
pub const DEFAULT_WINDOW: u64 = 8;

/// What a table data set holds, for `gpufeed inspect`: plain data, printed by the command.
#[derive(Clone, Debug, PartialEq)]
pub struct TableSummary {
    /// `parquet` or `arrow`.
    pub format: &'static str,
    /// Rows of all files together.
    pub rows: u64,
    /// The columns, in the files' order, each with the field it becomes or why it cannot.
    pub columns: Vec<ColumnSummary>,
    /// The files, in the data set's order.
    pub files: Vec<FileSummary>,
    /// Parquet: the chunks rows are decoded in (row groups split); Arrow: record batches.
    pub chunks: u64,
    /// Arrow, a `DatasetDict`: the split read and every split there is.
    pub splits: Option<(String, Vec<String>)>,
}

/// One column of a [`TableSummary`].
#[derive(Clone, Debug, PartialEq)]
pub struct ColumnSummary {
    /// The column's name (`parent.child` for a struct's child).
    pub name: String,
    /// Its Arrow type, as Arrow prints it.
    pub arrow_type: String,
    /// The field it becomes (`text: utf8 bytes`, `image: jpeg bytes`), or `None` when it
    /// cannot be read.
    pub field: Option<String>,
    /// Why it cannot be read, when it cannot; `None` when it can.
    pub unreadable: Option<String>,
    /// True when the options leave it out.
    pub skipped: bool,
}

/// One file of a [`TableSummary`].
#[derive(Clone, Debug, PartialEq)]
pub struct FileSummary {
    /// The file.
    pub path: PathBuf,
    /// Its size in bytes.
    pub bytes: u64,
    /// Its rows.
    pub rows: u64,
    /// Parquet: its row groups; Arrow: its record batches.
    pub groups: u64,
    /// Parquet: the codecs of its column chunks (`SNAPPY`, `ZSTD(…)`, `UNCOMPRESSED`); Arrow:
    /// `uncompressed`.
    pub compression: Vec<String>,
    /// Parquet: the bytes its column chunks take decompressed, as its footer says.
    pub uncompressed_bytes: Option<u64>,
}

/// Runs `f`, turning a panic of the Arrow or Parquet code under it into `Malformed` for
/// `path`: those crates can panic on malformed input in places, and bad input gets a typed
/// error here, never a panic.
pub(crate) fn guard<T>(
    path: &std::path::Path,
    format: &'static str,
    f: impl FnOnce() -> crate::error::Result<T>,
) -> crate::error::Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "the reader failed".to_owned());
            Err(crate::error::Error::Malformed {
                path: path.to_path_buf(),
                format,
                what: format!("the file cannot be decoded ({what})"),
            })
        }
    }
}

/// An error unless `b`'s columns are `a`'s: the two files and the first difference.
pub(crate) fn same_columns(
    a_path: &std::path::Path,
    a: &arrow_schema::Schema,
    b_path: &std::path::Path,
    b: &arrow_schema::Schema,
) -> crate::error::Result<()> {
    use crate::error::Error;
    let (fa, fb) = (a.fields(), b.fields());
    let differ = |what: String| {
        Err(Error::mismatch(format!(
            "{} and {} have different schemas: {what}; open them as separate data sets",
            a_path.display(),
            b_path.display()
        )))
    };
    for (x, y) in fa.iter().zip(fb.iter()) {
        if x.name() != y.name() {
            return differ(format!(
                "column `{}` where the first has `{}`",
                y.name(),
                x.name()
            ));
        }
        if x.data_type() != y.data_type() {
            return differ(format!(
                "column `{}` is {} in the first, {} in the second",
                x.name(),
                x.data_type(),
                y.data_type()
            ));
        }
    }
    if fa.len() != fb.len() {
        return differ(format!("{} columns against {}", fa.len(), fb.len()));
    }
    Ok(())
}

/// A file's mapping as the owner of a `Bytes`.
pub(crate) struct MapOwner(pub(crate) std::sync::Arc<memmap2::Mmap>);

impl AsRef<[u8]> for MapOwner {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl TableSummary {
    /// The summary as `gpufeed inspect` prints it: files, chunks, compression and sizes, and
    /// each column with its Arrow type and the field it becomes (or why it cannot).
    pub fn description(&self, format: Format, schema: &Schema) -> Description {
        let bytes: u64 = self.files.iter().map(|f| f.bytes).sum();
        let uncompressed: Option<u64> = self.files.iter().map(|f| f.uncompressed_bytes).sum();
        let groups: u64 = self.files.iter().map(|f| f.groups).sum();
        let mut compression: Vec<String> = Vec::new();
        for c in self.files.iter().flat_map(|f| &f.compression) {
            if !compression.contains(c) {
                compression.push(c.clone());
            }
        }
        let files: Vec<serde_json::Value> = self
            .files
            .iter()
            .map(|f| {
                serde_json::json!({
                    "path": f.path.display().to_string(), "bytes": f.bytes, "rows": f.rows,
                    "groups": f.groups, "compression": f.compression,
                    "uncompressed_bytes": f.uncompressed_bytes,
                })
            })
            .collect();
        let (first, last) = (self.files.first(), self.files.last());
        let name =
            |f: Option<&FileSummary>| f.map_or(String::new(), |f| f.path.display().to_string());
        let columns: Vec<serde_json::Value> = self
            .columns
            .iter()
            .map(|c| {
                serde_json::json!({
                    "name": c.name, "arrow_type": c.arrow_type, "field": c.field,
                    "unreadable": c.unreadable, "skipped": c.skipped,
                })
            })
            .collect();
        let column_text: Vec<String> = self
            .columns
            .iter()
            .map(|c| match (&c.field, &c.unreadable) {
                (_, Some(why)) => format!("{} ({}): not read: {why}", c.name, c.arrow_type),
                (Some(field), None) if c.skipped => {
                    format!("{} ({}) -> {field}, left out", c.name, c.arrow_type)
                }
                (Some(field), None) => format!("{} ({}) -> {field}", c.name, c.arrow_type),
                (None, None) => format!("{} ({})", c.name, c.arrow_type),
            })
            .collect();
        let (groups_key, groups_label, chunks_label) = match format {
            Format::Parquet => ("row_groups", "row groups", "chunks"),
            _ => ("record_batches", "record batches", ""),
        };
        let mut d = Description::new("", format, self.rows, schema.clone())
            .fact(
                "files",
                "files",
                files,
                if self.files.len() == 1 {
                    format!("1 ({})", name(first))
                } else {
                    format!("{} ({} .. {})", self.files.len(), name(first), name(last))
                },
            )
            .count("file_bytes", "file bytes", bytes)
            .count(groups_key, groups_label, groups)
            .fact(
                "chunks",
                chunks_label,
                self.chunks,
                format!(
                    "{} (the unit decoded and cached, row groups split)",
                    self.chunks
                ),
            )
            .fact(
                "compression",
                "compression",
                compression.clone(),
                compression.join(", "),
            );
        if let Some(u) = uncompressed {
            d = d.count("uncompressed_bytes", "uncompressed", u);
        }
        if let Some((split, all)) = &self.splits {
            d = d.fact(
                "split",
                "split",
                split.clone(),
                format!("{split} (of {})", all.join(", ")),
            );
        }
        d.fact("columns", "columns", columns, column_text.join("\n"))
    }
}
