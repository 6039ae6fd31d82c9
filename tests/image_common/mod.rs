// Helpers shared by the image tests (included with `#[path]`, not a test of its own).
#![allow(dead_code)]

use std::path::Path;

use image::{ExtendedColorType, ImageEncoder};

/// A deterministic RGB image with a smooth gradient and some structure.
pub fn smooth_rgb(w: u32, h: u32) -> Vec<u8> {
    let mut v = Vec::with_capacity((w * h * 3) as usize);
    for y in 0..h {
        for x in 0..w {
            v.push((x * 255 / w.max(1)) as u8);
            v.push((y * 255 / h.max(1)) as u8);
            v.push(((x + y) * 127 / (w + h)) as u8 + 64);
        }
    }
    v
}

/// Distinct pixel values everywhere (for exact comparisons).
pub fn noisy_rgb(w: u32, h: u32, seed: u32) -> Vec<u8> {
    (0..w * h * 3)
        .map(|i| {
            (i.wrapping_mul(2_654_435_761)
                .wrapping_add(seed.wrapping_mul(97))
                >> 13) as u8
        })
        .collect()
}

pub fn png(pixels: &[u8], w: u32, h: u32, color: ExtendedColorType) -> Vec<u8> {
    let mut out = Vec::new();
    image::codecs::png::PngEncoder::new(&mut out)
        .write_image(pixels, w, h, color)
        .unwrap();
    out
}

pub fn jpeg(pixels: &[u8], w: u32, h: u32, color: ExtendedColorType, quality: u8) -> Vec<u8> {
    let mut out = Vec::new();
    image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, quality)
        .write_image(pixels, w, h, color)
        .unwrap();
    out
}

/// Writes `root/class_{k}/{i}.jpg` files: `per_class` each of `classes` classes.
pub fn jpeg_folder(root: &Path, classes: usize, per_class: usize, w: u32, h: u32) {
    for c in 0..classes {
        let dir = root.join(format!("class_{c}"));
        std::fs::create_dir_all(&dir).unwrap();
        for i in 0..per_class {
            let px = noisy_rgb(w, h, (c * 1000 + i) as u32);
            let smooth = smooth_rgb(w, h);
            let mixed: Vec<u8> = px.iter().zip(&smooth).map(|(a, b)| a / 4 + b / 2).collect();
            std::fs::write(
                dir.join(format!("{i:04}.jpg")),
                jpeg(&mixed, w, h, ExtendedColorType::Rgb8, 90),
            )
            .unwrap();
        }
    }
}

/// The images of every kind the GPU decode's planner tells apart (tests/fixtures/jpeg_kinds/,
/// made by its make.py with Pillow), as (file name, bytes). Compiled into the test binary, so
/// that a binary staged for the GPU machine finds them wherever its tree lies there.
pub fn image_kinds() -> Vec<(&'static str, Vec<u8>)> {
    macro_rules! kinds {
        ($($name:literal),* $(,)?) => {
            vec![$((
                $name,
                include_bytes!(concat!("../fixtures/jpeg_kinds/", $name)).to_vec(),
            )),*]
        };
    }
    kinds![
        "baseline_420.jpg",
        "baseline_422.jpg",
        "baseline_444.jpg",
        "progressive_420.jpg",
        "gray.jpg",
        "cmyk.jpg",
        "rgb.png",
    ]
}

/// Writes an ImageFolder of `copies` of every kind of [`image_kinds`], one class per copy.
pub fn kinds_folder(root: &Path, copies: usize) {
    for c in 0..copies {
        let dir = root.join(format!("class_{c}"));
        std::fs::create_dir_all(&dir).unwrap();
        for (name, bytes) in image_kinds() {
            std::fs::write(dir.join(name), bytes).unwrap();
        }
    }
}

/// The first of [`image_kinds`] with its first scan naming a component (0x29) its frame does
/// not have: the CPU decoders refuse it; nvJPEG's hardware decoder does not check it (it
/// decoded it into pixels on an H200), so the GPU path must refuse it from the header.
pub fn corrupt_scan_jpeg() -> Vec<u8> {
    let (_, mut b) = image_kinds().into_iter().next().unwrap();
    let sos = b.windows(2).position(|m| m == [0xFF, 0xDA]).unwrap();
    // SOS: FF DA, length (2), count (1), then (selector, tables) per component.
    b[sos + 5] = 0x29;
    b
}
