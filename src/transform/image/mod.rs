//! The image pipeline: decode, crop and resize, flip, normalise, cast, into the batch slot.
//!
//! - [`decode`](crate::codec): JPEG and PNG bytes to RGB8, in reusable per-thread buffers;
//! - [`crop`]: torchvision's crop geometry (RandomResizedCrop, Resize + CenterCrop) and flips;
//! - `convert`: RGB8 HWC to u8/f16/bf16/f32 ([`Layout`] HWC or CHW), [`Normalize`]d;
//! - [`ImageTransform`]: all of it as one [`SampleTransform`], built with [`ImageTransform::train`]
//!   or [`ImageTransform::eval`].
//!
//! Resizing is fast_image_resize's SIMD convolution with the bilinear filter, antialiased like
//! PIL's (what torchvision uses on PIL images). Resizing only the cropped region of the source
//! straight to the output size gives the same result as cropping then resizing. For u8 HWC
//! output the resizer writes straight into the batch slot; other outputs go through one
//! per-thread scratch image and a table-driven conversion.
//!
//! Randomness only comes from [`SampleContext::rng`]: the crop is drawn first, then the flip, so
//! a sample's augmentation depends on (seed, epoch, index) alone, never on the worker.
//!
//! Bad images ([`OnBadImage`]): by default the batch fails with an [`Error::Image`] naming the
//! file (the loader wraps it with the sample index and batch). With [`OnBadImage::Skip`], the
//! sample's image slot is zeroed, its label set to -1, and the count goes up in
//! [`ImageStats`]: batches keep their fixed size and a training loop can mask `label < 0`.
//! An image is bad when it cannot be decoded, when it declares more pixels than
//! [`ImageTransformBuilder::max_pixels`] allows or than its bytes can hold, and when its crop
//! has no pixels (RandomResizedCrop's fallback box for a tiny image and a ratio range far from
//! its own). This module never panics on image bytes.
//!
//! Memory: each worker thread keeps its decode buffers from one image to the next, so the
//! steady state allocates nothing; after an image that needed more than
//! [`KEEP_BUFFER_BYTES`] in one of them, that buffer is freed rather than kept for the life of
//! the loader.

mod convert;
pub mod crop;
pub(crate) mod gpu;

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use fast_image_resize as fir;

pub use crate::codec::Region;
pub use crate::codec::{DecodeLimits, Decoded, ImageKind};
use convert::PixelWriter;
pub use convert::{Layout, Normalize};
pub use crop::CropBox;
pub use gpu::{Decode, GpuDecodeCounts};
pub(crate) use gpu::{DecodeSplit, GpuDecodePlan, GpuDecodeStats, Route, SampleRecord};

use crate::codec;
use crate::error::{Error, Result};
use crate::format::{DType, FieldKind, Schema};
use crate::layout::{OutputField, Slots};
use crate::source::Sample;
use crate::transform::{SampleContext, SampleTransform};

/// What an [`ImageTransform`] does to the geometry of an image.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Geometry {
    /// torchvision's `RandomResizedCrop(size, scale, ratio)` then `RandomHorizontalFlip(p)`.
    Train {
        /// Range of the crop's area, as a fraction of the image's (default `(0.08, 1.0)`).
        scale: (f64, f64),
        /// Range of the crop's aspect ratio, width / height (default `(3/4, 4/3)`).
        ratio: (f64, f64),
        /// Probability of a horizontal flip (default 0.5).
        flip: f64,
    },
    /// torchvision's `Resize(resize)` (shorter side) then `CenterCrop(size)`: any size works;
    /// along a side on which it is larger than the resized image, the output is padded with
    /// zeros as torchvision pads ([`crop::resize_center_crop`]).
    Eval {
        /// The shorter side after resizing (default `size * 256 / 224`, 256 for 224).
        resize: u32,
    },
}

/// The resampling filter of the resize (see [`ImageTransformBuilder::filter`]): a convolution
/// whose support grows with the scale factor when downscaling (antialiased, as PIL and
/// torchvision's `antialias=True` do).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum ResizeFilter {
    /// Each source pixel contributes with the same weight (area averaging when downscaling).
    Box,
    /// Linear interpolation (torchvision's default interpolation).
    #[default]
    Bilinear,
    /// Hamming: as fast as bilinear, sharper when downscaling.
    Hamming,
    /// Catmull-Rom bicubic.
    CatmullRom,
    /// Mitchell-Netravali bicubic.
    Mitchell,
    /// Gaussian, with a standard deviation of 0.5.
    Gaussian,
    /// Lanczos with three lobes (PIL's `LANCZOS`).
    Lanczos3,
}

impl ResizeFilter {
    /// The resizer's filter.
    fn filter_type(self) -> fir::FilterType {
        match self {
            ResizeFilter::Box => fir::FilterType::Box,
            ResizeFilter::Bilinear => fir::FilterType::Bilinear,
            ResizeFilter::Hamming => fir::FilterType::Hamming,
            ResizeFilter::CatmullRom => fir::FilterType::CatmullRom,
            ResizeFilter::Mitchell => fir::FilterType::Mitchell,
            ResizeFilter::Gaussian => fir::FilterType::Gaussian,
            ResizeFilter::Lanczos3 => fir::FilterType::Lanczos3,
        }
    }
}

/// What to do with an image that cannot be decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OnBadImage {
    /// Fail the batch with an error naming the file (the default).
    #[default]
    Fail,
    /// Zero the sample's image, set its label to -1, count it in [`ImageStats`], go on.
    Skip,
}

/// Counts an [`ImageTransform`] keeps; shared, so a handle taken before the transform moves
/// into a loader stays live.
#[derive(Debug, Default)]
pub struct ImageStats {
    decoded: AtomicU64,
    skipped: AtomicU64,
    last_skipped: Mutex<Option<Error>>,
}

impl ImageStats {
    /// Images decoded and written by the workers, in every batch made, those made ahead of
    /// the consumer and not delivered yet included.
    pub fn decoded(&self) -> u64 {
        self.decoded.load(Ordering::Relaxed)
    }

    /// Bad images skipped (with [`OnBadImage::Skip`]) by the workers, in every batch made,
    /// those made ahead of the consumer and not delivered yet included. What the consumer
    /// received is the loader's [`LoaderStats::skipped`](crate::loader::LoaderStats::skipped)
    /// (each delivered batch's [`BatchInfo::skipped`](crate::BatchInfo::skipped), summed).
    pub fn skipped(&self) -> u64 {
        self.skipped.load(Ordering::Relaxed)
    }

    /// The message of the last image skipped by the workers, if any.
    pub fn last_skipped(&self) -> Option<String> {
        self.map_last_skipped(Error::to_string)
    }

    /// `f` of the error of the last image skipped by the workers, if any: for a front-end
    /// that words it for its users (the setting that raises a limit, say).
    pub fn map_last_skipped<T>(&self, f: impl FnOnce(&Error) -> T) -> Option<T> {
        self.last_skipped.lock().ok()?.as_ref().map(f)
    }
}

/// Settings of an [`ImageTransform`]; see [`ImageTransform::train`] and [`ImageTransform::eval`].
#[derive(Clone, Debug)]
pub struct ImageTransformBuilder {
    geometry: Geometry,
    size: (u32, u32),
    dtype: DType,
    layout: Layout,
    normalize: Option<Normalize>,
    on_bad: OnBadImage,
    image_field: String,
    label_field: Option<String>,
    filter: ResizeFilter,
    limits: DecodeLimits,
    decode: Decode,
    encoded_capacity: usize,
    cpu_share: Option<f64>,
}

/// The default [`ImageTransformBuilder::encoded_capacity`]: 256 KiB per sample.
pub const DEFAULT_ENCODED_CAPACITY: usize = 256 << 10;

impl ImageTransformBuilder {
    /// Output height and width (default 224 x 224).
    pub fn size(mut self, height: u32, width: u32) -> Self {
        self.size = (height, width);
        self
    }

    /// RandomResizedCrop's area range (train only; default `(0.08, 1.0)`).
    pub fn scale(mut self, lo: f64, hi: f64) -> Self {
        if let Geometry::Train { scale, .. } = &mut self.geometry {
            *scale = (lo, hi);
        }
        self
    }

    /// RandomResizedCrop's aspect-ratio range (train only; default `(3/4, 4/3)`).
    pub fn ratio(mut self, lo: f64, hi: f64) -> Self {
        if let Geometry::Train { ratio, .. } = &mut self.geometry {
            *ratio = (lo, hi);
        }
        self
    }

    /// Probability of a horizontal flip (train only; default 0.5; 0 disables it).
    pub fn flip(mut self, p: f64) -> Self {
        if let Geometry::Train { flip, .. } = &mut self.geometry {
            *flip = p;
        }
        self
    }

    /// The shorter side before the centre crop (eval only; default `size * 256 / 224`). A crop
    /// (see [`size`](Self::size)) larger than the resized image along a side is padded with
    /// zeros there, as torchvision's `CenterCrop` pads.
    pub fn resize(mut self, shorter: u32) -> Self {
        if let Geometry::Eval { resize } = &mut self.geometry {
            *resize = shorter;
        }
        self
    }

    /// Output element type: u8 (pixels), or f16, bf16, f32 (`v / 255`, then normalised).
    pub fn dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    /// Output layout (default CHW, as PyTorch expects).
    pub fn layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self
    }

    /// Normalises float outputs with this mean and std (see [`Normalize::IMAGENET`]).
    pub fn normalize(mut self, n: Normalize) -> Self {
        self.normalize = Some(n);
        self
    }

    /// What to do with images that cannot be decoded (default [`OnBadImage::Fail`]).
    pub fn on_bad_image(mut self, policy: OnBadImage) -> Self {
        self.on_bad = policy;
        self
    }

    /// The input bytes field holding encoded images (default `image`).
    pub fn image_field(mut self, name: impl Into<String>) -> Self {
        self.image_field = name.into();
        self
    }

    /// The input integer field copied to the output `label` as i64 (default `label`; `None`
    /// writes no label).
    pub fn label_field(mut self, name: Option<&str>) -> Self {
        self.label_field = name.map(str::to_owned);
        self
    }

    /// The resampling filter (default bilinear, as torchvision's default interpolation).
    pub fn filter(mut self, filter: ResizeFilter) -> Self {
        self.filter = filter;
        self
    }

    /// The largest image decoded, in pixels (width x height): a larger one is a bad image
    /// ([`OnBadImage`]), refused from its header before anything is allocated for it. Default
    /// [`codec::DEFAULT_MAX_PIXELS`] (89,478,485, PIL's `MAX_IMAGE_PIXELS`); each worker may
    /// hold about 6 bytes per pixel of the largest image it decodes while it decodes it.
    pub fn max_pixels(mut self, pixels: u64) -> Self {
        self.limits.max_pixels = pixels;
        self
    }

    /// Where JPEGs are decoded (default [`Decode::Cpu`]): [`Decode::Gpu`] leaves them to
    /// nvJPEG and gpufeed's kernels on the GPU of a `cuda::DeviceLoader` (`docs/GPU.md`,
    /// "Decoding JPEGs on the GPU").
    pub fn decode(mut self, decode: Decode) -> Self {
        self.decode = decode;
        self
    }

    /// With the GPU decode, the bytes each sample's record holds in the pinned batch (default
    /// [`DEFAULT_ENCODED_CAPACITY`], and never less than an output image of u8 pixels): a JPEG
    /// larger than this is decoded by the worker instead.
    pub fn encoded_capacity(mut self, bytes: usize) -> Self {
        self.encoded_capacity = bytes;
        self
    }

    /// With the GPU decode, the share (0 to 1) of the JPEGs the GPU could take that the
    /// workers decode instead; `None` (the default): found from what each side costs, batch
    /// by batch, so that the workers and the GPU finish a batch at about the same time.
    pub fn cpu_share(mut self, share: Option<f64>) -> Self {
        self.cpu_share = share;
        self
    }

    /// Checks the settings and builds the transform.
    pub fn build(self) -> Result<ImageTransform> {
        let (h, w) = self.size;
        if h == 0 || w == 0 {
            return Err(Error::config("size", format!("{h}x{w} has no pixels")));
        }
        match self.geometry {
            Geometry::Train { scale, ratio, flip } => {
                let ok = |r: (f64, f64)| r.0.is_finite() && r.1.is_finite() && r.0 <= r.1;
                if !ok(scale) || scale.0 <= 0.0 {
                    return Err(Error::config(
                        "scale",
                        format!("{scale:?} must be a positive, ordered range"),
                    ));
                }
                if !ok(ratio) || ratio.0 <= 0.0 {
                    return Err(Error::config(
                        "ratio",
                        format!("{ratio:?} must be a positive, ordered range"),
                    ));
                }
                if !(0.0..=1.0).contains(&flip) {
                    return Err(Error::config(
                        "flip",
                        format!("{flip} is not a probability"),
                    ));
                }
            }
            Geometry::Eval { resize } => {
                if resize == 0 {
                    return Err(Error::config(
                        "resize",
                        "a shorter side of 0 pixels leaves nothing to crop",
                    ));
                }
            }
        }
        if !matches!(
            self.dtype,
            DType::U8 | DType::F16 | DType::BF16 | DType::F32
        ) {
            return Err(Error::config(
                "dtype",
                format!(
                    "{} images are not supported (u8, f16, bf16, f32)",
                    self.dtype
                ),
            ));
        }
        if self.dtype == DType::U8 && self.normalize.is_some() {
            return Err(Error::config(
                "normalize",
                "u8 output holds pixels; normalisation needs a float dtype",
            ));
        }
        if let Some(n) = self.normalize
            && n.std.iter().any(|&s| s == 0.0 || !s.is_finite())
        {
            return Err(Error::config("normalize", format!("std {:?}", n.std)));
        }
        if self.limits.max_pixels == 0 {
            return Err(Error::config(
                "max_pixels",
                "0 pixels allows no image at all",
            ));
        }
        if let Some(s) = self.cpu_share
            && !(0.0..=1.0).contains(&s)
        {
            return Err(Error::config(
                "cpu_share",
                format!("{s} is not a share from 0 to 1"),
            ));
        }
        if self.decode != Decode::Cpu && self.filter != ResizeFilter::Bilinear {
            return Err(Error::config(
                "decode",
                format!(
                    "the GPU decode resizes with the bilinear filter only, not {:?}: choose decode=cpu for it",
                    self.filter
                ),
            ));
        }
        let pixels = 3 * h as usize * w as usize;
        if self.decode != Decode::Cpu && self.encoded_capacity < pixels {
            return Err(Error::config(
                "encoded_capacity",
                format!(
                    "{} bytes per sample cannot hold the {h}x{w} RGB pixels a worker writes for an image the GPU cannot decode ({pixels} bytes)",
                    self.encoded_capacity
                ),
            ));
        }
        Ok(ImageTransform {
            converter: PixelWriter::new(self.dtype, self.layout, self.normalize),
            pixels: PixelWriter::new(DType::U8, Layout::Hwc, None),
            stats: Arc::new(ImageStats::default()),
            on_gpu: OnceLock::new(),
            split: Arc::new(DecodeSplit::new(self.cpu_share)),
            gpu_stats: Arc::new(GpuDecodeStats::default()),
            cfg: self,
        })
    }
}

/// Decodes an encoded image field and writes an augmented, resized image (and its label) into
/// the batch. See the [module docs](self).
///
/// Output fields: `image` (`[H, W, 3]` or `[3, H, W]` of the chosen dtype) and, unless disabled,
/// `label` (i64 scalar).
///
/// ```
/// use gpufeed::format::DType;
/// use gpufeed::source::ImageFolder;
/// use gpufeed::transform::image::{ImageTransform, Normalize};
/// use gpufeed::Loader;
///
/// # fn main() -> gpufeed::Result<()> {
/// // An ImageFolder as torchvision reads it: a directory per class (here 2 classes, 3 PNGs each).
/// let root = tempfile::tempdir().map_err(gpufeed::Error::user)?;
/// for (class, shade) in [("cat", 40u8), ("dog", 200)] {
///     std::fs::create_dir(root.path().join(class)).map_err(gpufeed::Error::user)?;
///     for k in 0..3 {
///         let png = image::RgbImage::from_pixel(48, 32, image::Rgb([shade, shade, shade]));
///         png.save(root.path().join(class).join(format!("{k}.png"))).map_err(gpufeed::Error::user)?;
///     }
/// }
/// let folder = ImageFolder::open(root.path())?;
/// // RandomResizedCrop(16) + RandomHorizontalFlip, normalised with ImageNet's mean and std, as f16.
/// let t = ImageTransform::train(16).dtype(DType::F16).normalize(Normalize::IMAGENET).build()?;
/// let mut loader = Loader::builder(folder).transform(t).batch_size(6).shuffle(0).workers(2).build()?;
/// let batch = loader.next().unwrap()?;
/// assert_eq!(batch.shape("image")?, [6, 3, 16, 16]); // CHW by default
/// let images: &[half::f16] = batch.field("image")?;
/// let labels: &[i64] = batch.field("label")?; // the class's index, in sorted order
/// for (image, &label) in images.chunks(3 * 16 * 16).zip(labels) {
///     // A flat grey image stays flat: dark for `cat` (0), light for `dog` (1).
///     assert_eq!(image[0].to_f32() > 0.0, label == 1);
/// }
/// # Ok(())
/// # }
/// ```
pub struct ImageTransform {
    cfg: ImageTransformBuilder,
    converter: PixelWriter,
    /// RGB8 HWC as it is: what a worker writes into a record for the GPU stage.
    pixels: PixelWriter,
    stats: Arc<ImageStats>,
    /// Whether the GPU decodes this transform's JPEGs, decided once, when a loader is built.
    on_gpu: OnceLock<bool>,
    split: Arc<DecodeSplit>,
    gpu_stats: Arc<GpuDecodeStats>,
}

impl std::fmt::Debug for ImageTransform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageTransform")
            .field("cfg", &self.cfg)
            .finish()
    }
}

/// A worker thread's decode buffer that grew past this many bytes for one image is freed
/// after it, not kept: an occasional huge image (or a corrupt one that was allocated for and
/// then failed) does not hold its memory for the life of the loader.
pub const KEEP_BUFFER_BYTES: usize = 64 << 20;

/// Buffers each worker thread reuses: decoded pixels, decoder scratch, resized pixels, resizer.
struct ThreadBuffers {
    decoded: Vec<u8>,
    scratch: Vec<u8>,
    resized: Vec<u8>,
    resizer: fir::Resizer,
}

impl ThreadBuffers {
    fn new() -> ThreadBuffers {
        ThreadBuffers {
            decoded: Vec::new(),
            scratch: Vec::new(),
            resized: Vec::new(),
            resizer: fir::Resizer::new(),
        }
    }

    /// Frees the buffers that grew past [`KEEP_BUFFER_BYTES`] (and the resizer's, with them).
    fn shrink_oversized(&mut self) {
        let mut any = false;
        for v in [&mut self.decoded, &mut self.scratch, &mut self.resized] {
            if v.capacity() > KEEP_BUFFER_BYTES {
                *v = Vec::new();
                any = true;
            }
        }
        if any {
            self.resizer = fir::Resizer::new();
        }
    }
}

thread_local! {
    static BUFFERS: RefCell<Option<ThreadBuffers>> = const { RefCell::new(None) };
}

impl ImageTransform {
    fn builder(geometry: Geometry, size: u32) -> ImageTransformBuilder {
        ImageTransformBuilder {
            geometry,
            size: (size, size),
            dtype: DType::U8,
            layout: Layout::Chw,
            normalize: None,
            on_bad: OnBadImage::Fail,
            image_field: "image".into(),
            label_field: Some("label".into()),
            filter: ResizeFilter::Bilinear,
            limits: DecodeLimits::default(),
            decode: Decode::Cpu,
            encoded_capacity: DEFAULT_ENCODED_CAPACITY,
            cpu_share: None,
        }
    }

    /// Training augmentation: `RandomResizedCrop(size)` + `RandomHorizontalFlip()`; u8 CHW
    /// output unless changed.
    pub fn train(size: u32) -> ImageTransformBuilder {
        ImageTransform::builder(
            Geometry::Train {
                scale: (0.08, 1.0),
                ratio: (3.0 / 4.0, 4.0 / 3.0),
                flip: 0.5,
            },
            size,
        )
    }

    /// Evaluation: `Resize(size * 256 / 224)` + `CenterCrop(size)`; u8 CHW output unless changed.
    pub fn eval(size: u32) -> ImageTransformBuilder {
        let resize = ((u64::from(size) * 256) / 224) as u32;
        ImageTransform::builder(Geometry::Eval { resize }, size)
    }

    /// The counts of images decoded and skipped; the handle stays live after the transform
    /// moves into a loader.
    pub fn stats(&self) -> Arc<ImageStats> {
        Arc::clone(&self.stats)
    }

    /// The output image's field description.
    pub fn image_output(&self) -> OutputField {
        let (h, w) = self.cfg.size;
        let shape = match self.cfg.layout {
            Layout::Hwc => [h as usize, w as usize, 3],
            Layout::Chw => [3, h as usize, w as usize],
        };
        OutputField::new("image", self.cfg.dtype, &shape)
    }

    /// Writes the augmented image for `ctx` from encoded `bytes` into `slot` (the image
    /// field's bytes). `name` names the source in errors.
    pub fn apply_image(
        &self,
        bytes: &[u8],
        name: &str,
        ctx: &SampleContext,
        slot: &mut [u8],
    ) -> Result<()> {
        BUFFERS.with(|cell| {
            let mut guard = cell.borrow_mut();
            let bufs = guard.get_or_insert_with(ThreadBuffers::new);
            let result = self.apply_with(&self.converter, bufs, bytes, name, ctx, slot);
            bufs.shrink_oversized();
            result
        })
    }

    /// The crop (in source pixels) and the flip of an image of `h` x `w` pixels, drawn from
    /// `rng`: the crop first, then the flip.
    fn geometry(&self, h: u32, w: u32, rng: &mut crate::transform::SampleRng) -> Placement {
        let (out_h, out_w) = self.cfg.size;
        match self.cfg.geometry {
            Geometry::Train {
                scale, ratio, flip, ..
            } => {
                let b = crop::random_resized_crop(h, w, scale, ratio, rng);
                let flipped = flip > 0.0 && rng.next_f64() < flip;
                Placement {
                    region: Region::from(b),
                    placed: whole_output(out_h, out_w),
                    flipped,
                }
            }
            Geometry::Eval { resize } => {
                let c = crop::resize_center_crop(h, w, resize, out_h, out_w);
                Placement {
                    region: c.region,
                    placed: c.placed,
                    flipped: false,
                }
            }
        }
    }

    /// Whether the eval geometry pads an `h` x `w` image (a centre crop larger than the resized
    /// image along a side): the GPU kernels resize into the whole output, so such an image is
    /// decoded by the workers.
    fn pads(&self, h: u32, w: u32) -> bool {
        let (out_h, out_w) = self.cfg.size;
        match self.cfg.geometry {
            Geometry::Eval { resize } => {
                crop::resize_center_crop(h, w, resize, out_h, out_w).placed
                    != whole_output(out_h, out_w)
            }
            Geometry::Train { .. } => false,
        }
    }

    fn apply_with(
        &self,
        writer: &PixelWriter,
        bufs: &mut ThreadBuffers,
        bytes: &[u8],
        name: &str,
        ctx: &SampleContext,
        slot: &mut [u8],
    ) -> Result<()> {
        let mut rng = ctx.rng();
        let (out_h, out_w) = self.cfg.size;
        let geometry =
            |h: u32, w: u32, rng: &mut crate::transform::SampleRng| self.geometry(h, w, rng);
        let (decoded, placement) = self.decode_for(bufs, bytes, name, &mut rng, geometry)?;
        let Placement {
            region,
            placed,
            flipped,
        } = placement;
        nonempty(name, region, decoded)?;
        let src = fir::images::ImageRef::new(
            decoded.width,
            decoded.height,
            &bufs.decoded,
            fir::PixelType::U8x3,
        )
        .map_err(|e| codec::image_error_from(name, "resize", e))?;
        let options = fir::ResizeOptions::new()
            .crop(region.left, region.top, region.width, region.height)
            .resize_alg(fir::ResizeAlg::Convolution(self.cfg.filter.filter_type()));
        let pixels = out_h as usize * out_w as usize;
        // Resizes into `out` (out_w x out_h RGB8): into all of it, or into the placed box with
        // zeros around (a padded centre crop).
        let resize_into = |resizer: &mut fir::Resizer, out: &mut [u8]| -> Result<()> {
            let whole = placed == whole_output(out_h, out_w);
            if !whole {
                out.fill(0);
            }
            let mut dst =
                fir::images::Image::from_slice_u8(out_w, out_h, out, fir::PixelType::U8x3)
                    .map_err(|e| codec::image_error_from(name, "resize", e))?;
            if whole {
                return resizer
                    .resize(&src, &mut dst, &options)
                    .map_err(|e| codec::image_error_from(name, "resize", e));
            }
            let mut inner = fir::images::CroppedImageMut::new(
                &mut dst,
                placed.left,
                placed.top,
                placed.width,
                placed.height,
            )
            .map_err(|e| codec::image_error_from(name, "resize", e))?;
            resizer
                .resize(&src, &mut inner, &options)
                .map_err(|e| codec::image_error_from(name, "resize", e))
        };
        if writer.is_identity() {
            resize_into(&mut bufs.resizer, slot)?;
            if flipped {
                crop::flip_horizontal(slot, out_w as usize, 3);
            }
        } else {
            bufs.resized.resize(pixels * 3, 0);
            resize_into(&mut bufs.resizer, &mut bufs.resized)?;
            let (w, h) = (out_w as usize, out_h as usize);
            writer.convert(&mut bufs.resized, w, h, flipped, slot);
        }
        self.stats.decoded.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Decodes into `bufs.decoded`; returns its size and where it goes.
    #[cfg(not(feature = "turbojpeg"))]
    fn decode_for(
        &self,
        bufs: &mut ThreadBuffers,
        bytes: &[u8],
        name: &str,
        rng: &mut crate::transform::SampleRng,
        geometry: impl Fn(u32, u32, &mut crate::transform::SampleRng) -> Placement,
    ) -> Result<(Decoded, Placement)> {
        let d = codec::decode_rgb8(
            bytes,
            name,
            &self.cfg.limits,
            &mut bufs.decoded,
            &mut bufs.scratch,
        )?;
        Ok((d, geometry(d.height, d.width, rng)))
    }

    /// Decodes into `bufs.decoded` only the part of the image the resize reads (JPEG, through
    /// libjpeg-turbo's partial decompression), at a reduced scale when the region allows;
    /// returns the decoded size and where it goes (its region in decoded pixels).
    #[cfg(feature = "turbojpeg")]
    fn decode_for(
        &self,
        bufs: &mut ThreadBuffers,
        bytes: &[u8],
        name: &str,
        rng: &mut crate::transform::SampleRng,
        geometry: impl Fn(u32, u32, &mut crate::transform::SampleRng) -> Placement,
    ) -> Result<(Decoded, Placement)> {
        let (w, h) = codec::probe(bytes, name)?;
        let placement = geometry(h, w, rng);
        let region = placement.region;
        nonempty(
            name,
            region,
            Decoded {
                width: w,
                height: h,
            },
        )?;
        let (out_h, out_w) = self.cfg.size;
        let denom = codec::scale_denominator(region.width, region.height, out_w, out_h);
        // The resize reads source pixels up to its filter's support beyond the region's edges
        // (as PIL's does): decode that margin too, so that the output is the one a full decode
        // gives. 3 is the widest support (Lanczos3), scaled by the downscale factor; the extra
        // pixel keeps libjpeg-turbo's edge upsampling of the block out of the support.
        let d = f64::from(denom);
        let margin =
            |len: f64, out: u32| ((3.0 * (len / d / f64::from(out)).max(1.0)).ceil() + 1.0) * d;
        let (mx, my) = (margin(region.width, out_w), margin(region.height, out_h));
        let left = (region.left - mx).max(0.0);
        let top = (region.top - my).max(0.0);
        let wide = Region {
            left,
            top,
            width: (region.left + region.width + mx).min(f64::from(w)) - left,
            height: (region.top + region.height + my).min(f64::from(h)) - top,
        };
        let got = codec::decode_rgb8_region(
            bytes,
            name,
            wide,
            denom,
            &self.cfg.limits,
            &mut bufs.decoded,
            &mut bufs.scratch,
        )?;
        // `got.region` is `wide` in the block; the region is `wide` less the margins, scaled.
        let (within, scale) = (got.region, f64::from(got.denom));
        let (bw, bh) = (f64::from(got.decoded.width), f64::from(got.decoded.height));
        let left = (within.left + (region.left - wide.left) / scale).min(bw);
        let top = (within.top + (region.top - wide.top) / scale).min(bh);
        let region = Region {
            left,
            top,
            width: (region.width / scale).min(bw - left),
            height: (region.height / scale).min(bh - top),
        };
        Ok((
            got.decoded,
            Placement {
                region,
                ..placement
            },
        ))
    }

    fn apply_sample(
        &self,
        sample: &Sample<'_>,
        ctx: &SampleContext,
        slots: &mut Slots<'_>,
    ) -> Result<()> {
        let schema = sample.schema();
        let k = schema.index_of(&self.cfg.image_field).ok_or_else(|| {
            Error::mismatch(format!("sample has no field `{}`", self.cfg.image_field))
        })?;
        let bytes = sample
            .field(k)
            .ok_or_else(|| Error::mismatch(format!("sample has no field {k}")))?;
        let named;
        let name = match sample
            .field_named("path")
            .and_then(|p| std::str::from_utf8(p).ok())
        {
            Some(p) => p,
            None => {
                named = format!("sample {}", ctx.index);
                &named
            }
        };
        let on_gpu = self.on_gpu.get() == Some(&true);
        // The image's field: the image on the CPU path; with the GPU decode the metadata
        // (field 0) and the record (the last field).
        let records = if self.cfg.label_field.is_some() { 2 } else { 1 };
        let result = if on_gpu {
            self.gather(bytes, name, ctx, slots, records)
                .and_then(|record| {
                    record.write(slots.field(0)?);
                    Ok(())
                })
        } else {
            self.apply_image(bytes, name, ctx, slots.field(0)?)
        };
        match (result, self.cfg.on_bad) {
            (Ok(()), _) => {}
            (Err(e @ Error::Image { .. }), OnBadImage::Skip) => {
                slots.field(0)?.fill(0);
                if on_gpu {
                    SampleRecord {
                        route: Route::Skipped,
                        len: 0,
                        width: 0,
                        height: 0,
                        flip: false,
                        region: Region {
                            left: 0.0,
                            top: 0.0,
                            width: 0.0,
                            height: 0.0,
                        },
                    }
                    .write(slots.field(0)?);
                    slots.field(records)?.fill(0);
                }
                slots.mark_skipped();
                self.stats.skipped.fetch_add(1, Ordering::Relaxed);
                if let Ok(mut last) = self.stats.last_skipped.lock() {
                    *last = Some(e);
                }
                if self.cfg.label_field.is_some() {
                    slots.field(1)?.copy_from_slice(&(-1i64).to_le_bytes());
                }
                return Ok(());
            }
            (Err(e), _) => return Err(e),
        }
        if let Some(label_name) = &self.cfg.label_field {
            let k = schema
                .index_of(label_name)
                .ok_or_else(|| Error::mismatch(format!("sample has no field `{label_name}`")))?;
            let dtype = label_dtype(schema, k)?;
            let raw = sample
                .field(k)
                .ok_or_else(|| Error::mismatch(format!("sample has no field {k}")))?;
            let label = read_int(raw, dtype).ok_or_else(|| {
                Error::mismatch(format!(
                    "label field `{label_name}` has {} bytes",
                    raw.len()
                ))
            })?;
            slots.field(1)?.copy_from_slice(&label.to_le_bytes());
        }
        Ok(())
    }

    /// The GPU decode's gather (see [`gpu`]): the JPEG's bytes into the record, with its crop
    /// and flip, for a JPEG the GPU takes; else the worker decodes it into the record as
    /// output-sized RGB8 pixels. Returns the sample's metadata.
    fn gather(
        &self,
        bytes: &[u8],
        name: &str,
        ctx: &SampleContext,
        slots: &mut Slots<'_>,
        records: usize,
    ) -> Result<SampleRecord> {
        let t0 = Instant::now();
        let header = match ImageKind::detect(bytes) {
            Some(ImageKind::Jpeg) => codec::inspect_jpeg(bytes, name, &self.cfg.limits)?,
            _ => None,
        };
        let route = header.as_ref().map_or(Route::Pixels, gpu::plan);
        let slot = gpu::RecordSlot::new(slots.field(records)?);
        let too_large = bytes.len() > slot.capacity();
        let counts = &self.gpu_stats;
        match header {
            Some(h)
                if route != Route::Pixels
                    && !too_large
                    && !self.pads(h.height, h.width)
                    && !self.split.to_workers(ctx.position) =>
            {
                let mut rng = ctx.rng();
                let Placement {
                    region,
                    flipped: flip,
                    ..
                } = self.geometry(h.height, h.width, &mut rng);
                let size = Decoded {
                    width: h.width,
                    height: h.height,
                };
                nonempty(name, region, size)?;
                slot.put(bytes.len(), |b| {
                    b.copy_from_slice(bytes);
                    Ok(())
                })?;
                self.split.measured_gather(t0.elapsed().as_nanos() as u64);
                Ok(SampleRecord {
                    route,
                    len: bytes.len() as u32,
                    width: h.width,
                    height: h.height,
                    flip,
                    region,
                })
            }
            _ => {
                let (out_h, out_w) = self.cfg.size;
                let pixels = 3 * out_h as usize * out_w as usize;
                slot.put(pixels, |b| {
                    BUFFERS.with(|cell| {
                        let mut guard = cell.borrow_mut();
                        let bufs = guard.get_or_insert_with(ThreadBuffers::new);
                        let done = self.apply_with(&self.pixels, bufs, bytes, name, ctx, b);
                        bufs.shrink_oversized();
                        done
                    })
                })?;
                let counter = if route == Route::Pixels {
                    &counts.cpu_unsupported
                } else if too_large {
                    &counts.cpu_too_large
                } else {
                    &counts.cpu_share
                };
                counter.fetch_add(1, Ordering::Relaxed);
                self.split.measured_cpu(t0.elapsed().as_nanos() as u64);
                Ok(SampleRecord {
                    route: Route::Pixels,
                    len: pixels as u32,
                    width: out_w,
                    height: out_h,
                    flip: false,
                    region: Region {
                        left: 0.0,
                        top: 0.0,
                        width: f64::from(out_w),
                        height: f64::from(out_h),
                    },
                })
            }
        }
    }

    /// Where this transform decodes JPEGs.
    pub fn decode_mode(&self) -> Decode {
        self.cfg.decode
    }

    /// Decides, once, whether the GPU decodes this transform's JPEGs: a loader that feeds a
    /// GPU (`cuda::DeviceLoader::from_builder`) calls it before it builds, with `nvjpeg`, the
    /// outcome of loading nvJPEG. [`Decode::Gpu`] takes the GPU (or fails with `nvjpeg`'s
    /// error), [`Decode::Auto`] takes it if nvJPEG loaded, [`Decode::Cpu`] never. A transform
    /// already built into a loader keeps its decision: deciding otherwise is an error (give
    /// each loader its own transform).
    ///
    /// Deciding for the GPU holds a measured split until the GPU stage has made nvJPEG's
    /// decoders: the workers decode the first batches' JPEGs meanwhile.
    pub fn decide_decode(&self, nvjpeg: Result<()>) -> Result<bool> {
        let want = match (self.cfg.decode, nvjpeg) {
            (Decode::Cpu, _) => false,
            (Decode::Gpu, Err(e)) => return Err(e),
            (Decode::Gpu, Ok(())) => true,
            (Decode::Auto, loaded) => loaded.is_ok(),
        };
        let got = *self.on_gpu.get_or_init(|| want);
        if got != want {
            return Err(Error::config(
                "decode",
                format!(
                    "this ImageTransform was built into a loader that decodes on the {}; give each loader its own",
                    if got { "GPU" } else { "CPU" }
                ),
            ));
        }
        if got {
            self.split.hold();
        }
        Ok(got)
    }

    /// What the GPU stage needs, when the GPU decodes this transform's JPEGs
    /// ([`decide_decode`](Self::decide_decode) said so).
    // Read by the GPU stage (`cuda::nvjpeg`), built with `cuda` only.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn gpu_decode_plan(&self) -> Option<GpuDecodePlan> {
        if self.on_gpu.get() != Some(&true) {
            return None;
        }
        let label = self.cfg.label_field.is_some();
        Some(GpuDecodePlan {
            size: self.cfg.size,
            dtype: self.cfg.dtype,
            layout: self.cfg.layout,
            normalize: self.cfg.normalize,
            on_bad: self.cfg.on_bad,
            limits: self.cfg.limits,
            meta_field: 0,
            label_field: label.then_some(1),
            records_field: if label { 2 } else { 1 },
            capacity: self.record_capacity(),
            split: Arc::clone(&self.split),
            stats: Arc::clone(&self.gpu_stats),
        })
    }

    fn record_capacity(&self) -> usize {
        let (h, w) = self.cfg.size;
        self.cfg.encoded_capacity.max(3 * h as usize * w as usize)
    }
}

/// What the geometry makes of one image: the source region, the box of the output it is
/// resized into, and whether it is mirrored.
#[derive(Clone, Copy, Debug)]
struct Placement {
    region: Region,
    /// All of the output, except for a centre crop padded where it is larger than the image.
    placed: CropBox,
    flipped: bool,
}

/// The box that is all of an `out_h` x `out_w` output.
fn whole_output(out_h: u32, out_w: u32) -> CropBox {
    CropBox {
        top: 0,
        left: 0,
        height: out_h,
        width: out_w,
    }
}

/// Refuses a region with no pixels: resizing it would write nothing, and the slot would keep
/// whatever an earlier sample left there.
fn nonempty(name: &str, region: Region, image: Decoded) -> Result<()> {
    if region.width > 0.0 && region.height > 0.0 {
        return Ok(());
    }
    Err(codec::image_error(
        name,
        format!(
            "empty crop: the region {}x{} at ({}, {}) of the {}x{} image has no pixels \
             (RandomResizedCrop's fallback box for an image this small and this ratio range)",
            region.width, region.height, region.left, region.top, image.width, image.height
        ),
    ))
}

/// The fields an image pipeline reads from a data set of `schema` unless told otherwise:
/// the encoded images, `image` (an ImageFolder's, a packed image folder's), else the one
/// field of JPEG bytes (a WebDataset's `jpg`, an MDS `jpeg` column), else the one of PNG
/// bytes; and the labels,
/// `label` or else `cls` (WebDataset's class member), where that field is one integer, else
/// none. The image field is `None` when the schema has no such field, or several of one
/// kind without an `image` among them (name it then).
pub fn default_image_fields(schema: &Schema) -> (Option<String>, Option<String>) {
    let fields = schema.fields();
    let only = |codec: crate::format::Codec| {
        let mut of = fields
            .iter()
            .filter(move |f| f.kind == FieldKind::Bytes { codec })
            .map(|f| f.name.clone());
        match (of.next(), of.next()) {
            (Some(one), None) => Some(one),
            _ => None,
        }
    };
    let image = if schema.index_of("image").is_some() {
        Some("image".to_owned())
    } else {
        only(crate::format::Codec::Jpeg).or_else(|| only(crate::format::Codec::Png))
    };
    let label = ["label", "cls"]
        .into_iter()
        .find(|name| {
            schema
                .index_of(name)
                .is_some_and(|k| label_dtype(schema, k).is_ok())
        })
        .map(str::to_owned);
    (image, label)
}

fn label_dtype(schema: &Schema, k: usize) -> Result<DType> {
    let f = &schema.fields()[k];
    match &f.kind {
        FieldKind::Tensor { dtype, shape }
            if shape.iter().product::<u64>() == 1
                && matches!(
                    dtype,
                    DType::U8
                        | DType::I8
                        | DType::U16
                        | DType::I16
                        | DType::U32
                        | DType::I32
                        | DType::U64
                        | DType::I64
                ) =>
        {
            Ok(*dtype)
        }
        _ => Err(Error::mismatch(format!(
            "label field `{}` must be one integer, not {}",
            f.name,
            match &f.kind {
                FieldKind::Tensor { dtype, shape } => format!("{dtype}{shape:?}"),
                FieldKind::Bytes { codec } => format!("bytes({})", codec.name()),
            }
        ))),
    }
}

fn read_int(b: &[u8], dtype: DType) -> Option<i64> {
    let mut a = [0u8; 8];
    let n = dtype.size();
    a[..n].copy_from_slice(b.get(..n)?);
    Some(match dtype {
        DType::U8 => i64::from(a[0]),
        DType::I8 => i64::from(a[0] as i8),
        DType::U16 => i64::from(u16::from_le_bytes([a[0], a[1]])),
        DType::I16 => i64::from(i16::from_le_bytes([a[0], a[1]])),
        DType::U32 => i64::from(u32::from_le_bytes([a[0], a[1], a[2], a[3]])),
        DType::I32 => i64::from(i32::from_le_bytes([a[0], a[1], a[2], a[3]])),
        DType::U64 => u64::from_le_bytes(a) as i64,
        _ => i64::from_le_bytes(a),
    })
}

impl SampleTransform for ImageTransform {
    fn output(&self, input: &Schema) -> Result<Vec<OutputField>> {
        let k = input.index_of(&self.cfg.image_field).ok_or_else(|| {
            Error::mismatch(format!(
                "no field `{}` in the dataset's schema [{input}]; name the encoded image field with image_field()",
                self.cfg.image_field
            ))
        })?;
        if !matches!(input.fields()[k].kind, FieldKind::Bytes { .. }) {
            return Err(Error::mismatch(format!(
                "field `{}` must hold encoded image bytes [{input}]",
                self.cfg.image_field
            )));
        }
        if self.cfg.decode == Decode::Gpu && self.on_gpu.get().is_none() {
            return Err(Error::config(
                "decode",
                "decode=gpu decodes on a GPU: build the loader with cuda::DeviceLoader::from_builder \
                 (Python: Loader(..., device=...)), or choose decode=cpu or auto",
            ));
        }
        let on_gpu = *self.on_gpu.get_or_init(|| false);
        let mut out = if on_gpu {
            vec![OutputField::new(
                "image.meta",
                DType::U8,
                &[gpu::META_BYTES],
            )]
        } else {
            vec![self.image_output()]
        };
        if let Some(label) = &self.cfg.label_field {
            let k = input.index_of(label).ok_or_else(|| {
                Error::mismatch(format!(
                    "no field `{label}` in the dataset's schema [{input}]; use label_field(None) for unlabelled data"
                ))
            })?;
            label_dtype(input, k)?;
            out.push(OutputField::new("label", DType::I64, &[]));
        }
        if on_gpu {
            out.push(OutputField::new(
                "image.records",
                DType::U8,
                &[self.record_capacity()],
            ));
        }
        Ok(out)
    }

    fn apply(&self, sample: Sample<'_>, ctx: &SampleContext, slots: &mut Slots<'_>) -> Result<()> {
        self.apply_sample(&sample, ctx, slots)
    }

    fn image_pipeline(&self) -> Option<&ImageTransform> {
        Some(self)
    }
}

#[cfg(test)]
mod gpu_gather_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use ::image::ImageEncoder;

    fn png_rgb(w: u32, h: u32) -> Vec<u8> {
        let px: Vec<u8> = (0..w * h * 3).map(|i| (i * 37) as u8).collect();
        let mut out = Vec::new();
        ::image::codecs::png::PngEncoder::new(&mut out)
            .write_image(&px, w, h, ::image::ExtendedColorType::Rgb8)
            .unwrap();
        out
    }

    fn capacities() -> (usize, usize) {
        BUFFERS.with(|c| {
            let g = c.borrow();
            let b = g.as_ref().unwrap();
            (b.decoded.capacity(), b.scratch.capacity())
        })
    }

    fn oversize_buffers() {
        BUFFERS.with(|c| {
            let mut b = ThreadBuffers::new();
            b.decoded.reserve_exact(KEEP_BUFFER_BYTES + 1);
            b.scratch.reserve_exact(KEEP_BUFFER_BYTES + 1);
            *c.borrow_mut() = Some(b);
        });
    }

    /// A worker's buffers must not keep the size of the largest image it ever decoded for the
    /// life of the loader.
    #[test]
    fn buffers_grown_past_the_keep_size_are_freed_after_the_image() {
        std::thread::spawn(|| {
            let t = ImageTransform::train(4).build().unwrap();
            let ctx = SampleContext {
                index: 1,
                position: 0,
                batch: 0,
                epoch: 0,
                seed: 3,
            };
            let mut slot = vec![0u8; 4 * 4 * 3];
            let image = png_rgb(8, 8);
            // As if the previous image had needed more than KEEP_BUFFER_BYTES.
            oversize_buffers();
            t.apply_image(&image, "a.png", &ctx, &mut slot).unwrap();
            assert_eq!(capacities(), (0, 0));
            // An ordinary image's buffers are kept, and reused.
            t.apply_image(&image, "a.png", &ctx, &mut slot).unwrap();
            let kept = capacities().0;
            assert!(kept >= 8 * 8 * 3);
            t.apply_image(&image, "a.png", &ctx, &mut slot).unwrap();
            assert_eq!(capacities().0, kept);
            // After a failure too.
            oversize_buffers();
            assert!(
                t.apply_image(b"\x89PNG\r\n\x1a\n", "bad.png", &ctx, &mut slot)
                    .is_err()
            );
            assert_eq!(capacities(), (0, 0));
        })
        .join()
        .unwrap();
    }
}
