// The score epilogue of every attention kernel, in docs/design.md's order: s = sm_scale * q.k;
// with a soft-cap (cap > 0) s = cap * tanh(s / cap); ALiBi adds slope * (j - p) (key j,
// query position p); the result in log2 units, as the kernels' softmax runs on exp2:
//   LOG2E * s = epi(q.k) + slope_log2 * (j - p),   slope_log2 = slope * LOG2E (0: no ALiBi)
//   epi(q.k)  = cap_log2 * tanh(q.k * scale_over_cap)   (cap > 0)
//             = q.k * scale_log2                        (no cap)
// with cap_log2 = cap * LOG2E, scale_over_cap = sm_scale / cap, scale_log2 = sm_scale * LOG2E.
// The ALiBi term is added where the kernel knows j and p (prefill's transform_scores and
// prefill_simt, the wgmma prefill's Rows::scores, decode's ScoreMods), always in that form.
//
// The plain case (positive scale, no soft-cap, no ALiBi: the plain paths of the sparse
// kernel and of the mma.sync and wgmma prefills) keeps raw dot products and folds
// scale_log2 into the exponential instead; that is the same score. The sparse kernel's
// general path (sparse_attention.cu, mask_keys) adds ALiBi in the form above too.
#pragma once
#include "common.cuh"

namespace cupaged {

struct ScoreEpilogue {
  float scale_log2, cap_log2, scale_over_cap;
  bool softcap;
  __device__ __forceinline__ void init(float sm_scale, float cap) {
    softcap = cap > 0.f;
    scale_log2 = sm_scale * LOG2E;
    cap_log2 = cap * LOG2E;
    scale_over_cap = softcap ? sm_scale / cap : 0.f;
  }
  // tanh(y) = 1 - 2 / (exp(2y) + 1): one MUFU op (the exp2), the reciprocal of d =
  // exp(2y) + 1 in [1, 2^64] (clamped: +-1 once exp(2y) leaves that range, so a large |s|
  // saturates to +-cap) from an exponent-flip first guess (relative error about 5 %) and three
  // Newton steps (< 1e-7) on the FMA pipe, which has the throughput to spare where the
  // multi-function unit does not (the softmax's exp2 needs it). Absolute error of tanh about
  // 1e-7 at every y, what a logit needs.
  // CAP: the soft-cap decided at compile time, for loops over a tile's scores that test
  // softcap once rather than at every score. FAST (the wgmma prefill, 16-bit inputs only):
  // tanh by the multi-function unit's tanh.approx.f32 (relative error about 2^-11, a few
  // 1e-4 of cap in the score, below a 16-bit output's resolution after the softmax), one op
  // where the reciprocal's Newton steps cost the FMA pipe eight, which that kernel's softmax
  // and conversions already fill.
  template <bool CAP, bool FAST = false>
  __device__ __forceinline__ float at(float dot) const {
    if (!CAP) return dot * scale_log2;
    if constexpr (FAST) {
      float t;
      asm("tanh.approx.f32 %0, %1;\n" : "=f"(t) : "f"(dot * scale_over_cap));
      return cap_log2 * t;
    }
    constexpr float BIG = 18446744073709551616.f;  // 2^64
    const float e = exp2f(dot * scale_over_cap * (2.f * LOG2E));
    const float d = (e > BIG ? BIG : e) + 1.f;  // a NaN stays NaN
    float r = __int_as_float(0x7EF311C3 - __float_as_int(d));
#pragma unroll
    for (int i = 0; i < 3; ++i) r = fmaf(r, fmaf(-d, r, 1.f), r);
    return cap_log2 * fmaf(-2.f, r, 1.f);
  }
  __device__ __forceinline__ float operator()(float dot) const {
    return softcap ? at<true>(dot) : at<false>(dot);
  }
};

}  // namespace cupaged
