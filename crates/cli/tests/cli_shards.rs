//! `gpufeed pack --shard-size ... -o DIR/`, and `inspect` and `bench` of a shard directory.

use crate::cli_common;

use cli_common::{gpufeed, s, stderr, stdout, write_npy};
use gpufeed::Dataset;
use gpufeed::format::DType;
use gpufeed::source::shards::packed::PackedShards;
use serde_json::Value;

/// 1,000 rows of 1,000 bytes (row `i` is bytes `i`) and u32 labels, as .npy files in `dir`.
fn inputs(dir: &std::path::Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let data: Vec<u8> = (0..1000u32)
        .flat_map(|i| std::iter::repeat_n(i as u8, 1000))
        .collect();
    let labels: Vec<u8> = (0..1000u32).flat_map(|i| i.to_le_bytes()).collect();
    (
        write_npy(&dir.join("x.npy"), DType::U8, &[1000, 1000], &data),
        write_npy(&dir.join("y.npy"), DType::U32, &[1000], &labels),
    )
}

#[test]
fn pack_writes_shards_that_inspect_and_bench_read() {
    let dir = tempfile::tempdir().unwrap();
    let (x, y) = inputs(dir.path());
    let out = dir.path().join("shards");
    let o = gpufeed(&[
        "pack",
        "--from",
        "npy",
        s(&x),
        "--labels",
        s(&y),
        "--shard-size",
        "100KiB",
        "-o",
        &format!("{}/", s(&out)),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("shards of"), "{}", stdout(&o));
    let d = PackedShards::open(&out).unwrap();
    assert_eq!(d.len(), 1000);
    assert!(d.shard_count() >= 10, "{} shards", d.shard_count());
    for name in d.shard_names() {
        let len = std::fs::metadata(out.join(name)).unwrap().len();
        assert!(len <= 100 << 10, "{name}: {len} bytes");
    }
    assert_eq!(
        d.get(999).unwrap().field(0),
        Some(&[999u32 as u8; 1000][..])
    );

    // A second pack into the same directory needs --force.
    let again = gpufeed(&[
        "pack",
        "--from",
        "npy",
        s(&x),
        "--shard-size",
        "100KiB",
        "-o",
        s(&out),
    ]);
    assert!(!again.status.success());
    assert!(stderr(&again).contains("--force"), "{}", stderr(&again));

    let o = gpufeed(&["inspect", s(&out), "--json", "--verify"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["format"], "packed");
    assert_eq!(v["samples"], 1000);
    assert_eq!(v["shards"], d.shard_count());
    assert_eq!(v["verified"], true);
    assert_eq!(v["fields"][0]["name"], "data");

    let o = gpufeed(&[
        "bench",
        s(&out),
        "--json",
        "--epochs",
        "2",
        "--batch-size",
        "64",
        "--workers",
        "2",
        "--shuffle-window",
        "3",
        "--shuffle-block",
        "16",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["samples"], 2000);
    assert_eq!(v["shards"], d.shard_count());
    assert_eq!(v["shuffle_blocks"], serde_json::json!([3, 16]));
    assert!(v["store"].is_null(), "local shards fetch nothing");
    assert!(v["baseline_ratio"].as_f64().is_some());
}

#[test]
fn bad_shard_sizes_and_flags_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (x, _) = inputs(dir.path());
    let o = gpufeed(&[
        "pack",
        "--from",
        "npy",
        s(&x),
        "--shard-size",
        "12 parsecs",
        "-o",
        s(&dir.path().join("d")),
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--shard-size"), "{}", stderr(&o));
    // A file where the directory should be.
    let o = gpufeed(&[
        "pack",
        "--from",
        "npy",
        s(&x),
        "--shard-size",
        "1MiB",
        "-o",
        s(&x),
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("directory of shards"), "{}", stderr(&o));
    // The two-level shuffle's flags need shards.
    let file = dir.path().join("one.gfd");
    let o = gpufeed(&["pack", "--from", "npy", s(&x), "-o", s(&file)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = gpufeed(&["bench", s(&file), "--shuffle-window", "2"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("sharded"), "{}", stderr(&o));
}
