// Vertical+slash index conversion (MInference) and the tile lists of the attention kernel.
//
// vs_prepare turns sorted index rows into what the walks of sparse_plan.cuh need (unique
// verticals, the runs of the slash row) and decides which rows run dense; vs_index_kernel
// writes MInference's block_offset / column_index lists; vs_plan_kernel writes the per-CTA
// tile lists of sparse_attention.cu into slots of a length bounded from shapes (no count
// goes back to the host); bsr_prepare checks a batched launch's lengths and block tables and
// schedules its CTAs (BSR, and vertical+slash without a pattern frame).
#include "sparse_plan.cuh"
#include "abi.cuh"
#include "block_scan.cuh"

namespace cupaged {

// PREP_THREADS (the prepare kernels' block) and SP_THREADS: from cupaged.sparse.launch

// Block counts of one query block's pattern (vs_block_lists): key blocks and columns.
struct BlockCount {
  i64 nblk, ncol;
  int bn;
  __device__ __forceinline__ void blocks(i64 rs, i64 re) { nblk += (re - rs) / bn; }
  __device__ __forceinline__ void columns(int a, int b) { ncol += b - a; }
};

// grid rows (= batch * heads of the index arrays), block PREP_THREADS. Block -> one row;
// thread t owns the contiguous chunk t of the row and walks it twice around a block scan.
// Lengths of sequence b: kv_lens[b * len_stride] (and q_lens[b * len_stride]).
// Verticals: the unique values < kv_len, packed at the front of v_unique's row, their number
// in v_count. Slashes: run_first[i] = first index of i's run (gaps <= bm, sparse_plan.cuh).
// A row holding a negative index is reported to err (argument v_idx or s_idx) and emptied
// (no vertical; its slashes set to PAD, past every key). With dense (the attention path):
// dense[row] = 1 when the row's pattern keeps more than dense_threshold of its causal
// blocks (cupaged.reference.sparse.dense_heads: per query block m, its key blocks plus
// ceil(columns / bn), against ceil(min(end_m, kv_len) / bn)); the threads take the query
// blocks in turn. (Minimum one CTA an SM: ptxas would otherwise cap the walks' registers
// and spill.)
__global__ void __launch_bounds__(PREP_THREADS, 1) vs_prepare(CUPAGED_PARAMS_VsPrepareArgs) {
  __shared__ int buf[PREP_THREADS];
  __shared__ unsigned long long sums[2];
  const i64 row = blockIdx.x;
  const int b = (int)(row / heads);
  const int kv_len = kv_lens[(i64)b * len_stride];
  int total;

  // -- negative entries (the rows are sorted: the first entry is the least) --
  const int* v = v_sorted + row * nv;
  int* s = s_sorted + row * ns;
  const bool bad_v = nv > 0 && v[0] < 0, bad_s = ns > 0 && s[0] < 0;
  if (threadIdx.x == 0 && bad_v)
    report_error(err, error_code(ARG_V_IDX, CHECK_RANGE), row, 0, v[0], 0x7fffffff);
  if (threadIdx.x == 0 && bad_s && !bad_v)
    report_error(err, error_code(ARG_S_IDX, CHECK_RANGE), row, 0, s[0], 0x7fffffff);
  __syncthreads();  // s[0] read by every thread before a bad row's slashes are overwritten
  const bool bad = bad_v || bad_s;
  if (bad)
    for (int i = threadIdx.x; i < ns; i += PREP_THREADS) s[i] = 0x7fffffff;

  // -- verticals: keep first occurrences below kv_len --
  int* vu = v_unique + row * nv;
  const int pv = (nv + PREP_THREADS - 1) / PREP_THREADS;
  const int v0 = min(nv, (int)threadIdx.x * pv), v1 = min(nv, v0 + pv);
  auto keep = [&](int i) { return !bad && v[i] < kv_len && (i == 0 || v[i] != v[i - 1]); };
  int count = 0;
  for (int i = v0; i < v1; ++i) count += keep(i);
  int at = block_scan<PREP_THREADS>(count, buf, total);
  for (int i = v0; i < v1; ++i)
    if (keep(i)) vu[at++] = v[i];
  if (threadIdx.x == 0) v_count[row] = total;

  // -- slashes: run starts, carried over the chunks by a max scan --
  int* rf = run_first + row * ns;
  const int ps = (ns + PREP_THREADS - 1) / PREP_THREADS;
  const int s0 = min(ns, (int)threadIdx.x * ps), s1 = min(ns, s0 + ps);
  auto starts = [&](int i) { return i == 0 || (i64)s[i] - s[i - 1] > bm; };
  int last = -1;
  for (int i = s0; i < s1; ++i)
    if (starts(i)) last = i;
  int cur = block_scan<PREP_THREADS, true>(last, buf, total, -1);
  for (int i = s0; i < s1; ++i) {
    if (starts(i)) cur = i;
    rf[i] = cur;
  }
  if (dense == nullptr) return;

  // -- dense fallback: kept and causal blocks of the row's query blocks --
  if (threadIdx.x < 2) sums[threadIdx.x] = 0;
  __syncthreads();  // the row's v_unique, v_count and run_first written; sums zeroed
  VsRow p;
  p.init(s_sorted, run_first, ns, v_unique, v_count, nv, row);
  const int q_len = q_lens[(i64)b * len_stride];
  i64 kept = 0, causal = 0;
  for (int m = threadIdx.x; (i64)m * bm < q_len; m += PREP_THREADS) {
    BlockCount n{0, 0, bn};
    vs_block_lists(p, m, q_len, kv_len, bm, bn, n);
    const i64 limit = imin((i64)kv_len - q_len + (i64)m * bm + bm, kv_len);
    kept += n.nblk + (n.ncol + bn - 1) / bn;
    causal += (imax(limit, 0) + bn - 1) / bn;
  }
  atomicAdd(&sums[0], (unsigned long long)kept);
  atomicAdd(&sums[1], (unsigned long long)causal);
  __syncthreads();
  if (threadIdx.x == 0) dense[row] = (double)sums[0] > dense_threshold * (double)sums[1];
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

// grid ceil(batch * heads * num_m / 4), block SP_THREADS: warp -> (b, h, m), m fastest; the whole
// warp walks block m of head h (vs_block_lists) and writes its lists. Outputs are
// [batch, heads, num_m] counts and [batch, heads, num_m, w] lists (entries past the counts
// untouched). Lengths outside 0 <= seqlens[b] <= max_q and seqlens[b] <= kv_seqlens[b] <=
// max_kv (the bounds the host sized the lists by) are reported to err by the warp of
// (b, 0, 0) and give the sequence empty lists.
__global__ void __launch_bounds__(SP_THREADS) vs_index_kernel(CUPAGED_PARAMS_VsIndexArgs) {
  const i64 item = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  if (item >= (i64)batch * heads * num_m) return;
  const int m = (int)(item % num_m);
  const i64 row = item / num_m;  // b * heads + h
  const int b = (int)(row / heads);
  const int q_len = seqlens[b], kv_len = kv_seqlens[b];
  const bool q_ok = q_len >= 0 && q_len <= max_q, kv_ok = kv_len >= q_len && kv_len <= max_kv;
  if (item % ((i64)heads * num_m) == 0 && threadIdx.x % 32 == 0) {
    if (!q_ok) report_error(err, error_code(ARG_SEQLENS, CHECK_RANGE), b, -1, q_len, max_q);
    else if (!kv_ok) report_error(err, error_code(ARG_KV_SEQLENS, CHECK_RANGE), b, -1, kv_len, max_kv);
  }
  VsRow p;
  p.init(s_sorted, run_first, ns, v_unique, v_count, nv, row);
  WarpLists out{p.v, block_offset + item * w_s, column_index + item * w_v, w_s, w_v, bn, 0, 0};
  if (q_ok && kv_ok) vs_block_lists(p, m, q_len, kv_len, bm, bn, out);
  if (threadIdx.x % 32 == 0) {
    block_count[item] = out.nblk;
    column_count[item] = out.ncol;
  }
}

// ----------------------------------------------------------------------------- tile lists
// Tile sink of the plan kernel (a warp per list; every lane walks alike): the tiles of each
// piece written with the lanes in parallel.
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

// grid ceil(heads * cta_bound / 4), block 128: warp -> the list of (query head head0 + h,
// CTA map entry at), at fastest, for the CTA's sequence and row of bsr_prepare's schedule in
// meta; index rows [batch, total_heads, n]. The list goes to tiles[item * cap ..] (cap:
// tiles.list_bound, from shapes), its length to counts[item] (0 past the last CTA): the
// CTA's vs_cta_tiles, or for a row that runs dense (dense[b * total_heads + head]; nullptr:
// none) the dense kernel's sequence, every tile_n keys below the CTA's causal clip held by
// both halves (at most ceil(max_kv / tile_n) <= cap tiles). (One CTA an SM at least, as
// vs_prepare.)
__global__ void __launch_bounds__(SP_THREADS, 1) vs_plan_kernel(CUPAGED_PARAMS_VsPlanArgs) {
  const i64 item = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  if (item >= (i64)heads * cta_bound) return;
  const int at = (int)(item % cta_bound), h = (int)(item / cta_bound);
  const int b = meta[4 * (batch + 1) + at];
  if (b < 0) {
    if (threadIdx.x % 32 == 0) counts[item] = 0;
    return;
  }
  const int4 info = reinterpret_cast<const int4*>(meta)[b];  // (row, kv_len, first CTA, q_len)
  const i64 row = (i64)b * total_heads + head0 + h;
  const int c = at - info.z;
  int2* base = tiles + item * cap;
  TileWrite w{base};
  if (dense != nullptr && dense[row]) {
    const i64 clip = (i64)info.y - info.w + imin((i64)c * 128 + 128, info.w);
    w.piece(0, (int)imax(imin(clip, info.y), 0), TILE_A | TILE_B, tile_n);
  } else {
    VsRow p;
    p.init(s_sorted, run_first, ns, v_unique, v_count, nv, row);
    vs_cta_tiles(p, c, info.w, info.y, bm, bn, tile_n, w);
  }
  if (threadIdx.x % 32 == 0) counts[item] = (int)(w.t - base);
}

// ----------------------------------------------------------------------------- batched BSR
// Whether cu[b], cu[b + 1] bound sequence b's rows in [0, total) (cu[0] == 0); the first
// failure is reported (argument: ARG_CU_SEQLENS_Q or _K).
__device__ __forceinline__ bool rows_ok(const int* cu, int b, int total, int argument, long long* err) {
  const int x0 = __ldg(cu + b), x1 = __ldg(cu + b + 1);
  if (b == 0 && x0 != 0) report_error(err, error_code(argument, CHECK_START), 0, -1, x0, 0);
  else if (x1 < x0) report_error(err, error_code(argument, CHECK_ORDER), b + 1, -1, x1, x0);
  else if (x1 > total) report_error(err, error_code(argument, CHECK_END), b + 1, -1, x1, total);
  else return true;
  return false;
}

// Keys of sequence b, 0 when its lengths (or its block-table row, below) are bad.
__device__ __forceinline__ int bsr_kv_len(const BsrPrepareArgs& a, int b) {
  if (a.seq_lens == nullptr)
    return rows_ok(a.cu_k, b, a.total_k, ARG_CU_SEQLENS_K, a.err) ? __ldg(a.cu_k + b + 1) - __ldg(a.cu_k + b) : 0;
  const int len = __ldg(a.seq_lens + b);
  if (len < 0) {
    report_error(a.err, error_code(ARG_SEQ_LENS, CHECK_RANGE), b, -1, len, 0x7fffffff);
    return 0;
  }
  if (((unsigned)len + a.page_size - 1) / (unsigned)a.page_size > (unsigned)a.table_width) {
    report_error(a.err, error_code(ARG_SEQ_LENS, CHECK_TABLE), b, -1, len, (i64)a.table_width * a.page_size);
    return 0;
  }
  return len;
}

// grid 1, block PREP_THREADS: the schedule of a batched launch of sparse_attention, in
// meta: int4 [batch] per sequence (first CSR row, keys, first CTA, queries; keys and queries
// 0 when bad), int4 at [batch] for the pattern (1 if indptr fits the lengths, CSR rows,
// CTAs, 0; not written without indptr: vertical+slash), then int [cta_bound]: the
// sequence of each CTA (cta_rows query rows), -1 past the last. Thread t owns the sequences of
// chunk t. A bad cu_seqlens_q gives every sequence no CTA (rows unknown); bad key lengths or
// block ids give the sequence no keys (zeros); an indptr of the wrong size or ends gives no
// sequence a pattern row (zeros). Rows past cu_seqlens_q[batch] are zeroed (padding). (One
// CTA: __launch_bounds__ says so, or ptxas would cap its registers for occupancy and spill.)
__global__ void __launch_bounds__(PREP_THREADS, 1) bsr_prepare(CUPAGED_PARAMS_BsrPrepareArgs) {
  const BsrPrepareArgs a{CUPAGED_FIELDS_BsrPrepareArgs};
  __shared__ int buf[PREP_THREADS];
  int4* seq = reinterpret_cast<int4*>(a.meta);
  int* cta_map = a.meta + 4 * (a.batch + 1);
  const int per = (a.batch + PREP_THREADS - 1) / PREP_THREADS;
  const int b0 = min(a.batch, (int)threadIdx.x * per), b1 = min(a.batch, b0 + per);

  // -- query rows: one bad prefix and no sequence runs --
  int bad = 0;
  for (int b = b0; b < b1; ++b) bad |= !rows_ok(a.cu_q, b, a.total_q, ARG_CU_SEQLENS_Q, a.err);
  bad = __syncthreads_or(bad);

  // -- CSR rows and CTAs of each sequence, scanned over the chunks --
  int rows = 0, ctas = 0, total_rows, total_ctas;
  for (int b = b0; b < b1; ++b) {
    const int n = bad ? 0 : __ldg(a.cu_q + b + 1) - __ldg(a.cu_q + b);
    rows += (n + a.block_m - 1) / a.block_m;
    ctas += (n + a.cta_rows - 1) / a.cta_rows;
  }
  int row_at = block_scan<PREP_THREADS>(rows, buf, total_rows);
  int cta_at = block_scan<PREP_THREADS>(ctas, buf, total_ctas);
  for (int b = b0; b < b1; ++b) {
    const int n = bad ? 0 : __ldg(a.cu_q + b + 1) - __ldg(a.cu_q + b), nc = (n + a.cta_rows - 1) / a.cta_rows;
    seq[b] = make_int4(a.pattern_heads * row_at, bsr_kv_len(a, b), cta_at, n);
    for (int c = 0; c < nc; ++c) cta_map[cta_at + c] = b;
    row_at += (n + a.block_m - 1) / a.block_m;
    cta_at += nc;
  }
  for (int i = total_ctas + threadIdx.x; i < a.cta_bound; i += PREP_THREADS) cta_map[i] = -1;
  __syncthreads();

  // -- block ids of every page a sequence uses --
  if (a.block_tables != nullptr) {
    for (int b = 0; b < a.batch; ++b) {
      int* kv_len = a.meta + 4 * b + 1;
      const int need = (int)(((unsigned)*kv_len + a.page_size - 1) / (unsigned)a.page_size);
      const int* row = a.block_tables + (i64)b * a.table_stride;
      for (int j = threadIdx.x; j < need; j += PREP_THREADS) {
        const int id = __ldg(row + j);
        if ((unsigned)id >= (unsigned)a.num_blocks) {
          report_error(a.err, error_code(ARG_BLOCK_TABLES, CHECK_RANGE), b, j, id, a.num_blocks);
          *kv_len = 0;
        }
      }
    }
  }

  // -- the pattern's frame: indptr sized by the lengths, from 0 to nnz --
  if (threadIdx.x == 0 && a.indptr != nullptr) {
    const int n_rows = a.pattern_heads * total_rows;
    bool ok = !bad;
    if (ok && n_rows + 1 != a.indptr_len) {
      report_error(a.err, error_code(ARG_INDPTR, CHECK_SIZE), -1, -1, a.indptr_len, n_rows + 1);
      ok = false;
    } else if (ok && __ldg(a.indptr) != 0) {
      report_error(a.err, error_code(ARG_INDPTR, CHECK_START), 0, -1, __ldg(a.indptr), 0);
      ok = false;
    } else if (ok && __ldg(a.indptr + n_rows) != a.nnz) {
      report_error(a.err, error_code(ARG_INDPTR, CHECK_LAST), n_rows, -1, __ldg(a.indptr + n_rows), a.nnz);
      ok = false;
    }
    seq[a.batch] = make_int4(ok, n_rows, total_ctas, 0);
  }

  // -- padding rows past the last sequence --
  const int q_end = bad ? a.total_q : __ldg(a.cu_q + a.batch);
  uint4* pad = reinterpret_cast<uint4*>(a.out + q_end * a.row_bytes);
  for (i64 i = threadIdx.x; i < (a.total_q - q_end) * (a.row_bytes / 16); i += PREP_THREADS)
    pad[i] = make_uint4(0, 0, 0, 0);
  if (a.lse != nullptr)
    for (i64 i = (i64)q_end * a.num_q_heads + threadIdx.x; i < (i64)a.total_q * a.num_q_heads; i += PREP_THREADS)
      a.lse[i] = neg_inf();
}

}  // namespace cupaged
