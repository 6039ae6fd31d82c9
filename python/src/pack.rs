//! `pack` and `inspect`: the command's `gpufeed pack` and `gpufeed inspect`, on the library's
//! APIs (`RecordWriter`, `NpyArray`, `RecordFile`, `pack_image_folder`), with the GIL released.
//!
//! `pack` writes through one `RecordWriter`, which writes a temporary file and renames it over
//! the output only once complete: an error or Ctrl-C (looked for every [`CHECK_EVERY`] bytes of
//! `.npy` or raw input) drops the writer, which removes its temporary file. An ImageFolder is
//! packed by the library in one call, which Ctrl-C interrupts only at its end.
//!
//! As `gpufeed pack` does, it replaces an existing output only with `force=True`, only when
//! that is a packed file gpufeed wrote (or an empty file), and never one of its inputs (see
//! [`check_output`]).

use std::path::{Path, PathBuf};
use std::time::Instant;

use gpufeed::format::{Field, FieldKind, PackSummary, RecordWriter, Schema, pack_raw_records};
use gpufeed::source::{ImageFolder, pack_image_folder};
use gpufeed::{Dataset, Error, NpyArray};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use serde_json::Value;

use crate::errors::{self, catch};

/// Bytes of input between two looks for Ctrl-C.
const CHECK_EVERY: u64 = 64 << 20;

/// Why a pack stopped.
enum PackError {
    Library(Error),
    /// A Python argument, as typed, and what is wrong with it.
    Argument(&'static str, String),
    /// A signal handler raised (Ctrl-C).
    Interrupted(PyErr),
    /// The output exists and `force` is false.
    Exists,
}

impl From<Error> for PackError {
    fn from(e: Error) -> Self {
        PackError::Library(e)
    }
}

/// Looks for signals (attaching to Python for a moment); `Err` if a handler raised.
fn check_signals() -> Result<(), PackError> {
    Python::attach(|py| py.check_signals()).map_err(PackError::Interrupted)
}

/// Refuses an output that is one of the inputs (through any link: it would be destroyed),
/// one that exists but is not a regular file (a directory, a link: never replaced), one that
/// is a file gpufeed did not write (a `.npy` array, a user's file: `force` replaces a packed
/// file, whole or not, or an empty one, as `gpufeed pack --force` does), and, without `force`,
/// one that exists. What else is wrong with it the writer says.
fn check_output(
    inputs: &[PathBuf],
    labels: Option<&Path>,
    output: &Path,
    force: bool,
) -> Result<(), PackError> {
    use std::os::unix::fs::MetadataExt;
    let Ok(found) = std::fs::symlink_metadata(output) else {
        return Ok(());
    };
    if let Ok(out) = std::fs::metadata(output) {
        for input in inputs.iter().map(PathBuf::as_path).chain(labels) {
            if let Ok(m) = std::fs::metadata(input)
                && (m.dev(), m.ino()) == (out.dev(), out.ino())
            {
                return Err(PackError::Argument(
                    "output",
                    format!(
                        "{} is the input {}: packing into it would destroy it; choose another output",
                        output.display(),
                        input.display()
                    ),
                ));
            }
        }
    }
    if found.is_dir() {
        return Err(PackError::Argument(
            "output",
            format!(
                "{} is a directory: output names the file to write, such as {}",
                output.display(),
                output.join("train.gfd").display()
            ),
        ));
    }
    if !found.is_file() {
        return Err(PackError::Argument(
            "output",
            format!(
                "{} is not a regular file (a link, a named pipe, a device?): pack writes a new file and replaces only a regular one",
                output.display()
            ),
        ));
    }
    if let Some(what) = gpufeed::format::foreign_file(output)? {
        return Err(PackError::Argument(
            "output",
            format!(
                "{} exists, and is {what}: pack replaces (with force=True) only a packed file; if it is to go, remove it yourself, or choose another output",
                output.display()
            ),
        ));
    }
    if force {
        Ok(())
    } else {
        Err(PackError::Exists)
    }
}

/// The writer of `output`: one that replaces nothing unless `force` (then the existing file
/// goes only once the new one is complete).
fn writer(output: &Path, schema: Schema, force: bool) -> gpufeed::Result<RecordWriter> {
    if force {
        RecordWriter::create(output, schema)
    } else {
        RecordWriter::create_new(output, schema)
    }
}

fn pack_npy(
    inputs: &[PathBuf],
    labels: Option<&Path>,
    output: &Path,
    force: bool,
) -> Result<(PackSummary, u64), PackError> {
    let arrays = inputs
        .iter()
        .map(NpyArray::open)
        .collect::<gpufeed::Result<Vec<_>>>()?;
    let Some(first) = arrays.first() else {
        return Err(PackError::Argument(
            "inputs",
            "at least one input is needed".into(),
        ));
    };
    let (dtype, row_shape) = (first.dtype(), first.shape()[1..].to_vec());
    for a in &arrays[1..] {
        if a.dtype() != dtype || a.shape()[1..] != row_shape[..] {
            return Err(PackError::Argument(
                "inputs",
                format!(
                    "{} has rows of {}{:?}, {} has rows of {dtype}{row_shape:?}: inputs must agree",
                    a.path().display(),
                    a.dtype(),
                    &a.shape()[1..],
                    first.path().display(),
                ),
            ));
        }
    }
    let rows: u64 = arrays.iter().map(|a| a.len()).sum();
    let labels = match labels {
        Some(path) => {
            let l = NpyArray::open_as(path, "label")?;
            if l.len() != rows {
                return Err(PackError::Argument(
                    "labels",
                    format!(
                        "{} has {} rows, the inputs have {rows}",
                        path.display(),
                        l.len()
                    ),
                ));
            }
            Some(l)
        }
        None => None,
    };
    let mut fields = vec![Field::tensor(NpyArray::FIELD, dtype, &row_shape)];
    if let Some(l) = &labels {
        fields.extend(l.schema().fields().iter().cloned());
    }
    let schema = Schema::new(fields).map_err(|e| PackError::Argument("inputs", e.to_string()))?;
    let total: u64 = arrays.iter().map(|a| a.len() * a.row_bytes() as u64).sum();
    let mut writer = writer(output, schema, force)?;
    let (mut done, mut checked, mut label_row) = (0u64, 0u64, 0u64);
    for a in &arrays {
        for i in 0..a.len() {
            let row = a.row(i)?;
            match &labels {
                Some(l) => writer.append(&[row, l.row(label_row)?])?,
                None => writer.append(&[row])?,
            }
            label_row += 1;
            done += row.len() as u64;
            if done - checked >= CHECK_EVERY {
                check_signals()?;
                checked = done;
            }
        }
    }
    Ok((writer.finish()?, total))
}

/// Packs raw record files through the library ([`pack_raw_records`]), which checks them,
/// reads them and names `record_bytes` in its errors; this looks for Ctrl-C between reads.
fn pack_raw(
    inputs: &[PathBuf],
    record_bytes: u64,
    output: &Path,
    force: bool,
) -> Result<(PackSummary, u64), PackError> {
    let (mut total, mut checked) = (0u64, 0u64);
    let mut interrupted = None;
    let packed = pack_raw_records(
        inputs,
        record_bytes,
        "record_bytes",
        NpyArray::FIELD,
        |schema, bytes| {
            total = bytes;
            writer(output, schema, force)
        },
        |done| {
            if done - checked >= CHECK_EVERY {
                checked = done;
                if let Err(e) = Python::attach(|py| py.check_signals()) {
                    interrupted = Some(e);
                    return Err(Error::user("interrupted by a signal handler"));
                }
            }
            Ok(())
        },
    );
    match (packed, interrupted) {
        (_, Some(e)) => Err(PackError::Interrupted(e)),
        (Ok(summary), None) => Ok((summary, total)),
        (Err(e), None) => Err(PackError::Library(e)),
    }
}

/// Packs an ImageFolder through the library's [`pack_image_folder`], whose writer replaces
/// what it finds: without `force`, [`check_output`] looked for an existing output just before
/// (as `gpufeed pack --from imagefolder` does).
fn pack_folder(inputs: &[PathBuf], output: &Path) -> Result<(PackSummary, u64), PackError> {
    let [dir] = inputs else {
        return Err(PackError::Argument(
            "inputs",
            format!(
                "kind='imagefolder' takes exactly one directory, not {}",
                inputs.len()
            ),
        ));
    };
    let folder = ImageFolder::open(dir)?;
    let summary = pack_image_folder(&folder, output, |_| {})?;
    let bytes = summary.file_bytes;
    Ok((summary, bytes))
}

/// Writes a packed record file from `.npy` arrays (`kind="npy"`), raw fixed-size records
/// (`kind="raw"`, with `record_bytes`) or one ImageFolder directory (`kind="imagefolder"`);
/// see `gpufeed.pack`.
#[pyfunction]
#[pyo3(signature = (inputs, output, *, kind, labels=None, record_bytes=None, force=false))]
pub fn pack<'py>(
    py: Python<'py>,
    inputs: Vec<PathBuf>,
    output: PathBuf,
    kind: &str,
    labels: Option<PathBuf>,
    record_bytes: Option<u64>,
    force: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let wrong = |arg: &str, what: &str| Err(errors::config(py, arg, what));
    match kind {
        "npy" if record_bytes.is_some() => {
            return wrong("record_bytes", "applies to kind='raw' only");
        }
        "raw" if labels.is_some() => return wrong("labels", "applies to kind='npy' only"),
        "raw" if record_bytes.is_none() => {
            return wrong("record_bytes", "is required with kind='raw'");
        }
        "imagefolder" if labels.is_some() || record_bytes.is_some() => {
            return wrong(
                "kind",
                "kind='imagefolder' takes its labels from the class directories; labels and record_bytes do not apply",
            );
        }
        "npy" | "raw" | "imagefolder" => {}
        other => {
            return wrong(
                "kind",
                &format!("{other:?} is not one of 'npy', 'raw', 'imagefolder'"),
            );
        }
    }
    let start = Instant::now();
    let caught = py.detach(|| {
        catch(|| {
            check_output(&inputs, labels.as_deref(), &output, force)?;
            match kind {
                "npy" => pack_npy(&inputs, labels.as_deref(), &output, force),
                "raw" => pack_raw(&inputs, record_bytes.unwrap_or(0), &output, force),
                _ => pack_folder(&inputs, &output),
            }
        })
    });
    let (summary, input_bytes) = match caught {
        Ok(Ok(done)) => done,
        Ok(Err(PackError::Exists)) => return Err(errors::file_exists(py, "output", &output)),
        // Made by another writer while this one wrote (`create_new`): nothing was replaced.
        Ok(Err(PackError::Library(Error::Io { source, .. })))
            if source.kind() == std::io::ErrorKind::AlreadyExists =>
        {
            return Err(errors::file_exists(py, "output", &output));
        }
        Ok(Err(PackError::Library(e))) => return Err(errors::to_py(py, &e)),
        Ok(Err(PackError::Argument(arg, what))) => return Err(errors::config(py, arg, what)),
        Ok(Err(PackError::Interrupted(e))) => return Err(e),
        Err(payload) => return Err(errors::panicked(py, payload.as_ref())),
    };
    let d = PyDict::new(py);
    d.set_item("path", summary.path.display().to_string())?;
    d.set_item("records", summary.records)?;
    d.set_item("file_bytes", summary.file_bytes)?;
    d.set_item("input_bytes", input_bytes)?;
    d.set_item("seconds", start.elapsed().as_secs_f64())?;
    Ok(d)
}

fn fields_list<'py>(py: Python<'py>, schema: &Schema) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    for (k, f) in schema.fields().iter().enumerate() {
        let d = PyDict::new(py);
        d.set_item("name", &f.name)?;
        match &f.kind {
            FieldKind::Tensor { dtype, shape } => {
                d.set_item("kind", "tensor")?;
                d.set_item("dtype", crate::dlpack::dtype_name(*dtype))?;
                d.set_item("shape", shape.clone())?;
                d.set_item("bytes", schema.fixed_range(k).map_or(0, |r| r.len()))?;
            }
            FieldKind::Bytes { codec } => {
                d.set_item("kind", "bytes")?;
                d.set_item("codec", codec.name())?;
            }
        }
        list.append(d)?;
    }
    Ok(list)
}

/// What the data set at `path` holds, as `gpufeed inspect --json` says it (the library's
/// front door opens it, its format describes it); with `verify`, every sample checked (a
/// fault is raised, as `gpufeed inspect --verify` fails on it). See `gpufeed.inspect`.
#[pyfunction]
#[pyo3(signature = (path, *, verify=false))]
pub fn inspect<'py>(py: Python<'py>, path: PathBuf, verify: bool) -> PyResult<Bound<'py, PyDict>> {
    let caught = py.detach(|| {
        catch(
            || -> gpufeed::Result<(gpufeed::source::Description, Option<Value>)> {
                let data = gpufeed::source::open(&path, &Default::default())?;
                let mut d = data.describe()?;
                d.location = path.display().to_string();
                if verify {
                    data.verify(&mut |_, _| {})?;
                }
                let store = data
                    .sharded()
                    .and_then(|s| s.store_stats())
                    .and_then(|s| serde_json::to_value(s).ok());
                Ok((d, store))
            },
        )
    });
    let (description, store) = errors::lift(py, caught)?;
    let json = description.to_json();
    let d = crate::value::to_python(py, &json)?.cast_into::<PyDict>()?;
    // Python's dtype names (numpy's), as batches name them.
    d.set_item("fields", fields_list(py, &description.schema)?)?;
    if let Some(dtype) = json.get("dtype").and_then(Value::as_str)
        && let Some(dt) = gpufeed::DType::from_name(dtype)
    {
        d.set_item("dtype", crate::dlpack::dtype_name(dt))?;
    }
    if let Some(store) = store {
        d.set_item("store", crate::value::to_python(py, &store)?)?;
    }
    if verify {
        d.set_item("verified", true)?;
    }
    Ok(d)
}

/// Sample `index` of the data set at `path` (anything `gpufeed.Loader` opens as one path),
/// as the library reads it: for each field, `(bytes, kind, dtype_or_codec, shape)`, where a
/// tensor field's bytes are its values (little-endian) and a bytes field's its bytes (a
/// variable-size field, which a batch cannot hold yet). See `gpufeed.read_sample`.
#[pyfunction]
pub fn read_sample<'py>(
    py: Python<'py>,
    path: PathBuf,
    index: u64,
) -> PyResult<Bound<'py, PyDict>> {
    type Fields = Vec<(String, Vec<u8>, &'static str, String, Vec<u64>)>;
    let caught = py.detach(|| {
        catch(|| -> gpufeed::Result<Fields> {
            let data = gpufeed::source::open(&path, &Default::default())?;
            let sample = data.get(index)?;
            let mut out = Vec::new();
            for (k, f) in data.schema().fields().iter().enumerate() {
                let bytes = sample.try_field(k)?.to_vec();
                out.push(match &f.kind {
                    FieldKind::Tensor { dtype, shape } => (
                        f.name.clone(),
                        bytes,
                        "tensor",
                        crate::dlpack::dtype_name(*dtype).to_owned(),
                        shape.clone(),
                    ),
                    FieldKind::Bytes { codec } => {
                        (f.name.clone(), bytes, "bytes", codec.name(), Vec::new())
                    }
                });
            }
            Ok(out)
        })
    });
    let fields = errors::lift(py, caught)?;
    let d = PyDict::new(py);
    for (name, bytes, kind, what, shape) in fields {
        let value = (pyo3::types::PyBytes::new(py, &bytes), kind, what, shape);
        d.set_item(name, value)?;
    }
    Ok(d)
}
