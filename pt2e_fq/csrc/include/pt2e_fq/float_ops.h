// Correctly rounded fp32 arithmetic shared by the CPU and CUDA kernels.
//
// Every operation here rounds once, to nearest even, exactly as IEEE 754 and
// ONNX QuantizeLinear / DequantizeLinear specify. On CUDA we call the _rn
// intrinsics, which the compiler never contracts into FMAs or replaces with
// approximate division; on the host the build passes -ffp-contract=off.
#pragma once

#include <cstdint>
#include <cmath>
#include <cstring>

// Forced inline on both sides: GCC left half_bits_to_float a call inside
// the AVX-512 clone of a loop (cpu_loops.h PT2E_FQ_CLONES), which then did
// not vectorise.
#if defined(__CUDACC__)
#define PT2E_FQ_HD __host__ __device__ __forceinline__
#else
#define PT2E_FQ_HD inline __attribute__((always_inline))
#endif

namespace pt2e_fq {

PT2E_FQ_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

PT2E_FQ_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

PT2E_FQ_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

PT2E_FQ_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

// Round half to even (the default rounding mode; rint never raises errno, so
// the host compiler vectorises it).
PT2E_FQ_HD float round_half_even(float v) {
#if defined(__CUDA_ARCH__)
  return rintf(v);
#else
  return __builtin_rintf(v);
#endif
}

// Clamp that lets NaN through (fminf/fmaxf would turn NaN into a limit).
PT2E_FQ_HD float clamp_keep_nan(float v, float lo, float hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

PT2E_FQ_HD uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

PT2E_FQ_HD float f32_from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// pick ? a : b by bit masks. GCC turns a ?: of floats whose operands feed
// later arithmetic into branches, each with its own copy of that
// arithmetic, which it vectorises only with masked instructions (AVX-512);
// integer masks keep it one select, so AVX2 loops vectorise too.
PT2E_FQ_HD float select_bits(bool pick, float a, float b) {
  const uint32_t m = 0u - static_cast<uint32_t>(pick);  // all ones or zero
  return f32_from_bits((f32_bits(a) & m) | (f32_bits(b) & ~m));
}

// IEEE half <-> fp32 with bit masks instead of branches, so the host compiler
// vectorises them; results equal c10::Half's (round to nearest even, NaN
// becomes 0x7E00 with the sign kept).
PT2E_FQ_HD float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  const uint32_t normal = ((exp + 112u) << 23) | (mant << 13);  // rebias 15 -> 127
  const uint32_t inf_nan = 0x7F800000u | (mant << 13);
  const uint32_t subnormal = f32_bits(static_cast<float>(mant) * 5.9604644775390625e-8f);  // mant * 2^-24
  const uint32_t is_inf_nan = 0u - static_cast<uint32_t>(exp == 31);  // all ones or zero
  const uint32_t is_subnormal = 0u - static_cast<uint32_t>(exp == 0);
  uint32_t bits = (normal & ~is_inf_nan) | (inf_nan & is_inf_nan);
  bits = (bits & ~is_subnormal) | (subnormal & is_subnormal);
  return f32_from_bits(bits | sign);
}

PT2E_FQ_HD uint16_t float_to_half_bits(float f) {
  const uint32_t w = f32_bits(f);
  const uint32_t twice = w + w;  // drops the sign
  const uint32_t sign = w & 0x80000000u;
  // Scaling up by 2^112 and back by 2^-110 overflows what exceeds the half
  // range to Inf and leaves the rest; adding 2^(e+1) style bias then makes
  // the fp32 adder round the mantissa to half precision (nearest even),
  // subnormals included.
  float base = (fabsf(f) * 5.192296858534828e+33f) * 7.703719777548943e-34f;
  uint32_t bias = twice & 0xFF000000u;
  bias = bias > 0x71000000u ? bias : 0x71000000u;
  base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f32_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
  const uint32_t is_nan = 0u - static_cast<uint32_t>(twice > 0xFF000000u);
  return static_cast<uint16_t>((sign >> 16) | (0x7E00u & is_nan) | (nonsign & ~is_nan));
}

// bfloat16 <-> fp32 by bit manipulation, identical to c10::BFloat16
// (round to nearest even, NaN becomes the canonical 0x7FC0). The NaN case
// is a select by mask, not a branch: a branch kept the host compiler from
// vectorising every loop that stores bf16 ("control flow in loop").
PT2E_FQ_HD float bf16_bits_to_float(uint16_t bits) {
  return f32_from_bits(static_cast<uint32_t>(bits) << 16);
}

PT2E_FQ_HD uint16_t float_to_bf16_bits(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t is_nan = 0u - static_cast<uint32_t>(f != f);  // all ones or zero
  return static_cast<uint16_t>((0x7FC0u & is_nan) | (rounded & ~is_nan));
}

}  // namespace pt2e_fq
