//! Batch buffers: one caching allocator over pluggable memory, and its host face [`HostPool`].
//!
//! Every byte the loader collates into, and every device batch buffer, comes from the same
//! algorithm (a private generic pool, instantiated for heap, pinned and device memory). It
//! behaves like PyTorch's caching allocators: a block freed by its user goes to a free list keyed
//! by size and is reused by the next request that fits (best fit, at most twice the size asked
//! for), never returned to the system on the hot path. A block can be released *behind
//! [`Fence`]s* (device work that still uses it): it is reused or freed only once every fence has
//! completed, the rule of PyTorch's `CachingHostAllocator` and of its CUDA caching allocator's
//! `record_stream`. The pool waits (blocking) on the fences of a pending block before it frees
//! it, so no block is ever freed under running work, whatever a fence's `Drop` does.
//!
//! A pool may have a byte budget: then a request that does not fit waits until a buffer comes
//! back (backpressure), after giving cached blocks of other sizes back (eviction). When the
//! [`Backing`] fails to allocate, the pool waits for its pending blocks, gives its cached blocks
//! back and tries once more.
//!
//! [`HostPool`] is the host face: [`HeapBacking`] (ordinary page-aligned memory) here,
//! page-locked memory with the `cuda` feature; each host block is zeroed once, when allocated, so
//! every byte a [`HostBuffer`] shows is initialised. The device face is `cuda::DevicePool`.

mod copy;
mod host;
mod pool;

pub(crate) use copy::DeferredFence;
pub(crate) use copy::copy_to_batch;
pub use host::{HostBuffer, HostPool};
#[cfg(feature = "cuda")]
pub(crate) use pool::{Buffer, Pool};

use std::fmt;
use std::ptr::NonNull;

use serde::Serialize;

use crate::error::{Error, Result};

/// Where a pool's blocks come from: heap, pinned or device memory.
///
/// `Addr` is how a block is named: `NonNull<u8>` for host memory (what [`HostPool`] and
/// `LoaderBuilder::backing` take), a device address for device memory.
///
/// # Safety
///
/// `Addr` must be a plain address (a pointer or an integer): the pool copies it and moves it
/// between threads. `allocate` must return the address of a block of at least `bytes` bytes,
/// aligned to at least 64, that stays valid, and that nobody else uses, until `free` is called
/// with the same address and size. When `Addr` is `NonNull<u8>`, the block must be host memory that this process may
/// read and write through that pointer (it may be uninitialised: [`HostPool`] zeroes it). The
/// pool calls `free` once per block, never on a block in use or one whose fences have not
/// completed.
pub unsafe trait Backing: Send + Sync + 'static {
    /// How a block is addressed.
    type Addr: Copy + 'static;

    /// A short name for reports (`heap`, `pinned`, `device`).
    fn name(&self) -> &'static str;

    /// Allocates a block of `bytes` bytes (`bytes > 0`).
    fn allocate(&self, bytes: usize) -> Result<Self::Addr>;

    /// True when every block `allocate` returns reads as zeros (fresh anonymous pages, or
    /// `alloc_zeroed`), so that the host pool need not zero it again. Default false.
    fn zeroed(&self) -> bool {
        false
    }

    /// True when batches in these blocks are copied to a device by a copy thread (pinned
    /// memory): a loader's default worker count then leaves CPUs to that thread and the
    /// consumer ([`default_workers`](crate::loader::default_workers)). Default false.
    fn feeds_device(&self) -> bool {
        false
    }

    /// Returns a block to the system.
    ///
    /// # Safety
    ///
    /// `addr` and `bytes` must come from one earlier `allocate` of this backing, and the block
    /// must not be used afterwards (by the host or by any device work).
    unsafe fn free(&self, addr: Self::Addr, bytes: usize);
}

/// Ordinary heap memory, aligned to 4096 bytes (a page).
#[derive(Clone, Copy, Debug, Default)]
pub struct HeapBacking;

const HEAP_ALIGN: usize = 4096;

// SAFETY: blocks come from the global allocator with a 4096-byte alignment and are freed with
// the same layout; heap memory is host memory this process reads and writes; the pool hands
// each block to one user at a time.
unsafe impl Backing for HeapBacking {
    type Addr = NonNull<u8>;

    fn name(&self) -> &'static str {
        "heap"
    }

    fn zeroed(&self) -> bool {
        true
    }

    fn allocate(&self, bytes: usize) -> Result<NonNull<u8>> {
        let layout = std::alloc::Layout::from_size_align(bytes, HEAP_ALIGN).map_err(|e| {
            Error::config("pool_budget", format!("cannot allocate {bytes} bytes: {e}"))
        })?;
        if layout.size() == 0 {
            return Err(Error::config("pool_budget", "cannot allocate 0 bytes"));
        }
        // SAFETY: the layout has a non-zero size (checked above). Zeroed memory: large blocks
        // come as fresh zero pages from the system, faulted in by their first writer instead of
        // being written twice.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        NonNull::new(ptr).ok_or_else(|| {
            Error::config(
                "pool_budget",
                format!("out of memory allocating {bytes} bytes"),
            )
        })
    }

    unsafe fn free(&self, ptr: NonNull<u8>, bytes: usize) {
        // SAFETY: `allocate` made this block with exactly this layout (the caller's contract:
        // same pointer, same size), and it is freed once.
        unsafe {
            std::alloc::dealloc(
                ptr.as_ptr(),
                std::alloc::Layout::from_size_align_unchecked(bytes, HEAP_ALIGN),
            )
        }
    }
}

/// Work a released block must wait for before it is reused or freed (a device copy that reads
/// it, a kernel that writes it).
///
/// A pool asks `is_complete` to decide whether a released block may be reused, and calls `wait`
/// on every fence of a block before it frees the block; it never relies on a fence's `Drop`.
///
/// # Safety
///
/// `is_complete` must never return `true` while the work the fence stands for may still access
/// the block, and `wait` must return only once that work can no longer access it. (Work that can
/// never run, such as work of a CUDA context broken by a sticky error, counts as complete.)
pub unsafe trait Fence: Send + 'static {
    /// True once the fenced work has finished; must not block.
    fn is_complete(&self) -> bool;

    /// Blocks the calling thread until the fenced work has finished.
    fn wait(&self);
}

// SAFETY: delegates both methods to the boxed fence, which upholds the contract.
unsafe impl<F: Fence + ?Sized> Fence for Box<F> {
    fn is_complete(&self) -> bool {
        (**self).is_complete()
    }

    fn wait(&self) {
        (**self).wait()
    }
}

/// What a pool holds and has done, in the terms of `torch.cuda.memory_allocated`,
/// `memory_reserved` and `max_memory_allocated`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PoolStats {
    /// Bytes in blocks handed out now (block sizes, rounded).
    pub allocated_bytes: u64,
    /// Bytes held from the backing: handed out, cached free, or waiting on a fence.
    pub reserved_bytes: u64,
    /// The most `allocated_bytes` has been.
    pub peak_allocated_bytes: u64,
    /// The most `reserved_bytes` has been.
    pub peak_reserved_bytes: u64,
    /// The byte budget `reserved_bytes` never exceeds (`None`: no budget, as for device pools).
    pub budget_bytes: Option<u64>,
    /// Blocks obtained from the backing.
    pub allocations: u64,
    /// Time spent obtaining them (in the backing's allocate, zeroing included; summed over
    /// the threads that allocated).
    pub allocation_time: std::time::Duration,
    /// Requests served from the free list.
    pub reuses: u64,
    /// Cached blocks given back to the backing to make room (for another size, or after the
    /// backing ran out of memory).
    pub evictions: u64,
    /// Requests that had to wait for a block to be released (backpressure).
    pub waits: u64,
    /// Blocks released behind fences that had not all completed when last looked at.
    pub pending_blocks: u64,
}

impl fmt::Display for PoolStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "allocated {} (peak {}), reserved {} (peak {})",
            human_bytes(self.allocated_bytes),
            human_bytes(self.peak_allocated_bytes),
            human_bytes(self.reserved_bytes),
            human_bytes(self.peak_reserved_bytes),
        )?;
        if let Some(budget) = self.budget_bytes {
            write!(f, " of budget {}", human_bytes(budget))?;
        }
        write!(
            f,
            "; {} allocations, {} reuses, {} evictions, {} waits, {} pending",
            self.allocations, self.reuses, self.evictions, self.waits, self.pending_blocks
        )
    }
}

// How gpufeed writes figures, sizes and rates in its messages and reports: public for the
// `gpufeed` command, whose reports must read as the library's messages do, and hidden from
// the docs, so not promised to users (see the crate's docs, "What is stable").

/// `v` with three significant digits (`41.2`, `3.07`, `0.0123`; from 100 on, whole: `512`,
/// `1500`), as gpufeed's reports print figures whose size varies by orders of magnitude.
#[doc(hidden)]
pub fn significant(v: f64) -> String {
    let a = v.abs();
    if !v.is_finite() || a >= 100.0 {
        return format!("{v:.0}");
    }
    if a == 0.0 {
        return "0".to_owned();
    }
    let decimals = (2 - a.log10().floor() as i64).clamp(0, 17) as usize;
    format!("{v:.decimals$}")
}

/// Formats a rate in bytes per second with a decimal unit and three significant digits
/// (`41.2 GB/s`, `512 MB/s`, `3.07 kB/s`): how every report of gpufeed's gives rates (sizes
/// are binary: `1.5 MiB`).
#[doc(hidden)]
pub fn human_rate(bytes_per_sec: f64) -> String {
    const UNITS: [&str; 5] = ["B/s", "kB/s", "MB/s", "GB/s", "TB/s"];
    let mut v = bytes_per_sec;
    let mut u = 0;
    while v.abs() >= 1000.0 && u + 1 < UNITS.len() {
        v /= 1000.0;
        u += 1;
    }
    format!("{} {}", significant(v), UNITS[u])
}

/// Formats a byte count with a binary unit (`1.5 MiB`).
#[doc(hidden)]
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::{human_rate, significant};

    #[test]
    fn rates_have_three_significant_digits_in_decimal_units() {
        assert_eq!(human_rate(41.23e9), "41.2 GB/s");
        assert_eq!(human_rate(5.12e8), "512 MB/s");
        assert_eq!(human_rate(9.99e6), "9.99 MB/s");
        assert_eq!(human_rate(3070.0), "3.07 kB/s");
        assert_eq!(human_rate(12.0), "12.0 B/s");
        assert_eq!(human_rate(0.0), "0 B/s");
        assert_eq!(human_rate(2.5e15), "2500 TB/s");
        assert_eq!(significant(0.01234), "0.0123");
        assert_eq!(significant(-1.5), "-1.50");
    }
}
