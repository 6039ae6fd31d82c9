//! A mutation fuzzer for the image decoders and the transform around them.
//!
//! Valid JPEGs and PNGs (RGB, grayscale, RGBA, 16-bit, progressive with `turbojpeg`) are
//! mutated: bit flips, byte writes, 16-bit size fields overwritten, truncations and
//! insertions. Each mutant goes through `probe`, `inspect_jpeg` (the GPU decode's gate),
//! `decode_rgb8`, (with `turbojpeg`) `decode_rgb8_region`, and the train and eval transforms.
//! The property: nothing panics, and every failure is an `Error::Image` naming the source.
//! The number of cases is proptest's default (256) unless `PROPTEST_CASES` says more;
//! `PROPTEST_CASES=20000 cargo test --release --test image_fuzz` is the long run.

use crate::image_common as common;

use std::sync::OnceLock;

use common::*;
use gpufeed::Error;
use gpufeed::codec::{DecodeLimits, decode_rgb8, inspect_jpeg, probe};
use gpufeed::format::DType;
use gpufeed::transform::SampleContext;
use gpufeed::transform::image::{ImageTransform, Normalize};
use image::ExtendedColorType as E;
use proptest::prelude::*;

/// Valid images to start from, small enough that decoding a mutant is quick.
fn seeds() -> &'static [Vec<u8>] {
    static SEEDS: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    SEEDS.get_or_init(|| {
        let (w, h) = (40u32, 30u32);
        let rgb = smooth_rgb(w, h);
        let gray: Vec<u8> = rgb.chunks(3).map(|p| p[1]).collect();
        let rgba: Vec<u8> = rgb
            .chunks(3)
            .flat_map(|p| [p[0], p[1], p[2], 200])
            .collect();
        let rgb16: Vec<u8> = rgb.iter().flat_map(|&v| [v, v ^ 0x5a]).collect();
        #[allow(unused_mut)]
        let mut seeds = vec![
            jpeg(&rgb, w, h, E::Rgb8, 90),
            jpeg(&gray, w, h, E::L8, 75),
            png(&rgb, w, h, E::Rgb8),
            png(&gray, w, h, E::L8),
            png(&rgba, w, h, E::Rgba8),
            png(&rgb16, w, h, E::Rgb16),
        ];
        // Optimised Huffman tables and 4:2:2, then the same progressive.
        #[cfg(feature = "turbojpeg")]
        for progressive in [false, true] {
            let mut c = turbojpeg::Compressor::new().unwrap();
            c.set_quality(85).unwrap();
            c.set_subsamp(turbojpeg::Subsamp::Sub2x1).unwrap();
            c.set_optimize(true).unwrap();
            c.set_progressive(progressive).unwrap();
            let image = turbojpeg::Image {
                pixels: &rgb[..],
                width: w as usize,
                pitch: w as usize * 3,
                height: h as usize,
                format: turbojpeg::PixelFormat::RGB,
            };
            seeds.push(c.compress_to_vec(image).unwrap());
        }
        seeds
    })
}

#[derive(Clone, Debug)]
enum Mutation {
    FlipBit {
        at: usize,
        bit: u8,
    },
    Write {
        at: usize,
        byte: u8,
    },
    /// A big-endian u16 written anywhere: JPEG's SOF and PNG's IHDR sizes are such fields.
    WriteU16 {
        at: usize,
        value: u16,
    },
    Truncate {
        at: usize,
    },
    Insert {
        at: usize,
        bytes: Vec<u8>,
    },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), 0u8..8).prop_map(|(at, bit)| Mutation::FlipBit { at, bit }),
        3 => (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Write { at, byte }),
        2 => (any::<usize>(), any::<u16>()).prop_map(|(at, value)| Mutation::WriteU16 { at, value }),
        1 => any::<usize>().prop_map(|at| Mutation::Truncate { at }),
        1 => (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
    ]
}

fn apply(bytes: &mut Vec<u8>, m: &Mutation) {
    let n = bytes.len();
    if n == 0 {
        return;
    }
    match m {
        Mutation::FlipBit { at, bit } => bytes[at % n] ^= 1 << bit,
        Mutation::Write { at, byte } => bytes[at % n] = *byte,
        Mutation::WriteU16 { at, value } => {
            let at = at % n.saturating_sub(1).max(1);
            for (k, b) in value.to_be_bytes().into_iter().enumerate() {
                if let Some(slot) = bytes.get_mut(at + k) {
                    *slot = b;
                }
            }
        }
        Mutation::Truncate { at } => bytes.truncate(at % n),
        Mutation::Insert { at, bytes: b } => {
            let at = at % n;
            bytes.splice(at..at, b.iter().copied());
        }
    }
}

/// Ok, or an image error that names the source: anything else fails the case.
fn check<T>(r: gpufeed::Result<T>, what: &str) -> Result<(), TestCaseError> {
    match r {
        Ok(_) => Ok(()),
        Err(Error::Image { source_name, .. }) => {
            prop_assert_eq!(source_name, "fuzz.img", "{}", what);
            Ok(())
        }
        Err(e) => Err(TestCaseError::fail(format!(
            "{what}: not an image error: {e}"
        ))),
    }
}

fn transforms() -> &'static [ImageTransform] {
    static T: OnceLock<Vec<ImageTransform>> = OnceLock::new();
    T.get_or_init(|| {
        vec![
            ImageTransform::train(16).build().unwrap(),
            ImageTransform::eval(16)
                .dtype(DType::F16)
                .normalize(Normalize::IMAGENET)
                .build()
                .unwrap(),
        ]
    })
}

proptest! {
    #[test]
    fn mutated_images_decode_or_fail_cleanly(
        seed in 0usize..16,
        mutations in proptest::collection::vec(mutation(), 1..6),
        sample in any::<u64>(),
    ) {
        let mut bytes = seeds()[seed % seeds().len()].clone();
        for m in &mutations {
            apply(&mut bytes, m);
        }
        let name = "fuzz.img";
        let probed = probe(&bytes, name);
        if let Ok((w, h)) = probed {
            prop_assert!(w > 0 && h > 0);
        }
        check(probed, "probe")?;
        // The GPU decode's gate (its marker and scan walk).
        check(inspect_jpeg(&bytes, name, &DecodeLimits::default()), "inspect_jpeg")?;
        let (mut out, mut scratch) = (Vec::new(), Vec::new());
        let decoded = decode_rgb8(&bytes, name, &DecodeLimits::default(), &mut out, &mut scratch);
        if let Ok(d) = &decoded {
            prop_assert_eq!(out.len(), d.width as usize * d.height as usize * 3);
        }
        check(decoded, "decode_rgb8")?;
        #[cfg(feature = "turbojpeg")]
        {
            use gpufeed::transform::image::Region;
            use gpufeed::codec::decode_rgb8_region;
            let r = Region { left: 3.5, top: 2.0, width: 20.0, height: 17.25 };
            for denom in [1, 2, 8] {
                let got = decode_rgb8_region(&bytes, name, r, denom, &DecodeLimits::default(), &mut out, &mut scratch);
                if let Ok(g) = &got {
                    let (bw, bh) = (g.decoded.width as usize, g.decoded.height as usize);
                    prop_assert_eq!(out.len(), bw * bh * 3);
                }
                check(got, "decode_rgb8_region")?;
            }
        }
        for t in transforms() {
            let mut slot = vec![0u8; t.image_output().sample_bytes()];
            let ctx = SampleContext { index: sample, position: 0, batch: 0, epoch: 1, seed: 5 };
            check(t.apply_image(&bytes, name, &ctx, &mut slot), "apply_image")?;
        }
    }
}

#[test]
fn every_seed_decodes() {
    for (k, s) in seeds().iter().enumerate() {
        let (mut out, mut scratch) = (Vec::new(), Vec::new());
        let d = decode_rgb8(s, "seed", &DecodeLimits::default(), &mut out, &mut scratch).unwrap();
        assert_eq!((d.width, d.height), (40, 30), "seed {k}");
    }
}
