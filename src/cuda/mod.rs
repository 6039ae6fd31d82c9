//! The GPU path (feature `cuda`): pinned batch buffers, asynchronous host-to-device copies,
//! device batches, and opt-in on-device conversion.
//!
//! ```text
//!  Loader (workers collate into PINNED host buffers: PinnedBacking)
//!     │ Batch
//!     ▼
//!  copy thread ── cuMemcpyHtoDAsync (whole batch buffer, one copy) on the COPY STREAM
//!     │           into a DevicePool buffer; [optional convert kernel]; record an event;
//!     │           host buffer.release_after(event): it is reused only once the copy is done
//!     ▼ bounded channel (depth)
//!  consumer: DeviceBatch ── wait_on(stream): cuStreamWaitEvent, no host synchronisation
//!            drop ── the device buffer returns to its pool behind an event recorded on every
//!                    stream registered with wait_on / release_on
//! ```
//!
//! What each module owns:
//!
//! | module | owns |
//! |---|---|
//! | `device` | [`Device`]: the context, the copy stream, the embedded kernels |
//! | `pinned` | [`PinnedBacking`] (page-locked host memory for [`HostPool`](crate::memory::HostPool)) and [`EventFence`] |
//! | `device_pool` | [`DevicePool`]: a caching device allocator with torch-like stats |
//! | `copy` | [`DeviceLoader`], [`DeviceBatch`]: the copy stage |
//! | `convert` | [`Convert`], [`Converter`]: u8 images to normalised f32/f16/bf16 CHW on the device |
//! | `bench` | [`pinned_copy_ceiling`], [`bench_device`], [`bench_images_device`] |
//!
//! Nothing here calls the driver before checking that it can be loaded: without a driver every
//! entry point returns [`Error::NoGpu`] instead of panicking (cudarc
//! panics when its library is missing). No function here ever synchronises the host on the hot
//! path; those that do (`*_sync`, `to_host`, benchmarks) say so.
//!
//! [`Error::NoGpu`]: crate::Error::NoGpu
//!
//! # The rule for device memory
//!
//! A [`DeviceBatch`]'s memory is valid until the batch is dropped *and* every stream registered
//! with [`DeviceBatch::wait_on`] or [`DeviceBatch::release_on`] has passed the point where the
//! batch was dropped: on drop, an event is recorded on each registered stream and the device
//! buffer is reused only once those events (and the copy) have completed. So: call
//! `wait_on(stream)` before enqueueing work that reads the batch on `stream`; call
//! `release_on(other)` for any other stream you use it on (PyTorch's `record_stream`); then drop
//! the batch whenever you like, without synchronising. Raw addresses
//! ([`DeviceField::ptr`]) do not extend this.
//!
//! # Conversion on the device
//!
//! A [`Convert`] (opt-in, per u8 field) makes the copy thread run a kernel after the copy that
//! computes, for sample `n`, channel `c`, row `y`, column `x`:
//!
//! ```text
//! out[n, c, y, x] = cast(in[n, y, x, c] * a[c] + b[c])      (HWC input; CHW reads in[n, c, y, x])
//! a[c] = scale / std[c],  b[c] = -mean[c] / std[c]           (scale defaults to 1/255)
//! ```
//!
//! that is `(in * scale - mean) / std`, torchvision's `ToTensor` + `Normalize`, rounded to
//! nearest-even into f16 or bf16; PCIe carries u8 and the GPU does the arithmetic.

mod bench;
mod convert;
mod copy;
mod device;
mod device_pool;
mod pinned;

pub use bench::{DeviceBenchReport, bench_device, bench_images_device, pinned_copy_ceiling};
pub use convert::{Convert, Converter, ImageLayout};
pub use copy::{DeviceBatch, DeviceField, DeviceLoader, DeviceLoaderOptions, DeviceStats};
pub use device::{Device, driver_present};
pub use device_pool::{DeviceBuffer, DevicePool, DevicePoolStats};
pub use pinned::{EventFence, PinnedBacking};

/// cudarc's driver API, re-exported so that users name the same types (`CudaStream`,
/// `CudaEvent`, `sys::CUdeviceptr`) without a version mismatch.
pub use cudarc::driver as cudarc_driver;

use crate::error::Error;
use cudarc::driver::DriverError;

/// Maps a driver error of operation `op` to [`Error::Cuda`].
pub(crate) fn cuda_err(op: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |e| Error::Cuda {
        op,
        what: format!("{e:?}"),
    }
}
