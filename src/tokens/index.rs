//! One source's rows: the windows of documents it is cut into, an epoch's order of them, and
//! the documents' pieces that make row `r` of an epoch.
//!
//! A source's documents are taken in windows of `window` consecutive documents (in file
//! order). What is kept of them is one number per window, computed once when the loader is
//! built (one pass over the index, in parallel): its tokens (concatenated rows) or the rows
//! its documents pack into (packed rows; packing reads lengths only, see [`pack`](super::pack)).
//! That is 8 bytes per window: 780 KiB for 10^8 documents in windows of 1,024; nothing per
//! document.
//!
//! An epoch of a source ([`EpochOrder`]) permutes the windows, keeps the running sum of their
//! tokens (or rows) in that order (8 bytes per window again), and permutes the epoch's rows.
//! Row `r` of the epoch is then found without a pass over anything:
//!
//! - **concatenated**: the epoch's stream is every window in the permuted order, each window's
//!   documents in an order permuted per (epoch, window); row `r` is the `seq_len + 1` tokens
//!   from token `r * seq_len` of that stream (a binary search over the running sums, then a walk
//!   of at most one window's document lengths). Rows overlap by one token, which is the last
//!   input's label; every token of the epoch is an input of exactly one row. The stream's last
//!   row is cut short by its end (and padded);
//! - **packed**: row `r` is row `j` of one window, as the packer lays the window out (the
//!   packing is the same every epoch; the rows' order is not).
//!
//! Rows are permuted over the whole epoch (Megatron's sample shuffle), so a batch's rows come
//! from unrelated windows. Windows are packed again for each row asked for, with a small cache
//! per worker thread of the windows and document orders used last.

use std::cell::RefCell;
use std::ops::Range;
use std::sync::Arc;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::pack::{PackScratch, PackedWindow, Packing, pack};
use crate::error::{Error, Result};
use crate::sampler::{Permutation, mix};
use crate::source::tokens::TokenSource;

/// How rows of `seq_len` tokens are made of documents.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SampleMode {
    /// Documents end to end, cut into windows of `seq_len + 1` tokens that overlap by one
    /// (Megatron's `GPTDataset`): no padding but at an epoch's end, attention across documents
    /// unless the model masks it with `document_ids` / `cu_seqlens`.
    #[default]
    Concatenated,
    /// Whole documents placed into rows by best-fit decreasing over windows of documents
    /// (documents longer than a row split into full rows), padded; `position_ids` restart and
    /// `cu_seqlens` delimit each document.
    Packed,
}

impl SampleMode {
    /// Its name as settings spell it (`concatenated`, `packed`).
    pub fn name(self) -> &'static str {
        match self {
            SampleMode::Concatenated => "concatenated",
            SampleMode::Packed => "packed",
        }
    }

    /// The mode of a name as [`SampleMode::name`] gives it (`concat` also for concatenated).
    pub fn from_name(name: &str) -> Option<SampleMode> {
        match name {
            "concatenated" | "concat" => Some(SampleMode::Concatenated),
            "packed" | "pack" => Some(SampleMode::Packed),
            _ => None,
        }
    }
}

/// A piece of a document in a row: tokens `start .. start + len` of document `doc`, laid at
/// the row's next place. A row's pieces cover its token window from its first token; places
/// from `seq_len` on hold only the label of the last input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RowPiece {
    pub doc: u64,
    pub start: u64,
    pub len: u64,
    /// The document's last token is this piece's last.
    pub ends_doc: bool,
}

/// One source, cut into windows; see the [module docs](self).
#[derive(Debug)]
pub(crate) struct SourceIndex {
    pub source: Arc<dyn TokenSource>,
    pub mode: SampleMode,
    pub seq_len: u64,
    /// Documents per window.
    pub window: u64,
    pub documents: u64,
    /// Per window: tokens (concatenated) or rows (packed).
    sizes: Vec<u64>,
    pub tokens: u64,
    /// Rows in one epoch of this source.
    pub rows: u64,
    /// The source's [fingerprint](TokenSource::fingerprint), taken when the loader is built.
    pub fingerprint: u64,
}

impl SourceIndex {
    /// Reads every document's length once (in parallel over windows) and keeps a number per
    /// window. A source without a token is an error.
    pub fn build(
        source: Arc<dyn TokenSource>,
        mode: SampleMode,
        seq_len: u64,
        window: u64,
    ) -> Result<SourceIndex> {
        let documents = source.documents();
        let window = window.max(1);
        let windows = documents.div_ceil(window);
        let range = |w: u64| w * window..((w + 1) * window).min(documents);
        let sizes: Vec<(u64, u64)> = (0..windows)
            .into_par_iter()
            .map_init(
                || (PackScratch::default(), Vec::new()),
                |(scratch, lengths), w| -> Result<(u64, u64)> {
                    match mode {
                        SampleMode::Concatenated => {
                            let t = source.tokens_in(range(w))?;
                            Ok((t, t))
                        }
                        SampleMode::Packed => {
                            lengths.clear();
                            for d in range(w) {
                                lengths.push(source.document_len(d)?);
                            }
                            let packed =
                                pack(lengths, seq_len, Packing::BestFitDecreasing, scratch);
                            Ok((packed.tokens(), packed.rows()))
                        }
                    }
                },
            )
            .collect::<Result<_>>()?;
        let tokens: u64 = sizes.iter().map(|s| s.0).sum();
        if tokens == 0 {
            return Err(Error::config(
                "sources",
                format!("{} has no token ({documents} documents)", source.name()),
            ));
        }
        let rows = match mode {
            SampleMode::Concatenated => tokens.div_ceil(seq_len),
            SampleMode::Packed => sizes.iter().map(|s| s.1).sum(),
        };
        let fingerprint = source.fingerprint()?;
        Ok(SourceIndex {
            source,
            mode,
            seq_len,
            window,
            documents,
            sizes: sizes.into_iter().map(|s| s.1).collect(),
            tokens,
            rows,
            fingerprint,
        })
    }

    /// Windows of documents.
    pub fn windows(&self) -> u64 {
        self.sizes.len() as u64
    }

    /// The documents of window `w`.
    pub fn window_docs(&self, w: u64) -> Range<u64> {
        w * self.window..((w + 1) * self.window).min(self.documents)
    }

    /// The order of this source's epoch `epoch` (shuffled with `seed`, or in file order).
    pub fn epoch(&self, seed: Option<u64>, epoch: u64) -> EpochOrder {
        let windows = self.windows();
        let perm = |what: u64, n: u64| seed.map(|s| Permutation::new(n, key_of(s, &[epoch, what])));
        let blocks = perm(1, windows);
        let mut prefix = Vec::with_capacity(windows as usize + 1);
        let mut sum = 0u64;
        prefix.push(0);
        for q in 0..windows {
            let w = blocks.as_ref().map_or(q, |p| p.apply(q));
            sum += self.sizes[w as usize];
            prefix.push(sum);
        }
        EpochOrder {
            epoch,
            seed,
            blocks,
            prefix,
            rows: perm(2, self.rows),
        }
    }

    /// The pieces of row `r` of the epoch `order` (`r < rows`), into `out` (cleared first).
    /// `cache` tells this source's windows apart from other sources' in the thread's cache.
    pub fn row(
        &self,
        order: &EpochOrder,
        r: u64,
        cache: CacheKey,
        out: &mut Vec<RowPiece>,
    ) -> Result<()> {
        out.clear();
        let r = order.rows.as_ref().map_or(r, |p| p.apply(r));
        match self.mode {
            SampleMode::Concatenated => self.concatenated(order, r, cache, out),
            SampleMode::Packed => self.packed(order, r, cache, out),
        }
    }

    fn concatenated(
        &self,
        order: &EpochOrder,
        r: u64,
        cache: CacheKey,
        out: &mut Vec<RowPiece>,
    ) -> Result<()> {
        let p = r * self.seq_len;
        let mut want = (self.seq_len + 1).min(self.tokens.saturating_sub(p));
        let mut q = order.prefix.partition_point(|&x| x <= p).saturating_sub(1) as u64;
        let mut offset = p - order.prefix[q as usize];
        while want > 0 && q < self.windows() {
            let w = order.window(q);
            let docs = self.window_docs(w);
            let sigma = order.documents_of(w, docs.end - docs.start, cache);
            for k in 0..docs.end - docs.start {
                let d = docs.start + sigma.as_ref().map_or(k, |s| s.apply(k));
                let len = self.source.document_len(d)?;
                if offset >= len {
                    offset -= len;
                    continue;
                }
                let take = (len - offset).min(want);
                out.push(RowPiece {
                    doc: d,
                    start: offset,
                    len: take,
                    ends_doc: offset + take == len,
                });
                want -= take;
                offset = 0;
                if want == 0 {
                    break;
                }
            }
            q += 1;
        }
        Ok(())
    }

    fn packed(
        &self,
        order: &EpochOrder,
        r: u64,
        cache: CacheKey,
        out: &mut Vec<RowPiece>,
    ) -> Result<()> {
        let q = order.prefix.partition_point(|&x| x <= r).saturating_sub(1);
        let j = r - order.prefix[q];
        let w = order.window(q as u64);
        let docs = self.window_docs(w);
        let window = self.packed_window(w, &docs, cache)?;
        for piece in window.row(j) {
            let doc = docs.start + u64::from(piece.doc);
            out.push(RowPiece {
                doc,
                start: piece.start,
                len: piece.len,
                ends_doc: !piece.continues,
            });
            if piece.continues {
                // The next token of the document: the label of the row's last input.
                out.push(RowPiece {
                    doc,
                    start: piece.start + piece.len,
                    len: 1,
                    ends_doc: false,
                });
            }
        }
        Ok(())
    }

    /// Window `w` packed, from this thread's cache or packed now.
    fn packed_window(
        &self,
        w: u64,
        docs: &Range<u64>,
        cache: CacheKey,
    ) -> Result<Arc<PackedWindow>> {
        let key = (cache, u64::MAX, w);
        if let Some(Cached::Window(p)) = cached(&key) {
            return Ok(p);
        }
        let mut lengths = Vec::with_capacity((docs.end - docs.start) as usize);
        for d in docs.clone() {
            lengths.push(self.source.document_len(d)?);
        }
        let packed = SCRATCH.with(|s| {
            pack(
                &lengths,
                self.seq_len,
                Packing::BestFitDecreasing,
                &mut s.borrow_mut(),
            )
        });
        let packed = Arc::new(packed);
        remember(key, Cached::Window(Arc::clone(&packed)));
        Ok(packed)
    }
}

/// One epoch of one source: its windows' order, the running sums over them, its rows' order.
#[derive(Debug)]
pub(crate) struct EpochOrder {
    pub epoch: u64,
    seed: Option<u64>,
    blocks: Option<Permutation>,
    /// Tokens (concatenated) or rows (packed) of the windows before position `q` of the order.
    prefix: Vec<u64>,
    rows: Option<Permutation>,
}

impl EpochOrder {
    fn window(&self, q: u64) -> u64 {
        self.blocks.as_ref().map_or(q, |p| p.apply(q))
    }

    /// The order of the `n` documents of window `w` in this epoch, from the thread's cache.
    fn documents_of(&self, w: u64, n: u64, cache: CacheKey) -> Option<Permutation> {
        let seed = self.seed?;
        let key = (cache, self.epoch, w);
        if let Some(Cached::Docs(p)) = cached(&key) {
            return Some(p);
        }
        let p = Permutation::new(n, key_of(seed, &[self.epoch, 3, w]));
        remember(key, Cached::Docs(p.clone()));
        Some(p)
    }
}

/// Mixes `parts` into `seed`, one by one.
pub(crate) fn key_of(seed: u64, parts: &[u64]) -> u64 {
    parts
        .iter()
        .fold(mix(seed ^ 0x243f_6a88_85a3_08d3), |h, &p| {
            mix(h ^ mix(p.wrapping_add(0x9e37_79b9_7f4a_7c15)))
        })
}

/// What tells one source of one loader from another in a thread's cache: (loader, source).
pub(crate) type CacheKey = (u64, usize);

/// A thread's cache entry: a packed window, or a window's document order in one epoch.
#[derive(Clone)]
enum Cached {
    Window(Arc<PackedWindow>),
    Docs(Permutation),
}

/// Entries a thread keeps: a few batches' worth of windows is all a global shuffle revisits.
const CACHE_ENTRIES: usize = 16;

/// What a cache entry is found by: (source, epoch or `u64::MAX` for a packed window, window).
type EntryKey = (CacheKey, u64, u64);

thread_local! {
    static CACHE: RefCell<Vec<(EntryKey, Cached)>> = const { RefCell::new(Vec::new()) };
    static SCRATCH: RefCell<PackScratch> = RefCell::new(PackScratch::default());
}

fn cached(key: &EntryKey) -> Option<Cached> {
    CACHE.with(|c| {
        let mut c = c.borrow_mut();
        let i = c.iter().position(|(k, _)| k == key)?;
        // Most recently used first.
        let entry = c.remove(i);
        let value = entry.1.clone();
        c.insert(0, entry);
        Some(value)
    })
}

fn remember(key: EntryKey, value: Cached) {
    CACHE.with(|c| {
        let mut c = c.borrow_mut();
        c.truncate(CACHE_ENTRIES - 1);
        c.insert(0, (key, value));
    })
}
