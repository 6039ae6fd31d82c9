//! The index of a JSON lines file: where each line that is not blank starts, packed
//! ([`LineIndex`]: blocks of 64 lines, each a `u64` start and the others' offsets from it in
//! the fewest bytes that hold the block's), built by one pass over the bytes
//! ([`scan_lines`], or [`scan_read`] a piece at a time for a file read with `pread`), which
//! also refuses a line that does not start with `{`; and its file in an index directory
//! ([`encode_index`], [`decode_index`]: checked against the file's path, size and
//! modification time, and its own checksum).

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use super::parse::is_ws;
use crate::error::{Error, Result};
use crate::file::{FileData, FileIdentity};
use crate::source::shards::quoted;

/// Lines per block of the index.
const BLOCK: u64 = 64;

/// A UTF-8 byte-order mark.
pub(super) const BOM: &[u8] = b"\xef\xbb\xbf";

/// Where each line that is not blank starts, packed (see the [module](self)): per block of
/// [`BLOCK`] lines, the first line's start and where the others' offsets from it are in
/// `offsets` (`position << 3 | (width - 1)`, the width in bytes).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct LineIndex {
    blocks: Vec<(u64, u64)>,
    offsets: Vec<u8>,
    pub(super) lines: u64,
    /// The end of the last line: the data's length.
    end: u64,
}

impl LineIndex {
    /// Where line `i` starts, if there is one.
    pub(super) fn start(&self, i: u64) -> Option<u64> {
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
    pub(super) fn span(&self, i: u64) -> Option<Range<u64>> {
        let start = self.start(i)?;
        let end = if i + 1 < self.lines {
            self.start(i + 1)?
        } else {
            self.end
        };
        (start <= end).then_some(start..end)
    }

    /// The memory the index holds.
    pub(super) fn heap_bytes(&self) -> u64 {
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
pub(super) fn scan_lines(path: &Path, bytes: &[u8]) -> Result<(LineIndex, u64)> {
    let start = if bytes.starts_with(BOM) { 3 } else { 0 };
    let mut scanner = LineScanner::new(path, start as u64);
    scanner.feed(&bytes[start..], start as u64)?;
    scanner.finish(bytes.len() as u64)
}

/// The index of lines of a file read with `pread`, a piece at a time.
pub(super) fn scan_read(path: &Path, data: &FileData) -> Result<(LineIndex, u64)> {
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
pub(super) fn sidecar_path(dir: &Path, path: &Path, identity: &FileIdentity) -> PathBuf {
    let canonical = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(canonical.as_os_str().as_encoded_bytes());
    h.update(&identity.len().to_le_bytes());
    h.update(&mtime_nanos(identity).to_le_bytes());
    dir.join(format!("{:032x}.gfjlidx", h.digest128()))
}

/// The index file's bytes: what it was built from (path, size, modification time, the
/// length of the bytes indexed), the index, an xxh3-64 of it all.
pub(super) fn encode_index(
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
pub(super) fn decode_index(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::file::FileIdentity;

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
}
