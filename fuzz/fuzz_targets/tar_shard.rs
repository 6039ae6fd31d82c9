//! cargo-fuzz target: any bytes, as a WebDataset tar shard: indexed (the tar reader and
//! webdataset's key rules, with and without skipping members that have no extension), then
//! opened as a dataset (fields from the shard, samples missing one refused or skipped) and
//! every sample read.
//!
//! `cargo +nightly fuzz run tar_shard corpus/tar_shard`. The reader must return a value or an
//! `Error` for every input, never panic or read out of bounds; every field handed out must lie
//! inside its sample, but for integers decoded from text members, held beside it. Each input
//! is tried twice: as it is, and with the checksum of every
//! 512-byte block re-sealed as if it were a tar header, so that mutations of a header's fields
//! get past its checksum. The corpus seeds are the fixtures of `tests/shard_fixtures.rs`.

#![no_main]

use std::path::Path;
use std::sync::Arc;

use gpufeed::Dataset;
use gpufeed::format::{DType, FieldKind};
use gpufeed::source::shards::MemoryStore;
use gpufeed::source::shards::webdataset::{
    MissingFieldPolicy, TarIndex, UnkeyedPolicy, WebDataset, WebDatasetOptions,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    exercise(data);
    let mut sealed = data.to_vec();
    for block in sealed.chunks_exact_mut(512) {
        if block.iter().any(|&b| b != 0) {
            block[148..156].copy_from_slice(b"        ");
            let sum: u32 = block.iter().map(|&b| u32::from(b)).sum();
            block[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
        }
    }
    if sealed != data {
        exercise(&sealed);
    }
});

fn exercise(bytes: &[u8]) {
    for unkeyed in [UnkeyedPolicy::Skip, UnkeyedPolicy::Error] {
        if let Ok(index) = TarIndex::build(Path::new("f.tar"), bytes, unkeyed) {
            for i in 0..index.len() as usize {
                for m in index.members(i).unwrap_or_default() {
                    assert!(m.offset + m.size <= bytes.len() as u64);
                }
            }
        }
    }
    let mut store = MemoryStore::new();
    store.insert("f.tar", bytes.to_vec());
    let store = Arc::new(store);
    for missing in [MissingFieldPolicy::Error, MissingFieldPolicy::Skip] {
        let options = WebDatasetOptions {
            // Not a directory: the index is never cached (the cache is fuzzed in tests/).
            cache_dir: Some("/dev/null/gpufeed-fuzz".into()),
            missing,
            ..WebDatasetOptions::default()
        };
        let Ok(d) = WebDataset::from_store(store.clone(), vec!["f.tar".into()], options) else {
            continue;
        };
        let n = d.len();
        for i in (0..n.min(64)).chain([n, u64::MAX]) {
            if let Ok(s) = d.get(i)
                && let Ok(bytes) = s.bytes()
            {
                let span = bytes.as_ptr_range();
                for k in 0..=s.schema().fields().len() {
                    if let Some(v) = s.field(k) {
                        let r = v.as_ptr_range();
                        let inside = r.start >= span.start && r.end <= span.end;
                        // An integer member (`cls`, `id`, ...: webdataset writes `str(int)`) is
                        // decoded to an i64 held beside the sample's bytes, not in them.
                        let decoded_int = v.len() == 8
                            && s.schema().fields().get(k).is_some_and(|f| {
                                f.kind
                                    == FieldKind::Tensor {
                                        dtype: DType::I64,
                                        shape: Vec::new(),
                                    }
                            });
                        assert!(inside || decoded_int, "field {k} outside its sample");
                    }
                }
            }
            let _ = d.key(i);
        }
    }
}
