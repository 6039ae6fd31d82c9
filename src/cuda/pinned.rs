//! Page-locked host memory for the batch-buffer pool.
//!
//! [`PinnedBacking`] is a [`Backing`]: `LoaderBuilder::backing(PinnedBacking::new(&device))`
//! makes every batch buffer pinned, so that the workers collate straight into the memory the
//! GPU copies from. The memory is ordinary (cached, not write-combined: the CPU writes these
//! buffers, and write-combined memory takes CPU writes several times slower).
//!
//! How a block is made decides how fast a first epoch can be, since each worker's first batch
//! waits for its buffer (`benches/RESULTS.md` has the figures). `cuMemHostAlloc` serialises in
//! the driver and pins 4 KiB pages one by one, as slowly however many threads ask. So where
//! the kernel gives transparent huge pages on request, a block is instead an anonymous mapping
//! advised `MADV_HUGEPAGE`, populated by the thread that asks for it (workers populate theirs in
//! parallel; the kernel hands out zeroed 2 MiB pages), then registered with
//! `cuMemHostRegister`, which is fast over present huge pages. Where it does not, blocks come
//! from `cuMemHostAlloc`. Either way the memory is portable (usable from every context).
//!
//! Blocks are made one at a time in the process. Populating huge pages does not get faster
//! with more threads (on the H200 machine, 6 blocks of 38.5 MB at once took 19 to 43 ms each,
//! one alone 8.4 ms: about as long in all), so in turn the first block, which the first batch
//! waits for, is ready in the time of one instead of the time of all.
//!
//! The copy thread releases each pinned buffer behind an [`EventFence`](super::EventFence)
//! recorded after the copy that reads it: the buffer is reused only once that copy has completed
//! (the rule of PyTorch's `CachingHostAllocator`).

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, result, sys};

use super::Device;
use super::cuda_err;
use crate::error::{Error, Result};
use crate::memory::Backing;

/// Registered blocks are multiples of this (a transparent huge page).
const HUGE_PAGE: usize = 2 << 20;

/// Held while a huge-page block is populated and registered: one at a time in the process.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Pinned (page-locked, portable, not write-combined) host memory. Blocks are populated huge
/// pages registered with `cuMemHostRegister` where the kernel gives transparent huge pages on
/// request (workers make their buffers in parallel), else `cuMemHostAlloc` blocks.
#[derive(Clone)]
pub struct PinnedBacking {
    ctx: Arc<CudaContext>,
    huge: bool,
}

impl std::fmt::Debug for PinnedBacking {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBacking")
            .field("huge_pages", &self.huge)
            .finish()
    }
}

impl PinnedBacking {
    /// Pinned memory registered with `device`'s context (and, being portable, with every
    /// context of the process).
    pub fn new(device: &Device) -> PinnedBacking {
        PinnedBacking {
            ctx: Arc::clone(device.context()),
            huge: huge_pages_on_request(),
        }
    }

    /// Pinned memory from `cuMemHostAlloc` only, never huge pages: for small buffers (a few
    /// KiB each) that a huge page would round up to 2 MiB.
    pub fn small(device: &Device) -> PinnedBacking {
        PinnedBacking {
            ctx: Arc::clone(device.context()),
            huge: false,
        }
    }

    /// The bytes a block of `bytes` takes from the system.
    fn block_bytes(&self, bytes: usize) -> usize {
        if self.huge {
            bytes.next_multiple_of(HUGE_PAGE)
        } else {
            bytes
        }
    }
}

/// True when this kernel gives transparent huge pages to mappings that ask for them
/// (`/sys/kernel/mm/transparent_hugepage/enabled` is `[always]` or `[madvise]`). Read once.
fn huge_pages_on_request() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .is_ok_and(|s| s.contains("[always]") || s.contains("[madvise]"))
    })
}

/// An anonymous mapping of `len` bytes (a multiple of [`HUGE_PAGE`]), advised to use huge
/// pages and populated (written) by this thread, so that registering it pins present pages.
fn map_populated(len: usize) -> std::io::Result<NonNull<u8>> {
    // SAFETY: a new private anonymous mapping; no existing memory is touched.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `ptr..ptr + len` is the mapping just made; advice changes no contents. Huge pages
    // are a request: without them the mapping still works, with 4 KiB pages.
    unsafe { libc::madvise(ptr, len, libc::MADV_HUGEPAGE) };
    // SAFETY: as above; MADV_POPULATE_WRITE faults every page in, writable, without changing
    // its (zero) contents. Kernels before 5.14 refuse it: then write one byte per page.
    if unsafe { libc::madvise(ptr, len, libc::MADV_POPULATE_WRITE) } != 0 {
        for offset in (0..len).step_by(4096) {
            // SAFETY: `offset < len`, inside the mapping, which only this thread uses yet;
            // writing the zero it holds keeps it zero.
            unsafe { ptr.cast::<u8>().add(offset).write_volatile(0) };
        }
    }
    NonNull::new(ptr.cast::<u8>()).ok_or_else(|| std::io::Error::other("mmap returned null"))
}

// SAFETY: both ways make page-aligned (>= 64) host memory of at least `bytes` bytes, readable
// and writable by this process, used by nobody else, zero-filled (fresh anonymous pages, or
// `cuMemHostAlloc`'s, zeroed in `allocate`), valid until `free` unregisters and unmaps it (or
// calls `cuMemFreeHost`) once. The context (and so the registration) outlives the backing
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
        if !self.huge {
            // SAFETY: a plain allocation call; flags PORTABLE only (not WRITECOMBINED).
            let ptr = unsafe { result::malloc_host(bytes, sys::CU_MEMHOSTALLOC_PORTABLE) }
                .map_err(cuda_err("allocate pinned host memory (cuMemHostAlloc)"))?;
            let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| Error::Cuda {
                op: "allocate pinned host memory (cuMemHostAlloc)",
                what: "the driver returned a null pointer".into(),
            })?;
            // SAFETY: `bytes` bytes of host memory just allocated, used by nobody else.
            unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, bytes) };
            return Ok(ptr);
        }
        let len = self.block_bytes(bytes);
        // One block at a time (see the module's docs); a panic cannot happen while holding it,
        // and the guard protects no data, so a poisoned lock is as good as a free one.
        let _turn = ONE_AT_A_TIME
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let ptr = map_populated(len).map_err(|e| Error::Cuda {
            op: "map host memory to pin (mmap)",
            what: e.to_string(),
        })?;
        // SAFETY: `ptr..ptr + len` is a live mapping owned by this block; it is unregistered
        // (in `free`) before it is unmapped.
        let registered = unsafe {
            sys::cuMemHostRegister_v2(
                ptr.as_ptr().cast::<c_void>(),
                len,
                sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        };
        if registered != sys::CUresult::CUDA_SUCCESS {
            // SAFETY: the mapping made above, not registered, unmapped once.
            unsafe { libc::munmap(ptr.as_ptr().cast(), len) };
            return Err(Error::Driver {
                op: "pin host memory (cuMemHostRegister)",
                source: cudarc::driver::DriverError(registered),
            });
        }
        Ok(ptr)
    }

    fn zeroed(&self) -> bool {
        true
    }

    fn feeds_device(&self) -> bool {
        true
    }

    unsafe fn free(&self, ptr: NonNull<u8>, bytes: usize) {
        let _ = self.ctx.bind_to_thread();
        if !self.huge {
            // SAFETY: `ptr` came from `allocate` (cuMemHostAlloc) and is freed once, with no
            // use afterwards (the caller's contract: the pool frees a block only once its
            // fences, the copies that read it, have completed).
            let _ = unsafe { result::free_host(ptr.as_ptr().cast()) };
            return;
        }
        // SAFETY: `ptr` and `bytes` come from one `allocate` (the caller's contract), which
        // registered and mapped `block_bytes(bytes)` bytes at `ptr`; no copy reads it any more
        // (the pool waited for its fences). Unregister, then unmap, once each.
        unsafe {
            let _ = sys::cuMemHostUnregister(ptr.as_ptr().cast::<c_void>());
            libc::munmap(ptr.as_ptr().cast(), self.block_bytes(bytes));
        }
    }
}
