//! `gpufeed pack` and `gpufeed inspect`, run as the built binary.

use crate::cli_common;

use cli_common::{gpufeed, s, stderr, write_npy};
use gpufeed::format::{DType, RecordFile};
use serde_json::Value;

#[test]
fn pack_npy_with_labels_then_inspect_json() {
    let dir = tempfile::tempdir().unwrap();
    let a = write_npy(
        &dir.path().join("a.npy"),
        DType::U8,
        &[3, 2, 2],
        &(0..12).collect::<Vec<u8>>(),
    );
    let b = write_npy(
        &dir.path().join("b.npy"),
        DType::U8,
        &[2, 2, 2],
        &(12..20).collect::<Vec<u8>>(),
    );
    let labels: Vec<u8> = (0..5i32).flat_map(|i| (i * 10).to_le_bytes()).collect();
    let l = write_npy(&dir.path().join("l.npy"), DType::I32, &[5], &labels);
    let out = dir.path().join("out.gfd");
    let o = gpufeed(&[
        "pack",
        "--from",
        "npy",
        s(&a),
        s(&b),
        "-o",
        s(&out),
        "--labels",
        s(&l),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let summary = String::from_utf8(o.stdout).unwrap();
    assert_eq!(summary.lines().count(), 1, "{summary}");
    assert!(
        summary.contains("5 records") && summary.contains("B/s") && !summary.contains(" 0 "),
        "{summary}"
    );

    let f = RecordFile::open(&out).unwrap();
    assert_eq!(f.len(), 5);
    for i in 0..5u8 {
        let r = f.get(i as u64).unwrap();
        assert_eq!(
            r.field_named("data"),
            Some(&[4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3][..])
        );
        assert_eq!(
            r.field_named("label"),
            Some(&(i as i32 * 10).to_le_bytes()[..])
        );
    }

    let o = gpufeed(&["inspect", s(&out), "--json", "--verify"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["records"], 5);
    assert_eq!(v["format"], "packed");
    assert_eq!(v["verified"], true);
    assert_eq!(v["path"], s(&out));
    assert_eq!(v["file_bytes"], std::fs::metadata(&out).unwrap().len());
    let fields = v["fields"].as_array().unwrap();
    assert_eq!(fields.len(), 2);
    assert_eq!(fields[0]["name"], "data");
    assert_eq!(fields[0]["dtype"], "u8");
    assert_eq!(fields[0]["shape"], serde_json::json!([2, 2]));
    assert_eq!(fields[1]["name"], "label");
    assert_eq!(fields[1]["dtype"], "i32");
    assert_eq!(fields[1]["shape"], serde_json::json!([]));

    // The text form names the same things.
    let o = gpufeed(&["inspect", s(&out)]);
    assert!(o.status.success());
    let text = String::from_utf8(o.stdout).unwrap();
    for want in [
        "version:       1.0",
        "records:       5",
        "label",
        "i32",
        "record align",
    ] {
        assert!(text.contains(want), "{want} missing from\n{text}");
    }
}

#[test]
fn labels_of_the_wrong_length_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let a = write_npy(&dir.path().join("images.npy"), DType::U8, &[4, 3], &[0; 12]);
    let l = write_npy(&dir.path().join("labels.npy"), DType::U32, &[3], &[0; 12]);
    let out = dir.path().join("out.gfd");
    let o = gpufeed(&[
        "pack",
        "--from",
        "npy",
        s(&a),
        "-o",
        s(&out),
        "--labels",
        s(&l),
    ]);
    assert!(!o.status.success());
    let e = stderr(&o);
    for want in [s(&a), s(&l), "3 rows", "4"] {
        assert!(e.contains(want), "`{want}` missing from: {e}");
    }
    assert!(!out.exists());
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        2,
        "a temporary file was left behind"
    );
}

#[test]
fn inputs_of_different_row_shapes_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let a = write_npy(&dir.path().join("a.npy"), DType::U8, &[2, 3], &[0; 6]);
    let b = write_npy(&dir.path().join("b.npy"), DType::U8, &[2, 4], &[0; 8]);
    let o = gpufeed(&[
        "pack",
        "--from",
        "npy",
        s(&a),
        s(&b),
        "-o",
        s(&dir.path().join("o")),
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains(s(&b)), "{}", stderr(&o));
}

#[test]
fn pack_npy_rejects_a_bad_npy_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.npy");
    std::fs::write(&p, b"\x93NUMPY\x01\x00\x10\x00{'descr': '|O'}").unwrap();
    let o = gpufeed(&[
        "pack",
        "--from",
        "npy",
        s(&p),
        "-o",
        s(&dir.path().join("o")),
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains(s(&p)), "{}", stderr(&o));
}

#[test]
fn pack_raw_concatenates_files() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.bin");
    let b = dir.path().join("b.bin");
    std::fs::write(&a, (0..30).collect::<Vec<u8>>()).unwrap();
    std::fs::write(&b, (30..40).collect::<Vec<u8>>()).unwrap();
    let out = dir.path().join("raw.gfd");
    let o = gpufeed(&[
        "pack",
        "--from",
        "raw",
        s(&a),
        s(&b),
        "--record-bytes",
        "10",
        "-o",
        s(&out),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let f = RecordFile::open(&out).unwrap();
    assert_eq!(f.len(), 4);
    assert_eq!(
        f.get(3).unwrap().field_named("data"),
        Some(&(30..40).collect::<Vec<u8>>()[..])
    );
    let o = gpufeed(&["inspect", "--json", s(&out)]);
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["records"], 4);
    assert_eq!(v["fields"][0]["dtype"], "u8");
    assert_eq!(v["fields"][0]["shape"], serde_json::json!([10]));
    assert!(v.get("verified").is_none());
}

#[test]
fn pack_raw_refuses_a_partial_record() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("odd.bin");
    std::fs::write(&a, [0u8; 25]).unwrap();
    let out = dir.path().join("raw.gfd");
    let o = gpufeed(&[
        "pack",
        "--from",
        "raw",
        s(&a),
        "--record-bytes",
        "10",
        "-o",
        s(&out),
    ]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains(s(&a)) && e.contains("25 bytes"), "{e}");
    let o = gpufeed(&["pack", "--from", "raw", s(&a), "-o", s(&out)]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--record-bytes"), "{}", stderr(&o));
    assert!(!out.exists());
}

#[test]
fn pack_raw_names_the_field_flag_for_a_field_name_a_schema_cannot_hold() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.bin");
    std::fs::write(&a, [0u8; 20]).unwrap();
    let out = dir.path().join("raw.gfd");
    let o = gpufeed(&[
        "pack",
        "--from",
        "raw",
        s(&a),
        "--record-bytes",
        "10",
        "--field",
        "",
        "-o",
        s(&out),
    ]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("--field") && e.contains("empty"), "{e}");
    assert!(!out.exists());
}

#[test]
fn inspect_npy_json() {
    let dir = tempfile::tempdir().unwrap();
    let a = write_npy(&dir.path().join("a.npy"), DType::F32, &[7, 3], &[0; 84]);
    let o = gpufeed(&["inspect", "--json", "--verify", s(&a)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["format"], "npy");
    assert_eq!(v["records"], 7);
    assert_eq!(v["fields"][0]["name"], "data");
    assert_eq!(v["fields"][0]["dtype"], "f32");
    assert_eq!(v["fields"][0]["shape"], serde_json::json!([3]));
    assert_eq!(v["verified"], true);
}

#[test]
fn inspect_verify_reports_the_first_fault() {
    let dir = tempfile::tempdir().unwrap();
    let raw = dir.path().join("r.bin");
    std::fs::write(&raw, vec![5u8; 640]).unwrap();
    let out = dir.path().join("r.gfd");
    assert!(
        gpufeed(&[
            "pack",
            "--from",
            "raw",
            s(&raw),
            "--record-bytes",
            "64",
            "-o",
            s(&out)
        ])
        .status
        .success()
    );
    let mut b = std::fs::read(&out).unwrap();
    // Record 6 of 64 bytes starts at 64 + 6 * 64.
    b[64 + 6 * 64 + 3] ^= 1;
    std::fs::write(&out, b).unwrap();
    assert!(gpufeed(&["inspect", s(&out)]).status.success());
    let o = gpufeed(&["inspect", "--verify", s(&out)]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains(s(&out)) && e.contains("record 6") && e.contains("checksum"),
        "{e}"
    );
    let o = gpufeed(&["inspect", "--verify", "--json", s(&out)]);
    assert!(!o.status.success());
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["verified"], false);
    assert!(v["error"].as_str().unwrap().contains("record 6"));
}

#[test]
fn inspect_refuses_malformed_files_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    for (name, bytes) in [("empty", &b""[..]), ("junk", &b"0123456789abcdef"[..])] {
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        let o = gpufeed(&["inspect", s(&p)]);
        assert!(!o.status.success());
        assert!(stderr(&o).contains(s(&p)), "{}", stderr(&o));
    }
}

/// A 128-byte `.npy` of zero-byte rows and a huge first axis made `pack` loop
/// until it ran out of memory and `bench` spin forever. Both refuse it at open, naming it.
#[test]
fn pack_and_bench_refuse_zero_byte_rows() {
    let dir = tempfile::tempdir().unwrap();
    let mut b = gpufeed::source::npy_header(DType::U8, &[u64::MAX, 0]).unwrap();
    b.resize(128, b' ');
    let p = dir.path().join("empty_rows.npy");
    std::fs::write(&p, &b).unwrap();
    let out = dir.path().join("out.gfd");
    for args in [
        &["pack", "--from", "npy", s(&p), "-o", s(&out)][..],
        &["bench", s(&p), "--epochs", "1", "--json"][..],
    ] {
        let o = gpufeed(args);
        assert!(!o.status.success(), "{args:?}");
        let e = stderr(&o);
        assert!(
            e.contains("empty_rows.npy") && e.contains("no bytes"),
            "{e}"
        );
    }
    assert!(!out.exists());
}

/// `bench --verify` checks every record as it reads it; a `.npy` array, which has no
/// checksums, takes them at open (it was refused once).
#[test]
fn bench_verify_reads_packed_files_and_npy_arrays() {
    let dir = tempfile::tempdir().unwrap();
    let o = gpufeed(&[
        "bench",
        "--records",
        "64",
        "--record-bytes",
        "1024",
        "--batch-size",
        "16",
        "--epochs",
        "2",
        "--verify",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["records"], 64);
    let a = write_npy(&dir.path().join("a.npy"), DType::U8, &[4, 2], &[0; 8]);
    let o = gpufeed(&["bench", s(&a), "--verify", "--batch-size", "2", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["records"], 4);
}

#[test]
fn inspect_reads_in_either_read_mode_and_shards_refuse_it() {
    let dir = tempfile::tempdir().unwrap();
    let a = write_npy(&dir.path().join("a.npy"), DType::U8, &[64, 8], &[3; 512]);
    let packed = dir.path().join("a.gfd");
    let o = gpufeed(&["pack", "--from", "npy", s(&a), "-o", s(&packed)]);
    assert!(o.status.success(), "{}", stderr(&o));
    for file in [&a, &packed] {
        for mode in ["pread", "mmap"] {
            let o = gpufeed(&[
                "inspect",
                "--verify",
                "--json",
                "--read-mode",
                mode,
                s(file),
            ]);
            assert!(o.status.success(), "{file:?} {mode}: {}", stderr(&o));
            let v: Value = serde_json::from_slice(&o.stdout).unwrap();
            assert_eq!((&v["records"], &v["verified"]), (&64.into(), &true.into()));
        }
    }
    let shards = dir.path().join("shards");
    let o = gpufeed(&[
        "pack",
        "--from",
        "npy",
        s(&a),
        "--shard-size",
        "4KiB",
        "-o",
        s(&shards),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    for args in [
        vec!["inspect", "--read-mode", "pread", s(&shards)],
        vec!["bench", "--read-mode", "pread", s(&shards)],
    ] {
        let o = gpufeed(&args);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains("--read-mode"), "{}", stderr(&o));
    }
}

#[test]
fn inspect_reads_an_image_folder_and_says_what_it_reads_otherwise() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("images");
    crate::image_common::jpeg_folder(&root, 2, 3, 40, 30);
    let o = gpufeed(&["inspect", "--json", "--verify", s(&root)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["format"], "imagefolder");
    assert_eq!(v["records"], 6);
    assert_eq!(v["classes"], serde_json::json!(["class_0", "class_1"]));
    assert_eq!(v["fields"][0]["name"], "image");
    assert_eq!(v["verified"], true);
    let o = gpufeed(&["inspect", s(&root)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = cli_common::stdout(&o);
    assert!(
        text.contains("2 classes") && text.contains("records:       6"),
        "{text}"
    );
    // --verify reads every image's header, and names the first bad one.
    let bad = root.join("class_1/0001.jpg");
    std::fs::write(&bad, b"not a jpeg").unwrap();
    let o = gpufeed(&["inspect", "--verify", s(&root)]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("0001.jpg"), "{}", stderr(&o));
    // A directory that is none of what inspect reads: the message lists what it reads.
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let o = gpufeed(&["inspect", s(&empty)]);
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{e}");
    for what in [
        "packed record file",
        ".npy",
        "index.json",
        "MDS",
        "WebDataset",
        "ImageFolder",
    ] {
        assert!(e.contains(what), "`{what}` missing from: {e}");
    }
}

#[test]
fn pack_reports_the_input_s_size_and_the_output_s() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("images");
    crate::image_common::jpeg_folder(&root, 2, 3, 40, 30);
    let mut input = 0;
    for class in std::fs::read_dir(&root).unwrap() {
        for f in std::fs::read_dir(class.unwrap().path()).unwrap() {
            input += f.unwrap().metadata().unwrap().len();
        }
    }
    let out = dir.path().join("images.gfd");
    let o = gpufeed(&["pack", "--from", "imagefolder", s(&root), "-o", s(&out)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let written = std::fs::metadata(&out).unwrap().len();
    assert_ne!(input, written);
    let text = cli_common::stdout(&o);
    assert!(
        text.contains(&format!(
            "({input} bytes of input, {written} bytes written)"
        )),
        "input {input}, written {written}: {text}"
    );
}

#[test]
fn inspect_reads_megatron_datasets_and_flat_token_files() {
    let fixtures =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tokens");
    // megatron-core's builder wrote it: 40 one-sequence documents, one of three, one empty.
    for name in ["megatron_u16.idx", "megatron_u16.bin", "megatron_u16"] {
        let o = gpufeed(&["inspect", "--json", "--verify", s(&fixtures.join(name))]);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        let v: Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["format"], "megatron", "{name}");
        assert_eq!(v["dtype"], "u16");
        assert_eq!(v["dtype_code"], 8);
        assert_eq!(v["sequences"], 43);
        assert_eq!(v["documents"], 42);
        assert_eq!(v["verified"], true);
        assert_eq!(v["tokens"], v["data_tokens"]);
    }
    // A corrupt entry is the command's error, naming the file.
    let dir = tempfile::tempdir().unwrap();
    let mut idx = std::fs::read(fixtures.join("megatron_u16.idx")).unwrap();
    std::fs::copy(fixtures.join("megatron_u16.bin"), dir.path().join("m.bin")).unwrap();
    idx[34..38].copy_from_slice(&(-5i32).to_le_bytes());
    std::fs::write(dir.path().join("m.idx"), &idx).unwrap();
    let o = gpufeed(&["inspect", "--verify", s(&dir.path().join("m.idx"))]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("m.idx"), "{}", stderr(&o));
    let o = gpufeed(&[
        "inspect",
        "--json",
        "--token-dtype",
        "u16",
        s(&fixtures.join("train.bin")),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["format"], "flat_tokens");
    assert_eq!(v["tokens"], 3000);
    let o = gpufeed(&[
        "inspect",
        "--token-dtype",
        "f9",
        s(&fixtures.join("train.bin")),
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--token-dtype"), "{}", stderr(&o));
}
