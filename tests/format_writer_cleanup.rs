//! `remove_unfinished_temporaries`, what the command's signal thread calls: in a test binary of
//! its own, since it removes the temporaries of every writer of the process.

use gpufeed::format::{
    DType, Field, RecordWriter, Schema, TEMPORARY_MARKER, remove_unfinished_temporaries,
};
use gpufeed::source::shards::packed::ShardWriter;

/// Held by each test: the function under test touches every writer of the process.
static ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn unfinished_temporaries_are_removed_for_a_signal_and_the_writer_then_fails() {
    let _alone = ALONE.lock().unwrap_or_else(|p| p.into_inner());
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

#[test]
fn the_shards_of_an_unfinished_shard_writer_are_removed_for_a_signal() {
    let _alone = ALONE.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let schema = Schema::new(vec![Field::tensor("data", DType::U8, &[1000])]).unwrap();
    let mut w = ShardWriter::create(dir.path(), schema, 8 << 10).unwrap();
    for i in 0..20u32 {
        w.append(&[&[i as u8; 1000]]).unwrap();
    }
    let names = || -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    // Two shards placed, the third under way.
    let before = names();
    assert_eq!(before.len(), 3, "{before:?}");
    assert_eq!(&before[..2], ["shard-000000.gfd", "shard-000001.gfd"]);
    assert!(before[2].contains(TEMPORARY_MARKER), "{before:?}");
    assert_eq!(remove_unfinished_temporaries(), 3);
    assert_eq!(names(), Vec::<String>::new());
    assert!(w.finish().is_err());
    assert_eq!(names(), Vec::<String>::new());
}
