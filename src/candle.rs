//! Batches as [candle](https://github.com/huggingface/candle) tensors (feature `candle`; device
//! batches with `candle-cuda`).
//!
//! This module owns the hand-off from gpufeed's batches to candle: the dtype map
//! ([`candle_dtype`]), [`Batch::tensor`](crate::Batch::tensor) for host batches and, with
//! `candle-cuda`, [`DeviceBatch::tensor`](crate::cuda::DeviceBatch::tensor) for device batches.
//! A tensor never borrows gpufeed's memory: candle frees a tensor's storage when its last
//! handle drops (cudarc's `CudaSlice` frees its pointer), with no hook through which a pool
//! could take the block back, so a view of a pooled block cannot be given to candle safely.
//! Each hand-off is therefore one copy into storage candle owns:
//!
//! - **Device batches**: one device-to-device copy per field, enqueued on candle's stream after
//!   it waits for the batch's copy (`cuStreamWaitEvent`: the host does not wait). candle's
//!   stream is registered with the batch, so the batch's block returns to its pool only once
//!   that stream has passed the copy: drop the batch whenever you like. The copy reads and
//!   writes each byte once on the device: for a 38.5 MB f16 batch of 128 images at 224 x 224,
//!   46 microseconds of device time and 31 of host time on an H200, once candle's memory pool
//!   keeps what it frees (its release threshold of 0 makes it unmap freed memory at each
//!   synchronisation and map it again for the next tensor, which the copy then pays:
//!   `examples/candle_handoff.rs` sets the threshold; `benches/RESULTS.md` has the figures).
//! - **Host batches**: one host copy, into the `Vec` that candle's CPU storage is (candle has
//!   no CPU storage over borrowed memory), or through candle's own upload for a CUDA device.
//!
//! Tensors come out contiguous, shaped `[batch, per-sample shape...]` (a ragged field: its
//! values, `[items, item shape...]`), of the field's dtype; gpufeed's `u16`, `i8` and `u64`
//! have no candle dtype and are refused (widen them on the device first:
//! [`Widen`](crate::cuda::Widen)).
//!
//! ```no_run
//! # #[cfg(feature = "candle-cuda")]
//! # fn main() -> gpufeed::Result<()> {
//! use gpufeed::cuda::{Device, DeviceLoader, DeviceLoaderOptions};
//!
//! // One context for both: gpufeed's device made from candle's.
//! let candle = candle_core::Device::new_cuda(0).map_err(gpufeed::Error::user)?;
//! let device = gpufeed::candle::device_of(&candle)?;
//! # let builder: gpufeed::LoaderBuilder = unimplemented!();
//! let loader = DeviceLoader::from_builder(builder, &device, DeviceLoaderOptions::default())?;
//! for batch in loader {
//!     let batch = batch?;
//!     let x = batch.tensor("image", &candle)?; // [B, 3, 224, 224], ordered after the copy
//!     let y = batch.tensor("label", &candle)?; // [B], i64
//!     drop(batch); // its block is reused once candle's stream has copied it
//!     # let _ = (x, y);
//! }
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "candle-cuda"))]
//! # fn main() {}
//! ```

use candle_core::Tensor;

use crate::error::{Error, Result};
use crate::format::DType;
use crate::loader::Batch;

/// The candle dtype of gpufeed's `dtype` (`Bool` as `U8`); field `name` is the one concerned,
/// for the error of a dtype candle does not have (`u16`, `i8`, `u64`).
pub fn candle_dtype(dtype: DType, name: &str) -> Result<candle_core::DType> {
    use candle_core::DType as C;
    Ok(match dtype {
        DType::U8 | DType::Bool => C::U8,
        DType::I16 => C::I16,
        DType::U32 => C::U32,
        DType::I32 => C::I32,
        DType::I64 => C::I64,
        DType::F16 => C::F16,
        DType::BF16 => C::BF16,
        DType::F32 => C::F32,
        DType::F64 => C::F64,
        DType::U16 | DType::I8 | DType::U64 => {
            return Err(Error::mismatch(format!(
                "field `{name}` is {dtype}, which candle has no dtype for (it has u8, i16, u32, \
                 i32, i64, f16, bf16, f32, f64): widen it first (cuda::Widen on a device loader)"
            )));
        }
    })
}

/// A candle error met while handing field `name` over.
fn candle_error(name: &str, op: &'static str, source: candle_core::Error) -> Error {
    Error::Candle {
        what: format!("field `{name}`: {op}"),
        source: Box::new(source),
    }
}

impl Batch {
    /// Field `name` as a candle tensor on `device`: `[len(), per-sample shape...]` (a ragged
    /// field: its values), of the field's dtype ([`candle_dtype`]). One copy: into the `Vec`
    /// of candle's CPU storage, or through candle's upload for a CUDA device. See the
    /// [`candle`](crate::candle) module.
    pub fn tensor(&self, name: &str, device: &candle_core::Device) -> Result<Tensor> {
        let dtype = candle_dtype(self.dtype(name)?, name)?;
        let shape = self.shape(name)?;
        Tensor::from_raw_buffer(self.field_bytes(name)?, dtype, &shape, device)
            .map_err(|e| candle_error(name, "make a tensor of the host batch's bytes", e))
    }
}

#[cfg(feature = "candle-cuda")]
mod device {
    use std::sync::Arc;

    use candle_core::backend::BackendStorage;
    use candle_core::cuda::{CudaDType, CudaDevice, CudaStorage};
    use candle_core::op::BackpropOp;
    use candle_core::{Storage, Tensor};
    use cudarc::driver::{CudaStream, DevicePtrMut, DeviceRepr, result};

    use super::{candle_dtype, candle_error};
    use crate::cuda::{Device, DeviceBatch, DeviceField};
    use crate::error::{Error, Result};

    /// gpufeed's [`Device`] on candle's CUDA device's context, so that its batches can be
    /// handed to candle ([`DeviceBatch::tensor`]); its copy stream is gpufeed's own. An
    /// [`Error::Mismatch`] for a device that is not CUDA.
    pub fn device_of(device: &candle_core::Device) -> Result<Device> {
        let cuda = cuda_device(device, || "the loader's device".to_owned())?;
        Device::from_context(Arc::clone(cuda.cuda_stream().context()))
    }

    /// candle's CUDA device, or the error for `what` (the thing handed over) when `device` is
    /// not one.
    fn cuda_device(
        device: &candle_core::Device,
        what: impl FnOnce() -> String,
    ) -> Result<&CudaDevice> {
        match device {
            candle_core::Device::Cuda(cuda) => Ok(cuda),
            other => Err(Error::mismatch(format!(
                "{}: a device batch goes to a CUDA device, not {:?} (copy a host batch \
                 with Batch::tensor instead)",
                what(),
                other.location()
            ))),
        }
    }

    impl DeviceBatch {
        /// Field `name` as a candle tensor on `device`, which must be a CUDA device on the
        /// batch's context (open gpufeed's device with [`device_of`]): `[len(), per-sample
        /// shape...]` (a ragged field: its values), of the field's dtype
        /// ([`candle_dtype`](super::candle_dtype)).
        ///
        /// The tensor owns its memory: one device-to-device copy on candle's stream, after
        /// that stream waits for the batch's copy on the device (the host does not wait).
        /// candle's stream is registered with the batch ([`wait_on`](Self::wait_on)), so the
        /// batch's block goes back to its pool only once that stream has passed the copy:
        /// the batch may drop at once, and the tensor lives as long as candle keeps it.
        pub fn tensor(&self, name: &str, device: &candle_core::Device) -> Result<Tensor> {
            let field = self.field_bytes(name)?;
            let dtype = candle_dtype(field.dtype(), name)?;
            let cuda = cuda_device(device, || format!("field `{name}`"))?;
            let stream = cuda.cuda_stream();
            if stream.context().cu_ctx() != self.context().cu_ctx() {
                return Err(Error::mismatch(format!(
                    "field `{name}`: the batch is on GPU {} and candle's device is on GPU {} in \
                     another context; open gpufeed's device from candle's \
                     (gpufeed::candle::device_of) so that both share one",
                    self.ordinal(),
                    stream.context().ordinal()
                )));
            }
            let shape = field.shape();
            if field.bytes() == 0 {
                return Tensor::zeros(shape, dtype, device)
                    .map_err(|e| candle_error(name, "make an empty tensor", e));
            }
            self.wait_on(&stream)?;
            use candle_core::DType as C;
            let storage = match dtype {
                C::U8 => copy::<u8>(&field, cuda, &stream),
                C::I16 => copy::<i16>(&field, cuda, &stream),
                C::U32 => copy::<u32>(&field, cuda, &stream),
                C::I32 => copy::<i32>(&field, cuda, &stream),
                C::I64 => copy::<i64>(&field, cuda, &stream),
                C::F16 => copy::<half::f16>(&field, cuda, &stream),
                C::BF16 => copy::<half::bf16>(&field, cuda, &stream),
                C::F32 => copy::<f32>(&field, cuda, &stream),
                C::F64 => copy::<f64>(&field, cuda, &stream),
                other => {
                    return Err(Error::mismatch(format!(
                        "field `{name}`: no copy to candle's {other:?}"
                    )));
                }
            }?;
            debug_assert_eq!(storage.dtype(), dtype);
            Ok(Tensor::from_storage(
                Storage::Cuda(storage),
                shape,
                BackpropOp::none(),
                false,
            ))
        }
    }

    /// A new candle storage of `field`'s bytes as elements of `T`, copied on `stream` (which
    /// waits for the batch and is registered with it).
    fn copy<T: CudaDType + DeviceRepr>(
        field: &DeviceField<'_>,
        cuda: &CudaDevice,
        stream: &Arc<CudaStream>,
    ) -> Result<CudaStorage> {
        let name = field.name();
        let bytes = field.bytes();
        let len = bytes / std::mem::size_of::<T>();
        // SAFETY: uninitialised memory of `len` elements on `stream`; the copy below, enqueued
        // on the same stream before the storage is handed out, writes every byte of it.
        let mut slice = unsafe { cuda.alloc::<T>(len) }
            .map_err(|e| candle_error(name, "allocate the tensor's storage", e))?;
        {
            let (dst, _write) = slice.device_ptr_mut(stream);
            let _scope = crate::cuda::ContextScope::enter(stream.context())?;
            // SAFETY: `dst` holds `len * size_of::<T>() == bytes` bytes (the field's bytes are
            // whole elements of its dtype, which `T` is); the source is the field's `bytes`
            // bytes in the batch's block, alive while `field` borrows the batch, and the read
            // is ordered after the batch's copy and fenced before the block is reused:
            // `stream` waited for the copy and is registered with the batch (`wait_on`). The
            // context of both is current (the scope).
            unsafe { result::memcpy_dtod_async(dst, field.ptr(), bytes, stream.cu_stream()) }
                .map_err(crate::cuda::cuda_err(
                    "copy a field into candle's storage (cuMemcpyDtoDAsync)",
                ))?;
        }
        Ok(CudaStorage::wrap_cuda_slice(slice, cuda.clone()))
    }
}

#[cfg(feature = "candle-cuda")]
pub use device::device_of;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Loader, NpyArray};

    #[test]
    fn every_dtype_with_a_candle_dtype_maps_and_the_rest_are_refused_by_name() {
        use candle_core::DType as C;
        let cases = [
            (DType::U8, C::U8),
            (DType::Bool, C::U8),
            (DType::I16, C::I16),
            (DType::U32, C::U32),
            (DType::I32, C::I32),
            (DType::I64, C::I64),
            (DType::F16, C::F16),
            (DType::BF16, C::BF16),
            (DType::F32, C::F32),
            (DType::F64, C::F64),
        ];
        for (ours, theirs) in cases {
            assert_eq!(candle_dtype(ours, "x").unwrap(), theirs, "{ours}");
            // The sizes agree, so a field's bytes are whole elements of the tensor.
            assert_eq!(ours.size(), theirs.size_in_bytes(), "{ours}");
        }
        for ours in [DType::U16, DType::I8, DType::U64] {
            let e = candle_dtype(ours, "tokens").unwrap_err();
            assert_eq!(e.kind(), crate::ErrorKind::Mismatch);
            assert!(e.to_string().contains("`tokens`"), "{e}");
        }
    }

    #[test]
    fn a_host_batch_becomes_a_cpu_tensor_of_its_values_and_shape() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.npy");
        let rows = 10u64;
        let values: Vec<f32> = (0..rows * 6).map(|k| k as f32 * 0.5 - 7.0).collect();
        let mut bytes = crate::source::npy_header(DType::F32, &[rows, 2, 3]).unwrap();
        bytes.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        std::fs::write(&path, bytes).unwrap();
        let loader = Loader::builder(NpyArray::open(&path).unwrap())
            .batch_size(4)
            .shuffle(3)
            .workers(1)
            .build()
            .unwrap();
        let mut seen = 0;
        for batch in loader {
            let batch = batch.unwrap();
            let t = batch
                .tensor(NpyArray::FIELD, &candle_core::Device::Cpu)
                .unwrap();
            assert_eq!(t.dims(), &[batch.len(), 2, 3]);
            assert_eq!(t.dtype(), candle_core::DType::F32);
            let got = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let want: Vec<f32> = batch
                .indices()
                .iter()
                .flat_map(|&i| values[i as usize * 6..i as usize * 6 + 6].to_vec())
                .collect();
            assert_eq!(got, want, "batch {}", batch.number());
            let e = batch.tensor("nope", &candle_core::Device::Cpu).unwrap_err();
            assert!(e.to_string().contains("nope"), "{e}");
            seen += batch.len();
        }
        assert_eq!(seen, rows as usize);
    }
}
