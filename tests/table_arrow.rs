//! Arrow IPC data sets: stream and file formats, `save_to_disk` directories, `DatasetDict`
//! splits, every column kind byte for byte.

use gpufeed::format::{Codec, FieldKind};
use gpufeed::source::ReadMode;
use gpufeed::source::table::{TableOptions, arrow};
use gpufeed::{Dataset, Error};

use crate::table_common::{Expected, assert_rows, every_kind, write_arrow};

fn concat(mut a: Expected, b: Expected) -> Expected {
    for (x, (_, more)) in a.iter_mut().zip(b) {
        x.1.extend(more);
    }
    a
}

#[test]
fn reads_streams_and_files_with_every_column_kind() {
    let dir = tempfile::tempdir().unwrap();
    let (a, wa) = every_kind(0, 17, true);
    let (b, wb) = every_kind(17, 30, true);
    let want = concat(wa.clone(), wb);
    // The stream replaces the `animal` dictionary between its batches (the second batch's
    // values come in another order); the file format allows one dictionary: one batch.
    for (name, file, batches, want, n) in [
        ("stream.arrow", false, vec![a.clone(), b.clone()], &want, 2),
        ("file.arrow", true, vec![a.clone()], &wa, 1),
    ] {
        let p = dir.path().join(name);
        write_arrow(&p, &batches, file);
        assert_eq!(
            gpufeed::source::detect(&p).unwrap(),
            gpufeed::source::Format::Arrow
        );
        let d = arrow::open(&p, &TableOptions::default()).unwrap();
        assert_rows(&d, want);
        let image = &d.schema().fields()[d.schema().index_of("image").unwrap()];
        assert_eq!(image.kind, FieldKind::Bytes { codec: Codec::Png });
        let s = d.describe();
        assert_eq!(
            (s.rows, s.chunks, s.files[0].groups),
            (want[0].1.len() as u64, n, n)
        );
    }
}

fn save_to_disk(dir: &std::path::Path, parts: &[(usize, usize)]) {
    std::fs::create_dir_all(dir).unwrap();
    let mut names = Vec::new();
    for (k, &(start, n)) in parts.iter().enumerate() {
        let name = format!("data-{k:05}-of-{:05}.arrow", parts.len());
        write_arrow(&dir.join(&name), &[every_kind(start, n, false).0], false);
        names.push(serde_json::json!({ "filename": name }));
    }
    // Listed in an order other than the names' sort order: state.json's order rules.
    names.reverse();
    std::fs::write(
        dir.join("state.json"),
        serde_json::json!({ "_data_files": names }).to_string(),
    )
    .unwrap();
    std::fs::write(dir.join("dataset_info.json"), "{}").unwrap();
}

#[test]
fn a_save_to_disk_directory_reads_its_files_in_state_order() {
    let dir = tempfile::tempdir().unwrap();
    save_to_disk(dir.path(), &[(10, 5), (0, 10)]);
    assert_eq!(
        gpufeed::source::detect(dir.path()).unwrap(),
        gpufeed::source::Format::Arrow
    );
    let d = arrow::open(dir.path(), &TableOptions::default()).unwrap();
    let want = concat(every_kind(0, 10, false).1, every_kind(10, 5, false).1);
    assert_rows(&d, &want);
}

#[test]
fn a_dataset_dict_is_read_by_split() {
    let dir = tempfile::tempdir().unwrap();
    save_to_disk(&dir.path().join("train"), &[(0, 8)]);
    save_to_disk(&dir.path().join("test"), &[(100, 3)]);
    std::fs::write(
        dir.path().join("dataset_dict.json"),
        r#"{"splits": ["train", "test"]}"#,
    )
    .unwrap();
    let e = arrow::open(dir.path(), &TableOptions::default()).unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidConfig {
                setting: "split",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("train, test"), "{e}");
    let test = arrow::open(
        dir.path(),
        &TableOptions {
            split: Some("test".into()),
            ..TableOptions::default()
        },
    )
    .unwrap();
    assert_eq!(test.len(), 3);
    assert_eq!(
        test.describe().splits,
        Some((
            "test".to_owned(),
            vec!["train".to_owned(), "test".to_owned()]
        ))
    );
    let by_dir = arrow::open(dir.path().join("train"), &TableOptions::default()).unwrap();
    assert_eq!(by_dir.len(), 8);
    let e = arrow::open(
        dir.path(),
        &TableOptions {
            split: Some("val".into()),
            ..TableOptions::default()
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("no split `val`"), "{e}");
}

#[test]
fn selected_columns_and_pread_mode() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("s.arrow");
    write_arrow(&p, &[every_kind(0, 5, false).0], false);
    let options = TableOptions {
        columns: Some(vec!["text".into(), "id".into()]),
        ..TableOptions::default()
    };
    let d = arrow::open(&p, &options).unwrap();
    let names: Vec<&str> = d
        .schema()
        .fields()
        .iter()
        .map(|f| f.name.as_str())
        .collect();
    assert_eq!(names, ["id", "text"], "in the file's order");
    assert_eq!(d.get(3).unwrap().field(1).unwrap(), "row 3 ééé".as_bytes());
    let e = arrow::open(
        &p,
        &TableOptions {
            read_mode: ReadMode::Pread,
            ..TableOptions::default()
        },
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidConfig {
                setting: "read_mode",
                ..
            }
        ),
        "{e}"
    );
}
