//! A timeline of the loader's work, written in the Chrome trace-event format that Perfetto
//! (<https://ui.perfetto.dev>) and `chrome://tracing` open.
//!
//! A [`Trace`] is given to loaders ([`LoaderBuilder::trace`](crate::LoaderBuilder::trace)); each
//! loader is a process of the timeline ("gpufeed loader 1") with a track per thread:
//!
//! | track | spans (each with its batch's epoch and number) |
//! |---|---|
//! | `worker N` | `batch` (a batch made whole) or `part` (one part of a batch made in parts), and inside it `buffer` (a batch buffer from the pool, waiting on the budget included), `fetch` and `transform` (the samples' `Dataset::get` and transform time), `collate` (the batch hook, hand-on); `warm` (buffers made ahead); `allocate` (a new pool block) |
//! | `consumer` | `waiting` (inside `next`, for the next batch), `holding` (from a batch's delivery to the next call), `epoch N` marks |
//! | `copy thread` (GPU path) | `waiting` for the host batch, `enqueue` (device buffer, events, the copy call), `blocked` (on the consumer's full queue), `allocate` |
//! | `copy stream` (GPU path) | `H2D`: each batch's copy on the device, from its CUDA events |
//!
//! A part's samples are fetched and transformed one after the other, sample by sample; a span
//! per sample would cost more than a trace may (small rows run at a million samples a second),
//! so each batch or part shows its samples' fetch time, then their transform time, summed, as
//! two spans inside it (`args.samples` says how many). Every other span is measured as it
//! happens.
//!
//! Recording costs a branch per batch when no trace is given, and a few tens of nanoseconds per
//! span when one is (each track keeps its own events; `benches/RESULTS.md` has the figures). A
//! trace keeps at most [`Trace::with_capacity`] events (default [`DEFAULT_CAPACITY`]); later
//! ones are counted, and the file says how many were dropped.
//!
//! This module sits at the bottom of the library with `memory/`, beside it: every layer that
//! records (the pool, the workers, the copy thread) imports it, and it imports only `error`.

mod json;

use std::cell::RefCell;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::Result;

/// Events a [`Trace`] keeps by default: about 80 MiB at most, some minutes of a fast run of
/// small batches, hours of large ones.
pub const DEFAULT_CAPACITY: usize = 1 << 20;

/// Events a track takes from the trace's room at a time (one shared count per this many).
const CHUNK: usize = 1024;

/// A timeline shared by the loaders it is given to; cheap to clone (one `Arc`).
///
/// ```
/// # fn main() -> gpufeed::Result<()> {
/// # let dir = tempfile::tempdir().map_err(gpufeed::Error::user)?;
/// # let x = dir.path().join("x.npy");
/// # let mut b = gpufeed::source::npy_header(gpufeed::DType::U32, &[64])?;
/// # b.extend((0..64u32).flat_map(|i| i.to_le_bytes()));
/// # std::fs::write(&x, b).map_err(gpufeed::Error::user)?;
/// # let dataset = gpufeed::source::Zip::npy([("x", &x)])?;
/// use gpufeed::trace::Trace;
/// use gpufeed::Loader;
///
/// let trace = Trace::new();
/// let loader = Loader::builder(dataset).batch_size(16).trace(&trace).build()?;
/// for batch in loader {
///     batch?;
/// }
/// trace.write(dir.path().join("loader.trace.json"))?; // open it in ui.perfetto.dev
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Trace {
    inner: Arc<Inner>,
}

struct Inner {
    /// Time zero of the timeline.
    origin: Instant,
    tracks: Mutex<Vec<Arc<TrackData>>>,
    /// Events that may still be taken (in chunks) by tracks.
    room: AtomicUsize,
    /// Events not kept for want of room.
    dropped: AtomicU64,
    /// The last process (loader) number given out.
    groups: AtomicU32,
    /// Group names, by number (1-based).
    group_names: Mutex<Vec<String>>,
}

impl std::fmt::Debug for Trace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trace")
            .field("tracks", &self.inner.lock_tracks().len())
            .field("dropped", &self.dropped())
            .finish()
    }
}

impl Default for Trace {
    fn default() -> Self {
        Trace::new()
    }
}

impl Trace {
    /// An empty timeline, keeping up to [`DEFAULT_CAPACITY`] events; its time zero is now.
    pub fn new() -> Trace {
        Trace::with_capacity(DEFAULT_CAPACITY)
    }

    /// An empty timeline that keeps up to `events` events.
    pub fn with_capacity(events: usize) -> Trace {
        Trace {
            inner: Arc::new(Inner {
                origin: Instant::now(),
                tracks: Mutex::new(Vec::new()),
                room: AtomicUsize::new(events),
                dropped: AtomicU64::new(0),
                groups: AtomicU32::new(0),
                group_names: Mutex::new(Vec::new()),
            }),
        }
    }

    /// Events recorded and kept so far.
    pub fn events(&self) -> usize {
        self.inner
            .lock_tracks()
            .iter()
            .map(|t| t.lock_events().len())
            .sum()
    }

    /// Events not kept because the trace was full.
    pub fn dropped(&self) -> u64 {
        self.inner.dropped.load(Ordering::Relaxed)
    }

    /// Writes the timeline so far as Chrome trace-event JSON (`{"traceEvents": [...]}`).
    pub fn write_to(&self, out: impl std::io::Write) -> std::io::Result<()> {
        let tracks: Vec<Arc<TrackData>> = self.inner.lock_tracks().clone();
        let groups = self
            .inner
            .group_names
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        json::write(out, &groups, &tracks, self.dropped())
    }

    /// Writes the timeline so far to the file `path`, replacing it: written to a temporary
    /// file beside it first, then renamed, so that `path` is never half written
    /// ([`write_replacing`](crate::temporary::write_replacing)). Refuses a path that exists
    /// and is not a regular file (a directory, a pipe, a device).
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        crate::temporary::write_replacing(path.as_ref(), "write the trace", |out| {
            self.write_to(out)
        })
    }

    /// A new process of the timeline (one loader), named `name` and a number; returns it.
    pub(crate) fn group(&self, name: &str) -> u32 {
        let number = self.inner.groups.fetch_add(1, Ordering::Relaxed) + 1;
        let mut names = self
            .inner
            .group_names
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        names.push(format!("{name} {number}"));
        number
    }

    /// A new track of process `group`, named `name`, shown in `sort` order.
    pub(crate) fn track(&self, group: u32, name: impl Into<String>, sort: i32) -> Track {
        let mut tracks = self.inner.lock_tracks();
        let data = Arc::new(TrackData {
            group,
            id: tracks.len() as u32 + 1,
            sort,
            name: Mutex::new(name.into()),
            events: Mutex::new(Vec::new()),
            taken: AtomicUsize::new(0),
        });
        tracks.push(Arc::clone(&data));
        Track {
            trace: Arc::clone(&self.inner),
            data,
        }
    }
}

impl Inner {
    fn lock_tracks(&self) -> MutexGuard<'_, Vec<Arc<TrackData>>> {
        self.tracks.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One thread's track (a worker, the consumer, the copy thread or the copy stream): its
/// events, in the order recorded.
pub(crate) struct TrackData {
    group: u32,
    id: u32,
    sort: i32,
    name: Mutex<String>,
    events: Mutex<Vec<Event>>,
    /// Events this track may still keep of the room it took.
    taken: AtomicUsize,
}

impl TrackData {
    fn lock_events(&self) -> MutexGuard<'_, Vec<Event>> {
        self.events.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One event: a span (`dur: Some`) or a mark in time.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Event {
    pub name: &'static str,
    /// Nanoseconds from the trace's time zero.
    pub start: u64,
    /// Nanoseconds; `None` for a mark.
    pub dur: Option<u64>,
    pub args: Args,
}

/// What an event is about; `NONE` where a figure does not apply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Args {
    pub epoch: u64,
    pub batch: u64,
    pub part: u32,
    pub parts: u32,
    pub samples: u32,
    pub bytes: u64,
}

/// The "does not apply" of [`Args`]' figures.
const NONE: u64 = u64::MAX;

impl Args {
    /// No figures.
    pub const EMPTY: Args = Args {
        epoch: NONE,
        batch: NONE,
        part: u32::MAX,
        parts: u32::MAX,
        samples: u32::MAX,
        bytes: NONE,
    };

    /// Batch `batch` of epoch `epoch`.
    pub fn batch(epoch: u64, batch: u64) -> Args {
        Args {
            epoch,
            batch,
            ..Args::EMPTY
        }
    }

    /// Epoch `epoch`.
    pub fn epoch(epoch: u64) -> Args {
        Args {
            epoch,
            ..Args::EMPTY
        }
    }

    /// `bytes` bytes.
    pub fn bytes(bytes: u64) -> Args {
        Args {
            bytes,
            ..Args::EMPTY
        }
    }

    /// The same, as part `part` of `parts`.
    pub fn part(self, part: usize, parts: usize) -> Args {
        Args {
            part: u32::try_from(part).unwrap_or(u32::MAX - 1),
            parts: u32::try_from(parts).unwrap_or(u32::MAX - 1),
            ..self
        }
    }

    /// The same, about `samples` samples.
    pub fn samples(self, samples: usize) -> Args {
        Args {
            samples: u32::try_from(samples).unwrap_or(u32::MAX - 1),
            ..self
        }
    }

    /// The same, with `bytes` bytes.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn with_bytes(self, bytes: u64) -> Args {
        Args { bytes, ..self }
    }
}

/// A handle on one track of a [`Trace`], held by the thread that records into it.
#[derive(Clone)]
pub(crate) struct Track {
    trace: Arc<Inner>,
    data: Arc<TrackData>,
}

impl Track {
    /// Nanoseconds from the trace's time zero to `at` (0 before it).
    pub fn ns(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.trace.origin).as_nanos())
            .unwrap_or(u64::MAX)
    }

    /// A span from `start` to `end`.
    pub fn span(&self, name: &'static str, start: Instant, end: Instant, args: Args) {
        let start = self.ns(start);
        let end = self.ns(end).max(start);
        self.record(Event {
            name,
            start,
            dur: Some(end - start),
            args,
        });
    }

    /// A span from `start` lasting `dur`.
    pub fn span_for(&self, name: &'static str, start: Instant, dur: Duration, args: Args) {
        let start = self.ns(start);
        self.span_ns(
            name,
            start,
            u64::try_from(dur.as_nanos()).unwrap_or(0),
            args,
        );
    }

    /// A span `start` nanoseconds from the time zero, lasting `dur` nanoseconds.
    pub fn span_ns(&self, name: &'static str, start: u64, dur: u64, args: Args) {
        self.record(Event {
            name,
            start,
            dur: Some(dur),
            args,
        });
    }

    /// A mark at `at`, drawn across every track (an epoch's start).
    pub fn mark(&self, name: &'static str, at: Instant, args: Args) {
        let start = self.ns(at);
        self.record(Event {
            name,
            start,
            dur: None,
            args,
        });
    }

    /// Renames the track (a loader's consumer track becomes the copy thread's when a device
    /// loader takes the loader over).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn rename(&self, name: impl Into<String>) {
        *self.data.name.lock().unwrap_or_else(|p| p.into_inner()) = name.into();
    }

    /// Makes this the track of the calling thread until the guard drops: what the layers below
    /// record without a track of their own (a pool's allocations) goes to it.
    pub fn enter(&self) -> Entered {
        let previous = CURRENT.with(|c| c.replace(Some(self.clone())));
        Entered { previous }
    }

    fn record(&self, event: Event) {
        if !self.take_room() {
            self.trace.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.data.lock_events().push(event);
    }

    /// Takes room for one event: from this track's share, else a new chunk of the trace's.
    fn take_room(&self) -> bool {
        let taken = &self.data.taken;
        if taken.load(Ordering::Relaxed) > 0 {
            taken.fetch_sub(1, Ordering::Relaxed);
            return true;
        }
        let room = &self.trace.room;
        let got = room.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| {
            (r > 0).then(|| r - r.min(CHUNK))
        });
        match got {
            Ok(before) => {
                taken.fetch_add(before.min(CHUNK) - 1, Ordering::Relaxed);
                true
            }
            Err(_) => false,
        }
    }
}

thread_local! {
    /// The track of the calling thread, while it has one ([`Track::enter`]).
    static CURRENT: RefCell<Option<Track>> = const { RefCell::new(None) };
}

/// Gives the calling thread back the track it had before [`Track::enter`].
pub(crate) struct Entered {
    previous: Option<Track>,
}

impl Drop for Entered {
    fn drop(&mut self) {
        let previous = self.previous.take();
        CURRENT.with(|c| *c.borrow_mut() = previous);
    }
}

/// Records a span from `start` lasting `dur` on the calling thread's track, if it has one
/// (see [`Track::enter`]); nothing otherwise.
pub(crate) fn span_here(name: &'static str, start: Instant, dur: Duration, args: Args) {
    CURRENT.with(|c| {
        if let Some(track) = c.borrow().as_ref() {
            track.span_for(name, start, dur, args);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::{Args, Trace};
    use std::time::{Duration, Instant};

    #[test]
    fn a_full_trace_keeps_its_first_events_and_counts_the_rest() {
        let trace = Trace::with_capacity(1500);
        let group = trace.group("loader");
        let (a, b) = (trace.track(group, "a", 0), trace.track(group, "b", 1));
        let t = Instant::now();
        for _ in 0..1000 {
            a.span_for("x", t, Duration::from_micros(1), Args::EMPTY);
            b.span_for("y", t, Duration::from_micros(1), Args::EMPTY);
        }
        // `a` took a chunk of 1,024 and used 1,000; `b` got the 476 left and dropped the rest.
        assert_eq!(trace.events(), 1476);
        assert_eq!(trace.dropped(), 524);
    }

    #[test]
    fn spans_recorded_on_a_thread_without_a_track_go_nowhere() {
        let trace = Trace::new();
        let track = trace.track(trace.group("loader"), "worker 0", 0);
        super::span_here("allocate", Instant::now(), Duration::ZERO, Args::bytes(1));
        assert_eq!(trace.events(), 0);
        {
            let _entered = track.enter();
            super::span_here("allocate", Instant::now(), Duration::ZERO, Args::bytes(1));
        }
        super::span_here("allocate", Instant::now(), Duration::ZERO, Args::bytes(1));
        assert_eq!(trace.events(), 1);
    }
}
