//! `source::Zip` over real sources: the two-level shuffle over a zip of two sharded sources
//! (its shards the common refinement of theirs), and what a zip forwards to its parts
//! (read-ahead through the loader, checksum verification, file-change checks).

use gpufeed::BatchStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use gpufeed::format::{DType, Field, ReadMode, ReadOptions, RecordFile, RecordWriter, Schema};
use gpufeed::source::shards::packed::{PackedShards, ShardWriter};
use gpufeed::source::{Zip, npy_header};
use gpufeed::{Concat, Dataset, Error, Loader, NpyArray, Result, Sample};

const MODES: [ReadMode; 2] = [ReadMode::Map, ReadMode::Pread];

/// `.npy` arrays of field `y`, u32 `7 * i` for global index `i`, in files of these sizes.
fn npy_parts(dir: &Path, sizes: &[u64]) -> Concat<NpyArray> {
    let mut start = 0u32;
    let parts = sizes
        .iter()
        .enumerate()
        .map(|(k, &n)| {
            let path = dir.join(format!("y-{k}.npy"));
            let mut b = npy_header(DType::U32, &[n]).unwrap();
            b.extend((start..start + n as u32).flat_map(|i| (7 * i).to_le_bytes()));
            start += n as u32;
            std::fs::write(&path, b).unwrap();
            NpyArray::open_as(&path, "y").unwrap()
        })
        .collect();
    Concat::new(parts).unwrap()
}

/// The shard (0, 1, ...) of each of `sizes.sum()` samples.
fn shard_of(sizes: &[u64]) -> Vec<usize> {
    sizes
        .iter()
        .enumerate()
        .flat_map(|(k, &n)| std::iter::repeat_n(k, n as usize))
        .collect()
}

/// A zip of packed shards (field `x`, u64 `i`, and padding that cuts them at 12 samples) and
/// `.npy` files of 20, 35, 25 and 40 samples (field `y`, u32 `7 * i`): shards cut in
/// different places. The two-level shuffle with windows of one shard reads every sample once
/// an epoch, each window (so each block) within one shard of each part.
#[test]
fn a_two_level_shuffle_over_a_zip_of_sharded_sources_keeps_to_every_part_s_shards() {
    let dir = tempfile::tempdir().unwrap();
    let schema = Schema::new(vec![
        Field::tensor("x", DType::U64, &[]),
        Field::tensor("pad", DType::U8, &[200]),
    ])
    .unwrap();
    let mut w = ShardWriter::create(dir.path().join("x"), schema, 3 << 10).unwrap();
    for i in 0..120u64 {
        w.append(&[&i.to_le_bytes(), &[i as u8; 200]]).unwrap();
    }
    w.finish().unwrap();
    let x = PackedShards::open(dir.path().join("x")).unwrap();
    let y = npy_parts(dir.path(), &[20, 35, 25, 40]);
    let x_sizes = Dataset::shard_sizes(&x).unwrap();
    let y_sizes = y.shard_sizes().unwrap();
    assert_eq!(x_sizes, [12; 10]);
    let (x, y): (Box<dyn Dataset>, Box<dyn Dataset>) = (Box::new(x), Box::new(y));
    let data = Arc::new(Zip::new([("x/", x), ("y-*.npy", y)]).unwrap());
    // Boundaries 12 24 36 48 60 72 84 96 108 and 20 55 80, together.
    let sizes = data.shard_sizes().unwrap();
    assert_eq!(sizes, [12, 8, 4, 12, 12, 7, 5, 12, 8, 4, 12, 12, 12]);
    let (zip_shard, x_shard, y_shard) = (shard_of(&sizes), shard_of(&x_sizes), shard_of(&y_sizes));
    for block in [4, 5] {
        let mut loader = Loader::builder_shared(data.clone())
            .batch_size(8)
            .shuffle(11)
            .shuffle_blocks(1, block)
            .workers(3)
            .build()
            .unwrap();
        let mut epochs = Vec::new();
        for epoch in 0..3 {
            loader.set_epoch(epoch);
            let mut order = Vec::new();
            for b in loader.by_ref() {
                let b = b.unwrap();
                let x = b.field::<u64>("x").unwrap();
                let y = b.field::<u32>("y").unwrap();
                assert_eq!(b.indices(), x, "batch {}", b.number());
                // The fields of one sample come from one index of each part.
                assert!(x.iter().zip(y).all(|(&x, &y)| u64::from(y) == 7 * x));
                order.extend_from_slice(x);
            }
            let mut sorted = order.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..120).collect::<Vec<_>>(), "epoch {epoch}");
            // Windows of one shard: each shard of the zip is one run of the epoch's order,
            // and all its samples are in one shard of each part.
            let runs = order.chunk_by(|&a, &b| zip_shard[a as usize] == zip_shard[b as usize]);
            let mut seen = Vec::new();
            for run in runs {
                let s = zip_shard[run[0] as usize];
                assert!(
                    !seen.contains(&s),
                    "epoch {epoch}: shard {s} read in two runs"
                );
                seen.push(s);
                assert_eq!(run.len() as u64, sizes[s], "epoch {epoch}: shard {s}");
                for part in [&x_shard, &y_shard] {
                    let first = part[run[0] as usize];
                    assert!(
                        run.iter().all(|&i| part[i as usize] == first),
                        "epoch {epoch}: run {run:?} crosses a part's shards"
                    );
                }
                // Within a shard, blocks of `block` consecutive samples.
                assert!(
                    run.chunk_by(|&a, &b| b == a + 1)
                        .all(|r| r.len() as u64 >= block || r.len() as u64 == sizes[s] % block),
                    "epoch {epoch}: shard {s} not read in blocks of {block}: {run:?}"
                );
            }
            epochs.push(order);
        }
        assert_ne!(epochs[0], epochs[1]);
    }
    // A zip none of whose parts has shards has none: the two-level shuffle is refused.
    let flat = Zip::new([
        (
            "a.npy",
            NpyArray::open_as(dir.path().join("y-0.npy"), "a").unwrap(),
        ),
        (
            "b.npy",
            NpyArray::open_as(dir.path().join("y-0.npy"), "b").unwrap(),
        ),
    ])
    .unwrap();
    assert_eq!(flat.shard_sizes(), None);
    let refused = Loader::builder(flat)
        .shuffle(1)
        .shuffle_blocks(1, 2)
        .build();
    assert!(matches!(
        refused,
        Err(Error::InvalidConfig {
            setting: "shuffle_window",
            ..
        })
    ));
}

/// A part that asks to hear `ahead` batches ahead and records what it hears.
struct Listening {
    inner: NpyArray,
    ahead: usize,
    heard: Mutex<Vec<u64>>,
}

impl Dataset for Listening {
    fn len(&self) -> u64 {
        self.inner.len()
    }
    fn schema(&self) -> &Schema {
        self.inner.schema()
    }
    fn get(&self, index: u64) -> Result<Sample<'_>> {
        self.inner.get(index)
    }
    fn read_ahead_batches(&self) -> usize {
        self.ahead
    }
    fn read_ahead(&self, indices: &[u64]) {
        self.heard.lock().unwrap().extend_from_slice(indices);
    }
}

/// The loader asks a zip how far ahead to announce (the furthest any part asks) and every
/// part hears every announcement, the part that asked for none included.
#[test]
fn every_part_of_a_zip_hears_what_the_loader_reads_ahead() {
    let dir = tempfile::tempdir().unwrap();
    let listening = |name: &str, ahead: usize| {
        let path = dir.path().join(format!("{name}.npy"));
        let mut b = npy_header(DType::U32, &[95]).unwrap();
        b.extend((0..95u32).flat_map(u32::to_le_bytes));
        std::fs::write(&path, b).unwrap();
        Listening {
            inner: NpyArray::open_as(&path, name).unwrap(),
            ahead,
            heard: Mutex::new(Vec::new()),
        }
    };
    let data = Arc::new(Zip::new([("a", listening("a", 3)), ("b", listening("b", 0))]).unwrap());
    assert_eq!(data.read_ahead_batches(), 3);
    let mut l = Loader::builder_shared(data.clone())
        .batch_size(10)
        .shuffle(8)
        .workers(2)
        .prefetch(2)
        .prefetch_across_epochs(false)
        .build()
        .unwrap();
    let order: Vec<u64> = l
        .by_ref()
        .flat_map(|b| b.unwrap().indices().to_vec())
        .collect();
    let heard: Vec<Vec<u64>> = data
        .parts()
        .iter()
        .map(|p| p.heard.lock().unwrap().clone())
        .collect();
    // What is announced is the rest of the epoch's order, from some batch on, once each.
    assert!(!heard[0].is_empty());
    assert!(order.ends_with(&heard[0]), "{heard:?} of {order:?}");
    assert_eq!(heard[0], heard[1]);
}

/// A packed file of 20 records, record `i` of bytes `0x40 + i`, and `.npy` labels beside it.
fn packed_and_labels(dir: &Path) -> (PathBuf, PathBuf) {
    let packed = dir.join("images.gfd");
    let schema = Schema::new(vec![Field::tensor("image", DType::U8, &[32])]).unwrap();
    let mut w = RecordWriter::create(&packed, schema).unwrap();
    for i in 0..20u8 {
        w.append(&[&[0x40 + i; 32]]).unwrap();
    }
    w.finish().unwrap();
    let labels = dir.join("labels.npy");
    let mut b = npy_header(DType::U32, &[20]).unwrap();
    b.extend((0..20u32).flat_map(u32::to_le_bytes));
    std::fs::write(&labels, b).unwrap();
    (packed, labels)
}

/// A part opened to verify checksums verifies them under the zip: a record overwritten in
/// place is a `ChecksumMismatch` naming the file and record, from `get` and from the loader.
#[test]
fn a_zipped_part_that_verifies_checksums_refuses_a_rewritten_record() {
    let dir = tempfile::tempdir().unwrap();
    let (packed, labels) = packed_and_labels(dir.path());
    let mut bytes = std::fs::read(&packed).unwrap();
    let at = bytes
        .windows(32)
        .position(|w| w == [0x49; 32])
        .expect("record 9 is in the file");
    bytes[at + 5] ^= 0xff;
    std::fs::write(&packed, bytes).unwrap();
    for mode in MODES {
        for verify in [false, true] {
            let options = ReadOptions {
                mode,
                verify_checksums: verify,
            };
            let zip = |packed: &Path| {
                let images: Box<dyn Dataset> =
                    Box::new(RecordFile::open_with(packed, options).unwrap());
                let labels: Box<dyn Dataset> =
                    Box::new(NpyArray::open_as(&labels, "label").unwrap());
                Zip::new([("images.gfd", images), ("labels.npy", labels)]).unwrap()
            };
            let data = zip(&packed);
            data.get(8).unwrap();
            let got = data.get(9);
            if !verify {
                // Unverified, the new bytes are read (as documented).
                let image = got.unwrap().field(0).unwrap().to_vec();
                assert_eq!(image[5], !0x49, "{mode:?}");
                continue;
            }
            let e = got.unwrap_err();
            assert!(
                matches!(&e, Error::ChecksumMismatch { path, record: 9, .. } if path == &packed),
                "{mode:?}: {e}"
            );
            let results: Vec<_> = Loader::builder(data)
                .batch_size(5)
                .workers(2)
                .build()
                .unwrap()
                .collect();
            assert_eq!(results.len(), 4);
            let Err(Error::Sample {
                index: 9, source, ..
            }) = &results[1]
            else {
                panic!("{mode:?}: batch 1 is {:?}", results[1].as_ref().map(|_| ()))
            };
            assert!(
                matches!(source.as_ref(), Error::ChecksumMismatch { record: 9, .. }),
                "{source}"
            );
            assert!([0, 2, 3].iter().all(|&k| results[k].is_ok()));
        }
    }
}

/// A zip checks the files of every part between epochs: a `.npy` replaced under it (as
/// `np.save` to a temporary and a rename does) fails the next epoch, naming that file.
#[test]
fn a_part_s_file_replaced_under_a_zip_fails_the_next_epoch_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let (packed, labels) = packed_and_labels(dir.path());
    for mode in MODES {
        let options = ReadOptions {
            mode,
            ..Default::default()
        };
        let images: Box<dyn Dataset> = Box::new(RecordFile::open_with(&packed, options).unwrap());
        let label_part: Box<dyn Dataset> =
            Box::new(NpyArray::open_with(&labels, "label", mode).unwrap());
        let data =
            Arc::new(Zip::new([("images.gfd", images), ("labels.npy", label_part)]).unwrap());
        data.check_unchanged().unwrap();
        let mut l = Loader::builder_shared(data.clone())
            .batch_size(5)
            .workers(2)
            .build()
            .unwrap();
        assert_eq!(l.by_ref().filter(|b| b.is_ok()).count(), 4);
        // Replace the labels, as np.save to a temporary then a rename.
        let tmp = dir.path().join("labels.npy.tmp");
        std::fs::copy(&labels, &tmp).unwrap();
        std::fs::rename(&tmp, &labels).unwrap();
        match data.check_unchanged() {
            Err(Error::FileChanged { path, .. }) => assert_eq!(path, labels, "{mode:?}"),
            other => panic!("{mode:?}: expected labels.npy changed, got {other:?}"),
        }
        l.set_epoch(1);
        let e = l.next().unwrap().unwrap_err();
        assert!(matches!(e, Error::FileChanged { .. }), "{mode:?}: {e}");
        assert!(e.to_string().contains("labels.npy"), "{e}");
    }
}
