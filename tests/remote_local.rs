//! The remote layer (`RemoteStore`: ranged fetches, the disk cache, checksums on arrival)
//! through `file://` URLs, which need no server: what every store shares. The S3 server's
//! tests are in tests/remote_s3.rs.
#![cfg(feature = "remote")]

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

use gpufeed::format::{DType, Field, Schema};
use gpufeed::source::shards::ShardedSource;
use gpufeed::source::shards::packed::ShardWriter;
use gpufeed::source::shards::remote::{RemoteOptions, open_url_with};
use gpufeed::source::shards::webdataset::WebDatasetOptions;
use gpufeed::{Dataset, Error, Loader, RemoteErrorKind};

const RECORD: usize = 1000;

fn record(i: u32) -> Vec<u8> {
    (0..RECORD)
        .map(|k| (i as usize * 31 + k * 7) as u8)
        .collect()
}

/// `n` records (label u32, data u8[1000]) as packed shards of about `shard_bytes` in `dir`.
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

fn url(dir: &Path) -> String {
    format!("file://{}", dir.display())
}

fn options(cache: &Path) -> RemoteOptions {
    RemoteOptions {
        cache_dir: Some(cache.to_path_buf()),
        // Several parts per shard, so that shards arrive in pieces.
        part_bytes: 8 << 10,
        ..RemoteOptions::default()
    }
}

/// Reads one shuffled epoch (two-level shuffle) and checks every sample came once, intact.
fn read_all(data: Arc<dyn ShardedSource>, n: u32) {
    let dataset: Arc<dyn Dataset> = data;
    let mut loader = Loader::builder_shared(dataset)
        .batch_size(32)
        .shuffle(7)
        .shuffle_blocks(3, 8)
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
            assert_eq!(
                &data[slot * RECORD..(slot + 1) * RECORD],
                &record(label)[..]
            );
        }
    }
    assert_eq!(seen.len(), n as usize, "samples lost");
}

fn open(dir: &Path, o: RemoteOptions) -> Arc<dyn ShardedSource> {
    Arc::from(open_url_with(&url(dir), &WebDatasetOptions::default(), o).unwrap())
}

#[test]
fn packed_shards_arrive_once_and_come_from_the_cache_after() {
    let (data, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let shards = write_packed(data.path(), 600, 64 << 10);
    assert!(shards >= 8, "{shards} shards");
    let first = open(data.path(), options(cache.path()));
    read_all(Arc::clone(&first), 600);
    let s = first.store_stats().unwrap();
    assert_eq!(s.cache_misses, shards as u64, "{s}");
    assert_eq!(s.cache_hits, 0, "{s}");
    assert_eq!(s.retries, 0, "{s}");
    assert_eq!(s.checksum_failures, 0, "{s}");
    let shard_bytes: u64 = std::fs::read_dir(data.path())
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    // Every byte of every file, once (the index included).
    assert_eq!(s.bytes_fetched, shard_bytes, "{s}");
    drop(first);
    let again = open(data.path(), options(cache.path()));
    read_all(Arc::clone(&again), 600);
    let s = again.store_stats().unwrap();
    assert_eq!((s.cache_hits, s.cache_misses), (shards as u64, 0), "{s}");
    let index = std::fs::metadata(data.path().join("index.json"))
        .unwrap()
        .len();
    assert_eq!(
        s.bytes_fetched, index,
        "only the index is fetched again: {s}"
    );
}

/// A shard whose object is not of the size the index says is a size mismatch naming the
/// shard, the size the index says and the size the store gave (it was called a checksum
/// mismatch): found when the store sends it (packed shards, whose index has a checksum: the
/// size is the index's, no request asks for it) or when the store is asked for its size
/// (MDS shards without a hash gpufeed computes).
#[test]
fn a_shard_of_another_size_than_its_index_says_is_a_size_mismatch() {
    let size_mismatch = |e: &Error, name: &str, got: u64, want: u64| match e {
        Error::Remote { shard, kind, what } => {
            assert_eq!(*kind, RemoteErrorKind::SizeMismatch, "{e}");
            assert!(shard.ends_with(name), "{e}");
            assert!(what.contains(&format!("{got} bytes")), "{e}");
            assert!(what.contains(&format!("the index says {want}")), "{e}");
            assert!(e.to_string().contains("size mismatch"), "{e}");
            assert!(!e.to_string().contains("checksum"), "{e}");
        }
        other => panic!("not a size mismatch: {other:?}"),
    };
    let (data, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    write_packed(data.path(), 200, 64 << 10);
    let victim = data.path().join("shard-000001.gfd");
    let want = std::fs::metadata(&victim).unwrap().len();
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&victim)
        .unwrap();
    std::io::Write::write_all(&mut f, &[0u8; 100]).unwrap();
    drop(f);
    let d = open(data.path(), options(cache.path()));
    let e = d.get(d.shard_start(1).unwrap()).map(|_| ()).unwrap_err();
    size_mismatch(&e, "shard-000001.gfd", want + 100, want);
    assert!(d.get(0).is_ok(), "shard 0 is whole");

    let mds = tempfile::tempdir().unwrap();
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/streaming/mds");
    for e in std::fs::read_dir(&fixtures).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), mds.path().join(e.file_name())).unwrap();
    }
    let index = mds.path().join("index.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&index).unwrap()).unwrap();
    for shard in v["shards"].as_array_mut().unwrap() {
        shard["raw_data"]["hashes"] = serde_json::json!({});
    }
    std::fs::write(&index, serde_json::to_vec(&v).unwrap()).unwrap();
    let victim = mds.path().join("shard.00002.mds");
    let want = std::fs::metadata(&victim).unwrap().len();
    std::fs::write(&victim, vec![1u8; want as usize - 10]).unwrap();
    let cache = tempfile::tempdir().unwrap();
    let d = open(mds.path(), options(cache.path()));
    let e = d.get(4).map(|_| ()).unwrap_err();
    size_mismatch(&e, "shard.00002.mds", want - 10, want);
}

#[test]
fn a_shard_that_does_not_match_its_checksum_is_refused_and_not_cached() {
    let (data, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    write_packed(data.path(), 200, 64 << 10);
    // One byte of a record changes; the size stays.
    let victim = data.path().join("shard-000001.gfd");
    let mut bytes = std::fs::read(&victim).unwrap();
    bytes[100] ^= 0xff;
    std::fs::write(&victim, &bytes).unwrap();
    let d = open(data.path(), options(cache.path()));
    let start = d.shard_start(1).unwrap();
    let e = d.get(start).map(|_| ()).unwrap_err();
    match &e {
        Error::Remote { shard, kind, .. } => {
            assert_eq!(*kind, RemoteErrorKind::Checksum, "{e}");
            assert!(shard.ends_with("shard-000001.gfd"), "{e}");
        }
        other => panic!("not a checksum error: {other:?}"),
    }
    // Fetched again, with the same bytes: refused after two fetches, each counted.
    assert_eq!(d.store_stats().unwrap().checksum_failures, 2);
    assert!(e.to_string().contains("on 2 fetches"), "{e}");
    // Shard 0 is fine and stays so.
    d.get(0).unwrap();
    let whole: Vec<String> = walk(cache.path())
        .into_iter()
        .filter(|n| n.contains("shard-000001") && !n.ends_with(".lock"))
        .collect();
    assert!(whole.is_empty(), "a refused shard was kept: {whole:?}");
}

fn walk(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            out.extend(walk(&e.path()));
        } else {
            out.push(e.path().display().to_string());
        }
    }
    out
}

fn cache_bytes(dir: &Path) -> u64 {
    walk(dir)
        .iter()
        .map(|p| std::fs::metadata(p).map_or(0, |m| m.len()))
        .sum()
}

#[test]
fn the_cache_stays_within_its_byte_limit_evicting_the_least_recently_used() {
    let (data, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let shards = write_packed(data.path(), 600, 64 << 10);
    let biggest = std::fs::read_dir(data.path())
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .max()
        .unwrap();
    let limit = 3 * biggest;
    let o = RemoteOptions {
        cache_limit: limit,
        ..options(cache.path())
    };
    let d = open(data.path(), o);
    // In order, one shard after another: the cache holds the last three.
    for i in 0..d.len() {
        d.get(i).unwrap();
    }
    let s = d.store_stats().unwrap();
    assert_eq!(s.cache_misses, shards as u64, "{s}");
    assert!(s.cache_evictions >= shards as u64 - 3, "{s}");
    assert!(
        cache_bytes(cache.path()) <= limit,
        "{} > {limit}",
        cache_bytes(cache.path())
    );
}

/// A mapping keeps its shard's pages resident, and an evicted shard's disk space taken, until
/// it is dropped: a dataset from a store keeps no more shards mapped than the cache holds of
/// its largest, or memory and disk grow with the data set whatever the cache limit (found
/// streaming 6.4 GB through a 1 GiB cache: 4.4 GiB resident, benches/RESULTS.md).
#[test]
fn no_more_shards_stay_mapped_than_the_cache_holds() {
    let (data, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let shards = write_packed(data.path(), 600, 64 << 10);
    assert!(shards > 6, "{shards} shards");
    let biggest = std::fs::read_dir(data.path())
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .max()
        .unwrap();
    let o = RemoteOptions {
        cache_limit: 3 * biggest,
        ..options(cache.path())
    };
    let d = open(data.path(), o);
    for i in 0..d.len() {
        d.get(i).unwrap();
    }
    let open = d.open_stats();
    assert_eq!(open.limit, 3, "{open:?}");
    assert!(open.open_now <= 3, "{open:?}");
    assert!(open.evictions >= shards as u64 - 3, "{open:?}");
}

#[test]
fn a_shard_larger_than_the_cache_is_refused_with_a_count() {
    let (data, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    write_packed(data.path(), 100, 64 << 10);
    let o = RemoteOptions {
        cache_limit: 4096,
        ..options(cache.path())
    };
    let d = open(data.path(), o);
    let e = d.get(0).map(|_| ()).unwrap_err();
    match &e {
        Error::Remote { shard, kind, what } => {
            assert_eq!(*kind, RemoteErrorKind::CacheFull, "{e}");
            assert!(shard.ends_with("shard-000000.gfd"), "{e}");
            assert!(what.contains("4096"), "{e}");
        }
        other => panic!("not a cache-full error: {other:?}"),
    }
    assert_eq!(d.store_stats().unwrap().cache_full, 1);
}

#[test]
fn a_missing_shard_is_an_error_naming_it_and_the_sample() {
    let (data, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    write_packed(data.path(), 200, 64 << 10);
    std::fs::remove_file(data.path().join("shard-000002.gfd")).unwrap();
    let d = open(data.path(), options(cache.path()));
    let start = d.shard_start(2).unwrap();
    let dataset: Arc<dyn Dataset> = d;
    let mut loader = Loader::builder_shared(dataset)
        .batch_size(16)
        .build()
        .unwrap();
    let e = loader
        .by_ref()
        .find_map(|b| b.err())
        .expect("the missing shard fails its batch");
    match &e {
        Error::Sample { index, source, .. } => {
            assert_eq!(*index, start, "{e}");
            match &**source {
                Error::Remote { shard, kind, .. } => {
                    assert_eq!(*kind, RemoteErrorKind::NotFound, "{e}");
                    assert!(shard.ends_with("shard-000002.gfd"), "{e}");
                }
                other => panic!("not a remote error: {other:?}"),
            }
        }
        other => panic!("not a sample error: {other:?}"),
    }
}

#[test]
fn two_stores_on_one_cache_fetch_each_shard_once() {
    let (data, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let shards = write_packed(data.path(), 600, 64 << 10);
    let (a, b) = (
        open(data.path(), options(cache.path())),
        open(data.path(), options(cache.path())),
    );
    std::thread::scope(|s| {
        for d in [&a, &b] {
            s.spawn(move || {
                for i in 0..d.len() {
                    d.get(i).unwrap();
                }
            });
        }
    });
    let (sa, sb) = (a.store_stats().unwrap(), b.store_stats().unwrap());
    assert_eq!(
        sa.cache_misses + sb.cache_misses,
        shards as u64,
        "{sa}\n{sb}"
    );
    assert_eq!(
        sa.cache_misses + sa.cache_hits + sb.cache_misses + sb.cache_hits,
        2 * shards as u64,
        "{sa}\n{sb}"
    );
}

#[test]
fn tar_shards_from_a_url_read_back() {
    use crate::tar_common::TarBuilder;
    let (data, cache, index_cache) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    for s in 0..4u32 {
        let mut t = TarBuilder::new();
        for i in 0..50u32 {
            let n = s * 50 + i;
            t.file(&format!("{n:06}.bin"), &record(n));
            t.file(&format!("{n:06}.cls"), n.to_string().as_bytes());
        }
        std::fs::write(data.path().join(format!("shard-{s:03}.tar")), t.finish()).unwrap();
    }
    let o = WebDatasetOptions {
        cache_dir: Some(index_cache.path().to_path_buf()),
        ..WebDatasetOptions::default()
    };
    let d = open_url_with(&url(data.path()), &o, options(cache.path())).unwrap();
    assert_eq!(d.len(), 200);
    for n in 0..200u32 {
        let s = d.get(u64::from(n)).unwrap();
        assert_eq!(s.field_named("bin").unwrap(), &record(n)[..]);
        // `str(int)`, read as webdataset reads it.
        assert_eq!(*s.field_as::<i64>("cls").unwrap(), [i64::from(n)]);
    }
}

/// The cache's copies change as the cache works (touched at every use, removed to make room,
/// fetched again, by any process of the machine) while no shard's bytes change: none of that
/// fails an epoch. The object changing in the store is not looked for (that would take a
/// request per shard at every epoch): a dataset opened again fetches the new version.
#[test]
fn the_cache_at_work_is_not_a_change_between_epochs() {
    let (data, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    write_packed(data.path(), 200, 64 << 10);
    let tars = tempfile::tempdir().unwrap();
    let tar = crate::tar_common::TarBuilder::new()
        .file("a.txt", b"one")
        .file("b.txt", b"two")
        .finish();
    std::fs::write(tars.path().join("shard-0.tar"), &tar).unwrap();
    for (dir, n) in [(data.path(), 200), (tars.path(), 2)] {
        let d = open(dir, options(cache.path()));
        // Every shard opened, mapped from its cache file.
        for i in 0..n {
            d.get(i).unwrap();
        }
        d.check_unchanged().unwrap();
        let copies: Vec<String> = walk(cache.path())
            .into_iter()
            .filter(|p| !p.ends_with(".lock"))
            .collect();
        assert!(!copies.is_empty());
        // Touched (as another rank's use does), then removed (as another rank's eviction does).
        let later = std::time::SystemTime::now() + std::time::Duration::from_secs(60);
        for p in &copies {
            std::fs::File::options()
                .write(true)
                .open(p)
                .unwrap()
                .set_modified(later)
                .unwrap();
        }
        d.check_unchanged().unwrap();
        for p in &copies {
            std::fs::remove_file(p).unwrap();
        }
        d.check_unchanged().unwrap();
        // The objects themselves rewritten in place: not seen.
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            std::fs::File::options()
                .write(true)
                .open(&p)
                .unwrap()
                .set_modified(later)
                .unwrap();
        }
        d.check_unchanged().unwrap();
        d.get(0).unwrap();
    }
}

/// `shards` tar shards of `per` samples (`NNNNNN.data`: `record(n)`, `NNNNNN.label`: `n` as
/// u32 LE) in `dir`, named `shard-NNN.tar`; returns the largest one's size.
fn write_tars(dir: &Path, shards: u32, per: u32) -> u64 {
    use crate::tar_common::TarBuilder;
    let mut largest = 0;
    for s in 0..shards {
        let mut t = TarBuilder::new();
        for i in 0..per {
            let n = s * per + i;
            t.file(&format!("{n:06}.data"), &record(n));
            t.file(&format!("{n:06}.label"), &n.to_le_bytes());
        }
        let bytes = t.finish();
        largest = largest.max(bytes.len() as u64);
        std::fs::write(dir.join(format!("shard-{s:03}.tar")), bytes).unwrap();
    }
    largest
}

/// Tar shards listed from a URL have no index to give their sizes: the listing does, and a
/// dataset of them keeps no more shards mapped than the cache holds of the largest, as packed
/// and MDS datasets do (before, it kept up to `max_open_shards`, 1,024 by default: an epoch
/// over tar shards larger than the cache kept them all resident and on disk). The epoch, in
/// the two-level shuffle's order through a cache of two shards, still yields every sample
/// once, intact.
#[test]
fn tar_shards_from_a_url_keep_no_more_shards_mapped_than_the_cache_holds() {
    use gpufeed::{FnTransform, Loader, OutputField};
    let (data, cache, index_cache) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let (shards, per) = (6u32, 40u32);
    let largest = write_tars(data.path(), shards, per);
    // Not a shard, and larger than the cache: it does not shrink the bound.
    std::fs::write(
        data.path().join("README.md"),
        vec![b'x'; 8 * largest as usize],
    )
    .unwrap();
    let o = RemoteOptions {
        cache_limit: 2 * largest + largest / 2,
        ..options(cache.path())
    };
    let w = WebDatasetOptions {
        cache_dir: Some(index_cache.path().to_path_buf()),
        ..WebDatasetOptions::default()
    };
    let d: Arc<dyn ShardedSource> = Arc::from(open_url_with(&url(data.path()), &w, o).unwrap());
    assert_eq!(d.shard_names().len(), shards as usize);
    assert_eq!(d.open_stats().limit, 2, "{:?}", d.open_stats());

    let dataset: Arc<dyn Dataset> = Arc::clone(&d) as Arc<dyn Dataset>;
    let mut loader = Loader::builder_shared(dataset)
        .batch_size(16)
        .shuffle(7)
        .shuffle_blocks(3, 8)
        .workers(3)
        .transform(FnTransform::new(
            vec![
                OutputField::new("label", DType::U32, &[]),
                OutputField::new("intact", DType::U8, &[]),
            ],
            |s: gpufeed::Sample<'_>, _: &gpufeed::SampleContext, slots: &mut gpufeed::Slots<'_>| {
                let label = s.field_named("label").unwrap_or_default();
                let n = u32::from_le_bytes(label.try_into().unwrap_or([0xff; 4]));
                let intact = s.field_named("data") == Some(&record(n)[..]);
                slots.field(0)?.copy_from_slice(&n.to_le_bytes());
                slots.field(1)?.copy_from_slice(&[u8::from(intact)]);
                Ok(())
            },
        ))
        .build()
        .unwrap();
    let mut seen = HashSet::new();
    for b in loader.by_ref() {
        let b = b.unwrap();
        let open = d.open_stats();
        assert!(open.open_now <= 2, "{open:?}");
        let labels = b.field::<u32>("label").unwrap();
        let intact = b.field::<u8>("intact").unwrap();
        for (&label, &ok) in labels.iter().zip(intact) {
            assert!(seen.insert(label), "sample {label} came twice");
            assert_eq!(ok, 1, "sample {label} is not what was written");
        }
    }
    assert_eq!(seen.len(), (shards * per) as usize, "samples lost");
    let open = d.open_stats();
    assert!(open.evictions >= u64::from(shards) - 2, "{open:?}");
}

/// One `.tar` object named by the URL: its size comes from a HEAD request (made anyway to
/// read the shard, and not repeated), and bounds the open shards the same way.
#[test]
fn a_single_tar_url_is_bounded_by_its_size() {
    let (data, cache, index_cache) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let size = write_tars(data.path(), 1, 30);
    let o = RemoteOptions {
        cache_limit: 3 * size,
        ..options(cache.path())
    };
    let w = WebDatasetOptions {
        cache_dir: Some(index_cache.path().to_path_buf()),
        ..WebDatasetOptions::default()
    };
    let one = format!("{}/shard-000.tar", url(data.path()));
    let d = open_url_with(&one, &w, o).unwrap();
    assert_eq!(d.open_stats().limit, 3, "{:?}", d.open_stats());
    assert_eq!(d.len(), 30);
    for n in 0..30u32 {
        let s = d.get(u64::from(n)).unwrap();
        assert_eq!(s.field_named("data").unwrap(), &record(n)[..]);
    }
    let s = d.store_stats().unwrap();
    assert_eq!(s.cache_misses, 1, "{s}");
    // One HEAD, then the shard's parts (`options`: 8 KiB each), with no retry.
    assert_eq!(s.retries, 0, "{s}");
    assert_eq!(s.requests, 1 + size.div_ceil(8 << 10), "{s}");
}

#[test]
fn compressed_mds_shards_from_a_url_are_fetched_compressed_and_decompressed_into_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let zip = crate::shard_compressed::compressed_set(dir.path(), "zstd", true);
    let d = open(dir.path(), options(cache.path()));
    assert_eq!(d.compression().as_deref(), Some("zstd"));
    for i in 0..20u64 {
        let s = d.get(i).unwrap();
        assert_eq!(*s.field_as::<i64>("id").unwrap(), [i as i64]);
        assert_eq!(
            s.field_named("payload").unwrap(),
            vec![i as u8; 100 + i as usize]
        );
    }
    let stats = d.store_stats().unwrap();
    assert_eq!(
        (stats.cache_misses, stats.checksum_failures),
        (1, 0),
        "{stats:?}"
    );
    // The compressed object, changed: refused by its checksum, naming it and the sample.
    let mut b = std::fs::read(&zip).unwrap();
    let mid = b.len() / 2;
    b[mid] ^= 1;
    std::fs::write(&zip, &b).unwrap();
    let cache = tempfile::tempdir().unwrap();
    let d = open(dir.path(), options(cache.path()));
    match d.get(5).unwrap_err() {
        Error::Remote { shard, kind, .. } => {
            assert_eq!(kind, RemoteErrorKind::Checksum);
            assert!(shard.ends_with("shard.00000.mds.zstd"), "{shard:?}");
        }
        other => panic!("expected a checksum error, got {other:?}"),
    }
}

/// Parquet files and JSON lines at a URL: one file, a pattern, a prefix; each fetched once
/// into the cache, then read as the local files are.
#[test]
fn tables_at_a_url_are_fetched_once_into_the_cache_and_read_as_local_files() {
    use crate::table_common::{every_kind, write_parquet};
    use gpufeed::source::{Format, OpenOptions, detect, open};
    let (dir, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut batches = Vec::new();
    for (k, start) in [0usize, 40].into_iter().enumerate() {
        let (batch, _) = every_kind(start, 40, false);
        write_parquet(
            &dir.path().join(format!("train-{k:05}.parquet")),
            std::slice::from_ref(&batch),
            15,
            5,
        );
        batches.push(batch);
    }
    std::fs::write(dir.path().join("README.md"), "not data").unwrap();
    let lines = tempfile::tempdir().unwrap();
    std::fs::write(
        lines.path().join("a.jsonl"),
        "{\"text\": \"one\"}\n{\"text\": \"two\"}\n",
    )
    .unwrap();
    let o = OpenOptions {
        cache_dir: Some(cache.path().to_path_buf()),
        ..OpenOptions::default()
    };
    let base = url(dir.path());
    let local = open(dir.path(), &OpenOptions::default()).unwrap();
    for name in [
        format!("{base}/train-*.parquet"),
        format!("{base}/"),
        format!("{base}/train-00001.parquet"),
    ] {
        // A prefix is told apart only by what is under it (detect fetches nothing).
        if !name.ends_with('/') {
            assert_eq!(detect(&name).unwrap(), Format::Parquet, "{name}");
        }
        let d = open(&name, &o).unwrap();
        assert_eq!(d.format(), Format::Parquet);
        let offset = if name.ends_with("00001.parquet") {
            40
        } else {
            0
        };
        assert_eq!(d.len(), 80 - offset, "{name}");
        for i in 0..d.len() {
            let (a, b) = (d.get(i).unwrap(), local.get(i + offset).unwrap());
            for k in 0..d.schema().fields().len() {
                assert_eq!(a.field(k), b.field(k), "{name}: row {i}, field {k}");
            }
        }
    }
    // Each file fetched once, whatever the number of opens.
    let cached: Vec<_> = walk(cache.path())
        .into_iter()
        .filter(|p| p.contains(".parquet~") && !p.ends_with(".lock"))
        .collect();
    assert_eq!(cached.len(), 2, "{cached:?} {:?}", walk(cache.path()));
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(6));
    std::io::Write::write_all(&mut gz, b"{\"text\": \"three\"}\n").unwrap();
    std::fs::write(lines.path().join("b.jsonl.gz"), gz.finish().unwrap()).unwrap();
    let j = open(format!("{}/*.jsonl*", url(lines.path())), &o).unwrap();
    assert_eq!(j.format(), Format::JsonLines);
    assert_eq!(j.len(), 3);
    assert_eq!(j.get(1).unwrap().field_named("text"), Some(&b"two"[..]));
    assert_eq!(j.get(2).unwrap().field_named("text"), Some(&b"three"[..]));
    let e = open(format!("{base}/nothing-*.parquet"), &o).err().unwrap();
    assert!(e.to_string().contains("no object matches"), "{e}");
}

#[test]
fn compressed_mds_shards_are_fetched_ahead_as_their_archives() {
    // The loader announces the shards it reads next; a compressed shard of a URL is made
    // from its archive, so the archive is what the store fetches ahead: one fetch in all,
    // none for the raw file, which the store does not hold.
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    crate::shard_compressed::compressed_set(dir.path(), "zstd", true);
    let d = open(dir.path(), options(cache.path()));
    d.read_ahead(&[0]);
    // The announcement is taken up by the store's own thread: wait (bounded) for its fetch.
    let start = std::time::Instant::now();
    while d.store_stats().unwrap().cache_misses == 0 {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(30),
            "no fetch ahead"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    for i in 0..20u64 {
        assert_eq!(
            *d.get(i).unwrap().field_as::<i64>("id").unwrap(),
            [i as i64]
        );
    }
    // One fetch, the archive's (a fetch of the raw file would be a second miss, and fail).
    let stats = d.store_stats().unwrap();
    assert_eq!(stats.cache_misses, 1, "{stats:?}");
}
