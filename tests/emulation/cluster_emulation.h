// CUDA's thread model for `kernels/cluster_row_stats.cu` on the CPU: every thread of a cluster of blocks
// runs as a CPU thread, so the kernel's own source (compiled with CLUSTER_HOST_EMULATION, which leaves out
// its PTX helpers) runs here and its outputs can be compared with the contract's CPU path.
//
// Defined here: the kernel's PTX helpers (cluster rank and barrier, the mbarriers, pushes into a peer's
// shared memory counted on its mbarrier, the slice copy and the waits, its replica of libdevice's `expf`,
// NaN-propagating max, fp16 widening) and the CUDA intrinsics it calls, with the same IEEE results
// (round-toward-zero adds and fma, correctly rounded division and fma); the exponential is the contract's
// CPU one (the fp64 exp rounded to fp32), as libdevice's `expf` is the contract's on a GPU. Shared memory
// is a per-block arena; a peer's is reached through the offset of the local slot, as `mapa` maps it. An
// mbarrier holds the bytes it still expects (an atomic: a push subtracts its bytes with release order, a
// wait loads with acquire order). Misuse the hardware would not forgive aborts with a message: a cluster
// barrier waited on without an arrival, a push outside the shared state, to a rank outside the cluster or
// of more bytes than its receiver expects, a wait on bytes nobody expects or that never land (60 s). Every
// other ordering between threads comes from std::barrier (and the shuffles' own barriers), so a build with
// -fsanitize=thread reports a read of shared memory that neither a barrier nor an mbarrier of the kernel
// orders after its write.
#pragma once

#include <barrier>
#include <chrono>
#include <cfenv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <math.h>
#include <optional>
#include <thread>

#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __cluster_dims__(...)
#define __align__(n) alignas(n)

struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};

struct alignas(16) float4 {
  float x, y, z, w;
};

inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

namespace emu {

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "cluster emulation: %s\n", what);
  std::abort();
}

struct Block {
  std::barrier<>* threads;   // __syncthreads
  std::barrier<>* warps;     // one per warp
  unsigned char* arena;      // BLOCK_SHARED
  std::size_t arena_bytes;
  unsigned char* dynamic;    // DYNAMIC_SHARED
  std::uint64_t* exchange;   // a slot per thread, for shuffles
};

struct Cluster {
  std::barrier<>* barrier;
  Block* blocks;
  unsigned size;
};

struct Thread {
  Block* block;
  Cluster* cluster;
  unsigned rank;
  std::optional<std::barrier<>::arrival_token> arrival;
};

inline thread_local Thread self;

template <class T>
std::uint64_t bits(T v) {
  std::uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}

template <class To, class From>
To cast(From v) {
  static_assert(sizeof(To) == sizeof(From));
  To t;
  std::memcpy(&t, &v, sizeof(To));
  return t;
}

}  // namespace emu

struct Dim3 {
  unsigned int x;
};
inline thread_local Dim3 threadIdx, blockIdx;

template <class T>
inline T min(T a, T b) { return b < a ? b : a; }
template <class T>
inline T max(T a, T b) { return a < b ? b : a; }

inline float __int_as_float(int v) { return emu::cast<float>(v); }
inline float __uint_as_float(unsigned int v) { return emu::cast<float>(v); }
inline int __float_as_int(float v) { return emu::cast<int>(v); }
inline unsigned int __float_as_uint(float v) { return emu::cast<unsigned int>(v); }

inline float __fadd_rz(float a, float b) {
  const int mode = std::fegetround();
  std::fesetround(FE_TOWARDZERO);
  volatile float r = a + b;
  std::fesetround(mode);
  return r;
}

inline float __fdiv_rn(float a, float b) {
  volatile float r = a / b;
  return r;
}

inline float __fmaf_rz(float a, float b, float c) {
  const int mode = std::fegetround();
  std::fesetround(FE_TOWARDZERO);
  volatile float r = std::fma(a, b, c);
  std::fesetround(mode);
  return r;
}

// The kernel's `convert_rz_u64` (cvt.rzi.u64.f32): toward zero, negatives to 0, at or above 2^64 the
// largest, and a NaN to EMULATED_NAN_TERM: by default 2^63 (the kernel then drops the entropy's min and
// clears the sum's bit 63), else what a build defines (any other value keeps the min).
#ifndef EMULATED_NAN_TERM
#define EMULATED_NAN_TERM (1ull << 63)
#endif
inline unsigned long long convert_rz_u64(float a) {
  if (a != a) return EMULATED_NAN_TERM;
  if (!(a > 0.0f)) return 0ull;
  if (a >= 18446744073709551616.0f) return ~0ull;
  return (unsigned long long)a;
}

// The kernel's `exp_parts`: e = expf(x) as r s, here the contract's CPU exponential (the fp64 exp rounded
// to fp32) and s = 1, so that fma(r, s, c) is the contract's add.
inline void exp_parts(float x, float& r, float& s) {
  r = (float)std::exp((double)x);
  s = 1.0f;
}

inline void __syncthreads() { emu::self.block->threads->arrive_and_wait(); }

template <class T>
inline T __shfl_xor_sync(unsigned int mask, T v, int lane_mask) {
  if (mask != 0xffffffffu) emu::fail("a shuffle over part of a warp");
  emu::Block& b = *emu::self.block;
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  b.exchange[threadIdx.x] = emu::bits(v);
  b.warps[warp].arrive_and_wait();
  T out;
  std::memcpy(&out, &b.exchange[warp * 32 + (lane ^ (unsigned)lane_mask)], sizeof(T));
  b.warps[warp].arrive_and_wait();
  return out;
}

// The kernel's PTX helpers.
inline unsigned int cluster_rank() { return emu::self.rank; }

inline void cluster_arrive_relaxed() {
  if (emu::self.arrival) emu::fail("two cluster arrivals without a wait");
  emu::self.arrival.emplace(emu::self.cluster->barrier->arrive());
}
inline void cluster_wait() {
  if (!emu::self.arrival) emu::fail("a cluster wait without an arrival");
  emu::self.cluster->barrier->wait(std::move(*emu::self.arrival));
  emu::self.arrival.reset();
}

namespace emu {
constexpr std::uint64_t kNobodyExpects = ~0ull;  // an mbarrier no copy or push will complete

// The byte offset of `p` in this block's shared state, checked to hold `bytes`.
inline std::size_t arena_offset(const void* p, std::size_t bytes, const char* what) {
  const auto* at = reinterpret_cast<const unsigned char*>(p);
  const Block& b = *self.block;
  if (at < b.arena || at + bytes > b.arena + b.arena_bytes) fail(what);
  return static_cast<std::size_t>(at - b.arena);
}

// `bytes` of `v` into block `rank`'s copy of `local_slot`, then counted on its copy of `bar`.
inline void push(const void* local_slot, const unsigned long long* bar, unsigned int rank, const void* v,
                 std::size_t bytes) {
  const std::size_t slot = arena_offset(local_slot, bytes, "a push from outside the shared state");
  const std::size_t counter = arena_offset(bar, sizeof(std::uint64_t), "a push counted outside the shared state");
  if (rank >= self.cluster->size) fail("a push to a rank outside the cluster");
  unsigned char* peer = self.cluster->blocks[rank].arena;
  std::memcpy(peer + slot, v, bytes);
  auto* left = reinterpret_cast<std::uint64_t*>(peer + counter);
  const std::uint64_t before = __atomic_fetch_sub(left, bytes, __ATOMIC_RELEASE);
  if (before == kNobodyExpects || before < bytes) fail("a push of more bytes than its receiver expects");
}
}  // namespace emu

inline void init_exchanges(unsigned long long* full, unsigned long long* max_full, unsigned int max_bytes,
                           unsigned long long* sums_full, unsigned int sums_bytes) {
  __atomic_store_n(full, emu::kNobodyExpects, __ATOMIC_RELAXED);
  __atomic_store_n(max_full, max_bytes, __ATOMIC_RELAXED);
  __atomic_store_n(sums_full, sums_bytes, __ATOMIC_RELAXED);
}

inline void push_float(const float* local_slot, const unsigned long long* bar, unsigned int rank, float v) {
  emu::push(local_slot, bar, rank, &v, sizeof v);
}
inline void push_pair(const long long* local_slot, const unsigned long long* bar, unsigned int rank, long long a,
                      long long b) {
  const long long pair[2] = {a, b};
  emu::push(local_slot, bar, rank, pair, sizeof pair);
}

inline void start_slice_copy(unsigned char* slice, const unsigned char* src, unsigned int bytes,
                             unsigned long long* full) {
  if (bytes % 16 || reinterpret_cast<std::uintptr_t>(src) % 16 || reinterpret_cast<std::uintptr_t>(slice) % 16)
    emu::fail("a bulk copy of a size or at an address that is not a multiple of 16");
  std::memcpy(slice, src, bytes);
  __atomic_store_n(full, 0ull, __ATOMIC_RELEASE);
}
template <unsigned int HINT_NS>
inline void wait_landed(const unsigned long long* bar) {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    const std::uint64_t left = __atomic_load_n(bar, __ATOMIC_ACQUIRE);
    if (left == emu::kNobodyExpects) emu::fail("a wait on bytes nobody expects");
    if (left == 0) return;
    if (std::chrono::steady_clock::now() - start > std::chrono::seconds(60))
      emu::fail("a wait on bytes that never land");
    std::this_thread::yield();
  }
}

inline float max_nan(float a, float b) {
  if (a != a || b != b) return __uint_as_float(0x7fffffffu);
  if (a == b) return std::signbit(a) ? b : a;  // max(-0, +0) = +0
  return a > b ? a : b;
}

inline float half_to_float(unsigned int bits16) {
  const unsigned int sign = (bits16 & 0x8000u) << 16, exponent = (bits16 >> 10) & 0x1f, fraction = bits16 & 0x3ff;
  if (exponent == 0x1f) return __uint_as_float(sign | 0x7f800000u | (fraction << 13));
  if (exponent == 0) {
    const float magnitude = std::ldexp((float)fraction, -24);  // subnormal (or zero): exact
    return sign ? -magnitude : magnitude;
  }
  return __uint_as_float(sign | ((exponent + 112) << 23) | (fraction << 13));
}

inline unsigned int max_nan_pair(unsigned int a, unsigned int b) {
  unsigned int out = 0;
  for (int half = 0; half < 2; ++half) {
    const unsigned int ha = (a >> (16 * half)) & 0xffffu, hb = (b >> (16 * half)) & 0xffffu;
#if ELEM == 0
    const float fa = __uint_as_float(ha << 16), fb = __uint_as_float(hb << 16);
#else
    const float fa = half_to_float(ha), fb = half_to_float(hb);
#endif
    const float m = max_nan(fa, fb);
    const unsigned int pick = m != m ? 0x7fffu : (__float_as_uint(m) == __float_as_uint(fa) ? ha : hb);
    out |= pick << (16 * half);
  }
  return out;
}

#define BLOCK_SHARED(type, name) type& name = *reinterpret_cast<type*>(emu::self.block->arena)
#define DYNAMIC_SHARED(name) unsigned char* name = emu::self.block->dynamic
