//! `gpufeed pack` never destroys data: not its inputs, not what `-o` names unless it is a
//! regular file and `--force` is given, never a half-written file under the output's name, and
//! no temporary left behind by an error or a catchable signal. Run as the built binary.

use crate::cli_common;

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use cli_common::*;
use gpufeed::format::{DType, RecordFile};

const TMP: &str = ".gpufeed-tmp-";

fn npy(dir: &Path, name: &str, rows: u64) -> PathBuf {
    let data: Vec<u8> = (0..rows * 4).map(|i| i as u8).collect();
    write_npy(&dir.join(name), DType::U8, &[rows, 4], &data)
}

/// Asserts that `o` failed with a message naming `path` and containing every one of `want`,
/// without panicking.
fn refused(o: &std::process::Output, path: &Path, want: &[&str]) {
    let e = stderr(o);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(!e.contains("panicked"), "{e}");
    assert!(e.contains(s(path)), "`{}` missing from: {e}", s(path));
    for w in want {
        assert!(e.contains(w), "`{w}` missing from: {e}");
    }
    assert!(!e.contains(TMP) && !e.contains(".tmp-"), "{e}");
}

#[test]
fn pack_refuses_to_write_over_its_own_input() {
    let dir = tempfile::tempdir().unwrap();
    let a = npy(dir.path(), "a.npy", 5);
    let l = write_npy(&dir.path().join("l.npy"), DType::U32, &[5], &[1; 20]);
    let before = std::fs::read(&a).unwrap();
    for force in [false, true] {
        let mut args = vec!["pack", "--from", "npy", s(&a), "-o", s(&a)];
        if force {
            args.push("--force");
        }
        refused(&gpufeed(&args), &a, &["input"]);
        assert_eq!(
            std::fs::read(&a).unwrap(),
            before,
            "the input was destroyed"
        );
        // The labels file is an input too.
        let mut args = vec![
            "pack",
            "--from",
            "npy",
            s(&a),
            "--labels",
            s(&l),
            "-o",
            s(&l),
        ];
        if force {
            args.push("--force");
        }
        refused(&gpufeed(&args), &l, &["input"]);
        assert_eq!(std::fs::read(&l).unwrap().len(), 128 + 20);
    }
    // Raw inputs.
    let raw = dir.path().join("r.bin");
    std::fs::write(&raw, [3u8; 40]).unwrap();
    let o = gpufeed(&[
        "pack",
        "--from",
        "raw",
        s(&raw),
        "--record-bytes",
        "10",
        "-o",
        s(&raw),
        "--force",
    ]);
    refused(&o, &raw, &["input"]);
    assert_eq!(std::fs::read(&raw).unwrap(), [3u8; 40]);
    assert!(files_with(dir.path(), TMP).is_empty());
}

#[test]
fn pack_refuses_an_input_reached_through_a_hard_link_or_a_linked_directory() {
    let dir = tempfile::tempdir().unwrap();
    let a = npy(dir.path(), "a.npy", 5);
    let before = std::fs::read(&a).unwrap();
    let hard = dir.path().join("hard.npy");
    std::fs::hard_link(&a, &hard).unwrap();
    let linked_dir = dir.path().join("via");
    std::os::unix::fs::symlink(dir.path(), &linked_dir).unwrap();
    let through_dir = linked_dir.join("a.npy");
    for out in [&hard, &through_dir] {
        let o = gpufeed(&["pack", "--from", "npy", s(&a), "-o", s(out), "--force"]);
        refused(&o, out, &["input"]);
        assert_eq!(
            std::fs::read(&a).unwrap(),
            before,
            "the input was destroyed"
        );
    }
    // The input named through a symbolic link, the output by its real name.
    let sym = dir.path().join("sym.npy");
    std::os::unix::fs::symlink(&a, &sym).unwrap();
    let o = gpufeed(&["pack", "--from", "npy", s(&sym), "-o", s(&a), "--force"]);
    refused(&o, &a, &["input"]);
    assert_eq!(std::fs::read(&a).unwrap(), before);
}

#[test]
fn pack_refuses_outputs_that_are_not_regular_files() {
    let dir = tempfile::tempdir().unwrap();
    let a = npy(dir.path(), "a.npy", 5);
    // A symbolic link to a file that is not an input: neither it nor its target is touched.
    let target = dir.path().join("precious.txt");
    std::fs::write(&target, b"keep me").unwrap();
    let link = dir.path().join("link.gfd");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    // A FIFO: the old command replaced it (and would block a reader forever).
    let fifo = dir.path().join("fifo");
    let c = std::ffi::CString::new(s(&fifo)).unwrap();
    // SAFETY: mkfifo with a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    // A character device: one of our own (as root), else /dev/null (which a user cannot
    // replace anyway).
    let dev = dir.path().join("null");
    let c = std::ffi::CString::new(s(&dev)).unwrap();
    // SAFETY: mknod with a NUL-terminated path; makes /dev/null's device (1, 3).
    let made = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) } == 0;
    let dev = if made {
        dev
    } else {
        PathBuf::from("/dev/null")
    };
    let subdir = dir.path().join("sub");
    std::fs::create_dir(&subdir).unwrap();
    for (out, what) in [
        (&link, "symbolic link"),
        (&fifo, "FIFO"),
        (&dev, "character device"),
        (&subdir, "directory"),
    ] {
        for force in [false, true] {
            let mut args = vec!["pack", "--from", "npy", s(&a), "-o", s(out)];
            if force {
                args.push("--force");
            }
            let o = output_with_limit(cmd(&args), Duration::from_secs(60));
            refused(&o, out, &[what]);
        }
    }
    use std::os::unix::fs::FileTypeExt;
    assert!(
        std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert_eq!(std::fs::read(&target).unwrap(), b"keep me");
    assert!(
        std::fs::symlink_metadata(&fifo)
            .unwrap()
            .file_type()
            .is_fifo()
    );
    assert!(
        std::fs::metadata(&dev)
            .unwrap()
            .file_type()
            .is_char_device()
    );
    assert_eq!(std::fs::read_dir(&subdir).unwrap().count(), 0);
    assert!(files_with(dir.path(), TMP).is_empty());
}

#[test]
fn pack_replaces_an_existing_file_only_with_force() {
    let dir = tempfile::tempdir().unwrap();
    let a = npy(dir.path(), "a.npy", 5);
    let out = dir.path().join("out.gfd");
    let o = gpufeed(&[
        "pack",
        "--from",
        "npy",
        s(&npy(dir.path(), "b.npy", 3)),
        "-o",
        s(&out),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let older = std::fs::read(&out).unwrap();
    let o = gpufeed(&["pack", "--from", "npy", s(&a), "-o", s(&out)]);
    refused(&o, &out, &["exists", "--force"]);
    assert_eq!(std::fs::read(&out).unwrap(), older);
    let o = gpufeed(&["pack", "--from", "npy", s(&a), "-o", s(&out), "--force"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(RecordFile::open(&out).unwrap().len(), 5);
    // An empty file holds nothing to lose: replaced with --force too.
    std::fs::write(&out, b"").unwrap();
    let o = gpufeed(&["pack", "--from", "npy", s(&a), "-o", s(&out), "--force"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(RecordFile::open(&out).unwrap().len(), 5);
    assert!(files_with(dir.path(), TMP).is_empty());
}

/// `--force` replaces a packed file gpufeed wrote, not whatever file -o names: a `.npy` array
/// that is not an input, or a file of the user's, is refused, forced or not, saying what it
/// is and what to do (it was overwritten).
#[test]
fn pack_force_refuses_to_replace_a_file_gpufeed_did_not_write() {
    let dir = tempfile::tempdir().unwrap();
    let a = npy(dir.path(), "a.npy", 5);
    let other = npy(dir.path(), "other.npy", 9);
    let notes = dir.path().join("notes.gfd");
    std::fs::write(&notes, b"an older file, not a packed one").unwrap();
    for (out, what) in [(&other, ".npy array"), (&notes, "a file of 31 bytes")] {
        let before = std::fs::read(out).unwrap();
        for force in [false, true] {
            let mut args = vec!["pack", "--from", "npy", s(&a), "-o", s(out)];
            if force {
                args.push("--force");
            }
            let o = gpufeed(&args);
            refused(
                &o,
                out,
                &[what, "not a packed record file", "remove it yourself"],
            );
            assert_eq!(
                std::fs::read(out).unwrap(),
                before,
                "{} was replaced",
                s(out)
            );
        }
    }
    assert!(files_with(dir.path(), TMP).is_empty());
}

#[test]
fn pack_checks_the_output_directory_before_reading_anything() {
    let dir = tempfile::tempdir().unwrap();
    let a = npy(dir.path(), "a.npy", 5);
    let out = dir.path().join("no-such-dir").join("out.gfd");
    let o = gpufeed(&["pack", "--from", "npy", s(&a), "-o", s(&out)]);
    refused(&o, &out, &["no-such-dir"]);
    // A file where the directory should be.
    let out = dir.path().join("a.npy").join("out.gfd");
    let o = gpufeed(&["pack", "--from", "npy", s(&a), "-o", s(&out)]);
    refused(&o, &out, &["not a directory"]);
    // An image folder is not scanned when the output cannot be written.
    let images = dir.path().join("images");
    std::fs::create_dir_all(images.join("cat")).unwrap();
    let out = dir.path().join("no-such-dir").join("images.gfd");
    let o = gpufeed(&["pack", "--from", "imagefolder", s(&images), "-o", s(&out)]);
    refused(&o, &out, &["no-such-dir"]);
}

#[test]
fn pack_from_npy_of_a_directory_says_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let o = gpufeed(&[
        "pack",
        "--from",
        "npy",
        s(dir.path()),
        "-o",
        s(&dir.path().join("o.gfd")),
    ]);
    refused(&o, dir.path(), &["directory", "--from imagefolder"]);
    assert!(!stderr(&o).contains("No such device"), "{}", stderr(&o));
}

/// A raw input of `gib` GiB that takes no disk space (a sparse file): packing it takes
/// seconds, time enough to signal the command in the middle.
fn sparse_input(dir: &Path, gib: u64) -> PathBuf {
    let p = dir.join("sparse.bin");
    std::fs::File::create(&p)
        .unwrap()
        .set_len(gib << 30)
        .unwrap();
    p
}

#[test]
fn a_signalled_pack_removes_its_temporary_file() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        let dir = tempfile::tempdir().unwrap();
        let input = sparse_input(dir.path(), 16);
        let out = dir.path().join("out.gfd");
        let mut c = cmd(&[
            "pack",
            "--from",
            "raw",
            s(&input),
            "--record-bytes",
            "1048576",
            "-o",
            s(&out),
        ]);
        let mut child = default_signals(&mut c)
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        wait_for_file(dir.path(), "tmp-", &mut child);
        signal(&child, sig);
        let status = wait_with_limit(&mut child, Duration::from_secs(60));
        assert!(
            status.signal() == Some(sig) || status.code() == Some(128 + sig),
            "signal {sig}: {status}"
        );
        let left = files_with(dir.path(), "tmp-");
        assert!(left.is_empty(), "signal {sig} left {left:?}");
        assert!(!out.exists());
    }
}

/// Ctrl-C while `pack --shard-size` writes many small shards (each synced, renamed into
/// place and hashed) ends the command of SIGINT every time, printing no error and leaving
/// nothing of the pack. Before, the signal thread removed a shard's temporary file (or the
/// shard just placed) while the writer was still placing it, and the writer's next step
/// failed: the command printed "No such file or directory" and, when it got there before the
/// signal ended it, exited 1; or the writer started the next shard's temporary after the
/// cleanup, which was left behind (5 of 40 tries of this run failed so). The signal comes at a different
/// point of the run each try; at most 40 tries, within about 40 s.
#[test]
fn ctrl_c_during_a_sharded_pack_always_ends_it_of_sigint_with_nothing_left() {
    let dir = tempfile::tempdir().unwrap();
    let input = sparse_input(dir.path(), 4);
    let start = std::time::Instant::now();
    let mut tries = 0u64;
    while tries < 40 && start.elapsed() < Duration::from_secs(40) {
        let name = format!("out-{tries}");
        let out = dir.path().join(&name);
        let mut c = cmd(&[
            "pack",
            "--from",
            "raw",
            s(&input),
            "--record-bytes",
            "65536",
            "--shard-size",
            "200KiB",
            "-o",
            s(&out),
        ]);
        let mut child = default_signals(&mut c)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        wait_for_file(dir.path(), &name, &mut child);
        wait_for_file(&out, "shard-000001.gfd", &mut child);
        std::thread::sleep(Duration::from_millis(tries * 7 % 60));
        signal(&child, libc::SIGINT);
        let status = wait_with_limit(&mut child, Duration::from_secs(60));
        let mut said = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut said).unwrap();
        assert!(
            status.signal() == Some(libc::SIGINT) || status.code() == Some(128 + libc::SIGINT),
            "try {tries}: {status}: {said}"
        );
        assert!(!said.contains("error"), "try {tries}: {said}");
        let left: Vec<_> = std::fs::read_dir(&out)
            .map(|d| d.map(|e| e.unwrap().file_name()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "try {tries} left {left:?}");
        tries += 1;
    }
    assert!(tries >= 10, "only {tries} tries in 40 s");
}

#[test]
fn a_pack_past_the_file_size_limit_fails_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.bin");
    std::fs::write(&input, vec![9u8; 4 << 20]).unwrap();
    let out = dir.path().join("out.gfd");
    // `ulimit -f` counts 1024-byte blocks in bash, 512 in POSIX sh: 1 MiB at most either way.
    let script = format!(
        "ulimit -f 1024 && exec '{}' pack --from raw '{}' --record-bytes 4096 -o '{}'",
        s(&bin()),
        s(&input),
        s(&out)
    );
    let mut c = std::process::Command::new("sh");
    c.args(["-c", &script]);
    let o = output_with_limit(c, Duration::from_secs(60));
    assert!(
        o.status.signal().is_none(),
        "killed by {:?}",
        o.status.signal()
    );
    refused(&o, &out, &["too large"]);
    assert!(files_with(dir.path(), "tmp-").is_empty());
    assert!(!out.exists());
}

#[test]
fn sigkill_never_corrupts_the_output_and_the_next_pack_clears_what_it_left() {
    let dir = tempfile::tempdir().unwrap();
    let small = npy(dir.path(), "small.npy", 7);
    let out = dir.path().join("out.gfd");
    let o = gpufeed(&["pack", "--from", "npy", s(&small), "-o", s(&out)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let before = std::fs::read(&out).unwrap();
    let input = sparse_input(dir.path(), 16);
    let mut child = cmd(&[
        "pack",
        "--from",
        "raw",
        s(&input),
        "--record-bytes",
        "1048576",
        "-o",
        s(&out),
        "--force",
    ])
    .stderr(std::process::Stdio::null())
    .spawn()
    .unwrap();
    wait_for_file(dir.path(), TMP, &mut child);
    std::thread::sleep(Duration::from_millis(50));
    signal(&child, libc::SIGKILL);
    wait_with_limit(&mut child, Duration::from_secs(60));
    assert_eq!(
        std::fs::read(&out).unwrap(),
        before,
        "SIGKILL changed the output"
    );
    RecordFile::open(&out).unwrap().verify(|_| {}).unwrap();
    assert_eq!(files_with(dir.path(), TMP).len(), 1);
    // The next pack to the same output removes it, and says so.
    let o = gpufeed(&["pack", "--from", "npy", s(&small), "-o", s(&out), "--force"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("removed 1 temporary file"),
        "{}",
        stderr(&o)
    );
    assert!(files_with(dir.path(), TMP).is_empty());
}

#[test]
fn two_packs_racing_to_one_output_give_one_clear_result() {
    let dir = tempfile::tempdir().unwrap();
    // Inputs large enough for the two packs to overlap.
    let inputs: Vec<PathBuf> = [1u8, 2]
        .iter()
        .map(|&fill| {
            let p = dir.path().join(format!("in{fill}.bin"));
            std::fs::write(&p, vec![fill; 64 << 20]).unwrap();
            p
        })
        .collect();
    for force in [false, true] {
        let out = dir.path().join(format!("out-{force}.gfd"));
        let children: Vec<_> = inputs
            .iter()
            .map(|input| {
                let mut args = vec![
                    "pack",
                    "--from",
                    "raw",
                    s(input),
                    "--record-bytes",
                    "65536",
                    "-o",
                    s(&out),
                ];
                if force {
                    args.push("--force");
                }
                cmd(&args)
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let outputs: Vec<_> = children
            .into_iter()
            .map(|c| c.wait_with_output().unwrap())
            .collect();
        let ok = outputs.iter().filter(|o| o.status.success()).count();
        for o in &outputs {
            assert!(!stderr(o).contains("panicked"), "{}", stderr(o));
            if !o.status.success() {
                assert!(stderr(o).contains(s(&out)), "{}", stderr(o));
            }
        }
        let said: Vec<String> = outputs.iter().map(stderr).collect();
        if force {
            assert_eq!(
                ok, 2,
                "with --force both replace the output in turn: {said:?}"
            );
        } else {
            assert_eq!(
                ok, 1,
                "without --force exactly one creates the output: {said:?}"
            );
        }
        let f = RecordFile::open(&out).unwrap();
        f.verify(|_| {}).unwrap();
        assert_eq!(f.len(), 1024);
        let fill = f.get(0).unwrap().field_named("data").unwrap()[0];
        assert!(
            (0..f.len()).all(|i| f.get(i).unwrap().field_named("data").unwrap()[0] == fill),
            "records of both writers in one file"
        );
    }
    assert!(files_with(dir.path(), TMP).is_empty());
}

#[test]
fn pack_takes_more_npy_inputs_than_the_kernel_has_maps() {
    let limit: u64 = std::fs::read_to_string("/proc/sys/vm/max_map_count")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(65_530);
    let n = limit + 500;
    let dir = tempfile::tempdir().unwrap();
    let header = gpufeed::source::npy_header(DType::U8, &[1, 2]).unwrap();
    let names: Vec<String> = (0..n).map(|i| format!("{i}.npy")).collect();
    for (i, name) in names.iter().enumerate() {
        let mut b = header.clone();
        b.extend_from_slice(&(i as u16).to_le_bytes());
        std::fs::write(dir.path().join(name), b).unwrap();
    }
    // Relative names keep the command line short.
    let mut c = cmd(&["pack", "--from", "npy", "-o", "all.gfd"]);
    c.args(&names).current_dir(dir.path());
    let o = output_with_limit(c, Duration::from_secs(300));
    assert!(o.status.success(), "{}", stderr(&o));
    let f = RecordFile::open(dir.path().join("all.gfd")).unwrap();
    assert_eq!(f.len(), n);
    assert_eq!(
        f.get(n - 1).unwrap().field_named("data").unwrap(),
        &((n - 1) as u16).to_le_bytes()
    );
}

#[test]
fn pack_names_the_data_field_as_asked() {
    let dir = tempfile::tempdir().unwrap();
    let a = npy(dir.path(), "a.npy", 3);
    let labels: Vec<u8> = [4u32, 5, 6].iter().flat_map(|l| l.to_le_bytes()).collect();
    let l = write_npy(&dir.path().join("l.npy"), DType::U32, &[3], &labels);
    let out = dir.path().join("out.gfd");
    let o = gpufeed(&[
        "pack",
        "--from",
        "npy",
        s(&a),
        "--labels",
        s(&l),
        "--field",
        "image",
        "-o",
        s(&out),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let f = RecordFile::open(&out).unwrap();
    let names: Vec<&str> = f
        .schema()
        .fields()
        .iter()
        .map(|f| f.name.as_str())
        .collect();
    assert_eq!(names, ["image", "label"]);
    assert_eq!(
        f.get(2).unwrap().field_named("label").unwrap(),
        6u32.to_le_bytes()
    );
}

#[test]
fn a_signal_ignored_when_pack_starts_stays_ignored() {
    // `nohup gpufeed pack ...` must survive its terminal's hangup.
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.bin");
    std::fs::File::create(&input)
        .unwrap()
        .set_len(256 << 20)
        .unwrap();
    let out = dir.path().join("out.gfd");
    let script = format!(
        "trap '' HUP; exec '{}' pack --from raw '{}' --record-bytes 1048576 -o '{}'",
        s(&bin()),
        s(&input),
        s(&out)
    );
    let mut child = std::process::Command::new("sh")
        .args(["-c", &script])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_for_file(dir.path(), TMP, &mut child);
    signal(&child, libc::SIGHUP);
    let status = wait_with_limit(&mut child, Duration::from_secs(120));
    assert!(status.success(), "{status}");
    assert_eq!(RecordFile::open(&out).unwrap().len(), 256);
}
