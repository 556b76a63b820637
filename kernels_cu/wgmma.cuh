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
// Shared-memory operands use a W-byte swizzle, W = 128, 64 or 32 (SW: the widest of them
// that divides the operand's contiguous extent, as CUTLASS picks them): a tile of R rows is
// stored as column blocks of W bytes (W / 2 elements) per row, R * W bytes per block, row
// after row; 16-byte chunk c of row r of a block sits at chunk c ^ ((r * W / 128) % (W / 16))
// of that row (`swizzled`: the hardware XORs byte-address bits 4.. with bits 7..). Tiles
// start 1024-byte aligned (the swizzle works on address bits).
// Descriptors (`descriptor`): start address >> 4 in bits 0-13, leading byte offset >> 4 in
// bits 16-29, stride byte offset >> 4 in bits 32-45, swizzle mode in bits 62-63 (1: 128 B,
// 2: 64 B, 3: 32 B).
//   K-major operand (rows = M or N, the 16 k-columns contiguous, e.g. Q and K for Q K^T, or
//   V^T [d][keys] for P V): stride offset 8 * W (8-row groups), leading offset unused;
//   k-step kk starts in column block 32 * kk / W, 32 * kk % W bytes into it.
//   MN-major operand (rows = k, N contiguous, e.g. V [keys][d] for P V, transpose flag set):
//   stride offset 8 * W (8-row k groups), leading offset = the column-block size (the next
//   W / 2 N-columns); k-step kk starts 16 * W * kk bytes in.
#pragma once
#include "bulk_copy.cuh"

namespace cupaged {
namespace sm90 {

typedef unsigned long long u64;

// The swizzle width of an operand whose rows hold `bytes` contiguous bytes.
__host__ __device__ constexpr int swizzle_bytes(int bytes) { return bytes % 128 == 0 ? 128 : bytes % 64 == 0 ? 64 : 32; }

// Byte offset of 16-byte chunk c of row r in a W-byte-swizzled tile of R rows.
template <int R, int W = 128>
__device__ __forceinline__ u32 swizzled(int r, int c) {
  constexpr int CPR = W / 16;  // chunks per row of a column block
  return (c / CPR) * (R * W) + r * W + (((c % CPR) ^ ((r * W / 128) % CPR)) << 4);
}

// Matrix descriptor of a W-byte-swizzled operand at shared address addr.
template <int W = 128>
__device__ __forceinline__ u64 descriptor(u32 addr, u32 leading_bytes, u32 stride_bytes) {
  constexpr u64 MODE = W == 128 ? 1 : W == 64 ? 2 : 3;
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((leading_bytes >> 4) & 0x3FFF) << 16) |
         ((u64)((stride_bytes >> 4) & 0x3FFF) << 32) | (MODE << 62);
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

// -- named barriers between warpgroups (id 0 is __syncthreads): `threads` arrivals complete
//    one; bar_arrive does not wait --
__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}

// -- per-warpgroup register budgets (sm_90a; the kernel needs a register cap at entry:
//    __launch_bounds__(threads, 1)) --
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(N)); }
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(N)); }

// Pin registers at this point of the program: reads of an accumulator after wgmma_wait
// (and writes before wgmma_fence) cannot be moved across it by the compiler.
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

// wgmma.mma_async.m64nNk16 with fp32 accumulators d[N / 2]:
//   WgmmaSS<T, N>::run: d (+)= A B, A and B from descriptors (both K-major), N = BN (Q K^T);
//   WgmmaRS<T, N>::run<TRANS_B>: d (+)= A B, A from registers, B from a descriptor, MN-major
//     (TRANS_B 1: V [keys][d]) or K-major (TRANS_B 0: V^T [d][keys]), N = D (P V).
// scale_d = 0 overwrites d (first k-step), 1 accumulates.
template <typename T, int N> struct WgmmaSS;
template <typename T, int N> struct WgmmaRS;

// Accumulator operands d[8i .. 8i + 7] (CUPAGED_WG_D<i>) and their asm names (CUPAGED_WG_R<i>);
// per N the operand list (ACC), the register list (REG) and the strings naming the operands
// that follow the N / 2 accumulators (K = N / 2: ss %K, %K+1 descriptors, %K+2 scale_d; rs
// %K..%K+3 A, %K+4 descriptor, %K+5 scale_d, %K+6 the transpose immediate).
#define CUPAGED_WG_D0 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
#define CUPAGED_WG_D1 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define CUPAGED_WG_D2 "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
#define CUPAGED_WG_D3 "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define CUPAGED_WG_D4 "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
#define CUPAGED_WG_D5 "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
#define CUPAGED_WG_D6 "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55])
#define CUPAGED_WG_D7 "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define CUPAGED_WG_D8 "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71])
#define CUPAGED_WG_D9 "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79])
#define CUPAGED_WG_D10 "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87])
#define CUPAGED_WG_D11 "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
#define CUPAGED_WG_D12 "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103])
#define CUPAGED_WG_D13 "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111])
#define CUPAGED_WG_D14 "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119])
#define CUPAGED_WG_D15 "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
#define CUPAGED_WG_R0 "%0, %1, %2, %3, %4, %5, %6, %7"
#define CUPAGED_WG_R1 "%8, %9, %10, %11, %12, %13, %14, %15"
#define CUPAGED_WG_R2 "%16, %17, %18, %19, %20, %21, %22, %23"
#define CUPAGED_WG_R3 "%24, %25, %26, %27, %28, %29, %30, %31"
#define CUPAGED_WG_R4 "%32, %33, %34, %35, %36, %37, %38, %39"
#define CUPAGED_WG_R5 "%40, %41, %42, %43, %44, %45, %46, %47"
#define CUPAGED_WG_R6 "%48, %49, %50, %51, %52, %53, %54, %55"
#define CUPAGED_WG_R7 "%56, %57, %58, %59, %60, %61, %62, %63"
#define CUPAGED_WG_R8 "%64, %65, %66, %67, %68, %69, %70, %71"
#define CUPAGED_WG_R9 "%72, %73, %74, %75, %76, %77, %78, %79"
#define CUPAGED_WG_R10 "%80, %81, %82, %83, %84, %85, %86, %87"
#define CUPAGED_WG_R11 "%88, %89, %90, %91, %92, %93, %94, %95"
#define CUPAGED_WG_R12 "%96, %97, %98, %99, %100, %101, %102, %103"
#define CUPAGED_WG_R13 "%104, %105, %106, %107, %108, %109, %110, %111"
#define CUPAGED_WG_R14 "%112, %113, %114, %115, %116, %117, %118, %119"
#define CUPAGED_WG_R15 "%120, %121, %122, %123, %124, %125, %126, %127"
#define CUPAGED_WG_ACC64 CUPAGED_WG_D0, CUPAGED_WG_D1, CUPAGED_WG_D2, CUPAGED_WG_D3
#define CUPAGED_WG_REG64 CUPAGED_WG_R0 ", " CUPAGED_WG_R1 ", " CUPAGED_WG_R2 ", " CUPAGED_WG_R3
#define CUPAGED_WG_SS64 "setp.ne.b32 p, %34, 0;\n", "}, %32, %33, p, 1, 1, 0, 0;\n"
#define CUPAGED_WG_RS64 "setp.ne.b32 p, %37, 0;\n", "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n"
#define CUPAGED_WG_ACC80 CUPAGED_WG_D0, CUPAGED_WG_D1, CUPAGED_WG_D2, CUPAGED_WG_D3, CUPAGED_WG_D4
#define CUPAGED_WG_REG80 CUPAGED_WG_R0 ", " CUPAGED_WG_R1 ", " CUPAGED_WG_R2 ", " CUPAGED_WG_R3 ", " CUPAGED_WG_R4
#define CUPAGED_WG_RS80 "setp.ne.b32 p, %45, 0;\n", "}, {%40, %41, %42, %43}, %44, p, 1, 1, %46;\n"
#define CUPAGED_WG_ACC96 CUPAGED_WG_D0, CUPAGED_WG_D1, CUPAGED_WG_D2, CUPAGED_WG_D3, CUPAGED_WG_D4, CUPAGED_WG_D5
#define CUPAGED_WG_REG96 CUPAGED_WG_R0 ", " CUPAGED_WG_R1 ", " CUPAGED_WG_R2 ", " CUPAGED_WG_R3 ", " CUPAGED_WG_R4 ", " CUPAGED_WG_R5
#define CUPAGED_WG_RS96 "setp.ne.b32 p, %53, 0;\n", "}, {%48, %49, %50, %51}, %52, p, 1, 1, %54;\n"
#define CUPAGED_WG_ACC112 CUPAGED_WG_D0, CUPAGED_WG_D1, CUPAGED_WG_D2, CUPAGED_WG_D3, CUPAGED_WG_D4, CUPAGED_WG_D5, CUPAGED_WG_D6
#define CUPAGED_WG_REG112 CUPAGED_WG_R0 ", " CUPAGED_WG_R1 ", " CUPAGED_WG_R2 ", " CUPAGED_WG_R3 ", " CUPAGED_WG_R4 ", " CUPAGED_WG_R5 ", " CUPAGED_WG_R6
#define CUPAGED_WG_RS112 "setp.ne.b32 p, %61, 0;\n", "}, {%56, %57, %58, %59}, %60, p, 1, 1, %62;\n"
#define CUPAGED_WG_ACC128 CUPAGED_WG_D0, CUPAGED_WG_D1, CUPAGED_WG_D2, CUPAGED_WG_D3, CUPAGED_WG_D4, CUPAGED_WG_D5, CUPAGED_WG_D6, CUPAGED_WG_D7
#define CUPAGED_WG_REG128 CUPAGED_WG_R0 ", " CUPAGED_WG_R1 ", " CUPAGED_WG_R2 ", " CUPAGED_WG_R3 ", " CUPAGED_WG_R4 ", " CUPAGED_WG_R5 ", " CUPAGED_WG_R6 ", " CUPAGED_WG_R7
#define CUPAGED_WG_SS128 "setp.ne.b32 p, %66, 0;\n", "}, %64, %65, p, 1, 1, 0, 0;\n"
#define CUPAGED_WG_RS128 "setp.ne.b32 p, %69, 0;\n", "}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n"
#define CUPAGED_WG_ACC256 CUPAGED_WG_D0, CUPAGED_WG_D1, CUPAGED_WG_D2, CUPAGED_WG_D3, CUPAGED_WG_D4, CUPAGED_WG_D5, CUPAGED_WG_D6, CUPAGED_WG_D7, CUPAGED_WG_D8, CUPAGED_WG_D9, CUPAGED_WG_D10, CUPAGED_WG_D11, CUPAGED_WG_D12, CUPAGED_WG_D13, CUPAGED_WG_D14, CUPAGED_WG_D15
#define CUPAGED_WG_REG256 CUPAGED_WG_R0 ", " CUPAGED_WG_R1 ", " CUPAGED_WG_R2 ", " CUPAGED_WG_R3 ", " CUPAGED_WG_R4 ", " CUPAGED_WG_R5 ", " CUPAGED_WG_R6 ", " CUPAGED_WG_R7 ", " CUPAGED_WG_R8 ", " CUPAGED_WG_R9 ", " CUPAGED_WG_R10 ", " CUPAGED_WG_R11 ", " CUPAGED_WG_R12 ", " CUPAGED_WG_R13 ", " CUPAGED_WG_R14 ", " CUPAGED_WG_R15
#define CUPAGED_WG_RS256 "setp.ne.b32 p, %133, 0;\n", "}, {%128, %129, %130, %131}, %132, p, 1, 1, %134;\n"
#define CUPAGED_WG_HEAD(PRE, POST) PRE
#define CUPAGED_WG_TAIL(PRE, POST) POST
#define CUPAGED_WG_FIRST(X) CUPAGED_WG_HEAD(X)
#define CUPAGED_WG_SECOND(X) CUPAGED_WG_TAIL(X)

#define CUPAGED_WGMMA_SS(TYPE, PTX, N)                                                           \
  template <> struct WgmmaSS<TYPE, N> {                                                          \
    static __device__ __forceinline__ void run(float (&d)[N / 2], u64 da, u64 db, int scale_d) { \
      asm volatile("{\n.reg .pred p;\n" CUPAGED_WG_FIRST(CUPAGED_WG_SS##N)                        \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX "." PTX " {"            \
                   CUPAGED_WG_REG##N CUPAGED_WG_SECOND(CUPAGED_WG_SS##N) "}\n"                   \
                   : CUPAGED_WG_ACC##N : "l"(da), "l"(db), "r"(scale_d));                        \
    }                                                                                            \
  };
#define CUPAGED_WGMMA_RS(TYPE, PTX, N)                                                           \
  template <> struct WgmmaRS<TYPE, N> {                                                          \
    template <int TRANS_B>                                                                       \
    static __device__ __forceinline__ void run(float (&d)[N / 2], const u32 (&a)[4], u64 db,     \
                                               int scale_d) {                                    \
      asm volatile("{\n.reg .pred p;\n" CUPAGED_WG_FIRST(CUPAGED_WG_RS##N)                        \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX "." PTX " {"            \
                   CUPAGED_WG_REG##N CUPAGED_WG_SECOND(CUPAGED_WG_RS##N) "}\n"                   \
                   : CUPAGED_WG_ACC##N                                                           \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d),          \
                     "n"(TRANS_B));                                                              \
    }                                                                                            \
  };

CUPAGED_WGMMA_SS(__nv_bfloat16, "bf16", 64)
CUPAGED_WGMMA_SS(__nv_bfloat16, "bf16", 128)
CUPAGED_WGMMA_RS(__nv_bfloat16, "bf16", 64)
CUPAGED_WGMMA_RS(__nv_bfloat16, "bf16", 80)
CUPAGED_WGMMA_RS(__nv_bfloat16, "bf16", 96)
CUPAGED_WGMMA_RS(__nv_bfloat16, "bf16", 112)
CUPAGED_WGMMA_RS(__nv_bfloat16, "bf16", 128)
CUPAGED_WGMMA_RS(__nv_bfloat16, "bf16", 256)
CUPAGED_WGMMA_SS(__half, "f16", 64)
CUPAGED_WGMMA_SS(__half, "f16", 128)
CUPAGED_WGMMA_RS(__half, "f16", 64)
CUPAGED_WGMMA_RS(__half, "f16", 80)
CUPAGED_WGMMA_RS(__half, "f16", 96)
CUPAGED_WGMMA_RS(__half, "f16", 112)
CUPAGED_WGMMA_RS(__half, "f16", 128)
CUPAGED_WGMMA_RS(__half, "f16", 256)

#undef CUPAGED_WGMMA_SS
#undef CUPAGED_WGMMA_RS
#undef CUPAGED_WG_FIRST
#undef CUPAGED_WG_SECOND
#undef CUPAGED_WG_HEAD
#undef CUPAGED_WG_TAIL
#undef CUPAGED_WG_D0
#undef CUPAGED_WG_D1
#undef CUPAGED_WG_D2
#undef CUPAGED_WG_D3
#undef CUPAGED_WG_D4
#undef CUPAGED_WG_D5
#undef CUPAGED_WG_D6
#undef CUPAGED_WG_D7
#undef CUPAGED_WG_D8
#undef CUPAGED_WG_D9
#undef CUPAGED_WG_D10
#undef CUPAGED_WG_D11
#undef CUPAGED_WG_D12
#undef CUPAGED_WG_D13
#undef CUPAGED_WG_D14
#undef CUPAGED_WG_D15
#undef CUPAGED_WG_R0
#undef CUPAGED_WG_R1
#undef CUPAGED_WG_R2
#undef CUPAGED_WG_R3
#undef CUPAGED_WG_R4
#undef CUPAGED_WG_R5
#undef CUPAGED_WG_R6
#undef CUPAGED_WG_R7
#undef CUPAGED_WG_R8
#undef CUPAGED_WG_R9
#undef CUPAGED_WG_R10
#undef CUPAGED_WG_R11
#undef CUPAGED_WG_R12
#undef CUPAGED_WG_R13
#undef CUPAGED_WG_R14
#undef CUPAGED_WG_R15
#undef CUPAGED_WG_ACC64
#undef CUPAGED_WG_REG64
#undef CUPAGED_WG_RS64
#undef CUPAGED_WG_SS64
#undef CUPAGED_WG_ACC80
#undef CUPAGED_WG_REG80
#undef CUPAGED_WG_RS80
#undef CUPAGED_WG_ACC96
#undef CUPAGED_WG_REG96
#undef CUPAGED_WG_RS96
#undef CUPAGED_WG_ACC112
#undef CUPAGED_WG_REG112
#undef CUPAGED_WG_RS112
#undef CUPAGED_WG_ACC128
#undef CUPAGED_WG_REG128
#undef CUPAGED_WG_RS128
#undef CUPAGED_WG_SS128
#undef CUPAGED_WG_ACC256
#undef CUPAGED_WG_REG256
#undef CUPAGED_WG_RS256

}  // namespace sm90
}  // namespace cupaged
