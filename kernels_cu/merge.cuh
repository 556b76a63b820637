// Merging partial attention states: the combine step of split-KV attention.
//
// A state is an output o_s normalised over its own keys and the natural-log sum of
// exponentials lse_s of their scores. States over disjoint key sets combine as
//   M   = max(max_s lse_s, sink)          w_s = exp(lse_s - M)
//   den = sum_s w_s + exp(sink - M)       out = sum_s w_s o_s / den      lse = M + log(den)
// An empty state has lse_s = -inf and weight 0 (its o_s is not read). A row with no
// non-empty state and no sink (sink = -inf) gives zeros and lse = -inf.
#pragma once
#include "common.cuh"

namespace cupaged {

// -inf as a float (NVRTC has no INFINITY macro).
__device__ __forceinline__ float minus_inf() { return __int_as_float(0xff800000); }

// The parts of one row: part 0 at `first`, part s >= 1 at `rest + (s - 1) * stride`
// (elements). Covers split partials at a fixed stride and two unrelated arrays alike.
template <typename TI>
struct PartRow {
  const TI* first;
  const TI* rest;
  i64 stride;
  __device__ __forceinline__ const TI* part(int s) const {
    return s == 0 ? first : rest + (s - 1) * stride;
  }
};

// One warp merges one row of `dim` elements (all 32 lanes must call it).
// Lane j holds the normalised weight of part s0 + j of each chunk of 32 parts and hands it
// to the other lanes by shuffle, so every weight is computed once per row.
template <typename TI, typename TO>
__device__ void merge_row_warp(PartRow<TI> o, PartRow<float> lse, int num_parts, float sink,
                               int dim, TO* __restrict__ out, float* __restrict__ lse_out) {
  const int lane = threadIdx.x & 31;
  float m = sink;
  for (int s = lane; s < num_parts; s += 32) m = fmaxf(m, *lse.part(s));
  m = warp_max(m);
  const float m_use = m == minus_inf() ? 0.f : m;
  float den = 0.f;
  for (int s = lane; s < num_parts; s += 32) den += exp2f((*lse.part(s) - m_use) * LOG2E);
  den = warp_sum(den) + exp2f((sink - m_use) * LOG2E);
  const float inv = den > 0.f ? 1.f / den : 0.f;

  for (int d0 = 0; d0 < dim; d0 += 32) {
    const int d = d0 + lane;
    float acc = 0.f;
    for (int s0 = 0; s0 < num_parts; s0 += 32) {
      const int s = s0 + lane;
      const float w_mine = s < num_parts ? exp2f((*lse.part(s) - m_use) * LOG2E) * inv : 0.f;
      const int n = min(32, num_parts - s0);
      for (int j = 0; j < n; ++j) {
        const float w = __shfl_sync(0xffffffffu, w_mine, j);
        if (w > 0.f && d < dim) acc += w * to_float<TI>(o.part(s0 + j)[d]);
      }
    }
    if (d < dim) out[d] = from_float<TO>(acc);
  }
  if (lane == 0 && lse_out != nullptr) *lse_out = den > 0.f ? m_use + logf(den) : minus_inf();
}

}  // namespace cupaged
