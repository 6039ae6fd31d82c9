//! `gpufeed bench`'s flags, and the checks that refuse what does not apply to a run.

use std::path::PathBuf;

use gpufeed::format::Schema;
use gpufeed::loader::{CpuBudget, Setting};
use gpufeed::transform::CopyFields;
use gpufeed::{Error, Result};

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
    /// The fields to batch, by name, comma-separated (default: every field; for encoded
    /// images use --images, or name them here to batch their bytes). A variable-size field
    /// (text, tokens, encoded bytes) is batched as one values buffer plus offsets.
    #[arg(long, value_delimiter = ',', value_name = "NAME,...")]
    pub fields: Option<Vec<String>>,
    /// Bytes of values one batch may hold in each variable-size (ragged) field; a batch that
    /// needs more is an error [default: measured from the first samples: twice the mean
    /// batch or more].
    #[arg(long, value_name = "BYTES")]
    pub ragged_budget: Option<u64>,
    /// Samples per batch.
    #[arg(long, default_value_t = 256)]
    pub batch_size: usize,
    /// Worker threads (default: the available parallelism, at most 16; two fewer with --device,
    /// for the copy thread and the consumer). `auto`: chosen by the loader from a short
    /// measurement on the first batches, within the CPUs this process may use (the report
    /// says what it chose and why).
    #[arg(long, value_name = "N|auto", value_parser = parse_setting)]
    pub workers: Option<Setting>,
    /// Batches in flight (default: --workers + 2, more for small batches; for batches made in
    /// parts, 2 + twice --workers / --batch-parts; never more than an epoch's batches). `auto`
    /// (also its default with --workers auto): the same rule for the workers chosen, within a
    /// memory budget.
    #[arg(long, value_name = "N|auto", value_parser = parse_setting)]
    pub prefetch: Option<Setting>,
    /// Make each batch in N parts, written by N workers at once (default: one per worker for
    /// batches of 4 MiB or more, else 1: each batch by one worker). `auto` (also its
    /// default with --workers auto): the same rule for the workers chosen.
    #[arg(long, value_name = "N|auto", value_parser = parse_setting)]
    pub batch_parts: Option<Setting>,
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
    /// directory, a packed file of images or a sharded data set with an image field
    /// (WebDataset jpg/png members, an MDS jpeg/png column; a directory, pattern or URL),
    /// instead of raw records.
    #[arg(long, value_name = "DIR|PACKED|SHARDS|URL")]
    pub images: Option<PathBuf>,
    /// Output side of the image pipeline's crops [default: 224] (with --images).
    #[arg(long)]
    pub image_size: Option<u32>,
    /// Output dtype of the image pipeline: u8, f16, bf16 or f32 (normalised with ImageNet's
    /// mean and std unless u8) [default: u8] (with --images).
    #[arg(long)]
    pub image_dtype: Option<String>,
    /// The field that holds the encoded images [default: image, else the data set's one
    /// field of JPEG or PNG bytes, such as a WebDataset's jpg] (with --images).
    #[arg(long, value_name = "NAME")]
    pub image_field: Option<String>,
    /// The field of integer labels [default: label, else cls (WebDataset's class), else
    /// none] (with --images).
    #[arg(long, value_name = "NAME")]
    pub label_field: Option<String>,
    /// Skip images that cannot be decoded (counted in the report) instead of failing (with
    /// --images).
    #[arg(long)]
    pub skip_bad_images: bool,
    /// The most pixels an image may declare; a larger one is refused before it is decoded (a
    /// decompression bomb), as a bad image [default: 89478485, PIL's MAX_IMAGE_PIXELS] (with
    /// --images).
    #[arg(long, value_name = "PIXELS")]
    pub max_pixels: Option<u64>,
    /// Stop the image pipeline after this many images (all epochs together) (with --images).
    #[arg(long)]
    pub limit: Option<u64>,
    /// Where the image pipeline decodes JPEGs: cpu (the workers), gpu (nvJPEG on the
    /// --device's GPU, crop/resize/normalise kernels there; the workers decode what it cannot)
    /// or auto (gpu where nvJPEG loads) [default: cpu] (with --images).
    #[arg(long, value_name = "cpu|gpu|auto")]
    pub decode: Option<String>,
    /// With --decode gpu|auto, the share (0 to 1) of the JPEGs the GPU could take that the
    /// workers decode instead, or `auto` (found from what each side costs) [default: auto].
    #[arg(long, value_name = "SHARE|auto")]
    pub decode_split: Option<String>,
    /// Also print the loader's internals: its own stage table, queues, batch pool.
    #[arg(long, short = 'v')]
    pub verbose: bool,
    /// Print one JSON object instead of text (the same keys for every kind of run).
    #[arg(long)]
    pub json: bool,
    /// Write the run's timeline to FILE as Chrome trace-event JSON (open it in
    /// ui.perfetto.dev or chrome://tracing): a track per worker, the consumer, the copy
    /// thread and the copy stream (with --device), pool allocations, epochs.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Draw the run's throughput over time to FILE.svg, beside the plain baseline or the copy
    /// ceiling when measured, the epochs marked.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// Check the data set's bytes against its checksums as it is read (a record whose bytes
    /// changed is an error, never data), and measure what that costs: every record of a
    /// packed file against its stored checksum, every row of a .npy array against a checksum
    /// taken when it is opened; a sharded data set's shards against its index's hashes each
    /// time one is opened (by default a local shard is checked once, when first opened), and
    /// each record of packed shards against its own checksum. An ImageFolder has no checksums.
    #[arg(long)]
    pub verify: bool,
    /// How DATASET (a packed file or a .npy array, and --labels) is read.
    #[command(flatten)]
    pub read: crate::read_mode::ReadFlags,
    /// Shards whose samples are shuffled together (a sharded data set's two-level shuffle)
    /// [default: 8].
    #[arg(long, value_name = "SHARDS")]
    pub shuffle_window: Option<u64>,
    /// Consecutive samples read as one run in the two-level shuffle [default: 64].
    #[arg(long, value_name = "SAMPLES")]
    pub shuffle_block: Option<u64>,
    /// The cache of shards downloaded from a URL.
    #[command(flatten)]
    pub cache: crate::open::CacheFlags,
    /// Run the token loader over this source of tokens (a Megatron dataset's `.idx`, `.bin`
    /// or prefix, a 1-D `.npy`, or a flat file with --token-dtype), `=WEIGHT` for a blend;
    /// repeat for several. --batch-size is then the global batch, in rows.
    #[arg(long, value_name = "SOURCE[=WEIGHT]")]
    pub tokens: Vec<String>,
    /// Tokens per row (with --tokens) [default: 2048].
    #[arg(long, value_name = "N")]
    pub seq_len: Option<usize>,
    /// Rows of the token loader: concatenated or packed (with --tokens) [default: concatenated].
    #[arg(long, value_name = "MODE")]
    pub token_mode: Option<String>,
    /// The dtype of flat token files (nanoGPT's train.bin: u16) (with --tokens).
    #[arg(long, value_name = "DTYPE")]
    pub token_dtype: Option<String>,
    /// Tokenize text on the fly with this tokenizer.json (or a hub directory holding one):
    /// every --tokens source that is not token ids (a Megatron dataset, a `.npy`, a `.bin`)
    /// is then data whose --text-field is read as text (Parquet, Arrow, JSON lines, shards).
    #[arg(long, value_name = "TOKENIZER")]
    pub tokenizer: Option<std::path::PathBuf>,
    /// The field of text of the --tokens sources read with --tokenizer [default: text].
    #[arg(long, value_name = "NAME")]
    pub text_field: Option<String>,
}

/// `RANK/WORLD` as two whole numbers.
pub(super) fn parse_shard(v: &str) -> Result<(u64, u64)> {
    let parsed = v
        .split_once('/')
        .and_then(|(r, w)| Some((r.trim().parse().ok()?, w.trim().parse().ok()?)));
    parsed.ok_or_else(|| Error::InvalidConfig {
        setting: "--shard",
        what: format!("{v:?} is not RANK/WORLD (like 0/2) or env"),
    })
}

/// The rank and world size of `--shard` (`env`: torchrun's or Slurm's variables); the whole
/// data set without it.
pub(super) fn shard_of(args: &Args) -> Result<(u64, u64)> {
    match args.shard.as_deref() {
        None => Ok((0, 1)),
        Some("env") => gpufeed::loader::rank_from_env(),
        Some(v) => parse_shard(v),
    }
}

/// The samples one batch of the run holds (`--batch-size`, or all that the rank reads in an
/// epoch of `len` samples if that is fewer, as the loader sizes its buffers:
/// [`OrderSpec::batch_capacity`](gpufeed::sampler::OrderSpec::batch_capacity)) and the batches
/// of an epoch. The order's settings are checked as the loader checks them (a `--drop-last` run
/// with a batch larger than the rank's share is refused here, before anything is written or
/// allocated).
pub(super) fn batch_sizes(args: &Args, len: u64, rank: u64, world: u64) -> Result<(usize, u64)> {
    let spec = gpufeed::sampler::OrderSpec {
        len,
        batch_size: args.batch_size as u64,
        shuffle: None,
        rank,
        world,
        remainder: gpufeed::sampler::Remainder::of(args.drop_last, args.evaluation)?,
        blocks: None,
    };
    spec.validate()?;
    let capacity = usize::try_from(spec.batch_capacity()).unwrap_or(args.batch_size);
    Ok((capacity, spec.batches()))
}

pub(super) fn refuse(flag: &'static str, what: impl Into<String>) -> Error {
    Error::InvalidConfig {
        setting: flag,
        what: what.into(),
    }
}

/// Refuses settings that cannot work and flags that do not apply to this kind of run.
pub(super) fn check_flags(args: &Args) -> Result<()> {
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
        ("--label-field", args.label_field.is_some()),
        ("--skip-bad-images", args.skip_bad_images),
        ("--max-pixels", args.max_pixels.is_some()),
        ("--limit", args.limit.is_some()),
        ("--decode", args.decode.is_some()),
        ("--decode-split", args.decode_split.is_some()),
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
            ("--ragged-budget", args.ragged_budget.is_some()),
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

/// The most workers a run starts: `--workers`, the CPU budget for `--workers auto`, or the
/// library's default (one per CPU, at most 16; two CPUs fewer with `--device`).
pub(super) fn workers(args: &Args) -> usize {
    match args.workers {
        Some(Setting::Fixed(n)) => n,
        Some(Setting::Auto) => CpuBudget::of_this_thread(args.device.is_some()).budget,
        None => gpufeed::loader::default_workers(args.device.is_some()),
    }
}

/// `auto` or a whole number (`--workers`, `--prefetch`, `--batch-parts`).
fn parse_setting(v: &str) -> std::result::Result<Setting, String> {
    if v.trim().eq_ignore_ascii_case("auto") {
        return Ok(Setting::Auto);
    }
    v.trim()
        .parse::<usize>()
        .map(Setting::Fixed)
        .map_err(|_| format!("{v:?} is neither a whole number nor auto"))
}

/// The number a setting fixes (`None` for `auto` or not given).
pub(super) fn fixed(setting: Option<Setting>) -> Option<usize> {
    match setting {
        Some(Setting::Fixed(n)) => Some(n),
        _ => None,
    }
}

/// What the loader is given for a setting: `auto` as it is, else the number checked
/// (`checked`, the flag's value or its default). Prefetch and parts not given are `auto` too
/// when the workers they follow (`follows`) are: their default rules then apply to the workers
/// chosen, not to the budget's.
pub(super) fn setting(given: Option<Setting>, checked: usize, follows: Option<Setting>) -> Setting {
    match (given, follows) {
        (Some(Setting::Auto), _) | (None, Some(Setting::Auto)) => Setting::Auto,
        _ => Setting::Fixed(checked),
    }
}

/// The positions of `--fields` in `schema` (`None` for every field), for the baseline to copy
/// what the loader batches. The names were checked against the schema with the transform.
pub(super) fn field_positions(args: &Args, schema: &Schema) -> Option<Vec<usize>> {
    let names = args.fields.as_ref()?;
    Some(names.iter().filter_map(|n| schema.index_of(n)).collect())
}

/// The transform of a records run: every field, or those of `--fields`.
pub(super) fn copy_fields(args: &Args) -> CopyFields {
    match &args.fields {
        Some(names) => CopyFields::named(names.iter().cloned()),
        None => CopyFields::all(),
    }
}
