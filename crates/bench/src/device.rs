//! The whole path to the GPU, measured: [`bench_device`] (raw batches, `gpufeed bench
//! --device N`) and [`bench_images_device`] (the image pipeline, `gpufeed bench --images
//! --device N`). Both synchronise the host: they are measurements, not the hot path.

use gpufeed::BatchStream;
use std::sync::Arc;

use gpufeed::cuda::CudaStream;
use gpufeed::cuda::{
    Convert, Device, DeviceLoader, DeviceLoaderOptions, PinnedBacking, pinned_copy_ceiling,
};
use gpufeed::format::DType;
use gpufeed::loader::{LoaderBuilder, LoaderStats};
use gpufeed::memory::PoolStats;
use gpufeed::transform::image::Layout;
use gpufeed::{Error, Result};
use serde::Serialize;

use crate::images::{EpochSource, EpochTimes, ImageBenchConfig, ImageBenchReport, ImageBenchSetup};

/// Waits for everything enqueued on the consumer stream.
fn synchronize(stream: &CudaStream) -> Result<()> {
    stream.synchronize().map_err(|source| Error::Driver {
        op: "synchronize the consumer stream",
        source,
    })
}

/// What [`bench_device`] measured. Serializable for `gpufeed bench --device N --json`.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceBenchReport {
    /// The device's name.
    pub device: String,
    /// Its ordinal.
    pub ordinal: usize,
    /// Device batches consumed.
    pub batches: u64,
    /// Samples consumed.
    pub samples: u64,
    /// Bytes of batch fields delivered to the device.
    pub bytes: u64,
    /// Seconds from the first batch asked for to the consumer stream's last wait done.
    pub elapsed_s: f64,
    /// End to end (mapped files to device memory) bytes per second.
    pub bytes_per_sec: f64,
    /// Bytes of the copies (whole batch buffers).
    pub h2d_bytes: u64,
    /// Copy-engine seconds of the timed copies.
    pub h2d_busy_s: f64,
    /// The copy stage's bytes per second of copy time.
    pub h2d_bytes_per_sec: f64,
    /// The pinned-copy ceiling of the same run, copies of the same size.
    pub h2d_ceiling_bytes_per_sec: f64,
    /// `h2d_bytes_per_sec / h2d_ceiling_bytes_per_sec`.
    pub h2d_fraction_of_ceiling: f64,
    /// The fraction of the consumer's time spent waiting for a batch.
    pub consumer_wait_fraction: f64,
    /// The device pool at the end.
    pub device_pool: PoolStats,
    /// The host loader's figures, as seen by the copy thread.
    pub loader: Option<LoaderStats>,
}

/// Runs the whole path on `device`: builds `builder` with pinned buffers, measures the
/// pinned-copy ceiling at the batch buffer's size (before any batch is made), then consumes up
/// to `max_batches` device batches (all of one epoch if `None`) on a consumer stream that waits
/// on each copy, and reports.
pub fn bench_device(
    builder: LoaderBuilder,
    device: &Device,
    opts: DeviceLoaderOptions,
    max_batches: Option<u64>,
) -> Result<DeviceBenchReport> {
    let loader = builder.backing(PinnedBacking::new(device)).build()?;
    let copy_bytes = loader.layout().total_bytes();
    let iterations = ((4usize << 30) / copy_bytes.max(1)).clamp(20, 2000);
    let ceiling = pinned_copy_ceiling(device, copy_bytes, iterations)?;
    let mut dl = DeviceLoader::new(loader, device, opts)?;
    let stream = device.new_stream()?;
    let limit = max_batches.unwrap_or(u64::MAX);
    let mut taken = 0u64;
    while taken < limit {
        match dl.next() {
            Some(batch) => {
                let batch = batch?;
                batch.wait_on(&stream)?;
                taken += 1;
            }
            None => break,
        }
    }
    synchronize(&stream)?;
    let stats = dl.stats();
    let h2d = stats.h2d_bytes_per_sec();
    Ok(DeviceBenchReport {
        device: device.name().to_owned(),
        ordinal: device.ordinal(),
        batches: stats.batches,
        samples: stats.samples,
        bytes: stats.bytes,
        elapsed_s: stats.elapsed.as_secs_f64(),
        bytes_per_sec: stats.bytes_per_sec(),
        h2d_bytes: stats.h2d_bytes,
        h2d_busy_s: stats.h2d_busy.as_secs_f64(),
        h2d_bytes_per_sec: h2d,
        h2d_ceiling_bytes_per_sec: ceiling,
        h2d_fraction_of_ceiling: if ceiling > 0.0 { h2d / ceiling } else { 0.0 },
        consumer_wait_fraction: stats.wait_fraction(),
        device_pool: stats.device_pool,
        loader: stats.loader,
    })
}

/// [`bench_images`](crate::images::bench_images) through the GPU path on
/// `device`: the workers decode, crop, resize and flip into u8 CHW batches in pinned buffers
/// (half the bytes of f16), the copy thread moves each batch to the device and, unless
/// `cfg.dtype` is u8, converts it there to `cfg.dtype` normalised with ImageNet's mean and std
/// ([`Convert::imagenet`](gpufeed::cuda::Convert::imagenet)); the consumer waits on every batch on a
/// stream of its own. Images/s are counted when the consumer stream has them.
pub fn bench_images_device(
    path: &std::path::Path,
    cfg: &ImageBenchConfig,
    device: &Device,
) -> Result<ImageBenchReport> {
    /// Device batches, each waited for on the consumer stream.
    struct Feed {
        loader: DeviceLoader,
        consumer: Arc<CudaStream>,
        /// The loader's figures when made and at the end of each epoch.
        stats: Vec<gpufeed::cuda::DeviceStats>,
        /// When the loader was made, and how long after it the first batch was on the device.
        started: std::time::Instant,
        first_ms: Option<f64>,
    }

    impl EpochSource for Feed {
        fn start_epoch(&mut self, epoch: u64) -> Result<()> {
            self.loader.set_epoch(epoch);
            Ok(())
        }

        fn next_batch(&mut self) -> Option<Result<(u64, u64)>> {
            let batch = self.loader.next()?;
            Some(batch.and_then(|b| {
                b.wait_on(&self.consumer)?;
                if self.first_ms.is_none() {
                    synchronize(&self.consumer)?;
                    self.first_ms = Some(self.started.elapsed().as_secs_f64() * 1e3);
                }
                Ok((b.len() as u64, b.skipped() as u64))
            }))
        }

        fn end_epoch(&mut self) -> Result<()> {
            synchronize(&self.consumer)?;
            self.stats.push(self.loader.stats());
            Ok(())
        }
    }

    let on_gpu = cfg.decode != gpufeed::transform::image::Decode::Cpu;
    // The CPU decode writes u8 (converted on the device); the GPU decode writes the dtype.
    let setup = ImageBenchSetup::new(path, cfg, if on_gpu { cfg.dtype } else { DType::U8 })?;
    // Timed from the loader's creation, pinned buffers and copy thread included.
    let started = std::time::Instant::now();
    let feed = if on_gpu {
        DeviceLoader::from_builder(setup.builder, device, DeviceLoaderOptions::default())?
    } else {
        let loader = setup.builder.backing(PinnedBacking::new(device)).build()?;
        let mut opts = DeviceLoaderOptions::default();
        if cfg.dtype != DType::U8 {
            opts = opts.convert(Convert::imagenet("image", Layout::Chw, cfg.dtype));
        }
        DeviceLoader::new(loader, device, opts)?
    };
    let mut feed = Feed {
        stats: vec![feed.stats()],
        loader: feed,
        consumer: device.new_stream()?,
        started,
        first_ms: None,
    };
    let times = EpochTimes::measure(cfg, started, &mut feed)?;
    let stats = feed.loader.stats();
    let skipped = times.skipped;
    let decode_report = feed.loader.decode_report();
    // The host loader's figures, with the consumer's wait: the device batches' consumer.
    let mut host = stats.loader.clone().ok_or(Error::Shutdown)?;
    (host.waited, host.elapsed) = (stats.waited, stats.elapsed);
    let mut report = ImageBenchReport::new(
        path,
        setup.kind,
        cfg,
        times,
        skipped,
        &host,
        Some(format!("{} (ordinal {})", device.name(), device.ordinal())),
    )?;
    if decode_report.is_some() {
        report.decode = "gpu";
    }
    report.decode_report = decode_report;
    report.device_stats = feed.stats;
    report.first_device_batch_ms = feed.first_ms;
    report.verdict = stats.verdict().map(|v| v.to_string());
    Ok(report)
}
