//! A mutation fuzzer for the parsers of sharded formats: WebDataset tar shards (the tar reader
//! and webdataset's key rules) and MosaicML MDS (index.json and shard files).
//!
//! Valid shards (the fixtures written by the Python packages, and archives built here with
//! long names and odd members) are mutated: bit flips, byte writes, truncations, appended
//! bytes, and for tars writes into a header's fields with the header checksum re-sealed (so
//! that the mutation reaches the size, type and name logic); for MDS, writes of interesting
//! numbers into the offset table and into the index's counts and sizes. Each result is opened
//! and every sample read; the property is that nothing panics and every field handed out lies
//! inside its sample. Proptest's default case count (256) unless `PROPTEST_CASES` says more:
//! `PROPTEST_CASES=100000 cargo test --release --test shard_fuzz` is the long run.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use crate::tar_common::TarBuilder;
use gpufeed::source::shards::mds::MdsDataset;
use gpufeed::source::shards::webdataset::{
    MissingFieldPolicy, TarIndex, UnkeyedPolicy, WebDataset, WebDatasetOptions,
};
use gpufeed::source::shards::{MemoryStore, ShardOptions};
use gpufeed::{Dataset, Error};
use proptest::prelude::*;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/streaming")
}

fn tar_seeds() -> &'static [Vec<u8>] {
    static SEEDS: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    SEEDS.get_or_init(|| {
        let mut out: Vec<Vec<u8>> = ["wds/shard-000001.tar", "names/pax.tar", "names/gnu.tar"]
            .iter()
            .map(|p| std::fs::read(fixtures().join(p)).unwrap())
            .collect();
        out.push(
            TarBuilder::new()
                .file("a.jpg", b"j")
                .file("a.cls", b"1")
                .file(&format!("{}/b.jpg", "d".repeat(150)), b"jj")
                .file("noext", b"")
                .entry("dir/", b'5', b"")
                .file("c.jpg", b"jjj")
                .finish(),
        );
        out
    })
}

/// An MDS index and its shards (name, bytes).
type MdsSeed = (Vec<u8>, Vec<(String, Vec<u8>)>);

fn mds_seed() -> &'static MdsSeed {
    static SEED: OnceLock<MdsSeed> = OnceLock::new();
    SEED.get_or_init(|| {
        let dir = fixtures().join("mds");
        let index = std::fs::read(dir.join("index.json")).unwrap();
        let shards = (0..4)
            .map(|k| {
                let name = format!("shard.{k:05}.mds");
                let b = std::fs::read(dir.join(&name)).unwrap();
                (name, b)
            })
            .collect();
        (index, shards)
    })
}

#[derive(Clone, Debug)]
enum Mutation {
    Flip(usize, u8),
    Byte(usize, u8),
    Truncate(usize),
    Append(Vec<u8>),
    /// Writes bytes into the header block that holds position `at`, at `field` (an offset
    /// within the block), then re-seals that header's checksum.
    Header {
        at: usize,
        field: usize,
        bytes: Vec<u8>,
    },
    /// Writes a little-endian u32 at `at` (MDS tables are u32s).
    U32 {
        at: usize,
        value: u32,
    },
}

fn interesting_u32() -> impl Strategy<Value = u32> {
    prop_oneof![any::<u32>(), 0u32..4096, Just(u32::MAX), Just(u32::MAX - 3)]
}

fn header_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 1..12),
        // Octal sizes, small and huge; base-256 numbers.
        "[0-7 ]{1,11}".prop_map(String::into_bytes),
        Just(vec![
            0x80, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff
        ]),
        Just(vec![0xff; 12]),
        // Types.
        proptest::sample::select(b"0125x gLKS7A\0".to_vec()).prop_map(|b| vec![b]),
        // Names with dots, slashes, newlines, underscores.
        "[a-c./_\n]{1,12}".prop_map(String::into_bytes),
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(p, b)| Mutation::Flip(p, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(p, b)| Mutation::Byte(p, b)),
        any::<usize>().prop_map(Mutation::Truncate),
        proptest::collection::vec(any::<u8>(), 1..600).prop_map(Mutation::Append),
        (
            any::<usize>(),
            prop_oneof![Just(0usize), Just(124), Just(156), Just(345), 0usize..512],
            header_bytes()
        )
            .prop_map(|(at, field, bytes)| Mutation::Header { at, field, bytes }),
        (any::<usize>(), interesting_u32()).prop_map(|(at, value)| Mutation::U32 { at, value }),
    ]
}

fn reseal_header(h: &mut [u8]) {
    h[148..156].copy_from_slice(b"        ");
    let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
    h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
}

fn apply(b: &mut Vec<u8>, m: &Mutation) {
    if b.is_empty() {
        return;
    }
    let n = b.len();
    match m {
        Mutation::Flip(p, bit) => b[p % n] ^= 1 << bit,
        Mutation::Byte(p, v) => b[p % n] = *v,
        Mutation::Truncate(len) => b.truncate(len % n),
        Mutation::Append(extra) => b.extend_from_slice(extra),
        Mutation::Header { at, field, bytes } => {
            let block = (at % n) / 512 * 512;
            if block + 512 <= n {
                let h = &mut b[block..block + 512];
                for (i, &v) in bytes.iter().enumerate() {
                    if let Some(x) = h.get_mut(field + i) {
                        *x = v;
                    }
                }
                reseal_header(h);
            }
        }
        Mutation::U32 { at, value } => {
            if n >= 4 {
                let at = (at % (n / 4)) * 4;
                b[at..at + 4].copy_from_slice(&value.to_le_bytes());
            }
        }
    }
}

fn check_sample(s: &gpufeed::Sample<'_>) {
    let span = s.bytes().unwrap().as_ptr_range();
    for k in 0..=s.schema().fields().len() {
        // An integer decoded from its text (webdataset's `.cls`) is the sample's own value.
        let decoded = s.schema().fields().get(k).is_some_and(|f| {
            f.kind
                == gpufeed::format::FieldKind::Tensor {
                    dtype: gpufeed::DType::I64,
                    shape: vec![],
                }
        });
        if let Some(v) = s.field(k).filter(|_| !decoded) {
            let r = v.as_ptr_range();
            assert!(
                r.start >= span.start && r.end <= span.end,
                "field {k} outside"
            );
        }
    }
}

/// Opens a (possibly broken) tar shard every way and reads every sample.
fn exercise_tar(bytes: &[u8]) {
    let path = Path::new("m.tar");
    for unkeyed in [UnkeyedPolicy::Skip, UnkeyedPolicy::Error] {
        if let Ok(index) = TarIndex::build(path, bytes, unkeyed) {
            for i in 0..index.len() as usize {
                for m in index.members(i).unwrap() {
                    assert!(m.offset + m.size <= bytes.len() as u64);
                    assert!((m.ext as usize) < index.extensions().len());
                }
                assert!(index.key(i).is_some());
            }
        }
    }
    let cache = tempfile::tempdir().unwrap();
    let mut store = MemoryStore::new();
    store.insert("m.tar", bytes.to_vec());
    let store = Arc::new(store);
    for missing in [MissingFieldPolicy::Error, MissingFieldPolicy::Skip] {
        let options = WebDatasetOptions {
            cache_dir: Some(cache.path().to_path_buf()),
            missing,
            ..WebDatasetOptions::default()
        };
        // Twice: the second open reads the index from the cache.
        for _ in 0..2 {
            let Ok(d) =
                WebDataset::from_store(store.clone(), vec!["m.tar".into()], options.clone())
            else {
                continue;
            };
            let n = d.len();
            for i in (0..n.min(64)).chain([n, u64::MAX]) {
                if let Ok(s) = d.get(i) {
                    check_sample(&s);
                }
                let _ = d.key(i);
            }
            let _ = d.verify(|_| {});
        }
    }
}

/// Opens a (possibly broken) MDS directory and reads every sample, plainly and verified.
fn exercise_mds(index: &[u8], shards: &[(String, Vec<u8>)]) {
    let mut store = MemoryStore::new();
    for (name, b) in shards {
        store.insert(name.clone(), b.clone());
    }
    let store = Arc::new(store);
    for verify in [false, true] {
        let options = ShardOptions {
            verify,
            ..ShardOptions::default()
        };
        let Ok(d) = MdsDataset::from_index(store.clone(), Path::new("index.json"), index, options)
        else {
            continue;
        };
        let n = d.len();
        for i in (0..n.min(64)).chain([n, u64::MAX]) {
            match d.get(i) {
                Ok(s) => check_sample(&s),
                Err(Error::OutOfRange { .. }) => assert!(i >= n),
                Err(_) => {}
            }
        }
        let _ = d.verify(|_| {});
    }
}

proptest! {
    #[test]
    fn mutated_tar_shards_never_panic(
        seed in 0usize..4,
        mutations in proptest::collection::vec(mutation(), 1..5),
    ) {
        let mut b = tar_seeds()[seed].clone();
        for m in &mutations {
            apply(&mut b, m);
        }
        exercise_tar(&b);
    }

    #[test]
    fn mutated_mds_shards_never_panic(
        shard in 0usize..4,
        mutations in proptest::collection::vec(mutation(), 1..4),
        fix_size in any::<bool>(),
    ) {
        let (index, shards) = mds_seed();
        let mut shards = shards.clone();
        let b = &mut shards[shard].1;
        for m in &mutations {
            apply(b, m);
        }
        let mut index = index.clone();
        if fix_size {
            // Keep the index's size right, so that the mutation reaches the shard's tables.
            let mut v: serde_json::Value = serde_json::from_slice(&index).unwrap();
            v["shards"][shard]["raw_data"]["bytes"] = b.len().into();
            index = serde_json::to_vec(&v).unwrap();
        }
        exercise_mds(&index, &shards);
    }

    #[test]
    fn mutated_mds_indexes_never_panic(
        edits in proptest::collection::vec((0usize..4, 0usize..6, any::<i64>()), 1..4),
        bytes in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..3),
    ) {
        let (index, shards) = mds_seed();
        let mut v: serde_json::Value = serde_json::from_slice(index).unwrap();
        for (shard, what, value) in edits {
            let s = &mut v["shards"][shard];
            match what {
                0 => s["samples"] = value.into(),
                1 => s["raw_data"]["bytes"] = value.into(),
                2 => s["column_sizes"][(value as usize) % 16] = (value % 64).into(),
                3 => s["column_encodings"][(value as usize) % 16] =
                    ["int", "bytes", "ndarray:uint8:2", "str", "ndarray", "uint64"][value.unsigned_abs() as usize % 6].into(),
                4 => s["raw_data"]["basename"] = format!("shard.{:05}.mds", value.rem_euclid(5)).into(),
                _ => s["column_names"][(value as usize) % 16] = "x".into(),
            }
        }
        let mut text = serde_json::to_vec(&v).unwrap();
        let n = text.len();
        for (p, b) in bytes {
            text[p % n] = b;
        }
        exercise_mds(&text, shards);
    }
}

#[test]
fn seeds_are_valid() {
    for (k, s) in tar_seeds().iter().enumerate() {
        TarIndex::build(Path::new("seed"), s, UnkeyedPolicy::Skip)
            .unwrap_or_else(|e| panic!("seed {k}: {e}"));
    }
    let (index, shards) = mds_seed();
    let mut store = MemoryStore::new();
    for (name, b) in shards {
        store.insert(name.clone(), b.clone());
    }
    let d = MdsDataset::from_index(
        Arc::new(store),
        Path::new("index.json"),
        index,
        ShardOptions::default(),
    )
    .unwrap();
    d.verify(|_| {}).unwrap();
}
