//! A packed record file ([`RecordFile`]) as a [`Dataset`]: each record a [`Sample`], a view into
//! the mapping, or with [`ReadMode::Pread`](crate::format::ReadMode::Pread) the record's place in the file (read when its
//! fields are copied into their slots) or the record read into a per-thread buffer.
//!
//! The file's layout, its validation at open and the bounds of each record are the format's
//! (`format/reader.rs`); this is where a record becomes a sample.

use crate::error::Result;
use crate::file::{FileData, RecordBuf};
use crate::format::{RecordFile, Schema};
use crate::source::{Dataset, Description, Format, Sample, Source};

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

/// Files with up to this many records have their record sizes described from every entry of
/// the offset table; larger ones from [`SIZE_SAMPLE`] evenly spaced records.
const EXACT_SIZES: u64 = 1 << 20;
/// How many records are sampled for the record sizes of a larger file.
const SIZE_SAMPLE: u64 = 4096;

impl Source for RecordFile {
    fn format(&self) -> Format {
        Format::Packed
    }

    /// The header's version and alignment, the file's sizes, and the records' sizes from the
    /// offset table: every entry for files of up to 2^20 records, 4,096 evenly spaced ones
    /// beyond (the mean is exact either way: the records tile the data region).
    fn describe(&self) -> Result<Description> {
        let n = self.len();
        let (step, looked_at) = match n {
            0 => (1, 0),
            n if n <= EXACT_SIZES => (1, n),
            n => (n / SIZE_SAMPLE, SIZE_SAMPLE),
        };
        let (mut min, mut max) = (if n == 0 { 0 } else { u64::MAX }, 0u64);
        for k in 0..looked_at {
            let len = self.record_len(k * step)?;
            min = min.min(len);
            max = max.max(len);
        }
        let mean = if n == 0 {
            0.0
        } else {
            self.data_bytes() as f64 / n as f64
        };
        let exact = looked_at == n;
        let how = if exact {
            "all records".to_owned()
        } else {
            format!("min and max from {looked_at} of {n} records, evenly spaced")
        };
        let (major, minor) = self.version();
        Ok(Description::new(
            self.path().display().to_string(),
            Format::Packed,
            n,
            self.schema.clone(),
        )
        .fact(
            "version",
            "version",
            format!("{major}.{minor}"),
            format!("{major}.{minor}"),
        )
        .fact(
            "record_align",
            "record align",
            self.record_align(),
            format!("{} bytes", self.record_align()),
        )
        .count("file_bytes", "file bytes", self.file_bytes())
        .count("data_bytes", "data bytes", self.data_bytes())
        .fact(
            "record_bytes",
            "record bytes",
            serde_json::json!({
                "min": min, "mean": mean, "max": max,
                "exact": exact, "sampled_records": looked_at,
            }),
            format!("min {min}, mean {mean:.1}, max {max} ({how}; padding included)"),
        ))
    }

    /// Every record's offsets, schema and checksum.
    fn verify(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<()> {
        let n = self.len();
        RecordFile::verify(self, |done| progress(done, n))
    }
}
