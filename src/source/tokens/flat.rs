//! [`FlatTokens`]: one flat run of tokens, nanoGPT's `train.bin` or a 1-D `.npy` array.
//!
//! nanoGPT's `prepare.py` writes its token ids with `np.memmap(path, dtype=np.uint16,
//! mode='w+')` (or `arr.tofile`): raw little-endian integers, no header, documents separated
//! only by the end-of-text token inside the stream. Such a file is one document here: the
//! token loader cuts it into rows (windows in concatenated mode, row-long pieces when packed).
//! A `.npy` array of one dimension is read through [`NpyArray`](crate::NpyArray), in place.

use std::path::{Path, PathBuf};

use super::{TokenSource, decode_tokens, is_token_dtype};
use crate::error::{Error, Result};
use crate::file::{FileData, FileIdentity, ReadMode, open_file};
use crate::format::DType;
use crate::source::NpyArray;

/// A flat run of tokens: one document of every token of a file.
pub struct FlatTokens {
    path: PathBuf,
    dtype: DType,
    /// Where the tokens start in the file (a `.npy` header's length; 0 for raw files).
    offset: u64,
    tokens: u64,
    data: Bytes,
}

/// The file behind a [`FlatTokens`]: opened here, or an [`NpyArray`]'s.
enum Bytes {
    Raw(FileData, FileIdentity),
    Npy(NpyArray),
}

impl std::fmt::Debug for FlatTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlatTokens")
            .field("path", &self.path)
            .field("dtype", &self.dtype)
            .field("tokens", &self.tokens)
            .finish()
    }
}

impl FlatTokens {
    /// Maps a raw file of little-endian tokens of `dtype` (nanoGPT's `train.bin`: `U16`).
    pub fn open(path: impl AsRef<Path>, dtype: DType) -> Result<FlatTokens> {
        FlatTokens::open_with(path, dtype, ReadMode::Map)
    }

    /// Opens a raw file of tokens of `dtype`, read as `mode` says. Its size must be a whole
    /// number of tokens.
    pub fn open_with(path: impl AsRef<Path>, dtype: DType, mode: ReadMode) -> Result<FlatTokens> {
        let path = path.as_ref();
        if !is_token_dtype(dtype) {
            return Err(Error::config(
                "token_dtype",
                format!("{dtype} is not a token dtype: token ids are integers (u16, u32, ...)"),
            ));
        }
        let (data, identity) = open_file(path, mode)?;
        let item = dtype.size() as u64;
        if !data.len().is_multiple_of(item) {
            return Err(Error::Malformed {
                path: path.to_path_buf(),
                format: "flat token",
                what: format!(
                    "{} bytes are not a whole number of {dtype} tokens ({item} bytes each): the file is truncated, or its tokens are of another dtype",
                    data.len()
                ),
            });
        }
        Ok(FlatTokens {
            path: path.to_path_buf(),
            dtype,
            offset: 0,
            tokens: data.len() / item,
            data: Bytes::Raw(data, identity),
        })
    }

    /// Maps a 1-D `.npy` array of integers.
    pub fn open_npy(path: impl AsRef<Path>) -> Result<FlatTokens> {
        FlatTokens::open_npy_with(path, ReadMode::Map)
    }

    /// Opens a 1-D `.npy` array of integers, read as `mode` says.
    pub fn open_npy_with(path: impl AsRef<Path>, mode: ReadMode) -> Result<FlatTokens> {
        let path = path.as_ref();
        let array = NpyArray::open_with(path, NpyArray::FIELD, mode)?;
        if array.shape().len() != 1 {
            return Err(Error::UnsupportedNpy {
                path: path.to_path_buf(),
                what: format!(
                    "shape {:?}: tokens are a 1-D array (reshape it with arr.reshape(-1), or read documents of a 2-D array with DocumentTokens)",
                    array.shape()
                ),
            });
        }
        if !is_token_dtype(array.dtype()) {
            return Err(Error::UnsupportedNpy {
                path: path.to_path_buf(),
                what: format!("dtype {}: token ids are integers", array.dtype()),
            });
        }
        Ok(FlatTokens {
            path: path.to_path_buf(),
            dtype: array.dtype(),
            offset: array.data_offset() as u64,
            tokens: array.shape()[0],
            data: Bytes::Npy(array),
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tokens in the file.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    fn file(&self) -> &FileData {
        match &self.data {
            Bytes::Raw(data, _) => data,
            Bytes::Npy(array) => array.file_data(),
        }
    }
}

impl TokenSource for FlatTokens {
    fn name(&self) -> String {
        self.path.display().to_string()
    }

    fn dtype(&self) -> DType {
        self.dtype
    }

    fn documents(&self) -> u64 {
        1
    }

    fn document_len(&self, doc: u64) -> Result<u64> {
        if doc != 0 {
            return Err(Error::OutOfRange { index: doc, len: 1 });
        }
        Ok(self.tokens)
    }

    fn read(&self, doc: u64, start: u64, out: &mut [u32]) -> Result<()> {
        let n = out.len() as u64;
        if doc != 0 || start.checked_add(n).is_none_or(|end| end > self.tokens) {
            return Err(Error::OutOfRange {
                index: start.saturating_add(n),
                len: self.tokens,
            });
        }
        let item = self.dtype.size() as u64;
        let bytes =
            self.file()
                .bytes_at(&self.path, self.offset + start * item, (n * item) as usize)?;
        decode_tokens(&bytes, self.dtype, out, |i, v| Error::Malformed {
            path: self.path.clone(),
            format: "flat token",
            what: format!("token {} is {v}, not a token id", start + i as u64),
        })
    }

    fn check_unchanged(&self) -> Result<()> {
        match &self.data {
            Bytes::Raw(_, identity) => identity.check(&self.path),
            Bytes::Npy(array) => array.check_unchanged(),
        }
    }

    /// The file's size and 256 KiB sampled evenly over it.
    fn fingerprint(&self) -> Result<u64> {
        self.file().fingerprint(&self.path)
    }
}
