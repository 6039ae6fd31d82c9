//! [`bench_images`]: the image pipeline through the loader, timed (for `gpufeed bench --images`).

use std::path::Path;
use std::time::Instant;

use serde::Serialize;

use super::{ImageTransform, OnBadImage};
use crate::error::{Error, Result};
use crate::format::DType;
use crate::loader::Loader;
use crate::source::{self, AnySource, ImageFolder};

/// Settings of [`bench_images`].
#[derive(Clone, Debug)]
pub struct ImageBenchConfig {
    /// Worker threads.
    pub workers: usize,
    /// Images per batch.
    pub batch_size: usize,
    /// Output side (RandomResizedCrop(size) + flip).
    pub size: u32,
    /// Output dtype (u8 CHW, or f16/bf16/f32 normalised with ImageNet's statistics).
    pub dtype: DType,
    /// Stop after this many images (at most one epoch); `None`: one whole epoch.
    pub limit: Option<u64>,
    /// Shuffle seed.
    pub seed: u64,
    /// Skip bad images instead of failing.
    pub skip_bad: bool,
}

impl Default for ImageBenchConfig {
    fn default() -> Self {
        ImageBenchConfig {
            workers: std::thread::available_parallelism().map_or(1, |n| n.get()),
            batch_size: 128,
            size: 224,
            dtype: DType::U8,
            limit: None,
            seed: 0,
            skip_bad: false,
        }
    }
}

/// What [`bench_images`] measured.
#[derive(Clone, Debug, Serialize)]
pub struct ImageBenchReport {
    /// The directory or packed file read.
    pub source: String,
    /// `imagefolder` or `packed`.
    pub kind: &'static str,
    /// Images delivered.
    pub images: u64,
    /// Bad images skipped.
    pub skipped: u64,
    /// Seconds from the first request to the last batch.
    pub seconds: f64,
    /// Images per second.
    pub images_per_sec: f64,
    /// Images per second per worker thread.
    pub images_per_sec_per_worker: f64,
    /// Worker threads.
    pub workers: usize,
    /// Fraction of the time the consumer waited for data (≈ 1 here: nothing else runs).
    pub wait_fraction: f64,
}

impl std::fmt::Display for ImageBenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}): {} images in {:.2} s: {:.0} images/s, {:.0} per worker ({} workers), {} skipped",
            self.source,
            self.kind,
            self.images,
            self.seconds,
            self.images_per_sec,
            self.images_per_sec_per_worker,
            self.workers,
            self.skipped
        )
    }
}

/// Runs decode + RandomResizedCrop + flip over `path` (an ImageFolder directory, or a packed
/// file of images written by [`pack_image_folder`](crate::source::pack_image_folder)) through
/// the loader and reports images/s.
pub fn bench_images(path: &Path, cfg: &ImageBenchConfig) -> Result<ImageBenchReport> {
    let (dataset, kind): (AnySource, _) = if path.is_dir() {
        (Box::new(ImageFolder::open(path)?), "imagefolder")
    } else {
        (source::open(path)?, "packed")
    };
    let mut t = ImageTransform::train(cfg.size).dtype(cfg.dtype);
    if cfg.dtype != DType::U8 {
        t = t.normalize(super::Normalize::IMAGENET);
    }
    if cfg.skip_bad {
        t = t.on_bad_image(OnBadImage::Skip);
    }
    let t = t.build()?;
    let stats = t.stats();
    let loader = Loader::builder(dataset)
        .transform(t)
        .batch_size(cfg.batch_size)
        .shuffle(cfg.seed)
        .workers(cfg.workers)
        .shard(0, 1)
        .build()?;
    let mut images = 0u64;
    let mut loader = loader;
    let t0 = Instant::now();
    for batch in loader.by_ref() {
        images += batch?.len() as u64;
        if cfg.limit.is_some_and(|l| images >= l) {
            break;
        }
    }
    let seconds = t0.elapsed().as_secs_f64();
    if images == 0 {
        return Err(Error::mismatch(format!(
            "{}: no image to read",
            path.display()
        )));
    }
    let rate = images as f64 / seconds.max(1e-9);
    Ok(ImageBenchReport {
        source: path.display().to_string(),
        kind,
        images,
        skipped: stats.skipped(),
        seconds,
        images_per_sec: rate,
        images_per_sec_per_worker: rate / cfg.workers as f64,
        workers: cfg.workers,
        wait_fraction: loader.stats().wait_fraction(),
    })
}
