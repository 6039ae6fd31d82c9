//! The yardstick the loader is measured against: a plain multi-threaded memcpy gather.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use gpufeed::sampler::OrderSpec;
use gpufeed::source::Dataset;
use gpufeed::{Error, Result};

/// Copies the records of `epochs` epochs of `spec`, in the loader's order, with one thread per
/// buffer in `buffers` (batch `b` by thread `b % threads`, into its own buffer, grown as
/// needed and kept), and returns the bytes per second. No pool, no channel, no transform:
/// what the loader's overhead is measured against (`gpufeed bench --baseline`,
/// `benches/loader.rs`). Pass the same buffers again to measure without their page faults.
///
/// `fields` are the fields copied, by position in the schema (every field for `None`), so
/// that the gather does the work of a loader that batches those. Once `stop` is set (by a
/// signal's handler, say), the threads stop after their current batch and the result is
/// `None`: a rate of part of the work is no yardstick.
pub fn gather_baseline(
    dataset: &dyn Dataset,
    spec: &OrderSpec,
    epochs: u64,
    max_batches: Option<u64>,
    fields: Option<&[usize]>,
    stop: &AtomicBool,
    buffers: &mut [Vec<u8>],
) -> Result<Option<f64>> {
    let threads = buffers.len();
    if threads == 0 {
        return Err(Error::InvalidConfig {
            setting: "threads",
            what: "the gather needs at least one buffer (thread)".to_owned(),
        });
    }
    let every: Vec<usize> = (0..dataset.schema().fields().len()).collect();
    let fields = fields.unwrap_or(&every);
    let started = Instant::now();
    // Threads and their buffers live across epochs, as the loader's do: page faults on fresh
    // buffers are paid once, not every epoch.
    let results: Vec<Result<u64>> = std::thread::scope(|s| {
        let handles: Vec<_> = buffers
            .iter_mut()
            .enumerate()
            .map(|(t, out)| {
                s.spawn(move || -> Result<u64> {
                    let mut indices = Vec::new();
                    let mut copied = 0u64;
                    for epoch in 0..epochs {
                        let order = spec.epoch(epoch);
                        let batches =
                            max_batches.map_or(order.batches(), |m| m.min(order.batches()));
                        let mut b = t as u64;
                        while b < batches && !stop.load(Ordering::Relaxed) {
                            order.batch(b, &mut indices);
                            let mut at = 0;
                            for &i in &indices {
                                let sample = dataset.get(i)?;
                                for &k in fields {
                                    // A read that fails is the gather's error, not the end.
                                    let field = sample.try_field(k)?;
                                    if out.len() < at + field.len() {
                                        out.resize(at + field.len(), 0u8);
                                    }
                                    out[at..at + field.len()].copy_from_slice(field);
                                    at += field.len();
                                }
                            }
                            std::hint::black_box(out.first());
                            copied += at as u64;
                            b += threads as u64;
                        }
                    }
                    Ok(copied)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::user("a gather thread panicked")))
            })
            .collect()
    });
    let mut bytes = 0u64;
    for r in results {
        bytes += r?;
    }
    if stop.load(Ordering::Relaxed) {
        return Ok(None);
    }
    let secs = started.elapsed().max(Duration::from_nanos(1)).as_secs_f64();
    Ok(Some(bytes as f64 / secs))
}
