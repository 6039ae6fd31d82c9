//! The order of samples: sequential or seeded shuffle, sharded by rank, cut into batches.
//!
//! An [`Order`] is a pure function of (seed, epoch, rank, world size, dataset length, batch
//! size, drop_last): the same on any number of workers, and after a resume. It holds no index
//! array: the shuffle is a keyed bijection on `[0, len)` ([`Permutation`], a Feistel network
//! over the next even power of two with cycle walking), so a 100M-sample epoch costs a few
//! bytes of state and O(1) time to start, and each index O(1) expected time.
//!
//! Sharding follows PyTorch's `DistributedSampler`: the epoch's sequence is padded by wrapping
//! around to a multiple of the world size (or its tail dropped with `drop_last`), and rank `r`
//! takes every `world`-th entry from position `r`. Every rank gets the same number of samples
//! and batches.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// A keyed pseudo-random permutation of `[0, n)`, computed on demand.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Permutation {
    n: u64,
    half_bits: u32,
    keys: [u64; Permutation::ROUNDS],
}

impl Permutation {
    const ROUNDS: usize = 6;

    /// The permutation of `[0, n)` for `key`.
    pub fn new(n: u64, key: u64) -> Permutation {
        let bits = 64 - n.saturating_sub(1).leading_zeros();
        let half_bits = bits.div_ceil(2).max(1);
        let mut state = key;
        let mut keys = [0u64; Permutation::ROUNDS];
        for k in &mut keys {
            *k = splitmix(&mut state);
        }
        Permutation { n, half_bits, keys }
    }

    /// The length of the permuted range.
    pub fn len(&self) -> u64 {
        self.n
    }

    /// True for the permutation of an empty range.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The image of `i` (`i < len()`).
    pub fn apply(&self, i: u64) -> u64 {
        debug_assert!(i < self.n);
        // Cycle walking: the Feistel network permutes [0, 4^half_bits), which holds [0, n) and
        // is less than 4n; apply it until the value lands back in range (expected < 4 times).
        let mut x = i;
        loop {
            x = self.feistel(x);
            if x < self.n {
                return x;
            }
        }
    }

    fn feistel(&self, x: u64) -> u64 {
        let mask = (1u64 << self.half_bits) - 1;
        let (mut l, mut r) = (x >> self.half_bits, x & mask);
        for &k in &self.keys {
            let f = mix(r ^ k) & mask;
            (l, r) = (r, l ^ f);
        }
        (l << self.half_bits) | r
    }
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    mix(*state)
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

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
    /// Drop the tail that does not fill a rank's share or a whole batch (otherwise pad by
    /// wrapping around, and deliver a short last batch).
    pub drop_last: bool,
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
        if self.drop_last && per_rank < self.batch_size {
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
        if self.drop_last {
            self.len / self.world
        } else {
            self.len.div_ceil(self.world)
        }
    }

    /// Batches each rank gets per epoch.
    pub fn batches(&self) -> u64 {
        let n = self.samples_per_rank();
        if self.drop_last {
            n / self.batch_size
        } else {
            n.div_ceil(self.batch_size)
        }
    }

    /// The order of `epoch`.
    pub fn epoch(&self, epoch: u64) -> Order {
        let perm = self.shuffle.map(|seed| {
            let mut s = seed ^ 0x5851_f42d_4c95_7f2d;
            let a = splitmix(&mut s);
            Permutation::new(self.len, a ^ mix(epoch.wrapping_add(0x1234_5678)))
        });
        Order {
            spec: self.clone(),
            epoch,
            perm,
        }
    }
}

/// The order of one epoch for one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Order {
    spec: OrderSpec,
    epoch: u64,
    perm: Option<Permutation>,
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

    /// Batches in this epoch (for this rank).
    pub fn batches(&self) -> u64 {
        self.spec.batches()
    }

    /// The dataset index of this rank's `k`-th sample.
    pub fn sample(&self, k: u64) -> u64 {
        let j = self.spec.rank + k * self.spec.world;
        let j = j % self.spec.len;
        match &self.perm {
            Some(p) => p.apply(j),
            None => j,
        }
    }

    /// Writes the dataset indices of batch `b` into `out` (cleared first); empty past the end.
    pub fn batch(&self, b: u64, out: &mut Vec<u64>) {
        out.clear();
        let per_rank = self.spec.samples_per_rank();
        if b >= self.batches() {
            return;
        }
        let start = b * self.spec.batch_size;
        let end = (start + self.spec.batch_size).min(per_rank);
        out.extend((start..end).map(|k| self.sample(k)));
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
            drop_last,
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
}
