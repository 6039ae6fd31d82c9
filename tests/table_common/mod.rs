//! Tables for the Parquet and Arrow tests: a record batch with a column of every kind the
//! readers map, each row's expected field bytes computed apart from Arrow, and writers.

#![allow(dead_code)]

use std::path::Path;
use std::sync::Arc;

use arrow_array::types::{Float32Type, Int16Type, Int32Type};
use arrow_array::{
    Array, ArrayRef, BinaryArray, BinaryViewArray, BooleanArray, DictionaryArray,
    FixedSizeBinaryArray, FixedSizeListArray, Float16Array, Float64Array, Int32Array, Int64Array,
    LargeBinaryArray, LargeListArray, LargeStringArray, ListArray, RecordBatch, StringArray,
    StringViewArray, StructArray, UInt8Array,
};
use arrow_schema::{DataType, Field};
use gpufeed::Dataset;

/// Each field's name and each row's expected bytes, in the readers' field order.
pub type Expected = Vec<(String, Vec<Vec<u8>>)>;

/// The PNG signature: what the image column's values start with, so that the field is
/// tagged PNG.
pub const PNG: &[u8] = b"\x89PNG\r\n\x1a\n";

/// A batch of `n` rows numbered from `start`, with a column of every kind; `views` adds
/// `Utf8View` and `BinaryView` columns. Returns the batch and, per field the readers make
/// (in order), each row's expected bytes.
pub fn every_kind(start: usize, n: usize, views: bool) -> (RecordBatch, Expected) {
    let v: Vec<usize> = (start..start + n).collect();
    let text = |v: usize| format!("row {v} {}", "é".repeat(v % 5));
    let mut cols: Vec<(&str, ArrayRef)> = vec![
        (
            "id",
            Arc::new(Int64Array::from_iter_values(v.iter().map(|&v| v as i64))),
        ),
        (
            "small",
            Arc::new(UInt8Array::from_iter_values(
                v.iter().map(|&v| (v % 256) as u8),
            )),
        ),
        (
            "half",
            Arc::new(Float16Array::from(
                v.iter()
                    .map(|&v| half::f16::from_f32(v as f32 * 0.5))
                    .collect::<Vec<_>>(),
            )),
        ),
        (
            "third",
            Arc::new(Float64Array::from_iter_values(
                v.iter().map(|&v| v as f64 / 3.0),
            )),
        ),
        (
            "flag",
            Arc::new(BooleanArray::from(
                v.iter().map(|&v| v % 3 == 0).collect::<Vec<_>>(),
            )),
        ),
        (
            "vec3",
            Arc::new(
                FixedSizeListArray::from_iter_primitive::<Float32Type, _, _>(
                    v.iter()
                        .map(|&v| Some((0..3).map(|k| Some((v + k) as f32)).collect::<Vec<_>>())),
                    3,
                ),
            ),
        ),
        ("mat", {
            let inner = FixedSizeListArray::from_iter_primitive::<Int16Type, _, _>(
                v.iter().flat_map(|&v| {
                    let v = v as i16;
                    [
                        Some(vec![Some(v), Some(v.wrapping_neg())]),
                        Some(vec![Some(v.wrapping_mul(2)), Some(v.wrapping_mul(3))]),
                    ]
                }),
                2,
            );
            let field = Arc::new(Field::new_list_field(inner.data_type().clone(), true));
            Arc::new(FixedSizeListArray::new(field, 2, Arc::new(inner), None))
        }),
        (
            "text",
            Arc::new(StringArray::from(
                v.iter().map(|&v| text(v)).collect::<Vec<_>>(),
            )),
        ),
        (
            "big_text",
            Arc::new(LargeStringArray::from(
                v.iter().map(|&v| "x".repeat(v % 20)).collect::<Vec<_>>(),
            )),
        ),
        (
            "blob",
            Arc::new(BinaryArray::from_iter_values(
                v.iter().map(|&v| vec![v as u8; v % 7]),
            )),
        ),
        (
            "big_blob",
            Arc::new(LargeBinaryArray::from_iter_values(
                v.iter().map(|&v| vec![(v * 7) as u8; v % 30]),
            )),
        ),
        (
            "fixed",
            Arc::new(
                FixedSizeBinaryArray::try_from_iter(v.iter().map(|&v| (v as u32).to_be_bytes()))
                    .unwrap(),
            ),
        ),
        (
            "tokens",
            Arc::new(ListArray::from_iter_primitive::<Int32Type, _, _>(
                v.iter().map(|&v| {
                    Some(
                        (0..v % 6)
                            .map(|k| Some((v * 10 + k) as i32))
                            .collect::<Vec<_>>(),
                    )
                }),
            )),
        ),
        (
            "floats",
            Arc::new(LargeListArray::from_iter_primitive::<Float32Type, _, _>(
                v.iter().map(|&v| {
                    Some(
                        (0..v % 4)
                            .map(|k| Some(k as f32 + 0.25))
                            .collect::<Vec<_>>(),
                    )
                }),
            )),
        ),
        (
            "animal",
            Arc::new(
                v.iter()
                    .map(|&v| ["cat", "dog", "bird"][v % 3])
                    .collect::<DictionaryArray<Int32Type>>(),
            ),
        ),
        ("meta", {
            let a: ArrayRef = Arc::new(Int32Array::from_iter_values(
                v.iter().map(|&v| v as i32 * 2),
            ));
            let b: ArrayRef = Arc::new(StringArray::from(
                v.iter().map(|&v| format!("b{v}")).collect::<Vec<_>>(),
            ));
            Arc::new(StructArray::from(vec![
                (Arc::new(Field::new("a", DataType::Int32, false)), a),
                (Arc::new(Field::new("b", DataType::Utf8, false)), b),
            ]))
        }),
        ("image", {
            let bytes: ArrayRef = Arc::new(BinaryArray::from_iter_values(
                v.iter().map(|&v| [PNG, &(v as u32).to_le_bytes()].concat()),
            ));
            let path: ArrayRef = Arc::new(StringArray::from(
                v.iter().map(|&v| format!("{v}.png")).collect::<Vec<_>>(),
            ));
            Arc::new(StructArray::from(vec![
                (Arc::new(Field::new("bytes", DataType::Binary, true)), bytes),
                (Arc::new(Field::new("path", DataType::Utf8, true)), path),
            ]))
        }),
    ];
    if views {
        cols.push((
            "text_view",
            Arc::new(StringViewArray::from(
                v.iter()
                    .map(|&v| text(v).repeat(1 + v % 3))
                    .collect::<Vec<_>>(),
            )),
        ));
        cols.push((
            "blob_view",
            Arc::new(BinaryViewArray::from_iter_values(
                v.iter().map(|&v| vec![v as u8; v % 17]),
            )),
        ));
    }
    let batch = RecordBatch::try_from_iter(cols).unwrap();
    let le = |x: &[Vec<u8>]| x.concat();
    let mut expected: Expected = vec![
        (
            "id".into(),
            v.iter()
                .map(|&v| (v as i64).to_le_bytes().to_vec())
                .collect(),
        ),
        (
            "small".into(),
            v.iter().map(|&v| vec![(v % 256) as u8]).collect(),
        ),
        (
            "half".into(),
            v.iter()
                .map(|&v| half::f16::from_f32(v as f32 * 0.5).to_le_bytes().to_vec())
                .collect(),
        ),
        (
            "third".into(),
            v.iter()
                .map(|&v| (v as f64 / 3.0).to_le_bytes().to_vec())
                .collect(),
        ),
        (
            "flag".into(),
            v.iter().map(|&v| vec![u8::from(v % 3 == 0)]).collect(),
        ),
        (
            "vec3".into(),
            v.iter()
                .map(|&v| {
                    le(&(0..3)
                        .map(|k| ((v + k) as f32).to_le_bytes().to_vec())
                        .collect::<Vec<_>>())
                })
                .collect(),
        ),
        (
            "mat".into(),
            v.iter()
                .map(|&v| {
                    let v = v as i16;
                    [v, v.wrapping_neg(), v.wrapping_mul(2), v.wrapping_mul(3)]
                        .iter()
                        .flat_map(|x| x.to_le_bytes())
                        .collect()
                })
                .collect(),
        ),
        (
            "text".into(),
            v.iter().map(|&v| text(v).into_bytes()).collect(),
        ),
        (
            "big_text".into(),
            v.iter().map(|&v| "x".repeat(v % 20).into_bytes()).collect(),
        ),
        (
            "blob".into(),
            v.iter().map(|&v| vec![v as u8; v % 7]).collect(),
        ),
        (
            "big_blob".into(),
            v.iter().map(|&v| vec![(v * 7) as u8; v % 30]).collect(),
        ),
        (
            "fixed".into(),
            v.iter()
                .map(|&v| (v as u32).to_be_bytes().to_vec())
                .collect(),
        ),
        (
            "tokens".into(),
            v.iter()
                .map(|&v| {
                    (0..v % 6)
                        .flat_map(|k| ((v * 10 + k) as i32).to_le_bytes())
                        .collect()
                })
                .collect(),
        ),
        (
            "floats".into(),
            v.iter()
                .map(|&v| {
                    (0..v % 4)
                        .flat_map(|k| (k as f32 + 0.25).to_le_bytes())
                        .collect()
                })
                .collect(),
        ),
        (
            "animal".into(),
            v.iter()
                .map(|&v| ["cat", "dog", "bird"][v % 3].as_bytes().to_vec())
                .collect(),
        ),
        (
            "meta.a".into(),
            v.iter()
                .map(|&v| (v as i32 * 2).to_le_bytes().to_vec())
                .collect(),
        ),
        (
            "meta.b".into(),
            v.iter().map(|&v| format!("b{v}").into_bytes()).collect(),
        ),
        (
            "image".into(),
            v.iter()
                .map(|&v| [PNG, &(v as u32).to_le_bytes()].concat())
                .collect(),
        ),
    ];
    if views {
        expected.push((
            "text_view".into(),
            v.iter()
                .map(|&v| text(v).repeat(1 + v % 3).into_bytes())
                .collect(),
        ));
        expected.push((
            "blob_view".into(),
            v.iter().map(|&v| vec![v as u8; v % 17]).collect(),
        ));
    }
    (batch, expected)
}

/// Checks every field of every row of `d` against `expected` (rows in order).
pub fn assert_rows(d: &dyn Dataset, expected: &[(String, Vec<Vec<u8>>)]) {
    let names: Vec<&str> = d
        .schema()
        .fields()
        .iter()
        .map(|f| f.name.as_str())
        .collect();
    let want: Vec<&str> = expected.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, want);
    let rows = expected[0].1.len();
    assert_eq!(d.len(), rows as u64);
    for r in 0..rows {
        let s = d.get(r as u64).unwrap();
        for (k, (name, values)) in expected.iter().enumerate() {
            assert_eq!(s.field(k).unwrap(), &values[r][..], "row {r}, field {name}");
        }
        // The record as a whole lays the same fields out.
        let record = s.bytes().unwrap().to_vec();
        let again = gpufeed::Sample::owned(record, d.schema()).unwrap();
        for k in 0..expected.len() {
            assert_eq!(
                again.field(k),
                s.field(k),
                "row {r}, field {k} of the laid-out record"
            );
        }
    }
}

/// Writes `batches` to a Parquet file of row groups of at most `group_rows` rows and data
/// pages of at most `page_rows` rows.
pub fn write_parquet(path: &Path, batches: &[RecordBatch], group_rows: usize, page_rows: usize) {
    use parquet::arrow::ArrowWriter;
    use parquet::basic::Compression;
    use parquet::file::properties::WriterProperties;
    let props = WriterProperties::builder()
        .set_max_row_group_row_count(Some(group_rows))
        .set_data_page_row_count_limit(page_rows)
        .set_write_batch_size(page_rows.max(1))
        .set_compression(Compression::SNAPPY)
        .build();
    let file = std::fs::File::create(path).unwrap();
    let mut w = ArrowWriter::try_new(file, batches[0].schema(), Some(props)).unwrap();
    for b in batches {
        w.write(b).unwrap();
    }
    w.close().unwrap();
}

/// Writes `batches` as an Arrow IPC stream (`file: false`, as `datasets` writes) or file.
pub fn write_arrow(path: &Path, batches: &[RecordBatch], file: bool) {
    let out = std::fs::File::create(path).unwrap();
    if file {
        let mut w = arrow_ipc::writer::FileWriter::try_new(out, &batches[0].schema()).unwrap();
        for b in batches {
            w.write(b).unwrap();
        }
        w.finish().unwrap();
    } else {
        let mut w = arrow_ipc::writer::StreamWriter::try_new(out, &batches[0].schema()).unwrap();
        for b in batches {
            w.write(b).unwrap();
        }
        w.finish().unwrap();
    }
}
