//! JSON lines ([`JsonLines`]): files written by the real tools (pandas, `datasets`, Python's
//! json module, gzip and zstandard; `tests/fixtures/jsonl/make.py`) read as Python's json
//! reads them, byte for byte; files written here for each rule: types inferred and declared,
//! inner objects, strings in place, fill values, blank lines, both read modes, directories and
//! patterns, the index kept in a directory, files that change, and the loader over it all.

use std::io::Write;
use std::path::{Path, PathBuf};

use gpufeed::format::ReadOptions;
use gpufeed::source::ReadMode;
use gpufeed::source::shards::FieldDecode;
use gpufeed::source::table::{JsonLines, JsonLinesOptions};
use gpufeed::{Dataset, Error, Loader};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/jsonl")
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Options that decompress into `cache`, in `mode`.
fn options(cache: &Path, mode: ReadMode) -> JsonLinesOptions {
    JsonLinesOptions {
        cache_dir: Some(cache.to_path_buf()),
        read: ReadOptions::from(mode),
        ..JsonLinesOptions::default()
    }
}

fn names_and_types(d: &JsonLines) -> Vec<(String, String)> {
    d.describe()
        .fields
        .iter()
        .filter_map(|f| Some((f.name.clone(), f.decode.clone()?)))
        .collect()
}

#[test]
fn files_of_real_writers_read_as_pythons_json_reads_them() {
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixtures().join("expected.json")).unwrap()).unwrap();
    let cache = tempfile::tempdir().unwrap();
    let files = manifest["files"].as_array().unwrap();
    assert_eq!(files.len(), 6);
    for mode in [ReadMode::Map, ReadMode::Pread] {
        for file in files {
            let name = file["file"].as_str().unwrap();
            let mut o = options(cache.path(), mode);
            for (field, text) in file["fill"].as_object().unwrap() {
                o.fill
                    .insert(field.clone(), text.as_str().unwrap().to_string());
            }
            let d = JsonLines::open(fixtures().join(name), &o).unwrap();
            let want: Vec<(String, String)> = file["fields"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| {
                    (
                        f[0].as_str().unwrap().to_string(),
                        f[1].as_str().unwrap().to_string(),
                    )
                })
                .collect();
            assert_eq!(names_and_types(&d), want, "{name}");
            let rows = file["rows"].as_array().unwrap();
            assert_eq!(d.len(), rows.len() as u64, "{name}");
            for (i, row) in rows.iter().enumerate() {
                let s = d.get(i as u64).unwrap();
                for (k, value) in row.as_array().unwrap().iter().enumerate() {
                    assert_eq!(
                        s.try_field(k).unwrap(),
                        hex(value.as_str().unwrap()),
                        "{name}: line {i}, field {}",
                        want[k].0
                    );
                }
            }
        }
    }
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn open(path: &Path) -> JsonLines {
    JsonLines::open(path, &JsonLinesOptions::default()).unwrap()
}

fn open_err(path: &Path, o: &JsonLinesOptions) -> Error {
    JsonLines::open(path, o).unwrap_err()
}

/// The line number, column and message of a `BadLine`.
fn bad_line(e: &Error) -> (u64, Option<u64>, String) {
    match e {
        Error::BadLine {
            line, column, what, ..
        } => (*line, *column, what.clone()),
        other => panic!("not a bad line: {other}"),
    }
}

#[test]
fn types_are_inferred_from_the_first_lines_and_inner_objects_are_fields() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(
        dir.path(),
        "a.jsonl",
        concat!(
            r#"{"id": 1, "x": 1, "ok": true, "t": "a", "v": [1, 2], "w": [], "m": {"a": {"b": 7}}, "n": null, "s": ["x"]}"#,
            "\n",
            r#"{"id": 2, "x": 2.5, "ok": false, "t": "b", "v": [], "w": [0.5], "m": {"a": {"b": 8}}, "n": null, "s": []}"#,
            "\n",
        ),
    );
    let d = open(&p);
    assert_eq!(
        names_and_types(&d),
        [
            ("id", "int"),
            ("x", "float"),
            ("ok", "bool[]"),
            ("t", "utf8"),
            ("v", "list[i64]"),
            ("w", "list[f64]"),
            ("m.a.b", "int"),
        ]
        .map(|(a, b)| (a.to_string(), b.to_string()))
    );
    // Left out, with why: always null, a list of strings.
    let summary = d.describe();
    let left: Vec<(&str, &str)> = summary
        .fields
        .iter()
        .filter_map(|f| Some((f.name.as_str(), f.left_out.as_deref()?)))
        .collect();
    assert_eq!(left.len(), 2, "{left:?}");
    assert!(left[0].0 == "n" && left[0].1.contains("null in every line"));
    assert!(left[1].0 == "s" && left[1].1.contains("lists of strings"));
    let s = d.get(0).unwrap();
    assert_eq!(*s.field_as::<i64>("id").unwrap(), [1]);
    assert_eq!(*s.field_as::<f64>("x").unwrap(), [1.0]);
    assert_eq!(*s.field_as::<u8>("ok").unwrap(), [1]);
    assert_eq!(*s.field_as::<i64>("v").unwrap(), [1, 2]);
    assert!(s.field_as::<f64>("w").unwrap().is_empty());
    assert_eq!(*s.field_as::<i64>("m.a.b").unwrap(), [7]);
    let s = d.get(1).unwrap();
    assert_eq!(*s.field_as::<f64>("x").unwrap(), [2.5]);
    assert_eq!(*s.field_as::<f64>("w").unwrap(), [0.5]);
    assert_eq!(summary.inferred_from_lines, 2);
}

#[test]
fn a_later_value_of_another_type_names_the_file_line_and_column() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(
        dir.path(),
        "a.jsonl",
        "{\"x\": 1}\n{\"x\": 2}\n\n{\"x\": 2.5}\n{\"x\": \"three\"}\n",
    );
    let o = JsonLinesOptions {
        infer_lines: 2,
        ..JsonLinesOptions::default()
    };
    let d = JsonLines::open(&p, &o).unwrap();
    let e = d.get(2).unwrap_err();
    assert!(
        e.to_string()
            .starts_with(&format!("{}: line 4, column 7: ", p.display())),
        "{e}"
    );
    let (line, column, what) = bad_line(&e);
    assert_eq!((line, column), (4, Some(7)));
    assert!(
        what.contains("`x` holds the number 2.5; the field is int"),
        "{what}"
    );
    assert!(what.contains("declare its type"), "{what}");
    assert_eq!(e.kind(), gpufeed::ErrorKind::Corrupt);
    let (_, _, what) = bad_line(&d.get(3).unwrap_err());
    assert!(what.contains("holds a string (\"three\")"), "{what}");
    // Declared float: integers are read as floats; the string still is not one.
    let o = JsonLinesOptions {
        decode: [("x".to_string(), FieldDecode::Float)].into(),
        ..o
    };
    let d = JsonLines::open(&p, &o).unwrap();
    assert_eq!(*d.get(0).unwrap().field_as::<f64>("x").unwrap(), [1.0]);
    assert_eq!(*d.get(2).unwrap().field_as::<f64>("x").unwrap(), [2.5]);
    let (line, _, what) = bad_line(&d.get(3).unwrap_err());
    assert_eq!(line, 5);
    assert!(!what.contains("declare"), "declared already: {what}");
    // Where the first lines hold both, the field is a float.
    let o = JsonLinesOptions {
        infer_lines: 3,
        ..JsonLinesOptions::default()
    };
    let d = JsonLines::open(&p, &o).unwrap();
    assert_eq!(names_and_types(&d)[0].1, "float");
}

#[test]
fn a_missing_key_or_a_null_is_an_error_unless_the_field_has_a_fill_value() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(
        dir.path(),
        "a.jsonl",
        concat!(
            "{\"a\": 1, \"t\": \"x\", \"m\": {\"k\": 2}}\n",
            "{\"t\": null, \"m\": null}\n",
            "{\"a\": null, \"m\": {}}\n",
        ),
    );
    let d = open(&p);
    let (line, column, what) = bad_line(&d.get(1).unwrap_err());
    assert_eq!((line, column), (2, None));
    assert!(what.starts_with("no key `a`"), "{what}");
    assert!(what.contains("fill value"), "{what}");
    let (line, column, what) = bad_line(&d.get(2).unwrap_err());
    assert_eq!((line, column), (3, Some(7)));
    assert!(what.starts_with("`a` is null"), "{what}");
    let o = JsonLinesOptions {
        fill: [("a", "-1"), ("t", "\"none\""), ("m.k", "0")]
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .into(),
        ..JsonLinesOptions::default()
    };
    let d = JsonLines::open(&p, &o).unwrap();
    for (i, (a, t, k)) in [(1, "x", 2), (-1, "none", 0), (-1, "none", 0)]
        .into_iter()
        .enumerate()
    {
        let s = d.get(i as u64).unwrap();
        assert_eq!(*s.field_as::<i64>("a").unwrap(), [a]);
        assert_eq!(s.field_named("t").unwrap(), t.as_bytes());
        assert_eq!(*s.field_as::<i64>("m.k").unwrap(), [k]);
    }
    let fills: Vec<Option<String>> = d.describe().fields.iter().map(|f| f.fill.clone()).collect();
    assert_eq!(
        fills,
        [Some("-1".into()), Some("\"none\"".into()), Some("0".into())]
    );
    // A fill value must be of its field's type, and for a field read.
    for (name, text, want) in [
        ("a", "\"x\"", "holds a string"),
        ("a", "null", "cannot be null"),
        ("a", "1 2", "more than one"),
        ("zz", "1", "not among the fields read"),
    ] {
        let o = JsonLinesOptions {
            fill: [(name.to_string(), text.to_string())].into(),
            ..JsonLinesOptions::default()
        };
        let e = open_err(&p, &o);
        assert!(
            matches!(
                e,
                Error::InvalidConfig {
                    setting: "fill",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains(want), "{want}: {e}");
    }
}

#[test]
fn declared_types_convert_as_numpy_and_keep_json_text_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(
        dir.path(),
        "a.jsonl",
        concat!(
            r#"{"px": [[1, 2, 3], [4, 5, 6]], "lab": 200, "h": 0.1, "tok": [1, 2, 70000], "meta": {"a": [1, "x"], "b": null}, "e": [0.5, 1.5]}"#,
            "\n",
            r#"{"px": [[1, 2, 3]], "lab": 300, "h": 1, "tok": [-1], "meta": "plain", "e": [1, 2, 3]}"#,
            "\n",
        ),
    );
    let decode = [
        ("px", "u8[2,3]"),
        ("lab", "u8[]"),
        ("h", "f16[]"),
        ("tok", "list[u32]"),
        ("meta", "json"),
        ("e", "f32[2]"),
    ]
    .map(|(k, v)| (k.to_string(), v.parse::<FieldDecode>().unwrap()))
    .into();
    let o = JsonLinesOptions {
        decode,
        ..JsonLinesOptions::default()
    };
    let d = JsonLines::open(&p, &o).unwrap();
    let s = d.get(0).unwrap();
    assert_eq!(*s.field_as::<u8>("px").unwrap(), [1, 2, 3, 4, 5, 6]);
    assert_eq!(*s.field_as::<u8>("lab").unwrap(), [200]);
    assert_eq!(
        *s.field_as::<half::f16>("h").unwrap(),
        [half::f16::from_f64(0.1)]
    );
    assert_eq!(*s.field_as::<u32>("tok").unwrap(), [1, 2, 70000]);
    assert_eq!(
        s.field_named("meta").unwrap(),
        br#"{"a": [1, "x"], "b": null}"#
    );
    assert_eq!(*s.field_as::<f32>("e").unwrap(), [0.5, 1.5]);
    // The json text is a view of the line, in the mapping: not copied.
    let line = s.bytes().unwrap().as_ptr_range();
    let meta = s.field_named("meta").unwrap().as_ptr_range();
    assert!(line.start <= meta.start && meta.end <= line.end);
    let e = d.get(1).unwrap_err();
    let (_, _, what) = bad_line(&e);
    assert!(
        what.contains(
            "`px` (the field is u8[2,3]): a list of 1 values where the shape [2, 3] has 2"
        ),
        "{what}"
    );
    // One line, each wrong value alone.
    for (line, want) in [
        (r#""lab": 300"#, "300 does not fit in u8"),
        (r#""tok": [-1]"#, "-1 does not fit in u32"),
        (r#""e": [1, 2, 3]"#, "a list of more than 2 values"),
        (r#""h": "x""#, "`h` holds a string"),
        (r#""tok": [1, 2.5]"#, "`tok` holds the number 2.5 in it"),
    ] {
        let good =
            r#""px": [[1, 2, 3], [4, 5, 6]], "lab": 1, "h": 1, "tok": [], "meta": 1, "e": [1, 2]"#;
        let text = format!("{{{good}}}\n{{{good}, {line}}}\n");
        let p = write(dir.path(), "b.jsonl", &text);
        let d = JsonLines::open(&p, &o).unwrap();
        d.get(0).unwrap();
        let (n, _, what) = bad_line(&d.get(1).unwrap_err());
        assert_eq!(n, 2);
        assert!(what.contains(want), "{want}: {what}");
    }
}

#[test]
fn strings_without_escapes_are_views_and_escapes_are_decoded() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(
        dir.path(),
        "a.jsonl",
        "{\"t\": \"plain text\"}\n{\"t\": \"caf\\u00e9 \\ud83d\\ude00 a\\/b \\\"q\\\" \\\\ \\n\"}\n{\"t\": \"日本\"}\n",
    );
    let d = open(&p);
    let s = d.get(0).unwrap();
    let line = s.bytes().unwrap().as_ptr_range();
    let t = s.field_named("t").unwrap();
    assert_eq!(t, b"plain text");
    assert!(line.start <= t.as_ptr() && t.as_ptr_range().end <= line.end);
    assert_eq!(
        d.get(1).unwrap().field_named("t").unwrap(),
        "café 😀 a/b \"q\" \\ \n".as_bytes()
    );
    assert_eq!(
        d.get(2).unwrap().field_named("t").unwrap(),
        "日本".as_bytes()
    );
}

#[test]
fn blank_lines_a_byte_order_mark_and_crlf_are_skipped_and_counted_in_line_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(
        dir.path(),
        "a.jsonl",
        "\u{feff}\r\n{\"a\": 1}\r\n   \r\n\t\n{\"a\": 2}\r\n{\"a\": \"x\"}\r\n\r\n\n",
    );
    for mode in [ReadMode::Map, ReadMode::Pread] {
        let o = JsonLinesOptions {
            infer_lines: 1,
            read: ReadOptions::from(mode),
            ..JsonLinesOptions::default()
        };
        let d = JsonLines::open(&p, &o).unwrap();
        assert_eq!(d.len(), 3);
        assert_eq!(*d.get(1).unwrap().field_as::<i64>("a").unwrap(), [2]);
        let (line, column, _) = bad_line(&d.get(2).unwrap_err());
        assert_eq!((line, column), (6, Some(7)));
        assert_eq!(d.line_of(1).unwrap().1, 5);
        let f = &d.describe().files[0];
        // Blank: the mark's line, `   `, a tab, and the two after the last object.
        assert_eq!((f.lines, f.blank_lines), (3, 5));
    }
}

#[test]
fn fields_are_chosen_by_name_and_an_object_by_its_name() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(
        dir.path(),
        "a.jsonl",
        "{\"a\": 1, \"b\": \"x\", \"m\": {\"p\": 1, \"q\": 2.5}, \"s\": [\"x\"]}\n",
    );
    let pick = |fields: &[&str]| JsonLinesOptions {
        fields: Some(fields.iter().map(|f| f.to_string()).collect()),
        ..JsonLinesOptions::default()
    };
    let d = JsonLines::open(&p, &pick(&["m", "b"])).unwrap();
    let names: Vec<String> = names_and_types(&d).into_iter().map(|f| f.0).collect();
    assert_eq!(names, ["m.p", "m.q", "b"]);
    let s = d.get(0).unwrap();
    assert_eq!(*s.field_as::<f64>("m.q").unwrap(), [2.5]);
    for (fields, want) in [
        (&["zz"][..], "no field `zz` in the first 1 lines"),
        (&["s"][..], "lists of strings"),
    ] {
        let e = open_err(&p, &pick(fields));
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
        assert!(e.to_string().contains(want), "{want}: {e}");
    }
    // A key not in the first lines, declared: read from the lines that have it.
    let o = JsonLinesOptions {
        decode: [("late".to_string(), FieldDecode::Int)].into(),
        fill: [("late".to_string(), "0".to_string())].into(),
        ..pick(&["a", "late"])
    };
    let d = JsonLines::open(&p, &o).unwrap();
    assert_eq!(*d.get(0).unwrap().field_as::<i64>("late").unwrap(), [0]);
    // An object read whole, and a field inside it: one or the other.
    let o = JsonLinesOptions {
        decode: [("m".to_string(), "json".parse().unwrap())].into(),
        ..pick(&["m", "m.p"])
    };
    assert!(
        open_err(&p, &o)
            .to_string()
            .contains("inside another field")
    );
    let o = JsonLinesOptions {
        decode: [("zz".to_string(), FieldDecode::Int)].into(),
        ..pick(&["a"])
    };
    assert!(matches!(
        open_err(&p, &o),
        Error::InvalidConfig {
            setting: "decode",
            ..
        }
    ));
}

#[test]
fn a_directory_or_a_pattern_of_files_is_one_data_set_in_the_order_of_their_names() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let line = |i: usize| format!("{{\"i\": {i}}}\n");
    let lines = |r: std::ops::Range<usize>| r.map(line).collect::<String>();
    write(&data, "train-00000-of-00003.jsonl", &lines(0..3));
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(6));
    gz.write_all(lines(3..7).as_bytes()).unwrap();
    std::fs::write(
        data.join("train-00001-of-00003.jsonl.gz"),
        gz.finish().unwrap(),
    )
    .unwrap();
    std::fs::write(
        data.join("train-00002-of-00003.jsonl.zst"),
        zstd::bulk::compress(lines(7..8).as_bytes(), 3).unwrap(),
    )
    .unwrap();
    write(&data, "dataset_info.json", "{\n  \"pretty\": true\n}\n");
    write(&data, "README.md", "# not data\n");
    let cache = tempfile::tempdir().unwrap();
    let o = JsonLinesOptions {
        decode: [("i".to_string(), FieldDecode::Int)].into(),
        ..options(cache.path(), ReadMode::Map)
    };
    for target in [data.clone(), data.join("train-*.jsonl*")] {
        let d = JsonLines::open(&target, &o).unwrap();
        assert_eq!(d.len(), 8, "{}", target.display());
        for i in 0..8 {
            assert_eq!(*d.get(i).unwrap().field_as::<i64>("i").unwrap(), [i as i64]);
        }
        let summary = d.describe();
        let compressions: Vec<Option<&str>> = summary
            .files
            .iter()
            .map(|f| f.compression.as_deref())
            .collect();
        assert_eq!(compressions, [None, Some("gzip"), Some("zstd")]);
        assert_eq!(summary.files[1].lines, 4);
        assert_eq!(summary.bytes, lines(0..8).len() as u64);
    }
    // A line's error names the compressed file and its own line number.
    write(
        &data,
        "train-00003-of-00003.jsonl",
        "{\"i\": 8}\n{\"i\": \"x\"}\n",
    );
    let d = JsonLines::open(&data, &o).unwrap();
    let e = d.get(9).unwrap_err();
    match &e {
        Error::BadLine { path, line, .. } => {
            assert_eq!(path, &data.join("train-00003-of-00003.jsonl"));
            assert_eq!(*line, 2);
        }
        other => panic!("{other}"),
    }
    // The .json files of a directory are read when it has no .jsonl: this one is no JSON
    // lines file.
    let pretty = dir.path().join("pretty");
    std::fs::create_dir(&pretty).unwrap();
    write(&pretty, "dataset_info.json", "{\n  \"pretty\": true\n}\n");
    let (line, column, what) = bad_line(&open_err(&pretty, &o));
    assert_eq!((line, column), (2, Some(3)));
    assert!(what.contains("pretty-printed"), "{what}");
    assert!(!gpufeed::source::table::is_json_lines(&pretty));
    assert!(gpufeed::source::table::is_json_lines(&data));
    assert!(gpufeed::source::table::is_json_lines(
        &data.join("*.jsonl.gz")
    ));
}

#[test]
fn a_json_file_is_json_lines_when_its_first_line_is_one_object() {
    use gpufeed::source::table::is_json_lines;
    let dir = tempfile::tempdir().unwrap();
    let long = format!("{{\"t\": \"{}\"}}\n{{\"t\": \"x\"}}\n", "a".repeat(100_000));
    for (name, text, lines) in [
        ("lines.json", "\n{\"a\": 1}\n{\"a\": 2}\n", true),
        ("one.json", "{\"a\": 1}", true),
        ("long.json", long.as_str(), true),
        ("array.json", "[{\"a\": 1}, {\"a\": 2}]\n", false),
        ("pretty.json", "{\n  \"a\": 1\n}\n", false),
        ("empty.json", "", false),
        ("any.jsonl", "not even JSON", true),
        ("data.txt", "{\"a\": 1}\n", false),
    ] {
        let p = write(dir.path(), name, text);
        assert_eq!(is_json_lines(&p), lines, "{name}");
    }
    let gz = dir.path().join("lines.json.gz");
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(6));
    e.write_all(b"{\"a\": 1}\n").unwrap();
    std::fs::write(&gz, e.finish().unwrap()).unwrap();
    assert!(is_json_lines(&gz));
    assert!(!is_json_lines(&dir.path().join("missing.jsonl")));
}

#[test]
fn a_compressed_file_is_decompressed_once_into_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let text: String = (0..100).map(|i| format!("{{\"i\": {i}}}\n")).collect();
    let path = dir.path().join("a.jsonl.zst");
    std::fs::write(&path, zstd::bulk::compress(text.as_bytes(), 3).unwrap()).unwrap();
    let cache = tempfile::tempdir().unwrap();
    let copies = || -> Vec<PathBuf> {
        walk(cache.path())
            .into_iter()
            .filter(|p| !p.to_string_lossy().ends_with(".lock"))
            .collect()
    };
    let o = options(cache.path(), ReadMode::Pread);
    let d = JsonLines::open(&path, &o).unwrap();
    assert_eq!(d.len(), 100);
    let first = copies();
    assert_eq!(first.len(), 1, "{first:?}");
    let made = std::fs::metadata(&first[0]).unwrap().ino();
    drop(d);
    let d = JsonLines::open(&path, &o).unwrap();
    assert_eq!(*d.get(99).unwrap().field_as::<i64>("i").unwrap(), [99]);
    assert_eq!(copies(), first, "found again, not made again");
    assert_eq!(std::fs::metadata(&first[0]).unwrap().ino(), made);
    // A cache too small for it: refused, naming the file and the limit.
    let o = JsonLinesOptions {
        cache_limit: Some(100),
        cache_dir: Some(tempfile::tempdir().unwrap().path().to_path_buf()),
        ..JsonLinesOptions::default()
    };
    let e = open_err(&path, &o);
    assert!(matches!(e, Error::Malformed { .. }), "{e}");
    assert!(e.to_string().contains("cache's limit"), "{e}");
    // A file changed since: a new copy.
    std::fs::write(&path, zstd::bulk::compress(b"{\"i\": 7}\n", 3).unwrap()).unwrap();
    let o = options(cache.path(), ReadMode::Map);
    let d = JsonLines::open(&path, &o).unwrap();
    assert_eq!(d.len(), 1);
}

use std::os::unix::fs::MetadataExt;

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out.sort();
    out
}

#[test]
fn the_index_is_kept_in_a_directory_when_allowed_and_built_again_when_stale() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "a.jsonl", "{\"a\": 1}\n\n{\"a\": 2}\n");
    let index_dir = dir.path().join("index");
    let o = JsonLinesOptions {
        index_dir: Some(index_dir.clone()),
        ..JsonLinesOptions::default()
    };
    let first = JsonLines::open(&p, &o).unwrap();
    assert!(!first.describe().files[0].index_from_file);
    assert_eq!(walk(&index_dir).len(), 1);
    let again = JsonLines::open(&p, &o).unwrap();
    let f = &again.describe().files[0];
    assert!(f.index_from_file);
    assert_eq!((f.lines, f.blank_lines), (2, 1));
    assert_eq!(*again.get(1).unwrap().field_as::<i64>("a").unwrap(), [2]);
    // Changed (another size): built again, and right.
    std::fs::write(&p, "{\"a\": 1}\n{\"a\": 2}\n{\"a\": 3}\n").unwrap();
    let changed = JsonLines::open(&p, &o).unwrap();
    assert!(!changed.describe().files[0].index_from_file);
    assert_eq!(changed.len(), 3);
    // A corrupt index file is not trusted.
    for f in walk(&index_dir) {
        let mut b = std::fs::read(&f).unwrap();
        let n = b.len();
        b[n / 2] ^= 0xff;
        std::fs::write(&f, b).unwrap();
    }
    let d = JsonLines::open(&p, &o).unwrap();
    assert!(!d.describe().files[0].index_from_file);
    assert_eq!(*d.get(2).unwrap().field_as::<i64>("a").unwrap(), [3]);
    // Without the option, nothing is written.
    let other = tempfile::tempdir().unwrap();
    let q = write(other.path(), "b.jsonl", "{\"a\": 1}\n");
    open(&q);
    assert_eq!(walk(other.path()), [q]);
}

#[test]
fn a_file_written_after_it_was_opened_is_reported_at_the_next_check() {
    let dir = tempfile::tempdir().unwrap();
    for mode in [ReadMode::Map, ReadMode::Pread] {
        let p = write(dir.path(), "a.jsonl", "{\"a\": 1}\n{\"a\": 2}\n");
        let o = JsonLinesOptions {
            read: ReadOptions::from(mode),
            ..JsonLinesOptions::default()
        };
        let d = JsonLines::open(&p, &o).unwrap();
        d.check_unchanged().unwrap();
        // Replaced by a new file renamed over it.
        let tmp = write(dir.path(), "tmp", "{\"a\": 1}\n{\"a\": 3}\n");
        std::fs::rename(&tmp, &p).unwrap();
        let e = d.check_unchanged().unwrap_err();
        assert!(matches!(e, Error::FileChanged { .. }), "{e}");
        // The open data set still reads the file it opened.
        assert_eq!(*d.get(1).unwrap().field_as::<i64>("a").unwrap(), [2]);
    }
}

#[test]
fn the_loader_batches_text_numbers_and_lists() {
    let dir = tempfile::tempdir().unwrap();
    let text: String = (0..100)
        .map(|i| {
            format!(
                "{{\"id\": {i}, \"text\": \"{}\", \"v\": [{}], \"y\": {}.5}}\n",
                "ab".repeat(i % 7),
                (0..i % 5)
                    .map(|j| j.to_string())
                    .collect::<Vec<_>>()
                    .join(","),
                i
            )
        })
        .collect();
    let p = write(dir.path(), "a.jsonl", &text);
    let d = open(&p);
    let mut loader = Loader::builder(d)
        .batch_size(16)
        .shuffle(3)
        .workers(2)
        .build()
        .unwrap();
    let mut seen = 0;
    for batch in loader.by_ref() {
        let batch = batch.unwrap();
        let ids = batch.field::<i64>("id").unwrap().to_vec();
        let y = batch.field::<f64>("y").unwrap();
        let t = batch.ragged::<u8>("text").unwrap();
        let v = batch.ragged::<i64>("v").unwrap();
        for (k, &i) in ids.iter().enumerate() {
            let i = i as usize;
            assert_eq!(y[k], i as f64 + 0.5);
            assert_eq!(t.iter().nth(k).unwrap(), "ab".repeat(i % 7).as_bytes());
            let want: Vec<i64> = (0..(i % 5) as i64).collect();
            assert_eq!(v.iter().nth(k).unwrap(), want);
        }
        seen += ids.len();
    }
    assert_eq!(seen, 100);
}

#[test]
fn the_front_door_opens_json_lines_with_the_tables_options_and_describes_them() {
    use gpufeed::source::table::{Fill, TableOptions};
    use gpufeed::source::{Format, OpenOptions, detect, open};
    let dir = tempfile::tempdir().unwrap();
    let p = write(
        dir.path(),
        "train.jsonl",
        "{\"text\": \"a\", \"label\": 1, \"extra\": true}\n{\"text\": \"b\", \"label\": null}\n",
    );
    let pattern = dir.path().join("*.jsonl");
    for name in [p.as_path(), dir.path(), pattern.as_path()] {
        assert_eq!(
            detect(name).unwrap(),
            Format::JsonLines,
            "{}",
            name.display()
        );
    }
    let options = OpenOptions {
        cache_dir: Some(dir.path().join("cache")),
        table: TableOptions {
            columns: Some(vec!["text".into(), "label".into()]),
            fill: [("label".to_string(), Fill::Int(-1))].into(),
            ..TableOptions::default()
        },
        ..OpenOptions::default()
    };
    let d = open(&p, &options).unwrap();
    assert_eq!(d.format(), Format::JsonLines);
    assert_eq!(d.len(), 2);
    let s = d.get(1).unwrap();
    assert_eq!(s.field_named("text"), Some(&b"b"[..]));
    assert_eq!(*s.field_as::<i64>("label").unwrap(), [-1]);
    let described = d.describe().unwrap();
    let json = described.to_json();
    assert_eq!(json["format"], "jsonl");
    assert_eq!(json["records"], 2);
    assert_eq!(json["files"].as_array().unwrap().len(), 1);
    let keys = described.get("keys").unwrap();
    assert!(
        keys.text.contains("label -> int (inferred; null: -1)"),
        "{}",
        keys.text
    );
    // Without the fill value the null is an error naming the line; checksums are refused.
    let e = open(&p, &OpenOptions::default())
        .unwrap()
        .get(1)
        .err()
        .unwrap();
    assert!(e.to_string().contains("line 2"), "{e}");
    let mut verify = OpenOptions::default();
    verify.read.verify_checksums = true;
    let e = open(&p, &verify).err().unwrap().to_string();
    assert!(e.contains("no checksums"), "{e}");
}
