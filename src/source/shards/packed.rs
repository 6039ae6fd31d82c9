//! gpufeed's own shards: packed record files (`docs/FORMAT.md`), one per shard, and an
//! `index.json` of shard names, sample counts, sizes and checksums; [`ShardWriter`] writes
//! them, [`PackedShards`] reads them.
//!
//! ```text
//! DIR/index.json           {"format": "gpufeed-packed-shards", "version": 1, "schema": [...],
//!                           "samples": N, "shards": [{"name": "shard-000000.gfd",
//!                           "samples": n, "bytes": b, "xxh3_64": "<16 hex digits>"}, ...]}
//! DIR/shard-000000.gfd     a packed record file
//! DIR/shard-000001.gfd     ...
//! ```
//!
//! The index is written last, by a temporary name and a rename, and each shard is written the
//! same way ([`RecordWriter`]), so a directory with an `index.json` is complete. Opening reads
//! the index only; a shard is opened (mapped, its footer checked) when first used, and refused
//! if its record count, size or schema disagree with the index. `xxh3_64` is the hash of the
//! whole shard file (xxh3-64, seed 0), checked when a local shard is opened, before its first
//! sample (once while its file stays the same: see the [shards](super) module's section on
//! hashes), every time under [`ShardOptions::verify`], by [`ShardedDataset::verify`], and by a
//! downloader on arrival.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{
    HashedShards, IndexedFormat, ShardFormat, ShardOptions, ShardStore, ShardedDataset,
    check_shard_name, xxh3_hex,
};
use crate::error::{Error, Result};
use crate::format::{
    Field, FieldKind, ReadOptions, RecordFile, RecordSink, RecordWriter, Schema,
    default_record_align,
};
use crate::source::Sample;

/// The `format` tag of a packed shard index.
pub const PACKED_INDEX_FORMAT: &str = "gpufeed-packed-shards";

/// The index file's name in a shard directory.
pub const INDEX_FILE: &str = "index.json";

/// One shard in a packed shard index.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PackedShardEntry {
    /// The file's name, relative to the index's directory.
    pub name: String,
    /// Records in it.
    pub samples: u64,
    /// The file's size in bytes.
    pub bytes: u64,
    /// xxh3-64 (seed 0) of the whole file, 16 lower-case hex digits.
    pub xxh3_64: String,
}

/// A packed shard index (`index.json`), as stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PackedIndex {
    /// Always [`PACKED_INDEX_FORMAT`].
    pub format: String,
    /// 1.
    pub version: u32,
    /// The fields of every record.
    pub schema: Vec<Field>,
    /// Records in all shards.
    pub samples: u64,
    /// The shards, in order.
    pub shards: Vec<PackedShardEntry>,
}

impl PackedIndex {
    /// Parses and checks an index (named `path` in errors): its tag, version, schema, names,
    /// checksums and total.
    pub fn parse(path: &Path, text: &[u8]) -> Result<PackedIndex> {
        let bad = |what: String| Error::Malformed {
            path: path.to_path_buf(),
            format: "packed shard index",
            what,
        };
        let index: PackedIndex =
            serde_json::from_slice(text).map_err(|e| bad(format!("not a valid index: {e}")))?;
        if index.format != PACKED_INDEX_FORMAT {
            return Err(bad(format!(
                "format is `{}`, not `{PACKED_INDEX_FORMAT}`",
                index.format
            )));
        }
        if index.version != 1 {
            return Err(bad(format!(
                "version {} (this reader knows version 1)",
                index.version
            )));
        }
        Schema::validated(index.schema.clone()).map_err(|e| bad(format!("schema: {e}")))?;
        let mut total = 0u64;
        for s in &index.shards {
            check_shard_name(path, "packed shard index", &s.name)?;
            if s.xxh3_64.len() != 16 || !s.xxh3_64.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(bad(format!(
                    "shard `{}`: xxh3_64 `{}` is not 16 hex digits",
                    s.name, s.xxh3_64
                )));
            }
            total = total
                .checked_add(s.samples)
                .ok_or_else(|| bad("sample counts add up past 2^64".into()))?;
        }
        if total != index.samples {
            return Err(bad(format!(
                "the shards hold {total} samples, the index says {}",
                index.samples
            )));
        }
        Ok(index)
    }
}

/// Reads packed shards for [`ShardedDataset`]: shard `k` is opened as a [`RecordFile`] and
/// checked against the index.
#[derive(Debug)]
pub struct Packed {
    index_path: PathBuf,
    entries: Vec<PackedShardEntry>,
    /// The shards whose files have passed their hashes when opened.
    hashed: HashedShards,
}

/// A dataset of packed shards.
pub type PackedShards = ShardedDataset<Packed>;

impl IndexedFormat for Packed {
    const INDEX_FILE: &'static str = INDEX_FILE;

    fn dataset(
        store: Arc<dyn ShardStore>,
        index_path: &Path,
        text: &[u8],
        options: ShardOptions,
    ) -> Result<PackedShards> {
        let index = PackedIndex::parse(index_path, text)?;
        let schema = Schema::validated(index.schema).map_err(|e| Error::Malformed {
            path: index_path.to_path_buf(),
            format: "packed shard index",
            what: format!("schema: {e}"),
        })?;
        let shards = index
            .shards
            .iter()
            .map(|s| (s.name.clone(), s.samples))
            .collect();
        let format = Packed {
            index_path: index_path.to_path_buf(),
            hashed: HashedShards::new(index.shards.len()),
            entries: index.shards,
        };
        ShardedDataset::from_parts(format, store, shards, schema, options)?.check_empty_shards()
    }
}

impl Packed {
    /// The index's entry for shard `k`.
    pub fn entry(&self, k: usize) -> Option<&PackedShardEntry> {
        self.entries.get(k)
    }

    fn disagrees(&self, path: &Path, what: String) -> Error {
        Error::Malformed {
            path: path.to_path_buf(),
            format: "packed shard",
            what: format!("{what} (index {})", self.index_path.display()),
        }
    }

    fn check_hash(&self, store: &dyn ShardStore, k: usize, name: &str) -> Result<()> {
        let bytes = store.open(name)?;
        self.hash_matches(k, bytes.path(), bytes.all()?)
    }

    /// Checks `all`, the bytes of shard `k`'s file at `path`, against the index's xxh3-64.
    fn hash_matches(&self, k: usize, path: &Path, all: &[u8]) -> Result<()> {
        let got = xxh3_hex(all);
        let want = &self.entries[k].xxh3_64;
        if !got.eq_ignore_ascii_case(want) {
            return Err(self.disagrees(
                path,
                format!(
                    "xxh3-64 of the file is {got}, the index says {want}: its bytes changed after the index was written (damaged, or replaced by another file); nothing of it is read"
                ),
            ));
        }
        Ok(())
    }

    fn open_file(
        &self,
        store: &dyn ShardStore,
        k: usize,
        name: &str,
        samples: u64,
        verify: bool,
        schema: Option<&Schema>,
    ) -> Result<RecordFile> {
        // `schema` is the index's: open_shard's is always given; the field ranges of `sample`
        // rely on it being the shard's own.
        let path = store.local_file(name)?;
        let file = RecordFile::open_with(
            &path,
            ReadOptions {
                verify_checksums: verify,
                ..ReadOptions::default()
            },
        )?;
        let entry = &self.entries[k];
        if file.len() != samples {
            return Err(self.disagrees(
                &path,
                format!(
                    "the shard holds {} records, the index says {samples}",
                    file.len()
                ),
            ));
        }
        if file.file_bytes() != entry.bytes {
            return Err(self.disagrees(
                &path,
                format!(
                    "the shard is {} bytes, the index says {}",
                    file.file_bytes(),
                    entry.bytes
                ),
            ));
        }
        if let Some(schema) = schema
            && file.schema() != schema
        {
            return Err(self.disagrees(
                &path,
                format!(
                    "the shard's schema is [{}], the index's [{schema}]",
                    file.schema()
                ),
            ));
        }
        Ok(file)
    }
}

/// An open packed shard.
pub struct PackedShard {
    file: RecordFile,
}

impl PackedShard {
    /// The shard's record file.
    pub fn file(&self) -> &RecordFile {
        &self.file
    }
}

impl ShardFormat for Packed {
    type Shard = PackedShard;

    fn name(&self) -> &'static str {
        "packed"
    }

    fn format(&self) -> crate::source::Format {
        crate::source::Format::PackedShards
    }

    fn open_shard(
        &self,
        store: &dyn ShardStore,
        k: usize,
        name: &str,
        samples: u64,
        schema: &Schema,
        options: &ShardOptions,
    ) -> Result<PackedShard> {
        if options.verify {
            self.check_hash(store, k, name)?;
        }
        let file = self.open_file(store, k, name, samples, options.verify, Some(schema))?;
        // Once per file, after the footer and the index's counts have said what they can,
        // over the record file's own bytes (the pages its samples are then read from).
        if !options.verify && store.check_hashes_on_open() {
            self.hashed
                .check_once(k, Some(file.file_fingerprint()), || {
                    let all = file
                        .data
                        .bytes_at(file.path(), 0, file.file_bytes() as usize)?;
                    self.hash_matches(k, file.path(), &all)
                })?;
        }
        Ok(PackedShard { file })
    }

    fn sample<'s>(
        &'s self,
        shard: &PackedShard,
        _k: usize,
        index: u64,
        schema: &'s Schema,
        options: &ShardOptions,
    ) -> Result<Sample<'s>> {
        let file = &shard.file;
        if options.verify {
            file.verify_record(index)?;
        }
        let record = file.get_bytes(index)?;
        let mut fields = Vec::with_capacity(schema.fields().len());
        for k in 0..schema.fields().len() {
            let Some(bytes) = schema.field_in(&record, k) else {
                return Err(Error::BadRecord {
                    path: file.path().to_path_buf(),
                    record: index,
                    what: format!("field {k} is outside the record"),
                });
            };
            let start = bytes.as_ptr() as usize - record.as_ptr() as usize;
            fields.push(start..start + bytes.len());
        }
        Sample::shared_fields(record, fields, schema)
    }

    fn verify_shard(
        &self,
        store: &dyn ShardStore,
        k: usize,
        name: &str,
        samples: u64,
        schema: &Schema,
    ) -> Result<()> {
        self.check_hash(store, k, name)?;
        let file = self.open_file(store, k, name, samples, true, Some(schema))?;
        file.verify(|_| {})
    }

    /// The shard's record file against what it was when opened
    /// ([`RecordFile::check_unchanged`]).
    fn check_unchanged(&self, shard: &PackedShard) -> Result<()> {
        shard.file.check_unchanged()
    }
}

/// Settings of a [`ShardWriter`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardWriterOptions {
    /// A shard is closed before the record that would take it past this many bytes (header,
    /// tables and footer included); a record larger than this gets a shard of its own.
    pub shard_bytes: u64,
    /// Shard files are named `{prefix}-{k:06}.gfd`.
    pub prefix: String,
    /// Record alignment; `None` for the writer's default ([`RecordWriter::create`](crate::format::RecordWriter::create)).
    pub record_align: Option<usize>,
}

impl ShardWriterOptions {
    /// Shards of at most `shard_bytes` bytes, named `shard-000000.gfd`, ...
    pub fn new(shard_bytes: u64) -> ShardWriterOptions {
        ShardWriterOptions {
            shard_bytes,
            prefix: "shard".into(),
            record_align: None,
        }
    }

    /// The file name of shard `k`: `{prefix}-{k:06}.gfd`.
    pub fn shard_name(&self, k: usize) -> String {
        format!("{}-{k:06}.gfd", self.prefix)
    }

    /// True if `name` is the name of one of the shards a writer with these options writes
    /// (what a writer into the same directory would replace).
    pub fn is_shard_name(&self, name: &str) -> bool {
        name.strip_prefix(self.prefix.as_str())
            .and_then(|rest| rest.strip_prefix('-'))
            .and_then(|rest| rest.strip_suffix(".gfd"))
            .and_then(|k| k.parse::<usize>().ok())
            .is_some_and(|k| self.shard_name(k) == name)
    }
}

/// What a directory holds that a [`ShardWriter`] into it replaces, removes or refuses: see
/// [`ExistingShards::find`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExistingShards {
    /// gpufeed's own shard index (`index.json` of [`PACKED_INDEX_FORMAT`]) is there.
    pub index: bool,
    /// gpufeed's own shard files there, by name, sorted: those its index names, and files under
    /// the writer's shard names (`shard-000000.gfd`, ...) that are packed record files or
    /// empty, as a pack killed before its index leaves them. A writer replaces those it writes
    /// again and removes the others once its own index is in place.
    pub shards: Vec<String>,
    /// What is there that gpufeed did not write and a writer would replace or orphan, in words
    /// (another writer's `index.json`, such as an MDS data set's; a file under a shard's name
    /// that is not a packed record file): a writer refuses such a directory.
    pub foreign: Option<String>,
}

impl ExistingShards {
    /// Looks at the directory `dir` (absent: nothing there) as a writer with `options` would
    /// write into it: its `index.json`, if any (read to tell whose it is, and to list the
    /// shards of gpufeed's), and the files under the writer's shard names (the first 8 bytes
    /// of each). Other files are not the writer's business and are left alone.
    pub fn find(dir: &Path, options: &ShardWriterOptions) -> Result<ExistingShards> {
        let mut found = ExistingShards::default();
        let entries = match std::fs::read_dir(dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(found),
            Err(e) => return Err(Error::io(dir, "list", e)),
        };
        let mut named = std::collections::BTreeSet::new();
        let index = dir.join(INDEX_FILE);
        match std::fs::symlink_metadata(&index) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(&index, "stat", e)),
            Ok(meta) if !meta.is_file() => {
                found.foreign = Some(format!(
                    "an {INDEX_FILE} that is not a regular file (a directory or a link)"
                ));
                return Ok(found);
            }
            Ok(_) => {
                let text = std::fs::read(&index).map_err(|e| Error::io(&index, "read", e))?;
                match whose_index(&text) {
                    Ok(names) => {
                        found.index = true;
                        for name in names {
                            if check_shard_name(&index, "packed shard index", &name).is_ok()
                                && std::fs::symlink_metadata(dir.join(&name))
                                    .is_ok_and(|m| !m.is_dir())
                            {
                                named.insert(name);
                            }
                        }
                    }
                    Err(what) => {
                        found.foreign = Some(what);
                        return Ok(found);
                    }
                }
            }
        }
        let mut taken: Vec<String> = entries
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|name| options.is_shard_name(name) && !named.contains(name))
            .collect();
        taken.sort();
        for name in taken {
            let path = dir.join(&name);
            if !std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_file()) {
                found.foreign = Some(format!(
                    "{name}, under a name gpufeed gives its shards, which is not a regular file"
                ));
                return Ok(found);
            }
            if let Some(what) = crate::format::foreign_file(&path)? {
                found.foreign = Some(format!(
                    "{name}, under a name gpufeed gives its shards, which is {what}"
                ));
                return Ok(found);
            }
            named.insert(name);
        }
        found.shards = named.into_iter().collect();
        Ok(found)
    }
}

/// The shards an `index.json` names if it is gpufeed's own (its `format` is
/// [`PACKED_INDEX_FORMAT`]: every name it lists, whatever else is wrong with it), else whose
/// it is, in words.
fn whose_index(text: &[u8]) -> std::result::Result<Vec<String>, String> {
    #[derive(Deserialize)]
    struct Probe {
        format: Option<serde_json::Value>,
        version: Option<serde::de::IgnoredAny>,
        shards: Option<Vec<serde::de::IgnoredAny>>,
    }
    #[derive(Deserialize)]
    struct Named {
        #[serde(default)]
        shards: Vec<NamedShard>,
    }
    #[derive(Deserialize)]
    struct NamedShard {
        name: Option<String>,
    }
    let Ok(probe) = serde_json::from_slice::<Probe>(text) else {
        return Err(format!(
            "an {INDEX_FILE} that gpufeed did not write (not a JSON object)"
        ));
    };
    match (&probe.format, &probe.shards) {
        (Some(serde_json::Value::String(f)), _) if f == PACKED_INDEX_FORMAT => {
            Ok(serde_json::from_slice::<Named>(text)
                .map(|n| n.shards.into_iter().filter_map(|s| s.name).collect())
                .unwrap_or_default())
        }
        (None, Some(shards)) if probe.version.is_some() => Err(format!(
            "an MDS data set (mosaicml-streaming's: its {INDEX_FILE} lists {} shards)",
            shards.len()
        )),
        (Some(f), _) => Err(format!("an {INDEX_FILE} of another writer (format {f})")),
        _ => Err(format!("an {INDEX_FILE} that gpufeed did not write")),
    }
}

/// What [`ShardWriter::finish`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardSummary {
    /// The index written.
    pub index: PathBuf,
    /// The shards, in order.
    pub shards: Vec<PackedShardEntry>,
    /// Records in all shards.
    pub samples: u64,
    /// The shards of the data set replaced that the new index does not name, removed once it
    /// was in place.
    pub removed: Vec<String>,
}

impl ShardSummary {
    /// Bytes in all shard files.
    pub fn bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.bytes).sum()
    }
}

struct OpenWriter {
    writer: RecordWriter,
    name: String,
    bytes: u64,
}

/// Writes records of one [`Schema`] into a directory of packed shards and its `index.json`,
/// starting a new shard before one would pass a byte size (see the [module](self)
/// documentation).
///
/// The shards it has placed are complete only with the index [`ShardWriter::finish`] writes
/// last: a writer dropped before that (an error, a panic) removes them, and so does
/// [`remove_unfinished_temporaries`](crate::temporary::remove_unfinished_temporaries), called on a
/// signal, so that an interrupted run leaves no shards without an index. (A process killed
/// outright leaves the shards it finished.)
///
/// Into a directory that holds a data set already, it replaces only what gpufeed wrote
/// ([`ExistingShards`]): its own `index.json` and the shards that names (and shard files a
/// killed pack left). Another writer's data set (an MDS `index.json`, a file under a shard's
/// name that is not a packed record file) is refused when the writer is made, before anything
/// is written. The old index is removed just before the first new shard is placed (a writer
/// that fails before that leaves the old data set as it was), so that no index ever names a
/// shard of the other; the old shards the new index does not name are removed once it is in
/// place. A run that stops in between leaves the directory without an index: the old data
/// set's shards are then removed by the next writer into it.
///
/// ```
/// use gpufeed::format::{DType, Field, Schema};
/// use gpufeed::source::shards::packed::{PackedShards, ShardWriter};
/// use gpufeed::Dataset;
/// # let dir = tempfile::tempdir().map_err(gpufeed::Error::user)?;
/// let schema = Schema::new(vec![Field::tensor("x", DType::U8, &[1000])])?;
/// let mut w = ShardWriter::create(dir.path(), schema, 64 << 10)?;
/// for i in 0..200u32 {
///     w.append(&[&[i as u8; 1000]])?;
/// }
/// let summary = w.finish()?;
/// assert!(summary.shards.len() > 1);
/// let data = PackedShards::open(dir.path())?;
/// assert_eq!(data.len(), 200);
/// assert_eq!(data.get(150)?.field(0), Some(&[150u8; 1000][..]));
/// # Ok::<(), gpufeed::Error>(())
/// ```
pub struct ShardWriter {
    dir: PathBuf,
    schema: Schema,
    options: ShardWriterOptions,
    record_align: usize,
    /// Bytes of a shard with no record: header, schema block and its padding, one offset,
    /// footer.
    empty_bytes: u64,
    current: Option<OpenWriter>,
    done: Vec<PackedShardEntry>,
    /// The shard files placed (or being placed) before the index: removed unless the index is
    /// written.
    placed: Vec<PathBuf>,
    /// The data set this writer replaces: gpufeed's index there (removed before the first
    /// shard is placed) and its shards (those the new index does not name are removed once it
    /// is in place).
    replaced: ExistingShards,
}

impl ShardWriter {
    /// Starts writing shards of at most `shard_bytes` bytes into `dir` (created if missing).
    /// A data set of gpufeed's there is replaced, another writer's refused (see the type's
    /// documentation and [`ExistingShards`]): an [`Error::Io`] of kind `AlreadyExists` that
    /// says what is there.
    pub fn create(dir: impl AsRef<Path>, schema: Schema, shard_bytes: u64) -> Result<ShardWriter> {
        ShardWriter::with_options(dir, schema, ShardWriterOptions::new(shard_bytes))
    }

    /// Starts writing shards with these settings.
    pub fn with_options(
        dir: impl AsRef<Path>,
        schema: Schema,
        options: ShardWriterOptions,
    ) -> Result<ShardWriter> {
        let dir = dir.as_ref().to_path_buf();
        if options.shard_bytes == 0 {
            return Err(Error::config("shard_size", "a shard size must be positive"));
        }
        if options.prefix.is_empty() || options.prefix.contains(['/', '\\']) {
            return Err(Error::config(
                "prefix",
                format!(
                    "`{}` is empty or has a path separator: shard names are file names",
                    options.prefix
                ),
            ));
        }
        let replaced = ExistingShards::find(&dir, &options)?;
        if let Some(what) = &replaced.foreign {
            return Err(Error::io(
                &dir,
                "write packed shards into",
                std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    format!(
                        "it holds {what}, which gpufeed did not write: a shard writer replaces only gpufeed's own index and shards; write into another directory, or remove that first"
                    ),
                ),
            ));
        }
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, "create directory", e))?;
        let record_align = options
            .record_align
            .unwrap_or_else(|| default_record_align(&schema));
        let schema_len = schema.encode().len() as u64;
        let data_offset = 64u64.div_ceil(record_align as u64) * record_align as u64;
        let empty_bytes = data_offset + (schema_len.div_ceil(8) * 8) + 8 + 64;
        Ok(ShardWriter {
            dir,
            schema,
            options,
            record_align,
            empty_bytes,
            current: None,
            done: Vec::new(),
            placed: Vec::new(),
            replaced,
        })
    }

    /// The schema records must follow.
    pub fn schema(&self) -> &Schema {
        &self.schema
    }

    /// Records appended so far.
    pub fn len(&self) -> u64 {
        self.done.iter().map(|s| s.samples).sum::<u64>()
            + self.current.as_ref().map_or(0, |c| c.writer.len())
    }

    /// True before the first record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The size one record takes in a shard: its padded bytes plus its two table entries.
    fn record_cost(&self, fields: &[&[u8]]) -> u64 {
        let var = self
            .schema
            .fields()
            .iter()
            .zip(fields)
            .filter(|(f, _)| matches!(f.kind, FieldKind::Bytes { .. }))
            .map(|(_, v)| v.len());
        let content = self.schema.record_bytes(var).max(1) as u64;
        let align = self.record_align as u64;
        content.div_ceil(align) * align + 16
    }

    /// Appends one record: one byte slice per field, in schema order (as
    /// [`RecordWriter::append`]).
    pub fn append(&mut self, fields: &[&[u8]]) -> Result<()> {
        if fields.len() != self.schema.fields().len() {
            return Err(Error::mismatch(format!(
                "{} field values given, the schema has {} fields",
                fields.len(),
                self.schema.fields().len()
            )));
        }
        let cost = self.record_cost(fields);
        if let Some(c) = &self.current
            && !c.writer.is_empty()
            && c.bytes + cost > self.options.shard_bytes
        {
            self.close_shard()?;
        }
        if self.current.is_none() {
            let name = self.options.shard_name(self.done.len());
            let writer = RecordWriter::with_record_align(
                self.dir.join(&name),
                self.schema.clone(),
                self.record_align,
            )?;
            self.current = Some(OpenWriter {
                writer,
                name,
                bytes: self.empty_bytes,
            });
        }
        if let Some(c) = self.current.as_mut() {
            c.writer.append(fields)?;
            c.bytes += cost;
        }
        Ok(())
    }

    fn close_shard(&mut self) -> Result<()> {
        let Some(c) = self.current.take() else {
            return Ok(());
        };
        // The old index goes before a shard of the new data set takes a name it may list.
        if std::mem::take(&mut self.replaced.index) {
            let index = self.dir.join(INDEX_FILE);
            match std::fs::remove_file(&index) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io(&index, "remove the old index", e)),
            }
        }
        // Recorded before it is placed (after its temporary, which the writer recorded when it
        // started): from here on a signal's cleanup or `drop` removes whichever exists.
        let path = self.dir.join(&c.name);
        crate::temporary::register_unfinished(&path);
        self.placed.push(path);
        let summary = c.writer.finish()?;
        let xxh3_64 = hash_file(&summary.path)?;
        self.done.push(PackedShardEntry {
            name: c.name,
            samples: summary.records,
            bytes: summary.file_bytes,
            xxh3_64,
        });
        Ok(())
    }

    /// Closes the last shard and writes the index (last, atomically: placed in one step with
    /// the shards it completes, as far as a signal's cleanup can tell), then removes the shards
    /// of the data set replaced that it does not name.
    pub fn finish(mut self) -> Result<ShardSummary> {
        self.close_shard()?;
        let samples = self.done.iter().map(|s| s.samples).sum();
        let index = PackedIndex {
            format: PACKED_INDEX_FORMAT.into(),
            version: 1,
            schema: self.schema.fields().to_vec(),
            samples,
            shards: std::mem::take(&mut self.done),
        };
        let path = self.dir.join(INDEX_FILE);
        let text = serde_json::to_vec_pretty(&index).map_err(Error::user)?;
        crate::temporary::write_completing(&path, "write the shard index", &text, &self.placed)?;
        // Complete: the shards stay.
        self.placed.clear();
        let mut removed = Vec::new();
        for name in std::mem::take(&mut self.replaced.shards) {
            if index.shards.iter().any(|s| s.name == name) {
                continue;
            }
            let old = self.dir.join(&name);
            match std::fs::remove_file(&old) {
                Ok(()) => removed.push(name),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(Error::io(
                        &old,
                        "remove (a shard of the data set replaced, which the new index, in place, no longer names)",
                        e,
                    ));
                }
            }
        }
        Ok(ShardSummary {
            index: path,
            shards: index.shards,
            samples,
            removed,
        })
    }
}

impl Drop for ShardWriter {
    fn drop(&mut self) {
        // Not finished: shards without an index are not a data set.
        for shard in self.placed.drain(..) {
            crate::temporary::discard(&shard);
        }
    }
}

impl RecordSink for ShardWriter {
    type Summary = ShardSummary;

    fn append(&mut self, fields: &[&[u8]]) -> Result<()> {
        ShardWriter::append(self, fields)
    }

    fn finish(self) -> Result<ShardSummary> {
        ShardWriter::finish(self)
    }
}

/// Parses a byte size as a user writes it (`256MiB`, `1.5 GiB`, `64MB`, `4096`): binary units
/// `KiB`, `MiB`, `GiB`, `TiB`, decimal units `kB`, `MB`, `GB`, `TB`, or `B`/none, in any
/// case; for `--shard-size`.
pub fn parse_byte_size(text: &str) -> Result<u64> {
    let bad = || {
        Error::config(
            "size",
            format!("`{text}` is not a size such as 256MiB, 1.5GiB, 64MB or 4096"),
        )
    };
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let unit = unit.trim().to_ascii_lowercase();
    let scale: u64 = match unit.as_str() {
        "" | "b" => 1,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(bad()),
    };
    let value: f64 = number.parse().map_err(|_| bad())?;
    let bytes = (value * scale as f64).round();
    if !bytes.is_finite() || bytes < 1.0 || bytes > u64::MAX as f64 {
        return Err(bad());
    }
    Ok(bytes as u64)
}

/// The xxh3-64 of a file's bytes, read in 1 MiB pieces.
fn hash_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, "open", e))?;
    let mut hash = xxhash_rust::xxh3::Xxh3::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => hash.update(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io(path, "read", e)),
        }
    }
    Ok(format!("{:016x}", hash.digest()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{Codec, DType};
    use crate::source::Dataset;
    use crate::source::shards::LocalDir;

    fn schema() -> Schema {
        Schema::new(vec![
            Field::tensor("label", DType::U32, &[]),
            Field::bytes("text", Codec::Utf8),
        ])
        .unwrap()
    }

    #[test]
    fn a_writer_dropped_before_finish_removes_the_shards_it_placed() {
        let dir = tempfile::tempdir().unwrap();
        let other = dir.path().join("notes.txt");
        std::fs::write(&other, "kept").unwrap();
        let mut w = ShardWriter::create(dir.path(), schema(), 512).unwrap();
        for i in 0..100u32 {
            w.append(&[&i.to_le_bytes(), b"some text"]).unwrap();
        }
        assert!(dir.path().join("shard-000001.gfd").exists());
        drop(w);
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(left, [other]);
        // Finished, the shards stay.
        let mut w = ShardWriter::create(dir.path(), schema(), 512).unwrap();
        for i in 0..100u32 {
            w.append(&[&i.to_le_bytes(), b"some text"]).unwrap();
        }
        let summary = w.finish().unwrap();
        assert!(summary.shards.len() > 1);
        for s in &summary.shards {
            assert!(dir.path().join(&s.name).exists(), "{}", s.name);
        }
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }

    fn write(dir: &Path, records: u32) -> ShardSummary {
        let mut w = ShardWriter::create(dir, schema(), 512).unwrap();
        for i in 0..records {
            w.append(&[&i.to_le_bytes(), b"some text"]).unwrap();
        }
        w.finish().unwrap()
    }

    #[test]
    fn a_writer_replaces_its_own_data_set_and_removes_the_shards_it_no_longer_names() {
        let dir = tempfile::tempdir().unwrap();
        let old = write(dir.path(), 100);
        assert!(old.removed.is_empty());
        std::fs::write(dir.path().join("notes.txt"), "mine").unwrap();
        let new = write(dir.path(), 30);
        assert!(new.shards.len() < old.shards.len());
        let gone: Vec<String> = old.shards[new.shards.len()..]
            .iter()
            .map(|s| s.name.clone())
            .collect();
        assert_eq!(new.removed, gone);
        let mut want: Vec<String> = new.shards.iter().map(|s| s.name.clone()).collect();
        want.extend(["index.json".into(), "notes.txt".into()]);
        want.sort();
        assert_eq!(names(dir.path()), want);
        assert_eq!(PackedShards::open(dir.path()).unwrap().len(), 30);
    }

    #[test]
    fn a_writer_that_fails_before_its_first_shard_leaves_the_old_data_set_whole() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), 100);
        let before = names(dir.path());
        let mut w = ShardWriter::create(dir.path(), schema(), 512).unwrap();
        w.append(&[&1u32.to_le_bytes(), b"text"]).unwrap();
        // A label of 5 bytes where the schema has 4: the pack fails before a shard is placed.
        assert!(w.append(&[b"wrong", b"text"]).is_err());
        drop(w);
        assert_eq!(names(dir.path()), before);
        assert_eq!(PackedShards::open(dir.path()).unwrap().len(), 100);
    }

    #[test]
    fn a_writer_refuses_a_data_set_it_did_not_write() {
        let mds = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/streaming/mds");
        let dir = tempfile::tempdir().unwrap();
        for e in std::fs::read_dir(&mds).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
        }
        let before = names(dir.path());
        let index = std::fs::read(dir.path().join("index.json")).unwrap();
        let e = ShardWriter::create(dir.path(), schema(), 512)
            .err()
            .unwrap();
        match &e {
            Error::Io { path, source, .. } => {
                assert_eq!(path, dir.path());
                assert_eq!(source.kind(), std::io::ErrorKind::AlreadyExists);
                assert!(source.to_string().contains("an MDS data set"), "{e}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(names(dir.path()), before);
        assert_eq!(std::fs::read(dir.path().join("index.json")).unwrap(), index);
        // What is there, as the command asks before it reads its inputs.
        let options = ShardWriterOptions::new(512);
        let found = ExistingShards::find(dir.path(), &options).unwrap();
        assert!(!found.index && found.shards.is_empty());
        assert!(found.foreign.unwrap().contains("lists 4 shards"));
        // A file under a shard's name that is not a packed record file.
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("shard-000003.gfd"), "mine").unwrap();
        assert!(ShardWriter::create(dir.path(), schema(), 512).is_err());
        // A packed one (a killed writer's) or an empty one is the writer's.
        let mut w = RecordWriter::create(dir.path().join("shard-000003.gfd"), schema()).unwrap();
        w.append(&[&0u32.to_le_bytes(), b""]).unwrap();
        w.finish().unwrap();
        std::fs::write(dir.path().join("shard-000007.gfd"), "").unwrap();
        let found = ExistingShards::find(dir.path(), &options).unwrap();
        assert_eq!(found.foreign, None);
        assert_eq!(found.shards, ["shard-000003.gfd", "shard-000007.gfd"]);
        let summary = write(dir.path(), 3);
        assert_eq!(summary.shards.len(), 1);
        assert_eq!(summary.removed, ["shard-000003.gfd", "shard-000007.gfd"]);
        assert_eq!(names(dir.path()), ["index.json", "shard-000000.gfd"]);
        // Absent: nothing there.
        let found = ExistingShards::find(&dir.path().join("none"), &options).unwrap();
        assert_eq!(found, ExistingShards::default());
    }

    #[test]
    fn shard_names_are_told_from_other_names() {
        let o = ShardWriterOptions::new(1);
        assert_eq!(o.shard_name(7), "shard-000007.gfd");
        assert_eq!(o.shard_name(1_234_567), "shard-1234567.gfd");
        for name in ["shard-000000.gfd", "shard-004711.gfd", "shard-1234567.gfd"] {
            assert!(o.is_shard_name(name), "{name}");
        }
        for name in [
            "shard-0.gfd",
            "shard-000000.gfd.gpufeed-tmp-1-0",
            "shard-00000x.gfd",
            "shards-000000.gfd",
            "shard-+00000.gfd",
            "index.json",
        ] {
            assert!(!o.is_shard_name(name), "{name}");
        }
    }

    #[test]
    fn shards_roll_over_at_the_byte_size_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = ShardWriter::create(dir.path(), schema(), 4096).unwrap();
        for i in 0..300u32 {
            let text = "x".repeat((i % 50) as usize);
            w.append(&[&i.to_le_bytes(), text.as_bytes()]).unwrap();
        }
        let summary = w.finish().unwrap();
        assert!(summary.shards.len() > 3, "{}", summary.shards.len());
        for s in &summary.shards {
            let len = std::fs::metadata(dir.path().join(&s.name)).unwrap().len();
            assert_eq!(len, s.bytes);
            assert!(len <= 4096, "{} is {len} bytes", s.name);
        }
        let d = PackedShards::open(dir.path()).unwrap();
        assert_eq!(d.len(), 300);
        assert_eq!(d.shard_sizes().iter().sum::<u64>(), 300);
        for i in 0..300u32 {
            let s = d.get(u64::from(i)).unwrap();
            assert_eq!(s.field(0), Some(&i.to_le_bytes()[..]));
            assert_eq!(s.field_named("text").unwrap().len(), (i % 50) as usize);
        }
        d.verify(|_| {}).unwrap();
    }

    #[test]
    fn byte_sizes_parse() {
        assert_eq!(parse_byte_size("256MiB").unwrap(), 256 << 20);
        assert_eq!(parse_byte_size("1.5 GiB").unwrap(), 3 << 29);
        assert_eq!(parse_byte_size("64mb").unwrap(), 64_000_000);
        assert_eq!(parse_byte_size("4096").unwrap(), 4096);
        for bad in ["", "MiB", "0", "-1MiB", "12 parsecs", "1e3"] {
            assert!(parse_byte_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_estimate_is_the_file_size() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = ShardWriter::create(dir.path(), schema(), u64::MAX).unwrap();
        let mut expect = w.empty_bytes;
        for i in 0..17u32 {
            let text = "y".repeat(i as usize * 3);
            let fields: [&[u8]; 2] = [&i.to_le_bytes(), text.as_bytes()];
            expect += w.record_cost(&fields);
            w.append(&fields).unwrap();
        }
        let s = w.finish().unwrap();
        assert_eq!(s.shards[0].bytes, expect);
    }

    /// Writes a byte of `path`'s checksum table (`back` bytes before its footer) again, in
    /// place (no truncation), as it was (so that the file still has the index's hash), and
    /// moves its modification time a minute on, whatever the file system's clock granularity.
    fn rewrite_in_place(path: &Path, back: u64) {
        use std::io::{Seek, SeekFrom, Write};
        let meta = std::fs::metadata(path).unwrap();
        let (at, was) = (meta.len() - 64 - back, meta.modified().unwrap());
        let byte = std::fs::read(path).unwrap()[at as usize];
        let mut f = std::fs::File::options().write(true).open(path).unwrap();
        f.seek(SeekFrom::Start(at)).unwrap();
        f.write_all(&[byte]).unwrap();
        f.set_modified(was + std::time::Duration::from_secs(60))
            .unwrap();
    }

    /// A store whose files are its own copies (as a download cache's): the same files as a
    /// [`LocalDir`], but not to be checked.
    struct Copies(LocalDir);

    impl ShardStore for Copies {
        fn locate(&self, name: &str) -> PathBuf {
            self.0.locate(name)
        }
        fn stat(&self, name: &str) -> Result<super::super::ShardStat> {
            self.0.stat(name)
        }
        fn open(&self, name: &str) -> Result<super::super::ShardBytes> {
            self.0.open(name)
        }
        fn local_file(&self, name: &str) -> Result<PathBuf> {
            self.0.local_file(name)
        }
    }

    #[test]
    fn the_open_shards_of_a_local_directory_are_checked_and_no_others() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = ShardWriter::create(dir.path(), schema(), 512).unwrap();
        for i in 0..40u32 {
            w.append(&[&i.to_le_bytes(), b"text"]).unwrap();
        }
        assert!(w.finish().unwrap().shards.len() >= 3);
        let options = ShardOptions {
            max_open_shards: 1,
            ..ShardOptions::default()
        };
        let d = PackedShards::open_with(dir.path(), options.clone()).unwrap();
        let (p0, p1) = (d.shard_path(0).unwrap(), d.shard_path(1).unwrap());
        // Nothing open: nothing to check, whatever the files.
        rewrite_in_place(&p1, 1);
        d.check_unchanged().unwrap();
        // Shard 0 opened, then closed when shard 1 opens (one open at most).
        d.get(0).unwrap();
        d.get(d.shard_start(1).unwrap()).unwrap();
        assert_eq!(d.open_stats().open_now, 1);
        d.check_unchanged().unwrap();
        rewrite_in_place(&p0, 1);
        d.check_unchanged().unwrap();
        // Shard 1 is open: its file is looked at.
        rewrite_in_place(&p1, 2);
        match d.check_unchanged().unwrap_err() {
            Error::FileChanged { path, what } => {
                assert_eq!(path, p1);
                assert!(what.contains("written in place"), "{what}");
            }
            other => panic!("expected FileChanged, got {other:?}"),
        }
        // The same shards from a store of copies are not checked.
        let text = std::fs::read(dir.path().join(INDEX_FILE)).unwrap();
        let copies = PackedShards::from_index(
            Arc::new(Copies(LocalDir::new(dir.path()))),
            &dir.path().join(INDEX_FILE),
            &text,
            options,
        )
        .unwrap();
        copies.get(0).unwrap();
        rewrite_in_place(&p0, 3);
        copies.check_unchanged().unwrap();
    }
}
