//! MosaicML Streaming's MDS directories (`index.json` and `shard.NNNNN.mds` files), read in
//! place: [`MdsDataset`].
//!
//! The layout, from mosaicml-streaming's `MDSWriter` and `MDSReader`
//! (`streaming/base/format/mds/`):
//!
//! ```text
//! index.json      {"version": 2, "shards": [{"format": "mds", "version": 2, "samples": n,
//!                   "column_names": [...], "column_encodings": [...], "column_sizes": [...],
//!                   "compression": null, "hashes": [...], "size_limit": ...,
//!                   "raw_data": {"basename": "shard.00000.mds", "bytes": b, "hashes": {...}},
//!                   "zip_data": null}, ...]}
//! shard file      u32 n | u32 offsets[n + 1] (absolute) | the shard's config as JSON |
//!                 samples: u32 size of each variable-size column, in column order, then
//!                 each column's bytes, in column order
//! ```
//!
//! (all integers little-endian; columns sorted by name, as the writer sorts them). Each column
//! becomes one field of the schema:
//!
//! | MDS encoding | field |
//! |---|---|
//! | `int` | tensor i64 `[]` |
//! | `uint8` … `int64`, `float16`, `float32`, `float64` | tensor of that dtype, `[]` |
//! | `ndarray:DTYPE:D0,D1,...` (fixed dtype and shape) | tensor of that dtype and shape |
//! | `str_int` (`str(int)`) | tensor i64 `[]`, decoded from the text |
//! | `str_float` (`str(float)`) | tensor f64 `[]`, decoded from the text |
//! | `str`, `str_decimal` | bytes, utf8 (checked to be UTF-8) |
//! | `json` | bytes, json (checked to be UTF-8) |
//! | `jpeg`, `png` | bytes, jpeg / png (the encoded image) |
//! | `bytes`, `pil`, `list[...]`, `jpeg_array`, `ndarray`, `ndarray:DTYPE` | bytes, raw (a variable `ndarray`'s header is kept: [`decode_ndarray`]) |
//! | `pkl` | refused: unpickling runs code the data set chose; declare the column `raw` to read its bytes |
//!
//! A column is declared otherwise by its name ([`ShardOptions::decode`]): a variable
//! `ndarray` (or `bytes`) column whose values have one dtype and shape, as a tensor
//! (`u16[2048]`: each value's header is checked against it, and the field is its values in
//! place); `str_int` as `utf8` text; `pkl` as `raw` bytes.
//!
//! Fields are views of the shard's mapping (tensor fields are not aligned in memory). A shard
//! is checked when opened against its index entry (its size, sample count, the offset table,
//! its own copy of the column layout) and each sample when read (its offsets, and that its
//! column sizes fill it exactly): each fault is a typed error naming the shard (and sample).
//! The index's hashes of a shard's raw file (`xxh64`, `xxh3_64`, `xxh3_128`/`xxh128`,
//! `xxh32`) are checked when a local shard is opened, before its first sample (once while
//! its file stays the same: see the [shards](super) module's section on hashes), every time
//! under [`ShardOptions::verify`], and by [`ShardedDataset::verify`]. streaming's other hashes
//! (`sha1`, `md5`, `sha256`, `blake2b`, ...) are not checked: computing them would take
//! another dependency and cost 20 to 50 times xxh3's time at every open (MD5 runs at about
//! 0.4 GiB/s on one core, xxh3 at 8 to 19 GiB/s); a data set hashed with those only is
//! checked by its sizes and structure. A compressed shard (`compression`: `zstd` or `gz`) is read
//! from its raw file when that is there (as streaming's local cache leaves it), else
//! decompressed once into the cache directory and read from there (see `compressed`:
//! checked against both files' sizes and hashes, within the cache's byte limit); a shard
//! compressed otherwise (`br`, `bz2`, `snappy`) without its raw file is refused with an
//! error naming its compression.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;

use super::compressed::{CompressedShard, Compression, Decompressor, FileCheck};
use super::decode::{Decoder, FieldDecode, Value, numpy_dtype};
pub use super::decode::{NdArrayView, decode_ndarray};
use super::{
    HashedShards, IndexedFormat, ShardBytes, ShardFormat, ShardOptions, ShardStore, ShardedDataset,
    check_shard_name,
};
use crate::error::{Error, Result};
use crate::format::{Codec, DType, FieldKind, Schema};
use crate::source::{FieldSpan, Sample};

/// The index file's name in an MDS directory.
pub const MDS_INDEX_FILE: &str = "index.json";

/// A shard file's entry in an MDS index (`raw_data`, `zip_data`), as read: borrowed from the
/// index's text where it can be, and kept only in [`ShardFile`]'s compact form.
#[derive(Deserialize)]
struct FileEntry<'a> {
    #[serde(borrow)]
    basename: Cow<'a, str>,
    bytes: u64,
    #[serde(default, borrow)]
    hashes: BTreeMap<Cow<'a, str>, Cow<'a, str>>,
}

/// One shard's entry in an MDS `index.json`, as read (see [`FileEntry`]).
#[derive(Deserialize)]
struct ShardEntry<'a> {
    #[serde(borrow)]
    format: Cow<'a, str>,
    #[serde(rename = "version")]
    _version: u32,
    samples: u64,
    #[serde(borrow)]
    column_names: Vec<Cow<'a, str>>,
    #[serde(borrow)]
    column_encodings: Vec<Cow<'a, str>>,
    column_sizes: Vec<Option<u64>>,
    #[serde(default, borrow)]
    compression: Option<Cow<'a, str>>,
    #[serde(borrow)]
    raw_data: FileEntry<'a>,
    #[serde(default, borrow)]
    zip_data: Option<FileEntry<'a>>,
}

#[derive(Deserialize)]
struct IndexFile {
    version: u32,
    shards: ShardList,
}

/// The hashes of a shard's raw file that an MDS index gives and gpufeed computes (others, such
/// as `sha1` or `md5`, are not checked).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ShardHashes {
    pub xxh64: Option<u64>,
    pub xxh3_64: Option<u64>,
    pub xxh3_128: Option<u128>,
    pub xxh32: Option<u32>,
}

/// What a data set keeps of a shard's index entry beyond its name and sample count: its raw
/// file's size and hashes, and for a compressed shard its compressed file. (The column
/// layout is the same for every shard: kept once.)
#[derive(Debug)]
pub(crate) struct ShardFile {
    pub bytes: u64,
    pub hashes: ShardHashes,
    /// The compressed file, for a shard that has one.
    pub zip: Option<Box<ZipFile>>,
}

/// A shard's compressed file (`zip_data`) and its compression.
#[derive(Debug)]
pub(crate) struct ZipFile {
    pub name: String,
    pub compression: Option<String>,
    pub bytes: u64,
    pub hashes: ShardHashes,
}

impl ShardHashes {
    /// True when the index gives none of the hashes gpufeed computes.
    fn is_empty(&self) -> bool {
        *self == ShardHashes::default()
    }

    /// The hashes of an index entry's `hashes` that gpufeed computes, or what is wrong.
    fn read(
        k: usize,
        hashes: &BTreeMap<Cow<'_, str>, Cow<'_, str>>,
    ) -> std::result::Result<ShardHashes, String> {
        let mut out = ShardHashes::default();
        for (algo, want) in hashes {
            let hex = |bits: u32| {
                u128::from_str_radix(want, 16)
                    .ok()
                    .filter(|v| bits == 128 || *v >> bits == 0)
                    .ok_or_else(|| {
                        format!("shard {k}: its {algo} `{want}` is not a {bits}-bit hex digest")
                    })
            };
            match &**algo {
                "xxh64" => out.xxh64 = Some(hex(64)? as u64),
                "xxh3_64" => out.xxh3_64 = Some(hex(64)? as u64),
                "xxh3_128" | "xxh128" => out.xxh3_128 = Some(hex(128)?),
                "xxh32" => out.xxh32 = Some(hex(32)? as u32),
                _ => {}
            }
        }
        Ok(out)
    }
}

impl FileCheck for ShardHashes {
    fn check(&self, all: &[u8]) -> std::result::Result<(), String> {
        let checks = [
            self.xxh64.map(|w| {
                (
                    "xxh64",
                    u128::from(xxhash_rust::xxh64::xxh64(all, 0)),
                    u128::from(w),
                    16,
                )
            }),
            self.xxh3_64.map(|w| {
                (
                    "xxh3_64",
                    u128::from(xxhash_rust::xxh3::xxh3_64(all)),
                    u128::from(w),
                    16,
                )
            }),
            self.xxh3_128
                .map(|w| ("xxh3_128", xxhash_rust::xxh3::xxh3_128(all), w, 32)),
            self.xxh32.map(|w| {
                (
                    "xxh32",
                    u128::from(xxhash_rust::xxh32::xxh32(all, 0)),
                    u128::from(w),
                    8,
                )
            }),
        ];
        for (algo, got, want, width) in checks.into_iter().flatten() {
            if got != want {
                return Err(format!(
                    "{algo} is {got:0width$x}, the index says {want:0width$x}"
                ));
            }
        }
        Ok(())
    }

    fn version(&self) -> Option<String> {
        self.xxh3_64
            .map(|h| format!("xxh3_64-{h:016x}"))
            .or_else(|| self.xxh64.map(|h| format!("xxh64-{h:016x}")))
            .or_else(|| self.xxh3_128.map(|h| format!("xxh3_128-{h:032x}")))
            .or_else(|| self.xxh32.map(|h| format!("xxh32-{h:08x}")))
    }
}

/// The column layout of every shard, as the index gives it.
#[derive(Debug, Default)]
struct Layout {
    names: Vec<String>,
    encodings: Vec<String>,
    sizes: Vec<Option<u64>>,
}

/// The `shards` of an MDS index, read one entry at a time into their compact form: names,
/// counts, [`ShardFile`]s and the one [`Layout`] (each entry's is checked against shard 0's as
/// it is read), so that a large index costs its shards' names and sizes, not its text's
/// strings.
#[derive(Default)]
struct ShardList {
    shards: Vec<(String, u64)>,
    files: Vec<ShardFile>,
    layout: Layout,
}

impl ShardList {
    /// Adds shard `k`'s entry, or says what is wrong with it.
    fn push(&mut self, k: usize, e: ShardEntry<'_>) -> std::result::Result<(), String> {
        if e.format != "mds" {
            return Err(format!(
                "shard {k}: format `{}` (this reader reads `mds`)",
                e.format
            ));
        }
        if k == 0 {
            self.layout = Layout {
                names: e.column_names.iter().map(|c| c.to_string()).collect(),
                encodings: e.column_encodings.iter().map(|c| c.to_string()).collect(),
                sizes: e.column_sizes,
            };
        } else {
            let same = |a: &[Cow<'_, str>], b: &[String]| {
                a.iter().map(|c| &**c).eq(b.iter().map(|c| &**c))
            };
            if !same(&e.column_names, &self.layout.names)
                || !same(&e.column_encodings, &self.layout.encodings)
                || e.column_sizes != self.layout.sizes
            {
                return Err(format!(
                    "shard {k} ({}) has other columns than shard 0",
                    e.raw_data.basename
                ));
            }
        }
        let hashes = ShardHashes::read(k, &e.raw_data.hashes)?;
        let zip = match e.zip_data {
            Some(z) => Some(Box::new(ZipFile {
                hashes: ShardHashes::read(k, &z.hashes)?,
                name: z.basename.into_owned(),
                compression: e.compression.map(Cow::into_owned),
                bytes: z.bytes,
            })),
            None => None,
        };
        self.files.push(ShardFile {
            bytes: e.raw_data.bytes,
            hashes,
            zip,
        });
        self.shards
            .push((e.raw_data.basename.into_owned(), e.samples));
        Ok(())
    }
}

impl<'de> Deserialize<'de> for ShardList {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Entries;
        impl<'de> serde::de::Visitor<'de> for Entries {
            type Value = ShardList;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a list of shard entries")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> std::result::Result<ShardList, A::Error> {
                use serde::de::Error as _;
                let mut list = ShardList::default();
                for k in 0.. {
                    let entry = seq.next_element::<ShardEntry<'de>>().map_err(|e| {
                        A::Error::custom(format_args!("shard {k}: not a valid entry: {e}"))
                    })?;
                    let Some(entry) = entry else { break };
                    list.push(k, entry).map_err(A::Error::custom)?;
                }
                Ok(list)
            }
        }
        d.deserialize_seq(Entries)
    }
}

/// The encoding of one MDS column, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MdsEncoding {
    /// A fixed-size column: a tensor.
    Tensor {
        /// Its element type.
        dtype: DType,
        /// Its shape (`[]` for a scalar).
        shape: Vec<u64>,
    },
    /// A variable-size column: bytes with this codec.
    Bytes(Codec),
    /// A variable-size column of numbers written as text (`str_int`: [`FieldDecode::Int`],
    /// `str_float`: [`FieldDecode::Float`]).
    Text(FieldDecode),
    /// A column of Python pickles (`pkl`), which gpufeed does not unpickle.
    Pickle,
}

impl MdsEncoding {
    /// Parses an MDS encoding name, as `streaming`'s `_get_coder` does; an encoding it does not
    /// know or cannot read in place fails with [`Error::Mismatch`].
    pub fn parse(encoding: &str) -> Result<MdsEncoding> {
        MdsEncoding::parse_text(encoding).map_err(Error::mismatch)
    }

    fn parse_text(encoding: &str) -> std::result::Result<MdsEncoding, String> {
        let (name, config) = match encoding.find(':') {
            Some(i) => (&encoding[..i], Some(&encoding[i + 1..])),
            None => (encoding, None),
        };
        if let Some(config) = config {
            if name != "ndarray" {
                return Err(format!("encoding `{encoding}` takes no arguments"));
            }
            let args: Vec<&str> = if config.is_empty() {
                Vec::new()
            } else {
                config.split(':').collect()
            };
            return match args.as_slice() {
                [] => Ok(MdsEncoding::Bytes(Codec::Raw)),
                [dtype] => numpy_dtype(dtype)
                    .map(|_| MdsEncoding::Bytes(Codec::Raw))
                    .ok_or_else(|| format!("`{encoding}`: unknown dtype `{dtype}`")),
                [dtype, shape] => {
                    let dtype = numpy_dtype(dtype)
                        .ok_or_else(|| format!("`{encoding}`: unknown dtype `{dtype}`"))?;
                    let shape = shape
                        .split(',')
                        .map(|d| d.trim().parse::<u64>().ok().filter(|&d| d >= 1))
                        .collect::<Option<Vec<u64>>>()
                        .ok_or_else(|| format!("`{encoding}`: a bad shape"))?;
                    Ok(MdsEncoding::Tensor { dtype, shape })
                }
                _ => Err(format!("`{encoding}`: too many arguments")),
            };
        }
        if let Some(dtype) = numpy_dtype(name) {
            return Ok(MdsEncoding::Tensor {
                dtype,
                shape: Vec::new(),
            });
        }
        Ok(match name {
            "int" => MdsEncoding::Tensor {
                dtype: DType::I64,
                shape: Vec::new(),
            },
            "str" | "str_decimal" => MdsEncoding::Bytes(Codec::Utf8),
            "json" => MdsEncoding::Bytes(Codec::Json),
            "str_int" => MdsEncoding::Text(FieldDecode::Int),
            "str_float" => MdsEncoding::Text(FieldDecode::Float),
            "pkl" => MdsEncoding::Pickle,
            "jpeg" => MdsEncoding::Bytes(Codec::Jpeg),
            "png" => MdsEncoding::Bytes(Codec::Png),
            "bytes" | "ndarray" | "pil" | "jpeg_array" | "jpegarray" | "list[pil]"
            | "list[jpeg]" | "list[png]" => MdsEncoding::Bytes(Codec::Raw),
            _ => return Err(format!("unknown MDS encoding `{encoding}`")),
        })
    }

    /// The fixed size in bytes, `None` for a variable-size column.
    pub fn size(&self) -> Option<u64> {
        match self {
            MdsEncoding::Tensor { dtype, shape } => Some(
                shape
                    .iter()
                    .try_fold(dtype.size() as u64, |a, &d| a.checked_mul(d))
                    .unwrap_or(u64::MAX),
            ),
            MdsEncoding::Bytes(_) | MdsEncoding::Text(_) | MdsEncoding::Pickle => None,
        }
    }

    /// The field a column of this encoding is read as by streaming's conventions, or why it
    /// is not read unless declared (`pkl`).
    pub fn decode(&self) -> std::result::Result<FieldDecode, String> {
        match self {
            MdsEncoding::Tensor { dtype, shape } => Ok(FieldDecode::Tensor {
                dtype: *dtype,
                shape: shape.clone(),
            }),
            MdsEncoding::Bytes(codec) => Ok(FieldDecode::Bytes(*codec)),
            MdsEncoding::Text(d) => Ok(d.clone()),
            MdsEncoding::Pickle => Err(
                "encoded pkl (Python pickles): unpickling runs whatever code the data set chose, so gpufeed reads no pickle; write the column as json, bytes or ndarray, or declare it `raw` to read its bytes as they are".into(),
            ),
        }
    }
}

/// Reads MDS shards for [`ShardedDataset`].
#[derive(Debug)]
pub struct MdsShards {
    index_path: PathBuf,
    /// Each shard's raw file, by shard number.
    files: Vec<ShardFile>,
    /// Every shard's columns (their sizes: `None` for a variable one).
    layout: Layout,
    /// Each column's encoding, parsed.
    encodings: Vec<MdsEncoding>,
    /// Each column's decoder (set when the dataset is made, from the declarations).
    decoders: Vec<Decoder>,
    /// Whether a compressed shard is read from its raw file when that is there (as
    /// streaming's local cache leaves it): true for a local directory; a remote store's has
    /// the compressed files only.
    pub(crate) raw_first: bool,
    /// Where compressed shards are decompressed to (the cache's root, limit and this data
    /// set's key in it), for a data set that has some.
    decompress_at: Option<(PathBuf, u64, String)>,
    /// The decompressor, made on first use (so that a data set read from its raw files
    /// makes no cache directory).
    decompressor: std::sync::OnceLock<Decompressor>,
    /// The shards whose raw files have passed their hashes when opened.
    hashed: HashedShards,
}

/// A dataset of MDS shards.
pub type MdsDataset = ShardedDataset<MdsShards>;

/// What an MDS index says: the format reader and the shards (name, samples).
pub(crate) struct ReadIndex {
    pub format: MdsShards,
    pub shards: Vec<(String, u64)>,
}

/// An open MDS shard: its bytes and where its samples start.
pub struct MdsShard {
    bytes: ShardBytes,
    samples: u64,
    data_start: u64,
}

impl IndexedFormat for MdsShards {
    const INDEX_FILE: &'static str = MDS_INDEX_FILE;

    fn dataset(
        store: Arc<dyn ShardStore>,
        index_path: &Path,
        text: &[u8],
        options: ShardOptions,
    ) -> Result<MdsDataset> {
        MdsDataset::from_read_index(MdsShards::read_index(index_path, text)?, store, options)
    }
}

impl ShardedDataset<MdsShards> {
    /// A dataset of what [`MdsShards::read_index`] read, with its shards in `store`.
    pub(crate) fn from_read_index(
        index: ReadIndex,
        store: Arc<dyn ShardStore>,
        options: ShardOptions,
    ) -> Result<MdsDataset> {
        let ReadIndex { mut format, shards } = index;
        let schema = format.declare(&options)?;
        if format.files.iter().any(|f| f.zip.is_some()) {
            let (dir, limit) = super::cache::settings_from_env()?;
            let root = options
                .cache_dir
                .clone()
                .or(dir)
                .unwrap_or_else(super::cache::default_root);
            let limit = options
                .cache_limit
                .or(limit)
                .unwrap_or(super::cache::DEFAULT_LIMIT);
            let key = store.locate(MDS_INDEX_FILE).to_string_lossy().into_owned();
            format.decompress_at = Some((root, limit, key));
        }
        ShardedDataset::from_parts(format, store, shards, schema, options)?.check_empty_shards()
    }
}

impl MdsShards {
    /// Reads the index `text` (from `index_path`), checking every entry's name and layout.
    pub(crate) fn read_index(index_path: &Path, text: &[u8]) -> Result<ReadIndex> {
        let bad = |what: String| Error::Malformed {
            path: index_path.to_path_buf(),
            format: "MDS index",
            what,
        };
        let file: IndexFile =
            serde_json::from_slice(text).map_err(|e| bad(format!("not a valid index: {e}")))?;
        if file.version != 2 {
            return Err(bad(format!(
                "version {} (this reader knows version 2)",
                file.version
            )));
        }
        let ShardList {
            shards,
            files,
            layout,
        } = file.shards;
        if shards.is_empty() {
            return Err(bad("no shard".into()));
        }
        for (name, _) in &shards {
            check_shard_name(index_path, "MDS index", name)?;
        }
        for f in &files {
            if let Some(z) = &f.zip {
                check_shard_name(index_path, "MDS index", &z.name)?;
            }
        }
        let n = layout.names.len();
        if n == 0 || layout.encodings.len() != n || layout.sizes.len() != n {
            return Err(bad(format!(
                "shard 0: {} column names, {} encodings, {} sizes",
                n,
                layout.encodings.len(),
                layout.sizes.len()
            )));
        }
        let mut encodings = Vec::with_capacity(n);
        for ((name, enc), &size) in layout
            .names
            .iter()
            .zip(&layout.encodings)
            .zip(&layout.sizes)
        {
            let e = MdsEncoding::parse(enc).map_err(|e| bad(format!("column `{name}`: {e}")))?;
            if e.size() != size {
                return Err(bad(format!(
                    "column `{name}` ({enc}) has size {size:?} in the index, its encoding gives {:?}",
                    e.size()
                )));
            }
            encodings.push(e);
        }
        let format = MdsShards {
            index_path: index_path.to_path_buf(),
            files,
            layout,
            encodings,
            decoders: Vec::new(),
            raw_first: true,
            decompress_at: None,
            decompressor: std::sync::OnceLock::new(),
            hashed: HashedShards::new(shards.len()),
        };
        Ok(ReadIndex { format, shards })
    }

    /// The schema of the columns, each read by streaming's conventions or as `options.decode`
    /// declares it, and the decoder of each.
    fn declare(&mut self, options: &ShardOptions) -> Result<Schema> {
        let bad = |what: String| Error::Malformed {
            path: self.index_path.clone(),
            format: "MDS index",
            what,
        };
        if let Some(name) = options
            .decode
            .keys()
            .find(|n| !self.layout.names.contains(n))
        {
            return Err(Error::config(
                "decode",
                format!(
                    "no column `{name}` to declare: the columns are {:?}",
                    self.layout.names
                ),
            ));
        }
        let mut fields = Vec::with_capacity(self.encodings.len());
        let mut decoders = Vec::with_capacity(self.encodings.len());
        for ((name, enc), e) in self
            .layout
            .names
            .iter()
            .zip(&self.layout.encodings)
            .zip(&self.encodings)
        {
            let decode = match options.decode.get(name) {
                Some(d) => {
                    if let (Some(size), FieldDecode::Tensor { .. }) = (e.size(), d) {
                        let want = d.field(name).fixed_bytes();
                        if want != usize::try_from(size).ok() {
                            return Err(Error::config(
                                "decode",
                                format!(
                                    "column `{name}` ({enc}) holds {size} bytes a sample, `{d}` is {want:?}"
                                ),
                            ));
                        }
                    }
                    d.clone()
                }
                None => e
                    .decode()
                    .map_err(|what| bad(format!("column `{name}`: {what}")))?,
            };
            let ndarray =
                (e.size().is_none() && enc.starts_with("ndarray")).then_some(enc.as_str());
            decoders.push(match (e, &decode) {
                // A fixed column read as what it is: its bytes in place.
                (MdsEncoding::Tensor { .. }, FieldDecode::Tensor { .. }) => Decoder::Verbatim,
                _ => Decoder::new(&decode, false, ndarray),
            });
            fields.push(decode.field(name));
        }
        self.decoders = decoders;
        Schema::validated(fields).map_err(|e| bad(format!("columns: {e}")))
    }

    /// What the index says of shard `k`'s raw file.
    #[cfg(feature = "remote")]
    pub(crate) fn file(&self, k: usize) -> Option<&ShardFile> {
        self.files.get(k)
    }

    fn disagrees(&self, path: &Path, what: String) -> Error {
        Error::Malformed {
            path: path.to_path_buf(),
            format: "MDS shard",
            what: format!("{what} (index {})", self.index_path.display()),
        }
    }

    /// Checks the hashes the index gives for the raw file that we know how to compute.
    fn check_hashes(&self, k: usize, bytes: &ShardBytes) -> Result<()> {
        self.hashes_match(k, bytes.path(), bytes.all()?)
    }

    /// Checks `all`, the bytes of shard `k`'s raw file at `path`, against the index's hashes.
    fn hashes_match(&self, k: usize, path: &Path, all: &[u8]) -> Result<()> {
        self.files[k].hashes.check(all).map_err(|what| {
            self.disagrees(
                path,
                format!(
                    "the file's {what}: its bytes changed after the index was written (damaged, or replaced by another file); nothing of it is read"
                ),
            )
        })
    }

    /// The compression of the data set's shards, if any is compressed (`zstd`, ...).
    pub fn compression(&self) -> Option<&str> {
        self.files
            .iter()
            .find_map(|f| f.zip.as_ref())
            .map(|z| z.compression.as_deref().unwrap_or("unknown"))
    }

    /// Shard `k`'s raw bytes from its compressed file `zip`, decompressed (once) into the
    /// cache.
    fn decompressed(
        &self,
        store: &dyn ShardStore,
        k: usize,
        name: &str,
        zip: &ZipFile,
    ) -> Result<ShardBytes> {
        let path = store.locate(name);
        let missing = |what: String| Error::Malformed {
            path: path.clone(),
            format: "MDS shard",
            what,
        };
        let compression = Compression::parse(zip.compression.as_deref().unwrap_or("none"))
            .map_err(|what| {
                missing(format!(
                    "missing, and its compressed file {} is {what}",
                    zip.name
                ))
            })?;
        let decompressor = match self.decompressor.get() {
            Some(d) => d,
            None => {
                let (root, limit, key) = self.decompress_at.as_ref().ok_or_else(|| {
                    missing("compressed, and no cache to decompress it to".into())
                })?;
                let d = Decompressor::new(root.clone(), *limit, key)?;
                self.decompressor.get_or_init(|| d)
            }
        };
        decompressor.open(
            store,
            &CompressedShard {
                format: "MDS shard",
                zip_name: &zip.name,
                zip_bytes: zip.bytes,
                zip_hashes: &zip.hashes,
                raw_name: name,
                raw_bytes: Some(self.files[k].bytes),
                raw_hashes: &self.files[k].hashes,
                compression,
            },
        )
    }

    fn u32_at(bytes: &ShardBytes, at: u64) -> Result<u32> {
        let b = bytes.get(at..at + 4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// The byte range of sample `i` (below the shard's count), checked.
    fn sample_range(shard: &MdsShard, i: u64) -> Result<(u64, u64)> {
        let start = u64::from(MdsShards::u32_at(&shard.bytes, 4 + 4 * i)?);
        let end = u64::from(MdsShards::u32_at(&shard.bytes, 8 + 4 * i)?);
        if start < shard.data_start || start > end || end > shard.bytes.len() {
            return Err(Error::BadRecord {
                path: shard.bytes.path().to_path_buf(),
                record: i,
                what: format!(
                    "offsets {start}..{end} are decreasing or outside the samples' bytes {}..{}",
                    shard.data_start,
                    shard.bytes.len()
                ),
            });
        }
        Ok((start, end))
    }

    /// Where each column of a sample lies within `sample` (its bytes), or what is wrong.
    fn columns(&self, sample: &[u8]) -> Result<Vec<std::ops::Range<usize>>, String> {
        let var = self.layout.sizes.iter().filter(|s| s.is_none()).count();
        let head = 4 * var;
        if sample.len() < head {
            return Err(format!(
                "{} bytes cannot hold the sizes of its {var} variable columns",
                sample.len()
            ));
        }
        let mut at = head as u64;
        let mut v = 0;
        let mut out = Vec::with_capacity(self.layout.sizes.len());
        for s in &self.layout.sizes {
            let size = match s {
                Some(s) => *s,
                None => {
                    let b = &sample[4 * v..4 * v + 4];
                    v += 1;
                    u64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                }
            };
            let end = at
                .checked_add(size)
                .filter(|&e| e <= sample.len() as u64)
                .ok_or_else(|| {
                    format!(
                        "its columns run past its {} bytes (a column of {size} bytes at {at})",
                        sample.len()
                    )
                })?;
            out.push(at as usize..end as usize);
            at = end;
        }
        if at != sample.len() as u64 {
            return Err(format!(
                "its columns take {at} bytes, the sample has {}",
                sample.len()
            ));
        }
        Ok(out)
    }
}

impl ShardFormat for MdsShards {
    type Shard = MdsShard;

    fn name(&self) -> &'static str {
        "MDS"
    }

    fn format(&self) -> crate::source::Format {
        crate::source::Format::Mds
    }

    fn compression(&self) -> Option<String> {
        MdsShards::compression(self).map(str::to_owned)
    }

    /// A compressed shard read from its archive (the store's, as from object storage) is
    /// fetched as the archive: asking for the raw name would cost a request for an object
    /// that is not there, and fetch nothing ahead.
    fn store_file<'a>(&'a self, k: usize, name: &'a str) -> &'a str {
        match self.files.get(k).and_then(|f| f.zip.as_deref()) {
            Some(zip) if !self.raw_first => &zip.name,
            _ => name,
        }
    }

    fn open_shard(
        &self,
        store: &dyn ShardStore,
        k: usize,
        name: &str,
        samples: u64,
        _schema: &Schema,
        options: &ShardOptions,
    ) -> Result<MdsShard> {
        let file = &self.files[k];
        // Whether the bytes are the store's file (else the cache's decompressed copy, checked
        // against the raw file's hashes when it was written).
        let (bytes, from_store) = match file.zip.as_deref() {
            None => (store.open(name)?, true),
            Some(zip) if !self.raw_first => (self.decompressed(store, k, name, zip)?, false),
            Some(zip) => match store.open(name) {
                Ok(b) => (b, true),
                Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                    (self.decompressed(store, k, name, zip)?, false)
                }
                Err(e) => return Err(e),
            },
        };
        let path = bytes.path().to_path_buf();
        if bytes.len() != file.bytes {
            return Err(self.disagrees(
                &path,
                format!(
                    "the shard is {} bytes, the index says {}",
                    bytes.len(),
                    file.bytes
                ),
            ));
        }
        if options.verify {
            self.check_hashes(k, &bytes)?;
        }
        let n = u64::from(MdsShards::u32_at(&bytes, 0)?);
        if n != samples {
            return Err(self.disagrees(
                &path,
                format!("the shard's header says {n} samples, the index says {samples}"),
            ));
        }
        let table_end = 4 + 4 * (n + 1);
        if table_end > bytes.len() {
            return Err(self.disagrees(
                &path,
                format!(
                    "an offset table of {} entries does not fit in {} bytes: truncated",
                    n + 1,
                    bytes.len()
                ),
            ));
        }
        let first = u64::from(MdsShards::u32_at(&bytes, 4)?);
        let last = u64::from(MdsShards::u32_at(&bytes, 4 + 4 * n)?);
        if first < table_end || first > last || last != bytes.len() {
            return Err(self.disagrees(
                &path,
                format!(
                    "samples span {first}..{last}; they must start after the offset table ({table_end}) and end at the end of the file ({})",
                    bytes.len()
                ),
            ));
        }
        // The shard's own copy of its columns, between the table and the samples.
        let config = bytes.get(table_end..first)?;
        if let Ok(c) = serde_json::from_slice::<serde_json::Value>(config) {
            let same = |key: &str, want: &serde_json::Value| c.get(key).is_none_or(|v| v == want);
            let names = serde_json::to_value(&self.layout.names).unwrap_or_default();
            let encs = serde_json::to_value(&self.layout.encodings).unwrap_or_default();
            if !same("column_names", &names) || !same("column_encodings", &encs) {
                return Err(self.disagrees(
                    &path,
                    "the shard's own column layout is not the index's".into(),
                ));
            }
        } else if !config.is_empty() {
            return Err(self.disagrees(
                &path,
                format!("bytes {table_end}..{first} (the shard's config) are not JSON: corrupt"),
            ));
        }
        // The hashes last, once the structure has said what it can: before any sample.
        if !options.verify && from_store && store.check_hashes_on_open() && !file.hashes.is_empty()
        {
            self.hashed.check_once(k, bytes.file_fingerprint(), || {
                self.hashes_match(k, &path, bytes.all()?)
            })?;
        }
        Ok(MdsShard {
            bytes,
            samples: n,
            data_start: first,
        })
    }

    fn sample<'s>(
        &'s self,
        shard: &MdsShard,
        _k: usize,
        index: u64,
        schema: &'s Schema,
        _options: &ShardOptions,
    ) -> Result<Sample<'s>> {
        if index >= shard.samples {
            return Err(Error::OutOfRange {
                index,
                len: shard.samples,
            });
        }
        let (start, end) = MdsShards::sample_range(shard, index)?;
        let data = shard.bytes.share(start..end)?;
        let bad = |what: String| Error::BadRecord {
            path: shard.bytes.path().to_path_buf(),
            record: index,
            what,
        };
        let columns = self.columns(&data).map_err(bad)?;
        let mut fields = Vec::with_capacity(columns.len());
        let mut decoded = Vec::new();
        for ((c, range), decoder) in columns.into_iter().enumerate().zip(&self.decoders) {
            if decoder.is_verbatim() {
                fields.push(FieldSpan::Shared(range));
                continue;
            }
            match decoder.decode(&data[range.clone()]) {
                Ok(Value::Within(r)) => {
                    fields.push(FieldSpan::Shared(
                        range.start + r.start..range.start + r.end,
                    ));
                }
                Ok(Value::Decoded(v)) => {
                    fields.push(FieldSpan::Decoded(decoded.len()..decoded.len() + v.len()));
                    decoded.extend_from_slice(&v);
                }
                Err(what) => {
                    return Err(bad(format!(
                        "column `{}` ({}): {what}",
                        self.layout.names[c], self.layout.encodings[c]
                    )));
                }
            }
        }
        Sample::spans(data, fields, decoded, schema)
    }

    fn verify_shard(
        &self,
        store: &dyn ShardStore,
        k: usize,
        name: &str,
        samples: u64,
        schema: &Schema,
    ) -> Result<()> {
        let options = ShardOptions {
            verify: true,
            ..ShardOptions::default()
        };
        let shard = self.open_shard(store, k, name, samples, schema, &options)?;
        for i in 0..samples {
            let s = self.sample(&shard, k, i, schema, &options)?;
            for (c, f) in schema.fields().iter().enumerate() {
                let enc = &self.layout.encodings[c];
                if let FieldKind::Bytes { .. } = f.kind
                    && enc.starts_with("ndarray")
                {
                    decode_ndarray(enc, s.field(c).unwrap_or_default()).map_err(|what| {
                        Error::BadRecord {
                            path: shard.bytes.path().to_path_buf(),
                            record: i,
                            what: format!("column `{}`: {what}", f.name),
                        }
                    })?;
                }
            }
        }
        Ok(())
    }

    /// The shard's file against what it was when mapped ([`ShardBytes::check_unchanged`]).
    fn check_unchanged(&self, shard: &MdsShard) -> Result<()> {
        shard.bytes.check_unchanged()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodings_map_to_fields() {
        let t = |d, s: &[u64]| MdsEncoding::Tensor {
            dtype: d,
            shape: s.to_vec(),
        };
        assert_eq!(MdsEncoding::parse("int").unwrap(), t(DType::I64, &[]));
        assert_eq!(MdsEncoding::parse("uint16").unwrap(), t(DType::U16, &[]));
        assert_eq!(MdsEncoding::parse("float16").unwrap(), t(DType::F16, &[]));
        assert_eq!(
            MdsEncoding::parse("ndarray:float32:3,4").unwrap(),
            t(DType::F32, &[3, 4])
        );
        assert_eq!(
            MdsEncoding::parse("ndarray:int8").unwrap(),
            MdsEncoding::Bytes(Codec::Raw)
        );
        assert_eq!(
            MdsEncoding::parse("str").unwrap(),
            MdsEncoding::Bytes(Codec::Utf8)
        );
        assert_eq!(
            MdsEncoding::parse("jpeg").unwrap(),
            MdsEncoding::Bytes(Codec::Jpeg)
        );
        assert!(MdsEncoding::parse("ndarray:complex64").is_err());
        assert!(MdsEncoding::parse("ndarray:uint8:0").is_err());
        assert!(MdsEncoding::parse("str:x").is_err());
        assert!(MdsEncoding::parse("nothing").is_err());
        assert_eq!(t(DType::F32, &[3, 4]).size(), Some(48));
    }

    #[test]
    fn dynamic_ndarrays_decode_in_place() {
        // int16, shape (2, 3) in uint8 dims: code 17, (2 << 2) | 0, 2, 3, values.
        let mut b = vec![17u8, 2 << 2, 2, 3];
        b.extend((0..6i16).flat_map(|v| v.to_le_bytes()));
        let v = decode_ndarray("ndarray", &b).unwrap();
        assert_eq!(
            (v.dtype, v.shape.clone(), v.values.len()),
            (DType::I16, vec![2, 3], 12)
        );
        let v = decode_ndarray("ndarray:int16", &b[1..]).unwrap();
        assert_eq!(v.shape, vec![2, 3]);
        assert!(decode_ndarray("ndarray", &b[..5]).is_err());
        assert!(decode_ndarray("ndarray:int16:2,3", &b).is_err());
    }
}
