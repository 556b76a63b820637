// Prefill attention over ragged or paged keys/values (FlashAttention-2 style).
//
// One CTA computes one work item (sequence b, kv head hk, first packed row row0) of a list
// the host builds longest-first. Rows are packed over the GQA group: packed row r of a
// sequence is query i = r / group of head hk * group + r % group, so the heads sharing a kv
// head share every K/V tile (decode rows of a mixed batch fill a tile with their group).
// Query i of a sequence with q_len queries and kv_len keys sits at p = kv_len - q_len + i
// (bottom-right alignment) and sees keys j in [lo, hi): lo = max(0, p - window_left) when
// window_left >= 0, else 0; hi = min(kv_len, p + 1) when causal, else kv_len.
//
// Scores are kept in log2 units: x = log2(e) * softcap(sm_scale * q.k) + log2(e) * slope * (j - p).
// Element (key j, dim d) of K sits at blk * k_block + hk * k_head + (d / X) * k_chunk + d % X
// + off * k_tok and of V at blk * v_block + hk * v_head + d * v_dim + off * v_tok, where
// X = 16 / sizeof(T) and (blk, off) = (table[j / block_size], j % block_size) for a paged
// cache or (0, kv_start + j) for ragged rows: one set of strides covers ragged rows and the
// NHD, HND and vllm cache layouts. All offsets are 64-bit.
//
// fp16/bf16 run on tensor cores (mma.sync m16n8k16, fp32 accumulation); fp32 inputs run a
// simple CUDA-core path (one warp per query row), correct but not tuned.
#include "common.cuh"
#include "mma.cuh"

namespace cupaged {

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// ----------------------------------------------------------------------------- problem
template <typename T>
struct Problem {
  const T* __restrict__ q;
  const T* __restrict__ k;
  const T* __restrict__ v;
  T* __restrict__ out;
  float* __restrict__ lse;
  const int4* __restrict__ work;
  const int* __restrict__ cu_q;
  const int* __restrict__ kv_info;  // ragged: cu_seqlens_k [B + 1]; paged: seq_lens [B]
  const int* __restrict__ block_tables;
  int max_blocks, block_size, paged;
  i64 k_block, k_head, k_chunk, k_tok, v_block, v_head, v_dim, v_tok;
  const float* __restrict__ alibi;
  const float* __restrict__ sinks;
  int num_q_heads, num_kv_heads;
  float sm_scale, soft_cap;
  int window_left, causal;
};

// The sequence, kv head and packed rows of one work item, and where its keys live.
struct Tile {
  int b, hk, row0, rows, group, q_start, q_len, kv_len, bs_shift;
  i64 kv_start;
  const int* table;

  template <typename T>
  __device__ __forceinline__ void init(const Problem<T>& P, int4 item, int block_m) {
    b = item.x; hk = item.y; row0 = item.z;
    group = P.num_q_heads / P.num_kv_heads;
    q_start = P.cu_q[b];
    q_len = P.cu_q[b + 1] - q_start;
    rows = min(block_m, q_len * group - row0);
    if (P.paged) {
      kv_start = 0;
      kv_len = P.kv_info[b];
      table = P.block_tables + (i64)b * P.max_blocks;
    } else {
      kv_start = P.kv_info[b];
      kv_len = P.kv_info[b + 1] - P.kv_info[b];
      table = nullptr;
    }
    const int bs = P.block_size;
    bs_shift = (bs & (bs - 1)) == 0 ? __ffs(bs) - 1 : -1;
  }
  // absolute position of packed row r (0-based within the tile)
  __device__ __forceinline__ int position(int r) const { return kv_len - q_len + (row0 + r) / group; }
  __device__ __forceinline__ int head(int r) const { return hk * group + (row0 + r) % group; }
  __device__ __forceinline__ i64 token_row(int r) const { return (i64)q_start + (row0 + r) / group; }
  // (blk, off) of key j
  template <typename T>
  __device__ __forceinline__ void locate(const Problem<T>& P, int j, i64& blk, i64& off) const {
    if (table == nullptr) {
      blk = 0;
      off = kv_start + j;
    } else {
      const int bi = bs_shift >= 0 ? (j >> bs_shift) : j / P.block_size;
      blk = table[bi];
      off = j - bi * P.block_size;
    }
  }
  template <typename T>
  __device__ __forceinline__ const T* key_ptr(const Problem<T>& P, int j, int d) const {
    constexpr int X = Vec16<T>::N;
    i64 blk, off;
    locate(P, j, blk, off);
    return P.k + blk * P.k_block + hk * P.k_head + (d / X) * P.k_chunk + d % X + off * P.k_tok;
  }
  template <typename T>
  __device__ __forceinline__ const T* value_ptr(const Problem<T>& P, int j, int d) const {
    i64 blk, off;
    locate(P, j, blk, off);
    return P.v + blk * P.v_block + hk * P.v_head + d * P.v_dim + off * P.v_tok;
  }
};

// Visible keys [lo, hi) of the query at position p.
__device__ __forceinline__ int visible_lo(int p, int window_left) {
  return window_left >= 0 ? max(0, p - window_left) : 0;
}
__device__ __forceinline__ int visible_hi(int p, int kv_len, int causal) {
  return causal ? min(kv_len, p + 1) : kv_len;
}

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

// Score transform in log2 units: soft-cap, then ALiBi.
struct ScoreMap {
  float scale_log2, cap_log2, scale_over_cap;
  bool softcap;
  __device__ __forceinline__ void init(float sm_scale, float cap) {
    softcap = cap > 0.f;
    scale_log2 = sm_scale * LOG2E;
    cap_log2 = cap * LOG2E;
    scale_over_cap = softcap ? sm_scale / cap : 0.f;
  }
  __device__ __forceinline__ float operator()(float dot) const {
    return softcap ? cap_log2 * tanhf(dot * scale_over_cap) : dot * scale_log2;
  }
};

// ----------------------------------------------------------------------------- tensor cores
// Tile shape of the tensor-core kernel for head size D with MT 16-row m-tiles per warp
// (MT = 2: each K/V fragment feeds two m-tiles, 4 warps, 2 CTAs per SM; MT = 1: 8 warps).
template <int D, int MT_>
struct MmaConfig {
  static constexpr int MT = MT_;
  static constexpr int WARPS = 8 / MT;
  static constexpr int THREADS = 32 * WARPS;
  static constexpr int MIN_BLOCKS = MT;                // CTAs per SM to fit (regs, smem)
  static constexpr int BLOCK_M = 16 * MT * WARPS;      // packed rows per CTA (128)
  static constexpr int BLOCK_N = (MT == 2 && D > 64) || D > 128 ? 32 : 64;  // keys per K/V tile
  static constexpr int LD = D + 8;                     // padded smem row (conflict-free ldmatrix)
  static constexpr int LDT = BLOCK_N + 8;              // padded row of a transposed V tile
  static constexpr int CHUNKS = D / 8;                 // 16-byte chunks per row
  static constexpr bool Q_IN_REGS = MT * D <= 128;     // else A fragments reload from smem
};

// K tile n (keys [n * BLOCK_N, +BLOCK_N)) -> sK [BLOCK_N][LD]; keys past kv_len zero-filled.
template <typename T, int D, int MT>
__device__ __forceinline__ void load_k_tile(const Problem<T>& P, const Tile& t, T* sK, int n) {
  using C = MmaConfig<D, MT>;
  const int j0 = n * C::BLOCK_N;
#pragma unroll
  for (int idx = threadIdx.x; idx < C::BLOCK_N * C::CHUNKS; idx += C::THREADS) {
    const int r = idx / C::CHUNKS, c = idx % C::CHUNKS;
    T* dst = sK + r * C::LD + c * 8;
    if (j0 + r < t.kv_len) cp_async16(dst, t.key_ptr(P, j0 + r, c * 8));
    else cp_async16(dst, P.k, 0);
  }
}

// V tile n -> sV [BLOCK_N][LD] (V_T false: rows of d contiguous in memory), or
// sV [D][LDT] (V_T true, the vllm value layout: keys contiguous per d).
template <typename T, int D, bool V_T, int MT>
__device__ __forceinline__ void load_v_tile(const Problem<T>& P, const Tile& t, T* sV, int n) {
  using C = MmaConfig<D, MT>;
  const int j0 = n * C::BLOCK_N;
  if constexpr (!V_T) {
#pragma unroll
    for (int idx = threadIdx.x; idx < C::BLOCK_N * C::CHUNKS; idx += C::THREADS) {
      const int r = idx / C::CHUNKS, c = idx % C::CHUNKS;
      T* dst = sV + r * C::LD + c * 8;
      if (j0 + r < t.kv_len) cp_async16(dst, t.value_ptr(P, j0 + r, c * 8));
      else cp_async16(dst, P.v, 0);
    }
  } else {
    constexpr int KC = C::BLOCK_N / 8;  // 8-key chunks per d row
    const bool vec = (P.block_size & 7) == 0;  // 8 keys never straddle a block
#pragma unroll
    for (int idx = threadIdx.x; idx < D * KC; idx += C::THREADS) {
      const int d = idx / KC, j = j0 + (idx % KC) * 8;
      T* dst = sV + d * C::LDT + (idx % KC) * 8;
      const int valid = min(8, t.kv_len - j);
      if (vec) {
        if (valid > 0) cp_async16(dst, t.value_ptr(P, j, d), valid * (int)sizeof(T));
        else cp_async16(dst, P.v, 0);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) dst[e] = e < valid ? *t.value_ptr(P, j + e, d) : from_float<T>(0.f);
      }
    }
  }
}

// Q tile: packed rows [row0, row0 + rows) -> sQ [BLOCK_M][LD]; rows past the tile zero-filled.
template <typename T, int D, int MT>
__device__ __forceinline__ void load_q_tile(const Problem<T>& P, const Tile& t, T* sQ) {
  using C = MmaConfig<D, MT>;
#pragma unroll
  for (int idx = threadIdx.x; idx < C::BLOCK_M * C::CHUNKS; idx += C::THREADS) {
    const int r = idx / C::CHUNKS, c = idx % C::CHUNKS;
    T* dst = sQ + r * C::LD + c * 8;
    if (r < t.rows) cp_async16(dst, P.q + (t.token_row(r) * P.num_q_heads + t.head(r)) * D + c * 8);
    else cp_async16(dst, P.q, 0);
  }
}

// One 16-row m-tile of a warp; this thread owns rows g and g + 8 of it (hr = 0, 1).
struct RowTile {
  int first, p[2], lo[2], hi[2];   // per owned row: position, visible keys [lo, hi)
  int j_lo, j_hi, hi_min, lo_max;  // keys any valid row sees; keys every valid row sees
  bool valid;                      // the m-tile holds a valid row

  __device__ __forceinline__ void init(const Tile& t, int first_row, int lane, int window_left,
                                       int causal) {
    first = first_row;
    valid = first < t.rows;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = first + lane / 4 + 8 * hr;
      p[hr] = t.position(r);
      lo[hr] = r < t.rows ? visible_lo(p[hr], window_left) : 0;
      hi[hr] = r < t.rows ? visible_hi(p[hr], t.kv_len, causal) : 0;
    }
    j_lo = j_hi = hi_min = lo_max = 0;  // an empty m-tile sees nothing and is always masked
    if (valid) {
      const int p_first = t.position(first), p_last = t.position(min(first + 15, t.rows - 1));
      j_lo = visible_lo(p_first, window_left);
      j_hi = visible_hi(p_last, t.kv_len, causal);
      hi_min = visible_hi(p_first, t.kv_len, causal);
      lo_max = visible_lo(p_last, window_left);
    }
  }
  // some row sees a key of [j0, j0 + n)
  __device__ __forceinline__ bool sees(int j0, int n) const { return valid && j0 < j_hi && j0 + n > j_lo; }
  // some row does not see every key of [j0, j0 + n)
  __device__ __forceinline__ bool needs_mask(int j0, int n) const { return j0 + n > hi_min || j0 < lo_max; }
};

// Scores of one m-tile in log2 units: scale / soft-cap, ALiBi, mask; then the online softmax
// (m_i, l_i, acc rescale) turning s into probabilities.
template <int NT_S, int NT_O>
__device__ __forceinline__ void softmax_step(float (&s)[NT_S][4], float (&o)[NT_O][4], float (&m)[2],
                                             float (&l)[2], const RowTile& w, const ScoreMap& smap,
                                             const float (&slope)[2], bool alibi, bool mask, int j0,
                                             int lane) {
#pragma unroll
  for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int hr = e / 2, j = j0 + nt * 8 + 2 * (lane % 4) + (e & 1);
      float x = smap(s[nt][e]);
      if (alibi) x += slope[hr] * (float)(j - w.p[hr]);
      if (mask && (j < w.lo[hr] || j >= w.hi[hr])) x = neg_inf();
      s[nt][e] = x;
    }
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float mx = neg_inf();
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * hr], s[nt][2 * hr + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m[hr], mx);
    const float m_use = m_new == neg_inf() ? 0.f : m_new;  // no key yet: p = 0, no NaN
    const float alpha = fast_exp2(m[hr] - m_use);
    m[hr] = m_new;
    float rs = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt) {
      s[nt][2 * hr] = fast_exp2(s[nt][2 * hr] - m_use);
      s[nt][2 * hr + 1] = fast_exp2(s[nt][2 * hr + 1] - m_use);
      rs += s[nt][2 * hr] + s[nt][2 * hr + 1];
    }
    l[hr] = l[hr] * alpha + rs;
#pragma unroll
    for (int dt = 0; dt < NT_O; ++dt) {
      o[dt][2 * hr] *= alpha;
      o[dt][2 * hr + 1] *= alpha;
    }
  }
}

// Normalise one m-tile, write its LSE, stage it in its own sQ rows and store 16-byte rows.
template <typename T, int D, int MT>
__device__ __forceinline__ void store_rows(const Problem<T>& P, const Tile& t, const RowTile& w,
                                           float (&o)[D / 8][4], float (&m)[2], float (&l)[2],
                                           T* sQ, int lane) {
  using C = MmaConfig<D, MT>;
  float inv[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    l[hr] += __shfl_xor_sync(0xffffffffu, l[hr], 1);
    l[hr] += __shfl_xor_sync(0xffffffffu, l[hr], 2);
    const int r = w.first + lane / 4 + 8 * hr;
    float row_lse;
    finish_row(m[hr], l[hr], P.sinks, t.head(min(r, t.rows - 1)), inv[hr], row_lse);
    if (P.lse != nullptr && lane % 4 == 0 && r < t.rows)
      P.lse[t.token_row(r) * P.num_q_heads + t.head(r)] = row_lse;
  }
  if (!w.valid) return;
  T* stage = sQ + w.first * C::LD;
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr)
      *reinterpret_cast<u32*>(stage + (lane / 4 + 8 * hr) * C::LD + dt * 8 + 2 * (lane % 4)) =
          pack2<T>(o[dt][2 * hr] * inv[hr], o[dt][2 * hr + 1] * inv[hr]);
  __syncwarp();
#pragma unroll
  for (int idx = lane; idx < 16 * C::CHUNKS; idx += 32) {
    const int r = idx / C::CHUNKS, c = idx % C::CHUNKS;
    if (w.first + r < t.rows)
      *reinterpret_cast<uint4*>(P.out + (t.token_row(w.first + r) * P.num_q_heads + t.head(w.first + r)) * D + c * 8) =
          *reinterpret_cast<const uint4*>(stage + r * C::LD + c * 8);
  }
}

// Grid: one CTA per work item; block: MmaConfig<D, MT>::THREADS.
// Each warp owns MT contiguous 16-row m-tiles: S = Q K^T and O += P V on mma.sync (every K/V
// fragment loaded once feeds MT m-tiles), Q fragments in registers (or reloaded from smem),
// online softmax in registers. All threads fill the K/V tiles with cp.async: V_n streams in
// during S = Q K_n^T, K_{n-1} during O += P V_n. Key tiles run from the last visible one
// down, so masked diagonal / end tiles come first; a warp none of whose rows sees a key of
// a tile skips its math. The output is staged through the warp's own Q rows in smem.
template <typename T, int D, bool V_T, int MT_>
__device__ __forceinline__ void prefill_mma(const Problem<T>& P) {
  using C = MmaConfig<D, MT_>;
  constexpr int MT = C::MT, NT_S = C::BLOCK_N / 8, NT_O = D / 8, KS_Q = D / 16, KS_P = C::BLOCK_N / 16;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + C::BLOCK_M * C::LD;
  T* sV = sK + C::BLOCK_N * C::LD;

  Tile t;
  t.init(P, P.work[blockIdx.x], C::BLOCK_M);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  RowTile w[MT];
  float slope[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    w[mt].init(t, (warp * MT + mt) * 16, lane, P.window_left, P.causal);
    for (int hr = 0; hr < 2; ++hr)
      slope[mt][hr] = P.alibi == nullptr ? 0.f
          : P.alibi[t.head(min(w[mt].first + lane / 4 + 8 * hr, t.rows - 1))] * LOG2E;
  }
  ScoreMap smap;
  smap.init(P.sm_scale, P.soft_cap);

  // key tiles n_first .. n_last (inclusive) hold every key a row of the CTA sees
  const int j_begin = visible_lo(t.position(0), P.window_left);
  const int j_end = visible_hi(t.position(t.rows - 1), t.kv_len, P.causal);
  const int n_first = j_begin / C::BLOCK_N;
  const int n_last = j_end > j_begin ? (j_end - 1) / C::BLOCK_N : n_first - 1;

  // -- prologue: Q, then the first K tile --
  load_q_tile<T, D, MT>(P, t, sQ);
  cp_async_commit();
  if (n_last >= n_first) load_k_tile<T, D, MT>(P, t, sK, n_last);
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();
  u32 qf[C::Q_IN_REGS ? MT : 1][C::Q_IN_REGS ? KS_Q : 1][4];
  if constexpr (C::Q_IN_REGS) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int kk = 0; kk < KS_Q; ++kk)
        ldmatrix_x4(qf[mt][kk], sQ + (w[mt].first + ldm_a_row(lane)) * C::LD + kk * 16 + ldm_a_col(lane));
  }

  float o[MT][NT_O][4], m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < NT_O; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.f;
    m[mt][0] = m[mt][1] = neg_inf();
    l[mt][0] = l[mt][1] = 0.f;
  }

  for (int n = n_last; n >= n_first; --n) {
    cp_async_wait<0>();
    __syncthreads();  // K_n visible to all; every warp is done with V_{n+1}
    load_v_tile<T, D, V_T, MT>(P, t, sV, n);
    cp_async_commit();

    const int j0 = n * C::BLOCK_N;
    bool active = false;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) active |= w[mt].sees(j0, C::BLOCK_N);
    u32 pf[MT][KS_P][4];
    if (active) {
      // -- compute qk --
      float s[MT][NT_S][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < NT_S; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < KS_Q; ++kk) {
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if constexpr (C::Q_IN_REGS) {
#pragma unroll
            for (int i = 0; i < 4; ++i) a[mt][i] = qf[mt][kk][i];
          } else {
            ldmatrix_x4(a[mt], sQ + (w[mt].first + ldm_a_row(lane)) * C::LD + kk * 16 + ldm_a_col(lane));
          }
        }
#pragma unroll
        for (int nn = 0; nn < C::BLOCK_N / 16; ++nn) {
          u32 bk[4];
          ldmatrix_x4(bk, sK + (nn * 16 + ldm_bnk_row(lane)) * C::LD + kk * 16 + ldm_bnk_col(lane));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_16816<T>(s[mt][2 * nn], a[mt], bk[0], bk[1]);
            mma_16816<T>(s[mt][2 * nn + 1], a[mt], bk[2], bk[3]);
          }
        }
      }
      // -- scores, mask, online softmax; p -> A fragments --
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const bool mask = !w[mt].sees(j0, C::BLOCK_N) || w[mt].needs_mask(j0, C::BLOCK_N);
        softmax_step<NT_S, NT_O>(s[mt], o[mt], m[mt], l[mt], w[mt], smap, slope[mt],
                                 P.alibi != nullptr, mask, j0, lane);
#pragma unroll
        for (int kk = 0; kk < KS_P; ++kk) {
          pf[mt][kk][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
          pf[mt][kk][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
          pf[mt][kk][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
          pf[mt][kk][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        }
      }
    }

    cp_async_wait<0>();
    __syncthreads();  // V_n visible to all; every warp is done with K_n
    if (n > n_first) load_k_tile<T, D, MT>(P, t, sK, n - 1);
    cp_async_commit();

    if (active) {
      // -- compute pv --
#pragma unroll
      for (int kk = 0; kk < KS_P; ++kk)
#pragma unroll
        for (int dd = 0; dd < D / 16; ++dd) {
          u32 bv[4];
          if constexpr (V_T)
            ldmatrix_x4(bv, sV + (dd * 16 + ldm_bnk_row(lane)) * C::LDT + kk * 16 + ldm_bnk_col(lane));
          else
            ldmatrix_x4_trans(bv, sV + (kk * 16 + ldm_bkn_row(lane)) * C::LD + dd * 16 + ldm_bkn_col(lane));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_16816<T>(o[mt][2 * dd], pf[mt][kk], bv[0], bv[1]);
            mma_16816<T>(o[mt][2 * dd + 1], pf[mt][kk], bv[2], bv[3]);
          }
        }
    }
  }

  // -- epilogue --
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) store_rows<T, D, MT>(P, t, w[mt], o[mt], m[mt], l[mt], sQ, lane);
}

// ----------------------------------------------------------------------------- fp32 (CUDA cores)
// Grid: one CTA per work item; block: 8 warps.
// Warp w takes packed rows w, w + 8, ... of the item, one query row at a time: the row sits
// in smem; in each step of 32 visible keys every lane scores one key (float4 reads of its
// K row), the warp updates m_i / l_i, then broadcasts the 32 probabilities while lane owns
// dims lane, lane + 32, ... of acc and reads them from each V row.
template <int D>
__device__ __forceinline__ void prefill_simt(const Problem<float>& P, int block_m) {
  constexpr int SIMT_WARPS = 8;
  constexpr int NV = (D + 31) / 32;
  __shared__ __align__(16) float sq[SIMT_WARPS][D];
  Tile t;
  t.init(P, P.work[blockIdx.x], block_m);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  ScoreMap smap;
  smap.init(P.sm_scale, P.soft_cap);
  for (int r = warp; r < t.rows; r += SIMT_WARPS) {
    const int p = t.position(r), h = t.head(r);
    const int lo = visible_lo(p, P.window_left), hi = visible_hi(p, t.kv_len, P.causal);
    const float slope = P.alibi != nullptr ? P.alibi[h] * LOG2E : 0.f;
    const float* qrow = P.q + (t.token_row(r) * P.num_q_heads + h) * D;
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
        x = smap(dot) + slope * (float)(j - p);
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

// ----------------------------------------------------------------------------- entry
// One kernel per (element type, head dim, transposed-V smem fill, m-tiles per warp); layout,
// paging and every score option are run-time arguments (see Problem). Grid: one CTA per work item (int4
// {sequence, kv head, first packed row, 0}); block: LaunchShape<T, D, MT>::THREADS. fp16/bf16
// need MmaConfig's dynamic shared memory, fp32 none.
template <typename T, int D, int MT>
struct LaunchShape {  // fp32 runs prefill_simt's 8 warps
  static constexpr int THREADS = sizeof(T) == 4 ? 256 : MmaConfig<D, MT>::THREADS;
  static constexpr int MIN_BLOCKS = sizeof(T) == 4 ? 1 : MmaConfig<D, MT>::MIN_BLOCKS;
};

template <typename T, int D, bool V_T, int MT>
__global__ void __launch_bounds__(LaunchShape<T, D, MT>::THREADS, LaunchShape<T, D, MT>::MIN_BLOCKS)
prefill_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
               T* __restrict__ out, float* __restrict__ lse, const int4* __restrict__ work,
               const int* __restrict__ cu_q, const int* __restrict__ kv_info,
               const int* __restrict__ block_tables, int max_blocks, int block_size, int paged,
               i64 k_block, i64 k_head, i64 k_chunk, i64 k_tok,
               i64 v_block, i64 v_head, i64 v_dim, i64 v_tok,
               const float* __restrict__ alibi, const float* __restrict__ sinks,
               int num_q_heads, int num_kv_heads, float sm_scale, float soft_cap,
               int window_left, int causal) {
  const Problem<T> P{q, k, v, out, lse, work, cu_q, kv_info, block_tables, max_blocks,
                     block_size, paged, k_block, k_head, k_chunk, k_tok, v_block, v_head,
                     v_dim, v_tok, alibi, sinks, num_q_heads, num_kv_heads, sm_scale,
                     soft_cap, window_left, causal};
  if constexpr (sizeof(T) == 4) {
    prefill_simt<D>(P, MmaConfig<D, MT>::BLOCK_M);
  } else {
    prefill_mma<T, D, V_T, MT>(P);
  }
}

}  // namespace cupaged
