//! The conversion kernel against a CPU reference on fresh random data, poisoned outputs.

use crate::cuda_common;

use gpufeed::cuda::{Convert, Converter, DeviceLoader, DeviceLoaderOptions, DevicePool};
use gpufeed::transform::image::Layout;
use gpufeed::{DType, Loader, NpyArray};

use cuda_common::{Rng, device, write_npy};

fn f16_to_f64(h: u16) -> f64 {
    let sign = if h >> 15 == 1 { -1.0 } else { 1.0 };
    let e = i32::from((h >> 10) & 0x1f);
    let m = f64::from(h & 0x3ff);
    match e {
        0 => sign * m * 2f64.powi(-24),
        31 => {
            if m == 0.0 {
                sign * f64::INFINITY
            } else {
                f64::NAN
            }
        }
        _ => sign * (1.0 + m / 1024.0) * 2f64.powi(e - 15),
    }
}

fn decode(bytes: &[u8], dtype: DType) -> Vec<f64> {
    match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16_to_f64(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| {
                f64::from(f32::from_bits(
                    u32::from(u16::from_le_bytes([c[0], c[1]])) << 16,
                ))
            })
            .collect(),
        _ => unreachable!(),
    }
}

/// `(x * scale - mean[c]) / std[c]`, NCHW out, in f64.
fn reference(
    src: &[u8],
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    layout: Layout,
    spec: &Convert,
) -> Vec<f64> {
    let mut out = vec![0.0; n * c * h * w];
    for s in 0..n {
        for ch in 0..c {
            for y in 0..h {
                for x in 0..w {
                    let j = match layout {
                        Layout::Hwc => ((s * h + y) * w + x) * c + ch,
                        Layout::Chw => ((s * c + ch) * h + y) * w + x,
                    };
                    let v = f64::from(src[j]) * f64::from(spec.scale);
                    out[((s * c + ch) * h + y) * w + x] =
                        (v - f64::from(spec.mean[ch])) / f64::from(spec.std[ch]);
                }
            }
        }
    }
    out
}

fn compare(got: &[f64], want: &[f64], dtype: DType, what: &str) {
    let tol = match dtype {
        DType::F32 => 1e-6,
        DType::F16 => 1e-3,
        _ => 5e-3,
    };
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.is_finite(),
            "{what}: element {i} is {g} (unwritten or wrong), want {w}"
        );
        let elem_tol = match dtype {
            DType::F32 => 1e-5 * w.abs().max(1.0),
            DType::F16 => 2f64.powi(-10) * w.abs().max(1e-2),
            _ => 2f64.powi(-7) * w.abs().max(1e-2),
        };
        assert!(
            (g - w).abs() <= elem_tol,
            "{what}: element {i} is {g}, want {w}"
        );
        num += (g - w) * (g - w);
        den += w * w;
    }
    let rel = (num / den).sqrt();
    eprintln!("{what}: relative error {rel:.3e}");
    assert!(rel < tol, "{what}: relative error {rel}");
}

pub fn conversion_matches_the_cpu_reference() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::fresh("convert");
    let (n, c, h, w) = (5usize, 3usize, 17usize, 23usize);
    let pool = DevicePool::new(&dev);
    let stream = dev.new_stream().unwrap();
    for layout in [Layout::Hwc, Layout::Chw] {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let mean: Vec<f32> = (0..c)
                .map(|_| (rng.next_u64() % 1000) as f32 / 1000.0)
                .collect();
            let std: Vec<f32> = (0..c)
                .map(|_| 0.1 + (rng.next_u64() % 1000) as f32 / 1000.0)
                .collect();
            let spec = Convert::new("img", layout, dtype).normalize_channels(&mean, &std);
            let shape = match layout {
                Layout::Hwc => [h, w, c],
                Layout::Chw => [c, h, w],
            };
            let conv = Converter::new(&dev, spec.clone(), &shape).unwrap();
            let mut src_host = vec![0u8; n * c * h * w];
            rng.fill(&mut src_host);
            let mut src = pool.alloc(src_host.len()).unwrap();
            src.upload_sync(&stream, 0, &src_host).unwrap();
            let mut dst = pool.alloc(conv.output_bytes(n)).unwrap();
            dst.fill_async(&stream, 0, dst.len(), 0xFF).unwrap();
            conv.launch(&stream, &src, 0, &dst, 0, n).unwrap();
            let mut out = vec![0u8; conv.output_bytes(n)];
            dst.download_sync(&stream, 0, &mut out).unwrap();
            let want = reference(&src_host, n, c, h, w, layout, &spec);
            compare(
                &decode(&out, dtype),
                &want,
                dtype,
                &format!("{layout:?} -> {dtype}"),
            );
        }
    }
}

pub fn conversion_rejects_bad_settings() {
    let Some(dev) = device() else { return };
    let spec = Convert::new("img", Layout::Hwc, DType::I32);
    assert!(Converter::new(&dev, spec, &[4, 4, 3]).is_err());
    let spec =
        Convert::new("img", Layout::Hwc, DType::F32).normalize_channels(&[0.5; 2], &[1.0; 2]);
    assert!(Converter::new(&dev, spec, &[4, 4, 3]).is_err());
    let spec = Convert::new("img", Layout::Hwc, DType::F32).normalize_channels(&[0.5], &[0.0]);
    assert!(Converter::new(&dev, spec, &[4, 4, 3]).is_err());
}

pub fn the_device_loader_converts_fields_end_to_end() {
    let Some(dev) = device() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::fresh("convert-loader");
    let (h, w, c) = (31usize, 29usize, 3usize);
    let (path, data) = write_npy(
        dir.path(),
        "img.npy",
        40,
        &[h as u64, w as u64, c as u64],
        &mut rng,
    );
    let spec = Convert::imagenet("data", Layout::Hwc, DType::BF16);
    let builder = Loader::builder(NpyArray::open(&path).unwrap())
        .batch_size(16)
        .shuffle(7)
        .workers(2);
    let opts = DeviceLoaderOptions::default()
        .convert(spec.clone())
        .poison(0xFF);
    let mut dl = DeviceLoader::from_builder(builder, &dev, opts).unwrap();
    let sample = h * w * c;
    let mut batches = 0;
    for b in dl.by_ref() {
        let b = b.unwrap();
        let f = b.field::<u16>("data").unwrap();
        assert_eq!(f.dtype(), DType::BF16);
        assert_eq!(f.shape(), vec![b.len(), c, h, w]);
        assert_eq!(f.len(), b.len() * c * h * w);
        assert!(b.field::<f32>("data").is_err(), "bf16 is not f32");
        let mut src = Vec::with_capacity(b.len() * sample);
        for &i in b.indices() {
            src.extend_from_slice(&data[i as usize * sample..(i as usize + 1) * sample]);
        }
        let want = reference(
            &src,
            b.len(),
            c,
            h,
            w,
            Layout::Hwc,
            &Convert {
                mean: vec![0.485, 0.456, 0.406],
                std: vec![0.229, 0.224, 0.225],
                ..spec.clone()
            },
        );
        let got = decode(&b.field_to_host("data").unwrap(), DType::BF16);
        compare(
            &got,
            &want,
            DType::BF16,
            &format!("loader batch {}", b.number()),
        );
        batches += 1;
    }
    assert_eq!(batches, 3);
}
