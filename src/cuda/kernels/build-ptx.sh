#!/usr/bin/env bash
# Regenerates the PTX of the CUDA C kernels beside this script (resize.cu -> resize.ptx), which
# the crate embeds and loads with cuModuleLoadData: no toolkit at build or run time.
#
#   bash src/cuda/kernels/build-ptx.sh          # from anywhere; no GPU needed
#
# The compiler is NVRTC (CUDA C to PTX, the front end nvcc runs) from the
# `nvidia-cuda-nvrtc-cu12` pip wheel, called through Python's ctypes: the `nvidia-cuda-nvcc-cu12`
# wheel ships ptxas and libnvvm but no nvcc driver. Both wheels go into a virtual environment
# under target/ (NVCC_VENV to use another). Version 12.4 writes PTX ISA 8.4, which every driver
# of CUDA 12.4 or later loads (the H200 machine's is CUDA 13); the target is compute_70 (Volta
# and later: the driver compiles the PTX for the GPU it runs on). ptxas then compiles each PTX
# for sm_90 (H100, H200) into a cubin beside it, which the crate also embeds and loads on such a
# GPU, so that the first batch does not wait for the driver's JIT; both replace the committed
# ones only once both were made.
set -euo pipefail
cd "$(dirname "$0")"
venv=${NVCC_VENV:-../../../target/nvcc-venv}
version=12.4
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q "nvidia-cuda-nvrtc-cu12==$version.*" "nvidia-cuda-nvcc-cu12==$version.*"
for cu in *.cu; do
  ptx="${cu%.cu}.ptx"
  "$venv/bin/python" - "$cu" "$ptx.tmp" <<'PY'
import ctypes, glob, os, sys
import nvidia.cuda_nvrtc
lib = glob.glob(os.path.join(os.path.dirname(nvidia.cuda_nvrtc.__file__), "lib", "libnvrtc.so*"))[0]
nvrtc = ctypes.CDLL(lib)
src, out = sys.argv[1], sys.argv[2]
prog = ctypes.c_void_p()
def check(status, what):
    if status != 0:
        nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
        sys.exit(f"{what}: {nvrtc.nvrtcGetErrorString(status).decode()}")
check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), open(src, "rb").read(), src.encode(), 0, None, None), "nvrtcCreateProgram")
# No fast math, so that rounding is the one resize.cu describes.
opts = [b"--gpu-architecture=compute_70", b"--std=c++14"]
status = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
size = ctypes.c_size_t()
nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
log = ctypes.create_string_buffer(size.value)
nvrtc.nvrtcGetProgramLog(prog, log)
if log.value.strip():
    print(log.value.decode(), file=sys.stderr)
check(status, "nvrtcCompileProgram")
nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
ptx = ctypes.create_string_buffer(size.value)
check(nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
open(out, "w").write(f"// Generated from {src} by build-ptx.sh (NVRTC, compute_70): do not edit by hand.\n" + ptx.value.decode())
PY
  ptxas=$("$venv/bin/python" -c 'import nvidia.cuda_nvcc, os; print(os.path.join(os.path.dirname(nvidia.cuda_nvcc.__file__), "bin", "ptxas"))')
  cubin="${cu%.cu}.sm_90.cubin"
  "$ptxas" -arch=sm_90 "$ptx.tmp" -o "$cubin.tmp"
  mv "$ptx.tmp" "$ptx"
  mv "$cubin.tmp" "$cubin"
  echo "$ptx: $(grep -m1 '^.version' "$ptx"), $(grep -m1 '^.target' "$ptx"); $cubin by ptxas -arch=sm_90"
done
