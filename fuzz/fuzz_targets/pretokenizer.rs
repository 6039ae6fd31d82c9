//! cargo-fuzz target: any text, split by the fast path's GPT-2 and Llama 3 pre-tokenizers and
//! by the `tokenizers` crate's, and encoded by both engines with byte-level fixtures.
//!
//! `cargo +nightly fuzz run pretokenizer corpus/pretokenizer`. The pieces (byte ranges) must
//! be the crate's, and the ids of both engines equal, for every split and `ignore_merges`
//! (bytes that are not UTF-8 are read as text with U+FFFD in their place). Seeds: texts in
//! several scripts with the cases the splits must get right.

#![no_main]

use std::sync::LazyLock;

use gpufeed::tokenizer::synthetic::{byte_level, crate_pieces, fast_pieces};
use gpufeed::tokenizer::{EngineChoice, Split, Tokenizer, TokenizerOptions};
use libfuzzer_sys::fuzz_target;

/// (fast, crate) tokenizers of each split, with and without `ignore_merges`.
static PAIRS: LazyLock<Vec<(Tokenizer, Tokenizer)>> = LazyLock::new(|| {
    let dir = std::env::temp_dir().join(format!("gpufeed-fuzz-pretok-{}", std::process::id()));
    let mut out = vec![];
    for (i, split) in [Split::Gpt2, Split::Llama3].into_iter().enumerate() {
        for ignore in [false, true] {
            let d = dir.join(format!("{i}-{ignore}"));
            std::fs::create_dir_all(&d).expect("a temporary directory");
            let json = byte_level(split, ignore).to_string();
            std::fs::write(d.join("tokenizer.json"), json).expect("a temporary file");
            let open = |engine| {
                TokenizerOptions::new()
                    .append_eos(false)
                    .engine(engine)
                    .open(&d)
                    .expect("the fixture opens")
            };
            out.push((open(EngineChoice::Fast), open(EngineChoice::Crate)));
        }
    }
    out
});

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    for split in [Split::Gpt2, Split::Llama3] {
        assert_eq!(
            fast_pieces(split, &text),
            crate_pieces(split, &text),
            "{split:?}: {text:?}"
        );
    }
    for (fast, slow) in PAIRS.iter() {
        let a = fast.encoder().encode(&text).expect("the fast path encodes");
        let b = slow.encoder().encode(&text).expect("the crate encodes");
        assert_eq!(a, b, "{text:?}");
    }
});
