//! `gpufeed merge`: the parts `tokenize --part I/N` writes, merged in order, are the single
//! run's files byte for byte (Megatron and nanoGPT); documents of several sequences keep them;
//! and what it refuses (a missing part, mismatched dtypes, parts it cannot join, an input or
//! an existing file as the output, no parts), writing nothing.

use std::path::{Path, PathBuf};

use gpufeed::source::tokens::{IndexedTokens, TokenSource};

use crate::cli_common::{gpufeed, s, stderr, stdout};
use crate::cli_tokenize::{documents, jsonl, read_megatron, tokenizer};
use crate::token_common::write_megatron;

/// `prefix` + `ext` (`ext` with its dot).
fn with(prefix: &Path, ext: &str) -> PathBuf {
    let mut p = prefix.as_os_str().to_owned();
    p.push(ext);
    PathBuf::from(p)
}

/// Runs `gpufeed merge ARGS`, checks that it succeeded, returns its standard output.
fn merge(args: &[&str]) -> String {
    let o = gpufeed(&[&["merge"][..], args].concat());
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    stdout(&o)
}

#[test]
fn three_parts_merge_into_the_single_run_s_files_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer(dir.path());
    // Empty documents (no tokens: documents of no sequence in Megatron's index) in the second
    // and third parts, the second part's first document one of them.
    let mut docs = documents();
    docs.insert(102, String::new());
    docs.insert(250, String::new());
    assert_eq!(docs.len(), 308);
    let input = dir.path().join("corpus.jsonl");
    jsonl(&input, &docs);
    let tokenize = |prefix: &Path, format: &str, part: Option<&str>| {
        let mut args = vec!["tokenize", s(&input), "--tokenizer", s(&tok)];
        args.extend(["-o", s(prefix), "--format", format, "--workers", "2"]);
        if let Some(part) = part {
            args.extend(["--part", part]);
        }
        let o = gpufeed(&args);
        assert!(o.status.success(), "{}", stderr(&o));
    };
    for (format, exts) in [("megatron", &[".bin", ".idx"][..]), ("nanogpt", &[".bin"])] {
        let whole = dir.path().join(format!("{format}-whole"));
        tokenize(&whole, format, None);
        let parts: Vec<PathBuf> = (0..3)
            .map(|i| {
                let prefix = dir.path().join(format!("{format}-part{i}"));
                tokenize(&prefix, format, Some(&format!("{i}/3")));
                prefix
            })
            .collect();
        let merged = dir.path().join(format!("{format}-merged"));
        let out = merge(&[
            s(&parts[0]),
            s(&parts[1]),
            s(&parts[2]),
            "-o",
            s(&merged),
            "--format",
            format,
        ]);
        assert!(out.contains("merged 3 parts"), "{out}");
        for ext in exts {
            let (want, got) = (with(&whole, ext), with(&merged, ext));
            assert!(
                std::fs::read(&want).unwrap() == std::fs::read(&got).unwrap(),
                "{format}: {} differs from {}",
                got.display(),
                want.display()
            );
        }
    }
    let m = IndexedTokens::open(dir.path().join("megatron-merged")).unwrap();
    assert_eq!(m.documents(), 308);
    assert_eq!(m.document_sequences(102).unwrap(), 101..101);
    // Parts named with an extension, or a nanoGPT part by its .bin, are their prefixes.
    let named = dir.path().join("named");
    merge(&[
        s(&dir.path().join("megatron-part0.idx")),
        s(&dir.path().join("megatron-part1.bin")),
        s(&dir.path().join("megatron-part2")),
        "-o",
        s(&named),
    ]);
    assert_eq!(
        std::fs::read(with(&named, ".idx")).unwrap(),
        std::fs::read(dir.path().join("megatron-whole.idx")).unwrap()
    );
    let flat = dir.path().join("flat");
    merge(&[
        s(&dir.path().join("nanogpt-part0.bin")),
        s(&dir.path().join("nanogpt-part1")),
        s(&dir.path().join("nanogpt-part2.bin")),
        "-o",
        s(&flat),
        "--format",
        "nanogpt",
    ]);
    assert_eq!(
        std::fs::read(with(&flat, ".bin")).unwrap(),
        std::fs::read(dir.path().join("nanogpt-whole.bin")).unwrap()
    );
}

/// An index of documents of several sequences (Megatron's sentence splitting), as
/// `IndexedDatasetBuilder.add_item` and `end_document` write it; tokens 0, 1, 2, ... in
/// order, uint16.
fn write_sentences(prefix: &Path, docs: &[&[i32]]) {
    let lengths: Vec<i32> = docs.iter().flat_map(|d| d.iter().copied()).collect();
    let tokens: i32 = lengths.iter().sum();
    let mut idx = b"MMIDIDX\x00\x00".to_vec();
    idx.extend(1u64.to_le_bytes());
    idx.push(8);
    idx.extend((lengths.len() as u64).to_le_bytes());
    idx.extend((docs.len() as u64 + 1).to_le_bytes());
    idx.extend(lengths.iter().flat_map(|l| l.to_le_bytes()));
    let mut ptr = 0i64;
    for l in &lengths {
        idx.extend(ptr.to_le_bytes());
        ptr += i64::from(*l) * 2;
    }
    let mut seq = 0i64;
    idx.extend(seq.to_le_bytes());
    for d in docs {
        seq += d.len() as i64;
        idx.extend(seq.to_le_bytes());
    }
    std::fs::write(with(prefix, ".idx"), idx).unwrap();
    let bin: Vec<u8> = (0..tokens as u16).flat_map(u16::to_le_bytes).collect();
    std::fs::write(with(prefix, ".bin"), bin).unwrap();
}

#[test]
fn documents_of_several_sequences_keep_them_offset_by_the_parts_before() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    write_sentences(&a, &[&[3, 2], &[], &[4]]);
    write_sentences(&b, &[&[1], &[2, 2, 1]]);
    let out = dir.path().join("out");
    merge(&[s(&a), s(&b), "-o", s(&out)]);
    let m = IndexedTokens::open(&out).unwrap();
    assert_eq!((m.documents(), m.sequences()), (5, 7));
    let sequences: Vec<_> = (0..5).map(|d| m.document_sequences(d).unwrap()).collect();
    assert_eq!(sequences, [0..2, 2..2, 2..3, 3..4, 4..7]);
    let pointers: Vec<u64> = (0..7).map(|q| m.sequence(q).unwrap().1).collect();
    assert_eq!(pointers, [0, 6, 10, 18, 20, 24, 28]);
    let docs: Vec<Vec<u32>> = read_megatron(&out);
    let want: Vec<Vec<u32>> = vec![
        (0..5).collect(),
        vec![],
        (5..9).collect(),
        vec![0],
        (1..6).collect(),
    ];
    assert_eq!(docs, want);
}

#[test]
fn bad_parts_are_refused_naming_the_part_and_nothing_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let docs: Vec<Vec<u32>> = (0..10).map(|d| (0..d * 3 + 1).collect()).collect();
    let (p0, p1) = (dir.path().join("p0"), dir.path().join("p1"));
    write_megatron(&p0, &docs[..6], 8);
    write_megatron(&p1, &docs[6..], 8);
    let out = dir.path().join("out");
    let refused = |args: &[&str], want: &[&str]| {
        let o = gpufeed(&[&["merge"][..], args].concat());
        assert!(!o.status.success(), "{args:?} succeeded");
        let e = stderr(&o);
        for w in want {
            assert!(e.contains(w), "{args:?}: want {w:?} in {e}");
        }
        assert!(!e.contains("panicked"), "{e}");
        assert!(!with(&out, ".bin").exists() && !with(&out, ".idx").exists());
        e
    };
    // No parts at all.
    refused(&["-o", s(&out)], &["PREFIX"]);
    // A missing part, named.
    let gone = dir.path().join("gone");
    refused(
        &[s(&p0), s(&gone), s(&p1), "-o", s(&out)],
        &["gone", "not there"],
    );
    // Another dtype: both parts and their dtypes named.
    let wide = dir.path().join("wide");
    write_megatron(&wide, &docs[6..], 4);
    refused(
        &[s(&p0), s(&wide), "-o", s(&out)],
        &["wide", "p0", "i32", "u16", "dtype"],
    );
    // Another version of the index, named.
    let v2 = dir.path().join("v2");
    write_megatron(&v2, &docs[6..], 8);
    let mut idx = std::fs::read(with(&v2, ".idx")).unwrap();
    idx[9] = 2;
    std::fs::write(with(&v2, ".idx"), idx).unwrap();
    refused(&[s(&p0), s(&v2), "-o", s(&out)], &["v2.idx", "version 2"]);
    // A .bin longer than its index says: copied whole, it would shift the parts after it.
    let long = dir.path().join("long");
    write_megatron(&long, &docs[6..], 8);
    let mut bin = std::fs::read(with(&long, ".bin")).unwrap();
    bin.extend([0, 0]);
    std::fs::write(with(&long, ".bin"), bin).unwrap();
    refused(&[s(&long), s(&p1), "-o", s(&out)], &["long.idx", "fill"]);
    // A multimodal dataset (sequence modes after the document index).
    let modes = dir.path().join("modes");
    write_megatron(&modes, &docs[6..], 8);
    let mut idx = std::fs::read(with(&modes, ".idx")).unwrap();
    idx.extend([0u8; 4]);
    std::fs::write(with(&modes, ".idx"), idx).unwrap();
    refused(
        &[s(&p0), s(&modes), "-o", s(&out)],
        &["modes", "multimodal"],
    );
    // A flat file of tokens without --format nanogpt, and a Megatron dataset with it.
    let flat = dir.path().join("flat.bin");
    std::fs::write(&flat, [1u8, 0, 2, 0]).unwrap();
    refused(
        &[s(&p0), s(&flat), "-o", s(&out)],
        &["flat.bin", "--format nanogpt"],
    );
    refused(
        &[s(&flat), s(&p0), "-o", s(&out), "--format", "nanogpt"],
        &["p0.bin", "Megatron", "without --format nanogpt"],
    );
}

#[test]
fn inputs_and_existing_outputs_are_never_written_over() {
    let dir = tempfile::tempdir().unwrap();
    let docs: Vec<Vec<u32>> = (0..10).map(|d| (0..d * 3 + 1).collect()).collect();
    let (p0, p1) = (dir.path().join("p0"), dir.path().join("p1"));
    write_megatron(&p0, &docs[..6], 8);
    write_megatron(&p1, &docs[6..], 8);
    let before = [
        std::fs::read(with(&p1, ".bin")).unwrap(),
        std::fs::read(with(&p1, ".idx")).unwrap(),
    ];
    let run = |args: &[&str]| gpufeed(&[&["merge", s(&p0), s(&p1)][..], args].concat());
    // An input as the output, even with --force, and through a link.
    let o = run(&["-o", s(&p1), "--force"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("is the input"), "{}", stderr(&o));
    let hard = dir.path().join("hard");
    std::fs::hard_link(with(&p1, ".bin"), with(&hard, ".bin")).unwrap();
    let o = run(&["-o", s(&hard), "--force"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("is the input"), "{}", stderr(&o));
    assert!(!with(&hard, ".idx").exists());
    assert_eq!(
        [
            std::fs::read(with(&p1, ".bin")).unwrap(),
            std::fs::read(with(&p1, ".idx")).unwrap(),
        ],
        before
    );
    // An existing output: refused without --force, replaced with it.
    let out = dir.path().join("out");
    assert!(run(&["-o", s(&out)]).status.success());
    std::fs::write(with(&out, ".bin"), b"older").unwrap();
    let o = run(&["-o", s(&out)]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--force"), "{}", stderr(&o));
    assert_eq!(std::fs::read(with(&out, ".bin")).unwrap(), b"older");
    assert!(run(&["-o", s(&out), "--force"]).status.success());
    assert_eq!(read_megatron(&out), docs);
    // Not a Megatron index, or not a regular file, under an output's name: never replaced.
    std::fs::write(with(&out, ".idx"), b"my notes").unwrap();
    let o = run(&["-o", s(&out), "--force"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("not a Megatron index"),
        "{}",
        stderr(&o)
    );
    assert_eq!(std::fs::read(with(&out, ".idx")).unwrap(), b"my notes");
    std::fs::create_dir(dir.path().join("d.idx")).unwrap();
    let o = run(&["-o", s(&dir.path().join("d")), "--force"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("a directory"), "{}", stderr(&o));
    // Nothing else left in the directory: no temporaries.
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "d.idx", "hard.bin", "out.bin", "out.idx", "p0.bin", "p0.idx", "p1.bin", "p1.idx"
        ]
    );
}

#[test]
fn a_closed_pipe_ends_merge_quietly() {
    use std::io::Read;
    use std::process::Stdio;

    let dir = tempfile::tempdir().unwrap();
    let docs: Vec<Vec<u32>> = (0..4).map(|d| (0..d + 1).collect()).collect();
    let p0 = dir.path().join("p0");
    write_megatron(&p0, &docs, 8);
    let out = dir.path().join("out");
    let mut child = crate::cli_common::cmd(&["merge", s(&p0), "-o", s(&out)])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The reader goes before the command writes its line.
    drop(child.stdout.take());
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}: {err}");
    assert!(err.is_empty(), "{err}");
    assert_eq!(read_megatron(&out), docs);
}
