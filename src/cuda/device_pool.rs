//! [`DevicePool`]: a caching allocator of device memory, like PyTorch's CUDA caching allocator.
//!
//! A block freed by its user goes to a free list keyed by size and is reused by the next request
//! that fits (a block of at least the size asked for and at most twice it); blocks are never
//! returned to the driver on the hot path. A buffer can be released behind events (the streams
//! that still use it): it is reused only once all have completed. When `cuMemAlloc` runs out of
//! memory, the pool waits for its pending blocks, gives its cached blocks back and tries once
//! more. Stats follow `torch.cuda.memory_allocated / memory_reserved / max_memory_allocated`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, result, sys};
use serde::Serialize;

use super::Device;
use super::cuda_err;
use crate::error::{Error, Result};
use crate::memory::human_bytes;

/// What a device pool holds and has done.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DevicePoolStats {
    /// Bytes in blocks handed out now (`torch.cuda.memory_allocated`).
    pub allocated_bytes: u64,
    /// Bytes held from the driver: handed out, cached or pending (`memory_reserved`).
    pub reserved_bytes: u64,
    /// The most `allocated_bytes` has been (`max_memory_allocated`).
    pub peak_allocated_bytes: u64,
    /// The most `reserved_bytes` has been (`max_memory_reserved`).
    pub peak_reserved_bytes: u64,
    /// Blocks obtained from `cuMemAlloc`.
    pub allocations: u64,
    /// Requests served from the free list.
    pub reuses: u64,
    /// Blocks released behind events that had not completed when last looked at.
    pub pending_blocks: u64,
}

impl std::fmt::Display for DevicePoolStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "allocated {} (peak {}), reserved {} (peak {}); {} allocations, {} reuses, {} pending",
            human_bytes(self.allocated_bytes),
            human_bytes(self.peak_allocated_bytes),
            human_bytes(self.reserved_bytes),
            human_bytes(self.peak_reserved_bytes),
            self.allocations,
            self.reuses,
            self.pending_blocks
        )
    }
}

struct Pending {
    ptr: sys::CUdeviceptr,
    size: usize,
    fences: Vec<Arc<CudaEvent>>,
}

struct State {
    free: BTreeMap<usize, Vec<sys::CUdeviceptr>>,
    pending: Vec<Pending>,
    stats: DevicePoolStats,
}

struct Inner {
    ctx: Arc<CudaContext>,
    state: Mutex<State>,
}

/// A caching allocator of device memory on one device. Cheap to clone (shared).
#[derive(Clone)]
pub struct DevicePool {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for DevicePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevicePool")
            .field("stats", &self.stats())
            .finish()
    }
}

/// Small blocks are rounded to 512 bytes, blocks of 1 MiB and more to 2 MiB (as PyTorch does).
fn block_size(bytes: usize) -> usize {
    let bytes = bytes.max(1);
    if bytes >= 1 << 20 {
        bytes.next_multiple_of(2 << 20)
    } else {
        bytes.next_multiple_of(512)
    }
}

fn complete(e: &CudaEvent) -> bool {
    // Any error other than "not ready" is a broken context: nothing will use the block again.
    e.try_is_complete().unwrap_or(true)
}

impl DevicePool {
    /// An empty pool on `device`.
    pub fn new(device: &Device) -> DevicePool {
        DevicePool {
            inner: Arc::new(Inner {
                ctx: Arc::clone(device.context()),
                state: Mutex::new(State {
                    free: BTreeMap::new(),
                    pending: Vec::new(),
                    stats: DevicePoolStats::default(),
                }),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bind(&self) -> Result<()> {
        self.inner
            .ctx
            .bind_to_thread()
            .map_err(cuda_err("make the context current"))
    }

    /// A buffer of at least `bytes` bytes of device memory (its contents are whatever the
    /// block last held). Never waits for the device, except after an out-of-memory error.
    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuffer> {
        let size = block_size(bytes);
        self.bind()?;
        {
            let mut state = self.lock();
            collect(&mut state);
            if let Some((ptr, found)) = take_free(&mut state, size) {
                state.stats.reuses += 1;
                return Ok(self.hand_out(&mut state, ptr, found, bytes));
            }
        }
        // SAFETY: a plain allocation of `size` bytes in the current context.
        let ptr = match unsafe { result::malloc_sync(size) } {
            Ok(p) => p,
            Err(_) => {
                // Out of memory (or another failure): wait for pending blocks, give every
                // cached block back, and try once more.
                self.drain_pending();
                self.trim();
                // SAFETY: as above.
                unsafe { result::malloc_sync(size) }
                    .map_err(cuda_err("allocate device memory (cuMemAlloc)"))?
            }
        };
        let mut state = self.lock();
        state.stats.allocations += 1;
        state.stats.reserved_bytes += size as u64;
        state.stats.peak_reserved_bytes = state
            .stats
            .peak_reserved_bytes
            .max(state.stats.reserved_bytes);
        Ok(self.hand_out(&mut state, ptr, size, bytes))
    }

    fn hand_out(
        &self,
        state: &mut State,
        ptr: sys::CUdeviceptr,
        size: usize,
        len: usize,
    ) -> DeviceBuffer {
        state.stats.allocated_bytes += size as u64;
        state.stats.peak_allocated_bytes = state
            .stats
            .peak_allocated_bytes
            .max(state.stats.allocated_bytes);
        DeviceBuffer {
            ptr,
            size,
            len,
            fences: Vec::new(),
            pool: self.clone(),
        }
    }

    fn release(&self, ptr: sys::CUdeviceptr, size: usize, fences: Vec<Arc<CudaEvent>>) {
        let mut state = self.lock();
        state.stats.allocated_bytes -= size as u64;
        let _ = self.inner.ctx.bind_to_thread();
        if fences.iter().all(|e| complete(e)) {
            state.free.entry(size).or_default().push(ptr);
        } else {
            state.pending.push(Pending { ptr, size, fences });
        }
        state.stats.pending_blocks = state.pending.len() as u64;
    }

    /// Waits (blocking the host) for every pending block's events, and caches the blocks.
    fn drain_pending(&self) {
        let pending = std::mem::take(&mut self.lock().pending);
        for p in &pending {
            for e in &p.fences {
                let _ = e.synchronize();
            }
        }
        let mut state = self.lock();
        for p in pending {
            state.free.entry(p.size).or_default().push(p.ptr);
        }
        state.stats.pending_blocks = state.pending.len() as u64;
    }

    /// The pool's figures now.
    pub fn stats(&self) -> DevicePoolStats {
        let _ = self.inner.ctx.bind_to_thread();
        let mut state = self.lock();
        collect(&mut state);
        state.stats
    }

    /// Gives every cached free block back to the driver (blocks in use or pending stay).
    pub fn trim(&self) {
        let _ = self.inner.ctx.bind_to_thread();
        let mut state = self.lock();
        collect(&mut state);
        let free = std::mem::take(&mut state.free);
        for (size, ptrs) in free {
            for ptr in ptrs {
                state.stats.reserved_bytes -= size as u64;
                // SAFETY: the block came from cuMemAlloc, is in no one's hands and no pending
                // work uses it (its fences completed before it reached the free list).
                let _ = unsafe { result::free_sync(ptr) };
            }
        }
    }
}

/// Moves pending blocks whose events have all completed to the free list.
fn collect(state: &mut State) {
    if state.pending.is_empty() {
        return;
    }
    let mut i = 0;
    while i < state.pending.len() {
        if state.pending[i].fences.iter().all(|e| complete(e)) {
            let p = state.pending.swap_remove(i);
            state.free.entry(p.size).or_default().push(p.ptr);
        } else {
            i += 1;
        }
    }
    state.stats.pending_blocks = state.pending.len() as u64;
}

/// The smallest cached block of at least `size` bytes and at most twice that, with its size.
fn take_free(state: &mut State, size: usize) -> Option<(sys::CUdeviceptr, usize)> {
    let (&found, _) = state.free.range(size..=size.saturating_mul(2)).next()?;
    let list = state.free.get_mut(&found)?;
    let ptr = list.pop();
    if list.is_empty() {
        state.free.remove(&found);
    }
    ptr.map(|p| (p, found))
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let state = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        for p in std::mem::take(&mut state.pending) {
            for e in &p.fences {
                let _ = e.synchronize();
            }
            // SAFETY: the block's last users (its fences) have completed; every DeviceBuffer
            // holds a clone of the pool, so none is in anyone's hands when the pool drops.
            let _ = unsafe { result::free_sync(p.ptr) };
        }
        for ptr in std::mem::take(&mut state.free).into_values().flatten() {
            // SAFETY: a cached block: in no one's hands, no pending work.
            let _ = unsafe { result::free_sync(ptr) };
        }
    }
}

/// A block of device memory from a [`DevicePool`]; returns to it on drop, behind the events
/// given to [`DeviceBuffer::release_after`].
pub struct DeviceBuffer {
    ptr: sys::CUdeviceptr,
    size: usize,
    len: usize,
    fences: Vec<Arc<CudaEvent>>,
    pool: DevicePool,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl DeviceBuffer {
    /// The device address of its first byte (aligned to at least 256 bytes).
    pub fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// Bytes requested (the block may be larger).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Keeps the block from reuse until `event` has completed (in addition to earlier ones).
    pub fn release_after(&mut self, event: Arc<CudaEvent>) {
        self.fences.push(event);
    }

    /// Records an event on `stream` now and keeps the block from reuse until it completes:
    /// call it after the last work on `stream` that uses the buffer (PyTorch's `record_stream`).
    pub fn release_on(&mut self, stream: &CudaStream) -> Result<()> {
        let event = stream
            .record_event(None)
            .map_err(cuda_err("record an event (cuEventRecord)"))?;
        self.fences.push(Arc::new(event));
        Ok(())
    }

    /// Copies `data` into the buffer from `offset` on, waiting for the copy (blocking the host;
    /// for setup and tests, not the hot path). The copy is ordered after all work on `stream`.
    pub fn upload_sync(&mut self, stream: &CudaStream, offset: usize, data: &[u8]) -> Result<()> {
        self.check(offset, data.len())?;
        self.pool.bind()?;
        // SAFETY: the range is inside the block (checked); `data` stays borrowed until the
        // stream synchronisation below has waited for the copy.
        unsafe { result::memcpy_htod_async(self.ptr + offset as u64, data, stream.cu_stream()) }
            .map_err(cuda_err("copy to the device (cuMemcpyHtoDAsync)"))?;
        stream
            .synchronize()
            .map_err(cuda_err("synchronize a stream"))
    }

    /// Copies `out.len()` bytes from `offset` on into `out`, ordered after all work on `stream`,
    /// and waits for it (blocking the host; for tests and inspection).
    pub fn download_sync(&self, stream: &CudaStream, offset: usize, out: &mut [u8]) -> Result<()> {
        self.check(offset, out.len())?;
        self.pool.bind()?;
        // SAFETY: the range is inside the block (checked); `out` stays borrowed until the
        // synchronisation below has waited for the copy.
        unsafe { result::memcpy_dtoh_async(out, self.ptr + offset as u64, stream.cu_stream()) }
            .map_err(cuda_err("copy to the host (cuMemcpyDtoHAsync)"))?;
        stream
            .synchronize()
            .map_err(cuda_err("synchronize a stream"))
    }

    /// Fills `len` bytes from `offset` with `byte`, on `stream`, without waiting.
    pub fn fill_async(
        &mut self,
        stream: &CudaStream,
        offset: usize,
        len: usize,
        byte: u8,
    ) -> Result<()> {
        self.check(offset, len)?;
        self.pool.bind()?;
        // SAFETY: the range is inside the block (checked); device memory only.
        unsafe { result::memset_d8_async(self.ptr + offset as u64, byte, len, stream.cu_stream()) }
            .map_err(cuda_err("fill device memory (cuMemsetD8Async)"))
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::config(
                "range",
                format!(
                    "bytes {offset}..{offset}+{len} are outside a device buffer of {} bytes",
                    self.len
                ),
            )),
        }
    }

    /// The pool it returns to.
    pub fn pool(&self) -> &DevicePool {
        &self.pool
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let fences = std::mem::take(&mut self.fences);
        self.pool.release(self.ptr, self.size, fences);
    }
}
