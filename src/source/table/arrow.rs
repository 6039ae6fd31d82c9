//! Arrow IPC data sets, as `datasets` writes them: a `save_to_disk` directory
//! (`dataset_info.json`, `state.json`, `data-0000k-of-0000n.arrow`), a `DatasetDict`'s
//! directory (`dataset_dict.json` and one directory per split), a `.arrow` file of the
//! `datasets` cache, or a pattern of `.arrow` files. Both IPC formats are read: the stream
//! format (what `datasets` writes) and the file format (`ARROW1` at both ends).
//!
//! # In place, no decode
//!
//! Each file is mapped and read where it lies, as a `.npy` array is: opening reads only the
//! messages' headers (flatbuffers, verified, every offset checked against the file; cost
//! O(record batches)), a record batch's arrays are made the first time a row of it is asked
//! for (Arrow's checks of its offsets and UTF-8, once per batch) as views of the mapping, and
//! a sample's fields are views of those (a reference count, no copy). Only bool columns
//! (bit-packed in Arrow) and dictionary keys are widened, once per batch.
//!
//! IPC files whose buffers are compressed (lz4 or zstd body compression, which `datasets`
//! never writes) cannot be read in place and are refused with an error saying so; so is
//! [`ReadMode::Pread`], which would copy every file into memory.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use arrow_buffer::Buffer;
use arrow_ipc::reader::FileDecoder;
use arrow_ipc::{Block, MessageHeader, MetadataVersion};
use arrow_schema::SchemaRef;
use bytes::Bytes;

use super::columns::{Columns, Plan, row_error};
use super::{FileSummary, MapOwner, TableOptions, TableSummary, guard, same_columns};
use crate::error::{Error, Result};
use crate::file::{FileData, FileIdentity, ReadMode, open_file};
use crate::format::Schema;
use crate::source::{Dataset, Sample};

const FORMAT: &str = "Arrow IPC";

/// The marker before each message of the IPC format (since Arrow 0.15).
pub(crate) const CONTINUATION: u32 = 0xFFFF_FFFF;

/// The splits of a `DatasetDict` directory, in its `dataset_dict.json`'s order; `None` when
/// `dir` is not one.
pub fn splits_of(dir: &Path) -> Result<Option<Vec<String>>> {
    let index = dir.join("dataset_dict.json");
    if !index.is_file() {
        return Ok(None);
    }
    let text = std::fs::read(&index).map_err(|e| Error::io(&index, "read", e))?;
    let value: serde_json::Value = serde_json::from_slice(&text).map_err(|e| Error::Malformed {
        path: index.clone(),
        format: "dataset_dict.json",
        what: e.to_string(),
    })?;
    let splits = value
        .get("splits")
        .and_then(|s| s.as_array())
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect::<Vec<_>>()
        })
        .ok_or_else(|| Error::Malformed {
            path: index.clone(),
            format: "dataset_dict.json",
            what: "no `splits` list of names".into(),
        })?;
    Ok(Some(splits))
}

/// The `.arrow` files of a `save_to_disk` directory, in its `state.json`'s order; `None` when
/// the directory has no `state.json`.
fn state_files(dir: &Path) -> Result<Option<Vec<PathBuf>>> {
    let state = dir.join("state.json");
    if !state.is_file() {
        return Ok(None);
    }
    let text = std::fs::read(&state).map_err(|e| Error::io(&state, "read", e))?;
    let value: serde_json::Value = serde_json::from_slice(&text).map_err(|e| Error::Malformed {
        path: state.clone(),
        format: "state.json",
        what: e.to_string(),
    })?;
    let files = value
        .get("_data_files")
        .and_then(|s| s.as_array())
        .ok_or_else(|| Error::Malformed {
            path: state.clone(),
            format: "state.json",
            what: "no `_data_files` list".into(),
        })?;
    let mut out = Vec::with_capacity(files.len());
    for f in files {
        let name = f
            .get("filename")
            .and_then(|n| n.as_str())
            .filter(|n| !n.is_empty() && !n.contains('/') && *n != "..")
            .ok_or_else(|| Error::Malformed {
                path: state.clone(),
                format: "state.json",
                what: format!("a data file without a plain `filename`: {f}"),
            })?;
        out.push(dir.join(name));
    }
    Ok(Some(out))
}

/// One mapped IPC file: its batches' places and the decoder that holds its dictionaries.
struct ArrowFile {
    path: PathBuf,
    identity: FileIdentity,
    /// The mapping, as `Bytes` (samples' views) and as an Arrow `Buffer` (arrays' views).
    data: Bytes,
    buffer: Buffer,
    /// One decoder per state of the dictionaries that batches are read with (one unless
    /// the stream replaces a dictionary between batches).
    decoders: Vec<FileDecoder>,
    rows: u64,
    batches: u64,
}

/// A record batch: its message in file `file`, and its rows.
#[derive(Clone, Copy)]
struct BatchRef {
    file: usize,
    /// Its decoder among its file's.
    decoder: usize,
    block: Block,
    rows: u64,
    /// Its first row within its file.
    file_row: u64,
}

/// An Arrow IPC data set (see the [module](self)).
pub struct ArrowDataset {
    files: Vec<ArrowFile>,
    batches: Vec<BatchRef>,
    /// Where each batch starts among the data set's rows (`batches + 1` entries).
    starts: Vec<u64>,
    /// Each batch's columns, made on first use.
    decoded: Vec<OnceLock<Columns>>,
    plan: Plan,
    schema: Schema,
    splits: Option<(String, Vec<String>)>,
}

/// Opens the Arrow data set `path` names (a `save_to_disk` directory, a `DatasetDict`
/// directory with [`TableOptions::split`], a `.arrow` file, a pattern of them) as `options`
/// say.
pub fn open(path: impl AsRef<Path>, options: &TableOptions) -> Result<ArrowDataset> {
    let path = path.as_ref();
    let mut dir = path.to_path_buf();
    let mut splits = None;
    if let Some(names) = splits_of(path)? {
        let split = match (&options.split, names.as_slice()) {
            (Some(s), _) if names.contains(s) => s.clone(),
            (Some(s), _) => {
                return Err(Error::config(
                    "split",
                    format!(
                        "{} has no split `{s}` (its splits: {})",
                        path.display(),
                        names.join(", ")
                    ),
                ));
            }
            (None, [one]) => one.clone(),
            (None, _) => {
                return Err(Error::config(
                    "split",
                    format!(
                        "{} is a DatasetDict of splits {}: name one (`split=`, `--split`, or \
                         the split's directory, {})",
                        path.display(),
                        names.join(", "),
                        path.join(&names[0]).display()
                    ),
                ));
            }
        };
        dir = path.join(&split);
        splits = Some((split, names));
    }
    let files = match state_files(&dir)? {
        Some(files) => files,
        None => super::files::dataset_files(&dir, &|n| n.ends_with(".arrow"), "Arrow files")?,
    };
    let mut dataset = ArrowDataset::open_files(&files, options)?;
    dataset.splits = splits;
    Ok(dataset)
}

/// The places of the messages of an IPC stream (or the stream inside an IPC file).
struct Walked {
    schema: SchemaRef,
    version: MetadataVersion,
    dictionaries: Vec<Block>,
    /// Each batch's message, rows, and the dictionary messages before it (a stream may
    /// replace a dictionary between batches: each batch is read with those before it).
    batches: Vec<(Block, u64, usize)>,
}

fn malformed(path: &Path, what: impl Into<String>) -> Error {
    Error::Malformed {
        path: path.to_path_buf(),
        format: FORMAT,
        what: what.into(),
    }
}

/// Reads the message headers of `data` (only they: bodies are not touched), checking every
/// length and offset against the file.
fn walk(path: &Path, data: &[u8]) -> Result<Walked> {
    let u32_at = |at: usize| -> Option<u32> {
        data.get(at..at + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let mut p = 0;
    if data.starts_with(b"ARROW1") {
        // The file format: the magic, padded with zeros to the writer's alignment (8 to 64
        // bytes), then a stream. No message starts with zero bytes.
        p = 8;
        while p < data.len().min(4096) && u32_at(p) == Some(0) {
            p += 8;
        }
    }
    let mut schema = None;
    let mut dictionaries = Vec::new();
    let mut batches = Vec::new();
    while p < data.len() {
        let Some(first) = u32_at(p) else {
            return Err(malformed(path, format!("a message cut short at byte {p}")));
        };
        let (prefix, meta_len) = if first == CONTINUATION {
            let len = u32_at(p + 4)
                .ok_or_else(|| malformed(path, format!("a message cut short at byte {p}")))?;
            (8usize, len)
        } else {
            (4, first)
        };
        if meta_len == 0 {
            break; // end of stream
        }
        let meta_len = i32::try_from(meta_len)
            .map_err(|_| malformed(path, format!("a message at byte {p} of negative length")))?
            as usize;
        let header_at = p + prefix;
        let header = data.get(header_at..header_at + meta_len).ok_or_else(|| {
            malformed(
                path,
                format!(
                    "the message at byte {p} says {meta_len} bytes of header, past the file's {} bytes",
                    data.len()
                ),
            )
        })?;
        let message = arrow_ipc::root_as_message(header)
            .map_err(|e| malformed(path, format!("the message at byte {p} cannot be read: {e}")))?;
        let body_len = usize::try_from(message.bodyLength())
            .map_err(|_| malformed(path, format!("the message at byte {p} has a negative body")))?;
        let end = (header_at + meta_len)
            .checked_add(body_len)
            .filter(|&e| e <= data.len())
            .ok_or_else(|| {
                malformed(
                    path,
                    format!(
                        "the message at byte {p} has a body of {body_len} bytes, past the file's end"
                    ),
                )
            })?;
        let meta = i32::try_from(prefix + meta_len)
            .map_err(|_| malformed(path, format!("the message at byte {p} is too large")))?;
        let block = Block::new(p as i64, meta, body_len as i64);
        match message.header_type() {
            MessageHeader::Schema if schema.is_none() => {
                let fb = message
                    .header_as_schema()
                    .ok_or_else(|| malformed(path, "its schema message holds no schema"))?;
                let s = arrow_ipc::convert::try_fb_to_schema(fb)
                    .map_err(|e| malformed(path, format!("its schema cannot be read: {e}")))?;
                schema = Some((Arc::new(s), message.version()));
            }
            _ if schema.is_none() => {
                return Err(malformed(path, "the first message is not a schema"));
            }
            MessageHeader::DictionaryBatch => dictionaries.push(block),
            MessageHeader::RecordBatch => {
                let batch = message.header_as_record_batch().ok_or_else(|| {
                    malformed(path, format!("the record batch at byte {p} is empty"))
                })?;
                if batch.compression().is_some() {
                    return Err(Error::UnsupportedTable {
                        path: path.to_path_buf(),
                        what: format!(
                            "the record batch at byte {p} is compressed (lz4/zstd buffers), which \
                             cannot be read in place: write the file uncompressed (pyarrow: \
                             `ipc.new_stream(..., options=ipc.IpcWriteOptions(compression=None))`) \
                             or as Parquet"
                        ),
                    });
                }
                let rows = u64::try_from(batch.length()).map_err(|_| {
                    malformed(
                        path,
                        format!("the record batch at byte {p} has negative rows"),
                    )
                })?;
                batches.push((block, rows, dictionaries.len()));
            }
            other => {
                return Err(malformed(
                    path,
                    format!("a message of kind {other:?} at byte {p}, where batches were expected"),
                ));
            }
        }
        p = end;
    }
    let (schema, version) = schema.ok_or_else(|| malformed(path, "no schema message"))?;
    Ok(Walked {
        schema,
        version,
        dictionaries,
        batches,
    })
}

impl ArrowDataset {
    /// Opens `files` (IPC stream or file format) as one data set: one schema, rows in order.
    pub fn open_files(files: &[PathBuf], options: &TableOptions) -> Result<ArrowDataset> {
        let Some(first) = files.first() else {
            return Err(Error::mismatch("no Arrow file to open"));
        };
        if options.read_mode == ReadMode::Pread {
            return Err(Error::config(
                "read_mode",
                "Arrow files are read in place from their mapping; reading them with pread \
                 would copy each file into memory: use the default read mode",
            ));
        }
        let mut walked: Vec<(PathBuf, Walked, FileIdentity, Bytes)> =
            Vec::with_capacity(files.len());
        for p in files {
            let (data, identity) = open_file(p, ReadMode::Map)?;
            let FileData::Map(map) = data else {
                return Err(malformed(p, "the file could not be mapped"));
            };
            let bytes = Bytes::from_owner(MapOwner(map));
            let w = guard(p, FORMAT, || walk(p, &bytes))?;
            if let Some((first_path, first_walk, ..)) = walked.first() {
                same_columns(first_path, &first_walk.schema, p, &w.schema)?;
            }
            walked.push((p.clone(), w, identity, bytes));
        }
        let plan = Plan::new(&walked[0].1.schema, options, first)?;
        let mut out = Vec::with_capacity(walked.len());
        let mut batches = Vec::new();
        let mut starts = vec![0u64];
        for (f, (path, w, identity, data)) in walked.into_iter().enumerate() {
            let buffer = Buffer::from(data.clone());
            // A decoder for each number of dictionary messages that precedes a batch, holding
            // those dictionaries.
            let mut states: Vec<usize> = w.batches.iter().map(|b| b.2).collect();
            states.dedup();
            let mut decoders = Vec::with_capacity(states.len());
            for &n in &states {
                let mut decoder = FileDecoder::new(Arc::clone(&w.schema), w.version)
                    .with_projection(plan.roots.clone());
                for block in &w.dictionaries[..n] {
                    let message = message_buffer(&buffer, block);
                    guard(&path, FORMAT, || {
                        decoder.read_dictionary(block, &message).map_err(|e| {
                            malformed(
                                &path,
                                format!("the dictionary at byte {}: {e}", block.offset()),
                            )
                        })
                    })?;
                }
                decoders.push(decoder);
            }
            let mut file_row = 0;
            for &(block, rows, dicts) in &w.batches {
                if rows == 0 {
                    continue;
                }
                batches.push(BatchRef {
                    file: f,
                    decoder: states.partition_point(|&n| n < dicts),
                    block,
                    rows,
                    file_row,
                });
                starts.push(starts.last().copied().unwrap_or(0) + rows);
                file_row += rows;
            }
            out.push(ArrowFile {
                path,
                identity,
                data,
                buffer,
                decoders,
                rows: file_row,
                batches: w.batches.len() as u64,
            });
        }
        let schema = plan.schema(first)?;
        let mut dataset = ArrowDataset {
            files: out,
            decoded: (0..batches.len()).map(|_| OnceLock::new()).collect(),
            batches,
            starts,
            plan,
            schema,
            splits: None,
        };
        dataset.sniff_images()?;
        Ok(dataset)
    }

    /// Tags each image field JPEG or PNG by the first value of the first batch.
    fn sniff_images(&mut self) -> Result<()> {
        let images: Vec<usize> = (0..self.plan.plans.len())
            .filter(|&k| self.plan.plans[k].image)
            .collect();
        if images.is_empty() || self.batches.is_empty() {
            return Ok(());
        }
        let first = self.columns(0)?;
        let values: Vec<(usize, bytes::Bytes)> = images
            .into_iter()
            .filter_map(|k| first.first_value(k).map(|v| (k, v)))
            .collect();
        for (k, v) in values {
            self.plan.sniff_image(k, &v);
        }
        self.schema = self.plan.schema(&self.files[0].path)?;
        Ok(())
    }

    /// Batch `k`'s columns, made on first use.
    fn columns(&self, k: usize) -> Result<&Columns> {
        if let Some(c) = self.decoded[k].get() {
            return Ok(c);
        }
        let b = self.batches[k];
        let f = &self.files[b.file];
        let at = b.block.offset();
        let columns = guard(&f.path, FORMAT, || {
            let message = message_buffer(&f.buffer, &b.block);
            let batch = f.decoders[b.decoder]
                .read_record_batch(&b.block, &message)
                .map_err(|e| malformed(&f.path, format!("the record batch at byte {at}: {e}")))?
                .ok_or_else(|| {
                    malformed(&f.path, format!("the record batch at byte {at} is empty"))
                })?;
            if batch.num_rows() as u64 != b.rows {
                return Err(malformed(
                    &f.path,
                    format!(
                        "the record batch at byte {at} has {} rows, its header says {}",
                        batch.num_rows(),
                        b.rows
                    ),
                ));
            }
            Columns::new(&batch, &self.plan, Some(&f.data)).map_err(|(k, what)| {
                malformed(
                    &f.path,
                    format!(
                        "the record batch at byte {at}, column `{}`: {what}",
                        self.plan.fields[k].name
                    ),
                )
            })
        })?;
        // Another thread may have made it meanwhile: either will do.
        Ok(self.decoded[k].get_or_init(|| columns))
    }

    /// What the data set holds, for `gpufeed inspect`.
    pub fn describe(&self) -> TableSummary {
        TableSummary {
            format: "arrow",
            rows: self.len(),
            columns: self.plan.columns.clone(),
            files: self
                .files
                .iter()
                .map(|f| FileSummary {
                    path: f.path.clone(),
                    bytes: f.data.len() as u64,
                    rows: f.rows,
                    groups: f.batches,
                    compression: vec!["uncompressed".to_owned()],
                    uncompressed_bytes: None,
                })
                .collect(),
            chunks: self.batches.len() as u64,
            splits: self.splits.clone(),
        }
    }
}

/// The bytes of the message at `block` (header and body), a view of the file's buffer.
fn message_buffer(buffer: &Buffer, block: &Block) -> Buffer {
    let len = block.metaDataLength() as usize + block.bodyLength() as usize;
    buffer.slice_with_length(block.offset() as usize, len)
}

impl Dataset for ArrowDataset {
    fn len(&self) -> u64 {
        self.starts.last().copied().unwrap_or(0)
    }

    fn schema(&self) -> &Schema {
        &self.schema
    }

    fn get(&self, index: u64) -> Result<Sample<'_>> {
        let len = self.len();
        if index >= len {
            return Err(Error::OutOfRange { index, len });
        }
        let k = self.starts.partition_point(|&s| s <= index) - 1;
        let columns = self.columns(k)?;
        let b = self.batches[k];
        let r = index - self.starts[k];
        let fields = columns.row(r as usize).map_err(|fault| {
            row_error(
                fault,
                &self.plan,
                &self.files[b.file].path,
                b.file_row + r,
                index,
            )
        })?;
        Sample::fields(fields, &self.schema)
    }

    fn check_unchanged(&self) -> Result<()> {
        self.files
            .iter()
            .try_for_each(|f| f.identity.check(&f.path))
    }
}

impl std::fmt::Debug for ArrowDataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArrowDataset")
            .field("files", &self.files.len())
            .field("rows", &self.len())
            .field("batches", &self.batches.len())
            .field("schema", &self.schema.to_string())
            .finish()
    }
}

impl crate::source::Source for ArrowDataset {
    fn format(&self) -> crate::source::Format {
        crate::source::Format::Arrow
    }

    fn describe(&self) -> Result<crate::source::Description> {
        Ok(ArrowDataset::describe(self).description(crate::source::Format::Arrow, &self.schema))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::{ArrayRef, Float32Array, RecordBatch, StringArray};

    #[test]
    fn fields_are_views_of_the_mapping() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s.arrow");
        let x: ArrayRef = Arc::new(Float32Array::from_iter_values((0..100).map(|i| i as f32)));
        let t: ArrayRef = Arc::new(StringArray::from_iter_values(
            (0..100).map(|i| format!("t{i}")),
        ));
        let batch = RecordBatch::try_from_iter([("x", x), ("t", t)]).unwrap();
        let mut w = arrow_ipc::writer::StreamWriter::try_new(
            std::fs::File::create(&p).unwrap(),
            &batch.schema(),
        )
        .unwrap();
        w.write(&batch).unwrap();
        w.finish().unwrap();
        let d = open(&p, &TableOptions::default()).unwrap();
        let map = d.files[0].data.as_ptr_range();
        for i in [0u64, 57, 99] {
            let s = d.get(i).unwrap();
            for k in 0..2 {
                let f = s.field(k).unwrap().as_ptr_range();
                assert!(
                    map.start <= f.start && f.end <= map.end,
                    "row {i} field {k} is a copy"
                );
            }
            assert_eq!(s.field(0).unwrap(), (i as f32).to_le_bytes());
        }
    }
}
