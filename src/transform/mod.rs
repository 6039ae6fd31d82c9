//! Per-sample work: what turns one [`Sample`] into its slots of a batch.
//!
//! A [`SampleTransform`] declares the batch fields it writes ([`OutputField`]s) once, when the
//! loader is built, then writes each sample straight into its slots ([`Slots`]) of the batch
//! buffer: no intermediate copy, no allocation per sample. [`CopyFields`] (the default) copies
//! fields as they are stored (variable-size bytes as ragged fields); [`FnTransform`] wraps a
//! closure.
//!
//! Randomness comes from [`SampleContext::rng`], a pure function of (seed, epoch, sample index):
//! the same augmentation for a sample whichever worker runs it, on any number of workers, and
//! after a resume.
//!
//! [`image`] holds the image pipeline: JPEG/PNG decode, torchvision's crops, flips,
//! normalisation, as one [`ImageTransform`](image::ImageTransform).

pub mod image;

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::format::Schema;
use crate::layout::{OutputField, Slots};
use crate::source::Sample;

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
    /// sample size; for a ragged field, room for the sample's items, asked for with
    /// [`Slots::ragged_mut`]). Must write every byte of every slot: buffers are reused.
    fn apply(&self, sample: Sample<'_>, ctx: &SampleContext, slots: &mut Slots<'_>) -> Result<()>;

    /// The image pipeline this transform is, if it is one: a loader that feeds a GPU asks, so
    /// that the GPU can decode its JPEGs ([`image::Decode`]). `None` (the default) for every
    /// other transform.
    fn image_pipeline(&self) -> Option<&image::ImageTransform> {
        None
    }
}

impl<T: SampleTransform + ?Sized> SampleTransform for Arc<T> {
    fn output(&self, input: &Schema) -> Result<Vec<OutputField>> {
        (**self).output(input)
    }
    fn apply(&self, sample: Sample<'_>, ctx: &SampleContext, slots: &mut Slots<'_>) -> Result<()> {
        (**self).apply(sample, ctx, slots)
    }
    fn image_pipeline(&self) -> Option<&image::ImageTransform> {
        (**self).image_pipeline()
    }
}

/// The default transform: copies fields as they are stored (all of them, or those named).
///
/// A tensor field is copied with [`Sample::copy_field_into`]: one copy from a mapping, or one
/// `pread` straight into the batch slot from a file opened with
/// [`ReadMode::Pread`](crate::source::ReadMode). A variable-size bytes field becomes a ragged
/// field (see [`OutputField::like`]): of `u8`, or of the dtype of [`Codec::Elements`] values,
/// each sample's bytes copied once into the batch's values; its length must be a whole number
/// of values.
///
/// [`Codec::Elements`]: crate::format::Codec::Elements
#[derive(Clone, Debug, Default)]
pub struct CopyFields {
    names: Option<Vec<String>>,
    // Schema positions of the fields copied, resolved by `output`.
    resolved: std::sync::OnceLock<Vec<usize>>,
}

impl CopyFields {
    /// Copies every field.
    pub fn all() -> CopyFields {
        CopyFields::default()
    }

    /// Copies the named fields, in this order.
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
            .map(|&k| OutputField::stored(&input.fields()[k]))
            .collect();
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
            let field = &slots.fields()[slot];
            if field.ragged {
                let (item, dtype) = (field.item_bytes(), field.dtype);
                let bytes = sample.try_field(k)?;
                if !bytes.len().is_multiple_of(item) {
                    return Err(Error::mismatch(format!(
                        "field `{}` has {} bytes, not a whole number of {dtype} values",
                        field.name,
                        bytes.len()
                    )));
                }
                let room = slots.ragged(slot, bytes.len() / item)?;
                crate::memory::copy_to_batch(room, bytes);
            } else {
                // From a mapping, one copy; from a file opened with ReadMode::Pread, one read
                // straight into the slot.
                sample.copy_field_into(k, slots.field(slot)?)?;
            }
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
