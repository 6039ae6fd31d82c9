//! Safe faces over nvJPEG's handles: [`Handle`] (a library handle whose memory comes from a
//! [`DecodeMemory`]), [`HardwareDecoder`] (the batched decode on the hardware JPEG engines)
//! and [`GpuDecoder`] (the decoupled decode, one image at a time, with the GPU-assisted
//! Huffman backend for baseline JPEGs and the hybrid one for progressive ones).
//!
//! Every call's status is checked; a failure is the [`NvjpegError`] of that call, which the
//! stage turns into a fallback for the image (the next decoder, then the CPU) or an error
//! naming the sample. Each decoder keeps a small ring of states, each with the fence of its
//! last use: a state is reused only once the GPU work that read its buffers has completed
//! (waiting, on the stage's thread, only when the ring has gone round).

use std::ffi::{c_int, c_uint, c_void};
use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::ffi::{self, Image, Status};
use super::library::Library;
use super::memory::{self, DecodeMemory};
use crate::cuda::fence::EventFence;
use crate::error::Error;
use crate::memory::Fence;

/// A failed nvJPEG call: which, and its status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct NvjpegError {
    pub(crate) op: &'static str,
    pub(crate) status: Status,
}

impl std::fmt::Display for NvjpegError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} returned {} ({})",
            self.op,
            ffi::status_name(self.status),
            self.status
        )
    }
}

impl std::error::Error for NvjpegError {}

impl NvjpegError {
    /// As an [`Error::Cuda`] (for failures that are not one image's).
    pub(crate) fn into_error(self, memory: &DecodeMemory) -> Error {
        let what = match memory.take_failure() {
            Some(why) => format!("{self}: {why}"),
            None => self.to_string(),
        };
        Error::Cuda { op: "nvJPEG", what }
    }
}

fn check(op: &'static str, status: Status) -> std::result::Result<(), NvjpegError> {
    if status == ffi::STATUS_SUCCESS {
        Ok(())
    } else {
        Err(NvjpegError { op, status })
    }
}

/// A region of the image to decode (nvJPEG's ROI), in pixels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Roi {
    pub(crate) x: u32,
    pub(crate) y: u32,
    pub(crate) width: u32,
    pub(crate) height: u32,
}

/// An nvJPEG library handle of one backend.
pub(crate) struct Handle {
    lib: Arc<Library>,
    raw: ffi::Handle,
    /// Where its memory comes from; outlives `raw` (dropped after it).
    memory: Arc<DecodeMemory>,
    /// Its memory comes from `memory` (nvjpegCreateExV2); else nvJPEG's own allocators.
    pooled: bool,
}

// SAFETY: an nvJPEG library handle is thread safe (nvJPEG's documentation); the memory context
// it points at is `Sync`.
unsafe impl Send for Handle {}
// SAFETY: as above.
unsafe impl Sync for Handle {}

impl Handle {
    /// A handle of `backend` whose memory comes from `memory`, with chroma upsampling by
    /// interpolation where the library has it.
    pub(crate) fn new(
        lib: &Arc<Library>,
        backend: c_int,
        memory: &Arc<DecodeMemory>,
    ) -> std::result::Result<Handle, NvjpegError> {
        let ctx = Arc::as_ptr(memory).cast_mut().cast::<c_void>();
        let mut last = NvjpegError {
            op: "nvjpegCreateEx",
            status: 0,
        };
        for flags in [ffi::FLAGS_UPSAMPLING_WITH_INTERPOLATION, 0 as c_uint] {
            let mut raw: ffi::Handle = std::ptr::null_mut();
            let (status, pooled, op) = match lib.api.nvjpegCreateExV2 {
                Some(create) => {
                    let mut dev = ffi::DevAllocatorV2 {
                        dev_malloc: memory::dev_malloc,
                        dev_free: memory::dev_free,
                        dev_ctx: ctx,
                    };
                    let mut pinned = ffi::PinnedAllocatorV2 {
                        pinned_malloc: memory::pinned_malloc,
                        pinned_free: memory::pinned_free,
                        pinned_ctx: ctx,
                    };
                    // SAFETY: both allocator structs live for the call (nvJPEG copies them);
                    // `ctx` is a `DecodeMemory` that outlives the handle (kept in `memory`).
                    let st = unsafe { create(backend, &mut dev, &mut pinned, flags, &mut raw) };
                    (st, true, "nvjpegCreateExV2")
                }
                None => {
                    // SAFETY: null allocators select nvJPEG's own (cudaMalloc, cudaHostAlloc).
                    let st = unsafe {
                        (lib.api.nvjpegCreateEx)(
                            backend,
                            std::ptr::null_mut(),
                            std::ptr::null_mut(),
                            flags,
                            &mut raw,
                        )
                    };
                    (st, false, "nvjpegCreateEx")
                }
            };
            if status == ffi::STATUS_SUCCESS && !raw.is_null() {
                return Ok(Handle {
                    lib: Arc::clone(lib),
                    raw,
                    memory: Arc::clone(memory),
                    pooled,
                });
            }
            last = NvjpegError { op, status };
            // An architecture or backend the library does not support fails either way.
            if matches!(status, 4 | 7 | 9) {
                break;
            }
        }
        Err(last)
    }

    pub(crate) fn api(&self) -> &ffi::Api {
        &self.lib.api
    }

    pub(crate) fn raw(&self) -> ffi::Handle {
        self.raw
    }

    /// Whether nvJPEG's memory comes from the stage's pools.
    pub(crate) fn pooled(&self) -> bool {
        self.pooled
    }

    /// The hardware engines and cores per engine (0, 0 where the library cannot say).
    pub(crate) fn hardware_info(&self) -> (u32, u32) {
        let Some(info) = self.api().nvjpegGetHardwareDecoderInfo else {
            return (0, 0);
        };
        let (mut engines, mut cores): (c_uint, c_uint) = (0, 0);
        // SAFETY: a live handle; two ints written.
        let st = unsafe { info(self.raw, &mut engines, &mut cores) };
        if st == ffi::STATUS_SUCCESS {
            (engines, cores)
        } else {
            (0, 0)
        }
    }

    /// A new JPEG stream (parsed bitstream) of this handle.
    fn stream(&self) -> std::result::Result<JpegStream, NvjpegError> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: a live handle; the stream is destroyed by `JpegStream`'s drop.
        check("nvjpegJpegStreamCreate", unsafe {
            (self.api().nvjpegJpegStreamCreate)(self.raw, &mut raw)
        })?;
        Ok(JpegStream {
            api: Arc::clone(&self.lib),
            raw,
        })
    }

    /// New decode parameters: interleaved RGB, no ROI.
    fn params(&self) -> std::result::Result<Params, NvjpegError> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: a live handle; destroyed by `Params`' drop.
        check("nvjpegDecodeParamsCreate", unsafe {
            (self.api().nvjpegDecodeParamsCreate)(self.raw, &mut raw)
        })?;
        let p = Params {
            lib: Arc::clone(&self.lib),
            raw,
        };
        // SAFETY: live parameters.
        check("nvjpegDecodeParamsSetOutputFormat", unsafe {
            (self.api().nvjpegDecodeParamsSetOutputFormat)(raw, ffi::OUTPUT_RGBI)
        })?;
        Ok(p)
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: the handle is live and destroyed once; every state, stream and buffer made
        // from it was dropped before (they are fields of decoders that own the handle and
        // drop first).
        let _ = unsafe { (self.lib.api.nvjpegDestroy)(self.raw) };
    }
}

struct JpegStream {
    api: Arc<Library>,
    raw: ffi::Stream,
}

impl Drop for JpegStream {
    fn drop(&mut self) {
        // SAFETY: live, destroyed once.
        let _ = unsafe { (self.api.api.nvjpegJpegStreamDestroy)(self.raw) };
    }
}

struct Params {
    lib: Arc<Library>,
    raw: ffi::Params,
}

impl Params {
    fn set_roi(&self, roi: Option<Roi>) -> std::result::Result<(), NvjpegError> {
        let (x, y, w, h) = match roi {
            Some(r) => (
                r.x as c_int,
                r.y as c_int,
                r.width as c_int,
                r.height as c_int,
            ),
            None => (0, 0, -1, -1),
        };
        // SAFETY: live parameters; plain ints.
        check("nvjpegDecodeParamsSetROI", unsafe {
            (self.lib.api.nvjpegDecodeParamsSetROI)(self.raw, x, y, w, h)
        })
    }
}

impl Drop for Params {
    fn drop(&mut self) {
        // SAFETY: live, destroyed once.
        let _ = unsafe { (self.lib.api.nvjpegDecodeParamsDestroy)(self.raw) };
    }
}

struct State {
    lib: Arc<Library>,
    raw: ffi::State,
}

impl Drop for State {
    fn drop(&mut self) {
        // SAFETY: live, destroyed once, after the work that used it (owners wait on its fence
        // before dropping: see the decoders' drops).
        let _ = unsafe { (self.lib.api.nvjpegJpegStateDestroy)(self.raw) };
    }
}

/// Waits until `fence` (the last use of a state) has completed.
fn settle(fence: &mut Option<EventFence>) {
    if let Some(f) = fence.take() {
        f.wait();
    }
}

/// States in a batched-decode ring of the hardware decoder: two, so that the host prepares a
/// batch while the engines decode the one before. Each costs about 0.2 s to create on an H200
/// (`nvjpegJpegStateCreate` of the hardware backend, `crates/bench/scripts/nvjpeg_setup_probe.py`),
/// which a first epoch pays; a third bought no steady rate (`benches/RESULTS.md`, "JPEG decode on
/// the GPU").
const HARDWARE_STATES: usize = 2;

/// nvJPEG's batched decode on the hardware JPEG engines (`NVJPEG_BACKEND_HARDWARE`).
pub(crate) struct HardwareDecoder {
    states: Vec<(State, Option<EventFence>)>,
    next: usize,
    /// For `nvjpegDecodeBatchedSupported(Ex)`.
    probe: JpegStream,
    probe_params: Params,
    /// One per image of the largest batch so far.
    params: Vec<Params>,
    /// Owns the library handle; dropped last.
    handle: Handle,
}

// SAFETY: every handle here is used by the stage's thread only (the decoder moves with it);
// nvJPEG's objects are not tied to the thread that made them.
unsafe impl Send for HardwareDecoder {}

impl HardwareDecoder {
    /// The hardware decoder, if this GPU and library have one (`Err`: why not).
    pub(crate) fn new(
        lib: &Arc<Library>,
        memory: &Arc<DecodeMemory>,
    ) -> std::result::Result<HardwareDecoder, NvjpegError> {
        let handle = Handle::new(lib, ffi::BACKEND_HARDWARE, memory)?;
        let mut states = Vec::new();
        for _ in 0..HARDWARE_STATES {
            let mut raw = std::ptr::null_mut();
            // SAFETY: a live handle; the state is destroyed by `State`'s drop.
            check("nvjpegJpegStateCreate", unsafe {
                (handle.api().nvjpegJpegStateCreate)(handle.raw(), &mut raw)
            })?;
            states.push((
                State {
                    lib: Arc::clone(lib),
                    raw,
                },
                None,
            ));
        }
        let probe = handle.stream()?;
        let probe_params = handle.params()?;
        Ok(HardwareDecoder {
            states,
            next: 0,
            probe,
            probe_params,
            params: Vec::new(),
            handle,
        })
    }

    pub(crate) fn handle(&self) -> &Handle {
        &self.handle
    }

    /// Whether the hardware engines can decode `bytes` (its header parsed by nvJPEG), with
    /// `roi` where the library can check a region.
    pub(crate) fn supports(&self, bytes: &[u8], roi: Option<Roi>) -> bool {
        let api = self.handle.api();
        // SAFETY: a live handle and stream; `bytes` is read during the call only.
        let parsed = unsafe {
            (api.nvjpegJpegStreamParseHeader)(
                self.handle.raw(),
                bytes.as_ptr(),
                bytes.len(),
                self.probe.raw,
            )
        };
        if parsed != ffi::STATUS_SUCCESS {
            return false;
        }
        let mut supported: c_int = -1;
        let st = match (roi, api.nvjpegDecodeBatchedSupportedEx) {
            (Some(_), Some(ex)) => {
                if self.probe_params.set_roi(roi).is_err() {
                    return false;
                }
                // SAFETY: a live handle, stream and parameters; one int written.
                unsafe {
                    ex(
                        self.handle.raw(),
                        self.probe.raw,
                        self.probe_params.raw,
                        &mut supported,
                    )
                }
            }
            // SAFETY: as above.
            _ => unsafe {
                (api.nvjpegDecodeBatchedSupported)(
                    self.handle.raw(),
                    self.probe.raw,
                    &mut supported,
                )
            },
        };
        st == ffi::STATUS_SUCCESS && supported == 0
    }

    /// Whether ROI decodes go through `nvjpegDecodeBatchedEx` in this library.
    pub(crate) fn has_roi(&self) -> bool {
        self.handle.api().nvjpegDecodeBatchedEx.is_some()
    }

    /// Enqueues the decode of `images` (bytes, where to write interleaved RGB, the region) on
    /// `stream`. The bytes must stay valid and unchanged until the work enqueued on `stream`
    /// so far has completed (the caller fences them), and each output must hold its region's
    /// (or image's) pixels, 3 bytes each, at its pitch.
    ///
    /// # Safety
    ///
    /// Each output pointer addresses device memory of this context that holds the decoded
    /// region at its pitch, and stays allocated until the work on `stream` has completed.
    pub(crate) unsafe fn decode(
        &mut self,
        images: &[(&[u8], Image, Option<Roi>)],
        stream: &Arc<CudaStream>,
    ) -> std::result::Result<(), NvjpegError> {
        if images.is_empty() {
            return Ok(());
        }
        let api = self.handle.api();
        let k = self.next;
        self.next = (self.next + 1) % self.states.len();
        // A state is reused once the batch it decoded last has completed.
        settle(&mut self.states[k].1);
        let state = self.states[k].0.raw;
        // SAFETY: a live handle and state; the state's previous decode has completed.
        check("nvjpegDecodeBatchedInitialize", unsafe {
            (api.nvjpegDecodeBatchedInitialize)(
                self.handle.raw(),
                state,
                images.len() as c_int,
                1,
                ffi::OUTPUT_RGBI,
            )
        })?;
        let data: Vec<*const u8> = images.iter().map(|(b, _, _)| b.as_ptr()).collect();
        let lengths: Vec<usize> = images.iter().map(|(b, _, _)| b.len()).collect();
        let mut outputs: Vec<Image> = images.iter().map(|(_, o, _)| *o).collect();
        let any_roi = images.iter().any(|(_, _, r)| r.is_some());
        let status = match (any_roi, api.nvjpegDecodeBatchedEx) {
            (true, Some(decode_ex)) => {
                while self.params.len() < images.len() {
                    self.params.push(self.handle.params()?);
                }
                for (p, (_, _, roi)) in self.params.iter().zip(images) {
                    p.set_roi(*roi)?;
                }
                let mut raw: Vec<ffi::Params> =
                    self.params[..images.len()].iter().map(|p| p.raw).collect();
                // SAFETY: the arrays hold `images.len()` entries each and live for the call;
                // the inputs live until the caller's fence, the outputs by the caller's
                // contract; the state was initialised for this many images.
                unsafe {
                    decode_ex(
                        self.handle.raw(),
                        state,
                        data.as_ptr(),
                        lengths.as_ptr(),
                        outputs.as_mut_ptr(),
                        raw.as_mut_ptr(),
                        stream.cu_stream(),
                    )
                }
            }
            // SAFETY: as above, without parameters (whole images).
            _ => unsafe {
                (api.nvjpegDecodeBatched)(
                    self.handle.raw(),
                    state,
                    data.as_ptr(),
                    lengths.as_ptr(),
                    outputs.as_mut_ptr(),
                    stream.cu_stream(),
                )
            },
        };
        // Fence the state whatever the status: work may have been enqueued before a failure.
        self.states[k].1 = EventFence::record(stream).ok();
        check("nvjpegDecodeBatched", status)
    }
}

impl Drop for HardwareDecoder {
    fn drop(&mut self) {
        for (_, fence) in &mut self.states {
            settle(fence);
        }
    }
}

/// Slots (state, buffers, stream) of the decoupled decoder's ring.
const GPU_SLOTS: usize = 4;

struct Slot {
    jpeg: JpegStream,
    /// Index by backend: 0 GPU-assisted Huffman (`GPU_HYBRID`), 1 CPU Huffman (`HYBRID`).
    states: [State; 2],
    pinned: ffi::BufferPinned,
    device: ffi::BufferDevice,
    fence: Option<EventFence>,
    lib: Arc<Library>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        settle(&mut self.fence);
        // SAFETY: live buffers, destroyed once, after the work that used them (settled above).
        unsafe {
            let _ = (self.lib.api.nvjpegBufferPinnedDestroy)(self.pinned);
            let _ = (self.lib.api.nvjpegBufferDeviceDestroy)(self.device);
        }
    }
}

/// nvJPEG's decoupled decode, one image at a time: the GPU-assisted Huffman backend for
/// baseline JPEGs it supports, the hybrid backend (Huffman on this thread) for the rest
/// (progressive JPEGs).
pub(crate) struct GpuDecoder {
    slots: Vec<Slot>,
    next: usize,
    params: Params,
    decoders: [ffi::Decoder; 2],
    handle: Handle,
}

// SAFETY: every handle here is used by the stage's thread only (the decoder moves with it).
unsafe impl Send for GpuDecoder {}

impl GpuDecoder {
    pub(crate) fn new(
        lib: &Arc<Library>,
        memory: &Arc<DecodeMemory>,
    ) -> std::result::Result<GpuDecoder, NvjpegError> {
        let handle = Handle::new(lib, ffi::BACKEND_DEFAULT, memory)?;
        let api = handle.api();
        let mut decoders = [std::ptr::null_mut(); 2];
        for (d, backend) in decoders
            .iter_mut()
            .zip([ffi::BACKEND_GPU_HYBRID, ffi::BACKEND_HYBRID])
        {
            // SAFETY: a live handle; destroyed in drop.
            check("nvjpegDecoderCreate", unsafe {
                (api.nvjpegDecoderCreate)(handle.raw(), backend, d)
            })?;
        }
        let mut decoder = GpuDecoder {
            slots: Vec::new(),
            next: 0,
            params: handle.params()?,
            decoders,
            handle,
        };
        for _ in 0..GPU_SLOTS {
            let slot = decoder.slot(lib)?;
            decoder.slots.push(slot);
        }
        Ok(decoder)
    }

    fn slot(&self, lib: &Arc<Library>) -> std::result::Result<Slot, NvjpegError> {
        let api = self.handle.api();
        let h = self.handle.raw();
        let mut states = Vec::new();
        for d in self.decoders {
            let mut raw = std::ptr::null_mut();
            // SAFETY: a live handle and decoder; destroyed by `State`'s drop.
            check("nvjpegDecoderStateCreate", unsafe {
                (api.nvjpegDecoderStateCreate)(h, d, &mut raw)
            })?;
            states.push(State {
                lib: Arc::clone(lib),
                raw,
            });
        }
        let (mut pinned, mut device) = (std::ptr::null_mut(), std::ptr::null_mut());
        let ctx = Arc::as_ptr(&self.handle.memory).cast_mut().cast::<c_void>();
        let (st_p, st_d) = match (
            api.nvjpegBufferPinnedCreateV2,
            api.nvjpegBufferDeviceCreateV2,
            self.handle.pooled(),
        ) {
            (Some(pc), Some(dc), true) => {
                let mut dev = ffi::DevAllocatorV2 {
                    dev_malloc: memory::dev_malloc,
                    dev_free: memory::dev_free,
                    dev_ctx: ctx,
                };
                let mut pin = ffi::PinnedAllocatorV2 {
                    pinned_malloc: memory::pinned_malloc,
                    pinned_free: memory::pinned_free,
                    pinned_ctx: ctx,
                };
                // SAFETY: allocator structs live for the calls (copied); `ctx` outlives the
                // buffers (the handle keeps the memory, and the slots drop before it).
                unsafe { (pc(h, &mut pin, &mut pinned), dc(h, &mut dev, &mut device)) }
            }
            _ => match (api.nvjpegBufferPinnedCreate, api.nvjpegBufferDeviceCreate) {
                // SAFETY: null allocators select the handle's.
                (Some(pc), Some(dc)) => unsafe {
                    (
                        pc(h, std::ptr::null_mut(), &mut pinned),
                        dc(h, std::ptr::null_mut(), &mut device),
                    )
                },
                _ => (9, 9),
            },
        };
        check("nvjpegBufferPinnedCreate", st_p)?;
        check("nvjpegBufferDeviceCreate", st_d)?;
        let jpeg = self.handle.stream()?;
        let mut it = states.into_iter();
        let (Some(a), Some(b)) = (it.next(), it.next()) else {
            return Err(NvjpegError {
                op: "nvjpegDecoderStateCreate",
                status: 8,
            });
        };
        Ok(Slot {
            jpeg,
            states: [a, b],
            pinned,
            device,
            fence: None,
            lib: Arc::clone(lib),
        })
    }

    pub(crate) fn handle(&self) -> &Handle {
        &self.handle
    }

    /// Enqueues the decode of one image (`bytes`, interleaved RGB into `out`, `roi` or the whole
    /// image) on `stream`. Synchronous on the host for the header and, for progressive JPEGs,
    /// the Huffman decode.
    ///
    /// # Safety
    ///
    /// As [`HardwareDecoder::decode`]: `bytes` stay valid until the work on `stream` has
    /// completed, and `out` addresses device memory that holds the decoded region.
    pub(crate) unsafe fn decode(
        &mut self,
        bytes: &[u8],
        out: Image,
        roi: Option<Roi>,
        stream: &Arc<CudaStream>,
    ) -> std::result::Result<(), NvjpegError> {
        let api = self.handle.api();
        let h = self.handle.raw();
        let k = self.next;
        self.next = (self.next + 1) % self.slots.len();
        settle(&mut self.slots[k].fence);
        let slot = &self.slots[k];
        // SAFETY: live handle and stream; `bytes` outlives the decode (the caller's contract:
        // save_stream 0 keeps a pointer to them).
        check("nvjpegJpegStreamParse", unsafe {
            (api.nvjpegJpegStreamParse)(h, bytes.as_ptr(), bytes.len(), 0, 0, slot.jpeg.raw)
        })?;
        self.params.set_roi(roi)?;
        let mut encoding: c_int = 0;
        // SAFETY: a parsed stream; one int written.
        check("nvjpegJpegStreamGetJpegEncoding", unsafe {
            (api.nvjpegJpegStreamGetJpegEncoding)(slot.jpeg.raw, &mut encoding)
        })?;
        let mut gpu_huffman: c_int = -1;
        if encoding == ffi::ENCODING_BASELINE_DCT {
            // SAFETY: a live decoder, parsed stream and parameters; one int written.
            let st = unsafe {
                (api.nvjpegDecoderJpegSupported)(
                    self.decoders[0],
                    slot.jpeg.raw,
                    self.params.raw,
                    &mut gpu_huffman,
                )
            };
            if st != ffi::STATUS_SUCCESS {
                gpu_huffman = -1;
            }
        }
        let b = if gpu_huffman == 0 { 0 } else { 1 };
        let (decoder, state) = (self.decoders[b], slot.states[b].raw);
        let mut out = out;
        // SAFETY: live objects of this handle; the slot's previous use has completed (settled
        // above), so its pinned and device buffers are free; the output by the caller's
        // contract.
        let status = unsafe {
            check(
                "nvjpegStateAttachPinnedBuffer",
                (api.nvjpegStateAttachPinnedBuffer)(state, slot.pinned),
            )
            .and_then(|()| {
                check(
                    "nvjpegStateAttachDeviceBuffer",
                    (api.nvjpegStateAttachDeviceBuffer)(state, slot.device),
                )
            })
            .and_then(|()| {
                check(
                    "nvjpegDecodeJpegHost",
                    (api.nvjpegDecodeJpegHost)(h, decoder, state, self.params.raw, slot.jpeg.raw),
                )
            })
            .and_then(|()| {
                check(
                    "nvjpegDecodeJpegTransferToDevice",
                    (api.nvjpegDecodeJpegTransferToDevice)(
                        h,
                        decoder,
                        state,
                        slot.jpeg.raw,
                        stream.cu_stream(),
                    ),
                )
            })
            .and_then(|()| {
                check(
                    "nvjpegDecodeJpegDevice",
                    (api.nvjpegDecodeJpegDevice)(h, decoder, state, &mut out, stream.cu_stream()),
                )
            })
        };
        self.slots[k].fence = EventFence::record(stream).ok();
        status
    }
}

impl Drop for GpuDecoder {
    fn drop(&mut self) {
        // Slots first (they wait for their work), then the decoders, then (a field) the handle.
        self.slots.clear();
        for d in self.decoders {
            // SAFETY: live decoders, destroyed once; no state of them is left.
            let _ = unsafe { (self.handle.api().nvjpegDecoderDestroy)(d) };
        }
    }
}
