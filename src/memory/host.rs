//! [`HostPool`]: the pool of host batch buffers (heap or pinned), with a byte budget.
//!
//! The generic pool with a budget, over a host [`Backing`] whose blocks are zeroed once when
//! allocated, released behind boxed [`Fence`]s. A slow consumer makes producers wait
//! (backpressure) instead of growing memory.

use std::fmt;
use std::ptr::NonNull;

use super::pool::{Buffer, Pool};
use super::{Backing, Fence, HeapBacking, PoolStats};
use crate::error::{Error, Result};

/// A host backing chosen at run time (heap, pinned, or the user's own).
type AnyHost = Box<dyn Backing<Addr = NonNull<u8>>>;

/// Host memory whose blocks are zeroed once, when allocated: every byte a [`HostBuffer`] shows
/// is initialised.
struct Zeroed(AnyHost);

// SAFETY: every block comes from the inner backing, which upholds the contract (host memory,
// aligned, exclusively the pool's until `free`); zeroing it first changes none of that.
unsafe impl Backing for Zeroed {
    type Addr = NonNull<u8>;

    fn name(&self) -> &'static str {
        self.0.name()
    }

    fn allocate(&self, bytes: usize) -> Result<NonNull<u8>> {
        let ptr = self.0.allocate(bytes)?;
        if !self.0.zeroed() {
            // SAFETY: by the inner backing's contract, `ptr` addresses `bytes` bytes of host
            // memory that this process may write and that nobody else uses yet.
            unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, bytes) };
        }
        Ok(ptr)
    }

    fn zeroed(&self) -> bool {
        true
    }

    unsafe fn free(&self, addr: NonNull<u8>, bytes: usize) {
        // SAFETY: the caller's contract (one earlier `allocate` of this backing, which is one of
        // the inner backing, and no use afterwards) is the inner backing's.
        unsafe { self.0.free(addr, bytes) }
    }
}

/// A caching allocator of batch buffers with a byte budget. Cheap to clone (shared).
#[derive(Clone)]
pub struct HostPool {
    pool: Pool<Zeroed, Box<dyn Fence>>,
}

impl fmt::Debug for HostPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostPool")
            .field("backing", &self.backing_name())
            .field("stats", &self.stats())
            .finish()
    }
}

/// Host blocks are rounded up to this granularity, so that requests of nearby sizes share
/// blocks.
const GRANULE: usize = 4096;

impl HostPool {
    /// A pool of heap memory that reserves at most `budget` bytes.
    pub fn heap(budget: u64) -> HostPool {
        HostPool::with_backing(HeapBacking, budget)
    }

    /// A pool over `backing` that reserves at most `budget` bytes.
    pub fn with_backing(backing: impl Backing<Addr = NonNull<u8>>, budget: u64) -> HostPool {
        HostPool {
            pool: Pool::new(
                Zeroed(Box::new(backing)),
                Some(budget),
                HostPool::block_size,
            ),
        }
    }

    /// The backing's name.
    pub fn backing_name(&self) -> &'static str {
        self.pool.backing().name()
    }

    /// The block size a request of `bytes` takes.
    pub fn block_size(bytes: usize) -> usize {
        bytes.max(1).next_multiple_of(GRANULE)
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
    pub(crate) fn acquire_unless(
        &self,
        bytes: usize,
        cancelled: impl Fn() -> bool,
    ) -> Result<Option<HostBuffer>> {
        Ok(self
            .pool
            .acquire(bytes, cancelled)?
            .map(|buf| HostBuffer { buf }))
    }

    /// Makes up to `count` buffers of `bytes` bytes ahead of need, in turn, each free for the
    /// next `acquire` as soon as it is made (see `Pool::allocate_ahead`).
    pub(crate) fn allocate_ahead(
        &self,
        bytes: usize,
        count: usize,
        cancelled: impl Fn() -> bool,
    ) -> Result<usize> {
        self.pool.allocate_ahead(bytes, count, cancelled)
    }

    /// The pool's figures now.
    pub fn stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// Returns every cached free block to the backing (blocks in use or pending are untouched).
    pub fn trim(&self) {
        self.pool.trim()
    }

    /// Wakes every waiting acquire, so that those given a cancellation check look at it again.
    pub(crate) fn wake_waiters(&self) {
        self.pool.wake_waiters()
    }

    /// Wakes every waiting `acquire` with [`Error::Shutdown`]; later ones fail the same way.
    pub(crate) fn close(&self) {
        self.pool.close()
    }
}

/// A buffer from a [`HostPool`]; returns to the pool on drop, behind the fences given to
/// [`HostBuffer::release_after`].
pub struct HostBuffer {
    buf: Buffer<Zeroed, Box<dyn Fence>>,
}

impl HostBuffer {
    /// Bytes requested (the block may be larger).
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.buf.len() == 0
    }

    /// The buffer's address (for device copies).
    pub fn as_ptr(&self) -> *const u8 {
        self.buf.addr().as_ptr()
    }

    /// The buffer's bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the block is host memory of at least `len` bytes (the pool rounds requests
        // up, the `Backing` contract), initialised (zeroed at allocation by `Zeroed`, written
        // since only through `as_mut_slice`), and this buffer is its only owner until it drops
        // (the pool hands a block to one buffer at a time); `&self` rules out `as_mut_slice`
        // for the borrow's life.
        unsafe { std::slice::from_raw_parts(self.buf.addr().as_ptr(), self.buf.len()) }
    }

    /// The buffer's bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only access for the borrow's
        // life.
        unsafe { std::slice::from_raw_parts_mut(self.buf.addr().as_ptr(), self.buf.len()) }
    }

    /// Keeps the block from reuse until `fence` has completed (for example, the event recorded
    /// after a device copy that reads it), in addition to the fences given before.
    pub fn release_after(&mut self, fence: Box<dyn Fence>) {
        self.buf.fences_mut().push(fence);
    }

    /// The pool this buffer belongs to (a handle to it).
    pub fn pool(&self) -> HostPool {
        HostPool {
            pool: self.buf.pool().clone(),
        }
    }
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("len", &self.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

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
        assert_eq!(s.budget_bytes, Some(1 << 20));
    }

    #[test]
    fn a_new_block_reads_as_zeros_and_a_reused_one_as_it_was_left() {
        let pool = HostPool::heap(1 << 20);
        let mut b = pool.acquire(10_000).unwrap();
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[9_999] = 5;
        drop(b);
        let b = pool.acquire(10_000).unwrap();
        assert_eq!(pool.stats().reuses, 1);
        assert_eq!(b.as_slice()[9_999], 5, "a reused block is not zeroed again");
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

    #[test]
    fn wake_waiters_lets_a_cancelled_acquire_give_up() {
        let pool = HostPool::heap(4096);
        let _a = pool.acquire(4096).unwrap();
        let cancel = Arc::new(AtomicBool::new(false));
        let (p2, c2) = (pool.clone(), Arc::clone(&cancel));
        let waiter = std::thread::spawn(move || {
            p2.acquire_unless(4096, || c2.load(Ordering::Acquire))
                .map(|b| b.is_none())
        });
        std::thread::sleep(Duration::from_millis(20));
        cancel.store(true, Ordering::Release);
        pool.wake_waiters();
        assert!(waiter.join().unwrap().unwrap(), "gave up with None");
    }

    struct Flag(Arc<AtomicBool>);

    // SAFETY: the flag stands for the work: set means done; `wait` spins until it is set.
    unsafe impl Fence for Flag {
        fn is_complete(&self) -> bool {
            self.0.load(Ordering::Acquire)
        }

        fn wait(&self) {
            while !self.is_complete() {
                std::thread::yield_now();
            }
        }
    }

    #[test]
    fn a_fenced_block_is_not_reused_before_its_fences_complete() {
        let pool = HostPool::heap(3 * 4096);
        let first = Arc::new(AtomicBool::new(false));
        let second = Arc::new(AtomicBool::new(false));
        let mut a = pool.acquire(4096).unwrap();
        let a_ptr = a.as_ptr();
        a.release_after(Box::new(Flag(first.clone())));
        a.release_after(Box::new(Flag(second.clone())));
        drop(a);
        let b = pool.acquire(4096).unwrap();
        assert_ne!(b.as_ptr(), a_ptr, "reused a block whose fences are pending");
        drop(b);
        first.store(true, Ordering::Release);
        // One fence of two completed: still pending.
        let c = pool.acquire(4096).unwrap();
        let d = pool.acquire(4096).unwrap();
        assert!(c.as_ptr() != a_ptr && d.as_ptr() != a_ptr);
        assert_eq!(pool.stats().pending_blocks, 1);
        second.store(true, Ordering::Release);
        drop((c, d));
        let s = pool.stats();
        assert_eq!((s.allocations, s.pending_blocks), (3, 0));
    }

    #[test]
    fn dropping_the_pool_waits_for_a_pending_fence() {
        let pool = HostPool::heap(4096);
        let done = Arc::new(AtomicBool::new(false));
        let mut a = pool.acquire(4096).unwrap();
        a.release_after(Box::new(Flag(done.clone())));
        drop(a);
        let setter = {
            let done = Arc::clone(&done);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                done.store(true, Ordering::Release);
            })
        };
        // Returns only once the fence has completed (Flag::wait), then frees the block.
        drop(pool);
        assert!(done.load(Ordering::Acquire));
        setter.join().unwrap();
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
