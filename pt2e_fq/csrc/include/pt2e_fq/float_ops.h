// Correctly rounded fp32 arithmetic shared by the CPU and CUDA kernels.
//
// Every operation here rounds once, to nearest even, exactly as IEEE 754 and
// ONNX QuantizeLinear / DequantizeLinear specify. On CUDA we call the _rn
// intrinsics, which the compiler never contracts into FMAs or replaces with
// approximate division; on the host the build passes -ffp-contract=off.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define PT2E_FQ_HD __host__ __device__ __forceinline__
#else
#define PT2E_FQ_HD inline
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

// The bits of an fp32 value and back.
PT2E_FQ_HD uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

PT2E_FQ_HD float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// bfloat16 <-> fp32 by bit manipulation, identical to c10::BFloat16
// (round to nearest even, NaN becomes the canonical 0x7FC0).
PT2E_FQ_HD float bf16_bits_to_float(uint16_t bits) {
  return bits_float(static_cast<uint32_t>(bits) << 16);
}

PT2E_FQ_HD uint16_t float_to_bf16_bits(float f) {
  uint32_t u = float_bits(f);
  if (f != f) return 0x7FC0;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace pt2e_fq
