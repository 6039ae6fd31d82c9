"""Where nvJPEG's hardware decoder spends its set-up (what the GPU decode's first epoch pays).

gpufeed's decode stage takes 0.85 to 0.90 s to create nvJPEG's hardware decoder on the H200
(`DecodeSetup::hardware_seconds`), longer than a steady epoch of 12,000 images. This probe asks
libnvjpeg directly (ctypes, no gpufeed), in one process, with the primary context already made
by PyTorch:

- the time of `nvjpegCreateEx` for the hardware, GPU-hybrid and default backends, each twice
  (is the cost once per process, or per handle?);
- what the hardware backend asks of its allocators while it is created (count, bytes, the
  time spent in cudaMalloc and cudaHostAlloc), through logging allocators;
- the time of three `nvjpegJpegStateCreate` and of `nvjpegDecodeBatchedInitialize(128)`;
- torchvision's first `decode_jpeg(device="cuda")` in the same process, against its second.

    python3 nvjpeg_setup_probe.py [LIBNVJPEG] [JPEG_DIR]

Prints one JSON object per measurement.
"""

import ctypes
import glob
import json
import os
import site
import sys
import time

import torch


def find_nvjpeg():
    if len(sys.argv) > 1 and sys.argv[1]:
        return sys.argv[1]
    dirs = []
    for s in site.getsitepackages():
        dirs += [os.path.join(s, "nvidia", "cu13", "lib"), os.path.join(s, "nvidia", "nvjpeg", "lib"),
                 os.path.join(s, "torchvision.libs")]
    for d in dirs:
        libs = sorted(glob.glob(os.path.join(d, "libnvjpeg*.so*")))
        if libs:
            return libs[-1]
    return "libnvjpeg.so"


def find_cudart():
    for s in site.getsitepackages():
        for d in ("nvidia/cu13/lib", "nvidia/cuda_runtime/lib", "torch/lib"):
            libs = sorted(glob.glob(os.path.join(s, d, "libcudart.so*")))
            if libs:
                return libs[-1]
    return "libcudart.so"


def emit(**kw):
    print(json.dumps(kw), flush=True)


torch.cuda.init()
t0 = time.perf_counter()
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
emit(what="primary context (torch)", seconds=round(time.perf_counter() - t0, 4))

lib_path = find_nvjpeg()
nv = ctypes.CDLL(lib_path)
rt = ctypes.CDLL(find_cudart())
emit(what="libraries", nvjpeg=lib_path, cudart=rt._name)

MALLOC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t)
FREE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
PMALLOC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint)


class DevAllocator(ctypes.Structure):
    _fields_ = [("dev_malloc", MALLOC), ("dev_free", FREE)]


class PinnedAllocator(ctypes.Structure):
    _fields_ = [("pinned_malloc", PMALLOC), ("pinned_free", FREE)]


log = {"device": [0, 0, 0.0], "pinned": [0, 0, 0.0]}


def dev_malloc(p, size):
    t = time.perf_counter()
    r = rt.cudaMalloc(p, ctypes.c_size_t(size))
    e = log["device"]
    e[0] += 1; e[1] += size; e[2] += time.perf_counter() - t
    return r


def dev_free(p):
    return rt.cudaFree(ctypes.c_void_p(p))


def pinned_malloc(p, size, flags):
    t = time.perf_counter()
    r = rt.cudaHostAlloc(p, ctypes.c_size_t(size), ctypes.c_uint(flags))
    e = log["pinned"]
    e[0] += 1; e[1] += size; e[2] += time.perf_counter() - t
    return r


def pinned_free(p):
    return rt.cudaFreeHost(ctypes.c_void_p(p))


dev = DevAllocator(MALLOC(dev_malloc), FREE(dev_free))
pinned = PinnedAllocator(PMALLOC(pinned_malloc), FREE(pinned_free))
BACKENDS = {"default": 0, "gpu_hybrid": 2, "hardware": 3}


def create(backend, logged):
    handle = ctypes.c_void_p()
    for k in log:
        log[k] = [0, 0, 0.0]
    t = time.perf_counter()
    if logged:
        st = nv.nvjpegCreateEx(BACKENDS[backend], ctypes.byref(dev), ctypes.byref(pinned), 0, ctypes.byref(handle))
    else:
        st = nv.nvjpegCreateEx(BACKENDS[backend], None, None, 0, ctypes.byref(handle))
    dt = time.perf_counter() - t
    allocs = {k: {"count": v[0], "bytes": v[1], "seconds": round(v[2], 4)} for k, v in log.items()}
    return st, handle, dt, allocs


for backend in ("hardware", "gpu_hybrid", "default"):
    for attempt in (1, 2):
        st, handle, dt, allocs = create(backend, logged=True)
        row = dict(what="nvjpegCreateEx", backend=backend, attempt=attempt, status=st, seconds=round(dt, 4),
                   allocations=allocs)
        if st == 0 and backend == "hardware" and attempt == 1:
            engines, cores = ctypes.c_uint(), ctypes.c_uint()
            if hasattr(nv, "nvjpegGetHardwareDecoderInfo"):
                nv.nvjpegGetHardwareDecoderInfo(handle, ctypes.byref(engines), ctypes.byref(cores))
            row["engines"], row["cores"] = engines.value, cores.value
            states = []
            t = time.perf_counter()
            for _ in range(3):
                s = ctypes.c_void_p()
                nv.nvjpegJpegStateCreate(handle, ctypes.byref(s))
                states.append(s)
            row["three_states_seconds"] = round(time.perf_counter() - t, 4)
            for k in log:
                log[k] = [0, 0, 0.0]
            t = time.perf_counter()
            row["batched_init_status"] = nv.nvjpegDecodeBatchedInitialize(handle, states[0], 128, 1, 5)
            row["batched_init_seconds"] = round(time.perf_counter() - t, 4)
            row["batched_init_allocations"] = {k: {"count": v[0], "bytes": v[1]} for k, v in log.items()}
            for s in states:
                nv.nvjpegJpegStateDestroy(s)
        if st == 0:
            t = time.perf_counter()
            nv.nvjpegDestroy(handle)
            row["destroy_seconds"] = round(time.perf_counter() - t, 4)
        emit(**row)

# The hardware backend with nvJPEG's own allocators, after the handles above (a later handle).
st, handle, dt, _ = create("hardware", logged=False)
emit(what="nvjpegCreateEx", backend="hardware", attempt=3, allocators="nvJPEG's own", status=st,
     seconds=round(dt, 4))
if st == 0:
    nv.nvjpegDestroy(handle)

if len(sys.argv) > 2:
    from torchvision.io import decode_jpeg, read_file
    files = sorted(glob.glob(os.path.join(sys.argv[2], "*", "*.jpg")))[:256]
    data = [read_file(f) for f in files]
    for attempt, chunk in enumerate((data[:128], data[128:256])):
        t = time.perf_counter()
        decode_jpeg(chunk, device="cuda")
        torch.cuda.synchronize()
        emit(what="torchvision decode_jpeg(device='cuda'), 128 images", attempt=attempt + 1,
             seconds=round(time.perf_counter() - t, 4))
