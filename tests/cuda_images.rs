//! The image pipeline through the GPU path: u8 CHW batches copied and normalised to f16 on
//! the device equal the host's own f16 batches (the device image bench is tested in gpufeed-bench).

use crate::cuda_common;
use crate::image_common;

use gpufeed::cuda::{Convert, DeviceLoader, DeviceLoaderOptions};
use gpufeed::source::ImageFolder;
use gpufeed::transform::image::{ImageTransform, Layout, Normalize};
use gpufeed::{DType, Loader};

use cuda_common::device;

fn f16_bits_to_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(2)
        .map(|b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
        .collect()
}

pub fn device_normalised_batches_equal_the_host_ones() {
    let Some(device) = device() else { return };
    let dir = tempfile::tempdir().unwrap();
    image_common::jpeg_folder(dir.path(), 3, 5, 80, 60);
    let (seed, batch) = (11, 4);
    let builder = |t: ImageTransform, workers: usize| {
        Loader::builder(ImageFolder::open(dir.path()).unwrap())
            .transform(t)
            .batch_size(batch)
            .shuffle(seed)
            .workers(workers)
            .shard(0, 1)
    };
    let host_t = ImageTransform::train(32)
        .dtype(DType::F16)
        .normalize(Normalize::IMAGENET)
        .build()
        .unwrap();
    let host: Vec<_> = builder(host_t, 2)
        .build()
        .unwrap()
        .map(|b| {
            let b = b.unwrap();
            let image = f16_bits_to_f32(b.field_bytes("image").unwrap());
            (image, b.field_bytes("label").unwrap().to_vec())
        })
        .collect();

    // u8 CHW on the host, the same normalisation on the device.
    let opts =
        DeviceLoaderOptions::default().convert(Convert::imagenet("image", Layout::Chw, DType::F16));
    let u8_t = ImageTransform::train(32).build().unwrap();
    let feed = DeviceLoader::from_builder(builder(u8_t, 3), &device, opts).unwrap();
    let mut batches = 0;
    for (k, got) in feed.enumerate() {
        let got = got.unwrap();
        let (want_image, want_label) = &host[k];
        let f = got.field_bytes("image").unwrap();
        let len = want_image.len() / (3 * 32 * 32); // 4, and 3 in the last batch
        assert_eq!(got.len(), len);
        assert_eq!(
            (f.dtype(), f.shape().as_slice()),
            (DType::F16, &[len, 3, 32, 32][..])
        );
        let image = f16_bits_to_f32(&got.field_to_host("image").unwrap());
        assert_eq!(image.len(), want_image.len());
        // The host rounds (v / 255 - mean) / std, the device v * a + b (both f32) to f16:
        // at most one f16 step apart, 2^-9 for |x| < 4.
        for (i, (a, b)) in image.iter().zip(want_image).enumerate() {
            assert!(
                (a - b).abs() <= 1.0 / 512.0 + 1e-6,
                "batch {k}, element {i}: device {a}, host {b}"
            );
        }
        assert_eq!(
            &got.field_to_host("label").unwrap(),
            want_label,
            "batch {k}"
        );
        batches += 1;
    }
    assert_eq!(batches, host.len());
    assert_eq!(batches, 4); // 15 images, batches of 4, the last short
}
