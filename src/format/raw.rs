//! Raw record files: fixed-size records back to back, with no header, packed as one `u8`
//! tensor field per record ([`pack_raw_records`]).
//!
//! `gpufeed pack --from raw` and the Python package's `pack(kind="raw")` both pack through
//! here. They differ only in what they do between chunks (draw a progress bar; look for
//! Ctrl-C), in where the records go (one file or a directory of shards: a [`RecordSink`]) and
//! in the name under which the user gave the record size, which the errors repeat.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use super::schema::{DType, Field, Schema};
use super::writer::RecordSink;
use crate::error::{Error, Result};

/// Bytes read at a time: the whole records that fit in this many (at least one record).
const CHUNK_BYTES: usize = 8 << 20;

/// Packs raw files of fixed-size records into a sink, in the order given: record `i` of the
/// output is the `i`-th run of `record_bytes` bytes of the inputs, concatenated.
///
/// Before anything is written it checks the record size (1 byte to 4 GiB) and every input's
/// size (a whole number of records), so that a bad input creates no output. Then it calls
/// `create` once, with the output's schema (one `u8` tensor field named `field`, of
/// `record_bytes` bytes) and the number of bytes to pack (for a progress bar), and streams
/// the inputs into the sink it returns, about 8 MiB of whole records per read. After each
/// read it calls `progress` with the bytes packed so far; an error from `progress` stops
/// packing and is returned as it is (the sink is dropped unfinished, which leaves no output).
/// Finally it finishes the sink and returns what that wrote.
///
/// `record_bytes_setting` is the name under which the caller's user gave the record size
/// (`--record-bytes`, `record_bytes`): errors about it name it.
///
/// # Errors
///
/// - [`Error::InvalidConfig`] for a record size of 0 or over 4 GiB (naming
///   `record_bytes_setting`), or for no inputs (naming `inputs`);
/// - [`Error::Io`] when an input cannot be examined, opened or read, naming it;
/// - [`Error::Malformed`] for an input whose size is not a multiple of the record size;
/// - [`Error::FileChanged`] for an input that ends before the size it had when packing began
///   (it shrank while being packed);
/// - [`Error::InvalidSchema`] for a field name a schema cannot hold (empty, over-long);
/// - whatever `create`, the sink or `progress` returns.
///
/// ```
/// use gpufeed::format::{RecordFile, RecordWriter, pack_raw_records};
/// # let dir = tempfile::tempdir().map_err(gpufeed::Error::user)?;
/// # let (a, b) = (dir.path().join("a.bin"), dir.path().join("b.bin"));
/// # std::fs::write(&a, [1u8, 1, 2, 2]).map_err(gpufeed::Error::user)?;
/// # std::fs::write(&b, [3u8, 3]).map_err(gpufeed::Error::user)?;
/// # let out = dir.path().join("raw.gfd");
/// // a.bin holds two records of 2 bytes, b.bin one.
/// let summary = pack_raw_records(
///     &[&a, &b],
///     2,
///     "record_bytes",
///     "data",
///     |schema, _bytes| RecordWriter::create(&out, schema),
///     |_done| Ok(()),
/// )?;
/// assert_eq!(summary.records, 3);
/// let file = RecordFile::open(&out)?;
/// assert_eq!(file.get(2)?.field(0), Some(&[3u8, 3][..]));
/// # Ok::<(), gpufeed::Error>(())
/// ```
pub fn pack_raw_records<S: RecordSink>(
    inputs: &[impl AsRef<Path>],
    record_bytes: u64,
    record_bytes_setting: &'static str,
    field: &str,
    create: impl FnOnce(Schema, u64) -> Result<S>,
    progress: impl FnMut(u64) -> Result<()>,
) -> Result<S::Summary> {
    let raw = RawInputs::check(inputs, record_bytes, record_bytes_setting)?;
    raw.pack(field, create, progress, CHUNK_BYTES)
}

/// Inputs whose sizes have been checked: a whole number of records each.
struct RawInputs<'a, P> {
    inputs: &'a [P],
    sizes: Vec<u64>,
    record_bytes: u64,
    /// `record_bytes` as a length in memory.
    rb: usize,
}

impl<'a, P: AsRef<Path>> RawInputs<'a, P> {
    fn check(inputs: &'a [P], record_bytes: u64, setting: &'static str) -> Result<Self> {
        let rb = usize::try_from(record_bytes)
            .ok()
            .filter(|&n| n > 0 && record_bytes <= u64::from(u32::MAX))
            .ok_or_else(|| {
                Error::config(setting, format!("{record_bytes} is not from 1 to 4 GiB"))
            })?;
        if inputs.is_empty() {
            return Err(Error::config("inputs", "at least one input is needed"));
        }
        let mut sizes = Vec::with_capacity(inputs.len());
        for path in inputs {
            let path = path.as_ref();
            let size = std::fs::metadata(path)
                .map_err(|e| Error::io(path, "stat", e))?
                .len();
            if size % record_bytes != 0 {
                return Err(Error::Malformed {
                    path: path.to_path_buf(),
                    format: "raw record",
                    what: format!(
                        "its size, {size} bytes, is not a multiple of {setting}={record_bytes} \
                         ({} whole records and {} bytes over)",
                        size / record_bytes,
                        size % record_bytes
                    ),
                });
            }
            sizes.push(size);
        }
        Ok(RawInputs {
            inputs,
            sizes,
            record_bytes,
            rb,
        })
    }

    /// Streams the inputs into the sink `create` makes, `chunk_bytes` (rounded down to whole
    /// records, at least one) per read.
    fn pack<S: RecordSink>(
        &self,
        field: &str,
        create: impl FnOnce(Schema, u64) -> Result<S>,
        mut progress: impl FnMut(u64) -> Result<()>,
        chunk_bytes: usize,
    ) -> Result<S::Summary> {
        let schema = Schema::new(vec![Field::tensor(field, DType::U8, &[self.record_bytes])])?;
        let mut sink = create(schema, self.sizes.iter().sum())?;
        let rb = self.rb;
        let mut buf = vec![0u8; (chunk_bytes / rb).max(1) * rb];
        let mut done = 0u64;
        for (path, &size) in self.inputs.iter().zip(&self.sizes) {
            let path = path.as_ref();
            let mut file = File::open(path).map_err(|e| Error::io(path, "open", e))?;
            let mut at = 0u64;
            while at < size {
                let want = (buf.len() as u64).min(size - at) as usize;
                let got = read_up_to(&mut file, &mut buf[..want])
                    .map_err(|e| Error::io(path, "read", e))?;
                if got < want {
                    return Err(Error::FileChanged {
                        path: path.to_path_buf(),
                        what: format!(
                            "it was {size} bytes when packing began, and it ended after {} bytes \
                             (it shrank while being packed)",
                            at + got as u64
                        ),
                    });
                }
                for record in buf[..want].chunks_exact(rb) {
                    sink.append(&[record])?;
                }
                at += want as u64;
                done += want as u64;
                progress(done)?;
            }
        }
        sink.finish()
    }
}

/// Reads into `buf` until it is full or the file ends; the bytes read.
fn read_up_to(file: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match file.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::path::PathBuf;
    use std::rc::Rc;

    use super::*;
    use crate::ErrorKind;
    use crate::format::{FieldKind, RecordFile, RecordWriter};

    /// A sink that keeps the records it is given where the test can see them, even after
    /// it is dropped unfinished.
    struct Collect {
        records: Rc<RefCell<Vec<Vec<u8>>>>,
    }

    impl RecordSink for Collect {
        type Summary = usize;

        fn append(&mut self, fields: &[&[u8]]) -> Result<()> {
            assert_eq!(fields.len(), 1);
            self.records.borrow_mut().push(fields[0].to_vec());
            Ok(())
        }

        fn finish(self) -> Result<usize> {
            Ok(self.records.borrow().len())
        }
    }

    /// Writes `records` records of `rb` bytes to `dir/name`, record `k` being bytes
    /// `first + k` (wrapping) throughout; returns the path and the records.
    fn raw_file(
        dir: &Path,
        name: &str,
        first: u8,
        records: usize,
        rb: usize,
    ) -> (PathBuf, Vec<Vec<u8>>) {
        let recs: Vec<Vec<u8>> = (0..records)
            .map(|k| vec![first.wrapping_add(k as u8); rb])
            .collect();
        let path = dir.join(name);
        std::fs::write(&path, recs.concat()).unwrap();
        (path, recs)
    }

    #[test]
    fn records_arrive_in_order_across_files_and_chunk_boundaries() {
        let dir = tempfile::tempdir().unwrap();
        // Chunks of 3 records: 7 records cross two chunk boundaries and end in a short
        // chunk; the empty file is packed as nothing; then 4 more.
        let (a, ra) = raw_file(dir.path(), "a.bin", 0, 7, 5);
        let (b, _) = raw_file(dir.path(), "b.bin", 0, 0, 5);
        let (c, rc) = raw_file(dir.path(), "c.bin", 100, 4, 5);
        let seen = Rc::new(RefCell::new(Vec::new()));
        let mut made = None;
        let mut calls = Vec::new();
        let inputs = [a, b, c];
        let n = RawInputs::check(&inputs, 5, "--record-bytes")
            .unwrap()
            .pack(
                "pixels",
                |schema, bytes| {
                    made = Some((schema, bytes));
                    Ok(Collect {
                        records: Rc::clone(&seen),
                    })
                },
                |done| {
                    calls.push(done);
                    Ok(())
                },
                16,
            )
            .unwrap();
        assert_eq!(n, 11);
        assert_eq!(*seen.borrow(), [ra, rc].concat());
        let (schema, bytes) = made.unwrap();
        assert_eq!(bytes, 55);
        assert_eq!(schema.fields().len(), 1);
        assert_eq!(schema.fields()[0].name, "pixels");
        assert_eq!(
            schema.fields()[0].kind,
            FieldKind::Tensor {
                dtype: DType::U8,
                shape: vec![5]
            }
        );
        // After each read: 3, 3 and 1 records of a.bin, then 3 and 1 of c.bin.
        assert_eq!(calls, [15, 30, 35, 50, 55]);
    }

    #[test]
    fn a_packed_file_holds_the_records_of_every_input() {
        let dir = tempfile::tempdir().unwrap();
        let (a, ra) = raw_file(dir.path(), "a.bin", 1, 300, 7);
        let (b, rb) = raw_file(dir.path(), "b.bin", 50, 20, 7);
        let out = dir.path().join("out.gfd");
        let summary = pack_raw_records(
            &[a, b],
            7,
            "record_bytes",
            "data",
            |schema, _| RecordWriter::create(&out, schema),
            |_| Ok(()),
        )
        .unwrap();
        assert_eq!(summary.records, 320);
        let file = RecordFile::open(&out).unwrap();
        assert_eq!(file.schema().fields()[0].name, "data");
        for (i, want) in [ra, rb].concat().iter().enumerate() {
            assert_eq!(file.get(i as u64).unwrap().field(0), Some(&want[..]));
        }
    }

    #[test]
    fn a_size_not_a_multiple_of_the_record_is_malformed_and_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (good, _) = raw_file(dir.path(), "good.bin", 0, 3, 10);
        let odd = dir.path().join("odd.bin");
        std::fs::write(&odd, [0u8; 25]).unwrap();
        let e = pack_raw_records(
            &[good, odd.clone()],
            10,
            "--record-bytes",
            "data",
            |_, _| -> Result<Collect> {
                unreachable!("no sink is made for inputs that fail their checks")
            },
            |_| Ok(()),
        )
        .unwrap_err();
        match &e {
            Error::Malformed { path, format, what } => {
                assert_eq!(path, &odd);
                assert_eq!(*format, "raw record");
                assert!(what.contains("25 bytes"), "{what}");
                assert!(what.contains("--record-bytes=10"), "{what}");
                assert!(what.contains("2 whole records and 5 bytes over"), "{what}");
            }
            other => panic!("expected Malformed, got {other:?}"),
        }
        assert_eq!(e.kind(), ErrorKind::Corrupt);
    }

    #[test]
    fn no_inputs_is_a_config_error() {
        let none: [&Path; 0] = [];
        let e = pack_raw_records(
            &none,
            4,
            "record_bytes",
            "data",
            |_, _| -> Result<Collect> { unreachable!("no sink without inputs") },
            |_| Ok(()),
        )
        .unwrap_err();
        assert!(
            matches!(&e, Error::InvalidConfig { setting: "inputs", what } if what.contains("at least one")),
            "{e:?}"
        );
    }

    #[test]
    fn a_record_size_out_of_range_names_the_callers_setting() {
        let dir = tempfile::tempdir().unwrap();
        let (a, _) = raw_file(dir.path(), "a.bin", 0, 1, 8);
        for rb in [0, u64::from(u32::MAX) + 1] {
            let e = pack_raw_records(
                &[&a],
                rb,
                "--record-bytes",
                "data",
                |_, _| -> Result<Collect> { unreachable!() },
                |_| Ok(()),
            )
            .unwrap_err();
            assert!(
                matches!(&e, Error::InvalidConfig { setting: "--record-bytes", what } if what.contains(&rb.to_string())),
                "{e:?}"
            );
        }
    }

    #[test]
    fn a_missing_input_is_an_io_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let gone = dir.path().join("gone.bin");
        let e = pack_raw_records(
            &[&gone],
            4,
            "record_bytes",
            "data",
            |_, _| -> Result<Collect> { unreachable!() },
            |_| Ok(()),
        )
        .unwrap_err();
        match e {
            Error::Io { path, op, source } => {
                assert_eq!(path, gone);
                assert_eq!(op, "stat");
                assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
            }
            other => panic!("expected Io, got {other:?}"),
        }
    }

    #[test]
    fn a_file_that_shrinks_after_its_size_was_checked_is_file_changed_and_leaves_no_output() {
        let dir = tempfile::tempdir().unwrap();
        let (a, _) = raw_file(dir.path(), "a.bin", 0, 10, 4);
        let out = dir.path().join("out.gfd");
        // `create` runs after the sizes were checked and before any read: shrink a.bin there.
        let e = pack_raw_records(
            &[&a],
            4,
            "record_bytes",
            "data",
            |schema, bytes| {
                assert_eq!(bytes, 40);
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(&a)
                    .and_then(|f| f.set_len(24))
                    .unwrap();
                RecordWriter::create(&out, schema)
            },
            |_| Ok(()),
        )
        .unwrap_err();
        match &e {
            Error::FileChanged { path, what } => {
                assert_eq!(path, &a);
                assert!(what.contains("40 bytes"), "{what}");
                assert!(what.contains("ended after 24"), "{what}");
            }
            other => panic!("expected FileChanged, got {other:?}"),
        }
        assert_eq!(e.kind(), ErrorKind::FileChanged);
        // The writer was dropped unfinished: no output, no temporary file.
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, ["a.bin"]);
    }

    #[test]
    fn a_file_that_shrinks_mid_read_is_file_changed_at_the_byte_it_ends() {
        let dir = tempfile::tempdir().unwrap();
        let (a, ra) = raw_file(dir.path(), "a.bin", 0, 10, 4);
        let seen = Rc::new(RefCell::new(Vec::new()));
        let inputs = [a.clone()];
        // Chunks of 3 records; after the first, cut the file to 5 records.
        let e = RawInputs::check(&inputs, 4, "record_bytes")
            .unwrap()
            .pack(
                "data",
                |_, _| {
                    Ok(Collect {
                        records: Rc::clone(&seen),
                    })
                },
                |done| {
                    if done == 12 {
                        std::fs::OpenOptions::new()
                            .write(true)
                            .open(&a)
                            .and_then(|f| f.set_len(20))
                            .unwrap();
                    }
                    Ok(())
                },
                12,
            )
            .unwrap_err();
        assert!(
            matches!(&e, Error::FileChanged { path, what } if path == &a && what.contains("ended after 20")),
            "{e:?}"
        );
        // The records of the first chunk went in; none of the short one.
        assert_eq!(*seen.borrow(), ra[..3]);
    }

    #[test]
    fn an_error_from_progress_stops_packing_and_is_returned() {
        let dir = tempfile::tempdir().unwrap();
        let (a, ra) = raw_file(dir.path(), "a.bin", 0, 10, 4);
        let (b, _) = raw_file(dir.path(), "b.bin", 0, 10, 4);
        let seen = Rc::new(RefCell::new(Vec::new()));
        let mut calls = 0;
        let inputs = [a, b];
        let e = RawInputs::check(&inputs, 4, "record_bytes")
            .unwrap()
            .pack(
                "data",
                |_, _| {
                    Ok(Collect {
                        records: Rc::clone(&seen),
                    })
                },
                |done| {
                    calls += 1;
                    if done >= 16 {
                        return Err(Error::user("interrupted"));
                    }
                    Ok(())
                },
                8,
            )
            .unwrap_err();
        assert!(
            matches!(&e, Error::User { what } if what == "interrupted"),
            "{e:?}"
        );
        // Two chunks of 2 records, then nothing more was read or appended.
        assert_eq!(calls, 2);
        assert_eq!(*seen.borrow(), ra[..4]);
    }

    #[test]
    fn a_field_name_a_schema_cannot_hold_is_a_schema_error() {
        let dir = tempfile::tempdir().unwrap();
        let (a, _) = raw_file(dir.path(), "a.bin", 0, 1, 8);
        let e = pack_raw_records(
            &[&a],
            8,
            "record_bytes",
            "",
            |_, _| -> Result<Collect> { unreachable!() },
            |_| Ok(()),
        )
        .unwrap_err();
        assert!(matches!(e, Error::InvalidSchema { .. }), "{e:?}");
    }
}
