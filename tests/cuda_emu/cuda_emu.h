// A small CPU emulation of the CUDA features kernels/*.cu use, so that the kernel sources
// themselves (index arithmetic, barriers, warp shuffles, reductions) can be tested against
// their torch references on a machine without a GPU.
//
// Every CUDA thread of a block is an OS thread; blocks run one after another (so a static
// `__shared__` array is the block's shared memory); __syncthreads is a std::barrier over the
// block, and a warp shuffle exchanges values through a per-warp slot array between two
// barriers of the warp. Math is the host's (expf, tanhf, ... differ from CUDA's by an ulp
// or so): the emulation checks logic, not the device's rounding.
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <math.h>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

using std::max;
using std::min;

#define DSH_EMULATE 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static
#define DSH_DYNAMIC_SMEM(T, name) T* name = reinterpret_cast<T*>(emu::dynamic_smem())

struct uint3 { unsigned x = 0, y = 0, z = 0; };
struct dim3 {
    unsigned x, y, z;
    dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) ushort4 { unsigned short x, y, z, w; };
struct alignas(4) char4 { signed char x, y, z, w; };

namespace emu {
struct Block {
    int n;
    std::barrier<> bar;
    std::vector<std::unique_ptr<std::barrier<>>> warp_bars;
    std::vector<uint64_t> slots;
    std::vector<double> smem;   // double for alignment
    Block(int threads, size_t smem_bytes)
        : n(threads), bar(threads), slots(threads), smem(smem_bytes / sizeof(double) + 1) {
        for (int w = 0; w * 32 < threads; ++w)
            warp_bars.emplace_back(new std::barrier<>(std::min(32, threads - 32 * w)));
    }
};
inline thread_local Block* cur = nullptr;
inline thread_local uint3 tidx, bidx;
inline dim3 bdim, gdim;
inline std::mutex atomic_mutex;
inline void* dynamic_smem() { return cur->smem.data(); }

template <class T>
T shfl(T v, int src_lane) {
    static_assert(sizeof(T) <= 8, "shuffle of at most 8 bytes");
    const int t = (int)tidx.x, warp = t / 32;
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    cur->slots[t] = bits;
    cur->warp_bars[warp]->arrive_and_wait();
    const uint64_t got = cur->slots[warp * 32 + src_lane];
    cur->warp_bars[warp]->arrive_and_wait();
    T r;
    std::memcpy(&r, &got, sizeof(T));
    return r;
}

// Run body() as a grid of blocks of `block.x` threads (1-D blocks; 1- or 2-D grids).
template <class F>
void launch(dim3 grid, dim3 block, size_t smem_bytes, F body) {
    gdim = grid;
    bdim = block;
    const int n = (int)block.x;
    for (unsigned by = 0; by < grid.y; ++by)
        for (unsigned bx = 0; bx < grid.x; ++bx) {
            Block blk(n, smem_bytes);
            std::vector<std::thread> threads;
            threads.reserve(n);
            for (int t = 0; t < n; ++t)
                threads.emplace_back([&, t] {
                    cur = &blk;
                    tidx = uint3{(unsigned)t, 0, 0};
                    bidx = uint3{bx, by, 0};
                    body();
                });
            for (auto& th : threads) th.join();
        }
}
}  // namespace emu

#define threadIdx emu::tidx
#define blockIdx emu::bidx
#define blockDim emu::bdim
#define gridDim emu::gdim

inline void __syncthreads() { emu::cur->bar.arrive_and_wait(); }
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __shfl_xor_sync(unsigned, T v, int off) {
    return emu::shfl(v, ((int)threadIdx.x % 32) ^ off);
}
template <class T> inline T __shfl_down_sync(unsigned, T v, unsigned d) {
    const int lane = (int)threadIdx.x % 32;
    return emu::shfl(v, lane + (int)d < 32 ? lane + (int)d : lane);
}
inline double atomicAdd(double* p, double v) {
    std::lock_guard<std::mutex> g(emu::atomic_mutex);
    const double old = *p;
    *p = old + v;
    return old;
}
// CUDA's rounding-pinned intrinsics: IEEE round to nearest even, never contracted.
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline double __longlong_as_double(long long v) { double d; std::memcpy(&d, &v, 8); return d; }
