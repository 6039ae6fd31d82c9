//! Parquet data sets: a file, a directory of `.parquet` files or a pattern of them, with one
//! schema; the rows of all files form one index.
//!
//! # Chunks, and the cache shared by the workers
//!
//! A Parquet file is read by row group, and writers choose row groups of any size (pyarrow up
//! to 1 Mi rows, `datasets` 2 groups for 169 MB of text, others 500 rows). So each row group
//! is split into *chunks* of at most [`TableOptions::chunk_rows`] rows (by default, chosen
//! from the group's size in the footer so that a decoded chunk is about
//! [`DEFAULT_CHUNK_BYTES`]), with prefix sums over files, groups
//! and chunks: unequal sizes are the rule. A chunk is the unit that is decoded (only the
//! columns read, only its rows: pages before it are skipped, through the file's page index
//! where it has one) and cached: decoded chunks are held for all workers together in one
//! cache bounded in bytes ([`TableOptions::cache_bytes`]), each decoded once however many
//! workers want it, the least recently used dropped first ([`ParquetDataset::cache_stats`]).
//! A sample holds views of its chunk's buffers (no copy), so dropping a chunk never
//! invalidates a sample in flight. Numbers and fixed-size lists of numbers are decoded
//! straight into their rows' values where the chunk holds no null (`dense.rs`), the other
//! columns by Arrow's reader.
//!
//! Workers decode different chunks at once: the loader announces the rows of the batches
//! ahead ([`Dataset::read_ahead`]), and a worker that finds the chunk it needs being decoded
//! by another decodes an announced chunk meanwhile instead of waiting (at a window's start,
//! every worker wants the window's chunks at once). Decoding ahead stays within the cache's
//! limit and never drops a chunk in use to make room.
//!
//! # Order: windows, not a global shuffle
//!
//! A global shuffle would decode a chunk for nearly every sample. The data set's chunks are its
//! shards ([`Dataset::shard_sizes`]) and it asks to be read in windows
//! ([`Dataset::windowed_shuffle`]): a shuffling loader permutes the chunks, cuts them into
//! windows of [`TableOptions::window`] chunks and shuffles the rows of each window together.
//! What the window buys: a row's neighbours in the order come from `window` chunks spread
//! over the whole data set, not from its own chunk. What it costs: `window` decoded chunks in
//! memory (two windows at a window's edge: the cache's default size). Each row is read once
//! per epoch, ranks get disjoint rows and equal batch counts, and a resume is exact (also under
//! another world size), as for any loader order.

use std::collections::VecDeque;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use arrow_array::{ArrayRef, RecordBatch};
use bytes::Bytes;
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder, RowSelection,
    RowSelector,
};
use parquet::file::metadata::PageIndexPolicy;
use parquet::file::reader::ChunkReader;

use super::cache::{ChunkCache, ChunkCacheStats};
use super::columns::{Columns, Plan, row_error};
use super::dense::DenseColumn;
use super::{
    DEFAULT_CHUNK_BYTES, DEFAULT_WINDOW, FileSummary, MapOwner, TableOptions, TableSummary, guard,
    same_columns,
};
use crate::error::{Error, Result};
use crate::file::{FileData, FileIdentity, open_file};
use crate::format::Schema;
use crate::source::{Dataset, Sample};

const FORMAT: &str = "parquet";

/// Batches beyond those in flight whose rows the loader announces ([`Dataset::read_ahead`]):
/// enough that a window's chunks are known before the workers reach it, so that workers who
/// would wait for one chunk decode the others.
const READ_AHEAD_BATCHES: usize = 8;

/// How a file's bytes reach the Parquet reader.
#[derive(Clone)]
enum Reader {
    /// The file's mapping: pages are read in place.
    Map(Bytes),
    /// The file, read at offsets.
    File(PreadFile),
}

/// A file read with `pread` at offsets, for the Parquet reader. Not `File`'s own
/// `ChunkReader`: that seeks a descriptor whose offset all its clones share, which races when
/// workers decode chunks of one file at once.
#[derive(Clone)]
struct PreadFile {
    file: Arc<File>,
    /// The file's size at open.
    len: u64,
}

impl ::parquet::file::reader::Length for PreadFile {
    fn len(&self) -> u64 {
        self.len
    }
}

/// A reader of a [`PreadFile`] from a position on.
struct PreadReader {
    file: Arc<File>,
    at: u64,
    end: u64,
}

impl std::io::Read for PreadReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use std::os::unix::fs::FileExt;
        let room = usize::try_from(self.end.saturating_sub(self.at)).unwrap_or(usize::MAX);
        let want = buf.len().min(room);
        if want == 0 {
            return Ok(0);
        }
        let n = self.file.read_at(&mut buf[..want], self.at)?;
        self.at += n as u64;
        Ok(n)
    }
}

impl ChunkReader for PreadFile {
    type T = std::io::BufReader<PreadReader>;

    fn get_read(&self, start: u64) -> ::parquet::errors::Result<Self::T> {
        Ok(std::io::BufReader::new(PreadReader {
            file: Arc::clone(&self.file),
            at: start,
            end: self.len,
        }))
    }

    fn get_bytes(&self, start: u64, length: usize) -> ::parquet::errors::Result<Bytes> {
        use std::os::unix::fs::FileExt;
        if start
            .checked_add(length as u64)
            .is_none_or(|end| end > self.len)
        {
            return Err(::parquet::errors::ParquetError::EOF(format!(
                "{length} bytes at {start} are past the file's {} bytes",
                self.len
            )));
        }
        let mut buf = vec![0u8; length];
        self.file.read_exact_at(&mut buf, start)?;
        Ok(Bytes::from(buf))
    }
}

struct ParquetFile {
    path: PathBuf,
    reader: Reader,
    identity: FileIdentity,
    meta: ArrowReaderMetadata,
    /// For each of the plan's roots, its dense reading when the file's layout allows one
    /// (`dense.rs`); the others, and a chunk a dense reading gives back, go through Arrow's
    /// reader.
    dense: Vec<Option<DenseColumn>>,
    bytes: u64,
    rows: u64,
}

/// A chunk: rows `start..start + len` of row group `group` of file `file`.
#[derive(Clone, Copy, Debug)]
struct Chunk {
    file: usize,
    group: usize,
    start: u64,
    len: u64,
    /// The chunk's first row within its file.
    file_row: u64,
}

/// A Parquet data set (see the [module](self)).
pub struct ParquetDataset {
    files: Vec<ParquetFile>,
    chunks: Vec<Chunk>,
    /// Where each chunk starts among the data set's rows (`chunks + 1` entries).
    starts: Vec<u64>,
    plan: Plan,
    schema: Schema,
    cache: ChunkCache<Columns>,
    window: u64,
    /// Chunks the loader announced it will read soon ([`Dataset::read_ahead`]), oldest first,
    /// not yet decoded: what a worker decodes while another decodes the chunk it waits for.
    ahead: Mutex<VecDeque<usize>>,
}

/// Opens the Parquet data set `path` names (a file, a directory, a pattern) as `options` say.
pub fn open(path: impl AsRef<Path>, options: &TableOptions) -> Result<ParquetDataset> {
    let path = path.as_ref();
    let files = super::files::dataset_files(path, &|n| n.ends_with(".parquet"), "Parquet files")?;
    ParquetDataset::open_files(&files, options)
}

impl ParquetDataset {
    /// Opens `files` as one data set (one schema, rows in this order).
    pub fn open_files(files: &[PathBuf], options: &TableOptions) -> Result<ParquetDataset> {
        let Some(first) = files.first() else {
            return Err(Error::mismatch("no Parquet file to open"));
        };
        if options.chunk_rows == Some(0) {
            return Err(Error::config(
                "chunk_rows",
                "a chunk holds at least one row",
            ));
        }
        if options.window == Some(0) {
            return Err(Error::config(
                "shuffle_window",
                "a window holds at least one chunk",
            ));
        }
        let mut opened: Vec<(PathBuf, Reader, FileIdentity, ArrowReaderMetadata, u64)> =
            Vec::with_capacity(files.len());
        for p in files {
            let (data, identity) = open_file(p, options.read_mode)?;
            let (reader, bytes) = match data {
                FileData::Map(map) => {
                    let len = map.len() as u64;
                    (Reader::Map(Bytes::from_owner(MapOwner(map))), len)
                }
                FileData::Pread { file, len } => (Reader::File(PreadFile { file, len }), len),
            };
            let meta = guard(p, FORMAT, || load_metadata(p, &reader))?;
            if let Some((first_path, .., first_meta, _)) = opened.first() {
                same_columns(first_path, first_meta.schema(), p, meta.schema())?;
            }
            opened.push((p.clone(), reader, identity, meta, bytes));
        }
        let plan = Plan::new(opened[0].3.schema(), options, first)?;
        let schema = plan.schema(first)?;
        // What a row of the fixed-size fields takes decoded: a floor under the footer's
        // uncompressed sizes, which dictionary and run-length encodings make smaller than the
        // decoded columns (a column of 1,024 f32 with few distinct values decodes to 4 KiB a
        // row whatever its pages hold).
        let fixed_row: u64 = schema
            .fields()
            .iter()
            .filter_map(|f| f.fixed_bytes())
            .map(|b| b as u64)
            .sum();
        let mut out = Vec::with_capacity(opened.len());
        let mut chunks = Vec::new();
        let mut starts = vec![0u64];
        for (f, (path, reader, identity, meta, bytes)) in opened.into_iter().enumerate() {
            let dense = plan
                .roots
                .iter()
                .map(|&r| {
                    DenseColumn::new(meta.parquet_schema(), r, meta.schema().field(r).data_type())
                })
                .collect();
            let md = meta.metadata();
            let leaves = meta.parquet_schema().num_columns();
            let mut file_row = 0u64;
            for (g, rg) in md.row_groups().iter().enumerate() {
                let rows = u64::try_from(rg.num_rows()).map_err(|_| Error::Malformed {
                    path: path.clone(),
                    format: FORMAT,
                    what: format!("row group {g} has {} rows", rg.num_rows()),
                })?;
                if rows == 0 {
                    continue;
                }
                let decoded: u64 = rg
                    .columns()
                    .iter()
                    .enumerate()
                    .filter(|&(j, _)| {
                        j < leaves
                            && plan
                                .roots
                                .contains(&meta.parquet_schema().get_column_root_idx(j))
                    })
                    .map(|(_, c)| u64::try_from(c.uncompressed_size()).unwrap_or(0))
                    .sum::<u64>()
                    .max(rows.saturating_mul(fixed_row));
                let per_chunk = options.chunk_rows.unwrap_or_else(|| {
                    (u128::from(rows) * u128::from(DEFAULT_CHUNK_BYTES)
                        / u128::from(decoded.max(1)))
                    .clamp(1, u128::from(rows)) as u64
                });
                let n = rows.div_ceil(per_chunk);
                // Equal chunks (within one row) rather than full ones and a short last one.
                let mut start = 0;
                for c in 0..n {
                    let end = rows * (c + 1) / n;
                    chunks.push(Chunk {
                        file: f,
                        group: g,
                        start,
                        len: end - start,
                        file_row: file_row + start,
                    });
                    let total = starts.last().copied().unwrap_or(0) + (end - start);
                    starts.push(total);
                    start = end;
                }
                file_row += rows;
            }
            out.push(ParquetFile {
                path,
                reader,
                identity,
                meta,
                dense,
                bytes,
                rows: file_row,
            });
        }
        let window = options.window.unwrap_or(DEFAULT_WINDOW);
        let limit = options
            .cache_bytes
            .unwrap_or(2 * window * DEFAULT_CHUNK_BYTES);
        let mut dataset = ParquetDataset {
            files: out,
            cache: ChunkCache::new(chunks.len(), limit),
            chunks,
            starts,
            plan,
            schema,
            window,
            ahead: Mutex::new(VecDeque::new()),
        };
        dataset.sniff_images()?;
        Ok(dataset)
    }

    /// Tags each image field JPEG or PNG by the first value of the first chunk.
    fn sniff_images(&mut self) -> Result<()> {
        let images: Vec<usize> = (0..self.plan.plans.len())
            .filter(|&k| self.plan.plans[k].image)
            .collect();
        if images.is_empty() || self.chunks.is_empty() {
            return Ok(());
        }
        let first = self.cache.get(0, || self.decode(0))?;
        for k in images {
            if let Some(v) = first.first_value(k) {
                self.plan.sniff_image(k, &v);
            }
        }
        self.schema = self.plan.schema(&self.files[0].path)?;
        Ok(())
    }

    /// Decodes chunk `k`: its rows of the columns read, and the bytes they take.
    fn decode(&self, k: usize) -> Result<(Columns, u64)> {
        let c = self.chunks[k];
        let f = &self.files[c.file];
        let place = || {
            format!(
                "row group {} (rows {}..{} of the file)",
                c.group,
                c.file_row,
                c.file_row + c.len
            )
        };
        guard(&f.path, FORMAT, || {
            let malformed = |e: String| Error::Malformed {
                path: f.path.clone(),
                format: FORMAT,
                what: format!("{}: {e}", place()),
            };
            // The dense columns first; a column that gives its chunk back (a null, a file
            // it cannot read) joins the others in Arrow's reader, which says what is wrong.
            let mut arrays: Vec<Option<ArrayRef>> = f
                .dense
                .iter()
                .map(|d| {
                    let d = d.as_ref()?;
                    let md = f.meta.metadata();
                    match &f.reader {
                        Reader::Map(b) => d.read(b.clone(), md, c.group, c.start, c.len),
                        Reader::File(file) => d.read(file.clone(), md, c.group, c.start, c.len),
                    }
                    .ok()
                    .flatten()
                })
                .collect();
            let rest: Vec<usize> = (0..arrays.len()).filter(|&i| arrays[i].is_none()).collect();
            if !rest.is_empty() {
                let mask = ProjectionMask::roots(
                    f.meta.parquet_schema(),
                    rest.iter().map(|&i| self.plan.roots[i]),
                );
                let batches = match &f.reader {
                    Reader::Map(b) => read_chunk(b.clone(), f, c, mask),
                    Reader::File(file) => read_chunk(file.clone(), f, c, mask),
                }
                .map_err(malformed)?;
                let batch = match batches.len() {
                    1 => batches.into_iter().next().unwrap_or_else(|| unreachable!()),
                    _ => {
                        let schema = batches.first().map_or_else(
                            || Arc::new(arrow_schema::Schema::empty()),
                            RecordBatch::schema,
                        );
                        arrow_select::concat::concat_batches(&schema, &batches)
                            .map_err(|e| malformed(e.to_string()))?
                    }
                };
                if batch.num_rows() as u64 != c.len {
                    return Err(malformed(format!(
                        "{} rows decoded where the footer says {}",
                        batch.num_rows(),
                        c.len
                    )));
                }
                if batch.num_columns() != rest.len() {
                    return Err(malformed(format!(
                        "{} columns decoded where {} were asked for",
                        batch.num_columns(),
                        rest.len()
                    )));
                }
                for (&i, column) in rest.iter().zip(batch.columns()) {
                    arrays[i] = Some(Arc::clone(column));
                }
            }
            let columns: Vec<ArrayRef> = arrays.into_iter().flatten().collect();
            let schema = arrow_schema::Schema::new(
                self.plan
                    .roots
                    .iter()
                    .zip(&columns)
                    .map(|(&r, a)| {
                        arrow_schema::Field::new(
                            f.meta.schema().field(r).name(),
                            a.data_type().clone(),
                            true,
                        )
                    })
                    .collect::<Vec<_>>(),
            );
            let batch = RecordBatch::try_new_with_options(
                Arc::new(schema),
                columns,
                &arrow_array::RecordBatchOptions::new().with_row_count(Some(c.len as usize)),
            )
            .map_err(|e| malformed(e.to_string()))?;
            let bytes = batch.get_array_memory_size() as u64;
            let columns =
                Columns::new(&batch, &self.plan, None).map_err(|(k, what)| Error::Malformed {
                    path: f.path.clone(),
                    format: FORMAT,
                    what: format!("{}, column `{}`: {what}", place(), self.plan.fields[k].name),
                })?;
            Ok((columns, bytes))
        })
    }

    /// The chunk that holds row `index` (`index < len()`).
    fn chunk_of(&self, index: u64) -> usize {
        self.starts.partition_point(|&s| s <= index) - 1
    }

    /// What the cache of decoded chunks did: hits, decodes, bytes held and their peak.
    pub fn cache_stats(&self) -> ChunkCacheStats {
        self.cache.stats()
    }

    /// The chunks rows are decoded in, in order: (file, row group, first row in the group,
    /// rows).
    pub fn chunks(&self) -> impl Iterator<Item = (&Path, usize, u64, u64)> {
        self.chunks
            .iter()
            .map(|c| (self.files[c.file].path.as_path(), c.group, c.start, c.len))
    }

    /// What the data set holds, for `gpufeed inspect`.
    pub fn describe(&self) -> TableSummary {
        TableSummary {
            format: FORMAT,
            rows: self.len(),
            columns: self.plan.columns.clone(),
            files: self
                .files
                .iter()
                .map(|f| {
                    let md = f.meta.metadata();
                    let mut compression: Vec<String> = Vec::new();
                    let mut uncompressed = 0u64;
                    for rg in md.row_groups() {
                        for c in rg.columns() {
                            let name = c.compression().to_string();
                            if !compression.contains(&name) {
                                compression.push(name);
                            }
                            uncompressed += u64::try_from(c.uncompressed_size()).unwrap_or(0);
                        }
                    }
                    FileSummary {
                        path: f.path.clone(),
                        bytes: f.bytes,
                        rows: f.rows,
                        groups: md.num_row_groups() as u64,
                        compression,
                        uncompressed_bytes: Some(uncompressed),
                    }
                })
                .collect(),
            chunks: self.chunks.len() as u64,
            splits: None,
        }
    }
}

/// Reads the columns `mask` selects of chunk `c` of file `f` through `reader`.
fn read_chunk<R: ChunkReader + 'static>(
    reader: R,
    f: &ParquetFile,
    c: Chunk,
    mask: ProjectionMask,
) -> std::result::Result<Vec<RecordBatch>, String> {
    let mut selection = Vec::with_capacity(2);
    if c.start > 0 {
        selection.push(RowSelector::skip(c.start as usize));
    }
    selection.push(RowSelector::select(c.len as usize));
    let reader = ParquetRecordBatchReaderBuilder::new_with_metadata(reader, f.meta.clone())
        .with_row_groups(vec![c.group])
        .with_projection(mask)
        .with_row_selection(RowSelection::from(selection))
        .with_batch_size(c.len as usize)
        .build()
        .map_err(|e| e.to_string())?;
    reader
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())
}

/// The footer of `path`, with its offset index where the file has one (pages are then
/// skipped without reading their headers).
fn load_metadata(path: &Path, reader: &Reader) -> Result<ArrowReaderMetadata> {
    let options = ArrowReaderOptions::new().with_offset_index_policy(PageIndexPolicy::Optional);
    match reader {
        Reader::Map(b) => ArrowReaderMetadata::load(b, options),
        Reader::File(f) => ArrowReaderMetadata::load(f, options),
    }
    .map_err(|e| Error::Malformed {
        path: path.to_path_buf(),
        format: FORMAT,
        what: format!("its footer cannot be read: {e}"),
    })
}

impl Dataset for ParquetDataset {
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
        let k = self.chunk_of(index);
        // While another worker decodes chunk `k`, this one decodes chunks the loader
        // announced instead of waiting (one at a time, checking between them).
        let columns = self.cache.get_or_help(
            k,
            || self.decode(k),
            || {
                let next = self
                    .ahead
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .pop_front();
                next.is_some_and(|j| {
                    self.cache.decode_ahead(j, self.window, || self.decode(j));
                    true
                })
            },
        )?;
        let c = self.chunks[k];
        let r = index - self.starts[k];
        let fields = columns.row(r as usize).map_err(|fault| {
            row_error(
                fault,
                &self.plan,
                &self.files[c.file].path,
                c.file_row + r,
                index,
            )
        })?;
        Sample::fields(fields, &self.schema)
    }

    fn shard_sizes(&self) -> Option<Vec<u64>> {
        Some(self.chunks.iter().map(|c| c.len).collect())
    }

    fn read_ahead_batches(&self) -> usize {
        READ_AHEAD_BATCHES
    }

    fn read_ahead(&self, indices: &[u64]) {
        let len = self.len();
        let mut last = None;
        let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        for &i in indices.iter().filter(|&&i| i < len) {
            let k = self.chunk_of(i);
            if last == Some(k) {
                continue;
            }
            last = Some(k);
            if !self.cache.is_held(k) && !ahead.contains(&k) {
                ahead.push_back(k);
            }
        }
        // What is left of windows the workers have passed is dropped first.
        let keep = usize::try_from(2 * self.window).unwrap_or(usize::MAX);
        while ahead.len() > keep {
            ahead.pop_front();
        }
    }

    fn windowed_shuffle(&self) -> Option<(u64, u64)> {
        Some((self.window, 1))
    }

    fn held_bytes(&self) -> u64 {
        self.cache_stats().limit_bytes
    }

    fn check_unchanged(&self) -> Result<()> {
        self.files
            .iter()
            .try_for_each(|f| f.identity.check(&f.path))
    }
}

impl std::fmt::Debug for ParquetDataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParquetDataset")
            .field("files", &self.files.len())
            .field("rows", &self.len())
            .field("chunks", &self.chunks.len())
            .field("schema", &self.schema.to_string())
            .finish()
    }
}

impl crate::source::Source for ParquetDataset {
    fn format(&self) -> crate::source::Format {
        crate::source::Format::Parquet
    }

    fn describe(&self) -> Result<crate::source::Description> {
        Ok(
            ParquetDataset::describe(self)
                .description(crate::source::Format::Parquet, &self.schema),
        )
    }

    fn chunk_cache(&self) -> Option<super::ChunkCacheStats> {
        Some(self.cache_stats())
    }
}
