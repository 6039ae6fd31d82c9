//! `gpufeed pack`: writes a packed record file from `.npy` arrays, raw fixed-size records or an
//! ImageFolder directory.
//!
//! Inputs are read in place (`.npy` arrays are memory-mapped one at a time, raw files are read
//! in large chunks by the library's [`pack_raw_records`]) and streamed through one
//! [`RecordWriter`], which writes a temporary file and renames it over the destination only
//! once it is complete. Several inputs concatenate, in the order given. This module never
//! leaves a half-written file under the destination's name: any error drops the writer, which
//! removes its temporary file (signals: see `cleanup.rs`).
//!
//! Before reading anything it checks the output (`Output::check`): never one of the inputs
//! (same device and inode, through any link), never anything but a regular file, never an
//! existing file without `--force`, never (even with `--force`) a file gpufeed did not write
//! (`--force` replaces a packed record file, whole or not, or an empty file: anything else,
//! a `.npy` array, a user's file, is refused, to be removed by the user if it is to go), and a
//! directory that exists and can be written.
//!
//! With `--shard-size 256MiB -o DIR/` it writes packed shards instead (`ShardWriter`): files
//! of at most that size and an `index.json` of their names, counts, sizes and checksums,
//! written last, so that a directory with an index is complete (`docs/FORMAT.md`, "Shard
//! directories"). Without `--force`, DIR must hold neither an index nor any file under a
//! shard's name (`shard-000000.gfd`, ...). With `--force`, gpufeed's own data set there is
//! replaced (its index, and the shards it names, those the new index does not name removed
//! once that is in place); another writer's (an MDS `index.json`, a file under a shard's name
//! that is not a packed record file) is refused, forced or not (`ExistingShards`). An error
//! or a signal before the index is written removes the shards already finished, as it removes
//! temporaries.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Instant;

use gpufeed::format::{
    DType, Field, PackSummary, RecordSink, RecordWriter, Schema, pack_raw_records,
};
use gpufeed::memory::{human_rate, significant};
use gpufeed::source::shards::packed::{
    ExistingShards, ShardWriter, ShardWriterOptions, parse_byte_size,
};

use gpufeed::{Dataset, Error, NpyArray, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::output::{OutputFile, kind_of};

/// What the inputs of `gpufeed pack` are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum InputKind {
    /// `.npy` arrays: row `i` (along the first axis) is record `i`.
    Npy,
    /// Raw files of fixed-size records (`--record-bytes`), back to back.
    Raw,
    /// One ImageFolder directory (class subdirectories of JPEG/PNG files): each record stores
    /// the encoded bytes, the label, the image size and the relative path.
    Imagefolder,
}

/// Arguments of `gpufeed pack`.
#[derive(clap::Args)]
pub struct Args {
    /// What the inputs are.
    #[arg(long = "from", value_enum)]
    from: InputKind,
    /// Input files, concatenated in this order.
    #[arg(required = true)]
    inputs: Vec<PathBuf>,
    /// The packed file to write (atomically: a temporary name, then a rename). It must not
    /// exist (see --force) and must not be one of the inputs.
    #[arg(short = 'o', long = "output")]
    output: PathBuf,
    /// Replace OUTPUT if it is a packed file gpufeed wrote (or an empty file); with
    /// --shard-size, replace gpufeed's shards and index in the directory, removing the old
    /// shards the new index does not name. Never an input, a link, a device, nor a file or
    /// data set another program wrote (a .npy array, an MDS directory): remove those
    /// yourself if they are to go.
    #[arg(long)]
    force: bool,
    /// The name of the data field (with --from npy or raw; default `data`). Name it `image`
    /// for programs that read images under that name, as the examples do.
    #[arg(long, value_name = "NAME")]
    field: Option<String>,
    /// A `.npy` array with one row per record of the inputs, stored as the field `label`
    /// (with `--from npy` only).
    #[arg(long)]
    labels: Option<PathBuf>,
    /// The size of one record of the raw inputs, in bytes (with `--from raw` only).
    #[arg(long)]
    record_bytes: Option<u64>,
    /// Write packed shards of at most this size (`256MiB`, `1GiB`, `64MB`) and their
    /// `index.json` into the directory -o names (created if missing), instead of one file
    /// (with --from npy or raw).
    #[arg(long, value_name = "SIZE")]
    shard_size: Option<String>,
}

/// Runs `gpufeed pack`.
pub fn run(args: Args) -> Result<()> {
    let start = Instant::now();
    let field = args.field.as_deref().unwrap_or(NpyArray::FIELD);
    let shard_bytes = match &args.shard_size {
        Some(text) => Some(parse_byte_size(text).map_err(|_| {
            config(
                "--shard-size",
                &format!("`{text}` is not a size such as 256MiB, 1GiB, 64MB or 4096"),
            )
        })?),
        None => None,
    };
    if shard_bytes.is_some() && args.from == InputKind::Imagefolder {
        return Err(config(
            "--shard-size",
            "applies to --from npy and --from raw (pack an ImageFolder into one file)",
        ));
    }
    let output = Output {
        path: &args.output,
        replace: args.force,
        shard_bytes,
    };
    let (summary, data_bytes) = match args.from {
        InputKind::Npy => {
            if args.record_bytes.is_some() {
                return Err(config("--record-bytes", "applies to --from raw only"));
            }
            let mut inputs: Vec<&Path> = args.inputs.iter().map(PathBuf::as_path).collect();
            inputs.extend(args.labels.as_deref());
            check_inputs(&inputs, "--from npy takes .npy files")?;
            output.check(&inputs)?;
            pack_npy(&args.inputs, args.labels.as_deref(), field, &output)?
        }
        InputKind::Raw => {
            if args.labels.is_some() {
                return Err(config("--labels", "applies to --from npy only"));
            }
            let Some(record_bytes) = args.record_bytes else {
                return Err(config("--record-bytes", "is required with --from raw"));
            };
            let inputs: Vec<&Path> = args.inputs.iter().map(PathBuf::as_path).collect();
            check_inputs(&inputs, "--from raw takes files of records")?;
            output.check(&inputs)?;
            pack_raw(&args.inputs, record_bytes, field, &output)?
        }
        InputKind::Imagefolder => {
            if args.labels.is_some() || args.record_bytes.is_some() || args.field.is_some() {
                return Err(config(
                    "--from imagefolder",
                    "takes its labels from the class directories and names its fields `image`, `label`, \
                     `size` and `path`; --labels, --record-bytes and --field do not apply",
                ));
            }
            let [dir] = args.inputs.as_slice() else {
                return Err(config("--from imagefolder", "takes exactly one directory"));
            };
            output.check_beside_folder(dir)?;
            let (summary, bytes) = crate::images::pack_imagefolder(
                dir,
                &args.output,
                std::io::stderr().is_terminal(),
            )?;
            (
                Written {
                    summary,
                    shards: 1,
                    removed: 0,
                },
                bytes,
            )
        }
    };
    let secs = start.elapsed().as_secs_f64();
    let into = match shard_bytes {
        Some(_) if summary.removed > 0 => format!(
            "{} shards of {} (and removed {} shards of the data set it replaced)",
            summary.shards,
            args.output.display(),
            summary.removed
        ),
        Some(_) => format!("{} shards of {}", summary.shards, args.output.display()),
        None => args.output.display().to_string(),
    };
    let summary = summary.summary;
    crate::out(format_args!(
        "packed {} records ({} bytes of input, {} bytes written) into {} in {} s: {}",
        summary.records,
        data_bytes,
        summary.file_bytes,
        into,
        significant(secs),
        human_rate(summary.file_bytes as f64 / secs.max(1e-9)),
    ))
}

/// The file `gpufeed pack` writes, as the user named it.
struct Output<'a> {
    path: &'a Path,
    /// `--force`: an existing regular file may be replaced.
    replace: bool,
    /// `--shard-size`: `path` is a directory of packed shards of at most this many bytes.
    shard_bytes: Option<u64>,
}

/// What was written: the summary of the file (for shards: the index, all records, all bytes),
/// the number of files, and the old shards removed.
struct Written {
    summary: PackSummary,
    shards: usize,
    removed: usize,
}

/// One packed file, or a directory of packed shards (both boxed: writers of some hundred
/// bytes, made once per command).
enum PackWriter {
    File(Box<RecordWriter>),
    Shards(Box<ShardWriter>),
}

impl RecordSink for PackWriter {
    type Summary = Written;

    fn append(&mut self, fields: &[&[u8]]) -> Result<()> {
        match self {
            PackWriter::File(w) => w.append(fields),
            PackWriter::Shards(w) => w.append(fields),
        }
    }

    fn finish(self) -> Result<Written> {
        match self {
            PackWriter::File(w) => Ok(Written {
                summary: w.finish()?,
                shards: 1,
                removed: 0,
            }),
            PackWriter::Shards(w) => {
                let s = w.finish()?;
                Ok(Written {
                    summary: PackSummary {
                        records: s.samples,
                        file_bytes: s.bytes(),
                        path: s.index.clone(),
                    },
                    shards: s.shards.len(),
                    removed: s.removed.len(),
                })
            }
        }
    }
}

/// Refuses inputs that are not regular files (before `.npy` mapping says "No such device").
pub fn check_inputs(inputs: &[&Path], takes: &str) -> Result<()> {
    for path in inputs {
        let meta = std::fs::metadata(path).map_err(|e| Error::Io {
            path: path.to_path_buf(),
            op: "open",
            source: e,
        })?;
        if !meta.is_file() {
            let hint = if meta.is_dir() {
                "; for a folder of images: gpufeed pack --from imagefolder DIR -o OUT"
            } else {
                ""
            };
            return Err(Error::user(format!(
                "{}: is {}, not a file: {takes}{hint}",
                path.display(),
                kind_of(meta.file_type())
            )));
        }
    }
    Ok(())
}

impl Output<'_> {
    /// The output as one file, for the checks every writing command makes.
    fn file(&self) -> OutputFile<'_> {
        OutputFile {
            path: self.path,
            replace: self.replace,
            command: "pack",
            example: "such as DIR/train.gfd",
        }
    }

    fn refuse(&self, what: impl std::fmt::Display) -> Error {
        self.file().refuse(what)
    }

    /// Checks the output before anything is read or written: see the module docs. `inputs`
    /// are every file that will be read.
    fn check(&self, inputs: &[&Path]) -> Result<()> {
        if self.shard_bytes.is_some() {
            return self.check_shard_dir(inputs);
        }
        self.file()
            .check(inputs, gpufeed::format::foreign_file, "a packed file")
    }

    /// The image folder's files are the inputs of `--from imagefolder`: refuse an output
    /// among them, then check as for other inputs.
    fn check_beside_folder(&self, dir: &Path) -> Result<()> {
        if self.file().existing()?.is_some() {
            let inside = match (std::fs::canonicalize(dir), std::fs::canonicalize(self.path)) {
                (Ok(d), Ok(o)) => o.starts_with(d),
                _ => false,
            };
            if inside {
                return Err(self.refuse(format_args!(
                    "is a file inside the image folder {} (it could be one of its images): write the packed file elsewhere",
                    dir.display()
                )));
            }
        }
        self.check(&[])
    }

    /// The shard directory: absent (its parent is then checked as for a file) or a directory
    /// holding nothing gpufeed did not write where its shards and index go, and without an
    /// index or shards of gpufeed's (else `--force`), holding none of the inputs.
    fn check_shard_dir(&self, inputs: &[&Path]) -> Result<()> {
        match std::fs::symlink_metadata(self.path) {
            Ok(meta) if meta.is_dir() => {
                let options = ShardWriterOptions::new(self.shard_bytes.unwrap_or(1));
                let existing = ExistingShards::find(self.path, &options)?;
                if let Some(what) = &existing.foreign {
                    return Err(self.refuse(format_args!(
                        "holds {what}, which gpufeed did not write: pack replaces (with --force) only its own \
                         shards and index; write the shards into another directory, or remove that first"
                    )));
                }
                if existing.index && !self.replace {
                    return Err(self.refuse(
                        "holds a shard index already; pass --force to replace its shards, or choose another -o",
                    ));
                }
                if !self.replace {
                    self.refuse_shard_files(&existing.shards)?;
                }
                if let Ok(dir) = std::fs::canonicalize(self.path) {
                    for input in inputs {
                        if std::fs::canonicalize(input).is_ok_and(|i| i.starts_with(&dir)) {
                            return Err(self.refuse(format_args!(
                                "holds the input {}: write the shards elsewhere",
                                input.display()
                            )));
                        }
                    }
                }
                Ok(())
            }
            Ok(meta) => Err(self.refuse(format_args!(
                "is {}; with --shard-size, -o names a directory of shards (created if missing), \
                 not a file: choose another -o",
                kind_of(meta.file_type())
            ))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let parent = Output {
                    path: self.path,
                    replace: self.replace,
                    shard_bytes: None,
                };
                parent.file().check_directory()
            }
            Err(e) => Err(Error::Io {
                path: self.path.to_path_buf(),
                op: "stat",
                source: e,
            }),
        }
    }

    /// Refuses a shard directory that holds shard files of gpufeed's (`taken`: under the names
    /// its shards get, any of them, as how many shards there will be is known only once they
    /// are written), naming the first.
    fn refuse_shard_files(&self, taken: &[String]) -> Result<()> {
        let Some(first) = taken.first() else {
            return Ok(());
        };
        let more = match taken.len() {
            1 => String::new(),
            2 => " (and 1 more shard file)".to_owned(),
            n => format!(" (and {} more shard files)", n - 1),
        };
        Err(self.refuse(format_args!(
            "holds {first}{more}, under the names pack gives its shards; pass --force to replace them, \
             or choose another -o"
        )))
    }

    /// The writer: one that replaces nothing unless `--force` was given.
    fn writer(&self, schema: Schema) -> Result<PackWriter> {
        if let Some(bytes) = self.shard_bytes {
            return Ok(PackWriter::Shards(Box::new(ShardWriter::create(
                self.path, schema, bytes,
            )?)));
        }
        Ok(PackWriter::File(Box::new(if self.replace {
            RecordWriter::create(self.path, schema)
        } else {
            RecordWriter::create_new(self.path, schema)
        }?)))
    }
}

/// An error about the flag `setting`.
pub(crate) fn config(setting: &'static str, what: &str) -> Error {
    Error::InvalidConfig {
        setting,
        what: what.to_string(),
    }
}

/// A byte-counting progress bar on stderr; hidden when stderr is not a terminal.
fn progress(total_bytes: u64) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total_bytes), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(
        "{bar:40} {bytes}/{total_bytes} ({binary_bytes_per_sec}, {eta} left)",
    ) {
        bar.set_style(style);
    }
    bar
}

/// Bytes between two updates of the progress bar, so that it costs nothing per record.
const PROGRESS_STEP: u64 = 16 << 20;

/// What one `.npy` input holds, from its header (the array is not kept mapped).
struct NpyInput {
    path: PathBuf,
    dtype: DType,
    row_shape: Vec<u64>,
    rows: u64,
    row_bytes: u64,
}

fn pack_npy(
    inputs: &[PathBuf],
    labels: Option<&Path>,
    field: &str,
    output: &Output<'_>,
) -> Result<(Written, u64)> {
    // Headers first, each array mapped and unmapped in turn: the kernel limits how many maps
    // a process holds (vm.max_map_count, 65,530 by default), and inputs can be more.
    let mut arrays = Vec::with_capacity(inputs.len());
    for path in inputs {
        let a = NpyArray::open(path)?;
        arrays.push(NpyInput {
            path: path.clone(),
            dtype: a.dtype(),
            row_shape: a.shape()[1..].to_vec(),
            rows: a.len(),
            row_bytes: a.row_bytes() as u64,
        });
    }
    let Some(first) = arrays.first() else {
        return Err(config("INPUT", "at least one input is needed"));
    };
    let (dtype, row_shape) = (first.dtype, first.row_shape.clone());
    for a in &arrays[1..] {
        if a.dtype != dtype || a.row_shape != row_shape {
            return Err(Error::Mismatch {
                what: format!(
                    "{} has rows of {}{:?}, {} has rows of {dtype}{row_shape:?}: inputs must agree",
                    a.path.display(),
                    a.dtype,
                    a.row_shape,
                    first.path.display(),
                ),
            });
        }
    }
    let rows: u64 = arrays.iter().map(|a| a.rows).sum();
    let labels = match labels {
        Some(path) => {
            let l = NpyArray::open_as(path, "label")?;
            if l.len() != rows {
                let inputs: Vec<String> = arrays
                    .iter()
                    .map(|a| format!("{} ({} rows)", a.path.display(), a.rows))
                    .collect();
                return Err(Error::Mismatch {
                    what: format!(
                        "labels file {} has {} rows, the inputs have {rows}: {}",
                        path.display(),
                        l.len(),
                        inputs.join(", ")
                    ),
                });
            }
            Some(l)
        }
        None => None,
    };
    let mut fields = vec![Field::tensor(field, dtype, &row_shape)];
    if let Some(l) = &labels {
        fields.extend(l.schema().fields().iter().cloned());
    }
    let schema =
        Schema::new(fields).map_err(|e| Error::user(format!("the schema of the output: {e}")))?;
    let total: u64 = arrays.iter().map(|a| a.rows * a.row_bytes).sum();
    let bar = progress(total);
    let mut writer = output.writer(schema)?;
    let mut done = 0u64;
    let mut shown = 0u64;
    let mut label_row = 0u64;
    for input in &arrays {
        let a = NpyArray::open(&input.path)?;
        if a.dtype() != input.dtype
            || a.len() != input.rows
            || a.shape()[1..] != input.row_shape[..]
        {
            return Err(Error::Mismatch {
                what: format!(
                    "{} changed while it was being packed: it was {}{:?}, it is {}{:?}",
                    input.path.display(),
                    input.dtype,
                    [&[input.rows][..], &input.row_shape[..]].concat(),
                    a.dtype(),
                    a.shape()
                ),
            });
        }
        for i in 0..a.len() {
            let row = a.row(i)?;
            match &labels {
                Some(l) => {
                    let label = l.row(label_row)?;
                    writer.append(&[row, label])?;
                }
                None => writer.append(&[row])?,
            }
            label_row += 1;
            done += row.len() as u64;
            if done - shown >= PROGRESS_STEP {
                bar.set_position(done);
                shown = done;
            }
        }
    }
    bar.set_position(done);
    let summary = writer.finish()?;
    bar.finish_and_clear();
    Ok((summary, total))
}

/// Packs raw record files through the library ([`pack_raw_records`]), which checks them,
/// reads them and names `--record-bytes` in its errors; this draws the progress bar.
fn pack_raw(
    inputs: &[PathBuf],
    record_bytes: u64,
    field: &str,
    output: &Output<'_>,
) -> Result<(Written, u64)> {
    let bar = progress(0);
    let mut total = 0;
    let written = pack_raw_records(
        inputs,
        record_bytes,
        "--record-bytes",
        field,
        |schema, bytes| {
            total = bytes;
            bar.set_length(bytes);
            output.writer(schema)
        },
        |done| {
            bar.set_position(done);
            Ok(())
        },
    )
    .map_err(|e| match e {
        // The schema is one field of --record-bytes bytes, checked: only its name can be wrong.
        Error::InvalidSchema { what } => config("--field", &what),
        e => e,
    })?;
    bar.finish_and_clear();
    Ok((written, total))
}
