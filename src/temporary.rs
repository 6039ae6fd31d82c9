//! Temporary files beside a destination: how gpufeed writes a file so that its name never
//! holds a half-written one. Every writer of files (the packed record file's `RecordWriter`,
//! shard writers, the timeline and the bench's plot through [`write_replacing`]) writes
//! to `NAME.gpufeed-tmp-PID-NONCE` beside `NAME`, created exclusively and locked (`flock`)
//! while it is written, then renames it over `NAME` (or links it, when it must be new).
//!
//! This process's unfinished temporaries are recorded, so that a command about to die of a
//! signal removes them ([`stop_writers`], or [`remove_unfinished_temporaries`]); those a
//! killed process left are found by their pid and lock ([`remove_stale_temporaries`]).
//!
//! A file that completes others (a shard directory's index, which makes the shards placed
//! before it a data set) is placed and its files forgotten in one step under the record's
//! lock (`write_completing`): a signal's cleanup runs wholly before that step (nothing of
//! the data set stays) or wholly after (all of it stays), never between.

use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};

/// Writes the file `path` through `write`, replacing it: to a temporary file beside it
/// first (recorded for [`remove_unfinished_temporaries`]), then renamed over `path`, so that
/// `path` never holds a half-written file. Refuses a path that exists and is not a regular
/// file (a directory, a pipe, a device). `what` names the write in errors ("write the
/// trace"), which name `path`, not the temporary.
pub fn write_replacing(
    path: &Path,
    what: &'static str,
    write: impl FnOnce(&mut BufWriter<File>) -> std::io::Result<()>,
) -> Result<()> {
    if let Ok(meta) = std::fs::metadata(path)
        && !meta.is_file()
    {
        return Err(Error::io(
            path,
            what,
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "exists and is not a regular file",
            ),
        ));
    }
    let (tmp, file) = create(path)?;
    let guard = Unowned::new(tmp);
    let mut out = BufWriter::new(file);
    write(&mut out)
        .and_then(|()| std::io::Write::flush(&mut out))
        .map_err(|e| Error::io(path, what, e))?;
    drop(out);
    std::fs::rename(&guard.0, path)
        .map_err(|e| Error::io(path, "rename (its temporary file) to", e))?;
    forget_unfinished(&guard.keep());
    Ok(())
}

/// Files written under temporary names beside their destinations and placed together, once
/// every one is complete ([`place`](Self::place)): what a writer of a data set of several
/// files (Megatron's `.bin` and `.idx`) streams into. Until then the destinations' names keep
/// what they held; an error drops the set, which removes its temporaries; a signal's cleanup
/// ([`stop_writers`]) removes them too, and also the files already placed by a [`place`](Self::place)
/// under way, so that a data set is left whole or not at all.
pub struct PlacedTogether {
    files: Vec<Staged>,
}

/// One file of a [`PlacedTogether`]: its destination, its temporary, the writer into it.
struct Staged {
    path: PathBuf,
    tmp: Unowned,
    out: BufWriter<File>,
}

impl PlacedTogether {
    /// Temporaries beside each of `paths` (created exclusively, recorded for the cleanup).
    /// Refuses a destination that exists and is not a regular file (a directory, a pipe, a
    /// device), naming it.
    pub fn create(paths: &[&Path]) -> Result<PlacedTogether> {
        let mut files = Vec::with_capacity(paths.len());
        for path in paths {
            if let Ok(meta) = std::fs::metadata(path)
                && !meta.is_file()
            {
                return Err(Error::io(
                    path,
                    "write",
                    std::io::Error::new(
                        std::io::ErrorKind::InvalidInput,
                        "exists and is not a regular file",
                    ),
                ));
            }
            let (tmp, file) = create(path)?;
            files.push(Staged {
                path: path.to_path_buf(),
                tmp: Unowned::new(tmp),
                out: BufWriter::with_capacity(1 << 20, file),
            });
        }
        Ok(PlacedTogether { files })
    }

    /// The writer into the temporary of the `i`-th path, and that path (for errors).
    pub fn writer(&mut self, i: usize) -> (&mut BufWriter<File>, &Path) {
        let f = &mut self.files[i];
        (&mut f.out, &f.path)
    }

    /// Flushes and syncs every temporary, then renames each over its destination, in order:
    /// all but the last are recorded as unfinished while they are placed (a signal's cleanup
    /// removes them), and the last is renamed and all of them forgotten in one step under
    /// the record's lock, as a single file's completing write does. A rename that fails removes the files
    /// this call placed.
    pub fn place(self) -> Result<()> {
        let mut files = self.files;
        for f in &mut files {
            std::io::Write::flush(&mut f.out)
                .and_then(|()| f.out.get_ref().sync_all())
                .map_err(|e| Error::io(&f.path, "write (its temporary file)", e))?;
        }
        let Some(last) = files.pop() else {
            return Ok(());
        };
        let mut placed: Vec<PathBuf> = Vec::new();
        let undo = |placed: &[PathBuf]| {
            for p in placed {
                discard(p);
            }
        };
        for f in files {
            register_unfinished(&f.path);
            if let Err(e) = std::fs::rename(&f.tmp.0, &f.path) {
                forget_unfinished(&f.path);
                undo(&placed);
                return Err(Error::io(&f.path, "rename (its temporary file) to", e));
            }
            forget_unfinished(&f.tmp.keep());
            placed.push(f.path);
        }
        let done = {
            let mut registry = live();
            if registry.stopped {
                Err(stopped(&last.path, "rename (its temporary file) to"))
            } else {
                let r = std::fs::rename(&last.tmp.0, &last.path)
                    .map_err(|e| Error::io(&last.path, "rename (its temporary file) to", e));
                if r.is_ok() {
                    registry
                        .files
                        .retain(|p| p != &last.tmp.0 && !placed.contains(p));
                }
                r
            }
        };
        match done {
            Ok(()) => {
                last.tmp.keep();
                Ok(())
            }
            Err(e) => {
                undo(&placed);
                Err(e)
            }
        }
    }
}

/// What the names of temporary files have after the destination's name:
/// `NAME.gpufeed-tmp-PID-NONCE`.
pub const TEMPORARY_MARKER: &str = ".gpufeed-tmp-";

/// The temporary files of this process's unfinished writers, and whether writing has been
/// stopped ([`stop_writers`]).
struct Registry {
    files: Vec<PathBuf>,
    stopped: bool,
}

static LIVE: Mutex<Registry> = Mutex::new(Registry {
    files: Vec::new(),
    stopped: false,
});

fn live() -> std::sync::MutexGuard<'static, Registry> {
    LIVE.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The error of a write asked for once [`stop_writers`] has run: the process is ending.
fn stopped(path: &Path, op: &'static str) -> Error {
    Error::io(
        path,
        op,
        std::io::Error::new(
            std::io::ErrorKind::Interrupted,
            "the process is ending on a signal: it writes no more files",
        ),
    )
}

/// A temporary file not yet owned by a writer: removed on drop.
pub(crate) struct Unowned(PathBuf);

impl Unowned {
    /// Owns the temporary file `path` (made by [`create`]) until [`keep`](Self::keep).
    pub(crate) fn new(path: PathBuf) -> Unowned {
        Unowned(path)
    }

    /// Hands the file over to a writer, which removes it from now on.
    pub(crate) fn keep(mut self) -> PathBuf {
        std::mem::take(&mut self.0)
    }
}

impl Drop for Unowned {
    fn drop(&mut self) {
        if !self.0.as_os_str().is_empty() {
            discard(&self.0);
        }
    }
}

/// Removes a temporary file and forgets it.
pub(crate) fn discard(tmp: &Path) {
    let _ = std::fs::remove_file(tmp);
    forget_unfinished(tmp);
}

/// Records `path`, a file about to be placed that is not complete without files placed after
/// it (a shard before its index: `ShardWriter`), so that [`remove_unfinished_temporaries`]
/// removes it with the temporaries until [`forget_unfinished`] (or [`discard`]) is called.
/// Recorded before it is placed and after its temporary, it is removed in the same pass as
/// that temporary: whichever of the two exists then goes.
pub(crate) fn register_unfinished(path: &Path) {
    live().files.push(path.to_path_buf());
}

/// Forgets a file recorded for [`remove_unfinished_temporaries`], leaving it in place.
pub(crate) fn forget_unfinished(path: &Path) {
    live().files.retain(|p| p != path);
}

/// Writes `bytes` to `path` by a temporary file beside it (synced, then renamed over `path`),
/// and forgets `completes`, the files recorded by [`register_unfinished`] that `path`
/// completes (the shards of a shard directory's index), in the same step: the record's lock
/// is held from the rename to the forgetting, so that a signal's cleanup runs wholly before
/// (the temporary is gone, the rename fails, `completes` are removed: no data set) or wholly
/// after (`path` and `completes` all stay: a whole one). `what` names the write in errors.
pub(crate) fn write_completing(
    path: &Path,
    what: &'static str,
    bytes: &[u8],
    completes: &[PathBuf],
) -> Result<()> {
    use std::io::Write;
    let (tmp, mut file) = create(path)?;
    let guard = Unowned::new(tmp);
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .map_err(|e| Error::io(path, what, e))?;
    let placed = {
        let mut registry = live();
        if registry.stopped {
            Err(stopped(path, what))
        } else {
            let placed = std::fs::rename(&guard.0, path)
                .map_err(|e| Error::io(path, "rename (its temporary file) to", e));
            if placed.is_ok() {
                registry
                    .files
                    .retain(|p| p != &guard.0 && !completes.contains(p));
            }
            placed
        }
    };
    // Placed: the temporary's name is gone and forgotten. Else `guard` removes it.
    if placed.is_ok() {
        guard.keep();
    }
    placed
}

/// Creates a new temporary file beside `path`, exclusively, under a name no other writer (in
/// this process, another, or another machine sharing the directory) uses, locks it, and
/// records it for [`remove_unfinished_temporaries`].
pub(crate) fn create(path: &Path) -> Result<(PathBuf, File)> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let name = path.file_name().unwrap_or_default();
    let mut last = None;
    for _ in 0..16 {
        let nonce = COUNTER.fetch_add(1, Ordering::Relaxed) ^ random_bits();
        let mut tmp_name = name.to_os_string();
        tmp_name.push(format!(
            "{TEMPORARY_MARKER}{}-{:016x}",
            std::process::id(),
            nonce
        ));
        let tmp = path.with_file_name(tmp_name);
        // Hold the registry while creating, so that a signal's cleanup never misses it, and
        // none is made once the writers are stopped.
        let mut registry = live();
        if registry.stopped {
            return Err(stopped(path, "create (a temporary file beside it)"));
        }
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
        {
            Ok(file) => {
                registry.files.push(tmp.clone());
                drop(registry);
                lock(&file);
                return Ok((tmp, file));
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => {
                return Err(Error::io(
                    path,
                    "create (a temporary file beside it, in its directory)",
                    e,
                ));
            }
        }
    }
    Err(Error::io(
        path,
        "create (a temporary file beside it: 16 names taken)",
        last.unwrap_or_else(|| std::io::Error::from(std::io::ErrorKind::AlreadyExists)),
    ))
}

/// 64 bits that differ between processes and calls (std's per-process random hash keys).
fn random_bits() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

/// Takes an exclusive advisory lock on a writer's temporary file, held until the file is
/// closed (also when the process is killed): how [`remove_stale_temporaries`] tells a live
/// writer's file from a dead one's, across processes and machines sharing the directory. A
/// file system without locks gets none; the pid in the name still protects this machine's
/// writers.
#[cfg(unix)]
fn lock(file: &File) {
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor `file` owns and keeps open; no memory is involved.
    let _ = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
}

#[cfg(not(unix))]
fn lock(_file: &File) {}

/// True if `path`'s lock can be taken: no live writer holds the file open.
#[cfg(unix)]
fn unlocked(path: &Path) -> bool {
    use std::os::fd::AsRawFd;
    let Ok(file) = File::open(path) else {
        return false;
    };
    // SAFETY: as in `lock`; the lock is released when `file` closes, below.
    let r = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if r == 0 {
        return true;
    }
    // No lock support: only the pid, already checked, can tell.
    let e = std::io::Error::last_os_error().raw_os_error();
    matches!(e, Some(libc::ENOLCK) | Some(libc::EOPNOTSUPP))
}

#[cfg(not(unix))]
fn unlocked(_path: &Path) -> bool {
    false
}

/// True if a process with this id runs (on this machine, in this pid namespace).
#[cfg(unix)]
fn process_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return true;
    };
    if pid <= 0 {
        return true;
    }
    // SAFETY: signal 0 only checks that `pid` (> 0: one process, never a group) exists.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

#[cfg(not(unix))]
fn process_alive(_pid: u32) -> bool {
    true
}

/// The writer's process id in a temporary's name `NAME.gpufeed-tmp-PID-NONCE` (or the
/// `NAME.tmp-PID` of gpufeed 0.1's writers), if `file_name` is a temporary of `name`'s.
fn temporary_pid(file_name: &std::ffi::OsStr, name: &std::ffi::OsStr) -> Option<u32> {
    let rest = file_name
        .as_encoded_bytes()
        .strip_prefix(name.as_encoded_bytes())?;
    let rest = std::str::from_utf8(rest).ok()?;
    if let Some(r) = rest.strip_prefix(TEMPORARY_MARKER) {
        let (pid, nonce) = r.split_once('-')?;
        if nonce.len() != 16 || !nonce.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        return pid.parse().ok();
    }
    let pid = rest.strip_prefix(".tmp-")?;
    if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    pid.parse().ok()
}

/// Removes the temporary files that writers to `path` killed outright (SIGKILL, a power
/// cut) left beside it: those whose process is gone and that no process holds locked. A live
/// writer's file, in this process or another, is never touched. Returns the files removed and
/// their sizes. Writers do not call this themselves (it lists the directory); `gpufeed pack`
/// does, before it writes.
pub fn remove_stale_temporaries(path: &Path) -> Result<Vec<(PathBuf, u64)>> {
    let Some(name) = path.file_name() else {
        return Ok(Vec::new());
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(dir, "list (for stale temporary files)", e)),
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let Some(pid) = temporary_pid(&entry.file_name(), name) else {
            continue;
        };
        let tmp = entry.path();
        if pid == std::process::id() || process_alive(pid) || !unlocked(&tmp) {
            continue;
        }
        let Ok(meta) = std::fs::symlink_metadata(&tmp) else {
            continue;
        };
        if meta.is_file() && std::fs::remove_file(&tmp).is_ok() {
            removed.push((tmp, meta.len()));
        }
    }
    Ok(removed)
}

/// Removes the temporary file of every unfinished writer of this process ([`RecordWriter`](crate::format::RecordWriter), [`write_replacing`]), and the
/// shards an unfinished [`ShardWriter`](crate::source::shards::packed::ShardWriter) has placed
/// (a shard directory is complete only with its index), so that a process about to die of a
/// signal leaves none behind; returns how many files it removed or found gone. For a
/// signal-handling thread (such as `signal-hook`'s iterator), not for a signal handler itself
/// (it takes a lock and allocates). Those writers then fail when they finish.
pub fn remove_unfinished_temporaries() -> usize {
    remove_recorded(&mut live())
}

/// For a process about to end of a signal while its other threads still run (until it does):
/// removes what [`remove_unfinished_temporaries`] removes and stops every writer of the
/// process for good, in one step: from then on no temporary file is created (a writer that
/// tries fails with an error of kind `Interrupted`), so that nothing a writer starts between
/// this cleanup and the end of the process is left behind; writers under way fail when they
/// next place a file (their temporaries are gone). Returns how many files it removed or found
/// gone. What `gpufeed`'s signal handling calls; as the other, for a signal-handling thread,
/// not a signal handler itself.
pub fn stop_writers() -> usize {
    let mut registry = live();
    registry.stopped = true;
    remove_recorded(&mut registry)
}

/// Removes every recorded file, and forgets them.
fn remove_recorded(registry: &mut Registry) -> usize {
    let n = registry.files.len();
    for tmp in registry.files.drain(..) {
        let _ = std::fs::remove_file(tmp);
    }
    n
}

#[cfg(test)]
mod tests {
    use super::{PlacedTogether, TEMPORARY_MARKER, write_replacing};
    use std::io::Write;

    fn names(dir: &std::path::Path) -> Vec<String> {
        let mut n: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        n.sort();
        n
    }

    #[test]
    fn files_placed_together_appear_only_at_the_end_and_an_error_leaves_the_old_ones() {
        let dir = tempfile::tempdir().unwrap();
        let (bin, idx) = (dir.path().join("d.bin"), dir.path().join("d.idx"));
        std::fs::write(&idx, b"old").unwrap();
        let mut files = PlacedTogether::create(&[&bin, &idx]).unwrap();
        files.writer(0).0.write_all(b"tokens").unwrap();
        files.writer(1).0.write_all(b"index").unwrap();
        assert_eq!(
            names(dir.path()).len(),
            3,
            "two temporaries and the old index"
        );
        assert!(!bin.exists());
        assert_eq!(std::fs::read(&idx).unwrap(), b"old");
        files.place().unwrap();
        assert_eq!(names(dir.path()), ["d.bin", "d.idx"]);
        assert_eq!(std::fs::read(&bin).unwrap(), b"tokens");
        assert_eq!(std::fs::read(&idx).unwrap(), b"index");
        // Dropped unplaced (an error on the way): the temporaries go, the files stay as they were.
        let mut files = PlacedTogether::create(&[&bin, &idx]).unwrap();
        files.writer(0).0.write_all(b"half").unwrap();
        drop(files);
        assert_eq!(names(dir.path()), ["d.bin", "d.idx"]);
        assert_eq!(std::fs::read(&bin).unwrap(), b"tokens");
        // A directory under a destination's name is refused before anything is made.
        let taken = dir.path().join("t.bin");
        std::fs::create_dir(&taken).unwrap();
        let e = PlacedTogether::create(&[&taken]).err().unwrap().to_string();
        assert!(e.contains("not a regular file"), "{e}");
    }

    #[test]
    fn a_replaced_file_is_whole_or_untouched_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.json");
        std::fs::write(&path, b"old").unwrap();
        // While written, the bytes go to a temporary beside it; the name keeps the old file.
        write_replacing(&path, "write the test file", |out| {
            out.write_all(b"new")?;
            out.flush()?;
            let during = names(dir.path());
            assert_eq!(during.len(), 2, "{during:?}");
            assert!(during[1].starts_with("out.json") && during[1].contains(TEMPORARY_MARKER));
            assert_eq!(std::fs::read(&path)?, b"old");
            Ok(())
        })
        .unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        assert_eq!(names(dir.path()), ["out.json"]);
        // A write that fails: the old file stays, the temporary goes, the error names the path.
        let e = write_replacing(&path, "write the test file", |out| {
            out.write_all(b"half")?;
            Err(std::io::Error::other("disk full"))
        })
        .unwrap_err();
        assert!(e.to_string().contains("out.json"), "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        assert_eq!(names(dir.path()), ["out.json"]);
        // A directory in the way is refused, not replaced.
        let e = write_replacing(dir.path(), "write the test file", |_| Ok(())).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        assert_eq!(names(dir.path()), ["out.json"]);
    }
}
