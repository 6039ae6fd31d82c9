//! The plain gather baseline: what it copies, and that it stops when told.

use std::sync::atomic::AtomicBool;

use gpufeed::format::{DType, Field, RecordFile, RecordWriter, Schema};
use gpufeed::sampler::{OrderSpec, Remainder};
use gpufeed_bench::gather_baseline;

/// 100 records of a 1,000-byte `data` field and a 4-byte `label`.
fn records(dir: &std::path::Path) -> RecordFile {
    let path = dir.join("r.gfd");
    let schema = Schema::new(vec![
        Field::tensor("data", DType::U8, &[1000]),
        Field::tensor("label", DType::U32, &[]),
    ])
    .unwrap();
    let mut w = RecordWriter::create(&path, schema).unwrap();
    for i in 0..100u32 {
        w.append(&[&[i as u8; 1000], &i.to_le_bytes()]).unwrap();
    }
    w.finish().unwrap();
    RecordFile::open(&path).unwrap()
}

fn spec() -> OrderSpec {
    OrderSpec {
        len: 100,
        batch_size: 10,
        shuffle: Some(3),
        rank: 0,
        world: 1,
        remainder: Remainder::Wrap,
        blocks: None,
    }
}

#[test]
fn the_gather_copies_the_fields_it_is_given() {
    let dir = tempfile::tempdir().unwrap();
    let data = records(dir.path());
    let stop = AtomicBool::new(false);
    let mut buffers = vec![Vec::new(); 2];
    gather_baseline(&data, &spec(), 1, None, None, &stop, &mut buffers).unwrap();
    // A batch of 10 samples of both fields.
    assert!(
        buffers.iter().all(|b| b.len() == 10 * 1004),
        "{:?}",
        buffers.iter().map(Vec::len).collect::<Vec<_>>()
    );
    let mut buffers = vec![Vec::new(); 2];
    gather_baseline(&data, &spec(), 1, None, Some(&[1]), &stop, &mut buffers).unwrap();
    assert!(
        buffers.iter().all(|b| b.len() == 10 * 4),
        "{:?}",
        buffers.iter().map(Vec::len).collect::<Vec<_>>()
    );
    // The labels of the last batch thread 0 copied (it copies batches 0, 2, .., 8 of 10), in
    // the loader's order.
    let order = spec().epoch(0);
    let mut last = Vec::new();
    order.batch(8, &mut last);
    let labels: Vec<u32> = buffers[0]
        .chunks(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(labels, last.iter().map(|&i| i as u32).collect::<Vec<_>>());
}

#[test]
fn a_stopped_gather_copies_nothing_more() {
    let dir = tempfile::tempdir().unwrap();
    let data = records(dir.path());
    let stop = AtomicBool::new(true);
    let mut buffers = vec![Vec::new(); 2];
    let r = gather_baseline(&data, &spec(), 1000, None, None, &stop, &mut buffers).unwrap();
    assert_eq!(r, None);
    assert!(buffers.iter().all(Vec::is_empty));
}
