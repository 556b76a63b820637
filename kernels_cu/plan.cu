// Device plans: the work of a decode step and of a prefill launch, computed where the lengths,
// prefix sums and block tables live (on the device), with every index they hold checked.
//
//   decode_plan_kernel   checks each sequence's length and the block ids it will read, then
//                        cuts the sequences' key tiles into the "balanced" schedule's pieces
//                        (decode_plan.balanced_pieces) and writes them as decode_plan.pack_work
//                        does, for decode.cu's kernels
//   prefill_plan_kernel  checks cu_seqlens_q / cu_seqlens_k or the lengths and block tables,
//                        zeroes the output rows no sequence owns, and writes the work items of
//                        prefill.cu's kernels (prefill_plan.work_list), longest first
//
// Both run their checks on every CTA of a small grid (a sequence a CTA at a time); the last
// CTA to finish (a counter in `done`, re-armed to 0) then builds the plan alone. A bad entry
// is reported to the error word (report_error) and never followed: its sequence gets no keys
// (decode: an empty piece; prefill: items flagged w = 1), so its rows come out as zeros.
#include "common.cuh"
#include "abi.cuh"
#include "index_checks.cuh"
#include "block_scan.cuh"

namespace cupaged {
namespace plan {

constexpr int WARPS = THREADS / 32;  // THREADS: the block (core.abi.PLAN_THREADS)
constexpr int BUCKETS = 2048;  // prefill cost buckets (key tiles; longer items share the last)

// Exclusive scan of get(i) over i in [0, n): put(i, prefix, value) for each; returns the sum.
template <typename Get, typename Put>
__device__ int scan(int n, Get get, Put put, int* s_warp) {
  int carry = 0;
  for (int base = 0; base < n; base += THREADS) {
    const int i = base + threadIdx.x;
    const int x = i < n ? get(i) : 0;
    int total;
    const int ex = block_scan<THREADS>(x, s_warp, total);
    if (i < n) put(i, carry + ex, x);
    carry += total;
  }
  __syncthreads();  // every put done before anyone reads what it wrote
  return carry;
}

// The largest i in [0, n) with a[i] <= x, for a non-decreasing a with a[0] <= x.
__device__ __forceinline__ int last_at_most(const int* a, int n, int x) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (a[mid] <= x) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// True in the CTA that finished last (every CTA calls once, after its checks); it re-arms
// the counter. Its loads of what the others wrote must bypass L1 (__ldcg).
__device__ __forceinline__ bool last_cta(int* done, int* s_flag) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int ticket = atomicAdd(done, 1);
    *s_flag = ticket == (int)gridDim.x - 1;
    if (*s_flag) *done = 0;
  }
  __syncthreads();
  if (*s_flag) __threadfence();
  return *s_flag;
}

// Whether sequence b is usable: its length len is not negative, its kv = len + append keys
// fit its block-table row of `width` blocks (keys_fit, reported by thread 0), and their block
// ids are in [0, num_blocks) (table_row_ok). Every thread of the CTA calls.
__device__ __forceinline__ bool sequence_ok(int len, int append, const int* table_row, int width,
                                            int block_size, int num_blocks, long long* err, int b) {
  const i64 kv = (i64)len + append;
  const bool len_ok = keys_fit(len, kv, width, block_size, threadIdx.x == 0 ? err : nullptr, b);
  const int need = len_ok ? (int)((kv + block_size - 1) / block_size) : 0;
  return len_ok && table_row_ok<THREADS>(table_row, need, num_blocks, err, b);
}

// ---------------------------------------------------------------------------- decode
// Scratch (ints): S, N, F, C, P per sequence (tile offset, tiles, first visible tile, first
// chunk, piece offset), then R per piece (its descriptor row).
//
// grid: any number of CTAs (a few tens); block THREADS. CTA c checks sequences c, c + grid,
// ...: length in [0, width * block_size - append] and the block ids of its keys (and of the
// appended one); lens_out[b] is the length, or -1 for a bad sequence (the append kernel
// skips it, the plan gives it no keys). The last CTA then lays the sequences' visible key
// tiles end to end and cuts them into shares of max(ceil(total / columns), min_piece tiles,
// ceil(sqrt(max_tiles * piece_num / piece_den))) tiles (decode_plan.min_piece_tiles), one a
// column: descriptors as decode_plan.pack_work writes them without a pool. With a row map
// (paged_attention's decode launch: rows written by prefill_plan_kernel) a sequence with
// rows[b] < 0 is not a decode row: not checked here (the prefill plan did), no keys.
__global__ void __launch_bounds__(THREADS) decode_plan_kernel(CUPAGED_PARAMS_DecodePlanArgs) {
  const DecodePlanArgs a{CUPAGED_FIELDS_DecodePlanArgs};
  __shared__ int s_warp[WARPS + 1];
  __shared__ int s_flag, s_max;
  for (int b = blockIdx.x; b < a.batch; b += gridDim.x) {
    const int len = __ldg(a.seq_lens + b);
    const bool decode_row = a.rows == nullptr || __ldg(a.rows + b) >= 0;  // uniform in the CTA
    const int* row = a.block_tables + (i64)b * a.bt_stride;
    const bool ok = decode_row && sequence_ok(len, a.append, row, a.width, a.block_size,
                                              a.num_blocks, a.err, b);
    if (threadIdx.x == 0) a.lens_out[b] = ok ? len : -1;
  }
  if (!last_cta(a.done, &s_flag)) return;

  const int B = a.batch;
  int* S = a.scratch;
  int* N = S + B;
  int* F = N + B;
  int* C = F + B;
  int* P = C + B;
  int* R = P + B;
  if (threadIdx.x == 0) s_max = 0;
  __syncthreads();
  // -- visible tiles of each sequence, laid end to end --
  const int total = scan(B,
      [&](int b) {
        const int len = __ldcg(a.lens_out + b);
        const int kv = len >= 0 ? len + a.append : 0;
        const int lo = a.window_left >= 0 ? max(0, kv - 1 - a.window_left) : 0;
        const int first = lo / a.tile;
        const int n = kv > 0 ? (kv + a.tile - 1) / a.tile - first : 0;
        F[b] = first;
        N[b] = n;
        atomicMax(&s_max, n);
        return n;
      },
      [&](int b, int prefix, int) { S[b] = prefix; }, s_warp);
  const double c = (double)a.piece_num / (double)a.piece_den;
  const int shortest = max(a.min_piece, (int)ceil(sqrt((double)s_max * c)));
  const int share = max(max(1, shortest), (total + a.columns - 1) / a.columns);
  // -- pieces: one per share a sequence's tiles touch (one for a sequence without keys) --
  const int pieces = scan(B,
      [&](int b) {
        const int s = S[b], n = N[b];
        const int f = s / share, l = n > 0 ? (s + n - 1) / share : f;
        C[b] = f;
        return l - f + 1;
      },
      [&](int b, int prefix, int per) {
        P[b] = prefix;
        a.seq_info[2 * b] = per;
      }, s_warp);
  scan(B, [&](int b) { const int per = a.seq_info[2 * b]; return per > 1 ? per : 0; },
       [&](int b, int prefix, int per) { a.seq_info[2 * b + 1] = per > 1 ? prefix : -1; },
       s_warp);
  // -- descriptor rows: a column's first piece in row `column`, the others after the header --
  auto column_of = [&](int g, int& b, int& k, int& chunk) {
    b = last_at_most(P, B, g);
    k = g - P[b];
    chunk = C[b] + k;
    return min(chunk, a.columns - 1);
  };
  const int rest = scan(pieces,
      [&](int g) {
        int b, k, chunk;
        const int col = column_of(g, b, k, chunk);
        bool lead = g == 0;
        if (!lead) {
          int b1, k1, chunk1;
          lead = column_of(g - 1, b1, k1, chunk1) != col;
        }
        R[g] = lead ? col : -1;
        return lead ? 0 : 1;
      },
      [&](int g, int prefix, int) { if (R[g] < 0) R[g] = a.columns + 1 + prefix; }, s_warp);
  int4* desc = reinterpret_cast<int4*>(a.work);
  for (int r = threadIdx.x; r < a.columns; r += THREADS) {  // NO_PIECE
    desc[2 * r] = make_int4(-1, 0, 0, 0);
    desc[2 * r + 1] = make_int4(0, 1, -1, -1);
  }
  if (threadIdx.x == 0) {  // the pool header: its first row, no pieces
    desc[2 * a.columns] = make_int4(a.columns + 1 + rest, 0, 0, 0);
    desc[2 * a.columns + 1] = make_int4(0, 0, 0, 0);
  }
  __syncthreads();
  for (int g = threadIdx.x; g < pieces; g += THREADS) {
    int b, k, chunk;
    column_of(g, b, k, chunk);
    const int s = S[b], n = N[b], per = a.seq_info[2 * b], slot0 = a.seq_info[2 * b + 1];
    const int lo = max(s, chunk * share), hi = min(s + n, (chunk + 1) * share);
    const int t_begin = F[b] + (lo - s);
    const int len = __ldcg(a.lens_out + b);
    const int kv = len >= 0 ? len + a.append : 0;
    const int next = g + 1 < pieces && R[g + 1] > a.columns ? R[g + 1] : -1;
    const int row = R[g];
    desc[2 * row] = make_int4(b, kv, t_begin, t_begin + max(0, hi - lo));
    desc[2 * row + 1] = make_int4(k, per, per > 1 ? slot0 + k : -1, next);
  }
}

// ---------------------------------------------------------------------------- prefill
// Scratch (ints): [0] every sequence bad (cu_seqlens unusable; zero before a launch, re-armed
// by the last CTA), then V per sequence (1: its keys may be read), T per sequence (first
// item); the bucket offsets live in shared memory.
//
// grid: any number of CTAs; block THREADS. CTA c checks sequences c, c + grid, ...:
// cu_seqlens_q (first entry 0, non-decreasing, within q's rows) and cu_seqlens_k likewise
// (ragged), or the length and its block ids (paged); a bad prefix sum makes every row
// unusable, a bad length or block id only its sequence (whose items are flagged w = 1: no
// keys). Every CTA zeroes its share of the rows past cu_seqlens_q[batch] (padding; LSE -inf).
// The last CTA then writes one item per (sequence, kv head, block_m packed rows), in sections of
// section_heads kv heads (prefill_plan.work_list), each section ordered by the key tiles the
// item's rows see (counting sort, largest first), and pads the list to `capacity` with sequence
// -1 (the kernels' CTAs for those return at once). With a row map (`rows`, paged_attention's
// split) sequences of one query row get no item and the last CTA writes rows[b] = cu_q[b] for
// them, -1 for the others (all -1 when the prefix sums are bad): the decode launch's rows
// (prefill.plan.decode_rows is the host twin).
__device__ __forceinline__ void zero_rows(const PrefillPlanArgs& a, i64 r0, i64 r1, int cta,
                                          int ctas) {
  if (r1 <= r0) return;
  uint4* out = reinterpret_cast<uint4*>(a.out + r0 * a.row_bytes);
  const i64 vecs = (r1 - r0) * (a.row_bytes / 16);
  for (i64 i = (i64)cta * THREADS + threadIdx.x; i < vecs; i += (i64)ctas * THREADS)
    out[i] = make_uint4(0, 0, 0, 0);
  if (a.lse != nullptr)
    for (i64 i = r0 * a.num_q_heads + (i64)cta * THREADS + threadIdx.x; i < r1 * a.num_q_heads;
         i += (i64)ctas * THREADS)
      a.lse[i] = neg_inf();
}

__device__ __forceinline__ bool prefix_ok(const int* cu, int b, int total, int argument,
                                          long long* err) {
  const int x0 = __ldg(cu + b), x1 = __ldg(cu + b + 1);
  bool ok = true;
  if (b == 0 && x0 != 0) {
    report_error(err, error_code(argument, CHECK_START), 0, -1, x0, 0);
    ok = false;
  }
  if (x1 < x0) {
    report_error(err, error_code(argument, CHECK_ORDER), b + 1, -1, x1, x0);
    ok = false;
  } else if (x1 > total) {
    report_error(err, error_code(argument, CHECK_END), b + 1, -1, x1, total);
    ok = false;
  }
  return ok;
}

__global__ void __launch_bounds__(THREADS) prefill_plan_kernel(CUPAGED_PARAMS_PrefillPlanArgs) {
  const PrefillPlanArgs a{CUPAGED_FIELDS_PrefillPlanArgs};
  __shared__ int s_warp[WARPS + 1];
  __shared__ int s_flag;
  __shared__ int s_bucket[BUCKETS];
  const int B = a.batch;
  int* all_bad = a.scratch;
  int* V = a.scratch + 1;
  int* T = V + B;
  for (int b = blockIdx.x; b < B; b += gridDim.x) {
    bool prefixes = true;
    bool ok = true;
    if (threadIdx.x == 0) {
      prefixes = prefix_ok(a.cu_q, b, a.total_q, ARG_CU_SEQLENS_Q, a.err);
      if (!a.paged) prefixes = prefix_ok(a.kv_info, b, a.total_k, ARG_CU_SEQLENS_K, a.err) && prefixes;
      if (!prefixes) atomicOr(all_bad, 1);
    }
    if (a.paged) {
      ok = sequence_ok(__ldg(a.kv_info + b), 0, a.block_tables + (i64)b * a.bt_stride, a.width,
                       a.block_size, a.num_blocks, a.err, b);
    }
    if (threadIdx.x == 0) V[b] = ok;
  }
  // -- padding rows: past the last prefix, when that lies within q --
  const int q_end = __ldg(a.cu_q + B);
  if (q_end >= 0 && q_end <= a.total_q) zero_rows(a, q_end, a.total_q, blockIdx.x, gridDim.x);
  if (!last_cta(a.done, &s_flag)) return;

  int4* list = a.work;
  const int padding_from = __ldcg(all_bad) ? 0 : -1;
  __syncthreads();  // every thread has read the flag
  if (threadIdx.x == 0) *all_bad = 0;  // re-armed for the next launch
  if (a.rows != nullptr)
    for (int b = threadIdx.x; b < B; b += THREADS) {
      const int q0 = __ldg(a.cu_q + b);
      a.rows[b] = padding_from < 0 && __ldg(a.cu_q + b + 1) - q0 == 1 ? q0 : -1;
    }
  int items = 0;
  if (padding_from < 0) {
    // -- items per sequence, and their first index --
    items = scan(B,
        [&](int b) {
          const int q_len = __ldg(a.cu_q + b + 1) - __ldg(a.cu_q + b);
          if (a.rows != nullptr && q_len == 1) return 0;  // a row of the decode launch
          return (int)(((i64)q_len * a.group + a.block_m - 1) / a.block_m);
        },
        [&](int b, int prefix, int) { T[b] = prefix; }, s_warp);
    for (int i = threadIdx.x; i < BUCKETS; i += THREADS) s_bucket[i] = 0;
    __syncthreads();
    // -- cost of an item: the key tiles its rows see (prefill_plan.work_list) --
    auto cost = [&](int i, int& b, int& row0, int& flag) {
      b = last_at_most(T, B, i);  // the last of the sequences starting at or before item i
      const int q0 = __ldg(a.cu_q + b), q_len = __ldg(a.cu_q + b + 1) - q0;
      flag = __ldcg(V + b) ? 0 : 1;
      int kv_len;
      if (a.paged) kv_len = flag ? 0 : __ldg(a.kv_info + b);
      else kv_len = __ldg(a.kv_info + b + 1) - __ldg(a.kv_info + b);
      const i64 rows = (i64)q_len * a.group;
      row0 = (i - T[b]) * a.block_m;
      const i64 row_last = min((i64)row0 + a.block_m, rows) - 1;
      const i64 shift = (i64)kv_len - q_len;
      const i64 p_first = shift + row0 / a.group, p_last = shift + row_last / a.group;
      const i64 j_begin = a.window_left >= 0 ? max((i64)0, p_first - a.window_left) : 0;
      const i64 j_end = a.causal ? min((i64)kv_len, p_last + 1) : kv_len;
      const i64 n = j_end > j_begin ? (j_end - 1) / a.block_n - j_begin / a.block_n + 1 : 0;
      return (int)min(n, (i64)BUCKETS - 1);
    };
    for (int i = threadIdx.x; i < items; i += THREADS) {
      int b, row0, flag;
      atomicAdd(&s_bucket[cost(i, b, row0, flag)], 1);
    }
    __syncthreads();
    // -- bucket offsets, the largest cost first --
    scan(BUCKETS, [&](int c) { return s_bucket[BUCKETS - 1 - c]; },
         [&](int c, int prefix, int) { s_bucket[BUCKETS - 1 - c] = prefix; }, s_warp);
    // -- the list: section by section of section_heads kv heads, each in bucket order --
    for (int i = threadIdx.x; i < items; i += THREADS) {
      int b, row0, flag;
      const int pos = atomicAdd(&s_bucket[cost(i, b, row0, flag)], 1);
      for (int h0 = 0; h0 < a.num_kv_heads; h0 += a.section_heads) {
        const int hs = min(a.section_heads, a.num_kv_heads - h0);
        for (int hk = h0; hk < h0 + hs; ++hk)
          list[(i64)items * h0 + (i64)pos * hs + (hk - h0)] = make_int4(b, hk, row0, flag);
      }
    }
  } else {
    zero_rows(a, 0, a.total_q, 0, 1);
  }
  for (i64 i = (i64)items * a.num_kv_heads + threadIdx.x; i < a.capacity; i += THREADS)
    list[i] = make_int4(-1, 0, 0, 0);
}

}  // namespace plan
}  // namespace cupaged
