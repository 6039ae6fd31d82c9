//! Token streams end to end: rows of documents written as Megatron's builder writes them, read
//! through the token loader, every invariant counted (tokens once per epoch when
//! concatenated, documents once per epoch when packed, split only at row ends, positions,
//! labels, `cu_seqlens`), blends exact per epoch and within 0.1% over every 10,000 samples,
//! and resumes at any global batch under any world size equal to the run without one.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use gpufeed::format::DType;
use gpufeed::source::tokens::{FlatTokens, IndexedTokens, TokenSource};
use gpufeed::tokens::{SampleMode, TokenLoader, TokenLoaderBuilder};
use gpufeed::{Batch, BatchStream, Error, ErrorKind, LoaderState};
use proptest::prelude::*;

use crate::token_common::write_megatron;

/// Document `doc`'s tokens: each names its document and place (`doc << 16 | offset`).
fn doc_tokens(doc: usize, len: u64) -> Vec<u32> {
    (0..len).map(|o| ((doc as u32) << 16) | o as u32).collect()
}

fn documents(lengths: &[u64]) -> Vec<Vec<u32>> {
    lengths
        .iter()
        .enumerate()
        .map(|(d, &l)| doc_tokens(d, l))
        .collect()
}

/// A Megatron dataset of documents of these lengths (int32 tokens), in `dir`.
fn megatron(dir: &Path, name: &str, lengths: &[u64]) -> Arc<dyn TokenSource> {
    let prefix = dir.join(name);
    write_megatron(&prefix, &documents(lengths), 4);
    Arc::new(IndexedTokens::open(&prefix).unwrap())
}

/// One row as delivered.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Row {
    input: Vec<i64>,
    labels: Vec<i64>,
    positions: Vec<i64>,
    docs: Vec<i32>,
}

/// The rows of a batch by global position, after checking its `cu_seqlens` against its
/// document ids.
fn rows_of(batch: &Batch, seq_len: usize) -> Vec<(u64, Row)> {
    let input = batch.field::<i64>("input_ids").unwrap();
    let labels = batch.field::<i64>("labels").unwrap();
    let positions = batch.field::<i64>("position_ids").unwrap();
    let docs = batch.field::<i32>("document_ids").unwrap();
    let counts = batch.tokens().expect("a token batch has counts");
    // cu_seqlens: the boundaries of the document pieces and of each row's padding, over the
    // batch's tokens end to end; the rest repeat the total.
    let cu = batch.field::<i32>("cu_seqlens").unwrap();
    let n = counts.sequences as usize;
    let total = (batch.len() * seq_len) as i32;
    assert_eq!(cu[0], 0);
    assert_eq!(cu[n], total);
    assert!(cu[n..].iter().all(|&c| c == total));
    let mut want = vec![0i32];
    let mut max = 0;
    for t in 1..=batch.len() * seq_len {
        let boundary =
            t % seq_len == 0 || docs[t] != docs[t - 1] || positions[t] == 0 && docs[t] != -1;
        if boundary {
            max = max.max(t as i32 - want.last().unwrap());
            want.push(t as i32);
        }
    }
    assert_eq!(&cu[..=n], &want[..], "cu_seqlens");
    assert_eq!(counts.max_seqlen, max as u64);
    let pad = docs.iter().filter(|&&d| d == -1).count() as u64;
    assert_eq!(counts.padding, pad);
    assert_eq!(counts.tokens, total as u64 - pad);
    let mut out = Vec::new();
    for (j, &g) in batch.indices().iter().enumerate() {
        let r = j * seq_len..(j + 1) * seq_len;
        let row = Row {
            input: input[r.clone()].to_vec(),
            labels: labels[r.clone()].to_vec(),
            positions: positions[r.clone()].to_vec(),
            docs: docs[r].to_vec(),
        };
        if g == u64::MAX {
            // A padding row: nothing to learn.
            assert!(row.docs.iter().all(|&d| d == -1));
            assert!(row.labels.iter().all(|&l| l == -100));
            assert!(j >= batch.len() - batch.padding());
        } else {
            out.push((g, row));
        }
    }
    out
}

/// Every row of one epoch of every rank of `world`, by global position.
fn epoch_rows(
    builder: impl Fn(u64, u64) -> TokenLoaderBuilder,
    world: u64,
    epoch: u64,
    seq_len: usize,
) -> BTreeMap<u64, Row> {
    let mut all = BTreeMap::new();
    for rank in 0..world {
        let mut loader = builder(rank, world).build().unwrap();
        loader.set_epoch(epoch);
        for batch in loader.by_ref() {
            for (g, row) in rows_of(&batch.unwrap(), seq_len) {
                assert!(all.insert(g, row).is_none(), "position {g} twice");
            }
        }
    }
    all
}

fn split(token: i64) -> (usize, u64) {
    ((token >> 16) as usize, (token & 0xffff) as u64)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Concatenated rows: every token of the epoch is an input of exactly one row, labels are
    /// the next token of the stream, and in file order the rows are the documents end to end.
    #[test]
    fn concatenated_rows_use_every_token_of_the_epoch_once(
        lengths in proptest::collection::vec(0u64..60, 1..40),
        seq_len in 1usize..24,
        batch in 1usize..7,
        world in 1u64..4,
        window in 1u64..9,
        seed in proptest::option::of(0u64..1000),
    ) {
        prop_assume!(lengths.iter().sum::<u64>() > 0);
        let dir = tempfile::tempdir().unwrap();
        let source = megatron(dir.path(), "c", &lengths);
        let builder = |rank, world| {
            let b = TokenLoader::builder(seq_len, batch)
                .source(Arc::clone(&source))
                .window(window)
                .shard(rank, world)
                .workers(2);
            match seed { Some(s) => b.shuffle(s), None => b }
        };
        let rows = epoch_rows(builder, world, 1, seq_len);
        let total: u64 = lengths.iter().sum();
        prop_assert_eq!(rows.len() as u64, total.div_ceil(seq_len as u64));
        let mut inputs: Vec<i64> = rows.values().flat_map(|r| {
            r.input.iter().zip(&r.docs).filter(|(_, d)| **d != -1).map(|(t, _)| *t).collect::<Vec<_>>()
        }).collect();
        let stream: Vec<i64> = inputs.clone();
        inputs.sort_unstable();
        let mut want: Vec<i64> = documents(&lengths).concat().into_iter().map(i64::from).collect();
        let in_file_order = want.clone();
        want.sort_unstable();
        prop_assert_eq!(&inputs, &want, "the epoch's tokens, each once");
        for row in rows.values() {
            for t in 0..seq_len {
                if row.docs[t] == -1 {
                    prop_assert_eq!(row.labels[t], -100);
                    continue;
                }
                // The label is the next token of the stream: the same document's next, or the
                // first of the document that follows (none at the epoch's end), also for the
                // row's last input (the window's extra token).
                if t + 1 < seq_len && row.docs[t + 1] != -1 {
                    prop_assert_eq!(row.labels[t], row.input[t + 1]);
                }
                let (doc, offset) = split(row.input[t]);
                if offset + 1 < lengths[doc] {
                    prop_assert_eq!(split(row.labels[t]), (doc, offset + 1));
                } else {
                    prop_assert!(row.labels[t] == -100 || split(row.labels[t]).1 == 0);
                }
                // Positions count from each document's piece.
                let first = t == 0 || row.docs[t] != row.docs[t - 1];
                prop_assert_eq!(row.positions[t] == 0, first);
            }
        }
        if seed.is_none() {
            prop_assert_eq!(stream, in_file_order, "sequential rows are the documents end to end");
        }
    }

    /// Packed rows: every document once per epoch, whole or split at row ends only, positions
    /// from 0 at each piece, labels within each document and ignored at its end.
    #[test]
    fn packed_rows_hold_every_document_once_split_only_at_row_ends(
        lengths in proptest::collection::vec(0u64..50, 1..40),
        seq_len in 1usize..20,
        batch in 1usize..6,
        world in 1u64..4,
        window in 1u64..12,
        seed in proptest::option::of(0u64..1000),
    ) {
        prop_assume!(lengths.iter().sum::<u64>() > 0);
        let dir = tempfile::tempdir().unwrap();
        let source = megatron(dir.path(), "p", &lengths);
        let builder = |rank, world| {
            let b = TokenLoader::builder(seq_len, batch)
                .source(Arc::clone(&source))
                .mode(SampleMode::Packed)
                .window(window)
                .shard(rank, world)
                .workers(2);
            match seed { Some(s) => b.shuffle(s), None => b }
        };
        let rows = epoch_rows(builder, world, 2, seq_len);
        let mut seen: Vec<Vec<(u64, u64)>> = vec![Vec::new(); lengths.len()];
        for row in rows.values() {
            let mut t = 0;
            while t < seq_len {
                if row.docs[t] == -1 {
                    prop_assert!(row.docs[t..].iter().all(|&d| d == -1), "padding ends the row");
                    prop_assert!(row.labels[t..].iter().all(|&l| l == -100));
                    break;
                }
                let end = (t..seq_len).find(|&u| row.docs[u] != row.docs[t]).unwrap_or(seq_len);
                let (doc, first) = split(row.input[t]);
                for u in t..end {
                    prop_assert_eq!(split(row.input[u]), (doc, first + (u - t) as u64));
                    prop_assert_eq!(row.positions[u], (u - t) as i64);
                }
                let last = first + (end - t) as u64;
                // Split only at row ends: a piece that does not end its document ends its row
                // (the rest follows in other rows: full rows, then the remainder, packed).
                prop_assert!(last == lengths[doc] || end == seq_len, "doc {doc} cut mid-row");
                for u in t..end - 1 {
                    prop_assert_eq!(row.labels[u], row.input[u + 1]);
                }
                let want_last = if last == lengths[doc] { -100 } else { (((doc as u32) << 16) | last as u32) as i64 };
                prop_assert_eq!(row.labels[end - 1], want_last, "label of doc {}'s piece end", doc);
                seen[doc].push((first, last));
                t = end;
            }
        }
        for (doc, pieces) in seen.iter_mut().enumerate() {
            pieces.sort_unstable();
            let mut at = 0;
            for &(a, b) in pieces.iter() {
                prop_assert_eq!(a, at, "doc {} pieces {:?}", doc, pieces);
                at = b;
            }
            prop_assert_eq!(at, lengths[doc], "doc {} whole once", doc);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    /// A state taken after any global batch, at any world size from 1 to 16, resumed at any
    /// other (twice in a row), gives the same global stream as the run without a stop.
    #[test]
    fn resume_at_any_global_batch_under_any_world_size_equals_the_run_without_one(
        lengths in proptest::collection::vec(1u64..40, 4..30),
        seq_len in 2usize..12,
        batch in 1usize..20,
        worlds in (1u64..=16, 1u64..=16, 1u64..=16),
        stops in (0.0f64..1.0, 0.0f64..1.0),
        packed: bool,
        blend: bool,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let a = megatron(dir.path(), "a", &lengths);
        let b = megatron(dir.path(), "b", &lengths.iter().rev().map(|l| l + 3).collect::<Vec<_>>());
        let builder = |rank: u64, world: u64| {
            let mut t = TokenLoader::builder(seq_len, batch)
                .weighted(Arc::clone(&a), 3.0)
                .shuffle(5)
                .window(4)
                .mode(if packed { SampleMode::Packed } else { SampleMode::Concatenated })
                .shard(rank, world)
                .workers(1);
            if blend {
                t = t.weighted(Arc::clone(&b), 1.0).samples_per_epoch(37);
            }
            t
        };
        let whole = epoch_rows(builder, 1, 1, seq_len);
        let batches = builder(0, 1).build().unwrap().batches_per_epoch();
        let first = ((stops.0 * batches as f64) as u64).min(batches);
        let second = first + ((stops.1 * (batches - first) as f64) as u64).min(batches - first);
        let (w1, w2, w3) = worlds;
        let mut got = BTreeMap::new();
        // Run 1: world w1, epoch 1, up to `first` global batches; every rank's state is the same.
        let mut state: Option<LoaderState> = None;
        for rank in 0..w1 {
            let mut l = builder(rank, w1).build().unwrap();
            l.set_epoch(1);
            for _ in 0..first {
                for (g, row) in rows_of(&l.next().unwrap().unwrap(), seq_len) {
                    got.insert(g, row);
                }
            }
            let s = l.state();
            prop_assert_eq!(s.next_batch, first);
            if let Some(prev) = &state {
                prop_assert_eq!(prev.next_batch, s.next_batch);
                prop_assert_eq!(&prev.tokens, &s.tokens);
            }
            state = Some(s);
        }
        // Run 2: world w2 from that state, up to `second`; run 3: world w3 to the end.
        let state = serde_json::to_string(&state.unwrap()).unwrap();
        let mut next = None;
        for rank in 0..w2 {
            let s: LoaderState = serde_json::from_str(&state).unwrap();
            let mut l = builder(rank, w2).resume(s).build().unwrap();
            l.set_epoch(1);
            for _ in first..second {
                for (g, row) in rows_of(&l.next().unwrap().unwrap(), seq_len) {
                    prop_assert!(got.insert(g, row).is_none(), "position {g} repeated");
                }
            }
            next = Some(l.state());
        }
        let next = next.unwrap();
        prop_assert_eq!(next.next_batch, second);
        for rank in 0..w3 {
            let mut l = builder(rank, w3).build().unwrap();
            l.load_state(next.clone()).unwrap();
            l.set_epoch(1);
            for batch in l.by_ref() {
                for (g, row) in rows_of(&batch.unwrap(), seq_len) {
                    prop_assert!(got.insert(g, row).is_none(), "position {g} repeated");
                }
            }
        }
        prop_assert_eq!(got, whole);
    }
}

#[test]
fn blends_take_exact_counts_per_epoch_and_hold_their_shares_over_every_window() {
    // Three sources of 1-token documents... packed into rows of 4: each row's source is in its
    // tokens. 40,000 samples an epoch, weights 5 : 3 : 2.
    let dir = tempfile::tempdir().unwrap();
    let sizes = [3000u64, 1000, 700];
    let sources: Vec<Arc<dyn TokenSource>> = sizes
        .iter()
        .enumerate()
        .map(|(s, &n)| {
            let docs: Vec<Vec<u32>> = (0..n)
                .map(|d| vec![((s as u32) << 24) | d as u32; 1 + (d % 7) as usize])
                .collect();
            let prefix = dir.path().join(format!("s{s}"));
            write_megatron(&prefix, &docs, 4);
            Arc::new(IndexedTokens::open(&prefix).unwrap()) as Arc<dyn TokenSource>
        })
        .collect();
    let weights = [5.0, 3.0, 2.0];
    let mut b = TokenLoader::builder(4, 64)
        .mode(SampleMode::Packed)
        .shuffle(3)
        .samples_per_epoch(40_000)
        .workers(2);
    for (s, w) in sources.iter().zip(weights) {
        b = b.weighted(Arc::clone(s), w);
    }
    let mut loader = b.build().unwrap();
    assert_eq!(loader.samples_per_source(), [20_000, 12_000, 8_000]);
    for epoch in 0..2 {
        loader.set_epoch(epoch);
        let mut by_position = vec![usize::MAX; 40_000];
        for batch in loader.by_ref() {
            let batch = batch.unwrap();
            let input = batch.field::<i64>("input_ids").unwrap();
            for (j, &g) in batch.indices().iter().enumerate() {
                by_position[g as usize] = (input[j * 4] >> 24) as usize;
            }
        }
        let mut counts = [0u64; 3];
        for &s in &by_position {
            counts[s] += 1;
        }
        assert_eq!(
            counts,
            [20_000, 12_000, 8_000],
            "exact counts, epoch {epoch}"
        );
        let mut window = [0i64; 3];
        for &s in &by_position[..10_000] {
            window[s] += 1;
        }
        let mut worst = 0f64;
        for start in 0..=by_position.len() - 10_000 {
            if start > 0 {
                window[by_position[start - 1]] -= 1;
                window[by_position[start + 9_999]] += 1;
            }
            for (s, &c) in window.iter().enumerate() {
                worst = worst.max((c as f64 / 10_000.0 - weights[s] / 10.0).abs());
            }
        }
        assert!(
            worst <= 0.001,
            "epoch {epoch}: a window's share is off by {worst}"
        );
    }
    let stats = loader.token_stats();
    assert_eq!(stats.rows_per_source, [40_000, 24_000, 16_000]);
}

#[test]
fn a_flat_train_bin_is_one_document_cut_into_windows() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("train.bin");
    let tokens: Vec<u16> = (0..1000u16).map(|t| t * 7 % 50_257).collect();
    std::fs::write(
        &path,
        tokens
            .iter()
            .flat_map(|t| t.to_le_bytes())
            .collect::<Vec<u8>>(),
    )
    .unwrap();
    let source = Arc::new(FlatTokens::open(&path, DType::U16).unwrap());
    let mut loader = TokenLoader::builder(64, 4)
        .source(source)
        .input_dtype(DType::U16)
        .workers(1)
        .build()
        .unwrap();
    let mut stream = Vec::new();
    for batch in loader.by_ref() {
        let batch = batch.unwrap();
        let docs = batch.field::<i32>("document_ids").unwrap();
        let input = batch.field::<u16>("input_ids").unwrap();
        stream.extend(
            input
                .iter()
                .zip(docs)
                .filter(|(_, d)| **d != -1)
                .map(|(t, _)| *t),
        );
    }
    assert_eq!(stream, tokens);
}

#[test]
fn corrupt_and_truncated_indexes_are_typed_errors_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("m");
    write_megatron(&prefix, &documents(&[5, 3, 8]), 8);
    let idx = std::fs::read(prefix.with_extension("idx")).unwrap();
    let bin = std::fs::read(prefix.with_extension("bin")).unwrap();
    let open = |idx: &[u8], bin: &[u8]| {
        std::fs::write(prefix.with_extension("idx"), idx).unwrap();
        std::fs::write(prefix.with_extension("bin"), bin).unwrap();
        IndexedTokens::open(&prefix).and_then(|t| t.verify().map(|_| t))
    };
    let mut cases: Vec<(&str, Vec<u8>, Vec<u8>, &str)> = Vec::new();
    cases.push((
        "empty index",
        Vec::new(),
        bin.clone(),
        "fewer than the 34-byte header",
    ));
    cases.push((
        "truncated header",
        idx[..20].to_vec(),
        bin.clone(),
        "truncated",
    ));
    let mut m = idx.clone();
    m[0] = b'X';
    cases.push(("magic", m, bin.clone(), "no MMIDIDX magic"));
    let mut m = idx.clone();
    m[9] = 2;
    cases.push(("version", m, bin.clone(), "version 2"));
    let mut m = idx.clone();
    m[17] = 7;
    cases.push(("float dtype", m, bin.clone(), "float32"));
    let mut m = idx.clone();
    m[17] = 42;
    cases.push(("unknown dtype", m, bin.clone(), "dtype code 42"));
    cases.push((
        "truncated arrays",
        idx[..idx.len() - 3].to_vec(),
        bin.clone(),
        "it is truncated or corrupt",
    ));
    let mut m = idx.clone();
    m[18] = 4; // four sequences claimed
    cases.push(("counts", m, bin.clone(), "need"));
    let docs_at = 34 + 12 * 3;
    let mut m = idx.clone();
    m[docs_at..docs_at + 8].copy_from_slice(&1i64.to_le_bytes());
    cases.push(("document index start", m, bin.clone(), "starts at 1"));
    let mut m = idx.clone();
    m[docs_at + 24..docs_at + 32].copy_from_slice(&2i64.to_le_bytes());
    cases.push(("document index end", m, bin.clone(), "ends at 2"));
    let mut m = idx.clone();
    m[docs_at + 8..docs_at + 16].copy_from_slice(&3i64.to_le_bytes());
    m[docs_at + 16..docs_at + 24].copy_from_slice(&1i64.to_le_bytes());
    cases.push(("document index order", m, bin.clone(), "document 1"));
    let mut m = idx.clone();
    m[34 + 4..34 + 8].copy_from_slice(&(-2i32).to_le_bytes());
    cases.push(("negative length", m, bin.clone(), "sequence 1"));
    let mut m = idx.clone();
    m[34 + 12 + 8..34 + 12 + 16].copy_from_slice(&1_000i64.to_le_bytes());
    cases.push((
        "pointer past the data",
        m,
        bin.clone(),
        "past the data file",
    ));
    cases.push((
        "truncated data",
        idx.clone(),
        bin[..bin.len() - 2].to_vec(),
        "it is truncated",
    ));
    for (what, idx, bin, message) in cases {
        let e = open(&idx, &bin).map(|_| ()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{what}: {e}");
        let text = e.to_string();
        assert!(text.contains(message), "{what}: `{message}` not in: {text}");
        assert!(
            text.contains("m.idx") || text.contains("m.bin"),
            "{what}: no file in {text}"
        );
    }
    // The loader's build reads every entry: a corrupt one is its error, before any batch.
    let mut m = idx.clone();
    m[34 + 4..34 + 8].copy_from_slice(&(-1i32).to_le_bytes());
    std::fs::write(prefix.with_extension("idx"), &m).unwrap();
    std::fs::write(prefix.with_extension("bin"), &bin).unwrap();
    let t = Arc::new(IndexedTokens::open(&prefix).unwrap());
    let e = TokenLoader::builder(4, 2).source(t).build().unwrap_err();
    assert!(matches!(e, Error::Malformed { .. }), "{e}");
}

/// The fixtures of `crates/bench/scripts/megatron_fixture.py` (megatron-core's builder, numpy),
/// or the directory GPUFEED_TOKEN_FIXTURES names (the script's `--check`, with files it wrote).
fn token_fixtures() -> std::path::PathBuf {
    std::env::var_os("GPUFEED_TOKEN_FIXTURES").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokens"),
        Into::into,
    )
}

fn all_tokens(source: &dyn TokenSource, doc: u64) -> Vec<u64> {
    let mut out = vec![0u32; source.document_len(doc).unwrap() as usize];
    source.read(doc, 0, &mut out).unwrap();
    out.into_iter().map(u64::from).collect()
}

fn json_tokens(v: &serde_json::Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

#[test]
fn files_written_by_megatron_core_and_numpy_read_as_those_tools_read_them() {
    let dir = token_fixtures();
    let text = std::fs::read_to_string(dir.join("expected.json")).unwrap();
    let expected: serde_json::Value = serde_json::from_str(&text).unwrap();
    for name in ["megatron_u16", "megatron_i32"] {
        let want = &expected[name];
        let source = IndexedTokens::open(dir.join(name)).unwrap();
        assert_eq!(u64::from(source.dtype_code()), want["dtype_code"], "{name}");
        assert_eq!(source.sequences(), want["sequences"], "{name}");
        let docs = want["documents"].as_array().unwrap();
        assert_eq!(source.documents(), docs.len() as u64, "{name}");
        // Checks every entry, as the loader's build does.
        let total: u64 = docs
            .iter()
            .map(|d| d.as_array().unwrap().len() as u64)
            .sum();
        assert_eq!(source.verify().unwrap(), total, "{name}");
        for (d, doc) in docs.iter().enumerate() {
            assert_eq!(
                all_tokens(&source, d as u64),
                json_tokens(doc),
                "{name} document {d}"
            );
        }
        // Concatenated in file order, the loader delivers megatron's documents end to end.
        let mut loader = TokenLoader::builder(37, 3)
            .source(Arc::new(IndexedTokens::open(dir.join(name)).unwrap()))
            .workers(1)
            .build()
            .unwrap();
        let mut stream = Vec::new();
        for batch in loader.by_ref() {
            let batch = batch.unwrap();
            let ids = batch.field::<i64>("input_ids").unwrap();
            let docs = batch.field::<i32>("document_ids").unwrap();
            stream.extend(
                ids.iter()
                    .zip(docs)
                    .filter(|(_, d)| **d != -1)
                    .map(|(t, _)| *t as u64),
            );
        }
        let want: Vec<u64> = docs.iter().flat_map(json_tokens).collect();
        assert_eq!(stream, want, "{name} through the loader");
    }
    let train = FlatTokens::open(dir.join("train.bin"), DType::U16).unwrap();
    assert_eq!(train.documents(), 1);
    assert_eq!(all_tokens(&train, 0), json_tokens(&expected["train_bin"]));
    let npy = FlatTokens::open_npy(dir.join("tokens.npy")).unwrap();
    assert_eq!(npy.dtype(), DType::U32);
    assert_eq!(all_tokens(&npy, 0), json_tokens(&expected["tokens_npy"]));
}

fn npy_with(descr: &str, shape: &str, data: &[u8]) -> Vec<u8> {
    let mut text = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    while (10 + text.len() + 1) % 64 != 0 {
        text.push(' ');
    }
    text.push('\n');
    let mut b = b"\x93NUMPY\x01\x00".to_vec();
    b.extend((text.len() as u16).to_le_bytes());
    b.extend(text.as_bytes());
    b.extend(data);
    b
}

#[test]
fn flat_token_files_of_the_wrong_size_or_dtype_are_typed_errors_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let names = |e: &Error, p: &Path| {
        let text = e.to_string();
        assert!(text.contains(&p.display().to_string()), "no file in {text}");
    };
    // An odd number of bytes is no whole number of uint16 tokens: truncated, or of another dtype.
    let odd = dir.path().join("odd.bin");
    std::fs::write(&odd, [1u8, 0, 2, 0, 3]).unwrap();
    let e = FlatTokens::open(&odd, DType::U16).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    assert!(
        e.to_string().contains("5 bytes are not a whole number"),
        "{e}"
    );
    names(&e, &odd);
    // The same five bytes are five uint8 tokens.
    assert_eq!(FlatTokens::open(&odd, DType::U8).unwrap().tokens(), 5);
    let e = FlatTokens::open(&odd, DType::F32).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    // A .npy of tokens is 1-D, of integers.
    let two_d = dir.path().join("two_d.npy");
    std::fs::write(&two_d, npy_with("<u2", "(2, 2)", &[0; 8])).unwrap();
    let e = FlatTokens::open_npy(&two_d).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
    assert!(e.to_string().contains("1-D"), "{e}");
    names(&e, &two_d);
    let floats = dir.path().join("floats.npy");
    std::fs::write(&floats, npy_with("<f4", "(2,)", &[0; 8])).unwrap();
    let e = FlatTokens::open_npy(&floats).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
    names(&e, &floats);
    let short = dir.path().join("short.npy");
    std::fs::write(&short, npy_with("<u2", "(4,)", &[0; 6])).unwrap();
    let e = FlatTokens::open_npy(&short).unwrap_err();
    names(&e, &short);
    // A negative id is no token: an error when the row holding it is read, not a huge id.
    let negative = dir.path().join("negative.npy");
    let data: Vec<u8> = [5i32, -3, 7].iter().flat_map(|t| t.to_le_bytes()).collect();
    std::fs::write(&negative, npy_with("<i4", "(3,)", &data)).unwrap();
    let source = Arc::new(FlatTokens::open_npy(&negative).unwrap());
    let mut out = [0u32; 3];
    let e = source.read(0, 0, &mut out).unwrap_err();
    names(&e, &negative);
    let mut loader = TokenLoader::builder(2, 2)
        .source(source)
        .workers(1)
        .build()
        .unwrap();
    let e = loader.next().unwrap().unwrap_err();
    assert!(e.to_string().contains("-3"), "{e}");
}

#[test]
fn bad_settings_are_config_errors_naming_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    let src = megatron(dir.path(), "a", &[40, 30, 20]);
    let b = || TokenLoader::builder(16, 4).source(Arc::clone(&src));
    let cases: [(TokenLoaderBuilder, &str); 9] = [
        (TokenLoader::builder(16, 4), "sources"),
        (
            TokenLoader::builder(0, 4).source(Arc::clone(&src)),
            "seq_len",
        ),
        (
            TokenLoader::builder(16, 0).source(Arc::clone(&src)),
            "global_batch",
        ),
        (b().window(0), "window"),
        (b().shard(3, 3), "rank"),
        (b().input_dtype(DType::F32), "input_dtype"),
        (b().position_dtype(DType::U16), "position_dtype"),
        (
            b().label_dtype(DType::I32).ignore_index(1 << 40),
            "ignore_index",
        ),
        // The padding token must fit the ids' dtype, not be cut to it.
        (b().input_dtype(DType::U16).pad_id(70_000), "pad_id"),
    ];
    for (builder, setting) in cases {
        match builder.build() {
            Err(Error::InvalidConfig { setting: s, .. }) => assert_eq!(s, setting),
            Err(e) => panic!("{setting}: {e}"),
            Ok(_) => panic!("{setting}: built"),
        }
    }
}

#[test]
fn state_at_an_earlier_batch_is_the_state_the_loader_had_there() {
    let dir = tempfile::tempdir().unwrap();
    let a = megatron(dir.path(), "a", &[40, 30, 20, 90, 17, 64, 5, 33]);
    let b = megatron(dir.path(), "b", &[12, 80, 41, 7, 29]);
    let build = || {
        TokenLoader::builder(16, 4)
            .weighted(Arc::clone(&a), 2.0)
            .weighted(Arc::clone(&b), 1.0)
            .mode(SampleMode::Packed)
            .shuffle(9)
            .shard(0, 2)
            .build()
            .unwrap()
    };
    let mut ahead = build();
    let mut behind = build();
    ahead.next().unwrap().unwrap();
    for _ in 0..3 {
        ahead.next().unwrap().unwrap();
        behind.next().unwrap().unwrap();
        let back = ahead.state_at(ahead.state().next_batch - 1);
        assert_eq!(back, behind.state());
        // And it resumes with the batch taken after it.
        let mut resumed = TokenLoader::builder(16, 4)
            .weighted(Arc::clone(&a), 2.0)
            .weighted(Arc::clone(&b), 1.0)
            .mode(SampleMode::Packed)
            .shuffle(9)
            .shard(1, 2)
            .resume(back)
            .build()
            .unwrap();
        assert_eq!(resumed.state().next_batch, behind.state().next_batch);
        assert!(resumed.next().is_some());
    }
}

#[test]
fn chosen_workers_make_the_same_batches_and_say_what_they_chose() {
    let dir = tempfile::tempdir().unwrap();
    let a = megatron(dir.path(), "a", &[40, 30, 20, 90, 17, 64, 5, 33, 70, 11]);
    let build = |workers: gpufeed::Setting| {
        TokenLoader::builder(16, 4)
            .weighted(Arc::clone(&a), 1.0)
            .mode(SampleMode::Packed)
            .shuffle(5)
            .workers(workers)
            .prefetch(gpufeed::Setting::Auto)
            .build()
            .unwrap()
    };
    let batches = |mut loader: TokenLoader| {
        let mut out = Vec::new();
        for b in loader.by_ref() {
            out.push(rows_of(&b.unwrap(), 16));
        }
        (out, loader.loader().stats().tuning)
    };
    let (given, tuning) = batches(build(gpufeed::Setting::Fixed(2)));
    assert!(tuning.is_some_and(|t| t.workers == 2));
    let (chosen, tuning) = batches(build(gpufeed::Setting::Auto));
    assert!(!given.is_empty());
    assert_eq!(chosen, given);
    let tuning = tuning.unwrap();
    assert!(tuning.reason.starts_with("autotune: "), "{}", tuning.reason);
    assert!(tuning.workers >= 1);
}
