//! Settings the loader chooses itself (`Setting::Auto`): the workers from a measurement on the
//! first batches, the prefetch and parts from them; every batch delivered as usual meanwhile.
//!
//! A binary of its own, its tests one at a time (`alone`): a trial measures what the cores
//! give each worker, which other tests' threads would take.

use std::time::Duration;

use gpufeed::format::{DType, Field, Schema};
use gpufeed::loader::Choice;
use gpufeed::{
    Auto, BatchStream, Dataset, Error, FnTransform, Loader, OutputField, Result, Sample,
    SampleContext, Slots,
};

/// Held by each test for its whole run: no two of them measure the cores at once.
fn alone() -> std::sync::MutexGuard<'static, ()> {
    static ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ALONE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Sample i: the u64 `i * 5 + 3`.
struct Numbers(Vec<u8>, Schema);

impl Numbers {
    fn new(n: u64) -> Numbers {
        let schema = Schema::new(vec![Field::tensor("x", DType::U64, &[])]).unwrap();
        Numbers(
            (0..n).flat_map(|i| (i * 5 + 3).to_le_bytes()).collect(),
            schema,
        )
    }
}

impl Dataset for Numbers {
    fn len(&self) -> u64 {
        self.0.len() as u64 / 8
    }
    fn schema(&self) -> &Schema {
        &self.1
    }
    fn get(&self, index: u64) -> Result<Sample<'_>> {
        let i = index as usize;
        let bytes = self.0.get(i * 8..i * 8 + 8).ok_or(Error::OutOfRange {
            index,
            len: self.len(),
        })?;
        Sample::borrowed(bytes, &self.1)
    }
}

/// A copy that takes at least 100 µs a sample: it waits, it does not compute, so that each
/// worker's rate is the same however many run on the two cores of CI.
fn slow_copy() -> FnTransform<
    impl Fn(Sample<'_>, &SampleContext, &mut Slots<'_>) -> Result<()> + Send + Sync + 'static,
> {
    FnTransform::new(
        vec![OutputField::new("x", DType::U64, &[])],
        |s: Sample<'_>, _: &SampleContext, slots: &mut Slots<'_>| {
            std::thread::sleep(Duration::from_micros(100));
            let x = s.field(0).ok_or_else(|| Error::user("no field"))?;
            slots.field(0)?.copy_from_slice(x);
            Ok(())
        },
    )
}

/// Runs `epochs` epochs of `loader`, checking every sample once an epoch, the consumer
/// taking `consume` per batch.
fn run_epochs(loader: &mut Loader, n: u64, epochs: u64, consume: Duration) {
    for epoch in 0..epochs {
        loader.set_epoch(epoch);
        let mut seen = vec![0u32; n as usize];
        for batch in loader.by_ref() {
            let batch = batch.unwrap();
            for (&i, &x) in batch.indices().iter().zip(batch.field::<u64>("x").unwrap()) {
                assert_eq!(x, i * 5 + 3);
                seen[i as usize] += 1;
            }
            std::thread::sleep(consume);
        }
        assert!(seen.iter().all(|&c| c == 1), "epoch {epoch}");
    }
}

#[test]
fn auto_workers_measure_each_count_and_keep_the_fastest_delivering_every_batch() {
    let _alone = alone();
    let n = 4000;
    let mut loader = Loader::builder(Numbers::new(n))
        .batch_size(16)
        .shuffle(1)
        .workers(Auto)
        .cpu_budget(2)
        .transform(slow_copy())
        .build()
        .unwrap();
    run_epochs(&mut loader, n, 2, Duration::ZERO);
    let stats = loader.stats();
    let tuning = stats.tuning.clone().expect("a loader that chooses says so");
    assert!(tuning.chosen, "{}", tuning.reason);
    let measured: Vec<usize> = tuning.trials.iter().map(|t| t.workers).collect();
    assert_eq!(measured, [2, 1], "{}", tuning.reason);
    // Waiting workers: two make twice what one makes, so two are kept.
    assert_eq!(
        (tuning.workers, tuning.choice),
        (2, Some(Choice::Fastest)),
        "{}",
        tuning.reason
    );
    assert_eq!(stats.workers, 2);
    assert!(tuning.seconds <= gpufeed::loader::TUNE_LIMIT.as_secs_f64());
    assert!(stats.to_string().contains("autotune: 2 workers"), "{stats}");
}

#[test]
fn auto_workers_under_a_slow_consumer_keep_the_fewest_that_keep_up() {
    let _alone = alone();
    let n = 1600;
    let trace = gpufeed::trace::Trace::new();
    let mut loader = Loader::builder(Numbers::new(n))
        .batch_size(16)
        .workers(Auto)
        .cpu_budget(4)
        .transform(slow_copy())
        .trace(&trace)
        .build()
        .unwrap();
    // A batch takes a worker 1.6 ms; the consumer takes 5 ms.
    run_epochs(&mut loader, n, 2, Duration::from_millis(5));
    let tuning = loader.stats().tuning.expect("tuning");
    assert!(tuning.chosen, "{}", tuning.reason);
    assert_eq!(tuning.workers, 1, "{}", tuning.reason);
    assert_eq!(
        tuning.choice,
        Some(Choice::ConsumerBound),
        "{}",
        tuning.reason
    );
    // The workers beyond the choice have stopped (dropping the loader joins them all): every
    // batch of the second epoch, made after the choice, was made by the first worker.
    drop(loader);
    let mut text = Vec::new();
    trace.write_to(&mut text).unwrap();
    let doc: serde_json::Value = serde_json::from_slice(&text).unwrap();
    let events = doc["traceEvents"].as_array().unwrap();
    let tid_of = |name: &str| {
        events
            .iter()
            .find(|e| e["name"] == "thread_name" && e["args"]["name"] == name)
            .and_then(|e| e["tid"].as_u64())
            .unwrap()
    };
    let first = tid_of("worker 0");
    let makers: std::collections::BTreeSet<u64> = events
        .iter()
        .filter(|e| e["name"] == "batch" && e["args"]["epoch"] == 1)
        .map(|e| e["tid"].as_u64().unwrap())
        .collect();
    assert_eq!(makers.into_iter().collect::<Vec<_>>(), [first]);
}

#[test]
fn auto_prefetch_and_parts_follow_the_given_workers_within_the_budget() {
    let _alone = alone();
    let n = 256;
    // Batches of 64 KiB samples x 64 = 4 MiB: made in parts by default.
    struct Wide;
    impl Dataset for Wide {
        fn len(&self) -> u64 {
            256
        }
        fn schema(&self) -> &Schema {
            static SCHEMA: std::sync::OnceLock<Schema> = std::sync::OnceLock::new();
            SCHEMA
                .get_or_init(|| Schema::new(vec![Field::tensor("x", DType::U8, &[65536])]).unwrap())
        }
        fn get(&self, _: u64) -> Result<Sample<'_>> {
            static BYTES: [u8; 65536] = [7; 65536];
            Sample::borrowed(&BYTES, self.schema())
        }
    }
    let mut loader = Loader::builder(Wide)
        .batch_size(64)
        .workers(2)
        .prefetch(Auto)
        .batch_parts(Auto)
        .pool_budget(5 * (4 << 20) + 4096)
        .build()
        .unwrap();
    let tuning = loader.stats().tuning.expect("tuning");
    assert!(
        tuning.chosen && tuning.trials.is_empty(),
        "{}",
        tuning.reason
    );
    // 2 workers, 2 parts: 2 * 1 + 2 = 4 batches in flight by the rule, but a budget of 5
    // batches keeps 2 for the caller: 3.
    assert_eq!(
        (tuning.workers, tuning.batch_parts, tuning.prefetch),
        (2, 2, 3),
        "{}",
        tuning.reason
    );
    assert_eq!((loader.prefetch(), loader.batch_parts()), (3, 2));
    let seen: usize = loader.by_ref().map(|b| b.unwrap().len()).sum();
    assert_eq!(seen as u64, n);
}
