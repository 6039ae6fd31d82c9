//! Page-locked host memory for the batch-buffer pool.
//!
//! [`PinnedBacking`] is a [`Backing`]: `LoaderBuilder::backing(PinnedBacking::new(&device))`
//! makes every batch buffer pinned, so that the workers collate straight into the memory the
//! GPU copies from. It uses ordinary pinned memory (`cuMemHostAlloc` with
//! `CU_MEMHOSTALLOC_PORTABLE`), never write-combined: the CPU writes these buffers, and
//! write-combined memory took CPU writes at 3 to 4 GB/s on the H200 machine against 9 to 27 GB/s.
//!
//! The copy thread releases each pinned buffer behind an [`EventFence`](super::EventFence)
//! recorded after the copy that reads it: the buffer is reused only once that copy has completed
//! (the rule of PyTorch's `CachingHostAllocator`).

use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::{CudaContext, result, sys};

use super::Device;
use super::cuda_err;
use crate::error::{Error, Result};
use crate::memory::Backing;

/// Pinned (page-locked, portable, not write-combined) host memory from `cuMemHostAlloc`.
#[derive(Clone)]
pub struct PinnedBacking {
    ctx: Arc<CudaContext>,
}

impl std::fmt::Debug for PinnedBacking {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PinnedBacking")
    }
}

impl PinnedBacking {
    /// Pinned memory registered with `device`'s context (and, being portable, with every
    /// context of the process).
    pub fn new(device: &Device) -> PinnedBacking {
        PinnedBacking {
            ctx: Arc::clone(device.context()),
        }
    }
}

// SAFETY: `cuMemHostAlloc` returns page-aligned (>= 64) host memory of at least `bytes` bytes,
// readable and writable by this process, that nobody else uses, valid until `cuMemFreeHost`,
// which `free` calls once per block. The context (and so the allocation) outlives the backing
// because the backing holds an Arc of it.
unsafe impl Backing for PinnedBacking {
    type Addr = NonNull<u8>;

    fn name(&self) -> &'static str {
        "pinned"
    }

    fn allocate(&self, bytes: usize) -> Result<NonNull<u8>> {
        self.ctx
            .bind_to_thread()
            .map_err(cuda_err("make the context current"))?;
        // SAFETY: a plain allocation call; flags PORTABLE only (not WRITECOMBINED).
        let ptr = unsafe { result::malloc_host(bytes, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(cuda_err("allocate pinned host memory (cuMemHostAlloc)"))?;
        NonNull::new(ptr.cast::<u8>()).ok_or_else(|| Error::Cuda {
            op: "allocate pinned host memory (cuMemHostAlloc)",
            what: "the driver returned a null pointer".into(),
        })
    }

    unsafe fn free(&self, ptr: NonNull<u8>, _bytes: usize) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `ptr` came from `allocate` (cuMemHostAlloc) and is freed once, with no use
        // afterwards (the caller's contract: the pool frees a block only once its fences, the
        // copies that read it, have completed).
        let _ = unsafe { result::free_host(ptr.as_ptr().cast()) };
    }
}
