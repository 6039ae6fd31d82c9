//! `gpufeed bench`: the loader end to end, on an embedded default data set or a named one, or
//! the image pipeline (`--images`).
//!
//! With no dataset argument it writes the default (8,192 records of 3x224x224 u8 and a u32
//! label, as a packed file in a temporary directory removed afterwards, also on an error or a
//! signal: see `cleanup.rs`), warms the page cache, and runs the loader over it. A plain
//! multi-threaded memcpy gather of the same records in the same order runs after it (unless
//! `--no-baseline`) and the report says how the loader compares with it.
//!
//! A sharded data set (a directory of shards, a `.tar` pattern, an `s3://` URL: see
//! `shards.rs`) is read in the two-level shuffle's order (`--shuffle-window` shards,
//! `--shuffle-block` samples), is not warmed (it streams), and its store's counts (bytes
//! fetched, requests, retries, cache hits, time waited) are part of the report.
//!
//! Every setting is checked before anything is written or started: flags that do not apply to
//! the run are refused, and `--batch-size`, `--prefetch` and `--workers` are checked against
//! the machine (`checks.rs`). Raw and image runs print one report, with the same JSON keys.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use crate::messages::human_bytes;
use gpufeed::format::{DType, Field, FieldKind, RecordWriter, Schema};
use gpufeed::source::{self, Dataset, NpyArray, Zip};
use gpufeed::transform::{CopyFields, SampleTransform};
use gpufeed::{Error, Loader, LoaderStats, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::checks::LoaderSizes;
use crate::cleanup::TempDir;

/// Records of the generated default data set.
const DEFAULT_RECORDS: u64 = 8192;
/// Bytes of each generated record's data field (3x224x224).
const DEFAULT_RECORD_BYTES: u64 = 150_528;

/// Arguments of `gpufeed bench`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A packed record file or a .npy array, or a sharded data set (a directory of shards, a
    /// `.tar` file or brace pattern, an s3:// URL); without it, an embedded default is
    /// generated. (For an ImageFolder directory or a packed file of images: --images.)
    pub dataset: Option<PathBuf>,
    /// A .npy array of one label per sample of DATASET (the same number of rows), read beside
    /// it as its field `label` (a .npy DATASET's own field is `data`): no packing needed.
    #[arg(long, value_name = "LABELS.npy")]
    pub labels: Option<PathBuf>,
    /// Records in the generated default data set [default: 8192].
    #[arg(long)]
    pub records: Option<u64>,
    /// Bytes of each generated record's data field [default: 150528 = 3x224x224].
    #[arg(long)]
    pub record_bytes: Option<u64>,
    /// The fields to batch, by name, comma-separated (default: every field; they must be
    /// tensors, for encoded images use --images).
    #[arg(long, value_delimiter = ',', value_name = "NAME,...")]
    pub fields: Option<Vec<String>>,
    /// Samples per batch.
    #[arg(long, default_value_t = 256)]
    pub batch_size: usize,
    /// Worker threads (default: the available parallelism, at most 16; two fewer with --device,
    /// for the copy thread and the consumer).
    #[arg(long)]
    pub workers: Option<usize>,
    /// Batches in flight (default: --workers + 2, more for small batches; for batches made in
    /// parts, 2 + twice --workers / --batch-parts).
    #[arg(long)]
    pub prefetch: Option<usize>,
    /// Make each batch in N parts, written by N workers at once (default: one per worker for
    /// batches of 4 MiB or more, else 1: each batch by one worker).
    #[arg(long, value_name = "N")]
    pub batch_parts: Option<usize>,
    /// Shuffle seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Epochs to run (each over the whole data set), at least 1.
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
    /// Read one rank's share: `RANK/WORLD` (e.g. `1/4`), or `env` for torchrun's RANK and
    /// WORLD_SIZE (else Slurm's). Without it, the whole data set.
    #[arg(long, value_name = "RANK/WORLD|env")]
    pub shard: Option<String>,
    /// Evaluation order: every sample once across ranks, padding slots masked.
    #[arg(long)]
    pub evaluation: bool,
    /// Measure a plain memcpy gather of the same records, in the same order, with as many
    /// threads as workers, and report the loader's share of it (the default for host runs over
    /// records; kept for scripts).
    #[arg(long, conflicts_with = "no_baseline")]
    pub baseline: bool,
    /// Skip the plain memcpy gather that the report compares the loader with.
    #[arg(long)]
    pub no_baseline: bool,
    /// Copy each batch to this GPU (needs the `cuda` feature) and measure the pinned-copy ceiling.
    #[arg(long)]
    pub device: Option<usize>,
    /// Run the image pipeline (decode + RandomResizedCrop + flip) over an ImageFolder
    /// directory or a packed file of images, instead of raw records.
    #[arg(long, value_name = "DIR|PACKED")]
    pub images: Option<PathBuf>,
    /// Output side of the image pipeline's crops [default: 224] (with --images).
    #[arg(long)]
    pub image_size: Option<u32>,
    /// Output dtype of the image pipeline: u8, f16, bf16 or f32 (normalised with ImageNet's
    /// mean and std unless u8) [default: u8] (with --images).
    #[arg(long)]
    pub image_dtype: Option<String>,
    /// The field of a packed file that holds the encoded images [default: image] (with --images).
    #[arg(long, value_name = "NAME")]
    pub image_field: Option<String>,
    /// Skip images that cannot be decoded (counted in the report) instead of failing (with
    /// --images).
    #[arg(long)]
    pub skip_bad_images: bool,
    /// Stop the image pipeline after this many images (all epochs together) (with --images).
    #[arg(long)]
    pub limit: Option<u64>,
    /// Also print the loader's internals: its own stage table, queues, batch pool.
    #[arg(long, short = 'v')]
    pub verbose: bool,
    /// Print one JSON object instead of text (the same keys for every kind of run).
    #[arg(long)]
    pub json: bool,
    /// Check every record of a packed file against its stored checksum as it is read, every
    /// row of a .npy array against a checksum taken when it is opened (a record whose bytes
    /// changed is an error, never data); measures what verification costs.
    #[arg(long)]
    pub verify: bool,
    /// Shards whose samples are shuffled together (a sharded data set's two-level shuffle)
    /// [default: 8].
    #[arg(long, value_name = "SHARDS")]
    pub shuffle_window: Option<u64>,
    /// Consecutive samples read as one run in the two-level shuffle [default: 64].
    #[arg(long, value_name = "SAMPLES")]
    pub shuffle_block: Option<u64>,
    /// The cache of shards downloaded from a URL.
    #[command(flatten)]
    pub cache: crate::shards::CacheFlags,
}

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
    /// Epochs run.
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
    pub store: Option<crate::shards::StoreReport>,
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

/// `RANK/WORLD` as two whole numbers.
fn parse_shard(v: &str) -> Result<(u64, u64)> {
    let parsed = v
        .split_once('/')
        .and_then(|(r, w)| Some((r.trim().parse().ok()?, w.trim().parse().ok()?)));
    parsed.ok_or_else(|| Error::InvalidConfig {
        setting: "--shard",
        what: format!("{v:?} is not RANK/WORLD (like 0/2) or env"),
    })
}

/// Writes the default data set into `dir`: `records` records of `record_bytes` pseudo-random
/// bytes and a u32 label. 150528-byte records get the shape [3, 224, 224].
fn generate(dir: &Path, records: u64, record_bytes: u64, quiet: bool) -> Result<PathBuf> {
    let file = dir.join("default.gfd");
    let shape: Vec<u64> = if record_bytes == 3 * 224 * 224 {
        vec![3, 224, 224]
    } else {
        vec![record_bytes]
    };
    let schema = Schema::new(vec![
        Field::tensor("image", DType::U8, &shape),
        Field::tensor("label", DType::U32, &[]),
    ])
    .map_err(|e| Error::InvalidConfig {
        setting: "--record-bytes",
        what: e.to_string(),
    })?;
    let mut w = RecordWriter::create(&file, schema)?;
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
    Ok(file)
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

fn refuse(flag: &'static str, what: impl Into<String>) -> Error {
    Error::InvalidConfig {
        setting: flag,
        what: what.into(),
    }
}

/// Refuses settings that cannot work and flags that do not apply to this kind of run.
fn check_flags(args: &Args) -> Result<()> {
    if args.epochs == 0 {
        return Err(refuse("--epochs", "must be at least 1"));
    }
    if args.max_batches == Some(0) {
        return Err(refuse("--max-batches", "must be at least 1"));
    }
    if args.limit == Some(0) {
        return Err(refuse("--limit", "must be at least 1"));
    }
    if args.device.is_some() && !cfg!(feature = "cuda") {
        return Err(Error::NoGpu {
            what: "this gpufeed was built without the `cuda` feature (cargo build --release --features cuda); \
                   run without --device for the host-only figures"
                .into(),
        });
    }
    let only_images = [
        ("--image-size", args.image_size.is_some()),
        ("--image-dtype", args.image_dtype.is_some()),
        ("--image-field", args.image_field.is_some()),
        ("--skip-bad-images", args.skip_bad_images),
        ("--limit", args.limit.is_some()),
    ];
    if args.images.is_some() {
        if args.dataset.is_some() {
            return Err(refuse(
                "--images",
                "names the data set of an image run: give no other DATASET",
            ));
        }
        for (flag, given) in [
            ("--records", args.records.is_some()),
            ("--record-bytes", args.record_bytes.is_some()),
            ("--fields", args.fields.is_some()),
            ("--labels", args.labels.is_some()),
            ("--baseline", args.baseline),
            ("--no-baseline", args.no_baseline),
        ] {
            if given {
                return Err(refuse(
                    flag,
                    "does not apply to --images (the image pipeline has no plain-copy baseline, \
                     and reads the encoded image field: see --image-field)",
                ));
            }
        }
        return Ok(());
    }
    for (flag, given) in only_images {
        if given {
            return Err(refuse(
                flag,
                "applies to the image pipeline only (--images DIR|PACKED)",
            ));
        }
    }
    if args.labels.is_some() && args.dataset.is_none() {
        return Err(refuse(
            "--labels",
            "labels a named DATASET (gpufeed bench X.npy --labels Y.npy); the generated default has its own",
        ));
    }
    if args.dataset.is_some() {
        for (flag, given) in [
            ("--records", args.records.is_some()),
            ("--record-bytes", args.record_bytes.is_some()),
        ] {
            if given {
                return Err(refuse(
                    flag,
                    "sizes the generated default data set; it does not apply to a named DATASET",
                ));
            }
        }
    }
    if args.device.is_some() && (args.baseline || args.no_baseline) {
        return Err(refuse(
            if args.baseline {
                "--baseline"
            } else {
                "--no-baseline"
            },
            "does not apply to --device: a device run compares with the pinned-copy ceiling it measures",
        ));
    }
    if args.records == Some(0) {
        return Err(refuse("--records", "must be at least 1"));
    }
    if args.record_bytes == Some(0) {
        return Err(refuse("--record-bytes", "must be at least 1"));
    }
    Ok(())
}

/// The workers a run uses: `--workers`, or the library's default (one per CPU, at most 16; two
/// CPUs fewer with `--device`).
fn workers(args: &Args) -> usize {
    args.workers
        .unwrap_or_else(|| gpufeed::loader::default_workers(args.device.is_some()))
}

/// The transform of a records run: every field, or those of `--fields`.
fn copy_fields(args: &Args) -> CopyFields {
    match &args.fields {
        Some(names) => CopyFields::named(names.iter().cloned()),
        None => CopyFields::all(),
    }
}

/// Bytes per sample that `transform` makes of `schema`'s records, with the command's advice
/// when a field cannot be batched as it is.
fn sample_bytes(path: &Path, schema: &Schema, transform: &CopyFields) -> Result<u64> {
    let outputs = transform.output(schema).map_err(|e| {
        let encoded_images = schema
            .fields()
            .iter()
            .any(|f| f.name == "image" && matches!(f.kind, FieldKind::Bytes { .. }));
        if encoded_images {
            Error::user(format!(
                "{}: its field `image` holds encoded images: run the image pipeline with \
                 gpufeed bench --images {}, or batch its tensor fields with --fields NAME,... ({})",
                path.display(),
                path.display(),
                crate::messages::in_flags(&e.to_string())
            ))
        } else {
            e
        }
    })?;
    Ok(outputs
        .iter()
        .map(|f| f.dtype.size() as u64 * f.shape.iter().map(|&d| d as u64).product::<u64>())
        .sum())
}

/// Opens DATASET, zipped with `--labels` (a .npy array read as the field `label`) if given.
fn open_dataset(
    path: &Path,
    labels: Option<&Path>,
    options: gpufeed::format::ReadOptions,
) -> Result<Box<dyn Dataset>> {
    let data = source::open_with(path, options)?;
    let Some(labels) = labels else {
        return Ok(data);
    };
    let label = labels.display().to_string();
    let labels: Box<dyn Dataset> = Box::new(NpyArray::open_with(labels, "label", options)?);
    let zipped = Zip::new([(path.display().to_string(), data), (label, labels)])?;
    Ok(Box::new(zipped))
}

/// Runs `gpufeed bench`.
pub fn run(args: Args) -> Result<()> {
    check_flags(&args)?;
    if let Some(images) = &args.images {
        return run_images(&args, images);
    }
    let workers = workers(&args);
    let (records, record_bytes) = (
        args.records.unwrap_or(DEFAULT_RECORDS),
        args.record_bytes.unwrap_or(DEFAULT_RECORD_BYTES),
    );
    let sharded = match &args.dataset {
        Some(path) if crate::shards::is_input(path) => {
            Some(crate::shards::open(path, &args.cache)?)
        }
        _ => {
            if args.cache.cache_dir.is_some() || args.cache.cache_limit.is_some() {
                return Err(refuse(
                    "--cache-dir",
                    "applies to data sets read from a URL",
                ));
            }
            None
        }
    };
    if sharded.is_some() && args.labels.is_some() {
        return Err(refuse(
            "--labels",
            "applies to a packed file or a .npy array, not to a sharded data set",
        ));
    }
    if sharded.is_some() && args.verify {
        return Err(refuse(
            "--verify",
            "applies to packed record files; a sharded data set checks its shards against \
             their index as they arrive",
        ));
    }
    if sharded.is_none() && (args.shuffle_window.is_some() || args.shuffle_block.is_some()) {
        return Err(refuse(
            "--shuffle-window",
            "--shuffle-window and --shuffle-block apply to sharded data sets",
        ));
    }
    let blocks = (
        args.shuffle_window.unwrap_or(8),
        args.shuffle_block.unwrap_or(64),
    );
    // Check the sizes before writing or starting anything.
    let sample = match (&args.dataset, &sharded) {
        (Some(path), Some(d)) => sample_bytes(path, d.schema(), &copy_fields(&args))?,
        (Some(path), None) => {
            if path.is_dir() {
                return Err(Error::user(format!(
                    "{}: is a directory; for an ImageFolder of JPEG/PNG images run \
                     gpufeed bench --images {}",
                    path.display(),
                    path.display()
                )));
            }
            crate::pack::check_inputs(&[path], "DATASET is a packed file or a .npy array")?;
            if let Some(labels) = &args.labels {
                crate::pack::check_inputs(&[labels], "--labels is a .npy array")?;
            }
            let dataset = open_dataset(path, args.labels.as_deref(), Default::default())?;
            sample_bytes(path, dataset.schema(), &copy_fields(&args))?
        }
        (None, _) => record_bytes + 4,
    };
    let (prefetch, parts) = LoaderSizes {
        batch_size: args.batch_size,
        workers,
        prefetch: args.prefetch,
        parts: args.batch_parts,
        sample_bytes: sample,
    }
    .check()?;

    let t_gen = Instant::now();
    // `_generated` removes the default data set when the bench returns, fails or panics, and
    // the signal handler removes it on Ctrl-C.
    let (path, _generated) = match &args.dataset {
        Some(p) => (p.clone(), None),
        None => {
            let dir = TempDir::new("bench")?;
            let file = generate(dir.path(), records, record_bytes, args.json)?;
            (file, Some(dir))
        }
    };
    let generate_secs = if args.dataset.is_none() {
        t_gen.elapsed().as_secs_f64()
    } else {
        0.0
    };
    let dataset: Arc<dyn Dataset> = match &sharded {
        Some(d) => Arc::clone(d) as Arc<dyn Dataset>,
        None => {
            warm_page_cache(&path)?;
            if let Some(labels) = &args.labels {
                warm_page_cache(labels)?;
            }
            let options = gpufeed::format::ReadOptions {
                verify_checksums: args.verify,
                ..Default::default()
            };
            Arc::from(open_dataset(&path, args.labels.as_deref(), options)?)
        }
    };
    let mut builder = Loader::builder_shared(Arc::clone(&dataset))
        .transform(copy_fields(&args))
        .batch_size(args.batch_size)
        .workers(workers)
        .prefetch(prefetch)
        .batch_parts(parts)
        .drop_last(args.drop_last)
        .evaluation(args.evaluation);
    builder = match args.shard.as_deref() {
        None => builder,
        Some("env") => builder.shard_from_env(),
        Some(v) => {
            let (rank, world) = parse_shard(v)?;
            builder.shard(rank, world)
        }
    };
    if !args.no_shuffle {
        builder = builder.shuffle(args.seed);
        if sharded.is_some() {
            builder = builder.shuffle_blocks(blocks.0, blocks.1);
        }
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
    report.batch_parts = parts;
    if let Some(labels) = &args.labels {
        report.dataset = format!("{} with labels {}", path.display(), labels.display());
    }
    report.steady_bytes_per_sec = gpufeed::loader::steady_rate(&epoch_rates);
    report.epoch_bytes_per_sec = epoch_rates;
    if let Some(d) = &sharded {
        report.shards = Some(d.shard_names().len());
        report.shuffle_blocks = (!args.no_shuffle).then_some(blocks);
        report.store = d.store_stats().map(crate::shards::StoreReport::from);
    }
    // From a URL, the gather would read the local cache the run filled: no comparison.
    let from_url = sharded.as_ref().is_some_and(|d| d.store_stats().is_some());
    if !args.no_baseline && !from_url {
        let mut buffers = vec![Vec::new(); workers];
        let b = gpufeed_bench::gather_baseline(
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
    // The generated data set goes before the report is printed: a reader that stops reading
    // (`| head -1`) must not leave it behind.
    drop(_generated);
    print_report_with(&args, report, Some(&stats), "")
}

/// `gpufeed bench --images`.
fn run_images(args: &Args, path: &Path) -> Result<()> {
    let name = args.image_dtype.as_deref().unwrap_or("u8");
    let dtype = DType::from_name(name)
        .filter(|d| matches!(d, DType::U8 | DType::F16 | DType::BF16 | DType::F32))
        .ok_or_else(|| {
            refuse(
                "--image-dtype",
                format!("{name:?} is not one of u8, f16, bf16, f32"),
            )
        })?;
    let size = args.image_size.unwrap_or(224);
    if size == 0 {
        return Err(refuse("--image-size", "must be at least 1"));
    }
    if !path.is_dir() {
        crate::pack::check_inputs(
            &[path],
            "--images takes an ImageFolder directory or a packed file of images",
        )?;
    }
    let workers = workers(args);
    // The host's batches hold u8 images with --device (converted on the GPU), else `dtype`.
    let host_dtype = if args.device.is_some() {
        DType::U8
    } else {
        dtype
    };
    let image_bytes = 3 * u64::from(size) * u64::from(size) * host_dtype.size() as u64;
    let (prefetch, parts) = LoaderSizes {
        batch_size: args.batch_size,
        workers,
        prefetch: args.prefetch,
        parts: args.batch_parts,
        sample_bytes: image_bytes + 8,
    }
    .check()?;
    let cfg = gpufeed_bench::ImageBenchConfig {
        workers,
        batch_size: args.batch_size,
        size,
        dtype,
        epochs: args.epochs,
        drop_last: args.drop_last,
        limit: args.limit,
        seed: args.seed,
        skip_bad: args.skip_bad_images,
        shuffle: !args.no_shuffle,
        prefetch: Some(prefetch),
        parts: Some(parts),
        max_batches: args.max_batches,
        image_field: args.image_field.clone(),
        verify_checksums: args.verify,
    };
    #[cfg(feature = "cuda")]
    let r = match args.device {
        Some(ordinal) => crate::bench_cuda::run_images(path, &cfg, ordinal)?,
        None => crate::images::bench_images(path, &cfg)?,
    };
    #[cfg(not(feature = "cuda"))]
    let r = crate::images::bench_images(path, &cfg)?;
    let sample_bytes = 3 * u64::from(size) * u64::from(size) * dtype.size() as u64;
    // Images in the data set: O(1) for a packed file, a listing for a folder (as the run's own).
    let records = if path.is_dir() {
        gpufeed::source::ImageFolder::open(path)?.len()
    } else {
        source::open(path)?.len()
    };
    let report = Report {
        mode: "images",
        dataset: r.source.clone(),
        generated: false,
        records,
        sample_bytes,
        batch_size: args.batch_size,
        workers: r.workers,
        prefetch,
        batch_parts: parts,
        epochs: r.epochs,
        shuffle: !args.no_shuffle,
        samples: r.images,
        seconds: r.seconds,
        samples_per_sec: r.images_per_sec,
        bytes_per_sec: r.images_per_sec * sample_bytes as f64,
        epoch_samples_per_sec: r.epoch_images_per_sec.clone(),
        steady_samples_per_sec: r.steady_images_per_sec,
        wait_fraction: r.wait_fraction,
        steady_bytes_per_sec: r.steady_images_per_sec.map(|s| s * sample_bytes as f64),
        epoch_bytes_per_sec: r
            .epoch_images_per_sec
            .iter()
            .map(|s| s * sample_bytes as f64)
            .collect(),
        device: r.device.clone(),
        skipped: Some(r.skipped),
        ..Report::default()
    };
    let what = format!("{} ({}), {size}x{size} {dtype}", r.source, r.kind);
    print_report_with(args, report, None, &what)
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
fn complete(args: &Args, report: &mut Report) {
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

/// One rate in the run's one unit: GB/s for records, images/s for images.
fn rate(report: &Report, bytes_per_sec: f64, samples_per_sec: f64) -> String {
    if report.mode == "images" {
        format!("{samples_per_sec:.0} images/s")
    } else {
        format!("{:.2} GB/s", bytes_per_sec / 1e9)
    }
}

/// The stage table of a host records run: worker time per stage, all as shares of one
/// denominator (the workers' time over the run).
fn stage_table(stats: &LoaderStats) -> String {
    let total = stats.elapsed.as_secs_f64() * stats.workers as f64;
    let share = |d: std::time::Duration| 100.0 * d.as_secs_f64() / total.max(1e-9);
    let busy = stats.stages.fetch + stats.stages.transform + stats.stages.collate;
    let idle = (total - busy.as_secs_f64()).max(0.0);
    let mut t = format!(
        "worker time: {} workers x {:.3} s = {:.3} s\n",
        stats.workers,
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

fn print_report_with(
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
    let mut text = String::new();
    let what = if images {
        extra
    } else {
        report.dataset.as_str()
    };
    let sizes = if images {
        format!(" ({} images)", report.records)
    } else {
        format!(
            " ({} records of {})",
            report.records,
            human_bytes(report.sample_bytes)
        )
    };
    let dataset_line = format!(
        "gpufeed bench{}: {what}{sizes}, batch {}, {} workers, prefetch {}, {} parts, {} epochs, {}",
        if images { " --images" } else { "" },
        report.batch_size,
        report.workers,
        report.prefetch,
        report.batch_parts,
        report.epochs,
        if report.shuffle {
            "shuffled"
        } else {
            "sequential"
        }
    );
    text.push_str(&dataset_line);
    text.push('\n');
    if let Some(device) = &report.device {
        text.push_str(&format!("device: {device}\n"));
    }
    let mut line = format!(
        "throughput: {} over the run ({} {} in {:.2} s)",
        rate(&report, report.bytes_per_sec, report.samples_per_sec),
        report.samples,
        if images { "images" } else { "samples" },
        report.seconds
    );
    if let (Some(b), Some(s)) = (report.steady_bytes_per_sec, report.steady_samples_per_sec) {
        line.push_str(&format!(
            "; steady state (epochs after the first) {}",
            rate(&report, b, s)
        ));
    }
    text.push_str(&line);
    text.push('\n');
    if report.epoch_bytes_per_sec.len() > 1 {
        let rates: Vec<String> = report
            .epoch_bytes_per_sec
            .iter()
            .zip(&report.epoch_samples_per_sec)
            .map(|(&b, &s)| rate(&report, b, s))
            .collect();
        text.push_str(&format!("per epoch: {}\n", rates.join(", ")));
    }
    if let (Some(b), Some(r)) = (report.baseline_bytes_per_sec, report.baseline_ratio) {
        text.push_str(&format!(
            "compared: a plain {}-thread memcpy gather of the same records{} in the same order runs at {}; \
             gpufeed's {} is {:.0}% of it\n",
            report.workers,
            if args.fields.is_some() {
                " (every field)"
            } else {
                ""
            },
            rate(&report, b, 0.0),
            if report.steady_bytes_per_sec.is_some() {
                "steady state"
            } else {
                "rate"
            },
            100.0 * r
        ));
    }
    if let (Some(h), Some(c)) = (report.h2d_bytes_per_sec, report.h2d_ceiling_bytes_per_sec) {
        text.push_str(&format!(
            "compared: host to device {:.2} GB/s; the pinned-copy ceiling in this run is {:.2} GB/s ({:.0}%)\n",
            h / 1e9,
            c / 1e9,
            100.0 * h / c
        ));
        if let Some(steady) = report.h2d_steady_bytes_per_sec {
            text.push_str(&format!(
                "host to device, epochs after the first: {:.2} GB/s ({:.0}% of the ceiling)\n",
                steady / 1e9,
                100.0 * steady / c
            ));
        }
    }
    if let Some(skipped) = report.skipped {
        text.push_str(&format!("bad images skipped: {skipped}\n"));
    }
    if let Some(shards) = report.shards {
        text.push_str(&format!(
            "shards: {shards}{}\n",
            report
                .shuffle_blocks
                .map_or(String::new(), |(w, b)| format!(
                    ", two-level shuffle: windows of {w} shards, blocks of {b} samples"
                ))
        ));
    }
    if let Some(store) = &report.store {
        text.push_str(&format!("store: {}\n", store.summary));
    }
    text.push_str(&format!(
        "consumer: waited for data {:.1}% of its time{}\n",
        100.0 * report.wait_fraction,
        report.first_batch_ms.map_or(String::new(), |ms| format!(
            "; first batch {ms:.2} ms after build"
        ))
    ));
    if let Some(stats) = stats {
        text.push_str(&stage_table(stats));
        if args.verbose {
            text.push_str(&format!("\nthe loader's own figures:\n{stats}\n"));
        }
    } else if !extra.is_empty() && !images && args.verbose {
        text.push_str(&format!("\nthe copy stage's figures:\n{extra}\n"));
    }
    crate::out(text.trim_end())
}
