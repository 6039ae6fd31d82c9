//! Writer to reader round trips: fixed and variable fields, shards, and `Bytes` that outlive
//! the file they came from.

use std::path::{Path, PathBuf};

use gpufeed::format::{Codec, DType, Field, RecordFile, RecordWriter, Schema};
use gpufeed::source::npy_header;
use gpufeed::{Dataset, Error};

fn fixed_schema() -> Schema {
    Schema::new(vec![
        Field::tensor("flag", DType::Bool, &[]),
        Field::tensor("pixels", DType::F32, &[2, 3]),
        Field::tensor("label", DType::I64, &[]),
    ])
    .unwrap()
}

fn fixed_record(i: u64) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let px: Vec<u8> = (0..6)
        .flat_map(|k| (i as f32 + k as f32 / 10.0).to_le_bytes())
        .collect();
    (
        vec![(i % 2) as u8],
        px,
        (-(i as i64)).to_le_bytes().to_vec(),
    )
}

fn write_fixed(path: &Path, range: std::ops::Range<u64>) {
    let mut w = RecordWriter::create(path, fixed_schema()).unwrap();
    for i in range {
        let (a, b, c) = fixed_record(i);
        w.append(&[&a, &b, &c]).unwrap();
    }
    let s = w.finish().unwrap();
    assert_eq!(s.file_bytes, std::fs::metadata(path).unwrap().len());
}

#[test]
fn fixed_fields_round_trip_aligned() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("fixed.gfd");
    write_fixed(&p, 0..100);
    let f = RecordFile::open(&p).unwrap();
    assert_eq!(f.len(), 100);
    assert_eq!(f.schema(), &fixed_schema());
    for i in 0..100 {
        let s = f.get(i).unwrap();
        let (a, b, c) = fixed_record(i);
        assert_eq!(s.field(0), Some(&a[..]));
        assert_eq!(s.field_named("pixels"), Some(&b[..]));
        assert_eq!(s.field_named("label"), Some(&c[..]));
        // Each tensor is aligned to its element size in memory, so it can be viewed as its dtype.
        assert_eq!(s.field(1).unwrap().as_ptr() as usize % 4, 0);
        assert_eq!(s.field(2).unwrap().as_ptr() as usize % 8, 0);
        assert_eq!(
            s.bytes().unwrap().as_ptr() as usize % f.record_align() as usize,
            0
        );
    }
    f.verify(|_| {}).unwrap();
}

#[test]
fn variable_fields_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("var.gfd");
    let schema = Schema::new(vec![
        Field::bytes("jpeg", Codec::Jpeg),
        Field::tensor("label", DType::U32, &[]),
        Field::bytes("caption", Codec::Utf8),
        Field::bytes("extra", Codec::Raw),
    ])
    .unwrap();
    let rec = |i: usize| {
        (
            vec![i as u8; (i * 37) % 5000],
            (i as u32 * 3).to_le_bytes(),
            format!("caption {i}").into_bytes(),
            Vec::<u8>::new(),
        )
    };
    let mut w = RecordWriter::with_record_align(&p, schema.clone(), 256).unwrap();
    for i in 0..300 {
        let (a, b, c, d) = rec(i);
        w.append(&[&a, &b, &c, &d]).unwrap();
    }
    assert_eq!(w.len(), 300);
    w.finish().unwrap();
    let f = RecordFile::open(&p).unwrap();
    assert_eq!(f.record_align(), 256);
    assert_eq!(f.schema(), &schema);
    for i in 0..300 {
        let s = f.get(i as u64).unwrap();
        let (a, b, c, d) = rec(i);
        assert_eq!(s.field(0), Some(&a[..]));
        assert_eq!(s.field(1), Some(&b[..]));
        assert_eq!(s.field_named("caption"), Some(&c[..]));
        assert_eq!(s.field(3), Some(&d[..]));
        assert_eq!(s.field(4), None);
        assert_eq!(s.len() % 256, 0);
    }
    f.verify(|_| {}).unwrap();
}

#[test]
fn writer_refuses_wrong_field_values() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("w.gfd");
    let mut w = RecordWriter::create(&p, fixed_schema()).unwrap();
    assert!(matches!(w.append(&[&[1]]), Err(Error::Mismatch { .. })));
    assert!(matches!(
        w.append(&[&[1], &[0; 23], &[0; 8]]),
        Err(Error::Mismatch { .. })
    ));
    assert!(matches!(
        RecordWriter::with_record_align(dir.path().join("x"), fixed_schema(), 12),
        Err(Error::InvalidConfig { .. })
    ));
}

#[test]
fn unfinished_writer_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("w.gfd");
    {
        let mut w = RecordWriter::create(&p, fixed_schema()).unwrap();
        let (a, b, c) = fixed_record(0);
        w.append(&[&a, &b, &c]).unwrap();
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn empty_dataset_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("none.gfd");
    write_fixed(&p, 0..0);
    let f = RecordFile::open(&p).unwrap();
    assert!(f.is_empty());
    assert_eq!(f.data_bytes(), 0);
    assert!(matches!(f.get(0), Err(Error::OutOfRange { .. })));
    f.verify(|_| {}).unwrap();
}

#[test]
fn shards_open_as_one_dataset() {
    let dir = tempfile::tempdir().unwrap();
    let paths: Vec<PathBuf> = (0..3)
        .map(|k| dir.path().join(format!("shard-{k}.gfd")))
        .collect();
    write_fixed(&paths[0], 0..10);
    write_fixed(&paths[1], 10..10);
    write_fixed(&paths[2], 10..25);
    let all = gpufeed::source::open_all(&paths, &Default::default()).unwrap();
    assert_eq!(all.len(), 25);
    for i in 0..25 {
        let (_, _, c) = fixed_record(i);
        assert_eq!(
            all.get(i).unwrap().field_named("label"),
            Some(&c[..]),
            "sample {i}"
        );
    }
    assert!(matches!(
        all.get(25),
        Err(Error::OutOfRange { index: 25, len: 25 })
    ));
    // A shard of another schema is refused.
    let other = dir.path().join("other.gfd");
    let mut w = RecordWriter::create(
        &other,
        Schema::new(vec![Field::tensor("x", DType::U8, &[])]).unwrap(),
    )
    .unwrap();
    w.append(&[&[1]]).unwrap();
    w.finish().unwrap();
    let Err(e) = gpufeed::source::open_all(&[&paths[0], &other], &Default::default()) else {
        panic!("opened")
    };
    assert!(matches!(e, Error::Mismatch { .. }), "{e}");
    // A broken shard names itself.
    std::fs::write(&paths[1], b"garbage").unwrap();
    let Err(e) = gpufeed::source::open_all(&paths, &Default::default()) else {
        panic!("opened")
    };
    assert!(e.to_string().contains("shard-1.gfd"), "{e}");
}

#[test]
fn npy_and_packed_shards_mix() {
    let dir = tempfile::tempdir().unwrap();
    let npy = dir.path().join("a.npy");
    let mut b = npy_header(DType::U8, &[4, 3]).unwrap();
    b.extend_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]);
    std::fs::write(&npy, b).unwrap();
    let packed = dir.path().join("b.gfd");
    let mut w = RecordWriter::create(
        &packed,
        Schema::new(vec![Field::tensor("data", DType::U8, &[3])]).unwrap(),
    )
    .unwrap();
    w.append(&[&[13, 14, 15]]).unwrap();
    w.finish().unwrap();
    let all = gpufeed::source::open_all(&[&npy, &packed], &Default::default()).unwrap();
    assert_eq!(all.len(), 5);
    assert_eq!(all.get(3).unwrap().field(0), Some(&[10, 11, 12][..]));
    assert_eq!(all.get(4).unwrap().field(0), Some(&[13, 14, 15][..]));
}

#[test]
fn bytes_outlive_the_record_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("fixed.gfd");
    write_fixed(&p, 0..50);
    let f = RecordFile::open(&p).unwrap();
    let range = f.schema().fixed_range(1).unwrap();
    let kept: Vec<bytes::Bytes> = (0..50).map(|i| f.get_bytes(i).unwrap()).collect();
    drop(f);
    std::fs::remove_file(&p).unwrap();
    for (i, b) in kept.iter().enumerate() {
        let (_, px, _) = fixed_record(i as u64);
        assert_eq!(&b[range.clone()], &px[..]);
    }
    // Threads share one file by reference.
    write_fixed(&p, 0..50);
    let f = RecordFile::open(&p).unwrap();
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let f = &f;
            s.spawn(move || {
                for i in (t..50).step_by(4) {
                    assert_eq!(
                        f.get(i).unwrap().field(2),
                        Some(&(-(i as i64)).to_le_bytes()[..])
                    );
                }
            });
        }
    });
}

#[test]
fn large_records_round_trip_with_checksums() {
    // Records of 64 KiB and more take the writer's parallel hash-and-write path.
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("large.gfd");
    let schema = Schema::new(vec![
        Field::tensor("label", DType::U8, &[]),
        Field::tensor("image", DType::U16, &[3, 100, 120]),
        Field::bytes("blob", Codec::Raw),
    ])
    .unwrap();
    let image = |i: u8| -> Vec<u8> { (0..72_000u32).map(|k| (k as u8).wrapping_mul(i)).collect() };
    let blob = |i: u8| vec![i ^ 0x5a; 40_000 * i as usize];
    let mut w = RecordWriter::create(&p, schema).unwrap();
    for i in 0..6u8 {
        w.append(&[&[i], &image(i), &blob(i)]).unwrap();
    }
    w.finish().unwrap();
    let f = RecordFile::open_with(
        &p,
        gpufeed::format::ReadOptions {
            verify_checksums: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(f.record_align(), 64);
    for i in 0..6u8 {
        let s = f.get(u64::from(i)).unwrap();
        assert_eq!(s.field(0), Some(&[i][..]));
        assert_eq!(s.field(1), Some(&image(i)[..]));
        assert_eq!(s.field(2), Some(&blob(i)[..]));
    }
    f.verify(|_| {}).unwrap();
}
