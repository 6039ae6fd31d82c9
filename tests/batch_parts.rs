//! Batches made in parts by several workers at once (`LoaderBuilder::batch_parts`): the same
//! batches as when one worker makes each, the same faults, the same budget, and the parts really
//! run side by side.

use gpufeed::BatchStream;
use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpufeed::format::{DType, Field, Schema};
use gpufeed::{
    Dataset, Error, FnTransform, Loader, OutputField, Result, Sample, SampleContext, Slots,
};
use proptest::prelude::*;

/// Sample i: a u64 `i * 3 + 1` and 24 bytes of `i as u8`, as two fields.
struct Numbers {
    data: Vec<u8>,
    schema: Schema,
}

const SAMPLE: usize = 32;

impl Numbers {
    fn new(n: u64) -> Numbers {
        let mut data = Vec::with_capacity(n as usize * SAMPLE);
        for i in 0..n {
            data.extend_from_slice(&(i * 3 + 1).to_le_bytes());
            data.extend_from_slice(&[i as u8; SAMPLE - 8]);
        }
        Numbers {
            data,
            schema: Schema::new(vec![
                Field::tensor("x", DType::U64, &[]),
                Field::tensor("tag", DType::U8, &[SAMPLE as u64 - 8]),
            ])
            .unwrap(),
        }
    }
}

impl Dataset for Numbers {
    fn len(&self) -> u64 {
        (self.data.len() / SAMPLE) as u64
    }
    fn schema(&self) -> &Schema {
        &self.schema
    }
    fn get(&self, index: u64) -> Result<Sample<'_>> {
        let i = index as usize;
        let bytes = self
            .data
            .get(i * SAMPLE..(i + 1) * SAMPLE)
            .ok_or(Error::OutOfRange {
                index,
                len: self.len(),
            })?;
        Sample::borrowed(bytes, &self.schema)
    }
}

/// Everything a batch says about itself, to compare loaders.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    number: u64,
    epoch: u64,
    indices: Vec<u64>,
    padding: usize,
    x: Vec<u64>,
    tag: Vec<u8>,
}

fn seen(b: &gpufeed::Batch) -> Seen {
    Seen {
        number: b.number(),
        epoch: b.epoch(),
        indices: b.indices().to_vec(),
        padding: b.padding(),
        x: b.field::<u64>("x").unwrap().to_vec(),
        tag: b.field::<u8>("tag").unwrap().to_vec(),
    }
}

fn two_epochs(l: &mut Loader) -> Vec<Seen> {
    let mut out = Vec::new();
    for epoch in 0..2 {
        l.set_epoch(epoch);
        for b in l.by_ref() {
            out.push(seen(&b.unwrap()));
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Parts change who writes a sample, never what a batch holds: every batch (samples,
    /// indices, padding, epoch) equals the one-worker-per-batch loader's, for any split.
    #[test]
    fn parts_make_the_same_batches_as_whole_batches(
        len in 1u64..300,
        batch in 1usize..40,
        parts in 2usize..12,
        workers in 1usize..6,
        seed in any::<u64>(),
        shuffle in any::<bool>(),
        drop_last in any::<bool>(),
        world in 1u64..3,
    ) {
        let make = |parts: usize| {
            let mut b = Loader::builder(Numbers::new(len))
                .batch_size(batch)
                .workers(workers)
                .batch_parts(parts)
                .drop_last(drop_last)
                .shard(world - 1, world);
            if shuffle {
                b = b.shuffle(seed);
            }
            b.build()
        };
        let (whole, split) = (make(1), make(parts));
        // Settings no loader takes (drop_last with less than a batch per rank) fail alike.
        prop_assume!(whole.is_ok() || split.is_ok());
        let (mut whole, mut split) = (whole.unwrap(), split.unwrap());
        prop_assert_eq!(whole.batch_parts(), 1);
        // At most one part a sample: a batch holds no more than the rank's share.
        prop_assert_eq!(split.batch_parts(), parts.min(split.layout().batch_size()));
        prop_assert_eq!(
            split.layout().batch_size() as u64,
            (batch as u64).min(split.order_spec().samples_per_rank())
        );
        let (a, b) = (two_epochs(&mut whole), two_epochs(&mut split));
        prop_assert_eq!(a.len() as u64, 2 * whole.batches_per_epoch());
        prop_assert_eq!(a, b);
    }
}

/// A transform that copies both fields and fails (or panics) on the samples in `bad`.
fn failing_on(bad: &'static [u64], panic: bool) -> impl gpufeed::SampleTransform {
    FnTransform::new(
        vec![
            OutputField::new("x", DType::U64, &[]),
            OutputField::new("tag", DType::U8, &[SAMPLE - 8]),
        ],
        move |s: Sample<'_>, ctx: &SampleContext, slots: &mut Slots<'_>| {
            if bad.contains(&ctx.index) {
                if panic {
                    panic!("boom at {}", ctx.index);
                }
                return Err(Error::user(format!("cannot read {}", ctx.index)));
            }
            slots.field(0)?.copy_from_slice(s.field(0).unwrap());
            slots.field(1)?.copy_from_slice(s.field(1).unwrap());
            Ok(())
        },
    )
}

#[test]
fn a_failing_sample_fails_its_batch_naming_the_first_failing_sample_and_the_loader_goes_on() {
    // Batch 2 holds samples 20..30; samples 23 and 28 fail, in different parts (4 parts of
    // 10: 20..22, 22..25, 25..27, 27..30). Whichever part finishes first, the batch names 23,
    // the first in the batch, as a one-worker batch does.
    for panic in [false, true] {
        let mut l = Loader::builder(Numbers::new(50))
            .batch_size(10)
            .workers(4)
            .batch_parts(4)
            .transform(failing_on(&[23, 28], panic))
            .shard(0, 1)
            .build()
            .unwrap();
        let results: Vec<_> = l.by_ref().collect();
        assert_eq!(results.len(), 5);
        for (k, r) in results.iter().enumerate() {
            if k == 2 {
                let e = r.as_ref().unwrap_err();
                assert!(
                    matches!(
                        e,
                        Error::Sample {
                            index: 23,
                            batch: 2,
                            ..
                        }
                    ),
                    "{e}"
                );
                if panic {
                    assert!(e.to_string().contains("boom at 23"), "{e}");
                }
            } else {
                let b = r.as_ref().unwrap();
                assert_eq!(b.len(), 10);
                let want: Vec<u64> = (k as u64 * 10..k as u64 * 10 + 10)
                    .map(|i| i * 3 + 1)
                    .collect();
                assert_eq!(b.field::<u64>("x").unwrap(), &want[..]);
            }
        }
        // The failed batch gave its buffer and permit back: the next epoch runs in full.
        l.set_epoch(1);
        assert_eq!(l.by_ref().filter(|r| r.is_ok()).count(), 4);
    }
}

#[test]
fn a_budget_of_one_batch_in_parts_delivers_every_batch_and_refuses_a_second_held_one() {
    // 10 samples of 32 B: one 4 KiB block per batch.
    let mut l = Loader::builder(Numbers::new(100))
        .batch_size(10)
        .workers(4)
        .batch_parts(5)
        .pool_budget(4096)
        .shard(0, 1)
        .build()
        .unwrap();
    let mut got = Vec::new();
    for batch in l.by_ref() {
        got.extend(batch.unwrap().field::<u64>("x").unwrap().to_vec());
    }
    assert_eq!(got, (0..100).map(|i| i * 3 + 1).collect::<Vec<_>>());

    l.set_epoch(1);
    let held = l.next().unwrap().unwrap();
    let err = l.next().unwrap().unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidConfig {
                setting: "pool_budget",
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(l.state().next_batch, 1, "the refused call cost no batch");
    drop(held);
    let rest: Vec<u64> = l.by_ref().map(|b| b.unwrap().number()).collect();
    assert_eq!(rest, (1..10).collect::<Vec<_>>());
    assert_eq!(l.stats().pool.allocations, 1, "one buffer, reused");
}

#[test]
fn skipped_samples_of_every_part_are_counted_once_and_the_hook_runs_once_per_batch() {
    let hooks = Arc::new(AtomicUsize::new(0));
    let h = Arc::clone(&hooks);
    let transform = FnTransform::new(
        vec![
            OutputField::new("x", DType::U64, &[]),
            OutputField::new("tag", DType::U8, &[SAMPLE - 8]),
        ],
        |s: Sample<'_>, ctx: &SampleContext, slots: &mut Slots<'_>| {
            slots.field(0)?.copy_from_slice(s.field(0).unwrap());
            slots.field(1)?.copy_from_slice(s.field(1).unwrap());
            if ctx.index.is_multiple_of(7) {
                slots.mark_skipped();
            }
            Ok(())
        },
    );
    let mut l = Loader::builder(Numbers::new(64))
        .batch_size(16)
        .workers(3)
        .batch_parts(4)
        // Nothing of the next epoch is made ahead: every hook call is a delivered batch's.
        .prefetch_across_epochs(false)
        .transform(transform)
        .batch_hook(move |_| {
            h.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
        .shard(0, 1)
        .build()
        .unwrap();
    let skipped: Vec<usize> = l.by_ref().map(|b| b.unwrap().skipped()).collect();
    let want: Vec<usize> = (0..4u64)
        .map(|b| {
            (b * 16..b * 16 + 16)
                .filter(|i| i.is_multiple_of(7))
                .count()
        })
        .collect();
    assert_eq!(skipped, want);
    assert_eq!(hooks.load(Ordering::SeqCst), 4);
}

#[test]
fn the_parts_of_one_batch_are_written_by_different_workers_at_once() {
    // Each part's first sample of batch 0 waits (up to 10 s) until all 4 parts have started:
    // that happens only if 4 workers hold the parts at once.
    let started = Arc::new(AtomicUsize::new(0));
    let writers: Arc<Mutex<BTreeMap<usize, String>>> = Arc::default();
    let (s2, w2) = (Arc::clone(&started), Arc::clone(&writers));
    let transform = FnTransform::new(
        vec![
            OutputField::new("x", DType::U64, &[]),
            OutputField::new("tag", DType::U8, &[SAMPLE - 8]),
        ],
        move |s: Sample<'_>, ctx: &SampleContext, slots: &mut Slots<'_>| {
            if ctx.batch == 0 && ctx.epoch == 0 {
                if ctx.position.is_multiple_of(8) {
                    s2.fetch_add(1, Ordering::SeqCst);
                    let t0 = Instant::now();
                    while s2.load(Ordering::SeqCst) < 4 && t0.elapsed() < Duration::from_secs(10) {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
                let me = std::thread::current().name().unwrap_or("?").to_owned();
                w2.lock().unwrap().insert(ctx.position, me);
            }
            slots.field(0)?.copy_from_slice(s.field(0).unwrap());
            slots.field(1)?.copy_from_slice(s.field(1).unwrap());
            Ok(())
        },
    );
    let t0 = Instant::now();
    let mut l = Loader::builder(Numbers::new(64))
        .batch_size(32)
        .workers(4)
        .batch_parts(4)
        .transform(transform)
        .shard(0, 1)
        .build()
        .unwrap();
    let first = l.next().unwrap().unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "the four parts never ran at once"
    );
    assert_eq!(started.load(Ordering::SeqCst), 4);
    assert_eq!(
        first.field::<u64>("x").unwrap(),
        &(0..32).map(|i| i * 3 + 1).collect::<Vec<_>>()[..]
    );
    let writers = writers.lock().unwrap();
    assert_eq!(writers.len(), 32, "every position written once");
    // Positions 8p..8p+8 are part p: one worker each, four different workers.
    let per_part: Vec<HashSet<&String>> = (0..4)
        .map(|p| (8 * p..8 * p + 8).map(|k| &writers[&k]).collect())
        .collect();
    assert!(per_part.iter().all(|w| w.len() == 1), "{per_part:?}");
    let all: HashSet<&String> = per_part.iter().flatten().copied().collect();
    assert_eq!(all.len(), 4, "{per_part:?}");
}

#[test]
fn set_epoch_and_drop_mid_epoch_abandon_batches_in_parts_without_a_hang() {
    let mut l = Loader::builder(Numbers::new(2000))
        .batch_size(50)
        .workers(4)
        .batch_parts(3)
        .shuffle(7)
        .shard(0, 1)
        .build()
        .unwrap();
    for epoch in 0..5 {
        l.set_epoch(epoch);
        // Take a few batches, then start the next epoch with parts in flight.
        let got: Vec<_> = l.by_ref().take(3).map(|b| b.unwrap().number()).collect();
        assert_eq!(got, [0, 1, 2]);
    }
    l.set_epoch(9);
    let all: Vec<u64> = l
        .by_ref()
        .flat_map(|b| b.unwrap().indices().to_vec())
        .collect();
    let mut sorted = all.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..2000).collect::<Vec<_>>(), "a permutation");
    let _ = l.next();
    l.set_epoch(10);
    let _ = l.next().unwrap().unwrap();
    let t0 = Instant::now();
    drop(l);
    assert!(t0.elapsed() < Duration::from_secs(5));
}

#[test]
fn large_batches_are_made_in_parts_by_default_with_fewer_in_flight() {
    // 4 MiB batches (512 samples of 8 KiB) on 4 workers: 4 parts, and 2 * 1 + 2 in flight.
    let schema = Schema::new(vec![Field::tensor("x", DType::U8, &[8192])]).unwrap();
    struct Big(Schema, Vec<u8>);
    impl Dataset for Big {
        // More batches an epoch than the default prefetch, which an epoch bounds.
        fn len(&self) -> u64 {
            4096
        }
        fn schema(&self) -> &Schema {
            &self.0
        }
        fn get(&self, index: u64) -> Result<Sample<'_>> {
            let _ = index;
            Sample::borrowed(&self.1, &self.0)
        }
    }
    let big = Loader::builder(Big(schema.clone(), vec![7; 8192]))
        .batch_size(512)
        .workers(4)
        .shard(0, 1)
        .build()
        .unwrap();
    assert_eq!(big.batch_parts(), 4);
    assert_eq!(big.prefetch(), 4);
    let small = Loader::builder(Big(schema, vec![7; 8192]))
        .batch_size(256)
        .workers(4)
        .shard(0, 1)
        .build()
        .unwrap();
    assert_eq!(small.batch_parts(), 1, "2 MiB batches are made whole");

    let err = Loader::builder(Numbers::new(10))
        .batch_parts(0)
        .build()
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidConfig {
                setting: "batch_parts",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn buffers_are_made_ahead_in_parallel_and_never_beyond_the_budget() {
    let mut l = Loader::builder(Numbers::new(1000))
        .batch_size(100)
        .workers(4)
        .batch_parts(4)
        .shard(0, 1)
        .build()
        .unwrap();
    let n = l.by_ref().map(|b| b.unwrap().len()).sum::<usize>();
    assert_eq!(n, 1000);
    let stats = l.stats();
    // prefetch 2 * ceil(4 / 4) + 2 = 4, budget 6 batches.
    assert_eq!(l.prefetch(), 4);
    assert!(
        stats.pool.allocations >= 1 && stats.pool.allocations <= 6,
        "{} allocations",
        stats.pool.allocations
    );
}
