#!/usr/bin/env bash
# The demo: fetch both real models if needed (SmolLM2-135M-Instruct and
# Gemma 3 270M), capture the default task suite (pass key retrieval at 512,
# 1024, 2048 and 4096 tokens) with each, sweep every baseline and seed
# method over budgets 32 to 1024 on each model, write the CSVs, plots and a
# report per model plus one page comparing the two models' rankings, then
# rerun each model closed-loop on one trace to check replay against it.
# Rerunning resumes whatever is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-model.sh all
cargo build --release --quiet
kv=target/release/kvreplay
gemma=models/gemma-3-270m-Q4_K_M.gguf
mkdir -p results
echo "== capturing the default suite with SmolLM2 into results/suite (about 1-2 minutes)"
"$kv" capture --suite default --decode 16 --out results/suite
"$kv" verify results/suite/passkey-0512-d10.kvtrace
echo "== capturing the default suite with Gemma 3 270M into results/suite-gemma3 (about 1-2 minutes)"
"$kv" capture --model "$gemma" --suite default --decode 16 --out results/suite-gemma3
"$kv" verify results/suite-gemma3/passkey-1024-d40.kvtrace
# every registered method (the `sliding` wrapper is not one: see docs/methods/sliding.md)
policies=$("$kv" policies | grep -E '^[a-z_0-9]+' -o | grep -vx sliding | tr '\n' ' ')
echo "== sweeping every policy over budgets 32..1024 on each model (about 3-5 minutes each)"
# shellcheck disable=SC2086
"$kv" sweep --traces results/suite --policy $policies --budget 32,64,128,256,512,1024 --out results/sweep
# shellcheck disable=SC2086
"$kv" sweep --traces results/suite-gemma3 --policy $policies --budget 32,64,128,256,512,1024 --out results/sweep-gemma3
echo
# policies use unequal memory at equal budget: rank them at equal memory
echo "== SmolLM2"
"$kv" compare results/sweep --rank
echo
echo "== Gemma 3 270M"
"$kv" compare results/sweep-gemma3 --rank
echo
echo "== the two models' rankings side by side"
"$kv" compare --models results/sweep results/sweep-gemma3 --html results/models.html
echo
echo "== closed-loop check on one trace per model: does replay error predict the model's own (about 2 minutes)"
"$kv" validate --trace results/suite/passkey-0512-d10.kvtrace --policy streaming_llm h2o snapkv tova --budget 32,64,128,256 --out results/validate
"$kv" validate --model "$gemma" --trace results/suite-gemma3/passkey-1024-d40.kvtrace --policy streaming_llm h2o snapkv tova --budget 32,64,128,256 --out results/validate-gemma3
echo
echo "reports: results/sweep/report.html, results/sweep-gemma3/report.html (open them in a browser)"
echo "models:  results/models.html (both models' rankings side by side)"
echo "tables:  results/sweep*/summary.csv, results/sweep*/results.csv"
echo "plots:   results/sweep*/*.svg"
echo "closed loop: results/validate*/report.md (the full suite: see the README, \"Does replay predict the model?\")"
echo "next:    $kv claims --trace results/suite/passkey-1024-d40.kvtrace   (the seed papers' claims)"
