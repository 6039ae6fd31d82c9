#!/usr/bin/env bash
# The first epoch's device run on the H200 machine: the staged tests (GPU tests must not skip), then
# where a first epoch goes, against PyTorch on the same files in the same run.
#
# Stage here first:
#   CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=symbols GPU_FEATURES=cuda ../shared/tools/gpu-stage
#   cp ../shared/bench/torch_baseline.py .gpu/
# then the device tool's `run` with carry [".gpu"] and `bash crates/bench/scripts/device_first_epoch.sh`.
# `bash crates/bench/scripts/device_first_epoch.sh bench` skips the tests; `... quick` runs the tests
# and gpufeed's own benches only (no PyTorch, no probe), on data numpy writes if it is missing.
set -u
ONLY=${1:-all}
cd "$(dirname "$0")/../../.."
G=.gpu
OUT=${OUT:-/tmp/gpufeed-out}
LOGS=/tmp/gpufeed-logs
DATA=/tmp/gpufeed-baseline
mkdir -p "$OUT" "$LOGS" "$DATA"
export PYTHONUNBUFFERED=1
# The CLI tests run the staged binary, not the one at its build-machine path.
GPUFEED_BIN="$(pwd)/$G/bin/gpufeed"
export GPUFEED_BIN
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "cpus: $(nproc)"
step() { echo; echo "== $*"; }

if [ "$ONLY" = all ] || [ "$ONLY" = quick ]; then
  step "tests (GPUFEED_REQUIRE_GPU=1)"
  for t in "$G"/tests/*; do
    name=$(basename "$t")
    threads=""
    case $name in *cuda*) threads="--test-threads=1" ;; esac
    # shellcheck disable=SC2086
    # The 66,000-input pack test is a CPU test of the command (CI runs it); on this machine's
    # disk it takes over 300 s.
    if GPUFEED_REQUIRE_GPU=1 timeout 300 "$t" -q $threads \
      --skip pack_takes_more_npy_inputs_than_the_kernel_has_maps >"$LOGS/$name.log" 2>&1; then
      echo "ok   $name: $(grep 'test result' "$LOGS/$name.log" | tail -1)"
    else
      echo "FAIL $name"; tail -30 "$LOGS/$name.log"
    fi
  done
  cat "$LOGS"/*.log >"$OUT/tests.log" 2>/dev/null
fi

if [ "$ONLY" = quick ]; then
  step "data (numpy)"
  python3 - "$DATA" <<'PY'
import os, sys, numpy as np
d = sys.argv[1]
for name, rows, width in (("records.npy", 16384, 150528), ("tokens.npy", 524288, 4096)):
    path = os.path.join(d, name)
    if not os.path.exists(path):
        a = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(rows, width))
        a[:] = np.arange(width, dtype=np.uint8)[None, :]
        a.flush()
PY
  step "gpufeed, 4096-B records, batch 512: host, then to the GPU, in turn"
  for i in 1 2 3; do
    "$G/bin/gpufeed" bench "$DATA/tokens.npy" --epochs 5 --batch-size 512 --json | tee -a "$OUT/gpufeed.jsonl"
    "$G/bin/gpufeed" bench "$DATA/tokens.npy" --epochs 5 --batch-size 512 --device 0 --json | tee -a "$OUT/gpufeed.jsonl"
  done
  step "gpufeed, 150528-B records to the GPU, 5 epochs"
  for i in 1 2; do
    "$G/bin/gpufeed" bench "$DATA/records.npy" --epochs 5 --device 0 --json | tee -a "$OUT/gpufeed.jsonl"
  done
  step "train_loop_cuda: a 10 ms step, 4 epochs, start-up included"
  "$G/examples/train_loop_cuda" "$DATA/records.npy" --step-ms 10 --epochs 4 --workers 14 2>&1 | tail -8
  echo "== done"
  exit 0
fi

step "PyTorch DataLoader, 16384 x 150528-B records, batch 256, shuffled, pinned, to the GPU"
python3 "$G/torch_baseline.py" --npy "$DATA/records.npy" --only raw --workers 0,16 2>&1 | tee "$OUT/torch.log" | grep -E '^\{'
step "PyTorch DataLoader, 524288 x 4096-B records, batch 512"
python3 "$G/torch_baseline.py" --npy "$DATA/tokens.npy" --records 524288 --record-bytes 4096 \
  --batch-size 512 --only raw --workers 0,16 2>&1 | tee -a "$OUT/torch.log" | grep -E '^\{'

step "first-epoch probe: context, pinned allocation, first copies, page faults"
"$G/examples/first_epoch_probe" "$DATA/records.npy" --buffers 34 --threads 16 | tee "$OUT/probe.jsonl"

# Workers: the defaults (16 on the host path; 14 to the GPU, two CPUs left to the copy thread
# and the consumer), as a user gets them.
step "gpufeed, 150528-B records to the GPU, 5 epochs: batches in parts (default) and whole, in turn"
for i in 1 2 3; do
  "$G/bin/gpufeed" bench "$DATA/records.npy" --epochs 5 --device 0 --json | tee -a "$OUT/gpufeed.jsonl"
  "$G/bin/gpufeed" bench "$DATA/records.npy" --epochs 5 --device 0 --batch-parts 1 --json | tee -a "$OUT/gpufeed.jsonl"
done
step "gpufeed, same, host only: in parts, whole"
"$G/bin/gpufeed" bench "$DATA/records.npy" --epochs 5 --json | tee -a "$OUT/gpufeed.jsonl"
"$G/bin/gpufeed" bench "$DATA/records.npy" --epochs 5 --batch-parts 1 --json | tee -a "$OUT/gpufeed.jsonl"
step "gpufeed, 4096-B records, batch 512: host, then to the GPU, in turn"
for i in 1 2 3; do
  "$G/bin/gpufeed" bench "$DATA/tokens.npy" --epochs 5 --batch-size 512 --json | tee -a "$OUT/gpufeed.jsonl"
  "$G/bin/gpufeed" bench "$DATA/tokens.npy" --epochs 5 --batch-size 512 --device 0 --json | tee -a "$OUT/gpufeed.jsonl"
done

step "train_loop_cuda: a 10 ms step, 4 epochs, start-up included"
"$G/examples/train_loop_cuda" "$DATA/records.npy" --step-ms 10 --epochs 4 --workers 14 2>&1 | tail -8
echo "== done"
