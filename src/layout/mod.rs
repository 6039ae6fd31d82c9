//! What a batch is made of, wherever its memory is: its fields ([`OutputField`]), their places
//! in one buffer ([`BatchLayout`]), the element types a field is viewed as ([`Element`]), the
//! window through which a transform writes one sample ([`Slots`]), and the values and offsets
//! of a ragged field ([`Ragged`]).
//!
//! This is the vocabulary that sources (typed sample views), transforms (what they write), the
//! loader (how it lays out and hands on batches) and the GPU path (device views) share; it
//! depends on nothing above [`format`](crate::format) (dtypes and schemas). A batch's fields
//! live back to back in one buffer, each at a 256-byte aligned offset, so a whole
//! batch is one host-to-device copy.
//!
//! # Ragged fields
//!
//! A field whose samples differ in size (text, token ids, encoded images) is *ragged*: each
//! sample holds any number of *items* of the field's shape (its element shape; a scalar for
//! bytes or tokens). A batch holds it as one values buffer, the items of its samples back to
//! back in sample order, and `offsets`, `len + 1` `i64`s, sample `i`'s items being
//! `values[offsets[i]..offsets[i + 1]]`: the layout of PyTorch's jagged nested tensors and of
//! flash-attention's `cu_seqlens`. Both live in the batch's one buffer, after the fixed fields:
//! the offsets, then the values, in a region of the field's byte budget, so every batch
//! buffer has the same size and a batch is still one copy (of the bytes in use only).
//!
//! A transform learns a sample's length before it writes it: [`Slots::ragged_mut`] takes the
//! number of items and hands out exactly that many. A batch made in parts by several workers
//! ([`LoaderBuilder::batch_parts`](crate::LoaderBuilder::batch_parts)) gives each part its
//! share of the budget, in proportion to its samples; the part that finishes last moves the
//! parts' values together (a part whose samples outgrow its share keeps the rest aside and
//! the last part puts it in place). A batch whose values exceed the budget is an error of
//! kind `Config` naming the field, the batch and the setting (`ragged_budget`), never a
//! truncated batch.

mod element;
mod ragged;
mod slots;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::format::{DType, Field, FieldKind, Schema};

pub use element::Element;
pub(crate) use element::{cast_slice, cast_slice_mut, element_name};
pub use ragged::Ragged;
pub(crate) use ragged::{RaggedPart, over_budget, seal, words_as_bytes};
pub(crate) use slots::BatchBytes;
pub use slots::Slots;

/// One field of a batch: every sample of the batch has this dtype and shape, or, for a ragged
/// field, any number of items of this dtype and shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct OutputField {
    /// The field's name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape of one sample (the batch adds a leading dimension); for a ragged field, the shape
    /// of one item (empty for scalar items: bytes, tokens).
    pub shape: Vec<usize>,
    /// True for a ragged field: each sample holds a number of items of its own, and the batch
    /// holds the field as values plus offsets (see the [module docs](self#ragged-fields)).
    #[serde(default)]
    pub ragged: bool,
}

impl OutputField {
    /// A field called `name` of `dtype` and per-sample `shape`.
    pub fn new(name: impl Into<String>, dtype: DType, shape: &[usize]) -> OutputField {
        OutputField {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            ragged: false,
        }
    }

    /// A ragged field called `name`: each sample a variable number of items of `dtype` and
    /// `item_shape` (`&[]` for scalar items: bytes, token ids).
    pub fn ragged(name: impl Into<String>, dtype: DType, item_shape: &[usize]) -> OutputField {
        OutputField {
            ragged: true,
            ..OutputField::new(name, dtype, item_shape)
        }
    }

    /// The output field that holds field `name` of `input` as it is stored: the same name,
    /// dtype and shape for a tensor field; for a variable-size bytes field, a ragged field of
    /// its bytes (`u8`), or of the dtype of its values for [`Codec::Elements`]. For transforms
    /// whose output follows their input (see
    /// [`FnTransform::with_output`](crate::transform::FnTransform::with_output)); a field that
    /// is not in `input` is an [`Error::Mismatch`] naming it.
    ///
    /// [`Codec::Elements`]: crate::format::Codec::Elements
    pub fn like(input: &Schema, name: &str) -> Result<OutputField> {
        let field = input
            .index_of(name)
            .map(|k| &input.fields()[k])
            .ok_or_else(|| {
                Error::mismatch(format!(
                    "no field `{name}` in the dataset's schema [{input}]"
                ))
            })?;
        Ok(OutputField::stored(field))
    }

    /// The output field that holds `field` as it is stored (see [`OutputField::like`]).
    pub(crate) fn stored(field: &Field) -> OutputField {
        match &field.kind {
            FieldKind::Tensor { dtype, shape } => OutputField {
                name: field.name.clone(),
                dtype: *dtype,
                shape: shape.iter().map(|&d| d as usize).collect(),
                ragged: false,
            },
            FieldKind::Bytes { codec } => {
                OutputField::ragged(field.name.clone(), codec.element_dtype(), &[])
            }
        }
    }

    /// True for a ragged field.
    pub fn is_ragged(&self) -> bool {
        self.ragged
    }

    /// Bytes one sample of this field takes; for a ragged field, whose samples vary, 0 (see
    /// [`item_bytes`](Self::item_bytes)).
    pub fn sample_bytes(&self) -> usize {
        if self.ragged { 0 } else { self.item_bytes() }
    }

    /// Bytes of one value of the field's shape: a sample of a fixed field, an item of a
    /// ragged one.
    pub fn item_bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

/// Where each field of a batch lives in its buffer.
///
/// Fixed fields come first, in their order, each at a 256-byte aligned offset; then, for each
/// ragged field, its `batch_size + 1` offsets (`i64`); then each ragged field's values, in a
/// region of its byte budget. Every offset is a multiple of 256.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchLayout {
    fields: Vec<OutputField>,
    slots: Vec<FieldSlot>,
    batch_size: usize,
    total_bytes: usize,
}

/// Field offsets in a batch buffer are multiples of this (what device copies and SIMD like).
pub(crate) const FIELD_ALIGN: usize = 256;

impl BatchLayout {
    /// The layout of batches of `batch_size` samples of these fields, which must all be fixed
    /// (a ragged field needs its budget: [`BatchLayout::with_budgets`]).
    pub fn new(fields: Vec<OutputField>, batch_size: usize) -> Result<BatchLayout> {
        BatchLayout::with_budgets(fields, batch_size, |_| None)
    }

    /// The layout of batches of `batch_size` samples of these fields, the values of each ragged
    /// field in a region of `budget(field)` bytes (rounded down to whole items). A ragged field
    /// without a budget, a budget that holds no item, or items of no bytes, are
    /// [`Error::InvalidConfig`]s naming `ragged_budget`.
    pub fn with_budgets(
        fields: Vec<OutputField>,
        batch_size: usize,
        budget: impl Fn(&OutputField) -> Option<u64>,
    ) -> Result<BatchLayout> {
        if fields.is_empty() {
            return Err(Error::config(
                "transform",
                "the transform declares no output field",
            ));
        }
        let too_large = || Error::config("batch_size", "a batch would not fit in memory");
        let mut offset = 0usize;
        let mut slots = Vec::with_capacity(fields.len());
        for f in &fields {
            let sample_bytes = f.item_bytes();
            slots.push(FieldSlot {
                offset,
                sample_bytes,
                ragged: None,
            });
            if f.ragged {
                continue;
            }
            let field_bytes = sample_bytes.checked_mul(batch_size).ok_or_else(too_large)?;
            offset = (offset + field_bytes).next_multiple_of(FIELD_ALIGN);
        }
        let offsets_bytes = batch_size
            .checked_add(1)
            .and_then(|n| n.checked_mul(8))
            .ok_or_else(too_large)?;
        for (slot, f) in slots.iter_mut().zip(&fields) {
            if f.ragged {
                slot.ragged = Some(RaggedSlot {
                    offsets: offset,
                    capacity: 0,
                });
                offset = (offset + offsets_bytes).next_multiple_of(FIELD_ALIGN);
            }
        }
        for (slot, f) in slots.iter_mut().zip(&fields) {
            let Some(ragged) = &mut slot.ragged else {
                continue;
            };
            if slot.sample_bytes == 0 {
                return Err(Error::config(
                    "ragged_budget",
                    format!(
                        "ragged field `{}` has items of no bytes (shape {:?})",
                        f.name, f.shape
                    ),
                ));
            }
            let bytes = budget(f).ok_or_else(|| {
                Error::config(
                    "ragged_budget",
                    format!(
                        "ragged field `{}` has no byte budget for its values in a batch",
                        f.name
                    ),
                )
            })?;
            let bytes = usize::try_from(bytes).map_err(|_| too_large())?;
            let capacity = bytes / slot.sample_bytes * slot.sample_bytes;
            if capacity == 0 {
                return Err(Error::config(
                    "ragged_budget",
                    format!(
                        "a budget of {bytes} bytes holds no item of ragged field `{}` ({} bytes each)",
                        f.name, slot.sample_bytes
                    ),
                ));
            }
            slot.offset = offset;
            ragged.capacity = capacity;
            offset = offset
                .checked_add(capacity)
                .ok_or_else(too_large)?
                .next_multiple_of(FIELD_ALIGN);
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

    /// Bytes of one sample, all fixed fields together (ragged fields, whose samples vary, are
    /// not counted: a batch's [`data_bytes`](crate::Batch::data_bytes) counts what it holds).
    pub fn sample_bytes(&self) -> usize {
        self.slots
            .iter()
            .filter(|s| s.ragged.is_none())
            .map(|s| s.sample_bytes)
            .sum()
    }

    /// The byte offset of field `k` in a batch buffer: of its first sample, or of a ragged
    /// field's values.
    pub fn field_offset(&self, k: usize) -> Option<usize> {
        self.slots.get(k).map(|s| s.offset)
    }

    /// The byte offset of ragged field `k`'s offsets (`batch_size + 1` `i64`s); `None` for a
    /// fixed field.
    pub fn offsets_offset(&self, k: usize) -> Option<usize> {
        self.slots.get(k)?.ragged.as_ref().map(|r| r.offsets)
    }

    /// The bytes of values a batch can hold in ragged field `k` (its budget, in whole items);
    /// `None` for a fixed field.
    pub fn ragged_capacity(&self, k: usize) -> Option<usize> {
        self.slots.get(k)?.ragged.as_ref().map(|r| r.capacity)
    }

    /// True when a field is ragged.
    pub fn has_ragged(&self) -> bool {
        self.fields.iter().any(|f| f.ragged)
    }

    /// The position of the field called `name`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.fields.iter().position(|f| f.name == name)
    }

    pub(crate) fn slots(&self) -> &[FieldSlot] {
        &self.slots
    }

    /// The offsets of ragged field `k` in a sealed batch of `len` samples held in `buffer`
    /// (laid out by this layout): `len + 1` of them, checked to rise from 0 within the field's
    /// capacity; `None` for a fixed field or offsets that do not hold together.
    pub(crate) fn offsets_in<'b>(
        &self,
        buffer: &'b [u8],
        k: usize,
        len: usize,
    ) -> Option<&'b [i64]> {
        let slot = self.slots.get(k)?;
        let ragged = slot.ragged.as_ref()?;
        let bytes = buffer.get(ragged.offsets..ragged.offsets + 8 * (len + 1))?;
        let offsets = cast_slice::<i64>(bytes)?;
        let last = *offsets.last()?;
        let fits = usize::try_from(last)
            .ok()
            .and_then(|n| n.checked_mul(slot.sample_bytes))
            .is_some_and(|b| b <= ragged.capacity);
        (offsets[0] == 0 && fits).then_some(offsets)
    }

    /// The bytes of `buffer` that hold a sealed batch of `len` samples: the whole buffer, less
    /// the unused end of the last ragged field's values (what a device copy needs to move).
    pub(crate) fn used_bytes(&self, buffer: &[u8], len: usize) -> usize {
        let last = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.ragged.is_some())
            .max_by_key(|(_, s)| s.offset);
        let Some((k, slot)) = last else {
            return self.total_bytes.min(buffer.len());
        };
        let items = self
            .offsets_in(buffer, k, len)
            .and_then(|o| o.last().copied())
            .map_or(0, |n| n as usize);
        (slot.offset + items * slot.sample_bytes).min(buffer.len())
    }
}

/// Where one output field lives in a batch buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct FieldSlot {
    /// The field's first sample; a ragged field's values.
    pub offset: usize,
    /// Bytes per sample; a ragged field's bytes per item.
    pub sample_bytes: usize,
    /// Where a ragged field's offsets are, and its values' room.
    pub ragged: Option<RaggedSlot>,
}

/// The offsets and the room for values of a ragged field in a batch buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RaggedSlot {
    /// The byte offset of its `batch_size + 1` `i64` offsets.
    pub offsets: usize,
    /// Bytes of values a batch can hold (whole items), from [`FieldSlot::offset`] on.
    pub capacity: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::format::Field;

    #[test]
    fn output_like_copies_a_tensor_field_and_makes_bytes_ragged() {
        use crate::format::Codec;
        let schema = Schema::new(vec![
            Field::tensor("x", DType::BF16, &[2, 3]),
            Field::bytes("jpg", Codec::Jpeg),
            Field::bytes("tokens", Codec::Elements(DType::U16)),
        ])
        .unwrap();
        assert_eq!(
            OutputField::like(&schema, "x").unwrap(),
            OutputField::new("x", DType::BF16, &[2, 3])
        );
        let jpg = OutputField::like(&schema, "jpg").unwrap();
        assert_eq!(jpg, OutputField::ragged("jpg", DType::U8, &[]));
        assert!(jpg.is_ragged() && jpg.sample_bytes() == 0 && jpg.item_bytes() == 1);
        assert_eq!(
            OutputField::like(&schema, "tokens").unwrap(),
            OutputField::ragged("tokens", DType::U16, &[])
        );
        let e = OutputField::like(&schema, "y").unwrap_err();
        assert!(e.to_string().contains("no field `y`"), "{e}");
    }

    #[test]
    fn ragged_fields_go_after_the_fixed_ones_offsets_then_values() {
        let fields = vec![
            OutputField::ragged("text", DType::U8, &[]),
            OutputField::new("label", DType::I64, &[]),
            OutputField::ragged("points", DType::F32, &[3]),
        ];
        let budget = |f: &OutputField| Some(if f.name == "text" { 1000 } else { 100 });
        let layout = BatchLayout::with_budgets(fields.clone(), 10, budget).unwrap();
        assert_eq!(layout.field_offset(1), Some(0));
        // Offsets: 11 i64 each, at 256 and 512.
        assert_eq!(layout.offsets_offset(0), Some(256));
        assert_eq!(layout.offsets_offset(2), Some(512));
        assert_eq!(layout.offsets_offset(1), None);
        // Values: text's 1000 bytes at 768; points' 100 bytes hold 8 items of 12 bytes.
        assert_eq!(layout.field_offset(0), Some(768));
        assert_eq!(layout.ragged_capacity(0), Some(1000));
        assert_eq!(layout.field_offset(2), Some(768 + 1024));
        assert_eq!(layout.ragged_capacity(2), Some(96));
        assert_eq!(layout.total_bytes(), 768 + 1024 + 256);
        assert_eq!(layout.sample_bytes(), 8);
        assert!(layout.has_ragged());
        // A ragged field without a budget, or with one too small for an item.
        let e = BatchLayout::new(fields.clone(), 10).unwrap_err();
        assert!(e.to_string().contains("`ragged_budget`") && e.to_string().contains("`text`"));
        let e = BatchLayout::with_budgets(fields, 10, |_| Some(11)).unwrap_err();
        assert!(
            e.to_string()
                .contains("holds no item of ragged field `points`"),
            "{e}"
        );
    }
}
