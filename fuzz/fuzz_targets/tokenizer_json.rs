//! cargo-fuzz target: any bytes as a tokenizer.json, opened as gpufeed opens one, and a few
//! texts encoded.
//!
//! `cargo +nightly fuzz run tokenizer_json corpus/tokenizer_json`. Opening must give a
//! tokenizer or an `Error` for every input, never a panic of gpufeed's (a panic inside the
//! `tokenizers` crate, which gpufeed catches and turns into an error, is not a failure here);
//! a file the fast path takes must give the crate's ids for every text. Seeds: byte-level BPE
//! files of both splits (`gpufeed::tokenizer::synthetic`).

#![no_main]

use std::sync::Once;

use gpufeed::tokenizer::{EngineChoice, TokenizerOptions};
use libfuzzer_sys::fuzz_target;

const TEXTS: &[&str] = &[
    "Hello world's  end\n\n x",
    "<|endoftext|>日本語のテキスト hello world 123",
    "",
    "Привет ─────── ſ'S  \t\r\n",
];

static QUIET: Once = Once::new();

fuzz_target!(|data: &[u8]| {
    // libFuzzer's hook aborts on any panic, even one gpufeed catches (the crate's, turned into
    // an error); a panic that escapes still aborts, after the target's own catch.
    QUIET.call_once(|| std::panic::set_hook(Box::new(|info| eprintln!("{info}"))));
    let dir = std::env::temp_dir().join(format!("gpufeed-fuzz-tok-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join("tokenizer.json");
    if std::fs::write(&path, data).is_err() {
        return;
    }
    let options = TokenizerOptions::new().append_eos(false);
    let Ok(auto) = options.clone().open(&path) else {
        return;
    };
    let Ok(slow) = options.engine(EngineChoice::Crate).open(&path) else {
        panic!("the crate opened it once and not twice");
    };
    let (mut a, mut b) = (auto.encoder(), slow.encoder());
    for text in TEXTS {
        let (x, y) = (a.encode(text), b.encode(text));
        if let (Ok(x), Ok(y)) = (&x, &y) {
            assert_eq!(x, y, "{}: {text:?}", auto.engine());
        }
    }
});
