//! `gpufeed tokenize`: a text field of any data set gpufeed opens (Parquet, Arrow, JSON lines,
//! packed files, shards; several inputs concatenate) through the user's tokenizer.json into
//! Megatron's `PREFIX.bin`/`PREFIX.idx` or nanoGPT's flat `PREFIX.bin`.
//!
//! Ids and document boundaries are those of Megatron's `tools/preprocess_data.py
//! --tokenizer-type HuggingFaceTokenizer --append-eod` with the same tokenizer: a document's
//! ids are `AutoTokenizer(text).input_ids` (the template's special tokens included), then the
//! EOS (the `eos_token` transformers reads) if there is any id; a document without ids is an
//! empty document. The token type is Megatron's choice from the vocabulary's size.
//!
//! The work: `pipeline.rs` (documents in order, tokenized on all cores, bounded memory) into
//! `writer.rs` (temporaries placed together at the end). Before anything is read, each output
//! file is checked as `pack` checks its own (`output.rs`): never an input, never a
//! non-regular file, never an existing file without `--force`, never (even forced) a file that
//! is not of this kind. A signal removes the temporaries (`cleanup.rs`).
//!
//! `--part I/N` tokenizes the I-th (from 0) of N equal runs of the inputs' documents, so that
//! N machines share the work; the parts, taken in order, are a single run's output: the
//! `.bin`s concatenated (`cat`), Megatron's parts merged by its `tools/merge_datasets.py`.

mod pipeline;
pub mod writer;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use gpufeed::memory::{human_rate, significant};
use gpufeed::source::{OpenOptions, TextColumn};
use gpufeed::tokenizer::{EngineChoice, Tokenizer, TokenizerOptions};
use gpufeed::{Error, Result};

use crate::output::OutputFile;
use crate::pack::config;
use pipeline::Job;
use writer::{Format, Stored, TokenWriter, output_paths};

/// Arguments of `gpufeed tokenize`.
#[derive(clap::Args)]
pub struct Args {
    /// The data sets to tokenize (Parquet, Arrow, JSON lines, packed files, shard
    /// directories), their documents concatenated in this order.
    #[arg(required = true)]
    inputs: Vec<PathBuf>,
    /// The tokenizer: a tokenizer.json, or a directory with one (the hub's layout, whose
    /// tokenizer_config.json names the EOS).
    #[arg(long, value_name = "PATH")]
    tokenizer: PathBuf,
    /// The field that holds each document's text.
    #[arg(long, value_name = "NAME", default_value = "text")]
    text_field: String,
    /// The prefix of the files to write: PREFIX.bin and PREFIX.idx (Megatron), or PREFIX.bin
    /// (nanoGPT).
    #[arg(short = 'o', long = "output", value_name = "PREFIX")]
    output: PathBuf,
    /// What to write.
    #[arg(long, value_enum, default_value = "megatron")]
    format: Format,
    /// The token that ends each document, instead of the one the tokenizer names.
    #[arg(long, value_name = "TOKEN")]
    eos_token: Option<String>,
    /// Tokenizing threads (default: every core).
    #[arg(long)]
    workers: Option<usize>,
    /// Tokenize only part I (from 0) of N equal parts of the documents, for N machines;
    /// the parts' files, in order, are the whole run's (see the README).
    #[arg(long, value_name = "I/N")]
    part: Option<String>,
    /// The tokenizing engine: auto (gpufeed's byte-level BPE where the tokenizer qualifies),
    /// fast, or crate (the tokenizers library).
    #[arg(long, default_value = "auto", value_parser = ["auto", "fast", "crate"])]
    engine: String,
    /// Replace existing output files of this kind (a Megatron dataset, a file of tokens).
    #[arg(long)]
    force: bool,
}

/// Runs `gpufeed tokenize`.
pub fn run(args: Args) -> Result<()> {
    let start = Instant::now();
    let part = match &args.part {
        Some(text) => Some(parse_part(text)?),
        None => None,
    };
    let workers = match args.workers {
        Some(0) => return Err(config("--workers", "must be at least 1")),
        Some(n) => n,
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let inputs: Vec<&Path> = args.inputs.iter().map(PathBuf::as_path).collect();
    let paths = checked_outputs("tokenize", args.format, &args.output, &inputs, args.force)?;

    let opening = Instant::now();
    let tokenizer = open_tokenizer(&args)?;
    let opened = opening.elapsed().as_secs_f64();
    let Some(eos) = tokenizer.eos().map(|t| t.id) else {
        return Err(config(
            "--eos-token",
            &format!(
                "{} names no EOS to end each document with (Megatron's --append-eod): no \
                 eos_token in a tokenizer_config.json beside it, none in its post-processor, no \
                 special token of a well-known name; name one with --eos-token",
                tokenizer.path().display()
            ),
        ));
    };
    let stored = Stored::of(args.format, tokenizer.vocab_size());
    tokenizer.check_width(stored.width, "token_dtype")?;

    let mut options = OpenOptions::default();
    options.table.columns = Some(vec![args.text_field.clone()]);
    // The text field is the only column decoded; a table without it says so naming the flag.
    let source = gpufeed::source::open_all(&args.inputs, &options).map_err(|e| match e {
        Error::InvalidConfig {
            setting: "fields",
            what,
        } => config("--text-field", &what),
        e => e,
    })?;
    let column = TextColumn::new(Arc::from(source), &args.text_field).map_err(|e| match e {
        Error::Mismatch { what } => config("--text-field", &what),
        e => e,
    })?;
    let documents = column.len();
    let rows = match part {
        Some((i, n)) => documents * i / n..documents * (i + 1) / n,
        None => 0..documents,
    };
    let job = Job {
        column: &column,
        rows: rows.clone(),
        tokenizer: &tokenizer,
        eos,
        stored,
    };

    let bar = crate::messages::progress(rows.end - rows.start, "tokenizing", false);
    let mut writer = TokenWriter::create(args.format, stored, &paths)?;
    let started = Instant::now();
    let mut text_bytes = 0u64;
    pipeline::run(&job, workers, |chunk| {
        writer.append(&chunk.bytes, &chunk.lengths)?;
        text_bytes += chunk.text_bytes;
        bar.inc(chunk.lengths.len() as u64);
        let secs = started.elapsed().as_secs_f64().max(1e-9);
        bar.set_message(format!(
            "{}, {} M tokens/s",
            human_rate(text_bytes as f64 / secs),
            significant(writer.counts().1 as f64 / secs / 1e6)
        ));
        Ok(())
    })?;
    bar.finish_and_clear();
    let (docs, tokens) = writer.counts();
    writer.finish()?;
    let working = started.elapsed().as_secs_f64().max(1e-9);

    let secs = start.elapsed().as_secs_f64().max(1e-9);
    let files: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    let part = match part {
        Some((i, n)) => format!(" (part {i}/{n}: documents {} to {})", rows.start, rows.end),
        None => String::new(),
    };
    crate::out(format_args!(
        "tokenized {docs} documents{part} ({text_bytes} bytes of text) into {tokens} tokens of {} \
         in {} s: {} M tokens/s, {} on {workers} threads after {} s loading the tokenizer \
         ({}): {}",
        stored.width.name(),
        significant(secs),
        significant(tokens as f64 / working / 1e6),
        human_rate(text_bytes as f64 / working),
        significant(opened),
        tokenizer.engine(),
        files.join(", ")
    ))
}

/// The tokenizer as Megatron's preprocessing uses it: Python's `encode(text).ids`, and the EOS
/// appended here (only to documents with ids, and even after a template that ends with it).
fn open_tokenizer(args: &Args) -> Result<Tokenizer> {
    let mut options = TokenizerOptions::new()
        .append_eos(false)
        .engine(EngineChoice::from_name(&args.engine).unwrap_or_default());
    if let Some(eos) = &args.eos_token {
        options = options.eos_token(eos.clone());
    }
    options.open(&args.tokenizer)
}

/// `I/N` with `I < N`.
fn parse_part(text: &str) -> Result<(u64, u64)> {
    let parsed = text
        .split_once('/')
        .and_then(|(i, n)| Some((i.trim().parse::<u64>().ok()?, n.trim().parse::<u64>().ok()?)));
    match parsed {
        Some((i, n)) if i < n => Ok((i, n)),
        _ => Err(config(
            "--part",
            &format!(
                "`{text}` is not a part I/N with I from 0 to N-1 (such as 0/4, the first of four)"
            ),
        )),
    }
}

/// The files a dataset of `format` at prefix `output` is written to, each checked as
/// `command` writes its outputs: never one of `inputs` or a non-regular file, an existing one
/// only with `force` and only if it is of the kind written ([`foreign`]).
pub fn checked_outputs(
    command: &'static str,
    format: Format,
    output: &Path,
    inputs: &[&Path],
    force: bool,
) -> Result<Vec<PathBuf>> {
    let paths = output_paths(format, output);
    for path in &paths {
        OutputFile {
            path,
            replace: force,
            command,
            example: "as a prefix such as DIR/corpus",
        }
        .check(inputs, |p| foreign(format, p), "the kind of file it writes")?;
    }
    Ok(paths)
}

/// What an existing output file is if `--force` may not replace it: for Megatron, an `.idx`
/// that is not a Megatron index; any `.bin` that begins as another format gpufeed knows (a
/// packed file, a `.npy` array, Parquet, an Arrow file) or is empty is judged by its name
/// alone otherwise, as a `.bin` has no header.
pub fn foreign(format: Format, path: &Path) -> Result<Option<String>> {
    use std::io::Read;
    let mut head = Vec::with_capacity(9);
    std::fs::File::open(path)
        .and_then(|f| f.take(9).read_to_end(&mut head))
        .map_err(|source| Error::Io {
            path: path.to_path_buf(),
            op: "read",
            source,
        })?;
    let is_idx = path.extension().is_some_and(|e| e == "idx");
    if is_idx && format == Format::Megatron {
        if head.is_empty() || head.as_slice() == gpufeed::source::tokens::MEGATRON_MAGIC {
            return Ok(None);
        }
        return Ok(Some("a file that is not a Megatron index".to_owned()));
    }
    let known: [(&[u8], &str); 4] = [
        (b"GPUFEED", "a packed record file"),
        (b"\x93NUMPY", "a .npy array"),
        (b"PAR1", "a Parquet file"),
        (b"ARROW1", "an Arrow file"),
    ];
    Ok(known
        .iter()
        .find(|(magic, _)| head.starts_with(magic))
        .map(|(_, what)| what.to_string()))
}
