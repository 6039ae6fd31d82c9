//! Where samples come from: every source is a map-style [`Dataset`] of zero-copy [`Sample`]s.
//!
//! - [`RecordFile`](crate::format::RecordFile): a packed record file;
//! - [`NpyArray`]: a `.npy` array, memory-mapped in place, one row a sample;
//! - [`ImageFolder`]: a directory of class subdirectories of JPEG/PNG files (torchvision's);
//! - [`Concat`]: several sources of one schema as one dataset (a few files, all opened);
//! - [`Zip`]: several sources of one length as one dataset whose fields are theirs together
//!   (`images.npy` and `labels.npy`, say), sharded where they are;
//! - [`shards`]: sharded datasets (packed shards, WebDataset tar shards, MosaicML MDS), each
//!   shard opened on first use, a bounded number open at once;
//! - [`table`]: tables as the Hugging Face hub ships them (Parquet, Arrow IPC, JSON lines),
//!   read as they are;
//! - [`TextColumn`]: the text of one field of any of these, row by row: documents for a
//!   tokenizer;
//! - [`tokens`]: documents of token ids for language models (Megatron's `.bin`/`.idx`,
//!   nanoGPT's `train.bin`, a field of any dataset), read in place;
//! - [`open`](open()): the front door: whichever of these a name names (a file, a directory, a
//!   pattern, a URL), found by one table of formats ([`detect`]), as a [`Source`]: the samples
//!   and what `gpufeed inspect` says of them ([`Description`]).
//!
//! A source never copies a sample: [`Dataset::get`] returns a view into its mapping, and the
//! loader copies it once, into its slot of the batch buffer. Sources are `Send + Sync` and are
//! shared by reference among worker threads; none holds per-thread state.
//!
//! # Mappings, and files that change while they are read
//!
//! [`RecordFile`](crate::format::RecordFile) and [`NpyArray`] read their file through a shared memory mapping by default
//! ([`ReadMode::Map`]): fast, but the file must not change while it is open. Truncating it
//! (`np.save` to the same path, for one) kills the process with `SIGBUS` at the next read past
//! its new end; bytes written in place are read as they change, silently. Replacing it (write a
//! new file, rename it over the old one, as [`RecordWriter`](crate::format::RecordWriter) does)
//! is safe: the open source keeps reading the old file.
//!
//! What a user must guarantee, or choose instead:
//!
//! - keep data files unchanged while they are open, and replace them only by renaming a new
//!   file into place; or
//! - open with [`ReadMode::Pread`] (for [`RecordFile`](crate::format::RecordFile), [`ReadOptions::mode`](crate::format::ReadOptions::mode); for [`NpyArray`],
//!   [`NpyArray::open_with`]; for any name, [`OpenOptions::read`]), which reads with `pread` and never
//!   maps: on a network file system, or for files that may be truncated, a short read is a
//!   typed [`Error::FileChanged`] instead of a signal;
//! - turn on [`ReadOptions::verify_checksums`](crate::format::ReadOptions::verify_checksums) to check every record read: a packed record
//!   against the checksum its writer stored ([`Error::ChecksumMismatch`]), a `.npy` row against
//!   the checksum the array took when it was opened ([`Error::FileChanged`]; one pass over the
//!   file at open), so that bytes rewritten in place are an error and not data, even within
//!   an epoch.
//!
//! Every file-backed source also remembers what its file was at open (device, inode, size,
//! modification and status-change times): [`Dataset::check_unchanged`] compares that with the
//! path now, and the loader calls it at the start of each epoch. The status-change time cannot
//! be put back, so a file written in place is reported even when its modification time was;
//! but it moves for metadata too (permissions, owner, a new hard link), and both times have
//! the file system's granularity (a few milliseconds on Linux): a write within that time of
//! the open is caught by checksums only. Sharded datasets of local files do so for each
//! shard open at that moment (see [`shards`](shards#shard-files-that-change)); shards
//! downloaded into a cache are not checked.

mod concat;
mod describe;
mod image_folder;
mod npy;
mod open;
mod packed;
pub mod shards;
pub mod table;
mod text;
pub mod tokens;
mod zip;

use std::borrow::Cow;
use std::path::Path;
use std::sync::{Arc, OnceLock};

pub use crate::file::ReadMode;
pub use concat::Concat;
pub use describe::{Description, Fact, Format, fields_json, fields_text};
pub use image_folder::{ImageFolder, pack_image_folder, packed_image_schema};
pub use npy::{NpyArray, npy_header};
pub use open::{OpenOptions, detect, open, open_all};
pub use text::{Text, TextColumn};
pub use zip::Zip;

use crate::file::RecordBuf;

use crate::error::{Error, Result};
use crate::format::{DType, FieldKind, Schema};
use crate::layout::{Element, cast_slice};

/// A map-style dataset: a length, a schema, and samples by index.
///
/// Implementations must be cheap to call from many threads at once: `get` is on the hot path.
pub trait Dataset: Send + Sync {
    /// The number of samples.
    fn len(&self) -> u64;

    /// True when there is no sample.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The fields every sample has.
    fn schema(&self) -> &Schema;

    /// Sample `index`, or an error naming the file and record at fault.
    fn get(&self, index: u64) -> Result<Sample<'_>>;

    /// Samples per shard, in order, for a data set made of shards (files, objects) that are
    /// best read a few at a time; `None` (the default) for one undivided data set. The
    /// loader's [`shuffle_blocks`](crate::LoaderBuilder::shuffle_blocks) needs it.
    fn shard_sizes(&self) -> Option<Vec<u64>> {
        None
    }

    /// `Some((window, block))` for a data set that must be read in windows: one whose random
    /// access is costly (a Parquet file decodes a chunk of rows to give one). When asked to
    /// shuffle without [`shuffle_blocks`](crate::LoaderBuilder::shuffle_blocks), the loader
    /// then shuffles in two levels, windows of `window` shards
    /// ([`shard_sizes`](Dataset::shard_sizes)) and blocks of `block` samples, instead of
    /// globally. `None` (the default): a global shuffle costs no more than reading in order.
    fn windowed_shuffle(&self) -> Option<(u64, u64)> {
        None
    }

    /// How many batches ahead of those being made the loader should announce with
    /// [`read_ahead`](Dataset::read_ahead); 0 (the default) for data sets that read on demand
    /// well enough (a mapping). Sources that fetch from slow storage say how far ahead they
    /// want to start fetching.
    fn read_ahead_batches(&self) -> usize {
        0
    }

    /// The loader will ask for these samples soon, in this order (one batch's indices, batch
    /// after batch, up to [`read_ahead_batches`](Dataset::read_ahead_batches) batches ahead of
    /// the workers), from the moment an epoch's first batch is delivered: the batches made
    /// before that are read by the workers on demand, so that the first batch never waits
    /// behind reads for later ones. A hint: called from the loader's thread, it must not block; it never
    /// changes what `get` returns. Default: nothing.
    fn read_ahead(&self, indices: &[u64]) {
        let _ = indices;
    }

    /// Checks that the files this dataset reads are still the ones it opened: that each path
    /// names the same file (device and inode) with the same size, modification time and
    /// status-change time (`ctime`, which moves when a file is written even if its
    /// modification time is put back).
    ///
    /// Returns [`Error::FileChanged`] naming the first file that was replaced, removed,
    /// truncated, extended or written since it was opened, and what changed; an
    /// [`Error::Io`] if a path cannot be looked at. Costs one `stat` per file and reads no
    /// data; safe to call from any thread, at any time, any number of times.
    ///
    /// The loader calls it at the start of every epoch, so that a data file changed under a
    /// running job fails the epoch with this error instead of being read (or, for a mapping
    /// that was truncated, killing the process). It is a check between epochs, not a guard
    /// on every read: see the [module's section on mappings](self) for what a file changed
    /// during an epoch does.
    ///
    /// The default returns `Ok(())`, for datasets that hold no open file (in memory, or read
    /// whole at every `get`, as [`ImageFolder`]). Wrappers forward it to what they wrap.
    fn check_unchanged(&self) -> Result<()> {
        Ok(())
    }

    /// A cheap hash of what identifies this data set's data, at a bounded cost whatever its
    /// size (for a file: its size and 256 KiB sampled evenly over it). A loader records it in
    /// its states and refuses to resume a state taken on data whose fingerprint differs:
    /// another data set of the same length.
    ///
    /// `None` (the default) for a data set with nothing cheap to hash; a state is then checked
    /// by its length only. Wrappers combine what they wrap.
    fn fingerprint(&self) -> Result<Option<u64>> {
        Ok(None)
    }
}

/// The fingerprint of data sets taken together, in order: `None` if one of them has none.
pub(crate) fn combined_fingerprint<D: Dataset>(parts: &[D]) -> Result<Option<u64>> {
    let prints = parts
        .iter()
        .map(Dataset::fingerprint)
        .collect::<Result<Option<Vec<u64>>>>()?;
    Ok(prints.map(crate::file::combined_fingerprint))
}

impl<D: Dataset + ?Sized> Dataset for Arc<D> {
    fn len(&self) -> u64 {
        (**self).len()
    }
    fn schema(&self) -> &Schema {
        (**self).schema()
    }
    fn get(&self, index: u64) -> Result<Sample<'_>> {
        (**self).get(index)
    }
    fn shard_sizes(&self) -> Option<Vec<u64>> {
        (**self).shard_sizes()
    }
    fn windowed_shuffle(&self) -> Option<(u64, u64)> {
        (**self).windowed_shuffle()
    }
    fn read_ahead_batches(&self) -> usize {
        (**self).read_ahead_batches()
    }
    fn read_ahead(&self, indices: &[u64]) {
        (**self).read_ahead(indices)
    }
    fn check_unchanged(&self) -> Result<()> {
        (**self).check_unchanged()
    }
    fn fingerprint(&self) -> Result<Option<u64>> {
        (**self).fingerprint()
    }
}

impl<D: Dataset + ?Sized> Dataset for Box<D> {
    fn len(&self) -> u64 {
        (**self).len()
    }
    fn schema(&self) -> &Schema {
        (**self).schema()
    }
    fn get(&self, index: u64) -> Result<Sample<'_>> {
        (**self).get(index)
    }
    fn shard_sizes(&self) -> Option<Vec<u64>> {
        (**self).shard_sizes()
    }
    fn windowed_shuffle(&self) -> Option<(u64, u64)> {
        (**self).windowed_shuffle()
    }
    fn read_ahead_batches(&self) -> usize {
        (**self).read_ahead_batches()
    }
    fn read_ahead(&self, indices: &[u64]) {
        (**self).read_ahead(indices)
    }
    fn check_unchanged(&self) -> Result<()> {
        (**self).check_unchanged()
    }
    fn fingerprint(&self) -> Result<Option<u64>> {
        (**self).fingerprint()
    }
}

/// A data set as [`open`](open()) returns it: its samples (a [`Dataset`]) and what it is.
///
/// Every format implements it: what `gpufeed inspect` prints ([`Source::describe`], cheap: no
/// pass over the data), a check of every sample ([`Source::verify`], `inspect --verify`), and
/// for formats read by shard, their sharded face (shard names, the store's counts).
pub trait Source: Dataset {
    /// The format.
    fn format(&self) -> Format;

    /// What it holds: the facts `gpufeed inspect` prints. Cheap: reads headers and indexes,
    /// no pass over the data.
    fn describe(&self) -> Result<Description>;

    /// Checks every sample (and every checksum where the format has them), calling
    /// `progress(done, total)` as it goes; the first fault is the error. The default reads
    /// every sample through [`Dataset::get`] and each of its fields.
    fn verify(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<()> {
        let n = self.len();
        for i in 0..n {
            let sample = self.get(i)?;
            for k in 0..self.schema().fields().len() {
                sample.try_field(k)?;
            }
            progress(i + 1, n);
        }
        Ok(())
    }

    /// The sharded face of a format read by shard (shard names, where a sample is, what its
    /// store fetched); `None` (the default) for others.
    fn sharded(&self) -> Option<&dyn shards::ShardedSource> {
        None
    }

    /// What the shared cache of decoded chunks did, for a format that decodes its rows in
    /// chunks (Parquet); `None` (the default) for others.
    fn chunk_cache(&self) -> Option<table::ChunkCacheStats> {
        None
    }
}

impl<S: Source + ?Sized> Source for Box<S> {
    fn format(&self) -> Format {
        (**self).format()
    }
    fn chunk_cache(&self) -> Option<table::ChunkCacheStats> {
        (**self).chunk_cache()
    }
    fn describe(&self) -> Result<Description> {
        (**self).describe()
    }
    fn verify(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<()> {
        (**self).verify(progress)
    }
    fn sharded(&self) -> Option<&dyn shards::ShardedSource> {
        (**self).sharded()
    }
}

impl<S: Source + ?Sized> Source for Arc<S> {
    fn format(&self) -> Format {
        (**self).format()
    }
    fn chunk_cache(&self) -> Option<table::ChunkCacheStats> {
        (**self).chunk_cache()
    }
    fn describe(&self) -> Result<Description> {
        (**self).describe()
    }
    fn verify(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<()> {
        (**self).verify(progress)
    }
    fn sharded(&self) -> Option<&dyn shards::ShardedSource> {
        (**self).sharded()
    }
}

/// One sample: a record's bytes and the schema that says where its fields are.
///
/// Sources that map their data hand out views into the mapping (no copy); sources that must
/// read (an image file, a decoded archive member) hand out bytes they own. A fixed-size record
/// of a file opened with [`ReadMode::Pread`] is not read by `get` at all: the sample holds the
/// record's place in the file, [`Sample::copy_field_into`] reads each field straight into its
/// batch slot, and the accessors that return bytes ([`Sample::bytes`], [`Sample::field`]) read
/// the whole record on first use.
#[derive(Clone)]
pub struct Sample<'a> {
    bytes: SampleBytes<'a>,
    schema: &'a Schema,
}

#[derive(Clone)]
enum SampleBytes<'a> {
    Borrowed(&'a [u8]),
    Owned(Vec<u8>),
    /// One span per field, in schema order, of `data` or of `decoded`; `data` keeps its
    /// buffer (a shard's mapping) alive, so the sample outlives the shard's place in a cache
    /// of open shards. `decoded` holds the values decoded from the container's bytes (an
    /// integer written as text), empty (no allocation) when there are none.
    Shared {
        data: bytes::Bytes,
        fields: Vec<FieldSpan>,
        decoded: Vec<u8>,
    },
    /// Read from a file into a reusable per-thread buffer.
    Read(RecordBuf),
    /// A fixed-size record of a file, read when asked for.
    Unread(UnreadRecord<'a>),
    /// Fields gathered from samples of several datasets ([`Zip`]): field `k` is field
    /// `fields[k].1` of `parts[fields[k].0]`. The record of the zipped schema is laid out on
    /// first use of [`Sample::bytes`] only.
    Zipped {
        parts: Vec<Sample<'a>>,
        fields: &'a [(usize, usize)],
        record: OnceLock<Vec<u8>>,
    },
    /// One buffer per field, in schema order, each a reference-counted view of the buffer
    /// that holds the field (a decoded column of a table, a file's mapping): no copy. The
    /// record of the schema is laid out on first use of [`Sample::bytes`] only.
    Fields {
        fields: Vec<bytes::Bytes>,
        record: OnceLock<Vec<u8>>,
    },
}

/// Where one field of a sample made of spans ([`Sample::shared_fields`], and the shard
/// formats' decoded samples) lies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum FieldSpan {
    /// Bytes of the shared buffer (a member or column in place).
    Shared(std::ops::Range<usize>),
    /// Bytes of the sample's own buffer of decoded values.
    Decoded(std::ops::Range<usize>),
}

impl FieldSpan {
    /// The field's bytes, from the shared buffer or the decoded values.
    fn of<'s>(&self, data: &'s [u8], decoded: &'s [u8]) -> Option<&'s [u8]> {
        match self {
            FieldSpan::Shared(r) => data.get(r.clone()),
            FieldSpan::Decoded(r) => decoded.get(r.clone()),
        }
    }
}

/// Where a fixed-size record lies in a file opened with [`ReadMode::Pread`].
#[derive(Clone)]
struct UnreadRecord<'a> {
    file: &'a std::fs::File,
    path: &'a Path,
    /// The file's size at open.
    file_len: u64,
    at: u64,
    len: usize,
    /// The whole record, once an accessor asked for bytes.
    loaded: OnceLock<RecordBuf>,
}

impl UnreadRecord<'_> {
    fn read(&self, within: std::ops::Range<usize>, dst: &mut [u8]) -> Result<()> {
        crate::file::pread_exact(
            self.file,
            self.path,
            self.at + within.start as u64,
            dst,
            self.file_len,
        )
    }

    fn load(&self) -> Result<&[u8]> {
        if let Some(b) = self.loaded.get() {
            return Ok(b.as_slice());
        }
        let mut buf = RecordBuf::with_len(self.len);
        self.read(0..self.len, buf.as_mut_slice())?;
        // Another thread sharing this sample may have loaded it meanwhile: either copy will do.
        Ok(self.loaded.get_or_init(|| buf).as_slice())
    }
}

impl<'a> Sample<'a> {
    /// A sample over `bytes`, which `schema.check_record` accepted.
    pub(crate) fn new(bytes: &'a [u8], schema: &'a Schema) -> Sample<'a> {
        Sample {
            bytes: SampleBytes::Borrowed(bytes),
            schema,
        }
    }

    /// A sample over a record read into `buf`, which `schema.check_record` accepted.
    pub(crate) fn read(buf: RecordBuf, schema: &'a Schema) -> Sample<'a> {
        Sample {
            bytes: SampleBytes::Read(buf),
            schema,
        }
    }

    /// The record of `len` bytes at `at` in `file` (`file_len` bytes at open), read when asked
    /// for. `schema` must be fixed-size and its minimum must fit in `len` (the caller checked).
    pub(crate) fn unread(
        file: &'a std::fs::File,
        path: &'a Path,
        file_len: u64,
        at: u64,
        len: usize,
        schema: &'a Schema,
    ) -> Sample<'a> {
        debug_assert!(schema.is_fixed() && schema.min_record_bytes() <= len);
        Sample {
            bytes: SampleBytes::Unread(UnreadRecord {
                file,
                path,
                file_len,
                at,
                len,
                loaded: OnceLock::new(),
            }),
            schema,
        }
    }

    /// A sample whose field `k` is field `fields[k].1` of `parts[fields[k].0]` ([`Zip`]);
    /// the caller checked that `fields` indexes `parts` and agrees with `schema`.
    pub(crate) fn zipped(
        parts: Vec<Sample<'a>>,
        fields: &'a [(usize, usize)],
        schema: &'a Schema,
    ) -> Sample<'a> {
        Sample {
            bytes: SampleBytes::Zipped {
                parts,
                fields,
                record: OnceLock::new(),
            },
            schema,
        }
    }

    /// A sample whose field `k` is `fields[k]` (in schema order), each a view of its own
    /// buffer: a table's decoded columns, whose fields are not ranges of one buffer. Checked
    /// here: one buffer per field, each tensor field's exactly its schema's size.
    pub(crate) fn fields(fields: Vec<bytes::Bytes>, schema: &'a Schema) -> Result<Sample<'a>> {
        if fields.len() != schema.fields().len() {
            return Err(Error::mismatch(format!(
                "{} fields for a schema of {} fields",
                fields.len(),
                schema.fields().len()
            )));
        }
        for (k, (b, field)) in fields.iter().zip(schema.fields()).enumerate() {
            if let Some(want) = schema.fixed_range(k).map(|r| r.len())
                && b.len() != want
            {
                return Err(Error::mismatch(format!(
                    "field `{}` has {} bytes, its schema says {want}",
                    field.name,
                    b.len()
                )));
            }
        }
        Ok(Sample {
            bytes: SampleBytes::Fields {
                fields,
                record: OnceLock::new(),
            },
            schema,
        })
    }

    /// A sample that borrows its record bytes (laid out as `schema` says); checked here.
    /// For sources that keep their data in memory they own.
    pub fn borrowed(bytes: &'a [u8], schema: &'a Schema) -> Result<Sample<'a>> {
        schema
            .record_end(bytes)
            .map_err(|e| Error::mismatch(format!("record does not fit its schema: {e}")))?;
        Ok(Sample::new(bytes, schema))
    }

    /// A sample that owns its record bytes, laid out as `schema` says (see
    /// [`Schema::record_bytes`] and `docs/FORMAT.md`, "Record"); checked here.
    pub fn owned(bytes: Vec<u8>, schema: &'a Schema) -> Result<Sample<'a>> {
        schema
            .record_end(&bytes)
            .map_err(|e| Error::mismatch(format!("record does not fit its schema: {e}")))?;
        Ok(Sample {
            bytes: SampleBytes::Owned(bytes),
            schema,
        })
    }

    /// A sample whose fields are separate ranges of one shared buffer: `fields[k]` is field
    /// `k`'s bytes within `data` (in schema order). No byte is copied: `data` is a reference
    /// counted view (of a shard's mapping, say) that the sample keeps alive.
    ///
    /// For containers whose fields are not laid out as a packed record (tar members, MDS
    /// columns). Checked here: one range per field, each inside `data`, and each tensor
    /// field's range exactly its schema's size. Tensor fields need not be aligned in memory.
    pub fn shared_fields(
        data: bytes::Bytes,
        fields: Vec<std::ops::Range<usize>>,
        schema: &'a Schema,
    ) -> Result<Sample<'a>> {
        let spans = fields.into_iter().map(FieldSpan::Shared).collect();
        Sample::spans(data, spans, Vec::new(), schema)
    }

    /// A sample whose field `k` is `spans[k]`: a range of `data` (in place) or of `decoded`
    /// (values the format decoded from its container's bytes, such as an integer written as
    /// text). Checked as [`Sample::shared_fields`] checks.
    pub(crate) fn spans(
        data: bytes::Bytes,
        spans: Vec<FieldSpan>,
        decoded: Vec<u8>,
        schema: &'a Schema,
    ) -> Result<Sample<'a>> {
        if spans.len() != schema.fields().len() {
            return Err(Error::mismatch(format!(
                "{} field ranges for a schema of {} fields",
                spans.len(),
                schema.fields().len()
            )));
        }
        for (k, (span, field)) in spans.iter().zip(schema.fields()).enumerate() {
            let (range, within, what) = match span {
                FieldSpan::Shared(r) => (r, data.len(), "the sample's"),
                FieldSpan::Decoded(r) => (r, decoded.len(), "the decoded values'"),
            };
            if range.start > range.end || range.end > within {
                return Err(Error::mismatch(format!(
                    "field `{}`: range {}..{} is outside {what} {within} bytes",
                    field.name, range.start, range.end,
                )));
            }
            if let Some(want) = schema.fixed_range(k).map(|r| r.len())
                && range.len() != want
            {
                return Err(Error::mismatch(format!(
                    "field `{}` has {} bytes, its schema says {want}",
                    field.name,
                    range.len()
                )));
            }
        }
        Ok(Sample {
            bytes: SampleBytes::Shared {
                data,
                fields: spans,
                decoded,
            },
            schema,
        })
    }

    /// The bytes of field `k` (in schema order), or `None` if there is no such field.
    ///
    /// For a sample of a file opened with [`ReadMode::Pread`], the first call reads the record;
    /// if that read fails this is `None` too: [`Sample::try_field`] returns the error.
    pub fn field(&self, k: usize) -> Option<&[u8]> {
        match &self.bytes {
            SampleBytes::Shared {
                data,
                fields,
                decoded,
            } => fields.get(k)?.of(data, decoded),
            SampleBytes::Zipped { parts, fields, .. } => {
                let &(part, j) = fields.get(k)?;
                parts.get(part)?.field(j)
            }
            SampleBytes::Fields { fields, .. } => fields.get(k).map(|b| &b[..]),
            _ => self.schema.field_in(self.bytes().ok()?, k),
        }
    }

    /// The bytes of field `k`, or an error: no such field, or (for a sample of a file opened
    /// with [`ReadMode::Pread`]) the read failed.
    pub fn try_field(&self, k: usize) -> Result<&[u8]> {
        if let SampleBytes::Shared {
            data,
            fields,
            decoded,
        } = &self.bytes
        {
            return fields
                .get(k)
                .and_then(|span| span.of(data, decoded))
                .ok_or_else(|| {
                    Error::mismatch(format!(
                        "no field {k} in a sample of schema [{}]",
                        self.schema
                    ))
                });
        }
        if let SampleBytes::Zipped { parts, fields, .. } = &self.bytes {
            let &(part, j) = fields.get(k).ok_or_else(|| {
                Error::mismatch(format!(
                    "no field {k} in a sample of schema [{}]",
                    self.schema
                ))
            })?;
            return parts[part].try_field(j);
        }
        if let SampleBytes::Fields { fields, .. } = &self.bytes {
            return fields.get(k).map(|b| &b[..]).ok_or_else(|| {
                Error::mismatch(format!(
                    "no field {k} in a sample of schema [{}]",
                    self.schema
                ))
            });
        }
        let bytes = self.bytes()?;
        self.schema.field_in(bytes, k).ok_or_else(|| {
            Error::mismatch(format!(
                "no field {k} in a sample of schema [{}]",
                self.schema
            ))
        })
    }

    /// The bytes of the field called `name`.
    pub fn field_named(&self, name: &str) -> Option<&[u8]> {
        self.field(self.schema.index_of(name)?)
    }

    /// The field called `name` as elements of `T`: a tensor field's values, a
    /// [`Codec::Elements`](crate::format::Codec::Elements) field's values (a ragged field:
    /// a list of numbers), or (with `T = u8`) a bytes field's bytes.
    ///
    /// `T` must be the field's element type (`u8` also views `bool` and every bytes field,
    /// `u16` also views `f16` and `bf16`); an unknown name or another type is an
    /// [`Error::Mismatch`] naming the field and the sample's fields. Inside a transform the loader adds the sample's index and
    /// batch to any error ([`Error::Sample`]).
    ///
    /// Borrowed, without a copy, when the field's bytes are aligned for `T`: tensor fields of
    /// packed record files and of `.npy` arrays written by NumPy are. Bytes that are not
    /// (a tensor inside a tar member, an array whose header leaves its data unaligned) are
    /// copied into an owned vector: this never returns a misaligned slice.
    ///
    /// ```
    /// use gpufeed::{DType, Field, Sample, Schema};
    ///
    /// let schema = Schema::new(vec![
    ///     Field::tensor("x", DType::F32, &[2]),
    ///     Field::tensor("label", DType::U32, &[]),
    /// ])
    /// .unwrap();
    /// let mut record = Vec::new();
    /// schema
    ///     .build_record(&[&[0, 0, 128, 63, 0, 0, 0, 64], &7u32.to_le_bytes()], &mut record)
    ///     .unwrap();
    /// let sample = Sample::owned(record, &schema)?;
    /// assert_eq!(*sample.field_as::<f32>("x")?, [1.0, 2.0]);
    /// assert_eq!(*sample.field_as::<u32>("label")?, [7]);
    /// assert!(sample.field_as::<f64>("x").is_err()); // x is f32
    /// assert!(sample.field_as::<u32>("y").is_err()); // no such field
    /// # Ok::<(), gpufeed::Error>(())
    /// ```
    pub fn field_as<T: Element>(&self, name: &str) -> Result<Cow<'_, [T]>> {
        let k = self.schema.index_of(name).ok_or_else(|| {
            let names: Vec<&str> = self
                .schema
                .fields()
                .iter()
                .map(|f| f.name.as_str())
                .collect();
            Error::mismatch(format!(
                "the sample has no field `{name}` (its fields: {names:?})"
            ))
        })?;
        let what = match &self.schema.fields()[k].kind {
            FieldKind::Tensor { dtype, .. } if T::matches(*dtype) => None,
            FieldKind::Tensor { dtype, .. } => Some(dtype.to_string()),
            FieldKind::Bytes { .. } if T::matches(DType::U8) => None,
            FieldKind::Bytes {
                codec: crate::format::Codec::Elements(dtype),
            } if T::matches(*dtype) => None,
            FieldKind::Bytes { codec } => Some(format!("{} bytes (read them as u8)", codec.name())),
        };
        if let Some(what) = what {
            return Err(Error::mismatch(format!(
                "field `{name}` is {what}, not {}",
                crate::layout::element_name::<T>()
            )));
        }
        let bytes = self.try_field(k)?;
        if let Some(typed) = cast_slice::<T>(bytes) {
            return Ok(Cow::Borrowed(typed));
        }
        if !bytes.len().is_multiple_of(std::mem::size_of::<T>()) {
            return Err(Error::mismatch(format!(
                "field `{name}` has {} bytes, not a whole number of {}",
                bytes.len(),
                crate::layout::element_name::<T>()
            )));
        }
        Ok(Cow::Owned(copy_to_vec(bytes)))
    }

    /// The record's bytes as stored (fields, length table, padding). A sample of a file
    /// opened with [`ReadMode::Pread`] reads them on first use, which can fail. For a sample
    /// made by [`Sample::shared_fields`], the bytes that hold it in its container (its fields
    /// and whatever the container puts between them, such as tar headers).
    pub fn bytes(&self) -> Result<&[u8]> {
        match &self.bytes {
            SampleBytes::Borrowed(b) => Ok(b),
            SampleBytes::Owned(v) => Ok(v),
            SampleBytes::Shared { data, .. } => Ok(data),
            SampleBytes::Read(b) => Ok(b.as_slice()),
            SampleBytes::Unread(u) => u.load(),
            SampleBytes::Zipped { record, .. } | SampleBytes::Fields { record, .. } => {
                if let Some(r) = record.get() {
                    return Ok(r);
                }
                let values = (0..self.schema.fields().len())
                    .map(|k| self.try_field(k))
                    .collect::<Result<Vec<_>>>()?;
                let mut out = Vec::new();
                self.schema
                    .build_record(&values, &mut out)
                    .map_err(|e| Error::mismatch(format!("sample of separate fields: {e}")))?;
                Ok(record.get_or_init(|| out))
            }
        }
    }

    /// The record's length in bytes (padding included), known without reading it.
    pub fn len(&self) -> usize {
        match &self.bytes {
            SampleBytes::Borrowed(b) => b.len(),
            SampleBytes::Owned(v) => v.len(),
            SampleBytes::Shared { data, .. } => data.len(),
            SampleBytes::Read(b) => b.as_slice().len(),
            SampleBytes::Unread(u) => u.len,
            SampleBytes::Zipped { record, .. } | SampleBytes::Fields { record, .. } => {
                match record.get() {
                    Some(r) => r.len(),
                    None => self.schema.record_bytes(
                        (0..self.schema.fields().len())
                            .filter(|&k| self.schema.fixed_range(k).is_none())
                            .map(|k| self.field(k).map_or(0, <[u8]>::len)),
                    ),
                }
            }
        }
    }

    /// True when the record has no byte.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies field `k` into `dst`, which must be exactly the field's size (a batch slot).
    ///
    /// From a mapping or bytes in memory this is one copy (with streaming stores for large
    /// fields). For a fixed-size record of a file opened with
    /// [`ReadMode::Pread`] that no accessor has read yet, it is one `pread` of the field
    /// straight into `dst`: no intermediate buffer, no allocation. [`CopyFields`](crate::CopyFields)
    /// writes every field this way.
    pub fn copy_field_into(&self, k: usize, dst: &mut [u8]) -> Result<()> {
        if let SampleBytes::Zipped { parts, fields, .. } = &self.bytes {
            let &(part, j) = fields.get(k).ok_or_else(|| {
                Error::mismatch(format!(
                    "no field {k} in a sample of schema [{}]",
                    self.schema
                ))
            })?;
            return parts[part].copy_field_into(j, dst);
        }
        if let SampleBytes::Unread(u) = &self.bytes
            && u.loaded.get().is_none()
        {
            let range = self.schema.fixed_range(k).ok_or_else(|| {
                Error::mismatch(format!(
                    "no field {k} in a sample of schema [{}]",
                    self.schema
                ))
            })?;
            if range.len() != dst.len() {
                return Err(size_mismatch(k, range.len(), dst.len()));
            }
            return u.read(range, dst);
        }
        let src = self.try_field(k)?;
        if src.len() != dst.len() {
            return Err(size_mismatch(k, src.len(), dst.len()));
        }
        crate::memory::copy_to_batch(dst, src);
        Ok(())
    }

    /// The schema of this sample.
    pub fn schema(&self) -> &'a Schema {
        self.schema
    }
}

/// `bytes` (a whole number of `T`s, at any alignment) copied into a vector of `T`.
fn copy_to_vec<T: Element>(bytes: &[u8]) -> Vec<T> {
    let size = std::mem::size_of::<T>();
    let n = bytes.len() / size;
    let mut out: Vec<T> = Vec::with_capacity(n);
    // SAFETY: `out` has room for `n` elements, `n * size` bytes, and `bytes` holds at least as
    // many; a fresh vector does not overlap `bytes`. Every one of the `n` elements is written in
    // full before `set_len`, and `T: Element` (sealed) has no padding and is valid for every
    // bit pattern, so they are initialised values of `T`. A byte copy needs no alignment of
    // the source.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.as_mut_ptr().cast::<u8>(), n * size);
        out.set_len(n);
    }
    out
}

fn size_mismatch(k: usize, field: usize, slot: usize) -> Error {
    Error::mismatch(format!(
        "field {k} has {field} bytes, its batch slot {slot}"
    ))
}

impl std::fmt::Debug for Sample<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let how = match &self.bytes {
            SampleBytes::Borrowed(_) => "borrowed",
            SampleBytes::Owned(_) => "owned",
            SampleBytes::Shared { .. } => "shared",
            SampleBytes::Read(_) => "read",
            SampleBytes::Unread(_) => "unread",
            SampleBytes::Zipped { .. } => "zipped",
            SampleBytes::Fields { .. } => "fields",
        };
        f.debug_struct("Sample")
            .field("bytes", &self.len())
            .field("how", &how)
            .field("schema", &self.schema.to_string())
            .finish()
    }
}

/// Any source a path can name, behind one type.
pub type AnySource = Box<dyn Dataset>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{Codec, Field};

    fn schema() -> Schema {
        Schema::new(vec![
            Field::tensor("x", DType::F32, &[2]),
            Field::tensor("half", DType::F16, &[]),
            Field::bytes("name", Codec::Utf8),
        ])
        .unwrap()
    }

    #[test]
    fn field_as_reads_fields_by_name_and_type() {
        let schema = schema();
        let mut record = Vec::new();
        let x = [1.5f32, -2.0].map(f32::to_le_bytes).concat();
        let h = half::f16::from_f32(0.25).to_le_bytes();
        schema.build_record(&[&x, &h, b"cat"], &mut record).unwrap();
        let s = Sample::owned(record, &schema).unwrap();
        assert_eq!(*s.field_as::<f32>("x").unwrap(), [1.5, -2.0]);
        assert_eq!(
            *s.field_as::<half::f16>("half").unwrap(),
            [half::f16::from_f32(0.25)]
        );
        assert_eq!(s.field_as::<u16>("half").unwrap().len(), 1);
        assert_eq!(*s.field_as::<u8>("name").unwrap(), *b"cat");
        for (e, want) in [
            (s.field_as::<f64>("x").unwrap_err(), "`x` is f32, not f64"),
            (
                s.field_as::<half::bf16>("half").unwrap_err(),
                "`half` is f16, not bf16",
            ),
            (s.field_as::<i8>("name").unwrap_err(), "read them as u8"),
            (s.field_as::<u8>("nope").unwrap_err(), "no field `nope`"),
        ] {
            assert!(matches!(e, Error::Mismatch { .. }), "{e}");
            assert!(e.to_string().contains(want), "`{want}` not in: {e}");
        }
    }

    #[test]
    fn field_as_reads_the_values_of_a_ragged_field_by_their_dtype() {
        let schema =
            Schema::new(vec![Field::bytes("tokens", Codec::Elements(DType::U32))]).unwrap();
        let mut record = Vec::new();
        let values = [7u32, 8, 9].map(u32::to_le_bytes).concat();
        schema.build_record(&[&values], &mut record).unwrap();
        let s = Sample::owned(record, &schema).unwrap();
        assert_eq!(*s.field_as::<u32>("tokens").unwrap(), [7, 8, 9]);
        assert_eq!(s.field_as::<u8>("tokens").unwrap().len(), 12);
        let e = s.field_as::<i64>("tokens").unwrap_err();
        assert!(e.to_string().contains("u32 values"), "{e}");
    }

    #[test]
    fn field_as_borrows_aligned_bytes_and_copies_the_others() {
        let schema = Schema::new(vec![Field::tensor("v", DType::U32, &[3])]).unwrap();
        let values = [7u32, 8, 9].map(u32::to_le_bytes).concat();
        // The same 12 bytes at offset 4 (aligned) and at offset 1 (not) of one buffer.
        for at in [4usize, 1] {
            let mut data = vec![0u8; 20];
            data[at..at + 12].copy_from_slice(&values);
            let data = bytes::Bytes::from(data);
            let base = data.as_ptr() as usize;
            let ranges: Vec<_> = std::iter::once(at..at + 12).collect();
            let s = Sample::shared_fields(data, ranges, &schema).unwrap();
            let v = s.field_as::<u32>("v").unwrap();
            assert_eq!(*v, [7, 8, 9]);
            let aligned = (base + at).is_multiple_of(4);
            assert_eq!(matches!(v, Cow::Borrowed(_)), aligned, "offset {at}");
        }
    }
}
