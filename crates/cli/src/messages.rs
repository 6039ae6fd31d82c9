//! The command's errors, in the user's words: the library names its settings as Rust does
//! (`batch_size`, `pool_budget`) and gives advice in its API (`CopyFields::named`,
//! `image_field()`); the command speaks of the flags the user typed and the choices it offers.

use gpufeed::Error;

/// Formats a byte count with a binary unit (`1.5 MiB`), as the library's reports do.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// The flag (or flags) of the command that set the library's setting `setting`, if any.
pub fn flag_of(setting: &str) -> Option<&'static str> {
    Some(match setting {
        "batch_size" => "--batch-size",
        "prefetch" => "--prefetch",
        "batch_parts" => "--batch-parts",
        "workers" | "threads" => "--workers",
        "pool_budget" => "--batch-size/--prefetch (the batch pool holds --prefetch + 2 batches)",
        "drop_last" => "--drop-last",
        "evaluation" => "--evaluation",
        "shard" | "rank" | "world" | "RANK" | "WORLD_SIZE" | "SLURM_PROCID" | "SLURM_NTASKS" => {
            "--shard"
        }
        "epochs" => "--epochs",
        "size" => "--image-size",
        "image_dtype" | "dtype" => "--image-dtype",
        "image_field" => "--image-field",
        "fields" => "--fields",
        "records" => "--records",
        "record_bytes" => "--record-bytes",
        "max_batches" => "--max-batches",
        "limit" => "--limit",
        "dataset" => "DATASET",
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
    ] {
        s = s.replace(rust, flags);
    }
    s
}

/// The message `gpufeed` prints for `e`, after "gpufeed: error: ".
pub fn describe(e: &Error) -> String {
    let mut text = match e {
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
        _ => in_flags(&e.to_string()),
    };
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
