//! Memory against the number of workers: one epoch over 2M small records with 1 and with 8
//! worker threads, each in a fresh process, reading the process's PSS from
//! `/proc/self/smaps_rollup` (Linux) during the epoch.
//!
//! ```text
//! cargo run --release --example memory_vs_workers [-- RECORDS]
//! ```
//!
//! PyTorch's DataLoader grows by +0.4 GiB PSS at 1 worker and +2.7 GiB at 8 over a 2M-entry
//! index (copy-on-read of Python objects). Here the workers share the dataset, so the growth
//! from 1 to 8 workers should be the batch buffers in flight and the threads' stacks, nothing
//! that scales with the data.

use std::path::Path;
use std::process::Command;

use gpufeed::format::{DType, Field, RecordWriter, Schema};
use gpufeed::{Error, Loader, RecordFile, Result};

const BATCH: usize = 1024;

/// PSS of this process in bytes, from smaps_rollup.
fn pss() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/smaps_rollup").ok()?;
    let line = text.lines().find(|l| l.starts_with("Pss:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

fn child(path: &Path, workers: usize) -> Result<()> {
    let file = RecordFile::open(path)?;
    let mut loader = Loader::builder(file)
        .batch_size(BATCH)
        .shuffle(1)
        .workers(workers)
        .shard(0, 1)
        .build()?;
    let before = pss().unwrap_or(0);
    let mut peak = before;
    let mut sum = 0u64;
    for (k, batch) in loader.by_ref().enumerate() {
        let batch = batch?;
        sum += batch
            .field::<u32>("label")?
            .iter()
            .map(|&l| l as u64)
            .sum::<u64>();
        if k % 64 == 0 {
            peak = peak.max(pss().unwrap_or(0));
        }
    }
    peak = peak.max(pss().unwrap_or(0));
    let stats = loader.stats();
    // One line for the parent: workers, peak PSS, pool peak reserved, checksum of labels.
    println!(
        "{workers} {peak} {} {} {sum}",
        stats.pool.peak_reserved_bytes, stats.pool.peak_allocated_bytes
    );
    Ok(())
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    if let Some("--child") = args.next().as_deref() {
        let path = args
            .next()
            .ok_or_else(|| Error::user("--child PATH WORKERS"))?;
        let workers = args
            .next()
            .and_then(|w| w.parse().ok())
            .ok_or_else(|| Error::user("--child PATH WORKERS"))?;
        return child(Path::new(&path), workers);
    }
    let records: u64 = std::env::args()
        .nth(1)
        .and_then(|r| r.parse().ok())
        .unwrap_or(2_000_000);
    if pss().is_none() {
        return Err(Error::user(
            "no /proc/self/smaps_rollup: this example reads PSS on Linux only",
        ));
    }
    let dir = std::env::temp_dir().join(format!("gpufeed-memory-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(Error::user)?;
    let path = dir.join("small.gfd");
    let schema = Schema::new(vec![
        Field::tensor("features", DType::U8, &[64]),
        Field::tensor("label", DType::U32, &[]),
    ])?;
    let mut w = RecordWriter::create(&path, schema)?;
    for i in 0..records {
        w.append(&[&[(i % 256) as u8; 64], &((i % 1000) as u32).to_le_bytes()])?;
    }
    w.finish()?;
    let exe = std::env::current_exe().map_err(Error::user)?;
    let mut rows = Vec::new();
    for workers in [1usize, 8] {
        let out = Command::new(&exe)
            .args(["--child", &path.display().to_string(), &workers.to_string()])
            .output()
            .map_err(Error::user)?;
        if !out.status.success() {
            return Err(Error::user(format!(
                "child with {workers} workers failed: {}",
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let f: Vec<u64> = text
            .split_whitespace()
            .filter_map(|x| x.parse().ok())
            .collect();
        if f.len() != 5 {
            return Err(Error::user(format!("unexpected child output {text:?}")));
        }
        rows.push(f);
    }
    let _ = std::fs::remove_dir_all(&dir);
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "{records} records of 68 bytes, batch {BATCH}, one shuffled epoch, PSS from /proc/self/smaps_rollup"
    );
    println!(
        "{:>8} {:>14} {:>20} {:>26}",
        "workers", "peak PSS MiB", "pool reserved MiB", "PSS - pool reserved MiB"
    );
    for r in &rows {
        println!(
            "{:>8} {:>14.1} {:>20.1} {:>26.1}",
            r[0],
            mib(r[1]),
            mib(r[2]),
            mib(r[1].saturating_sub(r[2]))
        );
    }
    let growth =
        mib(rows[1][1].saturating_sub(rows[1][2])) - mib(rows[0][1].saturating_sub(rows[0][2]));
    println!(
        "growth from 1 to 8 workers beyond the batch buffers: {growth:.1} MiB (target < 64 MiB)"
    );
    if rows[0][4] != rows[1][4] {
        return Err(Error::user("the two runs saw different labels"));
    }
    Ok(())
}
