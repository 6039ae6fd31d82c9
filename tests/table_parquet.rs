//! Parquet data sets: every column kind read byte for byte, chunks of row groups, files,
//! directories and patterns, nulls, the shared chunk cache, and the windowed order.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};
use gpufeed::format::{Codec, FieldKind};
use gpufeed::source::ReadMode;
use gpufeed::source::table::{Fill, TableOptions, parquet};
use gpufeed::{BatchStream, CopyFields, Dataset, Error, ErrorKind, Loader, LoaderState};
use proptest::prelude::*;

use crate::table_common::{assert_rows, every_kind, write_parquet};

#[test]
fn reads_every_column_kind_byte_for_byte_across_groups_chunks_and_pages() {
    let dir = tempfile::tempdir().unwrap();
    let (a, mut want) = every_kind(0, 40, false);
    let (b, want_b) = every_kind(40, 13, false);
    for (w, (_, more)) in want.iter_mut().zip(want_b) {
        w.1.extend(more);
    }
    let p = dir.path().join("t.parquet");
    // Row groups of 11 rows, pages of 4, chunks of 3: chunks start inside pages.
    write_parquet(&p, &[a, b], 11, 4);
    let options = TableOptions {
        chunk_rows: Some(3),
        ..TableOptions::default()
    };
    let d = parquet::open(&p, &options).unwrap();
    assert_eq!(
        d.schema().fields()[d.schema().index_of("image").unwrap()].kind,
        FieldKind::Bytes { codec: Codec::Png },
        "the Image feature's struct is a PNG field"
    );
    assert_rows(&d, &want);
    // Backwards too: chunks decoded again after eviction give the same bytes.
    for r in (0..53u64).rev() {
        let s = d.get(r).unwrap();
        assert_eq!(s.field(0).unwrap(), (r as i64).to_le_bytes());
    }
    let chunks: Vec<u64> = d.chunks().map(|c| c.3).collect();
    assert_eq!(chunks.iter().sum::<u64>(), 53);
    assert!(chunks.iter().all(|&c| c <= 3));
    let summary = d.describe();
    assert_eq!(summary.rows, 53);
    assert_eq!(summary.files[0].groups, 5);
    assert_eq!(summary.files[0].compression, ["SNAPPY"]);
    assert_eq!(summary.chunks, chunks.len() as u64);
    let image = summary.columns.iter().find(|c| c.name == "image").unwrap();
    assert_eq!(image.field.as_deref(), Some("png bytes"));
}

fn ids(start: i64, n: i64) -> RecordBatch {
    let id: ArrayRef = Arc::new(Int64Array::from_iter_values(start..start + n));
    RecordBatch::try_from_iter([("id", id)]).unwrap()
}

#[test]
fn a_directory_and_a_pattern_are_their_files_in_name_order() {
    let dir = tempfile::tempdir().unwrap();
    write_parquet(
        &dir.path().join("train-00001-of-00002.parquet"),
        &[ids(10, 5)],
        2,
        2,
    );
    write_parquet(
        &dir.path().join("train-00000-of-00002.parquet"),
        &[ids(0, 10)],
        3,
        2,
    );
    write_parquet(
        &dir.path().join("test-00000-of-00001.parquet"),
        &[ids(100, 1)],
        3,
        2,
    );
    let all = parquet::open(dir.path(), &TableOptions::default()).unwrap();
    assert_eq!(all.len(), 16);
    let train =
        parquet::open(dir.path().join("train-*.parquet"), &TableOptions::default()).unwrap();
    let got: Vec<i64> = (0..train.len())
        .map(|i| i64::from_le_bytes(train.get(i).unwrap().field(0).unwrap().try_into().unwrap()))
        .collect();
    assert_eq!(got, (0..15).collect::<Vec<_>>());
    assert_eq!(train.describe().files.len(), 2);
    let e = parquet::open(dir.path().join("val-*.parquet"), &TableOptions::default()).unwrap_err();
    assert!(e.to_string().contains("no Parquet file"), "{e}");
}

#[test]
fn nulls_are_refused_with_file_row_and_column_unless_filled() {
    let dir = tempfile::tempdir().unwrap();
    let id: ArrayRef = Arc::new(Int64Array::from(vec![Some(1), None, Some(3)]));
    let text: ArrayRef = Arc::new(StringArray::from(vec![Some("a"), Some("b"), None]));
    let batch = RecordBatch::try_from_iter([("id", id), ("text", text)]).unwrap();
    let before: ArrayRef = Arc::new(StringArray::from(vec!["x"; 4]));
    let first =
        RecordBatch::try_from_iter([("id", ids(10, 4).column(0).clone()), ("text", before)])
            .unwrap();
    write_parquet(&dir.path().join("a.parquet"), &[first], 10, 10);
    let p = dir.path().join("b.parquet");
    write_parquet(&p, &[batch], 10, 10);
    let d = parquet::open(&p, &TableOptions::default()).unwrap();
    assert_eq!(d.get(0).unwrap().field(1).unwrap(), b"a");
    let e = d.get(1).unwrap_err();
    assert!(matches!(e, Error::BadRecord { record: 1, .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("b.parquet") && msg.contains("`id` is null"),
        "{msg}"
    );
    let filled = TableOptions {
        fill: BTreeMap::from([
            ("id".to_owned(), Fill::Int(-1)),
            ("text".to_owned(), Fill::Bytes(b"?".to_vec())),
        ]),
        ..TableOptions::default()
    };
    let d = parquet::open(&p, &filled).unwrap();
    assert_eq!(d.get(1).unwrap().field(0).unwrap(), (-1i64).to_le_bytes());
    assert_eq!(d.get(2).unwrap().field(1).unwrap(), b"?");
    assert_eq!(d.get(2).unwrap().field(0).unwrap(), 3i64.to_le_bytes());
    // A fill value of the wrong kind names the setting.
    let bad = TableOptions {
        fill: BTreeMap::from([("id".to_owned(), Fill::Bytes(vec![]))]),
        ..TableOptions::default()
    };
    let e = parquet::open(&p, &bad).unwrap_err();
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
    // In the directory, the row is named within its file and within the data set.
    let d = parquet::open(
        dir.path(),
        &TableOptions {
            columns: Some(vec!["id".into()]),
            ..TableOptions::default()
        },
    )
    .unwrap();
    let e = d.get(5).unwrap_err().to_string();
    assert_eq!(d.get(4).unwrap().field(0).unwrap(), 1i64.to_le_bytes());
    assert!(
        e.contains("record 1") && e.contains("row 5 of the data set"),
        "{e}"
    );
}

/// Reads `d` in order with 4 workers and checks every row came, in order.
fn read_ids_with_four_workers(d: &Arc<parquet::ParquetDataset>) {
    let mut loader = Loader::builder(Arc::clone(d) as Arc<dyn Dataset>)
        .batch_size(10)
        .workers(4)
        .transform(CopyFields::named(["id"]))
        .build()
        .unwrap();
    let got: Vec<i64> = loader
        .by_ref()
        .flat_map(|b| b.unwrap().field::<i64>("id").unwrap().to_vec())
        .collect();
    assert_eq!(got, (0..1000).collect::<Vec<_>>());
}

#[test]
fn the_cache_decodes_each_chunk_once_for_all_workers() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.parquet");
    write_parquet(&p, &[ids(0, 1000)], 300, 50);
    let options = TableOptions {
        chunk_rows: Some(100),
        ..TableOptions::default()
    };
    let d = Arc::new(parquet::open(&p, &options).unwrap());
    read_ids_with_four_workers(&d);
    // 10 chunks (groups of 300, 300, 300, 100 split into chunks of at most 100 rows), each
    // decoded exactly once although four workers asked for rows of each: the threads that
    // ask while a chunk is being decoded wait for it instead of decoding it again.
    assert_eq!(d.chunks().count(), 10);
    let s = d.cache_stats();
    assert_eq!((s.misses, s.evictions, s.chunks), (10, 0, 10), "{s:?}");
    assert!(s.hits + s.misses >= 1000, "{s:?}");
}

#[test]
fn the_cache_stays_within_its_limit() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.parquet");
    write_parquet(&p, &[ids(0, 1000)], 300, 50);
    let options = TableOptions {
        chunk_rows: Some(100),
        cache_bytes: Some(1),
        ..TableOptions::default()
    };
    let d = Arc::new(parquet::open(&p, &options).unwrap());
    read_ids_with_four_workers(&d);
    // A limit below one chunk holds only the last chunk made; every chunk decoded at least
    // once, and every decode but the one held since dropped.
    let s = d.cache_stats();
    assert!(s.chunks <= 1, "{s:?}");
    assert!(s.misses >= 10, "{s:?}");
    assert_eq!(s.evictions + s.chunks as u64, s.misses, "{s:?}");
    assert!(s.hits + s.misses >= 1000, "{s:?}");
}

#[test]
fn shuffle_reads_in_windows_of_chunks_each_row_once() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.parquet");
    write_parquet(&p, &[ids(0, 500)], 120, 30);
    let options = TableOptions {
        chunk_rows: Some(25),
        window: Some(2),
        ..TableOptions::default()
    };
    let d = Arc::new(parquet::open(&p, &options).unwrap());
    assert_eq!(d.windowed_shuffle(), Some((2, 1)));
    let mut loader = Loader::builder(Arc::clone(&d) as Arc<dyn Dataset>)
        .batch_size(50)
        .shuffle(7)
        .workers(2)
        .transform(CopyFields::named(["id"]))
        .build()
        .unwrap();
    let got: Vec<i64> = loader
        .by_ref()
        .flat_map(|b| b.unwrap().field::<i64>("id").unwrap().to_vec())
        .collect();
    let mut sorted = got.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..500).collect::<Vec<_>>());
    assert_ne!(got, sorted, "shuffled");
    // The first 50 rows (one window of two chunks) come from two chunks only.
    let chunk_of = |id: i64| {
        d.chunks()
            .scan(0u64, |end, c| {
                *end += c.3;
                Some(*end)
            })
            .position(|end| (id as u64) < end)
            .unwrap()
    };
    let mut first: Vec<usize> = got[..40].iter().map(|&id| chunk_of(id)).collect();
    first.sort_unstable();
    first.dedup();
    assert!(
        first.len() <= 2,
        "the first window's rows come from its chunks: {first:?}"
    );
}

fn unequal_file(sizes: &[u64]) -> (tempfile::TempDir, std::path::PathBuf, u64) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.parquet");
    let mut start = 0i64;
    // One batch per row group: groups of unequal sizes.
    let file = std::fs::File::create(&p).unwrap();
    let mut w = ::parquet::arrow::ArrowWriter::try_new(file, ids(0, 1).schema(), None).unwrap();
    for &n in sizes {
        w.write(&ids(start, n as i64)).unwrap();
        w.flush().unwrap();
        start += n as i64;
    }
    w.close().unwrap();
    (dir, p, start as u64)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(8))]
    #[test]
    fn windowed_epochs_are_exact_per_rank_and_resume_mid_chunk(
        sizes in proptest::collection::vec(1u64..60, 1..6),
        chunk in 1u64..20, window in 1u64..4, world in 1u64..4, batch in 1usize..9,
        seed: u64, stop_frac in 0.0f64..1.0,
    ) {
        let (_dir, p, total) = unequal_file(&sizes);
        let options = TableOptions { chunk_rows: Some(chunk), window: Some(window), ..TableOptions::default() };
        let d = Arc::new(parquet::open(&p, &options).unwrap());
        let build = |rank: u64, state: Option<LoaderState>| {
            let b = Loader::builder(Arc::clone(&d) as Arc<dyn Dataset>).batch_size(batch).shuffle(seed)
                .workers(2).shard(rank, world).drop_last(world > 1).transform(CopyFields::named(["id"]));
            match state { Some(s) => b.resume(s), None => b }.build()
        };
        let epoch = |l: &mut Loader| -> Vec<Vec<i64>> {
            l.by_ref().map(|b| b.unwrap().field::<i64>("id").unwrap().to_vec()).collect()
        };
        let mut all = Vec::new();
        let mut counts = Vec::new();
        for rank in 0..world {
            let Ok(mut l) = build(rank, None) else { return Ok(()) };
            let batches = epoch(&mut l);
            counts.push(batches.len());
            all.extend(batches.concat());
        }
        // Ranks get equal batch counts and disjoint rows (the tail that does not divide among
        // them dropped); one rank reads every row once.
        prop_assert!(counts.windows(2).all(|w| w[0] == w[1]), "{:?}", counts);
        let mut sorted = all.clone();
        sorted.sort_unstable();
        sorted.dedup();
        prop_assert_eq!(sorted.len(), all.len(), "a row twice");
        if world == 1 {
            prop_assert_eq!(all.len() as u64, total);
        }
        // Resume mid-epoch (mid-chunk) gives exactly the rest.
        let mut full = build(0, None).unwrap();
        let whole = epoch(&mut full);
        let stop = (whole.len() as f64 * stop_frac) as usize;
        let mut first = build(0, None).unwrap();
        let mut joined: Vec<Vec<i64>> = first.by_ref().take(stop).map(|b| b.unwrap().field::<i64>("id").unwrap().to_vec()).collect();
        let saved = serde_json::to_string(&first.state()).unwrap();
        drop(first);
        let mut resumed = build(0, Some(serde_json::from_str(&saved).unwrap())).unwrap();
        joined.extend(epoch(&mut resumed));
        prop_assert_eq!(joined, whole);
    }
}

#[test]
fn unreadable_columns_are_listed_and_refused_when_named() {
    use arrow_array::Decimal128Array;
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.parquet");
    let price: ArrayRef = Arc::new(
        Decimal128Array::from(vec![1i128, 2])
            .with_precision_and_scale(10, 2)
            .unwrap(),
    );
    let id: ArrayRef = Arc::new(Int64Array::from(vec![1, 2]));
    write_parquet(
        &p,
        &[RecordBatch::try_from_iter([("id", id), ("price", price)]).unwrap()],
        10,
        10,
    );
    let d = parquet::open(&p, &TableOptions::default()).unwrap();
    assert_eq!(d.schema().fields().len(), 1);
    let price = d
        .describe()
        .columns
        .into_iter()
        .find(|c| c.name == "price")
        .unwrap();
    assert!(
        price.field.is_none() && price.unreadable.as_deref().unwrap().contains("decimal"),
        "{price:?}"
    );
    let named = TableOptions {
        columns: Some(vec!["price".into()]),
        ..TableOptions::default()
    };
    let e = parquet::open(&p, &named).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    assert!(
        e.to_string().contains("t.parquet") && e.to_string().contains("`price`"),
        "{e}"
    );
    let missing = TableOptions {
        columns: Some(vec!["nope".into()]),
        ..TableOptions::default()
    };
    let e = parquet::open(&p, &missing).unwrap_err();
    assert!(e.to_string().contains("no column `nope`"), "{e}");
}

#[test]
fn pread_mode_reads_what_the_mapping_reads_with_workers_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.parquet");
    let (batch, _) = every_kind(0, 400, false);
    write_parquet(&p, &[batch], 90, 16);
    let read = |mode| {
        let options = TableOptions {
            read_mode: mode,
            chunk_rows: Some(20),
            window: Some(3),
            ..TableOptions::default()
        };
        let d = Arc::new(parquet::open(&p, &options).unwrap());
        let mut loader = Loader::builder(d as Arc<dyn Dataset>)
            .batch_size(16)
            .shuffle(3)
            .workers(4)
            .transform(CopyFields::named(["id", "vec3", "third"]))
            .build()
            .unwrap();
        loader
            .by_ref()
            .map(|b| {
                let b = b.unwrap();
                (
                    b.field::<i64>("id").unwrap().to_vec(),
                    b.field::<f32>("vec3").unwrap().to_vec(),
                )
            })
            .collect::<Vec<_>>()
    };
    let mapped = read(ReadMode::Map);
    assert_eq!(read(ReadMode::Pread), mapped);
    assert_eq!(mapped.iter().map(|b| b.0.len()).sum::<usize>(), 400);
}

#[test]
fn the_chunk_cache_counts_in_the_loaders_memory() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.parquet");
    write_parquet(&p, &[ids(0, 100)], 50, 10);
    let build = |cache_bytes| {
        let options = TableOptions {
            cache_bytes: Some(cache_bytes),
            ..TableOptions::default()
        };
        let d = Arc::new(parquet::open(&p, &options).unwrap());
        assert_eq!(d.held_bytes(), cache_bytes);
        Loader::builder(d as Arc<dyn Dataset>)
            .batch_size(10)
            .pool_budget(1 << 20)
            .transform(CopyFields::named(["id"]))
            .build()
    };
    assert!(build(1 << 20).is_ok());
    // A budget that fits the machine alone, but not beside a cache as large as the machine.
    let e = build(u64::MAX / 4).err().unwrap().to_string();
    assert!(
        e.contains("pool_budget") && e.contains("decoded rows"),
        "{e}"
    );
}

#[test]
fn chunks_are_sized_by_what_rows_decode_to_not_by_dictionary_encoded_pages() {
    use arrow_array::FixedSizeListArray;
    use arrow_array::types::Float32Type;
    // 4,096 rows of 1,024 f32 taking 4 values: the pages hold little, the rows 16 MiB.
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.parquet");
    let x = FixedSizeListArray::from_iter_primitive::<Float32Type, _, _>(
        (0..4096).map(|r| Some((0..1024).map(move |k| Some(((r + k) % 4) as f32)))),
        1024,
    );
    let batch = RecordBatch::try_from_iter([("x", Arc::new(x) as ArrayRef)]).unwrap();
    write_parquet(&p, &[batch], 4096, 1024);
    let d = parquet::open(&p, &TableOptions::default()).unwrap();
    // Chunks of about 4 MiB decoded: 4 of them, so that a window of them fits the cache.
    let chunks = d.chunks().count() as u64;
    let decoded = 4096 * 1024 * 4;
    assert!(
        chunks >= decoded / gpufeed::source::table::DEFAULT_CHUNK_BYTES,
        "{chunks} chunks"
    );
}

/// Vectors and numbers as the hub ships them, read densely where a chunk has no null and by
/// Arrow's reader where it has one, byte for byte: `vec` (8 f32) with a whole row null (filled)
/// in two row groups, `id` an i64 with a null (filled), `score` f64 values of few distinct
/// values (dictionary-encoded pages), `word` an Arrow dictionary of strings; row groups of
/// unequal sizes, several pages each, chunks that start inside pages; in order, backwards, and
/// with two workers in a shuffled epoch. (`dense.rs`'s tests check which chunks take which
/// path, with and without the footer's null counts.)
#[test]
fn dense_and_general_columns_read_byte_for_byte_with_nulls_dictionaries_and_unequal_groups() {
    use arrow_array::types::{Float32Type, Int32Type};
    use arrow_array::{DictionaryArray, FixedSizeListArray, Float64Array};
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("vectors.parquet");
    let null_vec = [17usize, 140];
    let null_id = 75usize;
    let value = |r: usize, k: usize| (r * 8 + k) as f32 * 0.25;
    let mut expected: Vec<(String, Vec<Vec<u8>>)> = vec![
        ("vec".into(), Vec::new()),
        ("id".into(), Vec::new()),
        ("score".into(), Vec::new()),
        ("word".into(), Vec::new()),
    ];
    let mut batches = Vec::new();
    // Batches of unequal sizes, written in row groups of 50, 50, 50 and 30 rows.
    for (start, n) in [(0usize, 37usize), (37, 63), (100, 80)] {
        let rows = start..start + n;
        let vec = FixedSizeListArray::from_iter_primitive::<Float32Type, _, _>(
            rows.clone()
                .map(|r| (!null_vec.contains(&r)).then(|| (0..8).map(move |k| Some(value(r, k))))),
            8,
        );
        let id = Int64Array::from(
            rows.clone()
                .map(|r| (r != null_id).then_some(r as i64 + 1000))
                .collect::<Vec<_>>(),
        );
        let score = Float64Array::from_iter_values(rows.clone().map(|r| (r % 3) as f64 / 3.0));
        let word: DictionaryArray<Int32Type> = rows
            .clone()
            .map(|r| ["cat", "dog", "bird"][r % 3])
            .collect();
        for r in rows {
            let v: Vec<u8> = if null_vec.contains(&r) {
                (-1.5f32).to_le_bytes().repeat(8)
            } else {
                (0..8).flat_map(|k| value(r, k).to_le_bytes()).collect()
            };
            expected[0].1.push(v);
            let id = if r == null_id { -1 } else { r as i64 + 1000 };
            expected[1].1.push(id.to_le_bytes().to_vec());
            expected[2]
                .1
                .push(((r % 3) as f64 / 3.0).to_le_bytes().to_vec());
            expected[3]
                .1
                .push(["cat", "dog", "bird"][r % 3].as_bytes().to_vec());
        }
        batches.push(
            RecordBatch::try_from_iter_with_nullable([
                ("vec", Arc::new(vec) as ArrayRef, true),
                ("id", Arc::new(id) as ArrayRef, true),
                ("score", Arc::new(score) as ArrayRef, true),
                ("word", Arc::new(word) as ArrayRef, true),
            ])
            .unwrap(),
        );
    }
    write_parquet(&p, &batches, 50, 6);
    let options = TableOptions {
        chunk_rows: Some(7),
        fill: BTreeMap::from([
            ("vec".to_owned(), Fill::Float(-1.5)),
            ("id".to_owned(), Fill::Int(-1)),
        ]),
        ..TableOptions::default()
    };
    let d = parquet::open(&p, &options).unwrap();
    let mut group_rows = [0u64; 4];
    for (_, g, _, rows) in d.chunks() {
        group_rows[g] += rows;
    }
    assert_eq!(group_rows, [50, 50, 50, 30]);
    assert_rows(&d, &expected);
    for r in (0..180u64).rev() {
        let s = d.get(r).unwrap();
        assert_eq!(
            s.field(0).unwrap(),
            &expected[0].1[r as usize][..],
            "row {r}"
        );
    }
    // Two workers decoding chunks at once, in a shuffled epoch: every row once, as written.
    let d = Arc::new(parquet::open(&p, &options).unwrap());
    let mut loader = Loader::builder(d.clone() as Arc<dyn Dataset>)
        .batch_size(9)
        .workers(2)
        .shuffle(5)
        .transform(CopyFields::named(["vec", "id"]))
        .build()
        .unwrap();
    let mut seen = vec![0u32; 180];
    for batch in loader.by_ref() {
        let batch = batch.unwrap();
        let ids = batch.field_bytes("id").unwrap();
        let vecs = batch.field_bytes("vec").unwrap();
        for (id, v) in ids.chunks_exact(8).zip(vecs.chunks_exact(32)) {
            let id = i64::from_le_bytes(id.try_into().unwrap());
            let r = if id == -1 {
                null_id
            } else {
                (id - 1000) as usize
            };
            assert_eq!(v, &expected[0].1[r][..], "row {r}");
            seen[r] += 1;
        }
    }
    assert!(seen.iter().all(|&n| n == 1), "{seen:?}");
}
