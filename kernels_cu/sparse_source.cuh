// The tile sources of the block-sparse attention kernels (sparse_attention.cu on mma.sync,
// sparse_sm90.cu on wgmma): where a CTA's rows sit (the CTA map of bsr_prepare) and the
// stream of K/V tile descriptors it walks, from the tile lists of sparse_index.cu
// (vertical+slash, ListSource) or a batched BSR pattern walked in place from its `indices`
// (BsrSource, BsrStream of sparse_plan.cuh). A descriptor is int2 {x, width | flags << 8}
// (sparse_plan.cuh): contiguous keys x .. x + width - 1, or (TILE_GATHER) the vertical
// columns at positions x .. of the head's vertical row; TILE_A / TILE_B: the 64-row halves
// whose pattern holds the tile.
#pragma once
#include "common.cuh"
#include "abi.cuh"
#include "sparse_plan.cuh"

namespace cupaged {

// HALF_ROWS (query rows of one pattern half): from cupaged.sparse.launch
constexpr int EMPTY_KEY = 0x7fffffff;  // key of an empty K/V tile row (past every row's limit)

// cp.async of 8 and of 4 bytes (the L1-allocating form; .cg takes only 16).
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" :: "r"(smem_addr(smem)), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async4(u32 smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" :: "r"(smem), "l"(gmem) : "memory");
}

// Where the K/V rows of a CTA's keys come from: the kv head's bases (dense rows: from the
// sequence's first key), the sequence's block table (null: dense rows), the head's vertical
// row (gathered tiles' keys) and the page geometry (page_shift >= 0: power-of-two pages).
// Page and token strides fit in 32 bits (the host checks: blocks under 2^32 elements).
template <typename T>
struct SparseKeys {
  const T* kb;
  const T* vb;
  const int* table;
  const int* cols;
  int page_size, page_shift;
  u32 page_stride, tok_stride;

  __device__ __forceinline__ void init(const SparseArgs<T>& P, int b, int h) {
    const i64 base = (i64)(h / P.group) * P.head_stride +
                     (P.block_tables == nullptr ? (i64)P.cu_k[b] * P.tok_stride : 0);
    kb = P.k + base;
    vb = P.v + base;
    table = P.block_tables == nullptr ? nullptr : P.block_tables + (i64)b * P.table_stride;
    cols = P.cols == nullptr ? nullptr : P.cols + ((i64)b * P.cols_heads + h) * P.cols_width;
    page_size = P.page_size;
    page_shift = (page_size & (page_size - 1)) == 0 ? __ffs(page_size) - 1 : -1;
    page_stride = (u32)P.page_stride;
    tok_stride = (u32)P.tok_stride;
  }
  // element offset of key j's row from the bases (32 x 32 -> 64-bit products)
  __device__ __forceinline__ i64 offset(int j) const {
    if (table == nullptr) return (i64)((unsigned long long)(u32)j * tok_stride);
    const int page = __ldg(table + (page_shift >= 0 ? j >> page_shift : j / page_size));
    const u32 in_page = page_shift >= 0 ? j & (page_size - 1) : j % page_size;
    return (i64)((unsigned long long)(u32)page * page_stride + (unsigned long long)in_page * tok_stride);
  }
};

// The sequence rows of one CTA, from its tile source: 128-row CTA row c of sequence b.
struct CtaSeq {
  int b, c, q0, q_len, kv_len;
};

// ----------------------------------------------------------------------------- tile sources
// A source places its CTA (locate, every thread), sets up its walk (init, every thread) and
// hands thread 0 one descriptor at a time, width 0 once the walk is over (issue: into a ring
// slot, visible to the CTA after the next cp.async wait and barrier; pull: as a value).

// The CTA of grid row y: entry cta_bound - 1 - y of bsr_prepare's CTA map (the last rows of
// the last sequences first), false past the last CTA; keys and queries as checked there.
template <typename T>
__device__ __forceinline__ bool locate_mapped(const SparseArgs<T>& P, CtaSeq& s) {
  const int at = P.cta_bound - 1 - (int)blockIdx.y;
  s.b = __ldg(P.bsr_meta + 4 * (P.batch + 1) + at);
  if (s.b < 0) return false;
  const int4 info = __ldg(reinterpret_cast<const int4*>(P.bsr_meta) + s.b);
  s.c = at - info.z;
  s.q0 = __ldg(P.cu_q + s.b);
  s.q_len = info.w;
  s.kv_len = info.y;
  return true;
}

// The tile lists of sparse_index.cu: CTA (x, y) takes its map entry at (locate_mapped) and
// query head head0 + x; its list is tiles[item * list_cap ..] of list_counts[item] tiles,
// item = x * cta_bound + at, issued from the end (a row that runs dense has the dense
// kernel's tile sequence there).
struct ListSource {
  const int2* tiles;
  int next;  // list index of the next tile to issue; < 0: none left

  template <typename T>
  __device__ __forceinline__ static bool locate(const SparseArgs<T>& P, CtaSeq& s) {
    return locate_mapped(P, s);
  }

  template <int HALVES, typename T>
  __device__ __forceinline__ void init(const SparseArgs<T>& P, const CtaSeq&, int hh, int) {
    static_assert(HALVES == 2, "tile lists are built for 128-row CTAs");
    if (threadIdx.x != 0) return;
    const i64 item = (i64)hh * P.cta_bound + (P.cta_bound - 1 - (int)blockIdx.y);
    tiles = P.tiles + item * P.list_cap;
    next = __ldg(P.list_counts + item) - 1;
  }

  __device__ __forceinline__ void issue(int2* slot) {
    if (next >= 0) cp_async8(slot, tiles + next--);
    else *slot = make_int2(0, 0);
  }
  __device__ __forceinline__ int2 pull() { return next >= 0 ? __ldg(tiles + next--) : make_int2(0, 0); }
};

// A batched BSR pattern (cupaged/reference/bsr.py) with bsr_prepare's schedule in bsr_meta:
// CTA (x, y) takes its map entry (locate_mapped) and query head head0 + x, whose pattern
// head is h / pattern_group; it
// has HALVES 64-row halves (one: half b keeps no block). Its halves' CSR rows are checked
// first (every entry it follows: indptr within [0, nnz] and
// ordered, block ids within the sequence's columns and strictly increasing); a bad row is
// reported and its half keeps no block (its rows come out as zeros).
struct BsrSource {
  BsrStream stream;

  template <typename T>
  __device__ __forceinline__ static bool locate(const SparseArgs<T>& P, CtaSeq& s) {
    return locate_mapped(P, s);
  }

  template <int HALVES, typename T>
  __device__ __forceinline__ void init(const SparseArgs<T>& P, const CtaSeq& s, int hh, int tile_n) {
    const int row0 = __ldg(P.bsr_meta + 4 * s.b);
    const bool frame = __ldg(P.bsr_meta + 4 * P.batch) != 0;
    const int rows = (s.q_len + P.block_m - 1) / P.block_m;
    const int cols = (int)(((unsigned)s.kv_len + P.block_n - 1) / (unsigned)P.block_n);
    const i64 first = row0 + (i64)((P.head0 + hh) / P.pattern_group) * rows;
    int lo[2] = {0, 0}, hi[2] = {0, 0}, clip[2] = {0, 0};
#pragma unroll
    for (int k = 0; k < HALVES; ++k) {
      HalfTile half;
      half.init(HALVES * s.c + k, s.q_len, s.kv_len, P.block_m, P.block_m / HALF_ROWS, P.causal != 0);
      if (!frame || !half.valid) continue;  // CTA-uniform
      const i64 t = first + half.prow;
      if (row_ok(P, t, cols) && half.clip > 0) {
        lo[k] = __ldg(P.indptr + t);
        hi[k] = __ldg(P.indptr + t + 1);
        clip[k] = (int)half.clip;
      }
    }
    if (threadIdx.x == 0) {
      stream.init(P.block_n, tile_n);
      for (int k = 0; k < 2; ++k) stream.init_half(k, P.indices, lo[k], hi[k], clip[k]);
    }
  }

  // Whether CSR row t can be followed (every thread calls; the first bad entry reported).
  template <typename T>
  __device__ __forceinline__ static bool row_ok(const SparseArgs<T>& P, i64 t, int cols) {
    const int a = __ldg(P.indptr + t), e = __ldg(P.indptr + t + 1);
    int bad = 1;
    if (a < 0 || a > P.nnz) {
      if (threadIdx.x == 0) report_error(P.err, error_code(ARG_INDPTR, CHECK_RANGE), t, -1, a, (i64)P.nnz + 1);
    } else if (e < a) {
      if (threadIdx.x == 0) report_error(P.err, error_code(ARG_INDPTR, CHECK_ORDER), t + 1, -1, e, a);
    } else if (e > P.nnz) {
      if (threadIdx.x == 0) report_error(P.err, error_code(ARG_INDPTR, CHECK_RANGE), t + 1, -1, e, (i64)P.nnz + 1);
    } else {
      bad = 0;
      for (int j = a + threadIdx.x; j < e; j += blockDim.x) {
        const int id = __ldg(P.indices + j);
        if ((unsigned)id >= (unsigned)cols) {
          report_error(P.err, error_code(ARG_INDICES, CHECK_RANGE), j, -1, id, cols);
          bad = 1;
        } else if (j > a && __ldg(P.indices + j - 1) >= id) {
          report_error(P.err, error_code(ARG_INDICES, CHECK_INCREASING), j, -1, id, __ldg(P.indices + j - 1));
          bad = 1;
        }
      }
    }
    return !__syncthreads_or(bad);
  }

  __device__ __forceinline__ int2 pull() {
    int start, word;
    return stream.next(start, word) ? make_int2(start, word) : make_int2(0, 0);
  }
  __device__ __forceinline__ void issue(int2* slot) { *slot = pull(); }
};

}  // namespace cupaged
