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
