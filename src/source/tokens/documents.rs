//! [`DocumentTokens`]: one field of a [`Dataset`] read as tokens, one document per sample.
//!
//! For documents stored as records: a variable-size bytes field of a packed file, a bytes or
//! `ndarray` column of MosaicML MDS shards, a tensor field of fixed length, in local or remote
//! shards, all through [`Dataset::get`]. The field's bytes are little-endian tokens of the dtype
//! given; a field whose size is not a whole number of tokens is an error naming the sample.

use std::sync::Arc;

use super::{TokenSource, decode_tokens, is_token_dtype};
use crate::error::{Error, Result};
use crate::format::{DType, FieldKind};
use crate::source::Dataset;

/// The tokens of one field of a dataset, sample `i` being document `i`.
pub struct DocumentTokens {
    dataset: Arc<dyn Dataset>,
    field: usize,
    name: String,
    dtype: DType,
}

impl std::fmt::Debug for DocumentTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DocumentTokens")
            .field("field", &self.name)
            .field("dtype", &self.dtype)
            .field("documents", &self.dataset.len())
            .finish()
    }
}

impl DocumentTokens {
    /// The field `field` of `dataset`, its bytes read as tokens of `dtype`. A tensor field must
    /// be of that dtype; a bytes field may hold any.
    pub fn new(dataset: Arc<dyn Dataset>, field: &str, dtype: DType) -> Result<DocumentTokens> {
        if !is_token_dtype(dtype) {
            return Err(Error::config(
                "token_dtype",
                format!("{dtype} is not a token dtype: token ids are integers (u16, u32, ...)"),
            ));
        }
        let schema = dataset.schema();
        let k = schema.index_of(field).ok_or_else(|| {
            Error::mismatch(format!(
                "no field `{field}` to read tokens from in the dataset's schema [{schema}]"
            ))
        })?;
        if let FieldKind::Tensor { dtype: stored, .. } = &schema.fields()[k].kind
            && *stored != dtype
        {
            return Err(Error::mismatch(format!(
                "field `{field}` holds {stored}, not {dtype} tokens"
            )));
        }
        Ok(DocumentTokens {
            dataset,
            field: k,
            name: field.to_owned(),
            dtype,
        })
    }

    /// The dataset read.
    pub fn dataset(&self) -> &Arc<dyn Dataset> {
        &self.dataset
    }

    /// The field's bytes of sample `doc`, checked to be whole tokens, passed to `f`.
    fn with_bytes<T>(&self, doc: u64, f: impl FnOnce(&[u8]) -> Result<T>) -> Result<T> {
        let sample = self.dataset.get(doc)?;
        let bytes = sample.try_field(self.field)?;
        if !bytes.len().is_multiple_of(self.dtype.size()) {
            return Err(Error::mismatch(format!(
                "field `{}` of sample {doc}: {} bytes are not a whole number of {} tokens",
                self.name,
                bytes.len(),
                self.dtype
            )));
        }
        f(bytes)
    }
}

impl TokenSource for DocumentTokens {
    fn name(&self) -> String {
        format!("field `{}`", self.name)
    }

    fn dtype(&self) -> DType {
        self.dtype
    }

    fn documents(&self) -> u64 {
        self.dataset.len()
    }

    fn document_len(&self, doc: u64) -> Result<u64> {
        self.with_bytes(doc, |b| Ok((b.len() / self.dtype.size()) as u64))
    }

    fn read(&self, doc: u64, start: u64, out: &mut [u32]) -> Result<()> {
        self.with_bytes(doc, |bytes| {
            let item = self.dtype.size();
            let tokens = (bytes.len() / item) as u64;
            let n = out.len() as u64;
            if start.checked_add(n).is_none_or(|end| end > tokens) {
                return Err(Error::OutOfRange {
                    index: start.saturating_add(n),
                    len: tokens,
                });
            }
            let at = start as usize * item;
            decode_tokens(
                &bytes[at..at + out.len() * item],
                self.dtype,
                out,
                |i, v| {
                    Error::mismatch(format!(
                        "field `{}` of sample {doc}: token {} is {v}, not a token id",
                        self.name,
                        start + i as u64
                    ))
                },
            )
        })
    }

    fn check_unchanged(&self) -> Result<()> {
        self.dataset.check_unchanged()
    }

    /// The dataset's fingerprint with the field and dtype read; for a dataset without one
    /// (shards, whose later documents may have to be fetched), the first 16 documents'
    /// lengths and first tokens.
    fn fingerprint(&self) -> Result<u64> {
        match self.dataset.fingerprint()? {
            Some(f) => Ok(crate::file::combined_fingerprint([
                f,
                self.field as u64,
                self.dtype.size() as u64,
            ])),
            None => super::documents_fingerprint(self, 16, false),
        }
    }
}
