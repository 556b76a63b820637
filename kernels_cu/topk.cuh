// The top k of a row of scores, by one CTA: the k-th largest key, then one pass in position
// order that keeps every entry above it and the first `ties` equal to it (ties to the
// earlier position). The k-th key comes from a radix select (8 bits a pass from the top, a
// 256-bin shared histogram: keys read from anywhere, four passes) or, for rows whose keys
// fit in the CTA's registers, a bisection (a bit a step from the top, each step a CTA-wide
// count: no atomics, no shared keys). Quest's page selection (quest.cu) and the
// vertical+slash estimate's top verticals and slashes (sparse_estimate.cu) run on them.
#pragma once
#include "common.cuh"
#include "block_scan.cuh"

namespace cupaged {

// A score's order-preserving unsigned key (a larger float, a larger key; -0 and +0 one key;
// +inf above every finite score, -inf below; callers make NaN -inf).
__device__ __forceinline__ u32 order_key(float s) {
  const u32 u = s == 0.f ? 0u : __float_as_uint(s);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The k-th largest of the n keys key(i) (threshold) and how many keys equal to it the top k
// takes (ties); with n <= k every key: threshold 0, ties n. Every thread calls; s_hist holds
// 256 ints.
struct TopK {
  u32 threshold;
  int ties;
};
template <int THREADS, typename Key>
__device__ __forceinline__ TopK radix_select(const Key& key, int n, int k, int* s_hist) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (n <= k) return TopK{0u, n};
  u32 prefix = 0, mask = 0;
  int want = k;  // keys still to take among those matching the prefix
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += THREADS) s_hist[i] = 0;
    __syncthreads();
    // a warp's keys of one digit added by one lane (keys of a row share their top digits:
    // one atomic a key would serialise on a few bins)
    for (int base = 0; base < n; base += THREADS) {
      const int i = base + threadIdx.x;
      const u32 x = i < n ? key(i) : 0u;
      const int digit = i < n && (x & mask) == prefix ? (int)((x >> shift) & 255) : 256;
      const unsigned peers = __match_any_sync(0xffffffffu, digit);
      if (digit < 256 && lane == __ffs(peers) - 1) atomicAdd(&s_hist[digit], __popc(peers));
    }
    __syncthreads();
    if (warp == 0) {  // the digit where the count from the top reaches `want`
      int sum = 0;
#pragma unroll
      for (int e = 0; e < 8; ++e) sum += s_hist[255 - (lane * 8 + e)];
      int incl = sum;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
      }
      int above = incl - sum, digit = -1, over = 0;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int c = s_hist[255 - (lane * 8 + e)];
        if (digit < 0 && above + c >= want) {
          digit = 255 - (lane * 8 + e);
          over = above;
        }
        above += c;
      }
      const unsigned hit = __ballot_sync(0xffffffffu, digit >= 0);
      const int src = __ffs(hit) - 1;
      digit = __shfl_sync(0xffffffffu, digit, src);
      over = __shfl_sync(0xffffffffu, over, src);
      if (lane == 0) {
        s_hist[0] = digit;
        s_hist[1] = over;
      }
    }
    __syncthreads();
    prefix |= (u32)s_hist[0] << shift;
    mask |= 255u << shift;
    want -= s_hist[1];
    __syncthreads();
  }
  return TopK{prefix, want};
}

// The k-th largest of the n keys the CTA holds in registers (KPT a thread, 0 past n: below
// every key, as order_key never gives 0 to a score callers pass) and how many equal to it
// the top k takes, as radix_select. The threshold is found a bit at a time from the top: a
// candidate stays when at least k keys are at or above it (a CTA-wide count: a warp sum,
// then the warps' sums from shared memory, two buffers of THREADS / 32 ints in s_count
// taken in turn so one barrier a step suffices). Every thread calls.
template <int THREADS, int KPT>
__device__ __forceinline__ TopK bisect_select(const u32 (&x)[KPT], int n, int k, int* s_count) {
  constexpr int WARPS = THREADS / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (n <= k) return TopK{0u, n};
  const auto at_least = [&](u32 t, int* s) {
    int c = 0;
#pragma unroll
    for (int j = 0; j < KPT; ++j) c += x[j] >= t;
    c = __reduce_add_sync(0xffffffffu, c);
    if (lane == 0) s[warp] = c;
    __syncthreads();
    return __reduce_add_sync(0xffffffffu, lane < WARPS ? s[lane] : 0);
  };
  u32 t = 0;
#pragma unroll 1
  for (int bit = 31; bit >= 0; --bit) {
    const u32 cand = t | 1u << bit;
    if (at_least(cand, s_count + (bit & 1) * WARPS) >= k) t = cand;
  }
  const int above = t == 0xffffffffu ? 0 : at_least(t + 1, s_count + WARPS);
  return TopK{t, k - above};
}

// The kept keys in position order: emit(slot, i) for key i, slot its rank among the kept
// (0 .. min(n, k) - 1). Warp w takes the positions [w span, (w + 1) span) (span: n over the
// warps, whole warp steps), 32 a step: it counts its keys above and at the threshold
// (ballots), two CTA scans of the warps' counts give its first slots, and a second walk
// emits its kept keys (ranks within a step from the ballots). Every thread calls; s_warp
// holds THREADS / 32 + 1 ints.
template <int THREADS, typename Key, typename Emit>
__device__ __forceinline__ void keep_in_order(const Key& key, int n, TopK top, int* s_warp, const Emit& emit) {
  constexpr int WARPS = THREADS / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned below = (1u << lane) - 1;
  const int span = (n + 32 * WARPS - 1) / (32 * WARPS) * 32;
  const int lo = min(n, warp * span), hi = min(n, lo + span);
  int gt = 0, eq = 0;
  for (int base = lo; base < hi; base += 32) {
    const int i = base + lane;
    const u32 x = i < hi ? key(i) : 0u;
    gt += __popc(__ballot_sync(0xffffffffu, i < hi && x > top.threshold));
    eq += __popc(__ballot_sync(0xffffffffu, i < hi && x == top.threshold));
  }
  int total;  // counts before the warp: lane 0 holds the warp's, the others nothing
  int g = __shfl_sync(0xffffffffu, block_scan<THREADS>(lane == 0 ? gt : 0, s_warp, total), 0);
  int e = __shfl_sync(0xffffffffu, block_scan<THREADS>(lane == 0 ? eq : 0, s_warp, total), 0);
  for (int base = lo; base < hi; base += 32) {
    const int i = base + lane;
    const u32 x = i < hi ? key(i) : 0u;
    const bool is_gt = i < hi && x > top.threshold, is_eq = i < hi && x == top.threshold;
    const unsigned bg = __ballot_sync(0xffffffffu, is_gt), be = __ballot_sync(0xffffffffu, is_eq);
    const int gi = g + __popc(bg & below), ei = e + __popc(be & below);
    if (is_gt) emit(gi + min(ei, top.ties), i);
    if (is_eq && ei < top.ties) emit(gi + ei, i);
    g += __popc(bg);
    e += __popc(be);
  }
}

}  // namespace cupaged
