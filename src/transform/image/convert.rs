//! The last step: RGB8 HWC pixels to the output's dtype and layout, with normalisation.
//!
//! A [`Converter`] is built once per transform: for float outputs it precomputes, per channel,
//! the 256 values `(v / 255 - mean) / std` (as f32, and as f16 or bf16 bits), so converting a
//! pixel is a table lookup. u8 outputs are the pixels as they are (HWC) or transposed (CHW).

use crate::format::DType;

/// Where the channel axis goes in an image output.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Layout {
    /// Height, width, channels (what decoders produce; PIL and NumPy's order).
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
pub(crate) struct Converter {
    dtype: DType,
    layout: Layout,
    f32_lut: Box<[[f32; 256]; 3]>,
    half_lut: Box<[[u16; 256]; 3]>,
}

impl Converter {
    /// A converter to `dtype` (u8, f16, bf16 or f32) in `layout`; float outputs are `v / 255`,
    /// then normalised if `norm` is given.
    pub fn new(dtype: DType, layout: Layout, norm: Option<Normalize>) -> Converter {
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
        Converter {
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

    /// Converts `src` (`pixels` RGB8 pixels, HWC) into `dst` (exactly the slot's bytes).
    pub fn convert(&self, src: &[u8], pixels: usize, dst: &mut [u8]) {
        let src = &src[..pixels * 3];
        match (self.dtype, self.layout) {
            (DType::U8, Layout::Hwc) => dst.copy_from_slice(src),
            (DType::U8, Layout::Chw) => {
                let (r, rest) = dst.split_at_mut(pixels);
                let (g, b) = rest.split_at_mut(pixels);
                for (p, px) in src.chunks_exact(3).enumerate() {
                    r[p] = px[0];
                    g[p] = px[1];
                    b[p] = px[2];
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
        let c = Converter::new(DType::U8, Layout::Chw, None);
        let src = [1, 2, 3, 4, 5, 6];
        let mut dst = [0u8; 6];
        c.convert(&src, 2, &mut dst);
        assert_eq!(dst, [1, 4, 2, 5, 3, 6]);
    }

    #[test]
    fn f32_normalises_per_channel() {
        let n = Normalize {
            mean: [0.5, 0.0, 1.0],
            std: [0.5, 1.0, 2.0],
        };
        let c = Converter::new(DType::F32, Layout::Chw, Some(n));
        let src = [255, 0, 51];
        let mut dst = [0u8; 12];
        c.convert(&src, 1, &mut dst);
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
            let c = Converter::new(dtype, Layout::Hwc, None);
            let src = [0, 128, 255];
            let mut dst = [0u8; 6];
            c.convert(&src, 1, &mut dst);
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
}
