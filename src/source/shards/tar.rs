//! A reader of tar archives over bytes in memory (a mapped shard): the members' names, types
//! and where their data lies, found by one pass over the headers. Member data is never copied.
//!
//! It reads what Python's `tarfile` reads (webdataset reads shards with it): ustar and GNU
//! headers with octal or base-256 numbers and the `prefix` field, GNU long names (`L`), pax
//! extended and global headers (`x`, `X`: `path` and `size`; `g`: `path`), old V7 directories
//! (a name ending in `/`), applied in `tarfile`'s order. Where `tarfile` would skip data, this does too (regular files and
//! unknown types skip their data; links, directories and devices have none).
//!
//! It is stricter than `tarfile` in one way, on purpose: `tarfile` ends the archive silently at
//! a header with a bad checksum or at a partial last block, which drops the rest of a corrupt
//! shard without a word; here both are [`Error::Malformed`] naming the shard and the byte.
//! Compressed archives (gzip, bzip2, xz, zstd) are refused: their members cannot be read in
//! place. GNU sparse members are refused (their data is not stored contiguously).

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The size of a tar block.
pub(crate) const BLOCK: u64 = 512;

/// What kind of member a header describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemberKind {
    /// A regular file (types `0`, NUL, `7`): its data is a sample's field.
    Regular,
    /// Anything else `tarfile` lists but webdataset skips: directories, links, devices, FIFOs,
    /// types unknown to `tarfile`.
    Other(u8),
}

/// One member of a tar archive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TarMember {
    /// Its name, as `tarfile` gives it (after pax `path`, GNU long name and ustar `prefix`),
    /// as stored bytes.
    pub name: Vec<u8>,
    /// Where its first header (a pax or GNU long-name header, if any) starts.
    pub header_offset: u64,
    /// Where its data starts.
    pub data_offset: u64,
    /// Its data's size in bytes.
    pub size: u64,
    /// What it is.
    pub kind: MemberKind,
}

/// The members of a tar archive held in `bytes`, in order; an iterator of `Result`s that ends
/// after the first error.
pub struct TarMembers<'a> {
    path: PathBuf,
    bytes: &'a [u8],
    at: u64,
    global_path: Option<Vec<u8>>,
    done: bool,
}

impl<'a> TarMembers<'a> {
    /// The members of the archive `bytes` (named `path` in errors).
    pub fn new(path: &Path, bytes: &'a [u8]) -> TarMembers<'a> {
        TarMembers {
            path: path.to_path_buf(),
            bytes,
            at: 0,
            global_path: None,
            done: false,
        }
    }

    fn bad(&self, at: u64, what: impl Into<String>) -> Error {
        Error::Malformed {
            path: self.path.clone(),
            format: "tar",
            what: format!("at byte {at}: {}", what.into()),
        }
    }

    /// The header block at `at`, or `None` at a clean end (no byte left, or a zero block).
    fn block(&self, at: u64) -> Result<Option<&'a [u8]>> {
        let len = self.bytes.len() as u64;
        if at == len {
            return Ok(None);
        }
        if at + BLOCK > len {
            return Err(self.bad(
                at,
                format!(
                    "{} bytes left where a 512-byte header should be: the shard is truncated",
                    len - at
                ),
            ));
        }
        let b = &self.bytes[at as usize..(at + BLOCK) as usize];
        if b.iter().all(|&x| x == 0) {
            return Ok(None);
        }
        Ok(Some(b))
    }

    /// The data of the member whose data starts at `at` and holds `size` bytes: it and its
    /// padding to a whole block must be inside the archive.
    fn data(&self, header: u64, at: u64, size: u64) -> Result<&'a [u8]> {
        let len = self.bytes.len() as u64;
        let end = at
            .checked_add(size)
            .filter(|&e| e <= len && blocks(e) <= len)
            .ok_or_else(|| {
                self.bad(
                    header,
                    format!(
                        "a member of {size} bytes at {at} runs past the end of the shard ({} bytes): truncated",
                        self.bytes.len()
                    ),
                )
            })?;
        Ok(&self.bytes[at as usize..end as usize])
    }

    fn next_member(&mut self) -> Result<Option<TarMember>> {
        let first = self.at;
        if first == 0 && self.bytes.len() >= 6 {
            let magic = &self.bytes[..6];
            let compressed = magic.starts_with(&[0x1f, 0x8b])
                || magic.starts_with(b"BZh")
                || magic.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0])
                || magic.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]);
            if compressed {
                return Err(self.bad(
                    0,
                    "a compressed archive (gzip, bzip2, xz or zstd): members of a compressed tar cannot be read in place; decompress the shard",
                ));
            }
        }
        // Extended headers before the member, in order: GNU long names and pax records.
        let mut chain: Vec<Extension> = Vec::new();
        let mut at = self.at;
        loop {
            let Some(h) = self.block(at)? else {
                if at != first {
                    return Err(self.bad(
                        at,
                        "the archive ends after an extended header, before its member",
                    ));
                }
                return Ok(None);
            };
            check_checksum(h).map_err(|e| self.bad(at, e))?;
            let typ = h[156];
            let size = number(&h[124..136]).map_err(|e| self.bad(at, format!("size: {e}")))?;
            let data_at = at + BLOCK;
            match typ {
                b'L' | b'K' => {
                    let data = self.data(at, data_at, size)?;
                    if typ == b'L' {
                        chain.push(Extension::LongName(nts(data).to_vec()));
                    }
                    at = data_at + blocks(size);
                }
                b'x' | b'X' | b'g' => {
                    let data = self.data(at, data_at, size)?;
                    let (path, pax_size) = pax_records(data).map_err(|e| self.bad(at, e))?;
                    if typ == b'g' {
                        if pax_size.is_some() {
                            return Err(self.bad(
                                at,
                                "a global pax header with a `size` record (which tarfile applies inconsistently)",
                            ));
                        }
                        if path.is_some() {
                            self.global_path = path;
                        }
                    } else {
                        chain.push(Extension::Pax {
                            path,
                            size: pax_size,
                        });
                    }
                    at = data_at + blocks(size);
                }
                b'S' => {
                    return Err(self.bad(
                        at,
                        "a GNU sparse member: its data is not stored in one piece",
                    ));
                }
                _ => {
                    // As tarfile's frombuf: the name up to a NUL, a V7 directory (a regular
                    // type whose name ends in `/`), the ustar prefix (applied whatever the
                    // magic, as tarfile does).
                    let mut name = nts(&h[0..100]).to_vec();
                    let prefix = nts(&h[345..500]);
                    let kind = match typ {
                        0 if name.ends_with(b"/") => MemberKind::Other(b'5'),
                        b'0' | 0 | b'7' => MemberKind::Regular,
                        t => MemberKind::Other(t),
                    };
                    if !prefix.is_empty() {
                        let mut full = prefix.to_vec();
                        full.push(b'/');
                        full.extend_from_slice(&name);
                        name = full;
                    }
                    // tarfile skips the data of regular files and of types it does not know;
                    // links, directories, devices and FIFOs have none.
                    let has_data = kind == MemberKind::Regular || !matches!(typ, b'1'..=b'6');
                    let mut size = size;
                    // _proc_builtin: the global pax path.
                    if let Some(p) = &self.global_path {
                        name = strip_trailing_slashes(p);
                    }
                    // Then each extended header, the innermost (last) first, as tarfile's
                    // recursion applies them: the first one before the member wins.
                    for ext in chain.iter().rev() {
                        match ext {
                            Extension::LongName(n) => name = n.clone(),
                            Extension::Pax { path, size: s } => {
                                if let Some(p) = path.as_ref().or(self.global_path.as_ref()) {
                                    name = strip_trailing_slashes(p);
                                }
                                if let Some(s) = s {
                                    size = *s;
                                }
                            }
                        }
                    }
                    let size = if has_data { size } else { 0 };
                    self.data(at, data_at, size)?;
                    self.at = data_at + blocks(size);
                    return Ok(Some(TarMember {
                        name,
                        header_offset: first,
                        data_offset: data_at,
                        size,
                        kind,
                    }));
                }
            }
        }
    }
}

/// An extended header that applies to the next member.
enum Extension {
    /// A GNU long name (`L`).
    LongName(Vec<u8>),
    /// A pax extended header (`x`, `X`): its `path` and `size` records.
    Pax {
        path: Option<Vec<u8>>,
        size: Option<u64>,
    },
}

/// `n` bytes rounded up to whole blocks.
fn blocks(n: u64) -> u64 {
    n.div_ceil(BLOCK) * BLOCK
}

fn strip_trailing_slashes(p: &[u8]) -> Vec<u8> {
    let mut v = p.to_vec();
    while v.ends_with(b"/") {
        v.pop();
    }
    v
}

impl Iterator for TarMembers<'_> {
    type Item = Result<TarMember>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        match self.next_member() {
            Ok(Some(m)) => Some(Ok(m)),
            Ok(None) => {
                self.done = true;
                None
            }
            Err(e) => {
                self.done = true;
                Some(Err(e))
            }
        }
    }
}

/// The bytes up to the first NUL.
fn nts(b: &[u8]) -> &[u8] {
    match b.iter().position(|&x| x == 0) {
        Some(p) => &b[..p],
        None => b,
    }
}

/// A numeric header field: octal digits (up to a NUL, spaces around them allowed; empty is
/// 0), or GNU's base-256 (first byte 0x80; 0xff, a negative number, is refused).
fn number(field: &[u8]) -> Result<u64, String> {
    match field[0] {
        0x80 => {
            let mut n: u64 = 0;
            for &b in &field[1..] {
                n = n
                    .checked_mul(256)
                    .and_then(|n| n.checked_add(u64::from(b)))
                    .ok_or("a base-256 number past 2^64")?;
            }
            Ok(n)
        }
        0xff => Err("a negative base-256 number".into()),
        _ => {
            let s = nts(field);
            let s = s.trim_ascii();
            let mut n: u64 = 0;
            for &c in s {
                if !(b'0'..=b'7').contains(&c) {
                    return Err(format!("`{}` is not an octal number", super::quoted(s)));
                }
                n = n
                    .checked_mul(8)
                    .and_then(|n| n.checked_add(u64::from(c - b'0')))
                    .ok_or("an octal number past 2^64")?;
            }
            Ok(n)
        }
    }
}

/// The header checksum must be the sum of its bytes (unsigned or signed) with the checksum
/// field read as spaces, as `tarfile` checks.
fn check_checksum(h: &[u8]) -> Result<(), String> {
    let stored = number(&h[148..156]).map_err(|e| format!("header checksum: {e}"))?;
    let mut unsigned: i64 = 256;
    let mut signed: i64 = 256;
    for (i, &b) in h.iter().enumerate() {
        if (148..156).contains(&i) {
            continue;
        }
        unsigned += i64::from(b);
        signed += i64::from(b as i8);
    }
    if stored as i64 != unsigned && stored as i64 != signed {
        return Err(format!(
            "header checksum is {stored}, the header sums to {unsigned}: not a tar header, or a corrupt one"
        ));
    }
    Ok(())
}

/// The `path` and `size` of a pax header's records (`"%d %s=%s\n"`), read as `tarfile` reads
/// them: records until one does not parse; a length of 0 or one past the end is an error.
#[allow(clippy::type_complexity)]
fn pax_records(data: &[u8]) -> Result<(Option<Vec<u8>>, Option<u64>), String> {
    let mut path = None;
    let mut size = None;
    let mut pos = 0usize;
    loop {
        let rest = &data[pos..];
        let digits = rest.iter().take_while(|c| c.is_ascii_digit()).count();
        if digits == 0 || rest.get(digits) != Some(&b' ') {
            break;
        }
        let key_start = digits + 1;
        let Some(eq) = rest[key_start..].iter().position(|&c| c == b'=') else {
            break;
        };
        if eq == 0 {
            break;
        }
        let keyword = &rest[key_start..key_start + eq];
        let len: usize = std::str::from_utf8(&rest[..digits])
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or("a pax record length too large")?;
        if len == 0 {
            return Err("a pax record of length 0".into());
        }
        let value_start = key_start + eq + 1;
        if len > rest.len() || len < value_start + 1 {
            return Err(format!(
                "a pax record of length {len} does not fit in its header"
            ));
        }
        let value = &rest[value_start..len - 1];
        match keyword {
            b"path" => path = Some(value.to_vec()),
            b"size" => {
                // tarfile reads a bad number as 0.
                size = Some(
                    std::str::from_utf8(value)
                        .ok()
                        .and_then(|s| s.parse::<u64>().ok())
                        .unwrap_or(0),
                );
            }
            k if k.starts_with(b"GNU.sparse.") => {
                return Err("a GNU sparse member: its data is not stored in one piece".into());
            }
            _ => {}
        }
        pos += len;
    }
    Ok((path, size))
}

// The tests build their archives with the tests' own tar writer.
#[cfg(test)]
#[path = "../../../tests/tar_common/mod.rs"]
mod tar_common;

#[cfg(test)]
mod tests {
    use super::tar_common::TarBuilder;
    use super::*;

    fn list(bytes: &[u8]) -> Result<Vec<TarMember>> {
        TarMembers::new(Path::new("t.tar"), bytes).collect()
    }

    #[test]
    fn reads_files_directories_and_long_names() {
        let long = format!("{}/x.jpg", "d".repeat(120));
        let tar = TarBuilder::new()
            .entry("dir/", b'5', b"")
            .file("a.txt", b"hello")
            .file(&long, b"jpegdata")
            .finish();
        let m = list(&tar).unwrap();
        assert_eq!(m.len(), 3);
        assert_eq!(m[0].name, b"dir/");
        assert_eq!(m[0].kind, MemberKind::Other(b'5'));
        assert_eq!(m[1].name, b"a.txt");
        assert_eq!(
            &tar[m[1].data_offset as usize..][..m[1].size as usize],
            b"hello"
        );
        assert_eq!(m[2].name, long.as_bytes());
        assert_eq!(m[2].kind, MemberKind::Regular);
        assert!(m[2].header_offset < m[2].data_offset - 512);
    }

    #[test]
    fn truncation_and_corruption_are_errors_naming_the_byte() {
        let tar = TarBuilder::new().file("a.txt", &[7u8; 700]).finish();
        for cut in [100, 512, 600, 1023, 1100] {
            let e = list(&tar[..cut]).unwrap_err();
            assert!(matches!(e, Error::Malformed { .. }), "cut at {cut}: {e:?}");
        }
        // A missing end-of-archive is what tarfile accepts too.
        assert_eq!(list(&tar[..1536]).unwrap().len(), 1);
        let mut bad = tar.clone();
        bad[10] ^= 1;
        let e = list(&bad).unwrap_err().to_string();
        assert!(e.contains("checksum"), "{e}");
    }

    #[test]
    fn a_size_near_2_pow_64_is_an_error_not_an_overflow() {
        let mut tar = TarBuilder::new().file("a.txt", b"x").finish();
        // Base-256 size u64::MAX - 1000: the padded end of its data would overflow u64.
        let size = (u64::MAX - 1000).to_be_bytes();
        tar[124] = 0x80;
        tar[125..128].fill(0);
        tar[128..136].copy_from_slice(&size);
        tar[148..156].copy_from_slice(b"        ");
        let sum: u32 = tar[..512].iter().map(|&b| u32::from(b)).sum();
        tar[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
        let e = list(&tar).unwrap_err().to_string();
        assert!(e.contains("runs past the end"), "{e}");
    }

    #[test]
    fn gzip_is_refused() {
        let e = list(&[0x1f, 0x8b, 8, 0, 0, 0, 0, 0])
            .unwrap_err()
            .to_string();
        assert!(e.contains("compressed"), "{e}");
    }

    #[test]
    fn numbers_octal_and_base_256() {
        assert_eq!(number(b"0000644\0"), Ok(0o644));
        assert_eq!(number(b"  17 \0\0\0"), Ok(0o17));
        assert_eq!(number(b"\0\0\0\0"), Ok(0));
        assert_eq!(number(&[0x80, 0, 0, 1, 0]), Ok(256));
        assert!(number(b"9\0").is_err());
        assert!(number(&[0xff, 0xff]).is_err());
    }
}
