//! The batch budget: how many batch buffers may exist at once, in flight or in the caller's hands.
//!
//! A [`BatchPermit`] is taken from the [`BatchBudget`] when a batch is dispatched to a worker and
//! travels with it (in the task, then in the [`Batch`](super::Batch)) until the batch is dropped,
//! the shape of tokio's `OwnedSemaphorePermit`. Since the budget holds as many permits as the
//! pool's byte budget holds buffers, every batch in flight can get a buffer: workers never wait
//! for a buffer that only the caller could give back. The consumer takes permits without
//! blocking, and when the caller holds every one of them, it says so instead of waiting.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A fixed number of permits, each one batch buffer.
#[derive(Debug)]
pub(crate) struct BatchBudget {
    total: usize,
    free: AtomicUsize,
    held: AtomicUsize,
}

impl BatchBudget {
    /// A budget of `total` batches.
    pub(crate) fn new(total: usize) -> Arc<BatchBudget> {
        Arc::new(BatchBudget {
            total,
            free: AtomicUsize::new(total),
            held: AtomicUsize::new(0),
        })
    }

    /// Batches the budget allows.
    pub(crate) fn total(&self) -> usize {
        self.total
    }

    /// Batches delivered to the caller and not dropped yet.
    pub(crate) fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }

    /// A permit, if one is free; never waits.
    pub(crate) fn try_acquire(self: &Arc<Self>) -> Option<BatchPermit> {
        self.free
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .ok()?;
        Some(BatchPermit {
            budget: Arc::clone(self),
            held: false,
        })
    }
}

/// One batch's share of the budget; given back when dropped.
#[derive(Debug)]
pub(crate) struct BatchPermit {
    budget: Arc<BatchBudget>,
    held: bool,
}

impl BatchPermit {
    /// Counts the permit's batch as in the caller's hands until it drops.
    pub(crate) fn mark_held(&mut self) {
        if !self.held {
            self.held = true;
            self.budget.held.fetch_add(1, Ordering::AcqRel);
        }
    }
}

impl Drop for BatchPermit {
    fn drop(&mut self) {
        if self.held {
            self.budget.held.fetch_sub(1, Ordering::AcqRel);
        }
        self.budget.free.fetch_add(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permits_are_counted_and_given_back_on_drop() {
        let budget = BatchBudget::new(2);
        let mut a = budget.try_acquire().unwrap();
        let b = budget.try_acquire().unwrap();
        assert!(budget.try_acquire().is_none());
        a.mark_held();
        a.mark_held();
        assert_eq!(budget.held(), 1);
        drop(a);
        assert_eq!(budget.held(), 0);
        let c = budget.try_acquire().unwrap();
        assert!(budget.try_acquire().is_none());
        drop((b, c));
        assert_eq!(budget.free.load(Ordering::Acquire), budget.total());
    }
}
