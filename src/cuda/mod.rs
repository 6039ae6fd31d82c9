//! The GPU path (feature `cuda`): pinned batch buffers, asynchronous host-to-device copies,
//! device batches, and opt-in on-device conversion.
//!
//! ```text
//!  Loader (workers collate into PINNED host buffers: PinnedBacking)
//!     │ Batch
//!     ▼
//!  copy thread ── cuMemcpyHtoDAsync (whole batch buffer, one copy) on the COPY STREAM
//!     │           into a DevicePool buffer; [optional convert kernel]; record an event;
//!     │           host buffer released behind it: reused only once the copy is done
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
//! | `pinned` | [`PinnedBacking`]: page-locked host memory for [`HostPool`](crate::memory::HostPool) |
//! | `fence` | [`EventFence`]: a CUDA event nobody outside the crate can record, as a pool fence |
//! | `device_pool` | [`DevicePool`], [`DeviceBuffer`]: the crate's caching pool over device memory |
//! | `batch` | [`DeviceBatch`] and its field views, [`DeviceField`]; [`RawStream`], a consumer's stream by handle |
//! | `copy` | [`DeviceLoader`]: the copy stage |
//! | `release` | the release thread, where a pool whose last handle goes is dropped ([`settle`]) |
//! | `convert` | [`Convert`], [`Converter`]: u8 images to normalised f32/f16/bf16 CHW on the device |
//! | `widen` | [`Widen`], [`Widener`]: u16/i16/u32/i32 fields to i32/i64 on the device (token batches) |
//! | `ceiling` | [`pinned_copy_ceiling`]: what a plain pinned copy reaches, the copy stage's yardstick |
//! | [`nvjpeg`] | JPEG decode on the GPU: nvJPEG loaded at run time, the decode stage and its resize kernels |
//!
//! Nothing here calls the driver before checking that it can be loaded: without a driver every
//! entry point returns [`Error::NoGpu`] instead of panicking (cudarc
//! panics when its library is missing). No function here ever synchronises the host on the hot
//! path; those that do (`*_sync`, `field_to_host`, benchmarks) say so. gpufeed never changes a
//! context's settings: cudarc's event tracking stays on, so a `CudaSlice` made on
//! [`Device::context`] is as sound as anywhere else, and gpufeed's own memory is ordered by its
//! own fences, whatever the setting.
//!
//! [`Error::NoGpu`]: crate::Error::NoGpu
//!
//! # The rule for device memory
//!
//! Device memory is owned, borrowed and fenced as host memory is owned and borrowed:
//!
//! - A [`DeviceBatch`] owns its device buffer. Its fields are [`DeviceField`] views that borrow
//!   the batch (cudarc's `CudaView<'_, T>` model): no view outlives its batch.
//! - Before enqueueing work that reads a batch on `stream`, call
//!   [`wait_on(stream)`](DeviceBatch::wait_on): the stream waits for the copy on the device
//!   (`cuStreamWaitEvent`, no host synchronisation) and is registered as a user. Register any
//!   other stream that uses the batch with [`release_on`](DeviceBatch::release_on) (PyTorch's
//!   `record_stream`). Then drop the batch whenever you like: a fence is recorded on every
//!   registered stream, and the buffer is reused only once those fences and the copy have
//!   completed.
//! - cudarc calls that take the view as a [`DevicePtr`] follow the
//!   rule by themselves: on a registered stream they are fenced by the drop; on any other
//!   stream they synchronise that stream once the read is enqueued.
//! - A raw address ([`DeviceField::ptr`], [`DeviceBuffer::ptr`]) is an `unsafe` accessor: it is
//!   valid while its owner lives and under this rule, and you take on the contract for every
//!   use of it (register the streams that use it, order reads after `wait_on`).
//! - Every operation gpufeed enqueues on a [`DeviceBuffer`] (fills, uploads, downloads,
//!   [`Converter::launch`]) records its fence on the buffer and is ordered after the buffer's
//!   uses on other streams; a dropped buffer's block is reused only once those fences have
//!   completed, and the pool waits for them before it frees a block.
//! - The events behind these fences never leave the crate ([`EventFence`]): nobody can record
//!   them again and make a fence read as complete before its work is.
//! - Consumers outside cudarc (DLPack, PyTorch) name their streams by raw handle
//!   ([`RawStream`]): [`DeviceBatch::wait_on_raw`] and [`DeviceBatch::release_on_raw`] are
//!   `wait_on` and `release_on` for them, through `&self`, so that an `Arc<DeviceBatch>` can be
//!   shared by several views on several threads. The handle is the `unsafe` part: a stream
//!   given to a batch must live until the batch drops.
//! - Letting go never waits: a batch's drop records its fences and returns its buffer (or, if
//!   the driver cannot record a fence, leaks it, counted); a pool whose last handle goes is
//!   dropped on gpufeed's release thread ([`settle`] waits for it). Calls that reach the driver
//!   from a thread that is not gpufeed's (a batch's drop, `wait_on_raw`, `DeviceLoader::new` and
//!   `stats`) leave that thread's current context as they found it.
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
//!
//! A [`Widen`] (opt-in, per integer field) makes it run one that widens u16, i16, u32 or i32
//! values to i32 or i64 (zero- or sign-extended), so that token ids cross PCIe as u16 and
//! arrive as the i64 an embedding takes.

mod batch;
mod ceiling;
mod convert;
mod copy;
mod device;
mod device_loader;
mod device_pool;
mod device_stats;
mod fence;
pub mod nvjpeg;
mod pinned;
mod release;
mod widen;

pub use batch::{DeviceBatch, DeviceField, RawStream};
pub use ceiling::pinned_copy_ceiling;
pub use convert::{Convert, Converter};
#[cfg(feature = "candle-cuda")]
pub(crate) use device::ContextScope;
pub use device::{Device, driver_present};
pub use device_loader::{DeviceLoader, DeviceLoaderOptions};
pub use device_pool::{DeviceBuffer, DevicePool, leaked_buffers, reserved_bytes};
pub use device_stats::DeviceStats;
pub use fence::EventFence;
pub use pinned::PinnedBacking;
pub use release::settle;
pub use widen::{Widen, Widener};

/// The types of cudarc (0.19) that gpufeed's device API takes and gives: streams, the context,
/// and the trait through which cudarc calls read a device view. cudarc is a public dependency
/// of the `cuda` feature; a new major version of cudarc comes with a new minor version of
/// gpufeed. For the rest of cudarc's API, depend on `cudarc` itself (same version).
pub use cudarc::driver::{CudaContext, CudaStream, DevicePtr};

use crate::error::Error;
use cudarc::driver::DriverError;

/// Maps a driver error of operation `op` to [`Error::Driver`], which keeps it as its source.
pub(crate) fn cuda_err(op: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |source| Error::Driver { op, source }
}
