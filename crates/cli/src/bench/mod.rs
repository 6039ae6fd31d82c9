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

mod args;
mod data;
#[cfg(feature = "cuda")]
mod device;
mod report;
mod tokens;

pub use args::Args;

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use gpufeed::format::DType;
use gpufeed::source::{self, Dataset};
use gpufeed::{BatchStream, Error, Loader, Result};

use crate::checks::LoaderSizes;
use crate::cleanup::{ReportOnInterrupt, TempDir, interrupt_flag, interrupted};
use crate::messages::progress;

use args::{batch_sizes, check_flags, copy_fields, field_positions, refuse, shard_of, workers};
use data::{
    DEFAULT_RECORD_BYTES, DEFAULT_RECORDS, generate, open_dataset, sample_bytes, warm_page_cache,
};
use report::{RaggedTally, Report, print_report_with, report_of};

/// Runs `gpufeed bench`.
pub fn run(args: Args) -> Result<()> {
    check_flags(&args)?;
    if !args.tokens.is_empty() {
        return tokens::run(&args);
    }
    if args.seq_len.is_some() || args.token_mode.is_some() || args.token_dtype.is_some() {
        return Err(refuse(
            "--seq-len",
            "--seq-len, --token-mode and --token-dtype apply to token runs (--tokens)",
        ));
    }
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
    if sharded.is_some() {
        args.read
            .refuse_for("a sharded data set's shards are mapped by its store")?;
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
    let named = args.fields.is_some();
    let ((sample, ragged), len) = match (&args.dataset, &sharded) {
        (Some(path), Some(d)) => (
            sample_bytes(path, d.schema(), &copy_fields(&args), named)?,
            d.len(),
        ),
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
            let options = gpufeed::format::ReadOptions {
                mode: args.read.mode(),
                ..Default::default()
            };
            let dataset = open_dataset(path, args.labels.as_deref(), options)?;
            let sample = sample_bytes(path, dataset.schema(), &copy_fields(&args), named)?;
            (sample, dataset.len())
        }
        (None, _) => ((record_bytes + 4, Vec::new()), records),
    };
    if args.ragged_budget.is_some() && ragged.is_empty() {
        return Err(refuse(
            "--ragged-budget",
            "applies to variable-size fields, and the fields batched have none",
        ));
    }
    let (rank, world) = shard_of(&args)?;
    let (batch_size, batches) = batch_sizes(&args, len, rank, world)?;
    // A ragged field's values take its budget in every batch buffer.
    let ragged_room = args.ragged_budget.map_or(0, |b| {
        b.div_ceil(batch_size.max(1) as u64) * ragged.len() as u64
    });
    let (prefetch, parts) = LoaderSizes {
        batch_size,
        batches,
        workers,
        prefetch: args.prefetch,
        parts: args.batch_parts,
        sample_bytes: sample + ragged_room,
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
                mode: args.read.mode(),
                verify_checksums: args.verify,
            };
            Arc::from(open_dataset(&path, args.labels.as_deref(), options)?)
        }
    };
    let mut builder = Loader::builder_shared(Arc::clone(&dataset))
        .transform(copy_fields(&args))
        .batch_size(args.batch_size)
        .workers(workers)
        .drop_last(args.drop_last)
        .evaluation(args.evaluation);
    // With ragged fields whose budget the loader measures, the batches' size is known once
    // it is built: the loader's defaults then, and the report says what it chose.
    let measured = !ragged.is_empty() && args.ragged_budget.is_none();
    if let Some(p) = args.prefetch.or((!measured).then_some(prefetch)) {
        builder = builder.prefetch(p);
    }
    if let Some(p) = args.batch_parts.or((!measured).then_some(parts)) {
        builder = builder.batch_parts(p);
    }
    if let Some(b) = args.ragged_budget {
        builder = builder.ragged_budget_each(b);
    }
    builder = builder.shard(rank, world);
    if !args.no_shuffle {
        builder = builder.shuffle(args.seed);
        if sharded.is_some() {
            builder = builder.shuffle_blocks(blocks.0, blocks.1);
        }
    }

    #[cfg(feature = "cuda")]
    if let Some(ordinal) = args.device {
        return device::run(&args, builder, &path, dataset.len(), generate_secs, ordinal);
    }

    let mut loader = builder.build()?;
    let (prefetch, parts) = (loader.prefetch(), loader.batch_parts());
    let mut values = RaggedTally::of(loader.layout());
    let per_epoch = args.max_batches.map_or(loader.batches_per_epoch(), |m| {
        m.min(loader.batches_per_epoch())
    });
    // From here on Ctrl-C stops the run at the next batch, and the report says what ran.
    let _report_on_interrupt = ReportOnInterrupt::start();
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
            bytes += batch.data_bytes() as u64;
            values.add(&batch)?;
            bar.inc(1);
            if interrupted() {
                break;
            }
        }
        epoch_rates.push(bytes as f64 / t0.elapsed().as_secs_f64().max(1e-9));
        if interrupted() {
            break;
        }
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
    report.ragged = values.report();
    if let Some(labels) = &args.labels {
        report.dataset = format!("{} with labels {}", path.display(), labels.display());
    }
    report.epochs = epoch_rates.len() as u64;
    report.steady_bytes_per_sec = gpufeed_bench::steady_rate(&epoch_rates);
    report.epoch_bytes_per_sec = epoch_rates;
    if let Some(d) = &sharded {
        report.shards = Some(d.shard_names().len());
        report.shuffle_blocks = (!args.no_shuffle).then_some(blocks);
        report.store = d.store_stats().map(crate::shards::StoreReport::from);
    }
    // From a URL, the gather would read the local cache the run filled: no comparison.
    let from_url = sharded.as_ref().is_some_and(|d| d.store_stats().is_some());
    // Interrupted, the gather would measure other work than the loader did: none.
    if !args.no_baseline && !from_url && !interrupted() {
        let mut buffers = vec![Vec::new(); workers];
        let fields = field_positions(&args, dataset.schema());
        let gathered = gpufeed_bench::gather_baseline(
            dataset.as_ref(),
            &spec,
            args.epochs,
            args.max_batches,
            fields.as_deref(),
            interrupt_flag(),
            &mut buffers,
        )?;
        if let Some(b) = gathered {
            report.baseline_bytes_per_sec = Some(b);
            report.baseline_ratio =
                Some(report.steady_bytes_per_sec.unwrap_or(report.bytes_per_sec) / b);
        }
    }
    report.interrupted = interrupted();
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
    if crate::shards::is_input(path) {
        args.read
            .refuse_for("a sharded data set's shards are mapped by its store")?;
    } else if path.is_dir() {
        args.read
            .refuse_for("an ImageFolder's images are read whole, never mapped")?;
    } else {
        crate::pack::check_inputs(
            &[path],
            "--images takes an ImageFolder directory, a packed file of images or a sharded data set with an image field",
        )?;
    }
    let decode: gpufeed::transform::image::Decode = match args.decode.as_deref() {
        None => gpufeed::transform::image::Decode::Cpu,
        Some(v) => v
            .parse()
            .map_err(|_| refuse("--decode", format!("{v:?} is not one of cpu, gpu, auto")))?,
    };
    if decode != gpufeed::transform::image::Decode::Cpu && args.device.is_none() {
        return Err(refuse(
            "--decode",
            "gpu and auto decode on a GPU: give --device N",
        ));
    }
    let cpu_share = match args.decode_split.as_deref() {
        None | Some("auto") => None,
        Some(v) => Some(
            v.parse::<f64>()
                .ok()
                .filter(|s| (0.0..=1.0).contains(s))
                .ok_or_else(|| {
                    refuse(
                        "--decode-split",
                        format!("{v:?} is not a share from 0 to 1, or auto"),
                    )
                })?,
        ),
    };
    if cpu_share.is_some() && decode == gpufeed::transform::image::Decode::Cpu {
        return Err(refuse("--decode-split", "applies to --decode gpu or auto"));
    }
    let workers = workers(args);
    // The host's batches hold u8 images with --device (converted on the GPU), else `dtype`.
    let host_dtype = if args.device.is_some() {
        DType::U8
    } else {
        dtype
    };
    let image_bytes = 3 * u64::from(size) * u64::from(size) * host_dtype.size() as u64;
    // Images in the data set: O(1) for a packed file, a listing for a folder (as the run's
    // own), the index for shards.
    let records = if crate::shards::is_input(path) {
        crate::shards::open(path, &Default::default())?.len()
    } else if path.is_dir() {
        gpufeed::source::ImageFolder::open(path)?.len()
    } else {
        source::open(path)?.len()
    };
    let (batch_size, batches) = batch_sizes(args, records, 0, 1)?;
    let (prefetch, parts) = LoaderSizes {
        batch_size,
        batches,
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
        label_field: args.label_field.clone(),
        verify_checksums: args.verify,
        read_mode: args.read.mode(),
        stop: Some(interrupt_flag()),
        decode,
        cpu_share,
    };
    // Ctrl-C stops the run at the next batch, and the report says what ran.
    let _report_on_interrupt = ReportOnInterrupt::start();
    #[cfg(feature = "cuda")]
    let r = match args.device {
        Some(ordinal) => device::run_images(path, &cfg, ordinal)?,
        None => crate::images::bench_images(path, &cfg)?,
    };
    #[cfg(not(feature = "cuda"))]
    let r = crate::images::bench_images(path, &cfg)?;
    let sample_bytes = 3 * u64::from(size) * u64::from(size) * dtype.size() as u64;
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
        interrupted: interrupted(),
        decode: Some(r.decode),
        #[cfg(feature = "cuda")]
        decode_report: r.decode_report.clone(),
        #[cfg(feature = "cuda")]
        epoch_details: device::image_epoch_details(&r, sample_bytes),
        ..Report::default()
    };
    let what = format!(
        "{} ({}), {size}x{size} {dtype}, decoded on the {}",
        r.source,
        r.kind,
        r.decode.to_uppercase()
    );
    print_report_with(args, report, None, &what)
}
