//! [`DeviceLoader`]: a [`Loader`]'s batches on a GPU, copied ahead of the consumer by a copy
//! thread (`copy.rs`), delivered as [`DeviceBatch`]es behind the same face as the host loader
//! ([`BatchStream`]).
//!
//! The rule for device memory that this implements is in the [`cuda`](crate::cuda) module's docs.
//!
//! Optionally each device batch also carries the padding mask and the sample indices as fields
//! of its own ([`DeviceLoaderOptions::mask`], [`DeviceLoaderOptions::indices`]).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use super::DeviceStats;
use super::batch::FieldSpec;
use super::copy::{Control, CopyStage, Message, Shared};
use super::device::ContextScope;
use super::nvjpeg::{self, DecodeOptions, DecodeReport, DecodeStage};
use super::{Convert, Device, DeviceBatch, DevicePool, Widen};
use crate::error::{Error, Result};
use crate::layout::OutputField;
use crate::loader::{
    BatchStream, ConsumerTimeline, Delivered, Loader, LoaderBuilder, LoaderState, Next, Position,
    deadline, next_blocking,
};
use crate::sampler::OrderSpec;

/// Settings of a [`DeviceLoader`].
#[derive(Clone, Debug, Default)]
pub struct DeviceLoaderOptions {
    /// Device batches copied ahead of the consumer (the channel's capacity). One more can be
    /// in the copy thread's hands. Default (`None`): about 32 MiB of batches, 2 to 16, so that
    /// small batches keep the copy engine busy while the consumer takes each one.
    pub depth: Option<usize>,
    /// Fields to convert on the device (opt-in; see [`Convert`]).
    pub convert: Vec<Convert>,
    /// Integer fields to widen on the device (opt-in; see [`Widen`]).
    pub widen: Vec<Widen>,
    /// Debugging: fill each device buffer with this byte before the copy, so that bytes the
    /// copy does not write show up (tests use it; it costs a memset per batch).
    pub poison: Option<u8>,
    /// Adds a field of this name to each device batch: bool per sample, true for a real sample
    /// and false for a padding slot ([`BatchInfo::mask`](crate::BatchInfo::mask)). Opt-in.
    pub mask: Option<String>,
    /// Adds a field of this name to each device batch: the samples' dataset indices, as i64
    /// ([`BatchInfo::indices`](crate::BatchInfo::indices)). Opt-in.
    pub indices: Option<String>,
    /// The GPU decode stage's settings (for an image pipeline with
    /// [`Decode::Gpu`](crate::transform::image::Decode) or `Auto`).
    pub decode: DecodeOptions,
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

    /// Adds a widening.
    pub fn widen(mut self, w: Widen) -> Self {
        self.widen.push(w);
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

    /// Sets the GPU decode's [`DecodeOptions`].
    pub fn decode(mut self, decode: DecodeOptions) -> Self {
        self.decode = decode;
        self
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
    /// The device batches' fields.
    fields: Arc<[FieldSpec]>,
    /// The GPU decode stage's figures, and the transform's counts, if it decodes.
    decode: Option<(
        Arc<std::sync::Mutex<DecodeReport>>,
        Arc<crate::transform::image::GpuDecodeStats>,
    )>,
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
        let position = loader.position().clone();
        // The loader's consumer track becomes the copy thread's; the device batches' consumer
        // gets one of its own.
        let timeline = loader
            .trace()
            .map(|(t, group)| ConsumerTimeline::new(t.track(*group, "consumer", 0)));
        let pool = DevicePool::new(device);
        let plan = loader.image_pipeline().and_then(|t| t.gpu_decode_plan());
        let (stage, decode) = match plan {
            Some(plan) => {
                let stats = Arc::clone(&plan.stats);
                let workers = loader.stats().workers;
                let stage = DecodeStage::new(device, plan, loader.layout(), &opts.decode, workers)?;
                let report = stage.report();
                (Some(stage), Some((report, stats)))
            }
            None => (None, None),
        };
        let CopyStage {
            rx,
            control,
            thread,
            shared,
            fields,
        } = CopyStage::start(loader, device, &pool, &opts, stage)?;
        Ok(DeviceLoader {
            device: device.clone(),
            pool,
            rx: Some(rx),
            control: Some(control),
            thread: Some(thread),
            shared,
            generation: 0,
            position,
            ended: false,
            delivered: Delivered::recorded_on(timeline),
            fields,
            decode,
        })
    }

    /// Builds `builder` with pinned batch buffers on `device`, then [`DeviceLoader::new`]. An
    /// image pipeline ([`ImageTransform`](crate::transform::image::ImageTransform)) with
    /// [`Decode::Gpu`](crate::transform::image::Decode) or `Auto` decodes its JPEGs on this
    /// GPU (see [`nvjpeg`]): decided here, before the loader is built.
    pub fn from_builder(
        builder: LoaderBuilder,
        device: &Device,
        opts: DeviceLoaderOptions,
    ) -> Result<DeviceLoader> {
        if let Some(t) = builder.image_pipeline() {
            let nvjpeg = match t.decode_mode() {
                crate::transform::image::Decode::Cpu => Ok(()),
                _ => nvjpeg::load().map(|_| ()),
            };
            t.decide_decode(nvjpeg)?;
        }
        let loader = builder.backing(super::PinnedBacking::new(device)).build()?;
        DeviceLoader::new(loader, device, opts)
    }

    /// What the GPU decode stage did, if the loader decodes on the GPU: the library, the
    /// engines, the time on each side, which engine took how many images.
    pub fn decode_report(&self) -> Option<DecodeReport> {
        let (report, stats) = self.decode.as_ref()?;
        let mut r = report.lock().map(|r| r.clone()).unwrap_or_default();
        r.counts = stats.snapshot();
        Some(r)
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
    /// fields as the conversion writes them; a ragged field's item shape; the mask and indices
    /// fields last, if asked for).
    pub fn fields(&self) -> Vec<OutputField> {
        self.fields
            .iter()
            .map(|f| OutputField {
                ragged: f.offsets.is_some(),
                ..OutputField::new(f.name.clone(), f.dtype, &f.shape)
            })
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
            skipped: self.delivered.skipped,
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
            gpu_decode: self.decode.is_some(),
        }
    }

    fn next_until(&mut self, deadline: Option<Instant>) -> Next<DeviceBatch> {
        self.delivered.called();
        if self.ended {
            return Next::EndOfEpoch;
        }
        self.delivered
            .asked(self.position.epoch(), self.position.next_batch());
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
                        self.delivered.batch(b, b.data_bytes());
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
        self.delivered.epoch_starts(order.epoch());
        self.ended = false;
        self.send(Control::Load {
            state: Box::new(state),
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
        self.delivered.epoch_starts(epoch);
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
