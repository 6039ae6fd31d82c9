//! Where samples come from: every source is a map-style [`Dataset`] of zero-copy [`Sample`]s.
//!
//! - [`RecordFile`]: a packed record file;
//! - [`NpyArray`]: a `.npy` array, memory-mapped in place, one row a sample;
//! - [`ImageFolder`]: a directory of class subdirectories of JPEG/PNG files (torchvision's);
//! - [`Concat`]: several sources of one schema as one dataset (a few files, all opened);
//! - [`shards`]: sharded datasets (packed shards, WebDataset tar shards, MosaicML MDS), each
//!   shard opened on first use, a bounded number open at once;
//! - [`open`]: whichever of these a path names.
//!
//! A source never copies a sample: [`Dataset::get`] returns a view into its mapping, and the
//! loader copies it once, into its slot of the batch buffer. Sources are `Send + Sync` and are
//! shared by reference among worker threads; none holds per-thread state.

mod concat;
mod image_folder;
mod npy;
pub mod shards;

use std::path::Path;
use std::sync::Arc;

pub use concat::Concat;
pub use image_folder::{ImageFolder, pack_image_folder, packed_image_schema};
pub use npy::{NpyArray, npy_header};

use crate::error::{Error, Result};
use crate::format::{RecordFile, Schema};

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

    /// How many batches ahead of those being made the loader should announce with
    /// [`read_ahead`](Dataset::read_ahead); 0 (the default) for data sets that read on demand
    /// well enough (a mapping). Sources that fetch from slow storage say how far ahead they
    /// want to start fetching.
    fn read_ahead_batches(&self) -> usize {
        0
    }

    /// The loader will ask for these samples soon, in this order (one batch's indices, batch
    /// after batch, up to [`read_ahead_batches`](Dataset::read_ahead_batches) batches ahead of
    /// the workers). A hint: called from the loader's thread, it must not block; it never
    /// changes what `get` returns. Default: nothing.
    fn read_ahead(&self, indices: &[u64]) {
        let _ = indices;
    }
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
    fn read_ahead_batches(&self) -> usize {
        (**self).read_ahead_batches()
    }
    fn read_ahead(&self, indices: &[u64]) {
        (**self).read_ahead(indices)
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
    fn read_ahead_batches(&self) -> usize {
        (**self).read_ahead_batches()
    }
    fn read_ahead(&self, indices: &[u64]) {
        (**self).read_ahead(indices)
    }
}

/// One sample: a record's bytes and the schema that says where its fields are.
///
/// Sources that map their data hand out views into the mapping (no copy); sources that must
/// read (an image file, a decoded archive member) hand out bytes they own.
#[derive(Clone)]
pub struct Sample<'a> {
    bytes: SampleBytes<'a>,
    schema: &'a Schema,
}

#[derive(Clone)]
enum SampleBytes<'a> {
    Borrowed(&'a [u8]),
    Owned(Vec<u8>),
    /// One range of `data` per field, in schema order; `data` keeps its buffer (a shard's
    /// mapping) alive, so the sample outlives the shard's place in a cache of open shards.
    Shared {
        data: bytes::Bytes,
        fields: Vec<std::ops::Range<usize>>,
    },
}

impl<'a> Sample<'a> {
    /// A sample over `bytes`, which `schema.check_record` accepted.
    pub(crate) fn new(bytes: &'a [u8], schema: &'a Schema) -> Sample<'a> {
        Sample {
            bytes: SampleBytes::Borrowed(bytes),
            schema,
        }
    }

    /// A sample that borrows its record bytes (laid out as `schema` says); checked here.
    /// For sources that keep their data in memory they own.
    pub fn borrowed(bytes: &'a [u8], schema: &'a Schema) -> Result<Sample<'a>> {
        schema
            .check_record(bytes)
            .map_err(|e| Error::mismatch(format!("record does not fit its schema: {e}")))?;
        Ok(Sample::new(bytes, schema))
    }

    /// A sample that owns its record bytes, laid out as `schema` says (see
    /// [`Schema::record_bytes`] and `docs/FORMAT.md`, "Record"); checked here.
    pub fn owned(bytes: Vec<u8>, schema: &'a Schema) -> Result<Sample<'a>> {
        schema
            .check_record(&bytes)
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
        if fields.len() != schema.fields().len() {
            return Err(Error::mismatch(format!(
                "{} field ranges for a schema of {} fields",
                fields.len(),
                schema.fields().len()
            )));
        }
        for (k, (range, field)) in fields.iter().zip(schema.fields()).enumerate() {
            if range.start > range.end || range.end > data.len() {
                return Err(Error::mismatch(format!(
                    "field `{}`: range {}..{} is outside the sample's {} bytes",
                    field.name,
                    range.start,
                    range.end,
                    data.len()
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
            bytes: SampleBytes::Shared { data, fields },
            schema,
        })
    }

    /// The bytes of field `k` (in schema order), or `None` if there is no such field.
    pub fn field(&self, k: usize) -> Option<&[u8]> {
        match &self.bytes {
            SampleBytes::Shared { data, fields } => data.get(fields.get(k)?.clone()),
            _ => self.schema.field_in(self.bytes(), k),
        }
    }

    /// The bytes of the field called `name`.
    pub fn field_named(&self, name: &str) -> Option<&[u8]> {
        self.field(self.schema.index_of(name)?)
    }

    /// The record's bytes as stored (fields, length table, padding). For a sample made by
    /// [`Sample::shared_fields`], the bytes that hold it in its container (its fields and
    /// whatever the container puts between them, such as tar headers).
    pub fn bytes(&self) -> &[u8] {
        match &self.bytes {
            SampleBytes::Borrowed(b) => b,
            SampleBytes::Owned(v) => v,
            SampleBytes::Shared { data, .. } => data,
        }
    }

    /// The schema of this sample.
    pub fn schema(&self) -> &'a Schema {
        self.schema
    }
}

impl std::fmt::Debug for Sample<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sample")
            .field("bytes", &self.bytes().len())
            .field("schema", &self.schema.to_string())
            .finish()
    }
}

/// Any source a path can name, behind one type.
pub type AnySource = Box<dyn Dataset>;

/// Opens `path` as a dataset: a shard directory, `.tar` file or brace pattern of them (see
/// [`shards::open`]), a `.npy` array (by its magic bytes) or a packed record file.
pub fn open(path: impl AsRef<Path>) -> Result<AnySource> {
    let path = path.as_ref();
    if let Some(spec) = path.to_str()
        && shards::is_shard_spec(spec)
    {
        let sharded: Box<dyn Dataset> = shards::open(spec)?;
        return Ok(sharded);
    }
    let mut magic = [0u8; 8];
    {
        use std::io::Read;
        let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, "open", e))?;
        let mut got = 0;
        while got < magic.len() {
            match f.read(&mut magic[got..]) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io(path, "read", e)),
            }
        }
    }
    if magic.starts_with(npy::NPY_MAGIC) {
        Ok(Box::new(NpyArray::open(path)?))
    } else {
        Ok(Box::new(RecordFile::open(path)?))
    }
}

/// Opens many files (shards) as one dataset; all must have the same schema.
pub fn open_shards<P: AsRef<Path>>(paths: &[P]) -> Result<Concat<AnySource>> {
    let parts = paths.iter().map(open).collect::<Result<Vec<_>>>()?;
    Concat::new(parts)
}
