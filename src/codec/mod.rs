//! Encoded images: JPEG and PNG bytes probed for their size and decoded to packed RGB8 pixels
//! (HWC), in a buffer the caller reuses. Below [`source`](crate::source) (a packer probes the
//! images it packs) and [`transform`](crate::transform) (the image pipeline decodes each sample).
//!
//! The format comes from the bytes' magic numbers, never from a file name or a codec tag.
//! JPEG goes through zune-jpeg (the decoder the `image` crate uses), asked for RGB output
//! whatever the stored colour space (grayscale, YCbCr, CMYK, YCCK); PNG through the `image`
//! crate's decoder, then grayscale, grey+alpha, RGBA and 16-bit samples are converted to RGB8
//! (alpha is dropped, as PIL's `convert("RGB")` does). With the `turbojpeg` feature, JPEGs go
//! through libjpeg-turbo instead, which decodes only the part that covers a crop, at 1/2, 1/4
//! or 1/8 scale in the DCT domain when the crop allows (`decode_rgb8_region`).
//!
//! Every failure is an [`Error::Image`] naming the source (file or record) and what is wrong:
//! truncated or corrupt data, an unsupported format, a zero-sized or oversized image.
//!
//! Nothing is allocated for an image before its declared size has passed two checks: against
//! [`DecodeLimits::max_pixels`] (a setting, PIL's `MAX_IMAGE_PIXELS` by default), and against
//! the bytes there are: a PNG's pixels must fit in what deflate can expand its bytes to (at
//! most 1032 times), a Huffman-coded JPEG's in one bit per MCU at the least. So a small file
//! that declares a huge image (a decompression bomb, or a corrupt header) is refused at once
//! instead of costing gigabytes of zeroed buffers or seconds of decoding. Both checks use the
//! size (and, for a JPEG, the sampling factors) that the decoder itself read from the header,
//! before it decodes: bytes a decoder skips cannot hide the frame from them. The PNG decoder's own
//! allocations (rows, ancillary chunks) are capped too.

use std::io::Cursor;

use ::image::ImageDecoder;
use ::image::codecs::png::PngDecoder;
use zune_core::bytestream::ZCursor;
use zune_core::colorspace::ColorSpace;
use zune_core::options::DecoderOptions;

use crate::error::{Error, Result};

mod jpeg_header;

pub use jpeg_header::{JpegHeader, Subsampling, inspect_jpeg};

/// A source region in (fractional) source pixels, resized to the output.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Region {
    /// Left edge.
    pub left: f64,
    /// Top edge.
    pub top: f64,
    /// Width.
    pub width: f64,
    /// Height.
    pub height: f64,
}

impl Region {
    /// This region in an image decoded at `1/denom` of the source's size, clamped to that
    /// image's `width` x `height`.
    pub fn scaled(self, denom: u32, width: u32, height: u32) -> Region {
        let d = f64::from(denom);
        let left = (self.left / d).min(f64::from(width));
        let top = (self.top / d).min(f64::from(height));
        Region {
            left,
            top,
            width: (self.width / d).min(f64::from(width) - left),
            height: (self.height / d).min(f64::from(height) - top),
        }
    }
}

/// The default [`DecodeLimits::max_pixels`]: PIL's `Image.MAX_IMAGE_PIXELS` (a 1024 MiB image of
/// 4 bytes a pixel, divided by 3), above which PIL warns of a decompression bomb.
pub const DEFAULT_MAX_PIXELS: u64 = 89_478_485;

/// Bytes the PNG decoder may allocate for itself beyond one row of the image (ancillary chunks:
/// text, ICC profile, ...).
const PNG_DECODER_BYTES: u64 = 16 << 20;

/// Limits on what a declared image may cost before it is decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeLimits {
    /// The largest image decoded, in pixels (width x height); larger ones are an
    /// [`Error::Image`] that names this setting. Default [`DEFAULT_MAX_PIXELS`]; set it with
    /// [`ImageTransformBuilder::max_pixels`](crate::transform::image::ImageTransformBuilder::max_pixels).
    pub max_pixels: u64,
}

impl Default for DecodeLimits {
    fn default() -> DecodeLimits {
        DecodeLimits {
            max_pixels: DEFAULT_MAX_PIXELS,
        }
    }
}

/// An encoded image format this module decodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ImageKind {
    /// JPEG (JFIF, Exif, Adobe), baseline or progressive.
    Jpeg,
    /// PNG, any bit depth and colour type.
    Png,
}

impl ImageKind {
    /// The format of `bytes`, by their magic number.
    pub fn detect(bytes: &[u8]) -> Option<ImageKind> {
        if bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
            Some(ImageKind::Jpeg)
        } else if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
            Some(ImageKind::Png)
        } else {
            None
        }
    }
}

/// A decoded image's size and where its pixels are: `width * height * 3` bytes, RGB, row-major.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decoded {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
}

/// Builds an [`Error::Image`] that says what is wrong in its own words.
pub(crate) fn image_error(source_name: &str, what: impl Into<String>) -> Error {
    Error::Image {
        source_name: source_name.to_owned(),
        what: what.into(),
        setting: None,
        source: None,
    }
}

/// Builds an [`Error::Image`] whose cause is a decoder's (or resizer's) error, kept as its
/// [`source`](std::error::Error::source): the message is `what: <cause's message>`.
pub(crate) fn image_error_from(
    source_name: &str,
    what: impl Into<String>,
    cause: impl std::error::Error + Send + Sync + 'static,
) -> Error {
    Error::Image {
        source_name: source_name.to_owned(),
        what: what.into(),
        setting: None,
        source: Some(Box::new(cause)),
    }
}

fn detect_or_fail(bytes: &[u8], name: &str) -> Result<ImageKind> {
    ImageKind::detect(bytes).ok_or_else(|| {
        if bytes.is_empty() {
            image_error(name, "empty file: no image data")
        } else {
            let head: Vec<String> = bytes.iter().take(8).map(|b| format!("{b:02x}")).collect();
            image_error(
                name,
                format!(
                    "unsupported image format (starts with {}; JPEG and PNG are supported)",
                    head.join(" ")
                ),
            )
        }
    })
}

/// Checks a declared size: not zero, within `max_pixels` (`None`: no limit), within `u32`.
fn check_size(name: &str, width: u64, height: u64, max_pixels: Option<u64>) -> Result<(u32, u32)> {
    if width == 0 || height == 0 {
        return Err(image_error(
            name,
            format!("zero-sized image ({width}x{height})"),
        ));
    }
    if let Some(max) = max_pixels
        && width.saturating_mul(height) > max
    {
        return Err(Error::Image {
            source_name: name.to_owned(),
            what: format!(
                "{width}x{height} image ({} pixels) is larger than the max_pixels limit of {max} \
                 (a decompression bomb, or an image larger than the limit allows)",
                width.saturating_mul(height)
            ),
            setting: Some("max_pixels"),
            source: None,
        });
    }
    match (u32::try_from(width), u32::try_from(height)) {
        (Ok(w), Ok(h)) => Ok((w, h)),
        _ => Err(image_error(
            name,
            format!("{width}x{height} image is too large"),
        )),
    }
}

/// What a PNG's IHDR chunk says.
#[derive(Clone, Copy, Debug)]
struct PngHeader {
    width: u64,
    height: u64,
    depth: u8,
    color: u8,
}

impl PngHeader {
    /// The IHDR chunk, which must come first: signature (8), length (4), "IHDR" (4), width (4,
    /// BE), height (4, BE), bit depth, colour type.
    fn read(bytes: &[u8], name: &str) -> Result<PngHeader> {
        let ihdr = bytes
            .get(8..26)
            .filter(|h| &h[4..8] == b"IHDR")
            .ok_or_else(|| image_error(name, "truncated or corrupt PNG: no IHDR chunk"))?;
        let be = |b: &[u8]| u64::from(u32::from_be_bytes([b[0], b[1], b[2], b[3]]));
        Ok(PngHeader {
            width: be(&ihdr[8..12]),
            height: be(&ihdr[12..16]),
            depth: ihdr[16],
            color: ihdr[17],
        })
    }

    /// Bytes of one filtered row (filter byte included), for the colour types and depths PNG
    /// defines; `None` for others (the decoder refuses them).
    fn row_bytes(&self) -> Option<u64> {
        let channels = match self.color {
            0 | 3 => 1,
            2 => 3,
            4 => 2,
            6 => 4,
            _ => return None,
        };
        let bits = self.width.checked_mul(channels * u64::from(self.depth))?;
        Some(bits.div_ceil(8) + 1)
    }

    /// Refuses a PNG whose declared pixels (filtered, before deflate) exceed what its bytes
    /// can inflate to: deflate expands at most 1032 times (a 258-byte match in two bits).
    fn check_data(&self, name: &str, bytes: &[u8]) -> Result<()> {
        let Some(row) = self.row_bytes() else {
            return Ok(());
        };
        let raw = u128::from(row) * u128::from(self.height);
        let most = 1032 * bytes.len() as u128 + 1024;
        if raw > most {
            return Err(image_error(
                name,
                format!(
                    "PNG declares {}x{} ({}-bit, colour type {}), {raw} bytes once inflated, but holds \
                     {} bytes in all, which inflate to at most {most}: corrupt, or a decompression bomb",
                    self.width,
                    self.height,
                    self.depth,
                    self.color,
                    bytes.len()
                ),
            ));
        }
        Ok(())
    }
}

/// Whether the marker walk finds a frame header before the first scan: `false` for a
/// tables-only datastream, garbage, or markers that a decoder would skip to (past bytes that
/// are not a marker). Decides which decoder takes a JPEG (`decode_rgb8_region`), never whether
/// its size is checked: the checks use what the decoder itself read.
#[cfg(feature = "turbojpeg")]
fn jpeg_frame_found(bytes: &[u8]) -> bool {
    let mut at = 2;
    loop {
        if bytes.get(at) != Some(&0xFF) {
            return false;
        }
        while bytes.get(at) == Some(&0xFF) {
            at += 1;
        }
        let Some(&marker) = bytes.get(at) else {
            return false;
        };
        at += 1;
        match marker {
            0x01 | 0xD0..=0xD8 => continue,
            0xD9 | 0xDA => return false,
            0xC0..=0xCF if !matches!(marker, 0xC4 | 0xC8 | 0xCC) => return true,
            _ => {}
        }
        let len = match (bytes.get(at), bytes.get(at + 1)) {
            (Some(&a), Some(&b)) => usize::from(u16::from_be_bytes([a, b])),
            _ => return false,
        };
        if len < 2 {
            return false;
        }
        at += len;
    }
}

/// Refuses a Huffman-coded JPEG whose declared `width` x `height` needs more entropy-coded
/// bits than the file holds: every MCU codes at least one DC Huffman symbol of at least one
/// bit. `factors` are the largest sampling factors (horizontal, vertical) the decoder reads
/// the frame with, or the candidates when it does not say exactly which: the bound takes the
/// fewest MCUs among them. The size and factors must be the decoder's own (read by the
/// decoder that will decode the image), never a walk of the markers of ours: a decoder skips
/// bytes that end such a walk (`FF 00` after SOI, say) and decodes what follows.
fn check_jpeg_data(
    name: &str,
    bytes: &[u8],
    width: u32,
    height: u32,
    factors: &[(u64, u64)],
) -> Result<()> {
    let mcus = factors
        .iter()
        .map(|&(h, v)| {
            u64::from(width).div_ceil(8 * h.max(1)) * u64::from(height).div_ceil(8 * v.max(1))
        })
        .min()
        .unwrap_or(0);
    let least = mcus.div_ceil(8);
    if least > bytes.len() as u64 {
        return Err(image_error(
            name,
            format!(
                "JPEG declares {width}x{height}, {mcus} blocks of at least one bit each ({least} \
                 bytes), but holds {} bytes in all: corrupt or truncated",
                bytes.len()
            ),
        ));
    }
    Ok(())
}

/// Reads an image's (width, height) from its header only; the pixels are not decoded. A
/// zero-sized image, or one whose declared size its bytes cannot hold, is an error; the pixel
/// limit is not applied (nothing is allocated here): decoding applies it.
pub fn probe(bytes: &[u8], name: &str) -> Result<(u32, u32)> {
    match detect_or_fail(bytes, name)? {
        ImageKind::Jpeg => {
            let (_, w, h) = jpeg_header(bytes, name, None)?;
            Ok((w, h))
        }
        ImageKind::Png => {
            let header = PngHeader::read(bytes, name)?;
            let size = check_size(name, header.width, header.height, None)?;
            header.check_data(name, bytes)?;
            Ok(size)
        }
    }
}

/// A JPEG decoder over bytes in memory.
type JpegOver<'a> = zune_jpeg::JpegDecoder<ZCursor<&'a [u8]>>;

/// A JPEG decoder (RGB output) that has read and checked the headers, and the image's size,
/// checked against `max_pixels` and the bytes there are.
fn jpeg_header<'a>(
    bytes: &'a [u8],
    name: &str,
    max_pixels: Option<u64>,
) -> Result<(JpegOver<'a>, u32, u32)> {
    let mut d = zune_jpeg::JpegDecoder::new_with_options(
        ZCursor::new(bytes),
        jpeg_options(ColorSpace::RGB),
    );
    d.decode_headers()
        .map_err(|e| image_error_from(name, "corrupt JPEG header", e))?;
    let info = d
        .info()
        .ok_or_else(|| image_error(name, "corrupt JPEG header: no frame"))?;
    let (w, h) = check_size(
        name,
        u64::from(info.width),
        u64::from(info.height),
        max_pixels,
    )?;
    // zune-jpeg reads Huffman-coded frames only (SOF0 to SOF2; it refuses the others), and
    // says which sampling factors it reads them with.
    use zune_jpeg::SampleRatios;
    let factors = match info.sample_ratio {
        SampleRatios::None => (1, 1),
        SampleRatios::H => (2, 1),
        SampleRatios::V => (1, 2),
        SampleRatios::HV => (2, 2),
        SampleRatios::Generic(h, v) => (h as u64, v as u64),
    };
    check_jpeg_data(name, bytes, w, h, &[factors])?;
    Ok((d, w, h))
}

fn jpeg_options(out: ColorSpace) -> DecoderOptions {
    DecoderOptions::default()
        .jpeg_set_out_colorspace(out)
        .set_strict_mode(false)
        .set_max_width(1 << 16)
        .set_max_height(1 << 16)
}

/// Decodes `bytes` (JPEG or PNG, by magic) to RGB8 into `out` (resized; its capacity is reused).
///
/// `scratch` holds intermediate samples of PNGs that are not 8-bit RGB; keep both buffers
/// between calls (per thread) so that decoding allocates nothing in the steady state. The
/// declared size is checked against `limits` and against the bytes before either buffer grows.
pub fn decode_rgb8(
    bytes: &[u8],
    name: &str,
    limits: &DecodeLimits,
    out: &mut Vec<u8>,
    scratch: &mut Vec<u8>,
) -> Result<Decoded> {
    match detect_or_fail(bytes, name)? {
        ImageKind::Jpeg => decode_jpeg(bytes, name, limits, out),
        ImageKind::Png => decode_png(bytes, name, limits, out, scratch),
    }
}

/// A truncated JPEG is decoded by zune-jpeg's lenient mode with its missing part filled in;
/// PIL refuses it ("image file is truncated"), and so do we: the data must end with an
/// end-of-image marker, allowing some trailing padding after it.
fn check_jpeg_end(bytes: &[u8], name: &str) -> Result<()> {
    let tail = &bytes[bytes.len().saturating_sub(4096)..];
    if tail.windows(2).any(|w| w == [0xFF, 0xD9]) {
        Ok(())
    } else {
        Err(image_error(
            name,
            format!(
                "truncated JPEG: no end-of-image marker in its last {} bytes ({} bytes in all)",
                tail.len(),
                bytes.len()
            ),
        ))
    }
}

fn decode_jpeg(
    bytes: &[u8],
    name: &str,
    limits: &DecodeLimits,
    out: &mut Vec<u8>,
) -> Result<Decoded> {
    check_jpeg_end(bytes, name)?;
    let (mut d, w, h) = jpeg_header(bytes, name, Some(limits.max_pixels))?;
    let len = d
        .output_buffer_size()
        .ok_or_else(|| image_error(name, "corrupt JPEG header"))?;
    if len != w as usize * h as usize * 3 {
        return Err(image_error(
            name,
            format!("JPEG decoder wants {len} bytes for a {w}x{h} RGB image"),
        ));
    }
    out.resize(len, 0);
    d.decode_into(out)
        .map_err(|e| image_error_from(name, "corrupt JPEG data", e))?;
    Ok(Decoded {
        width: w,
        height: h,
    })
}

fn decode_png(
    bytes: &[u8],
    name: &str,
    limits: &DecodeLimits,
    out: &mut Vec<u8>,
    scratch: &mut Vec<u8>,
) -> Result<Decoded> {
    let bad = |e: ::image::ImageError| image_error_from(name, "corrupt PNG", e);
    // The declared size, checked before the decoder (or this function) allocates for it.
    let header = PngHeader::read(bytes, name)?;
    check_size(name, header.width, header.height, Some(limits.max_pixels))?;
    header.check_data(name, bytes)?;
    // The decoder's own allocations: one row of the image, and ancillary chunks up to a cap.
    let mut png_limits = ::image::Limits::default();
    png_limits.max_alloc = Some(
        header
            .row_bytes()
            .unwrap_or(0)
            .saturating_add(PNG_DECODER_BYTES),
    );
    let d = PngDecoder::with_limits(Cursor::new(bytes), png_limits).map_err(bad)?;
    let (w, h) = d.dimensions();
    let (w, h) = check_size(name, u64::from(w), u64::from(h), Some(limits.max_pixels))?;
    let color = d.color_type();
    let pixels = w as usize * h as usize;
    out.resize(pixels * 3, 0);
    use ::image::ColorType as C;
    if color == C::Rgb8 {
        d.read_image(out).map_err(bad)?;
        return Ok(Decoded {
            width: w,
            height: h,
        });
    }
    let total = usize::try_from(d.total_bytes())
        .map_err(|_| image_error(name, "PNG too large for this machine"))?;
    scratch.resize(total, 0);
    d.read_image(scratch).map_err(bad)?;
    let s = &scratch[..];
    // 16-bit samples are big-endian in PNG, but `image` returns them in native order.
    let s16 = |k: usize| -> u8 {
        let v = u16::from_ne_bytes([s[2 * k], s[2 * k + 1]]);
        ((u32::from(v) * 255 + 32_767) / 65_535) as u8
    };
    match color {
        C::L8 => expand(out, |p| [s[p]; 3]),
        C::La8 => expand(out, |p| [s[2 * p]; 3]),
        C::Rgba8 => expand(out, |p| [s[4 * p], s[4 * p + 1], s[4 * p + 2]]),
        C::L16 => expand(out, |p| [s16(p); 3]),
        C::La16 => expand(out, |p| [s16(2 * p); 3]),
        C::Rgb16 => expand(out, |p| [s16(3 * p), s16(3 * p + 1), s16(3 * p + 2)]),
        C::Rgba16 => expand(out, |p| [s16(4 * p), s16(4 * p + 1), s16(4 * p + 2)]),
        other => {
            return Err(image_error(
                name,
                format!("unsupported PNG colour type {other:?}"),
            ));
        }
    }
    Ok(Decoded {
        width: w,
        height: h,
    })
}

fn expand(out: &mut [u8], px: impl Fn(usize) -> [u8; 3]) {
    for (p, o) in out.chunks_exact_mut(3).enumerate() {
        o.copy_from_slice(&px(p));
    }
}

/// The denominator (1, 2, 4 or 8) of the smallest JPEG decode scale at which a `crop_w` x
/// `crop_h` region of the source still has at least `out_w` x `out_h` pixels.
pub fn scale_denominator(crop_w: f64, crop_h: f64, out_w: u32, out_h: u32) -> u32 {
    let mut denom = 1;
    for d in [2u32, 4, 8] {
        if crop_w / f64::from(d) >= f64::from(out_w) && crop_h / f64::from(d) >= f64::from(out_h) {
            denom = d;
        }
    }
    denom
}

/// What [`decode_rgb8_region`] decoded.
#[cfg(feature = "turbojpeg")]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodedRegion {
    /// The decoded block's size.
    pub decoded: Decoded,
    /// The requested region in the block's pixels.
    pub region: Region,
    /// The block's scale is `1/denom` of the source's.
    pub denom: u32,
}

/// libjpeg-turbo's `tjMCUWidth`, the iMCU width in pixels by `TJSAMP` (4:4:4, 4:2:2, 4:2:0,
/// gray, 4:4:0, 4:1:1, 4:4:1): a copy, so that reading it needs no `unsafe` extern static.
#[cfg(feature = "turbojpeg")]
const MCU_WIDTH: [std::ffi::c_int; 7] = [8, 16, 16, 8, 8, 32, 8];

/// The largest sampling factors (horizontal, vertical) a frame can have that libjpeg-turbo
/// reports as `subsamp` (`TJPARAM_SUBSAMP`): its `getSubsamp` also reports 4:4:4 for
/// components that all share factors of at most 3 blocks, and 4:2:2 and 4:4:0 for a 2x2
/// luminance with chroma at half of it in one direction. A grayscale frame is decoded one block
/// at a time whatever its factors; an unknown one may have any, up to 4 each.
#[cfg(feature = "turbojpeg")]
fn tj_sampling_factors(subsamp: std::ffi::c_int) -> &'static [(u64, u64)] {
    use turbojpeg::raw;
    match subsamp as raw::TJSAMP {
        raw::TJSAMP_TJSAMP_444 => &[(1, 1), (1, 2), (2, 1), (1, 3), (3, 1)],
        raw::TJSAMP_TJSAMP_422 => &[(2, 1), (2, 2)],
        raw::TJSAMP_TJSAMP_420 => &[(2, 2)],
        raw::TJSAMP_TJSAMP_GRAY => &[(1, 1)],
        raw::TJSAMP_TJSAMP_440 => &[(1, 2), (2, 2)],
        raw::TJSAMP_TJSAMP_411 => &[(4, 1)],
        raw::TJSAMP_TJSAMP_441 => &[(1, 4)],
        _ => &[(4, 4)],
    }
}

/// A libjpeg-turbo 3 decompressor handle (`tj3Init(TJINIT_DECOMPRESS)`), freed on drop.
#[cfg(feature = "turbojpeg")]
struct Tj3(turbojpeg::raw::tjhandle);

#[cfg(feature = "turbojpeg")]
impl Tj3 {
    fn new(name: &str) -> Result<Tj3> {
        // SAFETY: tj3Init takes no pointers; it returns a new handle or NULL on failure.
        let h = unsafe { turbojpeg::raw::tj3Init(turbojpeg::raw::TJINIT_TJINIT_DECOMPRESS as _) };
        if h.is_null() {
            return Err(image_error(name, "libjpeg-turbo: tj3Init failed"));
        }
        Ok(Tj3(h))
    }

    /// The handle's last error, with libjpeg-turbo's message.
    fn error(&self) -> turbojpeg::Error {
        // SAFETY: self.0 is a live handle (non-null, not yet destroyed). tj3GetErrorStr returns
        // a pointer to a NUL-terminated string owned by the handle (or a static buffer), valid
        // until the next call on this handle; we copy it out before making any other call.
        let message = unsafe {
            let s = turbojpeg::raw::tj3GetErrorStr(self.0);
            if s.is_null() {
                "unknown libjpeg-turbo error".to_owned()
            } else {
                std::ffi::CStr::from_ptr(s)
                    .to_string_lossy()
                    .trim()
                    .to_owned()
            }
        };
        turbojpeg::Error::TurboJpegError(message)
    }

    /// Whether the handle's last error was only a warning (the image was decoded).
    fn last_was_warning(&self) -> bool {
        // SAFETY: self.0 is a live handle; tj3GetErrorCode only reads its state.
        let code = unsafe { turbojpeg::raw::tj3GetErrorCode(self.0) };
        code == turbojpeg::raw::TJERR_TJERR_WARNING as std::ffi::c_int
    }

    fn get(&self, param: turbojpeg::raw::TJPARAM) -> std::ffi::c_int {
        // SAFETY: self.0 is a live handle; tj3Get only reads a parameter (-1 if it is unknown).
        unsafe { turbojpeg::raw::tj3Get(self.0, param as _) }
    }
}

#[cfg(feature = "turbojpeg")]
impl Drop for Tj3 {
    fn drop(&mut self) {
        // SAFETY: self.0 came from tj3Init, is non-null, and is destroyed only here, once; no
        // borrow of the handle outlives `self`.
        unsafe { turbojpeg::raw::tj3Destroy(self.0) }
    }
}

/// Decodes only the part of a JPEG that covers `region` (in source pixels), at `1/denom` of
/// its size (`denom` 1, 2, 4 or 8), through libjpeg-turbo's partial decompression: rows above
/// and below are skipped and columns are cut to whole iMCUs, so the work is about the crop's
/// share of the image. The decoded block starts at the iMCU boundary at or left of the region
/// (libjpeg-turbo requires it) and at the region's first row; it is clamped to the image.
///
/// The declared size is checked against `limits` and against the bytes (as [`decode_rgb8`]
/// does) before `out` grows.
///
/// Returns the decoded block's size (in `out`, RGB8, `width * 3` bytes a row), `region` in
/// that block's pixels (scaled by `1/denom` and shifted by the block's origin) and the scale.
///
/// Grayscale JPEGs become RGB. JPEGs libjpeg-turbo cannot crop or convert to RGB (CMYK, YCCK,
/// lossless, unusual subsampling, precision other than 8) go through [`decode_rgb8`] whole, at
/// full size, and `region` comes back unchanged, with `denom` 1. PNGs go through [`decode_rgb8`] too. A
/// libjpeg-turbo warning (e.g. extraneous bytes) is not an error, as with PIL; a truncated
/// file (no end-of-image marker) or a fatal decode error is an [`Error::Image`].
#[cfg(feature = "turbojpeg")]
pub fn decode_rgb8_region(
    bytes: &[u8],
    name: &str,
    region: Region,
    denom: u32,
    limits: &DecodeLimits,
    out: &mut Vec<u8>,
    scratch: &mut Vec<u8>,
) -> Result<DecodedRegion> {
    use turbojpeg::raw;

    let whole = |out: &mut Vec<u8>, scratch: &mut Vec<u8>| {
        Ok(DecodedRegion {
            decoded: decode_rgb8(bytes, name, limits, out, scratch)?,
            region,
            denom: 1,
        })
    };
    if ImageKind::detect(bytes) != Some(ImageKind::Jpeg) {
        return whole(out, scratch);
    }
    if !matches!(denom, 1 | 2 | 4 | 8) {
        return Err(image_error(
            name,
            format!("scale 1/{denom} is not one of 1, 1/2, 1/4, 1/8"),
        ));
    }
    check_jpeg_end(bytes, name)?;
    if !jpeg_frame_found(bytes) {
        // No frame header where the marker walk looks (a tables-only datastream, garbage, or
        // markers libjpeg-turbo would skip to with a warning): libjpeg-turbo reads no size
        // from such a header and would keep the previous image's, so the whole-image
        // decoder, which says what is wrong, takes it.
        return whole(out, scratch);
    }
    thread_local! {
        static TJ3: std::cell::RefCell<Option<Tj3>> = const { std::cell::RefCell::new(None) };
    }
    let done = TJ3.with(|cell| -> Result<Option<DecodedRegion>> {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = Some(Tj3::new(name)?);
        }
        let Some(tj) = slot.as_ref() else {
            return Err(image_error(name, "libjpeg-turbo: no decompressor"));
        };
        let decoded = (|| -> Result<Option<DecodedRegion>> {
            let fail = |what: &str| image_error_from(name, what, tj.error());
            // SAFETY: tj.0 is a live handle; the pointer and length describe `bytes`, which
            // outlives the call; libjpeg-turbo only reads them.
            if unsafe { raw::tj3DecompressHeader(tj.0, bytes.as_ptr(), bytes.len() as _) } != 0 {
                return Err(fail("corrupt JPEG header"));
            }
            let (jw, jh) = (
                tj.get(raw::TJPARAM_TJPARAM_JPEGWIDTH),
                tj.get(raw::TJPARAM_TJPARAM_JPEGHEIGHT),
            );
            if jw <= 0 || jh <= 0 {
                // A tables-only datastream, or garbage libjpeg-turbo read no frame from.
                return Err(image_error(name, "corrupt JPEG header: no frame"));
            }
            let (w32, h32) = check_size(name, jw as u64, jh as u64, Some(limits.max_pixels))?;
            let subsamp = tj.get(raw::TJPARAM_TJPARAM_SUBSAMP);
            // Arithmetic coding can spend less than a bit on an MCU: no bound from the bytes.
            if tj.get(raw::TJPARAM_TJPARAM_ARITHMETIC) != 1 {
                check_jpeg_data(name, bytes, w32, h32, tj_sampling_factors(subsamp))?;
            }
            let colorspace = tj.get(raw::TJPARAM_TJPARAM_COLORSPACE);
            let usable = (0..MCU_WIDTH.len() as std::ffi::c_int).contains(&subsamp)
                && matches!(
                    colorspace as raw::TJCS,
                    raw::TJCS_TJCS_RGB | raw::TJCS_TJCS_YCbCr | raw::TJCS_TJCS_GRAY
                )
                && tj.get(raw::TJPARAM_TJPARAM_LOSSLESS) == 0
                && tj.get(raw::TJPARAM_TJPARAM_PRECISION) == 8;
            if !usable {
                return Ok(None);
            }
            let d = denom as std::ffi::c_int;
            let scaled = |v: std::ffi::c_int| (v + d - 1) / d; // TJSCALED(v, 1/denom)
            let (sw, sh) = (scaled(jw), scaled(jh));
            // The requested region at this scale, clamped to the scaled image, then the pixels
            // that cover it; the left edge goes down to the scaled iMCU width.
            let r = region.scaled(denom, sw as u32, sh as u32);
            let mcu_w = scaled(MCU_WIDTH[subsamp as usize]).max(1);
            let x1 = ((r.left + r.width).ceil() as std::ffi::c_int).clamp(1, sw);
            let y1 = ((r.top + r.height).ceil() as std::ffi::c_int).clamp(1, sh);
            let x0 = (r.left.floor() as std::ffi::c_int).clamp(0, x1 - 1) / mcu_w * mcu_w;
            let y0 = (r.top.floor() as std::ffi::c_int).clamp(0, y1 - 1);
            let (w, h) = (x1 - x0, y1 - y0);
            let factor = raw::tjscalingfactor { num: 1, denom: d };
            // SAFETY: tj.0 is a live handle whose header has been read; the factor is passed by value.
            if unsafe { raw::tj3SetScalingFactor(tj.0, factor) } != 0 {
                return Err(fail("libjpeg-turbo scaling"));
            }
            let crop = raw::tjregion { x: x0, y: y0, w, h };
            // SAFETY: as above; the region is passed by value and checked by libjpeg-turbo (x is a
            // multiple of the scaled iMCU width, and the region lies within the scaled image).
            if unsafe { raw::tj3SetCroppingRegion(tj.0, crop) } != 0 {
                return Err(fail("libjpeg-turbo cropping"));
            }
            let pitch = w as usize * 3;
            out.resize(pitch * h as usize, 0);
            // SAFETY: tj.0 is a live handle; `bytes` is read-only input that outlives the call;
            // `out` holds exactly pitch * h bytes, and with the cropping region set libjpeg-turbo
            // writes h rows of w RGB pixels (3 bytes each) at `pitch` bytes apart, so every write
            // lies within `out`, which nothing else borrows during the call.
            let rc = unsafe {
                raw::tj3Decompress8(
                    tj.0,
                    bytes.as_ptr(),
                    bytes.len() as _,
                    out.as_mut_ptr(),
                    pitch as std::ffi::c_int,
                    raw::TJPF_TJPF_RGB as std::ffi::c_int,
                )
            };
            if rc != 0 && !tj.last_was_warning() {
                return Err(fail("corrupt JPEG data"));
            }
            let decoded = Decoded {
                width: w as u32,
                height: h as u32,
            };
            let (ox, oy) = (f64::from(x0), f64::from(y0));
            let within = Region {
                left: r.left - ox,
                top: r.top - oy,
                width: r.width.min(f64::from(w) - (r.left - ox)),
                height: r.height.min(f64::from(h) - (r.top - oy)),
            };
            Ok(Some(DecodedRegion {
                decoded,
                region: within,
                denom,
            }))
        })();
        if decoded.is_err() {
            // A failure can leave the handle in a state in which it misreads the next image's
            // header: the next image gets a new one.
            *slot = None;
        }
        decoded
    })?;
    match done {
        Some(done) => Ok(done),
        None => whole(out, scratch),
    }
}
