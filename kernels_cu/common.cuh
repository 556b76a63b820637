// Shared device helpers for every cupaged kernel: element types, conversions, 16-byte vectors.
//
// Element types are __half, __nv_bfloat16 and float. Offsets into caches are 64-bit (i64):
// a KV cache may hold far more than 2^31 elements.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace cupaged {

typedef long long i64;
typedef unsigned int u32;

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Shared-state-space address of a generic pointer into shared memory.
__device__ __forceinline__ u32 smem_addr(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

// Elements of T in one 16-byte vector.
template <typename T> struct Vec16 { static constexpr int N = 16 / sizeof(T); };

// Load N = 16 / sizeof(T) elements (16-byte aligned) and widen to float.
template <typename T>
__device__ __forceinline__ void load16_float(const T* __restrict__ p, float* out) {
  uint4 raw = *reinterpret_cast<const uint4*>(p);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < Vec16<T>::N; ++i) out[i] = to_float<T>(e[i]);
}

// Narrow N = 16 / sizeof(T) floats to T and store them as one 16-byte vector.
template <typename T>
__device__ __forceinline__ void store16_float(T* __restrict__ p, const float* in) {
  uint4 raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int i = 0; i < Vec16<T>::N; ++i) e[i] = from_float<T>(in[i]);
  *reinterpret_cast<uint4*>(p) = raw;
}

// L2 cache policies and residency (benchmarks/NOTES.md, decode v5 variants and v7c).
// evict_first tags data read exactly once (a decode's K/V stream) so that it does not
// displace what is reused. evict_last keeps split-KV partial rows, which the decode kernels
// write with it, from being pushed out to DRAM by that stream before the merge reads them;
// the merge then drops the lines it has read (discard: dead rows are never written back).
__device__ __forceinline__ unsigned long long l2_evict_first_policy() {
  unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

__device__ __forceinline__ unsigned long long l2_evict_last_policy() {
  unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

__device__ __forceinline__ void store_l2_hint(float* p, float v, unsigned long long policy) {
  asm volatile("st.global.L2::cache_hint.f32 [%0], %1, %2;\n" :: "l"(p), "f"(v), "l"(policy)
               : "memory");
}

// Invalidate the 128-byte line at p (128-byte aligned) in L2 without writing it back.
__device__ __forceinline__ void discard_l2_line(const void* p) {
  asm volatile("discard.global.L2 [%0], 128;\n" :: "l"(p) : "memory");
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Two floats -> one b32 of two 16-bit values (lo = first), as tensor-core A fragments take them.
template <typename T> __device__ __forceinline__ u32 pack2(float lo, float hi);
template <> __device__ __forceinline__ u32 pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<u32*>(&h);
}
template <> __device__ __forceinline__ u32 pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<u32*>(&h);
}

// Base-2 exponential on MUFU.EX2; ex2(-inf) = +0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

// -inf as a float (NVRTC has no INFINITY macro): the max of an empty set, the score of a
// masked key, the LSE of a row without keys.
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }

// Record a bad index entry in the device error word (cupaged.errors): the first report
// after the word is cleared wins, later ones are dropped. err may be null (not checked).
// code: error_code(argument, check) of abi.cuh; row / col locate the entry (-1: none).
__device__ __forceinline__ void report_error(long long* err, int code, i64 row, i64 col,
                                             i64 value, i64 bound) {
  if (err == nullptr) return;
  if (atomicCAS(reinterpret_cast<unsigned long long*>(err), 0ull,
                static_cast<unsigned long long>(code)) == 0ull) {
    err[1] = row;
    err[2] = col;
    err[3] = value;
    err[4] = bound;
  }
}

}  // namespace cupaged
