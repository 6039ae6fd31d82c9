//! Shards from a real S3 server: moto's, started by each test on 127.0.0.1 (see
//! tests/s3_common for how a missing moto fails in CI and skips elsewhere). Shards read back
//! whole through the loader; a proxy that fails or cuts 10% of the requests loses and repeats
//! nothing, and every retry is counted; processes on one machine share one download; a killed
//! reader leaves no half shard; bad input is a typed error naming the shard (and sample).
#![cfg(feature = "s3")]

use crate::s3_common;

use std::collections::HashSet;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::tar_common::TarBuilder;
use gpufeed::BatchStream;
use gpufeed::format::{DType, Field, Schema};
use gpufeed::source::shards::ShardedSource;
use gpufeed::source::shards::packed::ShardWriter;
use gpufeed::source::shards::remote::{RemoteOptions, open_url_with};
use gpufeed::source::shards::webdataset::WebDatasetOptions;
use gpufeed::{Dataset, Error, Loader, RemoteErrorKind, Result};
use s3_common::{FaultProxy, create_bucket, moto, put, put_dir};

const RECORD: usize = 3000;

fn record(i: u32) -> Vec<u8> {
    (0..RECORD)
        .map(|k| (i as usize * 131 + k * 7) as u8)
        .collect()
}

/// `n` records (label u32, data u8[3000]) as packed shards of about `shard_bytes` in `dir`.
fn write_packed(dir: &Path, n: u32, shard_bytes: u64) -> usize {
    let schema = Schema::new(vec![
        Field::tensor("label", DType::U32, &[]),
        Field::tensor("data", DType::U8, &[RECORD as u64]),
    ])
    .unwrap();
    let mut w = ShardWriter::create(dir, schema, shard_bytes).unwrap();
    for i in 0..n {
        w.append(&[&i.to_le_bytes(), &record(i)]).unwrap();
    }
    w.finish().unwrap().shards.len()
}

/// `shards` tar shards of `per` samples (`NNNNNN.data`, `NNNNNN.label`) in `dir`.
fn write_tars(dir: &Path, shards: u32, per: u32) {
    for s in 0..shards {
        let mut t = TarBuilder::new();
        for i in 0..per {
            let n = s * per + i;
            t.file(&format!("{n:06}.data"), &record(n));
            t.file(&format!("{n:06}.label"), &n.to_le_bytes());
        }
        std::fs::write(dir.join(format!("shard-{s:04}.tar")), t.finish()).unwrap();
    }
}

/// `shards` MDS shards of `per` samples each (columns `data`: `ndarray:uint8:3000`, the
/// record, and `label`: `uint32`, as MDSWriter lays them out) in `dir`, with an `index.json`
/// giving each shard's xxh3-64 when `hashed`. Every sample has the same size, so every shard
/// does.
fn write_mds(dir: &Path, shards: u32, per: u32, hashed: bool) {
    let names = serde_json::json!(["data", "label"]);
    let encodings = serde_json::json!([format!("ndarray:uint8:{RECORD}"), "uint32"]);
    let sizes = serde_json::json!([RECORD, 4]);
    let hashes = if hashed {
        serde_json::json!(["xxh3_64"])
    } else {
        serde_json::json!([])
    };
    let config = serde_json::to_vec(&serde_json::json!({
        "column_encodings": encodings, "column_names": names, "column_sizes": sizes,
        "compression": null, "format": "mds", "hashes": hashes, "size_limit": 1 << 26,
        "version": 2,
    }))
    .unwrap();
    let mut entries = Vec::new();
    for s in 0..shards {
        let table = 4 + 4 * (per as usize + 1);
        let data_start = table + config.len();
        let mut b = Vec::new();
        b.extend(per.to_le_bytes());
        for i in 0..=per as usize {
            b.extend(((data_start + i * (RECORD + 4)) as u32).to_le_bytes());
        }
        b.extend(&config);
        for i in 0..per {
            let n = s * per + i;
            b.extend(record(n));
            b.extend(n.to_le_bytes());
        }
        let name = format!("shard.{s:05}.mds");
        let mut raw = serde_json::json!({"basename": name, "bytes": b.len(), "hashes": {}});
        if hashed {
            raw["hashes"]["xxh3_64"] = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&b)).into();
        }
        entries.push(serde_json::json!({
            "column_encodings": encodings, "column_names": names, "column_sizes": sizes,
            "compression": null, "format": "mds", "hashes": hashes, "raw_data": raw,
            "samples": per, "size_limit": 1 << 26, "version": 2, "zip_data": null,
        }));
        std::fs::write(dir.join(&name), b).unwrap();
    }
    let index = serde_json::json!({"version": 2, "shards": entries});
    std::fs::write(dir.join("index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
}

fn options(cache: &Path, endpoint: &str) -> RemoteOptions {
    let setting = |k: &str, v: &str| (k.to_owned(), v.to_owned());
    RemoteOptions {
        cache_dir: Some(cache.to_path_buf()),
        // Several parts per shard, so that shards arrive in pieces and are read as they do.
        part_bytes: 32 << 10,
        backoff: Duration::from_millis(2),
        max_backoff: Duration::from_millis(20),
        retries: 12,
        request_timeout: Duration::from_secs(20),
        settings: vec![
            setting("aws_endpoint", endpoint),
            setting("aws_allow_http", "true"),
            setting("aws_access_key_id", "testing"),
            setting("aws_secret_access_key", "testing"),
            setting("aws_region", "us-east-1"),
        ],
        ..RemoteOptions::default()
    }
}

fn wds(index_cache: &Path) -> WebDatasetOptions {
    WebDatasetOptions {
        cache_dir: Some(index_cache.to_path_buf()),
        ..WebDatasetOptions::default()
    }
}

/// Reads one epoch in the two-level shuffle's order and checks that every sample came once,
/// intact (`label` field, then `data`).
fn read_epoch(data: Arc<dyn ShardedSource>, n: u32) {
    let dataset: Arc<dyn Dataset> = data;
    let mut loader = Loader::builder_shared(dataset)
        .batch_size(32)
        .shuffle(11)
        .shuffle_blocks(4, 16)
        .workers(3)
        .build()
        .unwrap();
    let mut seen = HashSet::new();
    for b in loader.by_ref() {
        let b = b.unwrap();
        let labels = b.field::<u32>("label").unwrap().to_vec();
        let data = b.field_bytes("data").unwrap();
        for (slot, &label) in labels.iter().enumerate() {
            assert!(seen.insert(label), "sample {label} came twice");
            assert!(
                data[slot * RECORD..(slot + 1) * RECORD] == record(label)[..],
                "sample {label} is not what was written"
            );
        }
    }
    assert_eq!(seen.len(), n as usize, "samples lost");
}

/// Tar shards have bytes fields: read each sample by `get` in the loader's order instead.
fn read_tar_epoch(data: &dyn ShardedSource, n: u32) {
    let mut seen = HashSet::new();
    for i in 0..data.len() {
        let s = data.get(i).unwrap();
        let label = u32::from_le_bytes(s.field_named("label").unwrap().try_into().unwrap());
        assert!(seen.insert(label), "sample {label} came twice");
        assert!(
            s.field_named("data").unwrap() == &record(label)[..],
            "sample {label} is not what was written"
        );
    }
    assert_eq!(seen.len(), n as usize);
}

fn remote_kind(e: &Error) -> (RemoteErrorKind, String) {
    match e {
        Error::Remote { kind, shard, .. } => (*kind, shard.display().to_string()),
        Error::Sample { source, .. } => remote_kind(source),
        other => panic!("not a remote error: {other:?}"),
    }
}

#[test]
fn packed_and_tar_shards_read_back_once_each() {
    let Some(server) = moto(false) else { return };
    let (data, tars, cache, idx) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let shards = write_packed(data.path(), 400, 160 << 10);
    write_tars(tars.path(), 5, 40);
    create_bucket(server.port, "data");
    put_dir(server.port, "data", "packed", data.path());
    put_dir(server.port, "data", "tars", tars.path());
    let packed = open_url_with(
        "s3://data/packed/",
        &WebDatasetOptions::default(),
        options(cache.path(), &server.endpoint()),
    )
    .unwrap();
    let packed: Arc<dyn ShardedSource> = Arc::from(packed);
    read_epoch(Arc::clone(&packed), 400);
    let s = packed.store_stats().unwrap();
    assert_eq!(s.cache_misses, shards as u64, "{s}");
    assert_eq!(s.retries, 0, "{s}");
    let tar = open_url_with(
        "s3://data/tars",
        &wds(idx.path()),
        options(cache.path(), &server.endpoint()),
    )
    .unwrap();
    read_tar_epoch(&*tar, 200);
    assert_eq!(tar.store_stats().unwrap().cache_misses, 5);
}

#[test]
fn faults_on_10_percent_of_requests_lose_and_repeat_nothing_and_every_retry_is_counted() {
    let Some(server) = moto(false) else { return };
    let (data, tars, cache, idx) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    write_packed(data.path(), 600, 200 << 10);
    write_tars(tars.path(), 6, 50);
    create_bucket(server.port, "faulty");
    put_dir(server.port, "faulty", "packed", data.path());
    put_dir(server.port, "faulty", "tars", tars.path());
    let proxy = FaultProxy::start(server.port, 10);
    let packed = open_url_with(
        "s3://faulty/packed",
        &WebDatasetOptions::default(),
        options(cache.path(), &proxy.endpoint()),
    )
    .unwrap();
    let packed: Arc<dyn ShardedSource> = Arc::from(packed);
    read_epoch(Arc::clone(&packed), 600);
    let tar = open_url_with(
        "s3://faulty/tars",
        &wds(idx.path()),
        options(cache.path(), &proxy.endpoint()),
    )
    .unwrap();
    read_tar_epoch(&*tar, 300);
    let (a, b) = (packed.store_stats().unwrap(), tar.store_stats().unwrap());
    let c = &proxy.counts;
    let (requests, failed, cut) = (
        c.requests.load(Ordering::Relaxed),
        c.failed.load(Ordering::Relaxed),
        c.cut.load(Ordering::Relaxed),
    );
    eprintln!("proxy: {requests} requests, {failed} failed, {cut} cut\npacked: {a}\ntar: {b}");
    assert!(
        failed > 0 && cut > 0,
        "the proxy injected no fault of some kind"
    );
    assert!(
        (failed + cut) * 100 >= requests * 5,
        "fewer faults than expected"
    );
    assert_eq!(a.requests + b.requests, requests, "every request counted");
    assert_eq!(a.retries + b.retries, failed + cut, "every retry counted");
}

#[test]
fn requests_that_hang_time_out_and_are_retried() {
    let Some(server) = moto(false) else { return };
    let (data, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    write_packed(data.path(), 200, 200 << 10);
    create_bucket(server.port, "hangs");
    put_dir(server.port, "hangs", "p", data.path());
    let proxy = FaultProxy::stalling(server.port, 8, Duration::from_secs(3));
    let o = RemoteOptions {
        request_timeout: Duration::from_secs(1),
        ..options(cache.path(), &proxy.endpoint())
    };
    let d = open_url_with("s3://hangs/p", &WebDatasetOptions::default(), o).unwrap();
    let d: Arc<dyn ShardedSource> = Arc::from(d);
    read_epoch(Arc::clone(&d), 200);
    let s = d.store_stats().unwrap();
    let stalled = proxy.counts.stalled.load(Ordering::Relaxed);
    assert!(stalled > 0, "no request hung");
    // Each hung request timed out and was sent again (a slow answer on a loaded machine may
    // time out too: at least as many).
    assert!(s.retries >= stalled, "{s}: {stalled} hung");
}

#[test]
fn a_bucket_that_does_not_exist_is_an_error_naming_it() {
    let Some(server) = moto(false) else { return };
    let cache = tempfile::tempdir().unwrap();
    let e = open_url_with(
        "s3://no-such-bucket/shards",
        &WebDatasetOptions::default(),
        options(cache.path(), &server.endpoint()),
    )
    .map(|_| ())
    .unwrap_err();
    let (kind, shard) = remote_kind(&e);
    assert_eq!(kind, RemoteErrorKind::NoSuchBucket, "{e}");
    assert!(shard.starts_with("s3://no-such-bucket/shards"), "{e}");
}

#[test]
fn refused_credentials_are_an_error_naming_the_shard() {
    let Some(server) = moto(true) else { return };
    let cache = tempfile::tempdir().unwrap();
    let e = open_url_with(
        "s3://data/shards",
        &WebDatasetOptions::default(),
        options(cache.path(), &server.endpoint()),
    )
    .map(|_| ())
    .unwrap_err();
    let (kind, shard) = remote_kind(&e);
    assert_eq!(kind, RemoteErrorKind::AccessDenied, "{e}");
    assert!(shard.starts_with("s3://data/shards"), "{e}");
}

#[test]
fn a_missing_shard_and_a_full_cache_are_errors_naming_the_shard_and_sample() {
    let Some(server) = moto(false) else { return };
    let (data, cache, small) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    write_packed(data.path(), 200, 100 << 10);
    create_bucket(server.port, "holes");
    // The index names it; the bucket does not have it.
    let missing = data.path().join("shard-000001.gfd");
    let kept = std::fs::read(&missing).unwrap();
    std::fs::remove_file(&missing).unwrap();
    put_dir(server.port, "holes", "p", data.path());
    std::fs::write(&missing, kept).unwrap();
    let d = open_url_with(
        "s3://holes/p",
        &WebDatasetOptions::default(),
        options(cache.path(), &server.endpoint()),
    )
    .unwrap();
    let start = d.shard_start(1).unwrap();
    let d: Arc<dyn ShardedSource> = Arc::from(d);
    let dataset: Arc<dyn Dataset> = d;
    let mut loader = Loader::builder_shared(dataset)
        .batch_size(16)
        .build()
        .unwrap();
    let e = loader
        .by_ref()
        .find_map(|b| b.err())
        .expect("a batch fails");
    match &e {
        Error::Sample { index, .. } => assert_eq!(*index, start, "{e}"),
        other => panic!("not a sample error: {other:?}"),
    }
    let (kind, shard) = remote_kind(&e);
    assert_eq!(kind, RemoteErrorKind::NotFound, "{e}");
    assert_eq!(shard, "s3://holes/p/shard-000001.gfd");

    let tiny = RemoteOptions {
        cache_limit: 10 << 10,
        ..options(small.path(), &server.endpoint())
    };
    let d = open_url_with("s3://holes/p", &WebDatasetOptions::default(), tiny).unwrap();
    let e = d.get(0).map(|_| ()).unwrap_err();
    let (kind, shard) = remote_kind(&e);
    assert_eq!(kind, RemoteErrorKind::CacheFull, "{e}");
    assert_eq!(shard, "s3://holes/p/shard-000000.gfd");
    assert_eq!(d.store_stats().unwrap().cache_full, 1);
}

/// The child side of the multi-process tests: reads every sample of the dataset named by the
/// environment, prints its store's counts. Run by the tests below, not by itself.
#[test]
#[ignore = "run as a child process by the multi-process tests"]
fn child_reader() -> Result<()> {
    let (Ok(url), Ok(cache), Ok(endpoint)) = (
        std::env::var("GPUFEED_TEST_URL"),
        std::env::var("GPUFEED_TEST_CACHE"),
        std::env::var("GPUFEED_TEST_ENDPOINT"),
    ) else {
        return Ok(());
    };
    let o = RemoteOptions {
        part_bytes: 16 << 10,
        ..options(Path::new(&cache), &endpoint)
    };
    let d = open_url_with(&url, &WebDatasetOptions::default(), o)?;
    for i in 0..d.len() {
        d.get(i)?;
    }
    let s = d.store_stats().unwrap_or_default();
    println!(
        "STATS misses={} hits={} shared={}",
        s.cache_misses, s.cache_hits, s.shared_downloads
    );
    Ok(())
}

fn child(url: &str, cache: &Path, endpoint: &str) -> Command {
    let mut c = Command::new(std::env::current_exe().unwrap());
    // The helper test by its full name in this binary (tests/tests.rs: module `remote_s3`).
    c.args([
        "--exact",
        "remote_s3::child_reader",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("GPUFEED_TEST_URL", url)
    .env("GPUFEED_TEST_CACHE", cache)
    .env("GPUFEED_TEST_ENDPOINT", endpoint);
    c
}

#[test]
fn processes_on_one_machine_fetch_each_shard_once() {
    let Some(server) = moto(false) else { return };
    let (data, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let shards = write_packed(data.path(), 300, 120 << 10) as u64;
    create_bucket(server.port, "shared");
    put_dir(server.port, "shared", "p", data.path());
    // A slow server, so that the processes overlap.
    let proxy = FaultProxy::start_with(server.port, 0, Duration::from_millis(20));
    let children: Vec<_> = (0..3)
        .map(|_| {
            child("s3://shared/p", cache.path(), &proxy.endpoint())
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let (mut misses, mut hits) = (0, 0);
    for c in children {
        let out = c.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "child failed: {text}");
        let line = text
            .lines()
            .find_map(|l| l.split_once("STATS ").map(|(_, v)| v))
            .unwrap_or_else(|| panic!("no stats: {text}"));
        let get = |k: &str| -> u64 {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(&format!("{k}=")))
                .and_then(|v| v.parse().ok())
                .unwrap()
        };
        misses += get("misses");
        hits += get("hits");
    }
    assert_eq!(
        misses, shards,
        "each shard fetched once over the three processes"
    );
    assert_eq!(hits, 2 * shards, "the other two read it from the cache");
}

#[test]
fn a_reader_killed_mid_fetch_leaves_no_half_shard() {
    let Some(server) = moto(false) else { return };
    let (data, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    write_packed(data.path(), 300, 400 << 10);
    create_bucket(server.port, "killed");
    put_dir(server.port, "killed", "p", data.path());
    let proxy = FaultProxy::start_with(server.port, 0, Duration::from_millis(30));
    let mut c = child("s3://killed/p", cache.path(), &proxy.endpoint())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Kill it once a fetch is under way.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !files(cache.path()).iter().any(|f| f.contains(".part-")) {
        assert!(Instant::now() < deadline, "no fetch started");
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(100));
    c.kill().unwrap();
    c.wait().unwrap();
    // Whatever is in the cache under a shard's name is that shard, whole.
    for f in files(cache.path()) {
        if f.contains(".part-") || f.ends_with(".lock") {
            continue;
        }
        let name = Path::new(&f)
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let shard = name.split('~').next().unwrap();
        assert_eq!(
            std::fs::read(&f).unwrap(),
            std::fs::read(data.path().join(shard)).unwrap(),
            "{f} is not whole"
        );
    }
    // A new reader takes over (the killed one's lock is free) and reads everything.
    let d = open_url_with(
        "s3://killed/p",
        &WebDatasetOptions::default(),
        options(cache.path(), &server.endpoint()),
    )
    .unwrap();
    let d: Arc<dyn ShardedSource> = Arc::from(d);
    read_epoch(d, 300);
    let left: Vec<String> = files(cache.path())
        .into_iter()
        .filter(|f| f.contains(".part-"))
        .collect();
    // The killed process's temporary file goes when the cache next makes room.
    assert!(left.is_empty(), "temporary files left: {left:?}");
}

fn files(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            out.extend(files(&e.path()));
        } else {
            out.push(e.path().display().to_string());
        }
    }
    out
}

#[test]
fn a_single_object_put_is_readable_as_one_tar_shard() {
    let Some(server) = moto(false) else { return };
    let (tars, cache, idx) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    write_tars(tars.path(), 1, 30);
    create_bucket(server.port, "one");
    put(
        server.port,
        "one",
        "x/only.tar",
        &std::fs::read(tars.path().join("shard-0000.tar")).unwrap(),
    );
    let d = open_url_with(
        "s3://one/x/only.tar",
        &wds(idx.path()),
        options(cache.path(), &server.endpoint()),
    )
    .unwrap();
    read_tar_epoch(&*d, 30);
}

/// Runs one epoch of `loader` and returns the labels delivered (with the batch each came in)
/// and the errors, in order.
fn labels_and_errors(loader: &mut Loader) -> (Vec<u32>, Vec<Error>) {
    let (mut labels, mut errors) = (Vec::new(), Vec::new());
    for b in loader.by_ref() {
        match b {
            Ok(b) => {
                let data = b.field_bytes("data").unwrap();
                for (slot, &label) in b.field::<u32>("label").unwrap().iter().enumerate() {
                    assert!(
                        data[slot * RECORD..(slot + 1) * RECORD] == record(label)[..],
                        "sample {label} is not what was written"
                    );
                    labels.push(label);
                }
            }
            Err(e) => errors.push(e),
        }
    }
    (labels, errors)
}

/// An MDS shard whose object is another shard's bytes (same size: only the index's xxh3-64
/// tells them apart) yields no sample, in any epoch: its batches are errors naming the shard
/// and the sample, its fetches are counted as the error says, it is fetched again a bounded
/// number of times, and nothing of it is left in the cache under its name. (Before: the
/// failure was counted, and the other shard's samples delivered in its place, every epoch.)
#[test]
fn an_mds_shard_that_fails_its_checksum_yields_no_sample_in_any_epoch() {
    let Some(server) = moto(false) else { return };
    let (data, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (shards, per) = (6u32, 40u32);
    write_mds(data.path(), shards, per, true);
    let (victim, other) = (
        data.path().join("shard.00002.mds"),
        std::fs::read(data.path().join("shard.00003.mds")).unwrap(),
    );
    assert_eq!(
        other.len() as u64,
        std::fs::metadata(&victim).unwrap().len()
    );
    std::fs::write(&victim, &other).unwrap();
    create_bucket(server.port, "swapped");
    put_dir(server.port, "swapped", "m", data.path());
    let d = open_url_with(
        "s3://swapped/m",
        &WebDatasetOptions::default(),
        options(cache.path(), &server.endpoint()),
    )
    .unwrap();
    let bad = d.shard_start(2).unwrap()..d.shard_start(3).unwrap();
    let d: Arc<dyn ShardedSource> = Arc::from(d);
    let dataset: Arc<dyn Dataset> = Arc::clone(&d) as Arc<dyn Dataset>;
    let mut loader = Loader::builder_shared(dataset)
        .batch_size(8)
        .shuffle(3)
        .shuffle_blocks(2, 8)
        .workers(3)
        .build()
        .unwrap();
    let mut failures_after_epoch = Vec::new();
    for epoch in 0..2 {
        loader.set_epoch(epoch);
        let (labels, errors) = labels_and_errors(&mut loader);
        let mut seen = HashSet::new();
        for &l in &labels {
            assert!(seen.insert(l), "epoch {epoch}: sample {l} came twice");
            assert!(
                !bad.contains(&u64::from(l)),
                "epoch {epoch}: sample {l} of the bad shard"
            );
        }
        assert_eq!(
            labels.len() as u64,
            u64::from(shards * per) - (bad.end - bad.start),
            "epoch {epoch}: every other sample, once"
        );
        assert!(!errors.is_empty(), "epoch {epoch}: no batch failed");
        for e in &errors {
            let Error::Sample { index, source, .. } = e else {
                panic!("epoch {epoch}: not a sample error: {e:?}");
            };
            assert!(bad.contains(index), "epoch {epoch}: {e}");
            match &**source {
                Error::Remote { shard, kind, what } => {
                    assert_eq!(*kind, RemoteErrorKind::Checksum, "{e}");
                    assert_eq!(
                        shard.display().to_string(),
                        "s3://swapped/m/shard.00002.mds"
                    );
                    assert!(what.contains("xxh3-64"), "{e}");
                }
                other => panic!("epoch {epoch}: not a checksum error: {other:?}"),
            }
        }
        failures_after_epoch.push(d.store_stats().unwrap().checksum_failures);
    }
    let s = d.store_stats().unwrap();
    // Fetched twice with the same bytes: the object is not the index's; not fetched again in
    // the next epoch, and the error says how many fetches failed.
    assert_eq!(failures_after_epoch, [2, 2], "{s}");
    let e = d.get(bad.start).map(|_| ()).unwrap_err();
    assert!(e.to_string().contains("2 fetches"), "{e}");
    assert_eq!(d.store_stats().unwrap().checksum_failures, 2);
    let left: Vec<String> = files(cache.path())
        .into_iter()
        .filter(|f| f.contains("shard.00002") && !f.ends_with(".lock"))
        .collect();
    assert!(left.is_empty(), "the bad shard is in the cache: {left:?}");
}

/// The cache's whole copies (not temporaries, not locks), each with the source file it must
/// equal: the name before `~`.
fn cached_copies(cache: &Path) -> Vec<(String, String)> {
    files(cache)
        .into_iter()
        .filter(|f| !f.contains(".part-") && !f.ends_with(".lock"))
        .map(|f| {
            let name = Path::new(&f)
                .file_name()
                .unwrap()
                .to_string_lossy()
                .into_owned();
            let shard = name.split('~').next().unwrap().to_owned();
            (f, shard)
        })
        .collect()
}

/// Formats with no checksum of their own (MDS without hashes, WebDataset tar) from S3, through
/// a proxy that flips bits in and truncates answers that otherwise look whole: the objects'
/// ETags (single-part uploads: their MD5) and sizes catch every fault before a shard is read
/// or cached; the shard is fetched again, every sample arrives intact, and the cache holds
/// only true copies, read back as such by the next run. (Before: the flipped bytes were
/// delivered, and cached under the shard's name for every later run.)
#[test]
fn bytes_corrupted_in_transit_are_fetched_again_never_delivered_or_cached() {
    let Some(server) = moto(false) else { return };
    let (mds, tars, cache, idx) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    write_mds(mds.path(), 5, 40, false);
    write_tars(tars.path(), 5, 40);
    create_bucket(server.port, "flips");
    put_dir(server.port, "flips", "mds", mds.path());
    put_dir(server.port, "flips", "tars", tars.path());
    let proxy = FaultProxy::corrupting(server.port, 4, 12);
    let o = |endpoint: &str| RemoteOptions {
        // Enough fetches that the faults, however they fall, cannot exhaust one shard's.
        checksum_retries: 12,
        ..options(cache.path(), endpoint)
    };
    let started = Instant::now();
    let m: Arc<dyn ShardedSource> = Arc::from(
        open_url_with(
            "s3://flips/mds",
            &WebDatasetOptions::default(),
            o(&proxy.endpoint()),
        )
        .unwrap(),
    );
    read_epoch(Arc::clone(&m), 200);
    let t = open_url_with("s3://flips/tars", &wds(idx.path()), o(&proxy.endpoint())).unwrap();
    read_tar_epoch(&*t, 200);
    let (flipped, truncated) = (
        proxy.counts.flipped.load(Ordering::Relaxed),
        proxy.counts.truncated.load(Ordering::Relaxed),
    );
    let (a, b) = (m.store_stats().unwrap(), t.store_stats().unwrap());
    eprintln!(
        "{flipped} flipped, {truncated} truncated in {:?}\nmds: {a}\ntar: {b}",
        started.elapsed()
    );
    assert!(
        flipped > 0 && truncated > 0,
        "the proxy did not corrupt both ways"
    );
    // Each fault costs one failed check (a flip; two in one fetch fail it once; the index's
    // answer truncated with a Content-Length to match, which only its MD5 tells) or one retry
    // (a part's body short of its range): never more, and nothing else is fetched again.
    let (failures, retries) = (
        a.checksum_failures + b.checksum_failures,
        a.retries + b.retries,
    );
    assert!(failures >= 1 && retries >= 1, "{a}\n{b}");
    assert!(
        failures + retries <= flipped + truncated,
        "{failures} failures and {retries} retries for {flipped} flips and {truncated} truncations"
    );
    assert_eq!(
        a.unverified + b.unverified,
        0,
        "every shard had an MD5 ETag: {a}\n{b}"
    );
    // Whatever the cache holds under a shard's name is that shard.
    let copies = cached_copies(cache.path());
    assert_eq!(copies.len(), 10, "{copies:?}");
    for (f, shard) in &copies {
        let source = if shard.ends_with(".mds") {
            mds.path()
        } else {
            tars.path()
        };
        assert!(
            std::fs::read(f).unwrap() == std::fs::read(source.join(shard)).unwrap(),
            "{f} is not {shard}"
        );
    }
    drop((m, t, proxy));
    // The next run, straight to the server: every shard from the cache, intact.
    let m: Arc<dyn ShardedSource> = Arc::from(
        open_url_with(
            "s3://flips/mds",
            &WebDatasetOptions::default(),
            o(&server.endpoint()),
        )
        .unwrap(),
    );
    read_epoch(Arc::clone(&m), 200);
    assert_eq!(m.store_stats().unwrap().cache_hits, 5);
}

/// `SIGTERM` (with no handler, as in a training script that sets none) stops a reader
/// mid-fetch as `kill -9` does: its temporary files stay in the cache. The next run removes
/// them when it opens the cache, before it fetches anything (before: only a fetch's scan did,
/// so a run that found every shard cached left them for good).
#[test]
fn download_temporaries_left_by_sigterm_are_removed_by_the_next_run() {
    let Some(server) = moto(false) else { return };
    let (data, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    write_packed(data.path(), 300, 400 << 10);
    create_bucket(server.port, "termed");
    put_dir(server.port, "termed", "p", data.path());
    let proxy = FaultProxy::start_with(server.port, 0, Duration::from_millis(30));
    let mut c = child("s3://termed/p", cache.path(), &proxy.endpoint())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let temporaries = || -> Vec<String> {
        files(cache.path())
            .into_iter()
            .filter(|f| f.contains(".part-"))
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while temporaries().is_empty() {
        assert!(Instant::now() < deadline, "no fetch started");
        std::thread::sleep(Duration::from_millis(5));
    }
    let pid = libc::pid_t::try_from(c.id()).unwrap();
    // SAFETY: a signal to the child this test started and has not waited for.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let status = c.wait().unwrap();
    assert!(!status.success(), "the child was not stopped: {status:?}");
    assert!(
        !temporaries().is_empty(),
        "SIGTERM left no temporary to remove"
    );
    let d = open_url_with(
        "s3://termed/p",
        &WebDatasetOptions::default(),
        options(cache.path(), &server.endpoint()),
    )
    .unwrap();
    assert_eq!(
        temporaries(),
        Vec::<String>::new(),
        "left after the next open"
    );
    assert_eq!(
        d.store_stats().unwrap().cache_misses,
        0,
        "nothing fetched yet"
    );
}
