#!/usr/bin/env bash
# Tokenizing per core, gpufeed beside its anchors on the same documents, in one run:
# benches/tokenize.rs (the fast byte-level BPE and the tokenizers crate, GPT-2 and
# Llama-3-style) then crates/bench/scripts/tokenize_anchors.py (Python tokenizers, tiktoken,
# gigatoken), ROUNDS times, interleaved, each on one thread. The log goes to stdout.
#
#   crates/bench/scripts/tokenize.sh [ROUNDS]          (default 2)
#   GPUFEED_BENCH_LONG=1 crates/bench/scripts/tokenize.sh   # and the long pieces (1 to 10 MB)
#
# The fixtures and the corpus are made as the Python tests make them, under
# target/tokenizer-tests, with the Python of python/run-tests.sh's virtual environment
# (target/python-venv: run python/run-tests.sh once), plus gigatoken if it installs.
set -euo pipefail
cd "$(dirname "$0")/../../.."
rounds=${1:-2}
venv=${GPUFEED_PYTHON_VENV:-target/python-venv}
py="$venv/bin/python"
data=${GPUFEED_TOKENIZER_TESTS:-$PWD/target/tokenizer-tests}
export GPUFEED_TOKENIZER_TESTS=$data
"$py" -m pip install --quiet --disable-pip-version-check -r python/requirements-tokenizers.txt
"$py" -m pip install --quiet --disable-pip-version-check gigatoken==0.10.0 \
  || echo "# gigatoken does not install here: measured without it"
"$py" - <<EOF
import sys
sys.path.insert(0, "python/tests")
from tokenizer_fixtures import make_corpus, make_fixtures
make_fixtures.make("$data/fixtures")
make_corpus.make("$data/corpus")
EOF
echo "# $(date -u +%FT%TZ) $(uname -n), $(nproc) CPUs: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
export RAYON_NUM_THREADS=1 RAYON_RS_NUM_CPUS=1
for r in $(seq "$rounds"); do
  echo "== round $r: load $(cut -d' ' -f1-3 /proc/loadavg)"
  cargo bench --bench tokenize -- --noplot 2>&1 | grep -v -e '^Benchmarking' -e '^$' -e 'Warming up' -e 'Analyzing'
  "$py" crates/bench/scripts/tokenize_anchors.py "$data" 1
done
echo "== end: load $(cut -d' ' -f1-3 /proc/loadavg)"
