//! cargo-fuzz target: any bytes as a JSON lines file, read with a few sets of options.
//!
//! `cargo +nightly fuzz run jsonl corpus/jsonl`. The first byte picks the options: the
//! fields inferred from the first lines (1 or all of them), or declared (`json`, a tensor, a
//! list, a small integer) with fill values. The reader must return a value or an `Error` for
//! every input, never panic, overflow its stack or read out of bounds; every field handed out
//! must lie inside its line but values decoded beside it (numbers, lists, strings with
//! escapes, fill values), and every tensor field must be its schema's size.

#![no_main]

use gpufeed::Dataset;
use gpufeed::format::{Codec, FieldKind};
use gpufeed::source::table::{JsonLines, JsonLinesOptions};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut o = JsonLinesOptions {
        infer_lines: if mode & 1 == 0 { 1 } else { 1000 },
        ..JsonLinesOptions::default()
    };
    if mode & 2 != 0 {
        for (name, decode) in [("a", "json"), ("b", "f32[2]"), ("c", "list[u16]"), ("d", "i8[]")] {
            o.decode.insert(name.into(), decode.parse().unwrap());
        }
        o.fill.insert("a".into(), "{\"x\": [1]}".into());
        o.fill.insert("d".into(), "-1".into());
    }
    let Ok(d) = JsonLines::from_memory("fuzz.jsonl", rest.to_vec(), &o) else {
        return;
    };
    let _ = d.describe();
    for i in (0..d.len().min(64)).chain([d.len(), u64::MAX]) {
        let Ok(s) = d.get(i) else { continue };
        let Ok(line) = s.bytes() else { continue };
        let line = line.as_ptr_range();
        for (k, f) in d.schema().fields().iter().enumerate() {
            let v = s.try_field(k).expect("every field of a sample read");
            if let FieldKind::Tensor { .. } = f.kind {
                assert_eq!(Some(v.len()), f.fixed_bytes(), "field {k}'s size");
            }
            let in_place = f.kind
                == FieldKind::Bytes {
                    codec: Codec::Json,
                };
            let inside = line.start <= v.as_ptr() && v.as_ptr_range().end <= line.end;
            assert!(
                !in_place || inside || v == b"{\"x\": [1]}",
                "field {k} outside its line"
            );
        }
    }
    let _ = d.verify(|_| {});
});
