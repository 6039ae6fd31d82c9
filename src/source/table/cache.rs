//! [`ChunkCache`]: decoded chunks of a table, shared by every worker thread, bounded in bytes,
//! the least recently used dropped first.
//!
//! The shape of the shards' set of open shards (`shards/lru.rs`), with a bound in bytes
//! instead of a count, and hits counted: a chunk is decoded the first time a row of it is asked
//! for, by the first thread that asks (the others wait on its slot, so each chunk is decoded
//! once however many workers want it), and stays while the chunks held fit in the byte limit.
//! Samples keep their chunk's buffers alive (they hold reference-counted views), so dropping a
//! chunk from the cache never invalidates a sample in flight.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use crate::error::Result;

/// What the cache of decoded chunks did, for `stats()`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ChunkCacheStats {
    /// Rows asked for whose chunk was held.
    pub hits: u64,
    /// Chunks decoded (each first use, and each use after an eviction).
    pub misses: u64,
    /// Chunks dropped to stay within the limit.
    pub evictions: u64,
    /// Chunks held now.
    pub chunks: usize,
    /// Bytes of the chunks held now.
    pub bytes: u64,
    /// The most bytes held at once.
    pub peak_bytes: u64,
    /// The limit in bytes (a single chunk larger than it is still held while used).
    pub limit_bytes: u64,
}

struct Slot<T> {
    chunk: RwLock<Option<Arc<T>>>,
    used: AtomicU64,
}

struct Held {
    /// (chunk, bytes) of the chunks held.
    chunks: Vec<(usize, u64)>,
    bytes: u64,
    peak: u64,
}

/// Decoded chunks of type `T`, at most `limit` bytes of them (and always the last one made).
pub(crate) struct ChunkCache<T> {
    slots: Vec<Slot<T>>,
    limit: u64,
    clock: AtomicU64,
    held: Mutex<Held>,
    hits: AtomicU64,
    misses: AtomicU64,
    evictions: AtomicU64,
}

impl<T> ChunkCache<T> {
    /// A cache for `chunks` chunks holding at most `limit` bytes of them.
    pub(crate) fn new(chunks: usize, limit: u64) -> ChunkCache<T> {
        ChunkCache {
            slots: (0..chunks)
                .map(|_| Slot {
                    chunk: RwLock::new(None),
                    used: AtomicU64::new(0),
                })
                .collect(),
            limit,
            clock: AtomicU64::new(1),
            held: Mutex::new(Held {
                chunks: Vec::new(),
                bytes: 0,
                peak: 0,
            }),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
        }
    }

    fn touch(&self, slot: &Slot<T>) {
        let now = self.clock.load(Ordering::Relaxed);
        if slot.used.load(Ordering::Relaxed) != now {
            slot.used.store(now, Ordering::Relaxed);
        }
    }

    /// Chunk `k` (a chunk number), decoded by `decode` (which also says its size in bytes)
    /// unless it is held.
    pub(crate) fn get(
        &self,
        k: usize,
        decode: impl FnOnce() -> Result<(T, u64)>,
    ) -> Result<Arc<T>> {
        let slot = &self.slots[k];
        if let Some(c) = slot
            .chunk
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            self.touch(slot);
            self.hits.fetch_add(1, Ordering::Relaxed);
            return Ok(Arc::clone(c));
        }
        let (made, bytes) = {
            let mut guard = slot.chunk.write().unwrap_or_else(|e| e.into_inner());
            if let Some(c) = guard.as_ref() {
                self.touch(slot);
                self.hits.fetch_add(1, Ordering::Relaxed);
                return Ok(Arc::clone(c));
            }
            let (chunk, bytes) = decode()?;
            let chunk = Arc::new(chunk);
            *guard = Some(Arc::clone(&chunk));
            (chunk, bytes)
        };
        let tick = self.clock.fetch_add(2, Ordering::Relaxed) + 1;
        slot.used.store(tick, Ordering::Relaxed);
        self.misses.fetch_add(1, Ordering::Relaxed);
        let mut victims = Vec::new();
        {
            let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
            held.chunks.push((k, bytes));
            held.bytes += bytes;
            held.peak = held.peak.max(held.bytes);
            while held.bytes > self.limit && held.chunks.len() > 1 {
                let Some((pos, _)) = held
                    .chunks
                    .iter()
                    .enumerate()
                    .filter(|&(_, &(v, _))| v != k)
                    .min_by_key(|&(_, &(v, _))| self.slots[v].used.load(Ordering::Relaxed))
                else {
                    break;
                };
                let (victim, b) = held.chunks.swap_remove(pos);
                held.bytes -= b;
                // Lock order: a slot's lock is never held while this mutex is taken.
                victims.push(
                    self.slots[victim]
                        .chunk
                        .write()
                        .unwrap_or_else(|e| e.into_inner())
                        .take(),
                );
                self.evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
        // Freed here, outside the mutex (unless samples still hold them).
        drop(victims);
        Ok(made)
    }

    /// The counts so far.
    pub(crate) fn stats(&self) -> ChunkCacheStats {
        let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        ChunkCacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            chunks: held.chunks.len(),
            bytes: held.bytes,
            peak_bytes: held.peak,
            limit_bytes: self.limit,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn holds_at_most_the_limit_and_drops_the_least_recently_used() {
        let cache = ChunkCache::<usize>::new(10, 300);
        for k in 0..3 {
            assert_eq!(*cache.get(k, || Ok((k, 100))).unwrap(), k);
        }
        // 0 used again: 1 is the least recently used when 3 comes.
        cache.get(0, || panic!("0 is held")).unwrap();
        cache.get(3, || Ok((3, 100))).unwrap();
        let s = cache.stats();
        assert_eq!((s.hits, s.misses, s.evictions), (1, 4, 1));
        assert_eq!((s.chunks, s.bytes, s.peak_bytes), (3, 300, 400));
        let again = AtomicUsize::new(0);
        cache
            .get(1, || {
                again.fetch_add(1, Ordering::Relaxed);
                Ok((1, 100))
            })
            .unwrap();
        assert_eq!(again.load(Ordering::Relaxed), 1, "1 was dropped");
        // A chunk larger than the limit is held alone.
        cache.get(5, || Ok((5, 1000))).unwrap();
        assert_eq!(cache.stats().chunks, 1);
        cache.get(5, || panic!("5 is held")).unwrap();
    }

    #[test]
    fn a_failed_decode_holds_nothing() {
        let cache = ChunkCache::<u8>::new(2, 10);
        assert!(
            cache
                .get(0, || Err(crate::error::Error::user("bad page")))
                .is_err()
        );
        assert_eq!(*cache.get(0, || Ok((7, 1))).unwrap(), 7);
        assert_eq!(cache.stats().misses, 1);
    }

    #[test]
    fn threads_decode_each_chunk_once() {
        let cache = ChunkCache::<usize>::new(64, 1 << 40);
        let decodes = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for t in 0..4 {
                let (cache, decodes) = (&cache, &decodes);
                s.spawn(move || {
                    for i in 0..2000usize {
                        let k = (i * 7 + t) % 64;
                        let got = cache
                            .get(k, || {
                                decodes.fetch_add(1, Ordering::Relaxed);
                                Ok((k, 10))
                            })
                            .unwrap();
                        assert_eq!(*got, k);
                    }
                });
            }
        });
        assert_eq!(decodes.load(Ordering::Relaxed), 64);
        let s = cache.stats();
        assert_eq!((s.misses, s.hits), (64, 8000 - 64));
    }
}
