#!/usr/bin/env bash
# The HF transformers capture tests (python/tests/test_hf.py), run by
# scripts/test.sh after scripts/test-python.sh. Makes .venv-hf/ with
# torch, transformers and gguf from PyPI (torch from PyPI brings the whole
# CUDA stack: several GB; see BENCHMARKS.md), installs the kvreplay wheel
# built by scripts/test-python.sh (run first), and runs the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-hf
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check torch transformers gguf accelerate numpy pytest
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
"$venv/bin/pip" install -q --disable-pip-version-check --force-reinstall --no-deps "$CARGO_TARGET_DIR"/wheels/kvreplay-*.whl
"$venv/bin/python" -m pytest -q -s -p no:cacheprovider -rs python/tests/test_hf.py "$@"
