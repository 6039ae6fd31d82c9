//! `gpufeed bench --tokens SOURCE[=WEIGHT] ...`: the token loader over Megatron datasets,
//! flat token files or 1-D `.npy` arrays (a weighted blend when more than one), rows of
//! `--seq-len` tokens in global batches of `--batch-size` rows, concatenated or packed
//! (`--token-mode`). The report: tokens and rows per second over the run and in the epochs
//! after the first, the padding fraction, and each source's share of the rows against its
//! weight.

use std::sync::Arc;
use std::time::Instant;

use gpufeed::format::DType;
use gpufeed::source::tokens::{FlatTokens, IndexedTokens, TokenSource};
use gpufeed::tokens::{SampleMode, TokenLoader};
use gpufeed::{BatchStream, Result, Setting};
use serde_json::json;

use super::args::{Args, fixed, refuse, shard_of, workers};

/// `PATH` or `PATH=WEIGHT`, opened: a Megatron dataset (its `.idx`, `.bin` or prefix), a 1-D
/// `.npy`, or a flat file of `--token-dtype` tokens.
fn open_source(spec: &str, dtype: Option<&str>) -> Result<(Arc<dyn TokenSource>, f64)> {
    let (path, weight) = match spec.rsplit_once('=') {
        Some((p, w)) => {
            let w: f64 = w.parse().map_err(|_| {
                refuse(
                    "--tokens",
                    format!("{spec:?}: the weight after `=` is not a number"),
                )
            })?;
            (p, w)
        }
        None => (spec, 1.0),
    };
    let path = std::path::Path::new(path);
    let source: Arc<dyn TokenSource> = if let Some(prefix) = IndexedTokens::prefix_of(path) {
        Arc::new(IndexedTokens::open(prefix)?)
    } else if path.extension().is_some_and(|e| e == "npy") {
        Arc::new(FlatTokens::open_npy(path)?)
    } else {
        let name = dtype.ok_or_else(|| {
            refuse(
                "--token-dtype",
                format!(
                    "{}: no .idx beside it and not a .npy: name the dtype of its raw tokens \
                     (nanoGPT's train.bin: --token-dtype u16)",
                    path.display()
                ),
            )
        })?;
        let d = DType::from_name(name)
            .ok_or_else(|| refuse("--token-dtype", format!("`{name}` is no dtype")))?;
        Arc::new(FlatTokens::open(path, d)?)
    };
    Ok((source, weight))
}

/// Runs the token bench.
pub fn run(args: &Args) -> Result<()> {
    for (flag, set) in [
        ("DATASET", args.dataset.is_some()),
        ("--labels", args.labels.is_some()),
        ("--fields", args.fields.is_some()),
        ("--device", args.device.is_some()),
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
        .workers(workers(args))
        .drop_last(args.drop_last);
    if !args.no_shuffle {
        builder = builder.shuffle(args.seed);
    }
    if matches!(args.prefetch, Some(Setting::Auto))
        || matches!(args.batch_parts, Some(Setting::Auto))
    {
        return Err(refuse(
            "--prefetch",
            "--prefetch auto and --batch-parts auto tune record and image runs; give a token run numbers",
        ));
    }
    if let Some(p) = fixed(args.prefetch) {
        builder = builder.prefetch(p);
    }
    if let Some(p) = fixed(args.batch_parts) {
        builder = builder.batch_parts(p);
    }
    let mut names = Vec::new();
    let mut weights = Vec::new();
    for spec in &args.tokens {
        let (source, weight) = open_source(spec, args.token_dtype.as_deref())?;
        names.push(source.name());
        weights.push(weight);
        builder = builder.weighted(source, weight);
    }
    let t_build = Instant::now();
    let mut loader = builder.build()?;
    let build_s = t_build.elapsed().as_secs_f64();
    let start = Instant::now();
    let (mut steady_tokens, mut steady_s) = (0u64, 0f64);
    for epoch in 0..args.epochs {
        loader.set_epoch(epoch);
        let (t0, before) = (Instant::now(), loader.token_stats().tokens);
        let mut n = 0;
        while args.max_batches.is_none_or(|m| n < m) {
            match loader.next() {
                Some(b) => drop(b?),
                None => break,
            }
            n += 1;
        }
        if epoch > 0 {
            steady_tokens += loader.token_stats().tokens - before;
            steady_s += t0.elapsed().as_secs_f64();
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let stats = loader.token_stats().clone();
    let total: f64 = weights.iter().sum();
    let shares = stats.shares();
    let sources: Vec<_> = names
        .iter()
        .zip(&weights)
        .enumerate()
        .map(|(i, (name, w))| {
            json!({
                "source": name,
                "weight": w / total,
                "share": shares.get(i).copied().unwrap_or(0.0),
                "rows": stats.rows_per_source.get(i).copied().unwrap_or(0),
            })
        })
        .collect();
    let per_s = |x: u64, s: f64| if s > 0.0 { x as f64 / s } else { 0.0 };
    let report = json!({
        "kind": "tokens",
        "mode": mode.name(),
        "seq_len": seq_len,
        "global_batch": args.batch_size,
        "rank": rank,
        "world": world,
        "workers": workers(args),
        "epochs": args.epochs,
        "build_seconds": build_s,
        "seconds": seconds,
        "batches": stats.batches,
        "rows": stats.rows,
        "tokens": stats.tokens,
        "padding": stats.padding,
        "padding_fraction": stats.padding_fraction(),
        "tokens_per_s": per_s(stats.tokens, seconds),
        "steady_tokens_per_s": per_s(steady_tokens, steady_s),
        "sources": sources,
    });
    if args.json {
        return crate::out(report);
    }
    let mut text = format!(
        "token loader: {} rows of {seq_len} tokens, global batch {}, rank {rank}/{world}, {} workers\n\
         built in:      {build_s:.3} s\n\
         delivered:     {} batches, {} rows, {} tokens in {seconds:.3} s: {:.1} M tokens/s ({:.1} M/s after the first epoch)\n\
         padding:       {} tokens ({:.2}%)\n",
        mode.name(),
        args.batch_size,
        workers(args),
        stats.batches,
        stats.rows,
        stats.tokens,
        per_s(stats.tokens, seconds) / 1e6,
        per_s(steady_tokens, steady_s) / 1e6,
        stats.padding,
        100.0 * stats.padding_fraction(),
    );
    for s in report["sources"].as_array().into_iter().flatten() {
        text.push_str(&format!(
            "source:        {} weight {:.4} share {:.4} ({} rows)\n",
            s["source"].as_str().unwrap_or(""),
            s["weight"].as_f64().unwrap_or(0.0),
            s["share"].as_f64().unwrap_or(0.0),
            s["rows"]
        ));
    }
    crate::out(text.trim_end_matches('\n'))
}
