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
pub struct Slots<'a> {
    buffer: &'a mut [u8],
    fields: &'a [FieldSlot],
    position: usize,
    skipped: bool,
}

/// Where one output field lives in a batch buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct FieldSlot {
    pub offset: usize,
    pub sample_bytes: usize,
}

impl<'a> Slots<'a> {
    pub(crate) fn new(buffer: &'a mut [u8], fields: &'a [FieldSlot], position: usize) -> Slots<'a> {
        Slots {
            buffer,
            fields,
            position,
            skipped: false,
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

    /// The bytes of output field `k` for this sample.
    pub fn field(&mut self, k: usize) -> Result<&mut [u8]> {
        let slot = self.fields.get(k).ok_or_else(|| {
            Error::user(format!(
                "output field {k} does not exist ({} fields)",
                self.fields.len()
            ))
        })?;
        let start = slot.offset + self.position * slot.sample_bytes;
        self.buffer
            .get_mut(start..start + slot.sample_bytes)
            .ok_or_else(|| Error::user("slot outside the batch buffer"))
    }
}

/// Writes one sample into its slots of a batch. Shared by every worker thread.
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

/// A transform made of a list of output fields and a closure.
pub struct FnTransform<F> {
    outputs: Vec<OutputField>,
    f: F,
}

impl<F> FnTransform<F>
where
    F: Fn(Sample<'_>, &SampleContext, &mut Slots<'_>) -> Result<()> + Send + Sync + 'static,
{
    /// A transform that writes `outputs` by calling `f` for each sample.
    pub fn new(outputs: Vec<OutputField>, f: F) -> FnTransform<F> {
        FnTransform { outputs, f }
    }
}

impl<F> SampleTransform for FnTransform<F>
where
    F: Fn(Sample<'_>, &SampleContext, &mut Slots<'_>) -> Result<()> + Send + Sync + 'static,
{
    fn output(&self, _input: &Schema) -> Result<Vec<OutputField>> {
        Ok(self.outputs.clone())
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
