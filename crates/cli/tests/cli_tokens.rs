//! The command over token files (`bench --tokens`, `inspect` of Megatron and flat token files):
//! `--read-mode pread` honoured (a file truncated under the run is an error, exit status 1,
//! never SIGBUS), weights checked for one source as for many, broken Megatron datasets named
//! as such, and figures that were not measured not printed.

use crate::cli_common;
use crate::token_common::write_megatron;

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use cli_common::*;
use serde_json::Value;

/// The command failed with exit code 1 (no panic, no signal) and said every one of `want` and
/// none of `not`.
fn refused(o: &std::process::Output, want: &[&str], not: &[&str]) -> String {
    let e = stderr(o);
    assert_eq!(o.status.code(), Some(1), "status {:?}: {e}", o.status);
    assert!(!e.contains("panicked"), "{e}");
    for w in want {
        assert!(e.contains(w), "`{w}` missing from: {e}");
    }
    for n in not {
        assert!(!e.contains(n), "`{n}` in: {e}");
    }
    e
}

/// `tokens` u16 tokens, raw (nanoGPT's train.bin).
fn train_bin(path: &Path, tokens: u32) -> PathBuf {
    let bytes: Vec<u8> = (0..tokens).flat_map(|t| (t as u16).to_le_bytes()).collect();
    std::fs::write(path, bytes).unwrap();
    path.to_path_buf()
}

/// A Megatron dataset (uint16) of `n` documents of `len` tokens.
fn megatron(prefix: &Path, n: u32, len: u32) -> PathBuf {
    let docs: Vec<Vec<u32>> = (0..n)
        .map(|d| (0..len).map(|t| (d * 7 + t) % 50_000).collect())
        .collect();
    write_megatron(prefix, &docs, 8);
    prefix.to_path_buf()
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tokens")
}

#[test]
fn a_token_file_truncated_under_bench_with_read_mode_pread_is_an_error_not_a_signal() {
    let dir = tempfile::tempdir().unwrap();
    // 4 MiB of tokens each: a flat train.bin, and a Megatron dataset's .bin.
    let flat = train_bin(&dir.path().join("train.bin"), 2 << 20);
    let prefix = megatron(&dir.path().join("web"), 2048, 1024);
    let bin = prefix.with_extension("bin");
    for (source, file, dtype) in [(&flat, &flat, Some("u16")), (&prefix, &bin, None)] {
        let bytes = std::fs::metadata(file).unwrap().len();
        // Far more epochs than the test waits for: the run ends only on the error.
        let mut args = vec![
            "bench",
            "--tokens",
            s(source),
            "--read-mode",
            "pread",
            "--seq-len",
            "256",
            "--batch-size",
            "8",
            "--epochs",
            "1000000",
            "--workers",
            "2",
        ];
        if let Some(d) = dtype {
            args.extend(["--token-dtype", d]);
        }
        let mut child = cmd(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Past twice its size read through system calls, the loader is reading it at offsets.
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
        assert_eq!(status.signal(), None, "{file:?}: {e}");
        assert_eq!(status.code(), Some(1), "{file:?}: {e}");
        assert!(
            e.contains("gpufeed: error:") && e.contains(s(file)) && e.contains("changed"),
            "{file:?}: {e}"
        );
    }
}

#[test]
fn a_broken_megatron_dataset_is_named_as_one_with_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = megatron(&dir.path().join("web_text_document"), 4, 10);
    let (idx, bin) = (prefix.with_extension("idx"), prefix.with_extension("bin"));
    // A corrupt index: its magic overwritten.
    let mut bytes = std::fs::read(&idx).unwrap();
    bytes[..4].copy_from_slice(b"JUNK");
    std::fs::write(&idx, &bytes).unwrap();
    for path in [&idx, &prefix] {
        let o = gpufeed(&["inspect", s(path)]);
        refused(
            &o,
            &[s(&idx), "Megatron index", "MMIDIDX"],
            &["packed record"],
        );
    }
    let o = gpufeed(&["bench", "--tokens", s(&prefix), "--epochs", "1"]);
    refused(
        &o,
        &[s(&idx), "Megatron index", "MMIDIDX"],
        &["--token-dtype"],
    );
    // Its .bin missing: named, and no advice to give a dtype.
    bytes[..4].copy_from_slice(b"MMID");
    std::fs::write(&idx, &bytes).unwrap();
    std::fs::remove_file(&bin).unwrap();
    for args in [
        vec!["inspect", s(&prefix)],
        vec!["inspect", s(&idx)],
        vec!["bench", "--tokens", s(&prefix), "--epochs", "1"],
        vec!["bench", "--tokens", s(&idx), "--epochs", "1"],
    ] {
        let o = gpufeed(&args);
        refused(
            &o,
            &[s(&bin), "missing"],
            &["--token-dtype", "packed record"],
        );
    }
}

#[test]
fn weights_that_cannot_share_an_epoch_are_refused_for_one_source_as_for_many() {
    let u16 = fixtures().join("megatron_u16");
    for (weight, said) in [("nan", "NaN"), ("-1", "-1.0"), ("0", "0.0"), ("inf", "inf")] {
        let spec = format!("{}={weight}", u16.display());
        let o = gpufeed(&["bench", "--tokens", &spec, "--epochs", "1"]);
        refused(
            &o,
            &["--tokens PATH=WEIGHT", s(&u16), said],
            &["invalid setting"],
        );
    }
    // A weight too small for one sample of the epoch: said as typed, not in 300 digits.
    let train = format!("{}=1e-300", fixtures().join("train.bin").display());
    let o = gpufeed(&[
        "bench",
        "--tokens",
        s(&u16),
        "--tokens",
        &train,
        "--token-dtype",
        "u16",
        "--epochs",
        "1",
    ]);
    refused(&o, &["train.bin", "1e-300", "no sample"], &["0.000000"]);
}

#[test]
fn one_epoch_has_no_rate_after_the_first_epoch() {
    let u16 = fixtures().join("megatron_u16");
    let run = |json: bool| {
        let mut args = vec!["bench", "--tokens", s(&u16), "--seq-len", "16", "--epochs"];
        args.extend(["1", "--batch-size", "8"]);
        if json {
            args.push("--json");
        }
        let o = gpufeed(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o)
    };
    let v: Value = serde_json::from_str(&run(true)).unwrap();
    assert!(v["steady_tokens_per_s"].is_null(), "{v}");
    assert!(v["tokens_per_s"].as_f64().unwrap() > 0.0, "{v}");
    let text = run(false);
    assert!(!text.contains("after the first epoch"), "{text}");
    assert!(!text.contains("0.0 M/s"), "{text}");
}

/// JSON lines of text, and a tokenizer.json (the library's synthetic byte-level BPE).
fn text_corpus(dir: &Path, docs: usize) -> (PathBuf, PathBuf) {
    let jsonl = dir.join("corpus.jsonl");
    let lines: Vec<String> = (0..docs)
        .map(|d| {
            let text = ["the world", " мир 日本語", "hello 123", ""][d % 4].repeat(1 + d % 5);
            serde_json::json!({"text": text, "n": d}).to_string()
        })
        .collect();
    std::fs::write(&jsonl, lines.join("\n") + "\n").unwrap();
    let tokenizer = dir.join("tokenizer.json");
    let json = gpufeed::tokenizer::synthetic::byte_level(gpufeed::tokenizer::Split::Gpt2, false);
    std::fs::write(&tokenizer, json.to_string()).unwrap();
    (jsonl, tokenizer)
}

#[test]
fn bench_tokenizes_text_on_the_fly_blended_with_token_files_and_names_its_flags() {
    let dir = tempfile::tempdir().unwrap();
    let (jsonl, tok) = text_corpus(dir.path(), 300);
    let prefix = megatron(&dir.path().join("web"), 50, 40);
    let text_spec = format!("{}=3", s(&jsonl));
    let o = gpufeed(&[
        "bench",
        "--tokens",
        &text_spec,
        "--tokens",
        s(&prefix.with_extension("idx")),
        "--tokenizer",
        s(&tok),
        "--text-field",
        "text",
        "--seq-len",
        "32",
        "--batch-size",
        "8",
        "--epochs",
        "2",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let report: Value = serde_json::from_str(&stdout(&o)).unwrap();
    let sources = report["sources"].as_array().unwrap();
    assert_eq!(sources.len(), 2);
    let text = &sources[0]["text"];
    assert!(text["tokens"].as_u64().unwrap() > 0, "{report}");
    assert!(text["estimated_rows"].as_u64().unwrap() > 0, "{report}");
    assert!(sources[1].get("text").is_none());
    assert!(report["tokens"].as_u64().unwrap() > 0);
    // The text report says what was tokenized.
    let o = gpufeed(&[
        "bench",
        "--tokens",
        s(&jsonl),
        "--tokenizer",
        s(&tok),
        "--seq-len",
        "16",
        "--batch-size",
        "4",
        "--max-batches",
        "3",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("tokenized:"), "{}", stdout(&o));
    // A field that is not text, a tokenizer that is not one, a text field without a tokenizer.
    let o = gpufeed(&[
        "bench",
        "--tokens",
        s(&jsonl),
        "--tokenizer",
        s(&tok),
        "--text-field",
        "n",
    ]);
    refused(&o, &["--text-field", "`n`", "not text"], &[]);
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "[1, 2]").unwrap();
    let o = gpufeed(&["bench", "--tokens", s(&jsonl), "--tokenizer", s(&bad)]);
    refused(&o, &["--tokenizer", "bad.json"], &[]);
    let o = gpufeed(&["bench", "--tokens", s(&jsonl), "--text-field", "text"]);
    refused(&o, &["--text-field", "--tokenizer"], &[]);
}
