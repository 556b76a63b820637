// Tensor-core building blocks for sm_80+: mma.sync m16n8k16, ldmatrix, cp.async.
//
// Fragment layouts of mma.sync.aligned.m16n8k16 (16-bit inputs, fp32 accumulators), with
// g = lane / 4 (group) and t = lane % 4 (thread in group):
//   A 16x16 row-major, 4 x b32: a0 (row g, cols 2t..2t+1), a1 (row g+8, cols 2t..),
//                               a2 (row g, cols 8+2t..),  a3 (row g+8, cols 8+2t..)
//   B 16x8 (k x n),     2 x b32: b0 (k 2t..2t+1, col g), b1 (k 8+2t.., col g)
//   C 16x8 fp32,        4 x f32: c0,c1 (row g, cols 2t, 2t+1), c2,c3 (row g+8, same cols)
// The lower-indexed element of each pair sits in the low 16 bits.
//
// ldmatrix.x4: lanes 8i..8i+7 give the 16-byte row addresses of 8x8 matrix i; register i
// receives matrix i in the C-like layout (lane holds row lane/4, cols 2*(lane%4)..+1), or
// its transpose with .trans. Helpers below compute the per-lane row/column for the usual
// operand tilings of a row-major shared-memory tile.
#pragma once
#include "common.cuh"

namespace cupaged {

// -- cp.async: 16 bytes global -> shared, bypassing L1; bytes past src_bytes are zero-filled --
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes = 16) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(smem_addr(smem)), "l"(gmem), "r"(src_bytes) : "memory");
}

// The same with the L2 prefetch-size hint of one 128-byte line, for the paged decode loader's
// K/V stream (benchmarks/NOTES.md, decode v4b).
__device__ __forceinline__ void cp_async16_line(void* smem, const void* gmem, int src_bytes = 16) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n"
               :: "r"(smem_addr(smem)), "l"(gmem), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Wait until at most N committed groups of this thread are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

// -- ldmatrix: four 8x8 b16 matrices --
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(smem)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(smem)));
}

// -- the same on 32-bit shared-state-space addresses (constant offsets fold into the
//    instruction's immediate; smem_addr() of a tile base gives one) --
__device__ __forceinline__ void cp_async16(u32 smem, const void* gmem, int src_bytes = 16) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(smem), "l"(gmem), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem));
}

// Per-lane (row, col) offsets for ldmatrix.x4 over a row-major tile.
//   A operand (16 rows x 16 cols at the tile origin): r = {a0, a1, a2, a3}.
__device__ __forceinline__ int ldm_a_row(int lane) { return (lane & 7) + ((lane >> 3) & 1) * 8; }
__device__ __forceinline__ int ldm_a_col(int lane) { return (lane >> 4) * 8; }
//   B operand stored [n][k] (k contiguous; e.g. K for Q.K^T), 16 n x 16 k, no .trans:
//   r = {b0, b1} of n-tile 0 then {b0, b1} of n-tile 1 (n + 8).
__device__ __forceinline__ int ldm_bnk_row(int lane) { return (lane & 7) + (lane >> 4) * 8; }
__device__ __forceinline__ int ldm_bnk_col(int lane) { return ((lane >> 3) & 1) * 8; }
//   B operand stored [k][n] (n contiguous; e.g. V for P.V), 16 k x 16 n, with .trans:
//   same register order as above.
__device__ __forceinline__ int ldm_bkn_row(int lane) { return (lane & 7) + ((lane >> 3) & 1) * 8; }
__device__ __forceinline__ int ldm_bkn_col(int lane) { return (lane >> 4) * 8; }

// -- mma.sync m16n8k16, fp32 accumulate: c += a * b --
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const u32 (&a)[4], u32 b0,
                                          u32 b1);

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&c)[4], const u32 (&a)[4],
                                                  u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&c)[4], const u32 (&a)[4],
                                                         u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace cupaged
