//! The copy stage: the thread behind a [`DeviceLoader`](super::DeviceLoader) that turns a
//! [`Loader`]'s host batches into [`DeviceBatch`]es.
//!
//! A copy thread owns the loader. For each host batch it takes a buffer from a [`DevicePool`],
//! enqueues on the device's copy stream one `cuMemcpyHtoDAsync` of the whole batch buffer (every
//! field lives in it, at [`BatchLayout::field_offset`](crate::layout::BatchLayout::field_offset);
//! with ragged fields, as far as the last one's values go: room they do not use is not copied),
//! then the optional conversion kernels, and records fences: the host buffer is released behind
//! the copy's (so that the pinned buffer returns to its pool only once the copy has read it),
//! the device buffer behind the batch's `ready` fence (after the conversions). The device batch
//! goes to the consumer through a bounded channel of `depth` batches: copies of the next batches
//! are in flight while the consumer computes on this one. Nothing on this path waits for the
//! device. If enqueueing fails half way, the copy thread synchronises the copy stream before it
//! lets go of either buffer.
//!
//! The mask and the sample indices, when asked for, are written into a small pinned staging
//! buffer and copied with the batch.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use cudarc::driver::{CudaEvent, CudaStream, result, sys};

use super::batch::{FieldSpec, HostSide};
use super::cuda_err;
use super::fence::EventFence;
use super::nvjpeg::DecodeStage;
use super::{
    Convert, Converter, Device, DeviceBatch, DeviceBuffer, DeviceLoaderOptions, DevicePool,
    PinnedBacking, Widen, Widener,
};
use crate::error::{Error, Result};
use crate::format::DType;
use crate::layout::FIELD_ALIGN;
use crate::loader::{Batch, BatchStream, Loader, LoaderState, LoaderStats};
use crate::memory::HostPool;
use crate::trace::{Args, Track};

/// Bytes of device batches the default depth aims to keep copied ahead.
const DEPTH_BYTES: usize = 32 << 20;

/// The copy thread refreshes the loader figures it shares every this many batches (and at
/// each epoch's end): reading them walks the pool's pending fences.
const STATS_EVERY: u64 = 64;

/// Timing events kept for reuse (creating an event is a driver call per batch otherwise).
const SPARE_EVENTS: usize = 64;

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
    converts: Vec<(Conversion, usize, usize)>,
    /// The mask and indices, if asked for.
    extras: Option<ExtrasPlan>,
    /// The image pipeline's GPU decode, which makes the image field instead of a copy.
    decode: Option<DecodeStage>,
    /// With `decode`: the bytes a decoded sample delivers (its pixels and label), which the
    /// device batch counts instead of the compressed record it was made from.
    decoded_sample_bytes: usize,
}

/// A conversion kernel the copy stage runs after the copy of a batch.
enum Conversion {
    /// u8 images to a float dtype, normalised ([`Convert`]).
    Normalize(Converter),
    /// Integers to wider integers ([`Widen`]).
    Widen(Widener),
}

impl Conversion {
    fn output_bytes(&self, n: usize) -> usize {
        match self {
            Conversion::Normalize(c) => c.output_bytes(n),
            Conversion::Widen(w) => w.output_bytes(n),
        }
    }

    /// Enqueues the conversion of `n` samples from `src` to `dst` on `stream`.
    ///
    /// # Safety
    ///
    /// As [`Converter::launch_raw`] and [`Widener::launch_raw`] say.
    unsafe fn launch_raw(
        &self,
        stream: &CudaStream,
        src: sys::CUdeviceptr,
        dst: sys::CUdeviceptr,
        n: usize,
    ) -> Result<()> {
        match self {
            // SAFETY: the caller's contract is the converter's.
            Conversion::Normalize(c) => unsafe { c.launch_raw(stream, src, dst, n) },
            // SAFETY: the caller's contract is the widener's.
            Conversion::Widen(w) => unsafe { w.launch_raw(stream, src, dst, n) },
        }
    }
}

impl Plan {
    fn new(
        loader: &Loader,
        device: &Device,
        opts: &DeviceLoaderOptions,
        decode: Option<DecodeStage>,
    ) -> Result<Plan> {
        if let Some(stage) = decode {
            return Plan::decoded(loader, opts, stage);
        }
        let converts = &opts.convert;
        let layout = loader.layout();
        let host_bytes = layout.total_bytes();
        let mut device_bytes = host_bytes.next_multiple_of(FIELD_ALIGN);
        let mut fields = Vec::new();
        let mut prepared = Vec::new();
        for (k, f) in layout.fields().iter().enumerate() {
            let offset = layout.field_offset(k).unwrap_or(0);
            let convert: Vec<&Convert> = converts.iter().filter(|c| c.field == f.name).collect();
            let widen: Vec<&Widen> = opts.widen.iter().filter(|w| w.field == f.name).collect();
            if convert.len() + widen.len() > 1 {
                return Err(Error::config(
                    "convert",
                    format!("field `{}` is converted more than once", f.name),
                ));
            }
            if convert.len() + widen.len() == 1 && f.ragged {
                return Err(Error::config(
                    "convert",
                    format!(
                        "field `{}` is ragged: a conversion works on fields of one shape",
                        f.name
                    ),
                ));
            }
            let conversion = match (convert.first(), widen.first()) {
                (Some(c), _) => {
                    if f.dtype != DType::U8 {
                        return Err(Error::config(
                            "convert",
                            format!("field `{}` is {}, not u8", f.name, f.dtype),
                        ));
                    }
                    let conv = Converter::new(device, (*c).clone(), &f.shape)?;
                    let shape = conv.output_shape();
                    Some((Conversion::Normalize(conv), c.dtype, shape))
                }
                (None, Some(w)) => {
                    let widener = Widener::new(device, (*w).clone(), f.dtype, &f.shape)?;
                    Some((Conversion::Widen(widener), w.dtype, f.shape.clone()))
                }
                (None, None) => None,
            };
            match conversion {
                None => fields.push(FieldSpec {
                    name: f.name.clone(),
                    dtype: f.dtype,
                    shape: f.shape.clone(),
                    offset,
                    sample_bytes: f.item_bytes(),
                    offsets: layout.offsets_offset(k),
                }),
                Some((conversion, dtype, shape)) => {
                    let out = device_bytes;
                    let out_bytes = conversion.output_bytes(layout.batch_size());
                    device_bytes = (device_bytes + out_bytes).next_multiple_of(FIELD_ALIGN);
                    fields.push(FieldSpec {
                        name: f.name.clone(),
                        dtype,
                        shape,
                        offset: out,
                        sample_bytes: conversion.output_bytes(1),
                        offsets: None,
                    });
                    prepared.push((conversion, offset, out));
                }
            }
        }
        let named = converts
            .iter()
            .map(|c| &c.field)
            .chain(opts.widen.iter().map(|w| &w.field));
        for name in named {
            if layout.index_of(name).is_none() {
                let names: Vec<&str> = layout.fields().iter().map(|f| f.name.as_str()).collect();
                return Err(Error::config(
                    "convert",
                    format!("no batch field `{name}` to convert (fields: {names:?})"),
                ));
            }
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
            decode: None,
            decoded_sample_bytes: 0,
        })
    }

    /// The device batch of the GPU decode: the image field the stage writes, the label as
    /// copied (the start of the host batch, copied as it is), then the mask and indices.
    fn decoded(loader: &Loader, opts: &DeviceLoaderOptions, stage: DecodeStage) -> Result<Plan> {
        if let Some(field) = opts
            .convert
            .iter()
            .map(|c| &c.field)
            .chain(opts.widen.iter().map(|w| &w.field))
            .next()
        {
            return Err(Error::config(
                "convert",
                format!(
                    "field `{field}`: the GPU decode writes the images as the ImageTransform's dtype and \
                     normalisation say; set them there instead of converting"
                ),
            ));
        }
        let layout = loader.layout();
        let batch = layout.batch_size();
        let image_offset = stage.image_offset();
        let image_bytes = stage.image_bytes(batch);
        let mut fields = vec![FieldSpec {
            name: "image".into(),
            dtype: stage.dtype(),
            shape: stage.image_shape(),
            offset: image_offset,
            sample_bytes: image_bytes / batch.max(1),
            offsets: None,
        }];
        if let Some(offset) = stage.label_offset() {
            fields.push(FieldSpec {
                name: "label".into(),
                dtype: DType::I64,
                shape: Vec::new(),
                offset,
                sample_bytes: 8,
                offsets: None,
            });
        }
        let mut device_bytes = (image_offset + image_bytes).next_multiple_of(FIELD_ALIGN);
        let extras = Plan::extras(opts, batch, device_bytes, &mut fields)?;
        if let Some(e) = &extras {
            device_bytes = (e.offset + e.bytes).next_multiple_of(FIELD_ALIGN);
        }
        let decoded_sample_bytes = fields
            .iter()
            .filter(|f| f.name == "image" || f.name == "label")
            .map(|f| f.sample_bytes)
            .sum();
        Ok(Plan {
            host_bytes: layout.total_bytes(),
            device_bytes,
            fields: fields.into(),
            converts: Vec::new(),
            extras,
            decode: Some(stage),
            decoded_sample_bytes,
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
                offsets: None,
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

// One message per batch through a bounded channel: a box would be one more allocation per batch
// to save the channel's few slots a couple of hundred bytes each.
#[allow(
    clippy::large_enum_variant,
    reason = "a box per batch costs more than the bytes it saves"
)]
pub(super) enum Message {
    /// A batch (or its error) of a generation; `advanced` when it moved the host loader's
    /// position (a batch's own error does; a loader's error does not).
    Batch {
        generation: u64,
        result: Result<DeviceBatch>,
        advanced: bool,
    },
    End(u64),
}

pub(super) enum Control {
    SetEpoch {
        epoch: u64,
        generation: u64,
    },
    /// A state is a few hundred bytes (its order, token stream and fingerprints): boxed, so
    /// that the common message stays small.
    Load {
        state: Box<LoaderState>,
        generation: u64,
    },
}

#[derive(Default)]
pub(super) struct Counters {
    pub h2d_bytes: u64,
    pub h2d_copies: u64,
    pub h2d_timed_bytes: u64,
    pub h2d_busy: Duration,
    pub enqueue: Duration,
    pub blocked: Duration,
    pub loader: Option<LoaderStats>,
}

pub(super) struct Shared {
    pub stop: AtomicBool,
    pub counters: Mutex<Counters>,
}

impl Shared {
    pub(super) fn counters(&self) -> std::sync::MutexGuard<'_, Counters> {
        self.counters.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The consumer's ends of a running copy thread.
pub(super) struct CopyStage {
    /// Device batches, in order, and the ends of epochs.
    pub rx: Receiver<Message>,
    /// Epoch changes and resumes.
    pub control: Sender<Control>,
    pub thread: JoinHandle<()>,
    /// The stop flag and the copy stage's counters.
    pub shared: Arc<Shared>,
    /// The device batches' fields.
    pub fields: Arc<[FieldSpec]>,
}

impl CopyStage {
    /// Starts the copy thread on `loader`'s batches, into buffers of `pool`.
    pub(super) fn start(
        loader: Loader,
        device: &Device,
        pool: &DevicePool,
        opts: &DeviceLoaderOptions,
        decode: Option<DecodeStage>,
    ) -> Result<CopyStage> {
        let plan = Plan::new(&loader, device, opts, decode)?;
        let depth = opts
            .depth
            .unwrap_or_else(|| (DEPTH_BYTES / plan.device_bytes.max(1)).clamp(2, 16));
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
        // The copy thread consumes the loader's host batches: the loader's consumer track is
        // its track; the copies themselves get a track of the copy stream's.
        let track = loader.consumer_track().cloned();
        if let Some(t) = &track {
            t.rename("copy thread");
        }
        let stream_track = loader.trace().map(|(t, group)| {
            t.track(*group, format!("copy stream (GPU {})", device.ordinal()), 1)
        });
        let worker = CopyThread {
            track,
            stream_track,
            anchor: None,
            last_placed: 0,
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
        Ok(CopyStage {
            rx,
            control: ctl_tx,
            thread,
            shared,
            fields,
        })
    }
}

/// The copy thread's state.
struct CopyThread {
    /// Its track of the loader's trace (the loader's consumer track), if it has one.
    track: Option<Track>,
    /// The copy stream's track: each copy's device time, from its events.
    stream_track: Option<Track>,
    /// An event of the copy stream and the trace time at which it completed: the copies'
    /// events are placed on the timeline by their device time from it.
    anchor: Option<(CudaEvent, u64)>,
    /// Where the last copy placed on the stream's track ended (trace nanoseconds).
    last_placed: u64,
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
    /// Copies whose timing events have not been read: (start, end, bytes, the batch).
    timing: VecDeque<(CudaEvent, EventFence, usize, Args)>,
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
        let track = self.track.clone();
        let _entered = track.as_ref().map(Track::enter);
        self.anchor_timeline();
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
                    if let Err(e) = self.loader.load_state(*state) {
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
                    let args = Args::batch(batch.epoch(), batch.number());
                    let result = self.copy(batch);
                    self.shared.counters().enqueue += t0.elapsed();
                    if let Some(track) = &track {
                        track.span("enqueue", t0, Instant::now(), args);
                    }
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
            if let Some(track) = &track {
                track.span("blocked", t0, Instant::now(), Args::EMPTY);
            }
        }
    }

    /// Enqueues the copy (and conversions) of one host batch; never waits for the device.
    fn copy(&mut self, mut batch: Batch) -> Result<DeviceBatch> {
        let stream = Arc::clone(self.device.copy_stream());
        let mut buffer = self.pool.alloc(self.plan.device_bytes)?;
        let enqueued = if self.plan.decode.is_some() {
            self.decode(&mut batch, &buffer, &stream)
        } else {
            self.enqueue(&mut batch, &mut buffer, &stream)
                .map(|ready| (ready, 0))
        };
        match enqueued {
            Ok((ready, skipped)) => {
                let mut host = HostSide::of(&batch, &self.plan.fields)?;
                if self.plan.decode.is_some() {
                    host.decoded(skipped, batch.len() * self.plan.decoded_sample_bytes);
                }
                Ok(DeviceBatch::new(
                    buffer,
                    Arc::clone(&self.plan.fields),
                    host,
                    ready,
                    stream,
                ))
            }
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

    /// Enqueues the GPU decode of `batch` into `buffer` on `stream` (the mask and indices
    /// copied first), fences the buffers, and returns the fence of the whole and the samples
    /// the stage skipped.
    fn decode(
        &mut self,
        batch: &mut Batch,
        buffer: &DeviceBuffer,
        stream: &Arc<CudaStream>,
    ) -> Result<(EventFence, usize)> {
        let staged = match (&self.plan.extras, &self.extras) {
            (Some(e), Some(pool)) => Some(stage_extras(e, pool, batch, buffer, stream)?),
            _ => None,
        };
        let Some(stage) = self.plan.decode.as_mut() else {
            return Err(Error::Shutdown);
        };
        let (ready, skipped, copied) = stage.enqueue(batch, buffer, stream)?;
        buffer.add_use(stream, ready.clone());
        if let Some(mut staged) = staged {
            staged.release_after(Box::new(ready.clone()));
        }
        let mut c = self.shared.counters();
        c.h2d_copies += 1;
        c.h2d_bytes += copied;
        Ok((ready, skipped))
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
        // The batch's bytes: all of them, less the room its last ragged field does not use.
        let n = batch.used_bytes().min(plan.host_bytes);
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
            if let Conversion::Normalize(conv) = conv {
                conv.fence_coefficients(stream, ready.clone());
            }
        }
        {
            let mut c = self.shared.counters();
            c.h2d_bytes += n as u64;
            c.h2d_copies += 1;
        }
        if self.timing.len() < 4096 {
            let args = Args::batch(batch.epoch(), batch.number()).with_bytes(n as u64);
            self.timing.push_back((start, copied, n, args));
        }
        Ok(ready)
    }

    /// With a trace, records an event on the copy stream and waits for it: the trace time at
    /// which it completed is where the copies' device times are counted from. Again at each
    /// epoch's end (the stream's work read to its end), so that the device clock's drift and
    /// the resolution of the events' float milliseconds stay small. Without a trace, nothing.
    fn anchor_timeline(&mut self) {
        let Some(track) = &self.stream_track else {
            return;
        };
        let stream = self.device.copy_stream();
        let anchored = self
            .device
            .context()
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .and_then(|e| {
                e.record(stream)?;
                e.synchronize()?;
                Ok(e)
            });
        // A driver failure here costs the copy stream's track its spans, nothing else.
        self.anchor = anchored.ok().map(|e| (e, track.ns(Instant::now())));
    }

    /// Puts the copy between `start` and `end` (completed events of the copy stream) on the
    /// copy stream's track, where it has one and an anchor.
    fn place_copy(&mut self, start: &CudaEvent, end: &CudaEvent, args: Args) {
        let (Some(track), Some((anchor, at))) = (&self.stream_track, &self.anchor) else {
            return;
        };
        // SAFETY: the three events are live, recorded on the copy stream, and completed (the
        // anchor was waited for, `end` has completed, `start` came before it), so the elapsed
        // times are defined and the calls do not wait.
        let times = unsafe {
            (
                result::event::elapsed(anchor.cu_event(), start.cu_event()),
                result::event::elapsed(start.cu_event(), end.cu_event()),
            )
        };
        if let (Ok(from_anchor), Ok(ms)) = times {
            let ns = |ms: f32| (f64::from(ms.max(0.0)) * 1e6) as u64;
            // Copies on one stream run one after the other: a start stamped before the
            // previous end (events are stamped when the stream reaches them) is moved to it.
            let begin = (at + ns(from_anchor)).max(self.last_placed);
            let end = begin + ns(ms);
            self.last_placed = end;
            track.span_ns("H2D", begin, end - begin, args);
        }
    }

    /// Reads the device time of completed copies; with `all`, waits for every pending one
    /// (at the end of an epoch only).
    fn read_timings(&mut self, all: bool) {
        let mut timed_bytes = 0u64;
        let mut busy = Duration::ZERO;
        while let Some((start, end, bytes, _)) = self.timing.front() {
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
            if let Some((start, end, _, args)) = self.timing.pop_front() {
                self.place_copy(&start, end.event(), args);
                if self.spare.len() < SPARE_EVENTS {
                    // Read and complete: nothing refers to it, it can be recorded again.
                    self.spare.push(start);
                }
            }
        }
        if all {
            self.anchor_timeline();
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
