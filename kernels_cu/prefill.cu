// Prefill attention over ragged or paged keys/values (FlashAttention-2 style).
//
// One CTA computes one work item (sequence b, kv head hk, first packed row row0) of a list
// built longest-first (plan.cu's prefill_plan_kernel, or the host in strict mode). Rows are
// packed over the GQA group: packed row r of a sequence is query i = r / group of head
// hk * group + r % group, so the heads sharing a kv head share every K/V tile (decode rows
// of a mixed batch fill a tile with their group).
// Query i of a sequence with q_len queries and kv_len keys sits at p = kv_len - q_len + i
// (bottom-right alignment) and sees keys j in [lo, hi): lo = max(0, p - window_left) when
// window_left >= 0, else 0; hi = min(kv_len, p + 1) when causal, else kv_len.
//
// Scores are kept in log2 units: x = log2(e) * softcap(sm_scale * q.k) + log2(e) * slope * (j - p).
// Element (key j, dim d) of K sits at blk * k_block + hk * k_head + (d / X) * k_chunk + d % X
// + off * k_tok and of V at blk * v_block + hk * v_head + d * v_dim + off * v_tok, where
// X = 16 / sizeof(T) and (blk, off) = (table[j / block_size], j % block_size) for a paged
// cache or (0, kv_start + j) for ragged rows: one set of strides covers ragged rows and the
// NHD, HND and vllm cache layouts. All offsets are 64-bit. The tensor-core loaders look a
// key up once per K/V tile row (shift for power-of-two block sizes) and give each thread a
// fixed 16-byte chunk of the row, so a chunk costs one add.
//
// fp16/bf16 run on tensor cores (mma.sync m16n8k16, fp32 accumulation); fp32 inputs run a
// simple CUDA-core path (one warp per query row), correct but not tuned.
//
// K/V hold elements of type KV: T, or an fp8 format (fp8.cuh) under 16-bit q. fp8 tiles
// are copied with cp.async as 16-byte chunks of 16 codes into per-thread staging slots
// (half the bytes of a 16-bit tile), and each thread widens its own chunks into the 16-bit
// K/V tile once they land (Fp8Stage), so the tensor-core loop reads the tiles a 16-bit
// cache gives. The kv head's k_scale multiplies the score scale and its v_scale the output,
// for 16-bit K/V too (1 unless given: a packed copy of an fp8 cache's codes).
#include "attn_common.cuh"
#include "attn_tile.cuh"
#include "score.cuh"

namespace cupaged {

// A work item (attn_common.cuh) with the shift of a power-of-two block size (-1: any other).
struct Tile : WorkItem {
  int bs_shift;

  template <typename Prob>
  __device__ __forceinline__ void init(const Prob& P, int4 item, int block_m) {
    WorkItem::init(P, item, block_m);
    const int bs = P.block_size;
    bs_shift = (bs & (bs - 1)) == 0 ? __ffs(bs) - 1 : -1;
  }
  // (blk, off) of key j
  template <typename Prob>
  __device__ __forceinline__ void locate(const Prob& P, int j, i64& blk, i64& off) const {
    if (table == nullptr) {
      blk = 0;
      off = kv_start + j;
    } else {
      const int bi = bs_shift >= 0 ? (j >> bs_shift) : j / P.block_size;
      blk = __ldg(table + bi);
      off = j - bi * P.block_size;
    }
  }
  // element offsets of key j's first K chunk and first V element (dim 0) from the head base
  template <typename Prob>
  __device__ __forceinline__ void kv_offsets(const Prob& P, int j, i64& k_off, i64& v_off) const {
    i64 blk, off;
    locate(P, j, blk, off);
    k_off = blk * P.k_block + off * P.k_tok;
    v_off = blk * P.v_block + off * P.v_tok;
  }
  template <typename T>
  __device__ __forceinline__ const T* key_ptr(const Problem<T, T>& P, int j, int d) const {
    constexpr int X = Vec16<T>::N;
    i64 k_off, v_off;
    kv_offsets(P, j, k_off, v_off);
    return P.k + k_off + hk * P.k_head + (d / X) * P.k_chunk + d % X;
  }
  template <typename T>
  __device__ __forceinline__ const T* value_ptr(const Problem<T, T>& P, int j, int d) const {
    i64 k_off, v_off;
    kv_offsets(P, j, k_off, v_off);
    return P.v + v_off + hk * P.v_head + d * P.v_dim;
  }
};

// ----------------------------------------------------------------------------- tensor cores
// TileShape, MmaConfig, compute_qk / compute_pv, online_softmax, pack_p, load_q_tile,
// store_rows: attn_tile.cuh.

// Where a CTA's K/V tiles come from: the kv head's bases (ragged rows: the sequence's first
// key folded in), the block table (null: ragged) and the key count. The main loop keeps it
// in shared memory (read once per tile) rather than in registers.
template <typename KV>
struct KVSource {
  const KV* kb;
  const KV* vb;
  const int* table;
  int kv_len, bs_shift;

  template <typename Prob>
  __device__ __forceinline__ void init(const Prob& P, const Tile& t) {
    kb = P.k + t.hk * P.k_head + t.kv_start * P.k_tok;
    vb = P.v + t.hk * P.v_head + t.kv_start * P.v_tok;
    table = t.table;
    kv_len = t.kv_len;
    bs_shift = t.bs_shift;
  }
  // element offsets of key j's K and V rows from kb / vb; 0 <= j < kv_len. MODE: 0 ragged,
  // 1 paged with a power-of-two block size, 2 any paged (-1: decided here). Block and token
  // strides fit in 32 bits (the host checks), so each product is one 32 x 32 -> 64-bit multiply.
  template <int MODE = -1, typename Prob>
  __device__ __forceinline__ void offsets(const Prob& P, int j, i64& k_off, i64& v_off) const {
    int blk = 0, off = j;
    if (MODE == 1 || (MODE == -1 && table != nullptr && bs_shift >= 0)) {
      blk = __ldg(table + (j >> bs_shift));
      off = j & (P.block_size - 1);
    } else if (MODE == 2 || (MODE == -1 && table != nullptr)) {
      const int bi = j / P.block_size;
      blk = __ldg(table + bi);
      off = j - bi * P.block_size;
    }
    k_off = (i64)(wide(blk, (u32)P.k_block) + wide(off, (u32)P.k_tok));
    v_off = (i64)(wide(blk, (u32)P.v_block) + wide(off, (u32)P.v_tok));
  }
};

// Rows [j0, j0 + BLOCK_N) of K (LOAD_K) and V (LOAD_V) with cp.async (KVChunks): to sK / sV,
// or the staging slots at sS (fp8). One key lookup per row serves both; rows past kv_len are
// zero-filled (their lookup clamped to the last key). The lookup kind is fixed per loop so
// that a thread's block-table reads issue together.
template <typename KV, typename C, bool LOAD_K, bool LOAD_V, int MODE, typename Prob>
__device__ __forceinline__ void load_rows(const Prob& P, const KVSource<KV>& src, int j0, u32 sK, u32 sV,
                                          u32 sS) {
  using F = KVChunks<KV, C::CHUNKS * 8, C::BLOCK_N, C::THREADS>;
  const int c = threadIdx.x % F::CL, r0 = threadIdx.x / F::CL;
  const u32 so = (r0 * C::LD + c * 8) * C::E;
  const KV* kb = src.kb + c * (int)P.k_chunk;
  const KV* vb = src.vb + c * F::PER;
#pragma unroll
  for (int i = 0; i < F::RPT; ++i) {
    const int j = j0 + r0 + i * F::ROW_STEP;
    const int bytes = j < src.kv_len ? 16 : 0;
    i64 k_off, v_off;
    src.template offsets<MODE>(P, min(j, src.kv_len - 1), k_off, v_off);
    const u32 at = so + i * F::ROW_STEP * C::LD * C::E;
    if (LOAD_K) cp_async16(F::FP8 ? F::slot(sS, i) : sK + at, kb + k_off, bytes);
    if (LOAD_V) cp_async16(F::FP8 ? F::slot(sS, F::RPT + i) : sV + at, vb + v_off, bytes);
  }
}

template <typename KV, typename C, bool LOAD_K, bool LOAD_V, typename Prob>
__device__ __forceinline__ void load_kv_rows(const Prob& P, const KVSource<KV> src, int j0, u32 sK, u32 sV,
                                             u32 sS) {
  using F = KVChunks<KV, C::CHUNKS * 8, C::BLOCK_N, C::THREADS>;
  if (F::CL != F::CH && threadIdx.x % F::CL >= F::CH) return;
  if (src.table == nullptr) load_rows<KV, C, LOAD_K, LOAD_V, 0>(P, src, j0, sK, sV, sS);
  else if (src.bs_shift >= 0) load_rows<KV, C, LOAD_K, LOAD_V, 1>(P, src, j0, sK, sV, sS);
  else load_rows<KV, C, LOAD_K, LOAD_V, 2>(P, src, j0, sK, sV, sS);
}

// V tile of keys [j0, j0 + BLOCK_N) from the vllm value layout (keys contiguous per dim) ->
// sV [D][LDT] (KVChunks' V^T chunks: one 16-byte cp.async each, to the tile or an fp8
// staging slot, when PER keys never straddle a cache block; else element by element,
// widened to the tile as they are read, with the chunk's first key clamped so that its
// in-block offset stays a multiple of PER).
template <typename T, typename KV, typename C, typename Prob>
__device__ __forceinline__ void load_v_transposed(const Prob& P, const KVSource<KV> src, int j0, u32 sV, u32 sS) {
  using F = KVChunks<KV, C::CHUNKS * 8, C::BLOCK_N, C::THREADS>;
  constexpr int D = F::D;
  const int kc = threadIdx.x % F::KC, d0 = threadIdx.x / F::KC, j = j0 + F::PER * kc;
  const int valid = max(0, min(F::PER, src.kv_len - j));
  const u32 so = (d0 * C::LDT + F::PER * kc) * C::E;
  const KV* vb = src.vb + d0 * P.v_dim;
  i64 k_off, v_off;
  if (P.block_size % F::PER == 0) {
    src.offsets(P, min(j, (src.kv_len - 1) & ~(F::PER - 1)), k_off, v_off);
#pragma unroll
    for (int i = 0; i < F::VT_PASSES; ++i)
      if (D % F::VT_STEP == 0 || d0 + i * F::VT_STEP < D)
        cp_async16(F::FP8 ? F::slot(sS, F::RPT + i) : sV + so + i * F::VT_STEP * C::LDT * C::E,
                   vb + v_off + i * F::VT_STEP * P.v_dim, valid * (int)sizeof(KV));
  } else {
    for (int e = 0; e < F::PER; ++e) {
      if (e < valid) src.offsets(P, j + e, k_off, v_off);
      for (int i = 0; d0 + i * F::VT_STEP < D; ++i)
        st_shared16(sV + so + (i * F::VT_STEP * C::LDT + e) * C::E,
                    e < valid ? tile_bits<T, KV>(vb[v_off + i * F::VT_STEP * P.v_dim]) : (unsigned short)0);
    }
  }
}

// fp8: the thread's staged chunks of a K/V tile (its copies landed) widened into sK and sV
// (the stage the tile is computed from; V^T chunks only where they were staged).
template <typename T, typename KV, typename C, bool V_T, typename Prob>
__device__ __forceinline__ void land_kv_tile(const Prob& P, u32 sK, u32 sV, u32 sS) {
  using F = KVChunks<KV, C::CHUNKS * 8, C::BLOCK_N, C::THREADS>;
  const int c = threadIdx.x % F::CL, r0 = threadIdx.x / F::CL;
  if (F::CL == F::CH || c < F::CH) {
#pragma unroll
    for (int i = 0; i < F::RPT; ++i) {
      const u32 at = ((r0 + i * F::ROW_STEP) * C::LD + F::PER * c) * C::E;
      widen_chunk_shared<T, KV>(F::slot(sS, i), sK + at, sK + at + 16, F::hi_first(c));
      if (!V_T) widen_chunk_shared<T, KV>(F::slot(sS, F::RPT + i), sV + at, sV + at + 16, F::hi_first(c));
    }
  }
  if (V_T && P.block_size % F::PER == 0) {
    const int kc = threadIdx.x % F::KC, d0 = threadIdx.x / F::KC;
#pragma unroll
    for (int i = 0; i < F::VT_PASSES; ++i) {
      const int d = d0 + i * F::VT_STEP;
      const u32 at = (d * C::LDT + F::PER * kc) * C::E;
      if (F::D % F::VT_STEP == 0 || d < F::D)
        widen_chunk_shared<T, KV>(F::slot(sS, F::RPT + i), sV + at, sV + at + 16, F::hi_first(kc));
    }
  }
}

// The work item of this CTA, read again (volatile: the compiler cannot keep the first read's
// values alive across the main loop instead), for the rare paths and the epilogue.
template <typename Prob>
__device__ __forceinline__ void reload_tile(const Prob& P, int block_m, Tile& t) {
  int4 item;
  asm volatile("ld.global.nc.v4.s32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(item.x), "=r"(item.y), "=r"(item.z), "=r"(item.w) : "l"(P.work + blockIdx.x));
  t.init(P, item, block_m);
}

// Scores of the m-tile at tile row `first` -> log2 units (the score epilogue, score.cuh, of
// the score scale sm: sm_scale times an fp8 cache's k_scale): the general path. The plain
// path (positive scale, no soft-cap, no ALiBi) keeps raw dots and scales inside the
// exponential.
template <int NT_S, typename Prob>
__device__ __forceinline__ void transform_scores(float (&s)[NT_S][4], const Prob& P, float sm, int block_m,
                                                 const int* pos_s, int first, int j0, int lane) {
  ScoreEpilogue epi;
  epi.init(sm, P.soft_cap);
  float slope[2] = {0.f, 0.f};
  int p[2] = {0, 0};
  if (P.alibi != nullptr) {
    Tile t;
    reload_tile(P, block_m, t);
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = min(first + lane / 4 + 8 * hr, t.rows - 1);  // rows past the tile: any valid row
      p[hr] = pos_s[r];
      slope[hr] = P.alibi[t.head(r)] * LOG2E;
    }
  }
#pragma unroll
  for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int hr = e / 2, j = j0 + nt * 8 + 2 * (lane % 4) + (e & 1);
      s[nt][e] = epi(s[nt][e]) + slope[hr] * (float)(j - p[hr]);  // no ALiBi: slope 0
    }
}

// Keys outside [lo, hi) of each row this thread owns in the m-tile at tile row `first`
// (positions from pos_s; NO_ROW: every key) -> -inf.
template <int NT_S, typename Prob>
__device__ __forceinline__ void mask_scores(float (&s)[NT_S][4], const Prob& P, int kv_len,
                                            const int* pos_s, int first, int j0, int lane) {
  int lo[2], hi[2], p[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    p[hr] = pos_s[first + lane / 4 + 8 * hr];
    lo[hr] = p[hr] == NO_ROW ? 0 : visible_lo(p[hr], P.window_left);
    hi[hr] = p[hr] == NO_ROW ? 0 : visible_hi(p[hr], kv_len, P.causal);
  }
#pragma unroll
  for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int hr = e / 2, j = j0 + nt * 8 + 2 * (lane % 4) + (e & 1);
      if (j < lo[hr] || j >= hi[hr]) s[nt][e] = neg_inf();
    }
}

// All of K/V tile j0 (K rows; V rows or transposed) into one stage (fp8: its staging at sS).
template <typename T, typename KV, typename C, bool V_T, typename Prob>
__device__ __forceinline__ void load_kv_tile(const Prob& P, const KVSource<KV>& src, int j0, u32 sK, u32 sV,
                                             u32 sS) {
  load_kv_rows<KV, C, true, !V_T>(P, src, j0, sK, sV, sS);
  if constexpr (V_T) load_v_transposed<T, KV, C>(P, src, j0, sV, sS);
}

// V of tile j0 alone (one-stage order; 16-bit caches).
template <typename T, typename C, bool V_T, typename Prob>
__device__ __forceinline__ void load_v_tile(const Prob& P, const KVSource<T>& src, int j0, u32 sK, u32 sV) {
  if constexpr (V_T) load_v_transposed<T, T, C>(P, src, j0, sV, 0u);
  else load_kv_rows<T, C, false, true>(P, src, j0, sK, sV, 0u);
}

// Per-CTA state the main loop reads from shared memory (after its first barrier) instead of
// holding it in registers: where K/V come from, each warp's key range, each row's position.
template <typename KV, int BLOCK_M, int WARPS>
struct LoopState {
  KVSource<KV> src;
  int4 keys[WARPS];   // RowKeys of each warp
  int pos[BLOCK_M];   // position of each tile row (NO_ROW past the rows)

  template <typename Prob>
  __device__ __forceinline__ void publish(const Prob& P, const Tile& t, int rows_per_warp) {
    const int warp = threadIdx.x / 32;
    if (threadIdx.x == 0) src.init(P, t);
    if (threadIdx.x % 32 == 0) {
      RowKeys w;
      w.init(t, warp * rows_per_warp, rows_per_warp, P.window_left, P.causal);
      keys[warp] = make_int4(w.j_lo, w.j_hi, w.hi_min, w.lo_max);
    }
    for (int r = threadIdx.x; r < BLOCK_M; r += 32 * WARPS) pos[r] = t.row_position(r);
  }
};

// Scores of the warp's m-tiles over K/V tile j0 -> probabilities as A fragments (pf), with
// the general transform (score scale sm) and the mask where needed; updates m, l and
// rescales o.
template <typename T, int D, typename C, typename St, typename Prob>
__device__ __forceinline__ void softmax_tile(float (&s)[C::MT][C::BLOCK_N / 8][4], u32 (&pf)[C::MT][C::BLOCK_N / 16][4],
                                             float (&o)[C::MT][D / 8][4], float (&m)[C::MT][2], float (&l)[C::MT][2],
                                             const Prob& P, const St& st, bool general, bool mask, float sm,
                                             float sc, int first, int j0, int lane) {
  constexpr int NT_S = C::BLOCK_N / 8;
#pragma unroll
  for (int mt = 0; mt < C::MT; ++mt) {
    if (general) transform_scores<NT_S>(s[mt], P, sm, C::BLOCK_M, st.pos, first + 16 * mt, j0, lane);
    if (mask) mask_scores<NT_S>(s[mt], P, st.src.kv_len, st.pos, first + 16 * mt, j0, lane);
    online_softmax<NT_S, D / 8>(s[mt], o[mt], m[mt], l[mt], sc);
    pack_p<T, C::BLOCK_N / 16>(pf[mt], s[mt]);
  }
}

// Body of the tensor-core kernel (see prefill_mma_kernel).
template <typename T, typename KV, int D, bool V_T, typename S>
__device__ __forceinline__ void prefill_mma(const Problem<T, KV>& P) {
  using C = MmaConfig<T, D, S, V_T>;
  using F = KVChunks<KV, C::CHUNKS * 8, C::BLOCK_N, C::THREADS>;
  constexpr int MT = C::MT, BN = C::BLOCK_N, NT_O = D / 8, KS_Q = D / 16;
  static_assert(!F::FP8 || C::STAGES == 2, "fp8 caches stream tiles into two stages");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ LoopState<KV, C::BLOCK_M, C::WARPS> st;
  const u32 sQ = smem_addr(smem_raw);
  const u32 sK0 = sQ + C::Q_BYTES;
  const u32 sV0 = sK0 + C::STAGES * C::K_BYTES;
  const u32 sS = sV0 + C::STAGES * C::V_BYTES;  // fp8: the staging of the tile in flight
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, first = warp * MT * 16;
  const u32 sQw = sQ + first * C::LD * C::E;

  Tile t;
  reload_tile(P, C::BLOCK_M, t);
  st.publish(P, t, MT * 16);
  // plain path: raw dots, scale folded into the exponential; general: log2-unit scores first.
  // The kv head's k_scale joins the score scale (s = sm_scale * q . (k_scale * code)).
  const bool general = P.soft_cap > 0.f || P.alibi != nullptr || !(P.sm_scale > 0.f);
  const float sm = P.sm_scale * kv_scale(P.k_scale, P.k_scale_stride, P.k_scale_value, t.hk);
  const float sc = general ? 1.f : sm * LOG2E;

  // key tiles n_first .. n_last (inclusive) hold every key a row of the CTA sees
  const int j_begin = visible_lo(t.position(0), P.window_left);
  const int j_end = visible_hi(t.position(t.rows - 1), t.kv_len, P.causal);
  const int n_first = j_begin / BN;
  const int n_last = j_end > j_begin ? (j_end - 1) / BN : n_first - 1;

  // -- prologue: Q, and K (all of the tile with two stages) of the last tile --
  load_q_tile<T, D, C>(P.q, P.q_tok, t, sQ);
  if (n_last >= n_first) {
    KVSource<KV> src;
    src.init(P, t);
    if constexpr (C::STAGES == 2) load_kv_tile<T, KV, C, V_T>(P, src, n_last * BN, sK0, sV0, sS);
    else load_kv_rows<KV, C, true, false>(P, src, n_last * BN, sK0, sV0, sS);
  }
  cp_async_commit();
  u32 qf[C::Q_REGS ? MT : 1][C::Q_REGS ? KS_Q : 1][4];
  if constexpr (C::Q_REGS) {
    cp_async_wait<0>();
    __syncthreads();
    const u32 qa = sQw + (ldm_a_row(lane) * C::LD + ldm_a_col(lane)) * C::E;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int kk = 0; kk < KS_Q; ++kk) ldmatrix_x4(qf[mt][kk], qa + (16 * mt * C::LD + kk * 16) * C::E);
  }

  float o[MT][NT_O][4], m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < NT_O; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.f;
    m[mt][0] = m[mt][1] = neg_inf();
    l[mt][0] = l[mt][1] = 0.f;
  }

  for (int n = n_last, stage = 0; n >= n_first; --n, stage ^= C::STAGES - 1) {
    const int j0 = n * BN;
    const u32 sK = sK0 + stage * C::K_BYTES, sV = sV0 + stage * C::V_BYTES;
    cp_async_wait<0>();
    // fp8: the thread's staged chunks of tile n widened into this stage (last read by tile n + 2)
    if constexpr (F::FP8) land_kv_tile<T, KV, C, V_T>(P, sK, sV, sS);
    __syncthreads();  // tile n (K; V too with two stages) visible; every warp is done with tile n + 1
    if constexpr (C::STAGES == 2) {
      if (n > n_first)  // all of tile n - 1 into the other stage (fp8: into the staging)
        load_kv_tile<T, KV, C, V_T>(P, st.src, j0 - BN, sK0 + (stage ^ 1) * C::K_BYTES,
                                    sV0 + (stage ^ 1) * C::V_BYTES, sS);
    } else {
      load_v_tile<T, C, V_T>(P, st.src, j0, sK, sV);
    }
    cp_async_commit();

    const int4 wk = st.keys[warp];
    const RowKeys w{wk.x, wk.y, wk.z, wk.w};
    const bool active = w.sees(j0, BN);
    u32 pf[MT][BN / 16][4];
    if (active) {
      // -- compute qk; scores, mask, online softmax; p -> A fragments --
      float s[MT][BN / 8][4];
      compute_qk<T, D, C>(s, qf, sQw, sK, lane);
      softmax_tile<T, D, C>(s, pf, o, m, l, P, st, general, w.needs_mask(j0, BN), sm, sc, first, j0, lane);
    }
    if constexpr (C::STAGES == 1) {
      cp_async_wait<0>();
      __syncthreads();  // V_n visible; every warp is done with K_n
      if (n > n_first) load_kv_rows<KV, C, true, false>(P, st.src, j0 - BN, sK, sV, 0u);
      cp_async_commit();
    }
    // -- compute pv --
    if (active) compute_pv<T, D, C, V_T>(o, pf, sV, lane);
  }

  // -- epilogue: rows staged in the warp's own sQ rows (Q's copy must have landed) --
  if (n_last < n_first) {
    cp_async_wait<0>();
    __syncthreads();
  }
  reload_tile(P, C::BLOCK_M, t);
  const float vs = kv_scale(P.v_scale, P.v_scale_stride, P.v_scale_value, t.hk);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const float m_log2[2] = {m[mt][0] * sc, m[mt][1] * sc};
    store_rows<T, D, C>(P.out, P.lse, P.sinks, P.num_q_heads, t, first + 16 * mt, o[mt], m_log2, l[mt],
                        reinterpret_cast<T*>(smem_raw), lane, vs);
  }
}

// ----------------------------------------------------------------------------- fp32 (CUDA cores)
// Warp w takes packed rows w, w + 8, ... of the item, one query row at a time: the row sits
// in smem; in each step of 32 visible keys every lane scores one key (float4 reads of its
// K row), the warp updates m_i / l_i, then broadcasts the 32 probabilities while lane owns
// dims lane, lane + 32, ... of acc and reads them from each V row.
constexpr int SIMT_WARPS = 8;

template <int D>
__device__ __forceinline__ void prefill_simt(const Problem<float, float>& P) {
  constexpr int SIMT_BLOCK_M = 128, NV = (D + 31) / 32;
  __shared__ __align__(16) float sq[SIMT_WARPS][D];
  Tile t;
  t.init(P, P.work[blockIdx.x], SIMT_BLOCK_M);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  ScoreEpilogue epi;
  epi.init(P.sm_scale, P.soft_cap);
  for (int r = warp; r < t.rows; r += SIMT_WARPS) {
    const int p = t.position(r), h = t.head(r);
    const int lo = visible_lo(p, P.window_left), hi = visible_hi(p, t.kv_len, P.causal);
    const float slope = P.alibi != nullptr ? P.alibi[h] * LOG2E : 0.f;
    const float* qrow = P.q + t.token_row(r) * P.q_tok + (i64)h * D;
    __syncwarp();
    for (int d = lane; d < D; d += 32) sq[warp][d] = qrow[d];
    __syncwarp();
    float acc[NV], m = neg_inf(), l = 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i) acc[i] = 0.f;
    for (int j0 = lo; j0 < hi; j0 += 32) {
      // -- one key per lane --
      const int j = j0 + lane;
      float x = neg_inf();
      if (j < hi) {
        const float* key = t.key_ptr(P, j, 0);  // 4-float chunk c at key + c * k_chunk
        float dot = 0.f;
#pragma unroll 4
        for (int d = 0; d < D; d += 4) {
          const float4 kv = *reinterpret_cast<const float4*>(key + (d / 4) * P.k_chunk);
          dot += sq[warp][d] * kv.x + sq[warp][d + 1] * kv.y + sq[warp][d + 2] * kv.z + sq[warp][d + 3] * kv.w;
        }
        x = epi(dot) + slope * (float)(j - p);
      }
      const float m_new = fmaxf(m, warp_max(x));  // finite: lane 0's key is visible
      const float alpha = exp2f(m - m_new);
      const float pj = exp2f(x - m_new);
      l = l * alpha + warp_sum(pj);
      m = m_new;
#pragma unroll
      for (int i = 0; i < NV; ++i) acc[i] *= alpha;
      // -- acc += p_j v_j over the step's keys --
      const int steps = min(32, hi - j0);
      for (int s = 0; s < steps; ++s) {
        const float ps = __shfl_sync(0xffffffffu, pj, s);
        const float* val = t.value_ptr(P, j0 + s, 0);  // dim d at val + d * v_dim
#pragma unroll
        for (int i = 0; i < NV; ++i)
          if (lane + 32 * i < D) acc[i] += ps * val[(lane + 32 * i) * P.v_dim];
      }
    }
    float inv, row_lse;
    finish_row(m, l, P.sinks, h, inv, row_lse);
    float* orow = P.out + (t.token_row(r) * P.num_q_heads + h) * D;
#pragma unroll
    for (int i = 0; i < NV; ++i)
      if (lane + 32 * i < D) orow[lane + 32 * i] = acc[i] * inv;
    if (P.lse != nullptr && lane == 0) P.lse[t.token_row(r) * P.num_q_heads + h] = row_lse;
  }
}

// ----------------------------------------------------------------------------- entries
// Both kernels take one Problem (abi.cuh): layout, paging and every score option are
// run-time fields; the work list holds int4 {sequence, kv head, first packed row, no-keys
// flag} items, padded with sequence -1 past its end.
// Grid: one CTA per work item; block: 32 * S::WARPS threads; dynamic smem: Q [BLOCK_M][D + 8]
// then S::STAGES K tiles [BLOCK_N][D + 8] and V tiles ([BLOCK_N][D + 8], or [D][BLOCK_N + 8]
// for V_T, the vllm value layout), then for an fp8 cache (KV) the staging of one tile
// (KVChunks::STAGE_BYTES); static smem: LoopState. Each warp owns S::MT contiguous
// 16-row m-tiles: S = Q K^T and O += P V on mma.sync (every K/V fragment loaded once feeds MT
// m-tiles), online softmax in registers. All threads fill the K/V tiles with cp.async, one
// block-table lookup per row (see TileShape for the order of loads and barriers); from an
// fp8 cache tile n - 1 streams into the staging during tile n and each thread widens its
// chunks into their stage before the barrier that opens tile n - 1 (two stages only).
// Key tiles run from the last visible one down, so masked diagonal / end tiles come first; a
// warp none of whose rows sees a key of a tile skips its math. The output is staged through
// the warp's own Q rows in smem.
template <typename T, typename KV, int D, bool V_T, typename S>
__global__ void __launch_bounds__(32 * S::WARPS, S::CTAS)
prefill_mma_kernel(CUPAGED_PARAMS_Problem) {
  const Problem<T, KV> P{CUPAGED_FIELDS_Problem};
  if (item_is_padding(P)) return;
  prefill_mma<T, KV, D, V_T, S>(P);
}

// Grid: one CTA per work item of 128 packed rows; block: SIMT_WARPS warps; fp32,
// every layout (see prefill_simt).
template <int D, typename T = float, typename KV = float>
__global__ void __launch_bounds__(32 * SIMT_WARPS)
prefill_simt_kernel(CUPAGED_PARAMS_Problem) {
  const Problem<float, float> P{CUPAGED_FIELDS_Problem};
  if (item_is_padding(P)) return;
  prefill_simt<D>(P);
}

}  // namespace cupaged
