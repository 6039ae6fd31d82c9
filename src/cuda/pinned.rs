//! Page-locked host memory for the batch-buffer pool, and the fence that keeps a buffer out of
//! the pool while a device copy still reads it.
//!
//! [`PinnedBacking`] is a [`Backing`]: `LoaderBuilder::backing(PinnedBacking::new(&device))`
//! makes every batch buffer pinned, so that the workers collate straight into the memory the
//! GPU copies from. It uses ordinary pinned memory (`cuMemHostAlloc` with
//! `CU_MEMHOSTALLOC_PORTABLE`), never write-combined: the CPU writes these buffers, and
//! write-combined memory took CPU writes at 3 to 4 GB/s on the H200 machine against 9 to 27 GB/s.
//!
//! [`EventFence`] is a [`Fence`] over a CUDA event: `HostBuffer::release_after(fence)` keeps
//! the buffer from reuse until the copy that reads it has completed (the rule of PyTorch's
//! `CachingHostAllocator`).

use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, result, sys};

use super::Device;
use super::cuda_err;
use crate::error::{Error, Result};
use crate::memory::{Backing, Fence};

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

// SAFETY: `cuMemHostAlloc` returns page-aligned memory (>= 64) of at least `bytes` bytes that
// nobody else uses, valid until `cuMemFreeHost`, which `free` calls once per block. The context
// (and so the allocation) outlives the backing because the backing holds an Arc of it.
unsafe impl Backing for PinnedBacking {
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
        // SAFETY: `ptr` came from `allocate` (cuMemHostAlloc) and is freed once (the caller's
        // contract); the pool frees a block only when no copy reads it any more.
        let _ = unsafe { result::free_host(ptr.as_ptr().cast()) };
    }
}

/// A [`Fence`] that completes when a CUDA event has completed.
///
/// Dropping a fence whose event has not completed waits for it (blocking the host): a pool that
/// drops its pending blocks frees their memory right after, and must not do so under a copy.
pub struct EventFence {
    event: Arc<CudaEvent>,
}

impl EventFence {
    /// A fence over `event`, which must already be recorded behind the work to wait for.
    pub fn new(event: Arc<CudaEvent>) -> EventFence {
        EventFence { event }
    }

    fn query(&self) -> bool {
        // A query that fails for another reason than "not ready" means the context is broken
        // (a sticky error): nothing will run on it any more, so nothing reads the block.
        let _ = self.event.context().bind_to_thread();
        self.event.try_is_complete().unwrap_or(true)
    }
}

impl Fence for EventFence {
    fn is_complete(&self) -> bool {
        self.query()
    }
}

impl Drop for EventFence {
    fn drop(&mut self) {
        if !self.query() {
            let _ = self.event.synchronize();
        }
    }
}
