//! [`RecordWriter`]: writes a packed record file, atomically.
//!
//! Records stream to a temporary file beside the destination, `NAME.gpufeed-tmp-PID-NONCE`,
//! created exclusively (never an existing file, never another writer's) and locked (`flock`)
//! while the writer lives; the offset and checksum tables are kept in memory (16 bytes a
//! record) and written after the data, then the footer, then the file is synced, renamed (or
//! linked, for [`RecordWriter::create_new`]) to the destination, and the directory synced. A
//! writer that is dropped before [`RecordWriter::finish`] removes its temporary file, so a
//! half-written file never carries the destination's name; a process killed outright (SIGKILL)
//! leaves its temporary, which [`remove_stale_temporaries`](crate::temporary::remove_stale_temporaries) (called by `gpufeed pack` before it
//! writes) removes once that process is gone.
//! [`remove_unfinished_temporaries`](crate::temporary::remove_unfinished_temporaries) is for
//! signal handlers. The temporaries themselves are the crate's [`temporary`] module's.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::Xxh3;

use super::layout::{BLOCK, Footer, Header, VERSION_MAJOR, VERSION_MINOR};
use super::schema::{FieldKind, Schema, align_up};
use crate::error::{Error, Result};
use crate::temporary::{self, discard};

/// What [`RecordWriter::finish`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackSummary {
    /// The file written.
    pub path: PathBuf,
    /// Records written.
    pub records: u64,
    /// Size of the whole file in bytes.
    pub file_bytes: u64,
}

/// Writes records of one [`Schema`] into a new packed record file.
///
/// ```
/// use gpufeed::format::{DType, Field, RecordFile, RecordWriter, Schema};
/// # let dir = tempfile::tempdir().map_err(gpufeed::Error::user)?;
/// # let path = dir.path().join("tiny.gfd");
/// let schema = Schema::new(vec![
///     Field::tensor("pixels", DType::U8, &[2, 2]),
///     Field::tensor("label", DType::U32, &[]),
/// ])?;
/// let mut w = RecordWriter::create(&path, schema)?;
/// w.append(&[&[1, 2, 3, 4], &7u32.to_le_bytes()])?;
/// w.finish()?;
/// let f = RecordFile::open(&path)?;
/// assert_eq!(f.get(0)?.field(0), Some(&[1u8, 2, 3, 4][..]));
/// # Ok::<(), gpufeed::Error>(())
/// ```
pub struct RecordWriter {
    path: PathBuf,
    tmp: PathBuf,
    /// False for [`RecordWriter::create_new`]: never replace an existing destination.
    replace: bool,
    out: Option<BufWriter<File>>,
    schema: Schema,
    schema_bytes: Vec<u8>,
    header: [u8; BLOCK],
    record_align: usize,
    pos: u64,
    offsets: Vec<u64>,
    checksums: Vec<u64>,
    zeros: Vec<u8>,
}

impl RecordWriter {
    /// Starts a packed file at `path`, with records aligned to 64 bytes when they are 4 KiB or
    /// more, else to the schema's largest element size (at least 8).
    /// [`finish`](Self::finish) replaces whatever regular file `path` names then.
    pub fn create(path: impl AsRef<Path>, schema: Schema) -> Result<RecordWriter> {
        let align = default_record_align(&schema);
        RecordWriter::open(path.as_ref(), schema, align, true)
    }

    /// Starts a packed file at `path` that must not exist: fails now if it does, and
    /// [`finish`](Self::finish) fails, replacing nothing, if another writer created it in the
    /// meantime (as `File::create_new`). Of several writers racing to one new file, exactly
    /// one succeeds.
    pub fn create_new(path: impl AsRef<Path>, schema: Schema) -> Result<RecordWriter> {
        let align = default_record_align(&schema);
        RecordWriter::open(path.as_ref(), schema, align, false)
    }

    /// Starts a packed file whose records each start at a multiple of `record_align` bytes
    /// (a power of two from 8 to 4096).
    pub fn with_record_align(
        path: impl AsRef<Path>,
        schema: Schema,
        record_align: usize,
    ) -> Result<RecordWriter> {
        RecordWriter::open(path.as_ref(), schema, record_align, true)
    }

    fn open(
        path: &Path,
        schema: Schema,
        record_align: usize,
        replace: bool,
    ) -> Result<RecordWriter> {
        if !record_align.is_power_of_two() || !(8..=4096).contains(&record_align) {
            return Err(Error::config(
                "record_align",
                format!("{record_align} is not a power of two from 8 to 4096"),
            ));
        }
        let path = path.to_path_buf();
        if path.file_name().is_none() {
            return Err(Error::io(
                &path,
                "create",
                std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file name"),
            ));
        }
        if !replace && std::fs::symlink_metadata(&path).is_ok() {
            return Err(Error::io(
                &path,
                "create",
                std::io::Error::from(std::io::ErrorKind::AlreadyExists),
            ));
        }
        let (tmp, file) = temporary::create(&path)?;
        // From here on, dropping `guard` removes the temporary (on an error below).
        let guard = temporary::Unowned::new(tmp);
        let mut out = BufWriter::with_capacity(8 << 20, file);
        let data_offset = align_up(BLOCK, record_align) as u64;
        let header = Header {
            major: VERSION_MAJOR,
            minor: VERSION_MINOR,
            record_align: record_align as u32,
            data_offset,
        }
        .encode();
        let mut zeros = vec![0u8; 4096];
        out.write_all(&header)
            .map_err(|e| Error::io(&path, WRITE, e))?;
        out.write_all(&zeros[..data_offset as usize - BLOCK])
            .map_err(|e| Error::io(&path, WRITE, e))?;
        zeros.truncate(record_align);
        let tmp = guard.keep();
        Ok(RecordWriter {
            path,
            tmp,
            replace,
            out: Some(out),
            schema_bytes: schema.encode(),
            schema,
            header,
            record_align,
            pos: data_offset,
            offsets: vec![data_offset],
            checksums: Vec::new(),
            zeros,
        })
    }

    /// The schema records must follow.
    pub fn schema(&self) -> &Schema {
        &self.schema
    }

    /// Records appended so far.
    pub fn len(&self) -> u64 {
        self.checksums.len() as u64
    }

    /// True before the first record.
    pub fn is_empty(&self) -> bool {
        self.checksums.is_empty()
    }

    /// Appends one record: one byte slice per field, in schema order. Tensor fields must have
    /// exactly their schema's size; bytes fields any size up to 4 GiB.
    pub fn append(&mut self, fields: &[&[u8]]) -> Result<()> {
        let record = self.checksums.len() as u64;
        if fields.len() != self.schema.fields().len() {
            return Err(Error::mismatch(format!(
                "{}: record {record}: {} field values given, the schema has {} fields",
                self.path.display(),
                fields.len(),
                self.schema.fields().len()
            )));
        }
        let mut var_lens = [0u32; 16];
        let mut var_lens_vec = Vec::new();
        let var_count = self.schema.var_count();
        let lens: &mut [u32] = if var_count <= 16 {
            &mut var_lens[..var_count]
        } else {
            var_lens_vec.resize(var_count, 0);
            &mut var_lens_vec
        };
        let mut k = 0;
        for (i, (field, value)) in self.schema.fields().iter().zip(fields).enumerate() {
            match field.kind {
                FieldKind::Tensor { .. } => {
                    let want = self.schema.fixed_range(i).map_or(0, |r| r.len());
                    if value.len() != want {
                        return Err(Error::mismatch(format!(
                            "{}: record {record}: field `{}` has {} bytes, its schema says {want}",
                            self.path.display(),
                            field.name,
                            value.len()
                        )));
                    }
                }
                FieldKind::Bytes { .. } => {
                    lens[k] = u32::try_from(value.len()).map_err(|_| {
                        Error::mismatch(format!(
                            "{}: record {record}: field `{}` has {} bytes (at most 4 GiB)",
                            self.path.display(),
                            field.name,
                            value.len()
                        ))
                    })?;
                    k += 1;
                }
            }
        }
        let mut table_stack = [0u8; 64];
        let mut table_heap = Vec::new();
        let table: &mut [u8] = if var_count <= 16 {
            &mut table_stack[..4 * var_count]
        } else {
            table_heap.resize(4 * var_count, 0);
            &mut table_heap
        };
        for (bytes, len) in table.chunks_exact_mut(4).zip(lens.iter()) {
            bytes.copy_from_slice(&len.to_le_bytes());
        }
        let content = self.schema.record_bytes(lens.iter().map(|&l| l as usize));
        let padded = align_up(content.max(1), self.record_align);
        let Some(out) = self.out.as_mut() else {
            return Err(Error::mismatch("append after a failed write"));
        };
        let (schema, zeros) = (&self.schema, &self.zeros[..]);
        let written = if padded >= PARALLEL_BYTES {
            // A large record: hash it on another core while this one writes it, and write its
            // large pieces past the buffer (one copy, into the page cache, instead of two).
            let mut pieces = Vec::with_capacity(2 * fields.len() + 4);
            record_pieces(schema, zeros, fields, table, padded, |p| pieces.push(p));
            let (digest, written) = rayon::join(
                || {
                    let mut hash = Xxh3::new();
                    pieces.iter().for_each(|p| hash.update(p));
                    hash.digest()
                },
                || -> std::io::Result<()> {
                    for p in &pieces {
                        if p.len() >= DIRECT_BYTES {
                            out.flush()?;
                            out.get_mut().write_all(p)?;
                        } else {
                            out.write_all(p)?;
                        }
                    }
                    Ok(())
                },
            );
            written.map(|()| digest)
        } else {
            let mut hash = Xxh3::new();
            let mut written = Ok(());
            record_pieces(schema, zeros, fields, table, padded, |p| {
                hash.update(p);
                if written.is_ok() {
                    written = out.write_all(p);
                }
            });
            written.map(|()| hash.digest())
        };
        let digest = match written {
            Ok(d) => d,
            Err(e) => {
                // The file's contents are unknown now: refuse further appends.
                self.out = None;
                discard(&self.tmp);
                return Err(Error::io(&self.path, WRITE, e));
            }
        };
        self.pos += padded as u64;
        self.offsets.push(self.pos);
        self.checksums.push(digest);
        Ok(())
    }

    /// Writes the schema, the tables and the footer, syncs, moves the file into place
    /// (renamed over the destination; linked to it, replacing nothing, for
    /// [`create_new`](Self::create_new)) and syncs the directory. On an error the temporary
    /// file is removed and the destination is as it was.
    pub fn finish(mut self) -> Result<PackSummary> {
        let Some(out) = self.out.take() else {
            return Err(Error::mismatch(format!(
                "{}: finish after a failed write",
                self.path.display()
            )));
        };
        let result = self.write_tail(out);
        // Placed or failed: either way the temporary name is gone or must go.
        discard(&self.tmp);
        result
    }

    fn write_tail(&mut self, mut out: BufWriter<File>) -> Result<PackSummary> {
        let path = self.path.clone();
        let w = |out: &mut BufWriter<File>, b: &[u8]| {
            out.write_all(b).map_err(|e| Error::io(&path, WRITE, e))
        };
        let data_end = self.pos;
        let schema_offset = data_end;
        w(&mut out, &self.schema_bytes)?;
        let mut at = schema_offset + self.schema_bytes.len() as u64;
        let pad = (align_up(at as usize, 8) as u64 - at) as usize;
        w(&mut out, &[0u8; 8][..pad])?;
        at += pad as u64;
        let offsets_offset = at;
        for chunk in self.offsets.chunks(8192) {
            let bytes: Vec<u8> = chunk.iter().flat_map(|o| o.to_le_bytes()).collect();
            w(&mut out, &bytes)?;
        }
        let checksums_offset = offsets_offset + 8 * self.offsets.len() as u64;
        for chunk in self.checksums.chunks(8192) {
            let bytes: Vec<u8> = chunk.iter().flat_map(|o| o.to_le_bytes()).collect();
            w(&mut out, &bytes)?;
        }
        let footer = Footer {
            records: self.checksums.len() as u64,
            data_end,
            schema_offset,
            schema_len: self.schema_bytes.len() as u64,
            offsets_offset,
            checksums_offset,
        }
        .encode(&self.header, &self.schema_bytes);
        w(&mut out, &footer)?;
        let file = out
            .into_inner()
            .map_err(|e| Error::io(&self.path, WRITE, e.into_error()))?;
        file.sync_all()
            .map_err(|e| Error::io(&self.path, "sync (its temporary file)", e))?;
        let file_bytes = checksums_offset + 8 * self.checksums.len() as u64 + BLOCK as u64;
        self.place()?;
        // The lock goes with the file, once it is in place.
        drop(file);
        sync_parent(&self.path)?;
        Ok(PackSummary {
            path: self.path.clone(),
            records: self.checksums.len() as u64,
            file_bytes,
        })
    }
}

/// Records of at least this many bytes are hashed on another thread while they are written.
const PARALLEL_BYTES: usize = 64 << 10;
/// Pieces of at least this many bytes bypass the write buffer.
const DIRECT_BYTES: usize = 32 << 10;

/// Calls `put` with the bytes of one record, in file order (see `docs/FORMAT.md`, "Records"):
/// tensor fields at their aligned offsets with zeros between them, the length table, the
/// variable bytes, and zeros up to `padded`. `fields` were checked against `schema`.
fn record_pieces<'a>(
    schema: &Schema,
    zeros: &'a [u8],
    fields: &[&'a [u8]],
    table: &'a [u8],
    padded: usize,
    mut put: impl FnMut(&'a [u8]),
) {
    let mut at = 0usize;
    for (i, value) in fields.iter().enumerate() {
        if let Some(range) = schema.fixed_range(i) {
            put(&zeros[..range.start - at]);
            put(value);
            at = range.end;
        }
    }
    if schema.var_count() > 0 {
        put(&zeros[..schema.var_table_offset() - at]);
        put(table);
        at = schema.min_record_bytes();
        for (field, value) in schema.fields().iter().zip(fields) {
            if let FieldKind::Bytes { .. } = field.kind {
                put(value);
                at += value.len();
            }
        }
    }
    put(&zeros[..padded - at]);
}

/// Where packed records go: one packed file ([`RecordWriter`]) or a directory of packed shards
/// ([`ShardWriter`](crate::source::shards::packed::ShardWriter)). Code that produces records
/// for either, such as [`pack_raw_records`](super::pack_raw_records), writes through this.
///
/// A sink dropped before [`finish`](RecordSink::finish) leaves nothing under the output's
/// name: both writers remove their temporary files.
pub trait RecordSink {
    /// What [`finish`](RecordSink::finish) reports: what was written, and where.
    type Summary;

    /// Appends one record: one byte slice per field, in schema order.
    fn append(&mut self, fields: &[&[u8]]) -> Result<()>;

    /// Completes the output (tables, footer, index) and gives it its name.
    fn finish(self) -> Result<Self::Summary>;
}

impl RecordSink for RecordWriter {
    type Summary = PackSummary;

    fn append(&mut self, fields: &[&[u8]]) -> Result<()> {
        RecordWriter::append(self, fields)
    }

    fn finish(self) -> Result<PackSummary> {
        RecordWriter::finish(self)
    }
}

impl std::fmt::Debug for RecordWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordWriter")
            .field("path", &self.path)
            .field("temporary", &self.tmp)
            .field("records", &self.checksums.len())
            .finish()
    }
}

impl RecordWriter {
    /// Gives the finished temporary file the destination's name.
    fn place(&self) -> Result<()> {
        if self.replace {
            return std::fs::rename(&self.tmp, &self.path)
                .map_err(|e| Error::io(&self.path, "rename (its temporary file) to", e));
        }
        // A hard link fails, atomically, if the name exists: of two writers racing to one new
        // file, one gets it and the other an error, never a file replaced behind its back.
        match std::fs::hard_link(&self.tmp, &self.path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Err(Error::io(
                &self.path,
                "create (another writer created it while this one wrote; nothing was replaced)",
                e,
            )),
            // A file system without hard links: check, then rename (a race is possible here).
            Err(_) => {
                if std::fs::symlink_metadata(&self.path).is_ok() {
                    return Err(Error::io(
                        &self.path,
                        "create (another writer created it while this one wrote; nothing was replaced)",
                        std::io::Error::from(std::io::ErrorKind::AlreadyExists),
                    ));
                }
                std::fs::rename(&self.tmp, &self.path)
                    .map_err(|e| Error::io(&self.path, "rename (its temporary file) to", e))
            }
        }
    }
}

impl Drop for RecordWriter {
    fn drop(&mut self) {
        if self.out.take().is_some() {
            // Not finished: the temporary file must not outlive the writer.
            discard(&self.tmp);
        }
    }
}

/// Whether the regular file at `path` is one that gpufeed's writers replace when they are told
/// to (`gpufeed pack --force`, Python's `pack(force=True)`, the shards of a
/// [`ShardWriter`](crate::source::shards::packed::ShardWriter)): a packed record file (it
/// begins with [`MAGIC`](super::MAGIC), whole or not) or an empty file. `Ok(None)` for those;
/// else what the file is, in words, for a refusal that does not destroy a file gpufeed did not
/// write (`"a .npy array of 1,280 bytes"`). Reads at most the file's first 8 bytes.
pub fn foreign_file(path: &Path) -> Result<Option<String>> {
    use std::io::Read;
    let file = File::open(path).map_err(|e| Error::io(path, "open", e))?;
    let size = file
        .metadata()
        .map_err(|e| Error::io(path, "stat", e))?
        .len();
    let mut head = Vec::with_capacity(8);
    file.take(8)
        .read_to_end(&mut head)
        .map_err(|e| Error::io(path, "read", e))?;
    if head.is_empty() || head == super::MAGIC {
        return Ok(None);
    }
    let what = if head.starts_with(b"\x93NUMPY") {
        "a .npy array"
    } else {
        "a file"
    };
    Ok(Some(format!(
        "{what} of {size} bytes, not a packed record file (which begins with GPUFEED)"
    )))
}

/// What a failed write is called in errors (which name the destination, not the temporary).
const WRITE: &str = "write (its temporary file)";

/// Syncs the directory that holds `path`, so that the rename that put it there survives a
/// crash. File systems that cannot sync a directory (EINVAL) are taken at their word.
fn sync_parent(path: &Path) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let d = File::open(dir).map_err(|e| Error::io(dir, "open (to sync the directory)", e))?;
    match d.sync_all() {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => Ok(()),
        Err(e) => Err(Error::io(dir, "sync (the directory, after the rename)", e)),
    }
}

/// The record alignment a writer uses unless told otherwise: 64 bytes (a cache line, and what
/// SIMD copies and DMA like) for records of 4 KiB or more, otherwise the largest element size
/// of the schema, at least 8, so that small records do not waste space.
pub(crate) fn default_record_align(schema: &Schema) -> usize {
    if schema.min_record_bytes() >= 4096 {
        return 64;
    }
    schema
        .fields()
        .iter()
        .filter_map(|f| match &f.kind {
            FieldKind::Tensor { dtype, .. } => Some(dtype.size()),
            FieldKind::Bytes { .. } => None,
        })
        .max()
        .unwrap_or(8)
        .max(8)
}
