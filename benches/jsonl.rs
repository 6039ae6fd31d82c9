//! JSON lines read through `JsonLines::get` (one line parsed, only the fields asked for),
//! against a `serde_json::Value` built for each line (the whole line parsed into a tree) and
//! against Python's `json.loads` per line (`crates/bench/scripts/jsonl_python.py`, on the
//! same files), and the index of lines built at open.
//!
//! Writes three files of about 64 MiB each into `target/jsonl-bench/` (kept there, for the
//! Python script): `text.jsonl`, web-text-like lines (`id`, `url`, a `text` of about 2 KB of
//! words without escapes, a `score`); `text_escaped.jsonl`, the same with a newline written
//! `\n` every 60 to 500 characters of text, as web text has; `numbers.jsonl`, lines of about
//! 290 bytes of numbers (`id`, `label`, two floats, a list of 16 floats). Then, with the files
//! in the page cache:
//!
//! - `get/<file>`: every line by `get(i)` in index order, its fields copied into a buffer (as
//!   the loader copies into its batch slots): `text` alone for the text files, every field for
//!   `numbers`;
//! - `serde/<file>`: every line of the same file, mapped, parsed by
//!   `serde_json::from_slice::<Value>`, the same fields taken from the tree and copied
//!   (numbers converted, as `get` does);
//! - `open/<file>`: `JsonLines::open` with `infer_lines: 1`, so that it is the index of lines
//!   (one pass over the file) that is timed.
//!
//! Before criterion's runs, the `get` and `serde` passes interleaved (7 rounds, medians) are
//! printed with their ratio: on a shared VM, ratios from alternating passes are the figures to
//! quote. Throughput is the file's bytes. Run with `cargo bench --bench jsonl`.

use std::hint::black_box;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gpufeed::Dataset;
use gpufeed::source::table::{JsonLines, JsonLinesOptions};

const TOTAL: usize = 64 << 20;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("target/jsonl-bench")
}

/// A deterministic stream of pseudo-random numbers (xorshift).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "in",
    "data",
    "model",
    "training",
    "loader",
    "batch",
    "memory",
    "throughput",
    "language",
    "image",
    "network",
    "gradient",
    "learning",
    "sample",
    "file",
    "process",
    "system",
    "results",
    "however",
    "because",
    "between",
    "example",
    "different",
];

fn words(rng: &mut Rng, len: usize, newlines: bool) -> String {
    let mut s = String::with_capacity(len + 16);
    let mut next_newline = 60 + rng.below(440) as usize;
    while s.len() < len {
        s.push_str(WORDS[rng.below(WORDS.len() as u64) as usize]);
        if newlines && s.len() >= next_newline {
            s.push_str("\\n");
            next_newline = s.len() + 60 + rng.below(440) as usize;
        } else {
            s.push(' ');
        }
    }
    s
}

/// Writes the file `name` of lines from `line` until it holds `TOTAL` bytes (kept if there).
fn write(name: &str, line: impl Fn(&mut Rng, u64) -> String) -> PathBuf {
    let path = dir().join(name);
    if path.exists() {
        return path;
    }
    std::fs::create_dir_all(dir()).expect("bench directory");
    let tmp = path.with_extension("tmp");
    let mut out = std::io::BufWriter::new(std::fs::File::create(&tmp).expect("create"));
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let (mut written, mut i) = (0usize, 0u64);
    while written < TOTAL {
        let l = line(&mut rng, i) + "\n";
        out.write_all(l.as_bytes()).expect("write");
        written += l.len();
        i += 1;
    }
    out.flush().expect("flush");
    drop(out);
    std::fs::rename(&tmp, &path).expect("rename");
    path
}

fn files() -> Vec<(&'static str, PathBuf)> {
    let text = |newlines: bool| {
        move |rng: &mut Rng, i: u64| {
            let len = 1000 + rng.below(2000) as usize;
            format!(
                "{{\"id\": {i}, \"url\": \"https://example.com/page/{}\", \"text\": \"{}\", \"score\": {:.6}}}",
                rng.below(1 << 30),
                words(rng, len, newlines),
                rng.below(1_000_000) as f64 / 1e6
            )
        }
    };
    vec![
        ("text", write("text.jsonl", text(false))),
        ("text_escaped", write("text_escaped.jsonl", text(true))),
        (
            "numbers",
            write("numbers.jsonl", |rng, i| {
                let v: Vec<String> = (0..16)
                    .map(|_| format!("{:.5}", rng.below(2_000_000) as f64 / 1e6 - 1.0))
                    .collect();
                format!(
                    "{{\"id\": {i}, \"label\": {}, \"x\": {:.8}, \"y\": {:e}, \"v\": [{}]}}",
                    rng.below(1000),
                    rng.below(1 << 40) as f64 / (1u64 << 40) as f64,
                    rng.below(1 << 40) as f64 * 1e-20,
                    v.join(", ")
                )
            }),
        ),
    ]
}

/// The fields each file is read for.
fn fields(name: &str) -> Vec<String> {
    let f: &[&str] = if name == "numbers" {
        &["id", "label", "x", "y", "v"]
    } else {
        &["text"]
    };
    f.iter().map(|s| s.to_string()).collect()
}

/// Every line by `get`, its fields copied into `buf`; the bytes copied.
fn pass_get(d: &JsonLines, buf: &mut [u8]) -> usize {
    let mut copied = 0;
    let n = d.schema().fields().len();
    for i in 0..d.len() {
        let s = d.get(i).expect("get");
        for k in 0..n {
            let f = s.try_field(k).expect("field");
            buf[..f.len()].copy_from_slice(f);
            copied += f.len();
        }
    }
    black_box(copied)
}

/// Every line parsed into a `serde_json::Value`, the same fields copied into `buf`.
fn pass_serde(lines: &[&[u8]], fields: &[String], buf: &mut [u8]) -> usize {
    let mut copied = 0;
    for line in lines {
        let v: serde_json::Value = serde_json::from_slice(line).expect("json");
        for f in fields {
            let value = &v[f.as_str()];
            let n = match value {
                serde_json::Value::String(s) => {
                    buf[..s.len()].copy_from_slice(s.as_bytes());
                    s.len()
                }
                serde_json::Value::Number(x) => {
                    let b = match x.as_i64() {
                        Some(i) => i.to_le_bytes(),
                        None => x.as_f64().unwrap_or(0.0).to_le_bytes(),
                    };
                    buf[..8].copy_from_slice(&b);
                    8
                }
                serde_json::Value::Array(items) => {
                    for (j, x) in items.iter().enumerate() {
                        let b = x.as_f64().unwrap_or(0.0).to_le_bytes();
                        buf[j * 8..j * 8 + 8].copy_from_slice(&b);
                    }
                    items.len() * 8
                }
                _ => 0,
            };
            copied += n;
        }
    }
    black_box(copied)
}

fn open(path: &Path, name: &str, infer_lines: usize) -> JsonLines {
    let o = JsonLinesOptions {
        fields: Some(fields(name)),
        infer_lines,
        ..JsonLinesOptions::default()
    };
    JsonLines::open(path, &o).expect("open")
}

/// The file mapped, as `JsonLines` maps it: both passes read the page cache's pages through
/// a mapping (a copy on the heap would be another kind of memory, with other TLB costs).
fn map(path: &Path) -> memmap2::Mmap {
    let file = std::fs::File::open(path).expect("open");
    // SAFETY: the bench's own file, written before and not changed while mapped.
    unsafe { memmap2::Mmap::map(&file) }.expect("map")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn bench(c: &mut Criterion) {
    let files = files();
    let mut buf = vec![0u8; 1 << 20];
    println!(
        "file                 lines     MB   get lines/s   get MB/s  serde MB/s  get/serde  open ms/GB  index B/line"
    );
    for (name, path) in &files {
        let bytes = map(path);
        let lines: Vec<&[u8]> = bytes
            .split(|&c| c == b'\n')
            .filter(|l| !l.is_empty())
            .collect();
        let d = open(path, name, 1000);
        let (mut get, mut serde, mut open_s) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..7 {
            let t = Instant::now();
            pass_get(&d, &mut buf);
            get.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            pass_serde(&lines, &fields(name), &mut buf);
            serde.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            black_box(open(path, name, 1));
            open_s.push(t.elapsed().as_secs_f64());
        }
        let (g, s, o) = (median(get), median(serde), median(open_s));
        let mb = bytes.len() as f64 / 1e6;
        println!(
            "{name:<16} {:>9} {:>6.1} {:>13.0} {:>10.0} {:>11.0} {:>10.2} {:>11.0} {:>13.2}",
            d.len(),
            mb,
            d.len() as f64 / g,
            mb / g,
            mb / s,
            s / g,
            o * 1e3 / (mb / 1e3),
            d.describe().index_bytes as f64 / d.len() as f64,
        );
    }
    let mut group = c.benchmark_group("jsonl");
    group.sample_size(10);
    for (name, path) in &files {
        let bytes = map(path);
        let lines: Vec<&[u8]> = bytes
            .split(|&c| c == b'\n')
            .filter(|l| !l.is_empty())
            .collect();
        group.throughput(Throughput::Bytes(bytes.len() as u64));
        let d = open(path, name, 1000);
        group.bench_function(format!("get/{name}"), |b| b.iter(|| pass_get(&d, &mut buf)));
        let f = fields(name);
        group.bench_function(format!("serde/{name}"), |b| {
            b.iter(|| pass_serde(&lines, &f, &mut buf))
        });
        group.bench_function(format!("open/{name}"), |b| b.iter(|| open(path, name, 1)));
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
