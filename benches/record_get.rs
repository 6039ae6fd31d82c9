//! `RecordFile::get` + copy of 150,528-byte records against a plain memcpy of the same bytes.
//!
//! Builds a packed file of 2048 records (`data`: u8 [3, 224, 224], `label`: u32) in a temporary
//! directory, then, in the same run and from the same mapping:
//!
//! - `get+copy`: for a batch of 256 indices in a seeded random order, `RecordFile::get(i)`, then a
//!   copy of its `data` field into the batch buffer slot;
//! - `memcpy`: the same 256 byte ranges, computed up front, copied into the same buffer;
//! - `open`: `RecordFile::open` of the file.
//!
//! Run with `cargo bench --bench record_get`. The target: get+copy at >= 90% of memcpy.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gpufeed::format::{DType, Field, RecordFile, RecordWriter, Schema};

const RECORDS: u64 = 2048;
const RECORD: usize = 3 * 224 * 224;
const BATCH: usize = 256;

/// A seeded permutation of `0..n` (xorshift64* Fisher-Yates), so both variants read the same
/// records in the same order.
fn permutation(n: u64, mut seed: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..n).collect();
    for i in (1..v.len()).rev() {
        seed ^= seed >> 12;
        seed ^= seed << 25;
        seed ^= seed >> 27;
        let r = seed.wrapping_mul(0x2545_f491_4f6c_dd1d);
        v.swap(i, (r % (i as u64 + 1)) as usize);
    }
    v
}

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("bench.gfd");
    let schema = Schema::new(vec![
        Field::tensor("data", DType::U8, &[3, 224, 224]),
        Field::tensor("label", DType::U32, &[]),
    ])
    .expect("schema");
    let mut w = RecordWriter::create(&path, schema).expect("create");
    let mut rec = vec![0u8; RECORD];
    for i in 0..RECORDS {
        rec.iter_mut()
            .enumerate()
            .for_each(|(k, b)| *b = (k as u64 ^ i) as u8);
        w.append(&[&rec, &(i as u32).to_le_bytes()])
            .expect("append");
    }
    w.finish().expect("finish");

    let file = RecordFile::open(&path).expect("open");
    let order = permutation(RECORDS, 0x9e37_79b9_7f4a_7c15);
    let batches: Vec<&[u64]> = order.chunks(BATCH).collect();
    // The memcpy baseline's ranges, from the same mapping, computed once.
    let data = file.schema().fixed_range(0).expect("data is a tensor");
    let ranges: Vec<Vec<&[u8]>> = batches
        .iter()
        .map(|b| {
            b.iter()
                .map(|&i| &file.record_bytes(i).expect("record")[data.clone()])
                .collect()
        })
        .collect();
    let mut buf = vec![0u8; BATCH * RECORD];

    let mut g = c.benchmark_group("record_get");
    g.throughput(Throughput::Bytes((BATCH * RECORD) as u64));
    let mut k = 0usize;
    g.bench_function("get+copy", |b| {
        b.iter(|| {
            let batch = batches[k % batches.len()];
            k += 1;
            for (slot, &i) in buf.chunks_exact_mut(RECORD).zip(batch) {
                let sample = file.get(i).expect("get");
                slot.copy_from_slice(sample.field(0).expect("data"));
            }
            black_box(&mut buf);
        })
    });
    let mut k = 0usize;
    g.bench_function("memcpy", |b| {
        b.iter(|| {
            let batch = &ranges[k % ranges.len()];
            k += 1;
            for (slot, src) in buf.chunks_exact_mut(RECORD).zip(batch) {
                slot.copy_from_slice(src);
            }
            black_box(&mut buf);
        })
    });
    g.finish();

    c.bench_function("open", |b| {
        b.iter(|| black_box(RecordFile::open(&path).expect("open")))
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
