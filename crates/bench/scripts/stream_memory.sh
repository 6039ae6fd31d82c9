#!/usr/bin/env bash
# Memory while streaming a sharded data set larger than the memory it may use:
# runs `gpufeed bench DATASET --json ...` under /usr/bin/time -v, sampling the process's
# resident memory (anonymous and file-backed, and the kernel's high-water mark) every 0.1 s,
# and prints the peaks, time's maximum resident set and the bench's JSON report. With a LIMIT
# other than `none` it runs inside a memory cgroup (v1 or v2) of that limit, made under the
# caller's own cgroup (so that no limit above it is escaped), and prints the cgroup's peak.
#
#   crates/bench/scripts/stream_memory.sh LIMIT|none GPUFEED DATASET [bench flags...]
#   crates/bench/scripts/stream_memory.sh 1G target/release/gpufeed /data/shards-10g --epochs 1 \
#       --shuffle-window 8 --shuffle-block 64 --no-baseline
#   crates/bench/scripts/stream_memory.sh none target/release/gpufeed s3://bench/mds-64x64 --epochs 1 \
#       --cache-dir /tmp/cache --cache-limit 512MiB --no-baseline
#
# A LIMIT needs root (it makes the cgroup); the cgroup is removed at the end.
set -euo pipefail
limit="$1" gpufeed="$2" dataset="$3"
shift 3
cg=""
peak_file=""
if [ "$limit" != none ]; then
  name="gpufeed-mem-$$"
  if [ -d /sys/fs/cgroup/memory ]; then
    own="$(awk -F: '$2 == "memory" {print $3}' /proc/self/cgroup)"
    cg="/sys/fs/cgroup/memory${own%/}/$name"
    mkdir "$cg"
    echo "$limit" > "$cg/memory.limit_in_bytes"
    peak_file="$cg/memory.max_usage_in_bytes"
  else
    own="$(awk -F: '$1 == "0" {print $3}' /proc/self/cgroup)"
    cg="/sys/fs/cgroup${own%/}/$name"
    mkdir "$cg"
    echo "$limit" > "$cg/memory.max"
    peak_file="$cg/memory.peak"
  fi
fi
samples="$(mktemp)"
report="$(mktemp)"
timing="$(mktemp)"
trap 'rm -f "$samples" "$report" "$timing"; [ -z "$cg" ] || rmdir "$cg" 2>/dev/null || true' EXIT
# The command's own process: in the cgroup (when there is one), under time.
bash -c '[ -z "$1" ] || echo $$ > "$1/cgroup.procs"; shift; exec "$@"' _ "$cg" \
  /usr/bin/time -v -o "$timing" "$gpufeed" bench "$dataset" --json "$@" > "$report" &
timer=$!
pid=""
while kill -0 "$timer" 2>/dev/null; do
  if [ -z "$pid" ]; then
    pid="$(cat "/proc/$timer/task/$timer/children" 2>/dev/null | awk '{print $1}')" || true
  fi
  if [ -n "$pid" ]; then
    awk '/^VmRSS|^VmHWM|^RssAnon|^RssFile/ {printf "%s %s ", $1, $2} END {print ""}' \
      "/proc/$pid/status" >> "$samples" 2>/dev/null || true
  fi
  sleep 0.1
done
status=0
wait "$timer" || status=$?
echo "exit status: $status; samples: $(wc -l < "$samples")"
for key in VmRSS: VmHWM: RssAnon: RssFile:; do
  awk -v k="$key" '{for (i = 1; i < NF; i++) if ($i == k && $(i+1) > m) m = $(i+1)} END {printf "peak %s %.1f MiB\n", k, m / 1024}' "$samples"
done
awk -F': ' '/Maximum resident set size/ {printf "time -v: maximum resident set %.1f MiB\n", $2 / 1024}
  /Elapsed \(wall clock\)/ {print "time -v: elapsed " $2}' "$timing"
if [ -n "$peak_file" ]; then
  echo "cgroup peak: $(( $(cat "$peak_file") / 1048576 )) MiB (limit $limit)"
fi
cat "$report"
exit "$status"
