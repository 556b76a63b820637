// Hopper (sm_90) bulk copies from global to shared memory that complete on an mbarrier
// (plain byte ranges, and TMA tensor copies through a tensor map), the mbarrier operations
// around them, and the proxy fence between generic and async accesses to shared memory.
//
// An mbarrier phase completes when its pending arrivals reach zero and its transaction
// count (bytes announced by arrive.expect_tx, minus bytes landed by complete_tx) is zero.
// The waiter passes the parity of the phase it waits for: use n of a barrier is parity n & 1.
#pragma once
#include "common.cuh"

namespace cupaged {

__device__ __forceinline__ void mbar_init(u32 bar, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(arrivals) : "memory");
}

// Make initialised barriers visible to the async proxy (before the barrier that publishes them).
__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival that also announces `bytes` more to land in the current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
               :: "r"(bar), "r"(bytes) : "memory");
}

// One arrival (no transaction bytes).
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}

// One arrival, made once every cp.async the thread issued before has landed (it counts
// against the barrier's expected arrivals: .noinc).
__device__ __forceinline__ void cp_async_arrive(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(bar) : "memory");
}

// No arrival, but the current phase cannot complete before every cp.async the thread issued
// before has landed (the pending count rises by one now and falls by one as they land).
__device__ __forceinline__ void cp_async_hold(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];\n" :: "r"(bar) : "memory");
}

// Block until the phase of the given parity has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" :: "r"(bar), "r"(parity) : "memory");
}

// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global src to shared dst,
// counted against barrier bar's transactions when they land; L2 lines tagged with `policy`.
__device__ __forceinline__ void bulk_copy_g2s(u32 dst, const void* src, u32 bytes, u32 bar,
                                              unsigned long long policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1], %2, [%3], %4;\n"
      :: "r"(dst), "l"(src), "r"(bytes), "r"(bar), "l"(policy) : "memory");
}

// A TMA tensor map (the driver's CUtensorMap, encoded on the host by cupaged.core.tma): a
// kernel takes it as a `const __grid_constant__` parameter, and copies name its address in
// the parameter space.
struct alignas(64) TensorMap {
  unsigned long long bits[16];
};

// Fetch a tensor map into the TMA unit's descriptor cache ahead of its first copy.
__device__ __forceinline__ void prefetch_tensor_map(const TensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" :: "l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}

// The box of a 4-d tensor map at coordinates (x, y, z, w) (innermost first; out-of-range
// elements land as zeros) -> shared dst (aligned as the map's swizzle needs), its bytes
// counted against barrier bar's transactions (the whole box, zero-filled parts included).
__device__ __forceinline__ void tma_load_4d(u32 dst, const TensorMap* map, int x, int y, int z, int w,
                                            u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
      :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(x), "r"(y), "r"(z), "r"(w),
         "r"(bar)
      : "memory");
}

// Shared memory written through the generic proxy (st.shared, cp.async) and next read or
// overwritten by the async proxy (wgmma, bulk copies): each writing thread fences before
// the barrier that orders the two.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

}  // namespace cupaged
