#!/usr/bin/env bash
# Autotune against fixed worker counts, and what a trace costs, on the H200 machine
# in one device call (about 8 minutes): every staged Rust GPU test with GPUFEED_REQUIRE_GPU=1,
# then `autotune_sweep.py` over raw 4 KB records (4 and 16 epochs), 150,528-B records, token
# rows (`--tokens`, 100 M uint16 tokens written by numpy, rows of 2,048, global batches of 8)
# and JPEGs decoded on the CPU (torch_baseline.py's 3,000 JPEGs), each setting in turn within a
# round; then the trace on and off, in turn, on records and JPEGs; last, auto on the GPU path.
#
# Stage here, from the repository's root:
#
#   grep -qxF '/.gpu/' .git/info/exclude || echo '/.gpu/' >> .git/info/exclude
#   rm -rf .gpu && mkdir -p .gpu/bin .gpu/tests
#   export CARGO_PROFILE_RELEASE_DEBUG=0
#   cargo build --release -p gpufeed-cli --features cuda,turbojpeg --bin gpufeed
#   cp target/release/gpufeed .gpu/bin/ && strip .gpu/bin/gpufeed
#   cargo test --release -p gpufeed --features cuda --test cuda --no-run --message-format=json \
#     | python3 -c 'import json,sys,shutil; [shutil.copy(m["executable"], ".gpu/tests/cuda") for m in map(json.loads, sys.stdin) if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]=="cuda"]'
#   strip .gpu/tests/cuda
#   cp ../shared/bench/torch_baseline.py .gpu/
#
# Then the device tool's `run`, carry [".gpu"], command `bash
# crates/bench/scripts/device_autotune.sh` (`... sweeps`: without the tests; `... longer`,
# `... abba` and `... memory`: the later calls, see below). Everything lands under $OUT: run.log (this
# script's output), tests_cuda.log, sweep.jsonl (every run's report).
set -u
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/gpufeed-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/run.log") 2>&1
export GPUFEED=.gpu/bin/gpufeed
step() { echo; echo "== $(date +%T) $*"; }
sweep() { timeout "$1" python3 crates/bench/scripts/autotune_sweep.py --jsonl "$OUT/sweep.jsonl" "${@:2}" || echo "(sweep rc=$?)"; }

step "machine"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "cpus: $(nproc)"
JPEGS=/tmp/gpufeed-jpegs
timeout 200 python3 .gpu/torch_baseline.py --only jpeg --jpeg-dir "$JPEGS" --jpeg-count 3000 \
  --workers 1 >"$OUT/folder.log" 2>&1 &
folder=$!
python3 -c '
import numpy as np
np.random.default_rng(0).integers(0, 50257, 100_000_000, dtype=np.uint16).tofile("/tmp/train.bin")
' &
data=$!

# The folder written in the background, whole (3,000 JPEGs), or what there is after a minute.
wait_jpegs() {
  for _ in $(seq 60); do
    [ "$(find "$JPEGS" -name '*.jpg' 2>/dev/null | wc -l)" -ge 3000 ] && break
    sleep 1
  done
  sleep 2; kill $folder 2>/dev/null
  echo "jpegs: $(find "$JPEGS" -name '*.jpg' | wc -l)"
}
gpu_tests() {
  step "Rust GPU tests (GPUFEED_REQUIRE_GPU=1)"
  GPUFEED_REQUIRE_GPU=1 timeout 180 .gpu/tests/cuda >"$OUT/tests_cuda.log" 2>&1
  echo "rc=$?"; grep -E "^test result|FAILED|panicked|failed" "$OUT/tests_cuda.log" | head -20
}

if [ "${1:-}" = memory ]; then
  # The fourth call: the GPU tests three times over (the memory test after it reads
  # the loader's own pools and nvJPEG's blocks are at least 64 KiB), then the memory test alone.
  for i in 1 2 3; do
    GPUFEED_REQUIRE_GPU=1 timeout 120 .gpu/tests/cuda >"$OUT/tests_$i.log" 2>&1
    echo "run $i: rc=$?"; grep -E "^test result|FAILED|after 5 epochs" "$OUT/tests_$i.log" | cut -c1-700
  done
  GPUFEED_REQUIRE_GPU=1 timeout 120 .gpu/tests/cuda device_memory >"$OUT/tests_alone.log" 2>&1
  echo "alone: rc=$?"; grep -E "^test result|FAILED|after 5 epochs" "$OUT/tests_alone.log" | cut -c1-700
  step done
  exit 0
fi
if [ "${1:-}" = abba ]; then
  # The third call: the trace on 150,528-B records in ABBA order (the trace ran
  # second in every round before), and the GPU decode after its timing fix, 4 and 16 workers;
  # the GPU tests first.
  gpu_tests
  step "the trace on 150,528-B records, 8 epochs, ABBA"
  sweep 200 trace-rec150k-abba 8 --abba --settings w16,w16+trace -- --epochs 8 --no-baseline
  wait_jpegs
  step "GPU decode, f16 to the GPU, batch 128, 3 epochs: 4 and 16 workers, two rounds"
  for round in 1 2; do for w in 4 16; do
    timeout 60 $GPUFEED bench --images "$JPEGS" --batch-size 128 --epochs 3 --decode gpu \
      --image-dtype f16 --device 0 --workers $w --json > "$OUT/gpu_decode_r${round}_w$w.json"
    python3 -c 'import json,sys; v=json.load(open(sys.argv[1])); d=v["decode_report"]; print(sys.argv[2], "steady %.0f img/s, epochs %s, cpu_share %.3f, device_seconds %.3f, host_seconds %.3f, counts %s | %s" % (v["steady_samples_per_sec"], [round(x) for x in v["epoch_samples_per_sec"]], d["cpu_share"], d["device_seconds"], d["host_seconds"], d["counts"], v["verdict"]))' "$OUT/gpu_decode_r${round}_w$w.json" "r$round w=$w"
  done; done
  step done
  exit 0
fi
if [ "${1:-}" = longer ]; then
  # The second call: longer runs, over which the measurement's 45 to 120 ms weigh
  # less, the trace on 150,528-B records again, auto on the GPU path, and the GPU decode's
  # copy figures.
  wait $data
  step "token rows, 16 epochs"
  sweep 120 tokens-e16 3 --unit tokens --settings w8,w16,auto -- --tokens /tmp/train.bin --token-dtype u16 --seq-len 2048 --batch-size 8 --epochs 16
  step "raw 4 KB records, 16 epochs, again"
  sweep 100 rec4k-e16b 3 --settings w16,auto -- --records 524288 --record-bytes 4096 --epochs 16 --no-baseline
  step "the trace on 150,528-B records, 8 epochs"
  sweep 100 trace-rec150k-e8 5 --settings w16,w16+trace -- --epochs 8 --no-baseline
  step "to the GPU: 150,528-B records, auto against the default (14 here) and 8"
  sweep 100 device-rec150k 2 --settings w8,default,auto -- --epochs 4 --device 0
  wait_jpegs
  step "GPU decode: what the stage copies (h2d_bytes)"
  timeout 60 $GPUFEED bench --images "$JPEGS" --batch-size 128 --epochs 3 --decode gpu --image-dtype f16 \
    --device 0 --workers 4 --json > "$OUT/gpu_decode.json"; echo "rc=$?"
  python3 -c 'import json,sys; v=json.load(open(sys.argv[1])); print({k: v.get(k) for k in ("steady_samples_per_sec","h2d_bytes_per_sec","h2d_gb","bytes","samples","verdict")}); print(json.dumps(v)[:3000])' "$OUT/gpu_decode.json"
  step done
  exit 0
fi
if [ "${1:-}" != sweeps ]; then
  gpu_tests
fi

step "raw 4 KB records, 4 epochs (runs 26 and 27's workload); the default here is 16"
sweep 100 rec4k-e4 3 --settings w4,w8,w16,auto -- --records 524288 --record-bytes 4096 --epochs 4 --no-baseline
step "raw 4 KB records, 16 epochs"
sweep 100 rec4k-e16 2 --settings w8,w16,auto -- --records 524288 --record-bytes 4096 --epochs 16 --no-baseline
step "150,528-B records (the default records), 4 epochs"
sweep 90 rec150k 3 --settings w4,w8,w16,auto -- --epochs 4 --no-baseline

wait $data
step "token rows: train.bin, seq 2048, global batch 8, 4 epochs"
sweep 90 tokens 3 --unit tokens --settings w2,w4,w8,w16,auto -- --tokens /tmp/train.bin --token-dtype u16 --seq-len 2048 --batch-size 8 --epochs 4

wait_jpegs
step "JPEGs, CPU decode to host batches, RRC 224 + flip, batch 128, 3 epochs"
sweep 90 jpegs 2 --unit bytes --settings w4,w8,w16,auto -- --images "$JPEGS" --batch-size 128 --epochs 3

step "the trace's cost: on and off in turn"
sweep 60 trace-rec4k 4 --settings w16,w16+trace -- --records 524288 --record-bytes 4096 --epochs 8 --no-baseline
sweep 60 trace-rec150k 4 --settings w16,w16+trace -- --epochs 4 --no-baseline
sweep 60 trace-jpegs 3 --unit bytes --settings w16,w16+trace -- --images "$JPEGS" --batch-size 128 --epochs 3

step "to the GPU: 150,528-B records, auto against the default (14 here) and 8"
sweep 60 device-rec150k 2 --settings w8,default,auto -- --epochs 4 --device 0
step done
