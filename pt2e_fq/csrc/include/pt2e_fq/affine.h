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

PT2E_FQ_HD float fake_quantize_affine_one(float x, float scale, float ioff, float foff,
                                          float qmin, float qmax, bool& in_range) {
  const float q = add_rn(round_half_even(div_rn(sub_rn(x, foff), scale)), ioff);
  in_range = (q >= qmin) & (q <= qmax);
  return add_rn(mul_rn(sub_rn(clamp_keep_nan(q, qmin, qmax), ioff), scale), foff);
}

}  // namespace pt2e_fq
