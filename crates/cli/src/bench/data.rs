//! The data set a bench reads: the embedded default written to a temporary directory, a named
//! file or shard set opened, the page cache warmed, the bytes of a sample.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpufeed::format::{Codec, DType, Field, FieldKind, RecordWriter, Schema};
use gpufeed::source::{Dataset, NpyArray, Source, Zip};
use gpufeed::transform::{CopyFields, SampleTransform};
use gpufeed::{Error, Result};

use crate::messages::progress;

/// Records of the generated default data set.
pub(super) const DEFAULT_RECORDS: u64 = 8192;

/// Bytes of each generated record's data field (3x224x224).
pub(super) const DEFAULT_RECORD_BYTES: u64 = 150_528;

/// Writes the default data set into `dir`: `records` records of `record_bytes` pseudo-random
/// bytes and a u32 label. 150528-byte records get the shape [3, 224, 224].
pub(super) fn generate(
    dir: &Path,
    records: u64,
    record_bytes: u64,
    quiet: bool,
) -> Result<PathBuf> {
    let file = dir.join("default.gfd");
    let shape: Vec<u64> = if record_bytes == 3 * 224 * 224 {
        vec![3, 224, 224]
    } else {
        vec![record_bytes]
    };
    let schema = Schema::new(vec![
        Field::tensor("image", DType::U8, &shape),
        Field::tensor("label", DType::U32, &[]),
    ])
    .map_err(|e| Error::InvalidConfig {
        setting: "--record-bytes",
        what: e.to_string(),
    })?;
    let mut w = RecordWriter::create(&file, schema)?;
    let bar = progress(records, "writing the default data set", quiet);
    if bar.is_hidden() {
        // No bar (not a terminal, or --json): say what the wait is for, on stderr.
        eprintln!(
            "gpufeed: writing the default data set ({records} records of {record_bytes} bytes, {}) to a temporary directory, then reading it; name a DATASET to bench your own",
            gpufeed::memory::human_bytes(records.saturating_mul(record_bytes + 4))
        );
    }
    let mut buf = vec![0u8; record_bytes as usize];
    let mut state = 0x2545_f491_4f6c_dd1du64;
    for i in 0..records {
        for chunk in buf.chunks_mut(8) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            chunk.copy_from_slice(&state.to_le_bytes()[..chunk.len()]);
        }
        w.append(&[&buf, &((i % 1000) as u32).to_le_bytes()])?;
        bar.inc(1);
    }
    w.finish()?;
    bar.finish_and_clear();
    Ok(file)
}

/// Reads a file once so that its pages are in the page cache, as PyTorch's baseline does.
pub(super) fn warm_page_cache(path: &Path) -> Result<()> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        op: "open",
        source: e,
    })?;
    let mut buf = vec![0u8; 64 << 20];
    loop {
        match f.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e) => {
                return Err(Error::Io {
                    path: path.to_path_buf(),
                    op: "read",
                    source: e,
                });
            }
        }
    }
}

/// What `transform` makes of `schema`'s records: the bytes of a sample's fixed fields, and the
/// names of its variable-size (ragged) fields; with the command's advice for a field of
/// encoded images that no `--fields` named.
pub(super) fn sample_bytes(
    path: &Path,
    schema: &Schema,
    transform: &CopyFields,
    fields_named: bool,
) -> Result<(u64, Vec<String>)> {
    let outputs = transform.output(schema)?;
    let encoded = outputs.iter().find(|f| {
        let stored = schema.index_of(&f.name).map(|k| &schema.fields()[k].kind);
        matches!(
            stored,
            Some(FieldKind::Bytes {
                codec: Codec::Jpeg | Codec::Png
            })
        )
    });
    if let (Some(f), false) = (encoded, fields_named) {
        return Err(Error::user(format!(
            "{}: its field `{}` holds encoded images: run the image pipeline with \
             gpufeed bench --images {}, or name the fields to batch with --fields NAME,... \
             (an encoded field named there is batched as its bytes)",
            path.display(),
            f.name,
            path.display(),
        )));
    }
    let fixed = outputs.iter().map(|f| f.sample_bytes() as u64).sum();
    let ragged = outputs
        .iter()
        .filter(|f| f.ragged)
        .map(|f| f.name.clone())
        .collect();
    Ok((fixed, ragged))
}

/// The data set opened, zipped with `--labels` (a .npy array read as the field `label`) if
/// given.
pub(super) fn with_labels(
    path: &Path,
    data: Arc<dyn Source>,
    labels: Option<&Path>,
    options: gpufeed::format::ReadOptions,
) -> Result<Arc<dyn Dataset>> {
    let Some(labels) = labels else {
        return Ok(data);
    };
    let label = labels.display().to_string();
    let labels: Arc<dyn Dataset> = Arc::new(NpyArray::open_with(labels, "label", options)?);
    let data: Arc<dyn Dataset> = data;
    let zipped = Zip::new([(path.display().to_string(), data), (label, labels)])?;
    Ok(Arc::new(zipped))
}
