// Rotary position embedding of queries and keys in one launch.
//
// A token at position p turns rotated pair f of every head by theta[p, f]: (x1, x2) ->
// (x1 cos - x2 sin, x2 cos + x1 sin). The angles come precomputed as a float32 table
// [table_len, rotary_dim]: cos(theta[p, 0 .. rd/2)) then sin(theta[p, 0 .. rd/2)) per row.
// neox style pairs (x[f], x[f + rd/2]); GPT-J style pairs (x[2f], x[2f + 1]).
#include "common.cuh"

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

// Load K consecutive floats of the angle table; float4/float2 accesses when K allows (the
// host picks vector specialisations only where those are aligned).
template <int K>
__device__ __forceinline__ void load_floats(const float* __restrict__ p, float* out) {
  if constexpr (K % 4 == 0) {
#pragma unroll
    for (int i = 0; i < K; i += 4) {
      float4 v = __ldg(reinterpret_cast<const float4*>(p + i));
      out[i] = v.x; out[i + 1] = v.y; out[i + 2] = v.z; out[i + 3] = v.w;
    }
  } else if constexpr (K == 2) {
    float2 v = __ldg(reinterpret_cast<const float2*>(p));
    out[0] = v.x; out[1] = v.y;
  } else {
#pragma unroll
    for (int i = 0; i < K; ++i) out[i] = __ldg(p + i);
  }
}

// Grid: ceil(num_tokens * (q_heads + k_heads) * (rot_units + pass_units) / 256) blocks;
// block: 256 threads.
// Each thread owns one unit of one head of one token, VEC elements wide:
//  - a rotated unit: neox - VEC elements of the first half and the VEC matching elements of
//    the second half; GPT-J - VEC consecutive elements holding VEC/2 pairs. It reads the
//    token's cos/sin for those pairs from the table and writes the rotated values;
//  - a pass unit: VEC elements of [rotary_dim, head_dim), copied (none when in place).
// Heads [0, q_heads) are query heads, the rest key heads. In and out may alias (in place):
// every element is read and written by the same thread.
template <typename T, bool NEOX, int VEC>
__global__ void __launch_bounds__(256)
rope_kernel(const void* __restrict__ positions, int positions_are_64bit,
            const float* __restrict__ table, const T* q, const T* k, T* q_out, T* k_out,
            i64 num_tokens, int q_heads, int k_heads, int head_dim, int rotary_dim,
            int rot_units, int pass_units) {
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
  const i64 row = is_q ? (token * q_heads + head) * head_dim
                       : (token * k_heads + (head - q_heads)) * head_dim;
  const T* src = (is_q ? q : k) + row;
  T* dst = (is_q ? q_out : k_out) + row;

  if (unit >= rot_units) {  // -- pass-through copy --
    const int off = rotary_dim + (unit - rot_units) * VEC;
    float v[VEC];
    load_vec<T, VEC>(src + off, v);
    store_vec<T, VEC>(dst + off, v);
    return;
  }

  // -- this unit's cos / sin --
  const i64 pos = positions_are_64bit ? static_cast<const i64*>(positions)[token]
                                      : static_cast<i64>(static_cast<const int*>(positions)[token]);
  const int f0 = unit * PAIRS;
  const float* cs = table + pos * rotary_dim;
  float c[PAIRS], s[PAIRS];
  load_floats<PAIRS>(cs + f0, c);
  load_floats<PAIRS>(cs + rotary_dim / 2 + f0, s);

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
