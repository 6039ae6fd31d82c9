//! WebDataset tar shards: members grouped into samples by webdataset's own rules, an index of
//! each shard's samples built once (one pass over its tar headers) and cached on disk, and
//! [`WebDataset`], the dataset reader.
//!
//! The rules, from webdataset's `tariterators.py` (`tar_file_iterator`, `base_plus_ext`,
//! `group_by_keys`):
//!
//! - only regular files are members of samples; directories, links and devices are skipped;
//! - a member whose name has no `/` and starts and ends with `__` is skipped (metadata), and so
//!   is one matching `__[^/]*__($|/)` at its start;
//! - a name splits into key and extension by `^((?:.*/|)[^.]+)[.]([^/]*)$`: the key is the path
//!   up to the first dot of the file name (directories kept), the extension the rest,
//!   lower-cased (gpufeed implements that regular expression exactly, backtracking
//!   included: `dir/.hidden` has key `dir/` and extension `hidden`);
//! - a member whose name does not match (no extension, or a file name starting with a dot in a
//!   directory whose name has a dot) is skipped by webdataset without a word: here it is
//!   skipped and counted ([`UnkeyedPolicy::Skip`], the default) or refused
//!   ([`UnkeyedPolicy::Error`]);
//! - consecutive members with the same key form one sample (`__key__`); a key that comes back
//!   later starts a new sample; samples never span shards;
//! - an extension seen twice in one sample is an error ([`Error::BadMember`]), as in
//!   webdataset (`ValueError: duplicate file name`); so are the extensions `__key__` and
//!   `__url__`, which webdataset's sample dict already holds.
//!
//! Where this reader is stricter than webdataset: a corrupt or truncated tar is an error
//! (Python's `tarfile` ends such an archive early without a word), and an empty extension (a
//! name ending in a dot) is an error (it cannot name a field).
//!
//! The schema has one field per extension, named by it, decoded by webdataset's own default
//! decoders (`autodecode.basichandlers`), from its last dot-separated part (see
//! [`decode`](super::decode)): `cls`, `cls2`, `index`, `inx`, `id` (`str(int)`, as
//! webdataset writes them) are `i64` scalar tensors; `npy` members are tensors of their dtype
//! and shape when every one of the first shard has the same, else bytes of codec npy (the
//! whole member); `txt`, `text`, `transcript` are UTF-8 bytes, `json`, `jsn` JSON bytes (both
//! checked to be UTF-8); `jpg`/`jpeg` and `png` images (bytes, jpeg / png); any other, raw
//! bytes. A field is declared otherwise by its name ([`ShardOptions::decode`]: `label.u32` as
//! `u32[]`, `x.npy` as `f32[3,4]` or as `npy`). The fields are those the user declares
//! ([`WebDatasetOptions::fields`]; other extensions are ignored, as webdataset's `suffixes`),
//! else every extension found in the first shard, sorted. A sample without one of the fields
//! is [`Error::MissingField`] (naming shard, key and field) when the dataset is opened, or is
//! skipped and counted ([`MissingFieldPolicy::Skip`]). A member that does not decode (a `.cls`
//! that is not an integer, a `.npy` of another shape than its field's) is [`Error::BadMember`]
//! naming the shard, the member and the field, when its sample is read. Each field is a view
//! of its member's bytes in the mapped shard (a `.npy` tensor's values in place): nothing is
//! copied but the integers decoded from text.
//!
//! The index of a shard (each sample's key, and each member's extension, offset and size) is
//! cached under [`WebDatasetOptions::cache_dir`] in a file named by a hash of the shard's path,
//! size and modification time (and the store's version tag, an object store's ETag), written by a temporary name and a rename, and checked when read
//! (its own checksum, the shard's path, size and time, every member inside the shard): a stale
//! or corrupt cache file is rebuilt, never trusted.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::UNIX_EPOCH;

use rayon::prelude::*;

use super::decode::{Decoder, FieldDecode, Value};
use super::tar::{MemberKind, TarMembers};
use super::{
    LocalDir, ShardFormat, ShardOptions, ShardStat, ShardStore, ShardedDataset, default_cache_dir,
    quoted, unquoted, write_atomically,
};
use crate::error::{Error, Result};
use crate::format::{Codec, Schema};
use crate::source::{FieldSpan, Sample};

/// What to do with a tar member whose name has no extension (webdataset skips it silently).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum UnkeyedPolicy {
    /// Skip it, as webdataset does, and count it ([`TarIndex::skipped_members`]).
    #[default]
    Skip,
    /// Refuse the shard: [`Error::BadMember`].
    Error,
}

/// What to do with a sample that lacks one of the dataset's fields.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum MissingFieldPolicy {
    /// Refuse the dataset when it is opened: [`Error::MissingField`].
    #[default]
    Error,
    /// Leave the sample out of the dataset and count it ([`WebDataset::skipped_samples`]).
    Skip,
}

/// Settings of a [`WebDataset`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WebDatasetOptions {
    /// The fields (extensions) of every sample, in order; `None`: every extension of the first
    /// shard, sorted.
    pub fields: Option<Vec<String>>,
    /// Where shard indexes are cached; `None`: `default_cache_dir()/tar-index`.
    pub cache_dir: Option<PathBuf>,
    /// Members without an extension.
    pub unkeyed: UnkeyedPolicy,
    /// Samples without one of the fields.
    pub missing: MissingFieldPolicy,
    /// Settings common to sharded formats.
    pub shards: ShardOptions,
}

impl Default for WebDatasetOptions {
    fn default() -> Self {
        WebDatasetOptions {
            fields: None,
            cache_dir: None,
            unkeyed: UnkeyedPolicy::Skip,
            missing: MissingFieldPolicy::Error,
            shards: ShardOptions::default(),
        }
    }
}

/// Splits a member name into (key, extension) as webdataset's `base_plus_ext` does with the
/// regular expression `^((?:.*/|)[^.]+)[.]([^/]*)$` (Python's `re.match`), or `None` where it
/// does not match. The extension is not lower-cased here.
pub(crate) fn split_key(name: &[u8]) -> Option<(&[u8], &[u8])> {
    // The extension cannot hold a `/`, so its dot is in the file name: the first dot there.
    let base = name.iter().rposition(|&c| c == b'/').map_or(0, |p| p + 1);
    let dot = base + name[base..].iter().position(|&c| c == b'.')?;
    // `(?:.*/|)` is a prefix ending in `/` (without a newline: `.` does not match one) or
    // nothing; `[^.]+` then runs, non-empty and dot-free, up to that dot. The shortest such
    // run is the best candidate: it starts right after the last dot before `dot`.
    let last_dot = name[..dot].iter().rposition(|&c| c == b'.');
    let start = match last_dot {
        None => 0,
        Some(p) => p + 1 + name[p + 1..].iter().position(|&c| c == b'/')? + 1,
    };
    if start >= dot {
        return None;
    }
    // The prefix before `start` must hold no newline (when it is not empty).
    if name[..start].contains(&b'\n') {
        // A later `/` would only lengthen the prefix; an earlier start would include a dot.
        return None;
    }
    Some((&name[..dot], &name[dot + 1..]))
}

/// Whether webdataset skips a member as metadata: no `/` and `__` at both ends, or a match of
/// `__[^/]*__($|/)` at its start.
pub(crate) fn is_meta(name: &[u8]) -> bool {
    if !name.contains(&b'/') && name.starts_with(b"__") && name.ends_with(b"__") {
        return true;
    }
    if !name.starts_with(b"__") {
        return false;
    }
    let end = name.iter().position(|&c| c == b'/').unwrap_or(name.len());
    // `__[^/]*__` then the end of the name, a `/`, or (Python's `$`) a final newline.
    (2..=end.saturating_sub(2)).any(|k| {
        &name[k..k + 2] == b"__"
            && (k + 2 == name.len()
                || name[k + 2] == b'/'
                || (k + 3 == name.len() && name[k + 2] == b'\n'))
    })
}

/// Lower-cases an extension as Python's `str.lower` (Unicode), or ASCII only for bytes that
/// are not UTF-8.
fn lower(ext: &[u8]) -> Vec<u8> {
    match std::str::from_utf8(ext) {
        Ok(s) => s.to_lowercase().into_bytes(),
        Err(_) => ext.to_ascii_lowercase(),
    }
}

/// The last dot-separated part of an extension, which webdataset's decoders go by.
fn last_part(ext: &str) -> &str {
    ext.rsplit('.').next().unwrap_or(ext)
}

/// How webdataset's default decoders (`autodecode.basichandlers`) decode a member of this
/// extension, as a field: from its last dot-separated part. `npy` members are bytes here;
/// [`WebDataset::from_store`] makes them tensors when the first shard's agree.
pub(crate) fn decode_for_extension(ext: &str) -> FieldDecode {
    match last_part(ext) {
        "cls" | "cls2" | "index" | "inx" | "id" => FieldDecode::Int,
        "jpg" | "jpeg" => FieldDecode::Bytes(Codec::Jpeg),
        "png" => FieldDecode::Bytes(Codec::Png),
        "txt" | "text" | "transcript" => FieldDecode::Bytes(Codec::Utf8),
        "json" | "jsn" => FieldDecode::Bytes(Codec::Json),
        "npy" => FieldDecode::Bytes(Codec::Npy),
        _ => FieldDecode::Bytes(Codec::Raw),
    }
}

/// One member of a sample in a [`TarIndex`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexedMember {
    /// Its extension's number in [`TarIndex::extensions`].
    pub ext: u32,
    /// Where its header starts (for messages).
    pub header: u64,
    /// Where its data starts.
    pub offset: u64,
    /// Its data's size.
    pub size: u64,
}

/// The samples of one tar shard: each one's key and members. Built by [`TarIndex::build`] from
/// one pass over the headers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TarIndex {
    extensions: Vec<String>,
    keys: Vec<u8>,
    /// Per sample: where its key ends in `keys`, where its members end in `members`.
    samples: Vec<(u64, u32)>,
    members: Vec<IndexedMember>,
    skipped_members: u64,
}

impl TarIndex {
    /// Indexes the tar archive `bytes` (the shard at `path`).
    pub fn build(path: &Path, bytes: &[u8], unkeyed: UnkeyedPolicy) -> Result<TarIndex> {
        let mut index = TarIndex {
            extensions: Vec::new(),
            keys: Vec::new(),
            samples: Vec::new(),
            members: Vec::new(),
            skipped_members: 0,
        };
        let mut current: Option<Vec<u8>> = None;
        let mut seen: Vec<u32> = Vec::new();
        let bad = |m: &super::tar::TarMember, what: String| Error::BadMember {
            shard: path.to_path_buf(),
            member: quoted(&m.name),
            offset: m.header_offset,
            what,
        };
        for member in TarMembers::new(path, bytes) {
            let m = member?;
            if m.kind != MemberKind::Regular || is_meta(&m.name) {
                continue;
            }
            let Some((key, ext)) = split_key(&m.name) else {
                match unkeyed {
                    UnkeyedPolicy::Skip => {
                        index.skipped_members += 1;
                        continue;
                    }
                    UnkeyedPolicy::Error => {
                        return Err(bad(
                            &m,
                            "no extension: webdataset's key rule (path up to the first dot of the file name) gives it no key".into(),
                        ));
                    }
                }
            };
            let ext = lower(ext);
            let ext = String::from_utf8(ext).map_err(|e| {
                bad(
                    &m,
                    format!(
                        "the extension is not UTF-8 (byte {})",
                        e.utf8_error().valid_up_to()
                    ),
                )
            })?;
            if ext.is_empty() {
                return Err(bad(
                    &m,
                    "an empty extension (the name ends in a dot)".into(),
                ));
            }
            if ext == "__key__" || ext == "__url__" {
                return Err(bad(
                    &m,
                    format!("the extension `{ext}` repeats a name webdataset gives every sample"),
                ));
            }
            if current.as_deref() != Some(key) {
                if let Some(k) = current.take() {
                    index.push_sample(&k)?;
                }
                current = Some(key.to_vec());
                seen.clear();
            }
            let id = match index.extensions.iter().position(|e| *e == ext) {
                Some(i) => i as u32,
                None => {
                    index.extensions.push(ext.clone());
                    (index.extensions.len() - 1) as u32
                }
            };
            if seen.contains(&id) {
                return Err(bad(
                    &m,
                    format!(
                        "the extension `{ext}` appears twice in the sample `{}`",
                        quoted(key)
                    ),
                ));
            }
            seen.push(id);
            index.members.push(IndexedMember {
                ext: id,
                header: m.header_offset,
                offset: m.data_offset,
                size: m.size,
            });
        }
        if let Some(k) = current.take() {
            index.push_sample(&k)?;
        }
        Ok(index)
    }

    fn push_sample(&mut self, key: &[u8]) -> Result<()> {
        self.keys.extend_from_slice(key);
        let members = u32::try_from(self.members.len())
            .map_err(|_| Error::mismatch("more than 2^32 members in one tar shard"))?;
        self.samples.push((self.keys.len() as u64, members));
        Ok(())
    }

    /// The samples in the shard.
    pub fn len(&self) -> u64 {
        self.samples.len() as u64
    }

    /// True for a shard with no sample.
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// The extensions found, in order of first appearance.
    pub fn extensions(&self) -> &[String] {
        &self.extensions
    }

    /// Members skipped for having no extension ([`UnkeyedPolicy::Skip`]).
    pub fn skipped_members(&self) -> u64 {
        self.skipped_members
    }

    /// Sample `i`'s key (`__key__`), as stored bytes.
    pub fn key(&self, i: usize) -> Option<&[u8]> {
        let end = self.samples.get(i)?.0 as usize;
        let start = if i == 0 {
            0
        } else {
            self.samples[i - 1].0 as usize
        };
        self.keys.get(start..end)
    }

    /// Sample `i`'s members.
    pub fn members(&self, i: usize) -> Option<&[IndexedMember]> {
        let end = self.samples.get(i)?.1 as usize;
        let start = if i == 0 {
            0
        } else {
            self.samples[i - 1].1 as usize
        };
        self.members.get(start..end)
    }

    /// Checks that the index holds together and every member lies inside a shard of
    /// `shard_bytes` bytes (a cache file is untrusted).
    fn check(&self, shard_bytes: u64) -> Result<(), String> {
        let mut key_end = 0u64;
        let mut member_end = 0u32;
        for &(k, m) in &self.samples {
            if k < key_end || m < member_end {
                return Err("sample table decreases".into());
            }
            key_end = k;
            member_end = m;
        }
        if key_end != self.keys.len() as u64 || member_end as usize != self.members.len() {
            return Err("sample table does not cover the keys and members".into());
        }
        for m in &self.members {
            if m.ext as usize >= self.extensions.len() {
                return Err(format!("extension {} of {}", m.ext, self.extensions.len()));
            }
            if m.offset.checked_add(m.size).is_none_or(|e| e > shard_bytes) {
                return Err(format!(
                    "a member at {}+{} is outside the shard's {shard_bytes} bytes",
                    m.offset, m.size
                ));
            }
        }
        for (i, e) in self.extensions.iter().enumerate() {
            if e.is_empty() || self.extensions[..i].contains(e) {
                return Err(format!("extension `{e}` is empty or repeated"));
            }
        }
        Ok(())
    }

    /// The cache file's bytes: a header naming the shard, the index, an xxh3-64 of it all.
    fn encode(&self, shard: &Path, stat: &ShardStat) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.keys.len() + 32 * self.members.len());
        out.extend_from_slice(CACHE_MAGIC);
        let path = shard.as_os_str().as_encoded_bytes();
        put_u64(&mut out, path.len() as u64);
        out.extend_from_slice(path);
        put_u64(&mut out, stat.bytes);
        put_u64(&mut out, mtime_nanos(stat));
        let tag = stat.tag.as_deref().unwrap_or("").as_bytes();
        put_u64(&mut out, tag.len() as u64);
        out.extend_from_slice(tag);
        put_u64(&mut out, self.skipped_members);
        put_u64(&mut out, self.extensions.len() as u64);
        for e in &self.extensions {
            put_u64(&mut out, e.len() as u64);
            out.extend_from_slice(e.as_bytes());
        }
        put_u64(&mut out, self.keys.len() as u64);
        out.extend_from_slice(&self.keys);
        put_u64(&mut out, self.samples.len() as u64);
        for &(k, m) in &self.samples {
            put_u64(&mut out, k);
            out.extend_from_slice(&m.to_le_bytes());
        }
        put_u64(&mut out, self.members.len() as u64);
        for m in &self.members {
            out.extend_from_slice(&m.ext.to_le_bytes());
            put_u64(&mut out, m.header);
            put_u64(&mut out, m.offset);
            put_u64(&mut out, m.size);
        }
        let sum = xxhash_rust::xxh3::xxh3_64(&out);
        put_u64(&mut out, sum);
        out
    }

    /// Reads a cache file written by `encode` for this shard; `Err` says why it cannot be
    /// trusted.
    fn decode(bytes: &[u8], shard: &Path, stat: &ShardStat) -> Result<TarIndex, String> {
        if bytes.len() < CACHE_MAGIC.len() + 8 {
            return Err("too short".into());
        }
        let (body, sum) = bytes.split_at(bytes.len() - 8);
        if xxhash_rust::xxh3::xxh3_64(body) != u64::from_le_bytes(sum.try_into().unwrap_or([0; 8]))
        {
            return Err("checksum mismatch".into());
        }
        let mut r = Cursor { b: body, at: 0 };
        if r.take(CACHE_MAGIC.len())? != CACHE_MAGIC {
            return Err("not a gpufeed tar index".into());
        }
        let n = r.len()?;
        if r.take(n)? != shard.as_os_str().as_encoded_bytes() {
            return Err("written for another shard".into());
        }
        if r.u64()? != stat.bytes || r.u64()? != mtime_nanos(stat) {
            return Err("the shard changed since".into());
        }
        let n = r.len()?;
        if r.take(n)? != stat.tag.as_deref().unwrap_or("").as_bytes() {
            return Err("the shard changed since (its version tag)".into());
        }
        let skipped_members = r.u64()?;
        let n = r.len()?;
        let mut extensions = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            let len = r.len()?;
            let e = std::str::from_utf8(r.take(len)?).map_err(|_| "extension not UTF-8")?;
            extensions.push(e.to_owned());
        }
        let n = r.len()?;
        let keys = r.take(n)?.to_vec();
        let n = r.count(12)?;
        let mut samples = Vec::with_capacity(n);
        for _ in 0..n {
            samples.push((r.u64()?, r.u32()?));
        }
        let n = r.count(28)?;
        let mut members = Vec::with_capacity(n);
        for _ in 0..n {
            members.push(IndexedMember {
                ext: r.u32()?,
                header: r.u64()?,
                offset: r.u64()?,
                size: r.u64()?,
            });
        }
        if r.at != body.len() {
            return Err("trailing bytes".into());
        }
        let index = TarIndex {
            extensions,
            keys,
            samples,
            members,
            skipped_members,
        };
        index.check(stat.bytes)?;
        Ok(index)
    }
}

const CACHE_MAGIC: &[u8] = b"GFTARIX2";

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn mtime_nanos(stat: &ShardStat) -> u64 {
    stat.modified
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos() as u64)
}

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or("truncated")?;
        let out = &self.b[self.at..end];
        self.at = end;
        Ok(out)
    }
    fn u64(&mut self) -> Result<u64, String> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }
    fn u32(&mut self) -> Result<u32, String> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(b))
    }
    /// A length that the rest of the bytes can hold.
    fn len(&mut self) -> Result<usize, String> {
        let n = self.u64()?;
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= self.b.len() - self.at)
            .ok_or_else(|| format!("a length of {n} past the end"))
    }
    /// A count of items of `size` bytes each that the rest of the bytes can hold.
    fn count(&mut self, size: usize) -> Result<usize, String> {
        let n = self.u64()?;
        usize::try_from(n)
            .ok()
            .filter(|&n| {
                n.checked_mul(size)
                    .is_some_and(|b| b <= self.b.len() - self.at)
            })
            .ok_or_else(|| format!("a count of {n} past the end"))
    }
}

/// What the index caches did: counts for tests and reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TarIndexStats {
    /// Indexes read from the cache and trusted.
    pub cache_hits: u64,
    /// Indexes built by scanning a shard.
    pub builds: u64,
    /// Cache files found stale or corrupt (then rebuilt).
    pub rejected: u64,
    /// Cache files that could not be written (the index is then rebuilt at each open).
    pub write_failures: u64,
}

/// Reads WebDataset tar shards for [`ShardedDataset`].
pub struct TarShards {
    cache_dir: PathBuf,
    unkeyed: UnkeyedPolicy,
    missing: MissingFieldPolicy,
    /// For each field of the schema, its extension.
    fields: Vec<String>,
    /// For each field of the schema, what its members are decoded by.
    decoders: Vec<Decoder>,
    skipped_samples: AtomicU64,
    skipped_members: AtomicU64,
    hits: AtomicU64,
    builds: AtomicU64,
    rejected: AtomicU64,
    write_failures: AtomicU64,
}

impl std::fmt::Debug for TarShards {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TarShards")
            .field("cache_dir", &self.cache_dir)
            .field("fields", &self.fields)
            .field("decoders", &self.decoders)
            .finish()
    }
}

/// A dataset of WebDataset tar shards.
pub type WebDataset = ShardedDataset<TarShards>;

/// An open tar shard: its bytes, its index, and for each of its samples the global sample
/// numbers that survived [`MissingFieldPolicy::Skip`].
pub struct TarShard {
    bytes: super::ShardBytes,
    index: TarIndex,
    /// For each field of the schema, the extension number in this shard's index.
    field_ext: Vec<Option<u32>>,
    /// Samples of the index kept, in order (all of them unless samples are skipped).
    kept: Option<Vec<u32>>,
}

impl TarShard {
    /// The shard's index.
    pub fn index(&self) -> &TarIndex {
        &self.index
    }
}

impl ShardedDataset<TarShards> {
    /// Opens the tar files `paths` (in this order) as one dataset, indexing each shard once
    /// (or reading its cached index).
    pub fn open<P: AsRef<Path>>(paths: &[P]) -> Result<WebDataset> {
        WebDataset::open_with(paths, WebDatasetOptions::default())
    }

    /// Opens the tar files `paths` with these settings.
    pub fn open_with<P: AsRef<Path>>(
        paths: &[P],
        options: WebDatasetOptions,
    ) -> Result<WebDataset> {
        let names = paths
            .iter()
            .map(|p| {
                p.as_ref().to_str().map(str::to_owned).ok_or_else(|| {
                    Error::config(
                        "shards",
                        format!("{} is not a UTF-8 path", p.as_ref().display()),
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?;
        WebDataset::from_store(Arc::new(LocalDir::new("")), names, options)
    }

    /// The tar shards `names` of `store` as one dataset.
    pub fn from_store(
        store: Arc<dyn ShardStore>,
        names: Vec<String>,
        options: WebDatasetOptions,
    ) -> Result<WebDataset> {
        if names.is_empty() {
            return Err(Error::config("shards", "no tar shard given"));
        }
        let cache_dir = options
            .cache_dir
            .clone()
            .unwrap_or_else(|| default_cache_dir().join("tar-index"));
        let mut format = TarShards {
            cache_dir,
            unkeyed: options.unkeyed,
            missing: options.missing,
            fields: Vec::new(),
            decoders: Vec::new(),
            skipped_samples: AtomicU64::new(0),
            skipped_members: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            builds: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            write_failures: AtomicU64::new(0),
        };
        // The first shard's index gives the fields unless they are declared; it is counted
        // below without being read again.
        let mut first = None;
        let fields = match &options.fields {
            Some(f) => {
                if f.is_empty() {
                    return Err(Error::config("fields", "no field declared"));
                }
                f.clone()
            }
            None => {
                let (path, index) = format
                    .load_index(&*store, &names[0])
                    .map_err(|e| unquoted(&*store, &names[0], "webdataset tar", e))?;
                let found: Vec<String> = index
                    .extensions()
                    .iter()
                    .cloned()
                    .collect::<BTreeSet<_>>()
                    .into_iter()
                    .collect();
                if found.is_empty() {
                    return Err(Error::Malformed {
                        path,
                        format: "webdataset tar",
                        what: "the first shard holds no sample to take fields from".into(),
                    });
                }
                first = Some((path, index));
                found
            }
        };
        if let Some(name) = options.shards.decode.keys().find(|n| !fields.contains(n)) {
            return Err(Error::config(
                "decode",
                format!("no field `{name}` to declare: the fields are {fields:?}"),
            ));
        }
        // Each field's decoding: declared, else webdataset's convention; `npy` members are
        // tensors if every one of the first shard has one dtype and shape.
        let mut decodes = Vec::with_capacity(fields.len());
        for ext in &fields {
            let decode = match options.shards.decode.get(ext) {
                Some(d) => d.clone(),
                None if last_part(ext) == "npy" => {
                    if first.is_none() {
                        first = Some(
                            format
                                .load_index(&*store, &names[0])
                                .map_err(|e| unquoted(&*store, &names[0], "webdataset tar", e))?,
                        );
                    }
                    let (path, index) = first
                        .as_ref()
                        .ok_or_else(|| Error::mismatch("the first shard's index was not read"))?;
                    npy_decode(&*store, &names[0], path, index, ext)
                        .map_err(|e| unquoted(&*store, &names[0], "webdataset tar", e))?
                }
                None => decode_for_extension(ext),
            };
            decodes.push(decode);
        }
        let schema = Schema::validated(
            fields
                .iter()
                .zip(&decodes)
                .map(|(e, d)| d.field(e))
                .collect(),
        )
        .map_err(|e| Error::config("fields", e))?;
        format.decoders = fields
            .iter()
            .zip(&decodes)
            .map(|(e, d)| Decoder::new(d, last_part(e) == "npy", None))
            .collect();
        format.fields = fields;
        // Every shard's count, from its index (cached, or built now), in parallel.
        let count = |(path, index): (PathBuf, TarIndex)| -> Result<u64> {
            let field_ext = format.field_ext(&index);
            let kept = format.kept(&path, &index, &field_ext)?;
            format
                .skipped_members
                .fetch_add(index.skipped_members(), Ordering::Relaxed);
            let n = kept.as_ref().map_or(index.len(), |k| k.len() as u64);
            format
                .skipped_samples
                .fetch_add(index.len() - n, Ordering::Relaxed);
            Ok(n)
        };
        let first_count = first
            .map(count)
            .transpose()
            .map_err(|e| unquoted(&*store, &names[0], "webdataset tar", e))?;
        let counts = names
            .par_iter()
            .enumerate()
            .map(|(k, name)| match (k, first_count) {
                (0, Some(n)) => Ok(n),
                _ => format
                    .load_index(&*store, name)
                    .and_then(count)
                    .map_err(|e| unquoted(&*store, name, "webdataset tar", e)),
            })
            .collect::<Result<Vec<u64>>>()?;
        let shards = names.into_iter().zip(counts).collect();
        ShardedDataset::from_parts(format, store, shards, schema, options.shards)
    }

    /// Samples left out for lacking a field ([`MissingFieldPolicy::Skip`]), over all shards.
    pub fn skipped_samples(&self) -> u64 {
        self.format().skipped_samples.load(Ordering::Relaxed)
    }

    /// Members skipped for having no extension ([`UnkeyedPolicy::Skip`]), over all shards.
    pub fn skipped_members(&self) -> u64 {
        self.format().skipped_members.load(Ordering::Relaxed)
    }

    /// The key (`__key__`) of sample `index`.
    pub fn key(&self, index: u64) -> Result<String> {
        let at = self.locate(index)?;
        let shard = self.shard(at.shard)?;
        let i = shard.sample_number(at.index);
        Ok(String::from_utf8_lossy(shard.index.key(i).unwrap_or_default()).into_owned())
    }
}

/// The field of the `npy` extension `ext`: a tensor of the dtype and shape of every such
/// member of the first shard (`name`, at `path`, indexed as `index`) if they all have the same
/// (webdataset writes `np.save`'s bytes), else bytes of codec npy. A member that is not a
/// readable `.npy` is [`Error::BadMember`].
fn npy_decode(
    store: &dyn ShardStore,
    name: &str,
    path: &Path,
    index: &TarIndex,
    ext: &str,
) -> Result<FieldDecode> {
    let Some(id) = index.extensions().iter().position(|e| e == ext) else {
        return Ok(FieldDecode::Bytes(Codec::Npy));
    };
    let bytes = store.open(name)?;
    let mut seen: Option<(crate::format::DType, Vec<u64>)> = None;
    for m in index.members.iter().filter(|m| m.ext as usize == id) {
        let member = bytes.get(m.offset..m.offset + m.size)?;
        let (dtype, shape, _) =
            super::decode::npy_array(member).map_err(|what| Error::BadMember {
                shard: path.to_path_buf(),
                member: format!("(the {ext} member at byte {})", m.header),
                offset: m.header,
                what,
            })?;
        match &seen {
            None => seen = Some((dtype, shape)),
            Some(s) if *s == (dtype, shape.clone()) => {}
            Some(_) => return Ok(FieldDecode::Bytes(Codec::Npy)),
        }
    }
    Ok(match seen {
        Some((dtype, shape)) => FieldDecode::Tensor { dtype, shape },
        None => FieldDecode::Bytes(Codec::Npy),
    })
}

impl TarShard {
    /// The index's number of the shard's `i`-th kept sample.
    fn sample_number(&self, i: u64) -> usize {
        match &self.kept {
            Some(k) => k.get(i as usize).map_or(usize::MAX, |&n| n as usize),
            None => i as usize,
        }
    }
}

impl TarShards {
    /// What the index caches have done.
    pub fn index_stats(&self) -> TarIndexStats {
        TarIndexStats {
            cache_hits: self.hits.load(Ordering::Relaxed),
            builds: self.builds.load(Ordering::Relaxed),
            rejected: self.rejected.load(Ordering::Relaxed),
            write_failures: self.write_failures.load(Ordering::Relaxed),
        }
    }

    /// The directory of cached indexes.
    pub fn cache_dir(&self) -> &Path {
        &self.cache_dir
    }

    /// The cache file of a shard at `path` with `stat`.
    pub fn cache_file(&self, path: &Path, stat: &ShardStat) -> PathBuf {
        let canonical = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(canonical.as_os_str().as_encoded_bytes());
        h.update(&stat.bytes.to_le_bytes());
        h.update(&mtime_nanos(stat).to_le_bytes());
        h.update(stat.tag.as_deref().unwrap_or("").as_bytes());
        self.cache_dir
            .join(format!("{:032x}.gftidx", h.digest128()))
    }

    /// Shard `name`'s index: from the cache if it is there and sound, else built by scanning
    /// the shard (and cached).
    fn load_index(&self, store: &dyn ShardStore, name: &str) -> Result<(PathBuf, TarIndex)> {
        let path = store.locate(name);
        let stat = store.stat(name)?;
        let cache = self.cache_file(&path, &stat);
        if let Ok(bytes) = std::fs::read(&cache) {
            match TarIndex::decode(&bytes, &path, &stat) {
                Ok(index) => {
                    self.hits.fetch_add(1, Ordering::Relaxed);
                    return Ok((path, index));
                }
                Err(_) => {
                    self.rejected.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        let shard = store.open(name)?;
        let index = TarIndex::build(shard.path(), shard.all()?, self.unkeyed)?;
        self.builds.fetch_add(1, Ordering::Relaxed);
        let written = std::fs::create_dir_all(&self.cache_dir)
            .map_err(|e| Error::io(&self.cache_dir, "create directory", e))
            .and_then(|()| write_atomically(&cache, &index.encode(&path, &stat)));
        if written.is_err() {
            self.write_failures.fetch_add(1, Ordering::Relaxed);
        }
        Ok((path, index))
    }

    fn field_ext(&self, index: &TarIndex) -> Vec<Option<u32>> {
        self.fields
            .iter()
            .map(|f| {
                index
                    .extensions()
                    .iter()
                    .position(|e| e == f)
                    .map(|p| p as u32)
            })
            .collect()
    }

    /// The samples kept under the missing-field policy (`None`: all), or the error naming the
    /// first sample that lacks a field.
    fn kept(
        &self,
        path: &Path,
        index: &TarIndex,
        field_ext: &[Option<u32>],
    ) -> Result<Option<Vec<u32>>> {
        let mut kept: Option<Vec<u32>> = None;
        for i in 0..index.len() as usize {
            let members = index.members(i).unwrap_or_default();
            let missing = self
                .fields
                .iter()
                .zip(field_ext)
                .find(|(_, ext)| ext.is_none_or(|e| !members.iter().any(|m| m.ext == e)));
            match (missing, self.missing) {
                (None, _) => {
                    if let Some(k) = kept.as_mut() {
                        k.push(i as u32);
                    }
                }
                (Some((field, _)), MissingFieldPolicy::Error) => {
                    return Err(Error::MissingField {
                        shard: path.to_path_buf(),
                        key: quoted(index.key(i).unwrap_or_default()),
                        field: field.clone(),
                    });
                }
                (Some(_), MissingFieldPolicy::Skip) => {
                    kept.get_or_insert_with(|| (0..i as u32).collect());
                }
            }
        }
        Ok(kept)
    }
}

impl ShardFormat for TarShards {
    type Shard = TarShard;

    fn name(&self) -> &'static str {
        "webdataset tar"
    }

    fn format(&self) -> crate::source::Format {
        crate::source::Format::WebDataset
    }

    fn open_shard(
        &self,
        store: &dyn ShardStore,
        _k: usize,
        name: &str,
        samples: u64,
        _schema: &Schema,
        options: &ShardOptions,
    ) -> Result<TarShard> {
        let (path, index) = if options.verify {
            let shard = store.open(name)?;
            let index = TarIndex::build(shard.path(), shard.all()?, self.unkeyed)?;
            (shard.path().to_path_buf(), index)
        } else {
            self.load_index(store, name)?
        };
        let field_ext = self.field_ext(&index);
        let kept = self.kept(&path, &index, &field_ext)?;
        let n = kept.as_ref().map_or(index.len(), |k| k.len() as u64);
        if n != samples {
            return Err(Error::Malformed {
                path,
                format: "webdataset tar",
                what: format!(
                    "the shard now holds {n} samples, {samples} when the dataset was opened: it changed"
                ),
            });
        }
        let bytes = store.open(name)?;
        if let Some(m) = index
            .members
            .iter()
            .find(|m| m.offset + m.size > bytes.len())
        {
            return Err(Error::Malformed {
                path,
                format: "webdataset tar",
                what: format!(
                    "a member at byte {} runs past the end of the shard's {} bytes: it changed or is truncated",
                    m.offset,
                    bytes.len()
                ),
            });
        }
        Ok(TarShard {
            bytes,
            index,
            field_ext,
            kept,
        })
    }

    fn sample<'s>(
        &'s self,
        shard: &TarShard,
        _k: usize,
        index: u64,
        schema: &'s Schema,
        _options: &ShardOptions,
    ) -> Result<Sample<'s>> {
        let i = shard.sample_number(index);
        let members = shard.index.members(i).unwrap_or_default();
        let (Some(first), Some(last)) = (
            members.iter().map(|m| m.offset).min(),
            members.iter().map(|m| m.offset + m.size).max(),
        ) else {
            return Err(Error::OutOfRange {
                index,
                len: shard.index.len(),
            });
        };
        let data = shard.bytes.share(first..last)?;
        let mut fields = Vec::with_capacity(shard.field_ext.len());
        let mut decoded = Vec::new();
        for (f, ext) in shard.field_ext.iter().enumerate() {
            let Some(m) = ext.and_then(|e| members.iter().find(|m| m.ext == e)) else {
                return Err(Error::MissingField {
                    shard: shard.bytes.path().to_path_buf(),
                    key: quoted(shard.index.key(i).unwrap_or_default()),
                    field: self.fields[f].clone(),
                });
            };
            let start = (m.offset - first) as usize;
            let member = start..start + m.size as usize;
            let decoder = &self.decoders[f];
            if decoder.is_verbatim() {
                fields.push(FieldSpan::Shared(member));
                continue;
            }
            match decoder.decode(&data[member]) {
                Ok(Value::Within(r)) => {
                    fields.push(FieldSpan::Shared(start + r.start..start + r.end));
                }
                Ok(Value::Decoded(v)) => {
                    fields.push(FieldSpan::Decoded(decoded.len()..decoded.len() + v.len()));
                    decoded.extend_from_slice(&v);
                }
                Err(what) => {
                    let mut name = shard.index.key(i).unwrap_or_default().to_vec();
                    name.push(b'.');
                    name.extend_from_slice(self.fields[f].as_bytes());
                    return Err(Error::BadMember {
                        shard: shard.bytes.path().to_path_buf(),
                        member: quoted(&name),
                        offset: m.header,
                        what: format!("field `{}`: {what}", self.fields[f]),
                    });
                }
            }
        }
        Sample::spans(data, fields, decoded, schema)
    }

    fn verify_shard(
        &self,
        store: &dyn ShardStore,
        _k: usize,
        name: &str,
        samples: u64,
        schema: &Schema,
    ) -> Result<()> {
        let options = ShardOptions {
            verify: true,
            ..ShardOptions::default()
        };
        let shard = self.open_shard(store, 0, name, samples, schema, &options)?;
        for i in 0..samples {
            self.sample(&shard, 0, i, schema, &options)?;
        }
        Ok(())
    }

    /// The shard's file against what it was when mapped ([`ShardBytes::check_unchanged`](super::ShardBytes::check_unchanged)).
    fn check_unchanged(&self, shard: &TarShard) -> Result<()> {
        shard.bytes.check_unchanged()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(name: &str) -> Option<(String, String)> {
        split_key(name.as_bytes()).map(|(k, e)| {
            (
                String::from_utf8(k.to_vec()).unwrap(),
                String::from_utf8(e.to_vec()).unwrap(),
            )
        })
    }

    #[test]
    fn keys_follow_base_plus_ext() {
        let s = |k: &str, e: &str| Some((k.to_owned(), e.to_owned()));
        assert_eq!(split("a.jpg"), s("a", "jpg"));
        assert_eq!(split("dir/a.seg.png"), s("dir/a", "seg.png"));
        assert_eq!(split("d.x/a.b.c"), s("d.x/a", "b.c"));
        assert_eq!(split("dir/.hidden"), s("dir/", "hidden"));
        assert_eq!(split("a/b/.hidden"), s("a/b/", "hidden"));
        assert_eq!(split("/.x"), s("/", "x"));
        assert_eq!(split("a."), s("a", ""));
        assert_eq!(split("noext"), None);
        assert_eq!(split("dir/noext"), None);
        assert_eq!(split(".hidden"), None);
        assert_eq!(split("d.x/.hidden"), None);
        assert_eq!(split("a.b/c"), None);
        // `.` in `(?:.*/|)` does not match a newline, `[^.]` does.
        assert_eq!(split("x\ny/.e"), s("x\ny/", "e"));
        assert_eq!(split("p/x\ny/.e"), s("p/x\ny/", "e"));
        assert_eq!(split("a\n/b.c"), s("a\n/b", "c"));
    }

    #[test]
    fn meta_members_are_recognised() {
        assert!(is_meta(b"__meta__"));
        assert!(is_meta(b"__info__/x.json"));
        assert!(is_meta(b"__a__b__/c"));
        assert!(is_meta(b"____"));
        assert!(is_meta(b"__x__\n"));
        assert!(!is_meta(b"__x_"));
        assert!(!is_meta(b"a/__x__"));
        assert!(!is_meta(b"__x/y__"));
        assert!(!is_meta(b"__x__.jpg"));
    }
}
