//! The GPU decode's memory: one budgeted [`DevicePool`] and one budgeted pinned
//! [`HostPool`] per decode stage, from which both gpufeed's scratch (decoded images, the
//! resize's rows, descriptors) and nvJPEG's own buffers come (nvJPEG's extended allocators,
//! `nvjpegCreateExV2`, point at them). So the decode's memory is bounded by the budget, reused
//! from batch to batch, and does not grow over epochs; a request that cannot fit is an error
//! naming the setting, never a wait that does not end.
//!
//! A block nvJPEG frees goes back to its pool behind a fence recorded on the stage's stream
//! (every nvJPEG call of a stage runs on it) and, when nvJPEG names another, on that one too.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::CudaStream;
use cudarc::driver::sys::CUstream;

use crate::cuda::fence::EventFence;
use crate::cuda::{Device, DeviceBuffer, DevicePool, PinnedBacking};
use crate::error::{Error, Result};
use crate::memory::{HostBuffer, HostPool, human_bytes};

/// The smallest device block lent to nvJPEG: its small requests (per-image state, a few KiB
/// that vary with each batch's images) all take blocks of this one size, which the pool reuses
/// whatever the batch, instead of a new power of two each time a batch brings a larger one
/// (with it the decode's pool held the same 8 blocks from epoch 5 to 50 in eight H200 runs).
const MIN_NVJPEG_BLOCK: usize = 64 << 10;

/// How long an allocation waits for pending blocks (work still on the GPU) before it fails.
const ALLOC_WAIT: Duration = Duration::from_secs(5);

/// The memory of one decode stage.
pub(crate) struct DecodeMemory {
    pub(crate) device: DevicePool,
    pub(crate) pinned: HostPool,
    /// The stage's stream: blocks nvJPEG frees are fenced behind it.
    stream: Arc<CudaStream>,
    device_budget: u64,
    /// Blocks lent to nvJPEG, by address.
    lent_device: Mutex<HashMap<u64, DeviceBuffer>>,
    lent_pinned: Mutex<HashMap<usize, HostBuffer>>,
    /// The last allocation that failed, for the error nvJPEG's status cannot carry.
    failed: Mutex<Option<String>>,
}

impl DecodeMemory {
    pub(crate) fn new(
        device: &Device,
        stream: Arc<CudaStream>,
        device_budget: u64,
        pinned_budget: u64,
    ) -> DecodeMemory {
        DecodeMemory {
            device: DevicePool::with_budget(device, device_budget),
            pinned: HostPool::with_backing(PinnedBacking::small(device), pinned_budget),
            stream,
            device_budget,
            lent_device: Mutex::new(HashMap::new()),
            lent_pinned: Mutex::new(HashMap::new()),
            failed: Mutex::new(None),
        }
    }

    /// A device buffer of `bytes` for the stage's scratch, within the budget.
    pub(crate) fn scratch(&self, bytes: usize) -> Result<DeviceBuffer> {
        self.device
            .alloc_within(bytes, ALLOC_WAIT)?
            .ok_or_else(|| self.over_budget(bytes))
    }

    fn over_budget(&self, bytes: usize) -> Error {
        let s = self.device.stats();
        Error::config(
            "decode_memory",
            format!(
                "the GPU decode needs {} more device memory, and {} of its budget of {} are in use \
                 (raise DeviceLoaderOptions::decode_memory, or make batches smaller)",
                human_bytes(bytes as u64),
                human_bytes(s.allocated_bytes),
                human_bytes(self.device_budget)
            ),
        )
    }

    /// What the last failed allocation was, if any (taken).
    pub(crate) fn take_failure(&self) -> Option<String> {
        self.failed.lock().ok().and_then(|mut f| f.take())
    }

    fn note_failure(&self, what: String) {
        if let Ok(mut f) = self.failed.lock() {
            *f = Some(what);
        }
    }

    fn device_malloc(&self, bytes: usize) -> Option<u64> {
        // Rounded up to a power of two, as the stage's scratch, and to at least
        // `MIN_NVJPEG_BLOCK`: nvJPEG's requests, which follow the images of each batch (their
        // count on each engine, which the split changes from batch to batch, and their sizes),
        // then take a few block sizes that the pool reuses, and its many small ones one size.
        let size = bytes.max(MIN_NVJPEG_BLOCK).next_power_of_two();
        match self.scratch(size) {
            Ok(buf) => {
                let addr = buf.addr();
                self.lent_device.lock().ok()?.insert(addr, buf);
                Some(addr)
            }
            Err(e) => {
                self.note_failure(e.to_string());
                None
            }
        }
    }

    fn device_free(&self, addr: u64, stream: CUstream) -> bool {
        let Some(buf) = self
            .lent_device
            .lock()
            .ok()
            .and_then(|mut m| m.remove(&addr))
        else {
            return false;
        };
        let fenced = buf.record_use(&self.stream).is_ok()
            && (stream.is_null()
                || stream == self.stream.cu_stream()
                // SAFETY: nvJPEG passes the stream its work on the block ran on: a live
                // stream of this context (or null, excluded above); the context is current on
                // this thread (the stage's, inside an nvJPEG call).
                || unsafe { buf.try_record_raw(stream) }.is_ok());
        if fenced {
            drop(buf);
        } else {
            buf.leak();
        }
        true
    }

    fn pinned_malloc(&self, bytes: usize) -> Option<usize> {
        let tried = std::cell::Cell::new(false);
        let deadline = std::time::Instant::now() + ALLOC_WAIT;
        let got = self.pinned.acquire_unless(bytes.max(1), || {
            tried.replace(true) && std::time::Instant::now() > deadline
        });
        match got {
            Ok(Some(mut buf)) => {
                let addr = buf.as_mut_slice().as_mut_ptr() as usize;
                self.lent_pinned.lock().ok()?.insert(addr, buf);
                Some(addr)
            }
            Ok(None) | Err(_) => {
                let s = self.pinned.stats();
                self.note_failure(format!(
                    "nvJPEG asked for {} of pinned memory; {} of the decode's pinned budget of {} are in use",
                    human_bytes(bytes as u64),
                    human_bytes(s.allocated_bytes),
                    human_bytes(s.budget_bytes.unwrap_or(0))
                ));
                None
            }
        }
    }

    fn pinned_free(&self, addr: usize) -> bool {
        let Some(mut buf) = self
            .lent_pinned
            .lock()
            .ok()
            .and_then(|mut m| m.remove(&addr))
        else {
            return false;
        };
        match EventFence::record(&self.stream) {
            Ok(fence) => buf.release_after(Box::new(fence)),
            // The stream cannot be fenced: wait for it, so the block is not reused under it.
            Err(_) => {
                let _ = self.stream.synchronize();
            }
        }
        true
    }
}

/// The body of nvJPEG's allocation callbacks: `alloc` on the [`DecodeMemory`] at `ctx`, its
/// address written to `ptr`; 0 on success, 1 (nvJPEG's failure) when it gives none, `ptr` is
/// null, or it panics (a panic must not unwind into C).
///
/// # Safety
///
/// `ctx` must be the `DecodeMemory` the handle was made with (its owner keeps it alive until
/// after `nvjpegDestroy`), and `ptr` null or valid for one write, as nvJPEG passes them.
unsafe fn allocated(
    ctx: *mut c_void,
    ptr: *mut *mut c_void,
    alloc: impl FnOnce(&DecodeMemory) -> Option<usize>,
) -> i32 {
    let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: `ctx` is a live `DecodeMemory`, by the caller's contract.
        alloc(unsafe { &*ctx.cast::<DecodeMemory>() })
    }));
    match done {
        Ok(Some(addr)) if !ptr.is_null() => {
            // SAFETY: `ptr` is valid for one write, by the caller's contract.
            unsafe { *ptr = addr as *mut c_void };
            0
        }
        _ => 1,
    }
}

/// The body of nvJPEG's free callbacks: `free` on the [`DecodeMemory`] at `ctx`; 0 if it took
/// the block back, 1 if it did not know it or panicked.
///
/// # Safety
///
/// As for [`allocated`]'s `ctx`.
unsafe fn freed(ctx: *mut c_void, free: impl FnOnce(&DecodeMemory) -> bool) -> i32 {
    let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: `ctx` is a live `DecodeMemory`, by the caller's contract.
        free(unsafe { &*ctx.cast::<DecodeMemory>() })
    }));
    if done.unwrap_or(false) { 0 } else { 1 }
}

/// nvJPEG's `tDevMallocV2` over [`DecodeMemory`] (`ctx`).
pub(super) unsafe extern "C" fn dev_malloc(
    ctx: *mut c_void,
    ptr: *mut *mut c_void,
    size: usize,
    _stream: CUstream,
) -> i32 {
    // SAFETY: nvJPEG calls this with the handle's `ctx` and a pointer to receive the address.
    unsafe { allocated(ctx, ptr, |m| m.device_malloc(size).map(|a| a as usize)) }
}

/// nvJPEG's `tDevFreeV2` over [`DecodeMemory`].
pub(super) unsafe extern "C" fn dev_free(
    ctx: *mut c_void,
    ptr: *mut c_void,
    _size: usize,
    stream: CUstream,
) -> i32 {
    // SAFETY: nvJPEG calls this with the handle's `ctx`.
    unsafe { freed(ctx, |m| m.device_free(ptr as u64, stream)) }
}

/// nvJPEG's `tPinnedMallocV2` over [`DecodeMemory`].
pub(super) unsafe extern "C" fn pinned_malloc(
    ctx: *mut c_void,
    ptr: *mut *mut c_void,
    size: usize,
    _stream: CUstream,
) -> i32 {
    // SAFETY: as for `dev_malloc`.
    unsafe { allocated(ctx, ptr, |m| m.pinned_malloc(size)) }
}

/// nvJPEG's `tPinnedFreeV2` over [`DecodeMemory`].
pub(super) unsafe extern "C" fn pinned_free(
    ctx: *mut c_void,
    ptr: *mut c_void,
    _size: usize,
    _stream: CUstream,
) -> i32 {
    // SAFETY: as for `dev_free`.
    unsafe { freed(ctx, |m| m.pinned_free(ptr as usize)) }
}
