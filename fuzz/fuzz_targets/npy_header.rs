//! cargo-fuzz target: any bytes, opened as a `.npy` array, every row read.
//!
//! `cargo +nightly fuzz run npy_header`. The parser must return an array or an `Error` for
//! every input, never panic or read out of bounds.

#![no_main]

use std::io::Write;

use gpufeed::{Dataset, NpyArray};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = std::env::temp_dir().join(format!("gpufeed-fuzz-npy-{}.npy", std::process::id()));
    let Ok(mut f) = std::fs::File::create(&path) else {
        return;
    };
    if f.write_all(data).is_err() {
        return;
    }
    drop(f);
    if let Ok(a) = NpyArray::open(&path) {
        let n = a.len();
        for i in (0..n.min(64)).chain([n, u64::MAX]) {
            if let Ok(s) = a.get(i) {
                assert_eq!(s.len(), a.row_bytes());
            }
        }
    }
    let _ = std::fs::remove_file(&path);
});
