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
//! 8.13 at most ([`JsonLinesSummary::index_bytes`]; a `u64` per line would be 8). With
//! [`JsonLinesOptions::index_dir`] set, the index is written there and read again at the next
//! open instead of being built, while the file's path, size and modification time are those
//! it was built from. [`Dataset::get`] parses the one line asked for: it walks its object once,
//! matches each key against the fields asked for, reads their values and checks the syntax of
//! the others without keeping them. A string without escapes (and a `json` field's text) is
//! handed out in place, in the mapping; numbers, lists and strings with escapes are decoded
//! into the sample's own bytes.
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
//!
//! # Parts
//!
//! This module: the options, the files a target names, the data set and its summary;
//! `index`: the index of lines and its file; `parse`: the reading of one line's bytes;
//! `fields`: which fields are read and how, and the walk of a line that reads them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use rayon::prelude::*;
use serde::Serialize;

mod fields;
mod index;
mod parse;

use fields::{Got, Inference, LeftOut, Plan};
use index::{BOM, LineIndex, decode_index, encode_index, scan_lines, scan_read, sidecar_path};
use parse::{Cursor, align, char_column, is_ws};

use super::files::dataset_files;
use crate::error::{Error, Result};
use crate::file::{FileData, FileIdentity, ReadMode, open_file};
use crate::format::{Codec, ReadOptions, Schema};
use crate::source::shards::FieldDecode;
use crate::source::shards::cache::{DEFAULT_LIMIT, default_root, settings_from_env};
use crate::source::shards::compressed::{CompressedShard, Compression, Decompressor, NoHashes};
use crate::source::shards::{LocalDir, ShardBytes, write_atomically};
use crate::source::{Dataset, FieldSpan, Sample};

/// The format's name in messages.
const FORMAT: &str = "JSON lines";

/// The most bytes of decoded values a line is given room for before it reads them (the most
/// any line has needed so far, within this): more than a line needs costs an allocation of
/// that size for every line.
const MOST_DECODED_HINT: usize = 4096;

/// Lines read to infer the fields unless told otherwise.
pub const DEFAULT_INFER_LINES: usize = 1000;

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
    /// cache's default ([`default_cache_dir`](crate::source::shards::default_cache_dir)`/objects`).
    pub cache_dir: Option<PathBuf>,
    /// The most bytes that cache directory holds (everything in it together); `None`:
    /// `$GPUFEED_CACHE_LIMIT`, else 64 GiB.
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
    const MOST: u64 = 64 << 10;
    let Ok(file) = ShardBytes::map_file(path) else {
        return false;
    };
    let Ok(bytes) = file.all() else {
        return false;
    };
    // The first 64 KiB hold all of the file, or lines up to a cut.
    let (head, whole) = match compression {
        None => {
            let n = bytes.len().min(MOST as usize);
            (bytes[..n].to_vec(), n == bytes.len())
        }
        // Decompressed as far as the first 64 KiB of output (the pages of the mapping
        // beyond what that takes are never read).
        Some(c) => {
            let mut head = Vec::new();
            let whole = c.decompress(bytes, &mut head, MOST).is_ok();
            (head, whole)
        }
    };
    let head = head.strip_prefix(BOM).unwrap_or(&head);
    let mut lines = head.split(|&c| c == b'\n');
    let Some(line) = lines.find(|l| l.iter().any(|c| !is_ws(*c))) else {
        return false;
    };
    let mut c = Cursor::new(line);
    c.ws();
    if c.peek() != Some(b'{') {
        return false;
    }
    // A first line longer than what was read: an object so far is all that can be known.
    let cut = !whole && lines.next().is_none();
    cut || (c.skip(0).is_ok() && {
        c.ws();
        c.done()
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
    left_out: LeftOut,
    /// Lines the fields were inferred from.
    inferred_from: u64,
    mode: ReadMode,
    /// The decoded bytes a line is given room for (see [`MOST_DECODED_HINT`]), shared by the
    /// threads that read: written only when a line needs more.
    decoded_hint: AtomicUsize,
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
        JsonLines::open_files(&list_files(target.as_ref())?, options)
    }

    /// Opens the files `paths` as one data set, in this order (each plain or compressed, as
    /// its name says).
    pub fn open_files(paths: &[PathBuf], options: &JsonLinesOptions) -> Result<JsonLines> {
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
            decoded_hint: AtomicUsize::new(0),
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
                c.ws();
                let mut path = Vec::new();
                let step = inference
                    .observe_object(&mut c, &mut path, 0)
                    .and_then(|()| {
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
        let hint = self.decoded_hint.load(Ordering::Relaxed);
        let mut decoded = Vec::with_capacity(hint);
        if let Err(fault) = self.plan.read_line(&line, &mut got, &mut decoded) {
            return Err(self.bad_line(f, start, &line, Some(fault.at), fault.what));
        }
        if decoded.len() > hint && hint < MOST_DECODED_HINT {
            self.decoded_hint
                .fetch_max(decoded.len().min(MOST_DECODED_HINT), Ordering::Relaxed);
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

/// A file's compression: as its name says (`.gz`, `.zst`), else, for a name that says
/// nothing of JSON (a file in the object store's cache, `name~tag`), as its first bytes say
/// (gzip's `1f 8b`, zstd's `28 b5 2f fd`).
fn compression_of(path: &Path) -> Option<Compression> {
    let name = path.file_name().and_then(|n| n.to_str());
    if let Some(kind) = name.and_then(name_kind) {
        return kind.compression;
    }
    let mut head = [0u8; 4];
    let n = std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read(&mut f, &mut head))
        .unwrap_or(0);
    match &head[..n] {
        [0x1f, 0x8b, ..] => Some(Compression::Gzip),
        [0x28, 0xb5, 0x2f, 0xfd] => Some(Compression::Zstd),
        _ => None,
    }
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

impl crate::source::Source for JsonLines {
    fn format(&self) -> crate::source::Format {
        crate::source::Format::JsonLines
    }

    fn describe(&self) -> Result<crate::source::Description> {
        Ok(JsonLines::describe(self).description(&self.schema))
    }
}

impl JsonLinesSummary {
    /// The summary as `gpufeed inspect` prints it: the files and their sizes (on disk and
    /// decompressed), the index of lines, and each field with how it is read (or each key
    /// left out, and why).
    pub fn description(&self, schema: &Schema) -> crate::source::Description {
        use crate::source::{Description, Format};
        let files = serde_json::to_value(&self.files).unwrap_or_default();
        let (first, last) = (self.files.first(), self.files.last());
        let name = |f: Option<&JsonLinesFileSummary>| {
            f.map_or(String::new(), |f| f.path.display().to_string())
        };
        let file_text = if self.files.len() == 1 {
            format!("1 ({})", name(first))
        } else {
            format!("{} ({} .. {})", self.files.len(), name(first), name(last))
        };
        let field_text: Vec<String> = self
            .fields
            .iter()
            .map(|f| match (&f.decode, &f.left_out) {
                (_, Some(why)) => format!("{}: left out: {why}", f.name),
                (Some(decode), None) => {
                    let how = if f.declared { "declared" } else { "inferred" };
                    match &f.fill {
                        Some(fill) => format!("{} -> {decode} ({how}; null: {fill})", f.name),
                        None => format!("{} -> {decode} ({how})", f.name),
                    }
                }
                (None, None) => f.name.clone(),
            })
            .collect();
        let json_fields = serde_json::to_value(&self.fields).unwrap_or_default();
        Description::new("", Format::JsonLines, self.lines, schema.clone())
            .fact("files", "files", files, file_text)
            .count("file_bytes", "file bytes", self.file_bytes)
            .count("bytes", "decompressed", self.bytes)
            .count("index_bytes", "index bytes", self.index_bytes)
            .count(
                "inferred_from_lines",
                "inferred from",
                self.inferred_from_lines,
            )
            .fact(
                "read_mode",
                "read mode",
                self.read_mode.clone(),
                self.read_mode.clone(),
            )
            .fact("keys", "keys", json_fields, field_text.join("\n"))
    }
}

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
