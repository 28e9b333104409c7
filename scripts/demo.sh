#!/usr/bin/env bash
# The demo: fetch the default model if needed, capture a trace of it on a
# built-in passkey prompt, then inspect and verify the trace.
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
echo "trace written to $out (open it from Python with safetensors: see traces/FORMAT.md)"
