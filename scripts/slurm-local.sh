#!/usr/bin/env bash
# A real Slurm test of kvreplay's scale-out path, on a one-node cluster on
# this machine:
#   1. installs slurm-wlm and munge from the Debian packages (apt-get) if missing;
#   2. configures slurmctld + slurmd on localhost (its own ports, state and logs
#      under a temporary folder; a `debug` partition with this machine's cores
#      and memory; proctrack/linuxproc, task/none, no cgroups) and starts them;
#   3. captures a small pass-key suite with the real model and writes a sweep file;
#   4. runs the sweep unsharded, then as the job array `kvreplay slurm` writes
#      (4 shards, --shard auto/4) plus its dependent merge job
#      (--dependency=afterok), and compares every merged file byte for byte;
#   5. again into a fresh folder, cancels one shard task mid-run: the merge job
#      never runs, `kvreplay merge` fails naming that shard and the rerun, and
#      resubmitting only that shard (plus a duplicate of it, which must be
#      harmless) completes the merge, byte for byte equal to the unsharded run;
#   6. stops the cluster (on any exit).
# Exit status: 0 passed, 77 skipped (the reason is printed), anything else failed.
# Ends with one line: "slurm-local: PASS ...", "slurm-local: SKIPPED: ..." or
# "slurm-local: FAIL: ...". KVREPLAY_SKIP_SLURM=1 skips it.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
start=$(date +%s)

skip() { echo "slurm-local: SKIPPED: $*"; exit 77; }
fail() { echo "slurm-local: FAIL: $*"; exit 1; }
step() { echo "slurm-local: [$(($(date +%s) - start)) s] $*"; }

[ -n "${KVREPLAY_SKIP_SLURM:-}" ] && skip "KVREPLAY_SKIP_SLURM is set"
[ "$(id -u)" = 0 ] || skip "needs root (installs packages, runs slurmctld and slurmd)"

# --- 1. packages ---------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
    || ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
    command -v apt-get >/dev/null || skip "slurm-wlm is not installed and there is no apt-get"
    step "installing slurm-wlm and munge (apt-get)"
    if ! apt-get update -qq >/tmp/kvreplay-slurm-apt.log 2>&1; then
        tail -5 /tmp/kvreplay-slurm-apt.log
        skip "apt-get update failed (no package registry reachable?)"
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge \
        >>/tmp/kvreplay-slurm-apt.log 2>&1 \
        || { tail -20 /tmp/kvreplay-slurm-apt.log; fail "apt-get install slurm-wlm munge failed"; }
fi

K=${CARGO_TARGET_DIR:-$ROOT/target}/release/kvreplay
if [ ! -x "$K" ] || [ -n "${KVREPLAY_SLURM_BUILD:-}" ]; then
    step "building kvreplay"
    cargo build --release -q || fail "cargo build --release failed"
fi
MODEL=$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$MODEL" ] || scripts/fetch-model.sh >/dev/null || fail "no model (scripts/fetch-model.sh failed)"

# --- 2. the cluster ----------------------------------------------------
W=$(mktemp -d /tmp/kvreplay-slurm.XXXXXX)
export SLURM_CONF=$W/etc/slurm.conf
started_munge=
jobs_to_cancel=()
cleanup() {
    local rc=$?
    set +e
    for j in "${jobs_to_cancel[@]}"; do scancel "$j" 2>/dev/null; done
    for d in slurmd slurmctld; do
        if [ -f "$W/run/$d.pid" ]; then
            local pid
            pid=$(cat "$W/run/$d.pid")
            kill "$pid" 2>/dev/null
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -9 "$pid" 2>/dev/null
        fi
    done
    if [ -n "$started_munge" ]; then
        kill "$started_munge" 2>/dev/null
    fi
    if [ "$rc" != 0 ] && [ "$rc" != 77 ]; then
        echo "slurm-local: logs of the failed run:"
        for f in "$W"/log/*.log "$W"/merged*/slurm/logs/*.out; do
            [ -f "$f" ] && { echo "--- $f"; tail -15 "$f"; }
        done
    fi
    if [ -z "${KVREPLAY_SLURM_KEEP:-}" ]; then rm -rf "$W"; else echo "slurm-local: kept $W"; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mkdir -p "$W"/etc "$W"/run "$W"/log "$W"/spool/ctld "$W"/spool/d
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    step "starting munged"
    [ -f /etc/munge/munge.key ] || { mungekey --create 2>/dev/null || /usr/sbin/create-munge-key -f; } \
        || fail "could not create /etc/munge/munge.key"
    install -d -o munge -g munge -m 0755 /run/munge
    chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
    runuser -u munge -- /usr/sbin/munged || fail "munged did not start"
    started_munge=$(cat /run/munge/munged.pid 2>/dev/null)
    munge -n | unmunge >/dev/null || fail "munge does not work after starting munged"
fi

node=$(slurmd -C | head -1)    # NodeName=... CPUs=... RealMemory=... (this machine)
host=$(hostname -s)
cat >"$SLURM_CONF" <<EOF
ClusterName=kvreplaytest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
DependencyParameters=kill_invalid_depend
MinJobAge=3600
ReturnToService=2
StateSaveLocation=$W/spool/ctld
SlurmdSpoolDir=$W/spool/d
SlurmctldPidFile=$W/run/slurmctld.pid
SlurmdPidFile=$W/run/slurmd.pid
SlurmctldLogFile=$W/log/slurmctld.log
SlurmdLogFile=$W/log/slurmd.log
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
step "starting slurmctld and slurmd ($node)"
slurmctld -f "$SLURM_CONF" || fail "slurmctld did not start"
slurmd -f "$SLURM_CONF" || fail "slurmd did not start"
for _ in $(seq 100); do
    sinfo -h -o %T 2>/dev/null | grep -qx idle && break
    sleep 0.2
done
sinfo -h -o %T | grep -qx idle || { sinfo; fail "the node did not become idle"; }

# --- helpers -------------------------------------------------------------
job_state() { # JOBID -> the states of the job (or of each array task), one a line
    scontrol -o show job "$1" 2>/dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p'
}
wait_jobs() { # JOBID... : until none is pending or running (at most 20 minutes)
    local deadline=$(($(date +%s) + 1200))
    while [ "$(date +%s)" -lt "$deadline" ]; do
        local busy=
        for j in "$@"; do
            job_state "$j" | grep -qE 'PENDING|RUNNING|CONFIGURING|COMPLETING|REQUEUED' && busy=1
        done
        [ -z "$busy" ] && return 0
        sleep 1
    done
    squeue
    fail "jobs $* still running after 20 minutes"
}
same_files() { # DIR DIR : the merged sweep equals the unsharded one, byte for byte
    local f n=0
    for f in results.csv summary.csv summary.tex report.html error_vs_budget.svg error_vs_memory.svg \
        retention_by_position.svg layer_error_heatmap.svg needle_retention.svg failed.csv; do
        # failed.csv exists only when some point failed: then in both
        if [ "$f" = failed.csv ] && [ ! -f "$1/$f" ] && [ ! -f "$2/$f" ]; then continue; fi
        [ -f "$1/$f" ] && [ -f "$2/$f" ] || { echo "$f is missing from $1 or $2"; return 1; }
        cmp -s "$1/$f" "$2/$f" || { echo "$2/$f differs from $1/$f"; return 1; }
        n=$((n + 1))
    done
    echo "$n files"
}
submit() { # OUTPUT of submit.sh -> sets SHARDS and MERGE
    SHARDS=$(sed -n 's/^shards=\([0-9]*\) merge=.*/\1/p' <<<"$1")
    MERGE=$(sed -n 's/.* merge=\([0-9]*\)$/\1/p' <<<"$1")
    [ -n "$SHARDS" ] && [ -n "$MERGE" ] || fail "unexpected submit.sh output: $1"
    jobs_to_cancel+=("$SHARDS" "$MERGE")
}

# --- 3. traces and the sweep file --------------------------------------
# A small pass-key suite shaped like the default one (four lengths, needle
# depths 0.1-0.9) but shorter, so that the whole test takes a few minutes on
# two cores: 256-1,024 tokens + 8 decode tokens.
step "capturing 4 pass-key traces"
mkdir -p "$W/traces"
for spec in 256:0.1 384:0.4 512:0.6 1024:0.9; do
    len=${spec%%:*} depth=${spec#*:}
    name=$(printf "passkey-%04d-d%02d.kvtrace" "$len" "$(awk "BEGIN { print int($depth * 100 + 0.5) }")")
    "$K" capture --model "$MODEL" --task "passkey:length=$len,depth=$depth" --chat --decode 8 \
        --device cpu --out "$W/traces/$name" >"$W/log/capture-$name.log" 2>&1 \
        || { cat "$W/log/capture-$name.log"; fail "capture of $name failed"; }
done
cat >"$W/sweep.toml" <<EOF
traces = ["$W/traces"]
policies = ["h2o", "snapkv", "streaming_llm", "tova", "knorm", "d2o"]
budgets = [32, 64, 128]
EOF

step "unsharded sweep"
"$K" sweep --file "$W/sweep.toml" --out "$W/one" >"$W/log/one.log" 2>&1 \
    || { cat "$W/log/one.log"; fail "the unsharded sweep failed"; }
points=$(($(wc -l <"$W/one/summary.csv") - 1))
[ "$points" = 72 ] || fail "the unsharded sweep has $points points, not 72"

# --- 4. the array and the dependent merge --------------------------------
step "kvreplay slurm: 4 shards + merge"
"$K" slurm --file "$W/sweep.toml" --shards 4 --out "$W/merged" | tee "$W/log/slurm.log" \
    || fail "kvreplay slurm failed"
out=$("$W/merged/slurm/submit.sh") || fail "submit.sh failed: $out"
submit "$out"
step "submitted: array job $SHARDS, merge job $MERGE (afterok:$SHARDS)"
wait_jobs "$SHARDS" "$MERGE"
states=$(job_state "$SHARDS" | sort | uniq -c | xargs)
[ "$(job_state "$SHARDS" | grep -c COMPLETED)" = 4 ] || fail "array tasks: $states"
[ "$(job_state "$MERGE")" = COMPLETED ] || fail "merge job: $(job_state "$MERGE")"
grep -q "running shard 2/4 (from SLURM_ARRAY_TASK_ID=2, 4 shards given)" \
    "$W"/merged/slurm/logs/shard-2-*.out || fail "shard 2's log does not say which shard it ran"
n=$(same_files "$W/one" "$W/merged") || fail "$n"
step "array ($states) and merge COMPLETED; merged = unsharded, byte for byte ($n)"

# --- 5. a shard cancelled mid-run, then resubmitted alone -----------------
step "again, cancelling one shard mid-run"
"$K" slurm --file "$W/sweep.toml" --shards 4 --out "$W/merged2" >/dev/null || fail "kvreplay slurm failed"
killed=
for victim in 3 2 1 0; do
    # a fresh start (a previous try's merge may have run): all but the job scripts
    find "$W/merged2" -mindepth 1 -maxdepth 1 ! -name slurm -exec rm -rf {} +
    out=$("$W/merged2/slurm/submit.sh") || fail "submit.sh failed: $out"
    submit "$out"
    total=
    deadline=$(($(date +%s) + 600))
    while [ "$(date +%s)" -lt "$deadline" ]; do
        rec="$W/merged2/shards/$victim/shard-$victim-of-4.json"
        done_now=$(find "$W/merged2/shards/$victim/points" -name '[0-9a-f]*.json' 2>/dev/null | wc -l)
        [ -f "$rec" ] && total=$(sed -n 's/.*"points": \([0-9]*\).*/\1/p' "$rec")
        if [ -n "$total" ] && [ "$done_now" -ge 1 ]; then break; fi
        [ "$(job_state "${SHARDS}_$victim")" = COMPLETED ] && break
        sleep 0.1
    done
    scancel "${SHARDS}_$victim"
    wait_jobs "$SHARDS" "$MERGE"
    done_now=$(find "$W/merged2/shards/$victim/points" -name '[0-9a-f]*.json' | wc -l)
    if [ "$(job_state "${SHARDS}_$victim")" = CANCELLED ] && [ "$done_now" -lt "$total" ]; then
        killed=$victim
        break
    fi
    step "shard $victim finished before it could be cancelled; trying another"
    scancel "$MERGE" 2>/dev/null
done
[ -n "$killed" ] || fail "no shard could be cancelled mid-run"
step "cancelled shard $killed after $done_now of its $total points"
ms=$(job_state "$MERGE")
[ "$ms" = CANCELLED ] || [ "$ms" = PENDING ] || fail "the merge job ran although shard $killed failed: $ms"
scancel "$MERGE" 2>/dev/null
[ ! -f "$W/merged2/report.html" ] || fail "a report was written although a shard failed"
if "$K" merge "$W"/merged2/shards/*/ --out "$W/merged2" >"$W/log/merge2.log" 2>&1; then
    fail "merge succeeded with shard $killed incomplete"
fi
grep -q "shard $killed/4: $((total - done_now)) of its $total points missing" "$W/log/merge2.log" \
    || { cat "$W/log/merge2.log"; fail "merge does not name the incomplete shard"; }
grep -q "merged2/slurm/submit.sh $killed" "$W/log/merge2.log" \
    || { cat "$W/log/merge2.log"; fail "merge does not say how to resubmit it"; }
step "merge refused: $(grep -m1 'points are missing' "$W/log/merge2.log" | sed 's/^Error: //')"

out=$("$W/merged2/slurm/submit.sh" "$killed") || fail "submit.sh $killed failed: $out"
submit "$out"
# a duplicate of the same shard at the same time (a requeued or doubly submitted task)
dup=$(sbatch --parsable --array="$killed" "$W/merged2/slurm/shards.sbatch") || fail "sbatch of the duplicate failed"
dup=${dup%%;*}
jobs_to_cancel+=("$dup")
step "resubmitted shard $killed: job $SHARDS, merge $MERGE; duplicate task $dup"
wait_jobs "$SHARDS" "$MERGE" "$dup"
[ "$(job_state "$SHARDS")" = COMPLETED ] || fail "resubmitted shard: $(job_state "$SHARDS")"
[ "$(job_state "$dup")" = COMPLETED ] || fail "duplicate shard task: $(job_state "$dup")"
[ "$(job_state "$MERGE")" = COMPLETED ] || fail "merge job after the resubmission: $(job_state "$MERGE")"
n=$(same_files "$W/one" "$W/merged2") || fail "$n"
step "resubmitted shard, its duplicate and the merge COMPLETED; merged = unsharded, byte for byte ($n)"

echo "slurm-local: PASS in $(($(date +%s) - start)) s (4-shard array + afterok merge equal to the unsharded sweep of $points points; shard $killed cancelled mid-run, merge refused naming it, resubmitted alone with a duplicate, merge equal)"
