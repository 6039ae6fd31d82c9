//! Every malformed packed file gets a typed error that names the file, never a panic.
//!
//! Files are written with `RecordWriter`, then patched byte by byte. The footer checksum covers
//! the header, the schema and the footer, so tests that patch those re-seal it with `reseal`
//! to get past that check and reach the one under test.

use std::path::{Path, PathBuf};

use gpufeed::format::{Codec, DType, Field, ReadOptions, RecordFile, RecordWriter, Schema};
use gpufeed::{Dataset, Error};

const FOOTER: usize = 64;

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// The footer's fields: (records, data_end, schema_offset, schema_len, offsets_offset, checksums_offset).
fn footer(b: &[u8]) -> [u64; 6] {
    let f = b.len() - FOOTER;
    [8, 16, 24, 32, 40, 48].map(|at| u64_at(b, f + at))
}

/// Recomputes the footer checksum after the header, schema or footer was patched.
fn reseal(b: &mut [u8]) {
    let [_, _, so, sl, _, _] = footer(b);
    let f = b.len() - FOOTER;
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(&b[..64]);
    h.update(&b[so as usize..(so + sl) as usize]);
    h.update(&b[f..f + 56]);
    let sum = h.digest();
    put_u64(b, f + 56, sum);
}

/// A file of `n` records: `data` u8[16] holding the record number, and `label` u32.
fn write_fixed(dir: &Path, n: u32) -> PathBuf {
    let path = dir.join("fixed.gfd");
    let schema = Schema::new(vec![
        Field::tensor("data", DType::U8, &[16]),
        Field::tensor("label", DType::U32, &[]),
    ])
    .unwrap();
    let mut w = RecordWriter::create(&path, schema).unwrap();
    for i in 0..n {
        w.append(&[&[i as u8; 16], &i.to_le_bytes()]).unwrap();
    }
    w.finish().unwrap();
    path
}

fn write_variable(dir: &Path, n: u32) -> PathBuf {
    let path = dir.join("var.gfd");
    let schema = Schema::new(vec![
        Field::tensor("label", DType::U16, &[]),
        Field::bytes("jpeg", Codec::Jpeg),
    ])
    .unwrap();
    let mut w = RecordWriter::create(&path, schema).unwrap();
    for i in 0..n {
        w.append(&[&(i as u16).to_le_bytes(), &vec![7u8; i as usize * 3]])
            .unwrap();
    }
    w.finish().unwrap();
    path
}

fn patched(path: &Path, f: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
    let mut b = std::fs::read(path).unwrap();
    f(&mut b);
    let out = path.with_extension("patched");
    std::fs::write(&out, b).unwrap();
    out
}

fn assert_names(e: &Error, path: &Path) {
    let msg = e.to_string();
    assert!(
        msg.contains(&path.display().to_string()),
        "`{msg}` does not name {}",
        path.display()
    );
}

#[test]
fn wrong_magic_is_malformed() {
    let dir = tempfile::tempdir().unwrap();
    let p = patched(&write_fixed(dir.path(), 4), |b| {
        b[0..8].copy_from_slice(b"NOTMAGIC")
    });
    let e = RecordFile::open(&p).unwrap_err();
    assert!(
        matches!(&e, Error::Malformed { what, .. } if what.contains("magic")),
        "{e}"
    );
    assert_names(&e, &p);
    // The front door recognises no format in it, and says what it looked for.
    let Err(e) = gpufeed::source::open(&p, &Default::default()) else {
        panic!("opened")
    };
    assert!(
        matches!(&e, Error::Unrecognised { what, .. }
            if what.contains("no format") && what.contains("packed record file")),
        "{e}"
    );
    assert_names(&e, &p);
}

#[test]
fn future_major_version_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let p = patched(&write_fixed(dir.path(), 4), |b| {
        b[8..10].copy_from_slice(&2u16.to_le_bytes());
        reseal(b);
    });
    let e = RecordFile::open(&p).unwrap_err();
    assert!(
        matches!(
            e,
            Error::UnsupportedVersion {
                major: 2,
                minor: 0,
                supported: 1,
                ..
            }
        ),
        "{e}"
    );
    assert_names(&e, &p);
    assert!(e.to_string().contains("upgrade"));
}

#[test]
fn newer_minor_version_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let p = patched(&write_fixed(dir.path(), 4), |b| {
        b[10..12].copy_from_slice(&9u16.to_le_bytes());
        reseal(b);
    });
    let f = RecordFile::open(&p).unwrap();
    assert_eq!(f.version(), (1, 9));
    assert_eq!(f.get(3).unwrap().field(1), Some(&3u32.to_le_bytes()[..]));
}

#[test]
fn unknown_codec_of_a_newer_minor_is_read_as_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_variable(dir.path(), 3);
    let p = patched(&path, |b| {
        let [_, _, so, sl, _, _] = footer(b);
        let schema = &mut b[so as usize..(so + sl) as usize];
        // The codec byte is the schema block's last byte (the bytes field is last).
        let last = schema.len() - 1;
        assert_eq!(schema[last], Codec::Jpeg.code());
        schema[last] = 200;
        reseal(b);
    });
    let f = RecordFile::open(&p).unwrap();
    assert_eq!(
        f.schema().fields()[1],
        Field::bytes("jpeg", Codec::Other(200))
    );
    assert_eq!(f.get(2).unwrap().field(1), Some(&[7u8; 6][..]));
}

#[test]
fn every_truncation_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    for path in [write_fixed(dir.path(), 5), write_variable(dir.path(), 5)] {
        let full = std::fs::read(&path).unwrap();
        for cut in 0..full.len() {
            let p = dir.path().join("cut.gfd");
            std::fs::write(&p, &full[..cut]).unwrap();
            let e = RecordFile::open(&p).expect_err(&format!("a file cut at {cut} opened"));
            assert!(matches!(e, Error::Malformed { .. }), "cut at {cut}: {e}");
            assert_names(&e, &p);
            assert!(
                gpufeed::source::open(&p, &Default::default()).is_err(),
                "cut at {cut}"
            );
        }
    }
}

#[test]
fn offset_pointing_outside_the_file_is_a_bad_record() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_fixed(dir.path(), 6);
    let p = patched(&path, |b| {
        let [_, _, _, _, oo, _] = footer(b);
        put_u64(b, oo as usize + 8 * 3, u64::MAX - 7);
    });
    // The footer checksum does not cover the tables: open succeeds in O(1)...
    let f = RecordFile::open(&p).unwrap();
    assert!(f.get(1).is_ok());
    // ...and every read that uses the bad entry is refused.
    for i in [2, 3] {
        let e = f.get(i).unwrap_err();
        assert!(
            matches!(e, Error::BadRecord { record, .. } if record == i),
            "{e}"
        );
        assert_names(&e, &p);
        assert!(matches!(f.get_bytes(i), Err(Error::BadRecord { .. })));
        assert!(matches!(f.record_bytes(i), Err(Error::BadRecord { .. })));
    }
    let e = f.verify(|_| {}).unwrap_err();
    assert!(matches!(e, Error::BadRecord { record: 2, .. }), "{e}");
}

#[test]
fn decreasing_or_repeated_offsets_are_bad_records() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_fixed(dir.path(), 6);
    let b = std::fs::read(&path).unwrap();
    let [_, _, _, _, oo, _] = footer(&b);
    let o = |i: usize| u64_at(&b, oo as usize + 8 * i);
    // Swap entries 2 and 3: record 1 ends after record 2 starts, record 2 runs backwards.
    let (o2, o3) = (o(2), o(3));
    let p = patched(&path, |b| {
        put_u64(b, oo as usize + 16, o3);
        put_u64(b, oo as usize + 24, o2);
    });
    let f = RecordFile::open(&p).unwrap();
    let e = f.get(2).unwrap_err();
    assert!(matches!(e, Error::BadRecord { record: 2, .. }), "{e}");
    assert_names(&e, &p);
    // A repeated offset makes an empty record.
    let p = patched(&path, |b| put_u64(b, oo as usize + 16, o(1)));
    let f = RecordFile::open(&p).unwrap();
    assert!(matches!(f.get(1), Err(Error::BadRecord { record: 1, .. })));
    // An offset that is not a multiple of the record alignment.
    let p = patched(&path, |b| put_u64(b, oo as usize + 16, o(2) + 1));
    let f = RecordFile::open(&p).unwrap();
    assert!(matches!(f.get(2), Err(Error::BadRecord { record: 2, .. })));
}

/// In a file of fixed-size records, offsets that moved by a whole stride
/// (still increasing, still aligned, still inside the data) made `get(2)` return record 3.
#[test]
fn moved_offset_in_a_fixed_size_file_is_a_bad_record_not_another_record() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_fixed(dir.path(), 6);
    let b = std::fs::read(&path).unwrap();
    let [_, _, _, _, oo, _] = footer(&b);
    let o = |i: usize| u64_at(&b, oo as usize + 8 * i);
    let stride = o(1) - o(0);
    // Entries 2 to 4 move one record on: record 1 swallows record 2, record 2 is record 3's
    // bytes, and only record 5 (now empty) is out of order.
    let p = patched(&path, |b| {
        for i in 2..=4 {
            put_u64(b, oo as usize + 8 * i, o(i) + stride);
        }
    });
    let f = RecordFile::open(&p).unwrap();
    assert_eq!(f.get(0).unwrap().field(0), Some(&[0u8; 16][..]));
    for i in 1..=3u64 {
        let got = f.get(i).map(|s| s.field(0).map(<[u8]>::to_vec));
        let e = got.expect_err(&format!("record {i} was read from a moved offset"));
        assert!(
            matches!(&e, Error::BadRecord { record, what, .. } if *record == i && what.contains("fixed-size")),
            "{e}"
        );
        assert_names(&e, &p);
        assert!(matches!(f.get_bytes(i), Err(Error::BadRecord { .. })));
    }
    // Record 4 now starts where record 5 does: empty.
    assert!(matches!(f.get(4), Err(Error::BadRecord { record: 4, .. })));
    // Through the checksum-verifying path too, and verify() names the first moved record.
    let e = f.verify(|_| {}).unwrap_err();
    assert!(matches!(e, Error::BadRecord { record: 1, .. }), "{e}");
}

/// A fixed-size schema whose data region is not a whole number of records is refused at open.
#[test]
fn fixed_size_records_that_do_not_tile_the_data_fail_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_fixed(dir.path(), 6);
    let b = std::fs::read(&path).unwrap();
    let [_, _, _, _, oo, _] = footer(&b);
    let o = |i: usize| u64_at(&b, oo as usize + 8 * i);
    // Record 0 made one alignment unit longer (and record 1 shorter): still increasing and
    // aligned, but 6 records of record 0's size no longer fill the data region.
    let p = patched(&path, |b| put_u64(b, oo as usize + 8, o(1) + 8));
    let e = RecordFile::open(&p).unwrap_err();
    assert!(
        matches!(&e, Error::Malformed { what, .. } if what.contains("fixed-size")),
        "{e}"
    );
    assert_names(&e, &p);
}

#[test]
fn first_or_last_offset_off_the_data_region_fails_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_fixed(dir.path(), 6);
    for entry in [0usize, 6] {
        let p = patched(&path, |b| {
            let [_, _, _, _, oo, _] = footer(b);
            let at = oo as usize + 8 * entry;
            let v = u64_at(b, at);
            put_u64(b, at, v + 8);
        });
        let e = RecordFile::open(&p).unwrap_err();
        assert!(
            matches!(&e, Error::Malformed { what, .. } if what.contains("offset table")),
            "{e}"
        );
        assert_names(&e, &p);
    }
}

#[test]
fn footer_naming_regions_outside_the_file_is_malformed() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_fixed(dir.path(), 6);
    // records, data_end, schema_offset, schema_len, offsets_offset, checksums_offset
    for (field, value) in [
        (8, 1u64 << 40),
        (16, u64::MAX),
        (24, 3),
        (32, u64::MAX - 2),
        (40, 1 << 50),
        (48, 12),
    ] {
        let p = patched(&path, |b| {
            let f = b.len() - FOOTER;
            put_u64(b, f + field, value);
            if (24..40).contains(&field) {
                // The schema range moved: the checksum can only be re-sealed when it is in bounds.
            } else {
                reseal(b);
            }
        });
        let e = RecordFile::open(&p).unwrap_err();
        assert!(
            matches!(e, Error::Malformed { .. }),
            "footer byte {field}: {e}"
        );
        assert_names(&e, &p);
    }
}

#[test]
fn corrupt_header_or_schema_fails_the_footer_checksum() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_fixed(dir.path(), 6);
    let p = patched(&path, |b| {
        let [_, _, so, _, _, _] = footer(b);
        b[so as usize + 6] ^= 0x20; // a letter of the first field's name
    });
    let e = RecordFile::open(&p).unwrap_err();
    assert!(
        matches!(&e, Error::Malformed { what, .. } if what.contains("checksum")),
        "{e}"
    );
    assert_names(&e, &p);
}

#[test]
fn schema_that_does_not_fit_the_records_is_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_fixed(dir.path(), 6);
    let p = patched(&path, |b| {
        let [_, _, so, _, _, _] = footer(b);
        // Schema block: count u32 | name_len u16 "data" | kind 0, dtype, ndim 1 | dim u64 ...
        let dim_at = so as usize + 4 + 2 + 4 + 3;
        assert_eq!(u64_at(b, dim_at), 16);
        put_u64(b, dim_at, 4096);
        reseal(b);
    });
    let e = RecordFile::open(&p).unwrap_err();
    assert!(
        matches!(&e, Error::Malformed { what, .. } if what.contains("does not fit record 0") && what.contains("minimum")),
        "{e}"
    );
    assert_names(&e, &p);
}

#[test]
fn variable_length_table_claiming_too_much_is_a_bad_record() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_variable(dir.path(), 4);
    let f = RecordFile::open(&path).unwrap();
    let start =
        f.record_bytes(2).unwrap().as_ptr() as usize - f.record_bytes(0).unwrap().as_ptr() as usize;
    let first = u64_at(&std::fs::read(&path).unwrap(), 16) as usize; // header: data offset
    drop(f);
    let p = patched(&path, |b| {
        // Record 2: label u16 at 0, length table at 4.
        let at = first + start + 4;
        assert_eq!(u32::from_le_bytes(b[at..at + 4].try_into().unwrap()), 6);
        b[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    });
    let f = RecordFile::open(&p).unwrap();
    assert!(f.get(1).is_ok());
    let e = f.get(2).unwrap_err();
    assert!(matches!(e, Error::BadRecord { record: 2, .. }), "{e}");
    assert!(matches!(
        f.get_bytes(2),
        Err(Error::BadRecord { record: 2, .. })
    ));
}

#[test]
fn checksum_mismatch_is_found_on_demand() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_fixed(dir.path(), 6);
    let f = RecordFile::open(&path).unwrap();
    let data_offset = u64_at(&std::fs::read(&path).unwrap(), 16) as usize;
    let rec3 =
        f.record_bytes(3).unwrap().as_ptr() as usize - f.record_bytes(0).unwrap().as_ptr() as usize;
    drop(f);
    let p = patched(&path, |b| b[data_offset + rec3 + 5] ^= 0xff);
    // A plain read does not hash: it sees the flipped byte.
    let f = RecordFile::open(&p).unwrap();
    assert_eq!(f.get(3).unwrap().field(0).unwrap()[5], 3 ^ 0xff);
    // The opt-in read mode and verify() both report the record.
    let checked = RecordFile::open_with(
        &p,
        ReadOptions {
            verify_checksums: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(checked.get(2).is_ok());
    let e = checked.get(3).unwrap_err();
    assert!(
        matches!(e, Error::ChecksumMismatch { record: 3, .. }),
        "{e}"
    );
    assert_names(&e, &p);
    assert!(e.to_string().contains("record 3"));
    let e = f.verify(|_| {}).unwrap_err();
    assert!(
        matches!(e, Error::ChecksumMismatch { record: 3, .. }),
        "{e}"
    );
    assert!(matches!(
        f.verify_record(3),
        Err(Error::ChecksumMismatch { record: 3, .. })
    ));
    // A flipped byte in the checksum table is found the same way.
    let p = patched(&path, |b| {
        let [_, _, _, _, _, co] = footer(b);
        b[co as usize + 8] ^= 1;
    });
    let f = RecordFile::open(&p).unwrap();
    assert!(matches!(
        f.verify(|_| {}),
        Err(Error::ChecksumMismatch { record: 1, .. })
    ));
}

#[test]
fn empty_file_is_malformed() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("empty.gfd");
    std::fs::write(&p, b"").unwrap();
    let e = RecordFile::open(&p).unwrap_err();
    assert!(
        matches!(&e, Error::Malformed { what, .. } if what.contains("empty")),
        "{e}"
    );
    assert_names(&e, &p);
    // The front door calls it what it is, whatever its name: an empty file.
    let Err(e) = gpufeed::source::open(&p, &Default::default()) else {
        panic!("opened")
    };
    assert!(
        matches!(&e, Error::Unrecognised { what, .. } if what.starts_with("an empty file")),
        "{e}"
    );
    assert_names(&e, &p);
}

#[test]
fn missing_file_is_an_io_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("nope.gfd");
    let e = RecordFile::open(&p).unwrap_err();
    assert!(matches!(e, Error::Io { op: "open", .. }), "{e}");
    assert_names(&e, &p);
}

#[test]
fn out_of_range_index_is_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let f = RecordFile::open(write_fixed(dir.path(), 3)).unwrap();
    assert!(matches!(
        f.get(3),
        Err(Error::OutOfRange { index: 3, len: 3 })
    ));
    assert!(matches!(f.get(u64::MAX), Err(Error::OutOfRange { .. })));
    assert!(matches!(Dataset::get(&f, 7), Err(Error::OutOfRange { .. })));
}
