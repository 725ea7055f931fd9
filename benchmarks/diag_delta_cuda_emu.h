// CPU emulation of the CUDA features diag_delta_cuda.cu uses, so that its kernels run (slowly) under g++ and can be
// checked against the PyTorch references without a GPU: one CTA at a time, each of its threads a std::thread, the
// warp intrinsics through a per-warp exchange array and barrier. Compiled with -DDELTA_EMULATE.
#pragma once
#include <algorithm>
#include <barrier>
#include <cstdint>
#include <thread>
#include <vector>

typedef uint32_t u32;
typedef uint64_t u64;
typedef int64_t i64;
typedef uint16_t u16;
typedef uint8_t u8;
#define FULL_MASK 0xffffffffu
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __restrict__
#define __shared__ static

struct Dim { u32 x; };
static thread_local Dim threadIdx, blockIdx;
struct uint4 { u32 x, y, z, w; };
static inline uint4 make_uint4(u32 x, u32 y, u32 z, u32 w) { return uint4{x, y, z, w}; }
template <class T> static inline T min(T a, T b) { return std::min(a, b); }
template <class T> static inline T max(T a, T b) { return std::max(a, b); }
static inline u32 __popc(u32 x) { return __builtin_popcount(x); }
static inline u32 __clz(u32 x) { return x ? __builtin_clz(x) : 32; }
static inline void atomicOr(u32* p, u32 v) { __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }

constexpr int EMU_MAX_WARPS = 8;
static std::barrier<>* emu_warp_barrier[EMU_MAX_WARPS];
static u32 emu_exchange[EMU_MAX_WARPS][32];

static inline void __syncwarp() { emu_warp_barrier[threadIdx.x >> 5]->arrive_and_wait(); }

template <class F> static inline u32 emu_collective(u32 v, F read) {  // read(values of the 32 lanes, lane)
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  emu_exchange[w][lane] = v;
  __syncwarp();
  u32 r = read(emu_exchange[w], lane);
  __syncwarp();
  return r;
}

static inline u32 __shfl_up_sync(u32, u32 v, int d) {
  return emu_collective(v, [&](const u32* x, int lane) { return lane >= d ? x[lane - d] : x[lane]; });
}
static inline u32 __shfl_sync(u32, u32 v, int src) {
  return emu_collective(v, [&](const u32* x, int) { return x[src]; });
}
static inline u32 __reduce_add_sync(u32, u32 v) {
  return emu_collective(v, [](const u32* x, int) { u32 s = 0; for (int i = 0; i < 32; i++) s += x[i]; return s; });
}
static inline u32 __reduce_max_sync(u32, u32 v) {
  return emu_collective(v, [](const u32* x, int) {
    u32 m = 0;
    for (int i = 0; i < 32; i++) m = std::max(m, x[i]);
    return m;
  });
}

template <class K> static void emu_launch(long long grid, int threads, K kernel) {
  for (int w = 0; w < threads / 32; w++) emu_warp_barrier[w] = new std::barrier<>(32);
  std::barrier<> cta(threads);  // shared memory is reused by the next CTA
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; t++)
    pool.emplace_back([&, t] {
      threadIdx.x = t;
      for (long long c = 0; c < grid; c++) {
        blockIdx.x = (u32)c;
        kernel();
        cta.arrive_and_wait();
      }
    });
  for (auto& th : pool) th.join();
  for (int w = 0; w < threads / 32; w++) delete emu_warp_barrier[w];
}
