//! JPEG decode on the GPU with nvJPEG (feature `cuda`): the library loaded at run time
//! (`library`), its API declared from NVIDIA's `nvjpeg.h` (`ffi`), safe faces over its handles
//! (`decoder`: the batched decode on the hardware JPEG engines, the decoupled decode of the
//! GPU backend), its memory from gpufeed's pools with a budget (`memory`), the resize kernels
//! (`resize`, over `src/cuda/kernels/resize.cu`), and the stage the copy thread runs on each
//! batch of the image pipeline's GPU decode (`stage`).
//!
//! The host half, what the workers gather and which engine takes which image, is
//! `transform::image::gpu` (the crate's own: the protocol between the workers and this stage);
//! a user asks for it with
//! [`ImageTransformBuilder::decode`](crate::transform::image::ImageTransformBuilder::decode)
//! and gets device batches from [`DeviceLoader::from_builder`](super::DeviceLoader::from_builder):
//!
//! ```no_run
//! use gpufeed::cuda::{Device, DeviceLoader, DeviceLoaderOptions};
//! use gpufeed::transform::image::{Decode, ImageTransform, Normalize};
//! use gpufeed::{DType, Loader};
//!
//! # fn main() -> gpufeed::Result<()> {
//! let device = Device::from_env()?;
//! let t = ImageTransform::train(224)
//!     .dtype(DType::F16)
//!     .normalize(Normalize::IMAGENET)
//!     .decode(Decode::Gpu) // nvJPEG on the GPU; the workers gather, and decode what it cannot
//!     .build()?;
//! let data = gpufeed::source::ImageFolder::open("train/")?;
//! let builder = Loader::builder(data).transform(t).batch_size(128).shuffle(0).workers(4);
//! let loader = DeviceLoader::from_builder(builder, &device, DeviceLoaderOptions::default())?;
//! for batch in loader {
//!     let batch = batch?; // `image`: f16 [128, 3, 224, 224] on the device, `label`: i64 [128]
//!     # let _ = batch;
//! }
//! # Ok(())
//! # }
//! ```
//!
//! A missing library is [`Error::MissingLibrary`](crate::Error::MissingLibrary), which says
//! where gpufeed looked and how to install it; [`Decode::Auto`](crate::transform::image::Decode)
//! then decodes on the CPU. Nothing of nvJPEG is touched by a loader that does not decode on
//! the GPU.

mod decoder;
mod ffi;
mod library;
mod memory;
mod resize;
mod stage;

pub use library::{Library, NVJPEG_ENV};
pub(crate) use stage::DecodeStage;

/// Settings of the GPU decode stage ([`DeviceLoaderOptions::decode`](super::DeviceLoaderOptions::decode)).
#[derive(Clone, Debug)]
pub struct DecodeOptions {
    /// Device memory the stage may hold (nvJPEG's buffers and the stage's scratch: decoded
    /// images, the resize's rows), a quarter of it again in pinned host memory for nvJPEG.
    /// `None`: eight batches of 1024 x 768 images, at least 1 GiB. A batch that needs more is
    /// an error naming the setting.
    pub memory: Option<u64>,
    /// Decode only the crop's region (and the resize's margin) of each JPEG, where the backend
    /// supports it (default true).
    pub roi: bool,
    /// Use the hardware JPEG engines where the GPU has them (default true; false: the GPU
    /// backend only).
    pub hardware: bool,
}

impl Default for DecodeOptions {
    fn default() -> Self {
        DecodeOptions {
            memory: None,
            roi: true,
            hardware: true,
        }
    }
}

/// What the GPU decode stage did, and with what ([`DeviceLoader::decode_report`](super::DeviceLoader::decode_report)).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct DecodeReport {
    /// Where libnvjpeg was loaded from.
    pub library: String,
    /// Its version.
    pub version: (i32, i32, i32),
    /// The hardware JPEG engines are used (known once the decoders are made: see `setup`).
    pub hardware: bool,
    /// Hardware engines, and cores per engine (0 where the library cannot say).
    pub hardware_engines: u32,
    /// Cores per hardware engine.
    pub hardware_cores: u32,
    /// nvJPEG's memory comes from the stage's budgeted pools (nvjpegCreateExV2).
    pub pooled_memory: bool,
    /// Region decode is on.
    pub roi: bool,
    /// The stage's device memory budget, bytes.
    pub memory_budget: u64,
    /// Batches decoded.
    pub batches: u64,
    /// Images nvJPEG decoded (timed batches).
    pub images: u64,
    /// Seconds the copy thread spent enqueueing decode work (nvJPEG's host side included).
    pub host_seconds: f64,
    /// Seconds of device time from each batch's first decode to its kernels' end.
    pub device_seconds: f64,
    /// The share of GPU-decodable images the workers decode now.
    pub cpu_share: f64,
    /// The counts of the transform's GPU decode (which engine took how many).
    pub counts: crate::transform::image::GpuDecodeCounts,
    /// Which image of gpufeed's kernels was loaded: `sm_90 cubin` (H100, H200), or the PTX,
    /// which the driver compiles on first load (or takes from its JIT cache).
    pub kernels: String,
    /// What the stage's creation cost, part by part (it counts in a first epoch, but the
    /// decoders are made while the workers decode: `setup.ready_seconds`).
    pub setup: DecodeSetup,
    /// The stage's own device pool (nvJPEG's buffers and the stage's scratch), as of the last
    /// batch enqueued: what the decode holds from the driver, beside the loader's batches.
    pub device_pool: crate::memory::PoolStats,
}

/// Seconds the parts of a decode stage's creation took (in [`DecodeReport::setup`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct DecodeSetup {
    /// Loading libnvjpeg (the first stage of the process; later ones find it loaded).
    pub library_seconds: f64,
    /// The hardware decoder: its nvJPEG handle (`nvjpegCreateExV2`) and ring of states (0
    /// until the decoders are made, as every figure of the decoders here).
    pub hardware_seconds: f64,
    /// The GPU-backend decoder: its handle, states and buffers.
    pub gpu_seconds: f64,
    /// Loading gpufeed's resize kernels (`cuModuleLoadData`: the driver's JIT for the PTX).
    pub kernels_seconds: f64,
    /// From the stage's creation to the copy thread taking the decoders, which are made on a
    /// thread of their own while the workers decode every image (0 until then).
    pub ready_seconds: f64,
    /// Batches the stage made before it took the decoders.
    pub batches_before_ready: u64,
}

/// Loads libnvjpeg (see [`Library::get`]) and says whether the GPU decode can run: `Ok` with
/// the library, or the [`Error::MissingLibrary`](crate::Error::MissingLibrary) that says why not.
pub fn load() -> crate::Result<std::sync::Arc<Library>> {
    Library::get()
}
