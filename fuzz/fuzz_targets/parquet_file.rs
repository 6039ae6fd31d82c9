//! cargo-fuzz target: any bytes, as a Parquet file: opened (footer, schema, chunks), every row
//! read, in chunks of a few rows (so that rows are selected inside pages).
//!
//! `cargo +nightly fuzz run parquet_file corpus/parquet_file`. The reader must return rows or
//! an `Error` for every input, never panic, hang or read out of bounds. The Parquet decoder
//! underneath can panic on some malformed input: the reader catches that at its boundary and
//! returns `Error::Malformed`, so this target lets a panic inside the decoder be caught there
//! (a panic hook that only stays quiet), while one that escapes the reader aborts as usual.
//! Seed the corpus with small files written by pyarrow and arrow-rs.

#![no_main]

use std::io::Write;

use gpufeed::Dataset;
use gpufeed::source::table::{TableOptions, parquet};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    std::panic::set_hook(Box::new(|_| {}));
    let path = std::env::temp_dir().join(format!("gpufeed-fuzz-{}.parquet", std::process::id()));
    let Ok(mut f) = std::fs::File::create(&path) else { return };
    if f.write_all(data).is_err() {
        return;
    }
    drop(f);
    for chunk_rows in [None, Some(3)] {
        let options = TableOptions { chunk_rows, ..TableOptions::default() };
        let Ok(d) = parquet::open(&path, &options) else { continue };
        let _ = d.describe();
        for i in 0..d.len().min(10_000) {
            if let Ok(s) = d.get(i) {
                for k in 0..d.schema().fields().len() {
                    let _ = s.field(k);
                }
                let _ = s.bytes();
            }
        }
    }
    let _ = std::fs::remove_file(&path);
});
