//! Decoding: PNG exact, JPEG within a tolerance, colour conversions, every bad-image case.

use crate::image_common as common;

use common::*;
use gpufeed::Error;
use gpufeed::codec::{DecodeLimits, ImageKind, decode_rgb8, probe};
use image::ExtendedColorType as E;

fn dec(bytes: &[u8]) -> gpufeed::Result<(u32, u32, Vec<u8>)> {
    let (mut out, mut scratch) = (Vec::new(), Vec::new());
    let d = decode_rgb8(
        bytes,
        "test.img",
        &DecodeLimits::default(),
        &mut out,
        &mut scratch,
    )?;
    Ok((d.width, d.height, out))
}

fn assert_image_error(r: gpufeed::Result<impl std::fmt::Debug>, needle: &str) {
    match r {
        Err(Error::Image {
            source_name, what, ..
        }) => {
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

/// The decoder's own error, which an image error keeps as its source.
fn decoder_error<T: std::fmt::Debug>(
    r: gpufeed::Result<T>,
) -> Box<dyn std::error::Error + Send + Sync> {
    match r {
        Err(Error::Image {
            source: Some(cause),
            ..
        }) => cause,
        other => panic!("expected an image error with a cause, got {other:?}"),
    }
}

#[test]
fn a_decoders_error_is_kept_as_the_source() {
    let b = png(&noisy_rgb(40, 40, 2), 40, 40, E::Rgb8);
    let mut c = b.clone();
    for x in &mut c[60..120] {
        *x ^= 0x5a;
    }
    let e = dec(&c).unwrap_err();
    let text = e.to_string();
    let cause = decoder_error(dec(&c));
    assert!(cause.is::<image::ImageError>(), "{cause:?}");
    // One line with the decoder's message, which Debug does not repeat.
    assert!(text.starts_with("test.img: corrupt PNG: "), "{text}");
    assert!(text.ends_with(&cause.to_string()), "{text}");
    assert!(!format!("{e:?}").contains("caused by"), "{e:?}");

    let mut j = vec![0xFF, 0xD8, 0xFF, 0xE0, 0x00, 0x02];
    j.extend((0..500u32).map(|i| (i * 7919 % 251) as u8));
    j.extend([0xFF, 0xD9]);
    let cause = decoder_error(dec(&j));
    assert!(cause.is::<zune_jpeg::errors::DecodeErrors>(), "{cause:?}");
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

/// A PNG chunk: length, type, data, CRC.
fn png_chunk(kind: &[u8; 4], data: &[u8]) -> Vec<u8> {
    let mut body = kind.to_vec();
    body.extend_from_slice(data);
    let mut c = (data.len() as u32).to_be_bytes().to_vec();
    c.extend_from_slice(&body);
    c.extend(crc32(&body).to_be_bytes());
    c
}

/// A zlib stream of one stored (uncompressed) deflate block holding `data`.
fn zlib_stored(data: &[u8]) -> Vec<u8> {
    let mut z = vec![0x78, 0x01, 0x01];
    z.extend((data.len() as u16).to_le_bytes());
    z.extend((!(data.len() as u16)).to_le_bytes());
    z.extend_from_slice(data);
    let (mut a, mut b) = (1u32, 0u32);
    for &x in data {
        a = (a + u32::from(x)) % 65_521;
        b = (b + a) % 65_521;
    }
    z.extend(((b << 16) | a).to_be_bytes());
    z
}

/// A PNG whose header says `w` x `h` of `depth`-bit samples of colour type `color`, followed
/// by one small IDAT and padding up to `total` bytes (a tEXt chunk).
fn png_declaring(w: u32, h: u32, depth: u8, color: u8, total: usize) -> Vec<u8> {
    let mut ihdr = w.to_be_bytes().to_vec();
    ihdr.extend(h.to_be_bytes());
    ihdr.extend([depth, color, 0, 0, 0]);
    let mut b = b"\x89PNG\r\n\x1a\n".to_vec();
    b.extend(png_chunk(b"IHDR", &ihdr));
    b.extend(png_chunk(b"IDAT", &zlib_stored(&[0u8; 64])));
    let end = png_chunk(b"IEND", &[]);
    let pad = total.saturating_sub(b.len() + end.len() + 12);
    let mut text = b"pad\0".to_vec();
    text.resize(pad.max(4), b'x');
    b.extend(png_chunk(b"tEXt", &text));
    b.extend(end);
    b
}

/// A 184-byte PNG that declares 13375 x 13375 RGBA16 made every worker
/// allocate and zero-fill about 2 GB before any pixel data was checked.
#[test]
fn png_declaring_more_pixels_than_its_data_can_hold_is_refused_before_allocating() {
    let b = png_declaring(13375, 13375, 16, 6, 184);
    assert_eq!(b.len(), 184);
    let (mut out, mut scratch) = (Vec::new(), Vec::new());
    let r = decode_rgb8(
        &b,
        "test.img",
        &DecodeLimits::default(),
        &mut out,
        &mut scratch,
    );
    assert_eq!((out.capacity(), scratch.capacity()), (0, 0), "allocated");
    assert_image_error(r, "13375x13375");
}

/// A JPEG baseline image of 16x16 whose frame header now says `w` x `h`, its scan data padded
/// with zeros to `total` bytes.
fn jpeg_declaring(w: u16, h: u16, total: usize) -> Vec<u8> {
    let mut j = jpeg(&smooth_rgb(16, 16), 16, 16, E::Rgb8, 90);
    let sof = j.windows(2).position(|m| m == [0xFF, 0xC0]).unwrap();
    j[sof + 5..sof + 7].copy_from_slice(&h.to_be_bytes());
    j[sof + 7..sof + 9].copy_from_slice(&w.to_be_bytes());
    let eoi = j.len() - 2;
    let pad = total.saturating_sub(j.len());
    j.splice(eoi..eoi, std::iter::repeat_n(0u8, pad));
    j
}

/// A 1,240-byte JPEG declaring 65496 x 226 decoded for 23 s under the fuzzer
/// (lenient decoding fills what the data lacks).
#[test]
fn jpeg_declaring_more_pixels_than_its_data_can_hold_is_refused_before_decoding() {
    let j = jpeg_declaring(65496, 226, 1240);
    assert_eq!(j.len(), 1240);
    let (mut out, mut scratch) = (Vec::new(), Vec::new());
    let r = decode_rgb8(
        &j,
        "test.img",
        &DecodeLimits::default(),
        &mut out,
        &mut scratch,
    );
    assert_eq!((out.capacity(), scratch.capacity()), (0, 0), "allocated");
    assert_image_error(r, "65496x226");
}

/// Two bytes, `FF 00`, inserted after SOI ended the marker walk that found
/// the frame header, so the check of the declared size against the bytes was skipped; the
/// decoder skips them and decoded the declared 65496x226 (7 s, 353 MB). Other bytes that are
/// not a marker do the same, or make the decoder fail: either way nothing is allocated.
#[test]
fn a_jpeg_bomb_whose_markers_cannot_be_walked_is_still_refused() {
    for junk in [
        &[0xFF, 0x00][..],
        &[0x00],
        &[0x12, 0x34, 0x56],
        &[0xFF, 0x00, 0xFF, 0x00],
    ] {
        let mut j = jpeg_declaring(65496, 226, 1240);
        j.splice(2..2, junk.iter().copied());
        let (mut out, mut scratch) = (Vec::new(), Vec::new());
        let r = decode_rgb8(
            &j,
            "test.img",
            &DecodeLimits::default(),
            &mut out,
            &mut scratch,
        );
        assert_eq!(
            (out.capacity(), scratch.capacity()),
            (0, 0),
            "{junk:?}: allocated"
        );
        assert!(matches!(r, Err(Error::Image { .. })), "{junk:?}: {r:?}");
        assert!(probe(&j, "test.img").is_err(), "{junk:?}");
    }
    // The case: the decoder reads the frame past the two bytes; the bound refuses it.
    let mut j = jpeg_declaring(65496, 226, 1240);
    j.splice(2..2, [0xFF, 0x00]);
    assert_image_error(dec(&j), "65496x226");
    assert_image_error(probe(&j, "test.img"), "65496x226");
    // The same two bytes in a real image do not stop it from decoding.
    let (w, h) = (48, 32);
    let mut ok = jpeg(&smooth_rgb(w, h), w, h, E::Rgb8, 90);
    ok.splice(2..2, [0xFF, 0x00]);
    assert_eq!(probe(&ok, "test.img").unwrap(), (w, h));
    let (dw, dh, _) = dec(&ok).unwrap();
    assert_eq!((dw, dh), (w, h));
}

#[test]
fn images_above_max_pixels_are_refused_naming_the_setting() {
    let (w, h) = (20, 20);
    let px = noisy_rgb(w, h, 4);
    let limits = DecodeLimits { max_pixels: 399 };
    for bytes in [png(&px, w, h, E::Rgb8), jpeg(&px, w, h, E::Rgb8, 90)] {
        let (mut out, mut scratch) = (Vec::new(), Vec::new());
        let r = decode_rgb8(&bytes, "test.img", &limits, &mut out, &mut scratch);
        assert_eq!(out.capacity(), 0, "allocated");
        assert_image_error(r, "max_pixels");
        let at = DecodeLimits { max_pixels: 400 };
        let d = decode_rgb8(&bytes, "test.img", &at, &mut out, &mut scratch).unwrap();
        assert_eq!((d.width, d.height), (w, h));
        // Probing reads the header only, and applies no pixel limit.
        assert_eq!(probe(&bytes, "test.img").unwrap(), (w, h));
    }
    assert_eq!(
        DecodeLimits::default().max_pixels,
        gpufeed::codec::DEFAULT_MAX_PIXELS
    );
}

/// The bounds on what the bytes can hold must never refuse a real image: flat images compress
/// best of all.
#[test]
fn flat_images_that_compress_well_still_decode() {
    let (w, h) = (1024, 768);
    let gray = vec![128u8; (w * h) as usize];
    for bytes in [png(&gray, w, h, E::L8), jpeg(&gray, w, h, E::L8, 50)] {
        assert!(bytes.len() < 20_000, "{} bytes", bytes.len());
        let (dw, dh, out) = dec(&bytes).unwrap();
        assert_eq!((dw, dh), (w, h));
        assert!(out.iter().all(|&v| v.abs_diff(128) <= 1));
        assert_eq!(probe(&bytes, "x").unwrap(), (w, h));
    }
}

/// A header that declares far more than the data holds is refused by `probe` too (so `pack`
/// refuses such a file instead of writing it).
#[test]
fn probe_refuses_declared_sizes_the_data_cannot_hold() {
    assert_image_error(
        probe(&png_declaring(13375, 13375, 16, 6, 184), "test.img"),
        "decompression bomb",
    );
    assert_image_error(
        probe(&jpeg_declaring(65496, 226, 1240), "test.img"),
        "65496x226",
    );
}

/// `decode_rgb8_region` (libjpeg-turbo partial decode) against a full libjpeg-turbo decode at
/// the same scale, cut to the same block.
#[cfg(feature = "turbojpeg")]
mod region {
    use super::*;
    use gpufeed::codec::decode_rgb8_region;
    use gpufeed::transform::image::Region;

    fn tj_jpeg(px: &[u8], w: u32, h: u32, subsamp: turbojpeg::Subsamp) -> Vec<u8> {
        let image = turbojpeg::Image {
            pixels: px,
            width: w as usize,
            pitch: w as usize * 3,
            height: h as usize,
            format: turbojpeg::PixelFormat::RGB,
        };
        turbojpeg::compress(image, 95, subsamp).unwrap().to_vec()
    }

    /// The whole image decoded by libjpeg-turbo at 1/denom: (width, height, RGB).
    fn full(bytes: &[u8], denom: usize) -> (usize, usize, Vec<u8>) {
        let mut d = turbojpeg::Decompressor::new().unwrap();
        let header = d.read_header(bytes).unwrap();
        let factor = turbojpeg::ScalingFactor::new(1, denom);
        d.set_scaling_factor(factor).unwrap();
        let s = header.scaled(factor);
        let mut px = vec![0u8; s.width * s.height * 3];
        let image = turbojpeg::Image {
            pixels: &mut px[..],
            width: s.width,
            pitch: s.width * 3,
            height: s.height,
            format: turbojpeg::PixelFormat::RGB,
        };
        d.decompress(bytes, image).unwrap();
        (s.width, s.height, px)
    }

    fn region(left: f64, top: f64, width: f64, height: f64) -> Region {
        Region {
            left,
            top,
            width,
            height,
        }
    }

    /// Decodes `r` at 1/denom, checks that the block covers it, and compares every pixel of
    /// the block with the full decode: (mean abs diff, max abs diff).
    fn compare(bytes: &[u8], r: Region, denom: u32) -> (f64, u8) {
        let (mut out, mut scratch) = (Vec::new(), Vec::new());
        let got = decode_rgb8_region(
            bytes,
            "test.img",
            r,
            denom,
            &DecodeLimits::default(),
            &mut out,
            &mut scratch,
        )
        .unwrap();
        assert_eq!(got.denom, denom);
        let (bw, bh) = (got.decoded.width as usize, got.decoded.height as usize);
        assert_eq!(out.len(), bw * bh * 3);
        let w = &got.region;
        let d = f64::from(denom);
        let eps = 1e-9;
        assert!(w.left >= 0.0 && w.top >= 0.0, "{r:?} -> {w:?}");
        assert!(
            w.left + w.width <= bw as f64 + eps,
            "{r:?} -> {w:?} in {bw}"
        );
        assert!(
            w.top + w.height <= bh as f64 + eps,
            "{r:?} -> {w:?} in {bh}"
        );
        assert!((w.width - r.width / d).abs() < eps && (w.height - r.height / d).abs() < eps);
        // The block's origin in the scaled image: a whole pixel, left on an iMCU boundary.
        let (ox, oy) = (r.left / d - w.left, r.top / d - w.top);
        assert!(
            ox.fract().abs() < eps && oy.fract().abs() < eps,
            "{ox} {oy}"
        );
        let (ox, oy) = (ox.round() as usize, oy.round() as usize);
        let (fw, fh, fpx) = full(bytes, denom as usize);
        assert!(ox + bw <= fw && oy + bh <= fh);
        let (mut sum, mut max) = (0u64, 0u8);
        for y in 0..bh {
            let a = &out[y * bw * 3..(y + 1) * bw * 3];
            let b = &fpx[((oy + y) * fw + ox) * 3..((oy + y) * fw + ox + bw) * 3];
            for (p, q) in a.iter().zip(b) {
                let e = p.abs_diff(*q);
                sum += u64::from(e);
                max = max.max(e);
            }
        }
        (sum as f64 / (bw * bh * 3) as f64, max)
    }

    #[test]
    fn cropped_decode_matches_full_decode_cropped() {
        // A smooth image, quality 95, at a size that is not a multiple of any iMCU. Tolerance:
        // libjpeg-turbo upsamples the chroma of the block's edge columns and rows without
        // their neighbours outside the block, so those pixels may differ a little from a
        // full decode: mean abs diff < 1.0 and max < 16 over every pixel of the block.
        let (w, h) = (157, 113);
        let px = smooth_rgb(w, h);
        let regions = [
            region(0.0, 0.0, 157.0, 113.0),  // the whole image
            region(5.0, 7.0, 60.0, 40.0),    // x not on an iMCU boundary
            region(23.0, 50.0, 134.0, 63.0), // to the right and bottom edges
            region(141.0, 97.0, 16.0, 16.0), // the bottom-right corner
            region(0.0, 30.0, 9.0, 83.0),    // left edge, to the bottom
            region(17.0, 1.0, 33.5, 90.25),  // fractional size (an Eval crop)
            region(98.0, 0.0, 41.0, 1.0),    // one row
        ];
        use turbojpeg::Subsamp as S;
        for subsamp in [S::Sub2x2, S::Sub2x1, S::None, S::Gray] {
            let bytes = tj_jpeg(&px, w, h, subsamp);
            for r in regions {
                for denom in [1, 2, 4] {
                    let (mean, max) = compare(&bytes, r, denom);
                    assert!(
                        mean < 1.0 && max < 16,
                        "{subsamp:?} {r:?} 1/{denom}: mean {mean}, max {max}"
                    );
                }
            }
        }
    }

    #[test]
    fn grayscale_region_becomes_rgb8() {
        let (w, h) = (40, 24);
        let gray: Vec<u8> = (0..w * h).map(|i| (i % 200) as u8 / 2 + 60).collect();
        let bytes = jpeg(&gray, w, h, E::L8, 95);
        let (mut out, mut scratch) = (Vec::new(), Vec::new());
        let r = region(9.0, 3.0, 20.0, 10.0);
        let got = decode_rgb8_region(
            &bytes,
            "test.img",
            r,
            1,
            &DecodeLimits::default(),
            &mut out,
            &mut scratch,
        )
        .unwrap();
        assert_eq!(got.decoded.height, 10);
        assert_eq!(out.len(), (got.decoded.width * 10 * 3) as usize);
        assert!(out.chunks(3).all(|p| p[0] == p[1] && p[1] == p[2]));
    }

    #[test]
    fn png_goes_through_the_whole_decode() {
        let (w, h) = (21, 13);
        let px = noisy_rgb(w, h, 3);
        let (mut out, mut scratch) = (Vec::new(), Vec::new());
        let r = region(2.0, 3.0, 10.0, 5.0);
        let bytes = png(&px, w, h, E::Rgb8);
        let got = decode_rgb8_region(
            &bytes,
            "test.img",
            r,
            2,
            &DecodeLimits::default(),
            &mut out,
            &mut scratch,
        )
        .unwrap();
        assert_eq!(
            (got.decoded.width, got.decoded.height, got.denom),
            (w, h, 1)
        );
        assert_eq!(got.region, r);
        assert_eq!(out, px);
    }

    fn dec_region(bytes: &[u8]) -> gpufeed::Result<Vec<u8>> {
        let (mut out, mut scratch) = (Vec::new(), Vec::new());
        let r = region(10.0, 10.0, 30.0, 30.0);
        decode_rgb8_region(
            bytes,
            "test.img",
            r,
            1,
            &DecodeLimits::default(),
            &mut out,
            &mut scratch,
        )?;
        Ok(out)
    }

    #[test]
    fn truncated_and_corrupt_jpegs_are_errors() {
        let b = tj_jpeg(&smooth_rgb(64, 64), 64, 64, turbojpeg::Subsamp::Sub2x2);
        assert_image_error(dec_region(&b[..b.len() / 2]), "truncated");
        // A JPEG magic then garbage, with an end marker so the truncation check passes.
        let mut g = vec![0xFF, 0xD8, 0xFF, 0xE0, 0x00, 0x02];
        g.extend((0..500u32).map(|i| (i * 7919 % 251) as u8));
        g.extend([0xFF, 0xD9]);
        assert_image_error(dec_region(&g), "JPEG");
        // Valid headers, then the entropy-coded data cut out: libjpeg-turbo fails on it.
        let sos = b.windows(2).position(|w| w == [0xFF, 0xDA]).unwrap();
        let mut cut = b[..sos].to_vec();
        cut.extend([0xFF, 0xD9]);
        assert_image_error(dec_region(&cut), "JPEG");
        // libjpeg-turbo's own message is kept as the source.
        let cause = decoder_error(dec_region(&cut));
        assert!(cause.is::<turbojpeg::Error>(), "{cause:?}");
    }

    /// Through libjpeg-turbo: the bomb whose markers cannot be walked is
    /// refused before anything is allocated, and so is one libjpeg-turbo reads itself (its
    /// frame found by the walk), with each subsampling.
    #[test]
    fn jpeg_bombs_are_refused_by_the_region_decoder() {
        let mut j = jpeg_declaring(65496, 226, 1240);
        j.splice(2..2, [0xFF, 0x00]);
        for bomb in [j, jpeg_declaring(65496, 226, 1240)] {
            let (mut out, mut scratch) = (Vec::new(), Vec::new());
            let r = decode_rgb8_region(
                &bomb,
                "test.img",
                region(0.0, 0.0, 224.0, 224.0),
                1,
                &DecodeLimits::default(),
                &mut out,
                &mut scratch,
            );
            assert_eq!((out.capacity(), scratch.capacity()), (0, 0), "allocated");
            assert_image_error(r, "65496x226");
        }
        for subsamp in [
            turbojpeg::Subsamp::None,
            turbojpeg::Subsamp::Sub2x1,
            turbojpeg::Subsamp::Sub2x2,
            turbojpeg::Subsamp::Gray,
        ] {
            let mut b = tj_jpeg(&smooth_rgb(16, 16), 16, 16, subsamp);
            let sof = b.windows(2).position(|m| m == [0xFF, 0xC0]).unwrap();
            b[sof + 5..sof + 7].copy_from_slice(&4000u16.to_be_bytes());
            b[sof + 7..sof + 9].copy_from_slice(&4000u16.to_be_bytes());
            let (mut out, mut scratch) = (Vec::new(), Vec::new());
            let r = decode_rgb8_region(
                &b,
                "test.img",
                region(0.0, 0.0, 224.0, 224.0),
                1,
                &DecodeLimits::default(),
                &mut out,
                &mut scratch,
            );
            assert_eq!(out.capacity(), 0, "{subsamp:?}: allocated");
            assert_image_error(r, "4000x4000");
        }
    }

    /// What `dec_region` gives for `bytes`, as text: the output's length or the error.
    fn outcome(bytes: &[u8]) -> String {
        format!("{:?}", dec_region(bytes).map(|out| out.len()))
    }

    #[test]
    fn what_a_jpeg_decodes_to_does_not_depend_on_the_jpegs_before_it() {
        // Each thread keeps one libjpeg-turbo decompressor: neither a good image nor a failure
        // before may change what the next image gives (a stale size let garbage after a good
        // image "decode" to the previous image's size and pixels).
        let good = tj_jpeg(&smooth_rgb(64, 64), 64, 64, turbojpeg::Subsamp::Sub2x2);
        let mut garbage = vec![0xFF, 0xD8, 0xFF, 0xE0, 0x00, 0x02];
        garbage.extend((0..500u32).map(|i| (i * 7919 % 251) as u8));
        garbage.extend([0xFF, 0xD9]);
        let sos = good.windows(2).position(|w| w == [0xFF, 0xDA]).unwrap();
        let mut no_scan = good[..sos].to_vec();
        no_scan.extend([0xFF, 0xD9]);
        let dqt = good.windows(2).position(|w| w == [0xFF, 0xDB]).unwrap();
        let mut bad_table = good.clone();
        bad_table[dqt + 4] = 0x0F; // quantization table 15 of 0..=3
        let cases = [good, garbage, no_scan, bad_table];
        let on_a_new_thread =
            |f: Box<dyn FnOnce() -> String + Send>| std::thread::spawn(f).join().unwrap();
        let alone: Vec<String> = cases
            .iter()
            .map(|c| {
                let c = c.clone();
                on_a_new_thread(Box::new(move || outcome(&c)))
            })
            .collect();
        assert!(alone[0].starts_with("Ok("), "{}", alone[0]);
        for a in &alone[1..] {
            assert!(a.starts_with("Err("), "{a}");
        }
        for (i, before) in cases.iter().enumerate() {
            for (j, after) in cases.iter().enumerate() {
                let (before, after) = (before.clone(), after.clone());
                let got = on_a_new_thread(Box::new(move || {
                    let _ = dec_region(&before);
                    outcome(&after)
                }));
                assert_eq!(got, alone[j], "case {j} after case {i}");
            }
        }
    }
}
