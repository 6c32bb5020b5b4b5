// One HBM read per row: the forward's row statistics (M, L, lse, the logp of each of a row's labels, the
// entropy, and with `out_full` every column's logprob) with a row held in the shared memory of a cluster of
// CLUSTER thread blocks, a slice of `width` columns each.
//
// The Triton forward (`row_stats.py`) reads a row twice, once for its max and once for the sums, and at
// 5 programs per SM the second read mostly misses L2. Here each block copies its slice into shared
// memory once (bulk asynchronous copies), scans it for the max and pushes it into every block of the
// cluster (asynchronous stores into distributed shared memory, each counted on the receiver's mbarrier:
// past the one cluster barrier at its start, no other and no fence); once every block's max has landed
// it sums the fixed-point terms of its slice from shared memory, the blocks push their sums the same way,
// and each thread that writes finishes the row (the same integers: the same results): with `out_full`
// every thread, writing its slice's logprobs; block 0's first threads the labels' logp, and its thread 0
// the row's scalars.
//
// Same operations as the Triton kernels, so the same bits: libdevice's expf (what `exact_exp` calls; its
// last product folded into the fixed-point split's round-toward-zero adds, which gives the same sums),
// the max in the logits' own type (exact, NaN-propagating), z = x / T the IEEE quotient (div_rn, the
// reciprocal and one fma correction where `row_reciprocal`'s range holds, or for 16-bit logits
// `row_divisor`'s pair where it checks: what T alone decides comes from the host, `division_setup.py`,
// as t_hi, t_lo and t_division; the row's max decides the rest here), the terms trunc(e 2^40) =
// hi 2^20 + lo from two round-toward-zero adds summed as uint32 bit patterns (`split_terms`, `lane_total`),
// the entropy's terms trunc(u 2^40) by one conversion toward zero summed as uint64 (`QUANT_CAST`'s: the
// same integers, three instructions and an add fewer a term than the split; the logp's terms keep the
// split, as a second conversion a logit beside the exp makes the special-function unit the limit), and
// `finalize_row`'s finish in fp64. Compiled by NVRTC with -fmad=false (no contraction the Triton
// kernels, compiled without fp fusion, lack); parameters:
//   ELEM: 0 bf16, 1 fp16, 2 fp32; CLUSTER: blocks per row; THREADS: threads per block;
//   MIN_BLOCKS: blocks per SM to fit in registers; ENTROPY: 0/1; TEMP: 0 none, 1 one float T for every row;
//   WAIT_NS: the copy wait's suspend-time hint in ns (0: the hardware's own limit).
// The host (`cluster_launch.py`) checks what the copies and the vector stores need: 16-byte aligned rows
// of logits and of `out_full`, a row's bytes and a slice's a multiple of 16.

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#if ELEM == 2
#define ESIZE 4
#else
#define ESIZE 2
#endif

#define WARPS (THREADS / 32)
#define COPY_BYTES 32768
// The split takes e 2^SCALE: with the entropy e 2^40 (its product feeds the entropy term's conversion), else e.
#if ENTROPY
#define SCALE 40
#else
#define SCALE 0
#endif
// Biases of spacing 2^(SCALE - 20) (the high part, trunc(e 2^20)) and 2^(SCALE - 40), and their fp32 patterns.
#define HI_BIAS __int_as_float(HI_PATTERN)
#define LO_BIAS __int_as_float(LO_PATTERN)
#define HI_PATTERN ((u32)(127 + 3 + SCALE) << 23)
#define LO_PATTERN ((u32)(127 - 17 + SCALE) << 23)
// The suspend-time hint of the waits for the peers' pushes. A suspended warp still wakes at the SM's other
// mbarrier events and tests again (on an H100, ~70 tests a warp for the sums of a row, with or without a
// hint): one warp waits, the others at a block barrier, where they issue nothing.
#define EXCHANGE_WAIT_NS 10000000u

// The PTX of the kernel, in these helpers only: `tests/cluster_emulation.h` defines them (and CUDA's
// intrinsics) for a host build that runs the kernel's threads as CPU threads (CLUSTER_HOST_EMULATION).
#ifndef CLUSTER_HOST_EMULATION
__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

__device__ __forceinline__ float max_nan(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

__device__ __forceinline__ u32 max_nan_pair(u32 a, u32 b) {
  u32 d;
#if ELEM == 0
  asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
#else
  asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
#endif
  return d;
}

__device__ __forceinline__ float half_to_float(u32 bits16) {
  float f;
  unsigned short h = (unsigned short)bits16;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

// The cluster's one barrier (each thread arriving on its own, not `.aligned`): its peers have started, so
// their shared memory and mbarriers can be written. The arrival is relaxed: `init_exchanges`' fence
// releases the mbarriers' initialisation.
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire;" ::: "memory"); }

// Thread 0 readies the block's three mbarriers (each one arrival: its own): `full` for the slice's copy
// (`start_slice_copy` expects its bytes), `max_full` for the `max_bytes` and `sums_full` for the
// `sums_bytes` the peers push; the fence makes the initialisation visible to the cluster before its barrier.
__device__ __forceinline__ void init_exchanges(u64* full, u64* max_full, u32 max_bytes, u64* sums_full,
                                               u32 sums_bytes) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(full)) : "memory");
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(max_full)) : "memory");
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(sums_full)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_addr(max_full)), "r"(max_bytes)
               : "memory");
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_addr(sums_full)),
               "r"(sums_bytes) : "memory");
}

// A shared-memory address of this block mapped into block `rank` of the cluster.
__device__ __forceinline__ u32 peer_addr(const void* local, u32 rank) {
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(local)), "r"(rank));
  return remote;
}

// Asynchronous stores into block `rank`'s copy of `local_slot`, their bytes counted on its copy of `bar`.
__device__ __forceinline__ void push_float(const float* local_slot, const u64* bar, u32 rank, float v) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];"
               :: "r"(peer_addr(local_slot, rank)), "f"(v), "r"(peer_addr(bar, rank)) : "memory");
}

__device__ __forceinline__ void push_pair(const i64* local_slot, const u64* bar, u32 rank, i64 a, i64 b) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.s64 [%0], {%1, %2}, [%3];"
               :: "r"(peer_addr(local_slot, rank)), "l"(a), "l"(b), "r"(peer_addr(bar, rank)) : "memory");
}

__device__ __forceinline__ u32 cluster_rank() {
  u32 rank;
  asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

// Thread 0 starts the copy of `bytes` (a multiple of 16, 16-byte aligned at both ends) from `src` into
// `slice`, its completion counted on the mbarrier `full` (`init_exchanges` readied it).
__device__ __forceinline__ void start_slice_copy(unsigned char* slice, const unsigned char* src, u32 bytes, u64* full) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_addr(full)), "r"(bytes) : "memory");
  for (u32 off = 0; off < bytes; off += COPY_BYTES) {
    u32 n = min(bytes - off, (u32)COPY_BYTES);
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_addr(slice + off)), "l"(src + off), "r"(n), "r"(smem_addr(full)) : "memory");
  }
}

// Whether the bytes counted on the mbarrier at `bar` have landed (its phase 0 complete). A thread may be
// suspended in the test until they land or a time limit passes: the hardware's own, or with HINT_NS > 0
// that many nanoseconds (a suspended warp issues nothing; a polling one issues five instructions a poll).
template <u32 HINT_NS>
__device__ __forceinline__ u32 landed(u32 bar) {
  u32 done;
  if (HINT_NS) {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0, %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar), "n"(HINT_NS) : "memory");
  } else {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar) : "memory");
  }
  return done;
}

// cvt.rzi.u64.f32 (toward zero, negatives to 0) as the instruction itself: what it gives a NaN is the
// GPU's (`nan_wraps`), never a compiler's assumption.
__device__ __forceinline__ u64 convert_rz_u64(float a) {
  u64 d;
  asm("cvt.rzi.u64.f32 %0, %1;" : "=l"(d) : "f"(a));
  return d;
}

__device__ __forceinline__ u64 global_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Every thread waits for the bytes counted on `full` (the slice's copy, or the peers' pushes) to land,
// suspended up to HINT_NS a test (`landed`); bytes that never land trap (a launch error) after about 8.6 s
// (2^33 ns of the GPU's global timer, read after every 256 tests) instead of hanging the GPU.
template <u32 HINT_NS>
__device__ __forceinline__ void wait_landed(const u64* full) {
  const u32 bar = smem_addr(full);
  const u64 start = global_ns();
  for (;;) {
#pragma unroll 1
    for (u32 polls = 0; polls < 256; ++polls) {
      if (landed<HINT_NS>(bar)) return;
    }
    if (global_ns() - start > (1ull << 33)) asm volatile("trap;");
  }
}

// libdevice's `expf(x)` (its PTX, op for op) as r s: its last product, of the 2^x of the reduced argument r
// and the power of two s, is left to the caller.
__device__ __forceinline__ void exp_parts(float x, float& r, float& s) {
  float t = __saturatef(__fmaf_rn(x, __int_as_float(0x3bbb989d), 0.5f));
  float j = __fmaf_rd(t, 252.0f, __int_as_float(0x4b400001));
  float k = __fadd_rn(j, __int_as_float(0xcb40007f));
  float f = __fmaf_rn(x, __int_as_float(0x32a57060), __fmaf_rn(x, __int_as_float(0x3fb8aa3b), -k));
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(f));
  s = __int_as_float(__float_as_int(j) << 23);
}

#define BLOCK_SHARED(type, name) __shared__ type name
#define DYNAMIC_SHARED(name) extern __shared__ __align__(128) unsigned char name[]
#endif  // CLUSTER_HOST_EMULATION

// The two logits of a 16-bit pair as fp32 (exact).
__device__ __forceinline__ void widen_pair(u32 w, float& a, float& b) {
#if ELEM == 0
  a = __int_as_float(w << 16);
  b = __int_as_float(w & 0xffff0000u);
#else
  a = half_to_float(w & 0xffffu);
  b = half_to_float(w >> 16);
#endif
}

__device__ __forceinline__ float load_logit(const unsigned char* row, i64 col) {
#if ELEM == 0
  return __int_as_float(((u32)((const unsigned short*)row)[col]) << 16);
#elif ELEM == 1
  return half_to_float(((const unsigned short*)row)[col]);
#else
  return ((const float*)row)[col];
#endif
}

// A row's k-th label and its logit (`owned`: the label is a column of this row; else the logit is column 0's,
// unused).
struct Pick {
  bool owned;
  float logit;
};

__device__ __forceinline__ Pick load_pick(const i64* labels, i64 row, int n_picks, int k, const unsigned char* x_row,
                                          int n_cols) {
  i64 label = labels[row * n_picks + k];
  bool owned = label >= 0 && label < n_cols;
  return {owned, load_logit(x_row, owned ? label : 0)};
}

// z = x / T, the IEEE quotient as the Triton kernels form it: none (DIV 0), the reciprocal and one fma
// correction (DIV 1, `scale_logits` without the pair), div_rn (DIV 2), fma(x, hi, x lo) with `row_divisor`'s
// pair for 16-bit logits (DIV 3; `inv_t` holds hi, `inv_lo` lo).
template <int DIV>
__device__ __forceinline__ float divide(float x, float t, float inv_t, float inv_lo) {
  if (DIV == 3) {
    return fmaf(x, inv_t, x * inv_lo);
  } else if (DIV == 1) {
    float q = x * inv_t;
    return fmaxf(fmaf(fmaf(-q, t, x), inv_t, q), -__int_as_float(0x7f800000));
  } else if (DIV == 2) {
    return __fdiv_rn(x, t);
  }
  return x;
}

// `CALL(D)` with the row's division `div` as a constant (no temperature: 0 only).
#define BY_DIVISION(CALL)  \
  if (!TEMP) {             \
    CALL(0);               \
  } else if (div == 3) {   \
    CALL(3);               \
  } else if (div == 1) {   \
    CALL(1);               \
  } else {                 \
    CALL(2);               \
  }

struct Sums {
  u32 s_hi, s_lo;
  u64 e;
};

// CLAMP: the entropy's factor is min(nd, 200), else nd (see `nan_wraps` in the kernel).
template <int DIV, bool CLAMP>
__device__ __forceinline__ void add_term(Sums& acc, float x, float t, float inv_t, float inv_lo, float shift) {
  float z = divide<DIV>(x, t, inv_t, inv_lo);
  float nd = shift - z;
  float r, s;
  exp_parts(nd * -1.0f, r, s);  // e = expf(-nd) = r s
  // s 2^SCALE from the power's bits: s = 2^k with k <= 0 (the argument is <= 0), so its exponent field
  // stays below 128 + SCALE. r s 2^SCALE = e 2^SCALE wherever e is normal.
  float ss = __int_as_float(__float_as_int(s) + (SCALE << 23));
  // The halves of trunc(e 2^40): e 2^SCALE + c rounded toward zero is fma(r, s 2^SCALE, c) rounded toward
  // zero (one instruction less than e's product and an add), and below 2^-126 both halves are the bias
  // either way.
  float hi = __fmaf_rz(r, ss, HI_BIAS);
  float lo = __fmaf_rz(r, ss, (HI_BIAS + LO_BIAS) - hi);
  acc.s_hi += __float_as_uint(hi);
  acc.s_lo += __float_as_uint(lo);
#if ENTROPY
  // trunc(u 2^40) of u = e min(nd, 200) (min: 0 * inf of a masked column kept out): round(e 2^40 min(nd,
  // 200)) is u 2^40 wherever u is normal, and below 2^-126 both truncate to 0; u < 1, so u 2^40 < 2^40.
  // Without the min (CLAMP false) the factor is nd: past nd = 200 e is 0 either way, and a masked column's
  // term is the conversion of 0 * inf = NaN, which the kernel's final sum clears (`nan_wraps`).
  float u40 = (r * ss) * (CLAMP ? fminf(nd, 200.0f) : nd);
  acc.e += convert_rz_u64(u40);
#endif
}

// The exact sum of n_terms split terms (`lane_total`: each pattern minus its bias).
__device__ __forceinline__ i64 total(u32 hi, u32 lo, u32 n_terms) {
  return ((i64)(u64)(hi - n_terms * HI_PATTERN) << 20) + (i64)(u64)(lo - n_terms * LO_PATTERN);
}

template <int DIV, bool CLAMP>
__device__ __forceinline__ Sums slice_sums(const uint4* v, int n_vec, float t, float inv_t, float inv_lo, float shift) {
  Sums acc = {0u, 0u, 0ull};
#pragma unroll 2
  for (int i = threadIdx.x; i < n_vec; i += THREADS) {
    uint4 w = v[i];
#if ELEM == 2
    add_term<DIV, CLAMP>(acc, __uint_as_float(w.x), t, inv_t, inv_lo, shift);
    add_term<DIV, CLAMP>(acc, __uint_as_float(w.y), t, inv_t, inv_lo, shift);
    add_term<DIV, CLAMP>(acc, __uint_as_float(w.z), t, inv_t, inv_lo, shift);
    add_term<DIV, CLAMP>(acc, __uint_as_float(w.w), t, inv_t, inv_lo, shift);
#else
    u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float a, b;
      widen_pair(words[k], a, b);
      add_term<DIV, CLAMP>(acc, a, t, inv_t, inv_lo, shift);
      add_term<DIV, CLAMP>(acc, b, t, inv_t, inv_lo, shift);
    }
#endif
  }
  return acc;
}

// (z - M) - L of every logit of the slice into `out` (fp32, 16-byte aligned: the slice's first column),
// `write_logprobs`' operations: a rollout's full-vocabulary logprobs.
template <int DIV>
__device__ __forceinline__ void slice_write(const uint4* v, int n_vec, float t, float inv_t, float inv_lo,
                                            float row_max, float log_sum32, float4* out) {
  for (int i = threadIdx.x; i < n_vec; i += THREADS) {
    uint4 w = v[i];
#if ELEM == 2
    out[i] = make_float4((divide<DIV>(__uint_as_float(w.x), t, inv_t, inv_lo) - row_max) - log_sum32,
                         (divide<DIV>(__uint_as_float(w.y), t, inv_t, inv_lo) - row_max) - log_sum32,
                         (divide<DIV>(__uint_as_float(w.z), t, inv_t, inv_lo) - row_max) - log_sum32,
                         (divide<DIV>(__uint_as_float(w.w), t, inv_t, inv_lo) - row_max) - log_sum32);
#else
    u32 words[4] = {w.x, w.y, w.z, w.w};
    float z[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      widen_pair(words[k], z[2 * k], z[2 * k + 1]);
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) z[k] = (divide<DIV>(z[k], t, inv_t, inv_lo) - row_max) - log_sum32;
    out[2 * i] = make_float4(z[0], z[1], z[2], z[3]);
    out[2 * i + 1] = make_float4(z[4], z[5], z[6], z[7]);
#endif
  }
}

// A block's shared memory beside its slice: the mbarriers of the copy and of the peers' pushes, every
// block's max and sums (pushed by the peers through distributed shared memory: a pair (s, e) per block),
// and its warps' partial results.
struct BlockShared {
  u64 full, max_full, sums_full;
  alignas(16) i64 peer_sums[CLUSTER][2];
  float peer_max[CLUSTER];
  float warp_max[WARPS];
  i64 warp_s[WARPS];
  u64 warp_e[WARPS];
};

extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(THREADS, MIN_BLOCKS)
cluster_row_stats(const unsigned char* __restrict__ x, i64 stride_bytes, const i64* __restrict__ labels, int n_picks,
                  float t, float t_hi, float t_lo, int t_division, float* out_max, float* out_log_sum,
                  float* out_lse, float* out_logp, float* out_ent, float* out_full, i64 stride_full, int n_cols,
                  int width) {
  DYNAMIC_SHARED(slice);
  BLOCK_SHARED(BlockShared, sh);
  const u32 rank = cluster_rank();
  const i64 row = blockIdx.x / CLUSTER;
  const unsigned char* x_row = x + row * stride_bytes;
  const int col0 = (int)rank * width;
  const int cols = max(0, min(width, n_cols - col0));
  const u32 bytes = (u32)cols * ESIZE;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  // Ready the mbarriers and start the copy of this block's slice; the cluster's barrier (its peers have
  // started) overlaps it.
  if (threadIdx.x == 0) {
    init_exchanges(&sh.full, &sh.max_full, sizeof(sh.peer_max), &sh.sums_full, sizeof(sh.peer_sums));
    if (bytes) start_slice_copy(slice, x_row + (i64)col0 * ESIZE, bytes, &sh.full);
  }
  cluster_arrive_relaxed();
  // Block 0's threads that write a label's logp load their first label and its logit now (past the cluster
  // arrival, which the peers wait on), behind the copy: the row's end does not wait for two dependent loads.
  const bool picks_early = out_logp && rank == 0 && (int)threadIdx.x < n_picks;
  const Pick first = picks_early ? load_pick(labels, row, n_picks, threadIdx.x, x_row, n_cols) : Pick{false, 0.0f};
  // The division as far as T decides it, worked out on the host (`division_setup.division`): T inside
  // `row_reciprocal`'s range (bit 0: t_hi its 1/T) and `row_divisor`'s pair kept (bit 1: t_hi + t_lo).
  const bool t_ok = TEMP && (t_division & 1), use_pair = t_ok && (t_division & 2);
  __syncthreads();  // thread 0 has readied the mbarriers the block waits on
  if (bytes) wait_landed<WAIT_NS>(&sh.full);

  // The slice's max in the logits' own type (exact, NaN-propagating), then fp32.
  const uint4* v = (const uint4*)slice;
  const int n_vec = (int)(bytes / 16);
  float m = -__int_as_float(0x7f800000);
#if ELEM == 2
  for (int i = threadIdx.x; i < n_vec; i += THREADS) {
    uint4 w = v[i];
    m = max_nan(m, max_nan(max_nan(__uint_as_float(w.x), __uint_as_float(w.y)),
                           max_nan(__uint_as_float(w.z), __uint_as_float(w.w))));
  }
#else
  u32 pair = ELEM == 0 ? 0xff80ff80u : 0xfc00fc00u;  // -inf, -inf
  for (int i = threadIdx.x; i < n_vec; i += THREADS) {
    uint4 w = v[i];
    pair = max_nan_pair(pair, max_nan_pair(max_nan_pair(w.x, w.y), max_nan_pair(w.z, w.w)));
  }
  float a, b;
  widen_pair(pair, a, b);
  m = max_nan(a, b);
#endif
  for (int o = 16; o; o >>= 1) m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (lane == 0) sh.warp_max[warp] = m;
  __syncthreads();
  m = sh.warp_max[0];
  for (int w = 1; w < WARPS; ++w) m = max_nan(m, sh.warp_max[w]);
  cluster_wait();  // every block of the cluster has started: its shared memory can be written
  if (threadIdx.x < CLUSTER) push_float(&sh.peer_max[rank], &sh.max_full, threadIdx.x, m);
  if (warp == 0) wait_landed<EXCHANGE_WAIT_NS>(&sh.max_full);
  __syncthreads();
  m = sh.peer_max[0];
  for (int r = 1; r < CLUSTER; ++r) m = max_nan(m, sh.peer_max[r]);

  // `scaled_max`: M = m / T, -0.0 made +0.0.
  float row_max = (TEMP ? __fdiv_rn(m, t) : m) + 0.0f;
  const float neg_inf = -__int_as_float(0x7f800000);
  float shift = row_max == neg_inf ? 0.0f : row_max;

  // The division, chosen once for the row: 0 none, 1 the reciprocal and one fma, 2 div_rn, 3 the pair
  // (16-bit logits). Every choice gives the IEEE quotient's bits. `row_reciprocal`'s range: T's (above) and
  // the max's.
  int div = 0;
  float inv_t = 0.0f, inv_lo = 0.0f;
  if (TEMP) {
    float am = fabsf(row_max);
    bool ok = t_ok && am >= 8.673617379884035e-19f && am <= 1.2676506002282294e30f;
    div = !ok ? 2 : use_pair ? 3 : 1;
    inv_t = ok ? t_hi : 0.0f;
    inv_lo = ok && use_pair ? t_lo : 0.0f;
  }
  // A masked column's entropy term e nd is 0 * inf = NaN. The sums are modulo 2^64, and a row's true
  // entropy sum is below 2^63 (under 2^23 columns of terms below 2^40): where this GPU converts a NaN to 0
  // or 2^63, clearing the total's bit 63 takes every such term out, and the terms skip min(nd, 200) (an
  // instruction a logit); elsewhere they keep it. The NaN is made at run time ((t - t) inf for any t).
  const bool nan_wraps = ENTROPY && (convert_rz_u64((t - t) * __int_as_float(0x7f800000)) << 1) == 0;
  Sums acc;
#define SUMS(D) \
  acc = nan_wraps ? slice_sums<D, false>(v, n_vec, t, inv_t, inv_lo, shift) \
                  : slice_sums<D, true>(v, n_vec, t, inv_t, inv_lo, shift)
  BY_DIVISION(SUMS);
  // Terms this thread added: ESIZE-byte logits, 16 bytes per vector.
  const u32 n_terms = (u32)(((n_vec - (int)threadIdx.x + THREADS - 1) / THREADS) * (16 / ESIZE));
  i64 s = threadIdx.x < n_vec ? total(acc.s_hi, acc.s_lo, n_terms) : 0;
  u64 e = acc.e;  // modulo 2^64 (see `nan_wraps`)
  for (int o = 16; o; o >>= 1) {
    s += __shfl_xor_sync(0xffffffffu, s, o);
    e += __shfl_xor_sync(0xffffffffu, e, o);
  }
  if (lane == 0) {
    sh.warp_s[warp] = s;
    sh.warp_e[warp] = e;
  }
  __syncthreads();
  if (threadIdx.x < CLUSTER) {  // every block gets every block's sums: each can finish the row
    s = 0;
    e = 0;
    for (int w = 0; w < WARPS; ++w) {
      s += sh.warp_s[w];
      e += sh.warp_e[w];
    }
    push_pair(sh.peer_sums[rank], &sh.sums_full, threadIdx.x, s, (i64)e);
  }
  if (warp == 0) wait_landed<EXCHANGE_WAIT_NS>(&sh.sums_full);
  __syncthreads();
  // Every peer's pushes into this block have landed, and no block reads another's shared memory: a thread
  // that writes nothing of the row leaves (with `out_full` every thread writes its logprobs; else block 0's
  // thread 0 writes the row's scalars and its first n_picks threads the labels' logp).
  if (!out_full && (rank != 0 || (threadIdx.x != 0 && (!out_logp || (int)threadIdx.x >= n_picks)))) return;

  // `finalize_row`, in the same operations (in every thread that writes: the same integers, the same results).
  i64 fixed = 0;
  u64 entropy_sum = 0;
  for (int r = 0; r < CLUSTER; ++r) {
    fixed += sh.peer_sums[r][0];
    entropy_sum += (u64)sh.peer_sums[r][1];
  }
  const i64 entropy_fixed = 0 - (i64)(entropy_sum & ~(1ull << 63));  // bit 63: `nan_wraps`
  const float nan = __int_as_float(0x7fc00000);
  double sd = (double)fixed;
  double log_sum = log(sd * (double)9.094947017729282e-13f);  // 2^-40
  bool bad = (row_max != row_max) || (row_max == __int_as_float(0x7f800000));
  float log_sum32 = bad ? nan : (float)log_sum;
  if (out_full) {
    float4* out = (float4*)(out_full + row * stride_full + col0);
#define WRITE(D) slice_write<D>(v, n_vec, t, inv_t, inv_lo, row_max, log_sum32, out)
    BY_DIVISION(WRITE);
  }
  if (rank != 0) return;
  if (out_logp) {  // the row's n_picks labels, a thread each
    for (int k = threadIdx.x; k < n_picks; k += THREADS) {
      Pick pick = k == (int)threadIdx.x ? first : load_pick(labels, row, n_picks, k, x_row, n_cols);
      float target = TEMP ? __fdiv_rn(pick.logit, t) : pick.logit;
      float logp = row_max != neg_inf ? (target - row_max) - log_sum32 : 0.0f;
      out_logp[row * n_picks + k] = pick.owned ? logp : 0.0f;
    }
  }
  if (threadIdx.x != 0) return;
  if (out_max) out_max[row] = row_max;
  if (out_log_sum) out_log_sum[row] = log_sum32;
  if (out_lse) out_lse[row] = bad ? nan : (float)((double)row_max + log_sum);
#if ENTROPY
  if (out_ent) {
    double h = log_sum - (double)entropy_fixed / sd;
    float h32 = (float)(fixed > 0 ? h : 0.0);
    out_ent[row] = bad ? nan : h32;
  }
#endif
}
