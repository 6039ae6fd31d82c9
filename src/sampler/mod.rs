//! The order of samples: sequential or seeded shuffle, sharded by rank, cut into batches.
//!
//! An [`Order`] is a pure function of (seed, epoch, rank, world size, dataset length, batch
//! size, remainder policy): the same on any number of workers, and after a resume. The shuffle
//! is a keyed bijection on `[0, len)` ([`Permutation`]): for up to [`Permutation::TABLE_MAX`]
//! samples an exact Fisher-Yates shuffle (uniform over all `len!` orders, at most 256 KiB,
//! made once per epoch); above that a Feistel network over the next even power of two with
//! cycle walking, which holds no index array, so a 100M-sample epoch costs a few bytes of state
//! and O(1) time to start, and each index O(1) expected time.
//!
//! Sharding follows PyTorch's `DistributedSampler`: rank `r` takes every `world`-th entry of the
//! epoch's sequence from position `r`, and every rank gets the same number of samples and
//! batches. What happens to the samples that do not divide evenly is the [`Remainder`] policy:
//! pad by wrapping around (PyTorch's default), drop them (`drop_last`), or, for evaluation,
//! pad with slots that are marked as padding so that every sample counts exactly once.

mod blocks;
mod permutation;

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use blocks::BlockSequence;
pub use blocks::BlockShuffle;
pub use permutation::Permutation;
pub(crate) use permutation::{mix, splitmix};

use crate::error::{Error, Result};

/// What decides an order, besides the epoch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderSpec {
    /// Samples in the dataset.
    pub len: u64,
    /// Samples per batch.
    pub batch_size: u64,
    /// `Some(seed)` to shuffle, `None` for sequential order.
    pub shuffle: Option<u64>,
    /// This process's rank.
    pub rank: u64,
    /// The number of ranks.
    pub world: u64,
    /// What happens to the samples that do not fill every rank's share or a whole batch.
    pub remainder: Remainder,
    /// With a seed: shuffle shards, then blocks within windows of shards, instead of samples
    /// globally ([`BlockShuffle`], for streamed, sharded data).
    #[serde(default)]
    pub blocks: Option<BlockShuffle>,
}

/// What a rank does with the samples that do not divide evenly among ranks and batches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Remainder {
    /// Pad each rank's share to the same length by wrapping around to the epoch's first
    /// samples, and deliver a short last batch (PyTorch's `DistributedSampler` and
    /// `DataLoader` defaults). A few samples count twice in an epoch.
    #[default]
    Wrap,
    /// Drop the tail that does not fill every rank's share, and a last short batch
    /// (`drop_last=True` in both of PyTorch's places). A few samples are not seen.
    Drop,
    /// Evaluation: every sample exactly once across ranks. Each rank's share is padded to the
    /// same length with slots marked as padding ([`BatchInfo::mask`](crate::BatchInfo::mask)); they
    /// hold a real sample (wrapped around) so that a model can run on them, and metrics skip
    /// them. Every rank gets the same number of batches.
    Mask,
}

impl Remainder {
    /// The policy of a loader's `drop_last` and `evaluation` settings: [`Remainder::Mask`]
    /// for evaluation, [`Remainder::Drop`] for `drop_last`, else [`Remainder::Wrap`]. Both
    /// at once is an error naming `evaluation`.
    pub fn of(drop_last: bool, evaluation: bool) -> Result<Remainder> {
        match (evaluation, drop_last) {
            (true, true) => Err(Error::config(
                "evaluation",
                "evaluation reads every sample once and cannot drop any: turn drop_last off",
            )),
            (true, false) => Ok(Remainder::Mask),
            (false, true) => Ok(Remainder::Drop),
            (false, false) => Ok(Remainder::Wrap),
        }
    }
}

impl OrderSpec {
    /// Checks the settings; every fault is a typed error naming the setting.
    pub fn validate(&self) -> Result<()> {
        if self.batch_size == 0 {
            return Err(Error::config("batch_size", "must be at least 1"));
        }
        if self.world == 0 {
            return Err(Error::config("world", "the world size must be at least 1"));
        }
        if self.rank >= self.world {
            return Err(Error::config(
                "rank",
                format!(
                    "rank {} is not below the world size {}",
                    self.rank, self.world
                ),
            ));
        }
        if self.len == 0 {
            return Err(Error::config("dataset", "the dataset is empty"));
        }
        if let Some(b) = &self.blocks
            && (!b.has_sizes() || b.len() != self.len)
        {
            return Err(Error::config(
                "shuffle_window",
                format!(
                    "the shard sizes hold {} samples, the data set {}",
                    b.len(),
                    self.len
                ),
            ));
        }
        let drop_last = self.remainder == Remainder::Drop;
        let per_rank = self.samples_per_rank();
        if per_rank == 0 {
            return Err(Error::config(
                "drop_last",
                format!(
                    "{} samples over {} ranks leaves none per rank with drop_last",
                    self.len, self.world
                ),
            ));
        }
        if drop_last && per_rank < self.batch_size {
            return Err(Error::config(
                "drop_last",
                format!(
                    "each rank has {per_rank} samples, fewer than one batch of {}: with drop_last no batch is left",
                    self.batch_size
                ),
            ));
        }
        Ok(())
    }

    /// Samples each rank gets per epoch.
    pub fn samples_per_rank(&self) -> u64 {
        self.samples_per_rank_from(0)
    }

    /// The most samples a batch holds: the batch size, or all this rank gets in an epoch if
    /// that is fewer (padding slots included). What a batch buffer must hold; a resumed order
    /// ([`OrderSpec::epoch_from`]) has no more.
    pub fn batch_capacity(&self) -> u64 {
        self.batch_size.min(self.samples_per_rank())
    }

    /// Samples each rank gets of the epoch's positions from `start` on.
    fn samples_per_rank_from(&self, start: u64) -> u64 {
        let left = self.len.saturating_sub(start);
        if self.remainder == Remainder::Drop {
            left / self.world
        } else {
            left.div_ceil(self.world)
        }
    }

    /// Batches each rank gets per epoch.
    pub fn batches(&self) -> u64 {
        self.batches_from(0)
    }

    fn batches_from(&self, start: u64) -> u64 {
        let n = self.samples_per_rank_from(start);
        if self.remainder == Remainder::Drop {
            n / self.batch_size
        } else {
            n.div_ceil(self.batch_size)
        }
    }

    /// The order of `epoch`.
    pub fn epoch(&self, epoch: u64) -> Order {
        self.epoch_from(epoch, 0)
    }

    /// The order of the rest of `epoch`, once its first `start` positions (over all ranks)
    /// have been consumed: an elastic resume, under another world size than the run that
    /// consumed them. Positions `start..len` are shared among this spec's ranks as usual.
    pub fn epoch_from(&self, epoch: u64, start: u64) -> Order {
        let sequence = match (self.shuffle, &self.blocks) {
            (None, _) => Sequence::Identity,
            (Some(seed), Some(blocks)) => Sequence::Blocks(Arc::new(blocks.epoch(seed, epoch))),
            (Some(seed), None) => {
                let mut s = seed ^ 0x5851_f42d_4c95_7f2d;
                let a = splitmix(&mut s);
                Sequence::Permuted(Permutation::new(
                    self.len,
                    a ^ mix(epoch.wrapping_add(0x1234_5678)),
                ))
            }
        };
        Order {
            spec: self.clone(),
            epoch,
            start: start.min(self.len),
            sequence,
        }
    }

    /// True when a state saved under `self` can resume under `other`: the same data, batch
    /// size, shuffle and remainder policy (ranks and world size may differ).
    pub fn same_sequence(&self, other: &OrderSpec) -> bool {
        (
            self.len,
            self.batch_size,
            self.shuffle,
            self.remainder,
            &self.blocks,
        ) == (
            other.len,
            other.batch_size,
            other.shuffle,
            other.remainder,
            &other.blocks,
        )
    }
}

/// An epoch's sequence of positions -> sample indices, before it is shared among ranks.
#[derive(Clone, Debug)]
enum Sequence {
    Identity,
    Permuted(Permutation),
    Blocks(Arc<BlockSequence>),
}

/// The order of one epoch for one rank.
#[derive(Clone, Debug)]
pub struct Order {
    spec: OrderSpec,
    epoch: u64,
    /// Positions consumed before this order (an elastic resume), 0 otherwise.
    start: u64,
    sequence: Sequence,
}

impl Order {
    /// The settings it was made from.
    pub fn spec(&self) -> &OrderSpec {
        &self.spec
    }

    /// The epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Positions of the epoch consumed before this order started (see
    /// [`OrderSpec::epoch_from`]); 0 for a whole epoch.
    pub fn start(&self) -> u64 {
        self.start
    }

    /// Batches in this epoch (for this rank).
    pub fn batches(&self) -> u64 {
        self.spec.batches_from(self.start)
    }

    /// Samples this rank gets in this epoch.
    pub fn samples(&self) -> u64 {
        self.spec.samples_per_rank_from(self.start)
    }

    /// The epoch position of this rank's `k`-th sample (past `len` for padding).
    fn position(&self, k: u64) -> u64 {
        self.start + self.spec.rank + k * self.spec.world
    }

    /// The dataset index of this rank's `k`-th sample.
    pub fn sample(&self, k: u64) -> u64 {
        let mut j = self.position(k);
        if j >= self.spec.len {
            // Padding: wrap around to the first positions of this order.
            j = self.start + (j - self.start) % (self.spec.len - self.start).max(1);
        }
        match &self.sequence {
            Sequence::Identity => j,
            Sequence::Permuted(p) => p.apply(j),
            Sequence::Blocks(b) => b.sample(j),
        }
    }

    /// True when this rank's `k`-th sample is a padding slot ([`Remainder::Mask`]: a position
    /// past the end of the epoch's sequence, holding a repeated sample that metrics skip).
    pub fn is_padding(&self, k: u64) -> bool {
        self.spec.remainder == Remainder::Mask && self.position(k) >= self.spec.len
    }

    /// Writes the dataset indices of batch `b` into `out` (cleared first); empty past the end.
    pub fn batch(&self, b: u64, out: &mut Vec<u64>) {
        out.clear();
        if let Some(range) = self.batch_range(b) {
            out.extend(range.map(|k| self.sample(k)));
        }
    }

    /// How many slots of batch `b` are padding ([`Remainder::Mask`] only). Padding slots are
    /// always the last ones of a batch.
    pub fn batch_padding(&self, b: u64) -> usize {
        match self.batch_range(b) {
            Some(range) => range.filter(|&k| self.is_padding(k)).count(),
            None => 0,
        }
    }

    /// This rank's sample positions in batch `b`.
    fn batch_range(&self, b: u64) -> Option<std::ops::Range<u64>> {
        if b >= self.batches() {
            return None;
        }
        let per_rank = self.samples();
        let start = b * self.spec.batch_size;
        Some(start..(start + self.spec.batch_size).min(per_rank))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn spec(
        len: u64,
        batch: u64,
        world: u64,
        rank: u64,
        drop_last: bool,
        seed: Option<u64>,
    ) -> OrderSpec {
        OrderSpec {
            len,
            batch_size: batch,
            shuffle: seed,
            rank,
            world,
            remainder: if drop_last {
                Remainder::Drop
            } else {
                Remainder::Wrap
            },
            blocks: None,
        }
    }

    proptest! {
        #[test]
        fn permutations_are_permutations(n in 1u64..3000, key: u64) {
            let p = Permutation::new(n, key);
            let mut seen: Vec<u64> = (0..n).map(|i| p.apply(i)).collect();
            seen.sort_unstable();
            prop_assert_eq!(seen, (0..n).collect::<Vec<_>>());
        }

        #[test]
        fn shards_are_disjoint_and_complete(len in 1u64..2000, world in 1u64..9, batch in 1u64..64, seed: u64, shuffle: bool, drop_last: bool) {
            let s0 = spec(len, batch, world, 0, drop_last, shuffle.then_some(seed));
            prop_assume!(s0.validate().is_ok());
            let mut all = Vec::new();
            let mut per_rank_batches = None;
            for rank in 0..world {
                let s = OrderSpec { rank, ..s0.clone() };
                let o = s.epoch(3);
                let mut b = Vec::new();
                let mut mine = Vec::new();
                for k in 0..o.batches() {
                    o.batch(k, &mut b);
                    prop_assert!(!b.is_empty() && b.len() as u64 <= batch);
                    if drop_last { prop_assert_eq!(b.len() as u64, batch); }
                    mine.extend_from_slice(&b);
                }
                // Every rank gets the same number of batches.
                prop_assert_eq!(*per_rank_batches.get_or_insert(o.batches()), o.batches());
                all.extend(mine);
            }
            let mut sorted = all.clone();
            sorted.sort_unstable();
            let distinct = { let mut d = sorted.clone(); d.dedup(); d };
            if drop_last {
                // Disjoint: no sample twice; the dropped tail is smaller than world + world*batch.
                prop_assert_eq!(distinct.len(), sorted.len());
                prop_assert!(len - (sorted.len() as u64) < world * batch + world);
            } else {
                // Complete: every sample at least once; the padding repeats fewer than `world`.
                prop_assert_eq!(distinct, (0..len).collect::<Vec<_>>());
                prop_assert!(sorted.len() as u64 - len < world);
            }
        }

        #[test]
        fn order_depends_on_epoch_and_seed_only(len in 2u64..500, seed: u64) {
            let s = spec(len, 7, 1, 0, false, Some(seed));
            let a: Vec<u64> = (0..len).map(|k| s.epoch(1).sample(k)).collect();
            let b: Vec<u64> = (0..len).map(|k| s.clone().epoch(1).sample(k)).collect();
            prop_assert_eq!(a, b);
        }
    }

    #[test]
    fn epochs_differ_and_sequential_is_identity() {
        let s = spec(1000, 10, 1, 0, false, Some(7));
        let a: Vec<u64> = (0..1000).map(|k| s.epoch(0).sample(k)).collect();
        let b: Vec<u64> = (0..1000).map(|k| s.epoch(1).sample(k)).collect();
        assert_ne!(a, b);
        let seq = spec(10, 3, 1, 0, false, None);
        let mut out = Vec::new();
        seq.epoch(0).batch(3, &mut out);
        assert_eq!(out, vec![9]);
    }

    #[test]
    fn matches_distributed_sampler_padding() {
        // PyTorch: indices = [0..5) + [0] ; rank 1 of 3 takes [1, 4].
        let s = spec(5, 2, 3, 1, false, None);
        let mut out = Vec::new();
        s.epoch(0).batch(0, &mut out);
        assert_eq!(out, vec![1, 4]);
        let s = spec(5, 2, 3, 2, false, None);
        s.epoch(0).batch(0, &mut out);
        assert_eq!(out, vec![2, 0]);
    }

    #[test]
    fn bad_settings_are_typed_errors() {
        assert!(spec(10, 0, 1, 0, false, None).validate().is_err());
        assert!(spec(10, 1, 0, 0, false, None).validate().is_err());
        assert!(spec(10, 1, 2, 2, false, None).validate().is_err());
        assert!(spec(0, 1, 1, 0, false, None).validate().is_err());
        assert!(spec(10, 11, 1, 0, true, None).validate().is_err());
        assert!(spec(3, 1, 4, 0, true, None).validate().is_err());
        assert!(spec(10, 11, 1, 0, false, None).validate().is_ok());
    }

    #[test]
    fn a_hundred_million_sample_shuffle_starts_at_once() {
        let s = spec(100_000_000, 256, 1, 0, true, Some(1));
        let o = s.epoch(0);
        let mut out = Vec::new();
        o.batch(0, &mut out);
        assert_eq!(out.len(), 256);
        assert!(out.iter().all(|&i| i < 100_000_000));
        assert!(std::mem::size_of_val(&o) < 256);
    }

    proptest! {
        #[test]
        fn masked_shards_hold_every_sample_exactly_once(len in 1u64..2000, world in 1u64..9, batch in 1u64..64, seed: u64, shuffle: bool) {
            let s0 = OrderSpec { remainder: Remainder::Mask, ..spec(len, batch, world, 0, false, shuffle.then_some(seed)) };
            prop_assume!(s0.validate().is_ok());
            let mut real = Vec::new();
            let mut batches = None;
            for rank in 0..world {
                let o = OrderSpec { rank, ..s0.clone() }.epoch(1);
                prop_assert_eq!(*batches.get_or_insert(o.batches()), o.batches());
                let mut b = Vec::new();
                for k in 0..o.batches() {
                    o.batch(k, &mut b);
                    let pad = o.batch_padding(k);
                    prop_assert!(pad <= b.len());
                    // Padding slots are the last ones, and only in the last batch.
                    prop_assert!(pad == 0 || k + 1 == o.batches());
                    real.extend_from_slice(&b[..b.len() - pad]);
                }
            }
            real.sort_unstable();
            prop_assert_eq!(real, (0..len).collect::<Vec<_>>());
        }
    }

    /// The chi-squared statistic's upper bound at p = 1e-6 for `df` degrees of freedom
    /// (Wilson-Hilferty). Seeds are fixed: these tests are deterministic, not flaky.
    fn chi2_limit(df: f64) -> f64 {
        let z = 4.753_424; // the standard normal's 1 - 1e-6 quantile
        let a = 2.0 / (9.0 * df);
        df * (1.0 - a + z * a.sqrt()).powi(3)
    }

    fn chi2(counts: &[u64], expected: f64) -> f64 {
        counts
            .iter()
            .map(|&c| (c as f64 - expected).powi(2) / expected)
            .sum()
    }

    #[test]
    fn small_shuffles_are_uniform() {
        // Every (position, sample) cell of n = 2..=64, over enough epochs that each cell
        // expects at least 200, and 60,000 epochs up to n = 16, where a Feistel network kept
        // one sample at one position 9% more often than chance (n = 5 and 6).
        for n in 2u64..=64 {
            let s = spec(n, 1, 1, 0, false, Some(n * 7919));
            let epochs = if n <= 16 { 60_000 } else { 200 * n };
            let mut counts = vec![0u64; (n * n) as usize];
            for e in 0..epochs {
                let o = s.epoch(e);
                for k in 0..n {
                    counts[(k * n + o.sample(k)) as usize] += 1;
                }
            }
            // Rows and columns each sum to `epochs`: (n - 1)^2 degrees of freedom.
            let stat = chi2(&counts, epochs as f64 / n as f64);
            let df = ((n - 1) * (n - 1)) as f64;
            assert!(
                stat < chi2_limit(df),
                "n = {n}: chi2 {stat:.1} over {df} df"
            );
        }
    }

    #[test]
    fn large_shuffles_are_uniform_at_sampled_positions() {
        // n = 10^3 (a table) and 10^6 (the Feistel network): at a few positions, the sample's
        // value in 40 bins over many epochs; and pairs of neighbouring positions in 8x8 bins,
        // which would show a correlation between adjacent outputs.
        for (n, epochs) in [(1_000u64, 16_000u64), (1_000_000, 16_000)] {
            let s = spec(n, 1, 1, 0, false, Some(n + 17));
            let positions = [0, 1, n / 3, n / 2, n - 2, n - 1];
            let bins = 40u64;
            let mut single = vec![vec![0u64; bins as usize]; positions.len()];
            let mut pairs = vec![vec![0u64; 64]; positions.len() - 1];
            for e in 0..epochs {
                let o = s.epoch(e);
                let v: Vec<u64> = positions.iter().map(|&p| o.sample(p)).collect();
                for (i, &x) in v.iter().enumerate() {
                    single[i][(x * bins / n) as usize] += 1;
                }
                for i in 0..positions.len() - 1 {
                    let (a, b) = (v[i] * 8 / n, v[i + 1] * 8 / n);
                    pairs[i][(a * 8 + b) as usize] += 1;
                }
            }
            for (i, c) in single.iter().enumerate() {
                let stat = chi2(c, epochs as f64 / bins as f64);
                let df = (bins - 1) as f64;
                assert!(
                    stat < chi2_limit(df),
                    "n = {n}, position {}: chi2 {stat:.1} over {df} df",
                    positions[i]
                );
            }
            for (i, c) in pairs.iter().enumerate() {
                let stat = chi2(c, epochs as f64 / 64.0);
                assert!(
                    stat < chi2_limit(63.0),
                    "n = {n}, positions {} and {}: chi2 {stat:.1} over 63 df",
                    positions[i],
                    positions[i + 1]
                );
            }
        }
    }
}
