//! [`ChunkCache`]: decoded chunks of a table, shared by every worker thread, bounded in bytes,
//! the least recently used dropped first.
//!
//! The shape of the shards' set of open shards (`shards/lru.rs`), with a bound in bytes
//! instead of a count, and hits counted: a chunk is decoded the first time a row of it is asked
//! for, by the first thread that asks (the others wait on its slot, so each chunk is decoded
//! once however many workers want it; a thread that would wait may decode another chunk it
//! was told will be needed instead, [`ChunkCache::get_or_help`]), and stays while the chunks
//! held fit in the byte limit.
//! Samples keep their chunk's buffers alive (they hold reference-counted views), so dropping a
//! chunk from the cache never invalidates a sample in flight.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, TryLockError};

use crate::error::Result;

/// What the cache of decoded chunks did, for `stats()`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ChunkCacheStats {
    /// Rows asked for whose chunk was held.
    pub hits: u64,
    /// Chunks decoded (each first use, and each use after an eviction).
    pub misses: u64,
    /// Of `misses`, the chunks decoded ahead of their use by a worker that would otherwise
    /// have waited for another worker's decode.
    pub decoded_ahead: u64,
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
    decoded_ahead: AtomicU64,
    /// The most bytes one chunk has taken: the guess of a chunk's size before decoding it.
    largest: AtomicU64,
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
            decoded_ahead: AtomicU64::new(0),
            largest: AtomicU64::new(0),
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
        self.get_or_help(k, decode, || false)
    }

    /// Chunk `k`, as [`get`](Self::get); but while another thread decodes it, this one calls
    /// `help` (which may decode another chunk with [`decode_ahead`](Self::decode_ahead))
    /// instead of waiting, until `help` says it found nothing to do (`false`), and only then
    /// waits. So threads that want a chunk being decoded decode other chunks meanwhile.
    pub(crate) fn get_or_help(
        &self,
        k: usize,
        decode: impl FnOnce() -> Result<(T, u64)>,
        mut help: impl FnMut() -> bool,
    ) -> Result<Arc<T>> {
        let slot = &self.slots[k];
        if let Some(c) = self.held(slot) {
            return Ok(c);
        }
        let (made, bytes) = {
            let mut guard = loop {
                match slot.chunk.try_write() {
                    Ok(g) => break g,
                    Err(TryLockError::Poisoned(e)) => break e.into_inner(),
                    Err(TryLockError::WouldBlock) => {
                        if !help() {
                            break slot.chunk.write().unwrap_or_else(|e| e.into_inner());
                        }
                        if let Some(c) = self.held(slot) {
                            return Ok(c);
                        }
                    }
                }
            };
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
        self.admit(k, bytes);
        Ok(made)
    }

    /// Decodes chunk `k` with `decode` ahead of its use, unless it is held, another thread is
    /// decoding it, or the limit cannot hold `keep` chunks beside it (the chunks in use: the
    /// largest chunk decoded so far is the guess of a chunk's size). Within the limit, as any
    /// decode, it drops the least recently used chunks, but only those no row was read from
    /// during the last `keep` decodes (a window the workers have passed): it never drops a
    /// chunk in use to make room. Returns whether it decoded; a failed decode holds
    /// nothing (the thread that needs the chunk decodes it again and meets the error).
    pub(crate) fn decode_ahead(
        &self,
        k: usize,
        keep: u64,
        decode: impl FnOnce() -> Result<(T, u64)>,
    ) -> bool {
        let Some(slot) = self.slots.get(k) else {
            return false;
        };
        let largest = self.largest.load(Ordering::Relaxed);
        if keep.saturating_add(1).saturating_mul(largest) > self.limit {
            return false;
        }
        {
            // Room is made only of chunks no row has been read from during the last `keep`
            // decodes (the clock moves by 2 a decode): a chunk read since is in use, and
            // dropping it would only have it decoded again.
            let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
            if held.bytes + largest > self.limit {
                let now = self.clock.load(Ordering::Relaxed);
                let oldest = held
                    .chunks
                    .iter()
                    .map(|&(v, _)| self.slots[v].used.load(Ordering::Relaxed))
                    .min()
                    .unwrap_or(now);
                if now.saturating_sub(oldest) <= 2 * keep {
                    return false;
                }
            }
        }
        let bytes = {
            let Ok(mut guard) = slot.chunk.try_write() else {
                return false;
            };
            if guard.is_some() {
                return false;
            }
            let Ok((chunk, bytes)) = decode() else {
                return false;
            };
            *guard = Some(Arc::new(chunk));
            bytes
        };
        self.decoded_ahead.fetch_add(1, Ordering::Relaxed);
        self.admit(k, bytes);
        true
    }

    /// Whether chunk `k` is held now.
    pub(crate) fn is_held(&self, k: usize) -> bool {
        self.slots
            .get(k)
            .and_then(|s| s.chunk.try_read().ok().map(|c| c.is_some()))
            .unwrap_or(false)
    }

    /// Chunk `slot`'s chunk if it is held, counted as a hit; `None` also while a thread
    /// decodes it (this never waits).
    fn held(&self, slot: &Slot<T>) -> Option<Arc<T>> {
        let c = match slot.chunk.try_read() {
            Ok(c) => Arc::clone(c.as_ref()?),
            Err(TryLockError::Poisoned(e)) => Arc::clone(e.into_inner().as_ref()?),
            Err(TryLockError::WouldBlock) => return None,
        };
        self.touch(slot);
        self.hits.fetch_add(1, Ordering::Relaxed);
        Some(c)
    }

    /// Counts chunk `k`, just decoded (`bytes`), among those held, and drops the least
    /// recently used others while the chunks held exceed the limit.
    fn admit(&self, k: usize, bytes: u64) {
        let slot = &self.slots[k];
        self.largest.fetch_max(bytes, Ordering::Relaxed);
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
    }

    /// The counts so far.
    pub(crate) fn stats(&self) -> ChunkCacheStats {
        let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        ChunkCacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            decoded_ahead: self.decoded_ahead.load(Ordering::Relaxed),
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

    #[test]
    fn a_thread_that_would_wait_decodes_other_chunks_meanwhile() {
        let cache = ChunkCache::<usize>::new(4, 1000);
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let mut decoded_meanwhile = Vec::new();
        std::thread::scope(|s| {
            let cache = &cache;
            s.spawn(move || {
                cache
                    .get(0, || {
                        started_tx.send(()).unwrap();
                        release_rx.recv().unwrap();
                        Ok((0, 10))
                    })
                    .unwrap();
            });
            started_rx.recv().unwrap();
            // Chunk 0 is being decoded by the other thread (until released): this one
            // decodes 1 and 2 meanwhile, then, with nothing left to do, waits for 0.
            let mut ahead = vec![2usize, 1];
            let got = cache
                .get_or_help(
                    0,
                    || panic!("0 is the other thread's to decode"),
                    || match ahead.pop() {
                        Some(k) => {
                            assert!(cache.decode_ahead(k, 1, || Ok((k, 10))));
                            decoded_meanwhile.push(k);
                            true
                        }
                        None => {
                            release_tx.send(()).unwrap();
                            false
                        }
                    },
                )
                .unwrap();
            assert_eq!(*got, 0);
        });
        assert_eq!(decoded_meanwhile, [1, 2]);
        cache.get(1, || panic!("1 was decoded ahead")).unwrap();
        cache.get(2, || panic!("2 was decoded ahead")).unwrap();
        let s = cache.stats();
        assert_eq!(
            (s.misses, s.decoded_ahead, s.chunks, s.bytes),
            (3, 2, 3, 30)
        );
    }

    #[test]
    fn decoding_ahead_keeps_the_chunks_in_use_and_never_decodes_twice() {
        let cache = ChunkCache::<usize>::new(8, 30);
        cache.get(0, || Ok((0, 10))).unwrap();
        assert!(
            !cache.decode_ahead(1, 3, || panic!("3 chunks of 10 in use leave no room")),
            "a limit of 30"
        );
        assert!(cache.decode_ahead(1, 2, || Ok((1, 10))));
        assert!(!cache.decode_ahead(1, 2, || panic!("1 is held")));
        cache.get(2, || Ok((2, 10))).unwrap();
        cache.get(0, || panic!("0 is held")).unwrap();
        // Full, and every chunk held was read or decoded during the last 2 decodes: none is
        // dropped for a chunk ahead.
        assert!(!cache.decode_ahead(3, 2, || panic!("0, 1 and 2 are in use")));
        // Decodes on demand drop 1, 2 and 0; 4 was decoded 2 decodes ago and not read since.
        for k in 4..7 {
            cache.get(k, || Ok((k, 10))).unwrap();
        }
        assert!(cache.decode_ahead(3, 2, || Ok((3, 10))));
        let s = cache.stats();
        assert_eq!(
            (s.evictions, s.chunks, s.bytes, s.decoded_ahead),
            (4, 3, 30, 2)
        );
        assert!(!cache.is_held(4) && cache.is_held(5) && cache.is_held(6) && cache.is_held(3));
        // A failed decode ahead holds nothing: the thread that needs it meets the error.
        let cache = ChunkCache::<usize>::new(2, 100);
        assert!(!cache.decode_ahead(1, 1, || Err(crate::error::Error::user("bad page"))));
        assert!(!cache.is_held(1));
        assert!(
            cache
                .get(1, || Err(crate::error::Error::user("bad page")))
                .is_err()
        );
    }
}
