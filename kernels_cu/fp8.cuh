// fp8 KV-cache elements: the two formats as 1-byte types, the write's quantisation and the
// read's widening to 16-bit tensor-core operands.
//
// Prefill tiles widen whole staged chunks into 16-bit tiles (widen_chunk_shared), so that
// the tensor-core loops read the tiles a 16-bit cache gives.
//
// The rule is cupaged/reference/fp8.py's, bit for bit: y = float32(x) / scale (one IEEE
// division: the kernels build without fast math), clamped to [-max, max], rounded to the
// format to nearest with ties to even; NaN stays NaN (sign | 0x7F for e4m3, sign | 0x7E for
// e5m2, as ml_dtypes' cast gives, the sign taken from x). fp8_encode writes the conversion
// out in integer and float operations (cuda_fp8.h is not includable by every NVRTC here);
// the write kernel's words of four codes (fp8_encode4) take two cvt.rn.satfinite on sm_89+,
// the same codes (round to nearest even; satfinite maps what rounds past the largest finite
// to it, as clamping first does) but for NaN, whose word is then written out by the rule.
// Their quotients come from a reciprocal taken once per scale (fp8_quotient), the
// division's result exactly.
//
// Reading: every e4m3 and e5m2 value is exact in float16 and in bfloat16. Decode's products
// on an fp8 cache run in float16 whatever q's type (MathTypeOf; bf16 q is scaled into
// float16's range by a power of two per head, decode.cu QWords): sm_89+ converts two e4m3
// codes to a float16 pair in one cvt.rn.f16x2.e4m3x2, an e5m2 code is the top byte of its
// float16 (one prmt a pair); sm_80 widens e4m3 by bits (below). Prefill widens to T by
// placing a code's bits in a 16-bit word and multiplying by a power of two (one
// fma.rn.f16x2 / bf16x2 with a -0 addend, a product: sm_80 has no bf16x2 mul; subnormals
// included; e5m2 into float16 needs none). The scale is applied in fp32 by the kernels
// (scores and outputs), never to the elements. NaN and infinity codes (never written for
// non-NaN input) do not read back as NaN or infinity by bits (the cvt keeps them).
#pragma once
#include "common.cuh"
#include "abi.cuh"

namespace cupaged {

// The formats as element types of a cache (1 byte each, distinct for templates).
struct fp8_e4m3 { unsigned char bits; };
struct fp8_e5m2 { unsigned char bits; };

// The formats' constants come from cupaged.core.fp8 (abi.cuh): FP8_<FORMAT>_MANT, _BIAS,
// _MAX and _NAN (the low 7 bits of the code NaN takes).
template <typename KV> struct Fp8Traits { static constexpr bool FP8 = false; };
template <> struct Fp8Traits<fp8_e4m3> {
  static constexpr bool FP8 = true;
  static constexpr int M = FP8_E4M3_MANT, BIAS = FP8_E4M3_BIAS;  // mantissa bits, exponent bias
  static constexpr u32 NAN_CODE = FP8_E4M3_NAN;
  __device__ static float max_finite() { return FP8_E4M3_MAX; }
};
template <> struct Fp8Traits<fp8_e5m2> {
  static constexpr bool FP8 = true;
  static constexpr int M = FP8_E5M2_MANT, BIAS = FP8_E5M2_BIAS;
  static constexpr u32 NAN_CODE = FP8_E5M2_NAN;
  __device__ static float max_finite() { return FP8_E5M2_MAX; }
};

// One operand's scale: a device float32 array (kv head h at p[stride * h]; stride 0: one
// value for every head) or, with p null, the host's value.
__device__ __forceinline__ float kv_scale(const float* __restrict__ p, int stride, float value,
                                          int h) {
  return p != nullptr ? __ldg(p + (i64)stride * h) : value;
}

// The code of x / scale (the rule above).
template <typename KV>
__device__ __forceinline__ u32 fp8_encode(float x, float scale) {
  using F = Fp8Traits<KV>;
  const float y = x / scale;
  const u32 sign = (__float_as_uint(x) >> 24) & 0x80u;
  if (y != y) return sign | F::NAN_CODE;
  const float a = fminf(fabsf(y), F::max_finite());
  u32 mag;
  if (a < __uint_as_float((u32)(127 + 1 - F::BIAS) << 23)) {  // subnormal: a / min_subnormal
    mag = (u32)__float2int_rn(a * __uint_as_float((u32)(127 + F::BIAS - 1 + F::M) << 23));
  } else {  // round float32's mantissa to M bits (a carry moves into the exponent), rebias
    constexpr int S = 23 - F::M;
    const u32 u = __float_as_uint(a);
    mag = ((u + ((1u << (S - 1)) - 1u) + ((u >> S) & 1u)) >> S) - ((u32)(127 - F::BIAS) << F::M);
  }
  return sign | mag;
}

// x / scale as the IEEE division rounds it, from r = 1 / scale (rounded) taken once per
// scale: q = x * r, then one correction by the residual q * scale - x, which an fma gives
// exactly. That is the division's result (Markstein's theorem) for a scale whose
// significand is not all ones (fp8_reciprocal_exact), while residual and quotient stay
// normal: scales in [2^-60, 2^60] and quotients of at least 2^-18 (smaller ones are codes
// of zero in both formats; the correction's addends keep x's sign, -0 included). Infinite
// or NaN x, and a product past float32's range, come out NaN (infinity minus infinity):
// fp8_encode4 then takes the rule's codes.
__device__ __forceinline__ bool fp8_reciprocal_exact(float scale) {
  return scale >= 0x1p-60f && scale <= 0x1p60f && (__float_as_uint(scale) & 0x7FFFFFu) != 0x7FFFFFu;
}

__device__ __forceinline__ float fp8_quotient(float x, float scale, float r) {
  const float q = x * r;
  return fmaf(-fmaf(q, scale, -x), r, q);
}

// The codes of x[0..3] / scale as one word (x[0] in the low byte), as fp8_encode gives
// them; RECIPROCAL: the quotients by fp8_quotient with r = 1 / scale (callers check
// fp8_reciprocal_exact), else by division.
template <typename KV, bool RECIPROCAL>
__device__ __forceinline__ u32 fp8_encode4(const float (&x)[4], float scale, float r) {
#if __CUDA_ARCH__ >= 890
  float y[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) y[i] = RECIPROCAL ? fp8_quotient(x[i], scale, r) : x[i] / scale;
  unsigned short h[2];  // cvt packs its first source into the high byte
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if constexpr (Fp8Traits<KV>::M == 3)
      asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(h[i]) : "f"(y[2 * i + 1]), "f"(y[2 * i]));
    else
      asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;\n" : "=h"(h[i]) : "f"(y[2 * i + 1]), "f"(y[2 * i]));
  }
  const u32 w = h[0] | ((u32)h[1] << 16);
  // satfinite gives a finite code below LOW in its low 7 bits for every non-NaN quotient
  // (e4m3: 0x7F is NaN; e5m2: 0x7C..0x7F are infinity and NaN): a byte reaching LOW
  // there marks a NaN quotient, and the rule gives the word's codes
  constexpr u32 LOW = Fp8Traits<KV>::M == 3 ? 0x7Fu : 0x7Cu;
  if (!(((w & 0x7F7F7F7Fu) + (0x80u - LOW) * 0x01010101u) & 0x80808080u)) return w;
#endif
  return fp8_encode<KV>(x[0], scale) | (fp8_encode<KV>(x[1], scale) << 8) |
         (fp8_encode<KV>(x[2], scale) << 16) | (fp8_encode<KV>(x[3], scale) << 24);
}

// A cache element from a value of type T: the value itself for a 16/32-bit cache, its code
// for an fp8 one.
template <typename KV, typename T>
__device__ __forceinline__ KV to_cache(T x, float scale) {
  if constexpr (Fp8Traits<KV>::FP8) return KV{(unsigned char)fp8_encode<KV>(to_float<T>(x), scale)};
  else return x;
}

// Bit patterns of the 16-bit types (for the widening multipliers).
template <typename T> struct Bits16;
template <> struct Bits16<__half> { static constexpr int MANT = 10, BIAS = 15; };
template <> struct Bits16<__nv_bfloat16> { static constexpr int MANT = 7, BIAS = 127; };

template <typename T> __device__ __forceinline__ u32 mul2(u32 a, u32 b);
template <> __device__ __forceinline__ u32 mul2<__half>(u32 a, u32 b) {
  u32 d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}
template <> __device__ __forceinline__ u32 mul2<__nv_bfloat16>(u32 a, u32 b) {
  u32 d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

// Two fp8 codes held as x = [0, c0, 0, c1] (each in the high byte of a 16-bit half) -> two
// T values (c0 low), exact: sign to bit 15, exponent and mantissa moved under T's, then
// times 2^(bias_T - bias_8).
template <typename T, typename KV>
__device__ __forceinline__ u32 widen_fp8x2(u32 x) {
  using F = Fp8Traits<KV>;
  using B = Bits16<T>;
  constexpr int S = 8 - (B::MANT - F::M);  // right shift of the high byte's magnitude bits
  constexpr u32 MAG = (0x7F00u >> S) * 0x10001u;
  const u32 w = (x & 0x80008000u) | ((x >> S) & MAG);
  constexpr u32 POW = (u32)(B::BIAS - F::BIAS + B::BIAS) << B::MANT;  // 2^(bias_T - bias_8)
  if constexpr (POW == ((u32)B::BIAS << B::MANT)) return w;           // a factor of 1
  else return mul2<T>(w, POW * 0x10001u);
}

// Four codes (bytes of v) -> words lo (codes 0, 1) and hi (codes 2, 3) of T pairs.
template <typename T, typename KV>
__device__ __forceinline__ void widen_fp8x4(u32 v, u32& lo, u32& hi) {
  lo = widen_fp8x2<T, KV>(__byte_perm(v, 0u, 0x1404));
  hi = widen_fp8x2<T, KV>(__byte_perm(v, 0u, 0x3424));
}

// Two codes in the low 16 bits of v -> one word of two T values.
template <typename T, typename KV>
__device__ __forceinline__ u32 widen_fp8x2_low(u32 v) {
  return widen_fp8x2<T, KV>(__byte_perm(v, 0u, 0x1404));
}

// ---- decode's products on fp8 caches run in float16, whatever q's type (bf16 q is scaled
// into float16's range by the kernel, decode.cu PageMath): every e4m3 and e5m2 value is a
// float16 value, and sm_89+ converts two e4m3 codes in one cvt.
template <typename T, typename KV> struct MathTypeOf { using type = T; };
template <typename T> struct MathTypeOf<T, fp8_e4m3> { using type = __half; };
template <typename T> struct MathTypeOf<T, fp8_e5m2> { using type = __half; };

// Whether a code is the top byte of the float16 of its value (e5m2: float16's sign,
// exponent and bias with 2 of its 10 mantissa bits).
template <typename KV>
__device__ __forceinline__ constexpr bool half_top_byte() {
  return Fp8Traits<KV>::M == Bits16<__half>::MANT - 8 && Fp8Traits<KV>::BIAS == Bits16<__half>::BIAS;
}

// Four codes (bytes of v) -> float16 pairs lo (codes 0, 1) and hi (codes 2, 3), exact: e4m3
// by cvt.rn.f16x2.e4m3x2 (sm_89+; the low code to the low half), e5m2 by placing each code
// in the high byte of a half (e5m2 is float16's top byte).
template <typename KV>
__device__ __forceinline__ void fp8x4_to_half2(u32 v, u32& lo, u32& hi) {
  if constexpr (half_top_byte<KV>()) {
    lo = __byte_perm(v, 0u, 0x1404);
    hi = __byte_perm(v, 0u, 0x3424);
  } else {
#if __CUDA_ARCH__ >= 890
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\n"
        "cvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
        : "=r"(lo), "=r"(hi) : "r"(v));
#else
    widen_fp8x4<__half, KV>(v, lo, hi);
#endif
  }
}

// Two codes in the low 16 bits of v -> one float16 pair (code 0 low).
template <typename KV>
__device__ __forceinline__ u32 fp8x2_to_half2(u32 v) {
  if constexpr (half_top_byte<KV>()) {
    return __byte_perm(v, 0u, 0x1404);
  } else {
#if __CUDA_ARCH__ >= 890
    u32 d;
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %1;\ncvt.rn.f16x2.e4m3x2 %0, l;\n}\n"
        : "=r"(d) : "r"(v));
    return d;
#else
    return widen_fp8x2_low<__half, KV>(v);
#endif
  }
}

// A 16-byte chunk of cache elements as tensor-core words of M pairs (M: MathTypeOf): W = 4
// words as read for a 16-bit cache, 8 words converted for an fp8 one (codes 2i, 2i + 1 in
// word i, M = float16). pair(u) gives words 2u and 2u + 1, converted only when asked
// (fewer registers live at once).
template <typename KV>
struct MathWords {
  static constexpr int W = Fp8Traits<KV>::FP8 ? 8 : 4;
  __device__ static __forceinline__ void pair(const u32 (&raw)[4], int u, u32& a, u32& b) {
    if constexpr (Fp8Traits<KV>::FP8) {
      fp8x4_to_half2<KV>(raw[u], a, b);
    } else {
      a = raw[2 * u];
      b = raw[2 * u + 1];
    }
  }
};

// The bits of one code as a T value (element copies of a tile).
template <typename T, typename KV>
__device__ __forceinline__ unsigned short widen_fp8(unsigned char code) {
  return (unsigned short)(widen_fp8x2_low<T, KV>(code) & 0xFFFFu);
}

// A staged 16-byte chunk of 16 codes at shared address `from` -> 16 T values, exact: codes
// 0-7 as the 16-byte chunk at shared address lo, 8-15 at hi. With hi_first the hi chunk is
// stored by the first of the two stores (callers pick it per thread so that the lanes of
// each store hit distinct bank quads). Without `keep` the chunk is stored as zeros,
// whatever codes it holds (a key past kv_len: its codes may be NaN's).
template <typename T, typename KV>
__device__ __forceinline__ void widen_chunk_shared(u32 from, u32 lo, u32 hi, bool hi_first, bool keep = true) {
  u32 r[4], w[8];
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(from) : "memory");
#pragma unroll
  for (int i = 0; i < 4; ++i) r[i] = keep ? r[i] : 0u;  // code 0 widens to +0
  const u32 x[4] = {hi_first ? r[2] : r[0], hi_first ? r[3] : r[1], hi_first ? r[0] : r[2],
                    hi_first ? r[1] : r[3]};
#pragma unroll
  for (int i = 0; i < 4; ++i) widen_fp8x4<T, KV>(x[i], w[2 * i], w[2 * i + 1]);
  const u32 first = hi_first ? hi : lo, second = hi_first ? lo : hi;
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n"
               :: "r"(first), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]) : "memory");
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n"
               :: "r"(second), "r"(w[4]), "r"(w[5]), "r"(w[6]), "r"(w[7]) : "memory");
}

}  // namespace cupaged
