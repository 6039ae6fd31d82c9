//! `gpufeed tokenize`: what it writes, read back with the crate's Megatron reader and compared
//! with the `Tokenizer`'s ids under Megatron's rules (the EOS after each document that has
//! ids; a document without ids is an empty document); Parquet and JSON lines inputs; parts
//! that concatenate into the whole; and what it refuses, naming the flag.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};
use gpufeed::source::tokens::{FlatTokens, IndexedTokens, TokenSource};
use gpufeed::tokenizer::synthetic::byte_level;
use gpufeed::tokenizer::{Split, TokenizerOptions};

use crate::cli_common::{gpufeed, s, stderr, stdout};
use crate::table_common::write_parquet;

/// Documents in several scripts, an empty one, special tokens written in the text, long and
/// short, a repeated one.
pub(crate) fn documents() -> Vec<String> {
    let mut docs: Vec<String> = vec![
        "hello world".into(),
        String::new(),
        "Привет мир, the naïve über 2024!!".into(),
        "日本語のテスト です\n\n中文 ── ──".into(),
        "<|endoftext|> inside the text".into(),
        "   ".into(),
    ];
    for i in 0..300 {
        docs.push(format!(
            "document {i}: the world's tion of and {} ça",
            "hello ".repeat(i % 17)
        ));
    }
    docs
}

/// A byte-level tokenizer.json (GPT-2's split; `<|endoftext|>` is its EOS) in `dir`.
pub(crate) fn tokenizer(dir: &Path) -> PathBuf {
    let t = dir.join("tok");
    std::fs::create_dir_all(&t).unwrap();
    std::fs::write(
        t.join("tokenizer.json"),
        byte_level(Split::Gpt2, false).to_string(),
    )
    .unwrap();
    t
}

pub(crate) fn jsonl(path: &Path, docs: &[String]) {
    let lines: String = docs
        .iter()
        .enumerate()
        .map(|(i, d)| format!("{}\n", serde_json::json!({"id": i, "text": d})))
        .collect();
    std::fs::write(path, lines).unwrap();
}

/// Megatron's ids of each document: the tokenizer's, then the EOS if there is any.
pub(crate) fn expected(tok: &Path, docs: &[String]) -> Vec<Vec<u32>> {
    let t = TokenizerOptions::new().append_eos(false).open(tok).unwrap();
    let eos = t.eos().unwrap().id;
    let mut e = t.encoder();
    docs.iter()
        .map(|d| {
            let mut ids = e.encode(d).unwrap();
            if !ids.is_empty() {
                ids.push(eos);
            }
            ids
        })
        .collect()
}

/// Every document of a Megatron dataset, through the crate's reader.
pub(crate) fn read_megatron(prefix: &Path) -> Vec<Vec<u32>> {
    let m = IndexedTokens::open(prefix).unwrap();
    m.verify().unwrap();
    (0..m.documents())
        .map(|d| {
            let mut out = vec![0u32; m.document_len(d).unwrap() as usize];
            m.read(d, 0, &mut out).unwrap();
            out
        })
        .collect()
}

#[test]
fn a_megatron_dataset_holds_each_document_s_ids_and_the_eos_as_megatron_writes_them() {
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer(dir.path());
    let docs = documents();
    let input = dir.path().join("corpus.jsonl");
    jsonl(&input, &docs);
    let prefix = dir.path().join("out");
    for workers in ["1", "3"] {
        let o = gpufeed(&[
            "tokenize",
            s(&input),
            "--tokenizer",
            s(&tok),
            "-o",
            s(&prefix),
            "--workers",
            workers,
            "--force",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(
            stdout(&o).contains("tokenized 306 documents"),
            "{}",
            stdout(&o)
        );
        let want = expected(&tok, &docs);
        assert_eq!(read_megatron(&prefix), want);
        // The empty text is a document of no sequence, as Megatron's builder writes it.
        assert!(want[1].is_empty() && !want[5].is_empty());
        let m = IndexedTokens::open(&prefix).unwrap();
        assert_eq!(m.sequences(), 305);
        assert_eq!(m.dtype_code(), 8, "uint16 for a vocabulary under 65,500");
        assert_eq!(m.document_sequences(1).unwrap(), 1..1);
        // The index as megatron-core's _IndexWriter lays it out.
        let idx = std::fs::read(dir.path().join("out.idx")).unwrap();
        assert_eq!(&idx[..9], b"MMIDIDX\x00\x00");
        assert_eq!(idx[9..17], 1u64.to_le_bytes());
        assert_eq!(idx.len(), 34 + 12 * 305 + 8 * 307);
        // Nothing else in the directory: the temporaries were renamed into place.
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["corpus.jsonl", "out.bin", "out.idx", "tok"]);
    }
}

#[test]
fn parquet_inputs_concatenate_and_parts_make_the_whole_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer(dir.path());
    let docs = documents();
    let (a, b) = docs.split_at(100);
    let mut inputs = vec![];
    for (i, part) in [a, b].iter().enumerate() {
        let text: ArrayRef = Arc::new(StringArray::from_iter_values(part.iter()));
        let n: ArrayRef = Arc::new(Int64Array::from_iter_values(0..part.len() as i64));
        let batch = RecordBatch::try_from_iter([("n", n), ("body", text)]).unwrap();
        let p = dir.path().join(format!("train-{i}.parquet"));
        write_parquet(&p, &[batch], 33, 10);
        inputs.push(p);
    }
    let whole = dir.path().join("whole");
    let mut args = vec!["tokenize", s(&inputs[0]), s(&inputs[1])];
    args.extend(["--tokenizer", s(&tok), "--text-field", "body"]);
    let o = gpufeed(&[&args[..], &["-o", s(&whole), "--format", "nanogpt"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let want: Vec<u32> = expected(&tok, &docs).concat();
    let read = |p: &Path| {
        let f = FlatTokens::open(p, gpufeed::format::DType::U16).unwrap();
        let mut out = vec![0u32; f.tokens() as usize];
        f.read(0, 0, &mut out).unwrap();
        out
    };
    assert_eq!(read(&dir.path().join("whole.bin")), want);
    // Three parts, Megatron and nanoGPT: in order, the whole run's documents.
    let mut megatron_docs = vec![];
    let mut flat = vec![];
    for i in 0..3 {
        let part = format!("{i}/3");
        for (format, name) in [("megatron", "m"), ("nanogpt", "n")] {
            let prefix = dir.path().join(format!("{name}{i}"));
            let o = gpufeed(
                &[
                    &args[..],
                    &["-o", s(&prefix), "--format", format, "--part", &part],
                ]
                .concat(),
            );
            assert!(o.status.success(), "{}", stderr(&o));
            if format == "megatron" {
                megatron_docs.extend(read_megatron(&prefix));
            } else {
                flat.extend(read(&dir.path().join(format!("n{i}.bin"))));
            }
        }
    }
    assert_eq!(megatron_docs, expected(&tok, &docs));
    assert_eq!(flat, want);
}

#[test]
fn bad_input_is_refused_naming_the_flag_and_nothing_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer(dir.path());
    let input = dir.path().join("c.jsonl");
    jsonl(&input, &documents()[..3]);
    let out = dir.path().join("out");
    let run = |extra: &[&str]| {
        gpufeed(
            &[
                &["tokenize", s(&input), "--tokenizer", s(&tok), "-o", s(&out)][..],
                extra,
            ]
            .concat(),
        )
    };
    let refused = |extra: &[&str], want: &[&str]| {
        let o = run(extra);
        assert!(!o.status.success());
        let e = stderr(&o);
        for w in want {
            assert!(e.contains(w), "{extra:?}: want {w:?} in {e}");
        }
        assert!(!e.contains("panicked"), "{e}");
        assert!(!dir.path().join("out.bin").exists() && !dir.path().join("out.idx").exists());
    };
    refused(&["--text-field", "body"], &["--text-field", "`body`"]);
    refused(
        &["--text-field", "id"],
        &["--text-field", "`id`", "not text"],
    );
    refused(&["--eos-token", "<nope>"], &["--eos-token", "<nope>"]);
    refused(&["--part", "3/3"], &["--part", "3/3"]);
    refused(&["--workers", "0"], &["--workers"]);
    // A tokenizer without an EOS: --eos-token named.
    let mut json = byte_level(Split::Gpt2, false);
    json["added_tokens"]
        .as_array_mut()
        .unwrap()
        .retain(|t| t["content"] != "<|endoftext|>");
    let no_eos = dir.path().join("no-eos.json");
    std::fs::write(&no_eos, json.to_string()).unwrap();
    let o = gpufeed(&[
        "tokenize",
        s(&input),
        "--tokenizer",
        s(&no_eos),
        "-o",
        s(&out),
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--eos-token"), "{}", stderr(&o));
    // Invalid UTF-8 in a JSON string is the input's error, naming the file.
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, b"{\"text\": \"ok\"}\n{\"text\": \"a\xffb\"}\n").unwrap();
    let o = gpufeed(&["tokenize", s(&bad), "--tokenizer", s(&tok), "-o", s(&out)]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("bad.jsonl"), "{}", stderr(&o));
    assert!(!dir.path().join("out.bin").exists());
}

#[test]
fn inputs_and_existing_outputs_are_never_written_over() {
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer(dir.path());
    let input = dir.path().join("c.jsonl");
    jsonl(&input, &documents()[..3]);
    let before = std::fs::read(&input).unwrap();
    let tokenize = |o: &Path, extra: &[&str]| {
        gpufeed(
            &[
                &["tokenize", s(&input), "--tokenizer", s(&tok), "-o", s(o)][..],
                extra,
            ]
            .concat(),
        )
    };
    // The input under the output's name (nanoGPT's PREFIX.bin), directly or through a link.
    let link = dir.path().join("link.bin");
    std::os::unix::fs::symlink(&input, &link).unwrap();
    let o = tokenize(
        &dir.path().join("link"),
        &["--format", "nanogpt", "--force"],
    );
    assert!(!o.status.success());
    assert!(stderr(&o).contains("symbolic link"), "{}", stderr(&o));
    let hard = dir.path().join("hard.bin");
    std::fs::hard_link(&input, &hard).unwrap();
    let o = tokenize(
        &dir.path().join("hard"),
        &["--format", "nanogpt", "--force"],
    );
    assert!(!o.status.success());
    assert!(stderr(&o).contains("is the input"), "{}", stderr(&o));
    assert_eq!(std::fs::read(&input).unwrap(), before);
    // An existing dataset: refused without --force, replaced with it.
    let out = dir.path().join("out");
    assert!(tokenize(&out, &[]).status.success());
    let o = tokenize(&out, &[]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--force"), "{}", stderr(&o));
    assert!(tokenize(&out, &["--force"]).status.success());
    // --force replaces a Megatron index, not another file under its name.
    std::fs::write(dir.path().join("out.idx"), b"my notes").unwrap();
    let o = tokenize(&out, &["--force"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("not a Megatron index"),
        "{}",
        stderr(&o)
    );
    assert_eq!(
        std::fs::read(dir.path().join("out.idx")).unwrap(),
        b"my notes"
    );
    // A directory or a pipe under an output's name.
    std::fs::create_dir(dir.path().join("d.bin")).unwrap();
    let o = tokenize(&dir.path().join("d"), &["--force"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("a directory"), "{}", stderr(&o));
}

#[test]
fn a_signalled_tokenize_leaves_no_file() {
    use std::os::unix::process::ExitStatusExt;
    use std::time::Duration;

    use crate::cli_common::{
        cmd, default_signals, files_with, signal, wait_for_file, wait_with_limit,
    };

    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer(dir.path());
    // 48 MB of text: seconds of work on one thread, time enough to signal it midway.
    let doc = "hello world, the naïve über tion of and 日本語のテスト ".repeat(2000);
    jsonl(&dir.path().join("c.jsonl"), &vec![doc; 400]);
    for sig in [libc::SIGINT, libc::SIGTERM] {
        let out = dir.path().join("out");
        let mut c = cmd(&[
            "tokenize",
            s(&dir.path().join("c.jsonl")),
            "--tokenizer",
            s(&tok),
            "-o",
            s(&out),
            "--workers",
            "1",
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
        let left = [
            files_with(dir.path(), "tmp-"),
            files_with(dir.path(), "out"),
        ]
        .concat();
        assert!(left.is_empty(), "signal {sig} left {left:?}");
    }
}
