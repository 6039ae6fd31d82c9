//! Sharded datasets read sequentially through `Dataset::get` against a plain sequential read
//! of the same shard files (what `dd bs=1M` does), in one run.
//!
//! Writes 128 MiB of samples (a 112 KiB `image` bytes field, a `label`) three ways, 8 MiB
//! shards each: packed shards (`ShardWriter`), WebDataset tar shards (`TarBuilder`, members
//! `NAME.jpg` and `NAME.cls`) and MDS shards (the layout of MosaicML's `MDSWriter`, columns
//! `image: bytes`, `label: int`). Then, with the files in the page cache:
//!
//! - `read/<format>`: every shard file read front to back into a 1 MiB buffer (`read(2)`, as
//!   `dd` does): a copy of every byte of the files;
//! - `get/<format>`: every sample by `get(i)` in index order, each field copied into a sample
//!   buffer (as the loader copies into its batch slot): a copy of every byte of the samples;
//! - `get-remap/<format>`: the same with `max_open_shards = 2`, so each shard is mapped again
//!   (and its pages faulted in again) on every pass.
//!
//! Throughput is the bytes of the shard files for `read`, of the samples' fields for `get`
//! (a few percent fewer: headers, tables). Run with `cargo bench --bench shard_read`. The
//! target (issue 14): `get` at >= 90% of `read`.

use std::hint::black_box;
use std::io::Read;
use std::path::{Path, PathBuf};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gpufeed::Dataset;
use gpufeed::format::{Codec, DType, Field, Schema};
use gpufeed::source::shards::mds::MdsDataset;
use gpufeed::source::shards::packed::{PackedShards, ShardWriter};
use gpufeed::source::shards::tar::TarBuilder;
use gpufeed::source::shards::webdataset::{WebDataset, WebDatasetOptions};
use gpufeed::source::shards::{ShardOptions, ShardedSource};

const SAMPLE: usize = 112 << 10;
const TOTAL: usize = 128 << 20;
const SHARD: usize = 8 << 20;

fn image(i: usize) -> Vec<u8> {
    (0..SAMPLE).map(|k| (k ^ i) as u8).collect()
}

fn write_packed(dir: &Path, n: usize) {
    let schema = Schema::new(vec![
        Field::bytes("image", Codec::Jpeg),
        Field::tensor("label", DType::I64, &[]),
    ])
    .expect("schema");
    let mut w = ShardWriter::create(dir, schema, SHARD as u64).expect("writer");
    for i in 0..n {
        w.append(&[&image(i), &(i as i64).to_le_bytes()])
            .expect("append");
    }
    w.finish().expect("finish");
}

fn write_tars(dir: &Path, n: usize) -> Vec<PathBuf> {
    let per = SHARD / (SAMPLE + 2048);
    let mut out = Vec::new();
    for (k, chunk) in (0..n).collect::<Vec<_>>().chunks(per).enumerate() {
        let mut t = TarBuilder::new();
        for &i in chunk {
            t.file(&format!("s{i:07}.cls"), (i % 1000).to_string().as_bytes());
            t.file(&format!("s{i:07}.jpg"), &image(i));
        }
        let p = dir.join(format!("shard-{k:06}.tar"));
        std::fs::write(&p, t.finish()).expect("write tar");
        out.push(p);
    }
    out
}

/// MDS shards as MDSWriter lays them out: u32 count, u32 offsets, the config, samples
/// (u32 size of `image`, its bytes, the 8-byte `label`).
fn write_mds(dir: &Path, n: usize) {
    let per = SHARD / (SAMPLE + 16);
    let mut shards = Vec::new();
    for (k, chunk) in (0..n).collect::<Vec<_>>().chunks(per).enumerate() {
        let config =
            br#"{"column_encodings": ["bytes", "int"], "column_names": ["image", "label"]}"#;
        let head = 4 + 4 * (chunk.len() + 1);
        let mut offsets = vec![(head + config.len()) as u32];
        let mut body = Vec::new();
        for &i in chunk {
            body.extend_from_slice(&(SAMPLE as u32).to_le_bytes());
            body.extend_from_slice(&image(i));
            body.extend_from_slice(&(i as i64).to_le_bytes());
            offsets.push((head + config.len() + body.len()) as u32);
        }
        let mut file = (chunk.len() as u32).to_le_bytes().to_vec();
        offsets
            .iter()
            .for_each(|o| file.extend_from_slice(&o.to_le_bytes()));
        file.extend_from_slice(config);
        file.extend_from_slice(&body);
        let name = format!("shard.{k:05}.mds");
        std::fs::write(dir.join(&name), &file).expect("write mds");
        shards.push(serde_json::json!({
            "format": "mds", "version": 2, "samples": chunk.len(),
            "column_names": ["image", "label"], "column_encodings": ["bytes", "int"],
            "column_sizes": [null, 8], "compression": null, "hashes": [],
            "raw_data": {"basename": name, "bytes": file.len(), "hashes": {}},
            "zip_data": null
        }));
    }
    let index = serde_json::json!({"version": 2, "shards": shards});
    std::fs::write(
        dir.join("index.json"),
        serde_json::to_vec(&index).expect("json"),
    )
    .expect("write index");
}

/// Every file read front to back into a 1 MiB buffer: `dd bs=1M`.
fn read_all(files: &[PathBuf], buf: &mut [u8]) -> u64 {
    let mut total = 0u64;
    for p in files {
        let mut f = std::fs::File::open(p).expect("open");
        loop {
            let n = f.read(buf).expect("read");
            if n == 0 {
                break;
            }
            total += n as u64;
            black_box(&buf[..n]);
        }
    }
    total
}

/// Every sample by `get`, each field copied out.
fn get_all(d: &dyn Dataset, buf: &mut [u8]) -> u64 {
    let mut total = 0u64;
    for i in 0..d.len() {
        let s = d.get(i).expect("get");
        let mut at = 0;
        for k in 0..d.schema().fields().len() {
            let f = s.field(k).expect("field");
            buf[at..at + f.len()].copy_from_slice(f);
            at += f.len();
        }
        total += at as u64;
        black_box(&buf[..at]);
    }
    total
}

fn files_of(d: &dyn ShardedSource, dir: &Path) -> Vec<PathBuf> {
    d.shard_names().iter().map(|n| dir.join(n)).collect()
}

fn bench(c: &mut Criterion) {
    let root = tempfile::tempdir().expect("temporary directory");
    let n = TOTAL / SAMPLE;
    let (packed, tars, mds) = (
        root.path().join("packed"),
        root.path().join("tar"),
        root.path().join("mds"),
    );
    for d in [&packed, &tars, &mds] {
        std::fs::create_dir_all(d).expect("mkdir");
    }
    write_packed(&packed, n);
    let tar_files = write_tars(&tars, n);
    write_mds(&mds, n);
    let tar_options = |max_open_shards| WebDatasetOptions {
        cache_dir: Some(root.path().join("cache")),
        shards: ShardOptions {
            max_open_shards,
            ..ShardOptions::default()
        },
        ..WebDatasetOptions::default()
    };
    let open = |max: usize| -> Vec<(&str, Box<dyn ShardedSource>, Vec<PathBuf>)> {
        let options = ShardOptions {
            max_open_shards: max,
            ..ShardOptions::default()
        };
        let p = PackedShards::open_with(&packed, options.clone()).expect("packed");
        let t = WebDataset::open_with(&tar_files, tar_options(max)).expect("tar");
        let m = MdsDataset::open_with(&mds, options).expect("mds");
        let (pf, tf, mf) = (files_of(&p, &packed), tar_files.clone(), files_of(&m, &mds));
        vec![
            ("packed", Box::new(p), pf),
            ("tar", Box::new(t), tf),
            ("mds", Box::new(m), mf),
        ]
    };
    let mut buf = vec![0u8; 1 << 20];
    let mut g = c.benchmark_group("shard_read");
    g.sample_size(20);
    for (name, d, files) in open(256) {
        let file_bytes: u64 = files
            .iter()
            .map(|p| std::fs::metadata(p).expect("stat").len())
            .sum();
        // Warm the page cache and the mappings.
        read_all(&files, &mut buf);
        let sample_bytes = get_all(&*d, &mut buf);
        g.throughput(Throughput::Bytes(file_bytes));
        g.bench_function(format!("read/{name}"), |b| {
            b.iter(|| read_all(&files, &mut buf))
        });
        g.throughput(Throughput::Bytes(sample_bytes));
        g.bench_function(format!("get/{name}"), |b| b.iter(|| get_all(&*d, &mut buf)));
    }
    for (name, d, _) in open(2) {
        let sample_bytes = get_all(&*d, &mut buf);
        g.throughput(Throughput::Bytes(sample_bytes));
        g.bench_function(format!("get-remap/{name}"), |b| {
            b.iter(|| get_all(&*d, &mut buf))
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
