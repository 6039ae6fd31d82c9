//! [`DeviceBatch`]: a batch on the device, and [`DeviceField`], a view of one of its fields that
//! borrows it (cudarc's `CudaView<'_, T>` model). A ragged field is two views: its values and
//! its offsets ([`DeviceBatch::ragged`]), whose lengths the batch knows from a host copy of the
//! offsets, so that no view reads the device to know its size.
//!
//! A device batch owns one pooled [`DeviceBuffer`] holding every field, and a private fence that
//! completes when the copy (and conversions) that fill it have. The consumer orders its work with
//! [`DeviceBatch::wait_on`] (`cuStreamWaitEvent`, the host does not wait), which also registers
//! the stream as a user; other streams are registered with [`DeviceBatch::release_on`]
//! (PyTorch's `record_stream`). On drop, a fence is recorded on every registered stream and the
//! buffer returns to its pool behind them and behind the copy. The events themselves never leave
//! the crate: nobody can record them again and make a fence read as complete early.
//!
//! A batch can also be shared (`Arc<DeviceBatch>`, it is `Send + Sync`) by consumers outside
//! cudarc, who name their streams by raw handle ([`RawStream`]): the DLPack capsules of its
//! fields, on any thread. [`DeviceBatch::wait_on_raw`] orders such a stream after the copy and
//! registers it; the batch's drop, wherever the last holder lets go (a DLPack deleter, with or
//! without the GIL), records a fence on every registered stream and returns the buffer behind
//! them, never waiting; if the driver cannot record a fence, the buffer is leaked and counted,
//! never reused. Calls that reach the driver from a thread that is not gpufeed's leave that
//! thread's current context as they found it.

use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{CudaStream, DevicePtr, DeviceSlice, SyncOnDrop, result, sys};

use super::DeviceBuffer;
use super::cuda_err;
use super::device::ContextScope;
use super::fence::EventFence;
use crate::error::{Error, Result};
use crate::format::DType;
use crate::layout::Element;
use crate::loader::{Batch, BatchInfo};
use crate::memory::Fence;

/// One field of a device batch: what it holds and where it lives in the device buffer.
#[derive(Debug)]
pub(crate) struct FieldSpec {
    pub(crate) name: String,
    pub(crate) dtype: DType,
    /// Per-sample shape (converted fields: `[C, H, W]`); a ragged field's item shape.
    pub(crate) shape: Vec<usize>,
    /// Byte offset in the device buffer (a multiple of 256); a ragged field's values.
    pub(crate) offset: usize,
    /// Bytes per sample; a ragged field's bytes per item.
    pub(crate) sample_bytes: usize,
    /// A ragged field's offsets' byte offset in the device buffer (`len + 1` `i64`s).
    pub(crate) offsets: Option<usize>,
}

/// What a device batch keeps of the host batch it was copied from: what the batch is, the
/// bytes of data it held, and a copy of each ragged field's offsets (by field, `None` for a
/// fixed one), so that the sizes of its views are known on the host.
#[derive(Debug)]
pub(crate) struct HostSide {
    info: BatchInfo,
    data_bytes: usize,
    offsets: Vec<Option<Box<[i64]>>>,
}

impl HostSide {
    /// What the device batch of `fields` copied from `batch` keeps of it.
    pub(crate) fn of(batch: &Batch, fields: &[FieldSpec]) -> Result<HostSide> {
        let offsets = fields
            .iter()
            .map(|f| match f.offsets {
                Some(_) => batch.offsets(&f.name).map(|o| Some(o.into())),
                None => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(HostSide {
            info: batch.info().clone(),
            data_bytes: batch.data_bytes(),
            offsets,
        })
    }

    /// Made by the GPU decode: `skipped` more samples skipped (bad images the decode
    /// dropped), and `data_bytes` delivered (pixels and labels, not the compressed records).
    pub(crate) fn decoded(&mut self, skipped: usize, data_bytes: usize) {
        self.info.skipped += skipped;
        self.data_bytes = data_bytes;
    }
}

/// A CUDA stream named by its raw handle (a `CUstream`), as consumers outside cudarc give it:
/// DLPack's `stream` argument, PyTorch's `torch.cuda.Stream.cuda_stream`, CuPy's
/// `Stream.ptr`.
///
/// The default streams are always valid ([`RawStream::LEGACY`], [`RawStream::PER_THREAD`],
/// [`RawStream::NULL`]); any other handle comes from [`RawStream::from_raw`], which is `unsafe`
/// because nothing can check a handle: the driver dereferences it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RawStream(usize);

impl RawStream {
    /// The null stream (`0`): gpufeed calls the driver's default (not per-thread) entry points,
    /// so this is the legacy default stream.
    pub const NULL: RawStream = RawStream(0);
    /// The legacy default stream (`CU_STREAM_LEGACY`, DLPack's `1`, PyTorch's default stream):
    /// its work waits for all earlier work of the context's blocking streams, and theirs for it.
    pub const LEGACY: RawStream = RawStream(1);
    /// The calling thread's per-thread default stream (`CU_STREAM_PER_THREAD`, DLPack's `2`).
    /// Which stream it names depends on the thread: [`DeviceBatch::wait_on_raw`] waits on the
    /// caller's; a release registered with it is recorded on [`RawStream::LEGACY`] instead,
    /// since the batch may drop on another thread (per-thread default streams are blocking
    /// streams, so the legacy stream's fence follows their work).
    pub const PER_THREAD: RawStream = RawStream(2);

    /// The stream with this handle.
    ///
    /// # Safety
    ///
    /// `handle` is `0`, `1`, `2` (the default streams), or a stream of the context of the
    /// batches it is given to (created with `cuStreamCreate`, `torch.cuda.Stream`,
    /// `cupy.cuda.Stream`, ...) that is not destroyed before every batch it is given to has
    /// dropped: a batch records an event on it when it drops. PyTorch never destroys its
    /// streams; the default streams live as long as the context.
    pub const unsafe fn from_raw(handle: usize) -> RawStream {
        RawStream(handle)
    }

    /// The handle.
    pub fn handle(self) -> usize {
        self.0
    }

    /// The handle of a cudarc stream (candle's device uses the per-thread default stream).
    fn of(stream: &CudaStream) -> RawStream {
        RawStream(stream.cu_stream() as usize)
    }

    fn cu(self) -> sys::CUstream {
        self.0 as sys::CUstream
    }

    /// The stream a fence recorded later, maybe on another thread, must go on to follow this
    /// stream's work so far.
    fn for_release(self) -> RawStream {
        if self == RawStream::PER_THREAD {
            RawStream::LEGACY
        } else {
            self
        }
    }
}

/// A stream registered as a user of a batch's memory.
enum User {
    /// A cudarc stream, kept alive by the batch.
    Stream(Arc<CudaStream>),
    /// A consumer's stream by handle (its owner keeps it alive: [`RawStream::from_raw`]).
    Raw(RawStream),
}

/// A batch on the device: typed fields in one pooled device buffer, filled by an asynchronous
/// copy. See [the rule for device memory](crate::cuda#the-rule-for-device-memory) for when its
/// memory may be used and reused.
///
/// It is `Send + Sync`: every method takes `&self`, so an `Arc<DeviceBatch>` can be shared by
/// the views of its fields on several threads (DLPack capsules, say); the buffer returns to its
/// pool when the last holder drops it.
///
/// ```no_run
/// use gpufeed::cuda::{CudaStream, DevicePtr};
/// use gpufeed::cuda::{DeviceBatch, RawStream};
///
/// /// Hands a batch's `x` field (f32) to a consumer that works on `stream`.
/// fn consume(batch: &DeviceBatch, stream: &std::sync::Arc<CudaStream>) -> gpufeed::Result<()> {
///     batch.wait_on(stream)?; // `stream` waits for the batch's copy, on the device
///     let x = batch.field::<f32>("x")?;
///     println!("{} f32 of shape {:?} for samples {:?}", x.len(), x.shape(), batch.indices());
///     let (ptr, _sync) = x.device_ptr(stream); // for a kernel launched on `stream`
///     # let _ = ptr;
///     // A consumer outside cudarc (PyTorch, CuPy) names its stream by handle instead:
///     batch.release_on_raw(RawStream::PER_THREAD);
///     // A copy back to the host, for checks (synchronises).
///     let bytes = batch.field_to_host("x")?;
///     assert_eq!(bytes.len(), x.len() * 4);
///     Ok(())
/// }
/// ```
pub struct DeviceBatch {
    /// Taken only in `drop`, inside a context scope.
    buffer: ManuallyDrop<DeviceBuffer>,
    fields: Arc<[FieldSpec]>,
    host: HostSide,
    /// Completes when the copy and conversions have; also a use of `buffer`. Dropped only in
    /// `drop`, inside a context scope (destroying an event makes cudarc bind its context).
    ready: ManuallyDrop<EventFence>,
    /// As `ready`.
    copy_stream: ManuallyDrop<Arc<CudaStream>>,
    users: Mutex<Vec<User>>,
}

/// `DeviceBatch` is shared across threads by design (an `Arc` held by DLPack capsules).
const _: () = {
    const fn shared<T: Send + Sync>() {}
    shared::<DeviceBatch>()
};

impl std::fmt::Debug for DeviceBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBatch")
            .field("epoch", &self.host.info.epoch)
            .field("number", &self.host.info.number)
            .field("len", &self.host.info.len())
            .field("fields", &self.fields().collect::<Vec<_>>())
            .finish()
    }
}

impl DeviceBatch {
    /// A batch in `buffer`, whose filling work `ready` fences on `copy_stream` (already a use of
    /// `buffer`).
    pub(crate) fn new(
        buffer: DeviceBuffer,
        fields: Arc<[FieldSpec]>,
        host: HostSide,
        ready: EventFence,
        copy_stream: Arc<CudaStream>,
    ) -> DeviceBatch {
        DeviceBatch {
            buffer: ManuallyDrop::new(buffer),
            fields,
            host,
            ready: ManuallyDrop::new(ready),
            copy_stream: ManuallyDrop::new(copy_stream),
            users: Mutex::new(Vec::new()),
        }
    }

    fn users(&self) -> MutexGuard<'_, Vec<User>> {
        // A panic under this lock leaves a list of streams: still right to use.
        self.users.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The ordinal of the device that holds it (DLPack's `device_id`). Its memory is in that
    /// device's primary context (the CUDA runtime's, so PyTorch's).
    pub fn ordinal(&self) -> usize {
        self.buffer.context().ordinal()
    }

    /// The context its memory is in.
    #[cfg(feature = "candle-cuda")]
    pub(crate) fn context(&self) -> &Arc<cudarc::driver::CudaContext> {
        self.buffer.context()
    }

    /// What the batch is: its samples' indices, epoch, number, padding (also reached through
    /// `Deref`: `batch.len()`), as for a [`Batch`](crate::Batch) on the host.
    pub fn info(&self) -> &BatchInfo {
        &self.host.info
    }

    /// Every field as bytes, in the loader's order (a ragged field: its values).
    pub fn fields(&self) -> impl ExactSizeIterator<Item = DeviceField<'_>> {
        self.fields
            .iter()
            .enumerate()
            .map(|(k, spec)| DeviceField::new(self, spec, k, false))
    }

    fn spec(&self, name: &str) -> Result<(usize, &FieldSpec)> {
        self.fields
            .iter()
            .enumerate()
            .find(|(_, f)| f.name == name)
            .ok_or_else(|| {
                let names: Vec<&str> = self.fields.iter().map(|f| f.name.as_str()).collect();
                Error::mismatch(format!(
                    "device batch has no field `{name}` (fields: {names:?})"
                ))
            })
    }

    /// Field `name` as bytes, whatever its dtype (a ragged field: its values).
    pub fn field_bytes(&self, name: &str) -> Result<DeviceField<'_>> {
        let (k, spec) = self.spec(name)?;
        Ok(DeviceField::new(self, spec, k, false))
    }

    /// Field `name` as elements of `T`, which must match the field's dtype (`u16` views f16 and
    /// bf16), as for [`Batch::field`](crate::Batch::field); a ragged field's values.
    pub fn field<T: Element>(&self, name: &str) -> Result<DeviceField<'_, T>> {
        let (k, spec) = self.spec(name)?;
        if !T::matches(spec.dtype) {
            return Err(Error::mismatch(format!(
                "field `{name}` is {}, not {}",
                spec.dtype,
                std::any::type_name::<T>()
            )));
        }
        Ok(DeviceField::new(self, spec, k, false))
    }

    /// Ragged field `name` on the device: its values as elements of `T` (which must match its
    /// dtype), `[items, item shape...]`, and its offsets, `len() + 1` `i64`s, as for
    /// [`Batch::ragged`](crate::Batch::ragged). A fixed field is an [`Error::Mismatch`].
    pub fn ragged<T: Element>(
        &self,
        name: &str,
    ) -> Result<(DeviceField<'_, T>, DeviceField<'_, i64>)> {
        let values = self.field::<T>(name)?;
        Ok((values, self.offsets(name)?))
    }

    /// The offsets of ragged field `name` on the device: `len() + 1` `i64`s, in items.
    pub fn offsets(&self, name: &str) -> Result<DeviceField<'_, i64>> {
        let (k, spec) = self.spec(name)?;
        if spec.offsets.is_none() {
            return Err(Error::mismatch(format!("field `{name}` is not ragged")));
        }
        Ok(DeviceField::new(self, spec, k, true))
    }

    /// The offsets of ragged field `name`, from the host batch the device batch was copied from
    /// (the same values as [`offsets`](Self::offsets) on the device): what a consumer splits
    /// the values by without reading the device.
    pub fn offsets_host(&self, name: &str) -> Result<&[i64]> {
        let (k, _) = self.spec(name)?;
        self.host.offsets[k]
            .as_deref()
            .ok_or_else(|| Error::mismatch(format!("field `{name}` is not ragged")))
    }

    /// Bytes of data of the host batch it was copied from: its samples of every fixed field and
    /// the values of every ragged field ([`Batch::data_bytes`](crate::Batch::data_bytes)).
    pub fn data_bytes(&self) -> usize {
        self.host.data_bytes
    }

    /// True once the copy (and conversions) have completed; does not wait.
    pub fn is_ready(&self) -> bool {
        self.ready.is_complete()
    }

    /// Makes `stream` wait for the copy and conversions (`cuStreamWaitEvent`; the host does not
    /// wait), and registers `stream` as a user of the batch's memory (see [the rule for device
    /// memory](crate::cuda#the-rule-for-device-memory)). Call it before enqueueing work that
    /// reads the batch on `stream`.
    pub fn wait_on(&self, stream: &Arc<CudaStream>) -> Result<()> {
        self.ready.order(stream)?;
        self.release_on(stream);
        Ok(())
    }

    /// Registers `stream` as a user of the batch's memory without ordering it after the copy:
    /// when the batch drops, a fence is recorded on `stream` and the buffer is reused only once
    /// `stream` has passed that point (PyTorch's `record_stream`). A cudarc stream over the
    /// per-thread default stream (`CudaContext::per_thread_stream`, candle's default) is
    /// registered as [`RawStream::PER_THREAD`] is: the batch may drop on another thread, whose
    /// per-thread stream that handle would name, so its fence goes on the legacy stream.
    pub fn release_on(&self, stream: &Arc<CudaStream>) {
        if RawStream::of(stream) == RawStream::PER_THREAD {
            // The handle names the stream of whichever thread records on it, and the batch may
            // drop on another: the release is recorded as for a raw per-thread stream.
            return self.release_on_raw(RawStream::PER_THREAD);
        }
        let mut users = self.users();
        if !users
            .iter()
            .any(|u| matches!(u, User::Stream(s) if Arc::ptr_eq(s, stream)))
        {
            users.push(User::Stream(Arc::clone(stream)));
        }
    }

    /// [`wait_on`](Self::wait_on) for a stream named by its raw handle: makes `stream` wait
    /// for the copy and conversions on the device (`cuStreamWaitEvent`; the host does not wait)
    /// and registers it with [`release_on_raw`](Self::release_on_raw). The calling thread's
    /// current context is left as it was. For [`RawStream::PER_THREAD`], call it on the
    /// thread whose stream that is.
    pub fn wait_on_raw(&self, stream: RawStream) -> Result<()> {
        let _scope = ContextScope::enter(self.buffer.context())?;
        // SAFETY: `RawStream`'s contract: a default stream or a live stream of this context.
        unsafe { self.ready.order_raw(stream.cu()) }?;
        self.release_on_raw(stream);
        Ok(())
    }

    /// [`release_on`](Self::release_on) for a stream named by its raw handle: when the batch
    /// drops, a fence is recorded on `stream` (on [`RawStream::LEGACY`] for
    /// [`RawStream::PER_THREAD`]), and the buffer is reused only once `stream` has passed it.
    /// Registering a stream twice registers it once. Calls no driver function.
    pub fn release_on_raw(&self, stream: RawStream) {
        let stream = stream.for_release();
        let mut users = self.users();
        if !users
            .iter()
            .any(|u| matches!(u, User::Raw(r) if *r == stream))
        {
            users.push(User::Raw(stream));
        }
    }

    /// True if `stream` is registered (the same CUDA stream as one given to `wait_on` or
    /// `release_on`, which the batch keeps alive, so the handle cannot name another stream).
    fn is_user(&self, stream: &CudaStream) -> bool {
        let raw = RawStream::of(stream);
        self.users().iter().any(|u| match u {
            User::Stream(s) => s.cu_stream() == stream.cu_stream(),
            User::Raw(r) => raw == RawStream::PER_THREAD && *r == raw.for_release(),
        })
    }

    /// The bytes of field `name` (a ragged field: its values), copied back to the host. Waits
    /// for the copy (blocking the host): for tests and inspection, not the hot path.
    pub fn field_to_host(&self, name: &str) -> Result<Vec<u8>> {
        self.view_to_host(self.field_bytes(name)?)
    }

    /// The offsets of ragged field `name` on the device, copied back to the host, as bytes.
    /// Waits for the copy (blocking the host): for tests and inspection.
    pub fn offsets_to_host(&self, name: &str) -> Result<Vec<u8>> {
        let offsets = self.offsets(name)?;
        let field = DeviceField::<u8>::new(self, offsets.spec, offsets.k, true);
        self.view_to_host(field)
    }

    fn view_to_host(&self, field: DeviceField<'_>) -> Result<Vec<u8>> {
        if field.start() + field.bytes() > self.buffer.len() {
            return Err(Error::mismatch("a device field lies outside its buffer"));
        }
        let _scope = ContextScope::enter(self.buffer.context())?;
        self.ready
            .event()
            .synchronize()
            .map_err(cuda_err("wait for the copy (cuEventSynchronize)"))?;
        let mut out = vec![0u8; field.bytes()];
        // SAFETY: the range lies in the batch's device buffer (checked), which lives while
        // `self` is borrowed; the copy that filled it has completed (synchronised above; the
        // event's context is current since); `out` has exactly that many bytes, and
        // cuMemcpyDtoH returns only once the copy is done.
        unsafe { result::memcpy_dtoh_sync(&mut out, field.addr()) }
            .map_err(cuda_err("copy to the host (cuMemcpyDtoH)"))?;
        Ok(out)
    }
}

impl std::ops::Deref for DeviceBatch {
    type Target = BatchInfo;

    fn deref(&self) -> &BatchInfo {
        &self.host.info
    }
}

impl Drop for DeviceBatch {
    /// Records a fence on every registered stream and returns the buffer to its pool behind
    /// them and the copy; never waits. If a fence cannot be recorded (a driver error), the
    /// buffer is leaked instead ([`DevicePool::leaked`](super::DevicePool::leaked)): never
    /// reused under work that nothing fences. The calling thread's current context is left as
    /// it was.
    fn drop(&mut self) {
        let users = std::mem::take(&mut *self.users());
        // SAFETY: each is taken or dropped once, here, and not used again.
        let (buffer, ready, copy_stream) = unsafe {
            (
                ManuallyDrop::take(&mut self.buffer),
                ManuallyDrop::take(&mut self.ready),
                ManuallyDrop::take(&mut self.copy_stream),
            )
        };
        let scope = ContextScope::enter(buffer.context());
        let mut fenced = scope.is_ok() || users.is_empty();
        if scope.is_ok() {
            for user in &users {
                fenced = fenced
                    && match user {
                        User::Stream(stream) => buffer.try_record_use(stream).is_ok(),
                        // SAFETY: `RawStream`'s contract: the stream lives until this batch
                        // has dropped, which is now; the batch's context is current (the scope).
                        User::Raw(raw) => unsafe { buffer.try_record_raw(raw.cu()) }.is_ok(),
                    };
            }
        }
        if fenced {
            // Back to the pool behind the fences just recorded and `ready`.
            drop(buffer);
        } else {
            buffer.leak();
        }
        // Inside the scope: destroying the last handle of an event or a stream binds its context.
        drop((ready, copy_stream, users));
        drop(scope);
    }
}

/// A view of one field of a [`DeviceBatch`], borrowing it: the field's name, dtype, shape and
/// bytes, as elements of `T` (bytes by default). It cannot outlive its batch:
///
/// ```compile_fail
/// fn outlive(batch: gpufeed::cuda::DeviceBatch) -> gpufeed::cuda::DeviceField<'static> {
///     batch.field_bytes("x").unwrap() // the view borrows `batch`, which drops here
/// }
/// ```
///
/// It is a cudarc [`DevicePtr`], so cudarc's copies and kernel launches can read it
/// (`stream.memcpy_dtoh(&view, &mut host)`, or `let (ptr, _guard) = view.device_ptr(&stream)`
/// for a launch argument): `device_ptr(stream)` makes `stream` wait for the copy on the device;
/// if `stream` is registered with the batch (`wait_on`, `release_on`), the batch's drop fences
/// it and the guard does nothing, otherwise the guard synchronises `stream` when dropped (after
/// the read is enqueued), so that the read is done before the batch can drop.
pub struct DeviceField<'a, T = u8> {
    batch: &'a DeviceBatch,
    spec: &'a FieldSpec,
    /// The field's position in the batch.
    k: usize,
    /// The view is of a ragged field's offsets, not its values.
    offsets: bool,
    element: PhantomData<fn() -> T>,
}

impl<T> Clone for DeviceField<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for DeviceField<'_, T> {}

impl<T> std::fmt::Debug for DeviceField<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceField")
            .field("name", &self.spec.name)
            .field("dtype", &self.spec.dtype)
            .field("shape", &self.shape())
            .finish()
    }
}

impl<'a, T> DeviceField<'a, T> {
    fn new(batch: &'a DeviceBatch, spec: &'a FieldSpec, k: usize, offsets: bool) -> Self {
        DeviceField {
            batch,
            spec,
            k,
            offsets,
            element: PhantomData,
        }
    }

    /// The field's name (of the field whose offsets this is, for a ragged field's offsets).
    pub fn name(&self) -> &'a str {
        &self.spec.name
    }

    /// Its element type (`i64` for a ragged field's offsets).
    pub fn dtype(&self) -> DType {
        if self.offsets {
            DType::I64
        } else {
            self.spec.dtype
        }
    }

    /// Items of a ragged field in this batch (from the host's copy of its offsets).
    fn items(&self) -> usize {
        self.batch.host.offsets[self.k]
            .as_deref()
            .and_then(|o| o.last())
            .map_or(0, |&n| n as usize)
    }

    /// True when the view is of a ragged field's values or offsets.
    pub fn is_ragged(&self) -> bool {
        self.spec.offsets.is_some()
    }

    /// Its shape in this batch: `[len, per-sample shape...]` (converted fields:
    /// `[len, C, H, W]`), C-contiguous; a ragged field's values `[items, item shape...]`, its
    /// offsets `[len + 1]`.
    pub fn shape(&self) -> Vec<usize> {
        if self.offsets {
            return vec![self.batch.len() + 1];
        }
        let mut shape = Vec::with_capacity(self.spec.shape.len() + 1);
        shape.push(if self.is_ragged() {
            self.items()
        } else {
            self.batch.len()
        });
        shape.extend_from_slice(&self.spec.shape);
        shape
    }

    /// Its size in bytes.
    pub fn bytes(&self) -> usize {
        if self.offsets {
            8 * (self.batch.len() + 1)
        } else if self.is_ragged() {
            self.spec.sample_bytes * self.items()
        } else {
            self.spec.sample_bytes * self.batch.len()
        }
    }

    /// Its byte offset in the device buffer.
    fn start(&self) -> usize {
        match (self.offsets, self.spec.offsets) {
            (true, Some(at)) => at,
            _ => self.spec.offset,
        }
    }

    /// The batch it views.
    pub fn batch(&self) -> &'a DeviceBatch {
        self.batch
    }

    fn addr(&self) -> sys::CUdeviceptr {
        self.batch.buffer.addr() + self.start() as u64
    }

    /// The device address of its first element (aligned to 256 bytes), for frameworks that
    /// take raw pointers (candle, burn, tch's `from_blob`).
    ///
    /// # Safety
    ///
    /// Getting the address is harmless; the caller takes on the contract for every use of it:
    ///
    /// - it addresses [`bytes`](Self::bytes) bytes that are valid while the batch lives, and
    ///   no longer: unlike the view, the address does not borrow the batch;
    /// - under [the rule for device memory](crate::cuda#the-rule-for-device-memory): every
    ///   stream on which work uses it must be registered with the batch
    ///   ([`DeviceBatch::wait_on`] or [`DeviceBatch::release_on`]) before the batch drops, or
    ///   be synchronised before it drops, else the memory may be reused under that work;
    /// - reads must be ordered after the copy: enqueue them on a stream after
    ///   [`DeviceBatch::wait_on`] on it (or once [`DeviceBatch::is_ready`] is true).
    pub unsafe fn ptr(&self) -> sys::CUdeviceptr {
        self.addr()
    }
}

impl<T: Element> DeviceField<'_, T> {
    /// Elements of `T` in this batch's field.
    pub fn len(&self) -> usize {
        self.bytes() / std::mem::size_of::<T>()
    }

    /// True for a field without elements.
    pub fn is_empty(&self) -> bool {
        self.bytes() == 0
    }
}

impl<T: Element> DeviceSlice<T> for DeviceField<'_, T> {
    fn len(&self) -> usize {
        DeviceField::len(self)
    }

    /// The stream the batch was filled on (the device's copy stream).
    fn stream(&self) -> &Arc<CudaStream> {
        &self.batch.copy_stream
    }
}

impl<T: Element> DevicePtr<T> for DeviceField<'_, T> {
    fn device_ptr<'b>(&'b self, stream: &'b CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'b>) {
        if self.batch.ready.order(stream).is_err() {
            // No wait on the device: wait on the host, so that the read still follows the copy.
            self.batch.ready.wait();
        }
        let guard = if self.batch.is_user(stream) {
            // The batch's drop records a fence on `stream`, after this read: nothing to do.
            SyncOnDrop::Record(None)
        } else {
            // Nothing would fence this read: wait for it before the view (and so the batch)
            // can go.
            SyncOnDrop::sync_stream(stream)
        };
        (self.addr(), guard)
    }
}
