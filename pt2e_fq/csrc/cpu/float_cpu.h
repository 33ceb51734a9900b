// The CPU forward of the float-format op with static scales, shared by
// pt2e_fq::fake_quantize_float and pt2e_fq::fake_quantize_float_observe
// (whose y must be the same bits).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "pt2e_fq/block_layout.h"
#include "pt2e_fq/float_formats.h"

namespace pt2e_fq::cpu {

// (y, packed mask) of contiguous x with layout L and checked, contiguous
// fp32 scales.
std::tuple<at::Tensor, at::Tensor> float_forward(const at::Tensor& x, const BlockLayout& L,
                                                 const at::Tensor& scale, ElemFormat format);

}  // namespace pt2e_fq::cpu
