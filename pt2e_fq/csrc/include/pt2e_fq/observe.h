// Per-block math of the fused observe-and-fake-quantize ops, once for the
// CPU and CUDA kernels: the running-range update of MinMaxObserver /
// MovingAverageMinMaxObserver (observers.py) and the qparams of a range
// (format_kinds.py, qparams.py), step for step as those torch ops round, so
// the fused ops give the unfused path's bits.
#pragma once

#include <cstdint>

#include "pt2e_fq/float_ops.h"

namespace pt2e_fq {

// The smallest integer scale (torch.finfo(torch.float32).eps) and float-format
// scale (torch.finfo(torch.float32).tiny), as qparams.py floors them.
constexpr float kIntScaleEps = 1.1920928955078125e-07f;
constexpr float kFloatScaleTiny = 1.1754943508222875e-38f;

// torch's `fp32 tensor / python float`: on the CPU an IEEE division by the
// float-cast scalar; ATen's CUDA kernel multiplies by the scalar's fp32
// reciprocal instead (div_true_kernel_cuda), so the device does the same.
PT2E_FQ_HD float div_by_scalar(float a, float b) {
#if defined(__CUDA_ARCH__)
  return mul_rn(a, div_rn(1.0f, b));
#else
  return div_rn(a, b);
#endif
}

// fp32 -> uint32 in the same order (for non-NaN values), -0 below +0: flip
// every bit of a negative number, the sign bit of a positive one. The batch
// min / max of both kernels compare these (atomics on CUDA, vectorised integer
// min / max on the CPU), so they do not depend on the order of the elements,
// and a block holding both zeros has min -0 and max +0 on every device and
// thread count (torch.amin / amax return either, depending on positions and
// vector width). 0xFFFFFFFF and 0 are the images of NaNs, so they serve as
// the identities of min and max. Written without a branch, so the host
// compiler vectorises the loops that call it.
PT2E_FQ_HD uint32_t ordered(float v) {
  const uint32_t u = f32_bits(v);
  return u ^ ((0u - (u >> 31)) | 0x80000000u);
}
PT2E_FQ_HD float unordered(uint32_t u) {
  return f32_from_bits((u & 0x80000000u) ? (u & 0x7FFFFFFFu) : ~u);
}
constexpr uint32_t kMinIdentity = 0xFFFFFFFFu, kMaxIdentity = 0u;

// torch.minimum / torch.maximum: NaN in either gives NaN.
PT2E_FQ_HD float minimum_nan(float a, float b) {
  return (a != a || b != b) ? add_rn(a, b) : (b < a ? b : a);
}
PT2E_FQ_HD float maximum_nan(float a, float b) {
  return (a != a || b != b) ? add_rn(a, b) : (b > a ? b : a);
}

// How the running range takes a batch's range (both per block; a batch block
// with no finite value is the empty range (+inf, -inf)). moving == false:
// MinMaxObserver, the running minimum / maximum. moving: the exponential
// moving average (moving_average), where a block seen for the first time
// (running range empty) takes the batch's range and a batch block with no
// finite value leaves it.
struct RangeUpdate {
  bool moving;
  float c;
};

constexpr float kFloatMax = 3.4028234663852886e+38f;  // torch.finfo(torch.float32).max

// old + c * (new - old) in fp32 (c rounded to fp32), as torch's
// MovingAverageMinMaxObserver rounds it. new - old overflows where old and
// new have opposite signs and are both near the fp32 limit; then
// (old - c * old) + c * new: two terms of opposite signs, each no larger
// than old or new, whose sum cannot overflow (an Inf range would turn the
// qparams into Inf and NaN for good).
PT2E_FQ_HD float moving_average(float old, float now, float c) {
  const float d = sub_rn(now, old);
  if (fabsf(d) <= kFloatMax) return add_rn(old, mul_rn(c, d));
  return add_rn(sub_rn(old, mul_rn(c, old)), mul_rn(c, now));
}

PT2E_FQ_HD void update_range(const RangeUpdate& u, float batch_lo, float batch_hi, float& lo,
                             float& hi) {
  if (!u.moving) {
    lo = minimum_nan(lo, batch_lo);
    hi = maximum_nan(hi, batch_hi);
    return;
  }
  const bool seen = !(batch_lo > batch_hi);
  const bool fresh = lo > hi;
  if (!seen) return;
  lo = fresh ? batch_lo : moving_average(lo, batch_lo, u.c);
  hi = fresh ? batch_hi : moving_average(hi, batch_hi, u.c);
}

// The range a block's qparams come from: an empty one (lo > hi: no finite
// value seen) is [0, 0] (FormatKind.qparams_from_range).
PT2E_FQ_HD void nonempty_range(float& lo, float& hi) {
  if (lo > hi) lo = hi = 0.0f;
}

// The integer schemes of the fused affine op: symmetric, asymmetric and
// symmetric without clipping (ZP formulation; the offset is the zero point)
// and MINVAL (the offset is lo).
enum class AffineScheme : int { kSymmetric = 0, kAsymmetric = 1, kMinval = 2, kSymmetricNoClip = 3 };

struct AffineRangeParams {
  AffineScheme scheme;
  int32_t quant_min, quant_max;
  float range_limit;  // observed ranges are clamped to [-range_limit, range_limit]
};

// clamp(v, max=0) / clamp(v, min=0) as torch computes them (NaN stays).
PT2E_FQ_HD float clamp_max0(float v) { return v > 0.0f ? 0.0f : v; }
PT2E_FQ_HD float clamp_min0(float v) { return v < 0.0f ? 0.0f : v; }
PT2E_FQ_HD float clamp_min_nan(float v, float m) { return v < m ? m : v; }

// Python's floor division of ints.
PT2E_FQ_HD int32_t floor_div2(int32_t v) { return v >= 0 ? v / 2 : -((-v + 1) / 2); }

// The scale and offset of a (non-empty) range [lo, hi] (qparams.py's
// symmetric_qparams, symmetric_no_clip_qparams, asymmetric_qparams,
// minval_qparams after the int_range_limit clamp). zero_point is set for the
// ZP schemes, minval for MINVAL.
PT2E_FQ_HD void affine_qparams_from_range(const AffineRangeParams& p, float lo, float hi,
                                          float& scale, int32_t& zero_point, float& minval) {
  lo = clamp_keep_nan(lo, -p.range_limit, p.range_limit);
  hi = clamp_keep_nan(hi, -p.range_limit, p.range_limit);
  const int32_t qmin = p.quant_min, qmax = p.quant_max;
  const float levels = static_cast<float>(qmax - qmin);
  switch (p.scheme) {
    case AffineScheme::kSymmetric: {
      // (quant_max - quant_min) / 2 is a half-integer, exact in fp32.
      const float amax = maximum_nan(-clamp_max0(lo), clamp_min0(hi));
      scale = clamp_min_nan(div_by_scalar(amax, 0.5f * levels), kIntScaleEps);
      zero_point = floor_div2(qmin + qmax + 1);
      minval = 0.0f;
      return;
    }
    case AffineScheme::kSymmetricNoClip: {
      // Each side of the range onto the codes on its side of the middle one.
      const int32_t middle = floor_div2(qmin + qmax + 1);
      const float below = div_by_scalar(-clamp_max0(lo), static_cast<float>(middle - qmin));
      const float above = div_by_scalar(clamp_min0(hi), static_cast<float>(qmax - middle));
      scale = clamp_min_nan(maximum_nan(below, above), kIntScaleEps);
      zero_point = middle;
      minval = 0.0f;
      return;
    }
    case AffineScheme::kAsymmetric: {
      const float min_neg = clamp_max0(lo);
      scale = clamp_min_nan(div_by_scalar(sub_rn(clamp_min0(hi), min_neg), levels), kIntScaleEps);
      // round(min_neg / scale) lies in [-(qmax - qmin), 0] for a finite range;
      // a NaN range (a corrupt loaded state) gives a NaN scale, which the op
      // rejects, and 0 here rather than an undefined conversion.
      const float r = round_half_even(div_rn(min_neg, scale));
      const int32_t zp = qmin - (r == r ? static_cast<int32_t>(r) : 0);
      zero_point = zp < qmin ? qmin : (zp > qmax ? qmax : zp);
      minval = 0.0f;
      return;
    }
    case AffineScheme::kMinval:
      scale = clamp_min_nan(div_by_scalar(sub_rn(hi, lo), levels), kIntScaleEps);
      zero_point = 0;
      minval = lo;
      return;
  }
}

// The scale of a float format of largest value fmax for a (non-empty) range
// (qparams.float_scale).
PT2E_FQ_HD float float_scale_from_range(float lo, float hi, float fmax) {
  const float amax = maximum_nan(fabsf(lo), fabsf(hi));
  return clamp_min_nan(div_by_scalar(amax, fmax), kFloatScaleTiny);
}

}  // namespace pt2e_fq
