//! A packed record file ([`RecordFile`]) as a [`Dataset`]: each record a [`Sample`], a view into
//! the mapping, or with [`ReadMode::Pread`](crate::format::ReadMode::Pread) the record's place in the file (read when its
//! fields are copied into their slots) or the record read into a per-thread buffer.
//!
//! The file's layout, its validation at open and the bounds of each record are the format's
//! (`format/reader.rs`); this is where a record becomes a sample.

use crate::error::Result;
use crate::file::{FileData, RecordBuf};
use crate::format::{RecordFile, Schema};
use crate::source::{Dataset, Sample};

impl RecordFile {
    /// Record `i` as a [`Sample`]: a view into the mapping, or (with [`ReadMode::Pread`](crate::format::ReadMode::Pread)) the
    /// record's place in the file, read when its fields are copied, or the record read into a
    /// per-thread buffer (schemas with bytes fields, or [`ReadOptions::verify_checksums`](crate::format::ReadOptions::verify_checksums)).
    pub fn get(&self, i: u64) -> Result<Sample<'_>> {
        let range = self.record_range(i)?;
        match &self.data {
            FileData::Map(map) => {
                let bytes = &map[range.start as usize..range.end as usize];
                if self.options.verify_checksums {
                    self.check_sum(i, bytes)?;
                }
                self.schema
                    .record_end(bytes)
                    .map_err(|e| self.bad_record(i, e))?;
                Ok(Sample::new(bytes, &self.schema))
            }
            FileData::Pread { file, len } => {
                let n = (range.end - range.start) as usize;
                if self.schema.is_fixed() && !self.options.verify_checksums {
                    // A fixed-size record fits its schema when it is long enough.
                    let min = self.schema.min_record_bytes();
                    if n < min {
                        return Err(self.bad_record(
                            i,
                            format!("{n} bytes is shorter than the schema's {min}-byte minimum"),
                        ));
                    }
                    return Ok(Sample::unread(
                        file,
                        &self.path,
                        *len,
                        range.start,
                        n,
                        &self.schema,
                    ));
                }
                let mut buf = RecordBuf::with_len(n);
                self.data
                    .read_at(&self.path, range.start, buf.as_mut_slice())?;
                if self.options.verify_checksums {
                    self.check_sum(i, buf.as_slice())?;
                }
                self.schema
                    .record_end(buf.as_slice())
                    .map_err(|e| self.bad_record(i, e))?;
                Ok(Sample::read(buf, &self.schema))
            }
        }
    }
}

impl Dataset for RecordFile {
    fn len(&self) -> u64 {
        RecordFile::len(self)
    }

    fn schema(&self) -> &Schema {
        &self.schema
    }

    fn get(&self, index: u64) -> Result<Sample<'_>> {
        RecordFile::get(self, index)
    }

    fn check_unchanged(&self) -> Result<()> {
        RecordFile::check_unchanged(self)
    }

    /// The file's size and a sample of its bytes.
    fn fingerprint(&self) -> Result<Option<u64>> {
        self.data.fingerprint(self.path()).map(Some)
    }
}
