//! `gpufeed pack --shard-size ... -o DIR/`, and `inspect` and `bench` of a shard directory.

use crate::cli_common;

use cli_common::{gpufeed, s, stderr, stdout, write_npy};
use gpufeed::Dataset;
use gpufeed::format::DType;
use gpufeed::source::shards::packed::PackedShards;
use serde_json::Value;

/// 1,000 rows of 1,000 bytes (row `i` is bytes `i`) and u32 labels, as .npy files in `dir`.
fn inputs(dir: &std::path::Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let data: Vec<u8> = (0..1000u32)
        .flat_map(|i| std::iter::repeat_n(i as u8, 1000))
        .collect();
    let labels: Vec<u8> = (0..1000u32).flat_map(|i| i.to_le_bytes()).collect();
    (
        write_npy(&dir.join("x.npy"), DType::U8, &[1000, 1000], &data),
        write_npy(&dir.join("y.npy"), DType::U32, &[1000], &labels),
    )
}

#[test]
fn pack_writes_shards_that_inspect_and_bench_read() {
    let dir = tempfile::tempdir().unwrap();
    let (x, y) = inputs(dir.path());
    let out = dir.path().join("shards");
    let o = gpufeed(&[
        "pack",
        "--from",
        "npy",
        s(&x),
        "--labels",
        s(&y),
        "--shard-size",
        "100KiB",
        "-o",
        &format!("{}/", s(&out)),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("shards of"), "{}", stdout(&o));
    let d = PackedShards::open(&out).unwrap();
    assert_eq!(d.len(), 1000);
    assert!(d.shard_count() >= 10, "{} shards", d.shard_count());
    for name in d.shard_names() {
        let len = std::fs::metadata(out.join(name)).unwrap().len();
        assert!(len <= 100 << 10, "{name}: {len} bytes");
    }
    assert_eq!(
        d.get(999).unwrap().field(0),
        Some(&[999u32 as u8; 1000][..])
    );

    // A second pack into the same directory needs --force.
    let again = gpufeed(&[
        "pack",
        "--from",
        "npy",
        s(&x),
        "--shard-size",
        "100KiB",
        "-o",
        s(&out),
    ]);
    assert!(!again.status.success());
    assert!(stderr(&again).contains("--force"), "{}", stderr(&again));

    let o = gpufeed(&["inspect", s(&out), "--json", "--verify"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["format"], "packed shards");
    assert_eq!(v["samples"], 1000);
    assert_eq!(v["shards"], d.shard_count());
    assert_eq!(v["verified"], true);
    assert_eq!(v["fields"][0]["name"], "data");

    let o = gpufeed(&[
        "bench",
        s(&out),
        "--json",
        "--epochs",
        "2",
        "--batch-size",
        "64",
        "--workers",
        "2",
        "--shuffle-window",
        "3",
        "--shuffle-block",
        "16",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["samples"], 2000);
    assert_eq!(v["shards"], d.shard_count());
    assert_eq!(v["shuffle_blocks"], serde_json::json!([3, 16]));
    assert!(v["store"].is_null(), "local shards fetch nothing");
    assert!(v["baseline_ratio"].as_f64().is_some());
}

#[test]
fn bad_shard_sizes_and_flags_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (x, _) = inputs(dir.path());
    let o = gpufeed(&[
        "pack",
        "--from",
        "npy",
        s(&x),
        "--shard-size",
        "12 parsecs",
        "-o",
        s(&dir.path().join("d")),
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--shard-size"), "{}", stderr(&o));
    // A file where the directory should be.
    let o = gpufeed(&[
        "pack",
        "--from",
        "npy",
        s(&x),
        "--shard-size",
        "1MiB",
        "-o",
        s(&x),
    ]);
    assert!(!o.status.success());
    // Called what it is (it was "not a regular file"), and what -o must name instead.
    let e = stderr(&o);
    assert!(
        e.contains("is a regular file") && e.contains("directory of shards"),
        "{e}"
    );
    assert!(!e.contains("not a regular file"), "{e}");
    // The two-level shuffle's flags need shards.
    let file = dir.path().join("one.gfd");
    let o = gpufeed(&["pack", "--from", "npy", s(&x), "-o", s(&file)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = gpufeed(&["bench", s(&file), "--shuffle-window", "2"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("shards or chunks"), "{}", stderr(&o));
}

/// Names in a directory, sorted.
fn names_in(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

#[test]
fn pack_refuses_existing_shard_files_without_force() {
    let dir = tempfile::tempdir().unwrap();
    let (x, _) = inputs(dir.path());
    let out = dir.path().join("d");
    std::fs::create_dir(&out).unwrap();
    // Shards a pack killed before its index left: packed files under the shards' names.
    let left = dir.path().join("left");
    let o = gpufeed(&[
        "pack",
        "--from",
        "npy",
        s(&x),
        "--shard-size",
        "100KiB",
        "-o",
        s(&left),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let orphan = out.join("shard-000000.gfd");
    std::fs::copy(left.join("shard-000000.gfd"), &orphan).unwrap();
    let before = std::fs::read(&orphan).unwrap();
    // Files of other names are the directory's own business.
    std::fs::write(out.join("README"), "notes\n").unwrap();
    let pack = |extra: &[&str]| {
        let mut args = vec!["pack", "--from", "npy", s(&x), "--shard-size", "4KiB"];
        args.extend_from_slice(&["-o", s(&out)]);
        args.extend_from_slice(extra);
        gpufeed(&args)
    };
    let o = pack(&[]);
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(
        e.contains("shard-000000.gfd") && e.contains("--force"),
        "{e}"
    );
    assert_eq!(std::fs::read(&orphan).unwrap(), before);
    assert!(!out.join("index.json").exists());
    // A shard further on that this pack would not reach is refused as well: its names are the
    // writer's.
    std::fs::remove_file(&orphan).unwrap();
    std::fs::copy(left.join("shard-000001.gfd"), out.join("shard-004711.gfd")).unwrap();
    let o = pack(&[]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("shard-004711.gfd"), "{}", stderr(&o));
    // With --force it goes: the new index does not name it.
    let o = pack(&["--force"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let d = PackedShards::open(&out).unwrap();
    assert_eq!(d.len(), 1000);
    assert!(!out.join("shard-004711.gfd").exists());
    assert_eq!(std::fs::read(out.join("README")).unwrap(), b"notes\n");
    // A file under a shard's name that gpufeed did not write is refused, forced or not.
    let precious = out.join("shard-009999.gfd");
    std::fs::write(&precious, "precious\n").unwrap();
    for force in [false, true] {
        let o = pack(if force { &["--force"] } else { &[] });
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{e}");
        assert!(
            e.contains("shard-009999.gfd") && e.contains("not a packed record file"),
            "{e}"
        );
    }
    assert_eq!(std::fs::read(&precious).unwrap(), b"precious\n");
    assert_eq!(PackedShards::open(&out).unwrap().len(), 1000);
}

/// `pack --force` into a directory that holds a mosaicml-streaming MDS data set (or any
/// index.json gpufeed did not write) refuses, saying what is there and what to do, and
/// touches nothing (it replaced the index.json and orphaned the MDS shards).
#[test]
fn pack_force_refuses_a_data_set_another_writer_wrote() {
    let dir = tempfile::tempdir().unwrap();
    let (x, _) = inputs(dir.path());
    let mds = dir.path().join("mds");
    std::fs::create_dir(&mds).unwrap();
    for e in std::fs::read_dir(fixtures().join("mds")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), mds.join(e.file_name())).unwrap();
    }
    let foreign = dir.path().join("foreign");
    std::fs::create_dir(&foreign).unwrap();
    std::fs::write(
        foreign.join("index.json"),
        b"{\"version\": 1, \"files\": []}",
    )
    .unwrap();
    for (out, what) in [(&mds, "an MDS data set"), (&foreign, "index.json")] {
        let before: Vec<(String, Vec<u8>)> = names_in(out)
            .into_iter()
            .map(|n| (n.clone(), std::fs::read(out.join(&n)).unwrap()))
            .collect();
        for force in [false, true] {
            let mut args = vec!["pack", "--from", "npy", s(&x), "--shard-size", "100KiB"];
            args.extend_from_slice(&["-o", s(out)]);
            if force {
                args.push("--force");
            }
            let o = gpufeed(&args);
            let e = stderr(&o);
            assert_eq!(o.status.code(), Some(1), "{e}");
            assert!(e.contains(s(out)) && e.contains(what), "{e}");
            assert!(
                e.contains("gpufeed did not write") && e.contains("another directory"),
                "{e}"
            );
        }
        let after: Vec<(String, Vec<u8>)> = names_in(out)
            .into_iter()
            .map(|n| (n.clone(), std::fs::read(out.join(&n)).unwrap()))
            .collect();
        assert_eq!(after, before, "{} was changed", s(out));
    }
    assert_eq!(
        gpufeed::source::open(&mds, &Default::default())
            .unwrap()
            .len(),
        7
    );
}

/// A second `pack --force` with fewer shards leaves exactly the new data set: the old
/// shards the new index does not name are removed (they were left beside it).
#[test]
fn pack_force_with_fewer_shards_removes_the_old_ones() {
    let dir = tempfile::tempdir().unwrap();
    let (x, _) = inputs(dir.path());
    let small = write_npy(
        &dir.path().join("small.npy"),
        DType::U8,
        &[150, 1000],
        &[7; 150_000],
    );
    let out = dir.path().join("d");
    let pack = |input: &std::path::Path| {
        gpufeed(&[
            "pack",
            "--from",
            "npy",
            s(input),
            "--shard-size",
            "100KiB",
            "-o",
            s(&out),
            "--force",
        ])
    };
    let o = pack(&x);
    assert!(o.status.success(), "{}", stderr(&o));
    let old = PackedShards::open(&out).unwrap().shard_count();
    std::fs::write(out.join("notes.txt"), "mine\n").unwrap();
    let o = pack(&small);
    assert!(o.status.success(), "{}", stderr(&o));
    let d = PackedShards::open(&out).unwrap();
    assert_eq!(d.len(), 150);
    assert!(
        d.shard_count() < old,
        "{} shards, {old} before",
        d.shard_count()
    );
    assert!(
        stdout(&o).contains(&format!("removed {} shards", old - d.shard_count())),
        "{}",
        stdout(&o)
    );
    let mut want: Vec<String> = d.shard_names().to_vec();
    want.extend(["index.json".to_owned(), "notes.txt".to_owned()]);
    want.sort();
    assert_eq!(names_in(&out), want);
    d.verify(|_| {}).unwrap();
}

#[test]
fn a_signalled_sharded_pack_leaves_no_shards_without_an_index() {
    use cli_common::{cmd, default_signals, signal, wait_for_file, wait_with_limit};
    use std::os::unix::process::ExitStatusExt;
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        let dir = tempfile::tempdir().unwrap();
        // 16 GiB that take no disk space: seconds of packing, shards of 8 records each.
        let input = dir.path().join("sparse.bin");
        std::fs::File::create(&input)
            .unwrap()
            .set_len(16 << 30)
            .unwrap();
        let out = dir.path().join("shards");
        let mut c = cmd(&[
            "pack",
            "--from",
            "raw",
            s(&input),
            "--record-bytes",
            "1048576",
            "--shard-size",
            "9MiB",
            "-o",
            s(&out),
        ]);
        let mut child = default_signals(&mut c)
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // Shard 2 under way: shards 0 and 1 are finished, under their own names.
        wait_for_file(dir.path(), "shards", &mut child);
        wait_for_file(&out, "shard-000002.gfd.gpufeed-tmp-", &mut child);
        assert!(out.join("shard-000001.gfd").exists());
        signal(&child, sig);
        let status = wait_with_limit(&mut child, std::time::Duration::from_secs(60));
        assert!(
            status.signal() == Some(sig) || status.code() == Some(128 + sig),
            "signal {sig}: {status}"
        );
        let left: Vec<_> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(left.is_empty(), "signal {sig} left {left:?}");
    }
}

fn fixtures() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/streaming")
}

#[test]
fn bench_images_runs_the_image_pipeline_on_webdataset_and_mds_shards() {
    // WebDataset (jpg + cls, by webdataset's ShardWriter) and MDS (a jpeg column, by
    // mosaicml-streaming's MDSWriter): the image and label fields found by their writers'
    // names, or named by flags.
    for (data, extra) in [
        (fixtures().join("wds"), vec![]),
        (fixtures().join("mds"), vec!["--image-field", "img"]),
        (
            fixtures().join("wds"),
            vec!["--image-field", "jpg", "--label-field", "cls"],
        ),
    ] {
        let mut args = vec![
            "bench",
            "--images",
            s(&data),
            "--image-size",
            "8",
            "--epochs",
            "1",
            "--batch-size",
            "2",
            "--workers",
            "1",
            "--json",
        ];
        args.extend(extra);
        let o = gpufeed(&args);
        assert!(o.status.success(), "{data:?}: {}", stderr(&o));
        let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
        assert!(v["samples"].as_u64().unwrap() > 0, "{v}");
    }
    // A label field that is not an integer is refused naming the flag.
    let o = gpufeed(&[
        "bench",
        "--images",
        s(&fixtures().join("wds")),
        "--label-field",
        "txt",
        "--epochs",
        "1",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("txt"), "{}", stderr(&o));
}

/// An MDS data set written with hashes (`xxh3_64`, `xxh64`, `sha1`), one byte of a sample
/// flipped inside a shard: `bench` fails naming the shard and the sample instead of
/// delivering the byte (it exited 0); `--verify` applies to sharded data sets as to files (it
/// was refused with a message about object stores), and passes on the intact data set.
#[test]
fn bench_refuses_a_local_mds_shard_that_fails_its_hashes_and_verifies_shards() {
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixtures().join("mds")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    let victim = dir.path().join("shard.00001.mds");
    let intact = std::fs::read(&victim).unwrap();
    let mut flipped = intact.clone();
    *flipped.last_mut().unwrap() ^= 0x10;
    let bench = |verify: bool| {
        let mut args = vec![
            "bench",
            s(dir.path()),
            "--fields",
            "id,u64",
            "--epochs",
            "1",
            "--batch-size",
            "1",
            "--workers",
            "1",
            "--json",
        ];
        if verify {
            args.push("--verify");
        }
        gpufeed(&args)
    };
    std::fs::write(&victim, &flipped).unwrap();
    for verify in [false, true] {
        let o = bench(verify);
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "--verify {verify}: {e}");
        assert!(e.contains(s(&victim)) && e.contains("xxh64"), "{e}");
        assert!(e.contains("sample 2") || e.contains("sample 3"), "{e}");
        assert!(!e.contains("panicked"), "{e}");
    }
    std::fs::write(&victim, &intact).unwrap();
    for verify in [false, true] {
        let o = bench(verify);
        assert!(o.status.success(), "--verify {verify}: {}", stderr(&o));
        let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
        assert_eq!(v["samples"], 7);
    }
}

#[cfg(not(feature = "remote"))]
#[test]
fn a_url_in_a_build_without_object_stores_names_the_command_that_builds_one() {
    // A user of the command is told the cargo command for the command, not a library feature.
    let o = gpufeed(&["inspect", "s3://bucket/train"]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(err.contains("s3://bucket/train"), "{err}");
    assert!(
        err.contains("cargo install --locked --profile dist --path crates/cli --features s3"),
        "{err}"
    );
    assert!(!err.contains("build it with"), "{err}");
}
