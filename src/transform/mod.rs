//! Per-sample work: what turns one [`Sample`] into its slots of a batch.
//!
//! A [`SampleTransform`] declares the batch fields it writes ([`OutputField`]s) once, when the
//! loader is built, then writes each sample straight into its slots ([`Slots`]) of the batch
//! buffer: no intermediate copy, no allocation per sample. [`CopyFields`] (the default) copies
//! tensor fields as they are stored; [`FnTransform`] wraps a closure.
//!
//! Randomness comes from [`SampleContext::rng`], a pure function of (seed, epoch, sample index):
//! the same augmentation for a sample whichever worker runs it, on any number of workers, and
//! after a resume.
//!
//! [`image`] holds the image pipeline: JPEG/PNG decode, torchvision's crops, flips,
//! normalisation, as one [`ImageTransform`](image::ImageTransform).

pub mod image;

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::format::{DType, FieldKind, Schema};
use crate::loader::{Element, cast_slice_mut};
use crate::source::Sample;

/// One field of a batch: every sample of the batch has this dtype and shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct OutputField {
    /// The field's name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape of one sample (the batch adds a leading dimension).
    pub shape: Vec<usize>,
}

impl OutputField {
    /// A field called `name` of `dtype` and per-sample `shape`.
    pub fn new(name: impl Into<String>, dtype: DType, shape: &[usize]) -> OutputField {
        OutputField {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
        }
    }

    /// The output field that holds tensor field `name` of `input` as it is stored: the same
    /// name, dtype and shape. For transforms whose output follows their input (see
    /// [`FnTransform::with_output`]); a field that is not in `input`, or holds variable-size
    /// bytes, is an [`Error::Mismatch`] naming it.
    pub fn like(input: &Schema, name: &str) -> Result<OutputField> {
        let field = input
            .index_of(name)
            .map(|k| &input.fields()[k])
            .ok_or_else(|| {
                Error::mismatch(format!(
                    "no field `{name}` in the dataset's schema [{input}]"
                ))
            })?;
        match &field.kind {
            FieldKind::Tensor { dtype, shape } => Ok(OutputField {
                name: field.name.clone(),
                dtype: *dtype,
                shape: shape.iter().map(|&d| d as usize).collect(),
            }),
            FieldKind::Bytes { codec } => Err(Error::mismatch(format!(
                "field `{name}` holds variable-size {} bytes, which have no fixed shape to copy",
                codec.name()
            ))),
        }
    }

    /// Bytes one sample of this field takes.
    pub fn sample_bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

/// Where a sample stands when it is transformed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SampleContext {
    /// The sample's index in the dataset.
    pub index: u64,
    /// Its position within the batch.
    pub position: usize,
    /// The batch's number within the epoch (for this rank).
    pub batch: u64,
    /// The epoch.
    pub epoch: u64,
    /// The loader's seed.
    pub seed: u64,
}

impl SampleContext {
    /// A random generator that depends only on (seed, epoch, sample index).
    pub fn rng(&self) -> SampleRng {
        SampleRng::new(self.seed, self.epoch, self.index)
    }
}

/// A small, fast, deterministic random generator (SplitMix64), seeded per sample.
#[derive(Clone, Debug)]
pub struct SampleRng {
    state: u64,
}

impl SampleRng {
    /// The generator of sample `index` in `epoch` under `seed`.
    pub fn new(seed: u64, epoch: u64, index: u64) -> SampleRng {
        let mut s = SampleRng {
            state: seed ^ 0x9e37_79b9_7f4a_7c15,
        };
        let a = s.next_u64();
        let mut s = SampleRng {
            state: a ^ epoch.wrapping_mul(0xbf58_476d_1ce4_e5b9),
        };
        let b = s.next_u64();
        SampleRng {
            state: b ^ index.wrapping_mul(0x94d0_49bb_1331_11eb),
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A uniform number in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// A uniform number in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.next_f64()
    }

    /// A uniform whole number in `[0, n)` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}

/// The slots of one sample in a batch buffer: one byte slice per output field.
///
/// A transform finds its slots by name and type with [`Slots::field_mut`] (or by position, as
/// bytes, with [`Slots::field`]), and must write every byte of each: batch buffers are reused,
/// so a byte left unwritten holds whatever an earlier batch put there. Two checks catch a
/// transform that does not:
///
/// - in every build, a field whose slot the transform never asked for (with
///   [`field`](Slots::field) or [`field_mut`](Slots::field_mut)) fails the sample, with an
///   error naming the field (and, through [`Error::Sample`], the sample and its batch);
/// - in debug builds (`debug_assertions`), every slot is filled with a marker pattern before
///   the transform runs, and a run of 8 bytes of the marker anywhere in a slot, or of 4 at
///   its end, still there afterwards fails the sample the same way, naming the field and the
///   bytes left unwritten. The marker is no value ordinary data holds (as `f32` it is a NaN
///   with a payload), so a false alarm needs data that repeats it byte for byte; slots of
///   fewer than 4 bytes (scalar `u8` or `u16` labels), and fewer than 8 bytes left unwritten
///   in the middle of a slot, are covered by the first check only.
///
/// A sample marked skipped ([`mark_skipped`](Slots::mark_skipped)) is not checked: its slots
/// are placeholders that the training loop masks.
///
/// # Example
///
/// A transform that turns a `u8` image into `f32` in `[0, 1]` and copies its label:
///
/// ```
/// use gpufeed::{DType, FnTransform, OutputField, Sample, SampleContext, Slots};
///
/// let transform = FnTransform::new(
///     vec![
///         OutputField::new("image", DType::F32, &[3, 8, 8]),
///         OutputField::new("label", DType::U32, &[]),
///     ],
///     |sample: Sample<'_>, _: &SampleContext, slots: &mut Slots<'_>| {
///         let pixels = sample.field_as::<u8>("image")?;
///         for (out, &p) in slots.field_mut::<f32>("image")?.iter_mut().zip(pixels.iter()) {
///             *out = f32::from(p) / 255.0;
///         }
///         let label = sample.field_as::<u32>("label")?;
///         slots.field_mut::<u32>("label")?.copy_from_slice(&label);
///         Ok(())
///     },
/// );
/// # let _ = transform;
/// ```
pub struct Slots<'a> {
    buffer: BatchBytes<'a>,
    fields: &'a [OutputField],
    slots: &'a [FieldSlot],
    position: usize,
    skipped: bool,
    /// Per field, whether the transform asked for its slot.
    touched: &'a mut [bool],
}

/// Where one output field lives in a batch buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct FieldSlot {
    pub offset: usize,
    pub sample_bytes: usize,
}

/// The marker written into every slot before a transform runs, in debug builds: byte `i` of a
/// slot is `MARKER[i % 8]`. Not a value typical data repeats (no run of equal bytes, no small
/// integer, a NaN as `f32`).
const MARKER: [u8; 8] = [0xa7, 0x3c, 0xe1, 0xff, 0x96, 0x0d, 0xf4, 0x7f];

/// The bytes of one batch buffer, as the workers that write its samples see it: a pointer and
/// a length, valid for `'a`. Copies can be on several threads at once because each [`Slots`]
/// made from it reads and writes only the slots of its own sample position (field `k`'s slot of
/// position `p` is `offset[k] + p * sample_bytes[k] ..`, and fields do not overlap), and the
/// loader gives each position to one worker.
#[derive(Clone, Copy)]
pub(crate) struct BatchBytes<'a> {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
    _buffer: std::marker::PhantomData<&'a mut [u8]>,
}

// SAFETY: a `BatchBytes` is a pointer into a batch buffer; the threads that hold copies write
// disjoint bytes of it (the contract of `Slots::for_position`), so sharing or sending it is no
// more than sharing disjoint `&mut [u8]`s, which are `Send` and `Sync`.
unsafe impl Send for BatchBytes<'_> {}
// SAFETY: as above.
unsafe impl Sync for BatchBytes<'_> {}

impl<'a> BatchBytes<'a> {
    /// The bytes of `buffer`, borrowed for `'a`.
    pub(crate) fn new(buffer: &'a mut [u8]) -> BatchBytes<'a> {
        BatchBytes {
            // A slice's pointer is never null (dangling but aligned when empty).
            ptr: std::ptr::NonNull::from(&mut *buffer).cast::<u8>(),
            len: buffer.len(),
            _buffer: std::marker::PhantomData,
        }
    }

    /// The `len` bytes at `ptr`.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be valid for reads and writes for `'a`, and nothing may read or
    /// write those bytes during `'a` except through copies of this value.
    pub(crate) unsafe fn from_raw(ptr: std::ptr::NonNull<u8>, len: usize) -> BatchBytes<'a> {
        BatchBytes {
            ptr,
            len,
            _buffer: std::marker::PhantomData,
        }
    }
}

impl<'a> Slots<'a> {
    /// The slots of sample `position` of a batch laid out as `fields` and `slots` say;
    /// `touched` (one entry per field) is scratch space, reset here.
    #[cfg(test)]
    pub(crate) fn new(
        buffer: &'a mut [u8],
        fields: &'a [OutputField],
        slots: &'a [FieldSlot],
        position: usize,
        touched: &'a mut [bool],
    ) -> Slots<'a> {
        // SAFETY: `buffer` is borrowed exclusively for `'a`, so this is the only `Slots` on it.
        unsafe { Slots::for_position(BatchBytes::new(buffer), fields, slots, position, touched) }
    }

    /// Like [`new`](Self::new), on a buffer whose other samples other threads may be writing.
    ///
    /// # Safety
    /// While this `Slots` lives, no other `Slots` of the same `position` on `buffer` may exist
    /// (each worker writes positions no other worker writes), and `slots` must be the layout
    /// the buffer was laid out with, so that positions' slots do not overlap.
    pub(crate) unsafe fn for_position(
        buffer: BatchBytes<'a>,
        fields: &'a [OutputField],
        slots: &'a [FieldSlot],
        position: usize,
        touched: &'a mut [bool],
    ) -> Slots<'a> {
        debug_assert_eq!(fields.len(), slots.len());
        debug_assert_eq!(touched.len(), slots.len());
        touched.fill(false);
        Slots {
            buffer,
            fields,
            slots,
            position,
            skipped: false,
            touched,
        }
    }

    /// This sample's bytes of `range` (inside the buffer: `range` checks that).
    fn bytes_mut(&mut self, range: std::ops::Range<usize>) -> &mut [u8] {
        debug_assert!(range.start <= range.end && range.end <= self.buffer.len);
        // SAFETY: `range` lies inside the buffer (`range` checked it against `len`) and is one
        // of this position's slots, which no other `Slots` reads or writes while this one lives
        // (the contract of `for_position`); the borrow of `self` keeps it unique here.
        unsafe {
            std::slice::from_raw_parts_mut(self.buffer.ptr.as_ptr().add(range.start), range.len())
        }
    }

    /// This sample's bytes of `range`, to read.
    fn bytes(&self, range: std::ops::Range<usize>) -> &[u8] {
        debug_assert!(range.start <= range.end && range.end <= self.buffer.len);
        // SAFETY: as in `bytes_mut`; shared while `self` is.
        unsafe {
            std::slice::from_raw_parts(self.buffer.ptr.as_ptr().add(range.start), range.len())
        }
    }

    /// Marks this sample as skipped: its slots hold a placeholder the training loop must mask
    /// (a bad image under `OnBadImage::Skip`, say). The batch counts its skipped samples
    /// ([`BatchInfo::skipped`](crate::BatchInfo::skipped)), so reports count what was delivered, not
    /// what workers made ahead.
    pub fn mark_skipped(&mut self) {
        self.skipped = true;
    }

    /// True once [`mark_skipped`](Self::mark_skipped) was called for this sample.
    pub fn is_skipped(&self) -> bool {
        self.skipped
    }

    /// The number of output fields.
    pub fn len(&self) -> usize {
        self.fields.len()
    }

    /// True when there are no output fields.
    pub fn is_empty(&self) -> bool {
        self.fields.is_empty()
    }

    /// The output fields, in order (what the transform's
    /// [`output`](SampleTransform::output) declared).
    pub fn fields(&self) -> &[OutputField] {
        self.fields
    }

    /// This sample's position within its batch.
    pub fn position(&self) -> usize {
        self.position
    }

    fn range(&self, k: usize) -> Result<std::ops::Range<usize>> {
        let slot = self.slots.get(k).ok_or_else(|| {
            Error::user(format!(
                "output field {k} does not exist ({} fields)",
                self.fields.len()
            ))
        })?;
        let start = slot.offset + self.position * slot.sample_bytes;
        let range = start..start + slot.sample_bytes;
        if range.end > self.buffer.len {
            return Err(Error::user("slot outside the batch buffer"));
        }
        Ok(range)
    }

    /// The bytes of output field `k` for this sample.
    pub fn field(&mut self, k: usize) -> Result<&mut [u8]> {
        let range = self.range(k)?;
        self.touched[k] = true;
        Ok(self.bytes_mut(range))
    }

    /// The slot of the output field called `name`, as elements of `T`: exactly one sample's
    /// worth (the product of the field's shape).
    ///
    /// `T` must be the field's element type (`u8` also views `bool`, `u16` also views `f16`
    /// and `bf16`); an unknown name or another type is an [`Error::Mismatch`] naming the field.
    /// Slots are always aligned for their element type: batch fields start at multiples of
    /// [`FIELD_ALIGN`](crate::loader::FIELD_ALIGN) and each sample's slot at a multiple of
    /// its element size, in buffers the pool aligns (a buffer that is not, from a
    /// [`Backing`](crate::memory::Backing) that breaks its contract, is an error, never a
    /// misaligned slice).
    pub fn field_mut<T: Element>(&mut self, name: &str) -> Result<&mut [T]> {
        let k = self
            .fields
            .iter()
            .position(|f| f.name == name)
            .ok_or_else(|| {
                let names: Vec<&str> = self.fields.iter().map(|f| f.name.as_str()).collect();
                Error::mismatch(format!(
                    "the transform has no output field `{name}` (its fields: {names:?})"
                ))
            })?;
        let dtype = self.fields[k].dtype;
        if !T::matches(dtype) {
            return Err(Error::mismatch(format!(
                "output field `{name}` is {dtype}, not {}",
                element_name::<T>()
            )));
        }
        let range = self.range(k)?;
        self.touched[k] = true;
        cast_slice_mut(self.bytes_mut(range)).ok_or_else(|| {
            Error::mismatch(format!(
                "output field `{name}`: its slot is not aligned for {dtype} (the batch buffer's backing breaks its alignment contract)"
            ))
        })
    }

    /// Fills every slot of this sample with [`MARKER`] (debug builds, before the transform).
    pub(crate) fn fill_marker(&mut self) {
        for k in 0..self.slots.len() {
            if let Ok(range) = self.range(k) {
                for (i, b) in self.bytes_mut(range).iter_mut().enumerate() {
                    *b = MARKER[i % MARKER.len()];
                }
            }
        }
    }

    /// Checks, after the transform, that it wrote each slot: that it asked for every slot, and
    /// (with `marker`, after [`fill_marker`](Self::fill_marker)) that no run of the marker is
    /// left. Skipped samples are not checked.
    pub(crate) fn check_written(&self, marker: bool) -> Result<()> {
        if self.skipped {
            return Ok(());
        }
        for (k, field) in self.fields.iter().enumerate() {
            if !self.touched[k] {
                return Err(Error::user(format!(
                    "the transform did not write output field `{}` ({} bytes per sample): a \
                     transform must write every byte of every slot, or the batch holds bytes \
                     of an earlier one",
                    field.name,
                    field.sample_bytes()
                )));
            }
            if !marker {
                continue;
            }
            let slot = self.bytes(self.range(k)?);
            if let Some(left) = marker_left(slot) {
                return Err(Error::user(format!(
                    "the transform did not write bytes {}..{} of output field `{}` (its \
                     slot has {} bytes): a transform must write every byte of every slot, or \
                     the batch holds bytes of an earlier one",
                    left.start,
                    left.end,
                    field.name,
                    slot.len()
                )));
            }
        }
        Ok(())
    }
}

/// The first run of [`MARKER`] left in `slot` that cannot be data: 8 bytes or more anywhere,
/// or 4 or more at the slot's end (a transform that wrote a prefix); `None` if there is none.
fn marker_left(slot: &[u8]) -> Option<std::ops::Range<usize>> {
    let mut start = 0;
    for (i, &b) in slot.iter().enumerate() {
        if b != MARKER[i % MARKER.len()] {
            if i - start >= MARKER.len() {
                return Some(start..i);
            }
            start = i + 1;
        }
    }
    (slot.len() - start >= 4).then_some(start..slot.len())
}

/// The short name of an element type (`f32`, `bf16`), for messages.
pub(crate) fn element_name<T: Element>() -> &'static str {
    let full = std::any::type_name::<T>();
    full.rsplit("::").next().unwrap_or(full)
}

/// Writes one sample into its slots of a batch. Shared by every worker thread.
///
/// A transform with settings of its own: random crops of a 1-D signal, the crop's place drawn
/// from [`SampleContext::rng`] (the same for a sample whichever worker runs it, and after a
/// resume). Its output follows the input: the signal's dtype, `len` values.
///
/// ```
/// use gpufeed::{DType, Dataset, Field, Loader, OutputField, Result, Sample, SampleContext, SampleTransform, Schema, Slots};
///
/// struct RandomCrop {
///     len: usize,
/// }
///
/// impl SampleTransform for RandomCrop {
///     fn output(&self, input: &Schema) -> Result<Vec<OutputField>> {
///         let signal = OutputField::like(input, "signal")?;
///         if signal.shape.len() != 1 || signal.shape[0] < self.len {
///             return Err(gpufeed::Error::user(format!("`signal` {:?} is shorter than a crop", signal.shape)));
///         }
///         Ok(vec![OutputField::new("signal", signal.dtype, &[self.len])])
///     }
///
///     fn apply(&self, sample: Sample<'_>, ctx: &SampleContext, slots: &mut Slots<'_>) -> Result<()> {
///         let signal = sample.field_as::<f32>("signal")?;
///         let start = ctx.rng().below((signal.len() - self.len + 1) as u64) as usize;
///         slots.field_mut::<f32>("signal")?.copy_from_slice(&signal[start..start + self.len]);
///         Ok(())
///     }
/// }
/// # struct Signals(Schema);
/// # impl Dataset for Signals {
/// #     fn len(&self) -> u64 { 16 }
/// #     fn schema(&self) -> &Schema { &self.0 }
/// #     fn get(&self, i: u64) -> Result<Sample<'_>> {
/// #         Sample::owned((0..100).flat_map(|t| (i as f32 * 1000.0 + t as f32).to_le_bytes()).collect(), &self.0)
/// #     }
/// # }
/// # let signals = Signals(Schema::new(vec![Field::tensor("signal", DType::F32, &[100])]).unwrap());
///
/// // `signals`: 16 samples of `signal`, 100 f32 each.
/// let mut loader = Loader::builder(signals)
///     .batch_size(8)
///     .shuffle(1)
///     .transform(RandomCrop { len: 10 })
///     .build()?;
/// let batch = loader.next().unwrap()?;
/// assert_eq!(batch.shape("signal")?, [8, 10]);
/// let crops = batch.field::<f32>("signal")?;
/// for (crop, &i) in crops.chunks(10).zip(batch.indices()) {
///     assert_eq!(crop[0] as u64 / 1000, i); // from sample i
///     assert!(crop.windows(2).all(|w| w[1] == w[0] + 1.0)); // contiguous
/// }
/// # Ok::<(), gpufeed::Error>(())
/// ```
pub trait SampleTransform: Send + Sync + 'static {
    /// The batch fields this transform writes, given the dataset's schema; called once, by
    /// the loader's `build()`, which fails with this error if there is one.
    fn output(&self, input: &Schema) -> Result<Vec<OutputField>>;

    /// Writes `sample` into `slots` (one slice per output field, each exactly the field's
    /// sample size). Must write every byte of every slot: buffers are reused.
    fn apply(&self, sample: Sample<'_>, ctx: &SampleContext, slots: &mut Slots<'_>) -> Result<()>;
}

impl<T: SampleTransform + ?Sized> SampleTransform for Arc<T> {
    fn output(&self, input: &Schema) -> Result<Vec<OutputField>> {
        (**self).output(input)
    }
    fn apply(&self, sample: Sample<'_>, ctx: &SampleContext, slots: &mut Slots<'_>) -> Result<()> {
        (**self).apply(sample, ctx, slots)
    }
}

/// The default transform: copies tensor fields as they are stored (all of them, or those named),
/// each with [`Sample::copy_field_into`]: one copy from a mapping, or one `pread` straight into
/// the batch slot from a file opened with [`ReadMode::Pread`](crate::source::ReadMode).
#[derive(Clone, Debug, Default)]
pub struct CopyFields {
    names: Option<Vec<String>>,
    // Schema positions of the fields copied, resolved by `output`.
    resolved: std::sync::OnceLock<Vec<usize>>,
}

impl CopyFields {
    /// Copies every field; the schema must have tensor fields only.
    pub fn all() -> CopyFields {
        CopyFields::default()
    }

    /// Copies the named tensor fields, in this order.
    pub fn named<S: Into<String>>(names: impl IntoIterator<Item = S>) -> CopyFields {
        CopyFields {
            names: Some(names.into_iter().map(Into::into).collect()),
            resolved: std::sync::OnceLock::new(),
        }
    }

    fn resolve(&self, input: &Schema) -> Result<Vec<usize>> {
        match &self.names {
            None => Ok((0..input.fields().len()).collect()),
            Some(names) => names
                .iter()
                .map(|n| {
                    input.index_of(n).ok_or_else(|| {
                        Error::mismatch(format!("no field `{n}` in the dataset's schema [{input}]"))
                    })
                })
                .collect(),
        }
    }
}

impl SampleTransform for CopyFields {
    fn output(&self, input: &Schema) -> Result<Vec<OutputField>> {
        let picked = self.resolve(input)?;
        let out = picked
            .iter()
            .map(|&k| {
                let f = &input.fields()[k];
                match &f.kind {
                    FieldKind::Tensor { dtype, shape } => Ok(OutputField {
                        name: f.name.clone(),
                        dtype: *dtype,
                        shape: shape.iter().map(|&d| d as usize).collect(),
                    }),
                    FieldKind::Bytes { codec } => Err(Error::mismatch(format!(
                        "field `{}` holds variable-size {} bytes, which cannot be batched as they are: \
                         give the loader a transform that decodes it, or pick tensor fields with CopyFields::named",
                        f.name,
                        codec.name()
                    ))),
                }
            })
            .collect::<Result<Vec<_>>>()?;
        if self.resolved.get_or_init(|| picked.clone()) != &picked {
            return Err(Error::mismatch(
                "this CopyFields was prepared for another schema; give each loader its own",
            ));
        }
        Ok(out)
    }

    fn apply(&self, sample: Sample<'_>, _ctx: &SampleContext, slots: &mut Slots<'_>) -> Result<()> {
        let Some(picked) = self.resolved.get() else {
            return Err(Error::user("CopyFields::apply before output"));
        };
        for (slot, &k) in picked.iter().enumerate() {
            // From a mapping, one copy; from a file opened with ReadMode::Pread, one read
            // straight into the slot.
            sample.copy_field_into(k, slots.field(slot)?)?;
        }
        Ok(())
    }
}

/// The output fields of a [`FnTransform`]: given, or computed from the input's schema.
enum Outputs {
    Fixed(Vec<OutputField>),
    #[allow(clippy::type_complexity)]
    FromInput(Box<dyn Fn(&Schema) -> Result<Vec<OutputField>> + Send + Sync>),
}

/// A transform made of its output fields and a closure that writes each sample.
///
/// The closure finds its input by name with [`Sample::field_as`] and its output with
/// [`Slots::field_mut`]; the output fields are given ([`FnTransform::new`]) or computed from
/// the dataset's schema when the loader is built ([`FnTransform::with_output`], with
/// [`OutputField::like`] for a field kept as it is).
///
/// ```
/// use gpufeed::{DType, Dataset, Field, FnTransform, Loader, OutputField, Sample, SampleContext, Schema, Slots};
/// # use gpufeed::Result;
/// # struct Numbers(Schema);
/// # impl Dataset for Numbers {
/// #     fn len(&self) -> u64 { 8 }
/// #     fn schema(&self) -> &Schema { &self.0 }
/// #     fn get(&self, i: u64) -> Result<Sample<'_>> {
/// #         Sample::owned([i as f32, -(i as f32)].iter().flat_map(|x| x.to_le_bytes()).collect(), &self.0)
/// #     }
/// # }
/// # let dataset = Numbers(Schema::new(vec![Field::tensor("x", DType::F32, &[2])]).unwrap());
/// // `dataset` has one field `x`: 2 f32s per sample. Keep it, add its sum as `total`.
/// let transform = FnTransform::with_output(
///     |input: &Schema| Ok(vec![OutputField::like(input, "x")?, OutputField::new("total", DType::F32, &[])]),
///     |sample: Sample<'_>, _: &SampleContext, slots: &mut Slots<'_>| {
///         let x = sample.field_as::<f32>("x")?;
///         slots.field_mut::<f32>("x")?.copy_from_slice(&x);
///         slots.field_mut::<f32>("total")?[0] = x.iter().sum();
///         Ok(())
///     },
/// );
/// let mut loader = Loader::builder(dataset).batch_size(4).transform(transform).build()?;
/// let batch = loader.next().unwrap()?;
/// assert_eq!(batch.shape("x")?, [4, 2]);
/// assert_eq!(batch.field::<f32>("total")?, [0.0; 4]);
/// # Ok::<(), gpufeed::Error>(())
/// ```
pub struct FnTransform<F> {
    outputs: Outputs,
    f: F,
}

impl<F> FnTransform<F>
where
    F: Fn(Sample<'_>, &SampleContext, &mut Slots<'_>) -> Result<()> + Send + Sync + 'static,
{
    /// A transform that writes `outputs` by calling `f` for each sample.
    pub fn new(outputs: Vec<OutputField>, f: F) -> FnTransform<F> {
        FnTransform {
            outputs: Outputs::Fixed(outputs),
            f,
        }
    }

    /// A transform whose output fields `outputs` computes from the dataset's schema (once,
    /// when the loader is built, which fails with its error), and that writes them by calling
    /// `f` for each sample.
    pub fn with_output<O>(outputs: O, f: F) -> FnTransform<F>
    where
        O: Fn(&Schema) -> Result<Vec<OutputField>> + Send + Sync + 'static,
    {
        FnTransform {
            outputs: Outputs::FromInput(Box::new(outputs)),
            f,
        }
    }
}

impl<F> SampleTransform for FnTransform<F>
where
    F: Fn(Sample<'_>, &SampleContext, &mut Slots<'_>) -> Result<()> + Send + Sync + 'static,
{
    fn output(&self, input: &Schema) -> Result<Vec<OutputField>> {
        match &self.outputs {
            Outputs::Fixed(outputs) => Ok(outputs.clone()),
            Outputs::FromInput(outputs) => outputs(input),
        }
    }

    fn apply(&self, sample: Sample<'_>, ctx: &SampleContext, slots: &mut Slots<'_>) -> Result<()> {
        (self.f)(sample, ctx, slots)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::format::Field;

    /// Two fields, `x` (3 f32) and `id` (u8), of a batch of 2, laid out as the loader does.
    fn layout() -> (Vec<OutputField>, Vec<FieldSlot>, Vec<u8>) {
        let fields = vec![
            OutputField::new("x", DType::F32, &[3]),
            OutputField::new("id", DType::U8, &[]),
        ];
        let slots = vec![
            FieldSlot {
                offset: 0,
                sample_bytes: 12,
            },
            FieldSlot {
                offset: 256,
                sample_bytes: 1,
            },
        ];
        (fields, slots, vec![0u8; 512])
    }

    /// A buffer aligned for f32, whatever the allocator gives a `Vec<u8>`.
    fn aligned(buf: &mut [u8]) -> &mut [u8] {
        let skip = buf.as_ptr().align_offset(8);
        &mut buf[skip..skip + 300]
    }

    #[test]
    fn field_mut_gives_a_typed_slot_by_name() {
        let (fields, slots, mut buf) = layout();
        let mut touched = [false; 2];
        let mut s = Slots::new(aligned(&mut buf), &fields, &slots, 1, &mut touched);
        let x = s.field_mut::<f32>("x").unwrap();
        assert_eq!(x.len(), 3);
        x.copy_from_slice(&[1.0, 2.0, 3.0]);
        s.field_mut::<u8>("id").unwrap()[0] = 9;
        s.check_written(false).unwrap();
        // Sample 1's slot of `x` is bytes 12..24; of `id`, byte 257.
        let b = s.field(0).unwrap().to_vec();
        assert_eq!(b, [1f32, 2.0, 3.0].map(f32::to_le_bytes).concat());
        assert_eq!(s.field(1).unwrap(), [9]);
    }

    #[test]
    fn field_mut_refuses_unknown_names_and_other_types_naming_the_field() {
        let (fields, slots, mut buf) = layout();
        let mut touched = [false; 2];
        let mut s = Slots::new(aligned(&mut buf), &fields, &slots, 0, &mut touched);
        let e = s.field_mut::<f32>("y").unwrap_err();
        assert!(matches!(e, Error::Mismatch { .. }), "{e}");
        assert!(
            e.to_string().contains("`y`") && e.to_string().contains("\"x\""),
            "{e}"
        );
        let e = s.field_mut::<u32>("x").unwrap_err();
        assert!(matches!(e, Error::Mismatch { .. }), "{e}");
        assert!(e.to_string().contains("`x` is f32, not u32"), "{e}");
        let e = s.field_mut::<half::f16>("x").unwrap_err();
        assert!(e.to_string().contains("not f16"), "{e}");
        // A failed lookup does not count as writing the field.
        assert!(s.check_written(false).is_err());
    }

    #[test]
    fn a_field_never_asked_for_is_an_error_naming_it() {
        let (fields, slots, mut buf) = layout();
        let mut touched = [false; 2];
        let mut s = Slots::new(aligned(&mut buf), &fields, &slots, 0, &mut touched);
        s.field_mut::<f32>("x").unwrap().fill(0.5);
        let e = s.check_written(false).unwrap_err();
        assert!(
            e.to_string().contains("did not write output field `id`"),
            "{e}"
        );
        // A skipped sample holds placeholders: not checked.
        s.mark_skipped();
        s.check_written(true).unwrap();
    }

    #[test]
    fn bytes_left_unwritten_are_found_by_the_marker() {
        let (fields, slots, mut buf) = layout();
        let mut touched = [false; 2];
        let mut s = Slots::new(aligned(&mut buf), &fields, &slots, 1, &mut touched);
        s.fill_marker();
        // Writes 2 of the 3 floats of `x`: bytes 8..12 keep the marker.
        s.field_mut::<f32>("x").unwrap()[..2].fill(0.0);
        s.field_mut::<u8>("id").unwrap()[0] = 1;
        let e = s.check_written(true).unwrap_err();
        assert!(
            e.to_string().contains("bytes 8..12 of output field `x`"),
            "{e}"
        );
        // All of it written: no error, whatever the values (zeros, the marker's first bytes
        // in a short run).
        let x = s.field(0).unwrap();
        x.fill(0);
        x[..3].copy_from_slice(&MARKER[..3]);
        s.check_written(true).unwrap();
        // A new sample's slots start unwritten again.
        let mut s = Slots::new(aligned(&mut buf), &fields, &slots, 0, &mut touched);
        s.fill_marker();
        s.field(0).unwrap();
        s.field(1).unwrap()[0] = 0;
        let e = s.check_written(true).unwrap_err();
        assert!(
            e.to_string().contains("bytes 0..12 of output field `x`"),
            "{e}"
        );
    }

    #[test]
    fn marker_runs_are_found_in_the_middle_and_at_the_end() {
        let marked: Vec<u8> = (0..40).map(|i| MARKER[i % 8]).collect();
        let with = |written: std::ops::Range<usize>| {
            let mut s = marked.clone();
            s[written].fill(0);
            s
        };
        // 8 unwritten bytes between written ones, at any offset.
        let mut s = with(0..40);
        s[13..21].copy_from_slice(&marked[13..21]);
        assert_eq!(marker_left(&s), Some(13..21));
        // 7 in the middle pass; 4 at the end do not.
        let mut s = with(0..40);
        s[13..20].copy_from_slice(&marked[13..20]);
        assert_eq!(marker_left(&s), None);
        assert_eq!(marker_left(&with(0..36)), Some(36..40));
        assert_eq!(marker_left(&with(0..37)), None);
        assert_eq!(marker_left(&with(0..0)), Some(0..40));
        assert_eq!(marker_left(&marked[..3]), None);
    }

    #[test]
    fn output_like_copies_a_tensor_field_and_refuses_bytes() {
        let schema = Schema::new(vec![
            Field::tensor("x", DType::BF16, &[2, 3]),
            Field::bytes("jpg", crate::format::Codec::Jpeg),
        ])
        .unwrap();
        assert_eq!(
            OutputField::like(&schema, "x").unwrap(),
            OutputField::new("x", DType::BF16, &[2, 3])
        );
        let e = OutputField::like(&schema, "jpg").unwrap_err();
        assert!(e.to_string().contains("`jpg`"), "{e}");
        let e = OutputField::like(&schema, "y").unwrap_err();
        assert!(e.to_string().contains("no field `y`"), "{e}");
    }

    #[test]
    fn rng_depends_on_seed_epoch_and_index_only() {
        let a = SampleRng::new(1, 2, 3).next_u64();
        assert_eq!(a, SampleRng::new(1, 2, 3).next_u64());
        assert_ne!(a, SampleRng::new(1, 2, 4).next_u64());
        assert_ne!(a, SampleRng::new(1, 3, 3).next_u64());
        assert_ne!(a, SampleRng::new(2, 2, 3).next_u64());
        let mut r = SampleRng::new(0, 0, 0);
        for _ in 0..1000 {
            let x = r.next_f64();
            assert!((0.0..1.0).contains(&x));
            assert!(r.below(7) < 7);
        }
    }
}
