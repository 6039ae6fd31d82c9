//! `gpufeed inspect`: prints what a packed record file, a `.npy` array, a Megatron indexed
//! dataset (`.bin` + `.idx`), a flat token file (`--token-dtype`), a sharded data set
//! (`shards.rs`) or an ImageFolder directory holds.
//!
//! The kind of file is told by its magic bytes, as [`gpufeed::source::open`] does. Without
//! `--verify` this costs O(1) in the size of the data, plus a look at the offset table: every
//! entry for files of up to [`EXACT_LIMIT`] records, an evenly spaced sample beyond that (and the
//! output says so). `--verify` checks every record's offsets, schema and checksum and fails on
//! the first fault. An ImageFolder is listed (classes, images per class); `--verify` reads
//! every image and checks its header, as `pack --from imagefolder` does. `--json` prints
//! exactly one JSON object on stdout, for machines.

use std::io::Read;
use std::path::{Path, PathBuf};

use gpufeed::codec::probe;
use gpufeed::format::{FieldKind, ReadMode, ReadOptions, RecordFile};
use gpufeed::source::ImageFolder;
use gpufeed::source::tokens::{FlatTokens, IndexedTokens};
use gpufeed::{Dataset, Error, NpyArray, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{Value, json};

use crate::messages::{fields_json, fields_text};

/// Arguments of `gpufeed inspect`.
#[derive(clap::Args)]
pub struct Args {
    /// A packed record file, a `.npy` array, a Megatron indexed dataset (its `.idx`, its
    /// `.bin` or their prefix), a sharded data set (a directory of shards: packed or MDS, with
    /// their `index.json`, or `.tar` files; a `.tar` file or a brace pattern of them; a URL of
    /// one, `s3://bucket/prefix`), or an ImageFolder directory.
    file: PathBuf,
    /// Read FILE as a flat file of tokens of this dtype (nanoGPT's `train.bin`: u16).
    #[arg(long, value_name = "DTYPE")]
    token_dtype: Option<String>,
    /// Check every record (offsets, schema, checksum; an ImageFolder's image headers); fail on
    /// the first fault.
    #[arg(long)]
    verify: bool,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// How a packed file or a .npy array is read (what --verify reads whole).
    #[command(flatten)]
    read: crate::read_mode::ReadFlags,
}

/// What inspect reads, for a path that is none of it.
const READS: &str = "inspect reads packed files, .npy arrays, Megatron .bin/.idx datasets, flat \
     token files (with --token-dtype), shard directories (packed or MDS \
     shards with their index.json, WebDataset .tar shards), a .tar file or a brace pattern of \
     them, URLs of those (s3://...), and ImageFolder directories (class subdirectories of \
     JPEG/PNG files)";

/// Files with up to this many records have their record sizes computed from every entry of the
/// offset table; larger ones from [`SAMPLE`] evenly spaced records.
pub const EXACT_LIMIT: u64 = 1 << 20;
/// How many records are sampled for the record sizes of a larger file.
pub const SAMPLE: u64 = 4096;

/// Record sizes, from the offset table.
struct Sizes {
    min: u64,
    mean: f64,
    max: u64,
    /// Records whose size was looked at (all of them unless the file is large).
    looked_at: u64,
}

/// Runs `gpufeed inspect`.
pub fn run(args: Args) -> Result<()> {
    let path = args.file.as_path();
    if let Some(dtype) = &args.token_dtype {
        crate::pack::check_inputs(&[path], READS)?;
        return print(
            inspect_flat_tokens(path, dtype, args.read.mode())?,
            args.json,
        );
    }
    if let Some(prefix) = megatron_prefix(path) {
        return print(
            inspect_megatron(&prefix, args.verify, args.read.mode())?,
            args.json,
        );
    }
    if crate::shards::is_input(path) {
        args.read
            .refuse_for("a sharded data set's shards are mapped by its store")?;
        return crate::shards::inspect(path, args.verify, args.json);
    }
    if path.is_dir() {
        args.read
            .refuse_for("an ImageFolder's images are read whole, never mapped")?;
        return inspect_image_folder(path, args.verify, args.json);
    }
    // A FIFO or a device would block or never end: only regular files are inspected.
    crate::pack::check_inputs(&[path], READS)?;
    let mode = args.read.mode();
    let report = if is_npy(path)? {
        inspect_npy(path, args.verify, mode)?
    } else {
        inspect_packed(path, args.verify, !args.json, mode)?
    };
    print(report, args.json)
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

/// The prefix of the Megatron dataset `path` names (its `.idx`, its `.bin`, or the prefix), told
/// by the `.idx`'s name: an index that is corrupt or lacks its `.bin` is still a Megatron
/// dataset, which opening it says is broken, and how.
fn megatron_prefix(path: &Path) -> Option<PathBuf> {
    IndexedTokens::prefix_of(path)
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
    let t = if is_npy(path)? {
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

/// `gpufeed inspect DIR` of an ImageFolder: its classes and images; with `verify`, every
/// image read and its header checked (the first bad one is the fault).
fn inspect_image_folder(path: &Path, verify: bool, as_json: bool) -> Result<()> {
    let has_classes = std::fs::read_dir(path)
        .map_err(|e| io(path, "read directory", e))?
        .flatten()
        .any(|e| e.path().is_dir());
    if !has_classes {
        return Err(Error::user(format!(
            "{}: a directory with no index.json, no .tar files and no class directories: {READS}",
            path.display()
        )));
    }
    let folder = ImageFolder::open(path)?;
    let classes = folder.classes();
    let mut per_class = vec![0u64; classes.len()];
    for i in 0..folder.len() {
        per_class[folder.label(i)? as usize] += 1;
    }
    let (min, max) = (
        per_class.iter().copied().min().unwrap_or(0),
        per_class.iter().copied().max().unwrap_or(0),
    );
    let mean = folder.len() as f64 / classes.len().max(1) as f64;
    let codec = match &folder.schema().fields()[0].kind {
        FieldKind::Bytes { codec } => codec.name(),
        FieldKind::Tensor { .. } => "raw".into(),
    };
    let mut json = json!({
        "path": path.display().to_string(),
        "format": "imagefolder",
        "records": folder.len(),
        "classes": classes,
        "images_per_class": {"min": min, "mean": mean, "max": max},
        "codec": codec,
        "fields": fields_json(folder.schema()),
        "file_bytes": Value::Null,
    });
    /// Classes named in the text report; the rest are counted.
    const SHOWN: usize = 8;
    let mut shown: Vec<String> = classes
        .iter()
        .zip(&per_class)
        .take(SHOWN)
        .map(|(c, n)| format!("{c} ({n})"))
        .collect();
    if classes.len() > SHOWN {
        shown.push(format!("and {} more", classes.len() - SHOWN));
    }
    let mut text = format!(
        "directory:     {}\nformat:        ImageFolder: {} classes, {} images (codec {codec})\n\
         classes:       {}\nimages:        {min} to {max} per class, mean {mean:.1}\nfields:\n{}",
        path.display(),
        classes.len(),
        folder.len(),
        shown.join(", "),
        fields_text(folder.schema()),
    );
    let mut fault = None;
    if verify {
        let bar = crate::messages::progress(folder.len(), "verify", as_json);
        let mut bytes = 0u64;
        let result = (0..folder.len()).try_for_each(|i| {
            let image = folder.read(i)?;
            probe(&image, &folder.path(i)?.display().to_string())?;
            bytes += image.len() as u64;
            bar.inc(1);
            Ok::<(), Error>(())
        });
        bar.finish_and_clear();
        json["verified"] = Value::Bool(result.is_ok());
        match result {
            Ok(()) => {
                json["file_bytes"] = bytes.into();
                text.push_str(&format!(
                    "file bytes:    {bytes}\nverified:      all {} images read, their headers checked\n",
                    folder.len()
                ));
            }
            Err(e) => fault = Some(e),
        }
    }
    print(Report { json, text, fault }, as_json)
}

fn is_npy(path: &Path) -> Result<bool> {
    let mut magic = [0u8; 6];
    let mut f = std::fs::File::open(path).map_err(|e| io(path, "open", e))?;
    let mut got = 0;
    while got < magic.len() {
        match f.read(&mut magic[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io(path, "read", e)),
        }
    }
    Ok(got == magic.len() && magic == *b"\x93NUMPY")
}

fn io(path: &Path, op: &'static str, source: std::io::Error) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        op,
        source,
    }
}

fn inspect_npy(path: &Path, verify: bool, mode: ReadMode) -> Result<Report> {
    let a = NpyArray::open_with(path, NpyArray::FIELD, mode)?;
    let file_bytes = std::fs::metadata(path)
        .map_err(|e| io(path, "stat", e))?
        .len();
    let data_bytes = a.len() * a.row_bytes() as u64;
    let mut json = json!({
        "path": path.display().to_string(),
        "format": "npy",
        "dtype": a.dtype().name(),
        "shape": a.shape(),
        "records": a.len(),
        "fields": fields_json(a.schema()),
        "file_bytes": file_bytes,
        "header_bytes": a.data_offset(),
        "data_bytes": data_bytes,
        "record_bytes": { "min": a.row_bytes(), "mean": a.row_bytes(), "max": a.row_bytes(), "exact": true },
    });
    let mut text = format!(
        "file:          {}\nformat:        .npy array, {} {:?} (C order), {}-byte header\nrecords:       {}\nfields:\n{}\
         file bytes:    {file_bytes}\ndata bytes:    {data_bytes}\nrecord bytes:  {} each\n",
        path.display(),
        a.dtype(),
        a.shape(),
        a.data_offset(),
        a.len(),
        fields_text(a.schema()),
        a.row_bytes(),
    );
    if verify {
        // Opening checked the header and that the data fits; a .npy has no checksums.
        json["verified"] = Value::Bool(true);
        text.push_str("verified:      header and size (a .npy file has no checksums)\n");
    }
    Ok(Report {
        json,
        text,
        fault: None,
    })
}

fn inspect_packed(
    path: &Path,
    verify: bool,
    show_progress: bool,
    mode: ReadMode,
) -> Result<Report> {
    let options = ReadOptions {
        mode,
        ..ReadOptions::default()
    };
    let f = RecordFile::open_with(path, options)?;
    let sizes = record_sizes(&f)?;
    let (major, minor) = f.version();
    let exact = sizes.looked_at == f.len();
    let mut json = json!({
        "path": path.display().to_string(),
        "format": "packed",
        "version": format!("{major}.{minor}"),
        "record_align": f.record_align(),
        "records": f.len(),
        "fields": fields_json(f.schema()),
        "file_bytes": f.file_bytes(),
        "data_bytes": f.data_bytes(),
        "record_bytes": {
            "min": sizes.min,
            "mean": sizes.mean,
            "max": sizes.max,
            "exact": exact,
            "sampled_records": sizes.looked_at,
        },
    });
    let how = if exact {
        "all records".to_string()
    } else {
        format!(
            "min and max from {} of {} records, evenly spaced",
            sizes.looked_at,
            f.len()
        )
    };
    let mut text = format!(
        "file:          {}\nformat:        packed record file, version {major}.{minor}\nrecord align:  {} bytes\n\
         records:       {}\nfields:\n{}file bytes:    {}\ndata bytes:    {}\n\
         record bytes:  min {}, mean {:.1}, max {} ({how}; padding included)\n",
        path.display(),
        f.record_align(),
        f.len(),
        fields_text(f.schema()),
        f.file_bytes(),
        f.data_bytes(),
        sizes.min,
        sizes.mean,
        sizes.max,
    );
    let mut fault = None;
    if verify {
        let bar = if show_progress {
            ProgressBar::with_draw_target(Some(f.len()), ProgressDrawTarget::stderr())
        } else {
            ProgressBar::hidden()
        };
        if let Ok(style) =
            ProgressStyle::with_template("verify {bar:40} {pos}/{len} records ({eta} left)")
        {
            bar.set_style(style);
        }
        let result = f.verify(|n| bar.set_position(n));
        bar.finish_and_clear();
        json["verified"] = Value::Bool(result.is_ok());
        match result {
            Ok(()) => text.push_str(&format!(
                "verified:      all {} records (offsets, schema, checksum)\n",
                f.len()
            )),
            Err(e) => fault = Some(e),
        }
    }
    Ok(Report { json, text, fault })
}

/// Record sizes from the offset table: every record up to [`EXACT_LIMIT`], else a sample. The
/// mean is exact either way: the records tile the data region.
fn record_sizes(f: &RecordFile) -> Result<Sizes> {
    let n = f.len();
    if n == 0 {
        return Ok(Sizes {
            min: 0,
            mean: 0.0,
            max: 0,
            looked_at: 0,
        });
    }
    let (step, looked_at) = if n <= EXACT_LIMIT {
        (1, n)
    } else {
        (n / SAMPLE, SAMPLE)
    };
    let (mut min, mut max) = (u64::MAX, 0u64);
    for k in 0..looked_at {
        let len = f.record_len(k * step)?;
        min = min.min(len);
        max = max.max(len);
    }
    Ok(Sizes {
        min,
        mean: f.data_bytes() as f64 / n as f64,
        max,
        looked_at,
    })
}
