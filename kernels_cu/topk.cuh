// The top k of a row of scores, by one CTA: the k-th largest key by a radix select (8 bits
// a pass from the top, a 256-bin shared histogram), then one pass in position order that
// keeps every entry above it and the first `ties` equal to it (ties to the earlier
// position). Quest's page selection (quest.cu) and the vertical+slash estimate's top
// verticals and slashes (sparse_estimate.cu) run on it.
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

// The kept keys in position order: emit(slot, i) for key i, slot its rank among the kept
// (0 .. min(n, k) - 1). Every thread calls; s_warp holds THREADS / 32 + 1 ints.
template <int THREADS, typename Key, typename Emit>
__device__ __forceinline__ void keep_in_order(const Key& key, int n, TopK top, int* s_warp, const Emit& emit) {
  int carry_gt = 0, carry_eq = 0;
  for (int base = 0; base < n; base += THREADS) {
    const int i = base + threadIdx.x;
    const u32 x = i < n ? key(i) : 0u;
    const int gt = i < n && x > top.threshold, eq = i < n && x == top.threshold;
    int total;
    const int incl = block_scan<THREADS>(gt | eq << 16, s_warp, total) + (gt | eq << 16);
    const int gt_before = carry_gt + (incl & 0xffff) - gt;
    const int eq_before = carry_eq + (incl >> 16) - eq;
    if (gt || (eq && eq_before < top.ties)) emit(gt_before + min(eq_before, top.ties), i);
    carry_gt += total & 0xffff;
    carry_eq += total >> 16;
  }
}

}  // namespace cupaged
