// Block-sparse attention on tensor cores: vertical+slash (MInference) and BSR patterns over
// dense packed or paged K/V, GQA, sinks, fp16/bf16.
//
// A CTA computes 128 query rows of one head, the 64-row tiles 2c (half a) and 2c + 1 (half
// b) of a sequence, with the tile core of the dense kernel (attn_tile.cuh: 4 warps x 32 rows,
// 64-key K/V tiles, two stages, one barrier per tile; 8 warps x 16 rows and 32-key tiles at
// D = 256); the warps of a half own its 64 rows. The CTA walks its tile list (sparse_plan.cuh,
// built by sparse_index.cu) from the end: each K/V tile - contiguous keys of the halves' key
// blocks, or vertical columns gathered from the head's vertical row - is loaded once and
// computed by the warps of the halves whose pattern holds it. Only tiles that cross a warp's
// diagonal (or are not full) are masked; a tile past every row of a warp is skipped.
#include "attn_tile.cuh"
#include "sparse_plan.cuh"

namespace cupaged {

constexpr int HALF_ROWS = 64;          // query rows of one pattern half
constexpr int EMPTY_KEY = 0x7fffffff;  // key of an empty K/V tile row (past every row's limit)

// cp.async of 8 bytes (the L1-allocating form; .cg takes only 16).
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" :: "r"(smem_addr(smem)), "l"(gmem) : "memory");
}

template <typename T>
struct SparseProblem {
  const T* __restrict__ q;
  const T* __restrict__ k;
  const T* __restrict__ v;
  T* __restrict__ out;
  float* __restrict__ lse;
  const int* __restrict__ cu_q;
  const int* __restrict__ kv_lens;
  const int* __restrict__ cu_k;          // dense rows: sequence starts; paged: unused
  const int* __restrict__ block_tables;  // nullptr: dense rows
  int table_stride, page_size;
  i64 page_stride, tok_stride, head_stride;
  int num_q_heads, group, head0, plan_heads, num_c;
  const i64* __restrict__ plan_ptr;      // [plan rows + 1] tile list offsets
  const int2* __restrict__ tiles;
  const int* __restrict__ cols;          // [batch, cols_heads, cols_width] vertical rows, or nullptr
  int cols_heads, cols_width, causal;
  float scale_log2;                      // sm_scale * log2(e)
  const float* __restrict__ sinks;
};

// Query rows of a CTA: tile row r is token row0 + r of head h (r < rows).
struct SparseRows {
  i64 row0;
  int h, rows;
  __device__ __forceinline__ i64 token_row(int r) const { return row0 + r; }
  __device__ __forceinline__ int head(int) const { return h; }
};

// Per-CTA state the main loop reads from shared memory rather than holding in registers.
template <typename T, int BN>
struct SparseLoop {
  const T* kb;          // the kv head's K / V (dense rows: from the sequence's first key)
  const T* vb;
  const int* table;     // the sequence's block table; nullptr: dense rows
  const int* cols;      // the head's vertical row (gathered tiles)
  const int2* tiles;    // this CTA's tile list
  int page_size, page_shift;   // page_shift >= 0: power-of-two pages
  u32 page_stride, tok_stride;
  int2 desc[3];         // descriptor of tile i in slot i % 3
  __align__(8) int keys[2][BN];  // key of each K/V row of a stage (EMPTY_KEY: none)

  __device__ __forceinline__ void init(const SparseProblem<T>& P, int b, int h, i64 t0) {
    const i64 base = (i64)(h / P.group) * P.head_stride +
                     (P.block_tables == nullptr ? (i64)P.cu_k[b] * P.tok_stride : 0);
    kb = P.k + base;
    vb = P.v + base;
    table = P.block_tables == nullptr ? nullptr : P.block_tables + (i64)b * P.table_stride;
    cols = P.cols == nullptr ? nullptr : P.cols + ((i64)b * P.cols_heads + h) * P.cols_width;
    tiles = P.tiles + t0;
    page_size = P.page_size;
    page_shift = (page_size & (page_size - 1)) == 0 ? __ffs(page_size) - 1 : -1;
    page_stride = (u32)P.page_stride;
    tok_stride = (u32)P.tok_stride;
  }
};

// K and V rows of the tile described by d -> one stage (sK, sV), their keys -> keys[]. Thread
// tid copies 16-byte chunk tid % CL of rows tid / CL + ROW_STEP * i; rows past the tile's
// width are zero-filled with key EMPTY_KEY. Keys (and pages) are looked up before any copy so
// that a thread's loads issue together.
template <typename T, typename C, bool PAGED>
__device__ __forceinline__ void load_rows(const SparseLoop<T, C::BLOCK_N>& st, int2 d, int* keys, u32 sK, u32 sV) {
  constexpr int NR = C::BLOCK_N / C::ROW_STEP;
  const int c = threadIdx.x % C::CL, r0 = threadIdx.x / C::CL;
  const int w = d.y & TILE_WIDTH;
  const bool gather = (d.y & TILE_GATHER) != 0;
  int key[NR], page[NR];
#pragma unroll
  for (int i = 0; i < NR; ++i) {
    const int r = r0 + i * C::ROW_STEP;
    key[i] = r >= w ? EMPTY_KEY : gather ? __ldg(st.cols + d.x + r) : d.x + r;
  }
#pragma unroll
  for (int i = 0; i < NR; ++i) {
    const int j = key[i] == EMPTY_KEY ? 0 : key[i];
    if constexpr (PAGED) page[i] = __ldg(st.table + (st.page_shift >= 0 ? j >> st.page_shift : j / st.page_size));
  }
#pragma unroll
  for (int i = 0; i < NR; ++i) {
    const int r = r0 + i * C::ROW_STEP;
    if (c == 0) keys[r] = key[i];
    const bool ok = key[i] != EMPTY_KEY;
    const u32 j = ok ? key[i] : 0;
    unsigned long long off = wide(j, st.tok_stride);
    if constexpr (PAGED) {
      const u32 in_page = st.page_shift >= 0 ? j & (st.page_size - 1) : j % (u32)st.page_size;
      off = wide(page[i], st.page_stride) + wide(in_page, st.tok_stride);
    }
    const u32 at = (r * C::LD + c * 8) * C::E;
    cp_async16(sK + at, st.kb + off + c * 8, ok ? 16 : 0);
    cp_async16(sV + at, st.vb + off + c * 8, ok ? 16 : 0);
  }
}

// All of tile i (descriptor in its ring slot) into stage `stage`.
template <typename T, typename C>
__device__ __forceinline__ void issue_tile(SparseLoop<T, C::BLOCK_N>& st, int i, int stage, u32 sK0, u32 sV0) {
  if (C::CL != C::CHUNKS && threadIdx.x % C::CL >= C::CHUNKS) return;
  const int2 d = st.desc[i % 3];
  const u32 sK = sK0 + stage * C::K_BYTES, sV = sV0 + stage * C::V_BYTES;
  if (st.table == nullptr) load_rows<T, C, false>(st, d, st.keys[stage], sK, sV);
  else load_rows<T, C, true>(st, d, st.keys[stage], sK, sV);
}

// Scores of one m-tile whose keys (keys[column]) pass a row's last visible key (lim0: row g,
// lim1: row g + 8) -> -inf; the others times pre (1 unless the scale is not positive).
template <int NT_S>
__device__ __forceinline__ void mask_keys(float (&s)[NT_S][4], const int* keys, int lim0, int lim1, float pre,
                                          int lane) {
#pragma unroll
  for (int nt = 0; nt < NT_S; ++nt) {
    const int2 kk = *reinterpret_cast<const int2*>(keys + nt * 8 + 2 * (lane % 4));
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = (e & 1) ? kk.y : kk.x;
      s[nt][e] = key > (e < 2 ? lim0 : lim1) ? neg_inf() : s[nt][e] * pre;
    }
  }
}

// One K/V tile for the warp's m-tiles: S = Q K^T, then (masked) keys past a row's last visible
// key -> -inf and scores times pre, online softmax (sc: scale in the exponential), O += P V.
// lim: last visible key of the warp's first row (rows below see one more key each when
// causal, else all see lim).
template <typename T, int D, typename C>
__device__ __forceinline__ void attend_tile(float (&o)[C::MT][D / 8][4], float (&m)[C::MT][2], float (&l)[C::MT][2],
                                            u32 sQw, u32 sK, u32 sV, const int* keys, bool masked, int lim,
                                            bool causal, float pre, float sc, int lane) {
  constexpr int NT_S = C::BLOCK_N / 8;
  u32 qf[1][1][4];  // Q fragments are re-read from sQ (C::Q_REGS is false)
  float s[C::MT][NT_S][4];
  u32 pf[C::MT][C::BLOCK_N / 16][4];
  // -- compute qk --
  compute_qk<T, D, C>(s, qf, sQw, sK, lane);
  // -- mask, online softmax, p -> A fragments --
#pragma unroll
  for (int mt = 0; mt < C::MT; ++mt) {
    const int lim0 = causal ? lim + 16 * mt + lane / 4 : lim;
    if (masked) mask_keys<NT_S>(s[mt], keys, lim0, causal ? lim0 + 8 : lim0, pre, lane);
    online_softmax<NT_S, D / 8>(s[mt], o[mt], m[mt], l[mt], sc);
    pack_p<T, C::BLOCK_N / 16>(pf[mt], s[mt]);
  }
  // -- compute pv --
  compute_pv<T, D, C, false>(o, pf, sV, lane);
}

// Body of sparse_attention (see the header and the kernel's comment).
template <typename T, int D, typename S>
__device__ __forceinline__ void sparse_mma(const SparseProblem<T>& P) {
  using C = MmaConfig<T, D, S, false>;
  static_assert(C::BLOCK_M == 2 * HALF_ROWS && C::STAGES == 2 && !C::Q_REGS, "two halves, two stages");
  constexpr int MT = C::MT, BN = C::BLOCK_N;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ SparseLoop<T, BN> st;
  const u32 sQ = smem_addr(smem_raw), sK0 = sQ + C::Q_BYTES, sV0 = sK0 + 2 * C::K_BYTES;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, first = warp * MT * 16;
  const u32 sQw = sQ + first * C::LD * C::E;

  const int hh = blockIdx.x, c = P.num_c - 1 - blockIdx.y, b = blockIdx.z, h = P.head0 + hh;
  const int q0 = P.cu_q[b], q_len = P.cu_q[b + 1] - q0, m0 = c * C::BLOCK_M;
  if (m0 >= q_len) return;
  const SparseRows rows{(i64)q0 + m0, h, min(C::BLOCK_M, q_len - m0)};
  const i64 prow = ((i64)b * P.plan_heads + (P.plan_heads > 1 ? hh : 0)) * P.num_c + c;
  const i64 t0 = P.plan_ptr[prow];
  const int n_tiles = (int)(P.plan_ptr[prow + 1] - t0);
  if (threadIdx.x == 0) st.init(P, b, h, t0);

  // -- prologue: Q and the descriptors of the last two tiles; then all of the last tile --
  load_q_tile<T, D, C>(P.q, (i64)P.num_q_heads * D, rows, sQ);
  if ((int)threadIdx.x < min(2, n_tiles)) {
    const int i = n_tiles - 1 - threadIdx.x;
    cp_async8(&st.desc[i % 3], P.tiles + t0 + i);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  if (n_tiles > 0) issue_tile<T, C>(st, n_tiles - 1, 0, sK0, sV0);
  cp_async_commit();

  // the warp's rows: last visible key of its first and of its last valid row
  const int pos0 = P.kv_lens[b] - q_len + m0 + first;
  const int my_rows = min(16 * MT, rows.rows - first);
  const int lim_lo = P.causal ? pos0 : EMPTY_KEY - 1;
  const int lim_hi = P.causal ? pos0 + my_rows - 1 : EMPTY_KEY - 1;
  const int half_bit = 1 << (first / HALF_ROWS);
  // plain path: raw dots, the scale folded into the exponential; else scores scaled first
  const bool plain = P.scale_log2 > 0.f;
  const float sc = plain ? P.scale_log2 : 1.f;

  float o[MT][D / 8][4], m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.f;
    m[mt][0] = m[mt][1] = neg_inf();
    l[mt][0] = l[mt][1] = 0.f;
  }

  for (int n = n_tiles - 1, stage = 0; n >= 0; --n, stage ^= 1) {
    cp_async_wait<0>();
    __syncthreads();  // tile n and the descriptor of n - 1 visible; every warp is done with n + 1
    if (n > 0) issue_tile<T, C>(st, n - 1, stage ^ 1, sK0, sV0);
    if (n > 1 && threadIdx.x == 0) cp_async8(&st.desc[(n - 2) % 3], st.tiles + (n - 2));
    cp_async_commit();

    const int2 d = st.desc[n % 3];
    const int* keys = st.keys[stage];
    const int w = d.y & TILE_WIDTH;
    const bool gather = (d.y & TILE_GATHER) != 0;
    const int k_first = gather ? keys[0] : d.x, k_last = gather ? keys[w - 1] : d.x + w - 1;
    if (((d.y >> 8) & half_bit) && my_rows > 0 && k_first <= lim_hi) {
      const bool mask = w < BN || k_last > lim_lo;  // some row does not see every key
      attend_tile<T, D, C>(o, m, l, sQw, sK0 + stage * C::K_BYTES, sV0 + stage * C::V_BYTES, keys,
                           mask || !plain, P.causal ? lim_lo : EMPTY_KEY - 1, P.causal != 0,
                           plain ? 1.f : P.scale_log2, sc, lane);
    }
  }

  // -- epilogue: rows staged in the warp's own sQ rows --
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const float m_log2[2] = {m[mt][0] * sc, m[mt][1] * sc};
    store_rows<T, D, C>(P.out, P.lse, P.sinks, P.num_q_heads, rows, first + 16 * mt, o[mt], m_log2, l[mt],
                        reinterpret_cast<T*>(smem_raw), lane);
  }
}

#define CUPAGED_SPARSE_PARAMS(T)                                                                  \
  const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ out, \
      float* __restrict__ lse, const int* __restrict__ cu_q, const int* __restrict__ kv_lens,    \
      const int* __restrict__ cu_k, const int* __restrict__ block_tables, int table_stride,       \
      int page_size, i64 page_stride, i64 tok_stride, i64 head_stride, int num_q_heads, int group, \
      int head0, int plan_heads, int num_c, const i64* __restrict__ plan_ptr,                    \
      const int2* __restrict__ tiles, const int* __restrict__ cols, int cols_heads, int cols_width, \
      int causal, float scale_log2, const float* __restrict__ sinks

// grid (heads in this call, ceil(max q_len / 128), batch), block 32 * S::WARPS; dynamic smem:
// Q [128][D + 8], then two K and two V stages [BLOCK_N][D + 8]; static smem: SparseLoop.
// CTA (x, y, b) computes query rows [128 c, 128 c + 128) of sequence b, head head0 + x,
// with c = gridDim.y - 1 - y (longest rows first; the query heads of a kv head are neighbours
// in x, so they share K/V tiles in L2). Its tile list is tiles[plan_ptr[r] .. plan_ptr[r + 1])
// of plan row r = (b * plan_heads + (plan_heads > 1 ? x : 0)) * num_c + c. Each warp holds
// S::MT m-tiles of scores, running max/sum and O accumulators in registers (attn_tile.cuh).
template <typename T, int D, typename S>
__global__ void __launch_bounds__(32 * S::WARPS, S::CTAS) sparse_attention(CUPAGED_SPARSE_PARAMS(T)) {
  const SparseProblem<T> P{q, k, v, out, lse, cu_q, kv_lens, cu_k, block_tables, table_stride,
                           page_size, page_stride, tok_stride, head_stride, num_q_heads, group,
                           head0, plan_heads, num_c, plan_ptr, tiles, cols, cols_heads, cols_width,
                           causal, scale_log2, sinks};
  sparse_mma<T, D, S>(P);
}

#undef CUPAGED_SPARSE_PARAMS

}  // namespace cupaged
