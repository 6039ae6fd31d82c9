//! gpufeed's measuring harnesses, above the library's layers: what `gpufeed bench` and the
//! criterion benches run, and what the library itself never compiles.
//!
//! | module | measures |
//! |---|---|
//! | [`baseline`] | [`gather_baseline`]: a plain multi-threaded memcpy gather in the loader's order, the yardstick of the loader's overhead |
//! | [`images`] | [`bench_images`]: the image pipeline (decode, crop, resize, flip, collate) through the loader, epoch by epoch |
//! | [`rates`] | [`steady_rate`]: the rate of the epochs after the first; [`Timeline`]: what was delivered when |
//! | `device` (feature `cuda`) | `bench_device` and `bench_images_device`: the same through the GPU path, against the pinned-copy ceiling |
//!
//! The figures they produce, with the machines and commands, are in `benches/RESULTS.md`.

pub mod baseline;
#[cfg(feature = "cuda")]
pub mod device;
pub mod images;
pub mod rates;

pub use baseline::gather_baseline;
#[cfg(feature = "cuda")]
pub use device::{DeviceBenchReport, bench_device, bench_images_device};
pub use images::{ImageBenchConfig, ImageBenchReport, bench_images};
pub use rates::{Timeline, steady_rate};
