// CTA-wide scan of one int per thread in thread order (sum, or max when MAX), with warp
// shuffles and one int per warp of shared memory: the plan kernels' prefix sums, Quest's
// selection counts and the sparse index preparation.
#pragma once
#include "common.cuh"

namespace cupaged {

// The exclusive scan of x over the THREADS threads of the CTA (identity id: thread 0's
// result); `total` gets the reduction of every x. Every thread calls; s_warp holds
// THREADS / 32 + 1 ints; it is free again on return.
template <int THREADS, bool MAX = false>
__device__ __forceinline__ int block_scan(int x, int* s_warp, int& total, int id = 0) {
  constexpr int WARPS = THREADS / 32;
  static_assert(THREADS % 32 == 0 && WARPS <= 32, "whole warps, one warp of warp sums");
  const auto op = [](int a, int b) { return MAX ? max(a, b) : a + b; };
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int incl = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl = op(incl, y);
  }
  const int before = __shfl_up_sync(0xffffffffu, incl, 1);  // the lane's exclusive part
  if (lane == 31) s_warp[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int w = lane < WARPS ? s_warp[lane] : id;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w = op(w, y);
    }
    const int ex = __shfl_up_sync(0xffffffffu, w, 1);
    if (lane < WARPS) s_warp[lane] = lane == 0 ? id : ex;  // the warp's exclusive prefix
    if (lane == WARPS - 1) s_warp[WARPS] = w;
  }
  __syncthreads();
  const int r = op(s_warp[warp], lane == 0 ? id : before);
  total = s_warp[WARPS];
  __syncthreads();
  return r;
}

}  // namespace cupaged
