//! cargo-fuzz target: any bytes, opened as a Megatron indexed dataset (`.idx` + `.bin`), every
//! document read.
//!
//! `cargo +nightly fuzz run megatron_index`. The input is a 4-byte little-endian length `n`,
//! then `n` bytes of `.bin`, then the `.idx` (an input too short for its `.bin` gives it the
//! rest). The reader must return documents or an `Error` for every input, never panic or read
//! out of bounds; mapped and read with `pread` (`ReadMode`), the same tokens or the same
//! errors; `verify` must succeed exactly when every document's entries are sound (its length
//! reads), and count their tokens.

#![no_main]

use gpufeed::format::ReadMode;
use gpufeed::source::tokens::{IndexedTokens, TokenSource};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((n, rest)) = data.split_first_chunk::<4>() else {
        return;
    };
    let n = (u32::from_le_bytes(*n) as usize).min(rest.len());
    let (bin, idx) = rest.split_at(n);
    let prefix = std::env::temp_dir().join(format!("gpufeed-fuzz-megatron-{}", std::process::id()));
    if std::fs::write(prefix.with_extension("bin"), bin).is_err()
        || std::fs::write(prefix.with_extension("idx"), idx).is_err()
    {
        return;
    }
    let [map, pread] = [ReadMode::Map, ReadMode::Pread].map(|mode| read_all(&prefix, mode));
    assert_eq!(map, pread, "the read modes disagree");
    let _ = std::fs::remove_file(prefix.with_extension("bin"));
    let _ = std::fs::remove_file(prefix.with_extension("idx"));
});

type Outcome = Result<Vec<u32>, String>;

fn read_all(prefix: &std::path::Path, mode: ReadMode) -> Vec<Outcome> {
    let t = match IndexedTokens::open_with(prefix, mode) {
        Ok(t) => t,
        Err(e) => return vec![Err(e.to_string())],
    };
    let mut out = Vec::new();
    let docs = t.documents();
    let (mut tokens, mut lengths_read) = (0u64, true);
    for d in (0..docs.min(256)).chain([docs, u64::MAX]) {
        let len = t.document_len(d);
        if d < docs {
            match &len {
                Ok(n) => tokens += n,
                Err(_) => lengths_read = false,
            }
        } else {
            assert!(len.is_err(), "document {d} of {docs} has a length");
        }
        let read = len.and_then(|len| {
            // A length is at most what the .bin holds: no allocation past the input.
            assert!(len <= t.data_len(), "document {d}: {len} tokens");
            let mut v = vec![0u32; len as usize];
            t.read(d, 0, &mut v).map(|()| v)
        });
        out.push(read.map_err(|e| e.to_string()));
    }
    let verified = t.verify();
    if docs <= 256 {
        match &verified {
            Ok(n) => {
                assert!(lengths_read, "verify passed a document without a length");
                assert_eq!(*n, tokens);
            }
            Err(_) => assert!(
                !lengths_read,
                "verify failed on documents that all have one"
            ),
        }
    }
    out.push(
        verified
            .map(|n| vec![n as u32, (n >> 32) as u32])
            .map_err(|e| e.to_string()),
    );
    out
}
