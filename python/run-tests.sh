#!/usr/bin/env bash
# The Python package's tests, as the README says: a virtual environment under target/ (the
# caller's Python is left alone), the pinned tools of requirements-ci.txt, the package
# installed as users install it (`pip install ./python`: maturin builds the abi3 wheel, in
# release mode, into the workspace's target directory), then pytest on python/tests.
# Arguments go to pytest. PYTHON picks the interpreter (default python3).
# GPUFEED_PYTHON_FEATURES (such as `s3`) builds the package with those cargo features, as the
# README's `--config-settings=build-args="--features s3"` does, into a virtual environment of
# its own (target/python-venv-FEATURES), so that the default build's stays as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
features="${GPUFEED_PYTHON_FEATURES:-}"
if [ -n "$features" ]; then
  venv="${GPUFEED_PYTHON_VENV:-target/python-venv-${features//,/-}}"
else
  venv="${GPUFEED_PYTHON_VENV:-target/python-venv}"
fi
if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
# Constraints reach pip's isolated build environment too: the wheel is built by the pinned maturin.
export PIP_CONSTRAINT="$PWD/python/requirements-ci.txt"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r python/requirements-ci.txt
# The real writers the tests compare with, without their own (unused, heavy) requirements.
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -r python/requirements-writers.txt
# The tokenizer tests' Python side: Python `tokenizers` (the ids compared with) and what makes
# their fixtures (transformers' converters); the fixtures and the corpus are made by the tests
# themselves, once, under target/tokenizer-tests.
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r python/requirements-tokenizers.txt
if [ -n "$features" ]; then
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check ./python \
    --config-settings=build-args="--features $features"
else
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check ./python
fi
# From the root, where no `gpufeed` folder hides the installed package (python/gpufeed has no
# compiled module).
exec "$venv/bin/python" -m pytest python/tests "$@"
