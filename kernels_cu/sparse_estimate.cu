// Vertical+slash pattern estimate (MInference): causal softmax of the last n <= 64 queries
// of one sequence over all its keys, summed per key (vertical scores) and per diagonal
// d = p - j (slash scores). Memory O(heads * kv_len): the scores are never stored.
//
// Two launches of one kernel: phase 0 writes each CTA's per-row max and sum of exp2 over its
// key chunk (the host combines them into the row max M and 1 / L); phase 1 recomputes the
// scores, p = exp2(x - M) / L, and accumulates column sums and diagonal sums.
#include "sparse_tile.cuh"
#include "topk.cuh"

namespace cupaged {

// EST_MAX_TILES (key tiles a CTA at most): from cupaged.sparse.launch

// grid (num_q_heads, chunks), block 128 (4 warps x 16 query rows). CTA (h, c) scores the
// last n queries of head h (rows q_row0 + r, positions kv_len - n + r) against keys
// [c * 64 * tiles_per_cta, ...) of kv head h / group, 64 keys per tile, double buffered.
// Each thread holds rows g and g + 8 of its warp's 16 rows.
// phase 0: row_max / row_sum [heads, chunks, 64] <- this chunk's max (log2 units) and sum.
// phase 1: row_max / row_sum [heads, 64] hold M and 1 / L; vertical [heads, kv_len] <- column
//         sums of the chunk's keys; slash [heads, kv_len] += diagonal sums (atomics, after
//         summing the chunk's diagonals in shared memory).
template <typename T, int D>
__global__ void __launch_bounds__(SP_THREADS) vs_estimate(CUPAGED_PARAMS_VsEstimateArgs) {
  using Tl = SpTile<D>;
  constexpr int TILE = SP_KEYS * Tl::SROW;
  extern __shared__ uint4 smem_u4[];
  T* sq = reinterpret_cast<T*>(smem_u4);
  T* sk = sq + SP_ROWS * Tl::SROW;
  __shared__ float s_diag[EST_MAX_TILES * SP_KEYS + SP_ROWS];
  __shared__ float s_col[4][SP_KEYS];

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int h = blockIdx.x, chunk = blockIdx.y;
  const int j_begin = chunk * tiles_per_cta * SP_KEYS;
  const int j_end = min(j_begin + tiles_per_cta * SP_KEYS, kv_len);
  const int n_tiles = (j_end - j_begin + SP_KEYS - 1) / SP_KEYS;
  const int p0 = kv_len - n;  // position of query row 0
  const KVRows rows = {block_table, page_size, (h / group) * head_stride, page_stride, tok_stride};
  auto issue = [&](int i, int buf) {
    const int j0 = j_begin + i * SP_KEYS;
    load_k_tile<T, D>(sk + buf * TILE, k, rows, [&](int r) { return j0 + r < j_end ? j0 + r : NO_KEY; });
  };

  load_q_tile<T, D>(sq, q, q_row0, n, num_q_heads, h);
  cp_async_commit();
  issue(0, 0);
  cp_async_commit();
  if (phase == 1)
    for (int i = threadIdx.x; i < EST_MAX_TILES * SP_KEYS + SP_ROWS; i += SP_THREADS) s_diag[i] = 0.f;
  cp_async_wait<1>();
  __syncthreads();
  QOperand<T, D> qop;
  qop.load(sq, warp, lane);

  int row[2], lim[2];  // rows of this thread; last visible key (-1: padding row)
  float m_i[2], l_i[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row[r] = warp * 16 + g + 8 * r;
    lim[r] = row[r] < n ? p0 + row[r] : -1;
    m_i[r] = phase == 0 ? neg_inf() : row_max[h * SP_ROWS + row[r]];
    l_i[r] = phase == 0 ? 0.f : row_sum[h * SP_ROWS + row[r]];
  }
  const int d_lo = p0 - (j_end - 1);  // smallest diagonal of the chunk (s_diag[0])

  for (int i = 0; i < n_tiles; ++i) {
    const int buf = i & 1, j0 = j_begin + i * SP_KEYS;
    if (i + 1 < n_tiles) issue(i + 1, buf ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();

    // -- compute qk, scale, mask (future keys, keys past the chunk, padding rows) --
    float s[8][4];
    qk_tile<T, D>(s, qop, sq, sk + buf * TILE, warp, lane);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = j0 + 8 * j + 2 * t + (e & 1);
        s[j][e] = (key > lim[e >> 1] || key >= j_end) ? neg_inf() : s[j][e] * scale_log2;
      }

    if (phase == 0) {
      // -- running max and sum of exp2 per row --
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = neg_inf();
#pragma unroll
        for (int j = 0; j < 8; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
        const float m_new = fmaxf(m_i[r], quad_max(mx));
        const float m_use = m_new == neg_inf() ? 0.f : m_new;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j)
          sum += fast_exp2(s[j][2 * r] - m_use) + fast_exp2(s[j][2 * r + 1] - m_use);
        l_i[r] = l_i[r] * fast_exp2(m_i[r] - m_use) + sum;
        m_i[r] = m_new;
      }
    } else {
      // -- probabilities; diagonal sums in shared memory; column sums per warp --
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1;
          const float p = s[j][e] == neg_inf() ? 0.f : fast_exp2(s[j][e] - m_i[r]) * l_i[r];
          if (p != 0.f) atomicAdd(&s_diag[lim[r] - (j0 + 8 * j + 2 * t + (e & 1)) - d_lo], p);
          s[j][e] = p;
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float c = s[j][e] + s[j][e + 2];
          c += __shfl_xor_sync(0xffffffffu, c, 4);
          c += __shfl_xor_sync(0xffffffffu, c, 8);
          c += __shfl_xor_sync(0xffffffffu, c, 16);
          if (g == 0) s_col[warp][8 * j + 2 * t + e] = c;
        }
      }
      __syncthreads();
      if (threadIdx.x < SP_KEYS && j0 + threadIdx.x < j_end)
        vertical[(i64)h * kv_len + j0 + threadIdx.x] = s_col[0][threadIdx.x] + s_col[1][threadIdx.x] +
                                                       s_col[2][threadIdx.x] + s_col[3][threadIdx.x];
    }
    __syncthreads();
  }

  if (phase == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float l = quad_sum(l_i[r]);
      if (t == 0) {
        const i64 at = ((i64)h * gridDim.y + chunk) * SP_ROWS + row[r];
        row_max[at] = m_i[r];
        row_sum[at] = l;
      }
    }
  } else {
    // -- flush diagonals d = d_lo + i of this chunk --
    for (int i = threadIdx.x; i < j_end - j_begin + SP_ROWS - 1; i += SP_THREADS) {
      const float val = s_diag[i];
      if (val != 0.f) atomicAdd(&slash[(i64)h * kv_len + d_lo + i], val);
    }
  }
}

// grid rows, block THREADS: row r of scores [rows, width] -> out[r, :k], the positions of
// its k largest scores in ascending order (ties to the earlier position; NaN as -inf):
// topk.cuh's radix select and ordered pass. The estimate's forced entries (sink columns,
// recent diagonals) are +inf, above every sum.
template <int THREADS>
__global__ void __launch_bounds__(THREADS) vs_top_kernel(CUPAGED_PARAMS_VsTopArgs) {
  const VsTopArgs a{CUPAGED_FIELDS_VsTopArgs};
  __shared__ int s_hist[256];
  __shared__ int s_warp[THREADS / 32 + 1];
  const float* row = a.scores + (i64)blockIdx.x * a.width;
  int* kept = a.out + (i64)blockIdx.x * a.k;
  const auto key = [&](int i) {
    const float x = row[i];
    return order_key(x != x ? neg_inf() : x);
  };
  const TopK top = radix_select<THREADS>(key, a.width, a.k, s_hist);
  keep_in_order<THREADS>(key, a.width, top, s_warp, [&](int slot, int i) { kept[slot] = i; });
}

}  // namespace cupaged
