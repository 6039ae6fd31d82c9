//! `gpufeed bench --device N`: the whole path, mapped file to device memory, with the
//! pinned-copy ceiling measured in the same run (feature `cuda`).

use gpufeed::BatchStream;
use std::path::Path;
use std::time::Instant;

use gpufeed::cuda::{
    Device, DeviceLoader, DeviceLoaderOptions, PinnedBacking, pinned_copy_ceiling,
};
use gpufeed::{Error, LoaderBuilder, Result};

use super::args::Args;
use super::report::{EpochDetail, RaggedTally, Report, print_device_report};
use crate::cleanup::{ReportOnInterrupt, interrupted};
use crate::messages::progress;

/// Opens GPU `ordinal`, with a hint in the error when there is none.
pub(super) fn open_device(ordinal: usize) -> Result<Device> {
    Device::open(ordinal).map_err(|e| match e {
        Error::NoGpu { what } => Error::NoGpu {
            what: format!("{what}; run `gpufeed bench` without --device for the host-only figures"),
        },
        other => other,
    })
}

/// `gpufeed bench --images PATH --device N`: the image pipeline to device batches (u8 CHW
/// copied, converted to the output dtype on the device).
pub fn run_images(
    path: &Path,
    cfg: &gpufeed_bench::ImageBenchConfig,
    ordinal: usize,
) -> Result<gpufeed_bench::ImageBenchReport> {
    gpufeed_bench::bench_images_device(path, cfg, &open_device(ordinal)?)
}

/// The stage times of each epoch of a device image run (`sample_bytes`: one image in the
/// device batch), from the loader's figures at each epoch's end.
pub fn image_epoch_details(
    r: &gpufeed_bench::ImageBenchReport,
    sample_bytes: u64,
) -> Vec<EpochDetail> {
    r.device_stats
        .windows(2)
        .zip(&r.epoch_images_per_sec)
        .map(|(w, &rate)| {
            let images = w[1].samples.saturating_sub(w[0].samples);
            let seconds = if rate > 0.0 {
                images as f64 / rate
            } else {
                0.0
            };
            epoch_detail(&w[0], &w[1], seconds, images * sample_bytes)
        })
        .collect()
}

/// Runs the device bench; `builder` has every host setting already (`trace` included);
/// `data_figures` puts what the caller knows of the data in the report after the run: its
/// name, records, the time to generate it, and what its own parts did (store, chunk cache).
pub fn run(
    args: &Args,
    builder: LoaderBuilder,
    ordinal: usize,
    trace: Option<&gpufeed::trace::Trace>,
    data_figures: impl FnOnce(&mut Report),
) -> Result<()> {
    let t_open = Instant::now();
    let device = open_device(ordinal)?;
    let device_open_ms = t_open.elapsed().as_secs_f64() * 1e3;
    let built = Instant::now();
    let loader = builder.backing(PinnedBacking::new(&device)).build()?;
    let workers = loader.stats().workers;
    let prefetch = loader.prefetch();
    let batch_parts = loader.batch_parts();
    let copy_bytes = loader.layout().total_bytes();
    let mut values = RaggedTally::of(loader.layout());
    let per_epoch = args.max_batches.map_or(loader.batches_per_epoch(), |m| {
        m.min(loader.batches_per_epoch())
    });
    let mut feed = DeviceLoader::new(loader, &device, DeviceLoaderOptions::default())?;
    let consumer = device.new_stream()?;
    let sync = |s: &gpufeed::cuda::CudaStream| {
        s.synchronize().map_err(|source| Error::Driver {
            op: "synchronize the consumer stream",
            source,
        })
    };
    // From here on Ctrl-C stops the run at the next batch, and the report says what ran.
    let _report_on_interrupt = ReportOnInterrupt::start();
    let bar = progress(per_epoch * args.epochs, "bench (device)", args.json);
    let mut epoch_rates = Vec::new();
    let mut details = Vec::new();
    let mut first_device_batch_ms = None;
    // Copy-stage counters (timed bytes, busy time) at the end of the first epoch.
    let mut after_first = None;
    let mut before = feed.stats();
    let mut timeline = gpufeed_bench::Timeline::default();
    for epoch in 0..args.epochs {
        feed.set_epoch(epoch);
        // The first epoch counts from the loader's creation, as PyTorch's does from its
        // DataLoader's: start-up is part of it.
        let t0 = if epoch == 0 { built } else { Instant::now() };
        timeline.epoch(t0.duration_since(built).as_secs_f64());
        let mut bytes = 0u64;
        // Run a whole epoch to its end (`None`) unless told to stop early: the copy stage reads
        // the last copies' timings at the end of an epoch.
        let limit = args.max_batches.map_or(usize::MAX, |_| per_epoch as usize);
        for batch in feed.by_ref().take(limit) {
            let batch = batch?;
            batch.wait_on(&consumer)?;
            if first_device_batch_ms.is_none() {
                sync(&consumer)?;
                first_device_batch_ms = Some(built.elapsed().as_secs_f64() * 1e3);
            }
            let batch_bytes = batch.fields().map(|f| f.bytes() as u64).sum::<u64>();
            bytes += batch_bytes;
            timeline.batch(built.elapsed().as_secs_f64(), batch_bytes as f64);
            values.add_counts(|name| Ok(*batch.offsets_host(name)?.last().unwrap_or(&0) as u64))?;
            bar.inc(1);
            if interrupted() {
                break;
            }
        }
        sync(&consumer)?;
        let seconds = t0.elapsed().as_secs_f64().max(1e-9);
        epoch_rates.push(bytes as f64 / seconds);
        let now = feed.stats();
        details.push(epoch_detail(&before, &now, seconds, bytes));
        before = now;
        if epoch == 0 {
            let s = feed.stats();
            after_first = Some((s.h2d_timed_bytes, s.h2d_busy));
        }
        if interrupted() {
            break;
        }
    }
    bar.finish_and_clear();
    device.synchronize()?;
    let stats = feed.stats();
    drop(feed);
    // The ceiling: repeated copies of one pinned buffer of a batch's size, after the run (so
    // that it does not delay the first batch), in the same process.
    let iterations = ((4usize << 30) / copy_bytes.max(1)).clamp(20, 2000);
    let ceiling = pinned_copy_ceiling(&device, copy_bytes, iterations)?;
    let host = stats.loader.clone();
    // With `auto`, what the loader chose in the end.
    let (workers, prefetch, batch_parts) = host
        .as_ref()
        .and_then(|h| h.tuning.as_ref())
        .map_or((workers, prefetch, batch_parts), |t| {
            (t.workers, t.prefetch, t.batch_parts)
        });
    let mut report = Report {
        sample_bytes: stats.bytes.checked_div(stats.samples).unwrap_or(0),
        batch_size: args.batch_size,
        workers,
        prefetch,
        batch_parts,
        epochs: epoch_rates.len() as u64,
        shuffle: !args.no_shuffle,
        samples: stats.samples,
        seconds: stats.elapsed.as_secs_f64(),
        samples_per_sec: stats.samples as f64 / stats.elapsed.as_secs_f64().max(1e-9),
        bytes_per_sec: stats.bytes_per_sec(),
        first_batch_ms: host
            .as_ref()
            .and_then(|h| h.first_batch)
            .map(|d| d.as_secs_f64() * 1e3),
        wait_fraction: stats.wait_fraction(),
        pool_reserved_bytes: host.as_ref().map(|h| h.pool.reserved_bytes),
        pool_peak_bytes: host.as_ref().map(|h| h.pool.peak_reserved_bytes),
        h2d_bytes_per_sec: Some(stats.h2d_bytes_per_sec()),
        h2d_steady_bytes_per_sec: after_first.filter(|_| args.epochs > 1).and_then(|(b, t)| {
            let busy = stats.h2d_busy.saturating_sub(t).as_secs_f64();
            (busy > 0.0).then(|| (stats.h2d_timed_bytes - b) as f64 / busy)
        }),
        h2d_ceiling_bytes_per_sec: Some(ceiling),
        steady_bytes_per_sec: gpufeed_bench::steady_rate(&epoch_rates),
        epoch_bytes_per_sec: epoch_rates,
        device: Some(format!("{} (ordinal {})", device.name(), device.ordinal())),
        device_open_ms: Some(device_open_ms),
        first_device_batch_ms,
        epoch_details: details,
        ragged: values.report(),
        interrupted: interrupted(),
        verdict: stats.verdict().map(|v| v.to_string()),
        tuning: host.as_ref().and_then(|h| h.tuning.clone()),
        ..Report::default()
    };
    data_figures(&mut report);
    let ceiling = Some(("pinned-copy ceiling".to_owned(), ceiling));
    super::write_outputs(args, trace, &timeline, true, ceiling, &mut report)?;
    print_device_report(args, &report, &stats.to_string())
}

/// One epoch's figures, as differences between the device loader's stats at its start and end.
fn epoch_detail(
    before: &gpufeed::cuda::DeviceStats,
    after: &gpufeed::cuda::DeviceStats,
    seconds: f64,
    bytes: u64,
) -> EpochDetail {
    let secs = |a: std::time::Duration, b: std::time::Duration| a.saturating_sub(b).as_secs_f64();
    let (hb, ha) = (before.loader.as_ref(), after.loader.as_ref());
    let stage = |f: fn(&gpufeed::LoaderStats) -> std::time::Duration| match (hb, ha) {
        (Some(b), Some(a)) => secs(f(a), f(b)),
        (None, Some(a)) => f(a).as_secs_f64(),
        _ => 0.0,
    };
    let busy = secs(after.h2d_busy, before.h2d_busy);
    let timed = after.h2d_timed_bytes.saturating_sub(before.h2d_timed_bytes);
    EpochDetail {
        seconds,
        bytes_per_sec: bytes as f64 / seconds,
        fetch_s: stage(|s| s.stages.fetch),
        transform_s: stage(|s| s.stages.transform),
        collate_s: stage(|s| s.stages.collate),
        pool_allocations: ha.map_or(0, |a| a.pool.allocations)
            - hb.map_or(0, |b| b.pool.allocations),
        pool_allocation_s: stage(|s| s.pool.allocation_time),
        h2d_busy_s: busy,
        h2d_bytes_per_sec: if busy > 0.0 { timed as f64 / busy } else { 0.0 },
        consumer_wait_s: secs(after.waited, before.waited),
        copy_thread_host_wait_s: stage(|s| s.waited),
        copy_thread_enqueue_s: secs(after.copy_thread_enqueue, before.copy_thread_enqueue),
        copy_thread_blocked_s: secs(after.copy_thread_blocked, before.copy_thread_blocked),
    }
}
