// Quest page selection for decode (cupaged/sparse/quest.py is the specification, in NumPy):
//
//   quest_bounds_kernel  per-page elementwise min and max of the keys of each kv head, over
//                        the tokens below the sequence's length
//   quest_select_kernel  per (sequence, kv head): the pages' upper-bound scores, the top_k
//                        pages (the last always), written in position order as a block table
//                        and key count of a one-kv-head view of the cache
//   quest_sinks_kernel   a sink logit folded into a decode's output and LSE afterwards
//
// Device index arrays are checked here: a bad length or block id is reported to the error
// word and never followed; the sequence's bounds stay as they were, and its selection is
// empty (length 0), so its decode rows come out as zeros.
#include "common.cuh"
#include "abi.cuh"
#include "index_checks.cuh"
#include "block_scan.cuh"
#include "topk.cuh"

namespace cupaged {
namespace quest {

// Whether sequence b's length is usable (in [0, width * block_size]); reports it otherwise.
__device__ __forceinline__ bool length_ok(int len, int width, int block_size, long long* err,
                                          int b) {
  if (len < 0) {
    report_error(err, error_code(ARG_SEQ_LENS, CHECK_RANGE), b, -1, len, INT32_MAX_);
    return false;
  }
  if ((i64)len > (i64)width * block_size) {
    report_error(err, error_code(ARG_SEQ_LENS, CHECK_TABLE), b, -1, len, (i64)width * block_size);
    return false;
  }
  return true;
}

// ---------------------------------------------------------------------------- bounds
// A bound stored as TB, rounded outward (a min down, a max up) so that it still bounds.
template <typename TB> __device__ __forceinline__ TB bound_down(float x);
template <typename TB> __device__ __forceinline__ TB bound_up(float x);
template <> __device__ __forceinline__ float bound_down<float>(float x) { return x; }
template <> __device__ __forceinline__ float bound_up<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 bound_down<__nv_bfloat16>(float x) {
  return __float2bfloat16_rd(x);
}
template <> __device__ __forceinline__ __nv_bfloat16 bound_up<__nv_bfloat16>(float x) {
  return __float2bfloat16_ru(x);
}

// grid (pages, batch): pages = width (every page) or 1 (each sequence's last page); block
// THREADS. CTA (i, b) takes page i (or the last) of sequence b; thread t takes the 16-byte
// key chunks t, t + THREADS, ... of the page's kv heads (chunk c: head c / (D / X), dims
// X (c % (D / X)) ...) and folds its valid tokens into min and max, written as TB [num_blocks,
// Hk, D] (bound_down, bound_up). Key element (h, token, d) of block blk sits at blk * k_block +
// h * k_head + (d / X) * k_chunk + d % X + token * k_tok (X = 16 / sizeof(T)).
template <typename T, typename TB, int THREADS>
__global__ void __launch_bounds__(THREADS) quest_bounds_kernel(CUPAGED_PARAMS_QuestBoundsArgs) {
  const QuestBoundsArgs<T, TB> a{CUPAGED_FIELDS_QuestBoundsArgs};
  constexpr int X = 16 / sizeof(T);
  const int b = blockIdx.y;
  const int len = __ldg(a.seq_lens + b);
  if (!length_ok(len, a.width, a.block_size, threadIdx.x == 0 ? a.err : nullptr, b)) return;
  const int used = (int)(((i64)len + a.block_size - 1) / a.block_size);
  const int page = a.last_page_only ? used - 1 : (int)blockIdx.x;
  if (page < 0 || page >= used) return;
  const int blk = __ldg(a.block_tables + (i64)b * a.bt_stride + page);
  if ((unsigned)blk >= (unsigned)a.num_blocks) {
    if (threadIdx.x == 0)
      report_error(a.err, error_code(ARG_BLOCK_TABLES, CHECK_RANGE), b, page, blk, a.num_blocks);
    return;
  }
  const int fill = min(a.block_size, len - page * a.block_size);
  const int chunks = a.head_dim / X;
  const T* base = a.k_cache + (i64)blk * a.k_block;
  for (int c = threadIdx.x; c < a.num_kv_heads * chunks; c += THREADS) {
    const int h = c / chunks, cc = c - h * chunks;
    const T* p = base + (i64)h * a.k_head + (i64)cc * a.k_chunk;
    float lo[X], hi[X];
    load16_float(p, lo);
#pragma unroll
    for (int e = 0; e < X; ++e) hi[e] = lo[e];
    for (int t = 1; t < fill; ++t) {
      float v[X];
      load16_float(p + (i64)t * a.k_tok, v);
#pragma unroll
      for (int e = 0; e < X; ++e) {
        lo[e] = fminf(lo[e], v[e]);
        hi[e] = fmaxf(hi[e], v[e]);
      }
    }
    const i64 out = ((i64)blk * a.num_kv_heads + h) * a.head_dim + cc * X;
    if constexpr (sizeof(TB) == 4) {
#pragma unroll
      for (int e = 0; e < X; e += 4) {
        *reinterpret_cast<float4*>(a.k_min + out + e) =
            make_float4(lo[e], lo[e + 1], lo[e + 2], lo[e + 3]);
        *reinterpret_cast<float4*>(a.k_max + out + e) =
            make_float4(hi[e], hi[e + 1], hi[e + 2], hi[e + 3]);
      }
    } else {
#pragma unroll
      for (int e = 0; e < X; ++e) {
        a.k_min[out + e] = bound_down<TB>(lo[e]);
        a.k_max[out + e] = bound_up<TB>(hi[e]);
      }
    }
  }
}

// ---------------------------------------------------------------------------- select
// The last page takes the largest key of all, above +inf (order_key, topk.cuh: no +inf
// score may displace it).
constexpr u32 LAST_KEY = 0xffffffffu, FIRST_KEY = 0xfffffffeu;

// The selection key of page i of n: the last page above the first `first` pages, those above
// every score.
__device__ __forceinline__ u32 page_key(int i, int n, int first, float s) {
  return i == n - 1 ? LAST_KEY : (i < first ? FIRST_KEY : order_key(s));
}

// grid (B * Hk, ceil(width / pages_per_cta)) (blockIdx.x = b * Hk + h); block THREADS;
// dynamic shared memory group * D floats (the group's queries); bounds TB (float or bf16).
// CTA ((b, h), c) scores pages [c pages_per_cta, (c + 1) pages_per_cta) of sequence b for kv
// head h into scores[b, h, :]: a warp UNROLL pages at a time, their bounds loaded before
// any is reduced (lane l holds dims l, l + 32, ...); score = max over the group's queries of
// sum_d (q_d > 0 ? q_d max_d : q_d < 0 ? q_d min_d : 0); -inf past the sequence (and for a
// sequence with a bad length), +inf for its last page, -inf for a bad block id (reported).
// (A minimum of one CTA a multiprocessor in the launch bounds: without it ptxas spills some
// head sizes on sm_80.)
template <typename T, typename TB, int D, int THREADS, int UNROLL>
__global__ void __launch_bounds__(THREADS, 1) quest_score_kernel(CUPAGED_PARAMS_QuestScoreArgs) {
  const QuestScoreArgs<T, TB> a{CUPAGED_FIELDS_QuestScoreArgs};
  constexpr int WARPS = THREADS / 32, DL = (D + 31) / 32;
  extern __shared__ float s_q[];
  const int row_id = blockIdx.x;
  const int b = row_id / a.num_kv_heads, h = row_id - b * a.num_kv_heads;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int* table = a.block_tables + (i64)b * a.bt_stride;
  float* row_scores = a.scores + (i64)row_id * a.width;
  const int len = __ldg(a.seq_lens + b);
  const bool report = threadIdx.x == 0 && blockIdx.y == 0 && h == 0;
  const int n = length_ok(len, a.width, a.block_size, report ? a.err : nullptr, b)
                    ? (int)(((i64)len + a.block_size - 1) / a.block_size) : 0;
  const int begin = blockIdx.y * a.pages_per_cta;
  const int end = min(a.width, begin + a.pages_per_cta);
  for (int i = threadIdx.x; i < a.group * D; i += THREADS) {
    const int g = i / D;
    s_q[i] = to_float<T>(a.q[(i64)b * a.q_stride + (i64)(h * a.group + g) * D + (i - g * D)]);
  }
  __syncthreads();
  const int stop = min(end, n);
  for (int i0 = begin + warp * UNROLL; i0 < stop; i0 += WARPS * UNROLL) {
    float mx[UNROLL][DL], mn[UNROLL][DL];
    bool ok[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int i = i0 + u;
      const int blk = i < stop ? __ldg(table + i) : 0;
      ok[u] = (unsigned)blk < (unsigned)a.num_blocks;
      if (i < stop && !ok[u] && lane == 0 && h == 0)
        report_error(a.err, error_code(ARG_BLOCK_TABLES, CHECK_RANGE), b, i, blk, a.num_blocks);
      const i64 row = ok[u] ? ((i64)blk * a.num_kv_heads + h) * D : 0;
#pragma unroll
      for (int j = 0; j < DL; ++j) {
        const int d = lane + 32 * j;
        const bool load = i < stop && ok[u] && d < D;
        mx[u][j] = load ? to_float<TB>(__ldg(a.k_max + row + d)) : 0.f;
        mn[u][j] = load ? to_float<TB>(__ldg(a.k_min + row + d)) : 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int i = i0 + u;  // the same for the whole warp
      if (i >= stop) break;
      float best = neg_inf();
      for (int g = 0; g < a.group; ++g) {
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < DL; ++j) {
          const int d = lane + 32 * j;
          const float qd = d < D ? s_q[g * D + d] : 0.f;
          const float prod = qd * (qd > 0.f ? mx[u][j] : mn[u][j]);
          acc += qd != 0.f ? prod : 0.f;  // q_d = 0 adds nothing, even against an infinite bound
        }
        best = fmaxf(best, warp_sum(acc));
      }
      if (lane == 0) {
        const float s = best != best || !ok[u] ? neg_inf() : best;
        row_scores[i] = i == n - 1 ? __int_as_float(0x7f800000) : s;
      }
    }
  }
  for (int i = max(begin, n) + threadIdx.x; i < end; i += THREADS) row_scores[i] = neg_inf();
}

// grid B * Hk (CTA (b, h) = blockIdx.x = b * Hk + h); block THREADS. From the scores of
// quest_score_kernel the CTA finds the key (page_key: the last page, then the first_pages
// first ones, then by score) of the k-th best page by a radix select (8 bits a pass, a
// 256-bin histogram) and keeps, in position order, every page above it and the first pages
// equal to it: positions[b, h, :] (-1 past the count), and a block table row of the
// one-kv-head view (tokens_per_page entries a page: id blk * Hk + h, or (blk * block_size +
// t) * Hk + h per token t) with its key count. A sequence with a bad length or block id
// keeps nothing (count 0; the score kernel reported it).
template <int THREADS>
__global__ void __launch_bounds__(THREADS) quest_select_kernel(CUPAGED_PARAMS_QuestSelectArgs) {
  const QuestSelectArgs a{CUPAGED_FIELDS_QuestSelectArgs};
  __shared__ int s_hist[256];
  __shared__ int s_warp[THREADS / 32 + 1];
  const int b = blockIdx.x / a.num_kv_heads, h = blockIdx.x - b * a.num_kv_heads;
  const int* table = a.block_tables + (i64)b * a.bt_stride;
  const float* row_scores = a.scores + (i64)blockIdx.x * a.width;
  const int len = __ldg(a.seq_lens + b);
  const bool len_ok = length_ok(len, a.width, a.block_size, nullptr, b);
  const int used = len_ok ? (int)(((i64)len + a.block_size - 1) / a.block_size) : 0;
  const int n = table_row_ok<THREADS>(table, used, a.num_blocks, nullptr, b) ? used : 0;

  // the top k pages by key (topk.cuh), written in position order
  const int k = min(a.top_k, a.width);
  const auto key = [&](int i) { return page_key(i, n, a.first_pages, row_scores[i]); };
  const TopK top = radix_select<THREADS>(key, n, k, s_hist);
  const int tpp = a.tokens_per_page;
  int* pos_row = a.positions ? a.positions + (i64)blockIdx.x * k : nullptr;
  int* tab_row = a.sel_tables + (i64)blockIdx.x * k * tpp;
  keep_in_order<THREADS>(key, n, top, s_warp, [&](int slot, int i) {
    const int blk = __ldg(table + i);
    if (pos_row) pos_row[slot] = i;
    if (tpp == 1) {
      tab_row[slot] = blk * a.num_kv_heads + h;
    } else {
      for (int t = 0; t < tpp; ++t) tab_row[slot * tpp + t] = (blk * a.block_size + t) * a.num_kv_heads + h;
    }
  });
  const int count = min(n, k);
  for (int s = count + threadIdx.x; s < k; s += THREADS) {
    if (pos_row) pos_row[s] = -1;
    for (int t = 0; t < tpp; ++t) tab_row[s * tpp + t] = -1;
  }
  if (threadIdx.x == 0)
    a.sel_lens[blockIdx.x] =
        count ? (count - 1) * a.block_size + (len - (n - 1) * a.block_size) : 0;
}

// ---------------------------------------------------------------------------- sinks
// grid ceil(rows / WARPS); block THREADS; a warp a row (token, query head) of a decode's
// output out [rows, D] and natural-log LSE lse [rows] over the keys alone: the sink logit
// s of the row's head joins the denominator, out *= 1 / (1 + exp(s - lse)) and
// lse = logaddexp(lse, s). A row without keys (lse -inf, out zeros) gets lse = s.
template <typename T, int THREADS>
__global__ void __launch_bounds__(THREADS) quest_sinks_kernel(CUPAGED_PARAMS_QuestSinksArgs) {
  const QuestSinksArgs<T> a{CUPAGED_FIELDS_QuestSinksArgs};
  const int row = blockIdx.x * (THREADS / 32) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (row >= a.rows) return;
  const float sink = __ldg(a.sinks + row % a.num_q_heads), row_lse = a.lse[row];
  const float scale = row_lse == neg_inf() ? 0.f : 1.f / (1.f + expf(sink - row_lse));
  T* o = a.out + (i64)row * a.head_dim;
  for (int d = lane; d < a.head_dim; d += 32) o[d] = from_float<T>(to_float<T>(o[d]) * scale);
  __syncwarp();
  if (lane == 0)
    a.lse[row] = row_lse == neg_inf() ? sink
                                     : fmaxf(row_lse, sink) + log1pf(expf(-fabsf(row_lse - sink)));
}

}  // namespace quest
}  // namespace cupaged
