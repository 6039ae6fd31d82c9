//! [`OpenShards`]: the shards a dataset has open now, at most a set number, shared by every
//! worker thread, the least recently used closed first.
//!
//! A shard is opened (mapped, its header or index read) the first time a sample of it is asked
//! for, and stays open until more than `limit` shards are open: then the one used least
//! recently is dropped from the set. Samples already handed out keep their shard's bytes alive
//! (they hold a reference-counted view), so a shard leaves memory when the set has dropped it
//! and its last sample is gone; the mappings alive are at most `limit` plus the samples in
//! flight. The kernel's map count and file descriptors are finite: `limit` keeps them bounded
//! whatever the number of shards.
//!
//! The hot path (a shard already open) takes one read lock on that shard's slot and clones an
//! `Arc`; recency is a tick that only changes when a shard is opened, so a hit writes nothing
//! shared unless the tick moved. Opening takes the slot's write lock, so concurrent requests
//! for one shard open it once; eviction takes one mutex, on misses only.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use crate::error::Result;

/// Counts of what the set of open shards did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpenShardStats {
    /// Shards opened (each first use, and each reuse after an eviction).
    pub opens: u64,
    /// Shards dropped from the set to stay within the limit.
    pub evictions: u64,
    /// Shards in the set now.
    pub open_now: usize,
    /// The most shards the set holds.
    pub limit: usize,
}

struct Slot<T> {
    shard: RwLock<Option<Arc<T>>>,
    used: AtomicU64,
}

/// At most `limit` open shards of type `T` (one slot per shard of the dataset).
pub(crate) struct OpenShards<T> {
    slots: Vec<Slot<T>>,
    limit: usize,
    clock: AtomicU64,
    open: Mutex<Vec<usize>>,
    opens: AtomicU64,
    evictions: AtomicU64,
}

impl<T> OpenShards<T> {
    /// A set for `shards` shards, holding at most `limit` (at least 1) open at once.
    pub(crate) fn new(shards: usize, limit: usize) -> OpenShards<T> {
        OpenShards {
            slots: (0..shards)
                .map(|_| Slot {
                    shard: RwLock::new(None),
                    used: AtomicU64::new(0),
                })
                .collect(),
            limit: limit.max(1),
            clock: AtomicU64::new(1),
            open: Mutex::new(Vec::new()),
            opens: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
        }
    }

    fn touch(&self, slot: &Slot<T>) {
        let now = self.clock.load(Ordering::Relaxed);
        if slot.used.load(Ordering::Relaxed) != now {
            slot.used.store(now, Ordering::Relaxed);
        }
    }

    /// Shard `k`, opened by `open` unless it is open already. `k` must be a shard number.
    pub(crate) fn get_or_open(&self, k: usize, open: impl FnOnce() -> Result<T>) -> Result<Arc<T>> {
        let slot = &self.slots[k];
        if let Some(shard) = slot
            .shard
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            self.touch(slot);
            return Ok(Arc::clone(shard));
        }
        let opened = {
            let mut guard = slot.shard.write().unwrap_or_else(|e| e.into_inner());
            if let Some(shard) = guard.as_ref() {
                self.touch(slot);
                return Ok(Arc::clone(shard));
            }
            let shard = Arc::new(open()?);
            *guard = Some(Arc::clone(&shard));
            shard
        };
        // The new shard gets a tick of its own; hits from now on get a later one, so a shard
        // used after this open ranks above it.
        let tick = self.clock.fetch_add(2, Ordering::Relaxed) + 1;
        slot.used.store(tick, Ordering::Relaxed);
        self.opens.fetch_add(1, Ordering::Relaxed);
        let mut victims = Vec::new();
        {
            let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
            open.push(k);
            while open.len() > self.limit {
                let Some((pos, _)) = open
                    .iter()
                    .enumerate()
                    .filter(|&(_, &v)| v != k)
                    .min_by_key(|&(_, &v)| self.slots[v].used.load(Ordering::Relaxed))
                else {
                    break;
                };
                let victim = open.swap_remove(pos);
                // Lock order: a slot's lock is never held while this mutex is taken, so
                // taking a slot's lock under the mutex cannot deadlock.
                let taken = self.slots[victim]
                    .shard
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .take();
                victims.push(taken);
                self.evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
        // Unmapping happens here, outside the mutex.
        drop(victims);
        Ok(opened)
    }

    /// Closes shard `k` if `shard` is what its slot holds (not a later open of it): for a
    /// shard whose bytes failed, so that its next use opens it afresh. Not an eviction.
    pub(crate) fn close(&self, k: usize, shard: &Arc<T>) {
        // Lock order as in `get_or_open`'s eviction: the mutex, then the slot.
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let taken = {
            let mut slot = self.slots[k]
                .shard
                .write()
                .unwrap_or_else(|e| e.into_inner());
            match slot.as_ref() {
                Some(s) if Arc::ptr_eq(s, shard) => slot.take(),
                _ => None,
            }
        };
        if taken.is_some()
            && let Some(pos) = open.iter().position(|&v| v == k)
        {
            open.swap_remove(pos);
        }
        drop(open);
        // Unmapped (if this was the last reference) outside the mutex.
        drop(taken);
    }

    /// The shards open now, by shard number, lowest first. Shards being opened or evicted while
    /// this runs may be in it or not.
    pub(crate) fn open_now(&self) -> Vec<Arc<T>> {
        // The numbers first, under the mutex; then each slot, with the mutex released (a
        // slot's lock may be held for a whole open, which must not stall the mutex).
        let mut numbers = self.open.lock().unwrap_or_else(|e| e.into_inner()).clone();
        numbers.sort_unstable();
        numbers
            .into_iter()
            .filter_map(|k| {
                self.slots[k]
                    .shard
                    .read()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone()
            })
            .collect()
    }

    /// The counts so far.
    pub(crate) fn stats(&self) -> OpenShardStats {
        OpenShardStats {
            opens: self.opens.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            open_now: self.open.lock().unwrap_or_else(|e| e.into_inner()).len(),
            limit: self.limit,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn holds_at_most_limit_and_evicts_the_least_recently_used() {
        let set = OpenShards::<usize>::new(10, 3);
        for k in 0..3 {
            assert_eq!(*set.get_or_open(k, || Ok(k)).unwrap(), k);
        }
        // Use 0 again: 1 becomes the least recently used.
        set.get_or_open(0, || panic!("0 is open")).unwrap();
        set.get_or_open(3, || Ok(3)).unwrap();
        let s = set.stats();
        assert_eq!((s.opens, s.evictions, s.open_now), (4, 1, 3));
        let reopened = AtomicUsize::new(0);
        set.get_or_open(1, || {
            reopened.fetch_add(1, Ordering::Relaxed);
            Ok(1)
        })
        .unwrap();
        assert_eq!(reopened.load(Ordering::Relaxed), 1, "1 was evicted");
        set.get_or_open(0, || panic!("0 stayed open")).unwrap();
        set.get_or_open(3, || panic!("3 stayed open")).unwrap();
    }

    #[test]
    fn open_now_lists_the_open_shards_in_shard_order() {
        let set = OpenShards::<usize>::new(10, 3);
        assert!(set.open_now().is_empty());
        for k in [7, 2, 5, 9] {
            set.get_or_open(k, || Ok(k)).unwrap();
        }
        // 7 was the least recently used when 9 came in.
        let open: Vec<usize> = set.open_now().iter().map(|s| **s).collect();
        assert_eq!(open, [2, 5, 9]);
    }

    #[test]
    fn a_closed_shard_is_opened_again_and_a_stale_close_changes_nothing() {
        let set = OpenShards::<u8>::new(3, 2);
        let first = set.get_or_open(1, || Ok(1)).unwrap();
        set.close(1, &first);
        assert_eq!(set.stats().open_now, 0);
        let again = set.get_or_open(1, || Ok(2)).unwrap();
        assert_eq!(*again, 2, "opened afresh");
        // A close for the open before: the one open now stays.
        set.close(1, &first);
        assert_eq!(*set.get_or_open(1, || panic!("still open")).unwrap(), 2);
        let s = set.stats();
        assert_eq!((s.opens, s.evictions, s.open_now), (2, 0, 1));
    }

    #[test]
    fn a_failed_open_leaves_the_slot_empty() {
        let set = OpenShards::<u8>::new(2, 1);
        assert!(
            set.get_or_open(0, || Err(crate::error::Error::user("no")))
                .is_err()
        );
        assert_eq!(*set.get_or_open(0, || Ok(7)).unwrap(), 7);
        assert_eq!(set.stats().opens, 1);
    }

    #[test]
    fn threads_open_each_shard_once_and_stay_within_the_limit() {
        let set = OpenShards::<usize>::new(64, 8);
        let opens = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for t in 0..4 {
                let (set, opens) = (&set, &opens);
                s.spawn(move || {
                    for i in 0..2000usize {
                        // Walk the shards in order, each thread a little apart: a window.
                        let k = ((i + t * 3) / 50) % 64;
                        let got = set
                            .get_or_open(k, || {
                                opens.fetch_add(1, Ordering::Relaxed);
                                Ok(k)
                            })
                            .unwrap();
                        assert_eq!(*got, k);
                    }
                });
            }
        });
        let s = set.stats();
        assert!(s.open_now <= 8);
        assert_eq!(s.opens as usize, opens.load(Ordering::Relaxed));
        assert_eq!(s.opens - s.evictions, s.open_now as u64);
    }
}
