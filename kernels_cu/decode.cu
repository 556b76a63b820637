// Paged decode: one query token per sequence against a paged KV cache, split-KV + merge.
//
//   append_kv_kernel     writes k_new / v_new at position seq_lens[b] (in-place append)
//   paged_decode_kernel  one CTA per (split, kv head x head chunk, sequence): streams its K/V
//                        tiles through a cp.async pipeline into shared memory and serves every
//                        query head of the kv head from them (K/V read once per group)
//   merge_states_kernel  combines split partials (adding sinks once) or two states
//
// Why tensor cores: per token and kv head decode reads 4*D bytes of 16-bit K/V and does
// 4*G*D flops (q.k and p.v for the G = Hq/Hk query heads sharing them): G flops per byte.
// At ~4.4 TB/s that is 4.4*G TFLOP/s: 18 for G = 4, 35 for G = 8, 141 for MQA's G = 32,
// against ~67 TFLOP/s of fp32 FMA peak (less after bf16 unpacking and shared-memory reads).
// mma.sync m16n8k16 (hundreds of TFLOP/s) keeps every group size memory-bound, and padding
// the group to the 8 columns of N wastes nothing that matters. So the 16-bit path puts tokens
// on M and the head group on N: S^T = K Q^T, then O^T = V^T P^T, where P^T reaches the B
// layout from the S^T accumulators by one movmatrix.trans per 8x8 (no shared memory round
// trip). fp32 caches (tests) take a CUDA-core path with the same fragment layouts.
//
// Fragment layouts in a warp (qr = lane / 4, r = lane % 4):
//   s[nt][k]       score of token qr + 8 * (k >> 1) of a 16-token m-tile, head nt*8 + 2r + (k&1)
//   acc[dt][nt][k] output dim dt*16 + qr + 8 * (k >> 1), head nt*8 + 2r + (k & 1)
#include "common.cuh"
#include "mma.cuh"
#include "merge.cuh"

namespace cupaged {
namespace decode {

typedef unsigned long long u64;

constexpr int NTHREADS = 128;
constexpr int NWARPS = NTHREADS / 32;
constexpr int STAGES = 3;  // K/V tiles in flight per CTA: STAGES - 1 while one is consumed

// Compile-time geometry of one (element type, head dim, n8 head tiles per warp); mirrored by
// decode_plan.tile_config. NT = 2 (16 heads a warp) serves large groups on 16-bit caches.
template <typename T, int D, int NT_ = 1>
struct Cfg {
  static constexpr int VEC = 16 / sizeof(T);  // elements per 16-byte chunk
  static constexpr int CPR = D / VEC;         // chunks per K/V row
  static constexpr int ROW_BYTES = D * (int)sizeof(T);
  static constexpr int TILE = ROW_BYTES <= 256 ? 64 : ROW_BYTES <= 512 ? 32 : 16;  // tokens/stage
  static constexpr int MTILES = TILE / 16;
  static constexpr int NT = NT_;              // n8 head tiles per warp
  static constexpr int HW = 8 * NT;            // query heads per warp
  static constexpr int DT = D / 16;
  static constexpr int KROW = D + VEC;         // padded smem row: ldmatrix rows hit 8 bank quads
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

// ---------------------------------------------------------------------------- tile math
// 16-bit K/V: both products on tensor cores. Q^T stays in registers as B fragments.
template <typename T, int D, bool VT, int NT>
struct MmaMath {
  using C = Cfg<T, D, NT>;
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

template <typename T, int D, bool VT, int NT> struct MathFor { using type = MmaMath<T, D, VT, NT>; };
template <int D, bool VT, int NT> struct MathFor<float, D, VT, NT> { using type = SimtMath<D, VT, NT>; };

// ---------------------------------------------------------------------------- tile loader
// Cache strides in elements: element (block, head, token in block, dim) sits at
// block*block + head*head + token*tok + (dim / VEC)*chunk + (dim % VEC)*elem. Everything but
// block*block fits in 32 bits (the host checks a block's size); that product is 64-bit.
struct Strides {
  int block, head, tok, chunk, elem;
};

// Gathers tile `tile` (tokens [tile*TILE, tile*TILE + TILE)) of one (sequence, kv head) into
// shared memory with 16-byte cp.async; tokens outside [lo, kv_len) are zero-filled so that
// their (masked) scores and values stay finite. Block ids of a tile are fetched one pipeline
// step before its copies are issued, so the id loads' latency hides behind a tile's math.
template <typename T, int D, bool VT>
struct Loader {
  using C = Cfg<T, D>;
  struct Ids { int k[C::ITEMS]; int v; };

  const T* k_head;
  const T* v_head;
  const int* bt;
  Strides ks, vs;
  int block_size;
  unsigned magic;  // token / block_size == (token * magic) >> shift for tokens < 2^31
  int shift;
  int lo, kv_len, tid;
  bool vt_whole;   // block_size % VEC == 0: a 16-byte token group never straddles blocks

  __device__ __forceinline__ int block_of(int tok) const {
    return (int)(((u64)(unsigned)tok * magic) >> shift);
  }
  __device__ __forceinline__ bool visible(int tok) const { return tok >= lo && tok < kv_len; }
  __device__ __forceinline__ int v_dim(int d) const {
    return (d / C::VEC) * vs.chunk + (d % C::VEC) * vs.elem;
  }
  __device__ __forceinline__ int vt_group_token(int tile) const {
    return tile * C::TILE + (tid % C::GPT) * C::VEC;
  }
  __device__ __forceinline__ bool vt_group_whole(int tok_g) const {
    return vt_whole && tok_g >= lo && tok_g + C::VEC <= kv_len;
  }
  __device__ __forceinline__ bool vt_group_empty(int tok_g) const {
    return tok_g + C::VEC <= lo || tok_g >= kv_len;
  }

  __device__ void fetch(int tile, Ids& ids) const {
#pragma unroll
    for (int i = 0; i < C::ITEMS; ++i) {
      const int tok = tile * C::TILE + (tid + i * NTHREADS) / C::CPR;
      ids.k[i] = visible(tok) ? __ldg(bt + block_of(tok)) : 0;
    }
    if (VT) {
      const int tok_g = vt_group_token(tile);
      ids.v = vt_group_whole(tok_g) ? __ldg(bt + block_of(tok_g)) : 0;
    }
  }

  __device__ void issue(int tile, const Ids& ids, T* k_s, T* v_s) const {
#pragma unroll
    for (int i = 0; i < C::ITEMS; ++i) {
      const int idx = tid + i * NTHREADS;
      const int row = idx / C::CPR, c = idx % C::CPR;
      const int tok = tile * C::TILE + row;
      const bool ok = visible(tok);
      const int in = tok - block_of(tok) * block_size;
      const T* k_src = k_head + (i64)ids.k[i] * ks.block + (in * ks.tok + c * ks.chunk);
      cp_async16(k_s + row * C::KROW + c * C::VEC, ok ? k_src : k_head, ok ? 16 : 0);
      if (!VT) {
        const T* v_src = v_head + (i64)ids.k[i] * vs.block + (in * vs.tok + c * vs.chunk);
        cp_async16(v_s + row * C::KROW + c * C::VEC, ok ? v_src : v_head, ok ? 16 : 0);
      }
    }
    if (VT) issue_vt(tile, ids.v, v_s);
  }

  // Transposed V tile [D][TILE] from the vllm value layout [.., D, block_size].
  __device__ void issue_vt(int tile, int blk_id, T* v_s) const {
    const int tok_g = vt_group_token(tile);
    T* dst = v_s + (tid % C::GPT) * C::VEC;
    const bool whole = vt_group_whole(tok_g);
    if (whole || vt_group_empty(tok_g)) {
      const T* src = v_head + (i64)blk_id * vs.block + (tok_g - block_of(tok_g) * block_size) * vs.tok;
#pragma unroll
      for (int i = 0; i < C::ITEMS; ++i) {
        const int d = (tid + i * NTHREADS) / C::GPT;
        cp_async16(dst + d * C::VTROW, whole ? src + v_dim(d) : v_head, whole ? 16 : 0);
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
        e16[e] = visible(tok) ? v_head[(i64)bt[slot] * vs.block + (tok - slot * block_size) * vs.tok + v_dim(d)]
                              : from_float<T>(0.f);
      }
      *reinterpret_cast<uint4*>(dst + d * C::VTROW) = raw;
    }
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
      m[nt][0] = m[nt][1] = minus_inf();
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
        const float m_use = m_new == minus_inf() ? 0.f : m_new;
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
        const float m_use = m_new == minus_inf() ? 0.f : m_new;
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

// Score epilogue in design.md's order: scale, soft-cap, ALiBi; then the visibility mask.
// Output in log2 units (exp2-based softmax).
struct ScoreMods {
  float scale_log2, sm_scale, soft_cap, inv_cap;
  bool plain;  // no soft-cap, no ALiBi: one multiply
  int lo, kv_len, pos;

  template <int NT>
  __device__ __forceinline__ void apply(float (&s)[NT][4], const float (&slope)[NT][2], int tok0,
                                        int qr) const {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int tok = tok0 + qr + 8 * (k >> 1);
        float x = s[nt][k];
        if (plain) {
          x *= scale_log2;
        } else {
          x *= sm_scale;
          if (soft_cap > 0.f) x = soft_cap * tanhf(x * inv_cap);
          x = (x + slope[nt][k & 1] * (float)(tok - pos)) * LOG2E;
        }
        s[nt][k] = (tok >= lo && tok < kv_len) ? x : minus_inf();
      }
  }
};

// Final rows of one warp: with one split, out (q's dtype, sink in the denominator) and lse;
// otherwise the split's fp32 partial (normalised over its keys) and natural-log lse.
template <typename T, int D, int NT>
__device__ __forceinline__ void write_rows(const SoftmaxState<NT, D / 16>& st, int warp_heads,
                                           i64 row0, int split, int num_splits,
                                           const float* __restrict__ sinks, int hq0,
                                           T* __restrict__ out, float* __restrict__ lse,
                                           float* __restrict__ part_out,
                                           float* __restrict__ part_lse, int lane) {
  const int qr = lane >> 2, r = lane & 3;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int h = nt * 8 + 2 * r + j;
      if (h >= warp_heads) continue;
      const i64 row = row0 + h;
      const float m = st.m[nt][j], l = st.l[nt][j];
      float scale, row_lse;
      if (num_splits == 1) {
        const float sink2 = sinks != nullptr ? sinks[hq0 + h] * LOG2E : minus_inf();
        const float m_all = fmaxf(m, sink2);
        const float m_use = m_all == minus_inf() ? 0.f : m_all;
        const float sc = fast_exp2(m - m_use);
        const float den = l * sc + fast_exp2(sink2 - m_use);
        scale = den > 0.f ? sc / den : 0.f;
        row_lse = den > 0.f ? (m_use + log2f(den)) * LN2 : minus_inf();
      } else {
        scale = l > 0.f ? 1.f / l : 0.f;
        row_lse = l > 0.f ? (m + log2f(l)) * LN2 : minus_inf();
      }
#pragma unroll
      for (int dt = 0; dt < D / 16; ++dt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int d = dt * 16 + qr + 8 * hh;
          const float v = st.acc[dt][nt][2 * hh + j] * scale;
          if (num_splits == 1) out[row * D + d] = from_float<T>(v);
          else part_out[(row * num_splits + split) * D + d] = v;
        }
      if (qr == 0) {
        if (num_splits > 1) part_lse[row * num_splits + split] = row_lse;
        else if (lse != nullptr) lse[row] = row_lse;
      }
    }
}

// ---------------------------------------------------------------------------- decode kernel
// grid  (num_splits, num_kv_heads * head_chunks, batch); block NTHREADS (4 warps).
// CTA (split, kv head hk, chunk hc, sequence b) owns query heads [hc*HPC, hc*HPC + HPC) of
// hk's group (HPC = head_warps * HW) and key tiles [t_begin, t_end) of b's visible range.
// Every thread issues cp.async copies of the tiles; warp w serves heads
// (w % head_warps)*HW.. of the CTA on the m-tiles w / head_warps, + token_warps, ... of each
// tile with its own online softmax; warps of one head set then combine through shared
// memory. Output: with one split the final out/lse (sink included), else an fp32 partial
// (out normalised over the split's keys, natural-log lse, sink excluded) for the merge.
template <typename T, int D, bool VT, int NT>
__global__ void __launch_bounds__(NTHREADS, 1)
paged_decode_kernel(const T* __restrict__ q, T* __restrict__ out, float* __restrict__ lse,
                    float* __restrict__ part_out, float* __restrict__ part_lse,
                    const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                    const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
                    const float* __restrict__ alibi_slopes, const float* __restrict__ sinks,
                    int kbs, int khs, int kts, int kcs, int vbs, int vhs, int vts, int vcs, int ves,
                    int block_size, unsigned block_magic, int block_shift, int bt_stride,
                    int num_q_heads, int num_kv_heads, int head_warps, int head_chunks,
                    int num_splits, int append, int window_left, float scale_log2, float sm_scale,
                    float soft_cap) {
  using C = Cfg<T, D, NT>;
  using Math = typename MathFor<T, D, VT, NT>::type;
  using State = SoftmaxState<NT, C::DT>;
  constexpr int STAGE = C::K_ELEMS + (VT ? C::V_ELEMS_T : C::V_ELEMS_ROWS);
  static_assert(NWARPS * State::FLOATS * 32 * 4 <= STAGES * STAGE * (int)sizeof(T),
                "the combine buffer fits in the tiles it aliases");
  extern __shared__ __align__(16) unsigned char smem[];
  T* tiles = reinterpret_cast<T*>(smem);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int split = blockIdx.x, b = blockIdx.z;
  const int hk = blockIdx.y / head_chunks, hc = blockIdx.y % head_chunks;
  const int group = num_q_heads / num_kv_heads;

  // -- keys of this CTA: tiles [t_begin, t_end) of the visible range [lo, kv_len) --
  const int kv_len = seq_lens[b] + append;
  const int pos = kv_len - 1;  // the query's position
  const int lo = window_left >= 0 ? max(0, pos - window_left) : 0;
  const int first_tile = lo / C::TILE;
  const int n_tiles = kv_len > 0 ? (kv_len + C::TILE - 1) / C::TILE - first_tile : 0;
  const int per_split = (n_tiles + num_splits - 1) / num_splits;
  const int t_begin = first_tile + min(split * per_split, n_tiles);
  const int t_end = first_tile + min((split + 1) * per_split, n_tiles);

  // -- warp roles --
  const int token_warps = NWARPS / head_warps;
  const int hg = warp % head_warps, tg = warp / head_warps;
  const int g_warp = hc * head_warps * C::HW + hg * C::HW;  // first head of the warp in the group
  const int warp_heads = max(0, min(group - g_warp, C::HW));
  const bool computes = tg < token_warps && warp_heads > 0;
  const int nt_used = (warp_heads + 7) / 8;
  const int hq_warp = hk * group + g_warp;

  Loader<T, D, VT> ld;
  ld.k_head = k_cache + (i64)hk * khs;
  ld.v_head = v_cache + (i64)hk * vhs;
  ld.bt = block_tables + (i64)b * bt_stride;
  ld.ks = Strides{kbs, khs, kts, kcs, 1};
  ld.vs = Strides{vbs, vhs, vts, vcs, ves};
  ld.block_size = block_size;
  ld.magic = block_magic;
  ld.shift = block_shift;
  ld.lo = lo;
  ld.kv_len = kv_len;
  ld.tid = tid;
  ld.vt_whole = block_size % C::VEC == 0;
  auto k_stage = [&](int st) { return tiles + st * STAGE; };
  auto v_stage = [&](int st) { return tiles + st * STAGE + C::K_ELEMS; };

  // -- prologue: STAGES - 1 tiles in flight, ids of the next one on their way --
  typename Loader<T, D, VT>::Ids pro[STAGES - 1], next;
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st)
    if (t_begin + st < t_end) ld.fetch(t_begin + st, pro[st]);
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (t_begin + st < t_end) ld.issue(t_begin + st, pro[st], k_stage(st), v_stage(st));
    cp_async_commit();
  }
  if (t_begin + STAGES - 1 < t_end) ld.fetch(t_begin + STAGES - 1, next);

  Math math;
  float* q_smem = reinterpret_cast<float*>(smem + STAGES * STAGE * sizeof(T)) + warp * C::HW * C::QROW;
  if (computes) math.load_q(q + ((i64)b * num_q_heads + hq_warp) * D, warp_heads, q_smem, lane);

  const ScoreMods mods{scale_log2, sm_scale, soft_cap, soft_cap > 0.f ? 1.f / soft_cap : 0.f,
                       soft_cap <= 0.f && alibi_slopes == nullptr, lo, kv_len, pos};
  float slope[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int h = nt * 8 + 2 * (lane & 3) + j;
      slope[nt][j] = (alibi_slopes != nullptr && h < warp_heads) ? alibi_slopes[hq_warp + h] : 0.f;
    }
  State state;
  state.init();

  // -- main loop: one tile per iteration, one __syncthreads --
  for (int tile = t_begin, it = 0; tile < t_end; ++tile, ++it) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile `it` landed for all threads; slot (it - 1) % STAGES is free
    const int ahead = tile + STAGES - 1, slot = (it + STAGES - 1) % STAGES;
    if (ahead < t_end) ld.issue(ahead, next, k_stage(slot), v_stage(slot));
    cp_async_commit();
    if (ahead + 1 < t_end) ld.fetch(ahead + 1, next);
    if (!computes) continue;

    const T* k_s = k_stage(it % STAGES);
    const T* v_s = v_stage(it % STAGES);
    for (int mt = tg; mt < C::MTILES; mt += token_warps) {
      const int tok0 = tile * C::TILE + mt * 16;
      if (tok0 + 16 <= lo || tok0 >= kv_len) continue;  // all masked (warp-uniform)
      float s[NT][4];
      math.scores(k_s + mt * 16 * C::KROW, s, nt_used, lane);
      mods.apply(s, slope, tok0, lane >> 2);
      state.update(s, nt_used);
      math.pv(v_s, mt * 16, s, state.acc, nt_used, lane);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // tiles are dead: the combine buffer may alias them

  // -- combine the token warps of each head set, then write --
  state.reduce_sum();
  float* red = reinterpret_cast<float*>(smem) + lane;
  if (computes && tg > 0) state.store(red + warp * State::FLOATS * 32);
  __syncthreads();
  if (!computes || tg > 0) return;
  for (int t2 = 1; t2 < token_warps; ++t2) state.absorb(red + (t2 * head_warps + hg) * State::FLOATS * 32);
  write_rows<T, D, NT>(state, warp_heads, (i64)b * num_q_heads + hq_warp, split, num_splits,
                       sinks, hq_warp, out, lse, part_out, part_lse, lane);
}

// ---------------------------------------------------------------------------- append
// grid (batch); block 128. CTA b writes k_new[b], v_new[b] ([Hk, D] each) into the cache slot
// of position seq_lens[b]; thread i copies elements i, i + 128, ... of the Hk*D.
template <typename T>
__global__ void __launch_bounds__(128)
append_kv_kernel(const T* __restrict__ k_new, const T* __restrict__ v_new, T* __restrict__ k_cache,
                 T* __restrict__ v_cache, const int* __restrict__ block_tables,
                 const int* __restrict__ seq_lens, int bt_stride, int block_size, int num_kv_heads,
                 int head_dim, int kbs, int khs, int kts, int kcs, int vbs, int vhs, int vts, int vcs,
                 int ves) {
  constexpr int VEC = Vec16<T>::N;
  const int b = blockIdx.x;
  const int p = seq_lens[b];
  const int slot = p / block_size, in = p - slot * block_size;
  const i64 blk = block_tables[(i64)b * bt_stride + slot];
  const i64 src = (i64)b * num_kv_heads * head_dim;
  for (int e = threadIdx.x; e < num_kv_heads * head_dim; e += blockDim.x) {
    const int h = e / head_dim, d = e - h * head_dim;
    const int dc = d / VEC, de = d % VEC;
    k_cache[blk * kbs + (h * khs + in * kts + dc * kcs + de)] = k_new[src + e];
    v_cache[blk * vbs + (h * vhs + in * vts + dc * vcs + de * ves)] = v_new[src + e];
  }
}

// ---------------------------------------------------------------------------- merge
// grid ceil(num_rows / 4); block 128: warp w of CTA c merges row 4c + w (row = token * heads
// + head) over num_parts states; output rows are contiguous [num_rows][dim].
// Part s of row i: o_first/o_rest as in PartRow, offset by i * o_row_stride; lse alike.
template <typename TI, typename TO>
__global__ void __launch_bounds__(128)
merge_states_kernel(const TI* __restrict__ o_first, const TI* __restrict__ o_rest, i64 o_part_stride,
                    i64 o_row_stride, const float* __restrict__ l_first, const float* __restrict__ l_rest,
                    i64 l_part_stride, i64 l_row_stride, int num_parts, int num_rows, int num_heads,
                    int dim, const float* __restrict__ sinks, TO* __restrict__ out,
                    float* __restrict__ lse_out) {
  const int row = blockIdx.x * 4 + (threadIdx.x >> 5);
  if (row >= num_rows) return;
  const PartRow<TI> o{o_first + row * o_row_stride, o_rest + row * o_row_stride, o_part_stride};
  const PartRow<float> ls{l_first + row * l_row_stride, l_rest + row * l_row_stride, l_part_stride};
  const float sink = sinks != nullptr ? sinks[row % num_heads] : minus_inf();
  merge_row_warp<TI, TO>(o, ls, num_parts, sink, dim, out + (i64)row * dim,
                         lse_out != nullptr ? lse_out + row : nullptr);
}

}  // namespace decode
}  // namespace cupaged
