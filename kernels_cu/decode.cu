// Paged decode: one query token per sequence against a paged KV cache, split-KV + merge.
//
//   append_kv_kernel     writes k_new / v_new at position seq_lens[b] (in-place append)
//   paged_decode_kernel  persistent CTAs (column, kv head x head chunk): each streams the key
//                        tiles of its column's pieces (cuts of the sequences, by plan.cu)
//                        through one cp.async pipeline into shared memory and serves every
//                        query head of the kv head from them (K/V read once per group);
//                        split sequences leave fp32 partials, merged by the CTA finishing
//                        the last piece (fused) or by merge_pieces_kernel (merge.cu)
//   paged_decode_pages_kernel  sm_90, 16-bit or fp8 NHD/HND caches, up to 8 query heads:
//                        one CTA per SM and group of up to 8 kv heads copies whole blocks
//                        (the group's heads of their tokens; about 32 KB an operand a
//                        stage) with cp.async.bulk into a 3-stage ring on mbarriers; its
//                        8 warps split the heads and their tokens and compute straight
//                        from the unpadded rows (PageMath)
// Both decode kernels run one loop over a CTA's pieces (piece_loop), templated over where
// its tiles come from (StagedTiles: cp.async tiles; PageRing: the bulk-copied page ring).
//
// Caches hold elements of type KV: q's type T, or an fp8 format (fp8.cuh) with 16-bit q.
// fp8 tiles are copied as they are (a 16-byte chunk holds 16 elements: half the bytes of a
// 16-bit tile) and widened to T in registers as the products read them (PageMath); the
// kv head's k_scale multiplies the score scale and its v_scale the output, in fp32.
//
// Why tensor cores: per token and kv head decode reads 4*D bytes of 16-bit K/V and does
// 4*G*D flops (q.k and p.v for the G = Hq/Hk query heads sharing them): G flops per byte.
// At a DRAM rate of R bytes/s that is G*R flop/s, which passes a current GPU's fp32 FMA peak
// from G = 4 (less still after bf16 unpacking and shared-memory reads; docs/decode.md).
// mma.sync m16n8k16 (an order of magnitude more) keeps every group size memory-bound, and padding
// the group to the 8 columns of N wastes nothing that matters. So the 16-bit path puts tokens
// on M and the head group on N: S^T = K Q^T, then O^T = V^T P^T, where P^T reaches the B
// layout from the S^T accumulators by one movmatrix.trans per 8x8 (no shared memory round
// trip). fp32 caches (tests) take a CUDA-core path with the same fragment layouts.
//
// Fragment layouts in a warp (qr = lane / 4, r = lane % 4):
//   s[nt][k]       score of token qr + 8 * (k >> 1) of a 16-token m-tile, head nt*8 + 2r + (k&1)
//   acc[dt][nt][k] output dim dt*16 + qr + 8 * (k >> 1), head nt*8 + 2r + (k & 1)
#include "common.cuh"
#include "abi.cuh"
#include "mma.cuh"
#include "merge.cuh"
#include "score.cuh"
#include "bulk_copy.cuh"
#include "fp8.cuh"

namespace cupaged {
namespace decode {

typedef unsigned long long u64;

// The kernels' constants come from cupaged.decode_plan (abi.cuh, namespace decode):
// NTHREADS (NWARPS warps) a staged CTA, STAGES K/V tiles in flight (STAGES - 1 while one is
// consumed), DESC_INTS ints a piece descriptor, PAGE_WARPS (PAGE_THREADS) a pages CTA,
// PAGE_STAGES its ring, and stage_tile(row bytes), the tokens of a staged tile.

// Compile-time geometry of one (cache element type, head dim, n8 head tiles per warp); the
// host side is decode_plan.tile_config. NT = 2 (16 heads a warp) serves large groups on
// 16-bit caches.
template <typename T, int D, int NT_ = 1>
struct Cfg {
  static constexpr int VEC = 16 / sizeof(T);  // elements per 16-byte chunk
  static constexpr int CPR = D / VEC;         // chunks per K/V row
  static constexpr int ROW_BYTES = D * (int)sizeof(T);
  static constexpr int TILE = stage_tile(ROW_BYTES);  // tokens a stage
  static constexpr int MTILES = TILE / 16;
  static constexpr int NT = NT_;              // n8 head tiles per warp
  static constexpr int HW = 8 * NT;            // query heads per warp
  static constexpr int DT = D / 16;
  static constexpr int KROW = D + stage_row_pad((int)sizeof(T), D);  // padded smem row
  static constexpr int VTROW = TILE + VEC;     // padded row of a transposed (vllm) V tile
  static constexpr int GPT = TILE / VEC;       // 16-byte token groups per transposed V row
  static constexpr int ITEMS = TILE * CPR / NTHREADS;  // 16-byte chunks per thread, tile, operand
  static constexpr int QROW = D + 4;           // fp32 path: q rows staged in shared memory
  static_assert(TILE * CPR % NTHREADS == 0, "a tile's chunks must split evenly over the CTA");
  static_assert(NTHREADS % GPT == 0, "a thread keeps one token group of a transposed V tile");
  static constexpr int K_ELEMS = TILE * KROW;
  static constexpr int V_ELEMS_ROWS = TILE * KROW;  // V tile [TILE][KROW]
  static constexpr int V_ELEMS_T = D * VTROW;       // transposed V tile [D][VTROW]
};

__device__ __forceinline__ u32 movmatrix_trans(u32 x) {
  u32 y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

template <typename T> __device__ __forceinline__ u32 bits16(T x);
template <> __device__ __forceinline__ u32 bits16<__half>(__half x) { return __half_as_ushort(x); }
template <> __device__ __forceinline__ u32 bits16<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat16_as_ushort(x);
}

template <typename E> __device__ __forceinline__ E zero_of() {
  if constexpr (Fp8Traits<E>::FP8) return E{0};
  else return from_float<E>(0.f);
}

// ---------------------------------------------------------------------------- tile math
// 16-bit K/V: both products on tensor cores. Q^T stays in registers as B fragments.
template <typename T, int D, bool VT, int NT>
struct MmaMath {
  using C = Cfg<T, D, NT>;
  static constexpr int PERM = 0;  // accumulator dims in order
  u32 qf[C::DT][C::NT][2];

  // q_rows: this warp's first query head [heads][D] in global memory.
  __device__ void load_q(const T* __restrict__ q_rows, int heads, float*, int lane) {
    const int qr = lane >> 2, r = lane & 3;
#pragma unroll
    for (int ks = 0; ks < C::DT; ++ks)
#pragma unroll
      for (int nt = 0; nt < C::NT; ++nt) {
        const int g = nt * 8 + qr;
        const T* p = q_rows + (i64)g * D + ks * 16 + 2 * r;
        const bool ok = g < heads;
        qf[ks][nt][0] = ok ? bits16(p[0]) | (bits16(p[1]) << 16) : 0u;
        qf[ks][nt][1] = ok ? bits16(p[8]) | (bits16(p[9]) << 16) : 0u;
      }
  }

  // s = K Q^T for the 16 tokens of rows k_rows[0..16) of a K tile.
  __device__ void scores(const T* k_rows, float (&s)[C::NT][4], int nt_used, int lane) const {
#pragma unroll
    for (int nt = 0; nt < C::NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
    const T* a_row = k_rows + ldm_a_row(lane) * C::KROW + ldm_a_col(lane);
#pragma unroll
    for (int ks = 0; ks < C::DT; ++ks) {
      u32 a[4];
      ldmatrix_x4(a, a_row + ks * 16);
#pragma unroll
      for (int nt = 0; nt < C::NT; ++nt)
        if (nt < nt_used) mma_16816<T>(s[nt], a, qf[ks][nt][0], qf[ks][nt][1]);
    }
  }

  // acc += V^T P^T over tokens [row0, row0 + 16) of a V tile; p holds probabilities in s layout.
  __device__ void pv(const T* v_tile, int row0, const float (&p)[C::NT][4],
                     float (&acc)[C::DT][C::NT][4], int nt_used, int lane) const {
    u32 pb[C::NT][2];
#pragma unroll
    for (int nt = 0; nt < C::NT; ++nt) {
      pb[nt][0] = movmatrix_trans(pack2<T>(p[nt][0], p[nt][1]));  // tokens 0-7
      pb[nt][1] = movmatrix_trans(pack2<T>(p[nt][2], p[nt][3]));  // tokens 8-15
    }
#pragma unroll
    for (int dt = 0; dt < C::DT; ++dt) {
      u32 a[4];
      if (VT)  // smem [d][token]: V^T row-major already
        ldmatrix_x4(a, v_tile + (dt * 16 + ldm_a_row(lane)) * C::VTROW + row0 + ldm_a_col(lane));
      else     // smem [token][d]: transpose each 8x8 on load
        ldmatrix_x4_trans(a, v_tile + (row0 + (lane & 7) + (lane >> 4) * 8) * C::KROW + dt * 16 +
                                 ((lane >> 3) & 1) * 8);
#pragma unroll
      for (int nt = 0; nt < C::NT; ++nt)
        if (nt < nt_used) mma_16816<T>(acc[dt][nt], a, pb[nt][0], pb[nt][1]);
    }
  }
};

// fp32 K/V: CUDA-core dot products in the same fragment layouts; q staged in shared memory.
template <int D, bool VT, int NT>
struct SimtMath {
  using C = Cfg<float, D, NT>;
  static constexpr int PERM = 0;
  const float* qs;  // [HW][QROW]

  __device__ void load_q(const float* __restrict__ q_rows, int heads, float* q_smem, int lane) {
    for (int i = lane; i < C::HW * D; i += 32) {
      const int g = i / D, d = i - g * D;
      q_smem[g * C::QROW + d] = g < heads ? q_rows[i] : 0.f;
    }
    __syncwarp();
    qs = q_smem;
  }

  __device__ void scores(const float* k_rows, float (&s)[C::NT][4], int nt_used, int lane) const {
    const int qr = lane >> 2, r = lane & 3;
    const float* ka = k_rows + qr * C::KROW;
    const float* kb = ka + 8 * C::KROW;
#pragma unroll
    for (int nt = 0; nt < C::NT; ++nt) {
      float s00 = 0.f, s01 = 0.f, s10 = 0.f, s11 = 0.f;
      if (nt < nt_used) {
        const float* q0 = qs + (nt * 8 + 2 * r) * C::QROW;
        const float* q1 = q0 + C::QROW;
#pragma unroll 2
        for (int d = 0; d < D; d += 4) {
          const float4 x = *reinterpret_cast<const float4*>(ka + d);
          const float4 y = *reinterpret_cast<const float4*>(kb + d);
          const float4 u = *reinterpret_cast<const float4*>(q0 + d);
          const float4 w = *reinterpret_cast<const float4*>(q1 + d);
          s00 += x.x * u.x + x.y * u.y + x.z * u.z + x.w * u.w;
          s01 += x.x * w.x + x.y * w.y + x.z * w.z + x.w * w.w;
          s10 += y.x * u.x + y.y * u.y + y.z * u.z + y.w * u.w;
          s11 += y.x * w.x + y.y * w.y + y.z * w.z + y.w * w.w;
        }
      }
      s[nt][0] = s00; s[nt][1] = s01; s[nt][2] = s10; s[nt][3] = s11;
    }
  }

  __device__ void pv(const float* v_tile, int row0, const float (&p)[C::NT][4],
                     float (&acc)[C::DT][C::NT][4], int nt_used, int lane) const {
    const int qr = lane >> 2, r = lane & 3;
#pragma unroll
    for (int half = 0; half < 2; ++half)  // tokens 0-7 sit in p[.][0..1], tokens 8-15 in p[.][2..3]
#pragma unroll 1
      for (int t8 = 0; t8 < 8; ++t8) {
        const int t = row0 + half * 8 + t8;
        const int src = (t8 << 2) | r;  // the lane holding token t for this lane's heads
        float pt[C::NT][2];
#pragma unroll
        for (int nt = 0; nt < C::NT; ++nt) {
          pt[nt][0] = __shfl_sync(0xffffffffu, p[nt][half * 2], src);
          pt[nt][1] = __shfl_sync(0xffffffffu, p[nt][half * 2 + 1], src);
        }
#pragma unroll
        for (int dt = 0; dt < C::DT; ++dt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int d = dt * 16 + qr + 8 * h;
            const float v = VT ? v_tile[d * C::VTROW + t] : v_tile[t * C::KROW + d];
#pragma unroll
            for (int nt = 0; nt < C::NT; ++nt)
              if (nt < nt_used) {
                acc[dt][nt][2 * h] += pt[nt][0] * v;
                acc[dt][nt][2 * h + 1] += pt[nt][1] * v;
              }
          }
      }
  }
};


// ---------------------------------------------------------------------------- page math
// Fragments from unpadded rows (a block as the cache stores it, rows D elements apart or
// further): ldmatrix would hit one bank group with all 8 rows, so each lane reads 16-byte
// chunks of its own rows with ld.shared (CH = 16 / sizeof(KV) elements: 8 of a 16-bit
// cache, 16 of an fp8 one, converted to W = CH / 2 words of float16 pairs, MathWords) and the head
// dim is permuted inside the products so that the chunks are mma fragments as read (2-way
// bank conflicts instead of 8-way):
//   lane (qr, r) reads chunk j (dims 4CH j + CH r + [0, CH), words w0..w(W-1)) of rows qr,
//                qr + 8.
//   S^T = K Q^T  k-step (W / 2) j + u takes A = (w[2u] of rows qr, qr + 8; w[2u + 1] of
//                rows qr, qr + 8) and as B the same words of q's chunk j for head qr.
//   O^T = V^T P^T  word m of chunk j is the lane's share of an 8x8 block (tokens x dims
//                4CH j + CH (c >> 1) + 2m + (c & 1) at column c = 2r + e) in the
//                accumulator layout; movmatrix.trans makes it a V^T fragment. D-tile
//                (W / 2) j + p takes blocks m = 2p (rows 0-7) and 2p + 1 (rows 8-15): its
//                row g holds perm_dim<CH>(dt, g).
template <int CH>
__device__ __forceinline__ int perm_dim(int dt, int g) {
  constexpr int TILES = CH / 4;  // d-tiles a chunk round holds
  return 4 * CH * (dt / TILES) + CH * ((g & 7) >> 1) + 2 * (2 * (dt % TILES) + (g >> 3)) + (g & 1);
}

__device__ __forceinline__ void lds16(u32 (&w)[4], const void* p) {
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(smem_addr(p)));
}

// q of type T as words of M pairs (MathTypeOf<T, KV>: float16 for an fp8 cache). T == M:
// as read. bf16 q into float16 operands: each head's row times a power of two 2^e that
// puts its largest magnitude in [2^14, 2^15), inside float16's range, so that every element
// down to 2^-28 of it converts exactly (bf16 has 8 significant bits, float16's normals
// 11); scores() multiplies the dot products back by 2^-e (exact in fp32).
template <typename T, typename M> struct QWords;
template <typename T> struct QWords<T, T> {
  static constexpr bool SCALED = false;
  template <int N>
  __device__ static __forceinline__ void convert(u32 (&)[N], float (&unscale)[2], int) {
    unscale[0] = unscale[1] = 1.f;
  }
};
template <> struct QWords<__nv_bfloat16, __half> {
  static constexpr bool SCALED = true;
  // words: a lane's share of head qr's row (the same row on the 4 lanes of a quad);
  // unscale[j]: 2^-e of head 2r + j, the heads of the lane's scores.
  template <int N>
  __device__ static __forceinline__ void convert(u32 (&words)[N], float (&unscale)[2], int lane) {
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < N; ++i)
      amax = fmaxf(amax, fmaxf(fabsf(lo(words[i])), fabsf(hi(words[i]))));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    const int exponent = (int)(__float_as_uint(amax) >> 23) - 127;  // amax >= 0
    const int e = amax > 0.f ? min(max(14 - exponent, -126), 126) : 0;
    const float up = __uint_as_float((u32)(127 + e) << 23);
    const float down = __uint_as_float((u32)(127 - e) << 23);
#pragma unroll
    for (int i = 0; i < N; ++i) words[i] = pack2<__half>(lo(words[i]) * up, hi(words[i]) * up);
    unscale[0] = __shfl_sync(0xffffffffu, down, 8 * (lane & 3));      // head 2r's lanes
    unscale[1] = __shfl_sync(0xffffffffu, down, 8 * (lane & 3) + 4);  // head 2r + 1's
  }
  __device__ static __forceinline__ float lo(u32 w) { return __uint_as_float(w << 16); }
  __device__ static __forceinline__ float hi(u32 w) { return __uint_as_float(w & 0xFFFF0000u); }
};

template <typename T, typename KV, int D>
struct PageMath {
  using M = typename MathTypeOf<T, KV>::type;  // the products' operand type
  using Words = MathWords<KV>;
  using Q = QWords<T, M>;
  static constexpr int CH = 16 / sizeof(KV);  // dims a chunk holds
  static constexpr int W = Words::W;          // its words of M pairs
  static_assert(D % (4 * CH) == 0, "whole 16-byte chunks per lane");
  static constexpr int J = D / (4 * CH);      // chunks per lane and row
  u32 qf[J][W];
  float q_unscale[2];  // scores of heads 2r, 2r + 1 times these (QWords)

  // q_rows: the warp's first query head [heads][D] in global memory.
  __device__ void load_q(const T* __restrict__ q_rows, int heads, int lane) {
    const int qr = lane >> 2, r = lane & 3;
    u32 words[J * W];
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
      for (int i = 0; i < W / 4; ++i) {
        const uint4 w = qr < heads
            ? reinterpret_cast<const uint4*>(q_rows + qr * D + 4 * CH * j + CH * r)[i]
            : make_uint4(0, 0, 0, 0);
        u32* o = words + j * W + 4 * i;
        o[0] = w.x; o[1] = w.y; o[2] = w.z; o[3] = w.w;
      }
    Q::convert(words, q_unscale, lane);
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
      for (int i = 0; i < W; ++i) qf[j][i] = words[j * W + i];
  }

  // Chunk j of the lane's rows qr (lo) and qr + 8 (hi) of the 16 rows at `rows`, `stride`
  // elements apart, as stored (MathWords::pair makes words of M pairs of them).
  __device__ __forceinline__ void chunk(const KV* rows, int stride, int j, u32 (&lo)[4],
                                        u32 (&hi)[4], int lane) const {
    const KV* a = rows + (lane >> 2) * stride + CH * (lane & 3) + 4 * CH * j;
    lds16(lo, a);
    lds16(hi, a + 8 * stride);
  }

  // s = K Q^T for the 16 rows at k_rows.
  __device__ void scores(const KV* k_rows, int stride, float (&s)[1][4], int lane) const {
    s[0][0] = s[0][1] = s[0][2] = s[0][3] = 0.f;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      u32 lo[4], hi[4];
      chunk(k_rows, stride, j, lo, hi, lane);
#pragma unroll
      for (int u = 0; u < W / 2; ++u) {
        u32 f[4];  // words 2u, 2u + 1 of rows qr (f[0], f[2]) and qr + 8 (f[1], f[3])
        Words::pair(lo, u, f[0], f[2]);
        Words::pair(hi, u, f[1], f[3]);
        mma_16816<M>(s[0], f, qf[j][2 * u], qf[j][2 * u + 1]);
      }
    }
    if constexpr (Q::SCALED)
#pragma unroll
      for (int k = 0; k < 4; ++k) s[0][k] *= q_unscale[k & 1];
  }

  // acc += V^T P^T over the 16 rows at v_rows; p holds probabilities in the s layout.
  __device__ void pv(const KV* v_rows, int stride, const float (&p)[1][4],
                     float (&acc)[D / 16][1][4], int lane) const {
    const u32 pb0 = movmatrix_trans(pack2<M>(p[0][0], p[0][1]));  // tokens 0-7
    const u32 pb1 = movmatrix_trans(pack2<M>(p[0][2], p[0][3]));  // tokens 8-15
#pragma unroll
    for (int j = 0; j < J; ++j) {
      u32 lo[4], hi[4];
      chunk(v_rows, stride, j, lo, hi, lane);
#pragma unroll
      for (int q2 = 0; q2 < W / 2; ++q2) {
        u32 f[4];  // words 2q2, 2q2 + 1 of rows qr (f[0], f[1]) and qr + 8 (f[2], f[3])
        Words::pair(lo, q2, f[0], f[1]);
        Words::pair(hi, q2, f[2], f[3]);
#pragma unroll
        for (int i = 0; i < 4; ++i) f[i] = movmatrix_trans(f[i]);
        mma_16816<M>(acc[(W / 2) * j + q2][0], f, pb0, pb1);
      }
    }
  }
};

// fp8 K/V in staged tiles: K rows and V rows (KROW apart) through PageMath's chunks (its
// permuted head dims: PERM); a transposed vllm V tile ([D][VTROW], tokens contiguous) by
// pairs of codes, each lane's A fragments read directly (natural head dims). One head tile
// a warp (NT = 1).
template <typename T, typename KV, int D, bool VT, int NT>
struct Fp8Math {
  static_assert(NT == 1, "fp8 caches take one n8 head tile a warp");
  using C = Cfg<KV, D, NT>;
  using Chunks = PageMath<T, KV, D>;
  static constexpr int PERM = VT ? 0 : Chunks::CH;  // accumulator dims: natural or chunk-permuted
  Chunks chunks;

  __device__ void load_q(const T* __restrict__ q_rows, int heads, float*, int lane) {
    chunks.load_q(q_rows, heads, lane);
  }
  __device__ void scores(const KV* k_rows, float (&s)[NT][4], int, int lane) const {
    chunks.scores(k_rows, C::KROW, s, lane);
  }
  __device__ void pv(const KV* v_tile, int row0, const float (&p)[NT][4],
                     float (&acc)[C::DT][NT][4], int, int lane) const {
    if constexpr (VT) {
      using M = typename Chunks::M;
      const u32 pb0 = movmatrix_trans(pack2<M>(p[0][0], p[0][1]));  // tokens 0-7
      const u32 pb1 = movmatrix_trans(pack2<M>(p[0][2], p[0][3]));  // tokens 8-15
      const KV* lane_row = v_tile + (lane >> 2) * C::VTROW + row0 + 2 * (lane & 3);
#pragma unroll
      for (int dt = 0; dt < C::DT; ++dt) {
        const KV* a = lane_row + dt * 16 * C::VTROW;  // dim dt * 16 + qr, tokens 2r, 2r + 1
        const u32 f[4] = {fp8x2_to_half2<KV>(lds_pair(a)),
                          fp8x2_to_half2<KV>(lds_pair(a + 8 * C::VTROW)),
                          fp8x2_to_half2<KV>(lds_pair(a + 8)),
                          fp8x2_to_half2<KV>(lds_pair(a + 8 * C::VTROW + 8))};
        mma_16816<M>(acc[dt][0], f, pb0, pb1);
      }
    } else {
      chunks.pv(v_tile + row0 * C::KROW, C::KROW, p, acc, lane);
    }
  }
  __device__ static __forceinline__ u32 lds_pair(const KV* p) {
    return *reinterpret_cast<const unsigned short*>(p);
  }
};

template <typename T, typename KV, int D, bool VT, int NT> struct MathFor {
  using type = Fp8Math<T, KV, D, VT, NT>;
};
template <typename T, int D, bool VT, int NT> struct MathFor<T, T, D, VT, NT> {
  using type = MmaMath<T, D, VT, NT>;
};
template <int D, bool VT, int NT> struct MathFor<float, float, D, VT, NT> {
  using type = SimtMath<D, VT, NT>;
};

// ---------------------------------------------------------------------------- tile loader
// Cache strides in elements: element (block, head, token in block, dim) sits at
// block*block + head*head + token*tok + (dim / VEC)*chunk + (dim % VEC)*elem. Everything but
// block*block fits in 32 bits (the host checks a block's size); that product is 64-bit.
struct Strides {
  int block, head, tok, chunk, elem;
};

// One tile to load: tokens [tile*TILE, tile*TILE + TILE) of a sequence whose visible keys
// are [lo, kv_len) and whose block-table row is bt.
struct TileRef {
  const int* bt;
  int tile, lo, kv_len;
  __device__ __forceinline__ bool visible(int tok) const { return tok >= lo && tok < kv_len; }
};

// Gathers a tile of one kv head into shared memory with 16-byte cp.async; tokens outside
// [lo, kv_len) are zero-filled so that their (masked) scores and values stay finite. Block
// ids of a tile are fetched one pipeline step before its copies are issued, so the id
// loads' latency hides behind a tile's math; fetch and issue take the same TileRef.
template <typename T, int D, bool VT>  // T: the cache's element type
struct Loader {
  using C = Cfg<T, D>;
  struct Ids { int k[C::ITEMS]; int v; };

  const T* k_head;
  const T* v_head;
  Strides ks, vs;
  int block_size;
  unsigned magic;  // token / block_size == (token * magic) >> shift for tokens < 2^31
  int shift;
  int tid;
  bool vt_whole;   // block_size % VEC == 0: a 16-byte token group never straddles blocks

  __device__ __forceinline__ int block_of(int tok) const {
    return (int)(((u64)(unsigned)tok * magic) >> shift);
  }
  __device__ __forceinline__ int v_dim(int d) const {
    return (d / C::VEC) * vs.chunk + (d % C::VEC) * vs.elem;
  }
  __device__ __forceinline__ int vt_group_token(const TileRef& r) const {
    return r.tile * C::TILE + (tid % C::GPT) * C::VEC;
  }
  __device__ __forceinline__ bool vt_group_whole(const TileRef& r, int tok_g) const {
    return vt_whole && tok_g >= r.lo && tok_g + C::VEC <= r.kv_len;
  }
  __device__ __forceinline__ bool vt_group_empty(const TileRef& r, int tok_g) const {
    return tok_g + C::VEC <= r.lo || tok_g >= r.kv_len;
  }

  __device__ void fetch(const TileRef& r, Ids& ids) const {
#pragma unroll
    for (int i = 0; i < C::ITEMS; ++i) {
      const int tok = r.tile * C::TILE + (tid + i * NTHREADS) / C::CPR;
      ids.k[i] = r.visible(tok) ? __ldg(r.bt + block_of(tok)) : 0;
    }
    if (VT) {
      const int tok_g = vt_group_token(r);
      ids.v = vt_group_whole(r, tok_g) ? __ldg(r.bt + block_of(tok_g)) : 0;
    }
  }

  __device__ void issue(const TileRef& r, const Ids& ids, T* k_s, T* v_s) const {
#pragma unroll
    for (int i = 0; i < C::ITEMS; ++i) {
      const int idx = tid + i * NTHREADS;
      const int row = idx / C::CPR, c = idx % C::CPR;
      const int tok = r.tile * C::TILE + row;
      const bool ok = r.visible(tok);
      const int in = tok - block_of(tok) * block_size;
      const T* k_src = k_head + (i64)ids.k[i] * ks.block + (in * ks.tok + c * ks.chunk);
      cp_async16_line(k_s + row * C::KROW + c * C::VEC, ok ? k_src : k_head, ok ? 16 : 0);
      if (!VT) {
        const T* v_src = v_head + (i64)ids.k[i] * vs.block + (in * vs.tok + c * vs.chunk);
        cp_async16_line(v_s + row * C::KROW + c * C::VEC, ok ? v_src : v_head, ok ? 16 : 0);
      }
    }
    if (VT) issue_vt(r, ids.v, v_s);
  }

  // Transposed V tile [D][TILE] from the vllm value layout [.., D, block_size].
  __device__ void issue_vt(const TileRef& r, int blk_id, T* v_s) const {
    const int tok_g = vt_group_token(r);
    T* dst = v_s + (tid % C::GPT) * C::VEC;
    const bool whole = vt_group_whole(r, tok_g);
    if (whole || vt_group_empty(r, tok_g)) {
      const T* src = v_head + (i64)blk_id * vs.block + (tok_g - block_of(tok_g) * block_size) * vs.tok;
#pragma unroll
      for (int i = 0; i < C::ITEMS; ++i) {
        const int d = (tid + i * NTHREADS) / C::GPT;
        cp_async16_line(dst + d * C::VTROW, whole ? src + v_dim(d) : v_head, whole ? 16 : 0);
      }
      return;
    }
    // ragged group (edge of the visible range, or blocks not a multiple of 16 bytes long):
    // element loads, invisible tokens as zeros
#pragma unroll 1
    for (int i = 0; i < C::ITEMS; ++i) {
      const int d = (tid + i * NTHREADS) / C::GPT;
      uint4 raw;
      T* e16 = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int e = 0; e < C::VEC; ++e) {
        const int tok = tok_g + e;
        const int slot = block_of(tok);
        e16[e] = r.visible(tok) ? v_head[(i64)r.bt[slot] * vs.block + (tok - slot * block_size) * vs.tok + v_dim(d)]
                                : zero_of<T>();
      }
      *reinterpret_cast<uint4*>(dst + d * C::VTROW) = raw;
    }
  }
};

// ---------------------------------------------------------------------------- work pieces
// The host plan (decode_plan.plan_work) cuts each sequence's visible key tiles into pieces
// and gives every CTA column (blockIdx.x) a list of them, the same for every row group
// (blockIdx.y), and may leave pieces to a pool taken at run time (PiecePool). Descriptor i
// is 8 ints at work[8 * i]; column c's first piece is descriptor c, `next` links the rest;
// descriptor gridDim.x is the pool header (first descriptor, count). A piece:
//   b              sequence (-1: no piece)        kv_len  keys of b, the appended one included
//   t_begin, t_end key tiles [t_begin, t_end) of b (absolute indices; equal when kv_len is 0)
//   k, npieces     the piece's index among b's pieces, and their number
//   slot           partial slot of the piece (npieces > 1; slots of b's pieces are
//                  consecutive), else -1
//   next           descriptor of the column's next piece, -1 after the last
struct Piece {
  int b, kv_len, t_begin, t_end, k, npieces, slot, next;
  __device__ __forceinline__ bool valid() const { return b >= 0; }
};
static_assert(DESC_INTS == 8, "a descriptor is two int4 (load_piece)");

__device__ __forceinline__ Piece load_piece(const int4* __restrict__ work, int i) {
  if (i < 0) return Piece{-1, 0, 0, 0, 0, 1, -1, -1};
  const int4 a = __ldg(work + 2 * i), c = __ldg(work + 2 * i + 1);
  return Piece{a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
}

__device__ __forceinline__ void prefetch_l1(const void* p) {
  asm volatile("prefetch.global.L1 [%0];\n" :: "l"(p));
}

// The q / out row of sequence b: b, or through the row map of paged_attention's decode
// launch (DecodeArgs::rows) its token row, -1 for a sequence that is not a decode row there
// (its one piece has no keys and writes nothing).
__device__ __forceinline__ int seq_row(const int* __restrict__ rows, int b) {
  return rows != nullptr ? __ldg(rows + b) : b;
}

// First visible key of a query at position kv_len - 1.
__device__ __forceinline__ int first_visible(int kv_len, int window_left) {
  return window_left >= 0 ? max(0, kv_len - 1 - window_left) : 0;
}

// The pool of a row group: once a CTA's list is done, its loader takes pool pieces one at a
// time by an atomic count (ctr[0]); thread 0 takes, and hands the descriptor (-1: none
// left) to the CTA's threads through the shared ring `ring` (8 entries: the loader runs at
// most STAGES - 1 tiles, so as many pieces, ahead of the consumer, which reads the taken
// pieces in turn). A CTA whose take fails counts itself done (ctr[1]); the last of the row
// group's gridDim.x CTAs re-arms both counts to 0 for the next launch (no CTA takes after
// its own failed take, and every CTA fails once). Under a full memory stream the atomic
// is slow enough that the whole CTA would wait for it at the barrier: thread 0 makes it
// ahead (take_ahead, TileCursor::TAKE_AHEAD tiles before the loader needs the piece) and
// take only publishes the result.
struct PiecePool {
  int first, count;  // the pool's descriptors [first, first + count)
  int* ctr;          // [2]: pieces taken, CTAs done
  int* ring;
  int taken, used;   // the loader's takes / the consumer's reads so far (uniform per CTA)
  int ahead;         // thread 0: the count of a take made ahead (-1: none)

  // Thread 0 (others return): the next take's atomic, its result waited for by take.
  __device__ void take_ahead() {
    if (threadIdx.x == 0 && ahead < 0) ahead = atomicAdd(ctr, 1);
  }
  // Called by every thread of the CTA (it holds a barrier).
  __device__ int take() {
    if (threadIdx.x == 0) {
      const int g = ahead >= 0 ? ahead : atomicAdd(ctr, 1);
      ahead = -1;
      ring[taken & 7] = g < count ? first + g : -1;
      if (g >= count && atomicAdd(ctr + 1, 1) == (int)gridDim.x - 1) {
        ctr[0] = 0;
        ctr[1] = 0;
      }
    }
    __syncthreads();
    return ring[taken++ & 7];
  }
  // The consumer's piece after a list entry `next` (-1: the list is done): the loader's
  // next take, which it made before issuing that piece's first tile.
  __device__ int after(int next) {
    return next >= 0 || count == 0 ? next : ring[used++ & 7];
  }
};

// The row group's pool, from the header after the column heads.
__device__ __forceinline__ PiecePool piece_pool(const int4* __restrict__ work, int* ctr,
                                                int* ring) {
  const int4 h = __ldg(work + 2 * gridDim.x);
  return PiecePool{h.x, h.y, ctr + 2 * blockIdx.y, ring, 0, 0, -1};
}

// The loader's walk over a CTA's tiles, piece after piece (empty pieces have none), its
// list's then the pool's: `ref` is the tile the next issue takes. On entering a listed
// piece the descriptor of its successor is prefetched to L1, so the next switch finds it
// there; a piece without a listed successor takes its pool piece TAKE_AHEAD tiles before
// its end. start and advance are called by every thread of the CTA alike (take's barrier).
struct TileCursor {
  static constexpr int TAKE_AHEAD = 2;

  const int4* work;
  const int* block_tables;
  int bt_stride, window_left;
  PiecePool pool;
  TileRef ref;
  int t_end, next;  // end of the current piece, descriptor of the following one

  __device__ bool has() const { return ref.bt != nullptr; }
  __device__ void start(int first) { enter(first); }
  __device__ void advance() {
    if (++ref.tile >= t_end) enter(next);
    else if (t_end - ref.tile == TAKE_AHEAD && next < 0 && pool.count > 0) pool.take_ahead();
  }
  // The first piece with tiles from descriptor i on, then from the pool (none: ref.bt null).
  __device__ void enter(int i) {
    Piece p = load_piece(work, i);
    for (bool open = pool.count > 0;;) {
      if (p.valid()) {
        if (p.t_begin < p.t_end) break;
        p = load_piece(work, p.next);
      } else if (open) {
        i = pool.take();
        open = i >= 0;
        p = load_piece(work, i);
      } else {
        break;
      }
    }
    if (p.next >= 0) prefetch_l1(work + 2 * p.next);
    else if (p.valid() && pool.count > 0 && p.t_end - p.t_begin <= TAKE_AHEAD) pool.take_ahead();
    ref = TileRef{p.valid() ? block_tables + (i64)p.b * bt_stride : nullptr, p.t_begin,
                  first_visible(p.kv_len, window_left), p.kv_len};
    t_end = p.t_end;
    next = p.next;
  }
};

// ---------------------------------------------------------------------------- softmax state
// One warp's online softmax over its tokens for its lane's heads, in log2 units: m[nt][j]
// the running max of head nt*8 + 2r + j (equal on the 8 lanes of the head), l[nt][j] this
// lane's share of the running sum (summed over those lanes by reduce_sum), acc the
// unnormalised output in the acc layout.
template <int NT, int DT>
struct SoftmaxState {
  float m[NT][2], l[NT][2], acc[DT][NT][4];
  static constexpr int FLOATS = DT * NT * 4 + NT * 4;  // per lane, when stored

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      m[nt][0] = m[nt][1] = neg_inf();
      l[nt][0] = l[nt][1] = 0.f;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) acc[dt][nt][0] = acc[dt][nt][1] = acc[dt][nt][2] = acc[dt][nt][3] = 0.f;
    }
  }

  // Fold in one m-tile of scores (masked ones -inf); leaves the probabilities in s.
  __device__ __forceinline__ void update(float (&s)[NT][4], int nt_used) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      if (nt >= nt_used) continue;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float mx = fmaxf(s[nt][j], s[nt][j + 2]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
        const float m_new = fmaxf(m[nt][j], mx);
        const float m_use = m_new == neg_inf() ? 0.f : m_new;
        const float alpha = fast_exp2(m[nt][j] - m_use);
        s[nt][j] = fast_exp2(s[nt][j] - m_use);
        s[nt][j + 2] = fast_exp2(s[nt][j + 2] - m_use);
        l[nt][j] = l[nt][j] * alpha + s[nt][j] + s[nt][j + 2];
        m[nt][j] = m_new;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          acc[dt][nt][j] *= alpha;
          acc[dt][nt][j + 2] *= alpha;
        }
      }
    }
  }

  __device__ __forceinline__ void reduce_sum() {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) l[nt][j] += __shfl_xor_sync(0xffffffffu, l[nt][j], o);
  }

  // w: this lane's slot of a lane-interleaved buffer (element i at w[i * 32]).
  __device__ __forceinline__ void store(float* w) const {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int k = 0; k < 4; ++k) w[((dt * NT + nt) * 4 + k) * 32] = acc[dt][nt][k];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        w[(DT * NT * 4 + nt * 4 + j) * 32] = m[nt][j];
        w[(DT * NT * 4 + nt * 4 + 2 + j) * 32] = l[nt][j];
      }
    }
  }

  // Merge a state stored by another warp over other tokens of the same heads.
  __device__ __forceinline__ void absorb(const float* w) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float m2 = w[(DT * NT * 4 + nt * 4 + j) * 32], l2 = w[(DT * NT * 4 + nt * 4 + 2 + j) * 32];
        const float m_new = fmaxf(m[nt][j], m2);
        const float m_use = m_new == neg_inf() ? 0.f : m_new;
        const float a = fast_exp2(m[nt][j] - m_use), c = fast_exp2(m2 - m_use);
        l[nt][j] = l[nt][j] * a + l2 * c;
        m[nt][j] = m_new;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int k = 2 * h + j;
            acc[dt][nt][k] = acc[dt][nt][k] * a + w[((dt * NT + nt) * 4 + k) * 32] * c;
          }
      }
  }
};

// The score epilogue of a launch (score.cuh), its scale in log2 units from the host, times
// the kv head's k_scale (1 for a 16/32-bit cache): s = sm_scale * q.(k_scale * code).
template <typename T, typename KV>
__device__ __forceinline__ ScoreEpilogue score_epilogue(const DecodeArgs<T, KV>& a,
                                                        float k_scale) {
  ScoreEpilogue e;
  e.init(a.sm_scale * k_scale, a.soft_cap);
  e.scale_log2 = a.scale_log2 * k_scale;
  return e;
}

// The score epilogue (score.cuh; slopes in log2 units), then the visibility mask: keys
// [lo, kv_len) of the query at position pos. Output in log2 units (exp2-based softmax).
struct ScoreMods {
  ScoreEpilogue epi;
  int lo, kv_len, pos;

  template <int NT>
  __device__ __forceinline__ void apply(float (&s)[NT][4], const float (&slope)[NT][2], int tok0,
                                        int qr) const {
    if (epi.softcap)  // warp-uniform: one branch a tile, straight-line scores either way
      apply_as<true>(s, slope, tok0, qr);
    else
      apply_as<false>(s, slope, tok0, qr);
  }
  template <bool CAP, int NT>
  __device__ __forceinline__ void apply_as(float (&s)[NT][4], const float (&slope)[NT][2],
                                           int tok0, int qr) const {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int tok = tok0 + qr + 8 * (k >> 1);
        const float x = epi.at<CAP>(s[nt][k]) + slope[nt][k & 1] * (float)(tok - pos);
        s[nt][k] = (tok >= lo && tok < kv_len) ? x : neg_inf();
      }
  }
};

// Final rows of one warp: for a whole sequence (one piece), out (q's dtype, sink in the
// denominator) and lse at rows out_row + h; for one piece of several, the fp32 partial
// (normalised over the piece's keys, kept in L2 for the merge) and natural-log lse at rows
// part_row + h, for the merge; the output times v_scale (the kv head's fp8 scale, else 1).
// sinks points at the warp's first head (or is null). PERM: the accumulator's head dims
// are PageMath's permutation for chunks of PERM elements (0: in order).
template <typename T, int D, int NT, int PERM = 0>
__device__ __forceinline__ void write_rows(const SoftmaxState<NT, D / 16>& st, int warp_heads,
                                           float v_scale, bool whole, i64 out_row, i64 part_row,
                                           const float* __restrict__ sinks, T* __restrict__ out,
                                           float* __restrict__ lse, float* __restrict__ part_out,
                                           float* __restrict__ part_lse, int lane) {
  const int qr = lane >> 2, r = lane & 3;
  const unsigned long long keep = l2_evict_last_policy();  // until the merge reads them
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int h = nt * 8 + 2 * r + j;
      if (h >= warp_heads) continue;
      const float m = st.m[nt][j], l = st.l[nt][j];
      float scale, row_lse;
      if (whole) {
        const float sink2 = sinks != nullptr ? sinks[h] * LOG2E : neg_inf();
        const float m_all = fmaxf(m, sink2);
        const float m_use = m_all == neg_inf() ? 0.f : m_all;
        const float sc = fast_exp2(m - m_use);
        const float den = l * sc + fast_exp2(sink2 - m_use);
        scale = den > 0.f ? sc / den : 0.f;
        row_lse = den > 0.f ? (m_use + log2f(den)) * LN2 : neg_inf();
      } else {
        scale = l > 0.f ? 1.f / l : 0.f;
        row_lse = l > 0.f ? (m + log2f(l)) * LN2 : neg_inf();
      }
      scale *= v_scale;
#pragma unroll
      for (int dt = 0; dt < D / 16; ++dt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          int d = dt * 16 + qr + 8 * hh;
          if constexpr (PERM > 0) d = perm_dim<PERM>(dt, qr + 8 * hh);
          const float v = st.acc[dt][nt][2 * hh + j] * scale;
          if (whole) out[(out_row + h) * D + d] = from_float<T>(v);
          else store_l2_hint(part_out + (part_row + h) * D + d, v, keep);
        }
      if (qr == 0) {
        if (!whole) part_lse[part_row + h] = row_lse;
        else if (lse != nullptr) lse[out_row + h] = row_lse;
      }
    }
}

// ---------------------------------------------------------------------------- fused merge
// Called by every thread of a CTA that has just written its partial rows of piece p of row
// group y (gridDim.y row groups; hpc query heads a row group from head hq_rg, rg_heads of
// them real; out_seq: the sequence's out row, seq_row): the CTA whose piece arrives last (an
// atomic count per (sequence, row group), re-armed to 0) merges all of them into out / lse,
// its nwarps warps one head at a time.
template <typename T, int D>
__device__ __forceinline__ void merge_if_last(const Piece& p, int out_seq,
                                              int* __restrict__ counters, int y,
                                              int hq_rg, int hpc, int rg_heads, int num_q_heads,
                                              const float* __restrict__ part_out,
                                              const float* __restrict__ part_lse,
                                              const float* __restrict__ sinks, T* __restrict__ out,
                                              float* __restrict__ lse, int& s_last, int nwarps) {
  __syncthreads();  // this CTA's partial rows are written
  if (threadIdx.x == 0) {
    int* counter = counters + (i64)p.b * gridDim.y + y;
    __threadfence();  // release the rows (cumulative over the CTA's threads, after the barrier)
    const int arrived = atomicAdd(counter, 1);
    __threadfence();  // acquire the other pieces' rows
    s_last = arrived == p.npieces - 1;
    if (s_last) *counter = 0;  // every piece has arrived: re-armed for the next launch
  }
  __syncthreads();
  if (s_last) {
    const i64 row = (i64)out_seq * num_q_heads + hq_rg;
    merge_group<T, (D + 127) / 128>(part_out, part_lse, p.slot - p.k, p.npieces, gridDim.y, y, hpc,
                                    rg_heads, D, sinks != nullptr ? sinks + hq_rg : nullptr,
                                    out + row * D, lse != nullptr ? lse + row : nullptr,
                                    threadIdx.x >> 5, nwarps, threadIdx.x & 31);
  }
}

// ---------------------------------------------------------------------------- piece loop
// Both decode kernels take the fields of DecodeArgs (abi.cuh; packed by decode.py): outputs,
// scratch and counts, work, caches and tables, optional per-head arrays, cache strides in
// elements (Loader), block-size division, heads, options. Query head h of sequence b is read
// at q + r * q_stride + h * D and written at out + (r * num_q_heads + h) * D, r =
// seq_row(rows, b) (b without a row map; r < 0: nothing read or written).

// A warp's part in a CTA: its head set hw of the row group's head_warps sets and its token
// warp tg of tw (warp = tg * head_warps + hw); computes: it serves heads.
struct WarpRoles {
  int head_warps, hw, tg, tw;
  bool computes;
};

// The row group a CTA's fused merge covers (merge_if_last): y, its hpc query heads from hq_rg,
// rg_heads of them real, merged by nwarps warps.
struct MergeGroup {
  int y, hq_rg, hpc, rg_heads, nwarps;
};

// The loop over a CTA's pieces that both decode kernels run, over a tile source Src: the
// staged cp.async tiles (StagedTiles, paged_decode_kernel) or the bulk-copied page ring
// (PageRing, paged_decode_pages_kernel). The CTA walks column blockIdx.x's pieces, then pool
// pieces of its row group (TileCursor), and streams their tiles back to back through Src's
// RING stages (no drain between pieces): the stream's tile `it` sits in stage it % RING. Per
// piece: q into the computing warps, then one tile an iteration (wait for tile `it`, one
// barrier, refill the stage the previous tile freed, the warp's m-tiles with its own online
// softmax); after the piece's last tile the token warps of each head set combine in the
// stage that tile used (no copy targets it before the next barrier), the first writes a
// whole sequence's out / lse (sink included) or the piece's fp32 partial, and with
// fused_merge the CTA completing a split sequence's pieces merges them.
// Src supplies: State, RING; prologue(cur) (the first RING - 1 tiles in flight);
// init_lanes(); k_scale() (the warp's kv head's); wait(it); refill(cur, st); load_q(p);
// tile(tile, st, mods, state);
// combine_buffer(st) (this lane's slot of a stage as floats); after_combine();
// write(state, p, whole); and its roles (WarpRoles).
template <typename T, typename KV, int D, typename Src>
__device__ __forceinline__ void piece_loop(const DecodeArgs<T, KV>& a, Src& src, TileCursor& cur,
                                           const MergeGroup& mg, int& s_last) {
  using State = typename Src::State;
  constexpr int RING = Src::RING;
  const WarpRoles& w = src.roles;
  cur.start(blockIdx.x);
  src.prologue(cur);
  src.init_lanes();
  State state;

  int it = 0;
  for (int pi = cur.pool.after(load_piece(a.work, blockIdx.x).valid() ? blockIdx.x : -1); pi >= 0;) {
    Piece p = load_piece(a.work, pi);
    if (!p.valid()) break;
    const ScoreMods mods{score_epilogue(a, src.k_scale()), first_visible(p.kv_len, a.window_left),
                         p.kv_len, p.kv_len - 1};
    if (w.computes) src.load_q(p);
    state.init();
    for (int tile = p.t_begin; tile < p.t_end; ++tile, ++it) {
      src.wait(it);
      __syncthreads();  // tile `it` landed for all threads; stage (it - 1) % RING is free
      src.refill(cur, (it + RING - 1) % RING);
      if (w.computes) src.tile(tile, it % RING, mods, state);
    }

    // -- combine the token warps of each head set in stage (it - 1) % RING, then write --
    p = load_piece(a.work, pi);  // (an L1 hit) rather than registers held through the loop
    pi = cur.pool.after(p.next);
    state.reduce_sum();
    if (w.tw > 1) {
      float* red = src.combine_buffer((it + RING - 1) % RING);
      __syncthreads();  // every warp is done with that stage's tile
      if (w.computes && w.tg > 0)
        state.store(red + ((w.tg - 1) * w.head_warps + w.hw) * State::FLOATS * 32);
      __syncthreads();
      if (w.computes && w.tg == 0)
        for (int t2 = 1; t2 < w.tw; ++t2)
          state.absorb(red + ((t2 - 1) * w.head_warps + w.hw) * State::FLOATS * 32);
      src.after_combine();
    }
    const bool whole = p.npieces == 1;
    if (w.computes && w.tg == 0) src.write(state, p, whole);
    if (!whole && a.fused_merge)
      merge_if_last<T, D>(p, seq_row(a.rows, p.b), a.counters, mg.y, mg.hq_rg, mg.hpc,
                          mg.rg_heads, a.num_q_heads, a.part_out, a.part_lse, a.sinks, a.out,
                          a.lse, s_last, mg.nwarps);
  }
}

// ---------------------------------------------------------------------------- decode kernel
// The staged tile source: every thread gathers its chunks of a tile (Loader) with cp.async
// into a STAGES-stage pipeline, block ids one tile ahead; warp (tg, hw) serves heads
// hw * HW.. of the row group on m-tiles tg, tg + tw, ... of each tile.
template <typename T, typename KV, int D, bool VT, int NT>
struct StagedTiles {
  using C = Cfg<KV, D, NT>;
  using Math = typename MathFor<T, KV, D, VT, NT>::type;
  using State = SoftmaxState<NT, C::DT>;
  using Load = Loader<KV, D, VT>;
  static constexpr int RING = STAGES;
  static constexpr int STAGE = C::K_ELEMS + (VT ? C::V_ELEMS_T : C::V_ELEMS_ROWS);  // elements
  static_assert((NWARPS - 1) * State::FLOATS * 32 * 4 <= STAGE * (int)sizeof(KV),
                "the combine buffer fits in one stage");

  const DecodeArgs<T, KV>& a;
  KV* tiles;
  float* q_smem;  // fp32 path: this warp's q rows
  WarpRoles roles;
  int lane, y, hpc, warp_heads, nt_used, hq_warp;
  Load ld;
  typename Load::Ids next;  // block ids of cur.ref, the tile the next refill issues
  Math math;
  float slope[NT][2];

  __device__ __forceinline__ explicit StagedTiles(const DecodeArgs<T, KV>& args) : a(args) {}
  // The kv head's scales (fp8; 1 otherwise), read where used rather than held in registers.
  __device__ __forceinline__ float k_scale() const {
    return kv_scale(a.k_scale, a.k_scale_stride, a.k_scale_value, y / a.head_chunks);
  }
  __device__ __forceinline__ float v_scale() const {
    return kv_scale(a.v_scale, a.v_scale_stride, a.v_scale_value, y / a.head_chunks);
  }
  __device__ __forceinline__ KV* k_stage(int st) const { return tiles + st * STAGE; }
  __device__ __forceinline__ KV* v_stage(int st) const { return tiles + st * STAGE + C::K_ELEMS; }

  // The first STAGES - 1 tiles in flight, the ids of the next on their way.
  __device__ __forceinline__ void prologue(TileCursor& cur) {
    TileRef pro_ref[STAGES - 1];
    typename Load::Ids pro[STAGES - 1];
    int n_pro = 0;
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st)
      if (cur.has()) {
        ld.fetch(cur.ref, pro[st]);
        pro_ref[st] = cur.ref;
        cur.advance();
        ++n_pro;
      }
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
      if (st < n_pro) ld.issue(pro_ref[st], pro[st], k_stage(st), v_stage(st));
      cp_async_commit();
    }
    if (cur.has()) ld.fetch(cur.ref, next);  // cur.ref stays on this tile until it is issued
  }
  __device__ __forceinline__ void init_lanes() {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int h = nt * 8 + 2 * (lane & 3) + j;
        slope[nt][j] = (a.alibi_slopes != nullptr && h < warp_heads)
                           ? a.alibi_slopes[hq_warp + h] * LOG2E : 0.f;  // log2 units
      }
  }
  __device__ __forceinline__ void wait(int) const { cp_async_wait<STAGES - 2>(); }
  __device__ __forceinline__ void refill(TileCursor& cur, int st) {
    if (cur.has()) {
      ld.issue(cur.ref, next, k_stage(st), v_stage(st));
      cur.advance();
      if (cur.has()) ld.fetch(cur.ref, next);
    }
    cp_async_commit();
  }
  __device__ __forceinline__ void load_q(const Piece& p) {
    const int r = seq_row(a.rows, p.b);
    if (r >= 0) math.load_q(a.q + (i64)r * a.q_stride + (i64)hq_warp * D, warp_heads, q_smem, lane);
  }
  // The warp's head tiles in use (1 .. NT; a computing warp has at least one). With one
  // head tile and D <= 128 they reach the math as the compile-time 1: a run-time count
  // predicates the .aligned ldmatrix and mma, and ptxas then puts a WARPSYNC before each,
  // which keeps them from overlapping. Elsewhere (NT = 2, d256) the unpredicated loop
  // spills registers on sm_80, so the count stays a run-time one (USED = 0).
  static constexpr bool FIXED_USED = NT == 1 && D <= 128;
  __device__ __forceinline__ void tile(int tile, int st, const ScoreMods& mods, State& state) const {
    tile_with<FIXED_USED ? 1 : 0>(tile, st, mods, state);
  }
  template <int USED>  // the head tiles in use, or 0: nt_used
  __device__ __forceinline__ void tile_with(int tile, int st, const ScoreMods& mods,
                                            State& state) const {
    const KV* k_s = k_stage(st);
    const KV* v_s = v_stage(st);
    for (int mt = roles.tg; mt < C::MTILES; mt += roles.tw) {
      const int tok0 = tile * C::TILE + mt * 16;
      if (tok0 + 16 <= mods.lo || tok0 >= mods.kv_len) continue;  // all masked (warp-uniform)
      float s[NT][4];
      const int used = USED > 0 ? USED : nt_used;
      math.scores(k_s + mt * 16 * C::KROW, s, used, lane);
      mods.apply(s, slope, tok0, lane >> 2);
      state.update(s, used);
      math.pv(v_s, mt * 16, s, state.acc, used, lane);
    }
  }
  __device__ __forceinline__ float* combine_buffer(int st) const {
    return reinterpret_cast<float*>(k_stage(st)) + lane;
  }
  __device__ __forceinline__ void after_combine() const {}
  __device__ __forceinline__ void write(const State& state, const Piece& p, bool whole) const {
    const int r = seq_row(a.rows, p.b);
    if (whole && r < 0) return;
    write_rows<T, D, NT, Math::PERM>(state, warp_heads, v_scale(), whole,
                         (i64)r * a.num_q_heads + hq_warp,
                         ((i64)p.slot * gridDim.y + y) * hpc + roles.hw * C::HW,
                         a.sinks != nullptr ? a.sinks + hq_warp : nullptr, a.out, a.lse,
                         a.part_out, a.part_lse, lane);
  }
};

// grid (columns, num_kv_heads * head_chunks); block NTHREADS (4 warps). Row group y =
// (kv head hk, head chunk hc) owns query heads hk*G + hc*HPC + [0, HPC) (HPC = head_warps *
// HW). CTA (c, y) runs piece_loop over StagedTiles for its row group: all threads stream the
// pieces' K/V tiles through one cp.async pipeline (pool_ctr [2 * row groups]); warp w serves
// heads (w % head_warps)*HW.. on m-tiles w / head_warps, + token_warps, ... of each tile.
// Split sequences leave fp32 partials; with fused_merge the CTA that completes a row group's
// pieces merges them into out/lse, otherwise merge_pieces_kernel (merge.cu) does. KV: the
// caches' element type (T, or an fp8 format with 16-bit T and NT = 1).
template <typename T, typename KV, int D, bool VT, int NT>
__global__ void __launch_bounds__(NTHREADS, 1)
paged_decode_kernel(CUPAGED_PARAMS_DecodeArgs) {
  using Src = StagedTiles<T, KV, D, VT, NT>;
  using C = typename Src::C;
  const DecodeArgs<T, KV> a{CUPAGED_FIELDS_DecodeArgs};
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int s_last;  // this CTA completed its row group's pieces (fused merge)
  __shared__ int s_ring[8];  // pool pieces taken (PiecePool)

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int y = blockIdx.y, hk = y / head_chunks, hc = y % head_chunks;
  const int group = num_q_heads / num_kv_heads;
  const int hpc = head_warps * C::HW;                // query heads per row group
  const int hq_rg = hk * group + hc * hpc;           // the row group's first query head
  const int rg_heads = min(group - hc * hpc, hpc);

  // -- warp roles --
  const int token_warps = NWARPS / head_warps;
  const int hg = warp % head_warps, tg = warp / head_warps;
  const int warp_heads = max(0, min(rg_heads - hg * C::HW, C::HW));

  Src src(a);
  src.tiles = reinterpret_cast<KV*>(smem);
  src.q_smem =
      reinterpret_cast<float*>(smem + STAGES * Src::STAGE * sizeof(KV)) + warp * C::HW * C::QROW;
  src.roles = WarpRoles{head_warps, hg, tg, token_warps, tg < token_warps && warp_heads > 0};
  src.lane = lane;
  src.y = y;
  src.hpc = hpc;
  src.warp_heads = warp_heads;
  src.nt_used = (warp_heads + 7) / 8;
  src.hq_warp = hq_rg + hg * C::HW;
  src.ld.k_head = k_cache + (i64)hk * khs;
  src.ld.v_head = v_cache + (i64)hk * vhs;
  src.ld.ks = Strides{kbs, khs, kts, kcs, 1};
  src.ld.vs = Strides{vbs, vhs, vts, vcs, ves};
  src.ld.block_size = block_size;
  src.ld.magic = block_magic;
  src.ld.shift = block_shift;
  src.ld.tid = tid;
  src.ld.vt_whole = block_size % C::VEC == 0;

  TileCursor cur{work, block_tables, bt_stride, window_left, piece_pool(work, pool_ctr, s_ring)};
  piece_loop<T, KV, D>(a, src, cur, MergeGroup{y, hq_rg, hpc, rg_heads, NWARPS}, s_last);
  cp_async_wait<0>();
}

// ---------------------------------------------------------------------------- page-copy kernel
// Rows t0 .. t0 + rows - 1 of the sequence in a stage (`stride` elements apart, `chunks`
// 16-byte chunks each, in K and in V): zeroes those outside the visible keys [lo, kv_len),
// so that their masked scores and values stay finite (the copies leave them as they were,
// or bring in the cache's). `threads` threads from `thread` share the work (a warp or the
// CTA; every thread of it calls).
template <typename T>
__device__ __forceinline__ void zero_invisible_rows(T* k_rows, T* v_rows, int stride, int chunks,
                                                    int t0, int rows, int lo, int kv_len,
                                                    int thread, int threads) {
  const int a = max(lo - t0, 0), b = min(kv_len - t0, rows);  // visible rows [a, b)
  const int zero_rows = a + rows - b;
  if (zero_rows == 0) return;
  for (int i = thread; i < zero_rows * chunks; i += threads) {
    const int zr = i / chunks, tok = zr < a ? zr : b + zr - a, c = i - zr * chunks;
    reinterpret_cast<uint4*>(k_rows + tok * stride)[c] = make_uint4(0, 0, 0, 0);
    reinterpret_cast<uint4*>(v_rows + tok * stride)[c] = make_uint4(0, 0, 0, 0);
  }
  fence_proxy_async();  // a later copy into this stage overwrites them
  __syncwarp();
}

// The page-ring tile source of paged_decode_pages_kernel (see there): whole blocks of the
// row group's HG kv heads, copied by cp.async.bulk into a PAGE_STAGES ring on mbarriers;
// warp (tg, wh) serves kv head kv0 + wh on m-tiles tg, tg + TW, ... of each tile.
template <typename T, typename KV, int D, bool HEAD_MAJOR>
struct PageRing {
  using State = SoftmaxState<1, D / 16>;
  using Math = PageMath<T, KV, D>;
  static constexpr int RING = PAGE_STAGES;

  const DecodeArgs<T, KV>& a;
  KV* ring;
  u32 bars;        // the stages' mbarriers (8 bytes each)
  WarpRoles roles;
  int tid, lane, warp_heads, hq_warp;
  int row;         // elements of a token in a stage (NHD)
  int tile_blocks, tile_rows, stage_elems;
  int head_rows;   // elements between a kv head's tokens
  int head_first;  // ... and from one head to the next
  // Run j of a tile (a block's tokens, or with fewer heads than the cache's one token's)
  // is copied by lane j / 8 of warp j % 8: a cp.async.bulk holds its warp for a while, so
  // 16 runs a tile from one warp would hold it, and at the next barrier every warp, for
  // all 32 copies.
  int run_rows;    // tokens a run
  int run;         // the run this thread copies
  bool copier;
  int run_block;   // its block in the tile
  int run_in;      // its first token there
  i64 head_off;    // the row group's first head in a block
  int blk;         // a copier's cache block of the tile cur.ref (block_id)
  Math math;
  float slope[1][2];

  __device__ __forceinline__ explicit PageRing(const DecodeArgs<T, KV>& args) : a(args) {}
  // The warp's kv head's scales (fp8; 1 otherwise), read where used.
  __device__ __forceinline__ int kv_head() const {
    return blockIdx.y * roles.head_warps + roles.hw;
  }
  __device__ __forceinline__ float k_scale() const {
    return kv_scale(a.k_scale, a.k_scale_stride, a.k_scale_value, kv_head());
  }
  __device__ __forceinline__ float v_scale() const {
    return kv_scale(a.v_scale, a.v_scale_stride, a.v_scale_value, kv_head());
  }
  __device__ __forceinline__ KV* k_stage(int st) const { return ring + 2 * st * stage_elems; }
  __device__ __forceinline__ KV* v_stage(int st) const { return ring + (2 * st + 1) * stage_elems; }

  // Tile r.tile into stage st (a copier holds blk, the cache block of its run): the
  // visible rows [lo, hi) copied (HND: the whole blocks holding them; their heads' invisible
  // rows are zeroed once they landed), NHD's invisible rows of partly visible m-tiles
  // zeroed (the math skips wholly invisible ones).
  __device__ __forceinline__ void issue(const TileRef& r, int st, int blk) const {
    const int t0 = r.tile * tile_rows;
    int lo = max(r.lo - t0, 0), hi = min(r.kv_len - t0, tile_rows);
    if (HEAD_MAJOR) {
      lo -= lo % a.block_size;
      hi = min(hi + (a.block_size - hi % a.block_size) % a.block_size, tile_rows);
    }
    KV* ks = k_stage(st);
    KV* vs = v_stage(st);
    if (!HEAD_MAJOR) {  // the m-tiles [m0, m1) hold the visible rows
      const int m0 = lo / 16 * 16, m1 = min((hi + 15) / 16 * 16, tile_rows);
      zero_invisible_rows(ks + m0 * row, vs + m0 * row, row, row / Vec16<KV>::N, t0 + m0,
                          m1 - m0, r.lo, r.kv_len, tid, PAGE_THREADS);
    }
    const u32 bar = bars + 8 * st;
    // The one arrival, with every copy's bytes: the phase completes when it has happened and
    // the copies (landing before or after it) are all in; with no rows to copy, at once.
    if (tid == 0) mbar_arrive_expect_tx(bar, 2 * (u32)((hi - lo) * row * (int)sizeof(KV)));
    if (copier) {
      const int r0 = max(lo, run * run_rows), r1 = min(hi, (run + 1) * run_rows);
      if (r0 < r1) {
        const u32 bytes = (u32)((r1 - r0) * row * (int)sizeof(KV));
        // the first copied token in the block (HND: whole blocks)
        const i64 in = head_off + (HEAD_MAJOR ? 0 : (i64)(run_in + r0 - run * run_rows) * a.kts);
        const unsigned long long once = l2_evict_first_policy();
        bulk_copy_g2s(smem_addr(ks + r0 * row), a.k_cache + (i64)blk * a.kbs + in, bytes, bar, once);
        bulk_copy_g2s(smem_addr(vs + r0 * row), a.v_cache + (i64)blk * a.vbs + in, bytes, bar, once);
      }
    }
  }

  // A copier loads the id of its block of the tile after the one it issues, so that the
  // load's latency passes during a tile's math rather than in front of the next copies
  // (blocks past the sequence's end are not read: their table entries may be -1).
  __device__ __forceinline__ int block_id(const TileRef& r) const {
    const int j = r.tile * tile_blocks + run_block;
    return copier && r.bt != nullptr && j * a.block_size + run_in < r.kv_len ? __ldg(r.bt + j) : 0;
  }

  __device__ __forceinline__ void prologue(TileCursor& cur) {
    blk = block_id(cur.ref);
#pragma unroll
    for (int st = 0; st < PAGE_STAGES - 1; ++st)
      if (cur.has()) {
        issue(cur.ref, st, blk);
        cur.advance();
        blk = block_id(cur.ref);
      }
  }
  __device__ __forceinline__ void init_lanes() {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int h = 2 * (lane & 3) + j;
      slope[0][j] = (a.alibi_slopes != nullptr && h < warp_heads)
                        ? a.alibi_slopes[hq_warp + h] * LOG2E : 0.f;  // log2 units
    }
  }
  __device__ __forceinline__ void wait(int it) const {
    mbar_wait(bars + 8 * (it % PAGE_STAGES), (it / PAGE_STAGES) & 1);
  }
  __device__ __forceinline__ void refill(TileCursor& cur, int st) {
    if (cur.has()) {
      issue(cur.ref, st, blk);
      cur.advance();
      blk = block_id(cur.ref);
    }
  }
  __device__ __forceinline__ void load_q(const Piece& p) {
    const int r = seq_row(a.rows, p.b);
    if (r >= 0) math.load_q(a.q + (i64)r * a.q_stride + (i64)hq_warp * D, warp_heads, lane);
  }
  __device__ __forceinline__ void tile(int tile, int st, const ScoreMods& mods, State& state) const {
    KV* ks = k_stage(st) + roles.hw * head_first;  // this warp's kv head
    KV* vs = v_stage(st) + roles.hw * head_first;
    const int lo = mods.lo, kv_len = mods.kv_len;
    for (int mt = roles.tg; mt < tile_rows / 16; mt += roles.tw) {
      const int tok0 = tile * tile_rows + mt * 16;
      if (tok0 + 16 <= lo || tok0 >= kv_len) continue;  // all masked (warp-uniform)
      // the m-tile's rows: HND [block][HG][block_size][D], NHD [token][HG][D]
      const int off = HEAD_MAJOR ? (mt * 16 / a.block_size) * a.block_size * row +
                                       (mt * 16 % a.block_size) * D
                                 : mt * 16 * row;
      if (HEAD_MAJOR && (tok0 < lo || tok0 + 16 > kv_len))
        zero_invisible_rows(ks + off, vs + off, D, D / Vec16<KV>::N, tok0, 16, lo, kv_len,
                            lane, 32);
      float s[1][4];
      math.scores(ks + off, head_rows, s, lane);
      mods.apply(s, slope, tok0, lane >> 2);
      state.update(s, 1);
      math.pv(vs + off, head_rows, s, state.acc, lane);
    }
  }
  __device__ __forceinline__ float* combine_buffer(int st) const {
    return reinterpret_cast<float*>(k_stage(st)) + lane;
  }
  __device__ __forceinline__ void after_combine() const {
    fence_proxy_async();  // the stage's next copy comes after these accesses
  }
  __device__ __forceinline__ void write(const State& state, const Piece& p, bool whole) const {
    const int r = seq_row(a.rows, p.b);
    if (whole && r < 0) return;
    write_rows<T, D, 1, Math::CH>(state, warp_heads, v_scale(), whole,
                              (i64)r * a.num_q_heads + hq_warp,
                              (i64)p.slot * a.num_q_heads + hq_warp,
                              a.sinks != nullptr ? a.sinks + hq_warp : nullptr, a.out, a.lse,
                              a.part_out, a.part_lse, lane);
  }
};

// grid (columns, row groups); block PAGE_THREADS; sm_90; 16-bit or fp8 caches (KV, with
// 16-bit T), at most 8 query heads a kv head: NHD with block_size a multiple of 16 or a
// divisor of 16, or HND with block_size a multiple of 16. Row group y is the kv heads
// y*HG .. y*HG + HG - 1 (HG = head_warps, at most PAGE_WARPS: every kv head, or a divisor of
// their number) with all their query heads.
// Warp w serves kv head y*HG + w % HG on the m-tiles (16 tokens) w / HG, + TW, ... of each
// tile (TW = PAGE_WARPS / HG token warps a head), for its G query heads (PageMath) with its
// own online softmax; a tile is tile_tokens tokens, whole blocks (decode_plan.page_tile: at
// least 16 * TW tokens unless that passes the bytes a stage holds of an operand, so that a
// stage holds about as many bytes however few the heads). CTA (c, y) runs piece_loop over
// PageRing: column c's pieces, then pool pieces of row group y (PiecePool); its stream of
// tiles goes through a PAGE_STAGES ring, a stage holding its tile's HG heads as the cache
// lays them out:
//   NHD  (HEAD_MAJOR false; kv head h's token t at (t * HG + h) * D in the stage): with
//        HG = Hk a block's visible tokens are one contiguous run [tokens][Hk][D] in the
//        cache, else each token's HG heads are one; lane j / 8 of warp j % 8 copies run j
//        of the tile, K and V, with two cp.async.bulk on the stage's mbarrier (the runs of
//        a tile land one after the other), and every thread zeroes its share of the
//        invisible rows of partly visible m-tiles before;
//   HND  (HEAD_MAJOR; block j of the tile at j * block_size * HG * D in the stage, there
//        [HG][block_size][D]): lane j / 8 of warp j % 8 copies the row group's heads of
//        block j as one run (all its tokens) if any of them is visible, and the warp of a
//        partly visible m-tile zeroes its invisible rows once it landed.
// After a piece's last tile the token warps of each head combine in the stage that tile
// used (the PAGE_WARPS - HG stored states fit in its K and V at every head dim), and its
// first writes. Pieces end as in paged_decode_kernel.
template <typename T, typename KV, int D, bool HEAD_MAJOR>
__global__ void __launch_bounds__(PAGE_THREADS, 1)
paged_decode_pages_kernel(CUPAGED_PARAMS_DecodeArgs) {
  using Src = PageRing<T, KV, D, HEAD_MAJOR>;
  const DecodeArgs<T, KV> a{CUPAGED_FIELDS_DecodeArgs};
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) u64 full[PAGE_STAGES];  // stage st's block landed
  __shared__ int s_last;
  __shared__ int s_ring[8];  // pool pieces taken (PiecePool)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = num_q_heads / num_kv_heads;
  const int hg = head_warps;                   // kv heads of the row group
  const int kv0 = blockIdx.y * hg;             // its first
  const int tw = PAGE_WARPS / hg;              // token warps a kv head
  const int wh = warp % hg, tg = warp / hg;    // this warp's head in the group, token warp
  const int row = hg * D;                      // elements of a token in a stage (NHD)
  const int tile_rows = tile_tokens;               // tokens a tile (a stage) holds
  const int tile_blocks = tile_rows / block_size;  // whole blocks (decode_plan.page_tile)
  const u32 bars = smem_addr(full);
  if (tid == 0)
    for (int st = 0; st < PAGE_STAGES; ++st) mbar_init(bars + 8 * st, 1);
  fence_mbar_init();
  __syncthreads();

  Src src(a);
  src.ring = reinterpret_cast<KV*>(smem);
  src.bars = bars;
  src.roles = WarpRoles{hg, wh, tg, tw, tg < tw};
  src.tid = tid;
  src.lane = lane;
  src.warp_heads = tg < tw ? group : 0;
  src.hq_warp = (kv0 + wh) * group;
  src.row = row;
  src.tile_blocks = tile_blocks;
  src.tile_rows = tile_rows;
  src.stage_elems = tile_rows * row;
  src.head_rows = HEAD_MAJOR ? D : row;
  src.head_first = HEAD_MAJOR ? block_size * D : D;
  src.run_rows = !HEAD_MAJOR && hg < num_kv_heads ? 1 : block_size;
  src.run = lane * PAGE_WARPS + warp;
  src.copier = src.run < tile_rows / src.run_rows;
  src.run_block = src.run * src.run_rows / block_size;
  src.run_in = src.run * src.run_rows - src.run_block * block_size;
  src.head_off = (i64)kv0 * khs;

  TileCursor cur{work, block_tables, bt_stride, window_left, piece_pool(work, pool_ctr, s_ring)};
  const MergeGroup mg{(int)blockIdx.y, kv0 * group, hg * group, hg * group, PAGE_WARPS};
  piece_loop<T, KV, D>(a, src, cur, mg, s_last);
}

// ---------------------------------------------------------------------------- append
// grid (batch); block 128. CTA b writes k_new[b], v_new[b] ([Hk, D] each, k_new_stride and
// v_new_stride elements from one sequence to the next) into the cache slot of position
// seq_lens[b]; thread i copies elements i, i + 128, ... of the Hk*D (into an fp8 cache
// quantised with their kv head's scales, fp8.cuh). A sequence whose length is negative (a
// bad one, found by decode_plan_kernel) is skipped.
template <typename T, typename KV>
__global__ void __launch_bounds__(128) append_kv_kernel(CUPAGED_PARAMS_AppendArgs) {
  constexpr int VEC = Vec16<KV>::N;
  const int b = blockIdx.x;
  const int p = seq_lens[b];
  if (p < 0) return;
  const int slot = p / block_size, in = p - slot * block_size;
  const i64 blk = block_tables[(i64)b * bt_stride + slot];
  const T* k_src = k_new + (i64)b * k_new_stride;
  const T* v_src = v_new + (i64)b * v_new_stride;
  for (int e = threadIdx.x; e < num_kv_heads * head_dim; e += blockDim.x) {
    const int h = e / head_dim, d = e - h * head_dim;
    const int dc = d / VEC, de = d % VEC;
    k_cache[blk * kbs + (h * khs + in * kts + dc * kcs + de)] =
        to_cache<KV>(k_src[e], kv_scale(k_scale, k_scale_stride, k_scale_value, h));
    v_cache[blk * vbs + (h * vhs + in * vts + dc * vcs + de * ves)] =
        to_cache<KV>(v_src[e], kv_scale(v_scale, v_scale_stride, v_scale_value, h));
  }
}

}  // namespace decode
}  // namespace cupaged
