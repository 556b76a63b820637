// The score epilogue of every attention kernel, in design.md's order: s = sm_scale * q.k;
// with a soft-cap (cap > 0) s = cap * tanh(s / cap); ALiBi adds slope * (j - p) (key j,
// query position p); then log2 units, as the kernels' softmax runs on exp2.
//
// Kernels that serve only the plain case (positive scale, no soft-cap, no ALiBi: the wgmma
// prefill and the sparse kernel, and the plain path of the mma.sync prefill) keep raw dot
// products and fold sm_scale * LOG2E into the exponential instead; that is the same score.
#pragma once
#include "common.cuh"

namespace cupaged {

struct ScoreEpilogue {
  float sm_scale, soft_cap, inv_cap, scale_log2;
  bool plain;  // no soft-cap, no ALiBi: one multiply

  // A raw dot product q.k of key j for the query at position p: dist = j - p, slope the
  // head's ALiBi slope (natural-log units; 0 without ALiBi). tanhf keeps the capped score
  // accurate to a few ulps in fp32 at every |s| (it saturates to +-cap).
  __device__ __forceinline__ float operator()(float dot, float slope, int dist) const {
    if (plain) return dot * scale_log2;
    float x = dot * sm_scale;
    if (soft_cap > 0.f) x = soft_cap * tanhf(x * inv_cap);
    return (x + slope * (float)dist) * LOG2E;
  }
};

// The epilogue of a call: scale, cap (<= 0: none), whether ALiBi slopes are given, and the
// scale in log2 units (default sm_scale * LOG2E).
__device__ __forceinline__ ScoreEpilogue score_epilogue(float sm_scale, float soft_cap, bool alibi,
                                                        float scale_log2) {
  return ScoreEpilogue{sm_scale, soft_cap, soft_cap > 0.f ? 1.f / soft_cap : 0.f, scale_log2,
                       soft_cap <= 0.f && !alibi};
}
__device__ __forceinline__ ScoreEpilogue score_epilogue(float sm_scale, float soft_cap, bool alibi) {
  return score_epilogue(sm_scale, soft_cap, alibi, sm_scale * LOG2E);
}

}  // namespace cupaged
