//! cargo-fuzz target: any bytes, opened as a packed record file, read and verified.
//!
//! `cargo +nightly fuzz run packed_file`. The reader must return a value or an `Error` for
//! every input, never panic or read out of bounds. Seed the corpus with files written by
//! `gpufeed pack` for deeper coverage.

#![no_main]

use std::io::Write;

use gpufeed::format::{ReadOptions, RecordFile};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // RecordFile maps a file: give it one.
    let path = std::env::temp_dir().join(format!("gpufeed-fuzz-packed-{}", std::process::id()));
    let Ok(mut f) = std::fs::File::create(&path) else { return };
    if f.write_all(data).is_err() {
        return;
    }
    drop(f);
    for options in [ReadOptions::default(), ReadOptions { verify_checksums: true }] {
        let Ok(file) = RecordFile::open_with(&path, options) else { continue };
        let n = file.len();
        let fields = file.schema().fields().len();
        for i in (0..n.min(64)).chain([n, u64::MAX]) {
            if let Ok(s) = file.get(i) {
                for k in 0..=fields {
                    let _ = s.field(k);
                }
            }
            let _ = file.get_bytes(i);
        }
        let _ = file.verify(|_| {});
    }
    let _ = std::fs::remove_file(&path);
});
