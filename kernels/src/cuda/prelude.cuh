// Prepended to every kernel source. Header-free on purpose: NVRTC 12 cannot
// include <cuda_fp16.h>, so f16/bf16 are converted with PTX and bit shifts.
// Sources are compiled with --fmad=false so a*b+c rounds twice, as on the CPU.
typedef unsigned char u8;
typedef unsigned short u16;
typedef long long i64;

// BLOCK, the thread count of every block-reduction kernel, is defined once in
// Rust (kvreplay_kernels::BLOCK) and passed to NVRTC as -DBLOCK=...
#ifndef BLOCK
#error "BLOCK is not defined: compile through kvreplay_kernels::cuda::nvrtc::compile"
#endif
#ifndef KEY_SPLIT
#error "KEY_SPLIT is not defined: compile through kvreplay_kernels::cuda::nvrtc::compile"
#endif
#define INFINITY __int_as_float(0x7f800000)

__device__ __forceinline__ float h2f(u16 h) {
#ifdef KVREPLAY_EMU  // the CPU emulation (kernels/emu/cuda_emu.h): a portable exact conversion
    return kvemu_h2f(h);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}
__device__ __forceinline__ float bf2f(u16 b) { return __uint_as_float(((unsigned int)b) << 16); }
__device__ __forceinline__ u16 ld16(const u8* p) { return (u16)p[0] | ((u16)p[1] << 8); }
__device__ __forceinline__ unsigned int ld32(const u8* p) {
    return (unsigned int)p[0] | ((unsigned int)p[1] << 8) | ((unsigned int)p[2] << 16) |
           ((unsigned int)p[3] << 24);
}
__device__ __forceinline__ float f16_at(const u8* p) { return h2f(ld16(p)); }
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
