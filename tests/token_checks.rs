//! What the token loader refuses rather than delivers: token files truncated while they are
//! read at offsets (an error naming the file, never `SIGBUS`), weights that cannot be a share,
//! and states taken on other data or other settings.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpufeed::format::{DType, Field, ReadMode, ReadOptions, RecordFile, RecordWriter, Schema};
use gpufeed::source::npy_header;
use gpufeed::source::tokens::{DocumentTokens, IndexedTokens, TokenSource, open_tokens};
use gpufeed::tokens::TokenLoader;
use gpufeed::{BatchStream, Error, ErrorKind};

use crate::token_common::write_megatron;

/// `n` documents of `len` tokens each, every token naming its document and place.
fn documents(n: u32, len: u32) -> Vec<Vec<u32>> {
    (0..n)
        .map(|d| (0..len).map(|o| (d << 12) | o).collect())
        .collect()
}

/// `tokens` u16 tokens, raw (nanoGPT's train.bin).
fn train_bin(path: &Path, tokens: u32) -> PathBuf {
    let bytes: Vec<u8> = (0..tokens).flat_map(|t| (t as u16).to_le_bytes()).collect();
    std::fs::write(path, bytes).unwrap();
    path.to_path_buf()
}

/// The error's message names `path`, and it is a file that changed or could not be read.
fn names_the_file(e: &Error, path: &Path) {
    assert!(
        matches!(e.kind(), ErrorKind::FileChanged | ErrorKind::Io),
        "{e}"
    );
    assert!(e.to_string().contains(&path.display().to_string()), "{e}");
}

/// A token loader over `source`, in file order, with batches small enough that an epoch is
/// many of them.
fn loader(source: Arc<dyn TokenSource>) -> TokenLoader {
    TokenLoader::builder(16, 2)
        .source(source)
        .workers(1)
        .prefetch(1)
        .build()
        .unwrap()
}

/// Takes one batch, shortens `file` to 8 bytes, and returns the first error of the rest of the
/// epoch (the batches made ahead before the truncation come first).
fn error_after_truncating(mut loader: TokenLoader, file: &Path) -> Error {
    loader.next().unwrap().unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(file)
        .unwrap()
        .set_len(8)
        .unwrap();
    loader.by_ref().find_map(|b| b.err()).unwrap_or_else(|| {
        panic!(
            "{}: truncated, and the epoch ended without an error",
            file.display()
        )
    })
}

#[test]
fn token_files_truncated_while_read_at_offsets_are_errors_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let pread = ReadMode::Pread;
    // A Megatron dataset: its .bin truncated under the loader.
    let prefix = dir.path().join("m");
    write_megatron(&prefix, &documents(64, 200), 4);
    let bin = prefix.with_extension("bin");
    let source = open_tokens(&prefix, None, pread).unwrap();
    names_the_file(&error_after_truncating(loader(source), &bin), &bin);
    // Its .idx truncated: held whole since the open, so reading goes on, and the check at the
    // next epoch's start names it.
    write_megatron(&prefix, &documents(64, 200), 4);
    let idx = prefix.with_extension("idx");
    let source = Arc::new(IndexedTokens::open_with(&prefix, pread).unwrap());
    std::fs::OpenOptions::new()
        .write(true)
        .open(&idx)
        .unwrap()
        .set_len(40)
        .unwrap();
    let mut out = vec![0u32; 200];
    source.read(63, 0, &mut out).unwrap();
    assert_eq!(out[199], (63 << 12) | 199);
    names_the_file(&source.check_unchanged().unwrap_err(), &idx);
    let mut l = loader(source);
    l.set_epoch(1);
    let e = l.next().unwrap().unwrap_err();
    names_the_file(&e, &idx);
    // nanoGPT's train.bin and a 1-D .npy, through open_tokens as the command and Python open
    // them.
    let flat = train_bin(&dir.path().join("train.bin"), 12_800);
    let source = open_tokens(&flat, Some(DType::U16), pread).unwrap();
    names_the_file(&error_after_truncating(loader(source), &flat), &flat);
    let npy = dir.path().join("tokens.npy");
    let mut bytes = npy_header(DType::U32, &[12_800]).unwrap();
    bytes.extend((0..12_800u32).flat_map(|t| t.to_le_bytes()));
    std::fs::write(&npy, bytes).unwrap();
    let source = open_tokens(&npy, None, pread).unwrap();
    names_the_file(&error_after_truncating(loader(source), &npy), &npy);
    // A field of a dataset opened to be read at offsets.
    let packed = dir.path().join("docs.gfd");
    let schema = Schema::new(vec![Field::tensor("tokens", DType::U16, &[200])]).unwrap();
    let mut w = RecordWriter::create(&packed, schema).unwrap();
    for d in 0..64u16 {
        let doc: Vec<u8> = (0..200u16).flat_map(|t| (d ^ t).to_le_bytes()).collect();
        w.append(&[&doc]).unwrap();
    }
    w.finish().unwrap();
    let options = ReadOptions {
        mode: pread,
        ..ReadOptions::default()
    };
    let dataset = Arc::new(RecordFile::open_with(&packed, options).unwrap());
    let source = Arc::new(DocumentTokens::new(dataset, "tokens", DType::U16).unwrap());
    names_the_file(&error_after_truncating(loader(source), &packed), &packed);
}

#[test]
fn a_megatron_prefix_without_its_bin_says_the_bin_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("web_text_document");
    write_megatron(&prefix, &documents(4, 10), 8);
    let bin = prefix.with_extension("bin");
    std::fs::remove_file(&bin).unwrap();
    for path in [prefix.clone(), prefix.with_extension("idx")] {
        for mode in [ReadMode::Map, ReadMode::Pread] {
            let e = open_tokens(&path, None, mode).unwrap_err();
            let text = e.to_string();
            assert_eq!(e.kind(), ErrorKind::Io, "{text}");
            assert!(text.contains(&bin.display().to_string()), "{text}");
            assert!(text.contains("missing"), "{text}");
            assert!(!text.contains("token_dtype"), "{text}");
        }
    }
    // A .bin alone is a flat file of tokens (nanoGPT's train.bin), not half a Megatron dataset.
    let alone = train_bin(&dir.path().join("train.bin"), 100);
    assert_eq!(IndexedTokens::prefix_of(&alone), None);
    assert!(open_tokens(&alone, Some(DType::U16), ReadMode::Map).is_ok());
}

/// The setting and message of a token loader's build that failed.
fn config_error(builder: gpufeed::tokens::TokenLoaderBuilder) -> (&'static str, String) {
    match builder.build() {
        Err(Error::InvalidConfig { setting, what }) => (setting, what),
        Err(e) => panic!("not a setting's error: {e}"),
        Ok(_) => panic!("built"),
    }
}

#[test]
fn weights_follow_the_same_rules_for_one_source_as_for_many() {
    let dir = tempfile::tempdir().unwrap();
    let a = open_tokens(
        train_bin(&dir.path().join("a.bin"), 1000),
        Some(DType::U16),
        ReadMode::Map,
    )
    .unwrap();
    let b = open_tokens(
        train_bin(&dir.path().join("b.bin"), 1000),
        Some(DType::U16),
        ReadMode::Map,
    )
    .unwrap();
    for (weight, said) in [
        (f64::NAN, "NaN"),
        (-1.0, "-1.0"),
        (0.0, "0.0"),
        (f64::INFINITY, "inf"),
    ] {
        // One source, then the same weight beside a good one (0 is fine beside another).
        let one = TokenLoader::builder(16, 2).weighted(Arc::clone(&a), weight);
        let (setting, what) = config_error(one);
        assert_eq!(setting, "weights");
        assert!(what.contains("a.bin") && what.contains(said), "{what}");
        if weight != 0.0 {
            let two = TokenLoader::builder(16, 2)
                .weighted(Arc::clone(&b), 1.0)
                .weighted(Arc::clone(&a), weight);
            let (setting, what) = config_error(two);
            assert_eq!(setting, "weights");
            assert!(what.contains("a.bin") && what.contains(said), "{what}");
        }
    }
    // A weight too small for one sample, named as typed (not 300 digits of 0.000...).
    let tiny = TokenLoader::builder(16, 2)
        .weighted(Arc::clone(&b), 1.0)
        .weighted(Arc::clone(&a), 1e-300);
    let (_, what) = config_error(tiny);
    assert!(what.contains("a.bin") && what.contains("1e-300"), "{what}");
    assert!(!what.contains("0.0000"), "{what}");
    // Any positive weight is the whole epoch for one source.
    for weight in [1e-300, 0.5, 7.0] {
        let l = TokenLoader::builder(16, 2)
            .weighted(Arc::clone(&a), weight)
            .build()
            .unwrap();
        assert_eq!(l.samples_per_source(), [63]);
    }
}

/// A token loader over `sources` (weights 1), shuffled with `seed`, in global batches of
/// `batch`.
fn token_loader(sources: &[&Arc<dyn TokenSource>], seed: u64, batch: usize) -> TokenLoader {
    let mut b = TokenLoader::builder(16, batch).shuffle(seed).workers(1);
    for s in sources {
        b = b.source(Arc::clone(s));
    }
    b.build().unwrap()
}

/// The state after `n` batches.
fn state_after(mut loader: TokenLoader, n: usize) -> gpufeed::LoaderState {
    for _ in 0..n {
        loader.next().unwrap().unwrap();
    }
    loader.state()
}

#[test]
fn a_state_taken_on_other_data_with_the_same_counts_is_refused_naming_the_source() {
    let dir = tempfile::tempdir().unwrap();
    // Two Megatron datasets of the same documents' lengths, other tokens.
    let (p, q) = (dir.path().join("p"), dir.path().join("q"));
    write_megatron(&p, &documents(64, 200), 4);
    let mut other = documents(64, 200);
    other[40][7] += 1;
    other[63][199] += 1;
    write_megatron(&q, &other, 4);
    let flat = train_bin(&dir.path().join("train.bin"), 5000);
    let open = |path: &Path, dtype| open_tokens(path, dtype, ReadMode::Map).unwrap();
    let (mp, mq, f) = (
        open(&p, None),
        open(&q, None),
        open(&flat, Some(DType::U16)),
    );
    let state = state_after(token_loader(&[&f, &mp], 3, 4), 5);
    let tokens = state.tokens.as_ref().unwrap();
    assert!(tokens.sources.iter().all(|s| s.fingerprint.is_some()));
    assert!(
        tokens.sources[1].name.ends_with("p"),
        "{}",
        tokens.sources[1].name
    );
    // The same data: resumes.
    let mut same = token_loader(&[&f, &mp], 3, 4);
    same.load_state(state.clone()).unwrap();
    // The same counts, other tokens: refused, naming the source that differs and how.
    let mut swapped = token_loader(&[&f, &mq], 3, 4);
    let e = swapped.load_state(state.clone()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Mismatch, "{e}");
    let text = e.to_string();
    assert!(
        text.contains("source 1") && text.contains(&q.display().to_string()),
        "{text}"
    );
    assert!(
        text.contains("fingerprint") && text.contains("same size"),
        "{text}"
    );
    assert!(!text.contains("source 0"), "{text}");
    let e = TokenLoader::builder(16, 4)
        .source(Arc::clone(&f))
        .source(Arc::clone(&mq))
        .shuffle(3)
        .resume(state.clone())
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("fingerprint"), "{e}");
    // A flat file rewritten with other tokens of the same count.
    let bytes: Vec<u8> = (0..5000u16).flat_map(|t| (t ^ 1).to_le_bytes()).collect();
    let flat2 = dir.path().join("train2.bin");
    std::fs::write(&flat2, bytes).unwrap();
    let f2 = open(&flat2, Some(DType::U16));
    let e = token_loader(&[&f2, &mp], 3, 4)
        .load_state(state.clone())
        .unwrap_err();
    assert!(e.to_string().contains("source 0"), "{e}");
    // A state of the layout before fingerprints (no name, no fingerprint) resumes on its
    // counts, as it did.
    let mut json = serde_json::to_value(&state).unwrap();
    for s in json["tokens"]["sources"].as_array_mut().unwrap() {
        let s = s.as_object_mut().unwrap();
        s.remove("fingerprint");
        s.remove("name");
    }
    let old: gpufeed::LoaderState = serde_json::from_value(json).unwrap();
    token_loader(&[&f, &mq], 3, 4).load_state(old).unwrap();
}

#[test]
fn a_state_of_other_settings_says_which_differ_in_words() {
    let dir = tempfile::tempdir().unwrap();
    let f = open_tokens(
        train_bin(&dir.path().join("train.bin"), 5000),
        Some(DType::U16),
        ReadMode::Map,
    )
    .unwrap();
    let g = open_tokens(
        train_bin(&dir.path().join("other.bin"), 3000),
        Some(DType::U16),
        ReadMode::Map,
    )
    .unwrap();
    let state = state_after(token_loader(&[&f], 3, 4), 2);
    let e = token_loader(&[&f], 5, 8)
        .load_state(state.clone())
        .unwrap_err();
    let text = e.to_string();
    for said in [
        "shuffle seed 3 (this loader: shuffle seed 5)",
        "global batch size 4 (this loader: global batch size 8)",
    ] {
        assert!(text.contains(said), "`{said}` missing from: {text}");
    }
    assert!(!text.contains("OrderSpec") && !text.contains('{'), "{text}");
    // Other sizes of the same count of samples: the source's sizes, in words.
    let mut b = TokenLoader::builder(16, 4)
        .shuffle(3)
        .workers(1)
        .source(Arc::clone(&g));
    b = b.samples_per_epoch(state.order.len);
    let e = b.build().unwrap().load_state(state).unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("source 0") && text.contains("other.bin"),
        "{text}"
    );
    assert!(
        text.contains("5000 tokens") && text.contains("3000 tokens"),
        "{text}"
    );
}

#[test]
fn batch_numbers_go_on_from_a_state_under_another_world_size() {
    let dir = tempfile::tempdir().unwrap();
    let f = open_tokens(
        train_bin(&dir.path().join("train.bin"), 1000),
        Some(DType::U16),
        ReadMode::Map,
    )
    .unwrap();
    let build = |rank, world| {
        TokenLoader::builder(16, 6)
            .source(Arc::clone(&f))
            .shuffle(1)
            .shard(rank, world)
            .workers(1)
            .build()
            .unwrap()
    };
    let mut first = build(0, 2);
    for n in 0..3 {
        assert_eq!(first.next().unwrap().unwrap().number(), n);
    }
    let state = first.state();
    // 63 rows in global batches of 6: 11 batches, the last of 3 rows.
    let mut resumed = build(3, 4);
    resumed.load_state(state).unwrap();
    // What each batch says of itself (batches are not held: the pool's budget is a few).
    let batches: Vec<(u64, Vec<u64>, usize)> = resumed
        .by_ref()
        .map(|b| {
            let b = b.unwrap();
            (b.number(), b.indices().to_vec(), b.padding())
        })
        .collect();
    let numbers: Vec<u64> = batches.iter().map(|b| b.0).collect();
    assert_eq!(numbers, (3..11).collect::<Vec<_>>());
    for (number, indices, padding) in &batches {
        // Rank 3 of 4 takes positions 4..6 of each global batch of 6 (2 rows), and of the last
        // (3 rows) position 2 and a padding row.
        let real = &indices[..indices.len() - padding];
        assert!(real.iter().all(|&g| g / 6 == *number && g < 63), "{real:?}");
        assert!(
            indices[indices.len() - padding..]
                .iter()
                .all(|&g| g == u64::MAX)
        );
    }
    assert_eq!(batches.last().unwrap().2, 1);
    assert_eq!(batches[0].2, 0);
}
