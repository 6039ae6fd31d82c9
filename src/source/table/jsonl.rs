//! [`JsonLines`]: JSON lines files (`.jsonl`, `.ndjson`, and `.json` files of one object per
//! line, as pandas' `to_json(orient="records", lines=True)` and `datasets`' `to_json` write
//! them), plain or compressed (`.gz`, `.zst`), one file, a directory of them or a glob
//! pattern, as one map-style [`Dataset`] whose sample `i` is the `i`-th object.
//!
//! # Lines
//!
//! Each line holds one JSON object. Lines of only whitespace (blank lines) are skipped,
//! wherever they are, as pandas' `read_json(lines=True)`, `datasets`' JSON loader and
//! pyarrow's JSON reader skip them (so a file's trailing newline ends its last line and adds
//! none); they count in the line numbers errors give. A UTF-8 byte-order mark at the start of
//! a file is skipped. A line that does not start with `{` (a JSON array, a pretty-printed
//! object) is an [`Error::BadLine`] when the file is opened; a line that is not one JSON
//! object, as Python's `json.loads` reads it, is one when it is read. The whole line is read
//! as Python's `json` reads it: UTF-8 text, escapes decoded (a string with a lone surrogate
//! escape, which no UTF-8 text can hold, is refused), `NaN`, `Infinity` and `-Infinity`
//! accepted as numbers, the last of two equal keys kept.
//!
//! # Fields
//!
//! A field is a key of the objects, a key of an object inside them as `outer.inner`. Which
//! fields, and their types, come from the first lines ([`JsonLinesOptions::infer_lines`],
//! 1,000 by default, across files in order), or from declarations by name
//! ([`JsonLinesOptions::decode`], the [`FieldDecode`] vocabulary of the shard formats):
//!
//! | in the first lines | field | declared as |
//! |---|---|---|
//! | integers | `i64` scalar tensor | `int` |
//! | numbers, some with a fraction or exponent | `f64` scalar tensor (integers converted) | `float` |
//! | `true`/`false` | `bool` scalar tensor | `bool[]` |
//! | strings | bytes (utf8): the string, escapes decoded | `utf8` (or `raw`) |
//! | lists of integers, lists of numbers, of bools | ragged: bytes of `i64`, `f64` or `bool` values ([`Codec::Elements`]) | `list[i64]`, `list[f32]`, ... |
//! | anything (a list of strings, an object kept whole) | bytes (json): the value's text as written | `json` |
//! | lists of numbers of one shape | tensor of that shape | `f32[3]`, `i64[2,4]` |
//!
//! A number declared of another dtype (`u8[]`, `f16[]`, `list[f32]`) is converted as NumPy
//! converts Python's value: integers range-checked, floats rounded from the `f64` that
//! Python's `float` reads (correctly rounded, as Rust's). Every field is read by default
//! ([`JsonLinesOptions::fields`] chooses some); a key whose values in the first lines fit no
//! field (null in every one, strings in some and numbers in others, a list of strings) is left
//! out unless declared, and [`JsonLines::describe`] lists it with the reason. A value of
//! another type in a later line, a key missing or a value `null` is an [`Error::BadLine`]
//! naming the file, the line (from 1) and the column, unless the field has a fill value
//! ([`JsonLinesOptions::fill`]).
//!
//! # Reading a line
//!
//! Opening a file builds an index of where its lines start (one pass over its bytes, at
//! memory speed), kept packed: blocks of 64 lines, each a `u64` start, a `u64` for where its
//! offsets are, and each other line's offset from the block's start in the fewest bytes that
//! hold the block's (1 to 8): about 2.2 bytes a line for lines under 1 KiB, 3.2 under 256 KiB,
//! 8.25 at most ([`JsonLinesSummary::index_bytes`]; a `u64` per line would be 8). With
//! [`JsonLinesOptions::index_dir`] set, the index is written there and read again at the next
//! open instead of being built, while the file's path, size and modification time are those
//! it was built from. [`Dataset::get`] parses the one line asked for: it walks its object once,
//! matches each key against the fields asked for, reads their values and checks the syntax of
//! the others without keeping them. A string without escapes (and a `json` field's text) is
//! handed out in place, in the mapping; numbers, lists and strings with escapes are decoded
//! into the sample's own bytes ([`FieldSpan::Decoded`]).
//!
//! Files are mapped ([`ReadMode::Map`]) or read with `pread` ([`ReadMode::Pread`]), as
//! [`ReadOptions::mode`] says, with the contract of every mapped source (see the
//! [`source`](crate::source) module); [`Dataset::check_unchanged`] compares each file with
//! what it was at open. JSON lines hold no checksums: [`ReadOptions::verify_checksums`] does
//! nothing here.
//!
//! # Compressed files
//!
//! A `.gz` or `.zst` file is decompressed once, when opened, into the cache directory that
//! compressed MDS shards and downloads share (`GPUFEED_CACHE_DIR`,
//! [`JsonLinesOptions::cache_dir`]; within `GPUFEED_CACHE_LIMIT`), by the same machinery:
//! written whole under a temporary name, one process of the machine decompressing while the
//! others wait, found again by later opens (by the compressed file's path, size and
//! modification time) until the cache evicts it. The copy is gpufeed's own, written whole and
//! never in place, so it is mapped whatever the read mode. Errors name the compressed file.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::UNIX_EPOCH;

use bytes::Bytes;
use rayon::prelude::*;
use serde::Serialize;

use super::files::dataset_files;
use crate::error::{Error, Result};
use crate::file::{FileData, FileIdentity, ReadMode, open_file};
use crate::format::{Codec, DType, ReadOptions, Schema};
use crate::source::shards::FieldDecode;
use crate::source::shards::cache::{DEFAULT_LIMIT, default_root, settings_from_env};
use crate::source::shards::compressed::{CompressedShard, Compression, Decompressor, NoHashes};
use crate::source::shards::{LocalDir, quoted, write_atomically};
use crate::source::{Dataset, FieldSpan, Sample};

/// The format's name in messages.
const FORMAT: &str = "JSON lines";

/// Lines read to infer the fields unless told otherwise.
pub const DEFAULT_INFER_LINES: usize = 1000;

/// How deep values may nest (objects in lists in objects...); Python's `json` stops near
/// 1,000 (its recursion limit).
const MAX_DEPTH: usize = 512;

/// Settings of a [`JsonLines`] data set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JsonLinesOptions {
    /// The fields to read, by name (`outer.inner` for a key of an inner object; an object's
    /// name reads every field inside it), in this order; `None`: every field the first lines
    /// show (and every one declared), in the order they appear.
    pub fields: Option<Vec<String>>,
    /// Fields' types declared by name, over what the first lines suggest (see the
    /// [module](self)): `int`, `float`, `utf8`, `raw`, `json`, `list[DTYPE]`, `DTYPE[SHAPE]`.
    pub decode: BTreeMap<String, FieldDecode>,
    /// A value by field name, as JSON text (`-1`, `""`, `[]`), for the lines where the key is
    /// missing or its value `null`; without one, such a line is an [`Error::BadLine`].
    pub fill: BTreeMap<String, String>,
    /// How many lines (from the first file on) the fields and their types are inferred from.
    pub infer_lines: usize,
    /// How files are read ([`ReadOptions::mode`]); JSON lines have no checksums.
    pub read: ReadOptions,
    /// Where compressed files are decompressed to; `None`: `$GPUFEED_CACHE_DIR`, else the
    /// cache's default ([`default_root`]).
    pub cache_dir: Option<PathBuf>,
    /// The most bytes that cache directory holds (everything in it together); `None`:
    /// `$GPUFEED_CACHE_LIMIT`, else [`DEFAULT_LIMIT`].
    pub cache_limit: Option<u64>,
    /// A directory where each file's index of lines may be written, and read at later opens
    /// while the file is unchanged (path, size and modification time); `None` (the default):
    /// the index is built at every open and written nowhere.
    pub index_dir: Option<PathBuf>,
}

impl Default for JsonLinesOptions {
    fn default() -> Self {
        JsonLinesOptions {
            fields: None,
            decode: BTreeMap::new(),
            fill: BTreeMap::new(),
            infer_lines: DEFAULT_INFER_LINES,
            read: ReadOptions::default(),
            cache_dir: None,
            cache_limit: None,
            index_dir: None,
        }
    }
}

/// What a file name says: a JSON lines name (`.jsonl`, `.ndjson`: certain; `.json`: maybe),
/// and its compression.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct NameKind {
    certain: bool,
    compression: Option<Compression>,
}

fn name_kind(name: &str) -> Option<NameKind> {
    let lower = name.to_ascii_lowercase();
    let (stem, compression) = if let Some(s) = lower.strip_suffix(".gz") {
        (s, Some(Compression::Gzip))
    } else if let Some(s) = lower
        .strip_suffix(".zst")
        .or_else(|| lower.strip_suffix(".zstd"))
    {
        (s, Some(Compression::Zstd))
    } else {
        (lower.as_str(), None)
    };
    if stem.ends_with(".jsonl") || stem.ends_with(".ndjson") {
        Some(NameKind {
            certain: true,
            compression,
        })
    } else if stem.ends_with(".json") {
        Some(NameKind {
            certain: false,
            compression,
        })
    } else {
        None
    }
}

/// Whether `path` names JSON lines: a file named `.jsonl` or `.ndjson` (plain, `.gz` or
/// `.zst`), or a `.json` file whose first line is a whole JSON object (a `.json` holding one
/// array or a pretty-printed object is not), or a directory holding such files, or a glob
/// pattern whose matches are. Reads at most the first 64 KiB of a `.json` file (decompressed).
pub fn is_json_lines(path: &Path) -> bool {
    let Ok(files) = list_files(path) else {
        return false;
    };
    files.iter().all(|f| {
        let name = f.file_name().and_then(|n| n.to_str()).unwrap_or("");
        match name_kind(name) {
            Some(k) if k.certain => true,
            Some(k) => first_line_is_object(f, k.compression),
            None => false,
        }
    })
}

/// True if the first line that is not blank in the first 64 KiB of `path` (decompressed) is
/// one whole JSON object.
fn first_line_is_object(path: &Path, compression: Option<Compression>) -> bool {
    use std::io::Read;
    const MOST: u64 = 64 << 10;
    let Ok(file) = std::fs::File::open(path) else {
        return false;
    };
    let mut head = Vec::new();
    let read = match compression {
        None => file.take(MOST).read_to_end(&mut head),
        Some(Compression::Gzip) => flate2::read::MultiGzDecoder::new(file)
            .take(MOST)
            .read_to_end(&mut head),
        Some(Compression::Zstd) => match zstd::stream::read::Decoder::new(file) {
            Ok(d) => d.take(MOST).read_to_end(&mut head),
            Err(_) => return false,
        },
    };
    if read.is_err() && head.is_empty() {
        return false;
    }
    let head = head.strip_prefix(BOM).unwrap_or(&head);
    head.split(|&c| c == b'\n')
        .find(|l| l.iter().any(|c| !is_ws(*c)))
        .is_some_and(|line| {
            let mut c = Cursor::new(line);
            c.ws();
            c.peek() == Some(b'{') && c.skip(0).is_ok() && {
                c.ws();
                c.done()
            }
        })
}

/// The files `target` names: itself, the JSON lines files of a directory (`.jsonl` and
/// `.ndjson` ones, else `.json` ones), or a pattern's matches.
fn list_files(target: &Path) -> Result<Vec<PathBuf>> {
    let any = |n: &str| name_kind(n).is_some();
    let mut files = dataset_files(target, &any, "JSON lines files (.jsonl, .json, .gz, .zst)")?;
    if target.is_dir() {
        let certain: Vec<PathBuf> = files
            .iter()
            .filter(|f| {
                f.file_name()
                    .and_then(|n| n.to_str())
                    .and_then(name_kind)
                    .is_some_and(|k| k.certain)
            })
            .cloned()
            .collect();
        if !certain.is_empty() {
            files = certain;
        }
    }
    Ok(files)
}

/// A data set of JSON lines files: sample `i` is the `i`-th object of the files in order (see
/// the [module](self) for the rules).
///
/// ```
/// use gpufeed::Dataset;
/// use gpufeed::source::table::{JsonLines, JsonLinesOptions};
///
/// let dir = tempfile::tempdir()?;
/// let path = dir.path().join("train.jsonl");
/// std::fs::write(&path, "{\"text\": \"a cat\", \"label\": 3}\n{\"text\": \"a dog\", \"label\": 5}\n")?;
/// let data = JsonLines::open(&path, &JsonLinesOptions::default())?;
/// assert_eq!(data.len(), 2);
/// let s = data.get(1)?;
/// assert_eq!(s.field_named("text"), Some(&b"a dog"[..]));
/// assert_eq!(*s.field_as::<i64>("label")?, [5]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct JsonLines {
    files: Vec<LinesFile>,
    /// Lines before each file, and the total last.
    starts: Vec<u64>,
    plan: Plan,
    schema: Schema,
    /// Keys the first lines show that no field reads, and why.
    left_out: Vec<(String, String)>,
    /// Lines the fields were inferred from.
    inferred_from: u64,
    mode: ReadMode,
}

impl std::fmt::Debug for JsonLines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JsonLines")
            .field("files", &self.files.len())
            .field("lines", &self.len())
            .field("schema", &self.schema.to_string())
            .finish()
    }
}

/// One file of the data set.
struct LinesFile {
    /// The file as the user named it (the compressed one, for a compressed file).
    path: PathBuf,
    body: Body,
    /// What the file was at open (`None` for bytes not from a file).
    identity: Option<FileIdentity>,
    compression: Option<Compression>,
    /// The file's size on disk.
    file_bytes: u64,
    index: LineIndex,
    blank_lines: u64,
    /// The index was read from `index_dir`, not built.
    index_from_file: bool,
}

/// The bytes of a file's lines.
enum Body {
    /// Mapped (or in memory): lines are views of it.
    Mapped(Bytes),
    /// Read at offsets.
    Read(FileData),
}

impl Body {
    fn len(&self) -> u64 {
        match self {
            Body::Mapped(b) => b.len() as u64,
            Body::Read(f) => f.len(),
        }
    }
}

/// A [`Arc<Mmap>`](memmap2::Mmap) as the owner of a [`Bytes`].
struct Mapping(Arc<memmap2::Mmap>);

impl AsRef<[u8]> for Mapping {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl JsonLines {
    /// Opens the JSON lines `target` names: a file, a directory (its `.jsonl` and `.ndjson`
    /// files, plain or compressed; if it has none, its `.json` files), or a glob pattern
    /// (`data/train-*.jsonl.gz`), files in the order of their paths.
    ///
    /// Builds each file's index of lines (in parallel over files; compressed files are
    /// decompressed first, once), then reads the first lines to find the fields. Errors: a
    /// file that cannot be read ([`Error::Io`]), a line that is not an object
    /// ([`Error::BadLine`]), a compressed file that does not decompress
    /// ([`Error::Malformed`]), settings that cannot work ([`Error::InvalidConfig`]: a field
    /// asked for that the first lines do not have and no declaration types).
    pub fn open(target: impl AsRef<Path>, options: &JsonLinesOptions) -> Result<JsonLines> {
        let target = target.as_ref();
        let paths = list_files(target)?;
        let mut decompress_at = None;
        if paths.iter().any(|p| compression_of(p).is_some()) {
            let (dir, limit) = settings_from_env()?;
            let root = options
                .cache_dir
                .clone()
                .or(dir)
                .unwrap_or_else(default_root);
            let limit = options.cache_limit.or(limit).unwrap_or(DEFAULT_LIMIT);
            decompress_at = Some(Decompressor::new(root, limit, "json-lines")?);
        }
        let files = paths
            .par_iter()
            .map(|p| LinesFile::open(p, options, decompress_at.as_ref()))
            .collect::<Result<Vec<_>>>()?;
        JsonLines::from_files(files, options)
    }

    /// A data set of one file's bytes held in memory (named `name` in errors): for tests,
    /// fuzzing and data made on the fly. Read as [`open`](JsonLines::open) reads a file.
    pub fn from_memory(
        name: impl Into<PathBuf>,
        bytes: impl Into<Bytes>,
        options: &JsonLinesOptions,
    ) -> Result<JsonLines> {
        let path = name.into();
        let bytes = bytes.into();
        let (index, blank_lines) = scan_lines(&path, &bytes)?;
        let file = LinesFile {
            file_bytes: bytes.len() as u64,
            body: Body::Mapped(bytes),
            path,
            identity: None,
            compression: None,
            index,
            blank_lines,
            index_from_file: false,
        };
        JsonLines::from_files(vec![file], options)
    }

    fn from_files(files: Vec<LinesFile>, options: &JsonLinesOptions) -> Result<JsonLines> {
        let mut starts = Vec::with_capacity(files.len() + 1);
        let mut total = 0u64;
        starts.push(0);
        for f in &files {
            total += f.index.lines;
            starts.push(total);
        }
        let mut data = JsonLines {
            files,
            starts,
            plan: Plan::default(),
            schema: Schema::new(vec![crate::format::Field::bytes("_", Codec::Raw)])?,
            left_out: Vec::new(),
            inferred_from: 0,
            mode: options.read.mode,
        };
        let (inference, read) = data.infer(options.infer_lines)?;
        data.inferred_from = read;
        let (plan, left_out) = Plan::new(&inference, read, options)?;
        let fields = plan
            .fields
            .iter()
            .map(|f| f.decode.field(&f.name))
            .collect();
        data.schema = Schema::validated(fields).map_err(|what| Error::InvalidSchema { what })?;
        data.plan = plan;
        data.left_out = left_out;
        Ok(data)
    }

    /// Reads the first `most` lines into what each key held.
    fn infer(&self, most: usize) -> Result<(Inference, u64)> {
        let mut inference = Inference::default();
        let mut read = 0u64;
        'files: for (f, file) in self.files.iter().enumerate() {
            for i in 0..file.index.lines {
                if read >= most as u64 {
                    break 'files;
                }
                let (line, start) = file.line(i)?;
                let mut c = Cursor::new(&line);
                let step = check_utf8(&line).and_then(|()| {
                    c.ws();
                    let mut path = Vec::new();
                    inference.observe_object(&mut c, &mut path, 0)?;
                    c.ws();
                    c.end()
                });
                if let Err(fault) = step {
                    return Err(self.bad_line(f, start, &line, Some(fault.at), fault.what));
                }
                read += 1;
            }
        }
        Ok((inference, read))
    }

    /// The files, in order.
    pub fn paths(&self) -> Vec<&Path> {
        self.files.iter().map(|f| f.path.as_path()).collect()
    }

    /// Where sample `index` is: the file's number and the line's place in it (among its lines
    /// that are not blank, from 0).
    fn locate(&self, index: u64) -> Result<(usize, u64)> {
        let total = self.len();
        if index >= total {
            return Err(Error::OutOfRange { index, len: total });
        }
        let f = self.starts.partition_point(|&s| s <= index) - 1;
        Ok((f, index - self.starts[f]))
    }

    /// The line number (from 1, blank lines counted) and the file of sample `index`.
    pub fn line_of(&self, index: u64) -> Result<(&Path, u64)> {
        let (f, i) = self.locate(index)?;
        let file = &self.files[f];
        let start = file.index.start(i).ok_or_else(|| file.corrupt_index())?;
        Ok((&file.path, file.line_number(start)?))
    }

    fn bad_line(
        &self,
        f: usize,
        start: u64,
        line: &[u8],
        at: Option<usize>,
        what: String,
    ) -> Error {
        let file = &self.files[f];
        match file.line_number(start) {
            Ok(number) => Error::BadLine {
                path: file.path.clone(),
                line: number,
                column: at.map(|at| char_column(line, at)),
                what,
            },
            Err(e) => e,
        }
    }

    /// Reads every line as [`get`](Dataset::get) does, and returns the first error (in file
    /// and line order); `progress` is told each file done. For `gpufeed inspect --verify`.
    pub fn verify(&self, mut progress: impl FnMut(usize)) -> Result<()> {
        for f in 0..self.files.len() {
            for i in self.starts[f]..self.starts[f + 1] {
                self.get(i)?;
            }
            progress(f);
        }
        Ok(())
    }

    /// What the data set is, as plain data: its files (sizes, compression, lines), its fields
    /// (how each is read, declared or inferred, fill values) and the keys left out (and why),
    /// for `gpufeed inspect` and Python.
    pub fn describe(&self) -> JsonLinesSummary {
        let files: Vec<JsonLinesFileSummary> = self
            .files
            .iter()
            .map(|f| JsonLinesFileSummary {
                path: f.path.clone(),
                compression: f.compression.map(|c| {
                    match c {
                        Compression::Gzip => "gzip",
                        Compression::Zstd => "zstd",
                    }
                    .to_string()
                }),
                file_bytes: f.file_bytes,
                bytes: f.body.len(),
                lines: f.index.lines,
                blank_lines: f.blank_lines,
                index_bytes: f.index.heap_bytes(),
                index_from_file: f.index_from_file,
            })
            .collect();
        let mut fields: Vec<JsonLinesFieldSummary> = self
            .plan
            .fields
            .iter()
            .map(|f| JsonLinesFieldSummary {
                name: f.name.clone(),
                decode: Some(f.decode.to_string()),
                declared: f.declared,
                fill: f.fill.as_ref().map(|x| x.text.clone()),
                left_out: None,
            })
            .collect();
        fields.extend(
            self.left_out
                .iter()
                .map(|(name, why)| JsonLinesFieldSummary {
                    name: name.clone(),
                    decode: None,
                    declared: false,
                    fill: None,
                    left_out: Some(why.clone()),
                }),
        );
        JsonLinesSummary {
            lines: self.len(),
            file_bytes: files.iter().map(|f| f.file_bytes).sum(),
            bytes: files.iter().map(|f| f.bytes).sum(),
            index_bytes: files.iter().map(|f| f.index_bytes).sum(),
            inferred_from_lines: self.inferred_from,
            read_mode: match self.mode {
                ReadMode::Map => "map",
                ReadMode::Pread => "pread",
            }
            .to_string(),
            files,
            fields,
        }
    }

    /// Sample `index`'s line, parsed into its fields.
    fn read(&self, index: u64) -> Result<Sample<'_>> {
        let (f, i) = self.locate(index)?;
        let file = &self.files[f];
        let (line, start) = file.line(i)?;
        let mut got = vec![Got::Missing; self.plan.fields.len()];
        let mut decoded = Vec::with_capacity(self.plan.decoded_hint);
        if let Err(fault) = self.plan.read_line(&line, &mut got, &mut decoded) {
            return Err(self.bad_line(f, start, &line, Some(fault.at), fault.what));
        }
        let mut spans = Vec::with_capacity(got.len());
        for (k, g) in got.into_iter().enumerate() {
            let field = &self.plan.fields[k];
            let (at, what) = match g {
                Got::At(span) => {
                    spans.push(span);
                    continue;
                }
                Got::Missing => (None, "missing"),
                Got::Null(at) => (Some(at), "null"),
            };
            let Some(fill) = &field.fill else {
                let what = if what == "missing" {
                    format!("no key `{}`", field.name)
                } else {
                    format!("`{}` is null", field.name)
                };
                return Err(self.bad_line(
                    f,
                    start,
                    &line,
                    at,
                    format!("{what}: give the field a fill value, or leave it out"),
                ));
            };
            align(&mut decoded, fill.align);
            let s = decoded.len();
            decoded.extend_from_slice(&fill.bytes);
            spans.push(FieldSpan::Decoded(s..decoded.len()));
        }
        Sample::spans(line, spans, decoded, &self.schema)
    }
}

impl Dataset for JsonLines {
    fn len(&self) -> u64 {
        self.starts.last().copied().unwrap_or(0)
    }

    fn schema(&self) -> &Schema {
        &self.schema
    }

    fn get(&self, index: u64) -> Result<Sample<'_>> {
        self.read(index)
    }

    fn check_unchanged(&self) -> Result<()> {
        for f in &self.files {
            if let Some(identity) = &f.identity {
                identity.check(&f.path)?;
            }
        }
        Ok(())
    }
}

fn compression_of(path: &Path) -> Option<Compression> {
    path.file_name()
        .and_then(|n| n.to_str())
        .and_then(name_kind)
        .and_then(|k| k.compression)
}

impl LinesFile {
    /// Opens one file: maps it or keeps it to read (a compressed one decompressed into the
    /// cache first), and reads or builds its index.
    fn open(
        path: &Path,
        options: &JsonLinesOptions,
        decompressor: Option<&Decompressor>,
    ) -> Result<LinesFile> {
        let compression = compression_of(path);
        let (body, identity) = match (compression, decompressor) {
            (Some(compression), Some(d)) => {
                let meta = std::fs::metadata(path).map_err(|e| Error::io(path, "stat", e))?;
                let identity = FileIdentity::of(&meta);
                let bytes = decompressed(d, path, compression, meta.len())?;
                (Body::Mapped(bytes), identity)
            }
            _ => {
                let (data, identity) = open_file(path, options.read.mode)?;
                let body = match data {
                    FileData::Map(map) => Body::Mapped(Bytes::from_owner(Mapping(map))),
                    read => Body::Read(read),
                };
                (body, identity)
            }
        };
        let file_bytes = identity.len();
        let sidecar = options
            .index_dir
            .as_ref()
            .map(|dir| sidecar_path(dir, path, &identity));
        if let Some(cache) = &sidecar
            && let Ok(stored) = std::fs::read(cache)
            && let Ok((index, blank_lines)) = decode_index(&stored, path, &identity, body.len())
        {
            return Ok(LinesFile {
                path: path.to_path_buf(),
                body,
                identity: Some(identity),
                compression,
                file_bytes,
                index,
                blank_lines,
                index_from_file: true,
            });
        }
        let (index, blank_lines) = match &body {
            Body::Mapped(bytes) => scan_lines(path, bytes)?,
            Body::Read(data) => scan_read(path, data)?,
        };
        if let (Some(cache), Some(dir)) = (&sidecar, &options.index_dir) {
            // An index that cannot be written is built again next time: not an error.
            let _ = std::fs::create_dir_all(dir)
                .map_err(|e| Error::io(dir, "create", e))
                .and_then(|()| {
                    write_atomically(
                        cache,
                        &encode_index(&index, blank_lines, path, &identity, body.len()),
                    )
                });
        }
        Ok(LinesFile {
            path: path.to_path_buf(),
            body,
            identity: Some(identity),
            compression,
            file_bytes,
            index,
            blank_lines,
            index_from_file: false,
        })
    }

    fn corrupt_index(&self) -> Error {
        Error::Malformed {
            path: self.path.clone(),
            format: FORMAT,
            what: "its index of lines does not hold together".into(),
        }
    }

    /// Line `i` (of those that are not blank): its bytes (up to the next such line's start:
    /// the blank lines after it included) and where it starts.
    fn line(&self, i: u64) -> Result<(Bytes, u64)> {
        let span = self.index.span(i).ok_or_else(|| self.corrupt_index())?;
        let past = || Error::Malformed {
            path: self.path.clone(),
            format: FORMAT,
            what: format!(
                "line at bytes {}..{} is past the end of its {} bytes: its index does not hold together",
                span.start,
                span.end,
                self.body.len()
            ),
        };
        let len = usize::try_from(span.end - span.start).map_err(|_| past())?;
        let bytes = match &self.body {
            Body::Mapped(b) => {
                if span.end > b.len() as u64 {
                    return Err(past());
                }
                b.slice(span.start as usize..span.end as usize)
            }
            Body::Read(data) => {
                let mut v = vec![0u8; len];
                data.read_at(&self.path, span.start, &mut v)?;
                Bytes::from(v)
            }
        };
        Ok((bytes, span.start))
    }

    /// The number (from 1) of the line that starts at byte `start`: one more than the newlines
    /// before it. Read again for each error, which is the only place it is needed.
    fn line_number(&self, start: u64) -> Result<u64> {
        let count = |b: &[u8]| memchr::memchr_iter(b'\n', b).count() as u64;
        match &self.body {
            Body::Mapped(b) => Ok(1 + count(&b[..(start as usize).min(b.len())])),
            Body::Read(data) => {
                let mut n = 1;
                let mut buf = vec![0u8; 1 << 20];
                let mut at = 0u64;
                while at < start {
                    let len = (start - at).min(buf.len() as u64) as usize;
                    data.read_at(&self.path, at, &mut buf[..len])?;
                    n += count(&buf[..len]);
                    at += len as u64;
                }
                Ok(n)
            }
        }
    }
}

/// `path` (compressed with `compression`, `zip_bytes` bytes) decompressed into the cache by
/// `d`: the copy's bytes.
fn decompressed(
    d: &Decompressor,
    path: &Path,
    compression: Compression,
    zip_bytes: u64,
) -> Result<Bytes> {
    let name = path.file_name().and_then(|n| n.to_str()).ok_or_else(|| {
        Error::config(
            "path",
            format!(
                "{}: a compressed file's name must be UTF-8 text",
                path.display()
            ),
        )
    })?;
    let dir = path.parent().unwrap_or(Path::new(""));
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let store = LocalDir::new(dir);
    // Named by the compressed file's whole path, so that equal names of two directories
    // are two copies.
    let canonical = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let stem = name
        .rsplit_once('.')
        .map_or(name, |(stem, _)| stem)
        .to_string();
    let raw_name = format!(
        "{:016x}-{stem}",
        xxhash_rust::xxh3::xxh3_64(canonical.as_os_str().as_encoded_bytes())
    );
    let bytes = d.open(
        &store,
        &CompressedShard {
            format: FORMAT,
            zip_name: name,
            zip_bytes,
            zip_hashes: &NoHashes,
            raw_name: &raw_name,
            raw_bytes: None,
            raw_hashes: &NoHashes,
            compression,
        },
    )?;
    bytes.share(0..bytes.len())
}

// ---------------------------------------------------------------------------------------
// The index of lines.

/// Lines per block of the index.
const BLOCK: u64 = 64;

/// A UTF-8 byte-order mark.
const BOM: &[u8] = b"\xef\xbb\xbf";

/// Where each line that is not blank starts, packed (see the [module](self)): per block of
/// [`BLOCK`] lines, the first line's start and where the others' offsets from it are in
/// `offsets` (`position << 3 | (width - 1)`, the width in bytes).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct LineIndex {
    blocks: Vec<(u64, u64)>,
    offsets: Vec<u8>,
    lines: u64,
    /// The end of the last line: the data's length.
    end: u64,
}

impl LineIndex {
    /// Where line `i` starts, if there is one.
    fn start(&self, i: u64) -> Option<u64> {
        let (block, j) = (i / BLOCK, i % BLOCK);
        if i >= self.lines {
            return None;
        }
        let &(base, packed) = self.blocks.get(usize::try_from(block).ok()?)?;
        if j == 0 {
            return Some(base);
        }
        let width = (packed & 7) as usize + 1;
        let at = usize::try_from(packed >> 3).ok()? + (j as usize - 1) * width;
        let mut v = [0u8; 8];
        v[..width].copy_from_slice(self.offsets.get(at..at + width)?);
        base.checked_add(u64::from_le_bytes(v))
    }

    /// Line `i`'s bytes: from its start to the next line's (or the end).
    fn span(&self, i: u64) -> Option<Range<u64>> {
        let start = self.start(i)?;
        let end = if i + 1 < self.lines {
            self.start(i + 1)?
        } else {
            self.end
        };
        (start <= end).then_some(start..end)
    }

    /// The memory the index holds.
    fn heap_bytes(&self) -> u64 {
        (self.blocks.capacity() * 16 + self.offsets.capacity()) as u64
    }
}

/// Builds a [`LineIndex`] from line starts in order.
#[derive(Default)]
struct IndexBuilder {
    index: LineIndex,
    block: Vec<u64>,
}

impl IndexBuilder {
    fn push(&mut self, start: u64) {
        self.block.push(start);
        if self.block.len() as u64 == BLOCK {
            self.flush();
        }
    }

    fn flush(&mut self) {
        let Some(&base) = self.block.first() else {
            return;
        };
        let last = self.block.last().map_or(0, |&l| l - base);
        let width = (8 - (last.leading_zeros() / 8) as usize).max(1);
        let position = self.index.offsets.len() as u64;
        self.index
            .blocks
            .push((base, position << 3 | (width as u64 - 1)));
        for &s in &self.block[1..] {
            self.index
                .offsets
                .extend_from_slice(&(s - base).to_le_bytes()[..width]);
        }
        self.index.lines += self.block.len() as u64;
        self.block.clear();
    }

    fn finish(mut self, end: u64) -> LineIndex {
        self.flush();
        self.index.blocks.shrink_to_fit();
        self.index.offsets.shrink_to_fit();
        self.index.end = end;
        self.index
    }
}

/// JSON's whitespace.
fn is_ws(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\n' | b'\r')
}

/// Finds lines in bytes given piece by piece, in order.
struct LineScanner<'p> {
    path: &'p Path,
    builder: IndexBuilder,
    /// Where the current line starts.
    line_start: u64,
    /// Its first byte that is not whitespace, once seen.
    first: Option<(u8, u64)>,
    /// Its number, from 1.
    number: u64,
    blank: u64,
}

impl<'p> LineScanner<'p> {
    fn new(path: &'p Path, start: u64) -> LineScanner<'p> {
        LineScanner {
            path,
            builder: IndexBuilder::default(),
            line_start: start,
            first: None,
            number: 1,
            blank: 0,
        }
    }

    /// The next `piece` of the data, which starts at byte `at`.
    fn feed(&mut self, piece: &[u8], at: u64) -> Result<()> {
        let mut from = 0usize;
        for nl in memchr::memchr_iter(b'\n', piece).chain(std::iter::once(piece.len())) {
            if self.first.is_none()
                && let Some(p) = piece[from..nl].iter().position(|&c| !is_ws(c))
            {
                self.first = Some((piece[from + p], at + (from + p) as u64));
            }
            if nl == piece.len() {
                break;
            }
            self.end_line()?;
            self.line_start = at + nl as u64 + 1;
            from = nl + 1;
        }
        Ok(())
    }

    fn end_line(&mut self) -> Result<()> {
        match self.first.take() {
            None => self.blank += 1,
            Some((b'{', _)) => self.builder.push(self.line_start),
            Some((c, at)) => return Err(self.not_an_object(c, at)),
        }
        self.number += 1;
        Ok(())
    }

    fn not_an_object(&self, c: u8, at: u64) -> Error {
        let what = match c {
            b'[' => "`[`: a JSON array, not JSON lines (one object per line; pandas writes them with to_json(orient=\"records\", lines=True))".to_string(),
            0x1f => "the bytes of a gzip file: name it .jsonl.gz to have it decompressed".to_string(),
            0x28 => "the bytes of a zstd file: name it .jsonl.zst to have it decompressed".to_string(),
            c => format!(
                "`{}`, not `{{`: each line must hold one whole JSON object (a pretty-printed JSON file is not JSON lines)",
                quoted(&[c])
            ),
        };
        Error::BadLine {
            path: self.path.to_path_buf(),
            line: self.number,
            column: Some(at - self.line_start + 1),
            what: format!("starts with {what}"),
        }
    }

    fn finish(mut self, end: u64) -> Result<(LineIndex, u64)> {
        if self.line_start < end || self.first.is_some() {
            self.end_line()?;
        }
        Ok((self.builder.finish(end), self.blank))
    }
}

/// The index of lines of `bytes` (a file named `path`) and its blank lines.
fn scan_lines(path: &Path, bytes: &[u8]) -> Result<(LineIndex, u64)> {
    let start = if bytes.starts_with(BOM) { 3 } else { 0 };
    let mut scanner = LineScanner::new(path, start as u64);
    scanner.feed(&bytes[start..], start as u64)?;
    scanner.finish(bytes.len() as u64)
}

/// The index of lines of a file read with `pread`, a piece at a time.
fn scan_read(path: &Path, data: &FileData) -> Result<(LineIndex, u64)> {
    let len = data.len();
    let mut buf = vec![0u8; 4 << 20];
    let mut at = 0u64;
    let mut scanner = None;
    while at < len {
        let n = (len - at).min(buf.len() as u64) as usize;
        data.read_at(path, at, &mut buf[..n])?;
        let mut piece = &buf[..n];
        let s = scanner.get_or_insert_with(|| {
            let start = if piece.starts_with(BOM) { 3 } else { 0 };
            piece = &piece[start..];
            LineScanner::new(path, start as u64)
        });
        let piece_at = at + (n - piece.len()) as u64;
        s.feed(piece, piece_at)?;
        at += n as u64;
    }
    scanner
        .unwrap_or_else(|| LineScanner::new(path, 0))
        .finish(len)
}

const INDEX_MAGIC: &[u8] = b"GFJSONL1";

fn mtime_nanos(identity: &FileIdentity) -> u64 {
    identity
        .modified()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos() as u64)
}

/// Where the index of the file at `path` (as it is now) is kept in `dir`.
fn sidecar_path(dir: &Path, path: &Path, identity: &FileIdentity) -> PathBuf {
    let canonical = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(canonical.as_os_str().as_encoded_bytes());
    h.update(&identity.len().to_le_bytes());
    h.update(&mtime_nanos(identity).to_le_bytes());
    dir.join(format!("{:032x}.gfjlidx", h.digest128()))
}

/// The index file's bytes: what it was built from (path, size, modification time, the
/// length of the bytes indexed), the index, an xxh3-64 of it all.
fn encode_index(
    index: &LineIndex,
    blank: u64,
    path: &Path,
    identity: &FileIdentity,
    data_len: u64,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(96 + index.blocks.len() * 16 + index.offsets.len());
    out.extend_from_slice(INDEX_MAGIC);
    let p = path.as_os_str().as_encoded_bytes();
    for v in [
        p.len() as u64,
        identity.len(),
        mtime_nanos(identity),
        data_len,
        blank,
        index.lines,
        index.blocks.len() as u64,
        index.offsets.len() as u64,
    ] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.extend_from_slice(p);
    for &(base, packed) in &index.blocks {
        out.extend_from_slice(&base.to_le_bytes());
        out.extend_from_slice(&packed.to_le_bytes());
    }
    out.extend_from_slice(&index.offsets);
    let sum = xxhash_rust::xxh3::xxh3_64(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

/// Reads an index file written by [`encode_index`] for this file; `Err` says why it cannot
/// be trusted (then the index is built again).
fn decode_index(
    bytes: &[u8],
    path: &Path,
    identity: &FileIdentity,
    data_len: u64,
) -> std::result::Result<(LineIndex, u64), &'static str> {
    let (body, sum) = bytes
        .split_last_chunk::<8>()
        .ok_or("too short")
        .map(|(b, s)| (b, u64::from_le_bytes(*s)))?;
    if xxhash_rust::xxh3::xxh3_64(body) != sum {
        return Err("checksum mismatch");
    }
    let rest = body.strip_prefix(INDEX_MAGIC).ok_or("not an index")?;
    let (head, rest) = rest.split_at_checked(64).ok_or("truncated")?;
    let v: Vec<u64> = head
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
        .collect();
    let [plen, size, mtime, len, blank, lines, blocks, offsets] = v[..] else {
        return Err("truncated");
    };
    if size != identity.len() || mtime != mtime_nanos(identity) || len != data_len {
        return Err("the file changed since");
    }
    let (p, rest) = rest
        .split_at_checked(usize::try_from(plen).map_err(|_| "truncated")?)
        .ok_or("truncated")?;
    if p != path.as_os_str().as_encoded_bytes() {
        return Err("written for another file");
    }
    let blocks_len = usize::try_from(blocks)
        .ok()
        .and_then(|b| b.checked_mul(16))
        .ok_or("truncated")?;
    let (b, o) = rest.split_at_checked(blocks_len).ok_or("truncated")?;
    if o.len() as u64 != offsets || blocks != lines.div_ceil(BLOCK) {
        return Err("sizes disagree");
    }
    let index = LineIndex {
        blocks: b
            .chunks_exact(16)
            .map(|c| {
                let (x, y) = c.split_at(8);
                (
                    u64::from_le_bytes(x.try_into().unwrap_or([0; 8])),
                    u64::from_le_bytes(y.try_into().unwrap_or([0; 8])),
                )
            })
            .collect(),
        offsets: o.to_vec(),
        lines,
        end: data_len,
    };
    // Every start inside the bytes, in order, and every block's offsets inside the table.
    let mut last = 0u64;
    for i in 0..lines {
        let s = index.start(i).ok_or("an offset outside the table")?;
        if s < last || s >= data_len {
            return Err("starts out of order or past the end");
        }
        last = s;
    }
    Ok((index, blank))
}

// ---------------------------------------------------------------------------------------
// Parsing.

/// Something wrong at byte `at` of a line.
#[derive(Debug)]
struct Fault {
    at: usize,
    what: String,
}

type Step<T> = std::result::Result<T, Fault>;

/// A position in a line's bytes.
struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

/// A number as written: its text and whether it is an integer (no fraction, no exponent).
struct Number {
    text: Range<usize>,
    int: bool,
}

impl<'a> Cursor<'a> {
    fn new(b: &'a [u8]) -> Cursor<'a> {
        Cursor { b, at: 0 }
    }

    fn fault(&self, what: impl Into<String>) -> Fault {
        Fault {
            at: self.at,
            what: what.into(),
        }
    }

    fn ws(&mut self) {
        while self.b.get(self.at).copied().is_some_and(is_ws) {
            self.at += 1;
        }
    }

    fn peek(&self) -> Option<u8> {
        self.b.get(self.at).copied()
    }

    fn done(&self) -> bool {
        self.at >= self.b.len()
    }

    fn eat(&mut self, c: u8) -> bool {
        if self.peek() == Some(c) {
            self.at += 1;
            true
        } else {
            false
        }
    }

    /// Nothing but the end: after a line's object.
    fn end(&self) -> Step<()> {
        if self.done() {
            Ok(())
        } else {
            Err(self.fault("more after the object's end: each line holds one JSON object, alone"))
        }
    }

    /// The separator after a member of an object: `,` (true) or `}` (false).
    fn after_member(&mut self) -> Step<bool> {
        self.ws();
        match self.peek() {
            Some(b',') => {
                self.at += 1;
                self.ws();
                Ok(true)
            }
            Some(b'}') => {
                self.at += 1;
                Ok(false)
            }
            _ => Err(self.expected("`,` or `}` after a value in an object")),
        }
    }

    /// The separator after an item of a list: `,` (true) or `]` (false).
    fn after_item(&mut self) -> Step<bool> {
        self.ws();
        match self.peek() {
            Some(b',') => {
                self.at += 1;
                self.ws();
                Ok(true)
            }
            Some(b']') => {
                self.at += 1;
                Ok(false)
            }
            _ => Err(self.expected("`,` or `]` after a value in a list")),
        }
    }

    fn expected(&self, what: &str) -> Fault {
        match self.peek() {
            // At the end of the line's text, before its newline (as Python's json counts
            // within one line).
            None => Fault {
                at: self.b.iter().rposition(|&c| !is_ws(c)).map_or(0, |p| p + 1),
                what: format!("the line ends where {what} was expected"),
            },
            Some(c) if c.is_ascii_graphic() => {
                self.fault(format!("expected {what}, found `{}`", c as char))
            }
            Some(c) => self.fault(format!(
                "expected {what}, found `{}`",
                quoted(&self.b[self.at..(self.at + utf8_len(c)).min(self.b.len())])
            )),
        }
    }

    /// A key and its colon; the cursor is at the key's quote. Returns the key's raw bytes
    /// (between the quotes) and whether it has escapes.
    fn key(&mut self) -> Step<(Range<usize>, bool)> {
        if self.peek() != Some(b'"') {
            return Err(self.expected("a key in double quotes"));
        }
        let key = self.string()?;
        self.ws();
        if !self.eat(b':') {
            return Err(self.expected("`:` after a key"));
        }
        self.ws();
        Ok(key)
    }

    /// A string at the cursor (its opening quote): its raw bytes between the quotes and
    /// whether it has escapes (each checked to be one JSON allows).
    fn string(&mut self) -> Step<(Range<usize>, bool)> {
        let open = self.at;
        self.at += 1;
        let start = self.at;
        let mut escaped = false;
        loop {
            let rest = &self.b[self.at..];
            let Some(k) = memchr::memchr2(b'"', b'\\', rest) else {
                return Err(Fault {
                    at: open,
                    what: "a string that does not end on its line".into(),
                });
            };
            if let Some(p) = rest[..k].iter().position(|&c| c < 0x20) {
                self.at += p;
                return Err(self.fault(
                    "a control character in a string (JSON writes it as an escape, \\n or \\u0001)",
                ));
            }
            self.at += k;
            if self.b[self.at] == b'"' {
                self.at += 1;
                return Ok((start..self.at - 1, escaped));
            }
            escaped = true;
            match self.b.get(self.at + 1) {
                Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => self.at += 2,
                Some(b'u') => {
                    let hex = self.b.get(self.at + 2..self.at + 6);
                    if !hex.is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit)) {
                        return Err(self.fault("`\\u` without four hexadecimal digits"));
                    }
                    self.at += 6;
                }
                _ => return Err(self.fault("an escape JSON does not have")),
            }
        }
    }

    /// A number at the cursor, as Python's `json` reads one: JSON's grammar, and `NaN`,
    /// `Infinity`, `-Infinity`.
    fn number(&mut self) -> Step<Number> {
        let start = self.at;
        let rest = &self.b[self.at..];
        for word in [&b"NaN"[..], b"Infinity", b"-Infinity"] {
            if rest.starts_with(word) {
                self.at += word.len();
                return Ok(Number {
                    text: start..self.at,
                    int: false,
                });
            }
        }
        self.eat(b'-');
        let digits = |c: &mut Cursor<'_>| {
            let from = c.at;
            while c.peek().is_some_and(|d| d.is_ascii_digit()) {
                c.at += 1;
            }
            c.at - from
        };
        match self.peek() {
            Some(b'0') => self.at += 1,
            Some(b'1'..=b'9') => {
                digits(self);
            }
            _ => {
                self.at = start;
                return Err(self.expected("a value"));
            }
        }
        let mut int = true;
        let point = self.at;
        if self.eat(b'.') {
            int = false;
            if digits(self) == 0 {
                self.at = point;
                return Err(self.fault("a decimal point without a digit after it"));
            }
        }
        let exponent = self.at;
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.at += 1;
            int = false;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.at += 1;
            }
            if digits(self) == 0 {
                self.at = exponent;
                return Err(self.fault("an exponent without a digit"));
            }
        }
        Ok(Number {
            text: start..self.at,
            int,
        })
    }

    fn literal(&mut self, word: &[u8]) -> Step<()> {
        if self.b[self.at..].starts_with(word) {
            self.at += word.len();
            Ok(())
        } else {
            Err(self.expected("a value"))
        }
    }

    /// Skips the value at the cursor, checking its syntax.
    fn skip(&mut self, depth: usize) -> Step<()> {
        if depth > MAX_DEPTH {
            return Err(self.fault(format!("values nested more than {MAX_DEPTH} deep")));
        }
        match self.peek() {
            Some(b'{') => {
                self.at += 1;
                self.ws();
                if self.eat(b'}') {
                    return Ok(());
                }
                loop {
                    self.key()?;
                    self.skip(depth + 1)?;
                    if !self.after_member()? {
                        return Ok(());
                    }
                }
            }
            Some(b'[') => {
                self.at += 1;
                self.ws();
                if self.eat(b']') {
                    return Ok(());
                }
                loop {
                    self.skip(depth + 1)?;
                    if !self.after_item()? {
                        return Ok(());
                    }
                }
            }
            Some(b'"') => self.string().map(|_| ()),
            Some(b't') => self.literal(b"true"),
            Some(b'f') => self.literal(b"false"),
            Some(b'n') => self.literal(b"null"),
            _ => self.number().map(|_| ()),
        }
    }

    /// What the value at the cursor is, in words, for a message: `a string ("cat")`, `the
    /// float 2.5`, `a list`, ...
    fn describe(&self) -> String {
        let rest = &self.b[self.at..];
        match rest.first() {
            Some(b'"') => {
                let end = memchr::memchr(b'"', &rest[1..]).map_or(rest.len(), |e| e + 1);
                let text = &rest[1..end];
                let cut = if text.len() > 40 { "..." } else { "" };
                format!(
                    "a string (\"{}{cut}\")",
                    quoted(&text[..text.len().min(40)])
                )
            }
            Some(b'{') => "an object".into(),
            Some(b'[') => "a list".into(),
            Some(b't') => "true".into(),
            Some(b'f') => "false".into(),
            Some(b'n') => "null".into(),
            _ => {
                let mut c = Cursor {
                    b: self.b,
                    at: self.at,
                };
                match c.number() {
                    Ok(n) if n.int => format!("the integer {}", quoted(&self.b[n.text])),
                    Ok(n) => format!("the number {}", quoted(&self.b[n.text])),
                    Err(_) => "not a value".into(),
                }
            }
        }
    }
}

/// The length of the UTF-8 character that starts with `c` (1 for a byte that starts none).
fn utf8_len(c: u8) -> usize {
    match c {
        0xf0..=0xf7 => 4,
        0xe0..=0xef => 3,
        0xc0..=0xdf => 2,
        _ => 1,
    }
}

/// The column (in characters, from 1) of byte `at` of `line`.
fn char_column(line: &[u8], at: usize) -> u64 {
    1 + line[..at.min(line.len())]
        .iter()
        .filter(|&&c| (c & 0xc0) != 0x80)
        .count() as u64
}

/// A line must be UTF-8 text, as Python reads a file.
fn check_utf8(line: &[u8]) -> Step<()> {
    std::str::from_utf8(line).map(|_| ()).map_err(|e| Fault {
        at: e.valid_up_to(),
        what: "not UTF-8 text".into(),
    })
}

/// Decodes the escapes of a string's raw bytes (`raw`, checked by [`Cursor::string`], which
/// start at byte `at` of the line) into `out`.
fn unescape(raw: &[u8], at: usize, out: &mut Vec<u8>) -> Step<()> {
    let mut i = 0;
    while i < raw.len() {
        let Some(k) = memchr::memchr(b'\\', &raw[i..]) else {
            out.extend_from_slice(&raw[i..]);
            break;
        };
        out.extend_from_slice(&raw[i..i + k]);
        i += k;
        let c = raw.get(i + 1).copied().unwrap_or(b'\\');
        let simple = match c {
            b'"' => Some(b'"'),
            b'\\' => Some(b'\\'),
            b'/' => Some(b'/'),
            b'b' => Some(0x08),
            b'f' => Some(0x0c),
            b'n' => Some(b'\n'),
            b'r' => Some(b'\r'),
            b't' => Some(b'\t'),
            _ => None,
        };
        if let Some(s) = simple {
            out.push(s);
            i += 2;
            continue;
        }
        let hex = |j: usize| -> Option<u32> {
            let h = raw.get(j..j + 4)?;
            u32::from_str_radix(std::str::from_utf8(h).ok()?, 16).ok()
        };
        let lone = |i: usize| {
            Fault {
            at: at + i,
            what: "a lone surrogate escape (\\ud800 to \\udfff without its pair), which no UTF-8 text can hold".into(),
        }
        };
        let Some(u) = hex(i + 2) else {
            return Err(Fault {
                at: at + i,
                what: "`\\u` without four hexadecimal digits".into(),
            });
        };
        let (code, len) = match u {
            0xd800..=0xdbff => match (raw.get(i + 6..i + 8), hex(i + 8)) {
                (Some(b"\\u"), Some(low @ 0xdc00..=0xdfff)) => {
                    (0x10000 + ((u - 0xd800) << 10) + (low - 0xdc00), 12)
                }
                _ => return Err(lone(i)),
            },
            0xdc00..=0xdfff => return Err(lone(i)),
            u => (u, 6),
        };
        let ch = char::from_u32(code).ok_or_else(|| lone(i))?;
        let mut buf = [0u8; 4];
        out.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
        i += len;
    }
    Ok(())
}

/// Pads `out` to a multiple of `to` bytes (a value's alignment within the decoded bytes).
fn align(out: &mut Vec<u8>, to: usize) {
    if to > 1 {
        let pad = out.len().next_multiple_of(to) - out.len();
        out.resize(out.len() + pad, 0);
    }
}

/// Why a value cannot be a field's.
enum Wrong {
    /// The value at byte `at` is of another type: what it is.
    Type { found: String, at: usize },
    /// The value at byte `at` is of the type, but cannot be held (out of range, another
    /// shape): why.
    Value { why: String, at: usize },
    /// The line's syntax.
    Syntax(Fault),
}

impl Wrong {
    /// The value at the cursor is of another type.
    fn found(c: &Cursor<'_>) -> Wrong {
        Wrong::Type {
            found: c.describe(),
            at: c.at,
        }
    }
}

impl From<Fault> for Wrong {
    fn from(f: Fault) -> Wrong {
        Wrong::Syntax(f)
    }
}

/// The number `n` of the line `b` as `dtype`, appended to `out`.
fn put_number(b: &[u8], n: &Number, dtype: DType, out: &mut Vec<u8>) -> Result<(), Wrong> {
    let text = &b[n.text.clone()];
    let at = n.text.start;
    let float = || -> f64 {
        match text {
            b"NaN" => f64::NAN,
            b"Infinity" => f64::INFINITY,
            b"-Infinity" => f64::NEG_INFINITY,
            // The grammar was checked: ASCII digits, sign, point, exponent, which Rust's
            // correctly rounded parser reads as Python's `float` does.
            t => std::str::from_utf8(t)
                .ok()
                .and_then(|t| t.parse::<f64>().ok())
                .unwrap_or(f64::NAN),
        }
    };
    match dtype {
        DType::F64 => out.extend_from_slice(&float().to_le_bytes()),
        DType::F32 => out.extend_from_slice(&(float() as f32).to_le_bytes()),
        DType::F16 => out.extend_from_slice(&half::f16::from_f64(float()).to_le_bytes()),
        DType::BF16 => out.extend_from_slice(&half::bf16::from_f64(float()).to_le_bytes()),
        DType::Bool => {
            let found = if n.int {
                format!("the integer {}", quoted(text))
            } else {
                format!("the number {}", quoted(text))
            };
            return Err(Wrong::Type { found, at });
        }
        int => {
            if !n.int {
                let found = format!("the number {}", quoted(text));
                return Err(Wrong::Type { found, at });
            }
            let v = parse_int(text);
            let fits = |lo: i128, hi: i128| v.filter(|v| (lo..=hi).contains(v));
            let range = |d: DType| -> (i128, i128) {
                match d {
                    DType::U8 => (0, u8::MAX.into()),
                    DType::I8 => (i8::MIN.into(), i8::MAX.into()),
                    DType::U16 => (0, u16::MAX.into()),
                    DType::I16 => (i16::MIN.into(), i16::MAX.into()),
                    DType::U32 => (0, u32::MAX.into()),
                    DType::I32 => (i32::MIN.into(), i32::MAX.into()),
                    DType::U64 => (0, u64::MAX.into()),
                    _ => (i64::MIN.into(), i64::MAX.into()),
                }
            };
            let (lo, hi) = range(int);
            let Some(v) = fits(lo, hi) else {
                let why = format!("{} does not fit in {int}", quoted(text));
                return Err(Wrong::Value { why, at });
            };
            let le = v.to_le_bytes();
            out.extend_from_slice(&le[..int.size()]);
        }
    }
    Ok(())
}

/// An integer's text (JSON's grammar: a sign, digits) as an `i128`, `None` if it does not fit.
fn parse_int(text: &[u8]) -> Option<i128> {
    let (negative, digits) = match text.split_first() {
        Some((b'-', d)) => (true, d),
        _ => (false, text),
    };
    let mut v: i128 = 0;
    for &d in digits {
        v = v.checked_mul(10)?.checked_add(i128::from(d - b'0'))?;
    }
    Some(if negative { -v } else { v })
}

// ---------------------------------------------------------------------------------------
// Fields: what the first lines show, what is read.

/// What a field's values are read as.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Kind {
    /// Numbers (or bools), nested in lists of this shape.
    Tensor { dtype: DType, shape: Vec<u64> },
    /// A string's text.
    Text,
    /// The value's text as written.
    Json,
    /// A list of numbers (or bools), any count.
    List(DType),
}

impl Kind {
    fn of(decode: &FieldDecode) -> std::result::Result<Kind, String> {
        Ok(match decode {
            FieldDecode::Int => Kind::Tensor {
                dtype: DType::I64,
                shape: Vec::new(),
            },
            FieldDecode::Float => Kind::Tensor {
                dtype: DType::F64,
                shape: Vec::new(),
            },
            FieldDecode::Tensor { dtype, shape } => Kind::Tensor {
                dtype: *dtype,
                shape: shape.clone(),
            },
            FieldDecode::Bytes(Codec::Utf8 | Codec::Raw) => Kind::Text,
            FieldDecode::Bytes(Codec::Json) => Kind::Json,
            FieldDecode::Bytes(Codec::Elements(dtype)) => Kind::List(*dtype),
            other => {
                return Err(format!(
                    "`{other}` is not read from JSON: a string is utf8 or raw, any value's text json, a number int, float or a tensor (f32[], f32[3]), a list of numbers list[i64] (list[f32], ...)"
                ));
            }
        })
    }

    /// The alignment of its decoded values.
    fn align(&self) -> usize {
        match self {
            Kind::Tensor { dtype, .. } | Kind::List(dtype) => dtype.size(),
            Kind::Text | Kind::Json => 1,
        }
    }
}

/// Kinds of value a key held, as bits.
mod seen {
    pub const NULL: u8 = 1;
    pub const BOOL: u8 = 2;
    pub const INT: u8 = 4;
    pub const FLOAT: u8 = 8;
    pub const STR: u8 = 16;
    pub const LIST: u8 = 32;
    pub const OBJECT: u8 = 64;
}

/// What one key (at one place: `a.b`) held in the first lines.
#[derive(Clone, Debug, Default)]
struct Seen {
    /// Its keys from the top, and their name (joined with `.`).
    path: Vec<String>,
    /// The kinds of its values ([`seen`]).
    kinds: u8,
    /// The kinds of the items of its lists.
    items: u8,
    /// Another key of the same name (`a.b` both a key and `b` in `a`).
    ambiguous: bool,
}

/// What the first lines show: every key, in the order first seen.
#[derive(Default)]
struct Inference {
    keys: Vec<Seen>,
    by_name: HashMap<String, usize>,
}

impl Inference {
    fn note(&mut self, path: &[String], kinds: u8, items: u8) {
        let name = path.join(".");
        let k = *self.by_name.entry(name).or_insert_with(|| {
            self.keys.push(Seen {
                path: path.to_vec(),
                ..Seen::default()
            });
            self.keys.len() - 1
        });
        let s = &mut self.keys[k];
        s.kinds |= kinds;
        s.items |= items;
        if s.path != path {
            s.ambiguous = true;
        }
    }

    /// Walks the object at the cursor, noting each key under `path`.
    fn observe_object(
        &mut self,
        c: &mut Cursor<'_>,
        path: &mut Vec<String>,
        depth: usize,
    ) -> Step<()> {
        if depth > MAX_DEPTH {
            return Err(c.fault(format!("values nested more than {MAX_DEPTH} deep")));
        }
        if !c.eat(b'{') {
            return Err(c.expected("`{`"));
        }
        c.ws();
        if c.eat(b'}') {
            return Ok(());
        }
        loop {
            let key_at = c.at;
            let (raw, escaped) = c.key()?;
            let key = if escaped {
                let mut k = Vec::new();
                unescape(&c.b[raw.clone()], raw.start, &mut k)?;
                String::from_utf8(k).map_err(|_| Fault {
                    at: key_at,
                    what: "a key that is not UTF-8 text".into(),
                })?
            } else {
                // The line was checked to be UTF-8; a string's raw bytes end at a quote.
                String::from_utf8_lossy(&c.b[raw]).into_owned()
            };
            path.push(key);
            match c.peek() {
                Some(b'{') => {
                    self.note(path, seen::OBJECT, 0);
                    self.observe_object(c, path, depth + 1)?;
                }
                Some(b'[') => {
                    let items = Self::list_items(c, depth + 1)?;
                    self.note(path, seen::LIST, items);
                }
                _ => {
                    let kind = Self::scalar(c)?;
                    self.note(path, kind, 0);
                }
            }
            path.pop();
            if !c.after_member()? {
                return Ok(());
            }
        }
    }

    /// The kind of the scalar at the cursor, read past it.
    fn scalar(c: &mut Cursor<'_>) -> Step<u8> {
        Ok(match c.peek() {
            Some(b'"') => {
                c.string()?;
                seen::STR
            }
            Some(b't') => {
                c.literal(b"true")?;
                seen::BOOL
            }
            Some(b'f') => {
                c.literal(b"false")?;
                seen::BOOL
            }
            Some(b'n') => {
                c.literal(b"null")?;
                seen::NULL
            }
            _ => {
                if c.number()?.int {
                    seen::INT
                } else {
                    seen::FLOAT
                }
            }
        })
    }

    /// The kinds of the items of the list at the cursor, read past it.
    fn list_items(c: &mut Cursor<'_>, depth: usize) -> Step<u8> {
        c.at += 1;
        c.ws();
        let mut items = 0;
        if c.eat(b']') {
            return Ok(0);
        }
        loop {
            items |= match c.peek() {
                Some(b'{') => {
                    c.skip(depth + 1)?;
                    seen::OBJECT
                }
                Some(b'[') => {
                    c.skip(depth + 1)?;
                    seen::LIST
                }
                _ => Self::scalar(c)?,
            };
            if !c.after_item()? {
                return Ok(items);
            }
        }
    }
}

/// How the values a key held in the first `lines` lines are read, or why they cannot be.
fn decide(s: &Seen, lines: u64) -> std::result::Result<FieldDecode, String> {
    use seen::*;
    if s.ambiguous {
        return Err("a key of this name with a `.` in it and a key of an inner object both have this name: name one of them in fields".into());
    }
    let k = s.kinds & !NULL;
    let words = |bits: u8| -> String {
        let names = [
            (BOOL, "bools"),
            (INT, "integers"),
            (FLOAT, "numbers"),
            (STR, "strings"),
            (LIST, "lists"),
            (OBJECT, "objects"),
            (NULL, "nulls"),
        ];
        let v: Vec<&str> = names
            .iter()
            .filter(|(b, _)| bits & b != 0)
            .map(|(_, n)| *n)
            .collect();
        v.join(" and ")
    };
    match k {
        0 => Err(format!(
            "null in every line of the first {lines} that has it: declare its type"
        )),
        STR => Ok(FieldDecode::Bytes(Codec::Utf8)),
        BOOL => Ok(FieldDecode::Tensor {
            dtype: DType::Bool,
            shape: Vec::new(),
        }),
        INT => Ok(FieldDecode::Int),
        FLOAT => Ok(FieldDecode::Float),
        _ if k == INT | FLOAT => Ok(FieldDecode::Float),
        LIST => {
            let items = s.items;
            let list = |d| Ok(FieldDecode::Bytes(Codec::Elements(d)));
            match items {
                0 => Err(format!(
                    "an empty list in every line of the first {lines}: declare its type (list[i64], say)"
                )),
                INT => list(DType::I64),
                FLOAT => list(DType::F64),
                _ if items == INT | FLOAT => list(DType::F64),
                BOOL => list(DType::Bool),
                _ if items & LIST != 0 && items & !(LIST) == 0 => Err(
                    "lists of lists: declare it a tensor of their shape (f32[2,3], say), or json for its text".into(),
                ),
                _ => Err(format!(
                    "lists of {}: declare it json to read each list's text",
                    words(items)
                )),
            }
        }
        _ => Err(format!(
            "{} in the first {lines} lines: declare its type",
            words(k)
        )),
    }
}

/// A value for the lines where a field is missing or null, decoded once.
#[derive(Clone, Debug)]
struct Fill {
    text: String,
    bytes: Vec<u8>,
    align: usize,
}

/// One field read from each line.
#[derive(Clone, Debug)]
struct PlannedField {
    name: String,
    decode: FieldDecode,
    kind: Kind,
    declared: bool,
    fill: Option<Fill>,
}

/// Where a key leads: a field, or an inner object holding fields.
#[derive(Debug)]
enum Slot {
    Field(usize),
    Object(Node),
}

/// The keys of one object that lead to fields.
#[derive(Debug, Default)]
struct Node {
    keys: Vec<(Box<[u8]>, Slot)>,
}

impl Node {
    fn find(&self, key: &[u8]) -> Option<&Slot> {
        self.keys
            .iter()
            .find(|(k, _)| **k == *key)
            .map(|(_, slot)| slot)
    }

    /// Adds field `k` at `path`; a field inside another is refused.
    fn insert(&mut self, path: &[String], k: usize) -> std::result::Result<(), ()> {
        let Some((first, rest)) = path.split_first() else {
            return Err(());
        };
        let key = first.as_bytes();
        let at = self.keys.iter().position(|(x, _)| **x == *key);
        match (at, rest.is_empty()) {
            (None, true) => self.keys.push((key.into(), Slot::Field(k))),
            (None, false) => {
                let mut node = Node::default();
                node.insert(rest, k)?;
                self.keys.push((key.into(), Slot::Object(node)));
            }
            (Some(i), false) => match &mut self.keys[i].1 {
                Slot::Object(node) => node.insert(rest, k)?,
                Slot::Field(_) => return Err(()),
            },
            (Some(_), true) => return Err(()),
        }
        Ok(())
    }

    /// Every field under this node.
    fn each_field(&self, f: &mut dyn FnMut(usize)) {
        for (_, slot) in &self.keys {
            match slot {
                Slot::Field(k) => f(*k),
                Slot::Object(node) => node.each_field(f),
            }
        }
    }
}

/// What a line gave a field.
#[derive(Clone, Debug)]
enum Got {
    Missing,
    /// `null`, at this byte.
    Null(usize),
    At(FieldSpan),
}

/// The fields read from each line and how.
#[derive(Debug, Default)]
struct Plan {
    fields: Vec<PlannedField>,
    tree: Node,
    /// The decoded bytes a line usually needs.
    decoded_hint: usize,
}

impl Plan {
    /// The fields `options` ask for, from what the first `lines` lines showed; and the keys
    /// left out, with why.
    #[allow(clippy::type_complexity)]
    fn new(
        inference: &Inference,
        lines: u64,
        options: &JsonLinesOptions,
    ) -> Result<(Plan, Vec<(String, String)>)> {
        let name_of = |s: &Seen| s.path.join(".");
        let is_parent = |s: &Seen| s.kinds & !seen::NULL == seen::OBJECT;
        let leaves: Vec<&Seen> = inference.keys.iter().filter(|s| !is_parent(s)).collect();
        let seen_named = |name: &str| inference.by_name.get(name).map(|&k| &inference.keys[k]);
        let under = |parent: &str, s: &Seen| {
            let n = name_of(s);
            n.len() > parent.len() && n.starts_with(parent) && n.as_bytes()[parent.len()] == b'.'
        };
        let declared_parent = |s: &Seen| {
            options
                .decode
                .keys()
                .any(|d| under(d, s) && seen_named(d).is_some_and(is_parent))
        };
        // (name, path, decode, declared)
        let mut chosen: Vec<(String, Vec<String>, FieldDecode, bool)> = Vec::new();
        let mut left_out = Vec::new();
        let path_of = |name: &str| -> Vec<String> {
            match seen_named(name) {
                Some(s) => s.path.clone(),
                None => name.split('.').map(str::to_string).collect(),
            }
        };
        let choose = |name: &str,
                      chosen: &mut Vec<(String, Vec<String>, FieldDecode, bool)>|
         -> Result<()> {
            if let Some(d) = options.decode.get(name) {
                chosen.push((name.to_string(), path_of(name), d.clone(), true));
                return Ok(());
            }
            match seen_named(name) {
                Some(s) if !is_parent(s) => {
                    let d = decide(s, lines)
                        .map_err(|why| Error::config("fields", format!("field `{name}`: {why}")))?;
                    chosen.push((name.to_string(), s.path.clone(), d, false));
                }
                Some(_) => {
                    for s in leaves.iter().filter(|s| under(name, s)) {
                        let n = name_of(s);
                        if options.decode.contains_key(&n) {
                            continue;
                        }
                        let d = decide(s, lines).map_err(|why| {
                            Error::config("fields", format!("field `{n}` (in `{name}`): {why}"))
                        })?;
                        chosen.push((n, s.path.clone(), d, false));
                    }
                    for (n, d) in options.decode.iter().filter(|(n, _)| {
                        n.len() > name.len()
                            && n.starts_with(name)
                            && n.as_bytes()[name.len()] == b'.'
                    }) {
                        chosen.push((n.clone(), path_of(n), d.clone(), true));
                    }
                }
                None => {
                    let mut names: Vec<String> = leaves.iter().map(|s| name_of(s)).collect();
                    names.truncate(32);
                    return Err(Error::config(
                        "fields",
                        format!(
                            "no field `{name}` in the first {lines} lines (their fields: {names:?}); declare its type to read it from later lines"
                        ),
                    ));
                }
            }
            Ok(())
        };
        match &options.fields {
            Some(names) => {
                for name in names {
                    choose(name, &mut chosen)?;
                }
            }
            None => {
                for s in &inference.keys {
                    let name = name_of(s);
                    if options.decode.contains_key(&name) {
                        chosen.push((
                            name.clone(),
                            s.path.clone(),
                            options.decode[&name].clone(),
                            true,
                        ));
                        continue;
                    }
                    if is_parent(s) || declared_parent(s) {
                        continue;
                    }
                    match decide(s, lines) {
                        Ok(d) => chosen.push((name, s.path.clone(), d, false)),
                        Err(why) => left_out.push((name, why)),
                    }
                }
                for (name, d) in &options.decode {
                    if !chosen.iter().any(|c| c.0 == *name) {
                        chosen.push((name.clone(), path_of(name), d.clone(), true));
                    }
                }
                // An empty object in every line: nothing in it to read.
                for s in inference.keys.iter().filter(|s| is_parent(s)) {
                    let name = name_of(s);
                    let has_fields = chosen.iter().any(|c| {
                        c.0 == name || {
                            c.0.len() > name.len()
                                && c.0.starts_with(&name)
                                && c.0.as_bytes()[name.len()] == b'.'
                        }
                    });
                    let has_left_out = left_out
                        .iter()
                        .any(|(n, _)| n.starts_with(&format!("{name}.")));
                    if !has_fields && !has_left_out {
                        left_out.push((
                            name,
                            format!("an empty object in every line of the first {lines}"),
                        ));
                    }
                }
            }
        }
        for (name, _) in &options.decode {
            if !chosen.iter().any(|c| c.0 == *name) {
                return Err(Error::config(
                    "decode",
                    format!("`{name}` is declared but not among the fields read"),
                ));
            }
        }
        if chosen.is_empty() {
            return Err(Error::config(
                "fields",
                format!(
                    "no field to read: the first {lines} lines have none that can be read ({}); declare one",
                    left_out
                        .iter()
                        .map(|(n, why)| format!("`{n}`: {why}"))
                        .collect::<Vec<_>>()
                        .join("; ")
                ),
            ));
        }
        let mut plan = Plan::default();
        for (name, path, decode, declared) in chosen {
            let kind = Kind::of(&decode)
                .map_err(|why| Error::config("decode", format!("field `{name}`: {why}")))?;
            if plan.fields.iter().any(|f| f.name == name) {
                return Err(Error::config(
                    "fields",
                    format!("field `{name}` is asked for twice"),
                ));
            }
            let k = plan.fields.len();
            plan.tree.insert(&path, k).map_err(|()| {
                Error::config(
                    "fields",
                    format!(
                        "field `{name}` is inside another field read (an object read whole as json, say): read one of them"
                    ),
                )
            })?;
            if let Kind::Tensor { dtype, shape } = &kind {
                let n: u64 = shape.iter().product();
                plan.decoded_hint += dtype.size() * n as usize + dtype.size();
            }
            plan.fields.push(PlannedField {
                name,
                decode,
                kind,
                declared,
                fill: None,
            });
        }
        for (name, text) in &options.fill {
            let Some(k) = plan.fields.iter().position(|f| f.name == *name) else {
                return Err(Error::config(
                    "fill",
                    format!("`{name}` has a fill value but is not among the fields read"),
                ));
            };
            let fill = plan.fill(k, text).map_err(|why| {
                Error::config(
                    "fill",
                    format!("the fill value of `{name}` ({text}): {why}"),
                )
            })?;
            plan.fields[k].fill = Some(fill);
        }
        Ok((plan, left_out))
    }

    /// Field `k`'s fill value, from its JSON `text`.
    fn fill(&self, k: usize, text: &str) -> std::result::Result<Fill, String> {
        let b = text.as_bytes();
        check_utf8(b).map_err(|f| f.what)?;
        let mut c = Cursor::new(b);
        c.ws();
        let mut decoded = Vec::new();
        let got = self.value(&mut c, k, &mut decoded, 0).map_err(|f| f.what)?;
        c.ws();
        c.end()
            .map_err(|_| "more than one JSON value".to_string())?;
        let bytes = match got {
            Got::At(FieldSpan::Shared(r)) => b[r].to_vec(),
            Got::At(FieldSpan::Decoded(r)) => decoded[r].to_vec(),
            Got::Null(_) | Got::Missing => return Err("a fill value cannot be null".into()),
        };
        Ok(Fill {
            text: text.to_string(),
            bytes,
            align: self.fields[k].kind.align(),
        })
    }

    /// Reads `line` (one object and whitespace) into `got`, decoded values into `decoded`.
    fn read_line(&self, line: &[u8], got: &mut [Got], decoded: &mut Vec<u8>) -> Step<()> {
        check_utf8(line)?;
        let mut c = Cursor::new(line);
        c.ws();
        if c.peek() != Some(b'{') {
            return Err(c.expected("`{`"));
        }
        self.object(&mut c, &self.tree, got, decoded, 0)?;
        c.ws();
        c.end()
    }

    /// The object at the cursor: its keys that lead to fields read into `got`, the others
    /// skipped.
    fn object(
        &self,
        c: &mut Cursor<'_>,
        node: &Node,
        got: &mut [Got],
        decoded: &mut Vec<u8>,
        depth: usize,
    ) -> Step<()> {
        if depth > MAX_DEPTH {
            return Err(c.fault(format!("values nested more than {MAX_DEPTH} deep")));
        }
        c.at += 1;
        c.ws();
        if c.eat(b'}') {
            return Ok(());
        }
        let mut key_buf = Vec::new();
        loop {
            let (raw, escaped) = c.key()?;
            let key: &[u8] = if escaped {
                key_buf.clear();
                unescape(&c.b[raw.clone()], raw.start, &mut key_buf)?;
                &key_buf
            } else {
                &c.b[raw]
            };
            match node.find(key) {
                None => c.skip(depth + 1)?,
                Some(Slot::Field(k)) => got[*k] = self.value(c, *k, decoded, depth + 1)?,
                Some(Slot::Object(inner)) => {
                    // A repeated key replaces the whole object, as in Python.
                    inner.each_field(&mut |k| got[k] = Got::Missing);
                    match c.peek() {
                        Some(b'{') => self.object(c, inner, got, decoded, depth + 1)?,
                        Some(b'n') => {
                            let at = c.at;
                            c.literal(b"null")?;
                            inner.each_field(&mut |k| got[k] = Got::Null(at));
                        }
                        _ => {
                            let mut names = Vec::new();
                            inner.each_field(&mut |k| names.push(self.fields[k].name.as_str()));
                            return Err(c.fault(format!(
                                "`{}` is {}, not an object holding {names:?}",
                                String::from_utf8_lossy(key),
                                c.describe()
                            )));
                        }
                    }
                }
            }
            if !c.after_member()? {
                return Ok(());
            }
        }
    }

    /// Field `k`'s value at the cursor.
    fn value(
        &self,
        c: &mut Cursor<'_>,
        k: usize,
        decoded: &mut Vec<u8>,
        depth: usize,
    ) -> Step<Got> {
        let field = &self.fields[k];
        let at = c.at;
        let start_at = at;
        if c.peek() == Some(b'n') {
            c.literal(b"null")?;
            return Ok(Got::Null(at));
        }
        let start = decoded.len();
        let read = match &field.kind {
            Kind::Text => {
                if c.peek() != Some(b'"') {
                    Err(Wrong::found(c))
                } else {
                    let (raw, escaped) = c.string()?;
                    if !escaped {
                        return Ok(Got::At(FieldSpan::Shared(raw)));
                    }
                    unescape(&c.b[raw.clone()], raw.start, decoded)?;
                    return Ok(Got::At(FieldSpan::Decoded(start..decoded.len())));
                }
            }
            Kind::Json => {
                c.skip(depth)?;
                return Ok(Got::At(FieldSpan::Shared(at..c.at)));
            }
            Kind::Tensor { dtype, shape } => {
                align(decoded, dtype.size());
                tensor(c, *dtype, shape, decoded)
            }
            Kind::List(dtype) => {
                align(decoded, dtype.size());
                if c.peek() != Some(b'[') {
                    Err(Wrong::found(c))
                } else {
                    list(c, *dtype, decoded)
                }
            }
        };
        match read {
            Ok(()) => {
                let start = start.next_multiple_of(field.kind.align().max(1));
                Ok(Got::At(FieldSpan::Decoded(start..decoded.len())))
            }
            Err(Wrong::Syntax(f)) => Err(f),
            Err(Wrong::Type { found, at }) => {
                let hint = if field.declared {
                    String::new()
                } else {
                    " (as its values in the first lines were): declare its type to read this"
                        .to_string()
                };
                let within = if at == start_at {
                    String::new()
                } else {
                    " in it".to_string()
                };
                Err(Fault {
                    at,
                    what: format!(
                        "`{}` holds {found}{within}; the field is {}{hint}",
                        field.name, field.decode
                    ),
                })
            }
            Err(Wrong::Value { why, at }) => Err(Fault {
                at,
                what: format!("`{}` (the field is {}): {why}", field.name, field.decode),
            }),
        }
    }
}

/// One number (or bool) at the cursor as `dtype`.
fn scalar(c: &mut Cursor<'_>, dtype: DType, out: &mut Vec<u8>) -> Result<(), Wrong> {
    match c.peek() {
        Some(b't' | b'f') if dtype == DType::Bool => {
            let v = c.peek() == Some(b't');
            c.literal(if v { b"true" } else { b"false" })?;
            out.push(u8::from(v));
            Ok(())
        }
        Some(b'-' | b'0'..=b'9' | b'N' | b'I') => {
            let n = c.number()?;
            put_number(c.b, &n, dtype, out)
        }
        _ => Err(Wrong::found(c)),
    }
}

/// Numbers nested in lists of `shape` at the cursor.
fn tensor(c: &mut Cursor<'_>, dtype: DType, shape: &[u64], out: &mut Vec<u8>) -> Result<(), Wrong> {
    let Some((&n, inner)) = shape.split_first() else {
        return scalar(c, dtype, out);
    };
    if c.peek() != Some(b'[') {
        return Err(Wrong::found(c));
    }
    let at = c.at;
    c.at += 1;
    c.ws();
    let mut count = 0u64;
    if !c.eat(b']') {
        loop {
            if count == n {
                let why =
                    format!("a list of more than {n} values where the shape {shape:?} has {n}");
                return Err(Wrong::Value { why, at });
            }
            tensor(c, dtype, inner, out)?;
            count += 1;
            if !c.after_item()? {
                break;
            }
        }
    }
    if count != n {
        let why = format!("a list of {count} values where the shape {shape:?} has {n}");
        return Err(Wrong::Value { why, at });
    }
    Ok(())
}

/// A list of numbers (or bools) at the cursor (at its `[`).
fn list(c: &mut Cursor<'_>, dtype: DType, out: &mut Vec<u8>) -> Result<(), Wrong> {
    c.at += 1;
    c.ws();
    if c.eat(b']') {
        return Ok(());
    }
    loop {
        scalar(c, dtype, out)?;
        if !c.after_item()? {
            return Ok(());
        }
    }
}

// ---------------------------------------------------------------------------------------
// The summary.

/// What a [`JsonLines`] data set is ([`JsonLines::describe`]), as plain data.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct JsonLinesSummary {
    /// Lines (samples) in all files.
    pub lines: u64,
    /// The files' sizes on disk.
    pub file_bytes: u64,
    /// Their sizes decompressed.
    pub bytes: u64,
    /// The memory their indexes of lines hold.
    pub index_bytes: u64,
    /// The lines the fields were inferred from.
    pub inferred_from_lines: u64,
    /// `map` or `pread`.
    pub read_mode: String,
    /// Each file, in order.
    pub files: Vec<JsonLinesFileSummary>,
    /// The fields read, in order, then the keys left out.
    pub fields: Vec<JsonLinesFieldSummary>,
}

/// One file of a [`JsonLinesSummary`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct JsonLinesFileSummary {
    /// The file.
    pub path: PathBuf,
    /// `gzip` or `zstd`, for a compressed file.
    pub compression: Option<String>,
    /// Its size on disk.
    pub file_bytes: u64,
    /// Its size decompressed (its size, if not compressed).
    pub bytes: u64,
    /// Its lines that are not blank (its samples).
    pub lines: u64,
    /// Its blank lines, skipped.
    pub blank_lines: u64,
    /// The memory its index of lines holds.
    pub index_bytes: u64,
    /// True if the index was read from the index directory rather than built.
    pub index_from_file: bool,
}

/// One field (or key left out) of a [`JsonLinesSummary`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct JsonLinesFieldSummary {
    /// Its name (`outer.inner` inside an object).
    pub name: String,
    /// How it is read ([`FieldDecode`]'s words: `int`, `float`, `utf8`, `json`, `bool[]`,
    /// `list[i64]`, `f32[3]`); `None` for a key left out.
    pub decode: Option<String>,
    /// True if declared, false if inferred from the first lines.
    pub declared: bool,
    /// Its fill value (JSON text), if it has one.
    pub fill: Option<String>,
    /// Why it is not read, for a key left out.
    pub left_out: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index_of(starts: &[u64], end: u64) -> LineIndex {
        let mut b = IndexBuilder::default();
        for &s in starts {
            b.push(s);
        }
        b.finish(end)
    }

    #[test]
    fn the_packed_index_gives_back_every_start() {
        // Lines of growing lengths, so that blocks take every width from 1 byte to 4.
        let mut starts = Vec::new();
        let mut at = 0u64;
        for i in 0..1000u64 {
            starts.push(at);
            at += 1 + i * i * 37;
        }
        let index = index_of(&starts, at);
        assert_eq!(index.lines, 1000);
        for (i, &s) in starts.iter().enumerate() {
            assert_eq!(index.start(i as u64), Some(s), "line {i}");
        }
        assert_eq!(index.start(1000), None);
        assert_eq!(index.span(999), Some(starts[999]..at));
        // Short lines take about 2 bytes each; a u64 per line would be 8.
        let short: Vec<u64> = (0..64_000).map(|i| i * 100).collect();
        let index = index_of(&short, 6_400_000);
        let per_line = index.heap_bytes() as f64 / 64_000.0;
        assert!(per_line < 2.3, "{per_line} bytes a line");
    }

    #[test]
    fn the_index_file_round_trips_and_is_refused_when_stale_or_corrupt() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.jsonl");
        std::fs::write(&path, "{}\n{}\n").unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        let identity = FileIdentity::of(&meta);
        let index = index_of(&[0, 3], 6);
        let bytes = encode_index(&index, 2, &path, &identity, 6);
        assert_eq!(decode_index(&bytes, &path, &identity, 6), Ok((index, 2)));
        assert!(decode_index(&bytes, &path, &identity, 7).is_err());
        assert!(decode_index(&bytes, &dir.path().join("b.jsonl"), &identity, 6).is_err());
        for cut in 0..bytes.len() {
            assert!(decode_index(&bytes[..cut], &path, &identity, 6).is_err());
        }
        let mut flipped = bytes.clone();
        flipped[20] ^= 1;
        assert!(decode_index(&flipped, &path, &identity, 6).is_err());
    }

    fn unescaped(s: &str) -> std::result::Result<String, String> {
        let mut out = Vec::new();
        unescape(s.as_bytes(), 0, &mut out).map_err(|f| f.what)?;
        Ok(String::from_utf8(out).unwrap())
    }

    #[test]
    fn escapes_decode_as_pythons_json_decodes_them() {
        assert_eq!(
            unescaped(r#"a\"b\\c\/d\n\t\r\b\f"#).unwrap(),
            "a\"b\\c/d\n\t\r\u{8}\u{c}"
        );
        assert_eq!(unescaped(r"caf\u00e9 \u732b").unwrap(), "café 猫");
        assert_eq!(unescaped(r"\ud83d\ude00!").unwrap(), "😀!");
        for lone in [r"\ud83d", r"\ud83dx", r"\ude00", r"\ud83d\u0041"] {
            assert!(
                unescaped(lone).unwrap_err().contains("lone surrogate"),
                "{lone}"
            );
        }
    }

    #[test]
    fn numbers_follow_jsons_grammar_and_pythons_constants() {
        let read = |t: &str| {
            let mut c = Cursor::new(t.as_bytes());
            c.number().map(|n| (n.text.end, n.int))
        };
        assert_eq!(read("-12,").ok(), Some((3, true)));
        assert_eq!(read("0.5e-3]").ok(), Some((6, false)));
        assert_eq!(read("NaN").ok(), Some((3, false)));
        assert_eq!(read("-Infinity").ok(), Some((9, false)));
        // `01` reads as `0` then a stray `1`, which the caller refuses.
        assert_eq!(read("01").ok(), Some((1, true)));
        for bad in ["-", ".5", "1.", "1e", "+1", "-NaN", "inf"] {
            assert!(read(bad).is_err(), "{bad}");
        }
        let put = |t: &str, d: DType| {
            let mut c = Cursor::new(t.as_bytes());
            let n = c.number().unwrap();
            let mut out = Vec::new();
            put_number(t.as_bytes(), &n, d, &mut out).map(|()| out)
        };
        assert_eq!(put("255", DType::U8).ok(), Some(vec![255]));
        assert!(matches!(put("256", DType::U8), Err(Wrong::Value { .. })));
        assert!(matches!(put("-1", DType::U64), Err(Wrong::Value { .. })));
        assert_eq!(
            put("18446744073709551615", DType::U64).ok(),
            Some(u64::MAX.to_le_bytes().to_vec())
        );
        assert!(matches!(
            put("9223372036854775808", DType::I64),
            Err(Wrong::Value { .. })
        ));
        assert!(matches!(put("1.5", DType::I64), Err(Wrong::Type { .. })));
        assert_eq!(put("3", DType::F64).ok(), Some(3f64.to_le_bytes().to_vec()));
        // Rounded once, to f64, as Python's float reads it; then to f32 as NumPy converts.
        assert_eq!(
            put("0.1", DType::F32).ok(),
            Some((0.1f64 as f32).to_le_bytes().to_vec())
        );
        assert_eq!(
            put("1e400", DType::F64).ok(),
            Some(f64::INFINITY.to_le_bytes().to_vec())
        );
    }

    #[test]
    fn columns_count_characters_as_python_does() {
        let line = "{\"é\": x}".as_bytes();
        // `x` is at byte 7, the 7th character.
        assert_eq!(char_column(line, 7), 7);
        assert_eq!(char_column(line, 0), 1);
    }

    #[test]
    fn names_say_what_a_file_is() {
        let k = |n: &str| name_kind(n).map(|k| (k.certain, k.compression));
        assert_eq!(k("train.jsonl"), Some((true, None)));
        assert_eq!(k("train.JSONL.GZ"), Some((true, Some(Compression::Gzip))));
        assert_eq!(k("x.ndjson.zst"), Some((true, Some(Compression::Zstd))));
        assert_eq!(k("data.json"), Some((false, None)));
        assert_eq!(k("data.json.zstd"), Some((false, Some(Compression::Zstd))));
        assert_eq!(k("data.parquet"), None);
        assert_eq!(k("jsonl"), None);
    }
}
