#!/usr/bin/env bash
# A candle training binary fed by gpufeed, and the GPU decode beside it, on the H200 machine
# (kind nvidia-h200), in one call of about 9 minutes:
#
#   1. every staged GPU test with GPUFEED_REQUIRE_GPU=1, candle's among them (tests/cuda.rs
#      built with `cuda,candle-cuda`);
#   2. what handing a batch to candle costs (examples/candle_handoff.rs);
#   3. examples/candle_train.rs on 10,000 synthetic JPEGs of 10 classes (written by the
#      example): gpufeed's feed with 16 workers decoding on the CPU and with 4 workers and the
#      GPU decode, then the loop a candle user writes (rayon over 16 threads, and one thread);
#      images/s, the share of step time waiting for data, the loss by epoch, the resume check;
#   4. nvJPEG's set-up, probed with ctypes (crates/bench/scripts/nvjpeg_setup_probe.py);
#   5. `gpufeed bench` on the issue's 12,000 JPEGs (torch_baseline.py --jpeg-count 12000),
#      GPU decode with 16 and 4 workers, the build before this change (`gpufeed-before`, if
#      staged) and after in turn, CPU decode with 16 beside them, and torchvision's nvJPEG
#      decode as the yardstick.
#
# Stage here, from the repository's root (about 20 minutes on 2 cores; the CUDA toolkit comes
# from PyPI's wheels, see ci/cuda-toolkit):
#
#   eval "$(ci/cuda-toolkit --link)"
#   export CARGO_PROFILE_RELEASE_DEBUG=0
#   cargo build --release --features candle-cuda --example candle_train --example candle_handoff
#   cargo test --release --features cuda,candle-cuda --test cuda --no-run   # its path: see below
#   cargo build --release -p gpufeed-cli --features cuda,turbojpeg
#   mkdir -p .gpu/bin .gpu/tests && cp target/release/examples/candle_{train,handoff} .gpu/bin/
#   cp target/release/gpufeed .gpu/bin/ && cp target/release/deps/cuda-<hash> .gpu/tests/cuda
#   strip .gpu/bin/* .gpu/tests/*; cp ../shared/bench/torch_baseline.py .gpu/
#   (cd .gpu && tar cJf candle.tar.xz bin/candle_train bin/candle_handoff tests/cuda \
#      && rm bin/candle_train bin/candle_handoff tests/cuda)    # PTX compresses tenfold
#
#   # For the tch part: examples/tch built against PyTorch 2.11's wheel (docs/FRAMEWORKS.md), as
#   # .gpu/bin/tch-handoff.
#   # For the ResNet-50 part: the Python package's wheel, built from this tree and from the
#   # commit before (`git worktree add /tmp/before <commit>`), in .gpu/wheels/{after,before}/:
#   maturin build --profile wheel -m python/Cargo.toml -o .gpu/wheels/after
#
# Then the device tool's `run`, carry [".gpu"], command
# `bash crates/bench/scripts/device_candle.sh [PARTS]`, PARTS a comma-separated list of tests,
# handoff, tch, probe, train, yardstick, bench, resnet (default: all but tch and resnet); ROUNDS=N
# runs the bench's cases N times in turn (default 2). Under $OUT:
# run.log (this output) and logs.tgz (tests.log, handoff.json, probe.jsonl, bench.jsonl,
# train.jsonl, resnet.jsonl and each run's own log).
set -u -o pipefail
PARTS=",${1:-tests,handoff,probe,train,yardstick,bench},"
want() { [[ $PARTS == *",$1,"* ]]; }
cd "$(dirname "$0")/../../.."
G=.gpu
OUT=${OUT:-/tmp/gpufeed-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
exec > >(tee "$OUT/run.log") 2>&1
T0=$SECONDS
BUDGET=${BUDGET:-540}
left() { echo $((BUDGET - (SECONDS - T0))); }
step() { echo; echo "== $(date +%T) (+$((SECONDS - T0)) s) $*"; }
fail=0
note_fail() { echo "FAILED: $*"; fail=1; }

step "machine"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
echo "cpus: $(nproc)"
[ -e $G/candle.tar.xz ] && (cd $G && tar xJf candle.tar.xz)
# What candle links (cuBLAS, cuBLASLt, cuRAND, NVRTC, cudart of CUDA 13): PyTorch's cu130 wheels.
libs=$(python3 - <<'PY'
import glob, os, site
dirs = set()
for s in site.getsitepackages():
    for lib in glob.glob(os.path.join(s, "nvidia", "**", "lib*.so*"), recursive=True):
        dirs.add(os.path.dirname(lib))
print(":".join(sorted(dirs)))
PY
)
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ldd $G/bin/candle_train | grep -E "cublas|curand|nvrtc|cudart|cuda\.so|not found"

JPEGS=/tmp/gpufeed-jpegs12k
folder=
if want yardstick || want bench || want resnet; then
  timeout 300 python3 $G/torch_baseline.py --only jpeg --jpeg-dir "$JPEGS" --jpeg-count 12000 \
    --workers 1 >"$OUT/folder.log" 2>&1 &
  folder=$!
fi

if want tests; then
  step "GPU tests (GPUFEED_REQUIRE_GPU=1), candle's among them"
  GPUFEED_REQUIRE_GPU=1 timeout 240 $G/tests/cuda --test-threads=1 >"$OUT/tests.log" 2>&1
  rc=$?
  grep -E "^test result|FAILED|panicked" "$OUT/tests.log" | head -20
  [ $rc = 0 ] || note_fail "GPU tests (rc $rc)"
fi

if want handoff; then
  step "the hand-off's cost (candle_handoff)"
  timeout 60 $G/bin/candle_handoff --batch 128 --batches 200 | tee "$OUT/handoff.log" || note_fail candle_handoff
  timeout 60 $G/bin/candle_handoff --batch 128 --batches 200 --keep-pool | tee -a "$OUT/handoff.log" || note_fail candle_handoff
  grep '^{' "$OUT/handoff.log" > "$OUT/handoff.json"
fi

if want tch; then
  step "tch-rs: the zero-copy hand-off of docs/FRAMEWORKS.md (examples/tch, against the machine's libtorch)"
  torchlib=$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
  LD_LIBRARY_PATH="$torchlib:$LD_LIBRARY_PATH" timeout 120 $G/bin/tch-handoff 2>&1 | tee "$OUT/tch.log"
  [ "${PIPESTATUS[0]}" = 0 ] || note_fail "tch hand-off"
fi

if want probe; then
  step "nvJPEG's set-up (probe)"
  timeout 60 python3 crates/bench/scripts/nvjpeg_setup_probe.py "" | tee "$OUT/probe.jsonl" || note_fail probe
fi

want train && step "candle_train: 10,000 JPEGs, gpufeed's feed against the candle user's loop"
DATA=/tmp/candle-data
train() {
  local name=$1; shift
  if [ "$(left)" -lt 40 ]; then echo "skipped $name: $(left) s left"; return; fi
  timeout 150 $G/bin/candle_train "$DATA" --make-data 1000 --json "$@" >"$OUT/train_$name.log" 2>&1
  local rc=$?
  grep -vE '^\{' "$OUT/train_$name.log" | sed "s/^/[$name] /"
  grep -E '^\{' "$OUT/train_$name.log" | sed "s/^{/{\"case\":\"$name\",/" >>"$OUT/train.jsonl"
  [ $rc = 0 ] || note_fail "candle_train $name (rc $rc)"
}
if want train; then
  train gpufeed_cpu16 --feed gpufeed --workers 16 --decode cpu --epochs 5
  train gpufeed_gpu4 --feed gpufeed --workers 4 --decode gpu --epochs 5
  train candle_rayon16 --feed candle --workers 16 --epochs 2 --steps 25
  train candle_seq --feed candle-seq --epochs 2 --steps 3
fi

if [ -n "$folder" ]; then
  step "waiting for the 12,000 JPEGs"
  for _ in $(seq 150); do
    [ "$(find "$JPEGS" -name '*.jpg' 2>/dev/null | wc -l)" -ge 12000 ] && break
    sleep 1
  done
  sleep 2; kill $folder 2>/dev/null; wait $folder 2>/dev/null
  echo "jpegs: $(find "$JPEGS" -name '*.jpg' | wc -l)"
fi

if want yardstick; then
  step "torchvision's nvJPEG decode (the yardstick): its first call, then three passes"
  timeout 90 python3 crates/bench/scripts/nvjpeg_yardstick.py "$JPEGS" | tee -a "$OUT/torch.jsonl" \
    || note_fail "yardstick"
fi

want bench && step "gpufeed bench on 12,000 JPEGs: GPU decode before and after, CPU decode"
bench() {
  local case=$1 bin=$2; shift 2
  [ -x "$bin" ] || { echo "skipped $case: no $bin"; return; }
  if [ "$(left)" -lt 25 ]; then echo "skipped $case: $(left) s left"; return; fi
  local line
  line=$(timeout 60 "$bin" bench --images "$JPEGS" --device 0 --image-dtype f16 --batch-size 128 \
    --epochs 4 --json "$@" 2>"$OUT/bench_err.log" | grep -E '^\{' | tail -1)
  if [ -z "$line" ]; then note_fail "bench $case"; tail -3 "$OUT/bench_err.log"; return; fi
  echo "{\"case\":\"$case\",${line#\{}" >>"$OUT/bench.jsonl"
  python3 -c '
import json, sys
r = json.loads(sys.argv[1]); e = [round(x) for x in r.get("epoch_samples_per_sec") or []]
d = r.get("decode_report") or {}; s = d.get("setup") or {}
print("%s: epochs %s img/s, steady %.0f, first/steady %.2f; hardware %.2f s, gpu backend %.2f s, decoders taken after %.2f s and %d batches, cpu_share %.2f, counts %s" % (
  sys.argv[2], e, r.get("steady_samples_per_sec") or 0, (e[0] / r["steady_samples_per_sec"]) if e and r.get("steady_samples_per_sec") else 0,
  s.get("hardware_seconds") or 0, s.get("gpu_seconds") or 0, s.get("ready_seconds") or 0, s.get("batches_before_ready") or 0,
  d.get("cpu_share") or 0, d.get("counts")))
' "{\"case\":\"$case\",${line#\{}" "$case"
}
want bench && for round in $(seq "${ROUNDS:-2}"); do
  bench "after_gpu16_r$round" $G/bin/gpufeed --workers 16 --decode gpu
  bench "before_gpu16_r$round" $G/bin/gpufeed-before --workers 16 --decode gpu
  bench "after_gpu4_r$round" $G/bin/gpufeed --workers 4 --decode gpu
  bench "before_gpu4_r$round" $G/bin/gpufeed-before --workers 4 --decode gpu
  bench "after_cpu16_r$round" $G/bin/gpufeed --workers 16 --decode cpu
done

if want resnet; then
  step "ResNet-50 (train_resnet50.py, gpufeed's feed, 150 steps): GPU decode with 4 workers, the wheel before this change and after, in turn; CPU decode with 16"
  for w in after before; do
    whl=$(ls $G/wheels/$w/gpufeed-*.whl 2>/dev/null | head -1)
    [ -n "$whl" ] && python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/site-$w "$whl"
  done
  resnet() {
    local case=$1 site=$2; shift 2
    [ -d "$site" ] || { echo "skipped $case: no $site"; return; }
    if [ "$(left)" -lt 45 ]; then echo "skipped $case: $(left) s left"; return; fi
    PYTHONPATH=$site timeout 120 python3 crates/bench/scripts/train_resnet50.py --data "$JPEGS" \
      --feed gpufeed --steps 150 --out "$OUT/resnet_$case.json" "$@" >/dev/null 2>"$OUT/resnet_err.log"
    local rc=$?
    [ $rc = 0 ] || { note_fail "resnet $case (rc $rc)"; tail -3 "$OUT/resnet_err.log"; return; }
    python3 -c '
import json, sys
v = json.load(open(sys.argv[1]))
keys = ("images_per_s", "gpu_wait_fraction", "gpu_wait_ms_max", "first_step_s", "whole_run_images_per_s")
print(sys.argv[2], {k: round(v[k], 4) if isinstance(v.get(k), float) else v.get(k) for k in keys})
print(json.dumps(dict(v, case=sys.argv[2])), file=open(sys.argv[3], "a"))
' "$OUT/resnet_$case.json" "$case" "$OUT/resnet.jsonl"
  }
  for round in 1 2; do
    resnet "after_gpu4_r$round" /tmp/site-after --decode gpu --workers 4
    resnet "before_gpu4_r$round" /tmp/site-before --decode gpu --workers 4
  done
  resnet "after_cpu16" /tmp/site-after --decode cpu --workers 16
fi

step "summary"
cat "$OUT/train.jsonl" 2>/dev/null
echo "== done in $((SECONDS - T0)) s, failures: $fail"
# At most 8 files come back: every log but this one in one archive.
(cd "$OUT" && tar czf /tmp/gpufeed-logs.tgz --exclude run.log . \
  && find . -maxdepth 1 -type f ! -name run.log -delete && mv /tmp/gpufeed-logs.tgz logs.tgz)
exit $fail
