//! The cost of a token source's fingerprint (what a resume checks a state's data by) against
//! the build of a token loader over a large Megatron dataset.
//!
//! ```sh
//! cargo bench --bench token_fingerprint -- [--documents 100000000] [--rounds 3] [--dir DIR]
//! ```
//!
//! Writes a Megatron `.idx` of `--documents` one-sequence documents of 1 to 4 uint16 tokens
//! (34 + 20 bytes a document: 2.0 GB for 10^8) and its `.bin` into `--dir` (default: a
//! temporary directory). Then, `--rounds` times and in both read modes, prints one JSON line:
//! the time to open the dataset with both files dropped from the page cache
//! (`posix_fadvise(DONTNEED)` after an `fsync`: what a first open after a reboot reads); to
//! take its fingerprint with both files dropped again (`fingerprint_cold_ms`: more than a
//! loader's build pays, whose pass over every entry of the index comes first) and warm; and to
//! build a token loader over it right after (concatenated rows of 2,048: the pass over every
//! entry of the index, then the fingerprint), the index as the fingerprint left it: mapped and
//! cold, or read into memory by the open.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use gpufeed::source::ReadMode;
use gpufeed::source::tokens::{IndexedTokens, TokenSource};
use gpufeed::tokens::TokenLoader;

/// Writes `prefix.idx` and `prefix.bin`: `documents` documents of one sequence of 1 to 4
/// tokens each. Returns the two files' sizes.
fn write_dataset(prefix: &Path, documents: u64) -> (u64, u64) {
    use std::io::Write;
    let length = |d: u64| 1 + (xxhash_rust::xxh3::xxh3_64(&d.to_le_bytes()) % 4) as i32;
    let (idx_path, bin_path) = (prefix.with_extension("idx"), prefix.with_extension("bin"));
    let mut idx = std::io::BufWriter::with_capacity(
        8 << 20,
        std::fs::File::create(&idx_path).expect("create the .idx"),
    );
    let mut bin = std::io::BufWriter::with_capacity(
        8 << 20,
        std::fs::File::create(&bin_path).expect("create the .bin"),
    );
    let put = |w: &mut std::io::BufWriter<std::fs::File>, b: &[u8]| {
        w.write_all(b).expect("write the dataset")
    };
    put(&mut idx, b"MMIDIDX\x00\x00");
    put(&mut idx, &1u64.to_le_bytes());
    put(&mut idx, &[8]);
    put(&mut idx, &documents.to_le_bytes());
    put(&mut idx, &(documents + 1).to_le_bytes());
    for d in 0..documents {
        put(&mut idx, &length(d).to_le_bytes());
    }
    let mut at = 0i64;
    for d in 0..documents {
        put(&mut idx, &at.to_le_bytes());
        let len = length(d);
        for t in 0..len {
            put(&mut bin, &((d as u16) ^ (t as u16)).to_le_bytes());
        }
        at += 2 * i64::from(len);
    }
    for d in 0..=documents {
        put(&mut idx, &(d as i64).to_le_bytes());
    }
    let size = |w: std::io::BufWriter<std::fs::File>| {
        let f = w.into_inner().expect("flush the dataset");
        f.sync_all().expect("sync the dataset");
        f.metadata().expect("stat the dataset").len()
    };
    (size(idx), size(bin))
}

/// Drops `path`'s pages from the page cache (they are clean: the file was synced).
fn drop_cache(path: &Path) {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).expect("open to drop from the cache");
    // SAFETY: posix_fadvise on an open descriptor only advises the kernel; it touches no
    // memory of this process.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(rc, 0, "posix_fadvise");
}

fn main() {
    let (mut documents, mut rounds, mut dir) = (100_000_000u64, 3usize, None::<PathBuf>);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--documents" => documents = value().parse().expect("--documents N"),
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
    let prefix = dir.join("large");
    let started = Instant::now();
    let (idx_bytes, bin_bytes) = write_dataset(&prefix, documents);
    eprintln!(
        "wrote {idx_bytes} + {bin_bytes} bytes in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    for round in 0..rounds {
        for (mode, name) in [(ReadMode::Map, "mmap"), (ReadMode::Pread, "pread")] {
            drop_cache(&prefix.with_extension("idx"));
            drop_cache(&prefix.with_extension("bin"));
            let t = Instant::now();
            let source = Arc::new(IndexedTokens::open_with(&prefix, mode).expect("open"));
            let open_s = t.elapsed().as_secs_f64();
            // In pread mode the open read the index whole: drop it again for a cold print.
            drop_cache(&prefix.with_extension("idx"));
            drop_cache(&prefix.with_extension("bin"));
            let t = Instant::now();
            let cold = source.fingerprint().expect("fingerprint");
            let cold_ms = t.elapsed().as_secs_f64() * 1e3;
            let t = Instant::now();
            let warm = source.fingerprint().expect("fingerprint");
            let warm_ms = t.elapsed().as_secs_f64() * 1e3;
            assert_eq!(cold, warm);
            let t = Instant::now();
            let loader = TokenLoader::builder(2048, 8)
                .source(source)
                .workers(1)
                .build()
                .expect("build");
            let build_s = t.elapsed().as_secs_f64();
            drop(loader);
            println!(
                "{{\"round\": {round}, \"mode\": \"{name}\", \"documents\": {documents}, \"idx_bytes\": {idx_bytes}, \"bin_bytes\": {bin_bytes}, \"open_s\": {open_s:.3}, \"fingerprint_cold_ms\": {cold_ms:.2}, \"fingerprint_warm_ms\": {warm_ms:.3}, \"build_s\": {build_s:.2}}}"
            );
        }
    }
}
