// MInference index conversion: vertical+slash indices -> per query block key blocks
// (block_offset) and uncovered vertical columns (column_index). The rule is written out in
// cupaged/reference/sparse.py; this kernel follows it step by step.
#include "common.cuh"

namespace cupaged {

// First index i of ascending row[0..n) with row[i] >= x (n if none).
__device__ __forceinline__ int lower_bound(const int* __restrict__ row, int n, i64 x) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (row[mid] < x) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Verticals of one query block (ascending, duplicates skipped), consumed in order: those
// below x are columns, or covered by a key block.
struct VerticalWalk {
  const int* row;
  int n;
  int* cols;
  int width;
  int i = 0, prev = -1, ncol = 0;

  __device__ __forceinline__ void below(i64 x, bool covered) {
    for (; i < n && row[i] < x; ++i) {
      if (!covered && row[i] != prev && ncol < width) cols[ncol++] = row[i];
      prev = row[i];
    }
  }
};

// A merged range [rs, re) is closed: write its block starts, then sort the verticals below
// its end into columns (before it) and covered ones (inside it).
__device__ __forceinline__ void close_range(int* offs, int& nblk, int w_s, int block_n, i64 rs,
                                            i64 re, i64 limit, VerticalWalk& walk) {
  for (i64 s = rs; s < re && nblk < w_s; s += block_n) offs[nblk++] = (int)s;
  walk.below(min(rs, limit), false);
  walk.below(min(re, limit), true);
}

// grid ceil(batch * heads * num_m / 128), block 128. Thread -> (b, h, m), m fastest: query
// block m of sequence b, head head0 + h of the index rows. It walks the slashes d < min(end,
// kv_len) by descending d (the rows are ascending), merging their key ranges; as each merged
// range closes it writes its block starts and sorts the verticals below its end into
// columns (before the range) and covered ones (inside it).
// Outputs are [batch, heads, num_m] counts and [batch, heads, num_m, w] lists.
__global__ void __launch_bounds__(128, 1) vertical_slash_index_kernel(
    const int* __restrict__ seqlens, const int* __restrict__ kv_seqlens,
    const int* __restrict__ v_idx, i64 v_batch_stride, int nnz_v,
    const int* __restrict__ s_idx, i64 s_batch_stride, int nnz_s, int head0, int batch,
    int heads, int num_m, int block_m, int block_n, int* __restrict__ block_count,
    int* __restrict__ block_offset, int w_s, int* __restrict__ column_count,
    int* __restrict__ column_index, int w_v) {
  const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (tid >= (i64)batch * heads * num_m) return;
  const int m = (int)(tid % num_m);
  const i64 bh = tid / num_m;
  const int h = (int)(bh % heads), b = (int)(bh / heads);
  const int q_len = seqlens[b], kv_len = kv_seqlens[b];
  int* offs = block_offset + tid * w_s;
  int* cols = column_index + tid * w_v;
  int nblk = 0, ncol = 0;
  if ((i64)m * block_m < q_len) {
    const i64 end = (i64)kv_len - q_len + (i64)m * block_m + block_m;
    const i64 limit = min(end, (i64)kv_len);
    const int* srow = s_idx + b * s_batch_stride + (i64)(head0 + h) * nnz_s;
    const int* vrow = v_idx + b * v_batch_stride + (i64)(head0 + h) * nnz_v;

    VerticalWalk walk{vrow, nnz_v, cols, w_v};

    // -- slashes by descending d: ranges ascend; merge while they start by the open end --
    const i64 per_range = (i64)((block_m + block_n - 1) / block_n) * block_n;
    i64 rs = 0, re = -1;  // re < 0: no open range
    for (int i = lower_bound(srow, nnz_s, limit) - 1; i >= 0; --i) {
      const i64 hi = max(end - srow[i], (i64)block_m), lo = hi - block_m;
      if (re >= 0 && lo <= re) {
        if (hi > re) re += (hi - re + block_n - 1) / block_n * block_n;
        continue;
      }
      if (re >= 0) close_range(offs, nblk, w_s, block_n, rs, re, limit, walk);
      rs = lo;
      re = lo + per_range;
    }
    if (re >= 0) close_range(offs, nblk, w_s, block_n, rs, re, limit, walk);
    walk.below(limit, false);
    ncol = walk.ncol;
  }
  block_count[tid] = nblk;
  column_count[tid] = ncol;
}

}  // namespace cupaged
