//! Token streams: packing speed (best-fit decreasing, the token loader's, against first-fit
//! decreasing and first-fit on the same documents) and rows of tokens to host batches.
//!
//! ```sh
//! cargo bench --bench token_stream
//! ```
//!
//! Documents have lengths drawn from a log-normal law (median 400 tokens, a long tail cut at
//! 32,768: web text as tokenised for GPT-2 has about this shape), in windows of 1,024
//! documents, packed into rows of 2,048 and 8,192 tokens. Criterion reports packing as tokens
//! of documents per second; before its runs, one line per rule gives the padding fraction it
//! leaves. Then the token loader's host path: a Megatron `.bin/.idx` of 32 M tokens, rows of
//! 8,192, global batches of 8, 4 workers, concatenated and packed, one epoch each after a
//! warm-up epoch, printed as one JSON line each: tokens/s, CPU time (user + system, the whole
//! process) per million tokens, the padding fraction. Last, the memory a loader keeps for
//! 10^8 documents (a source that computes its documents' lengths, so no file is written):
//! resident memory after the build (after `malloc_trim`) less before, and per document.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use gpufeed::BatchStream;
use gpufeed::format::DType;
use gpufeed::source::tokens::{IndexedTokens, TokenSource};
use gpufeed::tokens::pack::{PackScratch, Packing, pack};
use gpufeed::tokens::{SampleMode, TokenLoader};

const WINDOW: usize = 1024;

/// Document lengths: exp(N(ln 400, 1.0)), 1 to 32,768 tokens (a fixed xorshift generator).
fn lengths(n: usize) -> Vec<u64> {
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let mut uniform = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64
    };
    (0..n)
        .map(|_| {
            // Box-Muller.
            let (u, v) = (uniform().max(1e-12), uniform());
            let z = (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos();
            ((400f64.ln() + z).exp() as u64).clamp(1, 32_768)
        })
        .collect()
}

const RULES: [(Packing, &str); 3] = [
    (Packing::BestFitDecreasing, "best_fit_decreasing"),
    (Packing::FirstFitDecreasing, "first_fit_decreasing"),
    (Packing::FirstFit, "first_fit"),
];

fn bench_pack(c: &mut Criterion, docs: &[u64]) {
    let tokens: u64 = docs.iter().sum();
    for row in [2048u64, 8192] {
        let mut scratch = PackScratch::default();
        for (how, name) in RULES {
            let (mut rows, mut capacity) = (0u64, 0u64);
            for w in docs.chunks(WINDOW) {
                let p = pack(w, row, how, &mut scratch);
                rows += p.rows();
                capacity += p.rows() * row;
            }
            println!(
                "{{\"pack\":\"{name}\",\"row\":{row},\"documents\":{},\"tokens\":{tokens},\"rows\":{rows},\"padding_fraction\":{:.5}}}",
                docs.len(),
                1.0 - tokens as f64 / capacity as f64
            );
        }
        let mut group = c.benchmark_group(format!("pack_row_{row}"));
        group.throughput(Throughput::Elements(tokens));
        group.sample_size(10);
        group.warm_up_time(Duration::from_secs(1));
        group.measurement_time(Duration::from_secs(4));
        for (how, name) in RULES {
            group.bench_function(name, |b| {
                b.iter(|| {
                    let mut rows = 0;
                    for w in docs.chunks(WINDOW) {
                        rows += pack(w, row, how, &mut scratch).rows();
                    }
                    rows
                })
            });
        }
        group.finish();
    }
}

/// A Megatron dataset of documents of these lengths (uint16 tokens), one sequence each.
fn write_megatron(prefix: &Path, docs: &[u64]) {
    let mut bin = Vec::with_capacity(docs.iter().sum::<u64>() as usize * 2);
    for (d, &len) in docs.iter().enumerate() {
        for o in 0..len {
            bin.extend((((d as u64 * 31 + o) % 50_257) as u16).to_le_bytes());
        }
    }
    let mut idx = b"MMIDIDX\x00\x00".to_vec();
    idx.extend(1u64.to_le_bytes());
    idx.push(8);
    idx.extend((docs.len() as u64).to_le_bytes());
    idx.extend((docs.len() as u64 + 1).to_le_bytes());
    for &len in docs {
        idx.extend((len as i32).to_le_bytes());
    }
    let mut at = 0i64;
    for &len in docs {
        idx.extend(at.to_le_bytes());
        at += len as i64 * 2;
    }
    for i in 0..=docs.len() as i64 {
        idx.extend(i.to_le_bytes());
    }
    std::fs::write(prefix.with_extension("bin"), bin).unwrap();
    std::fs::write(prefix.with_extension("idx"), idx).unwrap();
}

/// User + system CPU time of the process, in seconds.
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes the struct it is given; a zeroed rusage is a valid one.
    let usage = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut u);
        u
    };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(usage.ru_utime) + t(usage.ru_stime)
}

fn bench_loader(docs: &[u64]) {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("web");
    write_megatron(&prefix, docs);
    let source = Arc::new(IndexedTokens::open(&prefix).unwrap());
    for mode in [SampleMode::Concatenated, SampleMode::Packed] {
        let mut loader = TokenLoader::builder(8192, 8)
            .source(source.clone())
            .mode(mode)
            .shuffle(1)
            .workers(4)
            .build()
            .unwrap();
        // A warm-up epoch: the pages of the mapping, the pool's buffers.
        for b in loader.by_ref() {
            b.unwrap();
        }
        loader.next_epoch();
        let before = loader.token_stats().clone();
        let (start, cpu) = (Instant::now(), cpu_seconds());
        for b in loader.by_ref() {
            std::hint::black_box(b.unwrap());
        }
        let (secs, cpu) = (start.elapsed().as_secs_f64(), cpu_seconds() - cpu);
        let stats = loader.token_stats();
        let tokens = stats.tokens - before.tokens;
        let padding = stats.padding - before.padding;
        println!(
            "{{\"loader\":\"{}\",\"workers\":4,\"seq_len\":8192,\"global_batch\":8,\"tokens\":{tokens},\"seconds\":{secs:.3},\"tokens_per_s\":{:.0},\"cpu_s_per_million_tokens\":{:.4},\"padding_fraction\":{:.5}}}",
            mode.name(),
            tokens as f64 / secs,
            cpu / (tokens as f64 / 1e6),
            padding as f64 / (tokens + padding) as f64
        );
    }
}

/// 10^8 documents of 1 to 1,024 tokens, computed (no file): what the loader's index costs.
#[derive(Debug)]
struct Computed(u64);

impl TokenSource for Computed {
    fn name(&self) -> String {
        "computed".into()
    }
    fn dtype(&self) -> DType {
        DType::U32
    }
    fn documents(&self) -> u64 {
        self.0
    }
    fn document_len(&self, doc: u64) -> gpufeed::Result<u64> {
        Ok(1 + (doc.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 54))
    }
    fn read(&self, doc: u64, start: u64, out: &mut [u32]) -> gpufeed::Result<()> {
        for (i, o) in out.iter_mut().enumerate() {
            *o = (doc + start + i as u64) as u32;
        }
        Ok(())
    }
}

/// Resident memory of the process, in bytes.
fn rss() -> u64 {
    // SAFETY: malloc_trim only releases free memory of the allocator's arenas.
    unsafe {
        libc::malloc_trim(0);
    }
    let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn bench_memory() {
    let documents = 100_000_000u64;
    for mode in [SampleMode::Concatenated, SampleMode::Packed] {
        let before = rss();
        let start = Instant::now();
        let mut loader = TokenLoader::builder(8192, 8)
            .source(Arc::new(Computed(documents)))
            .mode(mode)
            .shuffle(1)
            .workers(2)
            .build()
            .unwrap();
        let build = start.elapsed().as_secs_f64();
        std::hint::black_box(loader.next().unwrap().unwrap());
        let kept = rss().saturating_sub(before);
        println!(
            "{{\"memory\":\"{}\",\"documents\":{documents},\"build_seconds\":{build:.2},\"rss_kept_bytes\":{kept},\"bytes_per_document\":{:.4}}}",
            mode.name(),
            kept as f64 / documents as f64
        );
    }
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    // 16 windows of documents: about 11 M tokens.
    let docs = lengths(16 * WINDOW);
    bench_pack(&mut c, &docs);
    // About 32 M tokens for the loader.
    let docs = lengths(48 * WINDOW);
    bench_loader(&docs);
    bench_memory();
    c.final_summary();
}
