//! [`Batch`]: a collated batch in one pooled buffer, each field a contiguous typed slice.
//!
//! A batch's fields live back to back in one buffer (each at a 256-byte aligned offset), so a
//! whole batch is one host-to-device copy. [`BatchLayout`] is computed once at `build()`; a
//! batch holds an `Arc` of it, its buffer, and the indices of its samples. Dropping a batch
//! returns its buffer to the pool. A ragged field is its values and its offsets (see
//! [`Ragged`]), both in the same buffer.

use std::sync::Arc;

use super::budget::BatchPermit;
use crate::error::{Error, Result};
use crate::format::DType;
use crate::layout::{BatchLayout, Element, Ragged, cast_slice, cast_slice_mut};
use crate::memory::HostBuffer;

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
    /// What a batch of token rows holds beyond its fields (token loaders only).
    // Boxed: a batch of another kind carries 8 bytes for it, not the counts.
    pub(crate) tokens: Option<Box<TokenCounts>>,
}

/// What a batch of token rows ([`TokenLoader`](crate::tokens::TokenLoader)) holds, counted on
/// the host when it was made: how many sequences its `cu_seqlens` delimits and the longest (what
/// flash-attention's varlen kernels take with it), its tokens and padding, and its rows per
/// source.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenCounts {
    /// Sequences `cu_seqlens` delimits (its first `sequences + 1` entries), padding included.
    pub sequences: u64,
    /// The longest of them.
    pub max_seqlen: u64,
    /// Tokens of documents (inputs that are not padding).
    pub tokens: u64,
    /// Padding tokens (of padded rows, and of padding rows).
    pub padding: u64,
    /// Rows of each source, in the order the sources were given.
    pub rows_per_source: Vec<u64>,
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

    /// The dataset indices of its samples, in batch order. For a token batch, each row's
    /// position in the epoch's global stream, and `u64::MAX` for a padding row (see
    /// [`tokens`](crate::tokens#batches)).
    pub fn indices(&self) -> &[u64] {
        &self.indices
    }

    /// Slots that are padding, not samples of their own (only with
    /// [`LoaderBuilder::evaluation`](super::LoaderBuilder::evaluation)): always the last
    /// `padding()` slots of the batch. They hold a repeated sample, so a model can run on them;
    /// metrics must skip them. For a token batch, the rank's rows beyond its share of a short
    /// global batch: every label ignored, `document_ids` -1.
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

    /// Its number within the epoch (0-based, for this rank). For a token batch, the global
    /// batch's number, the same on every rank and continued after a resume under any world
    /// size.
    pub fn number(&self) -> u64 {
        self.number
    }

    /// Its token counts, for a batch of token rows (see [`TokenCounts`]); `None` otherwise.
    pub fn tokens(&self) -> Option<&TokenCounts> {
        self.tokens.as_deref()
    }
}

/// A collated batch: `len()` samples, each field one contiguous slice of shape `[len, ...]`;
/// a ragged field one contiguous slice of its values, `[items, ...]`, and its offsets
/// ([`Batch::ragged`]).
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
            let names: Vec<&str> = self
                .layout
                .fields()
                .iter()
                .map(|f| f.name.as_str())
                .collect();
            Error::mismatch(format!("batch has no field `{name}` (fields: {names:?})"))
        })
    }

    /// The bytes of field `k` in the buffer: its samples, or a ragged field's values.
    fn range(&self, k: usize) -> Result<std::ops::Range<usize>> {
        let slot = &self.layout.slots()[k];
        let len = match &slot.ragged {
            None => slot.sample_bytes * self.len(),
            Some(_) => {
                let items = *self.offsets_of(k)?.last().unwrap_or(&0) as usize;
                items * slot.sample_bytes
            }
        };
        Ok(slot.offset..slot.offset + len)
    }

    /// The offsets of ragged field `k`.
    fn offsets_of(&self, k: usize) -> Result<&[i64]> {
        self.layout
            .offsets_in(self.buffer.as_slice(), k, self.len())
            .ok_or_else(|| {
                Error::mismatch(format!(
                    "field `{}` is not ragged, or its offsets do not hold together",
                    self.layout.fields()[k].name
                ))
            })
    }

    /// The bytes of field `name`: `len()` samples back to back (a ragged field: its values).
    pub fn field_bytes(&self, name: &str) -> Result<&[u8]> {
        let k = self.field_index(name)?;
        Ok(&self.buffer.as_slice()[self.range(k)?])
    }

    /// Field `name` as a typed slice; `T` must match the field's dtype (`u16` views f16/bf16).
    /// For a ragged field, its values (see [`Batch::ragged`] for them with their offsets).
    pub fn field<T: Element>(&self, name: &str) -> Result<&[T]> {
        let k = self.typed_index::<T>(name)?;
        let dtype = self.layout.fields()[k].dtype;
        cast_slice(&self.buffer.as_slice()[self.range(k)?])
            .ok_or_else(|| Error::mismatch(format!("field `{name}` is not aligned for {dtype}")))
    }

    /// Field `name` as a mutable typed slice (for per-batch transforms); a ragged field's
    /// values (its offsets stay as they are).
    pub fn field_mut<T: Element>(&mut self, name: &str) -> Result<&mut [T]> {
        let k = self.typed_index::<T>(name)?;
        let dtype = self.layout.fields()[k].dtype;
        let range = self.range(k)?;
        cast_slice_mut(&mut self.buffer.as_mut_slice()[range])
            .ok_or_else(|| Error::mismatch(format!("field `{name}` is not aligned for {dtype}")))
    }

    /// The position of field `name`, which `T` must view.
    fn typed_index<T: Element>(&self, name: &str) -> Result<usize> {
        let k = self.field_index(name)?;
        let dtype = self.layout.fields()[k].dtype;
        if !T::matches(dtype) {
            return Err(Error::mismatch(format!(
                "field `{name}` is {dtype}, not {}",
                std::any::type_name::<T>()
            )));
        }
        Ok(k)
    }

    /// Ragged field `name`: its values as elements of `T` (which must match its dtype) and its
    /// offsets, `len() + 1` of them; sample `i`'s items are
    /// `values[offsets[i]..offsets[i + 1]]`. A fixed field is an [`Error::Mismatch`].
    pub fn ragged<T: Element>(&self, name: &str) -> Result<Ragged<'_, T>> {
        let k = self.typed_index::<T>(name)?;
        let field = &self.layout.fields()[k];
        if !field.ragged {
            return Err(Error::mismatch(format!(
                "field `{name}` is not ragged: read it with Batch::field"
            )));
        }
        let offsets = self.offsets_of(k)?;
        let values = &self.buffer.as_slice()[self.range(k)?];
        let item_len = field.shape.iter().product::<usize>();
        Ragged::of_bytes(values, offsets, item_len).ok_or_else(|| {
            Error::mismatch(format!(
                "ragged field `{name}`: its values are not aligned for {}",
                field.dtype
            ))
        })
    }

    /// The offsets of ragged field `name`: `len() + 1` of them, in items.
    pub fn offsets(&self, name: &str) -> Result<&[i64]> {
        let k = self.field_index(name)?;
        self.offsets_of(k)
    }

    /// The shape of field `name` in this batch: `[len(), per-sample shape...]`; for a ragged
    /// field, its values' shape: `[items in the batch, item shape...]`.
    pub fn shape(&self, name: &str) -> Result<Vec<usize>> {
        let k = self.field_index(name)?;
        let field = &self.layout.fields()[k];
        let first = if field.ragged {
            *self.offsets_of(k)?.last().unwrap_or(&0) as usize
        } else {
            self.len()
        };
        let mut shape = vec![first];
        shape.extend_from_slice(&field.shape);
        Ok(shape)
    }

    /// The dtype of field `name`.
    pub fn dtype(&self, name: &str) -> Result<DType> {
        Ok(self.layout.fields()[self.field_index(name)?].dtype)
    }

    /// Bytes of data the batch holds: its samples of every fixed field, and the values of
    /// every ragged field (not their offsets).
    pub fn data_bytes(&self) -> usize {
        (0..self.layout.fields().len())
            .filter_map(|k| self.range(k).ok())
            .map(|r| r.len())
            .sum()
    }

    /// The bytes at the start of the buffer that hold the batch: the whole buffer, less the
    /// unused end of the last ragged field's values (what a device copy moves).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn used_bytes(&self) -> usize {
        self.layout.used_bytes(self.buffer.as_slice(), self.len())
    }
}
