//! On-device widening of integer fields: u16, i16, u32 or i32 values to i32 or i64.
//!
//! Token ids fit 16 or 32 bits, positions 16, labels 32, but trainers index embeddings with
//! i64 (PyTorch's `nn.Embedding`, its cross-entropy's targets). Widening after the copy lets
//! PCIe carry the narrow values (a quarter of the bytes for u16 token ids) and the GPU write
//! the wide ones: the kernel (`gpufeed_widen` in the embedded PTX) zero-extends unsigned
//! values and sign-extends signed ones. A [`Widen`] says what to do with one batch field; a
//! [`Widener`] is its prepared form on one device.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaStream, sys};

use super::Device;
use super::device::Kernels;
use crate::error::{Error, Result};
use crate::format::DType;

/// The widening of one integer batch field on the device (opt-in; see [conversion on the
/// device](crate::cuda#conversion-on-the-device)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Widen {
    /// The batch field to widen (u16, i16, u32 or i32, any shape; not ragged).
    pub field: String,
    /// The output dtype: `I32` or `I64`, at least as wide as the field's (u32 only to i64).
    pub dtype: DType,
}

impl Widen {
    /// Widens field `field` to `dtype`.
    pub fn new(field: impl Into<String>, dtype: DType) -> Widen {
        Widen {
            field: field.into(),
            dtype,
        }
    }

    /// The kernel's codes of the input and output dtypes, checked: every input value must be
    /// an output value.
    fn codes(&self, from: DType) -> Result<(u32, u32)> {
        let wide = match self.dtype {
            DType::I32 => 0,
            DType::I64 => 1,
            other => {
                return Err(Error::config(
                    "widen",
                    format!(
                        "field `{}`: cannot widen to {other}; choose i32 or i64",
                        self.field
                    ),
                ));
            }
        };
        let code = match (from, wide) {
            (DType::U16, _) => 0,
            (DType::I16, _) => 1,
            (DType::U32, 1) => 2,
            (DType::I32, _) => 3,
            _ => {
                return Err(Error::config(
                    "widen",
                    format!(
                        "field `{}` is {from}: widening takes u16, i16, i32 (to i32 or i64) or u32 (to i64)",
                        self.field
                    ),
                ));
            }
        };
        Ok((code, wide))
    }
}

/// A [`Widen`] prepared on one device for one per-sample shape.
pub struct Widener {
    spec: Widen,
    from: DType,
    /// Elements per sample.
    elements: usize,
    codes: (u32, u32),
    kernels: Arc<Kernels>,
    device: Device,
}

impl std::fmt::Debug for Widener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Widener")
            .field("spec", &self.spec)
            .field("from", &self.from)
            .field("elements", &self.elements)
            .finish()
    }
}

impl Widener {
    /// Prepares `spec` for samples of `from` values of `shape`: checks the dtypes and loads the
    /// kernels.
    pub fn new(device: &Device, spec: Widen, from: DType, shape: &[usize]) -> Result<Widener> {
        let codes = spec.codes(from)?;
        let kernels = device.kernels()?;
        Ok(Widener {
            elements: shape.iter().product(),
            spec,
            from,
            codes,
            kernels,
            device: device.clone(),
        })
    }

    /// The widening.
    pub fn spec(&self) -> &Widen {
        &self.spec
    }

    /// Input bytes of `n` samples.
    pub fn input_bytes(&self, n: usize) -> usize {
        n * self.elements * self.from.size()
    }

    /// Output bytes of `n` samples.
    pub fn output_bytes(&self, n: usize) -> usize {
        n * self.elements * self.spec.dtype.size()
    }

    /// Enqueues the widening of `n` samples from `src` to `dst` on `stream`.
    ///
    /// # Safety
    ///
    /// `src` must address `input_bytes(n)` bytes and `dst` `output_bytes(n)` bytes of device
    /// memory of this device, aligned to the dtypes, that stay allocated until the kernel has
    /// run, and must not overlap.
    pub(crate) unsafe fn launch_raw(
        &self,
        stream: &CudaStream,
        src: sys::CUdeviceptr,
        dst: sys::CUdeviceptr,
        n: usize,
    ) -> Result<()> {
        let total = n * self.elements;
        if total == 0 {
            return Ok(());
        }
        let mut total = u32::try_from(total)
            .ok()
            .filter(|t| *t < (1 << 31))
            .ok_or_else(|| {
                Error::config(
                    "widen",
                    format!(
                        "field `{}`: {total} values in one batch; at most 2^31 - 1 (use smaller batches)",
                        self.spec.field
                    ),
                )
            })?;
        let (mut code, mut wide) = self.codes;
        let (mut src, mut dst) = (src, dst);
        let mut args: [*mut c_void; 5] = [
            (&raw mut src).cast(),
            (&raw mut dst).cast(),
            (&raw mut total).cast(),
            (&raw mut code).cast(),
            (&raw mut wide).cast(),
        ];
        // SAFETY: the arguments match `gpufeed_widen`'s parameters in order and type (u64 x2,
        // u32 x3) and live until the call returns; the kernel reads `total` values of the
        // input dtype at `src` and writes `total` of the output dtype at `dst`: in bounds,
        // aligned and allocated by the caller's contract.
        unsafe {
            self.device.launch_grid_stride(
                self.kernels.widen,
                total,
                stream,
                &mut args,
                "launch gpufeed_widen",
            )
        }
    }
}
