//! [`TextTokens`]: documents of text and the user's tokenizer, a token source whose token
//! counts are learned as it is read.
//!
//! Any text field of any source ([`TextColumn`]: a string column of Parquet, Arrow or JSON
//! lines, local or on S3; a `utf8` field of packed records or shards) with a [`Tokenizer`]:
//! document `i` is row `i`'s text, its ids what the tokenizer gives (the EOS appended by
//! default, Megatron's `--append-eod`; an empty text is the template and the EOS alone).
//!
//! Unlike a pre-tokenized [`TokenSource`](super::TokenSource), nothing here knows a document's
//! length before it is tokenized: the token loader tokenizes windows of documents as its
//! stream reaches them, in its worker threads, one [`Encoder`] per thread and one document per
//! call ([`encode`](TextTokens::encode)); see [`tokens`](crate::tokens).

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};
use crate::source::TextColumn;
use crate::source::{OpenOptions, Source, open};
use crate::tokenizer::{Encoder, Tokenizer};

/// A text field and a tokenizer: the documents a token loader tokenizes as it reads them.
pub struct TextTokens {
    column: TextColumn,
    tokenizer: Tokenizer,
    /// Tells this source's encoders apart in a thread's set of them.
    id: u64,
}

static TEXT_SOURCES: AtomicU64 = AtomicU64::new(0);

impl std::fmt::Debug for TextTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokens")
            .field("field", &self.column.field_name())
            .field("documents", &self.column.len())
            .field("tokenizer", &self.tokenizer.path())
            .finish()
    }
}

impl TextTokens {
    /// The documents of `column`, tokenized by `tokenizer`. A column without a document is
    /// an error naming `text_field`.
    pub fn new(column: TextColumn, tokenizer: Tokenizer) -> Result<TextTokens> {
        if column.is_empty() {
            return Err(Error::config(
                "text_field",
                format!(
                    "the {} data set has no row: no document to read the field `{}` of",
                    column.source().format().title(),
                    column.field_name()
                ),
            ));
        }
        Ok(TextTokens {
            column,
            tokenizer,
            id: TEXT_SOURCES.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// Opens `name` through the front door ([`open`]) and reads its field `text_field` as
    /// text. A field the data lacks, or one that is not text, is an [`Error::InvalidConfig`]
    /// naming `text_field` (what the field holds, or the fields there are).
    pub fn open(
        name: impl AsRef<Path>,
        options: &OpenOptions,
        text_field: &str,
        tokenizer: Tokenizer,
    ) -> Result<TextTokens> {
        let source: Arc<dyn Source> = Arc::from(open(name, options)?);
        let column = TextColumn::new(source, text_field).map_err(|e| match e {
            Error::Mismatch { what } => Error::config("text_field", what),
            other => other,
        })?;
        TextTokens::new(column, tokenizer)
    }

    /// What this is, for messages and reports: the field and the tokenizer.
    pub fn name(&self) -> String {
        format!(
            "text field `{}` ({})",
            self.column.field_name(),
            self.tokenizer
                .path()
                .file_name()
                .map_or_else(|| "tokenizer".into(), |n| n.to_string_lossy())
        )
    }

    /// The documents (the source's rows).
    pub fn documents(&self) -> u64 {
        self.column.len()
    }

    /// The text read.
    pub fn column(&self) -> &TextColumn {
        &self.column
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Tells this source apart from every other of the process.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Appends document `doc`'s ids to `out` with `encoder` (one of this source's
    /// tokenizer's) and returns how many. Text that is not UTF-8, and a document the tokenizer
    /// fails on, are errors naming the document.
    pub fn encode(&self, doc: u64, encoder: &mut Encoder, out: &mut Vec<u32>) -> Result<usize> {
        let text = self.column.text(doc)?;
        encoder
            .encode_into(text.as_str(), out)
            .map_err(|e| Error::Mismatch {
                what: format!(
                    "document {doc} (row {doc} of the field `{}`): {e}",
                    self.column.field_name()
                ),
            })
    }

    /// Checks that the files read are still the ones opened.
    pub fn check_unchanged(&self) -> Result<()> {
        self.column.source().check_unchanged()
    }

    /// A hash of what identifies the ids this source gives: the data set's fingerprint (or,
    /// for one without, its rows and the first 16 documents' text), the field, the
    /// tokenizer.json's bytes and the ids put around each document. A state taken with
    /// another tokenizer or other text is refused on resume.
    pub fn fingerprint(&self) -> Result<u64> {
        let mut hash = xxhash_rust::xxh3::Xxh3::new();
        match self.column.source().fingerprint()? {
            Some(f) => hash.update(&f.to_le_bytes()),
            None => {
                hash.update(&self.documents().to_le_bytes());
                for doc in 0..self.documents().min(16) {
                    hash.update(self.column.text(doc)?.as_str().as_bytes());
                }
            }
        }
        hash.update(self.column.field_name().as_bytes());
        let path = self.tokenizer.path();
        let json = std::fs::read(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            op: "read",
            source,
        })?;
        hash.update(&json);
        for id in [self.tokenizer.prepended(), self.tokenizer.appended()] {
            hash.update(&id.map_or(u64::MAX, u64::from).to_le_bytes());
        }
        hash.update(&[u8::from(self.tokenizer.adds_special_tokens())]);
        Ok(hash.digest())
    }
}
