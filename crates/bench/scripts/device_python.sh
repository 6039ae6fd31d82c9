#!/usr/bin/env bash
# The Python package's GPU path on the H200 machine, in one device call.
#
#   bash crates/bench/scripts/device_python.sh        # nvidia-h200 (1 GPU, 16 CPUs): tests, benches, training
#   bash crates/bench/scripts/device_python.sh ddp    # nvidia-h200-x2 (2 GPUs, 32 CPUs): the 2-GPU part
#
# One GPU (about 6 minutes): installs the carried wheel; the Python tests with
# GPUFEED_REQUIRE_GPU=1 (test_device.py must not skip) and the staged Rust GPU tests, if any;
# the JPEG folder of torch_baseline.py (3,000 JPEGs of 500x375, with PyTorch's one-epoch JPEG
# figure); crates/bench/scripts/python_loader.py --device 0 --torch on 150,528-B records, 4,096-B token rows
# and the JPEGs (RandomResizedCrop(224) + flip, normalised bf16 on the GPU): `gpufeed bench
# --device 0`, the Python path and PyTorch's DataLoader on the same files in the same run;
# crates/bench/scripts/train_resnet50.py, 200 steps fed by gpufeed, then by PyTorch.
# Two GPUs (about 5 minutes): the wheel, the JPEGs, the 2-GPU Python test, the one-GPU training
# run on this machine (the reference for per-rank images/s), then torchrun --nproc-per-node 2
# crates/bench/scripts/train_resnet50_ddp.py (200 steps per feed, checks: same batches, disjoint samples,
# final barrier).
#
# Stage here (the build machine, x86-64, no GPU needed), from the repository's root:
#
#   grep -qxF '/.gpu/' .git/info/exclude || echo '/.gpu/' >> .git/info/exclude
#   rm -rf .gpu && mkdir -p .gpu/bin .gpu/tests .gpu/wheels
#   # The command (for `gpufeed bench --device 0`), with the same JPEG decoder as the wheel:
#   CARGO_PROFILE_RELEASE_DEBUG=0 cargo build --release --features cuda,turbojpeg --bin gpufeed
#   cp target/release/gpufeed .gpu/bin/ && strip .gpu/bin/gpufeed
#   # The wheel: one abi3 wheel (CPython >= 3.9, so 3.12 there loads it); the package's `cuda`
#   # feature is a default (cudarc loads the driver at run time: no toolkit needed to build):
#   (cd python && maturin build --release --features turbojpeg -o ../.gpu/wheels)
#   # (or: pip wheel ./python --no-deps -w .gpu/wheels --config-settings=build-args="--features turbojpeg")
#   # Optional, the Rust GPU tests of the device path (run with --test-threads=1 there):
#   CARGO_PROFILE_RELEASE_DEBUG=0 cargo test --release -p gpufeed --features cuda --test cuda \
#     --no-run --message-format=json \
#     | python3 -c 'import json,sys,shutil; [shutil.copy(m["executable"], ".gpu/tests/cuda") for m in map(json.loads, sys.stdin) if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]=="cuda"]'
#   strip .gpu/tests/*
#   cp ../shared/bench/torch_baseline.py .gpu/
#   du -sh .gpu    # well under 64 MiB with the tree
#
# Then the device tool's `run`, carry [".gpu"], command `bash crates/bench/scripts/device_python.sh` (kind
# nvidia-h200), and for the 2-GPU part `bash crates/bench/scripts/device_python.sh ddp` (kind nvidia-h200-x2).
# What comes back under $OUT (at most 8 files): run.log (this script's output), pytest.log,
# rust_tests.log, torch_baseline.jsonl, python_loader.jsonl, train_resnet50.json; in ddp mode
# run.log, pytest_2gpu.log, train_resnet50_1gpu.json, train_resnet50_ddp.json. The last lines
# of run.log are a summary of every figure.
set -u
MODE=${1:-one}
cd "$(dirname "$0")/../../.."
G=.gpu
OUT=${OUT:-/tmp/gpufeed-out}
DATA=/tmp/gpufeed-data
mkdir -p "$OUT" "$DATA"
export PYTHONUNBUFFERED=1
exec > >(tee "$OUT/run.log") 2>&1
step() { echo; echo "== $(date +%T) $*"; }
fail=0
note_fail() { echo "FAILED: $*"; fail=1; }

step "machine"
nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv,noheader
echo "cpus: $(nproc)"

step "install the wheel"
WHEEL=$(ls "$G"/wheels/gpufeed-*.whl 2>/dev/null | head -1)
if [ -z "$WHEEL" ]; then echo "no wheel in $G/wheels: stage it first (see the header)"; exit 1; fi
python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/site "$WHEEL" || exit 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -c 'import sys, gpufeed, torch; print("python", sys.version.split()[0], "gpufeed", gpufeed.__version__, "cuda build", gpufeed._gpufeed.HAS_CUDA, "torch", torch.__version__, "gpus", torch.cuda.device_count())' || exit 1
BENCH="$G/bin/gpufeed"

jpegs() {
  step "the JPEG folder (torch_baseline.py --jpeg-dir), with PyTorch's one-epoch JPEG figure"
  timeout 240 python3 "$G/torch_baseline.py" --only jpeg --jpeg-dir "$DATA/jpegs" --workers 16 \
    | tee -a "$OUT/torch_baseline.jsonl" | grep -E '^\{|^#' || note_fail "torch_baseline.py"
  echo "jpegs: $(find "$DATA/jpegs" -name '*.jpg' | wc -l)"
}

if [ "$MODE" = ddp ]; then
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
  jpegs
  step "the 2-GPU Python test (GPUFEED_REQUIRE_GPU=1)"
  GPUFEED_REQUIRE_GPU=1 timeout 120 python3 -m pytest python/tests/test_device.py -q -p no:cacheprovider \
    -k "two_gpus or bytes" >"$OUT/pytest_2gpu.log" 2>&1 || note_fail "pytest (2 GPUs)"
  tail -3 "$OUT/pytest_2gpu.log"
  step "ResNet-50 on one GPU of this machine (the reference for per-rank images/s)"
  timeout 240 python3 crates/bench/scripts/train_resnet50.py --data "$DATA/jpegs" --steps 200 --workers 16 \
    --out "$OUT/train_resnet50_1gpu.json" >/dev/null || note_fail "train_resnet50.py"
  step "ResNet-50, DDP on 2 GPUs (torchrun --nproc-per-node 2)"
  timeout 330 python3 -m torch.distributed.run --nproc-per-node 2 crates/bench/scripts/train_resnet50_ddp.py --data "$DATA/jpegs" \
    --steps 200 --workers 16 --out "$OUT/train_resnet50_ddp.json" >/dev/null \
    || note_fail "train_resnet50_ddp.py (exit status $?: 124 is a timeout, a hang)"
else
  step "Python tests (GPUFEED_REQUIRE_GPU=1: the GPU tests must not skip)"
  GPUFEED_REQUIRE_GPU=1 timeout 240 python3 -m pytest python/tests -q -p no:cacheprovider -rs \
    >"$OUT/pytest.log" 2>&1 || note_fail "pytest"
  grep -E "passed|failed|SKIPPED|Error" "$OUT/pytest.log" | tail -8
  # GPUFEED_SKIP_RUST_TESTS=1: the staged Rust tests ran already in this machine's session
  # (crates/bench/scripts/device_first_epoch.sh runs them all).
  if [ "${GPUFEED_SKIP_RUST_TESTS:-0}" != 1 ] && ls "$G"/tests/*cuda* >/dev/null 2>&1; then
    step "Rust GPU tests (staged, GPUFEED_REQUIRE_GPU=1, --test-threads=1)"
    : >"$OUT/rust_tests.log"
    for t in "$G"/tests/*cuda*; do
      if GPUFEED_REQUIRE_GPU=1 timeout 120 "$t" -q --test-threads=1 >>"$OUT/rust_tests.log" 2>&1; then
        echo "ok   $(basename "$t"): $(grep 'test result' "$OUT/rust_tests.log" | tail -1)"
      else
        note_fail "$(basename "$t")"; tail -20 "$OUT/rust_tests.log"
      fi
    done
  fi
  jpegs
  common=(--gpufeed "$BENCH" --device 0 --torch --jsonl --workers 16)
  step "records of 150,528 B (16,384, batch 256): gpufeed bench, Python, PyTorch"
  timeout 150 python3 crates/bench/scripts/python_loader.py "${common[@]}" --npy "$DATA/records.npy" \
    --records 16384 --record-bytes 150528 --batch-size 256 --epochs 10 --rounds 3 \
    >>"$OUT/python_loader.jsonl" || note_fail "python_loader.py (records)"
  rm -f "$DATA/records.npy"
  step "token rows of 4,096 B (524,288, batch 512): gpufeed bench, Python, PyTorch"
  timeout 150 python3 crates/bench/scripts/python_loader.py "${common[@]}" --npy "$DATA/tokens.npy" \
    --records 524288 --record-bytes 4096 --batch-size 512 --epochs 10 --rounds 3 \
    >>"$OUT/python_loader.jsonl" || note_fail "python_loader.py (tokens)"
  rm -f "$DATA/tokens.npy"
  step "JPEGs, RandomResizedCrop(224) + flip to normalised bf16 on the GPU (batch 256)"
  timeout 150 python3 crates/bench/scripts/python_loader.py "${common[@]}" --images "$DATA/jpegs" \
    --image-dtype bf16 --batch-size 256 --epochs 6 --rounds 2 \
    >>"$OUT/python_loader.jsonl" || note_fail "python_loader.py (JPEGs)"
  step "ResNet-50, AMP bf16, channels_last, 200 steps: gpufeed, then PyTorch"
  timeout 240 python3 crates/bench/scripts/train_resnet50.py --data "$DATA/jpegs" --steps 200 --workers 16 \
    --out "$OUT/train_resnet50.json" >/dev/null || note_fail "train_resnet50.py"
fi

step "summary"
python3 - "$OUT" <<'PY'
import glob, json, os, sys

out = sys.argv[1]

def rows(path):
    try:
        with open(path) as f:
            return [json.loads(l) for l in f if l.strip().startswith("{")]
    except OSError:
        return []

def g(x, unit):
    if x is None:
        return "-"
    return f"{x / 1e9:.2f} GB/s" if unit == "bytes/s" else f"{x:,.0f} img/s"

for r in rows(os.path.join(out, "torch_baseline.jsonl")):
    print(f"torch_baseline {r['case']}: {r['value']} {r['unit']} ({r.get('workers')} workers)")
for r in rows(os.path.join(out, "python_loader.jsonl")):
    u = r["unit"]
    pt = r.get("pytorch", {})
    print(f"{r['case']}: gpufeed bench {g(r['bench_steady_best'], u)}, Python {g(r['python_steady_best'], u)}"
          f" (Python/bench per round {[round(x, 3) for x in r['python_over_bench_per_round']]},"
          f" median {r['python_over_bench_median']:.3f}); PyTorch {g(pt.get('steady_rate'), u)}"
          f" ({pt.get('best_case')}): Python/PyTorch {r.get('python_over_pytorch', 0):.1f}x")
for name in ("train_resnet50.json", "train_resnet50_1gpu.json"):
    for r in rows(os.path.join(out, name)):
        for feed, run in r["runs"].items():
            if "error" in run:
                print(f"{name} {feed}: {run['error']}")
                continue
            print(f"{name} {feed}: {run['images_per_s']:,.0f} img/s, GPU waited {100 * run['gpu_wait_fraction']:.1f}%"
                  f" ({run['gpu_wait_ms_per_step']:.2f} ms/step, compute {run['gpu_compute_ms_per_step']:.1f} ms/step),"
                  f" host data time {100 * run['host_data_time_fraction']:.1f}%, loss {run['loss_first']:.2f} -> {run['loss_last']:.2f},"
                  f" {run['epochs_started']} epochs")
for r in rows(os.path.join(out, "train_resnet50_ddp.json")):
    for feed, run in r["runs"].items():
        c = run["checks"]
        waits = [round(100 * x["gpu_wait_fraction"], 1) for x in run["per_rank"]]
        print(f"ddp {feed}: per rank {[round(x) for x in run['images_per_s_per_rank']]} img/s, GPU waited {waits}%;"
              f" same batches {c['same_batches']}, disjoint {c['disjoint']} ({c.get('samples_checked')} samples),"
              f" epochs {c['epochs_seen']}, final barrier {c['final_barrier']}")
PY
echo
if [ "$fail" = 0 ]; then echo "== done: every step passed"; else echo "== done, with failures (see above)"; fi
exit $fail
