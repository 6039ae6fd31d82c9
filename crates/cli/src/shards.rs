//! Sharded data sets on the command line: what counts as one (a shard directory, a `.tar`
//! file, a brace pattern, an `s3://`-style URL), opening it with the cache flags, and
//! `gpufeed inspect` of one.
//!
//! URLs take their endpoint and keys from the store's usual variables (`AWS_ENDPOINT_URL` or
//! `AWS_ENDPOINT`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION` or
//! `AWS_DEFAULT_REGION`, `AWS_ALLOW_HTTP`), and need a command built with the store's feature
//! (`--features s3`, `gcs`, `azure`, `http`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpufeed::source::shards::{self, ShardedSource, StoreStats};
use gpufeed::{Dataset, Error, Result};
use serde::Serialize;
use serde_json::{Value, json};

/// Where downloaded shards are cached (for URLs).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct CacheFlags {
    /// The cache directory of shards downloaded from a URL [default: $GPUFEED_CACHE_DIR, else
    /// ~/.cache/gpufeed/objects].
    #[arg(long, value_name = "DIR")]
    pub cache_dir: Option<PathBuf>,
    /// The most bytes the cache keeps (`200GiB`; least recently used shards go first)
    /// [default: $GPUFEED_CACHE_LIMIT, else 64GiB].
    #[arg(long, value_name = "SIZE")]
    pub cache_limit: Option<String>,
}

/// True if `path` names a sharded data set rather than one file: a URL, a directory of
/// shards (`index.json` or `.tar` files), a `.tar` file, a brace pattern or a `::` list.
pub fn is_input(path: &Path) -> bool {
    let Some(s) = path.to_str() else {
        return false;
    };
    shards::is_store_url(s)
        || shards::is_shard_dir(path)
        || s.contains("::")
        || s.contains('{')
        || s.ends_with(".tar")
}

/// Opens the sharded data set `path` names; with `verify` (`--verify`), every shard is checked
/// against its index's hashes each time it is opened, and each sample's own checksum where
/// the format has one (`ShardOptions::verify`).
pub fn open(path: &Path, cache: &CacheFlags, verify: bool) -> Result<Arc<dyn ShardedSource>> {
    let spec = path
        .to_str()
        .ok_or_else(|| Error::user(format!("{}: not a UTF-8 path", path.display())))?;
    let options = shards::webdataset::WebDatasetOptions {
        shards: shards::ShardOptions {
            verify,
            ..shards::ShardOptions::default()
        },
        ..shards::webdataset::WebDatasetOptions::default()
    };
    if shards::is_store_url(spec) {
        return open_url(spec, cache, &options);
    }
    if cache.cache_dir.is_some() || cache.cache_limit.is_some() {
        return Err(Error::InvalidConfig {
            setting: "--cache-dir",
            what: "--cache-dir and --cache-limit apply to URLs (s3://...) only".into(),
        });
    }
    Ok(Arc::from(shards::open_with(spec, &options)?))
}

#[cfg(feature = "remote")]
fn open_url(
    spec: &str,
    cache: &CacheFlags,
    options: &shards::webdataset::WebDatasetOptions,
) -> Result<Arc<dyn ShardedSource>> {
    use gpufeed::source::shards::remote::{RemoteOptions, open_url_with};
    let mut o = RemoteOptions::from_env()?;
    if let Some(dir) = &cache.cache_dir {
        o.cache_dir = Some(dir.clone());
    }
    if let Some(limit) = &cache.cache_limit {
        o.cache_limit = gpufeed::source::shards::packed::parse_byte_size(limit).map_err(|_| {
            Error::InvalidConfig {
                setting: "--cache-limit",
                what: format!("`{limit}` is not a size such as 200GiB"),
            }
        })?;
    }
    Ok(Arc::from(open_url_with(spec, options, o)?))
}

#[cfg(not(feature = "remote"))]
fn open_url(
    spec: &str,
    _cache: &CacheFlags,
    options: &shards::webdataset::WebDatasetOptions,
) -> Result<Arc<dyn ShardedSource>> {
    // The library says which feature the build lacks.
    Ok(Arc::from(shards::open_with(spec, options)?))
}

/// A store's counts in a report: every figure of [`StoreStats`], and the same as one line of
/// text.
#[derive(Clone, Debug, Default, Serialize)]
pub struct StoreReport {
    #[serde(flatten)]
    pub stats: StoreStats,
    /// The counts as one line of text.
    pub summary: String,
}

impl From<StoreStats> for StoreReport {
    fn from(stats: StoreStats) -> StoreReport {
        StoreReport {
            summary: stats.to_string(),
            stats,
        }
    }
}

/// `gpufeed inspect` of a sharded data set: its format, shards, samples and fields; with
/// `verify`, every shard checked whole (checksums where the index has them, every sample).
pub fn inspect(path: &Path, verify: bool, as_json: bool) -> Result<()> {
    let data = open(path, &CacheFlags::default(), false)?;
    let sizes = data.shard_sizes().unwrap_or_default();
    let names = data.shard_names();
    let (min, max) = (
        sizes.iter().copied().min().unwrap_or(0),
        sizes.iter().copied().max().unwrap_or(0),
    );
    let mean = if sizes.is_empty() {
        0.0
    } else {
        data.len() as f64 / sizes.len() as f64
    };
    let mut report = json!({
        "path": path.display().to_string(),
        "format": data.format_name(),
        "shards": names.len(),
        "samples": data.len(),
        "fields": crate::messages::fields_json(data.schema()),
        "samples_per_shard": {"min": min, "mean": mean, "max": max},
        "first_shard": names.first(),
        "last_shard": names.last(),
        "compression": data.compression(),
    });
    let mut text = format!(
        "data set:      {}\nformat:        {} shards\nshards:        {} ({} .. {})\nsamples:       {} \
         ({min} to {max} per shard, mean {mean:.1})\nfields:\n",
        path.display(),
        data.format_name(),
        names.len(),
        names.first().map_or("", String::as_str),
        names.last().map_or("", String::as_str),
        data.len(),
    );
    if let Some(c) = data.compression() {
        text.push_str(&format!(
            "compressed:    {c} (each shard decompressed once into the cache, {})\n",
            "--cache-dir or $GPUFEED_CACHE_DIR"
        ));
    }
    text.push_str(&crate::messages::fields_text(data.schema()));
    let mut fault = None;
    if verify {
        let bar = crate::messages::progress(names.len() as u64, "verify", as_json);
        let result = data.verify(&mut |n| bar.set_position(n as u64));
        bar.finish_and_clear();
        report["verified"] = Value::Bool(result.is_ok());
        match result {
            Ok(()) => text.push_str(&format!(
                "verified:      all {} shards (checksums where the index has them, every sample)\n",
                names.len()
            )),
            Err(e) => fault = Some(e),
        }
    }
    if let Some(s) = data.store_stats() {
        text.push_str(&format!("store:         {s}\n"));
        report["store"] = serde_json::to_value(StoreReport::from(s)).unwrap_or(Value::Null);
    }
    if as_json {
        if let Some(e) = &fault {
            report["error"] = Value::String(e.to_string());
        }
        crate::out(report)?;
    } else {
        crate::out(text.trim_end_matches('\n'))?;
    }
    match fault {
        Some(e) => Err(e),
        None => Ok(()),
    }
}
