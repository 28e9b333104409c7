// A small emulation of the CUDA execution model on the CPU, so the unmodified
// kernel sources (kernels/src/cuda/*.cu, prelude.cuh) compile with a C++17
// compiler and run under AddressSanitizer and ThreadSanitizer.
// Used by kernels/emu/driver.cpp, built by kernels/tests/emulated.rs.
//
// Model:
// - every thread of a block is a real OS thread (std::thread), so a missing
//   __syncthreads() is a data race that TSan reports (and results go wrong);
// - __syncthreads() is a generation barrier on a std::mutex and a
//   std::condition_variable (TSan understands both); every thread of a block
//   must reach the same __syncthreads() (same file and line), and no thread may
//   exit while others wait at one: both are reported as a divergent barrier;
// - blocks of a grid run one at a time, in order (x fastest, then y, then z):
//   all threads of a block are joined before the next block starts;
// - __shared__ variables are `static`: one instance for the whole program.
//   That is correct because exactly one block is alive at any time, so the
//   single instance is that block's shared memory; the join between blocks
//   orders one block's accesses before the next block's. (Unlike a GPU, a
//   block starts with the previous block's shared values, zero for the first:
//   reads of uninitialised shared memory are not detected.)
// - threadIdx, blockIdx, blockDim and gridDim are thread_local.
//
// Not emulated: warps (no lock-step execution, no warp intrinsics), the GPU
// memory model beyond "a barrier orders a block's accesses", dynamic
// (extern) shared memory, and GPU math (expf, exp, sqrt are the host libm's;
// products are not fused: build with -ffp-contract=off, as NVRTC gets
// --fmad=false).
#pragma once

#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#define KVREPLAY_EMU 1

// prelude.cuh defines INFINITY itself (NVRTC has no <math.h>).
#undef INFINITY

#define __global__
#define __device__ static
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __syncthreads() kvemu::syncthreads(__FILE__, __LINE__)

// CUDA's integer min/max device functions.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
};
using uint3 = dim3;

inline thread_local dim3 threadIdx;
inline thread_local dim3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, sizeof f);
    return f;
}
inline float __uint_as_float(unsigned int u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}
inline int __float_as_int(float f) {
    int i;
    std::memcpy(&i, &f, sizeof i);
    return i;
}
inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}

namespace kvemu {

[[noreturn]] inline void fail(const char* what) {
    std::fprintf(stderr, "cuda_emu: %s\n", what);
    std::fflush(stderr);
    std::_Exit(70);
}

// The barrier of the block that is running (one at a time).
struct Block {
    std::mutex m;
    std::condition_variable cv;
    unsigned int threads = 0, arrived = 0, exited = 0;
    unsigned long generation = 0;
    const char* file = nullptr;
    int line = 0;
};
inline Block* running = nullptr;  // set before the block's threads start

inline void divergent(const char* why, const char* file, int line) {
    char msg[512];
    std::snprintf(msg, sizeof msg,
                  "divergent __syncthreads in block (%u,%u,%u), thread (%u,%u,%u): %s (%s:%d)",
                  blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z, why,
                  file, line);
    fail(msg);
}

inline void syncthreads(const char* file, int line) {
    Block& b = *running;
    std::unique_lock<std::mutex> lock(b.m);
    if (b.exited) divergent("a thread of the block has already exited", file, line);
    if (b.arrived == 0) {
        b.file = file;
        b.line = line;
    } else if (b.line != line || std::strcmp(b.file, file) != 0) {
        divergent("other threads wait at a different __syncthreads", b.file, b.line);
    }
    if (++b.arrived == b.threads) {
        b.arrived = 0;
        ++b.generation;
        b.cv.notify_all();
    } else {
        unsigned long g = b.generation;
        b.cv.wait(lock, [&] { return b.generation != g; });
    }
}

inline void thread_exits() {
    Block& b = *running;
    std::lock_guard<std::mutex> lock(b.m);
    ++b.exited;
    if (b.arrived) divergent("this thread exits while others wait at", b.file, b.line);
}

// Run `body` for every block of `grid`, one block at a time, each block as
// block.x * block.y * block.z OS threads.
template <typename F>
void run_grid(dim3 grid, dim3 block, F body) {
    unsigned int threads = block.x * block.y * block.z;
    for (unsigned int bz = 0; bz < grid.z; ++bz)
        for (unsigned int by = 0; by < grid.y; ++by)
            for (unsigned int bx = 0; bx < grid.x; ++bx) {
                Block b;
                b.threads = threads;
                running = &b;
                std::vector<std::thread> pool;
                pool.reserve(threads);
                for (unsigned int tz = 0; tz < block.z; ++tz)
                    for (unsigned int ty = 0; ty < block.y; ++ty)
                        for (unsigned int tx = 0; tx < block.x; ++tx)
                            pool.emplace_back([=, &body] {
                                threadIdx = dim3{tx, ty, tz};
                                blockIdx = dim3{bx, by, bz};
                                blockDim = block;
                                gridDim = grid;
                                body();
                                thread_exits();
                            });
                for (auto& t : pool) t.join();
                running = nullptr;
            }
}

// cuLaunchKernel's argument convention: args[i] points at the i-th argument.
template <typename T>
T arg_at(void* p) {
    if constexpr (std::is_pointer_v<T>) {
        return static_cast<T>(*static_cast<void**>(p));
    } else {
        T v;
        std::memcpy(&v, p, sizeof v);
        return v;
    }
}

template <typename... A, std::size_t... I>
void call(void (*k)(A...), void** args, std::index_sequence<I...>) {
    k(arg_at<A>(args[I])...);
}

template <typename... A>
void invoke(void (*k)(A...), void** args) {
    call(k, args, std::index_sequence_for<A...>{});
}

// One letter per parameter type, for checking a launch's arguments: p
// pointer, i int, u unsigned int, l 64-bit integer, f float, d double.
template <typename T>
constexpr char code() {
    if constexpr (std::is_pointer_v<T>) return 'p';
    else if constexpr (std::is_same_v<T, int>) return 'i';
    else if constexpr (std::is_same_v<T, unsigned int>) return 'u';
    else if constexpr (std::is_integral_v<T> && sizeof(T) == 8) return 'l';
    else if constexpr (std::is_same_v<T, float>) return 'f';
    else if constexpr (std::is_same_v<T, double>) return 'd';
    else return '?';
}

template <typename... A>
const char* signature(void (*)(A...)) {
    static const char s[] = {code<A>()..., '\0'};
    return s;
}

struct Kernel {
    const char* name;
    const char* signature;
    void (*invoke)(void** args);
};

}  // namespace kvemu

// A table entry for the kernel `name` (an extern "C" __global__ function).
#define KVEMU_KERNEL(name) \
    kvemu::Kernel{#name, kvemu::signature(&name), [](void** a) { kvemu::invoke(&name, a); }},
