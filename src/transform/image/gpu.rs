//! The host half of the GPU decode ([`Decode::Gpu`]): what the workers put in a batch for the
//! GPU to decode, and which engine takes which image.
//!
//! With the GPU decode, a worker does not decode a JPEG that the GPU can take: it reads the
//! header ([`inspect_jpeg`](crate::codec::inspect_jpeg), which also refuses a truncated file or
//! a declared size above the pixel limit before anything is allocated), draws the crop and the
//! flip from the same [`SampleRng`](crate::transform::SampleRng) as the CPU path, and copies
//! the encoded bytes into the sample's record; the GPU stage (`cuda::nvjpeg`) decodes the records of a
//! batch with nvJPEG and runs the crop, resize, flip and normalisation kernels. What nvJPEG
//! cannot decode ([`plan`]: PNG, CMYK and YCCK, RGB-coded, 12-bit, lossless and
//! arithmetic-coded JPEGs) the worker decodes, crops and resizes itself into the record as
//! output-sized u8 pixels, which the same kernels normalise: a mixed folder works, in the same
//! batches.
//!
//! A batch's fields on the host, in this order (so that one copy of their start moves the
//! metadata and the labels, and the records follow):
//!
//! | field | per sample | holds |
//! |---|---|---|
//! | `image.meta` | 64 bytes | a [`SampleRecord`]: the route, the record's length, the image's size, the crop and the flip |
//! | `label` | i64 | the label, -1 for a skipped image (when labels are asked for) |
//! | `image.records` | [`ImageTransformBuilder::encoded_capacity`](super::ImageTransformBuilder::encoded_capacity) bytes | the JPEG's bytes, or the worker's pixels |
//!
//! The records are a fixed capacity per sample until the crate batches variable-length fields
//! (values and offsets in one buffer); `RecordSlot` is the one place that writes them, and a
//! JPEG larger than the capacity is decoded by the worker (counted in [`GpuDecodeStats`]).
//!
//! Both engines busy ([`DecodeSplit`]): of the images the GPU could take, a share is decoded
//! by the workers instead, chosen per batch position. The share is set, or found by the loader
//! from what each side costs: the workers' time per image decoded and per image gathered, the
//! GPU stage's time per image, measured as the batches go.

// The reader of what the workers write here is the GPU stage (`cuda::nvjpeg`), built with
// `cuda` only: without it, its half of the protocol is not called.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::codec::{JpegHeader, Region, Subsampling};
use crate::error::{Error, Result};

/// Where the image pipeline decodes JPEGs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Hash)]
pub enum Decode {
    /// The worker threads decode every image (the default).
    #[default]
    Cpu,
    /// nvJPEG decodes the JPEGs it can take on the GPU (the hardware JPEG engines where the GPU
    /// has them), gpufeed's kernels crop, resize, flip and normalise there; the workers decode
    /// the rest. Needs a loader that feeds a GPU (`cuda::DeviceLoader::from_builder`); nvJPEG
    /// missing is an error.
    Gpu,
    /// [`Decode::Gpu`] when the loader feeds a GPU and nvJPEG can be loaded, else
    /// [`Decode::Cpu`].
    Auto,
}

impl std::str::FromStr for Decode {
    type Err = Error;

    fn from_str(s: &str) -> Result<Decode> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(Decode::Cpu),
            "gpu" => Ok(Decode::Gpu),
            "auto" => Ok(Decode::Auto),
            other => Err(Error::config(
                "decode",
                format!("{other:?} is not one of cpu, gpu, auto"),
            )),
        }
    }
}

impl std::fmt::Display for Decode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Decode::Cpu => "cpu",
            Decode::Gpu => "gpu",
            Decode::Auto => "auto",
        })
    }
}

/// Which engine decodes a sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub(crate) enum Route {
    /// nvJPEG's hardware JPEG engines (baseline JPEGs, 8-bit, 4:4:4, 4:2:2, 4:2:0, 4:4:0 or
    /// gray), through its batched decode; where the GPU has no engines, the GPU backend.
    Hardware = 0,
    /// nvJPEG's GPU backend (decoupled decode): progressive and extended JPEGs, 4:1:1 and 4:1:0.
    Gpu = 1,
    /// The worker decoded it: the record holds output-sized RGB8 pixels.
    Pixels = 2,
    /// A bad image skipped under [`OnBadImage::Skip`](super::OnBadImage::Skip): written as zeros.
    Skipped = 3,
}

impl Route {
    fn from_u32(v: u32) -> Option<Route> {
        Some(match v {
            0 => Route::Hardware,
            1 => Route::Gpu,
            2 => Route::Pixels,
            3 => Route::Skipped,
            _ => return None,
        })
    }
}

/// The engine nvJPEG would use for a JPEG with this header, or [`Route::Pixels`] for one it
/// cannot decode as the CPU path does: not 8-bit, lossless, arithmetic-coded or hierarchical,
/// 2 or 4 components (CMYK, YCCK), RGB-coded (an Adobe transform of 0: nvJPEG assumes YCbCr),
/// or chroma sampled in a way nvJPEG does not know.
pub(crate) fn plan(header: &JpegHeader) -> Route {
    if header.precision != 8 || header.is_adobe_rgb() {
        return Route::Pixels;
    }
    let sampling = header.subsampling();
    let hardware_sampling = matches!(
        sampling,
        Subsampling::S444
            | Subsampling::S422
            | Subsampling::S420
            | Subsampling::S440
            | Subsampling::Gray
    );
    let gpu_sampling =
        hardware_sampling || matches!(sampling, Subsampling::S411 | Subsampling::S410);
    match header.sof {
        0xC0 if hardware_sampling => Route::Hardware,
        0xC0..=0xC2 if gpu_sampling => Route::Gpu,
        _ => Route::Pixels,
    }
}

/// Bytes of a [`SampleRecord`] in the `image.meta` field.
pub(crate) const META_BYTES: usize = 64;

/// What the GPU stage needs to know of one sample, written by the worker in the `image.meta`
/// field (64 bytes, little-endian).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct SampleRecord {
    /// Which engine decodes it.
    pub route: Route,
    /// Bytes of the record used (the JPEG's length, or the pixels').
    pub len: u32,
    /// The image's width (for pixels: the output's).
    pub width: u32,
    /// The image's height (for pixels: the output's).
    pub height: u32,
    /// Mirror left to right after resizing.
    pub flip: bool,
    /// The region of the image resized to the output.
    pub region: Region,
}

impl SampleRecord {
    /// Writes the record into `out` (at least [`META_BYTES`] bytes; all of them written).
    pub(crate) fn write(&self, out: &mut [u8]) {
        let out = &mut out[..META_BYTES];
        out.fill(0);
        let words = [
            self.route as u32,
            self.len,
            self.width,
            self.height,
            u32::from(self.flip),
        ];
        for (k, w) in words.iter().enumerate() {
            out[4 * k..4 * k + 4].copy_from_slice(&w.to_le_bytes());
        }
        let r = self.region;
        for (k, v) in [r.left, r.top, r.width, r.height].iter().enumerate() {
            out[32 + 8 * k..40 + 8 * k].copy_from_slice(&v.to_le_bytes());
        }
    }

    /// Reads a record written by [`write`](Self::write); `None` for bytes no worker wrote
    /// (an unknown route).
    pub(crate) fn read(b: &[u8]) -> Option<SampleRecord> {
        let b = b.get(..META_BYTES)?;
        let word =
            |k: usize| u32::from_le_bytes([b[4 * k], b[4 * k + 1], b[4 * k + 2], b[4 * k + 3]]);
        let float = |k: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[32 + 8 * k..40 + 8 * k]);
            f64::from_le_bytes(a)
        };
        Some(SampleRecord {
            route: Route::from_u32(word(0))?,
            len: word(1),
            width: word(2),
            height: word(3),
            flip: word(4) != 0,
            region: Region {
                left: float(0),
                top: float(1),
                width: float(2),
                height: float(3),
            },
        })
    }
}

/// The one writer of a sample's record (the stopgap for variable-length batch fields: a fixed
/// capacity, the length in the [`SampleRecord`], the rest zeroed so that every byte of the slot
/// is written).
pub(crate) struct RecordSlot<'a> {
    slot: &'a mut [u8],
}

impl<'a> RecordSlot<'a> {
    pub(crate) fn new(slot: &'a mut [u8]) -> RecordSlot<'a> {
        RecordSlot { slot }
    }

    /// Bytes a record may hold.
    pub(crate) fn capacity(&self) -> usize {
        self.slot.len()
    }

    /// Gives `fill` the first `len` bytes to write, and zeroes the rest.
    pub(crate) fn put<T>(self, len: usize, fill: impl FnOnce(&mut [u8]) -> Result<T>) -> Result<T> {
        let (used, rest) = self.slot.split_at_mut(len.min(self.slot.len()));
        let out = fill(used);
        rest.fill(0);
        out
    }
}

/// Fixed-point scale of [`DecodeSplit`]'s share (parts per million).
const SHARE_ONE: u64 = 1_000_000;

/// How the images that the GPU could decode are split between the GPU and the worker threads
/// (DALI's `hw_decoder_load`, found by the loader unless set): a share of them, by batch
/// position, is decoded by the workers so that both sides finish a batch at about the same time.
///
/// The measured split: with `W` workers that each take `c` seconds to decode an image and `g`
/// to gather one for the GPU, and a GPU stage that takes `d` seconds per image it decodes, a
/// share `s` to the workers balances the two when `W * (1 - s) * d = s * c + (1 - s) * g`,
/// that is `s = (W d - g) / (W d - g + c)`, clamped to `[0, 0.9]` (0 when the workers cannot
/// even gather as fast as the GPU decodes). Until both sides have been measured, the share is
/// 1/8, so that the workers' decode time is measured too. The workers' costs are exponential
/// averages; the GPU's is the median of its last [`GPU_WINDOW`] batches, taken once it has
/// [`GPU_MIN_BATCHES`]: a decoder's first batches pay nvJPEG's first allocations, which an
/// average would carry for dozens of batches, sending the workers more than they can decode.
///
/// While the GPU stage makes nvJPEG's decoders (half a second to a second on an H200, paid
/// once per loader), a measured split is held: the workers decode every image
/// ([`hold`](Self::hold), [`release`](Self::release)), so that the first batches do not wait
/// for the GPU. A fixed share is kept from the first batch.
#[derive(Debug)]
pub(crate) struct DecodeSplit {
    /// Parts per million of GPU-decodable images that the workers decode.
    share: AtomicU64,
    /// The share is fixed (set by the user).
    fixed: bool,
    /// The GPU cannot decode yet: every image to the workers (a measured split only).
    held: AtomicBool,
    workers: AtomicU64,
    /// Exponential averages, in nanoseconds per image (0: not measured yet).
    cpu_ns: AtomicU64,
    gather_ns: AtomicU64,
    /// The median of `gpu_recent` (0: fewer than `GPU_MIN_BATCHES` measured).
    gpu_ns: AtomicU64,
    /// The GPU stage's cost per image of its last `GPU_WINDOW` batches, oldest first.
    gpu_recent: Mutex<VecDeque<u64>>,
}

/// Batches of the GPU stage whose median cost the split takes.
pub(crate) const GPU_WINDOW: usize = 8;
/// Batches of the GPU stage measured before the split moves: the median of 7 holds against 3
/// slow first batches.
pub(crate) const GPU_MIN_BATCHES: usize = 7;

/// The share to the workers before anything is measured.
const INITIAL_SHARE: f64 = 0.125;
/// The largest share the measured split gives the workers.
const MAX_SHARE: f64 = 0.9;

impl DecodeSplit {
    /// A split found from measurements (`share` `None`), or fixed at `share` (0 to 1).
    pub(crate) fn new(share: Option<f64>) -> DecodeSplit {
        let s = share.unwrap_or(INITIAL_SHARE).clamp(0.0, 1.0);
        DecodeSplit {
            share: AtomicU64::new((s * SHARE_ONE as f64).round() as u64),
            fixed: share.is_some(),
            held: AtomicBool::new(false),
            workers: AtomicU64::new(1),
            cpu_ns: AtomicU64::new(0),
            gather_ns: AtomicU64::new(0),
            gpu_ns: AtomicU64::new(0),
            gpu_recent: Mutex::new(VecDeque::with_capacity(GPU_WINDOW)),
        }
    }

    /// The share of GPU-decodable images the workers decode now.
    pub(crate) fn share(&self) -> f64 {
        self.share.load(Ordering::Relaxed) as f64 / SHARE_ONE as f64
    }

    /// Whether the sample at `position` of a batch goes to a worker: a low-discrepancy
    /// sequence over positions (the golden ratio's), so that every batch gets its share and
    /// the choice depends on the position alone.
    pub(crate) fn to_workers(&self, position: usize) -> bool {
        if self.held.load(Ordering::Acquire) {
            return true;
        }
        let share = self.share.load(Ordering::Relaxed);
        if share == 0 {
            return false;
        }
        // frac((position + 1) * phi), in parts per million.
        let x = ((position as u64 + 1).wrapping_mul(618_034)) % SHARE_ONE;
        x < share
    }

    /// Sends every image to the workers until [`release`](Self::release), unless the share is
    /// fixed: the GPU stage cannot decode yet (its decoders are being made).
    pub(crate) fn hold(&self) {
        if !self.fixed {
            self.held.store(true, Ordering::Release);
        }
    }

    /// The GPU decodes its share again (see [`hold`](Self::hold)).
    pub(crate) fn release(&self) {
        self.held.store(false, Ordering::Release);
    }

    /// Whether every image goes to the workers while the GPU cannot decode.
    #[cfg(test)]
    pub(crate) fn is_held(&self) -> bool {
        self.held.load(Ordering::Acquire)
    }

    /// The loader's worker count (the `W` of the formula).
    pub(crate) fn set_workers(&self, workers: usize) {
        self.workers.store(workers.max(1) as u64, Ordering::Relaxed);
    }

    /// A worker decoded an image in `ns` nanoseconds.
    pub(crate) fn measured_cpu(&self, ns: u64) {
        average(&self.cpu_ns, ns);
    }

    /// A worker gathered an image for the GPU in `ns` nanoseconds.
    pub(crate) fn measured_gather(&self, ns: u64) {
        average(&self.gather_ns, ns);
    }

    /// The GPU stage took `ns` nanoseconds for a batch of `images` images it decoded; updates
    /// the share unless it is fixed.
    pub(crate) fn measured_gpu(&self, ns: u64, images: usize) {
        if images == 0 {
            return;
        }
        let Some(median) = self.gpu_median((ns / images as u64).max(1)) else {
            return;
        };
        self.gpu_ns.store(median, Ordering::Relaxed);
        if self.fixed {
            return;
        }
        let (c, g, d) = (
            self.cpu_ns.load(Ordering::Relaxed) as f64,
            self.gather_ns.load(Ordering::Relaxed) as f64,
            self.gpu_ns.load(Ordering::Relaxed) as f64,
        );
        if c == 0.0 || g == 0.0 || d == 0.0 {
            return;
        }
        let w = self.workers.load(Ordering::Relaxed) as f64;
        let s = balanced_share(w, c, g, d);
        self.share
            .store((s * SHARE_ONE as f64).round() as u64, Ordering::Relaxed);
    }

    /// Notes the GPU stage's cost per image of a batch; the median of the last `GPU_WINDOW`,
    /// once `GPU_MIN_BATCHES` have been noted.
    fn gpu_median(&self, ns: u64) -> Option<u64> {
        let mut recent = self.gpu_recent.lock().ok()?;
        if recent.len() == GPU_WINDOW {
            recent.pop_front();
        }
        recent.push_back(ns);
        if recent.len() < GPU_MIN_BATCHES {
            return None;
        }
        let mut sorted: Vec<u64> = recent.iter().copied().collect();
        sorted.sort_unstable();
        Some(sorted[sorted.len() / 2])
    }

    /// The costs so far, nanoseconds per image: (worker decode, worker gather, GPU stage).
    #[cfg(test)]
    pub(crate) fn costs(&self) -> (u64, u64, u64) {
        (
            self.cpu_ns.load(Ordering::Relaxed),
            self.gather_ns.load(Ordering::Relaxed),
            self.gpu_ns.load(Ordering::Relaxed),
        )
    }
}

/// `s = (W d - g) / (W d - g + c)`, clamped to `[0, MAX_SHARE]` (see [`DecodeSplit`]).
fn balanced_share(workers: f64, cpu: f64, gather: f64, gpu: f64) -> f64 {
    let spare = workers * gpu - gather;
    if spare <= 0.0 {
        return 0.0;
    }
    (spare / (spare + cpu)).clamp(0.0, MAX_SHARE)
}

/// An exponential average with weight 1/8 for the new value (the first value is taken as it is).
fn average(slot: &AtomicU64, ns: u64) {
    let ns = ns.max(1);
    let _ = slot.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
        Some(if old == 0 { ns } else { old - old / 8 + ns / 8 })
    });
}

/// Counts of the GPU decode, shared by the transform (its workers) and the GPU stage.
#[derive(Debug, Default)]
pub(crate) struct GpuDecodeStats {
    /// Images the hardware engines decoded.
    pub hardware: AtomicU64,
    /// Images nvJPEG's GPU backend decoded.
    pub gpu: AtomicU64,
    /// Images the workers decoded because nvJPEG cannot (PNG, CMYK, ...).
    pub cpu_unsupported: AtomicU64,
    /// Images the workers decoded as their share of the split.
    pub cpu_share: AtomicU64,
    /// JPEGs larger than the record capacity, decoded by the workers.
    pub cpu_too_large: AtomicU64,
    /// Images nvJPEG refused that the GPU stage then decoded on its CPU thread.
    pub stage_fallback: AtomicU64,
}

impl GpuDecodeStats {
    /// The counts as plain numbers, for reports.
    pub(crate) fn snapshot(&self) -> GpuDecodeCounts {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        GpuDecodeCounts {
            hardware: l(&self.hardware),
            gpu: l(&self.gpu),
            cpu_unsupported: l(&self.cpu_unsupported),
            cpu_share: l(&self.cpu_share),
            cpu_too_large: l(&self.cpu_too_large),
            stage_fallback: l(&self.stage_fallback),
        }
    }
}

/// Which engine decoded how many images in the GPU decode, at one moment (in the device
/// loader's decode report).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct GpuDecodeCounts {
    /// Images the hardware engines decoded.
    pub hardware: u64,
    /// Images nvJPEG's GPU backend decoded.
    pub gpu: u64,
    /// Images the workers decoded because nvJPEG cannot.
    pub cpu_unsupported: u64,
    /// Images the workers decoded as their share of the split.
    pub cpu_share: u64,
    /// JPEGs larger than the record capacity, decoded by the workers.
    pub cpu_too_large: u64,
    /// Images nvJPEG refused that the GPU stage decoded on its CPU thread.
    pub stage_fallback: u64,
}

/// What the GPU stage needs of an [`ImageTransform`](super::ImageTransform) that leaves its
/// decode to the GPU: the output, and where the host batch keeps each sample's metadata,
/// label and record.
#[derive(Clone, Debug)]
pub(crate) struct GpuDecodePlan {
    /// Output height and width.
    pub size: (u32, u32),
    /// Output dtype (u8, f16, bf16, f32).
    pub dtype: crate::format::DType,
    /// Output layout.
    pub layout: super::Layout,
    /// Normalisation of float outputs (`None`: `v / 255`).
    pub normalize: Option<super::Normalize>,
    /// What to do with a JPEG nvJPEG refuses and the CPU cannot decode either.
    pub on_bad: super::OnBadImage,
    /// The decode limits (the pixel limit), for the GPU stage's own CPU fallback.
    pub limits: crate::codec::DecodeLimits,
    /// Host field positions: the metadata, the label (if any), the records.
    pub meta_field: usize,
    /// The label's field position, if labels are written.
    pub label_field: Option<usize>,
    /// The records' field position.
    pub records_field: usize,
    /// Bytes of each sample's record.
    pub capacity: usize,
    /// The split between the GPU and the workers.
    pub split: Arc<DecodeSplit>,
    /// The counts.
    pub stats: Arc<GpuDecodeStats>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(
        sof: u8,
        precision: u8,
        comps: u8,
        sampling: [(u8, u8); 4],
        adobe: Option<u8>,
    ) -> JpegHeader {
        JpegHeader {
            sof,
            precision,
            width: 500,
            height: 375,
            components: comps,
            sampling,
            adobe_transform: adobe,
        }
    }

    const S420: [(u8, u8); 4] = [(2, 2), (1, 1), (1, 1), (0, 0)];
    const S444: [(u8, u8); 4] = [(1, 1), (1, 1), (1, 1), (0, 0)];
    const S411: [(u8, u8); 4] = [(4, 1), (1, 1), (1, 1), (0, 0)];
    const GRAY: [(u8, u8); 4] = [(1, 1), (0, 0), (0, 0), (0, 0)];

    #[test]
    fn the_planner_sends_each_kind_of_jpeg_to_its_engine() {
        let cases = [
            (
                header(0xC0, 8, 3, S420, None),
                Route::Hardware,
                "baseline 4:2:0",
            ),
            (
                header(0xC0, 8, 3, S444, Some(1)),
                Route::Hardware,
                "baseline 4:4:4, Adobe YCbCr",
            ),
            (
                header(0xC0, 8, 1, GRAY, None),
                Route::Hardware,
                "baseline gray",
            ),
            (header(0xC0, 8, 3, S411, None), Route::Gpu, "baseline 4:1:1"),
            (header(0xC2, 8, 3, S420, None), Route::Gpu, "progressive"),
            (
                header(0xC1, 8, 3, S420, None),
                Route::Gpu,
                "extended sequential",
            ),
            (header(0xC0, 12, 3, S420, None), Route::Pixels, "12-bit"),
            (header(0xC3, 8, 3, S444, None), Route::Pixels, "lossless"),
            (header(0xC9, 8, 3, S420, None), Route::Pixels, "arithmetic"),
            (
                header(0xC0, 8, 4, [(1, 1); 4], Some(2)),
                Route::Pixels,
                "YCCK",
            ),
            (
                header(0xC0, 8, 4, [(1, 1); 4], Some(0)),
                Route::Pixels,
                "CMYK",
            ),
            (
                header(0xC0, 8, 3, S444, Some(0)),
                Route::Pixels,
                "Adobe RGB",
            ),
            (
                header(0xC0, 8, 3, [(2, 2), (2, 1), (1, 1), (0, 0)], None),
                Route::Pixels,
                "odd sampling",
            ),
        ];
        for (h, want, what) in cases {
            assert_eq!(plan(&h), want, "{what}");
        }
    }

    #[test]
    fn records_round_trip_and_unknown_routes_are_refused() {
        let r = SampleRecord {
            route: Route::Gpu,
            len: 81_234,
            width: 500,
            height: 375,
            flip: true,
            region: Region {
                left: 12.0,
                top: 3.5,
                width: 400.25,
                height: 300.0,
            },
        };
        let mut b = vec![0xAAu8; META_BYTES + 3];
        r.write(&mut b);
        assert_eq!(SampleRecord::read(&b), Some(r));
        assert_eq!(b[META_BYTES], 0xAA, "writes exactly META_BYTES");
        b[0] = 9;
        assert_eq!(SampleRecord::read(&b), None);
        assert_eq!(SampleRecord::read(&b[..10]), None);
    }

    #[test]
    fn a_record_slot_zeroes_what_it_does_not_use() {
        let mut slot = vec![7u8; 16];
        let n = RecordSlot::new(&mut slot)
            .put(5, |b| {
                b.copy_from_slice(b"abcde");
                Ok(b.len())
            })
            .unwrap();
        assert_eq!(n, 5);
        assert_eq!(&slot[..5], b"abcde");
        assert!(slot[5..].iter().all(|&b| b == 0));
    }

    #[test]
    fn a_held_split_sends_every_image_to_the_workers_until_released_unless_fixed() {
        let measured = DecodeSplit::new(None);
        let ours = |s: &DecodeSplit| (0..1000).filter(|&p| s.to_workers(p)).count();
        assert_eq!(ours(&measured), 125);
        measured.hold();
        assert!(measured.is_held());
        assert_eq!(ours(&measured), 1000);
        measured.release();
        assert!(!measured.is_held());
        assert_eq!(ours(&measured), 125);
        let fixed = DecodeSplit::new(Some(0.0));
        fixed.hold();
        assert!(!fixed.is_held());
        assert_eq!(
            ours(&fixed),
            0,
            "a share the user fixed holds from the first batch"
        );
    }

    #[test]
    fn the_split_gives_each_batch_its_share_by_position() {
        for share in [0.0, 0.1, 0.25, 0.5, 0.9, 1.0] {
            let s = DecodeSplit::new(Some(share));
            let n = 1000;
            let taken = (0..n).filter(|&p| s.to_workers(p)).count();
            assert!(
                (taken as f64 - share * n as f64).abs() <= 2.0,
                "share {share}: {taken} of {n}"
            );
            // A batch of 128 gets its share too (low discrepancy).
            let taken = (0..128).filter(|&p| s.to_workers(p)).count();
            assert!(
                (taken as f64 - share * 128.0).abs() <= 2.0,
                "share {share}: {taken} of 128"
            );
        }
    }

    #[test]
    fn the_measured_split_balances_both_sides() {
        // 16 workers at 1.3 ms a decode and 20 us a gather; a GPU at 50 us an image: the
        // workers can take s = (16 * 50 - 20) / (16 * 50 - 20 + 1300) = 0.375.
        let s = balanced_share(16.0, 1300.0, 20.0, 50.0);
        assert!((s - 780.0 / 2080.0).abs() < 1e-12, "{s}");
        // Then both sides take the same time per batch.
        let (w, c, g, d) = (16.0, 1300.0, 20.0, 50.0);
        assert!(((s * c + (1.0 - s) * g) / w - (1.0 - s) * d).abs() < 1e-9);
        // Workers too few to gather as fast as the GPU decodes: nothing to them.
        assert_eq!(balanced_share(1.0, 1300.0, 80.0, 50.0), 0.0);
        // A very slow GPU: at most 90% to the workers.
        assert_eq!(balanced_share(64.0, 100.0, 1.0, 1e6), MAX_SHARE);

        let split = DecodeSplit::new(None);
        assert_eq!(split.share(), INITIAL_SHARE);
        split.set_workers(16);
        split.measured_gpu(50_000 * 100, 100); // nothing on the workers' side yet
        assert_eq!(split.share(), INITIAL_SHARE);
        split.measured_cpu(1_300_000);
        split.measured_gather(20_000);
        for _ in 1..GPU_MIN_BATCHES - 1 {
            split.measured_gpu(50_000 * 100, 100);
        }
        assert_eq!(split.share(), INITIAL_SHARE, "too few GPU batches to move");
        split.measured_gpu(50_000 * 100, 100);
        assert!((split.share() - 0.375).abs() < 1e-6, "{}", split.share());
        // A fixed split stays where it was set.
        let fixed = DecodeSplit::new(Some(0.2));
        fixed.measured_cpu(1_300_000);
        fixed.measured_gather(20_000);
        fixed.measured_gpu(5_000_000, 100);
        assert_eq!(fixed.share(), 0.2);
    }

    #[test]
    fn the_gpu_decoders_first_slow_batches_do_not_move_the_split() {
        let split = DecodeSplit::new(None);
        split.set_workers(16);
        split.measured_cpu(1_300_000);
        split.measured_gather(20_000);
        // Three first batches at 20 times the steady cost (nvJPEG's first allocations), then
        // steady ones: the share is the steady balance from the first move on.
        for k in 0..12 {
            let per_image = if k < 3 { 1_000_000 } else { 50_000 };
            split.measured_gpu(per_image * 100, 100);
            if k + 1 >= GPU_MIN_BATCHES {
                assert!(
                    (split.share() - 0.375).abs() < 1e-6,
                    "batch {k}: {}",
                    split.share()
                );
                assert_eq!(split.costs().2, 50_000);
            }
        }
        // A GPU that has become slower for good moves the split within the window.
        for _ in 0..GPU_WINDOW / 2 + 1 {
            split.measured_gpu(200_000 * 100, 100);
        }
        assert!(split.share() > 0.6, "{}", split.share());
    }

    #[test]
    fn decode_modes_parse_and_print() {
        for m in [Decode::Cpu, Decode::Gpu, Decode::Auto] {
            assert_eq!(m.to_string().parse::<Decode>().unwrap(), m);
        }
        assert_eq!(" GPU ".parse::<Decode>().unwrap(), Decode::Gpu);
        let e = "nvjpeg".parse::<Decode>().unwrap_err();
        assert!(e.to_string().contains("cpu, gpu, auto"), "{e}");
    }
}
