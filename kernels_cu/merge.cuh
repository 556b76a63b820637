// Merging partial attention states: the combine step of split-KV attention.
//
// A state is an output o_s normalised over its own keys and the natural-log sum of
// exponentials lse_s of their scores. States over disjoint key sets combine as
//   M   = max(max_s lse_s, sink)          w_s = exp(lse_s - M)
//   den = sum_s w_s + exp(sink - M)       out = sum_s w_s o_s / den      lse = M + log(den)
// An empty state has lse_s = -inf and weight 0. A row with no non-empty state and no sink
// (sink = -inf) gives zeros and lse = -inf. merge_row_warp serves any two states
// (merge_states); merge_pieces_row / merge_group the float32 pieces of split-KV decode.
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

// ---------------------------------------------------------------------------- decode pieces
// Split-KV decode leaves, per query head, one float32 partial row (normalised over its
// piece's keys) and one natural-log LSE per piece. merge_pieces_row merges the `np` pieces
// of one head: piece s at o + s * o_stride (dim floats, a multiple of 4, 16-byte aligned)
// and l + s * l_stride. One warp: lane j owns the 4-float chunks j + 32 * ch (CH = 1 up to
// dim 128, 2 beyond) and keeps BATCH pieces' chunks in flight at once; the weight of piece
// s0 + j is computed by lane j and handed out by shuffle. The first batch of rows is loaded
// with the LSEs (a row's address needs no weight), so that a row of up to BATCH pieces costs
// one round trip, not two. Loads go to L2 (__ldcg): other CTAs of the running kernel may
// have written the pieces. Read rows are discarded from L2.
template <typename TO>
__device__ __forceinline__ void store4(TO* __restrict__ p, float4 v) {
  p[0] = from_float<TO>(v.x);
  p[1] = from_float<TO>(v.y);
  p[2] = from_float<TO>(v.z);
  p[3] = from_float<TO>(v.w);
}

// Pieces [s, s + BATCH) of a row that are below np: lane's chunks (zeros past np or dim).
template <int BATCH, int CH>
__device__ __forceinline__ void load_pieces(float4 (&v)[BATCH][CH], const float* __restrict__ o,
                                            i64 o_stride, int s, int np, int dim, int lane) {
#pragma unroll
  for (int u = 0; u < BATCH; ++u)
#pragma unroll
    for (int ch = 0; ch < CH; ++ch) {
      const int c = lane + 32 * ch;
      const float4* src = reinterpret_cast<const float4*>(o + (s + u) * o_stride) + c;
      v[u][ch] = s + u < np && 4 * c < dim ? __ldcg(src) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
}

// acc += the weights of pieces [s0 + j0, s0 + j0 + BATCH) (lane j of the warp holds piece
// s0 + j's) times their chunks v.
template <int BATCH, int CH>
__device__ __forceinline__ void add_pieces(float4 (&acc)[CH], const float4 (&v)[BATCH][CH],
                                           float w_mine, int j0) {
#pragma unroll
  for (int u = 0; u < BATCH; ++u) {
    const float w = __shfl_sync(0xffffffffu, w_mine, (j0 + u) & 31);
#pragma unroll
    for (int ch = 0; ch < CH; ++ch) {
      acc[ch].x += w * v[u][ch].x;
      acc[ch].y += w * v[u][ch].y;
      acc[ch].z += w * v[u][ch].z;
      acc[ch].w += w * v[u][ch].w;
    }
  }
}

template <typename TO, int CH>
__device__ void merge_pieces_row(const float* __restrict__ o, i64 o_stride,
                                 const float* __restrict__ l, i64 l_stride, int np, float sink,
                                 int dim, TO* __restrict__ out, float* __restrict__ lse_out,
                                 int lane) {
  constexpr int BATCH = 16 / CH;  // divides 32: a batch never straddles two weight chunks
  // -- the LSEs (lane j: pieces j, j + 32, ...) and the first batch of rows, in flight together
  const float l0 = lane < np ? __ldcg(l + lane * l_stride) : minus_inf();
  float4 v[BATCH][CH];
  load_pieces<BATCH, CH>(v, o, o_stride, 0, np, dim, lane);
  // -- max and denominator
  float m = fmaxf(sink, l0);
  for (int s = lane + 32; s < np; s += 32) m = fmaxf(m, __ldcg(l + s * l_stride));
  m = warp_max(m);
  const float m_use = m == minus_inf() ? 0.f : m;
  float den = exp2f((l0 - m_use) * LOG2E);
  for (int s = lane + 32; s < np; s += 32) den += exp2f((__ldcg(l + s * l_stride) - m_use) * LOG2E);
  den = warp_sum(den) + exp2f((sink - m_use) * LOG2E);
  const float inv = den > 0.f ? 1.f / den : 0.f;

  // -- weighted sum of the rows, batch after batch (the first one already loaded)
  float4 acc[CH];
#pragma unroll
  for (int ch = 0; ch < CH; ++ch) acc[ch] = make_float4(0.f, 0.f, 0.f, 0.f);
  float w_mine = exp2f((l0 - m_use) * LOG2E) * inv;
  for (int s = 0; s < np; s += BATCH) {
    if (s > 0) {
      if ((s & 31) == 0) {  // the weights of pieces s .. s + 31
        const float ls = s + lane < np ? __ldcg(l + (s + lane) * l_stride) : minus_inf();
        w_mine = exp2f((ls - m_use) * LOG2E) * inv;
      }
      load_pieces<BATCH, CH>(v, o, o_stride, s, np, dim, lane);
    }
    add_pieces<BATCH, CH>(acc, v, w_mine, s);
  }
  // the rows are dead once read: drop their lines from L2 unwritten (whole lines only: rows
  // of a multiple of 32 floats, so that no line holds part of another head's row)
  __syncwarp();
  if ((dim & 31) == 0 && (lane & 7) == 0)
    for (int s = 0; s < np; ++s)
#pragma unroll
      for (int ch = 0; ch < CH; ++ch)
        if (4 * (lane + 32 * ch) < dim)
          discard_l2_line(reinterpret_cast<const float4*>(o + s * o_stride) + lane + 32 * ch);
#pragma unroll
  for (int ch = 0; ch < CH; ++ch)
    if (4 * (lane + 32 * ch) < dim) store4<TO>(out + 4 * (lane + 32 * ch), acc[ch]);
  if (lane == 0 && lse_out != nullptr) *lse_out = den > 0.f ? m_use + logf(den) : minus_inf();
}

// Merges the pieces of one row group (sequence, kv head, head chunk): its `heads` query heads'
// partial rows for piece s sit at row ((slot0 + s) * ny + y) * hpc + h of part_out
// [rows][dim] and part_lse [rows] (ny row groups per sequence, hpc heads per row group).
// Warps warp, warp + nwarps, ... take one head each; out, lse and sinks (either may be null)
// point at the row group's first head.
template <typename TO, int CH>
__device__ void merge_group(const float* __restrict__ part_out, const float* __restrict__ part_lse,
                            int slot0, int np, int ny, int y, int hpc, int heads, int dim,
                            const float* __restrict__ sinks, TO* __restrict__ out,
                            float* __restrict__ lse, int warp, int nwarps, int lane) {
  const i64 stride = (i64)ny * hpc;  // rows from one piece to the next
  for (int h = warp; h < heads; h += nwarps) {
    const i64 row = ((i64)slot0 * ny + y) * hpc + h;
    merge_pieces_row<TO, CH>(part_out + row * dim, stride * dim, part_lse + row, stride, np,
                             sinks != nullptr ? sinks[h] : minus_inf(), dim, out + (i64)h * dim,
                             lse != nullptr ? lse + h : nullptr, lane);
  }
}

}  // namespace cupaged
