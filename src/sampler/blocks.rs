//! [`BlockShuffle`]: the two-level shuffle of a sharded data set, for data streamed by shard.
//!
//! A global shuffle reads every shard at once. Data streamed from object storage wants the
//! opposite: few shards at a time, read in runs. So an epoch's sequence is made in two levels,
//! a pure function of (seed, epoch, shard sizes, window, block):
//!
//! 1. the shards are put in a shuffled order ([`Permutation`] over the shards);
//! 2. that order is cut into *windows* of `window` consecutive shards; within a window, the
//!    window's samples are cut into *blocks* of `block` consecutive samples (the last one may
//!    be short), and the blocks are shuffled.
//!
//! So the loader only ever needs the shards of one or two windows at a time (memory bounded
//! by the window, whatever the data set's size), reads runs of `block` samples, and holds no
//! per-sample index: per epoch, O(shards) numbers, plus the block order of the few windows in
//! use (cached, O(window samples / block) each).

use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use super::permutation::{Permutation, mix, splitmix};
use crate::error::{Error, Result};

/// How a sharded data set is shuffled in two levels: the shards in a shuffled order, cut
/// into windows of `window` shards; within a window, blocks of `block` consecutive samples
/// in a shuffled order. A pure function of (seed, epoch, shard sizes, window, block).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BlockShuffle {
    /// Samples per shard, in the data set's order (not serialized: `shards_digest` stands for
    /// it in a saved state).
    #[serde(skip)]
    shard_sizes: Arc<[u64]>,
    /// Where each shard starts in the data set (`shards + 1` entries; not serialized).
    #[serde(skip)]
    shard_starts: Arc<[u64]>,
    /// A digest of the shard sizes: a state saved over other shards does not resume.
    pub shards_digest: u64,
    /// Consecutive shards (in the epoch's shard order) whose samples are shuffled together.
    pub window: u64,
    /// Consecutive samples read as one run.
    pub block: u64,
}

impl PartialEq for BlockShuffle {
    fn eq(&self, other: &BlockShuffle) -> bool {
        (self.shards_digest, self.window, self.block)
            == (other.shards_digest, other.window, other.block)
    }
}

impl Eq for BlockShuffle {}

impl BlockShuffle {
    /// A two-level shuffle over shards of `shard_sizes` samples: windows of `window` shards,
    /// blocks of `block` samples. Errors name the setting (`shuffle_window`, `shuffle_block`).
    pub fn new(shard_sizes: Vec<u64>, window: u64, block: u64) -> Result<BlockShuffle> {
        if window == 0 {
            return Err(Error::config(
                "shuffle_window",
                "a window holds at least one shard",
            ));
        }
        if block == 0 {
            return Err(Error::config(
                "shuffle_block",
                "a block holds at least one sample",
            ));
        }
        if u32::try_from(shard_sizes.len()).is_err() {
            return Err(Error::config(
                "shuffle_window",
                format!("{} shards is more than 2^32", shard_sizes.len()),
            ));
        }
        let mut starts = Vec::with_capacity(shard_sizes.len() + 1);
        let mut total = 0u64;
        let mut digest = 0xcbf2_9ce4_8422_2325u64;
        for &n in &shard_sizes {
            starts.push(total);
            total = total.checked_add(n).ok_or_else(|| {
                Error::config("shuffle_window", "the shards hold more than 2^64 samples")
            })?;
            digest = mix(digest ^ n);
        }
        starts.push(total);
        Ok(BlockShuffle {
            shard_sizes: shard_sizes.into(),
            shard_starts: starts.into(),
            shards_digest: mix(digest ^ total),
            window,
            block,
        })
    }

    /// Samples in all shards together.
    pub fn len(&self) -> u64 {
        self.shard_starts.last().copied().unwrap_or(0)
    }

    /// True when the shards hold no sample.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Samples per shard, in the data set's order.
    pub fn shard_sizes(&self) -> &[u64] {
        &self.shard_sizes
    }

    /// True when this value can compute an order (it was made by [`BlockShuffle::new`], not
    /// read back from a saved state, which carries only the digest).
    pub(crate) fn has_sizes(&self) -> bool {
        !self.shard_starts.is_empty()
    }

    /// The sequence of `epoch` under `seed`.
    pub(crate) fn epoch(&self, seed: u64, epoch: u64) -> BlockSequence {
        let shards = self.shard_sizes.len() as u64;
        let mut key = seed ^ 0x2545_f491_4f6c_dd1d;
        let epoch_key = splitmix(&mut key) ^ mix(epoch.wrapping_add(0x9e37_79b9));
        let order = Permutation::new(shards, epoch_key);
        let mut shard_order = Vec::with_capacity(shards as usize);
        let mut starts = Vec::with_capacity(shards as usize + 1);
        let mut total = 0u64;
        for t in 0..shards {
            let s = order.apply(t) as usize;
            shard_order.push(s as u32);
            starts.push(total);
            total += self.shard_sizes[s];
        }
        starts.push(total);
        BlockSequence {
            shuffle: self.clone(),
            epoch_key,
            shard_order,
            starts,
            windows: Mutex::new(Vec::new()),
        }
    }
}

/// One epoch's two-level sequence: position -> sample index.
#[derive(Debug)]
pub(crate) struct BlockSequence {
    shuffle: BlockShuffle,
    epoch_key: u64,
    /// The shards in this epoch's order.
    shard_order: Vec<u32>,
    /// Where each shard of `shard_order` starts in the epoch's sequence (`shards + 1`).
    starts: Vec<u64>,
    /// The block orders of the windows used last (a few; shared by the workers).
    windows: Mutex<Vec<(u64, Arc<WindowOrder>)>>,
}

/// The block order within one window.
#[derive(Debug)]
struct WindowOrder {
    /// Samples in the window.
    len: u64,
    /// The full blocks' order.
    full: Permutation,
    /// Samples of the short last block (0 when the window divides into full blocks).
    short: u64,
    /// Where the short block goes among the full ones (0 ..= full blocks).
    slot: u64,
}

/// Windows whose block order is kept.
const CACHED_WINDOWS: usize = 4;

impl BlockSequence {
    /// The sample at `position` (`< len`) of the epoch's sequence.
    pub(crate) fn sample(&self, position: u64) -> u64 {
        let shards = self.shard_order.len();
        // The shard (in this epoch's order) that holds `position`: the last start <= position.
        let t = self.starts.partition_point(|&s| s <= position) - 1;
        let window = t as u64 / self.shuffle.window;
        let first = (window * self.shuffle.window) as usize;
        let last = (first + self.shuffle.window as usize).min(shards);
        let base = self.starts[first];
        let order = self.window_order(window, self.starts[last] - base);
        let source = base + order.source(position - base, self.shuffle.block);
        // The shard that holds `source`, within the window.
        let u = first + self.starts[first..=last].partition_point(|&s| s <= source) - 1;
        let shard = self.shard_order[u] as usize;
        self.shuffle.shard_starts[shard] + (source - self.starts[u])
    }

    fn window_order(&self, window: u64, len: u64) -> Arc<WindowOrder> {
        let mut cache = self.windows.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, order)) = cache.iter().find(|(w, _)| *w == window) {
            return Arc::clone(order);
        }
        let block = self.shuffle.block;
        let full_blocks = len / block;
        let short = len % block;
        let mut key = self.epoch_key ^ mix(window.wrapping_add(0x632b_e59b_d9b4_e019));
        let full = Permutation::new(full_blocks, splitmix(&mut key));
        let slot = if short > 0 {
            ((u128::from(splitmix(&mut key)) * u128::from(full_blocks + 1)) >> 64) as u64
        } else {
            full_blocks
        };
        let order = Arc::new(WindowOrder {
            len,
            full,
            short,
            slot,
        });
        if cache.len() >= CACHED_WINDOWS {
            cache.remove(0);
        }
        cache.push((window, Arc::clone(&order)));
        order
    }
}

impl WindowOrder {
    /// The offset in the window's samples (in shard order) of the window's `o`-th position.
    fn source(&self, o: u64, block: u64) -> u64 {
        debug_assert!(o < self.len);
        let before = self.slot * block;
        if o < before {
            self.full.apply(o / block) * block + o % block
        } else if o < before + self.short {
            self.full.len() * block + (o - before)
        } else {
            let o = o - self.short;
            self.full.apply(o / block) * block + o % block
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn an_epoch_is_a_permutation_with_windows_and_runs(
            sizes in proptest::collection::vec(0u64..40, 1..30),
            window in 1u64..6, block in 1u64..9, seed: u64, epoch in 0u64..4,
        ) {
            let shuffle = BlockShuffle::new(sizes.clone(), window, block).unwrap();
            let n = shuffle.len();
            let seq = shuffle.epoch(seed, epoch);
            let got: Vec<u64> = (0..n).map(|p| seq.sample(p)).collect();
            // A permutation of [0, n).
            let mut sorted = got.clone();
            sorted.sort_unstable();
            prop_assert_eq!(sorted, (0..n).collect::<Vec<_>>());
            // A pure function of its inputs.
            let again = shuffle.epoch(seed, epoch);
            prop_assert!((0..n).rev().all(|p| again.sample(p) == got[p as usize]));
            // Each window's positions hold exactly the samples of its shards.
            let shard_of = |i: u64| shuffle.shard_starts.partition_point(|&s| s <= i) - 1;
            for (t0, chunk) in seq.shard_order.chunks(window as usize).enumerate() {
                let first = t0 * window as usize;
                let (a, b) = (seq.starts[first], seq.starts[first + chunk.len()]);
                for p in a..b {
                    let s = shard_of(got[p as usize]);
                    prop_assert!(chunk.contains(&(s as u32)), "position {} left its window", p);
                }
            }
        }
    }

    #[test]
    fn blocks_are_read_as_runs_and_epochs_differ() {
        let shuffle = BlockShuffle::new(vec![1000; 8], 4, 50).unwrap();
        let a = shuffle.epoch(1, 0);
        let b = shuffle.epoch(1, 1);
        let run: Vec<u64> = (0..50).map(|p| a.sample(p)).collect();
        // The window's sample count divides into blocks, so position 0 starts a whole block.
        assert!(run.windows(2).all(|w| w[1] == w[0] + 1), "{run:?}");
        assert_ne!(
            (0..200).map(|p| a.sample(p)).collect::<Vec<_>>(),
            (0..200).map(|p| b.sample(p)).collect::<Vec<_>>()
        );
    }

    #[test]
    fn bad_settings_and_digests() {
        assert!(BlockShuffle::new(vec![1], 0, 1).is_err());
        assert!(BlockShuffle::new(vec![1], 1, 0).is_err());
        let a = BlockShuffle::new(vec![3, 4], 1, 2).unwrap();
        let b = BlockShuffle::new(vec![4, 3], 1, 2).unwrap();
        assert_ne!(a, b, "other shard sizes, another digest");
        let json = serde_json::to_string(&a).unwrap();
        let back: BlockShuffle = serde_json::from_str(&json).unwrap();
        assert_eq!(a, back);
        assert!(!back.has_sizes());
    }
}
