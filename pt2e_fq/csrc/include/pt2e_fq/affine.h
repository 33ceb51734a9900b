// Integer affine fake quantization of one element: the math, once, for the
// CPU and CUDA kernels.
//
// One formula covers both formulations through an integer offset `ioff` and a
// float offset `foff`:
//   ZP:      ioff = zero_point, foff = 0
//   MINVAL:  ioff = quant_min,  foff = minval
//   q    = round_half_even((x - foff) / scale) + ioff
//   y    = (clamp(q, qmin, qmax) - ioff) * scale + foff
//   mask = qmin <= q <= qmax   (false for NaN; +-Inf saturates with mask 0)
#pragma once

#include "pt2e_fq/float_ops.h"

namespace pt2e_fq {

// Per-block qparams as fp32 arrays indexed by block (device pointers on CUDA).
// ioff == nullptr: every block uses ioff_const; foff == nullptr: 0.
struct AffineQparams {
  const float* scale;
  const float* ioff;
  const float* foff;
  float ioff_const;
  float qmin;
  float qmax;
  PT2E_FQ_HD float ioff_at(int64_t b) const { return ioff ? ioff[b] : ioff_const; }
  PT2E_FQ_HD float foff_at(int64_t b) const { return foff ? foff[b] : 0.0f; }
};

// The kernel view of per-block fp32 qparams: ZP when zero_point is given
// (or neither), MINVAL when minval is (its integer offset is quant_min).
inline AffineQparams make_affine_qparams(const float* scale, const float* zero_point,
                                         const float* minval, int64_t quant_min,
                                         int64_t quant_max) {
  return {scale,
          zero_point,
          minval,
          minval ? static_cast<float>(quant_min) : 0.0f,
          static_cast<float>(quant_min),
          static_cast<float>(quant_max)};
}

// LSQ's gradient scale for the qparams of a block of n elements,
// 1 / sqrt(n * quant_max) (Esser et al. 2020, section 2.2): in double,
// rounded once to fp32, the same bits on the host and the device.
PT2E_FQ_HD float lsq_grad_factor(int64_t block_numel, int64_t quant_max) {
  return static_cast<float>(1.0 / sqrt(static_cast<double>(block_numel) *
                                       static_cast<double>(quant_max)));
}

// The factor of the learnable op's per-block gradients: the caller's
// `value` for every block, or (lsq_default) LSQ's for each block's own
// element count, so a ragged last block gets its own, not the full blocks'.
struct GradFactor {
  bool lsq_default;
  float value;
  int64_t quant_max;
  PT2E_FQ_HD float for_block(int64_t block_numel) const {
    return lsq_default ? lsq_grad_factor(block_numel, quant_max) : value;
  }
};

PT2E_FQ_HD float fake_quantize_affine_one(float x, float scale, float ioff, float foff,
                                          float qmin, float qmax, bool& in_range) {
  const float q = add_rn(round_half_even(div_rn(sub_rn(x, foff), scale)), ioff);
  in_range = (q >= qmin) & (q <= qmax);
  return add_rn(mul_rn(sub_rn(clamp_keep_nan(q, qmin, qmax), ioff), scale), foff);
}

// LSQ / LSQ+ derivatives of one element (learnable ranges), round taken
// straight through. With v = (x - foff) / scale, r = round(v), q = r + ioff
// (bit for bit the forward's q, so the mask is the forward's mask):
//   dx      = in_range ? dy : 0            (a select: NaN dy outside gives 0)
//   dscale  = dy * (r - v)                 inside the range (LSQ)
//           = dy * (clamp(q) - ioff)       outside (the clamp limit's level)
//   outside = in_range ? 0 : dy            the offsets' derivative comes from
//             this alone: y moves by d(foff) and by -scale * d(ioff) there,
//             and not at all inside (STE), so the caller scales its per-block
//             sum by 1 (minval, LSQ+) or -scale (a float zero point).
// A non-finite x (NaN, +-Inf) contributes nothing: dx, dscale and outside
// are 0 (the observers ignore such values too; one NaN would otherwise make
// its block's d scale NaN, and the optimizer would write it into the scale).
// The d scale cases select their operands (select_bits: no branch for the
// host compiler to split the loop into), one subtraction follows.
PT2E_FQ_HD float lsq_grads_one(float x, float dy, float scale, float ioff, float foff,
                               float qmin, float qmax, float& dscale, float& outside) {
  const float v = div_rn(sub_rn(x, foff), scale);
  const float r = round_half_even(v);
  const float q = add_rn(r, ioff);
  const bool in_range = (q >= qmin) & (q <= qmax);
  const bool finite = sub_rn(x, x) == 0.0f;  // NaN for NaN and +-Inf
  // clamp_keep_nan(q, qmin, qmax), as selects.
  const float clamped = select_bits(q < qmin, qmin, select_bits(q > qmax, qmax, q));
  const float term = mul_rn(dy, sub_rn(select_bits(in_range, r, clamped), select_bits(in_range, v, ioff)));
  dscale = select_bits(finite, term, 0.0f);
  outside = select_bits(finite & !in_range, dy, 0.0f);
  return select_bits(in_range, dy, 0.0f);
}

}  // namespace pt2e_fq
