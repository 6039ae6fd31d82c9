#!/usr/bin/env bash
# The hub formats on the H200 machine (kind nvidia-h200: 1 GPU, 16 CPUs), in ONE call of at
# most ~8 minutes, every pair of runs alternated in the same call:
#
#  (a) numbers to the GPU: 262,144 rows of a 1,024-f32 column and an i64 label (1 GiB), as
#      Parquet (pyarrow's layout: row groups of 65,536 rows, snappy) against the same data as
#      .npy (+ labels.npy), 16 and 4 workers, shuffled, 4 epochs each, 3 rounds;
#  (b) JPEGs: 12,000 JPEGs of 500x375 (torch_baseline.py's folder) as an ImageFolder against
#      the same JPEGs in one Parquet file in `datasets`' Image layout (hub_tables images),
#      RandomResizedCrop 224 + flip to f16 on the GPU, batch 128, 4 epochs, CPU decode and
#      --decode gpu, 16 workers, 2 rounds;
#  (c) memory: the Parquet run's chunk cache (peak bytes) and the process's peak RSS with 4
#      and with 16 workers;
#  (d) text tokenized on the fly against its Megatron output (gpufeed tokenize), 4 and 16
#      workers; (e) the GPU tests.
#
# Stage on the build machine, from the repository's root:
#   CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=symbols \
#     cargo build --release -p gpufeed-cli --features cuda
#   CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=symbols \
#     cargo build --release -p gpufeed-bench --example hub_tables
#   mkdir -p .gpu/bin && cp target/release/gpufeed target/release/examples/hub_tables .gpu/bin/
#   cp /work/shared/bench/torch_baseline.py .gpu/
#   cp target/release/deps/cuda-* .gpu/tests/cuda   (cargo test --release -p gpufeed --features cuda --test cuda --no-run)
#   mkdir -p .gpu/wheels && pip download -q --no-deps nvidia-nvjpeg-cu12 -d .gpu/wheels
#   mkdir -p .gpu/text && cp -r target/tokenizer-tests/fixtures/gpt2 target/tokenizer-tests/corpus/corpus.jsonl .gpu/text/
# then the device tool's `run` with carry [".gpu"] and `bash crates/bench/scripts/device_hub_tables.sh`.
# Every bench line goes to $OUT/bench.jsonl (tagged with its case), the summary to stdout.
set -u
cd "$(dirname "$0")/../../.."
G=.gpu
OUT=${OUT:-/tmp/gpufeed-out}
DATA=/tmp/hub-tables
JPEGS=$DATA/jpegs
COUNT=${COUNT:-12000}
mkdir -p "$OUT" "$DATA"
START=$(date +%s)
LIMIT=${LIMIT:-540}
left() { echo $((LIMIT - ($(date +%s) - START))); }
step() { echo "== [$(($(date +%s) - START)) s] $*"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "cpus: $(nproc)"

step "the data: the JPEG folder (in the background) and the numbers as Parquet and .npy"
timeout 300 python3 "$G/torch_baseline.py" --only jpeg --jpeg-dir "$JPEGS" --jpeg-count "$COUNT" \
  --workers 1 >"$OUT/folder.log" 2>&1 &
folder_pid=$!
"$G/bin/hub_tables" numbers "$DATA" 262144 1024 || echo "FAILED: hub_tables numbers"
ls -la "$DATA"

# One `gpufeed bench` run, its JSON line tagged with the case and its peak RSS (KiB).
bench() {
  local case=$1; shift
  if [ "$(left)" -lt 40 ]; then echo "skipped $case: $(left) s left"; return; fi
  python3 - "$case" "$OUT/bench.jsonl" "$G/bin/gpufeed" bench --json "$@" <<'PY'
import json, resource, subprocess, sys
case, out, cmd = sys.argv[1], sys.argv[2], sys.argv[3:]
p = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
if p.returncode != 0 or not lines:
    print(f"FAILED {case}: exit {p.returncode}: {p.stderr[-600:]}")
    sys.exit(0)
r = json.loads(lines[-1])
r["case"] = case
r["max_rss_kib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
with open(out, "a") as f:
    f.write(json.dumps(r) + "\n")
steady = r.get("steady_bytes_per_sec") or 0
sps = r.get("steady_samples_per_sec") or r.get("samples_per_sec") or 0
cache = r.get("chunk_cache") or {}
print(f"{case:28s} steady {steady / 1e9:7.2f} GB/s  samples/s {sps:10.0f}  epochs/s {r.get('epoch_bytes_per_sec')}  "
      f"rss {r['max_rss_kib'] / 1024:.0f} MiB  cache peak {cache.get('peak_bytes', 0) / 2**20:.0f} MiB")
PY
}

step "(a) numbers to the GPU: .npy against Parquet, alternated, 3 rounds"
for round in 1 2 3; do
  bench "npy_16w" "$DATA/numbers.npy" --labels "$DATA/labels.npy" --device 0 --workers 16 --batch-size 256 --epochs 4
  bench "parquet_16w" "$DATA/numbers.parquet" --device 0 --workers 16 --batch-size 256 --epochs 4
  bench "parquet_4w" "$DATA/numbers.parquet" --device 0 --workers 4 --batch-size 256 --epochs 4
  bench "npy_4w" "$DATA/numbers.npy" --labels "$DATA/labels.npy" --device 0 --workers 4 --batch-size 256 --epochs 4
done

step "waiting for the JPEG folder"
count() { find "$JPEGS" -name '*.jpg' 2>/dev/null | wc -l; }
while [ "$(count)" -lt "$COUNT" ] && kill -0 "$folder_pid" 2>/dev/null; do sleep 2; done
sleep 2
kill "$folder_pid" 2>/dev/null
wait "$folder_pid" 2>/dev/null
echo "$(count) JPEGs"
"$G/bin/hub_tables" images "$JPEGS" "$DATA/imagenet.parquet" || echo "FAILED: hub_tables images"
du -sh "$JPEGS" "$DATA/imagenet.parquet"

step "(b) JPEGs: ImageFolder against Parquet, CPU decode and --decode gpu, alternated, 2 rounds"
img() { bench "$1" --images "$2" --device 0 --image-size 224 --image-dtype f16 --batch-size 128 --epochs 4 --workers 16 --decode "$3"; }
for round in 1 2; do
  img "folder_cpu_16w" "$JPEGS" cpu
  img "parquet_cpu_16w" "$DATA/imagenet.parquet" cpu
  img "parquet_gpu_16w" "$DATA/imagenet.parquet" gpu
  img "folder_gpu_16w" "$JPEGS" gpu
done

step "(d) text to tokens: gpufeed tokenize on 16 cores, then the token loader to the GPU over the text (tokenized on the fly) and over its Megatron output, 4 and 16 workers, alternated"
if [ -e "$G/text/corpus.jsonl" ]; then
  TEXT=$DATA/text
  mkdir -p "$TEXT"
  # The tokenizer tests' corpus (Debian man pages in ten languages) 16 times: 43 MB of text.
  for i in $(seq 16); do grep "\"text\"" "$G/text/corpus.jsonl"; done > "$TEXT/corpus.jsonl"
  TIMEFORMAT="tokenize: %R s wall, %U s user"
  time "$G/bin/gpufeed" tokenize "$TEXT/corpus.jsonl" --tokenizer "$G/text/gpt2" --text-field text \
    -o "$TEXT/corpus" 2>&1 | tail -3
  ls -la "$TEXT"
  for round in 1 2; do
    bench "tokens_megatron_4w" --tokens "$TEXT/corpus" --device 0 --workers 4 --batch-size 32 --seq-len 2048 --epochs 3
    bench "tokens_text_4w" --tokens "$TEXT/corpus.jsonl" --tokenizer "$G/text/gpt2/tokenizer.json" --text-field text --device 0 --workers 4 --batch-size 32 --seq-len 2048 --epochs 3
    bench "tokens_text_16w" --tokens "$TEXT/corpus.jsonl" --tokenizer "$G/text/gpt2/tokenizer.json" --text-field text --device 0 --workers 16 --batch-size 32 --seq-len 2048 --epochs 3
    bench "tokens_megatron_16w" --tokens "$TEXT/corpus" --device 0 --workers 16 --batch-size 32 --seq-len 2048 --epochs 3
  done
fi

step "(e) the GPU tests (GPUFEED_REQUIRE_GPU=1), the JPEG decode's first"
if [ -e "$G/tests/cuda" ]; then
  for lib in "$G"/wheels/*.whl; do [ -e "$lib" ] && python3 -m pip install -q --no-deps "$lib" 2>/dev/null; done
  if [ "$(left)" -gt 60 ]; then
    GPUFEED_REQUIRE_GPU=1 timeout $(( $(left) - 30 )) "$G/tests/cuda" --test-threads=1 >"$OUT/tests_cuda.log" 2>&1 \
      && echo "ok: $(grep -E 'test result' "$OUT/tests_cuda.log" | tail -1)" \
      || { echo "FAILED: GPU tests"; grep -E "FAILED|panicked|test result" "$OUT/tests_cuda.log" | head -20; }
  else
    echo "skipped the GPU tests: $(left) s left"
  fi
fi

step "summary: medians of each case, and the ratios"
python3 - "$OUT/bench.jsonl" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
by = {}
for r in runs:
    by.setdefault(r["case"], []).append(r)
def med(case, key):
    v = [r.get(key) or 0 for r in by.get(case, [])]
    return statistics.median(v) if v else 0
for case, rs in by.items():
    print(case, "steady GB/s", [round((r.get("steady_bytes_per_sec") or 0) / 1e9, 2) for r in rs],
          "samples/s", [round(r.get("steady_samples_per_sec") or r.get("samples_per_sec") or 0) for r in rs])
for a, b in [("parquet_16w", "npy_16w"), ("parquet_4w", "npy_4w")]:
    if med(b, "steady_bytes_per_sec"):
        print(f"{a}/{b}: {med(a, 'steady_bytes_per_sec') / med(b, 'steady_bytes_per_sec'):.2f}")
for a, b in [("parquet_cpu_16w", "folder_cpu_16w"), ("parquet_gpu_16w", "folder_gpu_16w"),
             ("tokens_text_4w", "tokens_megatron_4w"), ("tokens_text_16w", "tokens_megatron_16w")]:
    k = "steady_samples_per_sec"
    if med(b, k):
        print(f"{a}/{b}: {med(a, k) / med(b, k):.2f}")
PY
step "done"
