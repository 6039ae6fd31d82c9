//! Writes the tables the hub-format device runs read, as the hub's writers lay them out, so
//! that the machine measured needs no pyarrow:
//!
//! - `hub_tables numbers DIR ROWS DIM`: `DIR/numbers.parquet` (a `x` column of fixed-size
//!   lists of `DIM` f32 and an i64 `label`, row groups of 65,536 rows, snappy, as pyarrow
//!   writes numbers) and the same data as `DIR/numbers.npy` (`x`) and `DIR/labels.npy`;
//! - `hub_tables images FOLDER OUT.parquet`: an ImageFolder (class directories of JPEGs) as
//!   `datasets` writes an Image feature: an `image` struct of `bytes` and `path` and an i64
//!   `label` (the class's index), in the folder's order, row groups of 1,000 rows, snappy.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::types::Float32Type;
use arrow_array::{
    ArrayRef, BinaryArray, FixedSizeListArray, Int64Array, RecordBatch, StringArray, StructArray,
};
use arrow_schema::{DataType, Field};
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn writer(
    path: &Path,
    batch: &RecordBatch,
    group_rows: usize,
) -> Result<ArrowWriter<std::fs::File>> {
    let props = WriterProperties::builder()
        .set_max_row_group_row_count(Some(group_rows))
        .set_compression(Compression::SNAPPY)
        .build();
    Ok(ArrowWriter::try_new(
        std::fs::File::create(path)?,
        batch.schema(),
        Some(props),
    )?)
}

/// The value of row `r`, element `k`: cheap, varied, exact in f32.
fn value(r: usize, k: usize) -> f32 {
    ((r * 31 + k * 7) % 4093) as f32 * 0.25
}

fn npy_header(descr: &str, shape: &str) -> Vec<u8> {
    let dict = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    let mut h = b"\x93NUMPY\x01\x00".to_vec();
    let len = (dict.len() + 1).div_ceil(64) * 64 + 64 - 10;
    let body = format!("{dict:<width$}\n", width = len - 1);
    h.extend_from_slice(&(body.len() as u16).to_le_bytes());
    h.extend_from_slice(body.as_bytes());
    h
}

fn numbers(dir: &Path, rows: usize, dim: usize) -> Result<()> {
    use std::io::Write;
    std::fs::create_dir_all(dir)?;
    let mut x_npy = std::io::BufWriter::new(std::fs::File::create(dir.join("numbers.npy"))?);
    x_npy.write_all(&npy_header("<f4", &format!("({rows}, {dim})")))?;
    let mut labels = Vec::with_capacity(rows * 8);
    let step = 8192;
    let mut w = None;
    for start in (0..rows).step_by(step) {
        let end = (start + step).min(rows);
        let x = FixedSizeListArray::from_iter_primitive::<Float32Type, _, _>(
            (start..end).map(|r| Some((0..dim).map(move |k| Some(value(r, k))))),
            dim as i32,
        );
        for r in start..end {
            for k in 0..dim {
                x_npy.write_all(&value(r, k).to_le_bytes())?;
            }
            labels.extend_from_slice(&((r % 1000) as i64).to_le_bytes());
        }
        let label = Int64Array::from_iter_values((start..end).map(|r| (r % 1000) as i64));
        let batch = RecordBatch::try_from_iter([
            ("x", Arc::new(x) as ArrayRef),
            ("label", Arc::new(label) as ArrayRef),
        ])?;
        let w = match &mut w {
            Some(w) => w,
            None => w.insert(writer(&dir.join("numbers.parquet"), &batch, 65_536)?),
        };
        w.write(&batch)?;
    }
    if let Some(w) = w {
        w.close()?;
    }
    x_npy.flush()?;
    let mut l = npy_header("<i8", &format!("({rows},)"));
    l.extend_from_slice(&labels);
    std::fs::write(dir.join("labels.npy"), l)?;
    Ok(())
}

fn images(folder: &Path, out: &Path) -> Result<()> {
    let mut classes: Vec<PathBuf> = std::fs::read_dir(folder)?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    classes.retain(|p| p.is_dir());
    classes.sort();
    let mut files: Vec<(PathBuf, i64)> = Vec::new();
    for (label, class) in classes.iter().enumerate() {
        let mut these: Vec<PathBuf> = std::fs::read_dir(class)?
            .map(|e| e.map(|e| e.path()))
            .collect::<std::io::Result<_>>()?;
        these.sort();
        files.extend(these.into_iter().map(|f| (f, label as i64)));
    }
    let mut w = None;
    for part in files.chunks(1000) {
        let bytes = part
            .iter()
            .map(|(f, _)| std::fs::read(f))
            .collect::<std::io::Result<Vec<_>>>()?;
        let paths = StringArray::from_iter_values(part.iter().map(|(f, _)| {
            f.file_name()
                .map_or(String::new(), |n| n.to_string_lossy().into_owned())
        }));
        let image = StructArray::from(vec![
            (
                Arc::new(Field::new("bytes", DataType::Binary, true)),
                Arc::new(BinaryArray::from_iter_values(bytes.iter())) as ArrayRef,
            ),
            (
                Arc::new(Field::new("path", DataType::Utf8, true)),
                Arc::new(paths) as ArrayRef,
            ),
        ]);
        let label = Int64Array::from_iter_values(part.iter().map(|(_, l)| *l));
        let batch = RecordBatch::try_from_iter([
            ("image", Arc::new(image) as ArrayRef),
            ("label", Arc::new(label) as ArrayRef),
        ])?;
        let w = match &mut w {
            Some(w) => w,
            None => w.insert(writer(out, &batch, 1000)?),
        };
        w.write(&batch)?;
    }
    match w {
        Some(w) => {
            w.close()?;
            println!("{}: {} images", out.display(), files.len());
            Ok(())
        }
        None => Err(format!("{}: no class directories of images", folder.display()).into()),
    }
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["numbers", dir, rows, dim] => numbers(Path::new(dir), rows.parse()?, dim.parse()?),
        ["images", folder, out] => images(Path::new(folder), Path::new(out)),
        _ => Err(
            "usage: hub_tables numbers DIR ROWS DIM | hub_tables images FOLDER OUT.parquet".into(),
        ),
    }
}
