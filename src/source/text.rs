//! [`TextColumn`]: the text of one field of a source, row by row: the documents a tokenizer
//! reads.
//!
//! Any source whose rows carry text gives documents: a string column of a Parquet or Arrow
//! table, a string key of JSON lines, a `utf8` field of packed records or shards. A field is
//! text when its schema says so ([`Codec::Utf8`]) or when it holds untagged bytes
//! ([`Codec::Raw`]: Parquet `binary`, a WebDataset `.txt` member), which are then checked to
//! be UTF-8 row by row. A tensor field, an image or a list of numbers is refused when the
//! column is opened, naming the field and what it holds, so that a wrong `--text-field` fails
//! before any worker starts.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::format::{Codec, FieldKind};
use crate::source::{Sample, Source};

/// One text field of a source: row `i`'s text is document `i`.
pub struct TextColumn {
    source: Arc<dyn Source>,
    field: usize,
    name: String,
}

impl TextColumn {
    /// The field `name` of `source`, checked to hold text. A name the schema lacks is an
    /// [`Error::Mismatch`] listing the fields there are; a field that holds something else
    /// than text, one naming what it holds.
    pub fn new(source: Arc<dyn Source>, name: &str) -> Result<TextColumn> {
        let schema = source.schema();
        let Some(field) = schema.index_of(name) else {
            let names: Vec<&str> = schema.fields().iter().map(|f| f.name.as_str()).collect();
            return Err(Error::Mismatch {
                what: format!(
                    "the {} data set has no field `{name}` to read text from; its fields: {}",
                    source.format().title(),
                    names.join(", ")
                ),
            });
        };
        let holds = match &schema.fields()[field].kind {
            FieldKind::Bytes {
                codec: Codec::Utf8 | Codec::Raw,
            } => None,
            FieldKind::Bytes { codec } => Some(format!("bytes of codec `{}`", codec.name())),
            FieldKind::Tensor { dtype, shape } => {
                Some(format!("a tensor of {} with shape {shape:?}", dtype.name()))
            }
        };
        if let Some(holds) = holds {
            return Err(Error::Mismatch {
                what: format!(
                    "the field `{name}` of the {} data set holds {holds}, not text",
                    source.format().title()
                ),
            });
        }
        Ok(TextColumn {
            source,
            field,
            name: name.to_owned(),
        })
    }

    /// The number of documents (the source's rows).
    pub fn len(&self) -> u64 {
        self.source.len()
    }

    /// True when there is no document.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The field's name.
    pub fn field_name(&self) -> &str {
        &self.name
    }

    /// The source the documents come from.
    pub fn source(&self) -> &Arc<dyn Source> {
        &self.source
    }

    /// Document `row`: the row read, its text borrowed from it. Text that is not UTF-8 is an
    /// [`Error::Mismatch`] naming the row, the field and the byte where the text breaks.
    pub fn text(&self, row: u64) -> Result<Text<'_>> {
        let sample = self.source.get(row)?;
        let bytes = sample.try_field(self.field)?;
        if let Err(e) = std::str::from_utf8(bytes) {
            return Err(Error::Mismatch {
                what: format!(
                    "row {row} of the {} data set: the field `{}` is not UTF-8 text (it breaks \
                     at byte {})",
                    self.source.format().title(),
                    self.name,
                    e.valid_up_to()
                ),
            });
        }
        Ok(Text {
            sample,
            field: self.field,
        })
    }
}

/// One document's text, borrowed from the row it was read from.
pub struct Text<'a> {
    sample: Sample<'a>,
    field: usize,
}

impl Text<'_> {
    /// The text.
    pub fn as_str(&self) -> &str {
        let bytes = self.sample.field(self.field).unwrap_or_default();
        // Checked to be UTF-8 when the row was read (`TextColumn::text`); a field read twice
        // from the same sample is the same bytes.
        std::str::from_utf8(bytes).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{DType, Field, RecordWriter, Schema};
    use crate::source::{OpenOptions, open};

    fn opened(path: &std::path::Path) -> Arc<dyn Source> {
        Arc::from(open(path, &OpenOptions::default()).unwrap())
    }

    #[test]
    fn a_string_key_of_json_lines_gives_each_line_s_text_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.jsonl");
        std::fs::write(
            &p,
            "{\"text\": \"héllo\", \"n\": 1}\n{\"text\": \"\", \"n\": 2}\n{\"text\": \"日本\", \"n\": 3}\n",
        )
        .unwrap();
        let column = TextColumn::new(opened(&p), "text").unwrap();
        assert_eq!(column.len(), 3);
        let texts: Vec<String> = (0..3)
            .map(|i| column.text(i).unwrap().as_str().to_owned())
            .collect();
        assert_eq!(texts, ["héllo", "", "日本"]);
    }

    #[test]
    fn a_missing_field_lists_the_fields_and_a_number_field_is_not_text() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.jsonl");
        std::fs::write(&p, "{\"text\": \"a\", \"n\": 1}\n").unwrap();
        let e = TextColumn::new(opened(&p), "body")
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("no field `body`") && e.contains("text, n"),
            "{e}"
        );
        let e = TextColumn::new(opened(&p), "n").err().unwrap().to_string();
        assert!(e.contains("field `n`") && e.contains("not text"), "{e}");
    }

    #[test]
    fn untagged_bytes_that_are_not_utf8_name_the_row_and_the_byte() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.gfd");
        let schema = Schema::new(vec![
            Field::bytes("body", Codec::Raw),
            Field::tensor("id", DType::U32, &[]),
        ])
        .unwrap();
        let mut w = RecordWriter::create(&p, schema).unwrap();
        w.append(&[b"fine", &0u32.to_le_bytes()]).unwrap();
        w.append(&[b"ab\xffc", &1u32.to_le_bytes()]).unwrap();
        w.finish().unwrap();
        let column = TextColumn::new(opened(&p), "body").unwrap();
        assert_eq!(column.text(0).unwrap().as_str(), "fine");
        let e = column.text(1).err().unwrap().to_string();
        assert!(
            e.contains("row 1") && e.contains("`body`") && e.contains("byte 2"),
            "{e}"
        );
        let e = TextColumn::new(opened(&p), "id").err().unwrap().to_string();
        assert!(e.contains("a tensor of u32"), "{e}");
    }
}
