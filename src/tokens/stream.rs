//! The global stream of samples and each rank's share of it.
//!
//! Position `g` of epoch `e` of the stream is a pure function of (seed, e, g) and the
//! settings: the [`Blend`] names its source `i` and how many of `i`'s samples come before it in
//! the epoch (`k`); the source's own stream runs through its epochs one after the other, so the
//! sample is that stream's `e * c_i + k`-th, that is row `(e * c_i + k) % rows_i` of the
//! source's epoch `(e * c_i + k) / rows_i` (a single source has `c = rows`: its epochs are the
//! loader's). Nothing depends on the number of ranks, workers or what was read before.
//!
//! Ranks share each global batch of `B` samples ([`Shares`]): rank `r` of `w` takes positions
//! `floor(r * b / w) .. floor((r + 1) * b / w)` of a batch of `b` (`B`, or fewer in an epoch's
//! last batch), and every rank's batch has `ceil(B / w)` rows, the rows a rank does not get
//! being padding rows (every label ignored) at its end. So the global stream is the same under
//! any world size, every rank's batches have one shape, and a state (which names the global
//! batch) resumes under any other world size from the next global batch.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::blend::Blend;
use super::index::{EpochOrder, RowPiece, SourceIndex, key_of};
use super::text::TextIndex;
use crate::error::{Error, Result};

/// Where a position of a pre-tokenized source's stream comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Place {
    pub source: usize,
    pub source_epoch: u64,
    pub row: u64,
}

/// A source of the stream: pre-tokenized (sizes known at build), or text (tokenized as the
/// stream reaches it: [`TextIndex`]).
#[derive(Debug)]
pub(crate) enum StreamSource {
    Tokens(SourceIndex),
    Text(Box<TextIndex>),
}

impl StreamSource {
    /// What it is, for messages and states.
    pub fn name(&self) -> String {
        match self {
            StreamSource::Tokens(s) => s.source.name(),
            StreamSource::Text(t) => t.source.name(),
        }
    }

    /// Its fingerprint, taken when the loader was built.
    pub fn fingerprint(&self) -> u64 {
        match self {
            StreamSource::Tokens(s) => s.fingerprint,
            StreamSource::Text(t) => t.fingerprint,
        }
    }

    /// Its documents.
    pub fn documents(&self) -> u64 {
        match self {
            StreamSource::Tokens(s) => s.documents,
            StreamSource::Text(t) => t.documents,
        }
    }

    /// Tokens of one of its epochs (a text source's pass: the build's estimate).
    pub fn tokens(&self) -> u64 {
        match self {
            StreamSource::Tokens(s) => s.tokens,
            StreamSource::Text(t) => t.estimated_tokens,
        }
    }

    /// Rows of one of its epochs (a text source's pass: the build's estimate).
    pub fn rows(&self) -> u64 {
        match self {
            StreamSource::Tokens(s) => s.rows,
            StreamSource::Text(t) => t.estimated_rows,
        }
    }

    /// Checks that its files are still the ones opened.
    pub fn check_unchanged(&self) -> Result<()> {
        match self {
            StreamSource::Tokens(s) => s.source.check_unchanged(),
            StreamSource::Text(t) => t.source.check_unchanged(),
        }
    }
}

/// The sources, their blend, and each source's epoch orders in use.
#[derive(Debug)]
pub(crate) struct Stream {
    /// Tells this stream's windows apart in the workers' caches.
    id: u64,
    pub sources: Vec<StreamSource>,
    seeds: Vec<Option<u64>>,
    pub blend: Blend,
    /// The epoch orders in use, per source (a few: the loader makes the next epoch's first
    /// batches while the last of this one are made, and a blend's source may change epochs).
    orders: Vec<Mutex<Vec<Arc<EpochOrder>>>>,
}

/// Epoch orders kept per source.
const ORDERS: usize = 4;

static STREAMS: AtomicU64 = AtomicU64::new(0);

/// Source `i`'s own seed, drawn from the stream's.
pub(crate) fn source_seed(seed: Option<u64>, i: usize) -> Option<u64> {
    seed.map(|s| key_of(s, &[0x736f_7572_6365, i as u64]))
}

impl Stream {
    /// The stream of `sources` blended as `blend` says, shuffled with `seed` (each source with
    /// a seed of its own drawn from it: [`source_seed`]) or in file order.
    pub fn new(sources: Vec<StreamSource>, blend: Blend, seed: Option<u64>) -> Stream {
        let seeds = (0..sources.len()).map(|i| source_seed(seed, i)).collect();
        let orders = sources.iter().map(|_| Mutex::new(Vec::new())).collect();
        Stream {
            id: STREAMS.fetch_add(1, Ordering::Relaxed),
            sources,
            seeds,
            blend,
            orders,
        }
    }

    /// The row of `source`'s own stream (its epochs, or a text source's passes, end to end)
    /// that its `k`-th sample of epoch `epoch` is.
    pub fn stream_row(&self, source: usize, epoch: u64, k: u64) -> Result<u64> {
        epoch
            .checked_mul(self.blend.counts()[source])
            .and_then(|q| q.checked_add(k))
            .ok_or_else(|| {
                Error::config(
                    "epoch",
                    format!("epoch {epoch} is too far along this stream to count its samples"),
                )
            })
    }

    /// Where the `k`-th sample of pre-tokenized `source` in epoch `epoch` comes from.
    pub fn place_of(&self, source: usize, epoch: u64, k: u64) -> Result<Place> {
        let q = self.stream_row(source, epoch, k)?;
        let rows = self.sources[source].rows();
        Ok(Place {
            source,
            source_epoch: q / rows,
            row: q % rows,
        })
    }

    /// The pieces of position `g` of epoch `epoch` into `pieces`, their tokens into `tokens`
    /// (`seq_len + 1` at most); returns its source.
    pub fn row(
        &self,
        epoch: u64,
        g: u64,
        pieces: &mut Vec<RowPiece>,
        tokens: &mut Vec<u32>,
    ) -> Result<usize> {
        let (i, k) = self.blend.source_at(g);
        match &self.sources[i] {
            StreamSource::Tokens(s) => {
                let place = self.place_of(i, epoch, k)?;
                let order = self.order(i, s, place.source_epoch);
                s.row(&order, place.row, (self.id, i), pieces)?;
                let n: u64 = pieces.iter().map(|p| p.len).sum();
                tokens.resize(n as usize, 0);
                let mut at = 0usize;
                for p in pieces.iter() {
                    s.source
                        .read(p.doc, p.start, &mut tokens[at..at + p.len as usize])?;
                    at += p.len as usize;
                }
            }
            StreamSource::Text(t) => t.row(self.stream_row(i, epoch, k)?, pieces, tokens)?,
        }
        Ok(i)
    }

    /// Source `i`'s epoch `epoch`, made once and shared.
    fn order(&self, i: usize, source: &SourceIndex, epoch: u64) -> Arc<EpochOrder> {
        let mut orders = self.orders[i].lock().unwrap_or_else(|p| p.into_inner());
        if let Some(o) = orders.iter().find(|o| o.epoch == epoch) {
            return Arc::clone(o);
        }
        let order = Arc::new(source.epoch(self.seeds[i], epoch));
        if orders.len() >= ORDERS {
            orders.remove(0);
        }
        orders.push(Arc::clone(&order));
        order
    }
}

/// How the ranks share each global batch (see the [module docs](self)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Shares {
    pub samples: u64,
    pub global_batch: u64,
    pub rank: u64,
    pub world: u64,
    /// Drop an epoch's last global batch if it is short.
    pub drop_last: bool,
}

impl Shares {
    /// Rows of every rank's batch: `ceil(global_batch / world)`.
    pub fn rows(&self) -> u64 {
        self.global_batch.div_ceil(self.world)
    }

    /// Global batches in an epoch.
    pub fn batches(&self) -> u64 {
        if self.drop_last {
            self.samples / self.global_batch
        } else {
            self.samples.div_ceil(self.global_batch)
        }
    }

    /// This rank's positions of global batch `batch`.
    pub fn range(&self, batch: u64) -> std::ops::Range<u64> {
        let first = batch * self.global_batch;
        let size = u128::from(self.global_batch.min(self.samples.saturating_sub(first)));
        let (r, w) = (u128::from(self.rank), u128::from(self.world));
        let lo = (r * size / w) as u64;
        let hi = ((r + 1) * size / w) as u64;
        first + lo..first + hi
    }

    /// The global position of row `j` of this rank's share of batch `batch`, or `None` for a
    /// padding row.
    pub fn position(&self, batch: u64, j: u64) -> Option<u64> {
        let range = self.range(batch);
        let g = range.start + j;
        (g < range.end).then_some(g)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_position_of_every_global_batch_goes_to_exactly_one_rank() {
        for (samples, batch) in [(100, 8), (101, 8), (7, 8), (64, 64), (1000, 10)] {
            for world in 1..=17 {
                let mut seen = vec![0u32; samples as usize];
                let s = Shares {
                    samples,
                    global_batch: batch,
                    rank: 0,
                    world,
                    drop_last: false,
                };
                for b in 0..s.batches() {
                    for rank in 0..world {
                        let s = Shares { rank, ..s };
                        let real = (0..s.rows()).filter_map(|j| s.position(b, j));
                        for g in real {
                            seen[g as usize] += 1;
                        }
                        // Real rows first, padding after.
                        let n = (0..s.rows())
                            .take_while(|&j| s.position(b, j).is_some())
                            .count();
                        assert_eq!(n as u64, s.range(b).end - s.range(b).start);
                    }
                }
                assert!(seen.iter().all(|&c| c == 1), "{samples} {batch} {world}");
            }
        }
    }
}
