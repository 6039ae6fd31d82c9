//! [`bench_images`]: the image pipeline through the loader, timed (for `gpufeed bench --images`;
//! `gpufeed bench --images --device N` runs the same through the GPU path,
//! `cuda::bench_images_device`).

use gpufeed::BatchStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use serde::Serialize;

use gpufeed::format::DType;
use gpufeed::loader::{Loader, LoaderBuilder, LoaderStats, Setting, Tuning};
use gpufeed::source;
use gpufeed::trace::Trace;
use gpufeed::transform::image::{ImageTransform, OnBadImage, default_image_fields};
use gpufeed::{Error, Result};

/// Settings of [`bench_images`].
#[derive(Clone, Debug)]
pub struct ImageBenchConfig {
    /// Worker threads, or [`Setting::Auto`]: chosen by the loader.
    pub workers: Setting,
    /// Images per batch.
    pub batch_size: usize,
    /// Output side (RandomResizedCrop(size) + flip).
    pub size: u32,
    /// Output dtype (u8 CHW, or f16/bf16/f32 normalised with ImageNet's statistics).
    pub dtype: DType,
    /// Epochs to run, back to back (the loader makes the next epoch's first batches while the
    /// last ones of the current epoch are delivered).
    pub epochs: u64,
    /// Drop each epoch's last short batch (as PyTorch's `drop_last=True`).
    pub drop_last: bool,
    /// Stop after this many images in all; `None`: every epoch to its end.
    pub limit: Option<u64>,
    /// Shuffle seed.
    pub seed: u64,
    /// Skip bad images instead of failing.
    pub skip_bad: bool,
    /// The most pixels an image may declare
    /// ([`ImageTransformBuilder::max_pixels`](gpufeed::transform::image::ImageTransformBuilder::max_pixels));
    /// `None`: the transform's default.
    pub max_pixels: Option<u64>,
    /// Shuffle (with `seed`) or read in order.
    pub shuffle: bool,
    /// Batches in flight (`None`: the loader's default).
    pub prefetch: Option<Setting>,
    /// Parts each batch is made in (`None`: the loader's default,
    /// [`LoaderBuilder::batch_parts`](gpufeed::LoaderBuilder::batch_parts)).
    pub parts: Option<Setting>,
    /// Records the run's timeline on this trace.
    pub trace: Option<Trace>,
    /// Stop each epoch after this many batches; `None`: every epoch to its end.
    pub max_batches: Option<u64>,
    /// The field of encoded images (`None`: the data set's by
    /// [`default_image_fields`]: `image`, or
    /// its one field of JPEG or PNG bytes).
    pub image_field: Option<String>,
    /// The field of integer labels (`None`: `label`, else `cls`, where there is one; else no
    /// label).
    pub label_field: Option<String>,
    /// Check every record of a packed file against its checksum as it is read
    /// ([`ReadOptions::verify_checksums`](gpufeed::format::ReadOptions::verify_checksums)), a
    /// sharded data set's shards against its index each time one is opened
    /// ([`ShardOptions::verify`](gpufeed::source::shards::ShardOptions::verify)); an image
    /// folder has no checksums, and refuses it.
    pub verify_checksums: bool,
    /// How a packed file is read: mapped (the default) or at offsets
    /// ([`ReadMode`](gpufeed::format::ReadMode)); an image folder's files are read whole.
    pub read_mode: gpufeed::format::ReadMode,
    /// Once set (by a signal's handler, say), the run stops after the batch it is on and
    /// reports what ran; `None`: every epoch to its end.
    pub stop: Option<&'static AtomicBool>,
    /// Where JPEGs are decoded (the GPU decode needs the device bench).
    pub decode: gpufeed::transform::image::Decode,
    /// With the GPU decode, the workers' share of the GPU-decodable JPEGs (`None`: measured).
    pub cpu_share: Option<f64>,
}

impl Default for ImageBenchConfig {
    fn default() -> Self {
        ImageBenchConfig {
            workers: Setting::Fixed(std::thread::available_parallelism().map_or(1, |n| n.get())),
            batch_size: 128,
            size: 224,
            dtype: DType::U8,
            epochs: 1,
            drop_last: false,
            limit: None,
            seed: 0,
            skip_bad: false,
            max_pixels: None,
            shuffle: true,
            prefetch: None,
            parts: None,
            max_batches: None,
            image_field: None,
            label_field: None,
            verify_checksums: false,
            read_mode: gpufeed::format::ReadMode::Map,
            stop: None,
            decode: gpufeed::transform::image::Decode::Cpu,
            cpu_share: None,
            trace: None,
        }
    }
}

/// What [`bench_images`] measured.
#[derive(Clone, Debug, Serialize)]
pub struct ImageBenchReport {
    /// The directory or packed file read.
    pub source: String,
    /// The data set's format (`imagefolder`, `packed`, `webdataset tar`, `parquet`, ...).
    pub kind: &'static str,
    /// Images delivered, all epochs.
    pub images: u64,
    /// Epochs run (the last one may have been cut short by the limit).
    pub epochs: u64,
    /// Bad images skipped.
    pub skipped: u64,
    /// Seconds from the loader's creation to the last batch.
    pub seconds: f64,
    /// Images per second over the whole run, start-up included.
    pub images_per_sec: f64,
    /// Images per second of each epoch, in order. The first one includes start-up (threads,
    /// buffer allocation, cold caches): it is what a one-epoch measurement, such as
    /// `torch_baseline.py`'s, sees.
    pub epoch_images_per_sec: Vec<f64>,
    /// Images per second over the epochs after the first (with 2 epochs or more): the rate a
    /// training run sustains.
    pub steady_images_per_sec: Option<f64>,
    /// Images per second per worker thread.
    pub images_per_sec_per_worker: f64,
    /// Worker threads.
    pub workers: usize,
    /// Fraction of the time the consumer waited for data (≈ 1 here: nothing else runs).
    pub wait_fraction: f64,
    /// The GPU the batches were copied to (and converted on), if any.
    pub device: Option<String>,
    /// Where the JPEGs were decoded: `cpu`, or `gpu` (nvJPEG and the resize kernels).
    pub decode: &'static str,
    /// The GPU decode stage's figures (`bench --json`'s stage times of the decode).
    #[cfg(feature = "cuda")]
    pub decode_report: Option<gpufeed::cuda::nvjpeg::DecodeReport>,
    /// On a device: the device loader's figures when it was made and at the end of each
    /// epoch, whose differences are the epochs' stage times (the command's `epoch_details`).
    #[cfg(feature = "cuda")]
    #[serde(skip)]
    pub device_stats: Vec<gpufeed::cuda::DeviceStats>,
    /// Device runs: milliseconds from the loader's creation to the first batch on the
    /// device (the consumer stream synchronised on it).
    pub first_device_batch_ms: Option<f64>,
    /// Images delivered when, from the loader's creation (for a plot).
    pub timeline: crate::Timeline,
    /// Whether the consumer waited, what bound the rate, what would help (one line).
    pub verdict: Option<String>,
    /// The settings the loader chose, if it chose any, and why.
    pub tuning: Option<Tuning>,
    /// The batches in flight and the parts of each, as the loader ran at the end.
    pub prefetch: usize,
    /// Parts each batch was made in at the end.
    pub batch_parts: usize,
}

impl std::fmt::Display for ImageBenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}): {} images in {:.2} s ({} epochs): {:.0} images/s, {:.0} per worker ({} workers), {} skipped",
            self.source,
            self.kind,
            self.images,
            self.seconds,
            self.epochs,
            self.images_per_sec,
            self.images_per_sec_per_worker,
            self.workers,
            self.skipped
        )?;
        if let Some(device) = &self.device {
            write!(f, ", to {device}")?;
        }
        write!(f, ", decoded on the {}", self.decode.to_uppercase())?;
        if self.epoch_images_per_sec.len() > 1 {
            let rates: Vec<String> = self
                .epoch_images_per_sec
                .iter()
                .map(|r| format!("{r:.0}"))
                .collect();
            write!(f, "\nper epoch (images/s): {}", rates.join(", "))?;
        }
        if let Some(steady) = self.steady_images_per_sec {
            write!(
                f,
                "\nsteady state (epochs after the first): {steady:.0} images/s, {:.0} per worker",
                steady / self.workers as f64
            )?;
        }
        Ok(())
    }
}

/// Runs decode + RandomResizedCrop + flip over `path` (an ImageFolder directory, a packed
/// file of images written by [`pack_image_folder`](gpufeed::source::pack_image_folder), or a
/// sharded data set with an image field: WebDataset `jpg`/`png` members, an MDS `jpeg`/`png`
/// column; local or a URL) through the loader and reports images/s.
pub fn bench_images(path: &Path, cfg: &ImageBenchConfig) -> Result<ImageBenchReport> {
    if cfg.decode == gpufeed::transform::image::Decode::Gpu {
        return Err(Error::InvalidConfig {
            setting: "decode",
            what: "the GPU decode runs on a device: give the bench a device".into(),
        });
    }
    let setup = ImageBenchSetup::new(path, cfg, cfg.dtype)?;
    // Timed from the loader's creation (its threads start in `build`), as a DataLoader's first
    // epoch is timed from `iter()`, which starts its worker processes.
    let started = Instant::now();
    let mut loader = setup.builder.build()?;
    let times = EpochTimes::measure(cfg, started, &mut loader)?;
    let stats = loader.stats();
    let skipped = times.skipped;
    let (prefetch, parts) = (loader.prefetch(), loader.batch_parts());
    let mut report = ImageBenchReport::new(path, setup.kind, cfg, times, skipped, &stats, None)?;
    report.verdict = Some(stats.verdict().to_string());
    (report.prefetch, report.batch_parts) = (prefetch, parts);
    Ok(report)
}

/// The source and loader settings of an image bench.
pub(crate) struct ImageBenchSetup {
    /// Every loader setting but the backing.
    pub builder: LoaderBuilder,
    /// The data set's format (`imagefolder`, `packed`, `webdataset tar`, `parquet`, ...).
    pub kind: &'static str,
}

impl ImageBenchSetup {
    /// Opens `path` and sets up RandomResizedCrop(`cfg.size`) + flip to `dtype` in CHW
    /// (normalised with ImageNet's statistics unless u8).
    pub fn new(path: &Path, cfg: &ImageBenchConfig, dtype: DType) -> Result<ImageBenchSetup> {
        if cfg.epochs == 0 {
            return Err(Error::InvalidConfig {
                setting: "epochs",
                what: "the image bench needs at least one epoch".to_owned(),
            });
        }
        let options = source::OpenOptions::read(gpufeed::format::ReadOptions {
            mode: cfg.read_mode,
            verify_checksums: cfg.verify_checksums,
        });
        let dataset = source::open(path, &options)?;
        let kind = dataset.format().name();
        let mut t = ImageTransform::train(cfg.size)
            .dtype(dtype)
            .decode(cfg.decode)
            .cpu_share(cfg.cpu_share);
        let (image, label) = default_image_fields(dataset.schema());
        let image = cfg.image_field.clone().or(image).ok_or_else(|| Error::InvalidConfig {
            setting: "image_field",
            what: format!(
                "the data set has no `image` field and not one field of JPEG or PNG bytes to take for it: name it [{}]",
                dataset.schema()
            ),
        })?;
        t = t.image_field(image);
        // A bench needs no labels: unlabelled data is read as it is.
        t = t.label_field(cfg.label_field.clone().or(label).as_deref());
        if dtype != DType::U8 {
            t = t.normalize(gpufeed::transform::image::Normalize::IMAGENET);
        }
        if cfg.skip_bad {
            t = t.on_bad_image(OnBadImage::Skip);
        }
        if let Some(pixels) = cfg.max_pixels {
            t = t.max_pixels(pixels);
        }
        let t = t.build()?;
        let mut builder = Loader::builder(dataset)
            .transform(t)
            .batch_size(cfg.batch_size)
            .drop_last(cfg.drop_last)
            .workers(cfg.workers)
            .shard(0, 1);
        if cfg.shuffle {
            builder = builder.shuffle(cfg.seed);
        }
        if let Some(prefetch) = cfg.prefetch {
            builder = builder.prefetch(prefetch);
        }
        if let Some(parts) = cfg.parts {
            builder = builder.batch_parts(parts);
        }
        if let Some(trace) = &cfg.trace {
            builder = builder.trace(trace);
        }
        Ok(ImageBenchSetup { builder, kind })
    }
}

/// Where an image bench takes its batches from: the loader, or the GPU path.
pub(crate) trait EpochSource {
    /// Starts epoch `epoch` (called before every epoch after the first).
    fn start_epoch(&mut self, epoch: u64) -> Result<()>;
    /// The next batch's image count and the images of it skipped as bad, `None` at the end
    /// of the epoch.
    fn next_batch(&mut self) -> Option<Result<(u64, u64)>>;
    /// Waits until the epoch's batches are where the consumer uses them (before the epoch's
    /// time is taken); nothing to wait for on the host.
    fn end_epoch(&mut self) -> Result<()> {
        Ok(())
    }
}

impl EpochSource for Loader {
    fn start_epoch(&mut self, epoch: u64) -> Result<()> {
        self.set_epoch(epoch);
        Ok(())
    }

    fn next_batch(&mut self) -> Option<Result<(u64, u64)>> {
        self.next()
            .map(|b| b.map(|b| (b.len() as u64, b.skipped() as u64)))
    }
}

/// What the epochs of an image bench took.
pub(crate) struct EpochTimes {
    images: u64,
    /// Bad images skipped in the batches delivered.
    pub skipped: u64,
    epochs: u64,
    seconds: f64,
    rates: Vec<f64>,
    timeline: crate::Timeline,
}

impl EpochTimes {
    /// Runs up to `cfg.epochs` epochs of `source` (each cut after `cfg.max_batches` batches),
    /// until `cfg.limit` images or `cfg.stop`; times each epoch and the whole, the first epoch
    /// and the whole from `started` (when the source was made).
    pub fn measure(
        cfg: &ImageBenchConfig,
        started: Instant,
        source: &mut impl EpochSource,
    ) -> Result<EpochTimes> {
        let (mut images, mut epochs, mut rates) = (0u64, 0u64, Vec::new());
        let mut skipped = 0u64;
        let mut timeline = crate::Timeline::default();
        'run: for epoch in 0..cfg.epochs {
            if epoch > 0 {
                source.start_epoch(epoch)?;
            }
            epochs += 1;
            let begin = if epoch == 0 { started } else { Instant::now() };
            timeline.epoch(begin.duration_since(started).as_secs_f64());
            let (mut n, mut batches) = (0u64, 0u64);
            while cfg.max_batches.is_none_or(|m| batches < m) {
                let Some(batch) = source.next_batch() else {
                    break;
                };
                let (len, bad) = batch?;
                timeline.batch(started.elapsed().as_secs_f64(), len as f64);
                n += len;
                skipped += bad;
                batches += 1;
                let stopped = cfg.stop.is_some_and(|s| s.load(Ordering::Relaxed));
                if stopped || cfg.limit.is_some_and(|l| images + n >= l) {
                    source.end_epoch()?;
                    images += n;
                    break 'run;
                }
            }
            source.end_epoch()?;
            images += n;
            rates.push(n as f64 / begin.elapsed().as_secs_f64().max(1e-9));
        }
        Ok(EpochTimes {
            images,
            skipped,
            epochs,
            seconds: started.elapsed().as_secs_f64(),
            rates,
            timeline,
        })
    }
}

impl ImageBenchReport {
    /// The report of a run; an error if it delivered no image.
    pub(crate) fn new(
        path: &Path,
        kind: &'static str,
        cfg: &ImageBenchConfig,
        times: EpochTimes,
        skipped: u64,
        stats: &LoaderStats,
        device: Option<String>,
    ) -> Result<ImageBenchReport> {
        if times.images == 0 {
            return Err(Error::Mismatch {
                what: format!("{}: no image to read", path.display()),
            });
        }
        let steady = crate::steady_rate(&times.rates);
        let rate = times.images as f64 / times.seconds.max(1e-9);
        Ok(ImageBenchReport {
            source: path.display().to_string(),
            kind,
            images: times.images,
            epochs: times.epochs,
            skipped,
            seconds: times.seconds,
            images_per_sec: rate,
            epoch_images_per_sec: times.rates,
            steady_images_per_sec: steady,
            images_per_sec_per_worker: rate / stats.workers.max(1) as f64,
            workers: stats.workers,
            wait_fraction: stats.wait_fraction(),
            device,
            decode: "cpu",
            #[cfg(feature = "cuda")]
            decode_report: None,
            #[cfg(feature = "cuda")]
            device_stats: Vec::new(),
            first_device_batch_ms: None,
            timeline: times.timeline,
            verdict: None,
            tuning: stats.tuning.clone(),
            prefetch: cfg.prefetch.and_then(fixed).unwrap_or(0),
            batch_parts: cfg.parts.and_then(fixed).unwrap_or(0),
        })
    }
}

/// The number a setting fixes, if it does.
fn fixed(setting: Setting) -> Option<usize> {
    match setting {
        Setting::Fixed(n) => Some(n),
        Setting::Auto => None,
    }
}
