//! The loader against a plain 2-thread memcpy gather of the same records in the same order,
//! side by side in one run (issue: >= 80% of the gather on the 2-core machine).
//!
//! `cargo bench --bench loader`

use gpufeed::BatchStream;
use std::sync::Arc;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gpufeed::format::{DType, Field, RecordWriter, Schema};
use gpufeed::{Dataset, Loader, RecordFile};

const RECORDS: u64 = 2048;
const RECORD: usize = 3 * 224 * 224;
const BATCH: usize = 256;

fn dataset(dir: &std::path::Path) -> Arc<RecordFile> {
    let path = dir.join("bench.gfd");
    let schema = Schema::new(vec![
        Field::tensor("image", DType::U8, &[3, 224, 224]),
        Field::tensor("label", DType::U32, &[]),
    ])
    .expect("schema");
    let mut w = RecordWriter::create(&path, schema).expect("create");
    let mut buf = vec![0u8; RECORD];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for i in 0..RECORDS {
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
    // Warm the page cache and the page tables, as for every epoch after the first.
    for i in 0..f.len() {
        std::hint::black_box(f.get(i).expect("get").bytes().expect("bytes")[0]);
    }
    f
}

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dataset(dir.path());
    let sample_bytes = (RECORD + 4) as u64;
    let epoch_bytes = RECORDS / BATCH as u64 * BATCH as u64 * sample_bytes;
    let mut g = c.benchmark_group("epoch_of_2048x150528B_shuffled");
    g.throughput(Throughput::Bytes(epoch_bytes));
    g.sample_size(20);

    let mut loader = Loader::builder_shared(data.clone() as Arc<dyn Dataset>)
        .batch_size(BATCH)
        .shuffle(7)
        .workers(2)
        .drop_last(true)
        .shard(0, 1)
        .build()
        .expect("build");
    let spec = loader.order_spec().clone();
    let mut epoch = 0;
    g.bench_function("loader_2_workers", |b| {
        b.iter(|| {
            loader.set_epoch(epoch);
            epoch += 1;
            for batch in loader.by_ref() {
                std::hint::black_box(batch.expect("batch").buffer().as_slice()[0]);
            }
        })
    });
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

criterion_group!(benches, bench);
criterion_main!(benches);
