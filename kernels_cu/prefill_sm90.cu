// Prefill attention on Hopper warpgroup tensor cores (wgmma, sm_90a): FlashAttention-3-lite.
//
// Same problem, work list and arguments as kernels_cu/prefill.cu (see there): one CTA per
// work item (sequence b, kv head hk, first packed row row0) of 128 packed rows, packed row r
// being query r / group of head hk * group + r % group; query i sits at
// p = kv_len - q_len + i and sees keys [lo, hi) (window_left, causal). fp16/bf16, head sizes
// 64, 80, 96, 112, 128 and 256, ragged K/V and the NHD, HND and vllm caches (V_T: the vllm
// value layout, keys contiguous per dim), sinks and LSE; GENERAL scores (soft-cap, ALiBi or
// a non-positive sm_scale) go through the score epilogue of score.cuh first, the plain ones
// stay raw dot products with the scale folded into the exponential.
//
// Two warpgroups each own 64 of the CTA's rows. Per K/V tile of BN keys, a warpgroup runs
// S = Q K^T (wgmma, A = Q and B = K from swizzled shared memory, both K-major), the online
// softmax on the fp32 accumulators (exp2 with one FFMA), converts P in registers to A
// fragments and runs O += P V (wgmma, B = V [keys][d], MN-major, or V^T [d][keys],
// K-major). All 256 threads load K/V tiles with cp.async into STAGES buffers, one tile
// ahead of the math (a paged cache's block-table entries one tile further ahead: one
// lookup per row and tile, shifts for power-of-two block sizes); tiles run from the last
// visible one down (masked tiles first). With three buffers the P V batch of a tile runs
// during the softmax of the next one (FA3's intra-warpgroup overlap; loop_overlap), with two
// each batch is waited for (loop_simple).
//
// K/V hold elements of type KV: T, or an fp8 format (fp8.cuh). fp8 tiles stream with
// cp.async as 16-byte chunks of 16 codes into per-thread staging slots, and each thread
// widens its own chunks into the tile's 16-bit buffer (Pipe::land) while its warpgroup's
// wgmma batches of the tile before run, so the wgmma loops read the tiles a 16-bit cache
// gives. The kv head's k_scale multiplies the score scale and its v_scale the output, for
// 16-bit K/V too (1 unless given: a paged prefill's packed copy of an fp8 cache's codes,
// cupaged.prefill.launch.GatherLaunches). The
// warp-specialised kernel takes fp8 caches by TMA alone (an explicit tile, prefill.plan
// tma_tile(d, kv=...)): the codes land in staging slots and producer warps widen them into
// the same tiles (ws_produce_fp8).
#include "attn_common.cuh"
#include "score.cuh"
#include "wgmma.cuh"

namespace cupaged {
namespace sm90 {

// One configuration: 2 warpgroups x 64 rows, BN-key K/V tiles, STAGES buffers, V^T tiles
// (V_T), the general score path (GENERAL). Q, K and V rows are swizzled SW bytes wide
// (D * 2 bytes a row: 128 for d64/d128/d256, 64 for d96, 32 for d80/d112), V^T rows SWT
// bytes (BN * 2 bytes a row). From an fp8 cache (KV) one tile's staging follows the buffers.
// LOADERS: the threads that copy tiles (all 256 of prefill_wgmma, the producer warpgroup of
// prefill_ws).
template <typename T, typename KV, int D, int BN, int STAGES, bool V_T, bool GENERAL, int LOADERS = 256>
struct Config {
  static_assert(sizeof(T) == 2 && D % 16 == 0 && D >= 64 && D <= 256, "fp16/bf16, head size 64..256");
  static_assert(BN % 64 == 0 && BN <= 128 && (STAGES == 2 || STAGES == 3), "tile shape");
  static constexpr int THREADS = LOADERS, BLOCK_M = 128, HEAD = D, KEYS = BN, BUFFERS = STAGES;
  static constexpr bool TRANSPOSED_V = V_T, GENERAL_SCORES = GENERAL;
  // three buffers: the P V batch of tile n + 1 runs during the softmax of tile n
  static constexpr bool OVERLAP = STAGES >= 3;
  static constexpr int SW = swizzle_bytes(2 * D), SWT = swizzle_bytes(2 * BN);
  static constexpr int CH = D / 8;                                  // 16-byte chunks per row
  static constexpr int CL = CH <= 8 ? 8 : CH <= 16 ? 16 : 32;       // threads per row in loads
  static constexpr int ROW_STEP = THREADS / CL;                     // rows per load pass
  static constexpr u32 Q_BYTES = BLOCK_M * D * 2;  // multiples of 1024: tiles stay aligned
  static constexpr u32 KV_BYTES = BN * D * 2;
  static constexpr u32 STAGING = KVChunks<KV, D, BN, THREADS>::STAGE_BYTES;  // fp8 only
  static constexpr u32 SMEM = Q_BYTES + 2 * STAGES * KV_BYTES + STAGING + 1024;  // + alignment slack
  static_assert(BN % ROW_STEP == 0 && BLOCK_M % ROW_STEP == 0, "whole load passes");
  static_assert(Q_BYTES % 1024 == 0 && KV_BYTES % 1024 == 0, "aligned tiles");
};

// a * b for non-negative 32-bit values as one 32 x 32 -> 64-bit multiply
__device__ __forceinline__ i64 wide(u32 a, u32 b) { return (i64)((u64)a * b); }

// Where the K/V rows of an item come from: the kv head's bases (ragged rows: the
// sequence's first key folded in), its block-table row (null: ragged), the key count and
// log2 of a power-of-two block size (-1: any other). Thread tid copies the 16-byte chunks
// KVChunks gives it (F: 16-bit or fp8 elements KV): one key lookup per row and tile
// serves K and V; rows past kv_len are zero-filled (their lookup clamped to the last key).
// V_T: V^T tiles instead (load_vt). fp8 chunks go to the thread's staging slots (at
// `staging`) and `land` widens them into the 16-bit tiles.
template <typename T, typename KV, typename C, int BN, bool V_T>
struct KVRows {
  using F = KVChunks<KV, C::HEAD, BN, C::THREADS>;
  static constexpr int RPT = F::RPT;  // rows per thread and tile
  const KV* kb;
  const KV* vb;
  const int* table;
  int kv_len, bs_shift;
  u32 staging;

  __device__ __forceinline__ int key(int j0, int i) const {
    return min(j0 + (int)threadIdx.x / F::CL + i * F::ROW_STEP, kv_len - 1);
  }
  // V^T: the first of the thread's PER keys j0 + PER (tid % KC) .., clamped to the chunk
  // of the last key (so that its in-block offset stays a multiple of PER)
  __device__ __forceinline__ int vt_key(int j0) const {
    return min(j0 + F::PER * ((int)threadIdx.x % F::KC), (kv_len - 1) & ~(F::PER - 1));
  }
  template <typename Prob>
  __device__ __forceinline__ int block_of(const Prob& P, int j) const {
    return __ldg(table + (bs_shift >= 0 ? j >> bs_shift : j / P.block_size));
  }
  template <typename Prob>
  __device__ __forceinline__ int offset_in_block(const Prob& P, int j) const {
    return bs_shift >= 0 ? j & (P.block_size - 1) : j % P.block_size;
  }
  // whole V^T chunks: PER keys never straddle a cache block
  template <typename Prob>
  __device__ __forceinline__ bool vt_chunks(const Prob& P) const { return P.block_size % F::PER == 0; }
  // Block-table entries of the thread's rows of the tile at key j0 (and, V_T with whole
  // V^T chunks, of its V^T chunk: vblk), all reads issued together (used at the next
  // `issue`, so their latency hides behind a tile of math).
  template <typename Prob>
  __device__ __forceinline__ void lookup(const Prob& P, int j0, int (&blk)[RPT + V_T]) const {
    if (table == nullptr) return;
#pragma unroll
    for (int i = 0; i < RPT; ++i) blk[i] = block_of(P, key(j0, i));
    if (V_T && vt_chunks(P)) blk[RPT] = block_of(P, vt_key(j0));
  }
  // cp.async of the tile at key j0 -> sK, sV (swizzled [BN][D]; V_T: sV [D][BN]), or the
  // staging slots (fp8), from the entries `lookup` gave. Block and token strides fit in 32
  // bits (the host checks): 32 x 32 -> 64-bit multiplies; the row offset in a block is a
  // mask for power-of-two block sizes.
  template <typename Prob>
  __device__ __forceinline__ void issue(const Prob& P, int j0, const int (&blk)[RPT + V_T], u32 sK, u32 sV) const {
    const int c = threadIdx.x % F::CL, r0 = threadIdx.x / F::CL;
    if (F::CL == F::CH || c < F::CH) {
      const KV* kc = kb + c * (int)P.k_chunk;
      const KV* vc = vb + c * F::PER * (int)P.v_dim;
#pragma unroll
      for (int i = 0; i < RPT; ++i) {
        const int r = r0 + i * F::ROW_STEP, jc = key(j0, i);
        int b = 0, off = jc;
        if (table != nullptr) {
          b = blk[i];
          off = offset_in_block(P, jc);
        }
        const u32 at = swizzled<BN, C::SW>(r, c);
        const int bytes = j0 + r < kv_len ? 16 : 0;
        cp_async16(F::FP8 ? F::slot(staging, i) : sK + at, kc + wide(b, (u32)P.k_block) + wide(off, (u32)P.k_tok),
                   bytes);
        if (!V_T)
          cp_async16(F::FP8 ? F::slot(staging, RPT + i) : sV + at,
                     vc + wide(b, (u32)P.v_block) + wide(off, (u32)P.v_tok), bytes);
      }
    }
    if constexpr (V_T) load_vt(P, j0, blk[RPT], sV);
  }
  // One part (K: KP, else V rows) of the tile at key j0 -> dst, as `issue` does, each row's
  // block-table entry read just before its copy: no entries kept across prefill_ws's waits
  // for a free stage (its producer runs in few registers).
  template <bool KP, typename Prob>
  __device__ __forceinline__ void issue_part(const Prob& P, int j0, u32 dst) const {
    static_assert(!V_T && !F::FP8, "V rows of a 16-bit cache");
    const int c = threadIdx.x % F::CL, r0 = threadIdx.x / F::CL;
    if (F::CL != F::CH && c >= F::CH) return;
    const KV* base = KP ? kb + c * (int)P.k_chunk : vb + c * F::PER * (int)P.v_dim;
    const u32 block = KP ? (u32)P.k_block : (u32)P.v_block, tok = KP ? (u32)P.k_tok : (u32)P.v_tok;
#pragma unroll 4
    for (int i = 0; i < RPT; ++i) {
      const int r = r0 + i * F::ROW_STEP, jc = key(j0, i);
      int b = 0, off = jc;
      if (table != nullptr) {
        b = block_of(P, jc);
        off = offset_in_block(P, jc);
      }
      cp_async16(dst + swizzled<BN, C::SW>(r, c), base + wide(b, block) + wide(off, tok), j0 + r < kv_len ? 16 : 0);
    }
  }
  // V^T tile of keys [j0, j0 + BN) from the vllm value layout (paged; keys contiguous:
  // v_tok 1, v_dim the block size) -> sV, swizzled [D][BN]: KVChunks' V^T chunks, one
  // 16-byte cp.async each (keys past kv_len zero-filled; to the staging for fp8) with
  // whole V^T chunks, else element by element, widened as they are read (st.shared; the
  // fence before the next barrier orders them for wgmma as it does the copies).
  template <typename Prob>
  __device__ __forceinline__ void load_vt(const Prob& P, int j0, int vblk, u32 sV) const {
    constexpr int D = C::HEAD;
    const int kc = threadIdx.x % F::KC, d0 = threadIdx.x / F::KC, j = j0 + F::PER * kc;
    const int valid = max(0, min(F::PER, kv_len - j));
    if (vt_chunks(P)) {
      const int jc = vt_key(j0);
      const KV* src = vb + wide(vblk, (u32)P.v_block) + wide(offset_in_block(P, jc), (u32)P.v_tok);
#pragma unroll
      for (int i = 0; i < F::VT_PASSES; ++i) {
        const int d = d0 + i * F::VT_STEP;
        if (D % F::VT_STEP == 0 || d < D)
          cp_async16(F::FP8 ? F::slot(staging, RPT + i) : sV + swizzled<D, C::SWT>(d, kc),
                     src + wide(d, (u32)P.v_dim), valid * (int)sizeof(KV));
      }
    } else {
      for (int e = 0; e < F::PER; ++e) {
        const KV* src = vb;
        if (e < valid) src += wide(block_of(P, j + e), (u32)P.v_block) + wide(offset_in_block(P, j + e), (u32)P.v_tok);
        for (int d = d0; d < D; d += F::VT_STEP) {
          const unsigned short x = e < valid ? tile_bits<T, KV>(src[wide(d, (u32)P.v_dim)]) : (unsigned short)0;
          const int e2 = F::PER * kc + e;  // key in the tile
          asm volatile("st.shared.b16 [%0], %1;\n" :: "r"(sV + swizzled<D, C::SWT>(d, e2 / 8) + 2 * (e2 % 8)),
                       "h"(x) : "memory");
        }
      }
    }
  }
  // fp8: the thread's staged chunks of a tile (its copies landed) widened into sK and sV.
  template <typename Prob>
  __device__ __forceinline__ void land(const Prob& P, u32 sK, u32 sV) const {
    const int c = threadIdx.x % F::CL, r0 = threadIdx.x / F::CL;
    if (F::CL == F::CH || c < F::CH) {
#pragma unroll
      for (int i = 0; i < RPT; ++i) {
        const int r = r0 + i * F::ROW_STEP;
        const u32 lo = swizzled<BN, C::SW>(r, 2 * c), hi = swizzled<BN, C::SW>(r, 2 * c + 1);
        widen_chunk_shared<T, KV>(F::slot(staging, i), sK + lo, sK + hi, F::hi_first(c));
        if (!V_T) widen_chunk_shared<T, KV>(F::slot(staging, RPT + i), sV + lo, sV + hi, F::hi_first(c));
      }
    }
    if constexpr (V_T) {
      // Without whole V^T chunks (element copies went to sV at issue) the chunks are widened
      // onto their own slot instead: no branch on the block size here, where a branch keeps
      // ptxas from overlapping the wgmma batches.
      constexpr int D = C::HEAD;
      const int kc = threadIdx.x % F::KC, d0 = threadIdx.x / F::KC;
      const bool whole = vt_chunks(P);
#pragma unroll
      for (int i = 0; i < F::VT_PASSES; ++i) {
        const int d = d0 + i * F::VT_STEP;
        const u32 from = F::slot(staging, RPT + i);
        if (D % F::VT_STEP == 0 || d < D)
          widen_chunk_shared<T, KV>(from, whole ? sV + swizzled<D, C::SWT>(d, 2 * kc) : from,
                                    whole ? sV + swizzled<D, C::SWT>(d, 2 * kc + 1) : from,
                                    F::hi_first(kc));
      }
    }
  }
};

// Q tile: packed rows [0, rows) of the item -> sQ (swizzled [128][D]); the rest zero-filled.
template <typename T, int D, typename C, typename Prob>
__device__ __forceinline__ void load_q(const Prob& P, const WorkItem& it, u32 sQ) {
  const int c = threadIdx.x % C::CL, r0 = threadIdx.x / C::CL;
  if (C::CL != C::CH && c >= C::CH) return;
#pragma unroll
  for (int i = 0; i < C::BLOCK_M / C::ROW_STEP; ++i) {
    const int r = r0 + i * C::ROW_STEP;
    const u32 dst = sQ + swizzled<C::BLOCK_M, C::SW>(r, c);
    if (r < it.rows) cp_async16(dst, P.q + it.token_row(r) * P.q_tok + (i64)it.head(r) * D + c * 8);
    else cp_async16(dst, P.q, 0);
  }
}

// Issue S = Q K^T over one K tile for the warpgroup's 64 rows (raw dots) as one batch;
// k-step kk reads 16 columns 32 * kk / W column blocks in (W = C::SW).
template <typename T, typename C>
__device__ __forceinline__ void qk(float (&s)[C::KEYS / 2], u32 sQg, u32 sK) {
  constexpr int D = C::HEAD, BN = C::KEYS, W = C::SW;
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const u32 block = 32 * kk / W, koff = 32 * kk % W;
    const u64 da = descriptor<W>(sQg + block * (C::BLOCK_M * W) + koff, 16, 8 * W);
    const u64 db = descriptor<W>(sK + block * (BN * W) + koff, 16, 8 * W);
    WgmmaSS<T, BN>::run(s, da, db, kk > 0);
  }
  wgmma_commit();
}

// Issue O += P V over one V tile (P as A fragments) as one batch: V [keys][D] MN-major, or
// (V_T) V^T [D][keys] K-major.
template <typename T, typename C>
__device__ __forceinline__ void pv(float (&o)[C::HEAD / 2], const u32 (&pf)[C::KEYS / 16][4], u32 sV) {
  constexpr int D = C::HEAD, BN = C::KEYS;
  fence_operands(o);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    if constexpr (C::TRANSPOSED_V) {
      constexpr int W = C::SWT;
      const u32 at = sV + (32 * kk / W) * (D * W) + 32 * kk % W;
      WgmmaRS<T, D>::template run<0>(o, pf[kk], descriptor<W>(at, 16, 8 * W), 1);
    } else {
      constexpr int W = C::SW;
      WgmmaRS<T, D>::template run<1>(o, pf[kk], descriptor<W>(sV + kk * 16 * W, BN * W, 8 * W), 1);
    }
  }
  wgmma_commit();
}

// Keys outside [lo, hi) of the thread's two rows -> -inf (columns j0 + 8i + 2t + e).
template <int BN>
__device__ __forceinline__ void mask(float (&s)[BN / 2], const int (&lo)[2], const int (&hi)[2], int j0, int lane) {
#pragma unroll
  for (int i = 0; i < BN / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = j0 + 8 * i + 2 * (lane % 4) + (e & 1);
      if (j < lo[e / 2] || j >= hi[e / 2]) s[4 * i + e] = neg_inf();
    }
}

// Online softmax step: raw scores s (sc * s in log2 units) update the row max m (raw) and
// the thread-partial sums l; s -> probabilities exp2(sc * s - sc * m) packed as A fragments
// of P; alpha: the factor the accumulators of the two rows take (see rescale).
template <typename T, int BN>
__device__ __forceinline__ void softmax(float (&s)[BN / 2], float (&m)[2], float (&l)[2], u32 (&pf)[BN / 16][4],
                                        float (&alpha)[2], float sc) {
  float mx[2] = {m[0], m[1]};
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) mx[(i / 2) % 2] = fmaxf(mx[(i / 2) % 2], s[i]);
  float m_sc[2], rs[2] = {0.f, 0.f};
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 1));
    mx[hr] = fmaxf(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 2));
    m_sc[hr] = mx[hr] == neg_inf() ? 0.f : mx[hr] * sc;  // no key yet: p = 0, no NaN
    alpha[hr] = fast_exp2(fmaf(m[hr], sc, -m_sc[hr]));  // m = -inf: 0 (o and l are 0)
    m[hr] = mx[hr];
  }
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) {
    const int hr = (i / 2) % 2;
    s[i] = fast_exp2(fmaf(s[i], sc, -m_sc[hr]));
    rs[hr] += s[i];
  }
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) l[hr] = fmaf(l[hr], alpha[hr], rs[hr]);
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
    for (int x = 0; x < 4; ++x) pf[kk][x] = pack2<T>(s[8 * kk + 2 * x], s[8 * kk + 2 * x + 1]);
}

template <int D>
__device__ __forceinline__ void rescale(float (&o)[D / 2], const float (&alpha)[2]) {
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] *= alpha[(i / 2) % 2];
}

// Wait for every wgmma batch of the warpgroup; the accumulators o and the A fragments pf
// of the last P V batch stay live (unmoved, unreused) up to here.
template <int D, int N>
__device__ __forceinline__ void drain(float (&o)[D / 2], u32 (&pf)[N][4]) {
  wgmma_wait<0>();
  fence_operands(o);
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int x = 0; x < 4; ++x) asm volatile("" : "+r"(pf[i][x]) :: "memory");
}

// Epilogue of one warp's 16 rows (tile rows first .. first + 15): normalise (times
// out_scale: an fp8 cache's v_scale), write LSE, stage the rows in the (swizzled) Q tile and
// store them as 16-byte chunks.
template <typename T, typename C, typename Prob>
__device__ __forceinline__ void store_rows(const Prob& P, const WorkItem& it, int first, const float (&o)[C::HEAD / 2],
                                           const float (&m)[2], float (&l)[2], float sc, float out_scale, u32 sQ,
                                           int lane) {
  constexpr int D = C::HEAD;
  float inv[2];
  const float m2[2] = {m[0] * sc, m[1] * sc};
  finish_warp_rows(it, first, m2, l, P.sinks, P.lse, P.num_q_heads, inv, lane);
  inv[0] *= out_scale;
  inv[1] *= out_scale;
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const u32 at = sQ + swizzled<C::BLOCK_M, C::SW>(first + lane / 4 + 8 * hr, i) + 4 * (lane % 4);
      const u32 x = pack2<T>(o[4 * i + 2 * hr] * inv[hr], o[4 * i + 2 * hr + 1] * inv[hr]);
      asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(at), "r"(x) : "memory");
    }
  __syncwarp();
#pragma unroll
  for (int idx = lane; idx < 16 * C::CH; idx += 32) {
    const int r = first + idx / C::CH, c = idx % C::CH;
    if (r < it.rows) {
      uint4 x;
      asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w) : "r"(sQ + swizzled<C::BLOCK_M, C::SW>(r, c)) : "memory");
      *reinterpret_cast<uint4*>(P.out + (it.token_row(r) * P.num_q_heads + it.head(r)) * D + c * 8) = x;
    }
  }
}

// K/V tiles in flight: tile n sits in buffer stage (n_last - n) % STAGES; blk holds the
// block-table entries of the next tile to issue (looked up one tile ahead). From an fp8
// cache tile n - 1 streams into the staging instead and `land` widens it into its buffer
// during tile n's math.
template <typename T, typename KV, typename C>
struct Pipe {
  using Src = KVRows<T, KV, C, C::KEYS, C::TRANSPOSED_V>;
  static constexpr int BN = C::KEYS, STAGES = C::BUFFERS;
  Src src;
  int n_first;
  u32 sKV;
  int blk[Src::RPT + C::TRANSPOSED_V];

  __device__ __forceinline__ u32 k_tile(int stage) const { return sKV + 2 * stage * C::KV_BYTES; }
  __device__ __forceinline__ u32 v_tile(int stage) const { return k_tile(stage) + C::KV_BYTES; }
  __device__ __forceinline__ static int next_stage(int stage) { return stage + 1 == STAGES ? 0 : stage + 1; }
  // Tile n (in `stage`) becomes visible to wgmma, and every warpgroup is done with the next
  // buffer (its last reader, a wgmma batch, is waited for before this barrier); tile n - 1
  // starts streaming into that buffer (or the fp8 staging) and tile n - 2's table entries
  // are read.
  template <typename Prob>
  __device__ __forceinline__ void advance(const Prob& P, int n, int stage) {
    cp_async_wait_all();
    fence_proxy_async();
    __syncthreads();
    if (n > n_first) {
      const int next = next_stage(stage);
      src.issue(P, (n - 1) * BN, blk, k_tile(next), v_tile(next));
      if (n - 1 > n_first) src.lookup(P, (n - 2) * BN, blk);
    }
    cp_async_commit();
  }
  // fp8: tile n - 1 (issued by advance(n)) widened from the staging into the next buffer,
  // while this warpgroup's wgmma batches run; the fence and barrier of advance(n - 1)
  // order the widened tile for wgmma. Nothing for a 16-bit cache.
  template <typename Prob>
  __device__ __forceinline__ void land(const Prob& P, int n, int stage) const {
    if constexpr (Src::F::FP8) {
      if (n > n_first) {
        const int next = next_stage(stage);
        cp_async_wait_all();
        src.land(P, k_tile(next), v_tile(next));
      }
    }
  }
};

// The thread's two rows: the warpgroup's key ranges, each row's visible keys [lo, hi), and
// for the general score path each row's position p and ALiBi slope in log2 units (0: none)
// with the score epilogue (score.cuh); sc: the factor taking s to log2 units in the softmax
// (sm_scale * log2(e) for raw dots, 1 for general scores, already in log2 units).
struct Rows {
  RowKeys gk;
  int lo[2], hi[2], p[2];
  float slope[2];
  ScoreEpilogue epi;
  float sc;
  int lane;

  // The rows of warpgroup g's warp `warp`: tile rows 64 g + 16 warp + lane / 4 (+ 8) (no
  // row: sees nothing); sm: the score scale.
  template <typename C, typename Prob>
  __device__ __forceinline__ void init(const Prob& P, const WorkItem& it, int g, int warp, int lane_, float sm) {
    gk.init(it, 64 * g, 64, P.window_left, P.causal);
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = 64 * g + 16 * warp + lane_ / 4 + 8 * hr;
      const bool valid = r < it.rows;
      p[hr] = valid ? it.position(r) : 0;
      lo[hr] = valid ? visible_lo(p[hr], P.window_left) : 0;
      hi[hr] = valid ? visible_hi(p[hr], it.kv_len, P.causal) : 0;
      slope[hr] = valid && P.alibi != nullptr ? __ldg(P.alibi + it.head(r)) * LOG2E : 0.f;
    }
    epi.init(sm, P.soft_cap);
    sc = C::GENERAL_SCORES ? 1.f : sm * LOG2E;
    lane = lane_;
  }
  // raw dots of tile j0 -> scores in log2 units (general path), keys the rows do not see -> -inf
  template <typename C>
  __device__ __forceinline__ void scores(float (&s)[C::KEYS / 2], int j0) const {
    epilogue<C>(s, j0);
    if (gk.needs_mask(j0, C::KEYS)) mask<C::KEYS>(s, lo, hi, j0, lane);
  }
  // general path: raw dots of the keys j0 + 8 i + 2 (lane % 4) + (e & 1) -> scores in log2
  // units (score epilogue, ALiBi); nothing on the plain path
  template <typename C>
  __device__ __forceinline__ void epilogue(float (&s)[C::KEYS / 2], int j0) const {
    constexpr int BN = C::KEYS;
    if constexpr (C::GENERAL_SCORES) {
      // The ALiBi term slope * (j - p) of key j = j0 + 2 (lane % 4) + 8 i + (e & 1) as
      // base + slope * (8 i + (e & 1)): one int-to-float conversion a row and tile (a
      // conversion runs at the rate of an exp2, and the softmax's exp2 keeps that unit
      // busy), a compile-time constant per score; the soft-cap tested once.
      float base[2];
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) base[hr] = slope[hr] * (float)(j0 + 2 * (lane % 4) - p[hr]);
      if (epi.softcap) general<true, BN>(s, base);
      else general<false, BN>(s, base);
    }
  }
  template <bool CAP, int BN>
  __device__ __forceinline__ void general(float (&s)[BN / 2], const float (&base)[2]) const {
#pragma unroll
    for (int i = 0; i < BN / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        s[4 * i + e] = epi.at<CAP, true>(s[4 * i + e]) + fmaf(slope[e / 2], (float)(8 * i + (e & 1)), base[e / 2]);
  }
};

// STAGES 2: per tile, S = Q K^T, softmax, O += P V, each wgmma batch waited for at once
// (from an fp8 cache the P V batch once the next tile is widened); a warpgroup none of
// whose rows sees a key of the tile skips it.
template <typename T, typename C, typename Pp, typename Prob>
__device__ __forceinline__ void loop_simple(const Prob& P, Pp& pipe, const Rows& rw, u32 sQg, int n_last,
                                            float (&o)[C::HEAD / 2], float (&m)[2], float (&l)[2]) {
  constexpr int D = C::HEAD, BN = C::KEYS, STAGES = C::BUFFERS;
  for (int n = n_last, stage = 0; n >= pipe.n_first; --n, stage = stage + 1 == STAGES ? 0 : stage + 1) {
    pipe.advance(P, n, stage);
    const bool sees = rw.gk.sees(n * BN, BN);  // uniform over the warpgroup
    if (sees) {
      float s[BN / 2], alpha[2];
      u32 pf[BN / 16][4];
      qk<T, C>(s, sQg, pipe.k_tile(stage));
      wgmma_wait<0>();
      fence_operands(s);
      rw.template scores<C>(s, n * BN);
      softmax<T, BN>(s, m, l, pf, alpha, rw.sc);
      rescale<D>(o, alpha);
      pv<T, C>(o, pf, pipe.v_tile(stage));
      pipe.land(P, n, stage);  // fp8: the next tile widened while P V runs
      drain<D>(o, pf);
    } else {
      pipe.land(P, n, stage);
    }
  }
}

// STAGES 3 (FA3's intra-warpgroup overlap): the P V batch of tile n + 1 is issued right
// after S = Q K^T of tile n and runs during the softmax of tile n (its V keeps the third
// buffer); the accumulators are rescaled once it is done. Every warpgroup computes every
// tile (masked where its rows see nothing): wgmma waits outside divergent code keep ptxas
// from serialising the batches.
template <typename T, typename C, typename Pp, typename Prob>
__device__ __forceinline__ void loop_overlap(const Prob& P, Pp& pipe, const Rows& rw, u32 sQg, int n_last,
                                             float (&o)[C::HEAD / 2], float (&m)[2], float (&l)[2]) {
  constexpr int D = C::HEAD, BN = C::KEYS, STAGES = C::BUFFERS;
  if (n_last < pipe.n_first) return;
  float s[BN / 2], alpha[2];
  u32 pf[BN / 16][4];
  pipe.advance(P, n_last, 0);
  qk<T, C>(s, sQg, pipe.k_tile(0));
  wgmma_wait<0>();
  fence_operands(s);
  rw.template scores<C>(s, n_last * BN);
  softmax<T, BN>(s, m, l, pf, alpha, rw.sc);  // o is still 0: nothing to rescale
  pipe.land(P, n_last, 0);                    // fp8: tile n_last - 1 widened
  int prev = 0;                               // buffer of the tile whose P is in pf
  for (int n = n_last - 1; n >= pipe.n_first; --n) {
    const int stage = prev + 1 == STAGES ? 0 : prev + 1;
    pipe.advance(P, n, stage);
    qk<T, C>(s, sQg, pipe.k_tile(stage));
    pv<T, C>(o, pf, pipe.v_tile(prev));
    wgmma_wait<1>();  // S of tile n done; P V of tile n + 1 may still run
    fence_operands(s);
    rw.template scores<C>(s, n * BN);
    u32 pn[BN / 16][4];
    softmax<T, BN>(s, m, l, pn, alpha, rw.sc);
    drain<D>(o, pf);
    rescale<D>(o, alpha);
    pipe.land(P, n, stage);  // fp8: tile n - 1 widened
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
      for (int x = 0; x < 4; ++x) pf[kk][x] = pn[kk][x];
    prev = stage;
  }
  pv<T, C>(o, pf, pipe.v_tile(prev));
  drain<D>(o, pf);
}

template <typename T, typename KV, typename C>
__device__ __forceinline__ void prefill_wgmma(const Problem<T, KV>& P) {
  constexpr int D = C::HEAD, BN = C::KEYS;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const u32 sQ = (smem_addr(smem_raw) + 1023) & ~1023u;
  const u32 sKV = sQ + C::Q_BYTES;  // stage s: K at sKV + 2 s KV_BYTES, V right after
  const u32 sS = sKV + 2 * C::BUFFERS * C::KV_BYTES;  // fp8: the staging of the tile in flight
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;

  WorkItem it;
  it.init(P, P.work[blockIdx.x], C::BLOCK_M);
  const int bs = P.block_size;
  using Pp = Pipe<T, KV, C>;
  constexpr bool FP8 = Pp::Src::F::FP8;
  const typename Pp::Src src{P.k + it.hk * P.k_head + it.kv_start * P.k_tok,
                             P.v + it.hk * P.v_head + it.kv_start * P.v_tok, it.table, it.kv_len,
                             (bs & (bs - 1)) == 0 ? __ffs(bs) - 1 : -1, sS};
  Rows rows;
  // the kv head's k_scale joins the score scale (s = sm_scale * q . (k_scale * code))
  const float sm = P.sm_scale * kv_scale(P.k_scale, P.k_scale_stride, P.k_scale_value, it.hk);
  rows.init<C>(P, it, wg, warp, lane, sm);

  // key tiles n_first .. n_last hold every key a row of the CTA sees
  const int j_begin = visible_lo(it.position(0), P.window_left);
  const int j_end = visible_hi(it.position(it.rows - 1), it.kv_len, P.causal);
  const int n_first = j_begin / BN;
  const int n_last = j_end > j_begin ? (j_end - 1) / BN : n_first - 1;

  Pp pipe{src, n_first, sKV};
  load_q<T, D, C>(P, it, sQ);  // with tile n_last (stage 0), in the first batch of copies
  if (n_last >= n_first) {
    src.lookup(P, n_last * BN, pipe.blk);
    src.issue(P, n_last * BN, pipe.blk, sKV, sKV + C::KV_BYTES);
    if (n_last > n_first) src.lookup(P, (n_last - 1) * BN, pipe.blk);
  }
  cp_async_commit();
  if constexpr (FP8) {
    cp_async_wait_all();
    if (n_last >= n_first) src.land(P, sKV, sKV + C::KV_BYTES);
  }

  float o[D / 2], m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  const u32 sQg = sQ + wg * 64 * C::SW;  // the warpgroup's 64 rows of each column block
  if constexpr (C::OVERLAP) loop_overlap<T, C>(P, pipe, rows, sQg, n_last, o, m, l);
  else loop_simple<T, C>(P, pipe, rows, sQg, n_last, o, m, l);

  cp_async_wait_all();
  __syncthreads();  // every wgmma done reading sQ; Q's own copy landed
  const float vs = kv_scale(P.v_scale, P.v_scale_stride, P.v_scale_value, it.hk);
  store_rows<T, C>(P, it, 64 * wg + 16 * warp, o, m, l, rows.sc, vs, sQ, lane);
}


// ------------------------------------------------------------ warp-specialised (prefill_ws)
// Warpgroup 0 produces, warpgroups 1 and 2 consume (WS_THREADS threads, from
// cupaged.prefill.plan; the producer's
// register budget PRODUCER_REGS, the consumers' the rest, set by setmaxnreg). The
// producer's 128 threads copy Q and the K/V tiles with cp.async (KVRows of 128 loaders)
// into STAGES K and STAGES V buffers; the consumers run the wgmma loop of loop_overlap on them. They meet only at
// mbarriers: no CTA barrier per tile.
// TMA (ragged K/V and NHD / HND caches, head sizes 64 and 128: rows of whole 128-byte
// column blocks): the 128 threads copy Q with cp.async as before, then warp 0 issues each
// K and V tile as tensor copies (ws_produce_tma) that land in the same swizzled layout.
// From an fp8 cache (NHD / HND, the same head sizes) warp 0's tensor copies bring the codes
// into staging slots and the producer's four warps widen them into the 16-bit tiles
// (ws_produce_fp8), so that the consumers' loop is the one of 16-bit caches.
// The consumers' budget beside a producer budget of PRODUCER_REGS, in setmaxnreg's
// multiples of 8. setmaxnreg moves registers within the CTA's allocation at launch (each
// thread's WS_ENTRY_REGS, the 64K register file over WS_THREADS rounded down to a multiple
// of 8), not the whole register file: an increase past what the producer's decrease freed
// waits forever.
constexpr int WS_ENTRY_REGS = (65536 / WS_THREADS) & ~7;
__host__ __device__ constexpr int ws_consumer_regs(int producer_regs) {
  return ((3 * WS_ENTRY_REGS - producer_regs) / 2) & ~7;
}
static_assert(WS_THREADS == 3 * 128, "one producer and two consumer warpgroups");

// The mbarriers (8 bytes each, after the tiles): Q landed; per stage s, its K and its V tile
// landed (full: an arrival from each producer thread as its copies land; TMA: one arrival
// announcing the tile's bytes, the phase completing as they land; fp8 TMA: an arrival from
// each widening thread once its part of the tile is widened) and read (empty:
// an arrival from each consumer thread once its wgmma batch reading the tile is done; every
// thread arrives, as a branch while a batch is in flight makes ptxas serialise the batches). Tile i
// of an item (the i-th processed, key tile n_last - i) sits in stage i % STAGES as its use
// u = i / STAGES: the consumers wait for the full phase of parity u & 1, the producer, before
// use u > 0, for the empty phase of parity (u - 1) & 1. fp8 TMA: then per staging slot x
// (SLOTS of them, after the barriers of the stages) its codes landed (s_full) and widened
// (s_empty); part q of an item (the K part of tile i is q = 2 i, its V part 2 i + 1) sits
// in slot q % SLOTS as its use q / SLOTS, waited for by the same parities. META: arrivals
// a K tile's full phase takes besides its fillers' (sparse_sm90.cu: the tile's descriptor).
template <int STAGES, bool TMA = false, int SLOTS_ = 0, int META = 0>
struct WsBarriers {
  static constexpr int SLOTS = SLOTS_, WIDENERS = 128;  // fp8: the producer's warps widen the staged parts
  static constexpr int COUNT = 1 + 4 * STAGES + 2 * SLOTS, PRODUCERS = 128, CONSUMERS = 256;
  // arrivals that complete a full phase
  static constexpr int FILLERS = !TMA ? PRODUCERS : SLOTS > 0 ? WIDENERS : 1;
  u32 base;
  __device__ __forceinline__ u32 q() const { return base; }
  __device__ __forceinline__ u32 k_full(int s) const { return base + 8 * (1 + s); }
  __device__ __forceinline__ u32 v_full(int s) const { return base + 8 * (1 + STAGES + s); }
  __device__ __forceinline__ u32 k_empty(int s) const { return base + 8 * (1 + 2 * STAGES + s); }
  __device__ __forceinline__ u32 v_empty(int s) const { return base + 8 * (1 + 3 * STAGES + s); }
  // fp8 staging slot x: its codes landed (one arrival with the bytes), widened (WIDENERS)
  __device__ __forceinline__ u32 s_full(int x) const { return base + 8 * (1 + 4 * STAGES + x); }
  __device__ __forceinline__ u32 s_empty(int x) const { return base + 8 * (1 + 4 * STAGES + SLOTS + x); }
  __device__ __forceinline__ void init() const {
    mbar_init(q(), PRODUCERS);
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(k_full(s), FILLERS + META);
      mbar_init(v_full(s), FILLERS);
      mbar_init(k_empty(s), CONSUMERS);
      mbar_init(v_empty(s), CONSUMERS);
    }
#pragma unroll
    for (int x = 0; x < SLOTS; ++x) {
      mbar_init(s_full(x), 1);
      mbar_init(s_empty(x), WIDENERS);
    }
    fence_mbar_init();
  }
};

// The consumers take turns at issuing their wgmma batches (FA3's ping-pong): consumer g
// waits for its turn at named barrier 1 + g and passes it at 2 - g, so that one's softmax
// runs while the tensor cores do the other's batches.
struct Turns {
  int g;
  __device__ __forceinline__ void wait() const { bar_sync(1 + g, 256); }
  __device__ __forceinline__ void pass() const { bar_arrive(2 - g, 256); }
};

// Producer: Q, then per tile its K and its V part, each once the consumers are done with the
// stage's previous tile.
// TMA producer: Q as ws_produce, then each tile's K and V part as tensor copies of boxes of
// 64 dims (the column blocks of swizzled<BN, 128>) x `rows` keys, announced on the part's
// full barrier by thread 0 first. The maps (cupaged.core.tma) are 4-d over (dim, key in
// block, kv head, block): ragged K/V is one block of total_k keys and a tile one box at
// the sequence's first key plus the tile's; a paged cache (NHD or HND) gives each cache
// block's part of a tile (rows = min(block_size, BN) keys, block sizes of whole 8-row
// swizzle atoms) its box, issued by lane p of warp 0 for part p from its block-table entry.
// The tile holding the sequence's last key (the first processed) is copied by the 128
// threads with cp.async instead when it runs past kv_len, so that its rows past kv_len
// land as zeros, as in ws_produce: a tensor copy would bring the next sequence's rows, a
// cache block's unwritten slots or whatever lies past the last sequence in the tensor, and
// a NaN or inf there would reach the output through P V (0 * inf is NaN). Each thread holds
// that phase open until its copies land (cp_async_hold), and thread 0 makes the one arrival
// the phase expects once all 128 have (named barrier PRODUCER_BAR); warps 1-3 then fence
// their writes against the async proxy and stop, and warp 0, which issues the tensor
// copies, fences its own and waits for theirs before the buffer's next, tensor, copy.
constexpr int PRODUCER_BAR = 3;  // the producer warpgroup's named barrier (1, 2: Turns)

// The tensor copies of a K or V tile: ragged K/V one box of BN keys at the sequence's first
// key plus the tile's (block 0), a paged cache one box per cache block's part of the tile
// (rows = min(block_size, BN) keys), part p issued by lane p of warp 0 (issuer) from its
// block-table entry; a part past kv_len (the last tile's, fp8) takes the block of the last
// key, as its rows are masked where they are widened.
struct TmaParts {
  int rows;
  bool paged, issuer;
  template <int BN, typename Prob>
  __device__ __forceinline__ void init(const Prob& P, const WorkItem& it) {
    paged = it.table != nullptr;
    rows = paged ? min(P.block_size, BN) : BN;
    issuer = threadIdx.x < BN / rows;
  }
  // part `lane` of the tile at key j0: its box's key coordinate y and block blk
  template <typename Prob>
  __device__ __forceinline__ void at(const Prob& P, const WorkItem& it, int j0, int lane, int& y, int& blk) const {
    const int j = j0 + lane * rows;
    y = (int)it.kv_start + j;  // ragged: total_k fits an int (the host checks)
    blk = 0;
    if (paged && issuer) {
      y = j % P.block_size;
      blk = __ldg(it.table + min(j, it.kv_len - 1) / P.block_size);
    }
  }
};

template <typename T, typename C, typename Bar, typename Src, typename Prob>
__device__ __forceinline__ void ws_produce_tma(const Prob& P, const WorkItem& it, const Src& src,
                                               const TensorMap* k_map, const TensorMap* v_map,
                                               const Bar& bar, u32 sQ, u32 sKV, int n_first, int n_last) {
  constexpr int BN = C::KEYS, STAGES = C::BUFFERS, BLOCKS = C::HEAD / 64;
  static_assert(C::SW == 128 && C::HEAD % 64 == 0, "rows of whole 128-byte column blocks");
  load_q<T, C::HEAD, C>(P, it, sQ);
  cp_async_arrive(bar.q());
  const int lane = threadIdx.x % 32;
  const bool lead = threadIdx.x == 0;
  if (lead && n_last >= n_first) {
    prefetch_tensor_map(k_map);
    prefetch_tensor_map(v_map);
  }
  TmaParts parts;
  parts.template init<BN>(P, it);
  const int tiles = n_last - n_first + 1;
  const bool ragged_end = tiles > 0 && (n_last + 1) * BN > it.kv_len;  // tile n_last runs past kv_len
  if (ragged_end) {  // tile n_last, the first processed: stage 0, use 0
    const u32 sK = sKV;
    src.template issue_part<true>(P, n_last * BN, sK);
    cp_async_hold(bar.k_full(0));
    src.template issue_part<false>(P, n_last * BN, sK + C::KV_BYTES);
    cp_async_hold(bar.v_full(0));
    bar_sync(PRODUCER_BAR, 128);  // every hold counted before the arrival
    if (lead) {
      mbar_arrive(bar.k_full(0));
      mbar_arrive(bar.v_full(0));
    }
  }
  if (threadIdx.x >= 32) {  // warps 1-3 are done once their copies are fenced for stage 0's reuse
    cp_async_wait_all();
    if (ragged_end && tiles > STAGES) {
      fence_proxy_async();
      bar_arrive(PRODUCER_BAR, 128);
    }
    return;
  }
  for (int n = n_last - ragged_end, i = ragged_end; n >= n_first; --n, ++i) {
    const int st = i % STAGES, u = i / STAGES;
    const u32 sK = sKV + 2 * st * C::KV_BYTES, sV = sK + C::KV_BYTES;
    int y, blk;
    parts.at(P, it, n * BN, lane, y, blk);
    const u32 dst = lane * parts.rows * 128;
    if (lead && u > 0) mbar_wait(bar.k_empty(st), (u - 1) & 1);  // one waiter, the warp after it
    __syncwarp();
    if (i == STAGES && ragged_end) {  // stage 0's next copy is a tensor copy
      cp_async_wait_all();
      fence_proxy_async();
      bar_sync(PRODUCER_BAR, 128);  // with warps 1-3's arrivals after their fences
    }
    if (lead) mbar_arrive_expect_tx(bar.k_full(st), C::KV_BYTES);
    __syncwarp();
    if (parts.issuer) {
#pragma unroll
      for (int b = 0; b < BLOCKS; ++b)
        tma_load_4d(sK + b * BN * 128 + dst, k_map, 64 * b, y, it.hk, blk, bar.k_full(st));
    }
    if (lead) {
      if (u > 0) mbar_wait(bar.v_empty(st), (u - 1) & 1);
      mbar_arrive_expect_tx(bar.v_full(st), C::KV_BYTES);
    }
    __syncwarp();
    if (parts.issuer) {
#pragma unroll
      for (int b = 0; b < BLOCKS; ++b)
        tma_load_4d(sV + b * BN * 128 + dst, v_map, 64 * b, y, it.hk, blk, bar.v_full(st));
    }
  }
  cp_async_wait_all();
}

// fp8 TMA producer: Q as ws_produce; then warp 0 brings each tile's K and then its V part
// (parts 2 i and 2 i + 1 of tile i) as tensor copies of the codes (TmaParts' boxes of D
// bytes x rows keys, unswizzled: row r of a part at r * D bytes) into staging slot
// q % SLOTS, the first SLOTS parts at once and part q + SLOTS once part q is widened,
// announcing its bytes on the slot's full barrier. All four warps (WIDENERS threads) widen
// each landed part, 16-code chunk by chunk, into the stage's 16-bit tile in the swizzled
// layout the 16-bit tensor copies give (swizzled<BN, 128>, KVRows::land's chunk order),
// once the consumers are done with the stage's previous tile. Rows past kv_len (the last
// tile's: the next sequence's rows, a cache block's unwritten slots, zeros past the tensor)
// become zeros there, so that no NaN or inf code reaches P V. Each widening thread fences
// its writes against the async proxy (wgmma reads them) and arrives on the stage's full
// barrier and the slot's empty one; warp 0 then waits for that empty phase (every warp's
// part q widened) before it copies part q + SLOTS into the slot.
template <typename T, typename KV, typename C, typename Bar, typename Prob>
__device__ __forceinline__ void ws_produce_fp8(const Prob& P, const WorkItem& it, const TensorMap* k_map,
                                               const TensorMap* v_map, const Bar& bar, u32 sQ, u32 sKV,
                                               u32 sS, int n_first, int n_last) {
  constexpr int BN = C::KEYS, D = C::HEAD, STAGES = C::BUFFERS, SLOTS = Bar::SLOTS;
  constexpr int CR = D / 16;       // 16-code chunks per row
  constexpr u32 PART = BN * D;     // bytes of a part's codes
  static_assert(SLOTS >= 2 && C::SW == 128 && D % 64 == 0, "a slot per K and V part, rows of whole 128-byte blocks");
  static_assert(Bar::WIDENERS == 128, "the producer warpgroup widens");
  using F = KVChunks<KV, D, BN, 128>;
  load_q<T, D, C>(P, it, sQ);
  cp_async_arrive(bar.q());
  const int parts = 2 * max(n_last - n_first + 1, 0);
  const int lane = threadIdx.x % 32;
  const bool copier = threadIdx.x < 32, lead = threadIdx.x == 0;
  TmaParts boxes;
  boxes.template init<BN>(P, it);
  // part p's codes into its slot (warp 0; the slot's previous part is widened), lane's box
  // at key y of block blk (TmaParts::at)
  auto copy = [&](int p, int y, int blk) {
    const int x = p % SLOTS;
    if (lead) mbar_arrive_expect_tx(bar.s_full(x), PART);
    __syncwarp();
    if (boxes.issuer)
      tma_load_4d(sS + x * PART + lane * boxes.rows * D, p & 1 ? v_map : k_map, 0, y, it.hk, blk, bar.s_full(x));
  };
  if (copier) {
    if (lead && parts > 0) {
      prefetch_tensor_map(k_map);
      prefetch_tensor_map(v_map);
    }
    for (int p = 0; p < min(parts, SLOTS); ++p) {
      int y, blk;
      boxes.at(P, it, (n_last - p / 2) * BN, lane, y, blk);
      copy(p, y, blk);
    }
  }
  for (int q = 0; q < parts; ++q) {
    const int x = q % SLOTS, i = q / 2, st = i % STAGES, u = i / STAGES, j0 = (n_last - i) * BN;
    const bool vp = q & 1;
    const u32 from = sS + x * PART, to = sKV + (2 * st + vp) * C::KV_BYTES;
    mbar_wait(bar.s_full(x), (q / SLOTS) & 1);
    if (u > 0) mbar_wait(vp ? bar.v_empty(st) : bar.k_empty(st), (u - 1) & 1);
#pragma unroll 2
    for (int idx = threadIdx.x; idx < BN * CR; idx += Bar::WIDENERS) {
      const int r = idx / CR, c = idx % CR;
      widen_chunk_shared<T, KV>(from + r * D + 16 * c, to + swizzled<BN, 128>(r, 2 * c),
                                to + swizzled<BN, 128>(r, 2 * c + 1), F::hi_first(c), j0 + r < it.kv_len);
    }
    fence_proxy_async();
    mbar_arrive(vp ? bar.v_full(st) : bar.k_full(st));
    mbar_arrive(bar.s_empty(x));
    if (copier && q + SLOTS < parts) {
      int y, blk;  // the block id's load under the wait
      boxes.at(P, it, (n_last - (q + SLOTS) / 2) * BN, lane, y, blk);
      if (lead) mbar_wait(bar.s_empty(x), (q / SLOTS) & 1);  // one waiter, the warp after it
      __syncwarp();
      copy(q + SLOTS, y, blk);
    }
  }
  cp_async_wait_all();
}

template <typename T, typename KV, typename C, typename Src, typename Prob>
__device__ __forceinline__ void ws_produce(const Prob& P, const WorkItem& it, const Src& src,
                                           const WsBarriers<C::BUFFERS>& bar, u32 sQ, u32 sKV, int n_first,
                                           int n_last) {
  constexpr int BN = C::KEYS, STAGES = C::BUFFERS;
  load_q<T, C::HEAD, C>(P, it, sQ);
  cp_async_arrive(bar.q());
  for (int n = n_last, i = 0; n >= n_first; --n, ++i) {
    const int st = i % STAGES, u = i / STAGES;
    const u32 sK = sKV + 2 * st * C::KV_BYTES;
    if (u > 0) mbar_wait(bar.k_empty(st), (u - 1) & 1);
    src.template issue_part<true>(P, n * BN, sK);
    cp_async_arrive(bar.k_full(st));
    if (u > 0) mbar_wait(bar.v_empty(st), (u - 1) & 1);
    src.template issue_part<false>(P, n * BN, sK + C::KV_BYTES);
    cp_async_arrive(bar.v_full(st));
  }
  cp_async_wait_all();
}

// Consumer g (rows 64 g .. 64 g + 63 of the tile): loop_overlap's order (S = Q K^T of tile
// i with O += P V of tile i - 1, the softmax of tile i under the P V batch), each batch pair
// issued in the warpgroup's turn; each stage released once the batch reading it is done.
template <typename T, typename C, typename Bar, typename Prob>
__device__ __forceinline__ void ws_consume(const Prob& P, const Rows& rw, const Bar& bar,
                                           const Turns& turn, u32 sQg, u32 sKV, int n_first, int n_last,
                                           float (&o)[C::HEAD / 2], float (&m)[2], float (&l)[2]) {
  constexpr int D = C::HEAD, BN = C::KEYS, STAGES = C::BUFFERS;
  mbar_wait(bar.q(), 0);  // also before an item without keys: the epilogue stages rows in sQ
  if (n_last < n_first) return;
  float s[BN / 2], alpha[2];
  u32 pf[BN / 16][4];
  mbar_wait(bar.k_full(0), 0);
  turn.wait();
  qk<T, C>(s, sQg, sKV);
  turn.pass();
  wgmma_wait<0>();
  fence_operands(s);
  mbar_arrive(bar.k_empty(0));
  rw.template scores<C>(s, n_last * BN);
  softmax<T, BN>(s, m, l, pf, alpha, rw.sc);  // o is still 0: nothing to rescale
  int i = 1;
  for (int n = n_last - 1; n >= n_first; --n, ++i) {
    const int sk = i % STAGES, sv = (i - 1) % STAGES;
    mbar_wait(bar.k_full(sk), (i / STAGES) & 1);
    mbar_wait(bar.v_full(sv), ((i - 1) / STAGES) & 1);
    turn.wait();
    qk<T, C>(s, sQg, sKV + 2 * sk * C::KV_BYTES);
    pv<T, C>(o, pf, sKV + (2 * sv + 1) * C::KV_BYTES);
    turn.pass();
    wgmma_wait<1>();  // S of tile i done; P V of tile i - 1 may still run
    fence_operands(s);
    mbar_arrive(bar.k_empty(sk));
    rw.template scores<C>(s, n * BN);
    u32 pn[BN / 16][4];
    softmax<T, BN>(s, m, l, pn, alpha, rw.sc);
    drain<D>(o, pf);
    mbar_arrive(bar.v_empty(sv));
    rescale<D>(o, alpha);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
      for (int x = 0; x < 4; ++x) pf[kk][x] = pn[kk][x];
  }
  const int sv = (i - 1) % STAGES;
  mbar_wait(bar.v_full(sv), ((i - 1) / STAGES) & 1);
  turn.wait();
  pv<T, C>(o, pf, sKV + (2 * sv + 1) * C::KV_BYTES);
  if (turn.g == 0) turn.pass();  // consumer 1's last turn is nobody's to wait for
  drain<D>(o, pf);
}

// TMA: the K/V tiles from the tensor maps k_map and v_map (ragged K/V, NHD and HND caches).
// SLOTS (TMA from an fp8 cache): the staging slots of ws_produce_fp8.
template <typename T, typename KV, typename C, int PRODUCER_REGS, bool TMA = false, int SLOTS = 0>
__device__ __forceinline__ void prefill_ws(const Problem<T, KV>& P, const TensorMap* k_map = nullptr,
                                           const TensorMap* v_map = nullptr) {
  constexpr bool FP8 = Fp8Traits<KV>::FP8;
  static_assert(!C::TRANSPOSED_V && FP8 == (TMA && SLOTS > 0),
                "V rows; fp8 caches by TMA with staging slots, 16-bit caches without (else prefill_wgmma)");
  constexpr int BN = C::KEYS;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const u32 sQ = (smem_addr(smem_raw) + 1023) & ~1023u;
  const u32 sKV = sQ + C::Q_BYTES;  // stage s: K at sKV + 2 s KV_BYTES, V right after
  const u32 sS = sKV + 2 * C::BUFFERS * C::KV_BYTES;  // fp8: SLOTS slots of BN x D codes
  using Bar = WsBarriers<C::BUFFERS, TMA, SLOTS>;
  const Bar bar{sS + SLOTS * BN * C::HEAD};
  const int wg = threadIdx.x / 128, lane = threadIdx.x % 32;

  WorkItem it;
  it.init(P, P.work[blockIdx.x], C::BLOCK_M);
  // key tiles n_first .. n_last hold every key a row of the CTA sees
  const int j_begin = visible_lo(it.position(0), P.window_left);
  const int j_end = visible_hi(it.position(it.rows - 1), it.kv_len, P.causal);
  const int n_first = j_begin / BN;
  const int n_last = j_end > j_begin ? (j_end - 1) / BN : n_first - 1;
  if (threadIdx.x == 0) bar.init();
  __syncthreads();

  if (wg == 0) {
    static_assert(PRODUCER_REGS + 2 * ws_consumer_regs(PRODUCER_REGS) <= 3 * WS_ENTRY_REGS,
                  "the consumers' increase fits in what the producer's decrease frees");
    setmaxnreg_dec<PRODUCER_REGS>();
    if constexpr (FP8) {
      ws_produce_fp8<T, KV, C>(P, it, k_map, v_map, bar, sQ, sKV, sS, n_first, n_last);
    } else {
      const int bs = P.block_size;
      const KVRows<T, KV, C, BN, C::TRANSPOSED_V> src{P.k + it.hk * P.k_head + it.kv_start * P.k_tok,
                                                     P.v + it.hk * P.v_head + it.kv_start * P.v_tok, it.table,
                                                     it.kv_len, (bs & (bs - 1)) == 0 ? __ffs(bs) - 1 : -1, 0u};
      if constexpr (TMA) ws_produce_tma<T, C>(P, it, src, k_map, v_map, bar, sQ, sKV, n_first, n_last);
      else ws_produce<T, KV, C>(P, it, src, bar, sQ, sKV, n_first, n_last);
    }
  } else {
    setmaxnreg_inc<ws_consumer_regs(PRODUCER_REGS)>();
    const int g = wg - 1, warp = (threadIdx.x / 32) % 4;
    Rows rows;
    // the kv head's k_scale joins the score scale, its v_scale scales the output (as prefill_wgmma)
    rows.init<C>(P, it, g, warp, lane,
                 P.sm_scale * kv_scale(P.k_scale, P.k_scale_stride, P.k_scale_value, it.hk));
    float o[C::HEAD / 2], m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < C::HEAD / 2; ++i) o[i] = 0.f;
    const Turns turn{g};
    if (g == 1 && n_last >= n_first) turn.pass();  // consumer 0 takes the first turn
    ws_consume<T, C>(P, rows, bar, turn, sQ + g * 64 * C::SW, sKV, n_first, n_last, o, m, l);
    const float vs = kv_scale(P.v_scale, P.v_scale_stride, P.v_scale_value, it.hk);
    store_rows<T, C>(P, it, 64 * g + 16 * warp, o, m, l, rows.sc, vs, sQ, lane);
  }
}

}  // namespace sm90

// Grid: one CTA per work item (int4 {sequence, kv head, first packed row, 0}); block: 256
// threads = 2 warpgroups; dynamic smem: Config::SMEM bytes (Q [128][D], then STAGES pairs
// of K [BN][D] and V [BN][D] (V_T: V^T [D][BN]), all swizzled, 1024-byte aligned, then
// from an fp8 cache (KV) the staging of one tile).
// Warpgroup g owns tile rows 64 g .. 64 g + 63: per K/V tile it runs S = Q K^T and O += P V
// on wgmma with the online softmax between them (STAGES 3: P V of the previous tile
// overlapping it); each thread owns rows 16 w + lane / 4 (+ 8) of its warp w's 16. Every
// thread copies K/V chunks with cp.async one tile ahead (fp8: into its staging slots, widened
// into the tile's buffer during the math of the tile before) and finally normalises and stores
// its rows' fragments through its warp's rows of the Q tile (16-byte global stores).
// Arguments: one Problem (abi.cuh), as kernels_cu/prefill.cu's kernels.
template <typename T, typename KV, int D, int BN, int STAGES, bool V_T, bool GENERAL>
__global__ void __launch_bounds__(256, 1) prefill_wgmma_kernel(CUPAGED_PARAMS_Problem) {
  const Problem<T, KV> P{CUPAGED_FIELDS_Problem};
  if (item_is_padding(P)) return;
  sm90::prefill_wgmma<T, KV, sm90::Config<T, KV, D, BN, STAGES, V_T, GENERAL>>(P);
}

}  // namespace cupaged

namespace cupaged {
// Grid: one CTA per work item, as prefill_wgmma_kernel; block: WS_THREADS = 3 warpgroups
// (warpgroup 0 copies, 1 and 2 compute: prefill_ws); dynamic smem: Q [128][D], then
// STAGES K [BN][D] and V [BN][D] tiles, all swizzled, 1024-byte aligned, then the
// WsBarriers (prefill.plan.wgmma_smem_bytes). 16-bit caches with V rows (not the vllm value
// layout: its V^T copies need more producer registers than it can spare).
template <typename T, typename KV, int D, int BN, int STAGES, bool GENERAL, int PRODUCER_REGS>
__global__ void __launch_bounds__(sm90::WS_THREADS, 1) prefill_ws_kernel(CUPAGED_PARAMS_Problem) {
  const Problem<T, KV> P{CUPAGED_FIELDS_Problem};
  if (item_is_padding(P)) return;
  sm90::prefill_ws<T, KV, sm90::Config<T, KV, D, BN, STAGES, false, GENERAL, 128>, PRODUCER_REGS>(P);
}

// prefill_ws_kernel with the K/V tiles copied by TMA (grid and block alike): ragged K/V or
// NHD / HND caches of head size 64 or 128, k_map and v_map over them (cupaged.core.tma).
// 16-bit K/V (SLOTS 0) land in the tiles as they are; from an fp8 cache (KV) the codes land
// in SLOTS staging slots of [BN][D] bytes after the tiles (before the WsBarriers), which
// the producer's warps widen into the tiles (ws_produce_fp8).
// Arguments: Problem's fields, then the two tensor maps (ProblemTma, abi.cuh).
template <typename T, typename KV, int D, int BN, int STAGES, bool GENERAL, int PRODUCER_REGS, int SLOTS>
__global__ void __launch_bounds__(sm90::WS_THREADS, 1) prefill_ws_tma_kernel(CUPAGED_PARAMS_ProblemTma) {
  const Problem<T, KV> P{CUPAGED_FIELDS_Problem};
  if (item_is_padding(P)) return;
  sm90::prefill_ws<T, KV, sm90::Config<T, KV, D, BN, STAGES, false, GENERAL, 128>, PRODUCER_REGS, true, SLOTS>(
      P, &k_map, &v_map);
}
}  // namespace cupaged
