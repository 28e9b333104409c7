#!/usr/bin/env bash
# The test command: fetch the real model and the Python reference if needed,
# then run every test of the workspace, optimised (the real-model tests run a
# 135M-parameter model). Tests that need the model fail rather than skip here.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-model.sh
scripts/setup-reference.sh
export KVREPLAY_REQUIRE_MODEL=1
exec cargo test --workspace --release "$@"
