//! Members and columns decoded by their writers' conventions: WebDataset's integer
//! extensions as `i64` scalars, `.npy` members as tensors (or npy bytes when their shapes
//! vary), text and JSON checked to be UTF-8, MDS `str_int`/`str_float` as numbers, `pkl`
//! refused unless declared, declarations by name; each value that does not decode a typed
//! error naming the shard, the sample and the field.

use std::path::{Path, PathBuf};

use crate::tar_common::TarBuilder;
use gpufeed::format::{Codec, DType, FieldKind};
use gpufeed::source::npy_header;
use gpufeed::source::shards::mds::MdsDataset;
use gpufeed::source::shards::webdataset::{WebDataset, WebDatasetOptions};
use gpufeed::source::shards::{FieldDecode, ShardOptions};
use gpufeed::{CopyFields, Dataset, Error, Loader};

fn options(cache: &Path, decode: &[(&str, &str)]) -> WebDatasetOptions {
    WebDatasetOptions {
        cache_dir: Some(cache.join("index-cache")),
        shards: ShardOptions {
            decode: decode
                .iter()
                .map(|(n, d)| (n.to_string(), d.parse::<FieldDecode>().unwrap()))
                .collect(),
            ..ShardOptions::default()
        },
        ..WebDatasetOptions::default()
    }
}

fn npy(dtype: DType, shape: &[u64], values: &[u8]) -> Vec<u8> {
    let mut b = npy_header(dtype, shape).unwrap();
    b.extend_from_slice(values);
    b
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn tensor(dtype: DType, shape: &[u64]) -> FieldKind {
    FieldKind::Tensor {
        dtype,
        shape: shape.to_vec(),
    }
}

/// Two shards of 3 and 2 samples with every member type webdataset decodes.
fn write_shards(dir: &Path) -> Vec<PathBuf> {
    let mut paths = Vec::new();
    for (s, range) in [(0, 0..3), (1, 3..5)] {
        let mut t = TarBuilder::new();
        for i in range {
            let key = format!("d/s{i:03}");
            let x = npy(DType::F32, &[2, 3], &f32s(&[i as f32; 6]));
            let v = npy(DType::U8, &[i + 1], &vec![i as u8; i as usize + 1]);
            t.file(&format!("{key}.cls"), i.to_string().as_bytes())
                .file(&format!("{key}.cls2"), format!(" {}\n", i * 10).as_bytes())
                .file(&format!("{key}.id"), format!("-{i}").as_bytes())
                .file(&format!("{key}.index"), b"1_000")
                .file(&format!("{key}.inx"), b"+7")
                .file(&format!("{key}.json"), format!("{{\"i\": {i}}}").as_bytes())
                .file(&format!("{key}.txt"), format!("caption {i} é").as_bytes())
                .file(&format!("{key}.x.npy"), &x)
                .file(&format!("{key}.v.npy"), &v)
                .file(&format!("{key}.label.u32"), &(i as u32 * 3).to_le_bytes());
        }
        let p = dir.join(format!("shard-{s}.tar"));
        std::fs::write(&p, t.finish()).unwrap();
        paths.push(p);
    }
    paths
}

#[test]
fn webdataset_members_are_decoded_by_webdatasets_conventions() {
    let dir = tempfile::tempdir().unwrap();
    let paths = write_shards(dir.path());
    let d = WebDataset::open_with(&paths, options(dir.path(), &[])).unwrap();
    let kind = |name: &str| {
        d.schema().fields()[d.schema().index_of(name).unwrap()]
            .kind
            .clone()
    };
    for name in ["cls", "cls2", "id", "index", "inx"] {
        assert_eq!(kind(name), tensor(DType::I64, &[]), "{name}");
    }
    assert_eq!(kind("x.npy"), tensor(DType::F32, &[2, 3]));
    assert_eq!(kind("v.npy"), FieldKind::Bytes { codec: Codec::Npy });
    assert_eq!(kind("txt"), FieldKind::Bytes { codec: Codec::Utf8 });
    assert_eq!(kind("json"), FieldKind::Bytes { codec: Codec::Json });
    assert_eq!(kind("label.u32"), FieldKind::Bytes { codec: Codec::Raw });
    assert_eq!(d.len(), 5);
    for i in 0..5u64 {
        let s = d.get(i).unwrap();
        let int = |name: &str| s.field_as::<i64>(name).unwrap()[0];
        assert_eq!(
            (int("cls"), int("cls2"), int("id"), int("index"), int("inx")),
            (i as i64, i as i64 * 10, -(i as i64), 1000, 7)
        );
        assert_eq!(*s.field_as::<f32>("x.npy").unwrap(), [i as f32; 6]);
        let v = s.field_named("v.npy").unwrap();
        assert_eq!(v, npy(DType::U8, &[i + 1], &vec![i as u8; i as usize + 1]));
        assert_eq!(
            s.field_named("txt").unwrap(),
            format!("caption {i} é").as_bytes()
        );
        assert_eq!(
            s.field_named("json").unwrap(),
            format!("{{\"i\": {i}}}").as_bytes()
        );
    }
}

#[test]
fn fixed_fields_of_webdataset_shards_batch_through_the_loader() {
    let dir = tempfile::tempdir().unwrap();
    let paths = write_shards(dir.path());
    let d = WebDataset::open_with(&paths, options(dir.path(), &[("label.u32", "u32[]")])).unwrap();
    let mut loader = Loader::builder(d)
        .batch_size(5)
        .workers(2)
        .transform(CopyFields::named(["cls", "x.npy", "label.u32"]))
        .build()
        .unwrap();
    let batch = loader.next().unwrap().unwrap();
    assert_eq!(*batch.field::<i64>("cls").unwrap(), [0, 1, 2, 3, 4]);
    assert_eq!(*batch.field::<u32>("label.u32").unwrap(), [0, 3, 6, 9, 12]);
    let x = batch.field::<f32>("x.npy").unwrap();
    assert_eq!(x.len(), 30);
    for (i, row) in x.chunks(6).enumerate() {
        assert_eq!(row, [i as f32; 6]);
    }
}

#[test]
fn declared_fields_override_the_conventions_and_unknown_names_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let paths = write_shards(dir.path());
    let d = WebDataset::open_with(
        &paths,
        options(
            dir.path(),
            &[("cls", "raw"), ("x.npy", "npy"), ("v.npy", "npy")],
        ),
    )
    .unwrap();
    let s = d.get(4).unwrap();
    assert_eq!(s.field_named("cls").unwrap(), b"4");
    assert!(s.field_named("x.npy").unwrap().starts_with(b"\x93NUMPY"));
    let e = WebDataset::open_with(&paths, options(dir.path(), &[("nope", "int")])).unwrap_err();
    assert!(matches!(e, Error::InvalidConfig { .. }), "{e:?}");
    assert!(e.to_string().contains("nope"), "{e}");
    // A tensor declared of another size than the member's: the sample is refused.
    let d = WebDataset::open_with(&paths, options(dir.path(), &[("label.u32", "u64[]")])).unwrap();
    let e = d.get(0).unwrap_err();
    assert!(matches!(e, Error::BadMember { .. }), "{e:?}");
    assert!(e.to_string().contains("label.u32"), "{e}");
}

/// A one-shard data set of samples `d/sNNN` with these members.
fn one_shard(dir: &Path, members: &[(&str, &[u8])]) -> PathBuf {
    let mut t = TarBuilder::new();
    for (name, data) in members {
        t.file(name, data);
    }
    let p = dir.join("one.tar");
    std::fs::write(&p, t.finish()).unwrap();
    p
}

fn bad_member(e: &Error, shard: &Path, want_member: &str, needle: &str) {
    match e {
        Error::BadMember {
            shard: s,
            member,
            what,
            ..
        } => {
            assert_eq!(s, shard);
            assert_eq!(member, want_member);
            assert!(what.contains(needle), "{what:?} lacks {needle:?}");
        }
        other => panic!("expected BadMember, got {other:?}"),
    }
}

#[test]
fn members_that_do_not_decode_are_errors_naming_shard_member_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let p = one_shard(
        dir.path(),
        &[
            ("a.cls", b"1"),
            ("a.txt", b"ok"),
            ("b.cls", b"one"),
            ("b.txt", b"ok"),
        ],
    );
    let d = WebDataset::open_with(&[&p], options(dir.path(), &[])).unwrap();
    d.get(0).unwrap();
    let e = d.get(1).unwrap_err();
    bad_member(&e, &p, "b.cls", "field `cls`: `one` is not an integer");

    let p = one_shard(dir.path(), &[("a.cls", b"99999999999999999999")]);
    let d = WebDataset::open_with(&[&p], options(dir.path(), &[])).unwrap();
    bad_member(
        &d.get(0).unwrap_err(),
        &p,
        "a.cls",
        "does not fit in an i64",
    );

    let p = one_shard(dir.path(), &[("a.txt", b"caf\xe9")]);
    let d = WebDataset::open_with(&[&p], options(dir.path(), &[])).unwrap();
    bad_member(
        &d.get(0).unwrap_err(),
        &p,
        "a.txt",
        "not UTF-8 text (at byte 3)",
    );

    // A .npy of the first shard's shape everywhere but in the second shard.
    let first = npy(DType::F32, &[2], &f32s(&[1.0, 2.0]));
    let other = npy(DType::F32, &[3], &f32s(&[1.0, 2.0, 3.0]));
    let a = dir.path().join("a.tar");
    let b = dir.path().join("b.tar");
    std::fs::write(&a, TarBuilder::new().file("s0.x.npy", &first).finish()).unwrap();
    std::fs::write(&b, TarBuilder::new().file("s1.x.npy", &other).finish()).unwrap();
    let d = WebDataset::open_with(&[&a, &b], options(dir.path(), &[])).unwrap();
    assert_eq!(
        d.schema().fields()[0].kind,
        tensor(DType::F32, &[2]),
        "inferred from the first shard"
    );
    bad_member(
        &d.get(1).unwrap_err(),
        &b,
        "s1.x.npy",
        "is f32[3], the field is f32[2]",
    );
    // A member that is no .npy at all is refused when the first shard is read for its shape.
    let p = one_shard(dir.path(), &[("a.x.npy", b"not an array")]);
    let e = WebDataset::open_with(&[&p], options(dir.path(), &[])).unwrap_err();
    assert!(matches!(e, Error::BadMember { .. }), "{e:?}");
    assert!(e.to_string().contains("not a readable .npy"), "{e}");
}

/// Writes a one-shard MDS data set as mosaicml-streaming's `MDSWriter` lays it out: columns
/// (name, encoding, fixed size), sorted by name, and each sample's values in column order.
pub(crate) fn write_mds(
    dir: &Path,
    columns: &[(&str, &str, Option<u64>)],
    samples: &[Vec<Vec<u8>>],
) {
    let names: Vec<&str> = columns.iter().map(|c| c.0).collect();
    let encodings: Vec<&str> = columns.iter().map(|c| c.1).collect();
    let sizes: Vec<Option<u64>> = columns.iter().map(|c| c.2).collect();
    let config = serde_json::json!({
        "column_names": names, "column_encodings": encodings, "column_sizes": sizes,
        "compression": null, "format": "mds", "hashes": [], "size_limit": 1 << 26, "version": 2,
    })
    .to_string();
    let n = samples.len();
    let mut body = Vec::new();
    let mut offsets = Vec::new();
    let start = 4 + 4 * (n + 1) + config.len();
    for sample in samples {
        offsets.push((start + body.len()) as u32);
        for (v, c) in sample.iter().zip(columns) {
            if c.2.is_none() {
                body.extend((v.len() as u32).to_le_bytes());
            }
        }
        for v in sample {
            body.extend_from_slice(v);
        }
    }
    offsets.push((start + body.len()) as u32);
    let mut shard = (n as u32).to_le_bytes().to_vec();
    for o in offsets {
        shard.extend(o.to_le_bytes());
    }
    shard.extend_from_slice(config.as_bytes());
    shard.extend(body);
    std::fs::write(dir.join("shard.00000.mds"), &shard).unwrap();
    let index = serde_json::json!({"version": 2, "shards": [{
        "column_names": names, "column_encodings": encodings, "column_sizes": sizes,
        "compression": null, "format": "mds", "hashes": [], "samples": n,
        "size_limit": 1 << 26, "version": 2,
        "raw_data": {"basename": "shard.00000.mds", "bytes": shard.len(), "hashes": {}},
        "zip_data": null,
    }]});
    std::fs::write(dir.join("index.json"), index.to_string()).unwrap();
}

/// streaming's `ndarray:uint16` value of a 1-D array (its shape in a uint8).
fn ndarray_u16(v: &[u16]) -> Vec<u8> {
    let mut b = vec![1 << 2, v.len() as u8];
    b.extend(v.iter().flat_map(|x| x.to_le_bytes()));
    b
}

fn mds_columns() -> Vec<(&'static str, &'static str, Option<u64>)> {
    vec![
        ("f", "str_float", None),
        ("i", "str_int", None),
        ("m", "json", None),
        ("p", "pkl", None),
        ("s", "str", None),
        ("t", "ndarray:uint16", None),
    ]
}

fn mds_sample(i: u16, t: &[u16]) -> Vec<Vec<u8>> {
    vec![
        format!("{}.5", i).into_bytes(),
        format!("-{i}").into_bytes(),
        format!("{{\"i\": {i}}}").into_bytes(),
        b"\x80\x04K\x01.".to_vec(),
        format!("text {i}").into_bytes(),
        ndarray_u16(t),
    ]
}

fn mds_options(decode: &[(&str, &str)]) -> ShardOptions {
    ShardOptions {
        decode: decode
            .iter()
            .map(|(n, d)| (n.to_string(), d.parse().unwrap()))
            .collect(),
        ..ShardOptions::default()
    }
}

#[test]
fn mds_columns_are_decoded_by_streamings_conventions_and_pickles_refused() {
    let dir = tempfile::tempdir().unwrap();
    let samples: Vec<_> = (0..3)
        .map(|i| mds_sample(i, &[i, i + 1, i + 2, i + 3]))
        .collect();
    write_mds(dir.path(), &mds_columns(), &samples);
    let e = MdsDataset::open(dir.path()).unwrap_err();
    assert!(matches!(e, Error::Malformed { .. }), "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains("column `p`") && text.contains("pkl"),
        "{text}"
    );
    assert!(text.contains("declare it `raw`"), "{text}");

    let d =
        MdsDataset::open_with(dir.path(), mds_options(&[("p", "raw"), ("t", "u16[4]")])).unwrap();
    let kind = |name: &str| {
        d.schema().fields()[d.schema().index_of(name).unwrap()]
            .kind
            .clone()
    };
    assert_eq!(kind("f"), tensor(DType::F64, &[]));
    assert_eq!(kind("i"), tensor(DType::I64, &[]));
    assert_eq!(kind("m"), FieldKind::Bytes { codec: Codec::Json });
    assert_eq!(kind("s"), FieldKind::Bytes { codec: Codec::Utf8 });
    assert_eq!(kind("p"), FieldKind::Bytes { codec: Codec::Raw });
    assert_eq!(kind("t"), tensor(DType::U16, &[4]));
    for i in 0..3u16 {
        let s = d.get(u64::from(i)).unwrap();
        assert_eq!(*s.field_as::<f64>("f").unwrap(), [f64::from(i) + 0.5]);
        assert_eq!(*s.field_as::<i64>("i").unwrap(), [-i64::from(i)]);
        assert_eq!(*s.field_as::<u16>("t").unwrap(), [i, i + 1, i + 2, i + 3]);
        assert_eq!(s.field_named("p").unwrap(), b"\x80\x04K\x01.");
        assert_eq!(s.field_named("s").unwrap(), format!("text {i}").as_bytes());
    }
    // Without a declaration a variable ndarray column is its bytes, header kept.
    let d = MdsDataset::open_with(dir.path(), mds_options(&[("p", "raw")])).unwrap();
    let t = d.schema().index_of("t").unwrap();
    assert_eq!(
        d.schema().fields()[t].kind,
        FieldKind::Bytes { codec: Codec::Raw }
    );
    assert_eq!(
        d.get(1).unwrap().field(t).unwrap(),
        ndarray_u16(&[1, 2, 3, 4])
    );
    // Declarations of a column that is not there, or of a size a fixed column is not.
    let e =
        MdsDataset::open_with(dir.path(), mds_options(&[("p", "raw"), ("zz", "int")])).unwrap_err();
    assert!(matches!(e, Error::InvalidConfig { .. }), "{e:?}");
}

fn bad_record(e: &Error, record: u64, needle: &str) {
    match e {
        Error::BadRecord {
            path,
            record: r,
            what,
        } => {
            assert!(path.ends_with("shard.00000.mds"), "{path:?}");
            assert_eq!(*r, record);
            assert!(what.contains(needle), "{what:?} lacks {needle:?}");
        }
        other => panic!("expected BadRecord, got {other:?}"),
    }
}

#[test]
fn mds_values_that_do_not_decode_are_errors_naming_shard_sample_and_column() {
    let dir = tempfile::tempdir().unwrap();
    let mut samples: Vec<_> = (0..4).map(|i| mds_sample(i, &[1, 2, 3, 4])).collect();
    samples[1][1] = b"12x".to_vec();
    samples[2][4] = b"caf\xe9".to_vec();
    samples[3][5] = ndarray_u16(&[1, 2, 3]);
    write_mds(dir.path(), &mds_columns(), &samples);
    let d =
        MdsDataset::open_with(dir.path(), mds_options(&[("p", "raw"), ("t", "u16[4]")])).unwrap();
    d.get(0).unwrap();
    bad_record(
        &d.get(1).unwrap_err(),
        1,
        "column `i` (str_int): `12x` is not an integer",
    );
    bad_record(
        &d.get(2).unwrap_err(),
        2,
        "column `s` (str): not UTF-8 text",
    );
    bad_record(
        &d.get(3).unwrap_err(),
        3,
        "the ndarray value is u16[3], the field is u16[4]",
    );
}
