//! Tokenizing text on one core: gpufeed's fast byte-level BPE against the `tokenizers` crate,
//! with GPT-2's and a Llama-3-style tokenizer.json, over a corpus of man pages in ten
//! languages; then one long piece (a document of 1 to 10 MB with no space, newline or
//! punctuation) on each engine: time and peak memory.
//!
//! ```sh
//! crates/bench/scripts/tokenize.sh   # makes the fixtures and the corpus, runs this and the
//!                                    # Python anchors (tiktoken, Python tokenizers, gigatoken)
//! cargo bench --bench tokenize       # needs them made: target/tokenizer-tests (or
//!                                    # GPUFEED_TOKENIZER_TESTS), as python/run-tests.sh makes them
//! ```
//!
//! Each timed pass takes a new encoder (its cache of pieces starts empty), encodes every
//! document into one reused buffer, and is reported by criterion as tokens per second
//! (`elem/s`). The two engines' ids are checked equal before the runs. The long pieces are
//! timed once each, outside criterion (the crate takes seconds on them), with the process's
//! peak resident memory reset before each (`/proc/self/clear_refs`).

use std::path::{Path, PathBuf};
use std::time::Instant;

use criterion::{BatchSize, Criterion, Throughput};
use gpufeed::tokenizer::{EngineChoice, Tokenizer, TokenizerOptions};

/// Where python/run-tests.sh (or crates/bench/scripts/tokenize.sh) made the fixtures and corpus.
fn data_dir() -> PathBuf {
    match std::env::var_os("GPUFEED_TOKENIZER_TESTS") {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("target/tokenizer-tests"),
    }
}

/// The corpus's documents (corpus.jsonl: a stamp line, then one `{"text": ...}` per line).
fn corpus(path: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| {
        eprintln!(
            "{}: {e}\nMake the fixtures and the corpus first: crates/bench/scripts/tokenize.sh \
             (or python/run-tests.sh python/tests/test_tokenizer.py)",
            path.display()
        );
        std::process::exit(2)
    });
    text.lines()
        .skip(1)
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
            v["text"].as_str().expect("a text").to_string()
        })
        .collect()
}

fn open(dir: &Path, engine: EngineChoice) -> Tokenizer {
    TokenizerOptions::new()
        .append_eos(false)
        .engine(engine)
        .open(dir)
        .expect("the fixture opens")
}

/// Opens the fixture on `engine` and prints the time it took, the resident memory it added
/// (after `malloc_trim`) and the model's size the tokenizer reports.
fn open_measured(name: &str, dir: &Path, engine: EngineChoice) -> Tokenizer {
    // SAFETY: malloc_trim only gives free heap memory back to the system.
    unsafe { libc::malloc_trim(0) };
    let before = resident_kib();
    let t = Instant::now();
    let tok = open(dir, engine);
    let s = t.elapsed().as_secs_f64();
    // SAFETY: as above.
    unsafe { libc::malloc_trim(0) };
    let grown = resident_kib().saturating_sub(before) as f64 / 1024.0;
    let json = std::fs::metadata(tok.path()).map(|m| m.len()).unwrap_or(0) as f64 / 1e6;
    let memory = tok.memory();
    println!(
        "{name} ({json:.1} MB of tokenizer.json) on {engine:?}: opened in {s:.2} s, resident \
         +{grown:.1} MiB; reported: model {:.1} MiB, {:.1} MiB per encoder",
        memory.model as f64 / (1 << 20) as f64,
        memory.per_encoder as f64 / (1 << 20) as f64
    );
    tok
}

fn bench_corpus(c: &mut Criterion, name: &str, dir: &Path, docs: &[String]) {
    let fast = open_measured(name, dir, EngineChoice::Fast);
    let slow = open_measured(name, dir, EngineChoice::Crate);
    let (mut f, mut s) = (fast.encoder(), slow.encoder());
    let mut tokens = 0u64;
    for d in docs {
        let a = f.encode(d).unwrap();
        assert_eq!(a, s.encode(d).unwrap(), "{name}: the engines differ");
        tokens += a.len() as u64;
    }
    let bytes: usize = docs.iter().map(String::len).sum();
    println!(
        "{name}: {} documents, {bytes} bytes, {tokens} tokens ({:.2} bytes/token), the same ids \
         from both engines; {}",
        docs.len(),
        bytes as f64 / tokens as f64,
        fast.engine()
    );
    let mut group = c.benchmark_group(format!("tokenize/{name}"));
    group.throughput(Throughput::Elements(tokens));
    for (engine, tok) in [("fast", &fast), ("crate", &slow)] {
        let mut out = Vec::new();
        group.bench_function(engine, |b| {
            b.iter_batched(
                || tok.encoder(),
                |mut encoder| {
                    for d in docs {
                        out.clear();
                        encoder.encode_into(d, &mut out).unwrap();
                    }
                },
                BatchSize::PerIteration,
            )
        });
    }
    group.finish();
}

/// Peak resident memory (KiB) since the last reset.
fn peak_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap_or(0)
}

fn resident_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap_or(0)
}

/// One long piece per engine and size: seconds, MB/s, and the peak memory above the resident
/// memory before it, per byte of the piece.
fn long_pieces(dir: &Path, docs: &[String]) {
    // The corpus's letters only (all scripts): one piece for the GPT-2 split. And one letter
    // repeated, the most merges per byte.
    let letters: String = docs
        .concat()
        .chars()
        .filter(|c| c.is_alphabetic())
        .collect();
    println!("long pieces (GPT-2): MB, engine, seconds, MB/s, tokens, peak bytes per byte");
    for (kind, source) in [("letters", letters), ("a", "a".repeat(1 << 20))] {
        for mb in [1usize, 2, 5, 10] {
            let mut piece = String::with_capacity(mb << 20);
            while piece.len() < mb * 1_000_000 {
                piece.push_str(&source);
            }
            let end = (0..=mb * 1_000_000)
                .rev()
                .find(|&i| piece.is_char_boundary(i))
                .unwrap_or(0);
            piece.truncate(end);
            for engine in [EngineChoice::Fast, EngineChoice::Crate] {
                let tok = open(dir, engine);
                let mut encoder = tok.encoder();
                let _ = std::fs::write("/proc/self/clear_refs", "5");
                let before = resident_kib();
                let t = Instant::now();
                let ids = encoder.encode(&piece).unwrap();
                let s = t.elapsed().as_secs_f64();
                let peak = peak_kib().saturating_sub(before) * 1024;
                println!(
                    "long {kind:7} {mb:3} MB {engine:?}: {s:8.3} s {:7.2} MB/s {:>9} tokens \
                     {:6.1} B/B",
                    piece.len() as f64 / s / 1e6,
                    ids.len(),
                    peak as f64 / piece.len() as f64
                );
            }
        }
    }
}

fn main() {
    let root = data_dir();
    let docs = corpus(&root.join("corpus/corpus.jsonl"));
    let mut c = Criterion::default().sample_size(10).configure_from_args();
    for name in ["gpt2", "llama3-style"] {
        bench_corpus(&mut c, name, &root.join("fixtures").join(name), &docs);
    }
    if std::env::var_os("GPUFEED_BENCH_LONG").is_some() {
        long_pieces(&root.join("fixtures/gpt2"), &docs);
    }
    c.final_summary();
}
