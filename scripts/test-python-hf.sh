#!/usr/bin/env bash
# The HF transformers capture tests (python/tests/test_hf.py), run by
# scripts/test.sh after scripts/test-python.sh. Makes .venv-hf/ with
# torch, transformers and gguf from PyPI (torch from PyPI brings the whole
# CUDA stack: 5.6 GiB installed; see BENCHMARKS.md), installs the kvreplay
# wheel built by scripts/test-python.sh (run first), and runs the tests.
#
# Disk: a plain `pip install torch ...` downloads every wheel before it
# installs any, and peaked 8.9 GiB above the disk use it began with (a
# cargo build beside it added some), against 5.6 installed (measured on
# 2026-11-30, pip 23.2.1, torch 2.15.0). So the packages are resolved once
# (`pip install --dry-run --report`) and installed one large wheel at a time,
# `--no-deps`, without pip's cache: that peaked at 5.7 GiB, the installed
# size (same day, same versions; `df` sampled every second). With less
# than KVREPLAY_HF_MIN_FREE_GIB (default 7) free where .venv-hf/ lives, the
# script installs nothing, says so and exits 77, which scripts/test.sh reports
# as skipped, not failed.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-hf
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pkgs=(torch transformers gguf accelerate numpy pytest)
imports="import $(IFS=,; echo "${pkgs[*]}")"
pip=("$venv/bin/pip" install -q --disable-pip-version-check --no-cache-dir)
if ! "$venv/bin/python" -c "$imports" 2>/dev/null; then
    need=${KVREPLAY_HF_MIN_FREE_GIB:-7}
    free=$(df -Pk "$venv" | awk 'NR == 2 { print int($4 / 1048576) }')
    if [ "$free" -lt "$need" ]; then
        echo "python HF capture: SKIPPED: $free GiB free on the disk of $PWD/$venv; torch," \
            "transformers and gguf need about $need GiB to install (5.6 GiB installed, plus" \
            "one wheel at a time): free disk space, or set KVREPLAY_SKIP_HF=1 to skip this on purpose"
        exit 77
    fi
    report=$(mktemp)
    trap 'rm -f "$report"' EXIT
    "${pip[@]}" --dry-run --ignore-installed --report "$report" "${pkgs[@]}"
    # name==version of every package the resolver chose, marked L for the
    # large ones (torch, triton, the CUDA stack: installed each on its own)
    large=() small=()
    while read -r size spec; do
        if [ "$size" = L ]; then large+=("$spec"); else small+=("$spec"); fi
    done < <("$venv/bin/python" -c '
import json, re, sys
for i in json.load(open(sys.argv[1]))["install"]:
    name, version = i["metadata"]["name"], i["metadata"]["version"]
    big = re.match(r"(torch|triton|nvidia-.*|cuda-.*)$", name, re.I)
    print("L" if big else "S", f"{name}=={version}")
' "$report")
    for spec in "${large[@]}"; do
        "${pip[@]}" --no-deps "$spec"
    done
    [ "${#small[@]}" = 0 ] || "${pip[@]}" --no-deps "${small[@]}"
    "$venv/bin/python" -c "$imports"
fi
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}"
"${pip[@]}" --force-reinstall --no-deps "$CARGO_TARGET_DIR"/wheels/kvreplay-*.whl
"$venv/bin/python" -m pytest -q -s -p no:cacheprovider -rs python/tests/test_hf.py "$@"
