//! Batch buffers: a caching host allocator with a byte budget, over a pluggable [`Backing`].
//!
//! [`HostPool`] owns every byte the loader collates into. It behaves like PyTorch's caching
//! allocators: a block freed by its user goes to a free list and is reused by the next request
//! that fits, never returned to the system on the hot path; a byte budget bounds what the pool
//! reserves, so that a slow consumer makes producers wait (backpressure) instead of growing
//! memory. A block can be released *behind a [`Fence`]* (a GPU copy still reading it): it is
//! reused only once the fence has completed, the rule of PyTorch's `CachingHostAllocator`.
//!
//! The backing decides what memory is: ordinary page-aligned heap memory ([`HeapBacking`]) here,
//! page-locked (pinned) memory with the `cuda` feature. The pool never touches a block's bytes
//! after zeroing it once at allocation.

mod copy;

pub use copy::{STREAM_THRESHOLD, copy_to_batch};

use std::collections::BTreeMap;
use std::fmt;
use std::ptr::NonNull;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use serde::Serialize;

use crate::error::{Error, Result};

/// Where a pool's blocks come from.
///
/// # Safety
///
/// `allocate` must return a pointer to `bytes` bytes of memory, aligned to at least 64, that
/// stays valid, and is not used by anyone else, until `free` is called with the same pointer
/// and size. The memory may be uninitialised: the pool zeroes it before first use.
pub unsafe trait Backing: Send + Sync + 'static {
    /// A short name for reports (`heap`, `pinned`).
    fn name(&self) -> &'static str;

    /// Allocates a block of `bytes` bytes (`bytes > 0`).
    fn allocate(&self, bytes: usize) -> Result<NonNull<u8>>;

    /// Returns a block to the system.
    ///
    /// # Safety
    ///
    /// `ptr` and `bytes` must come from one earlier `allocate` of this backing, and the block
    /// must not be used afterwards.
    unsafe fn free(&self, ptr: NonNull<u8>, bytes: usize);
}

/// Ordinary heap memory, aligned to 4096 bytes (a page).
#[derive(Clone, Copy, Debug, Default)]
pub struct HeapBacking;

const HEAP_ALIGN: usize = 4096;

// SAFETY: blocks come from the global allocator with a 4096-byte alignment and are freed with
// the same layout; the pool hands each block to one user at a time.
unsafe impl Backing for HeapBacking {
    fn name(&self) -> &'static str {
        "heap"
    }

    fn allocate(&self, bytes: usize) -> Result<NonNull<u8>> {
        let layout = std::alloc::Layout::from_size_align(bytes, HEAP_ALIGN).map_err(|e| {
            Error::config("pool_budget", format!("cannot allocate {bytes} bytes: {e}"))
        })?;
        // SAFETY: `bytes > 0` (the pool never asks for 0), so the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        NonNull::new(ptr).ok_or_else(|| {
            Error::config(
                "pool_budget",
                format!("out of memory allocating {bytes} bytes"),
            )
        })
    }

    unsafe fn free(&self, ptr: NonNull<u8>, bytes: usize) {
        // SAFETY: `allocate` made this block with exactly this layout (the caller's contract).
        unsafe {
            std::alloc::dealloc(
                ptr.as_ptr(),
                std::alloc::Layout::from_size_align_unchecked(bytes, HEAP_ALIGN),
            )
        }
    }
}

/// Something a released block must wait for before it is reused (a device copy reading it).
pub trait Fence: Send + 'static {
    /// True once whatever reads the block has finished; must not block.
    fn is_complete(&self) -> bool;
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
    /// The byte budget `reserved_bytes` never exceeds.
    pub budget_bytes: u64,
    /// Blocks obtained from the backing.
    pub allocations: u64,
    /// Requests served from the free list.
    pub reuses: u64,
    /// Cached blocks given back to the backing to make room for another size.
    pub evictions: u64,
    /// Requests that had to wait for a block to be released (backpressure).
    pub waits: u64,
    /// Blocks released behind a fence that has not completed yet.
    pub pending_blocks: u64,
}

impl fmt::Display for PoolStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "allocated {} (peak {}), reserved {} (peak {}) of budget {}; {} allocations, {} reuses, {} evictions, {} waits",
            human_bytes(self.allocated_bytes),
            human_bytes(self.peak_allocated_bytes),
            human_bytes(self.reserved_bytes),
            human_bytes(self.peak_reserved_bytes),
            human_bytes(self.budget_bytes),
            self.allocations,
            self.reuses,
            self.evictions,
            self.waits
        )
    }
}

/// Formats a byte count with a binary unit (`1.5 MiB`).
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

/// A block of memory owned by the pool.
struct Block {
    ptr: NonNull<u8>,
    size: usize,
}

// SAFETY: a Block is a unique handle to memory from a `Backing`, which is `Send + Sync`; the
// pool moves blocks between threads but only one owner uses a block at a time.
unsafe impl Send for Block {}

struct PoolState {
    free: BTreeMap<usize, Vec<Block>>,
    pending: Vec<(Block, Box<dyn Fence>)>,
    stats: PoolStats,
    closed: bool,
}

struct PoolShared {
    backing: Box<dyn Backing>,
    state: Mutex<PoolState>,
    released: Condvar,
}

/// A caching allocator of batch buffers with a byte budget. Cheap to clone (shared).
#[derive(Clone)]
pub struct HostPool {
    shared: Arc<PoolShared>,
}

impl fmt::Debug for HostPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostPool")
            .field("backing", &self.shared.backing.name())
            .field("stats", &self.stats())
            .finish()
    }
}

/// Blocks are rounded up to this granularity, so that requests of nearby sizes share blocks.
const GRANULE: usize = 4096;

impl HostPool {
    /// A pool of heap memory that reserves at most `budget` bytes.
    pub fn heap(budget: u64) -> HostPool {
        HostPool::with_backing(HeapBacking, budget)
    }

    /// A pool over `backing` that reserves at most `budget` bytes.
    pub fn with_backing(backing: impl Backing, budget: u64) -> HostPool {
        HostPool {
            shared: Arc::new(PoolShared {
                backing: Box::new(backing),
                state: Mutex::new(PoolState {
                    free: BTreeMap::new(),
                    pending: Vec::new(),
                    stats: PoolStats {
                        budget_bytes: budget,
                        ..PoolStats::default()
                    },
                    closed: false,
                }),
                released: Condvar::new(),
            }),
        }
    }

    /// The backing's name.
    pub fn backing_name(&self) -> &'static str {
        self.shared.backing.name()
    }

    /// The block size a request of `bytes` takes.
    pub fn block_size(bytes: usize) -> usize {
        bytes.max(1).next_multiple_of(GRANULE)
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        // A panic while holding this lock leaves only counters half-updated; keep going.
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A buffer of `bytes` bytes, waiting while the budget is used up by buffers in use.
    ///
    /// Fails at once if `bytes` alone exceeds the budget, and with [`Error::Shutdown`] if the
    /// pool is closed while waiting. The contents are whatever the block last held.
    pub fn acquire(&self, bytes: usize) -> Result<HostBuffer> {
        match self.acquire_unless(bytes, || false)? {
            Some(buffer) => Ok(buffer),
            None => Err(Error::Shutdown),
        }
    }

    /// Like [`HostPool::acquire`], but gives up with `Ok(None)` when `cancelled()` turns true
    /// while waiting (checked whenever the pool is woken; see [`HostPool::wake_waiters`]).
    pub fn acquire_unless(
        &self,
        bytes: usize,
        cancelled: impl Fn() -> bool,
    ) -> Result<Option<HostBuffer>> {
        let size = HostPool::block_size(bytes);
        let mut state = self.lock();
        if size as u64 > state.stats.budget_bytes {
            return Err(Error::config(
                "pool_budget",
                format!(
                    "a {} buffer does not fit in the pool's budget of {}",
                    human_bytes(size as u64),
                    human_bytes(state.stats.budget_bytes)
                ),
            ));
        }
        let mut waited = false;
        loop {
            if state.closed {
                return Err(Error::Shutdown);
            }
            if cancelled() {
                return Ok(None);
            }
            collect_completed(&mut state);
            if let Some(block) = take_free(&mut state, size) {
                state.stats.reuses += 1;
                return Ok(Some(self.hand_out(&mut state, block, bytes)));
            }
            if state.stats.reserved_bytes + size as u64 > state.stats.budget_bytes {
                self.evict(&mut state, size as u64);
            }
            if state.stats.reserved_bytes + size as u64 <= state.stats.budget_bytes {
                // Reserve the bytes, then allocate without holding the lock (pinned allocations
                // take milliseconds).
                state.stats.reserved_bytes += size as u64;
                drop(state);
                let allocated = self.shared.backing.allocate(size);
                state = self.lock();
                match allocated {
                    Ok(ptr) => {
                        // SAFETY: `ptr` points to `size` bytes that nobody else uses yet.
                        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, size) };
                        state.stats.allocations += 1;
                        state.stats.peak_reserved_bytes = state
                            .stats
                            .peak_reserved_bytes
                            .max(state.stats.reserved_bytes);
                        return Ok(Some(self.hand_out(&mut state, Block { ptr, size }, bytes)));
                    }
                    Err(e) => {
                        state.stats.reserved_bytes -= size as u64;
                        return Err(e);
                    }
                }
            }
            if !waited {
                state.stats.waits += 1;
                waited = true;
            }
            state = if state.pending.is_empty() {
                self.shared
                    .released
                    .wait(state)
                    .unwrap_or_else(|p| p.into_inner())
            } else {
                // Fences complete without telling us: poll them.
                self.shared
                    .released
                    .wait_timeout(state, Duration::from_micros(200))
                    .unwrap_or_else(|p| p.into_inner())
                    .0
            };
        }
    }

    /// Gives cached free blocks back to the backing until `need` more bytes fit the budget.
    fn evict(&self, state: &mut PoolState, need: u64) {
        while state.stats.reserved_bytes + need > state.stats.budget_bytes {
            let Some(mut entry) = state.free.last_entry() else {
                return;
            };
            let Some(block) = entry.get_mut().pop() else {
                entry.remove();
                continue;
            };
            if entry.get().is_empty() {
                entry.remove();
            }
            state.stats.reserved_bytes -= block.size as u64;
            state.stats.evictions += 1;
            // SAFETY: the block came from this backing's `allocate` and is in no one's hands.
            unsafe { self.shared.backing.free(block.ptr, block.size) };
        }
    }

    fn hand_out(&self, state: &mut PoolState, block: Block, len: usize) -> HostBuffer {
        state.stats.allocated_bytes += block.size as u64;
        state.stats.peak_allocated_bytes = state
            .stats
            .peak_allocated_bytes
            .max(state.stats.allocated_bytes);
        HostBuffer {
            block: Some(block),
            len,
            fence: None,
            pool: self.clone(),
        }
    }

    fn release(&self, block: Block, fence: Option<Box<dyn Fence>>) {
        let mut state = self.lock();
        state.stats.allocated_bytes -= block.size as u64;
        match fence {
            Some(f) if !f.is_complete() => {
                state.pending.push((block, f));
                state.stats.pending_blocks = state.pending.len() as u64;
            }
            _ => state.free.entry(block.size).or_default().push(block),
        }
        drop(state);
        self.shared.released.notify_all();
    }

    /// The pool's figures now.
    pub fn stats(&self) -> PoolStats {
        let mut state = self.lock();
        collect_completed(&mut state);
        state.stats
    }

    /// Returns every cached free block to the backing (blocks in use are untouched).
    pub fn trim(&self) {
        let mut state = self.lock();
        collect_completed(&mut state);
        let free = std::mem::take(&mut state.free);
        for block in free.into_values().flatten() {
            state.stats.reserved_bytes -= block.size as u64;
            // SAFETY: the block came from this backing and is in no one's hands.
            unsafe { self.shared.backing.free(block.ptr, block.size) };
        }
    }

    /// Wakes every waiting acquire, so that those given a cancellation check look at it again.
    pub fn wake_waiters(&self) {
        let _guard = self.lock();
        self.shared.released.notify_all();
    }

    /// Wakes every waiting `acquire` with [`Error::Shutdown`]; later ones fail the same way.
    pub fn close(&self) {
        self.lock().closed = true;
        self.shared.released.notify_all();
    }
}

/// Moves blocks whose fence has completed to the free list.
fn collect_completed(state: &mut PoolState) {
    if state.pending.is_empty() {
        return;
    }
    let mut i = 0;
    while i < state.pending.len() {
        if state.pending[i].1.is_complete() {
            let (block, _) = state.pending.swap_remove(i);
            state.free.entry(block.size).or_default().push(block);
        } else {
            i += 1;
        }
    }
    state.stats.pending_blocks = state.pending.len() as u64;
}

/// The smallest free block of at least `size` bytes and at most twice that.
fn take_free(state: &mut PoolState, size: usize) -> Option<Block> {
    let (&found, _) = state.free.range(size..=size.saturating_mul(2)).next()?;
    let list = state.free.get_mut(&found)?;
    let block = list.pop();
    if list.is_empty() {
        state.free.remove(&found);
    }
    block
}

impl Drop for PoolShared {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        let blocks = std::mem::take(&mut state.free)
            .into_values()
            .flatten()
            .chain(
                std::mem::take(&mut state.pending)
                    .into_iter()
                    .map(|(b, _)| b),
            );
        for block in blocks {
            // SAFETY: every buffer holds a clone of the pool, so when the pool's shared state
            // drops no block is in use; pending fences are dropped with their owner (for device
            // copies, the fence's drop waits for the copy).
            unsafe { self.backing.free(block.ptr, block.size) };
        }
    }
}

/// A buffer from a [`HostPool`]; returns to the pool on drop (behind its fence, if one is set).
pub struct HostBuffer {
    block: Option<Block>,
    len: usize,
    fence: Option<Box<dyn Fence>>,
    pool: HostPool,
}

// SAFETY: the buffer is the unique owner of its block (see Block); shared access goes through
// `&self`, which only hands out `&[u8]`.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Bytes requested (the block may be larger).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The buffer's address (for device copies).
    pub fn as_ptr(&self) -> *const u8 {
        self.block
            .as_ref()
            .map_or(std::ptr::null(), |b| b.ptr.as_ptr())
    }

    /// The buffer's bytes.
    pub fn as_slice(&self) -> &[u8] {
        match &self.block {
            // SAFETY: the block holds at least `len` initialised bytes (zeroed at allocation)
            // and this buffer is its only owner.
            Some(b) => unsafe { std::slice::from_raw_parts(b.ptr.as_ptr(), self.len) },
            None => &[],
        }
    }

    /// The buffer's bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match &mut self.block {
            // SAFETY: as in `as_slice`, and `&mut self` makes this the only access.
            Some(b) => unsafe { std::slice::from_raw_parts_mut(b.ptr.as_ptr(), self.len) },
            None => &mut [],
        }
    }

    /// Makes the block wait for `fence` before the pool reuses it (for example, the event
    /// recorded after a device copy that reads it). A later fence replaces an earlier one.
    pub fn release_after(&mut self, fence: Box<dyn Fence>) {
        self.fence = Some(fence);
    }

    /// The pool this buffer belongs to.
    pub fn pool(&self) -> &HostPool {
        &self.pool
    }
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("len", &self.len)
            .finish()
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if let Some(block) = self.block.take() {
            self.pool.release(block, self.fence.take());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[test]
    fn reuses_instead_of_allocating() {
        let pool = HostPool::heap(1 << 20);
        for _ in 0..10 {
            let mut b = pool.acquire(100_000).unwrap();
            b.as_mut_slice().fill(7);
        }
        let s = pool.stats();
        assert_eq!((s.allocations, s.reuses), (1, 9));
        assert_eq!(s.allocated_bytes, 0);
        assert_eq!(s.reserved_bytes, HostPool::block_size(100_000) as u64);
        assert_eq!(s.peak_allocated_bytes, s.reserved_bytes);
    }

    #[test]
    fn a_request_larger_than_the_budget_fails_at_once() {
        let pool = HostPool::heap(4096);
        assert!(matches!(
            pool.acquire(5000),
            Err(Error::InvalidConfig { .. })
        ));
    }

    #[test]
    fn budget_gives_backpressure_and_release_wakes_waiters() {
        let pool = HostPool::heap(2 * 4096);
        let a = pool.acquire(4096).unwrap();
        let _b = pool.acquire(4096).unwrap();
        let p2 = pool.clone();
        let waiter = std::thread::spawn(move || p2.acquire(4096).map(|b| b.len()));
        std::thread::sleep(Duration::from_millis(50));
        assert!(!waiter.is_finished());
        drop(a);
        assert_eq!(waiter.join().unwrap().unwrap(), 4096);
        assert_eq!(pool.stats().waits, 1);
        assert!(pool.stats().reserved_bytes <= 2 * 4096);
    }

    #[test]
    fn close_wakes_waiters_with_shutdown() {
        let pool = HostPool::heap(4096);
        let _a = pool.acquire(4096).unwrap();
        let p2 = pool.clone();
        let waiter = std::thread::spawn(move || p2.acquire(4096).map(|_| ()));
        std::thread::sleep(Duration::from_millis(20));
        pool.close();
        assert!(matches!(waiter.join().unwrap(), Err(Error::Shutdown)));
    }

    struct Flag(Arc<AtomicBool>);
    impl Fence for Flag {
        fn is_complete(&self) -> bool {
            self.0.load(Ordering::Acquire)
        }
    }

    #[test]
    fn a_fenced_block_is_not_reused_before_its_fence_completes() {
        let pool = HostPool::heap(2 * 4096);
        let done = Arc::new(AtomicBool::new(false));
        let mut a = pool.acquire(4096).unwrap();
        let a_ptr = a.as_ptr();
        a.release_after(Box::new(Flag(done.clone())));
        drop(a);
        let b = pool.acquire(4096).unwrap();
        assert_ne!(b.as_ptr(), a_ptr, "reused a block whose fence is pending");
        drop(b);
        done.store(true, Ordering::Release);
        let _c = pool.acquire(4096).unwrap();
        let d = pool.acquire(4096).unwrap();
        let _ = d;
        assert_eq!(pool.stats().allocations, 2);
        assert_eq!(pool.stats().pending_blocks, 0);
    }

    #[test]
    fn evicts_cached_blocks_of_another_size_to_fit_the_budget() {
        let pool = HostPool::heap(3 * 4096);
        drop(pool.acquire(3 * 4096).unwrap());
        let _small = pool.acquire(4096).unwrap();
        let s = pool.stats();
        assert_eq!(s.evictions, 1);
        assert_eq!(s.reserved_bytes, 4096);
    }
}
