// Block-sparse attention on tensor cores: vertical+slash (MInference) and BSR patterns,
// dense varlen or paged K/V, GQA, sinks, fp16/bf16.
//
// The pattern of one 64-row query tile is a list of key blocks (first keys
// entry * entry_scale, block_width keys each, ascending) plus, for vertical+slash, a list of
// single key columns. The CTA walks the block tiles (64 keys each) and then the columns
// gathered 64 at a time, with an online softmax across all of them; K/V tiles are
// gathered row by row (any key order, any page) with cp.async, double buffered for D <= 128.
#include "sparse_tile.cuh"

namespace cupaged {

// Key rows of one tile: keys base + r (block tile) or cols[r] (column tile), r < width.
struct TileDesc {
  int base;
  int width;
  const int* cols;
  __device__ __forceinline__ int key(int r) const {
    return r < width ? (cols != nullptr ? cols[r] : base + r) : NO_KEY;
  }
};

// Output columns per CTA: all of D, or 128 for D = 256 (two CTAs split the columns and
// both compute the scores, which keeps the O accumulators within the register file).
template <int D> struct SpSplit { static constexpr int DV = D <= 128 ? D : 128, PARTS = D / DV; };

// grid (heads in this call * D / DV, num_m_tiles, batch), block 128 (4 warps x 16 rows).
// CTA (x, m, b) computes query rows [64 m', 64 m' + 64) of sequence b, head
// head0 + x / (D / DV), output columns [dv0, dv0 + DV) with dv0 = DV * (x % (D / DV)),
// where m' = gridDim.y - 1 - m (longest rows first; the heads of one tile run together,
// so the query heads of a kv head share its K/V tiles in L2). Each thread holds rows g and g + 8
// of its warp's 16: scores s[8][4], running max/sum, and O accumulators o[DV/8][4].
// Pattern row of the CTA: prow = (b * pattern_heads + hp') * pattern_rows + m' / m_div
// (hp' = 0 when pattern_heads == 1); its blocks are blk_list[blk_ptr[prow]..blk_ptr[prow+1])
// when blk_ptr is given (BSR), else blk_list[prow * list_width ..][:blk_count[prow]].
template <typename T, int D>
__global__ void __launch_bounds__(SP_THREADS, 1) sparse_attention(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    T* __restrict__ out, float* __restrict__ lse,
    const int* __restrict__ cu_q, const int* __restrict__ kv_lens, const int* __restrict__ cu_k,
    const int* __restrict__ block_tables, int table_stride, int page_size, i64 page_stride,
    i64 tok_stride, i64 head_stride, int num_q_heads, int group, int head0,
    const int* __restrict__ blk_count, const int* __restrict__ blk_ptr,
    const int* __restrict__ blk_list, int list_width, int entry_scale, int block_width,
    const int* __restrict__ col_count, const int* __restrict__ col_index, int col_width,
    int pattern_heads, int pattern_rows, int m_div, int causal, float scale_log2,
    const float* __restrict__ sinks) {
  using Tl = SpTile<D>;
  constexpr int DV = SpSplit<D>::DV, PARTS = SpSplit<D>::PARTS;
  constexpr int SROW = Tl::SROW, SROW_V = DV + 8;
  constexpr int STAGES = D <= 128 ? 2 : 1;
  constexpr int TILE_K = SP_KEYS * SROW, TILE_V = SP_KEYS * SROW_V;
  extern __shared__ uint4 smem_u4[];
  T* sq = reinterpret_cast<T*>(smem_u4);
  T* sk = sq + SP_ROWS * SROW;
  T* sv = sk + STAGES * TILE_K;
  int* skey = reinterpret_cast<int*>(sv + STAGES * TILE_V);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int m = gridDim.y - 1 - blockIdx.y, hp = blockIdx.x / PARTS, b = blockIdx.z;
  const int h = head0 + hp, dv0 = DV * (blockIdx.x % PARTS);
  const int q0 = cu_q[b], q_len = cu_q[b + 1] - q0, m0 = m * SP_ROWS;
  if (m0 >= q_len) return;
  const int kv_len = kv_lens[b], pos0 = kv_len - q_len;
  const int kvh = h / group;
  KVRows rows;
  if (block_tables != nullptr)
    rows = {block_tables + (i64)b * table_stride, page_size, kvh * head_stride, page_stride, tok_stride};
  else
    rows = {nullptr, 1, (i64)cu_k[b] * tok_stride + kvh * head_stride, 0, tok_stride};

  // -- this tile's pattern: key blocks (causally reachable ones), then columns --
  const i64 prow = ((i64)b * pattern_heads + (pattern_heads > 1 ? hp : 0)) * pattern_rows + m / m_div;
  const int* list;
  int count;
  if (blk_ptr != nullptr) {
    list = blk_list + blk_ptr[prow];
    count = blk_ptr[prow + 1] - blk_ptr[prow];
  } else {
    list = blk_list + prow * list_width;
    count = blk_count[prow];
  }
  const int p_last = pos0 + min(m0 + SP_ROWS, q_len) - 1;
  if (causal) {
    int lo = 0, hi = count;
    while (lo < hi) {
      const int mid = (lo + hi) >> 1;
      if ((i64)list[mid] * entry_scale <= p_last) lo = mid + 1; else hi = mid;
    }
    count = lo;
  }
  const int* cols = nullptr;
  int n_cols = 0;
  if (col_count != nullptr) {
    n_cols = col_count[prow];
    cols = col_index + prow * col_width;
  }
  const int per_entry = (block_width + SP_KEYS - 1) / SP_KEYS;
  const int n_blk_tiles = count * per_entry;
  const int n_tiles = n_blk_tiles + (n_cols + SP_KEYS - 1) / SP_KEYS;

  auto tile_at = [&](int i) {
    TileDesc d;
    if (i < n_blk_tiles) {
      const int e = i / per_entry, sub = i - e * per_entry;
      d.base = list[e] * entry_scale + sub * SP_KEYS;
      d.width = min(min(SP_KEYS, block_width - sub * SP_KEYS), kv_len - d.base);
      d.cols = nullptr;
    } else {
      const int c0 = (i - n_blk_tiles) * SP_KEYS;
      d.base = 0;
      d.width = min(SP_KEYS, n_cols - c0);
      d.cols = cols + c0;
    }
    return d;
  };
  auto issue = [&](int i, int buf) {
    const TileDesc d = tile_at(i);
    load_kv_tile<T, D, DV>(sk + buf * TILE_K, sv + buf * TILE_V, k, v, dv0, rows,
                           [&](int r) { return d.key(r); });
    if (threadIdx.x < SP_KEYS) skey[buf * SP_KEYS + threadIdx.x] = d.key(threadIdx.x);
  };

  // -- prologue: Q tile, first K/V tile --
  load_q_tile<T, D>(sq, q, (i64)q0 + m0, min(SP_ROWS, q_len - m0), num_q_heads, h);
  cp_async_commit();
  if (n_tiles > 0) issue(0, 0);
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();
  QOperand<T, D> qop;
  qop.load(sq, warp, lane);

  float o[DV / 8][4];
#pragma unroll
  for (int i = 0; i < DV / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[i][e] = 0.f;
  float m_i[2] = {sp_neg_inf(), sp_neg_inf()}, l_i[2] = {0.f, 0.f};
  int lim[2];  // last visible key of rows g, g + 8
  lim[0] = causal ? pos0 + m0 + warp * 16 + g : NO_KEY - 1;
  lim[1] = causal ? lim[0] + 8 : NO_KEY - 1;
  const int lim_min = causal ? pos0 + m0 : NO_KEY - 1;

  for (int i = 0; i < n_tiles; ++i) {
    int buf = 0;
    if constexpr (STAGES == 2) {
      buf = i & 1;
      if (i + 1 < n_tiles) issue(i + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      if (i > 0) {
        issue(i, 0);
        cp_async_commit();
      }
      cp_async_wait<0>();
    }
    __syncthreads();
    const T* kt = sk + buf * TILE_K;
    const T* vt = sv + buf * TILE_V;

    // -- compute qk --
    float s[8][4];
    qk_tile<T, D>(s, qop, sq, kt, warp, lane);

    // -- scale, mask (skipped for full block tiles below the diagonal) --
    const TileDesc d = tile_at(i);
    const bool full = d.cols == nullptr && d.width == SP_KEYS && d.base + SP_KEYS - 1 <= lim_min;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      int2 key = make_int2(0, 0);
      if (!full) key = *reinterpret_cast<const int2*>(skey + buf * SP_KEYS + 8 * j + 2 * t);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int kj = (e & 1) ? key.y : key.x;
        s[j][e] = (!full && kj > lim[e >> 1]) ? sp_neg_inf() : s[j][e] * scale_log2;
      }
    }

    // -- online softmax --
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = sp_neg_inf();
#pragma unroll
      for (int j = 0; j < 8; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
      const float m_new = fmaxf(m_i[r], quad_max(mx));
      const float m_use = m_new == sp_neg_inf() ? 0.f : m_new;
      const float alpha = fast_exp2(m_i[r] - m_use);
      m_i[r] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        s[j][2 * r] = fast_exp2(s[j][2 * r] - m_use);
        s[j][2 * r + 1] = fast_exp2(s[j][2 * r + 1] - m_use);
        sum += s[j][2 * r] + s[j][2 * r + 1];
      }
      l_i[r] = l_i[r] * alpha + sum;
#pragma unroll
      for (int n = 0; n < DV / 8; ++n) {
        o[n][2 * r] *= alpha;
        o[n][2 * r + 1] *= alpha;
      }
    }

    // -- o += p v --
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      u32 a[4];
      a[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
      a[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
      a[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      a[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int dp = 0; dp < DV / 16; ++dp) {
        u32 bv[4];
        ldmatrix_x4_trans(bv, vt + (kk * 16 + ldm_bkn_row(lane)) * SROW_V + dp * 16 + ldm_bkn_col(lane));
        mma_16816<T>(o[2 * dp], a, bv[0], bv[1]);
        mma_16816<T>(o[2 * dp + 1], a, bv[2], bv[3]);
      }
    }
    __syncthreads();
  }

  // -- epilogue: sink, normalise, stage through shared, 16-byte stores --
  const float sink2 = sinks != nullptr ? sinks[h] * LOG2E : sp_neg_inf();
  float scale_o[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_sum(l_i[r]);
    const float mf = fmaxf(m_i[r], sink2);
    float lse_r = sp_neg_inf();
    scale_o[r] = 0.f;
    if (mf != sp_neg_inf()) {
      const float corr = fast_exp2(m_i[r] - mf);
      const float total = l * corr + fast_exp2(sink2 - mf);
      scale_o[r] = corr / total;
      lse_r = (mf + __log2f(total)) * LN2;
    }
    const int row = m0 + warp * 16 + g + 8 * r;
    if (lse != nullptr && dv0 == 0 && t == 0 && row < q_len) lse[((i64)q0 + row) * num_q_heads + h] = lse_r;
  }
  __syncthreads();  // every warp is done reading sq
#pragma unroll
  for (int n = 0; n < DV / 8; ++n) {
    *reinterpret_cast<u32*>(sq + (warp * 16 + g) * SROW_V + n * 8 + 2 * t) =
        pack2<T>(o[n][0] * scale_o[0], o[n][1] * scale_o[0]);
    *reinterpret_cast<u32*>(sq + (warp * 16 + g + 8) * SROW_V + n * 8 + 2 * t) =
        pack2<T>(o[n][2] * scale_o[1], o[n][3] * scale_o[1]);
  }
  __syncthreads();
#pragma unroll
  for (int it = 0; it < SP_ROWS * (DV / 8) / SP_THREADS; ++it) {
    const int i = threadIdx.x + it * SP_THREADS;
    const int r = i / (DV / 8), c = i - r * (DV / 8);
    if (m0 + r < q_len)
      *reinterpret_cast<uint4*>(out + (((i64)q0 + m0 + r) * num_q_heads + h) * D + dv0 + c * 8) =
          *reinterpret_cast<const uint4*>(sq + r * SROW_V + c * 8);
  }
}

}  // namespace cupaged
