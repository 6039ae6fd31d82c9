//! [`RecordFile`]: one packed record file, read in place, through one shared memory mapping
//! (the default) or with reads at offsets ([`ReadMode::Pread`]).
//!
//! Opening costs O(1) in the number and size of records: the header, the footer (with its
//! checksum over header and schema), the schema and the first and last entries of the offset
//! table are checked, nothing else. Every [`RecordFile::get`] then bounds-checks the two offsets
//! it reads, so that no byte pattern makes the reader touch memory outside the mapping, and, for
//! a schema of fixed-size fields, checks that the record lies exactly where its index says
//! (`data_offset + index * stride`); a record that does not fit is a typed error naming the file
//! and the record. Checksums are checked on demand ([`ReadOptions::verify_checksums`],
//! [`RecordFile::verify`]).

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use memmap2::Mmap;

use super::layout::{BLOCK, Footer, Header, VERSION_MAJOR, record_checksum, u64_at};
use super::schema::Schema;
use crate::error::{Error, Result};
pub use crate::file::ReadMode;
use crate::file::{FileData, FileIdentity, RecordBuf, open_file};

/// How a [`RecordFile`] reads.
///
/// ```
/// use gpufeed::format::{ReadMode, ReadOptions, RecordFile};
/// # fn f(path: &std::path::Path) -> gpufeed::Result<()> {
/// // On NFS, and with every record checked against its checksum:
/// let options = ReadOptions { mode: ReadMode::Pread, verify_checksums: true };
/// let file = RecordFile::open_with(path, options)?;
/// # let _ = file; Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadOptions {
    /// Check each record against its stored checksum whenever it is read ([`RecordFile::get`],
    /// so in every batch the loader makes, and [`RecordFile::get_bytes`]): a record whose bytes
    /// are not the ones its writer wrote (written in place under a running job, corrupted on
    /// disk or on the network) is then an [`Error::ChecksumMismatch`] naming the file and the
    /// record, never data. Costs one xxh3 pass over each record's bytes (`benches/RESULTS.md`);
    /// in [`ReadMode::Pread`], fields then go through a per-thread buffer instead of straight
    /// into their batch slots, since the whole record must be read to be checked.
    ///
    /// A `.npy` array ([`NpyArray`](crate::source::NpyArray)) has no checksums of its own: with
    /// this set, they are taken when it is opened (one pass over the file) and each row read is
    /// checked against them, so that a row written in place since is an
    /// [`Error::FileChanged`] naming the file and the row, never data (see `NpyArray`).
    pub verify_checksums: bool,
    /// A shared mapping (the default) or reads at offsets; see [`ReadMode`] for what each
    /// promises when the file changes while it is open.
    pub mode: ReadMode,
}

/// A mode alone: the default options with that mode (no checksums verified).
impl From<ReadMode> for ReadOptions {
    fn from(mode: ReadMode) -> ReadOptions {
        ReadOptions {
            mode,
            ..ReadOptions::default()
        }
    }
}

/// A packed record file, opened once and shared by reference among threads.
///
/// By default the file is mapped ([`ReadMode::Map`]): samples are zero-copy views into the
/// mapping, [`RecordFile::get`] borrows, and [`RecordFile::get_bytes`] returns [`Bytes`] that
/// keep the mapping alive.
///
/// # The file must not change while it is mapped
///
/// The mapping is shared with the file (`MAP_SHARED`): if another process truncates the file
/// while it is open (`open(path, "wb")` on the same path, a writer restarting), the next read
/// past the new end kills this process with `SIGBUS`; if it writes bytes in place, samples are
/// read with the new bytes, silently, possibly half old and half new. Replacing the file by
/// renaming a new one over it (what [`RecordWriter`](crate::format::RecordWriter) does) is safe:
/// this `RecordFile` keeps reading the file it opened. So either guarantee that no process
/// truncates or writes the file while it is open, or open it with [`ReadMode::Pread`], which
/// reads with `pread` and turns a truncation into an [`Error::FileChanged`]; and turn on
/// [`ReadOptions::verify_checksums`] to have bytes written in place refused. In every mode,
/// [`Dataset::check_unchanged`](crate::source::Dataset::check_unchanged) (which the loader calls at each epoch's start) reports a file
/// replaced, truncated, extended or written since it was opened.
#[derive(Clone)]
pub struct RecordFile {
    pub(crate) path: PathBuf,
    pub(crate) data: FileData,
    identity: FileIdentity,
    pub(crate) schema: Schema,
    records: u64,
    record_align: u64,
    data_offset: u64,
    data_end: u64,
    /// For a schema of fixed-size fields: every record's size, so record `i` is at
    /// `data_offset + i * stride`.
    stride: Option<u64>,
    offsets_at: u64,
    checksums_at: u64,
    pub(crate) options: ReadOptions,
    version: (u16, u16),
}

impl std::fmt::Debug for RecordFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordFile")
            .field("path", &self.path)
            .field("records", &self.records)
            .field("schema", &self.schema.to_string())
            .field("options", &self.options)
            .finish()
    }
}

impl RecordFile {
    /// Opens and validates a packed record file, mapped (see the [type's docs](RecordFile) for
    /// what the mapping asks of the file).
    pub fn open(path: impl AsRef<Path>) -> Result<RecordFile> {
        RecordFile::open_with(path, ReadOptions::default())
    }

    /// Opens a packed record file with these read options.
    pub fn open_with(path: impl AsRef<Path>, options: ReadOptions) -> Result<RecordFile> {
        let path = path.as_ref();
        let (data, identity) = open_file(path, options.mode)?;
        RecordFile::from_data(path, data, identity, options)
    }

    fn from_data(
        path: &Path,
        data: FileData,
        identity: FileIdentity,
        options: ReadOptions,
    ) -> Result<RecordFile> {
        let bad = |what: String| Error::Malformed {
            path: path.to_path_buf(),
            format: "packed record",
            what,
        };
        let len = data.len();
        if len == 0 {
            return Err(bad("the file is empty".into()));
        }
        let head = data.bytes_at(path, 0, len.min(BLOCK as u64) as usize)?;
        let header = Header::decode(&head).map_err(bad)?;
        if header.major > VERSION_MAJOR {
            return Err(Error::UnsupportedVersion {
                path: path.to_path_buf(),
                major: header.major,
                minor: header.minor,
                supported: VERSION_MAJOR,
            });
        }
        if header.major == 0 {
            return Err(bad("version 0 is not a released format".into()));
        }
        if len < 2 * BLOCK as u64 {
            return Err(bad(format!(
                "{len} bytes cannot hold a header and a footer: the file is truncated"
            )));
        }
        let align = u64::from(header.record_align);
        if !align.is_power_of_two() || !(8..=4096).contains(&align) {
            return Err(bad(format!(
                "record alignment {align} is not a power of two from 8 to 4096"
            )));
        }
        if header.data_offset < BLOCK as u64 || header.data_offset % align != 0 {
            return Err(bad(format!(
                "data offset {} is inside the header or not a multiple of the record alignment {align}",
                header.data_offset
            )));
        }
        let foot = data.bytes_at(path, len - BLOCK as u64, BLOCK)?;
        let footer = Footer::decode(&foot, len, &header).map_err(bad)?;
        // The footer checked that the schema lies inside the file, before the footer.
        let schema_bytes = data.bytes_at(path, footer.schema_offset, footer.schema_len as usize)?;
        Footer::check_sum(&foot, &head, &schema_bytes).map_err(bad)?;
        let schema = Schema::decode(&schema_bytes).map_err(|e| bad(format!("schema: {e}")))?;
        drop((head, foot, schema_bytes));
        let mut f = RecordFile {
            path: path.to_path_buf(),
            schema,
            records: footer.records,
            record_align: align,
            data_offset: header.data_offset,
            data_end: footer.data_end,
            stride: None,
            offsets_at: footer.offsets_offset,
            checksums_at: footer.checksums_offset,
            options,
            version: (header.major, header.minor),
            data,
            identity,
        };
        let first = f.offset(0)?;
        let last = f.offset(f.records)?;
        if first != f.data_offset || last != f.data_end {
            return Err(bad(format!(
                "offset table spans {first}..{last}, the data region is {}..{}",
                f.data_offset, f.data_end
            )));
        }
        // One record, still O(1): a schema that does not fit the records (for fixed schemas,
        // every record has the size of the first) is refused here rather than at every get.
        if f.records > 0 {
            let range = f.record_range(0)?;
            f.with_record(range.clone(), |bytes| f.schema.record_end(bytes))?
                .map_err(|e| {
                    bad(format!(
                        "the schema [{}] does not fit record 0: {e}",
                        f.schema
                    ))
                })?;
            if f.schema.is_fixed() {
                let stride = range.end - range.start;
                let total = f.data_end - f.data_offset;
                if f.records.checked_mul(stride) != Some(total) {
                    return Err(bad(format!(
                        "the records of a fixed-size schema all have record 0's size, {stride} bytes, \
                         but the data region's {total} bytes are not {} of them",
                        f.records
                    )));
                }
                f.stride = Some(stride);
            }
        }
        Ok(f)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The schema of its records.
    pub fn schema(&self) -> &Schema {
        &self.schema
    }

    /// The number of records.
    pub fn len(&self) -> u64 {
        self.records
    }

    /// True when the file holds no record.
    pub fn is_empty(&self) -> bool {
        self.records == 0
    }

    /// The format version the file was written with (major, minor).
    pub fn version(&self) -> (u16, u16) {
        self.version
    }

    /// Every record starts at a multiple of this many bytes.
    pub fn record_align(&self) -> u64 {
        self.record_align
    }

    /// The size of the whole file in bytes (when it was opened).
    pub fn file_bytes(&self) -> u64 {
        self.data.len()
    }

    /// Bytes of record data (padding included), without header, tables and footer.
    pub fn data_bytes(&self) -> u64 {
        self.data_end - self.data_offset
    }

    /// The options the file was opened with.
    pub fn read_options(&self) -> ReadOptions {
        self.options
    }

    /// For a schema of fixed-size fields, the size of every record (record `i` starts at the
    /// first record's offset plus `i` times this); `None` for a schema with bytes fields.
    pub fn stride(&self) -> Option<u64> {
        self.stride
    }

    /// Entry `i` of the offset table; `i <= records`, which open() and get() ensure.
    fn offset(&self, i: u64) -> Result<u64> {
        let at = self.offsets_at + 8 * i;
        match &self.data {
            FileData::Map(map) => Ok(u64_at(map, at as usize)),
            FileData::Pread { .. } => self.data.u64_at(&self.path, at),
        }
    }

    /// Entries `i` and `i + 1` of the offset table; `i < records`.
    fn offset_pair(&self, i: u64) -> Result<(u64, u64)> {
        let at = self.offsets_at + 8 * i;
        let mut b = [0u8; 16];
        match &self.data {
            FileData::Map(map) => b.copy_from_slice(&map[at as usize..at as usize + 16]),
            FileData::Pread { .. } => self.data.read_at(&self.path, at, &mut b)?,
        }
        Ok((u64_at(&b, 0), u64_at(&b, 8)))
    }

    fn stored_checksum(&self, i: u64) -> Result<u64> {
        self.data.u64_at(&self.path, self.checksums_at + 8 * i)
    }

    pub(crate) fn bad_record(&self, record: u64, what: String) -> Error {
        Error::BadRecord {
            path: self.path.clone(),
            record,
            what,
        }
    }

    /// The byte range of record `i` in the file, checked against the data region, the record
    /// alignment and (for fixed-size schemas) the stride.
    pub(crate) fn record_range(&self, i: u64) -> Result<Range<u64>> {
        if i >= self.records {
            return Err(Error::OutOfRange {
                index: i,
                len: self.records,
            });
        }
        // Each offset is read once, into a local, then checked and used.
        let (start, end) = self.offset_pair(i)?;
        if start >= end || start < self.data_offset || end > self.data_end {
            return Err(self.bad_record(
                i,
                format!(
                    "offset table gives {start}..{end}, which is empty, decreasing or outside the data region {}..{}",
                    self.data_offset, self.data_end
                ),
            ));
        }
        if start & (self.record_align - 1) != 0 {
            return Err(self.bad_record(
                i,
                format!(
                    "starts at {start}, not a multiple of the record alignment {}",
                    self.record_align
                ),
            ));
        }
        if let Some(stride) = self.stride {
            // records * stride = data_end - data_offset (checked at open): no overflow.
            let want = self.data_offset + i * stride;
            if start != want || end - start != stride {
                return Err(self.bad_record(
                    i,
                    format!(
                        "offset table gives {start}..{end}, but the records of this fixed-size schema are \
                         {stride} bytes each, so record {i} is at {want}..{}: the offset table is corrupt",
                        want + stride
                    ),
                ));
            }
        }
        Ok(start..end)
    }

    /// Calls `f` with the bytes of `range` (from the mapping, or read into a per-thread buffer).
    fn with_record<R>(&self, range: Range<u64>, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        match &self.data {
            FileData::Map(map) => Ok(f(&map[range.start as usize..range.end as usize])),
            FileData::Pread { .. } => {
                let mut buf = RecordBuf::with_len((range.end - range.start) as usize);
                self.data
                    .read_at(&self.path, range.start, buf.as_mut_slice())?;
                Ok(f(buf.as_slice()))
            }
        }
    }

    /// The size of record `i` in bytes (padding included), from the offset table, checked as
    /// [`RecordFile::record_bytes`] checks it; in either [`ReadMode`], without reading the
    /// record.
    pub fn record_len(&self, i: u64) -> Result<u64> {
        let range = self.record_range(i)?;
        Ok(range.end - range.start)
    }

    /// The raw bytes of record `i` (padding included), bounds-checked, not schema-checked,
    /// borrowed from the mapping. A file opened with [`ReadMode::Pread`] has no mapping to
    /// borrow from: [`Error::InvalidConfig`]; use [`RecordFile::get_bytes`].
    pub fn record_bytes(&self, i: u64) -> Result<&[u8]> {
        let range = self.record_range(i)?;
        match &self.data {
            FileData::Map(map) => Ok(&map[range.start as usize..range.end as usize]),
            FileData::Pread { .. } => Err(self.no_mapping("record_bytes")),
        }
    }

    fn no_mapping(&self, what: &str) -> Error {
        Error::config(
            "mode",
            format!(
                "{what} borrows from the mapping, and {} was opened with ReadMode::Pread: use get or get_bytes",
                self.path.display()
            ),
        )
    }

    /// Record `i` as [`Bytes`] (padding included): a slice that keeps the mapping alive, or
    /// (with [`ReadMode::Pread`]) the record read into memory of its own. Checked as
    /// [`RecordFile::get`] checks. Use [`Schema::fixed_range`] or [`RecordFile::get`] to find
    /// its fields.
    pub fn get_bytes(&self, i: u64) -> Result<Bytes> {
        let range = self.record_range(i)?;
        let check = |bytes: &[u8]| -> Result<()> {
            if self.options.verify_checksums {
                self.check_sum(i, bytes)?;
            }
            self.schema
                .record_end(bytes)
                .map_err(|e| self.bad_record(i, e))?;
            Ok(())
        };
        match &self.data {
            FileData::Map(map) => {
                let (start, end) = (range.start as usize, range.end as usize);
                check(&map[start..end])?;
                Ok(Bytes::from_owner(MapOwner(Arc::clone(map))).slice(start..end))
            }
            FileData::Pread { .. } => {
                let mut v = vec![0u8; (range.end - range.start) as usize];
                self.data.read_at(&self.path, range.start, &mut v)?;
                check(&v)?;
                Ok(Bytes::from(v))
            }
        }
    }

    pub(crate) fn check_sum(&self, i: u64, bytes: &[u8]) -> Result<()> {
        let stored = self.stored_checksum(i)?;
        let computed = record_checksum(bytes);
        if stored != computed {
            return Err(Error::ChecksumMismatch {
                path: self.path.clone(),
                record: i,
                stored,
                computed,
            });
        }
        Ok(())
    }

    /// Checks record `i` completely: offsets, schema and checksum.
    pub fn verify_record(&self, i: u64) -> Result<()> {
        let range = self.record_range(i)?;
        self.with_record(range, |bytes| {
            self.schema
                .record_end(bytes)
                .map_err(|e| self.bad_record(i, e))?;
            self.check_sum(i, bytes)
        })?
    }

    /// Checks every record (offsets increasing and inside the data, schema, checksum), calling
    /// `progress` with the number of records checked now and then. Stops at the first fault.
    pub fn verify(&self, mut progress: impl FnMut(u64)) -> Result<()> {
        for i in 0..self.records {
            self.verify_record(i)?;
            if i % 4096 == 4095 {
                progress(i + 1);
            }
        }
        progress(self.records);
        Ok(())
    }

    /// A fingerprint of what the file was when it was opened (see
    /// `FileIdentity::fingerprint`): equal for two opens of the same unchanged file.
    pub(crate) fn file_fingerprint(&self) -> u64 {
        self.identity.fingerprint()
    }

    /// Checks that the path still names the file opened, with the same size, modification
    /// time and status-change time; see [`Dataset::check_unchanged`](crate::source::Dataset::check_unchanged).
    pub fn check_unchanged(&self) -> Result<()> {
        self.identity.check(&self.path)
    }
}

/// Keeps a mapping alive for as long as any [`Bytes`] cut from it.
struct MapOwner(Arc<Mmap>);

impl AsRef<[u8]> for MapOwner {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}
