//! What `gpufeed tokenize` writes: Megatron's indexed dataset (`PREFIX.bin` + `PREFIX.idx`,
//! byte for byte what megatron-core's `IndexedDatasetBuilder` writes for the same documents)
//! or nanoGPT's flat `.bin`, streamed into temporaries that are renamed into place together
//! once complete (`gpufeed::temporary::PlacedTogether`).
//!
//! The `.idx` layout is the one `gpufeed::source::tokens::indexed` reads (its module docs):
//! magic, version 1, dtype code, sequence count, document-index count, then the sequences'
//! lengths (i32), their byte offsets into the `.bin` (i64) and the document index (i64, from
//! 0). Without sentence splitting, as `preprocess_data.py` runs by default, a document is one
//! sequence, except a document whose text gives no token: Megatron writes it as a document
//! of no sequence (its index entry repeats the previous one), and so does this writer.
//!
//! The index is written last, from what the writer kept: 4 bytes a document (its length)
//! plus 8 for each empty document, where megatron-core's builder keeps Python lists.

use std::io::Write;
use std::path::{Path, PathBuf};

use gpufeed::source::tokens::MEGATRON_MAGIC;
use gpufeed::temporary::PlacedTogether;
use gpufeed::tokenizer::TokenWidth;
use gpufeed::{Error, Result};

/// The file format written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Megatron-LM's indexed dataset: PREFIX.bin and PREFIX.idx.
    Megatron,
    /// nanoGPT's train.bin: the tokens back to back (PREFIX.bin), uint16 (or uint32 for a
    /// vocabulary of more than 65,536 tokens).
    Nanogpt,
}

/// How tokens are stored: the integer type, its Megatron dtype code, its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stored {
    /// The integer type.
    pub width: TokenWidth,
}

impl Stored {
    /// The type `format` stores the ids of a vocabulary of `vocab_size` in: Megatron's
    /// choice for Megatron, else `uint16` where every id fits, `uint32` otherwise.
    pub fn of(format: Format, vocab_size: u64) -> Stored {
        let width = match format {
            Format::Megatron => TokenWidth::megatron(vocab_size),
            Format::Nanogpt if vocab_size <= 1 << 16 => TokenWidth::U16,
            Format::Nanogpt => TokenWidth::U32,
        };
        Stored { width }
    }

    /// Bytes a token takes.
    pub fn bytes(self) -> usize {
        match self.width {
            TokenWidth::U16 => 2,
            TokenWidth::I32 | TokenWidth::U32 => 4,
        }
    }

    /// Megatron's dtype code (`DType` in megatron-core's indexed_dataset.py).
    fn megatron_code(self) -> u8 {
        match self.width {
            TokenWidth::U16 => 8,
            TokenWidth::I32 => 4,
            // Megatron never chooses it; `Stored::of` never gives it for Megatron.
            TokenWidth::U32 => 0,
        }
    }

    /// Appends `ids` to `out` as stored tokens (little-endian). The ids were checked to fit
    /// when the tokenizer was opened (its vocabulary).
    pub fn extend(self, ids: &[u32], out: &mut Vec<u8>) {
        match self.width {
            TokenWidth::U16 => out.extend(ids.iter().flat_map(|&t| (t as u16).to_le_bytes())),
            TokenWidth::I32 | TokenWidth::U32 => {
                out.extend(ids.iter().flat_map(|&t| t.to_le_bytes()))
            }
        }
    }
}

/// The files of PREFIX the format writes (the `.bin` first).
pub fn output_paths(format: Format, prefix: &Path) -> Vec<PathBuf> {
    let with = |ext: &str| {
        let mut p = prefix.as_os_str().to_owned();
        p.push(ext);
        PathBuf::from(p)
    };
    match format {
        Format::Megatron => vec![with(".bin"), with(".idx")],
        Format::Nanogpt => vec![with(".bin")],
    }
}

/// Writes documents' tokens in order.
pub struct TokenWriter {
    format: Format,
    stored: Stored,
    files: PlacedTogether,
    /// Each non-empty document's tokens (Megatron's sequence lengths).
    lengths: Vec<i32>,
    /// The documents (by number) that have no token, in order.
    empty: Vec<u64>,
    documents: u64,
    tokens: u64,
}

impl TokenWriter {
    /// Temporaries for `paths` (from [`output_paths`]).
    pub fn create(format: Format, stored: Stored, paths: &[PathBuf]) -> Result<TokenWriter> {
        let refs: Vec<&Path> = paths.iter().map(PathBuf::as_path).collect();
        Ok(TokenWriter {
            format,
            stored,
            files: PlacedTogether::create(&refs)?,
            lengths: Vec::new(),
            empty: Vec::new(),
            documents: 0,
            tokens: 0,
        })
    }

    /// Appends documents: `bytes`, their stored tokens back to back, and `lengths`, each
    /// document's token count (0 for a document without tokens).
    pub fn append(&mut self, bytes: &[u8], lengths: &[u32]) -> Result<()> {
        let (out, path) = self.files.writer(0);
        out.write_all(bytes).map_err(|e| write_error(path, e))?;
        if self.format == Format::Megatron {
            for &n in lengths {
                if n == 0 {
                    self.empty.push(self.documents);
                } else {
                    // A document is at most 2 GiB of text, fewer tokens than bytes plus the
                    // template's and the EOS: always an i32, as Megatron's lengths are.
                    self.lengths.push(i32::try_from(n).map_err(|_| {
                        Error::user(format!(
                            "document {}: {n} tokens, more than a Megatron index holds for one \
                             document (2^31 - 1)",
                            self.documents
                        ))
                    })?);
                }
                self.documents += 1;
            }
        } else {
            self.documents += lengths.len() as u64;
        }
        self.tokens += lengths.iter().map(|&n| n as u64).sum::<u64>();
        Ok(())
    }

    /// Documents and tokens written so far.
    pub fn counts(&self) -> (u64, u64) {
        (self.documents, self.tokens)
    }

    /// Writes the index (Megatron) and places the files under their names.
    pub fn finish(mut self) -> Result<()> {
        if self.format == Format::Megatron {
            self.write_index()?;
        }
        self.files.place()
    }

    /// The `.idx` of the documents written.
    fn write_index(&mut self) -> Result<()> {
        let index = IndexCounts {
            code: self.stored.megatron_code(),
            item_bytes: self.stored.bytes() as u64,
            sequences: self.lengths.len() as u64,
            documents: self.documents,
        };
        let lengths = || self.lengths.iter().map(|&n| Ok(n));
        // Document d ends after the sequences of the non-empty documents up to it.
        let mut empty = self.empty.iter().peekable();
        let mut end = 0u64;
        let ends = (0..self.documents).map(move |d| {
            if empty.next_if_eq(&&d).is_none() {
                end += 1;
            }
            Ok(end)
        });
        let (out, path) = self.files.writer(1);
        write_index(out, path, &index, lengths, ends)
    }
}

/// What the header of a Megatron `.idx` says.
pub struct IndexCounts {
    /// Megatron's dtype code of the tokens.
    pub code: u8,
    /// Bytes a token takes.
    pub item_bytes: u64,
    /// Sequences in the index.
    pub sequences: u64,
    /// Documents (the document index has one entry more).
    pub documents: u64,
}

/// Writes a Megatron `.idx` into `out` (the temporary of `path`), as megatron-core's
/// `_IndexWriter.write` lays it out: the header `index` gives, the sequences' lengths
/// (`lengths()`, called twice), their pointers (the sequences back to back in the `.bin`:
/// each one's byte offset is the bytes of the lengths before it, as `_IndexWriter` computes
/// them), then the document index: 0, then each document's end in sequences (`ends`). The
/// iterators give `index.sequences` lengths and `index.documents` ends.
pub fn write_index<L, I>(
    out: &mut impl Write,
    path: &Path,
    index: &IndexCounts,
    lengths: L,
    ends: impl Iterator<Item = Result<u64>>,
) -> Result<()>
where
    L: Fn() -> I,
    I: Iterator<Item = Result<i32>>,
{
    let fail = |e| write_error(path, e);
    let mut w = |bytes: &[u8]| out.write_all(bytes).map_err(fail);
    w(MEGATRON_MAGIC)?;
    w(&1u64.to_le_bytes())?;
    w(&[index.code])?;
    w(&index.sequences.to_le_bytes())?;
    w(&(index.documents + 1).to_le_bytes())?;
    for n in lengths() {
        w(&n?.to_le_bytes())?;
    }
    let mut pointer = 0u64;
    for n in lengths() {
        w(&pointer.to_le_bytes())?;
        // Lengths are not negative (the writer's by construction, a merged part's checked).
        pointer += n? as u64 * index.item_bytes;
    }
    w(&0u64.to_le_bytes())?;
    for end in ends {
        w(&end?.to_le_bytes())?;
    }
    Ok(())
}

/// A failed write to the temporary of `path` (errors name the destination).
fn write_error(path: &Path, source: std::io::Error) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        op: "write (its temporary file)",
        source,
    }
}
