//! Ragged fields: where each part of a batch writes a ragged field's values ([`RaggedPart`]),
//! how a made batch's parts become one values buffer and its offsets ([`seal`]), and the view
//! of both that a batch hands out ([`Ragged`]).
//!
//! While a batch is made, the offsets table of a ragged field holds each sample's *length*
//! (in items) at `offsets[position + 1]`, written by whichever part owns the position; the
//! values of a part go into its region of the field's values, in sample order, and what
//! outgrows the region into the part's own spill buffer. Sealing, once every part is done,
//! moves the regions (and spills) together in part order and turns the lengths into offsets
//! by a prefix sum: lengths do not depend on where values were put, so no part needs another
//! part's sizes while it works.

use super::{BatchLayout, Element, cast_slice, cast_slice_mut};
use crate::error::{Error, Result};

/// The values one part of a batch writes in one ragged field: a region of the field's values
/// (bytes `start..end` from the field's offset), what it holds, and what did not fit.
#[derive(Debug)]
pub(crate) struct RaggedPart {
    /// The field's position among the batch's fields.
    pub(crate) field: usize,
    start: usize,
    end: usize,
    /// Bytes written at `start..`.
    used: usize,
    /// Values that did not fit the region, in sample order after the region's (kept as `u64`
    /// words so that every element type is aligned).
    spill: Vec<u64>,
    /// Bytes of `spill` in use.
    spilled: usize,
    /// The most bytes of values the whole batch may hold in the field (its capacity).
    limit: usize,
    /// `(used, spilled)` when the current sample began: a second request for the same sample
    /// starts over from here.
    mark: (usize, usize),
    /// The current sample's values: in the spill or not, where, how many bytes.
    current: Option<(bool, usize, usize)>,
    /// Set when the batch's values in the field were found to exceed `limit`: the bytes asked
    /// for by then.
    over: Option<usize>,
}

impl RaggedPart {
    /// The regions of the ragged fields of `layout` for the part that writes positions
    /// `positions` of a batch of `len`: each a share of the field's capacity in proportion to
    /// the part's samples (a whole batch gets all of it), starting on an item.
    pub(crate) fn for_positions(
        layout: &BatchLayout,
        positions: std::ops::Range<usize>,
        len: usize,
    ) -> Vec<RaggedPart> {
        let share = |capacity: usize, item: usize, at: usize| -> usize {
            if at >= len {
                return capacity;
            }
            let bytes = (capacity as u128 * at as u128 / len.max(1) as u128) as usize;
            bytes / item * item
        };
        layout
            .slots()
            .iter()
            .enumerate()
            .filter_map(|(k, slot)| {
                let r = slot.ragged.as_ref()?;
                let item = slot.sample_bytes;
                Some(RaggedPart {
                    field: k,
                    start: share(r.capacity, item, positions.start),
                    end: share(r.capacity, item, positions.end),
                    used: 0,
                    spill: Vec::new(),
                    spilled: 0,
                    limit: r.capacity,
                    mark: (0, 0),
                    current: None,
                    over: None,
                })
            })
            .collect()
    }

    /// Parts with no region and no limit, for every ragged field of `layout`: every value goes
    /// to the spill (the loader's measure of samples' sizes before it sizes the budget).
    pub(crate) fn unbounded(layout: &BatchLayout) -> Vec<RaggedPart> {
        let mut parts = RaggedPart::for_positions(layout, 0..0, 1);
        for p in &mut parts {
            (p.start, p.end, p.limit) = (0, 0, usize::MAX);
        }
        parts
    }

    /// Bytes of values in this part (region and spill).
    pub(crate) fn bytes(&self) -> usize {
        self.used + self.spilled
    }

    /// The bytes asked for when the batch's values were found to exceed the field's budget.
    pub(crate) fn over_budget(&self) -> Option<usize> {
        self.over
    }

    /// A new sample begins: its values start after the previous sample's.
    pub(crate) fn begin_sample(&mut self) {
        self.mark = (self.used, self.spilled);
        self.current = None;
    }

    /// Room for `bytes` bytes of the current sample's values (replacing any asked for before
    /// for this sample): in the region while it has room, else in the spill; returns whether
    /// it is in the spill, and where (from the field's values, or in the spill). `None`, with
    /// [`over_budget`](Self::over_budget) set, when the part alone would hold more than the
    /// field's budget.
    pub(crate) fn place(&mut self, bytes: usize) -> Option<(bool, usize)> {
        (self.used, self.spilled) = self.mark;
        self.current = None;
        if self
            .bytes()
            .checked_add(bytes)
            .is_none_or(|t| t > self.limit)
        {
            self.over = Some(self.bytes().saturating_add(bytes));
            return None;
        }
        if self.spilled == 0 && self.start + self.used + bytes <= self.end {
            let at = self.start + self.used;
            self.used += bytes;
            self.current = Some((false, at, bytes));
            return Some((false, at));
        }
        let at = self.spilled;
        self.spilled += bytes;
        let words = self.spilled.div_ceil(8);
        if self.spill.len() < words {
            self.spill.resize(words, 0);
        }
        self.current = Some((true, at, bytes));
        Some((true, at))
    }

    /// Bytes `at..at + len` of the spill, to write.
    pub(crate) fn spill_mut(&mut self, at: usize, len: usize) -> &mut [u8] {
        &mut words_as_bytes(&mut self.spill)[at..at + len]
    }

    /// The current sample's values, if asked for: in the spill or not, where, how many bytes.
    pub(crate) fn current(&self) -> Option<(bool, usize, usize)> {
        self.current
    }

    /// The current sample's values in the spill, to read (for the checks after a transform).
    pub(crate) fn spilled_bytes(&self, at: usize, len: usize) -> &[u8] {
        let bytes = words_as_bytes_ref(&self.spill);
        &bytes[at..at + len]
    }
}

/// `words` as bytes: a buffer of bytes aligned for every element type.
pub(crate) fn words_as_bytes(words: &mut [u64]) -> &mut [u8] {
    let len = std::mem::size_of_val(words);
    // SAFETY: a `u64` slice is `len` initialised bytes, valid as `u8` and aligned for it; the
    // result takes over the exclusive borrow of `words`.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), len) }
}

/// `words` as bytes, to read.
fn words_as_bytes_ref(words: &[u64]) -> &[u8] {
    let len = std::mem::size_of_val(words);
    // SAFETY: as in `words_as_bytes`, shared.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), len) }
}

/// One part's values of a field, as [`compact`] moves them: a region of the values buffer and
/// what did not fit it.
struct Piece<'p> {
    /// Where the part's region starts in the values.
    start: usize,
    /// Bytes in use there.
    used: usize,
    /// Its values beyond the region.
    spill: &'p [u8],
}

/// Moves the pieces of a field's values (each part's region and spill, in part order) to the
/// start of `values`, back to back; returns the bytes they hold. The caller checked that they
/// fit in `values`.
///
/// Regions do not overlap and lie in part order, so a part's values never belong further
/// right than its region unless an earlier part spilled. Parts whose values move left (or
/// stay) are moved at once, in order: their destination ends before their region does, so no
/// region not yet moved is overwritten. A part whose values would move right, and every spill
/// whose destination reaches into a later region, are copied aside and written once every
/// region is in place. With no spill (the usual case) nothing is copied aside.
fn compact(values: &mut [u8], pieces: &[Piece<'_>]) -> usize {
    let mut at = 0usize;
    let mut aside: Vec<(usize, std::borrow::Cow<'_, [u8]>)> = Vec::new();
    for (p, piece) in pieces.iter().enumerate() {
        let source = piece.start..piece.start + piece.used;
        if at <= piece.start {
            values.copy_within(source, at);
        } else {
            aside.push((at, std::borrow::Cow::Owned(values[source].to_vec())));
        }
        at += piece.used;
        if !piece.spill.is_empty() {
            // The first byte a later part's region holds that is not moved yet.
            let next = pieces[p + 1..]
                .iter()
                .find(|q| q.used > 0)
                .map_or(usize::MAX, |q| q.start);
            if at + piece.spill.len() <= next {
                values[at..at + piece.spill.len()].copy_from_slice(piece.spill);
            } else {
                aside.push((at, std::borrow::Cow::Borrowed(piece.spill)));
            }
            at += piece.spill.len();
        }
    }
    for (to, bytes) in aside {
        values[to..to + bytes.len()].copy_from_slice(&bytes);
    }
    at
}

/// Seals a made batch of `len` samples in `buffer` (laid out by `layout`): for each ragged
/// field, moves the values of `parts` (each part's [`RaggedPart`]s, in part order) together and
/// turns the lengths the samples wrote into offsets. A field whose values exceed its budget is
/// an error naming it and `ragged_budget` (the caller adds the batch).
pub(crate) fn seal(
    buffer: &mut [u8],
    layout: &BatchLayout,
    len: usize,
    parts: &[Vec<RaggedPart>],
) -> Result<()> {
    for (k, slot) in layout.slots().iter().enumerate() {
        let Some(ragged) = &slot.ragged else {
            continue;
        };
        let name = &layout.fields()[k].name;
        let mine: Vec<&RaggedPart> = parts
            .iter()
            .filter_map(|p| p.iter().find(|r| r.field == k))
            .collect();
        let total: usize = mine.iter().map(|p| p.bytes()).sum();
        if total > ragged.capacity {
            return Err(over_budget(name, total, ragged.capacity, false));
        }
        let pieces: Vec<Piece<'_>> = mine
            .iter()
            .map(|p| Piece {
                start: p.start,
                used: p.used,
                spill: &words_as_bytes_ref(&p.spill)[..p.spilled],
            })
            .collect();
        let values = buffer
            .get_mut(slot.offset..slot.offset + ragged.capacity)
            .ok_or_else(|| Error::user("a ragged field's values lie outside the batch buffer"))?;
        let moved = compact(values, &pieces);
        let offsets = buffer
            .get_mut(ragged.offsets..ragged.offsets + 8 * (len + 1))
            .and_then(cast_slice_mut::<i64>)
            .ok_or_else(|| Error::user("a ragged field's offsets lie outside the batch buffer"))?;
        offsets[0] = 0;
        for i in 1..=len {
            offsets[i] += offsets[i - 1];
        }
        let items = offsets[len] as usize;
        if items * slot.sample_bytes != moved {
            return Err(Error::user(format!(
                "ragged field `{name}`: its samples' lengths add up to {items} items, but {moved} bytes of values were written"
            )));
        }
    }
    Ok(())
}

/// The error of a ragged field whose values in one batch exceed its budget: `bytes` needed
/// (at least, when `partial`: found before the batch was made).
pub(crate) fn over_budget(name: &str, bytes: usize, capacity: usize, partial: bool) -> Error {
    let needs = if partial { "at least " } else { "" };
    Error::config(
        "ragged_budget",
        format!(
            "ragged field `{name}`: the batch's values need {needs}{bytes} bytes, more than the field's budget of {capacity} bytes per batch; raise ragged_budget for `{name}` (a batch is never cut short)"
        ),
    )
}

/// A ragged field of a batch: its values, the items of its samples back to back, and its
/// offsets, `len + 1` of them, sample `i`'s items being `values[offsets[i]..offsets[i + 1]]`
/// (in items; an item is `item_len` elements of `T`).
///
/// ```
/// use gpufeed::{Codec, DType, Field, Loader, Schema};
/// # use gpufeed::{Dataset, Result, Sample};
/// # struct Texts(Schema);
/// # impl Dataset for Texts {
/// #     fn len(&self) -> u64 { 3 }
/// #     fn schema(&self) -> &Schema { &self.0 }
/// #     fn get(&self, i: u64) -> Result<Sample<'_>> {
/// #         let mut r = Vec::new();
/// #         self.0.build_record(&[["a", "bcd", ""][i as usize].as_bytes()], &mut r)?;
/// #         Sample::owned(r, &self.0)
/// #     }
/// # }
/// # let texts = Texts(Schema::new(vec![Field::bytes("text", Codec::Utf8)]).unwrap());
/// // `texts`: 3 samples of a variable-size field `text`: "a", "bcd", "".
/// let mut loader = Loader::builder(texts).batch_size(3).ragged_budget("text", 1024).build()?;
/// let batch = loader.next().unwrap()?;
/// let text = batch.ragged::<u8>("text")?;
/// assert_eq!(text.values(), b"abcd");
/// assert_eq!(text.offsets(), [0, 1, 4, 4]);
/// assert_eq!(text.sample(1), b"bcd");
/// assert_eq!(text.iter().map(<[u8]>::len).collect::<Vec<_>>(), [1, 3, 0]);
/// # Ok::<(), gpufeed::Error>(())
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Ragged<'a, T> {
    values: &'a [T],
    offsets: &'a [i64],
    item_len: usize,
}

impl<'a, T: Element> Ragged<'a, T> {
    /// The view of `values` (at least `offsets.last() * item_len` elements) cut by `offsets`
    /// (checked to rise from 0); `None` if they do not hold together.
    pub(crate) fn new(values: &'a [T], offsets: &'a [i64], item_len: usize) -> Option<Self> {
        let rising = offsets.first() == Some(&0) && offsets.windows(2).all(|w| w[0] <= w[1]);
        let last = usize::try_from(*offsets.last()?).ok()?;
        let values = values.get(..last.checked_mul(item_len)?)?;
        rising.then_some(Ragged {
            values,
            offsets,
            item_len,
        })
    }

    /// The bytes of `bytes` viewed as `T`, cut by `offsets`.
    pub(crate) fn of_bytes(bytes: &'a [u8], offsets: &'a [i64], item_len: usize) -> Option<Self> {
        Ragged::new(cast_slice::<T>(bytes)?, offsets, item_len)
    }

    /// Every sample's items, back to back, in sample order.
    pub fn values(&self) -> &'a [T] {
        self.values
    }

    /// `len() + 1` offsets, in items: sample `i` is `values[offsets[i]..offsets[i + 1]]`
    /// (times the item's elements).
    pub fn offsets(&self) -> &'a [i64] {
        self.offsets
    }

    /// Samples in the batch.
    pub fn len(&self) -> usize {
        self.offsets.len() - 1
    }

    /// True for a batch without samples.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements of `T` in one item (the product of the field's item shape).
    pub fn item_len(&self) -> usize {
        self.item_len
    }

    /// The items of sample `i` (`i < len()`), as elements of `T`.
    pub fn sample(&self, i: usize) -> &'a [T] {
        let (a, b) = (self.offsets[i] as usize, self.offsets[i + 1] as usize);
        &self.values[a * self.item_len..b * self.item_len]
    }

    /// Each sample's items, in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = &'a [T]> + '_ {
        (0..self.len()).map(|i| self.sample(i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use proptest::prelude::*;

    /// Fills `values` as parts with these (region share, bytes in region, bytes spilled) would,
    /// compacts, and returns the result and the expected concatenation.
    fn run(regions: &[(usize, usize, usize)], capacity: usize) -> (Vec<u8>, Vec<u8>) {
        let mut values = vec![0xeeu8; capacity];
        let mut expected = Vec::new();
        let mut spills = Vec::new();
        let mut start = 0usize;
        let mut tag = 1u8;
        let mut starts = Vec::new();
        for &(share, used, spilled) in regions {
            starts.push(start);
            for b in &mut values[start..start + used] {
                *b = tag;
                tag = tag.wrapping_add(1).max(1);
            }
            expected.extend_from_slice(&values[start..start + used]);
            let spill: Vec<u8> = (0..spilled)
                .map(|_| {
                    let t = tag;
                    tag = tag.wrapping_add(1).max(1);
                    t
                })
                .collect();
            expected.extend_from_slice(&spill);
            spills.push(spill);
            start += share;
        }
        let pieces: Vec<Piece<'_>> = regions
            .iter()
            .zip(&starts)
            .zip(&spills)
            .map(|((&(_, used, _), &start), spill)| Piece { start, used, spill })
            .collect();
        let n = compact(&mut values, &pieces);
        assert_eq!(n, expected.len());
        values.truncate(n);
        (values, expected)
    }

    #[test]
    fn compaction_closes_the_gaps_between_parts() {
        let (got, want) = run(&[(10, 4, 0), (10, 10, 0), (10, 0, 0), (10, 7, 0)], 40);
        assert_eq!(got, want);
    }

    #[test]
    fn compaction_puts_spills_in_place_even_when_they_push_later_parts_right() {
        // Part 0 spills 15 bytes: part 1's values move right, over part 2's region.
        let (got, want) = run(&[(10, 10, 15), (10, 8, 0), (10, 9, 2), (10, 0, 0)], 60);
        assert_eq!(got, want);
    }

    proptest! {
        /// Whatever the regions hold and spill, compaction gives the parts' values back to
        /// back in part order, as long as they fit.
        #[test]
        fn compaction_concatenates_the_parts(
            parts in proptest::collection::vec((0usize..20, 0usize..20, 0usize..20), 1..8),
        ) {
            let room: usize = parts.iter().map(|p| p.0).sum();
            let mut left = room - parts.iter().map(|p| p.1.min(p.0)).sum::<usize>();
            let regions: Vec<(usize, usize, usize)> = parts
                .iter()
                .map(|&(share, used, spilled)| {
                    // What is spilled fits in the room the other parts leave.
                    let spilled = spilled.min(left);
                    left -= spilled;
                    (share, used.min(share), spilled)
                })
                .collect();
            let (got, want) = run(&regions, room);
            prop_assert_eq!(got, want);
        }
    }

    #[test]
    fn a_view_checks_its_offsets() {
        let values = [1u16, 2, 3, 4, 5, 6];
        let v = Ragged::new(&values, &[0, 1, 3], 2).unwrap();
        assert_eq!(
            (v.len(), v.sample(0), v.sample(1)),
            (2, &[1, 2][..], &[3, 4, 5, 6][..])
        );
        assert!(Ragged::new(&values, &[0, 4], 2).is_none());
        assert!(Ragged::new(&values, &[0, 2, 1], 1).is_none());
        assert!(Ragged::new(&values, &[1, 2], 1).is_none());
    }
}
