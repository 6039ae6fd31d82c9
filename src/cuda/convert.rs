//! On-device conversion of u8 images: to f32, f16 or bf16, normalised per channel, laid out CHW.
//!
//! PCIe then carries u8 (a quarter of the f32 bytes) and the GPU does the arithmetic. The
//! kernel (`gpufeed_convert_u8` in the embedded PTX) computes, for each output element of
//! sample `n`, channel `c`, row `y`, column `x`:
//!
//! ```text
//! out[n, c, y, x] = cast(in[n, y, x, c] * a[c] + b[c])      (HWC input; CHW reads in[n, c, y, x])
//! a[c] = scale / std[c],  b[c] = -mean[c] / std[c]           (scale defaults to 1/255)
//! ```
//!
//! that is `(in * scale - mean) / std`, torchvision's `ToTensor` + `Normalize`, rounded to
//! nearest-even into f16 or bf16. A [`Convert`] says what to do with one batch field; a
//! [`Converter`] is its prepared form on one device (coefficients uploaded once).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaStream, sys};

use super::device::Kernels;
use super::fence::EventFence;
use super::{Device, DeviceBuffer, DevicePool};
use crate::error::{Error, Result};
use crate::format::DType;
use crate::transform::image::{Layout, Normalize};

/// The conversion of one u8 batch field (opt-in; see [conversion on the device](crate::cuda#conversion-on-the-device)).
#[derive(Clone, Debug, PartialEq)]
pub struct Convert {
    /// The batch field to convert (dtype u8, shape `[H, W, C]` or `[C, H, W]`).
    pub field: String,
    /// The input layout.
    pub layout: Layout,
    /// The output dtype: `F32`, `F16` or `BF16`.
    pub dtype: DType,
    /// Per-channel mean (after scaling), one value per channel or one for all; empty means 0.
    pub mean: Vec<f32>,
    /// Per-channel standard deviation, one per channel or one for all; empty means 1.
    pub std: Vec<f32>,
    /// Applied to the u8 value before normalising (default 1/255).
    pub scale: f32,
}

impl Convert {
    /// Converts field `field` of `layout` to `dtype`, scaled by 1/255, not normalised.
    pub fn new(field: impl Into<String>, layout: Layout, dtype: DType) -> Convert {
        Convert {
            field: field.into(),
            layout,
            dtype,
            mean: Vec::new(),
            std: Vec::new(),
            scale: 1.0 / 255.0,
        }
    }

    /// Normalises RGB images with `n` (after scaling): the image pipeline's
    /// [`Normalize`], so that a host transform and a device conversion take the same value
    /// (`Normalize::IMAGENET` for torchvision's statistics).
    pub fn normalize(self, n: Normalize) -> Convert {
        self.normalize_channels(&n.mean, &n.std)
    }

    /// Normalises with this per-channel mean and std (after scaling), for any number of
    /// channels: one value per channel, or one for all.
    pub fn normalize_channels(mut self, mean: &[f32], std: &[f32]) -> Convert {
        self.mean = mean.to_vec();
        self.std = std.to_vec();
        self
    }

    /// Sets the scale applied to the u8 value (default 1/255).
    pub fn scale(mut self, scale: f32) -> Convert {
        self.scale = scale;
        self
    }

    /// ImageNet's mean and std (torchvision's), scale 1/255.
    pub fn imagenet(field: impl Into<String>, layout: Layout, dtype: DType) -> Convert {
        Convert::new(field, layout, dtype).normalize(Normalize::IMAGENET)
    }

    /// `(channels, height, width)` of a per-sample input shape, checked against the layout.
    pub fn chw(&self, input_shape: &[usize]) -> Result<(usize, usize, usize)> {
        match (self.layout, input_shape) {
            (Layout::Hwc, &[h, w, c]) => Ok((c, h, w)),
            (Layout::Chw, &[c, h, w]) => Ok((c, h, w)),
            (_, &[h, w]) => Ok((1, h, w)),
            _ => Err(Error::config(
                "convert",
                format!(
                    "field `{}` has per-sample shape {input_shape:?}; converting needs [H, W, C] (HWC), [C, H, W] (CHW) or [H, W]",
                    self.field
                ),
            )),
        }
    }

    /// The per-channel coefficients `(a, b)` of `out = in * a + b`, checked.
    pub fn coefficients(&self, channels: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let pick = |v: &[f32], default: f32, what: &str| -> Result<Vec<f32>> {
            match v.len() {
                0 => Ok(vec![default; channels]),
                1 => Ok(vec![v[0]; channels]),
                n if n == channels => Ok(v.to_vec()),
                n => Err(Error::config(
                    "convert",
                    format!(
                        "field `{}`: {n} {what} values for {channels} channels",
                        self.field
                    ),
                )),
            }
        };
        let mean = pick(&self.mean, 0.0, "mean")?;
        let std = pick(&self.std, 1.0, "std")?;
        if let Some(s) = std.iter().find(|s| !(s.is_finite() && **s != 0.0)) {
            return Err(Error::config(
                "convert",
                format!(
                    "field `{}`: std {s} is not a finite non-zero number",
                    self.field
                ),
            ));
        }
        if !self.scale.is_finite() || mean.iter().any(|m| !m.is_finite()) {
            return Err(Error::config(
                "convert",
                format!("field `{}`: scale and mean must be finite", self.field),
            ));
        }
        let a = std.iter().map(|s| self.scale / s).collect();
        let b = mean.iter().zip(&std).map(|(m, s)| -m / s).collect();
        Ok((a, b))
    }

    fn dtype_code(&self) -> Result<u32> {
        match self.dtype {
            DType::F32 => Ok(0),
            DType::F16 => Ok(1),
            DType::BF16 => Ok(2),
            other => Err(Error::config(
                "convert",
                format!(
                    "field `{}`: cannot convert to {other}; choose f32, f16 or bf16",
                    self.field
                ),
            )),
        }
    }
}

/// A [`Convert`] prepared on one device for one per-sample input shape. Its coefficients live in
/// a device buffer fenced behind every launch, so dropping it never waits for the device.
pub struct Converter {
    spec: Convert,
    c: usize,
    h: usize,
    w: usize,
    dtype_code: u32,
    coefficients: DeviceBuffer,
    kernels: Arc<Kernels>,
    device: Device,
}

impl std::fmt::Debug for Converter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Converter")
            .field("spec", &self.spec)
            .field("chw", &(self.c, self.h, self.w))
            .finish()
    }
}

impl Converter {
    /// Prepares `spec` for samples of `input_shape` (u8): loads the kernels and uploads the
    /// coefficients (a blocking copy: setup, not the hot path).
    pub fn new(device: &Device, spec: Convert, input_shape: &[usize]) -> Result<Converter> {
        let (c, h, w) = spec.chw(input_shape)?;
        let dtype_code = spec.dtype_code()?;
        let (a, b) = spec.coefficients(c)?;
        let kernels = device.kernels()?;
        let bytes: Vec<u8> = a.iter().chain(&b).flat_map(|v| v.to_le_bytes()).collect();
        let mut coefficients = DevicePool::new(device).alloc(bytes.len())?;
        coefficients.upload_sync(device.copy_stream(), 0, &bytes)?;
        Ok(Converter {
            spec,
            c,
            h,
            w,
            dtype_code,
            coefficients,
            kernels,
            device: device.clone(),
        })
    }

    /// The conversion.
    pub fn spec(&self) -> &Convert {
        &self.spec
    }

    /// Input bytes of `n` samples.
    pub fn input_bytes(&self, n: usize) -> usize {
        n * self.c * self.h * self.w
    }

    /// Output bytes of `n` samples.
    pub fn output_bytes(&self, n: usize) -> usize {
        self.input_bytes(n) * self.spec.dtype.size()
    }

    /// The per-sample output shape, `[C, H, W]`.
    pub fn output_shape(&self) -> Vec<usize> {
        vec![self.c, self.h, self.w]
    }

    /// Enqueues the conversion of `n` samples on `stream`: input at `src[src_offset..]`,
    /// output at `dst[dst_offset..]` (the ranges are checked, and must not overlap when `src`
    /// and `dst` are one buffer). Ordered after the buffers' operations on other streams; both
    /// buffers (and the converter's coefficients) are fenced behind the kernel, so dropping
    /// them right after is safe. Does not wait.
    pub fn launch(
        &self,
        stream: &Arc<CudaStream>,
        src: &DeviceBuffer,
        src_offset: usize,
        dst: &DeviceBuffer,
        dst_offset: usize,
        n: usize,
    ) -> Result<()> {
        let (inb, outb) = (self.input_bytes(n), self.output_bytes(n));
        let fits = |b: &DeviceBuffer, off: usize, len: usize| {
            off.checked_add(len).is_some_and(|end| end <= b.len())
        };
        if !fits(src, src_offset, inb) || !fits(dst, dst_offset, outb) {
            return Err(Error::config(
                "convert",
                format!(
                    "{n} samples need {inb} input bytes at {src_offset} and {outb} output bytes at {dst_offset}; the buffers hold {} and {}",
                    src.len(),
                    dst.len()
                ),
            ));
        }
        let (s0, s1) = (
            src.addr() + src_offset as u64,
            src.addr() + (src_offset + inb) as u64,
        );
        let (d0, d1) = (
            dst.addr() + dst_offset as u64,
            dst.addr() + (dst_offset + outb) as u64,
        );
        if s0 < d1 && d0 < s1 {
            return Err(Error::config(
                "convert",
                "the input and output ranges overlap",
            ));
        }
        self.device.bind()?;
        src.order_on(stream)?;
        dst.order_on(stream)?;
        // SAFETY: both ranges are inside live device buffers (checked above) and do not overlap;
        // the buffers and the coefficients are fenced behind the kernel just below (or, failing
        // that, the stream is synchronised), so none is reused or freed under it.
        unsafe { self.launch_raw(stream, s0, d0, n) }?;
        let fenced = [
            src.record_use(stream),
            dst.record_use(stream),
            self.coefficients.record_use(stream),
        ];
        fenced.into_iter().collect()
    }

    /// Keeps the coefficient buffer from reuse until `fence`, recorded on `stream` after every
    /// launch of this converter on `stream`, has completed.
    pub(crate) fn fence_coefficients(&self, stream: &Arc<CudaStream>, fence: EventFence) {
        self.coefficients.add_use(stream, fence);
    }

    /// Enqueues the conversion of `n` samples from `src` to `dst` on `stream`.
    ///
    /// # Safety
    ///
    /// `src` must address `input_bytes(n)` bytes and `dst` `output_bytes(n)` bytes of device
    /// memory of this device that stay allocated until the kernel has run, and must not
    /// overlap. The caller must fence the coefficients behind the kernel before the converter
    /// drops ([`Converter::fence_coefficients`], or a use recorded on the stream).
    pub(crate) unsafe fn launch_raw(
        &self,
        stream: &CudaStream,
        src: sys::CUdeviceptr,
        dst: sys::CUdeviceptr,
        n: usize,
    ) -> Result<()> {
        let total = self.input_bytes(n);
        if total == 0 {
            return Ok(());
        }
        let mut total = u32::try_from(total)
            .ok()
            .filter(|t| *t < (1 << 31))
            .ok_or_else(|| {
                Error::config(
                    "convert",
                    format!(
                        "{total} elements in one conversion; at most 2^31 - 1 (use smaller batches)"
                    ),
                )
            })?;
        // Dimensions fit in u32 since their product does.
        let (mut c, mut h, mut w) = (self.c as u32, self.h as u32, self.w as u32);
        let mut src_chw = u32::from(self.spec.layout == Layout::Chw);
        let mut dtype = self.dtype_code;
        let (mut src, mut dst) = (src, dst);
        let mut scale = self.coefficients.addr();
        let mut bias = scale + 4 * self.c as u64;
        let mut args: [*mut c_void; 10] = [
            (&raw mut src).cast(),
            (&raw mut dst).cast(),
            (&raw mut scale).cast(),
            (&raw mut bias).cast(),
            (&raw mut total).cast(),
            (&raw mut c).cast(),
            (&raw mut h).cast(),
            (&raw mut w).cast(),
            (&raw mut src_chw).cast(),
            (&raw mut dtype).cast(),
        ];
        // SAFETY: the arguments match `gpufeed_convert_u8`'s parameters in order and type
        // (u64 x4, u32 x6) and live until the call returns; the kernel reads `total` bytes at
        // `src` and 2*C f32 coefficients (owned by self, fenced behind the kernel by the
        // caller's contract), and writes `total` elements of the output dtype at `dst`: in
        // bounds and allocated by the caller's contract.
        unsafe {
            self.device.launch_grid_stride(
                self.kernels.convert,
                total,
                stream,
                &mut args,
                "launch gpufeed_convert_u8",
            )
        }
    }
}
