//! Streaming from an S3 server against a plain parallel downloader of the same objects, in
//! one run (figures in benches/RESULTS.md, "Streaming").
//!
//! ```sh
//! AWS_ENDPOINT_URL=http://127.0.0.1:9000 AWS_ACCESS_KEY_ID=x AWS_SECRET_ACCESS_KEY=x \
//! AWS_REGION=us-east-1 AWS_ALLOW_HTTP=true \
//! cargo bench --features s3 --bench s3_stream -- --dir /data/s3 --bucket bench \
//!     --format mds --shards 16 --shard-mib 64 --rounds 3 [--upload] [--first-batch-only] \
//!     [--parallel 16] [--part-mib 8] [--prefetch-shards N] [--read-ahead BATCHES] [--pause S]
//!     [--verify on|off|both]
//! ```
//!
//! It writes `--shards` shards of about `--shard-mib` MiB (`--format mds`: MDS with an
//! xxh3-64 per shard in the index, samples a 147 KiB `image` tensor and an `int` label;
//! `packed`: packed shards) under `DIR/BUCKET/FORMAT-SHARDSxMIB/` unless they are there, and
//! with `--upload` puts them into the bucket (for servers that do not serve a directory:
//! moto). Then, `--rounds` times, alternately:
//!
//! - *download*: every object of the data set by ranged GETs of `--part-mib`, at most
//!   `--parallel` at once (object_store, as the store, bytes dropped): the plain downloader;
//! - *loader*: the data set opened from its URL with an empty cache, one epoch through the
//!   loader in the two-level shuffle's order (windows of 8 shards, blocks of 64 samples, two
//!   workers), every byte fetched into the cache; the time to the first batch is from the
//!   open (index fetched) on.
//!
//! and prints one JSON line per pass and the ratios. `--first-batch-only` stops each loader
//! pass after its first batch (for the first-batch target over a large data set).
//! `--parallel` and `--part-mib` set both the downloader's and the loader's requests in flight
//! and part size; `--prefetch-shards` and `--read-ahead` the loader's prefetch (default: the
//! library's defaults, 4 shards and 64 batches). `--pause` waits that many seconds before each
//! loader pass, so that the server is done with the requests the pass before dropped.
//! `--verify` sets `RemoteOptions::verify_checksums` (default `on`: every shard checked whole
//! against the index's xxh3-64 before it is read; `off`: shards read as they arrive); `both`
//! makes two loader passes a round, checked and not, in alternating order, each with the
//! download's time for its ratio.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use gpufeed::format::{DType, Field, Schema};
use gpufeed::source::shards::ShardedSource;
use gpufeed::source::shards::packed::ShardWriter;
use gpufeed::source::shards::remote::{RemoteOptions, open_url_with};
use gpufeed::source::shards::webdataset::WebDatasetOptions;
use gpufeed::{Dataset, Loader};
use object_store::aws::AmazonS3Builder;
use object_store::{ClientOptions, GetOptions, GetRange, ObjectStore, ObjectStoreExt, PutPayload};

const IMAGE: usize = 3 * 224 * 224;

struct Args {
    dir: PathBuf,
    bucket: String,
    format: String,
    shards: usize,
    shard_mib: usize,
    rounds: usize,
    parallel: usize,
    part_mib: u64,
    upload: bool,
    first_batch_only: bool,
    /// `RemoteOptions::prefetch_shards` and `read_ahead_batches` (None: the defaults).
    prefetch_shards: Option<usize>,
    read_ahead: Option<usize>,
    /// Seconds to wait before each loader pass, so that the server has finished the
    /// requests of the pass before (a server goes on sending a body the client dropped).
    pause: f64,
    /// `RemoteOptions::verify_checksums` of the loader passes of a round, in order.
    verify: Vec<bool>,
}

fn args() -> Args {
    let mut a = Args {
        dir: std::env::temp_dir().join("gpufeed-s3-bench"),
        bucket: "bench".into(),
        format: "mds".into(),
        shards: 16,
        shard_mib: 64,
        rounds: 3,
        parallel: 16,
        part_mib: 8,
        upload: false,
        first_batch_only: false,
        prefetch_shards: None,
        read_ahead: None,
        pause: 0.0,
        verify: vec![true],
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_default();
        match flag.as_str() {
            "--dir" => a.dir = PathBuf::from(value()),
            "--bucket" => a.bucket = value(),
            "--format" => a.format = value(),
            "--shards" => a.shards = value().parse().unwrap_or(a.shards),
            "--shard-mib" => a.shard_mib = value().parse().unwrap_or(a.shard_mib),
            "--rounds" => a.rounds = value().parse().unwrap_or(a.rounds),
            "--parallel" => a.parallel = value().parse().unwrap_or(a.parallel),
            "--part-mib" => a.part_mib = value().parse().unwrap_or(a.part_mib),
            "--upload" => a.upload = true,
            "--first-batch-only" => a.first_batch_only = true,
            "--prefetch-shards" => a.prefetch_shards = value().parse().ok(),
            "--read-ahead" => a.read_ahead = value().parse().ok(),
            "--pause" => a.pause = value().parse().unwrap_or(a.pause),
            "--verify" => {
                a.verify = match value().as_str() {
                    "on" => vec![true],
                    "off" => vec![false],
                    "both" => vec![true, false],
                    other => panic!("--verify {other}: on, off or both"),
                }
            }
            // cargo bench passes --bench.
            _ => {}
        }
    }
    a
}

fn image(i: usize, out: &mut [u8]) {
    let mut s = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for c in out.chunks_mut(8) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        c.copy_from_slice(&s.to_le_bytes()[..c.len()]);
    }
}

/// MDS shards as MDSWriter lays them out (fixed columns only: no size prefixes), with the
/// xxh3-64 of each shard in the index.
fn write_mds(dir: &Path, shards: usize, per: usize) {
    let mut entries = Vec::new();
    let mut buf = vec![0u8; IMAGE];
    for k in 0..shards {
        let config = format!(
            r#"{{"column_encodings": ["ndarray:uint8:{IMAGE}", "int"], "column_names": ["image", "label"]}}"#
        );
        let head = 4 + 4 * (per + 1) + config.len();
        let mut file = Vec::with_capacity(head + per * (IMAGE + 8));
        file.extend_from_slice(&(per as u32).to_le_bytes());
        for i in 0..=per {
            file.extend_from_slice(&((head + i * (IMAGE + 8)) as u32).to_le_bytes());
        }
        file.extend_from_slice(config.as_bytes());
        for i in 0..per {
            let n = k * per + i;
            image(n, &mut buf);
            file.extend_from_slice(&buf);
            file.extend_from_slice(&(n as i64).to_le_bytes());
        }
        let name = format!("shard.{k:05}.mds");
        std::fs::write(dir.join(&name), &file).expect("write mds");
        entries.push(serde_json::json!({
            "format": "mds", "version": 2, "samples": per,
            "column_names": ["image", "label"],
            "column_encodings": [format!("ndarray:uint8:{IMAGE}"), "int"],
            "column_sizes": [IMAGE, 8], "compression": null, "hashes": ["xxh3_64"],
            "raw_data": {"basename": name, "bytes": file.len(),
                         "hashes": {"xxh3_64": format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&file))}},
            "zip_data": null
        }));
    }
    let index = serde_json::json!({"version": 2, "shards": entries});
    std::fs::write(
        dir.join("index.json"),
        serde_json::to_vec(&index).expect("json"),
    )
    .expect("write index");
}

fn write_packed(dir: &Path, shards: usize, per: usize, shard_mib: usize) {
    let schema = Schema::new(vec![
        Field::tensor("image", DType::U8, &[IMAGE as u64]),
        Field::tensor("label", DType::I64, &[]),
    ])
    .expect("schema");
    let mut w =
        ShardWriter::create(dir, schema, ((shard_mib as u64) << 20) + (1 << 20)).expect("writer");
    let mut buf = vec![0u8; IMAGE];
    for n in 0..shards * per {
        image(n, &mut buf);
        w.append(&[&buf, &(n as i64).to_le_bytes()])
            .expect("append");
    }
    w.finish().expect("finish");
}

fn store(bucket: &str) -> Arc<dyn ObjectStore> {
    let allow = std::env::var("AWS_ALLOW_HTTP").is_ok_and(|v| v == "true");
    Arc::new(
        AmazonS3Builder::from_env()
            .with_bucket_name(bucket)
            .with_client_options(
                ClientOptions::new()
                    .with_allow_http(allow)
                    .with_timeout(Duration::from_secs(120)),
            )
            .build()
            .expect("S3 client from the AWS_* variables"),
    )
}

/// The plain downloader: every object by ranged GETs of `part` bytes, `parallel` at once,
/// bytes dropped. Returns (bytes, seconds).
async fn download(
    s: Arc<dyn ObjectStore>,
    keys: Vec<(String, u64)>,
    part: u64,
    parallel: usize,
) -> (u64, f64) {
    let t = Instant::now();
    let mut ranges = Vec::new();
    for (k, size) in &keys {
        let mut at = 0;
        while at < *size {
            ranges.push((k.clone(), at..(at + part).min(*size)));
            at += part;
        }
    }
    let total: u64 = futures_util::stream::iter(ranges)
        .map(|(k, r)| {
            let s = Arc::clone(&s);
            async move {
                let o = GetOptions {
                    range: Some(GetRange::Bounded(r)),
                    ..GetOptions::default()
                };
                let mut body = s
                    .get_opts(&k.as_str().into(), o)
                    .await
                    .expect("get")
                    .into_stream();
                let mut n = 0u64;
                while let Some(c) = body.next().await {
                    n += c.expect("body").len() as u64;
                }
                n
            }
        })
        .buffer_unordered(parallel)
        .fold(0u64, |a, n| async move { a + n })
        .await;
    (total, t.elapsed().as_secs_f64())
}

/// One loader pass over the data set at `url` with an empty cache and checks on or off:
/// prints its line; returns its time unless it stopped at the first batch.
fn loader_pass(a: &Args, url: &str, round: usize, verify: bool, per: usize) -> Option<f64> {
    let cache = tempfile::tempdir_in(&a.dir).expect("cache dir");
    std::thread::sleep(Duration::from_secs_f64(a.pause));
    let t = Instant::now();
    let defaults = RemoteOptions::from_env().expect("options");
    let o = RemoteOptions {
        cache_dir: Some(cache.path().to_path_buf()),
        part_bytes: a.part_mib << 20,
        max_requests: a.parallel,
        prefetch_shards: a.prefetch_shards.unwrap_or(defaults.prefetch_shards),
        read_ahead_batches: a.read_ahead.unwrap_or(defaults.read_ahead_batches),
        verify_checksums: verify,
        ..defaults
    };
    let d: Arc<dyn ShardedSource> =
        Arc::from(open_url_with(url, &WebDatasetOptions::default(), o).expect("open"));
    let opened = t.elapsed().as_secs_f64();
    let dataset: Arc<dyn Dataset> = Arc::clone(&d) as Arc<dyn Dataset>;
    let mut loader = Loader::builder_shared(dataset)
        .batch_size(64)
        .shuffle(round as u64)
        .shuffle_blocks(8, 64)
        .workers(2)
        .build()
        .expect("loader");
    let mut first = None;
    let mut samples = 0u64;
    for b in loader.by_ref() {
        let b = b.expect("batch");
        samples += b.len() as u64;
        if first.is_none() {
            first = Some(t.elapsed().as_secs_f64());
            if a.first_batch_only {
                break;
            }
        }
    }
    let secs = t.elapsed().as_secs_f64();
    drop(loader);
    let stats = d.store_stats().unwrap_or_default();
    println!(
        "{{\"round\": {round}, \"pass\": \"loader\", \"checks\": {verify}, \"samples\": {samples}, \"open_s\": {opened:.3}, \"first_batch_s\": {:.3}, \"seconds\": {secs:.3}, \"mib_per_s\": {:.1}, \"store\": \"{stats}\"}}",
        first.unwrap_or(f64::NAN),
        stats.bytes_fetched as f64 / secs / (1 << 20) as f64
    );
    if a.first_batch_only {
        return None;
    }
    assert_eq!(samples, (a.shards * per) as u64, "every sample once");
    Some(secs)
}

fn main() {
    let a = args();
    let per = (a.shard_mib << 20) / (IMAGE + 8);
    let name = format!("{}-{}x{}", a.format, a.shards, a.shard_mib);
    let data = a.dir.join(&a.bucket).join(&name);
    if !data.join("index.json").exists() {
        std::fs::create_dir_all(&data).expect("data dir");
        eprintln!(
            "writing {} shards of {} samples into {}",
            a.shards,
            per,
            data.display()
        );
        match a.format.as_str() {
            "mds" => write_mds(&data, a.shards, per),
            "packed" => write_packed(&data, a.shards, per, a.shard_mib),
            other => panic!("--format {other}: mds or packed"),
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let s = store(&a.bucket);
    let mut files: Vec<(String, u64)> = std::fs::read_dir(&data)
        .expect("list")
        .map(|e| {
            let e = e.expect("entry");
            (
                format!("{name}/{}", e.file_name().to_string_lossy()),
                e.metadata().expect("stat").len(),
            )
        })
        .collect();
    files.sort();
    if a.upload {
        eprintln!("uploading {} objects", files.len());
        for (k, _) in &files {
            let bytes = std::fs::read(a.dir.join(&a.bucket).join(k)).expect("read");
            rt.block_on(s.put(&k.as_str().into(), PutPayload::from(bytes)))
                .expect("put");
        }
    }
    let total: u64 = files.iter().map(|(_, n)| n).sum();
    let url = format!("s3://{}/{name}", a.bucket);
    let mut ratios = Vec::new();
    for round in 0..a.rounds {
        let (bytes, secs_of_download) = if a.first_batch_only {
            (0, 0.0)
        } else {
            rt.block_on(download(
                Arc::clone(&s),
                files.clone(),
                a.part_mib << 20,
                a.parallel,
            ))
        };
        if !a.first_batch_only {
            assert_eq!(bytes, total, "the downloader got every byte");
            println!(
                "{{\"round\": {round}, \"pass\": \"download\", \"bytes\": {bytes}, \"seconds\": {secs_of_download:.3}, \"mib_per_s\": {:.1}}}",
                bytes as f64 / secs_of_download / (1 << 20) as f64
            );
        }
        // Checked and not in alternating order, round after round.
        let mut passes = a.verify.clone();
        if round % 2 == 1 {
            passes.reverse();
        }
        for verify in passes {
            let secs = loader_pass(&a, &url, round, verify, per);
            if let Some(secs) = secs {
                // The same bytes both ways: the ratio of rates is the ratio of times.
                let ratio = secs_of_download / secs;
                println!(
                    "{{\"round\": {round}, \"checks\": {verify}, \"loader_over_download\": {ratio:.3}}}"
                );
                ratios.push((verify, ratio));
            }
        }
    }
    for checks in [true, false] {
        let mut of: Vec<f64> = ratios
            .iter()
            .filter(|(v, _)| *v == checks)
            .map(|(_, r)| *r)
            .collect();
        if of.is_empty() {
            continue;
        }
        of.sort_by(f64::total_cmp);
        println!(
            "{{\"checks\": {checks}, \"ratios\": {of:?}, \"median\": {:.3}}}",
            of[of.len() / 2]
        );
    }
}
