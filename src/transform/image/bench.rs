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
}

impl Default for ImageBenchConfig {
    fn default() -> Self {
        ImageBenchConfig {
            workers: std::thread::available_parallelism().map_or(1, |n| n.get()),
            batch_size: 128,
            size: 224,
            dtype: DType::U8,
            epochs: 1,
            drop_last: false,
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
    /// Images delivered, all epochs.
    pub images: u64,
    /// Epochs run (the last one may have been cut short by the limit).
    pub epochs: u64,
    /// Bad images skipped.
    pub skipped: u64,
    /// Seconds from the first request to the last batch.
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
    if cfg.epochs == 0 {
        return Err(Error::InvalidConfig {
            setting: "epochs",
            what: "the image bench needs at least one epoch".to_owned(),
        });
    }
    let mut loader = Loader::builder(dataset)
        .transform(t)
        .batch_size(cfg.batch_size)
        .shuffle(cfg.seed)
        .drop_last(cfg.drop_last)
        .workers(cfg.workers)
        .shard(0, 1)
        .build()?;
    let (mut images, mut epochs, mut epoch_rates) = (0u64, 0u64, Vec::new());
    let t0 = Instant::now();
    'run: for epoch in 0..cfg.epochs {
        if epoch > 0 {
            loader.set_epoch(epoch);
        }
        epochs += 1;
        let (start, mut n) = (Instant::now(), 0u64);
        for batch in loader.by_ref() {
            n += batch?.len() as u64;
            if cfg.limit.is_some_and(|l| images + n >= l) {
                images += n;
                break 'run;
            }
        }
        images += n;
        epoch_rates.push(n as f64 / start.elapsed().as_secs_f64().max(1e-9));
    }
    let seconds = t0.elapsed().as_secs_f64();
    if images == 0 {
        return Err(Error::mismatch(format!(
            "{}: no image to read",
            path.display()
        )));
    }
    // Equal images per epoch: the later epochs' overall rate is their rates' harmonic mean.
    let steady = epoch_rates
        .get(1..)
        .filter(|r| !r.is_empty())
        .map(|r| r.len() as f64 / r.iter().map(|x| 1.0 / x.max(1e-9)).sum::<f64>());
    let rate = images as f64 / seconds.max(1e-9);
    Ok(ImageBenchReport {
        source: path.display().to_string(),
        kind,
        images,
        epochs,
        skipped: stats.skipped(),
        seconds,
        images_per_sec: rate,
        epoch_images_per_sec: epoch_rates,
        steady_images_per_sec: steady,
        images_per_sec_per_worker: rate / cfg.workers as f64,
        workers: cfg.workers,
        wait_fraction: loader.stats().wait_fraction(),
    })
}
