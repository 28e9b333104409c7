#!/usr/bin/env bash
# The test command: fetch the real models (SmolLM2 and Gemma 3) and the Python reference if needed,
# then run every test of the workspace, optimised (the real-model tests run a
# 135M-parameter model). Tests that need the model fail rather than skip here.
# Then the real Slurm test (scripts/slurm-local.sh: a one-node cluster on this
# machine), where it can run: root, Debian packages reachable, no test filter
# given, KVREPLAY_SKIP_SLURM unset; it says why when it does not run.
# Then the Python package's pytest suite (scripts/test-python.sh: builds the
# wheel into .venv-py/), unless KVREPLAY_SKIP_PYTHON is set, and its HF
# transformers capture tests (scripts/test-python-hf.sh: torch, transformers
# and gguf into .venv-hf/, 5.6 GiB on first use; skipped, saying why, where the
# disk has less than 7 GiB free), unless KVREPLAY_SKIP_HF is set.
# KVREPLAY_PRUNE_BUILD=1 (set by .ci/run) deletes target/release's
# intermediate build files before that last phase, to make room for torch.
# Prints the seconds each phase took ("time per phase: ..."), then ends with
# one summary line, "tests: N passed, M failed" (the Slurm test
# counts as one; each pytest test as one).
set -euo pipefail
cd "$(dirname "$0")/.."
# seconds per phase, printed at the end (where CI time goes)
phases=() t_phase=$SECONDS
phase_done() { phases+=("$1 $((SECONDS - t_phase)) s"); t_phase=$SECONDS; }
scripts/fetch-model.sh all
scripts/setup-reference.sh
# NVRTC (no GPU needed) so every CUDA kernel is compile-checked for sm_80/sm_90
KVREPLAY_NVRTC_LIB=$(scripts/fetch-nvrtc.sh)
export KVREPLAY_NVRTC_LIB KVREPLAY_REQUIRE_NVRTC=1
# The emulated kernel tests (kernels/tests/emulated.rs) build the CUDA sources
# with g++ under AddressSanitizer/UBSan and ThreadSanitizer: install the
# compiler and the sanitizer runtimes where they are missing (a fresh Debian).
if ! dpkg -s g++ libasan8 libubsan1 libtsan2 >/dev/null 2>&1 && command -v apt-get >/dev/null \
    && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq g++ libasan8 libubsan1 libtsan2
fi
export KVREPLAY_REQUIRE_EMU=1
export KVREPLAY_REQUIRE_MODEL=1
phase_done setup
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
phase_done "cargo build + test"
# The real Slurm test: a one-node cluster on this machine (scripts/slurm-local.sh).
slurm_pass=0 slurm_fail=0
if [ $# -gt 0 ]; then
    echo "slurm-local: SKIPPED: a test filter was given ($*)"
else
    set +e
    scripts/slurm-local.sh
    slurm_status=$?
    set -e
    case $slurm_status in
        0) slurm_pass=1 ;;
        77) ;;
        *) slurm_fail=1; echo "slurm-local: FAILED (exit status $slurm_status)" ;;
    esac
fi
phase_done slurm
# The Python package (python/): its pytest suites, counted test by test.
py_pass=0 py_fail=0
pytest_suite() { # SCRIPT: run it, add its pytest counts to py_pass/py_fail
    local pylog status last pass fail
    pylog=$(mktemp)
    set +e
    "$1" 2>&1 | tee "$pylog"
    status=${PIPESTATUS[0]}
    set -e
    last=$(grep -E '(passed|failed|error|no tests ran)' "$pylog" | tail -1 || true)
    pass=$(grep -oE '[0-9]+ passed' <<<"$last" | grep -oE '[0-9]+' || echo 0)
    fail=$(( $(grep -oE '[0-9]+ failed' <<<"$last" | grep -oE '[0-9]+' || echo 0) \
        + $(grep -oE '[0-9]+ errors?' <<<"$last" | grep -oE '[0-9]+' || echo 0) ))
    # exit 77: the suite could not be set up here and said why (skipped);
    # any other build or setup failure counts as one failed test
    if [ "$status" = 77 ]; then pass=0 fail=0; fi
    if [ "$status" != 0 ] && [ "$status" != 77 ] && [ "$fail" = 0 ]; then fail=1; fi
    rm -f "$pylog"
    py_pass=$((py_pass + pass)) py_fail=$((py_fail + fail))
}
if [ -n "${KVREPLAY_SKIP_PYTHON:-}" ]; then
    echo "python: SKIPPED (KVREPLAY_SKIP_PYTHON is set)"
else
    # the CLI the pytest suites run is the one cargo test built above
    if [ "$status" = 0 ] && [ -x target/release/kvreplay ]; then
        export KVREPLAY_BIN_BUILT=1
    fi
    pytest_suite scripts/test-python.sh
    phase_done python
    if [ -n "${KVREPLAY_SKIP_HF:-}" ]; then
        echo "python HF capture: SKIPPED (KVREPLAY_SKIP_HF is set)"
    else
        if [ -n "${KVREPLAY_PRUNE_BUILD:-}" ]; then
            # CI (.ci/run): nothing compiles after this point, and torch needs
            # room (scripts/test-python-hf.sh): drop the test binaries and
            # intermediate build files; the CLI and the wheel stay
            rel=${CARGO_TARGET_DIR:-target}/release
            rm -rf "$rel/deps" "$rel/build" "$rel/.fingerprint"
            echo "pruned $rel/{deps,build,.fingerprint} (KVREPLAY_PRUNE_BUILD);" \
                "$(df -Ph . | awk 'NR == 2 { print $4 }') free"
        fi
        pytest_suite scripts/test-python-hf.sh
        phase_done "python HF"
    fi
fi
echo "time per phase: $(printf '%s; ' "${phases[@]}")"
awk -v sp="$((slurm_pass + py_pass))" -v sf="$((slurm_fail + py_fail))" \
    '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "tests: %d passed, %d failed\n", p + sp, f + sf }' "$log"
if [ "$status" = 0 ] && { [ "$slurm_fail" = 1 ] || [ "$py_fail" != 0 ]; }; then status=1; fi
exit "$status"
