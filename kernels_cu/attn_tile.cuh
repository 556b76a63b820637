// The tensor-core attention tile (FlashAttention-2 style, mma.sync m16n8k16) shared by the
// dense prefill kernel (prefill.cu) and the block-sparse kernel (sparse_attention.cu): tile
// shapes, S = Q K^T and O += P V for a warp's m-tiles, the online softmax step, probabilities
// as A fragments, and the final normalisation of a row (sink, LSE).
//
// A warp owns C::MT 16-row m-tiles; fragments follow mma.cuh's layouts (thread (g, t) of a
// quad holds rows g and g + 8 of each m-tile). Scores stay in the units of the raw dot
// product until the softmax step folds the scale (log2 units) into one FFMA per element.
#pragma once
#include "attn_common.cuh"
#include "mma.cuh"

namespace cupaged {

// Tile shape of the tensor-core kernel: WARPS warps of MT 16-row m-tiles each (every K/V
// fragment a warp loads feeds its MT m-tiles); BLOCK_N keys per K/V tile; STAGES K and V
// buffers (1: FlashAttention-2 order, V_n streams in during S = Q K_n^T and K_{n-1} during
// O += P V_n, two barriers per tile; 2: all of tile n-1 streams in while tile n computes, one
// barrier per tile); Q_REGS: the warp's Q fragments stay in registers (else they are re-read
// from shared memory for every K tile); CTAS: CTAs per SM that __launch_bounds__ aims for.
template <int WARPS_, int MT_, int BLOCK_N_, int STAGES_, bool Q_REGS_, int CTAS_>
struct TileShape {
  static constexpr int WARPS = WARPS_, MT = MT_, BLOCK_N = BLOCK_N_, STAGES = STAGES_, CTAS = CTAS_;
  static constexpr bool Q_REGS = Q_REGS_;
  static_assert(STAGES == 1 || STAGES == 2, "one or two K/V stages");
  static_assert(BLOCK_N % 16 == 0, "BLOCK_N is a multiple of the mma k-step");
};

// Derived sizes for head size D (elements; V_T: the V tile is stored transposed).
template <typename T, int D, typename S, bool V_T>
struct MmaConfig : S {
  static constexpr int THREADS = 32 * S::WARPS;
  static constexpr int BLOCK_M = 16 * S::MT * S::WARPS;  // packed rows per CTA
  static constexpr int LD = D + 8;                        // padded smem row (conflict-free ldmatrix)
  static constexpr int LDT = S::BLOCK_N + 8;              // padded row of a transposed V tile
  static constexpr int CHUNKS = D / 8;                    // 16-byte chunks per row
  static constexpr int CL = CHUNKS <= 8 ? 8 : CHUNKS <= 16 ? 16 : 32;  // threads per row in loads
  static constexpr int ROW_STEP = THREADS / CL;           // rows per load pass
  static constexpr int E = sizeof(T);                     // bytes per element
  static constexpr u32 Q_BYTES = BLOCK_M * LD * E;
  static constexpr u32 K_BYTES = S::BLOCK_N * LD * E;
  static constexpr u32 V_BYTES = (V_T ? D * LDT : S::BLOCK_N * LD) * E;
  static_assert(S::BLOCK_N % ROW_STEP == 0 && BLOCK_M % ROW_STEP == 0, "whole load passes");
};

// a * b for non-negative 32-bit values, as one 32 x 32 -> 64-bit multiply
__device__ __forceinline__ unsigned long long wide(u32 a, u32 b) { return (unsigned long long)a * b; }

// S = Q K^T (raw dots) for the warp's MT m-tiles over one K tile; Q fragments from registers
// (qf) or from the warp's rows of sQ (sQw).
template <typename T, int D, typename C, int QM, int QK>
__device__ __forceinline__ void compute_qk(float (&s)[C::MT][C::BLOCK_N / 8][4], const u32 (&qf)[QM][QK][4],
                                           u32 sQw, u32 sK, int lane) {
  const u32 qa = sQw + (ldm_a_row(lane) * C::LD + ldm_a_col(lane)) * C::E;
  const u32 kb = sK + (ldm_bnk_row(lane) * C::LD + ldm_bnk_col(lane)) * C::E;
#pragma unroll
  for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
    for (int i = 0; i < C::BLOCK_N / 8; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    u32 a[C::MT][4];
#pragma unroll
    for (int mt = 0; mt < C::MT; ++mt) {
      if constexpr (C::Q_REGS) {
#pragma unroll
        for (int i = 0; i < 4; ++i) a[mt][i] = qf[mt][kk][i];
      } else {
        ldmatrix_x4(a[mt], qa + (16 * mt * C::LD + kk * 16) * C::E);
      }
    }
#pragma unroll
    for (int nn = 0; nn < C::BLOCK_N / 16; ++nn) {
      u32 bk[4];
      ldmatrix_x4(bk, kb + (nn * 16 * C::LD + kk * 16) * C::E);
#pragma unroll
      for (int mt = 0; mt < C::MT; ++mt) {
        mma_16816<T>(s[mt][2 * nn], a[mt], bk[0], bk[1]);
        mma_16816<T>(s[mt][2 * nn + 1], a[mt], bk[2], bk[3]);
      }
    }
  }
}

// O += P V for the warp's MT m-tiles (P as A fragments, V rows or transposed V in smem).
template <typename T, int D, typename C, bool V_T>
__device__ __forceinline__ void compute_pv(float (&o)[C::MT][D / 8][4], const u32 (&pf)[C::MT][C::BLOCK_N / 16][4],
                                           u32 sV, int lane) {
  const u32 vb = V_T ? sV + (ldm_bnk_row(lane) * C::LDT + ldm_bnk_col(lane)) * C::E
                     : sV + (ldm_bkn_row(lane) * C::LD + ldm_bkn_col(lane)) * C::E;
#pragma unroll
  for (int kk = 0; kk < C::BLOCK_N / 16; ++kk)
#pragma unroll
    for (int dd = 0; dd < D / 16; ++dd) {
      u32 bv[4];
      if constexpr (V_T) ldmatrix_x4(bv, vb + (dd * 16 * C::LDT + kk * 16) * C::E);
      else ldmatrix_x4_trans(bv, vb + (kk * 16 * C::LD + dd * 16) * C::E);
#pragma unroll
      for (int mt = 0; mt < C::MT; ++mt) {
        mma_16816<T>(o[mt][2 * dd], pf[mt][kk], bv[0], bv[1]);
        mma_16816<T>(o[mt][2 * dd + 1], pf[mt][kk], bv[2], bv[3]);
      }
    }
}

// Online softmax step of one m-tile: scores s (sc * s in log2 units, sc > 0) update the
// running max m (in the units of s), the thread-partial sum l and the accumulators o, and
// turn into probabilities exp2(sc * s - sc * m) with one FFMA + EX2 each. The accumulators
// are rescaled only when the max of some row of the warp changed.
template <int NT_S, int NT_O>
__device__ __forceinline__ void online_softmax(float (&s)[NT_S][4], float (&o)[NT_O][4], float (&m)[2],
                                               float (&l)[2], float sc) {
  float alpha[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float mx = m[hr];
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * hr], s[nt][2 * hr + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_sc = mx == neg_inf() ? 0.f : mx * sc;  // no key yet: p = 0, no NaN
    alpha[hr] = mx == m[hr] ? 1.f : fast_exp2(fmaf(m[hr], sc, -m_sc));
    m[hr] = mx;
    float rs = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt) {
      s[nt][2 * hr] = fast_exp2(fmaf(s[nt][2 * hr], sc, -m_sc));
      s[nt][2 * hr + 1] = fast_exp2(fmaf(s[nt][2 * hr + 1], sc, -m_sc));
      rs += s[nt][2 * hr] + s[nt][2 * hr + 1];
    }
    l[hr] = fmaf(l[hr], alpha[hr], rs);
  }
  if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
    for (int dt = 0; dt < NT_O; ++dt) {
      o[dt][0] *= alpha[0];
      o[dt][1] *= alpha[0];
      o[dt][2] *= alpha[1];
      o[dt][3] *= alpha[1];
    }
  }
}

// Probabilities of one m-tile (C fragments of S) -> A fragments of P for O += P V.
template <typename T, int KS_P>
__device__ __forceinline__ void pack_p(u32 (&pf)[KS_P][4], const float (&s)[2 * KS_P][4]) {
#pragma unroll
  for (int kk = 0; kk < KS_P; ++kk) {
    pf[kk][0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
    pf[kk][1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
    pf[kk][2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    pf[kk][3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
  }
}

// Q tile: tile rows [0, t.rows) -> sQ [BLOCK_M][LD] (row r is query token t.token_row(r) of head
// t.head(r), at q + token * q_tok + head * D); rows past t.rows zero-filled.
template <typename T, int D, typename C, typename Rows>
__device__ __forceinline__ void load_q_tile(const T* q, i64 q_tok, const Rows& t, u32 sQ) {
  const int c = threadIdx.x % C::CL, r0 = threadIdx.x / C::CL;
  if (C::CL != C::CHUNKS && c >= C::CHUNKS) return;
#pragma unroll
  for (int i = 0; i < C::BLOCK_M / C::ROW_STEP; ++i) {
    const int r = r0 + i * C::ROW_STEP;
    const u32 dst = sQ + (r * C::LD + c * 8) * C::E;
    if (r < t.rows) cp_async16(dst, q + t.token_row(r) * q_tok + (i64)t.head(r) * D + c * 8);
    else cp_async16(dst, q, 0);
  }
}

// Normalise the m-tile at tile row `first` (m in log2 units), write its LSE ([tokens,
// num_q_heads], if lse), stage it in its own sQ rows and store 16-byte rows to out (rows as in
// load_q_tile), times out_scale (an fp8 cache's v_scale). Only the calling warp may still
// read those rows (its own ldmatrix of Q).
template <typename T, int D, typename C, typename Rows>
__device__ __forceinline__ void store_rows(T* out, float* lse, const float* sinks, int num_q_heads,
                                           const Rows& t, int first,
                                           float (&o)[D / 8][4], const float (&m)[2], float (&l)[2],
                                           T* sQ, int lane, float out_scale = 1.f) {
  float inv[2];
  finish_warp_rows(t, first, m, l, sinks, lse, num_q_heads, inv, lane);
  inv[0] *= out_scale;
  inv[1] *= out_scale;
  if (first >= t.rows) return;  // warp-uniform
  // The warp's last compute_qk may have read these rows (Q fragments, Q_REGS false) with
  // ldmatrix, whose row addresses come from other lanes than the ones staging here: order
  // those reads before the stores.
  __syncwarp();
  T* stage = sQ + first * C::LD;
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr)
      *reinterpret_cast<u32*>(stage + (lane / 4 + 8 * hr) * C::LD + dt * 8 + 2 * (lane % 4)) =
          pack2<T>(o[dt][2 * hr] * inv[hr], o[dt][2 * hr + 1] * inv[hr]);
  __syncwarp();
#pragma unroll
  for (int idx = lane; idx < 16 * C::CHUNKS; idx += 32) {
    const int r = idx / C::CHUNKS, c = idx % C::CHUNKS;
    if (first + r < t.rows)
      *reinterpret_cast<uint4*>(out + (t.token_row(first + r) * num_q_heads + t.head(first + r)) * D + c * 8) =
          *reinterpret_cast<const uint4*>(stage + r * C::LD + c * 8);
  }
}

}  // namespace cupaged
