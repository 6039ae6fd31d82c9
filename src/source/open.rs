//! The front door: what a user names (a file, a directory, a pattern, a URL) and how to read
//! it, to the data set it is. The command, its bench and the Python package open data through
//! [`open`] and nothing else.
//!
//! What a name is, is decided once, by [`detect`], from one table: each row is a [`Format`],
//! what it looks for, and how it is opened. A row looks only at what was seen of the name, once
//! (the kind of name, a file's first bytes, a directory's entries), so the order of the rows
//! is the whole of the rule; the first row that recognises the name wins. When no row does,
//! the error lists what every row looked for.
//!
//! The rows, in order, are listed in [`detect`]'s documentation.
//!
//! A new format is a module that opens it and one row here.

use std::path::{Path, PathBuf};

use super::describe::Format;
use super::shards;
use super::shards::webdataset::WebDatasetOptions;
use super::table::{self, Fill, JsonLinesOptions, TableOptions};
use super::{ImageFolder, NpyArray, Source, npy};
use crate::error::{Error, Result};
use crate::format::{ReadMode, ReadOptions, RecordFile};
use crate::source::tokens::IndexedTokens;

/// How to read what [`open`] opens. The default maps files, checks what every open checks,
/// and takes the cache's and the object store's settings from the environment.
#[derive(Clone, Debug, Default)]
pub struct OpenOptions {
    /// How single files are read (a mapping or `pread`) and whether every record's checksum
    /// is checked as it is read; `verify_checksums` also turns on
    /// [`ShardOptions::verify`](super::shards::ShardOptions::verify)
    /// (every shard checked against its index whenever it is opened).
    ///
    /// Formats read whole or mapped by their store (ImageFolder, shards) refuse
    /// [`ReadMode::Pread`] rather than ignore it.
    pub read: ReadOptions,
    /// Settings of sharded data sets (open shards, checks, declared fields) and, for
    /// WebDataset, its key rules.
    pub shards: WebDatasetOptions,
    /// Where compressed shards and files are decompressed to and downloaded shards are kept;
    /// `None`: `$GPUFEED_CACHE_DIR`, else the default cache directory.
    pub cache_dir: Option<PathBuf>,
    /// The most bytes that cache holds; `None`: `$GPUFEED_CACHE_LIMIT`, else the default.
    pub cache_limit: Option<u64>,
    /// How tables (Parquet, Arrow, JSON lines) are read: the columns, fill values for nulls,
    /// chunks and window, the split of a `DatasetDict`. Its read mode is [`OpenOptions::read`]'s.
    pub table: TableOptions,
}

impl OpenOptions {
    /// Options that read files as `read` says (a [`ReadMode`] or [`ReadOptions`]).
    pub fn read(read: impl Into<ReadOptions>) -> OpenOptions {
        OpenOptions {
            read: read.into(),
            ..OpenOptions::default()
        }
    }

    /// The sharded formats' settings: `shards`, with the checks and the cache asked for here.
    fn shard_options(&self) -> WebDatasetOptions {
        let mut o = self.shards.clone();
        o.shards.verify |= self.read.verify_checksums;
        if self.cache_dir.is_some() {
            o.shards.cache_dir.clone_from(&self.cache_dir);
        }
        if self.cache_limit.is_some() {
            o.shards.cache_limit = self.cache_limit;
        }
        o
    }

    /// The tables' settings, read as `read` says.
    fn table_options(&self) -> TableOptions {
        TableOptions {
            read_mode: self.read.mode,
            ..self.table.clone()
        }
    }

    /// The JSON lines settings: the tables' fields, declared types and fill values (as JSON:
    /// a number, or a string for bytes), read as `read` says, decompressed into the cache.
    fn json_lines_options(&self) -> Result<JsonLinesOptions> {
        let t = &self.table;
        let mut fill = std::collections::BTreeMap::new();
        for (name, value) in &t.fill {
            let text = match value {
                Fill::Int(i) => i.to_string(),
                Fill::Float(f) => serde_json::Number::from_f64(*f)
                    .map(|n| n.to_string())
                    .ok_or_else(|| {
                        Error::config(
                            "fill",
                            format!("the fill value of `{name}` is {f}: JSON has no such number"),
                        )
                    })?,
                Fill::Bytes(b) => {
                    let text = std::str::from_utf8(b).map_err(|_| {
                        Error::config(
                            "fill",
                            format!("the fill value of `{name}` is not text: JSON lines hold text"),
                        )
                    })?;
                    serde_json::Value::from(text).to_string()
                }
            };
            fill.insert(name.clone(), text);
        }
        Ok(JsonLinesOptions {
            fields: t.columns.clone(),
            decode: t.decode.clone(),
            fill,
            read: ReadOptions {
                verify_checksums: false,
                ..self.read
            },
            cache_dir: self.cache_dir.clone(),
            cache_limit: self.cache_limit,
            index_dir: t.index_dir.clone(),
            ..JsonLinesOptions::default()
        })
    }

    /// Refuses `pread` for a format that never reads through it: `what` says how it is read.
    fn refuse_pread(&self, what: &str) -> Result<()> {
        match self.read.mode {
            ReadMode::Map => Ok(()),
            ReadMode::Pread => Err(Error::config(
                "read_mode",
                format!("pread applies to files gpufeed reads itself; {what}"),
            )),
        }
    }
}

/// Opens the object store URL `url` with the store's settings from the environment and the
/// cache asked for in `o`.
#[cfg(feature = "remote")]
fn open_url(url: &str, o: &OpenOptions) -> Result<Box<dyn Source>> {
    let remote = remote_options(o)?;
    match shards::remote::open_url_with(url, &o.shard_options(), remote) {
        Ok(d) => sharded(d),
        // No index and no tar objects under the URL: the tables there, if any.
        Err(
            e @ Error::Remote {
                kind: crate::error::RemoteErrorKind::NotFound,
                ..
            },
        ) => match open_table_url(url, None, o)? {
            Some(table) => Ok(table),
            None => Err(e),
        },
        Err(e) => Err(e),
    }
}

/// The store's settings from the environment, with the cache asked for in `o`.
#[cfg(feature = "remote")]
fn remote_options(o: &OpenOptions) -> Result<shards::remote::RemoteOptions> {
    let mut remote = shards::remote::RemoteOptions::from_env()?;
    if let Some(dir) = &o.cache_dir {
        remote.cache_dir = Some(dir.clone());
    }
    if let Some(limit) = o.cache_limit {
        remote.cache_limit = limit;
    }
    Ok(remote)
}

/// The format of a table file by its name, for names in object storage (where no first
/// bytes are at hand): `.parquet`, `.arrow`, JSON lines' names (plain, `.gz`, `.zst`).
fn table_format_of(name: &str) -> Option<Format> {
    let lower = name.to_ascii_lowercase();
    let stem = [".gz", ".zst", ".zstd"]
        .iter()
        .find_map(|c| lower.strip_suffix(c))
        .unwrap_or(&lower);
    if lower.ends_with(".parquet") {
        Some(Format::Parquet)
    } else if lower.ends_with(".arrow") {
        Some(Format::Arrow)
    } else if [".jsonl", ".ndjson", ".json"]
        .iter()
        .any(|s| stem.ends_with(s))
    {
        Some(Format::JsonLines)
    } else {
        None
    }
}

/// The table an object store URL names by its last component (`.../train-00000.parquet`, or
/// a pattern `.../train-*.parquet`, `.../*.jsonl*`), if it names one.
fn url_table_format(url: &str) -> Option<Format> {
    let last = url.trim_end_matches('/').rsplit('/').next()?;
    table_format_of(last.trim_end_matches(['*', '?']))
}

/// Opens the table files at the object store URL `url`: the object it names, the objects
/// matching the pattern its last component is, or (`format` `None`: a prefix) the table files
/// directly under it, all of one format. Each file is fetched whole into the cache, once per
/// machine (processes sharing the cache wait for one another's fetch), several at a time,
/// before the data set opens: a table's rows are counted from every file's footer or lines.
/// `None` when a prefix holds no table file.
#[cfg(feature = "remote")]
fn open_table_url(
    url: &str,
    format: Option<Format>,
    o: &OpenOptions,
) -> Result<Option<Box<dyn Source>>> {
    use shards::ShardStore;
    let trimmed = url.trim_end_matches('/');
    let (dir, names) = match format {
        Some(_) => {
            let (dir, last) = trimmed.rsplit_once('/').unwrap_or(("", trimmed));
            let store = shards::remote::RemoteStore::new(dir, remote_options(o)?)?;
            let names = if table::files::is_pattern(last) {
                store
                    .list("")?
                    .into_iter()
                    .filter(|n| !n.contains('/') && table::files::name_matches(last, n))
                    .collect()
            } else {
                vec![last.to_owned()]
            };
            (store, names)
        }
        None => {
            let store = shards::remote::RemoteStore::new(trimmed, remote_options(o)?)?;
            let names: Vec<String> = store
                .list("")?
                .into_iter()
                .filter(|n| !n.contains('/') && table_format_of(n).is_some())
                .collect();
            (store, names)
        }
    };
    let Some(first) = names.first() else {
        return match format {
            Some(_) => Err(Error::Remote {
                shard: PathBuf::from(trimmed),
                kind: crate::error::RemoteErrorKind::NotFound,
                what: "no object matches this pattern".into(),
            }),
            None => Ok(None),
        };
    };
    let kind = table_format_of(first).unwrap_or(Format::Parquet);
    if let Some(other) = names.iter().find(|n| table_format_of(n) != Some(kind)) {
        return Err(Error::config(
            "path",
            format!(
                "{trimmed}: holds {} and {}: name the files of one format (a pattern such as \
                 `*.parquet`)",
                first, other
            ),
        ));
    }
    // Fetched several at a time; the first error wins.
    let slots: Vec<std::sync::Mutex<Option<Result<PathBuf>>>> =
        names.iter().map(|_| std::sync::Mutex::new(None)).collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..names.len().min(8) {
            scope.spawn(|| {
                loop {
                    let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(name) = names.get(k) else { break };
                    let got = dir.local_file(name);
                    if let Ok(mut slot) = slots[k].lock() {
                        *slot = Some(got);
                    }
                }
            });
        }
    });
    let files = slots
        .into_iter()
        .map(|slot| {
            slot.into_inner()
                .ok()
                .flatten()
                .unwrap_or_else(|| Err(Error::user("a fetch of a table file stopped")))
        })
        .collect::<Result<Vec<PathBuf>>>()?;
    let table = o.table_options();
    Ok(Some(match kind {
        Format::Arrow => Box::new(table::arrow::ArrowDataset::open_files(&files, &table)?),
        Format::JsonLines => Box::new(table::JsonLines::open_files(
            &files,
            &o.json_lines_options()?,
        )?),
        _ => Box::new(table::parquet::ParquetDataset::open_files(&files, &table)?),
    }))
}

#[cfg(not(feature = "remote"))]
fn open_table_url(
    url: &str,
    _: Option<Format>,
    o: &OpenOptions,
) -> Result<Option<Box<dyn Source>>> {
    open_url(url, o).map(Some)
}

#[cfg(not(feature = "remote"))]
fn open_url(url: &str, _: &OpenOptions) -> Result<Box<dyn Source>> {
    Err(Error::Remote {
        shard: url.into(),
        kind: crate::error::RemoteErrorKind::Config,
        what: format!(
            "this build of gpufeed reads no object store: {}",
            shards::NO_STORE_ADVICE
        ),
    })
}

/// What was seen of a name, once, for the rows of the table to look at.
#[derive(Debug)]
pub(crate) struct Seen {
    /// The name as given.
    pub(crate) name: String,
    kind: Kind,
}

#[derive(Debug)]
enum Kind {
    /// `scheme://...`.
    Url,
    /// A brace pattern (`{000..009}`) or a `::` list.
    Pattern,
    /// A file name with `*` or `?` (`data/train-*.parquet`).
    Glob,
    /// A directory and the names of its entries (files and directories apart).
    Dir {
        files: Vec<String>,
        dirs: Vec<String>,
    },
    /// A regular file and its first bytes.
    File { head: Vec<u8> },
    /// Something else that exists (a FIFO, a device): never opened.
    Special,
    /// Nothing by this name.
    Missing,
}

impl Seen {
    /// Looks at `name`: its kind, a file's first 16 bytes, a directory's entries.
    pub(crate) fn of(name: &str) -> Result<Seen> {
        let kind = if shards::is_store_url(name) {
            Kind::Url
        } else if name.contains("::") || name.contains('{') {
            Kind::Pattern
        } else if Path::new(name)
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.contains(['*', '?']))
        {
            Kind::Glob
        } else {
            let path = Path::new(name);
            match std::fs::metadata(path) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Kind::Missing,
                Err(e) => return Err(Error::io(path, "look at", e)),
                Ok(m) if m.is_dir() => {
                    let (mut files, mut dirs) = (Vec::new(), Vec::new());
                    let entries =
                        std::fs::read_dir(path).map_err(|e| Error::io(path, "list", e))?;
                    for entry in entries {
                        let entry = entry.map_err(|e| Error::io(path, "list", e))?;
                        let name = entry.file_name().to_string_lossy().into_owned();
                        // Follows links, as opening them will.
                        match std::fs::metadata(entry.path()) {
                            Ok(m) if m.is_dir() => dirs.push(name),
                            Ok(m) if m.is_file() => files.push(name),
                            _ => {}
                        }
                    }
                    files.sort();
                    dirs.sort();
                    Kind::Dir { files, dirs }
                }
                Ok(m) if m.is_file() => Kind::File {
                    head: head(path, 16)?,
                },
                Ok(_) => Kind::Special,
            }
        };
        Ok(Seen {
            name: name.to_owned(),
            kind,
        })
    }

    fn path(&self) -> &Path {
        Path::new(&self.name)
    }

    fn file_starts_with(&self, magic: &[u8]) -> bool {
        matches!(&self.kind, Kind::File { head } if head.starts_with(magic))
    }

    /// A file, a directory's files or a glob's name ending with `suffix`.
    fn names_end_with(&self, suffix: &str) -> bool {
        match &self.kind {
            Kind::File { .. } | Kind::Glob => self.name.ends_with(suffix),
            Kind::Dir { files, .. } => files.iter().any(|f| f.ends_with(suffix)),
            _ => false,
        }
    }

    fn dir_has_file(&self, name: &str) -> bool {
        matches!(&self.kind, Kind::Dir { files, .. } if files.iter().any(|f| f == name))
    }

    fn dir_has_files_ending(&self, suffix: &str) -> bool {
        matches!(&self.kind, Kind::Dir { files, .. } if files.iter().any(|f| f.ends_with(suffix)))
    }
}

/// The first `n` bytes of the file at `path` (fewer if it is shorter).
fn head(path: &Path, n: usize) -> Result<Vec<u8>> {
    use std::io::Read;
    let f = std::fs::File::open(path).map_err(|e| Error::io(path, "open", e))?;
    let mut out = Vec::with_capacity(n);
    f.take(n as u64)
        .read_to_end(&mut out)
        .map_err(|e| Error::io(path, "read", e))?;
    Ok(out)
}

/// One row of the table: a format, what it looks for (for the error when nothing matches),
/// whether a name is of it, and how it is opened.
struct Row {
    format: Format,
    looks_for: &'static str,
    recognise: fn(&Seen) -> bool,
    open: fn(&Seen, &OpenOptions) -> Result<Box<dyn Source>>,
}

/// The table, in the order the rows are tried.
const ROWS: &[Row] = &[
    Row {
        format: Format::Parquet,
        looks_for: "Parquet, Arrow or JSON lines files at an object store URL (one file, or a * pattern)",
        recognise: |s| matches!(s.kind, Kind::Url) && url_table_format(&s.name).is_some(),
        open: |s, o| {
            let format = url_table_format(&s.name);
            open_table_url(&s.name, format, o)?.ok_or_else(|| Error::Remote {
                shard: PathBuf::from(&s.name),
                kind: crate::error::RemoteErrorKind::NotFound,
                what: "no table file here".into(),
            })
        },
    },
    Row {
        format: Format::WebDataset,
        looks_for: "shards at an object store URL (s3://, gs://, az://, http(s)://, file://)",
        recognise: |s| matches!(s.kind, Kind::Url),
        open: |s, o| {
            o.refuse_pread("an object store's shards are downloaded whole and mapped")?;
            open_url(&s.name, o)
        },
    },
    Row {
        format: Format::WebDataset,
        looks_for: "WebDataset .tar shards named by a brace pattern or a `::` list",
        recognise: |s| matches!(s.kind, Kind::Pattern),
        open: |s, o| {
            o.refuse_pread("a sharded data set's shards are mapped by its store")?;
            sharded(shards::open_pattern(&s.name, &o.shard_options())?)
        },
    },
    Row {
        format: Format::PackedShards,
        looks_for: "packed shards or MDS shards (a directory with an index.json)",
        recognise: |s| s.dir_has_file("index.json"),
        open: |s, o| {
            o.refuse_pread("a sharded data set's shards are mapped by its store")?;
            sharded(shards::open_index_dir(s.path(), &o.shard_options())?)
        },
    },
    Row {
        format: Format::WebDataset,
        looks_for: "WebDataset .tar shards (a .tar file, or a directory of them)",
        recognise: |s| {
            (matches!(s.kind, Kind::File { .. }) && s.name.ends_with(".tar"))
                || s.dir_has_files_ending(".tar")
        },
        open: |s, o| {
            o.refuse_pread("a sharded data set's shards are mapped by its store")?;
            let options = o.shard_options();
            sharded(match s.kind {
                Kind::Dir { .. } => shards::open_tar_dir(s.path(), &options)?,
                _ => shards::open_tars_named(vec![s.path().to_path_buf()], &options)?,
            })
        },
    },
    Row {
        format: Format::Arrow,
        looks_for: "Arrow files of Hugging Face datasets (a directory with state.json, \
                    dataset_info.json or dataset_dict.json; .arrow files; a file starting ARROW1)",
        recognise: |s| {
            ["state.json", "dataset_info.json", "dataset_dict.json"]
                .iter()
                .any(|f| s.dir_has_file(f))
                || s.names_end_with(".arrow")
                || s.file_starts_with(b"ARROW1")
                || s.file_starts_with(&table::arrow::CONTINUATION.to_le_bytes())
        },
        open: |s, o| Ok(Box::new(table::arrow::open(s.path(), &o.table_options())?)),
    },
    Row {
        format: Format::Parquet,
        looks_for: "Parquet files (.parquet, or a file starting PAR1; a directory or a * pattern of them)",
        recognise: |s| s.names_end_with(".parquet") || s.file_starts_with(b"PAR1"),
        open: |s, o| {
            Ok(Box::new(table::parquet::open(
                s.path(),
                &o.table_options(),
            )?))
        },
    },
    Row {
        format: Format::JsonLines,
        looks_for: "JSON lines (.jsonl or .ndjson, plain, .gz or .zst; a .json file of one object \
                    a line; a directory or a * pattern of them)",
        recognise: |s| {
            matches!(s.kind, Kind::File { .. } | Kind::Glob | Kind::Dir { .. })
                && table::jsonl::is_json_lines(s.path())
        },
        open: |s, o| {
            if o.read.verify_checksums {
                return Err(Error::config(
                    "verify_checksums",
                    format!(
                        "{} is JSON lines, which have no checksums to verify",
                        s.name
                    ),
                ));
            }
            Ok(Box::new(table::JsonLines::open(
                s.path(),
                &o.json_lines_options()?,
            )?))
        },
    },
    Row {
        format: Format::MegatronTokens,
        looks_for: "a Megatron indexed dataset of tokens (PREFIX.idx and PREFIX.bin)",
        recognise: |s| megatron_index(s).is_some(),
        open: |s, _| {
            Err(Error::config(
                "path",
                format!(
                    "{} is a Megatron indexed dataset of tokens: read it with the token loader \
                     (gpufeed bench --tokens {}; Python gpufeed.TokenLoader)",
                    s.name, s.name
                ),
            ))
        },
    },
    Row {
        format: Format::Npy,
        looks_for: "a .npy array (a file starting \\x93NUMPY)",
        recognise: |s| s.file_starts_with(npy::NPY_MAGIC),
        open: |s, o| {
            Ok(Box::new(NpyArray::open_with(
                s.path(),
                NpyArray::FIELD,
                o.read,
            )?))
        },
    },
    Row {
        format: Format::Packed,
        looks_for: "a packed record file (a file starting GPUFEED)",
        recognise: |s| s.file_starts_with(&crate::format::MAGIC),
        open: |s, o| Ok(Box::new(RecordFile::open_with(s.path(), o.read)?)),
    },
    Row {
        format: Format::ImageFolder,
        looks_for: "an ImageFolder (a directory of class directories of JPEG/PNG files)",
        recognise: |s| matches!(&s.kind, Kind::Dir { dirs, .. } if !dirs.is_empty()),
        open: |s, o| {
            o.refuse_pread("an ImageFolder's images are read whole, never mapped")?;
            if o.read.verify_checksums {
                return Err(Error::config(
                    "verify_checksums",
                    format!(
                        "{} is an ImageFolder, whose images have no checksums to verify",
                        s.name
                    ),
                ));
            }
            Ok(Box::new(ImageFolder::open(s.path())?))
        },
    },
];

fn sharded(d: Box<dyn shards::ShardedSource>) -> Result<Box<dyn Source>> {
    Ok(d)
}

/// The prefix of the Megatron dataset `seen` names (`PREFIX`, `PREFIX.idx` or `PREFIX.bin`),
/// by the rule of [`IndexedTokens::prefix_of`]: its index's name.
fn megatron_index(seen: &Seen) -> Option<PathBuf> {
    match seen.kind {
        Kind::File { .. } | Kind::Missing => IndexedTokens::prefix_of(seen.path()),
        _ => None,
    }
}

/// What `name` is: the format of the first row of the table that recognises it. The rows,
/// in the order they are tried:
///
/// | format | recognised by |
/// |---|---|
/// | tables at an object store URL | `scheme://.../NAME.parquet` (`.arrow`, `.jsonl`, `.jsonl.gz`, ...) or a `*` pattern of them: each file fetched whole into the cache, once per machine, then opened as a local one |
/// | object store URL | `scheme://...` (`s3`, `gs`, `az`, `http(s)`, `file`): its `index.json`, else its `.tar` objects, else the table files directly under it |
/// | WebDataset tar shards | a brace pattern or `::` list, a `.tar` file, a directory of `.tar` files |
/// | packed shards / MDS | a directory with an `index.json` (told apart by its content) |
/// | Arrow (Hugging Face `datasets`) | a directory with `state.json`, `dataset_info.json` or `dataset_dict.json`; `.arrow` files; a file that starts `ARROW1` or an IPC stream's marker |
/// | Parquet | `.parquet` files (one, a directory of them, a `*` pattern), or a file that starts `PAR1` |
/// | JSON lines | `.jsonl`/`.ndjson` files (plain, `.gz`, `.zst`), `.json` files whose first line is one object; one, a directory of them, a `*` pattern |
/// | Megatron tokens | `PREFIX`, `PREFIX.idx` or `PREFIX.bin` whose `PREFIX.idx` is there (read by the token loader) |
/// | `.npy` array | a file that starts `\x93NUMPY` |
/// | packed record file | a file that starts `GPUFEED\0` |
/// | ImageFolder | a directory of class directories |
///
///
/// An error when no row does: nothing by that name, something that is not a file or a
/// directory, an empty file, or a file or directory of no format here; it says what each
/// format is recognised by.
pub fn detect(name: impl AsRef<Path>) -> Result<Format> {
    let seen = Seen::of(utf8(name.as_ref())?)?;
    // One row opens every table at a URL: the file's name says which.
    let url_table = matches!(seen.kind, Kind::Url)
        .then(|| url_table_format(&seen.name))
        .flatten();
    row_of(&seen).map(|r| url_table.unwrap_or(r.format))
}

/// A name as text: every format's rules (patterns, URLs, extensions) are about text.
fn utf8(path: &Path) -> Result<&str> {
    path.to_str().ok_or_else(|| Error::Unrecognised {
        path: path.to_path_buf(),
        what: "not a UTF-8 path: gpufeed reads names it can match against patterns".into(),
    })
}

fn row_of(seen: &Seen) -> Result<&'static Row> {
    if let Some(row) = ROWS.iter().find(|r| (r.recognise)(seen)) {
        return Ok(row);
    }
    let looked_for: Vec<&str> = ROWS.iter().map(|r| r.looks_for).collect();
    let list = looked_for.join("; ");
    let path = seen.path().to_path_buf();
    let what = match &seen.kind {
        Kind::Missing => {
            // What the operating system says of a name that is not there, as opening it would.
            return Err(Error::io(
                &path,
                "open",
                std::io::Error::from_raw_os_error(libc::ENOENT),
            ));
        }
        Kind::Special => "not a regular file or a directory".to_owned(),
        Kind::File { head } if head.is_empty() => "an empty file".to_owned(),
        Kind::File { .. } => "a file of no format gpufeed reads".to_owned(),
        Kind::Dir { .. } => "a directory of no format gpufeed reads".to_owned(),
        Kind::Url | Kind::Pattern | Kind::Glob => "no format gpufeed reads".to_owned(),
    };
    Err(Error::Unrecognised {
        path,
        what: format!("{what}; gpufeed reads {list}"),
    })
}

/// Opens the data set `name` names, read as `options` say: see [`detect`] for what is
/// recognised, and [`Source`] for what an opened data set tells.
///
/// ```no_run
/// use gpufeed::source::{OpenOptions, open};
/// # fn main() -> gpufeed::Result<()> {
/// let train = open("data/train", &OpenOptions::default())?; // a directory of shards, say
/// println!("{} samples of {}", train.len(), train.format());
/// # Ok(())
/// # }
/// ```
pub fn open(name: impl AsRef<Path>, options: &OpenOptions) -> Result<Box<dyn Source>> {
    let seen = Seen::of(utf8(name.as_ref())?)?;
    let row = row_of(&seen)?;
    (row.open)(&seen, options)
}

/// Opens several names as one data set of one schema (each as [`open`] does).
pub fn open_all<P: AsRef<Path>>(names: &[P], options: &OpenOptions) -> Result<Box<dyn Source>> {
    match names {
        [] => Err(Error::config("paths", "no data set was named")),
        [one] => open(one, options),
        many => {
            let parts = many
                .iter()
                .map(|p| open(p, options))
                .collect::<Result<Vec<_>>>()?;
            Ok(Box::new(super::Concat::new(parts)?))
        }
    }
}
