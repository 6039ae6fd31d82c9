//! `gpufeed bench --device N`: the whole path, mapped file to device memory, with the
//! pinned-copy ceiling measured in the same run (feature `cuda`).

use std::path::Path;

use gpufeed::cuda::{
    Device, DeviceLoader, DeviceLoaderOptions, PinnedBacking, pinned_copy_ceiling,
};
use gpufeed::{Error, LoaderBuilder, Result};

use crate::bench::{Args, Report, print_device_report, progress};

/// Opens GPU `ordinal`, with a hint in the error when there is none.
fn open_device(ordinal: usize) -> Result<Device> {
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
    cfg: &gpufeed::transform::image::bench::ImageBenchConfig,
    ordinal: usize,
) -> Result<gpufeed::transform::image::bench::ImageBenchReport> {
    gpufeed::cuda::bench_images_device(path, cfg, &open_device(ordinal)?)
}

/// Runs the device bench; `builder` has every host setting already.
pub fn run(
    args: &Args,
    builder: LoaderBuilder,
    path: &Path,
    records: u64,
    generate_secs: f64,
    ordinal: usize,
) -> Result<()> {
    let device = open_device(ordinal)?;
    let loader = builder.backing(PinnedBacking::new(&device)).build()?;
    let workers = loader.stats().workers;
    let copy_bytes = loader.layout().total_bytes();
    // The ceiling: repeated copies of one pinned buffer of a batch's size, before any batch.
    let iterations = ((4usize << 30) / copy_bytes.max(1)).clamp(20, 2000);
    let ceiling = pinned_copy_ceiling(&device, copy_bytes, iterations)?;
    let per_epoch = args.max_batches.map_or(loader.batches_per_epoch(), |m| {
        m.min(loader.batches_per_epoch())
    });
    let mut feed = DeviceLoader::new(loader, &device, DeviceLoaderOptions::default())?;
    let consumer = device.new_stream()?;
    let bar = progress(per_epoch * args.epochs, "bench (device)", args.json);
    let mut epoch_rates = Vec::new();
    // Copy-stage counters (timed bytes, busy time) at the end of the first epoch.
    let mut after_first = None;
    for epoch in 0..args.epochs {
        if epoch > 0 {
            feed.set_epoch(epoch);
        }
        let (t0, mut bytes) = (std::time::Instant::now(), 0u64);
        // Run a whole epoch to its end (`None`) unless told to stop early: the copy stage reads
        // the last copies' timings at the end of an epoch.
        let limit = args.max_batches.map_or(usize::MAX, |_| per_epoch as usize);
        for batch in feed.by_ref().take(limit) {
            let mut batch = batch?;
            batch.wait_on(&consumer)?;
            bytes += batch.fields().map(|f| f.bytes() as u64).sum::<u64>();
            bar.inc(1);
        }
        consumer.synchronize().map_err(|e| Error::Cuda {
            op: "synchronize the consumer stream",
            what: e.to_string(),
        })?;
        epoch_rates.push(bytes as f64 / t0.elapsed().as_secs_f64().max(1e-9));
        if epoch == 0 {
            let s = feed.stats();
            after_first = Some((s.h2d_timed_bytes, s.h2d_busy));
        }
    }
    bar.finish_and_clear();
    device.synchronize()?;
    let stats = feed.stats();
    let host = stats.loader.clone();
    let report = Report {
        dataset: path.display().to_string(),
        records,
        sample_bytes: stats.bytes.checked_div(stats.samples).unwrap_or(0),
        batch_size: args.batch_size,
        workers,
        prefetch: args.prefetch.unwrap_or(2 * workers),
        epochs: args.epochs,
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
        steady_bytes_per_sec: gpufeed::loader::steady_rate(&epoch_rates),
        epoch_bytes_per_sec: epoch_rates,
        device: Some(format!("{} (ordinal {})", device.name(), device.ordinal())),
        generate_secs,
        ..Report::default()
    };
    print_device_report(args, &report, &stats.to_string())
}
