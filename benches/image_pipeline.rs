//! Decode + RandomResizedCrop(224) + horizontal flip per image, on one thread.
//!
//! Reads the first 500 JPEGs under `$GPUFEED_JPEG_DIR` (default
//! `/tmp/gpufeed-baseline/jpegs`, as written by `crates/bench/scripts/pil_rrc.py --make` or
//! `../shared/bench/torch_baseline.py`) into memory, or synthesises 500x375 JPEGs if there are
//! none; `crates/bench/scripts/pil_rrc.py` times the same operations through Pillow on the same files.
//!
//! `cargo bench --bench image_pipeline` (add `--features turbojpeg` for the scaled decode).

use std::hint::black_box;
use std::path::Path;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gpufeed::format::DType;
use gpufeed::transform::SampleContext;
use gpufeed::transform::image::{ImageTransform, Layout, Normalize};
use image::ImageEncoder;

fn jpeg_files(dir: &Path, n: usize) -> Vec<Vec<u8>> {
    let mut paths = Vec::new();
    if let Ok(classes) = std::fs::read_dir(dir) {
        for c in classes.flatten() {
            if let Ok(files) = std::fs::read_dir(c.path()) {
                paths.extend(files.flatten().map(|f| f.path()));
            }
        }
    }
    paths.retain(|p| p.extension().is_some_and(|e| e == "jpg"));
    paths.sort();
    paths.truncate(n);
    paths.iter().filter_map(|p| std::fs::read(p).ok()).collect()
}

fn synthetic(n: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|k| {
            let (w, h) = (500u32, 375u32);
            let px: Vec<u8> = (0..w * h * 3)
                .map(|i| {
                    let (x, y) = ((i / 3) % w, (i / 3) / w);
                    let v = (x * (k as u32 + 3) + y * 7 + (x * y) / 97) % 256;
                    v as u8
                })
                .collect();
            let mut out = Vec::new();
            image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, 90)
                .write_image(&px, w, h, image::ExtendedColorType::Rgb8)
                .expect("encode");
            out
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let dir = std::env::var("GPUFEED_JPEG_DIR")
        .unwrap_or_else(|_| "/tmp/gpufeed-baseline/jpegs".to_owned());
    let mut files = jpeg_files(Path::new(&dir), 500);
    if files.is_empty() {
        eprintln!("no JPEGs under {dir}: synthesising 100");
        files = synthetic(100);
    }
    let mut g = c.benchmark_group("image");
    g.throughput(Throughput::Elements(files.len() as u64));
    g.sample_size(10);
    let cases = [
        (
            "decode_rrc224_flip_u8_hwc",
            ImageTransform::train(224).layout(Layout::Hwc).build(),
        ),
        (
            "decode_rrc224_flip_u8_chw",
            ImageTransform::train(224).layout(Layout::Chw).build(),
        ),
        (
            "decode_rrc224_flip_f16_chw_norm",
            ImageTransform::train(224)
                .dtype(DType::F16)
                .normalize(Normalize::IMAGENET)
                .build(),
        ),
    ];
    for (name, t) in cases {
        let t = t.expect("transform");
        let out = t.image_output();
        let mut slot = vec![0u8; out.sample_bytes()];
        let mut epoch = 0;
        g.bench_function(name, |b| {
            b.iter(|| {
                epoch += 1;
                for (i, f) in files.iter().enumerate() {
                    let ctx = SampleContext {
                        index: i as u64,
                        position: 0,
                        batch: 0,
                        epoch,
                        seed: 1,
                    };
                    t.apply_image(f, "bench", &ctx, &mut slot).expect("decode");
                    black_box(&slot);
                }
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
