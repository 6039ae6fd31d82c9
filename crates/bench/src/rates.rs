//! Rates of a run: what a bench reports of its epochs.

/// The overall rate of the epochs after the first, given each epoch's rate, when every epoch
/// moves the same amount (bytes, samples): their harmonic mean. `None` with fewer than two
/// epochs. The first epoch pays for start-up (threads, page faults, first allocations), so this
/// is the rate a long run sustains.
pub fn steady_rate(epoch_rates: &[f64]) -> Option<f64> {
    let later = epoch_rates.get(1..).filter(|r| !r.is_empty())?;
    Some(later.len() as f64 / later.iter().map(|r| 1.0 / r.max(1e-9)).sum::<f64>())
}

#[cfg(test)]
mod tests {
    use super::steady_rate;

    #[test]
    fn steady_rate_is_the_later_epochs_harmonic_mean() {
        assert_eq!(steady_rate(&[]), None);
        assert_eq!(steady_rate(&[5.0]), None);
        assert_eq!(steady_rate(&[1.0, 4.0]), Some(4.0));
        // Equal work at 2/s then 6/s: 2 units in 1/2 + 1/6 s = 3/s, not the mean 4/s.
        assert_eq!(steady_rate(&[1.0, 2.0, 6.0]), Some(3.0));
    }
}
