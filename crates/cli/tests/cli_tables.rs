//! The command on tables as the hub ships them: a Parquet image set in the layout of
//! `datasets`' Image feature (a struct of `bytes` and `path` beside an int label), Parquet
//! numbers, and JSON lines, through `inspect` and `bench`.

use std::path::Path;
use std::sync::Arc;

use arrow_array::{ArrayRef, BinaryArray, Int64Array, RecordBatch, StringArray, StructArray};
use arrow_schema::{DataType, Field};
use image::ExtendedColorType;

use crate::cli_common::{gpufeed, s, stderr, stdout};
use crate::image_common::{jpeg, noisy_rgb};
use crate::table_common::write_parquet;

/// `n` rows of `image` (a struct of a JPEG's bytes and its path) and `label`, in row groups
/// of 7 rows.
fn image_parquet(path: &Path, n: usize) {
    let images: Vec<Vec<u8>> = (0..n)
        .map(|i| {
            jpeg(
                &noisy_rgb(24, 20, i as u32),
                24,
                20,
                ExtendedColorType::Rgb8,
                90,
            )
        })
        .collect();
    let bytes: ArrayRef = Arc::new(BinaryArray::from_iter_values(images.iter()));
    let paths: ArrayRef = Arc::new(StringArray::from_iter_values(
        (0..n).map(|i| format!("{i}.jpg")),
    ));
    let image: ArrayRef = Arc::new(StructArray::from(vec![
        (Arc::new(Field::new("bytes", DataType::Binary, true)), bytes),
        (Arc::new(Field::new("path", DataType::Utf8, true)), paths),
    ]));
    let label: ArrayRef = Arc::new(Int64Array::from_iter_values((0..n as i64).map(|i| i % 3)));
    let batch = RecordBatch::try_from_iter([("image", image), ("label", label)]).unwrap();
    write_parquet(path, &[batch], 7, 7);
}

#[test]
fn a_parquet_image_set_is_inspected_and_decoded_by_bench_images() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("train-00000-of-00001.parquet");
    image_parquet(&p, 30);
    let o = gpufeed(&["inspect", s(&p), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let json: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(json["format"], "parquet");
    assert_eq!(json["records"], 30);
    assert_eq!(json["row_groups"], 5);
    let o = gpufeed(&[
        "bench",
        "--images",
        s(&p),
        "--image-size",
        "16",
        "--label-field",
        "label",
        "--batch-size",
        "8",
        "--epochs",
        "2",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let report: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(report["samples"], 60, "{report}");
}

#[test]
fn bench_reads_parquet_and_json_lines_fields_by_name_and_names_the_flag_for_a_wrong_one() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("numbers.parquet");
    let id: ArrayRef = Arc::new(Int64Array::from_iter_values(0..100));
    let text: ArrayRef = Arc::new(StringArray::from_iter_values(
        (0..100).map(|i| format!("row {i}")),
    ));
    let batch = RecordBatch::try_from_iter([("id", id), ("text", text)]).unwrap();
    write_parquet(&p, &[batch], 30, 10);
    let j = dir.path().join("rows.jsonl");
    let lines: String = (0..50)
        .map(|i| format!("{{\"id\": {i}, \"text\": \"row {i}\"}}\n"))
        .collect();
    std::fs::write(&j, lines).unwrap();
    for (data, rows) in [(&p, 100), (&j, 50)] {
        let o = gpufeed(&[
            "bench",
            s(data),
            "--fields",
            "id",
            "--batch-size",
            "10",
            "--epochs",
            "1",
            "--no-baseline",
            "--json",
        ]);
        assert!(o.status.success(), "{}: {}", data.display(), stderr(&o));
        let report: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
        assert_eq!(report["samples"], rows, "{report}");
        if data == &p {
            // Every row read through the shared cache of decoded chunks, each chunk decoded.
            let cache = &report["chunk_cache"];
            assert!(cache["misses"].as_u64().unwrap() >= 4, "{report}");
            assert!(cache["limit_bytes"].as_u64().unwrap() > 0, "{report}");
        } else {
            assert!(report["chunk_cache"].is_null(), "{report}");
        }
        let o = gpufeed(&["bench", s(data), "--fields", "nope", "--epochs", "1"]);
        assert!(!o.status.success());
        let e = stderr(&o);
        assert!(e.contains("--fields") && e.contains("nope"), "{e}");
    }
    let o = gpufeed(&["inspect", s(&j)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(
        text.contains("JSON lines") && text.contains("records:       50"),
        "{text}"
    );
}
