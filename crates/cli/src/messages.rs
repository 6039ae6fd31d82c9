//! The command's errors, in the user's words: the library names its settings as Rust does
//! (`batch_size`, `pool_budget`) and gives advice in its API (`CopyFields::named`,
//! `image_field()`); the command speaks of the flags the user typed and the choices it offers.
//! And the progress bar of long work.

use std::io::IsTerminal;

use gpufeed::Error;
use indicatif::{ProgressBar, ProgressStyle};

/// The flag (or flags) of the command that set the library's setting `setting`, if any.
pub fn flag_of(setting: &str) -> Option<&'static str> {
    Some(match setting {
        "batch_size" => "--batch-size",
        "prefetch" => "--prefetch",
        "batch_parts" => "--batch-parts",
        "workers" | "threads" => "--workers",
        "pool_budget" => "--batch-size/--prefetch (the batch pool holds --prefetch + 2 batches)",
        "ragged_budget" => "--ragged-budget",
        "drop_last" => "--drop-last",
        "evaluation" => "--evaluation",
        "shard" | "rank" | "world" | "RANK" | "WORLD_SIZE" | "SLURM_PROCID" | "SLURM_NTASKS" => {
            "--shard"
        }
        "epochs" => "--epochs",
        "size" => "--image-size",
        "image_dtype" | "dtype" => "--image-dtype",
        "image_field" => "--image-field",
        "label_field" => "--label-field",
        "max_pixels" => "--max-pixels",
        "fields" => "--fields",
        "records" => "--records",
        "record_bytes" => "--record-bytes",
        "max_batches" => "--max-batches",
        "limit" => "--limit",
        "dataset" | "path" => "DATASET",
        "read_mode" => "--read-mode",
        "verify_checksums" => "--verify",
        "cache_dir" => "--cache-dir",
        "cache_limit" => "--cache-limit",
        "weights" => "--tokens PATH=WEIGHT",
        "sources" => "--tokens",
        "eos_token" => "--eos-token",
        "text_field" => "--text-field",
        _ => return None,
    })
}

/// Library advice and Rust names in a message, as the command's flags.
pub fn in_flags(text: &str) -> String {
    let mut s = text.to_owned();
    for (rust, flags) in [
        (
            "pick tensor fields with CopyFields::named",
            "pick tensor fields with --fields NAME,... (for encoded images: gpufeed bench --images)",
        ),
        ("CopyFields::named", "--fields"),
        (
            "name the encoded image field with image_field()",
            "name the encoded image field with --image-field NAME",
        ),
        ("image_field()", "--image-field"),
        ("OnBadImage::Skip", "--skip-bad-images"),
        ("drop_last", "--drop-last"),
        ("batch_size", "--batch-size"),
        ("pool_budget", "the batch pool's budget"),
        ("ragged_budget", "--ragged-budget"),
    ] {
        s = s.replace(rust, flags);
    }
    s
}

/// The message `gpufeed` prints for `e`, after "gpufeed: error: ".
pub fn describe(e: &Error) -> String {
    let text = match e {
        Error::InvalidConfig { setting, what } if setting.starts_with('-') => {
            format!("{setting}: {}", in_flags(what))
        }
        Error::InvalidConfig { setting, what } => match flag_of(setting) {
            Some(flag) => format!("{flag}: {}", in_flags(what)),
            None => in_flags(&e.to_string()),
        },
        Error::Spawn {
            setting,
            thread,
            source,
        } => match flag_of(setting) {
            Some(flag) => format!("{flag}: cannot start {thread}: {source}"),
            None => e.to_string(),
        },
        _ => raised_with_flag(e).unwrap_or_else(|| in_flags(&e.to_string())),
    };
    // A command built without object stores: the command that builds one with them.
    let mut text = text.replace(
        gpufeed::source::shards::NO_STORE_ADVICE,
        "install the command with them: cargo install --locked --profile dist --path crates/cli --features s3 (or gcs, azure, http)",
    );
    if let Error::Sample { source, .. } = e
        && matches!(**source, Error::Image { .. })
    {
        text.push_str(
            "\n  (--skip-bad-images skips images that cannot be decoded, and counts them)",
        );
    }
    if let Error::Io {
        op: "map", source, ..
    } = e
        && source.raw_os_error() == Some(libc::ENOMEM)
    {
        text.push_str(
            "\n  (the kernel refused another memory map: its limit on maps per process, \
             vm.max_map_count, or on address space, ulimit -v, was reached)",
        );
    }
    text
}

/// The message of an image refused by a limit (in a sample of a batch, or alone), ending with
/// the flag that raises the limit instead of the library's builder method; `None` for any
/// other error.
fn raised_with_flag(e: &Error) -> Option<String> {
    match e {
        Error::Sample {
            index,
            batch,
            source,
        } => raised_with_flag(source).map(|m| format!("sample {index} (batch {batch}): {m}")),
        Error::Batch { batch, source } => {
            raised_with_flag(source).map(|m| format!("batch {batch}: {m}"))
        }
        Error::Image {
            source_name,
            what,
            setting: Some(setting),
            source,
        } => {
            let flag = flag_of(setting).map_or_else(|| setting.to_string(), |f| format!("{f} N"));
            let cause = source
                .as_ref()
                .map(|c| format!(": {c}"))
                .unwrap_or_default();
            Some(format!(
                "{source_name}: {what}; raise it with {flag}{cause}"
            ))
        }
        _ => None,
    }
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
