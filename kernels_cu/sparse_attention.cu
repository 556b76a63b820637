// Block-sparse attention on tensor cores: vertical+slash (MInference) and batched BSR
// patterns over dense packed or paged K/V, GQA, sinks, window_left, ALiBi, soft-cap
// (score.cuh's epilogue), fp16/bf16.
//
// A CTA computes 128 query rows of one head, the 64-row tiles 2c (half a) and 2c + 1 (half
// b) of a sequence (bsr_attention also runs 64-row CTAs of one half, 4 warps x 16 rows), with the tile core of the dense kernel (attn_tile.cuh: 4 warps x 32 rows,
// 64-key K/V tiles, two stages, one barrier per tile; 8 warps x 16 rows and 32-key tiles at
// D = 256); the warps of a half own its 64 rows. The CTA walks a stream of K/V tiles from its
// tile source - contiguous keys of the halves' key blocks, or vertical columns gathered from
// the head's vertical row - each loaded once and computed by the warps of the halves whose
// pattern holds it. Two sources share the loop: the tile lists of sparse_index.cu
// (vertical+slash, ListSource) and a batched BSR pattern walked in place from its `indices`
// (BsrSource, BsrStream of sparse_plan.cuh), both in sparse_source.cuh (shared with the
// sm_90 kernels of sparse_sm90.cu). Only tiles that cross a warp's diagonal (or are not full)
// are masked; a tile past every row of a warp is skipped. (mma.sync, on every GPU; sm_90's
// wgmma form: sparse_sm90.cu.)
#include "attn_tile.cuh"
#include "score.cuh"
#include "sparse_source.cuh"

namespace cupaged {

// Arguments: SparseArgs<T> (abi.cuh, packed by cupaged/sparse/launch.py).

// Query rows of a CTA: tile row r is token row0 + r of head h (r < rows).
struct SparseRows {
  i64 row0;
  int h, rows;
  __device__ __forceinline__ i64 token_row(int r) const { return row0 + r; }
  __device__ __forceinline__ int head(int) const { return h; }
};

// What the CTA's scores need besides the dots (in shared memory, SparseLoop::rs): the
// position of its first row (tile row r at pos + r), causal and window_left (docs/design.md's
// visibility), and the score epilogue of score.cuh (the general kernel's; the plain one
// keeps raw dots and folds scale_log2 into the exponential).
struct RowScores {
  ScoreEpilogue epi;
  float slope;      // ALiBi slope of the CTA's head in log2 units (0: none)
  int pos, window;  // window < 0: none
  bool causal;

  template <typename T>
  __device__ __forceinline__ void init(const SparseArgs<T>& P, int h, int pos0) {
    epi.init(P.sm_scale, P.soft_cap);
    slope = P.alibi != nullptr ? __ldg(P.alibi + h) * LOG2E : 0.f;
    pos = pos0;
    window = P.window_left;
    causal = P.causal != 0;
  }
};

// Per-CTA state the main loop reads from shared memory rather than holding in registers:
// where the keys' rows are (SparseKeys, sparse_source.cuh) and the walk's state.
template <typename T, int BN>
struct SparseLoop : SparseKeys<T> {
  RowScores rs;         // scores of the CTA's rows
  int2 desc[3];         // descriptor of the walk's tile i in slot i % 3 (width 0: the end)
  __align__(8) int keys[2][BN];  // key of each K/V row of a stage (EMPTY_KEY: none)
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


// Scores of one m-tile whose first row (lane / 4 of it) sits at p0: keys a row does not see
// (past p when causal, EMPTY_KEY rows; GENERAL: also before p - window_left) -> -inf; the
// others, when GENERAL, through the score epilogue (log2 units, + slope * (j - p)).
template <int NT_S, bool GENERAL>
__device__ __forceinline__ void mask_keys(float (&s)[NT_S][4], const int* keys, int p0, const RowScores& rs,
                                          int lane) {
  // row p0 sees keys [lo, hi], row p0 + 8 keys [lo + lo_step, hi + hi_step]
  const int hi = rs.causal ? p0 : EMPTY_KEY - 1, hi_step = rs.causal ? 8 : 0;
  const int lo = GENERAL && rs.window >= 0 ? p0 - rs.window : -EMPTY_KEY;
  const int lo_step = GENERAL && rs.window >= 0 ? 8 : 0;
#pragma unroll
  for (int nt = 0; nt < NT_S; ++nt) {
    const int2 kk = *reinterpret_cast<const int2*>(keys + nt * 8 + 2 * (lane % 4));
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = (e & 1) ? kk.y : kk.x;
      if constexpr (GENERAL) {
        const bool out = e < 2 ? key > hi || key < lo : key > hi + hi_step || key < lo + lo_step;
        const float x = rs.epi(s[nt][e]) + rs.slope * (float)(key - p0 - (e < 2 ? 0 : 8));
        s[nt][e] = out ? neg_inf() : x;
      } else {
        s[nt][e] = key > (e < 2 ? hi : hi + hi_step) ? neg_inf() : s[nt][e];
      }
    }
  }
}

// One K/V tile for the warp's m-tiles: S = Q K^T, then (masked: some row does not see every
// key, or GENERAL) mask_keys, online softmax (sc: scale in the exponential), O += P V.
template <typename T, int D, typename C, bool GENERAL>
__device__ __forceinline__ void attend_tile(float (&o)[C::MT][D / 8][4], float (&m)[C::MT][2], float (&l)[C::MT][2],
                                            u32 sQw, u32 sK, u32 sV, const int* keys, bool masked,
                                            const RowScores& rs, int first, float sc, int lane) {
  constexpr int NT_S = C::BLOCK_N / 8;
  u32 qf[1][1][4];  // Q fragments are re-read from sQ (C::Q_REGS is false)
  float s[C::MT][NT_S][4];
  u32 pf[C::MT][C::BLOCK_N / 16][4];
  // -- compute qk --
  compute_qk<T, D, C>(s, qf, sQw, sK, lane);
  // -- mask, online softmax, p -> A fragments --
#pragma unroll
  for (int mt = 0; mt < C::MT; ++mt) {
    if (masked) mask_keys<NT_S, GENERAL>(s[mt], keys, rs.pos + first + 16 * mt + lane / 4, rs, lane);
    online_softmax<NT_S, D / 8>(s[mt], o[mt], m[mt], l[mt], sc);
    pack_p<T, C::BLOCK_N / 16>(pf[mt], s[mt]);
  }
  // -- compute pv --
  compute_pv<T, D, C, false>(o, pf, sV, lane);
}

// Body of sparse_attention and bsr_attention (see the header and the kernels' comments).
// GENERAL: window_left and scores through the score epilogue (the launch picks the kernel:
// cupaged.sparse.launch.general_scores), else causal masking alone and raw dots with the
// scale in the exponential (the plain kernel's registers stay those of the causal loop).
template <typename T, int D, typename S, typename Src, bool GENERAL>
__device__ __forceinline__ void sparse_mma(const SparseArgs<T>& P) {
  using C = MmaConfig<T, D, S, false>;
  constexpr int HALVES = C::BLOCK_M / HALF_ROWS;
  static_assert(C::BLOCK_M % HALF_ROWS == 0 && (HALVES == 1 || HALVES == 2) && C::STAGES == 2 &&
                !C::Q_REGS, "one or two halves, two stages");
  constexpr int MT = C::MT, BN = C::BLOCK_N;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ SparseLoop<T, BN> st;
  __shared__ Src src;
  const u32 sQ = smem_addr(smem_raw), sK0 = sQ + C::Q_BYTES, sV0 = sK0 + 2 * C::K_BYTES;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, first = warp * MT * 16;
  const u32 sQw = sQ + first * C::LD * C::E;

  const int hh = blockIdx.x, h = P.head0 + hh;
  CtaSeq cs;
  if (!Src::locate(P, cs)) return;
  const int q_len = cs.q_len, m0 = cs.c * C::BLOCK_M;
  if (m0 >= q_len) return;
  const SparseRows rows{(i64)cs.q0 + m0, h, min(C::BLOCK_M, q_len - m0)};
  if (threadIdx.x == 0) {
    st.init(P, cs.b, h);
    st.rs.init(P, h, cs.kv_len - q_len + m0);
  }
  src.template init<HALVES>(P, cs, hh, BN);

  // -- prologue: Q and the descriptors of the first two tiles; then all of the first tile --
  load_q_tile<T, D, C>(P.q, P.q_tok, rows, sQ);
  if (threadIdx.x == 0) {
    src.issue(&st.desc[0]);
    src.issue(&st.desc[1]);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  if (st.desc[0].y & TILE_WIDTH) issue_tile<T, C>(st, 0, 0, sK0, sV0);
  cp_async_commit();

  // the warp's rows: last visible key of its first and of its last valid row (their first
  // visible keys under a window: pos0 - window_left, lim_hi - window_left)
  const int pos0 = cs.kv_len - q_len + m0 + first;
  const int my_rows = min(16 * MT, rows.rows - first);
  const int lim_lo = P.causal ? pos0 : EMPTY_KEY - 1;
  const int lim_hi = P.causal ? pos0 + my_rows - 1 : EMPTY_KEY - 1;
  const int half_bit = 1 << (first / HALF_ROWS);
  // plain path: raw dots, the scale folded into the exponential; else log2-unit scores first
  const float sc = GENERAL ? 1.f : P.scale_log2;

  float o[MT][D / 8][4], m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.f;
    m[mt][0] = m[mt][1] = neg_inf();
    l[mt][0] = l[mt][1] = 0.f;
  }

  for (int n = 0, stage = 0;; ++n, stage ^= 1) {
    cp_async_wait<0>();
    __syncthreads();  // tile n and the descriptor of n + 1 visible; every warp is done with n - 1
    const int2 d = st.desc[n % 3];
    if ((d.y & TILE_WIDTH) == 0) break;  // CTA-uniform
    if (st.desc[(n + 1) % 3].y & TILE_WIDTH) issue_tile<T, C>(st, n + 1, stage ^ 1, sK0, sV0);
    if (threadIdx.x == 0) src.issue(&st.desc[(n + 2) % 3]);  // the slot of tile n - 1
    cp_async_commit();

    const int* keys = st.keys[stage];
    const int w = d.y & TILE_WIDTH;
    const bool gather = (d.y & TILE_GATHER) != 0;
    const int k_first = gather ? keys[0] : d.x, k_last = gather ? keys[w - 1] : d.x + w - 1;
    // a row sees some key of the tile / some row does not see every key (GENERAL: window)
    bool sees = ((d.y >> 8) & half_bit) && my_rows > 0 && k_first <= lim_hi;
    bool mask = w < BN || k_last > lim_lo;
    if constexpr (GENERAL) {
      const int wl = st.rs.window;
      sees = sees && (wl < 0 || k_last >= pos0 - wl);
      mask = mask || (wl >= 0 && k_first < pos0 + my_rows - 1 - wl);
    }
    if (sees) {
      attend_tile<T, D, C, GENERAL>(o, m, l, sQw, sK0 + stage * C::K_BYTES, sV0 + stage * C::V_BYTES, keys,
                           mask || GENERAL, st.rs, first, sc, lane);
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

// grid (heads in this call, cta_bound), block 32 * S::WARPS; dynamic smem: Q [128][D + 8],
// then two K and two V stages [BLOCK_N][D + 8]; static smem: SparseLoop and the source. CTA
// (x, y) computes the 128 query rows of its CTA map entry, head head0 + x, over its tile list
// (ListSource; the query heads of a kv head are neighbours in x, so they share K/V tiles in
// L2). Each warp holds S::MT m-tiles
// of scores, running max/sum and O accumulators in registers (attn_tile.cuh).
template <typename T, int D, typename S, bool GENERAL>
__global__ void __launch_bounds__(32 * S::WARPS, S::CTAS) sparse_attention(CUPAGED_PARAMS_SparseArgs) {
  const SparseArgs<T> P{CUPAGED_FIELDS_SparseArgs};
  sparse_mma<T, D, S, ListSource, GENERAL>(P);
}

// grid (num_q_heads, cta_bound), block 32 * S::WARPS, shared memory as sparse_attention (Q
// [BLOCK_M][D + 8]): the same loop over a batched BSR pattern (BsrSource), CTAs of BLOCK_M =
// 128 or 64 query rows placed by bsr_prepare's map (64: for block rows of 64 or an odd
// multiple of it, whose neighbours keep other blocks).
template <typename T, int D, typename S, bool GENERAL>
__global__ void __launch_bounds__(32 * S::WARPS, S::CTAS) bsr_attention(CUPAGED_PARAMS_SparseArgs) {
  const SparseArgs<T> P{CUPAGED_FIELDS_SparseArgs};
  sparse_mma<T, D, S, BsrSource, GENERAL>(P);
}

}  // namespace cupaged
