//! `Loader::next_timeout`: a timed-out wait moves nothing, and the batches are those of `next`.

use gpufeed::BatchStream;
use std::time::{Duration, Instant};

use gpufeed::format::{DType, Field, Schema};
use gpufeed::{
    Dataset, Error, FnTransform, Loader, Next, OutputField, Result, Sample, SampleContext, Slots,
};

/// Sample i is the little-endian u64 `i`.
struct Counting {
    data: Vec<u8>,
    schema: Schema,
}

impl Counting {
    fn new(n: u64) -> Counting {
        Counting {
            data: (0..n).flat_map(u64::to_le_bytes).collect(),
            schema: Schema::new(vec![Field::tensor("x", DType::U64, &[])]).unwrap(),
        }
    }
}

impl Dataset for Counting {
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

/// Copies `x`, sleeping `delay` per sample.
fn slow(delay: Duration) -> impl gpufeed::SampleTransform {
    FnTransform::new(
        vec![OutputField::new("x", DType::U64, &[])],
        move |s: Sample<'_>, _: &SampleContext, slots: &mut Slots<'_>| {
            std::thread::sleep(delay);
            slots
                .field(0)?
                .copy_from_slice(s.field(0).unwrap_or(&[0; 8]));
            Ok(())
        },
    )
}

#[test]
fn a_timeout_moves_nothing_and_the_batches_are_those_of_next() {
    let build = || {
        Loader::builder(Counting::new(40))
            .batch_size(4)
            .shuffle(7)
            .workers(2)
            .transform(slow(Duration::from_millis(20)))
            .build()
            .unwrap()
    };
    let expected: Vec<Vec<u64>> = build()
        .map(|b| b.unwrap().field::<u64>("x").unwrap().to_vec())
        .collect();
    assert_eq!(expected.len(), 10);

    let mut loader = build();
    let (mut got, mut pending) = (Vec::new(), 0);
    loop {
        let before = loader.state();
        match loader.next_timeout(Duration::from_millis(1)) {
            Next::Ready(batch) => got.push(batch.unwrap().field::<u64>("x").unwrap().to_vec()),
            Next::Pending => {
                pending += 1;
                assert_eq!(loader.state(), before, "a timeout moved the position");
            }
            Next::EndOfEpoch => break,
        }
    }
    // Each batch takes 4 x 20 ms in a worker: a 1 ms wait times out before most of them.
    assert!(pending > 0, "no wait timed out");
    assert_eq!(got, expected);
    assert!(matches!(
        loader.next_timeout(Duration::ZERO),
        Next::EndOfEpoch
    ));
    loader.set_epoch(1);
    assert!(matches!(
        loader.next_timeout(Duration::from_secs(10)),
        Next::Ready(Ok(_))
    ));
}

#[test]
fn a_timeout_returns_close_to_its_deadline() {
    let mut loader = Loader::builder(Counting::new(8))
        .batch_size(8)
        .workers(1)
        .transform(slow(Duration::from_millis(250)))
        .build()
        .unwrap();
    let t0 = Instant::now();
    assert!(matches!(
        loader.next_timeout(Duration::from_millis(50)),
        Next::Pending
    ));
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(50),
        "returned early: {waited:?}"
    );
    // The batch takes 8 x 250 ms: a wait that ends well before it did not wait for it.
    assert!(
        waited < Duration::from_millis(1500),
        "waited for the batch: {waited:?}"
    );
    // The batch still comes, whole.
    match loader.next_timeout(Duration::from_secs(30)) {
        Next::Ready(b) => assert_eq!(
            b.unwrap().field::<u64>("x").unwrap(),
            &[0, 1, 2, 3, 4, 5, 6, 7]
        ),
        other => panic!("expected the batch, got {other:?}"),
    }
}
