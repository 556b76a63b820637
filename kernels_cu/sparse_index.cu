// Vertical+slash index conversion (MInference) and the tile lists of the attention kernel.
//
// vs_prepare turns sorted index rows into what the walks of sparse_plan.cuh need (unique
// verticals, the runs of the slash row); vs_index_kernel writes MInference's block_offset /
// column_index lists; vs_plan_kernel and bsr_plan_kernel write the per-CTA tile lists of
// sparse_attention.cu (a counting launch sizes them, a second launch fills them).
#include "sparse_plan.cuh"

namespace cupaged {

constexpr int PREP_THREADS = 256;

// Exclusive scan over the block of one int per thread (sum, or max when MAX), identity id;
// *total gets the reduction of all. Every thread of the block must call it.
template <bool MAX>
__device__ __forceinline__ int block_scan(int x, int id, int* buf, int& total) {
  buf[threadIdx.x] = x;
  __syncthreads();
  for (int o = 1; o < PREP_THREADS; o <<= 1) {
    const int y = threadIdx.x >= o ? buf[threadIdx.x - o] : id;
    __syncthreads();
    buf[threadIdx.x] = MAX ? max(buf[threadIdx.x], y) : buf[threadIdx.x] + y;
    __syncthreads();
  }
  const int excl = threadIdx.x > 0 ? buf[threadIdx.x - 1] : id;
  total = buf[PREP_THREADS - 1];
  __syncthreads();
  return excl;
}

// grid rows (= batch * heads of the index arrays), block PREP_THREADS. Block -> one row;
// thread t owns the contiguous chunk t of the row and walks it twice around a block scan.
// Verticals: the unique values < kv_len, packed at the front of v_unique's row, their number
// in v_count. Slashes: run_first[i] = first index of i's run (gaps <= bm, sparse_plan.cuh).
__global__ void __launch_bounds__(PREP_THREADS) vs_prepare(
    const int* __restrict__ v_sorted, int nv, const int* __restrict__ s_sorted, int ns,
    const int* __restrict__ kv_lens, int heads, int bm, int* __restrict__ v_unique,
    int* __restrict__ v_count, int* __restrict__ run_first) {
  __shared__ int buf[PREP_THREADS];
  const i64 row = blockIdx.x;
  const int kv_len = kv_lens[row / heads];
  int total;

  // -- verticals: keep first occurrences below kv_len --
  const int* v = v_sorted + row * nv;
  int* vu = v_unique + row * nv;
  const int pv = (nv + PREP_THREADS - 1) / PREP_THREADS;
  const int v0 = min(nv, (int)threadIdx.x * pv), v1 = min(nv, v0 + pv);
  auto keep = [&](int i) { return v[i] < kv_len && (i == 0 || v[i] != v[i - 1]); };
  int count = 0;
  for (int i = v0; i < v1; ++i) count += keep(i);
  int at = block_scan<false>(count, 0, buf, total);
  for (int i = v0; i < v1; ++i)
    if (keep(i)) vu[at++] = v[i];
  if (threadIdx.x == 0) v_count[row] = total;

  // -- slashes: run starts, carried over the chunks by a max scan --
  const int* s = s_sorted + row * ns;
  int* rf = run_first + row * ns;
  const int ps = (ns + PREP_THREADS - 1) / PREP_THREADS;
  const int s0 = min(ns, (int)threadIdx.x * ps), s1 = min(ns, s0 + ps);
  auto starts = [&](int i) { return i == 0 || (i64)s[i] - s[i - 1] > bm; };
  int last = -1;
  for (int i = s0; i < s1; ++i)
    if (starts(i)) last = i;
  int cur = block_scan<true>(last, -1, buf, total);
  for (int i = s0; i < s1; ++i) {
    if (starts(i)) cur = i;
    rf[i] = cur;
  }
}

// MInference lists of one query block written by a whole warp (lanes write in parallel;
// the walk itself runs in every lane alike). Lists stop at their widths.
struct WarpLists {
  const int* v;
  int* offs;
  int* cols;
  int w_s, w_v, bn, nblk, ncol;

  __device__ __forceinline__ void blocks(i64 rs, i64 re) {
    const int n = (int)((unsigned)(re - rs) / (unsigned)bn);
    for (int k = threadIdx.x % 32; k < n && nblk + k < w_s; k += 32) offs[nblk + k] = (int)(rs + (i64)k * bn);
    nblk = min(w_s, nblk + n);
  }
  __device__ __forceinline__ void columns(int a, int b) {
    for (int k = threadIdx.x % 32; k < b - a && ncol + k < w_v; k += 32) cols[ncol + k] = v[a + k];
    ncol = min(w_v, ncol + (b - a));
  }
};

// grid ceil(batch * heads * num_m / 4), block 128: warp -> (b, h, m), m fastest; the whole
// warp walks block m of head h (vs_block_lists) and writes its lists. Outputs are
// [batch, heads, num_m] counts and [batch, heads, num_m, w] lists (entries past the counts
// untouched).
__global__ void __launch_bounds__(128) vs_index_kernel(
    const int* __restrict__ seqlens, const int* __restrict__ kv_seqlens,
    const int* __restrict__ s_sorted, const int* __restrict__ run_first, int ns,
    const int* __restrict__ v_unique, const int* __restrict__ v_count, int nv, int batch, int heads,
    int num_m, int bm, int bn, int* __restrict__ block_count, int* __restrict__ block_offset, int w_s,
    int* __restrict__ column_count, int* __restrict__ column_index, int w_v) {
  const i64 item = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  if (item >= (i64)batch * heads * num_m) return;
  const int m = (int)(item % num_m);
  const i64 row = item / num_m;  // b * heads + h
  const int b = (int)(row / heads);
  VsRow p;
  p.init(s_sorted, run_first, ns, v_unique, v_count, nv, row);
  WarpLists out{p.v, block_offset + item * w_s, column_index + item * w_v, w_s, w_v, bn, 0, 0};
  vs_block_lists(p, m, seqlens[b], kv_seqlens[b], bm, bn, out);
  if (threadIdx.x % 32 == 0) {
    block_count[item] = out.nblk;
    column_count[item] = out.ncol;
  }
}

// ----------------------------------------------------------------------------- tile lists
// Tile sinks of the plan kernels (a warp per list; every lane walks alike): count, or write
// the tiles of each piece with the lanes in parallel.
struct TileCount {
  i64 n;
  __device__ __forceinline__ void piece(int x, int y, int, int tile_n) { n += (y - x + tile_n - 1) / tile_n; }
};
struct TileWrite {
  int2* t;
  __device__ __forceinline__ void piece(int x, int y, int f, int tile_n) {
    const int n = (y - x + tile_n - 1) / tile_n;
    for (int k = threadIdx.x % 32; k < n; k += 32) {
      const int s = x + k * tile_n;
      t[k] = make_int2(s, min(tile_n, y - s) | f);
    }
    t += n;
  }
};

// grid ceil(batch * heads * num_c / 4), block 128: warp -> CTA list (b, head0 + h, c), c
// fastest (vs_cta_tiles); index rows [batch, total_heads, n]. Counts (ptr[item] = number of
// tiles) when tiles is nullptr, else writes the list at tiles + ptr[item].
__global__ void __launch_bounds__(128) vs_plan_kernel(
    const int* __restrict__ cu_q, const int* __restrict__ kv_lens, const int* __restrict__ s_sorted,
    const int* __restrict__ run_first, int ns, const int* __restrict__ v_unique,
    const int* __restrict__ v_count, int nv, int batch, int total_heads, int head0, int heads,
    int num_c, int bm, int bn, int tile_n, i64* __restrict__ ptr, int2* __restrict__ tiles) {
  const i64 item = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  if (item >= (i64)batch * heads * num_c) return;
  const int c = (int)(item % num_c);
  const int h = (int)(item / num_c % heads), b = (int)(item / num_c / heads);
  VsRow p;
  p.init(s_sorted, run_first, ns, v_unique, v_count, nv, (i64)b * total_heads + head0 + h);
  const int q_len = cu_q[b + 1] - cu_q[b], kv_len = kv_lens[b];
  if (tiles == nullptr) {
    TileCount n{0};
    vs_cta_tiles(p, c, q_len, kv_len, bm, bn, tile_n, n);
    if (threadIdx.x % 32 == 0) ptr[item] = n.n;
  } else {
    TileWrite w{tiles + ptr[item]};
    vs_cta_tiles(p, c, q_len, kv_len, bm, bn, tile_n, w);
  }
}

// grid ceil(num_c / 4), block 128: warp -> CTA list c of a one-sequence BSR pattern
// (bsr_cta_tiles), shared by every head; counts or writes as vs_plan_kernel.
__global__ void __launch_bounds__(128) bsr_plan_kernel(
    const int* __restrict__ cu_q, const int* __restrict__ kv_lens, const int* __restrict__ indptr,
    const int* __restrict__ indices, int num_c, int bm, int bn, int causal, int tile_n,
    i64* __restrict__ ptr, int2* __restrict__ tiles) {
  const i64 item = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  if (item >= num_c) return;
  const int q_len = cu_q[1] - cu_q[0], kv_len = kv_lens[0];
  if (tiles == nullptr) {
    TileCount n{0};
    bsr_cta_tiles(indptr, indices, (int)item, q_len, kv_len, bm, bn, causal != 0, tile_n, n);
    if (threadIdx.x % 32 == 0) ptr[item] = n.n;
  } else {
    TileWrite w{tiles + ptr[item]};
    bsr_cta_tiles(indptr, indices, (int)item, q_len, kv_len, bm, bn, causal != 0, tile_n, w);
  }
}

}  // namespace cupaged
