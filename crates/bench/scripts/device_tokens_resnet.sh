#!/usr/bin/env bash
# Token batches on the GPU and ResNet-50 fed by the GPU decode, in one
# device call on the H200 machine (about 6 minutes): every staged Rust GPU test with
# GPUFEED_REQUIRE_GPU=1, the Python GPU and token tests with the carried wheel, then `gpufeed
# bench --tokens` to the host and to the GPU side by side (a 100 M-token uint16 train.bin
# written by numpy, rows of 8,192, global batches of 8: 4 and 16 workers, two rounds in turn;
# then packed rows of a Megatron-layout set of random documents); last, train_resnet50.py
# (gpufeed's feed only) on torch_baseline.py's 3,000 JPEGs: GPU decode with 4 workers, then CPU
# decode with 16.
#
# Stage here, from the repository's root:
#
#   grep -qxF '/.gpu/' .git/info/exclude || echo '/.gpu/' >> .git/info/exclude
#   rm -rf .gpu && mkdir -p .gpu/bin .gpu/tests .gpu/wheels
#   export CARGO_PROFILE_RELEASE_DEBUG=0
#   cargo build --release -p gpufeed-cli --features cuda --bin gpufeed
#   cp target/release/gpufeed .gpu/bin/ && strip .gpu/bin/gpufeed
#   cargo test --release -p gpufeed --features cuda --test cuda --no-run --message-format=json \
#     | python3 -c 'import json,sys,shutil; [shutil.copy(m["executable"], ".gpu/tests/cuda") for m in map(json.loads, sys.stdin) if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]=="cuda"]'
#   strip .gpu/tests/cuda
#   target/python-venv/bin/maturin build --release -m python/Cargo.toml -o .gpu/wheels
#   cp ../shared/bench/torch_baseline.py .gpu/
#
# Then the device tool's `run`, carry [".gpu"], command
# `bash crates/bench/scripts/device_tokens_resnet.sh` (`... again`: a second call,
# the Python GPU tests, 16-worker token benches with global batches of 8 and 32, and the
# GPU-decode training run again). Everything lands under $OUT: run.log
# (this script's output), tests_cuda.log, pytest.log, tokens.jsonl, resnet_gpu4.json,
# resnet_cpu16.json.
set -u
cd "$(dirname "$0")/../../.."
PART=${1:-all}
OUT=${OUT:-/tmp/gpufeed-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/run.log") 2>&1
G=.gpu/bin/gpufeed
step() { echo; echo "== $(date +%T) $*"; }

step "machine"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "cpus: $(nproc)"
JPEGS=/tmp/gpufeed-jpegs
timeout 200 python3 .gpu/torch_baseline.py --only jpeg --jpeg-dir "$JPEGS" --jpeg-count 3000 \
  --workers 1 >"$OUT/folder.log" 2>&1 &
folder=$!
python3 - <<'PY' &
import numpy as np
rng = np.random.default_rng(0)
rng.integers(0, 50257, 100_000_000, dtype=np.uint16).tofile("/tmp/train.bin")
# Megatron's layout (MMIDIDX v1, uint16): 60,000 documents of 1 to 2,000 tokens.
lengths = rng.integers(1, 2001, 60_000).astype("<i4")
pointers = np.zeros(len(lengths), "<i8"); pointers[1:] = np.cumsum(lengths[:-1].astype(np.int64) * 2)
import struct
head = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(lengths), len(lengths) + 1)
open("/tmp/docs.idx", "wb").write(head + lengths.tobytes() + pointers.tobytes() + np.arange(len(lengths) + 1, dtype="<i8").tobytes())
rng.integers(0, 50257, int(lengths.sum()), dtype=np.uint16).tofile("/tmp/docs.bin")
PY
data=$!

if [ "$PART" = all ]; then
  step "Rust GPU tests (GPUFEED_REQUIRE_GPU=1)"
  GPUFEED_REQUIRE_GPU=1 timeout 180 .gpu/tests/cuda >"$OUT/tests_cuda.log" 2>&1
  echo "rc=$?"; grep -E "^test result|FAILED|panicked|failed" "$OUT/tests_cuda.log" | head -20
fi

step "Python GPU and token tests (GPUFEED_REQUIRE_GPU=1)"
WHEEL=$(ls .gpu/wheels/gpufeed-*.whl | head -1)
python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/site "$WHEEL"
export PYTHONPATH=/tmp/site
GPUFEED_REQUIRE_GPU=1 timeout 240 python3 -m pytest python/tests/test_device.py python/tests/test_tokens.py \
  -q -p no:cacheprovider >"$OUT/pytest.log" 2>&1
echo "rc=$?"; tail -4 "$OUT/pytest.log"

wait $data
summ() { python3 -c '
import json, sys
for l in sys.stdin:
    l = l.strip()
    if not l.startswith("{"): continue
    v = json.loads(l); d = v.get("device") or {}
    print(sys.argv[1], "| %.3f G tokens/s steady, %.3f G/s all | first batch %.1f ms | CPU %.4f s per M tokens | padding %.4f | %s %.2f B/token copied" % (
        v["steady_tokens_per_s"] / 1e9, v["tokens_per_s"] / 1e9, v["first_batch_ms"] or 0,
        v["cpu_seconds_per_million_tokens"], v["padding_fraction"], d.get("device", "host"), d.get("h2d_bytes_per_token", 0)))
    print(l, file=open(sys.argv[2], "a"))
' "$1" "$OUT/tokens.jsonl"; }

if [ "$PART" = again ]; then
  step "gpufeed bench --tokens: train.bin, seq 8192, 16 workers, global batches of 8 and 32, host vs GPU"
  for round in 1 2; do for b in 8 32; do
    $G bench --tokens /tmp/train.bin --token-dtype u16 --seq-len 8192 --batch-size $b --epochs 3 \
      --workers 16 --json | summ "flat host   r$round b=$b"
    $G bench --tokens /tmp/train.bin --token-dtype u16 --seq-len 8192 --batch-size $b --epochs 3 \
      --workers 16 --device 0 --json | summ "flat device r$round b=$b"
  done; done
else
step "gpufeed bench --tokens: train.bin (100 M uint16 tokens), seq 8192, global batch 8, host vs GPU"
for round in 1 2; do for w in 4 16; do
  $G bench --tokens /tmp/train.bin --token-dtype u16 --seq-len 8192 --batch-size 8 --epochs 3 \
    --workers $w --json | summ "flat host   r$round w=$w"
  $G bench --tokens /tmp/train.bin --token-dtype u16 --seq-len 8192 --batch-size 8 --epochs 3 \
    --workers $w --device 0 --json | summ "flat device r$round w=$w"
done; done

step "packed rows of 60,000 documents (Megatron layout), seq 8192, global batch 8, 4 workers"
for round in 1 2; do
  $G bench --tokens /tmp/docs --token-mode packed --seq-len 8192 --batch-size 8 --epochs 3 \
    --workers 4 --json | summ "packed host   r$round w=4"
  $G bench --tokens /tmp/docs --token-mode packed --seq-len 8192 --batch-size 8 --epochs 3 \
    --workers 4 --device 0 --json | summ "packed device r$round w=4"
done
fi

step "ResNet-50 (gpufeed's feed, 150 steps): GPU decode, 4 workers; CPU decode, 16 workers"
for _ in $(seq 120); do
  [ "$(find "$JPEGS" -name '*.jpg' 2>/dev/null | wc -l)" -ge 3000 ] && break
  sleep 1
done
sleep 2; kill $folder 2>/dev/null
echo "jpegs: $(find "$JPEGS" -name '*.jpg' | wc -l)"
runs=("gpu 4" "cpu 16")
[ "$PART" = again ] && runs=("gpu 4" "gpu 6")
for run in "${runs[@]}"; do
  set -- $run
  timeout 150 python3 crates/bench/scripts/train_resnet50.py --data "$JPEGS" --feed gpufeed \
    --steps 150 --decode "$1" --workers "$2" --out "$OUT/resnet_$1$2.json" >/dev/null 2>"$OUT/resnet_$1$2.err"
  echo "decode $1, $2 workers: rc=$?"
  python3 -c 'import json,sys; v=json.load(open(sys.argv[1])); print(json.dumps(v)[:1500])' "$OUT/resnet_$1$2.json" 2>/dev/null || tail -5 "$OUT/resnet_$1$2.err"
done
step done
