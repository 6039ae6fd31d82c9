//! `.npy` arrays that cannot be read in place get a typed error naming the file.

use std::path::{Path, PathBuf};

use gpufeed::format::DType;
use gpufeed::source::npy_header;
use gpufeed::{Dataset, Error, NpyArray};

fn header_with(text: &str) -> Vec<u8> {
    let mut b = b"\x93NUMPY\x01\x00".to_vec();
    b.extend_from_slice(&(text.len() as u16).to_le_bytes());
    b.extend_from_slice(text.as_bytes());
    b
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn assert_names(e: &Error, path: &Path) {
    let msg = e.to_string();
    assert!(
        msg.contains(&path.display().to_string()),
        "`{msg}` does not name {}",
        path.display()
    );
}

#[test]
fn reads_rows_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let mut b = npy_header(DType::U16, &[3, 2]).unwrap();
    for v in 0u16..6 {
        b.extend_from_slice(&v.to_le_bytes());
    }
    let p = write(dir.path(), "ok.npy", &b);
    let a = NpyArray::open(&p).unwrap();
    assert_eq!(a.len(), 3);
    assert_eq!(a.get(2).unwrap().field(0), Some(&[4, 0, 5, 0][..]));
    assert!(matches!(
        a.get(3),
        Err(Error::OutOfRange { index: 3, len: 3 })
    ));
}

#[test]
fn unsupported_dtypes_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    for descr in ["|O", "<c8", "<U3", "|S4", "<M8[ns]", ">f4", "<f16"] {
        let text = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': (2,), }}");
        let mut b = header_with(&text);
        b.extend_from_slice(&[0u8; 64]);
        let p = write(dir.path(), "dtype.npy", &b);
        let e = NpyArray::open(&p).unwrap_err();
        assert!(
            matches!(&e, Error::UnsupportedNpy { what, .. } if what.contains(descr)),
            "{descr}: {e}"
        );
        assert_names(&e, &p);
    }
}

#[test]
fn object_array_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut b = header_with("{'descr': '|O', 'fortran_order': False, 'shape': (3,), }");
    b.extend_from_slice(b"\x80\x02]q\x00.");
    let p = write(dir.path(), "object.npy", &b);
    let e = NpyArray::open(&p).unwrap_err();
    assert!(matches!(e, Error::UnsupportedNpy { .. }), "{e}");
    assert_names(&e, &p);
    assert!(e.to_string().contains("object"));
}

#[test]
fn structured_dtype_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let b = header_with(
        "{'descr': [('a', '<f4'), ('b', '<i4')], 'fortran_order': False, 'shape': (3,), }",
    );
    let p = write(dir.path(), "structured.npy", &b);
    let e = NpyArray::open(&p).unwrap_err();
    assert!(matches!(e, Error::UnsupportedNpy { .. }), "{e}");
    assert_names(&e, &p);
}

#[test]
fn fortran_order_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut b = header_with("{'descr': '<f4', 'fortran_order': True, 'shape': (4, 3), }");
    b.extend_from_slice(&[0u8; 48]);
    let p = write(dir.path(), "fortran.npy", &b);
    let e = NpyArray::open(&p).unwrap_err();
    assert!(
        matches!(&e, Error::UnsupportedNpy { what, .. } if what.contains("Fortran")),
        "{e}"
    );
    assert_names(&e, &p);
    // Through the generic opener, which tells .npy by its magic.
    let Err(e) = gpufeed::source::open(&p, &Default::default()) else {
        panic!("opened")
    };
    assert!(matches!(e, Error::UnsupportedNpy { .. }), "{e}");
}

#[test]
fn truncated_data_is_malformed() {
    let dir = tempfile::tempdir().unwrap();
    let mut full = npy_header(DType::F32, &[10, 3]).unwrap();
    let header = full.len();
    full.extend_from_slice(&[0u8; 120]);
    for cut in [header, header + 1, header + 60, full.len() - 1] {
        let p = write(dir.path(), "short.npy", &full[..cut]);
        let e = NpyArray::open(&p).unwrap_err();
        assert!(
            matches!(&e, Error::Malformed { what, .. } if what.contains("truncated")),
            "cut {cut}: {e}"
        );
        assert_names(&e, &p);
    }
    // Every cut, header included, is an error and never a panic.
    for cut in 0..full.len() {
        let p = write(dir.path(), "cut.npy", &full[..cut]);
        assert!(NpyArray::open(&p).is_err(), "cut at {cut} opened");
        assert!(
            gpufeed::source::open(&p, &Default::default()).is_err(),
            "cut at {cut} opened"
        );
    }
    let p = write(dir.path(), "whole.npy", &full);
    assert_eq!(NpyArray::open(&p).unwrap().len(), 10);
}

#[test]
fn rows_larger_than_the_address_space_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let b = header_with(
        "{'descr': '<f8', 'fortran_order': False, 'shape': (2, 4294967296, 4294967296), }",
    );
    let p = write(dir.path(), "huge.npy", &b);
    let e = NpyArray::open(&p).unwrap_err();
    assert!(matches!(e, Error::UnsupportedNpy { .. }), "{e}");
    let b = header_with(
        "{'descr': '|u1', 'fortran_order': False, 'shape': (18446744073709551615, 2), }",
    );
    let p = write(dir.path(), "many.npy", &b);
    let e = NpyArray::open(&p).unwrap_err();
    assert!(matches!(e, Error::Malformed { .. }), "{e}");
}

#[test]
fn bad_magic_empty_and_garbled_headers_are_malformed() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&str, Vec<u8>); 5] = [
        ("empty.npy", vec![]),
        ("magic.npy", b"NOTNUMPY\x01\x00\x00\x00".to_vec()),
        ("long.npy", b"\x93NUMPY\x01\x00\xff\xff{'descr'".to_vec()),
        (
            "text.npy",
            header_with("{'descr': '<f4', 'fortran_order': False, 'shape': (5,"),
        ),
        ("nodict.npy", header_with("[1, 2, 3]")),
    ];
    for (name, bytes) in cases {
        let p = write(dir.path(), name, &bytes);
        let e = NpyArray::open(&p).unwrap_err();
        assert!(
            matches!(e, Error::Malformed { format: "npy", .. }),
            "{name}: {e}"
        );
        assert_names(&e, &p);
    }
    let p = write(
        dir.path(),
        "v9.npy",
        b"\x93NUMPY\x09\x00\x10\x00{}              ",
    );
    assert!(matches!(
        NpyArray::open(&p),
        Err(Error::UnsupportedNpy { .. })
    ));
}

/// Rows of zero bytes and a huge first axis made a 128-byte file a dataset of
/// 2^64 - 1 empty samples (`pack` looped until it ran out of memory, `bench` never ended).
#[test]
fn zero_byte_rows_are_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    for (descr, shape) in [
        ("|u1", "(18446744073709551615, 0)"),
        ("<f4", "(1000000, 3, 0)"),
        ("<i8", "(5, 0, 7)"),
    ] {
        let mut b = header_with(&format!(
            "{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}"
        ));
        b.resize(128, b' ');
        let p = write(dir.path(), "empty_rows.npy", &b);
        let e = NpyArray::open(&p).unwrap_err();
        assert!(
            matches!(&e, Error::UnsupportedNpy { what, .. } if what.contains("no bytes")),
            "{shape}: {e}"
        );
        assert_names(&e, &p);
        assert!(
            gpufeed::source::open(&p, &Default::default()).is_err(),
            "{shape}"
        );
    }
    // No rows at all is an empty dataset, as before.
    let p = write(
        dir.path(),
        "none.npy",
        &header_with("{'descr': '|u1', 'fortran_order': False, 'shape': (0, 0), }"),
    );
    assert_eq!(NpyArray::open(&p).unwrap().len(), 0);
}
