//! `RecordFile::get` + copy of 150,528-byte records against a plain memcpy of the same bytes.
//!
//! Builds a packed file of 2048 records (`data`: u8 [3, 224, 224], `label`: u32) in a temporary
//! directory, then, in the same run and from the same mapping:
//!
//! - `get+copy`: for a batch of 256 indices in a seeded random order, `RecordFile::get(i)`, then a
//!   copy of its `data` field into the batch buffer slot;
//! - `memcpy`: the same 256 byte ranges, computed up front, copied into the same buffer;
//! - `open`: `RecordFile::open` of the file;
//! - `get/map`, `get/pread`: `RecordFile::get(i)` and a read of its 4-byte label, per 256
//!   records: the reader's own cost, without the copy.
//!
//! Then, in group `read_mode`, what the loader's default transform does (`get`, then
//! `Sample::copy_field_into` of both fields into their slots) for each way of reading the file
//! (a mapping, `pread`, each with and without checksums), over the same records in the same
//! order:
//!
//! - `map`: from the mapping (`ReadMode::Map`, the default): streaming-store copies;
//! - `pread`: `ReadMode::Pread`, each field read by `pread` straight into its slot;
//! - `map+verify`, `pread+verify`: the same with `ReadOptions::verify_checksums` (each record
//!   hashed with xxh3 and compared with its stored checksum; in Pread, the record is read into a
//!   per-thread buffer, hashed, then copied).
//!
//! Then, in group `npy`, the same rows as a `.npy` array (`data`: u8 [2048, 3, 224, 224]) and
//! their labels as another (`label`: u32 [2048]), read as the loader's default transform reads
//! a `Zip` of the two (`get`, then `Sample::copy_field_into`), each way of reading them:
//!
//! - `map`, `pread`: as for the packed file;
//! - `map+verify`, `pread+verify`: opened with `ReadOptions::verify_checksums` (each row's
//!   group of rows hashed with xxh3 and compared with the checksum taken at open);
//!
//! in group `npy_labels`, the labels alone (rows of 4 bytes: a verified read hashes the 4 KiB
//! group of 1024 rows that holds its row); and in group `npy_open`, `NpyArray::open_with` of
//! the 308 MB array without and with verification (which hashes the whole array once).
//!
//! Run with `cargo bench --bench record_get`. The target: get+copy at >= 90% of memcpy.

use std::hint::black_box;
use std::io::Write;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gpufeed::format::{DType, Field, ReadMode, ReadOptions, RecordFile, RecordWriter, Schema};
use gpufeed::source::{Dataset, NpyArray, npy_header};

const RECORDS: u64 = 2048;
const RECORD: usize = 3 * 224 * 224;
const BATCH: usize = 256;

/// What record `i`'s `data` holds (the same in the packed file and the `.npy` array).
fn fill(rec: &mut [u8], i: u64) {
    rec.iter_mut()
        .enumerate()
        .for_each(|(k, b)| *b = (k as u64 ^ i) as u8);
}

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
        fill(&mut rec, i);
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

    // `get` alone, reading the 4-byte label: what the reader costs per record, without the copy
    // of the 150 KB field that dominates the figures above.
    let mut g = c.benchmark_group("get");
    g.throughput(Throughput::Elements(BATCH as u64));
    let mut k = 0usize;
    g.bench_function("map", |b| {
        b.iter(|| {
            let batch = batches[k % batches.len()];
            k += 1;
            let mut sum = 0u64;
            for &i in batch {
                sum += u64::from(file.get(i).expect("get").field(1).expect("label")[0]);
            }
            black_box(sum);
        })
    });
    // The same with ReadMode::Pread: the offset pair and the label are each one `pread`.
    let preads = RecordFile::open_with(
        &path,
        ReadOptions {
            mode: ReadMode::Pread,
            verify_checksums: false,
        },
    )
    .expect("open");
    let mut k = 0usize;
    g.bench_function("pread", |b| {
        b.iter(|| {
            let batch = batches[k % batches.len()];
            k += 1;
            let (mut sum, mut label) = (0u64, [0u8; 4]);
            for &i in batch {
                let sample = preads.get(i).expect("get");
                sample.copy_field_into(1, &mut label).expect("label");
                sum += u64::from(label[0]);
            }
            black_box(sum);
        })
    });
    g.finish();

    let mut g = c.benchmark_group("read_mode");
    g.throughput(Throughput::Bytes((BATCH * RECORD) as u64));
    let mut label = [0u8; 4];
    for (name, mode, verify_checksums) in [
        ("map", ReadMode::Map, false),
        ("pread", ReadMode::Pread, false),
        ("map+verify", ReadMode::Map, true),
        ("pread+verify", ReadMode::Pread, true),
    ] {
        let options = ReadOptions {
            mode,
            verify_checksums,
        };
        let file = RecordFile::open_with(&path, options).expect("open");
        let mut k = 0usize;
        g.bench_function(name, |b| {
            b.iter(|| {
                let batch = batches[k % batches.len()];
                k += 1;
                for (slot, &i) in buf.chunks_exact_mut(RECORD).zip(batch) {
                    let sample = file.get(i).expect("get");
                    sample.copy_field_into(0, slot).expect("data");
                    sample.copy_field_into(1, &mut label).expect("label");
                }
                black_box((&mut buf, &label));
            })
        });
    }
    g.finish();

    let npy = dir.path().join("bench.npy");
    let labels = dir.path().join("labels.npy");
    {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&npy).expect("create"));
        f.write_all(&npy_header(DType::U8, &[RECORDS, 3, 224, 224]).expect("header"))
            .expect("write");
        for i in 0..RECORDS {
            fill(&mut rec, i);
            f.write_all(&rec).expect("write");
        }
        f.flush().expect("write");
        let mut l = npy_header(DType::U32, &[RECORDS]).expect("header");
        (0..RECORDS as u32).for_each(|i| l.extend(i.to_le_bytes()));
        std::fs::write(&labels, l).expect("write");
    }
    let mut g = c.benchmark_group("npy");
    g.throughput(Throughput::Bytes((BATCH * RECORD) as u64));
    for (name, mode, verify_checksums) in NPY_MODES {
        let options = ReadOptions {
            mode,
            verify_checksums,
        };
        let (data, label_array) = npy_open(&npy, &labels, options);
        let mut k = 0usize;
        g.bench_function(name, |b| {
            b.iter(|| {
                let batch = batches[k % batches.len()];
                k += 1;
                for (slot, &i) in buf.chunks_exact_mut(RECORD).zip(batch) {
                    data.get(i)
                        .expect("get")
                        .copy_field_into(0, slot)
                        .expect("data");
                    label_array
                        .get(i)
                        .expect("get")
                        .copy_field_into(0, &mut label)
                        .expect("label");
                }
                black_box((&mut buf, &label));
            })
        });
    }
    g.finish();

    // The labels alone: rows of 4 bytes, 1024 to a checksum group, so that each verified read
    // hashes 4 KiB for 4 bytes (the worst case of the grouping).
    let mut g = c.benchmark_group("npy_labels");
    g.throughput(Throughput::Elements(BATCH as u64));
    for (name, mode, verify_checksums) in NPY_MODES {
        let options = ReadOptions {
            mode,
            verify_checksums,
        };
        let label_array = NpyArray::open_with(&labels, "label", options).expect("open");
        let mut k = 0usize;
        g.bench_function(name, |b| {
            b.iter(|| {
                let batch = batches[k % batches.len()];
                k += 1;
                let mut sum = 0u64;
                for &i in batch {
                    let sample = label_array.get(i).expect("get");
                    sample.copy_field_into(0, &mut label).expect("label");
                    sum += u64::from(label[0]);
                }
                black_box(sum);
            })
        });
    }
    g.finish();

    let mut g = c.benchmark_group("npy_open");
    g.sample_size(10);
    g.throughput(Throughput::Bytes(RECORDS * RECORD as u64));
    for (name, mode, verify_checksums) in NPY_MODES {
        let options = ReadOptions {
            mode,
            verify_checksums,
        };
        g.bench_function(name, |b| {
            b.iter(|| black_box(NpyArray::open_with(&npy, "data", options).expect("open")))
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

/// The ways of reading the `.npy` arrays that group `npy` measures.
const NPY_MODES: [(&str, ReadMode, bool); 4] = [
    ("map", ReadMode::Map, false),
    ("pread", ReadMode::Pread, false),
    ("map+verify", ReadMode::Map, true),
    ("pread+verify", ReadMode::Pread, true),
];

fn npy_open(
    data: &std::path::Path,
    labels: &std::path::Path,
    options: ReadOptions,
) -> (NpyArray, NpyArray) {
    (
        NpyArray::open_with(data, "data", options).expect("open"),
        NpyArray::open_with(labels, "label", options).expect("open"),
    )
}
