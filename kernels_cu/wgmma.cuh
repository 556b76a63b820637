// Hopper (sm_90a) warpgroup building blocks: wgmma.mma_async, smem matrix descriptors,
// cp.async and the wgmma ordering fences (the proxy fence is in bulk_copy.cuh).
//
// A warpgroup is 4 consecutive warps starting at a warp index divisible by 4. For
// wgmma.mma_async.m64nNk16 (16-bit inputs, fp32 accumulators) warp w of the warpgroup owns
// rows 16w .. 16w + 15 of the 64-row tile, and with g = lane / 4, t = lane % 4:
//   accumulator d[N / 2]: d[4i + 0, 1] = (row g, cols 8i + 2t, + 1), d[4i + 2, 3] = row g + 8
//   A from registers, 4 x b32: (row g, k 2t..), (row g + 8, k 2t..), (row g, k 8 + 2t..),
//                              (row g + 8, k 8 + 2t..); the lower element in the low half
// (the mma.sync m16n8k16 layouts, so an accumulator converts to A fragments in place).
//
// Shared-memory operands use the 128-byte swizzle: a tile of R rows x 64 elements (128
// bytes per row) is stored row after row, and 16-byte chunk c of row r sits at chunk
// c ^ (r % 8) of that row (`swizzled`); wider rows are split into 64-element column blocks
// of R * 128 bytes each. Tiles start 1024-byte aligned (the swizzle works on address bits).
// Descriptors (`descriptor`): start address >> 4 in bits 0-13, leading byte offset >> 4 in
// bits 16-29, stride byte offset >> 4 in bits 32-45, swizzle mode 1 (128 B) in bits 62-63.
//   K-major operand (rows = M or N, the 16 k-columns contiguous, e.g. Q and K for Q K^T):
//     stride offset 1024 (8-row groups), leading offset unused; k-step kk of a column block
//     starts 32 * (kk % 4) bytes into it.
//   MN-major operand (rows = k, N contiguous, e.g. V [keys][d] for P V, transpose flag set):
//     stride offset 1024 (8-row k groups), leading offset = the column-block size (the next
//     64 N-columns); k-step kk starts 16 * 128 * kk bytes in.
#pragma once
#include "bulk_copy.cuh"

namespace cupaged {
namespace sm90 {

typedef unsigned long long u64;

// Byte offset of 16-byte chunk c of row r in a 128-byte-swizzled tile of R rows.
template <int R>
__device__ __forceinline__ u32 swizzled(int r, int c) {
  return (c >> 3) * (R * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

// Matrix descriptor of a 128-byte-swizzled operand at shared address addr.
__device__ __forceinline__ u64 descriptor(u32 addr, u32 leading_bytes, u32 stride_bytes) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((leading_bytes >> 4) & 0x3FFF) << 16) |
         ((u64)((stride_bytes >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

// -- cp.async: 16 bytes global -> shared; bytes past src_bytes zero-filled --
__device__ __forceinline__ void cp_async16(u32 smem, const void* gmem, int src_bytes = 16) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(smem), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// -- wgmma ordering: fence before the first wgmma that reads registers written since; one
//    commit per batch; wait until at most N batches are in flight --
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}

// Pin registers at this point of the program: reads of an accumulator after wgmma_wait
// (and writes before wgmma_fence) cannot be moved across it by the compiler.
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

// wgmma.mma_async.m64nNk16 with fp32 accumulators d[N / 2]:
//   ss: d (+)= A B, A and B from descriptors (both K-major);
//   rs: d (+)= A B, A from registers, B from a descriptor (MN-major: transpose flag).
// scale_d = 0 overwrites d (first k-step), 1 accumulates.
template <typename T, int N> struct Wgmma;

// Operand lists per N: accumulators %0 .. %(N/2 - 1), then the other operands.
#define CUPAGED_WG_OPS64 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define CUPAGED_WG_SS64 \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n", \
  " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
#define CUPAGED_WG_RS64 \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n", \
  " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
#define CUPAGED_WG_OPS128 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define CUPAGED_WG_SS128 \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n", \
  " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
#define CUPAGED_WG_RS128 \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n", \
  " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
#define CUPAGED_WG_HEAD(PRE, TAIL) PRE
#define CUPAGED_WG_TAIL(PRE, TAIL) TAIL
#define CUPAGED_WG_FIRST(X) CUPAGED_WG_HEAD(X)
#define CUPAGED_WG_SECOND(X) CUPAGED_WG_TAIL(X)

#define CUPAGED_WGMMA(TYPE, PTX, N)                                                              \
  template <> struct Wgmma<TYPE, N> {                                                            \
    static __device__ __forceinline__ void ss(float (&d)[N / 2], u64 da, u64 db, int scale_d) {  \
      asm volatile(CUPAGED_WG_FIRST(CUPAGED_WG_SS##N)                                            \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX "." PTX                 \
                   CUPAGED_WG_SECOND(CUPAGED_WG_SS##N)                                           \
                   : CUPAGED_WG_OPS##N : "l"(da), "l"(db), "r"(scale_d));                        \
    }                                                                                            \
    static __device__ __forceinline__ void rs(float (&d)[N / 2], const u32 (&a)[4], u64 db,      \
                                              int scale_d) {                                     \
      asm volatile(CUPAGED_WG_FIRST(CUPAGED_WG_RS##N)                                            \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX "." PTX                 \
                   CUPAGED_WG_SECOND(CUPAGED_WG_RS##N)                                           \
                   : CUPAGED_WG_OPS##N                                                           \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));         \
    }                                                                                            \
  };

CUPAGED_WGMMA(__nv_bfloat16, "bf16", 64)
CUPAGED_WGMMA(__nv_bfloat16, "bf16", 128)
CUPAGED_WGMMA(__half, "f16", 64)
CUPAGED_WGMMA(__half, "f16", 128)

#undef CUPAGED_WGMMA
#undef CUPAGED_WG_FIRST
#undef CUPAGED_WG_SECOND
#undef CUPAGED_WG_HEAD
#undef CUPAGED_WG_TAIL
#undef CUPAGED_WG_OPS64
#undef CUPAGED_WG_OPS128
#undef CUPAGED_WG_SS64
#undef CUPAGED_WG_SS128
#undef CUPAGED_WG_RS64
#undef CUPAGED_WG_RS128

}  // namespace sm90
}  // namespace cupaged
