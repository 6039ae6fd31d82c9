//! `gpufeed pack`: writes a packed record file from `.npy` arrays, raw fixed-size records or an
//! ImageFolder directory.
//!
//! Inputs are read in place (`.npy` arrays are memory-mapped, raw files are read in large
//! chunks) and streamed through one [`RecordWriter`], which writes a temporary file and renames
//! it over the destination only once it is complete. Several inputs concatenate, in the order
//! given. This module never leaves a half-written file under the destination's name: any error
//! drops the writer, which removes its temporary file.

use std::fs::File;
use std::io::{IsTerminal, Read};
use std::path::{Path, PathBuf};
use std::time::Instant;

use gpufeed::format::{DType, Field, PackSummary, RecordWriter, Schema};

use gpufeed::{Dataset, Error, NpyArray, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

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
    /// The packed file to write (atomically: a temporary name, then a rename).
    #[arg(short = 'o', long = "output")]
    output: PathBuf,
    /// A `.npy` array with one row per record of the inputs, stored as the field `label`
    /// (with `--from npy` only).
    #[arg(long)]
    labels: Option<PathBuf>,
    /// The size of one record of the raw inputs, in bytes (with `--from raw` only).
    #[arg(long)]
    record_bytes: Option<u64>,
}

/// Runs `gpufeed pack`.
pub fn run(args: Args) -> Result<()> {
    let start = Instant::now();
    let (summary, data_bytes) = match args.from {
        InputKind::Npy => {
            if args.record_bytes.is_some() {
                return Err(config("--record-bytes", "applies to --from raw only"));
            }
            pack_npy(&args.inputs, args.labels.as_deref(), &args.output)?
        }
        InputKind::Raw => {
            if args.labels.is_some() {
                return Err(config("--labels", "applies to --from npy only"));
            }
            let Some(record_bytes) = args.record_bytes else {
                return Err(config("--record-bytes", "is required with --from raw"));
            };
            pack_raw(&args.inputs, record_bytes, &args.output)?
        }
        InputKind::Imagefolder => {
            if args.labels.is_some() || args.record_bytes.is_some() {
                return Err(config(
                    "--from imagefolder",
                    "takes its labels from the class directories; --labels and --record-bytes do not apply",
                ));
            }
            let [dir] = args.inputs.as_slice() else {
                return Err(config("--from imagefolder", "takes exactly one directory"));
            };
            let summary = crate::images::pack_imagefolder(
                dir,
                &args.output,
                std::io::stderr().is_terminal(),
            )?;
            let bytes = summary.file_bytes;
            (summary, bytes)
        }
    };
    let secs = start.elapsed().as_secs_f64();
    println!(
        "packed {} records ({} bytes of input, {} bytes written) into {} in {:.2} s: {:.0} MB/s",
        summary.records,
        data_bytes,
        summary.file_bytes,
        summary.path.display(),
        secs,
        summary.file_bytes as f64 / 1e6 / secs.max(1e-9),
    );
    Ok(())
}

fn config(setting: &'static str, what: &str) -> Error {
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

fn pack_npy(
    inputs: &[PathBuf],
    labels: Option<&Path>,
    output: &Path,
) -> Result<(PackSummary, u64)> {
    let arrays = inputs
        .iter()
        .map(NpyArray::open)
        .collect::<Result<Vec<_>>>()?;
    let Some(first) = arrays.first() else {
        return Err(config("INPUT", "at least one input is needed"));
    };
    let (dtype, row_shape) = (first.dtype(), first.shape()[1..].to_vec());
    for a in &arrays[1..] {
        if a.dtype() != dtype || a.shape()[1..] != row_shape[..] {
            return Err(Error::Mismatch {
                what: format!(
                    "{} has rows of {}{:?}, {} has rows of {dtype}{row_shape:?}: inputs must agree",
                    a.path().display(),
                    a.dtype(),
                    &a.shape()[1..],
                    first.path().display(),
                ),
            });
        }
    }
    let rows: u64 = arrays.iter().map(|a| a.len()).sum();
    let labels = match labels {
        Some(path) => {
            let l = NpyArray::open_as(path, "label")?;
            if l.len() != rows {
                let inputs: Vec<String> = arrays
                    .iter()
                    .map(|a| format!("{} ({} rows)", a.path().display(), a.len()))
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
    let mut fields = vec![Field::tensor(NpyArray::FIELD, dtype, &row_shape)];
    if let Some(l) = &labels {
        fields.extend(l.schema().fields().iter().cloned());
    }
    let schema = Schema::new(fields).map_err(|what| Error::Mismatch { what })?;
    let total: u64 = arrays.iter().map(|a| a.len() * a.row_bytes() as u64).sum();
    let bar = progress(total);
    let mut writer = RecordWriter::create(output, schema)?;
    let mut done = 0u64;
    let mut shown = 0u64;
    let mut label_row = 0u64;
    for a in &arrays {
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

fn pack_raw(inputs: &[PathBuf], record_bytes: u64, output: &Path) -> Result<(PackSummary, u64)> {
    let rb = usize::try_from(record_bytes)
        .ok()
        .filter(|&n| n > 0 && n <= u32::MAX as usize)
        .ok_or_else(|| {
            config(
                "--record-bytes",
                &format!("{record_bytes} is not from 1 to 4 GiB"),
            )
        })?;
    let mut sizes = Vec::with_capacity(inputs.len());
    for path in inputs {
        let size = std::fs::metadata(path).map_err(|e| Error::Io {
            path: path.clone(),
            op: "stat",
            source: e,
        })?;
        let size = size.len();
        if size % record_bytes != 0 {
            return Err(Error::Malformed {
                path: path.clone(),
                format: "raw record",
                what: format!(
                    "its size, {size} bytes, is not a multiple of --record-bytes {record_bytes} \
                     ({} whole records and {} bytes over)",
                    size / record_bytes,
                    size % record_bytes
                ),
            });
        }
        sizes.push(size);
    }
    let schema = Schema::new(vec![Field::tensor("data", DType::U8, &[record_bytes])])
        .map_err(|what| config("--record-bytes", &what))?;
    let total: u64 = sizes.iter().sum();
    let bar = progress(total);
    let mut writer = RecordWriter::create(output, schema)?;
    // Whole records per read: about 8 MiB, at least one record.
    let per_chunk = ((8usize << 20) / rb).max(1);
    let mut buf = vec![0u8; per_chunk * rb];
    let mut done = 0u64;
    let mut shown = 0u64;
    for (path, &size) in inputs.iter().zip(&sizes) {
        let mut file = File::open(path).map_err(|e| Error::Io {
            path: path.clone(),
            op: "open",
            source: e,
        })?;
        let mut left = size;
        while left > 0 {
            let want = (buf.len() as u64).min(left) as usize;
            file.read_exact(&mut buf[..want]).map_err(|e| Error::Io {
                path: path.clone(),
                op: "read (did the file shrink while being packed?)",
                source: e,
            })?;
            for record in buf[..want].chunks_exact(rb) {
                writer.append(&[record])?;
            }
            left -= want as u64;
            done += want as u64;
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
