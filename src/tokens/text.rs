//! A text source's rows: windows of documents tokenized as the stream reaches them, their
//! sizes learned in the stream's order, a shared and bounded cache of their ids.
//!
//! A pre-tokenized source knows every window's size when the loader is built ([`index`]);
//! a text source cannot: that would be a pass of the tokenizer over the whole corpus before
//! the first batch, and again up to the resume point on every resume. So:
//!
//! - **Passes of windows, sizes learned in order.** The source's stream is its passes end to
//!   end (a pass: every document once; the row after a pass's last is the next pass's first,
//!   no row lost or repeated). A pass permutes the source's windows of `window` documents (a
//!   pure function of seed and pass) and, for concatenated rows, the documents within each;
//!   the windows' sizes (tokens, or rows when packed) become known as they are tokenized, and
//!   the running sums are extended in that order: row `r` is found once the windows before it
//!   are counted.
//! - **A shared, bounded cache** ([`TextIndex`]): a window is tokenized once, by the worker
//!   that first needs it (the others wait for it, or claim the next window of the frontier:
//!   `W` workers tokenize up to `W` windows at once, never more windows ahead than that), its
//!   ids kept (u32, with its documents' offsets; packed: the window packed by best-fit
//!   decreasing when it is tokenized) until the cache's byte limit evicts the oldest; an
//!   evicted window asked for again is tokenized again (same ids). The running sums (a few
//!   tens of bytes per window, nothing per document) are kept from the first row the loader
//!   may still ask for ([`TextIndex::release_before`]: the next batch to deliver) to the
//!   frontier: the rows in flight, however far apart the workers are, are always found from
//!   them, and a worker ahead never moves the stream past a row a worker behind still needs.
//! - **Rows shuffled within blocks**, not over the pass (the pass is not known ahead):
//!   packed rows are permuted within their window, concatenated rows within blocks of `window`
//!   consecutive rows. A batch's rows therefore come from a few windows at a time (Megatron
//!   shuffles every sample of the epoch), and the tokenization frontier is at most a block
//!   ahead of the rows in flight.
//! - **Resume without tokenizing the past**: a state names, for a text source, its pass, the
//!   row the pass starts at and the window its next row's block starts in with the tokens (or
//!   rows) of the pass before it ([`TextPlace`](crate::loader::TextPlace)); a resumed loader
//!   starts its sums there. Nothing depends on ranks or workers, so the stream is the same
//!   under any world size and worker count, resumed or not. Going back before the place the
//!   stream was started or resumed at (`set_epoch` to an earlier epoch) tokenizes again from
//!   the last pass start known before it.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::index::{RowPiece, SampleMode, key_of};
use super::pack::{PackScratch, PackedWindow, Packing, pack};
use crate::error::{Error, Result};
use crate::loader::TextPlace;
use crate::sampler::Permutation;
use crate::source::tokens::TextTokens;
use crate::tokenizer::Encoder;

/// The default byte limit of a text source's cache of tokenized windows.
pub(crate) const DEFAULT_CACHE_BYTES: u64 = 256 << 20;

/// A window tokenized: its documents' ids end to end, in the order its rows read them.
struct Window {
    ids: Vec<u32>,
    /// Document `k`'s ids are `ids[offsets[k]..offsets[k + 1]]`.
    offsets: Vec<u64>,
    /// Document `k`'s number in the source (its row).
    docs: Vec<u64>,
    /// Packed rows: the window packed, and its rows' order in this pass.
    packed: Option<(PackedWindow, Option<Permutation>)>,
    /// Tokens (concatenated) or rows (packed).
    units: u64,
}

impl Window {
    fn bytes(&self) -> u64 {
        (self.ids.capacity() * 4 + self.offsets.capacity() * 8 + self.docs.capacity() * 8) as u64
            + self
                .packed
                .as_ref()
                .map_or(0, |(p, _)| p.rows() * 16 + self.docs.len() as u64 * 16)
    }
}

/// A place in the stream that rows can be found from: the start of window `ordinal` of
/// `pass`, `start` units into the pass, the pass starting at row `first_row`; every row from
/// `covers_from` on is found from here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Anchor {
    pass: u64,
    ordinal: u64,
    start: u64,
    first_row: u64,
    covers_from: u64,
}

/// What a window of the run holds.
enum Slot {
    /// Being tokenized by a worker.
    Claimed,
    Ready(Arc<Window>),
    /// Not held (evicted, or its tokenization failed): the next to need it tokenizes it.
    Free,
}

/// One window of the run: its place, and its size once tokenized.
struct Meta {
    pass: u64,
    ordinal: u64,
    /// Units of the pass before it, and the row its pass starts at: valid for the windows
    /// whose predecessors are all sized (`..=known`).
    start: u64,
    first_row: u64,
    size: Option<u64>,
    slot: Slot,
}

/// A completed pass of the run.
#[derive(Clone, Copy, Debug)]
struct Pass {
    pass: u64,
    first_row: u64,
    rows: u64,
    units: u64,
}

/// The windows known from an anchor on: contiguous in the stream's order of windows.
struct Run {
    /// Changes when the run restarts, so that a window tokenized for the old one is dropped.
    generation: u64,
    base: Anchor,
    metas: VecDeque<Meta>,
    /// `metas[..known]` are sized.
    known: usize,
    passes: Vec<Pass>,
    /// Where rows can be found from: the origin, pass starts, resume places (a few).
    checkpoints: Vec<Anchor>,
    bytes: u64,
    /// Rows below this one are not asked for again (the loader delivered them); the sums of
    /// windows before it may go.
    needed_from: u64,
    /// Recent permutations of windows (per pass) and of blocks of rows (per pass and block).
    window_orders: Vec<(u64, Permutation)>,
    block_orders: Vec<((u64, u64), Permutation)>,
}

/// The windows a row is read from, each with its start in the pass.
type Held = Vec<(Arc<Window>, u64)>;

/// What a row needs, as the run stands.
enum Plan {
    /// The windows that hold it, with their starts in the pass; and the row's place in them.
    Rows(Held, Need),
    /// Window `metas[i]` is not held: tokenize it.
    Fetch(usize),
    /// The sums do not reach the row yet: claim the next window.
    Extend,
    /// Another worker is tokenizing what is needed.
    Wait,
    /// The row is not reachable from the run: start it again here.
    Restart(Anchor),
}

/// The row's place in the windows a plan names.
#[derive(Clone, Copy)]
enum Need {
    /// Tokens `from..to` of the pass.
    Tokens { from: u64, to: u64 },
    /// Row `row` of the (one) window, in the packer's order.
    Packed { row: u64 },
}

/// A window to tokenize: its run, its place, the window of the source it is.
struct Job {
    generation: u64,
    pass: u64,
    ordinal: u64,
    window: u64,
}

/// How far a text source's stream went: passes completed, windows and tokens tokenized.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct TextStats {
    /// Passes over the source completed (every window of the pass tokenized).
    pub passes: u64,
    /// Windows tokenized (again after an eviction included).
    pub windows: u64,
    /// Windows tokenized again after their ids were evicted from the cache.
    pub retokenized: u64,
    /// Times the sums started again from a pass start or a resume place: going back before
    /// the rows delivered (`set_epoch` to an earlier epoch, a state loaded), or forward over
    /// rows no longer needed.
    pub restarts: u64,
    /// Documents tokenized.
    pub documents: u64,
    /// Tokens the tokenizer gave.
    pub tokens: u64,
    /// One pass's tokens and rows, as estimated when the loader was built.
    pub estimated_tokens: u64,
    /// See `estimated_tokens`.
    pub estimated_rows: u64,
}

/// A text source's rows (see the [module docs](self)).
pub(crate) struct TextIndex {
    pub source: Arc<TextTokens>,
    pub mode: SampleMode,
    pub seq_len: u64,
    pub window: u64,
    pub documents: u64,
    windows: u64,
    seed: Option<u64>,
    /// Rows shuffled together (concatenated rows).
    block: u64,
    /// One pass's tokens and rows, estimated at build from the first window in file order.
    pub estimated_tokens: u64,
    pub estimated_rows: u64,
    pub fingerprint: u64,
    cache_bytes: u64,
    /// Windows tokenized at once ahead of the sums.
    ahead: usize,
    run: Mutex<Run>,
    changed: Condvar,
    passes: AtomicU64,
    tokenized: AtomicU64,
    retokenized: AtomicU64,
    restarts: AtomicU64,
    documents_done: AtomicU64,
    tokens_done: AtomicU64,
}

impl std::fmt::Debug for TextIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextIndex")
            .field("source", &self.source)
            .field("mode", &self.mode)
            .field("window", &self.window)
            .finish()
    }
}

impl TextIndex {
    /// The index of `source`: one pass estimated from its first window (tokenized now, in
    /// file order), nothing else read. `ahead`: windows tokenized at once (the workers).
    pub fn build(
        source: Arc<TextTokens>,
        mode: SampleMode,
        seq_len: u64,
        window: u64,
        seed: Option<u64>,
        ahead: usize,
        cache_bytes: u64,
    ) -> Result<TextIndex> {
        let documents = source.documents();
        let window = window.max(1);
        let first = documents.min(window);
        let mut ids = Vec::new();
        let mut lengths = Vec::with_capacity(first as usize);
        with_encoder(&source, |encoder| -> Result<()> {
            for d in 0..first {
                let before = ids.len();
                source.encode(d, encoder, &mut ids)?;
                lengths.push((ids.len() - before) as u64);
            }
            Ok(())
        })?;
        let tokens = ids.len() as u64;
        let scale = |x: u64| (u128::from(x) * u128::from(documents)).div_ceil(u128::from(first));
        let estimated_tokens = scale(tokens).min(u128::from(u64::MAX)) as u64;
        let estimated_rows = match mode {
            SampleMode::Concatenated => estimated_tokens.div_ceil(seq_len),
            SampleMode::Packed => {
                let rows = pack(
                    &lengths,
                    seq_len,
                    Packing::BestFitDecreasing,
                    &mut PackScratch::default(),
                )
                .rows();
                scale(rows).min(u128::from(u64::MAX)) as u64
            }
        }
        .max(1);
        let fingerprint = source.fingerprint()?;
        let origin = Anchor {
            pass: 0,
            ordinal: 0,
            start: 0,
            first_row: 0,
            covers_from: 0,
        };
        Ok(TextIndex {
            documents,
            windows: documents.div_ceil(window),
            source,
            mode,
            seq_len,
            window,
            seed,
            block: window,
            estimated_tokens,
            estimated_rows,
            fingerprint,
            cache_bytes,
            ahead: ahead.max(1),
            run: Mutex::new(Run {
                generation: 0,
                base: origin,
                metas: VecDeque::new(),
                known: 0,
                passes: Vec::new(),
                checkpoints: vec![origin],
                bytes: 0,
                needed_from: 0,
                window_orders: Vec::new(),
                block_orders: Vec::new(),
            }),
            changed: Condvar::new(),
            passes: AtomicU64::new(0),
            tokenized: AtomicU64::new(0),
            retokenized: AtomicU64::new(0),
            restarts: AtomicU64::new(0),
            documents_done: AtomicU64::new(0),
            tokens_done: AtomicU64::new(0),
        })
    }

    /// What it did so far.
    pub fn stats(&self) -> TextStats {
        TextStats {
            passes: self.passes.load(Ordering::Relaxed),
            windows: self.tokenized.load(Ordering::Relaxed),
            retokenized: self.retokenized.load(Ordering::Relaxed),
            restarts: self.restarts.load(Ordering::Relaxed),
            documents: self.documents_done.load(Ordering::Relaxed),
            tokens: self.tokens_done.load(Ordering::Relaxed),
            estimated_tokens: self.estimated_tokens,
            estimated_rows: self.estimated_rows,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Run> {
        self.run.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Rows of a pass of `units`.
    fn rows_of(&self, units: u64) -> u64 {
        match self.mode {
            SampleMode::Concatenated => units.div_ceil(self.seq_len),
            SampleMode::Packed => units,
        }
    }

    /// The first row every row after which can be found from a window `start` units into a
    /// pass that starts at row `first_row` (concatenated: the next block's start).
    fn covers_from(&self, first_row: u64, start: u64) -> u64 {
        match self.mode {
            SampleMode::Concatenated => {
                let block_units = self.block.saturating_mul(self.seq_len);
                first_row + self.block * start.div_ceil(block_units)
            }
            SampleMode::Packed => first_row + start,
        }
    }

    /// The pieces and tokens of row `q` of the source's stream, into `pieces` and `tokens`
    /// (cleared first). Tokenizes what it needs and is not held.
    pub fn row(&self, q: u64, pieces: &mut Vec<RowPiece>, tokens: &mut Vec<u32>) -> Result<()> {
        pieces.clear();
        tokens.clear();
        let (windows, need) = self.windows_for(q)?;
        match need {
            Need::Tokens { from, to } => concatenated(&windows, from, to, pieces, tokens),
            Need::Packed { row } => {
                let (window, _) = &windows[0];
                packed(window, row, pieces, tokens);
            }
        }
        Ok(())
    }

    /// Where row `q`'s stream stands, for a state: its pass, its row in the pass, and the
    /// place a resume starts from. Tokenizes what it needs to count (not the ids' cache).
    pub fn place(&self, q: u64) -> Result<(u64, u64, TextPlace)> {
        let mut run = self.lock();
        loop {
            match self.locate(&mut run, q)? {
                Located::Found {
                    pass,
                    first_row,
                    anchor,
                } => {
                    let m = &run.metas[anchor];
                    return Ok((
                        pass,
                        q - first_row,
                        TextPlace {
                            first_row,
                            window: m.ordinal,
                            before: m.start,
                        },
                    ));
                }
                Located::Extend => run = self.extend(run)?,
                Located::Restart(a) => self.restart_for(&mut run, a, q),
            }
        }
    }

    /// Starts the stream at a state's place: row `q` is in pass `pass`, which starts at
    /// `place.first_row`; its block starts in window `place.window`, `place.before` units
    /// into the pass.
    pub fn resume_at(&self, q: u64, pass: u64, place: &TextPlace) -> Result<()> {
        if place.window >= self.windows || q < place.first_row {
            return Err(Error::mismatch(format!(
                "cannot resume: the state's place in {} (window {} of {}, row {q} of a pass \
                 from row {}) is not one of this source's",
                self.source.name(),
                place.window,
                self.windows,
                place.first_row
            )));
        }
        let anchor = Anchor {
            pass,
            ordinal: place.window,
            start: place.before,
            first_row: place.first_row,
            covers_from: self.covers_from(place.first_row, place.before).min(q),
        };
        let mut run = self.lock();
        if !run.checkpoints.contains(&anchor) {
            run.checkpoints.push(anchor);
            trim_checkpoints(&mut run.checkpoints);
        }
        if run.base != anchor {
            self.restart(&mut run, anchor);
        }
        run.needed_from = q;
        Ok(())
    }

    /// Says that rows of the stream below `q` will not be asked for again (the loader
    /// delivered them, or went back before them): the sums before it may be dropped.
    pub fn release_before(&self, q: u64) {
        let mut run = self.lock();
        run.needed_from = q;
        self.drop_released(&mut run);
    }

    /// The windows holding row `q`, held (tokenized now if need be), and its place in them.
    fn windows_for(&self, q: u64) -> Result<(Held, Need)> {
        let mut run = self.lock();
        loop {
            match self.plan(&mut run, q)? {
                Plan::Rows(windows, need) => return Ok((windows, need)),
                Plan::Fetch(i) => {
                    self.retokenized.fetch_add(1, Ordering::Relaxed);
                    run = self.tokenize_window(run, i)?;
                }
                Plan::Extend => run = self.extend(run)?,
                Plan::Wait => {
                    run = self.changed.wait(run).unwrap_or_else(|p| p.into_inner());
                }
                Plan::Restart(a) => self.restart_for(&mut run, a, q),
            }
        }
    }

    /// Claims the next window of the frontier and tokenizes it, or waits when `ahead`
    /// windows past the sized prefix are being tokenized or were (one slow window must not
    /// let the others run on without bound).
    fn extend<'a>(&'a self, mut run: MutexGuard<'a, Run>) -> Result<MutexGuard<'a, Run>> {
        // A window past the prefix whose tokenization failed: tokenize it again (its error
        // again, to this worker too) rather than wait for a size that will not come.
        if let Some(i) = (run.known..run.metas.len())
            .find(|&i| run.metas[i].size.is_none() && matches!(run.metas[i].slot, Slot::Free))
        {
            return self.tokenize_window(run, i);
        }
        if run.metas.len() - run.known >= self.ahead {
            return Ok(self.changed.wait(run).unwrap_or_else(|p| p.into_inner()));
        }
        let (pass, ordinal) = match run.metas.back() {
            Some(m) if m.ordinal + 1 < self.windows => (m.pass, m.ordinal + 1),
            Some(m) => (m.pass + 1, 0),
            None => (run.base.pass, run.base.ordinal),
        };
        let (start, first_row) = match run.metas.back() {
            None => (run.base.start, run.base.first_row),
            // After a sized prefix: placed now (`advance` has gone past it).
            Some(m) if run.known == run.metas.len() => {
                let end = m.start + m.size.unwrap_or(0);
                if m.ordinal + 1 < self.windows {
                    (end, m.first_row)
                } else {
                    (0, m.first_row + self.rows_of(end))
                }
            }
            Some(_) => (0, 0), // placed by `advance` when its predecessors are sized
        };
        run.metas.push_back(Meta {
            pass,
            ordinal,
            start,
            first_row,
            size: None,
            slot: Slot::Free,
        });
        let last = run.metas.len() - 1;
        self.tokenize_window(run, last)
    }

    /// Claims window `metas[i]` and tokenizes it.
    fn tokenize_window<'a>(
        &'a self,
        mut run: MutexGuard<'a, Run>,
        i: usize,
    ) -> Result<MutexGuard<'a, Run>> {
        run.metas[i].slot = Slot::Claimed;
        let (pass, ordinal) = (run.metas[i].pass, run.metas[i].ordinal);
        let job = Job {
            generation: run.generation,
            pass,
            ordinal,
            window: self.window_of(&mut run, pass, ordinal),
        };
        self.tokenize_and_store(run, job)
    }

    /// The source's window at `ordinal` of pass `pass`'s order.
    fn window_of(&self, run: &mut Run, pass: u64, ordinal: u64) -> u64 {
        let Some(seed) = self.seed else {
            return ordinal;
        };
        let windows = self.windows;
        let order = cached(&mut run.window_orders, pass, || {
            Permutation::new(windows, key_of(seed, &[pass, 1]))
        });
        order.apply(ordinal)
    }

    /// Tokenizes `job`'s window with the lock released, then stores it in the run (unless the
    /// run restarted meanwhile).
    fn tokenize_and_store<'a>(
        &'a self,
        run: MutexGuard<'a, Run>,
        job: Job,
    ) -> Result<MutexGuard<'a, Run>> {
        drop(run);
        let made = self.tokenize(&job);
        let mut run = self.lock();
        let at = (run.generation == job.generation)
            .then(|| self.index_of(&run, job.pass, job.ordinal))
            .flatten();
        let Some(i) = at else {
            return made.map(|_| run);
        };
        let window = match made {
            Ok(w) => w,
            Err(e) => {
                run.metas[i].slot = Slot::Free;
                self.changed.notify_all();
                return Err(e);
            }
        };
        if let Some(size) = run.metas[i].size
            && size != window.units
        {
            run.metas[i].slot = Slot::Free;
            self.changed.notify_all();
            return Err(Error::mismatch(format!(
                "{}: window {} of pass {} gave {} {} when tokenized again, {size} the first \
                 time: the data or the tokenizer changed while the loader ran",
                self.source.name(),
                job.ordinal,
                job.pass,
                window.units,
                self.unit_name()
            )));
        }
        run.bytes += window.bytes();
        run.metas[i].size = Some(window.units);
        run.metas[i].slot = Slot::Ready(Arc::new(window));
        let extended = self.advance(&mut run);
        if let Some(i) = self.index_of(&run, job.pass, job.ordinal) {
            self.evict(&mut run, i);
        }
        self.changed.notify_all();
        extended.map(|_| run)
    }

    fn unit_name(&self) -> &'static str {
        match self.mode {
            SampleMode::Concatenated => "tokens",
            SampleMode::Packed => "rows",
        }
    }

    /// The run's index of window `ordinal` of pass `pass`, if it is in the run.
    fn index_of(&self, run: &Run, pass: u64, ordinal: u64) -> Option<usize> {
        let front = run.metas.front()?;
        let canon = |p: u64, o: u64| u128::from(p) * u128::from(self.windows) + u128::from(o);
        let i = canon(pass, ordinal).checked_sub(canon(front.pass, front.ordinal))?;
        (i < run.metas.len() as u128).then_some(i as usize)
    }

    /// Extends the sized prefix over the windows sized since, recording completed passes,
    /// and drops the windows before the first row still needed.
    fn advance(&self, run: &mut Run) -> Result<()> {
        while run.known < run.metas.len() {
            let k = run.known;
            let Some(size) = run.metas[k].size else { break };
            let m = &run.metas[k];
            let (pass, ordinal, start, first_row) = (m.pass, m.ordinal, m.start, m.first_row);
            let (next_start, next_first) = if ordinal + 1 < self.windows {
                (start + size, first_row)
            } else {
                let units = start + size;
                let rows = self.rows_of(units);
                if rows == 0 {
                    return Err(Error::mismatch(format!(
                        "{}: a whole pass over its {} documents gave no token (every document \
                         is empty and no EOS is appended): nothing to train on",
                        self.source.name(),
                        self.documents
                    )));
                }
                if !run.passes.iter().any(|p| p.pass == pass) {
                    run.passes.push(Pass {
                        pass,
                        first_row,
                        rows,
                        units,
                    });
                }
                self.passes.fetch_max(pass + 1, Ordering::Relaxed);
                let next = Anchor {
                    pass: pass + 1,
                    ordinal: 0,
                    start: 0,
                    first_row: first_row + rows,
                    covers_from: first_row + rows,
                };
                if !run.checkpoints.contains(&next) {
                    run.checkpoints.push(next);
                    trim_checkpoints(&mut run.checkpoints);
                }
                (0, first_row + rows)
            };
            if let Some(n) = run.metas.get_mut(k + 1) {
                n.start = next_start;
                n.first_row = next_first;
            }
            run.known += 1;
        }
        self.drop_released(run);
        Ok(())
    }

    /// Drops the sums of the windows before the one that holds the first row still needed
    /// (keeping that one: the run's base must cover it).
    fn drop_released(&self, run: &mut Run) {
        while run.known > 1
            && run
                .metas
                .get(1)
                .is_some_and(|n| self.covers_from(n.first_row, n.start) <= run.needed_from)
        {
            if let Some(Meta {
                slot: Slot::Ready(w),
                ..
            }) = run.metas.pop_front()
            {
                run.bytes = run.bytes.saturating_sub(w.bytes());
            }
            run.known -= 1;
            if let Some(f) = run.metas.front() {
                run.base = Anchor {
                    pass: f.pass,
                    ordinal: f.ordinal,
                    start: f.start,
                    first_row: f.first_row,
                    covers_from: self.covers_from(f.first_row, f.start),
                };
            }
        }
        let base_pass = run.base.pass;
        run.passes.retain(|p| p.pass >= base_pass);
    }

    /// Frees the oldest windows' ids while the cache is over its limit (never the windows
    /// being tokenized ahead, nor `keep`).
    fn evict(&self, run: &mut Run, keep: usize) {
        let recent = run.metas.len().saturating_sub(self.ahead + 1);
        let mut i = 0;
        while run.bytes > self.cache_bytes && i < recent {
            if i != keep
                && let Slot::Ready(w) = &run.metas[i].slot
            {
                run.bytes = run.bytes.saturating_sub(w.bytes());
                run.metas[i].slot = Slot::Free;
            }
            i += 1;
        }
    }

    /// Starts the run again at `anchor` for row `q`: back before the rows released (the
    /// loader went back), so those from `q` on are needed again; or forward, over rows that
    /// are no longer needed.
    fn restart_for(&self, run: &mut Run, anchor: Anchor, q: u64) {
        run.needed_from = run.needed_from.min(q);
        self.restart(run, anchor);
    }

    /// Starts the run again at `anchor`.
    fn restart(&self, run: &mut Run, anchor: Anchor) {
        self.restarts.fetch_add(1, Ordering::Relaxed);
        run.generation += 1;
        run.base = anchor;
        run.metas.clear();
        run.known = 0;
        run.passes.clear();
        run.bytes = 0;
        self.changed.notify_all();
    }

    /// The pass of row `q`, its first row and its units if complete, as the run stands; or
    /// what to do first.
    fn pass_of(&self, run: &Run, q: u64) -> std::result::Result<(u64, u64, Option<Pass>), Plan> {
        let best = run
            .checkpoints
            .iter()
            .filter(|c| c.covers_from <= q)
            .max_by_key(|c| c.covers_from)
            .copied();
        if q < run.base.covers_from {
            return Err(best.map_or(Plan::Wait, Plan::Restart));
        }
        // A place known ahead of the frontier, with nothing still needed before it: start
        // there rather than tokenize the windows up to it.
        if let Some(c) = best
            && c.covers_from > self.frontier_row(run)
            && c.covers_from <= run.needed_from
        {
            return Err(Plan::Restart(c));
        }
        let (mut pass, mut first_row) = (run.base.pass, run.base.first_row);
        for p in &run.passes {
            if p.pass < pass {
                continue;
            }
            if q < p.first_row + p.rows {
                return Ok((p.pass, p.first_row, Some(*p)));
            }
            pass = p.pass + 1;
            first_row = p.first_row + p.rows;
        }
        Ok((pass, first_row, None))
    }

    /// A row below which every row is known to be found in the run as it stands.
    fn frontier_row(&self, run: &Run) -> u64 {
        match run.known {
            0 => run.base.covers_from,
            k => {
                let m = &run.metas[k - 1];
                let end = m.start + m.size.unwrap_or(0);
                match self.mode {
                    SampleMode::Concatenated => m.first_row + end / self.seq_len,
                    SampleMode::Packed => m.first_row + end,
                }
            }
        }
    }

    /// Units of pass `pass` the sized prefix covers.
    fn known_units(&self, run: &Run, pass: u64) -> u64 {
        let sized = run.metas.range(..run.known).rev().find(|m| m.pass == pass);
        match sized {
            Some(m) => m.start + m.size.unwrap_or(0),
            None if run.base.pass == pass => run.base.start,
            None => 0,
        }
    }

    /// The sized window of pass `pass` that holds unit `u`, if the prefix reaches it (a
    /// binary search over the sized prefix, sorted by pass and start).
    fn sized_window_at(&self, run: &Run, pass: u64, u: u64) -> Option<usize> {
        let (mut lo, mut hi) = (0usize, run.known);
        while lo < hi {
            let mid = (lo + hi) / 2;
            let m = &run.metas[mid];
            if (m.pass, m.start) <= (pass, u) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let i = lo.checked_sub(1)?;
        let m = &run.metas[i];
        (m.pass == pass && u < m.start + m.size.unwrap_or(0)).then_some(i)
    }

    /// What row `q` needs, as the run stands.
    fn plan(&self, run: &mut Run, q: u64) -> Result<Plan> {
        let located = match self.locate(run, q)? {
            Located::Found {
                pass, first_row, ..
            } => (pass, first_row),
            Located::Extend => return Ok(Plan::Extend),
            Located::Restart(a) => return Ok(Plan::Restart(a)),
        };
        let (pass, first_row) = located;
        let r = q - first_row;
        let complete = run.passes.iter().find(|p| p.pass == pass).copied();
        let (need, from, to) = match self.mode {
            SampleMode::Concatenated => {
                let b = r / self.block;
                let len = match complete {
                    Some(p) => self.block.min(p.rows - b * self.block),
                    // The block is whole once its last row is known to be in the pass.
                    None if self.known_units(run, pass)
                        > ((b + 1) * self.block - 1) * self.seq_len =>
                    {
                        self.block
                    }
                    None => return Ok(Plan::Extend),
                };
                let mut row = r;
                if let Some(seed) = self.seed {
                    let order = cached(&mut run.block_orders, (pass, b), || {
                        Permutation::new(len, key_of(seed, &[pass, 2, b]))
                    });
                    row = b * self.block + order.apply(r - b * self.block);
                }
                let from = row * self.seq_len;
                let mut to = from + self.seq_len + 1;
                if let Some(p) = complete {
                    to = to.min(p.units);
                } else if self.known_units(run, pass) < to {
                    return Ok(Plan::Extend);
                }
                (Need::Tokens { from, to }, from, to)
            }
            SampleMode::Packed => (Need::Packed { row: 0 }, r, r + 1),
        };
        let Some(first) = self.sized_window_at(run, pass, from) else {
            if pass == run.base.pass && from < run.base.start {
                return Ok(Plan::Restart(Anchor {
                    pass,
                    ordinal: 0,
                    start: 0,
                    first_row,
                    covers_from: first_row,
                }));
            }
            return Ok(Plan::Extend);
        };
        let mut windows = Vec::new();
        let mut i = first;
        while i < run.known && run.metas[i].pass == pass && run.metas[i].start < to {
            match &run.metas[i].slot {
                Slot::Ready(w) => windows.push((Arc::clone(w), run.metas[i].start)),
                Slot::Claimed => return Ok(Plan::Wait),
                Slot::Free => return Ok(Plan::Fetch(i)),
            }
            i += 1;
        }
        let need = match need {
            Need::Packed { .. } => Need::Packed {
                row: r - run.metas[first].start,
            },
            other => other,
        };
        Ok(Plan::Rows(windows, need))
    }

    /// Row `q`'s pass and the run's index of the window a resume would start from (the one
    /// holding its block's first token, or its own window when packed).
    fn locate(&self, run: &mut Run, q: u64) -> Result<Located> {
        let (pass, first_row, complete) = match self.pass_of(run, q) {
            Ok(p) => p,
            Err(Plan::Restart(a)) => return Ok(Located::Restart(a)),
            Err(_) => {
                return Err(Error::mismatch(format!(
                    "{}: row {q} of its stream is before every place it can be found from",
                    self.source.name()
                )));
            }
        };
        let r = q - first_row;
        let unit = match self.mode {
            SampleMode::Concatenated => r * self.seq_len,
            SampleMode::Packed => r,
        };
        // The row is in this pass once the sums pass its first unit (or the pass is complete).
        if complete.is_none() && self.known_units(run, pass) <= unit {
            return Ok(Located::Extend);
        }
        let anchor_unit = match self.mode {
            SampleMode::Concatenated => (r / self.block) * self.block * self.seq_len,
            SampleMode::Packed => r,
        };
        match self.sized_window_at(run, pass, anchor_unit) {
            Some(anchor) => Ok(Located::Found {
                pass,
                first_row,
                anchor,
            }),
            None if pass == run.base.pass && anchor_unit < run.base.start => {
                Ok(Located::Restart(Anchor {
                    pass,
                    ordinal: 0,
                    start: 0,
                    first_row,
                    covers_from: first_row,
                }))
            }
            None => Ok(Located::Extend),
        }
    }

    /// Tokenizes a window: its documents in this pass's order (concatenated rows) or in file
    /// order, then packed (packed rows), on this thread's encoder.
    fn tokenize(&self, job: &Job) -> Result<Window> {
        let docs = job.window * self.window..((job.window + 1) * self.window).min(self.documents);
        let n = docs.end - docs.start;
        let order = match (self.mode, self.seed) {
            (SampleMode::Concatenated, Some(seed)) => Some(Permutation::new(
                n,
                key_of(seed, &[job.pass, 3, job.window]),
            )),
            _ => None,
        };
        let mut ids = Vec::new();
        let mut offsets = Vec::with_capacity(n as usize + 1);
        let mut doc_ids = Vec::with_capacity(n as usize);
        offsets.push(0u64);
        with_encoder(&self.source, |encoder| -> Result<()> {
            for k in 0..n {
                let d = docs.start + order.as_ref().map_or(k, |p| p.apply(k));
                self.source.encode(d, encoder, &mut ids)?;
                offsets.push(ids.len() as u64);
                doc_ids.push(d);
            }
            Ok(())
        })?;
        self.tokenized.fetch_add(1, Ordering::Relaxed);
        self.documents_done.fetch_add(n, Ordering::Relaxed);
        self.tokens_done
            .fetch_add(ids.len() as u64, Ordering::Relaxed);
        let (packed, units) = match self.mode {
            SampleMode::Concatenated => (None, ids.len() as u64),
            SampleMode::Packed => {
                let lengths: Vec<u64> = offsets.windows(2).map(|w| w[1] - w[0]).collect();
                let window = PACK.with(|s| {
                    pack(
                        &lengths,
                        self.seq_len,
                        Packing::BestFitDecreasing,
                        &mut s.borrow_mut(),
                    )
                });
                let rows = window.rows();
                let order = self
                    .seed
                    .map(|seed| Permutation::new(rows, key_of(seed, &[job.pass, 2, job.window])));
                (Some((window, order)), rows)
            }
        };
        ids.shrink_to_fit();
        Ok(Window {
            ids,
            offsets,
            docs: doc_ids,
            packed,
            units,
        })
    }
}

/// Where a row is, as the run stands.
enum Located {
    /// In pass `pass`, which starts at row `first_row`; `anchor` is the run's index of the
    /// window a resume starts from.
    Found {
        pass: u64,
        first_row: u64,
        anchor: usize,
    },
    Extend,
    Restart(Anchor),
}

/// Keeps the origin and the last checkpoints.
fn trim_checkpoints(checkpoints: &mut Vec<Anchor>) {
    const KEPT: usize = 16;
    if checkpoints.len() > KEPT {
        let excess = checkpoints.len() - KEPT;
        checkpoints.drain(1..1 + excess);
    }
}

/// The permutation of `key` from a small cache, made by `make` if missing.
fn cached<K: PartialEq + Copy>(
    cache: &mut Vec<(K, Permutation)>,
    key: K,
    make: impl FnOnce() -> Permutation,
) -> Permutation {
    if let Some((_, p)) = cache.iter().find(|(k, _)| *k == key) {
        return p.clone();
    }
    let p = make();
    if cache.len() >= 8 {
        cache.remove(0);
    }
    cache.push((key, p.clone()));
    p
}

/// Tokens `from..to` of a pass, from the windows that hold them (each with its start).
fn concatenated(
    windows: &[(Arc<Window>, u64)],
    from: u64,
    to: u64,
    pieces: &mut Vec<RowPiece>,
    tokens: &mut Vec<u32>,
) {
    let mut at = from;
    for (w, start) in windows {
        let end = (to - start).min(w.units);
        let mut local = at.saturating_sub(*start);
        while local < end {
            let k = w.offsets.partition_point(|&o| o <= local) - 1;
            let doc_end = w.offsets[k + 1];
            let take = doc_end.min(end) - local;
            pieces.push(RowPiece {
                doc: w.docs[k],
                start: local - w.offsets[k],
                len: take,
                ends_doc: local + take == doc_end,
            });
            tokens.extend_from_slice(&w.ids[local as usize..(local + take) as usize]);
            local += take;
        }
        at = start + local;
        if at >= to {
            break;
        }
    }
}

/// Row `row` of a packed window (in this pass's order of its rows).
fn packed(w: &Window, row: u64, pieces: &mut Vec<RowPiece>, tokens: &mut Vec<u32>) {
    let Some((window, order)) = &w.packed else {
        return;
    };
    let row = order.as_ref().map_or(row, |p| p.apply(row));
    for piece in window.row(row) {
        let k = piece.doc as usize;
        let base = w.offsets[k] + piece.start;
        pieces.push(RowPiece {
            doc: w.docs[k],
            start: piece.start,
            len: piece.len,
            ends_doc: !piece.continues,
        });
        tokens.extend_from_slice(&w.ids[base as usize..(base + piece.len) as usize]);
        if piece.continues {
            // The next token of the document: the label of the row's last input.
            pieces.push(RowPiece {
                doc: w.docs[k],
                start: piece.start + piece.len,
                len: 1,
                ends_doc: false,
            });
            tokens.push(w.ids[(base + piece.len) as usize]);
        }
    }
}

/// Encoders a thread keeps: one per text source it tokenized for (the last few).
const ENCODERS: usize = 8;

thread_local! {
    static THREAD_ENCODERS: RefCell<Vec<(u64, Encoder)>> = const { RefCell::new(Vec::new()) };
    static PACK: RefCell<PackScratch> = RefCell::new(PackScratch::default());
}

/// Runs `f` with this thread's encoder of `source`'s tokenizer (made on first use).
fn with_encoder<T>(source: &TextTokens, f: impl FnOnce(&mut Encoder) -> T) -> T {
    let id = source.id();
    let kept = THREAD_ENCODERS.with(|e| {
        let mut e = e.borrow_mut();
        e.iter().position(|(k, _)| *k == id).map(|i| e.remove(i).1)
    });
    let mut encoder = kept.unwrap_or_else(|| source.tokenizer().encoder());
    let out = f(&mut encoder);
    THREAD_ENCODERS.with(|e| {
        let mut e = e.borrow_mut();
        if e.len() >= ENCODERS {
            e.remove(0);
        }
        e.push((id, encoder));
    });
    out
}
