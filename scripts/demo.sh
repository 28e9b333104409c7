#!/usr/bin/env bash
# The demo: fetch the default model if needed, capture the default task suite
# (pass key retrieval at 512, 1024, 2048 and 4096 tokens), sweep every
# baseline and seed method over budgets 32 to 1024, write the CSVs, plots
# and report into results/, then rerun the model closed-loop on one trace to
# check replay against it. Rerunning resumes whatever is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-model.sh
cargo build --release --quiet
kv=target/release/kvreplay
mkdir -p results
echo "== capturing the default suite into results/suite (about 1-2 minutes)"
"$kv" capture --suite default --decode 16 --out results/suite
"$kv" verify results/suite/passkey-0512-d10.kvtrace
echo "== sweeping every policy over budgets 32..1024 into results/sweep (about 2 minutes)"
policies=$("$kv" policies | grep -E '^[a-z_0-9]+' -o | tr '\n' ' ')
# shellcheck disable=SC2086
"$kv" sweep --traces results/suite --policy $policies --budget 32,64,128,256,512,1024 --out results/sweep
echo
# policies use unequal memory at equal budget: rank them at equal memory
"$kv" compare results/sweep --rank
echo
echo "== closed-loop check on one trace: does replay error predict the model's own (about 1 minute)"
"$kv" validate --trace results/suite/passkey-0512-d10.kvtrace --policy streaming_llm h2o snapkv tova --budget 32,64,128,256 --out results/validate
echo
echo "report:  results/sweep/report.html (open it in a browser)"
echo "tables:  results/sweep/summary.csv, results/sweep/results.csv"
echo "plots:   results/sweep/*.svg"
echo "closed loop: results/validate/report.md (the full suite: see the README, \"Does replay predict the model?\")"
echo "next:    $kv claims --trace results/suite/passkey-1024-d40.kvtrace   (the seed papers' claims)"
