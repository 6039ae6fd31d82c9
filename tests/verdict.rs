//! The stall verdict names the stage that bounds the rate, on runs made so that one stage is
//! ten times slower than the others: a slow `Dataset::get`, a slow transform, a slow consumer.

use std::time::Duration;

use gpufeed::format::{DType, Field, Schema};
use gpufeed::loader::{Bound, Verdict};
use gpufeed::{
    Dataset, Error, FnTransform, Loader, OutputField, Result, Sample, SampleContext, Slots,
};

/// Sample i: the u64 `i`; `get` takes at least `delay`.
struct Slow {
    data: Vec<u8>,
    schema: Schema,
    delay: Duration,
}

impl Dataset for Slow {
    fn len(&self) -> u64 {
        self.data.len() as u64 / 8
    }
    fn schema(&self) -> &Schema {
        &self.schema
    }
    fn get(&self, index: u64) -> Result<Sample<'_>> {
        std::thread::sleep(self.delay);
        let i = index as usize;
        let bytes = self.data.get(i * 8..i * 8 + 8).ok_or(Error::OutOfRange {
            index,
            len: self.len(),
        })?;
        Sample::borrowed(bytes, &self.schema)
    }
}

/// One epoch of 96 samples in batches of 4 with 2 workers, `get` taking `fetch`, the transform
/// `transform`, the consumer `consume` per batch; the verdict at its end.
fn run(fetch: Duration, transform: Duration, consume: Duration) -> Verdict {
    let n = 96u64;
    let dataset = Slow {
        data: (0..n).flat_map(|i| i.to_le_bytes()).collect(),
        schema: Schema::new(vec![Field::tensor("x", DType::U64, &[])]).unwrap(),
        delay: fetch,
    };
    let copy = FnTransform::new(
        vec![OutputField::new("x", DType::U64, &[])],
        move |s: Sample<'_>, _: &SampleContext, slots: &mut Slots<'_>| {
            std::thread::sleep(transform);
            let x = s.field(0).ok_or_else(|| Error::user("no field"))?;
            slots.field(0)?.copy_from_slice(x);
            Ok(())
        },
    );
    let mut loader = Loader::builder(dataset)
        .batch_size(4)
        .workers(2)
        .transform(copy)
        .build()
        .unwrap();
    let mut seen = 0;
    for batch in loader.by_ref() {
        seen += batch.unwrap().len();
        std::thread::sleep(consume);
    }
    assert_eq!(seen as u64, n);
    loader.stats().verdict()
}

const SLOW: Duration = Duration::from_millis(2);
const FAST: Duration = Duration::from_micros(200);

#[test]
fn a_slow_dataset_is_fetch_bound() {
    let v = run(SLOW, FAST, Duration::ZERO);
    assert_eq!(v.bound, Bound::Fetch, "{v}");
    assert!(v.waited > 0.5, "{v}");
    assert!(v.to_string().contains("fetch-bound"), "{v}");
}

#[test]
fn a_slow_transform_is_transform_bound() {
    let v = run(FAST, SLOW, Duration::ZERO);
    assert_eq!(v.bound, Bound::Transform, "{v}");
    assert!(v.to_string().contains("transform-bound"), "{v}");
}

#[test]
fn a_slow_consumer_is_consumer_bound() {
    // A batch takes a worker 4 x (0.2 + 0.2) ms = 1.6 ms; the consumer 10 x that per batch,
    // twice over for two workers.
    let v = run(FAST, FAST, Duration::from_millis(32));
    assert_eq!(v.bound, Bound::Consumer, "{v}");
    assert!(v.waited < 0.05, "{v}");
    assert!(v.to_string().contains("consumer-bound"), "{v}");
}
