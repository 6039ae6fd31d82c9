//! `gpufeed bench`: the loader end to end, on an embedded default data set or a named one.
//!
//! With no dataset argument it writes the default (8,192 records of 3x224x224 u8 and a u32
//! label, as a packed file in a temporary directory removed afterwards), warms the page cache,
//! and runs the loader over it. `--baseline` also runs a plain multi-threaded memcpy gather
//! of the same records in the same order, in the same run, and prints the ratio.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use gpufeed::format::{DType, Field, RecordWriter, Schema};
use gpufeed::memory::human_bytes;
use gpufeed::source::{self, Dataset};
use gpufeed::{Error, Loader, LoaderStats, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

/// Arguments of `gpufeed bench`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A packed record file or a .npy array; without it, an embedded default is generated.
    pub dataset: Option<PathBuf>,
    /// Records in the generated default data set.
    #[arg(long, default_value_t = 8192)]
    pub records: u64,
    /// Bytes of each generated record's data field (150528 = 3x224x224).
    #[arg(long, default_value_t = 150_528)]
    pub record_bytes: u64,
    /// Samples per batch.
    #[arg(long, default_value_t = 256)]
    pub batch_size: usize,
    /// Worker threads (default: the available parallelism, at most 16).
    #[arg(long)]
    pub workers: Option<usize>,
    /// Batches in flight (default: twice the workers).
    #[arg(long)]
    pub prefetch: Option<usize>,
    /// Shuffle seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Epochs to run (each over the whole data set).
    #[arg(long, default_value_t = 3)]
    pub epochs: u64,
    /// Sequential order instead of a seeded shuffle.
    #[arg(long)]
    pub no_shuffle: bool,
    /// Stop each epoch after this many batches (for quick runs over huge data sets).
    #[arg(long)]
    pub max_batches: Option<u64>,
    /// Drop the last short batch.
    #[arg(long)]
    pub drop_last: bool,
    /// Also measure a plain memcpy gather of the same records, in the same order, with as many
    /// threads as workers, and report the loader's share of it.
    #[arg(long)]
    pub baseline: bool,
    /// Copy each batch to this GPU (needs the `cuda` feature) and measure the pinned-copy ceiling.
    #[arg(long)]
    pub device: Option<usize>,
    /// Run the image pipeline (decode + RandomResizedCrop + flip) over an ImageFolder
    /// directory or a packed file of images, instead of raw records.
    #[arg(long, value_name = "DIR|PACKED")]
    pub images: Option<PathBuf>,
    /// Output side of the image pipeline's crops.
    #[arg(long, default_value_t = 224)]
    pub image_size: u32,
    /// Output dtype of the image pipeline: u8, f16, bf16 or f32 (normalised with ImageNet's
    /// mean and std unless u8).
    #[arg(long, default_value = "u8")]
    pub image_dtype: String,
    /// Stop the image pipeline after this many images (all epochs together).
    #[arg(long)]
    pub limit: Option<u64>,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Check every record of a packed file against its stored checksum as it is read (a record
    /// whose bytes changed is an error, never data); measures what verification costs.
    #[arg(long)]
    pub verify: bool,
}

/// What `gpufeed bench --json` prints.
#[derive(Serialize, Debug, Default)]
pub struct Report {
    /// The data set read (a temporary path for the embedded default).
    pub dataset: String,
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
    /// Epochs run.
    pub epochs: u64,
    /// Shuffled or not.
    pub shuffle: bool,
    /// Samples delivered per second (all epochs, first batch included).
    pub samples_per_sec: f64,
    /// Batch bytes delivered per second.
    pub bytes_per_sec: f64,
    /// Milliseconds from `build()` to the first batch.
    pub first_batch_ms: f64,
    /// Fraction of the consumer's time spent waiting for data.
    pub wait_fraction: f64,
    /// Bytes the batch pool reserved at the end.
    pub pool_reserved_bytes: u64,
    /// The most the batch pool reserved.
    pub pool_peak_bytes: u64,
    /// The plain gather's bytes per second (with `--baseline`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline_bytes_per_sec: Option<f64>,
    /// Batch bytes per second over the epochs after the first (with 2 epochs or more): the
    /// steady state, once the mapping's pages are mapped and the pool's buffers allocated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steady_bytes_per_sec: Option<f64>,
    /// `steady_bytes_per_sec / baseline_bytes_per_sec` (with `--baseline`; the gather runs
    /// after the loader, over pages the loader has mapped, so it is compared with the loader's
    /// steady state).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline_ratio: Option<f64>,
    /// Host-to-device bytes per second of the copy stage (with `--device`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub h2d_bytes_per_sec: Option<f64>,
    /// The copy stage's bytes per second over the epochs after the first (with `--device`
    /// and 2 epochs or more): the first epoch's copies read freshly pinned memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub h2d_steady_bytes_per_sec: Option<f64>,
    /// Pinned host-to-device copy ceiling measured in the same run (with `--device`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub h2d_ceiling_bytes_per_sec: Option<f64>,
    /// The GPU (with `--device`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// Batch bytes per second of each epoch, in order (the first one pays for page faults and
    /// buffer allocation; later ones show the steady state).
    pub epoch_bytes_per_sec: Vec<f64>,
    /// Seconds spent writing the generated data set (not part of the figures).
    pub generate_secs: f64,
}

/// A generated data set in a temporary directory, removed on drop.
struct TempData {
    dir: PathBuf,
    file: PathBuf,
}

impl Drop for TempData {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Writes the default data set: `records` records of `record_bytes` pseudo-random bytes and
/// a u32 label. 150528-byte records get the shape [3, 224, 224].
fn generate(records: u64, record_bytes: u64, quiet: bool) -> Result<TempData> {
    if records == 0 || record_bytes == 0 {
        return Err(Error::InvalidConfig {
            setting: "records",
            what: "--records and --record-bytes must be at least 1".into(),
        });
    }
    let dir = std::env::temp_dir().join(format!("gpufeed-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| Error::Io {
        path: dir.clone(),
        op: "create directory",
        source: e,
    })?;
    let data = TempData {
        file: dir.join("default.gfd"),
        dir,
    };
    let shape: Vec<u64> = if record_bytes == 3 * 224 * 224 {
        vec![3, 224, 224]
    } else {
        vec![record_bytes]
    };
    let schema = Schema::new(vec![
        Field::tensor("image", DType::U8, &shape),
        Field::tensor("label", DType::U32, &[]),
    ])
    .map_err(|what| Error::InvalidConfig {
        setting: "record_bytes",
        what,
    })?;
    let mut w = RecordWriter::create(&data.file, schema)?;
    let bar = progress(records, "writing the default data set", quiet);
    let mut buf = vec![0u8; record_bytes as usize];
    let mut state = 0x2545_f491_4f6c_dd1du64;
    for i in 0..records {
        for chunk in buf.chunks_mut(8) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            chunk.copy_from_slice(&state.to_le_bytes()[..chunk.len()]);
        }
        w.append(&[&buf, &((i % 1000) as u32).to_le_bytes()])?;
        bar.inc(1);
    }
    w.finish()?;
    bar.finish_and_clear();
    Ok(data)
}

/// A progress bar on stderr, hidden for `--json` or when stderr is not a terminal.
pub fn progress(len: u64, message: &'static str, quiet: bool) -> ProgressBar {
    if quiet || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} ({per_sec}, {eta})")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(message);
    bar
}

/// Reads a file once so that its pages are in the page cache, as PyTorch's baseline does.
fn warm_page_cache(path: &Path) -> Result<()> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        op: "open",
        source: e,
    })?;
    let mut buf = vec![0u8; 64 << 20];
    loop {
        match f.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e) => {
                return Err(Error::Io {
                    path: path.to_path_buf(),
                    op: "read",
                    source: e,
                });
            }
        }
    }
}

/// Runs `gpufeed bench`.
pub fn run(args: Args) -> Result<()> {
    if args.device.is_some() && !cfg!(feature = "cuda") {
        return Err(Error::NoGpu {
            what: "this gpufeed was built without the `cuda` feature (cargo build --release --features cuda); \
                   run without --device for the host-only figures"
                .into(),
        });
    }
    if let Some(images) = &args.images {
        return run_images(&args, images);
    }
    let t_gen = Instant::now();
    // `_generated` removes the default data set when the bench returns.
    let (path, _generated) = match &args.dataset {
        Some(p) => (p.clone(), None),
        None => {
            let g = generate(args.records, args.record_bytes, args.json)?;
            (g.file.clone(), Some(g))
        }
    };
    let generate_secs = if args.dataset.is_none() {
        t_gen.elapsed().as_secs_f64()
    } else {
        0.0
    };
    warm_page_cache(&path)?;
    let options = gpufeed::format::ReadOptions {
        verify_checksums: args.verify,
        ..Default::default()
    };
    let dataset: Arc<dyn Dataset> = Arc::from(source::open_with(&path, options)?);
    let workers = args.workers.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map_or(2, |n| n.get())
            .min(16)
    });
    let prefetch = args.prefetch.unwrap_or(2 * workers);
    let mut builder = Loader::builder_shared(Arc::clone(&dataset))
        .batch_size(args.batch_size)
        .workers(workers)
        .prefetch(prefetch)
        .drop_last(args.drop_last)
        .shard(0, 1);
    if !args.no_shuffle {
        builder = builder.shuffle(args.seed);
    }

    #[cfg(feature = "cuda")]
    if let Some(ordinal) = args.device {
        return crate::bench_cuda::run(
            &args,
            builder,
            &path,
            dataset.len(),
            generate_secs,
            ordinal,
        );
    }

    let mut loader = builder.build()?;
    let per_epoch = args.max_batches.map_or(loader.batches_per_epoch(), |m| {
        m.min(loader.batches_per_epoch())
    });
    let bar = progress(per_epoch * args.epochs, "bench", args.json);
    let mut epoch_rates = Vec::new();
    for epoch in 0..args.epochs {
        if epoch > 0 {
            loader.set_epoch(epoch);
        }
        let (t0, mut bytes) = (Instant::now(), 0u64);
        for batch in loader.by_ref().take(per_epoch as usize) {
            let batch = batch?;
            std::hint::black_box(batch.buffer().as_slice().first());
            bytes += (batch.len() * batch.layout().sample_bytes()) as u64;
            bar.inc(1);
        }
        epoch_rates.push(bytes as f64 / t0.elapsed().as_secs_f64().max(1e-9));
    }
    bar.finish_and_clear();
    let stats = loader.stats();
    let spec = loader.order_spec().clone();
    drop(loader);
    let mut report = report_of(
        &args,
        &path,
        &stats,
        dataset.len(),
        workers,
        prefetch,
        generate_secs,
    );
    report.steady_bytes_per_sec = gpufeed::loader::steady_rate(&epoch_rates);
    report.epoch_bytes_per_sec = epoch_rates;
    if args.baseline {
        let mut buffers = vec![Vec::new(); workers];
        let b = gpufeed::loader::gather_baseline(
            dataset.as_ref(),
            &spec,
            args.epochs,
            args.max_batches,
            &mut buffers,
        )?;
        report.baseline_bytes_per_sec = Some(b);
        report.baseline_ratio =
            Some(report.steady_bytes_per_sec.unwrap_or(report.bytes_per_sec) / b);
    }
    print_report(&args, &report, &stats)
}

/// `gpufeed bench --images`.
fn run_images(args: &Args, path: &Path) -> Result<()> {
    let dtype = DType::from_name(&args.image_dtype)
        .filter(|d| matches!(d, DType::U8 | DType::F16 | DType::BF16 | DType::F32))
        .ok_or_else(|| Error::InvalidConfig {
            setting: "image_dtype",
            what: format!("{:?} is not one of u8, f16, bf16, f32", args.image_dtype),
        })?;
    let workers = args.workers.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map_or(2, |n| n.get())
            .min(16)
    });
    let cfg = gpufeed::transform::image::bench::ImageBenchConfig {
        workers,
        batch_size: args.batch_size,
        size: args.image_size,
        dtype,
        epochs: args.epochs,
        drop_last: args.drop_last,
        limit: args.limit,
        seed: args.seed,
        verify_checksums: args.verify,
        ..Default::default()
    };
    #[cfg(feature = "cuda")]
    let report = match args.device {
        Some(ordinal) => crate::bench_cuda::run_images(path, &cfg, ordinal)?,
        None => crate::images::bench_images(path, &cfg)?,
    };
    #[cfg(not(feature = "cuda"))]
    let report = crate::images::bench_images(path, &cfg)?;
    if args.json {
        let text = serde_json::to_string(&report)
            .map_err(|e| Error::user(format!("cannot encode the report: {e}")))?;
        println!("{text}");
    } else {
        println!("{report}");
    }
    Ok(())
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
        dataset: path.display().to_string(),
        records,
        sample_bytes: stats.bytes.checked_div(stats.samples).unwrap_or(0),
        batch_size: args.batch_size,
        workers,
        prefetch,
        epochs: args.epochs,
        shuffle: !args.no_shuffle,
        samples_per_sec: stats.samples_per_sec(),
        bytes_per_sec: stats.bytes_per_sec(),
        first_batch_ms: stats.first_batch.map_or(0.0, |d| d.as_secs_f64() * 1e3),
        wait_fraction: stats.wait_fraction(),
        pool_reserved_bytes: stats.pool.reserved_bytes,
        pool_peak_bytes: stats.pool.peak_reserved_bytes,
        generate_secs,
        ..Report::default()
    }
}

/// Prints a device run's report as JSON or as tables (`stats` is the copy stage's table).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub fn print_device_report(args: &Args, report: &Report, stats: &str) -> Result<()> {
    print_report_with(args, report, stats)
}

/// Prints the report as JSON or as tables.
pub fn print_report(args: &Args, report: &Report, stats: &LoaderStats) -> Result<()> {
    print_report_with(args, report, &stats.to_string())
}

fn print_report_with(args: &Args, report: &Report, stats: &str) -> Result<()> {
    if args.json {
        let text = serde_json::to_string(report)
            .map_err(|e| Error::user(format!("cannot encode the report: {e}")))?;
        println!("{text}");
        return Ok(());
    }
    println!(
        "gpufeed bench: {} ({} records of {}), batch {}, {} workers, prefetch {}, {} epochs, {}",
        report.dataset,
        report.records,
        human_bytes(report.sample_bytes),
        report.batch_size,
        report.workers,
        report.prefetch,
        report.epochs,
        if report.shuffle {
            "shuffled"
        } else {
            "sequential"
        }
    );
    println!("{stats}");
    if let Some(steady) = report.steady_bytes_per_sec {
        println!(
            "steady state (epochs after the first): {:.2} GB/s",
            steady / 1e9
        );
    }
    println!(
        "throughput: {:.0} samples/s, {:.2} GB/s; first batch {:.2} ms; consumer waited {:.1}%",
        report.samples_per_sec,
        report.bytes_per_sec / 1e9,
        report.first_batch_ms,
        100.0 * report.wait_fraction
    );
    if report.epoch_bytes_per_sec.len() > 1 {
        let rates: Vec<String> = report
            .epoch_bytes_per_sec
            .iter()
            .map(|r| format!("{:.2}", r / 1e9))
            .collect();
        println!("per epoch (GB/s): {}", rates.join(", "));
    }
    if let (Some(b), Some(r)) = (report.baseline_bytes_per_sec, report.baseline_ratio) {
        println!(
            "baseline: plain {}-thread memcpy gather of the same records in the same order: {:.2} GB/s; loader (steady state) at {:.1}% of it",
            report.workers,
            b / 1e9,
            100.0 * r
        );
    }
    if let (Some(h), Some(c)) = (report.h2d_bytes_per_sec, report.h2d_ceiling_bytes_per_sec) {
        println!(
            "host to device: {:.2} GB/s; pinned-copy ceiling in this run {:.2} GB/s ({:.1}%)",
            h / 1e9,
            c / 1e9,
            100.0 * h / c
        );
        if let Some(steady) = report.h2d_steady_bytes_per_sec {
            println!(
                "host to device, epochs after the first: {:.2} GB/s ({:.1}% of the ceiling)",
                steady / 1e9,
                100.0 * steady / c
            );
        }
    }
    Ok(())
}
