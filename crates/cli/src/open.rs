//! What the user names on the command line (a file, a directory, a pattern, a URL), opened
//! through the library's front door ([`gpufeed::source::open`]) with the flags that say how to
//! read it: `--read-mode`, `--verify`, `--cache-dir`, `--cache-limit`. And the store's counts
//! as a report shows them.
//!
//! URLs take their endpoint and keys from the store's usual variables (`AWS_ENDPOINT_URL` or
//! `AWS_ENDPOINT`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION` or
//! `AWS_DEFAULT_REGION`, `AWS_ALLOW_HTTP`), and need a command built with the store's feature
//! (`--features s3`, `gcs`, `azure`, `http`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpufeed::format::ReadOptions;
use gpufeed::source::shards::StoreStats;
use gpufeed::source::{OpenOptions, Source};
use gpufeed::{Error, Result};
use serde::Serialize;

use crate::read_mode::ReadFlags;

/// Where decompressed and downloaded shards are kept.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct CacheFlags {
    /// The cache directory of shards downloaded from a URL or decompressed (MDS zstd/gz
    /// shards, .jsonl.gz/.zst files) [default: $GPUFEED_CACHE_DIR, else
    /// ~/.cache/gpufeed/objects].
    #[arg(long, value_name = "DIR")]
    pub cache_dir: Option<PathBuf>,
    /// The most bytes the cache keeps (`200GiB`; least recently used shards go first)
    /// [default: $GPUFEED_CACHE_LIMIT, else 64GiB].
    #[arg(long, value_name = "SIZE")]
    pub cache_limit: Option<String>,
}

/// The library's options for the flags: `--read-mode`, `--verify` (every record's checksum
/// where the format has them; every shard against its index), the cache flags.
pub fn options(read: &ReadFlags, cache: &CacheFlags, verify: bool) -> Result<OpenOptions> {
    let cache_limit = match &cache.cache_limit {
        None => None,
        Some(limit) => Some(
            gpufeed::source::shards::packed::parse_byte_size(limit).map_err(|_| {
                Error::InvalidConfig {
                    setting: "--cache-limit",
                    what: format!("`{limit}` is not a size such as 200GiB"),
                }
            })?,
        ),
    };
    Ok(OpenOptions {
        read: ReadOptions {
            mode: read.mode(),
            verify_checksums: verify,
        },
        cache_dir: cache.cache_dir.clone(),
        cache_limit,
        ..OpenOptions::default()
    })
}

/// Opens what `path` names, as the library's front door does.
pub fn open(path: &Path, options: &OpenOptions) -> Result<Arc<dyn Source>> {
    Ok(Arc::from(gpufeed::source::open(path, options)?))
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
