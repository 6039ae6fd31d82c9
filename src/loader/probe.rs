//! The sizes of ragged fields' samples, measured before the loader starts, to size a ragged
//! field's byte budget when none is given: the first samples of the loader's order run through
//! the transform, their ragged values set aside and counted.
//!
//! The samples measured are those the first batches will read anyway (the same indices and
//! contexts), so a source that fetches them (shards from object storage) fetches nothing the
//! run would not.

use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::error::{Error, Result};
use crate::layout::{BatchLayout, OutputField, RaggedPart, Slots, words_as_bytes};
use crate::sampler::Order;
use crate::source::Dataset;
use crate::transform::{SampleContext, SampleTransform};

/// Samples measured (at most): enough for a mean and a spread within a few per cent for sizes
/// of the usual spreads, in the time of a few batches.
pub(super) const PROBE_SAMPLES: usize = 128;

/// The sizes, in bytes, that samples of one ragged field took.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct Sizes {
    pub samples: u64,
    pub mean: f64,
    pub std_dev: f64,
    pub max: u64,
}

/// The sizes of the ragged fields of `fields` (by position; `None` for fixed fields) over up
/// to `samples` samples of `order`'s batches from batch `first` on, each written by
/// `transform` as the loader would. A sample that fails is not counted; if none of them could be measured, the error of
/// the first, naming `ragged_budget`.
pub(super) fn measure(
    dataset: &dyn Dataset,
    transform: &dyn SampleTransform,
    fields: &[OutputField],
    (order, first): (&Order, u64),
    samples: usize,
) -> Result<Vec<Option<Sizes>>> {
    // One sample's slots; ragged room of one item, unused: every value goes to the parts'
    // spills, which are unbounded.
    let layout = BatchLayout::with_budgets(fields.to_vec(), 1, |f| Some(f.item_bytes() as u64))?;
    let mut scratch = vec![0u64; layout.total_bytes().div_ceil(8)];
    let mut touched = vec![false; fields.len()];
    let mut sums = vec![(0u64, 0f64, 0f64, 0u64); fields.len()];
    let mut first_error: Option<Error> = None;
    let mut indices = Vec::new();
    let mut measured = 0usize;
    'batches: for b in first..order.batches() {
        order.batch(b, &mut indices);
        for (position, &index) in indices.iter().enumerate() {
            if measured == samples {
                break 'batches;
            }
            measured += 1;
            let ctx = SampleContext {
                index,
                position,
                batch: b,
                epoch: order.epoch(),
                seed: order.spec().shuffle.unwrap_or(0),
            };
            let mut parts = RaggedPart::unbounded(&layout);
            let outcome = catch_unwind(AssertUnwindSafe(|| -> Result<()> {
                let sample = dataset.get(index)?;
                let bytes = words_as_bytes(&mut scratch);
                let mut slots = Slots::new(
                    bytes,
                    layout.fields(),
                    layout.slots(),
                    0,
                    &mut touched,
                    &mut parts,
                );
                transform.apply(sample, &ctx, &mut slots)?;
                slots.check_written(false)
            }));
            match outcome {
                Ok(Ok(())) => {
                    for p in &parts {
                        let bytes = p.bytes() as u64;
                        let s = &mut sums[p.field];
                        s.0 += 1;
                        s.1 += bytes as f64;
                        s.2 += (bytes as f64) * (bytes as f64);
                        s.3 = s.3.max(bytes);
                    }
                }
                Ok(Err(e)) => {
                    first_error.get_or_insert(Error::Sample {
                        index,
                        batch: b,
                        source: Box::new(e),
                    });
                }
                Err(_) => {
                    first_error.get_or_insert(Error::Sample {
                        index,
                        batch: b,
                        source: Box::new(Error::user("the dataset or transform panicked")),
                    });
                }
            }
        }
    }
    fields
        .iter()
        .zip(&sums)
        .map(|(f, &(n, sum, sum_sq, max))| {
            if !f.ragged {
                return Ok(None);
            }
            if n == 0 {
                let why = first_error
                    .as_ref()
                    .map_or_else(|| "the data set has no sample".to_owned(), |e| e.to_string());
                return Err(Error::config(
                    "ragged_budget",
                    format!(
                        "no sample of the first {measured} could be read to size ragged field `{}`'s budget ({why}); set ragged_budget for it",
                        f.name
                    ),
                ));
            }
            let mean = sum / n as f64;
            let var = (sum_sq / n as f64 - mean * mean).max(0.0);
            Ok(Some(Sizes {
                samples: n,
                mean,
                std_dev: var.sqrt(),
                max,
            }))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::format::{Codec, DType, Field, Schema};
    use crate::sampler::{OrderSpec, Remainder};
    use crate::source::Sample;
    use crate::transform::CopyFields;

    struct Texts(Schema);

    impl Dataset for Texts {
        fn len(&self) -> u64 {
            10
        }
        fn schema(&self) -> &Schema {
            &self.0
        }
        fn get(&self, index: u64) -> Result<Sample<'_>> {
            if index == 3 {
                return Err(Error::user("sample 3 is bad"));
            }
            let mut r = Vec::new();
            self.0
                .build_record(&[&vec![b'x'; index as usize * 10], &[index as u8]], &mut r)?;
            Sample::owned(r, &self.0)
        }
    }

    #[test]
    fn sizes_are_those_of_the_samples_read_and_failures_are_not_counted() -> Result<()> {
        let schema = Schema::new(vec![
            Field::bytes("text", Codec::Utf8),
            Field::tensor("id", DType::U8, &[]),
        ])?;
        let dataset = Texts(schema);
        let transform = CopyFields::all();
        let fields = transform.output(dataset.schema())?;
        let spec = OrderSpec {
            len: 10,
            batch_size: 4,
            shuffle: None,
            rank: 0,
            world: 1,
            remainder: Remainder::Wrap,
            blocks: None,
        };
        // Samples 0..6 but 3: 0, 10, 20, 40, 50 bytes.
        let sizes = measure(&dataset, &transform, &fields, (&spec.epoch(0), 0), 6)?;
        assert_eq!(sizes[1], None);
        let s = sizes[0].ok_or_else(|| Error::user("text measured"))?;
        assert_eq!((s.samples, s.max), (5, 50));
        assert!((s.mean - 24.0).abs() < 1e-9, "{s:?}");
        assert!((s.std_dev - 18.547_236_990_991_4).abs() < 1e-6, "{s:?}");
        Ok(())
    }
}
