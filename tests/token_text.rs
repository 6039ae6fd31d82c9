//! Text sources in the token loader: JSON lines of text and a tokenizer.json, tokenized in the
//! workers as the stream reaches them. Without shuffle the rows are the documents' ids end to
//! end; packed rows hold every document once per pass; blends with a pre-tokenized source are
//! exact per epoch; a state taken under 2 ranks x 3 workers resumes under 3 ranks x 1 worker
//! into the stream of an uninterrupted 1-rank run, row by row; bad input is a typed error
//! naming the setting.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpufeed::source::OpenOptions;
use gpufeed::source::tokens::{IndexedTokens, TextTokens, TokenSource};
use gpufeed::tokenizer::synthetic::byte_level;
use gpufeed::tokenizer::{Split, Tokenizer};
use gpufeed::tokens::pack::{PackScratch, Packing, pack};
use gpufeed::tokens::{SampleMode, TokenLoader, TokenLoaderBuilder};
use gpufeed::{Batch, BatchStream, Error, LoaderState};
use proptest::prelude::*;

use crate::token_common::write_megatron;

/// Words the documents are made of: several scripts, the synthetic tokenizer's merges.
const WORDS: &[&str] = &[
    "the",
    " world",
    "hello",
    " мир",
    "日本語",
    " naïve",
    "123",
    "!!",
    "\n\n",
    "😀",
    " of",
    "テスト",
    "x",
];

/// `n` documents of varied lengths (every 7th empty), deterministic in `seed`.
fn texts(n: usize, seed: u64) -> Vec<String> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|d| {
            if d % 7 == 3 {
                return String::new();
            }
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let words = 1 + (x % 40) as usize;
            (0..words)
                .map(|k| WORDS[(x as usize / 3 + k * 5 + d) % WORDS.len()])
                .collect()
        })
        .collect()
}

/// The documents as JSON lines (`{"text": ..., "n": ...}`), and the tokenizer.json.
fn corpus(dir: &Path, docs: &[String]) -> (PathBuf, PathBuf) {
    let jsonl = dir.join("corpus.jsonl");
    let lines: Vec<String> = docs
        .iter()
        .enumerate()
        .map(|(n, t)| serde_json::json!({"text": t, "n": n}).to_string())
        .collect();
    std::fs::write(&jsonl, lines.join("\n") + "\n").unwrap();
    let tokenizer = dir.join("tokenizer.json");
    std::fs::write(
        &tokenizer,
        serde_json::to_string(&byte_level(Split::Gpt2, false)).unwrap(),
    )
    .unwrap();
    (jsonl, tokenizer)
}

fn text_source(jsonl: &Path, tokenizer: &Path) -> Arc<TextTokens> {
    let tokenizer = Tokenizer::open(tokenizer).unwrap();
    Arc::new(TextTokens::open(jsonl, &OpenOptions::default(), "text", tokenizer).unwrap())
}

/// Every document's ids (the EOS appended), by the tokenizer alone.
fn ids_of(tokenizer: &Path, docs: &[String]) -> Vec<Vec<u32>> {
    let tokenizer = Tokenizer::open(tokenizer).unwrap();
    let mut encoder = tokenizer.encoder();
    docs.iter().map(|t| encoder.encode(t).unwrap()).collect()
}

/// One row as delivered: inputs, labels, positions, piece numbers.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Row {
    input: Vec<i64>,
    labels: Vec<i64>,
    positions: Vec<i64>,
    docs: Vec<i32>,
}

/// The real rows of a batch, by global position.
fn rows_of(batch: &Batch, seq_len: usize) -> Vec<(u64, Row)> {
    let input = batch.field::<i64>("input_ids").unwrap();
    let labels = batch.field::<i64>("labels").unwrap();
    let positions = batch.field::<i64>("position_ids").unwrap();
    let docs = batch.field::<i32>("document_ids").unwrap();
    batch
        .indices()
        .iter()
        .enumerate()
        .filter(|(_, g)| **g != u64::MAX)
        .map(|(j, &g)| {
            let r = j * seq_len..(j + 1) * seq_len;
            let row = Row {
                input: input[r.clone()].to_vec(),
                labels: labels[r.clone()].to_vec(),
                positions: positions[r.clone()].to_vec(),
                docs: docs[r].to_vec(),
            };
            (g, row)
        })
        .collect()
}

/// Every row of `batches` global batches of epoch `epoch` (all of them: `None`) of every
/// rank of `world`.
fn rows(
    builder: &dyn Fn(u64, u64) -> TokenLoaderBuilder,
    world: u64,
    epoch: u64,
    seq_len: usize,
) -> BTreeMap<(u64, u64), Row> {
    let mut all = BTreeMap::new();
    for rank in 0..world {
        let mut loader = builder(rank, world).build().unwrap();
        loader.set_epoch(epoch);
        for batch in loader.by_ref() {
            for (g, row) in rows_of(&batch.unwrap(), seq_len) {
                assert!(all.insert((epoch, g), row).is_none(), "position {g} twice");
            }
        }
    }
    all
}

/// The inputs of rows in order, padding left out.
fn inputs(rows: &BTreeMap<(u64, u64), Row>) -> Vec<u32> {
    rows.values()
        .flat_map(|r| {
            r.input
                .iter()
                .zip(&r.docs)
                .filter(|(_, d)| **d != -1)
                .map(|(t, _)| *t as u32)
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn without_shuffle_concatenated_rows_are_the_documents_ids_end_to_end_in_file_order() {
    let dir = tempfile::tempdir().unwrap();
    let docs = texts(120, 1);
    let (jsonl, tok) = corpus(dir.path(), &docs);
    let ids = ids_of(&tok, &docs);
    let eos = Tokenizer::open(&tok).unwrap().appended().unwrap();
    // An empty document is the EOS alone.
    assert_eq!(ids[3], [eos]);
    let want: Vec<u32> = ids.concat();
    let seq_len = 16usize;
    let pass_rows = (want.len() as u64).div_ceil(seq_len as u64);
    let source = text_source(&jsonl, &tok);
    // Two passes: the second follows the first (its last row padded), the same ids.
    let builder = |rank, world| {
        TokenLoader::builder(seq_len, 5)
            .text(Arc::clone(&source))
            .window(8)
            .samples_per_epoch(pass_rows)
            .shard(rank, world)
            .workers(3)
    };
    for epoch in 0..2 {
        let got = rows(&builder, 2, epoch, seq_len);
        assert_eq!(got.len() as u64, pass_rows);
        assert_eq!(inputs(&got), want, "pass {epoch}");
        // Labels: the next id of the stream, the pass's last ignored.
        let stream: Vec<i64> = got.values().flat_map(|r| r.input.clone()).collect();
        let labels: Vec<i64> = got.values().flat_map(|r| r.labels.clone()).collect();
        for t in 0..want.len() - 1 {
            assert_eq!(labels[t], stream[t + 1], "label {t}");
        }
        assert_eq!(labels[want.len() - 1], -100);
    }
    let loader = builder(0, 1).build().unwrap();
    let stats = loader.text_stats()[0].clone().unwrap();
    assert!(stats.estimated_rows > 0 && stats.estimated_tokens > 0);
}

#[test]
fn packed_rows_hold_every_document_of_a_pass_once_whole_or_split_at_row_ends() {
    let dir = tempfile::tempdir().unwrap();
    let docs = texts(90, 2);
    let (jsonl, tok) = corpus(dir.path(), &docs);
    let ids = ids_of(&tok, &docs);
    let (seq_len, window) = (24usize, 10usize);
    // The pass's rows: each window of documents packed alone.
    let pass_rows: u64 = ids
        .chunks(window)
        .map(|w| {
            let lengths: Vec<u64> = w.iter().map(|d| d.len() as u64).collect();
            pack(
                &lengths,
                seq_len as u64,
                Packing::BestFitDecreasing,
                &mut PackScratch::default(),
            )
            .rows()
        })
        .sum();
    let source = text_source(&jsonl, &tok);
    let builder = |rank, world| {
        TokenLoader::builder(seq_len, 4)
            .text(Arc::clone(&source))
            .mode(SampleMode::Packed)
            .window(window as u64)
            .samples_per_epoch(pass_rows)
            .shuffle(11)
            .shard(rank, world)
            .workers(2)
    };
    let got = rows(&builder, 3, 0, seq_len);
    assert_eq!(got.len() as u64, pass_rows);
    // Each row's pieces: runs of one piece number; each is a run of some document's ids.
    let mut pieces: Vec<Vec<u32>> = Vec::new();
    for row in got.values() {
        let mut t = 0;
        while t < seq_len && row.docs[t] != -1 {
            let end = (t..seq_len)
                .find(|&u| row.docs[u] != row.docs[t])
                .unwrap_or(seq_len);
            for u in t..end {
                assert_eq!(row.positions[u], (u - t) as i64);
            }
            pieces.push(row.input[t..end].iter().map(|&x| x as u32).collect());
            t = end;
        }
        assert!(
            row.docs[t..].iter().all(|&d| d == -1),
            "padding ends the row"
        );
    }
    // Whole documents (or full rows of longer ones) once each: the same ids, counted.
    let mut want: Vec<Vec<u32>> = Vec::new();
    for d in &ids {
        for c in d.chunks(seq_len) {
            want.push(c.to_vec());
        }
    }
    // A document's last piece is what remains past its full rows.
    pieces.sort();
    want.sort();
    assert_eq!(pieces, want);
}

#[test]
fn a_blend_with_a_pre_tokenized_source_takes_exact_counts_and_continues_across_epochs() {
    let dir = tempfile::tempdir().unwrap();
    let docs = texts(60, 3);
    let (jsonl, tok) = corpus(dir.path(), &docs);
    let source = text_source(&jsonl, &tok);
    let prefix = dir.path().join("m");
    let megatron: Vec<Vec<u32>> = (0..40u32).map(|d| vec![1_000_000 + d; 5]).collect();
    write_megatron(&prefix, &megatron, 4);
    let pre: Arc<dyn TokenSource> = Arc::new(IndexedTokens::open(&prefix).unwrap());
    let mut loader = TokenLoader::builder(8, 6)
        .weighted_text(Arc::clone(&source), 3.0)
        .weighted(pre, 1.0)
        .samples_per_epoch(100)
        .shuffle(4)
        .workers(2)
        .build()
        .unwrap();
    assert_eq!(loader.samples_per_source(), [75, 25]);
    let mut text_rows = Vec::new();
    for epoch in 0..3 {
        loader.set_epoch(epoch);
        let before = loader.token_stats().rows_per_source.clone();
        for batch in loader.by_ref() {
            for (_, row) in rows_of(&batch.unwrap(), 8) {
                if row.input[0] < 1_000_000 {
                    text_rows.push(row);
                }
            }
        }
        let after = &loader.token_stats().rows_per_source;
        let got: Vec<u64> = after
            .iter()
            .zip(before.iter().chain(std::iter::repeat(&0)))
            .map(|(a, b)| a - b)
            .collect();
        assert_eq!(got, [75, 25], "exact counts, epoch {epoch}");
    }
    // 225 rows of the text source: several passes, each its documents once.
    let stats = loader.text_stats()[0].clone().unwrap();
    assert!(stats.passes >= 1, "{stats:?}");
    assert_eq!(loader.text_stats()[1], None);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(8))]

    /// A state at global batch `k` under 2 ranks x 3 workers, resumed under 3 ranks x 1 worker:
    /// the global stream equals an uninterrupted 1-rank run, row by row, in both row modes,
    /// alone or blended with a pre-tokenized source, across passes of the text source.
    #[test]
    fn a_state_under_two_ranks_resumes_under_three_into_the_uninterrupted_stream(
        seq_len in 3usize..20,
        batch in 1usize..9,
        window in 1u64..12,
        stop in 0.0f64..1.0,
        packed: bool,
        blend: bool,
        seed in proptest::option::of(0u64..100),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let docs = texts(45, 5);
        let (jsonl, tok) = corpus(dir.path(), &docs);
        let source = text_source(&jsonl, &tok);
        let prefix = dir.path().join("m");
        let megatron: Vec<Vec<u32>> = (0..20u32).map(|d| vec![1_000_000 + d; 3 + d as usize % 9]).collect();
        write_megatron(&prefix, &megatron, 4);
        let pre: Arc<dyn TokenSource> = Arc::new(IndexedTokens::open(&prefix).unwrap());
        let builder = |rank: u64, world: u64, workers: usize| {
            let mut b = TokenLoader::builder(seq_len, batch)
                .weighted_text(Arc::clone(&source), 2.0)
                .window(window)
                .mode(if packed { SampleMode::Packed } else { SampleMode::Concatenated })
                .samples_per_epoch(150)
                .shard(rank, world)
                .workers(workers);
            if blend {
                b = b.weighted(Arc::clone(&pre), 1.0);
            }
            if let Some(s) = seed {
                b = b.shuffle(s);
            }
            b
        };
        let whole = rows(&|r, w| builder(r, w, 1), 1, 1, seq_len);
        let batches = builder(0, 1, 1).build().unwrap().batches_per_epoch();
        let k = ((stop * batches as f64) as u64).min(batches);
        let mut got = BTreeMap::new();
        let mut state: Option<LoaderState> = None;
        for rank in 0..2 {
            let mut l = builder(rank, 2, 3).build().unwrap();
            l.set_epoch(1);
            for _ in 0..k {
                for (g, row) in rows_of(&l.next().unwrap().unwrap(), seq_len) {
                    got.insert((1, g), row);
                }
            }
            let s = l.state();
            prop_assert_eq!(s.next_batch, k);
            if let Some(prev) = &state {
                prop_assert_eq!(&prev.tokens, &s.tokens, "every rank's state is the same");
            }
            state = Some(s);
        }
        let state = serde_json::to_string(&state.unwrap()).unwrap();
        for rank in 0..3 {
            let s: LoaderState = serde_json::from_str(&state).unwrap();
            let mut l = builder(rank, 3, 1).resume(s).build().unwrap();
            l.set_epoch(1);
            for b in l.by_ref() {
                for (g, row) in rows_of(&b.unwrap(), seq_len) {
                    prop_assert!(got.insert((1, g), row).is_none(), "position {} repeated", g);
                }
            }
        }
        prop_assert_eq!(got, whole);
    }
}

#[test]
fn a_resumed_text_source_does_not_tokenize_the_pass_up_to_its_place() {
    let dir = tempfile::tempdir().unwrap();
    let docs = texts(400, 6);
    let (jsonl, tok) = corpus(dir.path(), &docs);
    let source = text_source(&jsonl, &tok);
    let build = || {
        TokenLoader::builder(16, 4)
            .text(Arc::clone(&source))
            .window(10)
            .shuffle(1)
            .workers(1)
    };
    let mut loader = build().build().unwrap();
    let batches = loader.batches_per_epoch();
    for _ in 0..batches * 3 / 4 {
        loader.next().unwrap().unwrap();
    }
    let state = loader.state();
    let done = loader.text_stats()[0].clone().unwrap().windows;
    let mut resumed = build().resume(state).build().unwrap();
    resumed.next().unwrap().unwrap();
    let stats = resumed.text_stats()[0].clone().unwrap();
    // The estimate's first window, and the few windows the next rows need.
    assert!(
        stats.windows * 4 < done,
        "resumed: {} windows tokenized, {done} before the state",
        stats.windows
    );
}

#[test]
fn bad_text_input_is_a_typed_error_naming_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    let docs = texts(5, 7);
    let (jsonl, tok) = corpus(dir.path(), &docs);
    let tokenizer = Tokenizer::open(&tok).unwrap();
    // A field that is not text, and one that is not there.
    for (field, says) in [("n", "not text"), ("body", "no field `body`")] {
        match TextTokens::open(&jsonl, &OpenOptions::default(), field, tokenizer.clone()) {
            Err(Error::InvalidConfig { setting, what }) => {
                assert_eq!(setting, "text_field");
                assert!(what.contains(says), "{what}");
            }
            other => panic!("{field}: {other:?}"),
        }
    }
    // A tokenizer.json that is not one names its file.
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{\"not\": \"a tokenizer\"}").unwrap();
    let e = Tokenizer::open(&bad).unwrap_err();
    assert!(e.to_string().contains("bad.json"), "{e}");
    // No EOS to append: a tokenizer without one, unless told not to append it.
    let mut json = byte_level(Split::Gpt2, false);
    json["added_tokens"] = serde_json::json!([]);
    let none = dir.path().join("no_eos.json");
    std::fs::write(&none, serde_json::to_string(&json).unwrap()).unwrap();
    match Tokenizer::open(&none) {
        Err(Error::InvalidConfig { setting, .. }) => assert_eq!(setting, "eos_token"),
        other => panic!("{other:?}"),
    }
    // A pool budget too small for the tokenizer and its cache.
    let source =
        Arc::new(TextTokens::open(&jsonl, &OpenOptions::default(), "text", tokenizer).unwrap());
    match TokenLoader::builder(8, 2)
        .text(source)
        .pool_budget(1 << 20)
        .build()
    {
        Err(Error::InvalidConfig { setting, .. }) => assert_eq!(setting, "pool_budget"),
        other => panic!("{:?}", other.map(|_| ())),
    }
}

/// Many workers over a corpus of few windows per pass: the workers ahead must not undo what
/// the ones behind need (the stream once restarted from a pass start for a row behind it, the
/// workers ahead moved it forward again, and it tokenized pass after pass without delivering).
/// Each epoch is delivered, and the windows tokenized are those the delivered rows need plus
/// the few tokenized ahead.
#[test]
fn many_workers_over_a_few_windows_per_pass_deliver_without_tokenizing_again() {
    // 17 windows a pass; and 2, so that the rows in flight span several passes.
    for (documents, packed) in [(136, false), (136, true), (16, false), (16, true)] {
        many_workers_deliver(documents, packed);
    }
}

fn many_workers_deliver(documents: usize, packed: bool) {
    let dir = tempfile::tempdir().unwrap();
    let docs = texts(documents, 9);
    let (jsonl, tok) = corpus(dir.path(), &docs);
    let pass_tokens: usize = ids_of(&tok, &docs).iter().map(Vec::len).sum();
    let source = text_source(&jsonl, &tok);
    let (seq_len, batch, window, workers) = (16usize, 8usize, 8u64, 16usize);
    let windows_per_pass = (docs.len() as u64).div_ceil(window);
    {
        let mut loader = TokenLoader::builder(seq_len, batch)
            .text(Arc::clone(&source))
            .window(window)
            .mode(if packed {
                SampleMode::Packed
            } else {
                SampleMode::Concatenated
            })
            .shuffle(3)
            .workers(workers)
            .build()
            .unwrap();
        let mut rows = 0u64;
        for epoch in 0..4 {
            loader.set_epoch(epoch);
            loop {
                match loader.next_timeout(std::time::Duration::from_secs(60)) {
                    gpufeed::Next::Ready(b) => rows += b.unwrap().indices().len() as u64,
                    gpufeed::Next::EndOfEpoch => break,
                    gpufeed::Next::Pending => panic!(
                        "packed {packed}: no batch for 60 s after {rows} rows: {:?}",
                        loader.text_stats()[0]
                    ),
                }
            }
        }
        let stats = loader.text_stats()[0].clone().unwrap();
        // A pass gives at least `pass_tokens / seq_len / 2` rows either way (packed rows hold
        // at least half a row on average: best fit decreasing); one window to estimate, up to
        // a pass ahead.
        let pass_rows = (pass_tokens / seq_len / 2) as u64;
        let passes = rows.div_ceil(pass_rows) + 1;
        assert!(
            stats.windows <= 1 + passes * windows_per_pass + workers as u64,
            "packed {packed}: {} windows tokenized for {rows} rows ({passes} passes of \
             {windows_per_pass} windows at most): {stats:?}",
            stats.windows
        );
        assert_eq!((stats.retokenized, stats.restarts), (0, 0), "{stats:?}");
    }
}

/// A document that cannot be tokenized (its text is null) is an error naming it, for
/// every worker that needs a row after it, never a wait for a window that will not come.
#[test]
fn a_document_that_fails_to_tokenize_is_an_error_for_the_rows_after_it_not_a_hang() {
    let dir = tempfile::tempdir().unwrap();
    let docs = texts(64, 10);
    let (jsonl, tok) = corpus(dir.path(), &docs);
    let mut lines: Vec<String> = std::fs::read_to_string(&jsonl)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    lines[40] = serde_json::json!({"text": null, "n": 40}).to_string();
    std::fs::write(&jsonl, lines.join("\n") + "\n").unwrap();
    let source = text_source(&jsonl, &tok);
    let mut loader = TokenLoader::builder(16, 4)
        .text(source)
        .window(4)
        .workers(4)
        .build()
        .unwrap();
    let mut errors = 0;
    for _ in 0..loader.batches_per_epoch() {
        match loader.next_timeout(std::time::Duration::from_secs(60)) {
            gpufeed::Next::Ready(Ok(_)) => {}
            gpufeed::Next::Ready(Err(e)) => {
                assert!(e.to_string().contains("line 41"), "{e}");
                errors += 1;
                if errors == 3 {
                    break;
                }
            }
            gpufeed::Next::EndOfEpoch => break,
            gpufeed::Next::Pending => panic!("no batch nor error for 60 s"),
        }
    }
    assert!(errors > 0);
}

/// Going back to an earlier epoch on the same loader (many workers, a shuffled stream of a
/// few windows per pass) gives that epoch's rows again, after the sums were released.
#[test]
fn an_earlier_epoch_again_on_the_same_loader_gives_the_same_rows() {
    let dir = tempfile::tempdir().unwrap();
    let docs = texts(40, 11);
    let (jsonl, tok) = corpus(dir.path(), &docs);
    let source = text_source(&jsonl, &tok);
    let mut loader = TokenLoader::builder(16, 4)
        .text(source)
        .window(8)
        .shuffle(5)
        .workers(8)
        .build()
        .unwrap();
    let epoch_rows = |loader: &mut TokenLoader, epoch: u64| {
        loader.set_epoch(epoch);
        let mut all = BTreeMap::new();
        for b in loader.by_ref() {
            all.extend(rows_of(&b.unwrap(), 16));
        }
        all
    };
    let first: Vec<_> = (0..4).map(|e| epoch_rows(&mut loader, e)).collect();
    for e in [1, 0, 3] {
        assert_eq!(
            epoch_rows(&mut loader, e),
            first[e as usize],
            "epoch {e} again"
        );
    }
}
