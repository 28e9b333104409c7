// Prepended to every kernel source. Header-free on purpose (NVRTC 12 cannot
// include the CUDA headers). Sources are compiled with --fmad=false so a*b+c
// rounds twice, as on the CPU.
typedef long long i64;

// BLOCK, the thread count of every block-reduction kernel, is defined once in
// Rust (kvreplay_kernels::BLOCK) and passed to NVRTC as -DBLOCK=...
#ifndef BLOCK
#error "BLOCK is not defined: compile through kvreplay_kernels::cuda::nvrtc::compile"
#endif
#ifndef KEY_SPLIT
#error "KEY_SPLIT is not defined: compile through kvreplay_kernels::cuda::nvrtc::compile"
#endif
#ifndef ATTN_ROWS
#error "ATTN_ROWS is not defined: compile through kvreplay_kernels::cuda::nvrtc::compile"
#endif
#define INFINITY __int_as_float(0x7f800000)

__device__ __forceinline__ i64 global_id() { return (i64)blockIdx.x * blockDim.x + threadIdx.x; }

// e^x with the operations and constants (bit patterns) of the CPU's
// kvreplay_kernels::cpu::simd::exp, so the gated activations agree bit for
// bit: Cody-Waite reduction (two fused steps), Cephes' polynomial with fused
// multiply-adds, 2^n from the exponent bits; subnormal results flush to 0.
__device__ __forceinline__ float kv_exp(float x) {
    const float lo = __int_as_float(0xc2aeac50), hi = __int_as_float(0x42b0c0a5);
    float xc = fminf(fmaxf(x, lo), hi);
    float n = rintf(xc * __int_as_float(0x3fb8aa3b));
    float r = fmaf(n, __int_as_float(0xbf318000), xc);
    r = fmaf(n, __int_as_float(0x395e8083), r);
    float p = __int_as_float(0x39506967);
    p = fmaf(p, r, __int_as_float(0x3ab743ce));
    p = fmaf(p, r, __int_as_float(0x3c088908));
    p = fmaf(p, r, __int_as_float(0x3d2aa9c1));
    p = fmaf(p, r, __int_as_float(0x3e2aaaaa));
    p = fmaf(p, r, 0.5f);
    float e = fmaf(p, r * r, r) + 1.0f;
    float y = e * __int_as_float(((int)n + 127) << 23);
    if (!(x >= lo)) y = 0.0f;
    if (!(hi >= x)) y = INFINITY;
    if (!(x >= x)) y = x;
    return y;
}

// Fixed-shape tree reductions over a BLOCK-thread block: the order of
// additions depends only on BLOCK, so results are deterministic.
__device__ float block_max(float v, float* sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int s = BLOCK / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sh[threadIdx.x] = fmaxf(sh[threadIdx.x], sh[threadIdx.x + s]);
        __syncthreads();
    }
    float r = sh[0];
    __syncthreads();
    return r;
}
__device__ double block_sum(double v, double* sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int s = BLOCK / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
        __syncthreads();
    }
    double r = sh[0];
    __syncthreads();
    return r;
}
// Dot product of two d-vectors in one thread, in index order.
__device__ __forceinline__ float dot_seq(const float* a, const float* b, int d) {
    float acc = 0.0f;
    for (int t = 0; t < d; ++t) acc += a[t] * b[t];
    return acc;
}
