//! The decode stage: what the copy thread does with a batch of the image pipeline's GPU decode
//! instead of copying it whole (see [`transform::image::gpu`](crate::transform::image::gpu)).
//!
//! For each host batch, on the copy stream, in order:
//!
//! 1. one copy of the batch buffer's start (the samples' metadata and labels) into the device
//!    batch; one copy per sample a worker decoded (its output-sized pixels) into scratch;
//! 2. the hardware JPEG engines decode, in one batched call, the JPEGs they support, each into
//!    scratch (only the crop's region and the resize's margin around it, where the library has
//!    region decode for them); the GPU backend decodes the rest one by one; an image nvJPEG
//!    refuses is decoded here on the CPU; one that cannot be decoded at all fails the batch
//!    with an error naming the sample (or, under `OnBadImage::Skip`, is zeroed, its label set
//!    to -1, and counted);
//! 3. one copy of the per-sample descriptors, then the two resize kernels write every image,
//!    cropped, resized, flipped, normalised and cast, into the device batch;
//! 4. an event: the device batch's `ready` fence, behind which the scratch and the host batch
//!    buffer (which nvJPEG reads the JPEGs from) are released.
//!
//! The host never waits for the device here except when a ring has gone round: a decoder's
//! states, or the stage's scratch blocks, are reused only once the GPU work that used them has
//! completed.
//!
//! nvJPEG's decoders take half a second to a second to make on an H200 (a library handle
//! 0.27 s, each state of the hardware decoder 0.2 s: `benches/RESULTS.md`, "JPEG decode on the
//! GPU"), longer than a whole epoch of a small folder. The stage makes them on a thread of its
//! own, one after the other (a second handle made beside the first pays the 0.27 s again), and
//! holds a measured split meanwhile ([`DecodeSplit::hold`](crate::transform::image::DecodeSplit)):
//! the workers decode every image, the stage copies and resizes their pixels, and the first
//! batches do not wait for nvJPEG. A batch that holds JPEGs for the GPU (a fixed split, or
//! one gathered before the hold) waits for the decoders.
//!
//! The scratch does not depend on which images a batch holds: each batch's block is sized for
//! the largest batch the stage can be sent, the batch size's worth of the largest images it has
//! seen (their decoded pixels and the resize's rows), not for this batch's images; and there
//! are `SCRATCH_BLOCKS` of them. So which images a batch holds (the shuffle,
//! the CPU/GPU split) never changes what is asked of the pool: the scratch grows only while
//! images larger than those seen arrive, and stops once the stage has seen each image once.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaEvent, CudaStream, result, sys};

use super::decoder::{GpuDecoder, HardwareDecoder, NvjpegError, Roi};
use super::ffi::Image;
use super::library::Library;
use super::memory::DecodeMemory;
use super::resize::{self, OutputSpec, ResizeKernels, ResizeSample};
use super::{DecodeOptions, DecodeReport, DecodeSetup};
use crate::codec::{self, Region};
use crate::cuda::cuda_err;
use crate::cuda::fence::EventFence;
use crate::cuda::{Device, DeviceBuffer, PinnedBacking};
use crate::error::{Error, Result};
use crate::layout::{BatchLayout, FIELD_ALIGN};
use crate::loader::Batch;
use crate::memory::{Fence, HostBuffer, HostPool};
use crate::transform::image::gpu::META_BYTES;
use crate::transform::image::{GpuDecodePlan, OnBadImage, Route, SampleRecord};

/// Bytes of pinned staging for descriptors and the stage's own CPU decodes.
const STAGING_BUDGET: u64 = 1 << 30;

/// Scratch blocks in the stage's ring: as many batches' decodes as may be on the GPU at once
/// before the stage waits for the oldest (as the hardware decoder's ring of states).
const SCRATCH_BLOCKS: usize = 3;

/// The sum of the `keep` largest sizes noted so far: a bound on what any `keep` of the noted
/// items take together, whichever they are.
#[derive(Debug)]
struct LargestSizes {
    keep: usize,
    sizes: BinaryHeap<Reverse<usize>>,
    sum: usize,
}

impl LargestSizes {
    fn new(keep: usize) -> LargestSizes {
        LargestSizes {
            keep,
            sizes: BinaryHeap::with_capacity(keep + 1),
            sum: 0,
        }
    }

    fn note(&mut self, size: usize) {
        if self.sizes.len() < self.keep {
            self.sizes.push(Reverse(size));
            self.sum += size;
        } else if self
            .sizes
            .peek()
            .is_some_and(|Reverse(least)| size > *least)
        {
            if let Some(Reverse(least)) = self.sizes.pop() {
                self.sum -= least;
            }
            self.sizes.push(Reverse(size));
            self.sum += size;
        }
    }

    fn sum(&self) -> usize {
        self.sum
    }
}

/// Timings of batches not yet read: (start, end, images the GPU decoded, host time).
type Pending = VecDeque<(CudaEvent, EventFence, usize, Duration)>;

/// What [`DecodeStage::enqueue_inner`] queued for a batch.
struct Enqueued {
    /// The device batch's fence.
    ready: EventFence,
    /// Samples skipped (bad images under `OnBadImage::Skip`).
    skipped: usize,
    /// Recorded before the batch's work: its device time runs from here to `ready`.
    start: CudaEvent,
    /// Images nvJPEG decoded, on the engines and the GPU backend.
    gpu_images: usize,
    /// Bytes copied to the device.
    copied: u64,
}

/// What the GPU backend's pass over a batch did.
#[derive(Default)]
struct BackendDecode {
    /// Images it decoded.
    images: usize,
    /// Bytes copied of the images it refused that the CPU decoded.
    cpu_bytes: usize,
    /// Images neither could decode, skipped.
    skipped: usize,
}

/// The records of a host batch: sample `p`'s at `offset + p * capacity`.
#[derive(Clone, Copy)]
struct Records<'a> {
    host: &'a [u8],
    offset: usize,
    capacity: usize,
}

impl<'a> Records<'a> {
    /// The first `len` bytes of sample `p`'s record.
    fn get(self, p: usize, len: u32) -> &'a [u8] {
        let start = self.offset + p * self.capacity;
        &self.host[start..start + self.capacity][..len as usize]
    }
}

/// The decode stage of one device loader.
pub(crate) struct DecodeStage {
    plan: GpuDecodePlan,
    out: OutputSpec,
    meta_offset: usize,
    label_offset: Option<usize>,
    records_offset: usize,
    /// Where the image field starts in the device buffer (the host batch's start, copied
    /// as it is, comes first).
    image_offset: usize,
    kernels: ResizeKernels,
    /// nvJPEG's decoders, once made (see the module docs): the hardware one where the GPU
    /// has engines and the options allow it, and the GPU backend's.
    hardware: Option<HardwareDecoder>,
    gpu: Option<GpuDecoder>,
    /// The thread making them, until the stage takes them.
    making: Option<Making>,
    /// Why they could not be made: every later batch's error.
    failed: Option<String>,
    staging: HostPool,
    roi: bool,
    pending: Pending,
    report: Arc<Mutex<DecodeReport>>,
    device: Device,
    /// Samples in a batch at most.
    batch_size: usize,
    /// The largest images' places seen (decoded pixels and resize rows, each aligned).
    largest: LargestSizes,
    /// The scratch blocks, each with the fence of the last batch that used it.
    scratch: Vec<Option<(DeviceBuffer, Option<EventFence>)>>,
    next_scratch: usize,
    /// Dropped after the decoders (their handles' memory).
    memory: Arc<DecodeMemory>,
    _lib: Arc<Library>,
}

/// nvJPEG's decoders being made on a thread of their own.
struct Making {
    thread: JoinHandle<Result<Decoders>>,
    /// When the stage was created.
    since: Instant,
    /// Batches the stage enqueued meanwhile.
    batches: u64,
}

/// What the thread makes.
struct Decoders {
    hardware: Option<HardwareDecoder>,
    gpu: GpuDecoder,
    hardware_seconds: f64,
    gpu_seconds: f64,
}

impl Decoders {
    /// The hardware decoder (if `hardware` and the GPU has engines), then the GPU backend's,
    /// on this thread, in `device`'s context.
    fn make(
        device: &Device,
        lib: &Arc<Library>,
        memory: &Arc<DecodeMemory>,
        hardware: bool,
    ) -> Result<Decoders> {
        device.bind()?;
        let t0 = Instant::now();
        let hardware = if hardware {
            HardwareDecoder::new(lib, memory).ok()
        } else {
            None
        };
        let hardware_seconds = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let gpu = GpuDecoder::new(lib, memory).map_err(|e| e.into_error(memory))?;
        Ok(Decoders {
            hardware,
            gpu,
            hardware_seconds,
            gpu_seconds: t1.elapsed().as_secs_f64(),
        })
    }
}

/// One sample's place in the batch's scratch.
struct Item {
    record: SampleRecord,
    /// The decoded image (or region) and its size.
    src: usize,
    width: u32,
    height: u32,
    /// The region decoded, in the image's pixels (`None`: all of it).
    roi: Option<Roi>,
    /// The crop in the decoded pixels.
    region: Region,
    tmp: usize,
    row0: u32,
    rows: u32,
    /// Written as zeros.
    zero: bool,
}

fn aligned(n: usize) -> usize {
    n.next_multiple_of(FIELD_ALIGN)
}

impl DecodeStage {
    /// The stage for batches laid out as `layout` by a transform with `plan`, on `device`.
    pub(crate) fn new(
        device: &Device,
        plan: GpuDecodePlan,
        layout: &BatchLayout,
        opts: &DecodeOptions,
        workers: usize,
    ) -> Result<DecodeStage> {
        let t0 = Instant::now();
        let lib = Library::get()?;
        let t_library = t0.elapsed();
        let out = OutputSpec::new(plan.size, plan.dtype, plan.layout, plan.normalize)?;
        let offset = |k: usize| {
            layout
                .field_offset(k)
                .ok_or_else(|| Error::mismatch(format!("the GPU decode's batch has no field {k}")))
        };
        let meta_offset = offset(plan.meta_field)?;
        let label_offset = plan.label_field.map(offset).transpose()?;
        let records_offset = offset(plan.records_field)?;
        let image_offset = aligned(records_offset);
        let stream = Arc::clone(device.copy_stream());
        let batch = layout.batch_size();
        let budget = opts
            .memory
            .unwrap_or_else(|| default_memory(batch, plan.size));
        let memory = Arc::new(DecodeMemory::new(device, stream, budget, budget / 4));
        let t1 = Instant::now();
        let kernels = ResizeKernels::load(device.context(), device.sm_count())?;
        let t_kernels = t1.elapsed();
        plan.split.set_workers(workers);
        plan.split.hold();
        let making = {
            let (device, lib, memory) = (device.clone(), Arc::clone(&lib), Arc::clone(&memory));
            let hardware = opts.hardware;
            std::thread::Builder::new()
                .name("gpufeed-nvjpeg-setup".into())
                .spawn(move || Decoders::make(&device, &lib, &memory, hardware))
        };
        let making = match making {
            Ok(thread) => thread,
            Err(e) => {
                plan.split.release();
                return Err(Error::spawn(
                    "decode",
                    "the thread that makes nvJPEG's decoders",
                    e,
                ));
            }
        };
        let report = DecodeReport {
            library: lib.path().to_owned(),
            version: lib.version(),
            roi: opts.roi,
            memory_budget: budget,
            kernels: kernels.image().to_string(),
            setup: DecodeSetup {
                library_seconds: t_library.as_secs_f64(),
                kernels_seconds: t_kernels.as_secs_f64(),
                ..DecodeSetup::default()
            },
            ..DecodeReport::default()
        };
        Ok(DecodeStage {
            out,
            meta_offset,
            label_offset,
            records_offset,
            image_offset,
            kernels,
            hardware: None,
            gpu: None,
            making: Some(Making {
                thread: making,
                since: t0,
                batches: 0,
            }),
            failed: None,
            staging: HostPool::with_backing(PinnedBacking::small(device), STAGING_BUDGET),
            roi: opts.roi,
            pending: VecDeque::new(),
            report: Arc::new(Mutex::new(report)),
            device: device.clone(),
            batch_size: batch,
            largest: LargestSizes::new(batch),
            scratch: (0..SCRATCH_BLOCKS).map(|_| None).collect(),
            next_scratch: 0,
            memory,
            plan,
            _lib: lib,
        })
    }

    /// Where the image field starts in the device buffer.
    pub(crate) fn image_offset(&self) -> usize {
        self.image_offset
    }

    /// Bytes of the image field of a full batch of `n`.
    pub(crate) fn image_bytes(&self, n: usize) -> usize {
        n * self.out.sample_bytes
    }

    /// The per-sample shape of the image field.
    pub(crate) fn image_shape(&self) -> Vec<usize> {
        let (h, w) = (self.out.height as usize, self.out.width as usize);
        match self.plan.layout {
            crate::transform::image::Layout::Chw => vec![3, h, w],
            crate::transform::image::Layout::Hwc => vec![h, w, 3],
        }
    }

    /// The output dtype.
    pub(crate) fn dtype(&self) -> crate::format::DType {
        self.plan.dtype
    }

    /// The label field's host offset, if any.
    pub(crate) fn label_offset(&self) -> Option<usize> {
        self.label_offset
    }

    /// The stage's figures (shared: the device loader reads them).
    pub(crate) fn report(&self) -> Arc<Mutex<DecodeReport>> {
        Arc::clone(&self.report)
    }

    /// Enqueues the decode of `batch` into `buffer` on `stream` (see the module docs) and
    /// returns the fence of the whole, the samples skipped, and the bytes it sends to the
    /// device: the batch's metadata and labels, the workers' pixels, the JPEGs nvJPEG reads
    /// from the host batch, the CPU fallbacks' pixels and the resize's descriptors. On an
    /// error the stream is synchronised before any buffer is let go of.
    pub(crate) fn enqueue(
        &mut self,
        batch: &mut Batch,
        buffer: &DeviceBuffer,
        stream: &Arc<CudaStream>,
    ) -> Result<(EventFence, usize, u64)> {
        self.read_timings();
        self.take_decoders(false)?;
        let t0 = Instant::now();
        let mut staged = Vec::new();
        let done = self.enqueue_inner(batch, buffer, stream, &mut staged);
        match done {
            Ok(Enqueued {
                ready,
                skipped,
                start,
                gpu_images,
                copied,
            }) => {
                batch.buffer_mut().release_after(Box::new(ready.clone()));
                for mut s in staged {
                    s.release_after(Box::new(ready.clone()));
                }
                self.pending
                    .push_back((start, ready.clone(), gpu_images, t0.elapsed()));
                if let Some(m) = &mut self.making {
                    m.batches += 1;
                }
                let pool = self.memory.device.stats();
                if let Ok(mut r) = self.report.lock() {
                    r.batches += 1;
                    r.host_seconds += t0.elapsed().as_secs_f64();
                    r.device_pool = pool;
                }
                Ok((ready, skipped, copied))
            }
            Err(e) => {
                // Work that reads the host batch, the scratch or the staging may be queued.
                let _ = stream.synchronize();
                Err(e)
            }
        }
    }

    /// Takes nvJPEG's decoders from the thread making them once it has (waiting for it if
    /// `wait`), releases the split and completes the report. If they could not be made, that
    /// is this batch's error, and every later one's.
    fn take_decoders(&mut self, wait: bool) -> Result<()> {
        if let Some(why) = &self.failed {
            return Err(Error::Cuda {
                op: "nvJPEG",
                what: format!("the GPU decoders could not be made: {why}"),
            });
        }
        let Some(making) = self.making.take_if(|m| wait || m.thread.is_finished()) else {
            return Ok(());
        };
        let made = making.thread.join().unwrap_or_else(|_| {
            Err(Error::Cuda {
                op: "nvJPEG",
                what: "the thread making the GPU decoders panicked".into(),
            })
        });
        let d = match made {
            Ok(d) => d,
            Err(e) => {
                self.failed = Some(e.to_string());
                return Err(e);
            }
        };
        let (engines, cores) = d
            .hardware
            .as_ref()
            .map_or((0, 0), |h| h.handle().hardware_info());
        if let Ok(mut r) = self.report.lock() {
            r.hardware = d.hardware.is_some();
            r.hardware_engines = engines;
            r.hardware_cores = cores;
            r.pooled_memory = d.gpu.handle().pooled();
            r.setup.hardware_seconds = d.hardware_seconds;
            r.setup.gpu_seconds = d.gpu_seconds;
            r.setup.ready_seconds = making.since.elapsed().as_secs_f64();
            r.setup.batches_before_ready = making.batches;
        }
        self.hardware = d.hardware;
        self.gpu = Some(d.gpu);
        self.plan.split.release();
        Ok(())
    }

    /// Queues one batch's decode on `stream` (the module docs' steps 1 to 4). Every source it
    /// queues a copy from is the batch's pinned host buffer or a pinned staging buffer put in
    /// `staged`, which `enqueue` releases behind the batch's `ready` fence; every destination
    /// is inside `buffer` or the scratch block taken here, fenced behind `ready` too; on an
    /// error `enqueue` synchronises the stream before either is let go of.
    fn enqueue_inner(
        &mut self,
        batch: &Batch,
        buffer: &DeviceBuffer,
        stream: &Arc<CudaStream>,
        staged: &mut Vec<HostBuffer>,
    ) -> Result<Enqueued> {
        let n = batch.len();
        let host = batch.buffer().as_slice();
        let records = Records {
            host,
            offset: self.records_offset,
            capacity: self.plan.capacity,
        };
        let (mut items, scratch_bytes) = self.place(batch)?;
        if items
            .iter()
            .any(|it| matches!(it.record.route, Route::Hardware | Route::Gpu))
        {
            self.take_decoders(true)?;
        }
        // The largest batch: `batch_size` descriptors and the largest images seen, which this
        // batch's (noted by `place`) cannot exceed.
        let bound =
            aligned(self.batch_size * std::mem::size_of::<ResizeSample>()) + self.largest.sum();
        let (slot, scratch) = self.take_scratch(scratch_bytes.max(bound).next_power_of_two())?;
        let base = scratch.addr();
        self.device.bind()?;
        scratch.order_on(stream)?;
        buffer.order_on(stream)?;
        let start = self
            .device
            .context()
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(cuda_err("create an event"))?;
        start
            .record(stream)
            .map_err(cuda_err("record an event (cuEventRecord)"))?;
        // SAFETY: the source is the batch's pinned host buffer and the destination the start
        // of `buffer` (`records_offset <= image_offset`), both fenced behind `ready` (see the
        // function's docs).
        unsafe {
            result::memcpy_htod_async(
                buffer.addr(),
                &host[..self.records_offset],
                stream.cu_stream(),
            )
        }
        .map_err(cuda_err("copy a batch's labels (cuMemcpyHtoDAsync)"))?;
        // The metadata and labels, then every record's bytes (pixels copied here, JPEGs that
        // nvJPEG reads from the host batch), the fallbacks and the descriptors below.
        let mut copied = self.records_offset
            + items
                .iter()
                .filter(|it| it.record.route != Route::Skipped)
                .map(|it| it.record.len as usize)
                .sum::<usize>();
        let (hardware, mut gpu) = self.copy_pixels_and_route(&items, records, base, stream)?;
        let hardware_images =
            self.decode_on_engines(&items, records, &hardware, base, stream, &mut gpu);
        let backend = self.decode_on_backend(
            batch, &mut items, records, &gpu, base, buffer, stream, staged,
        )?;
        copied += backend.cpu_bytes;
        let max_rows = self.copy_descriptors(&items, base, stream, staged)?;
        copied += n * std::mem::size_of::<ResizeSample>();
        // SAFETY: the descriptors were just copied to `base`; each addresses its image and rows
        // in `scratch` as placed above, and the output is the image field of `buffer`, which
        // holds `n` samples' images from `image_offset` (the plan's layout); all fenced
        // behind `ready`.
        unsafe {
            self.kernels.launch(
                stream,
                base,
                n,
                max_rows,
                buffer.addr() + self.image_offset as u64,
                &self.out,
            )
        }?;
        // Timed: `read_timings` measures the batch's device time from `start` to it (the
        // split's GPU rate); an untimed event made every reading 0.
        let ready = EventFence::record_timed(stream)?;
        scratch.add_use(stream, ready.clone());
        self.scratch[slot] = Some((scratch, Some(ready.clone())));
        Ok(Enqueued {
            ready,
            skipped: backend.skipped,
            start,
            gpu_images: hardware_images + backend.images,
            copied: copied as u64,
        })
    }

    /// Reads each sample's record and places it in the scratch: descriptors first, then the
    /// images, then the resize's rows. Returns the items and the scratch's bytes.
    fn place(&mut self, batch: &Batch) -> Result<(Vec<Item>, usize)> {
        let n = batch.len();
        let host = batch.buffer().as_slice();
        let (out_h, out_w) = (self.out.height, self.out.width);
        let mut items = Vec::with_capacity(n);
        let mut at = aligned(n * std::mem::size_of::<ResizeSample>());
        for p in 0..n {
            let meta = &host[self.meta_offset + p * META_BYTES..];
            let record = SampleRecord::read(meta).ok_or_else(|| {
                Error::mismatch(format!(
                    "sample {} of batch {}: its GPU-decode record is not one a worker wrote",
                    batch.indices().get(p).copied().unwrap_or(0),
                    batch.number()
                ))
            })?;
            let zero = record.route == Route::Skipped;
            let (roi, width, height, region) = match record.route {
                Route::Hardware | Route::Gpu if self.roi => {
                    let roi = wide_roi(record.region, record.width, record.height, out_w, out_h);
                    let region = Region {
                        left: record.region.left - f64::from(roi.x),
                        top: record.region.top - f64::from(roi.y),
                        ..record.region
                    };
                    (Some(roi), roi.width, roi.height, region)
                }
                Route::Skipped => (None, 1, 1, record.region),
                _ => (None, record.width, record.height, record.region),
            };
            // Each sample's places are sized for its whole image (whatever the region decoded
            // and the rows resampled): the block's size then depends on the images seen, not
            // on this batch's crops (see the module docs).
            let src = at;
            let (full_w, full_h) = if zero {
                (0, 0)
            } else {
                (record.width as usize, record.height as usize)
            };
            let pixels = aligned(3 * full_w * full_h);
            let resize_rows = aligned(full_h * out_w as usize * 3);
            self.largest.note(pixels + resize_rows);
            at += pixels;
            let (row0, rows) = resize::source_rows(region.top, region.height, height, out_h);
            let tmp = at;
            at += resize_rows;
            items.push(Item {
                record,
                src,
                width,
                height,
                roi,
                region,
                tmp,
                row0,
                rows,
                zero,
            });
        }
        Ok((items, at))
    }

    /// Copies the workers' pixels into the scratch (at `base`), and sorts the JPEGs between
    /// the hardware engines (those they support) and the GPU backend: returns the two lists of
    /// positions.
    fn copy_pixels_and_route(
        &self,
        items: &[Item],
        records: Records<'_>,
        base: u64,
        stream: &Arc<CudaStream>,
    ) -> Result<(Vec<usize>, Vec<usize>)> {
        let (mut hardware, mut gpu) = (Vec::new(), Vec::new());
        for (p, it) in items.iter().enumerate() {
            match it.record.route {
                Route::Pixels => {
                    let bytes = records.get(p, it.record.len);
                    // SAFETY: the source is the record in the batch's pinned host buffer; the
                    // destination the item's place in the scratch, sized for the pixels; both
                    // fenced behind `ready` (see `enqueue_inner`).
                    unsafe {
                        result::memcpy_htod_async(base + it.src as u64, bytes, stream.cu_stream())
                    }
                    .map_err(cuda_err("copy a worker's pixels (cuMemcpyHtoDAsync)"))?;
                }
                Route::Hardware => match &self.hardware {
                    Some(hw)
                        if hw.supports(
                            records.get(p, it.record.len),
                            it.roi.filter(|_| hw.has_roi()),
                        ) =>
                    {
                        hardware.push(p)
                    }
                    _ => gpu.push(p),
                },
                Route::Gpu => gpu.push(p),
                Route::Skipped => {}
            }
        }
        Ok((hardware, gpu))
    }

    /// Decodes the JPEGs at `hardware` on the hardware engines, in one batched call, each into
    /// its place in the scratch. What they cannot take goes to `gpu`: all of them if the call
    /// fails (nvJPEG gives no status per image), and the regions where the library has no
    /// region decode on the engines. Returns the images decoded.
    fn decode_on_engines(
        &mut self,
        items: &[Item],
        records: Records<'_>,
        hardware: &[usize],
        base: u64,
        stream: &Arc<CudaStream>,
        gpu: &mut Vec<usize>,
    ) -> usize {
        let Some(hw) = self.hardware.as_mut().filter(|_| !hardware.is_empty()) else {
            return 0;
        };
        let inputs: Vec<(&[u8], Image, Option<Roi>)> = hardware
            .iter()
            .map(|&p| {
                let it = &items[p];
                (
                    records.get(p, it.record.len),
                    Image::interleaved(base + it.src as u64, 3 * it.width as usize),
                    it.roi,
                )
            })
            .collect();
        let (whole, regions): (Vec<_>, Vec<_>) = if hw.has_roi() {
            (inputs, Vec::new())
        } else {
            inputs.into_iter().partition(|(_, _, r)| r.is_none())
        };
        // SAFETY: every output is its item's place in the scratch, sized for its region at
        // pitch `3 * width`; the scratch and the host records are fenced behind `ready` (see
        // `enqueue_inner`).
        let decoded = unsafe { hw.decode(&whole, stream) };
        let mut images = whole.len();
        if decoded.is_err() {
            gpu.extend_from_slice(hardware);
            images = 0;
        } else if !regions.is_empty() {
            gpu.extend(hardware.iter().copied().filter(|&p| items[p].roi.is_some()));
        }
        self.plan
            .stats
            .hardware
            .fetch_add(images as u64, Ordering::Relaxed);
        images
    }

    /// Decodes the JPEGs at `gpu` on the GPU backend, one by one, each into its place in the
    /// scratch; one it refuses is decoded here on the CPU, and one neither can decode fails
    /// the batch naming the sample, or is skipped under `OnBadImage::Skip`.
    #[allow(clippy::too_many_arguments)]
    fn decode_on_backend(
        &mut self,
        batch: &Batch,
        items: &mut [Item],
        records: Records<'_>,
        gpu: &[usize],
        base: u64,
        buffer: &DeviceBuffer,
        stream: &Arc<CudaStream>,
        staged: &mut Vec<HostBuffer>,
    ) -> Result<BackendDecode> {
        let mut done = BackendDecode::default();
        for &p in gpu {
            let it = &items[p];
            let bytes = records.get(p, it.record.len);
            let out = Image::interleaved(base + it.src as u64, 3 * it.width as usize);
            let Some(decoder) = self.gpu.as_mut() else {
                return Err(Error::Cuda {
                    op: "nvJPEG",
                    what: "a JPEG for the GPU backend before its decoder was made".into(),
                });
            };
            // SAFETY: as for the hardware decode: the output is the item's place in the
            // scratch, sized for its region; both it and the record are fenced behind `ready`.
            let Err(refused) = (unsafe { decoder.decode(bytes, out, it.roi, stream) }) else {
                done.images += 1;
                self.plan.stats.gpu.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            let index = batch.indices().get(p).copied().unwrap_or(0);
            match self.decode_on_cpu(bytes, index, it, base, stream, staged) {
                Ok(pixels) => {
                    done.cpu_bytes += pixels;
                    self.plan
                        .stats
                        .stage_fallback
                        .fetch_add(1, Ordering::Relaxed);
                }
                Err(_) if self.plan.on_bad == OnBadImage::Skip => {
                    done.skipped += 1;
                    self.skip(p, items, buffer, stream)?;
                }
                Err(e) => {
                    return Err(Error::Sample {
                        index,
                        batch: batch.number(),
                        source: Box::new(codec_error(index, refused, e)),
                    });
                }
            }
        }
        Ok(done)
    }

    /// Copies the resize kernels' descriptors, one per item, to the start of the scratch (at
    /// `base`), through a pinned staging buffer put in `staged`; returns the most source rows
    /// an item resamples.
    fn copy_descriptors(
        &mut self,
        items: &[Item],
        base: u64,
        stream: &Arc<CudaStream>,
        staged: &mut Vec<HostBuffer>,
    ) -> Result<u32> {
        const DESCRIPTOR: usize = std::mem::size_of::<ResizeSample>();
        let bytes = items.len() * DESCRIPTOR;
        let mut desc = self.staging.acquire(bytes)?;
        let mut max_rows = 1;
        for (p, it) in items.iter().enumerate() {
            let s = if it.zero {
                ResizeSample {
                    kind: resize::KIND_ZERO,
                    ..ResizeSample::default()
                }
            } else {
                max_rows = max_rows.max(it.rows);
                ResizeSample {
                    src: base + it.src as u64,
                    tmp: base + it.tmp as u64,
                    left: it.region.left,
                    top: it.region.top,
                    width: it.region.width,
                    height: it.region.height,
                    pitch: 3 * it.width,
                    src_w: it.width,
                    src_h: it.height,
                    row0: it.row0,
                    rows: it.rows,
                    flip: u32::from(it.record.flip),
                    kind: 0,
                    pad: 0,
                }
            };
            desc.as_mut_slice()[p * DESCRIPTOR..(p + 1) * DESCRIPTOR]
                .copy_from_slice(&s.to_bytes());
        }
        // SAFETY: the source is a pinned staging buffer, released behind `ready` once in
        // `staged`; the destination is the descriptors' place at the start of the scratch.
        unsafe { result::memcpy_htod_async(base, &desc.as_slice()[..bytes], stream.cu_stream()) }
            .map_err(cuda_err("copy the resize descriptors (cuMemcpyHtoDAsync)"))?;
        staged.push(desc);
        Ok(max_rows)
    }

    /// The ring's next scratch block, at least `bytes` long, once the batch that used it last
    /// has completed on the GPU; a shorter one goes back to the pool for a new one. On an
    /// error before the block is put back, it goes back to the pool (fenced by its uses).
    fn take_scratch(&mut self, bytes: usize) -> Result<(usize, DeviceBuffer)> {
        let slot = self.next_scratch;
        self.next_scratch = (slot + 1) % self.scratch.len();
        if let Some((block, fence)) = self.scratch[slot].take() {
            if let Some(f) = fence {
                f.wait();
            }
            if block.len() >= bytes {
                return Ok((slot, block));
            }
        }
        Ok((slot, self.memory.scratch(bytes)?))
    }

    /// Decodes on this thread a JPEG nvJPEG refused, its region into a pinned staging buffer,
    /// copied into the item's place in the scratch; returns the bytes copied.
    fn decode_on_cpu(
        &self,
        bytes: &[u8],
        index: u64,
        it: &Item,
        base: u64,
        stream: &Arc<CudaStream>,
        staged: &mut Vec<HostBuffer>,
    ) -> Result<usize> {
        let name = format!("sample {index}");
        let (mut pixels, mut scratch) = (Vec::new(), Vec::new());
        let d = codec::decode_rgb8(bytes, &name, &self.plan.limits, &mut pixels, &mut scratch)?;
        if (d.width, d.height) != (it.record.width, it.record.height) {
            return Err(codec::image_error(
                &name,
                format!(
                    "decodes to {}x{}, but its header declares {}x{}",
                    d.width, d.height, it.record.width, it.record.height
                ),
            ));
        }
        let roi = it.roi.unwrap_or(Roi {
            x: 0,
            y: 0,
            width: d.width,
            height: d.height,
        });
        let pitch = 3 * roi.width as usize;
        let mut out = self.staging.acquire(pitch * roi.height as usize)?;
        let full = 3 * d.width as usize;
        for (r, row) in out
            .as_mut_slice()
            .chunks_exact_mut(pitch)
            .take(roi.height as usize)
            .enumerate()
        {
            let from = (roi.y as usize + r) * full + 3 * roi.x as usize;
            row.copy_from_slice(&pixels[from..from + pitch]);
        }
        // SAFETY: the staging buffer is pinned and released behind `ready`; the destination
        // is the item's place in the scratch, sized for this region.
        unsafe {
            result::memcpy_htod_async(
                base + it.src as u64,
                &out.as_slice()[..pitch * roi.height as usize],
                stream.cu_stream(),
            )
        }
        .map_err(cuda_err("copy a CPU-decoded image (cuMemcpyHtoDAsync)"))?;
        staged.push(out);
        Ok(pitch * roi.height as usize)
    }

    /// Marks sample `p` skipped: written as zeros, its label set to -1 on the device.
    fn skip(
        &self,
        p: usize,
        items: &mut [Item],
        buffer: &DeviceBuffer,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        items[p].zero = true;
        if let Some(label) = self.label_offset {
            // SAFETY: the label field's slot of sample `p`, inside the copied prefix of
            // `buffer`, fenced behind `ready`.
            unsafe {
                result::memset_d8_async(
                    buffer.addr() + (label + 8 * p) as u64,
                    0xFF,
                    8,
                    stream.cu_stream(),
                )
            }
            .map_err(cuda_err("set a skipped sample's label (cuMemsetD8Async)"))?;
        }
        Ok(())
    }

    /// Reads the device time of completed batches and tells the split what the GPU costs.
    fn read_timings(&mut self) {
        while let Some((start, end, images, host)) = self.pending.front() {
            if !end.event().try_is_complete().unwrap_or(true) {
                break;
            }
            // SAFETY: both events are live, recorded on the copy stream, and `end` completed.
            let ms = unsafe { result::event::elapsed(start.cu_event(), end.event().cu_event()) }
                .unwrap_or(0.0);
            let device = Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3);
            let busy = device.max(*host);
            self.plan
                .split
                .measured_gpu(busy.as_nanos() as u64, *images);
            if let Ok(mut r) = self.report.lock() {
                r.device_seconds += device.as_secs_f64();
                r.images += *images as u64;
                r.cpu_share = self.plan.split.share();
            }
            self.pending.pop_front();
        }
    }
}

impl Drop for DecodeStage {
    fn drop(&mut self) {
        // Decoders still being made are dropped here, before the stage's memory and library
        // (the thread holds both, so this is order, not safety).
        if let Some(m) = self.making.take() {
            let _ = m.thread.join();
        }
    }
}

/// The error of an image neither nvJPEG nor the CPU decoder could decode.
fn codec_error(index: u64, refused: NvjpegError, cpu: Error) -> Error {
    match cpu {
        Error::Image {
            source_name,
            what,
            setting,
            source,
        } => Error::Image {
            source_name,
            what: format!("nvJPEG refused it ({refused}), and the CPU decoder: {what}"),
            setting,
            source,
        },
        other => codec::image_error(
            &format!("sample {index}"),
            format!("nvJPEG refused it ({refused}), and the CPU decoder: {other}"),
        ),
    }
}

/// The region to decode for a crop: the crop and the resize's support around it (the filter
/// reads up to `max(scale, 1)` pixels beyond each output pixel's centre), plus a pixel, within
/// the image.
fn wide_roi(crop: Region, width: u32, height: u32, out_w: u32, out_h: u32) -> Roi {
    let margin = |len: f64, out: u32| (len / f64::from(out)).max(1.0).ceil() + 2.0;
    let (mx, my) = (margin(crop.width, out_w), margin(crop.height, out_h));
    let x0 = (crop.left - mx).floor().max(0.0) as u32;
    let y0 = (crop.top - my).floor().max(0.0) as u32;
    let x1 = ((crop.left + crop.width + mx).ceil() as u32)
        .min(width)
        .max(x0 + 1);
    let y1 = ((crop.top + crop.height + my).ceil() as u32)
        .min(height)
        .max(y0 + 1);
    Roi {
        x: x0,
        y: y0,
        width: x1 - x0,
        height: y1 - y0,
    }
}

/// The default device budget of a stage: eight batches of decoded 1024 x 768 images, plus the
/// resize's rows, at least 1 GiB.
fn default_memory(batch: usize, (h, w): (u32, u32)) -> u64 {
    let image = 1024 * 768 * 3 + 1024 * w as u64 * 3;
    let _ = h;
    (8 * batch as u64 * image).max(1 << 30)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scratch_bound_is_the_largest_sizes_whatever_their_order() {
        let sizes = [5usize, 1, 9, 3, 9, 2, 7, 4, 8, 6];
        let mut want: Vec<usize> = sizes.to_vec();
        want.sort_unstable_by(|a, b| b.cmp(a));
        let top4: usize = want[..4].iter().sum();
        for rotation in 0..sizes.len() {
            let mut order = sizes.to_vec();
            order.rotate_left(rotation);
            order.reverse();
            let mut largest = LargestSizes::new(4);
            for (k, &s) in order.iter().enumerate() {
                largest.note(s);
                // Any four of those noted so far fit in the bound.
                let mut seen = order[..=k].to_vec();
                seen.sort_unstable_by(|a, b| b.cmp(a));
                assert_eq!(largest.sum(), seen.iter().take(4).sum::<usize>());
            }
            assert_eq!(largest.sum(), top4, "order {order:?}");
        }
        // A batch of one keeps the largest; nothing noted is nothing.
        let mut one = LargestSizes::new(1);
        assert_eq!(one.sum(), 0);
        for s in sizes {
            one.note(s);
        }
        assert_eq!(one.sum(), 9);
    }

    #[test]
    fn the_region_decoded_covers_the_resize_support_within_the_image() {
        let crop = Region {
            left: 100.0,
            top: 50.0,
            width: 300.0,
            height: 200.0,
        };
        let roi = wide_roi(crop, 500, 375, 224, 224);
        // Across, 300 / 224: a support of 2 (rounded up) and 2 more; down, 200 / 224: 1 and 2.
        assert_eq!((roi.x, roi.y, roi.width, roi.height), (96, 47, 308, 206));
        // Every tap of every output pixel is inside the region.
        let left = crop.left - f64::from(roi.x);
        for x in 0..224 {
            let (first, n) = resize::taps(crop.left, crop.width, 500, 224, x);
            assert!(
                first >= roi.x && first + n <= roi.x + roi.width,
                "column {x}"
            );
            let (f2, n2) = resize::taps(left, crop.width, roi.width, 224, x);
            assert_eq!(
                (f2 + roi.x, n2),
                (first, n),
                "column {x}: the same taps in the region"
            );
        }
        // At the image's edges the region stops there.
        let edge = Region {
            left: 0.0,
            top: 0.0,
            width: 500.0,
            height: 375.0,
        };
        let roi = wide_roi(edge, 500, 375, 224, 224);
        assert_eq!((roi.x, roi.y, roi.width, roi.height), (0, 0, 500, 375));
    }
}
