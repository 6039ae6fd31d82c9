//! cargo-fuzz target: any bytes as an MDS shard file or an MDS `index.json`, read with the
//! fixture's other half (`tests/fixtures/streaming/mds`).
//!
//! `cargo +nightly fuzz run mds_shard corpus/mds_shard`. The first byte picks the part:
//! even, the rest is shard 0 (the index's size for it set to the input's, so that the input
//! reaches the shard's tables); odd, the rest is `index.json` over the fixture's four shards.
//! The reader must return a value or an `Error` for every input, plainly and verified, never
//! panic or read out of bounds; every field handed out must lie inside its sample, but
//! numbers decoded from text columns, held beside it.

#![no_main]

use std::path::Path;
use std::sync::Arc;

use gpufeed::Dataset;
use gpufeed::format::{DType, FieldKind};
use gpufeed::source::shards::mds::MdsDataset;
use gpufeed::source::shards::{MemoryStore, ShardOptions};
use libfuzzer_sys::fuzz_target;

const INDEX: &[u8] = include_bytes!("../../tests/fixtures/streaming/mds/index.json");
const SHARDS: [(&str, &[u8]); 4] = [
    (
        "shard.00000.mds",
        include_bytes!("../../tests/fixtures/streaming/mds/shard.00000.mds"),
    ),
    (
        "shard.00001.mds",
        include_bytes!("../../tests/fixtures/streaming/mds/shard.00001.mds"),
    ),
    (
        "shard.00002.mds",
        include_bytes!("../../tests/fixtures/streaming/mds/shard.00002.mds"),
    ),
    (
        "shard.00003.mds",
        include_bytes!("../../tests/fixtures/streaming/mds/shard.00003.mds"),
    ),
];

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut store = MemoryStore::new();
    for (name, b) in SHARDS {
        store.insert(name, b.to_vec());
    }
    let index = if mode % 2 == 0 {
        store.insert("shard.00000.mds", rest.to_vec());
        // The fixture's index with shard 0's size set to the input's.
        let text = String::from_utf8_lossy(INDEX).replacen(
            &format!("\"bytes\": {}", SHARDS[0].1.len()),
            &format!("\"bytes\": {}", rest.len()),
            1,
        );
        text.into_bytes()
    } else {
        rest.to_vec()
    };
    let store = Arc::new(store);
    for verify in [false, true] {
        let options = ShardOptions {
            verify,
            ..ShardOptions::default()
        };
        let Ok(d) = MdsDataset::from_index(store.clone(), Path::new("index.json"), &index, options)
        else {
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
                        // `str_int` and `str_float` columns are decoded to an i64 or an f64
                        // held beside the sample's bytes, not in them.
                        let decoded_number = v.len() == 8
                            && s.schema().fields().get(k).is_some_and(|f| {
                                [DType::I64, DType::F64].into_iter().any(|dtype| {
                                    f.kind
                                        == FieldKind::Tensor {
                                            dtype,
                                            shape: Vec::new(),
                                        }
                                })
                            });
                        assert!(inside || decoded_number, "field {k} outside its sample");
                    }
                }
            }
        }
        let _ = d.verify(|_| {});
    }
});
