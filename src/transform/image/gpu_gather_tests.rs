//! The host half of the GPU decode, without a GPU: what the workers gather for each sample
//! (the route by kind of image, the JPEG's bytes, the crop and flip the CPU path draws, the
//! worker's own pixels for what nvJPEG cannot decode), and what they refuse before decoding.
//! These tests live in the crate: the records are the protocol between the workers and the
//! GPU stage, which no user reads.

use std::sync::Arc;

use super::gpu::META_BYTES;
use super::{Decode, ImageTransform, Layout, OnBadImage, Route, SampleRecord, crop};
use crate::source::{Dataset, ImageFolder};
use crate::{BatchStream, Error, Loader, SampleContext};

#[path = "../../../tests/image_common/mod.rs"]
mod image_common;

fn route_of(name: &str) -> Route {
    match name {
        n if n.starts_with("baseline") || n == "gray.jpg" => Route::Hardware,
        "progressive_420.jpg" => Route::Gpu,
        _ => Route::Pixels,
    }
}

#[test]
fn the_gather_records_the_cpu_paths_crop_and_flip_and_routes_each_kind() {
    let dir = tempfile::tempdir().unwrap();
    image_common::kinds_folder(dir.path(), 3);
    let seed = 7;
    let t = Arc::new(
        ImageTransform::train(32)
            .decode(Decode::Gpu)
            .cpu_share(Some(0.0))
            .build()
            .unwrap(),
    );
    assert!(t.decide_decode(Ok(())).unwrap());
    let data = ImageFolder::open(dir.path()).unwrap();
    let folder = ImageFolder::open(dir.path()).unwrap();
    let mut loader = Loader::builder(data)
        .transform(Arc::clone(&t))
        .batch_size(5)
        .shuffle(seed)
        .workers(2)
        .shard(0, 1)
        .build()
        .unwrap();
    // The CPU path's own pixels, u8 HWC, for the samples the workers decode.
    let cpu = ImageTransform::train(32)
        .layout(Layout::Hwc)
        .build()
        .unwrap();
    let (mut seen, mut routes) = (0, std::collections::BTreeMap::new());
    for epoch in 0..2 {
        loader.set_epoch(epoch);
        for batch in loader.by_ref() {
            let batch = batch.unwrap();
            let meta = batch.field_bytes("image.meta").unwrap();
            let records = batch.field_bytes("image.records").unwrap();
            let cap = records.len() / batch.len();
            for (p, &index) in batch.indices().iter().enumerate() {
                let r = SampleRecord::read(&meta[p * META_BYTES..]).unwrap();
                let sample = folder.get(index).unwrap();
                let path = std::str::from_utf8(sample.field_named("path").unwrap())
                    .unwrap()
                    .to_owned();
                let name = path.rsplit('/').next().unwrap();
                let bytes = sample.field_named("image").unwrap();
                assert_eq!(r.route, route_of(name), "{path}");
                *routes.entry(format!("{:?}", r.route)).or_insert(0) += 1;
                let record = &records[p * cap..p * cap + r.len as usize];
                let ctx = SampleContext {
                    index,
                    position: p,
                    batch: batch.number(),
                    epoch,
                    seed,
                };
                if r.route == Route::Pixels {
                    let mut want = vec![0u8; 32 * 32 * 3];
                    cpu.apply_image(bytes, &path, &ctx, &mut want).unwrap();
                    assert_eq!(
                        record,
                        &want[..],
                        "{path}: the worker's pixels are the CPU path's"
                    );
                    assert_eq!((r.width, r.height, r.flip), (32, 32, false));
                } else {
                    assert_eq!(record, bytes, "{path}: the record holds the JPEG as it is");
                    let mut rng = ctx.rng();
                    let b = crop::random_resized_crop(
                        90,
                        120,
                        (0.08, 1.0),
                        (3.0 / 4.0, 4.0 / 3.0),
                        &mut rng,
                    );
                    let flip = rng.next_f64() < 0.5;
                    assert_eq!(r.region, b.into(), "{path}: the CPU path's crop");
                    assert_eq!(r.flip, flip, "{path}: the CPU path's flip");
                    assert_eq!((r.width, r.height), (120, 90));
                }
                // Past the record, the slot is zeroed.
                assert!(
                    records[p * cap + r.len as usize..(p + 1) * cap]
                        .iter()
                        .all(|&b| b == 0)
                );
                seen += 1;
            }
        }
    }
    assert_eq!(seen, 2 * 21);
    assert_eq!(routes.get("Hardware"), Some(&(2 * 12)), "{routes:?}");
    assert_eq!(routes.get("Gpu"), Some(&(2 * 3)), "{routes:?}");
    assert_eq!(routes.get("Pixels"), Some(&(2 * 6)), "{routes:?}");
    // Batches made ahead of the next epoch count too.
    let counts = t.gpu_stats.snapshot();
    assert!(counts.cpu_unsupported >= 12, "{counts:?}");
    assert_eq!(
        counts.cpu_share, 0,
        "a fixed share of 0 leaves every JPEG to the GPU"
    );
}

/// A baseline JPEG whose frame declares `w` x `h`, with `pad` bytes of scan and an
/// end-of-image marker (`end`).
fn declared_jpeg(w: u16, h: u16, pad: usize, end: bool) -> Vec<u8> {
    let (_, real) = image_common::image_kinds().into_iter().next().unwrap();
    let mut b = real;
    // Rewrite the first SOF0's size.
    let at = b.windows(2).position(|m| m == [0xFF, 0xC0]).unwrap();
    b[at + 5..at + 7].copy_from_slice(&h.to_be_bytes());
    b[at + 7..at + 9].copy_from_slice(&w.to_be_bytes());
    b.truncate(b.len() - 2);
    b.extend(std::iter::repeat_n(0x55u8, pad));
    if end {
        b.extend([0xFF, 0xD9]);
    }
    b
}

#[test]
fn truncated_huge_and_corrupt_jpegs_are_refused_before_any_decode_and_skipped_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let class = dir.path().join("a");
    std::fs::create_dir_all(&class).unwrap();
    let (_, good) = image_common::image_kinds().into_iter().next().unwrap();
    std::fs::write(class.join("0_good.jpg"), &good).unwrap();
    std::fs::write(class.join("1_truncated.jpg"), &good[..good.len() / 2]).unwrap();
    // 60000 x 60000 declared in a few KB: refused by the pixel limit, before anything is
    // allocated for it.
    std::fs::write(
        class.join("2_huge.jpg"),
        declared_jpeg(60000, 60000, 4096, true),
    )
    .unwrap();
    std::fs::write(
        class.join("3_corrupt.jpg"),
        image_common::corrupt_scan_jpeg(),
    )
    .unwrap();
    let run = |policy: OnBadImage| {
        let t = ImageTransform::train(32)
            .decode(Decode::Gpu)
            .on_bad_image(policy)
            .build()
            .unwrap();
        t.decide_decode(Ok(())).unwrap();
        // Deciding for the GPU holds the split (every JPEG to the workers) until a GPU stage
        // has its decoders; there is none here, so the test releases it as the stage would.
        t.split.release();
        Loader::builder(ImageFolder::open(dir.path()).unwrap())
            .transform(t)
            .batch_size(1)
            .workers(1)
            .build()
            .unwrap()
            .collect::<Vec<_>>()
    };
    let batches = run(OnBadImage::Fail);
    assert!(batches[0].is_ok());
    for (k, want) in [
        (1usize, "truncated JPEG"),
        (2, "max_pixels"),
        (3, "component 41"),
    ] {
        match &batches[k] {
            Err(Error::Sample { index, source, .. }) => {
                assert_eq!(*index, k as u64);
                assert!(matches!(**source, Error::Image { .. }), "{source}");
                assert!(source.to_string().contains(want), "{source}");
            }
            other => panic!("sample {k}: {other:?}"),
        }
    }
    let batches = run(OnBadImage::Skip);
    for (k, b) in batches.iter().enumerate() {
        let b = b.as_ref().unwrap();
        let r = SampleRecord::read(b.field_bytes("image.meta").unwrap()).unwrap();
        let label = b.field::<i64>("label").unwrap()[0];
        if k == 0 {
            assert_eq!((r.route, label, b.skipped()), (Route::Hardware, 0, 0));
        } else {
            assert_eq!(
                (r.route, label, b.skipped()),
                (Route::Skipped, -1, 1),
                "sample {k}"
            );
        }
    }
}
