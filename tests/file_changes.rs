//! Files that change under an open source: `Dataset::check_unchanged` reports
//! a file replaced (np.save-like: a new file renamed over the path), written in place,
//! truncated, extended or removed, naming the file; a source opened with `ReadMode::Pread`
//! turns a read past a truncation into a typed error instead of `SIGBUS`.
//!
//! Nothing here reads a mapping after its file was truncated (that is the `SIGBUS` the
//! contract on `ReadMode::Map` warns of).

use gpufeed::BatchStream;
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
        out.push(source::open(path, &gpufeed::source::OpenOptions::read(options)).unwrap());
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
        let shards =
            source::open_all(&paths, &gpufeed::source::OpenOptions::read(options)).unwrap();
        shards.check_unchanged().unwrap();
        let shared: std::sync::Arc<dyn Dataset> = std::sync::Arc::new(
            source::open_all(&paths, &gpufeed::source::OpenOptions::read(options)).unwrap(),
        );
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

// ---- Sharded datasets ---------------------------------------------------------------------

/// Writes one byte of `path` again, in place (the same file, the same size; no truncation, so
/// no mapping of it can fault), where `needle` first occurs, and moves its modification time a
/// minute past what it was, so that the change shows whatever the file system's clock
/// granularity.
fn rewrite_in_place(path: &Path, needle: &[u8]) {
    use std::io::{Seek, SeekFrom, Write};
    let bytes = std::fs::read(path).unwrap();
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap_or_else(|| panic!("{needle:?} is not in {}", path.display()));
    let meta = std::fs::metadata(path).unwrap();
    let (ino, len, was) = (inode(path), meta.len(), meta.modified().unwrap());
    let mut f = OpenOptions::new().write(true).open(path).unwrap();
    f.seek(SeekFrom::Start(at as u64)).unwrap();
    f.write_all(&[bytes[at] ^ 0x20]).unwrap();
    f.set_modified(was + Duration::from_secs(60)).unwrap();
    drop(f);
    let meta = std::fs::metadata(path).unwrap();
    assert_eq!((inode(path), meta.len()), (ino, len), "not the same file");
    assert_ne!(std::fs::read(path).unwrap(), bytes, "no byte changed");
}

/// A directory of packed shards (at least three) of 40 samples (`sample 00` .. `sample 39` in
/// their `text`, the sample's number in `label`), and the shards' paths.
fn packed_shards(dir: &Path) -> Vec<PathBuf> {
    use gpufeed::source::shards::packed::ShardWriter;
    let schema = Schema::new(vec![
        Field::tensor("label", DType::U32, &[]),
        Field::tensor("text", DType::U8, &[9]),
    ])
    .unwrap();
    let mut w = ShardWriter::create(dir, schema, 640).unwrap();
    for i in 0..40u32 {
        w.append(&[&i.to_le_bytes(), format!("sample {i:02}").as_bytes()])
            .unwrap();
    }
    let summary = w.finish().unwrap();
    assert!(summary.shards.len() >= 3, "{:?}", summary.shards);
    summary.shards.iter().map(|s| dir.join(&s.name)).collect()
}

/// The one of `paths` that holds `needle`.
fn holding(paths: &[PathBuf], needle: &[u8]) -> PathBuf {
    let mut with = paths.iter().filter(|p| {
        std::fs::read(p)
            .unwrap()
            .windows(needle.len())
            .any(|w| w == needle)
    });
    let path = with.next().expect("no shard holds the needle").clone();
    assert!(with.next().is_none(), "two shards hold the needle");
    path
}

/// The loader's view of a shard rewritten between epochs: epoch 0 runs; the next epoch's first
/// `next()` is `FileChanged` naming the shard, once, and the position stays at that epoch's
/// start; a loader over shards left alone runs that epoch.
fn check_epochs_over_shards(
    changed: Box<dyn Dataset>,
    unchanged: Box<dyn Dataset>,
    batches: usize,
    rewrite: impl FnOnce() -> PathBuf,
) {
    use gpufeed::{FnTransform, Loader, OutputField};
    let loader = |d: Box<dyn Dataset>| {
        Loader::builder(d)
            .batch_size(5)
            .shuffle(7)
            .workers(2)
            .transform(FnTransform::new(
                vec![OutputField::new("i", DType::U32, &[])],
                |_s: gpufeed::Sample<'_>,
                 ctx: &gpufeed::SampleContext,
                 slots: &mut gpufeed::Slots<'_>| {
                    slots
                        .field(0)?
                        .copy_from_slice(&(ctx.index as u32).to_le_bytes());
                    Ok(())
                },
            ))
            .build()
            .unwrap()
    };
    let mut l = loader(changed);
    let mut good = loader(unchanged);
    for l in [&mut l, &mut good] {
        let mut delivered = 0;
        for b in l.by_ref() {
            b.unwrap();
            delivered += 1;
        }
        assert_eq!(delivered, batches);
    }
    let path = rewrite();
    l.set_epoch(1);
    let at_start = l.state();
    assert_eq!((at_start.epoch, at_start.next_batch), (1, 0));
    match l.next() {
        Some(Err(Error::FileChanged { path: p, what })) => {
            assert_eq!(p, path);
            assert!(what.contains("written in place"), "{what}");
        }
        Some(Err(e)) => panic!("expected FileChanged naming {}, got {e}", path.display()),
        Some(Ok(_)) => panic!("a batch of epoch 1 was delivered from a changed shard"),
        None => panic!("epoch 1 ended at once"),
    }
    assert_eq!(l.state(), at_start, "the error moved the position");
    // Once, then the end of the iteration (so that `collect` cannot run forever).
    assert!(l.next().is_none());
    assert_eq!(l.state(), at_start);
    good.set_epoch(1);
    let mut seen: Vec<u32> = good
        .by_ref()
        .flat_map(|b| b.unwrap().field::<u32>("i").unwrap().to_vec())
        .collect();
    seen.sort();
    assert!(seen.iter().copied().eq(0..batches as u32 * 5));
}

/// A packed shard written in place (same size, one byte changed) between epochs fails the
/// next epoch's start, naming the shard, without losing the position.
#[test]
fn a_packed_shard_rewritten_between_epochs_fails_the_next_epoch_naming_it() {
    use gpufeed::source::shards::packed::PackedShards;
    let (dir, good) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let paths = packed_shards(dir.path());
    packed_shards(good.path());
    let changed = holding(&paths, b"sample 25");
    assert_ne!(changed, paths[0]);
    check_epochs_over_shards(
        Box::new(PackedShards::open(dir.path()).unwrap()),
        // Through `source::open`: a boxed sharded source forwards the check.
        Box::new(source::open(good.path(), &Default::default()).unwrap()),
        8,
        || {
            rewrite_in_place(&changed, b"sample 25");
            changed.clone()
        },
    );
}

fn tar_shards(dir: &Path) -> Vec<PathBuf> {
    use crate::tar_common::TarBuilder;
    (0..3)
        .map(|k| {
            let mut tar = TarBuilder::new();
            for i in 0..5 {
                let n = k * 5 + i;
                tar.file(&format!("s{n:02}.txt"), format!("sample {n:02}").as_bytes());
            }
            let p = dir.join(format!("shard-{k}.tar"));
            std::fs::write(&p, tar.finish()).unwrap();
            p
        })
        .collect()
}

/// The same for WebDataset tar shards, which are mapped as they are.
#[test]
fn a_tar_shard_rewritten_between_epochs_fails_the_next_epoch_naming_it() {
    use gpufeed::source::shards::webdataset::{WebDataset, WebDatasetOptions};
    let (dir, good) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let options = WebDatasetOptions {
        cache_dir: Some(dir.path().join("cache")),
        ..WebDatasetOptions::default()
    };
    let paths = tar_shards(dir.path());
    let good_paths = tar_shards(good.path());
    check_epochs_over_shards(
        Box::new(WebDataset::open_with(&paths, options.clone()).unwrap()),
        Box::new(WebDataset::open_with(&good_paths, options).unwrap()),
        3,
        || {
            rewrite_in_place(&paths[1], b"sample 07");
            paths[1].clone()
        },
    );
}

/// Every kind of change to an open shard is reported, by the dataset's own check, naming the
/// shard: packed, tar and MDS shards alike; a shard not opened yet is not looked at (it will
/// be opened as it is); an unchanged set passes any number of times.
#[test]
fn open_shards_of_every_format_are_checked_and_unopened_ones_are_not() {
    use gpufeed::source::shards::mds::MdsDataset;
    use gpufeed::source::shards::packed::PackedShards;
    use gpufeed::source::shards::webdataset::{WebDataset, WebDatasetOptions};
    let dir = tempfile::tempdir().unwrap();
    let packed_dir = dir.path().join("packed");
    std::fs::create_dir(&packed_dir).unwrap();
    let packed = packed_shards(&packed_dir);
    let tars = tar_shards(dir.path());
    let mds_dir = dir.path().join("mds");
    std::fs::create_dir(&mds_dir).unwrap();
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/streaming/mds");
    for e in std::fs::read_dir(&fixtures).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), mds_dir.join(e.file_name())).unwrap();
    }
    let mds: Vec<PathBuf> = (0..4)
        .map(|k| mds_dir.join(format!("shard.0000{k}.mds")))
        .collect();
    let wds = WebDatasetOptions {
        cache_dir: Some(dir.path().join("cache")),
        ..WebDatasetOptions::default()
    };
    let sets: Vec<(Box<dyn Dataset>, &[PathBuf])> = vec![
        (Box::new(PackedShards::open(&packed_dir).unwrap()), &packed),
        (Box::new(WebDataset::open_with(&tars, wds).unwrap()), &tars),
        (Box::new(MdsDataset::open(&mds_dir).unwrap()), &mds),
    ];
    for (d, paths) in &sets {
        let sizes = d.shard_sizes().unwrap();
        // Open the first two shards only.
        d.get(0).unwrap();
        d.get(sizes[0]).unwrap();
        for _ in 0..3 {
            d.check_unchanged().unwrap();
        }
        // The last shard, never opened, changes: nothing to report.
        let last = paths.last().unwrap();
        age(last);
        d.check_unchanged().unwrap();
        // An open one is extended, then truncated back (so written since), then removed.
        let f = OpenOptions::new().write(true).open(&paths[1]).unwrap();
        let len = f.metadata().unwrap().len();
        f.set_len(len + 512).unwrap();
        assert_changed(d.as_ref(), &paths[1], "extended in place");
        f.set_len(len).unwrap();
        f.set_modified(SystemTime::now() + Duration::from_secs(60))
            .unwrap();
        assert_changed(d.as_ref(), &paths[1], "written in place");
        // The first changed shard is named: shard 0 before shard 1.
        std::fs::remove_file(&paths[0]).unwrap();
        assert_changed(d.as_ref(), &paths[0], "removed");
    }
}

// ---- Bytes written in place with the times put back -------------------------------------

/// The status-change time of `path` (seconds, nanoseconds).
#[cfg(unix)]
fn ctime(path: &Path) -> (i64, i64) {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).unwrap();
    (m.ctime(), m.ctime_nsec())
}

/// Waits until the file system stamps a change with a status-change time later than `path`'s,
/// so that a change made next is told apart from what `path` was: Linux stamps files from a
/// coarse clock (a tick of a few milliseconds), and a change within the tick of the last one
/// keeps its time. Looks at a file of its own, changed until its time has moved.
#[cfg(unix)]
pub(crate) fn wait_past_ctime(path: &Path) {
    let was = ctime(path);
    let probe = path.with_extension("clock");
    for _ in 0..10_000 {
        std::fs::write(&probe, b"tick").unwrap();
        if ctime(&probe) > was {
            std::fs::remove_file(&probe).unwrap();
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    panic!("the file system's clock did not move past {was:?} in 10 s");
}

/// Writes one byte of `path` in place at `at` (the same file, the same size: no mapping of it
/// can fault), then puts its access and modification times back, as `touch -r`, `os.utime`,
/// `rsync --inplace` or a careful tool does: only the status-change time, which no call can
/// set, moves.
#[cfg(unix)]
pub(crate) fn rewrite_keeping_times(path: &Path, at: u64) {
    use std::io::{Read, Seek, SeekFrom, Write};
    let meta = std::fs::metadata(path).unwrap();
    let (ino, len) = (inode(path), meta.len());
    let times = std::fs::FileTimes::new()
        .set_accessed(meta.accessed().unwrap())
        .set_modified(meta.modified().unwrap());
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8];
    f.seek(SeekFrom::Start(at)).unwrap();
    f.read_exact(&mut b).unwrap();
    f.seek(SeekFrom::Start(at)).unwrap();
    f.write_all(&[!b[0]]).unwrap();
    f.set_times(times).unwrap();
    drop(f);
    let now = std::fs::metadata(path).unwrap();
    assert_eq!((inode(path), now.len()), (ino, len), "not the same file");
    assert_eq!(now.modified().unwrap(), meta.modified().unwrap());
}

/// A file written in place whose modification time was put back passed the
/// check (device, inode, size and modification time all as they were), and its new bytes were
/// read: packed and `.npy`, mapped and `pread`. Its status-change time tells.
#[cfg(unix)]
#[test]
fn bytes_rewritten_in_place_with_the_times_put_back_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    for path in files(dir.path()) {
        let sources = open_all(&path);
        wait_past_ctime(&path);
        // A byte of the first record's data (packed) or of the last row (`.npy`).
        let len = std::fs::metadata(&path).unwrap().len();
        let at = if path.extension().is_some_and(|e| e == "npy") {
            len - 1
        } else {
            64 + 5
        };
        let before = sources[0].get(0).unwrap().bytes().unwrap().to_vec();
        rewrite_keeping_times(&path, at);
        for d in &sources {
            assert_changed(d.as_ref(), &path, "status-change time");
            assert_changed(d.as_ref(), &path, "modification time put back");
        }
        if path.extension().is_some_and(|e| e == "gfd") {
            // What the check exists for: the mapping reads the new bytes.
            let after = sources[0].get(0).unwrap().bytes().unwrap().to_vec();
            assert_ne!(after, before);
        }
    }
}

/// The same through the loader: epoch 0 runs, the file is written in place with its times put
/// back, and epoch 1's first batch is the error, for a packed file and a `.npy` array, mapped
/// and `pread`.
#[cfg(unix)]
#[test]
fn a_file_rewritten_with_its_times_put_back_fails_the_next_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let gfd = dir.path().join("ten.gfd");
    let npy = dir.path().join("ten.npy");
    let good_gfd = dir.path().join("good.gfd");
    let good_npy = dir.path().join("good.npy");
    for mode in MODES {
        packed(&gfd, 10, 0);
        packed(&good_gfd, 10, 0);
        std::fs::write(&npy, npy_bytes(10, 1)).unwrap();
        std::fs::write(&good_npy, npy_bytes(10, 1)).unwrap();
        let options = ReadOptions {
            mode,
            ..Default::default()
        };
        let opened = |p: &Path| -> Box<dyn Dataset> {
            if p.extension().is_some_and(|e| e == "npy") {
                Box::new(NpyArray::open_with(p, "data", mode).unwrap())
            } else {
                Box::new(RecordFile::open_with(p, options).unwrap())
            }
        };
        for (path, good) in [(&gfd, &good_gfd), (&npy, &good_npy)] {
            check_epochs_over_shards(opened(path), opened(good), 2, || {
                wait_past_ctime(path);
                rewrite_keeping_times(path, std::fs::metadata(path).unwrap().len() - 70);
                path.clone()
            });
        }
    }
}
