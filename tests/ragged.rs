//! Ragged fields through the loader: variable-size fields batched as values plus offsets, exact
//! in every order (shuffled, in parts, resumed), with a byte budget per batch that a batch
//! never exceeds and never is cut to.

use gpufeed::BatchStream;

use gpufeed::format::{Codec, DType, Field, RecordWriter, Schema};
use gpufeed::{
    Batch, Dataset, Error, ErrorKind, FnTransform, Loader, LoaderBuilder, OutputField, Result,
    Sample, SampleContext, Slots,
};
use proptest::prelude::*;

/// Sample `i`'s text: `len(i)` bytes, each a function of `i` and its place.
fn text(i: u64, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i as usize * 31 + j * 7) as u8).collect()
}

/// Sample `i`'s tokens: `len(i) / 3` u16s.
fn tokens(i: u64, len: usize) -> Vec<u16> {
    (0..len / 3)
        .map(|j| (i as usize * 1000 + j) as u16)
        .collect()
}

/// A length that varies a lot from sample to sample (0 to 399 bytes).
fn spread(i: u64) -> usize {
    ((i * 2_654_435_761) % 400) as usize
}

/// In memory: `id` (u64), `text` (utf8 bytes), `tokens` (u16 values), lengths from `len`.
struct Texts {
    records: Vec<Vec<u8>>,
    schema: Schema,
}

fn schema() -> Schema {
    Schema::new(vec![
        Field::tensor("id", DType::U64, &[]),
        Field::bytes("text", Codec::Utf8),
        Field::bytes("tokens", Codec::Elements(DType::U16)),
    ])
    .unwrap()
}

impl Texts {
    fn new(lens: Vec<usize>) -> Texts {
        let schema = schema();
        let records = lens
            .iter()
            .enumerate()
            .map(|(i, &len)| {
                let i = i as u64;
                let t: Vec<u8> = tokens(i, len)
                    .iter()
                    .flat_map(|t| t.to_le_bytes())
                    .collect();
                let mut r = Vec::new();
                schema
                    .build_record(&[&i.to_le_bytes(), &text(i, len), &t], &mut r)
                    .unwrap();
                r
            })
            .collect();
        Texts { records, schema }
    }

    fn of(n: u64, len: impl Fn(u64) -> usize) -> Texts {
        Texts::new((0..n).map(len).collect())
    }
}

impl Dataset for Texts {
    fn len(&self) -> u64 {
        self.records.len() as u64
    }
    fn schema(&self) -> &Schema {
        &self.schema
    }
    fn get(&self, index: u64) -> Result<Sample<'_>> {
        let r = self.records.get(index as usize).ok_or(Error::OutOfRange {
            index,
            len: self.len(),
        })?;
        Sample::borrowed(r, &self.schema)
    }
}

/// Checks every byte of a batch against the samples it names: ids, text values and offsets,
/// token values and offsets; returns the batch's indices.
fn check(batch: &Batch, lens: &[usize]) -> Vec<u64> {
    let indices = batch.indices().to_vec();
    assert_eq!(batch.field::<u64>("id").unwrap(), indices);
    let t = batch.ragged::<u8>("text").unwrap();
    let k = batch.ragged::<u16>("tokens").unwrap();
    let mut want_text = Vec::new();
    let mut want_tokens = Vec::new();
    let mut text_offsets = vec![0i64];
    let mut token_offsets = vec![0i64];
    for &i in &indices {
        let len = lens[i as usize];
        want_text.extend(text(i, len));
        want_tokens.extend(tokens(i, len));
        text_offsets.push(want_text.len() as i64);
        token_offsets.push(want_tokens.len() as i64);
    }
    assert_eq!(t.values(), want_text, "text of batch {}", batch.number());
    assert_eq!(t.offsets(), text_offsets);
    assert_eq!(
        k.values(),
        want_tokens,
        "tokens of batch {}",
        batch.number()
    );
    assert_eq!(k.offsets(), token_offsets);
    assert_eq!(batch.offsets("text").unwrap(), text_offsets);
    assert_eq!(batch.field_bytes("text").unwrap(), want_text);
    assert_eq!(batch.shape("tokens").unwrap(), [want_tokens.len()]);
    assert_eq!(
        batch.data_bytes(),
        8 * indices.len() + want_text.len() + 2 * want_tokens.len()
    );
    for (s, &i) in t.iter().zip(&indices) {
        assert_eq!(s, text(i, lens[i as usize]));
    }
    indices
}

fn builder(data: Texts) -> LoaderBuilder {
    Loader::builder(data)
        .ragged_budget("text", 16 << 10)
        .ragged_budget("tokens", 16 << 10)
}

/// Every batch of an epoch, checked, as (indices, text offsets).
fn epoch(loader: &mut Loader, lens: &[usize]) -> Vec<(Vec<u64>, Vec<i64>)> {
    loader
        .by_ref()
        .map(|b| {
            let b = b.unwrap();
            let offsets = b.offsets("text").unwrap().to_vec();
            (check(&b, lens), offsets)
        })
        .collect()
}

#[test]
fn ragged_fields_round_trip_shuffled_whole_and_in_parts() {
    let data = || Texts::of(200, spread);
    let lens: Vec<usize> = (0..200).map(spread).collect();
    let mut runs = Vec::new();
    for parts in [1, 2, 3, 7] {
        let mut loader = builder(data())
            .batch_size(16)
            .shuffle(5)
            .workers(3)
            .batch_parts(parts)
            .build()
            .unwrap();
        let mut epochs = Vec::new();
        for e in 0..2 {
            loader.set_epoch(e);
            let batches = epoch(&mut loader, &lens);
            let mut seen: Vec<u64> = batches.iter().flat_map(|b| b.0.clone()).collect();
            seen.sort_unstable();
            assert_eq!(
                seen,
                (0..200).collect::<Vec<_>>(),
                "parts {parts}, epoch {e}"
            );
            epochs.push(batches);
        }
        runs.push(epochs);
    }
    // The same batches however many parts make them.
    assert!(runs.windows(2).all(|w| w[0] == w[1]));
}

#[test]
fn a_resumed_loader_delivers_the_same_ragged_batches() {
    let lens: Vec<usize> = (0..150).map(spread).collect();
    let b = || {
        builder(Texts::of(150, spread))
            .batch_size(8)
            .shuffle(11)
            .workers(2)
            .batch_parts(2)
    };
    let mut whole = b().build().unwrap();
    let all = epoch(&mut whole, &lens);
    let mut first = b().build().unwrap();
    let head: Vec<_> = first
        .by_ref()
        .take(7)
        .map(|b| b.unwrap().indices().to_vec())
        .collect();
    let state = first.state();
    drop(first);
    let mut resumed = b().resume(state).build().unwrap();
    resumed.set_epoch(0);
    let rest = epoch(&mut resumed, &lens);
    assert_eq!(
        head,
        all[..7].iter().map(|b| b.0.clone()).collect::<Vec<_>>()
    );
    assert_eq!(rest, all[7..]);
}

#[test]
fn a_part_that_outgrows_its_share_of_the_budget_still_gives_the_exact_batch() {
    // Batches of 8 in 2 parts: the first part's samples take 90 bytes each (360), the second's
    // 10 (40); a budget of 400 gives each part 200: the first spills, the second's values move
    // right, over the first's spill.
    let len = |i: u64| if i % 8 < 4 { 90 } else { 10 };
    let lens: Vec<usize> = (0..32).map(len).collect();
    let mut loader = Loader::builder(Texts::of(32, len))
        .ragged_budget("text", 400)
        .ragged_budget("tokens", 400)
        .batch_size(8)
        .workers(2)
        .batch_parts(2)
        .build()
        .unwrap();
    let batches = epoch(&mut loader, &lens);
    assert_eq!(batches.len(), 4);
    assert_eq!(batches[0].1, [0, 90, 180, 270, 360, 370, 380, 390, 400]);
}

#[test]
fn a_batch_over_the_budget_is_an_error_naming_the_field_the_batch_and_the_setting() {
    // Samples of 100 bytes, but batch 2 (samples 8..12) whose sample 9 has 500.
    let len = |i: u64| if i == 9 { 500 } else { 100 };
    let lens: Vec<usize> = (0..16).map(len).collect();
    for parts in [1, 2] {
        let mut loader = Loader::builder(Texts::of(16, len))
            .ragged_budget("text", 450)
            .ragged_budget("tokens", 1 << 10)
            .batch_size(4)
            .workers(2)
            .batch_parts(parts)
            .build()
            .unwrap();
        let mut outcomes = Vec::new();
        for b in loader.by_ref() {
            outcomes.push(b.map(|b| check(&b, &lens)));
        }
        assert_eq!(outcomes.len(), 4);
        let e = outcomes[2].as_ref().unwrap_err();
        assert!(matches!(e, Error::Batch { batch: 2, .. }), "{e:?}");
        assert_eq!(e.kind(), ErrorKind::Config);
        let text = e.to_string();
        for want in ["batch 2", "`text`", "ragged_budget", "450 bytes"] {
            assert!(text.contains(want), "`{want}` not in: {text}");
        }
        // The other batches are whole; the loader goes on after the error.
        for (b, o) in outcomes.iter().enumerate().filter(|(b, _)| *b != 2) {
            assert_eq!(o.as_ref().unwrap().len(), 4, "batch {b}");
        }
    }
}

#[test]
fn the_default_budget_comes_from_the_first_samples_sizes() {
    // Every text has 100 bytes: twice a batch of 10, plus the largest, in 64 KiB.
    let mut loader = Loader::builder(Texts::of(40, |_| 100))
        .batch_size(10)
        .build()
        .unwrap();
    let layout = loader.layout().clone();
    let k = layout.index_of("text").unwrap();
    assert_eq!(
        layout.ragged_capacity(k),
        Some(gpufeed::loader::default_ragged_budget(10, 100.0, 0.0, 100) as usize)
    );
    let lens = vec![100; 40];
    assert_eq!(epoch(&mut loader, &lens).len(), 4);
}

#[test]
fn one_budget_for_each_ragged_field_leaves_the_named_ones_alone() {
    let loader = Loader::builder(Texts::of(8, spread))
        .batch_size(4)
        .ragged_budget("tokens", 5000)
        .ragged_budget_each(3000)
        .build()
        .unwrap();
    let layout = loader.layout();
    let cap = |name| layout.ragged_capacity(layout.index_of(name).unwrap());
    assert_eq!((cap("text"), cap("tokens")), (Some(3000), Some(5000)));
    let e = Loader::builder(Texts::of(8, spread))
        .transform(gpufeed::CopyFields::named(["id"]))
        .ragged_budget_each(3000)
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("no ragged field"), "{e}");
}

#[test]
fn a_budget_for_a_field_that_is_not_ragged_is_refused() {
    let e = builder(Texts::of(4, spread))
        .ragged_budget("id", 100)
        .build()
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidConfig {
                setting: "ragged_budget",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("no ragged field `id`"), "{e}");
}

#[test]
fn values_that_are_not_whole_elements_fail_their_sample() {
    // A tokens field (u16 values) of 3 bytes.
    struct Odd(Schema);
    impl Dataset for Odd {
        fn len(&self) -> u64 {
            2
        }
        fn schema(&self) -> &Schema {
            &self.0
        }
        fn get(&self, i: u64) -> Result<Sample<'_>> {
            let mut r = Vec::new();
            let t: &[u8] = if i == 1 { &[1, 2, 3] } else { &[1, 2] };
            self.0.build_record(&[t], &mut r)?;
            Sample::owned(r, &self.0)
        }
    }
    let odd = Odd(Schema::new(vec![Field::bytes("tokens", Codec::Elements(DType::U16))]).unwrap());
    let mut loader = Loader::builder(odd)
        .batch_size(1)
        .ragged_budget("tokens", 64)
        .build()
        .unwrap();
    let first = loader.next().unwrap().unwrap();
    assert_eq!(first.ragged::<u16>("tokens").unwrap().values(), [0x0201]);
    match loader.next() {
        Some(Err(Error::Sample {
            index: 1, source, ..
        })) => {
            assert!(
                source.to_string().contains("not a whole number of u16"),
                "{source}"
            );
        }
        other => panic!("expected sample 1's error, got {other:?}"),
    }
}

#[test]
fn a_transform_writes_ragged_fields_of_its_own_and_skipped_samples_hold_none() {
    // Each sample's words' lengths, as a ragged field of (start, len) u32 pairs; sample 3 is
    // skipped without writing it.
    let transform = FnTransform::new(
        vec![
            OutputField::new("id", DType::U64, &[]),
            OutputField::ragged("words", DType::U32, &[2]),
        ],
        |s: Sample<'_>, ctx: &SampleContext, slots: &mut Slots<'_>| {
            slots
                .field_mut::<u64>("id")?
                .copy_from_slice(&s.field_as::<u64>("id")?);
            if ctx.index == 3 {
                slots.mark_skipped();
                return Ok(());
            }
            let n = ctx.index as usize % 4;
            let words = slots.ragged_mut::<u32>("words", n)?;
            for (j, w) in words.chunks_mut(2).enumerate() {
                w.copy_from_slice(&[j as u32, ctx.index as u32]);
            }
            Ok(())
        },
    );
    let mut loader = Loader::builder(Texts::of(8, spread))
        .batch_size(8)
        .transform(transform)
        .build()
        .unwrap();
    let batch = loader.next().unwrap().unwrap();
    assert_eq!(batch.skipped(), 1);
    let words = batch.ragged::<u32>("words").unwrap();
    assert_eq!(words.item_len(), 2);
    assert_eq!(words.offsets(), [0, 0, 1, 3, 3, 3, 4, 6, 9]);
    assert_eq!(words.sample(2), [0, 2, 1, 2]);
    assert_eq!(batch.shape("words").unwrap(), [9, 2]);
    // The layout sized the budget from the measured samples, whose largest had 3 pairs.
    let k = loader.layout().index_of("words").unwrap();
    assert!(loader.layout().ragged_capacity(k).unwrap() >= 8 * 3 * 8);
}

#[test]
fn a_transform_that_leaves_a_ragged_field_unwritten_fails_its_sample() {
    let transform = FnTransform::new(
        vec![OutputField::ragged("text", DType::U8, &[])],
        |_: Sample<'_>, ctx: &SampleContext, slots: &mut Slots<'_>| {
            if ctx.index != 2 {
                slots.ragged_mut::<u8>("text", 1)?[0] = 1;
            }
            Ok(())
        },
    );
    let mut loader = Loader::builder(Texts::of(4, spread))
        .batch_size(4)
        .ragged_budget("text", 64)
        .transform(transform)
        .build()
        .unwrap();
    match loader.next() {
        Some(Err(Error::Sample {
            index: 2, source, ..
        })) => {
            assert!(
                source.to_string().contains("ragged output field `text`"),
                "{source}"
            );
        }
        other => panic!("expected sample 2's error, got {other:?}"),
    }
}

#[test]
fn a_packed_file_s_bytes_fields_load_as_ragged_fields() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("texts.gfd");
    let mut w = RecordWriter::create(&path, schema()).unwrap();
    let lens: Vec<usize> = (0..64).map(spread).collect();
    for (i, &len) in lens.iter().enumerate() {
        let i = i as u64;
        let t: Vec<u8> = tokens(i, len)
            .iter()
            .flat_map(|t| t.to_le_bytes())
            .collect();
        w.append(&[&i.to_le_bytes(), &text(i, len), &t]).unwrap();
    }
    w.finish().unwrap();
    let mut loader = Loader::builder(gpufeed::source::open(&path, &Default::default()).unwrap())
        .batch_size(10)
        .shuffle(3)
        .workers(2)
        .build()
        .unwrap();
    let seen: usize = epoch(&mut loader, &lens).iter().map(|b| b.0.len()).sum();
    assert_eq!(seen, 64);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Whatever the lengths (empty samples included), batch size, parts and workers, every
    /// batch holds exactly its samples' values, in order, at the right offsets.
    #[test]
    fn ragged_batches_hold_exactly_their_samples(
        lens in proptest::collection::vec(prop_oneof![Just(0usize), 0usize..64, 0usize..2000], 1..60),
        batch_size in 1usize..12,
        parts in 1usize..5,
        workers in 1usize..4,
        seed in any::<u64>(),
    ) {
        let n = lens.len();
        let mut loader = Loader::builder(Texts::new(lens.clone()))
            .ragged_budget("text", 2000 * 12)
            .ragged_budget("tokens", 2000 * 12)
            .batch_size(batch_size)
            .batch_parts(parts)
            .workers(workers)
            .shuffle(seed)
            .build()
            .unwrap();
        let mut seen = Vec::new();
        for b in loader.by_ref() {
            seen.extend(check(&b.unwrap(), &lens));
        }
        seen.sort_unstable();
        prop_assert_eq!(seen, (0..n as u64).collect::<Vec<_>>());
    }
}
