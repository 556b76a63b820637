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
  const float m_use = m == neg_inf() ? 0.f : m;
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
  if (lane == 0 && lse_out != nullptr) *lse_out = den > 0.f ? m_use + logf(den) : neg_inf();
}

// ---------------------------------------------------------------------------- decode pieces
// Split-KV decode leaves, per query head, one float32 partial row (normalised over its
// piece's keys) and one natural-log LSE per piece: piece s of a head at o + s * o_stride
// (dim floats, a multiple of 4, 16-byte aligned) and l + s * l_stride. A warp merges a run
// of pieces [s0, s1) into a RowShare, relative to the run's own max: lane j owns the
// 4-float chunks j + 32 * ch (CH = 1 up to dim 128, 2 beyond) and keeps BATCH pieces'
// chunks in flight at once; the weight of piece s0 + j is computed by lane j and handed out
// by shuffle. The first batch of rows is loaded with the LSEs (a row's address needs no
// weight), so that a run of up to BATCH pieces costs one round trip. Shares of one head
// combine (several warps may split its pieces), and write_merged adds the sink and writes
// the row. Loads go to L2 (__ldcg): other CTAs of the running kernel may have written the
// pieces. Read rows are discarded from L2.
template <typename TO>
__device__ __forceinline__ void store4(TO* __restrict__ p, float4 v) {
  p[0] = from_float<TO>(v.x);
  p[1] = from_float<TO>(v.y);
  p[2] = from_float<TO>(v.z);
  p[3] = from_float<TO>(v.w);
}

// Pieces [s, s + BATCH) of a row that are below s1: lane's chunks (zeros past s1 or dim).
template <int BATCH, int CH>
__device__ __forceinline__ void load_pieces(float4 (&v)[BATCH][CH], const float* __restrict__ o,
                                            i64 o_stride, int s, int s1, int dim, int lane) {
#pragma unroll
  for (int u = 0; u < BATCH; ++u)
#pragma unroll
    for (int ch = 0; ch < CH; ++ch) {
      const int c = lane + 32 * ch;
      const float4* src = reinterpret_cast<const float4*>(o + (s + u) * o_stride) + c;
      v[u][ch] = s + u < s1 && 4 * c < dim ? __ldcg(src) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
}

// acc += the weights of pieces [j0, j0 + BATCH) of a 32-piece chunk (lane j holds piece
// j's) times their chunks v.
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

// A run of pieces merged relative to its max lse m (-inf: no keys): den = sum_s exp(lse_s - m)
// and acc = sum_s exp(lse_s - m) o_s (lane's chunks), not yet normalised.
template <int CH>
struct RowShare {
  float m, den;
  float4 acc[CH];

  // this = this (+) r: both rescaled to the larger max.
  __device__ __forceinline__ void combine(const RowShare& r) {
    const float mx = fmaxf(m, r.m);
    const float m_use = mx == neg_inf() ? 0.f : mx;
    const float a = exp2f((m - m_use) * LOG2E), b = exp2f((r.m - m_use) * LOG2E);
    m = mx;
    den = den * a + r.den * b;
#pragma unroll
    for (int ch = 0; ch < CH; ++ch) {
      acc[ch].x = acc[ch].x * a + r.acc[ch].x * b;
      acc[ch].y = acc[ch].y * a + r.acc[ch].y * b;
      acc[ch].z = acc[ch].z * a + r.acc[ch].z * b;
      acc[ch].w = acc[ch].w * a + r.acc[ch].w * b;
    }
  }
};

// One warp's RowShare of pieces [s0, s1) of a head (all 32 lanes must call it; s0 == s1
// gives the empty share).
template <int CH>
__device__ RowShare<CH> merge_pieces_share(const float* __restrict__ o, i64 o_stride,
                                           const float* __restrict__ l, i64 l_stride, int s0,
                                           int s1, int dim, int lane) {
  constexpr int BATCH = 16 / CH;  // divides 32: a batch never straddles two weight chunks
  // -- the LSEs (lane j: pieces s0 + j, s0 + j + 32, ...) and the first batch of rows, in
  // flight together
  const float l0 = s0 + lane < s1 ? __ldcg(l + (s0 + lane) * l_stride) : neg_inf();
  float4 v[BATCH][CH];
  load_pieces<BATCH, CH>(v, o, o_stride, s0, s1, dim, lane);
  RowShare<CH> r;
  float m = l0;
  for (int s = s0 + lane + 32; s < s1; s += 32) m = fmaxf(m, __ldcg(l + s * l_stride));
  r.m = warp_max(m);
  const float m_use = r.m == neg_inf() ? 0.f : r.m;
  float w_mine = exp2f((l0 - m_use) * LOG2E);
  float den = w_mine;
  for (int s = s0 + lane + 32; s < s1; s += 32)
    den += exp2f((__ldcg(l + s * l_stride) - m_use) * LOG2E);
  r.den = warp_sum(den);

  // -- weighted sum of the rows, batch after batch (the first one already loaded)
#pragma unroll
  for (int ch = 0; ch < CH; ++ch) r.acc[ch] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s = s0; s < s1; s += BATCH) {
    if (s > s0) {
      if (((s - s0) & 31) == 0) {  // the weights of pieces s .. s + 31
        const float ls = s + lane < s1 ? __ldcg(l + (s + lane) * l_stride) : neg_inf();
        w_mine = exp2f((ls - m_use) * LOG2E);
      }
      load_pieces<BATCH, CH>(v, o, o_stride, s, s1, dim, lane);
    }
    add_pieces<BATCH, CH>(r.acc, v, w_mine, s - s0);
  }
  // the rows are dead once read: drop their lines from L2 unwritten (whole lines only: rows
  // of a multiple of 32 floats, so that no line holds part of another head's row)
  __syncwarp();
  if ((dim & 31) == 0 && (lane & 7) == 0)
    for (int s = s0; s < s1; ++s)
#pragma unroll
      for (int ch = 0; ch < CH; ++ch)
        if (4 * (lane + 32 * ch) < dim)
          discard_l2_line(reinterpret_cast<const float4*>(o + s * o_stride) + lane + 32 * ch);
  return r;
}

// Writes a head's merged row from the share of all its pieces, the sink (-inf: none) in
// the denominator: out [dim] in TO and, when lse_out is given, its natural-log LSE.
template <typename TO, int CH>
__device__ __forceinline__ void write_merged(const RowShare<CH>& r, float sink, int dim,
                                             TO* __restrict__ out, float* __restrict__ lse_out,
                                             int lane) {
  const float mx = fmaxf(r.m, sink);
  const float m_use = mx == neg_inf() ? 0.f : mx;
  const float a = exp2f((r.m - m_use) * LOG2E);
  const float den = r.den * a + exp2f((sink - m_use) * LOG2E);
  const float scale = den > 0.f ? a / den : 0.f;
#pragma unroll
  for (int ch = 0; ch < CH; ++ch)
    if (4 * (lane + 32 * ch) < dim) {
      const float4 x = r.acc[ch];
      store4<TO>(out + 4 * (lane + 32 * ch),
                 make_float4(x.x * scale, x.y * scale, x.z * scale, x.w * scale));
    }
  if (lane == 0 && lse_out != nullptr) *lse_out = den > 0.f ? m_use + logf(den) : neg_inf();
}

// One warp merges all `np` pieces of one head into out / lse_out.
template <typename TO, int CH>
__device__ __forceinline__ void merge_pieces_row(const float* __restrict__ o, i64 o_stride,
                                                 const float* __restrict__ l, i64 l_stride,
                                                 int np, float sink, int dim,
                                                 TO* __restrict__ out,
                                                 float* __restrict__ lse_out, int lane) {
  write_merged<TO, CH>(merge_pieces_share<CH>(o, o_stride, l, l_stride, 0, np, dim, lane), sink,
                       dim, out, lse_out, lane);
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
                             sinks != nullptr ? sinks[h] : neg_inf(), dim, out + (i64)h * dim,
                             lse != nullptr ? lse + h : nullptr, lane);
  }
}

}  // namespace cupaged
