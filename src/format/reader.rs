//! [`RecordFile`]: one packed record file, memory-mapped, read in place.
//!
//! Opening costs O(1) in the number and size of records: the header, the footer (with its
//! checksum over header and schema), the schema and the first and last entries of the offset
//! table are checked, nothing else. Every [`RecordFile::get`] then bounds-checks the two offsets
//! it reads, so that no byte pattern makes the reader touch memory outside the mapping; a record
//! that does not fit is a typed error naming the file and the record. Checksums are checked on
//! demand ([`ReadOptions::verify_checksums`], [`RecordFile::verify`]).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use memmap2::Mmap;

use super::layout::{BLOCK, Footer, Header, VERSION_MAJOR, record_checksum, u64_at};
use super::schema::Schema;
use crate::error::{Error, Result};
use crate::source::{Dataset, Sample};

/// How a [`RecordFile`] reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadOptions {
    /// Check each record's checksum on every read (costs one hash pass over its bytes).
    pub verify_checksums: bool,
}

/// A packed record file, mapped into memory and shared by reference among threads.
///
/// Samples are zero-copy views into the mapping: [`RecordFile::get`] borrows, and
/// [`RecordFile::get_bytes`] returns [`Bytes`] that keep the mapping alive.
#[derive(Clone)]
pub struct RecordFile {
    path: PathBuf,
    map: Arc<Mmap>,
    schema: Schema,
    records: u64,
    record_align: u64,
    data_offset: u64,
    data_end: u64,
    offsets_at: usize,
    checksums_at: usize,
    options: ReadOptions,
    version: (u16, u16),
}

impl std::fmt::Debug for RecordFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordFile")
            .field("path", &self.path)
            .field("records", &self.records)
            .field("schema", &self.schema.to_string())
            .finish()
    }
}

impl RecordFile {
    /// Opens and validates a packed record file.
    pub fn open(path: impl AsRef<Path>) -> Result<RecordFile> {
        RecordFile::open_with(path, ReadOptions::default())
    }

    /// Opens a packed record file with these read options.
    pub fn open_with(path: impl AsRef<Path>, options: ReadOptions) -> Result<RecordFile> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|e| Error::io(path, "open", e))?;
        // SAFETY: the mapping is read-only and private to this process's view. Another process
        // could still truncate or rewrite the file underneath it; packed files are written once
        // under a temporary name and renamed into place (see RecordWriter), so a file in use is
        // never rewritten by gpufeed. Every read below is bounds-checked against the mapping's
        // length taken here, so changed bytes give wrong data or a typed error, never an
        // out-of-bounds access; truncation by another process is the one hazard left (SIGBUS),
        // as with every memory-mapped reader.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, "map", e))?;
        RecordFile::from_map(path, Arc::new(map), options)
    }

    fn from_map(path: &Path, map: Arc<Mmap>, options: ReadOptions) -> Result<RecordFile> {
        let bad = |what: String| Error::Malformed {
            path: path.to_path_buf(),
            format: "packed record",
            what,
        };
        let bytes: &[u8] = &map;
        if bytes.is_empty() {
            return Err(bad("the file is empty".into()));
        }
        let header = Header::decode(bytes).map_err(bad)?;
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
        if bytes.len() < 2 * BLOCK {
            return Err(bad(format!(
                "{} bytes cannot hold a header and a footer: the file is truncated",
                bytes.len()
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
        let footer = Footer::decode(bytes, &header).map_err(bad)?;
        let schema_range =
            footer.schema_offset as usize..(footer.schema_offset + footer.schema_len) as usize;
        let schema =
            Schema::decode(&bytes[schema_range]).map_err(|e| bad(format!("schema: {e}")))?;
        let f = RecordFile {
            path: path.to_path_buf(),
            schema,
            records: footer.records,
            record_align: align,
            data_offset: header.data_offset,
            data_end: footer.data_end,
            offsets_at: footer.offsets_offset as usize,
            checksums_at: footer.checksums_offset as usize,
            options,
            version: (header.major, header.minor),
            map,
        };
        let first = f.offset(0);
        let last = f.offset(f.records);
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
            f.schema.check_record(&f.map[range]).map_err(|e| {
                bad(format!(
                    "the schema [{}] does not fit record 0: {e}",
                    f.schema
                ))
            })?;
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

    /// The size of the whole file in bytes.
    pub fn file_bytes(&self) -> u64 {
        self.map.len() as u64
    }

    /// Bytes of record data (padding included), without header, tables and footer.
    pub fn data_bytes(&self) -> u64 {
        self.data_end - self.data_offset
    }

    /// Entry `i` of the offset table; `i <= records`, which open() and get() ensure.
    fn offset(&self, i: u64) -> u64 {
        u64_at(&self.map, self.offsets_at + 8 * i as usize)
    }

    fn stored_checksum(&self, i: u64) -> u64 {
        u64_at(&self.map, self.checksums_at + 8 * i as usize)
    }

    fn bad_record(&self, record: u64, what: String) -> Error {
        Error::BadRecord {
            path: self.path.clone(),
            record,
            what,
        }
    }

    /// The byte range of record `i`, checked against the data region.
    fn record_range(&self, i: u64) -> Result<std::ops::Range<usize>> {
        if i >= self.records {
            return Err(Error::OutOfRange {
                index: i,
                len: self.records,
            });
        }
        let (start, end) = (self.offset(i), self.offset(i + 1));
        if start >= end || start < self.data_offset || end > self.data_end {
            return Err(self.bad_record(
                i,
                format!(
                    "offset table gives {start}..{end}, which is empty, decreasing or outside the data region {}..{}",
                    self.data_offset, self.data_end
                ),
            ));
        }
        if start % self.record_align != 0 {
            return Err(self.bad_record(
                i,
                format!(
                    "starts at {start}, not a multiple of the record alignment {}",
                    self.record_align
                ),
            ));
        }
        Ok(start as usize..end as usize)
    }

    /// The raw bytes of record `i` (padding included), bounds-checked, not schema-checked.
    pub fn record_bytes(&self, i: u64) -> Result<&[u8]> {
        let range = self.record_range(i)?;
        Ok(&self.map[range])
    }

    /// Record `i` as a zero-copy [`Sample`].
    pub fn get(&self, i: u64) -> Result<Sample<'_>> {
        let bytes = self.record_bytes(i)?;
        if self.options.verify_checksums {
            self.check_sum(i, bytes)?;
        }
        self.schema
            .check_record(bytes)
            .map_err(|e| self.bad_record(i, e))?;
        Ok(Sample::new(bytes, &self.schema))
    }

    /// Record `i` as [`Bytes`] that keep the mapping alive (padding included); use
    /// [`Schema::fixed_range`] or [`RecordFile::get`] to find its fields.
    pub fn get_bytes(&self, i: u64) -> Result<Bytes> {
        let range = self.record_range(i)?;
        self.schema
            .check_record(&self.map[range.clone()])
            .map_err(|e| self.bad_record(i, e))?;
        Ok(Bytes::from_owner(MapOwner(Arc::clone(&self.map))).slice(range))
    }

    fn check_sum(&self, i: u64, bytes: &[u8]) -> Result<()> {
        let stored = self.stored_checksum(i);
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
        let bytes = self.record_bytes(i)?;
        self.schema
            .check_record(bytes)
            .map_err(|e| self.bad_record(i, e))?;
        self.check_sum(i, bytes)
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
}

impl Dataset for RecordFile {
    fn len(&self) -> u64 {
        self.records
    }

    fn schema(&self) -> &Schema {
        &self.schema
    }

    fn get(&self, index: u64) -> Result<Sample<'_>> {
        RecordFile::get(self, index)
    }
}

/// Keeps a mapping alive for as long as any [`Bytes`] cut from it.
struct MapOwner(Arc<Mmap>);

impl AsRef<[u8]> for MapOwner {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}
