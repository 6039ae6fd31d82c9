//! `gpufeed bench` (and the command's messages), run as the built binary: no panic, hang or
//! abort on impossible settings or a closed pipe, no temporary data set left behind, flags that
//! do not apply refused, messages in flags, one report for every kind of run.

use crate::cli_common;
use crate::image_common;

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use cli_common::*;
use gpufeed::format::{Codec, DType, Field, RecordWriter, Schema};
use serde_json::Value;

/// A small generated data set: quick runs.
const SMALL: [&str; 4] = ["--records", "300", "--record-bytes", "1024"];

fn bench(extra: &[&str]) -> std::process::Output {
    let mut args = vec!["bench"];
    args.extend_from_slice(extra);
    output_with_limit(cmd(&args), Duration::from_secs(120))
}

/// The command failed with exit code 1 (no panic, no abort) and said every one of `want`.
fn refused(o: &std::process::Output, want: &[&str]) -> String {
    let e = stderr(o);
    assert_eq!(o.status.code(), Some(1), "status {:?}: {e}", o.status);
    assert!(!e.contains("panicked"), "{e}");
    for w in want {
        assert!(e.contains(w), "`{w}` missing from: {e}");
    }
    e
}

#[test]
fn output_into_a_closed_pipe_ends_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let raw = dir.path().join("r.bin");
    std::fs::write(&raw, [1u8; 640]).unwrap();
    let packed = dir.path().join("r.gfd");
    let o = gpufeed(&[
        "pack",
        "--from",
        "raw",
        s(&raw),
        "--record-bytes",
        "64",
        "-o",
        s(&packed),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let mut small = vec!["bench"];
    small.extend_from_slice(&SMALL);
    small.extend_from_slice(&["--epochs", "1"]);
    for args in [
        small.clone(),
        vec!["bench", s(&packed), "--epochs", "1", "--batch-size", "4"],
        vec!["inspect", s(&packed)],
        vec!["inspect", "--json", s(&packed)],
    ] {
        // As `gpufeed ... | head -0`: the reader is gone before the first write.
        let mut child = cmd(&args)
            .env("TMPDIR", dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        let status = wait_with_limit(&mut child, Duration::from_secs(120));
        let mut e = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut e).unwrap();
        assert!(
            status.success() || status.signal() == Some(libc::SIGPIPE),
            "{args:?}: {status}: {e}"
        );
        // Nothing about the pipe: at most the line that says the default data set is being
        // written (printed before any output, where no progress bar shows).
        let said: Vec<&str> = e
            .lines()
            .filter(|l| !l.starts_with("gpufeed: writing the default data set"))
            .collect();
        assert!(said.is_empty(), "{args:?}: {e}");
    }
    // Nothing left in the temporary directory but what the test put there.
    assert!(files_with(dir.path(), "gpufeed-").is_empty());
}

#[test]
fn impossible_sizes_fail_fast_naming_the_flag() {
    for (args, flag) in [
        (vec!["--prefetch", "1000000000"], "--prefetch"),
        (vec!["--prefetch", "10000000"], "--prefetch"),
        (vec!["--workers", "10000"], "--workers"),
        // A batch holds no more than the data set: a huge one over a huge data set (checked
        // before the data set is written).
        (
            vec!["--records", "1000000000", "--batch-size", "1000000000"],
            "--batch-size",
        ),
        (vec!["--batch-size", "0"], "--batch-size"),
        (vec!["--workers", "0"], "--workers"),
        (vec!["--prefetch", "0"], "--prefetch"),
        (vec!["--batch-parts", "0"], "--batch-parts"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut c = cmd(&["bench", "--record-bytes", "150528"]);
        if !args.contains(&"--records") {
            c.args(["--records", "256"]);
        }
        c.args(&args).env("TMPDIR", dir.path());
        let o = output_with_limit(c, Duration::from_secs(60));
        let e = refused(&o, &[flag]);
        for rust in ["batch_size", "pool_budget", "prefetch`", "workers`"] {
            assert!(!e.contains(rust), "{args:?}: Rust name {rust} in: {e}");
        }
        assert!(files_with(dir.path(), "gpufeed-").is_empty(), "{args:?}");
    }
}

#[test]
fn library_settings_are_reported_as_flags() {
    // More than the data set with --drop-last: the sampler's `drop_last` is the user's flag.
    let o = bench(&[
        "--records",
        "10",
        "--record-bytes",
        "8",
        "--batch-size",
        "64",
        "--drop-last",
    ]);
    let e = refused(&o, &["--drop-last"]);
    assert!(!e.contains("drop_last"), "{e}");
    assert!(!e.contains("invalid setting"), "{e}");
}

#[test]
fn an_interrupted_bench_removes_its_generated_data_set() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        let dir = tempfile::tempdir().unwrap();
        // Big enough to be interrupted while it is written.
        let mut c = cmd(&["bench", "--records", "200000", "--record-bytes", "150528"]);
        let mut child = default_signals(&mut c)
            .env("TMPDIR", dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        wait_for_file(dir.path(), "gpufeed-bench-", &mut child);
        std::thread::sleep(Duration::from_millis(200));
        signal(&child, sig);
        let status = wait_with_limit(&mut child, Duration::from_secs(60));
        assert!(
            status.signal() == Some(sig) || status.code() == Some(128 + sig),
            "{status}"
        );
        let left = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(left, 0, "signal {sig} left the data set behind");
    }
}

#[test]
fn a_failed_bench_removes_its_generated_data_set() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = cmd(&[
        "bench",
        "--records",
        "64",
        "--record-bytes",
        "64",
        "--fields",
        "nosuch",
    ]);
    c.env("TMPDIR", dir.path());
    let o = output_with_limit(c, Duration::from_secs(60));
    refused(&o, &["nosuch"]);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// An ImageFolder of 2 classes of 6 JPEGs, and one of its files made bad if `bad`.
fn image_folder(root: &Path, bad: bool) {
    image_common::jpeg_folder(root, 2, 6, 40, 30);
    if bad {
        let p = root.join("class_1/0003.jpg");
        let b = std::fs::read(&p).unwrap();
        std::fs::write(&p, &b[..b.len() / 3]).unwrap();
    }
}

#[test]
fn flags_that_do_not_apply_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let images = dir.path().join("images");
    image_folder(&images, false);
    let raw = dir.path().join("r.bin");
    std::fs::write(&raw, [1u8; 640]).unwrap();
    let packed = dir.path().join("r.gfd");
    let o = gpufeed(&[
        "pack",
        "--from",
        "raw",
        s(&raw),
        "--record-bytes",
        "64",
        "-o",
        s(&packed),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    for (args, want) in [
        (vec!["--epochs", "0"], "--epochs"),
        (vec!["--max-batches", "0"], "--max-batches"),
        (vec!["--images", s(&images), "--baseline"], "--baseline"),
        (vec!["--images", s(&images), "--records", "5"], "--records"),
        (vec!["--images", s(&images), "--fields", "a"], "--fields"),
        (vec!["--images", s(&images), "--epochs", "0"], "--epochs"),
        (
            vec!["--images", s(&images), "--max-batches", "0"],
            "--max-batches",
        ),
        (vec![s(&packed), "--records", "5"], "--records"),
        (vec![s(&packed), "--record-bytes", "5"], "--record-bytes"),
        (vec![s(&packed), "--image-size", "64"], "--image-size"),
        (vec![s(&packed), "--skip-bad-images"], "--skip-bad-images"),
        (vec![s(&packed), "--limit", "5"], "--limit"),
        (vec![s(&packed), "--image-field", "x"], "--image-field"),
    ] {
        let o = bench(&args);
        refused(&o, &[want]);
        assert!(stdout(&o).is_empty(), "{args:?}: {}", stdout(&o));
    }
}

#[test]
fn image_runs_honour_max_batches_no_shuffle_and_prefetch() {
    let dir = tempfile::tempdir().unwrap();
    let images = dir.path().join("images");
    image_folder(&images, false);
    let o = bench(&[
        "--images",
        s(&images),
        "--image-size",
        "16",
        "--batch-size",
        "4",
        "--workers",
        "2",
        "--epochs",
        "2",
        "--max-batches",
        "1",
        "--no-shuffle",
        "--prefetch",
        "1",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["samples"], 8, "{v}");
    assert_eq!(v["shuffle"], false);
    assert_eq!(v["prefetch"], 1);
    assert_eq!(v["batch_parts"], 1, "batches of 3 KiB are made whole");
    assert_eq!(v["mode"], "images");
}

#[test]
fn a_folder_of_images_is_pointed_to_images_and_encoded_fields_to_fields() {
    let dir = tempfile::tempdir().unwrap();
    let images = dir.path().join("images");
    image_folder(&images, false);
    let o = bench(&[s(&images)]);
    refused(&o, &["--images", s(&images)]);
    // A packed file of images read as records: its encoded field cannot be batched as it is.
    let packed = dir.path().join("images.gfd");
    let o = gpufeed(&[
        "pack",
        "--from",
        "imagefolder",
        s(&images),
        "-o",
        s(&packed),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = bench(&[s(&packed), "--epochs", "1"]);
    let e = refused(&o, &["--images", "--fields"]);
    assert!(!e.contains("CopyFields"), "{e}");
    // Its tensor fields can be.
    let o = bench(&[
        s(&packed),
        "--epochs",
        "1",
        "--fields",
        "label,size",
        "--batch-size",
        "4",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["sample_bytes"], 8 + 8);
    // Named in --fields, the encoded field is batched as its bytes (a ragged field).
    let o = bench(&[
        s(&packed),
        "--epochs",
        "1",
        "--fields",
        "image,label",
        "--batch-size",
        "4",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["ragged"]["fields"], serde_json::json!(["image"]));
    assert!(
        v["ragged"]["value_bytes_per_batch"].as_f64().unwrap() > 0.0,
        "{v}"
    );
}

#[test]
fn image_field_and_skip_bad_images_are_the_command_s_choices() {
    let dir = tempfile::tempdir().unwrap();
    let images = dir.path().join("images");
    image_folder(&images, true);
    // A bad image fails the run, and the message offers the flag that skips it.
    let o = bench(&[
        "--images",
        s(&images),
        "--image-size",
        "16",
        "--batch-size",
        "4",
        "--epochs",
        "1",
    ]);
    let e = refused(&o, &["0003.jpg", "--skip-bad-images"]);
    assert!(!e.contains("OnBadImage"), "{e}");
    let o = bench(&[
        "--images",
        s(&images),
        "--image-size",
        "16",
        "--batch-size",
        "4",
        "--epochs",
        "1",
        "--skip-bad-images",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["skipped"], 1);
    // An image over the pixel limit: the flag that raises it, not the library's method.
    let o = bench(&[
        "--images",
        s(&images),
        "--image-size",
        "16",
        "--batch-size",
        "4",
        "--epochs",
        "1",
        "--max-pixels",
        "10",
    ]);
    let e = refused(
        &o,
        &["max_pixels limit of 10", "raise it with --max-pixels N"],
    );
    assert!(!e.contains("ImageTransformBuilder"), "{e}");
    let o = bench(&["--max-pixels", "10"]);
    refused(&o, &["--max-pixels", "--images"]);

    // A packed file whose images are in two JPEG fields, `photo` and `thumb`, without labels:
    // neither is `image`, and there is not one JPEG field to take for it (with one, as a
    // WebDataset's `jpg`, the bench takes it: default_image_fields).
    let packed = dir.path().join("photos.gfd");
    let schema = Schema::new(vec![
        Field::bytes("photo", Codec::Jpeg),
        Field::bytes("thumb", Codec::Jpeg),
    ])
    .unwrap();
    let mut w = RecordWriter::create(&packed, schema).unwrap();
    let jpeg = std::fs::read(images.join("class_0/0000.jpg")).unwrap();
    for _ in 0..5 {
        w.append(&[&jpeg, &jpeg]).unwrap();
    }
    w.finish().unwrap();
    let o = bench(&[
        "--images",
        s(&packed),
        "--image-size",
        "16",
        "--batch-size",
        "2",
        "--epochs",
        "1",
    ]);
    let e = refused(&o, &["--image-field"]);
    assert!(!e.contains("image_field()"), "{e}");
    let o = bench(&[
        "--images",
        s(&packed),
        "--image-field",
        "photo",
        "--image-size",
        "16",
        "--batch-size",
        "2",
        "--epochs",
        "1",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["samples"], 5);
}

#[test]
fn the_report_has_one_unit_a_comparison_and_internals_only_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = cmd(&["bench", "--epochs", "2"]);
    c.args(SMALL).env("TMPDIR", dir.path());
    let o = output_with_limit(c, Duration::from_secs(120));
    assert!(o.status.success(), "{}", stderr(&o));
    // No progress bar off a terminal: a line says what the wait is for.
    assert!(
        stderr(&o).contains("writing the default data set (300 records of 1024 bytes"),
        "{}",
        stderr(&o)
    );
    let text = stdout(&o);
    assert!(
        !text.contains(s(dir.path())),
        "a removed temporary path shown:\n{text}"
    );
    assert!(text.contains("generated"), "{text}");
    assert!(
        text.contains("compared:") && text.contains("memcpy gather"),
        "{text}"
    );
    // Decimal bytes per second (MB/s for these small runs), nothing else.
    assert!(text.contains("B/s"), "{text}");
    for other_unit in ["samples/s", "KiB/s", "MiB/s", "GiB/s", "images/s"] {
        assert!(!text.contains(other_unit), "{other_unit} in:\n{text}");
    }
    for internal in ["reuses", "ready out of order"] {
        assert!(
            !text.contains(internal),
            "{internal} without --verbose:\n{text}"
        );
    }
    // The stage table: shares of one denominator, adding up to 100%.
    let shares: Vec<f64> = text
        .lines()
        .filter(|l| l.starts_with("  ") && l.trim_end().ends_with('%'))
        .map(|l| {
            let pct = l.split_whitespace().last().unwrap();
            pct.trim_end_matches('%').parse::<f64>().unwrap()
        })
        .collect();
    assert_eq!(shares.len(), 4, "{text}");
    let total: f64 = shares.iter().sum();
    assert!((total - 100.0).abs() < 0.5, "{total}: {text}");

    let mut c = cmd(&["bench", "--epochs", "1", "--verbose"]);
    c.args(SMALL).env("TMPDIR", dir.path());
    let o = output_with_limit(c, Duration::from_secs(120));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("reuses"), "{}", stdout(&o));
}

#[test]
fn json_has_the_same_keys_for_records_and_images() {
    let dir = tempfile::tempdir().unwrap();
    let images = dir.path().join("images");
    image_folder(&images, false);
    let mut c = cmd(&["bench", "--epochs", "2", "--json"]);
    c.args(SMALL).env("TMPDIR", dir.path());
    let raw = output_with_limit(c, Duration::from_secs(120));
    assert!(raw.status.success(), "{}", stderr(&raw));
    let img = bench(&[
        "--images",
        s(&images),
        "--image-size",
        "16",
        "--batch-size",
        "4",
        "--epochs",
        "2",
        "--json",
    ]);
    assert!(img.status.success(), "{}", stderr(&img));
    let keys = |o: &std::process::Output| -> Vec<String> {
        let v: Value = serde_json::from_slice(&o.stdout).unwrap();
        let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        k.sort();
        k
    };
    assert_eq!(keys(&raw), keys(&img));
    let v: Value = serde_json::from_slice(&raw.stdout).unwrap();
    assert_eq!(v["mode"], "records");
    assert_eq!(v["generated"], true);
    assert!(v["baseline_ratio"].as_f64().unwrap() > 0.0, "{v}");
    assert!(!v["dataset"].as_str().unwrap().contains(s(dir.path())));
    let v: Value = serde_json::from_slice(&img.stdout).unwrap();
    assert_eq!(v["records"], 12);
    assert_eq!(v["samples"], 24);
    assert_eq!(v["epoch_samples_per_sec"].as_array().unwrap().len(), 2);
}

#[test]
fn help_names_every_input_kind() {
    for args in [vec!["--help"], vec!["pack", "--help"]] {
        let o = gpufeed(&args);
        assert!(o.status.success());
        let text = stdout(&o);
        for kind in ["npy", "raw", "imagefolder"] {
            assert!(
                text.contains(kind),
                "{args:?} does not name {kind}:\n{text}"
            );
        }
    }
    let o = gpufeed(&["bench", "--help"]);
    for flag in [
        "--images",
        "--image-field",
        "--fields",
        "--skip-bad-images",
        "--verbose",
    ] {
        assert!(
            stdout(&o).contains(flag),
            "{flag} missing from bench --help"
        );
    }
}

#[test]
fn raw_records_still_bench_with_a_dtype_of_their_own() {
    // A .npy of f32 rows: records runs read any tensor dtype.
    let dir = tempfile::tempdir().unwrap();
    let a = write_npy(&dir.path().join("a.npy"), DType::F32, &[40, 3], &[0; 480]);
    let o = bench(&[s(&a), "--epochs", "1", "--batch-size", "8", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["samples"], 40);
    assert_eq!(v["sample_bytes"], 12);
    assert_eq!(v["generated"], false);
}

#[test]
fn fifos_and_devices_are_refused_not_read_forever() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    let c = std::ffi::CString::new(s(&fifo)).unwrap();
    // SAFETY: mkfifo with a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    for args in [
        vec!["inspect", s(&fifo)],
        vec!["bench", s(&fifo)],
        vec!["bench", "--images", s(&fifo)],
        vec!["inspect", "/dev/zero"],
    ] {
        let o = output_with_limit(cmd(&args), Duration::from_secs(60));
        refused(&o, &["not a regular file"]);
    }
}

#[test]
fn shard_reads_one_ranks_share_and_speaks_in_flags() {
    let json = |extra: &[&str]| -> Value {
        let mut args = SMALL.to_vec();
        args.extend_from_slice(&["--epochs", "1", "--batch-size", "10", "--json"]);
        args.extend_from_slice(extra);
        let o = bench(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_str(&stdout(&o)).unwrap()
    };
    assert_eq!(json(&[])["samples"], 300);
    assert_eq!(json(&["--shard", "1/3"])["samples"], 100);
    // Evaluation over 7 ranks: 300 samples, 43 slots each (one padding slot per rank but 6).
    assert_eq!(json(&["--shard", "2/7", "--evaluation"])["samples"], 43);
    let mut args = SMALL.to_vec();
    args.extend_from_slice(&["--shard", "3/3"]);
    refused(&bench(&args), &["--shard", "rank 3"]);
    let mut args = SMALL.to_vec();
    args.extend_from_slice(&["--shard", "half"]);
    refused(&bench(&args), &["--shard", "RANK/WORLD"]);
}

#[test]
fn labels_npy_is_read_beside_a_npy_data_set() {
    let dir = tempfile::tempdir().unwrap();
    let x = write_npy(&dir.path().join("x.npy"), DType::U8, &[40, 6], &[7; 240]);
    let labels: Vec<u8> = (0..40u32).flat_map(|l| (l % 5).to_le_bytes()).collect();
    let y = write_npy(&dir.path().join("y.npy"), DType::U32, &[40], &labels);
    let o = bench(&[
        s(&x),
        "--labels",
        s(&y),
        "--epochs",
        "2",
        "--batch-size",
        "8",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["records"], 40);
    assert_eq!(v["samples"], 80);
    // 6 bytes of `data` and a 4-byte `label` per sample.
    assert_eq!(v["sample_bytes"], 10);
    let dataset = v["dataset"].as_str().unwrap();
    assert!(
        dataset.contains("x.npy") && dataset.contains("y.npy"),
        "{dataset}"
    );
    // `--fields` picks among the zipped fields.
    let o = bench(&[
        s(&x),
        "--labels",
        s(&y),
        "--fields",
        "label",
        "--epochs",
        "1",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["sample_bytes"], 4);
}

#[test]
fn labels_of_another_length_or_name_are_refused_naming_the_files() {
    let dir = tempfile::tempdir().unwrap();
    let x = write_npy(&dir.path().join("x.npy"), DType::U8, &[40, 6], &[7; 240]);
    let short = write_npy(&dir.path().join("short.npy"), DType::U32, &[39], &[0; 156]);
    let o = bench(&[s(&x), "--labels", s(&short), "--epochs", "1"]);
    refused(&o, &["short.npy", "39", "x.npy", "40"]);
    // Without a DATASET, or with --images, --labels has nothing to label.
    let o = bench(&["--labels", s(&short)]);
    refused(&o, &["--labels", "DATASET"]);
    let o = bench(&["--images", s(dir.path()), "--labels", s(&short)]);
    refused(&o, &["--labels"]);
    // A packed DATASET that has a field `label` already.
    let packed = dir.path().join("p.gfd");
    let schema = Schema::new(vec![Field::tensor("label", DType::U32, &[])]).unwrap();
    let mut w = RecordWriter::create(&packed, schema).unwrap();
    for i in 0..39u32 {
        w.append(&[&i.to_le_bytes()]).unwrap();
    }
    w.finish().unwrap();
    let o = bench(&[s(&packed), "--labels", s(&short), "--epochs", "1"]);
    refused(&o, &["`label`", "p.gfd", "short.npy"]);
}

/// A packed file of 2,048 records of 4 KiB (8 MiB).
fn packed_records(path: &Path) -> u64 {
    let schema = Schema::new(vec![Field::tensor("data", DType::U8, &[4096])]).unwrap();
    let mut w = RecordWriter::create(path, schema).unwrap();
    for i in 0..2048u32 {
        w.append(&[&[i as u8; 4096]]).unwrap();
    }
    w.finish().unwrap().file_bytes
}

#[test]
fn a_file_truncated_under_bench_with_read_mode_pread_is_an_error_not_a_signal() {
    let dir = tempfile::tempdir().unwrap();
    let packed = dir.path().join("p.gfd");
    let packed_bytes = packed_records(&packed);
    let data: Vec<u8> = (0..2048u32 * 4096).map(|i| i as u8).collect();
    let npy = write_npy(&dir.path().join("x.npy"), DType::U8, &[2048, 4096], &data);
    let npy_bytes = std::fs::metadata(&npy).unwrap().len();
    for (file, bytes, verify) in [
        (&packed, packed_bytes, false),
        (&packed, packed_bytes, true),
        (&npy, npy_bytes, false),
    ] {
        // Far more epochs than the test waits for: the run ends only on the error.
        let mut args = vec![
            "bench",
            s(file),
            "--read-mode",
            "pread",
            "--epochs",
            "1000000",
            "--batch-size",
            "16",
            "--workers",
            "2",
            "--no-baseline",
        ];
        if verify {
            args.push("--verify");
        }
        let mut child = cmd(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // The page-cache warm-up reads the file once; past twice its size, the loader reads.
        wait_for_reads(&mut child, 2 * bytes);
        std::fs::OpenOptions::new()
            .write(true)
            .open(file)
            .unwrap()
            .set_len(bytes / 2)
            .unwrap();
        let status = wait_with_limit(&mut child, Duration::from_secs(60));
        let mut e = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut e).unwrap();
        assert_eq!(status.signal(), None, "{file:?} (verify {verify}): {e}");
        assert_eq!(status.code(), Some(1), "{file:?} (verify {verify}): {e}");
        assert!(
            e.contains("gpufeed: error:") && e.contains(s(file)) && e.contains("changed"),
            "{file:?} (verify {verify}): {e}"
        );
        // Whole again for the next case.
        if file == &packed {
            packed_records(&packed);
        }
    }
}

#[test]
fn the_subcommands_the_docs_name_exist() {
    let o = gpufeed(&["--help"]);
    let help = stdout(&o);
    let commands: Vec<&str> = help
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(commands.contains(&"bench"), "{help}");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    for doc in ["README.md", "Cargo.toml"] {
        let text = std::fs::read_to_string(root.join(doc)).unwrap();
        let mut named = Vec::new();
        // "the `gpufeed` command (`pack`, `inspect`, ...; more words)"
        for (at, _) in text.match_indices("`gpufeed` command (") {
            let list = &text[at + "`gpufeed` command (".len()..];
            let list = &list[..list.find([')', ';']).unwrap()];
            named.extend(
                list.split(',')
                    .map(|n| n.trim().trim_matches('`').to_owned()),
            );
        }
        // "`gpufeed pack ...`"
        for (at, _) in text.match_indices("`gpufeed ") {
            let word: String = text[at + "`gpufeed ".len()..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase())
                .collect();
            if !word.is_empty() {
                named.push(word);
            }
        }
        assert!(!named.is_empty(), "{doc} names no subcommand");
        for name in named {
            assert!(
                commands.contains(&name.as_str()),
                "{doc} names `gpufeed {name}`, which is not among {commands:?}"
            );
        }
    }
}

#[test]
fn a_batch_larger_than_the_data_set_takes_the_data_set_s_memory() {
    let dir = tempfile::tempdir().unwrap();
    let run = |extra: &[&str]| {
        let mut c = cmd(&["bench", "--records", "1024", "--record-bytes", "1024"]);
        c.args(["--epochs", "2", "--workers", "2", "--json"])
            .args(extra)
            .env("TMPDIR", dir.path());
        output_with_limit(c, Duration::from_secs(120))
    };
    let o = run(&["--batch-size", "100000"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["samples"], 2048);
    assert_eq!(v["batch_size"], 100_000);
    // A batch of the 1,024 samples there are (1,028 bytes each): a pool of a few MiB, not of
    // batches of 100,000 samples (100 MB each).
    let peak = v["pool_peak_bytes"].as_u64().unwrap();
    assert!(peak <= 8 << 20, "{peak} bytes: {v}");
    // With --drop-last no batch would be delivered: refused, saying so.
    let o = run(&["--batch-size", "100000", "--drop-last"]);
    let e = refused(&o, &["--drop-last", "1024 samples", "no batch"]);
    assert!(!e.contains("memory"), "{e}");
}

#[test]
fn small_runs_report_figures_that_say_something_in_one_unit_and_plain_words() {
    let dir = tempfile::tempdir().unwrap();
    // 300 records of 1 KiB, one epoch, one part: rates far below 1 GB/s.
    let mut c = cmd(&[
        "bench",
        "--epochs",
        "1",
        "--batch-parts",
        "1",
        "--workers",
        "1",
    ]);
    c.args(SMALL).env("TMPDIR", dir.path());
    let o = output_with_limit(c, Duration::from_secs(120));
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    for wrong in ["0.00 GB/s", " 0% of it", "1 parts", "1 epochs", "1 workers"] {
        assert!(!text.contains(wrong), "`{wrong}` in:\n{text}");
    }
    for right in ["1 part,", "1 epoch,", "1 worker,"] {
        assert!(text.contains(right), "`{right}` missing from:\n{text}");
    }
    // Every rate in decimal units, with three significant digits.
    let rates: Vec<&str> = text
        .split_whitespace()
        .collect::<Vec<_>>()
        .windows(2)
        .filter(|w| w[1].trim_end_matches([',', ';', ')']).ends_with("B/s"))
        .map(|w| w[0])
        .collect();
    assert!(rates.len() >= 2, "{text}");
    for r in rates {
        let digits = r.trim_start_matches(['0', '.']).replace('.', "");
        assert!(digits.len() >= 3 || !r.contains('.'), "`{r}` in:\n{text}");
        assert!(r.parse::<f64>().is_ok_and(|v| v > 0.0), "`{r}` in:\n{text}");
    }
    for binary in ["KiB/s", "MiB/s", "GiB/s"] {
        assert!(!text.contains(binary), "{binary} in:\n{text}");
    }
    // The loader's own figures (--verbose) speak of rates in the same units.
    let mut c = cmd(&["bench", "--epochs", "1", "--verbose"]);
    c.args(SMALL).env("TMPDIR", dir.path());
    let o = output_with_limit(c, Duration::from_secs(120));
    assert!(o.status.success(), "{}", stderr(&o));
    for binary in ["KiB/s", "MiB/s", "GiB/s"] {
        assert!(!stdout(&o).contains(binary), "{binary} in:\n{}", stdout(&o));
    }
}

#[test]
fn the_baseline_gathers_the_fields_the_loader_batches() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = cmd(&["bench", "--epochs", "1", "--fields", "label"]);
    c.args(SMALL).env("TMPDIR", dir.path());
    let o = output_with_limit(c, Duration::from_secs(120));
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("memcpy gather"), "{text}");
    assert!(!text.contains("every field"), "{text}");
    assert!(text.contains("of the same fields"), "{text}");
}

#[test]
fn ctrl_c_during_bench_prints_what_ran_marked_interrupted_then_exits_130() {
    for json in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        // Far more epochs than the test waits for; pread, so that the loader's reads show.
        let mut c = cmd(&[
            "bench",
            "--records",
            "2000",
            "--record-bytes",
            "4096",
            "--epochs",
            "1000000",
            "--read-mode",
            "pread",
        ]);
        if json {
            c.arg("--json");
        }
        let mut child = default_signals(&mut c)
            .env("TMPDIR", dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Written, read once to warm the page cache, then read by the loader.
        wait_for_reads(&mut child, 3 * 2000 * 4100);
        signal(&child, libc::SIGINT);
        let status = wait_with_limit(&mut child, Duration::from_secs(60));
        let mut out = String::new();
        std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut out).unwrap();
        let mut err = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
        assert!(
            status.signal() == Some(libc::SIGINT) || status.code() == Some(130),
            "{status}: {err}"
        );
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "the data set was left behind"
        );
        if json {
            let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
            assert_eq!(v["interrupted"], true, "{v}");
            assert!(v["samples"].as_u64().unwrap() > 0, "{v}");
            let epochs = v["epochs"].as_u64().unwrap();
            assert!((1..1_000_000).contains(&epochs), "{v}");
            assert_eq!(
                v["epoch_bytes_per_sec"].as_array().unwrap().len() as u64,
                epochs
            );
            assert!(v["baseline_bytes_per_sec"].is_null(), "{v}");
        } else {
            assert!(out.contains("interrupted"), "{out}");
            assert!(out.contains("throughput:"), "{out}");
            assert!(!out.contains("compared:"), "{out}");
        }
    }
}

/// A packed file of 200 records: `text`, raw bytes of `i % 50` bytes each, and `id`, a u32.
/// Returns it and its texts' bytes in all.
fn packed_texts(path: &Path) -> u64 {
    let schema = Schema::new(vec![
        Field::bytes("text", Codec::Raw),
        Field::tensor("id", DType::U32, &[]),
    ])
    .unwrap();
    let mut w = RecordWriter::create(path, schema).unwrap();
    let mut total = 0;
    for i in 0..200u32 {
        let text = vec![i as u8; (i % 50) as usize];
        total += text.len() as u64;
        w.append(&[&text, &i.to_le_bytes()]).unwrap();
    }
    w.finish().unwrap();
    total
}

#[test]
fn a_bytes_field_benches_as_values_plus_offsets_within_its_budget() {
    let dir = tempfile::tempdir().unwrap();
    let packed = dir.path().join("texts.gfd");
    let texts = packed_texts(&packed);
    let run = |extra: &[&str]| {
        let mut args = vec![s(&packed), "--epochs", "1", "--batch-size", "20"];
        args.extend_from_slice(extra);
        bench(&args)
    };
    let o = run(&["--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["samples"], 200);
    assert_eq!(v["ragged"]["fields"], serde_json::json!(["text"]));
    // Every batch's values, on average: the texts' bytes over 10 batches.
    assert_eq!(v["ragged"]["values_per_batch"], texts as f64 / 10.0);
    assert_eq!(v["ragged"]["value_bytes_per_batch"], texts as f64 / 10.0);
    assert!(v["ragged"]["budget_bytes"][0].as_u64().unwrap() >= 49 * 20);
    let o = run(&["--ragged-budget", "1000"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("ragged fields: text"), "{}", stdout(&o));
    // A budget under the batches' values: an error naming the flag, not a cut batch.
    let o = run(&["--ragged-budget", "100", "--no-shuffle"]);
    let e = refused(&o, &["--ragged-budget", "`text`"]);
    assert!(!e.contains("ragged_budget"), "{e}");
    // Only the fixed field: the flag does not apply, and no ragged report.
    let o = run(&["--fields", "id", "--ragged-budget", "100"]);
    refused(&o, &["--ragged-budget"]);
    let o = run(&["--fields", "id", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["ragged"].is_null(), "{v}");
}

#[test]
fn bench_runs_the_token_loader_over_a_blend_and_reports_shares_and_padding() {
    let fixtures =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tokens");
    let u16 = fixtures.join("megatron_u16");
    let train = format!("{}=1", fixtures.join("train.bin").display());
    // One source, concatenated, rows of 16 in global batches of 8 over 2 epochs, with these
    // settings: every token of each epoch once.
    let concatenated = |settings: &[&str]| -> Value {
        let mut a = vec!["bench", "--json", "--tokens", s(&u16)];
        a.extend(["--seq-len", "16", "--batch-size", "8", "--epochs", "2"]);
        a.extend(settings);
        let o = gpufeed(&a);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let v = concatenated(&["--workers", "2"]);
    assert_eq!(v["kind"], "tokens");
    assert_eq!(v["mode"], "concatenated");
    assert_eq!(v["tokens"], 2 * 3964, "{v}");
    assert!(v["first_batch_ms"].as_f64().unwrap() > 0.0, "{v}");
    assert!(
        v["cpu_seconds_per_million_tokens"].as_f64().unwrap() > 0.0,
        "{v}"
    );
    assert!(v["device"].is_null(), "{v}");
    // A blend 3 : 1 of it and nanoGPT's train.bin, packed.
    let weighted = format!("{}=3", u16.display());
    let o = gpufeed(&[
        "bench",
        "--json",
        "--tokens",
        &weighted,
        "--tokens",
        &train,
        "--token-dtype",
        "u16",
        "--token-mode",
        "packed",
        "--seq-len",
        "64",
        "--batch-size",
        "4",
        "--epochs",
        "1",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["mode"], "packed");
    let sources = v["sources"].as_array().unwrap();
    assert_eq!(sources.len(), 2);
    assert_eq!(sources[0]["weight"], 0.75);
    let share = sources[0]["share"].as_f64().unwrap();
    assert!((share - 0.75).abs() < 0.02, "{v}");
    assert!(v["padding_fraction"].as_f64().unwrap() > 0.0, "{v}");
    // Flags of other runs are refused, naming the flag.
    let o = gpufeed(&["bench", "--tokens", s(&u16), "--verify"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--verify"), "{}", stderr(&o));
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.json");
    let o = gpufeed(&["bench", "--tokens", s(&u16), "--trace", s(&trace)]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--trace"), "{}", stderr(&o));
    assert!(!trace.exists());
    // Settings chosen by the loader: the same tokens, and what was chosen and why.
    let v = concatenated(&["--workers", "auto", "--prefetch", "auto"]);
    assert_eq!(v["tokens"], 2 * 3964, "{v}");
    let reason = v["tuning"]["reason"].as_str().unwrap();
    assert!(reason.starts_with("autotune: "), "{v}");
    assert_eq!(v["workers"], v["tuning"]["workers"], "{v}");
    let o = gpufeed(&["bench", "--tokens", s(&u16), "--workers", "many"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--workers"), "{}", stderr(&o));
    let o = gpufeed(&["bench", "--seq-len", "8", "--no-baseline"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--tokens"), "{}", stderr(&o));
    let o = gpufeed(&["bench", "--tokens", s(&fixtures.join("train.bin"))]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--token-dtype"), "{}", stderr(&o));
    let o = gpufeed(&[
        "bench",
        "--tokens",
        s(&fixtures.join("train.bin")),
        "--token-dtype",
        "f7",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--token-dtype"), "{}", stderr(&o));
    // The command as built here has no `cuda` feature: --device says so, and runs nothing.
    let o = gpufeed(&["bench", "--tokens", s(&u16), "--device", "0"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--device"), "{}", stderr(&o));
}

#[test]
fn trace_plot_and_auto_workers_write_their_files_and_say_what_was_chosen() {
    let dir = tempfile::tempdir().unwrap();
    let (trace, plot) = (dir.path().join("run.json"), dir.path().join("run.svg"));
    let mut c = cmd(&[
        "bench",
        "--epochs",
        "3",
        "--workers",
        "auto",
        "--prefetch",
        "auto",
        "--trace",
        s(&trace),
        "--plot",
        s(&plot),
    ]);
    c.args(SMALL).env("TMPDIR", dir.path());
    let o = output_with_limit(c, Duration::from_secs(120));
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    // The last line is the verdict; the settings line says what autotune chose.
    let last = text.lines().last().unwrap();
    assert!(last.starts_with("verdict: waited "), "{text}");
    assert!(last.contains("-bound: "), "{text}");
    assert!(text.contains("settings: autotune: "), "{text}");
    assert!(
        text.contains(&format!("trace: {}", trace.display())),
        "{text}"
    );
    let doc: Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    let events = doc["traceEvents"].as_array().unwrap();
    let threads: Vec<&str> = events
        .iter()
        .filter(|e| e["name"] == "thread_name")
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    assert!(
        threads.contains(&"consumer") && threads.contains(&"worker 0"),
        "{threads:?}"
    );
    assert!(
        events
            .iter()
            .any(|e| e["name"] == "fetch" && e["ph"] == "X")
    );
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains(">epoch 2<"),
        "{svg}"
    );
    assert!(svg.contains("plain "), "the baseline is drawn: {svg}");
    // Nothing else left beside them (no temporaries, the data set removed).
    let mut left: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["run.json", "run.svg"]);
    // JSON: the same, as keys.
    let mut c = cmd(&["bench", "--epochs", "2", "--workers", "auto", "--json"]);
    c.args(SMALL).env("TMPDIR", dir.path());
    let o = output_with_limit(c, Duration::from_secs(120));
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["verdict"].as_str().unwrap().starts_with("waited "), "{v}");
    let tuning = &v["tuning"];
    assert!(
        tuning["reason"].as_str().unwrap().starts_with("autotune: "),
        "{v}"
    );
    assert_eq!(v["workers"], tuning["workers"], "{v}");
}

#[test]
fn trace_and_plot_refuse_to_write_over_what_they_should_not() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("d.gfd");
    let raw = dir.path().join("r.bin");
    std::fs::write(&raw, [1u8; 640]).unwrap();
    let o = gpufeed(&[
        "pack",
        "--from",
        "raw",
        s(&raw),
        "--record-bytes",
        "64",
        "-o",
        s(&data),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let before = std::fs::read(&data).unwrap();
    // The data set itself, through a link too.
    let link = dir.path().join("link.json");
    std::os::unix::fs::symlink(&data, &link).unwrap();
    for out in [&data, &link] {
        let o = bench(&[s(&data), "--epochs", "1", "--trace", s(out)]);
        refused(&o, &["--trace", "the data set"]);
    }
    // A directory, a plot that is not an SVG, a directory that does not exist, both flags on
    // one file.
    let o = bench(&[s(&data), "--epochs", "1", "--trace", s(dir.path())]);
    refused(&o, &["--trace", "not a regular file"]);
    let png = dir.path().join("p.png");
    let o = bench(&[s(&data), "--epochs", "1", "--plot", s(&png)]);
    refused(&o, &["--plot", ".svg", "rsvg-convert"]);
    let nowhere = dir.path().join("no/such/dir/t.json");
    let o = bench(&[s(&data), "--epochs", "1", "--trace", s(&nowhere)]);
    refused(&o, &["--trace", "does not exist"]);
    let same = dir.path().join("x.svg");
    let o = bench(&[
        s(&data),
        "--epochs",
        "1",
        "--trace",
        s(&same),
        "--plot",
        s(&same),
    ]);
    refused(&o, &["--plot", "--trace"]);
    // A value that is neither a count nor `auto`: clap's usage error (exit status 2).
    let o = bench(&[s(&data), "--epochs", "1", "--workers", "many"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("--workers") && stderr(&o).contains("auto"),
        "{}",
        stderr(&o)
    );
    assert_eq!(
        std::fs::read(&data).unwrap(),
        before,
        "the data set is untouched"
    );
}
