//! `gpufeed.Tokenizer`: the library's [`gpufeed::tokenizer::Tokenizer`] with one encoder, so
//! that a Python user sees the ids gpufeed's loader makes of a document, and can compare them
//! with their own tokenizer's (`tokenizers.Tokenizer.from_file(path).encode(text).ids`).
//!
//! Loading and encoding run with the GIL released; one encoder behind a mutex serves the
//! object's calls, one at a time (each call is one document: a worker thread of the loader
//! holds an encoder of its own instead).

use std::path::PathBuf;
use std::sync::Mutex;

use gpufeed::Error;
use gpufeed::tokenizer::{Encoder, EngineChoice, Tokenizer as Library, TokenizerOptions};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;

use crate::errors::{self, catch};

/// A Hugging Face tokenizer (``path``: a ``tokenizer.json``, or a directory that holds one
/// beside ``tokenizer_config.json``) and the ids gpufeed makes of each document: ``encode(text)``
/// is ``tokenizers.Tokenizer.from_file(path).encode(text).ids`` (its post-processor's
/// template included, such as Llama 3's BOS), then the EOS (Megatron's ``--append-eod``)::
///
///     tok = gpufeed.Tokenizer("Meta-Llama-3-8B/")
///     hf = tokenizers.Tokenizer.from_file("Meta-Llama-3-8B/tokenizer.json")
///     assert tok.encode(text) == hf.encode(text).ids + [tok.eos_id]
///
/// ``eos_token``/``bos_token`` name the special tokens by their text (else
/// ``tokenizer_config.json`` and ``special_tokens_map.json`` name them, as transformers reads
/// them, else the tokenizer.json's template or a special token of a well-known name: see the
/// library's docs); ``append_eos=False`` leaves the EOS out, ``prepend_bos=True`` puts the BOS
/// first (once: not if the template does), ``add_special_tokens=False`` leaves the template
/// out, as Python's ``encode(text, add_special_tokens=False)``. An empty document is the
/// template and the EOS. Truncation and padding written in the tokenizer.json are not applied.
///
/// ``engine``: ``"auto"`` runs byte-level BPE files of GPT-2's and Llama 3's kinds on gpufeed's
/// own fast path and every other file on the ``tokenizers`` library (Rust, the same ids);
/// ``"fast"`` asks for the fast path (a ConfigError says why a file does not qualify);
/// ``"crate"`` for the library. The ``engine`` attribute says which, and why not the fast path.
///
/// Attributes: ``eos_id``, ``bos_id`` (None when there is none), ``eos_token``, ``bos_token``,
/// ``vocab_size`` (one more than the largest id), ``megatron_dtype`` (``"uint16"`` below 65,500,
/// else ``"int32"``), ``engine``, ``path`` (the tokenizer.json read).
#[pyclass(module = "gpufeed", name = "Tokenizer", frozen)]
pub struct Tokenizer {
    tokenizer: Library,
    encoder: Mutex<Encoder>,
}

/// The library's error with its settings named as this class's arguments.
fn as_argument(e: Error) -> Error {
    match e {
        Error::InvalidConfig {
            setting: "tokenizer",
            what,
        } => Error::InvalidConfig {
            setting: "path",
            what,
        },
        other => other,
    }
}

#[pymethods]
impl Tokenizer {
    #[new]
    #[pyo3(signature = (path, *, eos_token=None, bos_token=None, append_eos=true, prepend_bos=false, add_special_tokens=true, engine=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        eos_token: Option<String>,
        bos_token: Option<String>,
        append_eos: bool,
        prepend_bos: bool,
        add_special_tokens: bool,
        engine: Option<String>,
    ) -> PyResult<Self> {
        let engine = engine.unwrap_or_else(|| "auto".into());
        let Some(engine) = EngineChoice::from_name(&engine) else {
            return Err(errors::config(
                py,
                "engine",
                format!("{engine:?}: use \"auto\", \"fast\" or \"crate\""),
            ));
        };
        let mut options = TokenizerOptions::new()
            .append_eos(append_eos)
            .prepend_bos(prepend_bos)
            .add_special_tokens(add_special_tokens)
            .engine(engine);
        if let Some(t) = eos_token {
            options = options.eos_token(t);
        }
        if let Some(t) = bos_token {
            options = options.bos_token(t);
        }
        let caught = py.detach(|| catch(|| options.open(&path).map_err(as_argument)));
        let tokenizer = errors::lift(py, caught)?;
        let encoder = Mutex::new(tokenizer.encoder());
        Ok(Tokenizer { tokenizer, encoder })
    }

    /// The ids of one document (a ``str``), as a list of ints: with the defaults,
    /// ``tokenizers``' ``encode(text).ids`` then the EOS.
    fn encode(&self, py: Python<'_>, text: PyBackedStr) -> PyResult<Vec<u32>> {
        let text: &str = &text;
        let caught = py.detach(|| {
            catch(|| {
                // A panic in an earlier call poisons the lock; the encoder's buffers are
                // still whole (it only appends to them), so it is used on.
                let mut encoder = self.encoder.lock().unwrap_or_else(|p| p.into_inner());
                encoder.encode(text)
            })
        });
        errors::lift(py, caught)
    }

    /// The EOS's id (None if there is none).
    #[getter]
    fn eos_id(&self) -> Option<u32> {
        self.tokenizer.eos().map(|t| t.id)
    }

    /// The BOS's id (None if there is none).
    #[getter]
    fn bos_id(&self) -> Option<u32> {
        self.tokenizer.bos().map(|t| t.id)
    }

    /// The EOS's text.
    #[getter]
    fn eos_token(&self) -> Option<String> {
        self.tokenizer.eos().map(|t| t.content.clone())
    }

    /// The BOS's text.
    #[getter]
    fn bos_token(&self) -> Option<String> {
        self.tokenizer.bos().map(|t| t.content.clone())
    }

    /// One more than the largest id.
    #[getter]
    fn vocab_size(&self) -> u64 {
        self.tokenizer.vocab_size()
    }

    /// The engine, and why not the fast path (one line).
    #[getter]
    fn engine(&self) -> String {
        self.tokenizer.engine().to_string()
    }

    /// The tokenizer.json read.
    #[getter]
    fn path(&self) -> String {
        self.tokenizer.path().display().to_string()
    }

    /// The numpy dtype Megatron stores this vocabulary's tokens in (``uint16`` or ``int32``).
    #[getter]
    fn megatron_dtype(&self) -> &'static str {
        self.tokenizer.megatron_width().name()
    }

    fn __repr__(&self) -> String {
        format!(
            "gpufeed.Tokenizer({:?}, vocab_size={}, eos_id={:?}, engine={:?})",
            self.tokenizer.path().display().to_string(),
            self.tokenizer.vocab_size(),
            self.eos_id(),
            self.engine()
        )
    }
}
