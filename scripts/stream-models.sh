#!/usr/bin/env bash
# C models of decode's memory streams, for BENCHMARKS.md (tenth session,
# redone): what the kernels' loops could reach on this machine, without the
# rest of a decode step.
#   stream  a plain sum over 96 MB of f32 (four 256-bit loads per step), on
#           one thread and on two: the rate the cores stream memory;
#   panels  decode's scores over 48 MB of key panels (d = 64, panels of 8
#           keys, 3 query rows, tiles of 4 or 1 panels), two threads, tasks of
#           128 or 4,096 panels, with and without a prefetch 8 KB ahead;
#   q4_1    the Q4_1 dot product (k = 576) of the fused kernel, as the file
#           holds it (20-byte blocks) and with f32 scales (24 bytes), one
#           thread, over 1,536 rows (in cache) and 200,000 rows (from memory,
#           with a prefetch 2 rows ahead).
# Needs gcc with OpenMP (Debian's gcc). Usage: scripts/stream-models.sh
set -euo pipefail
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cat > "$dir/stream.c" <<'C'
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(void) {
    size_t n = (size_t)24 << 20; /* floats: 96 MB */
    float *a = aligned_alloc(64, n * 4);
    for (size_t i = 0; i < n; i++) a[i] = (float)(i % 1000);
    for (int th = 1; th <= 2; th++) {
        double best = 1e9; float sink = 0;
        for (int r = 0; r < 10; r++) {
            double t = now();
#pragma omp parallel num_threads(th) reduction(+:sink)
            {
                int id = omp_get_thread_num();
                size_t lo = n * id / th, hi = n * (id + 1) / th;
                __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
                for (size_t i = lo; i < hi; i += 32) {
                    s0 = _mm256_add_ps(s0, _mm256_load_ps(a + i));
                    s1 = _mm256_add_ps(s1, _mm256_load_ps(a + i + 8));
                    s2 = _mm256_add_ps(s2, _mm256_load_ps(a + i + 16));
                    s3 = _mm256_add_ps(s3, _mm256_load_ps(a + i + 24));
                }
                float f[8];
                _mm256_storeu_ps(f, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
                sink += f[0];
            }
            t = now() - t;
            if (t < best) best = t;
        }
        printf("stream: %d thread(s): %.1f GB/s (best of 10; %g)\n", th, n * 4 / best / 1e9, sink);
    }
    return 0;
}
C
cat > "$dir/panels.c" <<'C'
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
    int P = atoi(argv[1]), chunk = atoi(argv[2]), pf = atoi(argv[3]);
    size_t n = (size_t)12 << 20; /* floats: 48 MB of panels (d = 64, 8 keys: 512 floats) */
    float *a = aligned_alloc(64, n * 4 + 65536);
    for (size_t i = 0; i < n; i++) a[i] = (i % 7) * 0.1f;
    float q[3 * 64];
    for (int i = 0; i < 192; i++) q[i] = i * 0.01f;
    size_t npan = n / 512;
    double best = 1e9; float sink = 0;
    for (int r = 0; r < 8; r++) {
        double t = now();
#pragma omp parallel for num_threads(2) schedule(dynamic, 1) reduction(+:sink)
        for (size_t c = 0; c < npan; c += chunk) {
            size_t ce = c + chunk < npan ? c + chunk : npan;
            for (size_t p0 = c; p0 < ce; p0 += P) {
                __m256 acc[3][4];
                for (int i = 0; i < 3; i++) for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_ps();
                const float *kp = a + p0 * 512;
                for (int t = 0; t < 64; t++) {
                    if (pf && (t & 1) == 0)
                        for (int j = 0; j < P; j++) _mm_prefetch((const char *)(kp + j * 512 + t * 8 + pf), _MM_HINT_T0);
                    __m256 b[4];
                    for (int j = 0; j < P; j++) b[j] = _mm256_load_ps(kp + (j * 64 + t) * 8);
                    for (int i = 0; i < 3; i++) {
                        __m256 x = _mm256_set1_ps(q[i * 64 + t]);
                        for (int j = 0; j < P; j++) acc[i][j] = _mm256_fmadd_ps(x, b[j], acc[i][j]);
                    }
                }
                for (int i = 0; i < 3; i++) for (int j = 0; j < P; j++) { float f[8]; _mm256_storeu_ps(f, acc[i][j]); sink += f[0]; }
            }
        }
        t = now() - t;
        if (t < best) best = t;
    }
    printf("panels: tiles of %d, tasks of %d panels, prefetch %d floats ahead: %.1f GB/s (%g)\n", P, chunk, pf, n * 4 / best / 1e9, sink);
    return 0;
}
C
cat > "$dir/q41.c" <<'C'
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static inline float hsum(__m256 a) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
static inline float f16(const uint8_t *p) { uint16_t b; memcpy(&b, p, 2); return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(b))); }
/* held: 0 = the file's 20-byte blocks (f16 d, m), 1 = 24-byte blocks (f32 d, m) */
static inline __attribute__((always_inline)) float dot(int held, const uint8_t *row, int nb, const float *x, const float *xs) {
    __m256i m15 = _mm256_set1_epi32(15);
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    int bb = held ? 24 : 20, qo = held ? 8 : 4;
    for (int b = 0; b < nb; b++) {
        const uint8_t *p = row + bb * b;
        __m256 d = held ? _mm256_broadcast_ss((const float *)p) : _mm256_set1_ps(f16(p));
        __m256 mn = held ? _mm256_broadcast_ss((const float *)(p + 4)) : _mm256_set1_ps(f16(p + 2));
        __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const void *)(p + qo)));
        __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const void *)(p + qo + 8)));
        const float *xb = x + 32 * b;
        __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(lo, m15)), _mm256_loadu_ps(xb));
        s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(hi, m15)), _mm256_loadu_ps(xb + 8), s);
        s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4)), _mm256_loadu_ps(xb + 16), s);
        s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4)), _mm256_loadu_ps(xb + 24), s);
        acc = _mm256_fmadd_ps(d, s, acc);
        accm = _mm256_fmadd_ps(mn, _mm256_loadu_ps(xs + 8 * b), accm);
    }
    return hsum(_mm256_add_ps(acc, accm));
}
int main(int argc, char **argv) {
    int rows = atoi(argv[1]), reps = atoi(argv[2]), pf = atoi(argv[3]), k = 576, nb = k / 32;
    float *x = malloc(k * 4), *xs = malloc(k), *out = malloc(rows * 4);
    for (int i = 0; i < k; i++) x[i] = i * 0.001f;
    for (int i = 0; i < k / 4; i++) xs[i] = 1;
    for (int held = 0; held < 2; held++) {
        int bb = held ? 24 : 20;
        uint8_t *w = malloc((size_t)(rows + 64) * nb * bb);
        for (size_t i = 0; i < (size_t)(rows + 64) * nb * bb; i++) w[i] = rand();
        for (size_t i = 0; i < (size_t)(rows + 64) * nb; i++) {
            if (held) { float one = 1.0f; memcpy(w + bb * i, &one, 4); memcpy(w + bb * i + 4, &one, 4); }
            else { uint16_t one = 0x3c00; memcpy(w + bb * i, &one, 2); memcpy(w + bb * i + 2, &one, 2); }
        }
        double best = 1e9;
        for (int r = 0; r < reps; r++) {
            double t = now();
            for (int i = 0; i < rows; i++) {
                const uint8_t *ahead = w + (size_t)bb * nb * (i + pf);
                for (int l = 0; pf && l < bb * nb; l += 64) _mm_prefetch((const char *)ahead + l, _MM_HINT_T0);
                const uint8_t *row = w + (size_t)bb * nb * i;
                out[i] = held ? dot(1, row, nb, x, xs) : dot(0, row, nb, x, xs);
            }
            t = now() - t;
            if (t < best) best = t;
        }
        printf("q4_1 %s blocks, %d rows: %.2f ns per block (%.1f GB/s; %g)\n", held ? "24-byte" : "20-byte",
               rows, best * 1e9 / rows / nb, (double)rows * nb * bb / best / 1e9, out[rows / 2]);
        free(w);
    }
    return 0;
}
C
for p in stream panels q41; do
    gcc -O3 -mavx2 -mfma -mf16c -fopenmp -o "$dir/$p" "$dir/$p.c"
done
"$dir/stream"
for tiles in 4 1; do
    for tasks in 128 4096; do
        for pf in 0 2048; do "$dir/panels" "$tiles" "$tasks" "$pf"; done
    done
done
"$dir/q41" 1536 300 0
"$dir/q41" 200000 5 2
