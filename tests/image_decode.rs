//! Decoding: PNG exact, JPEG within a tolerance, colour conversions, every bad-image case.

#[path = "image_common/mod.rs"]
mod common;

use common::*;
use gpufeed::Error;
use gpufeed::transform::image::decode::{ImageKind, decode_rgb8, probe};
use image::ExtendedColorType as E;

fn dec(bytes: &[u8]) -> gpufeed::Result<(u32, u32, Vec<u8>)> {
    let (mut out, mut scratch) = (Vec::new(), Vec::new());
    let d = decode_rgb8(bytes, "test.img", &mut out, &mut scratch)?;
    Ok((d.width, d.height, out))
}

fn assert_image_error(r: gpufeed::Result<impl std::fmt::Debug>, needle: &str) {
    match r {
        Err(Error::Image { source_name, what }) => {
            assert_eq!(source_name, "test.img");
            assert!(what.contains(needle), "{what:?} lacks {needle:?}");
        }
        other => panic!("expected an image error, got {other:?}"),
    }
}

#[test]
fn png_rgb8_decodes_exactly() {
    let (w, h) = (37, 23);
    let px = noisy_rgb(w, h, 1);
    let (dw, dh, out) = dec(&png(&px, w, h, E::Rgb8)).unwrap();
    assert_eq!((dw, dh), (w, h));
    assert_eq!(out, px);
    assert_eq!(probe(&png(&px, w, h, E::Rgb8), "x").unwrap(), (w, h));
}

#[test]
fn grayscale_rgba_and_16_bit_pngs_become_rgb8() {
    let (w, h) = (9, 5);
    let n = (w * h) as usize;
    let gray: Vec<u8> = (0..n).map(|i| (i * 5) as u8).collect();
    let (_, _, out) = dec(&png(&gray, w, h, E::L8)).unwrap();
    assert!(out.chunks(3).zip(&gray).all(|(p, &g)| p == [g, g, g]));

    let rgba = noisy_rgb(w, h * 4, 3)[..n * 4].to_vec();
    let (_, _, out) = dec(&png(&rgba, w, h, E::Rgba8)).unwrap();
    assert!(out.chunks(3).zip(rgba.chunks(4)).all(|(p, q)| p == &q[..3]));

    let la: Vec<u8> = (0..n).flat_map(|i| [(i * 3) as u8, 7]).collect();
    let (_, _, out) = dec(&png(&la, w, h, E::La8)).unwrap();
    assert!(out.chunks(3).zip(la.chunks(2)).all(|(p, q)| p == [q[0]; 3]));

    // 16-bit: the encoder takes native-endian u16 samples; 8-bit value = round(v * 255 / 65535).
    let vals: Vec<u16> = (0..n * 3).map(|i| (i as u16).wrapping_mul(1499)).collect();
    let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_ne_bytes()).collect();
    let (_, _, out) = dec(&png(&bytes, w, h, E::Rgb16)).unwrap();
    for (o, &v) in out.iter().zip(&vals) {
        let want = ((u32::from(v) * 255 + 32_767) / 65_535) as u8;
        assert_eq!(*o, want);
    }
    let g16: Vec<u8> = (0..n)
        .flat_map(|i| ((i * 1000) as u16).to_ne_bytes())
        .collect();
    let (_, _, out) = dec(&png(&g16, w, h, E::L16)).unwrap();
    for (p, i) in out.chunks(3).zip(0..) {
        let want = (((i * 1000) as u32 * 255 + 32_767) / 65_535) as u8;
        assert_eq!(p, [want; 3]);
    }
}

#[test]
fn jpeg_decodes_within_tolerance() {
    // Quality 95 on a smooth image: mean absolute error below 3 (measured ~1).
    let (w, h) = (120, 80);
    let px = smooth_rgb(w, h);
    let (dw, dh, out) = dec(&jpeg(&px, w, h, E::Rgb8, 95)).unwrap();
    assert_eq!((dw, dh), (w, h));
    let mae: f64 = out
        .iter()
        .zip(&px)
        .map(|(a, b)| (f64::from(*a) - f64::from(*b)).abs())
        .sum::<f64>()
        / px.len() as f64;
    assert!(mae < 3.0, "mean abs error {mae}");
}

#[test]
fn grayscale_jpeg_becomes_rgb8() {
    let (w, h) = (32, 16);
    let gray: Vec<u8> = (0..w * h).map(|i| (i % 200) as u8 / 2 + 60).collect();
    let (_, _, out) = dec(&jpeg(&gray, w, h, E::L8, 95)).unwrap();
    assert_eq!(out.len(), (w * h * 3) as usize);
    assert!(out.chunks(3).all(|p| p[0] == p[1] && p[1] == p[2]));
}

#[test]
fn truncated_jpeg_is_an_error() {
    let b = jpeg(&smooth_rgb(64, 64), 64, 64, E::Rgb8, 90);
    assert_image_error(dec(&b[..b.len() / 2]), "truncated");
}

#[test]
fn corrupt_jpeg_is_an_error() {
    // A JPEG magic then garbage, with an end marker so the truncation check passes.
    let mut b = vec![0xFF, 0xD8, 0xFF, 0xE0, 0x00, 0x02];
    b.extend((0..500u32).map(|i| (i * 7919 % 251) as u8));
    b.extend([0xFF, 0xD9]);
    assert_image_error(dec(&b), "JPEG");
}

#[test]
fn truncated_and_corrupt_png_are_errors() {
    let b = png(&noisy_rgb(40, 40, 2), 40, 40, E::Rgb8);
    assert_image_error(dec(&b[..b.len() / 2]), "PNG");
    assert_image_error(dec(&b[..20]), "PNG");
    let mut c = b.clone();
    for x in &mut c[60..120] {
        *x ^= 0x5a;
    }
    assert_image_error(dec(&c), "PNG");
}

#[test]
fn unsupported_format_and_empty_file_are_errors() {
    assert_image_error(dec(b"GIF89a\x01\x00\x01\x00"), "unsupported image format");
    assert_image_error(dec(b"BM\x00\x00"), "unsupported image format");
    assert_image_error(dec(b""), "empty");
    assert_eq!(ImageKind::detect(b"GIF89a"), None);
}

fn crc32(data: &[u8]) -> u32 {
    let mut c = 0xFFFF_FFFFu32;
    for &b in data {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
    }
    !c
}

#[test]
fn zero_sized_images_are_errors() {
    // A PNG whose IHDR says 0 x 5 (with a valid CRC).
    let mut b = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut chunk = b"IHDR".to_vec();
    chunk.extend(0u32.to_be_bytes());
    chunk.extend(5u32.to_be_bytes());
    chunk.extend([8, 2, 0, 0, 0]);
    b.extend(13u32.to_be_bytes());
    b.extend(&chunk);
    b.extend(crc32(&chunk).to_be_bytes());
    assert_image_error(probe(&b, "test.img"), "zero-sized");
    assert!(matches!(dec(&b), Err(Error::Image { .. })));
    // A JPEG whose frame header says height 0 (and no DNL marker).
    let mut j = jpeg(&smooth_rgb(16, 16), 16, 16, E::Rgb8, 90);
    let sof = j.windows(2).position(|w| w == [0xFF, 0xC0]).unwrap();
    j[sof + 5] = 0;
    j[sof + 6] = 0;
    assert!(matches!(dec(&j), Err(Error::Image { .. })));
}
