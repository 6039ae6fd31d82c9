//! Token sources for language-model training: documents of token ids, read in place.
//!
//! A [`TokenSource`] is a list of documents, each a run of token ids, read from one shared
//! mapping (or with `pread`) as every other source is:
//!
//! - [`IndexedTokens`]: Megatron-LM's indexed dataset, `prefix.bin` + `prefix.idx` (the
//!   `MMIDIDX` format that `megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder`
//!   writes), each of its documents a document;
//! - [`FlatTokens`]: one flat run of tokens, nanoGPT's `train.bin` (raw `uint16`/`uint32`, the
//!   dtype given) or a 1-D `.npy` array: one document;
//! - [`DocumentTokens`]: one field of any [`Dataset`](crate::Dataset) (a bytes field of a packed
//!   file, an MDS column, local or remote shards) read as the tokens of one document per sample.
//!
//! Nothing here holds memory per document: lengths and offsets are read from the index where it
//! lies (the `.idx` mapping, the packed file's offset table). What the token loader builds on
//! top ([`tokens`](crate::tokens)) holds a few bytes per window of documents.
//!
//! Every file is untrusted: a header, a count or an offset that does not hold together is an
//! [`Error::Malformed`] naming the file and what is wrong, a token that is not an id (negative,
//! or past `u32`) an error naming the document (see [`decode_tokens`]).

mod documents;
mod flat;
pub mod indexed;
mod text;

use std::ops::Range;

pub use documents::DocumentTokens;
pub use flat::FlatTokens;
pub use indexed::{IndexedTokens, MEGATRON_MAGIC};
pub use text::TextTokens;

use crate::error::{Error, Result};
use crate::format::DType;

/// Documents of token ids, shared by every worker thread.
///
/// Token ids are handed out as `u32` whatever their stored dtype: every vocabulary in use fits
/// (Megatron stores `uint16` below 65,500 entries, else `int32`).
pub trait TokenSource: Send + Sync + std::fmt::Debug {
    /// What this is, for messages and reports: the path or the field read.
    fn name(&self) -> String;

    /// The dtype the tokens are stored in.
    fn dtype(&self) -> DType;

    /// The number of documents.
    fn documents(&self) -> u64;

    /// The number of tokens of document `doc`.
    fn document_len(&self, doc: u64) -> Result<u64>;

    /// Tokens of documents `docs` together. The default sums [`document_len`](Self::document_len);
    /// sources with an index check it here too (the token loader calls this once per window of
    /// documents when it is built: a pass over the whole index).
    fn tokens_in(&self, docs: Range<u64>) -> Result<u64> {
        docs.map(|d| self.document_len(d)).sum()
    }

    /// Tokens `start .. start + out.len()` of document `doc`, into `out`.
    fn read(&self, doc: u64, start: u64, out: &mut [u32]) -> Result<()>;

    /// Checks that the files read are still the ones opened (see
    /// [`Dataset::check_unchanged`](crate::Dataset::check_unchanged)).
    fn check_unchanged(&self) -> Result<()> {
        Ok(())
    }

    /// A cheap hash of what identifies this source's data, at a bounded cost whatever its size:
    /// a token loader records it in its states and refuses to resume a state taken on data
    /// whose fingerprint differs (another data set with the same counts). Files hash their
    /// sizes and 256 KiB sampled evenly over them; the default hashes the number of
    /// documents and, for 64 documents spread evenly over them, each one's length and first
    /// 16 tokens ([`documents_fingerprint`]).
    fn fingerprint(&self) -> Result<u64> {
        documents_fingerprint(self, 64, true)
    }
}

/// A fingerprint of `source` from its documents: their number and, for `documents` of them
/// (spread evenly over all of them, or the first ones), each one's length and first 16 tokens.
pub fn documents_fingerprint<S: TokenSource + ?Sized>(
    source: &S,
    documents: u64,
    spread: bool,
) -> Result<u64> {
    let n = source.documents();
    let mut hash = xxhash_rust::xxh3::Xxh3::new();
    hash.update(&n.to_le_bytes());
    let picked = documents.min(n);
    let mut tokens = [0u32; 16];
    for k in 0..picked {
        let doc = if spread && picked > 1 {
            (u128::from(n - 1) * u128::from(k) / u128::from(picked - 1)) as u64
        } else {
            k
        };
        let len = source.document_len(doc)?;
        let head = &mut tokens[..len.min(16) as usize];
        source.read(doc, 0, head)?;
        hash.update(&len.to_le_bytes());
        for t in head.iter() {
            hash.update(&t.to_le_bytes());
        }
    }
    Ok(hash.digest())
}

impl<T: TokenSource + ?Sized> TokenSource for std::sync::Arc<T> {
    fn name(&self) -> String {
        (**self).name()
    }
    fn dtype(&self) -> DType {
        (**self).dtype()
    }
    fn documents(&self) -> u64 {
        (**self).documents()
    }
    fn document_len(&self, doc: u64) -> Result<u64> {
        (**self).document_len(doc)
    }
    fn tokens_in(&self, docs: Range<u64>) -> Result<u64> {
        (**self).tokens_in(docs)
    }
    fn read(&self, doc: u64, start: u64, out: &mut [u32]) -> Result<()> {
        (**self).read(doc, start, out)
    }
    fn check_unchanged(&self) -> Result<()> {
        (**self).check_unchanged()
    }
    fn fingerprint(&self) -> Result<u64> {
        (**self).fingerprint()
    }
}

/// True for the dtypes tokens can be stored in: the integers.
pub fn is_token_dtype(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::U8
            | DType::I8
            | DType::U16
            | DType::I16
            | DType::U32
            | DType::I32
            | DType::U64
            | DType::I64
    )
}

/// Decodes little-endian tokens of `dtype` from `bytes` into `out` (`bytes` holds exactly
/// `out.len()` of them). A value that is not a token id (negative, or above `u32::MAX`) is the
/// error `bad(position, value)` makes.
pub fn decode_tokens(
    bytes: &[u8],
    dtype: DType,
    out: &mut [u32],
    bad: impl Fn(usize, i128) -> Error,
) -> Result<()> {
    if bytes.len() != out.len() * dtype.size() {
        return Err(Error::mismatch(format!(
            "{} bytes hold {} tokens of {dtype}, not {}",
            bytes.len(),
            bytes.len() / dtype.size().max(1),
            out.len()
        )));
    }
    match dtype {
        DType::U8 => out.iter_mut().zip(bytes).for_each(|(o, &b)| *o = b.into()),
        DType::U16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = u16::from_le_bytes([b[0], b[1]]).into();
            }
        }
        DType::U32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        DType::I8 => checked(bytes, out, &bad, |b: [u8; 1]| i8::from_le_bytes(b).into())?,
        DType::I16 => checked(bytes, out, &bad, |b: [u8; 2]| i16::from_le_bytes(b).into())?,
        DType::I32 => checked(bytes, out, &bad, |b: [u8; 4]| i32::from_le_bytes(b).into())?,
        DType::U64 => checked(bytes, out, &bad, |b: [u8; 8]| u64::from_le_bytes(b).into())?,
        DType::I64 => checked(bytes, out, &bad, |b: [u8; 8]| i64::from_le_bytes(b).into())?,
        other => {
            return Err(Error::mismatch(format!(
                "{other} is not a token dtype (token ids are integers)"
            )));
        }
    }
    Ok(())
}

/// Decodes tokens stored as `N`-byte integers, each read as `value` does, checking that each
/// is a token id.
fn checked<const N: usize>(
    bytes: &[u8],
    out: &mut [u32],
    bad: &impl Fn(usize, i128) -> Error,
    value: fn([u8; N]) -> i128,
) -> Result<()> {
    for (i, (o, b)) in out.iter_mut().zip(bytes.chunks_exact(N)).enumerate() {
        let mut raw = [0u8; N];
        raw.copy_from_slice(b);
        let v = value(raw);
        *o = u32::try_from(v).map_err(|_| bad(i, v))?;
    }
    Ok(())
}

/// True for a name that holds token ids by the rule of [`open_tokens`]: a Megatron dataset
/// (`PREFIX.idx`, `PREFIX.bin`, or a prefix with both), a `.npy` array, a flat `.bin` file.
/// The front ends read every other name given with a tokenizer as text ([`TextTokens`]).
pub fn is_token_file(path: &std::path::Path) -> bool {
    IndexedTokens::prefix_of(path).is_some()
        || path.extension().is_some_and(|e| e == "npy" || e == "bin")
}

/// Opens a token file by its name: `PREFIX.idx`, `PREFIX.bin` with its `PREFIX.idx` beside it,
/// or a path `PREFIX` with both, as Megatron's indexed dataset; a `.npy` array as a flat run
/// of tokens; any other file as a flat run of tokens of `dtype` (nanoGPT's `train.bin`), which
/// must then be given.
pub fn open_tokens(
    path: impl AsRef<std::path::Path>,
    dtype: Option<DType>,
    mode: crate::source::ReadMode,
) -> Result<std::sync::Arc<dyn TokenSource>> {
    let path = path.as_ref();
    if let Some(prefix) = IndexedTokens::prefix_of(path) {
        if let Some(d) = dtype {
            return Err(Error::config(
                "token_dtype",
                format!(
                    "{} is a Megatron indexed dataset, whose index names its dtype; {d} was given too: leave it out",
                    path.display()
                ),
            ));
        }
        return Ok(std::sync::Arc::new(IndexedTokens::open_with(prefix, mode)?));
    }
    if path.extension().is_some_and(|e| e == "npy") {
        if let Some(d) = dtype {
            return Err(Error::config(
                "token_dtype",
                format!(
                    "{} is a .npy array, whose header names its dtype; {d} was given too: leave it out",
                    path.display()
                ),
            ));
        }
        return Ok(std::sync::Arc::new(FlatTokens::open_npy_with(path, mode)?));
    }
    let Some(dtype) = dtype else {
        return Err(Error::config(
            "token_dtype",
            format!(
                "{} is a flat file of tokens (nanoGPT's train.bin): give the dtype its tokens are stored in (u16 or u32)",
                path.display()
            ),
        ));
    };
    Ok(std::sync::Arc::new(FlatTokens::open_with(
        path, dtype, mode,
    )?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_of_every_integer_dtype_decode_and_bad_ids_are_refused() {
        let mut out = [0u32; 3];
        let bad = |i: usize, v: i128| Error::user(format!("token {i} is {v}"));
        decode_tokens(&[1, 0, 2, 0, 255, 255], DType::U16, &mut out, bad).unwrap();
        assert_eq!(out, [1, 2, 65535]);
        let b: Vec<u8> = [7i32, 0, 9].iter().flat_map(|v| v.to_le_bytes()).collect();
        decode_tokens(&b, DType::I32, &mut out, bad).unwrap();
        assert_eq!(out, [7, 0, 9]);
        let b: Vec<u8> = [7i32, -1, 9].iter().flat_map(|v| v.to_le_bytes()).collect();
        let e = decode_tokens(&b, DType::I32, &mut out, bad).unwrap_err();
        assert!(e.to_string().contains("token 1 is -1"), "{e}");
        let b: Vec<u8> = [1i64 << 33, 0, 0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let e = decode_tokens(&b, DType::I64, &mut out, bad).unwrap_err();
        assert!(e.to_string().contains("token 0 is 8589934592"), "{e}");
        assert!(decode_tokens(&[0; 12], DType::F32, &mut out, bad).is_err());
        assert!(decode_tokens(&[0; 5], DType::U16, &mut out, bad).is_err());
    }
}
