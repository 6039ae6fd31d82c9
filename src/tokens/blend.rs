//! [`Blend`]: a weighted mixture of sources, as exact counts per epoch in a fixed interleave.
//!
//! An epoch of `N` samples takes exactly `c_i` of source `i`: its weight's share of `N`,
//! rounded by largest remainders (Hamilton's method), so that the counts sum to `N`. Which
//! source each position of the epoch takes is decided by Tijdeman's algorithm for the
//! chairman assignment problem: at each position, among the sources at least `1 / (2n - 2)`
//! behind their share, the one whose next sample is due first. It keeps every source within
//! `1 - 1 / (2n - 2)` samples of its exact share `c_i * t / N` at every position `t`
//! (Tijdeman, 1980), hence the counts are exact at the epoch's end, and any window of `W`
//! positions holds a source's share to within 2 samples: 0.02% of a window of 10,000.
//! Megatron's `BlendedDataset` picks, at each position, the source furthest behind its share
//! (a greedy rule with no such bound) and asks each source for 0.5% more samples than its share.
//!
//! The interleave is the same every epoch and needs no randomness: which samples of a source
//! come is its own order's business. To find position `g`'s source without replaying the
//! epoch, the counts are kept every [`Blend::CHECKPOINT`] positions (`n` numbers each), and a
//! lookup replays at most that many steps.

use crate::error::{Error, Result};

/// Exact per-epoch counts of each source and their interleave; see the [module docs](self).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blend {
    counts: Vec<u64>,
    total: u64,
    /// `counts taken of each source` before position `k * CHECKPOINT`, flattened.
    checkpoints: Vec<u64>,
}

impl Blend {
    /// Positions between two checkpoints of the counts.
    pub const CHECKPOINT: u64 = 256;

    /// An epoch of `total` samples shared by `weights` (non-negative, not all zero; they need
    /// not sum to 1). A positive weight too small for one sample of the epoch is an error:
    /// the source would never be read.
    pub fn new(weights: &[f64], total: u64) -> Result<Blend> {
        Blend::named(weights, total, &|i| format!("source {i}"))
    }

    /// As [`new`](Self::new), its errors naming source `i` as `name(i)` says.
    pub(crate) fn named(
        weights: &[f64],
        total: u64,
        name: &dyn Fn(usize) -> String,
    ) -> Result<Blend> {
        let counts = apportion(weights, total, name)?;
        Ok(Blend::from_counts(counts))
    }

    /// The blend of exact per-epoch `counts` (their sum is the epoch's length).
    pub fn from_counts(counts: Vec<u64>) -> Blend {
        let total = counts.iter().sum();
        let mut blend = Blend {
            counts,
            total,
            checkpoints: Vec::new(),
        };
        if blend.counts.len() > 1 {
            let mut taken = vec![0u64; blend.counts.len()];
            for g in 0..total {
                if g % Blend::CHECKPOINT == 0 {
                    blend.checkpoints.extend_from_slice(&taken);
                }
                let i = blend.next(&taken, g);
                taken[i] += 1;
            }
        }
        blend
    }

    /// Samples of each source in an epoch.
    pub fn counts(&self) -> &[u64] {
        &self.counts
    }

    /// Samples in an epoch.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The source of position `g` of the epoch (`g < total()`), and how many of that source's
    /// samples come before it in the epoch.
    pub fn source_at(&self, g: u64) -> (usize, u64) {
        if self.counts.len() == 1 {
            return (0, g);
        }
        let taken = self.taken_before(g);
        let i = self.next(&taken, g);
        (i, taken[i])
    }

    /// How many samples of each source positions `0..g` hold.
    pub fn taken_before(&self, g: u64) -> Vec<u64> {
        let n = self.counts.len();
        if n == 1 {
            return vec![g.min(self.total)];
        }
        let g = g.min(self.total);
        let k = (g / Blend::CHECKPOINT) as usize;
        let mut taken = match self.checkpoints.get(k * n..(k + 1) * n) {
            Some(c) => c.to_vec(),
            // At the end of an epoch that is a whole number of checkpoints long.
            None => return self.counts.clone(),
        };
        for t in k as u64 * Blend::CHECKPOINT..g {
            let i = self.next(&taken, t);
            taken[i] += 1;
        }
        taken
    }

    /// Tijdeman's choice at position `g` (step `t = g + 1`) given the counts taken before it:
    /// among the sources with `taken + δ <= share * t` (δ = 1 / (2n - 2), n the sources with a
    /// count), the one with the earliest deadline `(taken + 1 - δ) / share`; exact in integers.
    fn next(&self, taken: &[u64], g: u64) -> usize {
        let n = self.counts.iter().filter(|&&c| c > 0).count().max(2) as u128;
        let k = 2 * n - 2;
        let (total, t) = (u128::from(self.total), u128::from(g) + 1);
        let mut best: Option<(usize, u128)> = None;
        for (i, (&c, &x)) in self.counts.iter().zip(taken).enumerate() {
            if c == 0 || x >= c {
                continue;
            }
            let (c, x) = (u128::from(c), u128::from(x));
            // taken + δ <= c * t / N, times K * N.
            if total * (k * x + 1) > k * c * t {
                continue;
            }
            // deadline (K (x + 1) - 1) / c, compared by cross-multiplying.
            let a = k * (x + 1) - 1;
            match best {
                Some((j, b)) if a * u128::from(self.counts[j]) >= b * c => {}
                _ => best = Some((i, a)),
            }
        }
        // Tijdeman's theorem says some source is always eligible; should rounding ever say
        // otherwise, the one furthest behind its share goes (Megatron's rule).
        best.map(|(i, _)| i).unwrap_or_else(|| {
            let mut furthest = (0, i128::MIN);
            for (i, (&c, &x)) in self.counts.iter().zip(taken).enumerate() {
                let behind = (u128::from(c) * t) as i128 - (u128::from(x) * total) as i128;
                if x < c && behind > furthest.1 {
                    furthest = (i, behind);
                }
            }
            furthest.0
        })
    }
}

/// Checks that `weights` can share an epoch: one at least, each finite and 0 or more, not
/// every one 0 (the same rules for one source as for many); errors name source `i` as
/// `name(i)` says, and its weight as typed (Rust's shortest form: `0.1`, `1e-300`, `NaN`).
pub(crate) fn check_weights(weights: &[f64], name: &dyn Fn(usize) -> String) -> Result<()> {
    if weights.is_empty() {
        return Err(Error::config(
            "sources",
            "a mixture needs at least one source",
        ));
    }
    if let Some((i, w)) = weights
        .iter()
        .enumerate()
        .find(|(_, w)| !(w.is_finite() && **w >= 0.0))
    {
        return Err(Error::config(
            "weights",
            format!(
                "{}: the weight {w:?} is not a number of at least 0 (a weight is the source's share of each epoch: finite, 0 or more)",
                name(i)
            ),
        ));
    }
    if weights.iter().all(|&w| w == 0.0) {
        let what = match weights {
            [_] => format!(
                "{}: the weight 0.0 leaves the only source nothing to give: give it a weight above 0 (any: a single source takes the whole epoch)",
                name(0)
            ),
            _ => "every weight is 0: give at least one source a weight above 0".to_owned(),
        };
        return Err(Error::config("weights", what));
    }
    Ok(())
}

/// `total` shared by `weights` in whole numbers, by largest remainders (ties: the first).
fn apportion(weights: &[f64], total: u64, name: &dyn Fn(usize) -> String) -> Result<Vec<u64>> {
    check_weights(weights, name)?;
    let sum: f64 = weights.iter().sum();
    if !sum.is_finite() {
        return Err(Error::config(
            "weights",
            format!("the weights sum to more than a number can hold ({sum:?}): scale them down"),
        ));
    }
    let quotas: Vec<f64> = weights.iter().map(|w| w / sum * total as f64).collect();
    let mut counts: Vec<u64> = quotas.iter().map(|q| q.floor() as u64).collect();
    let given: u64 = counts.iter().sum();
    let mut by_remainder: Vec<usize> = (0..weights.len()).collect();
    by_remainder.sort_by(|&a, &b| {
        let (ra, rb) = (quotas[a] - quotas[a].floor(), quotas[b] - quotas[b].floor());
        rb.total_cmp(&ra).then(a.cmp(&b))
    });
    for &i in by_remainder
        .iter()
        .cycle()
        .take(total.saturating_sub(given) as usize)
    {
        counts[i] += 1;
    }
    if let Some(i) = (0..weights.len()).find(|&i| weights[i] > 0.0 && counts[i] == 0) {
        return Err(Error::config(
            "weights",
            format!(
                "{}: the weight {:?} gives it no sample of an epoch of {total}: raise the weight or samples_per_epoch",
                name(i),
                weights[i]
            ),
        ));
    }
    Ok(counts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Every position's source, replayed from the start (what the checkpoints shortcut).
    fn sequence(b: &Blend) -> Vec<usize> {
        let mut taken = vec![0u64; b.counts().len()];
        (0..b.total())
            .map(|g| {
                let i = if taken.len() == 1 {
                    0
                } else {
                    b.next(&taken, g)
                };
                taken[i] += 1;
                i
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
        #[test]
        fn counts_are_exact_and_every_prefix_is_within_one_sample(
            weights in proptest::collection::vec(0.0f64..10.0, 1..8),
            total in 1u64..3000,
        ) {
            let Ok(b) = Blend::new(&weights, total) else { return Ok(()) };
            prop_assert_eq!(b.counts().iter().sum::<u64>(), total);
            let seq = sequence(&b);
            let mut taken = vec![0u64; weights.len()];
            for (g, &i) in seq.iter().enumerate() {
                // The lookup agrees with the replay: source, and its index among its samples.
                prop_assert_eq!(b.source_at(g as u64), (i, taken[i]));
                taken[i] += 1;
                for (j, &x) in taken.iter().enumerate() {
                    let share = b.counts()[j] as f64 * (g + 1) as f64 / total as f64;
                    prop_assert!((x as f64 - share).abs() < 1.0, "source {j} at {g}: {x} vs {share}");
                }
            }
            prop_assert_eq!(&taken, b.counts());
            prop_assert_eq!(b.taken_before(total), b.counts().to_vec());
        }
    }

    #[test]
    fn shares_hold_over_every_window_of_ten_thousand() {
        // Five sources, weights far apart, 200,000 samples: every window of 10,000 positions
        // holds each share within 0.1% (the bound says 0.02%).
        let b = Blend::new(&[0.5, 0.3, 0.15, 0.049, 0.001], 200_000).unwrap();
        assert_eq!(b.counts().iter().sum::<u64>(), 200_000);
        assert!(b.counts()[4] >= 199);
        let seq = sequence(&b);
        let window = 10_000usize;
        let mut count = [0i64; 5];
        for &i in &seq[..window] {
            count[i] += 1;
        }
        let mut worst = 0f64;
        for start in 0..=seq.len() - window {
            if start > 0 {
                count[seq[start - 1]] -= 1;
                count[seq[start + window - 1]] += 1;
            }
            for (i, &c) in count.iter().enumerate() {
                let want = b.counts()[i] as f64 / 200_000.0;
                worst = worst.max((c as f64 / window as f64 - want).abs());
            }
        }
        assert!(worst <= 0.0002, "worst share error {worst}");
    }

    #[test]
    fn weights_that_cannot_work_are_typed_errors() {
        assert!(Blend::new(&[], 10).is_err());
        assert!(Blend::new(&[0.0, 0.0], 10).is_err());
        assert!(Blend::new(&[1.0, -1.0], 10).is_err());
        assert!(Blend::new(&[1.0, f64::NAN], 10).is_err());
        let e = Blend::new(&[1.0, 1e-9], 1000).unwrap_err();
        assert!(e.to_string().contains("source 1"), "{e}");
        assert_eq!(
            Blend::new(&[2.0, 1.0, 0.0], 10).unwrap().counts(),
            [7, 3, 0]
        );
    }
}
