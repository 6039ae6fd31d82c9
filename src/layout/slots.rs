//! [`Slots`]: the bytes of one sample's slots in a batch buffer, as a transform writes them, and
//! the checks that every byte of every slot was written.

use super::ragged::{RaggedPart, over_budget};
use super::{Element, FieldSlot, OutputField, cast_slice_mut, element_name};
use crate::error::{Error, Result};

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
/// are placeholders that the training loop masks (a ragged field it did not write holds no
/// item for it).
///
/// A ragged field (see [the layout's docs](super#ragged-fields)) has no slot of a fixed size:
/// the transform asks for room for the number of items the sample has, with
/// [`ragged_mut`](Slots::ragged_mut) (or [`ragged`](Slots::ragged), as bytes), and must write
/// all of it, as for a fixed slot; asking again for the same sample replaces what it asked
/// for before.
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
    /// Where this part of the batch writes each ragged field's values, in field order.
    ragged: &'a mut [RaggedPart],
    /// Slots were filled with the marker (`fill_marker`): so is ragged room when handed out.
    marker: bool,
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
    /// `touched` (one entry per field) is scratch space, reset here; `ragged` holds the regions
    /// of the ragged fields' values (one per ragged field).
    pub(crate) fn new(
        buffer: &'a mut [u8],
        fields: &'a [OutputField],
        slots: &'a [FieldSlot],
        position: usize,
        touched: &'a mut [bool],
        ragged: &'a mut [RaggedPart],
    ) -> Slots<'a> {
        // SAFETY: `buffer` is borrowed exclusively for `'a`, so this is the only `Slots` on it.
        unsafe {
            Slots::for_position(
                BatchBytes::new(buffer),
                fields,
                slots,
                position,
                touched,
                ragged,
            )
        }
    }

    /// Like [`new`](Self::new), on a buffer whose other samples other threads may be writing.
    /// The sample's length in each ragged field is set to 0 until the transform asks for room.
    ///
    /// # Safety
    /// While this `Slots` lives, no other `Slots` of the same `position` on `buffer` may exist
    /// (each worker writes positions no other worker writes), `slots` must be the layout
    /// the buffer was laid out with, so that positions' slots do not overlap, and the regions
    /// of `ragged` must be this worker's alone (parts of a batch get disjoint regions:
    /// [`RaggedPart::for_positions`]).
    pub(crate) unsafe fn for_position(
        buffer: BatchBytes<'a>,
        fields: &'a [OutputField],
        slots: &'a [FieldSlot],
        position: usize,
        touched: &'a mut [bool],
        ragged: &'a mut [RaggedPart],
    ) -> Slots<'a> {
        debug_assert_eq!(fields.len(), slots.len());
        debug_assert_eq!(touched.len(), slots.len());
        touched.fill(false);
        let mut s = Slots {
            buffer,
            fields,
            slots,
            position,
            skipped: false,
            touched,
            ragged,
            marker: false,
        };
        for k in 0..s.ragged.len() {
            s.ragged[k].begin_sample();
            let field = s.ragged[k].field;
            // A layout's offsets always lie in its buffers; a broken one fails in `ragged`.
            let _ = s.set_length(field, 0);
        }
        s
    }

    /// Writes this sample's length (in items) in ragged field `k`'s offsets, at `position + 1`
    /// (sealing the batch turns lengths into offsets).
    fn set_length(&mut self, k: usize, items: usize) -> Result<()> {
        let at = self.slots[k]
            .ragged
            .as_ref()
            .map(|r| r.offsets + 8 * (self.position + 1))
            .ok_or_else(|| Error::user("not a ragged field"))?;
        let range = self.checked(at..at + 8)?;
        let items = i64::try_from(items).map_err(|_| Error::user("too many items"))?;
        self.bytes_mut(range).copy_from_slice(&items.to_le_bytes());
        Ok(())
    }

    /// `range`, if it lies inside the buffer.
    fn checked(&self, range: std::ops::Range<usize>) -> Result<std::ops::Range<usize>> {
        if range.start > range.end || range.end > self.buffer.len {
            return Err(Error::user("slot outside the batch buffer"));
        }
        Ok(range)
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
    /// [`output`](crate::transform::SampleTransform::output) declared).
    pub fn fields(&self) -> &[OutputField] {
        self.fields
    }

    /// This sample's position within its batch.
    pub fn position(&self) -> usize {
        self.position
    }

    fn slot(&self, k: usize) -> Result<&'a FieldSlot> {
        self.slots.get(k).ok_or_else(|| {
            Error::user(format!(
                "output field {k} does not exist ({} fields)",
                self.fields.len()
            ))
        })
    }

    fn range(&self, k: usize) -> Result<std::ops::Range<usize>> {
        let slot = self.slot(k)?;
        if slot.ragged.is_some() {
            return Err(Error::mismatch(format!(
                "output field `{}` is ragged: ask for room for the sample's items with \
                 Slots::ragged_mut(name, items) or Slots::ragged(k, items)",
                self.fields[k].name
            )));
        }
        let start = slot.offset + self.position * slot.sample_bytes;
        self.checked(start..start + slot.sample_bytes)
    }

    /// The position of the output field called `name`, or an error naming it and the fields.
    fn position_of(&self, name: &str) -> Result<usize> {
        self.fields
            .iter()
            .position(|f| f.name == name)
            .ok_or_else(|| {
                let names: Vec<&str> = self.fields.iter().map(|f| f.name.as_str()).collect();
                Error::mismatch(format!(
                    "the transform has no output field `{name}` (its fields: {names:?})"
                ))
            })
    }

    /// The bytes of output field `k` for this sample (a fixed field: see
    /// [`ragged`](Self::ragged) for a ragged one).
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
    /// 256 bytes and each sample's slot at a multiple of
    /// its element size, in buffers the pool aligns (a buffer that is not, from a
    /// [`Backing`](crate::memory::Backing) that breaks its contract, is an error, never a
    /// misaligned slice).
    pub fn field_mut<T: Element>(&mut self, name: &str) -> Result<&mut [T]> {
        let k = self.position_of(name)?;
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

    /// Room for `items` items of ragged output field `k` for this sample, as bytes: `items`
    /// times the field's item bytes, all of which the transform must write. Asking again for
    /// the same sample replaces the room asked for before (its bytes are not kept).
    ///
    /// A fixed field is an [`Error::Mismatch`] naming it. Room beyond the field's budget for
    /// the batch is an [`Error::InvalidConfig`] naming the field and `ragged_budget`, and
    /// fails the whole batch (a batch is never cut short).
    pub fn ragged(&mut self, k: usize, items: usize) -> Result<&mut [u8]> {
        let slot = self.slot(k)?;
        let fields = self.fields;
        let name = &fields[k].name;
        let Some(ragged) = &slot.ragged else {
            return Err(Error::mismatch(format!(
                "output field `{name}` is not ragged: write its slot with Slots::field_mut or Slots::field"
            )));
        };
        let bytes = items
            .checked_mul(slot.sample_bytes)
            .ok_or_else(|| over_budget(name, usize::MAX, ragged.capacity, true))?;
        let p = self
            .ragged
            .iter()
            .position(|r| r.field == k)
            .ok_or_else(|| Error::user(format!("ragged field `{name}` has no region")))?;
        let placed = self.ragged[p].place(bytes);
        let Some((spilled, at)) = placed else {
            let needed = self.ragged[p].over_budget().unwrap_or(bytes);
            return Err(over_budget(name, needed, ragged.capacity, true));
        };
        self.set_length(k, items)?;
        self.touched[k] = true;
        let marker = self.marker;
        let room = if spilled {
            self.ragged[p].spill_mut(at, bytes)
        } else {
            let range = self.checked(slot.offset + at..slot.offset + at + bytes)?;
            self.bytes_mut(range)
        };
        if marker {
            for (i, b) in room.iter_mut().enumerate() {
                *b = MARKER[i % MARKER.len()];
            }
        }
        Ok(room)
    }

    /// Room for `items` items of the ragged output field called `name` for this sample, as
    /// elements of `T`: `items` times the elements of the field's item shape (one per item for
    /// bytes or tokens). `T` must be the field's element type, as for
    /// [`field_mut`](Self::field_mut); otherwise as [`ragged`](Self::ragged).
    ///
    /// ```
    /// use gpufeed::{DType, FnTransform, OutputField, Sample, SampleContext, Slots};
    ///
    /// // A sample's text, and its words' lengths as a ragged u32 field.
    /// let transform = FnTransform::new(
    ///     vec![
    ///         OutputField::ragged("text", DType::U8, &[]),
    ///         OutputField::ragged("word_lengths", DType::U32, &[]),
    ///     ],
    ///     |sample: Sample<'_>, _: &SampleContext, slots: &mut Slots<'_>| {
    ///         let text = sample.field_as::<u8>("text")?;
    ///         slots.ragged_mut::<u8>("text", text.len())?.copy_from_slice(&text);
    ///         let words: Vec<u32> = text
    ///             .split(|&b| b == b' ')
    ///             .map(|w| w.len() as u32)
    ///             .collect();
    ///         slots.ragged_mut::<u32>("word_lengths", words.len())?.copy_from_slice(&words);
    ///         Ok(())
    ///     },
    /// );
    /// # let _ = transform;
    /// ```
    pub fn ragged_mut<T: Element>(&mut self, name: &str, items: usize) -> Result<&mut [T]> {
        let k = self.position_of(name)?;
        let dtype = self.fields[k].dtype;
        if !T::matches(dtype) {
            return Err(Error::mismatch(format!(
                "output field `{name}` is {dtype}, not {}",
                element_name::<T>()
            )));
        }
        let room = self.ragged(k, items)?;
        cast_slice_mut(room).ok_or_else(|| {
            Error::mismatch(format!(
                "output field `{name}`: its room is not aligned for {dtype} (the batch buffer's backing breaks its alignment contract)"
            ))
        })
    }

    /// Fills every fixed slot of this sample with [`MARKER`] (debug builds, before the
    /// transform), and from now on the room handed out for ragged fields too.
    pub(crate) fn fill_marker(&mut self) {
        self.marker = true;
        for k in 0..self.slots.len() {
            if let Ok(range) = self.range(k) {
                for (i, b) in self.bytes_mut(range).iter_mut().enumerate() {
                    *b = MARKER[i % MARKER.len()];
                }
            }
        }
    }

    /// The bytes handed out for ragged field `k` for this sample, to read (empty if none).
    fn ragged_written(&self, k: usize) -> Result<&[u8]> {
        let Some(part) = self.ragged.iter().find(|r| r.field == k) else {
            return Ok(&[]);
        };
        match part.current() {
            None => Ok(&[]),
            Some((true, at, len)) => Ok(part.spilled_bytes(at, len)),
            Some((false, at, len)) => {
                let offset = self.slots[k].offset;
                Ok(self.bytes(self.checked(offset + at..offset + at + len)?))
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
            if !self.touched[k] && field.ragged {
                return Err(Error::user(format!(
                    "the transform did not write ragged output field `{}`: a transform asks \
                     for room for each sample's items (Slots::ragged_mut, none for an empty \
                     sample: ragged_mut(name, 0)) and writes all of it",
                    field.name
                )));
            }
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
            let slot = if field.ragged {
                self.ragged_written(k)?
            } else {
                self.bytes(self.range(k)?)
            };
            if let Some(left) = marker_left(slot) {
                return Err(Error::user(format!(
                    "the transform did not write bytes {}..{} of output field `{}` (its \
                     slot has {} bytes for this sample): a transform must write every byte of \
                     every slot, or the batch holds bytes of an earlier one",
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

#[cfg(test)]
mod tests {
    use super::*;

    use crate::format::DType;
    use crate::layout::RaggedPart;

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
                ragged: None,
            },
            FieldSlot {
                offset: 256,
                sample_bytes: 1,
                ragged: None,
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
        let mut s = Slots::new(aligned(&mut buf), &fields, &slots, 1, &mut touched, &mut []);
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
        let mut s = Slots::new(aligned(&mut buf), &fields, &slots, 0, &mut touched, &mut []);
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
        let mut s = Slots::new(aligned(&mut buf), &fields, &slots, 0, &mut touched, &mut []);
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
        let mut s = Slots::new(aligned(&mut buf), &fields, &slots, 1, &mut touched, &mut []);
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
        let mut s = Slots::new(aligned(&mut buf), &fields, &slots, 0, &mut touched, &mut []);
        s.fill_marker();
        s.field(0).unwrap();
        s.field(1).unwrap()[0] = 0;
        let e = s.check_written(true).unwrap_err();
        assert!(
            e.to_string().contains("bytes 0..12 of output field `x`"),
            "{e}"
        );
    }

    /// A layout of a fixed `id` (u8) and a ragged `text` (u8, 16 bytes a batch) of 2 samples,
    /// and an aligned buffer for it.
    fn ragged_layout() -> (super::super::BatchLayout, Vec<u64>) {
        let fields = vec![
            OutputField::new("id", DType::U8, &[]),
            OutputField::ragged("text", DType::U8, &[]),
        ];
        let layout = super::super::BatchLayout::with_budgets(fields, 2, |_| Some(16)).unwrap();
        let words = vec![0u64; layout.total_bytes().div_ceil(8)];
        (layout, words)
    }

    fn offsets(layout: &super::super::BatchLayout, buf: &[u8]) -> Vec<i64> {
        let at = layout.offsets_offset(1).unwrap();
        buf[at..at + 24]
            .chunks(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    #[test]
    fn ragged_room_is_what_the_sample_asks_for_and_a_second_ask_replaces_the_first() {
        let (layout, mut words) = ragged_layout();
        let buf = super::super::words_as_bytes(&mut words);
        let mut touched = [false; 2];
        let mut parts = RaggedPart::for_positions(&layout, 0..2, 2);
        let (fields, slots) = (layout.fields(), layout.slots());
        {
            let mut s = Slots::new(&mut *buf, fields, slots, 0, &mut touched, &mut parts);
            s.field(0).unwrap()[0] = 7;
            s.ragged_mut::<u8>("text", 9).unwrap().fill(b'x');
            // Asked again: 3 bytes, from the same place.
            s.ragged_mut::<u8>("text", 3)
                .unwrap()
                .copy_from_slice(b"abc");
            s.check_written(false).unwrap();
            assert!(s.field(1).is_err() && s.field_mut::<u8>("text").is_err());
            let e = s.ragged(0, 1).unwrap_err();
            assert!(e.to_string().contains("`id` is not ragged"), "{e}");
            let e = s.ragged_mut::<u16>("text", 1).unwrap_err();
            assert!(e.to_string().contains("`text` is u8, not u16"), "{e}");
        }
        {
            let mut s = Slots::new(&mut *buf, fields, slots, 1, &mut touched, &mut parts);
            s.field(0).unwrap()[0] = 8;
            s.ragged(1, 4).unwrap().copy_from_slice(b"defg");
            s.check_written(false).unwrap();
        }
        // Lengths, before the batch is sealed; then offsets.
        assert_eq!(offsets(&layout, buf), [0, 3, 4]);
        super::super::seal(buf, &layout, 2, &[parts]).unwrap();
        assert_eq!(offsets(&layout, buf), [0, 3, 7]);
        let at = layout.field_offset(1).unwrap();
        assert_eq!(&buf[at..at + 7], b"abcdefg");
    }

    #[test]
    fn ragged_room_beyond_the_budget_is_an_error_naming_the_field_and_the_setting() {
        let (layout, mut words) = ragged_layout();
        let buf = super::super::words_as_bytes(&mut words);
        let mut touched = [false; 2];
        let mut parts = RaggedPart::for_positions(&layout, 0..2, 2);
        let mut s = Slots::new(
            buf,
            layout.fields(),
            layout.slots(),
            0,
            &mut touched,
            &mut parts,
        );
        s.ragged(1, 16).unwrap();
        let e = s.ragged(1, 17).unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidConfig {
                    setting: "ragged_budget",
                    ..
                }
            ),
            "{e}"
        );
        assert!(
            e.to_string().contains("`text`") && e.to_string().contains("at least 17"),
            "{e}"
        );
        assert_eq!(parts[0].over_budget(), Some(17));
    }

    #[test]
    fn a_part_whose_samples_outgrow_its_region_spills_and_sealing_puts_it_in_place() {
        let (layout, mut words) = ragged_layout();
        let buf = super::super::words_as_bytes(&mut words);
        let mut touched = [false; 2];
        // Two parts of one sample each: 8 bytes of region each.
        let mut first = RaggedPart::for_positions(&layout, 0..1, 2);
        let mut second = RaggedPart::for_positions(&layout, 1..2, 2);
        let (fields, slots) = (layout.fields(), layout.slots());
        {
            let mut s = Slots::new(&mut *buf, fields, slots, 0, &mut touched, &mut first);
            s.field(0).unwrap()[0] = 0;
            s.ragged(1, 12).unwrap().copy_from_slice(b"0123456789ab");
            s.check_written(false).unwrap();
        }
        {
            let mut s = Slots::new(&mut *buf, fields, slots, 1, &mut touched, &mut second);
            s.field(0).unwrap()[0] = 1;
            s.ragged(1, 4).unwrap().copy_from_slice(b"WXYZ");
            s.check_written(false).unwrap();
        }
        super::super::seal(buf, &layout, 2, &[first, second]).unwrap();
        assert_eq!(offsets(&layout, buf), [0, 12, 16]);
        let at = layout.field_offset(1).unwrap();
        assert_eq!(&buf[at..at + 16], b"0123456789abWXYZ");
    }

    #[test]
    fn parts_that_fit_alone_but_not_together_fail_when_sealed() {
        let (layout, mut words) = ragged_layout();
        let buf = super::super::words_as_bytes(&mut words);
        let mut touched = [false; 2];
        let mut first = RaggedPart::for_positions(&layout, 0..1, 2);
        let mut second = RaggedPart::for_positions(&layout, 1..2, 2);
        let (fields, slots) = (layout.fields(), layout.slots());
        for (position, parts) in [(0, &mut first), (1, &mut second)] {
            let mut s = Slots::new(&mut *buf, fields, slots, position, &mut touched, parts);
            s.ragged(1, 10).unwrap().fill(1);
        }
        let e = super::super::seal(buf, &layout, 2, &[first, second]).unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidConfig {
                    setting: "ragged_budget",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("need 20 bytes"), "{e}");
    }

    #[test]
    fn ragged_room_not_asked_for_or_not_written_fails_the_sample() {
        let (layout, mut words) = ragged_layout();
        let buf = super::super::words_as_bytes(&mut words);
        let mut touched = [false; 2];
        let mut parts = RaggedPart::for_positions(&layout, 0..2, 2);
        let (fields, slots) = (layout.fields(), layout.slots());
        let mut s = Slots::new(&mut *buf, fields, slots, 0, &mut touched, &mut parts);
        s.field(0).unwrap()[0] = 0;
        let e = s.check_written(false).unwrap_err();
        assert!(
            e.to_string()
                .contains("did not write ragged output field `text`"),
            "{e}"
        );
        // With the marker: room asked for and left unwritten is found.
        s.fill_marker();
        s.field(0).unwrap()[0] = 0;
        s.ragged(1, 10).unwrap()[..2].fill(0);
        let e = s.check_written(true).unwrap_err();
        assert!(
            e.to_string().contains("bytes 2..10 of output field `text`"),
            "{e}"
        );
        // An empty sample writes nothing, and is fine.
        s.ragged(1, 0).unwrap();
        s.check_written(true).unwrap();
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
}
