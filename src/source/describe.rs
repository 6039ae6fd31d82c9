//! What an opened data set is, for people and machines: its [`Format`] and a [`Description`]
//! (the facts `gpufeed inspect` prints), as every source gives them through
//! [`Source`](super::Source).
//!
//! A description is plain data: an ordered list of [`Fact`]s, each with a key for JSON and a
//! label and text for people, so that the command prints any format the same way and a new
//! format needs no printing code of its own. This module imports no other source module: the
//! formats (and the front door, [`open`](super::open())) import it.

use serde_json::Value;

use crate::format::{FieldKind, Schema};

/// The formats a data set can be in, as the front door tells them apart
/// ([`detect`](super::detect)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Format {
    /// gpufeed's packed record file.
    Packed,
    /// A NumPy `.npy` array, one row a sample.
    Npy,
    /// An ImageFolder: class directories of JPEG/PNG files (torchvision's).
    ImageFolder,
    /// gpufeed's packed shards: a directory (or URL) with its `index.json`.
    PackedShards,
    /// MosaicML Streaming's MDS: a directory (or URL) with its `index.json`.
    Mds,
    /// WebDataset `.tar` shards.
    WebDataset,
    /// Apache Parquet files.
    Parquet,
    /// Arrow IPC files (Hugging Face `datasets`' `save_to_disk` directories and cache files).
    Arrow,
    /// JSON lines (`.jsonl`, compressed or not).
    JsonLines,
    /// Megatron-LM's indexed dataset of tokens (`prefix.bin` + `prefix.idx`): a token source,
    /// read by the token loader.
    MegatronTokens,
    /// Several files of one format read as one data set.
    Concat,
}

impl Format {
    /// The name the command prints and JSON carries (`packed`, `npy`, `parquet`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Format::Packed => "packed",
            Format::Npy => "npy",
            Format::ImageFolder => "imagefolder",
            Format::PackedShards => "packed shards",
            Format::Mds => "MDS",
            Format::WebDataset => "webdataset tar",
            Format::Parquet => "parquet",
            Format::Arrow => "arrow",
            Format::JsonLines => "jsonl",
            Format::MegatronTokens => "megatron",
            Format::Concat => "concat",
        }
    }

    /// Its name for people (`packed record file`, `.npy array`, `Parquet`, ...).
    pub fn title(self) -> &'static str {
        match self {
            Format::Packed => "packed record file",
            Format::Npy => ".npy array",
            Format::ImageFolder => "ImageFolder",
            Format::PackedShards => "packed shards",
            Format::Mds => "MDS shards (MosaicML Streaming)",
            Format::WebDataset => "WebDataset tar shards",
            Format::Parquet => "Parquet",
            Format::Arrow => "Arrow IPC (Hugging Face datasets)",
            Format::JsonLines => "JSON lines",
            Format::MegatronTokens => "Megatron indexed dataset",
            Format::Concat => "several data sets of one schema",
        }
    }

    /// Whether samples of this format are read a shard (a file, an object) at a time, so that
    /// the loader's two-level shuffle fits them best.
    pub fn is_sharded(self) -> bool {
        matches!(
            self,
            Format::PackedShards | Format::Mds | Format::WebDataset
        )
    }
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One fact of a [`Description`]: its JSON key and value, and its label and text for people.
#[derive(Clone, Debug, PartialEq)]
pub struct Fact {
    /// The key in the JSON object (`records`, `row_groups`); empty for a fact shown only as
    /// text.
    pub key: &'static str,
    /// The label of its line of text (`records`, `row groups`); empty for a fact only in JSON.
    pub label: &'static str,
    /// The value in JSON.
    pub value: Value,
    /// The value as people read it (may span lines: each line after the first is indented).
    pub text: String,
}

/// What `gpufeed inspect` prints of a data set: where it is, its format, its samples and
/// fields, and the facts its format has (sizes, compression, row groups, shards...), in order.
#[derive(Clone, Debug, PartialEq)]
pub struct Description {
    /// The data set as the user named it.
    pub location: String,
    /// Its format.
    pub format: Format,
    /// Its samples.
    pub samples: u64,
    /// The fields every sample has.
    pub schema: Schema,
    /// The format's own facts, in the order they are shown.
    pub facts: Vec<Fact>,
}

impl Description {
    /// A description with no facts yet.
    pub fn new(location: impl Into<String>, format: Format, samples: u64, schema: Schema) -> Self {
        Description {
            location: location.into(),
            format,
            samples,
            schema,
            facts: Vec::new(),
        }
    }

    /// Adds a fact shown in JSON under `key` and as text under `label`.
    pub fn fact(
        mut self,
        key: &'static str,
        label: &'static str,
        value: impl Into<Value>,
        text: impl Into<String>,
    ) -> Self {
        self.facts.push(Fact {
            key,
            label,
            value: value.into(),
            text: text.into(),
        });
        self
    }

    /// Adds a number shown as itself.
    pub fn count(self, key: &'static str, label: &'static str, n: u64) -> Self {
        self.fact(key, label, n, n.to_string())
    }

    /// The fact under JSON key `key`, if there is one.
    pub fn get(&self, key: &str) -> Option<&Fact> {
        self.facts
            .iter()
            .find(|f| !f.key.is_empty() && f.key == key)
    }

    /// The description as one JSON object: `path`, `format`, `records`, `fields`, then every
    /// fact's key.
    pub fn to_json(&self) -> Value {
        let mut map = serde_json::Map::new();
        map.insert("path".into(), self.location.clone().into());
        map.insert("format".into(), self.format.name().into());
        map.insert("records".into(), self.samples.into());
        map.insert("fields".into(), fields_json(&self.schema));
        for f in self.facts.iter().filter(|f| !f.key.is_empty()) {
            map.insert(f.key.into(), f.value.clone());
        }
        Value::Object(map)
    }

    /// The description as lines of text: `label:` padded to a column, then the value.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        line(&mut out, "data set", &self.location);
        line(&mut out, "format", self.format.title());
        line(&mut out, "records", &self.samples.to_string());
        out.push_str("fields:\n");
        out.push_str(&fields_text(&self.schema));
        for f in self.facts.iter().filter(|f| !f.label.is_empty()) {
            line(&mut out, f.label, &f.text);
        }
        out
    }
}

/// Appends `label: text` (continuation lines indented to the value's column).
fn line(out: &mut String, label: &str, text: &str) {
    let mut lines = text.lines();
    let first = lines.next().unwrap_or("");
    out.push_str(&format!("{:<15}{first}\n", format!("{label}:")));
    for rest in lines {
        out.push_str(&format!("{:<15}{rest}\n", ""));
    }
}

/// The fields of a schema as JSON: name, kind, and dtype and shape (tensors) or codec (bytes).
pub fn fields_json(schema: &Schema) -> Value {
    let fields: Vec<Value> = schema
        .fields()
        .iter()
        .enumerate()
        .map(|(k, f)| match &f.kind {
            FieldKind::Tensor { dtype, shape } => serde_json::json!({
                "name": f.name,
                "kind": "tensor",
                "dtype": dtype.name(),
                "shape": shape,
                "bytes": schema.fixed_range(k).map_or(0, |r| r.len()),
            }),
            FieldKind::Bytes { codec } => serde_json::json!({
                "name": f.name,
                "kind": "bytes",
                "codec": codec.name(),
            }),
        })
        .collect();
    Value::Array(fields)
}

/// The fields of a schema, one a line, indented.
pub fn fields_text(schema: &Schema) -> String {
    let mut out = String::new();
    for f in schema.fields() {
        let what = match &f.kind {
            FieldKind::Tensor { dtype, shape } => format!("{dtype} {shape:?}"),
            FieldKind::Bytes { codec } => format!("bytes, codec {}", codec.name()),
        };
        out.push_str(&format!("  {:<16} {what}\n", f.name));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{DType, Field};

    #[test]
    fn a_description_prints_every_fact_as_text_and_json() {
        let schema = Schema::new(vec![Field::tensor("x", DType::U8, &[2])]).unwrap();
        let d = Description::new("data/x.gfd", Format::Packed, 3, schema)
            .count("file_bytes", "file bytes", 1024)
            .fact(
                "sizes",
                "sizes",
                serde_json::json!({"min": 1}),
                "1 to 2\nexact",
            );
        let text = d.to_text();
        assert!(text.starts_with("data set:      data/x.gfd\nformat:        packed record file\n"));
        assert!(text.contains("file bytes:    1024\n"), "{text}");
        assert!(
            text.contains("sizes:         1 to 2\n               exact\n"),
            "{text}"
        );
        let json = d.to_json();
        assert_eq!(json["records"], 3);
        assert_eq!(json["file_bytes"], 1024);
        assert_eq!(json["sizes"]["min"], 1);
        assert_eq!(json["fields"][0]["name"], "x");
        assert_eq!(d.get("file_bytes").map(|f| f.text.as_str()), Some("1024"));
    }
}
