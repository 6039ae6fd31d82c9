//! Shards written by the real Python packages (webdataset's ShardWriter, Python's tarfile,
//! mosaicml-streaming's MDSWriter: `tests/fixtures/make_streaming_fixtures.py`) read back
//! through gpufeed, every sample and field compared with what the packages' own readers gave
//! (`tests/fixtures/streaming/manifest.json`: each value's length and xxh3-64).

use gpufeed::BatchStream;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use gpufeed::format::{Codec, DType, FieldKind};
use gpufeed::source::shards::ShardOptions;
use gpufeed::source::shards::mds::{MdsDataset, decode_ndarray};
use gpufeed::source::shards::webdataset::{
    MissingFieldPolicy, TarIndex, UnkeyedPolicy, WebDataset, WebDatasetOptions,
};
use gpufeed::{Dataset, Error};
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/streaming")
}

fn manifest() -> Value {
    let text = std::fs::read(fixtures().join("manifest.json")).unwrap();
    serde_json::from_slice(&text).unwrap()
}

/// Checks `bytes` against a manifest entry `{"len": n, "xxh3_64": hex}`.
fn same(bytes: &[u8], want: &Value, what: &str) {
    assert_eq!(
        bytes.len() as u64,
        want["len"].as_u64().unwrap(),
        "{what}: length"
    );
    assert_eq!(
        format!("{:016x}", xxhash_rust::xxh3::xxh3_64(bytes)),
        want["xxh3_64"].as_str().unwrap(),
        "{what}: bytes"
    );
}

fn options(cache: &Path) -> WebDatasetOptions {
    WebDatasetOptions {
        cache_dir: Some(cache.to_path_buf()),
        ..WebDatasetOptions::default()
    }
}

#[test]
fn webdataset_shard_writer_output_reads_back_byte_identical() {
    let m = manifest();
    let cache = tempfile::tempdir().unwrap();
    let pattern = fixtures().join("wds/shard-{000000..000001}.tar");
    let d = gpufeed::source::open(
        pattern.to_str().unwrap(),
        &gpufeed::source::OpenOptions {
            shards: options(cache.path()).clone(),
            ..Default::default()
        },
    )
    .unwrap();
    let samples = m["wds"]["samples"].as_array().unwrap();
    assert_eq!(d.len(), samples.len() as u64);
    assert_eq!(d.shard_sizes(), Some(vec![3, 2]));
    let names: Vec<&str> = d
        .schema()
        .fields()
        .iter()
        .map(|f| f.name.as_str())
        .collect();
    assert_eq!(names, ["cls", "jpg", "seg.png", "txt"]);
    // webdataset's decoders: `cls` is an integer (`str(int)`), the rest bytes.
    let kinds: Vec<FieldKind> = d.schema().fields().iter().map(|f| f.kind.clone()).collect();
    let bytes = |codec| FieldKind::Bytes { codec };
    assert_eq!(
        kinds,
        [
            FieldKind::Tensor {
                dtype: DType::I64,
                shape: vec![]
            },
            bytes(Codec::Jpeg),
            bytes(Codec::Png),
            bytes(Codec::Utf8)
        ]
    );
    for (i, want) in samples.iter().enumerate() {
        let s = d.get(i as u64).unwrap();
        let fields = want["fields"].as_object().unwrap();
        assert_eq!(fields.len(), d.schema().fields().len());
        for (name, v) in fields {
            if name == "cls" {
                // The member held this text (its digest is the manifest's), read as its value.
                let class = i as i64 % 3;
                same(class.to_string().as_bytes(), v, &format!("sample {i} cls"));
                assert_eq!(*s.field_as::<i64>("cls").unwrap(), [class]);
                continue;
            }
            let got = s.field_named(name).unwrap();
            same(got, v, &format!("sample {i} field {name}"));
        }
        let at = d.sharded().unwrap().locate(i as u64).unwrap();
        assert_eq!(
            d.sharded().unwrap().shard_names()[at.shard]
                .rsplit('/')
                .next()
                .unwrap(),
            want["shard"].as_str().unwrap()
        );
    }
    // The keys, through the concrete type.
    let w = WebDataset::open_with(
        &[
            fixtures().join("wds/shard-000000.tar"),
            fixtures().join("wds/shard-000001.tar"),
        ],
        options(cache.path()),
    )
    .unwrap();
    for (i, want) in samples.iter().enumerate() {
        assert_eq!(w.key(i as u64).unwrap(), want["key"].as_str().unwrap());
    }
    // The second dataset read both indexes from the cache at open, and again when key()
    // opened each shard.
    let stats = w.format().index_stats();
    assert_eq!((stats.builds, stats.cache_hits), (0, 4), "{stats:?}");
    w.verify(|_| {}).unwrap();
}

/// Keys, grouping and skipped members match webdataset's own `tarfile_samples` over archives
/// whose names exercise its rules (pax and GNU formats).
#[test]
fn key_rules_match_webdataset_on_tricky_names() {
    let m = manifest();
    for format in ["pax", "gnu"] {
        let path = fixtures().join(format!("names/{format}.tar"));
        let bytes = std::fs::read(&path).unwrap();
        let index = TarIndex::build(&path, &bytes, UnkeyedPolicy::Skip).unwrap();
        let want = m["names"][format]["samples"].as_array().unwrap();
        assert_eq!(index.len(), want.len() as u64, "{format}");
        // README and dir/noext have no extension.
        assert_eq!(index.skipped_members(), 2, "{format}");
        for (i, w) in want.iter().enumerate() {
            assert_eq!(
                index.key(i).unwrap(),
                w["key"].as_str().unwrap().as_bytes(),
                "{format} sample {i}"
            );
            let members = index.members(i).unwrap();
            let got: BTreeMap<&str, &[u8]> = members
                .iter()
                .map(|mb| {
                    (
                        index.extensions()[mb.ext as usize].as_str(),
                        &bytes[mb.offset as usize..(mb.offset + mb.size) as usize],
                    )
                })
                .collect();
            let fields = w["fields"].as_object().unwrap();
            assert_eq!(
                got.keys().copied().collect::<Vec<_>>(),
                fields.keys().map(String::as_str).collect::<Vec<_>>(),
                "{format} sample {i}"
            );
            for (ext, v) in fields {
                same(got[ext.as_str()], v, &format!("{format} sample {i} .{ext}"));
            }
        }
        // As a dataset: the first shard's extensions are the fields, and sample `v1.2/item`
        // lacks most of them.
        let cache = tempfile::tempdir().unwrap();
        let e = WebDataset::open_with(&[&path], options(cache.path())).unwrap_err();
        match &e {
            Error::MissingField { shard, key, field } => {
                assert_eq!(shard, &path);
                assert_eq!(key, "v1.2/item");
                assert_eq!(field, "cls");
            }
            other => panic!("{other:?}"),
        }
        // Declared fields, samples without them skipped and counted.
        let d = WebDataset::open_with(
            &[&path],
            WebDatasetOptions {
                fields: Some(vec!["txt".into()]),
                missing: MissingFieldPolicy::Skip,
                ..options(cache.path())
            },
        )
        .unwrap();
        assert_eq!(d.len(), 3, "a, b and the long name have a txt");
        assert_eq!(d.skipped_samples(), 3);
        assert_eq!(d.skipped_members(), 2);
        assert_eq!(d.key(2).unwrap(), want[5]["key"].as_str().unwrap());
        same(
            d.get(1).unwrap().field(0).unwrap(),
            &want[3]["fields"]["txt"],
            "b.txt",
        );
        // Members without an extension refused on request.
        let e = WebDataset::open_with(
            &[&path],
            WebDatasetOptions {
                fields: Some(vec!["txt".into()]),
                missing: MissingFieldPolicy::Skip,
                unkeyed: UnkeyedPolicy::Error,
                cache_dir: Some(tempfile::tempdir().unwrap().path().to_path_buf()),
                ..WebDatasetOptions::default()
            },
        )
        .unwrap_err();
        match &e {
            Error::BadMember { shard, member, .. } => {
                assert_eq!(shard, &path);
                assert_eq!(member, "README");
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn mds_writer_output_reads_back_byte_identical() {
    let m = manifest();
    let dir = fixtures().join("mds");
    let d = MdsDataset::open(&dir).unwrap();
    let samples = m["mds"]["samples"].as_array().unwrap();
    assert_eq!(d.len(), samples.len() as u64);
    assert_eq!(d.shard_sizes(), &[2, 2, 2, 1]);
    let schema = d.schema();
    let kind = |name: &str| schema.fields()[schema.index_of(name).unwrap()].kind.clone();
    let tensor = |dtype, shape: &[u64]| FieldKind::Tensor {
        dtype,
        shape: shape.to_vec(),
    };
    let bytes = |codec| FieldKind::Bytes { codec };
    assert_eq!(kind("id"), tensor(DType::I64, &[]));
    assert_eq!(kind("i8"), tensor(DType::I8, &[]));
    assert_eq!(kind("u64"), tensor(DType::U64, &[]));
    assert_eq!(kind("f16"), tensor(DType::F16, &[]));
    assert_eq!(kind("fixed"), tensor(DType::I16, &[2, 3]));
    assert_eq!(kind("img"), bytes(Codec::Jpeg));
    assert_eq!(kind("mask"), bytes(Codec::Png));
    assert_eq!(kind("name"), bytes(Codec::Utf8));
    assert_eq!(kind("meta"), bytes(Codec::Json));
    assert_eq!(kind("raw"), bytes(Codec::Raw));
    assert_eq!(kind("dyn"), bytes(Codec::Raw));
    for (i, want) in samples.iter().enumerate() {
        let s = d.get(i as u64).unwrap();
        for (name, v) in want["fields"].as_object().unwrap() {
            same(
                s.field_named(name).unwrap(),
                v,
                &format!("sample {i} column {name}"),
            );
        }
        // Values, decoded by hand, are what the script wrote.
        let id = i64::from_le_bytes(s.field_named("id").unwrap().try_into().unwrap());
        assert_eq!(id, i as i64 * 1000 - 3);
        let u64v = u64::from_le_bytes(s.field_named("u64").unwrap().try_into().unwrap());
        assert_eq!(u64v, u64::MAX - i as u64);
        assert_eq!(
            std::str::from_utf8(s.field_named("name").unwrap()).unwrap(),
            format!("sample {i} é")
        );
        let fixed: Vec<i16> = s
            .field_named("fixed")
            .unwrap()
            .chunks(2)
            .map(|c| i16::from_le_bytes([c[0], c[1]]))
            .collect();
        assert_eq!(
            fixed,
            (0..6).map(|v| v * (i as i16 + 1)).collect::<Vec<_>>()
        );
        let dyn_ = decode_ndarray("ndarray", s.field_named("dyn").unwrap()).unwrap();
        assert_eq!(dyn_.shape, vec![i as u64 + 1]);
        assert_eq!(dyn_.dtype, if i % 2 == 1 { DType::U8 } else { DType::I64 });
        let dyn_t = decode_ndarray("ndarray:float32", s.field_named("dyn_t").unwrap()).unwrap();
        assert_eq!(dyn_t.shape, vec![i as u64 % 3 + 1, 2]);
    }
    // The index's xxh64 and xxh3_64 hashes of every shard, and every sample.
    d.verify(|_| {}).unwrap();
    let v = MdsDataset::open_with(
        &dir,
        ShardOptions {
            verify: true,
            ..ShardOptions::default()
        },
    )
    .unwrap();
    assert!(v.get(6).is_ok());
}

#[test]
fn source_open_recognises_each_kind_of_shard_set() {
    let d = gpufeed::source::open(fixtures().join("mds"), &Default::default()).unwrap();
    assert_eq!(d.len(), 7);
    // Tar shards through the same recognition, with the index cache in a temporary directory
    // (gpufeed::source::open would use the user's cache directory).
    let cache = tempfile::tempdir().unwrap();
    let open = |spec: &str| {
        gpufeed::source::open(
            spec,
            &gpufeed::source::OpenOptions {
                shards: options(cache.path()).clone(),
                ..Default::default()
            },
        )
        .unwrap()
    };
    assert_eq!(open(fixtures().join("wds").to_str().unwrap()).len(), 5);
    assert_eq!(
        open(fixtures().join("wds/shard-000001.tar").to_str().unwrap()).len(),
        2
    );
    let spec = format!(
        "{}::{}",
        fixtures().join("wds/shard-000001.tar").display(),
        fixtures().join("wds/shard-{000000..000000}.tar").display()
    );
    assert_eq!(open(&spec).shard_sizes(), Some(vec![2, 3]));
    use gpufeed::source::{Format, detect};
    assert_eq!(detect("x-{0..3}.tar").unwrap(), Format::WebDataset);
    assert!(detect("plain.gfd").is_err());
}

/// MDSWriter's output with `hashes=['sha1', 'xxh3_64', 'xxh64']`, one byte of a sample flipped
/// inside a shard (the file's size unchanged): the shard is checked against the index's hashes
/// when it is opened, so no sample of it is handed out; an error names the shard, and the
/// loader's the sample asked for. With `xxh64` alone in the index, the same. (Before, the
/// flipped byte was delivered: only `verify` and `inspect --verify` looked at the hashes.)
#[test]
fn a_flipped_byte_in_a_local_mds_shard_with_hashes_is_refused_before_its_samples() {
    use gpufeed::{CopyFields, Loader};
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixtures().join("mds")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    let victim = dir.path().join("shard.00001.mds");
    let intact = std::fs::read(&victim).unwrap();
    // The last byte of the shard: the last sample's `u64` column.
    let mut flipped = intact.clone();
    *flipped.last_mut().unwrap() ^= 0x10;
    let refused = |e: &Error| match e {
        Error::Malformed { path, what, .. } => {
            assert_eq!(path, &victim, "{e}");
            assert!(what.contains("the index says"), "{e}");
        }
        other => panic!("not a hash mismatch naming the shard: {other:?}"),
    };
    for only_xxh64 in [false, true] {
        if only_xxh64 {
            let index = dir.path().join("index.json");
            let mut v: Value = serde_json::from_slice(&std::fs::read(&index).unwrap()).unwrap();
            for s in v["shards"].as_array_mut().unwrap() {
                let hashes = s["raw_data"]["hashes"].as_object_mut().unwrap();
                hashes.remove("xxh3_64");
                hashes.remove("sha1");
            }
            std::fs::write(&index, serde_json::to_vec(&v).unwrap()).unwrap();
        }
        std::fs::write(&victim, &flipped).unwrap();
        let d = MdsDataset::open(dir.path()).unwrap();
        assert_eq!(d.shard_sizes(), &[2, 2, 2, 1]);
        assert!(d.get(1).is_ok(), "shard 0 is intact");
        for i in [2, 3] {
            let e = d.get(i).map(|_| ()).unwrap_err();
            refused(&e);
            // The first hash that disagrees is named.
            assert!(e.to_string().contains("the file's xxh64 is"), "{e}");
        }
        assert!(d.get(4).is_ok(), "shard 2 is intact");
        // Through the loader: the batch of sample 3 fails, naming the sample and the shard.
        let mut loader = Loader::builder(MdsDataset::open(dir.path()).unwrap())
            .batch_size(1)
            .workers(1)
            .transform(CopyFields::named(["id", "u64"]))
            .build()
            .unwrap();
        let results: Vec<_> = loader.by_ref().collect();
        assert_eq!(results.len(), 7);
        for (i, r) in results.iter().enumerate() {
            match (i, r) {
                (2 | 3, Err(Error::Sample { index, source, .. })) => {
                    assert_eq!(*index, i as u64);
                    refused(source);
                }
                (2 | 3, other) => panic!("sample {i} of the flipped shard: {:?}", other.is_ok()),
                (_, r) => assert!(r.is_ok(), "sample {i}: {:?}", r.as_ref().err()),
            }
        }
        // Put back, the shard reads again.
        std::fs::write(&victim, &intact).unwrap();
        let d = MdsDataset::open(dir.path()).unwrap();
        assert!(d.get(3).is_ok());
    }
}

/// A shard that passed its hashes is not hashed again when it is opened again as the same
/// file, but is when its file changed since: with one shard open at a time, shard 1 passes,
/// is closed for shard 0, is written in place, and is refused when next opened.
#[test]
fn a_shard_written_after_it_passed_is_hashed_again_when_opened_again() {
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixtures().join("mds")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    let d = MdsDataset::open_with(
        dir.path(),
        ShardOptions {
            max_open_shards: 1,
            ..ShardOptions::default()
        },
    )
    .unwrap();
    assert!(d.get(2).is_ok());
    assert!(d.get(0).is_ok());
    assert!(d.get(3).is_ok(), "the same file again");
    assert!(d.get(0).is_ok());
    let victim = dir.path().join("shard.00001.mds");
    let mut bytes = std::fs::read(&victim).unwrap();
    *bytes.last_mut().unwrap() ^= 1;
    {
        use std::io::{Seek, SeekFrom, Write};
        let mut f = std::fs::File::options().write(true).open(&victim).unwrap();
        f.seek(SeekFrom::Start(bytes.len() as u64 - 1)).unwrap();
        f.write_all(&bytes[bytes.len() - 1..]).unwrap();
    }
    match d.get(3).map(|_| ()).unwrap_err() {
        Error::Malformed { path, what, .. } => {
            assert_eq!(path, victim);
            assert!(what.contains("the file's xxh64 is"), "{what}");
        }
        other => panic!("{other:?}"),
    }
    // Shard 1 was opened three times (the third failed, and is not counted), shard 0 twice.
    assert_eq!(d.open_stats().opens, 4);
}

/// The loader takes a sharded dataset like any other: MDS tensor columns batched as they are,
/// shuffled, over worker threads.
#[test]
fn the_loader_batches_mds_columns() {
    use gpufeed::{CopyFields, Loader};
    let d = MdsDataset::open(fixtures().join("mds")).unwrap();
    let mut loader = Loader::builder(d)
        .batch_size(3)
        .shuffle(7)
        .workers(2)
        .transform(CopyFields::named(["id", "fixed"]))
        .build()
        .unwrap();
    let mut ids = Vec::new();
    for batch in loader.by_ref() {
        let batch = batch.unwrap();
        let id: &[i64] = batch.field("id").unwrap();
        let fixed: &[i16] = batch.field("fixed").unwrap();
        assert_eq!(fixed.len(), id.len() * 6);
        for (k, &v) in id.iter().enumerate() {
            let i = (v + 3) / 1000;
            assert_eq!(fixed[6 * k + 5], 5 * (i as i16 + 1));
            ids.push(i);
        }
    }
    ids.sort();
    assert_eq!(ids, (0..7).collect::<Vec<_>>());
}

/// The loader's two-level shuffle takes the shard sizes of a sharded dataset: every sample
/// once per epoch, read shard window by shard window.
#[test]
fn the_loader_shuffles_webdataset_shards_in_blocks() {
    use gpufeed::{FnTransform, Loader, OutputField};
    let cache = tempfile::tempdir().unwrap();
    let d = WebDataset::open_with(
        &[
            fixtures().join("wds/shard-000000.tar"),
            fixtures().join("wds/shard-000001.tar"),
        ],
        options(cache.path()),
    )
    .unwrap();
    assert_eq!(Dataset::shard_sizes(&d), Some(vec![3, 2]));
    // One output: the sample's class digit (field `cls`), as a u8.
    let cls = d.schema().index_of("cls").unwrap();
    let mut loader = Loader::builder(d)
        .batch_size(1)
        .shuffle(3)
        .shuffle_blocks(1, 2)
        .workers(2)
        .transform(FnTransform::new(
            vec![OutputField::new("i", DType::U8, &[])],
            move |s: gpufeed::Sample<'_>,
                  ctx: &gpufeed::SampleContext,
                  slots: &mut gpufeed::Slots<'_>| {
                assert_eq!(s.field(cls).unwrap(), (ctx.index as i64 % 3).to_le_bytes());
                slots.field(0)?[0] = ctx.index as u8;
                Ok(())
            },
        ))
        .build()
        .unwrap();
    for epoch in 0..2 {
        loader.set_epoch(epoch);
        let mut seen: Vec<u8> = loader
            .by_ref()
            .map(|b| b.unwrap().field::<u8>("i").unwrap()[0])
            .collect();
        seen.sort();
        assert_eq!(seen, [0, 1, 2, 3, 4], "epoch {epoch}");
    }
}
