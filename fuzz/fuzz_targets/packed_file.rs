//! cargo-fuzz target: any bytes, opened as a packed record file, read and verified.
//!
//! `cargo +nightly fuzz run packed_file`. The reader must return a value or an `Error` for
//! every input, never panic or read out of bounds. Each input is tried twice: as it is, and with
//! its footer checksum re-sealed (when the footer names a schema range inside the input), so
//! that mutations of the header, schema, footer and tables get past that checksum. Seed the
//! corpus with files written by `gpufeed pack`.

#![no_main]

use std::io::Write;

use gpufeed::format::{ReadOptions, RecordFile};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    exercise(data);
    let mut sealed = data.to_vec();
    if reseal(&mut sealed) {
        exercise(&sealed);
    }
});

/// Recomputes the footer checksum; false when the footer names no schema inside the input.
fn reseal(b: &mut [u8]) -> bool {
    if b.len() < 128 {
        return false;
    }
    let f = b.len() - 64;
    let u = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or([0; 8]));
    let (so, sl) = (u(f + 24), u(f + 32));
    let Some(end) = so.checked_add(sl).filter(|&e| e <= b.len() as u64) else {
        return false;
    };
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(&b[..64]);
    h.update(&b[so as usize..end as usize]);
    h.update(&b[f..f + 56]);
    let sum = h.digest();
    b[f + 56..f + 64].copy_from_slice(&sum.to_le_bytes());
    true
}

fn exercise(data: &[u8]) {
    // RecordFile maps a file: give it one.
    let path = std::env::temp_dir().join(format!("gpufeed-fuzz-packed-{}", std::process::id()));
    let Ok(mut f) = std::fs::File::create(&path) else {
        return;
    };
    if f.write_all(data).is_err() {
        return;
    }
    drop(f);
    for options in [
        ReadOptions::default(),
        ReadOptions {
            verify_checksums: true,
            ..Default::default()
        },
    ] {
        let Ok(file) = RecordFile::open_with(&path, options) else {
            continue;
        };
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
}
