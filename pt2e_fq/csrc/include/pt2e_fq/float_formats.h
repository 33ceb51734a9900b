// Floating-point fake quantization: the element formats FP8 E4M3 (fn), FP8
// E5M2 and FP4 E2M1, the E8M0 block scale of MX and the E4M3 block scale of
// NVFP4. The math, once, for the CPU and CUDA kernels.
//
// Rounding is done with exact arithmetic, not a table: for |v| in binade
// [2^e, 2^(e+1)) the format's grid step is 2^(max(e, emin) - mbits), and
//   round(v) = rint(v / step) * step
// where both scalings by a power of two are exact, so rint (to nearest, ties
// to even) is the only rounding. Subnormals of the format are the binades
// below emin, which share emin's step.
//
// Element fake quantization (static scale, MX and NVFP4 alike):
//   v    = x / scale                      (IEEE division, fp32)
//   y    = cast_rne(clamp(v, -fmax, fmax)) * scale
//   mask = |v| <= fmax                    (false for NaN and +-Inf)
// NaN gives NaN; +-Inf saturates to +-fmax * scale.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "pt2e_fq/float_ops.h"

namespace pt2e_fq {

enum class ElemFormat : int { kE4M3 = 0, kE5M2 = 1, kE2M1 = 2 };

// mbits: mantissa bits; emin: exponent of the smallest normal; emax: exponent
// of the largest normal (OCP MX's emax_elem); fmax: largest finite value.
// None of the three formats has infinities; E4M3 (fn) keeps 0x7F/0xFF for
// NaN, so its fmax is 1.75 * 2^8 rather than 1.875 * 2^8.
template <ElemFormat F>
struct Elem;
template <>
struct Elem<ElemFormat::kE4M3> {
  static constexpr int mbits = 3, emin = -6, emax = 8;
  static constexpr float fmax = 448.0f;
};
template <>
struct Elem<ElemFormat::kE5M2> {
  static constexpr int mbits = 2, emin = -14, emax = 15;
  static constexpr float fmax = 57344.0f;
};
template <>
struct Elem<ElemFormat::kE2M1> {
  static constexpr int mbits = 1, emin = 0, emax = 2;
  static constexpr float fmax = 6.0f;
};

// 2^k for -126 <= k <= 127 (normal numbers), built from its bits.
PT2E_FQ_HD float exp2_normal(int k) { return f32_from_bits(static_cast<uint32_t>(k + 127) << 23); }

// 2^k for -149 <= k <= 127, subnormals included (E8M0 reaches 2^-127).
PT2E_FQ_HD float exp2_exact(int k) {
  return k >= -126 ? exp2_normal(k) : f32_from_bits(1u << (k + 149));
}

// v rounded to the grid of format F, to nearest, ties to even, with the
// format's subnormals. Values beyond fmax round onto the grid continued
// upwards (the caller saturates); +-Inf and NaN pass through; the sign of
// zero is kept.
template <ElemFormat F>
PT2E_FQ_HD float round_to_elem(float v) {
  using E = Elem<F>;
  // Unbiased exponent of v, limited to [emin, emax + 1]: zero, fp32
  // subnormals (-127) and every |v| < 2^emin take the step of the format's
  // subnormals; beyond emax + 1 (up to 128 for Inf and NaN) any step would
  // do since the caller saturates, and the cap keeps 2^-step normal.
  int e = static_cast<int>((f32_bits(v) >> 23) & 0xFFu) - 127;
  e = e < E::emin ? E::emin : (e > E::emax + 1 ? E::emax + 1 : e);
  const int step = e - E::mbits;
  // For |v| <= fmax both products are exact: v / 2^step lies in
  // [0, 2^(mbits+1)) and is normal or an exactly scaled fp32 subnormal, and
  // the result is on the grid.
  return mul_rn(round_half_even(mul_rn(v, exp2_normal(-step))), exp2_normal(step));
}

// Saturating cast to format F and back: values beyond +-fmax (and +-Inf)
// become +-fmax; NaN stays NaN. Rounding first and clamping after gives the
// same result (rounding is monotonic and fmax is on the grid) and, unlike
// the other order, lets the compiler vectorise the loop.
template <ElemFormat F>
PT2E_FQ_HD float cast_rne_sat(float v) {
  return clamp_keep_nan(round_to_elem<F>(v), -Elem<F>::fmax, Elem<F>::fmax);
}

// Fake quantization of one element with a positive fp32 scale.
template <ElemFormat F>
PT2E_FQ_HD float fake_quantize_float_one(float x, float scale, bool& in_range) {
  const float v = div_rn(x, scale);
  in_range = (v >= -Elem<F>::fmax) & (v <= Elem<F>::fmax);
  return mul_rn(cast_rne_sat<F>(v), scale);
}

// Block amax as integers: the bits of |v| order like the values, and every
// NaN is above +Inf (0x7F800000), so max over abs_bits finds the amax and
// tells whether the block holds a NaN, with integer max (vectorisable).
PT2E_FQ_HD uint32_t abs_bits(float v) { return f32_bits(v) & 0x7FFFFFFFu; }

PT2E_FQ_HD float amax_from_bits(uint32_t max_abs_bits) {
  return max_abs_bits > 0x7F800000u ? f32_from_bits(0x7FC00000u) : f32_from_bits(max_abs_bits);
}

// ---------------------------------------------------------------------------
// MX (OCP Microscaling Formats v1.0, section 6.3): per block of k elements,
//   X = 2^(floor(log2(max_i |V_i|)) - emax_elem)
// as an E8M0 value, whose exponents span [-127, 127] (0xFF is NaN). An
// all-zero block has log2(0) = -inf and takes 2^-127; a block with +-Inf takes
// 2^127; a block with NaN gets a NaN scale, so all of it is NaN.

template <ElemFormat F>
PT2E_FQ_HD float mx_block_scale(float amax) {
  if (amax != amax) return amax;
  const int field = static_cast<int>((f32_bits(amax) >> 23) & 0xFFu);
  // floor(log2(amax)) is field - 127 for a normal amax. Zero and fp32
  // subnormals (field 0) are below 2^-126, so they clamp to -127 as their
  // true floor(log2) would; Inf (field 255) clamps to 127.
  int shared = field == 0xFF ? 127 : field - 127 - Elem<F>::emax;
  shared = shared < -127 ? -127 : (shared > 127 ? 127 : shared);
  return exp2_exact(shared);
}

// ---------------------------------------------------------------------------
// NVFP4: E2M1 elements in blocks of 16, each block with an E4M3 decode scale
// under an fp32 per-tensor decode scale g (NVIDIA's two-level scaling, as in
// TransformerEngine's NVFP4 recipe and torchao's nvfp4_quantize):
//   g   = amax(|x|) / (448 * 6)     unless given; 1 when that is 0 or Inf
//   s_b = e4m3_rne_sat(amax_b / 6 / g)
//   the element scale is the fp32 product s_b * g (what an ONNX
//   DequantizeLinear of s_b with scale g yields), and the elements are
//   fake-quantized to E2M1 with it like any float format.
// A block whose scale is 0 (max |x| below about 6 * 2^-10 * g) becomes zero
// with mask 1: nothing in it was clamped.

constexpr float kNvfp4E4M3Max = 448.0f;
constexpr float kNvfp4E2M1Max = 6.0f;

PT2E_FQ_HD float nvfp4_global_scale(float amax) {
  const float g = div_rn(amax, kNvfp4E4M3Max * kNvfp4E2M1Max);
  // An all-zero tensor (or one whose amax underflows) and a tensor with
  // +-Inf have no usable global scale; TransformerEngine uses 1 for both.
  // NaN stays NaN.
  return (g == 0.0f || g > 3.40282347e+38f) ? 1.0f : g;
}

PT2E_FQ_HD float nvfp4_block_scale(float amax_b, float global_scale) {
  return cast_rne_sat<ElemFormat::kE4M3>(div_rn(div_rn(amax_b, kNvfp4E2M1Max), global_scale));
}

// The fp32 scale a block's E2M1 elements are divided by: s_b * g. Where that
// is 0 the block dequantizes to 0 whatever its elements (q * 0); dividing
// its (finite, tiny) elements by FLT_MAX instead of 0 yields exactly that,
// signed zeros with mask 1, rather than 0 / 0 = NaN. TransformerEngine's
// reciprocal saturates to FLT_MAX the same way.
PT2E_FQ_HD float nvfp4_element_scale(float block_scale, float global_scale) {
  const float s = mul_rn(block_scale, global_scale);
  return s == 0.0f ? 3.40282347e+38f : s;
}

// Calls fn(std::integral_constant<ElemFormat, F>{}) so kernels are compiled
// once per element format (host code).
template <typename Fn>
void dispatch_elem_format(ElemFormat f, const Fn& fn) {
  switch (f) {
    case ElemFormat::kE4M3:
      return fn(std::integral_constant<ElemFormat, ElemFormat::kE4M3>{});
    case ElemFormat::kE5M2:
      return fn(std::integral_constant<ElemFormat, ElemFormat::kE5M2>{});
    case ElemFormat::kE2M1:
      return fn(std::integral_constant<ElemFormat, ElemFormat::kE2M1>{});
  }
}

}  // namespace pt2e_fq
