//! Shards from object storage: [`RemoteStore`], a [`ShardStore`] that downloads shards into a
//! local disk cache through the `object_store` crate, and [`open_url`], a sharded dataset from
//! a URL (`s3://bucket/prefix/`, `gs://`, `az://`, `http(s)://`, `file://`).
//!
//! The loader's worker threads see no async: the store owns a small tokio runtime and every
//! call blocks the calling thread only as long as the bytes it asks for take to arrive.
//!
//! - **Downloads** are parallel ranged GETs of `part_bytes` each, at most `parallel_parts` at
//!   once per shard and `max_requests` at once over the store. Each part is written in place
//!   into a temporary file of the shard's final size, and each range is served as soon as it
//!   has arrived ([`ShardBytes::arriving`]): a reader waits for its range only, and the parts
//!   readers wait for are fetched first. Packed shards, which are opened by path, wait for the
//!   whole shard ([`ShardStore::local_file`]).
//! - **Retries**: a request that fails (an error answer other than not-found or refused, a
//!   body cut short, a time-out, a stall) is sent again for the bytes still missing, after a
//!   backoff that doubles from `backoff` up to `max_backoff`, at most `retries` times; each
//!   retry is counted ([`StoreStats::retries`]). A missing object, a missing bucket and refused
//!   credentials are not retried: they are [`Error::Remote`] with their
//!   [`RemoteErrorKind`], naming the shard's URL.
//! - **Checks**: once a shard has all arrived, and before any byte of it is read or it is
//!   renamed into the cache, it is checked against the index's checksum where the index has
//!   one this store computes (a packed index's `xxh3_64`; an MDS index's `xxh3_64` or
//!   `xxh64`), else, from S3, against its ETag where that is the MD5 of its bytes (an object
//!   uploaded in one part). A shard that fails is fetched again, at most `checksum_retries`
//!   times; one that fails every time, or gives the same wrong bytes twice (the object is not
//!   the one the index describes), is [`RemoteErrorKind::Checksum`](crate::RemoteErrorKind)
//!   naming its URL (and the loader's error names the sample), is never read, is not cached,
//!   and is refused again, without a fetch, for as long as the store lives. Every fetch that
//!   failed is counted ([`StoreStats::checksum_failures`]). Readers of a shard with a check
//!   therefore wait for the whole shard; a shard with none is read range by range as it
//!   arrives. Every part's answer must be of the object's size (else
//!   [`RemoteErrorKind::SizeMismatch`](crate::RemoteErrorKind), naming the size the index or
//!   the listing says and the size the store gave), and of the ETag (`If-Match`) the object
//!   had when listed or looked at, so that no shard is put together from two versions of an
//!   object.
//!
//!   What is checked end to end (from the writer to the reader): packed shards, and MDS
//!   shards whose index has `xxh3_64` or `xxh64` hashes. From the store to the reader only:
//!   MDS shards without those hashes and WebDataset tar shards (and `index.json` itself) from
//!   S3 when their ETag is an MD5. Their size only (counted as
//!   [`StoreStats::unverified`]): the same from S3 when uploaded in several parts (the ETag
//!   is the MD5 of the parts' MD5s, which cannot be checked without each part's size), or
//!   encrypted with SSE-KMS or SSE-C, or from a server whose ETags are not MD5s (found out
//!   when two fetches give the same bytes and not the ETag's MD5: the store then checks no
//!   ETag, so such a bucket costs one shard fetched twice), and everything from GCS, Azure,
//!   HTTP servers and `file://`. S3's own `x-amz-checksum-*` values are not used:
//!   `object_store` hands out no response header but the ETag, size, time and version.
//!   Listings (the sizes and ETags of tar shards) carry no checksum. With `verify_checksums`
//!   off, nothing but sizes is checked, and shards are read as they arrive.
//! - **Prefetch**: the loader announces the samples of the next `read_ahead_batches` batches
//!   ([`Dataset::read_ahead`](crate::Dataset::read_ahead)); the store starts fetching their
//!   shards in that order, at most `prefetch_shards` at once, on a thread of its own.
//! - **The cache** is a directory shared by every process of the machine
//!   (ranks, data loader processes): a shard is downloaded once per machine, the others wait
//!   for it; files are whole or absent (temporary name, then rename); a byte limit is kept by
//!   removing the least recently used shards. A process that dies mid-fetch (`kill -9`, or a
//!   `SIGTERM` or `SIGINT` it has no handler for) leaves its temporary file, never a shard
//!   that reads as whole; the next store opened on the cache removes it.
//! - **Changes between epochs** are not looked for:
//!   [`Dataset::check_unchanged`](crate::Dataset::check_unchanged) passes for a dataset of this
//!   store ([`ShardStore::files_may_change`] is false). Its local files are the cache's copies,
//!   named by the object's version and never written in place: touched at every use, removed
//!   to make room and fetched again by any process of the machine, all without a byte of a
//!   shard changing (an open shard keeps reading the copy it mapped). A change of the object in
//!   the store itself is not seen either: that would take a request per shard at every epoch.
//!   A store opened again (a new run) looks again: a copy's version is the index's checksum
//!   where the index has one (a cached copy that matches the index is read; an object that no
//!   longer matches it is refused when fetched), else the object's ETag or modification time
//!   and its size (a changed object is fetched anew, under a new name).
//!
//! Endpoint and keys come from the usual variables of each store (`AWS_ENDPOINT_URL` or
//! `AWS_ENDPOINT`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`,
//! `AWS_REGION` or `AWS_DEFAULT_REGION`, `AWS_ALLOW_HTTP` for S3; `GOOGLE_*` for GCS;
//! `AZURE_*` for Azure). Each store is behind a cargo feature (`s3`, `gcs`, `azure`, `http`);
//! `file://` needs `remote` only.

use super::cache;
mod check;
mod download;
mod url;

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use object_store::{ObjectStore, ObjectStoreExt};

use super::mds::{MdsDataset, MdsShards};
use super::packed::PackedShards;
use super::webdataset::{WebDataset, WebDatasetOptions};
use super::{ShardBytes, ShardOptions, ShardStat, ShardStore, ShardedSource, StoreStats};
use crate::error::{Error, RemoteErrorKind, Result};
use cache::DiskCache;
use check::ContentCheck;
use download::Download;

/// Settings of a [`RemoteStore`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteOptions {
    /// The cache directory; `None`: `$GPUFEED_CACHE_DIR`, else `default_cache_dir()/objects`.
    pub cache_dir: Option<PathBuf>,
    /// The most bytes of shards the cache keeps on disk (whole shards, and those arriving).
    pub cache_limit: u64,
    /// Bytes per ranged GET.
    pub part_bytes: u64,
    /// Ranged GETs in flight at once for one shard.
    pub parallel_parts: usize,
    /// Requests in flight at once over the whole store.
    pub max_requests: usize,
    /// Shards fetched ahead of the readers at once.
    pub prefetch_shards: usize,
    /// How many batches ahead the loader announces its samples (0: no prefetch).
    pub read_ahead_batches: usize,
    /// Times a failed request is sent again.
    pub retries: u32,
    /// The first wait before a retry; it doubles with each retry of one request.
    pub backoff: Duration,
    /// The longest wait before a retry.
    pub max_backoff: Duration,
    /// A request whose answer (or its next piece of body) takes longer fails and is retried.
    pub request_timeout: Duration,
    /// Connecting takes at most this long.
    pub connect_timeout: Duration,
    /// Check each shard once it has arrived, before any of it is read or cached: against the
    /// index's checksum, else (S3) against its ETag where that is an MD5 (see the
    /// [module](self) documentation). False: shards are read as they arrive, with their sizes
    /// checked only.
    pub verify_checksums: bool,
    /// Times a shard whose bytes fail their check is fetched again before it is an error.
    pub checksum_retries: u32,
    /// Threads of the store's runtime (network and writes into the cache).
    pub runtime_threads: usize,
    /// Settings of the store's client by their `object_store` names (`aws_endpoint`,
    /// `aws_access_key_id`, `aws_allow_http`, `google_service_account`, ...), applied over
    /// those of the environment.
    pub settings: Vec<(String, String)>,
}

impl Default for RemoteOptions {
    fn default() -> Self {
        RemoteOptions {
            cache_dir: None,
            cache_limit: cache::DEFAULT_LIMIT,
            part_bytes: 8 << 20,
            parallel_parts: 4,
            max_requests: 16,
            prefetch_shards: 4,
            read_ahead_batches: 64,
            retries: 8,
            backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(5),
            request_timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(10),
            verify_checksums: true,
            checksum_retries: 2,
            runtime_threads: 2,
            settings: Vec::new(),
        }
    }
}

impl RemoteOptions {
    /// The defaults, with the cache's place and limit from `GPUFEED_CACHE_DIR` and
    /// `GPUFEED_CACHE_LIMIT` (a size such as `200GiB`) where they are set.
    pub fn from_env() -> Result<RemoteOptions> {
        let (cache_dir, cache_limit) = cache::settings_from_env()?;
        Ok(RemoteOptions {
            cache_dir,
            cache_limit: cache_limit.unwrap_or(cache::DEFAULT_LIMIT),
            ..RemoteOptions::default()
        })
    }

    fn check(&self) -> Result<()> {
        let positive = [
            ("part_bytes", self.part_bytes as usize),
            ("parallel_parts", self.parallel_parts),
            ("max_requests", self.max_requests),
            ("runtime_threads", self.runtime_threads),
            (
                "cache_limit",
                self.cache_limit.min(usize::MAX as u64) as usize,
            ),
        ];
        for (setting, v) in positive {
            if v == 0 {
                return Err(Error::config(setting, "must be at least 1"));
            }
        }
        Ok(())
    }

    /// The cache directory these settings name.
    pub fn cache_root(&self) -> PathBuf {
        self.cache_dir.clone().unwrap_or_else(cache::default_root)
    }
}

/// What the index says a shard must be: its size and, where it has one, its checksum.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Expected {
    /// The shard's size in bytes.
    pub bytes: u64,
    /// Its checksum, if the index has one this reader checks.
    pub checksum: Option<Checksum>,
}

/// A shard checksum as an index gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Checksum {
    /// xxh3-64, seed 0 (packed indexes; MDS `xxh3_64`).
    Xxh3_64(u64),
    /// xxh64, seed 0 (MDS `xxh64`).
    Xxh64(u64),
}

impl Checksum {
    fn of(&self, bytes: &[u8]) -> u64 {
        match self {
            Checksum::Xxh3_64(_) => xxhash_rust::xxh3::xxh3_64(bytes),
            Checksum::Xxh64(_) => xxhash_rust::xxh64::xxh64(bytes, 0),
        }
    }

    fn want(&self) -> u64 {
        match self {
            Checksum::Xxh3_64(v) | Checksum::Xxh64(v) => *v,
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Checksum::Xxh3_64(_) => "xxh3-64",
            Checksum::Xxh64(_) => "xxh64",
        }
    }
}

/// Counters behind [`StoreStats`].
#[derive(Default)]
pub(crate) struct Counters {
    pub bytes_fetched: AtomicU64,
    pub requests: AtomicU64,
    pub retries: AtomicU64,
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
    pub shared_downloads: AtomicU64,
    pub cache_evictions: AtomicU64,
    pub cache_full: AtomicU64,
    pub checksum_failures: AtomicU64,
    pub unverified: AtomicU64,
    pub prefetched: AtomicU64,
    pub waited_nanos: AtomicU64,
}

impl Counters {
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    fn snapshot(&self) -> StoreStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StoreStats {
            bytes_fetched: get(&self.bytes_fetched),
            requests: get(&self.requests),
            retries: get(&self.retries),
            cache_hits: get(&self.cache_hits),
            cache_misses: get(&self.cache_misses),
            shared_downloads: get(&self.shared_downloads),
            cache_evictions: get(&self.cache_evictions),
            cache_full: get(&self.cache_full),
            checksum_failures: get(&self.checksum_failures),
            unverified: get(&self.unverified),
            prefetched: get(&self.prefetched),
            waited: Duration::from_nanos(get(&self.waited_nanos)),
        }
    }
}

/// What every thread of a [`RemoteStore`] shares (its runtime excepted: see [`RemoteStore`]).
pub(crate) struct Inner {
    /// The store's URL, without a trailing `/` (for messages).
    pub base: String,
    pub store: Arc<dyn ObjectStore>,
    /// The object key prefix shard names are relative to.
    pub prefix: String,
    pub handle: tokio::runtime::Handle,
    pub options: RemoteOptions,
    pub cache: DiskCache,
    pub requests: Arc<tokio::sync::Semaphore>,
    pub stats: Counters,
    /// The store's ETags of 32 hex digits are MD5s of the objects' bytes ([`url::Target`]),
    /// until an object shows otherwise (two fetches with the same bytes, not the ETag's).
    md5_etags: AtomicBool,
    expected: Mutex<HashMap<String, Expected>>,
    /// Shards refused for bytes that are not the object's (failed checks, another size or
    /// version than expected): a later read is told so again, without another fetch.
    refused: Mutex<HashMap<String, download::Failure>>,
    /// What the store said of each shard it was asked about or listed: size, modification
    /// time, ETag (from a HEAD request, or the listing of tar shards).
    heads: Mutex<HashMap<String, ShardStat>>,
    inflight: Mutex<HashMap<String, Arc<Download>>>,
    /// Shards this store has fetched: found whole later, they are no cache hit.
    fetched: Mutex<HashSet<String>>,
    prefetch: Mutex<PrefetchQueue>,
    prefetch_cv: Condvar,
    stop: AtomicBool,
}

#[derive(Default)]
struct PrefetchQueue {
    names: VecDeque<String>,
    queued: HashSet<String>,
    /// Shard fetches the prefetcher started that have not finished.
    active: usize,
}

/// A [`ShardStore`] over an object store, with a local disk cache (see the
/// [module](self) documentation).
pub struct RemoteStore {
    inner: Arc<Inner>,
    prefetcher: Option<std::thread::JoinHandle<()>>,
    /// Dropped last: the runtime's threads stop when the store goes.
    runtime: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for RemoteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteStore")
            .field("url", &self.inner.base)
            .field("cache", &self.inner.cache.root())
            .finish()
    }
}

impl RemoteStore {
    /// A store of the objects under `url` (`s3://bucket/prefix`, `gs://...`, `az://...`,
    /// `http(s)://...`, `file:///...`), shard names being keys relative to it. Sends no
    /// request.
    pub fn new(url: &str, options: RemoteOptions) -> Result<RemoteStore> {
        options.check()?;
        let target = url::parse(url, &options)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(options.runtime_threads)
            .thread_name("gpufeed-remote")
            .enable_all()
            .build()
            .map_err(|e| Error::spawn("runtime_threads", "the store's threads", e))?;
        let cache = DiskCache::new(options.cache_root(), options.cache_limit, &target.base)?;
        // Fetches of processes that died (killed, or stopped by a signal with no handler) left
        // their temporary files: this run removes them before it adds its own.
        cache.remove_abandoned();
        let inner = Arc::new(Inner {
            md5_etags: AtomicBool::new(target.md5_etags && options.verify_checksums),
            base: target.base,
            store: target.store,
            prefix: target.prefix,
            handle: runtime.handle().clone(),
            requests: Arc::new(tokio::sync::Semaphore::new(options.max_requests)),
            options,
            cache,
            stats: Counters::default(),
            expected: Mutex::new(HashMap::new()),
            refused: Mutex::new(HashMap::new()),
            heads: Mutex::new(HashMap::new()),
            inflight: Mutex::new(HashMap::new()),
            fetched: Mutex::new(HashSet::new()),
            prefetch: Mutex::new(PrefetchQueue::default()),
            prefetch_cv: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let prefetcher =
            if inner.options.prefetch_shards > 0 && inner.options.read_ahead_batches > 0 {
                let inner = Arc::clone(&inner);
                Some(
                    std::thread::Builder::new()
                        .name("gpufeed-prefetch".into())
                        .spawn(move || prefetch_loop(&inner))
                        .map_err(|e| Error::spawn("prefetch_shards", "the prefetch thread", e))?,
                )
            } else {
                None
            };
        Ok(RemoteStore {
            inner,
            prefetcher,
            runtime: Some(runtime),
        })
    }

    /// The store's URL (without a trailing `/`).
    pub fn url(&self) -> &str {
        &self.inner.base
    }

    /// The settings it runs with.
    pub fn options(&self) -> &RemoteOptions {
        &self.inner.options
    }

    /// The cache directory.
    pub fn cache_dir(&self) -> &Path {
        self.inner.cache.root()
    }

    /// Records what the index says shard `name` is: its size (no request is then needed to
    /// learn it) and its checksum, checked on arrival. The checksum (else the size) also keys
    /// the shard's file in the cache.
    pub fn expect(&self, name: &str, expected: Expected) {
        lock(&self.inner.expected).insert(name.to_owned(), expected);
    }

    /// The whole object `name` (an index file), fetched with retries, not cached.
    pub fn fetch_small(&self, name: &str) -> Result<Vec<u8>> {
        self.inner.fetch_small(name)
    }

    /// The names (relative to the store's URL) of the objects under it whose names end with
    /// `suffix`, sorted. What the listing says of each (size, ETag, modification time) is
    /// kept: no HEAD request is made for them later.
    pub fn list(&self, suffix: &str) -> Result<Vec<String>> {
        self.inner.list(suffix)
    }

    /// What the store has done so far.
    pub fn stats(&self) -> StoreStats {
        self.inner.stats.snapshot()
    }
}

impl Drop for RemoteStore {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::Relaxed);
        self.inner.prefetch_cv.notify_all();
        if let Some(t) = self.prefetcher.take() {
            let _ = t.join();
        }
        // Fetches still running stop with the runtime; their temporary files go.
        let unfinished: Vec<Arc<Download>> =
            lock(&self.inner.inflight).drain().map(|(_, d)| d).collect();
        for d in &unfinished {
            d.cancel();
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
        for d in unfinished {
            d.remove_temporary();
        }
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a shard is in the store now, as far as this store knows.
struct Version {
    /// Its size.
    bytes: u64,
    /// What names its copy in the cache: the index's checksum, else a hash of the object's
    /// ETag (or modification time) and size.
    key: String,
    /// The object's ETag, where the store gave one (not asked for when the index has a
    /// checksum).
    etag: Option<String>,
}

/// Where a shard is now.
enum Entry {
    /// Whole, in the cache, at this path.
    Whole(PathBuf),
    /// Arriving (fetched by this process).
    Arriving(Arc<Download>),
    /// Being fetched by another process (only for a prefetch, which does not wait).
    Elsewhere,
}

impl Inner {
    /// Whether the index says what shard `name` is (its size and checksum: see
    /// [`RemoteStore::expect`]).
    pub(crate) fn expects(&self, name: &str) -> bool {
        lock(&self.expected).contains_key(name)
    }

    pub(crate) fn url_of(&self, name: &str) -> PathBuf {
        PathBuf::from(format!("{}/{name}", self.base))
    }

    pub(crate) fn key_of(&self, name: &str) -> object_store::path::Path {
        object_store::path::Path::from(format!("{}{name}", self.prefix))
    }

    /// The size of the largest shard whose size is known without fetching it: from the index
    /// ([`Expected`]), else from the listing or a HEAD request (tar shards); 0 if none is.
    fn largest_known(&self) -> u64 {
        let indexed = lock(&self.expected).values().map(|e| e.bytes).max();
        let listed = lock(&self.heads).values().map(|s| s.bytes).max();
        indexed.max(listed).unwrap_or(0)
    }

    fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.handle.block_on(f)
    }

    /// What the shard is now, from the index (a checksum and a size) or else from a HEAD
    /// request made once (or the listing): see [`Version`].
    fn version(&self, name: &str) -> Result<Version> {
        if let Some(e) = lock(&self.expected).get(name)
            && let Some(c) = e.checksum
        {
            return Ok(Version {
                bytes: e.bytes,
                key: format!("{:016x}", c.want()),
                etag: None,
            });
        }
        let stat = self.head(name)?;
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(stat.tag.as_deref().unwrap_or("").as_bytes());
        if stat.tag.is_none() {
            let t = stat
                .modified
                .and_then(|m| m.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            h.update(&t.to_le_bytes());
        }
        h.update(&stat.bytes.to_le_bytes());
        if self.md5_etag(stat.tag.as_deref()).is_some() {
            // Copies cached before ETags were checked get other names: not trusted.
            h.update(b"md5-etag");
        }
        Ok(Version {
            bytes: stat.bytes,
            key: format!("{:016x}", h.digest()),
            etag: stat.tag,
        })
    }

    /// The MD5 the ETag `tag` gives, where this store's ETags are MD5s (see
    /// [`check::md5_of_etag`]).
    fn md5_etag(&self, tag: Option<&str>) -> Option<u128> {
        tag.filter(|_| self.etags_are_md5())
            .and_then(check::md5_of_etag)
    }

    /// Whether ETags of 32 hex digits are still taken for MD5s (see `Inner::md5_etags`).
    pub(crate) fn etags_are_md5(&self) -> bool {
        self.md5_etags.load(Ordering::Relaxed)
    }

    /// An object's ETag of 32 hex digits was not the MD5 of its bytes (an encrypted object's,
    /// a server's own kind): this store checks no ETag from now on; its shards without a
    /// checksum in their index are checked by size only.
    pub(crate) fn etags_are_not_md5(&self) {
        self.md5_etags.store(false, Ordering::Relaxed);
    }

    /// What shard `name` is checked against once it has all arrived: the index's checksum,
    /// else its MD5 ETag, unless checks are off.
    fn content_check(
        &self,
        expected: Option<&Expected>,
        etag: Option<&str>,
    ) -> Option<ContentCheck> {
        if !self.options.verify_checksums {
            return None;
        }
        match expected.and_then(|e| e.checksum) {
            Some(c) => Some(ContentCheck::Index(c)),
            None => self.md5_etag(etag).map(ContentCheck::Md5Etag),
        }
    }

    fn head(&self, name: &str) -> Result<ShardStat> {
        if let Some(s) = lock(&self.heads).get(name) {
            return Ok(s.clone());
        }
        let key = self.key_of(name);
        let url = self.url_of(name);
        let meta = self.block_on(download::with_retries(self, &url, || {
            let key = key.clone();
            async move { self.store.head(&key).await }
        }))?;
        let stat = ShardStat {
            bytes: meta.size,
            modified: Some(std::time::SystemTime::from(meta.last_modified)),
            tag: meta.e_tag.clone(),
        };
        lock(&self.heads).insert(name.to_owned(), stat.clone());
        Ok(stat)
    }

    /// The whole object `name`, fetched again while its body is short (a request failure,
    /// retried as one) or does not match its MD5 ETag (at most `checksum_retries` times, as a
    /// shard is).
    fn fetch_small(&self, name: &str) -> Result<Vec<u8>> {
        let key = self.key_of(name);
        let url = self.url_of(name);
        let mut fetches = check::Fetches::default();
        loop {
            let (bytes, etag) = self.block_on(download::with_retries(self, &url, || {
                let key = key.clone();
                async move {
                    let got = self.store.get(&key).await?;
                    let (size, etag) = (got.meta.size, got.meta.e_tag.clone());
                    let bytes = got.bytes().await?;
                    if bytes.len() as u64 != size {
                        return Err(object_store::Error::Generic {
                            store: "gpufeed",
                            source: format!("the body is {} bytes, the object {size}", bytes.len())
                                .into(),
                        });
                    }
                    Ok((bytes, etag))
                }
            }))?;
            Counters::add(&self.stats.bytes_fetched, bytes.len() as u64);
            let Some(check) = self.content_check(None, etag.as_deref()) else {
                return Ok(bytes.to_vec());
            };
            let verdict =
                fetches.judge(&check, check.digest(&bytes), self.options.checksum_retries);
            if verdict == check::Verdict::Again {
                continue;
            }
            Counters::add(&self.stats.checksum_failures, fetches.failures(&verdict));
            match verdict {
                check::Verdict::Refused { what } => {
                    return Err(Error::Remote {
                        shard: url,
                        kind: RemoteErrorKind::Checksum,
                        what,
                    });
                }
                check::Verdict::NotAHash => self.etags_are_not_md5(),
                check::Verdict::Good | check::Verdict::Again => {}
            }
            return Ok(bytes.to_vec());
        }
    }

    fn list(&self, suffix: &str) -> Result<Vec<String>> {
        let prefix = object_store::path::Path::from(self.prefix.trim_end_matches('/'));
        let url = PathBuf::from(format!("{}/", self.base));
        let metas = self.block_on(download::with_retries(self, &url, || {
            let prefix = prefix.clone();
            async move {
                use futures_util::StreamExt;
                let mut stream = self.store.list(Some(&prefix));
                let mut out = Vec::new();
                while let Some(m) = stream.next().await {
                    out.push(m?);
                }
                Ok(out)
            }
        }))?;
        let mut names = Vec::new();
        for m in metas {
            let key = m.location.to_string();
            let Some(name) = key.strip_prefix(&self.prefix) else {
                continue;
            };
            if name.ends_with(suffix) {
                lock(&self.heads).insert(
                    name.to_owned(),
                    ShardStat {
                        bytes: m.size,
                        modified: Some(std::time::SystemTime::from(m.last_modified)),
                        tag: m.e_tag.clone(),
                    },
                );
                names.push(name.to_owned());
            }
        }
        names.sort();
        Ok(names)
    }

    /// Where shard `name` is, starting its fetch if it is nowhere. `demand`: a reader needs it
    /// now (it waits for another process's fetch, and counts a cache hit); else a prefetch.
    fn entry(self: &Arc<Self>, name: &str, demand: bool) -> Result<Entry> {
        if let Some(d) = lock(&self.inflight).get(name)
            && !d.failed()
        {
            return Ok(Entry::Arriving(Arc::clone(d)));
        }
        if let Some(e) = self.refusal(name) {
            return Err(e);
        }
        let version = self.version(name)?;
        let bytes = version.bytes;
        let path = self.cache.path_for(name, &version.key);
        let mut waited_since: Option<Instant> = None;
        loop {
            if self.cache.touch_if_whole(&path) {
                if demand && !lock(&self.fetched).contains(name) {
                    Counters::add(&self.stats.cache_hits, 1);
                }
                if let Some(t) = waited_since {
                    Counters::add(&self.stats.waited_nanos, t.elapsed().as_nanos() as u64);
                }
                return Ok(Entry::Whole(path));
            }
            let mut inflight = lock(&self.inflight);
            if let Some(d) = inflight.get(name)
                && !d.failed()
            {
                return Ok(Entry::Arriving(Arc::clone(d)));
            }
            match self.cache.try_lock(&path)? {
                Some(guard) => {
                    // Whole now? Another process may have finished between the two looks.
                    if self.cache.touch_if_whole(&path) {
                        drop(guard);
                        continue;
                    }
                    // Refused by a fetch of this store that ended since the first look.
                    if let Some(e) = self.refusal(name) {
                        return Err(e);
                    }
                    let url = self.url_of(name);
                    let expected = lock(&self.expected).get(name).cloned();
                    if let Some(e) = &expected
                        && e.bytes != bytes
                    {
                        return Err(Error::Remote {
                            shard: url,
                            kind: RemoteErrorKind::SizeMismatch,
                            what: format!(
                                "the store says the object is {bytes} bytes, the index says {}: it is not the object the index describes (replaced since?)",
                                e.bytes
                            ),
                        });
                    }
                    let evicted = match self.cache.make_room(bytes, &path) {
                        Ok(n) => n,
                        Err(what) => {
                            Counters::add(&self.stats.cache_full, 1);
                            return Err(Error::Remote {
                                shard: url,
                                kind: RemoteErrorKind::CacheFull,
                                what,
                            });
                        }
                    };
                    Counters::add(&self.stats.cache_evictions, evicted);
                    Counters::add(&self.stats.cache_misses, 1);
                    lock(&self.fetched).insert(name.to_owned());
                    let check = self.content_check(expected.as_ref(), version.etag.as_deref());
                    // A weak ETag may not match a strong `If-Match`: sent only strong.
                    let if_match = version.etag.filter(|t| !t.starts_with("W/"));
                    let d = Download::start(self, name, url, bytes, path, check, if_match, guard)?;
                    inflight.insert(name.to_owned(), Arc::clone(&d));
                    return Ok(Entry::Arriving(d));
                }
                None => {
                    drop(inflight);
                    // Another process of the machine is fetching it: wait for its file.
                    if !demand {
                        return Ok(Entry::Elsewhere);
                    }
                    if waited_since.is_none() {
                        waited_since = Some(Instant::now());
                        Counters::add(&self.stats.shared_downloads, 1);
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }

    /// A fetch has ended (whole or failed): it leaves the set of fetches in flight.
    /// Shard `name` is refused for its bytes: every later look at it says so, with no fetch.
    pub(crate) fn refuse(&self, name: &str, failure: &download::Failure) {
        lock(&self.refused).insert(name.to_owned(), failure.clone());
    }

    /// The error of a shard refused for its bytes, if it was.
    fn refusal(&self, name: &str) -> Option<Error> {
        lock(&self.refused)
            .get(name)
            .map(|f| f.error(&self.url_of(name)))
    }

    pub(crate) fn finished(&self, name: &str, d: &Download) {
        let mut inflight = lock(&self.inflight);
        if inflight.get(name).is_some_and(|x| std::ptr::eq(&**x, d)) {
            inflight.remove(name);
        }
        drop(inflight);
        // `done` or `failed` is set before this call, and the prefetcher marks a fetch as its
        // own under the same lock only while neither is: so each mark is counted down once.
        let mut q = lock(&self.prefetch);
        if d.prefetched() {
            q.active = q.active.saturating_sub(1);
            drop(q);
            self.prefetch_cv.notify_all();
        }
    }

    fn open_bytes(self: &Arc<Self>, name: &str) -> Result<ShardBytes> {
        let url = self.url_of(name);
        let mut tries = 0;
        loop {
            match self.entry(name, true)? {
                Entry::Whole(path) => match ShardBytes::map_file(&path) {
                    Ok(mapped) => {
                        let all = mapped.share(0..mapped.len())?;
                        return Ok(ShardBytes::new(url, all));
                    }
                    // Removed (another process made room) between the look and the map:
                    // look again, which fetches it anew.
                    Err(Error::Io { source, .. })
                        if source.kind() == std::io::ErrorKind::NotFound && tries < 3 =>
                    {
                        tries += 1;
                    }
                    Err(e) => return Err(e),
                },
                Entry::Arriving(d) => return Ok(ShardBytes::arriving(url, d.bytes(), d)),
                Entry::Elsewhere => return unreachable_elsewhere(&url),
            }
        }
    }

    fn whole_file(self: &Arc<Self>, name: &str) -> Result<PathBuf> {
        match self.entry(name, true)? {
            Entry::Whole(path) => Ok(path),
            Entry::Arriving(d) => {
                d.wait_whole()?;
                Ok(d.final_path().to_path_buf())
            }
            Entry::Elsewhere => unreachable_elsewhere(&self.url_of(name)),
        }
    }
}

/// `entry(.., demand = true)` waits instead of answering `Elsewhere`; an error, not a panic,
/// should that ever change.
fn unreachable_elsewhere<T>(url: &Path) -> Result<T> {
    Err(Error::Remote {
        shard: url.to_path_buf(),
        kind: RemoteErrorKind::Unavailable,
        what: "another process is fetching the shard".into(),
    })
}

/// The prefetch thread: starts the fetches of announced shards, in order, at most
/// `prefetch_shards` at once.
fn prefetch_loop(inner: &Arc<Inner>) {
    loop {
        let name = {
            let mut q = lock(&inner.prefetch);
            loop {
                if inner.stop.load(Ordering::Relaxed) {
                    return;
                }
                if q.active < inner.options.prefetch_shards
                    && let Some(n) = q.names.pop_front()
                {
                    q.queued.remove(&n);
                    break n;
                }
                q = inner
                    .prefetch_cv
                    .wait_timeout(q, Duration::from_millis(200))
                    .map(|(g, _)| g)
                    .unwrap_or_else(|e| e.into_inner().0);
            }
        };
        if lock(&inner.inflight).contains_key(&name) {
            continue;
        }
        // Errors are the reader's to see, when it asks for the shard.
        if let Ok(Entry::Arriving(d)) = inner.entry(&name, false) {
            let mut q = lock(&inner.prefetch);
            if !d.is_done() && d.mark_prefetched() {
                q.active += 1;
                Counters::add(&inner.stats.prefetched, 1);
            }
        }
    }
}

impl ShardStore for RemoteStore {
    fn locate(&self, name: &str) -> PathBuf {
        self.inner.url_of(name)
    }

    fn stat(&self, name: &str) -> Result<ShardStat> {
        if let Some(e) = lock(&self.inner.expected).get(name)
            && let Some(c) = e.checksum
        {
            return Ok(ShardStat {
                bytes: e.bytes,
                modified: None,
                tag: Some(format!("{}:{:016x}", c.name(), c.want())),
            });
        }
        self.inner.head(name)
    }

    fn open(&self, name: &str) -> Result<ShardBytes> {
        self.inner.open_bytes(name)
    }

    fn local_file(&self, name: &str) -> Result<PathBuf> {
        self.inner.whole_file(name)
    }

    /// False: the files are the cache's own copies, which change (touched, evicted, fetched
    /// again) without their bytes changing; see the [module](self) documentation.
    fn files_may_change(&self) -> bool {
        false
    }

    /// False: every shard is checked as it arrives, against the same hashes of the index,
    /// before any byte of it is read (or, with `verify_checksums` off, by its size only, as
    /// asked); its copy in the cache is then read as it is.
    fn check_hashes_on_open(&self) -> bool {
        false
    }

    fn read_ahead_batches(&self) -> usize {
        if self.prefetcher.is_some() {
            self.inner.options.read_ahead_batches
        } else {
            0
        }
    }

    fn prefetch(&self, name: &str) {
        if self.prefetcher.is_none() {
            return;
        }
        let mut q = lock(&self.inner.prefetch);
        if q.queued.contains(name) || lock(&self.inner.inflight).contains_key(name) {
            return;
        }
        // Announcements are bounded by the loader's read-ahead; this bound only guards
        // against a caller that announces without reading.
        if q.names.len() >= 65_536 {
            return;
        }
        q.queued.insert(name.to_owned());
        q.names.push_back(name.to_owned());
        drop(q);
        self.inner.prefetch_cv.notify_all();
    }

    fn stats(&self) -> Option<StoreStats> {
        Some(self.inner.stats.snapshot())
    }
}

/// `shards` with at most as many shards open as the store's cache holds of the largest shard
/// (at least one). An open shard is a mapping of its cache file: it keeps the file's pages
/// resident and, once the cache has evicted the file, its disk space taken, until it is
/// dropped; so without this bound an epoch over a data set larger than the cache would keep
/// up to `max_open_shards` shards resident and on disk whatever the cache limit.
///
/// The sizes are those the store knows before fetching any shard: the index's for packed
/// shards and MDS, the listing's for tar shards under a URL (a HEAD request's for the one
/// `.tar` object a URL names). Called once they are known; with none known (no shard), the
/// options are left as they are.
fn mapped_within_cache(store: &RemoteStore, shards: &ShardOptions) -> ShardOptions {
    let largest = store.inner.largest_known();
    let mut shards = shards.clone();
    if let Some(fit) = store.options().cache_limit.checked_div(largest) {
        let fit = usize::try_from(fit).unwrap_or(usize::MAX).max(1);
        shards.max_open_shards = shards.max_open_shards.min(fit);
    }
    shards
}

/// Opens the sharded dataset under `url`, with the cache settings of
/// [`RemoteOptions::from_env`]: see [`open_url_with`].
pub fn open_url(url: &str, options: &WebDatasetOptions) -> Result<Box<dyn ShardedSource>> {
    open_url_with(url, options, RemoteOptions::from_env()?)
}

/// Opens the sharded dataset under `url`: packed shards or MDS when `URL/index.json` exists
/// (told apart by its content, as for a local directory), else the `.tar` objects under the
/// URL (sorted), or the one `.tar` object the URL names. Fetches the index (or lists the
/// objects, or asks for the one object's size), and for tar shards their sample counts
/// (cached); no other shard. At most as many shards stay open as the cache holds of the
/// largest (see [`RemoteOptions::cache_limit`]), fewer if `options.shards` says so.
pub fn open_url_with(
    url: &str,
    options: &WebDatasetOptions,
    remote: RemoteOptions,
) -> Result<Box<dyn ShardedSource>> {
    let trimmed = url.trim_end_matches('/');
    if trimmed.ends_with(".tar") {
        let (dir, file) = trimmed.rsplit_once('/').unwrap_or(("", trimmed));
        let store = RemoteStore::new(dir, remote)?;
        // Its size, for the bound on open shards; reading its index asks again, answered from
        // what this request learned.
        store.stat(file)?;
        let options = WebDatasetOptions {
            shards: mapped_within_cache(&store, &options.shards),
            ..options.clone()
        };
        return Ok(Box::new(WebDataset::from_store(
            Arc::new(store),
            vec![file.to_owned()],
            options,
        )?));
    }
    let store = RemoteStore::new(trimmed, remote)?;
    let index_url = store.inner.url_of("index.json");
    match store.fetch_small("index.json") {
        Ok(text) => match super::open::index_kind(&index_url, &text)? {
            super::open::IndexKind::Packed => {
                let index = super::packed::PackedIndex::parse(&index_url, &text)?;
                for s in &index.shards {
                    let checksum = u64::from_str_radix(&s.xxh3_64, 16)
                        .ok()
                        .map(Checksum::Xxh3_64);
                    store.expect(
                        &s.name,
                        Expected {
                            bytes: s.bytes,
                            checksum,
                        },
                    );
                }
                let shards = mapped_within_cache(&store, &options.shards);
                Ok(Box::new(PackedShards::from_index(
                    Arc::new(store),
                    &index_url,
                    &text,
                    shards,
                )?))
            }
            super::open::IndexKind::Mds => {
                let mut index = MdsShards::read_index(&index_url, &text)?;
                // Sizes and hashes for the store (the one parse of the index). A compressed
                // shard is fetched as its compressed file, checked against that file's
                // hashes, and decompressed into this store's cache (`compressed`).
                for (k, (name, _)) in index.shards.iter().enumerate() {
                    let Some(file) = index.format.file(k) else {
                        continue;
                    };
                    let checksum = |h: &super::mds::ShardHashes| {
                        h.xxh3_64
                            .map(Checksum::Xxh3_64)
                            .or_else(|| h.xxh64.map(Checksum::Xxh64))
                    };
                    store.expect(
                        name,
                        Expected {
                            bytes: file.bytes,
                            checksum: checksum(&file.hashes),
                        },
                    );
                    if let Some(zip) = &file.zip {
                        store.expect(
                            &zip.name,
                            Expected {
                                bytes: zip.bytes,
                                checksum: checksum(&zip.hashes),
                            },
                        );
                    }
                }
                index.format.raw_first = false;
                let shards = ShardOptions {
                    cache_dir: Some(store.options().cache_root()),
                    cache_limit: Some(store.options().cache_limit),
                    ..mapped_within_cache(&store, &options.shards)
                };
                Ok(Box::new(MdsDataset::from_read_index(
                    index,
                    Arc::new(store),
                    shards,
                )?))
            }
        },
        Err(Error::Remote {
            kind: RemoteErrorKind::NotFound,
            ..
        }) => {
            let tars = store.list(".tar")?;
            if tars.is_empty() {
                return Err(Error::Remote {
                    shard: PathBuf::from(format!("{trimmed}/")),
                    kind: RemoteErrorKind::NotFound,
                    what: "no index.json (packed shards or MDS) and no .tar object under this URL"
                        .into(),
                });
            }
            // The listing gave each shard's size (see `Inner::list`).
            let options = WebDatasetOptions {
                shards: mapped_within_cache(&store, &options.shards),
                ..options.clone()
            };
            Ok(Box::new(WebDataset::from_store(
                Arc::new(store),
                tars,
                options,
            )?))
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store over `dir` (a `file://` URL) with a cache of `cache_limit` bytes in `cache`.
    fn store(dir: &Path, cache: &Path, cache_limit: u64) -> RemoteStore {
        let options = RemoteOptions {
            cache_dir: Some(cache.to_path_buf()),
            cache_limit,
            prefetch_shards: 0,
            runtime_threads: 1,
            ..RemoteOptions::default()
        };
        RemoteStore::new(&format!("file://{}", dir.display()), options).unwrap()
    }

    fn bound(store: &RemoteStore, max_open_shards: usize) -> usize {
        let shards = ShardOptions {
            max_open_shards,
            ..ShardOptions::default()
        };
        mapped_within_cache(store, &shards).max_open_shards
    }

    /// Tar shards have no index: the listing's sizes bound the open shards, by the largest
    /// listed tar object only (another object, larger, is not a shard).
    #[test]
    fn tar_sizes_from_the_listing_bound_the_open_shards() {
        let (dir, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        for (name, size) in [("a.tar", 3000), ("b.tar", 5000), ("c.tar", 4000)] {
            std::fs::write(dir.path().join(name), vec![0u8; size]).unwrap();
        }
        std::fs::write(dir.path().join("notes.txt"), vec![0u8; 50_000]).unwrap();
        let s = store(dir.path(), cache.path(), 14_999);
        // Nothing known yet: the options as they are.
        assert_eq!(bound(&s, 1024), 1024);
        assert_eq!(s.list(".tar").unwrap(), ["a.tar", "b.tar", "c.tar"]);
        assert_eq!(s.inner.largest_known(), 5000);
        assert_eq!(bound(&s, 1024), 2);
        assert_eq!(bound(&s, 1), 1, "a smaller setting stays");
        // No more than one shard fits: one stays open all the same.
        let small = store(dir.path(), cache.path(), 4999);
        small.list(".tar").unwrap();
        assert_eq!(bound(&small, 1024), 1);
    }

    /// The one `.tar` object a URL names: its size from a HEAD request.
    #[test]
    fn a_head_request_gives_a_single_tar_its_bound() {
        let (dir, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        std::fs::write(dir.path().join("only.tar"), vec![0u8; 1000]).unwrap();
        let s = store(dir.path(), cache.path(), 3500);
        assert_eq!(s.stat("only.tar").unwrap().bytes, 1000);
        assert_eq!(bound(&s, 1024), 3);
    }

    /// An index's sizes and a listing's count alike: the largest of either.
    #[test]
    fn the_largest_of_index_and_listing_sizes_counts() {
        let (dir, cache) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        std::fs::write(dir.path().join("a.tar"), vec![0u8; 1000]).unwrap();
        let s = store(dir.path(), cache.path(), 10_000);
        s.expect(
            "shard-0.gfd",
            Expected {
                bytes: 2500,
                checksum: None,
            },
        );
        assert_eq!(bound(&s, 1024), 4);
        s.list(".tar").unwrap();
        assert_eq!(bound(&s, 1024), 4);
    }
}
