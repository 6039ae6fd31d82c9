//! Files that change under an open source (issue 9, item 5): `Dataset::check_unchanged` reports
//! a file replaced (np.save-like: a new file renamed over the path), written in place,
//! truncated, extended or removed, naming the file; a source opened with `ReadMode::Pread`
//! turns a read past a truncation into a typed error instead of `SIGBUS`.
//!
//! Nothing here reads a mapping after its file was truncated (that is the `SIGBUS` the
//! contract on `ReadMode::Map` warns of).

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use gpufeed::format::{DType, Field, ReadMode, ReadOptions, RecordFile, RecordWriter, Schema};
use gpufeed::source::{self, Concat, ImageFolder, npy_header};
use gpufeed::{Dataset, Error, NpyArray};

const MODES: [ReadMode; 2] = [ReadMode::Map, ReadMode::Pread];

fn packed(path: &Path, n: u32, fill: u8) {
    let schema = Schema::new(vec![
        Field::tensor("data", DType::U8, &[32]),
        Field::tensor("label", DType::U32, &[]),
    ])
    .unwrap();
    let mut w = RecordWriter::create(path, schema).unwrap();
    for i in 0..n {
        w.append(&[&[fill ^ i as u8; 32], &i.to_le_bytes()])
            .unwrap();
    }
    w.finish().unwrap();
}

fn npy_bytes(rows: u64, fill: u8) -> Vec<u8> {
    let mut b = npy_header(DType::U8, &[rows, 16]).unwrap();
    b.extend(std::iter::repeat_n(fill, rows as usize * 16));
    b
}

/// Sets the file's modification time well in the past, so that a later write in place gets a
/// different one even on a file system with a coarse clock.
fn age(path: &Path) {
    let old = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000_000);
    File::options()
        .write(true)
        .open(path)
        .unwrap()
        .set_modified(old)
        .unwrap();
}

/// Every kind of file-backed source over `path`, in every mode.
fn open_all(path: &Path) -> Vec<Box<dyn Dataset>> {
    let mut out: Vec<Box<dyn Dataset>> = Vec::new();
    for mode in MODES {
        let options = ReadOptions {
            mode,
            ..Default::default()
        };
        out.push(source::open_with(path, options).unwrap());
        if path.extension().is_some_and(|e| e == "npy") {
            out.push(Box::new(NpyArray::open_with(path, "data", mode).unwrap()));
        } else {
            out.push(Box::new(RecordFile::open_with(path, options).unwrap()));
        }
    }
    out
}

fn assert_changed(d: &dyn Dataset, path: &Path, needle: &str) {
    match d.check_unchanged() {
        Err(Error::FileChanged { path: p, what }) => {
            assert_eq!(p, path);
            assert!(what.contains(needle), "{what:?} lacks {needle:?}");
        }
        other => panic!("expected FileChanged ({needle}), got {other:?}"),
    }
}

fn files(dir: &Path) -> [PathBuf; 2] {
    let gfd = dir.join("train.gfd");
    packed(&gfd, 6, 0);
    let npy = dir.join("train.npy");
    std::fs::write(&npy, npy_bytes(6, 1)).unwrap();
    [gfd, npy]
}

#[test]
fn an_unchanged_file_passes_any_number_of_times() {
    let dir = tempfile::tempdir().unwrap();
    for path in files(dir.path()) {
        for d in open_all(&path) {
            for _ in 0..3 {
                d.check_unchanged().unwrap();
            }
        }
    }
}

/// `np.save` to a temporary name then `os.replace` (or `RecordWriter`): the path names a new
/// file. The open source is not harmed (it keeps reading the old one) but is stale.
#[test]
fn a_file_replaced_by_rename_is_reported_and_the_old_one_still_reads() {
    let dir = tempfile::tempdir().unwrap();
    for path in files(dir.path()) {
        let sources = open_all(&path);
        let before: Vec<Vec<u8>> = sources
            .iter()
            .map(|d| d.get(2).unwrap().field(0).unwrap().to_vec())
            .collect();
        let tmp = path.with_extension("new");
        if path.extension().is_some_and(|e| e == "npy") {
            std::fs::write(&tmp, npy_bytes(6, 0xEE)).unwrap();
        } else {
            packed(&tmp, 6, 0xEE);
        }
        std::fs::rename(&tmp, &path).unwrap();
        for (d, was) in sources.iter().zip(&before) {
            assert_changed(d.as_ref(), &path, "replaced");
            assert_eq!(d.get(2).unwrap().field(0).unwrap(), &was[..]);
        }
    }
}

/// `np.save(path, ...)` itself: the same file truncated and rewritten in place, to the same
/// size. Only the modification time tells.
#[test]
fn a_file_rewritten_in_place_to_the_same_size_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    for path in files(dir.path()) {
        let new = if path.extension().is_some_and(|e| e == "npy") {
            npy_bytes(6, 2)
        } else {
            let tmp = dir.path().join("other.gfd");
            packed(&tmp, 6, 0x55);
            std::fs::read(&tmp).unwrap()
        };
        assert_eq!(new.len() as u64, std::fs::metadata(&path).unwrap().len());
        age(&path);
        let sources = open_all(&path);
        let ino = inode(&path);
        // Truncate to nothing, then write the new data: what open(path, "wb") + write does.
        std::fs::write(&path, &new).unwrap();
        assert_eq!(inode(&path), ino, "not the same file");
        for d in &sources {
            assert_changed(d.as_ref(), &path, "written in place");
        }
    }
}

#[cfg(unix)]
fn inode(path: &Path) -> u64 {
    std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(path).unwrap())
}

#[cfg(not(unix))]
fn inode(_path: &Path) -> u64 {
    0
}

#[test]
fn truncation_and_extension_are_reported_with_both_sizes() {
    let dir = tempfile::tempdir().unwrap();
    for path in files(dir.path()) {
        let len = std::fs::metadata(&path).unwrap().len();
        age(&path);
        let sources = open_all(&path);
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(len - 10).unwrap();
        for d in &sources {
            assert_changed(
                d.as_ref(),
                &path,
                &format!("truncated in place from {len} to {} bytes", len - 10),
            );
        }
        f.set_len(len + 4096).unwrap();
        for d in &sources {
            assert_changed(
                d.as_ref(),
                &path,
                &format!("extended in place from {len} to {} bytes", len + 4096),
            );
        }
        // Back to its size, but written since: still reported.
        f.set_len(len).unwrap();
        for d in &sources {
            assert_changed(d.as_ref(), &path, "written in place");
        }
    }
}

#[test]
fn a_removed_file_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    for path in files(dir.path()) {
        let sources = open_all(&path);
        std::fs::remove_file(&path).unwrap();
        for d in &sources {
            assert_changed(d.as_ref(), &path, "removed");
            // The open file lives on: reads still work.
            d.get(5).unwrap();
        }
    }
}

/// A shard set is checked part by part; the error names the shard that changed.
#[test]
fn concat_checks_every_part_and_wrappers_forward_the_check() {
    let dir = tempfile::tempdir().unwrap();
    let paths: Vec<PathBuf> = (0..3)
        .map(|k| {
            let p = dir.path().join(format!("shard-{k}.gfd"));
            packed(&p, 4, k as u8);
            p
        })
        .collect();
    for mode in MODES {
        let options = ReadOptions {
            mode,
            ..Default::default()
        };
        let shards = source::open_shards_with(&paths, options).unwrap();
        shards.check_unchanged().unwrap();
        let shared: std::sync::Arc<dyn Dataset> =
            std::sync::Arc::new(source::open_shards_with(&paths, options).unwrap());
        let typed = Concat::new(vec![RecordFile::open_with(&paths[0], options).unwrap()]).unwrap();
        typed.check_unchanged().unwrap();
        let f = OpenOptions::new().write(true).open(&paths[2]).unwrap();
        let len = f.metadata().unwrap().len();
        f.set_len(len + 8).unwrap();
        assert_changed(&shards, &paths[2], "extended");
        assert_changed(shared.as_ref(), &paths[2], "extended");
        f.set_len(len).unwrap();
        // Rebuild the last shard so the next mode starts from unchanged files.
        packed(&paths[2], 4, 2);
    }
}

/// An image folder reads each file whole at every `get`: no mapping to protect, nothing to
/// check between epochs.
#[test]
fn an_image_folder_has_nothing_to_check() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("c")).unwrap();
    std::fs::write(dir.path().join("c/a.png"), b"not really").unwrap();
    let f = ImageFolder::open(dir.path()).unwrap();
    std::fs::write(dir.path().join("c/a.png"), b"changed").unwrap();
    f.check_unchanged().unwrap();
}

/// With `ReadMode::Pread`, a read past a truncation is an error naming the file, not a signal:
/// the offset table, a record's fields, a lazily read record, an `.npy` row.
#[test]
fn reads_past_a_truncation_are_typed_errors_under_pread() {
    let dir = tempfile::tempdir().unwrap();
    let [gfd, npy] = files(dir.path());
    let pread = ReadOptions {
        mode: ReadMode::Pread,
        ..Default::default()
    };
    let rec = RecordFile::open_with(&gfd, pread).unwrap();
    let arr = NpyArray::open_with(&npy, "data", ReadMode::Pread).unwrap();
    // Samples taken before the truncation are read after it.
    let s_rec = rec.get(5).unwrap();
    let s_arr = arr.get(5).unwrap();
    // The packed file loses its tables and footer; the array its last rows.
    for (p, len) in [(&gfd, 100), (&npy, 150)] {
        OpenOptions::new()
            .write(true)
            .open(p)
            .unwrap()
            .set_len(len)
            .unwrap();
    }
    let is_changed = |e: &Error, p: &Path| matches!(e, Error::FileChanged { path, what } if path == p && what.contains("truncated"));
    let mut slot = [0u8; 32];
    let e = s_rec.copy_field_into(0, &mut slot).unwrap_err();
    assert!(is_changed(&e, &gfd), "{e}");
    assert!(is_changed(&s_rec.try_field(0).unwrap_err(), &gfd));
    assert_eq!(s_rec.field(0), None);
    assert!(is_changed(&s_rec.bytes().unwrap_err(), &gfd));
    let e = rec.get(3).unwrap_err();
    assert!(is_changed(&e, &gfd), "{e}");
    assert!(is_changed(&rec.get_bytes(3).unwrap_err(), &gfd));
    assert!(is_changed(&rec.verify(|_| {}).unwrap_err(), &gfd));
    let mut row = [0u8; 16];
    let e = s_arr.copy_field_into(0, &mut row).unwrap_err();
    assert!(is_changed(&e, &npy), "{e}");
    let e = arr
        .get(5)
        .unwrap()
        .copy_field_into(0, &mut row)
        .unwrap_err();
    assert!(is_changed(&e, &npy), "{e}");
    // Rows still inside the file read as they are.
    arr.get(0).unwrap().copy_field_into(0, &mut row).unwrap();
    assert_eq!(row, [1u8; 16]);
}
