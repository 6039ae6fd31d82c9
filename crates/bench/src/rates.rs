//! Rates of a run: what a bench reports of its epochs, and its timeline.

use serde::Serialize;

/// The overall rate of the epochs after the first, given each epoch's rate, when every epoch
/// moves the same amount (bytes, samples): their harmonic mean. `None` with fewer than two
/// epochs. The first epoch pays for start-up (threads, page faults, first allocations), so this
/// is the rate a long run sustains.
pub fn steady_rate(epoch_rates: &[f64]) -> Option<f64> {
    let later = epoch_rates.get(1..).filter(|r| !r.is_empty())?;
    Some(later.len() as f64 / later.iter().map(|r| 1.0 / r.max(1e-9)).sum::<f64>())
}

/// What a run delivered when: each batch's amount (bytes or samples) at its time, and each
/// epoch's start, in seconds from the run's start. What `gpufeed bench --plot` draws.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Timeline {
    /// (seconds, amount) per batch, in order.
    pub batches: Vec<(f64, f64)>,
    /// The seconds at which each epoch started.
    pub epochs: Vec<f64>,
}

impl Timeline {
    /// `amount` delivered at `seconds`.
    pub fn batch(&mut self, seconds: f64, amount: f64) {
        self.batches.push((seconds, amount));
    }

    /// An epoch started at `seconds`.
    pub fn epoch(&mut self, seconds: f64) {
        self.epochs.push(seconds);
    }

    /// The run's length: its last batch's time (0 without batches).
    pub fn seconds(&self) -> f64 {
        self.batches.last().map_or(0.0, |b| b.0)
    }

    /// The amount per second in each interval of `width` seconds from 0 to the last batch
    /// (the last interval, if shorter, divided by its own length).
    pub fn rates(&self, width: f64) -> Vec<f64> {
        let end = self.seconds();
        if width <= 0.0 || end <= 0.0 {
            return Vec::new();
        }
        let n = (end / width).ceil().max(1.0) as usize;
        let mut sums = vec![0.0; n];
        for &(t, amount) in &self.batches {
            let k = ((t / width) as usize).min(n - 1);
            sums[k] += amount;
        }
        sums.iter()
            .enumerate()
            .map(|(k, s)| {
                let len = (end - k as f64 * width).min(width).max(1e-9);
                s / len
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::{Timeline, steady_rate};

    #[test]
    fn a_timeline_gives_the_amount_per_second_of_each_interval() {
        let mut t = Timeline::default();
        for k in 1..=25 {
            t.batch(k as f64 * 0.1, 10.0);
        }
        // 0.1 .. 2.5 s: 9 batches before 1 s (0.1 .. 0.9), 10 in [1, 2), 6 in [2, 2.5].
        let r = t.rates(1.0);
        assert_eq!(r.len(), 3);
        assert!(
            (r[0] - 90.0).abs() < 1e-9 && (r[1] - 100.0).abs() < 1e-9,
            "{r:?}"
        );
        assert!((r[2] - 60.0 / 0.5).abs() < 1e-6, "{r:?}");
        assert!(Timeline::default().rates(1.0).is_empty());
    }

    #[test]
    fn steady_rate_is_the_later_epochs_harmonic_mean() {
        assert_eq!(steady_rate(&[]), None);
        assert_eq!(steady_rate(&[5.0]), None);
        assert_eq!(steady_rate(&[1.0, 4.0]), Some(4.0));
        // Equal work at 2/s then 6/s: 2 units in 1/2 + 1/6 s = 3/s, not the mean 4/s.
        assert_eq!(steady_rate(&[1.0, 2.0, 6.0]), Some(3.0));
    }
}
