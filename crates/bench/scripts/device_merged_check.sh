#!/usr/bin/env bash
# One device call after the merges of 2026-12-01 (ragged fields, GPU decode, token streams,
# trace/autotune): every staged GPU test with GPUFEED_REQUIRE_GPU=1, the device bench with a
# trace and a plot, then autotune against fixed worker counts on raw records, token rows and
# JPEGs (host path), two rounds in turn. Staged with gpu-stage (`--test cuda --features cuda`)
# plus `gpufeed` built with `--features cuda`; .gpu/torch_baseline.py writes the JPEG folder.
# Everything lands under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/gpufeed-out}
mkdir -p "$OUT"
G=.gpu/bin/gpufeed
log() { echo; echo "== $(date +%T) $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
nproc
# torch_baseline.py writes the folder first, then measures PyTorch: stopped once it is written.
D=/tmp/gpufeed-baseline/jpegs
timeout 300 python3 .gpu/torch_baseline.py --only jpeg --jpeg-dir "$D" --jpeg-count 12000 \
  --workers 1 >"$OUT/folder.log" 2>&1 &
folder=$!
python3 -c "import numpy as np; np.random.default_rng(0).integers(0, 50000, 100_000_000, dtype=np.uint16).tofile('/tmp/train.bin')"

log "GPU tests (GPUFEED_REQUIRE_GPU=1)"
GPUFEED_REQUIRE_GPU=1 .gpu/tests/cuda >"$OUT/tests_cuda.log" 2>&1
echo "rc=$?"; grep -E "^test result|FAILED|panicked" "$OUT/tests_cuda.log" | head -20

log "device bench with --trace and --plot"
$G bench --device 0 --epochs 3 --trace "$OUT/trace.json" --plot "$OUT/plot.svg" | tail -6

summ() { python3 -c '
import json,sys
for l in sys.stdin:
    l=l.strip()
    if not l.startswith("{"): continue
    v=json.loads(l); t=v.get("tuning") or {}
    r=v.get("steady_bytes_per_sec") or v.get("steady_images_per_sec") or v.get("steady_tokens_per_sec") or v.get("tokens_per_sec")
    print(sys.argv[1], "workers", v.get("workers"), "steady", r, "|", (t.get("reason") or "")[:160])
' "$1"; }
log "autotune against fixed workers: raw records 4 KB, host"
for round in 1 2; do for w in 4 8 12 16 auto; do
  $G bench --records 524288 --record-bytes 4096 --epochs 4 --workers $w --no-baseline --json | summ "records r$round w=$w"
done; done
log "token rows (uint16 train.bin, seq 2048, batch 8)"
for round in 1 2; do for w in 2 4 8 16 auto; do
  $G bench --tokens /tmp/train.bin --token-dtype u16 --seq-len 2048 --batch-size 8 --epochs 1 --workers $w --json 2>&1 | summ "tokens r$round w=$w"
done; done
for _ in $(seq 120); do
  [ "$(find "$D" -name '*.jpg' 2>/dev/null | wc -l)" -ge 12000 ] && break
  sleep 1
done
sleep 2; kill $folder 2>/dev/null
log "JPEGs, CPU decode to the host, $D"
for round in 1 2; do for w in 8 16 auto; do
  $G bench --images "$D" --epochs 3 --workers $w --json | summ "jpegs r$round w=$w"
done; done
log done
