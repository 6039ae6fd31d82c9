//! [`Batch`]: a collated batch in one pooled buffer, each field a contiguous typed slice.
//!
//! A batch's fields live back to back in one buffer (each at a 256-byte aligned offset), so a
//! whole batch is one host-to-device copy. [`BatchLayout`] is computed once at `build()`; a
//! batch holds an `Arc` of it, its buffer, and the indices of its samples. Dropping a batch
//! returns its buffer to the pool.

use std::sync::Arc;

use super::budget::BatchPermit;
use crate::error::{Error, Result};
use crate::format::DType;
use crate::memory::HostBuffer;
use crate::transform::{FieldSlot, OutputField};

/// Where each field of a batch lives in its buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchLayout {
    fields: Vec<OutputField>,
    slots: Vec<FieldSlot>,
    batch_size: usize,
    total_bytes: usize,
}

/// Field offsets in a batch buffer are multiples of this (what device copies and SIMD like).
pub const FIELD_ALIGN: usize = 256;

impl BatchLayout {
    /// The layout of batches of `batch_size` samples of these fields.
    pub fn new(fields: Vec<OutputField>, batch_size: usize) -> Result<BatchLayout> {
        if fields.is_empty() {
            return Err(Error::config(
                "transform",
                "the transform declares no output field",
            ));
        }
        let mut offset = 0usize;
        let mut slots = Vec::with_capacity(fields.len());
        for f in &fields {
            let sample_bytes = f.sample_bytes();
            slots.push(FieldSlot {
                offset,
                sample_bytes,
            });
            let field_bytes = sample_bytes
                .checked_mul(batch_size)
                .ok_or_else(|| Error::config("batch_size", "a batch would not fit in memory"))?;
            offset = (offset + field_bytes).next_multiple_of(FIELD_ALIGN);
        }
        Ok(BatchLayout {
            fields,
            slots,
            batch_size,
            total_bytes: offset.max(1),
        })
    }

    /// The fields, in order.
    pub fn fields(&self) -> &[OutputField] {
        &self.fields
    }

    /// Samples in a full batch.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Bytes of a full batch's buffer.
    pub fn total_bytes(&self) -> usize {
        self.total_bytes
    }

    /// Bytes of one sample, all fields together.
    pub fn sample_bytes(&self) -> usize {
        self.slots.iter().map(|s| s.sample_bytes).sum()
    }

    /// The byte offset of field `k` in a batch buffer.
    pub fn field_offset(&self, k: usize) -> Option<usize> {
        self.slots.get(k).map(|s| s.offset)
    }

    /// The position of the field called `name`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.fields.iter().position(|f| f.name == name)
    }

    pub(crate) fn slots(&self) -> &[FieldSlot] {
        &self.slots
    }
}

/// An element type a batch field can be viewed as: the primitive numbers, and `half`'s `f16`
/// and `bf16`.
///
/// Sealed: only types without padding, valid for every bit pattern and of their dtype's size
/// implement it, so that viewing a field's bytes as `&[T]` is sound.
pub trait Element: sealed::Sealed + Copy + Send + Sync + 'static {
    /// The dtypes this type can view.
    fn matches(dtype: DType) -> bool;
}

mod sealed {
    /// Implemented only below, for types with no padding that are valid for every bit pattern.
    pub trait Sealed {}
}

macro_rules! element {
    ($t:ty, $($d:path),+) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            fn matches(dtype: DType) -> bool {
                matches!(dtype, $($d)|+)
            }
        }
    };
}

element!(u8, DType::U8, DType::Bool);
element!(i8, DType::I8);
element!(u16, DType::U16, DType::F16, DType::BF16);
element!(i16, DType::I16);
element!(u32, DType::U32);
element!(i32, DType::I32);
element!(u64, DType::U64);
element!(i64, DType::I64);
element!(f32, DType::F32);
element!(f64, DType::F64);
element!(half::f16, DType::F16);
element!(half::bf16, DType::BF16);

/// Views `bytes` as a slice of `T`, checking alignment and length.
pub(crate) fn cast_slice<T: Element>(bytes: &[u8]) -> Option<&[T]> {
    let size = std::mem::size_of::<T>();
    if !(bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>())
        || !bytes.len().is_multiple_of(size)
    {
        return None;
    }
    // SAFETY: alignment and length are checked above; `T: Element` (sealed) is a type without
    // padding that is valid for every bit pattern; the result borrows `bytes`, so it cannot
    // outlive or alias a writer.
    Some(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), bytes.len() / size) })
}

/// Views `bytes` as a mutable slice of `T`, checking alignment and length.
pub(crate) fn cast_slice_mut<T: Element>(bytes: &mut [u8]) -> Option<&mut [T]> {
    let size = std::mem::size_of::<T>();
    if !(bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>())
        || !bytes.len().is_multiple_of(size)
    {
        return None;
    }
    // SAFETY: as in `cast_slice`; the exclusive borrow of `bytes` moves to the result.
    Some(unsafe {
        std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<T>(), bytes.len() / size)
    })
}

/// What a batch is, wherever its memory is: the samples it holds, where it stands in the
/// epoch, its padding and the samples skipped. [`Batch`] and `cuda::DeviceBatch` both
/// dereference to it, so `batch.len()`, `batch.indices()`, `batch.epoch()`, ... are the same
/// methods on both.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BatchInfo {
    pub(crate) indices: Vec<u64>,
    pub(crate) padding: usize,
    pub(crate) skipped: usize,
    pub(crate) epoch: u64,
    pub(crate) number: u64,
}

impl BatchInfo {
    /// Samples in the batch (the last batch of an epoch may be short without `drop_last`).
    pub fn len(&self) -> usize {
        self.indices.len()
    }

    /// True for a batch without samples (never delivered by the loader).
    pub fn is_empty(&self) -> bool {
        self.indices.is_empty()
    }

    /// The dataset indices of its samples, in batch order.
    pub fn indices(&self) -> &[u64] {
        &self.indices
    }

    /// Slots that are padding, not samples of their own (only with
    /// [`LoaderBuilder::evaluation`](super::LoaderBuilder::evaluation)): always the last
    /// `padding()` slots of the batch. They hold a repeated sample, so a model can run on them;
    /// metrics must skip them.
    pub fn padding(&self) -> usize {
        self.padding
    }

    /// Samples of the batch that the transform skipped (see
    /// [`Slots::mark_skipped`](crate::Slots::mark_skipped)): their slots hold placeholders.
    pub fn skipped(&self) -> usize {
        self.skipped
    }

    /// Per slot, true for a real sample and false for padding (see [`BatchInfo::padding`]).
    pub fn mask(&self) -> Vec<bool> {
        let real = self.len() - self.padding.min(self.len());
        (0..self.len()).map(|k| k < real).collect()
    }

    /// The epoch it belongs to.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Its number within the epoch (0-based, for this rank).
    pub fn number(&self) -> u64 {
        self.number
    }
}

/// A collated batch: `len()` samples, each field one contiguous slice of shape `[len, ...]`.
///
/// Its samples' indices, epoch, number, padding and mask are those of its [`BatchInfo`], which
/// it dereferences to.
///
/// A batch holds one of the loader's batch buffers until it is dropped; see
/// [`LoaderBuilder::pool_budget`](super::LoaderBuilder::pool_budget).
///
/// ```
/// use gpufeed::{DType, Dataset, Field, Loader, Sample, Schema};
/// # use gpufeed::Result;
/// # struct Pairs(Schema);
/// # impl Dataset for Pairs {
/// #     fn len(&self) -> u64 { 10 }
/// #     fn schema(&self) -> &Schema { &self.0 }
/// #     fn get(&self, i: u64) -> Result<Sample<'_>> {
/// #         let mut r = Vec::new();
/// #         let half = half::f16::from_f32(i as f32).to_le_bytes();
/// #         self.0.build_record(&[&[half, half, half].concat(), &(i as i64).to_le_bytes()], &mut r)?;
/// #         Sample::owned(r, &self.0)
/// #     }
/// # }
/// # let dataset = Pairs(Schema::new(vec![Field::tensor("x", DType::F16, &[3]), Field::tensor("label", DType::I64, &[])]).unwrap());
/// // `dataset`: 10 samples of `x` (3 f16) and `label` (i64).
/// let mut loader = Loader::builder(dataset).batch_size(4).build()?;
/// let batch = loader.next().unwrap()?;
/// assert_eq!((batch.len(), batch.epoch(), batch.number()), (4, 0, 0));
/// assert_eq!(batch.indices(), [0, 1, 2, 3]);
/// assert_eq!(batch.shape("x")?, [4, 3]);
/// assert_eq!(batch.dtype("x")?, DType::F16);
/// let x: &[half::f16] = batch.field("x")?; // `u16` views it too
/// assert_eq!(x[3 * 2].to_f32(), 2.0);
/// assert_eq!(batch.field::<i64>("label")?, [0, 1, 2, 3]);
/// assert!(batch.field::<f32>("x").is_err()); // not its dtype
/// // The whole batch is one buffer (one device copy): every field at its offset.
/// assert_eq!(batch.layout().field_offset(1), Some(256));
/// # Ok::<(), gpufeed::Error>(())
/// ```
pub struct Batch {
    pub(crate) buffer: HostBuffer,
    pub(crate) layout: Arc<BatchLayout>,
    pub(crate) info: BatchInfo,
    /// The batch's share of the loader's budget, given back when the batch drops.
    pub(crate) permit: Option<BatchPermit>,
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("epoch", &self.info.epoch)
            .field("number", &self.info.number)
            .field("len", &self.len())
            .finish()
    }
}

impl std::ops::Deref for Batch {
    type Target = BatchInfo;

    fn deref(&self) -> &BatchInfo {
        &self.info
    }
}

impl Batch {
    /// What the batch is: its samples' indices, epoch, number, padding (also reached through
    /// `Deref`: `batch.len()`).
    pub fn info(&self) -> &BatchInfo {
        &self.info
    }

    /// The layout of its buffer.
    pub fn layout(&self) -> &BatchLayout {
        &self.layout
    }

    /// The whole buffer (every field, at [`BatchLayout::field_offset`]), for one device copy.
    pub fn buffer(&self) -> &HostBuffer {
        &self.buffer
    }

    /// The whole buffer, mutable (for device-copy fences).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn buffer_mut(&mut self) -> &mut HostBuffer {
        &mut self.buffer
    }

    fn field_index(&self, name: &str) -> Result<usize> {
        self.layout.index_of(name).ok_or_else(|| {
            let names: Vec<&str> = self.layout.fields.iter().map(|f| f.name.as_str()).collect();
            Error::mismatch(format!("batch has no field `{name}` (fields: {names:?})"))
        })
    }

    fn range(&self, k: usize) -> std::ops::Range<usize> {
        let slot = &self.layout.slots[k];
        slot.offset..slot.offset + slot.sample_bytes * self.len()
    }

    /// The bytes of field `name`: `len()` samples back to back.
    pub fn field_bytes(&self, name: &str) -> Result<&[u8]> {
        let k = self.field_index(name)?;
        Ok(&self.buffer.as_slice()[self.range(k)])
    }

    /// Field `name` as a typed slice; `T` must match the field's dtype (`u16` views f16/bf16).
    pub fn field<T: Element>(&self, name: &str) -> Result<&[T]> {
        let k = self.field_index(name)?;
        let dtype = self.layout.fields[k].dtype;
        if !T::matches(dtype) {
            return Err(Error::mismatch(format!(
                "field `{name}` is {dtype}, not {}",
                std::any::type_name::<T>()
            )));
        }
        cast_slice(&self.buffer.as_slice()[self.range(k)])
            .ok_or_else(|| Error::mismatch(format!("field `{name}` is not aligned for {dtype}")))
    }

    /// Field `name` as a mutable typed slice (for per-batch transforms).
    pub fn field_mut<T: Element>(&mut self, name: &str) -> Result<&mut [T]> {
        let k = self.field_index(name)?;
        let dtype = self.layout.fields[k].dtype;
        if !T::matches(dtype) {
            return Err(Error::mismatch(format!(
                "field `{name}` is {dtype}, not {}",
                std::any::type_name::<T>()
            )));
        }
        let range = self.range(k);
        cast_slice_mut(&mut self.buffer.as_mut_slice()[range])
            .ok_or_else(|| Error::mismatch(format!("field `{name}` is not aligned for {dtype}")))
    }

    /// The shape of field `name` in this batch: `[len(), per-sample shape...]`.
    pub fn shape(&self, name: &str) -> Result<Vec<usize>> {
        let k = self.field_index(name)?;
        let mut shape = vec![self.len()];
        shape.extend_from_slice(&self.layout.fields[k].shape);
        Ok(shape)
    }

    /// The dtype of field `name`.
    pub fn dtype(&self, name: &str) -> Result<DType> {
        Ok(self.layout.fields[self.field_index(name)?].dtype)
    }
}
