//! Writing rows into batches: the [`SampleTransform`] that turns a row's pieces into its
//! fields, and the per-batch step that lays out the batch's `cu_seqlens` and counts.
//!
//! A row of `seq_len` tokens is written as:
//!
//! | field | per row | what |
//! |---|---|---|
//! | `input_ids` | `[seq_len]` | the tokens, `pad_id` after the row's last |
//! | `labels` | `[seq_len]` | the next token of the stream (`labels[t] = input_ids[t + 1]`, the window's extra token for the last), `ignore_index` for padding, and, with `mask_document_ends`, for each document's last token |
//! | `position_ids` | `[seq_len]` | the place within the row's piece of its document, from 0 at each piece; 0 for padding |
//! | `document_ids` | `[seq_len]` (i32) | the piece's number within the row, from 0; -1 for padding |
//! | `cu_seqlens` | `[seq_len + 1]` (i32) | see below |
//!
//! `cu_seqlens` is the batch's, as flash-attention's varlen kernels take it: the offsets of every
//! sequence (each piece of a document, and each row's padding as one more) in the batch's
//! `rows * seq_len` tokens laid end to end, from 0 to `rows * seq_len`. It varies in length, so
//! it lives in a field of `rows * (seq_len + 1)` entries, which is enough for any batch: its
//! first [`TokenCounts::sequences`]` + 1` entries are the offsets, the rest repeat the last. The
//! count and the longest sequence ([`TokenCounts::max_seqlen`]) travel with the batch
//! ([`BatchInfo::tokens`](crate::BatchInfo::tokens)), known on the host, so a device batch needs no
//! copy back to slice it. Each row writes its own offsets in its slot; the batch step, once
//! every row is written (by however many workers), moves them into place (each moves forward,
//! so in place).

use std::cell::RefCell;
use std::sync::Arc;

use super::index::RowPiece;
use super::stream::{Shares, Stream};
use crate::error::{Error, Result};
use crate::format::{DType, Field, Schema};
use crate::layout::{OutputField, Slots, cast_slice_mut};
use crate::loader::{Batch, TokenCounts};
use crate::source::{Dataset, Sample};
use crate::transform::{SampleContext, SampleTransform};

/// The names of a token batch's fields.
pub const INPUT_IDS: &str = "input_ids";
/// Shifted tokens, with the ignore index where there is nothing to predict.
pub const LABELS: &str = "labels";
/// Places within each document's piece.
pub const POSITION_IDS: &str = "position_ids";
/// Each token's piece within its row (-1: padding).
pub const DOCUMENT_IDS: &str = "document_ids";
/// The batch's sequence offsets (see the [module docs](self)).
pub const CU_SEQLENS: &str = "cu_seqlens";

/// What labels hold where there is nothing to predict.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Labels {
    /// The label of padding (and of document ends, with `mask_document_ends`): PyTorch's
    /// `cross_entropy` ignores -100 by default.
    pub ignore_index: i64,
    /// Also ignore the label of each document's last token (the next document's first token
    /// follows it). Default: on for packed rows, off for concatenated ones (Megatron's).
    pub mask_document_ends: bool,
}

/// The dtypes of the fields that have a choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowDtypes {
    /// `input_ids`: u16, u32, i32 or i64.
    pub input_ids: DType,
    /// `labels`: i32 or i64.
    pub labels: DType,
    /// `position_ids`: i32 or i64.
    pub position_ids: DType,
}

impl RowDtypes {
    /// Checks the choices (a fault names the field).
    pub(crate) fn check(&self, labels: &Labels, seq_len: u64) -> Result<()> {
        if !matches!(
            self.input_ids,
            DType::U16 | DType::U32 | DType::I32 | DType::I64
        ) {
            return Err(Error::config(
                "input_dtype",
                format!("{} is not one of u16, u32, i32, i64", self.input_ids),
            ));
        }
        for (setting, d) in [
            ("label_dtype", self.labels),
            ("position_dtype", self.position_ids),
        ] {
            if !matches!(d, DType::I32 | DType::I64) {
                return Err(Error::config(
                    setting,
                    format!("{d} is not one of i32, i64"),
                ));
            }
        }
        if self.labels == DType::I32 && i32::try_from(labels.ignore_index).is_err() {
            return Err(Error::config(
                "ignore_index",
                format!("{} does not fit i32 labels", labels.ignore_index),
            ));
        }
        if self.position_ids == DType::I32 && seq_len > i32::MAX as u64 {
            return Err(Error::config(
                "position_dtype",
                "rows this long have positions past i32",
            ));
        }
        Ok(())
    }

    /// The padding token checked against `input_ids`' dtype.
    pub(crate) fn check_pad(&self, pad_id: u32) -> Result<()> {
        let fits = match self.input_ids {
            DType::U16 => pad_id <= u32::from(u16::MAX),
            DType::I32 => pad_id <= i32::MAX as u32,
            _ => true,
        };
        if fits {
            Ok(())
        } else {
            Err(Error::config(
                "pad_id",
                format!("{pad_id} does not fit {} input_ids", self.input_ids),
            ))
        }
    }

    /// The dtypes to write on the host when the device widens them to these after the copy,
    /// with the fields to widen: `input_ids` cross as u16 when every source stores 16-bit
    /// tokens (and the padding token fits), else as u32 when they are to be i64; `labels` as
    /// i32 when the tokens are 16-bit (and the ignore index fits, as `check` made sure for
    /// i32 labels); `position_ids` as u16 when rows are at most 65,536 tokens.
    #[cfg(any(feature = "cuda", test))]
    pub(crate) fn wire(
        &self,
        sources: &[DType],
        seq_len: u64,
        labels: &Labels,
        pad_id: u32,
    ) -> (RowDtypes, Vec<(&'static str, DType)>) {
        let short_tokens = sources
            .iter()
            .all(|d| matches!(d, DType::U8 | DType::U16 | DType::I16));
        let mut wire = *self;
        let mut widen = Vec::new();
        let wide = |d: DType| matches!(d, DType::I32 | DType::I64);
        if wide(self.input_ids) {
            let narrow = if short_tokens && pad_id <= u32::from(u16::MAX) {
                Some(DType::U16)
            } else if self.input_ids == DType::I64 {
                Some(DType::U32)
            } else {
                None
            };
            if let Some(n) = narrow {
                wire.input_ids = n;
                widen.push((INPUT_IDS, self.input_ids));
            }
        }
        if self.labels == DType::I64 && short_tokens && i32::try_from(labels.ignore_index).is_ok() {
            wire.labels = DType::I32;
            widen.push((LABELS, DType::I64));
        }
        if seq_len <= 1 << 16 {
            wire.position_ids = DType::U16;
            widen.push((POSITION_IDS, self.position_ids));
        }
        (wire, widen)
    }
}

/// The fields of a row of `seq_len` tokens.
pub(crate) fn fields(seq_len: usize, dtypes: &RowDtypes) -> Vec<OutputField> {
    vec![
        OutputField::new(INPUT_IDS, dtypes.input_ids, &[seq_len]),
        OutputField::new(LABELS, dtypes.labels, &[seq_len]),
        OutputField::new(POSITION_IDS, dtypes.position_ids, &[seq_len]),
        OutputField::new(DOCUMENT_IDS, DType::I32, &[seq_len]),
        OutputField::new(CU_SEQLENS, DType::I32, &[seq_len + 1]),
    ]
}

/// The rows of this rank, as a dataset the loader orders: sample `i` is row `i % rows` of
/// global batch `i / rows`. A row depends on the epoch, which `Dataset::get` is not told, so
/// the samples are empty and [`RowWriter`] makes each row from its context.
pub(crate) struct RowSlots {
    pub stream: Arc<Stream>,
    pub len: u64,
    schema: Schema,
}

/// The one byte of an empty row sample.
static EMPTY: [u8; 1] = [0];

impl RowSlots {
    pub(crate) fn new(stream: Arc<Stream>, len: u64) -> Result<RowSlots> {
        Ok(RowSlots {
            stream,
            len,
            schema: Schema::new(vec![Field::tensor("row", DType::U8, &[])])?,
        })
    }
}

impl Dataset for RowSlots {
    fn len(&self) -> u64 {
        self.len
    }

    fn schema(&self) -> &Schema {
        &self.schema
    }

    fn get(&self, index: u64) -> Result<Sample<'_>> {
        if index >= self.len {
            return Err(Error::OutOfRange {
                index,
                len: self.len,
            });
        }
        Ok(Sample::new(&EMPTY, &self.schema))
    }

    fn check_unchanged(&self) -> Result<()> {
        self.stream
            .sources
            .iter()
            .try_for_each(|s| s.check_unchanged())
    }
}

/// Writes each row of a rank's batches (see the [module docs](self)).
pub(crate) struct RowWriter {
    pub stream: Arc<Stream>,
    pub shares: Shares,
    pub seq_len: usize,
    pub dtypes: RowDtypes,
    pub labels: Labels,
    pub pad_id: u32,
}

/// A worker's memory for one row: its pieces and its tokens (`seq_len + 1`).
#[derive(Default)]
struct RowScratch {
    pieces: Vec<RowPiece>,
    tokens: Vec<u32>,
    segments: Vec<(usize, bool)>,
}

thread_local! {
    static ROW: RefCell<RowScratch> = RefCell::new(RowScratch::default());
}

impl SampleTransform for RowWriter {
    fn output(&self, _input: &Schema) -> Result<Vec<OutputField>> {
        Ok(fields(self.seq_len, &self.dtypes))
    }

    fn apply(&self, _sample: Sample<'_>, ctx: &SampleContext, slots: &mut Slots<'_>) -> Result<()> {
        let rows = self.shares.rows();
        let (batch, j) = (ctx.index / rows, ctx.index % rows);
        ROW.with(|scratch| {
            let scratch = &mut *scratch.borrow_mut();
            scratch.pieces.clear();
            scratch.tokens.clear();
            if let Some(g) = self.shares.position(batch, j) {
                self.stream
                    .row(ctx.epoch, g, &mut scratch.pieces, &mut scratch.tokens)?;
            }
            self.write(scratch, slots)
        })
    }
}

impl RowWriter {
    /// Writes the row whose pieces and tokens `scratch` holds into `slots`.
    fn write(&self, scratch: &mut RowScratch, slots: &mut Slots<'_>) -> Result<()> {
        let len = self.seq_len;
        let window = &scratch.tokens;
        let inputs = window.len().min(len);
        // The row's sequences over its inputs: each piece cut at `len`, then the padding.
        let segments = &mut scratch.segments;
        segments.clear();
        let mut at = 0usize;
        for p in &scratch.pieces {
            if at >= len {
                break;
            }
            let end = (at + p.len as usize).min(len);
            let ends = p.ends_doc && at + p.len as usize <= len;
            if end > at {
                segments.push((end, ends));
            }
            at = end;
        }
        let padded = inputs < len;
        if padded {
            segments.push((len, false));
        }
        let max = window.iter().copied().max().unwrap_or(0);
        let fits = |d: DType| match d {
            DType::U16 => max <= u32::from(u16::MAX),
            DType::I32 => max <= i32::MAX as u32,
            _ => true,
        };
        for (d, setting) in [
            (self.dtypes.input_ids, INPUT_IDS),
            (self.dtypes.labels, LABELS),
        ] {
            if !fits(d) {
                return Err(Error::config(
                    if setting == INPUT_IDS {
                        "input_dtype"
                    } else {
                        "label_dtype"
                    },
                    format!("token {max} does not fit {d} {setting}"),
                ));
            }
        }
        let pad = u64::from(self.pad_id);
        let ignore = self.labels.ignore_index;
        let mask_ends = self.labels.mask_document_ends;
        write_ints(slots.field(0)?, self.dtypes.input_ids, len, |t| {
            if t < inputs {
                i64::from(window[t])
            } else {
                pad as i64
            }
        })?;
        // A label is ignored past the tokens, and (masking) at a document's last token.
        let mut ends = vec_of_ends(segments, mask_ends, padded);
        ends.sort_unstable();
        let mut e = 0usize;
        write_ints(slots.field(1)?, self.dtypes.labels, len, |t| {
            while e < ends.len() && ends[e] < t {
                e += 1;
            }
            if t + 1 >= window.len().max(1) || t >= inputs || ends.get(e) == Some(&t) {
                ignore
            } else {
                i64::from(window[t + 1])
            }
        })?;
        // Positions and piece numbers: walk the segments.
        let (mut s, mut start) = (0usize, 0usize);
        let last_real = segments.len() - usize::from(padded);
        write_ints(slots.field(2)?, self.dtypes.position_ids, len, |t| {
            while t >= segments[s].0 {
                start = segments[s].0;
                s += 1;
            }
            if s >= last_real {
                0
            } else {
                (t - start) as i64
            }
        })?;
        let mut s = 0usize;
        write_ints(slots.field(3)?, DType::I32, len, |t| {
            while t >= segments[s].0 {
                s += 1;
            }
            if s >= last_real { -1 } else { s as i64 }
        })?;
        // This row's own offsets: the count, then each sequence's end; the batch step moves
        // them into the batch's `cu_seqlens`.
        let cu: &mut [i32] = cast_slice_mut(slots.field(4)?)
            .ok_or_else(|| Error::user("cu_seqlens slot is not aligned"))?;
        cu[0] = segments.len() as i32;
        for (k, &(end, _)) in segments.iter().enumerate() {
            cu[k + 1] = end as i32;
        }
        cu[segments.len() + 1..].fill(0);
        Ok(())
    }

    /// The batch step (a loader's batch hook): `cu_seqlens` laid out for the batch, the
    /// rows' global positions as the batch's indices (`u64::MAX` for padding rows), and the
    /// batch's [`TokenCounts`].
    pub(crate) fn finish(&self, batch: &mut Batch) -> Result<()> {
        let rows = self.shares.rows();
        let len = self.seq_len;
        let number = batch.info.number;
        let mut counts = TokenCounts {
            rows_per_source: vec![0; self.stream.sources.len()],
            ..TokenCounts::default()
        };
        let mut indices = Vec::with_capacity(rows as usize);
        for j in 0..rows {
            match self.shares.position(number, j) {
                Some(g) => {
                    indices.push(g);
                    counts.rows_per_source[self.stream.blend.source_at(g).0] += 1;
                }
                None => indices.push(u64::MAX),
            }
        }
        let padding_rows = indices.iter().filter(|&&g| g == u64::MAX).count();
        // Padding tokens: rows whose last token is padding end with one padding sequence.
        let document_ids = batch.field::<i32>(DOCUMENT_IDS)?;
        let padded: Vec<bool> = (0..rows as usize)
            .map(|r| document_ids[r * len + len - 1] == -1)
            .collect();
        let cu = batch.field_mut::<i32>(CU_SEQLENS)?;
        let stride = len + 1;
        let mut out = 1usize;
        let mut max = 0u64;
        let mut pad_tokens = 0u64;
        for (r, &padded) in padded.iter().enumerate() {
            let count = cu[r * stride] as usize;
            let base = (r * len) as i64;
            let mut prev = 0i64;
            for k in 0..count {
                let end = i64::from(cu[r * stride + 1 + k]);
                let seq = (end - prev) as u64;
                max = max.max(seq);
                if padded && k + 1 == count {
                    pad_tokens += seq;
                }
                prev = end;
                // Writes stay behind reads: `out` <= 1 + r * len + k < r * stride + 1 + k.
                cu[out] = (base + end) as i32;
                out += 1;
            }
        }
        cu[0] = 0;
        let total = (rows as usize * len) as i32;
        cu[out..].fill(total);
        counts.sequences = (out - 1) as u64;
        counts.max_seqlen = max;
        counts.padding = pad_tokens;
        counts.tokens = rows * len as u64 - pad_tokens;
        batch.info.indices = indices;
        batch.info.padding = padding_rows;
        batch.info.tokens = Some(Box::new(counts));
        Ok(())
    }
}

/// The places whose label a row ignores besides padding: each document's last token (with
/// `mask`), as sorted positions.
fn vec_of_ends(segments: &[(usize, bool)], mask: bool, padded: bool) -> Vec<usize> {
    if !mask {
        return Vec::new();
    }
    let real = &segments[..segments.len() - usize::from(padded)];
    real.iter()
        .filter(|(_, ends)| *ends)
        .map(|&(end, _)| end - 1)
        .collect()
}

/// Writes `len` integers `value(t)` into `slot` as `dtype` (u16, u32, i32 or i64; the caller
/// checked that every value fits).
fn write_ints(
    slot: &mut [u8],
    dtype: DType,
    len: usize,
    mut value: impl FnMut(usize) -> i64,
) -> Result<()> {
    fn typed<T: crate::layout::Element>(slot: &mut [u8], len: usize) -> Result<&mut [T]> {
        cast_slice_mut::<T>(slot)
            .filter(|s| s.len() == len)
            .ok_or_else(|| Error::user("a token field's slot is not aligned or not a row long"))
    }
    match dtype {
        DType::U16 => typed::<u16>(slot, len)?
            .iter_mut()
            .enumerate()
            .for_each(|(t, o)| *o = value(t) as u16),
        DType::U32 => typed::<u32>(slot, len)?
            .iter_mut()
            .enumerate()
            .for_each(|(t, o)| *o = value(t) as u32),
        DType::I32 => typed::<i32>(slot, len)?
            .iter_mut()
            .enumerate()
            .for_each(|(t, o)| *o = value(t) as i32),
        DType::I64 => typed::<i64>(slot, len)?
            .iter_mut()
            .enumerate()
            .for_each(|(t, o)| *o = value(t)),
        other => {
            return Err(Error::user(format!("{other} is not a token field dtype")));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const I64: RowDtypes = RowDtypes {
        input_ids: DType::I64,
        labels: DType::I64,
        position_ids: DType::I64,
    };
    const LABELS: Labels = Labels {
        ignore_index: -100,
        mask_document_ends: false,
    };

    #[test]
    fn the_wire_is_narrow_where_every_value_fits_and_wide_where_one_may_not() {
        // 16-bit tokens, rows of 8,192: u16 ids and positions, i32 labels.
        let (wire, widen) = I64.wire(&[DType::U16, DType::U16], 8192, &LABELS, 0);
        assert_eq!(
            (wire.input_ids, wire.labels, wire.position_ids),
            (DType::U16, DType::I32, DType::U16)
        );
        assert_eq!(
            widen,
            [
                (INPUT_IDS, DType::I64),
                (super::LABELS, DType::I64),
                (POSITION_IDS, DType::I64)
            ]
        );
        // A 32-bit source in the blend: ids as u32, labels stay i64 (ids past i32 may exist).
        let (wire, widen) = I64.wire(&[DType::U16, DType::I32], 8192, &LABELS, 0);
        assert_eq!((wire.input_ids, wire.labels), (DType::U32, DType::I64));
        assert_eq!(widen.len(), 2);
        // A padding token past u16: ids as u32.
        let (wire, _) = I64.wire(&[DType::U16], 8192, &LABELS, 70_000);
        assert_eq!(wire.input_ids, DType::U32);
        // An ignore index past i32: labels stay i64.
        let far = Labels {
            ignore_index: 1 << 40,
            ..LABELS
        };
        let (wire, _) = I64.wire(&[DType::U16], 8192, &far, 0);
        assert_eq!(wire.labels, DType::I64);
        // Rows of 65,536 tokens have positions up to 65,535 (u16); longer ones do not.
        assert_eq!(
            I64.wire(&[DType::U16], 1 << 16, &LABELS, 0).0.position_ids,
            DType::U16
        );
        assert_eq!(
            I64.wire(&[DType::U16], (1 << 16) + 1, &LABELS, 0)
                .0
                .position_ids,
            DType::I64
        );
        // i32 ids from u32 tokens cannot be widened: they cross as they are.
        let i32_ids = RowDtypes {
            input_ids: DType::I32,
            ..I64
        };
        let (wire, widen) = i32_ids.wire(&[DType::U32], 8192, &LABELS, 0);
        assert_eq!(wire.input_ids, DType::I32);
        assert!(widen.iter().all(|(f, _)| *f != INPUT_IDS));
        // Ids already narrow are not widened.
        let u16_ids = RowDtypes {
            input_ids: DType::U16,
            ..I64
        };
        let (wire, widen) = u16_ids.wire(&[DType::U16], 8192, &LABELS, 0);
        assert_eq!(wire.input_ids, DType::U16);
        assert!(widen.iter().all(|(f, _)| *f != INPUT_IDS));
    }
}
