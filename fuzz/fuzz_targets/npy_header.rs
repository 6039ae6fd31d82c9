//! cargo-fuzz target: any bytes, opened as a `.npy` array, every row read.
//!
//! `cargo +nightly fuzz run npy_header`. The parser must return an array or an `Error` for
//! every input, never panic or read out of bounds; mapped and read with `pread` (`ReadMode`),
//! the same rows or the same errors.

#![no_main]

use std::io::Write;

use gpufeed::format::ReadMode;
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
    let [map, pread] = [ReadMode::Map, ReadMode::Pread].map(|mode| {
        let a = match NpyArray::open_with(&path, "data", mode) {
            Ok(a) => a,
            Err(e) => return vec![Err(e.to_string())],
        };
        let n = a.len();
        let mut out = Vec::new();
        for i in (0..n.min(64)).chain([n, u64::MAX]) {
            out.push(match a.get(i) {
                Ok(s) => {
                    assert!(a.row_bytes() > 0);
                    assert_eq!(s.len(), a.row_bytes());
                    let mut slot = vec![0u8; a.row_bytes()];
                    s.copy_field_into(0, &mut slot)
                        .map(|()| slot)
                        .map_err(|e| e.to_string())
                }
                Err(e) => Err(e.to_string()),
            });
        }
        out
    });
    assert_eq!(map, pread, "the read modes disagree");
    let _ = std::fs::remove_file(&path);
});
