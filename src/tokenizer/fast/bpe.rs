//! Byte-level BPE over pair-ranked merges, as the `tokenizers` crate applies a tokenizer.json's
//! `merges`: repeatedly merge the adjacent pair of lowest rank, the leftmost first among equal
//! ranks (the crate's `Word::merge_all` pops (rank, position) from a heap). Pair ranks, not
//! tiktoken's rank of the merged bytes, because a tokenizer.json may list several merges that
//! give the same token, or none for a token: pairs are the file's own semantics.
//!
//! A piece shorter than [`LONG_PIECE`] bytes is merged in tiktoken's `byte_pair_merge` shape (a
//! flat array, a linear scan for the lowest rank: O(n²) with small constants); a longer one by
//! a heap over a linked list, as the crate does (O(n log n)), in at most 36 bytes of scratch
//! per byte of the piece, given back once the piece is done when it was larger than [`KEEP_LONG`].

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::FastMap;

/// No merge for this pair.
const NONE: u64 = u64::MAX;

/// The heap path's links: no neighbour on that side.
const NO_LINK: u32 = u32::MAX;

/// The heap path's `prev` of a symbol merged into its left neighbour.
const DEAD: u32 = u32::MAX - 1;

/// Pieces at least this long (in bytes) take the heap.
const LONG_PIECE: usize = 128;

/// Pieces longer than this are not cached: they are rare, and one document's pathological
/// pieces (a megabyte without a space) must not fill the cache.
const CACHE_MAX_PIECE: usize = 64;

/// The piece cache's bound in bytes (keys, ids and the map's own overhead, estimated): it is
/// cleared when it would grow past this. 4 MiB holds about 60,000 pieces of man-page text.
pub(crate) const CACHE_BYTES: usize = 4 << 20;

/// What one cached piece costs besides its bytes and ids: the map's slot (two boxed slices,
/// a control byte, the load factor's slack) and the two allocations' headers.
const CACHE_ENTRY_OVERHEAD: usize = 64;

/// Scratch of the heap path kept between calls up to this many bytes of piece; above, it is
/// given back after the piece.
const KEEP_LONG: usize = 64 << 10;

/// Bytes of scratch per byte of a long piece, at most: its ids and two links (u32 each), and
/// the heap's entries (u64), of which there are at most three per byte: one per adjacent pair,
/// then two per merge.
pub(crate) const LONG_BYTES_PER_BYTE: usize = 4 + 4 + 4 + 3 * 8;

/// The immutable model, shared by every thread.
pub(crate) struct Bpe {
    /// Token id of each byte (the ByteLevel alphabet's character for that byte).
    pub(crate) byte_ids: [u32; 256],
    /// (left id << 32 | right id) -> (rank << 32) | merged id.
    pub(crate) merges: FastMap<u64, u64>,
    /// Whole pieces emitted as one token without merging: every token when the model has
    /// `ignore_merges`, else only those that merging their own bytes gives back (checked at
    /// load), so that looking a piece up first never changes the ids.
    pub(crate) whole: FastMap<Box<[u8]>, u32>,
    /// Longest key of `whole`, to skip lookups that cannot hit.
    pub(crate) whole_max_len: usize,
}

#[inline(always)]
fn pair(a: u32, b: u32) -> u64 {
    ((a as u64) << 32) | b as u64
}

/// One thread's scratch space and piece cache.
#[derive(Default)]
pub(crate) struct Scratch {
    ids: Vec<u32>,
    ranks: Vec<u64>,
    /// The heap path's arrays (reused up to [`KEEP_LONG`]).
    long_ids: Vec<u32>,
    prev: Vec<u32>,
    next: Vec<u32>,
    heap: BinaryHeap<Reverse<u64>>,
    /// Pieces seen before (not single tokens) -> their ids, bounded by [`CACHE_BYTES`].
    cache: FastMap<Box<[u8]>, Box<[u32]>>,
    cache_bytes: usize,
    /// Whether pieces are cached (off in tests that check the merging itself).
    no_cache: bool,
}

impl Scratch {
    /// A scratch whose cache is off.
    #[cfg(test)]
    pub(crate) fn uncached() -> Scratch {
        Scratch {
            no_cache: true,
            ..Scratch::default()
        }
    }

    /// Bytes this scratch holds now (its buffers' capacities and the cache's estimate).
    pub(crate) fn bytes(&self) -> usize {
        self.ids.capacity() * 4
            + self.ranks.capacity() * 8
            + self.long_ids.capacity() * 4
            + self.prev.capacity() * 4
            + self.next.capacity() * 4
            + self.heap.capacity() * 8
            + self.cache_bytes
    }
}

impl Bpe {
    #[inline(always)]
    fn merge_of(&self, a: u32, b: u32) -> u64 {
        match self.merges.get(&pair(a, b)) {
            Some(&v) => v,
            None => NONE,
        }
    }

    /// Appends the ids of one piece (the bytes of one pre-token) to `out`.
    #[inline]
    pub(crate) fn encode_piece(&self, piece: &[u8], scratch: &mut Scratch, out: &mut Vec<u32>) {
        if piece.len() == 1 {
            out.push(self.byte_ids[piece[0] as usize]);
            return;
        }
        if piece.len() <= self.whole_max_len
            && let Some(&id) = self.whole.get(piece)
        {
            out.push(id);
            return;
        }
        let cacheable = !scratch.no_cache && piece.len() <= CACHE_MAX_PIECE;
        if cacheable && let Some(ids) = scratch.cache.get(piece) {
            out.extend_from_slice(ids);
            return;
        }
        let start = out.len();
        if piece.len() < LONG_PIECE {
            self.merge_short(piece, scratch, out);
        } else {
            self.merge_long(piece, scratch, out);
        }
        if cacheable {
            let ids = &out[start..];
            let cost = piece.len() + ids.len() * 4 + CACHE_ENTRY_OVERHEAD;
            if scratch.cache_bytes + cost > CACHE_BYTES {
                scratch.cache = FastMap::default();
                scratch.cache_bytes = 0;
            }
            scratch.cache.insert(piece.into(), ids.into());
            scratch.cache_bytes += cost;
        }
    }

    /// The ids of `piece` by merging alone: no cache, no whole-piece lookup (used at load to
    /// find the tokens that merging gives back).
    pub(crate) fn merge_uncached(&self, piece: &[u8], scratch: &mut Scratch, out: &mut Vec<u32>) {
        if piece.len() < LONG_PIECE {
            self.merge_short(piece, scratch, out);
        } else {
            self.merge_long(piece, scratch, out);
        }
    }

    /// tiktoken's loop over pair ranks: O(n²) in the piece's length, with small constants.
    fn merge_short(&self, piece: &[u8], scratch: &mut Scratch, out: &mut Vec<u32>) {
        let ids = &mut scratch.ids;
        let ranks = &mut scratch.ranks;
        ids.clear();
        ranks.clear();
        ids.extend(piece.iter().map(|&b| self.byte_ids[b as usize]));
        // ranks[i]: the merge of (ids[i], ids[i + 1]).
        ranks.extend(ids.windows(2).map(|w| self.merge_of(w[0], w[1])));
        loop {
            // The lowest (rank, id) word; a rank belongs to one pair, so the rank alone orders,
            // and `<` keeps the leftmost of equal ranks (the same pair at several places).
            let mut best = NONE;
            let mut at = 0;
            for (i, &r) in ranks.iter().enumerate() {
                if r < best {
                    best = r;
                    at = i;
                }
            }
            if best == NONE {
                break;
            }
            ids[at] = best as u32;
            ids.remove(at + 1);
            ranks.remove(at);
            if at + 1 < ids.len() {
                ranks[at] = self.merge_of(ids[at], ids[at + 1]);
            }
            if at > 0 {
                ranks[at - 1] = self.merge_of(ids[at - 1], ids[at]);
            }
        }
        out.extend_from_slice(ids);
    }

    /// O(n log n): a min-heap of (rank << 32 | position) over a doubly linked list of symbols,
    /// as the crate's `Word::merge_all` (lowest rank first, then the leftmost). An entry is
    /// stale when its left symbol was merged away or its pair changed since it was pushed: a
    /// rank names one pair, so the entry is current exactly when the pair now at its position
    /// still has that rank.
    fn merge_long(&self, piece: &[u8], scratch: &mut Scratch, out: &mut Vec<u32>) {
        let n = piece.len();
        // Positions are u32 below the two markers (documents are at most 2 GiB:
        // `Encoder::encode_into` checks).
        debug_assert!(n < DEAD as usize);
        let Scratch {
            long_ids: id,
            prev,
            next,
            heap,
            ..
        } = scratch;
        id.clear();
        prev.clear();
        next.clear();
        heap.clear();
        id.extend(piece.iter().map(|&b| self.byte_ids[b as usize]));
        prev.push(NO_LINK);
        prev.extend(0..n as u32 - 1);
        next.extend(1..n as u32);
        next.push(NO_LINK);
        for i in 0..n - 1 {
            let m = self.merge_of(id[i], id[i + 1]);
            if m != NONE {
                heap.push(Reverse(m >> 32 << 32 | i as u64));
            }
        }
        while let Some(Reverse(top)) = heap.pop() {
            let (rank, i) = (top >> 32, (top & 0xffff_ffff) as usize);
            let j = next[i];
            if prev[i] == DEAD || j == NO_LINK {
                continue; // merged into its left neighbour, or the last symbol
            }
            let j = j as usize;
            let m = self.merge_of(id[i], id[j]);
            if m == NONE || m >> 32 != rank {
                continue; // its pair changed since
            }
            id[i] = m as u32;
            next[i] = next[j];
            if next[j] != NO_LINK {
                prev[next[j] as usize] = i as u32;
            }
            prev[j] = DEAD;
            if prev[i] != NO_LINK {
                let p = prev[i] as usize;
                let mp = self.merge_of(id[p], id[i]);
                if mp != NONE {
                    heap.push(Reverse(mp >> 32 << 32 | p as u64));
                }
            }
            if next[i] != NO_LINK {
                let q = next[i] as usize;
                let mq = self.merge_of(id[i], id[q]);
                if mq != NONE {
                    heap.push(Reverse(mq >> 32 << 32 | i as u64));
                }
            }
        }
        let mut i = 0;
        loop {
            out.push(id[i]);
            if next[i] == NO_LINK {
                break;
            }
            i = next[i] as usize;
        }
        if n > KEEP_LONG {
            *id = Vec::new();
            *prev = Vec::new();
            *next = Vec::new();
            *heap = BinaryHeap::new();
        }
    }
}
