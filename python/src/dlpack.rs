//! DLPack export: gpufeed's [`Array`], one field of a batch viewed in place, as a DLPack capsule.
//!
//! The structs are those of `dlpack.h` (v1.0, with the legacy `DLManagedTensor` of v0.x),
//! written out by hand: they are small, stable, and `#[repr(C)]` is all they need. An exported
//! capsule owns a boxed [`Export`]: the managed tensor, its shape and strides, and an [`Owner`]
//! (a reference count on the memory viewed). The consumer (numpy, torch) calls the deleter when
//! its tensor dies, or the capsule's destructor does if nobody consumed it; either drops the box,
//! and when the last owner of a batch goes, the batch's buffer returns to the loader's pool.
//!
//! Deleters run on any thread, with or without the GIL: they touch no Python object, only Rust
//! reference counts, and never unwind.
//!
//! Device batches (feature `cuda`) export as CUDA arrays (`kDLCUDA`, the device's ordinal):
//! `__dlpack__(stream=S)` makes the consumer's stream `S` wait on gpufeed's copy event on the
//! device (`DeviceBatch::wait_on_raw`, never a host synchronisation) and registers it; the
//! deleter of the last array of a batch drops the batch, which records an event on every
//! registered stream and returns the buffer to its pool behind them (PyTorch's `record_stream`
//! rule), without waiting, on whatever thread the consumer frees its tensor.

use std::ffi::{CStr, c_void};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use gpufeed::{Batch, DType};
use pyo3::exceptions::{PyBufferError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyTuple};

/// `DLDeviceType::kDLCPU`: host memory, pinned or not (DLPack's `kDLCUDAHost` is refused by
/// PyTorch, and pinned memory is CPU memory to every consumer).
pub const KDL_CPU: i32 = 1;
/// `DLDeviceType::kDLCUDA`: device memory (of the device's primary context).
#[cfg(feature = "cuda")]
pub const KDL_CUDA: i32 = 2;

const DLPACK_MAJOR: u32 = 1;
const DLPACK_MINOR: u32 = 0;
/// `DLPACK_FLAG_BITMASK_IS_COPIED`.
const FLAG_IS_COPIED: u64 = 1 << 1;

const LEGACY_NAME: &CStr = c"dltensor";
const VERSIONED_NAME: &CStr = c"dltensor_versioned";

/// `DLDevice`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

/// `DLDataType`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// `DLTensor`.
#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

/// `DLManagedTensor` (the legacy, unversioned capsule `dltensor`).
#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// `DLPackVersion`.
#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

/// `DLManagedTensorVersioned` (the capsule `dltensor_versioned`, DLPack >= 1.0).
#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

/// The DLPack type of a gpufeed dtype, if DLPack has one.
fn dl_dtype(dtype: DType) -> Option<DLDataType> {
    // kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4, kDLBool 6.
    let (code, bits) = match dtype {
        DType::U8 => (1, 8),
        DType::I8 => (0, 8),
        DType::U16 => (1, 16),
        DType::I16 => (0, 16),
        DType::U32 => (1, 32),
        DType::I32 => (0, 32),
        DType::U64 => (1, 64),
        DType::I64 => (0, 64),
        DType::F16 => (2, 16),
        DType::BF16 => (4, 16),
        DType::F32 => (2, 32),
        DType::F64 => (2, 64),
        DType::Bool => (6, 8),
        _ => return None,
    };
    Some(DLDataType {
        code,
        bits,
        lanes: 1,
    })
}

/// The name numpy and torch give a dtype (`uint8`, `bfloat16`, ...).
pub fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::U8 => "uint8",
        DType::I8 => "int8",
        DType::U16 => "uint16",
        DType::I16 => "int16",
        DType::U32 => "uint32",
        DType::I32 => "int32",
        DType::U64 => "uint64",
        DType::I64 => "int64",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::F32 => "float32",
        DType::F64 => "float64",
        DType::Bool => "bool",
        other => other.name(),
    }
}

/// Batches delivered to Python and not yet released by every array viewing them.
static LIVE_BATCHES: AtomicU64 = AtomicU64::new(0);
/// Memory blocks owned by arrays (masks, indices, copies) and not yet released.
static LIVE_BLOCKS: AtomicU64 = AtomicU64::new(0);

/// (batches, blocks) alive now: for leak checks.
pub fn live_counts() -> (u64, u64) {
    (
        LIVE_BATCHES.load(Ordering::Acquire),
        LIVE_BLOCKS.load(Ordering::Acquire),
    )
}

/// A batch in Python's hands: shared by the arrays of its fields; its buffer returns to the
/// loader's pool (and its budget permit to the loader) when the last of them goes.
pub struct HeldBatch {
    batch: Batch,
}

impl HeldBatch {
    /// Holds `batch` for its arrays.
    pub fn new(batch: Batch) -> Arc<HeldBatch> {
        LIVE_BATCHES.fetch_add(1, Ordering::AcqRel);
        Arc::new(HeldBatch { batch })
    }

    /// The batch.
    pub fn batch(&self) -> &Batch {
        &self.batch
    }
}

impl Drop for HeldBatch {
    fn drop(&mut self) {
        LIVE_BATCHES.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A device batch in Python's hands: shared by the arrays of its fields (and their DLPack
/// capsules, on any thread); when the last goes, the batch drops: its buffer returns to the
/// device pool behind events recorded on every stream that the arrays were exported to.
#[cfg(feature = "cuda")]
pub struct HeldDeviceBatch {
    batch: gpufeed::cuda::DeviceBatch,
}

#[cfg(feature = "cuda")]
impl HeldDeviceBatch {
    /// Holds `batch` for its arrays.
    pub fn new(batch: gpufeed::cuda::DeviceBatch) -> Arc<HeldDeviceBatch> {
        LIVE_BATCHES.fetch_add(1, Ordering::AcqRel);
        Arc::new(HeldDeviceBatch { batch })
    }

    /// The batch.
    pub fn batch(&self) -> &gpufeed::cuda::DeviceBatch {
        &self.batch
    }
}

#[cfg(feature = "cuda")]
impl Drop for HeldDeviceBatch {
    fn drop(&mut self) {
        LIVE_BATCHES.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The devices opened so far, one `Device` per ordinal for the process: every loader on a GPU
/// shares its context and copy stream, and opening one (hundreds of milliseconds) is paid once.
/// They are never closed (a device lives as long as the process, as PyTorch's do).
#[cfg(feature = "cuda")]
pub fn open_device(ordinal: usize) -> gpufeed::Result<gpufeed::cuda::Device> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static DEVICES: OnceLock<Mutex<HashMap<usize, gpufeed::cuda::Device>>> = OnceLock::new();
    let mut devices = DEVICES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(d) = devices.get(&ordinal) {
        return Ok(d.clone());
    }
    let d = gpufeed::cuda::Device::open(ordinal)?;
    devices.insert(ordinal, d.clone());
    Ok(d)
}

/// DLPack's `stream` argument for CUDA memory: the consumer's stream to order after gpufeed's
/// copy, or `None` for `-1` (the consumer synchronises itself). `None` (the argument left out)
/// means the legacy default stream, `1` that stream too, `2` the calling thread's per-thread
/// default stream; `0` is refused, as DLPack says (it could mean either).
#[cfg(feature = "cuda")]
fn consumer_stream(
    stream: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<gpufeed::cuda::RawStream>> {
    use gpufeed::cuda::RawStream;
    let Some(stream) = stream.filter(|s| !s.is_none()) else {
        return Ok(Some(RawStream::LEGACY));
    };
    let value: i128 = stream.extract().map_err(|_| {
        PyTypeError::new_err(format!(
            "stream must be an integer (a CUDA stream handle), not {}",
            stream
                .get_type()
                .name()
                .map_or_else(|_| "?".into(), |n| n.to_string())
        ))
    })?;
    match value {
        -1 => Ok(None),
        0 => Err(PyBufferError::new_err(
            "stream=0 is ambiguous for CUDA memory (DLPack): pass 1 for the legacy default stream, 2 for the per-thread default stream, or a stream handle",
        )),
        v if v > 0 && v <= usize::MAX as i128 => {
            // SAFETY: DLPack's contract: a consumer passes a stream of the device it asked
            // for, which it uses for the array; gpufeed's (documented in the package): the
            // stream lives until the last array exported on it is gone. PyTorch's streams and
            // the default streams are never destroyed.
            Ok(Some(unsafe { RawStream::from_raw(v as usize) }))
        }
        v => Err(PyValueError::new_err(format!(
            "stream={v} is not a CUDA stream handle (DLPack: None, -1, 1, 2 or a stream)"
        ))),
    }
}

/// Memory owned by arrays themselves: a batch's mask or indices, or a copy (`copy=True`).
/// Kept as u64 words so that every dtype is aligned.
pub struct OwnedBlock {
    words: Box<[u64]>,
}

impl OwnedBlock {
    /// A block holding `bytes`.
    pub fn new(bytes: &[u8]) -> Arc<OwnedBlock> {
        let mut words = vec![0u64; bytes.len().div_ceil(8)].into_boxed_slice();
        // SAFETY: `words` has at least `bytes.len()` bytes, u64 has no invalid bit patterns,
        // and the two do not overlap (a fresh allocation).
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                words.as_mut_ptr().cast::<u8>(),
                bytes.len(),
            )
        };
        LIVE_BLOCKS.fetch_add(1, Ordering::AcqRel);
        Arc::new(OwnedBlock { words })
    }

    fn ptr(&self) -> *const u8 {
        self.words.as_ptr().cast()
    }
}

impl Drop for OwnedBlock {
    fn drop(&mut self) {
        LIVE_BLOCKS.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What keeps an array's memory alive.
#[derive(Clone)]
pub enum Owner {
    /// A field of a batch in a pooled buffer.
    Batch(Arc<HeldBatch>),
    /// Memory of the array's own.
    Block(Arc<OwnedBlock>),
    /// A field of a device batch, at this device address.
    #[cfg(feature = "cuda")]
    Device(Arc<HeldDeviceBatch>, u64),
}

/// A dense, C-ordered array exported through DLPack: one field of a batch (viewing the batch's
/// buffer in place), or a small block of its own (a mask, indices, a copy).
///
/// It implements `__dlpack__` and `__dlpack_device__`, so `torch.from_dlpack(a)` and
/// `numpy.from_dlpack(a)` view its memory without a copy; the memory stays valid as long as
/// any such view, or this object, is alive.
#[pyclass(frozen, module = "gpufeed", name = "Array")]
pub struct Array {
    owner: Owner,
    /// Byte offset of the data from the owner's start.
    offset: usize,
    nbytes: usize,
    dtype: DType,
    dl_dtype: DLDataType,
    shape: Vec<i64>,
    device: DLDevice,
}

/// The DLPack type of `dtype`, or an error naming it.
fn exportable(dtype: DType) -> PyResult<DLDataType> {
    dl_dtype(dtype).ok_or_else(|| {
        PyTypeError::new_err(format!(
            "gpufeed cannot export {dtype} arrays through DLPack"
        ))
    })
}

/// What of a batch's field an array views: the field (a ragged field's values), a ragged
/// field's offsets, the items of one sample of a ragged field, or the leading entries of a
/// field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum View {
    /// The field: `[len, *shape]`, or a ragged field's values, `[items, *item shape]`.
    Field,
    /// A ragged field's offsets: `[len + 1]` int64.
    Offsets,
    /// Sample `i`'s items of a ragged field: `[its items, *item shape]`.
    Sample(usize),
    /// The field's first `n` elements, flat: `[n]` (a token batch's `cu_seqlens`, of which
    /// the counted entries lead).
    Leading(usize),
}

/// `e` as the ValueError of an array that cannot be made.
fn unviewable(e: gpufeed::Error) -> PyErr {
    PyValueError::new_err(e.to_string())
}

impl Array {
    /// `view` of field `k` of a held batch, in place.
    pub fn batch_field(held: &Arc<HeldBatch>, k: usize, view: View) -> PyResult<Array> {
        let batch = held.batch();
        let layout = batch.layout();
        let (Some(field), Some(at)) = (layout.fields().get(k), layout.field_offset(k)) else {
            return Err(PyValueError::new_err(format!("the batch has no field {k}")));
        };
        let (offset, dtype, shape) = match view {
            View::Field => (
                at,
                field.dtype,
                batch.shape(&field.name).map_err(unviewable)?,
            ),
            View::Offsets => {
                let at = layout.offsets_offset(k).ok_or_else(|| {
                    PyValueError::new_err(format!("field `{}` is not ragged", field.name))
                })?;
                (at, DType::I64, vec![batch.len() + 1])
            }
            View::Sample(i) => {
                let offsets = batch.offsets(&field.name).map_err(unviewable)?;
                let (Some(&a), Some(&b)) = (offsets.get(i), offsets.get(i + 1)) else {
                    return Err(PyValueError::new_err(format!(
                        "the batch has no sample {i}"
                    )));
                };
                let mut shape = vec![(b - a) as usize];
                shape.extend_from_slice(&field.shape);
                (at + a as usize * field.item_bytes(), field.dtype, shape)
            }
            View::Leading(n) => {
                let all: usize = batch
                    .shape(&field.name)
                    .map_err(unviewable)?
                    .iter()
                    .product();
                if n > all {
                    return Err(PyValueError::new_err(format!(
                        "field `{}` has {all} entries, not {n}",
                        field.name
                    )));
                }
                (at, field.dtype, vec![n])
            }
        };
        let nbytes = shape.iter().product::<usize>() * dtype.size();
        if offset + nbytes > batch.buffer().len() {
            return Err(PyValueError::new_err(format!(
                "field `{}` lies outside its batch buffer",
                field.name
            )));
        }
        Ok(Array {
            owner: Owner::Batch(Arc::clone(held)),
            offset,
            nbytes,
            dtype,
            dl_dtype: exportable(dtype)?,
            shape: shape.iter().map(|&d| d as i64).collect(),
            device: DLDevice {
                device_type: KDL_CPU,
                device_id: 0,
            },
        })
    }

    /// `view` of field `k` of a held device batch, in place (a CUDA array).
    #[cfg(feature = "cuda")]
    pub fn device_field(held: &Arc<HeldDeviceBatch>, k: usize, view: View) -> PyResult<Array> {
        let batch = held.batch();
        let Some(field) = batch.fields().nth(k) else {
            return Err(PyValueError::new_err(format!(
                "the device batch has no field {k}"
            )));
        };
        // SAFETY (the three `ptr` calls): only the address's value is taken here. The memory
        // behind it is used by the consumers of the DLPack capsules made from this array, each
        // of which holds the batch (the owner) until its deleter runs, and whose stream
        // `__dlpack__` orders after the copy and registers for the release: the rule of
        // `DeviceField::ptr`.
        let (addr, nbytes, dtype, shape) = match view {
            View::Field => {
                // SAFETY: see above.
                let addr = unsafe { field.ptr() };
                (addr, field.bytes(), field.dtype(), field.shape())
            }
            View::Offsets => {
                let offsets = batch.offsets(field.name()).map_err(unviewable)?;
                // SAFETY: see above.
                let addr = unsafe { offsets.ptr() };
                (addr, offsets.bytes(), offsets.dtype(), offsets.shape())
            }
            View::Sample(i) => {
                let offsets = batch.offsets_host(field.name()).map_err(unviewable)?;
                let (Some(&a), Some(&b)) = (offsets.get(i), offsets.get(i + 1)) else {
                    return Err(PyValueError::new_err(format!(
                        "the batch has no sample {i}"
                    )));
                };
                let values = field.shape();
                let item_bytes = values[1..].iter().product::<usize>() * field.dtype().size();
                let mut shape = vec![(b - a) as usize];
                shape.extend_from_slice(&values[1..]);
                // SAFETY: see above.
                let addr = unsafe { field.ptr() } + (a as usize * item_bytes) as u64;
                (addr, (b - a) as usize * item_bytes, field.dtype(), shape)
            }
            View::Leading(n) => {
                let bytes = n * field.dtype().size();
                if bytes > field.bytes() {
                    return Err(PyValueError::new_err(format!(
                        "field `{}` has {} bytes, not the {bytes} of {n} entries",
                        field.name(),
                        field.bytes()
                    )));
                }
                // SAFETY: see above.
                let addr = unsafe { field.ptr() };
                (addr, bytes, field.dtype(), vec![n])
            }
        };
        Ok(Array {
            owner: Owner::Device(Arc::clone(held), addr),
            offset: 0,
            nbytes,
            dtype,
            dl_dtype: exportable(dtype)?,
            shape: shape.iter().map(|&d| d as i64).collect(),
            device: DLDevice {
                device_type: KDL_CUDA,
                device_id: batch.ordinal() as i32,
            },
        })
    }

    /// True for device memory.
    fn on_device(&self) -> bool {
        self.device.device_type != KDL_CPU
    }

    /// An array of its own holding `bytes`, of `dtype` and `shape`.
    pub fn owned(bytes: &[u8], dtype: DType, shape: Vec<i64>) -> PyResult<Array> {
        Ok(Array {
            owner: Owner::Block(OwnedBlock::new(bytes)),
            offset: 0,
            nbytes: bytes.len(),
            dtype,
            dl_dtype: exportable(dtype)?,
            shape,
            device: DLDevice {
                device_type: KDL_CPU,
                device_id: 0,
            },
        })
    }

    /// The address of the first element.
    fn data_ptr(&self) -> *mut c_void {
        let base = match &self.owner {
            Owner::Batch(held) => held.batch().buffer().as_ptr(),
            Owner::Block(block) => block.ptr(),
            // A device address: never dereferenced on the host.
            #[cfg(feature = "cuda")]
            Owner::Device(_, addr) => *addr as usize as *const u8,
        };
        // The consumers may write through this pointer (a training loop that normalises in
        // place): the batch belongs to Python until its last view goes, and gpufeed never
        // reads or writes it again before then.
        base.wrapping_add(self.offset).cast_mut().cast()
    }

    /// The array's bytes (host arrays only).
    fn bytes(&self) -> PyResult<&[u8]> {
        if self.on_device() {
            return Err(PyBufferError::new_err(
                "this gpufeed.Array is in device memory: read it through a GPU library (torch.from_dlpack, cupy.from_dlpack)",
            ));
        }
        // SAFETY: a host array (checked above): `data_ptr` points to `nbytes` initialised bytes
        // (checked against the buffer's length when the array was made) that live as long as
        // `self.owner`, which `self` keeps; the borrow lasts only while the copy below is made.
        Ok(unsafe { std::slice::from_raw_parts(self.data_ptr().cast::<u8>(), self.nbytes) })
    }

    /// C-order strides, in elements.
    fn strides(&self) -> Vec<i64> {
        let mut strides = vec![1i64; self.shape.len()];
        for d in (0..self.shape.len().saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * self.shape[d + 1].max(1);
        }
        strides
    }

    fn dl_tensor(&self, shape: &mut [i64], strides: &mut [i64]) -> DLTensor {
        DLTensor {
            data: self.data_ptr(),
            device: self.device,
            ndim: self.shape.len() as i32,
            dtype: self.dl_dtype,
            shape: shape.as_mut_ptr(),
            strides: strides.as_mut_ptr(),
            byte_offset: 0,
        }
    }

    /// A copy of this array with memory of its own.
    fn copied(&self) -> PyResult<Array> {
        Array::owned(self.bytes()?, self.dtype, self.shape.clone())
    }

    /// The memory's device as a Python tuple `(device_type, device_id)`.
    fn device_tuple(&self) -> (i32, i32) {
        (self.device.device_type, self.device.device_id)
    }
}

/// What an exported capsule owns: the managed tensor `M` (legacy or versioned), the shape and
/// strides it points to, and the owner of the memory.
struct Export<M> {
    managed: M,
    _shape: Box<[i64]>,
    _strides: Box<[i64]>,
    _owner: Owner,
}

/// The deleter of a legacy managed tensor: frees its [`Export`].
unsafe extern "C" fn delete_legacy(managed: *mut DLManagedTensor) {
    if managed.is_null() {
        return;
    }
    // SAFETY: `managed` is the `managed` field of a boxed Export made by `export_legacy`,
    // whose `manager_ctx` points to that box; DLPack calls the deleter once.
    let ctx = unsafe { (*managed).manager_ctx }.cast::<Export<DLManagedTensor>>();
    // A panic must not unwind into C: the batch is then leaked, not freed.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: see above; the box is dropped exactly once, here.
        drop(unsafe { Box::from_raw(ctx) })
    }));
}

/// The deleter of a versioned managed tensor: frees its [`Export`].
unsafe extern "C" fn delete_versioned(managed: *mut DLManagedTensorVersioned) {
    if managed.is_null() {
        return;
    }
    // SAFETY: as in `delete_legacy`, for `export_versioned`'s boxes.
    let ctx = unsafe { (*managed).manager_ctx }.cast::<Export<DLManagedTensorVersioned>>();
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: see above.
        drop(unsafe { Box::from_raw(ctx) })
    }));
}

/// The destructor of a `dltensor` capsule: frees the tensor if no consumer took it (a consumer
/// renames the capsule `used_dltensor` and calls the deleter itself).
unsafe extern "C" fn destroy_legacy_capsule(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python with the GIL held on a capsule object; `PyCapsule_IsValid` and
    // `PyCapsule_GetPointer` with the name it checked do not fail or set an exception.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, LEGACY_NAME.as_ptr()) == 1 {
            let managed =
                ffi::PyCapsule_GetPointer(capsule, LEGACY_NAME.as_ptr()).cast::<DLManagedTensor>();
            if let Some(deleter) = (*managed).deleter {
                deleter(managed);
            }
        }
    }
}

/// The destructor of a `dltensor_versioned` capsule; see [`destroy_legacy_capsule`].
unsafe extern "C" fn destroy_versioned_capsule(capsule: *mut ffi::PyObject) {
    // SAFETY: as in `destroy_legacy_capsule`.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, VERSIONED_NAME.as_ptr()) == 1 {
            let managed = ffi::PyCapsule_GetPointer(capsule, VERSIONED_NAME.as_ptr())
                .cast::<DLManagedTensorVersioned>();
            if let Some(deleter) = (*managed).deleter {
                deleter(managed);
            }
        }
    }
}

/// Wraps `managed` (a pointer into a leaked box that the destructor frees) in a capsule.
fn capsule<'py>(
    py: Python<'py>,
    managed: *mut c_void,
    name: &'static CStr,
    destructor: unsafe extern "C" fn(*mut ffi::PyObject),
    free: impl FnOnce(),
) -> PyResult<Bound<'py, PyCapsule>> {
    // SAFETY: `managed` is non-null and valid until the destructor frees it; `name` is static,
    // as a capsule's name must outlive it.
    let raw = unsafe { ffi::PyCapsule_New(managed, name.as_ptr(), Some(destructor)) };
    if raw.is_null() {
        free();
        return Err(PyErr::fetch(py));
    }
    // SAFETY: `raw` is a new, owned reference to a capsule.
    let any = unsafe { Bound::from_owned_ptr(py, raw) };
    Ok(any.cast_into::<PyCapsule>()?)
}

fn export_legacy<'py>(py: Python<'py>, array: &Array) -> PyResult<Bound<'py, PyCapsule>> {
    let mut shape = array.shape.clone().into_boxed_slice();
    let mut strides = array.strides().into_boxed_slice();
    let tensor = array.dl_tensor(&mut shape, &mut strides);
    let ctx = Box::into_raw(Box::new(Export {
        managed: DLManagedTensor {
            dl_tensor: tensor,
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_legacy),
        },
        _shape: shape,
        _strides: strides,
        _owner: array.owner.clone(),
    }));
    // SAFETY: `ctx` is a valid, uniquely owned box until the capsule's deleter frees it.
    let managed = unsafe {
        (*ctx).managed.manager_ctx = ctx.cast();
        std::ptr::addr_of_mut!((*ctx).managed)
    };
    capsule(
        py,
        managed.cast(),
        LEGACY_NAME,
        destroy_legacy_capsule,
        // SAFETY: the capsule was not made, so nothing else owns `ctx`.
        || drop(unsafe { Box::from_raw(ctx) }),
    )
}

fn export_versioned<'py>(
    py: Python<'py>,
    array: &Array,
    flags: u64,
) -> PyResult<Bound<'py, PyCapsule>> {
    let mut shape = array.shape.clone().into_boxed_slice();
    let mut strides = array.strides().into_boxed_slice();
    let tensor = array.dl_tensor(&mut shape, &mut strides);
    let ctx = Box::into_raw(Box::new(Export {
        managed: DLManagedTensorVersioned {
            version: DLPackVersion {
                major: DLPACK_MAJOR,
                minor: DLPACK_MINOR,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_versioned),
            flags,
            dl_tensor: tensor,
        },
        _shape: shape,
        _strides: strides,
        _owner: array.owner.clone(),
    }));
    // SAFETY: as in `export_legacy`.
    let managed = unsafe {
        (*ctx).managed.manager_ctx = ctx.cast();
        std::ptr::addr_of_mut!((*ctx).managed)
    };
    capsule(
        py,
        managed.cast(),
        VERSIONED_NAME,
        destroy_versioned_capsule,
        // SAFETY: as in `export_legacy`.
        || drop(unsafe { Box::from_raw(ctx) }),
    )
}

#[pymethods]
impl Array {
    /// Exports the array as a DLPack capsule (the Python array API's `__dlpack__`).
    ///
    /// `max_version` of `(1, x)` or more gives a versioned capsule (`dltensor_versioned`),
    /// otherwise a legacy one (`dltensor`). `stream` is ignored for host memory: there is
    /// nothing to order. For device memory it is the consumer's stream (None: the legacy
    /// default stream; 1 that stream, 2 the per-thread default stream, -1 no ordering): it
    /// waits on the device for gpufeed's copy, and the batch's memory is reused only once it
    /// has passed the point where the last array of the batch is freed. `dl_device` must be
    /// this array's device or None; `copy=True` exports a copy (host memory only), `copy=False`
    /// or None a view (never a copy).
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<&Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyCapsule>> {
        #[cfg(feature = "cuda")]
        if let Owner::Device(held, _) = &self.owner {
            if copy == Some(true) {
                return Err(PyBufferError::new_err(
                    "gpufeed does not copy device arrays (copy=True): take the view and copy it with the consumer (tensor.clone())",
                ));
            }
            if let Some(device) = dl_device
                && device != self.device_tuple()
            {
                return Err(PyBufferError::new_err(format!(
                    "gpufeed cannot export this array to device {device:?}: it lives on {:?} (DLPack device type, id)",
                    self.device_tuple()
                )));
            }
            let batch = held.batch();
            match consumer_stream(stream)? {
                Some(raw) => batch
                    .wait_on_raw(raw)
                    .map_err(|e| crate::errors::to_py(py, &e))?,
                // The consumer orders its own work; the release still follows the legacy
                // default stream, which follows every blocking stream.
                None => batch.release_on_raw(gpufeed::cuda::RawStream::LEGACY),
            }
        }
        let _ = stream;
        if let Some(device) = dl_device
            && device != self.device_tuple()
        {
            return Err(PyBufferError::new_err(format!(
                "gpufeed cannot export this array to device {device:?}: it lives on {:?} (DLPack device type, id)",
                self.device_tuple()
            )));
        }
        let copied;
        let (array, flags) = if copy == Some(true) {
            copied = self.copied()?;
            (&copied, FLAG_IS_COPIED)
        } else {
            (self, 0)
        };
        match max_version {
            Some((major, _)) if major >= DLPACK_MAJOR => export_versioned(py, array, flags),
            _ => export_legacy(py, array),
        }
    }

    /// `(device_type, device_id)`: `(1, 0)`, DLPack's kDLCPU, for host batches; `(2, N)`,
    /// kDLCUDA on device N, for device batches.
    fn __dlpack_device__(&self) -> (i32, i32) {
        self.device_tuple()
    }

    /// The shape: `(batch, *per-sample shape)` for a batch field.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }

    /// The element type, as numpy and torch name it (`uint8`, `float16`, `bfloat16`, ...).
    #[getter]
    fn dtype(&self) -> &'static str {
        dtype_name(self.dtype)
    }

    /// The number of dimensions.
    #[getter]
    fn ndim(&self) -> usize {
        self.shape.len()
    }

    /// Bytes of data.
    #[getter]
    fn nbytes(&self) -> usize {
        self.nbytes
    }

    /// `"cpu"` for host memory, `"cuda:N"` for device memory.
    #[getter]
    fn device(&self) -> String {
        if self.on_device() {
            format!("cuda:{}", self.device.device_id)
        } else {
            "cpu".into()
        }
    }

    fn __len__(&self) -> usize {
        self.shape.first().map_or(0, |&n| n as usize)
    }

    fn __repr__(&self) -> String {
        format!(
            "gpufeed.Array(shape={:?}, dtype={}, device={})",
            self.shape,
            dtype_name(self.dtype),
            self.device()
        )
    }

    /// numpy's `__array__`: `numpy.asarray(a)` views the array through DLPack (no copy unless
    /// `dtype` asks for a conversion or `copy=True`).
    #[pyo3(signature = (dtype=None, copy=None))]
    fn __array__<'py>(
        slf: &Bound<'py, Self>,
        dtype: Option<&Bound<'py, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        if slf.get().on_device() {
            return Err(PyTypeError::new_err(
                "this gpufeed.Array is in device memory: numpy cannot view it; use torch.from_dlpack or cupy.from_dlpack",
            ));
        }
        let numpy = py.import("numpy").map_err(|e| {
            PyTypeError::new_err(format!("numpy is needed to convert a gpufeed.Array: {e}"))
        })?;
        let mut array = numpy.call_method1("from_dlpack", (slf,))?;
        if let Some(dtype) = dtype {
            array = array.call_method1("astype", (dtype,))?;
        } else if copy == Some(true) {
            array = array.call_method0("copy")?;
        }
        Ok(array)
    }
}
