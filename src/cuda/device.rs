//! [`Device`]: one GPU's context, its copy stream and the kernels embedded in the crate.
//!
//! Opening a device checks first that the driver library can be loaded (cudarc panics
//! otherwise), then that the ordinal exists. A `Device` is cheap to clone (shared); every
//! clone uses the same context and copy stream.

use std::ffi::{CString, c_void};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream, result, sys};

use super::cuda_err;
use crate::error::{Error, Result};

/// The embedded kernels (hand-written PTX, see `kernels.ptx`), NUL-terminated for
/// `cuModuleLoadData`.
const PTX: &str = concat!(include_str!("kernels.ptx"), "\0");

/// True when the CUDA driver library (`libcuda`) can be loaded on this machine. Checked once.
pub fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // Our own look rather than cudarc's `is_culib_present`, which exists only when cudarc loads
    // the driver itself: in a build where another crate (candle) makes cudarc link it instead,
    // the library is already in the process and this finds it.
    *PRESENT.get_or_init(|| {
        [c"libcuda.so.1", c"libcuda.so"].iter().any(|name| {
            // SAFETY: `name` is a NUL-terminated string; dlopen only maps the library (the
            // driver's initialisers run no driver call), and a handle it returns is closed
            // at once: the library stays loaded only if the process already held it.
            unsafe {
                let handle = libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
                if handle.is_null() {
                    false
                } else {
                    libc::dlclose(handle);
                    true
                }
            }
        })
    })
}

/// One GPU: a context (the device's primary context), a copy stream, and the embedded kernels.
#[derive(Clone)]
pub struct Device {
    inner: Arc<DeviceInner>,
}

struct DeviceInner {
    ctx: Arc<CudaContext>,
    copy_stream: Arc<CudaStream>,
    name: String,
    sm_count: u32,
    kernels: Mutex<Option<Arc<Kernels>>>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("ordinal", &self.ordinal())
            .field("name", &self.inner.name)
            .finish()
    }
}

impl Device {
    /// Opens GPU `ordinal`: retains its primary context (the one the CUDA runtime, and so
    /// PyTorch, uses) and creates one copy stream. The calling thread's current context is left
    /// as it was.
    ///
    /// [`Error::NoGpu`] when no driver can be loaded, the driver finds no device, or no
    /// device has this ordinal; [`Error::Cuda`] when the driver fails otherwise.
    pub fn open(ordinal: usize) -> Result<Device> {
        if !driver_present() {
            return Err(Error::NoGpu {
                what: "the CUDA driver library (libcuda) cannot be loaded on this machine".into(),
            });
        }
        result::init().map_err(|e| Error::NoGpu {
            what: format!("cuInit failed: {e:?}"),
        })?;
        // cudarc makes the context current while it opens it; the caller's thread keeps its own.
        let _scope = ContextScope::keep();
        let count = result::device::get_count().map_err(|e| Error::NoGpu {
            what: format!("cannot count devices: {e:?}"),
        })?;
        let count = usize::try_from(count).unwrap_or(0);
        if ordinal >= count {
            return Err(Error::NoGpu {
                what: format!("no device with ordinal {ordinal}: this machine has {count}"),
            });
        }
        // cudarc's event tracking stays as the context has it (on, for a new `CudaContext`):
        // gpufeed's own memory is ordered by its own fences and does not depend on it, and a
        // user's `CudaSlice` on this context is sound only with it. Its one cost, a context
        // synchronisation when the context's first stream is created, falls here, at open.
        let ctx = CudaContext::new(ordinal).map_err(cuda_err("open the device's context"))?;
        Device::from_context(ctx)
    }

    /// Uses a context the caller already has (candle's, a `CudaContext` of its own): gpufeed
    /// creates its copy stream on it and changes none of its settings. Creating a context
    /// costs hundreds of milliseconds on a warm machine (`benches/RESULTS.md`); sharing one
    /// pays it once. The calling thread's current context is left as it was.
    pub fn from_context(ctx: Arc<CudaContext>) -> Result<Device> {
        let _scope = ContextScope::enter(&ctx)?;
        let copy_stream = ctx
            .new_stream()
            .map_err(cuda_err("create the copy stream"))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_or(1, |n| n.max(1) as u32);
        Ok(Device {
            inner: Arc::new(DeviceInner {
                ctx,
                copy_stream,
                name,
                sm_count,
                kernels: Mutex::new(None),
            }),
        })
    }

    /// Opens the GPU of this process's local rank: `LOCAL_RANK` (torchrun), else
    /// `SLURM_LOCALID`, else 0.
    pub fn from_env() -> Result<Device> {
        Device::open(local_rank_from_env()?)
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ctx.ordinal()
    }

    /// The device's name (`NVIDIA H200`).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Its number of multiprocessors.
    pub fn sm_count(&self) -> u32 {
        self.inner.sm_count
    }

    /// The cudarc context (the device's primary context, shared with PyTorch and others). Its
    /// event tracking is on (gpufeed never changes a context's settings), so `CudaSlice`s made
    /// on it order themselves across streams as cudarc intends.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }

    /// The stream every host-to-device copy of this device's loaders goes on. Work you enqueue
    /// on it delays the copies (tests use that to hold it busy).
    pub fn copy_stream(&self) -> &Arc<CudaStream> {
        &self.inner.copy_stream
    }

    /// A new non-blocking stream, for the consumer's work.
    pub fn new_stream(&self) -> Result<Arc<CudaStream>> {
        self.inner
            .ctx
            .new_stream()
            .map_err(cuda_err("create a stream"))
    }

    /// Makes this device's context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        self.inner
            .ctx
            .bind_to_thread()
            .map_err(cuda_err("make the context current"))
    }

    /// Launches `kernel`, one of the embedded kernels that loop over `total` elements with a
    /// grid stride, on `stream`: blocks of 256 threads, as many as the elements need and at
    /// most 16 per multiprocessor. `what` names the launch in its error.
    ///
    /// # Safety
    ///
    /// `kernel` must be a function of this device's [`Kernels`], `args` must point at values
    /// that match its parameters in order and type, and every address among them must reach
    /// memory of this device that holds what the kernel reads and writes for `total` elements
    /// and stays allocated until it has run.
    pub(crate) unsafe fn launch_grid_stride(
        &self,
        kernel: sys::CUfunction,
        total: u32,
        stream: &CudaStream,
        args: &mut [*mut c_void],
        what: &'static str,
    ) -> Result<()> {
        let block = 256u32;
        let grid = total.div_ceil(block).min(self.sm_count() * 16).max(1);
        self.bind()?;
        // SAFETY: the kernel, its arguments and the memory they reach are as the caller's
        // contract says; the driver copies the arguments before this returns.
        unsafe {
            result::launch_kernel(
                kernel,
                (grid, 1, 1),
                (block, 1, 1),
                0,
                stream.cu_stream(),
                args,
            )
        }
        .map_err(cuda_err(what))
    }

    /// Waits (blocking the host) until every stream of the device is idle.
    pub fn synchronize(&self) -> Result<()> {
        self.inner
            .ctx
            .synchronize()
            .map_err(cuda_err("synchronize the context"))
    }

    /// The embedded kernels, loaded on first use.
    pub(crate) fn kernels(&self) -> Result<Arc<Kernels>> {
        let mut slot = self.inner.kernels.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(k) = &*slot {
            return Ok(Arc::clone(k));
        }
        let k = Arc::new(Kernels::load(&self.inner.ctx)?);
        *slot = Some(Arc::clone(&k));
        Ok(k)
    }

    /// Enqueues on `stream` a kernel that busy-waits for `duration` of GPU time (one thread,
    /// timed by `%globaltimer`): a stand-in for a training step, and a way to hold a stream
    /// busy in tests. Does not wait.
    pub fn spin(&self, stream: &CudaStream, duration: Duration) -> Result<()> {
        let kernels = self.kernels()?;
        self.bind()?;
        let mut ns = u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
        let mut args = [(&raw mut ns).cast::<c_void>()];
        // SAFETY: `gpufeed_spin` takes one u64 by value, which `args` points to for the
        // duration of the call (the driver copies parameters at launch); it touches no memory.
        unsafe {
            result::launch_kernel(
                kernels.spin,
                (1, 1, 1),
                (1, 1, 1),
                0,
                stream.cu_stream(),
                &mut args,
            )
        }
        .map_err(cuda_err("launch gpufeed_spin"))
    }
}

/// Makes a context current on the calling thread for a while, and puts back the one that was
/// current before (or none) when it drops.
///
/// cudarc makes its context current on the calling thread and leaves it so; on a thread that
/// belongs to someone else (a Python thread, where a DLPack deleter or `stats()` runs), that
/// would change which device the CUDA runtime, and so PyTorch, takes as current. Entry points a
/// foreign thread calls hold a scope while they call the driver.
pub(crate) struct ContextScope {
    /// The context current before, restored on drop (null: none).
    previous: sys::CUcontext,
}

impl ContextScope {
    /// Makes `ctx` current until the scope drops.
    pub(crate) fn enter(ctx: &CudaContext) -> Result<ContextScope> {
        let previous = result::ctx::get_current()
            .map_err(cuda_err("read the current context (cuCtxGetCurrent)"))?
            .unwrap_or(std::ptr::null_mut());
        let scope = ContextScope { previous };
        if previous != ctx.cu_ctx() {
            // SAFETY: `ctx` is a live context (its `CudaContext` holds a retain of it); setting
            // it current only changes this thread's binding, which the drop below restores.
            unsafe { result::ctx::set_current(ctx.cu_ctx()) }
                .map_err(cuda_err("make the context current (cuCtxSetCurrent)"))?;
        }
        Ok(scope)
    }

    /// Remembers the context current now, restores it on drop, and changes nothing else
    /// (for calls that make a context current themselves, such as cudarc's).
    pub(crate) fn keep() -> ContextScope {
        let previous = result::ctx::get_current()
            .ok()
            .flatten()
            .unwrap_or(std::ptr::null_mut());
        ContextScope { previous }
    }
}

impl Drop for ContextScope {
    fn drop(&mut self) {
        let now = result::ctx::get_current()
            .ok()
            .flatten()
            .unwrap_or(std::ptr::null_mut());
        if now != self.previous {
            // SAFETY: `previous` was current on this thread when the scope began, so it was a
            // live context then (or null, which unbinds); a caller that destroys the context it
            // had current while a gpufeed call runs on its thread is not possible, since that
            // call holds the thread. Only this thread's binding changes.
            let _ = unsafe { result::ctx::set_current(self.previous) };
        }
    }
}

/// `LOCAL_RANK`, else `SLURM_LOCALID`, else 0.
fn local_rank_from_env() -> Result<usize> {
    for name in ["LOCAL_RANK", "SLURM_LOCALID"] {
        if let Ok(v) = std::env::var(name) {
            return v.trim().parse().map_err(|_| {
                Error::config(
                    "device",
                    format!("environment variable {name}={v:?} is not a device ordinal"),
                )
            });
        }
    }
    Ok(0)
}

/// The loaded module of embedded kernels.
pub(crate) struct Kernels {
    ctx: Arc<CudaContext>,
    module: sys::CUmodule,
    pub(crate) convert: sys::CUfunction,
    pub(crate) widen: sys::CUfunction,
    pub(crate) spin: sys::CUfunction,
}

// SAFETY: module and function handles are plain driver handles, usable from any thread once the
// context is current; nothing here is mutated after `load`.
unsafe impl Send for Kernels {}
// SAFETY: as for Send: shared use only reads the handles.
unsafe impl Sync for Kernels {}

impl Kernels {
    fn load(ctx: &Arc<CudaContext>) -> Result<Kernels> {
        ctx.bind_to_thread()
            .map_err(cuda_err("make the context current"))?;
        // SAFETY: PTX is a NUL-terminated PTX text (concat! above) that lives for the program.
        let module = unsafe { result::module::load_data(PTX.as_ptr().cast()) }
            .map_err(cuda_err("load the embedded PTX (cuModuleLoadData)"))?;
        let get = |name: &str| {
            let cname = CString::new(name).map_err(|e| Error::Cuda {
                op: "get a kernel",
                what: e.to_string(),
            })?;
            // SAFETY: `module` was just loaded and is not unloaded before `Kernels` drops.
            unsafe { result::module::get_function(module, cname) }
                .map_err(cuda_err("find a kernel in the embedded PTX"))
        };
        let functions = get("gpufeed_convert_u8")
            .and_then(|c| Ok((c, get("gpufeed_widen")?, get("gpufeed_spin")?)));
        match functions {
            Ok((convert, widen, spin)) => Ok(Kernels {
                ctx: Arc::clone(ctx),
                module,
                convert,
                widen,
                spin,
            }),
            Err(e) => {
                // SAFETY: loaded above, unloaded once, no function of it escapes.
                let _ = unsafe { result::module::unload(module) };
                Err(e)
            }
        }
    }
}

impl Drop for Kernels {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // Kernels launched from it may still run: let them finish first.
            let _ = self.ctx.synchronize();
            // SAFETY: the module was loaded by `load` and is unloaded once, here; every user
            // holds an `Arc<Kernels>`, so no launch can use it afterwards.
            let _ = unsafe { result::module::unload(self.module) };
        }
    }
}
