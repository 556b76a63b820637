// Tiles of the vertical+slash estimate (sparse_estimate.cu): 64-key K tiles gathered into
// shared memory from a dense or paged cache, and the 64x64 score tile Q.K^T of four warps on
// tensor cores. (The attention kernel uses the dense kernel's tile core, attn_tile.cuh.)
//
// A CTA has 4 warps; warp w owns query rows [16w, 16w + 16) of a 64-row Q tile. Shared
// tiles are row-major [64][SROW] with SROW = D + 8: the 16-byte pad shifts consecutive rows
// by 4 banks, so ldmatrix reads of 8 rows are conflict-free for every head size.
#pragma once
#include "common.cuh"
#include "abi.cuh"
#include "mma.cuh"

namespace cupaged {

// SP_THREADS (4 warps), SP_ROWS (query rows a CTA tile), SP_KEYS (keys a K/V tile): from
// cupaged.sparse.launch
constexpr int NO_KEY = 0x7fffffff;  // key index of an empty tile row (masked everywhere)

template <int D> struct SpTile {
  static constexpr int SROW = D + 8;       // shared row stride (elements)
  static constexpr int CHUNKS = D / 8;     // 16-byte chunks per row (16-bit types)
  static constexpr int KSTEPS = D / 16;    // k-steps of Q.K^T
  static constexpr bool Q_IN_REGS = D <= 128;
};

// Where key j of one (sequence, kv head) lives: dense rows (table == nullptr) or pages.
struct KVRows {
  const int* table;   // the sequence's block table, or nullptr
  int page_size;
  i64 base;           // element offset of key 0 (dense) or of the kv head (paged)
  i64 page_stride;    // elements per page (paged)
  i64 tok_stride;     // elements between consecutive keys of one page / dense rows

  __device__ __forceinline__ i64 offset(int j) const {
    if (table == nullptr) return base + (i64)j * tok_stride;
    const int page = table[j / page_size];
    return base + (i64)page * page_stride + (i64)(j % page_size) * tok_stride;
  }
};

// Issue cp.async loads of the 64 key rows key_of(r) (all D columns of K) into a [64][D + 8]
// shared tile; rows with key_of(r) == NO_KEY are zero-filled.
template <typename T, int D, typename KeyOf>
__device__ __forceinline__ void load_k_tile(T* sk, const T* __restrict__ k, const KVRows& rows, KeyOf key_of) {
  constexpr int CK = D / 8, SROW = D + 8;
#pragma unroll
  for (int it = 0; it < SP_KEYS * CK / SP_THREADS; ++it) {
    const int i = threadIdx.x + it * SP_THREADS;
    const int r = i / CK, c = i - r * CK;
    const int j = key_of(r);
    const bool ok = j != NO_KEY;
    const i64 off = ok ? rows.offset(j) + c * 8 : 0;
    cp_async16(sk + r * SROW + c * 8, k + off, ok ? 16 : 0);
  }
}

// Load 64 query rows of one head ([tokens, heads, D] rows row0 + r, r < valid) into sq.
template <typename T, int D>
__device__ __forceinline__ void load_q_tile(T* sq, const T* __restrict__ q, i64 row0,
                                            int valid, int num_heads, int head) {
  using Tl = SpTile<D>;
#pragma unroll
  for (int it = 0; it < SP_ROWS * Tl::CHUNKS / SP_THREADS; ++it) {
    const int i = threadIdx.x + it * SP_THREADS;
    const int r = i / Tl::CHUNKS, c = i - r * Tl::CHUNKS;
    const bool ok = r < valid;
    const i64 off = ok ? ((row0 + r) * num_heads + head) * D + c * 8 : 0;
    cp_async16(sq + r * Tl::SROW + c * 8, q + off, ok ? 16 : 0);
  }
}

// Query operand of Q.K^T: fragments held in registers (D <= 128) or re-read from shared.
template <typename T, int D> struct QOperand {
  using Tl = SpTile<D>;
  u32 f[Tl::Q_IN_REGS ? Tl::KSTEPS : 1][4];

  __device__ __forceinline__ void load(const T* sq, int warp, int lane) {
    if constexpr (Tl::Q_IN_REGS) {
#pragma unroll
      for (int kk = 0; kk < Tl::KSTEPS; ++kk)
        ldmatrix_x4(f[kk], sq + (warp * 16 + ldm_a_row(lane)) * Tl::SROW + kk * 16 + ldm_a_col(lane));
    }
  }

  __device__ __forceinline__ void get(u32 (&a)[4], const T* sq, int kk, int warp, int lane) const {
    if constexpr (Tl::Q_IN_REGS) {
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = f[kk][i];
    } else {
      ldmatrix_x4(a, sq + (warp * 16 + ldm_a_row(lane)) * Tl::SROW + kk * 16 + ldm_a_col(lane));
    }
  }
};

// s[j][e] = score of (row g + 8 * (e >> 1), key 8j + 2t + (e & 1)) of this warp's 16 rows
// against the 64 keys of sk (g = lane / 4, t = lane % 4), fp32, unscaled.
template <typename T, int D>
__device__ __forceinline__ void qk_tile(float (&s)[8][4], const QOperand<T, D>& qop,
                                        const T* sq, const T* sk, int warp, int lane) {
  using Tl = SpTile<D>;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
#pragma unroll
  for (int kk = 0; kk < Tl::KSTEPS; ++kk) {
    u32 a[4];
    qop.get(a, sq, kk, warp, lane);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      u32 b[4];
      ldmatrix_x4(b, sk + (np * 16 + ldm_bnk_row(lane)) * Tl::SROW + kk * 16 + ldm_bnk_col(lane));
      mma_16816<T>(s[2 * np], a, b[0], b[1]);
      mma_16816<T>(s[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// Max and sum over the 4 threads of a quad (the threads sharing a fragment row).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

}  // namespace cupaged
