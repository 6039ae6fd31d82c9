//! For tests and fuzz targets (not part of the API): small byte-level BPE tokenizer.json files
//! made in code (the 256 ByteLevel characters, merges that spell a list of words both left to
//! right and right to left, so that merges compete on rank and several merges make the same
//! token; added tokens; the GPT-2 or Llama 3 split), and a text's pieces by the fast path's
//! splits and by the `tokenizers` crate's pre-tokenizers, to compare.

use serde_json::{Value, json};

use super::Split;
use super::fast::LLAMA3_REGEX;

/// GPT-2's byte -> character table (the ByteLevel alphabet), as strings.
fn alphabet() -> Vec<String> {
    let mut out = Vec::with_capacity(256);
    let mut shifted = 0u32;
    for b in 0..256u32 {
        let printable = (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
        let c = if printable {
            b
        } else {
            shifted += 1;
            255 + shifted
        };
        out.push(char::from_u32(c).map(String::from).unwrap_or_default());
    }
    out
}

/// Words (and bits of words) the merges spell: several scripts, digits, spaces, punctuation.
pub const WORDS: &[&str] = &[
    "the",
    " the",
    "hello",
    " world",
    "ing",
    "tion",
    " of",
    " and",
    "'s",
    "'re",
    " don",
    "Привет",
    " мир",
    "ство",
    "日本語",
    "テスト",
    "です",
    "中文",
    "ça",
    " naïve",
    "über",
    "123",
    " 2024",
    "00",
    "!!",
    "...",
    "  ",
    "\n\n",
    " \n",
    "──",
    "ελλη",
    "नमस्ते",
    "😀",
    "ſt",
];

/// A byte-level BPE tokenizer.json (as a JSON value, to adjust before writing): `split` picks
/// the pre-tokenizer; `ignore_merges` the model's flag. Added tokens: `<|endoftext|>`
/// (special, normalized, as GPT-2's), `<|begin_of_text|>` (special, not normalized) and
/// `hello world` (not special, normalized). The Llama 3 split also gets Llama 3's template
/// (`<|begin_of_text|>` before the text).
pub fn byte_level(split: Split, ignore_merges: bool) -> Value {
    let chars = alphabet();
    let mut vocab: Vec<String> = chars.clone();
    let mut merges: Vec<(String, String)> = Vec::new();
    let to_bl = |s: &str| -> Vec<String> {
        s.bytes()
            .map(|b| chars[b as usize].clone())
            .collect::<Vec<_>>()
    };
    let mut add = |a: &str, b: &str, vocab: &mut Vec<String>| {
        if !merges.iter().any(|(x, y)| x == a && y == b) {
            merges.push((a.to_string(), b.to_string()));
        }
        let ab = format!("{a}{b}");
        if !vocab.contains(&ab) {
            vocab.push(ab);
        }
    };
    for word in WORDS {
        let parts = to_bl(word);
        // Left to right: ((a b) c) d ...
        let mut acc = parts[0].clone();
        for p in &parts[1..] {
            add(&acc, p, &mut vocab);
            acc.push_str(p);
        }
    }
    for word in WORDS {
        let parts = to_bl(word);
        // Right to left: a (b (c d)) ..., the same tokens by other merges, ranked later.
        let mut acc = parts[parts.len() - 1].clone();
        for p in parts[..parts.len() - 1].iter().rev() {
            add(p, &acc, &mut vocab);
            acc = format!("{p}{acc}");
        }
    }
    let vocab_map: serde_json::Map<String, Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, s)| (s.clone(), json!(i)))
        .collect();
    let n = vocab.len();
    let added = |id: usize, content: &str, special: bool, normalized: bool| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": normalized, "special": special})
    };
    let byte_level = |use_regex: bool| {
        json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
               "use_regex": use_regex})
    };
    let (pre_tokenizer, post_processor) = match split {
        Split::Gpt2 => (byte_level(true), byte_level(true)),
        Split::Llama3 => (
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": LLAMA3_REGEX}, "behavior": "Isolated",
                 "invert": false},
                byte_level(false),
            ]}),
            json!({"type": "Sequence", "processors": [
                byte_level(true),
                {"type": "TemplateProcessing",
                 "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                            {"Sequence": {"id": "A", "type_id": 0}}],
                 "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                          {"Sequence": {"id": "A", "type_id": 0}},
                          {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}},
                          {"Sequence": {"id": "B", "type_id": 1}}],
                 "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>",
                                    "ids": [n + 1], "tokens": ["<|begin_of_text|>"]}}},
            ]}),
        ),
    };
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [
            added(n, "<|endoftext|>", true, true),
            added(n + 1, "<|begin_of_text|>", true, false),
            added(n + 2, "hello world", false, true),
        ],
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": byte_level(true),
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
            "byte_fallback": false, "ignore_merges": ignore_merges,
            "vocab": vocab_map,
            "merges": merges.iter().map(|(a, b)| json!([a, b])).collect::<Vec<_>>(),
        },
    })
}

/// The pieces of `text` by the fast path's `split`, as byte ranges.
pub fn fast_pieces(split: Split, text: &str) -> Vec<(usize, usize)> {
    let mut out = vec![];
    let base = text.as_ptr() as usize;
    split.split(text, |piece| {
        let start = piece.as_ptr() as usize - base;
        out.push((start, start + piece.len()));
    });
    out
}

/// The pieces of `text` by the `tokenizers` crate's pre-tokenizer for `split` (GPT-2's
/// `ByteLevel`, or Llama 3's `Split`), as byte ranges.
pub fn crate_pieces(split: Split, text: &str) -> Vec<(usize, usize)> {
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::split::{Split as CrateSplit, SplitPattern};
    use tokenizers::{
        OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer, SplitDelimiterBehavior,
    };
    let mut pre = PreTokenizedString::from(text);
    let done = match split {
        Split::Gpt2 => ByteLevel::new(false, true, true).pre_tokenize(&mut pre),
        Split::Llama3 => CrateSplit::new(
            SplitPattern::Regex(LLAMA3_REGEX.into()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .and_then(|s| s.pre_tokenize(&mut pre)),
    };
    if let Err(e) = done {
        panic!("the crate's pre-tokenizer failed: {e}");
    }
    pre.get_splits(OffsetReferential::Original, OffsetType::Byte)
        .into_iter()
        .map(|(_, offsets, _)| offsets)
        .collect()
}
