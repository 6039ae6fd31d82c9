//! `ReadMode::Pread` against `ReadMode::Map`: the same samples, the same
//! batches, the same errors; checksum verification on the loader's read path in both modes.

use gpufeed::BatchStream;
use std::path::Path;

use gpufeed::format::{
    Codec, DType, Field, ReadMode, ReadOptions, RecordFile, RecordWriter, Schema,
};
use gpufeed::source::{self, npy_header};
use gpufeed::{CopyFields, Dataset, Error, FnTransform, Loader, NpyArray, OutputField};

const MODES: [ReadMode; 2] = [ReadMode::Map, ReadMode::Pread];

fn options(mode: ReadMode, verify: bool) -> ReadOptions {
    ReadOptions {
        mode,
        verify_checksums: verify,
    }
}

/// 40 records: `image` u8 [3, 8, 8] and `label` u32, distinct bytes everywhere.
fn fixed_file(path: &Path) {
    let schema = Schema::new(vec![
        Field::tensor("image", DType::U8, &[3, 8, 8]),
        Field::tensor("label", DType::U32, &[]),
    ])
    .unwrap();
    let mut w = RecordWriter::create(path, schema).unwrap();
    for i in 0..40u32 {
        let img: Vec<u8> = (0..192u32).map(|k| (k * 7 + i * 13) as u8).collect();
        w.append(&[&img, &(i * 1000).to_le_bytes()]).unwrap();
    }
    w.finish().unwrap();
}

fn variable_file(path: &Path) {
    let schema = Schema::new(vec![
        Field::tensor("label", DType::U16, &[]),
        Field::bytes("blob", Codec::Raw),
    ])
    .unwrap();
    let mut w = RecordWriter::create(path, schema).unwrap();
    for i in 0..17u16 {
        w.append(&[&i.to_le_bytes(), &vec![i as u8; usize::from(i) * 5]])
            .unwrap();
    }
    w.finish().unwrap();
}

fn npy_file(path: &Path) {
    let mut b = npy_header(DType::F32, &[25, 4]).unwrap();
    for v in 0..100u32 {
        b.extend((v as f32 * 0.5).to_le_bytes());
    }
    std::fs::write(path, b).unwrap();
}

/// Everything a sample says, read every way there is.
fn describe(d: &dyn Dataset, i: u64) -> Vec<Vec<u8>> {
    let s = d.get(i).unwrap();
    let fields = d.schema().fields().len();
    let mut out = vec![s.bytes().unwrap().to_vec()];
    assert_eq!(s.len(), out[0].len());
    for k in 0..fields {
        let f = s.field(k).unwrap().to_vec();
        assert_eq!(s.try_field(k).unwrap(), &f[..]);
        if d.schema().is_fixed() {
            // A fresh sample, so that the copy reads straight from the file in Pread.
            let mut slot = vec![0xEEu8; f.len()];
            d.get(i).unwrap().copy_field_into(k, &mut slot).unwrap();
            assert_eq!(slot, f);
        }
        out.push(f);
    }
    assert!(s.field(fields).is_none());
    assert!(s.try_field(fields).is_err());
    out
}

#[test]
fn every_sample_reads_the_same_in_both_modes() {
    let dir = tempfile::tempdir().unwrap();
    let (fixed, var, npy) = (
        dir.path().join("fixed.gfd"),
        dir.path().join("var.gfd"),
        dir.path().join("a.npy"),
    );
    fixed_file(&fixed);
    variable_file(&var);
    npy_file(&npy);
    for path in [&fixed, &var, &npy] {
        let runs: Vec<Vec<Vec<Vec<u8>>>> = MODES
            .iter()
            .flat_map(|&m| [options(m, false), options(m, true)])
            .map(|o| {
                let d = source::open(path, &gpufeed::source::OpenOptions::read(o)).unwrap();
                d.check_unchanged().unwrap();
                (0..d.len()).map(|i| describe(d.as_ref(), i)).collect()
            })
            .collect();
        for r in &runs[1..] {
            assert_eq!(r, &runs[0], "{}", path.display());
        }
    }
    for mode in MODES {
        let f = RecordFile::open_with(&fixed, options(mode, false)).unwrap();
        assert_eq!(f.read_options().mode, mode);
        assert_eq!(f.stride(), Some(200));
        f.verify(|_| {}).unwrap();
        for i in 0..f.len() {
            assert_eq!(
                &f.get_bytes(i).unwrap()[..],
                RecordFile::open(&fixed).unwrap().record_bytes(i).unwrap()
            );
        }
        assert!(matches!(
            f.get(40),
            Err(Error::OutOfRange { index: 40, len: 40 })
        ));
        let a = NpyArray::open_with(&npy, "x", mode).unwrap();
        assert_eq!(a.read_mode(), mode);
        assert!(matches!(a.get(25), Err(Error::OutOfRange { .. })));
    }
    assert_eq!(
        RecordFile::open(&var).unwrap().stride(),
        None,
        "a schema with bytes fields has no stride"
    );
}

/// What borrows from a mapping says so, in Pread, instead of reading.
#[test]
fn borrowing_accessors_refuse_pread() {
    let dir = tempfile::tempdir().unwrap();
    let (fixed, npy) = (dir.path().join("f.gfd"), dir.path().join("a.npy"));
    fixed_file(&fixed);
    npy_file(&npy);
    let f = RecordFile::open_with(&fixed, options(ReadMode::Pread, false)).unwrap();
    let e = f.record_bytes(0).unwrap_err();
    assert!(
        matches!(&e, Error::InvalidConfig { setting: "mode", what } if what.contains("get_bytes")),
        "{e}"
    );
    let a = NpyArray::open_with(&npy, "data", ReadMode::Pread).unwrap();
    assert!(matches!(
        a.row(0),
        Err(Error::InvalidConfig {
            setting: "mode",
            ..
        })
    ));
    // A slot of the wrong size is an error, from the file as from a mapping.
    for mode in MODES {
        let f = RecordFile::open_with(&fixed, options(mode, false)).unwrap();
        let mut small = [0u8; 10];
        let e = f
            .get(0)
            .unwrap()
            .copy_field_into(0, &mut small)
            .unwrap_err();
        assert!(e.to_string().contains("192 bytes"), "{e}");
        assert!(f.get(0).unwrap().copy_field_into(7, &mut small).is_err());
    }
}

/// Batches from the loader with the default transform (straight into the slot in Pread) and
/// with a transform that reads bytes (`Sample::field`), in both modes: all the same.
#[test]
fn loader_batches_are_the_same_in_both_modes() {
    let dir = tempfile::tempdir().unwrap();
    let fixed = dir.path().join("f.gfd");
    fixed_file(&fixed);
    let run = |mode: ReadMode, verify: bool, by_field: bool| {
        let f = RecordFile::open_with(&fixed, options(mode, verify)).unwrap();
        let b = Loader::builder(f)
            .batch_size(7)
            .shuffle(3)
            .workers(2)
            .shard(0, 1);
        let b = if by_field {
            b.transform(FnTransform::new(
                vec![OutputField::new("label", DType::U32, &[])],
                |s, _, slots| {
                    let label = s.try_field(1)?;
                    slots.field(0)?.copy_from_slice(label);
                    Ok(())
                },
            ))
        } else {
            b.transform(CopyFields::named(["label", "image"]))
        };
        let loader = b.build().unwrap();
        loader
            .map(|b| {
                let b = b.unwrap();
                let image = b
                    .field_bytes("image")
                    .map(<[u8]>::to_vec)
                    .unwrap_or_default();
                (b.field::<u32>("label").unwrap().to_vec(), image)
            })
            .collect::<Vec<_>>()
    };
    for by_field in [false, true] {
        let want = run(ReadMode::Map, false, by_field);
        assert_eq!(want.len(), 6);
        for (mode, verify) in [
            (ReadMode::Map, true),
            (ReadMode::Pread, false),
            (ReadMode::Pread, true),
        ] {
            assert_eq!(run(mode, verify, by_field), want, "{mode:?} {verify}");
        }
    }
}

/// Bytes overwritten in place under a running loader were read silently.
/// Between epochs, the loader's check of the file now reports them, whether the modification
/// time was put back or not (by the status-change time). Within an epoch,
/// after that check, only `verify_checksums` tells: the batch that holds the record fails,
/// naming the file and the record; without it, the new bytes are read (as documented).
#[cfg(unix)]
#[test]
fn bytes_overwritten_under_a_running_loader_fail_their_batch_when_verified() {
    use crate::file_changes::{rewrite_keeping_times, wait_past_ctime};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.gfd");
    let at = 64 + 9 * 200 + 5;
    let loader = |f: RecordFile| {
        Loader::builder(f)
            .batch_size(10)
            .workers(1)
            .shard(0, 1)
            .prefetch_across_epochs(false)
            .build()
            .unwrap()
    };
    for mode in MODES {
        for verify in [false, true] {
            fixed_file(&path);
            let f = RecordFile::open_with(&path, options(mode, verify)).unwrap();
            let record9 = f.get(9).unwrap().field(0).unwrap().to_vec();
            let mut running = loader(f);
            assert!(running.by_ref().all(|b| b.is_ok()));
            // Overwrite one byte of record 9 in place, as another process would, and put the
            // modification time back.
            wait_past_ctime(&path);
            rewrite_keeping_times(&path, at);
            running.set_epoch(1);
            match running.next() {
                Some(Err(Error::FileChanged { path: p, what })) => {
                    assert_eq!(p, path);
                    assert!(what.contains("status-change time"), "{what}");
                }
                other => panic!("expected FileChanged, got {other:?}"),
            }
            // The record as it now is, read by a loader that opened the file since: the check
            // between epochs has nothing to report, the checksum does.
            let f = RecordFile::open_with(&path, options(mode, verify)).unwrap();
            let results: Vec<_> = loader(f).collect();
            if verify {
                let e = results[0].as_ref().unwrap_err();
                let Error::Sample {
                    index: 9, source, ..
                } = e
                else {
                    panic!("{e}")
                };
                assert!(
                    matches!(source.as_ref(), Error::ChecksumMismatch { path: p, record: 9, .. } if p == &path),
                    "{source}"
                );
                assert!(results[1..].iter().all(Result::is_ok));
            } else {
                let b = results[0].as_ref().unwrap();
                let image = b.field_bytes("image").unwrap();
                assert_eq!(image[9 * 192 + 5], !record9[5], "{mode:?}");
            }
        }
    }
}

/// `rows` rows of `cols` bytes, every row distinct.
fn npy_rows(path: &Path, rows: u64, cols: u64) {
    let mut b = npy_header(DType::U8, &[rows, cols]).unwrap();
    for r in 0..rows {
        b.extend((0..cols).map(|c| (r * 31 + c * 7) as u8));
    }
    std::fs::write(path, b).unwrap();
}

/// Hides a dataset's `check_unchanged` (the default says nothing changed), so that what the
/// loader delivers after a file changed under it shows what the reads themselves catch.
struct ReadsOnly<D>(D);

impl<D: Dataset> Dataset for ReadsOnly<D> {
    fn len(&self) -> u64 {
        self.0.len()
    }
    fn schema(&self) -> &gpufeed::format::Schema {
        self.0.schema()
    }
    fn get(&self, index: u64) -> gpufeed::Result<gpufeed::Sample<'_>> {
        self.0.get(index)
    }
}

/// A `.npy` array could not be verified at all (`verify_checksums` was
/// refused), so rows written in place were read as data. Opened with it, the array takes its
/// checksums at open and refuses a row whose bytes changed since, naming the file and the row,
/// in both modes: rows smaller than a checksum group (many to a group), larger (one a group),
/// and a last group shorter than the others.
#[cfg(unix)]
#[test]
fn npy_rows_written_in_place_are_refused_when_verified() {
    use crate::file_changes::rewrite_keeping_times;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rows.npy");
    // (rows, bytes a row): 256 rows to a group; 1 a group; 2 a group, the last one alone.
    for (rows, cols) in [(300u64, 16u64), (5, 5000), (7, 1500)] {
        for mode in MODES {
            npy_rows(&path, rows, cols);
            let plain = source::open(
                &path,
                &gpufeed::source::OpenOptions::read(options(mode, false)),
            )
            .unwrap();
            let checked = source::open(
                &path,
                &gpufeed::source::OpenOptions::read(options(mode, true)),
            )
            .unwrap();
            let want: Vec<Vec<Vec<u8>>> = (0..rows).map(|i| describe(plain.as_ref(), i)).collect();
            let got: Vec<Vec<Vec<u8>>> = (0..rows).map(|i| describe(checked.as_ref(), i)).collect();
            assert_eq!(got, want, "{rows}x{cols} {mode:?}");
            let direct = NpyArray::open_with(&path, "data", options(mode, true)).unwrap();
            assert_eq!(direct.read_options(), options(mode, true));
            // One byte of the last row, written in place, its times put back.
            let last = rows - 1;
            let data_offset = direct.data_offset() as u64;
            rewrite_keeping_times(&path, data_offset + last * cols + 3);
            let per_group = (4096 / cols).max(1);
            for d in [checked.as_ref(), &direct as &dyn Dataset] {
                for i in 0..rows {
                    let r = d.get(i);
                    if i / per_group != last / per_group {
                        r.unwrap();
                        continue;
                    }
                    match r {
                        Err(Error::FileChanged { path: p, what }) => {
                            assert_eq!(p, path);
                            assert!(
                                what.contains(&format!("row {i} is not what the file held")),
                                "{what}"
                            );
                            assert!(what.contains("written in place"), "{what}");
                        }
                        Err(e) => panic!("row {i}: expected FileChanged, got {e}"),
                        Ok(_) => panic!("row {i} of {rows}x{cols} ({mode:?}) read changed bytes"),
                    }
                }
            }
            if mode == ReadMode::Map {
                assert!(matches!(direct.row(last), Err(Error::FileChanged { .. })));
                if last / per_group != 0 {
                    assert_eq!(direct.row(0).unwrap(), &want[0][0][..]);
                }
            }
            // Unverified, the new byte is read.
            let s = plain.get(last).unwrap();
            assert_eq!(s.field(0).unwrap()[3], !want[last as usize][1][3]);
        }
    }
}

/// Through the loader, within an epoch (after its check of the file): the batch that holds a
/// changed row fails, naming the sample, the file and the row; the others are delivered.
#[cfg(unix)]
#[test]
fn a_verified_npy_row_changed_within_an_epoch_fails_its_batch() {
    use crate::file_changes::rewrite_keeping_times;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.npy");
    for mode in MODES {
        npy_rows(&path, 40, 5000);
        let a = NpyArray::open_with(&path, "data", options(mode, true)).unwrap();
        let at = a.data_offset() as u64 + 23 * 5000 + 17;
        rewrite_keeping_times(&path, at);
        let loader = Loader::builder(ReadsOnly(a))
            .batch_size(10)
            .workers(2)
            .shard(0, 1)
            .build()
            .unwrap();
        let results: Vec<_> = loader.collect();
        assert_eq!(results.len(), 4);
        for (k, r) in results.iter().enumerate() {
            if k != 2 {
                assert!(r.is_ok(), "batch {k}: {:?}", r.as_ref().err());
                continue;
            }
            let e = r.as_ref().unwrap_err();
            let Error::Sample {
                index: 23, source, ..
            } = e
            else {
                panic!("{e}")
            };
            assert!(
                matches!(source.as_ref(), Error::FileChanged { path: p, what } if p == &path && what.contains("row 23")),
                "{source}"
            );
        }
    }
}
