//! The cost of opening a sharded data set with a large index: time, and memory kept per shard.
//!
//! ```sh
//! cargo bench --bench index_open -- [--shards 200000] [--rounds 3] [--dir DIR]
//! ```
//!
//! Writes an MDS `index.json` of `--shards` entries into `--dir` (default: a temporary
//! directory), each as MosaicML Streaming's `MDSWriter` writes them, with the 16 columns of the
//! streaming fixture (`tests/fixtures/streaming/mds`: every encoding gpufeed reads) and three
//! hashes per shard (`sha1`, `xxh3_64`, `xxh64`); no shard file (opening reads the index only).
//! Then, `--rounds` times, opens it with `MdsDataset::open` and prints one JSON line: the time
//! to open, the resident memory the open data set keeps (after `malloc_trim`, less what was
//! resident before) in all and per shard, and the peak resident memory during the open (the
//! peak is reset before each open through `/proc/self/clear_refs`).

use std::path::PathBuf;
use std::time::Instant;

use gpufeed::Dataset;
use gpufeed::source::shards::mds::MdsDataset;

/// A field of `/proc/self/status` (`VmRSS`, `VmHWM`), in bytes.
fn status_bytes(field: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Returns freed heap to the system, so that resident memory is what is still allocated.
fn trim() {
    // SAFETY: malloc_trim only releases free memory of the allocator's arenas.
    unsafe {
        libc::malloc_trim(0);
    }
}

fn write_index(dir: &std::path::Path, shards: usize) -> u64 {
    let names = [
        "dyn", "dyn_t", "f16", "f32", "f64", "fixed", "i32", "i8", "id", "img", "mask", "meta",
        "name", "raw", "u16", "u64",
    ];
    let encodings = [
        "ndarray",
        "ndarray:float32",
        "float16",
        "float32",
        "float64",
        "ndarray:int16:2,3",
        "int32",
        "int8",
        "int",
        "jpeg",
        "png",
        "json",
        "str",
        "bytes",
        "uint16",
        "uint64",
    ];
    let sizes = [
        None,
        None,
        Some(2),
        Some(4),
        Some(8),
        Some(12),
        Some(4),
        Some(1),
        Some(8),
        None,
        None,
        None,
        None,
        None,
        Some(2),
        Some(8),
    ];
    let entries: Vec<serde_json::Value> = (0..shards)
        .map(|k| {
            let h = xxhash_rust::xxh3::xxh3_64(&k.to_le_bytes());
            serde_json::json!({
                "column_encodings": encodings,
                "column_names": names,
                "column_sizes": sizes,
                "compression": null,
                "format": "mds",
                "hashes": ["sha1", "xxh3_64", "xxh64"],
                "raw_data": {
                    "basename": format!("shard.{k:05}.mds"),
                    "bytes": 67_108_000 + (h % 1000),
                    "hashes": {
                        "sha1": format!("{h:016x}{h:016x}{:08x}", h as u32),
                        "xxh3_64": format!("{h:016x}"),
                        "xxh64": format!("{:016x}", h.rotate_left(7)),
                    },
                },
                "samples": 440,
                "size_limit": 67_108_864,
                "version": 2,
                "zip_data": null,
            })
        })
        .collect();
    let text = serde_json::to_vec(&serde_json::json!({"version": 2, "shards": entries}))
        .expect("serialize the index");
    std::fs::write(dir.join("index.json"), &text).expect("write index.json");
    text.len() as u64
}

fn main() {
    let (mut shards, mut rounds, mut dir) = (200_000usize, 3usize, None::<PathBuf>);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--shards" => shards = value().parse().expect("--shards N"),
            "--rounds" => rounds = value().parse().expect("--rounds N"),
            "--dir" => dir = Some(PathBuf::from(value())),
            // What `cargo bench` passes to every bench binary.
            "--bench" => {}
            other => panic!("unknown argument {other}"),
        }
    }
    let temp = tempfile::tempdir().expect("a temporary directory");
    let dir = dir.unwrap_or_else(|| temp.path().to_path_buf());
    std::fs::create_dir_all(&dir).expect("create --dir");
    let bytes = write_index(&dir, shards);
    for round in 0..rounds {
        trim();
        let before = status_bytes("VmRSS");
        let _ = std::fs::write("/proc/self/clear_refs", "5");
        let started = Instant::now();
        let d = MdsDataset::open(&dir).expect("open the index");
        let seconds = started.elapsed().as_secs_f64();
        let peak = status_bytes("VmHWM");
        trim();
        let kept = status_bytes("VmRSS").saturating_sub(before);
        assert_eq!(d.len(), shards as u64 * 440);
        println!(
            "{{\"round\": {round}, \"shards\": {shards}, \"index_bytes\": {bytes}, \"open_s\": {seconds:.3}, \"kept_bytes\": {kept}, \"kept_per_shard\": {}, \"peak_rss_bytes\": {peak}}}",
            kept / shards as u64
        );
        drop(d);
    }
}
