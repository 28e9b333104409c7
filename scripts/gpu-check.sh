#!/usr/bin/env bash
# The one command to run on a machine with an NVIDIA GPU. Writes a Markdown
# report (ready to paste into BENCHMARKS.md) with these sections, each run or
# marked "no GPU: skipped (why)":
#   a. the GPU (nvidia-smi: name, driver, CUDA version) and kvreplay's backend;
#   b. the kernel parity suite (every CUDA kernel against an f64 reference);
#   c. end to end on SmolLM2: one ~2,000-token prompt captured with --device
#      cpu and --device cuda, the traces compared (q/k/v/o per layer, greedy
#      tokens), a few policies replayed on both and on each device;
#   d. Gemma 3 (with KVREPLAY_GEMMA3_MODEL set): CPU against CUDA, as c;
#   e. compute-sanitizer memcheck and racecheck on a small CUDA capture;
#   f. capture throughput on each device.
# Without a GPU every device section is skipped and it exits 0. It exits 1
# when a check that ran failed (the report says which).
#
# Usage: scripts/gpu-check.sh [REPORT.md]        (default: gpu-check-report.md)
# Environment:
#   KVREPLAY_BIN             a prebuilt kvreplay (default: cargo build --release)
#   KVREPLAY_PARITY_BIN      a prebuilt parity test binary (default: cargo test ... --test parity)
#   KVREPLAY_MODEL           the model (default: models/SmolLM2-135M-Instruct.Q4_1.gguf,
#                            fetched by scripts/fetch-model.sh when missing)
#   KVREPLAY_GEMMA3_MODEL    a Gemma 3 GGUF for section d (scripts/fetch-model.sh gemma3)
#   KVREPLAY_GPU_CHECK_DIR   where traces and logs go (default: a new temporary folder)
#   KVREPLAY_GPU_CHECK_REPS  captures per device in section f (default 3)
#   KVREPLAY_GPU_CHECK_DEVICE the device compared with the CPU (default cuda;
#                            `cpu` tests this script on a machine without a GPU:
#                            sections c and f then compare the CPU with itself)
set -euo pipefail

report=$(realpath -m -- "${1:-gpu-check-report.md}")
cd "$(dirname "$0")/.."
work=${KVREPLAY_GPU_CHECK_DIR:-$(mktemp -d -t kvreplay-gpu-check.XXXXXX)}
mkdir -p "$work"
model=${KVREPLAY_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
reps=${KVREPLAY_GPU_CHECK_REPS:-3}
# the end-to-end prompt: a built-in task, so every machine captures the same tokens
task="passkey:length=2000,depth=0.5"
n_decode=32
policies=(streaming_llm h2o snapkv tova)
budgets=(64 256)
dev2=${KVREPLAY_GPU_CHECK_DEVICE:-cuda}

gpu_reason=""    # empty: a GPU kvreplay can use; else why not (short)
gpu_detail=""    # every reason, for the report's header
backend_line=""  # kvreplay's description of its CUDA backend
failures=()      # checks that ran and failed
declare -A wall prefill decode  # per role (ref: the CPU; dev: $dev2), from capture_on

say() { echo "gpu-check: $*" >&2; }
die() { say "$*"; exit 2; }
have() { command -v "$1" >/dev/null 2>&1; }
out() { printf '%s\n' "$*" >>"$report"; }
skipped() { out "no GPU: skipped ($gpu_reason)"; out ""; }
# sections that need CUDA itself, not only a second device
test_run() {
    [ "$dev2" = cuda ] && return 1
    out "skipped: test run (KVREPLAY_GPU_CHECK_DEVICE=$dev2)"
    out ""
}
# the last lines of a log, fenced
fenced() { out '```'; tail -n "${2:-20}" "$1" >>"$report"; out '```'; }
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }

resolve_bin() {
    if [ -n "${KVREPLAY_BIN:-}" ]; then
        [ -x "$KVREPLAY_BIN" ] || die "KVREPLAY_BIN=$KVREPLAY_BIN is not an executable file"
        bin=$(realpath -- "$KVREPLAY_BIN")
    elif have cargo; then
        say "building kvreplay (cargo build --release)"
        cargo build --release >&2
        bin=$(realpath -- "${CARGO_TARGET_DIR:-target}/release/kvreplay")
    else
        die "no kvreplay binary: set KVREPLAY_BIN to a prebuilt one, or install Rust (cargo) to build it"
    fi
}

# kvreplay loads libnvrtc and libcublas with dlopen: where the CUDA toolkit
# (or PyTorch's pip wheels) put them outside the loader's search path, add
# their folders to LD_LIBRARY_PATH.
find_cuda_libs() {
    if ldconfig -p 2>/dev/null | grep -q 'libnvrtc\.so'; then return; fi
    local dirs
    dirs=$(find /usr/local/cuda*/lib64 /usr/local/cuda*/targets/*/lib /opt /usr/lib/python3* \
        -maxdepth 6 \( -name 'libnvrtc.so.1[23]' -o -name 'libcublas.so.1[23]' \) 2>/dev/null |
        xargs -r -n1 dirname | sort -u | tr '\n' ':')
    if [ -n "$dirs" ]; then
        export LD_LIBRARY_PATH="${dirs}${LD_LIBRARY_PATH:-}"
        say "CUDA libraries found outside the loader's path: LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    fi
}

# Sets gpu_reason (empty when kvreplay can compute on a GPU) and backend_line.
detect_gpu() {
    find_cuda_libs
    local why=() log="$work/probe.log"
    if [ "$dev2" != cuda ]; then
        backend_line="test run: $dev2 in place of cuda"
        return
    fi
    if ! have nvidia-smi; then
        why+=("nvidia-smi not found")
    elif ! nvidia-smi -L >"$work/nvidia-smi-L.txt" 2>&1; then
        why+=("nvidia-smi failed: $(head -n 1 "$work/nvidia-smi-L.txt")")
    fi
    # kvreplay's own answer: replay the tiny golden trace on CUDA
    if "$bin" replay --trace replay/tests/golden/tiny.kvtrace --policy full --budget 4 \
        --device cuda --out "$work/probe" --force >"$log" 2>&1; then
        backend_line=$(sed -n 's/^device: //p' "$log" | head -n 1)
    else
        why+=("kvreplay cannot open CUDA: $(grep -m 1 'error' "$log" | sed 's/^error: //' || true)")
    fi
    gpu_reason=${why[0]:-}
    gpu_detail=$(IFS=';'; echo "${why[*]:-}" | sed 's/;/; /g')
}

section_header() {
    cat >"$report" <<EOF
# kvreplay GPU check

$(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $("$bin" --version).
Host: $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n 1), $(nproc) threads, $(awk '/MemTotal/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo).
Produced by \`scripts/gpu-check.sh\`; traces and logs in \`$work\`.
${gpu_detail:+
No GPU: $gpu_detail.
}
EOF
}

# a. the GPU
section_gpu() {
    out "## a. GPU"
    out ""
    if [ -n "$gpu_reason" ]; then skipped; return; fi
    if test_run; then return; fi
    local q cuda
    q=$(nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>/dev/null ||
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader)
    cuda=$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -n 1)
    out "| GPU | driver | memory | compute capability |"
    out "|---|---|---|---|"
    while IFS=, read -r name driver mem cap; do
        out "| $name | $driver |$mem |${cap:- ?} |"
    done <<<"$q"
    out ""
    out "CUDA version (driver): ${cuda:-unknown}. kvreplay backend: \`$backend_line\`."
    out ""
}

# b. the parity suite
section_parity() {
    out "## b. Kernel parity (CUDA against the f64 reference)"
    out ""
    if [ -n "$gpu_reason" ]; then skipped; return; fi
    if test_run; then return; fi
    local cmd log="$work/parity.log"
    if [ -n "${KVREPLAY_PARITY_BIN:-}" ]; then
        cmd=("$KVREPLAY_PARITY_BIN" --nocapture)
    elif have cargo; then
        cmd=(cargo test -p kvreplay-kernels --release --test parity -- --nocapture)
    else
        out "cargo not found: parity skipped (set KVREPLAY_PARITY_BIN to a prebuilt parity test binary)"
        out ""
        return
    fi
    say "parity: ${cmd[*]}"
    local status=passed
    "${cmd[@]}" >"$log" 2>&1 || status=FAILED
    [ "$status" = passed ] || failures+=("parity")
    local not_run
    not_run=$(grep -c "CUDA not run" "$log" || true)
    out "\`${cmd[*]}\`: **$status**; $(grep -m 1 '^test result' "$log" || echo 'no test summary'); tests where CUDA did not run: $not_run."
    out ""
    fenced "$log" 30
    out ""
}

# Capture `$task` as role $1 (ref or dev) on device $2 into $3 (decode
# $n_decode); fills wall, prefill and decode of the role.
capture_on() {
    local role=$1 dev=$2 dir=$3 log="$3.log" t0 t1
    say "capture on $dev: $task, decode $n_decode"
    t0=$(now)
    if ! "$bin" capture --model "$model" --task "$task" --decode "$n_decode" --device "$dev" \
        --out "$dir" --force >"$log" 2>&1; then
        return 1
    fi
    t1=$(now)
    wall[$role]=$(secs "$t0" "$t1")
    prefill[$role]=$(sed -n 's/^prefill \([0-9.]*\) tok\/s.*/\1/p' "$log")
    decode[$role]=$(sed -n 's/.*decode \([0-9.]*\) tok\/s.*/\1/p' "$log")
}

# rel_l2_mean of a replay's summary.json
rel_l2() { sed -n 's/^ *"rel_l2_mean": *\([^,]*\),*$/\1/p' "$1/summary.json"; }

# Replay policy $1 at budget $2 of trace $3 on device $4 into $5; prints rel_l2_mean.
replay_one() {
    "$bin" replay --trace "$3" --policy "$1" --budget "$2" --device "$4" --out "$5" --force \
        >"$5.log" 2>&1 || { echo "failed"; return; }
    rel_l2 "$5"
}

# c. CPU against CUDA, end to end
section_end_to_end() {
    out "## c. End to end on $(basename "$model"): CPU against CUDA"
    out ""
    if [ -n "$gpu_reason" ]; then skipped; return; fi
    if [ ! -f "$model" ]; then
        say "$model missing: scripts/fetch-model.sh"
        if ! scripts/fetch-model.sh >"$work/fetch-model.log" 2>&1; then
            out "skipped: the model $model is missing and scripts/fetch-model.sh failed ($(tail -n 1 "$work/fetch-model.log"))"
            out ""
            return
        fi
    fi
    local role dev
    for role in ref dev; do
        dev=cpu
        [ "$role" = ref ] || dev=$dev2
        if ! capture_on "$role" "$dev" "$work/$role.kvtrace"; then
            failures+=("capture --device $dev")
            out "capture --device $dev **FAILED**:"
            fenced "$work/$role.kvtrace.log"
            out ""
            return
        fi
    done
    out "Prompt \`--task $task\` ($(sed -n 's/^wrote .*: \([0-9]*\) prompt.*/\1/p' "$work/ref.kvtrace.log") tokens), greedy decode $n_decode; one capture per device."
    out ""
    out "| device | capture wall s (model load included) | prefill tok/s | decode tok/s |"
    out "|---|---:|---:|---:|"
    out "| cpu | ${wall[ref]} | ${prefill[ref]} | ${decode[ref]} |"
    out "| $dev2 | ${wall[dev]} | ${prefill[dev]} | ${decode[dev]} |"
    out ""
    out "### Traces: $dev2 against cpu"
    out ""
    if have python3; then
        if ! python3 scripts/compare-traces.py "$work/ref.kvtrace" "$work/dev.kvtrace" >>"$report" 2>"$work/compare.log"; then
            failures+=("trace comparison")
            out "**the comparison failed**:"
            fenced "$work/compare.log"
        fi
    else
        out "python3 not found: trace comparison skipped"
    fi
    out ""
    out "### Replays: rel_l2_mean"
    out ""
    out "A: the CPU trace replayed on the CPU; B: the $dev2 trace on the CPU (the capture device's effect); C: the CPU trace replayed on $dev2 (the replay device's effect)."
    out ""
    out "| policy | budget | A | B | C | abs(B-A)/A | abs(C-A)/A |"
    out "|---|---:|---:|---:|---:|---:|---:|"
    local p b a bb c t0 t_cpu=0 t_cuda=0
    for p in "${policies[@]}"; do
        for b in "${budgets[@]}"; do
            t0=$(now)
            a=$(replay_one "$p" "$b" "$work/ref.kvtrace" cpu "$work/r-$p-$b-A")
            t_cpu=$(awk -v s="$t_cpu" -v d="$(secs "$t0" "$(now)")" 'BEGIN { print s + d }')
            bb=$(replay_one "$p" "$b" "$work/dev.kvtrace" cpu "$work/r-$p-$b-B")
            t0=$(now)
            c=$(replay_one "$p" "$b" "$work/ref.kvtrace" "$dev2" "$work/r-$p-$b-C")
            t_cuda=$(awk -v s="$t_cuda" -v d="$(secs "$t0" "$(now)")" 'BEGIN { print s + d }')
            if [ "$a" = failed ] || [ "$bb" = failed ] || [ "$c" = failed ]; then
                failures+=("replay $p B=$b")
            fi
            out "| $p | $b | $a | $bb | $c | $(awk -v a="$a" -v x="$bb" 'BEGIN { if (a + 0 == 0) print "-"; else printf "%.2e", (x > a ? x - a : a - x) / a }') | $(awk -v a="$a" -v x="$c" 'BEGIN { if (a + 0 == 0) print "-"; else printf "%.2e", (x > a ? x - a : a - x) / a }') |"
        done
    done
    out ""
    out "Replay wall time of these ${#policies[@]} x ${#budgets[@]} points (one process each, trace reads included): A on cpu $(printf '%.1f' "$t_cpu") s, C on $dev2 $(printf '%.1f' "$t_cuda") s."
    out ""
}

# d. Gemma 3
section_gemma3() {
    out "## d. Gemma 3"
    out ""
    if ! grep -q '"gemma3"' capture/src/llama.rs 2>/dev/null; then
        out "Gemma 3: skipped (capture does not support the gemma3 architecture yet: issue 14)"
        out ""
        return
    fi
    if [ -n "$gpu_reason" ]; then skipped; return; fi
    if [ -z "${KVREPLAY_GEMMA3_MODEL:-}" ] || [ ! -f "$KVREPLAY_GEMMA3_MODEL" ]; then
        out "Gemma 3: skipped (capture supports gemma3; set KVREPLAY_GEMMA3_MODEL to a Gemma 3 GGUF to check it)"
        out ""
        return
    fi
    local role dev ok=1
    for role in ref dev; do
        dev=cpu
        [ "$role" = ref ] || dev=$dev2
        if ! model=$KVREPLAY_GEMMA3_MODEL capture_on "$role" "$dev" "$work/gemma3-$role.kvtrace"; then
            failures+=("gemma3 capture --device $dev")
            out "capture --device $dev **FAILED**:"
            fenced "$work/gemma3-$role.kvtrace.log"
            ok=0
        fi
    done
    if [ "$ok" = 1 ] && have python3; then
        python3 scripts/compare-traces.py "$work/gemma3-ref.kvtrace" "$work/gemma3-dev.kvtrace" >>"$report" ||
            failures+=("gemma3 trace comparison")
    fi
    out ""
}

# e. compute-sanitizer
section_sanitizer() {
    out "## e. compute-sanitizer"
    out ""
    if [ -n "$gpu_reason" ]; then skipped; return; fi
    if test_run; then return; fi
    local cs
    cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
    if [ -z "$cs" ]; then
        out "compute-sanitizer not found: skipped (it comes with the CUDA toolkit)"
        out ""
        return
    fi
    if [ ! -f "$model" ]; then
        out "skipped: no model at $model (see section c)"
        out ""
        return
    fi
    local tool log status
    for tool in memcheck racecheck; do
        log="$work/sanitizer-$tool.log"
        say "compute-sanitizer --tool $tool"
        status=clean
        "$cs" --tool "$tool" --error-exitcode 99 "$bin" capture --model "$model" --device cuda \
            --prompt "The quick brown fox jumps over the lazy dog. A short prompt keeps the sanitizer fast." \
            --decode 4 --out "$work/sanitizer-$tool.kvtrace" --force >"$log" 2>&1 || status=FAILED
        [ "$status" = clean ] || failures+=("compute-sanitizer $tool")
        out "- \`--tool $tool\` on a short \`capture --device cuda\`: **$status**; $(grep -m 1 'ERROR SUMMARY\|RACECHECK SUMMARY' "$log" || echo 'no summary line')"
        [ "$status" = clean ] || fenced "$log" 40
    done
    out ""
}

# f. capture throughput on each device
section_bench() {
    out "## f. Capture throughput"
    out ""
    if [ -n "$gpu_reason" ]; then skipped; return; fi
    if [ -z "${wall[dev]:-}" ]; then
        out "skipped: the captures of section c did not run"
        out ""
        return
    fi
    if "$bin" bench capture --help 2>/dev/null | grep -q -- '--device'; then
        local dev
        for dev in cpu "$dev2"; do
            say "kvreplay bench capture --device $dev"
            out "### \`kvreplay bench capture --device $dev --prompt-tokens 2048 --decode 64 --reps $reps\`"
            out '```'
            "$bin" bench capture --device "$dev" --prompt-tokens 2048 --decode 64 --reps "$reps" >>"$report" 2>&1 ||
                failures+=("bench capture --device $dev")
            out '```'
        done
        out ""
        return
    fi
    # `kvreplay bench` has no --device: time the capture of section c, $reps times per device
    out "\`kvreplay bench\` takes no \`--device\`: the capture of section c (\`--task $task --decode $n_decode\`), $reps times per device; medians."
    out ""
    out "| device | wall s | prefill tok/s | decode tok/s |"
    out "|---|---:|---:|---:|"
    local role dev i w=() pf=() dc=()
    median() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
    for role in ref dev; do
        dev=cpu
        [ "$role" = ref ] || dev=$dev2
        w=() pf=() dc=()
        for ((i = 0; i < reps; i++)); do
            capture_on "$role" "$dev" "$work/bench-$role.kvtrace" || { failures+=("bench capture $dev"); break; }
            w+=("${wall[$role]}") pf+=("${prefill[$role]}") dc+=("${decode[$role]}")
        done
        [ "${#w[@]}" -gt 0 ] && out "| $dev | $(median "${w[@]}") | $(median "${pf[@]}") | $(median "${dc[@]}") |"
    done
    out ""
}

section_summary() {
    out "## Summary"
    out ""
    if [ -n "$gpu_reason" ]; then
        out "No GPU here ($gpu_reason): every device check was skipped."
    elif [ "${#failures[@]}" -eq 0 ]; then
        out "Every check that ran passed."
    else
        out "**Failed:** $(IFS=,; echo "${failures[*]}" | sed 's/,/, /g')."
    fi
}

main() {
    resolve_bin
    detect_gpu
    if [ -n "$gpu_reason" ]; then say "no GPU: $gpu_reason"; else say "GPU: $backend_line"; fi
    section_header
    section_gpu
    section_parity
    section_end_to_end
    section_gemma3
    section_sanitizer
    section_bench
    section_summary
    say "wrote $report"
    [ "${#failures[@]}" -eq 0 ]
}

main
