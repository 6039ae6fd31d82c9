//! [`EventFence`]: a CUDA event that nobody outside gpufeed can record, as a pool [`Fence`].
//!
//! cudarc lets anyone who holds a `CudaEvent` record it again, and an event recorded again on an
//! idle stream reads as complete at once: a fence built on an event that someone else holds is
//! no fence. So an `EventFence` creates its own event, records it once, behind the work it
//! fences, and never hands the event out; cloning a fence shares the event, never the right to
//! record it. A device block remembers the streams that use it as [`StreamUse`]s.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, result, sys};

use super::cuda_err;
use crate::error::Result;
use crate::memory::Fence;

/// A fence over a CUDA event recorded on a stream: it completes once all the work enqueued on
/// that stream before [`EventFence::record`] has completed. Cheap to clone (shared).
#[derive(Clone)]
pub struct EventFence {
    event: Arc<CudaEvent>,
}

impl std::fmt::Debug for EventFence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventFence")
            .field("complete", &self.is_complete())
            .finish()
    }
}

impl EventFence {
    /// Records a new event on `stream` now, behind all the work enqueued on it so far. Does not
    /// wait.
    pub fn record(stream: &CudaStream) -> Result<EventFence> {
        EventFence::record_with(stream, None)
    }

    /// [`EventFence::record`] with timing enabled, for [`EventFence::event`]-based timing.
    pub(crate) fn record_timed(stream: &CudaStream) -> Result<EventFence> {
        EventFence::record_with(stream, Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
    }

    fn record_with(stream: &CudaStream, flags: Option<sys::CUevent_flags>) -> Result<EventFence> {
        let event = stream
            .record_event(flags)
            .map_err(cuda_err("record an event (cuEventRecord)"))?;
        Ok(EventFence {
            event: Arc::new(event),
        })
    }

    /// Records a new event on the raw stream `stream` now, behind all the work enqueued on it
    /// so far. Does not wait. The event's context must be current on the calling thread.
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of `ctx` (not destroyed), or the null or legacy default stream
    /// (`0`, `CU_STREAM_LEGACY`): see [`RawStream`](super::RawStream).
    pub(crate) unsafe fn record_raw(
        ctx: &Arc<CudaContext>,
        stream: sys::CUstream,
    ) -> Result<EventFence> {
        let event = ctx
            .new_event(None)
            .map_err(cuda_err("create an event (cuEventCreate)"))?;
        // SAFETY: the event was just made on `ctx`, which is current; the stream is live by the
        // caller's contract. A record only enqueues a marker: no memory is touched.
        unsafe { result::event::record(event.cu_event(), stream) }
            .map_err(cuda_err("record an event (cuEventRecord)"))?;
        Ok(EventFence {
            event: Arc::new(event),
        })
    }

    /// Makes `stream`'s later work wait for the fenced work, on the device
    /// (`cuStreamWaitEvent`); the host does not wait.
    pub(crate) fn order(&self, stream: &CudaStream) -> Result<()> {
        stream.wait(&self.event).map_err(cuda_err(
            "make a stream wait on an event (cuStreamWaitEvent)",
        ))
    }

    /// [`order`](Self::order) on a raw stream handle. The event's context must be current on
    /// the calling thread.
    ///
    /// # Safety
    ///
    /// `stream` is a live stream (not destroyed) of the event's context, or one of the default
    /// streams (`0`, `CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD`): see
    /// [`RawStream`](super::RawStream).
    pub(crate) unsafe fn order_raw(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: the event is live (we hold it); the stream is by the caller's contract. A
        // wait only enqueues a dependency: no memory is touched.
        unsafe {
            result::stream::wait_event(
                stream,
                self.event.cu_event(),
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(cuda_err(
            "make a stream wait on an event (cuStreamWaitEvent)",
        ))
    }

    /// The event, for timing and waits inside the crate. Never handed out: whoever holds a
    /// `CudaEvent` can record it again.
    pub(crate) fn event(&self) -> &CudaEvent {
        &self.event
    }
}

// SAFETY: the event was created by `record_with` and recorded there once, behind the work it
// fences; nobody can record it again (it is private to the fence and its clones, and nothing in
// the crate records it). `cuEventQuery` reports success only once all the work before the record
// has completed, and `cuEventSynchronize` returns success only then. Any other failure means the
// driver is shutting down or the context has a sticky error (the event handle is ours and alive),
// after which the context runs no more work, so the fenced work can no longer access the memory;
// `is_complete` still falls back on a synchronise before it says so.
unsafe impl Fence for EventFence {
    fn is_complete(&self) -> bool {
        let _ = self.event.context().bind_to_thread();
        match self.event.try_is_complete() {
            Ok(done) => done,
            Err(_) => {
                // Blocks only after a driver error.
                let _ = self.event.synchronize();
                true
            }
        }
    }

    fn wait(&self) {
        // `synchronize` makes the event's context current itself.
        let _ = self.event.synchronize();
    }
}

/// A fence recorded on a stream: how a device block remembers which streams use it. On a known
/// stream (a cudarc stream the block keeps alive), a later fence replaces an earlier one (it
/// completes after it, stream order). On a consumer's raw stream (`stream` is `None`) nothing is
/// replaced: a raw handle may name another stream once its stream is destroyed, so it is no key.
pub(crate) struct StreamUse {
    pub(crate) stream: Option<Arc<CudaStream>>,
    pub(crate) fence: EventFence,
}

// SAFETY: delegates to `EventFence`, which upholds the contract; the stream is only a key.
unsafe impl Fence for StreamUse {
    fn is_complete(&self) -> bool {
        self.fence.is_complete()
    }

    fn wait(&self) {
        self.fence.wait()
    }
}
