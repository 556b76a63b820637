// Cache kernels: scatter new key/value rows into a paged cache, copy whole blocks.
//
// Into a 16/32-bit cache the writes move bits and never convert them, so element types
// matter only through their size: rows are moved as 16-byte vectors (uint4) and the vllm
// value layout as 2- or 4-byte elements. Into an fp8 cache each 16-byte vector of input
// elements is quantised (fp8.cuh: x / scale of its kv head, saturated) to its image, a
// vector of 1-byte codes (Fp8Vec), written where the copy would write it. Every offset into a
// cache is 64-bit (i64), counted in cache vectors (an input vector's image; 16 bytes for the
// vllm layout, or elements) from the cache's base pointer, which the host checks is 16-byte
// aligned. Slots and block ids come from device arrays and are checked here: a slot outside
// [0, num_slots) or a block outside the cache is reported (report_error) and skipped.
#include "common.cuh"
#include "abi.cuh"
#include "fp8.cuh"
#include "index_checks.cuh"
#include "mma.cuh"  // cp_async16

namespace cupaged {

// THREADS, WRITE_UNROLL (tokens a thread group of write_rows), ROWS_UNROLL (16-byte loads
// a thread and row in flight in gather_kv), VLLM_TILE
// (tokens a CTA of write_vllm), COPY_UNROLL (vectors in flight a thread of
// copy_blocks_kernel) and GATHER_UNIT (elements a thread of gather_kv moves at a time):
// from cupaged.cache_ops.api
using namespace cache;

// The cache's image of one 16-byte input vector. Bits: the vector itself. A kv head's scale
// is prepared once (scale) for every vector put with it.
struct Bits {
  typedef uint4 Out;
  struct Scale {};
  __device__ static __forceinline__ Scale scale(float) { return {}; }
  __device__ static __forceinline__ Out put(const uint4& in, Scale) { return in; }
};

// N 1-byte codes as one vector (uint2 or a 4-byte word) from N / 4 words.
template <int N> struct CodesOf;
template <> struct CodesOf<8> {
  typedef uint2 Out;
  __device__ static __forceinline__ Out make(const u32 (&w)[2]) { return make_uint2(w[0], w[1]); }
};
template <> struct CodesOf<4> {
  typedef u32 Out;
  __device__ static __forceinline__ Out make(const u32 (&w)[1]) { return w[0]; }
};

// fp8 codes of the 16 / sizeof(In) elements of an input vector (In: __half,
// __nv_bfloat16 or float), each x / scale quantised to format KV (fp8.cuh: the division's
// quotient from one reciprocal per vector where that is exact).
template <typename In, typename KV>
struct Fp8Vec {
  static constexpr int N = 16 / sizeof(In);
  typedef typename CodesOf<N>::Out Out;
  template <bool RECIPROCAL>
  __device__ static __forceinline__ Out encode(const uint4& in, float scale, float r) {
    const In* e = reinterpret_cast<const In*>(&in);
    u32 w[N / 4];
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const float x[4] = {to_float<In>(e[4 * i]), to_float<In>(e[4 * i + 1]),
                          to_float<In>(e[4 * i + 2]), to_float<In>(e[4 * i + 3])};
      w[i] = fp8_encode4<KV, RECIPROCAL>(x, scale, r);
    }
    return CodesOf<N>::make(w);
  }
  struct Scale {
    float s, r;  // the scale and its reciprocal, 0 where quotients need the division
  };
  __device__ static __forceinline__ Scale scale(float s) {
    return {s, fp8_reciprocal_exact(s) ? 1.0f / s : 0.0f};
  }
  __device__ static __forceinline__ Out put(const uint4& in, Scale sc) {
    return sc.r != 0.0f ? encode<true>(in, sc.s, sc.r) : encode<false>(in, sc.s, 0.0f);
  }
};

// -- write_rows: NHD ([b, o, h, :]) and HND ([b, h, o, :]) layouts --------------------------
// Grid:  x = passes of WRITE_UNROLL * (THREADS >> tpt_log2) tokens, y = vector steps
// (ceil(row_vecs / tpt)).
// Block: THREADS threads in groups of tpt = 1 << tpt_log2 threads; a group owns WRITE_UNROLL
// tokens of the pass, THREADS >> tpt_log2 apart. Each thread copies vector v = step * tpt +
// lane (if v < row_vecs) of its tokens' key and value rows ([num_kv_heads, head_dim] =
// row_vecs vectors, head_vecs per head; key[t, h] at t * key_tok + h * key_head vectors) to
// the tokens' slots as Q puts them (Bits, or Fp8Vec with head h's scales).
// The rows go by cp.async into the thread's own shared-memory slots ([2 (key, value)]
// [WRITE_UNROLL][THREADS] vectors), all of them before any store and whatever the slots, so
// the bytes in flight are not bounded by the registers (the fp8 encode's bound the CTAs an
// SM). No thread reads another's slots: there is no barrier. Tokens with slot -1 are not
// written.
__device__ __forceinline__ i64 checked_block(i64 slot, i64 num_slots, int block_size,
                                             long long* err, int t) {
  if (slot < 0) return -1;
  if (slot >= num_slots) {
    report_error(err, error_code(ARG_SLOT_MAPPING, CHECK_RANGE), t, -1, slot, num_slots);
    return -1;
  }
  // a 32-bit division where the slot allows (a 64-bit one is a long software sequence)
  return slot <= INT32_MAX_ ? (i64)((u32)slot / (u32)block_size) : slot / block_size;
}

template <bool HND, typename Q>
__global__ void __launch_bounds__(THREADS) write_rows(CUPAGED_PARAMS_CacheWriteArgs) {
  typedef typename Q::Out Out;
  extern __shared__ uint4 s_rows[];  // [2][WRITE_UNROLL][THREADS]
  const int tokens_per_pass = THREADS >> tpt_log2;
  const int lane = threadIdx.x & ((1 << tpt_log2) - 1);
  const int v = (blockIdx.y << tpt_log2) + lane;
  if (v >= row_vecs) return;
  const int t0 = blockIdx.x * tokens_per_pass * WRITE_UNROLL + (threadIdx.x >> tpt_log2);
  const int h = v / head_vecs, c = v - h * head_vecs;
  uint4* s_key = s_rows + threadIdx.x;  // token u's vectors at s_key[u * THREADS], s_val[...]
  uint4* s_val = s_key + WRITE_UNROLL * THREADS;
  // -- every token's vectors in flight, skipped slots' too (no wait for the slots) --
#pragma unroll
  for (int u = 0; u < WRITE_UNROLL; ++u) {
    const i64 t = t0 + u * tokens_per_pass;
    if (t < num_tokens) {
      cp_async16(s_key + u * THREADS, key + t * key_tok + h * key_head + c);
      cp_async16(s_val + u * THREADS, value + t * value_tok + h * value_head + c);
    }
  }
  cp_async_commit();
  // -- the slots and scales while the rows land, then the rows placed --
  i64 slot[WRITE_UNROLL];
#pragma unroll
  for (int u = 0; u < WRITE_UNROLL; ++u) {
    const int t = t0 + u * tokens_per_pass;
    slot[u] = t < num_tokens ? __ldg(slot_mapping + t) : -1;
  }
  const typename Q::Scale ks = Q::scale(kv_scale(k_scale, k_scale_stride, k_scale_value, h));
  const typename Q::Scale vs = Q::scale(kv_scale(v_scale, v_scale_stride, v_scale_value, h));
  cp_async_wait<0>();
  Out* k_rows = static_cast<Out*>(k_cache);
  Out* v_rows = static_cast<Out*>(v_cache);
#pragma unroll
  for (int u = 0; u < WRITE_UNROLL; ++u) {
    const i64 blk = checked_block(slot[u], num_slots, block_size, v == 0 ? err : nullptr,
                                  t0 + u * tokens_per_pass);  // one thread a token reports
    if (blk < 0) continue;
    const i64 off = slot[u] - blk * block_size;
    const i64 in = HND ? ((i64)h * block_size + off) * head_vecs + c : off * row_vecs + v;
    k_rows[blk * k_block + in] = Q::put(s_key[u * THREADS], ks);
    v_rows[blk * v_block + in] = Q::put(s_val[u * THREADS], vs);
  }
}

// -- write_vllm: key [b, h, d / X, o, X] (X elements = 16 bytes), value [b, h, d, o] -------
// Grid:  x = ceil(num_tokens / VLLM_TILE) token tiles, y = num_kv_heads (head h).
// Block: THREADS threads.
// Stage 1: the tile's key and value rows of head h (head_vecs 16-byte input vectors each)
// are loaded, coalesced along each row, and put (Q: Bits, or Fp8Vec with head h's scales)
// into shared memory as cache rows of cache_vecs 16-byte vectors; rows are padded to an odd
// number of vectors so that 8 lanes reading one vector of 8 different rows hit distinct
// banks.
// Stage 2: lanes run over the tile's tokens (lane = token) and vectors over warps: a thread
// stores key vector j of its token as one 16 bytes and value vector j as X elements, so
// tokens in consecutive slots of a block make contiguous stores. Slot -1 tokens are skipped.
template <typename E, typename Q>  // E: an unsigned type of the cache element's size (1, 2, 4)
__global__ void __launch_bounds__(THREADS) write_vllm(CUPAGED_PARAMS_CacheWriteArgs) {
  typedef typename Q::Out Out;
  constexpr int X = 16 / sizeof(E);
  constexpr int R = 16 / sizeof(Out);  // input vectors a cache vector holds
  uint4* k_vecs = static_cast<uint4*>(k_cache);
  E* v_elems = static_cast<E*>(v_cache);
  extern __shared__ uint4 smem[];  // [2][VLLM_TILE][row_stride]
  __shared__ i64 s_blk[VLLM_TILE];
  __shared__ int s_off[VLLM_TILE];
  const int cache_vecs = head_vecs / R;
  const int row_stride = cache_vecs | 1;
  uint4* s_key = smem;
  uint4* s_val = smem + VLLM_TILE * row_stride;
  const int t0 = blockIdx.x * VLLM_TILE;
  const int h = blockIdx.y;
  const int tile = min(VLLM_TILE, num_tokens - t0);

  // -- slots of the tile (head 0's CTAs report) --
  if (threadIdx.x < VLLM_TILE) {
    const int t = t0 + threadIdx.x;
    const i64 slot = threadIdx.x < tile ? __ldg(slot_mapping + t) : -1;
    const i64 blk = checked_block(slot, num_slots, block_size, h == 0 ? err : nullptr, t);
    s_blk[threadIdx.x] = blk;
    s_off[threadIdx.x] = (int)(slot - blk * block_size);
  }
  // -- stage 1: rows of head h into shared memory --
  const typename Q::Scale ks = Q::scale(kv_scale(k_scale, k_scale_stride, k_scale_value, h));
  const typename Q::Scale vs = Q::scale(kv_scale(v_scale, v_scale_stride, v_scale_value, h));
  Out* s_key_out = reinterpret_cast<Out*>(s_key);
  Out* s_val_out = reinterpret_cast<Out*>(s_val);
  for (int i = threadIdx.x; i < tile * head_vecs; i += THREADS) {
    const int tok = i / head_vecs, j = i - tok * head_vecs;
    const i64 t = t0 + tok;
    const uint4 kv = __ldg(key + t * key_tok + (i64)h * key_head + j);
    const uint4 vv = __ldg(value + t * value_tok + (i64)h * value_head + j);
    s_key_out[tok * row_stride * R + j] = Q::put(kv, ks);
    s_val_out[tok * row_stride * R + j] = Q::put(vv, vs);
  }
  __syncthreads();

  // -- stage 2: lane = token; key vectors whole, value vectors element by element --
  const int head_dim = cache_vecs * X;
  for (int i = threadIdx.x; i < VLLM_TILE * cache_vecs; i += THREADS) {
    const int tok = i % VLLM_TILE, j = i / VLLM_TILE;
    const i64 blk = s_blk[tok];
    if (blk < 0) continue;
    const int off = s_off[tok];
    k_vecs[blk * k_block + ((i64)h * cache_vecs + j) * block_size + off] =
        s_key[tok * row_stride + j];
    const uint4 vv = s_val[tok * row_stride + j];
    const E* e = reinterpret_cast<const E*>(&vv);
    E* v_dst = v_elems + blk * v_block * X + ((i64)h * head_dim + (i64)j * X) * block_size + off;
#pragma unroll
    for (int x = 0; x < X; ++x) v_dst[(i64)x * block_size] = e[x];
  }
}

// -- copy_blocks_kernel: whole blocks, src[pairs[p][0]] -> dst[pairs[p][1]] -----------------
// Grid:  x = pair p, y = chunks of a block (grid-strided), z = cache (0: src0 -> dst0,
// 1: src1 -> dst1; key and value caches in one launch).
// Block: THREADS threads; each moves up to COPY_UNROLL 16-byte vectors per chunk, all loads
// before all stores. Sources are never destinations (checked on the host, or in strict
// mode for device pairs), so the copies of one launch are independent. A pair outside
// [0, num_src) x [0, num_dst) is reported and skipped. Pointers may be device memory or
// mapped pinned host memory.
__global__ void __launch_bounds__(THREADS) copy_blocks_kernel(CUPAGED_PARAMS_CopyBlocksArgs) {
  const uint4* src = blockIdx.z ? src1 : src0;
  uint4* dst = blockIdx.z ? dst1 : dst0;
  const i64 s = __ldg(pairs + 2 * (i64)blockIdx.x), d = __ldg(pairs + 2 * (i64)blockIdx.x + 1);
  if (s < 0 || s >= num_src || d < 0 || d >= num_dst) {
    if (threadIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
      const bool bad_src = s < 0 || s >= num_src;
      report_error(err, error_code(ARG_BLOCK_MAPPING, CHECK_RANGE), blockIdx.x, bad_src ? 0 : 1,
                   bad_src ? s : d, bad_src ? num_src : num_dst);
    }
    return;
  }
  src += s * block_vecs;
  dst += d * block_vecs;
  const i64 chunk = (i64)THREADS * COPY_UNROLL;
  for (i64 v0 = blockIdx.y * chunk + threadIdx.x; v0 < block_vecs; v0 += gridDim.y * chunk) {
    uint4 r[COPY_UNROLL];
#pragma unroll
    for (int u = 0; u < COPY_UNROLL; ++u) {
      const i64 v = v0 + u * THREADS;
      if (v < block_vecs) r[u] = src[v];
    }
#pragma unroll
    for (int u = 0; u < COPY_UNROLL; ++u) {
      const i64 v = v0 + u * THREADS;
      if (v < block_vecs) dst[v] = r[u];
    }
  }
}


// -- gather_kv: a batch's cached key and value rows, packed, as 16-bit elements -------------
// Grid:  x = CTAs a sequence (grid-strided over its tokens), y = sequence b (b >= batch: none).
// Block: THREADS threads in groups of tpt = 1 << tpt_log2 threads, as write_rows: a group
// owns TOKENS tokens of a pass (below), THREADS >> tpt_log2 apart, and each of its threads the
// units v = lane, lane + tpt, ... < num_kv_heads * units of their rows (unit c of head h:
// GATHER_UNIT elements, 16 bytes of a 16-bit cache or 8 of an fp8 one, one 16-byte output
// vector), all loads of a step before its stores. Sequence b's rows start at the lengths
// before it (each CTA sums them: lengths are read on the device, never by the host), which
// CTA (0, b) writes to cu_k[b + 1] (and CTA (0, 0) cu_k[0] = 0) for the ragged launch that
// follows; a length that is negative or past the block-table row (max_blocks blocks) is
// reported (keys_fit) and counts as 0. Token t lands at row cu_k[b] + t: a 16-bit unit as it is, an
// fp8 one (KV) widened to T exactly (fp8.cuh: every e4m3 and e5m2 value is a 16-bit value);
// the scales stay with the attention kernel, which applies them in fp32 as it does to the
// cache. Keys are whole units in every layout; values are too but in the vllm layout (V_T:
// dims block_size elements apart, read one by one). Each CTA checks the block ids of its
// sequence's row first (table_row_ok, reported by CTA x = 0): a sequence with one outside
// the cache has every row written as zeros, so that its outputs come out as zeros (zero
// values), as from the paged kernels.
__device__ __forceinline__ int gathered_len(int len, int max_blocks, int block_size,
                                            long long* err, int b) {
  return keys_fit(len, len, max_blocks, block_size, err, b) ? len : 0;
}

template <bool FP8> struct UnitOf { typedef uint4 type; };  // a unit's elements as loaded
template <> struct UnitOf<true> { typedef uint2 type; };

template <typename T, typename KV, bool V_T>
__global__ void __launch_bounds__(THREADS) gather_kv(CUPAGED_PARAMS_GatherKVArgs) {
  constexpr bool FP8 = Fp8Traits<KV>::FP8;
  constexpr int UNIT = GATHER_UNIT;
  constexpr int PER_CHUNK = 16 / sizeof(KV) / UNIT;  // units of a 16-byte cache chunk
  typedef typename UnitOf<FP8>::type In;
  static_assert(sizeof(In) == UNIT * sizeof(KV) && UNIT * sizeof(T) == sizeof(uint4), "a unit");
  // tokens of a group's pass: ROWS_UNROLL 16-byte loads a thread and row in flight, as
  // write_rows keeps, whatever the unit's size (an fp8 unit is 8 bytes: twice the tokens)
  constexpr int TOKENS = ROWS_UNROLL * (int)(sizeof(uint4) / sizeof(In));
  __shared__ i64 s_part[THREADS / 32];
  const int b = blockIdx.y;
  if (b >= batch) return;
  // -- the rows before sequence b: the valid lengths of sequences 0 .. b - 1 --
  i64 first = 0;
  for (int i = threadIdx.x; i < b; i += THREADS)
    first += gathered_len(__ldg(seq_lens + i), max_blocks, block_size, nullptr, i);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) first += __shfl_xor_sync(0xffffffffu, first, o);
  if ((threadIdx.x & 31) == 0) s_part[threadIdx.x >> 5] = first;
  __syncthreads();
  first = 0;
#pragma unroll
  for (int w = 0; w < THREADS / 32; ++w) first += s_part[w];
  const bool lead = blockIdx.x == 0 && threadIdx.x == 0;
  const int len = gathered_len(__ldg(seq_lens + b), max_blocks, block_size, lead ? err : nullptr, b);
  if (lead) {
    cu_k[b + 1] = (int)(first + len);
    if (b == 0) cu_k[0] = 0;
  }
  const int* table = block_tables + (i64)b * bt_stride;
  const bool ok = table_row_ok<THREADS>(table, (len + block_size - 1) / block_size, num_blocks,
                                        blockIdx.x == 0 ? err : nullptr, b);
  const KV* kc = static_cast<const KV*>(k_cache);
  const KV* vc = static_cast<const KV*>(v_cache);
  const int tpt = 1 << tpt_log2, tokens_per_pass = THREADS >> tpt_log2;
  const int row_vecs = num_kv_heads * units;
  const int step = gridDim.x * tokens_per_pass * TOKENS;
  for (int t0 = blockIdx.x * tokens_per_pass * TOKENS + (threadIdx.x >> tpt_log2); t0 < len;
       t0 += step) {
    i64 blk[TOKENS];
    int off[TOKENS];
#pragma unroll
    for (int u = 0; u < TOKENS; ++u) {
      const int t = t0 + u * tokens_per_pass;
      blk[u] = ok && t < len ? __ldg(table + t / block_size) : -1;
      off[u] = t % block_size;
    }
    for (int v = threadIdx.x & (tpt - 1); v < row_vecs; v += tpt) {
      // -- load every token's units, then store them --
      const int h = v / units, c = v - h * units;
      const i64 in_chunk = (i64)(c / PER_CHUNK) * k_chunk + (c % PER_CHUNK) * UNIT;
      In kk[TOKENS], vv[TOKENS];
#pragma unroll
      for (int u = 0; u < TOKENS; ++u) {
        kk[u] = vv[u] = In{};
        if (blk[u] < 0) continue;
        const i64 k_at = blk[u] * k_block + (i64)h * k_head + (i64)off[u] * k_tok + in_chunk;
        kk[u] = __ldg(reinterpret_cast<const In*>(kc + k_at));
        const i64 v_at = blk[u] * v_block + (i64)h * v_head + (i64)off[u] * v_tok;
        if constexpr (V_T) {
          KV* e = reinterpret_cast<KV*>(&vv[u]);
#pragma unroll
          for (int x = 0; x < UNIT; ++x) e[x] = vc[v_at + (i64)(c * UNIT + x) * v_dim];
        } else {
          vv[u] = __ldg(reinterpret_cast<const In*>(vc + v_at + c * UNIT));
        }
      }
#pragma unroll
      for (int u = 0; u < TOKENS; ++u) {
        const int t = t0 + u * tokens_per_pass;
        if (t >= len) continue;
        const i64 at = ((first + t) * num_kv_heads + h) * units + c;
        if constexpr (FP8) {
          u32 ko[4], vo[4];
          widen_fp8x4<T, KV>(kk[u].x, ko[0], ko[1]);
          widen_fp8x4<T, KV>(kk[u].y, ko[2], ko[3]);
          widen_fp8x4<T, KV>(vv[u].x, vo[0], vo[1]);
          widen_fp8x4<T, KV>(vv[u].y, vo[2], vo[3]);
          k_out[at] = make_uint4(ko[0], ko[1], ko[2], ko[3]);
          v_out[at] = make_uint4(vo[0], vo[1], vo[2], vo[3]);
        } else {
          k_out[at] = kk[u];
          v_out[at] = vv[u];
        }
      }
    }
  }
}

}  // namespace cupaged
