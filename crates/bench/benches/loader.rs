//! The loader against a plain 2-thread memcpy gather of the same records in the same order,
//! side by side in one run (issue: >= 80% of the gather on the 2-core machine), and the loader
//! alone over small rows (4,096-byte token rows, 1 MiB batches), where per-batch costs weigh
//! most: what a trace, or anything else added per batch, costs shows there first. Each loader
//! also runs with a trace recorded (`_traced`): the cost of a timeline.
//!
//! `cargo bench --bench loader`

use gpufeed::BatchStream;
use std::sync::Arc;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gpufeed::format::{DType, Field, RecordWriter, Schema};
use gpufeed::trace::Trace;
use gpufeed::{Dataset, Loader, LoaderBuilder, RecordFile};

const RECORDS: u64 = 2048;
const RECORD: usize = 3 * 224 * 224;
const BATCH: usize = 256;

/// Token rows: 2,048 u16 tokens (4,096 bytes) each.
const ROWS: u64 = 65_536;
const ROW: usize = 4096;

/// A packed file of `records` records of `bytes` pseudo-random bytes and a u32 label, its
/// pages warmed (as for every epoch after the first).
fn dataset(dir: &std::path::Path, name: &str, records: u64, bytes: usize) -> Arc<RecordFile> {
    let path = dir.join(name);
    let schema = Schema::new(vec![
        Field::tensor("data", DType::U8, &[bytes as u64]),
        Field::tensor("label", DType::U32, &[]),
    ])
    .expect("schema");
    let mut w = RecordWriter::create(&path, schema).expect("create");
    let mut buf = vec![0u8; bytes];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for i in 0..records {
        for c in buf.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
        }
        w.append(&[&buf, &(i as u32).to_le_bytes()])
            .expect("append");
    }
    w.finish().expect("finish");
    let f = Arc::new(RecordFile::open(&path).expect("open"));
    for i in 0..f.len() {
        std::hint::black_box(f.get(i).expect("get").bytes().expect("bytes")[0]);
    }
    f
}

/// An epoch of `loader` (the next epoch each call), every batch touched.
fn epoch(loader: &mut Loader, epoch: &mut u64) {
    loader.set_epoch(*epoch);
    *epoch += 1;
    for batch in loader.by_ref() {
        std::hint::black_box(batch.expect("batch").buffer().as_slice()[0]);
    }
}

fn records(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dataset(dir.path(), "records.gfd", RECORDS, RECORD);
    let sample_bytes = (RECORD + 4) as u64;
    let epoch_bytes = RECORDS / BATCH as u64 * BATCH as u64 * sample_bytes;
    let mut g = c.benchmark_group("epoch_of_2048x150528B_shuffled");
    g.throughput(Throughput::Bytes(epoch_bytes));
    g.sample_size(20);
    let mut loader = loader_of(&data).build().expect("build");
    let spec = loader.order_spec().clone();
    let mut n = 0;
    g.bench_function("loader_2_workers", |b| {
        b.iter(|| epoch(&mut loader, &mut n))
    });
    drop(loader);
    traced(&mut g, || loader_of(&data));
    // The gather's buffers persist across iterations, as the loader's pool does.
    let mut buffers = vec![Vec::new(); 2];
    g.bench_function("memcpy_gather_2_threads", |b| {
        b.iter(|| {
            gpufeed_bench::gather_baseline(
                data.as_ref(),
                &spec,
                1,
                None,
                None,
                &std::sync::atomic::AtomicBool::new(false),
                &mut buffers,
            )
            .expect("gather")
        })
    });
    g.finish();
}

fn rows(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dataset(dir.path(), "rows.gfd", ROWS, ROW);
    let epoch_bytes = ROWS / BATCH as u64 * BATCH as u64 * (ROW + 4) as u64;
    let mut g = c.benchmark_group("epoch_of_65536x4096B_rows_shuffled");
    g.throughput(Throughput::Bytes(epoch_bytes));
    g.sample_size(20);
    let mut loader = loader_of(&data).build().expect("build");
    let mut n = 0;
    g.bench_function("loader_2_workers", |b| {
        b.iter(|| epoch(&mut loader, &mut n))
    });
    drop(loader);
    traced(&mut g, || loader_of(&data));
    g.finish();
}

/// The loader of both groups: batches of 256, shuffled, 2 workers.
fn loader_of(data: &Arc<RecordFile>) -> LoaderBuilder {
    Loader::builder_shared(data.clone() as Arc<dyn Dataset>)
        .batch_size(BATCH)
        .shuffle(7)
        .workers(2)
        .drop_last(true)
        .shard(0, 1)
}

/// The same loader recording a timeline, every event kept (a full trace drops events, which
/// costs less than keeping them).
fn traced(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    builder: impl Fn() -> LoaderBuilder,
) {
    let trace = Trace::with_capacity(usize::MAX);
    let mut loader = builder().trace(&trace).build().expect("build");
    let mut n = 0;
    g.bench_function("loader_2_workers_traced", |b| {
        b.iter(|| epoch(&mut loader, &mut n))
    });
}

criterion_group!(benches, records, rows);
criterion_main!(benches);
