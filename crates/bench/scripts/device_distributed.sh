#!/usr/bin/env bash
# Issue 36's device run on the H200 machine (kind nvidia-h200: 1 GPU, 16 CPUs, torch 2.11 on
# Python 3.12), in two calls on one warm machine, each well under the 10-minute limit:
#
#   bash crates/bench/scripts/device_distributed.sh launch   # items 1-3, about 5 minutes
#   bash crates/bench/scripts/device_distributed.sh ranks    # item 4, about 6 minutes
#
# launch: python/tests/test_distributed.py with a local S3 server (moto, from the carried
#   wheels; GPUFEED_REQUIRE_S3=1: the S3 tests must not skip), first as CI runs it (the test
#   starts 8 processes with torchrun's variables), then with GPUFEED_TEST_LAUNCHER=torchrun:
#   two real `torchrun --nnodes 2 --node-rank {0,1} --nproc-per-node 4` agents on loopback
#   (static rendezvous, gloo), each "node" with its own cache directory, the ranks gathering
#   each epoch's samples with all_gather_object; a node's ranks and agent killed with SIGKILL
#   mid-epoch, the other node's ranks ending with the collective's error (not a hang).
# ranks: crates/bench/scripts/ranks_throughput.py under torchrun --nproc-per-node 8 (every rank
#   copying to the one GPU, 2 worker threads each: 16 CPUs shared) against --nproc-per-node 1
#   with 16 threads, on (a) raw records of 150,528 B (GB/s on the GPU), (b) 12,000 JPEGs of
#   500x375, RandomResizedCrop(224) + flip, decode="gpu", bf16 (images/s), (c) a train.bin of
#   uint16 tokens, rows of 2,048 (tokens/s); the pinned host-to-device ceiling (torch, one
#   stream, 256 MiB pinned) measured in the same call.
#
# Stage on the build machine (x86-64; no GPU, no torch needed), from the repository's root:
#
#   rm -rf .gpu && mkdir -p .gpu/wheels     # /.gpu is in .gitignore
#   # gpufeed's abi3 wheel (CPython >= 3.9: 3.12 there loads it) with the S3 client; the
#   # package's `cuda` feature is a default (cudarc loads the driver at run time):
#   target/python-venv/bin/maturin build --profile wheel --strip --features s3 -m python/Cargo.toml -o .gpu/wheels
#   # moto's S3 server and the writers the test uses, for CPython 3.12, without what the
#   # machine has already (werkzeug, jinja2, requests, pyyaml, xxhash, pillow, pyarrow...):
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux_2_34_x86_64 -d .gpu/wheels \
#     moto==5.2.1 boto3==1.44.8 botocore==1.44.8 s3transfer==0.19.3 jmespath==1.1.0 \
#     responses==0.26.3 xmltodict==1.0.4 py-partiql-parser==0.6.3 flask==3.1.3 \
#     flask-cors==6.0.5 blinker==1.9.0 itsdangerous==2.2.0 cryptography==50.0.2 cffi==2.1.1 \
#     pycparser==3.12 webdataset==1.0.2 braceexpand==0.1.7 mosaicml-streaming==0.13.0 \
#     zstd==1.5.6.1
#   # (zstd: CI's 1.5.7.2 has no CPython 3.12 wheel, 1.5.7.3 and 1.5.6.2 are yanked.)
#   du -sh .gpu    # about 37 MiB (31 of them the wheels above): under 64 MiB with the tree
#
# Then the device tool's `run`, kind nvidia-h200, carry [".gpu"], timeout_s 600, command
# `bash crates/bench/scripts/device_distributed.sh launch`, then the same with `ranks`.
# What comes back under $OUT: run-MODE.log (this script's output; its last lines are the
# summary), launch: pytest_direct.log, pytest_torchrun.log; ranks: ranks.jsonl (one line per
# run of ranks_throughput.py), ceiling.json.
set -u -o pipefail
MODE=${1:-launch}
cd "$(dirname "$0")/../../.."
G=.gpu
OUT=${OUT:-/tmp/gpufeed-out}
DATA=/tmp/gpufeed-ranks
mkdir -p "$OUT" "$DATA"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec > >(tee "$OUT/run-$MODE.log") 2>&1
T0=$SECONDS
# Each call stays under ~9 minutes: a step that would not fit in what is left is skipped (and
# said so), so that what ran still comes back.
BUDGET=540
left() { echo $((BUDGET - (SECONDS - T0))); }
step() { echo; echo "== $(date +%T) (+$((SECONDS - T0)) s) $*"; }
fail=0
note_fail() { echo "FAILED: $*"; fail=1; }
# Runs "$@" under a time limit of $1 seconds, or skips it if less than that is left.
bounded() {
  local limit=$1; shift
  if [ "$(left)" -lt "$limit" ]; then echo "SKIPPED (${limit} s needed, $(left) s left): $*"; return 1; fi
  timeout --kill-after=10 "$limit" "$@"
}

step "machine"
nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv,noheader
echo "cpus: $(nproc)"

step "install the carried wheels"
ls "$G"/wheels/gpufeed-*.whl >/dev/null 2>&1 || { echo "no gpufeed wheel in $G/wheels: stage first (see the header)"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$G"/wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -c 'import sys, gpufeed, torch; print("python", sys.version.split()[0], "gpufeed", gpufeed.__version__, "torch", torch.__version__, "gpus", torch.cuda.device_count())' || exit 1

if [ "$MODE" = launch ]; then
  export GPUFEED_REQUIRE_S3=1 GPUFEED_MOTO_PYTHON=python3
  python3 -c 'import moto.server, flask, werkzeug, webdataset, streaming, zstd' || exit 1
  step "test_distributed.py as CI runs it (8 processes with torchrun's variables; S3 from moto)"
  bounded 180 python3 -m pytest python/tests/test_distributed.py -q -p no:cacheprovider -rs --durations=5 \
    >"$OUT/pytest_direct.log" 2>&1 || note_fail "pytest, direct launch"
  tail -15 "$OUT/pytest_direct.log"
  step "test_distributed.py through the real torchrun: 2 agents x 4 ranks on loopback, gloo"
  bounded 330 env GPUFEED_TEST_LAUNCHER=torchrun python3 -m pytest python/tests/test_distributed.py -q \
    -p no:cacheprovider -rs --durations=10 \
    -k "eight_ranks_read_s3 or killed_mid_epoch or token_ranks_make or token_stream_stopped" \
    >"$OUT/pytest_torchrun.log" 2>&1 || note_fail "pytest, torchrun"
  tail -25 "$OUT/pytest_torchrun.log"
elif [ "$MODE" = ranks ]; then
  step "data: 16,384 records of 150,528 B; 12,000 JPEGs of 500x375; 500M uint16 tokens"
  python3 - "$DATA" <<'PY' || { echo "could not make the data"; exit 1; }
import glob, os, sys
from concurrent.futures import ProcessPoolExecutor
import numpy as np

d = sys.argv[1]
records = os.path.join(d, "records.npy")
if not os.path.exists(records):
    mm = np.lib.format.open_memmap(records + ".tmp", mode="w+", dtype=np.uint8, shape=(16384, 150528))
    rng = np.random.default_rng(0)
    for s in range(0, 16384, 1024):
        mm[s:s + 1024] = rng.integers(0, 256, size=(1024, 150528), dtype=np.uint8)
    mm.flush()
    del mm
    os.replace(records + ".tmp", records)
tokens = os.path.join(d, "train.bin")
if not os.path.exists(tokens):
    np.random.default_rng(1).integers(1, 50257, size=500_000_000, dtype=np.uint16).tofile(tokens + ".tmp")
    os.replace(tokens + ".tmp", tokens)

def jpegs(part):
    # As torch_baseline.py makes its folder: crops of scikit-image's photos, resized to
    # 500x375, quality 90, 10 classes.
    from PIL import Image
    from skimage import data as skd
    photos = [Image.fromarray(getattr(skd, n)()[..., :3]) for n in
              ["astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "hubble_deep_field", "retina"]]
    rng = np.random.default_rng(2 + part)
    for i in range(part, 12000, 16):
        im = photos[i % len(photos)]
        w, h = im.size
        cw, ch = int(w * rng.uniform(0.5, 1)), int(h * rng.uniform(0.5, 1))
        x0, y0 = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
        c = os.path.join(d, "jpegs", f"class_{i % 10}")
        os.makedirs(c, exist_ok=True)
        im.crop((x0, y0, x0 + cw, y0 + ch)).resize((500, 375)).save(os.path.join(c, f"{i:06d}.jpg"), quality=90)

if len(glob.glob(os.path.join(d, "jpegs", "*", "*.jpg"))) < 12000:
    with ProcessPoolExecutor(16) as pool:
        list(pool.map(jpegs, range(16)))
print("records", os.path.getsize(records), "tokens", os.path.getsize(tokens),
      "jpegs", len(glob.glob(os.path.join(d, "jpegs", "*", "*.jpg"))))
PY
  # Everything read once, so that the page cache holds it for every run alike.
  cat "$DATA/records.npy" "$DATA/train.bin" >/dev/null

  step "the pinned ceiling: one process, one stream, 256 MiB pinned to the GPU (torch)"
  bounded 60 python3 - "$OUT/ceiling.json" <<'PY' || note_fail "ceiling"
import json, sys, torch
src = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
dst = torch.empty(256 << 20, dtype=torch.uint8, device="cuda:0")
for _ in range(3):
    dst.copy_(src, non_blocking=True)
torch.cuda.synchronize()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(40):
    dst.copy_(src, non_blocking=True)
end.record()
end.synchronize()
gbs = 40 * src.numel() / (start.elapsed_time(end) / 1e3) / 1e9
print(json.dumps({"pinned_h2d_gb_s": gbs}))
json.dump({"pinned_h2d_gb_s": gbs}, open(sys.argv[1], "w"))
PY

  R="crates/bench/scripts/ranks_throughput.py"
  ranks() {  # ranks NPROC WORKERS CASE DATA [args...]
    local n=$1 w=$2 case=$3 data=$4; shift 4
    step "$case: $n rank(s) x $w worker threads"
    bounded 85 python3 -m torch.distributed.run --standalone --nproc-per-node "$n" "$R" \
      --case "$case" --data "$data" --workers "$w" --out "$OUT/ranks.jsonl" "$@" \
      | grep -E '^\{' || note_fail "$case, $n rank(s) (exit status $?: 124 is a time-out, a hang)"
  }
  ranks 8 2 raw "$DATA/records.npy" --batch-size 256 --epochs 30
  ranks 1 16 raw "$DATA/records.npy" --batch-size 256 --epochs 30
  ranks 8 2 jpeg "$DATA/jpegs" --batch-size 128 --epochs 10
  ranks 1 16 jpeg "$DATA/jpegs" --batch-size 128 --epochs 10
  ranks 8 2 tokens "$DATA/train.bin" --batch-size 256 --seq-len 2048 --epochs 5
  ranks 1 16 tokens "$DATA/train.bin" --batch-size 256 --seq-len 2048 --epochs 5
else
  echo "mode $MODE: launch or ranks"; exit 2
fi

step "summary"
python3 - "$OUT" "$MODE" <<'PY'
import json, os, re, sys
out, mode = sys.argv[1], sys.argv[2]
if mode == "launch":
    for name in ("pytest_direct.log", "pytest_torchrun.log"):
        try:
            text = open(os.path.join(out, name)).read()
        except OSError:
            continue
        last = [l for l in text.splitlines() if re.search(r"passed|failed|error", l)]
        print(f"{name}: {last[-1] if last else 'no result line'}")
else:
    try:
        ceiling = json.load(open(os.path.join(out, "ceiling.json")))["pinned_h2d_gb_s"]
        print(f"pinned ceiling: {ceiling:.1f} GB/s")
    except (OSError, KeyError, ValueError):
        ceiling = None
    rows = []
    try:
        rows = [json.loads(l) for l in open(os.path.join(out, "ranks.jsonl")) if l.startswith("{")]
    except OSError:
        pass
    by = {(r["case"], r["ranks"]): r for r in rows}
    for case in ("raw", "jpeg", "tokens"):
        many, one = by.get((case, 8)), by.get((case, 1))
        if not many or not one:
            print(f"{case}: missing ({'8 ranks' if not many else ''} {'1 rank' if not one else ''})")
            continue
        ratio = many["aggregate"] / one["aggregate"]
        extra = f", {many['aggregate'] / ceiling:.0%} of the pinned ceiling" if case == "raw" and ceiling else ""
        spread = f"per rank {min(many['per_rank']):,.1f} to {max(many['per_rank']):,.1f}"
        print(f"{case}: 8 ranks x 2 threads {many['aggregate']:,.1f} {many['unit']} ({spread}); "
              f"1 rank x 16 threads {one['aggregate']:,.1f}; ratio {ratio:.0%} (goal >= 90%){extra}")
PY
echo "exit: $fail"
exit $fail
