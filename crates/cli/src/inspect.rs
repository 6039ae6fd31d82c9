//! `gpufeed inspect`: prints what a data set holds, whatever its format: what the library's
//! front door ([`gpufeed::source::open`]) opens (packed files, `.npy` arrays, ImageFolders,
//! shard directories and patterns, URLs, Parquet, Arrow and JSON lines), described by the
//! format itself ([`Source::describe`]), and the token files the token loader reads (a
//! Megatron indexed dataset, `.bin` + `.idx`; a flat token file with `--token-dtype`).
//!
//! Without `--verify` this costs O(1) in the size of the data, plus what the format's
//! description reads (a packed file's offset table: every entry for files of up to 2^20
//! records, an evenly spaced sample beyond that, as the output says). `--verify` checks every
//! sample as the format can (offsets, schema and checksum of packed records; every shard
//! against its index; every image's header) and fails on the first fault. `--json` prints
//! exactly one JSON object on stdout, for machines.

use std::path::{Path, PathBuf};

use gpufeed::format::ReadMode;
use gpufeed::source::tokens::{FlatTokens, IndexedTokens};
use gpufeed::source::{Format, Source};
use gpufeed::{Error, Result};
use serde_json::{Value, json};

/// Arguments of `gpufeed inspect`.
#[derive(clap::Args)]
pub struct Args {
    /// A data set: a packed record file, a `.npy` array, a Megatron indexed dataset (its
    /// `.idx`, its `.bin` or their prefix), a sharded data set (a directory of shards: packed
    /// or MDS, with their `index.json`, or `.tar` files; a `.tar` file or a brace pattern of
    /// them; a URL of one, `s3://bucket/prefix`), an ImageFolder directory, Parquet, Arrow or
    /// JSON lines files (a file, a directory or a pattern).
    file: PathBuf,
    /// Read FILE as a flat file of tokens of this dtype (nanoGPT's `train.bin`: u16).
    #[arg(long, value_name = "DTYPE")]
    token_dtype: Option<String>,
    /// Check every sample (offsets, schema, checksum; shards against their index; an
    /// ImageFolder's image headers); fail on the first fault.
    #[arg(long)]
    verify: bool,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// How files gpufeed reads itself are read (what --verify reads whole).
    #[command(flatten)]
    read: crate::read_mode::ReadFlags,
    /// Where compressed or downloaded shards are kept.
    #[command(flatten)]
    cache: crate::open::CacheFlags,
}

/// Runs `gpufeed inspect`.
pub fn run(args: Args) -> Result<()> {
    let path = args.file.as_path();
    if let Some(dtype) = &args.token_dtype {
        return print(
            inspect_flat_tokens(path, dtype, args.read.mode())?,
            args.json,
        );
    }
    let name = path
        .to_str()
        .ok_or_else(|| Error::user(format!("{}: not a UTF-8 path", path.display())))?;
    if gpufeed::source::detect(name)? == Format::MegatronTokens
        && let Some(prefix) = IndexedTokens::prefix_of(path)
    {
        return print(
            inspect_megatron(&prefix, args.verify, args.read.mode())?,
            args.json,
        );
    }
    // The checks inspect makes with --verify are its own pass: the source is opened without
    // per-read checks.
    let options = crate::open::options(&args.read, &args.cache, false)?;
    let source = crate::open::open(path, &options)?;
    print(describe(path, &*source, args.verify, args.json)?, args.json)
}

/// What `source` is, as its format describes it; with `verify`, every sample checked (a
/// progress bar on a terminal, unless the output is JSON).
fn describe(path: &Path, source: &dyn Source, verify: bool, as_json: bool) -> Result<Report> {
    let mut d = source.describe()?;
    d.location = path.display().to_string();
    let mut json = d.to_json();
    let mut text = d.to_text();
    if let Some(s) = source.sharded().and_then(|s| s.store_stats()) {
        json["store"] =
            serde_json::to_value(crate::open::StoreReport::from(s)).unwrap_or(Value::Null);
    }
    let mut fault = None;
    if verify {
        let bar = crate::messages::progress(0, "verify", as_json);
        let result = source.verify(&mut |done, total| {
            bar.set_length(total);
            bar.set_position(done);
        });
        bar.finish_and_clear();
        json["verified"] = Value::Bool(result.is_ok());
        match result {
            Ok(()) => text.push_str(&format!("verified:      {}\n", verified(d.format))),
            Err(e) => fault = Some(e),
        }
    }
    Ok(Report { json, text, fault })
}

/// What `--verify` checked of a data set of `format`, once it passed.
fn verified(format: Format) -> &'static str {
    match format {
        Format::Packed => "every record (offsets, schema, checksum)",
        Format::Npy => "header and size (a .npy file has no checksums)",
        Format::ImageFolder => "every image read, its header checked",
        f if f.is_sharded() => "every shard (checksums where the index has them, every sample)",
        _ => "every sample read (and checksums where the format has them)",
    }
}

/// Prints a report as JSON or text; the fault `--verify` found is the command's error.
fn print(report: Report, as_json: bool) -> Result<()> {
    let Report {
        mut json,
        text,
        fault,
    } = report;
    if as_json {
        if let Some(e) = &fault {
            json["error"] = Value::String(e.to_string());
        }
        crate::out(json)?;
    } else {
        crate::out(text.trim_end_matches('\n'))?;
    }
    match fault {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// What inspect found: a JSON object, the same as text, and the first fault `--verify` found.
struct Report {
    json: Value,
    text: String,
    fault: Option<Error>,
}

/// `gpufeed inspect` of a Megatron indexed dataset: its header and sizes (O(1)); with
/// `verify`, every document's entries checked and its tokens counted.
fn inspect_megatron(prefix: &Path, verify: bool, mode: ReadMode) -> Result<Report> {
    let t = IndexedTokens::open_with(prefix, mode)?;
    use gpufeed::source::tokens::TokenSource;
    let dtype = t.dtype();
    let tokens = t.data_len() / dtype.size() as u64;
    let mut json = json!({
        "path": prefix.display().to_string(),
        "format": "megatron",
        "idx": t.idx_path().display().to_string(),
        "bin": t.bin_path().display().to_string(),
        "dtype": dtype.name(),
        "dtype_code": t.dtype_code(),
        "sequences": t.sequences(),
        "documents": t.documents(),
        "multimodal": t.multimodal(),
        "data_bytes": t.data_len(),
        "data_tokens": tokens,
    });
    let mut text = format!(
        "file:          {} (.idx + .bin)\nformat:        Megatron indexed dataset (MMIDIDX v1){}\n\
         dtype:         {dtype} (code {})\nsequences:     {}\ndocuments:     {}\n\
         data bytes:    {} ({tokens} tokens)\n",
        prefix.display(),
        if t.multimodal() { ", multimodal" } else { "" },
        t.dtype_code(),
        t.sequences(),
        t.documents(),
        t.data_len(),
    );
    let mut fault = None;
    if verify {
        match t.verify() {
            Ok(n) => {
                json["verified"] = Value::Bool(true);
                json["tokens"] = json!(n);
                text.push_str(&format!(
                    "verified:      every document's entries ({n} tokens in documents)\n"
                ));
            }
            Err(e) => {
                json["verified"] = Value::Bool(false);
                fault = Some(e);
            }
        }
    }
    Ok(Report { json, text, fault })
}

/// `gpufeed inspect --token-dtype DTYPE FILE`: a flat file of tokens (or a 1-D `.npy`).
fn inspect_flat_tokens(path: &Path, dtype: &str, mode: ReadMode) -> Result<Report> {
    let name = path.to_str().unwrap_or_default();
    let t = if gpufeed::source::detect(name).ok() == Some(Format::Npy) {
        FlatTokens::open_npy_with(path, mode)?
    } else {
        let d = gpufeed::format::DType::from_name(dtype).ok_or_else(|| {
            Error::user(format!(
                "--token-dtype: `{dtype}` is no dtype (u16, u32, i32, ...)"
            ))
        })?;
        FlatTokens::open_with(path, d, mode)?
    };
    use gpufeed::source::tokens::TokenSource;
    let json = json!({
        "path": path.display().to_string(),
        "format": "flat_tokens",
        "dtype": t.dtype().name(),
        "tokens": t.tokens(),
    });
    let text = format!(
        "file:          {}\nformat:        flat tokens, {}\ntokens:        {}\n",
        path.display(),
        t.dtype(),
        t.tokens()
    );
    Ok(Report {
        json,
        text,
        fault: None,
    })
}
