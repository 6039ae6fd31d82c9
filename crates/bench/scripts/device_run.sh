#!/usr/bin/env bash
# One device run on the H200 machine: every staged test with GPUFEED_REQUIRE_GPU=1, then PyTorch
# and gpufeed side by side on the same files. Stage first (here, on the build machine):
#   CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=symbols \
#     GPU_FEATURES="cuda,turbojpeg" ../shared/tools/gpu-stage
#   cp ../shared/bench/torch_baseline.py .gpu/
# then call the device tool's `run` with carry [".gpu"] and `bash crates/bench/scripts/device_run.sh`.
# Summaries go to stdout; logs to $OUT (at most 8 files come back).
# `bash crates/bench/scripts/device_run.sh gpu` runs only the GPU benches (the .npy must be made first:
# the torch step makes it, or it is made here with numpy); `bash crates/bench/scripts/device_run.sh images`
# runs the tests, then only the JPEG benches.
set -u
ONLY=${1:-all}
cd "$(dirname "$0")/../../.."
G=.gpu
OUT=${OUT:-/tmp/gpufeed-out}
LOGS=/tmp/gpufeed-logs
DATA=/tmp/gpufeed-baseline
mkdir -p "$OUT" "$LOGS" "$DATA"
export GPUFEED_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "cpus: $(nproc)"

if [ "$ONLY" = gpu ]; then
  python3 - "$DATA/records.npy" <<'PY'
import numpy as np, os, sys
p = sys.argv[1]
if not os.path.exists(p):
    mm = np.lib.format.open_memmap(p, mode="w+", dtype=np.uint8, shape=(16384, 150528))
    rng = np.random.default_rng(0)
    for s in range(0, 16384, 1024):
        mm[s:s + 1024] = rng.integers(0, 256, size=(1024, 150528), dtype=np.uint8)
    mm.flush()
PY
  for w in 12 16; do
    "$G/bin/gpufeed" bench "$DATA/records.npy" --workers "$w" --epochs 8 --device 0 --json | tee -a "$OUT/gpufeed.jsonl"
  done
  "$G/bin/gpufeed" bench "$DATA/records.npy" --workers 16 --epochs 8 --device 0 | tail -6
  exit 0
fi

step() { echo; echo "== $*"; }
echo "== tests (GPUFEED_REQUIRE_GPU=1)"
for t in "$G"/tests/*; do
  name=$(basename "$t")
  case $name in
    cli_pack_inspect) echo "skip $name: it runs the binary at its build-machine path"; continue ;;
  esac
  if "$t" -q >"$LOGS/$name.log" 2>&1; then
    echo "ok   $name: $(grep 'test result' "$LOGS/$name.log" | tail -1)"
  else
    echo "FAIL $name"; tail -25 "$LOGS/$name.log"
  fi
done
cat "$LOGS"/*.log >"$OUT/tests.log" 2>/dev/null

jpeg_benches() {
  step "PyTorch + PIL, JPEG RandomResizedCrop(224) + flip (one epoch from the DataLoader's creation)"
  python3 "$G/torch_baseline.py" --jpeg-dir "$DATA/jpegs" --only jpeg --workers 1,16 2>&1 | tee "$OUT/torch_jpeg.log" | grep -E '^\{|^#'
  step "PyTorch + PIL, same, 3 epochs with persistent workers"
  python3 crates/bench/scripts/torch_jpeg_epochs.py --jpeg-dir "$DATA/jpegs" --workers 1,16 --epochs 3 2>&1 | tee -a "$OUT/torch_jpeg.log"
  step "gpufeed, same JPEGs, same batches (128, drop_last), 3 epochs"
  for w in 1 16; do
    "$G/bin/gpufeed" bench --images "$DATA/jpegs" --workers "$w" --batch-size 128 --drop-last --epochs 3 --json | tee -a "$OUT/gpufeed.jsonl"
  done
  "$G/bin/gpufeed" pack --from imagefolder "$DATA/jpegs" -o "$DATA/jpegs.gfd" | tail -1
  for w in 1 16; do
    "$G/bin/gpufeed" bench --images "$DATA/jpegs.gfd" --workers "$w" --batch-size 128 --drop-last --epochs 3 --json | tee -a "$OUT/gpufeed.jsonl"
  done
  step "gpufeed, f16 normalised: on the host, then u8 CHW to the GPU and normalised there"
  for dev in "" "--device 0"; do
    # shellcheck disable=SC2086
    "$G/bin/gpufeed" bench --images "$DATA/jpegs.gfd" --workers 16 --batch-size 128 --drop-last --epochs 3 --image-dtype f16 $dev --json | tee -a "$OUT/gpufeed.jsonl"
  done
  step "imagenet_like: folder -> packed file -> f16 device batches"
  "$G/examples/imagenet_like" "$DATA/jpegs" 2>&1 | tail -3
}
if [ "$ONLY" = images ]; then
  jpeg_benches
  echo "== done"
  exit 0
fi
step "PyTorch DataLoader, raw records (16384 x 150528 B, batch 256, shuffled, pinned)"
python3 "$G/torch_baseline.py" --npy "$DATA/records.npy" --only raw --workers 0,4,8,16 2>&1 | tee "$OUT/torch_raw.log" | grep -E '^\{|^#'

step "gpufeed, same .npy, host only, with the plain gather baseline"
for w in 8 16; do
  "$G/bin/gpufeed" bench "$DATA/records.npy" --workers "$w" --epochs 5 --baseline --json | tee -a "$OUT/gpufeed.jsonl"
done
step "gpufeed, same .npy, to the GPU (pinned, copy stream), ceiling measured in the same run"
for w in 12 16; do
  "$G/bin/gpufeed" bench "$DATA/records.npy" --workers "$w" --epochs 5 --device 0 --json | tee -a "$OUT/gpufeed.jsonl"
done
"$G/bin/gpufeed" bench "$DATA/records.npy" --workers 16 --epochs 5 --device 0 | tail -25

step "train_loop_cuda: a GPU step slower than loading"
for ms in 10 25; do
  "$G/examples/train_loop_cuda" "$DATA/records.npy" --step-ms "$ms" --epochs 6 --workers 16 2>&1 | tail -6
done

step "memory against workers (2M records)"
"$G/examples/memory_vs_workers" 2>&1 | tail -6

jpeg_benches

step "first batch on a 100M-record file"
"$G/examples/open_large" "$DATA/large.gfd" --keep 2>&1 | tail -4
"$G/bin/gpufeed" bench "$DATA/large.gfd" --epochs 1 --max-batches 20 --json | tee -a "$OUT/gpufeed.jsonl"
rm -f "$DATA/large.gfd"
echo "== done"
