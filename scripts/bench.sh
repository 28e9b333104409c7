#!/usr/bin/env bash
# The benchmark suite, in one command. Prints every figure BENCHMARKS.md
# quotes and keeps a copy in results/bench/bench-DATE.txt:
#   1. criterion micro-benchmarks of the CPU kernels (cargo bench);
#   2. capture throughput (prefill, decode) on SmolLM2, 2048 + 64 tokens;
#   3. replay: one point, the NumPy reference comparison, the full sweep of
#      every policy x 6 budgets, and a model rerun for the points-per-rerun ratio;
#   4. replay time against prompt length, 512 to 16,384 tokens, and its exponent;
#   5. lines starting "target" put each figure the performance issue sets a
#      target for beside it (17-policy sweep, EMS/D2O/MiniCache/quant per
#      point, points per rerun, NumPy ratio, capture tok/s): met or not met;
#   6. where .venv-hf/ exists (scripts/test-python-hf.sh makes it), PyTorch's
#      figure on the same machine (scripts/bench-torch.py: HF transformers,
#      float32, same model and lengths) and capture's ratios to it;
#   7. the prefill's matrix products alone with NumPy's BLAS
#      (scripts/prefill-floor.py), a ceiling for capture prefill in f32, and,
#      where .venv-llamacpp/ exists (see scripts/bench-llamacpp.py), llama.cpp
#      on the same model and lengths.
# The first run captures the traces it needs (a few minutes for the longest).
# Usage: scripts/bench.sh [--quick]   (--quick: one repetition, no criterion)
set -euo pipefail
cd "$(dirname "$0")/.."
quick=${1:-}
reps=3
[ "$quick" = "--quick" ] && reps=1
scripts/fetch-model.sh
scripts/setup-reference.sh
cargo build --release
mkdir -p results/bench
log=results/bench/bench-$(date -u +%Y%m%dT%H%M%SZ).txt
{
    echo "# kvreplay benchmark suite, $(date -u), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(nproc) threads"
    if [ "$quick" != "--quick" ]; then
        echo "## criterion: CPU kernels"
        cargo bench -p kvreplay-kernels --bench kernels 2>&1 | grep -E "^[a-z_]+/|time:|thrpt:"
    fi
    echo "## capture"
    target/release/kvreplay bench capture --prompt-tokens 2048 --decode 64 --reps "$reps"
    echo "## the same prefill's matrix products alone, with NumPy's BLAS (a ceiling for capture prefill)"
    OPENBLAS_NUM_THREADS=$(nproc) .venv-ref/bin/python scripts/prefill-floor.py --reps "$reps"
    if [ -x .venv-llamacpp/bin/python ]; then
        echo "## llama.cpp, same model and lengths (8-bit activations, f16 KV cache, no trace)"
        .venv-llamacpp/bin/python scripts/bench-llamacpp.py --prompt-tokens 2048 --decode 64 \
            --reps "$reps" --threads "$(nproc)"
    fi
    if [ -x .venv-hf/bin/python ]; then
        echo "## PyTorch, same model and lengths"
        .venv-hf/bin/python scripts/bench-torch.py --prompt-tokens 2048 --decode 64 --reps "$reps" \
            --threads "$(nproc)" 2>&1 | grep -v Warning
    fi
    echo "## replay"
    target/release/kvreplay bench replay --trace results/bench2048.kvtrace --reps "$reps"
    echo "## scaling"
    target/release/kvreplay bench scaling --reps "$reps"
} 2>&1 | tee "$log"
# capture against PyTorch (the issue's targets: 1.2x prefill, 5x decode)
ratios() {
    local ours torch
    ours=$(grep -m1 '^median: prefill' "$log" || true)
    torch=$(grep -m1 '^torch .*median prefill' "$log" || true)
    [ -n "$ours" ] && [ -n "$torch" ] || return 0
    python3 - "$ours" "$torch" <<'PY'
import re, sys
o = [float(x) for x in re.findall(r"([0-9.]+) tok/s", sys.argv[1])]
t = [float(x) for x in re.findall(r"([0-9.]+) tok/s", sys.argv[2])]
for name, a, b, want in [("prefill", o[0], t[0], 1.2), ("decode", o[1], t[1], 5.0)]:
    r = a / b
    print(f"target  capture {name} vs PyTorch: {r:.2f}x ({a:.1f} / {b:.1f} tok/s; "
          f"target >= {want}x): {'met' if r >= want else 'not met'}")
PY
}
ratios | tee -a "$log"
# every figure with a target, together
{ echo "## targets"; grep -E '^(target|ceiling) ' "$log" || true; } | tee -a "$log"
echo "wrote $log"
