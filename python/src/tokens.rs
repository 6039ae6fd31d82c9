//! The token loader behind `gpufeed.TokenLoader`: [`gpufeed::tokens::TokenLoader`] built from
//! the Python arguments (`gpufeed/_tokens.py` checks and spells them out), served by the same
//! [`LoaderCore`] as `gpufeed.Loader`.
//!
//! Iteration, the hand-over of batches, signals, states, epochs and closing are the core's:
//! the token loader is one more [`Handed`] loader. What is here is the building (sources
//! opened by the library's `open_tokens`, the builder's settings, its errors named as the
//! Python arguments), the token figures of `stats()["tokens"]`, and `cu_seqlens` handed out as
//! its counted entries (`TokenCounts::sequences + 1`, a view of the batch's field, no copy).
//!
//! On a GPU (`device=N`) the library's `build_device`: the workers write narrow integers, the
//! copy stage widens them on the device; its batches are handed over as a device loader's.

use std::path::PathBuf;

use gpufeed::format::ReadOptions;
use gpufeed::source::tokens::{TextTokens, TokenSource, is_token_file, open_tokens};
use gpufeed::source::{OpenOptions, ReadMode};
use gpufeed::tokenizer::Tokenizer;
use gpufeed::tokens::{CU_SEQLENS, SampleMode, TokenLoader, TokenStats};
use gpufeed::trace::Trace;
use gpufeed::{Batch, DType, Error, Loader, OutputField, Setting};
use pyo3::prelude::*;

use crate::loader::{
    Around, BuildError, Feed, Figures, Handed, LoaderCore, Next, SettingArg, built, host_taken,
};

impl Handed for TokenLoader<Loader> {
    fn taken(&self, result: gpufeed::Result<Batch>) -> Next {
        host_taken(self.loader(), result)
    }

    fn fields(&self) -> Vec<OutputField> {
        self.loader().layout().fields().to_vec()
    }

    fn figures(&self) -> Figures {
        Figures::Host(Box::new(self.loader().stats()))
    }

    fn token_figures(&self) -> Option<TokenStats> {
        Some(self.token_stats().clone())
    }

    fn state_at(&self, next_batch: u64) -> gpufeed::LoaderState {
        TokenLoader::state_at(self, next_batch)
    }
}

#[cfg(feature = "cuda")]
impl Handed for TokenLoader<gpufeed::cuda::DeviceLoader> {
    fn taken(&self, result: gpufeed::Result<gpufeed::cuda::DeviceBatch>) -> Next {
        Handed::taken(self.loader(), result)
    }

    fn fields(&self) -> Vec<OutputField> {
        self.loader().fields()
    }

    fn figures(&self) -> Figures {
        Handed::figures(self.loader())
    }

    fn token_figures(&self) -> Option<TokenStats> {
        Some(self.token_stats().clone())
    }

    fn state_at(&self, next_batch: u64) -> gpufeed::LoaderState {
        TokenLoader::state_at(self, next_batch)
    }
}

/// What the build needs, all of it `Send`, so the files are opened with the GIL released.
struct TokenSettings {
    /// Each source's path and weight.
    sources: Vec<(PathBuf, f64)>,
    /// The tokenizer.json (or hub directory) that makes the text sources' ids (`tokenizer=`).
    tokenizer: Option<PathBuf>,
    /// The text sources' field of text (`text_field=`).
    text_field: Option<String>,
    token_dtype: Option<DType>,
    seq_len: usize,
    batch_size: usize,
    mode: SampleMode,
    shuffle: Option<u64>,
    window: u64,
    samples_per_epoch: Option<u64>,
    shard: Option<(u64, u64)>,
    shard_env: bool,
    drop_last: bool,
    ignore_index: i64,
    mask_document_ends: Option<bool>,
    pad_id: u32,
    input_dtype: DType,
    label_dtype: DType,
    position_dtype: DType,
    workers: Option<Setting>,
    prefetch: Option<Setting>,
    batch_parts: Option<Setting>,
    pool_budget: Option<u64>,
    epoch: u64,
    trace: Option<Trace>,
    /// The GPU of the batches, or none for host batches.
    device: Option<usize>,
    /// How the sources' token files are read (`read_mode=`).
    read_mode: ReadMode,
}

impl TokenSettings {
    /// The optional arguments not given: gpufeed chooses them.
    fn defaults(&self) -> Vec<&'static str> {
        [
            ("workers", self.workers.is_none()),
            ("prefetch", self.prefetch.is_none()),
            ("batch_parts", self.batch_parts.is_none()),
            ("pool_budget", self.pool_budget.is_none()),
            ("shard", self.shard.is_none() && !self.shard_env),
            ("samples_per_epoch", self.samples_per_epoch.is_none()),
        ]
        .into_iter()
        .filter_map(|(argument, default)| default.then_some(argument))
        .collect()
    }
}

/// A dtype as `gpufeed/_tokens.py` spells it (gpufeed's names: `u16`, `i64`), or the error of
/// the argument that gave it.
fn dtype_of(py: Python<'_>, argument: &'static str, name: &str) -> PyResult<DType> {
    DType::from_name(name)
        .ok_or_else(|| crate::errors::config(py, argument, format!("{name:?} is no dtype")))
}

/// The source at `path`, opened by the library's rule (`open_tokens`); `token_dtype` is given
/// to the flat files of raw tokens only, the kind that asks for it (a `.npy` header and a
/// Megatron index name their dtype), so that a blend may mix them. Sets `used` when it was.
fn open_source(
    path: &std::path::Path,
    token_dtype: Option<DType>,
    mode: ReadMode,
    used: &mut bool,
) -> Result<std::sync::Arc<dyn TokenSource>, BuildError> {
    // A path that is not there is that, not a flat file that lacks its dtype (a Megatron
    // prefix need not be a file: its .idx and .bin are).
    if gpufeed::source::tokens::IndexedTokens::prefix_of(path).is_none() {
        std::fs::metadata(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            op: "open",
            source,
        })?;
    }
    match open_tokens(path, None, mode) {
        Err(Error::InvalidConfig {
            setting: "token_dtype",
            what,
        }) => match token_dtype {
            Some(d) => {
                *used = true;
                Ok(open_tokens(path, Some(d), mode)?)
            }
            None => Err(BuildError::Lacks(
                "token_dtype",
                format!("{what}; pass token_dtype=, e.g. token_dtype=\"uint16\""),
            )),
        },
        other => Ok(other?),
    }
}

/// The tokenizer of `tokenizer=`, a file that is not one named as that argument.
fn open_tokenizer(path: &std::path::Path) -> Result<Tokenizer, BuildError> {
    Tokenizer::open(path).map_err(|e| match e {
        Error::InvalidConfig { what, .. } => BuildError::Argument("tokenizer", what),
        Error::Malformed { path, what, .. } => BuildError::Argument(
            "tokenizer",
            format!("{} is not a tokenizer.json: {what}", path.display()),
        ),
        other => other.into(),
    })
}

/// The library's settings that the Python arguments call otherwise.
fn argument_of(setting: &str) -> Option<&'static str> {
    match setting {
        "sources" | "weights" => Some("sources"),
        "global_batch" => Some("batch_size"),
        _ => None,
    }
}

fn build(s: TokenSettings) -> Result<Box<dyn Feed>, BuildError> {
    let mut builder = TokenLoader::builder(s.seq_len, s.batch_size)
        .mode(s.mode)
        .window(s.window)
        .drop_last(s.drop_last)
        .ignore_index(s.ignore_index)
        .pad_id(s.pad_id)
        .input_dtype(s.input_dtype)
        .label_dtype(s.label_dtype)
        .position_dtype(s.position_dtype)
        .epoch(s.epoch);
    let mut used = false;
    let tokenizer = s.tokenizer.as_deref().map(open_tokenizer).transpose()?;
    if s.text_field.is_some() && tokenizer.is_none() {
        return Err(BuildError::Argument(
            "text_field",
            "text_field= names the text that tokenizer= tokenizes: give tokenizer= too".into(),
        ));
    }
    for (path, weight) in &s.sources {
        match &tokenizer {
            Some(t) if !is_token_file(path) => {
                let options = OpenOptions::read(ReadOptions {
                    mode: s.read_mode,
                    verify_checksums: false,
                });
                let field = s.text_field.as_deref().unwrap_or("text");
                let text =
                    TextTokens::open(path, &options, field, t.clone()).map_err(|e| match e {
                        Error::InvalidConfig {
                            setting: "text_field",
                            what,
                        } => BuildError::Argument("text_field", what),
                        other => other.into(),
                    })?;
                builder = builder.weighted_text(std::sync::Arc::new(text), *weight);
            }
            _ => {
                builder = builder.weighted(
                    open_source(path, s.token_dtype, s.read_mode, &mut used)?,
                    *weight,
                );
            }
        }
    }
    if let Some(d) = s.token_dtype.filter(|_| !used) {
        return Err(BuildError::Argument(
            "token_dtype",
            format!(
                "{d} was given, and no source is a flat file of raw tokens (a .npy array and a Megatron index name their dtype): leave it out"
            ),
        ));
    }
    if let Some(seed) = s.shuffle {
        builder = builder.shuffle(seed);
    }
    if let Some(n) = s.samples_per_epoch {
        builder = builder.samples_per_epoch(n);
    }
    if s.shard_env {
        builder = builder.shard_from_env();
    } else if let Some((rank, world)) = s.shard {
        builder = builder.shard(rank, world);
    }
    if let Some(m) = s.mask_document_ends {
        builder = builder.mask_document_ends(m);
    }
    if let Some(w) = s.workers {
        builder = builder.workers(w);
    }
    if let Some(p) = s.prefetch {
        builder = builder.prefetch(p);
    }
    if let Some(p) = s.batch_parts {
        builder = builder.batch_parts(p);
    }
    if let Some(b) = s.pool_budget {
        builder = builder.pool_budget(b);
    }
    if let Some(t) = &s.trace {
        builder = builder.trace(t);
    }
    let loader: gpufeed::Result<Box<dyn Feed>> = match s.device {
        None => builder.build().map(|l| Box::new(l) as Box<dyn Feed>),
        #[cfg(feature = "cuda")]
        Some(ordinal) => crate::dlpack::open_device(ordinal).and_then(|device| {
            builder
                .build_device(&device, gpufeed::cuda::DeviceLoaderOptions::default())
                .map(|l| Box::new(l) as Box<dyn Feed>)
        }),
        #[cfg(not(feature = "cuda"))]
        Some(_) => {
            return Err(BuildError::Argument(
                "device",
                "this gpufeed was built without CUDA (the Python package's `cuda` feature): build it with `pip install ./python` (cuda is a default feature) to load batches to the GPU".into(),
            ));
        }
    };
    match loader {
        Ok(loader) => Ok(loader),
        Err(Error::InvalidConfig { setting, what }) => Err(match argument_of(setting) {
            Some(argument) => BuildError::Argument(argument, what),
            None => Error::InvalidConfig { setting, what }.into(),
        }),
        Err(e) => Err(e.into()),
    }
}

/// The core of a `gpufeed.TokenLoader`: the arguments as `gpufeed/_tokens.py` spells them
/// (dtypes by gpufeed's names, sources as (path, weight) pairs); not for direct use.
#[pyfunction]
#[pyo3(signature = (
    sources, *, seq_len, batch_size, mode, token_dtype, shuffle, window, samples_per_epoch,
    shard, shard_env, drop_last, ignore_index, mask_document_ends, pad_id, input_dtype,
    label_dtype, position_dtype, workers, prefetch, batch_parts, pool_budget, epoch, convert,
    trace=None, device=None, read_mode=None, tokenizer=None, text_field=None
))]
#[allow(clippy::too_many_arguments)]
pub fn token_core(
    py: Python<'_>,
    sources: Vec<(PathBuf, f64)>,
    seq_len: usize,
    batch_size: usize,
    mode: &str,
    token_dtype: Option<&str>,
    shuffle: Option<u64>,
    window: u64,
    samples_per_epoch: Option<u64>,
    shard: Option<(u64, u64)>,
    shard_env: bool,
    drop_last: bool,
    ignore_index: i64,
    mask_document_ends: Option<bool>,
    pad_id: u32,
    input_dtype: &str,
    label_dtype: &str,
    position_dtype: &str,
    workers: Option<SettingArg>,
    prefetch: Option<SettingArg>,
    batch_parts: Option<SettingArg>,
    pool_budget: Option<u64>,
    epoch: u64,
    convert: Option<Py<PyAny>>,
    trace: Option<PathBuf>,
    device: Option<usize>,
    read_mode: Option<&str>,
    tokenizer: Option<PathBuf>,
    text_field: Option<String>,
) -> PyResult<LoaderCore> {
    let read_mode = crate::loader::read_mode_of(read_mode)
        .map_err(|e| e.into_py(py, &[]))?
        .unwrap_or_default();
    let mode = SampleMode::from_name(mode).ok_or_else(|| {
        crate::errors::config(
            py,
            "mode",
            format!("{mode:?} is not 'concatenated' or 'packed'"),
        )
    })?;
    let timeline = trace.map(|path| (Trace::new(), path));
    let setting = |argument: &'static str, s: Option<SettingArg>| {
        s.map(|s| s.setting(argument).map_err(|e| e.into_py(py, &[])))
            .transpose()
    };
    let settings = TokenSettings {
        sources,
        tokenizer,
        text_field,
        token_dtype: token_dtype
            .map(|d| dtype_of(py, "token_dtype", d))
            .transpose()?,
        seq_len,
        batch_size,
        mode,
        shuffle,
        window,
        samples_per_epoch,
        shard,
        shard_env,
        drop_last,
        ignore_index,
        mask_document_ends,
        pad_id,
        input_dtype: dtype_of(py, "input_dtype", input_dtype)?,
        label_dtype: dtype_of(py, "label_dtype", label_dtype)?,
        position_dtype: dtype_of(py, "position_dtype", position_dtype)?,
        workers: setting("workers", workers)?,
        prefetch: setting("prefetch", prefetch)?,
        batch_parts: setting("batch_parts", batch_parts)?,
        pool_budget,
        epoch,
        trace: timeline.as_ref().map(|(t, _)| t.clone()),
        device,
        read_mode,
    };
    let defaults = settings.defaults();
    let loader = built(py, &defaults, || build(settings))?;
    Ok(LoaderCore::around(
        py,
        loader,
        Around {
            class: "gpufeed.TokenLoader",
            convert,
            evaluation: false,
            indices: false,
            ragged_list: false,
            images: None,
            source: None,
            device,
            defaults,
            trace: timeline,
            sequences: Some(CU_SEQLENS),
        },
    ))
}
