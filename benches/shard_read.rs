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
//!   (and its pages faulted in again) on every pass: what a dataset larger than the set of
//!   open shards costs, once per shard per epoch;
//!
//! The packed and MDS indexes give each shard's xxh3-64 (MDS as `MDSWriter(hashes=
//! ['xxh3_64'])` writes it), so a local shard is hashed when it is first opened. A second
//! interleaved measurement says what that costs: a *first pass* (a data set opened afresh,
//! every sample read once: every shard opened, and hashed, once), the same *cold* (each shard
//! file's cached pages dropped before the pass, as after a reboot: read from the disk) and a
//! *get-remap* pass, each with the check (the default) and through a store that asks for none
//! (what every pass cost before shards were checked when opened).
//!
//! The files' cached pages are first dropped and read back once (as after reading from disk:
//! the pages a writer leaves differ between formats). Before criterion's runs, the same passes
//! interleaved (read, get, get-remap; 15 rounds, medians) are printed with their ratios: on a
//! shared VM, ratios from alternating passes are the figures to quote.
//!
//! Throughput is the bytes of the shard files for `read`, of the samples' fields for `get`
//! (a few percent fewer: headers, tables). Run with `cargo bench --bench shard_read`. The
//! target: `get` at >= 90% of `read`.

use std::hint::black_box;
use std::io::Read;
use std::path::{Path, PathBuf};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gpufeed::Dataset;
use gpufeed::format::{Codec, DType, Field, Schema};
use gpufeed::source::shards::mds::MdsDataset;
use gpufeed::source::shards::packed::{PackedShards, ShardWriter};
use gpufeed::source::shards::webdataset::{WebDataset, WebDatasetOptions};
use gpufeed::source::shards::{
    IndexedFormat, LocalDir, ShardBytes, ShardOptions, ShardStat, ShardStore, ShardedDataset,
    ShardedSource,
};

#[path = "../tests/tar_common/mod.rs"]
mod tar_common;
use tar_common::TarBuilder;

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
            "column_sizes": [null, 8], "compression": null, "hashes": ["xxh3_64"],
            "raw_data": {"basename": name, "bytes": file.len(),
                         "hashes": {"xxh3_64": format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&file))}},
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

/// A directory of shards whose opening checks no hash: what a local shard cost before it was
/// checked against its index when opened.
struct Unchecked(LocalDir);

impl ShardStore for Unchecked {
    fn locate(&self, name: &str) -> PathBuf {
        self.0.locate(name)
    }
    fn stat(&self, name: &str) -> gpufeed::Result<ShardStat> {
        self.0.stat(name)
    }
    fn open(&self, name: &str) -> gpufeed::Result<ShardBytes> {
        self.0.open(name)
    }
    fn local_file(&self, name: &str) -> gpufeed::Result<PathBuf> {
        self.0.local_file(name)
    }
    fn files_may_change(&self) -> bool {
        true
    }
    fn check_hashes_on_open(&self) -> bool {
        false
    }
}

/// The data set of format `F` in `dir`, opened afresh, its shards checked when opened or not.
fn open_indexed<F: IndexedFormat>(
    dir: &Path,
    checked: bool,
    max_open_shards: usize,
) -> ShardedDataset<F> {
    let index = dir.join("index.json");
    let text = std::fs::read(&index).expect("index");
    let store: std::sync::Arc<dyn ShardStore> = if checked {
        std::sync::Arc::new(LocalDir::new(dir))
    } else {
        std::sync::Arc::new(Unchecked(LocalDir::new(dir)))
    };
    let options = ShardOptions {
        max_open_shards,
        ..ShardOptions::default()
    };
    ShardedDataset::<F>::from_index(store, &index, &text, options).expect("open")
}

/// Interleaved passes with and without the check at open (see the module docs), medians of
/// `rounds`, printed as GiB/s of samples and the checked pass's share of the unchecked one's.
fn check_cost(packed: &Path, mds: &Path, buf: &mut [u8], rounds: usize) {
    let shard_files = |dir: &Path| -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
            .expect("list")
            .map(|e| e.expect("entry").path())
            .filter(|p| p.file_name().is_some_and(|n| n != "index.json"))
            .collect();
        v.sort();
        v
    };
    use gpufeed::source::shards::mds::MdsShards;
    use gpufeed::source::shards::packed::Packed;
    eprintln!(
        "the check at open, median of {rounds} rounds (GiB/s of samples; checked as % of unchecked):"
    );
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let fresh = |name: &str, checked: bool, open: usize| -> Box<dyn ShardedSource> {
        match name {
            "packed" => Box::new(open_indexed::<Packed>(packed, checked, open)),
            _ => Box::new(open_indexed::<MdsShards>(mds, checked, open)),
        }
    };
    for name in ["packed", "mds"] {
        let files = shard_files(if name == "packed" { packed } else { mds });
        // [first pass checked, unchecked, get-remap checked, unchecked, cold checked,
        // unchecked]
        let mut times = [vec![], vec![], vec![], vec![], vec![], vec![]];
        let mut bytes = 0;
        let remap = [fresh(name, true, 2), fresh(name, false, 2)];
        for d in &remap {
            get_all(&**d, buf);
        }
        for round in 0..rounds {
            // Alternate which goes first.
            let order = if round % 2 == 0 {
                [true, false]
            } else {
                [false, true]
            };
            for checked in order {
                let d = fresh(name, checked, 256);
                let t = std::time::Instant::now();
                bytes = get_all(&*d, buf);
                times[usize::from(!checked)].push(t.elapsed().as_secs_f64());
            }
            for checked in order {
                let t = std::time::Instant::now();
                get_all(&*remap[usize::from(!checked)], buf);
                times[2 + usize::from(!checked)].push(t.elapsed().as_secs_f64());
            }
            for checked in order {
                drop_cached(&files);
                let d = fresh(name, checked, 256);
                let t = std::time::Instant::now();
                get_all(&*d, buf);
                times[4 + usize::from(!checked)].push(t.elapsed().as_secs_f64());
            }
        }
        let gib: Vec<f64> = times
            .iter_mut()
            .map(|t| bytes as f64 / median(t) / f64::from(1u32 << 30))
            .collect();
        eprintln!(
            "  {name:6} first pass {:5.2} / {:5.2} ({:3.0}%) | cold {:5.2} / {:5.2} ({:3.0}%) | get-remap {:5.2} / {:5.2} ({:3.0}%)",
            gib[0],
            gib[1],
            100.0 * gib[0] / gib[1],
            gib[4],
            gib[5],
            100.0 * gib[4] / gib[5],
            gib[2],
            gib[3],
            100.0 * gib[2] / gib[3],
        );
    }
}

/// Drops the files' cached pages (GNU dd's `iflag=nocache`: posix_fadvise DONTNEED); they
/// must have been written back (`sync`).
fn drop_cached(files: &[PathBuf]) {
    for f in files {
        let dropped = std::process::Command::new("dd")
            .arg(format!("if={}", f.display()))
            .args(["iflag=nocache", "count=0", "status=none"])
            .status()
            .is_ok_and(|s| s.success());
        assert!(dropped, "dd iflag=nocache failed on {}", f.display());
    }
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
    let open = |max_open_shards: usize| -> Vec<(&str, Box<dyn ShardedSource>, Vec<PathBuf>)> {
        let options = ShardOptions {
            max_open_shards,
            ..ShardOptions::default()
        };
        let tar_options = WebDatasetOptions {
            cache_dir: Some(root.path().join("cache")),
            shards: options.clone(),
            ..WebDatasetOptions::default()
        };
        let p = PackedShards::open_with(&packed, options.clone()).expect("packed");
        let t = WebDataset::open_with(&tar_files, tar_options).expect("tar");
        let m = MdsDataset::open_with(&mds, options).expect("mds");
        let (pf, tf, mf) = (files_of(&p, &packed), tar_files.clone(), files_of(&m, &mds));
        vec![
            ("packed", Box::new(p), pf),
            ("tar", Box::new(t), tf),
            ("mds", Box::new(m), mf),
        ]
    };
    let mut buf = vec![0u8; 1 << 20];
    let sets: Vec<_> = open(256)
        .into_iter()
        .zip(open(2))
        .map(|((name, d, files), (_, remap, _))| (name, d, remap, files))
        .collect();
    // The page cache as reading from disk leaves it, the same for every format: each file's
    // cached pages dropped (GNU dd's `iflag=nocache`: posix_fadvise DONTNEED), then read
    // once. Pages left by the writers differ (many small writes leave small folios, slower
    // to fault in and to read than the large ones readahead makes).
    // Written back first: dirty pages cannot be dropped.
    let synced = std::process::Command::new("sync")
        .status()
        .is_ok_and(|s| s.success());
    assert!(synced, "sync failed");
    for (_, _, _, files) in &sets {
        drop_cached(files);
        read_all(files, &mut buf);
    }

    // Interleaved passes first: the VM is shared, so the ratios are taken from passes that
    // alternate (read, get, get-remap), medians of 15 rounds.
    eprintln!("interleaved passes, median of 15 rounds (GiB/s; % of read):");
    for (name, d, remap, files) in &sets {
        let gib = |bytes: u64, secs: f64| bytes as f64 / secs / f64::from(1u32 << 30);
        let mut times = [vec![], vec![], vec![]];
        let (mut file_bytes, mut sample_bytes) = (0, 0);
        read_all(files, &mut buf);
        get_all(&**d, &mut buf);
        for _ in 0..15 {
            let t = std::time::Instant::now();
            file_bytes = read_all(files, &mut buf);
            times[0].push(t.elapsed().as_secs_f64());
            for (k, set) in [&**d, &**remap].into_iter().enumerate() {
                let t = std::time::Instant::now();
                sample_bytes = get_all(set, &mut buf);
                times[k + 1].push(t.elapsed().as_secs_f64());
            }
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let read = gib(file_bytes, median(&mut times[0]));
        let rates: Vec<f64> = times[1..]
            .iter_mut()
            .map(|t| gib(sample_bytes, median(t)))
            .collect();
        eprintln!(
            "  {name:6} read {read:5.2} | get {:5.2} ({:3.0}%) | get-remap {:5.2} ({:3.0}%)",
            rates[0],
            100.0 * rates[0] / read,
            rates[1],
            100.0 * rates[1] / read,
        );
    }

    check_cost(&packed, &mds, &mut buf, 15);

    let mut g = c.benchmark_group("shard_read");
    g.sample_size(20);
    // Per format, the variants one after the other, so that their ratio is measured under
    // similar load.
    for (name, d, remap, files) in &sets {
        let file_bytes: u64 = files
            .iter()
            .map(|p| std::fs::metadata(p).expect("stat").len())
            .sum();
        let sample_bytes = get_all(&**d, &mut buf);
        g.throughput(Throughput::Bytes(file_bytes));
        g.bench_function(format!("read/{name}"), |b| {
            b.iter(|| read_all(files, &mut buf))
        });
        g.throughput(Throughput::Bytes(sample_bytes));
        g.bench_function(format!("get/{name}"), |b| {
            b.iter(|| get_all(&**d, &mut buf))
        });
        g.bench_function(format!("get-remap/{name}"), |b| {
            b.iter(|| get_all(&**remap, &mut buf))
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
