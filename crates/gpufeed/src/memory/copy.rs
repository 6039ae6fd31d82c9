//! Copies into batch buffers that bypass the CPU caches (non-temporal stores).
//!
//! A batch buffer is written once by a worker and then read by a device copy (DMA) or by the
//! consumer much later: keeping it in cache helps nobody. An ordinary copy of a large sample
//! also reads every destination line before writing it (read-for-ownership), so each payload
//! byte crosses the memory bus three times before the DMA reads it a fourth. Streaming stores
//! skip the read and the cache: on a machine where 16 workers and the copy engine share the
//! memory bus, that is bandwidth the copy engine gets back.

/// Samples at least this large are copied with streaming stores; smaller ones with `memcpy`
/// (for them the destination line is likely in cache already, and the fence costs more).
pub const STREAM_THRESHOLD: usize = 32 * 1024;

/// Copies `src` into `dst` (same length), with streaming stores for large copies on x86-64.
///
/// # Panics
///
/// If the lengths differ, as `copy_from_slice` does.
pub fn copy_to_batch(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_to_batch: lengths differ");
    // Under Miri, the plain copy: it checks the slices, not the CPU's streaming stores.
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    if src.len() >= STREAM_THRESHOLD {
        stream_copy_x86_64(dst, src);
        return;
    }
    dst.copy_from_slice(src);
}

#[cfg(all(target_arch = "x86_64", not(miri)))]
fn stream_copy_x86_64(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    // Head: plain copy up to the first 16-byte aligned destination address.
    let head = dst.as_ptr().align_offset(16).min(dst.len());
    dst[..head].copy_from_slice(&src[..head]);
    let body = (dst.len() - head) / 64 * 64;
    let (d, s) = (&mut dst[head..head + body], &src[head..head + body]);
    let mut i = 0;
    while i < body {
        // SAFETY: SSE2 is part of the x86-64 baseline. `i + 64 <= body`, so the four 16-byte
        // loads read inside `s` and the four stores write inside `d`; `d` starts 16-byte
        // aligned (the head above) and `i` is a multiple of 64, so every store is aligned as
        // `_mm_stream_si128` requires. Loads are unaligned-safe (`loadu`).
        unsafe {
            let sp = s.as_ptr().add(i).cast::<__m128i>();
            let dp = d.as_mut_ptr().add(i).cast::<__m128i>();
            let a = _mm_loadu_si128(sp);
            let b = _mm_loadu_si128(sp.add(1));
            let c = _mm_loadu_si128(sp.add(2));
            let e = _mm_loadu_si128(sp.add(3));
            _mm_stream_si128(dp, a);
            _mm_stream_si128(dp.add(1), b);
            _mm_stream_si128(dp.add(2), c);
            _mm_stream_si128(dp.add(3), e);
        }
        i += 64;
    }
    // SAFETY: SSE2 is baseline on x86-64. The fence orders the streaming stores before every
    // later store, so the batch is complete before it is handed to another thread or a DMA.
    unsafe { _mm_sfence() };
    let tail = head + body;
    dst[tail..].copy_from_slice(&src[tail..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(
        miri,
        ignore = "Miri runs the plain copy, and byte loops over 100 KiB take minutes there"
    )]
    fn copies_every_byte_at_every_alignment_and_length() {
        let src: Vec<u8> = (0..STREAM_THRESHOLD * 3)
            .map(|i| (i * 7 + 3) as u8)
            .collect();
        let mut buf = vec![0xEEu8; STREAM_THRESHOLD * 3 + 64];
        for offset in [0usize, 1, 5, 15, 16, 33] {
            for len in [
                0usize,
                1,
                100,
                STREAM_THRESHOLD - 1,
                STREAM_THRESHOLD,
                STREAM_THRESHOLD * 2 + 37,
            ] {
                buf.fill(0xEE);
                copy_to_batch(&mut buf[offset..offset + len], &src[3..3 + len]);
                assert_eq!(
                    &buf[offset..offset + len],
                    &src[3..3 + len],
                    "offset {offset} len {len}"
                );
                assert!(buf[..offset].iter().all(|&b| b == 0xEE));
                assert!(buf[offset + len..].iter().all(|&b| b == 0xEE));
            }
        }
    }
}
