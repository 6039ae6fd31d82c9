//! What a JPEG's markers say before its first scan: the frame (coding process, precision,
//! size, components and their sampling factors) and an Adobe colour transform, read by a walk
//! over the marker segments. The decoders here use it to check a declared size against the
//! bytes; a decoder elsewhere (the GPU's, `cuda::nvjpeg`) uses it to decide which engine takes
//! an image ([`inspect_jpeg`]).

use super::{DecodeLimits, check_jpeg_data, check_jpeg_end, check_size, image_error};
use crate::error::Result;

/// The frame of a JPEG and what its header says about colour, as the markers before the first
/// scan declare them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JpegHeader {
    /// The start-of-frame marker: 0xC0 baseline, 0xC1 extended sequential, 0xC2 progressive,
    /// 0xC3 lossless (Huffman); 0xC5 to 0xCF hierarchical or arithmetic-coded.
    pub sof: u8,
    /// Bits per sample (8 for almost every JPEG; 12 and 16 exist).
    pub precision: u8,
    /// Width in pixels, as declared.
    pub width: u32,
    /// Height in pixels, as declared (0 when a DNL marker gives it after the first scan).
    pub height: u32,
    /// Colour components (1 gray, 3 YCbCr or RGB, 4 CMYK or YCCK).
    pub components: u8,
    /// Horizontal and vertical sampling factors of the first four components.
    pub sampling: [(u8, u8); 4],
    /// The transform flag of an Adobe APP14 segment, if there is one (0: none, RGB or CMYK;
    /// 1: YCbCr; 2: YCCK).
    pub adobe_transform: Option<u8>,
}

/// The chroma subsampling of a JPEG, from its components' sampling factors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Subsampling {
    /// One component.
    Gray,
    /// Three components, chroma at full resolution.
    S444,
    /// Three components, chroma halved horizontally.
    S422,
    /// Three components, chroma halved both ways.
    S420,
    /// Three components, chroma halved vertically.
    S440,
    /// Three components, chroma a quarter horizontally.
    S411,
    /// Three components, chroma a quarter horizontally and half vertically.
    S410,
    /// Anything else: chroma sampled above luma, unusual ratios, two or four components.
    Other,
}

impl JpegHeader {
    /// Walks the marker segments of `bytes` up to the frame header; `None` when the walk finds
    /// no frame (bytes that are not a JPEG, a truncated or corrupt header, a tables-only
    /// datastream).
    pub fn read(bytes: &[u8]) -> Option<JpegHeader> {
        if !bytes.starts_with(&[0xFF, 0xD8]) {
            return None;
        }
        let mut at = 2;
        let mut adobe_transform = None;
        loop {
            if *bytes.get(at)? != 0xFF {
                return None;
            }
            while bytes.get(at) == Some(&0xFF) {
                at += 1;
            }
            let marker = *bytes.get(at)?;
            at += 1;
            match marker {
                0x01 | 0xD0..=0xD8 => continue,
                0xD9 | 0xDA => return None,
                _ => {}
            }
            let len = usize::from(u16::from_be_bytes([*bytes.get(at)?, *bytes.get(at + 1)?]));
            if len < 2 {
                return None;
            }
            let seg = bytes.get(at + 2..at + len)?;
            if marker == 0xEE && seg.len() >= 12 && seg.starts_with(b"Adobe") {
                // "Adobe", version (2), flags0 (2), flags1 (2), transform (1).
                adobe_transform = Some(seg[11]);
            }
            if (0xC0..=0xCF).contains(&marker) && !matches!(marker, 0xC4 | 0xC8 | 0xCC) {
                // Precision, height, width, component count, then (id, H << 4 | V, table) each.
                let precision = *seg.first()?;
                let height = u32::from(u16::from_be_bytes([*seg.get(1)?, *seg.get(2)?]));
                let width = u32::from(u16::from_be_bytes([*seg.get(3)?, *seg.get(4)?]));
                let n = *seg.get(5)?;
                let comps = seg.get(6..6 + 3 * usize::from(n))?;
                if n == 0 {
                    return None;
                }
                let mut sampling = [(0, 0); 4];
                for (slot, c) in sampling.iter_mut().zip(comps.chunks_exact(3)) {
                    *slot = (c[1] >> 4, c[1] & 15);
                }
                return Some(JpegHeader {
                    sof: marker,
                    precision,
                    width,
                    height,
                    components: n,
                    sampling,
                    adobe_transform,
                });
            }
            at += len;
        }
    }

    /// The largest horizontal and vertical sampling factors (at least 1 each): an MCU covers
    /// `8 * h` by `8 * v` pixels.
    pub fn max_sampling(&self) -> (u8, u8) {
        let used = &self.sampling[..usize::from(self.components.min(4))];
        let h = used.iter().map(|s| s.0).max().unwrap_or(1);
        let v = used.iter().map(|s| s.1).max().unwrap_or(1);
        (h.max(1), v.max(1))
    }

    /// The chroma subsampling its sampling factors make.
    pub fn subsampling(&self) -> Subsampling {
        match self.components {
            1 => Subsampling::Gray,
            3 => {
                let [y, cb, cr, _] = self.sampling;
                if cb != (1, 1) || cr != (1, 1) {
                    return Subsampling::Other;
                }
                match y {
                    (1, 1) => Subsampling::S444,
                    (2, 1) => Subsampling::S422,
                    (2, 2) => Subsampling::S420,
                    (1, 2) => Subsampling::S440,
                    (4, 1) => Subsampling::S411,
                    (4, 2) => Subsampling::S410,
                    _ => Subsampling::Other,
                }
            }
            _ => Subsampling::Other,
        }
    }

    /// Three components stored as RGB rather than YCbCr (an Adobe segment with transform 0):
    /// decoders that assume YCbCr get the colours wrong.
    pub fn is_adobe_rgb(&self) -> bool {
        self.components == 3 && self.adobe_transform == Some(0)
    }
}

/// Reads the header of a JPEG that another decoder (the GPU's) is to decode, after the checks
/// [`decode_rgb8`](super::decode_rgb8) makes before it allocates anything: the data ends with
/// an end-of-image marker (a truncated file is refused, as PIL refuses it), the declared size
/// is neither zero nor above `limits.max_pixels`, and the bytes hold at least one bit per
/// block. Each failure is an [`Error::Image`](crate::Error::Image) naming `name`.
///
/// `Ok(None)` when the markers cannot be walked to a frame header: the JPEG decoder of this
/// module then says what is wrong (or decodes what a lenient walk cannot read).
pub fn inspect_jpeg(bytes: &[u8], name: &str, limits: &DecodeLimits) -> Result<Option<JpegHeader>> {
    check_jpeg_end(bytes, name)?;
    let Some(header) = JpegHeader::read(bytes) else {
        return Ok(None);
    };
    if header.height == 0 {
        // The height comes in a DNL marker after the first scan: only a full decoder knows it.
        return Ok(None);
    }
    let (w, h) = check_size(
        name,
        u64::from(header.width),
        u64::from(header.height),
        Some(limits.max_pixels),
    )?;
    if matches!(header.sof, 0xC0..=0xC3) {
        // Huffman-coded frames: at least one bit per MCU at the frame's own sampling.
        let (hmax, vmax) = header.max_sampling();
        check_jpeg_data(name, bytes, w, h, &[(u64::from(hmax), u64::from(vmax))])?;
    }
    check_scan_headers(bytes, name)?;
    Ok(Some(header))
}

/// Walks every marker segment and scan of `bytes` (skipping each scan's entropy-coded data)
/// and checks each scan header against the frame, as the CPU decoders (zune-jpeg,
/// libjpeg-turbo) do before they read a scan: its length is `6 + 2n`, it names 1 to 4
/// components, each once, each one the frame declares. nvJPEG's hardware decoder does not
/// check this and decodes such a file into pixels; the CPU path refuses it, so the GPU path
/// must too. A walk that loses its way stops without an error: the checks before this one
/// (the end-of-image marker, the size) stand, and the rest is the decoder's.
fn check_scan_headers(bytes: &[u8], name: &str) -> Result<()> {
    let corrupt = |what: String| Err(image_error(name, format!("corrupt JPEG: {what}")));
    let mut frame: &[u8] = &[];
    let mut at = 2;
    loop {
        if bytes.get(at) != Some(&0xFF) {
            return Ok(());
        }
        while bytes.get(at) == Some(&0xFF) {
            at += 1;
        }
        let Some(&marker) = bytes.get(at) else {
            return Ok(());
        };
        at += 1;
        match marker {
            0xD9 => return Ok(()),
            0x01 | 0xD0..=0xD8 => continue,
            _ => {}
        }
        let (Some(&hi), Some(&lo)) = (bytes.get(at), bytes.get(at + 1)) else {
            return Ok(());
        };
        let len = usize::from(u16::from_be_bytes([hi, lo]));
        let Some(seg) = bytes.get(at + 2..at + len.max(2)) else {
            return Ok(());
        };
        if (0xC0..=0xCF).contains(&marker) && !matches!(marker, 0xC4 | 0xC8 | 0xCC) {
            // Precision, height, width, count, then (id, sampling, table) per component.
            let n = usize::from(seg.get(5).copied().unwrap_or(0));
            frame = seg.get(6..6 + 3 * n).unwrap_or(&[]);
        }
        at += len.max(2);
        if marker != 0xDA {
            continue;
        }
        let ns = usize::from(seg.first().copied().unwrap_or(0));
        if !(1..=4).contains(&ns) {
            return corrupt(format!("a scan of {ns} components (1 to 4 allowed)"));
        }
        if len != 6 + 2 * ns {
            return corrupt(format!(
                "scan header of {len} bytes for {ns} components ({} expected)",
                6 + 2 * ns
            ));
        }
        let ids: Vec<u8> = frame.chunks_exact(3).map(|c| c[0]).collect();
        let scan: Vec<u8> = seg[1..1 + 2 * ns].chunks_exact(2).map(|c| c[0]).collect();
        for (k, id) in scan.iter().enumerate() {
            if !ids.contains(id) {
                return corrupt(format!(
                    "a scan names component {id}, which the frame (components {ids:?}) does not have"
                ));
            }
            if scan[..k].contains(id) {
                return corrupt(format!("a scan names component {id} twice"));
            }
        }
        // The entropy-coded data runs to the next marker: 0xFF followed by neither a stuffed
        // zero, a restart marker nor a fill byte.
        loop {
            let Some(ff) = bytes.get(at..).and_then(|b| memchr::memchr(0xFF, b)) else {
                return Ok(());
            };
            at += ff;
            match bytes.get(at + 1) {
                Some(0x00 | 0xD0..=0xD7) => at += 2,
                Some(0xFF) => at += 1,
                _ => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal JPEG header: SOI, optional APP14, SOF with the given components, SOS, EOI.
    fn header(sof: u8, comps: &[(u8, u8)], adobe: Option<u8>) -> Vec<u8> {
        let mut b = vec![0xFF, 0xD8];
        if let Some(t) = adobe {
            b.extend([0xFF, 0xEE, 0x00, 0x0E]);
            b.extend(b"Adobe");
            b.extend([0x00, 0x64, 0x00, 0x00, 0x00, 0x00, t]);
        }
        let n = comps.len() as u8;
        let len = 8 + 3 * u16::from(n);
        b.extend([0xFF, sof]);
        b.extend(len.to_be_bytes());
        b.extend([8, 0x01, 0x77, 0x01, 0xF4, n]); // 375 high, 500 wide
        for (k, (h, v)) in comps.iter().enumerate() {
            b.extend([k as u8 + 1, (h << 4) | v, 0]);
        }
        b.extend(scan_header(
            &comps
                .iter()
                .enumerate()
                .map(|(k, _)| (k as u8 + 1, 0))
                .collect::<Vec<_>>(),
            0,
        ));
        b.extend([0xFF, 0xD9]);
        b
    }

    /// An SOS segment over `scan` (id, tables), its length off by `len_delta`.
    fn scan_header(scan: &[(u8, u8)], len_delta: i16) -> Vec<u8> {
        let len = (6 + 2 * scan.len() as i16 + len_delta) as u16;
        let mut b = vec![0xFF, 0xDA];
        b.extend(len.to_be_bytes());
        b.push(scan.len() as u8);
        for &(id, tables) in scan {
            b.extend([id, tables]);
        }
        b.extend([0, 63, 0]);
        b
    }

    #[test]
    fn subsampling_comes_from_the_sampling_factors() {
        let cases = [
            (vec![(1, 1)], Subsampling::Gray),
            (vec![(1, 1), (1, 1), (1, 1)], Subsampling::S444),
            (vec![(2, 1), (1, 1), (1, 1)], Subsampling::S422),
            (vec![(2, 2), (1, 1), (1, 1)], Subsampling::S420),
            (vec![(1, 2), (1, 1), (1, 1)], Subsampling::S440),
            (vec![(4, 1), (1, 1), (1, 1)], Subsampling::S411),
            (vec![(4, 2), (1, 1), (1, 1)], Subsampling::S410),
            (vec![(2, 2), (2, 1), (1, 1)], Subsampling::Other),
            (vec![(1, 1), (1, 1), (1, 1), (1, 1)], Subsampling::Other),
        ];
        for (comps, want) in cases {
            let h = JpegHeader::read(&header(0xC0, &comps, None)).unwrap();
            assert_eq!(h.subsampling(), want, "{comps:?}");
            assert_eq!((h.width, h.height, h.precision), (500, 375, 8));
        }
    }

    #[test]
    fn the_frame_marker_and_the_adobe_transform_are_read() {
        let h = JpegHeader::read(&header(0xC2, &[(2, 2), (1, 1), (1, 1)], Some(1))).unwrap();
        assert_eq!((h.sof, h.adobe_transform), (0xC2, Some(1)));
        assert!(!h.is_adobe_rgb());
        let h = JpegHeader::read(&header(0xC0, &[(1, 1), (1, 1), (1, 1)], Some(0))).unwrap();
        assert!(h.is_adobe_rgb());
        let h = JpegHeader::read(&header(0xC0, &[(1, 1); 4], Some(2))).unwrap();
        assert_eq!((h.components, h.adobe_transform), (4, Some(2)));
    }

    #[test]
    fn headers_that_cannot_be_walked_are_none() {
        let good = header(0xC0, &[(2, 2), (1, 1), (1, 1)], None);
        assert!(JpegHeader::read(&good[..good.len() / 2]).is_none());
        assert!(JpegHeader::read(b"\x89PNG\r\n\x1a\n").is_none());
        let mut bad = good.clone();
        bad[2] = 0x00; // not a marker
        assert!(JpegHeader::read(&bad).is_none());
        // Scan before any frame.
        assert!(JpegHeader::read(&[0xFF, 0xD8, 0xFF, 0xDA, 0x00, 0x02]).is_none());
    }

    #[test]
    fn inspect_refuses_truncated_and_oversized_jpegs_before_decoding() {
        let limits = DecodeLimits::default();
        let good = header(0xC0, &[(2, 2), (1, 1), (1, 1)], None);
        // 500x375 in 4:2:0 is 32 x 24 MCUs, 96 bytes at one bit each: the header alone is
        // shorter, and is refused as holding too few bytes.
        let e = inspect_jpeg(&good, "a.jpg", &limits).unwrap_err();
        assert!(e.to_string().contains("corrupt or truncated"), "{e}");
        let mut padded = good.clone();
        padded.splice(padded.len() - 2..padded.len() - 2, vec![0u8; 200]);
        let h = inspect_jpeg(&padded, "a.jpg", &limits).unwrap().unwrap();
        assert_eq!(h.subsampling(), Subsampling::S420);
        let e = inspect_jpeg(&padded[..padded.len() - 2], "a.jpg", &limits).unwrap_err();
        assert!(e.to_string().contains("truncated JPEG"), "{e}");
        let small = DecodeLimits { max_pixels: 1000 };
        let e = inspect_jpeg(&padded, "a.jpg", &small).unwrap_err();
        assert!(e.to_string().contains("max_pixels"), "{e}");
    }

    /// A frame of three components (ids 1, 2, 3), one scan over `scan` (id, tables) after a
    /// segment of entropy-coded bytes with stuffed and restart markers, then EOI.
    fn with_scan(scan: &[(u8, u8)], len_delta: i16) -> Vec<u8> {
        let mut b = header(0xC0, &[(2, 2), (1, 1), (1, 1)], None);
        b.truncate(b.len() - 2 - scan_header(&[(1, 0), (2, 0), (3, 0)], 0).len()); // its scan, EOI
        // A first, good scan, with entropy data holding a stuffed 0xFF and a restart marker.
        b.extend(scan_header(&[(1, 0x00)], 0));
        b.extend([0x12; 100]);
        b.extend([0xFF, 0x00, 0x34, 0xFF, 0xD0, 0x56]);
        b.extend([0x12; 100]);
        b.push(0xFF); // a fill byte before the next marker
        b.extend(scan_header(scan, len_delta));
        b.extend([0x12; 100]);
        b.extend([0xFF, 0xD9]);
        b
    }

    #[test]
    fn inspect_refuses_scans_that_do_not_match_the_frame() {
        let limits = DecodeLimits::default();
        let good = with_scan(&[(2, 0x11), (3, 0x11)], 0);
        assert!(inspect_jpeg(&good, "a.jpg", &limits).unwrap().is_some());
        for (scan, delta, want) in [
            (vec![(0x29, 0x00), (2, 0x11), (3, 0x11)], 0, "component 41"),
            (vec![(2, 0x11), (2, 0x11)], 0, "twice"),
            (vec![(2, 0x11), (3, 0x11)], 2, "scan header"),
            (vec![], 0, "0 components"),
            (
                vec![(1, 0), (2, 0x11), (3, 0x11), (4, 0), (5, 0)],
                0,
                "5 components",
            ),
        ] {
            let bad = with_scan(&scan, delta);
            let e = inspect_jpeg(&bad, "a.jpg", &limits)
                .err()
                .unwrap_or_else(|| panic!("{scan:?} {delta}: accepted"));
            assert!(e.to_string().contains(want), "{scan:?} {delta}: {e}");
            assert!(e.to_string().contains("a.jpg"), "{e}");
        }
    }
}
