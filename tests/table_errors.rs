//! Bad Parquet and Arrow input: a typed error naming the file (and row group, column),
//! never a panic, a hang or wrong data.

use std::path::Path;

use gpufeed::source::table::{TableOptions, arrow, parquet};
use gpufeed::{Dataset, Error, ErrorKind};

use crate::table_common::{every_kind, write_arrow, write_parquet};

fn names(e: &Error, path: &Path) {
    assert!(
        e.to_string().contains(&path.display().to_string()),
        "`{e}` does not name {}",
        path.display()
    );
}

/// Opens and reads every row; any error is fine, a panic is not. Returns what happened.
fn read_all_parquet(p: &Path) -> Result<u64, Error> {
    let d = parquet::open(
        p,
        &TableOptions {
            chunk_rows: Some(4),
            ..TableOptions::default()
        },
    )?;
    (0..d.len()).try_for_each(|i| d.get(i).map(drop))?;
    Ok(d.len())
}

fn read_all_arrow(p: &Path) -> Result<u64, Error> {
    let d = arrow::open(p, &TableOptions::default())?;
    (0..d.len()).try_for_each(|i| d.get(i).map(drop))?;
    Ok(d.len())
}

#[test]
fn parquet_truncated_footer_wrong_magic_and_empty_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.parquet");
    write_parquet(&p, &[every_kind(0, 20, false).0], 8, 4);
    let good = std::fs::read(&p).unwrap();
    for (name, bytes) in [
        ("cut.parquet", good[..good.len() - 3].to_vec()),
        ("magic.parquet", [&good[..good.len() - 4], b"PAR2"].concat()),
        ("footer.parquet", {
            let mut b = good.clone();
            let n = b.len();
            b[n - 8..n - 4].copy_from_slice(&u32::MAX.to_le_bytes());
            b
        }),
        ("empty.parquet", Vec::new()),
    ] {
        let q = dir.path().join(name);
        std::fs::write(&q, bytes).unwrap();
        let e = read_all_parquet(&q).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{name}: {e}");
        names(&e, &q);
    }
}

#[test]
fn parquet_corrupt_pages_are_errors_or_values_never_panics() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.parquet");
    write_parquet(&p, &[every_kind(0, 24, false).0], 12, 4);
    let good = std::fs::read(&p).unwrap();
    let q = dir.path().join("bad.parquet");
    let mut errors = 0;
    // Every 7th byte of the data (before the footer), flipped.
    for at in (4..good.len() - 8).step_by(7) {
        let mut b = good.clone();
        b[at] ^= 0x5a;
        std::fs::write(&q, &b).unwrap();
        if let Err(e) = read_all_parquet(&q) {
            names(&e, &q);
            errors += 1;
        }
    }
    assert!(errors > 0);
}

#[test]
fn parquet_files_of_different_schemas_are_named_both() {
    let dir = tempfile::tempdir().unwrap();
    let (a, _) = every_kind(0, 3, false);
    write_parquet(
        &dir.path().join("a.parquet"),
        std::slice::from_ref(&a),
        8,
        8,
    );
    write_parquet(
        &dir.path().join("b.parquet"),
        &[a.project(&[0, 1, 3]).unwrap()],
        8,
        8,
    );
    let e = parquet::open(dir.path(), &TableOptions::default()).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("a.parquet") && msg.contains("b.parquet") && msg.contains("different schemas"),
        "{msg}"
    );
}

#[test]
fn arrow_truncated_garbage_and_corrupt_streams() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("s.arrow");
    write_arrow(
        &p,
        &[every_kind(0, 9, true).0, every_kind(9, 4, true).0],
        false,
    );
    let good = std::fs::read(&p).unwrap();
    for (name, bytes) in [
        ("cut.arrow", good[..good.len() / 2].to_vec()),
        ("garbage.arrow", b"not an arrow file at all".to_vec()),
        ("empty.arrow", Vec::new()),
        ("nohead.arrow", good[good.len() / 3..].to_vec()),
    ] {
        let q = dir.path().join(name);
        std::fs::write(&q, bytes).unwrap();
        let e = read_all_arrow(&q).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{name}: {e}");
        names(&e, &q);
    }
    let q = dir.path().join("bad.arrow");
    for at in (0..good.len()).step_by(5) {
        let mut b = good.clone();
        b[at] ^= 0xa5;
        std::fs::write(&q, &b).unwrap();
        if let Err(e) = read_all_arrow(&q) {
            names(&e, &q);
        }
    }
}

#[test]
fn parquet_page_checksums_written_by_pyarrow_are_checked() {
    use ::parquet::file::reader::{FileReader, SerializedFileReader};
    // Written by pyarrow with `write_page_checksum=True`, uncompressed (the fuzz seeds).
    let seed =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/parquet_file/plain_crc.parquet");
    let good = std::fs::read(&seed).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("crc.parquet");
    std::fs::write(&p, &good).unwrap();
    let options = TableOptions {
        columns: Some(vec!["id".into(), "text".into()]),
        ..TableOptions::default()
    };
    let d = parquet::open(&p, &options).unwrap();
    assert_eq!(d.get(11).unwrap().field(0).unwrap(), 11i64.to_le_bytes());
    let reader = SerializedFileReader::new(std::fs::File::open(&p).unwrap()).unwrap();
    let column = reader.metadata().row_group(0).column(0);
    let end = (column.data_page_offset() + column.compressed_size()) as usize;
    let mut bad = good.clone();
    bad[end - 2] ^= 0xff; // inside the last page's values
    std::fs::write(&p, &bad).unwrap();
    let d = parquet::open(&p, &options).unwrap();
    let e = d.get(0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt);
    let msg = e.to_string();
    assert!(
        msg.contains("crc.parquet")
            && msg.contains("row group 0")
            && msg.to_lowercase().contains("crc"),
        "{msg}"
    );
}
