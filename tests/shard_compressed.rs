//! Compressed MDS shards (streaming's `compression="zstd"` or `"gz"`): decompressed once into
//! the cache, checked against both files' sizes and hashes, within the cache's limit; a
//! corrupt one is an error naming the shard (and, through the loader, the sample).

use std::io::Write;
use std::path::{Path, PathBuf};

use gpufeed::source::shards::ShardOptions;
use gpufeed::source::shards::mds::MdsDataset;
use gpufeed::{CopyFields, Dataset, Error, Loader};

use crate::shard_decode::write_mds;

/// A one-shard MDS data set of 20 samples (an `int` and a `bytes` column), its shard
/// compressed with `compression` (`zstd` or `gz`) and its raw file removed, as streaming
/// writes it to a remote; both files' xxh64 in the index unless `hashes` is false.
pub(crate) fn compressed_set(dir: &Path, compression: &str, hashes: bool) -> PathBuf {
    let samples: Vec<Vec<Vec<u8>>> = (0..20i64)
        .map(|i| vec![i.to_le_bytes().to_vec(), vec![i as u8; 100 + i as usize]])
        .collect();
    write_mds(
        dir,
        &[("id", "int", Some(8)), ("payload", "bytes", None)],
        &samples,
    );
    let raw_path = dir.join("shard.00000.mds");
    let raw = std::fs::read(&raw_path).unwrap();
    let zip = match compression.split(':').next().unwrap() {
        "zstd" => zstd::bulk::compress(&raw, 3).unwrap(),
        "gz" => {
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(9));
            e.write_all(&raw).unwrap();
            e.finish().unwrap()
        }
        other => panic!("{other}"),
    };
    let ext = compression.split(':').next().unwrap();
    let zip_path = dir.join(format!("shard.00000.mds.{ext}"));
    std::fs::write(&zip_path, &zip).unwrap();
    std::fs::remove_file(&raw_path).unwrap();
    let index_path = dir.join("index.json");
    let mut index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&index_path).unwrap()).unwrap();
    let xxh64 = |b: &[u8]| format!("{:016x}", xxhash_rust::xxh64::xxh64(b, 0));
    let shard = &mut index["shards"][0];
    shard["compression"] = compression.into();
    if hashes {
        shard["hashes"] = serde_json::json!(["xxh64"]);
        shard["raw_data"]["hashes"] = serde_json::json!({ "xxh64": xxh64(&raw) });
    }
    shard["zip_data"] = serde_json::json!({
        "basename": format!("shard.00000.mds.{ext}"),
        "bytes": zip.len(),
        "hashes": if hashes { serde_json::json!({ "xxh64": xxh64(&zip) }) } else { serde_json::json!({}) },
    });
    std::fs::write(&index_path, index.to_string()).unwrap();
    zip_path
}

fn in_cache(cache: &Path) -> ShardOptions {
    ShardOptions {
        cache_dir: Some(cache.to_path_buf()),
        ..ShardOptions::default()
    }
}

fn read_all(d: &dyn Dataset) {
    assert_eq!(d.len(), 20);
    for i in 0..20u64 {
        let s = d.get(i).unwrap();
        assert_eq!(*s.field_as::<i64>("id").unwrap(), [i as i64]);
        assert_eq!(
            s.field_named("payload").unwrap(),
            vec![i as u8; 100 + i as usize]
        );
    }
}

/// Files under `dir` (recursively) whose names contain `needle`.
fn files_named(dir: &Path, needle: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(files_named(&p, needle));
        } else if p.file_name().unwrap().to_string_lossy().contains(needle) {
            out.push(p);
        }
    }
    out
}

#[test]
fn zstd_and_gzip_shards_are_decompressed_once_into_the_cache() {
    for compression in ["zstd", "zstd:7", "gz"] {
        let dir = tempfile::tempdir().unwrap();
        let cache = tempfile::tempdir().unwrap();
        let zip = compressed_set(dir.path(), compression, true);
        let d = MdsDataset::open_with(dir.path(), in_cache(cache.path())).unwrap();
        assert_eq!(d.format().compression(), Some(compression));
        read_all(&d);
        let copies: Vec<PathBuf> = files_named(cache.path(), "shard.00000.mds~")
            .into_iter()
            .filter(|p| !p.to_string_lossy().ends_with(".lock"))
            .collect();
        assert_eq!(
            copies.len(),
            1,
            "{compression}: one decompressed copy: {copies:?}"
        );
        // Once: a data set opened again reads the cache's copy, not the compressed file.
        std::fs::remove_file(&zip).unwrap();
        let again = gpufeed::source::open(
            dir.path().to_str().unwrap(),
            &gpufeed::source::OpenOptions {
                shards: gpufeed::source::shards::webdataset::WebDatasetOptions {
                    shards: in_cache(cache.path()),
                    ..Default::default()
                }
                .clone(),
                ..Default::default()
            },
        )
        .unwrap();
        let sharded = again.sharded().unwrap();
        assert_eq!(sharded.compression().as_deref(), Some(compression));
        read_all(&again);
    }
}

fn malformed(e: &Error, path: &Path, needle: &str) {
    match e {
        Error::Malformed { path: p, what, .. } => {
            assert_eq!(p, path);
            assert!(what.contains(needle), "{what:?} lacks {needle:?}");
        }
        other => panic!("expected Malformed naming {path:?}, got {other:?}"),
    }
}

#[test]
fn a_corrupt_compressed_shard_is_an_error_naming_the_shard_and_the_sample() {
    // With hashes: the compressed file's is checked before a byte is decompressed.
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let zip = compressed_set(dir.path(), "zstd", true);
    let mut b = std::fs::read(&zip).unwrap();
    let mid = b.len() / 2;
    b[mid] ^= 0x55;
    std::fs::write(&zip, &b).unwrap();
    let d = MdsDataset::open_with(dir.path(), in_cache(cache.path())).unwrap();
    malformed(
        &d.get(3).unwrap_err(),
        &zip,
        "the compressed file's xxh64 is",
    );
    // Without: the stream itself is refused, or decompresses to other bytes than the raw
    // file's size; each a typed error naming the compressed file, remembered for later
    // samples, and named with the sample by the loader.
    for (cut, needle) in [
        (false, "not a valid zstd stream"),
        (true, "not a valid zstd stream"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let cache = tempfile::tempdir().unwrap();
        let zip = compressed_set(dir.path(), "zstd", false);
        let mut b = std::fs::read(&zip).unwrap();
        if cut {
            b.truncate(b.len() - 7);
        } else {
            let n = b.len();
            b[n / 2..].fill(0xff);
        }
        std::fs::write(&zip, &b).unwrap();
        edit_zip_bytes(dir.path(), b.len());
        let d = MdsDataset::open_with(dir.path(), in_cache(cache.path())).unwrap();
        malformed(&d.get(0).unwrap_err(), &zip, needle);
        malformed(&d.get(1).unwrap_err(), &zip, needle);
        assert!(
            files_named(cache.path(), ".part-").is_empty(),
            "no temporary file left"
        );
        let mut loader = Loader::builder(d)
            .batch_size(4)
            .transform(CopyFields::named(["id"]))
            .build()
            .unwrap();
        match loader.next().unwrap().unwrap_err() {
            Error::Sample { index, source, .. } => {
                assert_eq!(index, 0);
                malformed(&source, &zip, needle);
            }
            other => panic!("expected an error naming the sample, got {other:?}"),
        }
    }
}

/// Sets the index's size of the compressed file (after a test changed it).
fn edit_zip_bytes(dir: &Path, bytes: usize) {
    let p = dir.join("index.json");
    let mut index: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    index["shards"][0]["zip_data"]["bytes"] = bytes.into();
    std::fs::write(&p, index.to_string()).unwrap();
}

#[test]
fn decompressed_shards_keep_within_the_cache_limit_and_other_compressions_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let zip = compressed_set(dir.path(), "zstd", true);
    let d = MdsDataset::open_with(
        dir.path(),
        ShardOptions {
            cache_limit: Some(1000),
            ..in_cache(cache.path())
        },
    )
    .unwrap();
    malformed(
        &d.get(0).unwrap_err(),
        &zip,
        "more than the cache's limit of 1000 bytes",
    );
    // A compression gpufeed does not decompress, without its raw file: named.
    let p = dir.path().join("index.json");
    let mut index: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    index["shards"][0]["compression"] = "br:11".into();
    std::fs::write(&p, index.to_string()).unwrap();
    let d = MdsDataset::open_with(dir.path(), in_cache(cache.path())).unwrap();
    malformed(
        &d.get(0).unwrap_err(),
        &dir.path().join("shard.00000.mds"),
        "is compressed with `br:11`, which gpufeed does not decompress",
    );
}
