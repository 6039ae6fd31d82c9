//! cargo-fuzz target: any bytes, opened as a packed record file, read and verified.
//!
//! `cargo +nightly fuzz run packed_file`. The reader must return a value or an `Error` for
//! every input, never panic or read out of bounds. Each input is tried twice: as it is, and with
//! its footer checksum re-sealed (when the footer names a schema range inside the input), so
//! that mutations of the header, schema, footer and tables get past that checksum. Each is read
//! mapped and with `pread` (`ReadMode`), with and without checksums: the two modes must give
//! the same bytes and the same errors, and every record of a fixed-size schema must be one
//! stride long. Seed the corpus with files written by `gpufeed pack`.

#![no_main]

use std::io::Write;

use gpufeed::format::{ReadMode, ReadOptions, RecordFile};
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

type Outcome = Result<Vec<Vec<u8>>, String>;

fn exercise(data: &[u8]) {
    // RecordFile maps (or preads) a file: give it one.
    let path = std::env::temp_dir().join(format!("gpufeed-fuzz-packed-{}", std::process::id()));
    let Ok(mut f) = std::fs::File::create(&path) else {
        return;
    };
    if f.write_all(data).is_err() {
        return;
    }
    drop(f);
    for verify_checksums in [false, true] {
        let [map, pread] = [ReadMode::Map, ReadMode::Pread].map(|mode| {
            read_all(
                &path,
                ReadOptions {
                    mode,
                    verify_checksums,
                },
            )
        });
        assert_eq!(map, pread, "the read modes disagree");
    }
    let _ = std::fs::remove_file(&path);
}

fn read_all(path: &std::path::Path, options: ReadOptions) -> Vec<Outcome> {
    let file = match RecordFile::open_with(path, options) {
        Ok(f) => f,
        Err(e) => return vec![Err(e.to_string())],
    };
    let mut out = Vec::new();
    let n = file.len();
    let fields = file.schema().fields().len();
    for i in (0..n.min(64)).chain([n, u64::MAX]) {
        out.push(match file.get(i) {
            Ok(s) => {
                if let Some(stride) = file.stride() {
                    assert_eq!(s.len() as u64, stride);
                }
                let mut got = Vec::new();
                for k in 0..=fields {
                    if let Some(v) = s.field(k) {
                        let mut slot = vec![0u8; v.len()];
                        if file.schema().is_fixed() {
                            file.get(i)
                                .and_then(|t| t.copy_field_into(k, &mut slot))
                                .map_err(|e| e.to_string())
                                .map(|()| assert_eq!(slot, v))
                                .unwrap_or_else(|e| panic!("{e}"));
                        }
                        got.push(v.to_vec());
                    }
                }
                Ok(got)
            }
            Err(e) => Err(e.to_string()),
        });
        out.push(
            file.get_bytes(i)
                .map(|b| vec![b.to_vec()])
                .map_err(|e| e.to_string()),
        );
    }
    out.push(
        file.verify(|_| {})
            .map(|()| Vec::new())
            .map_err(|e| e.to_string()),
    );
    out
}
