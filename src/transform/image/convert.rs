//! The last step: RGB8 HWC pixels to the output's dtype and layout, with normalisation.
//!
//! A [`PixelWriter`] is built once per transform: for float outputs it precomputes, per channel,
//! the 256 values `(v / 255 - mean) / std` (as f32, and as f16 or bf16 bits), so converting a
//! pixel is a table lookup. u8 outputs are the pixels as they are (HWC) or transposed (CHW).

use crate::format::DType;

/// Where the channel axis of an image goes: in an [`ImageTransform`](super::ImageTransform)'s
/// output, and in the u8 input of a conversion on the GPU (`cuda::Convert`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum Layout {
    /// Height, width, channels (what decoders produce; PIL and NumPy's order; `.npy` image
    /// arrays usually hold it).
    Hwc,
    /// Channels, height, width (PyTorch's order; `ToTensor`).
    #[default]
    Chw,
}

/// Per-channel mean and standard deviation, on the `[0, 1]` scale (torchvision's `Normalize`
/// after `ToTensor`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Normalize {
    /// Subtracted from each channel.
    pub mean: [f32; 3],
    /// Each channel is then divided by this.
    pub std: [f32; 3],
}

impl Normalize {
    /// ImageNet's statistics, as torchvision's reference scripts use them.
    pub const IMAGENET: Normalize = Normalize {
        mean: [0.485, 0.456, 0.406],
        std: [0.229, 0.224, 0.225],
    };
}

/// Writes RGB8 HWC pixels into an output slot of one dtype and layout.
#[derive(Clone)]
pub(crate) struct PixelWriter {
    dtype: DType,
    layout: Layout,
    f32_lut: Box<[[f32; 256]; 3]>,
    half_lut: Box<[[u16; 256]; 3]>,
}

impl PixelWriter {
    /// A converter to `dtype` (u8, f16, bf16 or f32) in `layout`; float outputs are `v / 255`,
    /// then normalised if `norm` is given.
    pub fn new(dtype: DType, layout: Layout, norm: Option<Normalize>) -> PixelWriter {
        let mut f32_lut = Box::new([[0f32; 256]; 3]);
        let mut half_lut = Box::new([[0u16; 256]; 3]);
        let (mean, std) = norm.map_or(([0.0; 3], [1.0; 3]), |n| (n.mean, n.std));
        for c in 0..3 {
            for v in 0..256 {
                let x = (v as f32 / 255.0 - mean[c]) / std[c];
                f32_lut[c][v] = x;
                half_lut[c][v] = match dtype {
                    DType::BF16 => half::bf16::from_f32(x).to_bits(),
                    _ => half::f16::from_f32(x).to_bits(),
                };
            }
        }
        PixelWriter {
            dtype,
            layout,
            f32_lut,
            half_lut,
        }
    }

    /// True when the output is exactly the resized pixels (u8, HWC): resize straight into it.
    pub fn is_identity(&self) -> bool {
        self.dtype == DType::U8 && self.layout == Layout::Hwc
    }

    /// Converts `src` (`width` x `height` RGB8 pixels, HWC) into `dst` (exactly the slot's
    /// bytes), mirrored left to right when `flip` is set. `src` is scratch: it may be flipped
    /// in place.
    pub fn convert(&self, src: &mut [u8], width: usize, height: usize, flip: bool, dst: &mut [u8]) {
        let pixels = width * height;
        let src = &mut src[..pixels * 3];
        if flip && (self.dtype, self.layout) != (DType::U8, Layout::Chw) {
            super::crop::flip_horizontal(src, width, 3);
        }
        match (self.dtype, self.layout) {
            (DType::U8, Layout::Hwc) => dst.copy_from_slice(src),
            (DType::U8, Layout::Chw) => {
                let (r, rest) = dst.split_at_mut(pixels);
                let (g, b) = rest.split_at_mut(pixels);
                deinterleave(src, r, g, b);
                if flip && width > 0 {
                    // Reversing byte planes is cheaper than reversing 3-byte pixels.
                    for plane in [r, g, b] {
                        plane.chunks_exact_mut(width).for_each(<[u8]>::reverse);
                    }
                }
            }
            (DType::F32, layout) => {
                let lut = &self.f32_lut;
                write_typed::<4>(src, pixels, layout, dst, |c, v| {
                    lut[c][v as usize].to_le_bytes()
                });
            }
            (_, layout) => {
                let lut = &self.half_lut;
                write_typed::<2>(src, pixels, layout, dst, |c, v| {
                    lut[c][v as usize].to_le_bytes()
                });
            }
        }
    }
}

/// Splits packed RGB pixels (`src`, 3 bytes each) into three planes of `r.len()` bytes.
fn deinterleave(src: &[u8], r: &mut [u8], g: &mut [u8], b: &mut [u8]) {
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("ssse3") {
        // SAFETY: the CPU has SSSE3, the only requirement of `deinterleave_ssse3` beyond its
        // (safe) slice arguments; `is_x86_feature_detected!` caches its answer.
        done = unsafe { deinterleave_ssse3(src, r, g, b) };
    }
    let rest = r[done..]
        .iter_mut()
        .zip(&mut g[done..])
        .zip(&mut b[done..])
        .zip(src[done * 3..].chunks_exact(3));
    for (((r, g), b), px) in rest {
        (*r, *g, *b) = (px[0], px[1], px[2]);
    }
}

/// `shuffle[c][v]`: the `pshufb` mask that moves channel `c` of the pixels in the `v`-th
/// 16 bytes of a 48-byte block (16 RGB pixels) to their places in a 16-byte plane chunk;
/// 0x80 zeroes a lane.
#[cfg(target_arch = "x86_64")]
const SHUFFLE: [[[u8; 16]; 3]; 3] = {
    let mut m = [[[0x80u8; 16]; 3]; 3];
    let mut c = 0;
    while c < 3 {
        let mut i = 0;
        while i < 16 {
            let at = 3 * i + c; // the byte of pixel i's channel c in the block
            m[c][at / 16][i] = (at % 16) as u8;
            i += 1;
        }
        c += 1;
    }
    m
};

/// [`deinterleave`] 16 pixels at a time, three `pshufb` per plane (the scalar loop was 6% of
/// decode + crop + flip to u8 CHW; with this, CHW costs what HWC does). Returns how many
/// pixels it wrote (a multiple of 16).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "ssse3")]
fn deinterleave_ssse3(src: &[u8], r: &mut [u8], g: &mut [u8], b: &mut [u8]) -> usize {
    use std::arch::x86_64::{
        __m128i, _mm_loadu_si128, _mm_or_si128, _mm_shuffle_epi8, _mm_storeu_si128,
    };
    let load = |bytes: &[u8; 16]| {
        // SAFETY: `bytes` is 16 readable bytes; `loadu` has no alignment requirement.
        unsafe { _mm_loadu_si128(bytes.as_ptr().cast::<__m128i>()) }
    };
    let masks = SHUFFLE.map(|c| c.map(|v| load(&v)));
    let blocks = (src.len() / 48).min(r.len().min(g.len()).min(b.len()) / 16);
    let src = src[..blocks * 48].as_chunks::<16>().0;
    for (k, s) in src.chunks_exact(3).enumerate() {
        let a = [load(&s[0]), load(&s[1]), load(&s[2])];
        for (c, plane) in [&mut *r, &mut *g, &mut *b].into_iter().enumerate() {
            let m = &masks[c];
            let v = _mm_or_si128(
                _mm_or_si128(_mm_shuffle_epi8(a[0], m[0]), _mm_shuffle_epi8(a[1], m[1])),
                _mm_shuffle_epi8(a[2], m[2]),
            );
            let out = &mut plane[k * 16..k * 16 + 16];
            // SAFETY: `out` is 16 writable bytes (the slice above is bounds-checked);
            // `storeu` has no alignment requirement.
            unsafe { _mm_storeu_si128(out.as_mut_ptr().cast::<__m128i>(), v) };
        }
    }
    blocks * 16
}

fn write_typed<const N: usize>(
    src: &[u8],
    pixels: usize,
    layout: Layout,
    dst: &mut [u8],
    value: impl Fn(usize, u8) -> [u8; N],
) {
    match layout {
        Layout::Hwc => {
            for (k, (o, &v)) in dst.chunks_exact_mut(N).zip(src).enumerate() {
                o.copy_from_slice(&value(k % 3, v));
            }
        }
        Layout::Chw => {
            for (c, plane) in dst.chunks_exact_mut(pixels * N).enumerate().take(3) {
                for (o, px) in plane.chunks_exact_mut(N).zip(src.chunks_exact(3)) {
                    o.copy_from_slice(&value(c, px[c]));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn u8_chw_transposes() {
        let c = PixelWriter::new(DType::U8, Layout::Chw, None);
        let mut src = [1, 2, 3, 4, 5, 6];
        let mut dst = [0u8; 6];
        c.convert(&mut src, 2, 1, false, &mut dst);
        assert_eq!(dst, [1, 4, 2, 5, 3, 6]);
    }

    #[test]
    fn f32_normalises_per_channel() {
        let n = Normalize {
            mean: [0.5, 0.0, 1.0],
            std: [0.5, 1.0, 2.0],
        };
        let c = PixelWriter::new(DType::F32, Layout::Chw, Some(n));
        let mut src = [255, 0, 51];
        let mut dst = [0u8; 12];
        c.convert(&mut src, 1, 1, false, &mut dst);
        let got: Vec<f32> = dst
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(got[0], 1.0);
        assert_eq!(got[1], 0.0);
        assert!((got[2] - (0.2 - 1.0) / 2.0).abs() < 1e-6);
    }

    #[test]
    fn half_types_round_trip_within_their_precision() {
        for dtype in [DType::F16, DType::BF16] {
            let c = PixelWriter::new(dtype, Layout::Hwc, None);
            let mut src = [0, 128, 255];
            let mut dst = [0u8; 6];
            c.convert(&mut src, 1, 1, false, &mut dst);
            let v: Vec<f32> = dst
                .chunks_exact(2)
                .map(|b| {
                    let bits = u16::from_le_bytes([b[0], b[1]]);
                    if dtype == DType::F16 {
                        half::f16::from_bits(bits).to_f32()
                    } else {
                        half::bf16::from_bits(bits).to_f32()
                    }
                })
                .collect();
            assert_eq!(v[0], 0.0);
            assert_eq!(v[2], 1.0);
            assert!((v[1] - 128.0 / 255.0).abs() < 4e-3);
        }
    }

    #[test]
    fn flip_while_converting_equals_flip_then_convert() {
        // Widths around the 16-pixel blocks of the SSSE3 path, so both paths and the tail run.
        for (w, h) in [(5usize, 3usize), (16, 2), (37, 4), (224, 3)] {
            let src: Vec<u8> = (0..w * h * 3).map(|i| (i * 37 % 251) as u8).collect();
            let mut mirrored = src.clone();
            crate::transform::image::crop::flip_horizontal(&mut mirrored, w, 3);
            for dtype in [DType::U8, DType::F16, DType::BF16, DType::F32] {
                for layout in [Layout::Hwc, Layout::Chw] {
                    let c = PixelWriter::new(dtype, layout, Some(Normalize::IMAGENET));
                    let bytes = w * h * 3 * dtype.size();
                    let (mut got, mut want) = (vec![0u8; bytes], vec![0u8; bytes]);
                    c.convert(&mut src.clone(), w, h, true, &mut got);
                    c.convert(&mut mirrored.clone(), w, h, false, &mut want);
                    assert_eq!(got, want, "{dtype:?} {layout:?} {w}x{h}");
                }
            }
        }
    }

    #[test]
    fn u8_chw_puts_every_channel_in_its_plane() {
        for n in [0usize, 1, 15, 16, 17, 48, 100] {
            let src: Vec<u8> = (0..n * 3).map(|i| (i * 7 % 256) as u8).collect();
            let mut dst = vec![0u8; n * 3];
            PixelWriter::new(DType::U8, Layout::Chw, None).convert(
                &mut src.clone(),
                n,
                1,
                false,
                &mut dst,
            );
            for p in 0..n {
                for c in 0..3 {
                    assert_eq!(dst[c * n + p], src[p * 3 + c], "{n} pixels, pixel {p}");
                }
            }
        }
    }
}
