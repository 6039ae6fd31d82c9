//! `RecordWriter`'s temporary files: unique, exclusive, removed on every path but SIGKILL, and
//! what SIGKILL leaves is removable by the next writer; concurrent writers to one destination.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier};

use gpufeed::format::{
    DType, Field, RecordFile, RecordWriter, Schema, TEMPORARY_MARKER, remove_stale_temporaries,
};

fn schema() -> Schema {
    Schema::new(vec![
        Field::tensor("data", DType::U8, &[4096]),
        Field::tensor("label", DType::U32, &[]),
    ])
    .unwrap()
}

/// The temporaries beside `dir`'s files.
fn temporaries(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let n = p.file_name().unwrap().to_string_lossy().into_owned();
            n.contains(TEMPORARY_MARKER) || n.contains(".tmp-")
        })
        .collect()
}

/// Writes `records` records whose bytes are all `fill`.
fn write(path: &Path, fill: u8, records: u32, new: bool) -> gpufeed::Result<u64> {
    let mut w = if new {
        RecordWriter::create_new(path, schema())?
    } else {
        RecordWriter::create(path, schema())?
    };
    let data = vec![fill; 4096];
    for i in 0..records {
        w.append(&[&data, &i.to_le_bytes()])?;
    }
    Ok(w.finish()?.records)
}

/// The fill byte of a file `write` made, after checking every record.
fn fill_of(path: &Path) -> u8 {
    let f = RecordFile::open(path).unwrap();
    f.verify(|_| {}).unwrap();
    let first = f.get(0).unwrap().field_named("data").unwrap()[0];
    for i in 0..f.len() {
        let r = f.get(i).unwrap();
        assert!(r.field_named("data").unwrap().iter().all(|&b| b == first));
    }
    first
}

#[test]
fn temporaries_are_unique_exclusive_and_named_for_their_writer() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.gfd");
    let a = RecordWriter::create(&out, schema()).unwrap();
    let b = RecordWriter::create(&out, schema()).unwrap();
    let tmps = temporaries(dir.path());
    assert_eq!(tmps.len(), 2, "{tmps:?}");
    let prefix = format!("out.gfd{TEMPORARY_MARKER}{}-", std::process::id());
    for t in &tmps {
        let name = t.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with(&prefix), "{name}");
    }
    drop((a, b));
    assert!(temporaries(dir.path()).is_empty());
}

#[test]
fn two_writers_in_one_process_never_make_a_corrupt_file() {
    for round in 0..5u8 {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out.gfd");
        let barrier = Arc::new(Barrier::new(2));
        let handles: Vec<_> = [1u8, 2]
            .into_iter()
            .map(|fill| {
                let (out, barrier) = (out.clone(), Arc::clone(&barrier));
                std::thread::spawn(move || {
                    barrier.wait();
                    write(&out, fill + 2 * round, 300, false)
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        // Both report Ok, and the file under the final name is one of them, whole.
        for r in &results {
            assert_eq!(r.as_ref().unwrap(), &300);
        }
        let fill = fill_of(&out);
        assert!([1 + 2 * round, 2 + 2 * round].contains(&fill));
        assert!(temporaries(dir.path()).is_empty());
    }
}

#[test]
fn of_two_create_new_writers_exactly_one_succeeds_and_nothing_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.gfd");
    let barrier = Arc::new(Barrier::new(2));
    let handles: Vec<_> = [1u8, 2]
        .into_iter()
        .map(|fill| {
            let (out, barrier) = (out.clone(), Arc::clone(&barrier));
            std::thread::spawn(move || {
                let mut w = RecordWriter::create_new(&out, schema())?;
                barrier.wait();
                for i in 0..200u32 {
                    w.append(&[&[fill; 4096], &i.to_le_bytes()])?;
                }
                w.finish().map(|_| fill)
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let ok: Vec<u8> = results
        .iter()
        .filter_map(|r| r.as_ref().ok().copied())
        .collect();
    assert_eq!(ok.len(), 1, "{results:?}");
    let err = results.iter().find_map(|r| r.as_ref().err()).unwrap();
    let msg = err.to_string();
    assert!(msg.contains(out.to_str().unwrap()), "{msg}");
    assert!(!msg.contains(TEMPORARY_MARKER), "{msg}");
    assert_eq!(fill_of(&out), ok[0]);
    assert!(temporaries(dir.path()).is_empty());

    // And an existing file is refused at once.
    let e = RecordWriter::create_new(&out, schema()).unwrap_err();
    assert!(e.to_string().contains(out.to_str().unwrap()), "{e}");
    assert_eq!(fill_of(&out), ok[0]);
}

/// A pid that no process has now: a child that has exited and been reaped.
fn dead_pid() -> u32 {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    pid
}

#[test]
fn stale_temporaries_of_dead_writers_are_removed_and_no_live_ones() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.gfd");
    let dead = dir.path().join(format!(
        "out.gfd{TEMPORARY_MARKER}{}-00000000000000ab",
        dead_pid()
    ));
    let old_style = dir.path().join(format!("out.gfd.tmp-{}", dead_pid()));
    // pid 1 is alive (init): its files are kept, whoever wrote them.
    let alive = dir
        .path()
        .join(format!("out.gfd{TEMPORARY_MARKER}1-00000000000000cd"));
    let other_output = dir.path().join(format!(
        "other.gfd{TEMPORARY_MARKER}{}-00000000000000ef",
        dead_pid()
    ));
    for p in [&dead, &old_style, &alive, &other_output] {
        std::fs::write(p, vec![0u8; 1000]).unwrap();
    }
    // A live writer of this process.
    let live = RecordWriter::create(&out, schema()).unwrap();
    let removed = remove_stale_temporaries(&out).unwrap();
    let mut names: Vec<PathBuf> = removed.iter().map(|(p, _)| p.clone()).collect();
    names.sort();
    let mut want = vec![dead.clone(), old_style.clone()];
    want.sort();
    assert_eq!(names, want);
    assert!(removed.iter().all(|(_, bytes)| *bytes == 1000));
    assert!(alive.exists() && other_output.exists());
    assert_eq!(
        temporaries(dir.path()).len(),
        3,
        "the live writer's file was touched"
    );
    drop(live);
}

#[cfg(unix)]
#[test]
fn a_locked_temporary_is_kept_even_when_its_pid_is_gone_here() {
    use std::os::fd::AsRawFd;
    // A writer in another pid namespace (a container on a shared volume): its pid means
    // nothing here, its lock does.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.gfd");
    let tmp = dir.path().join(format!(
        "out.gfd{TEMPORARY_MARKER}{}-0000000000000001",
        dead_pid()
    ));
    let f = std::fs::File::create(&tmp).unwrap();
    // SAFETY: flock on an open descriptor.
    let locked = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    assert_eq!(locked, 0);
    assert!(remove_stale_temporaries(&out).unwrap().is_empty());
    assert!(tmp.exists());
    drop(f);
    // The lock belongs to the open file description: a child that another test forked while
    // it was open holds it too until that child execs (the descriptor is close-on-exec), so
    // the lock can outlive `drop(f)` by a moment on a busy machine (seen on 16 cores).
    let t0 = std::time::Instant::now();
    let mut removed = remove_stale_temporaries(&out).unwrap();
    while removed.is_empty() && t0.elapsed() < std::time::Duration::from_secs(5) {
        std::thread::sleep(std::time::Duration::from_millis(20));
        removed = remove_stale_temporaries(&out).unwrap();
    }
    assert_eq!(removed.len(), 1);
    assert!(!tmp.exists());
}

#[test]
fn errors_name_the_destination_not_the_temporary() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("missing").join("out.gfd");
    let e = RecordWriter::create(&out, schema())
        .unwrap_err()
        .to_string();
    assert!(e.contains(out.to_str().unwrap()), "{e}");
    assert!(!e.contains(TEMPORARY_MARKER), "{e}");
    // A directory in the way of the final rename.
    let out = dir.path().join("a_dir");
    std::fs::create_dir(&out).unwrap();
    let e = write(&out, 1, 3, false).unwrap_err().to_string();
    assert!(e.contains(out.to_str().unwrap()), "{e}");
    assert!(!e.contains(TEMPORARY_MARKER), "{e}");
    assert!(temporaries(dir.path()).is_empty());
}
