// What the two prefill kernels (prefill.cu on mma.sync, prefill_sm90.cu on wgmma) and the
// sparse kernel's tile (attn_tile.cuh) share: the kernel arguments, the work item of a CTA
// with the position of each packed row, each query's visible keys, the K/V chunks a thread
// copies (KVChunks: 16-bit and fp8 caches) and the normalisation of a finished row.
//
// A work item (sequence b, kv head hk, first packed row row0) covers packed rows r of the
// sequence: packed row r is query i = r / group of head hk * group + r % group. Query i of a
// sequence with q_len queries and kv_len keys sits at p = kv_len - q_len + i and sees keys
// [visible_lo(p), visible_hi(p)) (window_left, causal).
#pragma once
#include "common.cuh"
#include "abi.cuh"
#include "fp8.cuh"

namespace cupaged {

// Position of a row past a tile's rows (sees no key).
constexpr int NO_ROW = -2147483647 - 1;

// Arguments of both prefill kernels: Problem<T, KV> (abi.cuh, packed by prefill/launch.py).

// The sequence, kv head and packed rows of one work item, and where its keys live (ragged:
// rows kv_start.., table null; paged: the sequence's block-table row). An item flagged
// (item.w = 1: its sequence failed a device check) sees no key, so its rows come out as
// zeros; an item of sequence -1 pads the list and its CTA returns (item_is_padding).
struct WorkItem {
  int b, hk, row0, rows, group, q_start, q_len, kv_len;
  i64 kv_start;
  const int* table;

  template <typename Prob>
  __device__ __forceinline__ void init(const Prob& P, int4 item, int block_m) {
    b = item.x; hk = item.y; row0 = item.z;
    group = P.num_q_heads / P.num_kv_heads;
    q_start = P.cu_q[b];
    q_len = P.cu_q[b + 1] - q_start;
    rows = min(block_m, q_len * group - row0);
    if (P.paged) {
      kv_start = 0;
      kv_len = item.w ? 0 : P.kv_info[b];
      table = P.block_tables + (i64)b * P.max_blocks;
    } else {
      kv_start = P.kv_info[b];
      kv_len = item.w ? 0 : P.kv_info[b + 1] - P.kv_info[b];
      table = nullptr;
    }
  }
  // absolute position of packed row r (0-based within the tile)
  __device__ __forceinline__ int position(int r) const { return kv_len - q_len + (row0 + r) / group; }
  __device__ __forceinline__ int head(int r) const { return hk * group + (row0 + r) % group; }
  __device__ __forceinline__ i64 token_row(int r) const { return (i64)q_start + (row0 + r) / group; }
  // position of tile row r; NO_ROW past the tile's rows
  __device__ __forceinline__ int row_position(int r) const { return r < rows ? position(r) : NO_ROW; }
};

// The K/V copies of a thread in both prefill kernels (D dims, BN-key tiles, THREADS
// threads): 16-byte chunks of PER = 16 / sizeof(KV) elements (8 of a 16-bit cache, 16
// codes of an fp8 one). Rows: thread tid copies chunk tid % CL (< CH) of tile rows
// tid / CL + ROW_STEP * i (i < RPT). V^T tiles (vllm values, keys contiguous per dim):
// chunk tid % KC (PER keys) of dims tid / KC + VT_STEP * i (i < VT_PASSES). A 16-bit chunk
// goes straight to its place in the tile; an fp8 chunk to the thread's staging slot (K row
// pass i: slot i; V row or V^T pass i: slot RPT + i; conflict-free, a thread's own), which
// the thread widens into the tile's 16-bit chunks 2c, 2c + 1 of the same row once its
// copies have landed (widen_chunk_shared: no barrier between the copy and the widening).
template <typename KV, int D_, int BN, int THREADS>
struct KVChunks {
  static constexpr bool FP8 = Fp8Traits<KV>::FP8;
  static constexpr int D = D_, PER = 16 / sizeof(KV);
  static constexpr int CH = D / PER;
  static constexpr int CL = CH <= 4 ? 4 : CH <= 8 ? 8 : CH <= 16 ? 16 : 32;
  static constexpr int ROW_STEP = THREADS / CL, RPT = BN / ROW_STEP;
  static constexpr int KC = BN / PER, VT_STEP = THREADS / KC;
  static constexpr int VT_PASSES = (D + VT_STEP - 1) / VT_STEP;
  static constexpr int SLOTS = RPT + (RPT > VT_PASSES ? RPT : VT_PASSES);
  // staging of a tile (prefill.plan.fp8_staging_bytes)
  static constexpr unsigned STAGE_BYTES = FP8 ? SLOTS * THREADS * 16 : 0;
  static_assert(BN % ROW_STEP == 0, "whole load passes");

  __device__ static __forceinline__ unsigned slot(unsigned staging, int s) {
    return staging + (s * THREADS + threadIdx.x) * 16;
  }
  // the first of a chunk's two stores goes to its hi half on odd groups of 4 chunks (the
  // lanes of each store then hit distinct bank quads in the padded and swizzled tiles)
  __device__ static __forceinline__ bool hi_first(int c) { return (c >> 2) & 1; }
};

// A cache element as the bits of a 16-bit tile element.
template <typename T, typename KV>
__device__ __forceinline__ unsigned short tile_bits(KV x) {
  if constexpr (Fp8Traits<KV>::FP8) return widen_fp8<T, KV>(x.bits);
  else return *reinterpret_cast<const unsigned short*>(&x);
}

__device__ __forceinline__ void st_shared16(u32 addr, unsigned short x) {
  asm volatile("st.shared.b16 [%0], %1;\n" :: "r"(addr), "h"(x));
}

// Whether this CTA's work item only pads the list (every thread of the CTA alike).
template <typename Prob>
__device__ __forceinline__ bool item_is_padding(const Prob& P) {
  return __ldg(&P.work[blockIdx.x].x) < 0;
}

// Visible keys [lo, hi) of the query at position p.
__device__ __forceinline__ int visible_lo(int p, int window_left) {
  return window_left >= 0 ? max(0, p - window_left) : 0;
}
__device__ __forceinline__ int visible_hi(int p, int kv_len, int causal) {
  return causal ? min(kv_len, p + 1) : kv_len;
}

// Key range of tile rows [first, first + n_rows) of a work item: keys some valid row sees
// [j_lo, j_hi), and every valid row sees [lo_max, hi_min) (empty without valid rows).
struct RowKeys {
  int j_lo, j_hi, hi_min, lo_max;

  __device__ __forceinline__ void init(const WorkItem& t, int first, int n_rows, int window_left, int causal) {
    j_lo = j_hi = hi_min = lo_max = 0;
    if (first < t.rows) {
      const int p_first = t.position(first), p_last = t.position(min(first + n_rows, t.rows) - 1);
      j_lo = visible_lo(p_first, window_left);
      j_hi = visible_hi(p_last, t.kv_len, causal);
      hi_min = visible_hi(p_first, t.kv_len, causal);
      lo_max = visible_lo(p_last, window_left);
    }
  }
  // some valid row sees a key of [j0, j0 + n)
  __device__ __forceinline__ bool sees(int j0, int n) const { return j0 < j_hi && j0 + n > j_lo; }
  // some valid row does not see every key of [j0, j0 + n)
  __device__ __forceinline__ bool needs_mask(int j0, int n) const { return j0 + n > hi_min || j0 < lo_max; }
};

// Normalisation of a finished row: out = acc * inv, natural-log lse including the sink.
// m: running max in log2 units (-inf: no visible key); l: sum of exp2(x - m).
__device__ __forceinline__ void finish_row(float m, float l, const float* sinks, int h,
                                           float& inv, float& lse) {
  if (sinks != nullptr) {
    const float sink = sinks[h] * LOG2E;
    const float mf = fmaxf(m, sink);
    if (mf == neg_inf()) { inv = 0.f; lse = neg_inf(); return; }
    const float f = m == neg_inf() ? 0.f : exp2f(m - mf);
    const float total = l * f + exp2f(sink - mf);
    inv = f / total;
    lse = (mf + log2f(total)) * LN2;
  } else if (l > 0.f) {
    inv = 1.f / l;
    lse = (m + log2f(l)) * LN2;
  } else {
    inv = 0.f;
    lse = neg_inf();
  }
}

// The two rows a lane holds of a warp's finished m-tile (tile rows first + lane / 4 + 8 hr
// of work item t): l summed over the row's 4 lanes, inv[hr] and the LSE from finish_row
// (m in log2 units), the LSE stored at lse[token, head] ([tokens, num_q_heads], if lse) by
// the row's first lane when the row exists.
template <typename Item>
__device__ __forceinline__ void finish_warp_rows(const Item& t, int first, const float (&m)[2],
                                                 float (&l)[2], const float* sinks, float* lse,
                                                 int num_q_heads, float (&inv)[2], int lane) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    l[hr] += __shfl_xor_sync(0xffffffffu, l[hr], 1);
    l[hr] += __shfl_xor_sync(0xffffffffu, l[hr], 2);
    const int r = first + lane / 4 + 8 * hr;
    float row_lse;
    finish_row(m[hr], l[hr], sinks, t.head(min(r, t.rows - 1)), inv[hr], row_lse);
    if (lse != nullptr && lane % 4 == 0 && r < t.rows)
      lse[t.token_row(r) * num_q_heads + t.head(r)] = row_lse;
  }
}

}  // namespace cupaged
