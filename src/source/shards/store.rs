//! Where a shard's bytes come from: the [`ShardStore`] trait, [`ShardBytes`] (a shard's bytes,
//! complete or still arriving) and [`LocalDir`] (files on a local disk, memory-mapped).
//!
//! The format readers (packed, tar, MDS) see a shard only through [`ShardBytes`]: they ask for
//! a byte range and get a reference-counted view of it. A local file is mapped whole and every
//! range is there at once; a store that downloads (an object store filling a local cache file)
//! hands out [`ShardBytes::arriving`], whose reads wait until their range has arrived, so
//! samples can be served from a shard that is still downloading without the readers knowing.
//!
//! A shard mapped from a local file ([`ShardBytes::map_file`]) remembers what the file was when
//! it was mapped (device, inode, size, modification time, as every file-backed source does), so
//! that [`ShardBytes::check_unchanged`] can tell whether the path still names that file, as it
//! was. Whether a store's files are worth that check is the store's to say
//! ([`ShardStore::files_may_change`]): a directory of the user's shards, yes; a download cache
//! whose files the store itself manages, no.

use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;
use memmap2::Mmap;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::file::FileIdentity;

/// What a store knows about a shard without reading it: the keys of on-disk index caches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardStat {
    /// Size in bytes.
    pub bytes: u64,
    /// When it last changed (a file's mtime), if the store knows.
    pub modified: Option<SystemTime>,
    /// An opaque version the store gives (an object store's ETag), if any.
    pub tag: Option<String>,
}

/// Where the shards of a dataset are: a local directory today, an object store's cache later.
///
/// Shards are named by the strings the dataset's index holds (`shard-000000.gfd`,
/// `shard.00000.mds`, or a tar file's path). Implementations are shared by worker threads.
pub trait ShardStore: Send + Sync {
    /// Where shard `name` is, for error messages and cache keys (a path or a URL as a path).
    fn locate(&self, name: &str) -> PathBuf;

    /// The shard's size and modification time, without reading it.
    fn stat(&self, name: &str) -> Result<ShardStat>;

    /// The shard's bytes, complete or arriving.
    fn open(&self, name: &str) -> Result<ShardBytes>;

    /// A complete local file holding the shard, for readers that need a file (packed record
    /// files are opened by path). A store that downloads waits until the shard is complete.
    fn local_file(&self, name: &str) -> Result<PathBuf>;

    /// Whether the local files this store's shards are read from (those
    /// [`ShardBytes::map_file`] maps, those [`local_file`](ShardStore::local_file) names) are
    /// the data set's own files, which a user or another program may replace or rewrite while
    /// a job runs. When true, a sharded dataset's
    /// [`Dataset::check_unchanged`](crate::Dataset::check_unchanged) (which the loader calls at
    /// each epoch's start) compares the file of every shard it has open with what that file
    /// was when the shard was opened.
    ///
    /// True for [`LocalDir`]. False (the default) for stores that hold no file (in memory) and
    /// for stores whose files are copies they manage themselves: a download cache's files are
    /// written whole under a name that includes their version, touched each time they are
    /// used, removed to make room and fetched again, by any process of the machine, so their
    /// modification time and inode change while their bytes do not.
    fn files_may_change(&self) -> bool {
        false
    }

    /// Whether a format checks a shard of this store against the hashes its index gives
    /// (MDS `xxh3_64`, `xxh64`, ...; a packed index's `xxh3_64`) when it opens it, before its
    /// first sample is handed out (once per file: see the [module](super)'s section on
    /// hashes). True (the default) for stores that hand out shards as they are: a directory
    /// of the data set's own files, a buffer. False for a store that checks what it hands
    /// out itself, before any byte of it is read: an object store's download cache checks
    /// each shard against the same hashes as it arrives (or, with its checks turned off, was
    /// told to check sizes only).
    fn check_hashes_on_open(&self) -> bool {
        true
    }

    /// How many batches ahead a dataset of this store wants to hear of the samples it will
    /// read ([`Dataset::read_ahead_batches`](crate::Dataset::read_ahead_batches)): 0 (the
    /// default) for stores whose shards are at hand.
    fn read_ahead_batches(&self) -> usize {
        0
    }

    /// Shard `name` will be read soon: a store that downloads may start fetching it. A hint,
    /// called from the loader's thread in the order of reading: it must not block. Default:
    /// nothing.
    fn prefetch(&self, name: &str) {
        let _ = name;
    }

    /// What the store has fetched, waited for and cached so far; `None` (the default) for
    /// stores that fetch nothing.
    fn stats(&self) -> Option<StoreStats> {
        None
    }

    /// Whether an error about shard `name` may quote what is in it (bytes, names or numbers
    /// read from it, always short and escaped): false for a shard that is a link to a file
    /// outside the data set's directory, whose content a data set must not be able to make
    /// gpufeed reveal. Asked only when an error is made. True (the default) for stores whose
    /// shards are their own.
    fn may_quote(&self, name: &str) -> bool {
        let _ = name;
        true
    }
}

/// What a store that downloads has done: the counts behind its throughput and its cache.
///
/// Serialized (serde) with `waited` as `waited_s`, in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StoreStats {
    /// Bytes received from the object store (retried bytes included).
    pub bytes_fetched: u64,
    /// Requests sent (listings, heads and ranged gets; retries included).
    pub requests: u64,
    /// Requests sent again after a failure (an error answer, a cut body, a time-out).
    pub retries: u64,
    /// Shards a reader found whole in the local cache, put there by an earlier run or another
    /// process (a shard this store fetched is not counted again when read).
    pub cache_hits: u64,
    /// Shards that had to be fetched (by this process).
    pub cache_misses: u64,
    /// Shards this process waited for while another process on the machine fetched them.
    pub shared_downloads: u64,
    /// Shards removed from the cache to stay within its byte limit.
    pub cache_evictions: u64,
    /// Shards refused for not fitting in the cache (larger than its limit, or a full disk).
    pub cache_full: u64,
    /// Fetches of a shard (or an index file) whose bytes did not pass their check once they
    /// had arrived: the index's checksum, or an S3 ETag that is an MD5. Each such shard is
    /// fetched again a bounded number of times, and never read until it passes.
    pub checksum_failures: u64,
    /// Shards cached with only their size checked: no checksum in the index and no hash of
    /// the bytes from the store (a multi-part upload's ETag, an encrypted object's, a store
    /// other than S3), or checks turned off.
    pub unverified: u64,
    /// Shards whose fetch was started ahead of the readers ([`ShardStore::prefetch`]).
    pub prefetched: u64,
    /// Time readers spent waiting for bytes to arrive, over all threads.
    #[serde(rename = "waited_s", serialize_with = "seconds")]
    pub waited: std::time::Duration,
}

/// A duration as seconds (`f64`), as reports give times.
fn seconds<S: serde::Serializer>(
    d: &std::time::Duration,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

impl std::fmt::Display for StoreStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "fetched {:.1} MiB in {} requests ({} retried); cache: {} hits, {} misses, {} shared, {} evicted, {} full; {} checksum failures, {} unverified; {} prefetched; readers waited {:.3} s",
            self.bytes_fetched as f64 / (1u64 << 20) as f64,
            self.requests,
            self.retries,
            self.cache_hits,
            self.cache_misses,
            self.shared_downloads,
            self.cache_evictions,
            self.cache_full,
            self.checksum_failures,
            self.unverified,
            self.prefetched,
            self.waited.as_secs_f64()
        )
    }
}

/// Told when byte ranges of a shard that is still arriving are there to read.
pub trait ShardArrival: Send + Sync {
    /// Returns once `range` of the shard has arrived, or an error if it never will (the
    /// download failed): the error names the shard.
    fn wait_for(&self, range: Range<u64>) -> Result<()>;
}

/// The bytes of one shard: a reference-counted buffer (a mapping, usually) and, for a shard
/// still arriving, what to wait on before reading a range.
#[derive(Clone)]
pub struct ShardBytes {
    path: PathBuf,
    bytes: Bytes,
    arrival: Option<Arc<dyn ShardArrival>>,
    /// What the file at `path` was when it was mapped ([`ShardBytes::map_file`] only).
    identity: Option<FileIdentity>,
}

impl std::fmt::Debug for ShardBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardBytes")
            .field("path", &self.path)
            .field("bytes", &self.bytes.len())
            .field("arriving", &self.arrival.is_some())
            .field("mapped_file", &self.identity.is_some())
            .finish()
    }
}

impl ShardBytes {
    /// A complete shard held in `bytes` (named `path` in errors).
    pub fn new(path: impl Into<PathBuf>, bytes: Bytes) -> ShardBytes {
        ShardBytes {
            path: path.into(),
            bytes,
            arrival: None,
            identity: None,
        }
    }

    /// A shard whose buffer has its final size but whose ranges arrive over time: every read
    /// first waits on `arrival` for its range.
    pub fn arriving(
        path: impl Into<PathBuf>,
        bytes: Bytes,
        arrival: Arc<dyn ShardArrival>,
    ) -> ShardBytes {
        ShardBytes {
            path: path.into(),
            bytes,
            arrival: Some(arrival),
            identity: None,
        }
    }

    /// Maps the file at `path` (read-only) as a complete shard, remembering what the file is
    /// (device, inode, size, modification time, taken from the descriptor it maps) for
    /// [`check_unchanged`](ShardBytes::check_unchanged).
    pub fn map_file(path: &Path) -> Result<ShardBytes> {
        let file = File::open(path).map_err(|e| Error::io(path, "open shard", e))?;
        let meta = file
            .metadata()
            .map_err(|e| Error::io(path, "stat shard", e))?;
        let identity = Some(FileIdentity::of(&meta));
        if meta.len() == 0 {
            // An empty file cannot be mapped; its bytes are nothing.
            return Ok(ShardBytes {
                identity,
                ..ShardBytes::new(path, Bytes::new())
            });
        }
        // SAFETY: the mapping is read-only. Shards are written under a temporary name and
        // renamed into place (ShardWriter, webdataset's and MosaicML's writers write whole
        // files), so a shard in use is not rewritten by them; every read of the mapping is
        // bounds-checked against its length taken here, so changed bytes give wrong data or a
        // typed error. Truncation by another process (SIGBUS) is the one hazard left, as with
        // every memory-mapped reader; `check_unchanged` (at each epoch's start) reports a file
        // changed between epochs before it is read again.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, "map shard", e))?;
        Ok(ShardBytes {
            identity,
            ..ShardBytes::new(path, Bytes::from_owner(map))
        })
    }

    /// For a shard mapped from a local file ([`map_file`](ShardBytes::map_file)): checks that
    /// its path still names the file mapped, with the size and modification time it had then
    /// (one `stat`). [`Error::FileChanged`] names the path and says what changed (replaced,
    /// removed, truncated, extended, written in place); an [`Error::Io`] if the path cannot be
    /// looked at. A shard held any other way (in memory, arriving, a copy a store made) has no
    /// file to check: `Ok(())`.
    pub fn check_unchanged(&self) -> Result<()> {
        match &self.identity {
            Some(identity) => identity.check(&self.path),
            None => Ok(()),
        }
    }

    /// For a shard mapped from a local file ([`map_file`](ShardBytes::map_file)): a
    /// fingerprint of what the file was when it was mapped (device, inode, size, modification
    /// and status-change times), never 0, equal for two mappings of the same unchanged file;
    /// `None` for a shard held any other way.
    pub(crate) fn file_fingerprint(&self) -> Option<u64> {
        self.identity.as_ref().map(FileIdentity::fingerprint)
    }

    /// Where the shard is (a path, or a URL as a path), for error messages.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The shard's size in bytes.
    pub fn len(&self) -> u64 {
        self.bytes.len() as u64
    }

    /// True for a shard of no byte.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    fn check(&self, range: &Range<u64>) -> Result<Range<usize>> {
        if range.start > range.end || range.end > self.len() {
            return Err(Error::Malformed {
                path: self.path.clone(),
                format: "shard",
                what: format!(
                    "bytes {}..{} are past the end of the shard's {} bytes: truncated?",
                    range.start,
                    range.end,
                    self.len()
                ),
            });
        }
        if let Some(arrival) = &self.arrival {
            arrival.wait_for(range.clone())?;
        }
        Ok(range.start as usize..range.end as usize)
    }

    /// Bytes `range` of the shard, borrowed (after waiting for them to arrive). A range past
    /// the end is [`Error::Malformed`] naming the shard.
    pub fn get(&self, range: Range<u64>) -> Result<&[u8]> {
        let r = self.check(&range)?;
        Ok(&self.bytes[r])
    }

    /// Bytes `range` of the shard as a view that keeps the buffer alive (after waiting for
    /// them to arrive). No byte is copied.
    pub fn share(&self, range: Range<u64>) -> Result<Bytes> {
        let r = self.check(&range)?;
        Ok(self.bytes.slice(r))
    }

    /// The whole shard, once it has all arrived.
    pub fn all(&self) -> Result<&[u8]> {
        self.get(0..self.len())
    }
}

/// Shards as files under a local directory (or anywhere, for absolute names), memory-mapped
/// when opened.
#[derive(Clone, Debug)]
pub struct LocalDir {
    root: PathBuf,
}

impl LocalDir {
    /// Shards named relative to `root` (absolute names are used as they are).
    pub fn new(root: impl Into<PathBuf>) -> LocalDir {
        LocalDir { root: root.into() }
    }

    /// The directory names are relative to.
    pub fn root(&self) -> &Path {
        &self.root
    }
}

impl ShardStore for LocalDir {
    fn locate(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }

    fn stat(&self, name: &str) -> Result<ShardStat> {
        let path = self.locate(name);
        let meta = std::fs::metadata(&path).map_err(|e| Error::io(&path, "stat shard", e))?;
        Ok(ShardStat {
            bytes: meta.len(),
            modified: meta.modified().ok(),
            tag: None,
        })
    }

    fn open(&self, name: &str) -> Result<ShardBytes> {
        ShardBytes::map_file(&self.locate(name))
    }

    fn local_file(&self, name: &str) -> Result<PathBuf> {
        Ok(self.locate(name))
    }

    /// True: the files are the data set's own.
    fn files_may_change(&self) -> bool {
        true
    }

    /// False if the shard's file, links resolved, is outside the directory (links resolved)
    /// of the store, or, for a store of paths (an empty root: tar shards named by path),
    /// outside the directory the shard is named in. True otherwise, and when there is no file
    /// to resolve (a missing shard, a dangling link: nothing of it was read).
    fn may_quote(&self, name: &str) -> bool {
        let path = self.locate(name);
        let dir = if self.root.as_os_str().is_empty() {
            path.parent().unwrap_or(Path::new(""))
        } else {
            self.root.as_path()
        };
        let dir = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        match (dir.canonicalize(), path.canonicalize()) {
            (Ok(dir), Ok(file)) => file.starts_with(dir),
            _ => true,
        }
    }
}

/// Shards held in memory, by name: for tests, fuzzing and data made on the fly. Counts how
/// often each kind of call is made, so tests can check what a dataset opened.
#[derive(Default)]
pub struct MemoryStore {
    shards: std::collections::HashMap<String, Bytes>,
    opens: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("shards", &self.shards.len())
            .finish()
    }
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    /// Adds (or replaces) shard `name`.
    pub fn insert(&mut self, name: impl Into<String>, bytes: impl Into<Bytes>) {
        self.shards.insert(name.into(), bytes.into());
    }

    /// How many times [`ShardStore::open`] has been called.
    pub fn opens(&self) -> u64 {
        self.opens.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn shard(&self, name: &str) -> Result<&Bytes> {
        self.shards.get(name).ok_or_else(|| Error::Io {
            path: self.locate(name),
            op: "open shard",
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        })
    }
}

impl ShardStore for MemoryStore {
    fn locate(&self, name: &str) -> PathBuf {
        Path::new("memory:").join(name)
    }

    fn stat(&self, name: &str) -> Result<ShardStat> {
        let bytes = self.shard(name)?;
        Ok(ShardStat {
            bytes: bytes.len() as u64,
            modified: None,
            // The content's hash: shards replaced in memory get new cache keys.
            tag: Some(format!("{:016x}", xxhash_rust::xxh3::xxh3_64(bytes))),
        })
    }

    fn open(&self, name: &str) -> Result<ShardBytes> {
        self.opens
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(ShardBytes::new(
            self.locate(name),
            self.shard(name)?.clone(),
        ))
    }

    fn local_file(&self, name: &str) -> Result<PathBuf> {
        self.shard(name)?;
        Err(Error::config(
            "store",
            format!("shard `{name}` is in memory, not in a local file"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes byte `at` of `path` again, in place (no truncation), and moves its modification
    /// time a minute on, whatever the file system's clock granularity.
    fn rewrite_in_place(path: &Path, at: u64) {
        use std::io::{Seek, SeekFrom, Write};
        let was = std::fs::metadata(path).unwrap().modified().unwrap();
        let mut f = File::options().write(true).open(path).unwrap();
        f.seek(SeekFrom::Start(at)).unwrap();
        f.write_all(b"!").unwrap();
        f.set_modified(was + std::time::Duration::from_secs(60))
            .unwrap();
    }

    fn changed(e: Error, want: &Path, needle: &str) {
        match e {
            Error::FileChanged { path, what } => {
                assert_eq!(path, want);
                assert!(what.contains(needle), "{what:?} lacks {needle:?}");
            }
            other => panic!("expected FileChanged, got {other:?}"),
        }
    }

    #[test]
    fn a_mapped_shard_notices_its_file_written_in_place_or_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard.bin");
        std::fs::write(&path, b"some shard bytes").unwrap();
        let bytes = LocalDir::new(dir.path()).open("shard.bin").unwrap();
        for _ in 0..3 {
            bytes.check_unchanged().unwrap();
        }
        // Clones (the views samples keep) share what the file was.
        let clone = bytes.clone();
        rewrite_in_place(&path, 3);
        changed(
            bytes.check_unchanged().unwrap_err(),
            &path,
            "written in place",
        );
        changed(
            clone.check_unchanged().unwrap_err(),
            &path,
            "written in place",
        );
        // An empty file, which is not mapped, is remembered too.
        let empty = dir.path().join("empty.bin");
        std::fs::write(&empty, b"").unwrap();
        let none = ShardBytes::map_file(&empty).unwrap();
        none.check_unchanged().unwrap();
        std::fs::remove_file(&empty).unwrap();
        changed(none.check_unchanged().unwrap_err(), &empty, "removed");
    }

    #[test]
    fn shards_not_mapped_from_a_file_have_nothing_to_check() {
        struct Arrived;
        impl ShardArrival for Arrived {
            fn wait_for(&self, _range: Range<u64>) -> Result<()> {
                Ok(())
            }
        }
        ShardBytes::new("x", Bytes::from_static(b"abc"))
            .check_unchanged()
            .unwrap();
        ShardBytes::arriving("x", Bytes::from_static(b"abc"), Arc::new(Arrived))
            .check_unchanged()
            .unwrap();
        let mut store = MemoryStore::new();
        store.insert("a", &b"abc"[..]);
        store.open("a").unwrap().check_unchanged().unwrap();
    }

    #[test]
    fn only_a_local_directory_says_its_files_may_change() {
        assert!(LocalDir::new("/nowhere").files_may_change());
        assert!(!MemoryStore::new().files_may_change());
    }
}
