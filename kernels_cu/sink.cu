// Softmax with a per-head sink logit: p_j = exp(x_j - M) / (sum_j exp(x_j - M) + exp(sink - M)),
// M = max(max_j x_j, sink). -inf logits give 0; a row whose logits and sink are all -inf
// gives zeros. Rows are the last axis of logits [..., heads, rows_per_head, n]; row r belongs
// to head (r / rows_per_head) % heads.
//
// Short rows: one warp per row (sink_softmax_rows<T, 32>); long rows: one CTA per row
// (sink_softmax_rows<T, SINK_THREADS>); very long rows with few of them: several CTAs per row, in two
// passes (sink_softmax_chunk_stats then sink_softmax_chunk_write).
#include "common.cuh"
#include "abi.cuh"

namespace cupaged {

// Softmax statistics of a set of logits in log2 units: m = max(x) * LOG2E and
// s = sum exp2(x * LOG2E - m). The empty set is (-inf, 0).
struct MaxSum {
  float m;
  float s;
};

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == neg_inf()) return a;
  return {m, a.s * exp2f(a.m - m) + b.s * exp2f(b.m - m)};
}

// Add K logits to the running statistics with one rescale.
template <int K>
__device__ __forceinline__ void accumulate(MaxSum& acc, const float* v) {
  float vm = neg_inf();
#pragma unroll
  for (int i = 0; i < K; ++i) vm = fmaxf(vm, v[i]);
  const float m = fmaxf(acc.m, vm * LOG2E);
  if (m == neg_inf()) return;
  float s = acc.s * exp2f(acc.m - m);
#pragma unroll
  for (int i = 0; i < K; ++i) s += exp2f(fmaf(v[i], LOG2E, -m));
  acc = {m, s};
}

// Merge the statistics of a group of GROUP threads (a warp, or a whole CTA of GROUP
// threads through red[GROUP / 32]); every thread of the group gets the result.
template <int GROUP>
__device__ __forceinline__ MaxSum group_reduce(MaxSum a, MaxSum* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    MaxSum b{__shfl_xor_sync(0xffffffffu, a.m, o), __shfl_xor_sync(0xffffffffu, a.s, o)};
    a = merge(a, b);
  }
  if constexpr (GROUP > 32) {
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = a;
    __syncthreads();
    a = red[0];
#pragma unroll
    for (int w = 1; w < GROUP / 32; ++w) a = merge(a, red[w]);
    __syncthreads();
  }
  return a;
}

// Final scale of a row: p = exp2(x * LOG2E - m) * inv (m = 0 for an empty row, where inv = 0).
struct RowScale {
  float m;
  float inv;
};

__device__ __forceinline__ RowScale row_scale(MaxSum acc, float sink) {
  const float sk = sink * LOG2E;
  const float m = fmaxf(acc.m, sk);
  if (m == neg_inf()) return {0.f, 0.f};
  const float total = acc.s * exp2f(acc.m - m) + exp2f(sk - m);
  return {m, 1.f / total};
}

// Visit elements [c0, c1) of row x, spread over `group` threads of which this is `lane`:
// scalars up to the first 16-byte boundary, then 16-byte vectors, then a scalar tail (only
// scalars when !vec). Calls f(i, v) with v a float[1] or float[Vec16<T>::N] of x[i ...].
template <typename T, typename F>
__device__ __forceinline__ void visit(const T* __restrict__ x, i64 c0, i64 c1, int lane, int group,
                                      bool vec, F& f) {
  constexpr int VEC = Vec16<T>::N;
  i64 head = c1 - c0;
  if (vec) {
    const unsigned mis = static_cast<unsigned>(reinterpret_cast<size_t>(x + c0) & 15u);
    head = min(head, static_cast<i64>(((16u - mis) & 15u) / sizeof(T)));
  }
  const i64 v0 = c0 + head;
  const i64 nvec = (c1 - v0) / VEC;
  const i64 t0 = v0 + nvec * VEC;
  for (i64 i = c0 + lane; i < v0; i += group) {
    float v[1] = {to_float<T>(x[i])};
    f(i, v);
  }
  for (i64 j = lane; j < nvec; j += group) {
    float v[VEC];
    load16_float<T>(x + v0 + j * VEC, v);
    f(v0 + j * VEC, v);
  }
  for (i64 i = t0 + lane; i < c1; i += group) {
    float v[1] = {to_float<T>(x[i])};
    f(i, v);
  }
}

// visit() callbacks: add elements to a thread's statistics, or write their probabilities.
struct StatsOp {
  MaxSum acc{neg_inf(), 0.f};
  template <int K>
  __device__ __forceinline__ void operator()(i64, const float (&v)[K]) { accumulate<K>(acc, v); }
};

template <typename T>
struct WriteOp {
  T* __restrict__ y;
  RowScale sc;
  template <int K>
  __device__ __forceinline__ void operator()(i64 i, float (&v)[K]) {
#pragma unroll
    for (int e = 0; e < K; ++e) v[e] = exp2f(fmaf(v[e], LOG2E, -sc.m)) * sc.inv;
    if constexpr (K == Vec16<T>::N) {
      store16_float<T>(y + i, v);
    } else {
      y[i] = from_float<T>(v[0]);
    }
  }
};

// This thread's share of the statistics of x[c0, c1).
template <typename T>
__device__ __forceinline__ MaxSum thread_stats(const T* __restrict__ x, i64 c0, i64 c1, int lane,
                                               int group, bool vec) {
  StatsOp op;
  visit<T>(x, c0, c1, lane, group, vec, op);
  return op.acc;
}

// Write the probabilities of x[c0, c1) to y (same alignment as x).
template <typename T>
__device__ __forceinline__ void write_probs(const T* __restrict__ x, T* __restrict__ y, i64 c0,
                                            i64 c1, int lane, int group, bool vec, RowScale sc) {
  WriteOp<T> op{y, sc};
  visit<T>(x, c0, c1, lane, group, vec, op);
}

__device__ __forceinline__ int head_of(i64 row, int heads, i64 rows_per_head) {
  return static_cast<int>((row / rows_per_head) % heads);
}

// Grid: ceil(num_rows / ROWS) blocks, ROWS = SINK_WARP_ROWS rows per CTA for GROUP = 32 (one
// warp per row) and 1 for GROUP = SINK_THREADS (the CTA per row). Block: 32 * SINK_WARP_ROWS
// or SINK_THREADS threads (both from cupaged.sink.api).
// Each group reads its row once for the online max/sum, merges the group's statistics and
// the sink, and reads the row again (mostly from cache) to write the probabilities.
template <typename T, int GROUP>
__global__ void __launch_bounds__(GROUP == 32 ? 32 * SINK_WARP_ROWS : GROUP)
sink_softmax_rows(CUPAGED_PARAMS_SinkSoftmaxArgs) {
  constexpr int ROWS = GROUP == 32 ? SINK_WARP_ROWS : 1;
  __shared__ MaxSum red[GROUP / 32];
  const i64 row = static_cast<i64>(blockIdx.x) * ROWS + threadIdx.x / GROUP;
  if (row >= num_rows) return;  // whole warps (GROUP 32) or the whole CTA
  const int lane = threadIdx.x % GROUP;
  const T* xr = x + row * n;
  MaxSum acc = thread_stats<T>(xr, 0, n, lane, GROUP, vec);
  acc = group_reduce<GROUP>(acc, red);
  const RowScale sc = row_scale(acc, sinks[head_of(row, heads, rows_per_head)]);
  write_probs<T>(xr, y + row * n, 0, n, lane, GROUP, vec, sc);
}

// Grid: num_rows * chunks blocks, block b -> row b / chunks, chunk c = b % chunks covering
// [c * chunk, min(n, (c + 1) * chunk)). Block: SINK_THREADS threads.
// Pass 1 of long rows: the CTA reduces its chunk to (m, s), stored at stats[2b], stats[2b + 1].
template <typename T>
__global__ void __launch_bounds__(SINK_THREADS)
sink_softmax_chunk_stats(CUPAGED_PARAMS_SinkSoftmaxArgs) {
  __shared__ MaxSum red[SINK_THREADS / 32];
  const i64 b = blockIdx.x;
  const i64 row = b / chunks, c0 = (b % chunks) * chunk;
  MaxSum acc = thread_stats<T>(x + row * n, c0, min(n, c0 + chunk), threadIdx.x, SINK_THREADS, vec);
  acc = group_reduce<SINK_THREADS>(acc, red);
  if (threadIdx.x == 0) {
    stats[2 * b] = acc.m;
    stats[2 * b + 1] = acc.s;
  }
}

// Grid and block as sink_softmax_chunk_stats. Pass 2: the CTA merges the `chunks` statistics
// of its row with the sink, then writes the probabilities of its chunk.
template <typename T>
__global__ void __launch_bounds__(SINK_THREADS)
sink_softmax_chunk_write(CUPAGED_PARAMS_SinkSoftmaxArgs) {
  __shared__ MaxSum red[SINK_THREADS / 32];
  const i64 b = blockIdx.x;
  const i64 row = b / chunks, c0 = (b % chunks) * chunk;
  MaxSum acc{neg_inf(), 0.f};
  for (int c = threadIdx.x; c < chunks; c += SINK_THREADS) {
    const i64 s = 2 * (row * chunks + c);
    acc = merge(acc, MaxSum{stats[s], stats[s + 1]});
  }
  acc = group_reduce<SINK_THREADS>(acc, red);
  const RowScale sc = row_scale(acc, sinks[head_of(row, heads, rows_per_head)]);
  write_probs<T>(x + row * n, y + row * n, c0, min(n, c0 + chunk), threadIdx.x, SINK_THREADS, vec,
                 sc);
}

}  // namespace cupaged
