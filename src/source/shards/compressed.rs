//! Compressed shards: MDS shards written with a `compression` (`zstd`, the common choice, or
//! `gz`), decompressed once into the [`cache`](super::cache) directory and read from there.
//! Compressed JSON lines files (`.jsonl.gz`, `.jsonl.zst`) go the same way, with no index to
//! give their sizes or hashes.
//!
//! mosaicml-streaming's writer offers `br`, `bz2`, `gz`, `snappy` and `zstd` (each with an
//! optional `:LEVEL`, which a reader need not know); its own reader decompresses a shard into
//! its local cache on first use (`Stream._decompress_shard_part`). gpufeed does the same for
//! `zstd` and `gz`; a shard compressed otherwise whose raw file is not there is refused with
//! an error naming its compression.
//!
//! - **Once, shared**: the decompressed shard is a file of the cache, named by the raw file's
//!   name and its version (the index's hash of the raw file, else of the compressed one, else
//!   the compressed file's size and modification time), written under a temporary name and
//!   renamed whole, under the cache's fetch lock: every process of the machine decompresses
//!   a shard once, the others wait for it, and a later run reads it again without
//!   decompressing until the cache evicts it.
//! - **Checked**: the compressed bytes against the index's size and hashes of the compressed
//!   file (streaming hashes both files, and validates the compressed one), the decompressed
//!   ones against the raw file's size and hashes. A compressed shard that does not
//!   decompress to its index's raw file is an error naming it (the loader adds the sample),
//!   remembered so that later samples of it are refused at once.
//! - **Within the cache's limit**: room is made for the decompressed shard before it is
//!   written (least recently used shards out), as for a download; a shard larger than the
//!   limit is refused. A file whose decompressed size no index gives (JSON lines) is written
//!   first, at most the limit's size, and room is made for it before it is renamed into
//!   place. From an object store, the compressed file is itself a download of that cache.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use super::cache::DiskCache;
use super::{ShardBytes, ShardStore};
use crate::error::{Error, Result};

/// A compression gpufeed decompresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Compression {
    /// Zstandard (`zstd`, `zstd:LEVEL`).
    Zstd,
    /// gzip (`gz`, `gz:LEVEL`).
    Gzip,
}

impl Compression {
    /// streaming's name of a compression, or why it is not decompressed here.
    pub(crate) fn parse(name: &str) -> std::result::Result<Compression, String> {
        let family = name.split(':').next().unwrap_or(name);
        match family {
            "zstd" => Ok(Compression::Zstd),
            "gz" => Ok(Compression::Gzip),
            "br" | "bz2" | "snappy" => Err(format!(
                "compressed with `{name}`, which gpufeed does not decompress (it reads zstd and gz): decompress the shards, or write them with compression='zstd'"
            )),
            _ => Err(format!(
                "compressed with `{name}`, a compression streaming does not know"
            )),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Compression::Zstd => "zstd",
            Compression::Gzip => "gz",
        }
    }

    /// Decompresses `from` into `to`, refusing output past `most` bytes; returns the bytes
    /// written.
    pub(crate) fn decompress(
        self,
        from: &[u8],
        to: &mut dyn Write,
        most: u64,
    ) -> std::io::Result<u64> {
        let mut limited = Limited { to, left: most };
        match self {
            Compression::Zstd => {
                let mut d = zstd::stream::read::Decoder::with_buffer(from)?;
                std::io::copy(&mut d, &mut limited)
            }
            Compression::Gzip => {
                // streaming's `gzip.compress` output: one gzip member (several are read too).
                let mut d = flate2::read::MultiGzDecoder::new(from);
                std::io::copy(&mut d, &mut limited)
            }
        }
    }
}

/// A writer that fails past `left` bytes, and marks the errors of the writer it wraps
/// ([`WriteFailed`]) so that they are told apart from the decoder's.
struct Limited<'a> {
    to: &'a mut dyn Write,
    left: u64,
}

impl Write for Limited<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if buf.len() as u64 > self.left {
            return Err(std::io::Error::other(TooLong));
        }
        self.left -= buf.len() as u64;
        self.to
            .write_all(buf)
            .map_err(|e| std::io::Error::other(WriteFailed(e)))?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.to
            .flush()
            .map_err(|e| std::io::Error::other(WriteFailed(e)))
    }
}

/// The decompressed bytes would pass the raw file's size.
#[derive(Debug)]
struct TooLong;

impl std::fmt::Display for TooLong {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("decompresses to more bytes than allowed")
    }
}

impl std::error::Error for TooLong {}

/// Writing the decompressed bytes failed (a full disk).
#[derive(Debug)]
struct WriteFailed(std::io::Error);

impl std::fmt::Display for WriteFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for WriteFailed {}

/// The hashes of a file an index gives that gpufeed computes, each as a check of `bytes`.
pub(crate) trait FileCheck {
    /// Checks `bytes` against the hashes; `Err` says which differs.
    fn check(&self, bytes: &[u8]) -> std::result::Result<(), String>;
    /// A version of the file from its hashes, if it has one.
    fn version(&self) -> Option<String>;
}

/// No hashes: a file no index describes (a compressed JSON lines file).
pub(crate) struct NoHashes;

impl FileCheck for NoHashes {
    fn check(&self, _bytes: &[u8]) -> std::result::Result<(), String> {
        Ok(())
    }
    fn version(&self) -> Option<String> {
        None
    }
}

/// What an index says of a compressed shard.
pub(crate) struct CompressedShard<'a> {
    /// The format in messages (`MDS shard`, `JSON lines`).
    pub format: &'static str,
    /// The compressed file's name in the store.
    pub zip_name: &'a str,
    /// Its size.
    pub zip_bytes: u64,
    /// Its hashes.
    pub zip_hashes: &'a dyn FileCheck,
    /// The raw file's name (that of the decompressed copy in the cache).
    pub raw_name: &'a str,
    /// Its size, where an index gives it; `None`: whatever it decompresses to, within the
    /// cache's limit.
    pub raw_bytes: Option<u64>,
    /// Its hashes.
    pub raw_hashes: &'a dyn FileCheck,
    /// How it is compressed.
    pub compression: Compression,
}

/// Decompresses shards into a cache directory, once (see the [module](self) documentation).
pub(crate) struct Decompressor {
    cache: DiskCache,
    /// Shards whose compressed bytes are bad: the error's text, by compressed name.
    refused: Mutex<HashMap<String, String>>,
}

impl std::fmt::Debug for Decompressor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Decompressor")
            .field("cache", &self.cache)
            .finish()
    }
}

impl Decompressor {
    /// Decompressed shards of the data set at `key` (its index's place) under the cache
    /// directory `root`, within `limit` bytes (shared with whatever else that directory
    /// holds).
    pub(crate) fn new(root: PathBuf, limit: u64, key: &str) -> Result<Decompressor> {
        Ok(Decompressor {
            cache: DiskCache::new(root, limit, &format!("{key}#decompressed"))?,
            refused: Mutex::new(HashMap::new()),
        })
    }

    /// The raw bytes of `shard`, from the cache, or decompressed from its compressed file in
    /// `store` into the cache first. Errors name the compressed file.
    pub(crate) fn open(
        &self,
        store: &dyn ShardStore,
        shard: &CompressedShard<'_>,
    ) -> Result<ShardBytes> {
        let zip_path = store.locate(shard.zip_name);
        let bad = |what: String| Error::Malformed {
            path: zip_path.clone(),
            format: shard.format,
            what,
        };
        if let Some(what) = lock(&self.refused).get(shard.zip_name) {
            return Err(bad(what.clone()));
        }
        let version = match shard
            .raw_hashes
            .version()
            .or_else(|| shard.zip_hashes.version())
        {
            Some(v) => v,
            None => {
                let stat = store.stat(shard.zip_name)?;
                let mut h = xxhash_rust::xxh3::Xxh3::new();
                h.update(&stat.bytes.to_le_bytes());
                let t = stat
                    .modified
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                    .map_or(0, |d| d.as_nanos());
                h.update(&t.to_le_bytes());
                h.update(stat.tag.as_deref().unwrap_or("").as_bytes());
                format!("{:016x}", h.digest())
            }
        };
        let path = self.cache.path_for(shard.raw_name, &version);
        loop {
            if self.cache.touch_if_whole(&path) {
                return Self::mapped(&path, zip_path.clone());
            }
            let Some(guard) = self.cache.try_lock(&path)? else {
                // Another process of the machine is decompressing it.
                std::thread::sleep(Duration::from_millis(10));
                continue;
            };
            if self.cache.touch_if_whole(&path) {
                drop(guard);
                continue;
            }
            // Without a size from an index, the compressed size is the least it will take.
            self.cache
                .make_room(shard.raw_bytes.unwrap_or(shard.zip_bytes), &path)
                .map_err(|what| bad(format!("cannot be decompressed into the cache: {what}")))?;
            let (file, tmp) = self.cache.temporary(&path)?;
            let written = self.decompress(store, shard, file, &tmp);
            let result = written
                .and_then(|()| {
                    if shard.raw_bytes.is_some() {
                        return Ok(());
                    }
                    // Now that its size is known: room for it, the temporary file counted as
                    // arriving (it is not `keep`'s, so it is neither removed nor evicted).
                    self.cache.make_room(0, &tmp).map(|_| ()).map_err(|what| {
                        bad(format!("cannot be decompressed into the cache: {what}"))
                    })
                })
                .and_then(|()| {
                    std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, "rename", e))
                });
            if let Err(e) = result {
                let _ = std::fs::remove_file(&tmp);
                if let Error::Malformed { what, .. } = &e {
                    lock(&self.refused).insert(shard.zip_name.to_owned(), what.clone());
                }
                return Err(e);
            }
            drop(guard);
            return Self::mapped(&path, zip_path);
        }
    }

    /// Decompresses `shard` into `file` (at `tmp`) and checks it.
    fn decompress(
        &self,
        store: &dyn ShardStore,
        shard: &CompressedShard<'_>,
        file: std::fs::File,
        tmp: &Path,
    ) -> Result<()> {
        let zip_path = store.locate(shard.zip_name);
        let bad = |what: String| Error::Malformed {
            path: zip_path.clone(),
            format: shard.format,
            what,
        };
        let zip = store.open(shard.zip_name)?;
        let bytes = zip.all()?;
        if bytes.len() as u64 != shard.zip_bytes {
            return Err(bad(format!(
                "the compressed file is {} bytes, the index says {}",
                bytes.len(),
                shard.zip_bytes
            )));
        }
        shard
            .zip_hashes
            .check(bytes)
            .map_err(|what| bad(format!("the compressed file's {what}")))?;
        let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
        let name = shard.compression.name();
        let most = shard.raw_bytes.unwrap_or(self.cache.limit());
        let n = match shard.compression.decompress(bytes, &mut out, most) {
            Ok(n) => n,
            Err(e) if e.get_ref().is_some_and(|e| e.is::<TooLong>()) => {
                return Err(bad(match shard.raw_bytes {
                    Some(raw) => format!(
                        "{name}: decompresses to more than the index's {raw} bytes of its raw file"
                    ),
                    None => format!(
                        "{name}: decompresses to more than the cache's limit of {most} bytes ({}): raise the limit (GPUFEED_CACHE_LIMIT) or split the file",
                        self.cache.root().display()
                    ),
                }));
            }
            Err(e) => {
                let text = e.to_string();
                if let Some(Ok(w)) = e.into_inner().map(|e| e.downcast::<WriteFailed>()) {
                    return Err(Error::io(tmp, "write", w.0));
                }
                return Err(bad(format!("{name}: not a valid {name} stream ({text})")));
            }
        };
        out.flush().map_err(|e| Error::io(tmp, "write", e))?;
        drop(out);
        if let Some(raw) = shard.raw_bytes
            && n != raw
        {
            return Err(bad(format!(
                "{name}: decompresses to {n} bytes, the index's raw file is {raw}"
            )));
        }
        let raw = ShardBytes::map_file(tmp)?;
        shard
            .raw_hashes
            .check(raw.all()?)
            .map_err(|what| bad(format!("{name}: decompressed, its {what}")))
    }

    /// The cache's file at `path`, named `name` in messages.
    fn mapped(path: &Path, name: PathBuf) -> Result<ShardBytes> {
        let mapped = ShardBytes::map_file(path)?;
        Ok(ShardBytes::new(name, mapped.share(0..mapped.len())?))
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streamings_compressions_are_named() {
        assert_eq!(Compression::parse("zstd"), Ok(Compression::Zstd));
        assert_eq!(Compression::parse("zstd:7"), Ok(Compression::Zstd));
        assert_eq!(Compression::parse("gz:9"), Ok(Compression::Gzip));
        for other in ["br", "bz2:9", "snappy"] {
            let e = Compression::parse(other).unwrap_err();
            assert!(e.contains("does not decompress"), "{e}");
        }
        assert!(Compression::parse("lz4").is_err());
    }

    #[test]
    fn output_past_the_raw_size_is_refused() {
        let raw = vec![7u8; 10_000];
        let z = zstd::bulk::compress(&raw, 3).unwrap();
        let mut out = Vec::new();
        assert_eq!(
            Compression::Zstd.decompress(&z, &mut out, 10_000).unwrap(),
            10_000
        );
        assert_eq!(out, raw);
        let e = Compression::Zstd
            .decompress(&z, &mut Vec::new(), 9_999)
            .unwrap_err();
        assert!(e.get_ref().is_some_and(|e| e.is::<TooLong>()), "{e}");
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(6));
        gz.write_all(&raw).unwrap();
        let gz = gz.finish().unwrap();
        let mut out = Vec::new();
        Compression::Gzip.decompress(&gz, &mut out, 10_000).unwrap();
        assert_eq!(out, raw);
        assert!(
            Compression::Zstd
                .decompress(b"not zstd", &mut Vec::new(), 100)
                .is_err()
        );
    }
}
