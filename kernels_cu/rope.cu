// Rotary position embedding of queries and keys in one launch.
//
// A token at position p turns rotated pair f of every head by theta = p * inv_freq[f]:
// (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). inv_freq (float64, [rotary_dim / 2]) holds
// the base's frequencies with the scaling folded in (rope.py); the angle is formed and
// reduced modulo 2 pi in float64, so that large positions keep their precision, and its
// cosine and sine taken in float32. neox style pairs (x[f], x[f + rd/2]); GPT-J style
// pairs (x[2f], x[2f + 1]).
#include "common.cuh"
#include "abi.cuh"

namespace cupaged {

// Load / store VEC elements of T as floats: one 16-byte access when VEC * sizeof(T) == 16.
template <typename T, int VEC>
__device__ __forceinline__ void load_vec(const T* p, float* out) {
  if constexpr (VEC == Vec16<T>::N) {
    load16_float<T>(p, out);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = to_float<T>(p[i]);
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void store_vec(T* p, const float* in) {
  if constexpr (VEC == Vec16<T>::N) {
    store16_float<T>(p, in);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) p[i] = from_float<T>(in[i]);
  }
}

// cos and sin of the angles of pairs f0 .. f0 + K - 1 at position pos.
template <int K>
__device__ __forceinline__ void angles(const double* __restrict__ inv_freq, i64 pos, int f0,
                                       float* c, float* s) {
  constexpr double TWO_PI = 6.283185307179586;
#pragma unroll
  for (int i = 0; i < K; ++i) {
    const double theta = (double)pos * __ldg(inv_freq + f0 + i);
    const float r = (float)(theta - rint(theta * (1.0 / TWO_PI)) * TWO_PI);
    sincosf(r, &s[i], &c[i]);
  }
}

// Grid: ceil(num_tokens * (q_heads + k_heads) * (rot_units + pass_units) / ROPE_THREADS)
// blocks; block: ROPE_THREADS threads (cupaged.rope.api).
// Each thread owns one unit of one head of one token, VEC elements wide:
//  - a rotated unit: neox - VEC elements of the first half and the VEC matching elements of
//    the second half; GPT-J - VEC consecutive elements holding VEC/2 pairs. It forms the
//    token's angles for those pairs and writes the rotated values;
//  - a pass unit: VEC elements of [rotary_dim, head_dim), copied (none when in place).
// Heads [0, q_heads) are query heads, the rest key heads; token t's rows start at t * q_tok
// (k_tok; q_out, k_out: qo_tok, ko_tok), heads head_dim apart. In and out may alias (in
// place): every element is read and written by the same thread. A position outside
// [0, max_positions) (max_positions < 0: no bound) is reported and its rows written as zeros.
template <typename T, bool NEOX, int VEC>
__global__ void __launch_bounds__(ROPE_THREADS) rope_kernel(CUPAGED_PARAMS_RopeArgs) {
  constexpr int PAIRS = NEOX ? VEC : VEC / 2;  // rotated pairs per rotated unit
  const int units = rot_units + pass_units;
  const i64 idx = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x;
  const i64 per_token = static_cast<i64>(q_heads + k_heads) * units;
  if (idx >= num_tokens * per_token) return;
  const i64 token = idx / per_token;
  const int rem = static_cast<int>(idx - token * per_token);
  const int head = rem / units;
  const int unit = rem - head * units;

  // -- locate this head's row --
  const bool is_q = head < q_heads;
  const int h = is_q ? head : head - q_heads;
  const T* src = (is_q ? q + token * q_tok : k + token * k_tok) + (i64)h * head_dim;
  T* dst = (is_q ? q_out + token * qo_tok : k_out + token * ko_tok) + (i64)h * head_dim;
  const i64 pos = positions_are_64bit ? static_cast<const i64*>(positions)[token]
                                      : static_cast<i64>(static_cast<const int*>(positions)[token]);
  const bool bad = pos < 0 || (max_positions >= 0 && pos >= max_positions);
  if (bad && rem == 0)
    report_error(err, error_code(ARG_POSITIONS, CHECK_RANGE), token, -1, pos, max_positions);

  if (unit >= rot_units) {  // -- pass-through copy --
    const int off = rotary_dim + (unit - rot_units) * VEC;
    float v[VEC];
    load_vec<T, VEC>(src + off, v);
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = bad ? 0.f : v[i];
    store_vec<T, VEC>(dst + off, v);
    return;
  }

  // -- this unit's cos / sin (zeros for a bad position: its rotated elements become 0) --
  const int f0 = unit * PAIRS;
  float c[PAIRS], s[PAIRS];
  angles<PAIRS>(inv_freq, bad ? 0 : pos, f0, c, s);
#pragma unroll
  for (int i = 0; i < PAIRS; ++i) {
    c[i] = bad ? 0.f : c[i];
    s[i] = bad ? 0.f : s[i];
  }

  // -- rotate --
  if constexpr (NEOX) {
    const int half = rotary_dim / 2;
    float x1[VEC], x2[VEC];
    load_vec<T, VEC>(src + f0, x1);
    load_vec<T, VEC>(src + half + f0, x2);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const float a = x1[i], b = x2[i];
      x1[i] = a * c[i] - b * s[i];
      x2[i] = b * c[i] + a * s[i];
    }
    store_vec<T, VEC>(dst + f0, x1);
    store_vec<T, VEC>(dst + half + f0, x2);
  } else {
    float x[VEC];
    load_vec<T, VEC>(src + 2 * f0, x);
#pragma unroll
    for (int i = 0; i < PAIRS; ++i) {
      const float a = x[2 * i], b = x[2 * i + 1];
      x[2 * i] = a * c[i] - b * s[i];
      x[2 * i + 1] = b * c[i] + a * s[i];
    }
    store_vec<T, VEC>(dst + 2 * f0, x);
  }
}

}  // namespace cupaged
