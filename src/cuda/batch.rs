//! [`DeviceBatch`]: a batch on the device, and [`DeviceField`], a view of one of its fields that
//! borrows it (cudarc's `CudaView<'_, T>` model).
//!
//! A device batch owns one pooled [`DeviceBuffer`] holding every field, and a private fence that
//! completes when the copy (and conversions) that fill it have. The consumer orders its work with
//! [`DeviceBatch::wait_on`] (`cuStreamWaitEvent`, the host does not wait), which also registers
//! the stream as a user; other streams are registered with [`DeviceBatch::release_on`]
//! (PyTorch's `record_stream`). On drop, a fence is recorded on every registered stream and the
//! buffer returns to its pool behind them and behind the copy. The events themselves never leave
//! the crate: nobody can record them again and make a fence read as complete early.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DeviceSlice, SyncOnDrop, result, sys};

use super::DeviceBuffer;
use super::cuda_err;
use super::fence::EventFence;
use crate::error::{Error, Result};
use crate::format::DType;
use crate::loader::Element;
use crate::memory::Fence;

/// One field of a device batch: what it holds and where it lives in the device buffer.
#[derive(Debug)]
pub(crate) struct FieldSpec {
    pub(crate) name: String,
    pub(crate) dtype: DType,
    /// Per-sample shape (converted fields: `[C, H, W]`).
    pub(crate) shape: Vec<usize>,
    /// Byte offset in the device buffer (a multiple of 256).
    pub(crate) offset: usize,
    pub(crate) sample_bytes: usize,
}

/// A batch on the device: typed fields in one pooled device buffer, filled by an asynchronous
/// copy. See [the rule for device memory](crate::cuda#the-rule-for-device-memory) for when its
/// memory may be used and reused.
pub struct DeviceBatch {
    buffer: DeviceBuffer,
    fields: Arc<[FieldSpec]>,
    indices: Vec<u64>,
    padding: usize,
    skipped: usize,
    epoch: u64,
    number: u64,
    /// Completes when the copy and conversions have; also a use of `buffer`.
    ready: EventFence,
    copy_stream: Arc<CudaStream>,
    users: Vec<Arc<CudaStream>>,
}

impl std::fmt::Debug for DeviceBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBatch")
            .field("epoch", &self.epoch)
            .field("number", &self.number)
            .field("len", &self.indices.len())
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
        (indices, padding, skipped): (Vec<u64>, usize, usize),
        (epoch, number): (u64, u64),
        ready: EventFence,
        copy_stream: Arc<CudaStream>,
    ) -> DeviceBatch {
        DeviceBatch {
            buffer,
            fields,
            indices,
            padding,
            skipped,
            epoch,
            number,
            ready,
            copy_stream,
            users: Vec::new(),
        }
    }

    /// Samples in the batch.
    pub fn len(&self) -> usize {
        self.indices.len()
    }

    /// True for a batch without samples (never delivered).
    pub fn is_empty(&self) -> bool {
        self.indices.is_empty()
    }

    /// The dataset indices of its samples, in batch order.
    pub fn indices(&self) -> &[u64] {
        &self.indices
    }

    /// Slots that are padding (evaluation mode), always the last ones; see
    /// [`Batch::padding`](crate::Batch::padding).
    pub fn padding(&self) -> usize {
        self.padding
    }

    /// Samples the transform skipped (placeholders); see
    /// [`Batch::skipped`](crate::Batch::skipped).
    pub fn skipped(&self) -> usize {
        self.skipped
    }

    /// Per slot, true for a real sample and false for padding; see
    /// [`Batch::mask`](crate::Batch::mask).
    pub fn mask(&self) -> Vec<bool> {
        let real = self.len() - self.padding.min(self.len());
        (0..self.len()).map(|k| k < real).collect()
    }

    /// The epoch it belongs to.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Its number within the epoch.
    pub fn number(&self) -> u64 {
        self.number
    }

    /// Every field as bytes, in the loader's order.
    pub fn fields(&self) -> impl ExactSizeIterator<Item = DeviceField<'_>> {
        self.fields.iter().map(|spec| DeviceField::new(self, spec))
    }

    fn spec(&self, name: &str) -> Result<&FieldSpec> {
        self.fields.iter().find(|f| f.name == name).ok_or_else(|| {
            let names: Vec<&str> = self.fields.iter().map(|f| f.name.as_str()).collect();
            Error::mismatch(format!(
                "device batch has no field `{name}` (fields: {names:?})"
            ))
        })
    }

    /// Field `name` as bytes, whatever its dtype.
    pub fn field_bytes(&self, name: &str) -> Result<DeviceField<'_>> {
        Ok(DeviceField::new(self, self.spec(name)?))
    }

    /// Field `name` as elements of `T`, which must match the field's dtype (`u16` views f16 and
    /// bf16), as for [`Batch::field`](crate::Batch::field).
    pub fn field<T: Element>(&self, name: &str) -> Result<DeviceField<'_, T>> {
        let spec = self.spec(name)?;
        if !T::matches(spec.dtype) {
            return Err(Error::mismatch(format!(
                "field `{name}` is {}, not {}",
                spec.dtype,
                std::any::type_name::<T>()
            )));
        }
        Ok(DeviceField::new(self, spec))
    }

    /// True once the copy (and conversions) have completed; does not wait.
    pub fn is_ready(&self) -> bool {
        self.ready.is_complete()
    }

    /// Makes `stream` wait for the copy and conversions (`cuStreamWaitEvent`; the host does not
    /// wait), and registers `stream` as a user of the batch's memory (see [the rule for device
    /// memory](crate::cuda#the-rule-for-device-memory)). Call it before enqueueing work that
    /// reads the batch on `stream`.
    pub fn wait_on(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        self.ready.order(stream)?;
        self.release_on(stream);
        Ok(())
    }

    /// Registers `stream` as a user of the batch's memory without ordering it after the copy:
    /// when the batch drops, a fence is recorded on `stream` and the buffer is reused only once
    /// `stream` has passed that point (PyTorch's `record_stream`).
    pub fn release_on(&mut self, stream: &Arc<CudaStream>) {
        if !self.users.iter().any(|s| Arc::ptr_eq(s, stream)) {
            self.users.push(Arc::clone(stream));
        }
    }

    /// True if `stream` is registered (the same CUDA stream as one given to `wait_on` or
    /// `release_on`, which the batch keeps alive, so the handle cannot name another stream).
    fn is_user(&self, stream: &CudaStream) -> bool {
        self.users
            .iter()
            .any(|s| s.cu_stream() == stream.cu_stream())
    }

    /// The bytes of field `name`, copied back to the host. Waits for the copy (blocking the
    /// host): for tests and inspection, not the hot path.
    pub fn field_to_host(&self, name: &str) -> Result<Vec<u8>> {
        let field = self.field_bytes(name)?;
        if field.spec.offset + field.bytes() > self.buffer.len() {
            return Err(Error::mismatch("a device field lies outside its buffer"));
        }
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

impl Drop for DeviceBatch {
    fn drop(&mut self) {
        for stream in std::mem::take(&mut self.users) {
            // Falls back to synchronising the stream when no event can be recorded.
            let _ = self.buffer.record_use(&stream);
        }
        // `buffer` drops next and returns to its pool behind these fences and `ready`.
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
    fn new(batch: &'a DeviceBatch, spec: &'a FieldSpec) -> Self {
        DeviceField {
            batch,
            spec,
            element: PhantomData,
        }
    }

    /// The field's name.
    pub fn name(&self) -> &'a str {
        &self.spec.name
    }

    /// Its element type.
    pub fn dtype(&self) -> DType {
        self.spec.dtype
    }

    /// Its shape in this batch: `[len, per-sample shape...]` (converted fields:
    /// `[len, C, H, W]`), C-contiguous.
    pub fn shape(&self) -> Vec<usize> {
        let mut shape = Vec::with_capacity(self.spec.shape.len() + 1);
        shape.push(self.batch.len());
        shape.extend_from_slice(&self.spec.shape);
        shape
    }

    /// Its size in bytes.
    pub fn bytes(&self) -> usize {
        self.spec.sample_bytes * self.batch.len()
    }

    /// The batch it views.
    pub fn batch(&self) -> &'a DeviceBatch {
        self.batch
    }

    fn addr(&self) -> sys::CUdeviceptr {
        self.batch.buffer.addr() + self.spec.offset as u64
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
