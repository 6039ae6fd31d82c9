//! The copy stage: [`DeviceLoader`] turns a [`Loader`]'s host batches into [`DeviceBatch`]es.
//!
//! A copy thread owns the loader. For each host batch it takes a buffer from a [`DevicePool`],
//! enqueues on the device's copy stream one `cuMemcpyHtoDAsync` of the whole batch buffer (every
//! field lives in it, at [`BatchLayout::field_offset`](crate::layout::BatchLayout::field_offset)),
//! then the optional conversion kernels, and records fences: the host buffer is released behind
//! the copy's (so that the pinned buffer returns to its pool only once the copy has read it),
//! the device buffer behind the batch's `ready` fence (after the conversions). The device batch
//! goes to the consumer through a bounded channel of `depth` batches: copies of the next batches
//! are in flight while the consumer computes on this one. Nothing on this path waits for the
//! device. If enqueueing fails half way, the copy thread synchronises the copy stream before it
//! lets go of either buffer.
//!
//! The rule for device memory that this implements is in the [`cuda`](crate::cuda) module's docs.
//!
//! Optionally each device batch also carries the padding mask and the sample indices as fields
//! of its own ([`DeviceLoaderOptions::mask`], [`DeviceLoaderOptions::indices`]): the copy thread
//! writes them into a small pinned staging buffer and copies them with the batch.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use cudarc::driver::{CudaEvent, CudaStream, result, sys};
use serde::Serialize;

use super::batch::FieldSpec;
use super::cuda_err;
use super::device::ContextScope;
use super::fence::EventFence;
use super::{Convert, Converter, Device, DeviceBatch, DeviceBuffer, DevicePool, PinnedBacking};
use crate::error::{Error, Result};
use crate::format::DType;
use crate::layout::{FIELD_ALIGN, OutputField};
use crate::loader::{
    Batch, BatchStream, Delivered, Loader, LoaderBuilder, LoaderState, LoaderStats, Next, Position,
    deadline, next_blocking,
};
use crate::memory::{HostPool, PoolStats, human_bytes, human_rate};
use crate::sampler::OrderSpec;

/// Bytes of device batches the default depth aims to keep copied ahead.
const DEPTH_BYTES: usize = 32 << 20;

/// The copy thread refreshes the loader figures it shares every this many batches (and at
/// each epoch's end): reading them walks the pool's pending fences.
const STATS_EVERY: u64 = 64;

/// Timing events kept for reuse (creating an event is a driver call per batch otherwise).
const SPARE_EVENTS: usize = 64;

/// Settings of a [`DeviceLoader`].
#[derive(Clone, Debug, Default)]
pub struct DeviceLoaderOptions {
    /// Device batches copied ahead of the consumer (the channel's capacity). One more can be
    /// in the copy thread's hands. Default (`None`): about 32 MiB of batches, 2 to 16, so that
    /// small batches keep the copy engine busy while the consumer takes each one.
    pub depth: Option<usize>,
    /// Fields to convert on the device (opt-in; see [`Convert`]).
    pub convert: Vec<Convert>,
    /// Debugging: fill each device buffer with this byte before the copy, so that bytes the
    /// copy does not write show up (tests use it; it costs a memset per batch).
    pub poison: Option<u8>,
    /// Adds a field of this name to each device batch: bool per sample, true for a real sample
    /// and false for a padding slot ([`BatchInfo::mask`](crate::BatchInfo::mask)). Opt-in.
    pub mask: Option<String>,
    /// Adds a field of this name to each device batch: the samples' dataset indices, as i64
    /// ([`BatchInfo::indices`](crate::BatchInfo::indices)). Opt-in.
    pub indices: Option<String>,
}

impl DeviceLoaderOptions {
    /// Sets [`depth`](Self::depth).
    pub fn depth(mut self, n: usize) -> Self {
        self.depth = Some(n);
        self
    }

    /// Adds a conversion.
    pub fn convert(mut self, c: Convert) -> Self {
        self.convert.push(c);
        self
    }

    /// Sets [`poison`](Self::poison).
    pub fn poison(mut self, byte: u8) -> Self {
        self.poison = Some(byte);
        self
    }

    /// Sets [`mask`](Self::mask): each device batch gets its padding mask as field `name`.
    pub fn mask(mut self, name: impl Into<String>) -> Self {
        self.mask = Some(name.into());
        self
    }

    /// Sets [`indices`](Self::indices): each device batch gets its samples' indices as field
    /// `name`.
    pub fn indices(mut self, name: impl Into<String>) -> Self {
        self.indices = Some(name.into());
        self
    }
}

/// Where the mask and indices fields live: a region of the device buffer, staged on the host in
/// a pinned buffer laid out the same way, copied in one piece.
struct ExtrasPlan {
    /// The region's offset in the device buffer.
    offset: usize,
    /// Its bytes.
    bytes: usize,
    /// The mask's offset in the region (`batch_size` bytes), if asked for.
    mask: Option<usize>,
    /// The indices' offset in the region (`8 * batch_size` bytes), if asked for.
    indices: Option<usize>,
}

/// Where each field of a device batch lives, computed once.
struct Plan {
    host_bytes: usize,
    device_bytes: usize,
    /// The output fields, shared by every device batch.
    fields: Arc<[FieldSpec]>,
    /// Conversions with their input and output offsets.
    converts: Vec<(Converter, usize, usize)>,
    /// The mask and indices, if asked for.
    extras: Option<ExtrasPlan>,
}

impl Plan {
    fn new(loader: &Loader, device: &Device, opts: &DeviceLoaderOptions) -> Result<Plan> {
        let converts = &opts.convert;
        let layout = loader.layout();
        let host_bytes = layout.total_bytes();
        let mut device_bytes = host_bytes.next_multiple_of(FIELD_ALIGN);
        let mut fields = Vec::new();
        let mut prepared = Vec::new();
        for (k, f) in layout.fields().iter().enumerate() {
            let offset = layout.field_offset(k).unwrap_or(0);
            let convert: Vec<&Convert> = converts.iter().filter(|c| c.field == f.name).collect();
            match convert.as_slice() {
                [] => fields.push(FieldSpec {
                    name: f.name.clone(),
                    dtype: f.dtype,
                    shape: f.shape.clone(),
                    offset,
                    sample_bytes: f.sample_bytes(),
                }),
                [c] => {
                    if f.dtype != DType::U8 {
                        return Err(Error::config(
                            "convert",
                            format!("field `{}` is {}, not u8", f.name, f.dtype),
                        ));
                    }
                    let conv = Converter::new(device, (*c).clone(), &f.shape)?;
                    let out = device_bytes;
                    let out_bytes = conv.output_bytes(layout.batch_size());
                    device_bytes = (device_bytes + out_bytes).next_multiple_of(FIELD_ALIGN);
                    fields.push(FieldSpec {
                        name: f.name.clone(),
                        dtype: c.dtype,
                        shape: conv.output_shape(),
                        offset: out,
                        sample_bytes: conv.output_bytes(1),
                    });
                    prepared.push((conv, offset, out));
                }
                _ => {
                    return Err(Error::config(
                        "convert",
                        format!("field `{}` is converted more than once", f.name),
                    ));
                }
            }
        }
        if let Some(c) = converts
            .iter()
            .find(|c| layout.index_of(&c.field).is_none())
        {
            let names: Vec<&str> = layout.fields().iter().map(|f| f.name.as_str()).collect();
            return Err(Error::config(
                "convert",
                format!(
                    "no batch field `{}` to convert (fields: {names:?})",
                    c.field
                ),
            ));
        }
        let extras = Plan::extras(opts, layout.batch_size(), device_bytes, &mut fields)?;
        if let Some(e) = &extras {
            device_bytes = (e.offset + e.bytes).next_multiple_of(FIELD_ALIGN);
        }
        Ok(Plan {
            host_bytes,
            device_bytes,
            fields: fields.into(),
            converts: prepared,
            extras,
        })
    }

    /// Places the mask and indices fields (if asked for) in a region from `offset` on, and adds
    /// their specs to `fields`.
    fn extras(
        opts: &DeviceLoaderOptions,
        batch_size: usize,
        offset: usize,
        fields: &mut Vec<FieldSpec>,
    ) -> Result<Option<ExtrasPlan>> {
        let mut bytes = 0;
        let mut place = |setting: &'static str,
                         name: &Option<String>,
                         dtype: DType,
                         fields: &mut Vec<FieldSpec>|
         -> Result<Option<usize>> {
            let Some(name) = name else { return Ok(None) };
            if fields.iter().any(|f| &f.name == name) {
                return Err(Error::config(
                    setting,
                    format!("the batches already have a field `{name}`: choose another name"),
                ));
            }
            let at = bytes;
            let sample_bytes = dtype.size();
            bytes = (bytes + sample_bytes * batch_size).next_multiple_of(FIELD_ALIGN);
            fields.push(FieldSpec {
                name: name.clone(),
                dtype,
                shape: Vec::new(),
                offset: offset + at,
                sample_bytes,
            });
            Ok(Some(at))
        };
        let mask = place("mask", &opts.mask, DType::Bool, fields)?;
        let indices = place("indices", &opts.indices, DType::I64, fields)?;
        Ok((bytes > 0).then_some(ExtrasPlan {
            offset,
            bytes,
            mask,
            indices,
        }))
    }
}

/// Figures of a [`DeviceLoader`].
#[derive(Clone, Debug, Serialize)]
pub struct DeviceStats {
    /// Device batches delivered to the consumer.
    pub batches: u64,
    /// Samples delivered.
    pub samples: u64,
    /// Bytes of batch fields delivered (as collated on the host).
    pub bytes: u64,
    /// Time since the consumer's first call to `next`.
    pub elapsed: Duration,
    /// Time the consumer waited inside `next`.
    pub waited: Duration,
    /// Bytes copied host to device (whole batch buffers).
    pub h2d_bytes: u64,
    /// Copies enqueued.
    pub h2d_copies: u64,
    /// Bytes of the copies whose device time is known (their events completed and were read).
    pub h2d_timed_bytes: u64,
    /// Device time of those copies: the union of the intervals between the events around each
    /// copy on the copy stream (time shared by queued copies counted once).
    pub h2d_busy: Duration,
    /// Copy-thread time spent enqueueing copies (taking a device buffer, recording events,
    /// the copy and conversion calls): with the host loader's `waited` (for host batches) and
    /// `copy_thread_blocked` (on a full queue to the consumer), where the copy thread's time went.
    pub copy_thread_enqueue: Duration,
    /// Copy-thread time blocked handing device batches to the consumer (the queue of `depth`
    /// batches was full: the consumer is the slower side).
    pub copy_thread_blocked: Duration,
    /// The device pool.
    pub device_pool: PoolStats,
    /// Device buffers of this loader leaked because their release could not be fenced (a
    /// driver error; see [`DevicePool::leaked`]). Zero unless the driver failed.
    pub device_leaked: u64,
    /// The host loader's figures, as seen by the copy thread (its `waited` is the copy thread's).
    pub loader: Option<LoaderStats>,
}

impl DeviceStats {
    /// Host-to-device bytes per second of copy-engine time (timed bytes over busy time).
    pub fn h2d_bytes_per_sec(&self) -> f64 {
        let s = self.h2d_busy.as_secs_f64();
        if s > 0.0 {
            self.h2d_timed_bytes as f64 / s
        } else {
            0.0
        }
    }

    /// Bytes delivered per second, end to end.
    pub fn bytes_per_sec(&self) -> f64 {
        let s = self.elapsed.as_secs_f64();
        if s > 0.0 { self.bytes as f64 / s } else { 0.0 }
    }

    /// The fraction of the consumer's time spent waiting for a batch (0 to 1).
    pub fn wait_fraction(&self) -> f64 {
        let e = self.elapsed.as_secs_f64();
        if e > 0.0 {
            (self.waited.as_secs_f64() / e).min(1.0)
        } else {
            0.0
        }
    }
}

impl std::fmt::Display for DeviceStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{:<22} {} batches, {} in {:.3}s: {} end to end",
            "delivered to device",
            self.batches,
            human_bytes(self.bytes),
            self.elapsed.as_secs_f64(),
            human_rate(self.bytes_per_sec())
        )?;
        writeln!(
            f,
            "{:<22} {} copies, {}; copy engine busy {:.3}s: {}",
            "H2D",
            self.h2d_copies,
            human_bytes(self.h2d_bytes),
            self.h2d_busy.as_secs_f64(),
            human_rate(self.h2d_bytes_per_sec())
        )?;
        writeln!(
            f,
            "{:<22} enqueueing {:.3}s, blocked on the consumer {:.3}s",
            "copy thread",
            self.copy_thread_enqueue.as_secs_f64(),
            self.copy_thread_blocked.as_secs_f64()
        )?;
        writeln!(
            f,
            "{:<22} {:.3}s ({:.2}% of the consumer's time)",
            "consumer waited",
            self.waited.as_secs_f64(),
            100.0 * self.wait_fraction()
        )?;
        write!(f, "{:<22} {}", "device pool", self.device_pool)?;
        if self.device_leaked > 0 {
            write!(
                f,
                "\n{:<22} {} buffers (driver errors)",
                "device leaked", self.device_leaked
            )?;
        }
        if let Some(l) = &self.loader {
            write!(f, "\n{l}")?;
        }
        Ok(())
    }
}

enum Message {
    /// A batch (or its error) of a generation; `advanced` when it moved the host loader's
    /// position (a batch's own error does; a loader's error does not).
    Batch {
        generation: u64,
        result: Result<DeviceBatch>,
        advanced: bool,
    },
    End(u64),
}

enum Control {
    SetEpoch { epoch: u64, generation: u64 },
    Load { state: LoaderState, generation: u64 },
}

#[derive(Default)]
struct Counters {
    h2d_bytes: u64,
    h2d_copies: u64,
    h2d_timed_bytes: u64,
    h2d_busy: Duration,
    enqueue: Duration,
    blocked: Duration,
    loader: Option<LoaderStats>,
}

struct Shared {
    stop: AtomicBool,
    counters: Mutex<Counters>,
}

impl Shared {
    fn counters(&self) -> std::sync::MutexGuard<'_, Counters> {
        self.counters.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Yields the loader's batches on the device, copied asynchronously ahead of the consumer (one
/// `cuMemcpyHtoDAsync` of each whole batch buffer on the device's copy stream, then the
/// conversions, then an event; see [the rule for device
/// memory](crate::cuda#the-rule-for-device-memory)). An iterator of `Result<DeviceBatch>` over
/// one epoch; dropping it stops the copy thread and the loader's workers.
///
/// Epochs and resume work as on [`Loader`]: [`state`](Self::state) counts the device batches
/// delivered to the consumer (not those copied ahead), a loader built with
/// [`LoaderBuilder::resume`] or given [`load_state`](Self::load_state) yields the rest of that
/// epoch, and the first [`set_epoch`](Self::set_epoch) of that epoch keeps the position.
///
/// ```no_run
/// use gpufeed::cuda::{Device, DeviceLoader, DeviceLoaderOptions};
/// use gpufeed::BatchStream;
/// use gpufeed::source::Zip;
/// use gpufeed::Loader;
///
/// # fn main() -> gpufeed::Result<()> {
/// let device = Device::from_env()?; // LOCAL_RANK's GPU (else SLURM_LOCALID's, else 0)
/// let data = Zip::npy([("image", "images.npy"), ("label", "labels.npy")])?;
/// let builder = Loader::builder(data).batch_size(256).shuffle(0).workers(8);
/// // Pinned host buffers, copied ahead of the consumer on the device's copy stream.
/// let mut loader = DeviceLoader::from_builder(builder, &device, DeviceLoaderOptions::default())?;
/// let compute = device.new_stream()?; // where the model runs
/// for epoch in 0..2 {
///     loader.set_epoch(epoch);
///     for batch in loader.by_ref() {
///         let batch = batch?;
///         batch.wait_on(&compute)?; // `compute` waits for the copy, on the device
///         let images = batch.field::<u8>("image")?; // a device view: enqueue work on `compute`
///         let labels = batch.field::<i64>("label")?;
///         # let _ = (images, labels);
///         // Dropping the batch fences its buffer behind the work enqueued on `compute`.
///     }
/// }
/// let state = loader.state(); // checkpoint it; resume with `builder.resume(state)`
/// # let _ = state;
/// # Ok(())
/// # }
/// ```
pub struct DeviceLoader {
    device: Device,
    pool: DevicePool,
    rx: Option<Receiver<Message>>,
    control: Option<Sender<Control>>,
    thread: Option<JoinHandle<()>>,
    shared: Arc<Shared>,
    generation: u64,
    /// Where the consumer stands: device batches delivered (not those copied ahead).
    position: Position,
    /// The epoch's end was delivered (or the copy thread is gone).
    ended: bool,
    delivered: Delivered,
    sample_bytes: usize,
    /// The device batches' fields.
    fields: Arc<[FieldSpec]>,
}

impl std::fmt::Debug for DeviceLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceLoader")
            .field("device", &self.device)
            .field("epoch", &self.position.epoch())
            .finish()
    }
}

impl DeviceLoader {
    /// Copies `loader`'s batches to `device`. Build the loader with
    /// `.backing(PinnedBacking::new(&device))` (or use [`DeviceLoader::from_builder`]): from
    /// pageable buffers the copies are correct but staged by the driver, and slow.
    ///
    /// The calling thread's current context is left as it was.
    pub fn new(loader: Loader, device: &Device, opts: DeviceLoaderOptions) -> Result<DeviceLoader> {
        if opts.depth == Some(0) {
            return Err(Error::config(
                "depth",
                "at least one device batch must be in flight",
            ));
        }
        let _scope = ContextScope::enter(device.context())?;
        let plan = Plan::new(&loader, device, &opts)?;
        let depth = opts
            .depth
            .unwrap_or_else(|| (DEPTH_BYTES / plan.device_bytes.max(1)).clamp(2, 16));
        let pool = DevicePool::new(device);
        // Copies in flight hold a staging buffer each until they complete: a few dozen.
        let extras = plan.extras.as_ref().map(|e| {
            HostPool::with_backing(
                PinnedBacking::small(device),
                ((depth + 32) * HostPool::block_size(e.bytes)) as u64,
            )
        });
        let fields = Arc::clone(&plan.fields);
        let (tx, rx) = crossbeam_channel::bounded(depth);
        let (ctl_tx, ctl_rx) = crossbeam_channel::unbounded();
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            counters: Mutex::new(Counters::default()),
        });
        let position = loader.position().clone();
        let sample_bytes = loader.layout().sample_bytes();
        let worker = CopyThread {
            loader,
            device: device.clone(),
            plan,
            pool: pool.clone(),
            extras,
            poison: opts.poison,
            tx,
            control: ctl_rx,
            shared: Arc::clone(&shared),
            timing: VecDeque::new(),
            spare: Vec::new(),
            last_end: None,
        };
        let thread = std::thread::Builder::new()
            .name(format!("gpufeed-copy-{}", device.ordinal()))
            .spawn(move || worker.run())
            .map_err(|e| Error::spawn("device", "the copy thread", e))?;
        Ok(DeviceLoader {
            device: device.clone(),
            pool,
            rx: Some(rx),
            control: Some(ctl_tx),
            thread: Some(thread),
            shared,
            generation: 0,
            position,
            ended: false,
            delivered: Delivered::default(),
            sample_bytes,
            fields,
        })
    }

    /// Builds `builder` with pinned batch buffers on `device`, then [`DeviceLoader::new`].
    pub fn from_builder(
        builder: LoaderBuilder,
        device: &Device,
        opts: DeviceLoaderOptions,
    ) -> Result<DeviceLoader> {
        let loader = builder.backing(super::PinnedBacking::new(device)).build()?;
        DeviceLoader::new(loader, device, opts)
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The pool of device batch buffers.
    pub fn device_pool(&self) -> &DevicePool {
        &self.pool
    }

    /// The device batches' fields, in order: name, dtype and per-sample shape (converted
    /// fields as the conversion writes them; the mask and indices fields last, if asked for).
    pub fn fields(&self) -> Vec<OutputField> {
        self.fields
            .iter()
            .map(|f| OutputField::new(f.name.clone(), f.dtype, &f.shape))
            .collect()
    }

    fn send(&mut self, control: Control) {
        let sent = self
            .control
            .as_ref()
            .is_some_and(|c| c.send(control).is_ok());
        if !sent {
            // The copy thread is gone: `next` reports it.
            self.control = None;
        }
    }

    /// Figures so far. The calling thread's current context is left as it was.
    pub fn stats(&self) -> DeviceStats {
        // Reading the pool's figures queries (and destroys) completed events.
        let _scope = ContextScope::enter(self.device.context());
        let c = self.shared.counters();
        DeviceStats {
            batches: self.delivered.batches,
            samples: self.delivered.samples,
            bytes: self.delivered.bytes,
            elapsed: self.delivered.elapsed(),
            waited: self.delivered.waited,
            h2d_bytes: c.h2d_bytes,
            h2d_copies: c.h2d_copies,
            h2d_timed_bytes: c.h2d_timed_bytes,
            h2d_busy: c.h2d_busy,
            copy_thread_enqueue: c.enqueue,
            copy_thread_blocked: c.blocked,
            device_pool: self.pool.stats(),
            device_leaked: self.pool.leaked().0,
            loader: c.loader.clone(),
        }
    }

    fn next_until(&mut self, deadline: Option<Instant>) -> Next<DeviceBatch> {
        if self.ended {
            return Next::EndOfEpoch;
        }
        self.delivered.asked();
        if self.control.is_none() {
            self.ended = true;
            return Next::Ready(Err(Error::Shutdown));
        }
        let Some(rx) = self.rx.as_ref() else {
            return Next::EndOfEpoch;
        };
        loop {
            let message = self.delivered.wait(|| match deadline {
                None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
                Some(d) => rx.recv_deadline(d),
            });
            let message = match message {
                Ok(m) => Some(m),
                Err(RecvTimeoutError::Timeout) => return Next::Pending,
                Err(RecvTimeoutError::Disconnected) => None,
            };
            match message {
                None => {
                    self.ended = true;
                    return Next::Ready(Err(Error::Shutdown));
                }
                Some(Message::Batch {
                    generation,
                    result,
                    advanced,
                }) if generation == self.generation => {
                    if advanced {
                        self.position.advance();
                    }
                    if let Ok(b) = &result {
                        self.delivered.batch(b.len(), self.sample_bytes);
                    }
                    return Next::Ready(result);
                }
                Some(Message::End(g)) if g == self.generation => {
                    self.ended = true;
                    return Next::EndOfEpoch;
                }
                // A batch of an abandoned epoch: it drops here (a stale one of a generation
                // that `set_epoch` or `load_state` replaced).
                Some(_) => continue,
            }
        }
    }
}

impl Iterator for DeviceLoader {
    type Item = Result<DeviceBatch>;

    fn next(&mut self) -> Option<Result<DeviceBatch>> {
        next_blocking(|| self.next_until(None))
    }
}

impl BatchStream for DeviceLoader {
    type Batch = DeviceBatch;

    fn epoch(&self) -> u64 {
        self.position.epoch()
    }

    fn batches_per_epoch(&self) -> u64 {
        self.position.spec().batches()
    }

    fn order_spec(&self) -> &OrderSpec {
        self.position.spec()
    }

    /// Device batches copied ahead are not counted.
    fn state(&self) -> LoaderState {
        self.position.state()
    }

    /// Copies in flight are discarded.
    fn load_state(&mut self, state: LoaderState) -> Result<()> {
        let (order, next) = self.position.resolve(&state)?;
        self.generation += 1;
        self.position.resume_at(&order, next);
        self.ended = false;
        self.send(Control::Load {
            state,
            generation: self.generation,
        });
        Ok(())
    }

    /// Copies in flight are discarded. If the copy thread has stopped, the next call to `next`
    /// says so.
    fn set_epoch(&mut self, epoch: u64) {
        if self.position.keeps(epoch) && !self.ended {
            return;
        }
        self.generation += 1;
        self.position.restart(epoch);
        self.ended = false;
        self.send(Control::SetEpoch {
            epoch,
            generation: self.generation,
        });
    }

    fn next_timeout(&mut self, timeout: Duration) -> Next<DeviceBatch> {
        self.next_until(deadline(timeout))
    }
}

impl Drop for DeviceLoader {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        // Closing both channels wakes the copy thread wherever it blocks on us; it then drops
        // the loader, which stops and joins the workers.
        self.control = None;
        self.rx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The copy thread's state.
struct CopyThread {
    loader: Loader,
    device: Device,
    plan: Plan,
    pool: DevicePool,
    /// Pinned staging buffers of the mask and indices, if asked for.
    extras: Option<HostPool>,
    poison: Option<u8>,
    tx: Sender<Message>,
    control: Receiver<Control>,
    shared: Arc<Shared>,
    /// Copies whose timing events have not been read: (start, end, bytes).
    timing: VecDeque<(CudaEvent, EventFence, usize)>,
    /// Start events already read, to record again.
    spare: Vec<CudaEvent>,
    /// The end event of the last copy timed, to count time shared with the next one once.
    last_end: Option<EventFence>,
}

impl CopyThread {
    fn run(mut self) {
        if let Err(e) = self.device.bind() {
            let _ = self.tx.send(Message::Batch {
                generation: 0,
                result: Err(e),
                advanced: false,
            });
            return;
        }
        let mut generation = 0u64;
        let mut ended = false;
        let mut sent = 0u64;
        loop {
            if self.shared.stop.load(Ordering::Acquire) {
                return;
            }
            let control = if ended {
                match self.control.recv() {
                    Ok(c) => Some(c),
                    Err(_) => return,
                }
            } else {
                match self.control.try_recv() {
                    Ok(c) => Some(c),
                    Err(crossbeam_channel::TryRecvError::Empty) => None,
                    Err(crossbeam_channel::TryRecvError::Disconnected) => return,
                }
            };
            match control {
                Some(Control::SetEpoch {
                    epoch,
                    generation: g,
                }) => {
                    // The consumer restarts `epoch` from its first batch: the host loader must
                    // too, also when it stands at that epoch's start or was resumed.
                    self.loader.restart_epoch(epoch);
                    generation = g;
                    ended = false;
                }
                Some(Control::Load {
                    state,
                    generation: g,
                }) => {
                    generation = g;
                    ended = false;
                    // Checked by the consumer against the same order settings.
                    if let Err(e) = self.loader.load_state(state) {
                        let message = Message::Batch {
                            generation,
                            result: Err(e),
                            advanced: false,
                        };
                        if self.tx.send(message).is_err() {
                            return;
                        }
                        ended = true;
                        continue;
                    }
                }
                None => {}
            }
            self.read_timings(false);
            let before = self.loader.position().next_batch();
            let message = match self.loader.next() {
                None => {
                    ended = true;
                    self.read_timings(true);
                    Message::End(generation)
                }
                Some(Err(e)) => Message::Batch {
                    generation,
                    result: Err(e),
                    advanced: self.loader.position().next_batch() != before,
                },
                Some(Ok(batch)) => {
                    let t0 = Instant::now();
                    let result = self.copy(batch);
                    self.shared.counters().enqueue += t0.elapsed();
                    Message::Batch {
                        generation,
                        result,
                        advanced: true,
                    }
                }
            };
            sent += 1;
            if ended || sent % STATS_EVERY == 1 {
                self.shared.counters().loader = Some(self.loader.stats());
            }
            let t0 = Instant::now();
            if self.tx.send(message).is_err() {
                return;
            }
            self.shared.counters().blocked += t0.elapsed();
        }
    }

    /// Enqueues the copy (and conversions) of one host batch; never waits for the device.
    fn copy(&mut self, mut batch: Batch) -> Result<DeviceBatch> {
        let stream = Arc::clone(self.device.copy_stream());
        let mut buffer = self.pool.alloc(self.plan.device_bytes)?;
        match self.enqueue(&mut batch, &mut buffer, &stream) {
            Ok(ready) => Ok(DeviceBatch::new(
                buffer,
                Arc::clone(&self.plan.fields),
                batch.info().clone(),
                ready,
                stream,
            )),
            Err(e) => {
                // Work that reads the host buffer or writes the device buffer may be on the copy
                // stream without its fence: wait for it before both are dropped (if this fails
                // too, the context is broken and runs nothing more).
                let _ = stream.synchronize();
                Err(e)
            }
        }
        // `batch` drops here: its pinned buffer waits in the pool behind the copy.
    }

    /// Enqueues the copy of `batch` into `buffer` and the conversions on `stream`, fences both
    /// buffers (and the converters' coefficients), and returns the fence of the whole.
    fn enqueue(
        &mut self,
        batch: &mut Batch,
        buffer: &mut DeviceBuffer,
        stream: &Arc<CudaStream>,
    ) -> Result<EventFence> {
        let plan = &self.plan;
        if let Some(byte) = self.poison {
            buffer.fill_async(stream, 0, plan.device_bytes, byte)?;
        }
        let host = batch.buffer().as_slice();
        let n = host.len().min(plan.host_bytes);
        let start = match self.spare.pop() {
            Some(e) => e,
            None => self
                .device
                .context()
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(cuda_err("create an event"))?,
        };
        start
            .record(stream)
            .map_err(cuda_err("record an event (cuEventRecord)"))?;
        // SAFETY: `host[..n]` is the batch's pinned host buffer, released behind `copied` (just
        // below) before the batch can drop; the destination is this device buffer of at least
        // `device_bytes >= n` bytes, fenced behind `ready` (recorded after the copy on this
        // stream) before this function returns. On an error in between, `copy` synchronises
        // the stream before either buffer drops.
        unsafe { result::memcpy_htod_async(buffer.addr(), &host[..n], stream.cu_stream()) }
            .map_err(cuda_err("copy a batch to the device (cuMemcpyHtoDAsync)"))?;
        let staged = match (&plan.extras, &self.extras) {
            (Some(e), Some(pool)) => Some(stage_extras(e, pool, batch, buffer, stream)?),
            _ => None,
        };
        let copied = EventFence::record_timed(stream)?;
        batch.buffer_mut().release_after(Box::new(copied.clone()));
        if let Some(mut staged) = staged {
            staged.release_after(Box::new(copied.clone()));
        }
        let len = batch.len();
        for (conv, src, dst) in &plan.converts {
            // SAFETY: the plan placed the input field at `src` and the output at `dst` inside
            // a device buffer of `device_bytes` (computed for a full batch; `len` is at most
            // that), the two ranges do not overlap (outputs follow the host image), and the
            // buffer and the coefficients are fenced behind `ready`, recorded after this kernel
            // on this stream (or `copy` synchronises the stream).
            unsafe {
                conv.launch_raw(
                    stream,
                    buffer.addr() + *src as u64,
                    buffer.addr() + *dst as u64,
                    len,
                )?
            };
        }
        let ready = if plan.converts.is_empty() {
            copied.clone()
        } else {
            EventFence::record(stream)?
        };
        buffer.add_use(stream, ready.clone());
        for (conv, _, _) in &plan.converts {
            conv.fence_coefficients(stream, ready.clone());
        }
        {
            let mut c = self.shared.counters();
            c.h2d_bytes += n as u64;
            c.h2d_copies += 1;
        }
        if self.timing.len() < 4096 {
            self.timing.push_back((start, copied, n));
        }
        Ok(ready)
    }

    /// Reads the device time of completed copies; with `all`, waits for every pending one
    /// (at the end of an epoch only).
    fn read_timings(&mut self, all: bool) {
        let mut timed_bytes = 0u64;
        let mut busy = Duration::ZERO;
        while let Some((start, end, bytes)) = self.timing.front() {
            let done = end.event().try_is_complete().unwrap_or(true);
            if !done && (!all || end.event().synchronize().is_err()) {
                break;
            }
            // SAFETY: both events are live, were recorded on the copy stream, and `end` has
            // completed, so the elapsed time is defined and the call does not wait.
            let elapsed =
                unsafe { result::event::elapsed(start.cu_event(), end.event().cu_event()) };
            if let Ok(ms) = elapsed {
                // Busy time is the union of the copies' intervals: a start event can be stamped
                // before the previous copy has ended (copies queued back to back), so the part
                // of this interval before the previous end is not counted twice.
                let overlap = match &self.last_end {
                    Some(prev) => {
                        // SAFETY: as above; the previous end event has completed too.
                        let gap = unsafe {
                            result::event::elapsed(start.cu_event(), prev.event().cu_event())
                        };
                        gap.map_or(0.0, |o| o.clamp(0.0, ms.max(0.0)))
                    }
                    None => 0.0,
                };
                busy += Duration::from_secs_f64(f64::from((ms - overlap).max(0.0)) / 1e3);
                timed_bytes += *bytes as u64;
            }
            self.last_end = Some(end.clone());
            if let Some((start, _, _)) = self.timing.pop_front()
                && self.spare.len() < SPARE_EVENTS
            {
                // Read and complete: nothing refers to it, it can be recorded again.
                self.spare.push(start);
            }
        }
        if timed_bytes > 0 {
            let mut c = self.shared.counters();
            c.h2d_timed_bytes += timed_bytes;
            c.h2d_busy += busy;
        }
    }
}

/// Writes `batch`'s mask and indices into a pinned staging buffer laid out as the extras region,
/// and enqueues its copy into `buffer` on `stream`. The caller fences the staging buffer behind
/// the copy (`release_after`) and `buffer` behind the batch's `ready` fence, or, on an error,
/// synchronises the stream before either drops.
fn stage_extras(
    plan: &ExtrasPlan,
    pool: &HostPool,
    batch: &Batch,
    buffer: &DeviceBuffer,
    stream: &CudaStream,
) -> Result<crate::memory::HostBuffer> {
    let mut staged = pool.acquire(plan.bytes)?;
    let bytes = staged.as_mut_slice();
    bytes.fill(0);
    if let Some(at) = plan.mask {
        for (slot, real) in bytes[at..].iter_mut().zip(batch.mask()) {
            *slot = u8::from(real);
        }
    }
    if let Some(at) = plan.indices {
        for (slot, &index) in bytes[at..].chunks_exact_mut(8).zip(batch.indices()) {
            let index = i64::try_from(index).unwrap_or(i64::MAX);
            slot.copy_from_slice(&index.to_le_bytes());
        }
    }
    // SAFETY: the staging buffer is pinned host memory of `plan.bytes` bytes, released behind
    // the copy's fence by the caller before it can be reused; the destination is the extras
    // region of this device buffer (`plan.offset + plan.bytes <= device_bytes`, the plan's
    // layout), fenced behind `ready` (or the stream synchronised on an error) by the caller.
    unsafe {
        result::memcpy_htod_async(
            buffer.addr() + plan.offset as u64,
            &staged.as_slice()[..plan.bytes],
            stream.cu_stream(),
        )
    }
    .map_err(cuda_err(
        "copy a batch's mask and indices (cuMemcpyHtoDAsync)",
    ))?;
    Ok(staged)
}
