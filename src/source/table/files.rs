//! The files a table data set names: one file, the files of a directory that its format
//! reads, or a glob pattern (`data/train-*.jsonl.gz`), in the order of their paths.
//!
//! Patterns follow Python's `glob.glob` (what `datasets`' `data_files=` takes): `*` any run of
//! characters and `?` one character, neither crossing a `/` nor matching a leading `.`
//! (hidden files); `[abc]`, `[a-z]` and `[!a-z]` one character of (or not of) a set. A
//! component of the pattern with none of those is a name, looked up as it is; `**` is read as
//! `*` (one directory level). Matches are sorted by path, as the hub names shards
//! (`train-00000-of-00042`) so that sorting is their order.

use std::path::{Component, Path, PathBuf};

use crate::error::{Error, Result};

/// True if `text` holds a glob metacharacter (`*`, `?` or `[`).
pub(crate) fn is_pattern(text: &str) -> bool {
    text.contains(['*', '?', '['])
}

/// The files `target` names, sorted: itself if it is a file; the files directly in it that
/// `wanted` accepts (by file name) if it is a directory; the files matching it that `wanted`
/// accepts if it is a pattern (`data/*` names a directory's data files, not its README).
/// `what` names the files in errors (`JSON lines files`). Nothing found is an
/// [`Error::InvalidConfig`] of `path` saying what was looked for; a path that is not there,
/// an [`Error::Io`].
pub(crate) fn dataset_files(
    target: &Path,
    wanted: &dyn Fn(&str) -> bool,
    what: &str,
) -> Result<Vec<PathBuf>> {
    let text = target.to_string_lossy();
    if is_pattern(&text) && !target.exists() {
        let mut found = glob(target)?;
        found.retain(|p| p.is_file() && p.file_name().and_then(|n| n.to_str()).is_some_and(wanted));
        found.sort();
        if found.is_empty() {
            return Err(Error::config(
                "path",
                format!("the pattern `{text}` matches no {what}"),
            ));
        }
        return Ok(found);
    }
    let meta = std::fs::metadata(target).map_err(|e| Error::io(target, "open", e))?;
    if !meta.is_dir() {
        return Ok(vec![target.to_path_buf()]);
    }
    let mut found = Vec::new();
    for entry in std::fs::read_dir(target).map_err(|e| Error::io(target, "list", e))? {
        let entry = entry.map_err(|e| Error::io(target, "list", e))?;
        let path = entry.path();
        let name = entry.file_name();
        if name.to_str().is_some_and(wanted) && path.is_file() {
            found.push(path);
        }
    }
    found.sort();
    if found.is_empty() {
        return Err(Error::config(
            "path",
            format!("the directory {} holds no {what}", target.display()),
        ));
    }
    Ok(found)
}

/// The paths that match `pattern`, component by component (unsorted).
fn glob(pattern: &Path) -> Result<Vec<PathBuf>> {
    let mut found = vec![PathBuf::new()];
    for component in pattern.components() {
        let part = match component {
            Component::Normal(p) => p.to_string_lossy(),
            other => {
                for p in &mut found {
                    p.push(other.as_os_str());
                }
                continue;
            }
        };
        if !is_pattern(&part) {
            for p in &mut found {
                p.push(part.as_ref());
            }
            continue;
        }
        let pattern: Vec<char> = part.chars().collect();
        let mut next = Vec::new();
        for dir in &found {
            let list = if dir.as_os_str().is_empty() {
                Path::new(".")
            } else {
                dir.as_path()
            };
            let Ok(entries) = std::fs::read_dir(list) else {
                continue;
            };
            for entry in entries.flatten() {
                let name = entry.file_name();
                let Some(name) = name.to_str() else { continue };
                if name.starts_with('.') && pattern.first() != Some(&'.') {
                    continue;
                }
                let chars: Vec<char> = name.chars().collect();
                if matches(&pattern, &chars) {
                    next.push(dir.join(name));
                }
            }
        }
        found = next;
    }
    Ok(found)
}

/// Whether the file name `name` matches the glob `pattern` (one path component), by the
/// rules above (a leading `.` only by a pattern that starts with one).
#[cfg_attr(not(feature = "remote"), allow(dead_code))]
pub(crate) fn name_matches(pattern: &str, name: &str) -> bool {
    if name.starts_with('.') && !pattern.starts_with('.') {
        return false;
    }
    let (pattern, name): (Vec<char>, Vec<char>) =
        (pattern.chars().collect(), name.chars().collect());
    matches(&pattern, &name)
}

/// Whether `name` matches the glob `pattern` (one path component).
fn matches(pattern: &[char], name: &[char]) -> bool {
    // The classic two-pointer match: on a mismatch, go back to the last `*` and let it
    // take one more character.
    let (mut p, mut n) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while n < name.len() {
        match pattern.get(p) {
            Some('*') => {
                while pattern.get(p) == Some(&'*') {
                    p += 1;
                }
                star = Some((p, n));
                continue;
            }
            Some('?') => {
                p += 1;
                n += 1;
                continue;
            }
            Some('[') => {
                if let Some((hit, len)) = class(&pattern[p..], name[n]) {
                    if hit {
                        p += len;
                        n += 1;
                        continue;
                    }
                } else if name[n] == '[' {
                    // An unclosed `[` is a literal, as in Python's fnmatch.
                    p += 1;
                    n += 1;
                    continue;
                }
            }
            Some(&c) if c == name[n] => {
                p += 1;
                n += 1;
                continue;
            }
            _ => {}
        }
        match star {
            Some((sp, sn)) => {
                p = sp;
                n = sn + 1;
                star = Some((sp, sn + 1));
            }
            None => return false,
        }
    }
    pattern[p..].iter().all(|&c| c == '*')
}

/// A `[...]` class at the start of `pattern`: whether `c` is in it and the class's length,
/// or `None` if the bracket is not closed.
fn class(pattern: &[char], c: char) -> Option<(bool, usize)> {
    let mut i = 1;
    let negate = matches!(pattern.get(i), Some('!'));
    if negate {
        i += 1;
    }
    let first = i;
    let mut hit = false;
    while let Some(&x) = pattern.get(i) {
        if x == ']' && i > first {
            return Some((hit != negate, i + 1));
        }
        if pattern.get(i + 1) == Some(&'-') && pattern.get(i + 2).is_some_and(|&y| y != ']') {
            let y = pattern[i + 2];
            hit |= x <= c && c <= y;
            i += 3;
        } else {
            hit |= x == c;
            i += 1;
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(p: &str, n: &str) -> bool {
        matches(
            &p.chars().collect::<Vec<_>>(),
            &n.chars().collect::<Vec<_>>(),
        )
    }

    #[test]
    fn patterns_match_as_pythons_fnmatch_does() {
        assert!(m("train-*.jsonl", "train-00000-of-00002.jsonl"));
        assert!(!m("train-*.jsonl", "test-00000.jsonl"));
        assert!(m("*", "a"));
        assert!(m("a*b*c", "aXbYbZc"));
        assert!(!m("a*b*c", "aXbYbZ"));
        assert!(m("part-?.json", "part-1.json"));
        assert!(!m("part-?.json", "part-12.json"));
        assert!(m("[ab]x", "bx"));
        assert!(!m("[!ab]x", "bx"));
        assert!(m("[0-9][0-9]", "42"));
        assert!(m("[]]", "]"));
        assert!(m("a[", "a["));
        assert!(m("**.gz", "x.gz"));
    }

    #[test]
    fn a_directory_a_pattern_and_a_file_name_their_files_in_order() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["b.jsonl", "a.jsonl", "c.txt", ".hidden.jsonl"] {
            std::fs::write(dir.path().join(name), "{}\n").unwrap();
        }
        std::fs::create_dir(dir.path().join("sub.jsonl")).unwrap();
        let wanted = |n: &str| n.ends_with(".jsonl");
        let names = |v: Vec<PathBuf>| -> Vec<String> {
            v.iter()
                .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
                .collect()
        };
        let listed = dataset_files(dir.path(), &wanted, "JSON lines files").unwrap();
        assert_eq!(names(listed), [".hidden.jsonl", "a.jsonl", "b.jsonl"]);
        let globbed = dataset_files(&dir.path().join("*.jsonl"), &wanted, "x").unwrap();
        assert_eq!(names(globbed), ["a.jsonl", "b.jsonl"]);
        let every = dataset_files(&dir.path().join("*"), &wanted, "x").unwrap();
        assert_eq!(names(every), ["a.jsonl", "b.jsonl"], "not c.txt");
        let one = dataset_files(&dir.path().join("c.txt"), &wanted, "x").unwrap();
        assert_eq!(names(one), ["c.txt"]);
        let e = dataset_files(&dir.path().join("*.parquet"), &wanted, "x").unwrap_err();
        assert!(e.to_string().contains("matches no x"), "{e}");
        let empty = tempfile::tempdir().unwrap();
        let e = dataset_files(empty.path(), &wanted, "JSON lines files").unwrap_err();
        assert!(e.to_string().contains("holds no JSON lines files"), "{e}");
        let e = dataset_files(&dir.path().join("nope.jsonl"), &wanted, "x").unwrap_err();
        assert!(matches!(e, Error::Io { .. }), "{e}");
    }
}
