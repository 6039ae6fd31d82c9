//! Packing a window of documents into rows of `row_len` tokens.
//!
//! A document of `len` tokens is cut into `len / row_len` full rows (its pieces in order, each
//! exactly a row) and a remainder of `len % row_len` tokens, its last piece. The remainders are
//! then placed into rows by one of three rules ([`Packing`]); [`Packing::BestFitDecreasing`] is
//! the token loader's:
//!
//! - best-fit decreasing: remainders from the longest (ties: the first document first), each
//!   into the open row it leaves least room in, a new row when none has room;
//! - first-fit decreasing: the same order, each into the first open row it fits;
//! - first-fit: in the documents' order, each into the first open row it fits (the online rule
//!   of streaming packers).
//!
//! Every rule keeps a row's documents whole (only the full rows of a long document are pieces),
//! and each leaves no two rows that one row could hold (each row opened after another found no
//! room in it). Only lengths are read: a window of 1,024 documents packs in 0.1 to 0.2 ms
//! (`benches/RESULTS.md`), so the token loader packs a window again whenever a row of it is
//! asked for (a few windows cached per thread), instead of keeping the result.
//!
//! Rows come out in this order: the full rows, document by document, then the packed rows in
//! the order they were opened.

/// How remainders are placed into rows (see the [module docs](self)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Packing {
    /// Longest first, each into the fullest row it fits (the token loader's).
    #[default]
    BestFitDecreasing,
    /// Longest first, each into the first row it fits.
    FirstFitDecreasing,
    /// In order, each into the first row it fits.
    FirstFit,
}

/// One piece of a document placed in a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The document's position in the window.
    pub doc: u32,
    /// Its first token within the document.
    pub start: u64,
    /// Its tokens.
    pub len: u64,
    /// True when the document goes on past this piece (a full row of a longer document): the
    /// next token is the document's, the label of the piece's last token.
    pub continues: bool,
}

/// A window of documents packed into rows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PackedWindow {
    row_len: u64,
    /// Documents with full rows, and the first of their rows: `(doc, first_row, len)`.
    full: Vec<(u32, u64, u64)>,
    full_rows: u64,
    /// The packed rows' remainders: row `k`'s are `items[starts[k]..starts[k + 1]]`, as
    /// `(doc, len)`, each starting at `len - len % row_len` of its document.
    items: Vec<(u32, u64)>,
    starts: Vec<u32>,
    tokens: u64,
}

impl PackedWindow {
    /// Rows in the window.
    pub fn rows(&self) -> u64 {
        self.full_rows + self.starts.len().saturating_sub(1) as u64
    }

    /// Tokens of every document of the window.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// The share of the rows' tokens that is padding (0 to 1).
    pub fn padding_fraction(&self) -> f64 {
        let capacity = self.rows() * self.row_len;
        if capacity == 0 {
            0.0
        } else {
            1.0 - self.tokens as f64 / capacity as f64
        }
    }

    /// The pieces of row `row` (`row < rows()`), in the order they are laid out.
    pub fn row(&self, row: u64) -> impl Iterator<Item = Piece> + '_ {
        let (full, packed) = if row < self.full_rows {
            let i = self.full.partition_point(|&(_, first, _)| first <= row) - 1;
            let (doc, first, len) = self.full[i];
            let start = (row - first) * self.row_len;
            let piece = Piece {
                doc,
                start,
                len: self.row_len,
                continues: start + self.row_len < len,
            };
            (Some(piece), 0..0)
        } else {
            let k = (row - self.full_rows) as usize;
            let range = match (self.starts.get(k), self.starts.get(k + 1)) {
                (Some(&a), Some(&b)) => a as usize..b as usize,
                _ => 0..0,
            };
            (None, range)
        };
        let row_len = self.row_len;
        full.into_iter()
            .chain(self.items[packed].iter().map(move |&(doc, len)| {
                let rem = len % row_len;
                Piece {
                    doc,
                    start: len - rem,
                    len: rem,
                    continues: false,
                }
            }))
    }
}

/// Reusable memory of [`pack`] (a worker keeps one).
#[derive(Default)]
pub struct PackScratch {
    order: Vec<u32>,
    /// Remaining room of each open row.
    room: Vec<u64>,
    bin_of: Vec<u32>,
    /// Best fit: open rows by remaining room (`head[room]`, linked through `next`), and the
    /// rooms that have a row, as a two-level bitset.
    head: Vec<u32>,
    next: Vec<u32>,
    words: Vec<u64>,
    summary: Vec<u64>,
    /// First fit: the largest room in each subtree of a tree over rows.
    tree: Vec<u64>,
}

const NONE: u32 = u32::MAX;

/// Packs documents of these lengths into rows of `row_len` tokens (see the [module docs](self)).
///
/// `row_len` must be at least 1; windows hold fewer than 2^32 documents.
pub fn pack(
    lengths: &[u64],
    row_len: u64,
    how: Packing,
    scratch: &mut PackScratch,
) -> PackedWindow {
    let row_len = row_len.max(1);
    let mut window = PackedWindow {
        row_len,
        ..PackedWindow::default()
    };
    let s = scratch;
    s.order.clear();
    for (doc, &len) in lengths.iter().enumerate() {
        window.tokens += len;
        let full = len / row_len;
        if full > 0 {
            window.full.push((doc as u32, window.full_rows, len));
            window.full_rows += full;
        }
        if len % row_len > 0 {
            s.order.push(doc as u32);
        }
    }
    if how != Packing::FirstFit {
        // Longest remainder first; the sort is stable, so equal ones keep the documents' order.
        s.order
            .sort_by_key(|&d| std::cmp::Reverse(lengths[d as usize] % row_len));
    }
    s.room.clear();
    s.bin_of.clear();
    s.bin_of.resize(lengths.len(), NONE);
    match how {
        Packing::BestFitDecreasing => best_fit(lengths, row_len, s),
        Packing::FirstFitDecreasing | Packing::FirstFit => first_fit(lengths, row_len, s),
    }
    // Lay the remainders out row by row (a counting sort by row), in placement order.
    let rows = s.room.len();
    window.starts = vec![0; rows + 1];
    for &d in &s.order {
        window.starts[s.bin_of[d as usize] as usize + 1] += 1;
    }
    for k in 0..rows {
        window.starts[k + 1] += window.starts[k];
    }
    let mut fill: Vec<u32> = window.starts[..rows].to_vec();
    window.items = vec![(0, 0); s.order.len()];
    for &d in &s.order {
        let bin = s.bin_of[d as usize] as usize;
        window.items[fill[bin] as usize] = (d, lengths[d as usize]);
        fill[bin] += 1;
    }
    window
}

/// Best fit over the sorted remainders: rows kept by remaining room in buckets, the smallest
/// room that fits found with a two-level bitset.
fn best_fit(lengths: &[u64], row_len: u64, s: &mut PackScratch) {
    let rooms = row_len as usize + 1;
    let words = rooms.div_ceil(64);
    if s.head.len() < rooms {
        s.head.resize(rooms, NONE);
    }
    s.words.clear();
    s.words.resize(words, 0);
    s.summary.clear();
    s.summary.resize(words.div_ceil(64), 0);
    s.next.clear();
    for i in 0..s.order.len() {
        let d = s.order[i] as usize;
        let len = lengths[d] % row_len;
        let bin = match find_from(&s.words, &s.summary, len as usize) {
            Some(room) => {
                let bin = s.head[room];
                // Take the row out of its bucket.
                s.head[room] = s.next[bin as usize];
                if s.head[room] == NONE {
                    clear_bit(&mut s.words, &mut s.summary, room);
                }
                bin
            }
            None => {
                s.room.push(row_len);
                s.next.push(NONE);
                (s.room.len() - 1) as u32
            }
        };
        s.bin_of[d] = bin;
        let room = s.room[bin as usize] - len;
        s.room[bin as usize] = room;
        if room > 0 {
            let room = room as usize;
            s.next[bin as usize] = s.head[room];
            s.head[room] = bin;
            set_bit(&mut s.words, &mut s.summary, room);
        }
    }
    // Leave the buckets empty for the next window.
    for &room in &s.room {
        if let Some(h) = s.head.get_mut(room as usize) {
            *h = NONE;
        }
    }
}

fn set_bit(words: &mut [u64], summary: &mut [u64], i: usize) {
    words[i / 64] |= 1 << (i % 64);
    summary[i / 4096] |= 1 << ((i / 64) % 64);
}

fn clear_bit(words: &mut [u64], summary: &mut [u64], i: usize) {
    words[i / 64] &= !(1 << (i % 64));
    if words[i / 64] == 0 {
        summary[i / 4096] &= !(1 << ((i / 64) % 64));
    }
}

/// The smallest set bit at `i` or above.
fn find_from(words: &[u64], summary: &[u64], i: usize) -> Option<usize> {
    let w = i / 64;
    let here = words.get(w)? & (!0u64 << (i % 64));
    if here != 0 {
        return Some(w * 64 + here.trailing_zeros() as usize);
    }
    // The next word with a bit, through the summary (one bit per word).
    let next = w + 1;
    let mut s = next / 64;
    let mut bits = summary.get(s)? & (!0u64).checked_shl((next % 64) as u32).unwrap_or(0);
    loop {
        if bits != 0 {
            let word = s * 64 + bits.trailing_zeros() as usize;
            return Some(word * 64 + words[word].trailing_zeros() as usize);
        }
        s += 1;
        bits = *summary.get(s)?;
    }
}

/// First fit: a tree of the largest room over rows in opening order finds the first row that
/// fits in O(log rows).
fn first_fit(lengths: &[u64], row_len: u64, s: &mut PackScratch) {
    let leaves = s.order.len().max(1).next_power_of_two();
    s.tree.clear();
    s.tree.resize(2 * leaves, 0);
    for i in 0..s.order.len() {
        let d = s.order[i] as usize;
        let len = lengths[d] % row_len;
        let bin = if s.tree[1] >= len {
            let mut node = 1;
            while node < leaves {
                node = if s.tree[2 * node] >= len {
                    2 * node
                } else {
                    2 * node + 1
                };
            }
            node - leaves
        } else {
            s.room.push(row_len);
            s.room.len() - 1
        };
        s.bin_of[d] = bin as u32;
        s.room[bin] -= len;
        let mut node = leaves + bin;
        s.tree[node] = s.room[bin];
        while node > 1 {
            node /= 2;
            s.tree[node] = s.tree[2 * node].max(s.tree[2 * node + 1]);
        }
    }
}

/// Every row of `window`, each as its pieces (for tests and reports).
pub fn rows_of(window: &PackedWindow) -> Vec<Vec<Piece>> {
    (0..window.rows())
        .map(|r| window.row(r).collect())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn check(lengths: &[u64], row_len: u64, how: Packing) -> Result<PackedWindow, TestCaseError> {
        let w = pack(lengths, row_len, how, &mut PackScratch::default());
        let rows = rows_of(&w);
        prop_assert_eq!(rows.len() as u64, w.rows());
        // Every token of every document exactly once, pieces in order, split only into full
        // rows and a last remainder.
        let mut covered = vec![Vec::new(); lengths.len()];
        let mut loads = Vec::new();
        for row in &rows {
            let load: u64 = row.iter().map(|p| p.len).sum();
            prop_assert!(load <= row_len && load > 0);
            for p in row {
                let len = lengths[p.doc as usize];
                prop_assert!(p.len == row_len || p.start + p.len == len, "{p:?} of {len}");
                prop_assert_eq!(p.continues, p.start + p.len < len);
                if p.len == row_len {
                    prop_assert_eq!(row.len(), 1, "a full piece fills its row");
                }
                covered[p.doc as usize].push((p.start, p.len));
            }
            if row.len() > 1 || row[0].len < row_len {
                loads.push(load);
            }
        }
        for (d, pieces) in covered.iter_mut().enumerate() {
            pieces.sort_unstable();
            let mut at = 0;
            for &(start, len) in pieces.iter() {
                prop_assert_eq!(start, at, "document {}", d);
                at += len;
            }
            prop_assert_eq!(at, lengths[d]);
        }
        // No two packed rows that one row could hold.
        for i in 0..loads.len() {
            for j in i + 1..loads.len() {
                prop_assert!(
                    loads[i] + loads[j] > row_len,
                    "rows {i} and {j}: {:?}",
                    loads
                );
            }
        }
        Ok(w)
    }

    proptest! {
        #[test]
        fn every_rule_places_every_token_once(
            lengths in proptest::collection::vec(0u64..300, 0..200),
            row_len in 1u64..128,
        ) {
            let mut rows = Vec::new();
            for how in [Packing::BestFitDecreasing, Packing::FirstFitDecreasing, Packing::FirstFit] {
                rows.push(check(&lengths, row_len, how)?.rows());
            }
            // No rule can use fewer rows than the tokens need.
            let remainders: u64 = lengths.iter().map(|l| l % row_len).sum();
            let full: u64 = lengths.iter().map(|l| l / row_len).sum();
            prop_assert!(rows[0] >= full + remainders.div_ceil(row_len));
        }

        #[test]
        fn long_rows_use_the_bitset_summary(
            lengths in proptest::collection::vec(1u64..20_000, 1..100),
        ) {
            check(&lengths, 9_000, Packing::BestFitDecreasing)?;
        }
    }

    #[test]
    fn best_fit_fills_the_tightest_row() {
        // Rows of 10: 7 and 6 open two rows; 3 goes into 7's (room 3, exactly), 4 into 6's.
        let w = pack(
            &[7, 6, 3, 4],
            10,
            Packing::BestFitDecreasing,
            &mut PackScratch::default(),
        );
        let rows: Vec<Vec<u32>> = rows_of(&w)
            .iter()
            .map(|r| r.iter().map(|p| p.doc).collect())
            .collect();
        assert_eq!(rows, [vec![0, 2], vec![1, 3]]);
        // First fit in order: 7, then 6 (new row), 3 into the first (room 3), 4 into the second.
        let w = pack(
            &[7, 6, 3, 4],
            10,
            Packing::FirstFit,
            &mut PackScratch::default(),
        );
        assert_eq!(w.rows(), 2);
        // A document longer than a row: full rows first, its remainder packed.
        let w = pack(
            &[25, 3],
            10,
            Packing::BestFitDecreasing,
            &mut PackScratch::default(),
        );
        let rows = rows_of(&w);
        assert_eq!(rows.len(), 3);
        assert_eq!(
            rows[0],
            [Piece {
                doc: 0,
                start: 0,
                len: 10,
                continues: true
            }]
        );
        assert!(
            rows[1][0].continues,
            "the second full row goes on into the remainder"
        );
        assert_eq!(rows[2].iter().map(|p| p.len).collect::<Vec<_>>(), [5, 3]);
        assert!((w.padding_fraction() - 2.0 / 30.0).abs() < 1e-12);
    }
}
