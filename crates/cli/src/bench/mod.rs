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
mod plot;
mod report;
mod tokens;

pub use args::Args;

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use gpufeed::format::DType;
use gpufeed::sampler::OrderSpec;
use gpufeed::source::{Dataset, Format, OpenOptions, Source};
use gpufeed::trace::Trace;
use gpufeed::transform::image::Decode;
use gpufeed::{BatchStream, Loader, LoaderBuilder, Result};
use gpufeed_bench::Timeline;

use crate::checks::{LoaderSizes, check_output};
use crate::cleanup::{ReportOnInterrupt, TempDir, interrupt_flag, interrupted};
use crate::messages::progress;

use args::{
    batch_sizes, check_flags, copy_fields, field_positions, fixed, refuse, setting, shard_of,
    workers,
};
use data::{
    DEFAULT_RECORD_BYTES, DEFAULT_RECORDS, generate, sample_bytes, warm_page_cache, with_labels,
};
use report::{RaggedTally, Report, print_report_with, report_of};

/// Runs `gpufeed bench`.
pub fn run(args: Args) -> Result<()> {
    check_flags(&args)?;
    check_outputs(&args)?;
    let trace = args.trace.as_ref().map(|_| Trace::new());
    if !args.tokens.is_empty() {
        if trace.is_some() || args.plot.is_some() {
            return Err(refuse(
                "--trace",
                "--trace and --plot draw record and image runs; token runs (--tokens) have neither",
            ));
        }
        return tokens::run(&args);
    }
    if args.seq_len.is_some() || args.token_mode.is_some() || args.token_dtype.is_some() {
        return Err(refuse(
            "--seq-len",
            "--seq-len, --token-mode and --token-dtype apply to token runs (--tokens)",
        ));
    }
    if args.tokenizer.is_some() || args.text_field.is_some() {
        return Err(refuse(
            "--tokenizer",
            "--tokenizer and --text-field tokenize the text of token runs (--tokens PATH)",
        ));
    }
    if let Some(images) = &args.images {
        return run_images(&args, images, trace.as_ref());
    }
    run_records(&args, trace.as_ref())
}

/// What a records run reads and how, settled and checked against the machine before anything
/// is written or started.
struct RecordsPlan {
    /// How the data set named is opened.
    options: OpenOptions,
    /// The data set named (with `--labels` beside it); `None`: the generated default.
    data: Option<Arc<dyn Dataset>>,
    /// The data set named, when it is sharded: its store's counts go in the report.
    sharded: Option<Arc<dyn Source>>,
    /// The data set named, when it decodes chunks into a cache (Parquet): the cache's counts
    /// go in the report.
    chunked: Option<Arc<dyn Source>>,
    /// The two-level shuffle's shards (or chunks) per window and samples per block, for data
    /// read by shard or chunk.
    blocks: Option<(u64, u64)>,
    /// The batches have variable-size fields whose budget the loader measures.
    measured: bool,
    rank: u64,
    world: u64,
    workers: usize,
    prefetch: usize,
    parts: usize,
    /// The generated default data set's records and their bytes.
    records: u64,
    record_bytes: u64,
}

impl RecordsPlan {
    /// What the data set's own parts did, into the report: a sharded set's shards and
    /// store, a table's cache of decoded chunks.
    fn source_figures(&self, report: &mut Report) {
        if let Some(d) = self.sharded.as_ref().and_then(|s| s.sharded()) {
            report.shards = Some(d.shard_names().len());
            report.store = d.store_stats().map(crate::open::StoreReport::from);
        }
        report.chunk_cache = self.chunked.as_ref().and_then(|s| s.chunk_cache());
    }

    /// Opens the data set named (once, through the library's front door) and checks the
    /// flags against it and the sizes against the machine.
    fn new(args: &Args) -> Result<RecordsPlan> {
        let workers = workers(args);
        let (records, record_bytes) = (
            args.records.unwrap_or(DEFAULT_RECORDS),
            args.record_bytes.unwrap_or(DEFAULT_RECORD_BYTES),
        );
        let mut options = crate::open::options(&args.read, &args.cache, args.verify)?;
        // A table decodes only the columns batched.
        options.table.columns.clone_from(&args.fields);
        let opened = match &args.dataset {
            Some(path) => Some(crate::open::open(path, &options)?),
            None => None,
        };
        let sharded = opened
            .as_ref()
            .and_then(|s| s.sharded().map(|_| Arc::clone(s)));
        let chunked = opened
            .as_ref()
            .and_then(|s| s.chunk_cache().map(|_| Arc::clone(s)));
        if let (Some(labels), Some(source)) = (&args.labels, &opened)
            && !matches!(source.format(), Format::Packed | Format::Npy)
        {
            return Err(refuse(
                "--labels",
                format!(
                    "applies to a packed file or a .npy array, not to {} ({})",
                    labels.display(),
                    source.format().title()
                ),
            ));
        }
        let blocks = shuffle_blocks(args, opened.as_deref(), sharded.is_some())?;
        let named = args.fields.is_some();
        let data = match (&args.dataset, opened) {
            (Some(path), Some(source)) => Some(with_labels(
                path,
                source,
                args.labels.as_deref(),
                options.read,
            )?),
            _ => None,
        };
        let ((sample, ragged), len) = match (&args.dataset, &data) {
            (Some(path), Some(d)) => (
                sample_bytes(path, d.schema(), &copy_fields(args), named)?,
                d.len(),
            ),
            _ => ((record_bytes + 4, Vec::new()), records),
        };
        if args.ragged_budget.is_some() && ragged.is_empty() {
            return Err(refuse(
                "--ragged-budget",
                "applies to variable-size fields, and the fields batched have none",
            ));
        }
        let (rank, world) = shard_of(args)?;
        let (batch_size, batches) = batch_sizes(args, len, rank, world)?;
        // A ragged field's values take its budget in every batch buffer.
        let ragged_room = args.ragged_budget.map_or(0, |b| {
            b.div_ceil(batch_size.max(1) as u64) * ragged.len() as u64
        });
        let (prefetch, parts) = LoaderSizes {
            batch_size,
            batches,
            workers,
            prefetch: fixed(args.prefetch),
            parts: fixed(args.batch_parts),
            sample_bytes: sample + ragged_room,
        }
        .check()?;
        Ok(RecordsPlan {
            options,
            data,
            sharded,
            chunked,
            blocks,
            measured: !ragged.is_empty() && args.ragged_budget.is_none(),
            rank,
            world,
            workers,
            prefetch,
            parts,
            records,
            record_bytes,
        })
    }

    /// The loader's builder over `dataset`, as the flags and the plan say.
    fn builder(
        &self,
        args: &Args,
        dataset: &Arc<dyn Dataset>,
        trace: Option<&Trace>,
    ) -> LoaderBuilder {
        let mut builder = Loader::builder_shared(Arc::clone(dataset))
            .transform(copy_fields(args))
            .batch_size(args.batch_size)
            .workers(setting(args.workers, self.workers, None))
            .drop_last(args.drop_last)
            .evaluation(args.evaluation);
        // With ragged fields whose budget the loader measures, the batches' size is known once
        // it is built: the loader's defaults then, and the report says what it chose.
        if args.prefetch.is_some() || !self.measured {
            builder = builder.prefetch(setting(args.prefetch, self.prefetch, args.workers));
        }
        if args.batch_parts.is_some() || !self.measured {
            builder = builder.batch_parts(setting(args.batch_parts, self.parts, args.workers));
        }
        if let Some(b) = args.ragged_budget {
            builder = builder.ragged_budget_each(b);
        }
        builder = builder.shard(self.rank, self.world);
        if let Some(trace) = trace {
            builder = builder.trace(trace);
        }
        if !args.no_shuffle {
            builder = builder.shuffle(args.seed);
            if let Some((window, block)) = self.blocks {
                builder = builder.shuffle_blocks(window, block);
            }
        }
        builder
    }
}

/// The two-level shuffle of data read by shard or chunk: windows of `--shuffle-window` shards
/// (or chunks), blocks of `--shuffle-block` samples; by default, a sharded data set's windows
/// of 8 shards and blocks of 64 samples, a table's own window (Parquet). `None` for data read
/// in place, which refuses the two flags.
fn shuffle_blocks(
    args: &Args,
    opened: Option<&dyn Source>,
    sharded: bool,
) -> Result<Option<(u64, u64)>> {
    let windowed = opened.is_some_and(|s| s.shard_sizes().is_some());
    if !windowed && (args.shuffle_window.is_some() || args.shuffle_block.is_some()) {
        return Err(refuse(
            "--shuffle-window",
            "--shuffle-window and --shuffle-block apply to data sets read in windows of shards \
             or chunks (shard directories, Parquet)",
        ));
    }
    let own = opened.and_then(|s| s.windowed_shuffle());
    Ok(match (args.shuffle_window, args.shuffle_block, own) {
        (None, None, Some(own)) => Some(own),
        (None, None, None) if sharded => Some((8, 64)),
        (None, None, None) => None,
        (w, b, own) => Some((
            w.or(own.map(|o| o.0)).unwrap_or(8),
            b.or(own.map(|o| o.1)).unwrap_or(64),
        )),
    })
}

/// `gpufeed bench` over records: the data set named, or the generated default.
fn run_records(args: &Args, trace: Option<&Trace>) -> Result<()> {
    let plan = RecordsPlan::new(args)?;
    let t_gen = Instant::now();
    // `_generated` removes the default data set when the bench returns, fails or panics, and
    // the signal handler removes it on Ctrl-C.
    let (path, _generated) = match &args.dataset {
        Some(p) => (p.clone(), None),
        None => {
            let dir = TempDir::new("bench")?;
            let file = generate(dir.path(), plan.records, plan.record_bytes, args.json)?;
            (file, Some(dir))
        }
    };
    let generate_secs = if args.dataset.is_none() {
        t_gen.elapsed().as_secs_f64()
    } else {
        0.0
    };
    let dataset: Arc<dyn Dataset> = match &plan.data {
        Some(d) => Arc::clone(d),
        None => crate::open::open(&path, &plan.options)?,
    };
    // Files read in place are read once first, as PyTorch's baseline reads its file.
    if matches!(
        gpufeed::source::detect(&path),
        Ok(Format::Packed | Format::Npy)
    ) {
        warm_page_cache(&path)?;
        if let Some(labels) = &args.labels {
            warm_page_cache(labels)?;
        }
    }
    let builder = plan.builder(args, &dataset, trace);

    #[cfg(feature = "cuda")]
    if let Some(ordinal) = args.device {
        return device::run(args, builder, ordinal, trace, |report| {
            report.dataset = path.display().to_string();
            report.records = dataset.len();
            report.generate_secs = generate_secs;
            plan.source_figures(report);
        });
    }

    let mut loader = builder.build()?;
    // From here on Ctrl-C stops the run at the next batch, and the report says what ran.
    let _report_on_interrupt = ReportOnInterrupt::start();
    let read = read_epochs(&mut loader, args)?;
    let stats = loader.stats();
    let spec = loader.order_spec().clone();
    // With `auto`, what the loader chose (the gather below uses as many threads).
    let (workers, prefetch, parts) = (stats.workers, loader.prefetch(), loader.batch_parts());
    drop(loader);
    let mut report = report_of(
        args,
        &path,
        &stats,
        dataset.len(),
        workers,
        prefetch,
        generate_secs,
    );
    report.batch_parts = parts;
    report.ragged = read.values.report();
    if let Some(labels) = &args.labels {
        report.dataset = format!("{} with labels {}", path.display(), labels.display());
    }
    report.epochs = read.rates.len() as u64;
    report.steady_bytes_per_sec = gpufeed_bench::steady_rate(&read.rates);
    report.epoch_bytes_per_sec = read.rates;
    report.shuffle_blocks = plan.blocks.filter(|_| !args.no_shuffle);
    plan.source_figures(&mut report);
    let store = plan.sharded.as_ref().and_then(|s| s.sharded());
    // From a URL, the gather would read the local cache the run filled: no comparison.
    let from_url = store.is_some_and(|d| d.store_stats().is_some());
    // Interrupted, the gather would measure other work than the loader did: none.
    if !args.no_baseline && !from_url && !interrupted() {
        compare_with_gather(args, dataset.as_ref(), &spec, workers, &mut report)?;
    }
    report.interrupted = interrupted();
    report.verdict = Some(stats.verdict().to_string());
    report.tuning = stats.tuning.clone();
    let baseline = report
        .baseline_bytes_per_sec
        .map(|b| (format!("plain {workers}-thread memcpy gather"), b));
    write_outputs(args, trace, &read.timeline, true, baseline, &mut report)?;
    // The generated data set goes before the report is printed: a reader that stops reading
    // (`| head -1`) must not leave it behind.
    drop(_generated);
    print_report_with(args, report, Some(&stats), "")
}

/// What a records run's epochs read.
struct EpochsRead {
    /// Each epoch's rate, bytes per second.
    rates: Vec<f64>,
    timeline: Timeline,
    /// The values of the ragged fields.
    values: RaggedTally,
}

/// Reads `--epochs` epochs of at most `--max-batches` batches from `loader`, with a progress
/// bar; stops at the next batch once the run is interrupted.
fn read_epochs(loader: &mut Loader, args: &Args) -> Result<EpochsRead> {
    let mut values = RaggedTally::of(loader.layout());
    let per_epoch = args.max_batches.map_or(loader.batches_per_epoch(), |m| {
        m.min(loader.batches_per_epoch())
    });
    let bar = progress(per_epoch * args.epochs, "bench", args.json);
    let mut rates = Vec::new();
    let (started, mut timeline) = (Instant::now(), Timeline::default());
    for epoch in 0..args.epochs {
        if epoch > 0 {
            loader.set_epoch(epoch);
        }
        let (t0, mut bytes) = (Instant::now(), 0u64);
        timeline.epoch(t0.duration_since(started).as_secs_f64());
        for batch in loader.by_ref().take(per_epoch as usize) {
            let batch = batch?;
            std::hint::black_box(batch.buffer().as_slice().first());
            let batch_bytes = batch.data_bytes() as u64;
            bytes += batch_bytes;
            values.add(&batch)?;
            timeline.batch(started.elapsed().as_secs_f64(), batch_bytes as f64);
            bar.inc(1);
            if interrupted() {
                break;
            }
        }
        rates.push(bytes as f64 / t0.elapsed().as_secs_f64().max(1e-9));
        if interrupted() {
            break;
        }
    }
    bar.finish_and_clear();
    Ok(EpochsRead {
        rates,
        timeline,
        values,
    })
}

/// Runs the plain multi-threaded memcpy gather of the same records in the same order
/// (`spec`), on `workers` threads, and puts its rate and the loader's ratio to it in `report`.
fn compare_with_gather(
    args: &Args,
    dataset: &dyn Dataset,
    spec: &OrderSpec,
    workers: usize,
    report: &mut Report,
) -> Result<()> {
    let mut buffers = vec![Vec::new(); workers];
    let fields = field_positions(args, dataset.schema());
    let gathered = gpufeed_bench::gather_baseline(
        dataset,
        spec,
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
    Ok(())
}

/// Refuses `--trace` and `--plot` files that would destroy something (`check_output`): the
/// data set read, a file that is not a regular file, the one named by the other flag.
fn check_outputs(args: &Args) -> Result<()> {
    let inputs: Vec<&Path> = [&args.dataset, &args.labels, &args.images]
        .into_iter()
        .flatten()
        .map(|p| p.as_path())
        .collect();
    if let Some(path) = &args.trace {
        check_output("--trace", path, &inputs, None)?;
    }
    if let Some(path) = &args.plot {
        check_output("--plot", path, &inputs, Some(".svg"))?;
    }
    if let (Some(t), Some(p)) = (&args.trace, &args.plot)
        && (t == p
            || std::fs::canonicalize(t)
                .ok()
                .is_some_and(|t| std::fs::canonicalize(p).ok() == Some(t)))
    {
        return Err(refuse("--plot", "names the same file as --trace"));
    }
    Ok(())
}

/// Writes what `--trace` and `--plot` ask for, and says so in the report: the trace, and the
/// run's `timeline` (amounts in bytes, else images) drawn beside the `line` (a baseline or a
/// ceiling, bytes per second), if measured.
fn write_outputs(
    args: &Args,
    trace: Option<&Trace>,
    timeline: &Timeline,
    bytes: bool,
    line: Option<(String, f64)>,
    report: &mut Report,
) -> Result<()> {
    if let (Some(path), Some(trace)) = (&args.trace, trace) {
        trace.write(path)?;
        report.trace = Some(path.display().to_string());
    }
    if let Some(path) = &args.plot {
        let title = format!(
            "gpufeed bench{}: {}, batch {}, {} worker{}, prefetch {}, {} epoch{}",
            if args.images.is_some() {
                " --images"
            } else {
                ""
            },
            if report.generated || args.dataset.is_none() && args.images.is_none() {
                "the generated default data set".to_owned()
            } else {
                report.dataset.clone()
            },
            report.batch_size,
            report.workers,
            if report.workers == 1 { "" } else { "s" },
            report.prefetch,
            report.epochs,
            if report.epochs == 1 { "" } else { "s" },
        );
        let plot = plot::Plot {
            title,
            timeline,
            bytes,
            lines: line.into_iter().collect(),
        };
        plot.write(path)?;
        report.plot = Some(path.display().to_string());
    }
    Ok(())
}

/// `gpufeed bench --images`.
fn run_images(args: &Args, path: &Path, trace: Option<&Trace>) -> Result<()> {
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
    let (decode, cpu_share) = decode_flags(args)?;
    let workers = workers(args);
    // The host's batches hold u8 images with --device (converted on the GPU), else `dtype`.
    let host_dtype = if args.device.is_some() {
        DType::U8
    } else {
        dtype
    };
    let image_bytes = 3 * u64::from(size) * u64::from(size) * host_dtype.size() as u64;
    // Images in the data set, from the front door as the run's own open finds them (O(1) for
    // a packed file, a listing for a folder, the index for shards).
    let options = crate::open::options(&args.read, &args.cache, args.verify)?;
    let records = crate::open::open(path, &options)?.len();
    let (batch_size, batches) = batch_sizes(args, records, 0, 1)?;
    let (prefetch, parts) = LoaderSizes {
        batch_size,
        batches,
        workers,
        prefetch: fixed(args.prefetch),
        parts: fixed(args.batch_parts),
        sample_bytes: image_bytes + 8,
    }
    .check()?;
    let cfg = gpufeed_bench::ImageBenchConfig {
        workers: setting(args.workers, workers, None),
        batch_size: args.batch_size,
        size,
        dtype,
        epochs: args.epochs,
        drop_last: args.drop_last,
        limit: args.limit,
        seed: args.seed,
        skip_bad: args.skip_bad_images,
        max_pixels: args.max_pixels,
        shuffle: !args.no_shuffle,
        prefetch: Some(setting(args.prefetch, prefetch, args.workers)),
        parts: Some(setting(args.batch_parts, parts, args.workers)),
        max_batches: args.max_batches,
        image_field: args.image_field.clone(),
        label_field: args.label_field.clone(),
        verify_checksums: args.verify,
        read_mode: args.read.mode(),
        stop: Some(interrupt_flag()),
        decode,
        cpu_share,
        trace: trace.cloned(),
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
    // With `auto`, what the loader chose.
    let (prefetch, parts) = r
        .tuning
        .as_ref()
        .map_or((prefetch, parts), |t| (t.prefetch, t.batch_parts));
    let mut report = Report {
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
        first_device_batch_ms: r.first_device_batch_ms,
        verdict: r.verdict.clone(),
        tuning: r.tuning.clone(),
        ..Report::default()
    };
    write_outputs(args, trace, &r.timeline, false, None, &mut report)?;
    let what = format!(
        "{} ({}), {size}x{size} {dtype}, decoded on the {}",
        r.source,
        r.kind,
        r.decode.to_uppercase()
    );
    print_report_with(args, report, None, &what)
}

/// Where `--images` decodes (`--decode`) and the share of the GPU's JPEGs the workers take
/// (`--decode-split`: `None` for the measured split), checked against each other and
/// `--device`.
fn decode_flags(args: &Args) -> Result<(Decode, Option<f64>)> {
    let decode: Decode = match args.decode.as_deref() {
        None => Decode::Cpu,
        Some(v) => v
            .parse()
            .map_err(|_| refuse("--decode", format!("{v:?} is not one of cpu, gpu, auto")))?,
    };
    if decode != Decode::Cpu && args.device.is_none() {
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
    if cpu_share.is_some() && decode == Decode::Cpu {
        return Err(refuse("--decode-split", "applies to --decode gpu or auto"));
    }
    Ok((decode, cpu_share))
}
