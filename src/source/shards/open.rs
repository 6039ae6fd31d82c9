//! Sharded data sets by how they are named, for the front door ([`open`](crate::source::open())):
//! a directory with an `index.json` (packed shards or MDS, told apart by the index's content:
//! [`IndexKind`], the one rule, which the object store's URLs follow too), `.tar` files, a
//! brace pattern of them (`shards-{000000..000099}.tar`, as webdataset writes them), or
//! several patterns joined by `::` (webdataset's `expand_urls`). [`expand_braces`] is
//! braceexpand's expansion (the package webdataset uses).

use std::path::{Path, PathBuf};

use super::ShardedSource;
use super::mds::MdsDataset;
use super::packed::{PACKED_INDEX_FORMAT, PackedShards};
use super::webdataset::{WebDataset, WebDatasetOptions};
use crate::error::{Error, Result};

/// What the error of a build without object stores advises, for a Rust program: the
/// command and the Python package put their own build's command in its place.
pub const NO_STORE_ADVICE: &str = "build it with `--features s3` (or gcs, azure, http)";

/// The most names a brace pattern may expand to.
const MAX_EXPANSION: usize = 10_000_000;

/// Whether `spec` is the URL of an object store (`s3://`, `gs://`, `az://`, `http(s)://`,
/// `file://`), which the `remote` feature's store reads.
pub fn is_store_url(spec: &str) -> bool {
    match spec.split_once("://") {
        Some((scheme, _)) => {
            !scheme.is_empty()
                && scheme
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'-' || b == b'.')
        }
        None => false,
    }
}

/// The sharded formats an `index.json` describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IndexKind {
    /// gpufeed's packed shards (`"format": "gpufeed-shards"`).
    Packed,
    /// MosaicML Streaming's MDS (`"shards": [...]`).
    Mds,
}

/// Which format the index `text` (read from `path`) describes, by its content: the one rule,
/// for local directories and object stores alike.
pub(crate) fn index_kind(path: &Path, text: &[u8]) -> Result<IndexKind> {
    let value: serde_json::Value = serde_json::from_slice(text).map_err(|e| Error::Malformed {
        path: path.to_path_buf(),
        format: "shard index",
        what: format!("not valid JSON: {e}"),
    })?;
    if value.get("format").and_then(|f| f.as_str()) == Some(PACKED_INDEX_FORMAT) {
        return Ok(IndexKind::Packed);
    }
    if value.get("shards").is_some() {
        return Ok(IndexKind::Mds);
    }
    Err(Error::Malformed {
        path: path.to_path_buf(),
        format: "shard index",
        what: format!(
            "neither a packed shard index (`\"format\": \"{PACKED_INDEX_FORMAT}\"`) nor an MDS index (`\"shards\"`)"
        ),
    })
}

/// Opens the shard directory `dir` by its `index.json` (packed shards or MDS); opens no shard.
pub fn open_index_dir(dir: &Path, options: &WebDatasetOptions) -> Result<Box<dyn ShardedSource>> {
    let index = dir.join("index.json");
    let text = std::fs::read(&index).map_err(|e| Error::io(&index, "read", e))?;
    let store = std::sync::Arc::new(super::LocalDir::new(dir));
    let shards = options.shards.clone();
    Ok(match index_kind(&index, &text)? {
        IndexKind::Packed => Box::new(PackedShards::from_index(store, &index, &text, shards)?),
        IndexKind::Mds => Box::new(MdsDataset::from_index(store, &index, &text, shards)?),
    })
}

/// Opens the `.tar` files of directory `dir` (sorted by name) as WebDataset shards.
pub fn open_tar_dir(dir: &Path, options: &WebDatasetOptions) -> Result<Box<dyn ShardedSource>> {
    let mut tars = Vec::new();
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, "list", e))?;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(dir, "list", e))?;
        let p = entry.path();
        if p.extension().is_some_and(|e| e == "tar") && p.is_file() {
            tars.push(p);
        }
    }
    tars.sort();
    open_tars_named(tars, options)
}

/// Opens the `.tar` files a brace pattern (`shards-{000000..000099}.tar`), or several joined
/// by `::`, names, as WebDataset shards; one `.tar` file is a pattern of one.
pub fn open_pattern(spec: &str, options: &WebDatasetOptions) -> Result<Box<dyn ShardedSource>> {
    let mut paths = Vec::new();
    for part in spec.split("::").filter(|p| !p.is_empty()) {
        paths.extend(expand_braces(part)?.into_iter().map(PathBuf::from));
    }
    open_tars_named(paths, options)
}

/// Opens the `.tar` files `paths` as WebDataset shards, in this order.
pub fn open_tars_named(
    paths: Vec<PathBuf>,
    options: &WebDatasetOptions,
) -> Result<Box<dyn ShardedSource>> {
    if paths.is_empty() {
        return Err(Error::config("shards", "the pattern names no shard"));
    }
    if paths.iter().any(|p| p.as_os_str().is_empty()) {
        return Err(Error::config("shards", "the pattern names an empty path"));
    }
    Ok(Box::new(WebDataset::open_with(&paths, options.clone())?))
}

/// Expands a brace pattern as Python's `braceexpand` does (webdataset's shard lists):
/// `{a,b}` alternatives, `{000..099}` integer ranges (zero-padded when an end has a leading
/// zero), `{a..e}` letter ranges, an optional step (`{0..10..2}`), ranges down as well as up,
/// nesting, and `\` escaping a character. Unbalanced braces are an error.
pub(crate) fn expand_braces(pattern: &str) -> Result<Vec<String>> {
    let chars: Vec<char> = pattern.chars().collect();
    let out = expand_pattern(&chars, pattern)?;
    Ok(out.into_iter().map(|s| unescape(&s)).collect())
}

fn unbalanced(pattern: &str) -> Error {
    Error::config(
        "shards",
        format!("unbalanced braces in the pattern `{pattern}`"),
    )
}

fn too_many(pattern: &str) -> Error {
    Error::config(
        "shards",
        format!("the pattern `{pattern}` expands to more than {MAX_EXPANSION} names"),
    )
}

/// The product of the pattern's literal parts and brace expressions (escapes kept).
fn expand_pattern(p: &[char], whole: &str) -> Result<Vec<String>> {
    let mut items: Vec<Vec<String>> = Vec::new();
    let (mut start, mut pos, mut depth) = (0usize, 0usize, 0i32);
    while pos < p.len() {
        match p[pos] {
            '\\' => {
                pos += 2;
                continue;
            }
            '{' => {
                if depth == 0 && pos > start {
                    items.push(vec![p[start..pos].iter().collect()]);
                    start = pos;
                }
                depth += 1;
            }
            '}' => {
                depth -= 1;
                if depth == 0 {
                    let expr = &p[start + 1..pos];
                    match expand_expression(expr, whole)? {
                        Some(v) => items.push(v),
                        None => {
                            items.push(vec!["{".into()]);
                            items.push(expand_pattern(expr, whole)?);
                            items.push(vec!["}".into()]);
                        }
                    }
                    start = pos + 1;
                }
                if depth < 0 {
                    return Err(unbalanced(whole));
                }
            }
            _ => {}
        }
        pos += 1;
    }
    if depth != 0 {
        return Err(unbalanced(whole));
    }
    if start < p.len() {
        items.push(vec![p[start..].iter().collect()]);
    }
    let mut out = vec![String::new()];
    for item in items {
        if out.len().saturating_mul(item.len()) > MAX_EXPANSION {
            return Err(too_many(whole));
        }
        out = out
            .iter()
            .flat_map(|a| item.iter().map(move |b| format!("{a}{b}")))
            .collect();
    }
    Ok(out)
}

/// A range or a sequence, or `None` when `expr` is neither (its braces are then literal).
fn expand_expression(expr: &[char], whole: &str) -> Result<Option<Vec<String>>> {
    let s: String = expr.iter().collect();
    if let Some(v) = int_range(&s) {
        if v.len() > MAX_EXPANSION {
            return Err(too_many(whole));
        }
        return Ok(Some(v));
    }
    if let Some(v) = char_range(&s) {
        return Ok(Some(v));
    }
    // A sequence: commas at depth 0.
    let mut parts = Vec::new();
    let (mut start, mut pos, mut depth) = (0usize, 0usize, 0i32);
    while pos < expr.len() {
        match expr[pos] {
            '\\' => {
                pos += 2;
                continue;
            }
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&expr[start..pos]);
                start = pos + 1;
            }
            _ => {}
        }
        pos += 1;
    }
    if depth != 0 || parts.is_empty() {
        return Ok(None);
    }
    parts.push(&expr[start.min(expr.len())..]);
    let mut out = Vec::new();
    for part in parts {
        out.extend(expand_pattern(part, whole)?);
        if out.len() > MAX_EXPANSION {
            return Err(too_many(whole));
        }
    }
    Ok(Some(out))
}

/// `-?\d+..-?\d+(..-?\d+)?`, as braceexpand's `make_int_range`.
fn int_range(s: &str) -> Option<Vec<String>> {
    let parts: Vec<&str> = s.split("..").collect();
    let is_int = |t: &str| {
        let d = t.strip_prefix('-').unwrap_or(t);
        !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit())
    };
    let (a, b, step) = match parts.as_slice() {
        [a, b] if is_int(a) && is_int(b) => (*a, *b, None),
        [a, b, c] if is_int(a) && is_int(b) && is_int(c) => (*a, *b, Some(*c)),
        _ => return None,
    };
    let padded = [a, b]
        .iter()
        .any(|t| *t != "0" && *t != "-0" && (t.starts_with('0') || t.starts_with("-0")));
    let width = if padded { a.len().max(b.len()) } else { 0 };
    let start: i64 = a.parse().ok()?;
    let end: i64 = b.parse().ok()?;
    let step = match step {
        Some(c) => c.trim_start_matches('-').parse::<i64>().ok()?.max(0),
        None => 1,
    };
    let step = if step == 0 { 1 } else { step };
    if start.abs_diff(end) / step as u64 > MAX_EXPANSION as u64 {
        return Some(vec![String::new(); MAX_EXPANSION + 1]);
    }
    let mut out = Vec::new();
    let mut i = start;
    if start < end {
        while i <= end {
            out.push(format!("{i:0width$}"));
            i += step;
        }
    } else {
        while i >= end {
            out.push(format!("{i:0width$}"));
            i -= step;
        }
    }
    Some(out)
}

/// `[A-Za-z]..[A-Za-z](..-?\d+)?` over braceexpand's alphabet (`A`-`Z` then `a`-`z`).
fn char_range(s: &str) -> Option<Vec<String>> {
    const ALPHABET: &str = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    let parts: Vec<&str> = s.split("..").collect();
    let letter = |t: &str| {
        (t.len() == 1 && t.as_bytes()[0].is_ascii_alphabetic())
            .then(|| ALPHABET.find(t))
            .flatten()
    };
    let (a, b, step) = match parts.as_slice() {
        [a, b] => (letter(a)?, letter(b)?, 1usize),
        [a, b, c] => {
            let c = c.strip_prefix('-').unwrap_or(c);
            (letter(a)?, letter(b)?, c.parse::<usize>().ok()?.max(1))
        }
        _ => return None,
    };
    let letters: Vec<char> = ALPHABET.chars().collect();
    Some(if a < b {
        (a..=b)
            .step_by(step)
            .map(|i| letters[i].to_string())
            .collect()
    } else {
        (b..=a)
            .rev()
            .step_by(step)
            .map(|i| letters[i].to_string())
            .collect()
    })
}

/// Removes escaping backslashes (`\x` -> `x`).
fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            if let Some(n) = chars.next() {
                out.push(n);
            } else {
                out.push(c);
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn x(p: &str) -> Vec<String> {
        expand_braces(p).unwrap()
    }

    #[test]
    fn braces_expand_as_braceexpand() {
        assert_eq!(x("item{1..3}"), ["item1", "item2", "item3"]);
        assert_eq!(x("{07..10}"), ["07", "08", "09", "10"]);
        assert_eq!(x("s-{000000..000002}.tar")[2], "s-000002.tar");
        assert_eq!(x("{4..1}"), ["4", "3", "2", "1"]);
        assert_eq!(x("{2..-1}"), ["2", "1", "0", "-1"]);
        assert_eq!(x("{0..6..3}"), ["0", "3", "6"]);
        assert_eq!(x("{a..c}"), ["a", "b", "c"]);
        assert_eq!(x("{a..g..2}"), ["a", "c", "e", "g"]);
        assert_eq!(
            x("index.html{,.backup}"),
            ["index.html", "index.html.backup"]
        );
        assert_eq!(
            x("python{2.{5..7},3.{2,3}}"),
            [
                "python2.5",
                "python2.6",
                "python2.7",
                "python3.2",
                "python3.3"
            ]
        );
        assert_eq!(x("{x}"), ["{x}"]);
        assert_eq!(x(r"{1\{2,3}"), ["1{2", "3"]);
        assert_eq!(x("plain.tar"), ["plain.tar"]);
        assert!(expand_braces("{1{2,3}").is_err());
        assert!(expand_braces("{0..99999999999}").is_err());
    }
}
