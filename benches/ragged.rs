//! Ragged fields against fixed fields of the same bytes: an epoch of a packed file whose
//! records hold one variable-size field (lengths spread evenly from half to one and a half
//! times the mean), and of one whose records hold a fixed field of the mean size, through the
//! loader with 2 workers, batches made whole or in 2 parts (a ragged batch in parts is put
//! together by its last part). Two shapes: JPEG-like records (~110 KB, batches of 128) and
//! text-like ones (~2 KB, batches of 256).
//!
//! `cargo bench --bench ragged`

use gpufeed::BatchStream;
use std::sync::Arc;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gpufeed::format::{Codec, DType, Field, RecordWriter, Schema};
use gpufeed::{Dataset, Loader, RecordFile};

/// A packed file of `records` records: a fixed field of `mean` bytes, or (`ragged`) a raw
/// bytes field whose lengths run evenly over `mean / 2 ..= 3 * mean / 2`; the page cache and
/// page tables warmed. Returns it and its bytes of data.
fn dataset(
    dir: &std::path::Path,
    records: u64,
    mean: usize,
    ragged: bool,
) -> (Arc<RecordFile>, u64) {
    let path = dir.join(if ragged { "ragged.gfd" } else { "fixed.gfd" });
    let field = if ragged {
        Field::bytes("data", Codec::Raw)
    } else {
        Field::tensor("data", DType::U8, &[mean as u64])
    };
    let schema = Schema::new(vec![field]).expect("schema");
    let mut w = RecordWriter::create(&path, schema).expect("create");
    let mut buf = vec![0u8; 2 * mean];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut total = 0u64;
    for i in 0..records {
        let len = if ragged {
            mean / 2 + (i as usize * 7919) % (mean + 1)
        } else {
            mean
        };
        for c in buf[..len].chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
        }
        w.append(&[&buf[..len]]).expect("append");
        total += len as u64;
    }
    w.finish().expect("finish");
    let f = Arc::new(RecordFile::open(&path).expect("open"));
    for i in 0..f.len() {
        std::hint::black_box(f.get(i).expect("get").bytes().expect("bytes")[0]);
    }
    (f, total)
}

fn epochs(c: &mut Criterion, name: &str, records: u64, mean: usize, batch: usize) {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut g = c.benchmark_group(name);
    g.sample_size(15);
    for ragged in [false, true] {
        let (data, total) = dataset(dir.path(), records, mean, ragged);
        g.throughput(Throughput::Bytes(total));
        for parts in [1, 2] {
            let mut builder = Loader::builder_shared(data.clone() as Arc<dyn Dataset>)
                .batch_size(batch)
                .shuffle(7)
                .workers(2)
                .batch_parts(parts);
            if ragged {
                // Room for a batch of the largest records: no batch is over the budget.
                builder = builder.ragged_budget("data", (batch * (3 * mean / 2 + 1)) as u64);
            }
            let mut loader = builder.build().expect("build");
            let mut epoch = 0;
            let what = format!(
                "{}_{}",
                if ragged { "ragged" } else { "fixed" },
                if parts == 1 { "whole" } else { "2_parts" }
            );
            g.bench_function(what, |b| {
                b.iter(|| {
                    loader.set_epoch(epoch);
                    epoch += 1;
                    for batch in loader.by_ref() {
                        let batch = batch.expect("batch");
                        std::hint::black_box(batch.field_bytes("data").expect("data")[0]);
                    }
                })
            });
        }
    }
    g.finish();
}

fn bench(c: &mut Criterion) {
    epochs(c, "jpeg_like_1024x110KB_batch128", 1024, 110_000, 128);
    epochs(c, "text_like_32768x2KB_batch256", 32_768, 2_000, 256);
}

criterion_group!(benches, bench);
criterion_main!(benches);
