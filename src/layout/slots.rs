//! [`Slots`]: the bytes of one sample's slots in a batch buffer, as a transform writes them, and
//! the checks that every byte of every slot was written.

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
    /// [`output`](crate::transform::SampleTransform::output) declared).
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
    /// 256 bytes and each sample's slot at a multiple of
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

#[cfg(test)]
mod tests {
    use super::*;

    use crate::format::DType;

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
}
