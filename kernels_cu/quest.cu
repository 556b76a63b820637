// Quest page selection for decode (cupaged/sparse/quest.py is the specification, in NumPy):
//
//   quest_bounds_kernel  per-page elementwise min and max of the keys of each kv head, over
//                        the tokens below the sequence's length
//   quest_select_kernel  per (sequence, kv head): the pages' upper-bound scores, the top_k
//                        pages (the last always), written in position order as a block table
//                        and key count of a one-kv-head view of the cache
//   quest_sinks_kernel   a sink logit folded into a decode's output and LSE afterwards
//
// Device index arrays are checked here: a bad length or block id is reported to the error
// word and never followed; the sequence's bounds stay as they were, and its selection is
// empty (length 0), so its decode rows come out as zeros.
#include "common.cuh"
#include "abi.cuh"
#include "index_checks.cuh"
#include "block_scan.cuh"
#include "topk.cuh"
#include "fp8.cuh"

namespace cupaged {
namespace quest {

// Whether sequence b's length is usable (in [0, width * block_size]); reports it otherwise.
__device__ __forceinline__ bool length_ok(int len, int width, int block_size, long long* err,
                                          int b) {
  if (len < 0) {
    report_error(err, error_code(ARG_SEQ_LENS, CHECK_RANGE), b, -1, len, INT32_MAX_);
    return false;
  }
  if ((i64)len > (i64)width * block_size) {
    report_error(err, error_code(ARG_SEQ_LENS, CHECK_TABLE), b, -1, len, (i64)width * block_size);
    return false;
  }
  return true;
}

// ---------------------------------------------------------------------------- bounds
// A bound stored as TB, rounded outward (a min down, a max up) so that it still bounds.
template <typename TB> __device__ __forceinline__ TB bound_down(float x);
template <typename TB> __device__ __forceinline__ TB bound_up(float x);
template <> __device__ __forceinline__ float bound_down<float>(float x) { return x; }
template <> __device__ __forceinline__ float bound_up<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 bound_down<__nv_bfloat16>(float x) {
  return __float2bfloat16_rd(x);
}
template <> __device__ __forceinline__ __nv_bfloat16 bound_up<__nv_bfloat16>(float x) {
  return __float2bfloat16_ru(x);
}

// e4m3 codes (no infinity): the code nearest x (saturated), moved one code outward where it
// lies on the wrong side of x. Past the largest finite value that step reaches the NaN code
// (sign | 0x7F): "unknown", read by the score kernel as an infinite bound. Zero steps to
// the smallest subnormal of the direction's sign.
template <bool UP>
__device__ __forceinline__ fp8_e4m3 e4m3_outward(float x) {
  u32 c = fp8_encode<fp8_e4m3>(x, 1.f);
  if (x == x) {
    const float v = __half2float(__ushort_as_half((unsigned short)(fp8x2_to_half2<fp8_e4m3>(c) & 0xFFFFu)));
    if (UP ? v < x : v > x)
      c = (c & 0x7Fu) == 0u ? (UP ? 0x01u : 0x81u) : ((c >> 7) == (UP ? 0u : 1u) ? c + 1 : c - 1);
  }
  return fp8_e4m3{(unsigned char)c};
}
template <> __device__ __forceinline__ fp8_e4m3 bound_down<fp8_e4m3>(float x) {
  return e4m3_outward<false>(x);
}
template <> __device__ __forceinline__ fp8_e4m3 bound_up<fp8_e4m3>(float x) {
  return e4m3_outward<true>(x);
}

// grid (pages, batch): pages = width (every page) or 1 (each sequence's last page); block
// THREADS. CTA (i, b) takes page i (or the last) of sequence b; thread t takes the 16-byte
// key chunks t, t + THREADS, ... of the page's kv heads (chunk c: head c / (D / X), dims
// X (c % (D / X)) ...) and folds its valid tokens, TOKENS loads at a time, into min and max,
// written as TB [num_blocks, Hk, D] (bound_down, bound_up). Key element (h, token, d) of
// block blk sits at blk * k_block + h * k_head + (d / X) * k_chunk + d % X + token * k_tok
// (X = 16 / sizeof(T)).
template <typename T, typename TB, int THREADS, int TOKENS>
__global__ void __launch_bounds__(THREADS) quest_bounds_kernel(CUPAGED_PARAMS_QuestBoundsArgs) {
  const QuestBoundsArgs<T, TB> a{CUPAGED_FIELDS_QuestBoundsArgs};
  constexpr int X = 16 / sizeof(T);
  const int b = blockIdx.y;
  const int len = __ldg(a.seq_lens + b);
  if (!length_ok(len, a.width, a.block_size, threadIdx.x == 0 ? a.err : nullptr, b)) return;
  const int used = (int)(((i64)len + a.block_size - 1) / a.block_size);
  const int page = a.last_page_only ? used - 1 : (int)blockIdx.x;
  if (page < 0 || page >= used) return;
  const int blk = __ldg(a.block_tables + (i64)b * a.bt_stride + page);
  if ((unsigned)blk >= (unsigned)a.num_blocks) {
    if (threadIdx.x == 0)
      report_error(a.err, error_code(ARG_BLOCK_TABLES, CHECK_RANGE), b, page, blk, a.num_blocks);
    return;
  }
  const int fill = min(a.block_size, len - page * a.block_size);
  const int chunks = a.head_dim / X;
  const T* base = a.k_cache + (i64)blk * a.k_block;
  for (int c = threadIdx.x; c < a.num_kv_heads * chunks; c += THREADS) {
    const int h = c / chunks, cc = c - h * chunks;
    const T* p = base + (i64)h * a.k_head + (i64)cc * a.k_chunk;
    float lo[X], hi[X];
    load16_float(p, lo);
#pragma unroll
    for (int e = 0; e < X; ++e) hi[e] = lo[e];
    // TOKENS rows in flight at once (a page's rows one after another would wait a memory
    // latency each)
    for (int t0 = 1; t0 < fill; t0 += TOKENS) {
      float v[TOKENS][X];
#pragma unroll
      for (int u = 0; u < TOKENS; ++u)
        if (t0 + u < fill) load16_float(p + (i64)(t0 + u) * a.k_tok, v[u]);
#pragma unroll
      for (int u = 0; u < TOKENS; ++u) {
#pragma unroll
        for (int e = 0; e < X; ++e) {
          lo[e] = t0 + u < fill ? fminf(lo[e], v[u][e]) : lo[e];
          hi[e] = t0 + u < fill ? fmaxf(hi[e], v[u][e]) : hi[e];
        }
      }
    }
    const i64 out = ((i64)blk * a.num_kv_heads + h) * a.head_dim + cc * X;
    if constexpr (sizeof(TB) == 4) {
#pragma unroll
      for (int e = 0; e < X; e += 4) {
        *reinterpret_cast<float4*>(a.k_min + out + e) =
            make_float4(lo[e], lo[e + 1], lo[e + 2], lo[e + 3]);
        *reinterpret_cast<float4*>(a.k_max + out + e) =
            make_float4(hi[e], hi[e + 1], hi[e + 2], hi[e + 3]);
      }
    } else {
#pragma unroll
      for (int e = 0; e < X; ++e) {
        a.k_min[out + e] = bound_down<TB>(lo[e]);
        a.k_max[out + e] = bound_up<TB>(hi[e]);
      }
    }
  }
}

// ---------------------------------------------------------------------------- select
// The last page takes the largest key of all, above +inf (order_key, topk.cuh: no +inf
// score may displace it).
constexpr u32 LAST_KEY = 0xffffffffu, FIRST_KEY = 0xfffffffeu;

// The selection key of page i of n: the last page above the first `first` pages, those above
// every score.
__device__ __forceinline__ u32 page_key(int i, int n, int first, float s) {
  return i == n - 1 ? LAST_KEY : (i < first ? FIRST_KEY : order_key(s));
}

// X consecutive bound dims in one load (4, 8 or 16 bytes: 4 floats, 4 or 8 bfloat16, 4 or
// 8 e4m3 codes), kept raw and widened when used. An e4m3 NaN code (an unknown bound) widens
// to NaN, which sends its page to the score kernel's term-by-term path (unknown()).
template <typename TB, int X>
struct BoundChunk {
  static constexpr int WORDS = X * (int)sizeof(TB) / 4;
  static_assert(WORDS == 1 || WORDS == 2 || WORDS == 4, "4-, 8- or 16-byte chunks");
  u32 w[WORDS];
  __device__ __forceinline__ void load(const TB* p) {
    if constexpr (WORDS == 4) {
      const uint4 r = __ldg(reinterpret_cast<const uint4*>(p));
      w[0] = r.x; w[1] = r.y; w[2] = r.z; w[3] = r.w;
    } else if constexpr (WORDS == 2) {
      const uint2 r = __ldg(reinterpret_cast<const uint2*>(p));
      w[0] = r.x; w[1] = r.y;
    } else {
      w[0] = __ldg(reinterpret_cast<const unsigned*>(p));
    }
  }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < WORDS; ++i) w[i] = 0u;
  }
  // Dims 2i and 2i + 1 (widened where used: fewer values live at once than get's X).
  __device__ __forceinline__ float2 pair(int i) const {
    if constexpr (Fp8Traits<TB>::FP8) {
      const u32 h2 = fp8x2_to_half2<TB>(i % 2 ? w[i / 2] >> 16 : w[i / 2]);
      float2 r = __half22float2(*reinterpret_cast<const __half2*>(&h2));
#if __CUDA_ARCH__ < 890
      const u32 c = w[i / 2] >> (16 * (i % 2));  // widened by bits here: the NaN code as a number
      r.x = (c & 0x7Fu) == 0x7Fu ? __int_as_float(0x7fc00000) : r.x;
      r.y = (c >> 8 & 0x7Fu) == 0x7Fu ? __int_as_float(0x7fc00000) : r.y;
#endif
      return r;
    } else if constexpr (sizeof(TB) == 4) {
      return make_float2(__uint_as_float(w[2 * i]), __uint_as_float(w[2 * i + 1]));
    } else {
      return make_float2(__uint_as_float(w[i] << 16), __uint_as_float(w[i] & 0xffff0000u));
    }
  }
  __device__ __forceinline__ void get(float (&x)[X]) const {
#pragma unroll
    for (int i = 0; i < X / 2; ++i) {
      const float2 p = pair(i);
      x[2 * i] = p.x;
      x[2 * i + 1] = p.y;
    }
  }
  // A bound as the term-by-term sums read it: an e4m3 NaN code (unknown) is infinite, +inf
  // for a max (UP), -inf for a min; other types' values as they are.
  template <bool UP>
  __device__ __forceinline__ static float unknown(float x) {
    if constexpr (Fp8Traits<TB>::FP8) return x != x ? (UP ? 1.f : -1.f) * __int_as_float(0x7f800000) : x;
    else return x;
  }
};

// The index of the total group_sums<N, LANES> leaves to lane `sub` of a group (its `which`).
template <int N, int LANES>
__device__ __forceinline__ int sum_index(int sub) {
  int which = 0, m = N;
#pragma unroll
  for (int off = LANES / 2; off >= 1; off >>= 1) {
    if (m > 1) {
      if (sub & off) which += m / 2;
      m /= 2;
    }
  }
  return which;
}

// Sums N values of each lane over the LANES lanes (a power of two >= N) of its aligned lane
// group, N / 2 values exchanged a step while more than one is left (the lanes whose `off`
// bit is set keep the upper half): returns the total of value sum_index (the same for every
// lane of a group whose high log2(N) group bits agree).
template <int N, int LANES>
__device__ __forceinline__ float group_sums(float (&v)[N], unsigned mask) {
  static_assert(N <= LANES, "one total a lane");
  int m = N;
#pragma unroll
  for (int off = LANES / 2; off >= 1; off >>= 1) {
    if (m > 1) {
      const bool up = threadIdx.x & off;
#pragma unroll
      for (int i = 0; i < N / 2; ++i) {
        if (i < m / 2) {
          const float send = up ? v[i] : v[i + m / 2];
          const float keep = up ? v[i + m / 2] : v[i];
          v[i] = keep + __shfl_xor_sync(mask, send, off);
        }
      }
      m /= 2;
    } else {
      v[0] += __shfl_xor_sync(mask, v[0], off);
    }
  }
  return v[0];
}

// grid (B * Hk, ceil(width / pages_per_cta)) (blockIdx.x = b * Hk + h); block THREADS. CTA
// ((b, h), c) scores pages [c pages_per_cta, (c + 1) pages_per_cta) of sequence b for kv
// head h into scores[b, h, :]. A page takes LANES lanes (D / X rounded up to a power of
// two, at most 32; PAGES = 32 / LANES pages a warp step), lane l of them dims X (l + LANES
// j) .. + X - 1 (j < CPL), loaded X at a time. A warp takes its pages a batch of UNROLL
// steps: the bounds of a batch loaded together, the block ids of the next batch loaded with
// them. The group's query heads go GC at a time (registers: q split into its positive and
// negative parts), each chunk a pass over the pages: score = max over the group's heads of
// sum_d (q_d > 0 ? q_d max_d : q_d < 0 ? q_d min_d : 0), computed as q+ max + q- min (two
// FMAs a dim). A lane's UNROLL x GC partial sums of a batch are summed across the page's
// lanes in one exchange (group_sums: a lane ends with the total of one (step, head) of its
// index), then the max over the heads' lanes. Where a sum gives NaN (an infinite bound
// times a zero part, +inf - inf, or an unknown e4m3 bound) the page is recomputed term by
// term (an unknown bound infinite there: BoundChunk::unknown), and a NaN there makes the
// page -inf. -inf past the sequence (and for a sequence with a bad length), +inf for its
// last page, -inf for a bad block id (reported). Passes after the first take the max with
// what the last one stored (NaN kept until the last pass).
template <typename T, typename TB, int D, int X, int THREADS, int GC, int UNROLL>
__global__ void __launch_bounds__(THREADS, 2) quest_score_kernel(CUPAGED_PARAMS_QuestScoreArgs) {
  const QuestScoreArgs<T, TB> a{CUPAGED_FIELDS_QuestScoreArgs};
  constexpr int WARPS = THREADS / 32, C = D / X;
  constexpr int LANES = C <= 8 ? 8 : C <= 16 ? 16 : 32;
  constexpr int CPL = (C + LANES - 1) / LANES, PAGES = 32 / LANES, N = UNROLL * GC;
  constexpr int KEEPER = LANES / UNROLL;  // lanes a batch's page score is held by (one stores)
  static_assert(D % X == 0 && N <= LANES, "quest_score_kernel: head size, group chunk or unroll");
  const int row_id = blockIdx.x;
  const int b = row_id / a.num_kv_heads, h = row_id - b * a.num_kv_heads;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int sub = lane % LANES, slot = lane / LANES;
  const unsigned mask = LANES == 32 ? 0xffffffffu : ((1u << LANES) - 1) << (slot * LANES);
  const int* table = a.block_tables + (i64)b * a.bt_stride;
  float* row_scores = a.scores + (i64)row_id * a.width;
  const int len = __ldg(a.seq_lens + b);
  const bool report = threadIdx.x == 0 && blockIdx.y == 0 && h == 0;
  const int n = length_ok(len, a.width, a.block_size, report ? a.err : nullptr, b)
                    ? (int)(((i64)len + a.block_size - 1) / a.block_size) : 0;
  const int begin = blockIdx.y * a.pages_per_cta;
  const int end = min(a.width, begin + a.pages_per_cta);
  const int stop = min(end, n);
  // the lane's total after group_sums: step u_mine of the batch, head g_mine of the chunk
  const int mine = sum_index<N, LANES>(sub), u_mine = mine / GC, g_mine = mine % GC;
  constexpr int BATCH = UNROLL * PAGES, STRIDE = WARPS * BATCH;  // pages a warp batch, a CTA pass
  for (int g0 = 0; g0 < a.group; g0 += GC) {
    const bool first_pass = g0 == 0, last_pass = g0 + GC >= a.group;
    float qp[GC][CPL][X], qn[GC][CPL][X];
#pragma unroll
    for (int g = 0; g < GC; ++g) {
      const T* qrow = a.q + (i64)b * a.q_stride + (i64)(h * a.group + g0 + g) * D;
#pragma unroll
      for (int j = 0; j < CPL; ++j) {
#pragma unroll
        for (int e = 0; e < X; ++e) {
          const int d = X * (sub + LANES * j) + e;
          const float x = g0 + g < a.group && d < D ? to_float<T>(qrow[d]) : 0.f;
          qp[g][j][e] = x > 0.f ? x : 0.f;
          qn[g][j][e] = x < 0.f ? x : 0.f;
        }
      }
    }
    // block ids of the warp's next batch (a page's lanes all load its id)
    int next[UNROLL];
    const auto lookup = [&](int i0) {
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int i = i0 + u * PAGES + slot;
        next[u] = i < stop ? __ldg(table + i) : 0;
      }
    };
    lookup(begin + warp * BATCH);
    for (int i0 = begin + warp * BATCH; i0 < stop; i0 += STRIDE) {
      BoundChunk<TB, X> mx[UNROLL][CPL], mn[UNROLL][CPL];
      bool ok[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int i = i0 + u * PAGES + slot, blk = next[u];
        ok[u] = (unsigned)blk < (unsigned)a.num_blocks;
        if (i < stop && !ok[u] && sub == 0 && h == 0 && first_pass)
          report_error(a.err, error_code(ARG_BLOCK_TABLES, CHECK_RANGE), b, i, blk, a.num_blocks);
        const i64 row = ((i64)(ok[u] ? blk : 0) * a.num_kv_heads + h) * D;
#pragma unroll
        for (int j = 0; j < CPL; ++j) {
          const int d = X * (sub + LANES * j);
          if (i < stop && ok[u] && d < D) {
            mx[u][j].load(a.k_max + row + d);
            mn[u][j].load(a.k_min + row + d);
          } else {
            mx[u][j].zero();
            mn[u][j].zero();
          }
        }
      }
      lookup(i0 + STRIDE);
      // a page's score s (NaN kept until the last pass) into its row, by one lane a page
      const auto store = [&](int i, bool page_ok, float s) {
        if (i >= stop) return;
        if (!first_pass) {
          const float prev = row_scores[i];
          s = prev != prev || s != s ? prev + s : fmaxf(prev, s);
        }
        if (last_pass) {
          s = s != s || !page_ok ? neg_inf() : s;
          s = i == n - 1 ? __int_as_float(0x7f800000) : s;
        }
        row_scores[i] = s;
      };
      float acc[N];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
        for (int g = 0; g < GC; ++g) acc[u * GC + g] = 0.f;
#pragma unroll
        for (int j = 0; j < CPL; ++j) {
#pragma unroll
          for (int e = 0; e < X; e += 2) {  // a pair of dims' bounds used by every head at once
            const float2 hi = mx[u][j].pair(e / 2), lo = mn[u][j].pair(e / 2);
#pragma unroll
            for (int g = 0; g < GC; ++g) {
              float& t = acc[u * GC + g];
              t = fmaf(qp[g][j][e], hi.x, fmaf(qn[g][j][e], lo.x, t));
              t = fmaf(qp[g][j][e + 1], hi.y, fmaf(qn[g][j][e + 1], lo.y, t));
            }
          }
        }
      }
      float s = group_sums<N, LANES>(acc, mask);
      s = g0 + g_mine < a.group ? s : neg_inf();
      // steps whose sums gave NaN (rare; the same bits for a page's lanes)
      unsigned redo = 0;
      for (unsigned nan = __ballot_sync(0xffffffffu, s != s) & mask; nan; nan &= nan - 1)
        redo |= 1u << (sum_index<N, LANES>((__ffs(nan) - 1) % LANES) / GC);
#pragma unroll
      for (int off = LANES / N; off < LANES / N * GC; off <<= 1)
        s = fmaxf(s, __shfl_xor_sync(mask, s, off));
      if (sub % KEEPER == 0 && !(redo >> u_mine & 1)) {
        bool page_ok = false;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) page_ok = u == u_mine ? ok[u] : page_ok;
        store(i0 + u_mine * PAGES + slot, page_ok, s);
      }
      // pages whose two-FMA sums gave NaN, term by term as the reference sums them (their
      // bounds loaded again: rare, kept out of the batch's registers); a NaN there makes
      // the page -inf
#pragma unroll 1
      for (int u = 0; u < UNROLL; ++u) {
        if (!(redo >> u & 1)) continue;
        const int i = i0 + u * PAGES + slot;
        const i64 row = ((i64)__ldg(table + i) * a.num_kv_heads + h) * D;
        float best = neg_inf();
        bool any_nan = false;
#pragma unroll
        for (int g = 0; g < GC; ++g) {
          float t = 0.f;
#pragma unroll
          for (int j = 0; j < CPL; ++j) {
            const int d = X * (sub + LANES * j);
            if (d >= D) continue;
            BoundChunk<TB, X> bhi, blo;
            bhi.load(a.k_max + row + d);
            blo.load(a.k_min + row + d);
            float hi[X], lo[X];
            bhi.get(hi);
            blo.get(lo);
#pragma unroll
            for (int e = 0; e < X; ++e) {
              const float qd = qp[g][j][e] + qn[g][j][e];
              const float prod = qd * (qd > 0.f ? BoundChunk<TB, X>::template unknown<true>(hi[e])
                                                : BoundChunk<TB, X>::template unknown<false>(lo[e]));
              t += qd != 0.f ? prod : 0.f;  // q_d = 0 adds nothing, even against an infinite bound
            }
          }
          float one[1] = {t};
          t = group_sums<1, LANES>(one, mask);
          if (g0 + g < a.group) {
            any_nan |= t != t;
            best = fmaxf(best, t);
          }
        }
        if (sub == 0) store(i, true, any_nan ? __int_as_float(0x7fc00000) : best);
      }
    }
  }
  for (int i = max(begin, n) + threadIdx.x; i < end; i += THREADS) row_scores[i] = neg_inf();
}

// grid B * Hk (CTA (b, h) = blockIdx.x = b * Hk + h); block THREADS. From the scores of
// quest_score_kernel the CTA finds the key (page_key: the last page, then the first_pages
// first ones, then by score) of the k-th best page (KPT > 0: the row's keys in registers,
// page t + j THREADS as key j of thread t, and a bisection; else a radix select, 8 bits a
// pass) and keeps, in position order, every page above it and the first pages equal to it:
// positions[b, h, :] (-1 past the count), and a block table row of the one-kv-head view
// (tokens_per_page entries a page: id blk * Hk + h, or (blk * block_size + t) * Hk + h per
// token t; rows sel_stride entries apart) with its key count. A sequence with a bad length
// or block id keeps nothing (count 0; the score kernel reported it). Dynamic shared memory:
// with stage_positions the kept positions (k ints; the table row is written from them by
// all threads at once, its block ids read together), then with cache_keys the row's keys
// (width u32s, computed once; else on each pass from the scores; always with KPT > 0).
template <int THREADS, int KPT>
__global__ void __launch_bounds__(THREADS) quest_select_kernel(CUPAGED_PARAMS_QuestSelectArgs) {
  const QuestSelectArgs a{CUPAGED_FIELDS_QuestSelectArgs};
  constexpr int LOADS = KPT > 0 ? KPT : 4;  // score loads in flight a thread while the keys are cached
  __shared__ int s_hist[256];
  __shared__ int s_warp[THREADS / 32 + 1];
  const int b = blockIdx.x / a.num_kv_heads, h = blockIdx.x - b * a.num_kv_heads;
  const int* table = a.block_tables + (i64)b * a.bt_stride;
  const float* row_scores = a.scores + (i64)blockIdx.x * a.width;
  const int len = __ldg(a.seq_lens + b);
  const bool len_ok = length_ok(len, a.width, a.block_size, nullptr, b);
  const int used = len_ok ? (int)(((i64)len + a.block_size - 1) / a.block_size) : 0;
  const int n = table_row_ok<THREADS>(table, used, a.num_blocks, nullptr, b) ? used : 0;
  const int k = min(a.top_k, a.width);

  extern __shared__ u32 s_dyn[];
  int* s_pos = reinterpret_cast<int*>(s_dyn);
  u32* s_keys = s_dyn + (a.stage_positions ? k : 0);
  u32 kept[LOADS] = {};  // KPT > 0: the thread's keys (0 past n)
  if (a.cache_keys) {
    for (int base = 0; base < n; base += LOADS * THREADS) {
      float sc[LOADS];
#pragma unroll
      for (int u = 0; u < LOADS; ++u) {
        const int i = base + u * THREADS + threadIdx.x;
        sc[u] = i < n ? row_scores[i] : 0.f;
      }
#pragma unroll
      for (int u = 0; u < LOADS; ++u) {
        const int i = base + u * THREADS + threadIdx.x;
        kept[u] = i < n ? page_key(i, n, a.first_pages, sc[u]) : 0u;
        if (i < n) s_keys[i] = kept[u];
      }
    }
    __syncthreads();
  }
  const auto key = [&](int i) {
    return a.cache_keys ? s_keys[i] : page_key(i, n, a.first_pages, row_scores[i]);
  };
  // the top k pages by key (topk.cuh), written in position order
  TopK top;
  if constexpr (KPT > 0) {
    top = bisect_select<THREADS, KPT>(kept, n, k, s_hist);
  } else {
    top = radix_select<THREADS>(key, n, k, s_hist);
  }
  const int tpp = a.tokens_per_page;
  int* pos_row = a.positions ? a.positions + (i64)blockIdx.x * k : nullptr;
  int* tab_row = a.sel_tables + (i64)blockIdx.x * a.sel_stride;
  // entry t of kept page `slot` (position i, block blk) of the table row, and the position
  const auto write = [&](int slot, int t, int i, int blk) {
    if (pos_row && t == 0) pos_row[slot] = i;
    tab_row[slot * tpp + t] =
        tpp == 1 ? blk * a.num_kv_heads + h : (blk * a.block_size + t) * a.num_kv_heads + h;
  };
  keep_in_order<THREADS>(key, n, top, s_warp, [&](int slot, int i) {
    if (a.stage_positions) {
      s_pos[slot] = i;
    } else {
      const int blk = __ldg(table + i);
      for (int t = 0; t < tpp; ++t) write(slot, t, i, blk);
    }
  });
  const int count = min(n, k);
  if (a.stage_positions) {
    __syncthreads();
    for (int e = threadIdx.x; e < count * tpp; e += THREADS) {
      const int slot = e / tpp, i = s_pos[slot];
      write(slot, e - slot * tpp, i, __ldg(table + i));
    }
  }
  for (int s = count + threadIdx.x; s < k; s += THREADS) {
    if (pos_row) pos_row[s] = -1;
    for (int t = 0; t < tpp; ++t) tab_row[s * tpp + t] = -1;
  }
  if (threadIdx.x == 0)
    a.sel_lens[blockIdx.x] =
        count ? (count - 1) * a.block_size + (len - (n - 1) * a.block_size) : 0;
}

// ---------------------------------------------------------------------------- sinks
// grid ceil(rows / WARPS); block THREADS; a warp a row (token, query head) of a decode's
// output out [rows, D] and natural-log LSE lse [rows] over the keys alone: the sink logit
// s of the row's head joins the denominator, out *= 1 / (1 + exp(s - lse)) and
// lse = logaddexp(lse, s). A row without keys (lse -inf, out zeros) gets lse = s.
template <typename T, int THREADS>
__global__ void __launch_bounds__(THREADS) quest_sinks_kernel(CUPAGED_PARAMS_QuestSinksArgs) {
  const QuestSinksArgs<T> a{CUPAGED_FIELDS_QuestSinksArgs};
  const int row = blockIdx.x * (THREADS / 32) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (row >= a.rows) return;
  const float sink = __ldg(a.sinks + row % a.num_q_heads), row_lse = a.lse[row];
  const float scale = row_lse == neg_inf() ? 0.f : 1.f / (1.f + expf(sink - row_lse));
  T* o = a.out + (i64)row * a.head_dim;
  for (int d = lane; d < a.head_dim; d += 32) o[d] = from_float<T>(to_float<T>(o[d]) * scale);
  __syncwarp();
  if (lane == 0)
    a.lse[row] = row_lse == neg_inf() ? sink
                                     : fmaxf(row_lse, sink) + log1pf(expf(-fabsf(row_lse - sink)));
}

}  // namespace quest
}  // namespace cupaged
