//! The caching allocator behind every pool: a free list keyed by block size, best fit within
//! 2x, blocks released behind fences, an optional byte budget with backpressure and eviction,
//! one retry after an allocation failure, torch-like statistics.
//!
//! [`Pool`] is generic over where memory comes from (a [`Backing`]) and what a released block
//! waits for (a [`Fence`]); [`HostPool`](super::HostPool) (heap or pinned memory) and
//! `cuda::DevicePool` (device memory) are its faces. It never touches a block's memory: it keeps
//! addresses, and its only `unsafe` is calling [`Backing::free`] (on blocks no buffer holds and
//! whose fences have completed or been waited for) and sending an address between threads.

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use super::{Backing, Fence, PoolStats, human_bytes};
use crate::error::{Error, Result};
use crate::trace::Args;

/// An address lent by a [`Backing`] to the pool.
#[derive(Clone, Copy)]
struct Lent<A>(A);

// SAFETY: a `Backing::Addr` is a plain address (a pointer or an integer; `Copy + 'static`) of
// memory the backing lent to the pool alone (the `Backing` contract). Whoever holds the `Block`
// or `Buffer` carrying it owns that memory, so moving the address to another thread moves that
// ownership, as moving a `Box<[u8]>` does; backings are `Send + Sync`, so a block may be freed on
// any thread.
unsafe impl<A> Send for Lent<A> {}
// SAFETY: sharing a `Lent` only lets other threads copy the address; every access to the memory
// behind it goes through the owner (`HostBuffer::as_slice` hands out `&[u8]` to `&self`, writes
// need `&mut`).
unsafe impl<A> Sync for Lent<A> {}

/// A block of the backing's memory, with the fences it waits for once released.
struct Block<A, F> {
    addr: Lent<A>,
    size: usize,
    /// Empty while the block is cached; its capacity travels with the block, so that fencing a
    /// reused block allocates nothing.
    fences: Vec<F>,
}

struct State<A, F> {
    /// Cached blocks by size. Lists emptied by reuse are kept (no allocation per release).
    free: BTreeMap<usize, Vec<Block<A, F>>>,
    /// Released blocks whose fences have not all completed.
    pending: Vec<Block<A, F>>,
    stats: PoolStats,
    closed: bool,
}

struct Shared<B: Backing, F: Fence> {
    backing: B,
    /// The block size a request takes (granularity differs between host and device).
    round: fn(usize) -> usize,
    state: Mutex<State<B::Addr, F>>,
    released: Condvar,
}

/// A caching allocator over `B`, whose released blocks wait for fences `F`. Cheap to clone
/// (shared).
pub(crate) struct Pool<B: Backing, F: Fence> {
    shared: Arc<Shared<B, F>>,
}

impl<B: Backing, F: Fence> Clone for Pool<B, F> {
    fn clone(&self) -> Self {
        Pool {
            shared: Arc::clone(&self.shared),
        }
    }
}

/// How long a request waiting for the budget sleeps between looks at pending fences (fences
/// complete without telling the pool).
const POLL: Duration = Duration::from_micros(200);

impl<B: Backing, F: Fence> Pool<B, F> {
    /// An empty pool over `backing`: at most `budget` bytes reserved (`None`: no limit), requests
    /// rounded up to blocks of `round(bytes)` bytes (`round(bytes) >= max(bytes, 1)`).
    pub(crate) fn new(backing: B, budget: Option<u64>, round: fn(usize) -> usize) -> Self {
        Pool {
            shared: Arc::new(Shared {
                backing,
                round,
                state: Mutex::new(State {
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

    /// This handle if it is the pool's last (no other handle and no buffer of the pool is
    /// left), else `None` after dropping it. Of several last handles dropped this way at once,
    /// exactly one gets `Some`. Lets a caller choose where the pool's drop, which waits on
    /// pending fences, happens.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn into_unique(self) -> Option<Pool<B, F>> {
        Arc::into_inner(self.shared).map(|shared| Pool {
            shared: Arc::new(shared),
        })
    }

    /// The backing.
    pub(crate) fn backing(&self) -> &B {
        &self.shared.backing
    }

    fn lock(&self) -> MutexGuard<'_, State<B::Addr, F>> {
        // A panic while holding this lock leaves only counters half-updated; keep going.
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A buffer of `bytes` bytes: a cached block if one fits, else a new one. With a budget, waits
    /// while the budget is used up by buffers in use or pending; gives up with `Ok(None)` when
    /// `cancelled()` turns true (checked whenever the pool is woken), with [`Error::Shutdown`]
    /// once the pool is closed. The contents are whatever the block last held.
    pub(crate) fn acquire(
        &self,
        bytes: usize,
        cancelled: impl Fn() -> bool,
    ) -> Result<Option<Buffer<B, F>>> {
        let size = (self.shared.round)(bytes).max(bytes).max(1);
        let mut state = self.lock();
        if let Some(budget) = state.stats.budget_bytes.filter(|&b| size as u64 > b) {
            return Err(Error::config(
                "pool_budget",
                format!(
                    "a {} buffer does not fit in the pool's budget of {}",
                    human_bytes(size as u64),
                    human_bytes(budget)
                ),
            ));
        }
        let mut waited = false;
        let mut reclaimed = false;
        loop {
            if state.closed {
                return Err(Error::Shutdown);
            }
            if cancelled() {
                return Ok(None);
            }
            // A cached block first; else the oldest pending block of the size whose fences have
            // completed (oldest first, stopping at the first: a fence query is a driver call,
            // and on the copy thread's path one per pending block per batch added up).
            let found = match take_free(&mut state, size) {
                Some(block) => Some(block),
                None => take_completed(&mut state, size),
            };
            if let Some(block) = found {
                state.stats.reuses += 1;
                return Ok(Some(self.hand_out(&mut state, block, bytes)));
            }
            // Nothing of this size: cache every pending block that completed, of any size, so
            // that eviction below can give those back (and one of this size may be done now).
            collect_completed(&mut state);
            if let Some(block) = take_free(&mut state, size) {
                state.stats.reuses += 1;
                return Ok(Some(self.hand_out(&mut state, block, bytes)));
            }
            if !fits(&state.stats, size) {
                self.evict(&mut state, size as u64);
            }
            if fits(&state.stats, size) {
                // Reserve the bytes, then allocate without holding the lock (pinned and device
                // allocations take milliseconds).
                state.stats.reserved_bytes += size as u64;
                drop(state);
                let t0 = std::time::Instant::now();
                let allocated = self.shared.backing.allocate(size);
                let took = t0.elapsed();
                crate::trace::span_here("allocate", t0, took, Args::bytes(size as u64));
                state = self.lock();
                match allocated {
                    Ok(addr) => {
                        let block = new_block(&mut state, addr, size, took);
                        return Ok(Some(self.hand_out(&mut state, block, bytes)));
                    }
                    Err(e) => {
                        state.stats.reserved_bytes -= size as u64;
                        let nothing_to_give_back =
                            state.pending.is_empty() && state.free.values().all(Vec::is_empty);
                        if reclaimed || nothing_to_give_back {
                            return Err(e);
                        }
                        // Out of memory (or another failure): wait for the pending blocks, give
                        // every cached block back, and try once more.
                        reclaimed = true;
                        state = self.reclaim(state);
                        continue;
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
                self.shared
                    .released
                    .wait_timeout(state, POLL)
                    .unwrap_or_else(|p| p.into_inner())
                    .0
            };
        }
    }

    /// Makes up to `count` new blocks for buffers of `bytes` bytes ahead of need, one after the
    /// other, each cached (free for the next [`acquire`](Self::acquire)) as soon as it is made;
    /// returns how many it made. The budget's room for all of them is reserved first, so that an
    /// `acquire` meanwhile waits for the next block made here instead of making one of its own
    /// at the same time (with pinned memory, two at once take as long as two in turn). Makes
    /// only what the budget has room for now; stops early, giving the rest of the reservation
    /// back, when `cancelled()` turns true or an allocation fails (the error is returned).
    pub(crate) fn allocate_ahead(
        &self,
        bytes: usize,
        count: usize,
        cancelled: impl Fn() -> bool,
    ) -> Result<usize> {
        let size = (self.shared.round)(bytes).max(bytes).max(1);
        let mut state = self.lock();
        if state.closed {
            return Err(Error::Shutdown);
        }
        collect_completed(&mut state);
        let room = match state.stats.budget_bytes {
            Some(b) => b.saturating_sub(state.stats.reserved_bytes) / size as u64,
            None => count as u64,
        };
        let count = usize::try_from(room).unwrap_or(usize::MAX).min(count);
        state.stats.reserved_bytes += (count * size) as u64;
        drop(state);
        let mut made = 0;
        let outcome = loop {
            if made == count || cancelled() || self.lock().closed {
                break Ok(made);
            }
            let t0 = std::time::Instant::now();
            let allocated = self.shared.backing.allocate(size);
            let took = t0.elapsed();
            crate::trace::span_here("allocate", t0, took, Args::bytes(size as u64));
            let mut state = self.lock();
            match allocated {
                Ok(addr) => {
                    made += 1;
                    let block = new_block(&mut state, addr, size, took);
                    cache(&mut state, block);
                    drop(state);
                    self.shared.released.notify_all();
                }
                Err(e) => break Err(e),
            }
        };
        // Give back the room of the blocks not made, and wake whoever waits for it.
        let mut state = self.lock();
        state.stats.reserved_bytes -= ((count - made) * size) as u64;
        drop(state);
        self.shared.released.notify_all();
        outcome
    }

    fn hand_out(
        &self,
        state: &mut State<B::Addr, F>,
        block: Block<B::Addr, F>,
        len: usize,
    ) -> Buffer<B, F> {
        state.stats.allocated_bytes += block.size as u64;
        state.stats.peak_allocated_bytes = state
            .stats
            .peak_allocated_bytes
            .max(state.stats.allocated_bytes);
        Buffer {
            addr: block.addr,
            size: block.size,
            len,
            fences: Mutex::new(block.fences),
            pool: self.clone(),
        }
    }

    /// Takes a block back from its buffer: cached if its fences have completed, else pending.
    fn release(&self, mut block: Block<B::Addr, F>) {
        // Query (and drop) the fences before taking the lock.
        block.fences.retain(|f| !f.is_complete());
        let mut state = self.lock();
        state.stats.allocated_bytes -= block.size as u64;
        // Wake waiters when the block can be used now (cached), or when it is the first pending
        // one: a waiter that saw no pending block sleeps until woken, one that saw some polls
        // them (`POLL`). Another pending block changes nothing for either, and waking every
        // waiter for it was most of the copy thread's time per small batch (`benches/RESULTS.md`).
        let wake = if block.fences.is_empty() {
            cache(&mut state, block);
            true
        } else {
            state.pending.push(block);
            state.pending.len() == 1
        };
        state.stats.pending_blocks = state.pending.len() as u64;
        drop(state);
        if wake {
            self.shared.released.notify_all();
        }
    }

    /// Gives cached blocks back to the backing, largest first, until `need` more bytes fit the
    /// budget (or none is left).
    fn evict(&self, state: &mut State<B::Addr, F>, need: u64) {
        let Some(budget) = state.stats.budget_bytes else {
            return;
        };
        while state.stats.reserved_bytes + need > budget {
            let Some(mut entry) = state.free.last_entry() else {
                return;
            };
            let Some(block) = entry.get_mut().pop() else {
                entry.remove();
                continue;
            };
            state.stats.reserved_bytes -= block.size as u64;
            state.stats.evictions += 1;
            // SAFETY: a cached block: no buffer holds it, and its fences completed before it was
            // cached; it came from this backing with this size, and leaves the pool here.
            unsafe { self.shared.backing.free(block.addr.0, block.size) };
        }
    }

    /// Waits (blocking, without the lock) on the fences of every pending block, then gives every
    /// cached block back to the backing.
    fn reclaim<'a>(
        &'a self,
        mut state: MutexGuard<'a, State<B::Addr, F>>,
    ) -> MutexGuard<'a, State<B::Addr, F>> {
        let mut pending = std::mem::take(&mut state.pending);
        state.stats.pending_blocks = 0;
        drop(state);
        for block in &mut pending {
            for fence in &block.fences {
                fence.wait();
            }
            block.fences.clear();
        }
        let mut state = self.lock();
        for block in pending {
            cache(&mut state, block);
        }
        for block in std::mem::take(&mut state.free).into_values().flatten() {
            state.stats.reserved_bytes -= block.size as u64;
            state.stats.evictions += 1;
            // SAFETY: cached (the pending ones just waited for): no buffer holds it and no fenced
            // work uses it; it came from this backing with this size, and leaves the pool here.
            unsafe { self.shared.backing.free(block.addr.0, block.size) };
        }
        state
    }

    /// The pool's figures now (pending blocks whose fences completed are cached first).
    pub(crate) fn stats(&self) -> PoolStats {
        let mut state = self.lock();
        collect_completed(&mut state);
        state.stats
    }

    /// Gives every cached block back to the backing (blocks in use or pending stay).
    pub(crate) fn trim(&self) {
        let mut state = self.lock();
        collect_completed(&mut state);
        for block in std::mem::take(&mut state.free).into_values().flatten() {
            state.stats.reserved_bytes -= block.size as u64;
            // SAFETY: a cached block: no buffer holds it, its fences completed before it was
            // cached; it came from this backing with this size, and leaves the pool here.
            unsafe { self.shared.backing.free(block.addr.0, block.size) };
        }
    }

    /// Wakes every waiting request, so that those with a cancellation check look at it again.
    pub(crate) fn wake_waiters(&self) {
        let _guard = self.lock();
        self.shared.released.notify_all();
    }

    /// Fails every waiting and later request with [`Error::Shutdown`].
    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.shared.released.notify_all();
    }
}

/// True when a block of `size` more bytes stays within the budget.
fn fits(stats: &PoolStats, size: usize) -> bool {
    stats
        .budget_bytes
        .is_none_or(|b| stats.reserved_bytes + size as u64 <= b)
}

/// A block the backing just allocated (`size` bytes at `addr`, in `took`), counted in the
/// figures; its bytes were reserved before the allocation.
fn new_block<A, F>(state: &mut State<A, F>, addr: A, size: usize, took: Duration) -> Block<A, F> {
    state.stats.allocations += 1;
    state.stats.allocation_time += took;
    state.stats.peak_reserved_bytes = state
        .stats
        .peak_reserved_bytes
        .max(state.stats.reserved_bytes);
    Block {
        addr: Lent(addr),
        size,
        fences: Vec::new(),
    }
}

/// Puts a block whose fences have all completed on the free list.
fn cache<A, F>(state: &mut State<A, F>, block: Block<A, F>) {
    debug_assert!(block.fences.is_empty(), "caching a block with fences");
    state.free.entry(block.size).or_default().push(block);
}

/// Caches the pending blocks whose fences have all completed.
fn collect_completed<A, F: Fence>(state: &mut State<A, F>) {
    if state.pending.is_empty() {
        return;
    }
    let mut i = 0;
    while i < state.pending.len() {
        state.pending[i].fences.retain(|f| !f.is_complete());
        if state.pending[i].fences.is_empty() {
            let block = state.pending.remove(i);
            cache(state, block);
        } else {
            i += 1;
        }
    }
    state.stats.pending_blocks = state.pending.len() as u64;
}

/// The oldest pending block that `take_free` would take for `size` (at least `size` bytes, at
/// most twice that) whose fences have all completed, taken out of the pending list; queries the
/// fences of pending blocks of other sizes not at all, and stops at the first block found.
/// Blocks are released in the order their work was enqueued, so the oldest is the likeliest
/// done. Order is kept (the list is at most a budget's worth of blocks).
fn take_completed<A, F: Fence>(state: &mut State<A, F>, size: usize) -> Option<Block<A, F>> {
    let fits = |b: &Block<A, F>| b.size >= size && b.size <= size.saturating_mul(2);
    let mut found = None;
    for (i, block) in state.pending.iter_mut().enumerate() {
        if !fits(block) {
            continue;
        }
        block.fences.retain(|f| !f.is_complete());
        if block.fences.is_empty() {
            found = Some(i);
            break;
        }
    }
    let block = state.pending.remove(found?);
    state.stats.pending_blocks = state.pending.len() as u64;
    Some(block)
}

/// The smallest cached block of at least `size` bytes and at most twice that.
fn take_free<A, F>(state: &mut State<A, F>, size: usize) -> Option<Block<A, F>> {
    state
        .free
        .range_mut(size..=size.saturating_mul(2))
        .find_map(|(_, list)| list.pop())
}

impl<B: Backing, F: Fence> Drop for Shared<B, F> {
    fn drop(&mut self) {
        // Every buffer holds a clone of the pool, so when the shared state drops no block is in
        // anyone's hands: each is cached or pending.
        let state = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        let pending = std::mem::take(&mut state.pending);
        let free = std::mem::take(&mut state.free);
        for block in pending {
            // This wait, not a fence's `Drop`, is what keeps the block from being freed under
            // running work.
            for fence in &block.fences {
                fence.wait();
            }
            // SAFETY: no buffer holds the block (above) and every fence of it has been waited
            // for; it came from this backing with this size, and is freed once, here.
            unsafe { self.backing.free(block.addr.0, block.size) };
        }
        for block in free.into_values().flatten() {
            // SAFETY: a cached block: no buffer holds it, its fences completed before it was
            // cached; it came from this backing with this size, and is freed once, here.
            unsafe { self.backing.free(block.addr.0, block.size) };
        }
    }
}

/// A block handed out by a [`Pool`]: returns to it on drop, behind the fences added meanwhile.
pub(crate) struct Buffer<B: Backing, F: Fence> {
    addr: Lent<B::Addr>,
    size: usize,
    len: usize,
    /// Behind a lock so that work enqueued through `&self` (a device read) can be fenced.
    fences: Mutex<Vec<F>>,
    pool: Pool<B, F>,
}

impl<B: Backing, F: Fence> Buffer<B, F> {
    /// The block's address. The memory behind it belongs to this buffer until it drops.
    pub(crate) fn addr(&self) -> B::Addr {
        self.addr.0
    }

    /// Bytes requested (the block is at least this large).
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The fences the block will wait for once released.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn fences(&self) -> MutexGuard<'_, Vec<F>> {
        self.fences.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The same, through an exclusive borrow (no locking).
    pub(crate) fn fences_mut(&mut self) -> &mut Vec<F> {
        self.fences.get_mut().unwrap_or_else(|p| p.into_inner())
    }

    /// The pool it returns to.
    pub(crate) fn pool(&self) -> &Pool<B, F> {
        &self.pool
    }
}

impl<B: Backing, F: Fence> Drop for Buffer<B, F> {
    fn drop(&mut self) {
        let fences = std::mem::take(self.fences_mut());
        self.pool.release(Block {
            addr: self.addr,
            size: self.size,
            fences,
        });
    }
}

#[cfg(test)]
mod tests {
    //! The algorithm over a backing of plain numbers (no memory, no FFI: Miri runs these).
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    /// Hands out distinct numbers as addresses and logs frees; fails past `capacity` live blocks.
    #[derive(Default)]
    struct Numbers {
        next: AtomicUsize,
        live: AtomicUsize,
        capacity: Option<usize>,
        log: Arc<Mutex<Vec<String>>>,
    }

    // SAFETY: the addresses are numbers that address no memory; nothing dereferences them.
    unsafe impl Backing for Numbers {
        type Addr = usize;

        fn name(&self) -> &'static str {
            "numbers"
        }

        fn allocate(&self, _bytes: usize) -> Result<usize> {
            if self
                .capacity
                .is_some_and(|c| self.live.load(Ordering::SeqCst) >= c)
            {
                return Err(Error::config("test", "out of numbers"));
            }
            self.live.fetch_add(1, Ordering::SeqCst);
            Ok(self.next.fetch_add(1, Ordering::SeqCst))
        }

        unsafe fn free(&self, addr: usize, _bytes: usize) {
            self.live.fetch_sub(1, Ordering::SeqCst);
            self.log.lock().unwrap().push(format!("free {addr}"));
        }
    }

    /// Completes when `done` is set; `wait` sets it (standing for the work finishing) and logs.
    /// Its `Drop` does nothing: the pool must not rely on it.
    struct Flag {
        name: &'static str,
        done: Arc<AtomicBool>,
        log: Arc<Mutex<Vec<String>>>,
    }

    // SAFETY: `is_complete` reads the flag that stands for the work; `wait` finishes the "work"
    // before returning.
    unsafe impl Fence for Flag {
        fn is_complete(&self) -> bool {
            self.done.load(Ordering::Acquire)
        }

        fn wait(&self) {
            self.log.lock().unwrap().push(format!("wait {}", self.name));
            self.done.store(true, Ordering::Release);
        }
    }

    fn round(bytes: usize) -> usize {
        bytes.max(1).next_multiple_of(100)
    }

    fn flag(name: &'static str, log: &Arc<Mutex<Vec<String>>>) -> (Flag, Arc<AtomicBool>) {
        let done = Arc::new(AtomicBool::new(false));
        let f = Flag {
            name,
            done: Arc::clone(&done),
            log: Arc::clone(log),
        };
        (f, done)
    }

    fn get(pool: &Pool<Numbers, Flag>, bytes: usize) -> Buffer<Numbers, Flag> {
        pool.acquire(bytes, || false).unwrap().unwrap()
    }

    #[test]
    fn a_released_block_is_reused_only_once_its_fences_complete() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let pool = Pool::new(Numbers::default(), None, round);
        let mut a = get(&pool, 100);
        let a_addr = a.addr();
        let (f1, done1) = flag("1", &log);
        let (f2, done2) = flag("2", &log);
        a.fences_mut().push(f1);
        a.fences().push(f2);
        drop(a);
        assert_eq!(pool.stats().pending_blocks, 1);
        let b = get(&pool, 100);
        assert_ne!(b.addr(), a_addr, "reused a block with pending fences");
        drop(b);
        done1.store(true, Ordering::Release);
        let c = get(&pool, 100);
        let d = get(&pool, 100);
        assert!(
            c.addr() != a_addr && d.addr() != a_addr,
            "one fence is pending"
        );
        drop((c, d));
        done2.store(true, Ordering::Release);
        let s = pool.stats();
        assert_eq!((s.pending_blocks, s.allocations), (0, 3));
        let reused = [get(&pool, 100), get(&pool, 100), get(&pool, 100)];
        assert!(reused.iter().any(|b| b.addr() == a_addr));
        assert_eq!(pool.stats().allocations, 3);
        assert!(log.lock().unwrap().is_empty(), "nothing waited or freed");
    }

    #[test]
    fn dropping_the_pool_waits_on_every_pending_fence_before_freeing() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let backing = Numbers {
            log: Arc::clone(&log),
            ..Numbers::default()
        };
        let pool = Pool::new(backing, None, round);
        let mut a = get(&pool, 100);
        let mut b = get(&pool, 300);
        let cached = get(&pool, 500);
        let (fa, _) = flag("a", &log);
        let (fb1, _) = flag("b1", &log);
        let (fb2, _) = flag("b2", &log);
        a.fences_mut().push(fa);
        b.fences_mut().extend([fb1, fb2]);
        drop((a, b, cached));
        assert_eq!(pool.stats().pending_blocks, 2);
        drop(pool);
        let log = log.lock().unwrap().clone();
        let at = |s: &str| log.iter().position(|l| l == s).unwrap_or(usize::MAX);
        assert_eq!(log.len(), 6, "{log:?}");
        assert!(at("wait a") < at("free 0"), "{log:?}");
        assert!(
            at("wait b1") < at("free 1") && at("wait b2") < at("free 1"),
            "{log:?}"
        );
        assert!(at("free 2") < usize::MAX, "{log:?}");
    }

    #[test]
    fn an_allocation_failure_waits_for_pending_blocks_gives_cached_ones_back_and_retries() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let backing = Numbers {
            capacity: Some(2),
            log: Arc::clone(&log),
            ..Numbers::default()
        };
        let pool = Pool::new(backing, None, round);
        let mut a = get(&pool, 100);
        let cached = get(&pool, 900);
        let (fa, _) = flag("a", &log);
        a.fences_mut().push(fa);
        drop((a, cached));
        // A third size: the backing refuses, the pool waits on `a`, frees both, retries.
        let c = get(&pool, 5000);
        let s = pool.stats();
        assert_eq!((s.allocations, s.evictions, s.pending_blocks), (3, 2, 0));
        assert_eq!(s.reserved_bytes, 5000);
        let log = log.lock().unwrap().clone();
        assert_eq!(log.first().map(String::as_str), Some("wait a"), "{log:?}");
        drop(c);
        // Nothing left to give back: the failure is the backing's error.
        let _d = get(&pool, 5000);
        let _e = get(&pool, 100);
        assert!(pool.acquire(300, || false).is_err());
    }

    #[test]
    fn into_unique_gives_the_pool_to_exactly_its_last_holder() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let backing = Numbers {
            log: Arc::clone(&log),
            ..Numbers::default()
        };
        let pool: Pool<Numbers, Flag> = Pool::new(backing, None, round);
        let other = pool.clone();
        let buffer = get(&pool, 100);
        assert!(
            pool.into_unique().is_none(),
            "a handle and a buffer are left"
        );
        assert!(other.clone().into_unique().is_none(), "`other` is left");
        assert!(other.into_unique().is_none(), "the buffer holds the pool");
        assert!(
            log.lock().unwrap().is_empty(),
            "nothing freed while a buffer lives"
        );
        // The buffer is the last holder now: its drop frees the pool (no fences: no wait).
        drop(buffer);
        assert_eq!(log.lock().unwrap().clone(), ["free 0"]);

        // Several last handles let go at once on several threads: exactly one gets the pool.
        for _ in 0..50 {
            let pool: Pool<Numbers, Flag> = Pool::new(Numbers::default(), None, round);
            let handles: Vec<_> = (0..4).map(|_| pool.clone()).collect();
            drop(pool);
            let got = std::thread::scope(|s| {
                let joins: Vec<_> = handles
                    .into_iter()
                    .map(|h| s.spawn(move || h.into_unique().is_some()))
                    .collect();
                joins
                    .into_iter()
                    .filter_map(|j| j.join().ok())
                    .filter(|&x| x)
                    .count()
            });
            assert_eq!(got, 1);
        }
    }

    #[test]
    fn best_fit_takes_the_smallest_block_of_at_most_twice_the_size() {
        let pool: Pool<Numbers, Flag> = Pool::new(Numbers::default(), None, round);
        let small = get(&pool, 100);
        let mid = get(&pool, 300);
        let big = get(&pool, 800);
        let (s, m, b) = (small.addr(), mid.addr(), big.addr());
        drop((small, mid, big));
        assert_eq!(get(&pool, 200).addr(), m, "300 is the smallest fit for 200");
        let x = get(&pool, 100);
        assert_eq!(x.addr(), s);
        let y = get(&pool, 500);
        assert_eq!(y.addr(), b, "800 is at most twice 500");
        // Only the 300 block is cached: more than twice 100, so a new block.
        let z = get(&pool, 100);
        assert!(![s, m, b].contains(&z.addr()));
        assert_eq!(pool.stats().allocations, 4);
    }

    #[test]
    fn budget_counts_pending_blocks_and_closing_fails_waiters() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let pool = Pool::new(Numbers::default(), Some(200), round);
        let mut a = get(&pool, 100);
        let (fa, done) = flag("a", &log);
        a.fences_mut().push(fa);
        drop(a);
        let _b = get(&pool, 100);
        // The budget is full (one in use, one pending): the request waits, then gives up when
        // its cancellation check turns true.
        let looks = std::cell::Cell::new(0);
        let cancelled = || {
            looks.set(looks.get() + 1);
            looks.get() > 1
        };
        assert!(pool.acquire(100, cancelled).unwrap().is_none());
        assert_eq!(pool.stats().waits, 1);
        done.store(true, Ordering::Release);
        let _c = get(&pool, 100);
        assert_eq!(pool.stats().reuses, 1);
        pool.close();
        assert!(matches!(pool.acquire(100, || false), Err(Error::Shutdown)));
    }

    #[test]
    fn blocks_made_ahead_are_reserved_first_and_taken_by_acquire_without_a_new_allocation() {
        // A budget of 3 blocks, one in use: two are made ahead, not three.
        let pool: Pool<Numbers, Flag> = Pool::new(Numbers::default(), Some(300), round);
        let held = get(&pool, 100);
        assert_eq!(pool.allocate_ahead(100, 5, || false).unwrap(), 2);
        let s = pool.stats();
        assert_eq!(
            (s.allocations, s.reserved_bytes, s.allocated_bytes),
            (3, 300, 100)
        );
        // Both are cached: acquiring them reuses, allocates nothing.
        let a = get(&pool, 100);
        let b = get(&pool, 100);
        assert_eq!(pool.stats().allocations, 3);
        assert_eq!(pool.stats().reuses, 2);
        drop((held, a, b));
        // No room left: nothing is made, nothing reserved.
        let full: Pool<Numbers, Flag> = Pool::new(Numbers::default(), Some(100), round);
        let _x = get(&full, 100);
        assert_eq!(full.allocate_ahead(100, 3, || false).unwrap(), 0);
        assert_eq!(full.stats().reserved_bytes, 100);
    }

    #[test]
    fn an_acquire_waits_for_the_block_made_ahead_instead_of_making_its_own() {
        // The backing is slow to make its first block; meanwhile another thread asks for one.
        // The budget holds one block, reserved by `allocate_ahead`, so the asker must get that
        // block (one allocation in all), not a second one.
        struct Slow(Numbers, std::sync::Barrier);
        // SAFETY: as `Numbers`: addresses are numbers nothing dereferences.
        unsafe impl Backing for Slow {
            type Addr = usize;
            fn name(&self) -> &'static str {
                "slow"
            }
            fn allocate(&self, bytes: usize) -> Result<usize> {
                self.1.wait(); // the asker is started
                std::thread::sleep(std::time::Duration::from_millis(20));
                self.0.allocate(bytes)
            }
            unsafe fn free(&self, addr: usize, bytes: usize) {
                // SAFETY: forwarded as received.
                unsafe { self.0.free(addr, bytes) }
            }
        }
        let pool: Pool<Slow, Flag> = Pool::new(
            Slow(Numbers::default(), std::sync::Barrier::new(2)),
            Some(100),
            round,
        );
        let asker = {
            let pool = pool.clone();
            std::thread::spawn(move || {
                pool.shared.backing.1.wait();
                let b = pool.acquire(100, || false).unwrap().unwrap();
                b.addr()
            })
        };
        assert_eq!(pool.allocate_ahead(100, 1, || false).unwrap(), 1);
        assert_eq!(asker.join().unwrap(), 0, "the block made ahead");
        let s = pool.stats();
        assert_eq!((s.allocations, s.reuses), (1, 1));
    }

    #[test]
    fn a_cancelled_warm_up_gives_back_the_room_it_did_not_use() {
        let pool: Pool<Numbers, Flag> = Pool::new(Numbers::default(), Some(500), round);
        let calls = std::cell::Cell::new(0);
        let cancelled = || {
            calls.set(calls.get() + 1);
            calls.get() > 2
        };
        assert_eq!(pool.allocate_ahead(100, 5, cancelled).unwrap(), 2);
        let s = pool.stats();
        assert_eq!((s.allocations, s.reserved_bytes), (2, 200));
        // A failing backing: the error comes back, and the room with it.
        let failing: Pool<Numbers, Flag> = Pool::new(
            Numbers {
                capacity: Some(1),
                ..Numbers::default()
            },
            Some(500),
            round,
        );
        assert!(failing.allocate_ahead(100, 3, || false).is_err());
        assert_eq!(failing.stats().reserved_bytes, 100);
        assert_eq!(failing.stats().allocations, 1);
    }

    #[test]
    fn the_oldest_completed_pending_block_of_the_size_is_taken_and_the_rest_stay_pending() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let pool = Pool::new(Numbers::default(), None, round);
        // Three released blocks, oldest first: 100 B not done, 100 B done, 400 B done.
        let (mut a, mut b, mut c) = (get(&pool, 100), get(&pool, 100), get(&pool, 400));
        let (a_addr, b_addr, c_addr) = (a.addr(), b.addr(), c.addr());
        let (fa, _a_done) = flag("a", &log);
        let (fb, b_done) = flag("b", &log);
        let (fc, c_done) = flag("c", &log);
        a.fences_mut().push(fa);
        b.fences_mut().push(fb);
        c.fences_mut().push(fc);
        drop((a, b, c));
        b_done.store(true, Ordering::Release);
        c_done.store(true, Ordering::Release);
        let got = get(&pool, 100);
        assert_eq!(got.addr(), b_addr, "the completed one of the size");
        assert_ne!(got.addr(), a_addr);
        let s = pool.stats();
        assert_eq!((s.allocations, s.reuses), (3, 1));
        // The 400 B block completed too, and is cached once figures are read; `a` is pending.
        assert_eq!(s.pending_blocks, 1);
        let big = get(&pool, 400);
        assert_eq!(big.addr(), c_addr);
        assert!(log.lock().unwrap().is_empty(), "nothing waited");
    }

    #[test]
    fn a_waiter_asleep_with_nothing_pending_wakes_for_the_first_pending_block() {
        // Budget of one block, held; a second thread waits with nothing pending (an untimed
        // wait). The held block comes back behind a fence that has not completed: the waiter
        // must switch to polling and take the block once the fence completes.
        let log = Arc::new(Mutex::new(Vec::new()));
        let pool = Pool::new(Numbers::default(), Some(100), round);
        let mut held = get(&pool, 100);
        let addr = held.addr();
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = {
            let pool = pool.clone();
            std::thread::spawn(move || {
                let b = get(&pool, 100);
                tx.send(b.addr()).unwrap();
            })
        };
        // Let the waiter reach its wait (it cannot allocate: the budget is held).
        while pool.stats().waits == 0 {
            std::thread::yield_now();
        }
        let (f, done) = flag("held", &log);
        held.fences_mut().push(f);
        drop(held);
        assert!(
            rx.recv_timeout(std::time::Duration::from_millis(50))
                .is_err(),
            "reused under a fence that has not completed"
        );
        done.store(true, Ordering::Release);
        let got = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the waiter never saw the block complete");
        assert_eq!(got, addr);
        waiter.join().unwrap();
        assert!(
            log.lock().unwrap().is_empty(),
            "nothing waited on the fence"
        );
    }
}
