//! Geometry: where to crop, with torchvision's rules, and the horizontal flip.
//!
//! [`random_resized_crop`] is torchvision's `RandomResizedCrop.get_params` (ten attempts, then
//! the central-crop fallback), drawing from a [`SampleRng`] instead of torch's generator;
//! [`resize_center_crop`] is `Resize(size)` (shorter side) followed by `CenterCrop`, expressed as
//! the source region that the centre crop covers and the box of the output it fills (all of
//! it, or less where torchvision pads a crop larger than the resized image). Python's `round` (half to even) and `int`
//! (truncation) are reproduced exactly, so the integer boxes match torchvision's for the same
//! random draws.

use crate::codec::Region;
use crate::transform::SampleRng;

/// A crop box in source pixels, as torchvision returns it: `(top, left, height, width)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CropBox {
    /// First row (torchvision's `i`).
    pub top: u32,
    /// First column (`j`).
    pub left: u32,
    /// Rows (`h`).
    pub height: u32,
    /// Columns (`w`).
    pub width: u32,
}

impl From<CropBox> for Region {
    fn from(b: CropBox) -> Region {
        Region {
            left: f64::from(b.left),
            top: f64::from(b.top),
            width: f64::from(b.width),
            height: f64::from(b.height),
        }
    }
}

/// torchvision's `RandomResizedCrop.get_params` for an image of `height` x `width` pixels.
///
/// Ten attempts draw an area fraction uniformly from `scale` and a log-uniform aspect ratio
/// from `ratio`; the first box that fits is placed uniformly at random. If none fits, the
/// fallback is a central crop of the whole image, clamped to the ratio range.
pub fn random_resized_crop(
    height: u32,
    width: u32,
    scale: (f64, f64),
    ratio: (f64, f64),
    rng: &mut SampleRng,
) -> CropBox {
    let area = f64::from(height) * f64::from(width);
    let (log_lo, log_hi) = (ratio.0.ln(), ratio.1.ln());
    for _ in 0..10 {
        let target_area = area * rng.uniform(scale.0, scale.1);
        let aspect = rng.uniform(log_lo, log_hi).exp();
        let w = (target_area * aspect).sqrt().round_ties_even();
        let h = (target_area / aspect).sqrt().round_ties_even();
        if 0.0 < w && w <= f64::from(width) && 0.0 < h && h <= f64::from(height) {
            let (w, h) = (w as u32, h as u32);
            // torch.randint(0, n + 1): uniform in 0..=n.
            let top = rng.below(u64::from(height - h) + 1) as u32;
            let left = rng.below(u64::from(width - w) + 1) as u32;
            return CropBox {
                top,
                left,
                height: h,
                width: w,
            };
        }
    }
    central_fallback(height, width, ratio)
}

/// The fallback of [`random_resized_crop`]: the largest central box whose aspect ratio is
/// within `ratio` (the whole image when its own ratio is).
pub fn central_fallback(height: u32, width: u32, ratio: (f64, f64)) -> CropBox {
    let in_ratio = f64::from(width) / f64::from(height);
    let (lo, hi) = (ratio.0.min(ratio.1), ratio.0.max(ratio.1));
    let (w, h) = if in_ratio < lo {
        let w = width;
        let h = (f64::from(w) / lo).round_ties_even() as u32;
        (w, h.min(height))
    } else if in_ratio > hi {
        let h = height;
        let w = (f64::from(h) * hi).round_ties_even() as u32;
        (w.min(width), h)
    } else {
        (width, height)
    };
    CropBox {
        top: (height - h) / 2,
        left: (width - w) / 2,
        height: h,
        width: w,
    }
}

/// Where [`resize_center_crop`] puts an image: the part of the source the output shows, and
/// the box of the output it is resized into.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CenterCrop {
    /// The source region, in source pixels: the crop's share of the source, or all of the
    /// source along a side on which the crop is larger than the resized image.
    pub region: Region,
    /// The box of the `crop_h` x `crop_w` output that `region` is resized into: the whole
    /// output where the crop fits the resized image; along a side where it does not, the
    /// resized image's length, `(crop - resized) / 2` (rounded down) from the output's edge,
    /// with zeros around it, as torchvision's `CenterCrop` pads.
    pub placed: CropBox,
}

/// torchvision's `Resize(resize)` (the shorter side becomes `resize`, the longer
/// `int(resize * long / short)`) then `CenterCrop((crop_h, crop_w))`, as the region of the
/// *source* image that the crop covers and where it goes in the output. Resizing that region
/// straight to its box gives the same sampling grid as resizing the whole image and then
/// cropping, without the waste.
///
/// Any crop works, as in torchvision: along each side, a crop no longer than the resized
/// image is cut from its middle (`int(round((resized - crop) / 2))` from its edge); a longer
/// one is padded with zeros, `(crop - resized) / 2` before the image (rounded down) and the
/// rest after ([`CenterCrop::placed`]).
pub fn resize_center_crop(
    height: u32,
    width: u32,
    resize: u32,
    crop_h: u32,
    crop_w: u32,
) -> CenterCrop {
    let (rh, rw) = resized_size(height, width, resize);
    let (top, pad_top, h) = center_side(rh, crop_h);
    let (left, pad_left, w) = center_side(rw, crop_w);
    let sy = f64::from(height) / f64::from(rh.max(1));
    let sx = f64::from(width) / f64::from(rw.max(1));
    CenterCrop {
        region: Region {
            left: left * sx,
            top: top * sy,
            width: f64::from(w) * sx,
            height: f64::from(h) * sy,
        },
        placed: CropBox {
            top: pad_top,
            left: pad_left,
            height: h,
            width: w,
        },
    }
}

/// One side of `CenterCrop(crop)` on a side of `resized` pixels: where the crop starts in the
/// resized image, where the image starts in the output (the padding before it), and how many
/// pixels of the image the output shows.
fn center_side(resized: u32, crop: u32) -> (f64, u32, u32) {
    if crop <= resized {
        // torchvision: top = int(round((h - ch) / 2.0)), Python's round (half to even).
        ((f64::from(resized - crop) / 2.0).round_ties_even(), 0, crop)
    } else {
        // torchvision pads (crop - h) // 2 before and (crop - h + 1) // 2 after.
        (0.0, (crop - resized) / 2, resized)
    }
}

/// The size `(height, width)` torchvision's `Resize(size)` gives an image: the shorter side
/// becomes `size`, the longer `int(size * long / short)` (at most `u32::MAX`).
pub fn resized_size(height: u32, width: u32, size: u32) -> (u32, u32) {
    let (short, long) = (height.min(width), height.max(width));
    let new_long = ((u64::from(size) * u64::from(long)) / u64::from(short.max(1)))
        .min(u64::from(u32::MAX)) as u32;
    if height <= width {
        (size, new_long)
    } else {
        (new_long, size)
    }
}

/// Mirrors packed HWC rows of `channels` bytes per pixel in place (left becomes right).
pub fn flip_horizontal(pixels: &mut [u8], width: usize, channels: usize) {
    let row = width * channels;
    if row == 0 {
        return;
    }
    match channels {
        // Whole pixels as arrays: `reverse` on `[[u8; N]]` compiles to wide loads and shuffles
        // (the byte-by-byte swap it replaces was 9% of a decode + crop + flip).
        1 => pixels.chunks_exact_mut(row).for_each(<[u8]>::reverse),
        3 => flip_rows::<3>(pixels, row),
        4 => flip_rows::<4>(pixels, row),
        _ => {
            for r in pixels.chunks_exact_mut(row) {
                let (mut a, mut b) = (0, width - 1);
                while a < b {
                    for c in 0..channels {
                        r.swap(a * channels + c, b * channels + c);
                    }
                    a += 1;
                    b -= 1;
                }
            }
        }
    }
}

/// Reverses the `N`-byte pixels of each `row`-byte row of `pixels`.
fn flip_rows<const N: usize>(pixels: &mut [u8], row: usize) {
    for r in pixels.chunks_exact_mut(row) {
        r.as_chunks_mut::<N>().0.reverse();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rrc_boxes_are_inside_the_image_and_in_range() {
        for seed in 0..2000u64 {
            let mut rng = SampleRng::new(seed, 0, seed);
            let (h, w) = (375, 500);
            let b = random_resized_crop(h, w, (0.08, 1.0), (3.0 / 4.0, 4.0 / 3.0), &mut rng);
            assert!(b.height > 0 && b.width > 0);
            assert!(b.top + b.height <= h && b.left + b.width <= w, "{b:?}");
            let frac = f64::from(b.height * b.width) / f64::from(h * w);
            let ratio = f64::from(b.width) / f64::from(b.height);
            // Rounding to whole pixels moves the area and ratio a little past the range.
            assert!((0.07..=1.0).contains(&frac), "{frac}");
            assert!((0.70..=1.40).contains(&ratio), "{ratio}");
        }
    }

    #[test]
    fn fallback_is_torchvisions_central_crop() {
        let r = (3.0 / 4.0, 4.0 / 3.0);
        // Too wide: full height, width = round(h * 4/3), centred.
        assert_eq!(
            central_fallback(100, 1000, r),
            CropBox {
                top: 0,
                left: (1000 - 133) / 2,
                height: 100,
                width: 133
            }
        );
        // Too tall: full width, height = round(w / (3/4)).
        assert_eq!(
            central_fallback(1000, 100, r),
            CropBox {
                top: (1000 - 133) / 2,
                left: 0,
                height: 133,
                width: 100
            }
        );
        // Within the range: the whole image.
        assert_eq!(
            central_fallback(375, 500, r),
            CropBox {
                top: 0,
                left: 0,
                height: 375,
                width: 500
            }
        );
        // An image where no attempt can fit (scale too large for a 1-pixel-high strip)
        // ends in the fallback.
        let mut rng = SampleRng::new(1, 2, 3);
        assert_eq!(
            random_resized_crop(1, 1000, (0.9, 1.0), r, &mut rng),
            central_fallback(1, 1000, r)
        );
    }

    #[test]
    fn resize_center_crop_matches_resize_then_crop() {
        // 500x375 -> Resize(256) -> 341x256 -> CenterCrop(224): top 16, left round(58.5)=58.
        assert_eq!(resized_size(375, 500, 256), (256, 341));
        let c = resize_center_crop(375, 500, 256, 224, 224);
        let r = c.region;
        let s = 375.0 / 256.0;
        assert!((r.top - 16.0 * s).abs() < 1e-9);
        assert!((r.left - 58.0 * 500.0 / 341.0).abs() < 1e-9);
        assert!((r.height - 224.0 * s).abs() < 1e-9);
        let whole = CropBox {
            top: 0,
            left: 0,
            height: 224,
            width: 224,
        };
        assert_eq!(c.placed, whole);
    }

    #[test]
    fn a_centre_crop_larger_than_the_resized_image_is_placed_as_torchvision_pads() {
        // 500x375 -> Resize(256) -> 341x256 -> CenterCrop((300, 200)): padded by 22 above
        // (and 22 below), cut from column round(70.5) = 70.
        let c = resize_center_crop(375, 500, 256, 300, 200);
        assert_eq!(
            c.placed,
            CropBox {
                top: 22,
                left: 0,
                height: 256,
                width: 200
            }
        );
        let (sx, sy) = (500.0 / 341.0, 375.0 / 256.0);
        assert!((c.region.top - 0.0).abs() < 1e-9);
        assert!((c.region.height - 256.0 * sy).abs() < 1e-9);
        assert!((c.region.left - 70.0 * sx).abs() < 1e-9);
        assert!((c.region.width - 200.0 * sx).abs() < 1e-9);
        // An odd difference, 344 - 341 = 3: 1 column of padding before the image, 2 after.
        let c = resize_center_crop(375, 500, 256, 256, 344);
        assert_eq!((c.placed.left, c.placed.width), (1, 341));
        assert!((c.region.width - 500.0).abs() < 1e-9);
    }

    #[test]
    fn resized_sizes_saturate_instead_of_wrapping() {
        assert_eq!(resized_size(1, 100_000, 100_000), (100_000, u32::MAX));
    }

    #[test]
    fn flip_mirrors_rows() {
        let mut px: Vec<u8> = (0..18).collect(); // 2 rows of 3 RGB pixels
        flip_horizontal(&mut px, 3, 3);
        assert_eq!(
            px,
            vec![6, 7, 8, 3, 4, 5, 0, 1, 2, 15, 16, 17, 12, 13, 14, 9, 10, 11]
        );
    }

    #[test]
    fn flip_matches_pixel_reversal_for_every_channel_count() {
        for channels in 1..=5usize {
            for width in [1usize, 2, 7, 224] {
                let rows = 3;
                let px: Vec<u8> = (0..width * channels * rows).map(|i| i as u8).collect();
                let mut want = Vec::new();
                for r in px.chunks_exact(width * channels) {
                    for p in r.chunks_exact(channels).rev() {
                        want.extend_from_slice(p);
                    }
                }
                let mut got = px.clone();
                flip_horizontal(&mut got, width, channels);
                assert_eq!(got, want, "{channels} channels, width {width}");
            }
        }
    }
}
