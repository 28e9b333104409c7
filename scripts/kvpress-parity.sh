#!/usr/bin/env bash
# Parity of kvreplay's preset=kvpress policies with NVIDIA kvpress itself
# (docs/kvpress-parity.md). From a fresh clone: fetches SmolLM2 if needed,
# builds target/release/kvreplay, makes .venv-kvpress/ with pinned kvpress,
# transformers, torch and gguf from PyPI (torch from PyPI brings the CUDA
# stack: several GB; the run itself is on CPU), then runs
# scripts/kvpress_parity.py, which rewrites the table of docs/kvpress-parity.md.
# Extra arguments go to the Python script (e.g. --only SnapKV --ratios 0.5).
# Not part of CI: 5-20 minutes on 2 CPU cores once installed.
set -euo pipefail
cd "$(dirname "$0")/.."
KVPRESS_VERSION=0.5.4
TRANSFORMERS_VERSION=4.57.1
TORCH_VERSION=2.9.1
GGUF_VERSION=0.17.1
scripts/fetch-model.sh smollm2
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
cargo build --release --bin kvreplay
venv=.venv-kvpress
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check \
    "kvpress==$KVPRESS_VERSION" "transformers==$TRANSFORMERS_VERSION" \
    "torch==$TORCH_VERSION" "gguf==$GGUF_VERSION"
"$venv/bin/python" scripts/kvpress_parity.py --kvreplay "$CARGO_TARGET_DIR/release/kvreplay" "$@"
