//! The tokenizer layer against the `tokenizers` crate, on small tokenizer.json files made here
//! (`synthetic`): the fast path's pieces and ids equal the crate's; BOS and EOS as the options
//! and the hub's configuration files say; bad files as typed errors.

use std::path::Path;

use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;
use crate::ErrorKind;

/// Texts with the cases the splits must get right.
const EDGES: &[&str] = &[
    "Hello world's  end\n\n x",
    "a  \nb",
    " 123 ?!",
    "x   ",
    "I'M HERE'S 'ſ 'Ll 'RE I'ſx and 'Sx",
    "日本語のテキスト、です。",
    "Größe\u{a0}über\u{3000}Straße  \t\n\r\n",
    "12345678 ½ ² Ⅻ ٣٤٥",
    "<|endoftext|>foo<|begin_of_text|>bar hello world!hello worlds",
    "emoji 👍🏽 and ZWJ 👨\u{200d}👩\u{200d}👧",
    "tab\tword\n\tindent",
    "   ",
    "",
    "'",
    "a'",
    "'s",
    "\n",
    " \n ",
    "x\r\ny",
    "(word) [x]{y} ''quote''",
    "कि हिन्दी नमस्ते",
    "ﬁ ligature Ǆ ǅ ﬅ 'ﬅ",
    "Привет мир, это тест ство",
    "the the the  the\u{85}the\u{2028}x",
    "────────────────────────────────────────────────────────────────────",
];

/// A long piece (more than 128 bytes: the heap path), and a very long one.
fn long_texts() -> Vec<String> {
    vec![
        format!("x {} y", "─".repeat(200)),
        "=".repeat(300),
        "字".repeat(200),
        "a".repeat(1000),
        "the".repeat(2000),
        format!(" {}", "Привет".repeat(500)),
    ]
}

/// Writes `json` as DIR/tokenizer.json and returns DIR.
fn write_dir(json: &Value) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("tokenizer.json"),
        serde_json::to_string(json).unwrap(),
    )
    .unwrap();
    dir
}

fn open(dir: &Path, options: TokenizerOptions) -> Tokenizer {
    options.open(dir).unwrap()
}

/// The crate's own ids for `text` (`encode(text, add_special_tokens)`), from the file.
fn crate_ids(path: &Path, text: &str, add_special_tokens: bool) -> Vec<u32> {
    let t = tokenizers::Tokenizer::from_file(path).unwrap();
    t.encode(text, add_special_tokens)
        .unwrap()
        .get_ids()
        .to_vec()
}

/// Every fixture: both splits, with and without `ignore_merges`.
fn fixtures() -> Vec<(String, Value)> {
    let mut out = vec![];
    for split in [Split::Gpt2, Split::Llama3] {
        for ignore in [false, true] {
            out.push((
                format!("{split:?} ignore_merges={ignore}"),
                synthetic::byte_level(split, ignore),
            ));
        }
    }
    out
}

#[test]
fn the_fast_path_takes_the_byte_level_fixtures() {
    for (name, json) in fixtures() {
        let dir = write_dir(&json);
        let t = open(dir.path(), TokenizerOptions::new());
        assert!(
            matches!(t.engine(), Engine::FastBpe { .. }),
            "{name}: {}",
            t.engine()
        );
        assert!(t.engine().to_string().starts_with("fast byte-level BPE"));
    }
}

#[test]
fn fast_ids_equal_the_crate_s_and_python_s_default() {
    let mut texts: Vec<String> = EDGES.iter().map(|s| s.to_string()).collect();
    texts.extend(long_texts());
    for (name, json) in fixtures() {
        let dir = write_dir(&json);
        let path = dir.path().join("tokenizer.json");
        for add in [true, false] {
            let plain = || {
                TokenizerOptions::new()
                    .append_eos(false)
                    .add_special_tokens(add)
            };
            let fast = open(dir.path(), plain().engine(EngineChoice::Fast));
            let slow = open(dir.path(), plain().engine(EngineChoice::Crate));
            let (mut f, mut s) = (fast.encoder(), slow.encoder());
            for text in &texts {
                let want = crate_ids(&path, text, add);
                assert_eq!(f.encode(text).unwrap(), want, "{name} add={add}: {text:?}");
                assert_eq!(s.encode(text).unwrap(), want, "{name} add={add}: {text:?}");
            }
        }
    }
}

#[test]
fn the_cache_does_not_change_the_ids() {
    // The same texts twice through one encoder (the second time from the cache), and through
    // an encoder whose cache is off.
    let json = synthetic::byte_level(Split::Gpt2, false);
    let dir = write_dir(&json);
    let t = open(dir.path(), TokenizerOptions::new());
    let Model::Fast(f) = &t.inner.model else {
        panic!("not fast")
    };
    let mut cached = t.encoder();
    let mut uncached = Scratch::uncached();
    for text in EDGES.iter().chain(EDGES) {
        let mut a = vec![];
        let mut b = vec![];
        f.encode_into(text, true, &mut cached.scratch, &mut a);
        f.encode_into(text, true, &mut uncached, &mut b);
        assert_eq!(a, b, "{text:?}");
    }
}

#[test]
fn the_splits_equal_the_crate_s() {
    for split in [Split::Gpt2, Split::Llama3] {
        for text in EDGES.iter().map(|s| s.to_string()).chain(long_texts()) {
            assert_eq!(
                synthetic::fast_pieces(split, &text),
                synthetic::crate_pieces(split, &text),
                "{split:?}: {text:?}"
            );
        }
    }
}

/// Characters where the classes and the regexes' branches meet.
fn interesting_char() -> impl Strategy<Value = char> {
    prop_oneof![
        3 => prop::sample::select(vec![
            ' ', ' ', '\n', '\r', '\t', '\u{b}', '\u{c}', '\'', 's', 'S', 't', 'r', 'e', 'v', 'm',
            'l', 'L', 'd', 'D', 'ſ', 'K', '\u{212a}', 'a', 'z', '0', '9', '½', '²', 'Ⅻ', '٣', '!',
            '.', '-', '(', '字', 'の', 'ä', 'ß', '\u{a0}', '\u{3000}', '\u{85}', '\u{2028}',
            '\u{200b}', '\u{200d}', '😀', '👍', '\u{301}', 'ﬅ', 'ǅ', '\u{10ffff}',
        ]),
        1 => any::<char>(),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn the_splits_equal_the_crate_s_on_any_text(
        chars in prop::collection::vec(interesting_char(), 0..40)
    ) {
        let text: String = chars.into_iter().collect();
        for split in [Split::Gpt2, Split::Llama3] {
            prop_assert_eq!(
                synthetic::fast_pieces(split, &text),
                synthetic::crate_pieces(split, &text),
                "{:?}",
                text
            );
        }
    }
}

#[test]
fn a_normalizer_sends_the_file_to_the_crate_and_says_so() {
    let mut json = synthetic::byte_level(Split::Gpt2, false);
    json["normalizer"] = json!({"type": "NFC"});
    let dir = write_dir(&json);
    let t = open(dir.path(), TokenizerOptions::new());
    assert_eq!(
        t.engine(),
        &Engine::Crate {
            why: "the normalizer is NFC".into()
        }
    );
    assert_eq!(
        t.engine().to_string(),
        "tokenizers crate (not the fast path: the normalizer is NFC)"
    );
    // Its ids are the crate's, normalizer applied ("e" + combining acute -> "é").
    let path = dir.path().join("tokenizer.json");
    let text = "cafe\u{301} the world";
    let mut want = crate_ids(&path, text, true);
    want.push(t.eos().unwrap().id);
    assert_eq!(t.encoder().encode(text).unwrap(), want);
    // Asked for the fast path, it says why not, naming the setting.
    let e = TokenizerOptions::new()
        .engine(EngineChoice::Fast)
        .open(dir.path())
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(matches!(
        e,
        Error::InvalidConfig {
            setting: "engine",
            ..
        }
    ));
    assert!(e.to_string().contains("the normalizer is NFC"), "{e}");
    // An empty Sequence of normalizers changes nothing: the fast path takes it.
    json["normalizer"] = json!({"type": "Sequence", "normalizers": []});
    let dir = write_dir(&json);
    assert!(matches!(
        open(dir.path(), TokenizerOptions::new()).engine(),
        Engine::FastBpe { .. }
    ));
}

#[test]
fn each_refusal_is_one_line_naming_what() {
    type Change = Box<dyn Fn(&mut Value)>;
    let cases: Vec<(&str, Change)> = vec![
        (
            "BPE dropout",
            Box::new(|j| j["model"]["dropout"] = json!(0.1)),
        ),
        (
            "the pre-tokenizer is Whitespace",
            Box::new(|j| j["pre_tokenizer"] = json!({"type": "Whitespace"})),
        ),
        (
            "adds a prefix space",
            Box::new(|j| j["pre_tokenizer"]["add_prefix_space"] = json!(true)),
        ),
        (
            "an added token with lstrip",
            Box::new(|j| j["added_tokens"][0]["lstrip"] = json!(true)),
        ),
        (
            "the post-processor is BertProcessing",
            Box::new(|j| {
                j["post_processor"] = json!({"type": "BertProcessing",
                    "sep": ["<|endoftext|>", 0], "cls": ["<|endoftext|>", 0]})
            }),
        ),
        (
            "BPE end_of_word_suffix",
            Box::new(|j| j["model"]["end_of_word_suffix"] = json!("</w>")),
        ),
    ];
    for (want, change) in cases {
        let mut json = synthetic::byte_level(Split::Gpt2, false);
        change(&mut json);
        let dir = write_dir(&json);
        let t = open(dir.path(), TokenizerOptions::new());
        let line = t.engine().to_string();
        assert!(line.contains(want), "{want}: {line}");
        assert!(!line.contains('\n'));
    }
    // A byte missing from the vocabulary (so the crate would need unk or byte fallback).
    let mut json = synthetic::byte_level(Split::Gpt2, false);
    let vocab = json["model"]["vocab"].as_object_mut().unwrap();
    vocab.remove("!");
    json["model"]["merges"] = json!([]);
    let dir = write_dir(&json);
    let t = open(dir.path(), TokenizerOptions::new());
    assert!(
        t.engine().to_string().contains("byte 0x21"),
        "{}",
        t.engine()
    );
}

#[test]
fn the_crate_is_used_when_asked() {
    let dir = write_dir(&synthetic::byte_level(Split::Gpt2, false));
    let t = open(
        dir.path(),
        TokenizerOptions::new().engine(EngineChoice::Crate),
    );
    assert_eq!(
        t.engine().to_string(),
        "tokenizers crate (not the fast path: the crate was asked for)"
    );
    assert_eq!(EngineChoice::from_name("crate"), Some(EngineChoice::Crate));
    assert_eq!(EngineChoice::from_name("quick"), None);
}

#[test]
fn eos_is_appended_by_default_and_an_empty_document_is_the_template_and_eos() {
    // GPT-2's kind: no template, the EOS found by its name (no configuration file).
    let dir = write_dir(&synthetic::byte_level(Split::Gpt2, false));
    let t = open(dir.path(), TokenizerOptions::new());
    let eos = t.eos().unwrap().clone();
    assert_eq!(eos.content, "<|endoftext|>");
    assert_eq!(eos.origin, TokenOrigin::KnownName);
    let mut e = t.encoder();
    assert_eq!(e.encode("").unwrap(), vec![eos.id]);
    let path = dir.path().join("tokenizer.json");
    let mut want = crate_ids(&path, "the world", true);
    want.push(eos.id);
    assert_eq!(e.encode("the world").unwrap(), want);
    // Llama 3's kind: the template's BOS, then the EOS.
    let json = synthetic::byte_level(Split::Llama3, true);
    let dir = write_dir(&json);
    let t = open(dir.path(), TokenizerOptions::new());
    let bos = t.bos().unwrap().clone();
    assert_eq!(bos.origin, TokenOrigin::Template);
    assert_eq!(bos.content, "<|begin_of_text|>");
    assert_eq!(
        t.encoder().encode("").unwrap(),
        vec![bos.id, t.eos().unwrap().id]
    );
}

#[test]
fn ids_go_into_the_callers_buffer_after_what_it_holds() {
    let dir = write_dir(&synthetic::byte_level(Split::Gpt2, false));
    let t = open(dir.path(), TokenizerOptions::new());
    let mut e = t.encoder();
    let mut out = vec![7, 7];
    let n = e.encode_into("hello world", &mut out).unwrap();
    assert_eq!(&out[..2], &[7, 7]);
    assert_eq!(n, out.len() - 2);
    assert_eq!(out[2..], e.encode("hello world").unwrap()[..]);
}

#[test]
fn bos_and_eos_are_never_doubled_by_the_template() {
    let json = synthetic::byte_level(Split::Llama3, false);
    let dir = write_dir(&json);
    let path = dir.path().join("tokenizer.json");
    let t = open(dir.path(), TokenizerOptions::new().prepend_bos(true));
    let bos = t.bos().unwrap().id;
    // The template puts the BOS there already: once.
    assert_eq!(t.prepended(), None);
    let ids = t.encoder().encode("the world").unwrap();
    assert_eq!(ids.iter().filter(|&&i| i == bos).count(), 1);
    // Without the template, gpufeed puts it.
    let t = open(
        dir.path(),
        TokenizerOptions::new()
            .prepend_bos(true)
            .add_special_tokens(false),
    );
    assert_eq!(t.prepended(), Some(bos));
    let mut want = vec![bos];
    want.extend(crate_ids(&path, "the world", false));
    want.push(t.eos().unwrap().id);
    assert_eq!(t.encoder().encode("the world").unwrap(), want);
    // A template that ends with the EOS: not appended again.
    let mut json = synthetic::byte_level(Split::Gpt2, false);
    let eos_id = json["added_tokens"][0]["id"].clone();
    json["post_processor"] = json!({"type": "TemplateProcessing",
        "single": [{"Sequence": {"id": "A", "type_id": 0}},
                   {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [eos_id],
                                              "tokens": ["<|endoftext|>"]}}});
    let dir = write_dir(&json);
    let t = open(dir.path(), TokenizerOptions::new());
    assert_eq!(t.eos().unwrap().origin, TokenOrigin::Template);
    assert_eq!(t.appended(), None);
    let ids = t.encoder().encode("the").unwrap();
    assert_eq!(
        ids,
        crate_ids(&dir.path().join("tokenizer.json"), "the", true)
    );
    assert_eq!(ids.last(), Some(&t.eos().unwrap().id));
}

/// A hub directory: the synthetic GPT-2 tokenizer.json and these configuration files.
fn hub_dir(config: Option<Value>, map: Option<Value>) -> tempfile::TempDir {
    let dir = write_dir(&synthetic::byte_level(Split::Gpt2, false));
    if let Some(c) = config {
        std::fs::write(dir.path().join("tokenizer_config.json"), c.to_string()).unwrap();
    }
    if let Some(m) = map {
        std::fs::write(dir.path().join("special_tokens_map.json"), m.to_string()).unwrap();
    }
    dir
}

/// The id of a token that is one piece of text (an added token).
fn id_of(t: &Tokenizer, token: &str) -> u32 {
    crate_ids(t.path(), token, false)[0]
}

#[test]
fn the_config_names_eos_and_bos_as_transformers_reads_them() {
    // A string, and an AddedToken object.
    let dir = hub_dir(
        Some(json!({"eos_token": "hello world",
                    "bos_token": {"__type": "AddedToken", "content": "<|begin_of_text|>"}})),
        None,
    );
    let t = open(dir.path(), TokenizerOptions::new());
    let config = dir.path().join("tokenizer_config.json");
    assert_eq!(t.eos().unwrap().content, "hello world");
    assert_eq!(t.eos().unwrap().origin, TokenOrigin::Config(config.clone()));
    assert_eq!(t.bos().unwrap().content, "<|begin_of_text|>");
    assert_eq!(t.eos().unwrap().id, id_of(&t, "hello world"));
    // The tokenizer.json's own path reads the files beside it too.
    let t2 = open(&dir.path().join("tokenizer.json"), TokenizerOptions::new());
    assert_eq!(t2.eos(), t.eos());
    // special_tokens_map.json wins over a config without added_tokens_decoder...
    let dir = hub_dir(
        Some(json!({"eos_token": "hello world"})),
        Some(json!({"eos_token": {"content": "<|endoftext|>", "lstrip": false}})),
    );
    let t = open(dir.path(), TokenizerOptions::new());
    assert_eq!(t.eos().unwrap().content, "<|endoftext|>");
    assert_eq!(
        t.eos().unwrap().origin,
        TokenOrigin::Config(dir.path().join("special_tokens_map.json"))
    );
    // ... and not over one with it (transformers 5).
    let dir = hub_dir(
        Some(json!({"eos_token": "hello world", "added_tokens_decoder": {}})),
        Some(json!({"eos_token": "<|endoftext|>"})),
    );
    let t = open(dir.path(), TokenizerOptions::new());
    assert_eq!(t.eos().unwrap().content, "hello world");
    // The option wins over everything.
    let t = open(
        dir.path(),
        TokenizerOptions::new().eos_token("<|endoftext|>"),
    );
    assert_eq!(t.eos().unwrap().origin, TokenOrigin::Option);
}

#[test]
fn a_config_naming_a_token_the_vocabulary_lacks_is_an_error_naming_both_files() {
    let dir = hub_dir(Some(json!({"eos_token": "</s>"})), None);
    let e = TokenizerOptions::new().open(dir.path()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Mismatch);
    let text = e.to_string();
    assert!(
        text.contains("tokenizer_config.json: eos_token `</s>`"),
        "{text}"
    );
    assert!(text.contains("tokenizer.json"), "{text}");
    // Even when appending is off: the file is wrong.
    assert!(
        TokenizerOptions::new()
            .append_eos(false)
            .open(dir.path())
            .is_err()
    );
    // An option naming a token the vocabulary lacks names the setting.
    let dir = hub_dir(None, None);
    let e = TokenizerOptions::new()
        .bos_token("<nope>")
        .open(dir.path())
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidConfig {
                setting: "bos_token",
                ..
            }
        ),
        "{e}"
    );
    // A value of the wrong type is a malformed config.
    let dir = hub_dir(Some(json!({"eos_token": 3})), None);
    let e = TokenizerOptions::new().open(dir.path()).unwrap_err();
    assert!(
        matches!(
            &e,
            Error::Malformed {
                format: "tokenizer_config.json",
                ..
            }
        ),
        "{e}"
    );
    let dir = hub_dir(None, Some(json!([1, 2])));
    let e = TokenizerOptions::new().open(dir.path()).unwrap_err();
    assert!(e.to_string().contains("special_tokens_map.json"), "{e}");
}

#[test]
fn no_eos_to_append_is_an_error_unless_appending_is_off() {
    let mut json = synthetic::byte_level(Split::Gpt2, false);
    json["added_tokens"] = json!([]);
    let dir = write_dir(&json);
    let e = TokenizerOptions::new().open(dir.path()).unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidConfig {
                setting: "eos_token",
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string().contains("no EOS to put after each document"),
        "{e}"
    );
    let t = open(dir.path(), TokenizerOptions::new().append_eos(false));
    assert_eq!(t.eos(), None);
    assert_eq!(t.encoder().encode("").unwrap(), Vec::<u32>::new());
    // A BOS asked for and none found.
    let e = TokenizerOptions::new()
        .append_eos(false)
        .prepend_bos(true)
        .open(dir.path())
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidConfig {
                setting: "bos_token",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn bad_paths_and_files_are_typed_errors_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    // A directory without a tokenizer.json, with the hint for a SentencePiece model.
    std::fs::write(dir.path().join("tokenizer.model"), b"x").unwrap();
    let e = Tokenizer::open(dir.path()).unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidConfig {
                setting: "tokenizer",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("without a tokenizer.json"), "{e}");
    assert!(e.to_string().contains("tokenizer.model"), "{e}");
    // No such file.
    let e = Tokenizer::open(dir.path().join("nope.json")).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Io);
    assert!(e.to_string().contains("nope.json"), "{e}");
    // Not JSON, not UTF-8, JSON that is not a tokenizer, a model the crate does not know.
    let cases: [(&str, &[u8], &str); 5] = [
        ("a.json", b"{\"model\": ", "not JSON"),
        ("b.json", b"\xff\xfe{}", "not UTF-8"),
        ("c.json", b"{\"eos_token\": \"</s>\"}", "no `model`"),
        ("d.json", b"[1, 2]", "no `model`"),
        (
            "e.json",
            br#"{"model": {"type": "Bogus"}, "added_tokens": []}"#,
            "the tokenizers library cannot load it",
        ),
    ];
    for (name, bytes, want) in cases {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        let e = Tokenizer::open(&path).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{name}: {e}");
        let text = e.to_string();
        assert!(text.starts_with(&path.display().to_string()), "{text}");
        assert!(text.contains(want), "{name}: {text}");
    }
}

#[test]
fn a_fifo_is_refused_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path; mkfifo only creates the node.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let e = Tokenizer::open(dir.path()).unwrap_err();
    assert!(e.to_string().contains("not a regular file"), "{e}");
}

#[test]
fn the_vocabulary_size_picks_megatron_s_width_and_a_narrow_width_is_refused() {
    let dir = write_dir(&synthetic::byte_level(Split::Gpt2, false));
    let t = open(dir.path(), TokenizerOptions::new());
    let n = synthetic::byte_level(Split::Gpt2, false)["model"]["vocab"]
        .as_object()
        .unwrap()
        .len() as u64;
    assert_eq!(t.vocab_size(), n + 3); // three added tokens after the model's
    assert_eq!(t.megatron_width(), TokenWidth::U16);
    t.check_width(TokenWidth::U16, "token_dtype").unwrap();
    assert_eq!(TokenWidth::megatron(65_499), TokenWidth::U16);
    assert_eq!(TokenWidth::megatron(65_500), TokenWidth::I32);
    // A token at id 70,000: not in uint16.
    let mut json = synthetic::byte_level(Split::Gpt2, false);
    json["model"]["vocab"]["qqqq"] = json!(70_000);
    let dir = write_dir(&json);
    let t = open(dir.path(), TokenizerOptions::new());
    assert_eq!(t.vocab_size(), 70_001);
    assert_eq!(t.megatron_width(), TokenWidth::I32);
    let e = t.check_width(TokenWidth::U16, "token_dtype").unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidConfig {
                setting: "token_dtype",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("ids up to 70000"), "{e}");
    // Beyond int32: Megatron's width cannot hold it.
    let mut json = synthetic::byte_level(Split::Gpt2, false);
    json["model"]["vocab"]["qqqq"] = json!(3_000_000_000u64);
    let dir = write_dir(&json);
    let t = open(dir.path(), TokenizerOptions::new());
    assert!(t.check_width(t.megatron_width(), "token_dtype").is_err());
    t.check_width(TokenWidth::U32, "token_dtype").unwrap();
}

#[test]
fn truncation_and_padding_are_not_applied_and_no_thread_is_used() {
    let mut json = synthetic::byte_level(Split::Gpt2, false);
    json["normalizer"] = json!({"type": "NFC"}); // the crate's path
    json["truncation"] = json!({"direction": "Right", "max_length": 4, "strategy": "LongestFirst",
                                "stride": 0});
    json["padding"] = json!({"strategy": {"Fixed": 64}, "direction": "Right",
                             "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0,
                             "pad_token": "<|endoftext|>"});
    let dir = write_dir(&json);
    let t = open(dir.path(), TokenizerOptions::new().append_eos(false));
    assert!(matches!(t.engine(), Engine::Crate { .. }));
    let text = "the world the world the world the world";
    let mut e = t.encoder();
    let got = e.encode(text).unwrap();
    for _ in 0..100 {
        assert_eq!(e.encode(text).unwrap(), got);
    }
    // The crate's own account: no parallel iterator ran in this process (this is the one test
    // of the binary that pads, below).
    assert!(!tokenizers::parallelism::has_parallelism_been_used());
    let mut plain = tokenizers::Tokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
    let truncated = plain.encode(text, true).unwrap().get_ids().to_vec();
    assert_eq!(truncated.len(), 64); // what Python's encode gives: cut to 4, padded to 64
    let _ = plain.with_truncation(None);
    plain.with_padding(None);
    let want = plain.encode(text, true).unwrap().get_ids().to_vec();
    assert!(want.len() > 4);
    assert_eq!(got, want);
}

#[test]
fn an_encoder_s_memory_stays_within_what_the_tokenizer_says() {
    let dir = write_dir(&synthetic::byte_level(Split::Llama3, false));
    let t = open(dir.path(), TokenizerOptions::new());
    let memory = t.memory();
    assert!(memory.model > 0);
    let mut e = t.encoder();
    // Many distinct pieces, to fill the cache past its bound and clear it.
    let mut text = String::new();
    for i in 0..200_000u32 {
        text.push_str(&format!(" w{:x}q", i.wrapping_mul(2_654_435_761)));
    }
    e.encode(&text).unwrap();
    assert!(
        e.bytes() <= memory.per_encoder,
        "{} > {}",
        e.bytes(),
        memory.per_encoder
    );
    // A long piece's scratch is given back.
    e.encode(&"字".repeat(100_000)).unwrap();
    assert!(
        e.bytes() <= memory.per_encoder,
        "{} > {}",
        e.bytes(),
        memory.per_encoder
    );
}

#[test]
fn tokenizers_and_encoders_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<Tokenizer>();
    send::<Encoder>();
    let dir = write_dir(&synthetic::byte_level(Split::Llama3, false));
    let t = open(dir.path(), TokenizerOptions::new());
    let want = t.encoder().encode(EDGES[0]).unwrap();
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                let mut e = t.encoder();
                for _ in 0..50 {
                    assert_eq!(e.encode(EDGES[0]).unwrap(), want);
                }
            });
        }
    });
}

#[test]
fn added_tokens_get_the_crate_s_ids_not_the_file_s() {
    // The crate gives an added token the model's id of its text, else the next free id, and
    // ignores the id written beside it (it only warns): so does the fast path.
    let mut json = synthetic::byte_level(Split::Llama3, false);
    for (i, t) in json["added_tokens"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .enumerate()
    {
        t["id"] = json!(90_000 + i);
    }
    let dir = write_dir(&json);
    let path = dir.path().join("tokenizer.json");
    let text = "<|endoftext|>a hello world<|begin_of_text|>";
    let want = crate_ids(&path, text, false);
    assert!(want.iter().all(|&id| id < 90_000), "{want:?}");
    for engine in [EngineChoice::Fast, EngineChoice::Crate] {
        let t = open(
            dir.path(),
            TokenizerOptions::new()
                .engine(engine)
                .add_special_tokens(false)
                .append_eos(false),
        );
        assert_eq!(t.encoder().encode(text).unwrap(), want, "{engine:?}");
        assert_eq!(
            t.eos().unwrap().id,
            crate_ids(&path, "<|endoftext|>", false)[0]
        );
    }
}
