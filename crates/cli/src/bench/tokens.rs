//! `gpufeed bench --tokens SOURCE[=WEIGHT] ...`: the token loader over Megatron datasets,
//! flat token files or 1-D `.npy` arrays (a weighted blend when more than one), rows of
//! `--seq-len` tokens in global batches of `--batch-size` rows, concatenated or packed
//! (`--token-mode`). The report: tokens and rows per second over the run and in the epochs
//! after the first, the padding fraction, and each source's share of the rows against its
//! weight. With `--device N` (feature `cuda`) the batches go to the GPU (u16 ids over PCIe,
//! widened there) and each is ordered on a consumer stream; the report adds the device, the
//! first batch on the device and the bytes copied. Both report the process's CPU time per
//! million tokens.
//!
//! With `--tokenizer`, a source that is not token ids is text: its `--text-field` (default
//! `text`) of any data the front door opens (Parquet, Arrow, JSON lines, shards), tokenized
//! in the loader's workers as the stream reaches it; the report adds, per text source, the
//! passes completed, the tokens tokenized and the estimate of a pass.

use std::sync::Arc;
use std::time::Instant;

use gpufeed::format::DType;
use gpufeed::loader::Tuning;
use gpufeed::source::ReadMode;
use gpufeed::source::tokens::{IndexedTokens, TextTokens, TokenSource, is_token_file, open_tokens};
use gpufeed::tokenizer::Tokenizer;
use gpufeed::tokens::{SampleMode, TextStats, TokenLoader, TokenLoaderBuilder, TokenStats};
use gpufeed::{BatchStream, Error, Result};
use serde_json::json;

use super::args::{Args, refuse, shard_of, workers};

/// `PATH=WEIGHT` split, or `PATH` with weight 1.
fn weighted(spec: &str) -> Result<(&str, f64)> {
    match spec.rsplit_once('=') {
        Some((p, w)) => {
            let w: f64 = w.parse().map_err(|_| {
                refuse(
                    "--tokens",
                    format!("{spec:?}: the weight after `=` is not a number"),
                )
            })?;
            Ok((p, w))
        }
        None => Ok((spec, 1.0)),
    }
}

/// The tokenizer of `--tokenizer`, its errors naming the flag.
fn open_tokenizer(path: &std::path::Path) -> Result<Tokenizer> {
    Tokenizer::open(path).map_err(|e| match e {
        Error::InvalidConfig { what, .. } => refuse("--tokenizer", what),
        Error::Malformed { path, what, .. } => refuse(
            "--tokenizer",
            format!("{} is not a tokenizer.json: {what}", path.display()),
        ),
        other => other,
    })
}

/// A text source: `--text-field` of the data at `path` with the tokenizer, its errors naming
/// the flags.
fn open_text(path: &str, args: &Args, tokenizer: &Tokenizer) -> Result<Arc<TextTokens>> {
    let options = crate::open::options(&args.read, &args.cache, false)?;
    let field = args.text_field.as_deref().unwrap_or("text");
    let text = TextTokens::open(path, &options, field, tokenizer.clone()).map_err(|e| match e {
        Error::InvalidConfig {
            setting: "text_field",
            what,
        } => refuse("--text-field", what),
        other => other,
    })?;
    Ok(Arc::new(text))
}

/// `PATH` or `PATH=WEIGHT`, opened by the library's rule ([`open_tokens`]) and read as
/// `--read-mode` says: a Megatron dataset (its `.idx`, `.bin` or prefix), a 1-D `.npy`, or a
/// flat file of `--token-dtype` tokens.
fn open_source(path: &str, dtype: Option<&str>, mode: ReadMode) -> Result<Arc<dyn TokenSource>> {
    let dtype = dtype
        .map(|name| {
            DType::from_name(name)
                .ok_or_else(|| refuse("--token-dtype", format!("`{name}` is no dtype")))
        })
        .transpose()?;
    let path = std::path::Path::new(path);
    // A .npy header and a Megatron index name their dtype: --token-dtype is for the others.
    let given = dtype.filter(|_| {
        IndexedTokens::prefix_of(path).is_none() && path.extension().is_none_or(|e| e != "npy")
    });
    open_tokens(path, given, mode).map_err(|e| match e {
        Error::InvalidConfig {
            setting: "token_dtype",
            what,
        } => refuse("--token-dtype", what),
        other => other,
    })
}

/// What a run of the token loader measured.
struct Run {
    seconds: f64,
    steady_tokens: u64,
    steady_s: f64,
    /// From the loader's creation to the first batch taken (on a GPU: ready there).
    first_batch_ms: Option<f64>,
}

/// Takes every batch of `args.epochs` epochs (at most `--max-batches` each); `take` is given
/// each batch and whether it is the first, `settle` is called at each epoch's end.
fn drive<L>(
    loader: &mut TokenLoader<L>,
    args: &Args,
    built: Instant,
    mut take: impl FnMut(&L::Batch, bool) -> Result<()>,
    mut settle: impl FnMut() -> Result<()>,
) -> Result<Run>
where
    L: BatchStream,
    L::Batch: std::ops::Deref<Target = gpufeed::BatchInfo>,
{
    let start = Instant::now();
    let (mut steady_tokens, mut steady_s) = (0u64, 0f64);
    let mut first_batch_ms = None;
    for epoch in 0..args.epochs {
        loader.set_epoch(epoch);
        let (t0, before) = (Instant::now(), loader.token_stats().tokens);
        let mut n = 0;
        while args.max_batches.is_none_or(|m| n < m) {
            match loader.next() {
                Some(b) => {
                    let b = b?;
                    take(&b, first_batch_ms.is_none())?;
                    first_batch_ms.get_or_insert_with(|| built.elapsed().as_secs_f64() * 1e3);
                }
                None => break,
            }
            n += 1;
        }
        settle()?;
        if epoch > 0 {
            steady_tokens += loader.token_stats().tokens - before;
            steady_s += t0.elapsed().as_secs_f64();
        }
    }
    Ok(Run {
        seconds: start.elapsed().as_secs_f64(),
        steady_tokens,
        steady_s,
        first_batch_ms,
    })
}

/// The CPU time this process has used so far (user and system), in seconds.
fn cpu_seconds() -> f64 {
    // SAFETY: `getrusage` writes one `rusage` into the zeroed struct it is given and reads
    // nothing else; RUSAGE_SELF is always a valid `who`.
    let usage = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        (libc::getrusage(libc::RUSAGE_SELF, &mut u) == 0).then_some(u)
    };
    usage.map_or(0.0, |u| {
        let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 * 1e-6;
        t(u.ru_utime) + t(u.ru_stime)
    })
}

/// The flags of the other runs, refused here.
fn refuse_other_flags(args: &Args) -> Result<()> {
    for (flag, set) in [
        ("DATASET", args.dataset.is_some()),
        ("--labels", args.labels.is_some()),
        ("--fields", args.fields.is_some()),
        ("--evaluation", args.evaluation),
        ("--baseline", args.baseline),
        ("--verify", args.verify),
        ("--images", args.images.is_some()),
    ] {
        if set {
            return Err(refuse(
                if flag == "DATASET" { "--tokens" } else { flag },
                format!("{flag} does not apply to a token run (--tokens)"),
            ));
        }
    }
    if args.text_field.is_some() && args.tokenizer.is_none() {
        return Err(refuse(
            "--text-field",
            "--text-field names the text that --tokenizer tokenizes: give --tokenizer too",
        ));
    }
    Ok(())
}

/// The run's settings, as the report states them.
struct Plan {
    mode: SampleMode,
    rank: u64,
    world: u64,
    seq_len: usize,
    /// Each source's name and weight.
    sources: Vec<(String, f64)>,
}

/// The loader's builder from the flags, its sources opened (text ones with the tokenizer).
fn builder_of(args: &Args) -> Result<(TokenLoaderBuilder, Plan)> {
    let mode = match args.token_mode.as_deref() {
        None => SampleMode::Concatenated,
        Some(m) => SampleMode::from_name(m).ok_or_else(|| {
            refuse(
                "--token-mode",
                format!("`{m}` is neither concatenated nor packed"),
            )
        })?,
    };
    let (rank, world) = shard_of(args)?;
    let seq_len = args.seq_len.unwrap_or(2048);
    let mut builder = TokenLoader::builder(seq_len, args.batch_size)
        .mode(mode)
        .shard(rank, world)
        .drop_last(args.drop_last);
    if !args.no_shuffle {
        builder = builder.shuffle(args.seed);
    }
    // Numbers or `auto` (chosen by the loader, reported under "tuning").
    if let Some(w) = args.workers {
        builder = builder.workers(w);
    }
    if let Some(p) = args.prefetch {
        builder = builder.prefetch(p);
    }
    if let Some(p) = args.batch_parts {
        builder = builder.batch_parts(p);
    }
    let tokenizer = args.tokenizer.as_deref().map(open_tokenizer).transpose()?;
    let mut sources = Vec::new();
    for spec in &args.tokens {
        let (path, weight) = weighted(spec)?;
        match &tokenizer {
            Some(t) if !is_token_file(std::path::Path::new(path)) => {
                let text = open_text(path, args, t)?;
                sources.push((text.name(), weight));
                builder = builder.weighted_text(text, weight);
            }
            _ => {
                let source = open_source(path, args.token_dtype.as_deref(), args.read.mode())?;
                sources.push((source.name(), weight));
                builder = builder.weighted(source, weight);
            }
        }
    }
    let plan = Plan {
        mode,
        rank,
        world,
        seq_len,
        sources,
    };
    Ok((builder, plan))
}

/// What the loader did: the run's times, its figures, the device's and the settings it chose.
struct Measured {
    run: Run,
    stats: TokenStats,
    text: Vec<Option<TextStats>>,
    device: Option<serde_json::Value>,
    tuning: Option<Tuning>,
    build_s: f64,
    cpu_s: f64,
}

/// Builds the loader (on the host, or with `--device` on a GPU) and takes its batches.
fn measure(builder: TokenLoaderBuilder, args: &Args) -> Result<Measured> {
    let cpu0 = cpu_seconds();
    let t_build = Instant::now();
    let measured = match args.device {
        None => {
            let mut loader = builder.build()?;
            let build_s = t_build.elapsed().as_secs_f64();
            let run = drive(&mut loader, args, t_build, |_, _| Ok(()), || Ok(()))?;
            Measured {
                run,
                stats: loader.token_stats().clone(),
                text: loader.text_stats(),
                device: None,
                tuning: loader.loader().stats().tuning,
                build_s,
                cpu_s: 0.0,
            }
        }
        #[cfg(feature = "cuda")]
        Some(ordinal) => {
            let device = super::device::open_device(ordinal)?;
            let mut loader =
                builder.build_device(&device, gpufeed::cuda::DeviceLoaderOptions::default())?;
            let build_s = t_build.elapsed().as_secs_f64();
            let consumer = device.new_stream()?;
            let sync = || {
                consumer
                    .synchronize()
                    .map_err(|source| gpufeed::Error::Driver {
                        op: "synchronize the consumer stream",
                        source,
                    })
            };
            // Each batch ordered on the consumer's stream (as a training step would be); the
            // first and each epoch's last waited for on the host, so that the rates count
            // batches on the device.
            let run = drive(
                &mut loader,
                args,
                t_build,
                |b, first| {
                    b.wait_on(&consumer)?;
                    if first { sync() } else { Ok(()) }
                },
                sync,
            )?;
            let s = loader.loader().stats();
            let tuning = s.loader.as_ref().and_then(|h| h.tuning.clone());
            let device = json!({
                "device": format!("{} (ordinal {})", device.name(), device.ordinal()),
                "h2d_bytes": s.h2d_bytes,
                "h2d_bytes_per_token": s.h2d_bytes as f64 / loader.token_stats().tokens.max(1) as f64,
                "wait_fraction": s.wait_fraction(),
            });
            Measured {
                run,
                stats: loader.token_stats().clone(),
                text: loader.text_stats(),
                device: Some(device),
                tuning,
                build_s,
                cpu_s: 0.0,
            }
        }
        #[cfg(not(feature = "cuda"))]
        Some(_) => {
            return Err(refuse(
                "--device",
                "this gpufeed was built without the `cuda` feature",
            ));
        }
    };
    Ok(Measured {
        cpu_s: cpu_seconds() - cpu0,
        ..measured
    })
}

/// The report as JSON: the settings, the rates, each source's share (and a text source's
/// tokenization).
fn report_json(args: &Args, plan: &Plan, m: &Measured) -> serde_json::Value {
    let stats = &m.stats;
    let total: f64 = plan.sources.iter().map(|(_, w)| w).sum();
    let shares = stats.shares();
    let sources: Vec<_> = plan
        .sources
        .iter()
        .enumerate()
        .map(|(i, (name, w))| {
            let mut s = json!({
                "source": name,
                "weight": w / total,
                "share": shares.get(i).copied().unwrap_or(0.0),
                "rows": stats.rows_per_source.get(i).copied().unwrap_or(0),
            });
            if let Some(Some(t)) = m.text.get(i) {
                s["text"] = json!(t);
            }
            s
        })
        .collect();
    let per_s = |x: u64, s: f64| if s > 0.0 { x as f64 / s } else { 0.0 };
    let run = &m.run;
    // Measured only over epochs after the first: none with --epochs 1 (null, and not printed).
    let steady =
        (args.epochs > 1 && run.steady_s > 0.0).then(|| per_s(run.steady_tokens, run.steady_s));
    let mut report = json!({
        "kind": "tokens",
        "mode": plan.mode.name(),
        "seq_len": plan.seq_len,
        "global_batch": args.batch_size,
        "rank": plan.rank,
        "world": plan.world,
        "workers": m.tuning.as_ref().map_or(workers(args), |t| t.workers),
        "epochs": args.epochs,
        "build_seconds": m.build_s,
        "seconds": run.seconds,
        "batches": stats.batches,
        "rows": stats.rows,
        "tokens": stats.tokens,
        "padding": stats.padding,
        "padding_fraction": stats.padding_fraction(),
        "tokens_per_s": per_s(stats.tokens, run.seconds),
        "steady_tokens_per_s": steady,
        "first_batch_ms": run.first_batch_ms,
        "cpu_seconds": m.cpu_s,
        "cpu_seconds_per_million_tokens": m.cpu_s / (stats.tokens.max(1) as f64 / 1e6),
        "sources": sources,
    });
    if let Some(d) = &m.device {
        report["device"] = d.clone();
    }
    if let Some(t) = &m.tuning {
        report["tuning"] = json!(t);
    }
    report
}

/// The report as text, from its JSON.
fn report_text(report: &serde_json::Value, m: &Measured) -> String {
    let f = |k: &str| report[k].as_f64().unwrap_or(0.0);
    let u = |k: &str| report[k].as_u64().unwrap_or(0);
    let mut text = format!(
        "token loader: {} rows of {} tokens, global batch {}, rank {}/{}, {} workers\n\
         built in:      {:.3} s\n\
         delivered:     {} batches, {} rows, {} tokens in {:.3} s: {:.1} M tokens/s{}\n\
         padding:       {} tokens ({:.2}%)\n\
         first batch:   {}{}\n\
         CPU time:      {:.3} s, {:.4} s per million tokens\n",
        report["mode"].as_str().unwrap_or(""),
        u("seq_len"),
        u("global_batch"),
        u("rank"),
        u("world"),
        u("workers"),
        f("build_seconds"),
        u("batches"),
        u("rows"),
        u("tokens"),
        f("seconds"),
        f("tokens_per_s") / 1e6,
        report["steady_tokens_per_s"]
            .as_f64()
            .map_or(String::new(), |r| format!(
                " ({:.1} M/s after the first epoch)",
                r / 1e6
            )),
        u("padding"),
        100.0 * f("padding_fraction"),
        m.run
            .first_batch_ms
            .map_or("n/a (no batch taken)".to_owned(), |ms| format!(
                "{ms:.1} ms"
            )),
        m.device.as_ref().map_or(String::new(), |d| format!(
            " (on {}: {:.2} bytes copied per token)",
            d["device"].as_str().unwrap_or(""),
            d["h2d_bytes_per_token"].as_f64().unwrap_or(0.0)
        )),
        f("cpu_seconds"),
        f("cpu_seconds_per_million_tokens"),
    );
    for s in report["sources"].as_array().into_iter().flatten() {
        text.push_str(&format!(
            "source:        {} weight {:.4} share {:.4} ({} rows)\n",
            s["source"].as_str().unwrap_or(""),
            s["weight"].as_f64().unwrap_or(0.0),
            s["share"].as_f64().unwrap_or(0.0),
            s["rows"]
        ));
        if let Some(t) = s.get("text") {
            text.push_str(&format!(
                "  tokenized:   {} passes, {} documents, {} tokens; a pass estimated at {} tokens, {} rows\n",
                t["passes"], t["documents"], t["tokens"], t["estimated_tokens"], t["estimated_rows"]
            ));
            let restarts = t["restarts"].as_u64().unwrap_or(0);
            if restarts > 0 {
                text.push_str(&format!(
                    "  restarted:   {restarts} times from a pass start or a resume place
"
                ));
            }
        }
    }
    if let Some(t) = &m.tuning {
        text.push_str(&format!("settings:      {}\n", t.reason));
    }
    text
}

/// Runs the token bench: the flags checked, the loader built from them, its batches taken,
/// the report printed.
pub fn run(args: &Args) -> Result<()> {
    refuse_other_flags(args)?;
    let (builder, plan) = builder_of(args)?;
    let measured = measure(builder, args)?;
    let report = report_json(args, &plan, &measured);
    if args.json {
        return crate::out(report);
    }
    let text = report_text(&report, &measured);
    crate::out(text.trim_end_matches('\n'))
}
