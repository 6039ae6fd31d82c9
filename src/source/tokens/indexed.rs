//! [`IndexedTokens`]: Megatron-LM's indexed dataset (`prefix.idx` + `prefix.bin`), read in
//! place.
//!
//! The index, as `megatron.core.datasets.indexed_dataset._IndexWriter` writes it (all
//! little-endian):
//!
//! ```text
//! offset       what
//! 0            magic  b"MMIDIDX\x00\x00" (9 bytes)
//! 9            version, u64 = 1
//! 17           dtype code, u8 (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
//!              7 float32, 8 uint16)
//! 18           S: sequence count, u64
//! 26           D: document count, u64 (entries of the document index: documents + 1)
//! 34           sequence lengths, S x i32 (tokens)
//! 34 + 4S      sequence pointers, S x i64 (byte offsets into the .bin)
//! 34 + 12S     document index, D x i64 (sequence numbers; document d is sequences
//!              doc[d] .. doc[d + 1]; doc[0] = 0, doc[D - 1] = S)
//! 34 + 12S+8D  sequence modes, S x i8, only in multimodal datasets (read past here: ignored)
//! ```
//!
//! The `.bin` holds the sequences' tokens back to back. The arrays are not aligned (they start
//! at byte 34), so every value is read as bytes.
//!
//! What is checked when: at open, in O(1), the header, the dtype, that the file's size is what
//! the counts need (with or without modes), that the document index starts at 0 and ends at S,
//! and that the last sequence ends inside the `.bin` (a truncated `.bin`). Each document read
//! checks its own entries: sequence numbers in order and in range, lengths not negative,
//! pointers contiguous within the document and inside the `.bin`. The token loader reads every
//! document's length once when it is built ([`TokenSource::tokens_in`]), so a corrupt entry
//! anywhere is an error then, naming the document; [`IndexedTokens::verify`] does the same pass.
//!
//! A document is one of Megatron's documents (a run of sequences). Datasets written by
//! `tools/preprocess_data.py` without sentence splitting have one sequence per document, and
//! Megatron's `GPTDataset` samples those; with sentence splitting, a document's sentences are
//! read together as one document here.
//!
//! Both files are read as [`ReadMode`] says. The `.idx`'s arrays are read on every document
//! access: mapped ([`ReadMode::Map`]), or, with [`ReadMode::Pread`], read whole into memory at
//! open (12 bytes a sequence and 8 a document: 200 MB for 10^7 documents), so that neither
//! file is ever mapped and a file truncated while it is open is an error, never `SIGBUS`: the
//! `.bin`'s reads find it short ([`Error::FileChanged`]), and
//! [`check_unchanged`](TokenSource::check_unchanged) reports either file at the next epoch.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use super::{TokenSource, decode_tokens};
use crate::error::{Error, Result};
use crate::file::{
    FileData, FileIdentity, ReadMode, combined_fingerprint, mapped_fingerprint, open_file,
    sampled_fingerprint,
};
use crate::format::DType;

/// The first 9 bytes of a Megatron index (`_INDEX_HEADER`).
pub const MEGATRON_MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";

/// Bytes before the arrays: magic, version, dtype code, two counts.
const HEADER_BYTES: u64 = 34;

const IDX_FORMAT: &str = "Megatron index (.idx)";
const BIN_FORMAT: &str = "Megatron data (.bin)";

/// Megatron-LM's indexed dataset: the documents of `prefix.bin`, as `prefix.idx` lays them out.
/// See the [module docs](self) for the format and what is checked.
pub struct IndexedTokens {
    idx_path: PathBuf,
    bin_path: PathBuf,
    index: IndexBytes,
    index_identity: FileIdentity,
    data: FileData,
    data_identity: FileIdentity,
    dtype: DType,
    code: u8,
    sequences: u64,
    /// Entries of the document index (documents + 1).
    doc_entries: u64,
    multimodal: bool,
}

impl std::fmt::Debug for IndexedTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IndexedTokens")
            .field("idx", &self.idx_path)
            .field("dtype", &self.dtype)
            .field("sequences", &self.sequences)
            .field("documents", &self.documents())
            .finish()
    }
}

/// The `.idx`'s bytes: its mapping, or (read at offsets) a copy read at open.
enum IndexBytes {
    Map(Arc<Mmap>),
    Read(Vec<u8>),
}

impl std::ops::Deref for IndexBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            IndexBytes::Map(map) => map,
            IndexBytes::Read(bytes) => bytes,
        }
    }
}

impl IndexBytes {
    /// The index at `path`, opened as `mode` says: mapped, or read whole.
    fn open(path: &Path, mode: ReadMode) -> Result<(IndexBytes, FileIdentity)> {
        let (data, identity) = open_file(path, mode)?;
        let bytes = match data {
            FileData::Map(map) => IndexBytes::Map(map),
            FileData::Pread { .. } => {
                let len = data.len() as usize;
                let mut bytes = Vec::new();
                bytes.try_reserve_exact(len).map_err(|_| {
                    Error::io(
                        path,
                        "read",
                        std::io::Error::other(format!(
                            "no memory for the {len}-byte index (read whole with --read-mode pread / ReadMode::Pread; a mapping needs none)"
                        )),
                    )
                })?;
                bytes.resize(len, 0);
                data.read_at(path, 0, &mut bytes)?;
                IndexBytes::Read(bytes)
            }
        };
        Ok((bytes, identity))
    }
}

impl IndexedTokens {
    /// Opens `prefix.idx` and `prefix.bin` (the prefix may also be given with either
    /// extension), mapping both.
    pub fn open(prefix: impl AsRef<Path>) -> Result<IndexedTokens> {
        IndexedTokens::open_with(prefix, ReadMode::Map)
    }

    /// Opens `prefix.idx` and `prefix.bin`, read as `mode` says (with [`ReadMode::Pread`],
    /// the index is read into memory at open and the data read at offsets: see the
    /// [module docs](self)). A missing `.bin` is an [`Error::Io`] naming it.
    pub fn open_with(prefix: impl AsRef<Path>, mode: ReadMode) -> Result<IndexedTokens> {
        let prefix = prefix.as_ref();
        let prefix = strip_extension(prefix).unwrap_or_else(|| prefix.to_path_buf());
        let idx_path = with_suffix(&prefix, "idx");
        let bin_path = with_suffix(&prefix, "bin");
        if idx_path.is_file() && !bin_path.exists() {
            return Err(Error::Io {
                path: bin_path.clone(),
                op: "open",
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!(
                        "the data file of the Megatron dataset {} is missing (its index {} is there; a Megatron dataset is PREFIX.idx + PREFIX.bin, written together)",
                        prefix.display(),
                        idx_path.display()
                    ),
                ),
            });
        }
        let (index, index_identity) = IndexBytes::open(&idx_path, mode)?;
        let (data, data_identity) = open_file(&bin_path, mode)?;
        let header = Header::parse(&index).map_err(|what| malformed_idx(&idx_path, what))?;
        let tokens = IndexedTokens {
            idx_path,
            bin_path,
            index,
            index_identity,
            data,
            data_identity,
            dtype: header.dtype,
            code: header.code,
            sequences: header.sequences,
            doc_entries: header.doc_entries,
            multimodal: header.multimodal,
        };
        tokens.check_ends()?;
        Ok(tokens)
    }

    /// The prefix of a Megatron dataset that `path` names, told by its index: `path` without
    /// its `.idx` or `.bin` extension when that prefix's `.idx` is there, or `path` itself when
    /// `path.idx` is. A `.bin` without a `.idx` beside it is none (nanoGPT's `train.bin` is a
    /// flat file of tokens); a `.idx` without its `.bin` is one, which
    /// [`open_with`](Self::open_with) refuses, naming the missing `.bin`.
    pub fn prefix_of(path: &Path) -> Option<PathBuf> {
        if let Some(prefix) = strip_extension(path)
            && with_suffix(&prefix, "idx").is_file()
        {
            return Some(prefix);
        }
        with_suffix(path, "idx")
            .is_file()
            .then(|| path.to_path_buf())
    }

    /// The index file.
    pub fn idx_path(&self) -> &Path {
        &self.idx_path
    }

    /// The data file.
    pub fn bin_path(&self) -> &Path {
        &self.bin_path
    }

    /// Megatron's dtype code in the index (8 for uint16, 4 for int32, ...).
    pub fn dtype_code(&self) -> u8 {
        self.code
    }

    /// Sequences in the index.
    pub fn sequences(&self) -> u64 {
        self.sequences
    }

    /// True when the index holds sequence modes (a multimodal dataset); they are not read.
    pub fn multimodal(&self) -> bool {
        self.multimodal
    }

    /// Bytes of the data file.
    pub fn data_len(&self) -> u64 {
        self.data.len()
    }

    /// The sequences of document `doc`, as the document index says (checked: in order, in
    /// range).
    pub fn document_sequences(&self, doc: u64) -> Result<Range<u64>> {
        if doc >= self.documents() {
            return Err(Error::OutOfRange {
                index: doc,
                len: self.documents(),
            });
        }
        let at = self.docs_at() + 8 * doc;
        let (s0, s1) = (self.i64_at(at)?, self.i64_at(at + 8)?);
        if s0 < 0 || s1 < s0 || s1 as u64 > self.sequences {
            return Err(self.bad_idx(format!(
                "document {doc}: its entries in the document index are {s0} .. {s1}, not an ordered range of the {} sequences",
                self.sequences
            )));
        }
        Ok(s0 as u64..s1 as u64)
    }

    /// The length in tokens and the byte offset of sequence `seq` (checked: the length is not
    /// negative, the sequence lies inside the data file).
    pub fn sequence(&self, seq: u64) -> Result<(u64, u64)> {
        if seq >= self.sequences {
            return Err(Error::OutOfRange {
                index: seq,
                len: self.sequences,
            });
        }
        let len = self.i32_at(HEADER_BYTES + 4 * seq)?;
        let ptr = self.i64_at(self.pointers_at() + 8 * seq)?;
        let item = self.dtype.size() as u64;
        let end = u64::try_from(len)
            .ok()
            .zip(u64::try_from(ptr).ok())
            .and_then(|(l, p)| l.checked_mul(item).and_then(|b| b.checked_add(p)));
        match end {
            Some(end) if end <= self.data.len() => Ok((len as u64, ptr as u64)),
            Some(end) => Err(self.bad_bin(format!(
                "sequence {seq} ({len} tokens at byte {ptr}) ends at byte {end}, past the data file's {} bytes: it is truncated",
                self.data.len()
            ))),
            None => Err(self.bad_idx(format!(
                "sequence {seq}: length {len} at byte {ptr} is not a place in a file"
            ))),
        }
    }

    /// The tokens and the byte offset of document `doc`: its sequences, checked to follow one
    /// another in the data file.
    fn document(&self, doc: u64) -> Result<(u64, u64)> {
        let seqs = self.document_sequences(doc)?;
        let Some(first) = (!seqs.is_empty()).then_some(seqs.start) else {
            return Ok((0, 0));
        };
        let item = self.dtype.size() as u64;
        let (mut tokens, start) = self.sequence(first)?;
        for seq in seqs.start + 1..seqs.end {
            let (len, ptr) = self.sequence(seq)?;
            if ptr != start + tokens * item {
                return Err(self.bad_idx(format!(
                    "document {doc}: sequence {seq} starts at byte {ptr}, not where the document's sequence before it ends ({})",
                    start + tokens * item
                )));
            }
            tokens += len;
        }
        Ok((tokens, start))
    }

    /// Reads every entry of the index and checks each document (see the [module docs](self)):
    /// the pass the token loader makes when it is built. Returns the number of tokens.
    pub fn verify(&self) -> Result<u64> {
        self.tokens_in(0..self.documents())
    }

    fn docs_at(&self) -> u64 {
        HEADER_BYTES + 12 * self.sequences
    }

    fn pointers_at(&self) -> u64 {
        HEADER_BYTES + 4 * self.sequences
    }

    fn bytes_at<const N: usize>(&self, at: u64) -> Result<[u8; N]> {
        let bytes = usize::try_from(at)
            .ok()
            .and_then(|at| self.index.get(at..at.checked_add(N)?));
        let mut out = [0u8; N];
        out.copy_from_slice(bytes.ok_or_else(|| {
            self.bad_idx(format!(
                "{N} bytes at {at} lie past the end of the {}-byte index",
                self.index.len()
            ))
        })?);
        Ok(out)
    }

    fn i32_at(&self, at: u64) -> Result<i32> {
        self.bytes_at(at).map(i32::from_le_bytes)
    }

    fn i64_at(&self, at: u64) -> Result<i64> {
        self.bytes_at(at).map(i64::from_le_bytes)
    }

    /// The checks of the ends that open makes: the document index from 0 to S, and the last
    /// sequence inside the data file.
    fn check_ends(&self) -> Result<()> {
        let first = self.i64_at(self.docs_at())?;
        let last = self.i64_at(self.docs_at() + 8 * (self.doc_entries - 1))?;
        if first != 0 {
            return Err(self.bad_idx(format!(
                "the document index starts at {first}, not at sequence 0"
            )));
        }
        if last != self.sequences as i64 {
            return Err(self.bad_idx(format!(
                "the document index ends at {last}, not at the {} sequences of the index",
                self.sequences
            )));
        }
        if self.sequences > 0 {
            self.sequence(self.sequences - 1)?;
        }
        Ok(())
    }

    fn bad_idx(&self, what: String) -> Error {
        malformed_idx(&self.idx_path, what)
    }

    fn bad_bin(&self, what: String) -> Error {
        Error::Malformed {
            path: self.bin_path.clone(),
            format: BIN_FORMAT,
            what,
        }
    }
}

impl TokenSource for IndexedTokens {
    fn name(&self) -> String {
        strip_extension(&self.idx_path)
            .unwrap_or_else(|| self.idx_path.clone())
            .display()
            .to_string()
    }

    fn dtype(&self) -> DType {
        self.dtype
    }

    fn documents(&self) -> u64 {
        self.doc_entries - 1
    }

    fn document_len(&self, doc: u64) -> Result<u64> {
        self.document(doc).map(|(tokens, _)| tokens)
    }

    fn read(&self, doc: u64, start: u64, out: &mut [u32]) -> Result<()> {
        let (tokens, at) = self.document(doc)?;
        let n = out.len() as u64;
        if start.checked_add(n).is_none_or(|end| end > tokens) {
            return Err(Error::OutOfRange {
                index: start.saturating_add(n),
                len: tokens,
            });
        }
        let item = self.dtype.size() as u64;
        let bytes = self
            .data
            .bytes_at(&self.bin_path, at + start * item, (n * item) as usize)?;
        decode_tokens(&bytes, self.dtype, out, |i, v| {
            self.bad_bin(format!(
                "document {doc}: token {} is {v}, not a token id",
                start + i as u64
            ))
        })
    }

    fn check_unchanged(&self) -> Result<()> {
        self.index_identity.check(&self.idx_path)?;
        self.data_identity.check(&self.bin_path)
    }

    /// Both files' sizes and 256 KiB sampled evenly over each: the index's lengths, pointers
    /// and document index, and the tokens.
    fn fingerprint(&self) -> Result<u64> {
        let idx = match &self.index {
            IndexBytes::Map(map) => mapped_fingerprint(map),
            IndexBytes::Read(bytes) => sampled_fingerprint(bytes.len() as u64, |at, buf| {
                let at = at as usize;
                buf.copy_from_slice(&bytes[at..at + buf.len()]);
                Ok(())
            })?,
        };
        let bin = self.data.fingerprint(&self.bin_path)?;
        Ok(combined_fingerprint([idx, bin]))
    }
}

/// What an index's first 34 bytes and its size say.
struct Header {
    dtype: DType,
    code: u8,
    sequences: u64,
    doc_entries: u64,
    multimodal: bool,
}

impl Header {
    fn parse(index: &[u8]) -> std::result::Result<Header, String> {
        let len = index.len() as u64;
        if len < HEADER_BYTES {
            return Err(format!(
                "the file has {len} bytes, fewer than the {HEADER_BYTES}-byte header: it is truncated"
            ));
        }
        if &index[..9] != MEGATRON_MAGIC {
            return Err(format!(
                "no MMIDIDX magic at the start (found {:?})",
                String::from_utf8_lossy(&index[..9])
            ));
        }
        let u64_at = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&index[at..at + 8]);
            u64::from_le_bytes(b)
        };
        let version = u64_at(9);
        if version != 1 {
            return Err(format!("version {version} (gpufeed reads version 1)"));
        }
        let code = index[17];
        let dtype = match code {
            1 => DType::U8,
            2 => DType::I8,
            3 => DType::I16,
            4 => DType::I32,
            5 => DType::I64,
            8 => DType::U16,
            6 | 7 => {
                let name = if code == 6 { "float64" } else { "float32" };
                return Err(format!(
                    "dtype code {code} ({name}): token ids are integers"
                ));
            }
            other => {
                return Err(format!(
                    "dtype code {other} is not one of Megatron's (1 to 8)"
                ));
            }
        };
        let (sequences, doc_entries) = (u64_at(18), u64_at(26));
        if doc_entries == 0 {
            return Err(
                "the document index is empty (a builder writes at least its first entry, 0)".into(),
            );
        }
        let need = sequences
            .checked_mul(12)
            .and_then(|s| doc_entries.checked_mul(8)?.checked_add(s))
            .and_then(|n| n.checked_add(HEADER_BYTES));
        let multimodal = match need {
            Some(n) if n == len => false,
            Some(n) if n.checked_add(sequences) == Some(len) => true,
            _ => {
                return Err(format!(
                    "the file has {len} bytes; {sequences} sequences and {doc_entries} document index entries need {} ({} with sequence modes): it is truncated or corrupt",
                    need.map_or("more than 2^64".to_string(), |n| n.to_string()),
                    need.and_then(|n| n.checked_add(sequences))
                        .map_or("more than 2^64".to_string(), |n| n.to_string()),
                ));
            }
        };
        Ok(Header {
            dtype,
            code,
            sequences,
            doc_entries,
            multimodal,
        })
    }
}

fn malformed_idx(path: &Path, what: String) -> Error {
    Error::Malformed {
        path: path.to_path_buf(),
        format: IDX_FORMAT,
        what,
    }
}

/// `path` without a `.idx` or `.bin` extension, if it has one.
fn strip_extension(path: &Path) -> Option<PathBuf> {
    let ext = path.extension()?;
    (ext == "idx" || ext == "bin").then(|| path.with_extension(""))
}

/// `prefix` + `.` + `ext` (a prefix may hold dots of its own: `data.v2` -> `data.v2.idx`).
fn with_suffix(prefix: &Path, ext: &str) -> PathBuf {
    let mut s = prefix.as_os_str().to_os_string();
    s.push(".");
    s.push(ext);
    PathBuf::from(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An index as `_IndexWriter` writes it, for documents of these sequence lengths.
    pub(crate) fn index_bytes(code: u8, docs: &[&[i32]], item: i64) -> Vec<u8> {
        let lengths: Vec<i32> = docs.iter().flat_map(|d| d.iter().copied()).collect();
        let mut out = MEGATRON_MAGIC.to_vec();
        out.extend(1u64.to_le_bytes());
        out.push(code);
        out.extend((lengths.len() as u64).to_le_bytes());
        out.extend((docs.len() as u64 + 1).to_le_bytes());
        out.extend(lengths.iter().flat_map(|l| l.to_le_bytes()));
        let mut ptr = 0i64;
        for l in &lengths {
            out.extend(ptr.to_le_bytes());
            ptr += i64::from(*l) * item;
        }
        let mut seq = 0i64;
        out.extend(seq.to_le_bytes());
        for d in docs {
            seq += d.len() as i64;
            out.extend(seq.to_le_bytes());
        }
        out
    }

    #[test]
    fn documents_of_several_sequences_read_as_one() {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("data");
        let docs: &[&[i32]] = &[&[3, 2], &[], &[4]];
        std::fs::write(with_suffix(&prefix, "idx"), index_bytes(8, docs, 2)).unwrap();
        let tokens: Vec<u8> = (0..9u16).flat_map(|t| (t + 100).to_le_bytes()).collect();
        std::fs::write(with_suffix(&prefix, "bin"), tokens).unwrap();
        let t = IndexedTokens::open(&prefix).unwrap();
        assert_eq!(
            (t.documents(), t.sequences(), t.dtype()),
            (3, 3, DType::U16)
        );
        assert_eq!(
            (0..3)
                .map(|d| t.document_len(d).unwrap())
                .collect::<Vec<_>>(),
            [5, 0, 4]
        );
        let mut out = [0u32; 3];
        t.read(0, 2, &mut out).unwrap();
        assert_eq!(out, [102, 103, 104]);
        t.read(2, 1, &mut out).unwrap();
        assert_eq!(out, [106, 107, 108]);
        assert!(t.read(2, 2, &mut out).is_err());
        assert_eq!(t.verify().unwrap(), 9);
        assert!(IndexedTokens::open(with_suffix(&prefix, "bin")).is_ok());
        assert_eq!(
            IndexedTokens::prefix_of(&with_suffix(&prefix, "idx")),
            Some(prefix)
        );
    }
}
