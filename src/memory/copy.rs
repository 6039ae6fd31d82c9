//! Copies into batch buffers that bypass the CPU caches (non-temporal stores).
//!
//! A batch buffer is written once by a worker and then read by a device copy (DMA) or by the
//! consumer much later: keeping it in cache helps nobody. An ordinary copy of a large sample
//! also reads every destination line before writing it (read-for-ownership), so each payload
//! byte crosses the memory bus three times before the DMA reads it a fourth. Streaming stores
//! skip the read and the cache: on a machine where 16 workers and the copy engine share the
//! memory bus, that is bandwidth the copy engine gets back.
//!
//! Streaming stores are weakly ordered: a fence (`sfence`) must follow them before the buffer
//! is handed on. [`copy_to_batch`] fences each copy; a loader's worker defers the fences of
//! its copies to one per batch part ([`DeferredFence`]).

use std::cell::Cell;

/// Samples at least this large are copied with streaming stores; smaller ones with `memcpy`.
/// Streaming small rows too was measured slower on the host and the device paths
/// (`benches/RESULTS.md`): for small copies the destination lines are still in cache, and the
/// loads they save cost less than the stores' trip to memory.
pub(crate) const STREAM_THRESHOLD: usize = 32 * 1024;

thread_local! {
    /// Whether this thread defers the fences of its streaming copies (`DeferredFence`), and
    /// whether one is owed.
    static DEFERRAL: Cell<(bool, bool)> = const { Cell::new((false, false)) };
}

/// While one lives, the streaming copies of this thread skip their fence, and one fence is
/// issued when it drops (also on unwinding): a worker holds one while it writes a batch part,
/// and drops it before handing the batch on.
pub(crate) struct DeferredFence {
    /// The state to put back (deferrals nest).
    outer: (bool, bool),
}

impl DeferredFence {
    /// Starts deferring this thread's fences.
    pub(crate) fn start() -> DeferredFence {
        let outer = DEFERRAL.with(|d| d.replace((true, false)));
        DeferredFence { outer }
    }
}

impl Drop for DeferredFence {
    fn drop(&mut self) {
        let (_, owed) = DEFERRAL.with(|d| d.replace(self.outer));
        if owed {
            if self.outer.0 {
                // An outer deferral fences for us, later.
                DEFERRAL.with(|d| d.set((true, true)));
            } else {
                store_fence();
            }
        }
    }
}

/// Orders every streaming store this thread made before its later stores.
fn store_fence() {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    // SAFETY: SSE2 is part of the x86-64 baseline; a fence touches no memory.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// Copies `src` into `dst` (same length), with streaming stores for copies of at least
/// [`STREAM_THRESHOLD`] bytes on x86-64; the copy is complete (fenced) when this returns, except
/// inside a loader's worker, which fences once for each batch part it writes.
///
/// # Panics
///
/// If the lengths differ, as `copy_from_slice` does.
pub(crate) fn copy_to_batch(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_to_batch: lengths differ");
    // Under Miri, the plain copy: it checks the slices, not the CPU's streaming stores.
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    if src.len() >= STREAM_THRESHOLD {
        let deferred = DEFERRAL.with(|d| {
            let (active, _) = d.get();
            if active {
                d.set((true, true));
            }
            active
        });
        stream_copy_x86_64(dst, src);
        if !deferred {
            store_fence();
        }
        return;
    }
    dst.copy_from_slice(src);
}

#[cfg(all(target_arch = "x86_64", not(miri)))]
fn stream_copy_x86_64(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
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
    // The caller fences (`copy_to_batch`, or a worker's `DeferredFence`) before the batch is
    // handed to another thread or a DMA.
    let tail = head + body;
    dst[tail..].copy_from_slice(&src[tail..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deferred_fences_nest_and_copies_stay_exact() {
        // Both copies stream (>= STREAM_THRESHOLD): their fences are owed, then paid.
        let n = STREAM_THRESHOLD * 3;
        let src: Vec<u8> = (0..n).map(|i| (i * 13 + 1) as u8).collect();
        let mut dst = vec![0u8; n];
        {
            let _outer = DeferredFence::start();
            {
                let _inner = DeferredFence::start();
                copy_to_batch(&mut dst[..STREAM_THRESHOLD], &src[..STREAM_THRESHOLD]);
            }
            let (active, owed) = DEFERRAL.with(|d| d.get());
            assert!(active, "the outer deferral is still on");
            assert_eq!(
                owed,
                cfg!(all(target_arch = "x86_64", not(miri))),
                "the inner one's fence is owed by the outer"
            );
            copy_to_batch(&mut dst[STREAM_THRESHOLD..], &src[STREAM_THRESHOLD..]);
        }
        assert_eq!(DEFERRAL.with(|d| d.get()), (false, false));
        assert_eq!(dst, src);
    }

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
