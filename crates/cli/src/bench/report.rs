//! What a bench reports: the figures of a run, per epoch, as JSON or as a table for people.

use std::path::Path;

use gpufeed::memory::{human_bytes, human_rate, significant};
use gpufeed::{Error, LoaderStats, Result};
use serde::Serialize;

use super::args::Args;

/// What `gpufeed bench --json` prints: the same keys for every kind of run (`null` where a
/// figure does not apply). Rates are per second of the run, the first batch included.
#[derive(Serialize, Debug, Default, Clone)]
pub struct Report {
    /// `records` (the loader over a data set's records) or `images` (the image pipeline).
    pub mode: &'static str,
    /// The data set read; for the generated default, a description (its temporary file is
    /// gone when the report is printed).
    pub dataset: String,
    /// True for the generated default data set.
    pub generated: bool,
    /// Samples in the data set.
    pub records: u64,
    /// Bytes per sample in a batch, all fields.
    pub sample_bytes: u64,
    /// Samples per batch.
    pub batch_size: usize,
    /// Worker threads.
    pub workers: usize,
    /// Batches in flight.
    pub prefetch: usize,
    /// Parts each batch is made in, by as many workers at once.
    pub batch_parts: usize,
    /// Epochs run (started, when the run was interrupted).
    pub epochs: u64,
    /// Shuffled or not.
    pub shuffle: bool,
    /// Samples delivered, all epochs.
    pub samples: u64,
    /// Seconds the run took (from the first batch asked for; for images, from the loader's
    /// creation).
    pub seconds: f64,
    /// Samples delivered per second (all epochs, first batch included).
    pub samples_per_sec: f64,
    /// Batch bytes delivered per second.
    pub bytes_per_sec: f64,
    /// Samples per second of each epoch, in order.
    pub epoch_samples_per_sec: Vec<f64>,
    /// Samples per second over the epochs after the first (with 2 epochs or more).
    pub steady_samples_per_sec: Option<f64>,
    /// Milliseconds from `build()` to the first batch (records runs).
    pub first_batch_ms: Option<f64>,
    /// Fraction of the consumer's time spent waiting for data.
    pub wait_fraction: f64,
    /// Bytes the batch pool reserved at the end (host records runs).
    pub pool_reserved_bytes: Option<u64>,
    /// The most the batch pool reserved (host records runs).
    pub pool_peak_bytes: Option<u64>,
    /// The plain gather's bytes per second (host records runs, unless `--no-baseline`).
    pub baseline_bytes_per_sec: Option<f64>,
    /// Batch bytes per second over the epochs after the first (with 2 epochs or more): the
    /// steady state, once the mapping's pages are mapped and the pool's buffers allocated.
    pub steady_bytes_per_sec: Option<f64>,
    /// `steady_bytes_per_sec / baseline_bytes_per_sec` (the gather runs after the loader, over
    /// pages the loader has mapped, so it is compared with the loader's steady state; the
    /// whole run's rate with one epoch).
    pub baseline_ratio: Option<f64>,
    /// Host-to-device bytes per second of the copy stage (with `--device`).
    pub h2d_bytes_per_sec: Option<f64>,
    /// The copy stage's bytes per second over the epochs after the first (with `--device`
    /// and 2 epochs or more): the first epoch's copies read freshly pinned memory.
    pub h2d_steady_bytes_per_sec: Option<f64>,
    /// Pinned host-to-device copy ceiling measured in the same run (with `--device`).
    pub h2d_ceiling_bytes_per_sec: Option<f64>,
    /// The GPU (with `--device`).
    pub device: Option<String>,
    /// Batch bytes per second of each epoch, in order (the first one pays for page faults and
    /// buffer allocation; later ones show the steady state).
    pub epoch_bytes_per_sec: Vec<f64>,
    /// Images that could not be decoded and were skipped (images runs).
    pub skipped: Option<u64>,
    /// The image pipeline's decode: `cpu` or `gpu` (`null` for records).
    pub decode: Option<&'static str>,
    /// The GPU decode stage's figures: library, engines, host and device seconds, which
    /// engine took how many images, the split (`null` unless the GPU decoded).
    #[cfg(feature = "cuda")]
    pub decode_report: Option<gpufeed::cuda::nvjpeg::DecodeReport>,
    /// Seconds spent writing the generated data set (not part of the figures).
    pub generate_secs: f64,
    /// Milliseconds to open the GPU: load the driver, create the context and the copy stream
    /// (with `--device`; not part of the other figures).
    pub device_open_ms: Option<f64>,
    /// Milliseconds from the loader's creation to the first device batch ready on the
    /// consumer's stream (with `--device`).
    pub first_device_batch_ms: Option<f64>,
    /// Where each epoch's time went (with `--device`): worker time per stage, pool
    /// allocations, the copy stage, the consumer's wait.
    pub epoch_details: Vec<EpochDetail>,
    /// Shards of a sharded data set.
    pub shards: Option<usize>,
    /// The two-level shuffle's window (shards) and block (samples), for a sharded data set.
    pub shuffle_blocks: Option<(u64, u64)>,
    /// What the store of a data set read from a URL fetched, retried and cached.
    pub store: Option<crate::open::StoreReport>,
    /// What the cache of decoded chunks of a table (Parquet) did: hits, decodes, evictions,
    /// bytes held at most and its limit.
    pub chunk_cache: Option<gpufeed::source::table::ChunkCacheStats>,
    /// The variable-size fields batched as values plus offsets (records runs that have them).
    pub ragged: Option<RaggedReport>,
    /// True when Ctrl-C stopped the run: the figures are those of what ran (the last epoch
    /// counted may be cut short, `epochs` is the number started), and there is no baseline.
    pub interrupted: bool,
    /// Whether the consumer waited, which stage bound the rate, what would help (one line).
    pub verdict: Option<String>,
    /// What the loader chose of the settings given as `auto`, and why.
    pub tuning: Option<gpufeed::loader::Tuning>,
    /// The file the run's timeline was written to (`--trace`).
    pub trace: Option<String>,
    /// The file the throughput picture was written to (`--plot`).
    pub plot: Option<String>,
}

/// The ragged fields of a records run: their budgets, and what the batches held.
#[derive(Serialize, Debug, Default, Clone)]
pub struct RaggedReport {
    /// The fields, in the batches' order.
    pub fields: Vec<String>,
    /// Each field's byte budget per batch (`--ragged-budget`, or measured by the loader).
    pub budget_bytes: Vec<u64>,
    /// Values (items) per batch on average, all ragged fields together.
    pub values_per_batch: f64,
    /// Bytes of values per batch on average, all ragged fields together.
    pub value_bytes_per_batch: f64,
}

/// What a run's batches held in their ragged fields, counted as they come.
pub struct RaggedTally {
    /// (name, position, budget, item bytes) of each ragged field.
    fields: Vec<(String, usize, u64, u64)>,
    batches: u64,
    values: u64,
    bytes: u64,
}

impl RaggedTally {
    /// A tally of the ragged fields of batches laid out as `layout` (none: no report).
    pub fn of(layout: &gpufeed::BatchLayout) -> RaggedTally {
        let fields = layout
            .fields()
            .iter()
            .enumerate()
            .filter(|(_, f)| f.ragged)
            .map(|(k, f)| {
                let budget = layout.ragged_capacity(k).unwrap_or(0) as u64;
                (f.name.clone(), k, budget, f.item_bytes() as u64)
            })
            .collect();
        RaggedTally {
            fields,
            batches: 0,
            values: 0,
            bytes: 0,
        }
    }

    /// Counts a host batch.
    pub fn add(&mut self, batch: &gpufeed::Batch) -> Result<()> {
        self.add_counts(|name| Ok(*batch.offsets(name)?.last().unwrap_or(&0) as u64))
    }

    /// Counts a batch whose fields' item counts `items` gives.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn add_counts(&mut self, items: impl Fn(&str) -> Result<u64>) -> Result<()> {
        if self.fields.is_empty() {
            return Ok(());
        }
        self.batches += 1;
        for (name, _, _, item) in &self.fields {
            let n = items(name)?;
            self.values += n;
            self.bytes += n * item;
        }
        Ok(())
    }

    /// The report, if the batches have ragged fields.
    pub fn report(&self) -> Option<RaggedReport> {
        if self.fields.is_empty() {
            return None;
        }
        let per = |n: u64| n as f64 / self.batches.max(1) as f64;
        Some(RaggedReport {
            fields: self.fields.iter().map(|f| f.0.clone()).collect(),
            budget_bytes: self.fields.iter().map(|f| f.2).collect(),
            values_per_batch: per(self.values),
            value_bytes_per_batch: per(self.bytes),
        })
    }
}

/// One epoch of a device run, as differences of the loader's counters over the epoch.
#[derive(Serialize, Debug, Default, Clone)]
pub struct EpochDetail {
    /// Wall seconds of the epoch (the first from the loader's creation).
    pub seconds: f64,
    /// Batch bytes delivered per second.
    pub bytes_per_sec: f64,
    /// Worker seconds in `Dataset::get` (summed over workers).
    pub fetch_s: f64,
    /// Worker seconds writing samples into batch buffers.
    pub transform_s: f64,
    /// Worker seconds getting batch buffers (pool waits and allocations included).
    pub collate_s: f64,
    /// Batch buffers allocated from the backing (pinned) in the epoch.
    pub pool_allocations: u64,
    /// Seconds the pool spent allocating them (summed over threads).
    pub pool_allocation_s: f64,
    /// Seconds the copy engine was busy with the epoch's copies (those timed).
    pub h2d_busy_s: f64,
    /// The copy stage's bytes per second over the epoch.
    pub h2d_bytes_per_sec: f64,
    /// Seconds the consumer waited for device batches.
    pub consumer_wait_s: f64,
    /// Seconds the copy thread waited for host batches (the host loader's wait).
    pub copy_thread_host_wait_s: f64,
    /// Seconds the copy thread spent enqueueing copies.
    pub copy_thread_enqueue_s: f64,
    /// Seconds the copy thread was blocked on a full queue to the consumer.
    pub copy_thread_blocked_s: f64,
}

/// The report's common fields.
pub fn report_of(
    args: &Args,
    path: &Path,
    stats: &LoaderStats,
    records: u64,
    workers: usize,
    prefetch: usize,
    generate_secs: f64,
) -> Report {
    Report {
        mode: "records",
        dataset: path.display().to_string(),
        records,
        sample_bytes: stats.bytes.checked_div(stats.samples).unwrap_or(0),
        batch_size: args.batch_size,
        workers,
        prefetch,
        epochs: args.epochs,
        shuffle: !args.no_shuffle,
        samples: stats.samples,
        seconds: stats.elapsed.as_secs_f64(),
        samples_per_sec: stats.samples_per_sec(),
        bytes_per_sec: stats.bytes_per_sec(),
        first_batch_ms: stats.first_batch.map(|d| d.as_secs_f64() * 1e3),
        wait_fraction: stats.wait_fraction(),
        pool_reserved_bytes: Some(stats.pool.reserved_bytes),
        pool_peak_bytes: Some(stats.pool.peak_reserved_bytes),
        generate_secs,
        ..Report::default()
    }
}

/// Prints a device run's report as JSON or as text (`stats` is the copy stage's table).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub fn print_device_report(args: &Args, report: &Report, stats: &str) -> Result<()> {
    let mut report = report.clone();
    report.mode = "records";
    print_report_with(args, report, None, stats)
}

/// Fills the figures every report has from those it was given, and describes a generated
/// data set instead of naming its (removed) file.
pub(super) fn complete(args: &Args, report: &mut Report) {
    if args.dataset.is_none() && args.images.is_none() {
        report.generated = true;
        report.dataset = "the generated default data set (removed after the run)".to_owned();
    }
    if report.sample_bytes > 0 {
        let per = report.sample_bytes as f64;
        if report.epoch_samples_per_sec.is_empty() {
            report.epoch_samples_per_sec =
                report.epoch_bytes_per_sec.iter().map(|b| b / per).collect();
        }
        if report.steady_samples_per_sec.is_none() {
            report.steady_samples_per_sec = report.steady_bytes_per_sec.map(|b| b / per);
        }
        if report.samples == 0 && report.samples_per_sec > 0.0 && report.seconds > 0.0 {
            report.samples = (report.samples_per_sec * report.seconds).round() as u64;
        }
    }
}

/// One rate in the run's one unit: bytes per second in decimal units for records (`41.2 GB/s`,
/// `512 MB/s`), images/s for images; three significant digits.
pub(super) fn rate(report: &Report, bytes_per_sec: f64, samples_per_sec: f64) -> String {
    if report.mode == "images" {
        format!("{} images/s", significant(samples_per_sec))
    } else {
        human_rate(bytes_per_sec)
    }
}

/// A fraction as a percentage with three significant digits (`98.7%`, `5.12%`, `0.372%`).
pub(super) fn percent(fraction: f64) -> String {
    format!("{}%", significant(100.0 * fraction))
}

/// `n` and the word for that many (`1 epoch`, `3 epochs`).
pub(super) fn count(n: impl Into<u64>, one: &str, many: &str) -> String {
    let n = n.into();
    format!("{n} {}", if n == 1 { one } else { many })
}

/// The stage table of a host records run: worker time per stage, all as shares of one
/// denominator (the workers' time over the run).
pub(super) fn stage_table(stats: &LoaderStats) -> String {
    let total = stats.elapsed.as_secs_f64() * stats.workers as f64;
    let share = |d: std::time::Duration| 100.0 * d.as_secs_f64() / total.max(1e-9);
    let busy = stats.stages.fetch + stats.stages.transform + stats.stages.collate;
    let idle = (total - busy.as_secs_f64()).max(0.0);
    let mut t = format!(
        "worker time: {} x {:.3} s = {:.3} s\n",
        count(stats.workers as u64, "worker", "workers"),
        stats.elapsed.as_secs_f64(),
        total
    );
    for (name, secs, pct) in [
        (
            "fetch",
            stats.stages.fetch.as_secs_f64(),
            share(stats.stages.fetch),
        ),
        (
            "transform (copy)",
            stats.stages.transform.as_secs_f64(),
            share(stats.stages.transform),
        ),
        (
            "collate",
            stats.stages.collate.as_secs_f64(),
            share(stats.stages.collate),
        ),
        ("idle or waiting", idle, 100.0 * idle / total.max(1e-9)),
    ] {
        t.push_str(&format!("  {name:<18} {secs:>9.3} s {pct:>6.1}%\n"));
    }
    t
}

/// Prints the report of a run: as JSON with `--json`, else as lines of text (`extra`: what an
/// image run decoded, or the copy stage's figures shown with `--verbose`).
pub(super) fn print_report_with(
    args: &Args,
    mut report: Report,
    stats: Option<&LoaderStats>,
    extra: &str,
) -> Result<()> {
    complete(args, &mut report);
    if args.json {
        let text = serde_json::to_string(&report)
            .map_err(|e| Error::user(format!("cannot encode the report: {e}")))?;
        return crate::out(text);
    }
    let images = report.mode == "images";
    let what = if images {
        extra
    } else {
        report.dataset.as_str()
    };
    let mut text = heading(&report, what);
    text.push('\n');
    if report.interrupted {
        text.push_str(&format!(
            "interrupted: Ctrl-C after {} of {} (the last cut short); the figures are of what ran\n",
            count(report.epochs, "epoch", "epochs"),
            args.epochs
        ));
    }
    if let Some(device) = &report.device {
        text.push_str(&format!("device: {device}\n"));
    }
    rate_lines(args, &report, &mut text);
    data_lines(&report, &mut text);
    text.push_str(&format!(
        "consumer: waited for data {} of its time{}\n",
        percent(report.wait_fraction),
        report.first_batch_ms.map_or(String::new(), |ms| format!(
            "; first batch {} ms after build",
            significant(ms)
        ))
    ));
    if let Some(tuning) = &report.tuning {
        text.push_str(&format!("settings: {}\n", tuning.reason));
    }
    if let Some(stats) = stats {
        text.push_str(&stage_table(stats));
        if args.verbose {
            text.push_str(&format!("\nthe loader's own figures:\n{stats}\n"));
        }
    } else if !extra.is_empty() && !images && args.verbose {
        text.push_str(&format!("\nthe copy stage's figures:\n{extra}\n"));
    }
    if let Some(path) = &report.trace {
        text.push_str(&format!(
            "trace: {path} (open it in https://ui.perfetto.dev or chrome://tracing)\n"
        ));
    }
    if let Some(path) = &report.plot {
        text.push_str(&format!("plot: {path}\n"));
    }
    if let Some(verdict) = &report.verdict {
        text.push_str(&format!("verdict: {verdict}\n"));
    }
    crate::out(text.trim_end())
}

/// The report's first line: what ran, on what data, with which settings.
fn heading(report: &Report, what: &str) -> String {
    let images = report.mode == "images";
    let sizes = if images {
        format!(" ({})", count(report.records, "image", "images"))
    } else {
        format!(
            " ({} of {})",
            count(report.records, "record", "records"),
            human_bytes(report.sample_bytes)
        )
    };
    format!(
        "gpufeed bench{}: {what}{sizes}, batch {}, {}, prefetch {}, {}, {}, {}",
        if images { " --images" } else { "" },
        report.batch_size,
        count(report.workers as u64, "worker", "workers"),
        report.prefetch,
        count(report.batch_parts as u64, "part", "parts"),
        count(report.epochs, "epoch", "epochs"),
        if report.shuffle {
            "shuffled"
        } else {
            "sequential"
        }
    )
}

/// The report's rates: over the run, per epoch, and against the gather or the copy ceiling.
fn rate_lines(args: &Args, report: &Report, text: &mut String) {
    let images = report.mode == "images";
    let mut line = format!(
        "throughput: {} over the run ({} in {} s)",
        rate(report, report.bytes_per_sec, report.samples_per_sec),
        if images {
            count(report.samples, "image", "images")
        } else {
            count(report.samples, "sample", "samples")
        },
        significant(report.seconds)
    );
    if let (Some(b), Some(s)) = (report.steady_bytes_per_sec, report.steady_samples_per_sec) {
        line.push_str(&format!(
            "; steady state (epochs after the first) {}",
            rate(report, b, s)
        ));
    }
    text.push_str(&line);
    text.push('\n');
    if report.epoch_bytes_per_sec.len() > 1 {
        let rates: Vec<String> = report
            .epoch_bytes_per_sec
            .iter()
            .zip(&report.epoch_samples_per_sec)
            .map(|(&b, &s)| rate(report, b, s))
            .collect();
        text.push_str(&format!("per epoch: {}\n", rates.join(", ")));
    }
    if let (Some(b), Some(r)) = (report.baseline_bytes_per_sec, report.baseline_ratio) {
        text.push_str(&format!(
            "compared: a plain {}-thread memcpy gather of the same {}records in the same order runs at {}; \
             gpufeed's {} is {} of it\n",
            report.workers,
            if args.fields.is_some() {
                "fields of the same "
            } else {
                ""
            },
            rate(report, b, 0.0),
            if report.steady_bytes_per_sec.is_some() {
                "steady state"
            } else {
                "rate"
            },
            percent(r)
        ));
    }
    if let (Some(h), Some(c)) = (report.h2d_bytes_per_sec, report.h2d_ceiling_bytes_per_sec) {
        text.push_str(&format!(
            "compared: host to device {}; the pinned-copy ceiling in this run is {} ({})\n",
            human_rate(h),
            human_rate(c),
            percent(h / c)
        ));
        if let Some(steady) = report.h2d_steady_bytes_per_sec {
            text.push_str(&format!(
                "host to device, epochs after the first: {} ({} of the ceiling)\n",
                human_rate(steady),
                percent(steady / c)
            ));
        }
    }
}

/// What the run read besides samples: bad images skipped, shards, the store, ragged fields.
fn data_lines(report: &Report, text: &mut String) {
    if let Some(skipped) = report.skipped {
        text.push_str(&format!("bad images skipped: {skipped}\n"));
    }
    if let Some(shards) = report.shards {
        text.push_str(&format!(
            "shards: {shards}{}\n",
            report
                .shuffle_blocks
                .map_or(String::new(), |(w, b)| format!(
                    ", two-level shuffle: windows of {}, blocks of {}",
                    count(w, "shard", "shards"),
                    count(b, "sample", "samples")
                ))
        ));
    }
    if let Some(store) = &report.store {
        text.push_str(&format!("store: {}\n", store.summary));
    }
    if let Some(c) = &report.chunk_cache {
        text.push_str(&format!(
            "chunk cache: {} rows from decoded chunks, {} chunk decodes ({} ahead, by workers that would have waited; {} dropped), at most {} held of a limit of {}\n",
            c.hits,
            c.misses,
            c.decoded_ahead,
            c.evictions,
            human_bytes(c.peak_bytes),
            human_bytes(c.limit_bytes)
        ));
    }
    if let Some(r) = &report.ragged {
        let budgets: Vec<String> = r.budget_bytes.iter().map(|&b| human_bytes(b)).collect();
        text.push_str(&format!(
            "ragged fields: {} (values plus offsets; budgets {} per batch): {} values, {}, per batch on average\n",
            r.fields.join(", "),
            budgets.join(", "),
            significant(r.values_per_batch),
            human_bytes(r.value_bytes_per_batch.round() as u64)
        ));
    }
}
