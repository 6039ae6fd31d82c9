//! Bad JSON lines: every malformed line, compressed file and value is a typed error naming the
//! file and line (and column where one place is at fault), never a panic or a value read
//! wrong; random objects read back as serde_json reads them; random bytes and mutations of a
//! good file never panic and never hand out a field outside its sample.

use std::path::Path;

use gpufeed::Dataset;
use gpufeed::Error;
use gpufeed::format::{DType, FieldKind};
use gpufeed::source::table::{JsonLines, JsonLinesOptions};
use proptest::prelude::*;

fn open_memory(text: &[u8]) -> gpufeed::Result<JsonLines> {
    JsonLines::from_memory("m.jsonl", text.to_vec(), &JsonLinesOptions::default())
}

/// The error of reading the second line of `first` then `second` (or of opening them).
fn second_line_error(first: &str, second: &[u8]) -> Error {
    let mut text = format!("{first}\n").into_bytes();
    text.extend_from_slice(second);
    text.push(b'\n');
    match open_memory(&text) {
        Ok(d) => {
            d.get(0).unwrap();
            d.get(1).unwrap_err()
        }
        Err(e) => e,
    }
}

/// Columns are Python's: `json.loads` of each line says the same column, but where Python
/// reads what gpufeed refuses (a lone surrogate, which no UTF-8 text holds), or refuses
/// before it parses (bytes that are not UTF-8), or says `Expecting ',' delimiter` at a
/// number's stray point or exponent.
#[test]
fn malformed_lines_are_errors_naming_the_line_and_column() {
    let good = r#"{"a": 1, "t": "x"}"#;
    for (second, column, want) in [
        (
            &br#"{"a": 1, "t": "x""#[..],
            18,
            "the line ends where `,` or `}`",
        ),
        (
            br#"{"a": 1 "t": "x"}"#,
            9,
            "expected `,` or `}` after a value in an object, found `\"`",
        ),
        (
            br#"{"a": 1, "t": "x"} {}"#,
            20,
            "more after the object's end",
        ),
        (br#"{"a": 01, "t": "x"}"#, 8, "expected `,` or `}`"),
        (br#"{"a": 1, "t": "x",}"#, 19, "a key in double quotes"),
        (br#"{a: 1}"#, 2, "a key in double quotes"),
        (
            br#"{"a": 1, "t": "x\q"}"#,
            17,
            "an escape JSON does not have",
        ),
        (br#"{"a": 1, "t": "\u12"}"#, 16, "four hexadecimal digits"),
        (br#"{"a": 1, "t": "\ud800"}"#, 16, "lone surrogate"),
        (b"{\"a\": 1, \"t\": \"x\ty\"}", 17, "control character"),
        (br#"{"a": 1, "t": "x}"#, 15, "does not end on its line"),
        (br#"{"a": tru, "t": "x"}"#, 7, "expected a value"),
        (
            br#"{"a": 1., "t": "x"}"#,
            8,
            "a decimal point without a digit",
        ),
        (br#"{"a": 1e+, "t": "x"}"#, 8, "an exponent without a digit"),
        (br#"{"a": -, "t": "x"}"#, 7, "expected a value"),
        (br#"{"a": 1, "t": "x", "z": [1, 2}"#, 30, "`,` or `]`"),
        (b"{\"a\": 1, \"t\": \"\xff\"}", 16, "not UTF-8"),
        (br#"{"a": 1, "t": "x", "z": +1}"#, 25, "expected a value"),
    ] {
        let e = second_line_error(good, second);
        let text = e.to_string();
        match &e {
            Error::BadLine {
                path,
                line,
                column: c,
                what,
            } => {
                assert_eq!(path, Path::new("m.jsonl"));
                assert_eq!(*line, 2, "{text}");
                assert_eq!(
                    *c,
                    Some(column),
                    "{}: {text}",
                    String::from_utf8_lossy(second)
                );
                assert!(what.contains(want), "`{want}` not in: {text}");
            }
            other => panic!("{}: {other}", String::from_utf8_lossy(second)),
        }
    }
}

#[test]
fn lines_that_are_not_objects_are_refused_when_the_file_is_opened() {
    for (text, line, column, want) in [
        (&b"[{\"a\": 1}, {\"a\": 2}]\n"[..], 1, 1, "a JSON array"),
        (b"{\n  \"a\": 1\n}\n", 2, 3, "pretty-printed"),
        (b"{\"a\": 1}\n  42\n", 2, 3, "`4`, not `{`"),
        (b"\x1f\x8b\x08\x00rest", 1, 1, "gzip"),
        (b"\x28\xb5\x2f\xfdrest", 1, 1, "zstd"),
    ] {
        let e = open_memory(text).unwrap_err();
        match &e {
            Error::BadLine {
                line: l,
                column: c,
                what,
                ..
            } => {
                assert_eq!((*l, *c), (line, Some(column)), "{e}");
                assert!(what.contains(want), "`{want}` not in: {e}");
            }
            other => panic!("{other}"),
        }
    }
    // A syntax error in the first lines is found when the fields are inferred.
    let e = open_memory(b"{\"a\": 1}\n{\"a\": }\n").unwrap_err();
    assert!(matches!(e, Error::BadLine { line: 2, .. }), "{e}");
    // Nothing to read.
    for empty in [&b""[..], b"\n\n  \n", b"{}\n{}\n"] {
        let e = open_memory(empty).unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidConfig {
                    setting: "fields",
                    ..
                }
            ),
            "{e}"
        );
    }
}

#[test]
fn deep_nesting_is_an_error_not_a_stack_overflow() {
    let deep = format!(
        "{{\"a\": 1, \"b\": {}1{}}}\n",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    let text = format!("{{\"a\": 1}}\n{deep}");
    let first_line_only = JsonLinesOptions {
        infer_lines: 1,
        ..JsonLinesOptions::default()
    };
    let d = JsonLines::from_memory("m.jsonl", text.into_bytes(), &first_line_only).unwrap();
    let e = d.get(1).unwrap_err();
    assert!(e.to_string().contains("nested more than"), "{e}");
    let e = open_memory(deep.as_bytes()).unwrap_err();
    assert!(e.to_string().contains("nested more than"), "{e}");
}

#[test]
fn a_corrupt_compressed_file_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let o = JsonLinesOptions {
        cache_dir: Some(cache.path().to_path_buf()),
        ..JsonLinesOptions::default()
    };
    let text: String = (0..1000).map(|i| format!("{{\"i\": {i}}}\n")).collect();
    let gz = {
        use std::io::Write;
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(6));
        e.write_all(text.as_bytes()).unwrap();
        e.finish().unwrap()
    };
    let zst = zstd::bulk::compress(text.as_bytes(), 3).unwrap();
    for (name, bytes) in [
        ("cut.jsonl.gz", gz[..gz.len() / 2].to_vec()),
        ("cut.jsonl.zst", zst[..zst.len() / 2].to_vec()),
        ("plain.jsonl.gz", text.as_bytes().to_vec()),
        ("plain.jsonl.zst", text.as_bytes().to_vec()),
        ("empty.jsonl.gz", Vec::new()),
    ] {
        let p = dir.path().join(name);
        std::fs::write(&p, &bytes).unwrap();
        let e = JsonLines::open(&p, &o).unwrap_err();
        match &e {
            Error::Malformed { path, format, .. } => {
                assert_eq!(path, &p);
                assert_eq!(*format, "JSON lines");
            }
            // An empty gzip file decompresses to nothing: no line to infer fields from.
            Error::InvalidConfig { .. } if name == "empty.jsonl.gz" => {}
            other => panic!("{name}: {other}"),
        }
    }
    // Nothing half written is left in the cache.
    let left: Vec<_> = std::fs::read_dir(cache.path())
        .unwrap()
        .flatten()
        .flat_map(|d| std::fs::read_dir(d.path()).unwrap().flatten())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".part-"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// Every field of every sample of `d` lies inside its line, but decoded values and fill
/// values (`fill`).
fn read_all(d: &JsonLines, fill: &[u8]) {
    for i in 0..d.len().min(200) {
        let Ok(s) = d.get(i) else { continue };
        let line = s.bytes().unwrap().as_ptr_range();
        for (k, f) in d.schema().fields().iter().enumerate() {
            let v = s.try_field(k).unwrap();
            let inside = line.start <= v.as_ptr() && v.as_ptr_range().end <= line.end;
            let decoded = !matches!(
                f.kind,
                FieldKind::Bytes {
                    codec: gpufeed::format::Codec::Json
                }
            );
            assert!(
                inside || decoded || v.is_empty() || v == fill,
                "field {k} outside its line"
            );
            if let FieldKind::Tensor { dtype, .. } = &f.kind {
                assert_eq!(Some(v.len()), f.fixed_bytes(), "{dtype}");
            }
        }
    }
    let _ = d.verify(|_| {});
}

const GOOD: &str = concat!(
    r#"{"id": 1, "x": 0.5, "t": "caf\u00e9", "v": [1, 2, 3], "m": {"a": true, "b": [0.5]}, "j": null}"#,
    "\n",
    r#"{"id": 2, "x": -1e3, "t": "日本", "v": [], "m": {"a": false, "b": []}, "j": {"k": [1, {"z": "y"}]}}"#,
    "\n\n",
    r#"{"id": 3, "x": NaN, "t": "\"", "v": [7], "m": {"a": true, "b": [Infinity]}, "j": 1}"#,
    "\n",
);

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Mutations of a good file: opened or refused, every line read or refused, never a panic.
    #[test]
    fn mutated_files_never_panic(
        edits in prop::collection::vec((0usize..GOOD.len(), any::<u8>(), 0u8..3), 1..8),
        declare in any::<bool>(),
    ) {
        let mut b = GOOD.as_bytes().to_vec();
        for (at, byte, how) in edits {
            let at = at.min(b.len().saturating_sub(1));
            match how {
                0 if !b.is_empty() => b[at] = byte,
                1 => b.insert(at, byte),
                _ if !b.is_empty() => { b.remove(at); }
                _ => {}
            }
        }
        let mut o = JsonLinesOptions::default();
        if declare {
            o.decode.insert("j".into(), "json".parse().unwrap());
            o.decode.insert("v".into(), "list[u8]".parse().unwrap());
            o.fill.insert("j".into(), "[]".into());
        }
        if let Ok(d) = JsonLines::from_memory("m.jsonl", b, &o) {
            read_all(&d, b"[]");
        }
    }

    /// Any bytes: never a panic.
    #[test]
    fn random_bytes_never_panic(b in prop::collection::vec(any::<u8>(), 0..300)) {
        if let Ok(d) = open_memory(&b) {
            read_all(&d, b"");
        }
    }

    /// Objects serde_json writes read back as serde_json reads them.
    #[test]
    fn objects_read_back_as_serde_json_reads_them(rows in prop::collection::vec(row(), 1..20)) {
        let text: String = rows
            .iter()
            .map(|r| serde_json::to_string(r).unwrap() + "\n")
            .collect();
        // Lists of ints, declared: in a few rows all may be empty.
        let o = JsonLinesOptions {
            decode: [("inner.v".to_string(), "list[i64]".parse().unwrap())].into(),
            ..JsonLinesOptions::default()
        };
        let d = JsonLines::from_memory("m.jsonl", text.clone().into_bytes(), &o).unwrap();
        prop_assert_eq!(d.len(), rows.len() as u64);
        for (i, r) in rows.iter().enumerate() {
            let s = d.get(i as u64).unwrap();
            prop_assert_eq!(s.field_as::<i64>("n").unwrap().to_vec(), vec![r["n"].as_i64().unwrap()]);
            prop_assert_eq!(
                s.field_as::<f64>("x").unwrap()[0].to_bits(),
                r["x"].as_f64().unwrap().to_bits()
            );
            prop_assert_eq!(s.field_named("s").unwrap(), r["s"].as_str().unwrap().as_bytes());
            let v: Vec<i64> = r["inner"]["v"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_i64().unwrap())
                .collect();
            prop_assert_eq!(s.field_as::<i64>("inner.v").unwrap().to_vec(), v);
            prop_assert_eq!(
                s.field_as::<u8>("inner.b").unwrap().to_vec(),
                vec![u8::from(r["inner"]["b"].as_bool().unwrap())]
            );
        }
        // Only the fields asked for: the others are skipped, their syntax checked.
        let o = JsonLinesOptions {
            fields: Some(vec!["inner.b".into()]),
            ..JsonLinesOptions::default()
        };
        let d = JsonLines::from_memory("m.jsonl", text.into_bytes(), &o).unwrap();
        prop_assert_eq!(d.schema().fields().len(), 1);
        prop_assert_eq!(&d.schema().fields()[0].kind, &FieldKind::Tensor { dtype: DType::Bool, shape: vec![] });
        for i in 0..d.len() {
            d.get(i).unwrap();
        }
    }
}

/// An object of an int, a float (always with a point or exponent, as serde_json writes
/// floats), a string of any characters, and an inner object of a list of ints and a bool.
fn row() -> impl Strategy<Value = serde_json::Value> {
    (
        any::<i64>(),
        any::<f64>().prop_filter("finite", |x| x.is_finite()),
        any::<String>(),
        prop::collection::vec(any::<i64>(), 0..5),
        any::<bool>(),
    )
        .prop_map(|(n, x, s, v, b)| {
            serde_json::json!({ "n": n, "x": x, "s": s, "inner": { "v": v, "b": b } })
        })
}
