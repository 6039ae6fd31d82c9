//! The GPU decode (nvJPEG, then gpufeed's resize kernels) against the CPU path: the same
//! batches, pixels within the tolerance for every kind of image, corrupt and huge
//! JPEGs as typed errors (or skipped), resume, and device memory that does not grow.

use gpufeed::cuda::nvjpeg::{self, DecodeOptions};
use gpufeed::cuda::{DeviceLoader, DeviceLoaderOptions};
use gpufeed::source::ImageFolder;
use gpufeed::transform::image::{Decode, ImageTransform, ImageTransformBuilder, OnBadImage};
use gpufeed::{BatchStream, DType, Error, Loader, LoaderBuilder};

use crate::cuda_common::device;
use crate::image_common;

const SEED: u64 = 5;

fn builder(dir: &std::path::Path, t: ImageTransform, batch: usize) -> LoaderBuilder {
    Loader::builder(ImageFolder::open(dir).unwrap())
        .transform(t)
        .batch_size(batch)
        .shuffle(SEED)
        .workers(3)
        .shard(0, 1)
}

/// A temporary ImageFolder of one class, `a`: the folder, and the class's directory.
fn one_class_folder() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let class = dir.path().join("a");
    std::fs::create_dir_all(&class).unwrap();
    (dir, class)
}

fn gpu(t: ImageTransformBuilder) -> ImageTransform {
    t.decode(Decode::Gpu).cpu_share(Some(0.0)).build().unwrap()
}

/// nvJPEG loads, or its absence is the typed error that says how to get it (runs everywhere;
/// with GPUFEED_REQUIRE_GPU=1 it must load).
pub fn nvjpeg_loads_or_says_what_is_missing() {
    match nvjpeg::load() {
        Ok(lib) => {
            eprintln!("nvJPEG {:?} from {}", lib.version(), lib.path());
            assert!(lib.version().0 >= 11, "{:?}", lib.version());
        }
        Err(e @ Error::MissingLibrary { .. }) => {
            assert!(
                std::env::var("GPUFEED_REQUIRE_GPU").as_deref() != Ok("1"),
                "GPUFEED_REQUIRE_GPU=1 but {e}"
            );
            assert!(
                e.to_string().contains("pip install nvidia-nvjpeg-cu12"),
                "{e}"
            );
        }
        Err(other) => panic!("not a MissingLibrary error: {other}"),
    }
}

/// Mean absolute difference and 99.9th percentile of |a - b| over u8 pixels.
/// The bytes of every file under `dir`.
fn walk_sizes(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                walk_sizes(&e.path())
            } else {
                e.metadata().unwrap().len()
            }
        })
        .sum()
}

fn differences(a: &[u8], b: &[u8]) -> (f64, u8) {
    assert_eq!(a.len(), b.len());
    let mut d: Vec<u8> = a.iter().zip(b).map(|(x, y)| x.abs_diff(*y)).collect();
    let mean = d.iter().map(|&v| f64::from(v)).sum::<f64>() / d.len() as f64;
    d.sort_unstable();
    (mean, d[(d.len() * 999 / 1000).min(d.len() - 1)])
}

/// Every kind (baseline 4:2:0, 4:2:2, 4:4:4, progressive, gray, CMYK, PNG), u8 CHW: the same
/// batches, labels and order as the CPU path, pixels within mean 1.0 and 99.9th percentile 8;
/// then f16 normalised within the same tolerance in pixel units.
pub fn gpu_decoded_batches_match_the_cpu_path_for_every_kind() {
    let Some(device) = device() else { return };
    let dir = tempfile::tempdir().unwrap();
    image_common::kinds_folder(dir.path(), 6);
    for (roi, hardware) in [(true, true), (false, true), (true, false)] {
        let host: Vec<_> = builder(dir.path(), ImageTransform::train(64).build().unwrap(), 8)
            .build()
            .unwrap()
            .map(|b| {
                let b = b.unwrap();
                (
                    b.field_bytes("image").unwrap().to_vec(),
                    b.field_bytes("label").unwrap().to_vec(),
                    b.indices().to_vec(),
                )
            })
            .collect();
        let opts = DeviceLoaderOptions::default().decode(DecodeOptions {
            roi,
            hardware,
            ..DecodeOptions::default()
        });
        let mut feed = DeviceLoader::from_builder(
            builder(dir.path(), gpu(ImageTransform::train(64)), 8),
            &device,
            opts,
        )
        .unwrap();
        let (mut all_gpu, mut all_cpu) = (Vec::new(), Vec::new());
        for (k, got) in feed.by_ref().enumerate() {
            let got = got.unwrap();
            let (image, label, indices) = &host[k];
            assert_eq!(got.indices(), &indices[..], "batch {k}: the same samples");
            let f = got.field_bytes("image").unwrap();
            assert_eq!(
                (f.dtype(), f.shape()),
                (DType::U8, vec![got.len(), 3, 64, 64])
            );
            let pixels = got.field_to_host("image").unwrap();
            assert_eq!(&got.field_to_host("label").unwrap(), label, "batch {k}");
            all_gpu.extend_from_slice(&pixels);
            all_cpu.extend_from_slice(image);
        }
        let (mean, p999) = differences(&all_gpu, &all_cpu);
        let report = feed.decode_report().unwrap();
        eprintln!("roi {roi}, hardware {hardware}: mean {mean:.3}, p99.9 {p999}; {report:?}");
        assert!(
            mean <= 1.0 && p999 <= 8,
            "roi {roi}, hardware {hardware}: mean {mean}, p99.9 {p999}"
        );
        assert!(
            report.pooled_memory,
            "nvJPEG's memory comes from the stage's pools"
        );
        assert!(
            report.counts.cpu_unsupported > 0 && report.counts.gpu + report.counts.hardware > 0,
            "{report:?}"
        );
        // What the stage sent to the device: a descriptor per sample at least; at most every
        // file's bytes, an output's pixels per sample (workers' decodes, fallbacks) and each
        // batch's metadata and labels.
        let s = feed.stats();
        let files: u64 = walk_sizes(dir.path());
        let (samples, batches) = (s.samples, s.batches);
        let most = files + samples * (3 * 64 * 64 + 80) + batches * 8 * 128;
        assert!(
            s.h2d_bytes >= 80 * samples && s.h2d_bytes <= most,
            "h2d_bytes {} for {samples} samples, {files} bytes of files",
            s.h2d_bytes
        );
    }
    // f16, normalised: the same values, in pixel units, within the same tolerance.
    let n = gpufeed::transform::image::Normalize::IMAGENET;
    let host: Vec<u8> = builder(dir.path(), ImageTransform::train(64).build().unwrap(), 8)
        .build()
        .unwrap()
        .flat_map(|b| b.unwrap().field_bytes("image").unwrap().to_vec())
        .collect();
    let feed = DeviceLoader::from_builder(
        builder(
            dir.path(),
            gpu(ImageTransform::train(64).dtype(DType::F16).normalize(n)),
            8,
        ),
        &device,
        DeviceLoaderOptions::default(),
    )
    .unwrap();
    let mut back = Vec::new();
    for b in feed {
        let b = b.unwrap();
        let bytes = b.field_to_host("image").unwrap();
        // Back to pixel levels: v = (x * std + mean) * 255, per channel (CHW).
        for (i, h) in bytes.chunks_exact(2).enumerate() {
            let c = (i / (64 * 64)) % 3;
            let x = half::f16::from_bits(u16::from_le_bytes([h[0], h[1]])).to_f32();
            back.push(
                ((x * n.std[c] + n.mean[c]) * 255.0)
                    .round()
                    .clamp(0.0, 255.0) as u8,
            );
        }
    }
    let (mean, p999) = differences(&back, &host);
    assert!(mean <= 1.0 && p999 <= 8, "f16: mean {mean}, p99.9 {p999}");
}

/// Corrupt and truncated JPEGs: a typed error naming the sample, the next batches unharmed (no
/// device fault, no poisoned context); under Skip, counted, zeroed, labelled -1.
pub fn corrupt_jpegs_are_typed_errors_naming_the_sample_or_skipped() {
    let Some(device) = device() else { return };
    let (dir, class) = one_class_folder();
    let kinds = image_common::image_kinds();
    for i in 0..4 {
        std::fs::write(class.join(format!("{i}_good.jpg")), &kinds[0].1).unwrap();
    }
    std::fs::write(
        class.join("4_corrupt.jpg"),
        image_common::corrupt_scan_jpeg(),
    )
    .unwrap();
    std::fs::write(
        class.join("5_truncated.jpg"),
        &kinds[0].1[..kinds[0].1.len() / 2],
    )
    .unwrap();
    for i in 6..8 {
        std::fs::write(class.join(format!("{i}_good.jpg")), &kinds[3].1).unwrap();
    }
    let seq = |t: ImageTransform| {
        Loader::builder(ImageFolder::open(dir.path()).unwrap())
            .transform(t)
            .batch_size(1)
            .workers(2)
            .shard(0, 1)
    };
    let fail = DeviceLoader::from_builder(
        seq(gpu(ImageTransform::train(32))),
        &device,
        DeviceLoaderOptions::default(),
    )
    .unwrap();
    let results: Vec<_> = fail.collect();
    assert_eq!(results.len(), 8);
    for (k, r) in results.iter().enumerate() {
        match (k, r) {
            (4 | 5, Err(Error::Sample { index, source, .. })) => {
                assert_eq!(*index, k as u64);
                assert!(
                    matches!(**source, Error::Image { .. }),
                    "sample {k}: {source}"
                );
            }
            (4 | 5, other) => panic!("sample {k}: {other:?}"),
            (_, Ok(b)) => assert_eq!(b.field_to_host("image").unwrap().len(), 3 * 32 * 32),
            (_, Err(e)) => panic!("sample {k}: {e}"),
        }
    }
    let skip = DeviceLoader::from_builder(
        seq(gpu(ImageTransform::train(32).on_bad_image(OnBadImage::Skip))),
        &device,
        DeviceLoaderOptions::default(),
    )
    .unwrap();
    for (k, b) in skip.enumerate() {
        let b = b.unwrap();
        let label = i64::from_le_bytes(b.field_to_host("label").unwrap()[..8].try_into().unwrap());
        let image = b.field_to_host("image").unwrap();
        if k == 4 || k == 5 {
            assert_eq!((b.skipped(), label), (1, -1), "sample {k}");
            assert!(image.iter().all(|&v| v == 0), "sample {k} zeroed");
        } else {
            assert_eq!((b.skipped(), label), (0, 0), "sample {k}");
            assert!(image.iter().any(|&v| v != 0), "sample {k} decoded");
        }
    }
}

/// A JPEG declaring 60000 x 60000 is refused by the pixel limit before anything is allocated:
/// the device holds no more memory than for a plain batch.
pub fn huge_declared_jpegs_are_refused_before_allocation() {
    let Some(device) = device() else { return };
    let dir = tempfile::tempdir().unwrap();
    let class = dir.path().join("a");
    std::fs::create_dir_all(&class).unwrap();
    let (_, mut huge) = image_common::image_kinds().into_iter().next().unwrap();
    let at = huge.windows(2).position(|m| m == [0xFF, 0xC0]).unwrap();
    huge[at + 5..at + 9].copy_from_slice(&[0xEA, 0x60, 0xEA, 0x60]);
    huge.truncate(huge.len() - 2);
    huge.extend(std::iter::repeat_n(0u8, 1 << 20));
    huge.extend([0xFF, 0xD9]);
    std::fs::write(class.join("huge.jpg"), &huge).unwrap();
    let before = gpufeed::cuda::reserved_bytes();
    let mut feed = DeviceLoader::from_builder(
        Loader::builder(ImageFolder::open(dir.path()).unwrap())
            .transform(gpu(ImageTransform::train(32)))
            .batch_size(1),
        &device,
        DeviceLoaderOptions::default(),
    )
    .unwrap();
    match feed.next() {
        Some(Err(Error::Sample { source, .. })) => {
            assert!(source.to_string().contains("max_pixels"), "{source}")
        }
        other => panic!("{other:?}"),
    }
    // 60000 x 60000 RGB would be 10.8 GB.
    assert!(gpufeed::cuda::reserved_bytes() < before + (64 << 20));
}

/// A resumed GPU-decode loader delivers the same batches, byte for byte (a fixed split).
pub fn resumed_gpu_decode_delivers_the_same_batches() {
    let Some(device) = device() else { return };
    let dir = tempfile::tempdir().unwrap();
    image_common::kinds_folder(dir.path(), 4);
    let t = || {
        ImageTransform::train(48)
            .decode(Decode::Gpu)
            .cpu_share(Some(0.25))
            .build()
            .unwrap()
    };
    let feed = DeviceLoader::from_builder(
        builder(dir.path(), t(), 4),
        &device,
        DeviceLoaderOptions::default(),
    )
    .unwrap();
    let mut feed = feed;
    let whole: Vec<Vec<u8>> = feed
        .by_ref()
        .map(|b| b.unwrap().field_to_host("image").unwrap())
        .collect();
    let mut first = DeviceLoader::from_builder(
        builder(dir.path(), t(), 4),
        &device,
        DeviceLoaderOptions::default(),
    )
    .unwrap();
    for _ in 0..3 {
        first.next().unwrap().unwrap();
    }
    let state = first.state();
    drop(first);
    let mut resumed = DeviceLoader::from_builder(
        builder(dir.path(), t(), 4).resume(state),
        &device,
        DeviceLoaderOptions::default(),
    )
    .unwrap();
    resumed.set_epoch(0);
    let rest: Vec<Vec<u8>> = resumed
        .by_ref()
        .map(|b| b.unwrap().field_to_host("image").unwrap())
        .collect();
    assert_eq!(rest.len(), whole.len() - 3);
    for (k, (a, b)) in rest.iter().zip(&whole[3..]).enumerate() {
        assert!(a == b, "batch {} differs after the resume", k + 3);
    }
}

/// While nvJPEG's decoders are being made (a measured split, the default), the workers decode
/// every image and the first batch does not wait for them; once made, the GPU takes its share.
/// Every batch arrives, in order, with pixels within the tolerance of the CPU path's.
pub fn the_workers_decode_while_the_decoders_are_made_then_the_gpu_takes_its_share() {
    let Some(device) = device() else { return };
    let (dir, class) = one_class_folder();
    let kinds = image_common::image_kinds();
    for i in 0..64 {
        std::fs::write(class.join(format!("{i:02}.jpg")), &kinds[i % 2].1).unwrap();
    }
    let cpu = |epoch: u64| -> Vec<Vec<u8>> {
        let mut l = builder(dir.path(), ImageTransform::train(32).build().unwrap(), 8)
            .build()
            .unwrap();
        l.set_epoch(epoch);
        l.map(|b| b.unwrap().field_bytes("image").unwrap().to_vec())
            .collect()
    };
    let t = ImageTransform::train(32)
        .decode(Decode::Gpu)
        .build()
        .unwrap();
    let created = std::time::Instant::now();
    let mut feed =
        DeviceLoader::from_builder(builder(dir.path(), t, 8), &device, Default::default()).unwrap();
    let first = feed.next().unwrap().unwrap();
    let first_after = created.elapsed();
    let r = feed.decode_report().unwrap();
    if r.setup.ready_seconds == 0.0 {
        // Not made yet: the first batch (and any the workers made ahead) decoded by them.
        assert_eq!(r.counts.hardware + r.counts.gpu, 0, "{r:?}");
        assert!(r.counts.cpu_share >= 8, "{r:?}");
    } else {
        // Made before the first batch was asked for (a GPU whose nvJPEG sets up quickly).
        eprintln!(
            "the decoders were made in {:.3} s, before the first batch ({first_after:?})",
            r.setup.ready_seconds
        );
    }
    let mut epochs = vec![vec![first.field_to_host("image").unwrap()]];
    let started = std::time::Instant::now();
    let mut epoch = 0;
    loop {
        for b in feed.by_ref() {
            epochs[epoch as usize].push(b.unwrap().field_to_host("image").unwrap());
        }
        let r = feed.decode_report().unwrap();
        // Until the GPU has decoded two epochs' worth of images.
        if r.setup.ready_seconds > 0.0 && r.counts.hardware + r.counts.gpu >= 128 {
            break;
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(60),
            "the GPU decoded nothing in a minute: {r:?}"
        );
        epoch += 1;
        feed.set_epoch(epoch);
        epochs.push(Vec::new());
    }
    let r = feed.decode_report().unwrap();
    eprintln!(
        "first batch after {first_after:?}, {} epochs; {r:?}",
        epochs.len()
    );
    assert!(r.hardware_engines == 0 || r.counts.hardware > 0, "{r:?}");
    for (e, got) in epochs.iter().enumerate() {
        let want = cpu(e as u64);
        assert_eq!(got.len(), want.len(), "epoch {e}: every batch");
        let (mean, p999) = differences(&got.concat(), &want.concat());
        assert!(
            mean <= 1.0 && p999 <= 8,
            "epoch {e}: mean {mean}, p99.9 {p999}"
        );
    }
}

/// The decode's device memory after 50 epochs is what it was after 5 (nvJPEG's buffers and
/// the stage's scratch come from its budgeted pool and are reused; the scratch is sized from the
/// largest images seen, not from each batch's, so the split's and the shuffle's choice of images
/// for each batch, which the automatic split below varies, does not change it), and the device
/// batches' pool stays within the batches that can be alive at once: `depth` in the channel,
/// one in the copy thread's hands, one held here, and those whose decode is still running on
/// the GPU after they were dropped (at most the stage's ring of 3 scratch blocks). That pool
/// never waits for the device: it makes a new buffer when every cached one is still in use,
/// so on the H200 it held 2 buffers after 5 epochs and 3 after 50 in two runs of four.
pub fn device_memory_does_not_grow_over_50_epochs() {
    const DEPTH: usize = 2;
    let Some(device) = device() else { return };
    let dir = tempfile::tempdir().unwrap();
    image_common::kinds_folder(dir.path(), 4);
    let mut feed = DeviceLoader::from_builder(
        builder(
            dir.path(),
            ImageTransform::train(48)
                .decode(Decode::Gpu)
                .build()
                .unwrap(),
            7,
        ),
        &device,
        DeviceLoaderOptions {
            depth: Some(DEPTH),
            ..DeviceLoaderOptions::default()
        },
    )
    .unwrap();
    // This loader's own pools (the decode stage's, the device batches'), not the process's:
    // the other GPU tests run beside this one and allocate and free their own.
    let held = |feed: &DeviceLoader| {
        let decode = feed.decode_report().unwrap().device_pool;
        let batches = feed.stats().device_pool;
        (
            decode.reserved_bytes,
            decode.allocations,
            batches.allocations,
        )
    };
    // The workers decode every image until the stage has made nvJPEG's decoders (about a
    // second, many epochs of this folder): the 50 epochs count from then.
    let ready = |feed: &DeviceLoader| feed.decode_report().unwrap().setup.ready_seconds > 0.0;
    let started = std::time::Instant::now();
    let mut first = 0;
    while !ready(&feed) {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(60),
            "nvJPEG's decoders were not made in a minute"
        );
        feed.set_epoch(first);
        for b in feed.by_ref() {
            b.unwrap();
        }
        first += 1;
    }
    let mut after_5 = (0, 0, 0);
    for epoch in first..first + 50 {
        feed.set_epoch(epoch);
        for b in feed.by_ref() {
            b.unwrap();
        }
        device.synchronize().unwrap();
        if epoch == first + 4 {
            after_5 = held(&feed);
        }
    }
    let after_50 = held(&feed);
    let report = feed.decode_report().unwrap();
    eprintln!(
        "(decode pool bytes, decode allocations, batch buffers) after 5 epochs {after_5:?}, \
         after 50 {after_50:?}; {report:?}"
    );
    assert!(report.pooled_memory);
    assert!(
        report.counts.hardware + report.counts.gpu > 0,
        "the GPU decoded after its decoders were made: {report:?}"
    );
    assert!(
        after_5.0 > 0,
        "the decode's pool holds its buffers: {after_5:?}"
    );
    assert!(
        after_50.0 <= after_5.0 && after_50.1 == after_5.1,
        "the decode's device memory grew from {after_5:?} to {after_50:?} (bytes, allocations)"
    );
    // Batches alive at once: the channel's, the copy thread's, this loop's, and those still
    // decoding after they were dropped.
    let bound = DEPTH as u64 + 2 + 3;
    assert!(
        after_50.2 <= bound,
        "{} device batch buffers made, more than the {bound} that can be alive at once",
        after_50.2
    );
}
