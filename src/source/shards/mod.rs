//! Sharded datasets: many shard files, each with a sample count known from an index, presented
//! as one map-style [`Dataset`].
//!
//! - [`ShardedDataset`]: the shards of one dataset behind [`Dataset`]: sample `i` of the whole
//!   is found by a binary search over the shards' cumulative counts ([`ShardedDataset::locate`]),
//!   its shard opened on first use and kept in a bounded set of open shards (`lru`), the sample
//!   handed out as a zero-copy view that keeps its shard's bytes alive;
//! - [`ShardFormat`]: what a format supplies (open one shard, cut one sample out of it);
//!   [`packed`] (gpufeed's packed record files and an `index.json`), [`webdataset`] (tar shards
//!   with WebDataset's key rules, an index of members cached on disk) and [`mds`] (MosaicML
//!   Streaming's MDS directories);
//! - [`ShardStore`]: where shards' bytes come from ([`LocalDir`]: files, memory-mapped);
//! - [`ShardedSource`]: what a streaming order needs of any sharded dataset (shard names, the
//!   mapping from a global index to its shard; the sizes are [`Dataset::shard_sizes`], which
//!   the loader's `shuffle_blocks` reads), as a trait object;
//! - [`open_index_dir`], [`open_tar_dir`], [`open_pattern`]: these by how they are named
//!   (the front door, [`source::open`](crate::source::open()), says which).
//!
//! Opening a dataset reads its index only: no shard is opened or mapped until a sample of it is
//! asked for (a dataset of 10,000 shards opens in the time it takes to parse its index). The
//! one exception is a shard the index (packed or MDS) says holds no sample, which no sample
//! would ever open: it is opened at once and checked against its header, so that an index
//! that says 0 of a shard that holds samples is an error, not samples dropped unseen.
//!
//! # Shard files that change
//!
//! An open shard of a local directory is a mapping of its file, with the same contract as a
//! [`RecordFile`](crate::format::RecordFile)'s: the file must not be truncated or written in
//! place while it is open (see the [`source`](crate::source) module). Each open shard
//! remembers what its file was when it was opened (device, inode, size, modification time),
//! and [`Dataset::check_unchanged`] (which the loader calls at each epoch's start) compares
//! that with what the path names now, for every shard open at that moment, reporting the first
//! changed one (lowest shard number) as [`Error::FileChanged`] naming its file. A shard not
//! open then is not looked at: it has not been opened yet, or it was closed to stay within
//! [`ShardOptions::max_open_shards`], and it is opened afresh, from the file as it is then,
//! when a sample of it is next asked for (and checked against the index: sample count, size,
//! and hashes: see below).
//!
//! Shards fetched from an object store (`remote`, with the `remote` feature) are not looked at
//! for changes: their local files are the cache's own copies, written whole under a name that includes the
//! object's version (its checksum from the index, else its ETag or modification time, and
//! size), touched at every use and removed and fetched again as the cache needs; none of that
//! changes a shard's bytes, and an open shard keeps reading the copy it mapped. A change to
//! the object in the store itself is not seen either: finding it would take a request per
//! shard at every epoch (a dataset opened again looks again). See
//! [`ShardStore::files_may_change`].
//!
//! # Hashes
//!
//! Where a data set's index gives a hash of a shard's file that gpufeed computes (a packed
//! index's `xxh3_64`; an MDS index's `xxh3_64`, `xxh64`, `xxh3_128`/`xxh128` or `xxh32`), a
//! shard read from a local directory is checked against it when it is opened, before its
//! first sample is handed out: a shard whose bytes changed after it was written (a flipped
//! bit, a shard copied over from another data set of the same size) is an
//! [`Error::Malformed`] naming the shard and the hashes (the loader's error names the sample
//! asked for), never samples read from it. The pass over the shard's bytes runs at memory
//! speed (`benches/RESULTS.md`, "Local shards checked against their index when opened") and
//! faults in the pages the samples are then read from; it is made once per file: a shard
//! closed (to stay within [`ShardOptions::max_open_shards`]) and opened again is hashed again
//! only if its file was replaced or written since (device, inode, size, times). Hashes
//! gpufeed does not compute (MDS `sha1`, `md5`, `sha256` and the other cryptographic ones
//! streaming offers) are not checked: a data set that has none of the above is read with its
//! sizes and structure checked only; write it with `hashes=['xxh3_64']` (streaming's fastest)
//! to have it checked.
//! [`ShardOptions::verify`] checks every time a shard is opened, and each packed record's own
//! checksum as it is read; [`ShardedDataset::verify`] checks everything, every sample too.
//!
//! Shards fetched from an object store (`remote`, with the `remote` feature) are checked as
//! they arrive, before any byte is read (see `remote`), and are not hashed again when
//! opened ([`ShardStore::check_hashes_on_open`]); nor are a compressed MDS shard's
//! decompressed copies, checked when they are written into the cache.

pub(crate) mod cache;
pub(crate) mod compressed;
pub mod decode;
mod lru;
pub mod mds;
mod open;
pub mod packed;
#[cfg(feature = "remote")]
pub mod remote;
mod store;
pub mod tar;
pub mod webdataset;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use decode::FieldDecode;
pub use lru::OpenShardStats;
pub use open::{
    NO_STORE_ADVICE, is_store_url, open_index_dir, open_pattern, open_tar_dir, open_tars_named,
};
pub use store::{
    LocalDir, MemoryStore, ShardArrival, ShardBytes, ShardStat, ShardStore, StoreStats,
};

use crate::error::{Error, Result};
use crate::format::Schema;
use crate::source::{Dataset, Description, Format, Sample, Source};
use lru::OpenShards;

/// How many shards a dataset keeps open (mapped, with their headers or indexes read) at once,
/// unless told otherwise. A mapping is one entry of the kernel's per-process map count (65,530
/// by default on Linux) and holds no file descriptor; mapping a shard again costs about as much
/// as copying its bytes when they are in the page cache (`benches/RESULTS.md`, "Streaming"),
/// so the set is generous: a streaming order touches a window of shards at a time.
pub const DEFAULT_MAX_OPEN_SHARDS: usize = 1024;

/// Where a sample of a sharded dataset is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SampleLocation {
    /// The shard's number (its position in the dataset's index).
    pub shard: usize,
    /// The sample's index within that shard.
    pub index: u64,
}

/// Settings common to every sharded format.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardOptions {
    /// The most shards open at once (at least 1): see [`DEFAULT_MAX_OPEN_SHARDS`].
    pub max_open_shards: usize,
    /// Check each shard against its index's checksums every time it is opened (one pass over
    /// the shard's bytes per open, where by default a local shard is hashed once while its
    /// file stays the same: see the [module](self)'s section on hashes), and each sample's
    /// own checksum as it is read where the format has one (packed records). Tar shards,
    /// which have no checksums, are indexed again from their bytes instead of from the cache.
    /// What `gpufeed bench --verify` turns on for a sharded data set.
    pub verify: bool,
    /// Fields declared by name, over what the reader infers from the writer's conventions
    /// (see [`decode`]): how the WebDataset member of that extension, or the MDS column of
    /// that name, becomes the field. A name the data set does not have is an error when it
    /// is opened; packed shards, whose schema is stored, take no declaration.
    pub decode: std::collections::BTreeMap<String, FieldDecode>,
    /// Where shards that are compressed (MDS `compression`) are decompressed to, once, and
    /// read from: the cache directory, `None`: `$GPUFEED_CACHE_DIR`, else
    /// [`default_cache_dir`]`/objects`. From an object store, the store's cache.
    pub cache_dir: Option<PathBuf>,
    /// The most bytes that cache directory holds (decompressed and downloaded shards
    /// together); `None`: `$GPUFEED_CACHE_LIMIT`, else 64 GiB.
    pub cache_limit: Option<u64>,
}

impl Default for ShardOptions {
    fn default() -> Self {
        ShardOptions {
            max_open_shards: DEFAULT_MAX_OPEN_SHARDS,
            verify: false,
            decode: std::collections::BTreeMap::new(),
            cache_dir: None,
            cache_limit: None,
        }
    }
}

/// What a shard format supplies to [`ShardedDataset`]: how to open shard `k`, and how to cut
/// sample `i` out of an open shard.
///
/// The format holds whatever per-shard facts its index gave (column layouts, checksums); the
/// dataset holds the names and counts and the set of open shards.
pub trait ShardFormat: Send + Sync + 'static {
    /// An open shard: its bytes and whatever was read from its header or index.
    type Shard: Send + Sync + 'static;

    /// The format's name in messages (`packed`, `webdataset tar`, `MDS`).
    fn name(&self) -> &'static str;

    /// The format, as the front door names it.
    fn format(&self) -> Format;

    /// How the data set's shards are compressed (`zstd`, ...), if they are; `None` (the
    /// default) for formats read as they are.
    fn compression(&self) -> Option<String> {
        None
    }

    /// The file the store fetches to open shard `k` (called `name` in the index): `name`
    /// itself (the default), or the file the format makes the shard from (a compressed MDS
    /// shard's archive, where the raw file is not in the store). Read-ahead asks the store for
    /// this file, so that it fetches what the shard's opening will read.
    fn store_file<'a>(&'a self, k: usize, name: &'a str) -> &'a str {
        let _ = k;
        name
    }

    /// Opens shard `k` (called `name` in the index), which the index says holds `samples`
    /// samples of `schema`; a shard that disagrees with its index is an error naming it.
    fn open_shard(
        &self,
        store: &dyn ShardStore,
        k: usize,
        name: &str,
        samples: u64,
        schema: &Schema,
        options: &ShardOptions,
    ) -> Result<Self::Shard>;

    /// Sample `index` of open shard `k`, as a view that owns a reference to the shard's bytes
    /// (the shard may be closed while the sample lives). `index` is below the shard's count.
    fn sample<'s>(
        &'s self,
        shard: &Self::Shard,
        k: usize,
        index: u64,
        schema: &'s Schema,
        options: &ShardOptions,
    ) -> Result<Sample<'s>>;

    /// Checks shard `k` completely: its checksums where the index has them, and every sample.
    fn verify_shard(
        &self,
        store: &dyn ShardStore,
        k: usize,
        name: &str,
        samples: u64,
        schema: &Schema,
    ) -> Result<()>;

    /// Checks that the file an open shard reads is still the one it opened, as it was then:
    /// [`Error::FileChanged`] naming the file if not (see [`Dataset::check_unchanged`]).
    /// Called for shards of stores whose files may change ([`ShardStore::files_may_change`]).
    /// The default, `Ok(())`, suits formats whose shards hold no file of their own.
    fn check_unchanged(&self, shard: &Self::Shard) -> Result<()> {
        let _ = shard;
        Ok(())
    }
}

/// A shard format whose directory is described by one index file (gpufeed's packed shards,
/// MosaicML's MDS): [`ShardedDataset::open`] reads it, [`ShardedDataset::from_index`] takes it
/// from anywhere (object storage, a test).
pub trait IndexedFormat: ShardFormat + Sized {
    /// The index's file name in the directory (`index.json`).
    const INDEX_FILE: &'static str;

    /// A dataset whose index (read from `index_path`) is `text`, with its shards in `store`;
    /// opens no shard.
    fn dataset(
        store: Arc<dyn ShardStore>,
        index_path: &Path,
        text: &[u8],
        options: ShardOptions,
    ) -> Result<ShardedDataset<Self>>;
}

impl<F: IndexedFormat> ShardedDataset<F> {
    /// Opens the shard directory `dir` (its index file); opens no shard.
    pub fn open(dir: impl AsRef<Path>) -> Result<ShardedDataset<F>> {
        Self::open_with(dir, ShardOptions::default())
    }

    /// Opens the shard directory `dir` with these settings.
    pub fn open_with(dir: impl AsRef<Path>, options: ShardOptions) -> Result<ShardedDataset<F>> {
        let dir = dir.as_ref();
        let path = dir.join(F::INDEX_FILE);
        let text = std::fs::read(&path).map_err(|e| Error::io(&path, "read", e))?;
        Self::from_index(Arc::new(LocalDir::new(dir)), &path, &text, options)
    }

    /// A dataset whose index (read from `index_path`) is `text`, with its shards in `store`;
    /// opens no shard.
    pub fn from_index(
        store: Arc<dyn ShardStore>,
        index_path: &Path,
        text: &[u8],
        options: ShardOptions,
    ) -> Result<ShardedDataset<F>> {
        F::dataset(store, index_path, text, options)
    }
}

/// The shards of one dataset, as one [`Dataset`] (see the [module](self) documentation).
pub struct ShardedDataset<F: ShardFormat> {
    format: F,
    store: Arc<dyn ShardStore>,
    names: Vec<String>,
    sizes: Vec<u64>,
    /// `ends[k]` = samples in shards `0..=k`.
    ends: Vec<u64>,
    schema: Schema,
    options: ShardOptions,
    open: OpenShards<F::Shard>,
    /// The last shard announced to the store by `read_ahead` (`usize::MAX`: none), so that a
    /// run of samples of one shard is announced once.
    announced: std::sync::atomic::AtomicUsize,
}

impl<F: ShardFormat> std::fmt::Debug for ShardedDataset<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedDataset")
            .field("format", &self.format.name())
            .field("shards", &self.names.len())
            .field("samples", &self.len())
            .field("schema", &self.schema.to_string())
            .finish()
    }
}

impl<F: ShardFormat> ShardedDataset<F> {
    /// A dataset of the shards `shards` (name, sample count) in `store`, read by `format`,
    /// whose samples have `schema`. Opens nothing.
    pub fn from_parts(
        format: F,
        store: Arc<dyn ShardStore>,
        shards: Vec<(String, u64)>,
        schema: Schema,
        options: ShardOptions,
    ) -> Result<ShardedDataset<F>> {
        if options.max_open_shards == 0 {
            return Err(Error::config(
                "max_open_shards",
                "at least one shard must be allowed open",
            ));
        }
        let mut total = 0u64;
        let mut ends = Vec::with_capacity(shards.len());
        for (name, n) in &shards {
            total = total.checked_add(*n).ok_or_else(|| {
                Error::mismatch(format!(
                    "shard `{name}`: the sample counts add up past 2^64"
                ))
            })?;
            ends.push(total);
        }
        let open = OpenShards::new(shards.len(), options.max_open_shards);
        let (names, sizes) = shards.into_iter().unzip();
        Ok(ShardedDataset {
            format,
            store,
            names,
            sizes,
            ends,
            schema,
            options,
            open,
            announced: std::sync::atomic::AtomicUsize::new(usize::MAX),
        })
    }

    /// Opens each shard the index says holds no sample, to check it against the index (as
    /// every shard is when opened), and closes it again: a shard with no sample is never
    /// opened for one, so an index that says 0 of a shard that holds samples would drop them
    /// unseen. Writers write no empty shard: a data set as written has none to open.
    pub(crate) fn check_empty_shards(self) -> Result<Self> {
        for (k, name) in self.names.iter().enumerate() {
            if self.sizes[k] == 0 {
                self.format
                    .open_shard(&*self.store, k, name, 0, &self.schema, &self.options)
                    .map_err(|e| self.unquoted(k, e))?;
            }
        }
        Ok(self)
    }

    /// The format reader.
    pub fn format(&self) -> &F {
        &self.format
    }

    /// Where the shards are.
    pub fn store(&self) -> &dyn ShardStore {
        &*self.store
    }

    /// The number of shards.
    pub fn shard_count(&self) -> usize {
        self.names.len()
    }

    /// Samples in each shard, in index order.
    pub fn shard_sizes(&self) -> &[u64] {
        &self.sizes
    }

    /// Shard names, in index order.
    pub fn shard_names(&self) -> &[String] {
        &self.names
    }

    /// The global index of shard `k`'s first sample (`len()` for `k == shard_count()`).
    pub fn shard_start(&self, k: usize) -> Option<u64> {
        match k {
            0 => Some(0),
            k => self.ends.get(k - 1).copied(),
        }
    }

    /// Where sample `index` is: its shard and its index within the shard (O(log shards)).
    pub fn locate(&self, index: u64) -> Result<SampleLocation> {
        let shard = self.ends.partition_point(|&end| end <= index);
        if shard >= self.ends.len() {
            return Err(Error::OutOfRange {
                index,
                len: self.len(),
            });
        }
        let start = if shard == 0 { 0 } else { self.ends[shard - 1] };
        Ok(SampleLocation {
            shard,
            index: index - start,
        })
    }

    /// What the set of open shards has done.
    pub fn open_stats(&self) -> OpenShardStats {
        self.open.stats()
    }

    /// The settings this dataset reads with.
    pub fn options(&self) -> &ShardOptions {
        &self.options
    }

    /// Shard `k`, opened unless it is open already.
    pub fn shard(&self, k: usize) -> Result<Arc<F::Shard>> {
        let (Some(name), Some(&samples)) = (self.names.get(k), self.sizes.get(k)) else {
            return Err(Error::config(
                "shard",
                format!("shard {k} of a dataset of {}", self.names.len()),
            ));
        };
        self.open.get_or_open(k, || {
            self.format
                .open_shard(&*self.store, k, name, samples, &self.schema, &self.options)
                .map_err(|e| self.unquoted(k, e))
        })
    }

    /// `e`, an error about shard `k`, as its store allows it to be told ([`unquoted`]).
    fn unquoted(&self, k: usize, e: Error) -> Error {
        unquoted(&*self.store, &self.names[k], self.format.name(), e)
    }

    /// Sample `index` within shard `k`. A shard whose bytes cannot be had while it is open (a
    /// store's download that failed, a read that failed: an error of kind
    /// [`ErrorKind::Remote`](crate::ErrorKind) or [`Io`](crate::ErrorKind)) is closed, so that
    /// its next use opens it afresh (its store fetches it again, or says why not) instead of
    /// failing from the same bytes, or reading them, ever after. A sample that is corrupt
    /// leaves its shard open.
    pub fn get_in_shard(&self, k: usize, index: u64) -> Result<Sample<'_>> {
        let shard = self.shard(k)?;
        let samples = self.sizes[k];
        if index >= samples {
            return Err(Error::OutOfRange {
                index,
                len: samples,
            });
        }
        let sample = self
            .format
            .sample(&shard, k, index, &self.schema, &self.options);
        if let Err(e) = &sample
            && matches!(
                e.kind(),
                crate::error::ErrorKind::Remote | crate::error::ErrorKind::Io
            )
        {
            self.open.close(k, &shard);
        }
        sample.map_err(|e| self.unquoted(k, e))
    }

    /// Checks every shard completely (checksums where the index has them, every sample),
    /// calling `progress` with the number of shards checked. Stops at the first fault.
    pub fn verify(&self, mut progress: impl FnMut(usize)) -> Result<()> {
        for (k, (name, &n)) in self.names.iter().zip(&self.sizes).enumerate() {
            self.format
                .verify_shard(&*self.store, k, name, n, &self.schema)
                .map_err(|e| self.unquoted(k, e))?;
            progress(k + 1);
        }
        Ok(())
    }

    /// Where shard `k` is (for messages).
    pub fn shard_path(&self, k: usize) -> Option<PathBuf> {
        self.names.get(k).map(|n| self.store.locate(n))
    }
}

impl<F: ShardFormat> Dataset for ShardedDataset<F> {
    fn len(&self) -> u64 {
        self.ends.last().copied().unwrap_or(0)
    }

    fn schema(&self) -> &Schema {
        &self.schema
    }

    fn get(&self, index: u64) -> Result<Sample<'_>> {
        let at = self.locate(index)?;
        self.get_in_shard(at.shard, at.index)
    }

    fn shard_sizes(&self) -> Option<Vec<u64>> {
        Some(self.sizes.clone())
    }

    fn read_ahead_batches(&self) -> usize {
        self.store.read_ahead_batches()
    }

    /// Tells the store which shards come next, each time the shard changes along `indices`
    /// (so a block of samples of one shard is one announcement).
    fn read_ahead(&self, indices: &[u64]) {
        use std::sync::atomic::Ordering;
        let mut last = self.announced.load(Ordering::Relaxed);
        for &i in indices {
            // The common case: the sample is in the shard announced last.
            if last != usize::MAX {
                let start = self.shard_start(last).unwrap_or(u64::MAX);
                if i >= start && i < self.ends[last] {
                    continue;
                }
            }
            let Ok(at) = self.locate(i) else { continue };
            last = at.shard;
            let file = self.format.store_file(at.shard, &self.names[at.shard]);
            self.store.prefetch(file);
        }
        self.announced.store(last, Ordering::Relaxed);
    }

    /// Checks the file of every shard open now, lowest shard number first, for a store whose
    /// files may change ([`ShardStore::files_may_change`]); shards not open are opened afresh
    /// when next used. See the [module's section](self#shard-files-that-change).
    fn check_unchanged(&self) -> Result<()> {
        if !self.store.files_may_change() {
            return Ok(());
        }
        self.open
            .open_now()
            .iter()
            .try_for_each(|shard| self.format.check_unchanged(shard))
    }
}

/// What a streaming order needs of a sharded dataset, whatever its format: a [`Dataset`]
/// (whose [`Dataset::shard_sizes`] gives the samples in each shard) plus the shards' names
/// and the mapping from a global index to a shard.
pub trait ShardedSource: Source {
    /// Shard names, in index order.
    fn shard_names(&self) -> &[String];

    /// Where sample `index` is.
    fn locate(&self, index: u64) -> Result<SampleLocation>;

    /// The global index of shard `k`'s first sample.
    fn shard_start(&self, k: usize) -> Option<u64>;

    /// What the set of open shards has done.
    fn open_stats(&self) -> OpenShardStats;

    /// What the dataset's store has fetched and cached, for a store that downloads (an
    /// object store); `None` for local files.
    fn store_stats(&self) -> Option<StoreStats> {
        None
    }

    /// How the shards are compressed (an MDS `compression` such as `zstd`), if they are: they
    /// are decompressed once into the cache (see [`ShardOptions::cache_dir`]).
    fn compression(&self) -> Option<String> {
        None
    }
}

impl<F: ShardFormat> ShardedSource for ShardedDataset<F> {
    fn shard_names(&self) -> &[String] {
        ShardedDataset::shard_names(self)
    }
    fn locate(&self, index: u64) -> Result<SampleLocation> {
        ShardedDataset::locate(self, index)
    }
    fn shard_start(&self, k: usize) -> Option<u64> {
        ShardedDataset::shard_start(self, k)
    }
    fn open_stats(&self) -> OpenShardStats {
        ShardedDataset::open_stats(self)
    }
    fn store_stats(&self) -> Option<StoreStats> {
        self.store.stats()
    }
    fn compression(&self) -> Option<String> {
        self.format.compression()
    }
}

impl<F: ShardFormat> Source for ShardedDataset<F> {
    fn format(&self) -> Format {
        self.format.format()
    }

    /// Its shards (how many, the first and last), samples per shard, compression, and what
    /// the store fetched (from a URL).
    fn describe(&self) -> Result<Description> {
        let (min, max) = (
            self.sizes.iter().copied().min().unwrap_or(0),
            self.sizes.iter().copied().max().unwrap_or(0),
        );
        let mean = if self.sizes.is_empty() {
            0.0
        } else {
            self.len() as f64 / self.sizes.len() as f64
        };
        let (first, last) = (self.names.first(), self.names.last());
        let mut d = Description::new(
            self.store.locate("").display().to_string(),
            self.format.format(),
            self.len(),
            self.schema.clone(),
        )
        .fact(
            "shards",
            "shards",
            self.names.len(),
            format!(
                "{} ({} .. {})",
                self.names.len(),
                first.map_or("", String::as_str),
                last.map_or("", String::as_str)
            ),
        )
        .count("samples", "", self.len())
        .fact("first_shard", "", first.cloned(), "")
        .fact("last_shard", "", last.cloned(), "")
        .fact(
            "samples_per_shard",
            "per shard",
            serde_json::json!({"min": min, "mean": mean, "max": max}),
            format!("{min} to {max} samples, mean {mean:.1}"),
        );
        let compression = self.format.compression();
        d = d.fact(
            "compression",
            if compression.is_some() { "compressed" } else { "" },
            compression.clone(),
            compression.map_or(String::new(), |c| {
                format!(
                    "{c} (each shard decompressed once into the cache, --cache-dir or $GPUFEED_CACHE_DIR)"
                )
            }),
        );
        if let Some(s) = self.store.stats() {
            d = d.fact(
                "store",
                "store",
                serde_json::to_value(s).unwrap_or_default(),
                s.to_string(),
            );
        }
        Ok(d)
    }

    /// Every shard against its index (checksums where the index has them) and every sample;
    /// progress counts shards.
    fn verify(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<()> {
        let n = self.names.len() as u64;
        ShardedDataset::verify(self, |k| progress(k as u64, n))
    }

    fn sharded(&self) -> Option<&dyn ShardedSource> {
        Some(self)
    }
}

/// Where the on-disk caches (tar indexes) go unless told otherwise: `$XDG_CACHE_HOME/gpufeed`,
/// else `$HOME/.cache/gpufeed`, else the temporary directory's `gpufeed-cache`.
pub fn default_cache_dir() -> PathBuf {
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|x| !x.is_empty()) {
        return PathBuf::from(x).join("gpufeed");
    }
    if let Some(h) = std::env::var_os("HOME").filter(|x| !x.is_empty()) {
        return PathBuf::from(h).join(".cache").join("gpufeed");
    }
    std::env::temp_dir().join("gpufeed-cache")
}

/// Writes `bytes` to `path` by a temporary name beside it (unique to this process and call)
/// and a rename, so that `path` is never seen half written.
pub(crate) fn write_atomically(path: &std::path::Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp-{}-{n}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let result = (|| {
        let mut f = std::fs::File::create(&tmp).map_err(|e| Error::io(&tmp, "create", e))?;
        f.write_all(bytes)
            .map_err(|e| Error::io(&tmp, "write", e))?;
        f.sync_all().map_err(|e| Error::io(&tmp, "sync", e))?;
        std::fs::rename(&tmp, path).map_err(|e| Error::io(path, "rename", e))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Refuses a shard name from an index that could reach outside the dataset's directory: an
/// empty name, an absolute path, or one with a `..` component.
pub(crate) fn check_shard_name(
    index: &std::path::Path,
    format: &'static str,
    name: &str,
) -> Result<()> {
    let p = std::path::Path::new(name);
    let bad = name.is_empty()
        || p.is_absolute()
        || p.components().any(|c| {
            matches!(
                c,
                std::path::Component::ParentDir
                    | std::path::Component::RootDir
                    | std::path::Component::Prefix(_)
            )
        });
    if bad {
        return Err(Error::Malformed {
            path: index.to_path_buf(),
            format,
            what: format!(
                "shard name `{name}` is empty, absolute or goes up a directory: shards must be inside the dataset's directory"
            ),
        });
    }
    Ok(())
}

/// `e`, an error about shard `name` of `store` (a shard of `format`), unless it may quote the
/// shard's content (an error of kind [`Corrupt`](crate::ErrorKind) or
/// [`Unsupported`](crate::ErrorKind)) and the store says that shard's content must not be
/// quoted ([`ShardStore::may_quote`]: a link to a file outside the data set): then an
/// [`Error::Malformed`] that says only so.
pub(crate) fn unquoted(
    store: &dyn ShardStore,
    name: &str,
    format: &'static str,
    e: Error,
) -> Error {
    use crate::error::ErrorKind;
    if !matches!(e.kind(), ErrorKind::Corrupt | ErrorKind::Unsupported) || store.may_quote(name) {
        return e;
    }
    Error::Malformed {
        path: store.locate(name),
        format,
        what: "not valid; the shard is a link to a file outside the data set's directory, so what is wrong with it is not told (it would quote that file)".into(),
    }
}

/// At most 96 bytes of `bytes` (a name or a field read from a shard), escaped for a message:
/// UTF-8 as `str::escape_debug` writes it (control characters, quotes and backslashes
/// escaped), other bytes as `\xNN`; a longer value is cut, with its length.
pub(crate) fn quoted(bytes: &[u8]) -> String {
    const MOST: usize = 96;
    let cut = bytes.len() > MOST;
    let head = &bytes[..bytes.len().min(MOST)];
    let mut out = match std::str::from_utf8(head) {
        Ok(s) => s.escape_debug().to_string(),
        // A cut through a character: the valid part as text, the rest as bytes.
        Err(e) if cut && e.error_len().is_none() => {
            let (text, rest) = head.split_at(e.valid_up_to());
            let text = std::str::from_utf8(text).unwrap_or_default();
            format!("{}{}", text.escape_debug(), rest.escape_ascii())
        }
        Err(_) => head.escape_ascii().to_string(),
    };
    if cut {
        out.push_str(&format!("... ({} bytes)", bytes.len()));
    }
    out
}

/// The shards of a data set that have passed their index's hashes since it was opened, each as
/// the file it was then ([`ShardBytes::file_fingerprint`]): a shard closed to stay within
/// [`ShardOptions::max_open_shards`] and opened again is hashed again only if its file changed
/// since, so that a data set with more shards than its set of open shards (a shuffle over
/// all of them) pays one pass over each shard's bytes, not one for each time it is opened.
/// Eight bytes a shard.
pub(crate) struct HashedShards {
    /// Per shard: the fingerprint of the file that passed, 0 for none yet.
    passed: Vec<std::sync::atomic::AtomicU64>,
}

impl std::fmt::Debug for HashedShards {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HashedShards")
            .field("shards", &self.passed.len())
            .finish()
    }
}

impl HashedShards {
    /// None of `shards` shards checked yet.
    pub(crate) fn new(shards: usize) -> HashedShards {
        HashedShards {
            passed: (0..shards)
                .map(|_| std::sync::atomic::AtomicU64::new(0))
                .collect(),
        }
    }

    /// Runs `check` (a pass over shard `k`'s file, the file whose fingerprint is `file`: see
    /// [`ShardBytes::file_fingerprint`]) unless that file, unchanged, passed it before;
    /// remembers a file that passes. A shard held other than as a file (`None`) is checked
    /// every time.
    pub(crate) fn check_once(
        &self,
        k: usize,
        file: Option<u64>,
        check: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        use std::sync::atomic::Ordering;
        let slot = self.passed.get(k);
        if let (Some(file), Some(slot)) = (file, slot)
            && slot.load(Ordering::Relaxed) == file
        {
            return Ok(());
        }
        check()?;
        if let (Some(file), Some(slot)) = (file, slot) {
            slot.store(file, Ordering::Relaxed);
        }
        Ok(())
    }
}

/// The xxh3-64 of a byte slice, as the lower-case hex string indexes store.
pub(crate) fn xxh3_hex(bytes: &[u8]) -> String {
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(bytes))
}

#[cfg(test)]
mod tests {
    use super::quoted;

    #[test]
    fn quoted_values_are_short_and_escaped() {
        assert_eq!(quoted(b"abc.jpg"), "abc.jpg");
        assert_eq!(quoted("日本/猫.jpg".as_bytes()), "日本/猫.jpg");
        assert_eq!(quoted(b"a\nb\"\\\x01"), r#"a\nb\"\\\u{1}"#);
        assert_eq!(quoted(b"\xff\xfeab"), r"\xff\xfeab");
        let long = quoted(&[b'x'; 1000]);
        assert_eq!(long, format!("{}... (1000 bytes)", "x".repeat(96)));
        // Cut through a character: the part before it as text, the rest as bytes.
        let mut cut = vec![b'y'; 95];
        cut.extend("é".as_bytes());
        cut.extend([b'z'; 10]);
        assert_eq!(
            quoted(&cut),
            format!("{}\\xc3... (107 bytes)", "y".repeat(95))
        );
    }
}
