//! The file behind a file-backed source: how its bytes are reached ([`ReadMode`]), what is
//! remembered of it at open to notice later that it changed, and the per-thread buffers that
//! reads go through.
//!
//! # The mapping's contract
//!
//! [`ReadMode::Map`] (the default) maps the file with `mmap(PROT_READ, MAP_SHARED)`. The mapping
//! is *shared* with the file: it is the page cache itself, so another process that writes to the
//! file changes the bytes gpufeed reads while it reads them, and a file that becomes shorter
//! than the mapping makes every access past its new end fault. Concretely, while a source is
//! open in this mode:
//!
//! - **truncating the file** (`np.save` or `open(path, "wb")` onto the same path, `truncate`,
//!   a writer restarting) kills the process with `SIGBUS` at the next read of a page past the
//!   new end. No Rust code can catch it;
//! - **rewriting bytes in place** gives samples whose bytes change under the reader, between
//!   batches or within one sample: silently wrong data, or (for packed files) a typed error when
//!   an offset or length no longer fits. Rust's rules for `&[u8]` assume the bytes do not
//!   change; gpufeed reads each offset once, into a local, before checking and using it, but
//!   nothing more can be promised about a file mutated under a mapping;
//! - **replacing the file** (write a new file, rename it over the path, as `RecordWriter` and
//!   careful tools do) is harmless to the open source: it keeps reading the old file, whose
//!   inode lives until it is closed.
//!
//! The user must therefore guarantee that no process truncates or writes a file while a source
//! maps it, or choose [`ReadMode::Pread`], which never maps: a truncated file is then a typed
//! error ([`Error::FileChanged`]), never a signal. Bytes rewritten in place are read as they
//! are in either mode unless the source checks what it reads
//! ([`ReadOptions::verify_checksums`](crate::format::ReadOptions::verify_checksums)): packed
//! files against the checksums their writer stored, `.npy` arrays against checksums taken at
//! open.
//!
//! Every file-backed source records the file's device, inode, size, modification time and
//! status-change time (`ctime`, which no call can set back) at open;
//! [`Dataset::check_unchanged`](crate::source::Dataset::check_unchanged) compares them with
//! what the path holds now (one `stat`), so that a replaced, truncated, extended or rewritten
//! file is reported, naming the file and what changed, at the next epoch instead of being read,
//! also when its modification time was put back.
//!
//! # Fingerprints
//!
//! What a resume checks a state against, beside sizes: [`sampled_fingerprint`] hashes a file's
//! length and 64 blocks of 4 KiB spread evenly over it (256 KiB read, whatever the file's size),
//! so that another data set of the same size is told apart from the one a state was taken on.
//! It is not a checksum: a few bytes rewritten between its blocks go unseen (the checksums of
//! [`ReadOptions::verify_checksums`](crate::format::ReadOptions::verify_checksums) see them).

use std::borrow::Cow;
use std::cell::RefCell;
use std::fs::{File, Metadata};
use std::path::Path;
use std::sync::Arc;
use std::time::SystemTime;

use memmap2::{Mmap, MmapOptions};

use crate::error::{Error, Result};

/// How a file-backed source ([`RecordFile`](crate::format::RecordFile),
/// [`NpyArray`](crate::source::NpyArray)) reaches its file's bytes.
///
/// See the [`source`](crate::source) module's section on mappings for what each mode promises
/// when the file changes while it is open.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ReadMode {
    /// One read-only, shared memory mapping of the whole file (`mmap(MAP_SHARED)`): samples
    /// are views into the page cache, with no copy and no system call per sample. The default,
    /// and the fastest. The file must not be truncated or written while it is open: truncation
    /// kills the process with `SIGBUS`, bytes written in place are read as they change.
    #[default]
    Map,
    /// Reads at offsets (`pread`) from one file descriptor shared by every thread, never a
    /// mapping. Fixed-size fields are read straight into their batch slot
    /// ([`Sample::copy_field_into`](crate::source::Sample::copy_field_into)); other reads go
    /// through a reusable per-thread buffer. For file systems where a mapping is unsafe or slow
    /// (NFS and other network or FUSE file systems) and for files that may be truncated: a
    /// short read is an [`Error::FileChanged`] naming the file, never a signal. Costs a system
    /// call and a kernel copy per read (see `benches/RESULTS.md`).
    Pread,
}

/// The bytes of an open file: a shared mapping, or the file itself to read at offsets.
#[derive(Clone)]
pub(crate) enum FileData {
    Map(Arc<Mmap>),
    Pread { file: Arc<File>, len: u64 },
}

/// Opens `path` in `mode`: its bytes and what it is (identity, size, modification time), the
/// latter taken from the open descriptor, so the two describe the same file.
pub(crate) fn open_file(path: &Path, mode: ReadMode) -> Result<(FileData, FileIdentity)> {
    let file = File::open(path).map_err(|e| Error::io(path, "open", e))?;
    let meta = file.metadata().map_err(|e| Error::io(path, "stat", e))?;
    let identity = FileIdentity::of(&meta);
    // Positions inside the file are used as `usize` (slices, buffers) in either mode.
    let len = usize::try_from(identity.len).map_err(|_| {
        Error::io(
            path,
            "open",
            std::io::Error::other("the file is larger than this machine's address space"),
        )
    })?;
    let data = match mode {
        ReadMode::Map => {
            // SAFETY: `Mmap` hands out `&[u8]` over a `MAP_SHARED` mapping of a file that
            // another process can still write or truncate; that cannot be ruled out here, so
            // this call relies on the contract documented on `ReadMode::Map`, `RecordFile`,
            // `NpyArray` and the README: the user does not let the file be truncated or written
            // while it is open (or opens it with `ReadMode::Pread`). What gpufeed does to limit
            // the harm if the contract is broken: the mapping's length is the size taken from
            // this descriptor just above, every position is checked against it, and every offset
            // read from the file is read once into a local before it is checked and used.
            // Truncation still ends the process with SIGBUS, which no code here can prevent.
            let map = unsafe { MmapOptions::new().len(len).map(&file) }
                .map_err(|e| Error::io(path, "map", e))?;
            FileData::Map(Arc::new(map))
        }
        ReadMode::Pread => FileData::Pread {
            file: Arc::new(file),
            len: identity.len,
        },
    };
    Ok((data, identity))
}

impl FileData {
    /// The file's size when it was opened (the mapping's length).
    pub fn len(&self) -> u64 {
        match self {
            FileData::Map(map) => map.len() as u64,
            FileData::Pread { len, .. } => *len,
        }
    }

    /// Which mode this is.
    pub fn mode(&self) -> ReadMode {
        match self {
            FileData::Map(_) => ReadMode::Map,
            FileData::Pread { .. } => ReadMode::Pread,
        }
    }

    /// Fills `dst` with the bytes at `at`; `at + dst.len()` must be within the size at open,
    /// else (or if the file has become shorter) an error naming `path`.
    pub fn read_at(&self, path: &Path, at: u64, dst: &mut [u8]) -> Result<()> {
        let end = at
            .checked_add(dst.len() as u64)
            .filter(|&e| e <= self.len());
        let Some(end) = end else {
            return Err(Error::io(
                path,
                "read",
                std::io::Error::other(format!(
                    "{} bytes at {at} lie past the end of the {}-byte file",
                    dst.len(),
                    self.len()
                )),
            ));
        };
        match self {
            FileData::Map(map) => {
                dst.copy_from_slice(&map[at as usize..end as usize]);
                Ok(())
            }
            FileData::Pread { file, len } => pread_exact(file, path, at, dst, *len),
        }
    }

    /// `len` bytes at `at`: borrowed from the mapping, or read.
    pub fn bytes_at(&self, path: &Path, at: u64, len: usize) -> Result<Cow<'_, [u8]>> {
        match self {
            FileData::Map(map) => {
                let end = at
                    .checked_add(len as u64)
                    .filter(|&e| e <= map.len() as u64);
                match end {
                    Some(end) => Ok(Cow::Borrowed(&map[at as usize..end as usize])),
                    None => Err(Error::io(
                        path,
                        "read",
                        std::io::Error::other(format!(
                            "{len} bytes at {at} lie past the end of the {}-byte file",
                            map.len()
                        )),
                    )),
                }
            }
            FileData::Pread { .. } => {
                let mut v = vec![0u8; len];
                self.read_at(path, at, &mut v)?;
                Ok(Cow::Owned(v))
            }
        }
    }

    /// The little-endian `u64` at `at`.
    pub fn u64_at(&self, path: &Path, at: u64) -> Result<u64> {
        let mut b = [0u8; 8];
        self.read_at(path, at, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }
}

/// Blocks a fingerprint reads at most, and their size (see the [module docs](self)).
const FINGERPRINT_BLOCKS: u64 = 64;
const FINGERPRINT_BLOCK: u64 = 4096;

/// The blocks a fingerprint of `len` bytes reads, as (offset, length): 64 blocks of 4 KiB
/// spread evenly from the first byte to the last, or every block when there are fewer than
/// 256 KiB.
fn fingerprint_blocks(len: u64) -> impl Iterator<Item = (u64, usize)> {
    let whole = len <= FINGERPRINT_BLOCKS * FINGERPRINT_BLOCK;
    let count = if whole {
        len.div_ceil(FINGERPRINT_BLOCK)
    } else {
        FINGERPRINT_BLOCKS
    };
    let last = len.saturating_sub(FINGERPRINT_BLOCK);
    (0..count).map(move |k| {
        if whole {
            let at = k * FINGERPRINT_BLOCK;
            (at, (len - at).min(FINGERPRINT_BLOCK) as usize)
        } else {
            let at = u128::from(last) * u128::from(k) / u128::from(FINGERPRINT_BLOCKS - 1);
            (at as u64, FINGERPRINT_BLOCK as usize)
        }
    })
}

/// The fingerprint of `len` bytes that `read(at, buf)` reads: xxh3-64 of the length and of the
/// [blocks](fingerprint_blocks) sampled.
pub(crate) fn sampled_fingerprint(
    len: u64,
    mut read: impl FnMut(u64, &mut [u8]) -> Result<()>,
) -> Result<u64> {
    let mut hash = xxhash_rust::xxh3::Xxh3::new();
    hash.update(&len.to_le_bytes());
    let mut block = [0u8; FINGERPRINT_BLOCK as usize];
    for (at, n) in fingerprint_blocks(len) {
        read(at, &mut block[..n])?;
        hash.update(&block[..n]);
    }
    Ok(hash.digest())
}

/// The fingerprint of a mapping's bytes. The blocks are asked for first (`MADV_WILLNEED`: the
/// kernel reads them at once, in parallel, and no more), so that a cold file costs one read of
/// each block, not a page fault's read-ahead around each (8 MiB each on a machine whose
/// `read_ahead_kb` is 8192: a second for a cold file, against 10 ms; benches/RESULTS.md).
pub(crate) fn mapped_fingerprint(map: &Mmap) -> u64 {
    let len = map.len() as u64;
    for (at, n) in fingerprint_blocks(len) {
        // A hint: if it fails, the read below faults the page in.
        let _ = map.advise_range(memmap2::Advice::WillNeed, at as usize, n);
    }
    let mut hash = xxhash_rust::xxh3::Xxh3::new();
    hash.update(&len.to_le_bytes());
    for (at, n) in fingerprint_blocks(len) {
        hash.update(&map[at as usize..at as usize + n]);
    }
    hash.digest()
}

/// One fingerprint of several (of the files or fields that make a data set), in order.
pub(crate) fn combined_fingerprint(parts: impl IntoIterator<Item = u64>) -> u64 {
    let mut hash = xxhash_rust::xxh3::Xxh3::new();
    for p in parts {
        hash.update(&p.to_le_bytes());
    }
    hash.digest()
}

/// A fingerprint as states write it: 16 lower-case hex digits.
pub(crate) fn fingerprint_hex(fingerprint: u64) -> String {
    format!("{fingerprint:016x}")
}

impl FileData {
    /// The file's [fingerprint](sampled_fingerprint), read as this file is read.
    pub fn fingerprint(&self, path: &Path) -> Result<u64> {
        match self {
            FileData::Map(map) => Ok(mapped_fingerprint(map)),
            FileData::Pread { .. } => {
                sampled_fingerprint(self.len(), |at, buf| self.read_at(path, at, buf))
            }
        }
    }
}

/// `pread` until `dst` is full; a file that ends first was truncated after it was opened.
pub(crate) fn pread_exact(
    file: &File,
    path: &Path,
    at: u64,
    dst: &mut [u8],
    len: u64,
) -> Result<()> {
    match read_exact_at(file, dst, at) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(Error::FileChanged {
            path: path.to_path_buf(),
            what: format!(
                "it ends before byte {} (it had {len} bytes when it was opened): it was truncated \
                 while open",
                at + dst.len() as u64
            ),
        }),
        Err(e) => Err(Error::io(path, "read", e)),
    }
}

#[cfg(unix)]
fn read_exact_at(file: &File, dst: &mut [u8], at: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(file, dst, at)
}

#[cfg(windows)]
fn read_exact_at(file: &File, mut dst: &mut [u8], mut at: u64) -> std::io::Result<()> {
    use std::os::windows::fs::FileExt;
    while !dst.is_empty() {
        match file.seek_read(dst, at) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                dst = &mut dst[n..];
                at += n as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(not(any(unix, windows)))]
fn read_exact_at(_file: &File, _dst: &mut [u8], _at: u64) -> std::io::Result<()> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "reads at offsets (ReadMode::Pread) are not supported on this platform",
    ))
}

/// What a file was when it was opened: device and inode (which file the path named), size,
/// modification time and status-change time (whether it was written since).
///
/// The status-change time (`ctime`) is what catches a file written in place whose
/// modification time was then put back (`touch -r`, `os.utime`, `rsync --inplace`, a tool that
/// preserves times): no system call sets it, every write and every change of the file's
/// metadata moves it to the present. Both times have the file system's granularity (on Linux,
/// a tick of the kernel's coarse clock, a few milliseconds): a write within the same tick as
/// the open is not told apart by them; checksums
/// ([`ReadOptions::verify_checksums`](crate::format::ReadOptions::verify_checksums)) are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FileIdentity {
    /// Device and inode, where the platform has them.
    id: Option<(u64, u64)>,
    len: u64,
    modified: Option<SystemTime>,
    /// Seconds and nanoseconds, where the platform has them.
    changed: Option<(i64, i64)>,
}

impl FileIdentity {
    pub fn of(meta: &Metadata) -> FileIdentity {
        #[cfg(unix)]
        let (id, changed) = {
            use std::os::unix::fs::MetadataExt;
            (
                Some((meta.dev(), meta.ino())),
                Some((meta.ctime(), meta.ctime_nsec())),
            )
        };
        #[cfg(not(unix))]
        let (id, changed) = (None, None);
        FileIdentity {
            id,
            len: meta.len(),
            modified: meta.modified().ok(),
            changed,
        }
    }

    /// A hash of everything this records, never 0: equal for two looks at the same file
    /// unchanged, different (but for a 2^-64 chance) once it was replaced or written.
    pub fn fingerprint(&self) -> u64 {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        let (dev, ino) = self.id.unwrap_or_default();
        let modified = self
            .modified
            .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        let (secs, nanos) = self.changed.unwrap_or_default();
        for word in [dev, ino, self.len, secs as u64, nanos as u64] {
            h.update(&word.to_le_bytes());
        }
        h.update(&modified.to_le_bytes());
        h.digest().max(1)
    }

    /// The file's size.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Its modification time, where the platform has one.
    pub fn modified(&self) -> Option<SystemTime> {
        self.modified
    }

    /// Compares this with what `path` names now (one `stat`, following links): an
    /// [`Error::FileChanged`] naming the file and what changed, or an [`Error::Io`] if the
    /// path cannot be looked at.
    pub fn check(&self, path: &Path) -> Result<()> {
        let now = match std::fs::metadata(path) {
            Ok(m) => FileIdentity::of(&m),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::FileChanged {
                    path: path.to_path_buf(),
                    what: "it was removed or renamed: no file has this name any more (the source \
                           still reads the file it opened)"
                        .into(),
                });
            }
            Err(e) => return Err(Error::io(path, "stat", e)),
        };
        let changed = |what: String| {
            Err(Error::FileChanged {
                path: path.to_path_buf(),
                what,
            })
        };
        const RENAME: &str =
            "to change data under a running job, write a new file and rename it over the old one";
        if let (Some(was), Some(is)) = (self.id, now.id)
            && was != is
        {
            return changed(format!(
                "it was replaced by another file (device:inode {}:{} when opened, {}:{} now; {} bytes then, {} now); \
                 the source still reads the file it opened: reopen the path to read the new one",
                was.0, was.1, is.0, is.1, self.len, now.len
            ));
        }
        if now.len != self.len {
            let how = if now.len < self.len {
                "truncated"
            } else {
                "extended"
            };
            return changed(format!(
                "it was {how} in place from {} to {} bytes (reading a mapping past a truncation \
                 kills the process with SIGBUS); {RENAME}",
                self.len, now.len
            ));
        }
        if now.modified != self.modified {
            return changed(format!(
                "it was written in place (same size; modification time {} when opened, {} now): \
                 samples may mix old and new bytes; {RENAME}",
                describe_time(self.modified),
                describe_time(now.modified)
            ));
        }
        if let (Some(was), Some(is)) = (self.changed, now.changed)
            && was != is
        {
            return changed(format!(
                "its status-change time (ctime) moved from {}.{:09}s when opened to {}.{:09}s now, \
                 with its size ({} bytes) and modification time ({}) as they were: it was written \
                 in place and its modification time put back (touch -r, os.utime, a copy that \
                 keeps times), or its permissions, owner or links changed; samples may mix old \
                 and new bytes; {RENAME}",
                was.0,
                was.1,
                is.0,
                is.1,
                self.len,
                describe_time(self.modified)
            ));
        }
        Ok(())
    }
}

fn describe_time(t: Option<SystemTime>) -> String {
    match t.map(|t| t.duration_since(SystemTime::UNIX_EPOCH)) {
        Some(Ok(d)) => format!("{}.{:09}s", d.as_secs(), d.subsec_nanos()),
        Some(Err(_)) => "before 1970".into(),
        None => "unknown".into(),
    }
}

/// Buffers above this size are not kept for reuse when their record is dropped.
const SPARE_MAX_BYTES: usize = 64 << 20;
/// Spare buffers kept per thread.
const SPARE_BUFFERS: usize = 4;

thread_local! {
    static SPARE: RefCell<Vec<Vec<u8>>> = const { RefCell::new(Vec::new()) };
}

/// A record's bytes read from a file, in a buffer taken from (and given back to, on drop) a
/// small per-thread list of spares: after the first few reads on a thread, reading a record
/// allocates and zero-fills nothing.
pub(crate) struct RecordBuf {
    /// Initialised bytes, at least `len`; only `..len` are the record.
    buf: Vec<u8>,
    len: usize,
}

impl RecordBuf {
    /// A buffer of `len` bytes, whose contents are whatever a spare held (to be overwritten).
    pub fn with_len(len: usize) -> RecordBuf {
        let spare = SPARE
            .try_with(|s| {
                let mut s = s.try_borrow_mut().ok()?;
                let k = s.iter().position(|b| b.len() >= len).or_else(|| {
                    // None is large enough: grow the largest.
                    (0..s.len()).max_by_key(|&k| s[k].len())
                })?;
                Some(s.swap_remove(k))
            })
            .ok()
            .flatten();
        let mut buf = spare.unwrap_or_default();
        if buf.len() < len {
            buf.resize(len, 0);
        }
        RecordBuf { buf, len }
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.buf[..self.len]
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.buf[..self.len]
    }
}

impl Clone for RecordBuf {
    fn clone(&self) -> RecordBuf {
        let mut c = RecordBuf::with_len(self.len);
        c.as_mut_slice().copy_from_slice(self.as_slice());
        c
    }
}

impl Drop for RecordBuf {
    fn drop(&mut self) {
        if self.buf.capacity() > SPARE_MAX_BYTES {
            return;
        }
        let buf = std::mem::take(&mut self.buf);
        let _ = SPARE.try_with(|s| {
            if let Ok(mut s) = s.try_borrow_mut()
                && s.len() < SPARE_BUFFERS
            {
                s.push(buf);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_buffers_are_reused_on_one_thread() {
        std::thread::spawn(|| {
            let a = RecordBuf::with_len(1000);
            let p = a.buf.as_ptr();
            drop(a);
            let mut b = RecordBuf::with_len(600);
            assert_eq!(b.buf.as_ptr(), p, "the spare was not reused");
            assert_eq!(b.as_slice().len(), 600);
            b.as_mut_slice().fill(7);
            let c = b.clone();
            assert_eq!(c.as_slice(), b.as_slice());
            // A larger request grows a spare rather than leaving it unused.
            drop((b, c));
            let d = RecordBuf::with_len(5000);
            assert_eq!(d.as_slice().len(), 5000);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn reads_past_the_end_are_errors_in_both_modes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, [1u8, 2, 3, 4, 5]).unwrap();
        for mode in [ReadMode::Map, ReadMode::Pread] {
            let (data, _) = open_file(&p, mode).unwrap();
            assert_eq!(data.mode(), mode);
            let mut b = [0u8; 3];
            data.read_at(&p, 2, &mut b).unwrap();
            assert_eq!(b, [3, 4, 5]);
            assert!(data.read_at(&p, 3, &mut b).is_err());
            assert!(data.read_at(&p, u64::MAX, &mut b).is_err());
            assert_eq!(&*data.bytes_at(&p, 1, 2).unwrap(), &[2, 3]);
            assert!(data.bytes_at(&p, 4, 2).is_err());
        }
    }

    #[test]
    fn fingerprints_tell_files_of_one_size_apart_and_read_a_bounded_sample() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        for len in [0usize, 1, 4095, 4097, 256 << 10, (256 << 10) + 1, 5 << 20] {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            std::fs::write(&p, &bytes).unwrap();
            let mut prints = Vec::new();
            for mode in [ReadMode::Map, ReadMode::Pread] {
                let (data, _) = open_file(&p, mode).unwrap();
                prints.push(data.fingerprint(&p).unwrap());
            }
            assert_eq!(prints[0], prints[1], "{len}: the same in both modes");
            let mut read = 0u64;
            let f = sampled_fingerprint(len as u64, |at, buf| {
                read += buf.len() as u64;
                buf.copy_from_slice(&bytes[at as usize..at as usize + buf.len()]);
                Ok(())
            })
            .unwrap();
            assert_eq!(f, prints[0]);
            assert!(read <= 256 << 10, "{len}: {read} bytes read");
            if len > 0 {
                // The first and the last byte are in a block; another file of the same size
                // is told apart.
                for at in [0, len - 1] {
                    let mut other = bytes.clone();
                    other[at] ^= 1;
                    std::fs::write(&p, &other).unwrap();
                    let (data, _) = open_file(&p, ReadMode::Map).unwrap();
                    assert_ne!(data.fingerprint(&p).unwrap(), f, "{len}: byte {at}");
                }
            }
        }
    }

    #[test]
    fn a_truncated_file_is_a_typed_error_under_pread() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, [9u8; 100]).unwrap();
        let (data, id) = open_file(&p, ReadMode::Pread).unwrap();
        id.check(&p).unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(10)
            .unwrap();
        let mut b = [0u8; 20];
        let e = data.read_at(&p, 50, &mut b).unwrap_err();
        assert!(matches!(e, Error::FileChanged { .. }), "{e}");
        let e = id.check(&p).unwrap_err();
        assert!(e.to_string().contains("truncated"), "{e}");
    }
}
