//! Transforms as a program of one's own writes them: typed fields by name, the check that each
//! slot was written, output fields derived from the input, and `.npy` arrays zipped as one
//! data set, all through the loader.

use gpufeed::format::{DType, Field, Schema};
use gpufeed::source::{NpyArray, Zip, npy_header};
use gpufeed::{
    Dataset, Error, FnTransform, Loader, OutputField, Result, Sample, SampleContext, Slots,
};

/// Sample i: `x` = [i, i + 0.5] as f32, `label` = i % 3 as u32.
struct Points {
    schema: Schema,
    n: u64,
}

fn points(n: u64) -> Points {
    Points {
        schema: Schema::new(vec![
            Field::tensor("x", DType::F32, &[2]),
            Field::tensor("label", DType::U32, &[]),
        ])
        .unwrap(),
        n,
    }
}

impl Dataset for Points {
    fn len(&self) -> u64 {
        self.n
    }
    fn schema(&self) -> &Schema {
        &self.schema
    }
    fn get(&self, i: u64) -> Result<Sample<'_>> {
        let x = [i as f32, i as f32 + 0.5].map(f32::to_le_bytes).concat();
        let mut record = Vec::new();
        self.schema
            .build_record(&[&x, &(i as u32 % 3).to_le_bytes()], &mut record)
            .map_err(Error::user)?;
        Sample::owned(record, &self.schema)
    }
}

/// The loader's one batch of `n` samples with `transform`, or its error.
fn run(n: u64, transform: impl gpufeed::SampleTransform) -> Result<gpufeed::Batch> {
    let mut loader = Loader::builder(points(n))
        .batch_size(n as usize)
        .workers(1)
        .transform(transform)
        .build()?;
    loader.next().expect("one batch")
}

#[test]
fn a_transform_reads_and_writes_typed_fields_by_name() {
    let t = FnTransform::new(
        vec![
            OutputField::new("scaled", DType::F64, &[2]),
            OutputField::new("label", DType::U32, &[]),
        ],
        |s: Sample<'_>, _: &SampleContext, slots: &mut Slots<'_>| {
            let x = s.field_as::<f32>("x")?;
            for (o, &v) in slots.field_mut::<f64>("scaled")?.iter_mut().zip(x.iter()) {
                *o = f64::from(v) * 2.0;
            }
            slots
                .field_mut::<u32>("label")?
                .copy_from_slice(&s.field_as::<u32>("label")?);
            Ok(())
        },
    );
    let batch = run(6, t).unwrap();
    let scaled = batch.field::<f64>("scaled").unwrap();
    let labels = batch.field::<u32>("label").unwrap();
    for (k, &i) in batch.indices().iter().enumerate() {
        assert_eq!(
            scaled[2 * k..2 * k + 2],
            [i as f64 * 2.0, i as f64 * 2.0 + 1.0]
        );
        assert_eq!(labels[k], i as u32 % 3);
    }
    assert_eq!(batch.len(), 6);
}

/// The sample error of a loader whose transform fails on every sample.
fn sample_error(t: impl gpufeed::SampleTransform) -> Error {
    let e = run(4, t).unwrap_err();
    assert!(matches!(e, Error::Sample { batch: 0, .. }), "{e}");
    e
}

#[test]
fn wrong_types_and_unknown_names_fail_the_sample_naming_the_field() {
    let out = || vec![OutputField::new("y", DType::F32, &[2])];
    let cases: Vec<(std::sync::Arc<dyn gpufeed::SampleTransform>, &str)> = vec![
        (
            std::sync::Arc::new(FnTransform::new(
                out(),
                |s: Sample<'_>, _: &SampleContext, _: &mut Slots<'_>| {
                    s.field_as::<f64>("x").map(drop)
                },
            )),
            "field `x` is f32, not f64",
        ),
        (
            std::sync::Arc::new(FnTransform::new(
                out(),
                |s: Sample<'_>, _: &SampleContext, _: &mut Slots<'_>| {
                    s.field_as::<f32>("z").map(drop)
                },
            )),
            "no field `z`",
        ),
        (
            std::sync::Arc::new(FnTransform::new(
                out(),
                |_: Sample<'_>, _: &SampleContext, slots: &mut Slots<'_>| {
                    slots.field_mut::<u32>("y").map(drop)
                },
            )),
            "output field `y` is f32, not u32",
        ),
        (
            std::sync::Arc::new(FnTransform::new(
                out(),
                |_: Sample<'_>, _: &SampleContext, slots: &mut Slots<'_>| {
                    slots.field_mut::<f32>("x").map(drop)
                },
            )),
            "no output field `x`",
        ),
    ];
    for (t, want) in cases {
        let e = sample_error(t);
        let Error::Sample { source, .. } = &e else {
            unreachable!()
        };
        assert!(matches!(**source, Error::Mismatch { .. }), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains(want) && msg.contains("sample "),
            "`{want}` not in: {msg}"
        );
    }
}

#[test]
fn a_slot_the_transform_never_writes_fails_the_sample() {
    // Writes `a` and forgets `b`: caught in every build.
    let t = FnTransform::new(
        vec![
            OutputField::new("a", DType::U8, &[4]),
            OutputField::new("b", DType::U8, &[]),
        ],
        |_: Sample<'_>, _: &SampleContext, slots: &mut Slots<'_>| {
            slots.field_mut::<u8>("a")?.fill(1);
            Ok(())
        },
    );
    let e = sample_error(t);
    assert!(
        e.to_string().contains("did not write output field `b`"),
        "{e}"
    );
}

#[test]
fn a_skipped_sample_need_not_write_its_slots() {
    let t = FnTransform::new(
        vec![OutputField::new("a", DType::F32, &[8])],
        |s: Sample<'_>, _: &SampleContext, slots: &mut Slots<'_>| {
            if s.field_as::<u32>("label")?[0] == 1 {
                slots.mark_skipped();
                return Ok(());
            }
            slots.field_mut::<f32>("a")?.fill(1.0);
            Ok(())
        },
    );
    let batch = run(6, t).unwrap();
    assert_eq!(batch.skipped(), 2);
}

#[cfg(debug_assertions)]
#[test]
fn a_transform_that_writes_too_few_bytes_fails_the_sample_in_debug_builds() {
    use gpufeed::BatchStream;
    // Writes 15 of the 16 floats of `a`.
    let t = FnTransform::new(
        vec![OutputField::new("a", DType::F32, &[4, 4])],
        |_: Sample<'_>, _: &SampleContext, slots: &mut Slots<'_>| {
            let a = slots.field_mut::<f32>("a")?;
            let n = a.len() - 1;
            a[..n].fill(0.0);
            Ok(())
        },
    );
    let e = sample_error(t);
    assert!(
        e.to_string()
            .contains("did not write bytes 60..64 of output field `a`"),
        "{e}"
    );
    // Writing all 16 passes, batch after batch (a buffer reused from an earlier batch holds
    // that batch's bytes, not the marker, until the next sample's slots are marked).
    let t = FnTransform::new(
        vec![OutputField::new("a", DType::F32, &[4, 4])],
        |s: Sample<'_>, _: &SampleContext, slots: &mut Slots<'_>| {
            slots
                .field_mut::<f32>("a")?
                .fill(s.field_as::<f32>("x")?[0]);
            Ok(())
        },
    );
    let mut loader = Loader::builder(points(40))
        .batch_size(8)
        .workers(2)
        .transform(t)
        .build()
        .unwrap();
    for epoch in 0..2 {
        loader.set_epoch(epoch);
        let mut n = 0;
        for b in loader.by_ref() {
            let b = b.unwrap();
            let a = b.field::<f32>("a").unwrap();
            for (k, &i) in b.indices().iter().enumerate() {
                assert!(a[16 * k..16 * k + 16].iter().all(|&v| v == i as f32));
            }
            n += b.len();
        }
        assert_eq!(n, 40);
    }
}

#[test]
fn output_fields_can_follow_the_input_schema() {
    let t = FnTransform::with_output(
        |input: &Schema| {
            Ok(vec![
                OutputField::like(input, "x")?,
                OutputField::new("norm", DType::F32, &[]),
            ])
        },
        |s: Sample<'_>, _: &SampleContext, slots: &mut Slots<'_>| {
            let x = s.field_as::<f32>("x")?;
            slots.field_mut::<f32>("x")?.copy_from_slice(&x);
            slots.field_mut::<f32>("norm")?[0] = x.iter().map(|v| v * v).sum::<f32>().sqrt();
            Ok(())
        },
    );
    let batch = run(3, t).unwrap();
    assert_eq!(batch.shape("x").unwrap(), [3, 2]);
    assert_eq!(batch.dtype("x").unwrap(), DType::F32);
    assert_eq!(batch.field::<f32>("norm").unwrap().len(), 3);
    // A field the input lacks fails the build, naming it.
    let bad = FnTransform::with_output(
        |input: &Schema| Ok(vec![OutputField::like(input, "nope")?]),
        |_: Sample<'_>, _: &SampleContext, _: &mut Slots<'_>| Ok(()),
    );
    let e = Loader::builder(points(3))
        .transform(bad)
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("no field `nope`"), "{e}");
}

fn write_npy(path: &std::path::Path, dtype: DType, shape: &[u64], data: &[u8]) {
    let mut b = npy_header(dtype, shape).unwrap();
    b.extend_from_slice(data);
    std::fs::write(path, b).unwrap();
}

#[test]
fn npy_arrays_zipped_feed_the_loader_as_one_data_set() {
    let dir = tempfile::tempdir().unwrap();
    let (images, labels) = (dir.path().join("images.npy"), dir.path().join("labels.npy"));
    let pixels: Vec<u8> = (0..50u32).flat_map(|i| [i as u8; 12]).collect();
    write_npy(&images, DType::U8, &[50, 3, 2, 2], &pixels);
    let l: Vec<u8> = (0..50i64).flat_map(|i| (i * 10).to_le_bytes()).collect();
    write_npy(&labels, DType::I64, &[50], &l);
    let data = Zip::npy([("image", &images), ("label", &labels)]).unwrap();
    let mut loader = Loader::builder(data)
        .batch_size(16)
        .shuffle(7)
        .workers(2)
        .build()
        .unwrap();
    let mut seen = 0;
    for b in loader.by_ref() {
        let b = b.unwrap();
        assert_eq!(b.shape("image").unwrap()[1..], [3, 2, 2]);
        let (img, lab) = (
            b.field::<u8>("image").unwrap(),
            b.field::<i64>("label").unwrap(),
        );
        for (k, &i) in b.indices().iter().enumerate() {
            assert!(img[12 * k..12 * k + 12].iter().all(|&p| p == i as u8));
            assert_eq!(lab[k], i as i64 * 10);
        }
        seen += b.len();
    }
    assert_eq!(seen, 50);
}

#[test]
fn zipped_arrays_of_different_lengths_are_refused_naming_both_files() {
    let dir = tempfile::tempdir().unwrap();
    let (images, labels) = (dir.path().join("images.npy"), dir.path().join("labels.npy"));
    write_npy(&images, DType::U8, &[50, 4], &[0; 200]);
    write_npy(&labels, DType::U32, &[49], &[0; 196]);
    let e = Zip::npy([("image", &images), ("label", &labels)]).unwrap_err();
    assert!(matches!(e, Error::Mismatch { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains(&format!("{} has 49 samples", labels.display()))
            && msg.contains(&format!("{} has 50", images.display())),
        "{msg}"
    );
    // Two arrays opened under one name (NpyArray's default `data`).
    let parts = [&images, &images].map(|p| (p.display().to_string(), NpyArray::open(p).unwrap()));
    let e = Zip::new(parts).unwrap_err();
    assert!(e.to_string().contains("field `data` is in both"), "{e}");
}
