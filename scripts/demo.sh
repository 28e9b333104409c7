#!/usr/bin/env bash
# The demo: fetch the default model if needed, capture a trace of it on a
# built-in passkey prompt, inspect and verify the trace, then replay every
# compression policy on it at one budget and print the errors and memory.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-model.sh
cargo build --release --quiet
kv=target/release/kvreplay
out=results/demo.kvtrace
mkdir -p results
filler="The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
prompt="There is an important passkey hidden in this text. Remember it. $(printf '%.0s'"$filler" {1..6})The passkey is 68142. Remember it: 68142 is the passkey. $(printf '%.0s'"$filler" {1..6})What is the passkey?"
"$kv" capture --prompt "$prompt" --chat --decode 32 --out "$out" --force
"$kv" inspect "$out"
"$kv" verify "$out"
echo
budget=64
echo "every policy at budget $budget (prompt entries per KV head and layer):"
printf '%-14s %8s %8s %10s %8s %10s\n' policy rel_l2 cosine attn_mass kl memory
for policy in $("$kv" policies | grep -E '^[a-z_0-9]+' -o); do
    line=$("$kv" replay --trace "$out" --policy "$policy" --budget "$budget" --out "results/demo-replay/$policy" | grep -E '^ +all')
    # "   all  rel_l2  cosine  attn_mass  kl  bytes  (NN.N% of the full f16 cache)"
    read -r _ rel cos mass kl _ pct _ <<<"$line"
    printf '%-14s %8s %8s %10s %8s %10s\n' "$policy" "$rel" "$cos" "$mass" "$kl" "${pct#(}"
done
echo
echo "trace: $out (open it from Python with safetensors: see traces/FORMAT.md)"
echo "per-policy CSVs: results/demo-replay/POLICY/{metrics.csv, retention.csv, summary.json}"
echo "next: target/release/kvreplay claims --trace $out   (the seed papers' claims, ~1 minute)"
