#!/usr/bin/env bash
# The GPU decode's device run on the H200 machine (kind nvidia-h200: 1 GPU, 16 CPUs), in ONE call of
# at most ~9 minutes: the GPU tests of the decode (GPUFEED_REQUIRE_GPU=1: none may skip), then
# the rest of the GPU tests, then on the issue's folder (12,000 JPEGs of 500x375, quality 90,
# written by torch_baseline.py --jpeg-count 12000): gpufeed's CPU decode against its GPU decode
# with 16 and with 4 workers (RandomResizedCrop(224) + flip, f16 CHW on the GPU, batch 128,
# first epoch and steady), and torchvision's nvJPEG decode (decode_jpeg on device='cuda',
# batches of 128, no crop) as the yardstick, in the same run. Every `bench --json` line keeps
# the stage times (epoch_details: fetch/transform/collate, the copy thread's waits) and the GPU
# decode's own figures (decode_report: library, engines, host and device seconds, which engine
# took how many images, the split).
#
# Stage on the build machine (x86-64, no GPU needed), from the repository's root:
#
#   # The GPU tests (tests/cuda.rs, crates/bench/tests/cuda.rs) with the default CPU decoder,
#   # their reference. gpu-stage writes .git/info/exclude, which a git worktree does not have
#   # (.git is a file there); /.gpu is in .gitignore, so that line can go:
#   CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=symbols \
#   GPU_CARGO_ARGS="-p gpufeed -p gpufeed-bench --test cuda --test bench_cuda --features gpufeed/cuda,gpufeed-bench/cuda" \
#     bash <(sed '/info\/exclude/d' /work/shared/tools/gpu-stage)
#   # The command, with libjpeg-turbo for the CPU decode it is measured against (the issue's
#   # CPU figures are turbojpeg's):
#   CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=symbols \
#     cargo build --release -p gpufeed-cli --features cuda,turbojpeg
#   cp target/release/gpufeed .gpu/bin/
#   cp /work/shared/bench/torch_baseline.py .gpu/
#   # libnvjpeg, if the machine has none (a CUDA 12 build runs on the CUDA 13 driver):
#   mkdir -p .gpu/wheels && pip download -q --no-deps nvidia-nvjpeg-cu12 -d .gpu/wheels
#   du -sh .gpu    # under 60 MiB with the tree
#
# Then the device tool's `run`, kind nvidia-h200, carry [".gpu"], timeout_s 600, command
# `bash crates/bench/scripts/device_gpu_decode.sh`. What comes back under $OUT: run.log (this
# script's output; its last lines are a summary of every figure), tests_decode.log,
# tests_bench.log, tests_other.log, folder.log, bench.jsonl (one `gpufeed bench --json` line
# per run, each with a "case" key added), torch.jsonl (torch_baseline.py's lines and the
# nvJPEG yardstick's).
#   bash crates/bench/scripts/device_gpu_decode.sh bench   # the benches only (no tests)
set -u -o pipefail
MODE=${1:-all}
cd "$(dirname "$0")/../../.."
G=.gpu
OUT=${OUT:-/tmp/gpufeed-out}
DATA=/tmp/gpufeed-decode
JPEGS=$DATA/jpegs
COUNT=${COUNT:-12000}
mkdir -p "$OUT" "$DATA"
export PYTHONUNBUFFERED=1
exec > >(tee "$OUT/run.log") 2>&1
T0=$SECONDS
# The whole call stays under ~9 minutes: a step that would not fit in what is left is skipped
# (and said so), so that what ran still comes back.
BUDGET=530
left() { echo $((BUDGET - (SECONDS - T0))); }
step() { echo; echo "== $(date +%T) (+$((SECONDS - T0)) s) $*"; }
fail=0
note_fail() { echo "FAILED: $*"; fail=1; }
BENCH="$G/bin/gpufeed"
for f in "$BENCH" "$G/tests/cuda" "$G/torch_baseline.py"; do
  [ -e "$f" ] || { echo "missing $f: stage first (see this script's header)"; exit 1; }
done

step "machine"
nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv,noheader
echo "cpus: $(nproc)"
python3 -c 'import sys, torch, torchvision; print("python", sys.version.split()[0], "torch", torch.__version__, "torchvision", torchvision.__version__)' \
  || echo "(no torch/torchvision: the yardstick will be missing)"

step "libnvjpeg"
# gpufeed searches GPUFEED_NVJPEG, the loader's path, the CUDA dirs and the usual Python
# prefixes itself; here the Python that runs torch says where its copies are (a venv that is not
# active is not one of the usual prefixes), and the carried wheel is the last resort.
if [ -z "${GPUFEED_NVJPEG:-}" ]; then
  cat >"$DATA/nvjpeg.py" <<'PY'
import glob, os, site, sys
dirs = []
for s in site.getsitepackages() + [site.getusersitepackages()]:
    dirs += [os.path.join(s, "nvidia", "nvjpeg", "lib"), os.path.join(s, "nvidia", "cu13", "lib"),
             os.path.join(s, "torchvision.libs")]
for d in dirs:
    libs = sorted(glob.glob(os.path.join(d, "libnvjpeg*.so*")))
    if libs:
        print(libs[-1]); break
PY
  found=$(python3 "$DATA/nvjpeg.py" 2>/dev/null)
  if [ -z "$found" ] && ! ldconfig -p 2>/dev/null | grep libnvjpeg >/dev/null \
    && ! ls /usr/local/cuda*/lib64/libnvjpeg*.so* >/dev/null 2>&1; then
    wheel=$(ls "$G"/wheels/nvidia_nvjpeg*.whl 2>/dev/null | head -1)
    if [ -n "$wheel" ]; then
      python3 -m zipfile -e "$wheel" "$DATA/nvjpeg-wheel" && found=$(ls "$DATA"/nvjpeg-wheel/nvidia/nvjpeg/lib/libnvjpeg*.so* | tail -1)
    fi
  fi
  if [ -n "$found" ]; then export GPUFEED_NVJPEG="$found"; fi
fi
echo "GPUFEED_NVJPEG=${GPUFEED_NVJPEG:-unset, the library searches itself}"
ldconfig -p 2>/dev/null | grep libnvjpeg | head -3

step "the folder: $COUNT JPEGs of 500x375 (torch_baseline.py --jpeg-count $COUNT), written in the background"
# One Python thread writes them (about a minute) while the tests run; that run is stopped once
# they are all there (folder.log has its output).
timeout 300 python3 "$G/torch_baseline.py" --only jpeg --jpeg-dir "$JPEGS" --jpeg-count "$COUNT" \
  --workers 1 >"$OUT/folder.log" 2>&1 &
folder_pid=$!

if [ "$MODE" = all ]; then
  step "GPU tests of the decode (GPUFEED_REQUIRE_GPU=1)"
  if GPUFEED_REQUIRE_GPU=1 timeout 200 "$G/tests/cuda" --test-threads=1 cuda_decode >"$OUT/tests_decode.log" 2>&1; then
    echo "ok: $(grep -E 'test result|passed' "$OUT/tests_decode.log" | tail -1)"
  else
    note_fail "GPU decode tests"; tail -40 "$OUT/tests_decode.log"
  fi
  step "the device bench's GPU tests (bench_cuda), then the other GPU tests"
  if [ -e "$G/tests/bench_cuda" ]; then
    if GPUFEED_REQUIRE_GPU=1 timeout 60 "$G/tests/bench_cuda" --test-threads=1 >"$OUT/tests_bench.log" 2>&1; then
      echo "ok: $(grep -E 'test result|passed' "$OUT/tests_bench.log" | tail -1)"
    else
      note_fail "bench_cuda"; tail -30 "$OUT/tests_bench.log"
    fi
  fi
  if GPUFEED_REQUIRE_GPU=1 timeout 120 "$G/tests/cuda" --test-threads=1 --skip cuda_decode >"$OUT/tests_other.log" 2>&1; then
    echo "ok: $(grep -E 'test result|passed' "$OUT/tests_other.log" | tail -1)"
  else
    note_fail "other GPU tests"; tail -30 "$OUT/tests_other.log"
  fi
fi

step "waiting for the folder"
count() { find "$JPEGS" -name '*.jpg' 2>/dev/null | wc -l; }
while [ "$(count)" -lt "$COUNT" ] && kill -0 "$folder_pid" 2>/dev/null; do sleep 2; done
# Written (the last file a few ms after it appears): the rest of that run, a one-worker epoch
# beside nothing that needs it, is not waited for.
sleep 2
kill "$folder_pid" 2>/dev/null
wait "$folder_pid" 2>/dev/null
step "PyTorch DataLoader + torchvision, 16 workers, one epoch (torch_baseline.py)"
timeout 120 python3 "$G/torch_baseline.py" --only jpeg --jpeg-dir "$JPEGS" --jpeg-count "$COUNT" --workers 16 \
  | tee -a "$OUT/torch.jsonl" | grep -E '^\{|^#' || note_fail "torch_baseline.py"
n=$(count)
echo "jpegs: $n"
[ "$n" -ge "$COUNT" ] || { note_fail "the folder has $n JPEGs, not $COUNT"; }

step "yardstick: torchvision.io.decode_jpeg(device='cuda'), batches of 128, every file, 3 passes"
timeout 90 python3 crates/bench/scripts/nvjpeg_yardstick.py "$JPEGS" | tee -a "$OUT/torch.jsonl" \
  || note_fail "nvJPEG yardstick"

# One line per `gpufeed bench --json` report (its stage times stay in bench.jsonl).
cat >"$DATA/line.py" <<'PY'
import json, sys
r = json.loads(sys.stdin.read())
d = r.get("decode_report") or {}
e = [round(x) for x in r.get("epoch_samples_per_sec") or []]
text = "%s: epochs %s img/s, steady %.0f, wait %.3f, skipped %s" % (
    r["case"], e, r.get("steady_samples_per_sec") or 0, r.get("wait_fraction") or 0, r.get("skipped"))
if d:
    text += "; nvJPEG %s hw=%s engines=%s host %.2f s device %.2f s cpu_share %.2f counts %s" % (
        d.get("library"), d.get("hardware"), d.get("hardware_engines"), d.get("host_seconds") or 0,
        d.get("device_seconds") or 0, d.get("cpu_share") or 0, d.get("counts"))
    s = d.get("setup") or {}
    text += "\n    stage setup: library %.3f hardware %.3f gpu %.3f kernels %.3f s (%s)" % tuple(
        [s.get(k) or 0 for k in ("library_seconds", "hardware_seconds", "gpu_seconds",
                                 "kernels_seconds")] + [d.get("kernels")])
first = (r.get("epoch_details") or [None])[0]
if first and d:
    text += ("\n    first epoch %.2f s: consumer waits %.2f s, copy thread enqueues %.2f waits %.2f s"
             % tuple(first.get(k) or 0 for k in ("seconds", "consumer_wait_s",
                                                 "copy_thread_enqueue_s", "copy_thread_host_wait_s")))
last = (r.get("epoch_details") or [None])[-1]
if last:
    text += ("\n    last epoch %.2f s: workers fetch %.2f transform %.2f collate %.2f s; copy thread "
             "waits %.2f enqueues %.2f blocked %.2f s; consumer waits %.2f s") % tuple(
        last.get(k) or 0 for k in ("seconds", "fetch_s", "transform_s", "collate_s",
                                   "copy_thread_host_wait_s", "copy_thread_enqueue_s",
                                   "copy_thread_blocked_s", "consumer_wait_s"))
print(text)
PY
# One `gpufeed bench` run: 4 epochs (the first, then three steady), its JSON line tagged.
bench() {
  local case=$1; shift
  if [ "$(left)" -lt 50 ]; then echo "skipped $case: $(left) s left"; return; fi
  local line
  line=$(timeout 120 "$BENCH" bench --images "$JPEGS" --device 0 --image-dtype f16 --batch-size 128 \
    --epochs 4 --json "$@" 2>"$DATA/err.log" | grep -E '^\{' | tail -1)
  if [ -z "$line" ]; then note_fail "bench $case"; tail -5 "$DATA/err.log"; return; fi
  echo "{\"case\":\"$case\",${line#\{}" | tee -a "$OUT/bench.jsonl" | python3 "$DATA/line.py"
}

step "gpufeed bench: CPU decode against GPU decode, 16 and 4 workers, in turn (2 rounds)"
for round in 1 2; do
  bench "cpu_decode_16w" --workers 16 --decode cpu
  bench "gpu_decode_16w" --workers 16 --decode gpu
  bench "gpu_decode_4w" --workers 4 --decode gpu
  bench "cpu_decode_4w" --workers 4 --decode cpu
done
step "gpufeed bench: the split fixed (every JPEG the GPU can take goes to it), 16 and 4 workers"
bench "gpu_decode_16w_split0" --workers 16 --decode gpu --decode-split 0
bench "gpu_decode_4w_split0" --workers 4 --decode gpu --decode-split 0

step "summary"
python3 - "$OUT/torch.jsonl" "$OUT/bench.jsonl" <<'PY'
import json, os, sys
torch_lines, bench_lines = ([json.loads(l) for l in open(p) if l.startswith("{")] if os.path.exists(p) else []
                            for p in sys.argv[1:])
for r in torch_lines:
    rest = {k: v for k, v in r.items() if k not in ("case", "value", "unit")}
    print("%s: %s %s %s" % (r.get("case"), r.get("value"), r.get("unit"), rest))
for r in bench_lines:
    e = r.get("epoch_samples_per_sec") or [0]
    s = r.get("steady_samples_per_sec") or 0
    print("%s: first epoch %.0f img/s, steady %.0f img/s, first/steady %.2f"
          % (r["case"], e[0], s, e[0] / s if s else 0))
PY
echo "== done in $((SECONDS - T0)) s, failures: $fail"
exit $fail
