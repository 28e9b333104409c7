#!/usr/bin/env bash
# The machine's f32 multiply-add peak: one process per core, each running
# twelve independent chains of 256-bit fused multiply-adds (AVX2 + FMA), so
# the FMA pipes, not the latency of one chain, bound the rate (two pipes of
# 4-cycle latency need 8 chains in flight; 12 leave a margin and still fit
# the 16 registers with the two constants). Prints each
# process's GFLOP/s (2 flops x 8 lanes per instruction) and their sum.
# BENCHMARKS.md compares the kernels' rates with it.
# Usage: scripts/fma-peak.sh [processes (default: the CPU count)]
set -euo pipefail
n=${1:-$(nproc)}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cat > "$dir/peak.c" <<'C'
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
#define CHAINS 12
int main(void) {
    /* Distinct starting values: chains that start equal and take the same
       steps are one chain to the compiler, which then computes it once. */
    __m256 a[CHAINS];
    for (int i = 0; i < CHAINS; i++) a[i] = _mm256_set1_ps(1.0f + 0.001f * i);
    const __m256 b = _mm256_set1_ps(0.9999999f), c = _mm256_set1_ps(1e-7f);
    const long n = 200000000;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long k = 0; k < n; k++) {
#define STEP(i) a[i] = _mm256_fmadd_ps(a[i], b, c);
        STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5)
        STEP(6) STEP(7) STEP(8) STEP(9) STEP(10) STEP(11)
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double s = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
    __m256 r = a[0];
    for (int i = 1; i < CHAINS; i++) r = _mm256_add_ps(r, a[i]);
    /* the result is printed so the loop is not removed */
    printf("%.2f GFLOP/s (checksum %.3f)\n", n * CHAINS * 16.0 / s / 1e9, _mm256_cvtss_f32(r));
    return 0;
}
C
cc -O2 -mavx2 -mfma "$dir/peak.c" -o "$dir/peak"
# Guard against the compiler merging chains again: the program must hold 12
# FMAs (checked where objdump is installed).
if command -v objdump >/dev/null; then
    fmas=$(objdump -d "$dir/peak" | grep -c vfmadd || true)
    [ "$fmas" -ge 12 ] || echo "warning: the program holds $fmas FMAs, not 12: chains were merged" >&2
fi
for i in $(seq "$n"); do "$dir/peak" > "$dir/out.$i" & done
wait
cat "$dir"/out.*
awk '{s += $1} END {printf "sum over %d processes: %.1f GFLOP/s\n", NR, s}' "$dir"/out.*
