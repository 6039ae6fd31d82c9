//! gpufeed's errors as Python exceptions, and panics caught before they reach Python.
//!
//! Each [`gpufeed::Error`] becomes an instance of one of the classes of `gpufeed/_errors.py`
//! (made there by `_from_rust`, from a kind, the message and the details: path, record,
//! sample, batch, argument, errno), so that the class hierarchy, with its Python bases
//! (`ValueError`, `OSError`), lives in one Python file. Settings are named as the Python user
//! typed them (`images['size']`, not `size`); a setting the user did not give (gpufeed's
//! default: see [`Defaults`]) is not called an invalid argument, and the message says that
//! it is the default and which argument sets it.

use std::any::Any;

use gpufeed::Error;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyDict;

static FROM_RUST: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// The Python argument a library setting comes from.
pub fn python_argument(setting: &str) -> String {
    match setting {
        "rank" | "world" | "shard" | "RANK" | "WORLD_SIZE" | "SLURM_PROCID" | "SLURM_NTASKS" => {
            "shard".into()
        }
        "dataset" | "shards" | "sources" => "path_or_paths".into(),
        "transform" | "columns" => "fields".into(),
        "verify_checksums" => "verify".into(),
        "size" | "scale" | "ratio" | "flip" | "resize" | "dtype" | "normalize" | "layout"
        | "max_pixels" => format!("images['{setting}']"),
        other => other.into(),
    }
}

/// How a Python user raises the limit of the library's setting `setting`: an image option is
/// a key of `images=`, another setting its own argument.
fn raise_with(setting: &str) -> String {
    match python_argument(setting).strip_prefix("images[") {
        Some(key) => format!("images={{..., {}: N}}", key.trim_end_matches(']')),
        None => format!("{}=N", python_argument(setting)),
    }
}

/// Details of an error: its kind, and what it names.
#[derive(Default)]
struct Details {
    kind: &'static str,
    path: Option<String>,
    record: Option<u64>,
    sample: Option<u64>,
    batch: Option<u64>,
    argument: Option<String>,
    errno: Option<i32>,
    op: Option<&'static str>,
}

fn details(e: &Error) -> Details {
    let path = |p: &std::path::Path| Some(p.display().to_string());
    match e {
        Error::Io {
            path: p,
            op,
            source,
        } => Details {
            kind: "io",
            path: path(p),
            errno: source.raw_os_error(),
            op: Some(op),
            ..Details::default()
        },
        Error::Malformed { path: p, .. } => Details {
            kind: "malformed",
            path: path(p),
            ..Details::default()
        },
        // A line of a JSON lines file: the file, as any malformed file; the line and column
        // are in the message.
        Error::BadLine { path: p, .. } => Details {
            kind: "malformed",
            path: path(p),
            ..Details::default()
        },
        Error::UnsupportedVersion { path: p, .. } => Details {
            kind: "unsupported_version",
            path: path(p),
            ..Details::default()
        },
        Error::BadRecord {
            path: p, record, ..
        } => Details {
            kind: "bad_record",
            path: path(p),
            record: Some(*record),
            ..Details::default()
        },
        Error::ChecksumMismatch {
            path: p, record, ..
        } => Details {
            kind: "checksum",
            path: path(p),
            record: Some(*record),
            ..Details::default()
        },
        Error::FileChanged { path: p, .. } => Details {
            kind: "file_changed",
            path: path(p),
            ..Details::default()
        },
        Error::UnsupportedNpy { path: p, .. } => Details {
            kind: "unsupported_npy",
            path: path(p),
            ..Details::default()
        },
        Error::UnsupportedTable { path: p, .. } => Details {
            kind: "unsupported_table",
            path: path(p),
            ..Details::default()
        },
        Error::Mismatch { .. } => Details {
            kind: "mismatch",
            ..Details::default()
        },
        Error::OutOfRange { .. } => Details {
            kind: "out_of_range",
            ..Details::default()
        },
        Error::InvalidConfig { setting, .. } => Details {
            kind: "invalid_config",
            argument: Some(python_argument(setting)),
            ..Details::default()
        },
        // A thread a setting asks for that could not start: that setting's error, with the
        // operating system's errno.
        Error::Spawn {
            setting, source, ..
        } => Details {
            kind: "invalid_config",
            argument: Some(python_argument(setting)),
            errno: source.raw_os_error(),
            ..Details::default()
        },
        // A sample's failure is of its cause's kind, and names the sample and batch.
        Error::Sample {
            index,
            batch,
            source,
        } => Details {
            sample: Some(*index),
            batch: Some(*batch),
            ..details(source)
        },
        // A batch hook's failure is of its cause's kind, and names the batch.
        Error::Batch { batch, source } => Details {
            batch: Some(*batch),
            ..details(source)
        },
        Error::InvalidSchema { .. } => Details {
            kind: "invalid_config",
            ..Details::default()
        },
        Error::User { .. } => Details {
            kind: "user",
            ..Details::default()
        },
        Error::Image { source_name, .. } => Details {
            kind: "image",
            path: Some(source_name.clone()),
            ..Details::default()
        },
        Error::Shutdown => Details {
            kind: "shutdown",
            ..Details::default()
        },
        Error::NoGpu { .. } => Details {
            kind: "no_gpu",
            ..Details::default()
        },
        Error::Cuda { .. } => Details {
            kind: "cuda",
            ..Details::default()
        },
        #[cfg(feature = "cuda")]
        Error::Driver { .. } => Details {
            kind: "cuda",
            ..Details::default()
        },
        _ => Details {
            kind: "other",
            ..Details::default()
        },
    }
}

/// The Python arguments a call left to gpufeed's defaults (`gpufeed.Loader(path)`: workers,
/// prefetch, pool_budget, ...): an error about one of them is not the user's invalid argument.
#[derive(Clone, Copy, Default)]
pub struct Defaults<'a>(pub &'a [&'static str]);

impl Defaults<'_> {
    /// True when `argument` (`images['size']` counts as `images`) was left to its default.
    fn has(&self, argument: &str) -> bool {
        let base = argument.split('[').next().unwrap_or(argument);
        self.0.contains(&base)
    }
}

/// The message of a setting's error: the invalid argument, named as in Python, or, for a
/// default, what gpufeed chose and the argument that sets it; an environment variable as such.
fn config_message(setting: &str, what: &str, defaults: Defaults<'_>) -> String {
    if setting.starts_with("GPUFEED_") {
        return format!("environment variable {setting}: {what}");
    }
    let argument = python_argument(setting);
    if defaults.has(&argument) {
        format!(
            "{what} ({argument}= was not given: this is gpufeed's default; pass {argument}= to set it)"
        )
    } else {
        format!("invalid argument {argument}: {what}")
    }
}

/// The message of `e` as a Python user reads it (settings named as the arguments).
pub fn python_message(e: &Error) -> String {
    message(e, Defaults::default())
}

/// The message: gpufeed's, with settings named as in Python.
fn message(e: &Error, defaults: Defaults<'_>) -> String {
    // A package built without object stores: the pip command that builds one with them.
    raw_message(e, defaults).replace(
        gpufeed::source::shards::NO_STORE_ADVICE,
        "install the package with them: pip install ./python --config-settings=build-args=\"--features s3\" (or gcs, azure, http)",
    )
}

fn raw_message(e: &Error, defaults: Defaults<'_>) -> String {
    match e {
        Error::InvalidConfig { setting, what } => config_message(setting, what, defaults),
        Error::Spawn {
            setting,
            thread,
            source,
        } => config_message(
            setting,
            &format!("cannot start {thread}: {source}"),
            defaults,
        ),
        Error::Sample {
            index,
            batch,
            source,
        } => format!(
            "sample {index} (batch {batch}): {}",
            message(source, defaults)
        ),
        Error::Batch { batch, source } => {
            format!("batch {batch}: {}", message(source, defaults))
        }
        // An image refused by a limit: the argument that raises it, not the Rust builder's.
        Error::Image {
            source_name,
            what,
            setting: Some(setting),
            source,
        } => {
            let cause = source
                .as_ref()
                .map(|c| format!(": {c}"))
                .unwrap_or_default();
            format!(
                "{source_name}: {what}; raise it with {}{cause}",
                raise_with(setting)
            )
        }
        other => other.to_string(),
    }
}

/// Builds the exception for `kind` with `message` and `details` through `gpufeed._errors`.
fn make(
    py: Python<'_>,
    kind: &str,
    message: String,
    fill: impl FnOnce(&Bound<'_, PyDict>) -> PyResult<()>,
) -> PyErr {
    let build = || -> PyResult<PyErr> {
        let factory = FROM_RUST.get_or_try_init(py, || {
            py.import("gpufeed._errors")?
                .getattr("_from_rust")
                .map(Bound::unbind)
        })?;
        let attrs = PyDict::new(py);
        fill(&attrs)?;
        let exc = factory.bind(py).call1((kind, &message, attrs))?;
        Ok(PyErr::from_value(exc))
    };
    match build() {
        Ok(err) => err,
        // gpufeed._errors cannot be imported (a broken install): the message still gets out.
        Err(e) => PyRuntimeError::new_err(format!(
            "{message} (and gpufeed's exception classes failed: {e})"
        )),
    }
}

/// The Python exception for `e`.
pub fn to_py(py: Python<'_>, e: &Error) -> PyErr {
    to_py_with(py, e, Defaults::default())
}

/// The Python exception for `e`, of a call that left `defaults` to gpufeed.
pub fn to_py_with(py: Python<'_>, e: &Error, defaults: Defaults<'_>) -> PyErr {
    let d = details(e);
    make(py, d.kind, message(e, defaults), |attrs| {
        attrs.set_item("path", d.path)?;
        attrs.set_item("record", d.record)?;
        attrs.set_item("sample", d.sample)?;
        attrs.set_item("batch", d.batch)?;
        attrs.set_item("argument", d.argument)?;
        attrs.set_item("errno", d.errno)?;
        attrs.set_item("op", d.op)?;
        Ok(())
    })
}

/// A `ConfigError` naming the Python argument `argument`.
pub fn config(py: Python<'_>, argument: &str, what: impl std::fmt::Display) -> PyErr {
    config_said(py, argument, format!("invalid argument {argument}: {what}"))
}

/// A `ConfigError` about the Python argument `argument` (the one that changes it), whose
/// message says what the user did: for what is not an invalid argument but calls for one.
pub fn config_said(py: Python<'_>, argument: &str, message: String) -> PyErr {
    make(py, "invalid_config", message, |attrs| {
        attrs.set_item("argument", argument)
    })
}

/// A `FileExists` (a `FileExistsError`) for the file `path` that the argument `argument` names
/// and that a call would replace: `force=True` replaces it.
pub fn file_exists(py: Python<'_>, argument: &str, path: &std::path::Path) -> PyErr {
    make(
        py,
        "io",
        format!(
            "{argument} {} exists: pass force=True to replace it, or choose another {argument}",
            path.display()
        ),
        |attrs| {
            attrs.set_item("path", path.display().to_string())?;
            attrs.set_item("argument", argument)?;
            attrs.set_item("errno", py.import("errno")?.getattr("EEXIST")?)?;
            attrs.set_item("op", "create")
        },
    )
}

/// The exception for a panic caught in gpufeed: a bug, reported as such, never a crash.
pub fn panicked(py: Python<'_>, payload: &(dyn Any + Send)) -> PyErr {
    let what = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into());
    make(
        py,
        "internal",
        format!("internal error in gpufeed (please report it): {what}"),
        |_| Ok(()),
    )
}

/// What a call into the library gave: its result, or the payload of a panic it raised.
pub type Caught<T> = Result<T, Box<dyn Any + Send>>;

/// Runs `f`, catching a panic so that it never unwinds into Python.
pub fn catch<T>(f: impl FnOnce() -> T) -> Caught<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
}

/// Turns a caught library result into a Python one.
pub fn lift<T>(py: Python<'_>, caught: Caught<gpufeed::Result<T>>) -> PyResult<T> {
    lift_with(py, caught, Defaults::default())
}

/// Turns a caught library result of a call that left `defaults` to gpufeed into a Python one.
pub fn lift_with<T>(
    py: Python<'_>,
    caught: Caught<gpufeed::Result<T>>,
    defaults: Defaults<'_>,
) -> PyResult<T> {
    match caught {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(to_py_with(py, &e, defaults)),
        Err(payload) => Err(panicked(py, payload.as_ref())),
    }
}
