//! [`DevicePool`]: the caching allocator of device memory (the crate's one pool, over
//! `cuMemAlloc`), like PyTorch's CUDA caching allocator; [`DeviceBuffer`]: a block of it.
//!
//! A block freed by its user goes to a free list keyed by size and is reused by the next request
//! that fits (at least the size asked for, at most twice it); blocks are never returned to the
//! driver on the hot path. Every asynchronous operation a `DeviceBuffer` enqueues is first
//! ordered after the buffer's uses on other streams (`cuStreamWaitEvent`, no host wait), then
//! records its fence on the buffer (an event on its stream; a later one on the same stream
//! replaces the earlier). A dropped buffer's block is reused only once all its fences have
//! completed, and freed (`trim`, out of memory, the pool's drop) only after the pool has waited
//! for them. When `cuMemAlloc` runs out of memory, the pool waits for its pending blocks, gives
//! its cached blocks back and tries once more.
//!
//! A pool's last handle (a [`DevicePool`] or a [`DeviceBuffer`]) never waits when it goes: the
//! pool is dropped on gpufeed's release thread (`release.rs`), which waits for its blocks' work
//! and frees them there. A buffer whose release cannot be fenced (a driver error) is leaked,
//! never reused, and counted ([`DevicePool::leaked`], [`leaked_buffers`]).

use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::{CudaContext, CudaStream, result, sys};

use super::Device;
use super::cuda_err;
use super::fence::{EventFence, StreamUse};
use super::release;
use crate::error::{Error, Result};
use crate::memory::{Backing, Buffer, Pool, PoolStats};

/// Bytes of device memory all of the process's device pools hold from the driver.
static RESERVED: AtomicU64 = AtomicU64::new(0);
/// Device buffers leaked by every pool of the process (see [`leaked_buffers`]).
static LEAKED: AtomicU64 = AtomicU64::new(0);

/// Bytes of device memory that gpufeed's device pools hold from the driver now, all pools of
/// the process together (blocks in use, cached, and waiting for their fences): what gpufeed adds
/// to the device's used memory. It falls back to what live pools hold once dropped pools have
/// been freed ([`settle`](super::settle) waits for that).
pub fn reserved_bytes() -> u64 {
    RESERVED.load(Ordering::Acquire)
}

/// Device buffers that gpufeed leaked because their release could not be fenced (the driver
/// failed to record an event on a stream that used them): never reused, never freed. Zero
/// unless the driver failed.
pub fn leaked_buffers() -> u64 {
    LEAKED.load(Ordering::Acquire)
}

/// Device memory of one context, from `cuMemAlloc`.
pub(crate) struct DeviceMemory {
    ctx: Arc<CudaContext>,
    /// Buffers of this pool leaked, and their bytes.
    leaked: AtomicU64,
    leaked_bytes: AtomicU64,
}

impl DeviceMemory {
    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(cuda_err("make the context current"))
    }
}

// SAFETY: `cuMemAlloc` returns device memory of at least `bytes` bytes, aligned to at least 256,
// that nobody else uses, valid until `cuMemFree`, which `free` calls once per block; the address
// is a plain integer. The context (and so the allocation) outlives the backing, which holds an
// Arc of it.
unsafe impl Backing for DeviceMemory {
    type Addr = sys::CUdeviceptr;

    fn name(&self) -> &'static str {
        "device"
    }

    fn allocate(&self, bytes: usize) -> Result<sys::CUdeviceptr> {
        self.bind()?;
        // SAFETY: a plain allocation of `bytes` (> 0) bytes in the current context.
        let addr = unsafe { result::malloc_sync(bytes) }
            .map_err(cuda_err("allocate device memory (cuMemAlloc)"))?;
        RESERVED.fetch_add(bytes as u64, Ordering::AcqRel);
        Ok(addr)
    }

    unsafe fn free(&self, addr: sys::CUdeviceptr, bytes: usize) {
        let _ = self.bind();
        // SAFETY: `addr` came from `allocate` (cuMemAlloc) and is freed once, with no use
        // afterwards: the pool frees a block only when no buffer holds it and its fences (every
        // operation enqueued on it) have completed.
        let _ = unsafe { result::free_sync(addr) };
        RESERVED.fetch_sub(bytes as u64, Ordering::AcqRel);
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

/// A caching allocator of device memory on one device, with no budget. Cheap to clone (shared).
///
/// The pool lives while any handle or buffer of it does. Its last handle never waits when it
/// drops: the pool is dropped on gpufeed's release thread, which waits there for the work still
/// using its blocks and gives them back to the driver ([`settle`](super::settle) waits for it).
pub struct DevicePool {
    /// Taken only in `drop`.
    pool: ManuallyDrop<Pool<DeviceMemory, StreamUse>>,
}

impl Clone for DevicePool {
    fn clone(&self) -> Self {
        DevicePool::from_pool(Pool::clone(&self.pool))
    }
}

impl Drop for DevicePool {
    fn drop(&mut self) {
        // SAFETY: `pool` is taken once, here, and the field is not used again.
        let pool = unsafe { ManuallyDrop::take(&mut self.pool) };
        if let Some(last) = pool.into_unique() {
            release::drop_later(Box::new(last));
        }
    }
}

impl std::fmt::Debug for DevicePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevicePool")
            .field("stats", &self.stats())
            .finish()
    }
}

impl DevicePool {
    /// An empty pool on `device`.
    pub fn new(device: &Device) -> DevicePool {
        let memory = DeviceMemory {
            ctx: Arc::clone(device.context()),
            leaked: AtomicU64::new(0),
            leaked_bytes: AtomicU64::new(0),
        };
        DevicePool::from_pool(Pool::new(memory, None, block_size))
    }

    /// An empty pool on `device` that holds at most `budget` bytes from the driver: a request
    /// that does not fit waits for pending blocks, evicts cached ones, or fails. The GPU
    /// decode's memory comes from one.
    pub fn with_budget(device: &Device, budget: u64) -> DevicePool {
        let memory = DeviceMemory {
            ctx: Arc::clone(device.context()),
            leaked: AtomicU64::new(0),
            leaked_bytes: AtomicU64::new(0),
        };
        DevicePool::from_pool(Pool::new(memory, Some(budget), block_size))
    }

    /// A buffer of at least `bytes` bytes within the pool's budget, waiting at most `wait` for
    /// pending blocks to complete; `Ok(None)` when it does not fit by then (or at once, when
    /// every byte of the budget is in buffers in use). For callers that must not wait for
    /// buffers only they could give back (nvJPEG's allocator).
    pub(crate) fn alloc_within(
        &self,
        bytes: usize,
        wait: std::time::Duration,
    ) -> Result<Option<DeviceBuffer>> {
        let s = self.pool.stats();
        if let Some(budget) = s.budget_bytes
            && s.reserved_bytes + block_size(bytes) as u64 > budget
            && s.pending_blocks == 0
            && s.reserved_bytes <= s.allocated_bytes
        {
            return Ok(None);
        }
        let deadline = std::time::Instant::now() + wait;
        Ok(self
            .pool
            .acquire(bytes, || std::time::Instant::now() > deadline)?
            .map(|buf| DeviceBuffer {
                buf,
                pool: self.clone(),
            }))
    }

    fn from_pool(pool: Pool<DeviceMemory, StreamUse>) -> DevicePool {
        DevicePool {
            pool: ManuallyDrop::new(pool),
        }
    }

    /// A buffer of at least `bytes` bytes of device memory (its contents are whatever the block
    /// last held). Never waits for the device, except after an out-of-memory error.
    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuffer> {
        match self.pool.acquire(bytes, || false)? {
            Some(buf) => Ok(DeviceBuffer {
                buf,
                pool: self.clone(),
            }),
            // Only a cancelled or closed pool gives none; this one is neither.
            None => Err(Error::Shutdown),
        }
    }

    /// Buffers of this pool leaked (their release could not be fenced: a driver error), and
    /// their bytes. Leaked memory is never reused nor freed.
    pub fn leaked(&self) -> (u64, u64) {
        let m = self.pool.backing();
        (
            m.leaked.load(Ordering::Acquire),
            m.leaked_bytes.load(Ordering::Acquire),
        )
    }

    /// The context of its memory.
    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.pool.backing().ctx
    }

    /// The pool's figures now (`budget_bytes` is `None`: device pools have no budget).
    pub fn stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// Gives every cached block back to the driver (blocks in use or pending stay).
    pub fn trim(&self) {
        self.pool.trim()
    }
}

/// A block of device memory from a [`DevicePool`]. Returns to it on drop, reused only once every
/// operation enqueued on it has completed (each records its fence on the buffer).
pub struct DeviceBuffer {
    buf: Buffer<DeviceMemory, StreamUse>,
    /// A handle of the pool, dropped after `buf` (fields drop in order): if the buffer is the
    /// pool's last holder, this handle is, and the pool goes to the release thread.
    pool: DevicePool,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .finish()
    }
}

impl DeviceBuffer {
    /// Bytes requested (the block may be larger).
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.buf.len() == 0
    }

    /// The device address of its first byte (aligned to at least 256 bytes).
    ///
    /// # Safety
    ///
    /// Getting the address is harmless; the caller takes on the contract for every use of it.
    /// It addresses `len()` bytes that are this buffer's while it lives, no longer. Work that
    /// gpufeed did not enqueue is not fenced: for every stream on which you enqueue work that
    /// uses the address, call [`DeviceBuffer::release_on`] after that work and before the
    /// buffer drops (or synchronise the stream), else the block may be reused or freed under
    /// it. Order your work after the buffer's own operations on other streams yourself.
    pub unsafe fn ptr(&self) -> sys::CUdeviceptr {
        self.buf.addr()
    }

    /// The address, for the crate's own fenced operations.
    pub(crate) fn addr(&self) -> sys::CUdeviceptr {
        self.buf.addr()
    }

    /// Records a fence on `stream` now: the block is not reused before `stream` has passed this
    /// point (PyTorch's `record_stream`). Call it after the last work you enqueued on `stream`
    /// that uses the buffer. Does not wait (unless the event cannot be recorded: then it
    /// synchronises `stream` and returns the error).
    pub fn release_on(&self, stream: &Arc<CudaStream>) -> Result<()> {
        self.record_use(stream)
    }

    /// Fills `len` bytes from `offset` with `byte`, on `stream`, without waiting. Ordered after
    /// the buffer's operations on other streams; the block is not reused before it completes.
    pub fn fill_async(
        &mut self,
        stream: &Arc<CudaStream>,
        offset: usize,
        len: usize,
        byte: u8,
    ) -> Result<()> {
        self.check(offset, len)?;
        self.bind()?;
        self.order_on(stream)?;
        // SAFETY: the range is inside this buffer's block (checked), device memory only; the
        // block is not reused or freed before the memset completes: its fence is recorded just
        // below (or, failing that, the stream is synchronised).
        unsafe {
            result::memset_d8_async(self.addr() + offset as u64, byte, len, stream.cu_stream())
        }
        .map_err(cuda_err("fill device memory (cuMemsetD8Async)"))?;
        self.record_use(stream)
    }

    /// Copies `data` into the buffer from `offset` on, on `stream` after its earlier work (and
    /// after the buffer's operations on other streams), and waits for the copy (blocking the
    /// host; for setup and tests, not the hot path).
    pub fn upload_sync(
        &mut self,
        stream: &Arc<CudaStream>,
        offset: usize,
        data: &[u8],
    ) -> Result<()> {
        self.check(offset, data.len())?;
        self.bind()?;
        self.order_on(stream)?;
        // SAFETY: the range is inside this buffer's block (checked); the block is fenced below;
        // `data` stays borrowed until the stream synchronisation below has waited for the copy
        // (if that fails, the context is broken and runs nothing more).
        unsafe { result::memcpy_htod_async(self.addr() + offset as u64, data, stream.cu_stream()) }
            .map_err(cuda_err("copy to the device (cuMemcpyHtoDAsync)"))?;
        let fenced = self.record_use(stream);
        stream
            .synchronize()
            .map_err(cuda_err("synchronize a stream"))?;
        fenced
    }

    /// Copies `out.len()` bytes from `offset` on into `out`, on `stream` after its earlier work
    /// (and after the buffer's operations on other streams), and waits for it (blocking the
    /// host; for tests and inspection).
    pub fn download_sync(
        &self,
        stream: &Arc<CudaStream>,
        offset: usize,
        out: &mut [u8],
    ) -> Result<()> {
        self.check(offset, out.len())?;
        self.bind()?;
        self.order_on(stream)?;
        // SAFETY: the range is inside this buffer's block (checked); the block is fenced below;
        // `out` stays borrowed until the stream synchronisation below has waited for the copy
        // (if that fails, the context is broken and runs nothing more).
        unsafe { result::memcpy_dtoh_async(out, self.addr() + offset as u64, stream.cu_stream()) }
            .map_err(cuda_err("copy to the host (cuMemcpyDtoHAsync)"))?;
        let fenced = self.record_use(stream);
        stream
            .synchronize()
            .map_err(cuda_err("synchronize a stream"))?;
        fenced
    }

    fn bind(&self) -> Result<()> {
        self.pool.pool.backing().bind()
    }

    /// Makes `stream`'s later work wait, on the device, for the buffer's uses on other streams.
    pub(crate) fn order_on(&self, stream: &Arc<CudaStream>) -> Result<()> {
        let uses = self.buf.fences();
        let other = |u: &&StreamUse| u.stream.as_ref().is_none_or(|s| !Arc::ptr_eq(s, stream));
        for u in uses.iter().filter(other) {
            u.fence.order(stream)?;
        }
        Ok(())
    }

    /// Records a fence on `stream` behind the work enqueued on it so far, as a use of the block.
    /// If no event can be recorded, synchronises `stream` (so the block is never reused under
    /// that work) and returns the error.
    pub(crate) fn record_use(&self, stream: &Arc<CudaStream>) -> Result<()> {
        self.try_record_use(stream).inspect_err(|_| {
            // If this fails too, the context is broken and runs nothing more.
            let _ = stream.synchronize();
        })
    }

    /// [`record_use`](Self::record_use) without the synchronisation: on an error, nothing fences
    /// the work on `stream`, and the caller must not let the block be reused ([`leak`](Self::leak)).
    pub(crate) fn try_record_use(&self, stream: &Arc<CudaStream>) -> Result<()> {
        // Recording under the lock keeps the fences of one stream in the order of their records,
        // so the replacement in `put` only ever puts a later fence in place of an earlier one.
        let mut uses = self.buf.fences();
        let fence = EventFence::record(stream)?;
        put(&mut uses, Some(stream), fence);
        Ok(())
    }

    /// Records a fence on a consumer's raw stream behind the work enqueued on it so far, as a
    /// use of the block. The pool's context must be current on the calling thread. On an
    /// error, nothing fences the work on `stream`: the caller must not let the block be reused
    /// ([`leak`](Self::leak)).
    ///
    /// # Safety
    ///
    /// As [`RawStream::from_raw`](super::RawStream::from_raw): `stream` is live and of this
    /// pool's context (or the null or legacy default stream).
    pub(crate) unsafe fn try_record_raw(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: the caller's contract.
        let fence = unsafe { EventFence::record_raw(self.pool.context(), stream) }?;
        put(&mut self.buf.fences(), None, fence);
        Ok(())
    }

    /// Adds `fence`, already recorded on `stream` behind every use of the buffer on `stream`
    /// registered so far, as a use of the block (the copy thread's `ready` event).
    pub(crate) fn add_use(&self, stream: &Arc<CudaStream>, fence: EventFence) {
        put(&mut self.buf.fences(), Some(stream), fence);
    }

    /// Lets go of the buffer without ever returning its block to the pool (nor the pool's
    /// memory to the driver): for a buffer whose last uses could not be fenced. Counted in
    /// [`DevicePool::leaked`] and [`leaked_buffers`].
    pub(crate) fn leak(self) {
        let m = self.pool.pool.backing();
        m.leaked.fetch_add(1, Ordering::AcqRel);
        m.leaked_bytes
            .fetch_add(self.len() as u64, Ordering::AcqRel);
        LEAKED.fetch_add(1, Ordering::AcqRel);
        std::mem::forget(self);
    }

    /// The context of its memory.
    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        self.pool.context()
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(Error::config(
                "range",
                format!(
                    "bytes {offset}..{offset}+{len} are outside a device buffer of {} bytes",
                    self.len()
                ),
            )),
        }
    }

    /// The pool it returns to (a handle to it).
    pub fn pool(&self) -> DevicePool {
        self.pool.clone()
    }
}

/// Registers `fence` as the latest use of the block on `stream`: on a known stream it replaces
/// an earlier fence of the same stream, which completes before it (stream order); a fence on a
/// raw stream (`None`) is added.
fn put(uses: &mut Vec<StreamUse>, stream: Option<&Arc<CudaStream>>, fence: EventFence) {
    let same = |u: &StreamUse| match (&u.stream, stream) {
        (Some(a), Some(b)) => Arc::ptr_eq(a, b),
        _ => false,
    };
    match (stream, uses.iter_mut().find(|u| same(u))) {
        (Some(_), Some(u)) => u.fence = fence,
        _ => uses.push(StreamUse {
            stream: stream.map(Arc::clone),
            fence,
        }),
    }
}
