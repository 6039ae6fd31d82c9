//! [`DiskCache`]: the local directory that downloaded shards (`remote`) and decompressed
//! shards (`compressed`) live in, shared by every process of the machine that reads them,
//! within one byte limit.
//!
//! ```text
//! ROOT/<16 hex: hash of the store's URL>/<shard name>~<16 hex: version>          a whole shard
//! ROOT/<...>/<shard name>~<version>.lock                                          its fetch lock
//! ROOT/<...>/<shard name>~<version>.part-<pid>-<n>                                a fetch under way
//! ```
//!
//! - **Whole or absent**: a fetch writes a temporary file of its own (`.part-<pid>-<n>`,
//!   created exclusively) and renames it into place once every byte has arrived and passed
//!   its check (the index's checksum, or an MD5 ETag: see the `remote` module). A
//!   process that dies mid-fetch (killed, or stopped by a signal it has no handler for, as
//!   `SIGTERM` and `SIGINT` are by default) leaves a temporary file, never a shard that reads
//!   as whole; the next store opened on the cache, in any process, removes it
//!   ([`DiskCache::remove_abandoned`]: its fetch lock is free), and so does every later
//!   fetch's scan. A store dropped mid-fetch removes its own.
//! - **One fetch per machine**: the fetcher holds an exclusive `flock` on the shard's `.lock`
//!   file for as long as it fetches. Another process (a rank on the same machine) that finds
//!   the lock taken waits for the whole file to appear, or takes over the fetch if the lock
//!   comes free without it (the fetcher died or failed). The lock is advisory: two fetches of
//!   one shard (a lock file removed between an open and a lock) each write their own
//!   temporary file and rename a whole, identical shard.
//! - **Byte limit, least recently used out**: before a fetch, whole shards are removed, the
//!   least recently used first (a shard's modification time is set each time it is opened
//!   from the cache), until the shards on disk plus those arriving plus the new one fit within
//!   the limit. A shard larger than the limit is refused. Removing a shard that a process
//!   still has mapped is safe: its mapping keeps the bytes until it is dropped (the disk space
//!   too, so the directory can exceed its limit by the shards open at that moment).

use std::fs::File;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use crate::error::{Error, Result};

/// The cache's byte limit unless told otherwise (`GPUFEED_CACHE_LIMIT`): 64 GiB.
pub const DEFAULT_LIMIT: u64 = 64 << 30;

/// The cache directory unless told otherwise (`GPUFEED_CACHE_DIR`):
/// [`default_cache_dir`](super::default_cache_dir)`/objects`.
pub fn default_root() -> PathBuf {
    super::default_cache_dir().join("objects")
}

/// The cache's place and byte limit from the environment, where set: `GPUFEED_CACHE_DIR`, and
/// `GPUFEED_CACHE_LIMIT` (a size such as `200GiB`; one that is not is an
/// [`Error::InvalidConfig`] naming the variable).
pub fn settings_from_env() -> Result<(Option<PathBuf>, Option<u64>)> {
    let dir = std::env::var_os("GPUFEED_CACHE_DIR")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from);
    let limit = match std::env::var("GPUFEED_CACHE_LIMIT") {
        Ok(limit) if !limit.is_empty() => {
            Some(super::packed::parse_byte_size(&limit).map_err(|_| {
                Error::config(
                    "GPUFEED_CACHE_LIMIT",
                    format!("`{limit}` is not a size such as 200GiB"),
                )
            })?)
        }
        _ => None,
    };
    Ok((dir, limit))
}

/// The marker of a temporary file in the cache.
pub(crate) const PART_MARKER: &str = ".part-";

/// The cache directory of one store (see the [module](self) documentation).
#[derive(Debug)]
pub struct DiskCache {
    root: PathBuf,
    dir: PathBuf,
    limit: u64,
}

/// An exclusive `flock` on a shard's lock file, released when dropped.
#[derive(Debug)]
pub struct FetchLock {
    file: File,
}

impl Drop for FetchLock {
    fn drop(&mut self) {
        // SAFETY: `file` is open for the lifetime of self; unlocking a descriptor has no
        // memory effect. Closing the file would release the lock too; this says so at once.
        unsafe {
            libc::flock(self.file.as_raw_fd(), libc::LOCK_UN);
        }
    }
}

impl DiskCache {
    /// The cache under `root` for the store at `url`, holding at most `limit` bytes (over
    /// every store sharing `root`). Creates the directories.
    pub fn new(root: PathBuf, limit: u64, url: &str) -> Result<DiskCache> {
        let dir = root.join(format!(
            "{:016x}",
            xxhash_rust::xxh3::xxh3_64(url.as_bytes())
        ));
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, "create cache directory", e))?;
        Ok(DiskCache { root, dir, limit })
    }

    /// The directory shared by every store.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The byte limit.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Where the whole shard `name` at `version` is kept.
    pub fn path_for(&self, name: &str, version: &str) -> PathBuf {
        self.dir.join(format!("{name}~{version}"))
    }

    /// True if the whole shard is there; then marks it used now (its modification time).
    pub fn touch_if_whole(&self, path: &Path) -> bool {
        match File::options().write(true).open(path) {
            Ok(f) => {
                let _ = f.set_modified(SystemTime::now());
                true
            }
            Err(_) => path.is_file(),
        }
    }

    fn lock_path(path: &Path) -> PathBuf {
        let mut p = path.as_os_str().to_owned();
        p.push(".lock");
        PathBuf::from(p)
    }

    /// Takes the fetch lock of the shard at `path` if no process holds it (`None` if one
    /// does).
    pub fn try_lock(&self, path: &Path) -> Result<Option<FetchLock>> {
        let lock = Self::lock_path(path);
        if let Some(parent) = lock.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| Error::io(parent, "create cache directory", e))?;
        }
        let file = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock)
            .map_err(|e| Error::io(&lock, "open lock file", e))?;
        // SAFETY: flock on a descriptor we own; no memory is involved.
        let r = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if r == 0 {
            return Ok(Some(FetchLock { file }));
        }
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::WouldBlock {
            Ok(None)
        } else {
            Err(Error::io(&lock, "lock", e))
        }
    }

    /// A new temporary file beside `path`, created exclusively, and its name.
    pub fn temporary(&self, path: &Path) -> Result<(File, PathBuf)> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        loop {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let mut p = path.as_os_str().to_owned();
            p.push(format!("{PART_MARKER}{}-{n}", std::process::id()));
            let p = PathBuf::from(p);
            match File::options()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&p)
            {
                Ok(f) => return Ok((f, p)),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(Error::io(&p, "create", e)),
            }
        }
    }

    /// Makes room for `need` more bytes: removes whole shards, least recently used first,
    /// until the cache's shards (whole and arriving) plus `need` fit within the limit, and
    /// removes temporary files that no fetch holds. `keep` is the shard the caller is about
    /// to fetch, holding its lock and before making its temporary file: it is not removed,
    /// and temporaries of it already there are abandoned. Returns the number of shards
    /// removed, or why the shard cannot fit.
    pub fn make_room(&self, need: u64, keep: &Path) -> std::result::Result<u64, String> {
        if need > self.limit {
            return Err(format!(
                "the shard is {need} bytes, more than the cache's limit of {} bytes ({}): raise the limit (GPUFEED_CACHE_LIMIT) or write smaller shards",
                self.limit,
                self.root.display()
            ));
        }
        let mut whole = Vec::new();
        let mut used = 0u64;
        scan(&self.root, &mut |path, meta| {
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if name.ends_with(".lock") {
                return;
            }
            if let Some(shard) = shard_of_temporary(path) {
                // A temporary file: arriving, or left by a process that died. The caller
                // holds `keep`'s lock and has made no temporary yet: any there is abandoned.
                if shard == keep || self.is_abandoned(&shard) {
                    let _ = std::fs::remove_file(path);
                } else {
                    used += meta.len();
                }
                return;
            }
            used += meta.len();
            if path != keep {
                whole.push((
                    meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                    meta.len(),
                    path.to_path_buf(),
                ));
            }
        });
        whole.sort();
        let mut removed = 0;
        for (_, len, path) in whole {
            if used.saturating_add(need) <= self.limit {
                break;
            }
            if std::fs::remove_file(&path).is_ok() {
                let _ = std::fs::remove_file(Self::lock_path(&path));
                used = used.saturating_sub(len);
                removed += 1;
            }
        }
        // Past the limit with nothing left to remove: shards arriving fill it. They end soon,
        // and refusing would fail a reader that only waits for them: go on, a little over.
        Ok(removed)
    }

    /// Removes the temporary files under the cache that no fetch holds: those of processes
    /// that died mid-fetch. Returns how many.
    #[cfg_attr(not(feature = "remote"), allow(dead_code))]
    pub fn remove_abandoned(&self) -> u64 {
        let mut removed = 0;
        scan(&self.root, &mut |path, _| {
            if let Some(shard) = shard_of_temporary(path)
                && self.is_abandoned(&shard)
                && std::fs::remove_file(path).is_ok()
            {
                removed += 1;
            }
        });
        removed
    }

    /// True if no process holds the fetch lock of the shard at `path` (so its temporary
    /// files are abandoned).
    fn is_abandoned(&self, path: &Path) -> bool {
        matches!(self.try_lock(path), Ok(Some(_)))
    }
}

/// The shard a temporary file (`<shard>.part-<pid>-<n>`) is a fetch of; `None` for any other
/// file.
fn shard_of_temporary(path: &Path) -> Option<PathBuf> {
    let name = path.file_name()?.to_str()?;
    let at = name.find(PART_MARKER)?;
    Some(path.with_file_name(&name[..at]))
}

/// Calls `f` on every file under `dir` (recursively), with its metadata.
fn scan(dir: &Path, f: &mut dyn FnMut(&Path, &std::fs::Metadata)) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(meta) = entry.metadata() else { continue };
        if meta.is_dir() {
            scan(&path, f);
        } else if meta.is_file() {
            f(&path, &meta);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(path: &Path, len: usize, age_s: u64) {
        std::fs::write(path, vec![7u8; len]).unwrap();
        let f = File::options().write(true).open(path).unwrap();
        f.set_modified(SystemTime::now() - std::time::Duration::from_secs(age_s))
            .unwrap();
    }

    #[test]
    fn the_least_recently_used_go_first_until_the_new_shard_fits() {
        let dir = tempfile::tempdir().unwrap();
        let c = DiskCache::new(dir.path().to_path_buf(), 1000, "s3://b/p").unwrap();
        let (a, b, d) = (
            c.path_for("a", "1"),
            c.path_for("b", "1"),
            c.path_for("d", "1"),
        );
        put(&a, 400, 30);
        put(&b, 400, 10);
        put(&d, 100, 20);
        // 900 used; 300 more needs 200 freed: `a`, the oldest, goes.
        assert_eq!(c.make_room(300, &c.path_for("new", "1")).unwrap(), 1);
        assert!(!a.exists() && b.exists() && d.exists());
        // Touching `d` makes `b` the oldest.
        assert!(c.touch_if_whole(&d));
        assert_eq!(c.make_room(600, &c.path_for("new", "1")).unwrap(), 1);
        assert!(!b.exists() && d.exists());
        let e = c.make_room(1001, &c.path_for("new", "1")).unwrap_err();
        assert!(e.contains("more than the cache's limit"), "{e}");
    }

    #[test]
    fn a_lock_is_exclusive_and_abandoned_temporaries_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let c = DiskCache::new(dir.path().to_path_buf(), 1 << 20, "s3://b/p").unwrap();
        let shard = c.path_for("s", "v");
        let held = c.try_lock(&shard).unwrap().expect("free");
        assert!(
            c.try_lock(&shard).unwrap().is_none(),
            "held by another descriptor"
        );
        let (_f, tmp) = c.temporary(&shard).unwrap();
        let other = c.path_for("other", "v");
        c.make_room(1, &other).unwrap();
        assert!(tmp.exists(), "its fetch holds the lock");
        drop(held);
        c.make_room(1, &other).unwrap();
        assert!(!tmp.exists(), "abandoned: removed");
        // A temporary of the shard about to be fetched (whose lock the caller holds) is an
        // earlier, dead fetch's.
        let _held = c.try_lock(&shard).unwrap().expect("free");
        let (_f, tmp) = c.temporary(&shard).unwrap();
        c.make_room(1, &shard).unwrap();
        assert!(
            !tmp.exists(),
            "a dead fetch's temporary of the shard being fetched"
        );
    }

    #[test]
    fn abandoned_temporaries_are_removed_without_a_fetch() {
        let dir = tempfile::tempdir().unwrap();
        let c = DiskCache::new(dir.path().to_path_buf(), 1 << 20, "s3://b/p").unwrap();
        let (held, free) = (c.path_for("held", "v"), c.path_for("free", "v"));
        let _lock = c.try_lock(&held).unwrap().expect("free");
        let (_a, arriving) = c.temporary(&held).unwrap();
        let (_b, dead) = c.temporary(&free).unwrap();
        put(&free, 10, 0);
        assert_eq!(c.remove_abandoned(), 1);
        assert!(arriving.exists(), "its fetch holds the lock");
        assert!(
            !dead.exists() && free.exists(),
            "only the dead fetch's temporary goes"
        );
    }
}
