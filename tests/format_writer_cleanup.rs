//! `remove_unfinished_temporaries`, what the command's signal thread calls: in a test binary of
//! its own, since it removes the temporaries of every writer of the process.

use gpufeed::format::{
    DType, Field, RecordWriter, Schema, TEMPORARY_MARKER, remove_unfinished_temporaries,
};

#[test]
fn unfinished_temporaries_are_removed_for_a_signal_and_the_writer_then_fails() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.gfd");
    let mut w = RecordWriter::create(
        &out,
        Schema::new(vec![
            Field::tensor("data", DType::U8, &[4096]),
            Field::tensor("label", DType::U32, &[]),
        ])
        .unwrap(),
    )
    .unwrap();
    w.append(&[&[7; 4096], &0u32.to_le_bytes()]).unwrap();
    let count = || {
        std::fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| {
                let n = e.as_ref().unwrap().file_name();
                n.to_string_lossy().contains(TEMPORARY_MARKER)
            })
            .count()
    };
    assert_eq!(count(), 1);
    assert_eq!(remove_unfinished_temporaries(), 1);
    assert_eq!(count(), 0);
    let e = w.finish().unwrap_err();
    assert!(e.to_string().contains(out.to_str().unwrap()), "{e}");
    assert!(!out.exists());
}
