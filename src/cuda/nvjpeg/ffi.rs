//! The part of nvJPEG's C API that gpufeed calls, declared from NVIDIA's `nvjpeg.h` (CUDA 12;
//! the same in CUDA 13), and its functions looked up in the loaded library (`dlsym`).
//!
//! Handles are opaque pointers; status codes are `c_int` (`nvjpegStatus_t`); enums are passed
//! as `c_int`. `cudaStream_t` is the driver's `CUstream` (the runtime's stream is the same
//! object).

use std::ffi::{CStr, c_int, c_uint, c_void};

use cudarc::driver::sys::CUstream;

/// `nvjpegStatus_t`.
pub(super) type Status = c_int;
pub(super) const STATUS_SUCCESS: Status = 0;

/// The name of a status code, as `nvjpeg.h` spells it.
pub(super) fn status_name(status: Status) -> &'static str {
    match status {
        0 => "NVJPEG_STATUS_SUCCESS",
        1 => "NVJPEG_STATUS_NOT_INITIALIZED",
        2 => "NVJPEG_STATUS_INVALID_PARAMETER",
        3 => "NVJPEG_STATUS_BAD_JPEG",
        4 => "NVJPEG_STATUS_JPEG_NOT_SUPPORTED",
        5 => "NVJPEG_STATUS_ALLOCATOR_FAILURE",
        6 => "NVJPEG_STATUS_EXECUTION_FAILED",
        7 => "NVJPEG_STATUS_ARCH_MISMATCH",
        8 => "NVJPEG_STATUS_INTERNAL_ERROR",
        9 => "NVJPEG_STATUS_IMPLEMENTATION_NOT_SUPPORTED",
        10 => "NVJPEG_STATUS_INCOMPLETE_BITSTREAM",
        _ => "an unknown nvJPEG status",
    }
}

/// `nvjpegBackend_t`.
pub(super) const BACKEND_DEFAULT: c_int = 0;
pub(super) const BACKEND_HYBRID: c_int = 1;
pub(super) const BACKEND_GPU_HYBRID: c_int = 2;
pub(super) const BACKEND_HARDWARE: c_int = 3;

/// `nvjpegOutputFormat_t::NVJPEG_OUTPUT_RGBI`: interleaved RGB in `channel[0]` (gray JPEGs
/// become gray RGB).
pub(super) const OUTPUT_RGBI: c_int = 5;

/// `nvjpegJpegEncoding_t::NVJPEG_ENCODING_BASELINE_DCT`.
pub(super) const ENCODING_BASELINE_DCT: c_int = 0xC0;

/// `NVJPEG_FLAGS_UPSAMPLING_WITH_INTERPOLATION` (CUDA 12.6 and later): chroma upsampling by
/// interpolation, as libjpeg's "fancy upsampling" (which the CPU decoders use), instead of
/// replication. Older libraries refuse the flag; the handle is then made without it.
pub(super) const FLAGS_UPSAMPLING_WITH_INTERPOLATION: c_uint = 32;

/// `libraryPropertyType`.
pub(super) const MAJOR_VERSION: c_int = 0;
pub(super) const MINOR_VERSION: c_int = 1;
pub(super) const PATCH_LEVEL: c_int = 2;

/// `NVJPEG_MAX_COMPONENT`.
pub(super) const MAX_COMPONENT: usize = 4;

/// `nvjpegImage_t`: the output planes (device pointers) and their row pitches.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct Image {
    pub channel: [*mut u8; MAX_COMPONENT],
    pub pitch: [usize; MAX_COMPONENT],
}

impl Image {
    /// Interleaved output at `ptr`, rows `pitch` bytes apart.
    pub(super) fn interleaved(ptr: u64, pitch: usize) -> Image {
        let mut image = Image {
            channel: [std::ptr::null_mut(); MAX_COMPONENT],
            pitch: [0; MAX_COMPONENT],
        };
        image.channel[0] = ptr as *mut u8;
        image.pitch[0] = pitch;
        image
    }
}

/// `tDevMallocV2` / `tDevFreeV2` / `tPinnedMallocV2` / `tPinnedFreeV2`.
pub(super) type MallocV2 =
    unsafe extern "C" fn(*mut c_void, *mut *mut c_void, usize, CUstream) -> c_int;
pub(super) type FreeV2 = unsafe extern "C" fn(*mut c_void, *mut c_void, usize, CUstream) -> c_int;

/// `nvjpegDevAllocatorV2_t`.
#[repr(C)]
pub(super) struct DevAllocatorV2 {
    pub dev_malloc: MallocV2,
    pub dev_free: FreeV2,
    pub dev_ctx: *mut c_void,
}

/// `nvjpegPinnedAllocatorV2_t`.
#[repr(C)]
pub(super) struct PinnedAllocatorV2 {
    pub pinned_malloc: MallocV2,
    pub pinned_free: FreeV2,
    pub pinned_ctx: *mut c_void,
}

/// Opaque handles.
pub(super) type Handle = *mut c_void;
pub(super) type State = *mut c_void;
pub(super) type Decoder = *mut c_void;
pub(super) type Stream = *mut c_void;
pub(super) type Params = *mut c_void;
pub(super) type BufferPinned = *mut c_void;
pub(super) type BufferDevice = *mut c_void;

/// Declares the function table: each entry's name is its C symbol; `required` entries must be
/// present, `optional` ones may be missing (older libraries).
macro_rules! api {
    (
        required { $($name:ident: fn($($arg:ty),* $(,)?);)* }
        optional { $($oname:ident: fn($($oarg:ty),* $(,)?);)* }
    ) => {
        /// nvJPEG's functions, resolved in the loaded library.
        #[allow(non_snake_case)]
        pub(super) struct Api {
            $(pub $name: unsafe extern "C" fn($($arg),*) -> Status,)*
            $(pub $oname: Option<unsafe extern "C" fn($($oarg),*) -> Status>,)*
        }

        impl Api {
            /// Looks every function up in `lib` (a `dlopen` handle); the name of the first
            /// required one missing is the error.
            ///
            /// # Safety
            ///
            /// `lib` is a live `dlopen` handle of a library whose symbols of these names are
            /// nvJPEG's functions with these signatures (NVIDIA's libnvjpeg).
            pub(super) unsafe fn resolve(lib: *mut c_void) -> Result<Api, &'static str> {
                Ok(Api {
                    $($name: {
                        let name: &CStr = CStr::from_bytes_with_nul(concat!(stringify!($name), "\0").as_bytes())
                            .map_err(|_| stringify!($name))?;
                        // SAFETY: `lib` is live (the caller's contract), `name` is NUL-terminated.
                        let f = unsafe { libc::dlsym(lib, name.as_ptr()) };
                        if f.is_null() {
                            return Err(stringify!($name));
                        }
                        // SAFETY: the symbol is nvJPEG's function of this signature (the
                        // caller's contract); a function pointer and a data pointer have one
                        // size on the platforms CUDA supports.
                        unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) -> Status>(f) }
                    },)*
                    $($oname: {
                        let name: &CStr = CStr::from_bytes_with_nul(concat!(stringify!($oname), "\0").as_bytes())
                            .map_err(|_| stringify!($oname))?;
                        // SAFETY: as above.
                        let f = unsafe { libc::dlsym(lib, name.as_ptr()) };
                        if f.is_null() {
                            None
                        } else {
                            // SAFETY: as above.
                            Some(unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($oarg),*) -> Status>(f) })
                        }
                    },)*
                })
            }
        }
    };
}

api! {
    required {
        nvjpegGetProperty: fn(c_int, *mut c_int);
        nvjpegCreateEx: fn(c_int, *mut c_void, *mut c_void, c_uint, *mut Handle);
        nvjpegDestroy: fn(Handle);
        nvjpegJpegStateCreate: fn(Handle, *mut State);
        nvjpegJpegStateDestroy: fn(State);
        nvjpegDecoderCreate: fn(Handle, c_int, *mut Decoder);
        nvjpegDecoderDestroy: fn(Decoder);
        nvjpegDecoderStateCreate: fn(Handle, Decoder, *mut State);
        nvjpegDecoderJpegSupported: fn(Decoder, Stream, Params, *mut c_int);
        nvjpegJpegStreamCreate: fn(Handle, *mut Stream);
        nvjpegJpegStreamDestroy: fn(Stream);
        nvjpegJpegStreamParse: fn(Handle, *const u8, usize, c_int, c_int, Stream);
        nvjpegJpegStreamParseHeader: fn(Handle, *const u8, usize, Stream);
        nvjpegJpegStreamGetJpegEncoding: fn(Stream, *mut c_int);
        nvjpegBufferPinnedDestroy: fn(BufferPinned);
        nvjpegBufferDeviceDestroy: fn(BufferDevice);
        nvjpegStateAttachPinnedBuffer: fn(State, BufferPinned);
        nvjpegStateAttachDeviceBuffer: fn(State, BufferDevice);
        nvjpegDecodeParamsCreate: fn(Handle, *mut Params);
        nvjpegDecodeParamsDestroy: fn(Params);
        nvjpegDecodeParamsSetOutputFormat: fn(Params, c_int);
        nvjpegDecodeParamsSetROI: fn(Params, c_int, c_int, c_int, c_int);
        nvjpegDecodeJpegHost: fn(Handle, Decoder, State, Params, Stream);
        nvjpegDecodeJpegTransferToDevice: fn(Handle, Decoder, State, Stream, CUstream);
        nvjpegDecodeJpegDevice: fn(Handle, Decoder, State, *mut Image, CUstream);
        nvjpegDecodeBatchedInitialize: fn(Handle, State, c_int, c_int, c_int);
        nvjpegDecodeBatched: fn(Handle, State, *const *const u8, *const usize, *mut Image, CUstream);
        nvjpegDecodeBatchedSupported: fn(Handle, Stream, *mut c_int);
    }
    optional {
        nvjpegCreateExV2: fn(c_int, *mut DevAllocatorV2, *mut PinnedAllocatorV2, c_uint, *mut Handle);
        nvjpegBufferPinnedCreateV2: fn(Handle, *mut PinnedAllocatorV2, *mut BufferPinned);
        nvjpegBufferDeviceCreateV2: fn(Handle, *mut DevAllocatorV2, *mut BufferDevice);
        nvjpegBufferPinnedCreate: fn(Handle, *mut c_void, *mut BufferPinned);
        nvjpegBufferDeviceCreate: fn(Handle, *mut c_void, *mut BufferDevice);
        nvjpegGetHardwareDecoderInfo: fn(Handle, *mut c_uint, *mut c_uint);
        nvjpegDecodeBatchedEx: fn(Handle, State, *const *const u8, *const usize, *mut Image, *mut Params, CUstream);
        nvjpegDecodeBatchedSupportedEx: fn(Handle, Stream, Params, *mut c_int);
    }
}
