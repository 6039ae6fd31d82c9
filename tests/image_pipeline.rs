//! The image pipeline through the loader: geometry and flips exact, determinism across worker
//! counts, ImageFolder labels, packing, and the bad-image policies.

use crate::image_common as common;
use gpufeed::BatchStream;

use common::*;
use gpufeed::format::{DType, RecordFile};
use gpufeed::source::{Dataset, ImageFolder, pack_image_folder};
use gpufeed::transform::SampleContext;
use gpufeed::transform::image::{Decode, ImageTransform, Layout, Normalize, OnBadImage};
use gpufeed::{Error, Loader};
use image::ExtendedColorType as E;

fn batches(loader: Loader) -> Vec<(Vec<u8>, Vec<i64>, Vec<u64>)> {
    loader
        .map(|b| {
            let b = b.unwrap();
            (
                b.field_bytes("image").unwrap().to_vec(),
                b.field::<i64>("label").unwrap().to_vec(),
                b.indices().to_vec(),
            )
        })
        .collect()
}

#[test]
fn image_folder_sorts_classes_and_files_like_torchvision() {
    let dir = tempfile::tempdir().unwrap();
    for (class, files) in [("zebra", &["b.PNG", "a.jpg"][..]), ("ant", &["x.jpeg"][..])] {
        std::fs::create_dir_all(dir.path().join(class).join("sub")).unwrap();
        for f in files {
            let bytes = if f.ends_with("PNG") {
                png(&noisy_rgb(4, 4, 0), 4, 4, E::Rgb8)
            } else {
                jpeg(&noisy_rgb(4, 4, 0), 4, 4, E::Rgb8, 90)
            };
            std::fs::write(dir.path().join(class).join(f), bytes).unwrap();
        }
        std::fs::write(dir.path().join(class).join("notes.txt"), b"skip me").unwrap();
    }
    std::fs::write(
        dir.path().join("zebra/sub/c.jpg"),
        jpeg(&noisy_rgb(4, 4, 0), 4, 4, E::Rgb8, 90),
    )
    .unwrap();
    let f = ImageFolder::open(dir.path()).unwrap();
    assert_eq!(f.classes(), ["ant", "zebra"]);
    assert_eq!(f.len(), 4);
    let got: Vec<(String, u32)> = (0..4)
        .map(|i| (f.relative_path(i).unwrap().to_owned(), f.label(i).unwrap()))
        .collect();
    assert_eq!(
        got,
        [
            ("ant/x.jpeg".into(), 0),
            ("zebra/a.jpg".into(), 1),
            ("zebra/b.PNG".into(), 1),
            ("zebra/sub/c.jpg".into(), 1)
        ]
    );
    let s = f.get(2).unwrap();
    assert_eq!(s.field_named("label").unwrap(), 1i64.to_le_bytes());
    assert_eq!(s.field_named("path").unwrap(), b"zebra/b.PNG");
    assert!(s.field_named("image").unwrap().starts_with(b"\x89PNG"));
    // An empty class is an error naming it, as in torchvision.
    std::fs::create_dir_all(dir.path().join("empty_class")).unwrap();
    let e = ImageFolder::open(dir.path()).unwrap_err().to_string();
    assert!(e.contains("empty_class"), "{e}");
}

fn png_folder(root: &std::path::Path, n: usize, w: u32, h: u32) -> Vec<Vec<u8>> {
    std::fs::create_dir_all(root.join("c")).unwrap();
    (0..n)
        .map(|i| {
            let px = noisy_rgb(w, h, i as u32);
            std::fs::write(root.join(format!("c/{i}.png")), png(&px, w, h, E::Rgb8)).unwrap();
            px
        })
        .collect()
}

#[test]
fn eval_at_the_source_size_is_the_identity_and_flips_are_exact() {
    let dir = tempfile::tempdir().unwrap();
    let px = png_folder(dir.path(), 3, 32, 32);
    // Resize(32) + CenterCrop(32) of a 32x32 image: the image itself.
    let t = ImageTransform::eval(32)
        .resize(32)
        .layout(Layout::Hwc)
        .build()
        .unwrap();
    let loader = Loader::builder(ImageFolder::open(dir.path()).unwrap())
        .transform(t)
        .batch_size(3)
        .workers(1)
        .shard(0, 1)
        .build()
        .unwrap();
    let b = batches(loader);
    assert_eq!(b[0].0, px.concat());
    // RandomResizedCrop with scale (1, 1), ratio (1, 1) on a square image is the whole image;
    // flip(1.0) mirrors it.
    let t = ImageTransform::train(32)
        .scale(1.0, 1.0)
        .ratio(1.0, 1.0)
        .flip(1.0)
        .layout(Layout::Hwc)
        .build()
        .unwrap();
    let loader = Loader::builder(ImageFolder::open(dir.path()).unwrap())
        .transform(t)
        .batch_size(3)
        .workers(2)
        .shard(0, 1)
        .build()
        .unwrap();
    let b = batches(loader);
    let mut want = px.concat();
    gpufeed::transform::image::crop::flip_horizontal(&mut want, 32, 3);
    assert_eq!(b[0].0, want);
    // CHW u8 is the same pixels, transposed.
    let t = ImageTransform::eval(32).resize(32).build().unwrap();
    let loader = Loader::builder(ImageFolder::open(dir.path()).unwrap())
        .transform(t)
        .batch_size(1)
        .workers(1)
        .shard(0, 1)
        .build()
        .unwrap();
    let b = batches(loader);
    let chw = &b[0].0;
    for p in 0..32 * 32 {
        for c in 0..3 {
            assert_eq!(chw[c * 1024 + p], px[0][p * 3 + c]);
        }
    }
}

#[test]
fn same_seed_same_batches_on_1_and_8_workers() {
    let dir = tempfile::tempdir().unwrap();
    jpeg_folder(dir.path(), 3, 7, 96, 64);
    let run = |workers| {
        let t = ImageTransform::train(40)
            .dtype(DType::F16)
            .normalize(Normalize::IMAGENET)
            .build()
            .unwrap();
        let loader = Loader::builder(ImageFolder::open(dir.path()).unwrap())
            .transform(t)
            .batch_size(4)
            .shuffle(7)
            .workers(workers)
            .shard(0, 1)
            .build()
            .unwrap();
        batches(loader)
    };
    let one = run(1);
    assert_eq!(one.len(), 6);
    assert_eq!(one, run(8));
    // Labels follow the classes (7 files each).
    for (_, labels, idx) in &one {
        for (l, i) in labels.iter().zip(idx) {
            assert_eq!(*l, (*i / 7) as i64);
        }
    }
}

#[test]
fn packed_image_folder_reads_back_and_trains_the_same() {
    let dir = tempfile::tempdir().unwrap();
    jpeg_folder(&dir.path().join("imgs"), 2, 5, 50, 30);
    let folder = ImageFolder::open(dir.path().join("imgs")).unwrap();
    let out = dir.path().join("imgs.gfd");
    let mut calls = Vec::new();
    let summary = pack_image_folder(&folder, &out, |n| calls.push(n)).unwrap();
    assert_eq!(summary.records, 10);
    assert_eq!(calls.last(), Some(&10));
    let f = RecordFile::open(&out).unwrap();
    for i in 0..10 {
        let s = f.get(i).unwrap();
        assert_eq!(s.field_named("image").unwrap(), folder.read(i).unwrap());
        assert_eq!(
            s.field_named("label").unwrap(),
            (i as i64 / 5).to_le_bytes()
        );
        let mut size = 30u32.to_le_bytes().to_vec();
        size.extend(50u32.to_le_bytes());
        assert_eq!(s.field_named("size").unwrap(), size);
    }
    let run = |ds: Box<dyn Dataset>| {
        let t = ImageTransform::train(24).build().unwrap();
        batches(
            Loader::builder(ds)
                .transform(t)
                .batch_size(5)
                .shuffle(3)
                .workers(2)
                .shard(0, 1)
                .build()
                .unwrap(),
        )
    };
    assert_eq!(run(Box::new(folder)), run(Box::new(f)));
}

fn folder_with_bad_file(root: &std::path::Path) {
    png_folder(root, 4, 16, 16);
    let good = std::fs::read(root.join("c/1.png")).unwrap();
    std::fs::write(root.join("c/1.png"), &good[..good.len() / 2]).unwrap();
}

#[test]
fn a_bad_image_fails_its_batch_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    folder_with_bad_file(dir.path());
    let t = ImageTransform::train(8).build().unwrap();
    let loader = Loader::builder(ImageFolder::open(dir.path()).unwrap())
        .transform(t)
        .batch_size(2)
        .workers(1)
        .shard(0, 1)
        .build()
        .unwrap();
    let results: Vec<_> = loader.collect();
    let e = results[0].as_ref().unwrap_err();
    assert!(matches!(e, Error::Sample { index: 1, .. }), "{e:?}");
    assert!(e.to_string().contains("c/1.png"), "{e}");
    assert!(results[1].is_ok());
}

#[test]
fn skip_policy_zeroes_the_image_sets_label_minus_one_and_counts() {
    let dir = tempfile::tempdir().unwrap();
    folder_with_bad_file(dir.path());
    let t = ImageTransform::train(8)
        .dtype(DType::F32)
        .on_bad_image(OnBadImage::Skip)
        .build()
        .unwrap();
    let stats = t.stats();
    let loader = Loader::builder(ImageFolder::open(dir.path()).unwrap())
        .transform(t)
        .batch_size(4)
        .workers(1)
        .shard(0, 1)
        // Counts of one epoch: no work on the next one ahead of time.
        .prefetch_across_epochs(false)
        .build()
        .unwrap();
    let b = batches(loader);
    assert_eq!(b[0].1, [0, -1, 0, 0]);
    let per = 8 * 8 * 3 * 4;
    assert!(b[0].0[per..2 * per].iter().all(|&x| x == 0));
    assert!(b[0].0[..per].iter().any(|&x| x != 0));
    assert_eq!(stats.skipped(), 1);
    assert_eq!(stats.decoded(), 3);
    assert!(stats.last_skipped().unwrap().contains("c/1.png"));
}

#[test]
fn builder_refuses_settings_that_cannot_work() {
    assert!(ImageTransform::train(0).build().is_err());
    assert!(ImageTransform::train(8).scale(0.5, 0.1).build().is_err());
    assert!(ImageTransform::train(8).flip(2.0).build().is_err());
    assert!(ImageTransform::eval(224).resize(0).build().is_err());
    assert!(ImageTransform::train(8).dtype(DType::I32).build().is_err());
    assert!(
        ImageTransform::train(8)
            .normalize(Normalize::IMAGENET)
            .build()
            .is_err()
    );
}

#[test]
fn eval_center_crop_of_a_jpeg_is_its_decoded_centre() {
    // Resize(96) + CenterCrop(32) of a 96x96 JPEG is its pixels 32..64 in both directions:
    // with the turbojpeg feature, a partial decode whose block starts left of and above the
    // crop. Against zune-jpeg's full decode: different decoders, so a tolerance (mean < 1.5).
    let dir = tempfile::tempdir().unwrap();
    let (w, h) = (96, 96);
    let bytes = jpeg(&smooth_rgb(w, h), w, h, E::Rgb8, 95);
    std::fs::create_dir(dir.path().join("a")).unwrap();
    std::fs::write(dir.path().join("a/x.jpg"), &bytes).unwrap();
    let (mut full, mut scratch) = (Vec::new(), Vec::new());
    gpufeed::codec::decode_rgb8(&bytes, "x", &Default::default(), &mut full, &mut scratch).unwrap();
    let t = ImageTransform::eval(32)
        .resize(96)
        .layout(Layout::Hwc)
        .build()
        .unwrap();
    let loader = Loader::builder(ImageFolder::open(dir.path()).unwrap())
        .transform(t)
        .batch_size(1)
        .workers(1)
        .shard(0, 1)
        .build()
        .unwrap();
    let got = &batches(loader)[0].0;
    let mut sum = 0u64;
    for y in 0..32 {
        for x in 0..32 * 3 {
            let want = full[((32 + y) * 96 + 32) * 3 + x];
            sum += u64::from(got[y * 32 * 3 + x].abs_diff(want));
        }
    }
    let mean = sum as f64 / (32 * 32 * 3) as f64;
    assert!(mean < 1.5, "mean abs diff {mean}");
}

/// RandomResizedCrop with scale (0.08, 0.4) and ratio (2, 3): on a 1x1 image no attempt fits,
/// and the fallback box (width 1, height round(1 / 2) = 0) is empty.
fn empty_box_transform(policy: OnBadImage) -> ImageTransform {
    ImageTransform::train(4)
        .scale(0.08, 0.4)
        .ratio(2.0, 3.0)
        .layout(Layout::Hwc)
        .on_bad_image(policy)
        .build()
        .unwrap()
}

/// The empty fallback box made `apply_image` return `Ok` without writing the
/// slot, so a batch kept an earlier sample's pixels under this sample's label.
#[test]
fn an_empty_crop_box_is_an_image_error_not_stale_pixels() {
    let one = png(&[10, 20, 30], 1, 1, E::Rgb8);
    let t = empty_box_transform(OnBadImage::Fail);
    let mut slot = vec![0xABu8; 4 * 4 * 3];
    for index in 0..32 {
        let ctx = SampleContext {
            index,
            position: 0,
            batch: 0,
            epoch: 0,
            seed: 7,
        };
        match t.apply_image(&one, "one.png", &ctx, &mut slot) {
            Err(Error::Image {
                source_name, what, ..
            }) => {
                assert_eq!(source_name, "one.png");
                assert!(what.contains("empty"), "{what}");
            }
            other => panic!("sample {index}: expected an image error, got {other:?}"),
        }
    }
}

#[test]
fn an_empty_crop_box_is_counted_and_skipped_under_skip() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("c")).unwrap();
    for (i, (w, h)) in [(8, 8), (1, 1), (8, 8)].into_iter().enumerate() {
        let px = noisy_rgb(w, h, i as u32);
        std::fs::write(
            dir.path().join(format!("c/{i}.png")),
            png(&px, w, h, E::Rgb8),
        )
        .unwrap();
    }
    let t = empty_box_transform(OnBadImage::Skip);
    let stats = t.stats();
    let loader = Loader::builder(ImageFolder::open(dir.path()).unwrap())
        .transform(t)
        .batch_size(3)
        .workers(1)
        .shard(0, 1)
        .prefetch_across_epochs(false)
        .build()
        .unwrap();
    let b = batches(loader);
    assert_eq!(b[0].1, [0, -1, 0]);
    let per = 4 * 4 * 3;
    assert!(b[0].0[per..2 * per].iter().all(|&x| x == 0));
    assert_eq!(stats.skipped(), 1);
    assert_eq!(stats.decoded(), 2);
    assert!(stats.last_skipped().unwrap().contains("c/1.png"));
}

#[test]
fn max_pixels_is_a_setting_of_the_transform() {
    let px = noisy_rgb(20, 20, 1);
    let bytes = png(&px, 20, 20, E::Rgb8);
    let ctx = SampleContext {
        index: 0,
        position: 0,
        batch: 0,
        epoch: 0,
        seed: 0,
    };
    let mut slot = vec![0u8; 8 * 8 * 3];
    let small = ImageTransform::train(8).max_pixels(399).build().unwrap();
    match small.apply_image(&bytes, "big.png", &ctx, &mut slot) {
        Err(Error::Image {
            source_name, what, ..
        }) => {
            assert_eq!(source_name, "big.png");
            assert!(what.contains("max_pixels"), "{what}");
        }
        other => panic!("{other:?}"),
    }
    let enough = ImageTransform::eval(8).max_pixels(400).build().unwrap();
    enough
        .apply_image(&bytes, "big.png", &ctx, &mut slot)
        .unwrap();
    let e = ImageTransform::train(8).max_pixels(0).build().unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidConfig {
                setting: "max_pixels",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn skipped_images_are_counted_by_the_batches_that_hold_them() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("images");
    let class = root.join("a");
    std::fs::create_dir_all(&class).unwrap();
    for i in 0..6 {
        let bytes = if i == 3 {
            b"not an image".to_vec()
        } else {
            jpeg(&noisy_rgb(24, 20, i), 24, 20, E::Rgb8, 90)
        };
        std::fs::write(class.join(format!("{i:04}.jpg")), bytes).unwrap();
    }
    let t = ImageTransform::train(8)
        .on_bad_image(OnBadImage::Skip)
        .build()
        .unwrap();
    let mut l = Loader::builder(ImageFolder::open(&root).unwrap())
        .transform(t)
        .batch_size(2)
        .workers(2)
        .build()
        .unwrap();
    // Over three epochs, made ahead or not, the delivered batches hold the bad image 3 times.
    let mut skipped = 0;
    for epoch in 0..3 {
        l.set_epoch(epoch);
        for b in l.by_ref() {
            let b = b.unwrap();
            skipped += b.skipped();
            assert_eq!(b.skipped(), usize::from(b.indices().contains(&3)));
        }
    }
    assert_eq!(skipped, 3);
}

/// One image through `t`, by a loader over a folder of it: the image field's bytes.
fn through(t: ImageTransform, px: &[u8], w: u32, h: u32) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("c")).unwrap();
    std::fs::write(dir.path().join("c/x.png"), png(px, w, h, E::Rgb8)).unwrap();
    let loader = Loader::builder(ImageFolder::open(dir.path()).unwrap())
        .transform(t)
        .batch_size(1)
        .workers(1)
        .shard(0, 1)
        .build()
        .unwrap();
    batches(loader).remove(0).0
}

/// A new user's report: a centre crop that fits the resized image was refused when it
/// was not square: `size=(400, 600), resize=400` on a 600x400 image is torchvision's
/// `Resize(400)` (which leaves it as it is) then `CenterCrop((400, 600))`: the image itself.
#[test]
fn a_non_square_centre_crop_that_fits_the_resized_image_works() {
    let (w, h) = (600, 400);
    let px = noisy_rgb(w, h, 7);
    let t = ImageTransform::eval(224)
        .size(400, 600)
        .resize(400)
        .layout(Layout::Hwc)
        .build()
        .unwrap();
    assert_eq!(through(t, &px, w, h), px);
    // Portrait: 40 wide, 60 high; Resize(40) leaves it, CenterCrop((60, 40)) is all of it and
    // CenterCrop((50, 40)) its rows 5..55.
    let (w, h) = (40, 60);
    let px = noisy_rgb(w, h, 8);
    let eval = |ch: u32, cw: u32| {
        ImageTransform::eval(224)
            .size(ch, cw)
            .resize(40)
            .layout(Layout::Hwc)
            .build()
            .unwrap()
    };
    assert_eq!(through(eval(60, 40), &px, w, h), px);
    let row = (w * 3) as usize;
    assert_eq!(through(eval(50, 40), &px, w, h), px[5 * row..55 * row]);
}

/// A crop larger than the resized image along a side is padded there with zeros, as
/// torchvision's `CenterCrop` pads (`(crop - size) // 2` before, the rest after); along a side
/// where it fits, it is cropped as before. After normalisation the padding is what a zero
/// pixel becomes, as in torchvision, which pads before `ToTensor` and `Normalize`.
#[test]
fn a_centre_crop_larger_than_the_resized_image_is_padded_as_torchvision_pads() {
    // 48 wide, 32 high; Resize(32) leaves it.
    let (w, h) = (48u32, 32u32);
    let px = noisy_rgb(w, h, 9);
    let pixel = |x: u32, y: u32| &px[((y * w + x) * 3) as usize..((y * w + x) * 3 + 3) as usize];
    for (ch, cw) in [(40u32, 56u32), (41, 57), (40, 24), (20, 51)] {
        let t = ImageTransform::eval(224)
            .size(ch, cw)
            .resize(32)
            .layout(Layout::Hwc)
            .build()
            .unwrap();
        let got = through(t, &px, w, h);
        // Per side: padded by (c - r) // 2 when c > r, else cropped at round((r - c) / 2).
        let side = |r: u32, c: u32| -> (i64, u32) {
            if c > r {
                (-i64::from((c - r) / 2), r)
            } else {
                (((f64::from(r - c)) / 2.0).round_ties_even() as i64, c)
            }
        };
        let ((y0, _), (x0, _)) = (side(h, ch), side(w, cw));
        for y in 0..ch {
            for x in 0..cw {
                let (sx, sy) = (i64::from(x) + x0, i64::from(y) + y0);
                let at = ((y * cw + x) * 3) as usize;
                let want: &[u8] =
                    if (0..i64::from(w)).contains(&sx) && (0..i64::from(h)).contains(&sy) {
                        pixel(sx as u32, sy as u32)
                    } else {
                        &[0, 0, 0]
                    };
                assert_eq!(&got[at..at + 3], want, "crop {ch}x{cw}, output ({x}, {y})");
            }
        }
    }
    // Normalised: the padding is (0 - mean) / std.
    let t = ImageTransform::eval(224)
        .size(36, 48)
        .resize(32)
        .layout(Layout::Hwc)
        .dtype(DType::F32)
        .normalize(Normalize::IMAGENET)
        .build()
        .unwrap();
    let got = through(t, &px, w, h);
    let values: Vec<f32> = got
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let n = Normalize::IMAGENET;
    for c in 0..3 {
        let want = -n.mean[c] / n.std[c];
        assert!(
            (values[c] - want).abs() < 1e-5,
            "{} against {want}",
            values[c]
        );
        // Row 2 (inside the image) is the image's first row.
        let inside = values[(2 * 48) * 3 + c];
        let want = (f32::from(pixel(0, 0)[c]) / 255.0 - n.mean[c]) / n.std[c];
        assert!((inside - want).abs() < 1e-2, "{inside} against {want}");
    }
}

/// The same with a JPEG, which the `turbojpeg` feature decodes in part: the padding is zero
/// exactly, the rest is the decoded image's centre (within a tolerance, against zune-jpeg's
/// full decode).
#[test]
fn a_padded_centre_crop_of_a_jpeg_is_its_decoded_image_with_zeros_around() {
    let (w, h) = (48u32, 32u32);
    let bytes = jpeg(&smooth_rgb(w, h), w, h, E::Rgb8, 95);
    let (mut full, mut scratch) = (Vec::new(), Vec::new());
    gpufeed::codec::decode_rgb8(&bytes, "x", &Default::default(), &mut full, &mut scratch).unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("a")).unwrap();
    std::fs::write(dir.path().join("a/x.jpg"), &bytes).unwrap();
    // Resize(32) leaves it; CenterCrop((40, 24)): 4 rows of zeros above and below, columns
    // 12..36 of the image.
    let t = ImageTransform::eval(224)
        .size(40, 24)
        .resize(32)
        .layout(Layout::Hwc)
        .build()
        .unwrap();
    let loader = Loader::builder(ImageFolder::open(dir.path()).unwrap())
        .transform(t)
        .batch_size(1)
        .workers(1)
        .shard(0, 1)
        .build()
        .unwrap();
    let got = &batches(loader)[0].0;
    let row = 24 * 3;
    assert!(got[..4 * row].iter().all(|&v| v == 0));
    assert!(got[36 * row..].iter().all(|&v| v == 0));
    let mut sum = 0u64;
    for y in 0..32 {
        for x in 0..row {
            let want = full[(y * 48 + 12) * 3 + x];
            sum += u64::from(got[(4 + y) * row + x].abs_diff(want));
        }
    }
    let mean = sum as f64 / (32 * row) as f64;
    assert!(mean < 1.5, "mean abs diff {mean}");
}

/// The GPU decode asked of a loader that feeds no GPU is refused, naming the loader that does;
/// `Decode::Auto` decodes on the CPU there. (What the workers gather for the GPU is tested in
/// the crate, `src/transform/image/gpu_gather_tests.rs`: the records are the crate's own.)
#[test]
fn a_host_loader_refuses_the_gpu_decode() {
    let dir = tempfile::tempdir().unwrap();
    common::kinds_folder(dir.path(), 1);
    let t = ImageTransform::train(32)
        .decode(Decode::Gpu)
        .build()
        .unwrap();
    let e = Loader::builder(ImageFolder::open(dir.path()).unwrap())
        .transform(t)
        .build()
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidConfig {
                setting: "decode",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("DeviceLoader::from_builder"), "{e}");
    // Auto decodes on the CPU there.
    let t = ImageTransform::train(32)
        .decode(Decode::Auto)
        .build()
        .unwrap();
    let mut loader = Loader::builder(ImageFolder::open(dir.path()).unwrap())
        .transform(t)
        .batch_size(7)
        .build()
        .unwrap();
    assert_eq!(
        loader.next().unwrap().unwrap().shape("image").unwrap(),
        [7, 3, 32, 32]
    );
}
