//! The loader end to end: order, workers, resume, faults, shutdown, bad settings.

use gpufeed::BatchStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use gpufeed::format::{DType, Field, Schema};
use gpufeed::{
    Dataset, Error, FnTransform, Loader, LoaderState, OutputField, Result, Sample, SampleContext,
    Slots,
};
use proptest::prelude::*;

/// An in-memory dataset: sample i is 8 bytes, the little-endian u64 `i * 3 + 1`.
struct Numbers {
    data: Vec<u8>,
    schema: Schema,
}

impl Numbers {
    fn new(n: u64) -> Numbers {
        Numbers {
            data: (0..n).flat_map(|i| (i * 3 + 1).to_le_bytes()).collect(),
            schema: Schema::new(vec![Field::tensor("x", DType::U64, &[])]).unwrap(),
        }
    }
}

impl Dataset for Numbers {
    fn len(&self) -> u64 {
        self.data.len() as u64 / 8
    }
    fn schema(&self) -> &Schema {
        &self.schema
    }
    fn get(&self, index: u64) -> Result<Sample<'_>> {
        let i = index as usize;
        let bytes = self.data.get(i * 8..i * 8 + 8).ok_or(Error::OutOfRange {
            index,
            len: self.len(),
        })?;
        Sample::borrowed(bytes, &self.schema)
    }
}

fn values(batch: &gpufeed::Batch) -> Vec<u64> {
    batch.field::<u64>("x").unwrap().to_vec()
}

fn epoch_of(loader: &mut Loader) -> Vec<Vec<u64>> {
    loader.by_ref().map(|b| values(&b.unwrap())).collect()
}

#[test]
fn delivers_every_sample_in_order_with_content() {
    let mut loader = Loader::builder(Numbers::new(1000))
        .batch_size(32)
        .workers(4)
        .shard(0, 1)
        .build()
        .unwrap();
    let batches = epoch_of(&mut loader);
    assert_eq!(batches.len(), 32);
    assert_eq!(batches.last().unwrap().len(), 1000 - 31 * 32);
    let flat: Vec<u64> = batches.concat();
    assert_eq!(flat, (0..1000).map(|i| i * 3 + 1).collect::<Vec<_>>());
    assert!(loader.next().is_none(), "an epoch ends with None");
}

#[test]
fn order_does_not_depend_on_workers_or_prefetch() {
    let run = |workers, prefetch| {
        let mut l = Loader::builder(Numbers::new(777))
            .batch_size(10)
            .shuffle(42)
            .workers(workers)
            .prefetch(prefetch)
            .shard(0, 1)
            .epoch(5)
            .build()
            .unwrap();
        epoch_of(&mut l)
    };
    let one = run(1, 1);
    assert_eq!(one, run(8, 3));
    assert_eq!(one, run(3, 16));
    let mut flat = one.concat();
    flat.sort_unstable();
    assert_eq!(flat, (0..777).map(|i| i * 3 + 1).collect::<Vec<_>>());
}

#[test]
fn set_epoch_gives_a_new_order_on_the_same_threads() {
    let mut l = Loader::builder(Numbers::new(300))
        .batch_size(7)
        .shuffle(1)
        .workers(2)
        .shard(0, 1)
        .build()
        .unwrap();
    let e0 = epoch_of(&mut l);
    l.set_epoch(1);
    let e1 = epoch_of(&mut l);
    assert_ne!(e0, e1);
    l.set_epoch(0);
    // Abandon mid-epoch, then start again: the same order as before.
    let _ = l.next();
    let _ = l.next();
    l.set_epoch(0);
    assert_eq!(epoch_of(&mut l), e0);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn resume_yields_exactly_the_rest(len in 1u64..400, batch in 1usize..40, stop_frac in 0.0f64..1.0,
                                      seed: u64, workers in 1usize..5, drop_last: bool) {
        let build = |state: Option<LoaderState>| {
            let b = Loader::builder(Numbers::new(len)).batch_size(batch).shuffle(seed).workers(workers)
                .drop_last(drop_last).shard(0, 1).epoch(2);
            match state { Some(s) => b.resume(s), None => b }.build()
        };
        let Ok(mut full) = build(None) else { return Ok(()) }; // drop_last with len < batch
        let whole = epoch_of(&mut full);
        let stop = (whole.len() as f64 * stop_frac) as usize;
        let mut first = build(None).unwrap();
        let delivered: Vec<Vec<u64>> = first.by_ref().take(stop).map(|b| values(&b.unwrap())).collect();
        // The state goes through JSON, as it would through a checkpoint file.
        let saved = serde_json::to_string(&first.state()).unwrap();
        drop(first); // the crash
        let mut resumed = build(Some(serde_json::from_str(&saved).unwrap())).unwrap();
        let rest = epoch_of(&mut resumed);
        let mut joined = delivered;
        joined.extend(rest);
        prop_assert_eq!(joined, whole);
    }
}

#[test]
fn resume_refuses_a_state_from_other_settings() {
    let mut l = Loader::builder(Numbers::new(100))
        .batch_size(10)
        .shuffle(3)
        .shard(0, 1)
        .build()
        .unwrap();
    let _ = l.next();
    let state = l.state();
    let other = Loader::builder(Numbers::new(100))
        .batch_size(20)
        .shuffle(3)
        .shard(0, 1)
        .resume(state)
        .build();
    // Said in words, with both values: no Rust type, no debug dump.
    match other {
        Err(e @ Error::Mismatch { .. }) => {
            let text = e.to_string();
            assert!(
                text.contains("batch size 10 (this loader: batch size 20)"),
                "{text}"
            );
            assert!(!text.contains("OrderSpec") && !text.contains('{'), "{text}");
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("resumed a state of another batch size"),
    }
}

#[test]
fn a_state_taken_on_another_data_set_of_the_same_length_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let npy = |name: &str, value: u8| {
        let path = dir.path().join(name);
        let mut b = gpufeed::source::npy_header(DType::U8, &[20, 4]).unwrap();
        b.extend_from_slice(&[value; 80]);
        std::fs::write(&path, b).unwrap();
        gpufeed::NpyArray::open(&path).unwrap()
    };
    let build = |data: gpufeed::NpyArray, resume: Option<LoaderState>| {
        let b = Loader::builder(data).batch_size(5).shuffle(1).workers(1);
        match resume {
            Some(state) => b.resume(state),
            None => b,
        }
        .build()
    };
    let mut l = build(npy("a.npy", 1), None).unwrap();
    let _ = l.next();
    let state = l.state();
    assert!(state.fingerprint.is_some());
    // The same data resumes; other data of the same length does not, said in words.
    build(npy("a2.npy", 1), Some(state.clone())).unwrap();
    let e = build(npy("b.npy", 2), Some(state.clone())).unwrap_err();
    assert!(matches!(e, Error::Mismatch { .. }), "{e}");
    assert!(e.to_string().contains("other data"), "{e}");
    let mut running = build(npy("c.npy", 3), None).unwrap();
    assert!(running.load_state(state.clone()).is_err());
    // A state of the layout before fingerprints resumes on its length, as it did.
    let old = LoaderState {
        fingerprint: None,
        ..state
    };
    build(npy("d.npy", 4), Some(old)).unwrap();
}

fn failing_on(bad: u64, panic: bool) -> impl gpufeed::SampleTransform {
    FnTransform::new(
        vec![OutputField::new("x", DType::U64, &[])],
        move |s: Sample<'_>, ctx: &SampleContext, slots: &mut Slots<'_>| {
            if ctx.index == bad {
                if panic {
                    panic!("boom at {bad}");
                }
                return Err(Error::user("cannot read this one"));
            }
            slots.field(0)?.copy_from_slice(s.field(0).unwrap());
            Ok(())
        },
    )
}

#[test]
fn a_failing_sample_fails_its_batch_and_the_loader_goes_on() {
    for panic in [false, true] {
        let mut l = Loader::builder(Numbers::new(50))
            .batch_size(10)
            .workers(3)
            .transform(failing_on(23, panic))
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
                let msg = e.to_string();
                assert!(msg.contains("sample 23"), "{msg}");
                if panic {
                    assert!(
                        msg.contains("panicked") && msg.contains("boom at 23"),
                        "{msg}"
                    );
                }
            } else {
                assert_eq!(r.as_ref().unwrap().len(), 10);
            }
        }
        // Still usable: the next epoch runs.
        l.set_epoch(1);
        assert_eq!(l.by_ref().filter(|r| r.is_ok()).count(), 4);
    }
}

#[test]
fn dropping_mid_epoch_with_a_full_channel_stops_every_thread_promptly() {
    let made = Arc::new(AtomicUsize::new(0));
    let m = made.clone();
    let slow = FnTransform::new(
        vec![OutputField::new("x", DType::U64, &[])],
        move |s: Sample<'_>, _: &SampleContext, slots: &mut Slots<'_>| {
            m.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(Duration::from_micros(200));
            slots.field(0)?.copy_from_slice(s.field(0).unwrap());
            Ok(())
        },
    );
    let mut l = Loader::builder(Numbers::new(100_000))
        .batch_size(64)
        .workers(4)
        .prefetch(8)
        .transform(slow)
        .shard(0, 1)
        .build()
        .unwrap();
    let first = l.next().unwrap().unwrap();
    // A slow consumer: the workers fill every slot of the prefetch window, then wait.
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    drop(l);
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "drop took {:?}",
        t0.elapsed()
    );
    drop(first);
    // Each worker holds the shared state (and so the transform) until its thread ends.
    assert_eq!(
        Arc::strong_count(&made),
        1,
        "worker threads outlived the loader"
    );
    assert!(
        made.load(Ordering::Relaxed) < 100_000,
        "workers kept going after the drop"
    );
}

/// A dataset whose `get` blocks until `release` is sent or dropped (a read that does not
/// return, as of a named pipe); it says when a `get` starts, and when it is dropped.
struct Stuck {
    inner: Numbers,
    started: std::sync::mpsc::SyncSender<()>,
    release: std::sync::Mutex<std::sync::mpsc::Receiver<()>>,
    dropped: Arc<std::sync::atomic::AtomicBool>,
}

impl Dataset for Stuck {
    fn len(&self) -> u64 {
        self.inner.len()
    }
    fn schema(&self) -> &Schema {
        self.inner.schema()
    }
    fn get(&self, index: u64) -> Result<Sample<'_>> {
        let _ = self.started.try_send(());
        let _ = self.release.lock().unwrap().recv();
        self.inner.get(index)
    }
}

impl Drop for Stuck {
    fn drop(&mut self) {
        self.dropped.store(true, Ordering::Release);
    }
}

#[test]
fn dropping_a_loader_whose_worker_is_stuck_returns_and_detaches_the_worker() {
    let (started_tx, started) = std::sync::mpsc::sync_channel(16);
    let (release, release_rx) = std::sync::mpsc::channel::<()>();
    let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let l = Loader::builder(Stuck {
        inner: Numbers::new(10),
        started: started_tx,
        release: std::sync::Mutex::new(release_rx),
        dropped: Arc::clone(&dropped),
    })
    .batch_size(1)
    .workers(1)
    .prefetch(1)
    .build()
    .unwrap();
    started
        .recv_timeout(Duration::from_secs(30))
        .expect("the worker never called get");
    let before = gpufeed::loader::detached_workers();
    // Dropped on another thread, so that a drop that never returns fails the test.
    let (took_tx, took) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let t0 = Instant::now();
        drop(l);
        let _ = took_tx.send(t0.elapsed());
    });
    let wait = gpufeed::loader::SHUTDOWN_WAIT;
    let took = took
        .recv_timeout(wait + Duration::from_secs(30))
        .expect("dropping the loader did not return: it waits for a worker stuck in Dataset::get");
    assert!(
        took >= wait,
        "the drop gave up after {took:?}, before {wait:?}"
    );
    assert!(
        gpufeed::loader::detached_workers() > before,
        "the stuck worker was not counted as detached"
    );
    // The detached worker still owns the dataset (no freed memory under it) ...
    assert!(
        !dropped.load(Ordering::Acquire),
        "the dataset was freed under its worker"
    );
    // ... until its call returns: then it ends, and frees it.
    drop(release);
    let t0 = Instant::now();
    while !dropped.load(Ordering::Acquire) {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the detached worker did not end once its get returned"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn holding_more_batches_than_the_budget_is_an_error_not_a_hang() {
    let mut l = Loader::builder(Numbers::new(1000))
        .batch_size(64)
        .workers(2)
        .prefetch(2)
        .pool_budget(3 * 4096)
        .shard(0, 1)
        .build()
        .unwrap();
    let mut held = Vec::new();
    let mut error = None;
    for r in l.by_ref() {
        match r {
            Ok(b) => held.push(b),
            Err(e) => {
                error = Some(e);
                break;
            }
        }
        assert!(held.len() <= 3);
    }
    assert!(
        matches!(
            error,
            Some(Error::InvalidConfig {
                setting: "pool_budget",
                ..
            })
        ),
        "{error:?}"
    );
    // What the error is about, as figures: every batch of the budget is in the caller's hands.
    assert_eq!((l.held_batches(), l.budget_batches()), (3, 3));
    held.pop();
    assert_eq!(l.held_batches(), 2);
    drop(held);
    assert_eq!(l.held_batches(), 0);
}

#[test]
fn pool_reuses_buffers_across_batches() {
    let mut l = Loader::builder(Numbers::new(10_000))
        .batch_size(100)
        .workers(2)
        .shard(0, 1)
        .build()
        .unwrap();
    let n = l.by_ref().filter(|b| b.is_ok()).count();
    assert_eq!(n, 100);
    let stats = l.stats();
    // Never more buffers than the budget holds: prefetch + 2 batches.
    assert!(
        stats.pool.allocations <= l.prefetch() as u64 + 2,
        "{}",
        stats.pool
    );
    assert!(stats.pool.reuses >= 90, "{}", stats.pool);
    assert_eq!(stats.samples, 10_000);
    assert!(stats.first_batch.is_some());
    let table = stats.to_string();
    assert!(
        table.contains("fetch") && table.contains("consumer waited"),
        "{table}"
    );
}

#[test]
fn bad_settings_are_typed_errors_at_build() {
    let b = || Loader::builder(Numbers::new(10)).shard(0, 1);
    let setting = |r: Result<Loader>| match r {
        Err(Error::InvalidConfig { setting, .. }) => setting,
        other => panic!("expected InvalidConfig, got {other:?}"),
    };
    assert_eq!(setting(b().batch_size(0).build()), "batch_size");
    assert_eq!(setting(b().shard(2, 2).build()), "rank");
    assert_eq!(setting(b().shard(0, 0).build()), "world");
    assert_eq!(setting(b().prefetch(0).build()), "prefetch");
    assert_eq!(setting(b().workers(0).build()), "workers");
    assert_eq!(
        setting(b().batch_size(11).drop_last(true).build()),
        "drop_last"
    );
    assert_eq!(
        setting(b().batch_size(4).pool_budget(100).build()),
        "pool_budget"
    );
    assert_eq!(
        setting(Loader::builder(Numbers::new(0)).shard(0, 1).build()),
        "dataset"
    );
    // A variable-size field is batched as a ragged one: with no budget given, the loader
    // measures the first samples to size it, and names the setting when none can be read.
    struct Var(Schema);
    impl Dataset for Var {
        fn len(&self) -> u64 {
            1
        }
        fn schema(&self) -> &Schema {
            &self.0
        }
        fn get(&self, _: u64) -> Result<Sample<'_>> {
            Err(Error::user("unused"))
        }
    }
    let var = || Var(Schema::new(vec![Field::bytes("jpeg", gpufeed::Codec::Jpeg)]).unwrap());
    assert_eq!(
        setting(Loader::builder(var()).shard(0, 1).build()),
        "ragged_budget"
    );
    assert_eq!(
        setting(Loader::builder(var()).ragged_budget("jpg", 10).build()),
        "ragged_budget"
    );
    let mut l = Loader::builder(var())
        .ragged_budget("jpeg", 1 << 10)
        .build()
        .unwrap();
    assert!(matches!(
        l.next(),
        Some(Err(Error::Sample { index: 0, .. }))
    ));
}

#[test]
fn sharded_loaders_split_the_epoch() {
    let mut all = Vec::new();
    for rank in 0..3 {
        let mut l = Loader::builder(Numbers::new(99))
            .batch_size(5)
            .shuffle(9)
            .shard(rank, 3)
            .build()
            .unwrap();
        let mine = epoch_of(&mut l).concat();
        assert_eq!(mine.len(), 33);
        all.extend(mine);
    }
    all.sort_unstable();
    assert_eq!(all, (0..99).map(|i| i * 3 + 1).collect::<Vec<_>>());
}

#[test]
fn the_next_epoch_is_made_ahead_and_kept_only_if_asked_for() {
    let build = |across| {
        Loader::builder(Numbers::new(500))
            .batch_size(16)
            .shuffle(5)
            .workers(3)
            .prefetch(6)
            .prefetch_across_epochs(across)
            .shard(0, 1)
            .build()
            .unwrap()
    };
    let mut plain = build(false);
    let mut ahead = build(true);
    for epoch in [0, 1, 2, 7, 8] {
        plain.set_epoch(epoch);
        ahead.set_epoch(epoch);
        assert_eq!(epoch_of(&mut ahead), epoch_of(&mut plain), "epoch {epoch}");
    }
    // At the end of an epoch, batches of the next one are in flight already.
    assert!(ahead.stats().in_flight > 0);
    assert_eq!(plain.stats().in_flight, 0);
}

#[test]
fn a_dataset_that_panics_fails_its_batch_and_does_not_hang() {
    struct Fragile(Numbers);
    impl Dataset for Fragile {
        fn len(&self) -> u64 {
            self.0.len()
        }
        fn schema(&self) -> &Schema {
            self.0.schema()
        }
        fn get(&self, index: u64) -> Result<Sample<'_>> {
            if index == 7 {
                panic!("disk on fire at {index}");
            }
            self.0.get(index)
        }
    }
    let mut l = Loader::builder(Fragile(Numbers::new(40)))
        .batch_size(5)
        .workers(2)
        .shard(0, 1)
        .build()
        .unwrap();
    // Keep the outcomes, not the batches (holding every batch would exhaust the pool).
    let results: Vec<_> = l.by_ref().map(|r| r.map(|b| b.len())).collect();
    assert_eq!(results.len(), 8);
    let e = results[1].as_ref().unwrap_err();
    assert!(
        matches!(
            e,
            Error::Sample {
                index: 7,
                batch: 1,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("disk on fire"), "{e}");
    for (k, r) in results.iter().enumerate() {
        assert!(k == 1 || r.is_ok(), "batch {k}: {:?}", r.as_ref().err());
    }
}

// ---- No batch lost or repeated at the budget or at resume ----

fn numbers_of(batch: &gpufeed::Batch) -> u64 {
    batch.number()
}

/// One batch of `Numbers` with `batch` samples takes one 4 KiB pool block.
const ONE_BLOCK: u64 = 4096;

#[test]
fn a_budget_of_exactly_one_batch_delivers_every_batch() {
    let mut l = Loader::builder(Numbers::new(100))
        .batch_size(10)
        .workers(2)
        .pool_budget(ONE_BLOCK)
        .shard(0, 1)
        .build()
        .unwrap();
    // The README's loop: each batch is dropped at the end of its iteration.
    let mut got = Vec::new();
    for batch in l.by_ref() {
        got.push(values(&batch.unwrap()));
    }
    assert_eq!(got.len(), 10);
    assert_eq!(
        got.concat(),
        (0..100).map(|i| i * 3 + 1).collect::<Vec<_>>()
    );
}

#[test]
fn asking_past_the_budget_is_an_error_that_costs_no_batch() {
    // The default budget with one worker and prefetch 2: 4 batches' worth of buffers.
    let mut l = Loader::builder(Numbers::new(200))
        .batch_size(10)
        .workers(1)
        .prefetch(2)
        .shard(0, 1)
        .build()
        .unwrap();
    let mut held: Vec<gpufeed::Batch> = (0..4).map(|_| l.next().unwrap().unwrap()).collect();
    assert_eq!(
        held.iter().map(numbers_of).collect::<Vec<_>>(),
        [0, 1, 2, 3]
    );
    // A fifth while holding all four: an error naming the budget, raised before waiting.
    let err = l.next().unwrap().unwrap_err();
    match &err {
        Error::InvalidConfig { setting, what } => {
            assert_eq!(*setting, "pool_budget");
            assert!(what.contains("holds 4"), "{what}");
        }
        other => panic!("expected a pool_budget error, got {other:?}"),
    }
    assert_eq!(
        l.state().next_batch,
        4,
        "the refused call delivered nothing"
    );
    // Asking again while still holding them ends the iteration (a `for` loop or `collect`
    // stops instead of receiving the error forever), and still costs nothing.
    assert!(l.next().is_none());
    assert_eq!(l.state().next_batch, 4);
    // `next_timeout`, which a polling caller uses, reports the error again.
    assert!(matches!(
        l.next_timeout(std::time::Duration::from_millis(10)),
        gpufeed::Next::Ready(Err(Error::InvalidConfig { .. }))
    ));
    // Dropping a batch lifts it: the rest of the epoch comes.
    held.truncate(1);
    let rest: Vec<u64> = l.by_ref().map(|b| numbers_of(&b.unwrap())).collect();
    assert_eq!(rest, (4..20).collect::<Vec<_>>());
    assert_eq!(l.state().next_batch, 20);
}

#[test]
fn keeping_the_last_two_batches_with_prefetch_one_loses_nothing() {
    let mut l = Loader::builder(Numbers::new(200))
        .batch_size(10)
        .workers(2)
        .prefetch(1)
        .shard(0, 1)
        .build()
        .unwrap();
    let mut last_two = std::collections::VecDeque::new();
    let mut seen = Vec::new();
    for batch in l.by_ref() {
        let batch = batch.unwrap();
        seen.push(batch.number());
        last_two.push_back(batch);
        if last_two.len() > 2 {
            last_two.pop_front();
        }
    }
    assert_eq!(seen, (0..20).collect::<Vec<_>>());
}

/// The README's loop over epochs `start..end`, with `set_epoch` at the top of each epoch,
/// stopping (the crash) after `stop` batches in all when given, while holding the last `hold`
/// batches. Returns what was delivered, as (epoch, batch number, values).
fn readme_loop(
    loader: &mut Loader,
    start: u64,
    end: u64,
    stop: Option<usize>,
    hold: usize,
) -> Vec<(u64, u64, Vec<u64>)> {
    let mut out = Vec::new();
    let mut held = std::collections::VecDeque::new();
    for epoch in start..end {
        loader.set_epoch(epoch);
        loop {
            // The crash comes between steps: after a batch was used, before the next is asked.
            if stop == Some(out.len()) {
                return out;
            }
            let Some(batch) = loader.next() else { break };
            let batch = batch.unwrap();
            out.push((batch.epoch(), batch.number(), values(&batch)));
            held.push_back(batch);
            while held.len() > hold {
                held.pop_front();
            }
        }
    }
    out
}

#[test]
fn resume_then_set_epoch_of_the_state_continues_that_epoch() {
    let build = |state: Option<LoaderState>| {
        let b = Loader::builder(Numbers::new(95))
            .batch_size(10)
            .shuffle(7)
            .workers(2)
            .shard(0, 1);
        match state {
            Some(s) => b.resume(s),
            None => b,
        }
        .build()
        .unwrap()
    };
    let whole = readme_loop(&mut build(None), 0, 3, None, 0);
    assert_eq!(whole.len(), 30);
    let mut first = build(None);
    let before = readme_loop(&mut first, 0, 3, Some(14), 0);
    let state = first.state();
    assert_eq!((state.epoch, state.next_batch), (1, 4));
    drop(first);
    // One loop for fresh and resumed runs: start at the state's epoch, set_epoch at the top.
    let mut resumed = build(Some(state.clone()));
    let after = readme_loop(&mut resumed, state.epoch, 3, None, 0);
    let mut joined = before;
    joined.extend(after);
    assert_eq!(joined, whole);
}

#[test]
fn load_state_on_a_running_loader_continues_from_the_state() {
    let mut l = Loader::builder(Numbers::new(95))
        .batch_size(10)
        .shuffle(7)
        .workers(2)
        .shard(0, 1)
        .build()
        .unwrap();
    let whole = readme_loop(&mut l, 0, 2, None, 0);
    l.set_epoch(0);
    let _ = l.next();
    let state = LoaderState {
        epoch: 1,
        next_batch: 6,
        start: 0,
        order: l.order_spec().clone(),
        tokens: None,
        fingerprint: None,
    };
    l.load_state(state).unwrap();
    let rest = readme_loop(&mut l, 1, 2, None, 0);
    assert_eq!(rest, whole[16..]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]
    /// Any stop point, the caller holding 0..3 batches when it stops, resumed with other worker
    /// and prefetch counts, twice in a row: delivered + resumed = the uninterrupted run.
    #[test]
    fn the_readme_loop_resumes_exactly_twice_in_a_row(
        len in 1u64..300, batch in 1usize..32, seed: u64, drop_last: bool, across: bool,
        stops in (0.0f64..1.0, 0.0f64..1.0), holds in (0usize..3, 0usize..3),
        workers in (1usize..5, 1usize..5, 1usize..5), prefetch in (1usize..6, 1usize..6, 1usize..6),
    ) {
        const EPOCHS: u64 = 3;
        let build = |workers: usize, prefetch: usize, state: Option<LoaderState>| {
            let b = Loader::builder(Numbers::new(len)).batch_size(batch).shuffle(seed)
                .workers(workers).prefetch(prefetch).drop_last(drop_last)
                .prefetch_across_epochs(across).shard(0, 1);
            match state { Some(s) => b.resume(s), None => b }.build()
        };
        let Ok(mut full) = build(workers.0, prefetch.0, None) else { return Ok(()) };
        let whole = readme_loop(&mut full, 0, EPOCHS, None, 0);
        let stop1 = (whole.len() as f64 * stops.0) as usize;
        let mut run = build(workers.0, prefetch.0, None).unwrap();
        let mut got = readme_loop(&mut run, 0, EPOCHS, Some(stop1), holds.0);
        let saved = serde_json::to_string(&run.state()).unwrap();
        drop(run);
        let state: LoaderState = serde_json::from_str(&saved).unwrap();
        let mut run = build(workers.1, prefetch.1, Some(state.clone())).unwrap();
        let stop2 = ((whole.len() - got.len()) as f64 * stops.1) as usize;
        let more = readme_loop(&mut run, state.epoch, EPOCHS, Some(stop2), holds.1);
        got.extend(more);
        let state = run.state();
        drop(run);
        let mut run = build(workers.2, prefetch.2, Some(state.clone())).unwrap();
        got.extend(readme_loop(&mut run, state.epoch, EPOCHS, None, 0));
        prop_assert_eq!(got, whole);
    }
}

#[test]
fn sharding_is_explicit_and_shard_from_env_reads_torchrun() {
    // SAFETY: (of set_var) std's environment functions share one lock, so the other tests of
    // this binary that read the environment through std are not racing it; none reads RANK
    // or WORLD_SIZE, and none reads the environment through libc directly.
    unsafe {
        std::env::set_var("RANK", "1");
        std::env::set_var("WORLD_SIZE", "2");
    }
    let whole = Loader::builder(Numbers::new(10))
        .batch_size(4)
        .build()
        .unwrap();
    assert_eq!(
        whole.order_spec().world,
        1,
        "a plain loader reads everything"
    );
    assert_eq!(whole.batches_per_epoch(), 3);
    let mut half = Loader::builder(Numbers::new(10))
        .batch_size(4)
        .shard_from_env()
        .build()
        .unwrap();
    assert_eq!((half.order_spec().rank, half.order_spec().world), (1, 2));
    assert_eq!(epoch_of(&mut half).concat(), [4, 10, 16, 22, 28]);
    // SAFETY: as above.
    unsafe { std::env::set_var("WORLD_SIZE", "two") };
    let err = Loader::builder(Numbers::new(10)).shard_from_env().build();
    assert!(
        matches!(
            err,
            Err(Error::InvalidConfig {
                setting: "WORLD_SIZE",
                ..
            })
        ),
        "{err:?}"
    );
    // SAFETY: as above.
    unsafe {
        std::env::remove_var("RANK");
        std::env::remove_var("WORLD_SIZE");
    }
}

#[test]
fn evaluation_reads_every_sample_once_with_equal_batches_per_rank() {
    let world = 3;
    let mut seen = Vec::new();
    let mut batches = Vec::new();
    for rank in 0..world {
        let mut l = Loader::builder(Numbers::new(100))
            .batch_size(8)
            .shuffle(4)
            .shard(rank, world)
            .evaluation(true)
            .workers(2)
            .build()
            .unwrap();
        let mut n = 0;
        for batch in l.by_ref() {
            let batch = batch.unwrap();
            let mask = batch.mask();
            assert_eq!(mask.len(), batch.len());
            assert_eq!(mask.iter().filter(|m| !**m).count(), batch.padding());
            for (v, real) in values(&batch).into_iter().zip(mask) {
                if real {
                    seen.push(v);
                }
            }
            n += 1;
        }
        batches.push(n);
    }
    // 100 samples over 3 ranks: 34 slots each, 2 of them padding; 5 batches each.
    assert_eq!(batches, [5, 5, 5]);
    seen.sort_unstable();
    assert_eq!(seen, (0..100).map(|i| i * 3 + 1).collect::<Vec<_>>());
    let both = Loader::builder(Numbers::new(10))
        .evaluation(true)
        .drop_last(true)
        .build();
    assert!(matches!(
        both,
        Err(Error::InvalidConfig {
            setting: "evaluation",
            ..
        })
    ));
}

#[test]
fn sizes_beyond_the_machine_are_refused_at_build_naming_the_setting() {
    let setting = |r: Result<Loader>| match r {
        Err(Error::InvalidConfig { setting, .. }) => setting,
        other => panic!("expected InvalidConfig, got {other:?}"),
    };
    let b = || Loader::builder(Numbers::new(100));
    assert_eq!(setting(b().workers(10_000).build()), "workers");
    assert_eq!(setting(b().prefetch(1usize << 50).build()), "prefetch");
    assert_eq!(setting(b().pool_budget(u64::MAX).build()), "pool_budget");
    // A batch larger than the machine (sample bytes times a huge batch size, over a data set
    // that has the samples: a batch never holds more than the data set).
    let huge = || Loader::builder(Lengthy(1 << 61));
    assert_eq!(
        setting(huge().batch_size(1usize << 60).build()),
        "batch_size"
    );
}

/// A data set of `.0` samples of 8 bytes that it never has to produce: for settings refused
/// at build.
struct Lengthy(u64);

impl Dataset for Lengthy {
    fn len(&self) -> u64 {
        self.0
    }
    fn schema(&self) -> &Schema {
        static SCHEMA: std::sync::OnceLock<Schema> = std::sync::OnceLock::new();
        SCHEMA.get_or_init(|| Schema::new(vec![Field::tensor("x", DType::U64, &[])]).unwrap())
    }
    fn get(&self, index: u64) -> Result<Sample<'_>> {
        Err(Error::OutOfRange { index, len: self.0 })
    }
}

#[test]
fn a_batch_larger_than_the_data_set_is_sized_for_the_samples_there_are() {
    // 1,024 samples, batches of 100,000: one batch of 1,024 an epoch, in buffers of 1,024.
    let mut l = Loader::builder(Numbers::new(1024))
        .batch_size(100_000)
        .workers(2)
        .build()
        .unwrap();
    assert_eq!(l.layout().batch_size(), 1024);
    assert_eq!(l.batches_per_epoch(), 1);
    let epoch = epoch_of(&mut l);
    assert_eq!(epoch.len(), 1);
    assert_eq!(epoch[0], (0..1024).map(|i| i * 3 + 1).collect::<Vec<_>>());
    let stats = l.stats();
    let buffer = l.layout().total_bytes() as u64;
    assert!(buffer < 2 * 1024 * 8 + 4096, "{buffer} bytes a buffer");
    assert!(
        stats.pool.peak_reserved_bytes <= (l.prefetch() as u64 + 2) * buffer.next_power_of_two(),
        "{}",
        stats.pool
    );
    // What one rank delivers: 1,024 over 3 ranks is 342 slots each (padded).
    let l = Loader::builder(Numbers::new(1024))
        .batch_size(100_000)
        .shard(2, 3)
        .build()
        .unwrap();
    assert_eq!(l.layout().batch_size(), 342);
    // Evaluation pads with masked slots: 342 again, the last one of rank 2's masked.
    let mut l = Loader::builder(Numbers::new(1024))
        .batch_size(100_000)
        .shard(2, 3)
        .evaluation(true)
        .build()
        .unwrap();
    assert_eq!(l.layout().batch_size(), 342);
    let batch = l.next().unwrap().unwrap();
    assert_eq!((batch.len(), batch.padding()), (342, 1));
    // Batches of the data set's size or less are as asked.
    let l = Loader::builder(Numbers::new(1024))
        .batch_size(1000)
        .build()
        .unwrap();
    assert_eq!(l.layout().batch_size(), 1000);
    // With drop_last, a batch larger than a rank's share leaves nothing to deliver: refused,
    // saying so, before any buffer is made.
    let e = Loader::builder(Numbers::new(1024))
        .batch_size(100_000)
        .drop_last(true)
        .build()
        .unwrap_err();
    assert!(
        matches!(
            &e,
            Error::InvalidConfig {
                setting: "drop_last",
                what,
            } if what.contains("1024 samples") && what.contains("no batch")
        ),
        "{e}"
    );
}

#[test]
fn workers_start_at_build_and_set_epoch_at_the_start_keeps_their_work() {
    let build = || {
        Loader::builder(Numbers::new(100))
            .batch_size(10)
            .shuffle(2)
            .workers(2)
            .prefetch(4)
            .build()
            .unwrap()
    };
    let mut l = build();
    assert_eq!(
        l.stats().in_flight,
        4,
        "batches are under way before the first next()"
    );
    l.set_epoch(0);
    assert_eq!(
        l.stats().in_flight,
        4,
        "set_epoch of the epoch at its start keeps them"
    );
    let first = epoch_of(&mut l);
    let mut other = build();
    other.set_epoch(1);
    other.set_epoch(0);
    assert_eq!(first, epoch_of(&mut other));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// An elastic restart: a run of `w1` ranks stops after the same number of batches on every
    /// rank; a run of `w2` ranks resumes from rank 0's state. In evaluation mode every sample
    /// of the epoch must then be seen exactly once over both runs.
    #[test]
    fn a_state_resumes_under_another_world_size(
        len in 1u64..300, batch in 1usize..16, seed: u64, w1 in 1u64..5, w2 in 1u64..5,
        stop_frac in 0.0f64..1.0,
    ) {
        let build = |rank, world, state: Option<LoaderState>| {
            let mut b = Loader::builder(Numbers::new(len)).batch_size(batch).shuffle(seed)
                .shard(rank, world).evaluation(true).workers(2);
            if let Some(s) = state { b = b.resume(s) }
            b.build()
        };
        let Ok(first) = build(0, w1, None) else { return Ok(()) };
        let stop = (first.batches_per_epoch() as f64 * stop_frac) as usize;
        drop(first);
        let mut seen = Vec::new();
        let mut state = None;
        for rank in 0..w1 {
            let mut l = build(rank, w1, None).unwrap();
            for _ in 0..stop {
                let b = l.next().unwrap().unwrap();
                seen.extend(values(&b).into_iter().zip(b.mask()).filter(|x| x.1).map(|x| x.0));
            }
            state.get_or_insert(l.state());
        }
        let state = state.unwrap();
        let mut batches = None;
        for rank in 0..w2 {
            let Ok(mut l) = build(rank, w2, Some(state.clone())) else { return Ok(()) };
            let mut n = 0;
            for b in l.by_ref() {
                let b = b.unwrap();
                seen.extend(values(&b).into_iter().zip(b.mask()).filter(|x| x.1).map(|x| x.0));
                n += 1;
            }
            // Every new rank gets the same number of batches.
            prop_assert_eq!(*batches.get_or_insert(n), n);
        }
        seen.sort_unstable();
        prop_assert_eq!(seen, (0..len).map(|i| i * 3 + 1).collect::<Vec<_>>());
    }
}

#[test]
fn a_two_level_shuffle_reads_shards_a_window_at_a_time() {
    // Ten shards of 50 samples: a window of 2 shards, blocks of 10 samples.
    let shards: Vec<Numbers> = (0..10).map(|_| Numbers::new(50)).collect();
    let data = gpufeed::Concat::new(shards).unwrap();
    let mut l = Loader::builder(data)
        .batch_size(25)
        .shuffle(3)
        .shuffle_blocks(2, 10)
        .workers(3)
        .build()
        .unwrap();
    let mut shard_sets = Vec::new();
    let mut count = 0;
    for b in l.by_ref() {
        let b = b.unwrap();
        count += b.len();
        // Each batch holds samples of the shards of one window only (the windows divide
        // into whole batches here: 100 samples, batches of 25).
        let mut shards: Vec<u64> = b.indices().iter().map(|i| i / 50).collect();
        shards.sort_unstable();
        shards.dedup();
        assert!(shards.len() <= 2, "batch {}: shards {shards:?}", b.number());
        shard_sets.push(shards);
    }
    assert_eq!(count, 500);
    let refused = Loader::builder(Numbers::new(10))
        .shuffle(1)
        .shuffle_blocks(2, 2)
        .build();
    assert!(matches!(
        refused,
        Err(Error::InvalidConfig {
            setting: "shuffle_window",
            ..
        })
    ));
}

#[test]
fn a_dataset_that_asks_hears_every_sample_ahead_in_order() {
    use std::sync::Mutex;
    struct Listening {
        inner: Numbers,
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
            3
        }
        fn read_ahead(&self, indices: &[u64]) {
            self.heard.lock().unwrap().extend_from_slice(indices);
        }
    }
    let data = Arc::new(Listening {
        inner: Numbers::new(95),
        heard: Mutex::new(Vec::new()),
    });
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
    // Nothing is announced before the first batch is delivered (its reads come first); then
    // every sample of the batches not yet in flight (batches 0 and 1 were dispatched at
    // build, with prefetch 2), once, in the order it is read.
    assert_eq!(*data.heard.lock().unwrap(), order[20..]);
}

#[test]
fn a_data_file_replaced_between_epochs_fails_the_next_epoch_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.npy");
    let write = |value: u8| {
        let mut b = gpufeed::source::npy_header(DType::U8, &[20, 4]).unwrap();
        b.extend_from_slice(&[value; 80]);
        let tmp = dir.path().join("x.npy.tmp");
        std::fs::write(&tmp, b).unwrap();
        std::fs::rename(&tmp, &path).unwrap(); // as np.save to a temporary then a rename
    };
    write(1);
    let mut l = Loader::builder(gpufeed::NpyArray::open(&path).unwrap())
        .batch_size(5)
        .workers(2)
        .build()
        .unwrap();
    assert_eq!(l.by_ref().filter(|b| b.is_ok()).count(), 4);
    write(2);
    l.set_epoch(1);
    let e = l.next().unwrap().unwrap_err();
    assert!(matches!(e, Error::FileChanged { .. }), "{e}");
    assert!(e.to_string().contains("x.npy"), "{e}");
    // The error is given once; then the iteration ends, so that `collect` cannot run forever.
    assert!(l.next().is_none());
    assert_eq!(
        l.state().next_batch,
        0,
        "nothing of the epoch was delivered"
    );
    // Every epoch asked for says so again, until the file is reopened.
    l.set_epoch(2);
    let all: Vec<_> = l.by_ref().collect();
    assert_eq!(all.len(), 1);
    assert!(matches!(all[0], Err(Error::FileChanged { .. })));
}

/// `collect` holds every batch: past the budget it must stop with the budget's error, not
/// receive that error forever (which ran CI out of memory).
#[test]
fn collecting_an_epoch_larger_than_the_budget_ends_with_the_budget_error() {
    let mut l = Loader::builder(Numbers::new(200))
        .batch_size(10)
        .workers(1)
        .prefetch(2)
        .shard(0, 1)
        .build()
        .unwrap();
    let all: Vec<_> = l.by_ref().collect();
    let ok = all.iter().filter(|b| b.is_ok()).count();
    assert_eq!(ok, 4, "the default budget with prefetch 2 is 4 batches");
    assert_eq!(all.len(), 5, "the budget's error once, then the end");
    assert!(matches!(
        all[4],
        Err(Error::InvalidConfig {
            setting: "pool_budget",
            ..
        })
    ));
    assert_eq!(l.state().next_batch, 4, "no batch was lost to the error");
    drop(all);
    // With the batches dropped, the same loop goes on from batch 4.
    let rest: Vec<u64> = l.by_ref().map(|b| numbers_of(&b.unwrap())).collect();
    assert_eq!(rest, (4..20).collect::<Vec<_>>());
}
