#!/usr/bin/env bash
# The README's table of trace sizes: `kvreplay inspect --estimate` on the
# model shapes in docs/shapes/ (HF config.json fields) at 4k, 32k and 128k
# prompt tokens, 16 decode tokens, f16, lean traces keeping 128 queries.
# Prints one markdown table; tests/trace_sizes.rs checks that the README
# holds exactly this output.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${KVREPLAY_BIN:-target/release/kvreplay}
[ -x "$bin" ] || cargo build --release --quiet
first=1
for shape in smollm2-135m gemma-3-270m qwen2.5-7b llama-3.1-8b mistral-7b-v0.3 qwen3-8b llama-3.1-70b; do
    out=$("$bin" inspect --estimate "docs/shapes/$shape.json" --tokens 4096,32768,131072)
    if [ $first = 1 ]; then echo "$out"; first=0; else tail -n +3 <<<"$out"; fi
done
