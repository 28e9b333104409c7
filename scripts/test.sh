#!/usr/bin/env bash
# The test command: fetch the real model and the Python reference if needed,
# then run every test of the workspace, optimised (the real-model tests run a
# 135M-parameter model). Tests that need the model fail rather than skip here.
# Ends with one summary line, "tests: N passed, M failed".
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-model.sh
scripts/setup-reference.sh
# NVRTC (no GPU needed) so every CUDA kernel is compile-checked for sm_80/sm_90
KVREPLAY_NVRTC_LIB=$(scripts/fetch-nvrtc.sh)
export KVREPLAY_NVRTC_LIB KVREPLAY_REQUIRE_NVRTC=1
export KVREPLAY_REQUIRE_MODEL=1
log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
cargo test --workspace --release "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
# Which devices the parity suite ran on (its tests print why CUDA did not run).
parity=$(cargo test --workspace --release --test parity -q -- --nocapture 2>&1 || true)
why=$(grep -m1 "CUDA not run" <<<"$parity" | sed 's/^[a-z_]*: //' || true)
echo "parity suite: ${why:-ran on the CPU and on CUDA}"
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
exit "$status"
