//! What a batch is made of, wherever its memory is: its fields ([`OutputField`]), their places
//! in one buffer ([`BatchLayout`]), the element types a field is viewed as ([`Element`]), and
//! the window through which a transform writes one sample ([`Slots`]).
//!
//! This is the vocabulary that sources (typed sample views), transforms (what they write), the
//! loader (how it lays out and hands on batches) and the GPU path (device views) share; it
//! depends on nothing above [`format`](crate::format) (dtypes and schemas). A batch's fields
//! live back to back in one buffer, each at a 256-byte aligned offset, so a whole
//! batch is one host-to-device copy.

mod element;
mod slots;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::format::{DType, FieldKind, Schema};

pub use element::Element;
pub(crate) use element::{cast_slice, cast_slice_mut, element_name};
pub(crate) use slots::BatchBytes;
pub use slots::Slots;

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
    /// [`FnTransform::with_output`](crate::transform::FnTransform::with_output)); a field that is not in `input`, or holds variable-size
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

/// Where each field of a batch lives in its buffer.
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

/// Where one output field lives in a batch buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct FieldSlot {
    pub offset: usize,
    pub sample_bytes: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::format::Field;

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
}
