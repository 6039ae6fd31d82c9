//! `LoaderCore`: a [`gpufeed::Loader`] behind a Python iterator; `gpufeed.Loader` (Python)
//! checks and spells out the arguments, this does the work.
//!
//! Each batch becomes a dict of field name -> array, every array a view of the batch's buffer
//! through DLPack (see `dlpack.rs`), converted by the `convert` callable (`torch.from_dlpack`,
//! `numpy.from_dlpack`) or handed out as `gpufeed.Array`s. The buffer returns to the pool when
//! the last view is gone.
//!
//! Waiting: `__next__` waits for the batch with the GIL released, [`POLL`] at a time, and looks
//! for signals between waits (`PyErr_CheckSignals`), so Ctrl-C raises `KeyboardInterrupt`
//! promptly; a timed-out wait moves nothing ([`Loader::next_timeout`]), so the loader can be
//! used again or dropped.
//!
//! Locking: the loader sits in a mutex that is only taken with the GIL released and never held
//! while attaching to Python, so a thread that waits on a batch does not block the others, and
//! calls from other Python threads (`stats()`) wait at most one [`POLL`].
//!
//! Epochs, as in the library, plus one rule for `for` loops (see `iter_epoch`): iterating goes
//! on where the loader stands, and once an epoch has been delivered to its end, a new iteration
//! that no `set_epoch` or `load_state_dict` preceded starts the next epoch.
//!
//! Hand-over: a batch is delivered when `__next__` returns it. Converting it runs Python code
//! (`torch.from_dlpack`), where a signal handler may raise (Ctrl-C); a batch whose hand-over
//! fails so is kept ([`Place::pending`]) and handed over by the next `__next__`, and until
//! then neither `state_dict` nor `position` counts it. It is kept as it was taken, shared:
//! views made by the failed attempt (in the exception's traceback) keep its buffer, so it
//! cannot go back to the library's loader, and later views share it.
//!
//! A signal that arrives while the batch is waited for (the GIL released) or converted by C
//! code (`numpy.from_dlpack`) runs no handler there: Python runs handlers where it next
//! checks, and after a call (`b = next(it)`, `it.__next__()`) that is as the call returns,
//! before its result is assigned, so the batch, counted as delivered, would be dropped. So
//! `__next__` runs the handlers itself once the batch is made, and a handler that raises fails
//! the hand-over as above (a `for` loop, which checks only after its body, gets the same
//! rule). What is left is a signal in the few instructions between that check and the return.
//!
//! Device loaders (`device=N`, feature `cuda`): the same loader in pinned buffers behind a
//! [`DeviceLoader`], whose device batches become CUDA arrays (`dlpack.rs`); with the image
//! pipeline to a float dtype, the workers stop at u8 CHW and the GPU converts
//! ([`gpufeed::cuda::Convert`]); the mask and indices are device fields of the batch.
//!
//! Other kinds of loader (the token loader, `tokens.rs`) are served by the same core: each is
//! a [`Handed`] loader, built elsewhere and wrapped by [`LoaderCore::around`].

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use gpufeed::format::{FieldKind, ReadMode, ReadOptions};
use gpufeed::source::{self, Dataset, Format, Source};
use gpufeed::tokens::TokenStats;
use gpufeed::trace::Trace;
use gpufeed::transform::image::{ImageStats, ImageTransform, Layout, Normalize, OnBadImage};
use gpufeed::{
    Batch, BatchInfo, BatchStream, Codec, CopyFields, DType, Error, Loader, LoaderState,
    OutputField,
};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

#[cfg(feature = "cuda")]
use gpufeed::cuda::{Convert, DeviceLoader, DeviceLoaderOptions};
use gpufeed::sampler::OrderSpec;

use crate::dlpack::{Array, HeldBatch, View, dtype_name};
use crate::errors::{self, Caught, Defaults, catch, lift_with};
use crate::value;

/// How long `__next__` waits for a batch before it looks for signals.
pub const POLL: Duration = Duration::from_millis(50);

/// The reserved key of the padding mask (evaluation loaders).
pub const MASK_KEY: &str = "__mask__";
/// The reserved key of the sample indices (`indices=True`).
pub const INDEX_KEY: &str = "__index__";

/// What [`Feed::next_timeout`] found.
pub(crate) enum Next {
    /// The next batch, taken from the loader (or kept from a failed hand-over).
    Batch(Taken),
    /// The caller holds every batch the pool's budget allows: `batches` of `batch_bytes`.
    Budget {
        batches: usize,
        batch_bytes: usize,
    },
    Failed(Error),
    Pending,
    End,
}

/// A batch taken from the loader, held for the arrays of its hand-over to Python.
pub(crate) enum Taken {
    Host(Arc<HeldBatch>),
    #[cfg(feature = "cuda")]
    Device(Arc<crate::dlpack::HeldDeviceBatch>),
}

/// A loader's figures, as its kind has them.
pub(crate) enum Figures {
    Host(Box<gpufeed::LoaderStats>),
    #[cfg(feature = "cuda")]
    Device(Box<gpufeed::cuda::DeviceStats>, String),
}

/// What `LoaderCore` needs of a loader, whatever its batches: the library's [`BatchStream`],
/// with each batch taken for its hand-over to Python. Implemented once, below, for every
/// loader the binding knows how to hand over ([`Handed`]).
pub(crate) trait Feed: Send {
    fn next_timeout(&mut self, timeout: Duration) -> Next;
    fn epoch(&self) -> u64;
    fn batches_per_epoch(&self) -> u64;
    fn order_spec(&self) -> &OrderSpec;
    fn state(&self) -> LoaderState;
    /// The state with one batch fewer of this epoch delivered (the batch kept for the next
    /// call, whose hand-over failed).
    fn state_less_one(&self) -> LoaderState;
    fn load_state(&mut self, state: LoaderState) -> gpufeed::Result<()>;
    fn set_epoch(&mut self, epoch: u64);
    fn next_epoch(&mut self);
    /// Every field of the batches, in order (device batches: the mask and indices last).
    fn fields(&self) -> Vec<OutputField>;
    fn figures(&self) -> Figures;
    fn token_figures(&self) -> Option<TokenStats>;
}

/// A loader whose batches the binding hands to Python: what differs between kinds of loader.
pub(crate) trait Handed: BatchStream + Send {
    /// The batch taken from the loader (or the loader's error, said as the binding says it).
    fn taken(&self, result: gpufeed::Result<Self::Batch>) -> Next;
    fn fields(&self) -> Vec<OutputField>;
    fn figures(&self) -> Figures;
    /// What a token loader delivered (`stats()["tokens"]`); None for other loaders.
    fn token_figures(&self) -> Option<TokenStats> {
        None
    }
    /// The state at `next_batch` batches of this epoch: the state with its count set, for a
    /// loader whose state is nothing more (a token loader's names the stream's places too).
    fn state_at(&self, next_batch: u64) -> LoaderState {
        LoaderState {
            next_batch,
            ..BatchStream::state(self)
        }
    }
}

impl<L: Handed> Feed for L {
    fn next_timeout(&mut self, timeout: Duration) -> Next {
        match BatchStream::next_timeout(self, timeout) {
            gpufeed::Next::Ready(result) => self.taken(result),
            gpufeed::Next::Pending => Next::Pending,
            gpufeed::Next::EndOfEpoch => Next::End,
        }
    }

    fn epoch(&self) -> u64 {
        BatchStream::epoch(self)
    }

    fn batches_per_epoch(&self) -> u64 {
        BatchStream::batches_per_epoch(self)
    }

    fn order_spec(&self) -> &OrderSpec {
        BatchStream::order_spec(self)
    }

    fn state(&self) -> LoaderState {
        BatchStream::state(self)
    }

    fn state_less_one(&self) -> LoaderState {
        let next = BatchStream::state(self).next_batch;
        self.state_at(next.saturating_sub(1))
    }

    fn load_state(&mut self, state: LoaderState) -> gpufeed::Result<()> {
        BatchStream::load_state(self, state)
    }

    fn set_epoch(&mut self, epoch: u64) {
        BatchStream::set_epoch(self, epoch)
    }

    fn next_epoch(&mut self) {
        BatchStream::next_epoch(self)
    }

    fn fields(&self) -> Vec<OutputField> {
        Handed::fields(self)
    }

    fn figures(&self) -> Figures {
        Handed::figures(self)
    }

    fn token_figures(&self) -> Option<TokenStats> {
        Handed::token_figures(self)
    }
}

/// A host batch taken from `loader` (or from a loader over it, as a token loader is), or the
/// loader's error: the pool's budget spent by the caller is said as such.
pub(crate) fn host_taken(loader: &Loader, result: gpufeed::Result<Batch>) -> Next {
    match result {
        Ok(b) => Next::Batch(Taken::Host(HeldBatch::new(b))),
        // The budget's error (another `pool_budget` error, a failed allocation, is a
        // batch's, while the caller holds fewer).
        Err(Error::InvalidConfig {
            setting: "pool_budget",
            ..
        }) if loader.held_batches() >= loader.budget_batches() => Next::Budget {
            batches: loader.budget_batches(),
            batch_bytes: gpufeed::HostPool::block_size(loader.layout().total_bytes()),
        },
        Err(e) => Next::Failed(e),
    }
}

impl Handed for Loader {
    fn taken(&self, result: gpufeed::Result<Batch>) -> Next {
        host_taken(self, result)
    }

    fn fields(&self) -> Vec<OutputField> {
        self.layout().fields().to_vec()
    }

    fn figures(&self) -> Figures {
        Figures::Host(Box::new(self.stats()))
    }
}

#[cfg(feature = "cuda")]
impl Handed for DeviceLoader {
    fn taken(&self, result: gpufeed::Result<gpufeed::cuda::DeviceBatch>) -> Next {
        match result {
            Ok(b) => Next::Batch(Taken::Device(crate::dlpack::HeldDeviceBatch::new(b))),
            Err(e) => Next::Failed(e),
        }
    }

    fn fields(&self) -> Vec<OutputField> {
        DeviceLoader::fields(self)
    }

    fn figures(&self) -> Figures {
        Figures::Device(Box::new(self.stats()), self.device().name().to_owned())
    }
}

struct Core {
    /// None once closed.
    loader: Option<Box<dyn Feed>>,
    place: Place,
}

/// Where the Python iterator stands, beyond the loader's position.
#[derive(Default)]
struct Place {
    /// Set by construction, `set_epoch` and `load_state_dict`; cleared by iterating.
    fresh: bool,
    /// A batch taken from the loader whose hand-over failed (see the module docs): the next
    /// `__next__` hands it over. The loader counts it as delivered; [`Place::state`] does not.
    pending: Option<Taken>,
    /// A batch was handed over since the position was last set (construction, `set_epoch`,
    /// `load_state_dict`, the next epoch of `iter_epoch`).
    handed: bool,
    /// Counts the times the position was set: a batch whose hand-over fails is kept only if
    /// the position was not set in the meantime (by another thread).
    positioned: u64,
}

/// What a hand-over changes in a [`Place`], to undo if it fails.
#[derive(Clone, Copy)]
struct Prior {
    handed: bool,
    positioned: u64,
}

impl Place {
    /// The loader's state, less the batch kept for the next call.
    fn state(&self, loader: &dyn Feed) -> LoaderState {
        if self.pending.is_some() {
            loader.state_less_one()
        } else {
            loader.state()
        }
    }

    fn prior(&self) -> Prior {
        Prior {
            handed: self.handed,
            positioned: self.positioned,
        }
    }

    /// The position is set anew: what was kept is dropped.
    fn reposition(&mut self) {
        self.pending = None;
        self.handed = false;
        self.positioned += 1;
    }
}

/// How a field arrives in the batch dict.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Arrives {
    /// Its array, `[len, *shape]`.
    Whole,
    /// A ragged field: `(values, offsets)`, or a list (`ragged_list`).
    Ragged,
    /// The leading [`TokenCounts::sequences`](gpufeed::loader::TokenCounts::sequences)` + 1`
    /// entries, flat: a token batch's `cu_seqlens`.
    Sequences,
}

/// The Rust half of `gpufeed.Loader` and `gpufeed.TokenLoader`; not for direct use.
#[pyclass(frozen, module = "gpufeed._gpufeed", name = "LoaderCore")]
pub struct LoaderCore {
    core: Mutex<Core>,
    /// The Python class it serves, for messages (`gpufeed.Loader`).
    class: &'static str,
    /// The batch dict's keys, one per field of the batches (device batches: the mask and
    /// indices fields too).
    names: Vec<Py<PyString>>,
    /// Per key of `names`, how its field arrives.
    arrives: Vec<Arrives>,
    /// Ragged fields as a list of one array per sample instead of `(values, offsets)`.
    ragged_list: bool,
    /// The data fields as delivered (device batches: after the conversion on the GPU), without
    /// the mask and indices.
    fields: Vec<OutputField>,
    convert: Option<Py<PyAny>>,
    evaluation: bool,
    indices: bool,
    images: Option<Arc<ImageStats>>,
    /// The data set as opened: its own figures (a table's chunk cache, a sharded set's store).
    source: Option<Arc<dyn Source>>,
    /// The device's ordinal for device loaders.
    device: Option<usize>,
    /// The process that built the loader: a forked child has none of its threads.
    pid: u32,
    /// The arguments left to gpufeed's defaults (see `errors::Defaults`).
    defaults: Vec<&'static str>,
    /// The timeline being recorded (`trace=`) and the file it is written to.
    trace: Option<(Trace, PathBuf)>,
}

/// The image pipeline's options, as `gpufeed.ImageOptions` spells them out.
#[derive(FromPyObject, Clone)]
#[pyo3(from_item_all)]
struct ImageArgs {
    size: (u32, u32),
    train: bool,
    scale: (f64, f64),
    ratio: (f64, f64),
    flip: f64,
    resize: Option<u32>,
    dtype: String,
    normalize: Option<([f32; 3], [f32; 3])>,
    layout: String,
    image_field: String,
    label_field: Option<String>,
    skip_bad_images: bool,
    decode: String,
    max_pixels: Option<u64>,
}

impl ImageArgs {
    /// The decode asked for (`images['decode']`, or `decode=`).
    fn decode(&self) -> gpufeed::Result<gpufeed::transform::image::Decode> {
        self.decode.parse()
    }

    /// The image and label fields a data set's writer named otherwise than the defaults (a
    /// WebDataset's `jpg` and `cls`, an MDS `jpeg` column), taken where the defaults are not
    /// the data set's: the library's `default_image_fields`, as `gpufeed bench --images`.
    fn take_fields_of(&mut self, schema: &gpufeed::Schema) {
        let (image, label) = gpufeed::transform::image::default_image_fields(schema);
        if self.image_field == DEFAULT_IMAGE_FIELD
            && schema.index_of(DEFAULT_IMAGE_FIELD).is_none()
            && let Some(image) = image
        {
            self.image_field = image;
        }
        if self.label_field.as_deref() == Some(DEFAULT_LABEL_FIELD)
            && schema.index_of(DEFAULT_LABEL_FIELD).is_none()
            && let Some(label) = label
        {
            self.label_field = Some(label);
        }
    }

    /// True for a float dtype: on a device loader the GPU converts (the workers write u8).
    fn converts(&self) -> bool {
        // The GPU decode writes the dtype itself.
        self.decode == "cpu" && DType::from_name(&self.dtype).is_some_and(|d| d != DType::U8)
    }

    /// The conversion a device loader runs on the GPU for a float dtype: u8 CHW to that dtype,
    /// `v / 255`, normalised if asked (the host transform's arithmetic).
    #[cfg(feature = "cuda")]
    fn device_convert(&self) -> Result<Option<Convert>, BuildError> {
        let Some(dtype) =
            DType::from_name(&self.dtype).filter(|&d| d != DType::U8 && self.converts())
        else {
            return Ok(None);
        };
        if self.layout != "chw" {
            return Err(BuildError::Argument(
                "images['layout']",
                format!(
                    "{:?} with a float dtype on the GPU: the conversion there writes CHW; use layout='chw', or dtype='uint8'",
                    self.layout
                ),
            ));
        }
        let mut c = Convert::new("image", Layout::Chw, dtype);
        if let Some((mean, std)) = self.normalize {
            c = c.normalize(Normalize { mean, std });
        }
        Ok(Some(c))
    }

    /// The host transform: the options as given, or on a device loader that converts, u8 and
    /// no normalisation (the GPU does both).
    fn transform(&self, device: bool) -> gpufeed::Result<ImageTransform> {
        if device && self.converts() {
            let host = ImageArgs {
                dtype: "u8".into(),
                normalize: None,
                ..self.clone()
            };
            return host.transform(false);
        }
        let (h, w) = self.size;
        let mut b = if self.train {
            ImageTransform::train(h.max(w))
                .scale(self.scale.0, self.scale.1)
                .ratio(self.ratio.0, self.ratio.1)
                .flip(self.flip)
        } else {
            let mut b = ImageTransform::eval(h.max(w));
            if let Some(r) = self.resize {
                b = b.resize(r);
            }
            b
        };
        b = b.size(h, w);
        let dtype = DType::from_name(&self.dtype).ok_or_else(|| Error::InvalidConfig {
            setting: "dtype",
            what: format!(
                "{:?} is not one of uint8, float16, bfloat16, float32",
                self.dtype
            ),
        })?;
        b = b.dtype(dtype);
        b = b.layout(match self.layout.as_str() {
            "hwc" => Layout::Hwc,
            _ => Layout::Chw,
        });
        if let Some((mean, std)) = self.normalize {
            b = b.normalize(Normalize { mean, std });
        }
        b = b
            .image_field(self.image_field.clone())
            .label_field(self.label_field.as_deref());
        if self.skip_bad_images {
            b = b.on_bad_image(OnBadImage::Skip);
        }
        if let Some(pixels) = self.max_pixels {
            b = b.max_pixels(pixels);
        }
        b = b.decode(self.decode()?);
        b.build()
    }
}

/// `workers=`, `prefetch=`, `batch_parts=` as given: a count, or `"auto"` (`gpufeed/_loader.py`
/// has checked which).
#[derive(FromPyObject, Clone)]
pub(crate) enum SettingArg {
    Count(usize),
    Word(String),
}

impl SettingArg {
    /// The library's setting, or the argument's error.
    pub(crate) fn setting(&self, argument: &'static str) -> Result<gpufeed::Setting, BuildError> {
        match self {
            SettingArg::Count(n) => Ok(gpufeed::Setting::Fixed(*n)),
            SettingArg::Word(w) if w == "auto" => Ok(gpufeed::Setting::Auto),
            SettingArg::Word(w) => Err(BuildError::Argument(
                argument,
                format!("{w:?} is neither a whole number nor 'auto'"),
            )),
        }
    }
}

/// What `build` needs, all of it `Send`, so the files are opened with the GIL released.
struct Settings {
    paths: Vec<PathBuf>,
    batch_size: usize,
    shuffle: Option<u64>,
    workers: Option<SettingArg>,
    prefetch: Option<SettingArg>,
    batch_parts: Option<SettingArg>,
    /// Records a timeline (`trace=`).
    trace: Option<Trace>,
    drop_last: bool,
    shard: Option<(u64, u64)>,
    shard_env: bool,
    evaluation: bool,
    images: Option<ImageArgs>,
    fields: Option<Vec<String>>,
    epoch: u64,
    pool_budget: Option<u64>,
    /// The byte budget of every ragged field (`ragged_budget=N`).
    ragged_budget_each: Option<u64>,
    /// The byte budgets of ragged fields by name (`ragged_budget={name: N}`).
    ragged_budgets: Vec<(String, u64)>,
    /// Device loaders copy the indices as a field (host loaders add them in `batch_dict`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    indices: bool,
    /// A device's ordinal: device batches.
    device: Option<usize>,
    /// How a packed file or a `.npy` array is read (`read_mode=`; None: not given, a mapping).
    read_mode: Option<gpufeed::format::ReadMode>,
    /// Check each record against its checksum (`verify=True`).
    verify: bool,
    /// The split of a `DatasetDict` directory (`split=`).
    split: Option<String>,
    /// Values for the nulls of a table's fields (`fill=`).
    fill: std::collections::BTreeMap<String, gpufeed::source::table::Fill>,
}

/// One value of `fill=`: an int, a float, a str (its UTF-8 bytes) or bytes (`_loader.py` has
/// checked which).
pub(crate) struct FillArg(gpufeed::source::table::Fill);

impl<'py> FromPyObject<'_, 'py> for FillArg {
    type Error = PyErr;

    fn extract(value: pyo3::Borrowed<'_, 'py, PyAny>) -> PyResult<FillArg> {
        use gpufeed::source::table::Fill;
        if let Ok(i) = value.extract::<i64>() {
            return Ok(FillArg(Fill::Int(i)));
        }
        if let Ok(f) = value.extract::<f64>() {
            return Ok(FillArg(Fill::Float(f)));
        }
        if let Ok(s) = value.extract::<String>() {
            return Ok(FillArg(Fill::Bytes(s.into_bytes())));
        }
        Ok(FillArg(Fill::Bytes(value.extract::<Vec<u8>>()?)))
    }
}

impl Settings {
    /// The optional arguments not given: gpufeed chooses them.
    fn defaults(&self) -> Vec<&'static str> {
        let shard = self.shard.is_none() && !self.shard_env;
        [
            ("workers", self.workers.is_none()),
            ("prefetch", self.prefetch.is_none()),
            ("batch_parts", self.batch_parts.is_none()),
            ("pool_budget", self.pool_budget.is_none()),
            (
                "ragged_budget",
                self.ragged_budget_each.is_none() && self.ragged_budgets.is_empty(),
            ),
            ("shard", shard),
            ("images", self.images.is_none()),
            ("fields", self.fields.is_none()),
            ("device", self.device.is_none()),
        ]
        .into_iter()
        .filter_map(|(argument, default)| default.then_some(argument))
        .collect()
    }
}

/// A failure of a build that is the Python user's argument, named as typed.
pub(crate) enum BuildError {
    Library(Error),
    /// An invalid argument, and what is wrong with it.
    Argument(&'static str, String),
    /// What the call lacks, said plainly (`errors::config_said`), and the argument that
    /// gives it.
    Lacks(&'static str, String),
}

/// `ImageOptions`' defaults of the fields the image pipeline reads (`gpufeed/_loader.py`).
const DEFAULT_IMAGE_FIELD: &str = "image";
const DEFAULT_LABEL_FIELD: &str = "label";

impl From<Error> for BuildError {
    fn from(e: Error) -> Self {
        BuildError::Library(e)
    }
}

/// A build run with the GIL released (`py.detach`), panics caught: its loader, or the error as
/// the Python user's, for a call that left `defaults` to gpufeed.
pub(crate) fn built<T: Send>(
    py: Python<'_>,
    defaults: &[&'static str],
    build: impl FnOnce() -> Result<T, BuildError> + Send,
) -> PyResult<T> {
    match py.detach(|| catch(build)) {
        Ok(Ok(built)) => Ok(built),
        Ok(Err(e)) => Err(e.into_py(py, defaults)),
        Err(payload) => Err(errors::panicked(py, payload.as_ref())),
    }
}

impl BuildError {
    /// The Python user's error, for a call that left `defaults` to gpufeed.
    pub(crate) fn into_py(self, py: Python<'_>, defaults: &[&'static str]) -> PyErr {
        match self {
            BuildError::Library(e) => errors::to_py_with(py, &e, Defaults(defaults)),
            BuildError::Argument(arg, what) => errors::config(py, arg, what),
            BuildError::Lacks(arg, message) => errors::config_said(py, arg, message),
        }
    }
}

/// `read_mode=` as the library's mode: `"mmap"` or `"pread"` (`gpufeed/_loader.py` has
/// checked which).
pub(crate) fn read_mode_of(name: Option<&str>) -> Result<Option<ReadMode>, BuildError> {
    match name {
        None => Ok(None),
        Some("mmap") => Ok(Some(ReadMode::Map)),
        Some("pread") => Ok(Some(ReadMode::Pread)),
        Some(other) => Err(BuildError::Argument(
            "read_mode",
            format!("{other:?} is not 'mmap' or 'pread'"),
        )),
    }
}

/// The data set the arguments name, and the same as a sharded data set when it is one (for
/// its store's and open shards' figures).
type Opened = (Arc<dyn Dataset>, Option<Arc<dyn Source>>);

/// Opens the data set the arguments name through the library's front door (one name, or
/// several of one schema), read as `read_mode=` and `verify=` say; an ImageFolder only with
/// `images=` (its samples are encoded images).
fn open_dataset(s: &Settings) -> Result<Opened, BuildError> {
    let mut options = source::OpenOptions::read(ReadOptions {
        mode: s.read_mode.unwrap_or_default(),
        verify_checksums: s.verify,
    });
    // A table decodes only the columns batched.
    options.table.columns.clone_from(&s.fields);
    options.table.split.clone_from(&s.split);
    options.table.fill.clone_from(&s.fill);
    if s.paths.is_empty() {
        return Err(BuildError::Argument(
            "path_or_paths",
            "no file given".into(),
        ));
    }
    let opened: Arc<dyn Source> = Arc::from(source::open_all(&s.paths, &options)?);
    if opened.format() == Format::ImageFolder && s.images.is_none() {
        return Err(BuildError::Lacks(
            "images",
            format!(
                "{} is a directory of images (an ImageFolder), and images= was not given: pass images={{...}} to decode them, e.g. images={{'size': 224}}",
                s.paths[0].display()
            ),
        ));
    }
    Ok((Arc::clone(&opened) as Arc<dyn Dataset>, Some(opened)))
}

/// The fields named in the arguments must exist: say so naming the argument, with the
/// data set's fields.
fn check_names(s: &Settings, schema: &gpufeed::Schema) -> Result<(), BuildError> {
    let missing = |name: &str| schema.index_of(name).is_none();
    let fields = || {
        let names: Vec<&str> = schema.fields().iter().map(|f| f.name.as_str()).collect();
        format!("the data set's fields are {names:?}")
    };
    if let Some(names) = &s.fields
        && let Some(name) = names.iter().find(|n| missing(n))
    {
        return Err(BuildError::Argument(
            "fields",
            format!("no field `{name}`: {}", fields()),
        ));
    }
    if let Some(images) = &s.images {
        let image = images.image_field.as_str();
        if missing(image) && image == DEFAULT_IMAGE_FIELD {
            return Err(BuildError::Lacks(
                "images",
                format!(
                    "images= decodes the field `{image}` (image_field's default), which the data set does not have: {}; name the field of encoded images with images={{..., 'image_field': NAME}}",
                    fields()
                ),
            ));
        }
        if missing(image) {
            return Err(BuildError::Argument(
                "images['image_field']",
                format!("no field `{image}`: {}", fields()),
            ));
        }
        if let Some(label) = images.label_field.as_deref().filter(|l| missing(l)) {
            if label == DEFAULT_LABEL_FIELD {
                return Err(BuildError::Lacks(
                    "images",
                    format!(
                        "images= reads labels from the field `{label}` (label_field's default), which the data set does not have: {}; name it with images={{..., 'label_field': NAME}}, or 'label_field': None for unlabelled data",
                        fields()
                    ),
                ));
            }
            return Err(BuildError::Argument(
                "images['label_field']",
                format!(
                    "no field `{label}`: {}; use label_field=None for unlabelled data",
                    fields()
                ),
            ));
        }
    }
    Ok(())
}

/// Field names gpufeed keeps for its own arrays cannot be the data's: the fields picked
/// (`fields=`), or, without it, the data set's.
fn check_reserved(s: &Settings, loader: &Loader) -> Result<(), BuildError> {
    for f in loader.layout().fields() {
        if f.name != MASK_KEY && f.name != INDEX_KEY {
            continue;
        }
        if s.fields.is_some() {
            return Err(BuildError::Argument(
                "fields",
                format!(
                    "`{}` is a key gpufeed reserves for its own arrays; rename the field",
                    f.name
                ),
            ));
        }
        return Err(BuildError::Lacks(
            "fields",
            format!(
                "the data set has a field `{}`, a key gpufeed reserves for its own arrays: rename the field, or leave it out with fields=[...]",
                f.name
            ),
        ));
    }
    Ok(())
}

/// A loader built from the arguments, its image pipeline's figures (with `images=`), and its
/// data set when it is a sharded one.
struct Built {
    loader: Box<dyn Feed>,
    images: Option<Arc<ImageStats>>,
    source: Option<Arc<dyn Source>>,
}

fn build(mut s: Settings) -> Result<Built, BuildError> {
    let on_device = s.device.is_some();
    // The image options first: they are wrong whatever the data.
    if let Some(i) = &s.images {
        i.transform(on_device)?;
    }
    let (dataset, opened) = open_dataset(&s)?;
    if let Some(i) = s.images.as_mut() {
        i.take_fields_of(dataset.schema());
    }
    let transform = s
        .images
        .as_ref()
        .map(|i| i.transform(on_device))
        .transpose()?;
    check_names(&s, dataset.schema())?;
    if s.images.is_none() && s.fields.is_none() {
        // Encoded images are decoded with images=, not loaded as their bytes, unless fields=
        // names them (then they come as ragged uint8 fields, as any variable-size field).
        let schema = dataset.schema();
        let encoded = schema.fields().iter().find(|f| {
            matches!(
                f.kind,
                FieldKind::Bytes {
                    codec: Codec::Jpeg | Codec::Png
                }
            )
        });
        if let Some(f) = encoded {
            let others: Vec<&str> = schema
                .fields()
                .iter()
                .filter(|g| g.name != f.name)
                .map(|g| g.name.as_str())
                .collect();
            return Err(BuildError::Lacks(
                "images",
                format!(
                    "the data set's field `{}` holds encoded images, and images= was not given: pass images={{...}} to decode them, or fields=[...] to pick the fields to load ({others:?}; an encoded field named there arrives as its bytes, a ragged uint8 field)",
                    f.name
                ),
            ));
        }
    }
    let mut builder = Loader::builder_shared(dataset)
        .batch_size(s.batch_size)
        .drop_last(s.drop_last)
        .evaluation(s.evaluation)
        .epoch(s.epoch);
    if let Some(seed) = s.shuffle {
        builder = builder.shuffle(seed);
    }
    if let Some(w) = &s.workers {
        builder = builder.workers(w.setting("workers")?);
    }
    if let Some(p) = &s.prefetch {
        builder = builder.prefetch(p.setting("prefetch")?);
    }
    if let Some(p) = &s.batch_parts {
        builder = builder.batch_parts(p.setting("batch_parts")?);
    }
    if let Some(t) = &s.trace {
        builder = builder.trace(t);
    }
    if let Some(b) = s.pool_budget {
        builder = builder.pool_budget(b);
    }
    if let Some(b) = s.ragged_budget_each {
        builder = builder.ragged_budget_each(b);
    }
    for (name, b) in &s.ragged_budgets {
        builder = builder.ragged_budget(name.clone(), *b);
    }
    if s.shard_env {
        builder = builder.shard_from_env();
    } else if let Some((rank, world)) = s.shard {
        builder = builder.shard(rank, world);
    }
    let mut stats = None;
    if let Some(t) = transform {
        stats = Some(t.stats());
        // A GPU decode is decided before the loader is built (it lays out the batches).
        #[cfg(feature = "cuda")]
        if on_device && t.decode_mode() != gpufeed::transform::image::Decode::Cpu {
            t.decide_decode(gpufeed::cuda::nvjpeg::load().map(|_| ()))?;
        }
        builder = builder.transform(t);
    } else if let Some(names) = &s.fields {
        builder = builder.transform(CopyFields::named(names.iter().cloned()));
    }
    match s.device {
        None => {
            let loader = builder.build()?;
            check_reserved(&s, &loader)?;
            Ok(Built {
                loader: Box::new(loader),
                images: stats,
                source: opened,
            })
        }
        #[cfg(feature = "cuda")]
        Some(ordinal) => {
            let device = crate::dlpack::open_device(ordinal)?;
            let loader = builder
                .backing(gpufeed::cuda::PinnedBacking::new(&device))
                .build()?;
            check_reserved(&s, &loader)?;
            let mut opts = DeviceLoaderOptions::default();
            if let Some(c) = s.images.as_ref().map(ImageArgs::device_convert).transpose()? {
                opts.convert.extend(c);
            }
            if s.evaluation {
                opts = opts.mask(MASK_KEY);
            }
            if s.indices {
                opts = opts.indices(INDEX_KEY);
            }
            let loader = DeviceLoader::new(loader, &device, opts)?;
            Ok(Built {
                loader: Box::new(loader),
                images: stats,
                source: opened,
            })
        }
        #[cfg(not(feature = "cuda"))]
        Some(_) => Err(BuildError::Argument(
            "device",
            "this gpufeed was built without CUDA (the Python package's `cuda` feature): build it with `pip install ./python` (cuda is a default feature) to load batches to the GPU".into(),
        )),
    }
}

fn lock(core: &Mutex<Core>) -> MutexGuard<'_, Core> {
    // A panic while the lock was held left the loader as the library left it: go on.
    core.lock().unwrap_or_else(|p| p.into_inner())
}

impl LoaderCore {
    /// The error of a caller that holds every batch the budget allows, said as what it did
    /// (it passed no `pool_budget=`, maybe).
    fn budget_error(&self, py: Python<'_>, batches: usize, batch_bytes: usize) -> PyErr {
        let budget = if self.defaults.contains(&"pool_budget") {
            "gpufeed's default budget, prefetch + 2 batches: pool_budget= was not given"
        } else {
            "pool_budget="
        };
        let err = errors::config_said(
            py,
            "pool_budget",
            format!(
                "you hold {batches} batches, all that the pool's budget allows ({budget}; batches of {batch_bytes} bytes): drop one and iterate again, or raise pool_budget= (bytes)"
            ),
        );
        let note = "gpufeed: each tensor of a batch keeps the whole batch buffer; keep copies (tensor.clone(), numpy.array(a)) of what you keep across steps";
        // Python < 3.11 has no notes; the message says enough without one.
        let _ = err.value(py).call_method1("add_note", (note,));
        err
    }

    fn check_process(&self) -> PyResult<()> {
        if std::process::id() != self.pid {
            return Err(PyRuntimeError::new_err(format!(
                "this {} was made in process {} and cannot be used in process {} (a fork copies none of its threads): make the loader in the process that iterates it; with torch's DataLoader, use num_workers=0",
                self.class,
                self.pid,
                std::process::id()
            )));
        }
        Ok(())
    }

    /// Runs `f` on the loader (and the iterator's place) with the GIL released, catching
    /// panics.
    fn with_loader<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Place, &mut dyn Feed) -> gpufeed::Result<T> + Send,
    ) -> PyResult<T> {
        self.check_process()?;
        let caught: Caught<Option<gpufeed::Result<T>>> = py.detach(|| {
            catch(|| {
                let mut guard = lock(&self.core);
                let Core { loader, place } = &mut *guard;
                Some(f(place, loader.as_deref_mut()?))
            })
        });
        let defaults = Defaults(&self.defaults);
        match caught {
            Ok(None) => Err(PyRuntimeError::new_err(format!(
                "this {} is closed",
                self.class
            ))),
            Ok(Some(result)) => lift_with(py, Ok(result), defaults),
            Err(payload) => lift_with(py, Err(payload), defaults),
        }
    }

    /// Hands `taken` over: its dict, or, if that fails (a signal handler raised in the
    /// conversion, or a signal is pending once it is made), the error, with the batch kept
    /// for the next call (see the module docs).
    fn hand_over<'py>(
        &self,
        py: Python<'py>,
        taken: Taken,
        prior: Prior,
    ) -> PyResult<Bound<'py, PyDict>> {
        let made = match &taken {
            Taken::Host(held) => self.batch_dict(py, held),
            #[cfg(feature = "cuda")]
            Taken::Device(held) => self.device_batch_dict(py, held),
        }
        // A signal that came while the batch was waited for, or converted by C code (which
        // runs no handler), would otherwise raise right after this call returns, in the
        // caller's frame, before `b = next(it)` assigns the batch: run the handlers now,
        // while the batch can still be kept.
        .and_then(|dict| py.check_signals().map(|()| dict));
        if made.is_err() {
            // The loader closed meanwhile: nothing to keep it for.
            let _ = self.with_loader(py, move |place, _| {
                if place.positioned == prior.positioned {
                    place.pending = Some(taken);
                    place.handed = prior.handed;
                }
                Ok(())
            });
        }
        made
    }

    fn batch_dict<'py>(
        &self,
        py: Python<'py>,
        held: &Arc<HeldBatch>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let batch = held.batch();
        let mask = self.evaluation.then(|| batch.mask());
        let indices = self.indices.then(|| batch.indices());
        let len = batch.len() as i64;
        let dict = PyDict::new(py);
        for (k, name) in self.names.iter().enumerate() {
            let value = self.field_value(py, batch, k, |view| Array::batch_field(held, k, view))?;
            dict.set_item(name.bind(py), value)?;
        }
        if let Some(mask) = mask {
            let bytes: Vec<u8> = mask.iter().map(|&m| u8::from(m)).collect();
            let array = Bound::new(py, Array::owned(&bytes, DType::Bool, vec![len])?)?;
            dict.set_item(MASK_KEY, self.converted(py, array)?)?;
        }
        if let Some(indices) = indices {
            let bytes: Vec<u8> = indices
                .iter()
                .flat_map(|&i| (i as i64).to_le_bytes())
                .collect();
            let array = Bound::new(py, Array::owned(&bytes, DType::I64, vec![len])?)?;
            dict.set_item(INDEX_KEY, self.converted(py, array)?)?;
        }
        Ok(dict)
    }

    /// A device batch as a dict of CUDA arrays (the mask and indices are fields of it).
    #[cfg(feature = "cuda")]
    fn device_batch_dict<'py>(
        &self,
        py: Python<'py>,
        held: &Arc<crate::dlpack::HeldDeviceBatch>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let dict = PyDict::new(py);
        let info: &BatchInfo = held.batch();
        for (k, name) in self.names.iter().enumerate() {
            let value = self.field_value(py, info, k, |view| Array::device_field(held, k, view))?;
            dict.set_item(name.bind(py), value)?;
        }
        Ok(dict)
    }

    /// Field `k` of the batch `info` as the batch dict holds it (see [`Arrives`]): its array,
    /// for a ragged field `(values, offsets)` or a list of one array per sample, or its
    /// counted entries; `view` makes the arrays (in place).
    fn field_value<'py>(
        &self,
        py: Python<'py>,
        info: &BatchInfo,
        k: usize,
        view: impl Fn(View) -> PyResult<Array>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let array = |v: View| -> PyResult<Bound<'py, PyAny>> {
            self.converted(py, Bound::new(py, view(v)?)?)
        };
        match self.arrives.get(k).copied().unwrap_or(Arrives::Whole) {
            Arrives::Whole => return array(View::Field),
            Arrives::Sequences => {
                return match info.tokens() {
                    Some(t) => array(View::Leading(t.sequences as usize + 1)),
                    None => array(View::Field),
                };
            }
            Arrives::Ragged => {}
        }
        if self.ragged_list {
            let items = (0..info.len())
                .map(|i| array(View::Sample(i)))
                .collect::<PyResult<Vec<_>>>()?;
            return Ok(PyList::new(py, items)?.into_any());
        }
        Ok(PyTuple::new(py, [array(View::Field)?, array(View::Offsets)?])?.into_any())
    }

    fn converted<'py>(
        &self,
        py: Python<'py>,
        array: Bound<'py, Array>,
    ) -> PyResult<Bound<'py, PyAny>> {
        match &self.convert {
            Some(f) => f.bind(py).call1((array,)),
            None => Ok(array.into_any()),
        }
    }
}

/// What a [`LoaderCore`] holds beside its loader: how batches are handed over, and what its
/// messages and figures say.
pub(crate) struct Around {
    /// The Python class served (`gpufeed.Loader`), for messages.
    pub class: &'static str,
    /// Makes each array the user's (`torch.from_dlpack`), or None for `gpufeed.Array`s.
    pub convert: Option<Py<PyAny>>,
    /// Adds the padding mask (`MASK_KEY`) to host batches.
    pub evaluation: bool,
    /// Adds the sample indices (`INDEX_KEY`) to host batches.
    pub indices: bool,
    /// Ragged fields as a list of one array per sample.
    pub ragged_list: bool,
    /// The image pipeline's figures, with `images=`.
    pub images: Option<Arc<ImageStats>>,
    /// The data set as opened (`stats()["cache"]`, `["store"]`, `["shards"]`).
    pub source: Option<Arc<dyn Source>>,
    /// The device's ordinal for device loaders.
    pub device: Option<usize>,
    /// The arguments left to gpufeed's defaults (see `errors::Defaults`).
    pub defaults: Vec<&'static str>,
    /// The timeline being recorded and the file it is written to.
    pub trace: Option<(Trace, PathBuf)>,
    /// The field handed out as its batch's counted sequences (see [`Arrives::Sequences`]).
    pub sequences: Option<&'static str>,
}

impl LoaderCore {
    /// The core of a built `loader`: the Python iterator over its batches.
    pub(crate) fn around(py: Python<'_>, loader: Box<dyn Feed>, a: Around) -> LoaderCore {
        // Every field of the batches, in order (device batches: the mask and indices last).
        let all = loader.fields();
        let names = all
            .iter()
            .map(|f| PyString::intern(py, &f.name).unbind())
            .collect();
        let arrives = all
            .iter()
            .map(|f| {
                if f.ragged {
                    Arrives::Ragged
                } else if a.sequences == Some(f.name.as_str()) {
                    Arrives::Sequences
                } else {
                    Arrives::Whole
                }
            })
            .collect();
        let fields = all
            .into_iter()
            .filter(|f| f.name != MASK_KEY && f.name != INDEX_KEY)
            .collect();
        LoaderCore {
            core: Mutex::new(Core {
                loader: Some(loader),
                place: Place {
                    fresh: true,
                    ..Place::default()
                },
            }),
            class: a.class,
            names,
            arrives,
            ragged_list: a.ragged_list,
            fields,
            convert: a.convert,
            evaluation: a.evaluation,
            indices: a.indices,
            images: a.images,
            source: a.source,
            device: a.device,
            pid: std::process::id(),
            defaults: a.defaults,
            trace: a.trace,
        }
    }
}

#[pymethods]
impl LoaderCore {
    #[new]
    #[pyo3(signature = (
        paths, *, batch_size, shuffle, workers, prefetch, batch_parts, drop_last, shard, shard_env,
        evaluation, images, fields, epoch, pool_budget, indices, convert, device=None,
        ragged_budget_each=None, ragged_budgets=None, ragged_list=false, trace=None,
        read_mode=None, verify=false, split=None, fill=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        paths: Vec<PathBuf>,
        batch_size: usize,
        shuffle: Option<u64>,
        workers: Option<SettingArg>,
        prefetch: Option<SettingArg>,
        batch_parts: Option<SettingArg>,
        drop_last: bool,
        shard: Option<(u64, u64)>,
        shard_env: bool,
        evaluation: bool,
        images: Option<&Bound<'_, PyDict>>,
        fields: Option<Vec<String>>,
        epoch: u64,
        pool_budget: Option<u64>,
        indices: bool,
        convert: Option<Py<PyAny>>,
        device: Option<usize>,
        ragged_budget_each: Option<u64>,
        ragged_budgets: Option<Vec<(String, u64)>>,
        ragged_list: bool,
        trace: Option<PathBuf>,
        read_mode: Option<&str>,
        verify: bool,
        split: Option<String>,
        fill: Option<Vec<(String, FillArg)>>,
    ) -> PyResult<LoaderCore> {
        let images = images.map(|d| d.extract::<ImageArgs>()).transpose()?;
        let read_mode = read_mode_of(read_mode).map_err(|e| e.into_py(py, &[]))?;
        let timeline = trace.map(|path| (Trace::new(), path));
        let settings = Settings {
            paths,
            batch_size,
            shuffle,
            workers,
            prefetch,
            batch_parts,
            trace: timeline.as_ref().map(|(t, _)| t.clone()),
            drop_last,
            shard,
            shard_env,
            evaluation,
            images,
            fields,
            epoch,
            pool_budget,
            ragged_budget_each,
            ragged_budgets: ragged_budgets.unwrap_or_default(),
            indices,
            device,
            read_mode,
            verify,
            split,
            fill: fill
                .unwrap_or_default()
                .into_iter()
                .map(|(name, value)| (name, value.0))
                .collect(),
        };
        let defaults = settings.defaults();
        let b = built(py, &defaults, || build(settings))?;
        Ok(LoaderCore::around(
            py,
            b.loader,
            Around {
                class: "gpufeed.Loader",
                convert,
                evaluation,
                indices,
                ragged_list,
                images: b.images,
                source: b.source,
                device,
                defaults,
                trace: timeline,
                sequences: None,
            },
        ))
    }

    /// Applies the epoch rule of `for` loops and returns the iterator (this object).
    fn iter_epoch(slf: Bound<'_, Self>) -> PyResult<Bound<'_, Self>> {
        let py = slf.py();
        slf.get().with_loader(py, |place, loader| {
            if !place.fresh && place.state(loader).next_batch >= loader.batches_per_epoch() {
                place.reposition();
                loader.next_epoch();
            }
            place.fresh = false;
            Ok(())
        })?;
        Ok(slf)
    }

    fn __iter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        loop {
            let (next, prior) = self.with_loader(py, |place, loader| {
                place.fresh = false;
                let prior = place.prior();
                let next = match place.pending.take() {
                    Some(kept) => Next::Batch(kept),
                    None => loader.next_timeout(POLL),
                };
                // Handed over, unless `hand_over` fails and puts `prior` back.
                place.handed |= matches!(next, Next::Batch(_));
                Ok((next, prior))
            })?;
            let taken = match next {
                Next::Batch(taken) => taken,
                Next::Budget {
                    batches,
                    batch_bytes,
                } => return Err(self.budget_error(py, batches, batch_bytes)),
                Next::Failed(e) => {
                    return Err(errors::to_py_with(py, &e, Defaults(&self.defaults)));
                }
                Next::End => return Ok(None),
                Next::Pending => {
                    py.check_signals()?;
                    continue;
                }
            };
            return self.hand_over(py, taken, prior).map(Some);
        }
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        self.with_loader(py, |_, l| Ok(l.batches_per_epoch() as usize))
    }

    fn set_epoch(&self, py: Python<'_>, epoch: u64) -> PyResult<()> {
        self.with_loader(py, |place, l| {
            place.fresh = true;
            // A batch kept before any was handed over since the position was set: the loader
            // keeps its position for a `set_epoch` of its epoch then, so keep the batch too.
            if place.pending.is_some() && !place.handed && epoch == l.epoch() {
                return Ok(());
            }
            place.reposition();
            l.set_epoch(epoch);
            Ok(())
        })
    }

    fn state_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let state = self.with_loader(py, |place, l| Ok(place.state(l)))?;
        let json = serde_json::to_value(&state).map_err(|e| {
            PyRuntimeError::new_err(format!("cannot encode the loader's state: {e}"))
        })?;
        value::to_python(py, &json)
    }

    fn load_state_dict(&self, py: Python<'_>, state: &Bound<'_, PyAny>) -> PyResult<()> {
        let json = value::from_python(state, "state_dict")?;
        let state: LoaderState = serde_json::from_value(json).map_err(|e| {
            errors::config(py, "state_dict", format!("not a gpufeed loader state: {e}"))
        })?;
        let result = self.with_loader(py, |place, l| {
            l.load_state(state)?;
            place.reposition();
            place.fresh = true;
            Ok(())
        });
        // A state of other order settings is a bad argument, named as such.
        result.map_err(|e| {
            let is_mismatch = e
                .value(py)
                .getattr("kind")
                .and_then(|k| k.extract::<String>())
                .is_ok_and(|k| k == "mismatch");
            if is_mismatch {
                errors::config(py, "state_dict", e.value(py).to_string())
            } else {
                e
            }
        })
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (figures, tokens) =
            self.with_loader(py, |_, l| Ok((l.figures(), l.token_figures())))?;
        let d = match figures {
            Figures::Host(s) => self.host_stats(py, &s)?,
            #[cfg(feature = "cuda")]
            Figures::Device(s, name) => self.device_stats(py, *s, name)?,
        };
        if let Some(t) = tokens {
            d.set_item("tokens", token_figures(py, &t)?)?;
        }
        self.shard_figures(py, &d)?;
        Ok(d)
    }

    /// Writes the timeline recorded so far (`trace=`) to `path`, or to the file `trace=`
    /// named; returns the file written.
    #[pyo3(signature = (path=None))]
    fn write_trace(&self, py: Python<'_>, path: Option<PathBuf>) -> PyResult<PathBuf> {
        let Some((trace, named)) = &self.trace else {
            return Err(errors::config(
                py,
                "trace",
                "this loader records no timeline: pass trace=\"FILE.json\" when making it"
                    .to_owned(),
            ));
        };
        let path = path.unwrap_or_else(|| named.clone());
        py.detach(|| trace.write(&path))
            .map_err(|e| errors::to_py_with(py, &e, Defaults(&self.defaults)))?;
        Ok(path)
    }

    /// The epoch being delivered.
    #[getter]
    fn epoch(&self, py: Python<'_>) -> PyResult<u64> {
        self.with_loader(py, |_, l| Ok(l.epoch()))
    }

    /// Batches delivered in this epoch.
    #[getter]
    fn position(&self, py: Python<'_>) -> PyResult<u64> {
        self.with_loader(py, |place, l| Ok(place.state(l).next_batch))
    }

    /// (rank, world size, samples in the data set, batch size).
    #[getter]
    fn order(&self, py: Python<'_>) -> PyResult<(u64, u64, u64, u64)> {
        self.with_loader(py, |_, l| {
            let s = l.order_spec();
            Ok((s.rank, s.world, s.len, s.batch_size))
        })
    }

    /// The device's ordinal, or None for host batches.
    #[getter]
    fn device(&self) -> Option<usize> {
        self.device
    }

    /// Each field's (name, dtype, per-sample shape, ragged): a ragged field's shape is that of
    /// one item.
    #[getter]
    fn fields<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let items: Vec<(String, &'static str, Vec<usize>, bool)> = self
            .fields
            .iter()
            .map(|f| {
                (
                    f.name.clone(),
                    dtype_name(f.dtype),
                    f.shape.clone(),
                    f.ragged,
                )
            })
            .collect();
        PyList::new(py, items)
    }

    /// Stops the worker threads and frees the pool's cached buffers; batches still held stay
    /// valid. Later calls raise. With `trace=`, writes the timeline once the threads stopped.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.check_process()?;
        // Taken under the lock, dropped after it: other threads find the loader closed at
        // once instead of waiting for its workers to stop.
        let loader = py.detach(|| {
            let mut core = lock(&self.core);
            core.place.reposition();
            core.loader.take()
        });
        let stopped = loader.is_some();
        stop(py, loader)?;
        if stopped && self.trace.is_some() {
            self.write_trace(py, None)?;
        }
        Ok(())
    }
}

/// The host loader's worker figures into `d`: workers, batches in flight and ready, time per
/// stage, the (pinned, on a device loader) host pool.
fn host_figures(py: Python<'_>, d: &Bound<'_, PyDict>, s: &gpufeed::LoaderStats) -> PyResult<()> {
    d.set_item("workers", s.workers)?;
    let tuning = match &s.tuning {
        Some(t) => {
            let json = serde_json::to_value(t)
                .map_err(|e| PyRuntimeError::new_err(format!("the tuning's figures: {e}")))?;
            Some(value::to_python(py, &json)?)
        }
        None => None,
    };
    d.set_item("tuning", tuning)?;
    d.set_item("in_flight", s.in_flight)?;
    d.set_item("ready", s.ready)?;
    let stages = PyDict::new(py);
    stages.set_item("fetch_s", s.stages.fetch.as_secs_f64())?;
    stages.set_item("transform_s", s.stages.transform.as_secs_f64())?;
    stages.set_item("collate_s", s.stages.collate.as_secs_f64())?;
    stages.set_item("batches_made", s.stages.batches_made)?;
    d.set_item("stages", stages)?;
    d.set_item("pool", pool_figures(py, &s.pool)?)?;
    Ok(())
}

/// A pool's figures as a dict.
fn pool_figures<'py>(
    py: Python<'py>,
    p: &gpufeed::memory::PoolStats,
) -> PyResult<Bound<'py, PyDict>> {
    let pool = PyDict::new(py);
    pool.set_item("allocated_bytes", p.allocated_bytes)?;
    pool.set_item("reserved_bytes", p.reserved_bytes)?;
    pool.set_item("peak_allocated_bytes", p.peak_allocated_bytes)?;
    pool.set_item("peak_reserved_bytes", p.peak_reserved_bytes)?;
    pool.set_item("budget_bytes", p.budget_bytes)?;
    pool.set_item("allocations", p.allocations)?;
    pool.set_item("reuses", p.reuses)?;
    pool.set_item("evictions", p.evictions)?;
    pool.set_item("waits", p.waits)?;
    pool.set_item("pending_blocks", p.pending_blocks)?;
    Ok(pool)
}

/// A token loader's figures as a dict (`stats()["tokens"]`).
fn token_figures<'py>(py: Python<'py>, t: &TokenStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("batches", t.batches)?;
    d.set_item("rows", t.rows)?;
    d.set_item("tokens", t.tokens)?;
    d.set_item("padding", t.padding)?;
    d.set_item("padding_fraction", t.padding_fraction())?;
    d.set_item("rows_per_source", t.rows_per_source.clone())?;
    d.set_item("shares", t.shares())?;
    Ok(d)
}

impl LoaderCore {
    /// A host loader's figures.
    fn host_stats<'py>(
        &self,
        py: Python<'py>,
        s: &gpufeed::LoaderStats,
    ) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("batches", s.batches)?;
        d.set_item("samples", s.samples)?;
        d.set_item("bytes", s.bytes)?;
        d.set_item("elapsed_s", s.elapsed.as_secs_f64())?;
        d.set_item("waited_s", s.waited.as_secs_f64())?;
        d.set_item("wait_fraction", s.wait_fraction())?;
        d.set_item("samples_per_s", s.samples_per_sec())?;
        d.set_item("bytes_per_s", s.bytes_per_sec())?;
        d.set_item("first_batch_s", s.first_batch.map(|f| f.as_secs_f64()))?;
        host_figures(py, &d, s)?;
        self.image_figures(py, &d, s.skipped)?;
        d.set_item("verdict", s.verdict().to_string())?;
        d.set_item("text", s.to_string())?;
        Ok(d)
    }

    /// The data set's own figures into `d`: `cache`, what a table's shared cache of decoded
    /// chunks did (Parquet; None for others); for a sharded data set, `shards`, what its set
    /// of open shards did, and `store`, what its store fetched and cached (from a URL; the
    /// command's `store:` line, which `text` then ends with too). Both None for other data
    /// sets, `store` for local shards.
    fn shard_figures(&self, py: Python<'_>, d: &Bound<'_, PyDict>) -> PyResult<()> {
        match self.source.as_ref().and_then(|s| s.chunk_cache()) {
            Some(c) => {
                let cache = PyDict::new(py);
                cache.set_item("hits", c.hits)?;
                cache.set_item("decodes", c.misses)?;
                cache.set_item("decoded_ahead", c.decoded_ahead)?;
                cache.set_item("evictions", c.evictions)?;
                cache.set_item("chunks", c.chunks)?;
                cache.set_item("bytes", c.bytes)?;
                cache.set_item("peak_bytes", c.peak_bytes)?;
                cache.set_item("limit_bytes", c.limit_bytes)?;
                d.set_item("cache", cache)?;
            }
            None => d.set_item("cache", py.None())?,
        }
        let Some(sharded) = self.source.as_ref().and_then(|s| s.sharded()) else {
            d.set_item("shards", py.None())?;
            d.set_item("store", py.None())?;
            return Ok(());
        };
        let open = sharded.open_stats();
        let shards = PyDict::new(py);
        shards.set_item("count", sharded.shard_names().len())?;
        shards.set_item("opens", open.opens)?;
        shards.set_item("evictions", open.evictions)?;
        shards.set_item("open_now", open.open_now)?;
        shards.set_item("open_limit", open.limit)?;
        d.set_item("shards", shards)?;
        match sharded.store_stats() {
            Some(store) => {
                let json = serde_json::to_value(store)
                    .map_err(|e| PyRuntimeError::new_err(format!("the store's figures: {e}")))?;
                d.set_item("store", value::to_python(py, &json)?)?;
                let text: String = d
                    .get_item("text")?
                    .map_or(Ok(String::new()), |t| t.extract())?;
                d.set_item("text", format!("{}\nstore: {store}", text.trim_end()))?;
            }
            None => d.set_item("store", py.None())?,
        }
        Ok(())
    }

    /// The image pipeline's figures into `d` (with `images=`): `skipped` counts the images
    /// skipped in the batches delivered (`skipped`, the loader's), `decoded` and
    /// `last_skipped` what the workers did, batches made ahead included.
    fn image_figures(&self, py: Python<'_>, d: &Bound<'_, PyDict>, skipped: u64) -> PyResult<()> {
        if let Some(images) = &self.images {
            let i = PyDict::new(py);
            i.set_item("decoded", images.decoded())?;
            i.set_item("skipped", skipped)?;
            i.set_item(
                "last_skipped",
                images.map_last_skipped(errors::python_message),
            )?;
            d.set_item("images", i)?;
        }
        Ok(())
    }

    /// A device loader's figures: the consumer's (as the host path's, same keys), the host
    /// loader's as the copy thread sees them, and `device`: the copy stage and the device pool.
    #[cfg(feature = "cuda")]
    fn device_stats<'py>(
        &self,
        py: Python<'py>,
        s: gpufeed::cuda::DeviceStats,
        name: String,
    ) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let elapsed = s.elapsed.as_secs_f64();
        d.set_item("batches", s.batches)?;
        d.set_item("samples", s.samples)?;
        d.set_item("bytes", s.bytes)?;
        d.set_item("elapsed_s", elapsed)?;
        d.set_item("waited_s", s.waited.as_secs_f64())?;
        d.set_item("wait_fraction", s.wait_fraction())?;
        let per_sec = |n: u64| {
            if elapsed > 0.0 {
                n as f64 / elapsed
            } else {
                0.0
            }
        };
        d.set_item("samples_per_s", per_sec(s.samples))?;
        d.set_item("bytes_per_s", s.bytes_per_sec())?;
        if let Some(host) = &s.loader {
            d.set_item("first_batch_s", host.first_batch.map(|f| f.as_secs_f64()))?;
            host_figures(py, &d, host)?;
        }
        let dev = PyDict::new(py);
        dev.set_item("ordinal", self.device)?;
        dev.set_item("name", name)?;
        dev.set_item("h2d_bytes", s.h2d_bytes)?;
        dev.set_item("h2d_copies", s.h2d_copies)?;
        dev.set_item("h2d_busy_s", s.h2d_busy.as_secs_f64())?;
        dev.set_item("h2d_bytes_per_s", s.h2d_bytes_per_sec())?;
        dev.set_item("pool", pool_figures(py, &s.device_pool)?)?;
        dev.set_item("leaked_buffers", s.device_leaked)?;
        dev.set_item("reserved_bytes_all_pools", gpufeed::cuda::reserved_bytes())?;
        d.set_item("device", dev)?;
        self.image_figures(py, &d, s.skipped)?;
        d.set_item("verdict", s.verdict().map(|v| v.to_string()))?;
        d.set_item("text", s.to_string())?;
        Ok(d)
    }
}

/// Drops `loader` with the GIL released, since its workers may take a while to stop (up to
/// [`gpufeed::loader::SHUTDOWN_WAIT`] for one stuck in a read that does not return), and warns
/// (`RuntimeWarning`) if it left any running.
fn stop(py: Python<'_>, loader: Option<Box<dyn Feed>>) -> PyResult<()> {
    if loader.is_none() {
        return Ok(());
    }
    let before = gpufeed::loader::detached_workers();
    let caught = py.detach(|| catch(|| drop(loader)));
    caught.map_err(|payload| errors::panicked(py, payload.as_ref()))?;
    let detached = gpufeed::loader::detached_workers().saturating_sub(before);
    if detached == 0 {
        return Ok(());
    }
    let message = format!(
        "gpufeed: {detached} worker thread(s) of the loader did not stop within {} s (stuck in a read that does not return: a named pipe, a hung network file system?); they are left running and end when their read returns",
        gpufeed::loader::SHUTDOWN_WAIT.as_secs_f64()
    );
    let message = std::ffi::CString::new(message).unwrap_or_default();
    PyErr::warn(
        py,
        &py.get_type::<pyo3::exceptions::PyRuntimeWarning>(),
        &message,
        1,
    )
}

impl Drop for LoaderCore {
    fn drop(&mut self) {
        let core = self.core.get_mut().unwrap_or_else(|p| p.into_inner());
        if std::process::id() != self.pid {
            // A forked child: the worker threads are not in this process, so joining them
            // would wait forever. The parent's loader is untouched; leak the copy.
            std::mem::forget(core.loader.take());
            return;
        }
        let loader = core.loader.take();
        // `del loader` (the last reference) runs this with the GIL held: `stop` releases it
        // while the workers stop. An error (a warning that `-W error` makes one) cannot be
        // raised from a deallocation: it is reported as unraisable. Were this thread not
        // attached to Python, the closure, and the loader in it, would just be dropped.
        let stopped = loader.is_some();
        Python::try_attach(|py| {
            if let Err(e) = stop(py, loader) {
                e.write_unraisable(py, None);
            }
            // A loader with `trace=` not closed: its timeline is written now.
            if stopped
                && self.trace.is_some()
                && let Err(e) = self.write_trace(py, None)
            {
                e.write_unraisable(py, None);
            }
        });
    }
}

/// (batches, own blocks) alive: for leak checks.
#[pyfunction]
pub fn _live() -> (u64, u64) {
    crate::dlpack::live_counts()
}

/// (device bytes all of gpufeed's device pools hold, device buffers leaked), after waiting for
/// the pools let go of so far to be dropped (`gpufeed::cuda::settle`): for leak checks. Zeros
/// without the `cuda` feature.
#[pyfunction]
pub fn _device_memory(py: Python<'_>) -> (u64, u64) {
    #[cfg(feature = "cuda")]
    {
        py.detach(gpufeed::cuda::settle);
        (
            gpufeed::cuda::reserved_bytes(),
            gpufeed::cuda::leaked_buffers(),
        )
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = py;
        (0, 0)
    }
}
