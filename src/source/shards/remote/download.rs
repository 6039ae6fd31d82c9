//! [`Download`]: one shard arriving into a temporary file of the cache, by parallel ranged
//! GETs; each range readable as soon as it has arrived, or, for a shard with a
//! [`ContentCheck`], only once the whole shard has passed it (fetched again, a bounded number
//! of times, when it does not); and [`with_retries`], the retry loop of the store's other
//! requests.

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use object_store::{GetOptions, GetRange};

use super::cache::FetchLock;
use super::check::{ContentCheck, Fetches, Verdict};
use super::{Counters, Inner, lock};
use crate::error::{Error, RemoteErrorKind, Result};
use crate::source::shards::ShardArrival;

/// Why a fetch failed, kept to answer every reader that waits on it.
#[derive(Clone, Debug)]
pub(crate) struct Failure {
    kind: RemoteErrorKind,
    what: String,
}

impl Failure {
    pub(crate) fn error(&self, url: &Path) -> Error {
        Error::Remote {
            shard: url.to_path_buf(),
            kind: self.kind,
            what: self.what.clone(),
        }
    }
}

/// How an `object_store` error is handled: given up at once (with its kind), or retried.
fn classify(e: &object_store::Error) -> Option<RemoteErrorKind> {
    let text = e.to_string();
    let has = |s: &str| text.contains(s);
    if has("NoSuchBucket") || has("bucket does not exist") || has("ContainerNotFound") {
        return Some(RemoteErrorKind::NoSuchBucket);
    }
    match e {
        object_store::Error::NotFound { .. } => Some(RemoteErrorKind::NotFound),
        object_store::Error::PermissionDenied { .. }
        | object_store::Error::Unauthenticated { .. } => Some(RemoteErrorKind::AccessDenied),
        object_store::Error::Precondition { .. } => Some(RemoteErrorKind::Checksum),
        object_store::Error::NotSupported { .. }
        | object_store::Error::NotImplemented { .. }
        | object_store::Error::UnknownConfigurationKey { .. }
        | object_store::Error::InvalidPath { .. } => Some(RemoteErrorKind::Config),
        _ if has("InvalidAccessKeyId") || has("SignatureDoesNotMatch") || has("AccessDenied") => {
            Some(RemoteErrorKind::AccessDenied)
        }
        _ => None,
    }
}

/// The wait before retry `attempt` (1, 2, ...): `backoff` doubled each time, at most
/// `max_backoff`, less up to a quarter at random so that clients do not retry in step.
fn backoff(inner: &Inner, attempt: u32) -> Duration {
    let base =
        inner.options.backoff.as_secs_f64() * 2f64.powi(attempt.saturating_sub(1).min(30) as i32);
    let capped = base.min(inner.options.max_backoff.as_secs_f64());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::from(d.subsec_nanos()))
        ^ u64::from(attempt).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let jitter =
        1.0 - 0.25 * ((xxhash_rust::xxh3::xxh3_64(&nanos.to_le_bytes()) % 1000) as f64 / 1000.0);
    Duration::from_secs_f64(capped * jitter)
}

/// Runs the request `make` builds, sending it again after a backoff on a retryable failure
/// (at most `retries` times, each counted), within the request time-out each time.
pub(crate) async fn with_retries<T, F, Fut>(inner: &Inner, url: &Path, mut make: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = object_store::Result<T>>,
{
    let mut attempt = 0u32;
    loop {
        Counters::add(&inner.stats.requests, 1);
        let outcome = {
            let _permit = inner.requests.acquire().await;
            tokio::time::timeout(inner.options.request_timeout, make()).await
        };
        let why = match outcome {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(e)) => {
                if let Some(kind) = classify(&e) {
                    return Err(Error::Remote {
                        shard: url.to_path_buf(),
                        kind,
                        what: e.to_string(),
                    });
                }
                e.to_string()
            }
            Err(_) => format!("no answer within {:?}", inner.options.request_timeout),
        };
        attempt += 1;
        if attempt > inner.options.retries {
            return Err(Error::Remote {
                shard: url.to_path_buf(),
                kind: RemoteErrorKind::Unavailable,
                what: format!("gave up after {} retries: {why}", inner.options.retries),
            });
        }
        Counters::add(&inner.stats.retries, 1);
        tokio::time::sleep(backoff(inner, attempt)).await;
    }
}

struct State {
    /// The fetches of the whole shard that failed its check.
    fetches: Fetches,
    /// Bytes arrived from the start of each part (a part's bytes arrive in order).
    progress: Vec<u64>,
    /// Parts a fetch lane has taken.
    taken: Vec<bool>,
    /// The next part in order that no lane has taken.
    next: usize,
    /// Parts readers wait for, fetched before the rest.
    wanted: Vec<usize>,
    /// Parts whole.
    whole: usize,
    /// Readers waiting.
    waiters: usize,
    failed: Option<Failure>,
    done: bool,
}

/// One shard being fetched into the cache by this process.
pub(crate) struct Download {
    name: String,
    url: PathBuf,
    size: u64,
    part_bytes: u64,
    parts: usize,
    temp: PathBuf,
    final_path: PathBuf,
    file: File,
    bytes: Bytes,
    /// What the whole shard is checked against before any byte of it is read.
    check: Option<ContentCheck>,
    /// The object's ETag, sent as `If-Match` with every part's request: every part comes from
    /// the version of the object the fetch began with.
    if_match: Option<String>,
    state: Mutex<State>,
    /// `State::done`, for readers to see without the mutex once the shard is whole.
    whole: AtomicBool,
    arrived: Condvar,
    /// Lanes fetching parts now; and how many each fetch of the shard starts.
    lanes: AtomicUsize,
    lane_count: usize,
    cancelled: AtomicBool,
    prefetched: AtomicBool,
    lock: Mutex<Option<FetchLock>>,
    inner: std::sync::Weak<Inner>,
}

impl Download {
    /// Starts fetching shard `name` (`size` bytes) into a temporary file beside `final_path`,
    /// holding `lock` until it ends; the whole shard must pass `check` (if any) to be read and
    /// renamed into place.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn start(
        inner: &Arc<Inner>,
        name: &str,
        url: PathBuf,
        size: u64,
        final_path: PathBuf,
        check: Option<ContentCheck>,
        if_match: Option<String>,
        lock: FetchLock,
    ) -> Result<Arc<Download>> {
        let (file, temp) = inner.cache.temporary(&final_path)?;
        let full = |e: std::io::Error| {
            Counters::add(&inner.stats.cache_full, 1);
            Error::Remote {
                shard: url.clone(),
                kind: RemoteErrorKind::CacheFull,
                what: format!(
                    "cannot make a file of {size} bytes in the cache ({}): {e}",
                    temp.display()
                ),
            }
        };
        let made = file.set_len(size).map_err(full).and_then(|()| {
            if size == 0 {
                return Ok(Bytes::new());
            }
            // SAFETY: the mapping is read-only and shared. The file is this fetch's own
            // temporary (created exclusively), written only by its lanes through `pwrite`,
            // and a reader touches a range only after `wait_for` saw it arrive (the state's
            // mutex, or `whole`'s release and acquire, orders the write before the read); a
            // shard fetched again after failing its check was read by no one (its readers
            // wait for it whole and checked). It is never truncated: it is renamed whole, or
            // removed (the mapping keeps its pages).
            let map = unsafe { memmap2::Mmap::map(&file) }
                .map_err(|e| Error::io(&temp, "map cache file", e))?;
            Ok(Bytes::from_owner(map))
        });
        let bytes = match made {
            Ok(b) => b,
            Err(e) => {
                let _ = std::fs::remove_file(&temp);
                return Err(e);
            }
        };
        let part_bytes = inner.options.part_bytes;
        let parts = size.div_ceil(part_bytes) as usize;
        let lanes = inner.options.parallel_parts.min(parts).max(1);
        let d = Arc::new(Download {
            name: name.to_owned(),
            url,
            size,
            part_bytes,
            parts,
            temp,
            final_path,
            file,
            bytes,
            check,
            if_match,
            state: Mutex::new(State {
                fetches: Fetches::default(),
                progress: vec![0; parts],
                taken: vec![false; parts],
                next: 0,
                wanted: Vec::new(),
                whole: 0,
                waiters: 0,
                failed: None,
                done: false,
            }),
            whole: AtomicBool::new(false),
            arrived: Condvar::new(),
            lanes: AtomicUsize::new(0),
            lane_count: lanes,
            cancelled: AtomicBool::new(false),
            prefetched: AtomicBool::new(false),
            lock: Mutex::new(Some(lock)),
            inner: Arc::downgrade(inner),
        });
        d.spawn_lanes(inner);
        Ok(d)
    }

    /// Starts the lanes of one fetch of the whole shard (one, that fetches nothing, for an
    /// empty shard).
    fn spawn_lanes(self: &Arc<Self>, inner: &Arc<Inner>) {
        self.lanes.store(self.lane_count, Ordering::Relaxed);
        for _ in 0..self.lane_count {
            let (d, inner) = (Arc::clone(self), Arc::clone(inner));
            inner.handle.clone().spawn(async move {
                d.lane(&inner).await;
                d.lane_done(&inner);
            });
        }
    }

    /// The shard's buffer (a mapping of the temporary file, of its final size).
    pub(crate) fn bytes(&self) -> Bytes {
        self.bytes.clone()
    }

    /// Where the whole shard will be.
    pub(crate) fn final_path(&self) -> &Path {
        &self.final_path
    }

    pub(crate) fn failed(&self) -> bool {
        lock(&self.state).failed.is_some()
    }

    pub(crate) fn is_done(&self) -> bool {
        let s = lock(&self.state);
        s.done || s.failed.is_some()
    }

    /// Marks the fetch as the prefetcher's; false if it already was.
    pub(crate) fn mark_prefetched(&self) -> bool {
        !self.prefetched.swap(true, Ordering::Relaxed)
    }

    pub(crate) fn prefetched(&self) -> bool {
        self.prefetched.load(Ordering::Relaxed)
    }

    /// Stops the lanes at their next part.
    pub(crate) fn cancel(&self) {
        self.cancelled.store(true, Ordering::Relaxed);
        self.fail(RemoteErrorKind::Unavailable, "the store was closed".into());
    }

    /// Removes the temporary file (after a failure, or when the store closes).
    pub(crate) fn remove_temporary(&self) {
        let _ = std::fs::remove_file(&self.temp);
    }

    /// Fails the fetch; a shard refused for its bytes (a failed check, another size or
    /// version than expected) is recorded as refused by the store first, so that whoever sees
    /// this fetch failed finds why without fetching the shard again.
    fn fail(&self, kind: RemoteErrorKind, what: String) {
        let failure = Failure { kind, what };
        if matches!(
            kind,
            RemoteErrorKind::Checksum | RemoteErrorKind::SizeMismatch
        ) && let Some(inner) = self.inner.upgrade()
        {
            inner.refuse(&self.name, &failure);
        }
        let mut s = lock(&self.state);
        if s.failed.is_none() && !s.done {
            s.failed = Some(failure);
        }
        drop(s);
        self.arrived.notify_all();
    }

    /// The next part for a lane: one a reader waits for, else the next in order.
    fn take(&self) -> Option<usize> {
        let mut s = lock(&self.state);
        if s.failed.is_some() || self.cancelled.load(Ordering::Relaxed) {
            return None;
        }
        while let Some(p) = s.wanted.pop() {
            if !s.taken[p] {
                s.taken[p] = true;
                return Some(p);
            }
        }
        while s.next < self.parts && s.taken[s.next] {
            s.next += 1;
        }
        if s.next < self.parts {
            let p = s.next;
            s.taken[p] = true;
            s.next += 1;
            return Some(p);
        }
        None
    }

    fn part_range(&self, p: usize) -> Range<u64> {
        let start = p as u64 * self.part_bytes;
        start..(start + self.part_bytes).min(self.size)
    }

    /// A fetch lane: takes parts until none is left.
    async fn lane(&self, inner: &Inner) {
        while let Some(p) = self.take() {
            if let Err(f) = self.fetch_part(inner, p).await {
                self.fail(f.kind, f.what);
                return;
            }
        }
    }

    /// Fetches part `p`, writing each piece of body where it goes as it comes; a request that
    /// fails part-way is sent again for the rest of the part.
    async fn fetch_part(&self, inner: &Inner, p: usize) -> std::result::Result<(), Failure> {
        use futures_util::StreamExt;
        let range = self.part_range(p);
        let key = inner.key_of(&self.name);
        let mut attempt = 0u32;
        loop {
            let done = lock(&self.state).progress[p];
            let from = range.start + done;
            if from >= range.end {
                return Ok(());
            }
            if self.cancelled.load(Ordering::Relaxed) {
                return Err(Failure {
                    kind: RemoteErrorKind::Unavailable,
                    what: "the store was closed".into(),
                });
            }
            Counters::add(&inner.stats.requests, 1);
            let why: String = {
                let _permit = inner.requests.acquire().await;
                let options = GetOptions {
                    range: Some(GetRange::Bounded(from..range.end)),
                    if_match: self.if_match.clone(),
                    ..GetOptions::default()
                };
                let timeout = inner.options.request_timeout;
                match tokio::time::timeout(timeout, inner.store.get_opts(&key, options)).await {
                    Err(_) => format!("no answer within {timeout:?}"),
                    Ok(Err(object_store::Error::Precondition { .. })) => {
                        return Err(Failure {
                            kind: RemoteErrorKind::Checksum,
                            what: format!(
                                "the object changed while it was fetched: its ETag is no longer {} (open the data set again to read the new version)",
                                self.if_match.as_deref().unwrap_or("the one it had")
                            ),
                        });
                    }
                    Ok(Err(e)) => {
                        if let Some(kind) = classify(&e) {
                            return Err(Failure {
                                kind,
                                what: e.to_string(),
                            });
                        }
                        e.to_string()
                    }
                    Ok(Ok(got)) if got.meta.size != self.size => {
                        let said = if inner.expects(&self.name) {
                            "the index says"
                        } else {
                            "the store said when it was listed"
                        };
                        return Err(Failure {
                            kind: RemoteErrorKind::SizeMismatch,
                            what: format!(
                                "the store sent an object of {} bytes, {said} {}: it is not the object the data set describes (replaced since?)",
                                got.meta.size, self.size
                            ),
                        });
                    }
                    Ok(Ok(got)) if got.range.start != from => {
                        format!(
                            "asked for bytes from {from}, the answer starts at {}",
                            got.range.start
                        )
                    }
                    Ok(Ok(got)) => {
                        let mut stream = got.into_stream();
                        let mut at = from;
                        let mut why = None;
                        loop {
                            match tokio::time::timeout(timeout, stream.next()).await {
                                Err(_) => {
                                    why = Some(format!("the body stalled for {timeout:?}"));
                                    break;
                                }
                                Ok(None) => break,
                                Ok(Some(Err(e))) => {
                                    why = Some(e.to_string());
                                    break;
                                }
                                Ok(Some(Ok(chunk))) => {
                                    let take = (chunk.len() as u64).min(range.end - at) as usize;
                                    Counters::add(&inner.stats.bytes_fetched, chunk.len() as u64);
                                    if let Err(e) = self.file.write_all_at(&chunk[..take], at) {
                                        return Err(self.write_failure(inner, e));
                                    }
                                    at += take as u64;
                                    self.advance(p, at - range.start);
                                    if at >= range.end {
                                        break;
                                    }
                                }
                            }
                        }
                        if at >= range.end {
                            return Ok(());
                        }
                        why.unwrap_or_else(|| {
                            format!(
                                "the body ended at byte {at}, {} bytes short",
                                range.end - at
                            )
                        })
                    }
                }
            };
            attempt += 1;
            if attempt > inner.options.retries {
                return Err(Failure {
                    kind: RemoteErrorKind::Unavailable,
                    what: format!(
                        "bytes {}..{}: gave up after {} retries: {why}",
                        range.start, range.end, inner.options.retries
                    ),
                });
            }
            Counters::add(&inner.stats.retries, 1);
            tokio::time::sleep(backoff(inner, attempt)).await;
        }
    }

    fn write_failure(&self, inner: &Inner, e: std::io::Error) -> Failure {
        let full = matches!(
            e.raw_os_error(),
            Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::EFBIG)
        );
        if full {
            Counters::add(&inner.stats.cache_full, 1);
        }
        Failure {
            kind: if full {
                RemoteErrorKind::CacheFull
            } else {
                RemoteErrorKind::Unavailable
            },
            what: format!("writing into the cache ({}): {e}", self.temp.display()),
        }
    }

    /// Part `p` now has `got` bytes from its start.
    fn advance(&self, p: usize, got: u64) {
        let mut s = lock(&self.state);
        s.progress[p] = got;
        if got == self.part_range(p).end - self.part_range(p).start {
            s.whole += 1;
        }
        let notify = s.waiters > 0;
        drop(s);
        if notify {
            self.arrived.notify_all();
        }
    }

    /// A lane has ended; the last one hands the shard to [`finish`](Download::finish), off the
    /// runtime's threads (a check hashes the whole shard).
    fn lane_done(self: &Arc<Self>, inner: &Arc<Inner>) {
        if self.lanes.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let (d, inner) = (Arc::clone(self), Arc::clone(inner));
        inner
            .handle
            .clone()
            .spawn_blocking(move || d.finish(&inner));
    }

    /// Every lane of a fetch has ended: checks the whole shard and renames it into place, or
    /// fetches it again, or removes its temporary file and fails it (in that order: whoever
    /// is told of a failure found here finds no file of it); then releases its lock.
    fn finish(self: &Arc<Self>, inner: &Arc<Inner>) {
        let complete = {
            let s = lock(&self.state);
            s.failed.is_none() && s.whole == self.parts
        };
        let failure = if complete {
            match self.judge(inner) {
                Ok(None) => return self.fetch_again(inner),
                Ok(Some(checked)) => match self.rename() {
                    Ok(()) => {
                        if !checked {
                            Counters::add(&inner.stats.unverified, 1);
                        }
                        lock(&self.state).done = true;
                        self.whole.store(true, Ordering::Release);
                        self.arrived.notify_all();
                        None
                    }
                    Err(f) => Some(f),
                },
                Err(f) => Some(f),
            }
        } else if lock(&self.state).failed.is_none() {
            Some(Failure {
                kind: RemoteErrorKind::Unavailable,
                what: "the fetch stopped before the end".into(),
            })
        } else {
            None
        };
        if !lock(&self.state).done {
            self.remove_temporary();
        }
        if let Some(f) = failure {
            self.fail(f.kind, f.what);
        }
        // Other processes waiting on the lock see the whole file (or take over).
        lock(&self.lock).take();
        inner.finished(&self.name, self);
    }

    /// Checks the whole shard: `Some(true)` if it passed, `Some(false)` if it has no check (or
    /// its ETag turned out to be no hash of it), `None` to fetch it again. Failed checks are
    /// counted once judged: those of a shard taken or refused, not those of an ETag found to
    /// be no MD5.
    fn judge(&self, inner: &Inner) -> std::result::Result<Option<bool>, Failure> {
        let Some(check) = self.check else {
            return Ok(Some(false));
        };
        if matches!(check, ContentCheck::Md5Etag(_)) && !inner.etags_are_md5() {
            // Another object of the store showed that its ETags are no MD5.
            return Ok(Some(false));
        }
        let got = check.digest(&self.bytes);
        let mut s = lock(&self.state);
        let verdict = s.fetches.judge(&check, got, inner.options.checksum_retries);
        if verdict == Verdict::Again {
            return Ok(None);
        }
        Counters::add(&inner.stats.checksum_failures, s.fetches.failures(&verdict));
        match verdict {
            Verdict::Good => Ok(Some(true)),
            Verdict::NotAHash => {
                inner.etags_are_not_md5();
                Ok(Some(false))
            }
            Verdict::Refused { what } => Err(Failure {
                kind: RemoteErrorKind::Checksum,
                what,
            }),
            Verdict::Again => Ok(None),
        }
    }

    /// Fetches the whole shard again, into the same temporary file: nothing of it was read
    /// (its readers wait for it checked), so every part is written anew.
    fn fetch_again(self: &Arc<Self>, inner: &Arc<Inner>) {
        {
            let mut s = lock(&self.state);
            s.progress.fill(0);
            s.taken.fill(false);
            s.wanted.clear();
            s.next = 0;
            s.whole = 0;
        }
        self.spawn_lanes(inner);
    }

    fn rename(&self) -> std::result::Result<(), Failure> {
        std::fs::rename(&self.temp, &self.final_path).map_err(|e| Failure {
            kind: RemoteErrorKind::CacheFull,
            what: format!("rename {} into place: {e}", self.temp.display()),
        })
    }

    /// Waits until every byte has arrived and the shard is in the cache.
    pub(crate) fn wait_whole(&self) -> Result<()> {
        self.wait_until(|s| s.done, &[])
    }

    /// Waits until `ready`, asking for parts `want` first; a failure is seen before
    /// readiness, so that no range of a fetch that failed is read.
    fn wait_until(&self, ready: impl Fn(&State) -> bool, want: &[usize]) -> Result<()> {
        let mut s = lock(&self.state);
        if let Some(f) = &s.failed {
            return Err(f.error(&self.url));
        }
        if ready(&s) {
            return Ok(());
        }
        let started = Instant::now();
        for &p in want.iter().rev() {
            if !s.taken[p] {
                s.wanted.push(p);
            }
        }
        s.waiters += 1;
        let result = loop {
            if let Some(f) = &s.failed {
                break Err(f.error(&self.url));
            }
            if ready(&s) {
                break Ok(());
            }
            s = self
                .arrived
                .wait_timeout(s, Duration::from_millis(500))
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        };
        s.waiters -= 1;
        drop(s);
        if let Some(inner) = self.inner.upgrade() {
            Counters::add(
                &inner.stats.waited_nanos,
                started.elapsed().as_nanos() as u64,
            );
        }
        result
    }
}

impl ShardArrival for Download {
    /// Returns once `range` has arrived, or, for a shard with a check, once the whole shard
    /// has passed it; an error if the fetch failed (even where `range` had arrived).
    fn wait_for(&self, range: Range<u64>) -> Result<()> {
        if self.whole.load(Ordering::Acquire) {
            return Ok(());
        }
        if self.check.is_some() {
            let all: Vec<usize> = (0..self.parts).collect();
            return self.wait_until(|s| s.done, &all);
        }
        if range.start >= range.end {
            return Ok(());
        }
        let first = (range.start / self.part_bytes) as usize;
        let last = ((range.end - 1) / self.part_bytes) as usize;
        let covered = |s: &State| {
            s.done
                || (first..=last).all(|p| {
                    let r = self.part_range(p);
                    r.start + s.progress[p] >= range.end.min(r.end)
                })
        };
        let want: Vec<usize> = (first..=last).collect();
        self.wait_until(covered, &want)
    }
}
