#!/usr/bin/env bash
# The machine's f32 multiply-add peak: one process per core, each running
# eight independent chains of 256-bit fused multiply-adds (AVX2 + FMA), so
# the FMA pipes, not the latency of one chain, bound the rate. Prints each
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
int main(void) {
    __m256 a0 = _mm256_set1_ps(1.0f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    const __m256 b = _mm256_set1_ps(0.9999999f), c = _mm256_set1_ps(1e-7f);
    const long n = 400000000;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long k = 0; k < n; k++) {
        a0 = _mm256_fmadd_ps(a0, b, c); a1 = _mm256_fmadd_ps(a1, b, c);
        a2 = _mm256_fmadd_ps(a2, b, c); a3 = _mm256_fmadd_ps(a3, b, c);
        a4 = _mm256_fmadd_ps(a4, b, c); a5 = _mm256_fmadd_ps(a5, b, c);
        a6 = _mm256_fmadd_ps(a6, b, c); a7 = _mm256_fmadd_ps(a7, b, c);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double s = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
    __m256 r = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                             _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    /* the result is printed so the loop is not removed */
    printf("%.2f GFLOP/s (checksum %.3f)\n", n * 8.0 * 16.0 / s / 1e9, _mm256_cvtss_f32(r));
    return 0;
}
C
cc -O2 -mavx2 -mfma "$dir/peak.c" -o "$dir/peak"
for i in $(seq "$n"); do "$dir/peak" > "$dir/out.$i" & done
wait
cat "$dir"/out.*
awk '{s += $1} END {printf "sum over %d processes: %.1f GFLOP/s\n", NR, s}' "$dir"/out.*
